"""Exceptions raised by koila-retry."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["BatchSizeExhausted", "CacheFileWarning"]


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

    .. versionadded:: 0.1.0
    """

    def __init__(self, message: str, *, batch_size: int, attempts: int) -> None:
        super().__init__(message)
        self.batch_size = batch_size
        self.attempts = attempts

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only arguments are not in ``args``; without this the error could not
        # cross a process boundary (multiprocessing, torch.distributed launchers).
        return (_rebuild, (type(self), str(self), self.batch_size, self.attempts))


def _rebuild(cls: type[BatchSizeExhausted], message: str, batch_size: int, attempts: int) -> BatchSizeExhausted:
    return cls(message, batch_size=batch_size, attempts=attempts)


class CacheFileWarning(UserWarning):
    """Warned when a :class:`DiskCache` file cannot be read or written.

    The cache then keeps sizes in memory only; the job goes on. Filter it like
    any warning, e.g. ``warnings.simplefilter("error", koila.CacheFileWarning)``
    to make it fatal in CI.

    .. versionadded:: 0.1.0
    """
