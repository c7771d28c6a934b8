"""The trainer integrations' run of a step whose batch cannot be split: whole, through ``accumulate``, over one row.

Both integrations use ``_frontends.whole``; their own tests run it inside real trainers. These pin what
the helper itself promises: the step's gradient is the plain step's, nothing of a failed call is kept,
and giving up says why the batch ran whole.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch

import koila_retry as koila
from koila_retry import BatchSizeExhausted
from koila_retry._frontends.whole import Whole, unsplittable
from koila_retry.testing import make_oom


class _Patches:
    """A batch of 4 images whose patches are not rows: 16 patches, 4 labels."""

    def __init__(self) -> None:
        self.patches = torch.randn(16, 3)
        self.labels = torch.randn(4)


def _whole(step: Any) -> Whole:
    return Whole(step, "Module.training_step", koila.accumulate(initial=8), "OOMRecovery", "make it rows")


def test_a_batch_of_unequal_rows_is_unsplittable_and_a_plain_one_is_not() -> None:
    reason = unsplittable(({"patches": torch.zeros(16, 3), "labels": torch.zeros(4)},), {}, "OOMRecovery")
    assert reason is not None
    assert "16" in reason
    assert unsplittable(({"x": torch.zeros(4, 3), "y": torch.zeros(4)},), {}, "OOMRecovery") is None


def test_the_step_runs_whole_and_its_gradient_is_the_plain_steps() -> None:
    torch.manual_seed(0)
    weight = torch.randn(3, requires_grad=True)
    batch = _Patches()

    def step(batch: _Patches) -> torch.Tensor:
        return ((batch.patches @ weight).view(4, 4).sum(1) - batch.labels).square().mean()

    step(batch).backward()
    expected = weight.grad.clone()
    weight.grad = None
    whole = _whole(step)
    loss = whole(torch.device("cpu"), batch, (batch,), {}, "patches are not rows")
    assert torch.equal(weight.grad, expected)
    assert torch.equal(loss, step(batch).detach())
    assert whole.held is None


def test_giving_up_says_why_it_ran_whole_and_keeps_nothing_of_the_call() -> None:
    weight = torch.randn(3, requires_grad=True)
    batch = _Patches()
    kept = weakref.ref(batch)

    def step(batch: _Patches) -> torch.Tensor:
        raise make_oom()

    whole = _whole(step)
    with pytest.raises(BatchSizeExhausted) as caught:
        whole(torch.device("cpu"), batch, (batch,), {}, "patches are not rows")
    message = str(caught.value)
    assert message.startswith(
        "OOMRecovery cannot split the batch of Module.training_step, a _Patches: patches are not rows."
    )
    assert "To let OOMRecovery run it in micro-batches, make it rows (see the docs: Batches" in message
    assert isinstance(caught.value.__cause__, BatchSizeExhausted)
    assert weight.grad is None
    assert whole.held is None
    del batch, caught
    gc.collect()
    assert kept() is None


def test_a_batch_of_no_rows_gives_up_saying_so() -> None:
    def step(batch: torch.Tensor) -> torch.Tensor:
        raise make_oom()

    with pytest.raises(BatchSizeExhausted, match=r"^The batch of Module\.training_step has 0 rows: OOMRecovery ran"):
        _whole(step)(torch.device("cpu"), torch.zeros(0, 3), (torch.zeros(0, 3),), {}, "")


def test_a_stand_in_made_under_inference_mode_serves_a_training_step_after() -> None:
    # Lightning's validation loop runs under inference_mode, and the stand-in is kept for training steps.
    weight = torch.randn(3, requires_grad=True)
    whole = _whole(lambda x: (x @ weight).sum())
    with torch.inference_mode():
        whole(torch.device("cpu"), torch.ones(2, 3), (torch.ones(2, 3),), {}, "a reason")
    made = whole.stand_in
    assert made is not None
    assert not made.is_inference()
    whole(torch.device("cpu"), torch.ones(2, 3), (torch.ones(2, 3),), {}, "a reason")
    assert whole.stand_in is made
    assert torch.equal(weight.grad, torch.full((3,), 2.0))
