"""Why a call ran out of memory: capacity or fragmentation, from the caching allocator's own figures.

PyTorch gives no measure of fragmentation (pytorch#29554). A request above the cached unused bytes plus
what may still be taken from the device is capacity; one below that, but above both the largest free
piece and that room, is fragmentation. :func:`from_allocator` reads PyTorch's formats, so it is tested on
the CPU with real H100 states (``tests/data/oom_states.json``); only :func:`capture` needs the device.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from koila_retry._common.tracking import simulated
from koila_retry._common.units import parse_bytes
from koila_retry.exceptions import Diagnosis

__all__ = ["capture", "from_allocator", "requested_bytes"]

CAPACITY = (
    "The memory is not there for this call: run less at once (a smaller batch, or a lower minimum= if one is set), "
    "shard the model (FSDP2) or offload what waits (koila.offload), or use less precision or "
    "activation checkpointing."
)
FRAGMENTATION = (
    "The memory is there, but in pieces smaller than the request: start the process with "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, or give the cached blocks back "
    "(koila.release(), torch.cuda.empty_cache()) between phases that allocate differently; "
    "a smaller batch may not help."
)
UNKNOWN = "Nothing this device reports says whether the memory was short or in pieces."
UNKNOWN_CUDA = (
    "The allocator's figures do not say whether the memory was short or in pieces: "
    "torch.cuda.memory_summary() shows what it held."
)
_HOST = (
    "The operating system refused the allocation: the process's limit (ulimit -v, a container's "
    "memory limit) or the machine's memory is reached. Run less at once, or free what waits."
)

# "Tried to allocate 1024.00 MiB" (CUDA, MPS, XPU), "you tried to allocate 123 bytes" (the CPU).
_REQUESTED = re.compile(r"[Tt]ried to allocate\s+([\d.]+\s*(?:[KMGT]i?B|bytes|B)?)")
# "2.00 GiB allowed;": the process's share, under set_per_process_memory_fraction.
_ALLOWED = re.compile(r"([\d.]+\s*[KMGT]i?B) allowed")
# What the stand-in's own refusal says (koila_retry.testing.SimulatedDevice): an error without
# it was raised some other way inside the block (injected by a test, say), not by the stand-in.
_STAND_IN = "Simulated device has a total capacity of"


def _size(text: str) -> int | None:
    text = text.strip().replace("bytes", "B")
    try:
        return parse_bytes(text if text[-1].isalpha() else f"{text}B")
    except (ValueError, IndexError):
        return None


def requested_bytes(message: str) -> int | None:
    """Return the bytes an out-of-memory message says were asked for (to its rounding), or ``None``."""
    found = _REQUESTED.search(message)
    return _size(found.group(1)) if found else None


def from_allocator(
    message: str,
    stats: Mapping[str, Any],
    segments: Iterable[Mapping[str, Any]] | None,
    limit: int | None,
    device_free: int | None,
) -> Diagnosis:
    """Diagnose a caching allocator's out-of-memory error from ``memory_stats()`` and snapshot segments."""
    requested = requested_bytes(message)
    reserved = int(stats.get("reserved_bytes.all.current", 0))
    allocated = int(stats.get("allocated_bytes.all.current", 0))
    unused = max(reserved - allocated, 0)
    largest = None
    if segments is not None:
        sizes = [
            int(block.get("size", 0))
            for segment in segments
            for block in segment.get("blocks", ())
            if block.get("state") == "inactive"
        ]
        largest = max(sizes, default=0)
    allowed = _allowed(message, limit)
    room = None
    if allowed is not None:
        room = max(allowed - reserved, 0)
        if device_free is not None:
            room = min(room, device_free)
    elif device_free is not None:
        room = device_free
    kind = "unknown"
    if requested is not None:
        if unused + (room or 0) < requested:
            kind = "capacity"
        elif (largest is not None and largest < requested) and (room is not None and room < requested):
            kind = "fragmentation"
    advice = {"capacity": CAPACITY, "fragmentation": FRAGMENTATION}.get(kind, UNKNOWN_CUDA)
    return Diagnosis(kind, requested, room, unused, largest, advice)


def _allowed(message: str, limit: int | None) -> int | None:
    found = _ALLOWED.search(message)
    said = _size(found.group(1)) if found else None
    if said is not None and limit is not None:
        return min(said, limit)
    return said if said is not None else limit


def capture(error: BaseException, device: torch.device) -> Diagnosis:
    """Diagnose an out-of-memory ``error`` from the allocator now: before the attempt's memory is released."""
    message = str(error)
    try:
        free = simulated.free()
        if free is not None and _STAND_IN in message:
            # A simulated device is one pool with a limit: what it refused is capacity. Other errors
            # raised inside it (by a test) are diagnosed as they would be outside. The free bytes are
            # free_memory()'s: of nested devices, the tightest, which an outer one may be.
            return Diagnosis("capacity", requested_bytes(message), free, None, None, CAPACITY)
        if device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            return _cuda(message, device)
        if device.type == "cpu" and "can't allocate memory" in message:  # the CPU allocator's own error
            return Diagnosis("capacity", requested_bytes(message), None, None, None, _HOST)
        if device.type == "mps":
            # MPS keeps no cache it could split; its message says what it holds and may hold.
            return Diagnosis("capacity", requested_bytes(message), None, None, None, CAPACITY)
    except Exception:  # a diagnosis must never hide the error it explains
        pass
    advice = UNKNOWN_CUDA if device.type == "cuda" else UNKNOWN  # the summary is CUDA's alone
    return Diagnosis("unknown", requested_bytes(message), None, None, None, advice)


def _cuda(message: str, device: torch.device) -> Diagnosis:
    index = device.index if device.index is not None else torch.cuda.current_device()
    stats = torch.cuda.memory_stats(index)
    snapshot = torch.cuda.memory_snapshot()  # type: ignore[no-untyped-call]
    segments = [segment for segment in snapshot if segment.get("device", index) == index]
    free, total = torch.cuda.mem_get_info(index)
    fraction = torch.cuda.get_per_process_memory_fraction(index)
    return from_allocator(message, stats, segments, int(total * fraction), free)
