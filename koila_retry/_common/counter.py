"""A lock-free counter for statistics on the happy path."""

from __future__ import annotations

import itertools


class Counter:
    """A counter that threads can increment without a lock."""

    __slots__ = ("_count", "increment")

    def __init__(self, start: int = 0) -> None:
        self._count = itertools.count(start)
        # One C call, atomic in CPython, where ``self.n += 1`` can lose updates between threads
        # and a lock costs more than the rest of a cached call.
        self.increment = self._count.__next__

    @property
    def value(self) -> int:
        """The number of increments so far."""
        # repr is "count(N)": N is the next value to be returned, the increments so far.
        return int(repr(self._count)[6:-1])
