"""Tests for free memory, device resolution and release (koila_retry._core.memory)."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import types
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from _fake_cuda import FakeCuda
from torch.utils._python_dispatch import TorchDispatchMode

import koila_retry as koila
from koila_retry._core import memory
from koila_retry.testing import simulated_device

MiB = 2**20
REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(torch.accelerator.is_available(), reason="written for a machine without accelerator")


# ---------------------------------------------------------------------------
# free_memory on the CPU
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("device", [None, "cpu", torch.device("cpu")])
@pytest.mark.usefixtures("live_free_memory")
def test_free_memory_is_a_positive_int_not_above_available_memory(device: object) -> None:
    before = psutil.virtual_memory().available
    free = koila.free_memory(device)  # type: ignore[arg-type]
    after = psutil.virtual_memory().available
    assert type(free) is int
    assert free > 0
    # Other processes allocate meanwhile: allow what the readings around it differ by, and 64 MiB.
    assert free <= max(before, after) + 64 * MiB


class _FakeProcess:
    def __init__(self, vms: int) -> None:
        self.vms = vms

    def memory_info(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(vms=self.vms)


@pytest.fixture
def fake_system(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Fix available memory, the address-space limit and the process size that _cpu_free reads."""
    assert memory.resource is not None
    system = {"available": 8 * 2**30, "soft": memory.resource.RLIM_INFINITY, "vms": 3 * 2**30}
    monkeypatch.setattr(memory.psutil, "virtual_memory", lambda: types.SimpleNamespace(available=system["available"]))
    monkeypatch.setattr(
        memory.resource,
        "getrlimit",
        lambda which: (system["soft"], memory.resource.RLIM_INFINITY),
    )
    process = _FakeProcess(system["vms"])
    monkeypatch.setattr(memory, "_PROCESS", process)
    return system


def test_cpu_free_memory_is_available_memory_without_a_limit(fake_system: dict[str, int]) -> None:
    assert koila.free_memory("cpu") == 8 * 2**30


def test_cpu_free_memory_is_capped_by_what_is_left_of_rlimit_as(fake_system: dict[str, int]) -> None:
    fake_system["soft"] = fake_system["vms"] + 512 * MiB
    assert koila.free_memory("cpu") == 512 * MiB


def test_cpu_free_memory_is_never_negative(fake_system: dict[str, int]) -> None:
    fake_system["soft"] = fake_system["vms"] - MiB
    assert koila.free_memory("cpu") == 0


def test_rlimit_larger_than_available_memory_changes_nothing(fake_system: dict[str, int]) -> None:
    fake_system["soft"] = fake_system["vms"] + 64 * 2**30
    assert koila.free_memory("cpu") == 8 * 2**30


