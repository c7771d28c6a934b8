"""The retry engine: the one attempt loop that every front end hands its work to.

A :class:`Controller` holds one wrapper's policy, cache, statistics and plan;
:meth:`Controller.start` returns a call's :class:`~koila_retry.Attempt`, and :func:`run`,
:func:`run_async` or :func:`cover` drives it. No size is decided here: every size rule
is in :mod:`koila_retry._core.decision`.
"""

from __future__ import annotations

import enum
import functools
import time
from collections.abc import Awaitable, Callable, Hashable, Iterable
from types import FrameType
from typing import Any, NamedTuple, TypeVar, cast

import torch

from koila_retry._common.dynamo import not_traced
from koila_retry._core import decision, distributed, ranks, sharded
from koila_retry._core.attempt import Attempt, Mechanics, abandon
from koila_retry._core.cache import SizeCache, StackMemoryCache
from koila_retry._core.call import Call, FirstSize
from koila_retry._core.outcomes import Exhaustion, Explain, plain_message
from koila_retry._core.policy import Policy
from koila_retry._core.stats import Stats
from koila_retry._core.strategies import compose
from koila_retry.exceptions import BatchSizeExhausted

__all__ = [
    "ROWS",
    "Attempt",
    "Call",
    "Controller",
    "Exhaustion",
    "Explain",
    "FirstSize",
    "Sampled",
    "cover",
    "run",
    "run_async",
]

R = TypeVar("R")

_clock = time.perf_counter


#: What a run of steps covers, as its progress bar and notes name it: one, many, a step.
ROWS = ("row", "rows", "chunk")


class Route(enum.IntEnum):
    """Which way :meth:`Controller.call` goes: whether a call's first attempt may run before anything is made."""

    SHORT = 0  #: always: nothing agrees, and no strategy acts before a failure
    SHORT_UNLESS_A_GROUP = 1  #: unless a default process group runs, looked up on each call
    LONG = 2  #: never: a strategy acts on every call, or ranks always agree


_LONG = Route.LONG
_WORLD = ranks.WORLD  # read on every call of the short way, so a global of this module


