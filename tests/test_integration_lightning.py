"""koila_retry.integrations.lightning.OOMRecovery under a real Lightning Trainer, on a simulated device."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import io
import json
import signal
import subprocess
import sys
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import default_collate

import koila_retry as koila
from koila_retry import BatchSizeExhausted
from koila_retry.testing import make_oom, simulated_device

L = pytest.importorskip("lightning")
from _layers import Marked, Marker, OOMInBackward, RaiseInBackward, WatchFreed  # noqa: E402
from _lightning_trainer import (  # noqa: E402
    EVAL_LIMIT,
    FIT_LIMIT,
    MLP,
    NOTICES,
    assert_same_parameters,
    loader,
    quiet,  # noqa: F401 (autouse: Lightning's warnings off)
    stand_in,
    trainer,
)
from lightning.pytorch.profilers import PassThroughProfiler  # noqa: E402

from koila_retry.integrations._lightning_logging import batch_size, combined, weights  # noqa: E402
from koila_retry.integrations.lightning import OOMRecovery  # noqa: E402

pytestmark = NOTICES


def test_the_plain_trainer_runs_out_of_memory_at_the_limit() -> None:
    with pytest.raises(torch.OutOfMemoryError), simulated_device(FIT_LIMIT):
        trainer(gradient_clip_val=0.1).fit(MLP(), loader())


@pytest.mark.parametrize("accumulate_grad_batches", [1, 2])
def test_fit_under_the_limit_ends_at_the_unlimited_parameters(accumulate_grad_batches: int) -> None:
    options = {"gradient_clip_val": 0.1, "accumulate_grad_batches": accumulate_grad_batches}
    reference = MLP()
    unlimited = trainer(**options)
    unlimited.fit(reference, loader(rows=128 * accumulate_grad_batches))

    events: list[Any] = []
    model = MLP()
    limited = trainer(OOMRecovery(on_oom=events.append), **options)
    with simulated_device(FIT_LIMIT):
        limited.fit(model, loader(rows=128 * accumulate_grad_batches))

    assert events, "the training step never ran out of memory: the limit is too high to test anything"
    assert all(event.batch_size == 64 for event in events[:1])
    assert_same_parameters(model, reference, rtol=1e-12, atol=1e-12)
    # The logged loss is the whole batch's, once per step, not the last micro-batch's.
    torch.testing.assert_close(
        limited.callback_metrics["train_loss"], unlimited.callback_metrics["train_loss"], rtol=1e-12, atol=1e-12
    )
    # The step's wrapper is gone once the trainer is done.
    assert "training_step" not in vars(model)


class SumLoss(MLP):
    """A loss that sums its rows' (a VAE's ELBO, say), logged as it is, with a count beside it."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y, reduction="sum")
        self.log("train_loss", loss)
        self.log("correct", (self.net(x).argmax(1) == y).sum())
        self.log("rows", float(len(x)))  # a sum over the rows, the same in micro-batches of one size
        self.log("lr", self.optimizers().param_groups[0]["lr"], reduce_fx="max")  # the step's: not added up
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        self.log("val_sum", F.cross_entropy(self.net(x), y, reduction="sum"))


def test_fit_of_a_sum_loss_under_the_limit_ends_at_the_unlimited_parameters_with_reduction_sum() -> None:
    # Weighted by their share of the rows, the micro-batches' sums made a gradient 1/k of the batch's, with no
    # way to say otherwise (probe 73C).
    reference = SumLoss()
    unlimited = trainer(max_steps=2)
    unlimited.fit(reference, loader(rows=128))
    events: list[Any] = []
    model = SumLoss()
    limited = trainer(OOMRecovery(on_oom=events.append, reduction="sum"), max_steps=2)
    with simulated_device(FIT_LIMIT):
        limited.fit(model, loader(rows=128))
    assert events, "the training step never ran out of memory: the limit is too high to test anything"
    assert_same_parameters(model, reference, rtol=1e-12, atol=1e-12)
    # The whole batch's sums and its count (a sum the same in every micro-batch too: probe 73I), and a value of
    # the step's own logged with "max", as it is (probe 73H).
    for name in ("train_loss", "correct", "rows", "lr"):
        torch.testing.assert_close(
            limited.callback_metrics[name], unlimited.callback_metrics[name], rtol=1e-12, atol=1e-12
        )


def test_validate_of_a_sum_under_the_limit_gives_the_unlimited_sum_with_reduction_sum() -> None:
    # Evaluation steps took no reduction: a validation step logging the same sum as the loss logged 1/k of it,
    # the value a checkpoint monitors (probe 73H).
    model = SumLoss()
    expected = trainer().validate(model, loader(rows=128), verbose=False)
    events: list[Any] = []
    with simulated_device(EVAL_LIMIT):
        got = trainer(OOMRecovery(on_oom=events.append, reduction="sum")).validate(
            model, loader(rows=128), verbose=False
        )
    assert events
    assert got[0]["val_sum"] == pytest.approx(expected[0]["val_sum"], rel=1e-12)


class Fits16(MLP):
    """A module whose batches fit 16 rows at a time, in training and in validation."""

    limit = 16
    rows: list[int]

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.rows = [*getattr(self, "rows", []), len(batch[0])]
        if len(batch[0]) > self.limit:
            raise make_oom()
        return super().training_step(batch, batch_idx)


class FitsWhole(Fits16):
    """Another module, with the same step, that fits its batch of 64 whole."""

    limit = 64


def test_a_size_remembered_on_disk_is_the_modules_not_every_modules(tmp_path: Any) -> None:
    # Keyed by the callback's own wrapper, every module's training steps shared one entry, and every module's
    # evaluation steps another: a module that fits whole ran at another's size for good (probe 73F).
    path = tmp_path / "sizes.json"
    small = Fits16()
    trainer(OOMRecovery(cache=koila.DiskCache(path)), max_steps=2).fit(small, loader(rows=128))
    assert small.rows == [64, 32, 16, 16, 16, 16] + [16] * 4
    large = FitsWhole()
    trainer(OOMRecovery(cache=koila.DiskCache(path)), max_steps=2).fit(large, loader(rows=128))
    assert large.rows == [64, 64]
    assert [key.split(" (")[0] for key in json.loads(path.read_text())["sizes"]] == ["Fits16.training_step"]


def test_validate_under_the_limit_gives_the_unlimited_metrics() -> None:
    model = MLP()
    expected = trainer().validate(model, loader(rows=128), verbose=False)
    events: list[Any] = []
    with simulated_device(EVAL_LIMIT):
        got = trainer(OOMRecovery(on_oom=events.append)).validate(model, loader(rows=128), verbose=False)
    assert events
    assert got[0].keys() == expected[0].keys() == {"val_loss", "val_max"}
    for name in expected[0]:
        assert got[0][name] == pytest.approx(expected[0][name], rel=1e-12)


def test_predict_under_the_limit_gives_the_same_outputs() -> None:
    model = MLP()
    expected = trainer().predict(model, loader(rows=128))
    events: list[Any] = []
    with simulated_device(EVAL_LIMIT):
        got = trainer(OOMRecovery(on_oom=events.append)).predict(model, loader(rows=128))
    assert events
    assert len(got) == len(expected) == 2
    for batch, reference in zip(got, expected, strict=True):
        torch.testing.assert_close(batch["logits"], reference["logits"], rtol=1e-12, atol=1e-12)
        assert torch.equal(batch["classes"], reference["classes"])


class Labelled(MLP):
    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        return {"logits": self.net(batch[0]), "source": f"batch {batch_idx}", "rows": len(batch[0])}


def test_an_evaluation_step_that_fits_returns_its_own_output_strings_included() -> None:
    got = trainer(OOMRecovery()).predict(Labelled(), loader(rows=128))
    assert [batch["source"] for batch in got] == ["batch 0", "batch 1"]
    assert [batch["rows"] for batch in got] == [64, 64]
    with simulated_device(EVAL_LIMIT), pytest.warns(UserWarning, match=r"returned the result\[1\]\['source'\]"):
        split = trainer(OOMRecovery()).predict(Labelled(), loader(rows=128))
    assert split[0]["source"] is None  # split: the tensors and counts are joined, a string cannot be
    torch.testing.assert_close(split[0]["logits"], got[0]["logits"], rtol=1e-12, atol=1e-12)
    assert [batch["rows"] for batch in split] == [64, 64]


class Float32MLP(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.net = self.net.float()
        self.autocast: list[bool] = []  # per call of the step: whether autocast was on

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.autocast.append(torch.is_autocast_enabled("cpu"))
        x, y = batch
        return F.cross_entropy(self.net(x.float()), y)


def test_bf16_mixed_precision_under_the_limit_matches_the_unlimited_run() -> None:
    reference = Float32MLP()
    try:
        trainer(precision="bf16-mixed", gradient_clip_val=0.1).fit(reference, loader(rows=128))
    except (RuntimeError, ValueError) as error:  # pragma: no cover - depends on the CPU build
        pytest.skip(f"bf16-mixed does not train on this CPU build of torch: {error}")
    model = Float32MLP()
    events: list[Any] = []
    with simulated_device("200KiB"):
        trainer(OOMRecovery(on_oom=events.append), precision="bf16-mixed", gradient_clip_val=0.1).fit(
            model, loader(rows=128)
        )
    assert events
    # The whole batch's backward ran out of memory in Lightning's, outside the step's autocast:
    # the step ran again under it.
    assert len(model.autocast) > 3
    assert all(model.autocast), model.autocast
    # The micro-batches' bf16 matmuls round differently from the whole batch's.
    assert_same_parameters(model, reference, rtol=2e-2, atol=2e-3)


def test_16_mixed_loss_scaling_is_applied_to_each_micro_batch_and_undone_once() -> None:
    """A GradScaler on the CPU (Lightning makes none there): each micro-batch's loss scaled, unscaled once.

    No clipping, which would hide a gradient 1024 times too large.
    """
    from lightning.pytorch.plugins.precision import MixedPrecision

    def scaled() -> Any:
        return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))

    reference = Float32MLP()
    try:
        trainer(plugins=[scaled()]).fit(reference, loader(rows=128))
    except (RuntimeError, ValueError) as error:  # pragma: no cover - depends on the CPU build
        pytest.skip(f"float16 autocast does not train on this CPU build of torch: {error}")
    model = Float32MLP()
    events: list[Any] = []
    precision = scaled()
    with simulated_device("200KiB"):
        trainer(OOMRecovery(on_oom=events.append), plugins=[precision]).fit(model, loader(rows=128))
    assert events
    assert precision.scaler.get_scale() == 2.0**10
    # float16 matmuls round differently over fewer rows; a scale left in would be off by 1024.
    assert_same_parameters(model, reference, rtol=1e-2, atol=1e-3)


