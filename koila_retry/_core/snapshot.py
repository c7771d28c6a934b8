"""PyTorch's memory snapshot of a call that runs out of memory, on request (``snapshot=``).

At a call's first out-of-memory error the CUDA allocator's history starts, so that the retries are
recorded; at a give-up (or every such error, with ``snapshot_each_oom``) PyTorch's own snapshot, which
https://pytorch.org/memory_viz opens, is written while the failed attempt's memory is still held. The
history is process-wide: it stops when the last recording call ends, unless something else started it.
These are PyTorch's private functions, the ones its memory documentation names.
"""

from __future__ import annotations

import os
import pickle
import threading
from collections.abc import Callable
from typing import Any

import torch

from koila_retry._common.forks import lock_renewed_in_child
from koila_retry._common.places import levels_to_caller
from koila_retry._common.tracking import simulated
from koila_retry._common.units import check_flag
from koila_retry._common.warn import warn_or_log

__all__ = ["Snapshots", "Target", "check_target"]

#: Where a snapshot goes: a path (``"{rank}"`` and ``"{attempt}"`` are filled in), or a
#: callable given the snapshot, a dict.
# Evaluated, not a string: typing.get_type_hints() reads it from the modules that use it.
Target = str | os.PathLike[str] | Callable[[dict[str, Any]], None]

# Events kept in the history: enough for the retries of a step, bounded for a long job.
MAX_ENTRIES = 100_000


def check_target(target: object, each: object) -> None:
    """Refuse a ``snapshot=`` or ``snapshot_each_oom=`` a call could not use, when the front end is made."""
    check_flag("snapshot_each_oom", each)
    if target is None or (callable(target) and not isinstance(target, (str, os.PathLike))):
        return
    if not isinstance(target, (str, os.PathLike)):
        raise TypeError(
            "snapshot must be a path like 'oom/{rank}.pickle' or a callable given the snapshot (a dict), "
            f"got {type(target).__name__} {target!r}"
        )
    try:
        os.fspath(target).format(rank=0, attempt=1)
    except (KeyError, IndexError, ValueError, TypeError, AttributeError) as exc:
        raise ValueError(
            f"snapshot={os.fspath(target)!r}: the path may name {{rank}} and {{attempt}} and no other field "
            f"(double a brace to keep it: {{{{ }}}}): {exc}"
        ) from None


class _History:
    """The allocator's history, process-wide: started by the first call that records, stopped by the last."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        lock_renewed_in_child(self, "lock")
        self.users = 0
        self.ours = False

    def join(self) -> None:
        with self.lock:
            if self.users == 0:
                already = bool(torch._C._cuda_isHistoryEnabled())
                if not already:
                    torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES)
                self.ours = not already
            self.users += 1

    def leave(self) -> None:
        with self.lock:
            self.users -= 1
            if self.users == 0 and self.ours:
                self.ours = False
                torch.cuda.memory._record_memory_history(enabled=None)


_history = _History()
_NOTHING_TO_RECORD = (
    "snapshot= records the CUDA caching allocator's history, and {device} has none{why}: nothing was recorded "
    "for {name}"
)


class Snapshots:
    """One call's snapshots: the history it records, and what it writes; ``name`` is for warnings."""

    def __init__(self, target: Target, each: bool, device: torch.device, name: str) -> None:
        self.target, self.each, self.device, self.name = target, each, device, name
        self.recording = False
        self.warned = False

    def failed(self, attempt: int, giving_up: bool) -> None:
        """At an out-of-memory error, while the attempt's memory is held: record from now on, and write if due."""
        if self.device.type != "cuda" or not torch.cuda.is_available() or simulated.device() is not None:
            if not self.warned:  # once a call
                self.warned = True
                why = " (a simulated device)" if simulated.device() is not None else ""
                # Warned while the out-of-memory error is handled: a filter that makes it an error
                # must not end the recovery, or take the place of BatchSizeExhausted.
                warn_or_log(
                    _NOTHING_TO_RECORD.format(device=self.device, why=why, name=self.name),
                    stacklevel=levels_to_caller(),
                )
            return
        try:
            if not self.recording:
                _history.join()
                self.recording = True
            if self.each or giving_up:
                self._write(attempt)
        except Exception as exc:  # a snapshot never hides the out-of-memory error
            warn_or_log(f"snapshot= could not be taken for {self.name}: {exc}", stacklevel=levels_to_caller())

    def _write(self, attempt: int) -> None:
        data = torch.cuda.memory._snapshot(self.device)
        if callable(self.target) and not isinstance(self.target, (str, os.PathLike)):
            self.target(data)
            return
        rank = (
            torch.distributed.get_rank()
            if torch.distributed.is_available() and torch.distributed.is_initialized()
            else 0
        )
        path = os.fspath(self.target).format(rank=rank, attempt=attempt)
        with open(path, "wb") as file:
            pickle.dump(data, file)

    def close(self) -> None:
        """End the call's recording (the history stops when no other call records)."""
        if self.recording:
            self.recording = False
            _history.leave()
