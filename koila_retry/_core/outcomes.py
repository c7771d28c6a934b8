"""What a call keeps of its attempts: what a success stores, and what failures leave and report.

Plain values only: an attempt's out-of-memory error is read inside its handler
and dropped with it, its finished frames cleared first (:func:`clear_frames`). The
one exception kept is the cause of a coming :class:`~koila_retry.BatchSizeExhausted`,
stripped of its traceback first.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import gc
import io
import itertools
import logging
import sys
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, fields, is_dataclass
from types import AsyncGeneratorType, CoroutineType, FrameType, FunctionType, GeneratorType, TracebackType
from typing import Any, NoReturn, cast

import torch

from koila_retry._common.places import SUSPENDABLE, levels_to_caller
from koila_retry._common.units import format_free
from koila_retry._common.walk import frame_locals
from koila_retry._common.warn import warn_or_log
from koila_retry._core import decision
from koila_retry._core.cache import SizeCache
from koila_retry._core.decision import Done, GiveUp, Outcome, Rules, State, Step
from koila_retry._core.snapshot import Snapshots
from koila_retry._core.stats import OOMEvent, Stats
from koila_retry.exceptions import BatchSizeExhausted, Diagnosis

__all__ = [
    "Exhaustion",
    "Explain",
    "Failure",
    "clear_frames",
    "detached",
    "iterator_among",
    "plain_message",
    "store",
    "unpin",
]

logger = logging.getLogger("koila_retry")


@dataclass(frozen=True)
class Exhaustion:
    """What a call that gives up knows, in plain values: the facts an :data:`Explain` turns into its message."""

    name: str
    tried: tuple[int, ...]  # in order; the last failed last
    minimum: int  # the policy's, or when ranks agree the largest of theirs
    max_attempts: int | None
    where: str
    failing_rank: int | None  # when ranks agree, the rank that ran out of memory
    rank: int | None
    world_size: int | None
    device: torch.device
    free_bytes: int  # after the release; -1 if unknown
    figures: tuple[int, int] | None  # an initial="auto" estimate's per-sample and fixed bytes
    frame: FrameType | None  # the engine's frame: the ones above it hold the call's objects
    diagnosis: Diagnosis | None = None
    reason: str = ""  # why the decision gave up: "max_attempts", "minimum", "schedule", "ranks", "iterator"


#: Builds the message of :class:`BatchSizeExhausted` from what a call that gives up knows.
Explain = Callable[[Exhaustion], str]


def plain_message(exhaustion: Exhaustion) -> str:
    """Return one line with the sizes tried: the message of a call that gives up, by default."""
    tried = " -> ".join(str(size) for size in exhaustion.tried)
    why = "" if exhaustion.diagnosis is None else f" Diagnosis: {exhaustion.diagnosis}"
    return (
        f"{exhaustion.name}: out of memory. Every batch size tried failed ({tried}); "
        f"last raised at {exhaustion.where}.{why}"
    )


class Failure:
    """What a call keeps of its failed attempts: plain values, never the exception."""

    __slots__ = (
        "diagnosis",
        "final_oom",
        "invalid",
        "rank",
        "reused",
        "seconds",
        "snapshots",
        "step",
        "tried",
        "where",
    )

    def __init__(self) -> None:
        self.step: Step = GiveUp("minimum")  # what the decision said follows the attempt that failed
        self.where = ""  # a place in the code, or "rank N"
        self.rank: int | None = None  # when ranks agree, the lowest that failed
        self.seconds = 0.0  # lost since the last report
        self.tried: list[int] = []
        self.reused: str | None = None  # an iterator argument, which a retry would reuse
        # What the schedule raised, or why its next size is none a call can use, without traceback or context:
        # raised by retry(), outside the handler, once the memory is released.
        self.invalid: BaseException | None = None
        self.final_oom: BaseException | None = None  # the coming BatchSizeExhausted's cause, without its traceback
        # Read before the memory was released; None when another rank's failure ended the call.
        self.diagnosis: Diagnosis | None = None
        self.snapshots: Snapshots | None = None

    def swallowed(self, error: BaseException, retried: bool) -> None:
        """Let go of an out-of-memory error an attempt's block swallows; keep it, detached, if the call gives up."""
        # The with statement drops it, but not what another holder keeps (an asyncio task, a TaskGroup's
        # CancelledError, a step that stored it): its finished frames are cleared, and with them the attempt's
        # tensors, whoever holds it. Giving up walks no object list (detached strips the tracebacks).
        clear_frames(error, scan=retried)
        if not retried:
            self.final_oom = detached(error)

    def decided(self, rules: Rules, state: State, reused: str | None) -> None:
        """Take the decision after an out-of-memory error; ``reused``: an iterator argument, if any."""
        self.invalid = None
        try:
            self.step = decision.decide(rules, state, Outcome.OUT_OF_MEMORY, reused=reused is not None)
        except Exception as error:  # a schedule's, or the check of what it returned
            # Raised here, in the handler, it would keep the out-of-memory error and the failed attempt's
            # frames as its context, and its traceback the engine's frames, which hold that error: retry()
            # raises it, outside, once the memory is released, with only the schedule's own frames, after
            # clearing the engine's frames those link back to (unpin).
            own = _schedules_frames(error.__traceback__)
            detached(error)
            note = None
            if own is not None:
                error.__traceback__ = own
                note = (
                    "raised by the schedule= function after an out-of-memory error, and raised again once the "
                    "failed attempt's memory was released, without that error as its context, which would have "
                    "kept the memory alive"
                )
            elif not isinstance(error, ValueError):  # the engine's own check of a size explains itself
                note = (
                    "raised while the next size was chosen after an out-of-memory error; its traceback was "
                    "dropped, since it would have kept the failed attempt's memory alive"
                )
            if note is not None and hasattr(error, "add_note"):  # Python 3.11+
                error.add_note(note)
            self.step, self.invalid = GiveUp("schedule"), error
        # Kept only where it ends the call: a retry would see only what the failed attempt left of it.
        self.reused = reused if isinstance(self.step, GiveUp) and self.step.reason == "iterator" else None

    def close(self) -> None:
        """End what the call records for its snapshots, if anything."""
        if self.snapshots is not None:
            self.snapshots.close()

    def report(
        self, name: str, failed: int, next_size: int | None, number: int, device: torch.device, free: int, stats: Stats
    ) -> OOMEvent:
        """Count the failure in ``stats``, log it, and return its event; ``next_size`` is ``None`` on giving up."""
        self.tried.append(failed)
        stats.record_oom(self.seconds)
        event = OOMEvent(
            function=name,
            batch_size=failed,
            next_batch_size=next_size,
            attempt=number,
            device=device,
            free_bytes=free,
            seconds=self.seconds,
            where=self.where,
            rank=self.rank,
        )
        self.seconds = 0.0
        if next_size is None:
            logger.info("%s: out of memory at batch size %d; giving up", name, failed)
        else:
            logger.info(
                "%s: out of memory at batch size %d (%s), retrying at %d with %s free on %s",
                name,
                failed,
                self.where,
                next_size,
                format_free(free),
                device,
            )
        return event

    def exhaustion(
        self,
        name: str,
        minimum: int,
        max_attempts: int | None,
        device: torch.device,
        free: int,
        ranks: tuple[int | None, int | None],
        figures: tuple[int, int] | None,
        frame: FrameType | None,
    ) -> Exhaustion:
        """Return what the call that gives up knows, for its message; ``ranks``: this rank and how many agree."""
        return Exhaustion(
            name=name,
            tried=tuple(self.tried),
            minimum=minimum,
            max_attempts=max_attempts,
            where=self.where,
            failing_rank=self.rank,
            rank=ranks[0],
            world_size=ranks[1],
            device=device,
            free_bytes=free,
            figures=figures,
            frame=frame,
            diagnosis=self.diagnosis,
            reason=self.step.reason if isinstance(self.step, GiveUp) else "",
        )

    def give_up(self, explain: Explain, facts: Exhaustion, number: int, stats: Stats) -> NoReturn:
        """Raise the error of a call that gives up after attempt ``number``, from its last out-of-memory error.

        ``stats`` counts it in ``exhausted``.
        """
        self.close()
        cause, self.final_oom = self.final_oom, None
        failed = facts.tried[-1]
        stats.record_exhausted()
        if self.reused is not None:
            raise self.reuse_error(facts.name, failed) from cause
        message = explain(facts)
        raise BatchSizeExhausted(message, batch_size=failed, attempts=number, diagnosis=self.diagnosis) from cause

    def reuse_error(self, name: str, failed: int) -> TypeError:
        """Return the error of a call that cannot be retried because an argument is an iterator."""
        reused = self.reused or ""
        if reused.endswith(_READABLE):
            advice = (
                "Open it for writing only ('w' or 'a') if the function only writes to it, or pass its path and "
                "open it inside the function"
            )
        elif reused.endswith(_BUFFER):
            advice = "Append what the function writes to a list instead, or make the buffer inside the function"
        else:
            advice = (
                "Pass a list, a tuple or another collection that can be iterated again (list(...) of the "
                "iterator), or make the iterator inside the function"
            )
        return TypeError(
            f"{name}: out of memory at batch size {failed}, and the call cannot be retried: "
            f"{self.reused} is an iterator, which the failed attempt may have consumed in part, so a "
            f"retry would see only the rest. {advice}"
        )


