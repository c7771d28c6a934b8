"""Growing by throughput, not just size (issue 31, part 2): a probe that fits but runs hardly faster is let go.

Every test times with a fake clock that the work itself moves on by the seconds its rows cost: no test
reads a real clock.
"""

from __future__ import annotations

import fractions
from collections.abc import Callable
from typing import Any

import pytest
import torch

import koila_retry as koila
from koila_retry._core import decision
from koila_retry._core.decision import Done, Outcome, Rules, State
from koila_retry.testing import make_oom


class Clock:
    """Seconds that pass only when the work says so."""

    def __init__(self) -> None:
        self.now = 100.0
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now


def worker(clock: Clock, cost: Callable[[int], float], fail_first_at: int) -> tuple[Callable[[int], int], list[int]]:
    """Work that takes ``cost(rows)`` seconds, and runs out of memory once, at ``fail_first_at`` rows."""
    sizes: list[int] = []

    def work(batch_size: int) -> int:
        sizes.append(batch_size)
        if batch_size == fail_first_at and sizes.count(batch_size) == 1:
            raise make_oom()
        clock.now += cost(batch_size)
        return batch_size

    return work, sizes


@pytest.mark.parametrize(
    ("cost", "settled"),
    [
        (lambda rows: rows / 128, 32),  # 128 rows/s at any size: growing to 64 gains nothing
        (lambda rows: 0.125 + rows / 128, 64),  # a fixed 1/8 s a call: 64 rows run 20% faster than 32
    ],
    ids=["flat", "rising"],
)
def test_a_probe_that_fits_stays_only_if_it_runs_faster(cost: Callable[[int], float], settled: int) -> None:
    clock = Clock()
    work, sizes = worker(clock, cost, fail_first_at=64)
    run = koila.batch(initial=64, grow=True, grow_after=1, grow_gain=0.03, clock=clock)(work)
    for _ in range(8):
        run()
    # 64 ran out of memory, 32 fitted; at the next call the probe back up to 64 fitted too.
    assert sizes[:3] == [64, 32, 64]
    # Kept only where it brought 3% or more rows per second; after that, no more probes either way.
    assert sizes[3:] == [settled] * 6
    assert set(run.stats.throughput) == {32, 64}
    assert run.stats.throughput[32] == pytest.approx(32 / cost(32))


def test_a_gain_of_zero_grows_whenever_it_fits() -> None:
    clock = Clock()
    work, sizes = worker(clock, lambda rows: rows / 128, fail_first_at=64)
    run = koila.batch(initial=64, grow=True, grow_after=1, grow_gain=0.0, clock=clock)(work)
    for _ in range(5):
        run()
    assert sizes == [64, 32, 64, 64, 64, 64]


def test_a_chunked_call_goes_back_to_the_size_below_for_its_other_chunks() -> None:
    clock = Clock()
    seen: list[int] = []

    def embed(chunk: torch.Tensor) -> torch.Tensor:
        seen.append(len(chunk))
        if len(chunk) == 64 and seen.count(64) == 1:
            raise make_oom()
        clock.now += len(chunk) / 128
        return chunk * 2

    x = torch.arange(512.0).unsqueeze(1)
    out = koila.chunked(
        embed, x, initial=64, grow=True, grow_after=1, grow_gain=0.03, clock=clock, cache=koila.NoCache()
    )
    assert torch.equal(out, x * 2)
    # 64 failed, 32 fitted, the next chunk probed 64, which fitted and gained nothing: 32 for the rest.
    assert seen[:4] == [64, 32, 64, 32]
    assert set(seen[4:]) == {32}


@pytest.mark.parametrize(("overhead", "settled"), [(0.01, 32), (0.1, 64)], ids=["small", "large"])
def test_accumulate_weighs_the_rows_per_second_of_whole_steps(overhead: float, settled: int) -> None:
    # Each micro-batch costs a fixed overhead and its rows: larger micro-batches pay it fewer times
    # a step. 256 rows from 32 to 64: 2% faster with 0.01 s, 17% with 0.1 s.
    clock = Clock()
    weight = torch.nn.Parameter(torch.ones(1))
    sizes: list[int] = []

    @koila.accumulate(initial=64, grow=True, grow_after=1, grow_gain=0.03, clock=clock)
    def step(x: torch.Tensor) -> torch.Tensor:
        sizes.append(len(x))
        if len(x) == 64 and sizes.count(64) == 1:
            raise make_oom()
        clock.now += overhead + len(x) / 128
        return (x * weight).sum()

    x = torch.ones(256, 1)
    for _ in range(4):
        step(x)
        weight.grad = None
    assert step.stats.batch_size == settled
    assert set(step.stats.throughput) == {32, 64}
    assert step.stats.throughput[32] == pytest.approx(256 / (8 * overhead + 2))


def test_growing_without_a_gain_never_reads_the_clock() -> None:
    # Growing by size alone is the default: no attempt is timed, and nothing depends on a clock. (A clock or a
    # gain without grow=True is refused: test_grow.py.)
    clock = Clock()
    work, sizes = worker(clock, lambda rows: rows / 128, fail_first_at=64)
    run = koila.batch(initial=64, grow=True, grow_after=1, clock=clock)(work)
    for _ in range(3):
        run()
    assert clock.reads == 0
    assert run.stats.throughput == {}
    assert sizes == [64, 32, 64, 64]


