"""OOMRecovery under a real Lightning Trainer with what some modules and callbacks add: SWA's
BatchNorm epoch, which runs no backward; tensors returned beside the loss; a loss of shape (1,)."""

from __future__ import annotations

import dataclasses
import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from koila_retry.testing import SimulatedDevice, simulated_device

L = pytest.importorskip("lightning")
from _layers import Marked, Marker  # noqa: E402
from _lightning_trainer import (  # noqa: E402
    FIT_LIMIT,
    MLP,
    NOTICES,
    assert_same_parameters,
    loader,
    quiet,  # noqa: F401 (autouse: Lightning's warnings off)
    trainer,
)
from lightning.pytorch.callbacks import StochasticWeightAveraging  # noqa: E402

from koila_retry.integrations.lightning import OOMRecovery  # noqa: E402

pytestmark = NOTICES


class Normed(L.LightningModule):  # type: ignore[misc]
    """An MLP with BatchNorm that counts the backward passes run while the loop skips its backward.

    With ``ballast``, a step whose backward is skipped holds that many float64 numbers per row
    through its forward: more than the device has for the whole batch, not for half of it.
    """

    def __init__(self, ballast: int = 0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 512), torch.nn.BatchNorm1d(512), torch.nn.ReLU(), torch.nn.Linear(512, 4)
        ).double()
        self.ballast, self.unbacked, self.rows = ballast, 0, []
        self.net[3].register_full_backward_hook(lambda *_: self._backward_ran())

    def _backward_ran(self) -> None:
        if self.trainer.fit_loop._skip_backward:
            self.unbacked += 1

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        held = None
        if self.trainer.fit_loop._skip_backward:
            self.rows.append(len(x))
            held = torch.zeros(len(x), self.ballast, dtype=torch.float64)
        loss = F.cross_entropy(self.net(x), y)
        del held
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Peaks(L.Callback):  # type: ignore[misc]
    """The device's peak over the training epochs, and over the epoch whose backward the loop skips."""

    def __init__(self, device: SimulatedDevice) -> None:
        self.device, self.training, self.unbacked = device, 0, 0

    def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
        if trainer.fit_loop._skip_backward:  # set by the SWA callback's hook, which runs before this one
            self.training = self.device.peak
            self.device.reset_peak()

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        if trainer.fit_loop._skip_backward:
            self.unbacked = self.device.peak


def swa_fit(*callbacks: Any, limit: int | str = "1GiB", ballast: int = 0) -> tuple[Normed, Peaks, Any]:
    """Fit two epochs and SWA's BatchNorm epoch, on a simulated device."""
    model = Normed(ballast)
    with simulated_device(limit) as device:
        peaks = Peaks(device)
        swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)
        fitted = trainer(swa, peaks, *callbacks, max_epochs=2, max_steps=-1)
        fitted.fit(model, loader(rows=128))
    return model, peaks, device


