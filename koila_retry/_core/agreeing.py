"""Agreement across ranks: every rank starts each call and step at one size, and settles each attempt together.

The collectives run outside the ``except`` block: :meth:`Agreeing.settle` is the
exchange after each attempt, and a rank that failed takes part in it as the others do.
"""

from __future__ import annotations

from typing import cast

from koila_retry._core import decision, distributed
from koila_retry._core.decision import Outcome, Try
from koila_retry._core.outcomes import Failure
from koila_retry._core.strategy import FAILED, PENDING, Alone, Course, Strategy

__all__ = ["Agreeing"]


class Agreeing(Strategy, Alone):
    """Start at the ranks' common size, and settle each attempt by their exchange after it."""

    waits = True

    def __init__(self, agreement: distributed.Agreement, on_steps: bool, sharded: bool = False) -> None:
        # on_steps: whether a step may start at another size than the last succeeded at (growing,
        # refining); else the ranks agreed on the size that succeeded, the same everywhere.
        self.agreement: distributed.Agreement = agreement
        self.on_steps, self.unanimous = on_steps, True
        # sharded: the call reaches FSDP2 modules, whose collectives every micro-batch or chunk makes, so
        # the ranks must cover as many rows (at any size, or one rank runs a micro-batch more and hangs).
        self.sharded = sharded
        self.rank: int | None = agreement.rank
        self.world_size: int | None = agreement.world_size

    def start(self, course: Course, first: bool) -> None:
        if first or self.on_steps:
            rules, state = course.owner.rules, course.state
            call = course.call
            span = (call.span or (call.rows if self.sharded else None) or None) if first else None
            # Rows of a step (accumulate's), not a span the ranks must share: one run whole needs no other
            # rank's size, and a rank with fewer rows would split the others' for nothing.
            whole = 0 < call.rows <= state.size and call.span is None and not self.sharded
            agreed, floor = self.agreement.start(state.size, span, rules.minimum, rules.initial, whole)
            decision.agreed_start(state, agreed, floor)
            course.resize(state.size)

    def succeeded(self, course: Course) -> None:
        course.phase = PENDING  # a success here is kept only if every rank had one

    def settle(self, course: Course, vote: bool) -> bool:
        failed = course.phase == FAILED
        proposal = course.failure.step if failed and course.failure is not None else None
        failing, agreed, self.unanimous = self.agreement.after(
            failed, proposal.size if isinstance(proposal, Try) else None, vote
        )
        if failing is None:
            course.succeed()
            return True
        failure = course.fail(f"rank {failing}") if not failed else cast(Failure, course.failure)
        failure.rank = failing
        reused = failure.reused is not None
        state = course.state
        state.ran_out = state.ran_out or failed
        failure.step = decision.decide(course.owner.rules, state, Outcome.AGREED, agreed=agreed, reused=reused)
        if not state.ran_out and course.call.rows > 0 and isinstance(failure.step, Try):
            # Only other ranks' failures: a success at the size they lead to says nothing of this rank's rows,
            # and stored, would split the batches this rank fits whole (accumulate's: ranks' rows may differ).
            decision.not_stored_below(state, failure.step.size)
        return False
