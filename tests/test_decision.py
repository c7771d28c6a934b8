"""The engine's one decision, as a table: (rules, state, outcome) and the step that follows.

No work runs here: each row is the facts a call has after an attempt, and what must come next.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import koila_retry as koila
from koila_retry._core import decision
from koila_retry._core.call import Call
from koila_retry._core.decision import Done, GiveUp, Outcome, Rules, State, Try
from koila_retry._core.growing import Growing, followed, streaks
from koila_retry._core.outcomes import Failure, store
from koila_retry._core.policy import Policy
from koila_retry._core.stats import Stats
from koila_retry._core.strategies import compose
from koila_retry._core.strategy import HOOKS, Strategy
from koila_retry._core.throughput import Rates, Throughput

OOM, OK, AGREED = Outcome.OUT_OF_MEMORY, Outcome.SUCCEEDED, Outcome.AGREED
RULES = Rules("f", initial=512)


def state(size: int, **changes: object) -> State:
    """A call of ``RULES`` at ``size``, nothing stored, with ``changes``."""
    return replace(State(size, ceiling=512, floor=1, cached=512), **changes)  # type: ignore[arg-type]


DECISIONS = [
    # (id, rules, state, outcome, agreed, hint, step)
    # -- shrinking by the schedule
    ("powers of two", RULES, state(512), OOM, None, None, Try(256)),
    ("500 to 256", RULES, state(500), OOM, None, None, Try(256)),
    ("scaled(0.9)", replace(RULES, schedule=koila.scaled(0.9)), state(100), OOM, None, None, Try(90)),
    ("a short step goes below its rows", RULES, state(512, rows=300), OOM, None, None, Try(256)),
    # -- the floor
    ("raised to the floor", replace(RULES, minimum=48), state(64, floor=48), OOM, None, None, Try(48)),
    ("nothing below the floor", RULES, state(48, floor=48), OOM, None, None, GiveUp("minimum")),
    ("the ranks' floor", RULES, state(100, floor=80), OOM, None, None, Try(80)),
    ("at 1", RULES, state(1), OOM, None, None, GiveUp("minimum")),
    # -- max_attempts
    ("the last attempt", replace(RULES, max_attempts=3), state(128, number=3), OOM, None, None, GiveUp("max_attempts")),
    ("before the last", replace(RULES, max_attempts=3), state(128, number=2), OOM, None, None, Try(64)),
    (
        "a schedule that gives up",
        replace(RULES, schedule=lambda n: None),
        state(8),
        OOM,
        None,
        None,
        GiveUp("schedule"),
    ),
    # -- the probe fallback: back to what fitted, within max_attempts (a hard cap: see can_probe)
    ("a probe falls back", RULES, state(256, probe_from=128, growing=True), OOM, None, None, Try(128, probe=True)),
    # A refine probe falls back as a growth probe does, but it is no growth probe: growing back waits no longer.
    ("a refine probe falls back", RULES, state(96, probe_from=64), OOM, None, None, Try(64, probe=False)),
    (
        "a probe falls back within max_attempts",
        replace(RULES, max_attempts=2),
        state(256, probe_from=128, growing=True),
        OOM,
        None,
        None,
        Try(128, probe=True),
    ),
    (
        "never past max_attempts",
        replace(RULES, max_attempts=1),
        state(256, probe_from=128, growing=True),
        OOM,
        None,
        None,
        GiveUp("max_attempts", probe=True),
    ),
    ("a short step below the probe shrinks", RULES, state(256, probe_from=128, rows=100), OOM, None, None, Try(64)),
    # -- a measured run's smaller probe
    ("the estimate's probe", RULES, state(256, measures=2), OOM, None, None, Try(128)),
    ("the estimate's smaller probe", RULES, state(256, measures=2), OOM, None, 16, Try(16)),
    ("not below the floor", RULES, state(256, measures=2, floor=32), OOM, None, 16, Try(32)),
    ("no longer measured", RULES, state(256, measures=0), OOM, None, 16, Try(128)),
    # -- what the ranks agreed on
    ("the ranks' size", RULES, state(256), AGREED, 64, None, Try(64)),
    ("never below the floor", RULES, state(256, floor=100), AGREED, 64, None, Try(100)),
    ("a rank has none left", RULES, state(256), AGREED, None, None, GiveUp("ranks")),
    ("a probe the ranks failed", RULES, state(256, probe_from=128, growing=True), AGREED, 128, None, Try(128, True)),
    ("a refine probe the ranks failed", RULES, state(96, probe_from=64), AGREED, 64, None, Try(64)),
    # -- successes: what is stored
    ("at the ceiling: nothing", RULES, state(512), OK, None, None, Done(None, False, True, False, False)),
    ("below it: stored", RULES, state(256), OK, None, None, Done(256, False, True, True, False)),
    ("already stored", RULES, state(256, cached=256), OK, None, None, Done(None, False, True, True, False)),
    ("the ceiling reached again", RULES, state(512, cached=256), OK, None, None, Done(None, True, True, False, False)),
    (
        "a larger wrapper's size",
        RULES,
        state(512, cached=1024),
        OK,
        None,
        None,
        Done(None, False, True, False, False),
    ),
    (
        "a short step proves nothing",
        RULES,
        state(256, rows=100),
        OK,
        None,
        None,
        Done(None, False, False, False, False),
    ),
    (
        "a probe that fitted",
        RULES,
        state(256, probe_from=128, growing=True),
        OK,
        None,
        None,
        Done(256, False, True, True, True),
    ),
    (
        "a probe on a short step",
        RULES,
        state(256, probe_from=128, rows=100, growing=True),
        OK,
        None,
        None,
        Done(None, False, False, False, True),
    ),
    # A refine probe is no growth probe: its success counts towards growing back as any other.
    ("a refine probe that fitted", RULES, state(96, probe_from=64), OK, None, None, Done(96, False, True, True, False)),
    (
        "a refine probe on a short step",
        RULES,
        state(96, probe_from=64, rows=58),
        OK,
        None,
        None,
        Done(None, False, False, False, False),
    ),
    (
        "keep_last stores the ceiling",
        replace(RULES, keep_last=True),
        state(512, cached=0),
        OK,
        None,
        None,
        Done(512, False, True, False, False),
    ),
    (
        "keep_last stores a short step",
        replace(RULES, keep_last=True),
        state(512, cached=0, rows=10),
        OK,
        None,
        None,
        Done(512, False, True, False, False),
    ),
]


@pytest.mark.parametrize(
    ("rules", "before", "outcome", "agreed", "hint", "step"),
    [row[1:] for row in DECISIONS],
    ids=[row[0] for row in DECISIONS],
)
def test_the_decision_table(
    rules: Rules, before: State, outcome: Outcome, agreed: int | None, hint: int | None, step: decision.Step
) -> None:
    snapshot = replace(before)
    assert decision.decide(rules, before, outcome, agreed=agreed, hint=hint) == step
    assert before == snapshot  # pure: the attempt carries the step out


def test_only_a_growth_probe_is_weighed_by_grow_gain() -> None:
    rules = replace(RULES, grow_gain=0.05)
    hardly = decision.decide(rules, state(128, probe_from=64, growing=True), OK, gain=0.01)
    assert hardly == Done(64, False, True, True, True, too_slow=True)
    # A refine probe searches for what fits, not for speed: it stays, and growing back goes on.
    assert decision.decide(rules, state(96, probe_from=64), OK, gain=0.01) == Done(96, False, True, True, False)
    # A growth probe to refine's smallest size that failed, a few rows up, here or on another rank: not weighed,
    # or growth stopped for good where the next size up fits and runs faster (probes 77G, 77K).
    bound = decision.decide(rules, state(176, probe_from=168, growing=True), OK, gain=0.01)
    assert bound == Done(176, False, True, True, True)
    capped = decision.decide(rules, state(512, ceiling=512, probe_from=300, growing=True), OK, gain=0.01)
    assert capped.too_slow  # up to the ceiling, the whole step up there is


FIRSTS = [
    # (id, rules, cached, rows, estimate, proven, per_sample, (size, ceiling, floor, cached))
    ("nothing stored: initial", RULES, None, 0, None, None, 0, (512, 512, 1, 512)),
    ("stored", RULES, 128, 0, None, None, 0, (128, 512, 1, 128)),
    ("stored above initial", RULES, 1024, 0, None, None, 0, (512, 512, 1, 1024)),
    ("stored below minimum", replace(RULES, minimum=64), 8, 0, None, None, 0, (64, 512, 64, 8)),
    ("the estimate", RULES, None, 0, 100, None, 0, (100, 512, 1, 512)),
    ("the estimate above initial", RULES, None, 0, 4096, None, 0, (512, 512, 1, 512)),
    ("the estimate below minimum", replace(RULES, minimum=8), None, 0, 2, None, 0, (8, 512, 8, 512)),
    ("the cache beats the estimate", RULES, 64, 0, 100, None, 0, (64, 512, 1, 64)),
    ("keep_last stores the first success", replace(RULES, keep_last=True), None, 0, None, None, 0, (512, 512, 1, 0)),
    # initial=None: the call's rows are the ceiling
    ("no initial: the rows", Rules("f", None), None, 1000, None, None, 0, (1000, 1000, 1, 1000)),
    ("no initial: rows below minimum", Rules("f", None, 16), None, 5, None, None, 0, (16, 16, 16, 16)),
    ("no initial: stored above the rows", Rules("f", None), 512, 200, None, None, 0, (512, 512, 1, 512)),
    ("no initial: stored below the rows", Rules("f", None), 512, 4000, None, None, 0, (512, 4000, 1, 512)),
    # size classes: a size proven on smaller samples, as many bytes of these samples
    ("proven on smaller samples", RULES, 256, 0, None, 100, 200, (128, 512, 1, 128)),
    ("proven on larger samples", RULES, 256, 0, None, 400, 200, (256, 512, 1, 256)),
    ("never scaled below 1", RULES, 2, 0, None, 100, 1000, (1, 512, 1, 1)),
]


@pytest.mark.parametrize(
    ("rules", "cached", "rows", "estimate", "proven", "per_sample", "expected"),
    [row[1:] for row in FIRSTS],
    ids=[row[0] for row in FIRSTS],
)
def test_the_first_size_table(
    rules: Rules,
    cached: int | None,
    rows: int,
    estimate: int | None,
    proven: int | None,
    per_sample: int,
    expected: tuple[int, int, int, int],
) -> None:
    asked: list[int] = []

    def estimated() -> int:
        asked.append(1)
        return estimate  # type: ignore[return-value]

    made = decision.first(
        rules, cached, rows, estimate=None if estimate is None else estimated, proven=proven, per_sample=per_sample
    )
    assert (made.size, made.ceiling, made.floor, made.cached) == expected
    assert asked == ([1] if estimate is not None and cached is None else [])  # asked only when nothing is stored


@given(
    st.one_of(st.none(), st.integers(1, 4096)),
    st.one_of(st.none(), st.integers(1, 8192)),
    st.integers(1, 64),
    st.integers(0, 8192),
    st.booleans(),
)
def test_settled_agrees_with_first(
    initial: int | None, cached: int | None, minimum: int, rows: int, keep_last: bool
) -> None:
    rules = Rules("f", initial, minimum if initial is None else min(minimum, initial), keep_last=keep_last)
    size = decision.settled(rules, cached, rows)
    made = decision.first(rules, cached, rows)
    if size:
        assert made.size == size
        assert made.cached == size  # a success stores nothing: the call needs no state
    else:  # it leaves out only the calls whose success stores, or that start away from the cached size
        assert made.cached != made.size or cached is None or cached < rules.minimum


@pytest.mark.parametrize(
    ("rules", "cached", "rows", "size"),
    [
        (RULES, None, 0, 512),
        (RULES, 128, 0, 128),
        (RULES, 1024, 0, 0),
        (replace(RULES, keep_last=True), None, 0, 0),
        (replace(RULES, keep_last=True), 512, 0, 512),
        (Rules("f", None, keep_last=True), 64, 100, 64),  # toma's: a stored size, whatever the rows
        (Rules("f", None), None, 100, 100),
        (Rules("f", None, 16), None, 5, 16),
        (Rules("f", None, 16), 8, 100, 0),
    ],
)
def test_the_settled_table(rules: Rules, cached: int | None, rows: int, size: int) -> None:
    assert decision.settled(rules, cached, rows) == size


GROWTHS = [
    # (id, rules, state, due, size)
    ("not due", RULES, state(128), False, 128),
    ("doubled", RULES, state(128), True, 256),
    ("to the next power of two", RULES, state(100), True, 128),
    ("capped at initial", replace(RULES, initial=200), state(128, ceiling=200), True, 200),
    ("at the ceiling", RULES, state(512), True, 512),
    ("by scaled(0.9)", replace(RULES, schedule=koila.scaled(0.9)), state(100), True, 112),
    ("by scaled(0.5)", replace(RULES, schedule=koila.scaled(0.5)), state(100), True, 200),
    ("no initial: above the rows", Rules("f", None), state(128, ceiling=150), True, 256),
    # A probe that failed needs a second attempt to go back: max_attempts=1 leaves none.
    ("no probe under max_attempts=1", replace(RULES, max_attempts=1), state(128), True, 128),
    ("a probe under max_attempts=2", replace(RULES, max_attempts=2), state(128), True, 256),
]

FAILED_GROWTHS = [
    # (id, state, failed, size): refine's bound, the smallest size that failed under the key
    ("first at a size that failed below the next power of two", state(168), 176, 176),
    ("past a bound at the next power of two", state(128), 256, 256),
    ("past a bound above it", state(128), 300, 256),
    ("past a bound at the size itself", state(128), 128, 256),
    ("no bound", state(128), None, 256),
]


@pytest.mark.parametrize(
    ("rules", "before", "due", "size"), [row[1:] for row in GROWTHS], ids=[row[0] for row in GROWTHS]
)
def test_the_growth_table(rules: Rules, before: State, due: bool, size: int) -> None:
    assert decision.grown(rules, before, due) == size


@pytest.mark.parametrize(
    ("before", "failed", "size"), [row[1:] for row in FAILED_GROWTHS], ids=[row[0] for row in FAILED_GROWTHS]
)
def test_the_growth_table_with_a_size_that_failed(before: State, failed: int | None, size: int) -> None:
    assert decision.grown(RULES, before, True, failed) == size
    assert decision.grown(RULES, before, False, failed) == before.size


def test_a_schedule_grows_by_its_own_rule_and_must_grow() -> None:
    class Thirds:
        def __call__(self, failed: int) -> int | None:
            return failed * 2 // 3 or None

        def grow(self, size: int) -> int:
            return size * 3 // 2 + 1

    assert decision.grow_by(Thirds(), 100) == 151
    assert decision.grow_by(lambda failed: failed - 1, 100) == 128  # a plain callable doubles

    class Stuck(Thirds):
        def grow(self, size: int) -> int:
            return size

    with pytest.raises(ValueError, match=r"^step: the schedule's grow returned 100 for batch size 100; it must return"):
        decision.grow_by(Stuck(), 100, "step")


@given(st.sampled_from([0.3, 0.5, 0.75, 0.9, 0.99]), st.integers(1, 100_000))
def test_scaled_grows_back_to_the_smallest_size_that_shrinks_to_it(factor: float, size: int) -> None:
    schedule = koila.scaled(factor)
    larger = schedule.grow(size)
    assert larger > size
    assert (schedule(larger) or 0) >= size
    assert larger == size + 1 or (schedule(larger - 1) or 0) < size


def test_scaled_grows_back_from_a_tiny_factor() -> None:
    """Past 2**53 a float's steps are coarser than one: the search for the exact size never ended."""
    schedule = koila.scaled(1e-300)
    larger = schedule.grow(10)
    assert larger > 10
    assert (schedule(larger) or 0) >= 10


