"""The attempts of one call: the engine's driver, which every front end's loop and ``with`` block runs.

Inside ``__exit__`` an attempt only classifies the error and asks the decision what
follows: the exception's traceback still pins the failed attempt's tensors there, so
memory is released in :meth:`Attempt.retry`. Features are strategies of the call's
plan (:mod:`koila_retry._core.strategy`); the driver holds no branch for any.
"""

from __future__ import annotations

import dataclasses
import sys
import time
import warnings
from collections.abc import Hashable, Iterator
from types import TracebackType
from typing import cast

from koila_retry._common.places import place_of
from koila_retry._common.units import as_int, type_name
from koila_retry._core import decision, diagnosis, memory
from koila_retry._core.calibrating import calibrate
from koila_retry._core.call import Call, FirstSize
from koila_retry._core.decision import Done, Outcome, State, Try
from koila_retry._core.detect import is_oom
from koila_retry._core.distributed import Agreement, RanksFailed
from koila_retry._core.outcomes import Failure, clear_frames, iterator_among, store, unpin
from koila_retry._core.stats import Stats
from koila_retry._core.strategy import FAILED, PENDING, READY, RUNNING, SUCCEEDED, Owner, Plan

__all__ = ["Attempt", "Block", "Mechanics", "Owner", "abandon", "agreement_of"]

_DONE = {
    RUNNING: "is already inside `with attempt:`",
    FAILED: "already ran its block, which ran out of memory",
    SUCCEEDED: "already ran its block, which succeeded",
    PENDING: "already ran its block, whose outcome the ranks have yet to agree on",
}
# What a loop left before it retried its attempt leaves undone.
_UNRETRIED = {
    FAILED: "ran out of memory",
    PENDING: "ran out of memory on another rank",
}


