"""The retry engine: the one attempt loop that every front end hands its work to.

A :class:`Controller` holds one wrapper's policy, cache and statistics. A call
begins with :meth:`Controller.start`, which looks up the starting size (and, when
ranks agree, agrees on it) and returns an :class:`Attempt`. Then one of three
drivers runs it:

- :meth:`Controller.run` runs ``work(size)`` until an attempt succeeds: the
  attempt loop, written once for plain calls;
- :meth:`Controller.run_async` is the same loop for coroutines;
- :meth:`Controller.cover` covers ``[start, stop)`` in steps, each step run
  by :meth:`Controller.run` and resumed where it failed.

:class:`Attempt` is also the engine's own public iterator, for blocks::

    for attempt in koila.attempts():
        with attempt:
            ...

Inside the ``except`` clause (or ``__exit__``) the engine only classifies the
error and records the failed size: the exception, and through its traceback
every frame and tensor of the failed attempt, is still alive there. Memory is
released in :meth:`Attempt.retry`, after the handler has dropped the exception.
When ranks agree (see :mod:`koila_retry._core.distributed`), they exchange the
outcome of every attempt in :meth:`Attempt.succeeded`: a rank whose attempt
worked still retries if another rank's did not, and drops its result first.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
import weakref
from collections.abc import Awaitable, Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any, Protocol, TypeVar, cast

import torch

from koila_retry._common.places import where
from koila_retry._common.units import format_bytes, format_free
from koila_retry._core import distributed, memory
from koila_retry._core.cache import SizeCache, StackMemoryCache, checked_size
from koila_retry._core.detect import is_oom
from koila_retry._core.policy import Policy
from koila_retry._core.stats import OOMEvent, Stats
from koila_retry.exceptions import BatchSizeExhausted

__all__ = ["ROWS", "Attempt", "Controller", "Exhaustion", "Explain", "FirstSize"]

R = TypeVar("R")

logger = logging.getLogger("koila_retry")
# torch.distributed's record of the default process group, when this torch has the layout
# that distributed reads: whether it is None decides, on every call, that nothing agrees.
_WORLD: Any = distributed.world if distributed.FAST else None
# How many runs of a call that measures are measured: a probe, then a run at the size it chose.
MEASURES = 2

#: What a run of steps covers, as its progress bar and notes name it: one, many, a step.
ROWS = ("row", "rows", "chunk")


@dataclass(frozen=True)
class Exhaustion:
    """What a call that gives up knows: the facts an :data:`Explain` turns into its message.

    Plain values only: no exception, no tensor.

    Attributes:
        name (str): the function or block.
        tried (tuple of int): the sizes tried, in order; the last failed last.
        minimum (int): the smallest size allowed: the policy's minimum or, when
            ranks agree, the largest of theirs.
        max_attempts (int or None): the policy's bound on attempts.
        where (str): where the last error was raised.
        failing_rank (int or None): when ranks agree, the rank that ran out of memory.
        rank (int or None): this process's rank, when ranks agree.
        world_size (int or None): how many ranks agree.
        device (torch.device): the device.
        free_bytes (int): its free memory after the release; -1 if unknown.
        figures (tuple or None): an ``initial="auto"`` estimate's per-sample and fixed bytes.
        frame (FrameType or None): the engine's frame; the ones above it hold the call's objects.
    """

    name: str
    tried: tuple[int, ...]
    minimum: int
    max_attempts: int | None
    where: str
    failing_rank: int | None
    rank: int | None
    world_size: int | None
    device: torch.device
    free_bytes: int
    figures: tuple[int, int] | None
    frame: FrameType | None


#: Builds the message of :class:`BatchSizeExhausted` from what a call that gives up knows.
Explain = Callable[[Exhaustion], str]


class FirstSize(Protocol):
    """The first size of a call the cache knows nothing of, from an estimate (``initial="auto"``).

    Attributes:
        meter (PeakMeter or None): after the call: what measures the first run, when
            the first size is a probe whose run corrects the estimate.
    """

    meter: memory.PeakMeter | None

    def __call__(self, measure: bool) -> int:
        """Return the first size; a probe to measure only if ``measure``."""

    def figures(self) -> tuple[int, int] | None:
        """Return the estimate's per-sample and fixed bytes, if one was made."""

    def corrected(self, rows: int, rise: int) -> int:
        """Correct the estimate by a run of ``rows`` that rose by ``rise`` bytes; return the size for what follows."""

    def after_oom(self, size: int) -> int:
        """Return the size to measure next, after the run to be measured ran out of memory at ``size``."""