class Manual(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = F.cross_entropy(self.net(batch[0]), batch[1])
        self.manual_backward(loss)
        optimizer.step()
        return loss


def test_manual_optimisation_leaves_the_training_step_alone_and_says_so() -> None:
    model = Manual()
    seen: dict[str, bool] = {}

    class Look(L.Callback):  # type: ignore[misc]
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            seen["training"] = "training_step" in vars(pl_module)
            seen["validation"] = "validation_step" in vars(pl_module)

    with pytest.warns(UserWarning, match="manual optimisation: OOMRecovery leaves its training_step as it is"):
        trainer(OOMRecovery(), Look(), max_steps=1).fit(model, loader())
    assert seen == {"training": False, "validation": True}


class ManualWithItsOwnStep(Manual):
    """Manual optimisation as docs/trainers.rst shows it: the loss computation decorated in ``__init__``."""

    def __init__(self) -> None:
        super().__init__()
        self.step = koila.accumulate(backward=self.manual_backward)(self.compute_loss)

    def compute_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.net(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = self.step(*batch)
        optimizer.step()
        return loss


class ManualWithADecoratedMethod(Manual):
    @koila.accumulate
    def loss_of(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.net(x), y)


class ManualWithItsStepsInADict(ManualWithItsOwnStep):
    """A GAN's way: one wrapper per loss, kept in a dict (was told to decorate what it had decorated)."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = {"main": vars(self).pop("step")}

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = self.steps["main"](*batch)
        optimizer.step()
        return loss


@pytest.mark.parametrize("module", [ManualWithItsOwnStep, ManualWithADecoratedMethod, ManualWithItsStepsInADict])
def test_manual_optimisation_that_follows_the_docs_is_not_warned(module: type[Manual]) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(OOMRecovery(), max_steps=1).fit(module(), loader())
    assert not [str(each.message) for each in caught if "OOMRecovery" in str(each.message)]


class FindsItsSize(MLP):
    """A module whose loader reads its batch_size, as Lightning's batch-size finder needs."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_size = 4

    def train_dataloader(self) -> Any:
        return loader(batch=self.batch_size)


def test_a_batch_size_finder_in_the_same_trainer_is_refused_before_any_step(tmp_path: Any) -> None:
    # OOMRecovery splits what does not fit: the finder doubled up to the dataset's size, then crashed
    # on a BatchSizeExhausted it does not take for an out-of-memory error.
    from lightning.pytorch.callbacks import BatchSizeFinder
    from lightning.pytorch.tuner import Tuner

    model = FindsItsSize()
    before = [parameter.detach().clone() for parameter in model.parameters()]
    with pytest.raises(RuntimeError, match="OOMRecovery and BatchSizeFinder in one trainer"):
        trainer(OOMRecovery(), BatchSizeFinder(max_trials=2), default_root_dir=tmp_path).fit(model)
    with pytest.raises(RuntimeError, match="OOMRecovery and BatchSizeFinder in one trainer"):
        Tuner(trainer(OOMRecovery(), default_root_dir=tmp_path)).scale_batch_size(model, max_trials=2)
    assert not list(tmp_path.iterdir())  # refused before the finder saved its checkpoint
    assert "training_step" not in vars(model)
    assert model.batch_size == 4
    for parameter, was in zip(model.parameters(), before, strict=True):
        assert torch.equal(parameter, was)


def test_options_are_checked_when_the_callback_is_made() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'minimun'"):
        OOMRecovery(minimun=8)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="minimum"):
        OOMRecovery(initial=4, minimum=8)
    with pytest.raises(ValueError, match=r"reduction must be 'mean' .* or 'sum' .*, got 'none'"):
        OOMRecovery(reduction="none")


def test_importing_koila_retry_does_not_import_lightning() -> None:
    code = "import sys, koila_retry; print(sorted(name for name in sys.modules if 'lightning' in name))"
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert completed.stdout.strip() == "[]"


def test_a_trainer_of_another_package_is_refused_in_setup_by_name() -> None:
    # pytorch_lightning's Trainer (the same release under its old name) was refused for its strategy: "the
    # trainer runs SingleDeviceStrategy, whose forward or backward communicates between the ranks" (probe 75D).
    model = MLP()
    stand_in = type("Trainer", (), {"strategy": L.pytorch.strategies.SingleDeviceStrategy()})()
    with pytest.raises(TypeError, match=r"lightning.pytorch's Trainer, and this trainer is a .*Trainer\. The light"):
        OOMRecovery().setup(stand_in, model, "fit")
    assert "training_step" not in vars(model)
    ptl = pytest.importorskip("pytorch_lightning")
    with pytest.raises(TypeError, match=r"this trainer is a pytorch_lightning\.trainer\.trainer\.Trainer\."):
        OOMRecovery().setup(ptl.Trainer(accelerator="cpu", logger=False), model, "fit")


def test_a_strategy_that_communicates_inside_the_step_is_refused_in_setup() -> None:
    from lightning.pytorch.strategies import FSDPStrategy

    callback = OOMRecovery()
    fake = stand_in(strategy=FSDPStrategy())  # setup reads only the strategy first
    model = MLP()
    with pytest.raises(
        RuntimeError,
        match=r"OOMRecovery serves one device, DDP or FSDP2 \(ModelParallelStrategy\); the trainer runs FSDPStrategy",
    ):
        callback.setup(fake, model, "fit")
    assert "training_step" not in vars(model)


@pytest.mark.parametrize("name", ["XLAStrategy", "SingleDeviceXLAStrategy"])
def test_xla_on_several_cores_or_on_one_is_refused_in_setup(name: str) -> None:
    """SingleDeviceXLAStrategy is a SingleDeviceStrategy, not an XLAStrategy: refused by name too."""
    strategy = object.__new__(getattr(L.pytorch.strategies, name))  # made without torch_xla: setup reads its type
    fake = stand_in(strategy=strategy, callbacks=[])
    model = MLP()
    with pytest.raises(RuntimeError, match=f"OOMRecovery does not serve XLA: the trainer runs {name}, "):
        OOMRecovery().setup(fake, model, "fit")
    assert "training_step" not in vars(model)


# Batches in the containers a data loader's collate_fn makes. The splitter takes tuples,
# lists, dicts and dataclasses apart (docs/batches.rst); a class of its own with .to()
# (as PyTorch Geometric's Batch) it cannot, and that batch runs whole.
@dataclasses.dataclass
class Fields:
    x: torch.Tensor
    y: torch.Tensor


class Graph:
    """A batch of a class of its own, moved to the device with .to(): not a container koila can take apart."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def to(self, device: Any) -> Graph:
        return Graph(self.x.to(device), self.y.to(device))


def _pair(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(batch, dict):
        return batch["x"], batch["y"]
    if isinstance(batch, (Fields, Graph)):
        return batch.x, batch.y
    return batch[0], batch[1]


_COLLATED: dict[str, Any] = {
    "tuple": tuple,
    "list": list,
    "dict": lambda pair: {"x": pair[0], "y": pair[1]},
    "dataclass": lambda pair: Fields(*pair),
    "own class": lambda pair: Graph(*pair),
}


def collated(kind: str, rows: int = 128, nan_rows: slice | None = None) -> torch.utils.data.DataLoader[Any]:
    """The loader of _lightning_trainer, its batches of 64 rows made into ``kind``; ``nan_rows`` made NaN."""
    dataset = loader(rows=rows).dataset
    if nan_rows is not None:
        x, y = dataset.tensors
        x = x.clone()
        x[nan_rows] = float("nan")
        dataset = torch.utils.data.TensorDataset(x, y)
    make = _COLLATED[kind]
    return torch.utils.data.DataLoader(dataset, batch_size=64, collate_fn=lambda rows: make(default_collate(rows)))


def _told(batch: Any) -> int | None:
    """The rows to tell ``self.log``: Lightning finds them in a batch it can take apart, not in a Graph."""
    return len(batch.x) if isinstance(batch, Graph) else None


class AnyBatch(MLP):
    """The MLP, its steps taking a batch of any of the kinds above."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = _pair(batch)
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, batch_size=_told(batch))
        return {"loss": loss, "correct": (self.net(x).argmax(1) == y).sum()}

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = _pair(batch)
        logits = self.net(x)
        self.log("val_loss", F.cross_entropy(logits, y), batch_size=_told(batch))
        self.log("val_max", logits.max(), reduce_fx="max", batch_size=_told(batch))
        return F.cross_entropy(logits, y)

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        return super().predict_step(_pair(batch), batch_idx)


@pytest.mark.parametrize("kind", ["tuple", "list", "dict", "dataclass"])
def test_a_split_step_is_exact_for_every_kind_of_batch(kind: str) -> None:
    """Parameters, the logged training and validation metrics, and predictions equal the unsplit run's."""
    reference = AnyBatch()
    plain = trainer()
    plain.fit(reference, collated(kind))
    expected = trainer().validate(reference, collated(kind), verbose=False)
    predicted = trainer().predict(reference, collated(kind))

    model = AnyBatch()
    events: list[Any] = []
    limited = trainer(OOMRecovery(on_oom=events.append))
    with simulated_device(FIT_LIMIT):
        limited.fit(model, collated(kind))
    assert events, "the training step never ran out of memory"
    assert_same_parameters(model, reference, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        limited.callback_metrics["train_loss"], plain.callback_metrics["train_loss"], rtol=1e-12, atol=1e-12
    )

    events.clear()
    with simulated_device(EVAL_LIMIT):
        got = trainer(OOMRecovery(on_oom=events.append)).validate(model, collated(kind), verbose=False)
        split = trainer(OOMRecovery(on_oom=events.append)).predict(model, collated(kind))
    assert events, "the evaluation steps never ran out of memory"
    assert got[0].keys() == expected[0].keys() == {"val_loss", "val_max"}
    for name in expected[0]:
        assert got[0][name] == pytest.approx(expected[0][name], rel=1e-12)
    assert len(split) == len(predicted) == 2
    for batch, reference_batch in zip(split, predicted, strict=True):
        assert batch["logits"].shape == (64, 4)
        torch.testing.assert_close(batch["logits"], reference_batch["logits"], rtol=1e-12, atol=1e-12)
        assert torch.equal(batch["classes"], reference_batch["classes"])


class Skipping(AnyBatch):
    """Skips a batch as Lightning documents it: ``training_step`` returns None (for batch 1, or a non-finite loss)."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = _pair(batch)
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, on_epoch=True, batch_size=_told(batch))
        if batch_idx == 1 or not torch.isfinite(loss):
            return None
        return loss


def _fit_skipping(limit: str | None, nan_rows: slice | None, **options: Any) -> tuple[Any, Any, list[Any]]:
    model, events = Skipping(), []
    fitted = trainer(*([] if limit is None else [OOMRecovery(on_oom=events.append)]), max_steps=-1, **options)
    with simulated_device(limit) if limit is not None else contextlib.nullcontext():
        fitted.fit(model, collated("tuple", rows=256, nan_rows=nan_rows))
    return model, fitted, events


@pytest.mark.parametrize("limit", [None, FIT_LIMIT], ids=["whole", "split"])
@pytest.mark.parametrize("accumulate_grad_batches", [1, 2])
def test_a_training_step_that_returns_none_skips_the_batch_as_lightning_does(
    limit: str | None, accumulate_grad_batches: int
) -> None:
    """Batch 1 returns None, whole and in every micro-batch: no gradient of it reaches the optimizer.

    Run whole, the skipped step's ``self.log`` calls count as without the callback (the
    epoch's mean loss takes them in); split, they are dropped, as a failed attempt's are.
    """
    options = {"max_epochs": 1, "accumulate_grad_batches": accumulate_grad_batches}
    reference, plain, _ = _fit_skipping(None, None, **options)
    model, fitted, events = _fit_skipping(limit or "1GiB", None, **options)
    assert bool(events) == (limit is not None)
    assert fitted.global_step == plain.global_step
    assert_same_parameters(model, reference, rtol=1e-12, atol=1e-12)
    if limit is None:
        assert fitted.callback_metrics.keys() == plain.callback_metrics.keys()
        for name, value in plain.callback_metrics.items():
            torch.testing.assert_close(fitted.callback_metrics[name], value, rtol=1e-12, atol=1e-12)


def test_a_split_step_that_returns_none_for_one_micro_batch_skips_the_whole_batch() -> None:
    """A guard against a non-finite loss: half of batch 2 is NaN, so the whole batch's loss is, and is skipped.

    Split, the first micro-batch returns a loss and the second None: the batch is skipped
    whole, as the unsplit step skips it, and the first micro-batch's gradient does not
    reach ``.grad`` (under ``accumulate_grad_batches=2``, batch 2's gradient is added to
    batch 1's, which Lightning does not zero in between).
    """
    options = {"max_epochs": 1, "accumulate_grad_batches": 2}
    reference, plain, _ = _fit_skipping(None, slice(160, 192), **options)
    model, fitted, events = _fit_skipping(FIT_LIMIT, slice(160, 192), **options)
    assert any(event.batch_size == 64 for event in events)
    assert fitted.global_step == plain.global_step
    assert_same_parameters(model, reference, rtol=1e-12, atol=1e-12)
    assert all(torch.isfinite(parameter).all() for parameter in model.parameters())


def test_a_batch_that_cannot_be_split_runs_whole_exactly_as_without_the_callback() -> None:
    reference = AnyBatch()
    plain = trainer()
    plain.fit(reference, collated("own class"))
    expected = trainer().validate(reference, collated("own class"), verbose=False)
    predicted = trainer().predict(reference, collated("own class"))

    model = AnyBatch()
    events: list[Any] = []
    fitted = trainer(OOMRecovery(on_oom=events.append))
    fitted.fit(model, collated("own class"))
    assert not events
    assert_same_parameters(model, reference, rtol=0, atol=0)
    assert fitted.callback_metrics["train_loss"] == plain.callback_metrics["train_loss"]
    assert trainer(OOMRecovery()).validate(model, collated("own class"), verbose=False) == expected
    for batch, reference_batch in zip(trainer(OOMRecovery()).predict(model, collated("own class")), predicted):
        assert torch.equal(batch["logits"], reference_batch["logits"])


class Raising(MLP):
    """A training step that raises a ValueError of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.calls += 1
        raise ValueError("the step's own error")


def test_an_error_of_a_splittable_batch_is_raised_as_it_is_and_the_step_is_not_run_again() -> None:
    model = Raising()
    with pytest.raises(ValueError, match="the step's own error"):
        trainer(OOMRecovery()).fit(model, loader())
    assert model.calls == 1


class Emptied(MLP):
    """Batch 1 of each loader comes with no rows (a collate_fn that dropped them all); ``skip`` says how it runs."""

    def __init__(self, skip: bool) -> None:
        super().__init__()
        self.skip = skip
        self.batches = self.empty = 0

    def transfer_batch_to_device(self, batch: Any, device: Any, dataloader_idx: int) -> Any:
        x, y = batch
        self.batches += 1
        return [x[:0], y[:0]] if self.batches % 3 == 2 else batch

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        self.empty += not len(x)
        if not len(x):  # a guard that skips it, or a loss of no rows: 0, with a gradient of 0
            return None if self.skip else self.net(x).sum()
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        self.empty += not len(x)
        if len(x):
            self.log("val_loss", F.cross_entropy(self.net(x), y))
        return None if self.skip else self.net(x)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5)