def assert_same_state(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    for (name, value), (_, expected) in zip(model.state_dict().items(), reference.state_dict().items(), strict=True):
        assert torch.equal(value, expected), name


def test_swa_s_batchnorm_epoch_runs_whole_with_no_backward_and_the_plain_peak() -> None:
    reference, plain, _ = swa_fit()
    events: list[Any] = []
    model, peaks, _ = swa_fit(OOMRecovery(on_oom=events.append))
    assert not events
    assert reference.unbacked == 0
    assert model.unbacked == 0  # a backward per step, the whole batch's, ran before
    assert reference.rows == model.rows == [64, 64]
    assert 0 < peaks.unbacked <= plain.unbacked
    assert_same_state(model, reference)

    # Where the plain trainer fits, and the training epochs with OOMRecovery do, the BatchNorm epoch does too:
    # its running statistics are the whole batches', as the plain trainer's.
    limit = max(plain.training, plain.unbacked, peaks.training)
    reference, _, _ = swa_fit(limit=limit)
    model, _, _ = swa_fit(OOMRecovery(on_oom=events.append), limit=limit)
    assert not events
    assert_same_state(model, reference)


def test_swa_s_batchnorm_epoch_that_runs_out_of_memory_runs_in_micro_batches_with_no_backward() -> None:
    reference, plain, _ = swa_fit()
    _, recovering, _ = swa_fit(OOMRecovery())
    limit = max(plain.training, recovering.training)  # the training epochs fit whole
    with pytest.raises(torch.OutOfMemoryError):
        swa_fit(limit=limit, ballast=1024)

    events: list[Any] = []
    model, _, _ = swa_fit(OOMRecovery(on_oom=events.append), limit=limit, ballast=1024)
    assert [event.batch_size for event in events] == [64]
    assert model.rows == [64, 32, 32, 32, 32]  # the whole batch failed once: the size is remembered
    assert model.unbacked == 0
    # No gradient written: .grad holds the last training step's, as the plain trainer leaves it.
    for parameter, expected in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(parameter.grad, expected.grad, rtol=1e-12, atol=1e-12)
    assert_same_parameters(model, reference, rtol=1e-12, atol=1e-12)


@dataclasses.dataclass
class Extra:
    logits: torch.Tensor
    name: str = "logits"


WRAPS: dict[str, Callable[[torch.Tensor], Any]] = {
    "tensor": lambda logits: logits,
    "dataclass": Extra,
    "nested": lambda logits: [{"inner": (logits, "label")}, Extra(logits)],
}


class WithLogits(MLP):
    """Returns its logits, with their graph, beside the loss; notes whether an earlier call's graph is alive."""

    def __init__(self, wrap: str = "tensor") -> None:
        super().__init__()
        self.wrap = WRAPS[wrap]
        self.graphs: list[weakref.ref[Marker]] = []
        self.alive: list[bool] = []
        self.rows: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        gc.collect()
        self.alive.append(any(graph() is not None for graph in self.graphs))
        self.rows.append(len(x))
        marker = Marker()
        self.graphs.append(weakref.ref(marker))
        logits = self.net[2](self.net[1](Marked.apply(self.net[0](x), marker)))
        return {"loss": F.cross_entropy(logits, y), "logits": self.wrap(logits)}


@pytest.mark.parametrize("wrap", list(WRAPS))
def test_the_graph_of_a_whole_step_whose_backward_failed_is_gone_while_its_micro_batches_run(wrap: str) -> None:
    # In a dataclass too: flattened, it is one leaf, which held the graph.
    reference = WithLogits(wrap)
    trainer(max_steps=2).fit(reference, loader(rows=128))

    events: list[Any] = []
    model = WithLogits(wrap)
    # The whole batch's forward fits, and Lightning's backward of it runs out of memory; micro-batches
    # of 32 rows fit, with nothing of that graph alive.
    with simulated_device("700KiB"):
        trainer(OOMRecovery(minimum=32, on_oom=events.append), max_steps=2).fit(model, loader(rows=128))
    assert [event.batch_size for event in events] == [64]
    assert model.rows == [64, 32, 32, 32, 32]
    assert not any(model.alive), model.alive
    assert_same_parameters(model, reference, rtol=1e-12, atol=1e-12)


class Outputs(L.Callback):  # type: ignore[misc]
    """Keeps what each training step's output holds under ``key``, as on_train_batch_end gets it."""

    def __init__(self, key: str = "logits") -> None:
        self.key = key
        self.seen: list[Any] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, *args: Any) -> None:
        self.seen.append(outputs[self.key])


def test_a_step_that_runs_whole_hands_lightning_its_other_outputs_detached() -> None:
    plain, recovering = Outputs(), Outputs()
    trainer(plain, max_steps=2).fit(WithLogits(), loader(rows=128))
    trainer(recovering, OOMRecovery(), max_steps=2).fit(WithLogits(), loader(rows=128))
    assert [logits.grad_fn is not None for logits in plain.seen] == [True, True]
    assert [logits.grad_fn is not None for logits in recovering.seen] == [False, False]
    for logits, expected in zip(recovering.seen, plain.seen, strict=True):
        torch.testing.assert_close(logits, expected.detach(), rtol=0, atol=0)


@dataclasses.dataclass
class Scaled:
    """Scales its logits as it is made, and holds a field the step sets after."""

    logits: torch.Tensor
    temperature: float = 2.0
    probs: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.logits = self.logits / self.temperature


