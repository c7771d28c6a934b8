"""``adapt``'s own attempt of a whole batch leaves nothing pinned by an out-of-memory error a user kept.

A step that ran whole as the trainer runs it and ran out of memory kept only the error's message and
place, but never cleared its frames: a ``compute_loss`` that stores the error it re-raises (as
docs/recovery.rst says is handled) pinned the failed attempt's activations, and the micro-batches
that would have fitted ran out of memory too, up to ``BatchSizeExhausted``.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _hf_trainer import make_trainer  # noqa: E402 (after the skip)

from koila_retry.integrations.transformers import adapt  # noqa: E402
from koila_retry.testing import simulated_device  # noqa: E402


@pytest.fixture(autouse=True)
def no_mixed_precision_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers 4 leaves a bf16 or fp16 trainer's precision in os.environ, for every later trainer."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")


class Keeps(transformers.Trainer):  # type: ignore[misc]
    """A ``compute_loss`` that keeps every out-of-memory error it re-raises."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.errors: list[BaseException] = []

    def compute_loss(
        self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        try:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        except torch.OutOfMemoryError as error:
            self.errors.append(error)
            raise


def watched(trainer: Any) -> list[tuple[int, weakref.ref[torch.Tensor]]]:
    """The rows and a weak reference of every output of the first block's MLP: the attempts' activations."""
    seen: list[tuple[int, weakref.ref[torch.Tensor]]] = []
    mlp = trainer.model.transformer.h[0].mlp
    mlp.register_forward_hook(lambda module, args, output: seen.append((len(output), weakref.ref(output))))
    return seen


def test_a_kept_error_of_a_whole_training_step_pins_none_of_its_tensors(tmp_path: Path) -> None:
    trainer = adapt(make_trainer(tmp_path, Keeps))
    seen = watched(trainer)
    with simulated_device("1MiB"):  # 8 rows run out of memory, 4 fit
        trainer.train()
    stats = trainer.training_step.stats
    assert stats.ooms == 1
    assert stats.batch_size == 4
    assert trainer.errors  # still kept: its frames hold no tensor
    assert [rows for rows, output in seen if output() is not None] == []


def test_a_kept_error_of_a_whole_prediction_step_pins_none_of_its_tensors(tmp_path: Path) -> None:
    trainer = adapt(make_trainer(tmp_path, Keeps))
    seen = watched(trainer)
    with simulated_device("256KiB"):  # 8 rows run out of memory
        metrics = trainer.evaluate()
    assert trainer.prediction_step.stats.ooms >= 1
    assert trainer.errors
    assert metrics["eval_loss"] > 0
    assert [rows for rows, output in seen if output() is not None] == []
