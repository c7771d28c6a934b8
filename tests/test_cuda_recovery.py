"""Real out-of-memory errors on a device with a limit: each front end settles on the power of two that fits.

Each test runs on CUDA (marked ``cuda``; the limit is a fraction of the card, the error
the caching allocator's own) and on the CPU stand-in (``simulated_device``), with the same
steps. The limit is worked out from the peak of a run by hand that fits: halfway between
what the hand-written loop needs at the expected size ``s`` and at ``2 * s``, so that
``s`` fits, ``2 * s`` does not, and rounding or the allocator's segments cannot change
the outcome. Every call starts at ``8 * s``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from _devices import Device, Meter, device_fixture
from torch import nn
from torch.nn import functional

import koila_retry as koila

device = device_fixture()

FRONT_ENDS = ("batch", "accumulate", "chunked")
FEATURES, CLASSES = 16, 16
# Hidden width and expected size per kind of device: on CUDA, each hidden activation at
# the expected size is 16 MiB, so every one gets segments of its own, rounded to 2 MiB.
SHAPES = {"cuda": (8192, 512), "simulated": (512, 64)}


@dataclass
class Work:
    """A model, a batch of ``8 * size`` rows, and how each front end and a hand-written loop run it."""

    device: Device
    front_end: str
    hidden: int
    size: int  # the expected size
    model: nn.Module = field(init=False)
    x: torch.Tensor = field(init=False)
    y: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        torch.manual_seed(0)
        where = self.device.torch_device
        self.model = nn.Sequential(nn.Linear(FEATURES, self.hidden), nn.ReLU(), nn.Linear(self.hidden, CLASSES))
        self.model.to(where)
        self.x = torch.randn(8 * self.size, FEATURES, device=where)
        self.y = torch.randint(0, CLASSES, (8 * self.size,), device=where)

    def by_hand(self, size: int) -> None:
        """Run the work in pieces of ``size`` rows, as one would write it without koila."""
        if self.front_end == "accumulate":
            self.model.zero_grad(set_to_none=True)
            for xb, yb in zip(self.x.split(size), self.y.split(size)):
                (functional.cross_entropy(self.model(xb), yb) * len(xb) / len(self.x)).backward()
            self.model.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                torch.cat([self.model(xb) for xb in self.x.split(size)])

    def rise(self, size: int) -> int:
        """Return the most bytes the hand-written loop adds to what is allocated, at ``size``."""
        self.by_hand(size)  # a warm-up: cuBLAS's workspace, kept for the process, is made here
        with self.device.measuring() as meter:
            before = meter.allocated()
            self.by_hand(size)
            return meter.peak() - before

    def run(self, *, minimum: int, on_oom: Callable[[koila.OOMEvent], object], start: Callable[[], None]) -> int:
        """Run the work through the front end, from ``8 * size``; return the size it settled on."""
        options: dict[str, Any] = {"minimum": minimum, "cache": koila.NoCache(), "on_oom": on_oom}
        model, x, y = self.model, self.x, self.y
        if self.front_end == "batch":

            @koila.batch(initial=len(x), **options)
            def evaluate(batch_size: int) -> torch.Tensor:
                start()
                with torch.no_grad():
                    return torch.cat([model(xb) for xb in x.split(batch_size)])

            evaluate()
            return evaluate.stats.batch_size
        if self.front_end == "accumulate":

            @koila.accumulate(initial=len(x), **options)
            def step(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
                start()
                return functional.cross_entropy(model(xb), yb)

            model.zero_grad(set_to_none=True)
            step(x, y)
            return step.stats.batch_size

        def forward(rows: torch.Tensor) -> torch.Tensor:
            start()
            return model(rows)

        encode = koila.chunked(initial=len(x), **options)(forward)
        with torch.no_grad():
            encode(x)
        return encode.stats.batch_size


@dataclass
class Probe:
    """What ``allocated()`` read at the first call of every retry, told apart by ``on_oom``."""

    meter: Meter
    failed: list[int] = field(default_factory=list)  # the sizes that ran out of memory
    at_retry: list[int] = field(default_factory=list)
    _retrying: bool = False

    def on_oom(self, event: koila.OOMEvent) -> None:
        self.failed.append(event.batch_size)
        self._retrying = True

    def start(self) -> None:
        if self._retrying:
            self._retrying = False
            self.at_retry.append(self.meter.allocated())


def work(device: Device, front_end: str) -> Work:
    hidden, size = SHAPES[device.name]
    return Work(device, front_end, hidden, size)


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_a_real_oom_settles_on_the_largest_power_of_two_that_fits(device: Device, front_end: str) -> None:
    job = work(device, front_end)
    fits, too_big = job.rise(job.size), job.rise(2 * job.size)
    assert too_big > fits * 1.5, "the activations must be most of what the work needs"
    with device.limited((fits + too_big) // 2) as meter:
        probe = Probe(meter)
        before = meter.allocated()
        settled = job.run(minimum=1, on_oom=probe.on_oom, start=probe.start)
    assert settled == job.size
    assert probe.failed == [8 * job.size, 4 * job.size, 2 * job.size]
    # Every retry started with nothing of the failed attempt allocated: the call's own
    # tensors (gradients, finished chunks) were all made after the last failure.
    assert probe.at_retry == [before] * 3


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_after_giving_up_nothing_of_the_call_stays_allocated(device: Device, front_end: str) -> None:
    job = work(device, front_end)
    fits = job.rise(job.size)
    with device.limited(fits // 2) as meter:
        probe = Probe(meter)
        before = meter.allocated()
        with pytest.raises(koila.BatchSizeExhausted) as excinfo:
            job.run(minimum=job.size, on_oom=probe.on_oom, start=probe.start)
        after = meter.allocated()  # while the error, and what it was raised from, is held
        assert excinfo.value.__cause__ is not None
    assert probe.failed == [8 * job.size, 4 * job.size, 2 * job.size, job.size]
    assert probe.at_retry == [before] * 3
    assert after == before
    assert all(parameter.grad is None for parameter in job.model.parameters())
