"""The cache types of :mod:`koila_retry.compat.toma`, under toma's names.

Each is a koila_retry cache (a :class:`~koila_retry.SizeCache`: thread-safe,
bounded, with ``cache_info()`` and ``cache_clear()``) and decides what tells
calls apart *within* a context, of which each gets its own instance.

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
    """Remember sizes per call stack, device and free-memory level (the default).

    The key is ``koila.deep_stack_key(sys.maxsize)``'s: every frame of the stack
    above the call, its device, and that device's free memory in power-of-two
    buckets. toma used 256 MiB steps of free CPU RAM and of CUDA device 0's.

    Args:
        lru_cache_size (int, optional): how many keys to keep, the least
            recently used going first. Default: ``2**16``, as in toma.

    Raises:
        TypeError: if ``lru_cache_size`` is not an int or ``None``.
        ValueError: if ``lru_cache_size`` is below 1.

    .. versionadded:: 0.1.0
    """

    LRU_CACHE_SIZE: int = 2**16

    def __init__(self, lru_cache_size: int | None = None) -> None:
        size = self.LRU_CACHE_SIZE if lru_cache_size is None else lru_cache_size
        if isinstance(size, bool) or not isinstance(size, int):
            raise TypeError(f"lru_cache_size must be an int or None, got {type(size).__name__} {size!r}")
        if size < 1:
            raise ValueError(f"lru_cache_size must be >= 1, got {size}")
        super().__init__(size, depth=sys.maxsize)