@pytest.mark.slow
def test_free_memory_respects_a_real_rlimit_as_in_a_subprocess() -> None:
    script = """
import json, resource, psutil
import torch
import koila_retry as koila
vms = psutil.Process().memory_info().vms
_, hard = resource.getrlimit(resource.RLIMIT_AS)
resource.setrlimit(resource.RLIMIT_AS, (vms + 512 * 2**20, hard))
free = koila.free_memory("cpu")
try:
    torch.empty(2**30, dtype=torch.uint8)
    error = None
except RuntimeError as exc:
    error = [type(exc).__name__, koila.is_oom(exc)]
print(json.dumps({"free": free, "default": koila.free_memory(), "error": error}))
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert 0 < report["free"] <= 512 * MiB
    assert 0 < report["default"] <= 512 * MiB
    # The real CPU allocator fails past the limit, with an error koila recognises.
    assert report["error"] == ["RuntimeError", True]


# ---------------------------------------------------------------------------
# resolve_device
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("device", [None, "cpu", torch.device("cpu")])
def test_resolve_device_gives_the_cpu_here(device: object) -> None:
    assert memory.resolve_device(device) == torch.device("cpu")  # type: ignore[arg-type]


def test_resolve_device_adds_index_zero_to_accelerator_types() -> None:
    assert memory.resolve_device("cuda") == torch.device("cuda", 0)
    assert memory.resolve_device("cuda:1") == torch.device("cuda", 1)
    assert memory.resolve_device(torch.device("meta")) == torch.device("meta")


@pytest.mark.parametrize("device", ["gpu:x", "nonsense", "cuda:-1", ""])
def test_resolve_device_rejects_unknown_strings(device: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        memory.resolve_device(device)
    assert repr(device) in str(excinfo.value)


@pytest.mark.parametrize("device", [3.5, True, [0], b"cpu"])
def test_resolve_device_rejects_other_types(device: object) -> None:
    with pytest.raises(TypeError) as excinfo:
        memory.resolve_device(device)  # type: ignore[arg-type]
    assert repr(device) in str(excinfo.value)


def test_resolve_device_rejects_negative_indices() -> None:
    with pytest.raises(ValueError, match=r"got -1$"):
        memory.resolve_device(-1)


@pytest.mark.parametrize("index", [0, 1])
def test_resolve_device_rejects_an_index_without_accelerator(index: int) -> None:
    with pytest.raises(ValueError, match=rf"index {index} given, but no accelerator"):
        memory.resolve_device(index)


@pytest.mark.parametrize("device", ["cuda", "cuda:1", torch.device("cuda", 0), "mps", "xpu"])
def test_free_memory_of_a_missing_accelerator_is_a_value_error(device: object) -> None:
    with pytest.raises(ValueError, match=r"this process has no \w+ device"):
        koila.free_memory(device)  # type: ignore[arg-type]


def test_free_memory_rejects_bad_devices() -> None:
    with pytest.raises(ValueError, match="'gpu:x'"):
        koila.free_memory("gpu:x")
    with pytest.raises(TypeError, match="3.5"):
        koila.free_memory(3.5)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# release
# ---------------------------------------------------------------------------


class _Node:
    other: _Node
    tensor: torch.Tensor


def _cycle_holding_a_tensor() -> weakref.ref[torch.Tensor]:
    first, second = _Node(), _Node()
    first.other, second.other = second, first
    first.tensor = torch.zeros(1024)
    return weakref.ref(first.tensor)


@pytest.mark.parametrize("device", [None, "cpu", "cuda"])
def test_release_collects_reference_cycles(device: object) -> None:
    was_enabled = gc.isenabled()
    gc.disable()  # so that nothing but release() collects the cycle
    try:
        tensor = _cycle_holding_a_tensor()
        assert tensor() is not None  # only the cycle keeps it alive
        koila.release(device)  # type: ignore[arg-type]
        assert tensor() is None
    finally:
        if was_enabled:
            gc.enable()


class _Refusing(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """A mode of the user's that refuses every operator it was not written for."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise AssertionError(f"unexpected {func}")