class WithScaled(MLP):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        logits = self.net(x)
        extra = Scaled(logits)
        extra.probs = extra.logits.softmax(1)
        return {"loss": F.cross_entropy(logits, y), "extra": extra}


def test_a_dataclass_among_the_outputs_is_copied_as_it_is_not_made_again() -> None:
    # Remade through its __init__, it ran __post_init__ again (the logits scaled twice) and lost the
    # field the step set after.
    plain, recovering = Outputs("extra"), Outputs("extra")
    trainer(plain, max_steps=2).fit(WithScaled(), loader(rows=128))
    trainer(recovering, OOMRecovery(), max_steps=2).fit(WithScaled(), loader(rows=128))
    for mine, theirs in zip(recovering.seen, plain.seen, strict=True):
        assert mine.logits.grad_fn is None
        assert mine.probs.grad_fn is None
        torch.testing.assert_close(mine.logits, theirs.logits.detach(), rtol=0, atol=0)
        torch.testing.assert_close(mine.probs, theirs.probs.detach(), rtol=0, atol=0)


class ShapedOne(MLP):
    """Returns its loss with shape (1,), not ()."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return F.cross_entropy(self.net(x), y).reshape(1)


class ShapedOneOwnBackward(ShapedOne):
    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        loss.backward(*args, **kwargs)


@pytest.mark.parametrize(
    ("module", "accumulate_grad_batches", "initial", "limit"),
    [(ShapedOne, 2, 32, None), (ShapedOne, 2, None, FIT_LIMIT), (ShapedOneOwnBackward, 1, 32, None)],
)
def test_a_loss_of_shape_one_trains_as_without_the_callback(
    module: type[MLP], accumulate_grad_batches: int, initial: int | None, limit: str | None
) -> None:
    reference = module()
    trainer(accumulate_grad_batches=accumulate_grad_batches).fit(reference, loader(rows=256))
    events: list[Any] = []
    model = module()
    fitted = trainer(
        OOMRecovery(initial=initial, on_oom=events.append), accumulate_grad_batches=accumulate_grad_batches
    )
    with simulated_device(limit or "1GiB"):
        fitted.fit(model, loader(rows=256))
    assert bool(events) == (limit is not None)
    assert_same_parameters(model, reference, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- a step that keeps its error


class KeepsErrors(MLP):
    """Keeps each out-of-memory error of its training step or its loss's backward, as a report might."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where, self.errors = where, []
        self.activations: list[weakref.ref[torch.Tensor]] = []
        # What the graph saves: ReLU its output, the last layer its input.
        self.net[0].register_forward_hook(lambda module, inputs, output: self.activations.append(weakref.ref(output)))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        try:
            output = super().training_step(batch, batch_idx)
        except torch.OutOfMemoryError as error:
            if self.where == "step":
                self.errors.append(error)
            raise
        if self.where == "backward":  # a backward that needs 16 KiB a row more: the whole batch's fails
            rows = len(batch[0])

            def heavy(gradient: torch.Tensor) -> None:
                try:
                    torch.empty(rows, 2048, dtype=torch.float64)
                except torch.OutOfMemoryError as error:
                    self.errors.append(error)
                    raise

            output["loss"].register_hook(heavy)
            self.activations.append(weakref.ref(output["loss"]))  # which holds the graph
        return output


@pytest.mark.parametrize(("where", "limit"), [("step", FIT_LIMIT), ("backward", "1100KiB")])
def test_a_step_that_keeps_its_error_keeps_nothing_of_the_attempt_that_ran_whole(where: str, limit: str) -> None:
    # The error of the step that ran whole was kept with its frames: their locals held that attempt's
    # activations (and a backward's, its graph) through the micro-batches, which then ran out of memory too.
    reference = MLP()
    trainer(max_steps=2).fit(reference, loader(rows=128))
    model = KeepsErrors(where)
    with simulated_device(limit):
        trainer(OOMRecovery(), max_steps=2).fit(model, loader(rows=128))
    assert model.errors, "the whole batch ran out of memory"
    assert [reference() for reference in model.activations] == [None] * len(model.activations)
    assert_same_parameters(model, reference)
