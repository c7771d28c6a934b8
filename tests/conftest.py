"""Shared fixtures: every test starts from clean global state."""

from __future__ import annotations

import os

# Before torch is imported, here and in every process the tests start: idle OpenMP threads sleep
# instead of spinning. Two pytest-xdist workers on two cores, each process with a thread per
# core, spun against each other: the suite took 320 s, and 238 s with this (issue 38).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import gc
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import _isolation
import psutil
import pytest
from _devices import HAS_CUDA
from _fake_cuda import FakeCuda
from _isolation import pytest_configure, pytest_runtest_logreport, pytest_runtest_protocol
from hypothesis import settings

import koila_retry as koila
from koila_retry._common import tracking
from koila_retry._core import memory
from koila_retry._estimation import estimate, versions
from koila_retry._frontends import accumulate, batch, chunked, in_flight

# Tests never time themselves: these machines are shared and noisy, and a deadline that
# a loaded machine misses fails a test that proved what it should. Every settings object
# a test module makes inherits this profile.
settings.register_profile("koila", deadline=None)
# tox (the README's test command, and CI's) draws the same examples on every run, so that
# a landing never fails on a draw no earlier run made; pytest alone draws new ones, and
# finds what a fixed set never would (a 3-d convolution's rule was found that way).
settings.register_profile("koila-fixed", deadline=None, derandomize=True, database=None)
settings.load_profile(os.environ.get("KOILA_HYPOTHESIS_PROFILE", "koila"))


@pytest.fixture(autouse=True, scope="session")
def _version_gate_warned_once() -> None:
    """Let the estimator's once-per-process warning about the torch version go off before any test.

    On a torch outside the versions its rules were checked on (the GPU machines' 2.11, say),
    the first estimate warns; which test makes it depends on the order, and a test that
    turns warnings into errors would fail for it. ``tests/test_versions.py`` checks the
    warning itself, with a version of its own.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        versions.warn_if_unchecked()


__all__ = ["pytest_configure", "pytest_runtest_logreport", "pytest_runtest_protocol"]  # tests/_isolation.py's hooks


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run each CUDA test file in a process of its own, where there is a CUDA device (``tests/_isolation.py``)."""
    if HAS_CUDA:
        for item in items:
            if item.get_closest_marker("cuda") is not None:
                item.add_marker(_isolation.MARKER)
    _isolation.pytest_collection_modifyitems(config, items)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Leave what the imports made out of every later garbage collection.

    Each out-of-memory error a test provokes runs a full collection (``koila.release``),
    and each call that gives up scans the collector's objects for tensors. With torch,
    accelerate and Lightning imported, that is some 300,000 objects: about 130 ms a
    collection, most of the suite's time. Frozen, the modules' objects stay alive (they
    would anyway) and are not traversed again; what a test makes, the failed attempts'
    tensors included, is collected as before.
    """
    gc.collect()
    gc.freeze()


# The machine's memory as the session found it. Free memory is part of the default cache's key
# (StackMemoryCache, in power-of-two buckets, and toma's, in 256 MiB steps): read live, another
# process on a busy machine could move it into another bucket between two calls of a test and
# start the second afresh. Tests of how free memory is read fake it themselves
# (tests/test_memory.py), or ask for ``live_free_memory``; tests of levels of free memory use
# ``simulated_device``.
_LIVE_VIRTUAL_MEMORY = psutil.virtual_memory
_SESSION_READING = psutil.virtual_memory()


@pytest.fixture(autouse=True)
def _steady_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hold the system's memory reading still for the test: the reading the session started with."""
    monkeypatch.setattr(psutil, "virtual_memory", lambda: _SESSION_READING)


@pytest.fixture
def live_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Read the system's memory live, as outside the tests, for a test of that reading itself."""
    monkeypatch.setattr(psutil, "virtual_memory", _LIVE_VIRTUAL_MEMORY)


@pytest.fixture(autouse=True)
def _reset_global_state() -> Iterator[None]:
    """Clear the caches and readings that outlive a call, before and after each test."""
    batch.attempts_cache.cache_clear()
    chunked.calls_cache.cache_clear()
    memory.forget_free_memory()
    yield
    batch.attempts_cache.cache_clear()
    chunked.calls_cache.cache_clear()
    memory.forget_free_memory()
    leaked = list(tracking.simulated.active)
    tracking.simulated.active.clear()
    assert not leaked, "a test left a simulated device active"
    # A step that ends, however it ends, lets go of the parameters it held: one left held would
    # make a later step of another thread on a tensor with the same id wait for it forever.
    registry = in_flight.IN_FLIGHT
    held = dict(registry.owners), dict(registry.shared), dict(registry.held)
    registry.owners.clear()
    registry.shared.clear()
    registry.held.clear()
    assert held == ({}, {}, {}), "a test left accumulate steps holding parameters (in_flight.IN_FLIGHT)"


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """Start and end a test with no compiled code and Dynamo's counters zeroed."""
    import torch._dynamo  # seconds to import: only for the tests that compile
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()


@pytest.fixture
def estimates(monkeypatch: pytest.MonkeyPatch) -> list[Callable[..., Any]]:
    """The functions ``initial="auto"`` estimated, one entry per estimate."""
    seen: list[Callable[..., Any]] = []
    real = estimate.estimate_batch

    def counting(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> koila.MemoryEstimate:
        seen.append(fn)
        return real(fn, *args, **kwargs)

    # Both front ends imported the function by name.
    monkeypatch.setattr(accumulate, "estimate_batch", counting)
    monkeypatch.setattr(chunked, "estimate_batch", counting)
    return seen


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    """A CUDA device made of numbers (``tests/_fake_cuda.py``), installed for the test."""
    device = FakeCuda()
    device.install(monkeypatch)
    return device


@pytest.fixture
def frequent_switches() -> Iterator[None]:
    """Let the interpreter switch threads about every instruction, so that races show at once."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)
