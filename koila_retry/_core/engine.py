"""The retry engine: the one attempt loop that every front end hands its work to.

A :class:`Controller` holds one wrapper's policy, cache and statistics. A call
is described by a :class:`~koila_retry._core.call.Call`;
:meth:`Controller.start` looks up its starting size (and, when ranks agree,
agrees on it) and returns its :class:`~koila_retry.Attempt`. Then one of the
drivers runs it, each a thin loop around the attempt's own ``with`` protocol:

- :func:`run` runs ``work(size)`` until an attempt succeeds;
- :func:`run_async` is the same loop for coroutines;
- :func:`cover` covers ``[start, stop)`` in steps, each step run by
  :func:`run` and resumed where it failed;
- :meth:`Controller.call` is :meth:`~Controller.start` then :func:`run`, with
  the first attempt run before anything is made: the whole cost of a decorated
  call that does not fail.

What size comes next is never decided here: every size rule is in
:mod:`koila_retry._core.decision`, which the attempt asks.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Awaitable, Callable, Hashable, Iterable
from types import FrameType
from typing import Any, TypeVar, cast

import torch

from koila_retry._core import decision, distributed, sharded
from koila_retry._core.attempt import Attempt, Course
from koila_retry._core.cache import SizeCache, StackMemoryCache, checked_size
from koila_retry._core.call import Call, FirstSize
from koila_retry._core.decision import settled
from koila_retry._core.outcomes import Exhaustion, Explain, plain_message
from koila_retry._core.policy import Policy
from koila_retry._core.stats import Stats
from koila_retry.exceptions import BatchSizeExhausted

__all__ = ["ROWS", "Attempt", "Call", "Controller", "Exhaustion", "Explain", "FirstSize", "cover", "run", "run_async"]

R = TypeVar("R")

# torch.distributed's record of the default process group, when this torch has the layout
# that distributed reads: whether it is None decides, on every call, that nothing agrees.
_WORLD: Any = distributed.world if distributed.FAST else None
# How many runs of a call that measures are measured: a probe, then a run at the size it chose.
MEASURES = 2
_clock = time.perf_counter
_SHORT, _UNLESS_A_GROUP, _LONG = 0, 1, 2

#: What a run of steps covers, as its progress bar and notes name it: one, many, a step.
ROWS = ("row", "rows", "chunk")


class Controller:
    """The policy, cache and statistics of one decorated function or block.

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
        self.rules = decision.Rules.of(name, policy, keep_last=keep_last)
        self.sync = policy.sync
        if policy.cache is not None:
            default_cache = policy.cache
        self.cache: SizeCache = StackMemoryCache() if default_cache is None else default_cache
        self.explain = explain or plain_message
        self.stats = Stats(batch_size=0 if policy.initial is None else policy.initial)
        # Whether a call may take the short way (see call): always, when no process group runs
        # (the usual case, looked up on each call), or never.
        self._mode = (
            _LONG
            if policy.grow or policy.refine or policy.sync is True
            else _SHORT
            if policy.sync is False
            else _UNLESS_A_GROUP
        )
        # What the decision settles a call with nothing stored at, asked once (0: ask each call).
        self._unstored = 0 if policy.initial is None else decision.settled(self.rules, None, 0)
        self._count_call = self.stats.calls_counter.increment
        # The DDP and FSDP2 modules found at the first call that agrees.
        self._parallel: list[weakref.ref[Any]] | None = None

    @property
    def ddp_modules(self) -> list[Any]:
        """The ``DistributedDataParallel`` modules the first agreeing call reached, still alive."""
        return [module for module in self._alive() if not sharded.is_fsdp2(module)]

    @property
    def fsdp_modules(self) -> list[Any]:
        """The FSDP2 modules the first agreeing call reached, still alive."""
        return [module for module in self._alive() if sharded.is_fsdp2(module)]

    def _alive(self) -> list[Any]:
        return [module for module in (ref() for ref in self._parallel or ()) if module is not None]

    def start(self, call: Call) -> Attempt:
        """Begin one call: look up its starting size and return its attempts.

        When ranks agree, they agree here on the starting size, and the call's
        modules are looked at (see :meth:`reach`).

        Args:
            call (Call): the call.

        Returns:
            Attempt: the first attempt, which is also the iterable of all of them.

        Raises:
            ValueError: if ranks agree and their spans differ.
            NotImplementedError: if ranks agree and the call reaches an FSDP1,
                HSDP or tensor-parallel module.
        """
        sync = self.sync
        if sync is False or (sync is None and _WORLD is not None and _WORLD._default_pg is None):
            agreement = None  # the usual case, decided without a call: it costs every call
        else:
            agreement = distributed.agreement(sync, self.policy.group)
        key, cached = self._look_up(call.function, call.caller, call.device, call.sample)
        first = call.first
        measure = agreement is None
        state = decision.first(
            self.rules,
            cached,
            call.rows,
            estimate=None if first is None else lambda: first(measure),
            proven=self.cache.sample_bytes(key) if call.per_sample and cached is not None else None,
            per_sample=call.per_sample,
        )
        if first is not None and first.meter is not None:
            state.measures = MEASURES
        self.stats.batch_size = state.size
        if agreement is None:
            return Attempt(Course(self, call, state, key))
        self.reach(call.roots, agreement)
        course = Course(self, call, state, key, agreement)
        modules = self.fsdp_modules
        if modules:  # their collectives learn of another rank's failure (see sharded.py)
            course.shards = sharded.Shards(modules, agreement)
        return Attempt(course)

    def _look_up(
        self, function: object, caller: FrameType | None, device: torch.device, sample: Hashable
    ) -> tuple[Hashable | None, int | None]:
        """Count a call, and return its key and what the cache holds for it."""
        cache = self.cache
        # Without a sample, the three-argument call that caches written before ``sample`` expect.
        key = cache.key(function, caller, device) if sample is None else cache.key(function, caller, device, sample)
        cached = cache.lookup(key) if key is not None else None
        if cached is not None and (type(cached) is not int or cached < 1):  # a subclass's lookup: 2.5, True
            cached = checked_size(cache, key, cached)
        self._count_call()
        return key, cached

    def call(
        self,
        function: object,
        caller: FrameType | None,
        device: torch.device,
        work: Callable[[int], R],
        roots: Iterable[Any] = (),
        rows: int = 0,
    ) -> R:
        """Run one call of ``work(size)``: :meth:`start`, then :func:`run`.

        The common case, where no rank agrees, nothing grows and the decision
        settles the first size without a state (:func:`~koila_retry._core.decision.settled`),
        runs its first attempt before anything is made; its :class:`Attempt` is
        made only if that attempt fails.

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
        mode = self._mode
        if mode and (mode == _LONG or _WORLD is None or _WORLD._default_pg is not None):
            return run(self.start(Call(function, caller, device, rows=rows, roots=roots)), work)
        # _look_up, spelled out: a method call is a tenth of what a cached call costs.
        cache = self.cache
        key = cache.key(function, caller, device)
        cached = cache.lookup(key) if key is not None else None
        if cached is None:  # the usual case: a call that never ran out of memory stores nothing
            size = self._unstored or settled(self.rules, None, rows)
        else:
            if type(cached) is not int or cached < 1:
                cached = checked_size(cache, key, cached)
            size = settled(self.rules, cached, rows)
        self._count_call()
        if not size:
            state = decision.first(self.rules, cached, rows)
            self.stats.batch_size = state.size
            return run(Attempt(Course(self, Call(function, caller, device, rows=rows, roots=roots), state, key)), work)
        self.stats.batch_size = size
        started = _clock()
        try:
            return work(size)
        except BaseException as exc:
            call = Call(function, caller, device, rows=rows, roots=roots)
            attempt = Attempt(Course(self, call, decision.first(self.rules, cached, rows), key, started=started))
            if not attempt.__exit__(type(exc), exc, exc.__traceback__):
                raise
        attempt.retry()  # outside the handler: the failed frames are gone
        return run(attempt, work)

    def agree_on_nothing(self) -> None:
        """Take part, with nothing to cover, in the ranks' check that they cover as much."""
        if self.sync is not False:
            agreement = distributed.agreement(self.sync, self.policy.group)
            if agreement is not None:
                agreement.start(0, span=0)

    def reach(self, roots: Iterable[Any], agreement: distributed.Agreement) -> None:
        """Look, once, at the modules a call that agrees across ranks reaches from ``roots``.

        Every rank does, before the first attempt, so an error here is raised
        on every rank at once.

        Args:
            roots (iterable): the function, its arguments and what else the call reaches.
            agreement (Agreement): the call's agreement.

        Raises:
            NotImplementedError: if the call reaches an FSDP1, HSDP or tensor-parallel
                module, or an FSDP2 module sharded over other ranks than agree.
        """
        if self._parallel is None:
            found = distributed.supported_modules(roots, self.name)
            for module in sharded.fsdp_modules(found):
                sharded.check_mesh(module, agreement.world_size, self.name)
            self._parallel = [weakref.ref(module) for module in found]