def store(cache: SizeCache, key: Hashable | None, done: Done, state: State, per_sample: int) -> None:
    """Carry out what the decision says a success stores; ``state.cached`` becomes what the cache holds."""
    if done.conclusive and key is not None and state.cached != state.size:
        try:
            if done.store is not None:
                cache[key] = done.store
                if per_sample:
                    cache.prove(key, per_sample)
            elif done.forget:
                cache.pop(key, None)
        except Exception as error:  # a cache of yours (a store elsewhere) that fails must not cost the result
            warn_or_log(
                f"koila: {type(cache).__name__} could not keep the batch size of a call that succeeded "
                f"({type(error).__name__}: {error!s:.200}); its result is returned, and the next call "
                "starts from what the cache holds",
                RuntimeWarning,
                stacklevel=levels_to_caller(),
            )
        state.cached = state.size  # stored or not, not tried again in this call (each chunk of chunked would)


def iterator_among(roots: tuple[object, ...]) -> str | None:
    """Name the first iterator among a call's arguments (the tuples and dicts in its roots), nested ones included."""
    # Tensors, lists and data loaders are iterated afresh by each attempt; an iterator
    # (a generator, iter(...), a file) goes on from where the failed attempt stopped, at any
    # depth ({"scales": iter(...)}). Looked at only after a failure, so the walk costs no call;
    # it must never replace the retry, whatever the arguments do when read.
    try:
        return _iterator_among(roots)
    except Exception:
        return None