AGREEMENTS = [
    # (id, state, agreed, floor, (size, floor, probe_from, cached))
    # Another rank's smaller start: a success there is not stored under this rank's key (its rows may be
    # shorter), which would pull every later start down.
    ("the smallest start", state(256), 64, 1, (64, 1, None, 64)),
    ("the same start", state(256, cached=256), 256, 1, (256, 1, None, 256)),
    ("below what this rank stored", state(128, cached=128), 32, 1, (32, 1, None, 32)),
    ("every success stored (keep_last)", state(256, cached=0), 64, 1, (64, 1, None, 0)),
    ("the largest floor", state(256), 64, 100, (100, 100, None, 100)),
    ("a probe every rank was due", state(256, probe_from=128), 256, 1, (256, 1, 128, 512)),
    ("a probe another rank was not due", state(256, probe_from=128), 128, 1, (128, 1, None, 128)),
]


@pytest.mark.parametrize(
    ("before", "agreed", "floor", "expected"), [row[1:] for row in AGREEMENTS], ids=[row[0] for row in AGREEMENTS]
)
def test_the_agreed_start_table(
    before: State, agreed: int, floor: int, expected: tuple[int, int, int | None, int]
) -> None:
    decision.agreed_start(before, agreed, floor)
    assert (before.size, before.floor, before.probe_from, before.cached) == expected


