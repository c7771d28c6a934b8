"""The engine's one decision: which size a call tries next, and when it stops.

Every size rule of the engine lives here, and it is pure: no tensor, no cache, no
collective, no clock. The strategies of a call's plan (:mod:`koila_retry._core.strategy`)
gather the facts, ask, and carry the step out; ``tests/test_decision.py`` tests it
as tables of (state, outcome) and the step that follows.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from koila_retry._common.units import as_int
from koila_retry._core.cache import Bound, Streak
from koila_retry._core.policy import Policy, Schedule, powers_of_two

__all__ = [
    "NEVER",
    "Done",
    "GiveUp",
    "Outcome",
    "Rules",
    "State",
    "Step",
    "Try",
    "agreed_start",
    "between",
    "bound_rows",
    "calibrated",
    "can_probe",
    "counted",
    "decide",
    "due",
    "failed_at",
    "failed_growing",
    "first",
    "grow_by",
    "grown",
    "in_samples",
    "not_stored_below",
    "presumed",
    "refined",
    "settled",
    "shrink",
    "started_growing",
    "still_failed",
]


@dataclass(frozen=True, slots=True)
class Rules:
    """What a wrapper's options say about sizes."""

    name: str  # how errors name the function
    initial: int | None  # None: each call's rows
    minimum: int = 1
    schedule: Schedule = powers_of_two
    max_attempts: int | None = None  # of a call, or of a step
    keep_last: bool = False  # store every success's size (toma's caches do), not only those below the ceiling
    grow_gain: float | None = None  # the least gain in rows/s a growth probe must bring; None: not weighed
    refine: bool = False

    @classmethod
    def of(cls, name: str, policy: Policy, *, keep_last: bool = False) -> Rules:
        """Return the size rules of ``policy``, for the function named ``name``."""
        return cls(
            name,
            policy.initial,
            policy.minimum,
            policy.schedule,
            policy.max_attempts,
            keep_last,
            grow_gain=policy.grow_gain if policy.grow else None,
            refine=policy.refine,
        )


@dataclass(slots=True)
class State:
    """Where one call stands; its attempt owns it and carries each step out on it."""

    size: int
    ceiling: int  # the policy's initial, or the call's rows
    floor: int  # the policy's minimum, or, when ranks agree, the largest of theirs
    cached: int  # what the cache holds; the ceiling when none (nothing to store), 0 when every success is stored
    number: int = 1
    rows: int | None = None  # the rows of a short last step, fewer than size
    probe_from: int | None = None  # the size that fitted, when size is a probe above it (growth's or refine's)
    # Whether a probe above probe_from is growth's (grow=True): only a growth probe moves growing back
    # (its streak, grow_gain); refine's searches below a size that failed. Set at each start.
    growing: bool = False
    measures: int = 0  # how many more successful runs are measured for the estimate's correction
    estimated: bool = False  # size is an estimate's (initial="auto"), the cache holding none
    corrected: bool = False  # a measured run has corrected the size in this call
    failed: int | None = None  # the fewest rows that ran out of memory in this call since then
    ran_out: bool = False  # whether this rank ran out of memory in this call, not only another (see Agreeing)


class Outcome(enum.Enum):
    """What the last attempt did."""

    #: It succeeded (on every rank, when ranks agree).
    SUCCEEDED = "succeeded"
    #: It ran out of memory here.
    OUT_OF_MEMORY = "out of memory"
    #: The ranks agreed, after an out-of-memory error on one of them, on the size every rank tries next.
    AGREED = "agreed"


@dataclass(frozen=True, slots=True)
class Try:
    """Run the next attempt at ``size``."""

    size: int
    probe: bool = False  # the attempt that failed was a growth probe: its key waits longer to grow again


@dataclass(frozen=True, slots=True)
class GiveUp:
    """Try nothing more: the call raises :class:`~koila_retry.BatchSizeExhausted`."""

    # "minimum", "max_attempts", "schedule" (it returned None), "ranks" (a rank that failed has
    # no size left) or "iterator" (an argument is an iterator the failed attempt may have consumed)
    reason: str
    probe: bool = False


@dataclass(frozen=True, slots=True)
class Done:
    """The call succeeded: what its cache keeps."""

    store: int | None
    forget: bool  # the call reached the initial of its wrapper, which lifts the limit stored before
    conclusive: bool  # the success proves its size (a short last step does not); growing back counts only those
    reduced: bool  # below the ceiling: growing back waits for such successes in a row
    probe: bool  # a growth probe (refine's are none): its success starts growing back's wait afresh
    too_slow: bool = False  # a probe that fitted with too little gain: back below, and the key grows no more


