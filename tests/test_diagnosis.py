"""Why a call ran out of memory: capacity or fragmentation (issue 31, part 3).

The rule reads PyTorch's own formats, so it is tested with two real allocator states from an H100
(``tests/data/oom_states.json``, a copy of ``benchmarks/runs/2026-11-25-h100/oom_states.json``: a
capacity OOM and a fragmentation OOM under a 2 GiB memory fraction, with their messages,
``memory_stats()`` and the segments of ``memory_snapshot()``), with made-up states around its edges,
and through calls that give up on the simulated device, the CPU allocator and a CUDA device made of
those numbers.
"""

from __future__ import annotations

import json
import pickle
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import koila_retry as koila
from koila_retry._common.units import format_bytes
from koila_retry._core import diagnosis
from koila_retry.testing import make_oom, simulated_device

MiB, GiB = 2**20, 2**30
STATES = {
    state["name"]: state for state in json.loads((Path(__file__).parent / "data" / "oom_states.json").read_text())
}


def _diagnose(state: dict[str, Any]) -> koila.Diagnosis:
    free, total = state["mem_get_info"]
    return diagnosis.from_allocator(
        state["message"], state["memory_stats"], state["segments"], int(total * state["fraction"]), free
    )


def test_a_real_capacity_oom_is_capacity() -> None:
    found = _diagnose(STATES["capacity"])
    assert found.kind == "capacity"
    assert found.requested == GiB
    assert found.reserved_unused == 5 * MiB
    # What the cache held unused and what the 2 GiB share left together fall short of 1 GiB.
    assert found.free is not None
    assert found.reserved_unused + found.free < found.requested
    assert "smaller batch" in found.advice


def test_a_real_fragmentation_oom_is_fragmentation() -> None:
    found = _diagnose(STATES["fragmentation"])
    assert found.kind == "fragmentation"
    assert found.requested == 400 * MiB
    assert found.reserved_unused == 925 * MiB
    assert found.largest_free_block == 40 * MiB  # the 1800 MiB segment, every other 40 MiB piece freed
    assert found.free is not None
    assert found.free < found.requested
    assert "expandable_segments:True" in found.advice
    text = str(found)
    assert text.startswith("fragmentation (asked for 400.00 MiB")
    assert "925.00 MiB cached by PyTorch but unused" in text
    assert "the largest free piece 40.00 MiB" in text


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity of 79.25 GiB", 3 * GiB // 2),
        ("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 ...", 20 * MiB),
        (
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
            "you tried to allocate 123456 bytes. Error code 12 (Cannot allocate memory)",
            123456,
        ),
        (
            "MPS backend out of memory (MPS allocated: 17.00 GB). Tried to allocate 256.00 MiB on private pool.",
            256 * MiB,
        ),
        ("XPU out of memory. Tried to allocate 2.00 GiB (GPU 0; 48.00 GiB total capacity)", 2 * GiB),
        ("CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`", None),
    ],
)
def test_the_request_is_read_from_the_message(message: str, expected: int | None) -> None:
    assert diagnosis.requested_bytes(message) == expected


def _state(reserved: int, allocated: int, pieces: list[int]) -> tuple[dict[str, int], list[dict[str, Any]]]:
    stats = {"reserved_bytes.all.current": reserved, "allocated_bytes.all.current": allocated}
    blocks = [{"size": size, "state": "inactive"} for size in pieces]
    blocks.append({"size": allocated, "state": "active_allocated"})
    return stats, [{"total_size": reserved, "blocks": blocks}]


def test_a_request_that_one_free_piece_could_hold_is_unknown() -> None:
    # Enough memory in one piece, and still an error: the figures do not say why.
    stats, segments = _state(4 * GiB, 2 * GiB, [2 * GiB])
    found = diagnosis.from_allocator("Tried to allocate 1.00 GiB", stats, segments, 4 * GiB, 10 * GiB)
    assert found.kind == "unknown"
    assert "memory_summary" in found.advice


def test_without_the_request_in_the_message_it_is_unknown() -> None:
    stats, segments = _state(4 * GiB, 4 * GiB, [])
    assert diagnosis.from_allocator("CUBLAS_STATUS_ALLOC_FAILED", stats, segments, 4 * GiB, 0).kind == "unknown"