@pytest.mark.parametrize("skip", [True, False], ids=["skipped", "zero-loss"])
@pytest.mark.parametrize("initial", [None, 32], ids=["whole-first", "through-accumulate"])
def test_a_batch_of_no_rows_runs_as_without_the_callback(skip: bool, initial: int | None) -> None:
    """Nothing to split: fit and validate run it as the plain trainer does, with no error (they raised a ValueError)."""
    reference, plain = Emptied(skip), trainer(max_steps=-1, max_epochs=1)
    plain.fit(reference, loader(rows=192), loader(rows=192))
    model, fitted = Emptied(skip), trainer(OOMRecovery(initial=initial), max_steps=-1, max_epochs=1)
    fitted.fit(model, loader(rows=192), loader(rows=192))
    assert model.empty == reference.empty == 2  # a batch of training, one of validation
    assert fitted.global_step == plain.global_step
    assert_same_parameters(model, reference, rtol=1e-12, atol=1e-12)
    assert float(fitted.callback_metrics["val_loss"]) == pytest.approx(float(plain.callback_metrics["val_loss"]))
    expected = trainer().validate(reference, loader(rows=192), verbose=False)[0]
    got = trainer(OOMRecovery(initial=initial)).validate(model, loader(rows=192), verbose=False)[0]
    assert got == pytest.approx(expected)


def test_a_batch_of_no_rows_runs_whole_under_any_single_device_strategy() -> None:
    """A subclass of SingleDeviceStrategy (as Lightning's own XLA one is) is one device too."""

    class Mine(L.pytorch.strategies.SingleDeviceStrategy):  # type: ignore[misc]
        pass

    reference = Emptied(True)
    trainer(max_steps=-1, max_epochs=1).fit(reference, loader(rows=192))
    model = Emptied(True)
    strategy = Mine(device=torch.device("cpu"))
    trainer(OOMRecovery(), max_steps=-1, max_epochs=1, strategy=strategy).fit(model, loader(rows=192))
    assert model.empty == reference.empty == 1
    assert_same_parameters(model, reference, rtol=1e-12, atol=1e-12)


class Popping(MLP):
    """A module whose steps take what they need out of a dict batch, and fit 16 rows (or more) at a time."""

    def __init__(self, limit: int = 1 << 30, where: str = "forward") -> None:
        super().__init__()
        self.limit, self.where = limit, where

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
        labels, weight = batch.pop("y"), batch.pop("weight", 1.0)
        fails = len(labels) > self.limit
        if fails and self.where == "forward":
            raise make_oom()
        loss = F.cross_entropy(self.net(batch["x"]), labels) * weight
        return OOMInBackward.apply(loss) if fails else loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
        labels = batch.pop("y")
        if len(labels) > self.limit:
            raise make_oom()
        self.log("val_loss", F.cross_entropy(self.net(batch["x"]), labels) * batch.pop("weight"))


def _weighed_dicts() -> torch.utils.data.DataLoader[Any]:
    dataset = loader(rows=128).dataset

    def collate(rows: Any) -> dict[str, Any]:
        x, y = default_collate(rows)
        return {"x": x, "y": y, "weight": 2.0}

    return torch.utils.data.DataLoader(dataset, batch_size=64, collate_fn=collate)


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_step_that_pops_from_its_batch_is_retried_on_the_batch_as_lightning_gave_it(where: str) -> None:
    # The whole attempt ran on Lightning's own dict: its retry was given the dict without "y" and "weight"
    # (a KeyError, or a weight of 1.0 trained silently; probe 76B).
    reference = Popping()
    trainer().fit(reference, _weighed_dicts())
    expected = trainer().validate(reference, _weighed_dicts(), verbose=False)
    events: list[Any] = []
    model = Popping(limit=16, where=where)
    trainer(OOMRecovery(on_oom=events.append)).fit(model, _weighed_dicts())
    assert events
    assert_same_parameters(model, reference, rtol=1e-12, atol=1e-12)
    model.where = "forward"
    got = trainer(OOMRecovery()).validate(model, _weighed_dicts(), verbose=False)
    assert got[0]["val_loss"] == pytest.approx(expected[0]["val_loss"], rel=1e-12)


class Primed(AnyBatch):
    """Gradients in ``.grad`` as the step starts (as the batches of an accumulate_grad_batches window leave them)."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        for parameter in self.parameters():
            parameter.grad = torch.full_like(parameter, 0.25)


class Zeroing(Primed):
    """A zero_grad of its own, which keeps the tensors: the gradients in ``.grad`` cannot be released early."""

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        optimizer.zero_grad(set_to_none=False)


@pytest.mark.parametrize("module", [Primed, Zeroing])
def test_a_batch_that_cannot_be_split_and_runs_out_of_memory_says_how_to_make_it_splittable(module: type) -> None:
    model = module()
    before = [parameter.detach().clone() for parameter in model.parameters()]
    with (
        simulated_device(FIT_LIMIT),
        pytest.raises(
            BatchSizeExhausted, match=rf"cannot split the batch of {module.__name__}\.training_step, a Graph"
        ) as caught,
    ):
        trainer(OOMRecovery()).fit(model, collated("own class"))
    message = str(caught.value)
    assert "none of the arguments is a tensor" in message
    assert "make the batch a dataclass" in message
    for parameter, value in zip(model.parameters(), before, strict=True):
        assert torch.equal(parameter, value)
        if module is Zeroing:  # .grad as it was
            assert torch.equal(parameter.grad, torch.full_like(parameter, 0.25))
        else:  # released as the step began: Lightning's zero_grad was about to set it to None
            assert parameter.grad is None
    with (
        simulated_device(EVAL_LIMIT),
        pytest.raises(BatchSizeExhausted, match=rf"cannot split the batch of {module.__name__}\.validation_step"),
    ):
        trainer(OOMRecovery()).validate(model, collated("own class"), verbose=False)


class Quiet(AnyBatch):
    """A validation step that only logs, and returns nothing: the usual kind."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = _pair(batch)
        self.log("val_loss", F.cross_entropy(self.net(x), y))


def test_an_evaluation_step_that_returns_nothing_is_split_without_a_warning() -> None:
    model = Quiet()
    expected = trainer().validate(model, collated("tuple"), verbose=False)
    events: list[Any] = []
    with warnings.catch_warnings(record=True) as caught, simulated_device(EVAL_LIMIT):
        warnings.simplefilter("always")
        got = trainer(OOMRecovery(on_oom=events.append)).validate(model, collated("tuple"), verbose=False)
    assert events
    assert [str(warning.message) for warning in caught if "Quiet.validation_step" in str(warning.message)] == []
    assert got[0]["val_loss"] == pytest.approx(expected[0]["val_loss"], rel=1e-12)


class Lean(MLP):
    """A training step that only computes the loss: what a hand-written loop computes."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _gradient_bytes(model: torch.nn.Module) -> int:
    return sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())


class ZeroedByItself(Lean):
    """Its own ``optimizer_zero_grad``, as Lightning's docstring shows one (the same as Lightning's own)."""

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        optimizer.zero_grad(set_to_none=True)


def _peak_of_fit(*callbacks: Any, kind: type[Lean] = Lean, **options: Any) -> tuple[int, Any]:
    # Batches of 8 rows: the gradients weigh more than the activations, as in a large model.
    model = kind()
    with simulated_device("1GiB") as device:
        trainer(*callbacks, max_steps=4, gradient_clip_val=0.1, **options).fit(model, loader(rows=64, batch=8))
    return device.peak, model


def test_nothing_failing_the_callback_costs_no_memory_over_the_plain_trainer() -> None:
    plain, reference = _peak_of_fit()
    events: list[Any] = []
    peak, model = _peak_of_fit(OOMRecovery(on_oom=events.append))
    assert events == []
    assert peak <= 1.02 * plain, f"{peak} bytes with OOMRecovery, {plain} without it"
    assert_same_parameters(model, reference, rtol=0, atol=0)


def test_nothing_failing_a_module_s_own_zero_grad_lets_go_of_the_gradients_set_aside_before_the_backward() -> None:
    # Set aside the whole step on a window's first batch, where Lightning's own zero_grad would let them go
    # before the backward: 1.12 to 1.34 times the plain trainer's peak (probe 75D).
    plain, reference = _peak_of_fit(kind=ZeroedByItself)
    peak, model = _peak_of_fit(OOMRecovery(), kind=ZeroedByItself)
    assert peak <= 1.02 * plain, f"{peak} bytes with OOMRecovery, {plain} without it"
    assert_same_parameters(model, reference, rtol=0, atol=0)


def test_nothing_failing_under_gradient_accumulation_the_callback_costs_at_most_the_gradients_set_aside() -> None:
    # Lightning zeroes the gradients on the first batch of each group: the callback releases
    # them there. On the other batches the earlier ones' sum is in .grad and is kept apart
    # while the step runs, so that an attempt that runs out of memory can start again from it.
    plain, reference = _peak_of_fit(accumulate_grad_batches=2)
    peak, model = _peak_of_fit(OOMRecovery(), accumulate_grad_batches=2)
    gradients = _gradient_bytes(reference)
    assert peak <= 1.02 * plain + gradients, f"{peak} bytes with OOMRecovery, {plain} without it"
    assert_same_parameters(model, reference, rtol=1e-12, atol=1e-12)


def test_under_a_limit_where_a_hand_loop_of_micro_batches_fits_the_callback_fits_too() -> None:
    limit, rows, micro = "240KiB", 64, 8
    hand = Lean()
    optimizer = torch.optim.SGD(hand.parameters(), lr=0.5)
    with simulated_device(limit) as device:
        for x, y in loader(rows=3 * rows, batch=rows):
            for start in range(0, rows, micro):
                part = slice(start, start + micro)
                (F.cross_entropy(hand.net(x[part]), y[part]) * (micro / rows)).backward()
            torch.nn.utils.clip_grad_norm_(hand.parameters(), 0.1)
            optimizer.step()
            optimizer.zero_grad()
    assert device.peak <= device.limit  # the hand loop fits

    reference = Lean()
    trainer(gradient_clip_val=0.1).fit(reference, loader(rows=3 * rows, batch=rows))
    assert_same_parameters(hand, reference, rtol=1e-12, atol=1e-12)
    model = Lean()
    events: list[Any] = []
    with simulated_device(limit):
        trainer(OOMRecovery(on_oom=events.append), gradient_clip_val=0.1).fit(model, loader(rows=3 * rows, batch=rows))
    assert events, "the whole batch fitted: the limit is too high to test anything"
    assert_same_parameters(model, reference, rtol=1e-12, atol=1e-12)


class Watching(Lean):
    """An ``on_before_zero_grad`` hook that looks at the gradients Lightning is about to zero."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[torch.Tensor | None]] = []

    def on_before_zero_grad(self, optimizer: Any) -> None:
        self.seen.append([None if p.grad is None else p.grad.clone() for p in self.parameters()])


