"""``refine=True``: probes between the size that fits and the smallest that failed under the key.

The bound is a size, so the cache keeps it (``cache.bounds``; a DiskCache writes it
to its file): it outlives the process as the sizes do.
"""

from __future__ import annotations

import logging

from koila_retry._core import decision
from koila_retry._core.decision import Done, Step
from koila_retry._core.stats import OOMEvent
from koila_retry._core.strategy import Course, Strategy

__all__ = ["Presuming", "Refining"]

logger = logging.getLogger("koila_retry")


class Refining(Strategy):
    """Probe halfway to the smallest size that failed, and move that bound as sizes fit and fail."""

    def start(self, course: Course, first: bool) -> None:
        state, key = course.state, course.key
        if key is None or state.probe_from is not None:
            return  # nothing remembered; or a growth probe runs first
        failed = decision.bound_rows(course.owner.cache.bounds.get(key), course.call.per_sample)
        size = decision.refined(course.owner.rules, state, failed)
        if size != state.size:
            logger.info("%s: batch size %d fits and %s did not; trying %d", course.owner.name, state.size, failed, size)
            state.probe_from = state.size
            course.resize(size)

    def stored(self, course: Course, done: Done) -> None:
        if course.key is not None and done.conclusive:
            size, per_sample = course.state.size, course.call.per_sample
            course.owner.cache.bounds.update(course.key, lambda bound: decision.still_failed(bound, size, per_sample))

    def failed(self, course: Course, event: OOMEvent, step: Step) -> None:
        # On every rank (the size failed in the job), and outside the handler: a DiskCache writes it.
        if course.key is not None:
            size, per_sample = event.batch_size, course.call.per_sample
            course.owner.cache.bounds.update(course.key, lambda bound: decision.failed_at(bound, size, per_sample))


class Presuming(Strategy):
    """Record twice an estimate's size as failed, so that the search stays below it (after the ranks agreed)."""

    def start(self, course: Course, first: bool) -> None:
        if first and course.state.estimated and not course.state.measures:
            self.calibrated(course)

    def calibrated(self, course: Course) -> None:
        size = decision.presumed(course.owner.rules, course.state)
        if size is not None and course.key is not None:
            per_sample = course.call.per_sample
            course.owner.cache.bounds.update(course.key, lambda bound: decision.failed_at(bound, size, per_sample))
