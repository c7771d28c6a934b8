"""The cache types of :mod:`koila_retry.compat.toma`, under toma's names.

Each is a koila_retry cache (a :class:`~koila_retry.SizeCache`), so it is
thread-safe, bounded and has ``cache_info()`` and ``cache_clear()``. The toma
functions make one instance per cache type and context (by default, the
decorated function), so a type decides what distinguishes calls *within* one
context.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import sys

from koila_retry._core.cache import GlobalCache, NoCache, StackMemoryCache

__all__ = ["GlobalBatchsizeCache", "NoBatchsizeCache", "StacktraceMemoryBatchsizeCache"]


class NoBatchsizeCache(NoCache):
    """Remember nothing: every call starts at the initial size it is given.

    .. versionadded:: 0.1.0
    """


class GlobalBatchsizeCache(GlobalCache):
    """Remember one size per context (by default, per function), wherever it is called from.

    .. versionadded:: 0.1.0
    """


class StacktraceMemoryBatchsizeCache(StackMemoryCache):
    """Remember sizes per call stack and free-memory level (the default).

    The key is the stack key of the whole call stack above the call
    (``koila.deep_stack_key(sys.maxsize)``: file, function and position in each
    frame, read from ``sys._getframe``), the device the call runs on, and its
    free memory in power-of-two buckets: the same code path with about the same
    free memory starts where the last call ended. toma used 256 MiB steps of
    free CPU RAM and of CUDA device 0's memory instead.

    Args:
        lru_cache_size (int, optional): how many keys to keep; the least
            recently used go first. Default: ``2**16``, as in toma.

    Raises:
        TypeError: if ``lru_cache_size`` is not an int or ``None``.
        ValueError: if ``lru_cache_size`` is below 1.

    .. versionadded:: 0.1.0
    """

    LRU_CACHE_SIZE: int = 2**16

    def __init__(self, lru_cache_size: int | None = None) -> None:
        if lru_cache_size is None:
            lru_cache_size = self.LRU_CACHE_SIZE
        elif isinstance(lru_cache_size, bool) or not isinstance(lru_cache_size, int):
            raise TypeError(
                f"lru_cache_size must be an int or None, got {type(lru_cache_size).__name__} {lru_cache_size!r}"
            )
        elif lru_cache_size < 1:
            raise ValueError(f"lru_cache_size must be >= 1, got {lru_cache_size}")
        super().__init__(lru_cache_size, depth=sys.maxsize)