def test_an_on_before_zero_grad_hook_sees_the_gradients_it_sees_without_the_callback() -> None:
    reference, model = Watching(), Watching()
    trainer(gradient_clip_val=0.1).fit(reference, loader(rows=64, batch=16))
    trainer(OOMRecovery(), gradient_clip_val=0.1).fit(model, loader(rows=64, batch=16))
    assert len(model.seen) == len(reference.seen) == 3
    assert reference.seen[1][0] is not None  # the previous step's gradients
    for got, expected in zip(model.seen, reference.seen, strict=True):
        for gradient, wanted in zip(got, expected, strict=True):
            if wanted is None:
                assert gradient is None
            else:
                torch.testing.assert_close(gradient, wanted, rtol=1e-12, atol=1e-12)


class _Rows(torch.nn.Module):
    """ReLU that records each forward's rows, and those that ran out of memory."""

    def __init__(self, seen: list[str]) -> None:
        super().__init__()
        self.seen = seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            out = torch.relu(x)
        except torch.OutOfMemoryError:
            self.seen.append(f"{len(x)} OOM")
            raise
        self.seen.append(str(len(x)))
        return out


class HookedAndCounted(MLP):
    """A module whose on_before_zero_grad hook keeps its first step of a window from running whole."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []
        self.net[1] = _Rows(self.seen)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def on_before_zero_grad(self, optimizer: Any) -> None:
        pass


def test_after_a_split_step_the_later_steps_of_a_window_start_at_its_size_and_every_oom_is_heard() -> None:
    """The window's second batch ran whole again after the first had split, and that OOM reached no on_oom."""
    reference, model = HookedAndCounted(), HookedAndCounted()
    trainer(max_steps=2, accumulate_grad_batches=2).fit(reference, loader(rows=256))
    events: list[koila.OOMEvent] = []
    with simulated_device(FIT_LIMIT):
        trainer(OOMRecovery(on_oom=events.append), max_steps=2, accumulate_grad_batches=2).fit(model, loader(rows=256))
    # Only the first batch tries its 64 rows whole: an attempt the second made again failed unheard.
    assert [rows.split()[0] for rows in model.seen].count("64") == 1, model.seen
    sizes = [event.batch_size for event in events]
    assert sizes[0] == 64
    assert sizes == sorted(set(sizes), reverse=True), sizes  # each heard once, each smaller
    assert_same_parameters(model, reference, rtol=1e-12, atol=1e-12)