class Mechanics:
    """The mechanics of one call's attempts, behind :class:`Attempt`: asks the decision, runs the plan's strategies."""

    __slots__ = ("call", "clocked", "failure", "key", "owner", "phase", "plan", "started", "state")

    def __init__(
        self, owner: Owner, call: Call, state: State, key: Hashable | None, plan: Plan, started: float | None = None
    ) -> None:
        self.owner, self.call, self.state, self.key, self.plan = owner, call, state, key, plan
        self.failure: Failure | None = None  # made on the first failure: none on the happy path
        self.phase = READY if started is None else RUNNING  # a driver's first attempt may run before
        self.started = started or 0.0
        self.clocked = 0.0  # the policy's clock as the attempt began, when growing weighs throughput
        self.resize(state.size)
        for start in plan.start:
            start(self, True)

    def resize(self, size: int) -> None:
        """Move the call to ``size``: the one place the engine's statistics learn of a new size."""
        self.state.size = self.owner.stats.batch_size = size

    def begin(self) -> None:
        """Start the current attempt's block."""
        if self.phase != READY:
            # A second block would hide the outcome of the first: an OOM could count as a success.
            raise RuntimeError(
                f"{self.owner.name}: attempt {self.state.number} (batch size {self.state.size}) {_DONE[self.phase]}; "
                "each attempt runs its body in one `with attempt:` block, entered once per turn of the loop"
            )
        self.phase = RUNNING
        for begin in self.plan.begin:
            begin(self)
        self.started = time.perf_counter()

    def end(self, exc: BaseException | None) -> bool:
        """End the current attempt's block; return whether its error was out of memory (and is swallowed)."""
        plan = self.plan
        for end in plan.end:
            end(self)
        if exc is None:
            plan.settling.succeeded(self)
            return False
        if isinstance(exc, RanksFailed) and plan.settling.waits:
            # Another rank failed, as an exchange inside this attempt learned (FSDP2, or DDP's
            # reducer all-reducing early): the exchange after it gives what that one said.
            self.phase = PENDING
            clear_frames(exc)  # as for an out-of-memory error, below
            return True
        if not is_oom(exc):
            self.phase = READY  # the error propagates untouched and ends the run
            if self.failure is not None:
                self.failure.close()
            return False
        # Plain values only, and nothing released: the traceback still pins the failed attempt.
        failure = self.fail(place_of(exc))
        # Where the call may give up (the ranks decide that after the attempt), read what the
        # allocator holds while the attempt's memory is still held: after the release it is gone.
        final = not isinstance(failure.step, Try) or plan.settling.waits
        if final:
            failure.diagnosis = diagnosis.capture(exc, self.call.device)
        for out_of_memory in plan.out_of_memory:
            out_of_memory(self, failure, final)
        failure.swallowed(exc, retried=isinstance(failure.step, Try))  # after the reads above, which need it
        return True

    def succeed(self) -> None:
        """Carry out a success: what the decision, with its strategies' facts, says it stores."""
        self.phase = SUCCEEDED
        if self.failure is not None:
            self.failure.close()
        owner, state = self.owner, self.state
        done = cast(Done, decision.decide(owner.rules, state, Outcome.SUCCEEDED))
        for judge in self.plan.judge:
            done = judge(self, done)
        store(owner.cache, self.key, done, state, self.call.per_sample)
        for stored in self.plan.stored:
            stored(self, done)

    def fail(self, place: str) -> Failure:
        """Record that the current attempt failed at ``place``, and what the decision says follows."""
        failure = self.failure
        if failure is None:
            failure = self.failure = Failure()
        failure.seconds += time.perf_counter() - self.started
        failure.where, failure.rank, failure.diagnosis = place, None, None
        state, roots = self.state, self.call.roots
        size = state.size if state.rows is None else min(state.size, state.rows)
        # A front end's (function, args, kwargs): looked at only when an attempt fails.
        reused = iterator_among(roots) if isinstance(roots, tuple) else None
        failure.decided(self.owner.rules, state, reused)
        state.size, state.rows = size, None  # a short last step failed: go on below what it tried
        self.phase = FAILED
        return failure

    def settle(self, vote: bool) -> bool:
        """Return whether the attempt succeeded, on every rank when ranks agree (see :meth:`Attempt.succeeded`)."""
        if self.phase == SUCCEEDED:
            return True
        if self.phase not in (FAILED, PENDING):
            raise RuntimeError("each attempt must run its body inside `with attempt:`")
        for exchanging in self.plan.exchanging:
            exchanging(self)
        return self.plan.settling.settle(self, vote)

    def retry(self) -> None:
        """Release the failed attempt's memory, report it, and move on to the next size or give up."""
        owner, state, failure, device = self.owner, self.state, self.failure, self.call.device
        if self.phase != FAILED or failure is None:
            raise RuntimeError("retry() follows an attempt that ran out of memory inside `with attempt:`")
        step, failed, invalid = failure.step, state.size, failure.invalid
        next_size = step.size if isinstance(step, Try) else None
        started = time.perf_counter()
        for releasing in self.plan.releasing:
            releasing(self)
        unpin(invalid)  # what the schedule raised links to the engine's frames, which hold the attempt
        # After giving up nothing runs, and what the attempt left in cycles is young: a full
        # collection would cost what the whole process holds.
        (memory.release_young if next_size is None else memory.release)(device)
        failure.seconds += time.perf_counter() - started
        free = memory.recent_free_memory(device)  # fresh: the release forgot the old reading
        event = failure.report(owner.name, failed, next_size, state.number, device, free, owner.stats)
        for failed_hook in self.plan.failed:
            failed_hook(self, event, step)
        if invalid is not None:  # it ends the call, whose last failure was counted and reported as any other
            raise invalid
        if next_size is not None:
            # After the hooks: one that raises, or calls the wrapper again, leaves stats naming a size that ran.
            self.resize(next_size)
        else:
            first, settling = self.call.first, self.plan.settling
            facts = failure.exhaustion(
                *(owner.name, state.floor, owner.rules.max_attempts, device, free),
                ranks=(settling.rank, settling.world_size),
                figures=None if first is None else first.figures(),
                frame=sys._getframe(2),  # Attempt.retry()'s caller: the frames above it hold the call's model
            )
            failure.give_up(owner.explain, facts, state.number, owner.stats)
        state.number, state.probe_from, self.phase = state.number + 1, None, READY

    def next_step(self) -> None:
        """Make the call ready for its next step, after this one succeeded."""
        if self.phase != SUCCEEDED:
            raise RuntimeError("next_step() follows a step that succeeded inside `with attempt:`")
        state = self.state
        # A probe that succeeded is the size that fits now: the next step may probe above it.
        state.rows, state.number, state.probe_from, self.phase = None, 1, None, READY
        if self.failure is not None:
            self.failure.tried.clear()
        for start in self.plan.start:
            start(self, False)