def _iterator_among(roots: tuple[object, ...]) -> str | None:
    # (value, index of the entry it was found in, how it was reached): the path is made only for an
    # iterator found. At most _WALKED values are taken in, each container once (one may hold itself).
    entries: list[tuple[object, int, str]] = []
    for root in roots:
        if isinstance(root, (tuple, list)):
            entries.extend((value, -1, f"argument {index}") for index, value in enumerate(root))
        elif isinstance(root, dict):
            entries.extend((value, -1, f"keyword argument {name!r}") for name, value in root.items())
        elif isinstance(root, functools.partial):  # what it binds is the function's argument all the same
            entries.extend((value, -1, f"argument {index} of the partial") for index, value in enumerate(root.args))
            words = root.keywords.items()
            entries.extend((value, -1, f"keyword argument {name!r} of the partial") for name, value in words)
    seen: set[int] = set()
    position = 0
    while position < len(entries):
        value, _, _ = entries[position]
        room = _WALKED - len(entries)
        # Both checks by the type's own attributes: an ABC's isinstance runs _collections_abc's
        # __subclasshook__, which Dynamo compiled once per new type under a compiled caller until it hit
        # its recompile limit.
        kind = type(value)
        if hasattr(kind, "__next__") and hasattr(kind, "__iter__") and not isinstance(value, torch.Tensor):
            if not _write_only(value):
                buffer = isinstance(value, (io.StringIO, io.BytesIO))
                readable = (_BUFFER if buffer else _READABLE) if isinstance(value, io.IOBase) else ")"
                return f"{_path(entries, position)} ({type(value).__name__}{readable}"
        elif room > 0 and id(value) not in seen and not isinstance(value, (str, bytes, torch.Tensor)):
            seen.add(id(value))
            if isinstance(value, (tuple, list)):
                entries.extend((item, position, f"[{index}]") for index, item in enumerate(value[:room]))
            elif isinstance(value, dict) or Mapping in kind.__mro__:
                pairs = itertools.islice(cast("Mapping[Any, Any]", value).items(), room)
                entries.extend((item, position, f"[{key!r}]") for key, item in pairs)
            elif is_dataclass(value) and not isinstance(value, type):
                named = fields(value)[:room]
                entries.extend((getattr(value, field.name, None), position, f".{field.name}") for field in named)
        position += 1
    return None