class OwnBackward(MLP):
    """A module whose ``backward`` is its own: it doubles the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.backwards = 0

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.backwards += 1
        (loss * 2).backward(*args, **kwargs)


@pytest.mark.parametrize("own", [False, True], ids=["lightnings-backward", "the-modules-own"])
def test_a_split_step_runs_the_modules_backward_once_per_batch_in_the_loops_backward(
    own: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The micro-batches run ``loss.backward()``; the module's ``backward`` runs in the loop's, once.

    A module's own ``backward`` that scales the loss scales the step's gradient once, as
    without the callback (it was applied to each micro-batch and again to the whole).
    """
    calls = [0]
    plain_backward = L.LightningModule.backward

    def counted(module: Any, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        calls[0] += 1
        plain_backward(module, loss, *args, **kwargs)

    if not own:  # counted, and still Lightning's own: the class attribute itself
        monkeypatch.setattr(L.LightningModule, "backward", counted)
    reference = OwnBackward() if own else MLP()
    trainer().fit(reference, loader(rows=128))
    model = OwnBackward() if own else MLP()
    events: list[Any] = []
    calls[0] = 0
    fitting = trainer(OOMRecovery(on_oom=events.append))
    with simulated_device(FIT_LIMIT):
        fitting.fit(model, loader(rows=128))
    assert events, "the training step never ran out of memory: the limit is too high to test anything"
    steps = fitting.global_step
    assert_same_parameters(model, reference, rtol=1e-12, atol=1e-12)
    assert (model.backwards if own else calls[0]) == steps, "the loop's backward only, once per step"


class PositionalLog(MLP):
    """Logs with ``prog_bar`` given by position, which the held-back call binds by name."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, True)
        return loss


def test_a_log_call_with_positional_options_is_replayed_as_called() -> None:
    reference = PositionalLog()
    unlimited = trainer()
    unlimited.fit(reference, loader(rows=128))
    model = PositionalLog()
    limited = trainer(OOMRecovery())
    with simulated_device(FIT_LIMIT):
        limited.fit(model, loader(rows=128))
    assert "train_loss" in limited.progress_bar_metrics, "prog_bar=True, given by position, reached Lightning"
    torch.testing.assert_close(
        limited.callback_metrics["train_loss"], unlimited.callback_metrics["train_loss"], rtol=1e-12, atol=1e-12
    )


class Actions(PassThroughProfiler):
    """A profiler that keeps the names of what Lightning runs: a callback's hook calls among them."""

    def __init__(self) -> None:
        super().__init__()
        self.actions: list[str] = []

    def start(self, action_name: str) -> None:
        self.actions.append(action_name)


def test_lightning_calls_none_of_the_callbacks_hooks_that_do_nothing_in_a_step() -> None:
    """Per training or validation batch, Lightning calls ``on_train_batch_start`` of the callback, and nothing else."""
    profiler = Actions()
    fitting = trainer(OOMRecovery(), profiler=profiler, limit_val_batches=2, val_check_interval=2)
    fitting.fit(MLP(), loader(rows=128), loader(rows=128))
    called = [action for action in profiler.actions if action.startswith("[Callback]OOMRecovery.")]
    assert fitting.global_step == 3
    assert called.count("[Callback]OOMRecovery.on_train_batch_start") == 3
    per_batch = [action for action in called if "batch" in action or "backward" in action or "optimizer" in action]
    assert per_batch == ["[Callback]OOMRecovery.on_train_batch_start"] * 3


class Counting(OOMRecovery):
    """A subclass with hooks of its own: Lightning calls them as it calls any callback's."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def on_before_zero_grad(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.calls.append("on_before_zero_grad")

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        super().on_after_backward(trainer, pl_module)
        self.calls.append("on_after_backward")

    def on_train_batch_end(self, *args: Any) -> None:
        self.calls.append("on_train_batch_end")


def test_a_subclass_of_the_callback_has_its_own_hooks_called_and_still_releases_the_gradients() -> None:
    reference, model = Lean(), Lean()
    trainer(max_steps=4).fit(reference, loader(rows=64, batch=16))
    counting = Counting()
    trainer(counting, max_steps=4).fit(model, loader(rows=64, batch=16))
    assert counting.calls == ["on_before_zero_grad", "on_after_backward", "on_train_batch_end"] * 4
    assert_same_parameters(model, reference, rtol=0, atol=0)
    # Its on_before_zero_grad, which could look at the gradients, keeps the previous step's
    # gradients alive until Lightning zeroes them, as without the callback: not released as the step
    # begins (which peaks lower), and let go of before the backward (which peaked higher, probe 75D).
    plain, _ = _peak_of_fit()
    peak, _ = _peak_of_fit(Counting())
    assert plain <= peak <= 1.02 * plain, f"{peak} bytes with the callback, {plain} without it"


class Wrapped(torch.nn.Sequential):
    """A container whose ``named_modules`` is its own: the parameters are found through it."""

    def named_modules(self, *args: Any, **kwargs: Any) -> Any:
        return super().named_modules(*args, **kwargs)


class Tied(Lean):
    """Tied weights, a layer used twice, a layer without bias and a frozen one; the head in a container."""

    def __init__(self, container: type[torch.nn.Sequential] = torch.nn.Sequential) -> None:
        super().__init__()
        torch.manual_seed(0)
        shared = torch.nn.Linear(16, 16).double()
        first, last = torch.nn.Linear(16, 16, bias=False).double(), torch.nn.Linear(16, 16).double()
        last.weight = first.weight
        frozen = torch.nn.Linear(16, 16).double().requires_grad_(False)
        head = container(torch.nn.Linear(16, 4).double())
        self.net = torch.nn.Sequential(first, torch.nn.Tanh(), shared, torch.nn.Tanh(), shared, frozen, last, head)
        self.spare = shared  # the same module again, under another name


@pytest.mark.parametrize("container", [torch.nn.Sequential, Wrapped], ids=["torchs", "its-own"])
def test_tied_shared_and_frozen_parameters_train_as_without_the_callback(container: type[torch.nn.Sequential]) -> None:
    reference, model = Tied(container), Tied(container)
    trainer(max_steps=4).fit(reference, loader(rows=64, batch=16))
    trainer(OOMRecovery(), max_steps=4).fit(model, loader(rows=64, batch=16))
    assert_same_parameters(model, reference, rtol=0, atol=0)
    assert len(list(model.parameters())) == 8  # each once: the tied weight and the shared layer too
    assert not torch.equal(next(model.parameters()), next(Tied().parameters())), "the tied weight trained"


class Hooked(MLP):
    """The MLP with a hook of each kind on its first weight: one that clamps the gradient, one that counts."""

    def __init__(self) -> None:
        super().__init__()
        self.accumulations: list[int] = []  # the hooks must not hold the module: autograd keeps them
        weight = self.net[0].weight
        weight.register_hook(lambda gradient: gradient.clamp(-1e-3, 1e-3) * 2)
        weight.register_post_accumulate_grad_hook(lambda parameter, seen=self.accumulations: seen.append(1))


@pytest.mark.parametrize("limit", [None, FIT_LIMIT], ids=["whole", "split"])
def test_a_parameters_hooks_run_once_per_batch_on_its_whole_gradient_as_without_the_callback(
    limit: str | None,
) -> None:
    """Not in the step's micro-batches, and not a second time as its gradients reach Lightning's backward."""
    reference = Hooked()
    trainer().fit(reference, loader())
    model, events = Hooked(), []
    with simulated_device(limit) if limit else contextlib.nullcontext():
        trainer(OOMRecovery(on_oom=events.append)).fit(model, loader())
    assert bool(events) == bool(limit), events
    assert (len(model.accumulations), len(reference.accumulations)) == (3, 3)
    # The hook clamps: on each micro-batch's gradient, the sum would differ from the whole batch's.
    assert_same_parameters(model, reference, rtol=1e-12, atol=1e-12)
    # Put back: the hooks run in a backward after the fit as before it.
    model.net[0].weight.grad = None
    model.net(torch.ones(1, 16, dtype=torch.float64)).sum().backward()
    assert len(model.accumulations) == 4


class Staged(L.pytorch.callbacks.Callback):  # type: ignore[misc]
    """Says whether the loop's backward is running: between ``on_before_backward`` and ``on_after_backward``."""

    def __init__(self) -> None:
        self.in_loop_backward = False

    def on_before_backward(self, *args: Any) -> None:
        self.in_loop_backward = True

    def on_after_backward(self, *args: Any) -> None:
        self.in_loop_backward = False


class Traced(Lean):
    """Records where the backward of each step's loss runs, and keeps a weak reference to each step's graph."""

    def __init__(self, staged: Staged) -> None:
        super().__init__()
        self.staged = staged
        self.backward_in_loop: list[bool] = []
        self.activations: list[weakref.ref[torch.Tensor]] = []
        self.dead_before: list[bool] = []  # per call of the step: whether every earlier call's graph is gone
        self.rows: list[int] = []  # per call of the step

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.dead_before.append(all(reference() is None for reference in self.activations))
        x, y = batch
        self.rows.append(len(x))
        # A copy of the batch that only the graph holds, saved by the node a backward runs last.
        copy = x.clone()
        self.activations.append(weakref.ref(copy))
        loss = F.cross_entropy(self.net(copy), y)
        loss.register_hook(lambda gradient: self.backward_in_loop.append(self.staged.in_loop_backward))
        return loss


def test_nothing_failing_a_training_step_runs_whole_and_lightnings_backward_backpropagates_it() -> None:
    """As without the callback: one forward of the batch in the step, its backward in the loop's."""
    reference = Lean()
    trainer().fit(reference, loader(rows=128))
    staged = Staged()
    model = Traced(staged)
    events: list[Any] = []
    recovery = OOMRecovery(on_oom=events.append)
    trainer(recovery, staged).fit(model, loader(rows=128))
    assert events == []
    assert model.backward_in_loop == [True, True, True], "backpropagated by Lightning's backward, once a step"
    # The first step's graph reached nothing but the parameters: the later steps' are not walked.
    assert recovery._steps["training_step"].walks is False
    assert_same_parameters(model, reference, rtol=0, atol=0)
    assert "backward" not in vars(model), "the module's backward is its class's again"


# Batches of 64 rows of Lean: its forward fits in this and its backward does not (660 KiB fits neither
# the whole step nor less than its forward, 890 KiB the whole step).
BACKWARD_LIMIT = "700KiB"


def test_an_oom_in_lightnings_backward_of_a_step_that_ran_whole_runs_it_again_in_micro_batches() -> None:
    reference = Lean()
    trainer().fit(reference, loader(rows=128))
    staged = Staged()
    model = Traced(staged)
    events: list[Any] = []
    inside: list[bool] = []

    def on_oom(event: Any) -> None:
        events.append(event)
        inside.append(staged.in_loop_backward)

    with simulated_device(BACKWARD_LIMIT):
        trainer(OOMRecovery(on_oom=on_oom), staged).fit(model, loader(rows=128))
    assert events, "the training step never ran out of memory: the limit is too high to test anything"
    # The step ran whole and its loss's backward, Lightning's, ran out of memory; the step then ran
    # again inside that backward, through accumulate: whole (out of memory again), then split.
    assert model.backward_in_loop[0] is True
    # That failure is accumulate's first attempt: reported once, inside the loop's backward, and the
    # step runs again in micro-batches at once, not whole a second time.
    assert inside == [True]
    assert [event.batch_size for event in events] == [64]
    assert model.rows[:3] == [64, 32, 32]
    # The graph of the attempt that failed was gone before the step ran again.
    assert model.dead_before[1] is True
    assert_same_parameters(model, reference, rtol=1e-12, atol=1e-12)
    assert "backward" not in vars(model)


class Scaled(Lean):
    """A scale of the module's own that needs a gradient but is no parameter: Lightning never zeroes it."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.ones((), dtype=torch.float64, requires_grad=True)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return F.cross_entropy(self.net(x) * self.scale, y)


def test_a_tensor_of_the_modules_own_keeps_nothing_of_a_whole_step_whose_backward_failed() -> None:
    """Found in the graph, as accumulate finds it: its gradient adds up over the steps as without the callback."""
    reference = Scaled()
    trainer().fit(reference, loader(rows=128))
    model = Scaled()
    events: list[Any] = []
    recovery = OOMRecovery(on_oom=events.append)
    with simulated_device(BACKWARD_LIMIT):
        trainer(recovery).fit(model, loader(rows=128))
    assert [event.batch_size for event in events] == [64], "the first step's whole backward ran out of memory"
    assert recovery._steps["training_step"].walks is True
    assert reference.scale.grad is not None
    # The failed backward had written the scale's gradient before the error: not kept, not added twice.
    torch.testing.assert_close(model.scale.grad, reference.scale.grad, rtol=1e-12, atol=1e-12)
    assert_same_parameters(model, reference, rtol=1e-12, atol=1e-12)


def test_an_oom_in_the_forward_of_a_step_that_ran_whole_runs_it_again_in_micro_batches() -> None:
    reference = Lean()
    trainer().fit(reference, loader(rows=128))
    staged = Staged()
    model = Traced(staged)
    events: list[Any] = []
    with simulated_device("400KiB"):  # less than the whole batch's forward
        trainer(OOMRecovery(on_oom=events.append), staged).fit(model, loader(rows=128))
    # Reported once at 64 rows (and again at 32, which does not fit either here), and run again in
    # micro-batches at once, not whole a second time.
    assert [event.batch_size for event in events] == [64, 32]
    assert model.rows[:2] == [64, 32]
    # The first named where the step that ran whole raised it, not where accumulate raised it again.
    assert events[0].where.endswith(" in training_step"), events[0].where
    assert model.dead_before[1] is True, "the failed forward's tensors were gone before the step ran again"
    # Every backward since ran inside the step, as accumulate runs it: a size is known now.
    assert True not in model.backward_in_loop
    assert_same_parameters(model, reference, rtol=1e-12, atol=1e-12)


class TracedZeroing(Traced):
    """A zero_grad of its own, which keeps the tensors: they cannot be released as the step begins."""

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        optimizer.zero_grad(set_to_none=False)


class TracedReleasing(Traced):
    """A zero_grad of its own that sets them to None, as Lightning's does."""

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("kind", [TracedZeroing, TracedReleasing])
def test_a_step_with_a_zero_grad_of_its_own_runs_whole_and_again_in_micro_batches_exactly(kind: type[Traced]) -> None:
    # It ran through accumulate from the start, the previous step's gradients kept beside it: 1.12 to 1.34
    # times the plain trainer's peak with nothing failing (probe 75D). Now whole, its gradients set aside
    # and read again after the zero, before its backward; that backward running out of memory, in micro-batches.
    reference = kind(Staged())
    trainer().fit(reference, loader(rows=128))
    staged = Staged()
    model = kind(staged)
    events: list[Any] = []
    with simulated_device(BACKWARD_LIMIT):
        trainer(OOMRecovery(on_oom=events.append), staged).fit(model, loader(rows=128))
    assert events, "the training step never ran out of memory: the limit is too high to test anything"
    assert model.backward_in_loop[0] is True
    assert_same_parameters(model, reference, rtol=1e-12, atol=1e-12)
    plain = kind(staged)
    trainer(OOMRecovery(), staged).fit(plain, loader(rows=128))
    assert plain.backward_in_loop
    assert all(plain.backward_in_loop), "nothing failing, every step ran whole"


@pytest.mark.parametrize("setting", ["initial", "hook"])
def test_where_the_whole_step_cannot_be_undone_it_runs_through_accumulate_from_the_start(setting: str) -> None:
    """With ``initial=`` or a hook on a parameter, every backward runs in the step."""
    staged = Staged()
    model = Traced(staged)
    if setting == "hook":
        model.net[0].bias.register_hook(lambda gradient: gradient)
    recovery = OOMRecovery(initial=64) if setting == "initial" else OOMRecovery()
    trainer(recovery, staged).fit(model, loader(rows=256))
    assert model.backward_in_loop
    assert True not in model.backward_in_loop


class Counted(MLP):
    """The MLP whose validation step records the rows of each call."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[int] = []

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        self.rows.append(len(batch[0]))
        return super().validation_step(batch, batch_idx)


def test_an_evaluation_step_that_fits_runs_as_lightning_runs_it_and_one_that_does_not_is_split_at_once() -> None:
    expected = trainer().validate(MLP(), loader(rows=128), verbose=False)
    recovery = OOMRecovery()
    model = Counted()
    assert trainer(recovery).validate(model, loader(rows=128), verbose=False) == expected
    assert model.rows == [64, 64]
    assert recovery._steps["validation_step"].run.stats.calls == 0, "accumulate was not called"

    events: list[Any] = []
    model = Counted()
    with simulated_device(EVAL_LIMIT):
        got = trainer(OOMRecovery(on_oom=events.append)).validate(model, loader(rows=128), verbose=False)
    # The whole batch's error is accumulate's first attempt: reported once, then chunks at once,
    # and the next batch starts at the size that worked.
    assert [event.batch_size for event in events] == [64]
    assert model.rows == [64, 32, 32, 32, 32]
    assert events[0].where.endswith(" in validation_step"), "named where the whole batch's step raised it"
    for name in expected[0]:
        assert got[0][name] == pytest.approx(expected[0][name], rel=1e-12)


def test_under_gradient_accumulation_every_step_runs_whole_and_the_sum_is_the_trainers_own() -> None:
    """The window's gradients so far are set aside while a later batch runs, and added back: to the last bit."""
    reference = Lean()
    trainer(accumulate_grad_batches=2, max_steps=2).fit(reference, loader(rows=256))
    staged = Staged()
    model = Traced(staged)
    trainer(OOMRecovery(), staged, accumulate_grad_batches=2, max_steps=2).fit(model, loader(rows=256))
    assert model.backward_in_loop == [True] * 4
    assert_same_parameters(model, reference, rtol=0, atol=0)


def _norms(module: torch.nn.Module) -> list[float]:
    # Norms, not copies: a copy of every gradient would count against the simulated device. NaN: no gradient.
    return [float("nan") if p.grad is None else torch.linalg.vector_norm(p.grad).item() for p in module.parameters()]


class BeforeBackward(L.pytorch.callbacks.Callback):  # type: ignore[misc]
    """Records the gradients in ``.grad`` as a callback's ``on_before_backward`` sees them."""

    def __init__(self) -> None:
        self.seen: list[list[float]] = []

    def on_before_backward(self, trainer: Any, module: Any, loss: Any) -> None:
        self.seen.append(_norms(module))


class LooksBeforeBackward(Lean):
    """Records the gradients in ``.grad`` as the module's ``on_before_backward`` and ``on_after_backward`` see them."""

    def __init__(self) -> None:
        super().__init__()
        self.before: list[list[float]] = []
        self.after: list[list[float]] = []

    def on_before_backward(self, loss: Any) -> None:
        self.before.append(_norms(self))

    def on_after_backward(self) -> None:
        self.after.append(_norms(self))


@pytest.mark.parametrize("limit", [None, FIT_LIMIT], ids=["whole", "split"])
def test_on_before_backward_sees_the_windows_gradients_so_far_as_without_the_callback(limit: str | None) -> None:
    """Under accumulate_grad_batches=3: None on a window's first batch, the earlier batches' sum on the others."""
    runs, events = [], []
    for callbacks in ((), (OOMRecovery(on_oom=events.append),)):
        model, watching = LooksBeforeBackward(), BeforeBackward()
        with simulated_device(limit) if limit and callbacks else contextlib.nullcontext():
            trainer(*callbacks, watching, accumulate_grad_batches=3, max_steps=2).fit(model, loader(rows=384))
        runs.append((model, watching))
    (reference, plain), (model, watching) = runs
    assert bool(events) == bool(limit), "split where limited"
    assert len(reference.before) == 6
    assert reference.before[1][0] > 0, "the window's first batch's gradient"
    assert all(norm != norm for norm in reference.before[3]), "None on a window's first batch"
    pairs = ((model.before, reference.before), (watching.seen, plain.seen), (model.after, reference.after))
    for got, expected in pairs:
        assert len(got) == len(expected)
        for norms, wanted in zip(got, expected, strict=True):
            assert norms == pytest.approx(wanted, rel=1e-12, abs=1e-12, nan_ok=True)
    assert_same_parameters(model, reference, rtol=1e-12, atol=1e-12)


def test_a_tensor_of_the_modules_own_is_walked_in_every_step_once_the_first_found_it() -> None:
    """The second batch of a window fails in Lightning's backward: its graph was walked too."""
    reference = Scaled()
    trainer(accumulate_grad_batches=2, max_steps=2).fit(reference, loader(rows=256))
    batches = Batches()
    model = Scaled()
    events: list[Any] = []
    where: list[int] = []

    def on_oom(event: Any) -> None:
        events.append(event)
        where.append(batches.index)

    with simulated_device("860KiB"):
        trainer(OOMRecovery(on_oom=on_oom), batches, accumulate_grad_batches=2, max_steps=2).fit(
            model, loader(rows=256)
        )
    # The first window's second batch fails in Lightning's backward and runs through accumulate there,
    # the second window's batches through accumulate: their gradients divided by accumulate_grad_batches
    # as Lightning divides the loss, the scale's too.
    assert where[:1] == [1], "the second batch of the first window"
    torch.testing.assert_close(model.scale.grad, reference.scale.grad, rtol=1e-12, atol=1e-12)
    assert_same_parameters(model, reference, rtol=1e-12, atol=1e-12)


def test_a_tensor_of_the_modules_own_gets_through_accumulate_what_lightning_gives_it_in_a_window() -> None:
    """Every step through accumulate (initial=): handed over with the parameters' gradients, and divided alike."""
    reference = Scaled()
    trainer(accumulate_grad_batches=2, max_steps=2).fit(reference, loader(rows=256))
    model = Scaled()
    recovery = OOMRecovery(initial=32)
    trainer(recovery, accumulate_grad_batches=2, max_steps=2).fit(model, loader(rows=256))
    assert recovery._steps["training_step"].run.stats.batch_size == 32
    torch.testing.assert_close(model.scale.grad, reference.scale.grad, rtol=1e-12, atol=1e-12)
    assert_same_parameters(model, reference, rtol=1e-12, atol=1e-12)


class Batches(L.pytorch.callbacks.Callback):  # type: ignore[misc]
    """Says which batch of the epoch runs."""

    def __init__(self) -> None:
        self.index = -1

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        self.index = batch_idx


def test_an_oom_in_the_backward_of_a_later_batch_of_a_window_puts_the_windows_gradients_back() -> None:
    """At this limit the second batch of a window does not fit (the first's gradients are in .grad), the first does."""
    reference = Lean()
    trainer(accumulate_grad_batches=2, max_steps=2).fit(reference, loader(rows=256))
    staged, batches = Staged(), Batches()
    model = Traced(staged)
    events: list[Any] = []
    where: list[tuple[int, bool]] = []

    def on_oom(event: Any) -> None:
        events.append(event)
        where.append((batches.index, staged.in_loop_backward))

    recovery = OOMRecovery(on_oom=on_oom)
    with simulated_device("860KiB"):
        trainer(recovery, staged, batches, accumulate_grad_batches=2, max_steps=2).fit(model, loader(rows=256))
    assert where[:1] == [(1, True)], "the second batch, in Lightning's backward"
    assert [event.batch_size for event in events][:1] == [64]
    assert model.rows[:3] == [64, 64, 32]
    assert_same_parameters(model, reference, rtol=1e-12, atol=1e-12)


def _attached(model: Any) -> dict[str, Any]:
    """Return what the module object holds under the names OOMRecovery may set on it while a trainer runs it."""
    names = ("training_step", "validation_step", "test_step", "predict_step", "log", "backward", "__getstate__")
    return {name: vars(model)[name] for name in names if name in vars(model)}


class _Copying(L.Callback):  # type: ignore[misc]
    """Copy and pickle the module during ``fit``, as a callback that keeps the best model so far does."""

    def __init__(self) -> None:
        self.copies: list[Any] = []
        self.shallow: list[Any] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.shallow.append(copy.copy(pl_module))  # its parameters are the module's
        self.copies += [copy.deepcopy(pl_module), torch.load(_saved(pl_module), weights_only=False)]


def _saved(module: Any) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return buffer


def test_a_copy_or_a_pickle_of_the_module_made_during_fit_runs_its_own_steps() -> None:
    # The wrappers are attributes of the module object: a copy ran the original's steps (through the
    # original's _Step), after fit a trainer with OOMRecovery recursed on it, and a pickle failed.
    copying = _Copying()
    model = MLP()
    with simulated_device(FIT_LIMIT):
        trainer(OOMRecovery(), copying, max_steps=2).fit(model, loader())
    assert len(copying.copies) == 4
    assert [_attached(twin) for twin in copying.shallow] == [{}, {}]
    x = next(iter(loader()))[0]
    for twin in copying.copies:
        assert _attached(twin) == {}, "nothing of the callback's on a copy"
        with torch.no_grad():
            for parameter in twin.parameters():
                parameter.zero_()
        assert not twin.predict_step((x,), 0)["logits"].any()  # its own weights, not the trained model's
        predicted = trainer(OOMRecovery()).predict(twin, loader())
        assert not predicted[0]["logits"].any()
    assert _attached(model) == {}


class Failing(MLP):
    """Fails in its second training step as ``failure`` says: its own error, an interrupt, a hook's error."""

    def __init__(self, failure: str | None = None) -> None:
        super().__init__()
        self.failure = failure
        self.hidden: list[weakref.ref[torch.Tensor]] = []  # each step's activations, which its graph holds

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        if self.failure in ("step", "interrupt") and self.trainer.global_step == 1:
            raise ValueError("the step's own error") if self.failure == "step" else KeyboardInterrupt
        hidden = self.net[1](self.net[0](x))
        self.hidden.append(weakref.ref(hidden))
        loss = F.cross_entropy(self.net[2](hidden), y)
        self.log("train_loss", loss)
        return loss

    def on_before_backward(self, loss: torch.Tensor) -> None:
        if self.failure == "hook" and self.trainer.global_step == 1:
            raise RuntimeError("a hook's own error")


@contextlib.contextmanager
def _sigint_kept() -> Iterator[None]:
    """Put back the SIGINT handler that Lightning sets aside when it meets a KeyboardInterrupt."""
    handler = signal.getsignal(signal.SIGINT)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)


