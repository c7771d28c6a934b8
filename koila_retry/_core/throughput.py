"""Growth that weighs throughput (``grow_gain``): a probe that fits but runs hardly faster is given up."""

from __future__ import annotations

import logging
from typing import cast

from koila_retry._core import decision
from koila_retry._core.decision import Done, Outcome
from koila_retry._core.strategy import Course, Strategy

__all__ = ["Throughput"]

logger = logging.getLogger("koila_retry")


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
    owner, state, call = course.owner, course.state, course.call
    if state.rows is not None:
        return None  # a short step says nothing of its size's rate
    # What one attempt runs: all the call's rows where its size splits them (accumulate's
    # micro-batches), else its size (a call of batch, a chunk of chunked, whose span is set).
    rows = call.rows if call.span is None and call.rows else state.size
    rate = owner.stats.record_time(state.size, owner.policy.clock() - course.clocked, rows)
    below = state.probe_from
    if rate is None or below is None or state.size <= below:
        return None
    base = owner.stats.rate(below)
    return None if not base else rate / base - 1