class Attempt:
    """The attempts of one call: iterate it, and run each attempt's body in ``with``.

    The iterable and the current attempt are one object, made once per call;
    nothing is made per attempt until one fails.

    .. versionadded:: 0.1.0
    """

    __slots__ = ("_course",)

    def __init__(self, course: Mechanics) -> None:
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
        return self._course.plan.settling.waits

    @property
    def unanimous(self) -> bool:
        """After :meth:`succeeded` with agreement across ranks, whether every rank's ``vote`` was yes."""
        return self._course.plan.settling.unanimous

    def __repr__(self) -> str:
        return f"<koila_retry.Attempt of {self._course.owner.name}: batch_size={self.batch_size}, number={self.number}>"

    def __iter__(self) -> Iterator[Attempt]:
        # A generator, so that ending the loop costs no StopIteration raised in Python.
        try:
            yield self
            while not self.succeeded():
                yield self.retry()
        finally:
            abandon(self)  # a loop left after an out-of-memory error ends the call's recording

    def __enter__(self) -> Attempt:
        self._course.begin()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        try:
            return self._course.end(exc)
        except BaseException:  # a strategy's, or an interrupt, as the failure is taken in
            abandon(self)
            raise

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
        try:
            return self._course.settle(vote)
        except BaseException:  # the exchange between ranks failed: the call ends
            abandon(self)
            raise

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
        try:
            self._course.retry()
        except BaseException:
            # Giving up, the schedule's error, or a hook that raised (KeyboardInterrupt included): the call
            # ends, and so does what it records for its snapshots.
            abandon(self)
            raise
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
        return calibrate(self._course, rows, rise)

    def narrow(self, rows: int) -> None:
        """Use only ``rows`` (fewer than ``batch_size``) in the coming attempt: a short last step.

        If it runs out of memory, the next size is below ``rows``; if it
        succeeds, nothing is stored, because fewer rows prove nothing about ``batch_size``.

        Args:
            rows (int): the rows the coming attempt uses, at least 1.

        Raises:
            TypeError: if ``rows`` is not an int.
            ValueError: if ``rows`` is below 1.

        .. versionadded:: 0.1.0
        """
        number = as_int(rows)  # numpy's ints too
        if number is None:
            raise TypeError(f"narrow takes the rows the coming attempt uses, an int, got {type_name(rows)} {rows!r}")
        rows = number
        if rows < 1:
            raise ValueError(f"narrow takes the rows the coming attempt uses, at least 1, got {rows}")
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


class Block(Attempt):
    """The attempts of a block under :func:`~koila_retry.attempts`: entered only inside the loop that retries it."""

    # Nothing else calls retry() for the user: a `with attempt:` outside the loop would swallow an
    # out-of-memory error and let the code after it go on without the block's work.

    __slots__ = ("_loops",)

    def __init__(self, attempt: Attempt) -> None:
        course = attempt._course
        # The caller's frame and variables served the start only (the cache key, the modules
        # the ranks agree on): held by an attempt that the frame itself holds, they would keep
        # its variables alive in a cycle, after the frame returned, until a collection.
        course.call = dataclasses.replace(course.call, caller=None, roots=())
        super().__init__(course)
        self._loops = 0  # the loops iterating it now

    def __iter__(self) -> Iterator[Attempt]:
        self._loops += 1
        try:
            yield self
            while not self.succeeded():
                yield self.retry()
        except GeneratorExit:
            self._left()
            raise
        finally:
            self._loops -= 1
            abandon(self)  # however the loop ends, the call's recording ends with it

    def __enter__(self) -> Attempt:
        if not self._loops:
            state = self._course.state
            raise RuntimeError(
                f"{self._course.owner.name}: attempt {state.number} (batch size {state.size}) was entered outside "
                "the `for` loop that retries it, where an out-of-memory error would be swallowed with nothing to "
                "run the block again; write `for attempt in koila.attempts(...):` around `with attempt:`"
            )
        self._course.begin()
        return self

    def _left(self) -> None:
        """Warn that the loop was left with its last attempt neither retried nor given up."""
        course = self._course
        undone = _UNRETRIED.get(course.phase)
        if undone is not None:
            state = course.state
            warnings.warn(
                f"{course.owner.name}: attempt {state.number} (batch size {state.size}) {undone}, and the loop over "
                "koila.attempts() was left before it could retry it: the block's work was not done. Leave the "
                "loop only by its end, which comes once `with attempt:` succeeds",
                RuntimeWarning,
                stacklevel=3,
            )


def abandon(attempt: Attempt) -> None:
    """End what a call that ends here records for its failures: a snapshot's share of the allocator's history."""
    failure = attempt._course.failure
    if failure is not None:
        failure.close()


def agreement_of(attempt: Attempt) -> Agreement | None:
    """Return the exchanges of the ranks a call's attempts agree with, or None where it agrees with none."""
    return attempt._course.plan.settling.agreement
