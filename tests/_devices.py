"""A device with a memory limit for the tests that run on a GPU and on a CPU stand-in alike.

Two kinds, one interface:

* ``"cuda"``: the current CUDA device. The limit is
  ``torch.cuda.set_per_process_memory_fraction``, so a large card runs out of memory as a
  small one would, with the caching allocator's real ``torch.OutOfMemoryError``; the
  readings are ``torch.cuda.memory_allocated`` and ``torch.cuda.max_memory_allocated``.
  Its tests carry the ``cuda`` marker and are skipped without a CUDA device.
* ``"simulated"``: the CPU, limited by :func:`koila_retry.testing.simulated_device`. Its
  readings count the storages created inside the block, which is what a device's
  allocator counts for the tensors a test makes there.

Every reading is compared with another one taken the same way (a rise over a value
before, one value with another), never with an absolute number: the CUDA readings
include what was allocated before the block, the simulated ones do not.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, Protocol, TypeVar

import pytest
import torch

from koila_retry.testing import SimulatedDevice, simulated_device

HAS_CUDA = torch.cuda.is_available()
ROOT = Path(__file__).resolve().parents[1]
# What a test that needs a real CUDA device carries: the marker that `tox -e gpu` selects,
# and a skip everywhere else.
CUDA = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]
UNLIMITED = 2**60  # a simulated device that never runs out: it only counts

Test = TypeVar("Test", bound=Callable[..., Any])


def run_json(script: str, *args: str) -> dict[str, Any]:
    """Run ``script`` with ``args`` in a fresh interpreter at the repository's root; return its last line's JSON.

    A CUDA test that sets a process-wide limit (``set_per_process_memory_fraction``) or
    needs a fresh caching allocator runs its case this way.
    """
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def needs_cuda(test: Test) -> Test:
    """Mark a test that runs only on CUDA: ``cuda``, and skipped without a CUDA device."""
    for mark in CUDA:
        test = mark(test)
    return test


class Meter(Protocol):
    """What a test reads of a device's memory while a :class:`Device` block is active."""

    def allocated(self) -> int:
        """Return the bytes of tensor storages alive now."""

    def peak(self) -> int:
        """Return the most bytes alive at once since the last :meth:`reset_peak`."""

    def reset_peak(self) -> None:
        """Make the peak the bytes alive now."""

    def reserved_peak(self) -> int | None:
        """Return the most bytes the allocator held at once since :meth:`reset_peak`; ``None`` if none."""


class Device(Protocol):
    """A device that tests run real models on, with or without a memory limit."""

    name: str  # "cuda" or "simulated"
    torch_device: torch.device  # where the tests put their tensors

    def measuring(self) -> AbstractContextManager[Meter]:
        """Return a block without a limit, whose meter reads what the tensors made in it hold."""

    def limited(self, budget: int) -> AbstractContextManager[Meter]:
        """Return a block in which allocating more than ``budget`` bytes above what is held now fails."""


class _CudaMeter:
    def __init__(self, device: torch.device) -> None:
        self._device = device

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self._device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self._device)

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self._device)
        torch.cuda.reset_peak_memory_stats(self._device)

    def reserved_peak(self) -> int | None:
        return torch.cuda.max_memory_reserved(self._device)


class CudaDevice:
    """The current CUDA device; a limit is a fraction of the card for this process."""

    name = "cuda"

    def __init__(self) -> None:
        self.torch_device = torch.device("cuda", torch.cuda.current_device())

    def _settle(self) -> None:
        gc.collect()
        torch.cuda.synchronize(self.torch_device)
        torch.cuda.empty_cache()

    @contextmanager
    def measuring(self) -> Iterator[Meter]:
        self._settle()
        meter = _CudaMeter(self.torch_device)
        meter.reset_peak()
        yield meter

    @contextmanager
    def limited(self, budget: int) -> Iterator[Meter]:
        # The fraction caps what the caching allocator reserves from the driver; with the
        # cache emptied, what it reserves now is the blocks of live tensors (and the free
        # space of their segments, which new tensors may use).
        self._settle()
        total = torch.cuda.get_device_properties(self.torch_device).total_memory
        fraction = (torch.cuda.memory_reserved(self.torch_device) + budget) / total
        if not 0 < fraction <= 1:
            raise ValueError(f"a budget of {budget} bytes does not fit on this card of {total} bytes")
        torch.cuda.set_per_process_memory_fraction(fraction, self.torch_device)
        try:
            meter = _CudaMeter(self.torch_device)
            meter.reset_peak()
            yield meter
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, self.torch_device)
            self._settle()


class _SimulatedMeter:
    def __init__(self, device: SimulatedDevice) -> None:
        self._device = device

    def allocated(self) -> int:
        return self._device.live

    def peak(self) -> int:
        return self._device.peak

    def reset_peak(self) -> None:
        self._device.reset_peak()

    def reserved_peak(self) -> int | None:
        return None  # no allocator caches blocks here


class SimulatedStandIn:
    """The CPU under :func:`~koila_retry.testing.simulated_device`, standing in for a small device."""

    name = "simulated"
    torch_device = torch.device("cpu")

    @contextmanager
    def measuring(self) -> Iterator[Meter]:
        with simulated_device(UNLIMITED) as device:
            yield _SimulatedMeter(device)

    @contextmanager
    def limited(self, budget: int) -> Iterator[Meter]:
        with simulated_device(budget) as device:
            yield _SimulatedMeter(device)


_KINDS: dict[str, Callable[[], Device]] = {"cuda": CudaDevice, "simulated": SimulatedStandIn}


def device_fixture() -> Any:
    """Return a ``device`` fixture: the CPU stand-in, unmarked, and CUDA, marked ``cuda``.

    A module that says ``device = device_fixture()`` runs each test that takes ``device``
    twice: on the stand-in everywhere, and on CUDA where there is a CUDA device.
    """

    @pytest.fixture(params=[pytest.param("simulated", id="simulated"), pytest.param("cuda", id="cuda", marks=CUDA)])
    def device(request: pytest.FixtureRequest) -> Device:
        return _KINDS[request.param]()

    return device