def test_a_success_at_another_ranks_smaller_start_stores_nothing_but_one_below_it_does() -> None:
    started = state(128, cached=128)
    decision.agreed_start(started, 32, 1)
    assert decision.decide(RULES, started, OK) == Done(None, False, True, True, False)
    # After the ranks agreed on a failure below it, the size that fits everywhere is stored, as before.
    started.size = 16
    assert decision.decide(RULES, started, OK) == Done(16, False, True, True, False)


@pytest.mark.parametrize(
    ("wanted", "rows", "floor", "size"),
    [(300, 64, 1, 300), (10, 64, 1, 64), (10, 4, 32, 32), (4096, 64, 1, 512)],
    ids=["the estimate's", "never below the rows that ran", "the floor", "the ceiling"],
)
def test_the_calibration_table(wanted: int, rows: int, floor: int, size: int) -> None:
    assert decision.calibrated(state(64, floor=floor), wanted, rows) == size


def test_a_schedule_that_does_not_shrink_is_refused() -> None:
    with pytest.raises(ValueError, match=r"f: the schedule returned 100 after batch size 100"):
        decision.decide(replace(RULES, schedule=lambda n: n), state(100), OOM)


@pytest.mark.parametrize(
    ("size", "proven", "per_sample", "rows"),
    [(256, 100, 200, 128), (256, 400, 200, 256), (256, 0, 200, 256), (2, 100, 1000, 1), (0, 100, 200, 0)],
    ids=["smaller samples", "larger samples", "unknown", "never below 1", "nothing"],
)
def test_sizes_proven_on_other_samples_of_a_class(size: int, proven: int, per_sample: int, rows: int) -> None:
    assert decision.in_samples(size, proven, per_sample) == rows


