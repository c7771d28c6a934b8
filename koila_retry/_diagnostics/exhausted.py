"""The message of :class:`BatchSizeExhausted`: what was tried, why it stopped, and what holds the memory."""

from __future__ import annotations

import torch

from koila_retry._common import tracking
from koila_retry._common.units import format_bytes, format_free
from koila_retry._core import memory
from koila_retry._core.engine import Exhaustion
from koila_retry._diagnostics import report

__all__ = ["message"]


def message(exhaustion: Exhaustion) -> str:
    """Say why a call gave up: the sizes tried, why no other was, where, and what holds the memory."""
    tried = " -> ".join(str(size) for size in exhaustion.tried)
    failed, minimum = exhaustion.tried[-1], exhaustion.minimum
    if exhaustion.reason == "schedule":
        reason = f"the schedule gave up after batch size {failed} (it returned None)"
    elif exhaustion.reason == "ranks" and failed > minimum:  # this rank could go smaller, another could not
        reason = "the rank that ran out of memory has no smaller batch size left"
    elif failed > minimum:
        reason = f"gave up after max_attempts={exhaustion.max_attempts} attempts"
    elif failed == minimum:
        reason = f"batch size {failed} is the minimum"
    else:  # a short last chunk, already below the minimum
        reason = f"nothing below batch size {failed} is allowed (minimum={minimum})"
    if exhaustion.failing_rank is not None and exhaustion.failing_rank != exhaustion.rank:
        last = (
            f"Rank {exhaustion.failing_rank} of {exhaustion.world_size} ran out of memory, "
            "and every rank gives up with it."
        )
    else:
        last = f"The last error was raised at {exhaustion.where}."
    why = "" if exhaustion.diagnosis is None else f" Diagnosis: {exhaustion.diagnosis}"
    return (
        f"{exhaustion.name}: out of memory. Every batch size tried failed ({tried}); {reason}. "
        f"{last} {_memory_summary(exhaustion.device, exhaustion.free_bytes)}{why}{_explanation(exhaustion)}"
    )


def _memory_summary(device: torch.device, free: int) -> str:
    # Read after the release, unlike the diagnosis's figures, read at the error: said, or the two would clash.
    parts = [f"Once the failed attempt was released, {format_free(free)} free on {device}"]
    if tracking.simulated.free() is not None:
        parts.append("(a simulated device)")
    elif memory.on_accelerator(device):
        allocated = torch.accelerator.memory_allocated(device)
        reserved = torch.accelerator.memory_reserved(device)
        parts.append(
            f"with {format_bytes(allocated)} allocated by tensors and {format_bytes(reserved)} "
            "reserved by PyTorch's caching allocator"
        )
    return " ".join(parts) + "."


def _explanation(exhaustion: Exhaustion) -> str:
    """Say what holds the memory and what one sample needs."""
    parts = []
    try:
        # Scans the objects the failing call's frames reach: paid for only when a call gives up.
        held = report.explain(exhaustion.device, exhaustion.frame)
    except Exception:  # a diagnosis must never hide the error it explains
        held = ""
    if held:
        parts.append(held)
    if exhaustion.figures is not None:
        per_sample, fixed = exhaustion.figures
        parts.append(
            f"The estimate (initial='auto') puts one sample at {format_bytes(per_sample)} on top of "
            f"{format_bytes(fixed)} that do not depend on the batch size."
        )
    return "".join(f" {part}" for part in parts)