class _FailInTheMeansBackward(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.div.Scalar and torch._C._current_graph_task_id() != -1:
            raise torch.OutOfMemoryError("in the mean's backward")
        return func(*args, **(kwargs or {}))


def _graph_of_a_failed_backward() -> weakref.ref[torch.Tensor]:
    """Return a weak reference to an activation that only the autograd queue a failed backward left holds."""
    hidden = torch.ones(4, 4, requires_grad=True).tanh()
    loss = hidden.square().sum() + hidden.mean()  # the square's node is queued as the mean's backward fails
    activation = weakref.ref(hidden)
    with _FailInTheMeansBackward(), contextlib.suppress(torch.OutOfMemoryError):
        loss.backward()
    del hidden, loss
    return activation


@pytest.mark.parametrize("context", ["a mode that refuses", "a backward", "inference mode", "a full device"])
def test_release_still_collects_where_the_autograd_queue_cannot_be_drained(context: str) -> None:
    # The drain of a failed backward's queue is best effort: whatever stops it, release collects and returns.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        graph = _graph_of_a_failed_backward()
        assert graph() is not None, "PyTorch let go of the failed backward's graph by itself"
        tensor = _cycle_holding_a_tensor()
        if context == "a backward":
            leaf = torch.ones((), requires_grad=True)
            square = leaf.square()
            square.register_hook(lambda grad: koila.release("cpu"))
            square.backward()
        else:
            modes = {
                "a mode that refuses": _Refusing,
                "inference mode": torch.inference_mode,
                "a full device": lambda: simulated_device(1),
            }
            with modes[context]():
                koila.release("cpu")
        assert tensor() is None
        if context == "inference mode":  # drained all the same
            assert graph() is None
    finally:
        if was_enabled:
            gc.enable()


def test_release_forgets_cached_free_memory_readings() -> None:
    memory.recent_free_memory(torch.device("cpu"))
    memory.recent_free_memory(torch.device("meta"))  # a reading per device, even a bogus one
    assert memory._free_readings
    koila.release()
    assert memory._free_readings == {}


def test_release_rejects_bad_devices() -> None:
    with pytest.raises(ValueError, match="'gpu:x'"):
        koila.release("gpu:x")


# ---------------------------------------------------------------------------
# recent_free_memory: a fake timer
# ---------------------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(memory, "time", types.SimpleNamespace(monotonic=fake.monotonic))
    return fake


@pytest.fixture
def readings(monkeypatch: pytest.MonkeyPatch) -> list[torch.device]:
    """Record each real read; the n-th read of any device returns n MiB."""
    calls: list[torch.device] = []

    def device_free(device: torch.device) -> int:
        calls.append(device)
        return len(calls) * MiB

    monkeypatch.setattr(memory, "_device_free", device_free)
    return calls


def test_recent_free_memory_reuses_a_reading_within_the_ttl(clock: _Clock, readings: list[torch.device]) -> None:
    cpu = torch.device("cpu")
    assert memory.recent_free_memory(cpu) == MiB
    assert readings == [cpu]
    clock.now += memory.FREE_MEMORY_TTL / 2
    assert memory.recent_free_memory(cpu) == MiB
    assert readings == [cpu]


def test_recent_free_memory_reads_again_after_the_ttl(clock: _Clock, readings: list[torch.device]) -> None:
    cpu = torch.device("cpu")
    assert memory.recent_free_memory(cpu) == MiB
    clock.now += memory.FREE_MEMORY_TTL * 1.01
    assert memory.recent_free_memory(cpu) == 2 * MiB
    assert len(readings) == 2
    clock.now += memory.FREE_MEMORY_TTL / 2  # the TTL counts from the new reading
    assert memory.recent_free_memory(cpu) == 2 * MiB
    assert len(readings) == 2


def test_recent_free_memory_keeps_one_reading_per_device(clock: _Clock, readings: list[torch.device]) -> None:
    cpu, meta = torch.device("cpu"), torch.device("meta")
    assert memory.recent_free_memory(cpu) == MiB
    assert memory.recent_free_memory(meta) == 2 * MiB
    assert memory.recent_free_memory(cpu) == MiB
    assert memory.recent_free_memory(meta) == 2 * MiB
    assert readings == [cpu, meta]


def test_forgetting_readings_makes_the_next_one_fresh(clock: _Clock, readings: list[torch.device]) -> None:
    cpu = torch.device("cpu")
    assert memory.recent_free_memory(cpu) == MiB
    memory.forget_free_memory()
    assert memory.recent_free_memory(cpu) == 2 * MiB
    koila.release()
    assert memory.recent_free_memory(cpu) == 3 * MiB
    assert len(readings) == 3


def test_recent_free_memory_reports_an_active_simulated_device(clock: _Clock, readings: list[torch.device]) -> None:
    from koila_retry.testing import simulated_device

    with simulated_device("3MiB"):
        assert memory.recent_free_memory(torch.device("cpu")) == 3 * MiB
    assert readings == []


def test_free_memory_of_the_meta_device_is_unlimited() -> None:
    assert koila.free_memory("meta") == memory.UNLIMITED == 2**63 - 1


def test_recent_free_memory_of_an_unreadable_device_is_minus_one() -> None:
    assert memory.recent_free_memory(torch.device("cuda", 0)) == -1
    assert memory._free_readings[torch.device("cuda", 0)][1] == -1


# ---------------------------------------------------------------------------
# free_memory on CUDA, read from a device made of numbers (tests/_fake_cuda.py)
# ---------------------------------------------------------------------------

GiB = 2**30


def test_cuda_free_memory_is_the_drivers_free_plus_the_caches_unused(fake_cuda: FakeCuda) -> None:
    assert koila.free_memory("cuda") == 70 * GiB + 8 * GiB - 6 * GiB
    assert koila.free_memory() == koila.free_memory(0) == koila.free_memory("cuda:0")


def test_cuda_free_memory_honours_the_process_memory_fraction(fake_cuda: FakeCuda) -> None:
    # As on the H100 of 2026-11-25: a 4 GiB share of an 80 GiB card, most of the card free.
    fake_cuda.fraction = 0.05
    fake_cuda.reserved, fake_cuda.allocated = 2 * GiB, 1 * GiB
    # The share less what is reserved: a cached block serves only a request that fits in it,
    # and anything larger needs a new segment, which the whole reserve counts against.
    assert koila.free_memory("cuda") == int(0.05 * 80 * GiB) - 2 * GiB
    fake_cuda.reserved = fake_cuda.allocated = 5 * GiB  # past the share (set after the memory was taken)
    assert koila.free_memory("cuda") == 0


def test_a_fraction_above_what_the_driver_has_free_changes_nothing(fake_cuda: FakeCuda) -> None:
    # Other processes hold most of the card: the driver's free memory is the smaller bound.
    fake_cuda.fraction, fake_cuda.driver_free = 0.9, 10 * GiB
    assert koila.free_memory("cuda") == 10 * GiB + 8 * GiB - 6 * GiB


def test_the_cache_key_reading_honours_the_fraction(fake_cuda: FakeCuda) -> None:
    fake_cuda.fraction = 0.05
    fake_cuda.reserved, fake_cuda.allocated = 3 * GiB, 1 * GiB
    assert memory.recent_free_memory(torch.device("cuda", 0)) == int(0.05 * 80 * GiB) - 3 * GiB


def test_suggest_batch_size_fits_the_processs_share_not_the_card(fake_cuda: FakeCuda) -> None:
    fake_cuda.fraction, fake_cuda.reserved, fake_cuda.allocated = 0.05, 0, 0
    model = torch.nn.Linear(256, 256)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return model(x)

    x = torch.randn(8, 256)
    found = koila.estimate(forward, x, device="cuda")
    share = int(0.05 * 80 * GiB)
    size = koila.suggest_batch_size(forward, x, device="cuda")
    assert found.fits(size, share)
    assert not found.fits(2 * size, share)


@pytest.mark.parametrize("reading", [RuntimeError("no"), AssertionError("no"), ValueError("no")])
def test_a_fraction_that_cannot_be_read_is_the_whole_card(
    fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch, reading: Exception
) -> None:
    def broken(device: object = None) -> float:
        raise reading

    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", broken)
    assert memory.memory_fraction(torch.device("cuda", 0)) == 1.0
    assert koila.free_memory("cuda") == 72 * GiB


def test_a_backend_without_a_fraction_has_the_whole_device() -> None:
    assert memory.memory_fraction(torch.device("mps", 0)) == 1.0
    assert memory.memory_fraction(torch.device("privateuseone", 0)) == 1.0


# ---------------------------------------------------------------------------
# The stand-in's share: SimulatedDevice.set_memory_fraction
# ---------------------------------------------------------------------------


def test_a_simulated_share_limits_allocations_and_free_memory() -> None:
    from koila_retry.testing import simulated_device

    with simulated_device("64MiB") as device:
        device.set_memory_fraction(0.25)
        assert device.allowed == 16 * MiB
        assert koila.free_memory() == 16 * MiB
        held = torch.empty(12 * MiB, dtype=torch.uint8)
        assert koila.free_memory("cuda") == 4 * MiB  # whatever device is named, inside the stand-in
        with pytest.raises(torch.OutOfMemoryError, match=r"16\.00 MiB allowed"):
            torch.empty(8 * MiB, dtype=torch.uint8)
        device.set_memory_fraction(1.0)
        more = torch.empty(8 * MiB, dtype=torch.uint8)  # the whole device again
        assert device.live == 20 * MiB
        del held, more


def test_suggest_batch_size_under_a_simulated_share() -> None:
    from koila_retry.testing import simulated_device

    model = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 8))

    def forward(x: torch.Tensor) -> torch.Tensor:
        return model(x)

    x = torch.randn(4, 64)
    with simulated_device("256MiB") as device:
        whole = koila.suggest_batch_size(forward, x)
        device.set_memory_fraction(0.125)
        share = koila.suggest_batch_size(forward, x)
    assert share * 8 == whole