def done(*, reduced: bool = True, probe: bool = False, conclusive: bool = True) -> Done:
    return Done(None, False, conclusive=conclusive, reduced=reduced, probe=probe)


STREAKS = [
    # (id, streak before, what happened, streak after)
    ("the first success below the ceiling", None, done(), (1, 50)),
    ("one more", (3, 50), done(), (4, 50)),
    ("a probe that fitted waits afresh", (0, 200), done(probe=True), (1, 50)),
    ("the ceiling ends it", (3, 50), done(reduced=False), None),
    ("a short step counts nothing", (3, 50), done(conclusive=False), (3, 50)),
    ("a probe on a short step is due again", (0, 50), done(conclusive=False, probe=True), (50, 50)),
    ("nothing to follow", None, done(conclusive=False, probe=True), None),
]


@pytest.mark.parametrize(("before", "success", "after"), [row[1:] for row in STREAKS], ids=[row[0] for row in STREAKS])
def test_the_streak_table_after_a_success(
    before: tuple[int, int] | None, success: Done, after: tuple[int, int] | None
) -> None:
    assert decision.counted(before, success, 50) == after


def test_the_streak_when_asked_and_after_a_failure() -> None:
    assert not decision.due(None)
    assert not decision.due((49, 50))
    assert decision.due((50, 50))
    assert decision.started_growing((50, 50)) == (0, 50)  # the probe starts a new count
    assert decision.started_growing((49, 50)) == (49, 50)
    assert decision.started_growing(None) is None
    assert decision.failed_growing((30, 50), probe=False) == (0, 50)
    assert decision.failed_growing((0, 50), probe=True) == (0, 100)  # a failed probe waits twice as long
    assert decision.failed_growing(None, probe=True) is None