def _path(entries: list[tuple[object, int, str]], position: int) -> str:
    parts = []
    while position >= 0:
        _, position, part = entries[position]
        parts.append(part)
    return "".join(reversed(parts))


def _write_only(value: object) -> bool:
    """Return whether ``value`` is a file nothing reads from (a log, ``sys.stdout``): a retry writes on."""
    if not isinstance(value, io.IOBase):
        return False
    try:
        return not value.readable()
    except ValueError:  # closed: the function cannot read it either
        return True


# How a failure names a file, or a buffer in memory, that may be read from: the advice is another.
_READABLE = ", a file open for reading)"
_BUFFER = ", a buffer that can be read)"

# The most values a failure's look for iterators visits: a long list of numbers is not walked whole.
_WALKED = 10_000


def detached(exc: BaseException) -> BaseException:
    """Return ``exc`` without the tracebacks that pin a failed attempt's frames and tensors."""
    # Contexts are dropped; the explicit causes stay: they hold the OOM error a wrapper was raised from.
    # An exception group's members are errors of the attempt too, each with its traceback and chain.
    seen: set[int] = set()
    waiting: list[BaseException] = [exc]
    while waiting:
        link = waiting.pop()
        if id(link) in seen:
            continue
        seen.add(id(link))
        link.__traceback__ = None
        link.__context__ = None
        if link.__cause__ is not None:
            waiting.append(link.__cause__)
        if _GROUP is not None and isinstance(link, _GROUP):
            waiting.extend(link.exceptions)
    return exc


_GROUP: Any = getattr(builtins, "BaseExceptionGroup", None)  # Python 3.11 on

# From Python 3.13 on, clearing a suspended frame raises RuntimeError instead of closing its generator.
_CLEAR_CLOSES = sys.version_info < (3, 13)