def run(
    attempt: Attempt,
    work: Callable[[int], R],
    *,
    rows: int | None = None,
    vote: Callable[[], bool] | None = None,
    undo: Callable[[], None] | None = None,
) -> R:
    """Run ``work(size)`` at the attempt's size until it succeeds; return its result.

    Each attempt runs in the attempt's ``with`` protocol: an out-of-memory error
    is recorded inside it, and outside it the failed attempt's memory is
    released and the next size tried (:meth:`Attempt.retry`), or the call gives
    up. Any other error propagates untouched.

    Args:
        attempt (Attempt): from :meth:`Controller.start`.
        work (callable): runs one attempt at the size it is given.
        rows (int, optional): the most rows an attempt can use; a larger size
            runs them as a short step (see :meth:`Attempt.narrow`).
        vote (callable, optional): asked after each attempt, when ranks agree;
            whether every rank said yes is then in ``attempt.unanimous``.
        undo (callable, optional): called after an attempt that failed (on any
            rank), before its memory is released.

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
        with attempt:
            result = work(size)
        # Outside the block: the exception and the failed frames are gone.
        if attempt.succeeded(True if vote is None else vote()):
            return result
        result = cast(R, None)  # this rank's result of an attempt another rank failed
        if undo is not None:
            undo()
        attempt.retry()


async def run_async(attempt: Attempt, work: Callable[[int], Awaitable[R]]) -> R:
    """Await ``work(size)`` until an attempt succeeds: :func:`run` for coroutines.

    Args:
        attempt (Attempt): from :meth:`Controller.start`.
        work (callable): returns the awaitable of one attempt at the size it is given.

    Returns:
        What the attempt that succeeded returned.

    Raises:
        BatchSizeExhausted: if the smallest size runs out of memory too.
    """
    while True:
        with attempt:
            result = await work(attempt.batch_size)
        if attempt.succeeded():
            return result
        result = cast(R, None)
        attempt.retry()


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
    """Run ``work(begin, end)`` over ``[start, stop)`` in steps, each retried alone.

    A step that runs out of memory is run again from its own first row at the
    next size; finished steps are kept, never run again. Each step's result goes
    to ``keep(begin, end, result)`` once it succeeded (on every rank, when ranks agree).

    Args:
        controller (Controller): the wrapper.
        attempt (Attempt or None): from :meth:`Controller.start`; ``None`` when
            there is nothing to cover (``start == stop``): the call still takes
            part in the ranks' check that they cover as much.
        start (int): the first row or index.
        stop (int): one past the last.
        work (callable): runs one step over ``[begin, end)``.
        keep (callable): takes a finished step's result.
        progress (callable, optional): makes a tqdm progress bar.
        unit (tuple of str): what is covered, in the singular and plural, and
            what a step of it is called.

    Raises:
        BatchSizeExhausted: if a step runs out of memory at the smallest size;
            a note says how much was finished before it.
    """
    if attempt is None:
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