class Controller:
    """The policy, cache, statistics and plan of one decorated function or block."""

    def __init__(
        self,
        name: str,
        policy: Policy,
        *,
        default_cache: SizeCache | None = None,
        explain: Explain | None = None,
        keep_last: bool = False,  # store every success's size, the initial one too (toma's caches do)
        stats: Stats | None = None,  # shared by the steps of one integration's wrapper, which shows one
        function: object = None,  # whose collectives FSDP2's records are: its name and code (see sharded.py)
    ) -> None:
        self.name = name
        self.policy = policy
        self.rules = decision.Rules.of(name, policy, keep_last=keep_last)
        if policy.cache is not None:
            default_cache = policy.cache
        self.cache: SizeCache = StackMemoryCache() if default_cache is None else default_cache
        self.explain = explain or plain_message
        self.stats = Stats(batch_size=0 if policy.initial is None else policy.initial) if stats is None else stats
        self.plan = compose(policy, self.rules, self.cache)  # a call's strategies, when it agrees with no rank
        self.ranks = ranks.Ranks(name, policy, self.rules, self.cache, getattr(function, "__code__", None))
        short = Route.SHORT if policy.sync is False else Route.SHORT_UNLESS_A_GROUP
        self._route = short if self.plan.short and policy.sync is not True else Route.LONG
        # What the decision settles a call at, by what the cache holds (and the call's rows,
        # without an initial): the fast path's first size, asked once per value.
        self._settled: dict[Hashable, int] = {}
        self._by_rows = policy.initial is None
        self._settled_get = self._settled.get
        self._unstored = 0 if self._by_rows else decision.settled(self.rules, None, 0)
        self._count_call = self.stats.calls_counter.increment

    @property
    def ddp_modules(self) -> list[Any]:
        """The ``DistributedDataParallel`` modules the first agreeing call reached, still alive."""
        return [module for module in self.ranks.alive() if not sharded.is_fsdp2(module)]

    @property
    def fsdp_modules(self) -> list[Any]:
        """The FSDP2 modules the first agreeing call reached, still alive."""
        return [module for module in self.ranks.alive() if sharded.is_fsdp2(module)]

    def start(self, call: Call) -> Attempt:
        """Begin one call: look up its starting size and return its attempts (the ranks agree on it here)."""
        agreement = self.ranks.agreement()
        key, cached = self._look_up(call.function, call.caller, call.device, call.sample)
        return self._attempts(call, key, cached, agreement)

    def _attempts(
        self,
        call: Call,
        key: Hashable | None,
        cached: int | None,
        agreement: distributed.Agreement | None = None,
        started: float | None = None,
    ) -> Attempt:
        """Return the attempts of a call looked up, its first one running since ``started`` if given."""
        first = call.first
        state = decision.first(
            self.rules,
            cached,
            call.rows,
            estimate=None if first is None else lambda: first(agreement is None),  # measured alone only
            proven=self.cache.sample_bytes(key) if call.per_sample and cached is not None else None,
            per_sample=call.per_sample,
        )
        return Attempt(Mechanics(self, call, state, key, self.ranks.plan(self.plan, agreement, call), started))

    def _look_up(
        self, function: object, caller: FrameType | None, device: torch.device, sample: Hashable
    ) -> tuple[Hashable | None, int | None]:
        """Count a call, and return its key and what the cache holds for it."""
        cache = self.cache
        # Without a sample, the three-argument call that caches written before ``sample`` expect.
        key = cache.key(function, caller, device) if sample is None else cache.key(function, caller, device, sample)
        cached = cache.lookup(key) if key is not None else None
        if cached is not None and (type(cached) is not int or cached < 1):  # a subclass's lookup: 2.5, True
            cached = cache.checked_size(key, cached)
        self._count_call()
        return key, cached

    @not_traced
    def call(
        self,
        function: object,
        caller: FrameType | None,
        device: torch.device,
        work: Callable[[int], R],
        roots: Iterable[Any] = (),
        rows: int = 0,
        sampled: Sampled | None = None,
    ) -> R:
        """Run one call of ``work(size)``: :meth:`start`, then :func:`run`; return what succeeded.

        ``sampled`` is what ``accumulate`` adds: its sample's size class for the key, the rows
        an attempt may use and what undoes a failed one (:class:`Sampled`).
        """
        # Where no rank agrees and no strategy acts before a failure (Plan.short), the first attempt
        # runs at decision.settled's size before anything is made; the attempts are made only if it fails.
        route = self._route
        if route and (route is _LONG or _WORLD is None or _WORLD._default_pg is not None):  # ranks.alone(), inline
            attempt = self.start(_call_of(function, caller, device, roots, rows, sampled))
        else:
            # _look_up, spelled out: a method call is a twentieth of what a cached call costs.
            cache = self.cache
            if sampled is None:
                key = cache.key(function, caller, device)
            else:
                key = cache.key(function, caller, device, sampled.sample)
            cached = cache.lookup(key) if key is not None else None
            if cached is not None and (type(cached) is not int or cached < 1):  # a subclass's lookup: 2.5, True
                cached = cache.checked_size(key, cached)
            self._count_call()
            size: int | None = self._unstored if cached is None else 0  # the usual case: a call that never failed
            # A size proven on samples of other bytes is scaled to these by decision.first: the long way.
            if not size and (cached is None or sampled is None or not sampled.per_sample):
                at = (cached, rows) if self._by_rows else cached
                size = self._settled_get(at)
                if size is None:
                    size = decision.settled(self.rules, cached, rows)
                    if len(self._settled) < 64:  # a few values of what the cache holds; rows may vary more
                        self._settled[at] = size
            if not size:
                attempt = self._attempts(_call_of(function, caller, device, roots, rows, sampled), key, cached)
            else:
                self.stats.batch_size = size
                started = _clock()
                try:
                    return work(size)
                except BaseException as exc:
                    call = _call_of(function, caller, device, roots, rows, sampled)
                    attempt = self._attempts(call, key, cached, started=started)
                    if sampled is not None and sampled.limit < size:
                        attempt.narrow(sampled.limit)  # as run() does: the next size is below the rows there were
                    if not attempt.__exit__(type(exc), exc, exc.__traceback__):
                        raise
                if sampled is not None:
                    sampled.undo()  # as run() undoes a failed attempt, before its memory is released
                attempt.retry()  # outside the handler: the failed frames are gone
        return run(attempt, work) if sampled is None else run(attempt, work, rows=sampled.limit, undo=sampled.undo)

    def agree_on_nothing(self) -> None:
        """Take part, with nothing to cover, in the ranks' check that they cover as much."""
        self.ranks.agree_on_nothing()


