"""The retry engine that every front end drives.

A :class:`Controller` holds one wrapper's policy, cache and statistics; each call
gets an :class:`Attempt`, the context manager of the current attempt. Front ends
drive it in one of two equivalent ways::

    for attempt in controller.start(function, caller, device):   # blocks
        with attempt:
            result = work(attempt.batch_size)

    attempt = controller.start(function, caller, device)         # functions
    while True:
        with attempt:
            result = work(attempt.batch_size)
        if attempt.succeeded():
            return result
        result = None
        attempt.retry()

The second saves a generator on every call of a decorated function.
``succeeded()`` is where the ranks of a distributed job agree, after every
attempt (see :mod:`koila_retry._core.distributed`): a rank whose attempt worked
still retries if another rank's did not, so it drops its result first.

``__exit__`` only classifies the error and records the failed size: it runs while
the exception, and through its traceback every frame and tensor of the failed
attempt, is still alive. Memory is released in ``__next__``, after the ``with``
statement has dropped the exception.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any, cast

import torch

from koila_retry._common import tracking
from koila_retry._common.counter import Counter
from koila_retry._common.places import where
from koila_retry._common.units import format_bytes
from koila_retry._core import distributed, memory
from koila_retry._core.cache import Growth, SizeCache
from koila_retry._core.detect import is_oom
from koila_retry._diagnostics import report
from koila_retry.exceptions import BatchSizeExhausted

__all__ = ["DEFAULT_GROW_AFTER", "DEFAULT_INITIAL", "Attempt", "Controller", "OOMEvent", "Stats", "next_batch_size"]

DEFAULT_INITIAL = 512
DEFAULT_GROW_AFTER = 50

logger = logging.getLogger("koila_retry")
# torch.distributed's record of the default process group, when this torch has the layout
# that distributed reads: whether it is None decides, on every call, that nothing agrees.
_WORLD: Any = distributed._world if distributed._FAST else None


@dataclass(frozen=True)
class OOMEvent:
    """What an ``on_oom`` hook is told about one out-of-memory failure.

    It never holds the exception: an exception's traceback would keep the failed
    attempt's tensors alive.

    Attributes:
        function (str): the qualified name of the decorated function or block.
        batch_size (int): the size that ran out of memory.
        next_batch_size (int or None): the size tried next, ``None`` if the call
            gives up and raises :class:`BatchSizeExhausted`.
        attempt (int): the number of the failed attempt within the call, from 1.
        device (torch.device): the device the call runs on.
        free_bytes (int): free memory on the device after releasing the failed
            attempt's memory; ``-1`` if the device's memory cannot be read.
        seconds (float): time spent in the failed attempt and the release.
        where (str): the file, line and function where the error was raised:
            the deepest frame outside koila_retry and PyTorch; for a rank that
            retries because another rank ran out of memory, ``"rank 1"``.
        rank (int or None): when ranks agree (see :doc:`distributed`), the
            rank that ran out of memory, the lowest if several did; ``None``
            in a process that agrees with no other.

    .. versionadded:: 0.1.0
    """

    function: str
    batch_size: int
    next_batch_size: int | None
    attempt: int
    device: torch.device
    free_bytes: int
    seconds: float
    where: str
    rank: int | None = None


OnOOM = Callable[[OOMEvent], object]


class Stats:
    """Counters of one decorated function, updated as it is called.

    Attributes:
        calls (int): calls started.
        ooms (int): out-of-memory failures recovered from or given up on.
        exhausted (int): calls that raised :class:`BatchSizeExhausted`.
        batch_size (int): the size of the latest attempt.
        seconds_lost (float): time spent in failed attempts and in releasing
            their memory.

    .. versionadded:: 0.1.0
    """

    def __init__(self, batch_size: int) -> None:
        self._calls = Counter()
        self._lock = threading.Lock()
        self.batch_size = batch_size
        self.ooms = 0
        self.exhausted = 0
        self.seconds_lost = 0.0

    @property
    def calls(self) -> int:
        return self._calls.value

    def record_oom(self, seconds: float, next_size: int | None) -> None:
        """Count one out-of-memory failure and the time it cost."""
        with self._lock:
            self.ooms += 1
            self.seconds_lost += seconds
            if next_size is None:
                self.exhausted += 1
            else:
                self.batch_size = next_size

    def as_dict(self) -> dict[str, float]:
        """Return the counters as a dict, the failure counters read consistently."""
        with self._lock:
            return {
                "calls": self.calls,
                "ooms": self.ooms,
                "exhausted": self.exhausted,
                "batch_size": self.batch_size,
                "seconds_lost": self.seconds_lost,
            }

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={value!r}" for name, value in self.as_dict().items())
        return f"Stats({fields})"


def next_batch_size(failed: int, minimum: int) -> int | None:
    """Return the size to try after ``failed`` ran out of memory, or ``None``.

    The next size is the largest power of two strictly below ``failed`` (500 →
    256, 256 → 128), raised to ``minimum`` if it falls below it. ``None`` means
    ``failed`` was already the minimum: there is nothing smaller to try.

    Args:
        failed (int): the size that ran out of memory.
        minimum (int): the smallest size allowed.

    Returns:
        int or None: the next size, or ``None`` when the schedule is exhausted.
    """
    if failed <= minimum:
        return None
    return max(1 << ((failed - 1).bit_length() - 1), minimum)


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


class Controller:
    """The retry policy, cache and statistics of one decorated function or block.

    Args:
        name (str): how logs, events and errors name the function.
        initial (int or None): the first size to try when the cache knows none;
            ``None`` lets each call bring its own: the rows it was given.
        minimum (int): the smallest size to try.
        cache (SizeCache): where sizes that worked are remembered.
        max_attempts (int, optional): the most attempts one call (or one step
            of a run of steps, such as a chunk) may make.
        on_oom (callable, optional): called with an :class:`OOMEvent` after each
            out-of-memory failure, once its memory has been released.
        grow (bool): whether to try the next power of two up, never above
            ``initial``, once ``grow_after`` calls in a row succeeded at a
            reduced size. Default: ``False``.
        grow_after (int): successes in a row before growing; doubled each time
            a probe at the larger size runs out of memory. Default: 50.
        sync (bool or None): whether the ranks of a ``torch.distributed`` job
            agree on every size; ``None`` when a process group of more than
            one rank is initialized. Default: ``None``.
        group (ProcessGroup, optional): the ranks that agree. Default: all.
        schedule (callable, optional): called with the size that failed, returns
            the size to try next (at least ``minimum``, below the failed size),
            or ``None`` to give up. Default: the largest power of two below
            the failed size (:func:`next_batch_size`). The compatibility layers
            use it to keep the schedules of the libraries they stand in for.

    Raises:
        TypeError: if a size is not an int, ``cache`` is not a cache, ``grow``
            is not a bool, ``on_oom`` or ``schedule`` is not callable, ``sync``
            is not a bool or ``None``, or ``group`` is not a process group.
        ValueError: if a size or ``grow_after`` is below 1, or ``minimum``
            exceeds ``initial``.
    """

    def __init__(
        self,
        *,
        name: str,
        initial: int | None,
        minimum: int = 1,
        cache: SizeCache,
        max_attempts: int | None = None,
        on_oom: OnOOM | None = None,
        grow: bool = False,
        grow_after: int = DEFAULT_GROW_AFTER,
        sync: bool | None = None,
        group: Any = None,
        schedule: Callable[[int], int | None] | None = None,
    ) -> None:
        distributed.check_sync(sync)
        distributed.check_group(group)
        self.initial = None if initial is None else _positive_int("initial", initial)
        self.minimum = _positive_int("minimum", minimum)
        if initial is not None and minimum > initial:
            raise ValueError(f"minimum ({minimum}) must not exceed initial ({initial})")
        if max_attempts is not None:
            _positive_int("max_attempts", max_attempts)
        if not isinstance(cache, SizeCache):
            raise TypeError(
                "cache must be a koila_retry cache (StackMemoryCache, GlobalCache, NoCache or "
                f"another SizeCache), got {type(cache).__name__}"
            )
        if on_oom is not None and not callable(on_oom):
            raise TypeError(f"on_oom must be callable, got {type(on_oom).__name__} {on_oom!r}")
        if not isinstance(grow, bool):
            raise TypeError(f"grow must be a bool, got {type(grow).__name__} {grow!r}")
        if schedule is not None and not callable(schedule):
            raise TypeError(f"schedule must be callable, got {type(schedule).__name__} {schedule!r}")
        self.schedule = schedule
        self.grow_after = _positive_int("grow_after", grow_after)
        self.grow = grow
        self.name = name
        self.max_attempts = max_attempts
        self.cache = cache
        self.on_oom = on_oom
        self.stats = Stats(batch_size=0 if initial is None else initial)
        self._count_call = self.stats._calls.increment
        self.sync = sync
        self.group = group
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
        first: Callable[[], int] | None = None,
        span: int | None = None,
    ) -> Attempt:
        """Begin one call: look up the starting size and return its attempts.

        Args:
            function (object): what the cache key names (a function or a
                description of one).
            caller (FrameType or None): the frame that made the call.
            device (torch.device): the device the call runs on.
            sample (Hashable, optional): the shape of one input sample, for the key.
            rows (int): the rows the call was given; its first size when the
                controller has no ``initial``.
            first (callable, optional): asked for the first size when the cache
                knows none (an estimate's suggestion); kept within
                ``[minimum, initial]``.
            span (int, optional): the rows or indices a run of steps covers;
                ranks that agree must have the same.

        Returns:
            Attempt: the first attempt, which is also the iterable of all of them.

        Raises:
            ValueError: if ranks agree and their spans differ.
        """
        sync = self.sync
        if sync is False or (sync is None and _WORLD is not None and _WORLD._default_pg is None):
            agreement = None  # the usual case, decided without a call: it costs every call
        else:
            agreement = distributed.agreement(sync, self.group)
        cache = self.cache
        # Without a sample, the three-argument call that caches written before ``sample`` expect.
        key = cache.key(function, caller, device) if sample is None else cache.key(function, caller, device, sample)
        cached = cache.lookup(key) if key is not None else None
        initial = self.initial
        if initial is None:
            # Above a stored size, the call's rows are its ceiling; a stored size above the
            # rows stays the ceiling, so that the front end runs the rows as a short step.
            initial = max(rows, self.minimum) if cached is None else max(rows, cached, self.minimum)
        if cached is None:
            # Nothing stored: a success at ``initial`` has nothing to store either (see
            # Attempt._remember), so the attempt is told that it is already there.
            size = cached = initial
            if first is not None:
                size = min(max(first(), self.minimum), initial)
        else:  # another wrapper sharing the cache may have stored a size out of our range
            size = cached if self.minimum <= cached <= initial else min(max(cached, self.minimum), initial)
        self._count_call()
        attempt = Attempt(self, key, size, cached, device, initial, agreement)
        if first is not None:
            attempt._estimated = getattr(first, "figures", None)
        if agreement is not None:
            if self.grow:
                attempt._grow()
            return attempt._agree_on_start(span)
        if self.grow:
            return attempt._grow()
        self.stats.batch_size = size
        return attempt

    def reach(self, roots: Iterable[Any]) -> None:
        """Look, once, at the modules a call that agrees across ranks reaches from ``roots``.

        Front ends call it after :meth:`start` when the attempt agrees, before
        the first attempt: every rank does, so an error here is raised on every
        rank at once.

        Args:
            roots (iterable): the function, its arguments and what else the call reaches.

        Raises:
            NotImplementedError: if the call reaches an FSDP or tensor-parallel module.
        """
        if self._ddp is None:
            self._ddp = [weakref.ref(module) for module in distributed.supported_modules(roots, self.name)]

    def next_size(self, failed: int, attempt: int) -> int | None:
        """Return the size after ``failed`` failed on attempt ``attempt``, or ``None``."""
        if self.max_attempts is not None and attempt >= self.max_attempts:
            return None
        if self.schedule is None:
            return next_batch_size(failed, self.minimum)
        if failed <= self.minimum:
            return None
        size = self.schedule(failed)
        if size is None:
            return None
        if isinstance(size, bool) or not isinstance(size, int) or not self.minimum <= size < failed:
            # An endless loop (a size that does not shrink) or a size no call can use.
            raise ValueError(
                f"{self.name}: the schedule returned {size!r} after batch size {failed} ran out of memory; "
                f"it must return an int from {self.minimum} (the minimum) to {failed - 1}, or None to give up"
            )
        return size

    def grown(self, key: Hashable, size: int, initial: int) -> int:
        """Return the size to start a call or step at: ``size``, or the probe above it when due."""
        if size >= initial:
            return size
        with self.cache._lock:
            growth = self.cache._growth.get(key)
            if growth is None or growth.streak < growth.wait:
                return size
            growth.streak = 0
            wait = growth.wait
        probe = 1 << size.bit_length()
        if self.initial is not None:
            probe = min(probe, initial)
        # Without an initial of its own, the call's rows are no cap: a probe above them runs
        # them as a short step, which proves nothing about the probe (and lifts nothing).
        logger.info("%s: succeeded %d times in a row at batch size %d; trying %d", self.name, wait, size, probe)
        return probe

    def succeeded(self, key: Hashable, size: int, initial: int, *, probe: bool) -> None:
        """Count a success at ``size`` towards growing back; a probe that fits resets the wait."""
        with self.cache._lock:
            if size >= initial:
                self.cache._growth.pop(key, None)
                return
            growth = self.cache._growth.get(key)
            if growth is None:
                growth = self.cache._growth[key] = Growth(self.grow_after)
            elif probe:
                growth.wait, growth.streak = self.grow_after, 0
            growth.streak += 1

    def failed(self, key: Hashable, *, probe: bool) -> None:
        """Restart the count towards growing; after a failed probe, wait twice as long."""
        with self.cache._lock:
            growth = self.cache._growth.get(key)
            if growth is not None:
                if probe:
                    growth.wait *= 2
                growth.streak = 0

    def inconclusive(self, key: Hashable) -> None:
        """Undo a probe that ran on too few rows to prove the size: probe again next time."""
        with self.cache._lock:
            growth = self.cache._growth.get(key)
            if growth is not None:
                growth.streak = growth.wait


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
        "_cached",
        "_controller",
        "_device",
        "_estimated",
        "_failure",
        "_initial",
        "_key",
        "_probe_from",
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
    ) -> None:
        self._controller = controller
        self._agreement = agreement
        self._initial = initial
        self._key = key
        self._cached = cached
        self._device = device
        self._state = _READY
        self._failure: _Failure | None = None  # made on the first failure: none on the happy path
        self._estimated: Callable[[], tuple[int, int] | None] | None = None  # initial="auto": the estimate's figures
        self._rows: int | None = None
        self._probe_from: int | None = None  # the size a growth probe started from
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

    def __enter__(self) -> Attempt:
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
        if not is_oom(exc):
            self._state = _READY  # the error propagates untouched and ends the run
            return False
        # Still inside exception handling: record plain values only, release nothing.
        failure = self._fail(where(tb))
        if failure.next_size is None:
            failure.final_oom = _detached(exc)
        return True

    def _succeed(self) -> None:
        self._state = _SUCCEEDED
        controller = self._controller
        if self._rows is None:
            if self._key is not None and self._cached != self.batch_size:
                self._remember(controller)
            if controller.grow:
                controller.succeeded(self._key, self.batch_size, self._initial, probe=self._probe_from is not None)
        elif self._probe_from is not None:
            # A short last step proves nothing about its full size: neither store it
            # nor take it as a probe that fitted.
            controller.inconclusive(self._key)

    def _fail(self, where: str) -> _Failure:
        """Record that the current attempt failed at ``where``, and the size to try next."""
        failure = self._failure
        if failure is None:
            failure = self._failure = _Failure()
        failure.seconds += time.perf_counter() - self._started
        failure.where = where
        failure.rank = None
        failure.next_size = self._next_after_failure()
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
        return self._controller.next_size(size, self.number)

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
        """
        controller, failed, failure = self._controller, self.batch_size, self._failure
        if self._state != _FAILED or failure is None:
            raise RuntimeError("retry() follows an attempt that ran out of memory inside `with attempt:`")
        next_size = failure.next_size
        started = time.perf_counter()
        memory.release(self._device)
        failure.seconds += time.perf_counter() - started
        free = memory.recent_free_memory(self._device)  # fresh: release() forgot the old reading
        failure.tried.append(failed)
        controller.stats.record_oom(failure.seconds, next_size)
        if controller.grow:
            controller.failed(self._key, probe=failure.probe)
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
                _free_text(free),
                self._device,
            )
        if controller.on_oom is not None:
            controller.on_oom(event)
        if next_size is None:
            cause, failure.final_oom = failure.final_oom, None
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
        if size < self._initial:
            controller.cache[self._key] = size
        elif self._cached < size:  # not a larger size, stored by a wrapper with a larger initial
            controller.cache.pop(self._key, None)
        self._cached = size

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
        """Start at the smallest of the ranks' sizes; a probe only if every rank was due one."""
        agreed = cast(distributed.Agreement, self._agreement).start(self.batch_size, span)
        if self._probe_from is not None and agreed <= self._probe_from:
            self._probe_from = None
        self.batch_size = self._controller.stats.batch_size = agreed
        return self

    def _grow(self) -> Attempt:
        size = self._controller.grown(self._key, self.batch_size, self._initial)
        self._probe_from = self.batch_size if size != self.batch_size else None
        self.batch_size = self._controller.stats.batch_size = size
        return self

    def _exhausted_message(self, failure: _Failure, free: int) -> str:
        controller, failed = self._controller, self.batch_size
        tried = " -> ".join(str(size) for size in failure.tried)
        if failed > controller.minimum:
            reason = f"gave up after max_attempts={controller.max_attempts} attempts"
        elif failed == controller.minimum:
            reason = f"batch size {failed} is the minimum"
        else:  # a short last chunk, already below the minimum
            reason = f"nothing below batch size {failed} is allowed (minimum={controller.minimum})"
        agreement = self._agreement
        if agreement is not None and failure.rank is not None and failure.rank != agreement.rank:
            last = f"Rank {failure.rank} of {agreement.world_size} ran out of memory, and every rank gives up with it."
        else:
            last = f"The last error was raised at {failure.where}."
        return (
            f"{controller.name}: out of memory at every batch size tried ({tried}); {reason}. "
            f"{last} {_memory_summary(self._device, free)}{self._explanation()}"
        )

    def _explanation(self) -> str:
        """Say what holds the memory and what one sample needs; paid for only when a call gives up."""
        parts = []
        try:
            # Frames up from retry()'s caller (past this method and _exhausted_message) hold the call's model.
            held = report.explain(self._device, sys._getframe(3))
        except Exception:  # a diagnosis must never hide the error it explains
            held = ""
        if held:
            parts.append(held)
        figures = self._estimated() if self._estimated is not None else None
        if figures is not None:
            per_sample, fixed = figures
            parts.append(
                f"The estimate (initial='auto') puts one sample at {format_bytes(per_sample)} on top of "
                f"{format_bytes(fixed)} that do not depend on the batch size."
            )
        return "".join(f" {part}" for part in parts)