@pytest.mark.parametrize("fraction", [-0.1, 1.5, float("nan")])
def test_a_simulated_share_outside_zero_to_one_is_refused(fraction: float) -> None:
    from koila_retry.testing import simulated_device

    with pytest.raises(ValueError, match=r"from 0\.0 to 1\.0, got"):
        simulated_device("1MiB").set_memory_fraction(fraction)


@pytest.mark.parametrize("fraction", ["0.5", True, None])
def test_a_simulated_share_that_is_no_number_is_refused(fraction: object) -> None:
    from koila_retry.testing import simulated_device

    with pytest.raises(TypeError, match="fraction must be a number"):
        simulated_device("1MiB").set_memory_fraction(fraction)  # type: ignore[arg-type]


def test_empty_caches_empties_each_accelerator_device_and_the_host_and_forgets_readings(
    fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[object] = []

    @contextlib.contextmanager
    def device_index(index: int) -> Iterator[None]:
        calls.append(("on", index))
        yield

    monkeypatch.setattr(torch.accelerator, "device_index", device_index)
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: calls.append("empty"))
    monkeypatch.setattr(torch.accelerator, "empty_host_cache", lambda: calls.append("host"), raising=False)
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    memory.empty_caches([cuda0, torch.device("cpu"), cuda1])
    assert calls == [("on", 0), "empty", ("on", 1), "empty"]  # the CPU has no such cache
    calls.clear()
    memory.empty_caches([], host=True)
    assert calls == ["host"]

    def broken() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.accelerator, "empty_cache", broken)
    memory.recent_free_memory(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        memory.empty_caches([cuda0])
    assert memory._free_readings == {}  # forgotten all the same


def test_release_empties_the_device_through_empty_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    devices: list[list[torch.device]] = []
    monkeypatch.setattr(memory, "empty_caches", lambda given, host=False: devices.append(list(given)))
    koila.release("cpu")
    memory.release_young("meta")
    assert devices == [[torch.device("cpu")], [torch.device("meta")]]


def test_a_simulated_device_refuses_the_device_arguments_a_real_one_refuses() -> None:
    # It answered True, 1.5, "bogus" and -1 with its free bytes: a test passed that would fail for real.
    with simulated_device("1MiB") as device:
        for wrong, error in ((True, TypeError), (1.5, TypeError), ("bogus", ValueError), (-1, ValueError)):
            with pytest.raises(error):
                koila.free_memory(wrong)  # type: ignore[arg-type]
        # The device it stands for: named as the code under test names it, on a machine without one.
        assert koila.free_memory("cuda") == koila.free_memory("cuda:1") == koila.free_memory() == device.free