@pytest.mark.parametrize("failure", ["exhausted", "step", "interrupt", "hook"])
def test_a_fit_that_raises_leaves_the_module_as_it_was_and_later_fits_train_as_the_plain_one(failure: str) -> None:
    model = Failing(failure)
    raised = {"exhausted": BatchSizeExhausted, "step": ValueError, "interrupt": SystemExit, "hook": RuntimeError}
    limit = simulated_device("150KiB") if failure == "exhausted" else contextlib.nullcontext()
    # Lightning answers a KeyboardInterrupt with sys.exit(1), and ignores SIGINT from then on.
    with _sigint_kept(), pytest.raises(raised[failure]), limit:
        trainer(OOMRecovery(), max_steps=4).fit(model, loader(rows=256))
    gc.collect()
    assert _attached(model) == {}, "nothing the callback put on the module object is left"
    hidden, model.hidden = model.hidden, []
    assert [ref() for ref in hidden if ref() is not None] == [], "nothing of a failed step's graph is kept"
    torch.save(model, io.BytesIO())  # nothing on it that cannot be pickled
    model.failure = None
    reference = Failing()
    trainer(accumulate_grad_batches=2, max_steps=2).fit(reference, loader(rows=256))
    for callbacks, limit in (((), None), ((OOMRecovery(),), FIT_LIMIT)):
        model.load_state_dict(Failing().state_dict())
        with simulated_device(limit) if limit else contextlib.nullcontext():
            trainer(*callbacks, accumulate_grad_batches=2, max_steps=2).fit(model, loader(rows=256))
        assert_same_parameters(model, reference, rtol=1e-12, atol=1e-12)
    assert _attached(model) == {}


class FailingInAWindow(MLP):
    """Fails in the second batch of an accumulation window, as ``failure`` says, with .grad holding the first's."""

    def __init__(self, failure: str) -> None:
        super().__init__()
        self.failure, self.batch = failure, -1
        self.before: list[torch.Tensor] = []

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.batch = batch_idx
        if batch_idx == 1:
            self.before = [parameter.grad.clone() for parameter in self.parameters()]

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        failing = batch_idx == 1
        if failing and self.failure in ("step", "interrupt"):
            raise ValueError("the step's own error") if self.failure == "step" else KeyboardInterrupt
        hidden = self.net[1](self.net[0](x))
        if failing and self.failure == "backward":
            hidden = RaiseInBackward.apply(hidden)
        loss = F.cross_entropy(self.net[2](hidden), y)
        self.log("train_loss", loss)
        return loss

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if self.failure == "log" and self.batch == 1:
            raise make_oom()  # where Lightning's log allocates: held, it runs after the step returned
        super().log(name, value, *args, **kwargs)


@pytest.mark.parametrize("failure", ["step", "interrupt", "backward", "log"])
def test_an_error_in_a_window_leaves_the_windows_gradients_as_they_were(failure: str) -> None:
    # The step after the first of a window runs with the window's gradients set aside: they were lost.
    raised = {"step": ValueError, "interrupt": SystemExit, "backward": ValueError, "log": torch.OutOfMemoryError}
    for callbacks in ((), (OOMRecovery(),)):
        model = FailingInAWindow(failure)
        with _sigint_kept(), pytest.raises(raised[failure]):
            trainer(*callbacks, accumulate_grad_batches=2, max_steps=2).fit(model, loader(rows=256))
        assert len(model.before) == 4, "the first batch of the window ran its backward"
        if failure == "backward" and not callbacks:
            continue  # without the callback, the head's gradients of the failed backward stay added in
        for parameter, before in zip(model.parameters(), model.before, strict=True):
            assert parameter.grad is not None, f"{failure}, callbacks {callbacks}: a gradient was lost"
            assert torch.equal(parameter.grad, before), f"{failure}, callbacks {callbacks}"
        assert _attached(model) == {}


def test_validate_that_raises_leaves_the_module_as_it_was() -> None:
    model = Shared()
    own = _attached(model)
    recovery = OOMRecovery(minimum=64)
    with pytest.raises(BatchSizeExhausted), simulated_device(EVAL_LIMIT):
        trainer(recovery).validate(model, loader(rows=128), verbose=False)
    assert _attached(model) == own
    # The callback, which may serve the next trainer, keeps nothing of the module; Lightning's own
    # log and log_dict, which it gives every callback, aside.
    vars(recovery).pop("log", None)
    vars(recovery).pop("log_dict", None)
    gone = weakref.ref(model)
    del model, own
    gc.collect()
    assert gone() is None


class Shared(MLP):
    """Its steps are set on the instance, to share code between them: a usual Lightning pattern."""

    def __init__(self) -> None:
        super().__init__()
        self.training_step = self._shared_train
        self.validation_step = self._shared_eval

    def _shared_train(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def _shared_eval(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y))


def test_steps_set_on_the_instance_are_served_and_put_back_as_they_were() -> None:
    model = Shared()
    own = _attached(model)
    assert own.keys() == {"training_step", "validation_step"}
    expected = trainer().validate(model, loader(rows=128), verbose=False)
    events: list[Any] = []
    with simulated_device(EVAL_LIMIT):
        got = trainer(OOMRecovery(on_oom=events.append)).validate(model, loader(rows=128), verbose=False)
    assert events, "the validation step was split"
    assert got[0]["val_loss"] == pytest.approx(expected[0]["val_loss"], rel=1e-12)
    assert _attached(model) == own

    reference = Shared()
    trainer().fit(reference, loader(rows=128))
    events.clear()
    with simulated_device(FIT_LIMIT):
        trainer(OOMRecovery(on_oom=events.append)).fit(model, loader(rows=128))
    assert events, "the training step was split"
    assert_same_parameters(model, reference, rtol=1e-12, atol=1e-12)
    assert _attached(model) == own


