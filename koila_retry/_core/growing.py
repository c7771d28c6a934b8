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

from koila_retry._core import decision
from koila_retry._core.cache import PerKey, SizeCache, Streak
from koila_retry._core.decision import Done, Step
from koila_retry._core.stats import OOMEvent
from koila_retry._core.strategy import Course, Strategy

__all__ = ["Growing", "Streaks", "streaks"]

logger = logging.getLogger("koila_retry")


class Streaks(PerKey[Streak]):
    """Each key's streak towards growing back, for one cache; forgotten when the cache is cleared."""

    def __init__(self, cache: SizeCache) -> None:
        super().__init__(cache.cache_info().maxsize)
        self.cache = weakref.ref(cache)
        self.generation = cache.generation

    def update(self, key: Hashable, change: Callable[[Streak | None], Streak | None]) -> Streak | None:
        self.follow()
        return super().update(key, change)

    def get(self, key: Hashable) -> Streak | None:
        self.follow()
        return super().get(key)

    def follow(self) -> None:
        """Forget every streak if the cache was cleared since the last look."""
        cache = self.cache()
        if cache is not None and cache.generation != self.generation:
            self.generation = cache.generation
            self.clear()


_FOLLOWED: dict[int, Streaks] = {}  # by the cache's id, while it lives
_LOCK = threading.Lock()


def streaks(cache: SizeCache) -> Streaks:
    """Return the streaks the engine follows for ``cache``, made on first use."""
    with _LOCK:
        found = _FOLLOWED.get(id(cache))
        if found is None:
            found = _FOLLOWED[id(cache)] = Streaks(cache)
            weakref.finalize(cache, _FOLLOWED.pop, id(cache), None)
    return found


class Growing(Strategy):
    """Probe above a reduced size when its key is due, and count successes and failures towards the next probe."""

    def __init__(self, streaks: Streaks, wait: int) -> None:
        self.streaks, self.wait = streaks, wait

    def start(self, course: Course, first: bool) -> None:
        state, name = course.state, course.owner.name
        streak = self.streaks.update(course.key, decision.started_growing) if state.size < state.ceiling else None
        size = decision.grown(course.owner.rules, state, decision.due(streak))
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
