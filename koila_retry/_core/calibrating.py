"""Calibration (``initial="auto"`` where the device keeps a peak): measured runs correct the estimate's size.

The front end wraps a run in :attr:`Attempt.meter <koila_retry.Attempt.meter>` and hands
the rows and the rise to :func:`calibrate`; the estimate, which the engine only asks,
lives in ``koila_retry._estimation``.
"""

from __future__ import annotations

import logging

from koila_retry._common.units import format_bytes
from koila_retry._core import decision
from koila_retry._core.call import FirstSize
from koila_retry._core.decision import Outcome
from koila_retry._core.outcomes import Failure
from koila_retry._core.strategy import Course, Strategy

__all__ = ["MEASURES", "Calibrating", "calibrate"]

logger = logging.getLogger("koila_retry")

# How many runs of a call that measures are measured: a probe, then a run at the size it chose.
MEASURES = 2


class Calibrating(Strategy):
    """Measure a call's first runs; after one that ran out of memory, probe where the estimate now says."""

    def __init__(self, first: FirstSize) -> None:
        self.first = first

    def start(self, course: Course, first: bool) -> None:
        if first:
            course.state.measures = MEASURES

    def out_of_memory(self, course: Course, failure: Failure, final: bool) -> None:
        state = course.state
        if state.corrected:
            rows = state.size if state.rows is None else state.rows
            state.failed = rows if state.failed is None else min(state.failed, rows)
        if state.measures:  # the estimate is short: its smaller probe is the decision's hint
            hint = self.first.after_oom(state.size)
            reused = failure.reused is not None
            failure.step = decision.decide(course.owner.rules, state, Outcome.OUT_OF_MEMORY, hint=hint, reused=reused)


def calibrate(course: Course, rows: int, rise: int) -> int:
    """Move a call on to the size the estimate corrected by a measured run chooses (see :meth:`Attempt.calibrate`)."""
    state, first = course.state, course.call.first
    if not state.measures or first is None:
        raise RuntimeError("calibrate() follows a run measured with attempt.meter, of a call that measures")
    state.measures -= 1
    size = decision.calibrated(state, first.corrected(rows, rise), rows)
    state.corrected = True
    message = "%s: %d rows rose by %s on %s; the corrected estimate chooses batch size %d"
    logger.info(message, course.owner.name, rows, format_bytes(rise), course.call.device, size)
    course.resize(size)
    for calibrated in course.plan.calibrated:
        calibrated(course)
    return size