def clear_frames(error: BaseException, *, scan: bool = True) -> None:
    """Clear the finished frames that ``error``, the errors chained to it and a group's members pass through.

    ``scan``: look, before Python 3.13, for the generators and coroutines that own the frames that may
    be suspended (one walk through every object); without it, such frames are left alone.
    """
    # Whoever else holds one of them keeps those frames, and their locals the failed attempt's tensors,
    # through the retry: an asyncio task holds its error until the next await, a TaskGroup's CancelledError,
    # which asyncio's C code keeps, holds __aexit__'s frame and through it the group, a step may store its
    # error. Cleared, the frames still name their file, line and function. Running frames are left alone
    # (clear() refuses them), and so is any error that starts in a frame above the one the attempt ran in:
    # one the caller handles around the call, not one of the attempt.
    top = error.__traceback__
    start = top.tb_frame if top is not None else None
    above: set[FrameType] = set()
    frame = start.f_back if start is not None else sys._getframe(1)
    while frame is not None:
        above.add(frame)
        frame = frame.f_back
    finished: dict[int, FrameType] = {}
    doubtful: list[FrameType] = []  # a generator's or coroutine's, which may be suspended
    seen: set[int] = set()
    waiting = [error]
    while waiting:
        link = waiting.pop()
        if id(link) in seen:
            continue
        seen.add(id(link))
        tb = link.__traceback__
        if tb is not None and tb.tb_frame in above:
            continue
        while tb is not None:
            frame = tb.tb_frame
            if frame is not start and frame not in above and id(frame) not in finished:
                # A suspended frame has no caller; a finished one mostly has, from Python 3.12 on.
                if _CLEAR_CLOSES and frame.f_code.co_flags & SUSPENDABLE and frame.f_back is None:
                    doubtful.append(frame)
                else:
                    finished[id(frame)] = frame
            tb = tb.tb_next
        waiting.extend(linked for linked in (link.__cause__, link.__context__) if linked is not None)
        if _GROUP is not None and isinstance(link, _GROUP):
            waiting.extend(link.exceptions)
    if doubtful and scan:
        finished.update((id(frame), frame) for frame in _not_suspended(doubtful))
    for frame in finished.values():
        inner = _inner(frame) if frame.f_code is _CALL_IMPL else None
        # Refused for a frame running, in this thread or another (or suspended, from Python 3.13 on).
        try:
            frame.clear()
        except RuntimeError:
            continue
        if inner is not None:
            for cell in inner.__closure__ or ():
                with contextlib.suppress(ValueError):  # empty already
                    del cell.cell_contents


# A module with hooks runs its forward in a closure made per call, inner, over the call's arguments. A
# cleared frame of inner still holds the function, and its cells the arguments (Python 3.11): a module's
# input, and through it the graph, would outlive the clearing. Nothing else holds a call's inner, once
# its call is over.
_CALL_IMPL = getattr(getattr(torch.nn.Module, "_call_impl", None), "__code__", None)


def _inner(frame: FrameType) -> FunctionType | None:
    """Return the ``inner`` closure that a ``Module._call_impl`` frame made, if any."""
    # Read without keeping the snapshot of the variables in the frame, which clear() leaves (Python 3.11).
    inner = dict(frame_locals(frame)).get("inner")
    return inner if isinstance(inner, FunctionType) and inner.__code__.co_name == "inner" else None


def _not_suspended(frames: list[FrameType]) -> list[FrameType]:
    """Those of ``frames`` that no generator, coroutine or async generator still owns: finished ones."""
    # One walk through every object the collector tracks: only before a retry, which collects them all
    # anyway, and only where the error passed through a generator or coroutine, before Python 3.13.
    owned: set[int] = set()
    for owner in gc.get_referrers(*frames):
        if isinstance(owner, GeneratorType):
            owned.add(id(owner.gi_frame))
        elif isinstance(owner, CoroutineType):
            owned.add(id(owner.cr_frame))
        elif isinstance(owner, AsyncGeneratorType):
            owned.add(id(owner.ag_frame))
    return [frame for frame in frames if id(frame) not in owned]


def _schedules_frames(tb: TracebackType | None) -> TracebackType | None:
    """The part of a traceback below the engine's call of the schedule, if the error came from there."""
    shrink = decision.shrink.__code__
    while tb is not None:
        if tb.tb_frame.f_code is shrink:
            return tb.tb_next
        tb = tb.tb_next
    return None


def unpin(error: BaseException | None) -> None:
    """Clear the finished frames of the engine that a schedule's kept frames link back to, if any."""
    # A frame links to its caller for good: the schedule's to decision.shrink's, and on up to
    # Mechanics.end's and Attempt.__exit__'s, whose locals hold the out-of-memory error and so the
    # failed attempt's tensors. Those calls have returned; the first frame still running ends the walk.
    tb = None if error is None else error.__traceback__
    frame = None if tb is None else tb.tb_frame.f_back
    while (
        frame is not None
        and str(frame.f_globals.get("__name__", "")).startswith("koila_retry.")
        and not frame.f_code.co_flags & SUSPENDABLE
    ):
        caller = frame.f_back
        try:
            frame.clear()
        except RuntimeError:  # still running
            return
        frame = caller
