"""koila.accumulate with threads that share one model: each step's gradient is added once, whole, into ``.grad``.

Four threads train one model at once, each running a step over its own batch that runs out
of memory once part-way through. Plain concurrent ``loss.backward()`` on one model adds
every batch's gradient into ``.grad`` (autograd locks each leaf while it adds), so after
the threads are joined ``.grad`` holds the sum of the four batches' gradients; the steps
must leave the same, however their micro-batches and failures interleave.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from _layers import OOMInBackward
from torch import nn
from torch.nn import functional as F

import koila_retry as koila
from koila_retry.testing import make_oom

DTYPE = torch.float64
RTOL, ATOL = 1e-7, 1e-10
THREADS, ROWS, TRIALS = 4, 64, 10


def _data(n: int, *shape: int, seed: int) -> torch.Tensor:
    return torch.randn(n, *shape, generator=torch.Generator().manual_seed(seed), dtype=DTYPE)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)).to(DTYPE)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(_data(ROWS, 16, seed=2 * i), _data(ROWS, 1, seed=2 * i + 1)) for i in range(THREADS)]


def _plain_gradients(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """The sum of the batches' full-batch gradients, one plain backward each, on one thread."""
    model.zero_grad(set_to_none=True)
    for x, y in batches:
        F.mse_loss(model(x), y).backward()
    sums = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)
    return sums


def _give_grads(model: nn.Module) -> list[torch.Tensor]:
    """Set nonzero gradients on every parameter; return each as it is, the tensor object itself."""
    for i, p in enumerate(model.parameters()):
        p.grad = torch.full_like(p, 0.5) + _data(p.numel(), seed=100 + i).view_as(p)
    return [p.grad for p in model.parameters()]  # type: ignore[misc]


@pytest.fixture
def frequent_switches() -> Iterator[None]:
    """Let the interpreter switch threads about every instruction, so that races show at once."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


def _run_together(work: Callable[[int], None]) -> None:
    """Run ``work(number)`` in ``THREADS`` threads released by one barrier; re-raise what one raised."""
    barrier = threading.Barrier(THREADS)
    errors: list[BaseException] = []

    def worker(number: int) -> None:
        barrier.wait()
        try:
            work(number)
        except BaseException as exc:  # pragma: no cover - only on failure
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(number,)) for number in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


class _OncePerThread:
    """Runs out of memory once in each thread, on the thread's ``fail_on``-th call (from 1), in forward or backward."""

    def __init__(self, where: str, fail_on: int = 2) -> None:
        self.where, self.fail_on = where, fail_on
        self.local = threading.local()

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        calls = getattr(self.local, "calls", 0) + 1
        self.local.calls = calls
        if calls != self.fail_on:
            return h
        if self.where == "forward":
            raise make_oom()
        return OOMInBackward.apply(h)  # its backward runs after the head's gradients were computed


def _step(model: nn.Module, fail: _OncePerThread) -> Any:
    # NoCache: no thread starts at a size another thread found, so every step fails once.
    @koila.accumulate(initial=ROWS // 2, cache=koila.NoCache())
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = model[:2](x)
        return F.mse_loss(model[2:](fail(h)), y)

    return step


@pytest.mark.usefixtures("frequent_switches")
@pytest.mark.parametrize("before", [False, True], ids=["no-grads-before", "grads-before"])
@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("shared", [True, False], ids=["one-decorated-function", "one-per-thread"])
def test_threads_sharing_a_model_leave_the_sum_of_their_batches_gradients(
    shared: bool, where: str, before: bool
) -> None:
    model, batches = _model(), _batches()
    expected = _plain_gradients(model, batches)
    for trial in range(TRIALS):
        model.zero_grad(set_to_none=True)
        given = _give_grads(model) if before else [None] * len(expected)
        values = [None if g is None else g.clone() for g in given]
        fail = _OncePerThread(where)
        steps = [_step(model, fail)] * THREADS if shared else [_step(model, fail) for _ in range(THREADS)]

        def work(number: int, steps: list[Any] = steps) -> None:
            steps[number](*batches[number])

        _run_together(work)
        assert sum(step.stats.ooms for step in set(steps)) == THREADS, "each step ran out of memory once"
        for (name, p), want, grad, value in zip(model.named_parameters(), expected, given, values, strict=True):
            assert p.grad is not None, name
            if grad is not None:
                assert p.grad is grad, f"{name}: the gradient from before is the same tensor, added to in place"
                want = want + value
            torch.testing.assert_close(
                p.grad, want, rtol=RTOL, atol=ATOL, msg=lambda m, name=name, trial=trial: f"trial {trial}, {name}: {m}"
            )