class Sized(MLP):
    """Logs its loss with the ``batch_size`` its kind says, and a count of correct predictions, per epoch."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def _size(self, x: torch.Tensor) -> Any:
        return {"fixed": 64, "rows": len(x), "tensor": torch.tensor(len(x)), "none": None}[self.kind]

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        self.log("loss", loss, on_step=False, on_epoch=True, batch_size=self._size(x))
        self.log("correct", (logits.argmax(1) == y).sum(), on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", F.cross_entropy(logits, y), batch_size=self._size(x))
        self.log("val_correct", (logits.argmax(1) == y).sum())
        self.log("val_any", (logits.argmax(1) == y).any())


def _sized_metrics(kind: str, limit: str | None, fit: bool) -> dict[str, float]:
    model = Sized(kind)
    events: list[Any] = []
    callbacks = (OOMRecovery(on_oom=events.append),) if limit else ()
    with simulated_device(limit) if limit else contextlib.nullcontext():
        if fit:  # 160 rows in batches of 64, 64 and 32: a fixed batch_size is not the last batch's rows
            run = trainer(*callbacks, max_steps=-1, max_epochs=1)
            run.fit(model, loader(rows=160))
            metrics = {name: float(value) for name, value in run.callback_metrics.items()}
        else:
            metrics = trainer(*callbacks).validate(model, loader(rows=160), verbose=False)[0]
    assert bool(events) == bool(limit), "split where limited"
    return metrics


@pytest.mark.parametrize("kind", ["fixed", "rows", "tensor", "none"])
@pytest.mark.parametrize("fit", [True, False], ids=["fit", "validate"])
def test_a_split_step_logs_the_batch_size_the_whole_batchs_call_passes(kind: str, fit: bool) -> None:
    expected = _sized_metrics(kind, None, fit)
    got = _sized_metrics(kind, FIT_LIMIT if fit else EVAL_LIMIT, fit)
    name = "loss" if fit else "val_loss"
    assert got[name] == pytest.approx(expected[name], rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("fit", [True, False], ids=["fit", "validate"])
def test_a_count_logged_by_a_split_step_is_added_up_as_accumulate_adds_counts(fit: bool) -> None:
    expected = _sized_metrics("none", None, fit)
    got = _sized_metrics("none", FIT_LIMIT if fit else EVAL_LIMIT, fit)
    names = ["correct"] if fit else ["val_correct", "val_any"]
    assert {name: got[name] for name in names} == pytest.approx({name: expected[name] for name in names}, rel=1e-12)


class Prefixed(MLP):
    """Overrides ``log`` to prefix the names, as modules do, passing the options on to Lightning's."""

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        super().log(f"train/{name}", value, *args, **kwargs)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        self.log("loss", loss, prog_bar=True, on_epoch=True)
        self.log("max", logits.max(), True, reduce_fx="max")  # prog_bar by position, as Lightning's log reads it
        return loss


class Tagged(MLP):
    """Overrides ``log`` with a parameter of its own, given by position or by name, and passes the rest on."""

    def log(self, name: str, value: Any, tag: str = "train", **kwargs: Any) -> None:
        super().log(f"{tag}/{name}", value, **kwargs)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        self.log("loss", loss, "fit", prog_bar=True, on_epoch=True)
        self.log("max", logits.max(), tag="fit", prog_bar=True, reduce_fx="max")
        return loss


@pytest.mark.parametrize("limit", [None, FIT_LIMIT])
@pytest.mark.parametrize("module", [Prefixed, Tagged])
def test_a_modules_own_log_that_passes_its_options_on_gets_them_as_called(module: type, limit: str | None) -> None:
    unlimited = trainer()
    unlimited.fit(module(), loader(rows=128))
    limited = trainer(OOMRecovery())
    with simulated_device(limit) if limit else contextlib.nullcontext():
        limited.fit(module(), loader(rows=128))
    assert limited.callback_metrics.keys() == unlimited.callback_metrics.keys()
    shown = limited.progress_bar_metrics.keys()
    prefix = "train" if module is Prefixed else "fit"
    assert shown == unlimited.progress_bar_metrics.keys() >= {f"{prefix}/loss_step", f"{prefix}/max"}
    for name, value in unlimited.callback_metrics.items():
        torch.testing.assert_close(limited.callback_metrics[name], value, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("sizes", "rows", "expected"),
    [
        ([None, None], [32, 32], None),  # none passed: none, for Lightning to find in the whole batch
        ([64, 64], [32, 32], 64),  # a fixed size: as passed
        ([64, 64, 64], [16, 8, 8], 64),
        ([32, 32], [32, 32], 64),  # each micro-batch's rows (len(x)), even if also a fixed size could be that
        ([32, 16], [32, 16], 48),
        ([300, 250], [32, 32], 550),  # another count (tokens): added up
        ([40, 40], [32, 32], 40),  # ... but the same in each micro-batch, and not its rows: taken for a fixed size
        ([None, 64], [32, 32], 64),
    ],
)
def test_a_split_steps_batch_size_follows_the_documented_rule(sizes: list[Any], rows: list[int], expected: int) -> None:
    assert batch_size(sizes, rows) == expected
    tensors = [None if size is None else torch.tensor(size) for size in sizes]
    got = batch_size(tensors, rows)
    assert (got if got is None else int(got)) == expected


@pytest.mark.parametrize(
    ("sizes", "rows", "expected"),
    [
        ([300, 250], [32, 32], [300, 250]),  # a count (tokens): the values are its means
        ([0, 250], [32, 32], [0, 250]),  # a micro-batch that counted nothing weighs nothing
        ([32, 16], [32, 16], [32, 16]),
        ([64, 64], [32, 16], [32, 16]),  # a fixed size: the rows
        ([None, 64], [32, 32], [32, 32]),
        ([0, 0], [32, 16], [32, 16]),  # nothing counted anywhere: the mean of none, as the whole batch's
    ],
)
def test_a_split_steps_means_are_weighed_by_the_counts_logged_with_them(
    sizes: list[Any], rows: list[int], expected: list[int]
) -> None:
    assert weights(sizes, rows) == expected
    assert weights([None if size is None else torch.tensor(size) for size in sizes], rows) == expected


class EvenCounted(MLP):
    """Logs a mean over some rows only (the even classes'), with their count as ``batch_size``: a token mean's way."""

    def _even(self, batch: Any, prefix: str) -> None:
        x, y = batch
        even = y % 2 == 0
        loss = F.cross_entropy(self.net(x[even]), y[even])
        self.log(f"{prefix}even_loss", loss, on_step=False, on_epoch=True, batch_size=int(even.sum()))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self._even(batch, "")
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        self._even(batch, "val_")


@pytest.mark.parametrize(
    ("fit", "limit"), [(True, "400KiB"), (True, "300KiB"), (False, "200KiB"), (False, "150KiB")]
)  # split in two, in four or more
def test_a_mean_over_counted_items_logged_with_their_count_is_the_whole_batchs(fit: bool, limit: str) -> None:
    """One batch: its value is the epoch's, whatever batch_size weighs it there (see the rule above)."""

    def run(limit: str | None) -> float:
        model, events = EvenCounted(), []
        callbacks = (OOMRecovery(on_oom=events.append),) if limit else ()
        with simulated_device(limit) if limit else contextlib.nullcontext():
            if fit:
                fitted = trainer(*callbacks, max_steps=1)
                fitted.fit(model, loader(rows=64))
                value = float(fitted.callback_metrics["even_loss"])
            else:
                value = trainer(*callbacks).validate(model, loader(rows=64), verbose=False)[0]["val_even_loss"]
        assert bool(events) == bool(limit), "split where limited"
        return value

    assert run(limit) == pytest.approx(run(None), rel=1e-12)


class ScaledFirst(MLP):
    """Takes dict batches whose first tensor is a number, from which Lightning infers a batch_size of 1."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = F.cross_entropy(self.net(batch["x"]) * batch["scale"], batch["y"])
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        self.log("val_loss", F.cross_entropy(self.net(batch["x"]) * batch["scale"], batch["y"]))


def _scaled_first(rows: int) -> torch.utils.data.DataLoader[Any]:
    def collate(samples: list[Any]) -> dict[str, torch.Tensor]:
        x, y = default_collate(samples)
        return {"scale": torch.tensor(1.0, dtype=torch.float64), "x": x, "y": y}

    return torch.utils.data.DataLoader(loader(rows).dataset, batch_size=64, collate_fn=collate)


@pytest.mark.parametrize("fit", [True, False], ids=["fit", "validate"])
def test_a_split_step_that_passes_no_batch_size_is_weighed_as_lightning_weighs_the_whole_batch(fit: bool) -> None:
    """3 batches of 64 rows and one of 10: each counts once in the epoch's mean, as Lightning weighs them."""

    def run(limit: str | None) -> float:
        model, events = ScaledFirst(), []
        callbacks = (OOMRecovery(on_oom=events.append),) if limit else ()
        with simulated_device(limit) if limit else contextlib.nullcontext():
            if fit:
                limited = trainer(*callbacks, max_steps=-1, max_epochs=1)
                limited.fit(model, _scaled_first(202))
                value = float(limited.callback_metrics["train_loss"])
            else:
                value = trainer(*callbacks).validate(model, _scaled_first(202), verbose=False)[0]["val_loss"]
        assert bool(events) == bool(limit), "split where limited"
        return value

    assert run(FIT_LIMIT if fit else EVAL_LIMIT) == pytest.approx(run(None), rel=1e-12)


def test_a_split_steps_logged_values_combine_as_accumulate_combines_outputs() -> None:
    counts = [torch.tensor(3), torch.tensor(5)]
    assert torch.equal(combined(counts, [32, 16], "mean"), torch.tensor(8))
    flags = [torch.tensor(False), torch.tensor(True)]
    assert torch.equal(combined(flags, [32, 16], "mean"), torch.tensor(True))
    means = [torch.tensor(3.0, dtype=torch.float64), torch.tensor(6.0, dtype=torch.float64)]
    assert torch.equal(combined(means, [32, 16], "mean"), torch.tensor(4.0, dtype=torch.float64))
    assert combined([3, 6], [32, 16], "mean") == 4.0  # a Python number is taken for a mean
    assert torch.equal(combined(counts, [32, 16], "max"), torch.tensor(5))
    assert torch.equal(combined(counts, [32, 16], "sum"), torch.tensor(8))


def _logged(module: Any, limit: str | None, **options: Any) -> dict[str, float]:
    """Fit ``module`` on the plain trainer (``limit`` None) or with the callback under ``limit``: the logged values."""
    events: list[Any] = []
    callbacks = [] if limit is None else [OOMRecovery(on_oom=events.append)]
    fitted = trainer(*callbacks, **options)
    with simulated_device(limit or "1GiB"):
        fitted.fit(module, loader(rows=256))
    assert bool(events) == (limit is not None and limit != "1GiB"), "split where limited"
    return {name: float(value) for name, value in fitted.callback_metrics.items()}


class ChangedAfterLogging(MLP):
    """Logs a buffer and the loss, then changes both in place: Lightning logs their values at the call."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros((), dtype=torch.float64))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        self.log("seen", self.seen)
        self.seen += 1
        loss = F.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        loss *= 0.5
        return loss


@pytest.mark.parametrize("limit", ["1GiB", FIT_LIMIT], ids=["whole", "split"])
def test_a_tensor_the_step_changes_after_logging_it_is_logged_as_it_was_at_the_call(limit: str) -> None:
    expected = _logged(ChangedAfterLogging(), None, max_steps=2)
    got = _logged(ChangedAfterLogging(), limit, max_steps=2)
    assert got["loss"] == pytest.approx(expected["loss"], rel=1e-12)
    if limit == "1GiB":  # whole only: split, each micro-batch logs the buffer as it found it, then adds to it
        assert got["seen"] == expected["seen"]


# Every spelling Lightning reads as one of its four reductions (its _Metadata._parse_reduce_fx).
_SPELLINGS: dict[str, Any] = {
    "MAX": "MAX",
    "builtin max": max,
    "Min": "Min",
    "builtin min": min,
    "Sum": "Sum",
    "builtin sum": sum,
    "Mean": "Mean",
    "AVG": "AVG",
    "torch.max": torch.max,
    "torch.mean": torch.mean,
}


class Reduced(MLP):
    """Logs a value of its batch under every spelling of a reduction, for the step and for the epoch."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        rows = x.mean(1)
        values = {"sum": x.sum(), "max": rows.max(), "min": rows.min()}
        for name, reduce_fx in _SPELLINGS.items():
            value = next((values[kind] for kind in values if kind in name.lower()), rows.mean())
            self.log(name, value, reduce_fx=reduce_fx, on_step=True, on_epoch=True)
        return F.cross_entropy(self.net(x), y)


