"""The attempts of one call: the engine's state machine, which every driver and ``with`` block runs.

Inside the ``except`` clause (or ``__exit__``) an attempt only classifies the
error and asks the decision (:mod:`koila_retry._core.decision`) what follows:
the exception, and through its traceback every frame and tensor of the failed
attempt, is still alive there. Memory is released in :meth:`Attempt.retry`,
after the handler has dropped the exception. When ranks agree, they exchange
the outcome of every attempt in :meth:`Attempt.succeeded`.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Hashable, Iterator
from dataclasses import replace
from types import TracebackType
from typing import Protocol, cast

from koila_retry._common.places import where
from koila_retry._common.units import format_bytes
from koila_retry._core import decision, diagnosis, distributed, memory
from koila_retry._core.cache import SizeCache
from koila_retry._core.call import Call, FirstSize
from koila_retry._core.decision import Done, Outcome, Rules, State, Try
from koila_retry._core.detect import is_oom
from koila_retry._core.outcomes import Explain, Failure, detached, iterator_among, store
from koila_retry._core.policy import Policy
from koila_retry._core.sharded import RanksFailed, Shards
from koila_retry._core.snapshot import Snapshots
from koila_retry._core.stats import Stats
from koila_retry.exceptions import BatchSizeExhausted

__all__ = ["Attempt", "Course", "Owner"]

logger = logging.getLogger("koila_retry")

# PENDING: the body succeeded here, and the ranks have yet to agree that it did everywhere.
READY, RUNNING, SUCCEEDED, FAILED, PENDING = range(5)
_DONE = {
    RUNNING: "is already inside `with attempt:`",
    FAILED: "already ran its block, which ran out of memory",
    SUCCEEDED: "already ran its block, which succeeded",
    PENDING: "already ran its block, whose outcome the ranks have yet to agree on",
}


class Owner(Protocol):
    """What an attempt needs of the wrapper it belongs to (a :class:`~koila_retry._core.engine.Controller`)."""

    name: str
    rules: Rules
    policy: Policy
    cache: SizeCache
    stats: Stats
    explain: Explain


class Course:
    """The mechanics of one call's attempts, behind :class:`Attempt`: the facts the decision is asked on, and its steps.

    Attributes:
        state (State): where the call stands.
        phase (int): where the current attempt is: ready, running, succeeded,
            failed, or pending the ranks' agreement.
        unanimous (bool): after an agreement, whether every rank's vote was yes.
    """

    __slots__ = (
        "agreement",
        "arguments",
        "call",
        "clocked",
        "failure",
        "key",
        "owner",
        "phase",
        "shards",
        "started",
        "state",
        "unanimous",
    )

    def __init__(
        self,
        owner: Owner,
        call: Call,
        state: State,
        key: Hashable | None,
        agreement: distributed.Agreement | None = None,
        started: float | None = None,
    ) -> None:
        self.owner, self.call, self.state, self.key, self.agreement = owner, call, state, key, agreement
        # A front end's (function, args, kwargs): looked at only when an attempt fails.
        self.arguments = call.roots if isinstance(call.roots, tuple) else None
        self.failure: Failure | None = None  # made on the first failure: none on the happy path
        self.phase = READY if started is None else RUNNING  # a driver's first attempt may run before
        self.started = started or 0.0
        self.unanimous = True
        self.clocked = 0.0  # the policy's clock as the attempt began, when growing weighs throughput
        self.shards: Shards | None = None  # the FSDP2 modules of a call that agrees, if it reaches any
        if owner.policy.grow:
            self.grow()
        if owner.rules.refine:
            self.refine()
        if agreement is not None:
            self.agree_on_start(call.span)
        if owner.rules.refine and state.estimated and not state.measures:
            self.presume()  # after the ranks agreed: every rank presumes from the same size

    def begin(self) -> None:
        """Start the current attempt's block."""
        if self.phase != READY:
            # A second block would hide the outcome of the first: an OOM could count as a success.
            raise RuntimeError(
                f"{self.owner.name}: attempt {self.state.number} (batch size {self.state.size}) {_DONE[self.phase]}; "
                "each attempt runs its body in one `with attempt:` block, entered once per turn of the loop"
            )
        self.phase = RUNNING
        if self.shards is not None:
            self.shards.arm()
        if self.owner.rules.grow_gain is not None:
            self.clocked = self.owner.policy.clock()
        self.started = time.perf_counter()

    def end(self, exc: BaseException | None) -> bool:
        """End the current attempt's block; return whether its error was out of memory (and is swallowed)."""
        if self.shards is not None:
            self.shards.disarm()
        if exc is None:
            if self.agreement is not None:
                self.phase = PENDING  # a success here is kept only if every rank had one
            else:
                self.succeed()
            return False
        if isinstance(exc, RanksFailed) and self.agreement is not None:
            # Another rank failed, as an exchange inside this attempt learned (FSDP2): the
            # exchange after it gives what that one said.
            self.phase = PENDING
            return True
        if not is_oom(exc):
            self.phase = READY  # the error propagates untouched and ends the run
            if self.failure is not None:
                self.failure.close()
            return False
        # Plain values only, and nothing released: the traceback still pins the failed attempt.
        failure = self.fail(where(exc.__traceback__))
        # Where the call may give up (the ranks decide that after the attempt), read what the
        # allocator holds while the attempt's memory is still held: after the release it is gone.
        final = not isinstance(failure.step, Try) or self.agreement is not None
        if final:
            failure.diagnosis = diagnosis.capture(exc, self.call.device)
        policy = self.owner.policy
        if policy.snapshot is not None:
            if failure.snapshots is None:
                failure.snapshots = Snapshots(
                    policy.snapshot, policy.snapshot_each_oom, self.call.device, self.owner.name
                )
            failure.snapshots.failed(self.state.number, final)
        if not isinstance(failure.step, Try):
            failure.final_oom = detached(exc)
        return True

    def succeed(self) -> None:
        """Carry out a success: what the decision says it stores."""
        self.phase = SUCCEEDED
        if self.failure is not None:
            self.failure.close()
        owner, state = self.owner, self.state
        gain = self.timed() if owner.rules.grow_gain is not None else None
        done = cast(Done, decision.decide(owner.rules, state, Outcome.SUCCEEDED, gain=gain))
        grow = owner.policy.grow_after if owner.policy.grow else None
        store(owner.cache, self.key, done, state, self.call.per_sample, grow)
        if owner.rules.refine and self.key is not None and done.conclusive:
            per_sample = self.call.per_sample
            owner.cache.bounds.update(self.key, lambda bound: decision.still_failed(bound, state.size, per_sample))
        if done.enough:  # the probe hardly ran faster: back to the size below, for the rest of the call
            below = cast(int, state.probe_from)
            logger.info(
                "%s: batch size %d ran less than %g%% more rows per second than %d; staying at %d",
                *(owner.name, state.size, 100 * cast(float, owner.rules.grow_gain), below, below),
            )
            state.size = state.cached = owner.stats.batch_size = below
            state.probe_from = None

    def timed(self) -> float | None:
        """Time the attempt that succeeded; at a growth probe, return its gain in rows/s over the size below."""
        owner, state = self.owner, self.state
        if state.rows is not None:
            return None  # a short step says nothing of its size's rate
        # What one attempt runs: all the call's rows where its size splits them (accumulate's
        # micro-batches), else its size (a call of batch, a chunk of chunked, whose span is set).
        call = self.call
        rows = call.rows if call.span is None and call.rows else state.size
        rate = owner.stats.record_time(state.size, owner.policy.clock() - self.clocked, rows)
        below = state.probe_from
        if rate is None or below is None or state.size <= below:
            return None
        base = owner.stats.rate(below)
        return None if not base else rate / base - 1

    def fail(self, place: str) -> Failure:
        """Record that the current attempt failed at ``place``, and what the decision says follows."""
        failure = self.failure
        if failure is None:
            failure = self.failure = Failure()
        failure.seconds += time.perf_counter() - self.started
        failure.where, failure.rank, failure.reused, failure.diagnosis = place, None, None, None
        state, first = self.state, self.call.first
        size = state.size if state.rows is None else min(state.size, state.rows)
        hint = first.after_oom(size) if state.measures and first is not None else None
        failure.step = decision.decide(self.owner.rules, state, Outcome.OUT_OF_MEMORY, hint=hint)
        if isinstance(failure.step, Try) and self.arguments is not None:
            failure.reused = iterator_among(self.arguments)
            if failure.reused is not None:  # a retry would see only what the failed attempt left of it
                failure.step = decision.GiveUp("iterator", failure.step.probe)
        state.size, state.rows = size, None  # a short last step failed: go on below what it tried
        self.phase = FAILED
        return failure

    def settle(self, vote: bool) -> bool:
        """Return whether the attempt succeeded, on every rank when ranks agree (see :meth:`Attempt.succeeded`)."""
        phase = self.phase
        if phase == SUCCEEDED:
            return True
        if phase != FAILED and phase != PENDING:
            raise RuntimeError("each attempt must run its body inside `with attempt:`")
        if self.agreement is None:
            return False
        failed = phase == FAILED
        proposal = self.failure.step if failed and self.failure is not None else None
        failing, agreed, self.unanimous = self.agreement.after(
            failed, proposal.size if isinstance(proposal, Try) else None, vote
        )
        if failing is None:
            self.succeed()
            return True
        failure = self.fail(f"rank {failing}") if not failed else cast(Failure, self.failure)
        failure.rank = failing
        failure.step = decision.decide(self.owner.rules, self.state, Outcome.AGREED, agreed=agreed)
        return False

    def retry(self) -> None:
        """Release the failed attempt's memory, report it, and move on to the next size or give up."""
        owner, state, failure, device = self.owner, self.state, self.failure, self.call.device
        if self.phase != FAILED or failure is None:
            raise RuntimeError("retry() follows an attempt that ran out of memory inside `with attempt:`")
        step, failed = failure.step, state.size
        next_size = step.size if isinstance(step, Try) and failure.reused is None else None
        started = time.perf_counter()
        if self.shards is not None:  # before the release: FSDP2's state holds the attempt's buffers
            self.shards.reset()
        # After giving up nothing runs, and what the attempt left in cycles is young: a full
        # collection would cost what the whole process holds.
        if next_size is None:
            memory.release_young(device)
        else:
            memory.release(device)
        failure.seconds += time.perf_counter() - started
        free = memory.recent_free_memory(device)  # fresh: the release forgot the old reading
        event = failure.report(owner.name, failed, next_size, state.number, device, free, owner.stats)
        if owner.policy.grow:
            owner.cache.growth.update(self.key, lambda streak: decision.failed_growing(streak, step.probe))
        if owner.rules.refine and self.key is not None:
            # On every rank (the size failed in the job), and outside the handler: a DiskCache writes it.
            per_sample = self.call.per_sample
            owner.cache.bounds.update(self.key, lambda bound: decision.failed_at(bound, failed, per_sample))
        if owner.policy.on_oom is not None:
            owner.policy.on_oom(event)
        if next_size is None:
            failure.close()
            cause, failure.final_oom = failure.final_oom, None
            if failure.reused is not None:
                raise failure.reuse_error(owner.name, failed) from cause
            message = self.exhausted(failure, free)
            raise BatchSizeExhausted(
                message, batch_size=failed, attempts=state.number, diagnosis=failure.diagnosis
            ) from cause
        state.size, state.number, state.probe_from, self.phase = next_size, state.number + 1, None, READY

    def calibrate(self, rows: int, rise: int) -> int:
        """Move on to the size the estimate corrected by a measured run chooses (see :meth:`Attempt.calibrate`)."""
        state, first = self.state, self.call.first
        if not state.measures or first is None:
            raise RuntimeError("calibrate() follows a run measured with attempt.meter, of a call that measures")
        state.measures -= 1
        size = decision.calibrated(state, first.corrected(rows, rise), rows)
        message = "%s: %d rows rose by %s on %s; the corrected estimate chooses batch size %d"
        logger.info(message, self.owner.name, rows, format_bytes(rise), self.call.device, size)
        state.size = self.owner.stats.batch_size = size
        if self.owner.rules.refine:
            self.presume()
        return size

    def next_step(self) -> None:
        """Make the call ready for its next step, after this one succeeded."""
        if self.phase != SUCCEEDED:
            raise RuntimeError("next_step() follows a step that succeeded inside `with attempt:`")
        state = self.state
        # A probe that succeeded is the size that fits now: the next step may probe above it.
        state.rows, state.number, state.probe_from, self.phase = None, 1, None, READY
        if self.failure is not None:
            self.failure.tried.clear()
        policy = self.owner.policy
        if policy.grow or policy.refine:  # else the ranks agreed on the size that succeeded: the same everywhere
            if policy.grow:
                self.grow()
            if policy.refine:
                self.refine()
            if self.agreement is not None:
                self.agree_on_start()

    def refine(self) -> None:
        """Move to a probe between the size that fits and the smallest that failed, with ``refine=True``."""
        owner, state = self.owner, self.state
        if self.key is None or state.probe_from is not None:
            return  # nothing remembered; or a growth probe runs first
        failed = decision.bound_rows(owner.cache.bounds.get(self.key), self.call.per_sample)
        size = decision.refined(owner.rules, state, failed)
        if size != state.size:
            logger.info("%s: batch size %d fits and %s did not; trying %d", owner.name, state.size, failed, size)
            state.probe_from = state.size
            state.size = owner.stats.batch_size = size

    def presume(self) -> None:
        """Record twice an estimate's size as failed, with ``refine=True``: the search stays below it."""
        size = decision.presumed(self.owner.rules, self.state)
        if size is not None and self.key is not None:
            per_sample = self.call.per_sample
            self.owner.cache.bounds.update(self.key, lambda bound: decision.failed_at(bound, size, per_sample))

    def agree_on_start(self, span: int | None = None) -> None:
        """Start at the ranks' agreed size, never below their floor."""
        owner, state = self.owner, self.state
        agreed, floor = cast(distributed.Agreement, self.agreement).start(
            state.size, span, owner.rules.minimum, owner.rules.initial
        )
        decision.agreed_start(state, agreed, floor)
        owner.stats.batch_size = state.size

    def grow(self) -> None:
        """Move to the probe above the current size, when growing back is due."""
        owner, state = self.owner, self.state
        streak = owner.cache.growth.update(self.key, decision.started_growing) if state.size < state.ceiling else None
        size = decision.grown(owner.rules, state, decision.due(streak))
        wait = None if streak is None else streak[1]
        state.probe_from = state.size if size != state.size else None
        if size != state.size:
            logger.info(
                "%s: succeeded %s times in a row at batch size %d; trying %d", owner.name, wait, *(state.size, size)
            )
        state.size = owner.stats.batch_size = size

    def exhausted(self, failure: Failure, free: int) -> str:
        """Return the message of the call that gives up."""
        owner, agreement, first = self.owner, self.agreement, self.call.first
        facts = failure.exhaustion(owner.name, self.state.floor, owner.rules.max_attempts, self.call.device, free)
        return owner.explain(
            replace(
                facts,
                rank=None if agreement is None else agreement.rank,
                world_size=None if agreement is None else agreement.world_size,
                figures=None if first is None else first.figures(),
                frame=sys._getframe(3),  # Attempt.retry()'s caller: the frames above it hold the call's model
            )
        )


