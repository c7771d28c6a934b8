"""Growing back (``grow=True``): a probe above a reduced size once its key succeeded enough times in a row.

Each key's :data:`~koila_retry._core.cache.Streak` is the engine's, not the cache's:
it lives in :class:`Streaks`, one per cache (``koila.attempts`` makes a controller
per run, and the streak must outlive it), forgotten when the cache is cleared.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Any, TypeVar, cast

from koila_retry._common.forks import locks_renewed_in_child
from koila_retry._core import decision
from koila_retry._core.cache import PerKey, SizeCache, Streak
from koila_retry._core.decision import Done, Step
from koila_retry._core.stats import OOMEvent
from koila_retry._core.strategy import Course, Strategy

__all__ = ["Followed", "Growing", "Streaks", "followed", "streaks"]

logger = logging.getLogger("koila_retry")

Kept = TypeVar("Kept")


class Followed(PerKey[Kept]):
    """What the engine follows per key of one cache, beside its sizes; forgotten when the cache is cleared."""

    def __init__(self, cache: SizeCache) -> None:
        super().__init__(cache.cache_info().maxsize)
        self.cache = weakref.ref(cache)
        self.generation = cache.generation

    def update(self, key: Hashable, change: Callable[[Kept | None], Kept | None]) -> Kept | None:
        self.follow()
        return super().update(key, change)

    def get(self, key: Hashable) -> Kept | None:
        self.follow()
        return super().get(key)

    def follow(self) -> None:
        """Forget every key if the cache was cleared since the last look."""
        cache = self.cache()
        if cache is not None and cache.generation != self.generation:
            self.generation = cache.generation
            self.clear()


class Streaks(Followed[Streak]):
    """Each key's streak towards growing back, for one cache; forgotten when the cache is cleared."""


# By the cache's id, while it lives, and the kind followed.
_FOLLOWED: dict[tuple[int, type[Any]], Followed[Any]] = {}
_LOCK = threading.Lock()
locks_renewed_in_child(globals(), "_LOCK")  # a fork while another thread held it
F = TypeVar("F", bound=Followed[Any])


def followed(cache: SizeCache, kind: type[F]) -> F:
    """Return what the engine follows of ``kind`` for ``cache``, made on first use."""
    where = (id(cache), kind)
    found = _FOLLOWED.get(where)  # without the lock: once made, every call finds it
    if found is None:
        with _LOCK:
            found = _FOLLOWED.get(where)
            if found is None:
                found = _FOLLOWED[where] = kind(cache)
                weakref.finalize(cache, _FOLLOWED.pop, where, None)
    return cast(F, found)


def streaks(cache: SizeCache) -> Streaks:
    """Return the streaks the engine follows for ``cache``, made on first use."""
    return followed(cache, Streaks)


class Growing(Strategy):
    """Probe above a reduced size when its key is due, and count successes and failures towards the next probe."""

    def __init__(self, streaks: Streaks, wait: int) -> None:
        self.streaks, self.wait = streaks, wait

    def start(self, course: Course, first: bool) -> None:
        state, name = course.state, course.owner.name
        streak = self.streaks.update(course.key, decision.started_growing) if state.size < state.ceiling else None
        rules, due, failed = course.owner.rules, decision.due(streak), None
        if due and rules.refine and course.key is not None:  # refine's bound: only refine moves it
            failed = decision.bound_rows(course.owner.cache.bounds.get(course.key), course.call.per_sample)
        size = decision.grown(rules, state, due, failed)
        state.probe_from = state.size if size != state.size else None
        state.growing = size != state.size  # refine's probe, which may start instead, is none of growth's
        if size != state.size:
            wait = None if streak is None else streak[1]
            logger.info("%s: succeeded %s times in a row at batch size %d; trying %d", name, wait, state.size, size)
        course.resize(size)

    def stored(self, course: Course, done: Done) -> None:
        wait = self.wait
        self.streaks.update(course.key, lambda streak: decision.counted(streak, done, wait))

    def failed(self, course: Course, event: OOMEvent, step: Step) -> None:
        self.streaks.update(course.key, lambda streak: decision.failed_growing(streak, step.probe))