REFINE = replace(RULES, refine=True)
REFINED = [
    # (id, rules, state, bound in rows, size)
    ("halfway", REFINE, state(64), 128, 96),
    ("nothing failed", REFINE, state(64), None, 64),
    ("the bound fitted", REFINE, state(128), 128, 128),
    ("refine off", RULES, state(64), 128, 64),
    ("under the ceiling", REFINE, state(64, ceiling=80), 128, 80),
    ("to the last multiple of 8 below a bound", REFINE, state(88), 102, 96),
    ("no probe under max_attempts=1", replace(REFINE, max_attempts=1), state(64), 128, 64),
    ("a probe under max_attempts=2", replace(REFINE, max_attempts=2), state(64), 128, 96),
]


@pytest.mark.parametrize(
    ("rules", "before", "bound", "size"), [row[1:] for row in REFINED], ids=[row[0] for row in REFINED]
)
def test_the_refine_table(rules: Rules, before: State, bound: int | None, size: int) -> None:
    assert decision.refined(rules, before, bound) == size


BOUNDS = [
    # (id, bound, per_sample now, in rows)
    ("none", None, 40, None),
    ("same samples", (88, 40), 40, 88),
    ("bytes unknown then", (88, 0), 60, 88),
    ("bytes unknown now", (88, 40), 0, 88),
    ("longer rows: fewer", (88, 40), 60, 59),  # 58 x 60 = 3480 holds less than 88 x 40 = 3520
    ("shorter rows: more", (88, 40), 33, 107),  # 106 x 33 = 3498
    ("never below 1", (1, 1), 1000, 1),
]