def test_the_decision_keeps_the_size_below_when_the_gain_is_short() -> None:
    rules = Rules("f", 128, grow_gain=0.03)
    probe = State(size=64, ceiling=128, floor=1, cached=32, probe_from=32, growing=True)
    short = decision.decide(rules, probe, Outcome.SUCCEEDED, gain=0.01)
    assert short == Done(None, False, conclusive=True, reduced=True, probe=True, too_slow=True)
    assert decision.counted((1, 1), short, 1) == (0, decision.NEVER)  # the key grows no more
    assert not decision.due(decision.counted((5, decision.NEVER), Done(32, False, True, True, False), 1))
    enough = decision.decide(rules, probe, Outcome.SUCCEEDED, gain=0.05)
    assert isinstance(enough, Done)
    assert (enough.store, enough.too_slow) == (64, False)
    # Untimed (a clock that did not move), or throughput not weighed: the plain rule.
    assert decision.decide(rules, probe, Outcome.SUCCEEDED, gain=None) == enough
    unweighed = Rules("f", 128)
    assert decision.decide(unweighed, probe, Outcome.SUCCEEDED, gain=0.0) == enough


@pytest.mark.parametrize(
    ("options", "error", "shown"),
    [
        ({"grow_gain": -0.1}, ValueError, r"grow_gain must be at least 0 and below 10 \(0 <= grow_gain < 10\)"),
        ({"grow_gain": float("nan")}, ValueError, r"grow_gain must be at least 0 and below 10"),
        ({"grow_gain": "3%"}, TypeError, "grow_gain must be a number"),
        ({"grow_gain": True}, TypeError, "grow_gain must be a number"),
        ({"clock": 3}, TypeError, "clock must be callable"),
    ],
)
def test_bad_options_are_refused(options: dict[str, object], error: type[Exception], shown: str) -> None:
    with pytest.raises(error, match=shown):
        koila.batch(grow=True, **options)(lambda batch_size: None)


def _heavy_after(cheap_calls: int) -> tuple[list[int], dict[int, float]]:
    """A call site of heavy rows, growing back, after ``cheap_calls`` calls of one of cheap rows, one wrapper."""
    clock, limit = Clock(), [64]

    def by_site(function: object, caller: Any, device: object, sample: object = None) -> object:
        return (function, caller.f_code.co_name)  # one key per call site, whatever the free memory

    @koila.batch(
        initial=128, grow=True, grow_after=1, grow_gain=0.05, clock=clock, cache=koila.GlobalCache(key=by_site)
    )
    def run(batch_size: int, cost_per_row: float) -> int:
        if batch_size > limit[0]:
            raise make_oom()
        clock.now += 1.0 + batch_size * cost_per_row  # a fixed second a call, and the rows' cost
        return batch_size

    def cheap() -> int:
        return run(0.0001)

    def heavy() -> int:  # 128 rows run 44% more rows per second than 64: 128 / 2.28 s against 64 / 1.64 s
        return run(0.01)

    for _ in range(cheap_calls):
        cheap()  # 64 fits, and runs about 64 rows per second
    heavy()  # 128 fails, 64 fits: about 39 rows per second
    limit[0] = 1000  # memory comes back
    return [heavy() for _ in range(4)], run.stats.throughput


def test_a_probe_is_weighed_against_the_size_below_under_its_own_key() -> None:
    """grow_gain weighed heavy rows' probe against cheap rows' rate at 64, mixed from another call site: the probe
    brought 44% more of its own rows per second, yet was judged too slow, and the key grew no more."""
    alone, alone_throughput = _heavy_after(cheap_calls=0)
    beside, beside_throughput = _heavy_after(cheap_calls=5)
    assert beside == alone == [128] * 4  # the cheap call site changes nothing of the heavy one's growth
    # stats.throughput is still the wrapper's, by size, over every call site: cheap rows lift its mean at 64.
    assert set(beside_throughput) == set(alone_throughput) == {64, 128}
    assert beside_throughput[64] > alone_throughput[64]


def test_the_range_of_grow_gain_is_said_as_it_is_and_numpy_floats_are_numbers() -> None:
    """grow_gain=10 said "must be from 0 to 10 ..., got 10": 10 is refused, so the range is [0, 10)."""
    with pytest.raises(ValueError, match=r"grow_gain must be at least 0 and below 10 \(0 <= grow_gain < 10\).*got 10$"):
        koila.batch(grow=True, grow_gain=10)
    np = pytest.importorskip("numpy")
    sizes = {}
    for gain in (np.float32(0.03), 0.03):
        clock = Clock()
        work, tried = worker(clock, lambda rows: 0.125 + rows / 128, fail_first_at=64)
        run = koila.batch(initial=64, grow=True, grow_after=1, grow_gain=gain, clock=clock)(work)
        for _ in range(5):
            run()
        sizes[type(gain)] = tried
    assert sizes[np.float32] == sizes[float]  # the same decisions as the Python float it reads as


def test_a_fraction_is_a_number_for_grow_gain_and_scaled() -> None:
    # float(str(Fraction(3, 100))) raised "could not convert string to float: '3/100'".
    assert koila.batch(initial=8, grow=True, grow_gain=fractions.Fraction(3, 100))(lambda size: size)() == 8
    assert koila.scaled(fractions.Fraction(1, 2))(100) == 50