def test_the_share_the_message_names_bounds_the_room_to_grow() -> None:
    stats, segments = _state(GiB, GiB, [])
    # The device is free, but the process may hold 1.5 GiB: 0.5 GiB more, short of 1 GiB.
    found = diagnosis.from_allocator(
        "Tried to allocate 1.00 GiB. ... 1.50 GiB allowed; ...", stats, segments, 80 * GiB, 70 * GiB
    )
    assert found.free == GiB // 2
    assert found.kind == "capacity"


@given(
    reserved=st.integers(0, 64).map(lambda n: n * 64 * MiB),
    used=st.floats(0, 1),
    pieces=st.lists(st.integers(1, 32).map(lambda n: n * 2 * MiB), max_size=6),
    room=st.integers(0, 64).map(lambda n: n * 32 * MiB),
    requested=st.integers(1, 64).map(lambda n: n * 32 * MiB),
)
def test_the_kind_follows_the_rule(reserved: int, used: float, pieces: list[int], room: int, requested: int) -> None:
    unused = sum(pieces)
    allocated = int(reserved * used)
    reserved = allocated + unused
    stats, segments = _state(reserved, allocated, pieces)
    limit = reserved + room
    found = diagnosis.from_allocator(f"Tried to allocate {requested} bytes", stats, segments, limit, 10**15)
    assert found.requested == requested
    assert found.free == room
    assert found.reserved_unused == unused
    if unused + room < requested:
        assert found.kind == "capacity"
    elif max(pieces, default=0) < requested and room < requested:
        assert found.kind == "fragmentation"
    else:
        assert found.kind == "unknown"


# --- through calls that give up ------------------------------------------------------------------


def test_a_call_that_gives_up_on_the_simulated_device_says_capacity() -> None:
    @koila.batch(initial=64, minimum=16)
    def run(batch_size: int) -> torch.Tensor:
        return torch.ones(batch_size, 64, 1024)  # 256 KiB per row

    with simulated_device("2MiB"), pytest.raises(koila.BatchSizeExhausted) as caught:
        run()
    found = caught.value.diagnosis
    assert found is not None
    assert found.kind == "capacity"
    assert found.requested == 16 * 256 * 1024  # the last size tried, 16 rows
    assert found.free is not None
    assert found.free < found.requested
    message = str(caught.value)
    assert "Diagnosis: capacity (asked for 4.00 MiB" in message
    assert "a smaller batch" in message


def test_the_diagnosis_crosses_a_process_boundary() -> None:
    found = diagnosis.from_allocator(
        STATES["fragmentation"]["message"], STATES["fragmentation"]["memory_stats"], None, 2 * GiB, None
    )
    error = koila.BatchSizeExhausted("gave up", batch_size=1, attempts=3, diagnosis=found)
    again = pickle.loads(pickle.dumps(error))
    assert again.diagnosis == found
    assert (again.batch_size, again.attempts, str(again)) == (1, 3, "gave up")
    assert koila.BatchSizeExhausted("gave up", batch_size=1, attempts=1).diagnosis is None


def test_an_error_that_is_not_the_allocators_is_unknown() -> None:
    # An out-of-memory error raised by hand on the CPU (a test's injection) says nothing of the device.
    @koila.batch(initial=2, minimum=1)
    def run(batch_size: int) -> None:
        raise make_oom("cuda")

    with pytest.raises(koila.BatchSizeExhausted) as caught:
        run()
    assert caught.value.diagnosis is not None
    assert caught.value.diagnosis.kind == "unknown"
    assert caught.value.diagnosis.requested == 2 * GiB  # make_oom's default request
    assert "Diagnosis: unknown" in str(caught.value)