def _plain_message(exhaustion: Exhaustion) -> str:
    tried = " -> ".join(str(size) for size in exhaustion.tried)
    return f"{exhaustion.name}: out of memory at every batch size tried ({tried}); last raised at {exhaustion.where}."


def _step(work: Callable[[int, int], R], begin: int, rows: int) -> R:
    return work(begin, begin + rows)


class Controller:
    """The policy, cache and statistics of one decorated function or block, and its attempt loop.

    Args:
        name (str): how logs, events and errors name the function.
        policy (Policy): the checked options.
        default_cache (SizeCache, optional): the cache when the policy names
            none. Default: a new :class:`StackMemoryCache`.
        explain (callable, optional): builds the message of a call that gives
            up. Default: one line with the sizes tried.
        keep_last (bool): store the size of every success, the initial size
            too (toma's caches do); by default only sizes below the initial
            one are stored, since only they say something about memory.
    """

    def __init__(
        self,
        name: str,
        policy: Policy,
        *,
        default_cache: SizeCache | None = None,
        explain: Explain | None = None,
        keep_last: bool = False,
    ) -> None:
        self.name = name
        self.policy = policy
        self.initial = policy.initial
        self.minimum = policy.minimum
        self.grow = policy.grow
        self.sync = policy.sync
        if policy.cache is not None:
            default_cache = policy.cache
        self.cache: SizeCache = StackMemoryCache() if default_cache is None else default_cache
        self.explain = explain or _plain_message
        self.keep_last = keep_last
        self.stats = Stats(batch_size=0 if policy.initial is None else policy.initial)
        self._count_call = self.stats.calls_counter.increment
        self._ddp: list[weakref.ref[Any]] | None = None  # found at the first call that agrees

    @property
    def ddp_modules(self) -> list[Any]:
        """The ``DistributedDataParallel`` modules the first agreeing call reached, still alive."""
        return [module for module in (ref() for ref in self._ddp or ()) if module is not None]

    def start(
        self,
        function: object,
        caller: FrameType | None,
        device: torch.device,
        sample: Hashable = None,
        rows: int = 0,
        first: FirstSize | None = None,
        span: int | None = None,
        roots: Iterable[Any] = (),
        per_sample: int = 0,
    ) -> Attempt:
        """Begin one call: look up the starting size and return its attempts.

        When ranks agree, they agree here on the starting size, and the call's
        modules are looked at (see :meth:`reach`).

        Args:
            function (object): what the cache key names (a function or a
                description of one).
            caller (FrameType or None): the frame that made the call.
            device (torch.device): the device the call runs on.
            sample (Hashable, optional): the shape of one input sample, for the key.
            rows (int): the rows the call was given; its first size when the
                policy has no ``initial``.
            first (FirstSize, optional): asked for the first size when the cache
                knows none (an estimate's suggestion); kept within
                ``[minimum, initial]``. When it gives a probe to measure, the
                front end measures the first run that succeeds
                (:attr:`Attempt.meter`) and hands the measurement back
                (:meth:`Attempt.calibrate`).
            span (int, optional): the rows or indices a run of steps covers;
                ranks that agree must have the same.
            roots (iterable): what the call reaches (the function, its
                arguments), looked at only when ranks agree.
            per_sample (int): the bytes of one sample, when ``sample`` names a
                class of sizes rather than one: a stored size proven on smaller
                samples of the class is scaled down to as many bytes of samples.

        Returns:
            Attempt: the first attempt, which is also the iterable of all of them.

        Raises:
            ValueError: if ranks agree and their spans differ.
            NotImplementedError: if ranks agree and the call reaches an FSDP
                or tensor-parallel module.
        """
        sync = self.sync
        if sync is False or (sync is None and _WORLD is not None and _WORLD._default_pg is None):
            agreement = None  # the usual case, decided without a call: it costs every call
        else:
            agreement = distributed.agreement(sync, self.policy.group)
        key, size, cached, initial = self._look_up(
            function, caller, device, sample, rows, first, per_sample, measure=agreement is None
        )
        attempt = Attempt(self, key, size, cached, device, initial, agreement, roots)
        attempt._per_sample = per_sample
        if first is not None:
            attempt._first = first
            attempt._measures = MEASURES if first.meter is not None else 0
        if agreement is not None:
            self.reach(roots)
            if self.grow:
                attempt._grow()
            return attempt._agree_on_start(span)
        if self.grow:
            return attempt._grow()
        return attempt

    def _look_up(
        self,
        function: object,
        caller: FrameType | None,
        device: torch.device,
        sample: Hashable,
        rows: int,
        first: FirstSize | None,
        per_sample: int = 0,
        *,
        measure: bool = False,
    ) -> tuple[Hashable | None, int, int, int]:
        """Count a call and find its key, its first size, what the cache holds for it, and its ceiling."""
        cache = self.cache
        # Without a sample, the three-argument call that caches written before ``sample`` expect.
        key = cache.key(function, caller, device) if sample is None else cache.key(function, caller, device, sample)
        cached = cache.lookup(key) if key is not None else None
        if cached is not None and (type(cached) is not int or cached < 1):  # a subclass's lookup: 2.5, True
            cached = checked_size(cache, key, cached)
        if cached is not None and per_sample:
            proven = cache.sample_bytes(key)
            if proven is not None and per_sample > proven:
                # Proven on smaller samples of the same class (a shorter padding, say): as
                # many bytes of samples, never as many rows of larger ones.
                cached = max(cached * proven // per_sample, 1)
        initial = self.initial
        if initial is None:
            # Above a stored size, the call's rows are its ceiling; a stored size above the
            # rows stays the ceiling, so that the front end runs the rows as a short step.
            initial = max(rows, self.minimum) if cached is None else max(rows, cached, self.minimum)
        if cached is None:
            # Nothing stored: a success at ``initial`` has nothing to store either (see
            # Attempt._succeed), so the attempt is told that it is already there.
            size = cached = initial
            if self.keep_last:
                cached = 0  # except for a cache that keeps every success: it stores this one
            if first is not None:
                size = min(max(first(measure), self.minimum), initial)
        else:  # another wrapper sharing the cache may have stored a size out of our range
            size = cached if self.minimum <= cached <= initial else min(max(cached, self.minimum), initial)
        self._count_call()
        self.stats.batch_size = size
        return key, size, cached, initial

    def call(
        self,
        function: object,
        caller: FrameType | None,
        device: torch.device,
        work: Callable[[int], R],
        roots: Iterable[Any] = (),
        rows: int = 0,
    ) -> R:
        """Run one call of ``work(size)``: :meth:`start`, then :meth:`run`.

        The common case, where no rank agrees, nothing grows and the first size
        is the one stored, runs its first attempt without making an
        :class:`Attempt`, which is made only if that attempt fails; the loop of
        :meth:`run` then takes over. This is the whole cost of a decorated
        function's call when nothing fails.

        Args:
            function (object): what the cache key names.
            caller (FrameType or None): the frame that made the call.
            device (torch.device): the device the call runs on.
            work (callable): runs one attempt at the size it is given.
            roots (iterable): what the call reaches, looked at when ranks agree.
            rows (int): the call's own first size, when the policy has no ``initial``.

        Returns:
            What the attempt that succeeded returned.

        Raises:
            BatchSizeExhausted: if the smallest size runs out of memory too.
        """
        sync = self.sync
        if self.grow or not (sync is False or (sync is None and _WORLD is not None and _WORLD._default_pg is None)):
            return self.run(self.start(function, caller, device, rows=rows, roots=roots), work)
        key, size, cached, initial = self._look_up(function, caller, device, None, rows, None, 0)
        if cached != size:  # a success would store its size: the attempt keeps track
            return self.run(Attempt(self, key, size, cached, device, initial, roots=roots), work)
        started = time.perf_counter()
        try:
            return work(size)
        except BaseException as exc:
            attempt = Attempt(self, key, size, cached, device, initial, roots=roots)
            attempt._started = started
            if not attempt._record(exc):
                raise
        attempt.retry()  # outside the handler: the failed frames are gone
        return self.run(attempt, work)

    def run(
        self,
        attempt: Attempt,
        work: Callable[[int], R],
        *,
        rows: int | None = None,
        vote: Callable[[], bool] | None = None,
        undo: Callable[[], None] | None = None,
    ) -> R:
        """Run ``work(size)`` at the attempt's size until it succeeds; return its result.

        The attempt loop: each out-of-memory error is recorded inside the
        handler, and outside it the failed attempt's memory is released and the
        next size tried (:meth:`Attempt.retry`), or the call gives up. Any other
        error propagates untouched.

        Args:
            attempt (Attempt): from :meth:`start`.
            work (callable): runs one attempt at the size it is given.
            rows (int, optional): the most rows an attempt can use; a larger
                size runs them as a short step (see :meth:`Attempt.narrow`).
            vote (callable, optional): asked after each attempt, when ranks
                agree; whether every rank said yes is then in
                ``attempt.unanimous``.
            undo (callable, optional): called after an attempt that failed (on
                any rank), before its memory is released.

        Returns:
            What the attempt that succeeded returned.

        Raises:
            BatchSizeExhausted: if the smallest size runs out of memory too.
        """
        while True:
            size = attempt.batch_size
            if rows is not None and rows < size:
                attempt.narrow(rows)
                size = rows
            attempt._started = time.perf_counter()
            try:
                result = work(size)
            except BaseException as exc:
                if not attempt._record(exc):
                    raise
            else:
                attempt._ran = size
                if attempt._agreement is None:
                    attempt._succeed()
                    return result
                attempt._state = _PENDING
            # Outside the handler: the exception and the failed frames are gone.
            if attempt.succeeded(True if vote is None else vote()):
                return result
            result = cast(R, None)  # this rank's result of an attempt another rank failed
            if undo is not None:
                undo()
            attempt.retry()

    async def run_async(self, attempt: Attempt, work: Callable[[int], Awaitable[R]]) -> R:
        """Await ``work(size)`` until an attempt succeeds: :meth:`run` for coroutines.

        Args:
            attempt (Attempt): from :meth:`start`.
            work (callable): returns the awaitable of one attempt at the size it is given.

        Returns:
            What the attempt that succeeded returned.

        Raises:
            BatchSizeExhausted: if the smallest size runs out of memory too.
        """
        while True:
            attempt._started = time.perf_counter()
            try:
                result = await work(attempt.batch_size)
            except BaseException as exc:
                if not attempt._record(exc):
                    raise
            else:
                if attempt._agreement is None:
                    attempt._succeed()
                    return result
                attempt._state = _PENDING
            if attempt.succeeded():
                return result
            result = cast(R, None)
            attempt.retry()

    def cover(
        self,
        attempt: Attempt | None,
        start: int,
        stop: int,
        work: Callable[[int, int], R],
        keep: Callable[[int, int, R], None],
        *,
        progress: Callable[..., Any] | None = None,
        unit: tuple[str, str, str] = ROWS,
    ) -> None:
        """Run ``work(begin, end)`` over ``[start, stop)`` in steps, each retried alone.

        A step that runs out of memory is run again from its own first row at
        the next size; finished steps are kept, never run again. Each step's
        result goes to ``keep(begin, end, result)`` once it succeeded (on every
        rank, when ranks agree).

        Args:
            attempt (Attempt or None): from :meth:`start`; ``None`` when there
                is nothing to cover (``start == stop``): the call still takes
                part in the ranks' check that they cover as much.
            start (int): the first row or index.
            stop (int): one past the last.
            work (callable): runs one step over ``[begin, end)``.
            keep (callable): takes a finished step's result.
            progress (callable, optional): makes a tqdm progress bar.
            unit (tuple of str): what is covered, in the singular and plural,
                and what a step of it is called.

        Raises:
            BatchSizeExhausted: if a step runs out of memory at the smallest
                size; a note says how much was finished before it.
        """
        if attempt is None:
            self.agree_on_nothing()
            return
        bar = None if progress is None else progress(total=stop - start, unit=unit[0], desc=self.name)
        begin = start
        try:
            while begin < stop:
                result = self.run(attempt, functools.partial(_step, work, begin), rows=stop - begin)
                rows = attempt._ran  # a calibration may have moved batch_size on for the next step
                keep(begin, begin + rows, result)
                del result
                begin += rows
                if bar is not None:
                    bar.set_postfix({unit[2]: attempt.batch_size}, refresh=False)
                    bar.update(rows)
                if begin < stop:
                    attempt.next_step()
        except BatchSizeExhausted as exc:
            if hasattr(exc, "add_note"):  # Python 3.11+
                exc.add_note(f"{begin - start} of {stop - start} {unit[1]} were finished before it gave up.")
            raise
        finally:
            if bar is not None:
                bar.close()

    def agree_on_nothing(self) -> None:
        """Take part, with nothing to cover, in the ranks' check that they cover as much."""
        if self.sync is not False:
            agreement = distributed.agreement(self.sync, self.policy.group)
            if agreement is not None:
                agreement.start(0, span=0)

    def reach(self, roots: Iterable[Any]) -> None:
        """Look, once, at the modules a call that agrees across ranks reaches from ``roots``.

        Every rank does, before the first attempt, so an error here is raised
        on every rank at once.

        Args:
            roots (iterable): the function, its arguments and what else the call reaches.

        Raises:
            NotImplementedError: if the call reaches an FSDP or tensor-parallel module.
        """
        if self._ddp is None:
            self._ddp = [weakref.ref(module) for module in distributed.supported_modules(roots, self.name)]

    def next_size(self, failed: int, attempt: int, minimum: int | None = None) -> int | None:
        """Return the size after ``failed`` failed on attempt ``attempt``, or ``None``.

        ``minimum``, when given, replaces the policy's (the ranks' agreed floor).
        """
        return self.policy.next_size(failed, attempt, self.name, minimum)

    def grown(self, key: Hashable, size: int, initial: int) -> int:
        """Return the size to start a call or step at: ``size``, or the probe above it when due."""
        if size >= initial:
            return size
        wait = self.cache.growth.due(key)
        if wait is None:
            return size
        probe = 1 << size.bit_length()
        if self.initial is not None:
            probe = min(probe, initial)
        # Without an initial of its own, the call's rows are no cap: a probe above them runs
        # them as a short step, which proves nothing about the probe (and lifts nothing).
        logger.info("%s: succeeded %d times in a row at batch size %d; trying %d", self.name, wait, size, probe)
        return probe


# _PENDING: the body succeeded here, and the ranks have yet to agree that it did everywhere.
_READY, _RUNNING, _SUCCEEDED, _FAILED, _PENDING = range(5)


class Attempt:
    """The attempts of one call: iterate it, and run each attempt's body in ``with``.

    The iterable and the current attempt are one object, made once per call;
    nothing is made per attempt until one fails.

    .. versionadded:: 0.1.0

    Attributes:
        batch_size (int): the size the current attempt must use.
        number (int): the current attempt's number, from 1.
        unanimous (bool): after :meth:`succeeded` with agreement across ranks,
            whether every rank's ``vote`` was yes.
    """

    __slots__ = (
        "_agreement",
        "_arguments",
        "_cached",
        "_controller",
        "_device",
        "_failure",
        "_first",
        "_floor",
        "_initial",
        "_key",
        "_measures",
        "_per_sample",
        "_probe_from",
        "_ran",
        "_rows",
        "_started",
        "_state",
        "batch_size",
        "number",
        "unanimous",
    )

    def __init__(
        self,
        controller: Controller,
        key: Hashable | None,
        size: int,
        cached: int,
        device: torch.device,
        initial: int,
        agreement: distributed.Agreement | None = None,
        roots: Iterable[Any] = (),
    ) -> None:
        self._controller = controller
        self._agreement = agreement
        # A front end's (function, args, kwargs): looked at only when an attempt fails.
        self._arguments = roots if isinstance(roots, tuple) else None
        self._initial = initial
        self._key = key
        self._cached = cached
        self._device = device
        self._state = _READY
        self._failure: _Failure | None = None  # made on the first failure: none on the happy path
        self._first: FirstSize | None = None  # initial="auto": the estimate behind the first size
        self._measures = 0  # how many more runs that succeed are to be measured
        self._ran = size  # the size of the last attempt that succeeded
        self._rows: int | None = None
        self._probe_from: int | None = None  # the size a growth probe started from
        self._floor = controller.minimum  # when ranks agree: the largest of their minimums
        self._per_sample = 0  # the bytes of one sample, when the key names a class of sizes
        self.batch_size = size
        self.number = 1
        self.unanimous = True  # see succeeded(vote=)

    @property
    def stats(self) -> Stats:
        """The statistics of the controller this run belongs to."""
        return self._controller.stats

    def __iter__(self) -> Iterator[Attempt]:
        # A generator, so that ending the loop costs no StopIteration raised in Python.
        yield self
        while not self.succeeded():
            yield self.retry()

    @property
    def agrees(self) -> bool:
        """Whether the ranks of a distributed job agree on this call's sizes."""
        return self._agreement is not None

    def __enter__(self) -> Attempt:
        state = self._state
        if state != _READY:
            # A second block would hide the outcome of the first: an OOM could count as a success.
            done = {
                _RUNNING: "is already inside `with attempt:`",
                _FAILED: "already ran its block, which ran out of memory",
                _SUCCEEDED: "already ran its block, which succeeded",
                _PENDING: "already ran its block, whose outcome the ranks have yet to agree on",
            }[state]
            raise RuntimeError(
                f"{self._controller.name}: attempt {self.number} (batch size {self.batch_size}) {done}; each "
                "attempt runs its body in one `with attempt:` block, entered once per turn of the loop"
            )
        self._state = _RUNNING
        self._started = time.perf_counter()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if exc is None:
            if self._agreement is not None:
                self._state = _PENDING  # a success here is kept only if every rank had one
            else:
                self._succeed()
            return False
        return self._record(exc)

    def _record(self, exc: BaseException) -> bool:
        """Record a failed attempt's error; return whether it was out of memory (and is swallowed).

        Called while the exception is being handled: it records plain values
        only and releases nothing.
        """
        if not is_oom(exc):
            self._state = _READY  # the error propagates untouched and ends the run
            return False
        failure = self._fail(where(exc.__traceback__))
        if failure.next_size is None:
            failure.final_oom = _detached(exc)
        return True

    def _succeed(self) -> None:
        self._state = _SUCCEEDED
        controller = self._controller
        # A cache that keeps every success keeps the size of a short last step too, as toma's do.
        if self._rows is None or controller.keep_last:
            if self._key is not None and self._cached != self.batch_size:
                self._remember(controller)
            if controller.grow:
                controller.cache.growth.succeeded(
                    self._key,
                    reduced=self.batch_size < self._initial,
                    wait=controller.policy.grow_after,
                    probe=self._probe_from is not None,
                )
        elif self._probe_from is not None:
            # A short last step proves nothing about its full size: neither store it
            # nor take it as a probe that fitted.
            controller.cache.growth.inconclusive(self._key)

    def _fail(self, where: str) -> _Failure:
        """Record that the current attempt failed at ``where``, and the size to try next."""
        failure = self._failure
        if failure is None:
            failure = self._failure = _Failure()
        failure.seconds += time.perf_counter() - self._started
        failure.where = where
        failure.rank = None
        failure.next_size = self._next_after_failure()
        failure.reused = None
        if failure.next_size is not None and self._arguments is not None:
            failure.reused = _iterator_among(self._arguments)
            if failure.reused is not None:
                failure.next_size = None  # a retry would see only what the failed attempt left of it
        if self._rows is not None:  # a short last step failed: go on below what it tried
            self.batch_size, self._rows = min(self.batch_size, self._rows), None
        failure.probe = self._probe_from is not None and self.batch_size > self._probe_from
        self._probe_from = None
        self._state = _FAILED
        return failure

    def _next_after_failure(self) -> int | None:
        size = self.batch_size if self._rows is None else min(self.batch_size, self._rows)
        if self._probe_from is not None and size > self._probe_from:
            return self._probe_from  # back to the size that fitted, whatever max_attempts says
        next_size = self._controller.next_size(size, self.number, self._floor)
        first = self._first
        if next_size is not None and self._measures and first is not None:
            # The estimate is under the truth by more than its margin: the next run, still the
            # one to be measured, is a probe that fits if it were far more under.
            next_size = max(min(next_size, first.after_oom(size)), self._floor)
        return next_size

    def succeeded(self, vote: bool = True) -> bool:
        """Return whether the attempt that just ran succeeded (on every rank, when ranks agree).

        Call it after the ``with attempt:`` block. Without agreement across
        ranks it only reads the outcome. With it, it is the collective every
        rank makes after each attempt: if any rank ran out of memory, every
        rank's attempt counts as failed, and :meth:`retry` then moves all of
        them to the same size.

        Args:
            vote (bool): a yes or no of the front end's, which the ranks
                exchange in the same collective; whether every rank said yes
                is then in ``unanimous``. Default: ``True``.

        Returns:
            bool: ``True`` if the attempt succeeded; ``False`` if it must be
            retried with :meth:`retry`.

        Raises:
            RuntimeError: if no attempt ran inside ``with attempt:``.

        .. versionadded:: 0.1.0
        """
        state = self._state
        if state == _SUCCEEDED:
            return True
        if state != _FAILED and state != _PENDING:
            raise RuntimeError("each attempt must run its body inside `with attempt:`")
        agreement = self._agreement
        if agreement is None:
            return False
        failed = state == _FAILED
        failure = self._failure
        failing, next_size, self.unanimous = agreement.after(
            failed, failure.next_size if failed and failure is not None else None, vote
        )
        if failing is None:
            self._succeed()
            return True
        if not failed:
            failure = self._fail(f"rank {failing}")
        failure = cast(_Failure, failure)
        failure.rank = failing
        failure.next_size = next_size
        return False

    def retry(self) -> Attempt:
        """Release the failed attempt's memory and move on to the next size.

        Call it when :meth:`succeeded` returned ``False``, outside any ``except``
        block.

        Returns:
            Attempt: this object, with ``batch_size`` and ``number`` advanced.

        Raises:
            BatchSizeExhausted: if there is no smaller size, or ``max_attempts``
                attempts were made; raised from the last out-of-memory error.
            RuntimeError: if the last attempt did not fail with an out-of-memory error.
            TypeError: if an argument of the call is an iterator, which the
                failed attempt may have consumed in part.
        """
        controller, failed, failure = self._controller, self.batch_size, self._failure
        if self._state != _FAILED or failure is None:
            raise RuntimeError("retry() follows an attempt that ran out of memory inside `with attempt:`")
        next_size = None if failure.reused is not None else failure.next_size
        started = time.perf_counter()
        if next_size is None:
            # Nothing runs after giving up, and what the attempt left in cycles is young:
            # a full collection would cost what the whole process holds.
            memory.release_young(self._device)
        else:
            memory.release(self._device)
        failure.seconds += time.perf_counter() - started
        free = memory.recent_free_memory(self._device)  # fresh: release() forgot the old reading
        failure.tried.append(failed)
        controller.stats.record_oom(failure.seconds, next_size)
        if controller.grow:
            controller.cache.growth.failed(self._key, probe=failure.probe)
        event = OOMEvent(
            function=controller.name,
            batch_size=failed,
            next_batch_size=next_size,
            attempt=self.number,
            device=self._device,
            free_bytes=free,
            seconds=failure.seconds,
            where=failure.where,
            rank=failure.rank,
        )
        failure.seconds = 0.0
        if next_size is None:
            logger.info("%s: out of memory at batch size %d; giving up", controller.name, failed)
        else:
            logger.info(
                "%s: out of memory at batch size %d (%s), retrying at %d with %s free on %s",
                controller.name,
                failed,
                failure.where,
                next_size,
                format_free(free),
                self._device,
            )
        if controller.policy.on_oom is not None:
            controller.policy.on_oom(event)
        if next_size is None:
            cause, failure.final_oom = failure.final_oom, None
            if failure.reused is not None:
                raise TypeError(
                    f"{controller.name}: out of memory at batch size {failed}, and the call cannot be retried: "
                    f"{failure.reused} is an iterator, which the failed attempt may have consumed in part, so a "
                    "retry would see only the rest. Pass a list, a tuple or another collection that can be "
                    "iterated again (list(...) of the iterator), or make the iterator inside the function"
                ) from cause
            raise BatchSizeExhausted(
                self._exhausted_message(failure, free), batch_size=failed, attempts=self.number
            ) from cause
        self.batch_size = next_size
        self.number += 1
        self._state = _READY
        return self

    def _remember(self, controller: Controller) -> None:
        # Only a size below ``initial`` says something about memory: one equal to it says
        # only what was asked for, and stored, it would hold back a later call that asks
        # for more (a larger ``initial`` at the same call site, or in the next run with
        # a DiskCache). Reaching ``initial`` again lifts the limit that was stored.
        size = self.batch_size
        if size < self._initial or controller.keep_last:
            controller.cache[self._key] = size
            if self._per_sample:
                controller.cache.prove(self._key, self._per_sample)
        elif self._cached < size:  # not a larger size, stored by a wrapper with a larger initial
            controller.cache.pop(self._key, None)
        self._cached = size

    @property
    def meter(self) -> memory.PeakMeter | None:
        """What measures the coming run, while the call's estimate waits for a measurement; else ``None``.

        A front end of ``initial="auto"`` wraps the real work of one step or chunk
        in it (``with meter: ...``), and hands :meth:`calibrate` the rows that ran
        and ``meter.rise``.

        .. versionadded:: 0.1.0
        """
        return cast(FirstSize, self._first).meter if self._measures else None

    def calibrate(self, rows: int, rise: int) -> int:
        """Correct the call's estimate by a measured run, and move on to the size it then chooses.

        The size holds for the rest of the call (the steps, chunks or micro-batches
        still to run) and, once they succeed, is the one the cache remembers; if it
        runs out of memory, the schedule goes on below it. It is never below the rows
        measured, which ran.

        Args:
            rows (int): the rows of the run measured.
            rise (int): its peak less what was allocated as it began, in bytes.

        Returns:
            int: the new ``batch_size``, within ``[minimum, initial]``.

        Raises:
            RuntimeError: if the call has nothing to measure.

        .. versionadded:: 0.1.0
        """
        first = self._first
        if not self._measures or first is None:
            raise RuntimeError("calibrate() follows a run measured with attempt.meter, of a call that measures")
        self._measures -= 1
        controller = self._controller
        # The rows measured ran: never fewer, whatever the margin of the corrected estimate says.
        wanted = max(first.corrected(rows, rise), rows)
        size = min(max(wanted, self._floor), self._initial)
        logger.info(
            "%s: %d rows rose by %s on %s; the corrected estimate chooses batch size %d",
            controller.name,
            rows,
            format_bytes(rise),
            self._device,
            size,
        )
        self.batch_size = controller.stats.batch_size = size
        return size

    def narrow(self, rows: int) -> None:
        """Use only ``rows`` (fewer than ``batch_size``) in the coming attempt.

        For the last, shorter step of a run of steps, such as the remainder of
        a dataset: if it runs out of memory, the next size is below ``rows``
        (not below ``batch_size``); if it succeeds, nothing is stored in the
        cache, because fewer rows prove nothing about ``batch_size``.

        Args:
            rows (int): the rows the coming attempt uses.

        .. versionadded:: 0.1.0
        """
        self._rows = rows

    def next_step(self) -> Attempt:
        """Move on to the next step of a run of steps, after this step succeeded.

        A run of steps (the chunks of :func:`chunked`) is one call of the engine
        whose every step is retried on its own: the next step starts at the
        size the last one succeeded at, or, when growing back is due, the probe
        above it.

        Returns:
            Attempt: this object, ready for the next step's first attempt.

        Raises:
            RuntimeError: if the current step has not succeeded.

        .. versionadded:: 0.1.0
        """
        if self._state != _SUCCEEDED:
            raise RuntimeError("next_step() follows a step that succeeded inside `with attempt:`")
        controller = self._controller
        self._rows = None
        self._state = _READY
        self.number = 1
        if self._failure is not None:
            self._failure.tried.clear()
        if not controller.grow:
            return self  # the ranks agreed on the size that succeeded: it is the same everywhere
        self._grow()
        return self if self._agreement is None else self._agree_on_start()

    def _agree_on_start(self, span: int | None = None) -> Attempt:
        """Start at the smallest of the ranks' sizes; a probe only if every rank was due one.

        No rank goes below the largest of the ranks' minimums: it is the floor of every later size.
        """
        controller = self._controller
        agreed, self._floor = cast(distributed.Agreement, self._agreement).start(
            self.batch_size, span, controller.minimum, controller.initial
        )
        if self._probe_from is not None and agreed <= self._probe_from:
            self._probe_from = None
        self.batch_size = controller.stats.batch_size = agreed
        return self

    def _grow(self) -> Attempt:
        size = self._controller.grown(self._key, self.batch_size, self._initial)
        self._probe_from = self.batch_size if size != self.batch_size else None
        self.batch_size = self._controller.stats.batch_size = size
        return self

    def _exhausted_message(self, failure: _Failure, free: int) -> str:
        controller, agreement = self._controller, self._agreement
        figures = self._first.figures() if self._first is not None else None
        return controller.explain(
            Exhaustion(
                name=controller.name,
                tried=tuple(failure.tried),
                minimum=self._floor,
                max_attempts=controller.policy.max_attempts,
                where=failure.where,
                failing_rank=failure.rank,
                rank=None if agreement is None else agreement.rank,
                world_size=None if agreement is None else agreement.world_size,
                device=self._device,
                free_bytes=free,
                figures=figures,
                # retry()'s caller: the frames above it hold the call's model.
                frame=sys._getframe(2),
            )
        )


class _Failure:
    """What a call keeps of its failed attempts: plain values, never the exception.

    The one exception kept, ``final_oom``, is the cause of the coming
    :class:`BatchSizeExhausted`, stripped of its traceback first.
    """

    __slots__ = ("final_oom", "next_size", "probe", "rank", "reused", "seconds", "tried", "where")

    def __init__(self) -> None:
        self.rank: int | None = None  # when ranks agree: the lowest that failed
        self.probe = False
        self.seconds = 0.0
        self.where = ""
        self.next_size: int | None = None
        self.final_oom: BaseException | None = None
        self.tried: list[int] = []
        self.reused: str | None = None  # an iterator argument, which a retry would reuse


def _iterator_among(roots: tuple[Any, ...]) -> str | None:
    """Name the first iterator among a call's arguments (the tuples and dicts in its roots)."""
    # Tensors, lists and data loaders are iterated afresh by each attempt; an iterator
    # (a generator, iter(...), a file) goes on from where the failed attempt stopped.
    for root in roots:
        if isinstance(root, (tuple, list)):
            for index, value in enumerate(root):
                if isinstance(value, Iterator):
                    return f"argument {index} ({type(value).__name__})"
        elif isinstance(root, dict):
            for name, value in root.items():
                if isinstance(value, Iterator):
                    return f"keyword argument {name!r} ({type(value).__name__})"
    return None


def _detached(exc: BaseException) -> BaseException:
    # The cause of BatchSizeExhausted must not pin the failed attempt: drop the
    # traceback (frames, and through them tensors) of the error and of every error
    # it was raised from, and the errors they were raised while handling. The
    # explicit causes stay: they hold the out-of-memory error a wrapper was raised from.
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        link.__traceback__ = None
        link.__context__ = None
        link = link.__cause__
    return exc