class Attempt:
    """The attempts of one call: iterate it, and run each attempt's body in ``with``.

    The iterable and the current attempt are one object, made once per call;
    nothing is made per attempt until one fails.

    .. versionadded:: 0.1.0
    """

    __slots__ = ("_course",)

    def __init__(self, course: Course) -> None:
        self._course = course

    @property
    def batch_size(self) -> int:
        """The size the current attempt must use."""
        return self._course.state.size

    @property
    def number(self) -> int:
        """The current attempt's number, from 1."""
        return self._course.state.number

    @property
    def stats(self) -> Stats:
        """The statistics of the wrapper this call belongs to."""
        return self._course.owner.stats

    @property
    def agrees(self) -> bool:
        """Whether the ranks of a distributed job agree on this call's sizes."""
        return self._course.agreement is not None

    @property
    def unanimous(self) -> bool:
        """After :meth:`succeeded` with agreement across ranks, whether every rank's ``vote`` was yes."""
        return self._course.unanimous

    def __iter__(self) -> Iterator[Attempt]:
        # A generator, so that ending the loop costs no StopIteration raised in Python.
        yield self
        while not self.succeeded():
            yield self.retry()

    def __enter__(self) -> Attempt:
        self._course.begin()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        return self._course.end(exc)

    def succeeded(self, vote: bool = True) -> bool:
        """Return whether the attempt that just ran succeeded (on every rank, when ranks agree).

        Call it after the ``with attempt:`` block. When ranks agree, it is the
        collective every rank makes after each attempt: if any rank ran out of
        memory, every rank's attempt failed, and :meth:`retry` moves all of them
        to the same size.

        Args:
            vote (bool): a yes or no the ranks exchange in the same collective;
                whether every rank said yes is then in ``unanimous``. Default: ``True``.

        Returns:
            bool: ``False`` if the attempt must be retried with :meth:`retry`.

        Raises:
            RuntimeError: if no attempt ran inside ``with attempt:``.

        .. versionadded:: 0.1.0
        """
        return self._course.settle(vote)

    def retry(self) -> Attempt:
        """Release the failed attempt's memory and move on to the next size.

        Call it when :meth:`succeeded` returned ``False``, outside any ``except`` block.

        Returns:
            Attempt: this object, with ``batch_size`` and ``number`` advanced.

        Raises:
            BatchSizeExhausted: if there is no size left to try, raised from the
                last out-of-memory error.
            RuntimeError: if the last attempt did not run out of memory.
            TypeError: if an argument of the call is an iterator, which the
                failed attempt may have consumed in part.
        """
        self._course.retry()
        return self

    @property
    def meter(self) -> memory.PeakMeter | None:
        """What measures the coming run (``with meter:``) for :meth:`calibrate`; ``None`` when nothing waits for one.

        .. versionadded:: 0.1.0
        """
        course = self._course
        return cast(FirstSize, course.call.first).meter if course.state.measures else None

    def calibrate(self, rows: int, rise: int) -> int:
        """Correct the call's estimate by a measured run, and move on to the size it then chooses.

        The size holds for the rest of the call, and is the one stored once it succeeds.

        Args:
            rows (int): the rows of the run measured.
            rise (int): its peak less what was allocated as it began, in bytes.

        Returns:
            int: the new ``batch_size``, within ``[minimum, initial]``; never below ``rows``.

        Raises:
            RuntimeError: if the call has nothing to measure.

        .. versionadded:: 0.1.0
        """
        return self._course.calibrate(rows, rise)

    def narrow(self, rows: int) -> None:
        """Use only ``rows`` (fewer than ``batch_size``) in the coming attempt: a short last step.

        If it runs out of memory, the next size is below ``rows``; if it
        succeeds, nothing is stored, because fewer rows prove nothing about ``batch_size``.

        .. versionadded:: 0.1.0
        """
        self._course.state.rows = rows

    def next_step(self) -> Attempt:
        """Move on to the next step of a run of steps (a chunk), at the size the last one succeeded at.

        Returns:
            Attempt: this object, ready for the next step's first attempt.

        Raises:
            RuntimeError: if the current step has not succeeded.

        .. versionadded:: 0.1.0
        """
        self._course.next_step()
        return self