def test_every_spelling_of_reduce_fx_that_lightning_accepts_combines_a_split_steps_values_as_it_reduces() -> None:
    expected = _logged(Reduced(), None, max_steps=-1, max_epochs=1)
    got = _logged(Reduced(), FIT_LIMIT, max_steps=-1, max_epochs=1)
    assert got.keys() == expected.keys()
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-12)


class LoggedTwice(MLP):
    """Logs names more than once in a step: a helper called per class, and once per row of label 0."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        for label in (0, 1):
            self.log("labelled", (y == label).sum(), reduce_fx="sum", on_step=True, on_epoch=True)
            self.log("share", (y == label).double().mean(), on_step=True, on_epoch=True)
        # As many calls as the micro-batch has rows of label 0: a number that differs between them.
        for _ in range(int((y == 0).sum())):
            self.log("zeros", 1.0, reduce_fx="sum", on_step=False, on_epoch=True)
        return F.cross_entropy(self.net(x), y)


def test_a_name_logged_more_than_once_in_a_split_step_reaches_the_epochs_value_as_without_the_callback() -> None:
    expected = _logged(LoggedTwice(), None, max_steps=-1, max_epochs=1)
    got = _logged(LoggedTwice(), FIT_LIMIT, max_steps=-1, max_epochs=1)
    assert expected["zeros"] == int((loader(rows=256).dataset.tensors[1] == 0).sum())
    assert got.keys() == expected.keys()
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-12)


class _GraphLogged(MLP):
    """Logs its loss with ``enable_graph=True``; the second micro-batch of the first split runs out of memory."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[int] = []
        self.logged: list[weakref.ref[Marker]] = []  # of each step's graph
        self.alive: list[bool] = []  # at each call, whether the previous calls' logged values are alive
        self.told: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        gc.collect()
        self.alive.append(any(ref() is not None for ref in self.logged))
        self.rows.append(len(x))
        hidden = self.net[1](self.net[0](x))
        if len(self.rows) == 3:  # a real out-of-memory error in this micro-batch's backward
            hidden.register_hook(lambda grad: torch.empty(2**24))
        marker = Marker()
        loss = F.cross_entropy(Marked.apply(self.net[2](hidden), marker), y)
        self.log("train_loss", loss, enable_graph=True)  # the value holds the micro-batch's graph
        self.logged.append(weakref.ref(marker))
        return loss


def test_what_a_failed_attempt_logged_with_its_graph_is_gone_when_the_retry_starts() -> None:
    model = _GraphLogged()
    with simulated_device(FIT_LIMIT):
        trainer(OOMRecovery(on_oom=lambda event: model.told.append(event.batch_size)), max_steps=1).fit(model, loader())
    # The whole batch, then micro-batches of 32 whose second failed in its backward, then of 16.
    assert model.rows == [64, 32, 32, 16, 16, 16, 16], model.rows
    assert model.told == [64, 32]  # the user's own on_oom is still told
    # The first split's micro-batches had logged their losses, each holding its graph: dropped with the attempt.
    assert model.alive[3] is False, model.alive


class _GraphLoggedEnds(_GraphLogged):
    """Also looks, as each batch ends, at whether any value its steps logged is alive."""

    def __init__(self) -> None:
        super().__init__()
        self.ended: list[bool] = []

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        gc.collect()
        self.ended.append(any(ref() is not None for ref in self.logged))


def test_what_a_split_step_logged_with_its_graph_is_gone_when_the_step_ends() -> None:
    # Lightning keeps the combined value, detached; the last micro-batch's own, with its graph, stayed
    # held through the optimizer's step, until the next step began.
    model = _GraphLoggedEnds()
    with simulated_device(FIT_LIMIT):
        trainer(OOMRecovery(), max_steps=2).fit(model, loader(rows=128))
    assert model.rows == [64, 32, 32, 16, 16, 16, 16, 16, 16, 16, 16], model.rows
    assert model.ended == [False, False], model.ended


def test_handing_a_split_steps_gradients_to_lightning_makes_no_tensor() -> None:
    # Under DDP it runs after the ranks agreed: a scalar it made could run out of memory on one rank alone.
    from koila_retry.integrations.lightning import _Delivery, _Held

    parameter = torch.nn.Parameter(torch.ones(3))
    loss, held = torch.tensor(2.0), _Held([torch.full((3,), 5.0)], None, True)
    with simulated_device("1KiB") as device:
        delivered = _Delivery.apply(held, loss, parameter)
        assert device.live == 0
    delivered.backward()
    assert delivered.item() == 2.0
    assert torch.equal(parameter.grad, torch.full((3,), 5.0))


class WritesThenRaises(MLP):
    """Writes .grad itself in the second batch of a window, then raises; keeps the first batch's gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.first: torch.Tensor | None = None

    def on_after_backward(self) -> None:
        self.first = self.net[0].weight.grad.clone()

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if batch_idx == 1:
            x, y = batch
            F.cross_entropy(self.net(x), y).backward()
            raise ValueError("the step's own error")
        return super().training_step(batch, batch_idx)


def test_a_step_that_writes_gradients_itself_and_fails_leaves_the_window_s_as_they_were() -> None:
    """The window's gradients are set aside before the step (and back in .grad for on_before_backward)."""
    model = WritesThenRaises()
    with pytest.raises(ValueError, match="the step's own error"):
        trainer(OOMRecovery(), accumulate_grad_batches=2).fit(model, loader(rows=128))
    assert model.first is not None
    torch.testing.assert_close(model.net[0].weight.grad, model.first, rtol=0, atol=0)


# Seconds the spawned group may take for all its scenarios (tests/_lightning_ddp_ranks.py): a guard
# against ranks that hang, not a measure of speed.
DDP_DEADLINE = 300.0


@pytest.fixture(scope="module")
def ddp_ranks(tmp_path_factory: pytest.TempPathFactory) -> Any:
    import _lightning_ddp_ranks
    from _spawn import Groups

    return Groups(_lightning_ddp_ranks, tmp_path_factory, DDP_DEADLINE)("two")


@pytest.mark.timeout(DDP_DEADLINE + 120)
@pytest.mark.parametrize("name", ["lightning_static_graph", "lightning_static_graph_hooks"])
def test_ddp_with_a_static_graph_trains_as_the_plain_trainer_on_both_ranks(ddp_ranks: Any, name: str) -> None:
    """DDP counts in its first step every gradient a parameter gets, the micro-batches' delivery included."""
    values = ddp_ranks[name]
    for run in ("all_the_memory", "rank_1_limited"):
        for index, (mine, theirs) in enumerate(
            zip(values[0][run]["parameters"], values[1][run]["parameters"], strict=True)
        ):
            assert torch.equal(mine, theirs), f"{run}: parameter {index} differs between the ranks"
    for rank, value in enumerate(values):
        assert value["plain_steps"] == value["all_the_memory"]["steps"] == value["rank_1_limited"]["steps"] == 4
        assert value["all_the_memory"]["events"] == []
        assert (64, 1) in value["rank_1_limited"]["events"], value["rank_1_limited"]["events"]
        for run, tolerance in (("all_the_memory", 0.0), ("rank_1_limited", 1e-12)):
            assert value[run]["warnings"] == []
            assert value[run]["accumulated"] == value["plain_accumulated"]
            for index, (mine, theirs) in enumerate(zip(value[run]["parameters"], value["expected"], strict=True)):
                message = f"{run}, rank {rank}, parameter {index}"
                torch.testing.assert_close(mine, theirs, rtol=tolerance, atol=tolerance, msg=message)


def test_the_integration_without_lightning_names_the_extra() -> None:
    # A bare "No module named 'lightning'", where the transformers integration names its extra (probe 74M).
    code = (
        "import sys\n"
        "sys.modules['lightning'] = None\n"
        "try:\n"
        "    import koila_retry.integrations.lightning\n"
        "except ImportError as error:\n"
        "    print(error)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert "koila_retry.integrations.lightning needs lightning (koila-retry's lightning extra)" in done.stdout


class WatchedHead(Lean):
    """Its whole step's backward runs out of memory once the head's gradients are written."""

    def __init__(self, error: str = "oom") -> None:
        super().__init__()
        self.freed: list[bool] = []
        self.error = error

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        hidden = self.net[0](x)
        if len(x) == 64:
            hidden = WatchFreed.apply(hidden, list(self.net[2].parameters()), self.freed, self.error)
        return F.cross_entropy(self.net[2](self.net[1](hidden)), y)


@pytest.mark.parametrize("error", ["oom", "other"])
def test_a_failed_whole_backward_s_gradients_are_freed_after_every_grad_is_cleared(error: str) -> None:
    # Freed one by one inside .grad's setter, where a read of that .grad (another thread's step giving up,
    # koila.report) crashes the process (probes 75G, 75K: a bus error, a segmentation fault).
    model = WatchedHead(error)
    if error == "oom":
        trainer(OOMRecovery(), max_steps=1).fit(model, loader(rows=64))
    else:
        with pytest.raises(RuntimeError, match="a hook of the user's"):
            trainer(OOMRecovery(), max_steps=1).fit(model, loader(rows=64))
    assert model.freed == [True, True]


class Penalised(ZeroedByItself):
    """Its step backpropagates a penalty itself, then returns the loss; its own zero_grad follows."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        (self.net[0].weight.square().sum() * 1e-3).backward()
        return super().training_step(batch, batch_idx)


def test_a_step_that_writes_grad_itself_before_its_own_zero_grad_trains_as_without_the_callback() -> None:
    # The gradients set aside were put back only where the step wrote none: the zero cleared the step's
    # own, and the old ones were added back after the backward (probe 75I: parameters 0.03 off).
    reference, model = Penalised(), Penalised()
    model.load_state_dict(reference.state_dict())
    trainer(max_steps=3).fit(reference, loader(rows=192))
    trainer(OOMRecovery(), max_steps=3).fit(model, loader(rows=192))
    assert_same_parameters(model, reference, rtol=0, atol=0)


class _OOMAtGrowthTracker(TorchDispatchMode):
    """Runs out of memory once, as GradScaler makes its growth tracker (its int32 full) after its scale."""

    def __init__(self) -> None:
        super().__init__()
        self.fired = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not self.fired and func is torch.ops.aten.full.default and kwargs.get("dtype") == torch.int32:
            self.fired += 1
            raise make_oom()
        return func(*args, **kwargs)


def test_a_grad_scaler_half_made_by_the_loop_s_own_backward_is_made_again() -> None:
    # Lightning's backward of the whole batch ran out of memory between the scaler's scale and its tracker:
    # the micro-batches ran, and the optimizer step asserted on the missing tracker (probe 77L).
    from lightning.pytorch.plugins.precision import MixedPrecision

    precision = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
    events: list[Any] = []
    failing = _OOMAtGrowthTracker()
    try:
        with failing:
            trainer(OOMRecovery(on_oom=events.append), plugins=[precision]).fit(Float32MLP(), loader(rows=128))
    except (RuntimeError, ValueError) as error:  # pragma: no cover - depends on the CPU build
        if "float16" not in str(error).lower() and "half" not in str(error).lower():
            raise
        pytest.skip(f"float16 autocast does not train on this CPU build of torch: {error}")
    assert failing.fired == 1
    assert len(events) == 1
    assert precision.scaler._growth_tracker is not None