class _Failure:
    """What a call keeps of its failed attempts: plain values, never the exception.

    The one exception kept, ``final_oom``, is the cause of the coming
    :class:`BatchSizeExhausted`, stripped of its traceback first.
    """

    __slots__ = ("final_oom", "next_size", "probe", "rank", "seconds", "tried", "where")

    def __init__(self) -> None:
        self.rank: int | None = None  # when ranks agree: the lowest that failed
        self.probe = False
        self.seconds = 0.0
        self.where = ""
        self.next_size: int | None = None
        self.final_oom: BaseException | None = None
        self.tried: list[int] = []


def _free_text(free: int) -> str:
    return "unknown memory" if free < 0 else format_bytes(free)


def _memory_summary(device: torch.device, free: int) -> str:
    parts = [f"{_free_text(free)} free on {device}"]
    simulated = tracking.simulated.free()
    if simulated is not None:
        parts.append("(a simulated device)")
    elif memory.on_accelerator(device):
        allocated = torch.accelerator.memory_allocated(device)
        reserved = torch.accelerator.memory_reserved(device)
        parts.append(
            f"with {format_bytes(allocated)} allocated by tensors and {format_bytes(reserved)} "
            "reserved by PyTorch's caching allocator"
        )
    return " ".join(parts) + "."


def _detached(exc: BaseException) -> BaseException:
    # The cause of BatchSizeExhausted must not pin the failed attempt: drop the
    # traceback (frames, and through them tensors) and the chained exceptions,
    # whose tracebacks would do the same.
    exc.__traceback__ = None
    exc.__context__ = None
    exc.__cause__ = None
    return exc