#: The next step of a call.
Step = Try | GiveUp | Done


def grow_by(schedule: Schedule, size: int, name: str = "koila") -> int:
    """Return the size above ``size``: by the schedule's own ``grow`` (:class:`~koila_retry.scaled`), else doubled."""
    grow = getattr(schedule, "grow", None)
    if grow is None:  # plain callables, powers_of_two among them: the next power of two
        return 1 << size.bit_length()
    larger = grow(size)
    number = as_int(larger)  # numpy's ints too
    if number is None or number <= size:
        raise ValueError(
            f"{name}: the schedule's grow returned {larger!r} for batch size {size}; it must return an int above {size}"
        )
    return number


def first(
    rules: Rules,
    cached: int | None,
    rows: int,
    *,
    estimate: Callable[[], int] | None = None,
    proven: int | None = None,
    per_sample: int = 0,
) -> State:
    """Return the state of a call as it begins; ``estimate`` is asked only when the cache holds none."""
    floor = rules.minimum
    if cached is not None and proven is not None:
        cached = in_samples(cached, proven, per_sample)
    ceiling = rules.initial
    if ceiling is None:
        # Above a stored size, the call's rows are its ceiling; a stored size above the rows
        # stays the ceiling, so that the front end runs the rows as a short step.
        ceiling = max(rows, floor) if cached is None else max(rows, cached, floor)
    if cached is None:
        # Nothing stored: a success at the ceiling has nothing to store either.
        if estimate is None:
            return State(ceiling, ceiling, floor, 0 if rules.keep_last else ceiling)
        size = min(max(estimate(), floor), ceiling)
        return State(size, ceiling, floor, 0 if rules.keep_last else ceiling, estimated=True)
    # Another wrapper sharing the cache may have stored a size out of this one's range.
    return State(min(max(cached, floor), ceiling), ceiling, floor, cached)


