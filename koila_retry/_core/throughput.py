"""Growth that weighs throughput (``grow_gain``): a probe that fits but runs hardly faster is given up."""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import cast

from koila_retry._core import decision
from koila_retry._core.decision import Done, Outcome
from koila_retry._core.growing import Followed, followed
from koila_retry._core.strategy import Course, Strategy

__all__ = ["Rates", "Throughput"]

logger = logging.getLogger("koila_retry")

#: The attempts timed at one size, and their mean rows per second.
Rate = tuple[int, float]


class Rates(Followed[dict[int, Rate]]):
    """Each key's mean rows per second by size, for one cache: what ``grow_gain`` weighs a probe against."""

    # Per key, not per wrapper: another call site, or another class of samples, may run rows of
    # another cost, and its rate would say nothing of this key's size below its probe.

    def record(self, key: Hashable, size: int, rate: float) -> float:
        """Count an attempt of ``key`` at ``size`` that ran ``rate`` rows/s; return the key's mean at ``size``."""
        mean = [rate]

        def counted(kept: dict[int, Rate] | None) -> dict[int, Rate]:
            count, before = (kept or {}).get(size, (0, 0.0))
            mean[0] = before + (rate - before) / (count + 1)
            return {**(kept or {}), size: (count + 1, mean[0])}

        self.update(key, counted)
        return mean[0]

    def mean(self, key: Hashable, size: int) -> float | None:
        """Return the mean rows/s of ``key`` at ``size``, or ``None`` if none was timed."""
        found = (self.get(key) or {}).get(size)
        return None if found is None else found[1]


class Throughput(Strategy):
    """Time each attempt; after a growth probe that fitted, weigh its rows per second against the size below."""

    def begin(self, course: Course) -> None:
        course.clocked = course.owner.policy.clock()

    def judge(self, course: Course, done: Done) -> Done:
        gain = gain_of(course)
        if gain is None:
            return done
        return cast(Done, decision.decide(course.owner.rules, course.state, Outcome.SUCCEEDED, gain=gain))

    def stored(self, course: Course, done: Done) -> None:
        if done.too_slow:  # back to the size below, for the rest of the call
            owner, state = course.owner, course.state
            below = state.probe_from or 0
            logger.info(
                "%s: batch size %d ran less than %g%% more rows per second than %d; staying at %d",
                *(owner.name, state.size, 100 * (owner.rules.grow_gain or 0), below, below),
            )
            state.cached = below
            course.resize(below)
            state.probe_from = None


def gain_of(course: Course) -> float | None:
    """Time the attempt that succeeded; at a growth probe, return its gain in rows/s over the size below."""
    owner, state, call, key = course.owner, course.state, course.call, course.key
    if state.rows is not None:
        return None  # a short step says nothing of its size's rate
    # What one attempt runs: all the call's rows where its size splits them (accumulate's
    # micro-batches), else its size (a call of batch, a chunk of chunked, whose span is set).
    rows = call.rows if call.span is None and call.rows else state.size
    seconds = owner.policy.clock() - course.clocked
    rate = owner.stats.record_time(state.size, seconds, rows)  # stats.throughput: the wrapper's, every key's
    if rate is None:
        return None
    rates = None if key is None else followed(owner.cache, Rates)  # no key (NoCache): the wrapper's rates
    if rates is not None:
        rate = rates.record(key, state.size, rows / seconds)
    below = state.probe_from
    if below is None or state.size <= below:
        return None
    base = owner.stats.rate(below) if rates is None else rates.mean(key, below)
    return None if not base else rate / base - 1