@pytest.mark.parametrize(("bound", "per_sample", "rows"), [row[1:] for row in BOUNDS], ids=[row[0] for row in BOUNDS])
def test_the_bound_in_rows_of_other_samples(bound: tuple[int, int] | None, per_sample: int, rows: int | None) -> None:
    assert decision.bound_rows(bound, per_sample) == rows


@given(st.integers(1, 512), st.integers(1, 4096), st.integers(1, 4096))
def test_no_size_at_or_above_a_scaled_bound_holds_fewer_bytes(size: int, nbytes: int, per_sample: int) -> None:
    rows = decision.bound_rows((size, nbytes), per_sample)
    assert rows is not None
    assert rows * per_sample >= size * nbytes  # at the bound: at least as many bytes as failed
    assert rows == 1 or (rows - 1) * per_sample < size * nbytes  # below it: fewer


def test_an_estimates_size_presumes_twice_it_failed() -> None:
    assert decision.presumed(REFINE, state(64)) == 128
    assert decision.presumed(RULES, state(64)) is None  # refine off
    assert decision.presumed(REFINE, state(512)) is None  # at the ceiling: nothing to search
    made = decision.first(REFINE, None, 0, estimate=lambda: 64)
    assert made.estimated
    assert not decision.first(REFINE, 64, 0, estimate=lambda: 32).estimated  # the cache's size


# -- the strategies composed into the decision ------------------------------------------------
# Each feature that changes what follows is a Strategy of a wrapper's Plan (issue 41). A row is
# the facts a call has at one event, and where the strategy leaves it; a fake course stands in
# for the driver, so that no work runs.


class FakeCourse:
    """What a strategy sees of a call's attempts: a state, a key, a cache; resize as the driver does."""

    def __init__(self, rules: Rules, before: State, cache: koila.SizeCache, policy: Policy) -> None:
        self.owner = SimpleNamespace(name="f", rules=rules, policy=policy, cache=cache, stats=Stats(0))
        self.call = Call(None, None, torch.device("cpu"))
        self.state, self.key, self.phase, self.clocked, self.unanimous, self.failure = before, "key", 0, 0.0, True, None

    def resize(self, size: int) -> None:
        self.state.size = self.owner.stats.batch_size = size


STRATEGY_PLANS = [
    # (id, options, the strategies in the order each event runs them, whether a call may take the short way)
    ("nothing", {}, [], True),
    ("grow", {"grow": True}, ["Growing"], False),
    ("refine", {"refine": True}, ["Refining", "Presuming"], False),
    ("grow and gain", {"grow": True, "grow_gain": 0.05}, ["Growing", "Throughput"], False),
    (
        "all",
        {"grow": True, "refine": True, "grow_gain": 0.05},
        ["Growing", "Refining", "Presuming", "Throughput"],
        False,
    ),
    ("a snapshot acts only on a failure", {"snapshot": "oom.pickle"}, ["Snapshotting"], True),
    ("on_oom is told last", {"on_oom": print, "refine": True}, ["Refining", "Presuming", "Notifying"], False),
]