def test_on_a_simulated_device_its_own_error_is_capacity_and_an_injected_one_unknown() -> None:
    # The device's own refusal is one pool running out; an error raised by hand inside the
    # block says nothing of that pool, whatever its message claims was asked for.
    @koila.batch(initial=4, minimum=2, cache=koila.NoCache())
    def allocates(batch_size: int) -> torch.Tensor:
        return torch.ones(batch_size, 64, 1024)  # 256 KiB a row

    @koila.batch(initial=4, minimum=2, cache=koila.NoCache())
    def injects(batch_size: int) -> None:
        raise make_oom("cuda")

    with simulated_device("256KiB") as device:
        with pytest.raises(koila.BatchSizeExhausted) as real:
            allocates()
        with pytest.raises(koila.BatchSizeExhausted) as injected:
            injects()
        own = diagnosis.capture(torch.OutOfMemoryError(str(real.value.__cause__)), torch.device("cpu"))
        free = device.free
    assert real.value.diagnosis == koila.Diagnosis("capacity", 512 * 1024, free, None, None, diagnosis.CAPACITY)
    assert own.kind == "capacity"
    # As outside a simulated device: unknown, with the request as the message says it and no figures.
    assert injected.value.diagnosis == koila.Diagnosis("unknown", 2 * GiB, None, None, None, diagnosis.UNKNOWN)
    assert "Diagnosis: unknown (asked for 2.00 GiB)." in str(injected.value)
    # On the CPU (as on the meta device), no advice to read CUDA's memory summary.
    assert "cuda" not in diagnosis.UNKNOWN.lower()
    assert "torch.cuda.memory_summary()" in diagnosis.capture(make_oom("cuda"), torch.device("cuda")).advice


def test_the_cpu_allocators_refusal_is_capacity() -> None:
    pytest.importorskip("resource")
    script = textwrap.dedent(
        """
        import json, resource
        import psutil, torch
        import koila_retry as koila

        torch.set_num_threads(1)
        limit = psutil.Process().memory_info().vms + 256 * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))

        @koila.batch(initial=2**18, minimum=2**17)  # 1 GiB, then 512 MiB of float32 rows of 1024
        def run(batch_size):
            return float(torch.ones(batch_size, 1024).sum())

        try:
            run()
        except koila.BatchSizeExhausted as exc:
            print(json.dumps({"kind": exc.diagnosis.kind, "requested": exc.diagnosis.requested,
                              "advice": exc.diagnosis.advice}))
        """
    )
    from test_rlimit import run_limited  # imported here: it skips its module where there is no RLIMIT_AS

    found = run_limited(script)
    assert found["kind"] == "capacity"
    assert found["requested"] == 2**17 * 1024 * 4
    assert "operating system refused" in found["advice"]


def test_on_cuda_the_live_allocator_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """The capture reads the allocator's figures of the failing device (here, numbers from the H100)."""
    state = STATES["fragmentation"]
    other = {"device": 1, "total_size": 8 * GiB, "blocks": [{"size": 8 * GiB, "state": "inactive"}]}
    mine = [{**segment, "device": 0} for segment in state["segments"]]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: state["memory_stats"])
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda *args, **kwargs: [*mine, other])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: tuple(state["mem_get_info"]))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: state["fraction"])
    found = diagnosis.capture(torch.OutOfMemoryError(state["message"]), torch.device("cuda", 0))
    # Another device's free 8 GiB piece is not this one's.
    assert found.kind == "fragmentation"
    assert found.largest_free_block == 40 * MiB


def test_a_capture_that_fails_is_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the driver went away")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_stats", broken)
    found = diagnosis.capture(torch.OutOfMemoryError("Tried to allocate 2.00 MiB"), torch.device("cuda", 0))
    assert found.kind == "unknown"
    assert found.requested == 2 * MiB


def test_nested_devices_are_diagnosed_from_the_tighter_outer_one() -> None:
    """The outer device refused, full of weights: the diagnosis read the inner one's 64 MiB free and nothing held."""
    with simulated_device("4MiB"):  # the real, tight limit
        weights = torch.zeros(3 * MiB // 4)

        @koila.batch(initial=64, minimum=8, cache=koila.NoCache())
        def run(batch_size: int) -> int:
            return torch.ones(batch_size, 64, 1024).shape[0] + weights.shape[0] * 0  # 256 KiB a row

        with simulated_device("64MiB"):  # a fixture's own, larger device, say
            with pytest.raises(koila.BatchSizeExhausted) as caught:
                run()
            free = koila.free_memory()
    assert caught.value.diagnosis is not None
    assert caught.value.diagnosis.free == free
    assert f"Largest on cpu ({format_bytes(weights.untyped_storage().nbytes())} in 1 storage)" in str(caught.value)
    assert f"weights float32[{weights.numel()}] {format_bytes(weights.untyped_storage().nbytes())}" in str(caught.value)
