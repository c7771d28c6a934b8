"""koila_retry.integrations.lightning.OOMRecovery under a real Lightning Trainer, on a simulated device."""

from __future__ import annotations

import subprocess
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from koila_retry.testing import simulated_device

L = pytest.importorskip("lightning")
from _lightning_trainer import EVAL_LIMIT, FIT_LIMIT, MLP, assert_same_parameters, loader, trainer  # noqa: E402

from koila_retry.integrations.lightning import OOMRecovery  # noqa: E402

# Lightning's own notices, not this library's: a module without a val_dataloader, and its
# use of a pytree name this torch deprecates.
pytestmark = [
    pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`"),
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated"),
]


@pytest.fixture(autouse=True)
def quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="lightning")
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        yield


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

    def training_step(self, batch: Any, batch_idx: int) -> Any:
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
    with simulated_device("300KiB"):
        trainer(OOMRecovery(on_oom=events.append), precision="bf16-mixed", gradient_clip_val=0.1).fit(
            model, loader(rows=128)
        )
    assert events
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
    with simulated_device("300KiB"):
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


def test_options_are_checked_when_the_callback_is_made() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'minimun'"):
        OOMRecovery(minimun=8)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="minimum"):
        OOMRecovery(initial=4, minimum=8)


def test_importing_koila_retry_does_not_import_lightning() -> None:
    code = "import sys, koila_retry; print(sorted(name for name in sys.modules if 'lightning' in name))"
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert completed.stdout.strip() == "[]"


def test_a_strategy_that_communicates_inside_the_step_is_refused_in_setup() -> None:
    from lightning.pytorch.strategies import FSDPStrategy

    callback = OOMRecovery()
    stand_in = type("Trainer", (), {"strategy": FSDPStrategy()})()  # setup reads only the strategy first
    model = MLP()
    with pytest.raises(RuntimeError, match="OOMRecovery serves one device or DDP; the trainer runs FSDPStrategy"):
        callback.setup(stand_in, model, "fit")
    assert "training_step" not in vars(model)
