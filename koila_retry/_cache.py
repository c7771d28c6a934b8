"""Caches that remember which batch size worked, and the keys they use."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterator, MutableMapping
from types import FrameType
from typing import NamedTuple

import cachetools
import torch

from koila_retry._counter import Counter
from koila_retry._memory import recent_free_memory

__all__ = ["CacheInfo", "GlobalCache", "NoCache", "SizeCache", "StackMemoryCache"]


class CacheInfo(NamedTuple):
    """Hits, misses and size of a cache, as ``functools.lru_cache`` reports them."""

    hits: int
    misses: int
    maxsize: int
    currsize: int


class SizeCache(MutableMapping[Hashable, int], ABC):
    """A thread-safe, bounded mapping from a call's key to the batch size that worked.

    Subclasses decide what a key is (:meth:`key`); the mapping itself is a
    least-recently-used cache of at most ``maxsize`` entries. One cache may be
    shared by several decorated functions: keys include the function.

    Args:
        maxsize (int): how many keys to keep; the least recently used go first.

    Raises:
        ValueError: if ``maxsize`` is not a positive int.

    .. versionadded:: 0.1.0
    """

    def __init__(self, maxsize: int = 256) -> None:
        if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 1:
            raise ValueError(f"maxsize must be an int >= 1, got {maxsize!r}")
        self._sizes: cachetools.LRUCache[Hashable, int] = cachetools.LRUCache(maxsize)
        # Reads take no lock (a lock costs more than the rest of a cached call);
        # writes, rare, do. cachetools' LRU survives a read racing a write.
        self._lock = threading.Lock()
        self._hits = Counter()
        self._misses = Counter()
        self._recent: tuple[Hashable, int] | None = None

    @abstractmethod
    def key(self, function: object, caller: FrameType | None, device: torch.device) -> Hashable | None:
        """Return the key for one call, or ``None`` to neither look up nor store.

        Args:
            function (object): identifies the decorated function or block (a
                function or a code object).
            caller (FrameType or None): the frame that made the call.
            device (torch.device): the device the call runs on.

        Returns:
            Hashable or None: the key.
        """

    def lookup(self, key: Hashable) -> int | None:
        """Return the size stored under ``key``, counting a hit or a miss."""
        # A loop calls from the same place again and again: answer a repeat of the
        # latest key without the LRU's bookkeeping. One tuple, replaced whole, so a
        # racing thread sees either the old pair or the new one.
        recent = self._recent
        if recent is not None and recent[0] == key:
            self._hits.increment()
            return recent[1]
        try:
            size = self._sizes[key]
        except KeyError:
            fallback = self._fallback(key)
            if fallback is None:
                self._misses.increment()
                return None
            self[key] = size = fallback  # later calls find it directly
        self._hits.increment()
        self._recent = (key, size)
        return size

    def _fallback(self, key: Hashable) -> int | None:
        """Return a size for a key that is not stored, from a related key, or ``None``."""
        return None

    def cache_info(self) -> CacheInfo:
        """Return hits, misses, the bound and the number of keys stored."""
        with self._lock:
            return CacheInfo(self._hits.value, self._misses.value, int(self._sizes.maxsize), len(self._sizes))

    def cache_clear(self) -> None:
        """Forget every size and reset the hit and miss counts."""
        with self._lock:
            self._recent = None
            self._sizes.clear()
            self._hits, self._misses = Counter(), Counter()

    def __getitem__(self, key: Hashable) -> int:
        return self._sizes[key]

    def __setitem__(self, key: Hashable, size: int) -> None:
        with self._lock:
            self._recent = None  # the insertion may evict the remembered key
            self._sizes[key] = size
            self._recent = (key, size)

    def __delitem__(self, key: Hashable) -> None:
        with self._lock:
            self._recent = None
            del self._sizes[key]

    def __iter__(self) -> Iterator[Hashable]:
        with self._lock:
            return iter(list(self._sizes))

    def __len__(self) -> int:
        return len(self._sizes)

    def __repr__(self) -> str:
        hits, misses, maxsize, currsize = self.cache_info()
        return f"{type(self).__name__}(maxsize={maxsize}, currsize={currsize}, hits={hits}, misses={misses})"


class StackMemoryCache(SizeCache):
    """Remember sizes per call site and per free-memory level (the default cache).

    The key is the function, the place of the call in each of the innermost
    ``depth`` calling frames (file, function and position within it, read from
    ``sys._getframe``, no ``inspect``), the device, and the device's free memory in power-of-two
    buckets. The same loop calling again with about the same free memory starts
    at the size that last worked; another call site, or the same one with much
    more free memory, starts afresh. With less free memory than any stored
    level, it starts from the size that worked at the nearest level above (up to
    ``fallback_buckets`` buckets, each a factor of two, away): every larger size
    failed even with more memory. Free memory is read at most once a second per
    device, because a reading costs far more than a cached call.

    Args:
        maxsize (int): how many keys to keep; the least recently used go first.
        depth (int): how many calling frames identify a call site. Default: 1,
            the line that calls.
        fallback_buckets (int): how many free-memory buckets above the current
            one to look in when the current one has no size. Default: 4.

    Raises:
        ValueError: if ``maxsize``, ``depth`` or ``fallback_buckets`` is out of range.

    .. versionadded:: 0.1.0
    """

    def __init__(self, maxsize: int = 256, *, depth: int = 1, fallback_buckets: int = 4) -> None:
        super().__init__(maxsize)
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be an int >= 1, got {depth!r}")
        if isinstance(fallback_buckets, bool) or not isinstance(fallback_buckets, int) or fallback_buckets < 0:
            raise ValueError(f"fallback_buckets must be an int >= 0, got {fallback_buckets!r}")
        self.depth = depth
        self.fallback_buckets = fallback_buckets

    def key(self, function: object, caller: FrameType | None, device: torch.device) -> Hashable:
        # File, function name and bytecode offset of each frame: the strings cache their
        # hashes (hashing a code object rehashes its bytecode on every call), and the
        # offset is read directly where f_lineno searches the line table.
        # Power-of-two buckets: readings within a factor of two usually share one, so small
        # fluctuations keep the cache warm while twice the memory gets a fresh start.
        bucket = recent_free_memory(device).bit_length()
        if self.depth == 1 and caller is not None:  # the default, spelled out: no loop, one tuple
            code = caller.f_code
            return (function, device, bucket, code.co_filename, code.co_name, caller.f_lasti)
        parts: tuple[object, ...] = (function, device, bucket)
        frame, remaining = caller, self.depth
        while frame is not None and remaining:
            code = frame.f_code
            parts += (code.co_filename, code.co_name, frame.f_lasti)
            frame, remaining = frame.f_back, remaining - 1
        return parts

    def _fallback(self, key: Hashable) -> int | None:
        # Nothing stored at this free-memory level: take the size that worked at the
        # same call site with more free memory. Every larger size failed even then, so
        # starting there skips only attempts that would fail again. (Gradients left by
        # a previous step, or optimizer state made by the first one, move free memory
        # down a bucket between the first call and the second.)
        if not isinstance(key, tuple) or len(key) < 3 or not isinstance(key[2], int):
            return None
        head, bucket, tail = key[:2], key[2], key[3:]
        for more in range(1, self.fallback_buckets + 1):
            size = self._sizes.get((*head, bucket + more, *tail))
            if size is not None:
                return size
        return None


class GlobalCache(SizeCache):
    """Remember one size per function, wherever and however it is called.

    Args:
        maxsize (int): how many functions to keep; the least recently used go first.

    .. versionadded:: 0.1.0
    """

    def key(self, function: object, caller: FrameType | None, device: torch.device) -> Hashable:
        return function


class NoCache(SizeCache):
    """Remember nothing: every call starts at the initial size.

    .. versionadded:: 0.1.0
    """

    def key(self, function: object, caller: FrameType | None, device: torch.device) -> None:
        return None

    def __setitem__(self, key: Hashable, size: int) -> None:
        pass  # remembering nothing is this cache's whole contract