class Sampled(NamedTuple):
    """What a call of ``accumulate`` adds to :meth:`Controller.call`: :class:`Call`'s and :func:`run`'s."""

    sample: Hashable  # the shape class of one sample, for the key
    per_sample: int  # its bytes
    limit: int  # the rows an attempt can use: a larger size runs them, as a short step
    undo: Callable[[], None]  # after an attempt that failed, before its memory is released


def _call_of(
    function: object,
    caller: FrameType | None,
    device: torch.device,
    roots: Iterable[Any],
    rows: int,
    sampled: Sampled | None,
) -> Call:
    if sampled is None:
        return Call(function, caller, device, rows=rows, roots=roots)
    return Call(function, caller, device, sampled.sample, rows, roots=roots, per_sample=sampled.per_sample)


@not_traced
def run(
    attempt: Attempt,
    work: Callable[[int], R],
    *,
    rows: int | None = None,
    vote: Callable[[], bool] | None = None,
    undo: Callable[[], None] | None = None,
) -> R:
    """Run ``work(size)`` at the attempt's size until it succeeds; return its result.

    ``rows``: the most rows an attempt can use (a larger size runs them as a short
    step); ``vote``: asked after each attempt when ranks agree; ``undo``: called after
    an attempt that failed on any rank, before its memory is released.
    """
    try:
        while True:
            size = attempt.batch_size
            if rows is not None and rows < size:
                attempt.narrow(rows)
                size = rows
            with attempt:
                result = work(size)
            # Outside the block: the exception and the failed frames are gone.
            if attempt.succeeded(True if vote is None else vote()):
                return result
            result = cast(R, None)  # this rank's result of an attempt another rank failed
            if undo is not None:
                undo()
            attempt.retry()
    except BaseException:
        abandon(attempt)  # a vote or an undo that raised ends the call too
        raise


@not_traced
async def run_async(attempt: Attempt, work: Callable[[int], Awaitable[R]]) -> R:
    """Await ``work(size)`` until an attempt succeeds: :func:`run` for coroutines."""
    try:
        while True:
            with attempt:
                result = await work(attempt.batch_size)
            if attempt.succeeded():
                return result
            result = cast(R, None)
            attempt.retry()
    except BaseException:
        abandon(attempt)  # cancelled while it waited, say
        raise


def _step(work: Callable[[int, int], R], begin: int, ran: list[int], rows: int) -> R:
    ran[0] = rows  # the last attempt run is the one that succeeded
    return work(begin, begin + rows)


def cover(
    controller: Controller,
    attempt: Attempt | None,
    start: int,
    stop: int,
    work: Callable[[int, int], R],
    keep: Callable[[int, int, R], None],
    *,
    progress: Callable[..., Any] | None = None,
    unit: tuple[str, str, str] = ROWS,
) -> None:
    """Run ``work(begin, end)`` over ``[start, stop)`` in steps, each retried alone from its own first row.

    Each finished step goes to ``keep(begin, end, result)`` once it succeeded (on every
    rank), and is never run again.
    """
    if attempt is None:  # nothing to cover: the call still takes part in the ranks' check
        controller.agree_on_nothing()
        return
    bar = None if progress is None else progress(total=stop - start, unit=unit[0], desc=controller.name)
    begin, ran = start, [0]
    try:
        while begin < stop:
            result = run(attempt, functools.partial(_step, work, begin, ran), rows=stop - begin)
            rows = ran[0]  # not batch_size: a calibration may have moved it on for the next step
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
