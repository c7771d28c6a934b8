"""The engine's controller when each call brings its own first size (``initial=None``)."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

from koila_retry import NoCache, StackMemoryCache
from koila_retry._core.engine import Attempt, Call, Controller
from koila_retry._core.policy import Policy
from koila_retry.testing import make_oom

CPU = torch.device("cpu")


def _function() -> None:
    """What the cache keys name in these tests."""


def start(controller: Controller, rows: int) -> Attempt:
    return controller.start(Call(_function, sys._getframe(), CPU, rows=rows))


def run(controller: Controller, rows: int, fits: int) -> int:
    """Make one call over ``rows`` that runs out of memory above ``fits`` rows; return the size used."""
    attempt = start(controller, rows)
    while True:
        size = attempt.batch_size
        if size > rows:
            attempt.narrow(rows)
        with attempt:
            if min(size, rows) > fits:
                raise make_oom()
            return min(size, rows)
        attempt.retry()


def test_without_initial_a_call_starts_at_its_rows() -> None:
    controller = Controller("step", Policy(initial=None, cache=StackMemoryCache()))
    assert controller.stats.batch_size == 0  # no attempt yet
    assert start(controller, 1000).batch_size == 1000
    assert start(controller, 7).batch_size == 7


def test_without_initial_a_call_below_minimum_starts_at_minimum() -> None:
    controller = Controller("step", Policy(initial=None, minimum=16, cache=StackMemoryCache()))
    assert start(controller, 5).batch_size == 16


def test_success_at_the_rows_stores_nothing() -> None:
    cache = StackMemoryCache()
    controller = Controller("step", Policy(initial=None, cache=cache))
    for _ in range(2):
        assert run(controller, 1000, fits=1000) == 1000
    assert cache.cache_info().currsize == 0


def test_a_reduced_size_is_stored_and_used_by_larger_and_smaller_calls() -> None:
    cache = StackMemoryCache()
    controller = Controller("step", Policy(initial=None, cache=cache))
    assert run(controller, 1000, fits=600) == 512
    assert cache.cache_info().currsize == 1
    ooms = controller.stats.ooms
    # A smaller batch runs whole, as a short step: nothing stored, nothing lost.
    assert run(controller, 200, fits=600) == 200
    assert start(controller, 200).batch_size == 512  # above its rows: the front end narrows
    # A larger batch starts at the stored size instead of its own rows.
    assert run(controller, 4000, fits=600) == 512
    assert controller.stats.ooms == ooms
    assert list(cache.values()) == [512]


def test_a_short_call_that_fails_goes_below_its_rows() -> None:
    controller = Controller("step", Policy(initial=None, cache=StackMemoryCache()))
    assert run(controller, 1000, fits=600) == 512
    assert run(controller, 300, fits=200) == 128  # 300 fails, so 256 is next, which fails too
    assert start(controller, 1000).batch_size == 128


def test_growing_back_stores_a_probe_that_covers_the_whole_call() -> None:
    cache = StackMemoryCache()
    controller = Controller("step", Policy(initial=None, cache=cache, grow=True, grow_after=2))
    assert run(controller, 512, fits=300) == 256  # the first success at 256
    assert run(controller, 512, fits=1000) == 256  # the second: growing is due
    # The probe is 512, the call's rows: they fit, and are stored as a size that worked. Forgotten
    # (as they were), a later call with more rows started from its whole and failed down again.
    assert run(controller, 512, fits=1000) == 512
    assert list(cache.values()) == [512]
    assert start(controller, 2000).batch_size == 512


def test_a_probe_above_a_calls_rows_proves_nothing_and_keeps_the_stored_size() -> None:
    cache = StackMemoryCache()
    controller = Controller("step", Policy(initial=None, cache=cache, grow=True, grow_after=1))
    assert run(controller, 256, fits=100) == 64
    # The probe (128) is above this short call's 100 rows: they run whole, which says
    # nothing about 128 rows, so 64 stays stored and the probe is made again.
    assert run(controller, 100, fits=1000) == 100
    assert list(cache.values()) == [64]
    ooms = controller.stats.ooms
    assert run(controller, 256, fits=100) == 64  # 128 is probed, fails, and falls back
    assert controller.stats.ooms == ooms + 1
    assert list(cache.values()) == [64]


def test_initial_none_skips_the_minimum_check_that_an_int_initial_gets() -> None:
    Controller("step", Policy(initial=None, minimum=64, cache=NoCache()))
    with pytest.raises(ValueError, match=r"minimum \(64\) must not exceed initial \(8\)"):
        Controller("step", Policy(initial=8, minimum=64, cache=NoCache()))


# --------------------------------------------------------------------------- the counters in stats


def test_exhausted_counts_the_calls_that_gave_up_and_not_a_schedules_error() -> None:
    """As Stats documents it: BatchSizeExhausted, and an iterator argument's TypeError; not a schedule's error."""
    import koila_retry as koila

    ended: list[str] = []

    def refusing(failed: int) -> int:
        raise ValueError(f"no size after {failed}")

    raised: dict[str, int] = {"plain": 0, "scheduled": 0}

    def counting(name: str) -> Any:
        def total(batch_size: int, numbers: object) -> int:
            for _ in numbers:  # type: ignore[attr-defined]
                if batch_size > 2:
                    raised[name] += 1
                    raise make_oom()
            return batch_size

        return total

    plain = koila.batch(initial=8, minimum=4, cache=NoCache())(counting("plain"))
    scheduled = koila.batch(initial=8, schedule=refusing, cache=NoCache())(counting("scheduled"))
    # An iterator argument gives up with a TypeError; a list, with BatchSizeExhausted at the minimum.
    for wrapped, numbers in ((plain, iter([1, 2])), (plain, [1, 2]), (scheduled, [3]), (plain, [4])):
        try:
            wrapped(numbers)
        except (TypeError, ValueError, koila.BatchSizeExhausted) as error:
            ended.append(type(error).__name__)
    assert ended == ["TypeError", "BatchSizeExhausted", "ValueError", "BatchSizeExhausted"]
    assert plain.stats.exhausted == ended.count("TypeError") + ended.count("BatchSizeExhausted")
    assert plain.stats.ooms == raised["plain"]
    assert scheduled.stats.exhausted == 0
    assert scheduled.stats.ooms == raised["scheduled"] == 1  # the OOM the schedule's error followed counts
