"""Exceptions raised by koila-retry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from koila_retry._common.units import format_bytes

__all__ = ["BatchSizeExhausted", "CacheFileWarning", "Diagnosis"]


@dataclass(frozen=True)
class Diagnosis:
    """Why a call ran out of memory, as the device's allocator tells it: capacity or fragmentation.

    The two call for opposite fixes. *Capacity*: the memory is not there, in all,
    for what was asked; run less at once (a smaller batch or ``minimum``), shard or
    offload the model, or use less precision. *Fragmentation*: the memory is there,
    cached by PyTorch's allocator or still free on the device, but in pieces too
    small for the request; ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` or
    freeing the cached blocks fixes it, and a smaller batch may not.

    Made when a call gives up (:attr:`BatchSizeExhausted.diagnosis`), from the
    state of the allocator at its last out-of-memory error. Plain values only.

    Attributes:
        kind (str): ``"capacity"``, ``"fragmentation"`` or ``"unknown"``.
        requested (int or None): the bytes the failed allocation asked for, read
            from the error's message; ``None`` if it does not say.
        free (int or None): the bytes the allocator could still have taken from the
            device, within the process's share
            (``torch.cuda.set_per_process_memory_fraction``); on a simulated device,
            its free bytes; ``None`` where unknown.
        reserved_unused (int or None): bytes the caching allocator holds that no
            tensor uses; ``None`` where there is no caching allocator.
        largest_free_block (int or None): the largest of those free pieces; ``None``
            where the allocator cannot say.
        advice (str): what to do about it, for the kind.

    .. versionadded:: 0.1.0
    """

    kind: str
    requested: int | None
    free: int | None
    reserved_unused: int | None
    largest_free_block: int | None
    advice: str

    def __str__(self) -> str:
        def size(value: int | None) -> str:
            return "unknown" if value is None else format_bytes(value)

        parts = [f"asked for {size(self.requested)}"]
        if self.free is not None:
            parts.append(f"{format_bytes(self.free)} still free to allocate")
        if self.reserved_unused is not None:
            parts.append(f"{format_bytes(self.reserved_unused)} cached by PyTorch but unused")
        if self.largest_free_block is not None:
            parts.append(f"the largest free piece {format_bytes(self.largest_free_block)}")
        return f"{self.kind} ({', '.join(parts)}). {self.advice}"


class BatchSizeExhausted(torch.OutOfMemoryError):
    """Raised when even the smallest allowed batch size runs out of memory.

    A subclass of ``torch.OutOfMemoryError`` (itself a ``RuntimeError``), so
    handlers written for PyTorch's own error still catch it. It is raised
    ``from`` the last out-of-memory error; that error's traceback is dropped so
    it cannot keep the failed attempt's tensors alive, and where it happened is
    named in the message instead.

    Args:
        message (str): what happened, what was tried and what holds the memory.
        batch_size (int): the last batch size tried.
        attempts (int): how many attempts the call made.
        diagnosis (Diagnosis, optional): why the last attempt ran out of memory,
            as the allocator tells it; ``None`` where this process saw no
            out-of-memory error of its own (another rank's ended the call).

    Attributes:
        batch_size (int): the last batch size tried.
        attempts (int): how many attempts the call made.
        diagnosis (Diagnosis or None): capacity or fragmentation, and the advice.

    .. versionadded:: 0.1.0
    """

    def __init__(self, message: str, *, batch_size: int, attempts: int, diagnosis: Diagnosis | None = None) -> None:
        super().__init__(message)
        self.batch_size = batch_size
        self.attempts = attempts
        self.diagnosis = diagnosis

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only arguments are not in ``args``; without this the error could not
        # cross a process boundary (multiprocessing, torch.distributed launchers). The
        # instance's dict carries ``add_note``'s notes, as a built-in exception's pickle does.
        return (_rebuild, (type(self), str(self), self.batch_size, self.attempts, self.diagnosis), self.__dict__)


def _rebuild(
    cls: type[BatchSizeExhausted], message: str, batch_size: int, attempts: int, diagnosis: Diagnosis | None = None
) -> BatchSizeExhausted:
    return cls(message, batch_size=batch_size, attempts=attempts, diagnosis=diagnosis)


class CacheFileWarning(UserWarning):
    """Warned when a :class:`DiskCache` file cannot be read or written.

    The cache then keeps sizes in memory only; the job goes on. Filter it like
    any warning, e.g. ``warnings.simplefilter("error", koila.CacheFileWarning)``
    to make a file that cannot be read fatal in CI where the cache is made. A
    write fails after a call succeeded or while its out-of-memory error is
    handled: an error that a filter makes of the warning there is logged on the
    ``koila_retry`` logger instead, so that it costs no call its result.

    .. versionadded:: 0.1.0
    """