def in_samples(size: int, proven: int, per_sample: int) -> int:
    """Return ``size`` rows proven on samples of ``proven`` bytes, as rows of samples of ``per_sample`` bytes."""
    # A size class holds samples of several sizes (rows padded to 37 tokens and to 50 share one):
    # a size proven on smaller samples is scaled down to as many bytes, never as many rows; one
    # proven on larger samples (or with either unknown, 0) stays as it is.
    if size and proven and per_sample > proven:
        return max(size * proven // per_sample, 1)
    return size


def settled(rules: Rules, cached: int | None, rows: int) -> int:
    """Return the size a call without an estimate starts at when a success there stores nothing, or 0.

    The engine's fast path runs that first attempt before it makes anything; the
    answer is :func:`first`'s, so the two cannot disagree.
    """
    state = first(rules, cached, rows)
    return state.size if state.cached == state.size else 0


def grown(rules: Rules, state: State, due: bool, failed: int | None = None) -> int:
    """Return the size to start a call or a step at: the state's, or the probe above it when ``due``.

    ``failed``: the smallest size that failed under the key (refine's bound), if any.
    """
    size = state.size
    if not due or size >= state.ceiling or not can_probe(rules, state):
        return size
    probe = grow_by(rules.schedule, size, rules.name)
    if failed is not None and size < failed < probe:
        # It failed while memory was short. Past it, a probe that fails leaves it the bound, and
        # refine never searches above it again; at it, one that fits lifts the bound.
        probe = failed
    # Without an initial of its own, the call's rows are no cap: a probe above them runs
    # them as a short step, which proves nothing about the probe (and lifts nothing).
    return probe if rules.initial is None else min(probe, state.ceiling)


def shrink(rules: Rules, failed: int, number: int, floor: int) -> Try | GiveUp:
    """Return the step after ``failed`` ran out of memory on attempt ``number``: the schedule's, raised to ``floor``."""
    if rules.max_attempts is not None and number >= rules.max_attempts:
        return GiveUp("max_attempts")
    if failed <= floor:
        return GiveUp("minimum")
    size = rules.schedule(failed)
    if size is None:
        return GiveUp("schedule")
    shrunk = as_int(size)  # numpy's ints too, as the options take them
    if shrunk is None or not 1 <= shrunk < failed:
        # An endless loop (a size that does not shrink) or a size no call can use.
        raised = f" (raised to the minimum, {floor}, if below it)" if floor > 1 else ""
        raise ValueError(
            f"{rules.name}: the schedule returned {size!r} after batch size {failed} ran out of memory; "
            f"it must return an int from 1 to {failed - 1}{raised}, or None to give up"
        )
    return Try(max(shrunk, floor))


def decide(
    rules: Rules,
    state: State,
    outcome: Outcome,
    *,
    agreed: int | None = None,
    hint: int | None = None,
    gain: float | None = None,
    reused: bool = False,
) -> Step:
    """Return what follows the attempt that just ran.

    ``agreed``: the ranks' size after :attr:`Outcome.AGREED` (``None``: a rank that
    failed had none left); ``hint``: the estimate's smaller probe while a run is
    measured; ``gain``: a growth probe's rows/s over the size below, less 1 (0.05 for
    5% more); ``reused``: an argument is an iterator, so a retry gives up instead.
    """
    size = state.size if state.rows is None else min(state.size, state.rows)
    probing = state.probe_from is not None and size > state.probe_from
    grew = probing and state.growing  # a growth probe, which the steps' probe flags tell growing back of
    if outcome is Outcome.SUCCEEDED:
        probe = state.probe_from is not None and state.growing
        if state.rows is not None and not rules.keep_last:
            # A short last step proves nothing about its full size: nothing is stored.
            return Done(None, False, conclusive=False, reduced=False, probe=probe)
        if grew and rules.grow_gain is not None and gain is not None and gain < rules.grow_gain and _full(rules, state):
            # It fits, but runs hardly faster: keep the size below, and stop growing.
            below = cast(int, state.probe_from)
            store = below if state.cached != below else None
            return Done(store, False, conclusive=True, reduced=True, probe=True, too_slow=True)
        store, forget, reduced = None, False, state.size < state.ceiling
        # Only a size below the ceiling says something about memory: one at it says only what
        # was asked for, and stored, it would hold back a later call that asks for more.
        if state.cached != state.size:
            if reduced or rules.keep_last:
                store = state.size
            elif state.cached < state.size and rules.initial is None:
                # Above the size stored, a probe capped at the call's own rows (initial=None): they fit,
                # but a call with more rows may not. Kept as a size that worked, below any later call's
                # ceiling; forgotten, the next full batch would fail down from its whole again.
                store, reduced = state.size, True
            elif state.cached < state.size:  # not a larger size, stored by a wrapper with a larger ceiling
                forget = True
        return Done(store, forget, conclusive=True, reduced=reduced, probe=probe)
    if outcome is Outcome.AGREED:
        if reused:  # a retry would see only what the failed attempt left of the iterator
            return GiveUp("iterator", grew)
        return GiveUp("ranks", grew) if agreed is None else Try(max(agreed, state.floor), grew)
    step = _after_oom(rules, state, size, probing, grew, hint)
    return GiveUp("iterator", step.probe) if reused and isinstance(step, Try) else step


def _full(rules: Rules, state: State) -> bool:
    """Return whether a growth probe went the whole step up, not only to refine's smallest size that failed."""
    # That one, a few rows up (on any rank, when ranks agree), looks for memory that came back: grow_gain,
    # which would judge its few rows too slow, does not weigh it.
    full = grow_by(rules.schedule, cast(int, state.probe_from), rules.name)
    return state.size >= (full if rules.initial is None else min(full, state.ceiling))


def _after_oom(rules: Rules, state: State, size: int, probing: bool, grew: bool, hint: int | None) -> Try | GiveUp:
    """Return the step after an out-of-memory error here, the iterator aside."""
    if probing:
        if rules.max_attempts is not None and state.number >= rules.max_attempts:
            return GiveUp("max_attempts", grew)  # a hard cap: can_probe makes no probe it would reach
        return Try(state.probe_from, grew)  # type: ignore[arg-type]  # back to the size that fitted
    step = shrink(rules, size, state.number, state.floor)
    if isinstance(step, Try) and state.measures and hint is not None:
        # The estimate is under the truth by more than its margin: the next run, still the one
        # to be measured, is a probe that fits even if it were far more under.
        return Try(max(min(step.size, hint), state.floor))
    return step


def between(fits: int, failed: int) -> int:
    """Return the size halfway from one that fits to one that failed, or ``fits`` when none is left between."""
    # Multiples of 8 from 64 up (the sizes tensor cores run whole): the search ends within 8
    # rows, about log2(fits / 8) probes from a power of two.
    step = 8 if fits >= 64 else 1
    middle = (fits + failed) // 2 // step * step
    if middle <= fits:  # a bound scaled from other samples need not be a multiple of 8
        middle = (fits // step + 1) * step
    return middle if fits < middle < failed else fits


def refined(rules: Rules, state: State, failed: int | None) -> int:
    """Return the size to start at with ``refine=True``: a probe below ``failed`` (in rows), or ``state.size``."""
    if not rules.refine or failed is None or failed <= state.size or not can_probe(rules, state):
        return state.size
    return min(between(state.size, failed), state.ceiling)


def can_probe(rules: Rules, state: State) -> bool:
    """Return whether a probe may start the call's next attempt: one that fails needs another to go back."""
    # max_attempts is a hard cap: with no attempt left after the probe, there is no probe.
    return rules.max_attempts is None or state.number < rules.max_attempts


def bound_rows(bound: Bound | None, per_sample: int) -> int | None:
    """Return a key's bound in rows of samples of ``per_sample`` bytes: the fewest that hold as many bytes as failed."""
    if bound is None:
        return None
    size, nbytes = bound
    # Rounded up, so that no size at or above it holds fewer bytes; as it is when either is unknown (0).
    if nbytes and per_sample and nbytes != per_sample:
        return max(-(-size * nbytes // per_sample), 1)
    return size


def failed_at(bound: Bound | None, size: int, per_sample: int = 0) -> Bound:
    """Return a key's bound after ``size`` rows of samples of ``per_sample`` bytes failed: the fewer bytes."""
    rows = bound_rows(bound, per_sample)
    return bound if bound is not None and rows is not None and rows <= size else (size, per_sample)


def still_failed(bound: Bound | None, size: int, per_sample: int = 0) -> Bound | None:
    """Return a key's bound after ``size`` rows of samples of ``per_sample`` bytes fitted: gone if they reached it."""
    rows = bound_rows(bound, per_sample)
    return None if rows is not None and size >= rows else bound


def presumed(rules: Rules, state: State) -> int | None:
    """Return the size an estimate's first size stands for as the one that failed, with ``refine=True``; or ``None``."""
    # initial="auto" starts at the largest power of two the estimate finds to fit: twice that does
    # not, by the estimate. At the ceiling there is nothing to search.
    if not rules.refine or state.size >= state.ceiling:
        return None
    return 2 * state.size


#: The wait of a key whose last probe fitted but ran too few more rows per second: it grows no more.
NEVER = 1 << 62


def started_growing(streak: Streak | None) -> Streak | None:
    """Return a key's streak (``None``: not followed) as a call asks whether to grow: restarted, when it is due."""
    # Due once its successes in a row reach its wait (grow_after, doubled after each probe that
    # failed); the probe then starts a new count.
    if streak is None or streak[0] < streak[1]:
        return streak
    return (0, streak[1])


def due(streak: Streak | None) -> bool:
    """Return whether a key with ``streak`` is due to grow back (see :func:`started_growing`)."""
    return streak is not None and streak[0] >= streak[1]


def counted(streak: Streak | None, done: Done, wait: int) -> Streak | None:
    """Return a key's streak after a success the decision called ``done``; ``wait`` is the policy's ``grow_after``."""
    if not done.conclusive:  # a short step counts nothing; a probe on one leaves the key due again
        return (streak[1], streak[1]) if done.probe and streak is not None else streak
    if done.too_slow:  # growth stops there
        return (0, NEVER)
    if not done.reduced:  # at the ceiling: nothing to grow back to
        return None
    if streak is None or done.probe:  # a growth probe that fitted starts the wait afresh
        return (1, wait)
    return (streak[0] + 1, streak[1])


def failed_growing(streak: Streak | None, probe: bool) -> Streak | None:
    """Return a key's streak after an attempt ran out of memory: restarted, and after a failed probe, twice as long."""
    if streak is None:
        return None
    return (0, streak[1] * 2 if probe else streak[1])


def agreed_start(state: State, agreed: int, floor: int) -> None:
    """Move a call that agrees across ranks to the ranks' start: their smallest size, never below their floor."""
    state.floor = floor
    own, state.size = state.size, max(agreed, floor)
    if state.size < own and state.cached > state.size:
        # Another rank's start: a success there says nothing of what fits here (that rank's rows may be
        # longer), and stored under this rank's key, scaled to its rows, it would pull every start down.
        state.cached = state.size
    if state.probe_from is not None and state.size <= state.probe_from:  # a probe only if every rank was due one
        state.probe_from = None


def not_stored_below(state: State, size: int) -> None:
    """Let a success at ``size`` or above store nothing: what the cache holds counts as that size."""
    state.cached = min(state.cached, size)


def calibrated(state: State, wanted: int, rows: int) -> int:
    """Return the size a measured run's corrected estimate leads to: never below the rows measured, which ran."""
    size = min(max(wanted, rows, state.floor), state.ceiling)
    # Nor past halfway to a size that ran out of memory after a correction: a step whose peak depends on
    # its rows measures a probe of cheap rows that says more fit, and a search converges where repeats would
    # not. Failures before the first correction do not count: the estimate's own, or a transient one.
    return size if state.failed is None else min(size, max(between(rows, state.failed), state.floor))