@pytest.mark.parametrize(
    ("options", "names", "short"), [row[1:] for row in STRATEGY_PLANS], ids=[row[0] for row in STRATEGY_PLANS]
)
def test_the_plan_table(options: dict[str, object], names: list[str], short: bool) -> None:
    policy = Policy(initial=512, **options)  # type: ignore[arg-type]
    plan = compose(policy, Rules.of("f", policy), koila.GlobalCache())
    assert [type(each).__name__ for each in plan.strategies] == names
    assert plan.short is short
    # Each event runs only the hooks a strategy overrides: none is a no-op call.
    for hook in HOOKS:
        assert all(
            getattr(type(owner), hook) is not getattr(Strategy, hook)
            for owner in plan.strategies
            if getattr(owner, hook) in getattr(plan, hook)
        )


GROWING = [
    # (id, state before, the key's streak before, size after, probe_from after, streak after)
    ("not followed", state(64, ceiling=512), None, 64, None, None),
    ("not yet due", state(64, ceiling=512), (2, 3), 64, None, (2, 3)),
    ("due: a probe, and the count starts again", state(64, ceiling=512), (3, 3), 128, 64, (0, 3)),
    ("at the ceiling, nothing is asked", state(512), (3, 3), 512, None, (3, 3)),
    ("no attempt left to go back", replace(state(64), number=2), (3, 3), 64, None, (0, 3)),
]


@pytest.mark.parametrize(
    ("before", "streak", "size", "probe_from", "after"), [row[1:] for row in GROWING], ids=[row[0] for row in GROWING]
)
def test_the_growing_strategy_table(
    before: State, streak: tuple[int, int] | None, size: int, probe_from: int | None, after: tuple[int, int] | None
) -> None:
    cache = koila.GlobalCache()
    rules = replace(RULES, max_attempts=2) if before.number == 2 else RULES
    course = FakeCourse(rules, before, cache, Policy(initial=512, grow=True, grow_after=3))
    growing = Growing(streaks(cache), wait=3)
    growing.streaks.update("key", lambda _: streak)
    growing.start(course, True)  # type: ignore[arg-type]
    assert (course.state.size, course.state.probe_from, growing.streaks.get("key")) == (size, probe_from, after)
    assert course.state.growing is (probe_from is not None)  # what tells a growth probe from refine's
    assert course.owner.stats.batch_size == size  # the driver's resize: the one writer of the size


def test_the_streaks_are_the_engines_and_follow_the_cache() -> None:
    cache = koila.GlobalCache()
    assert not hasattr(cache, "growth")  # the user's cache stores sizes (and refine's failed sizes)
    assert streaks(cache) is streaks(cache)  # one per cache: koila.attempts makes a controller per run
    streaks(cache).update("key", lambda _: (2, 3))
    cache.cache_clear()
    assert streaks(cache).get("key") is None


THROUGHPUT = [
    # (id, gain over the size below, size after, what the cache holds after, too slow)
    ("enough faster: kept", 0.10, 128, 128, False),
    ("hardly faster: back below", 0.01, 64, 64, True),
]


@pytest.mark.parametrize(
    ("gain", "size", "cached", "too_slow"), [row[1:] for row in THROUGHPUT], ids=[row[0] for row in THROUGHPUT]
)
def test_the_throughput_strategy_table(gain: float, size: int, cached: int, too_slow: bool) -> None:
    ticks = iter([0.0, 1.0])
    policy = Policy(initial=512, grow=True, grow_gain=0.05, clock=lambda: next(ticks))
    before = state(128, cached=64, probe_from=64, growing=True)
    cache = koila.GlobalCache()
    course = FakeCourse(Rules.of("f", policy), before, cache, policy)
    followed(cache, Rates).record("key", 64, 128 / (1 + gain))  # the size below ran at this rate, under the key
    throughput = Throughput()
    throughput.begin(course)  # type: ignore[arg-type]
    done = throughput.judge(course, Done(128, False, True, True, True))  # type: ignore[arg-type]
    store(course.owner.cache, course.key, done, course.state, 0)
    throughput.stored(course, done)  # type: ignore[arg-type]
    assert (done.too_slow, course.state.size, course.state.cached, course.owner.stats.batch_size) == (
        too_slow,
        size,
        cached,
        size if too_slow else 0,  # only a move back is the driver's resize
    )


ITERATORS = [
    # (id, state, outcome, agreed, the step with an iterator argument, and without)
    ("a retry becomes giving up", state(512), OOM, None, GiveUp("iterator"), Try(256)),
    ("giving up stays as it was", state(1), OOM, None, GiveUp("minimum"), GiveUp("minimum")),
    (
        "a probe's fallback too",
        state(256, probe_from=128, growing=True),
        OOM,
        None,
        GiveUp("iterator", True),
        Try(128, True),
    ),
    ("after the ranks agreed", state(512), AGREED, 256, GiveUp("iterator"), Try(256)),
    ("when a rank has no size left", state(512), AGREED, None, GiveUp("iterator"), GiveUp("ranks")),
]


@pytest.mark.parametrize(
    ("before", "outcome", "agreed", "step", "alone"), [row[1:] for row in ITERATORS], ids=[row[0] for row in ITERATORS]
)
def test_the_iterator_table(
    before: State, outcome: Outcome, agreed: int | None, step: decision.Step, alone: decision.Step
) -> None:
    # A retry would see only what the failed attempt left of an iterator argument.
    assert decision.decide(RULES, before, outcome, agreed=agreed, reused=True) == step
    assert decision.decide(RULES, before, outcome, agreed=agreed, reused=False) == alone


class Estimate:
    """A first size whose run is measured, and whose smaller probe after an out-of-memory error is ``probe``."""

    def __init__(self, probe: int) -> None:
        self.meter, self.probe = object(), probe

    def after_oom(self, size: int) -> int:
        return self.probe


CALIBRATING = [
    # (id, state after the failure, the estimate's probe, the step)
    ("the estimate's probe, below the schedule's", state(256, measures=2), 40, Try(40)),
    ("the schedule's, below the estimate's", state(256, measures=2), 200, Try(128)),
    ("never below the floor", state(256, measures=2, floor=64), 40, Try(64)),
    ("measured already: the schedule", state(256, measures=0), 40, Try(128)),
    ("giving up stays", state(1, measures=2), 1, GiveUp("minimum")),
]


@pytest.mark.parametrize(
    ("before", "probe", "step"), [row[1:] for row in CALIBRATING], ids=[row[0] for row in CALIBRATING]
)
def test_the_calibrating_strategy_table(before: State, probe: int, step: decision.Step) -> None:
    policy = Policy(initial=512)
    estimate = Estimate(probe)
    plan = compose(policy, RULES, koila.GlobalCache(), first=estimate)  # type: ignore[arg-type]
    assert [type(each).__name__ for each in plan.strategies] == ["Calibrating"]
    course = FakeCourse(RULES, before, koila.GlobalCache(), policy)
    failure = Failure()
    failure.step = decision.decide(RULES, before, OOM)
    for out_of_memory in plan.out_of_memory:
        out_of_memory(course, failure, False)  # type: ignore[arg-type]
    assert failure.step == step


def test_a_success_at_the_calls_own_rows_is_a_size_that_worked_where_the_rows_are_the_ceiling() -> None:
    """initial=None: a probe capped at (or landing on) the call's rows forgot the key, as if it reached initial."""
    rows_rules = Rules("f", initial=None, refine=True)
    refined = State(90, ceiling=90, floor=1, cached=64, probe_from=64)  # refine's probe, capped at 90 rows
    assert decision.decide(rows_rules, refined, OK) == Done(90, False, True, True, False)
    grown = State(512, ceiling=512, floor=1, cached=256, probe_from=256, growing=True)  # growth's, on 512 rows
    assert decision.decide(rows_rules, grown, OK) == Done(512, False, True, True, True)
    # Nothing stored before: the whole call fitted, and there is nothing to store.
    assert decision.decide(rows_rules, State(90, ceiling=90, floor=1, cached=90), OK) == Done(
        None, False, True, False, False
    )
    # With an initial of its own, the ceiling is the wrapper's: reaching it lifts the limit stored before.
    lifted = decision.decide(RULES, state(512, cached=256, probe_from=256, growing=True), OK)
    assert lifted == Done(None, True, True, False, True)
