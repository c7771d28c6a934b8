"""Growing back (grow=True, grow_after=...): the schedule of probes, for @koila.batch and koila.attempts."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

import koila_retry as koila
from koila_retry.testing import make_oom, simulated_device

# Calls and what each of them tried, in order: [[512, 256, 128, 64], [64], [128, 64], ...].
Call = Callable[[], list[int]]


class Budget:
    """A mock device: sizes above ``limit`` run out of memory; raise ``limit`` to free memory."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.ooms = 0

    def use(self, size: int) -> None:
        if size > self.limit:
            self.ooms += 1
            raise make_oom()


def batch_calls(budget: Budget, cache: koila.SizeCache | None, **options: Any) -> Call:
    tried: list[int] = []

    @koila.batch(cache=cache, **options)
    def step(batch_size: int) -> int:
        tried.append(batch_size)
        budget.use(batch_size)
        return batch_size

    def call() -> list[int]:
        tried.clear()
        assert step() == tried[-1]  # the same line every time: one call site
        return list(tried)

    return call


def attempts_calls(budget: Budget, cache: koila.SizeCache | None, **options: Any) -> Call:
    if cache is not None:
        options["cache"] = cache

    def call() -> list[int]:
        tried: list[int] = []
        # A new Controller on every run of the block: what it knows of growing lives in the cache.
        for attempt in koila.attempts(**options):
            with attempt:
                tried.append(attempt.batch_size)
                budget.use(attempt.batch_size)
        return tried

    return call


FRONT_ENDS: dict[str, Callable[..., Call]] = {"batch": batch_calls, "attempts": attempts_calls}


@pytest.fixture(params=sorted(FRONT_ENDS))
def calls(request: pytest.FixtureRequest) -> Callable[..., Call]:
    return FRONT_ENDS[str(request.param)]


def run(call: Call, times: int) -> list[list[int]]:
    return [call() for _ in range(times)]


def at(size: int, times: int) -> list[list[int]]:
    """``times`` calls that each ran once, at ``size``."""
    return [[size]] * times


# -- the schedule, with a mock out-of-memory threshold ----------------------------------------
# GlobalCache: one key per function (or block), whatever the free memory. The default
# StackMemoryCache puts a free-memory bucket in the key; see the real-allocation tests below.


def test_failed_probes_go_back_down_and_double_the_wait(calls: Callable[..., Call]) -> None:
    budget = Budget(64)
    call = calls(budget, koila.GlobalCache(), initial=512, grow=True, grow_after=3)
    assert call() == [512, 256, 128, 64]  # the reduction; its success is the first of 3 in a row
    history = run(call, 2 + 1 + 5 + 1 + 11 + 1)
    assert history == [
        *at(64, 2),
        [128, 64],  # 3 successes in a row at 64: probe 128, which fails, and go back to 64
        *at(64, 5),  # the probe's own success at 64 counts: 6 in a row before the next probe
        [128, 64],
        *at(64, 11),  # failed again: the wait doubles again, to 12
        [128, 64],
    ]
    assert budget.ooms == 3 + 3  # the reduction, then one per probe


def test_size_climbs_one_step_per_grow_after_successes_once_memory_is_free(calls: Callable[..., Call]) -> None:
    budget = Budget(64)
    call = calls(budget, koila.GlobalCache(), initial=512, grow=True, grow_after=3)
    assert call() == [512, 256, 128, 64]
    budget.limit = 512  # memory is available again
    history = run(call, 2 + 1 + 2 + 1 + 2 + 1 + 10)
    assert history == [*at(64, 2), [128], *at(128, 2), [256], *at(256, 2), [512], *at(512, 10)]
    assert budget.ooms == 3


def test_after_backing_off_a_successful_probe_resets_the_wait(calls: Callable[..., Call]) -> None:
    budget = Budget(64)
    call = calls(budget, koila.GlobalCache(), initial=512, grow=True, grow_after=3)
    call()
    assert run(call, 3) == [*at(64, 2), [128, 64]]  # the wait is 6 now
    budget.limit = 512
    history = run(call, 5 + 1 + 2 + 1 + 2 + 1 + 3)
    assert history == [*at(64, 5), [128], *at(128, 2), [256], *at(256, 2), [512], *at(512, 3)]


def test_a_non_power_of_two_initial_is_the_top_probe(calls: Callable[..., Call]) -> None:
    budget = Budget(64)
    call = calls(budget, koila.GlobalCache(), initial=500, grow=True, grow_after=3)
    assert call() == [500, 256, 128, 64]
    budget.limit = 500
    history = run(call, 2 + 1 + 2 + 1 + 2 + 1 + 5)
    assert history == [*at(64, 2), [128], *at(128, 2), [256], *at(256, 2), [500], *at(500, 5)]


def test_probes_never_exceed_initial_and_back_off_at_the_top(calls: Callable[..., Call]) -> None:
    budget = Budget(300)  # 256 fits, initial (500) does not
    call = calls(budget, koila.GlobalCache(), initial=500, grow=True, grow_after=3)
    assert call() == [500, 256]
    history = run(call, 2 + 1 + 5 + 1)
    assert history == [*at(256, 2), [500, 256], *at(256, 5), [500, 256]]
    assert max(size for sizes in history for size in sizes) == 500


def test_default_grow_after_is_50(calls: Callable[..., Call]) -> None:
    budget = Budget(64)
    call = calls(budget, koila.GlobalCache(), initial=512, grow=True)
    call()
    budget.limit = 512
    assert run(call, 50) == [*at(64, 49), [128]]


@pytest.mark.parametrize("options", [{}, {"grow": False}], ids=["default", "grow=False"])
def test_without_grow_the_size_never_grows(calls: Callable[..., Call], options: dict[str, Any]) -> None:
    budget = Budget(64)
    call = calls(budget, koila.GlobalCache(), initial=512, **options)
    assert call() == [512, 256, 128, 64]
    budget.limit = 512
    assert run(call, 120) == at(64, 120)


def test_growth_state_outlives_each_attempts_controller() -> None:
    # koila.attempts makes a Controller (and its Stats) per run of the block: the
    # streak towards the next probe is kept in the cache, here the default shared one.
    # A simulated device fixes the free memory that the default cache's key holds.
    budget = Budget(64)
    stats: list[koila.Stats] = []

    def call() -> list[int]:
        tried: list[int] = []
        for attempt in koila.attempts(initial=512, grow=True, grow_after=3):
            with attempt:
                tried.append(attempt.batch_size)
                budget.use(attempt.batch_size)
        stats.append(attempt.stats)
        return tried

    with simulated_device("1GiB"):
        history = run(call, 1 + 2 + 1 + 5 + 1)
    assert history == [[512, 256, 128, 64], *at(64, 2), [128, 64], *at(64, 5), [128, 64]]
    assert len({id(each) for each in stats}) == len(stats)  # a controller per run
    assert [each.calls for each in stats] == [1] * len(stats)


def test_cache_clear_forgets_growth_state(calls: Callable[..., Call]) -> None:
    budget = Budget(64)
    cache = koila.GlobalCache()
    call = calls(budget, cache, initial=512, grow=True, grow_after=3)
    call()
    assert run(call, 3) == [*at(64, 2), [128, 64]]  # a failed probe: the wait is 6 now
    cache.cache_clear()
    assert call() == [512, 256, 128, 64]  # the size is forgotten ...
    assert run(call, 3) == [*at(64, 2), [128, 64]]  # ... and so is the doubled wait: 3 again


def test_batch_cache_clear_forgets_growth_state() -> None:
    budget = Budget(64)
    tried: list[int] = []

    @koila.batch(initial=512, grow=True, grow_after=2, cache=koila.GlobalCache())
    def step(batch_size: int) -> None:
        tried.append(batch_size)
        budget.use(batch_size)

    for _ in range(3):  # reduce, succeed, probe and fail: the wait is 4
        step()
    assert tried == [512, 256, 128, 64, 64, 128, 64]
    step.cache_clear()
    tried.clear()
    for _ in range(3):
        step()
    assert tried == [512, 256, 128, 64, 64, 128, 64]  # probed after 2 again, not 4


def test_a_probe_is_logged_at_info_with_the_new_size(caplog: pytest.LogCaptureFixture) -> None:
    budget = Budget(64)
    call = batch_calls(budget, koila.GlobalCache(), initial=512, grow=True, grow_after=3)
    with caplog.at_level(logging.INFO, logger="koila_retry"):
        run(call, 3)
        assert not [record for record in caplog.records if "; trying " in record.getMessage()]
        caplog.clear()
        assert call() == [128, 64]
    probes = [record for record in caplog.records if "; trying " in record.getMessage()]
    assert len(probes) == 1
    (probe,) = probes
    assert probe.name == "koila_retry"
    assert probe.levelno == logging.INFO
    message = probe.getMessage()
    assert "step" in message
    assert "batch size 64" in message
    assert message.endswith("trying 128")


def test_a_failed_probe_never_fails_the_call_under_max_attempts() -> None:
    budget = Budget(64)
    cache = koila.GlobalCache()
    tried: list[int] = []

    def step(batch_size: int) -> int:
        tried.append(batch_size)
        budget.use(batch_size)
        return batch_size

    cache[step] = 64  # remembered from earlier (a DiskCache from the last run, say)
    wrapped = koila.batch(initial=512, max_attempts=1, grow=True, grow_after=1, cache=cache)(step)
    assert wrapped() == 64
    assert wrapped() == 64  # the probe at 128 fails; 64 is known to fit


# -- real allocations under a simulated device ---------------------------------------------

ROW_FLOATS = 256  # one row of float32: 1 KiB
ROW_BYTES = ROW_FLOATS * 4
LIMIT = 2**20  # 1 MiB: 512 rows and their sum fit on an empty device


def _allocating_step(tried: list[int], **options: Any) -> Callable[[], float]:
    @koila.batch(initial=512, grow=True, grow_after=2, **options)
    def step(batch_size: int) -> float:
        tried.append(batch_size)
        rows = torch.ones(batch_size, ROW_FLOATS)  # batch_size KiB, really allocated
        return float(rows.sum())

    return step


def _hold_all_but(free_rows: int) -> torch.Tensor:
    """Allocate, inside the active simulated device, all but ``free_rows`` rows and a little slack."""
    return torch.empty((LIMIT - free_rows * ROW_BYTES - ROW_BYTES) // 4)


def test_real_memory_freed_after_a_reduction_climbs_back_on_schedule() -> None:
    # GlobalCache: the default cache's key holds the free-memory bucket, so freeing memory
    # would change the key (and start afresh) instead of following the growth schedule.
    tried: list[int] = []
    step = _allocating_step(tried, cache=koila.GlobalCache())
    per_call: list[list[int]] = []
    ooms: list[int] = []

    def call() -> None:
        tried.clear()
        assert step() == tried[-1] * ROW_FLOATS
        per_call.append(list(tried))
        ooms.append(step.stats.ooms)

    with simulated_device(LIMIT) as device:
        held = _hold_all_but(64)  # allocated inside the device, held outside the function
        for _ in range(1 + 1 + 1 + 3 + 1):
            call()
        # Memory still short: each probe costs one OOM, and the wait doubles (2, 4; 8 below).
        assert per_call == [[512, 256, 128, 64], [64], [128, 64], [64], [64], [64], [128, 64]]
        assert ooms == [3, 3, 4, 4, 4, 4, 5]
        del held
        assert device.live == 0
        per_call.clear()
        for _ in range(7 + 1 + 1 + 1 + 1 + 1 + 3):
            call()
    assert per_call == [*at(64, 7), [128], *at(128, 1), [256], *at(256, 1), [512], *at(512, 3)]
    assert ooms[-1] == 5  # climbing back cost no OOM


def test_real_memory_with_the_default_cache_starts_afresh_once_freed() -> None:
    # What actually happens with the default StackMemoryCache: while memory is short the
    # key is the same and probes follow the schedule; freeing memory moves the free-memory
    # bucket of the key up, the new key has no size (the fallback only looks at buckets
    # with more memory), so the next call starts at `initial` at once, without waiting.
    # Shorting memory again returns to the old key, whose size (and streak) is remembered.
    tried: list[int] = []
    step = _allocating_step(tried)
    per_call: list[list[int]] = []

    def call() -> None:
        tried.clear()
        step()
        per_call.append(list(tried))

    with simulated_device(LIMIT):
        held = _hold_all_but(64)
        for _ in range(3):
            call()
        assert per_call == [[512, 256, 128, 64], [64], [128, 64]]
        del held
        call()
        assert per_call[-1] == [512]
        held = _hold_all_but(64)
        call()
        call()
        del held
    assert per_call[-2:] == [[64], [64]]  # the old key: its size, and its doubled wait (4) not reached yet
    assert step.cache_info().currsize == 1  # the new key's success at initial stored nothing


# -- validation ------------------------------------------------------------------------------


def _decorated(batch_size: int) -> int:
    return batch_size


def _apply(front_end: str, **options: Any) -> object:
    if front_end == "batch":
        return koila.batch(**options)(_decorated)
    if front_end == "attempts":
        return koila.attempts(**options)
    if front_end == "chunked":
        return koila.chunked(lambda rows: rows, torch.ones(4, 2), **options)
    if front_end == "chunked decorator":
        return koila.chunked(**options)(lambda rows: rows)
    if front_end == "range":
        return koila.range(lambda begin, end: end - begin, 0, 4, **options)
    assert front_end == "range decorator"
    return koila.range(**options)(lambda begin, end: end - begin)


ALL_FRONT_ENDS = ["batch", "attempts", "chunked", "chunked decorator", "range", "range decorator"]


@pytest.mark.parametrize("front_end", ALL_FRONT_ENDS)
@pytest.mark.parametrize("value", [1, 0, "yes", None])
def test_grow_must_be_a_bool(front_end: str, value: object) -> None:
    message = f"grow must be a bool, got {type(value).__name__} {value!r}"
    with pytest.raises(TypeError, match=re.escape(message)):
        _apply(front_end, grow=value)


@pytest.mark.parametrize("front_end", ALL_FRONT_ENDS)
@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (0, ValueError, "grow_after must be >= 1, got 0"),
        (-3, ValueError, "grow_after must be >= 1, got -3"),
        (2.5, TypeError, "grow_after must be an int, got float 2.5"),
        (True, TypeError, "grow_after must be an int, got bool True"),
        ("50", TypeError, "grow_after must be an int, got str '50'"),
    ],
)
def test_grow_after_must_be_a_positive_int(front_end: str, value: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        _apply(front_end, grow=True, grow_after=value)


@pytest.mark.parametrize("front_end", ALL_FRONT_ENDS)
@pytest.mark.parametrize(
    "options",
    [
        {"grow_after": 1},
        {"grow_gain": 0.05},
        {"clock": lambda: 0.0},
        {"grow": False, "grow_after": 50},  # the default's value, given: still an option that would do nothing
        {"grow_gain": 0.05, "grow_after": 1, "clock": lambda: 0.0},
    ],
    ids=["grow_after", "grow_gain", "clock", "grow=False", "all three"],
)
def test_an_option_of_growing_without_grow_is_refused(front_end: str, options: dict[str, Any]) -> None:
    """They were taken and did nothing, where snapshot_each_oom without snapshot= is refused."""
    first = next(name for name in ("grow_after", "grow_gain", "clock") if name in options)
    with pytest.raises(ValueError, match=rf"got {first}=.* without grow=True: .* Give grow=True too, or leave {first}"):
        _apply(front_end, **options)
    # The same with grow=True is taken, and grow_gain=None, the default, alone too.
    assert _apply(front_end, **{**options, "grow": True}) is not None
    assert _apply(front_end, grow_gain=None) is not None


def test_grow_gain_without_grow_never_grew_and_is_now_refused_before_any_call() -> None:
    """What the probe saw: grow_gain and grow_after alone let a call stay at its reduced size for good."""
    budget = Budget(64)
    growing = batch_calls(budget, koila.GlobalCache(), initial=256, grow=True, grow_gain=0.05, grow_after=1)
    assert growing() == [256, 128, 64]
    budget.limit = 1000
    assert max(size for sizes in run(growing, 5) for size in sizes) > 64  # with grow=True it grows back
    with pytest.raises(ValueError, match="without grow=True"):
        batch_calls(budget, koila.GlobalCache(), initial=256, grow_gain=0.05, grow_after=1)


@pytest.mark.parametrize("front_end", ALL_FRONT_ENDS)
def test_valid_grow_options_are_accepted(front_end: str) -> None:
    assert _apply(front_end, grow=True, grow_after=1) is not None


def test_growing_back_follows_the_schedule() -> None:
    budget = Budget(limit=100)
    call = batch_calls(
        budget, koila.StackMemoryCache(), initial=128, schedule=koila.scaled(0.9), grow=True, grow_after=1
    )
    assert call() == [128, 115, 103, 92]
    # scaled(0.9) grows back by its own steps: 103, the smallest size it shrinks to 92, not 128.
    assert call() == [103, 92]
    assert call() == [92]  # the wait doubled after the failed probe
    assert call() == [103, 92]
    budget.limit = 1000
    assert [call() for _ in range(3)] == [[92]] * 3  # and doubled again
    assert [call() for _ in range(4)] == [[103], [115], [128], [128]]  # never above initial


def test_a_plain_schedule_grows_to_the_next_power_of_two() -> None:
    budget = Budget(limit=100)
    call = batch_calls(
        budget, koila.StackMemoryCache(), initial=256, schedule=lambda n: n - 30, grow=True, grow_after=1
    )
    assert call() == [256, 226, 196, 166, 136, 106, 76]
    budget.limit = 1000
    assert call() == [128]  # the next power of two above 76, where the schedule shrank by 30
    assert call() == [256]


def test_a_schedules_grow_that_does_not_grow_is_named_by_the_function() -> None:
    """Raised as a later call starts, it did not say which function's schedule it was."""

    class Halves:
        def __call__(self, failed: int) -> int | None:
            return failed // 2 or None

        def grow(self, size: int) -> int:
            return size  # not above it

    @koila.batch(initial=64, schedule=Halves(), grow=True, grow_after=1, cache=koila.GlobalCache())
    def step(batch_size: int) -> int:
        if batch_size > 16:
            raise make_oom()
        return batch_size

    assert step() == 16
    with pytest.raises(ValueError, match=r"\.step: the schedule.s grow returned 16 for batch size 16"):
        step()


def test_a_growth_probe_on_the_calls_own_rows_is_stored_not_forgotten() -> None:
    """initial=None: a probe that landed on a pass's 512 rows and fitted forgot the key, and the next pass of 1024
    rows started from its whole again, where the docs store a probe that fits as any size that worked."""
    row = 64 * 1024  # float32 elements: 256 KiB a row
    tried: list[int] = []

    def double(chunk: torch.Tensor) -> torch.Tensor:
        tried.append(len(chunk))
        torch.empty(len(chunk), row)
        return chunk * 2

    cache = koila.GlobalCache()
    passes = []
    for rows, fit in ((1024, 300), (512, 600), (1024, 600)):
        tried.clear()
        x = torch.arange(float(rows)).unsqueeze(1)
        with simulated_device(fit * row * 4 + row):  # fit rows fit, one more does not
            out = koila.chunked(double, x, initial=None, grow=True, grow_after=3, cache=cache)
        assert torch.equal(out, x * 2)
        passes.append((list(tried), list(cache.values())))
    assert passes[0] == ([1024, 512, 256, 256, 256, 256], [256])
    assert passes[1] == ([512], [512])  # the probe, on all 512 rows, fitted: stored as any size that worked
    assert passes[2] == ([512, 512], [512])  # and the next pass starts there, not at its 1024 rows


def test_a_numpy_bool_for_grow_is_refused_naming_numpy_and_numpy_ints_count_as_grow_after() -> None:
    """grow=np.bool_(True) said "grow must be a bool, got bool np.True_": a bool, it seemed."""
    np = pytest.importorskip("numpy")
    with pytest.raises(
        TypeError, match=r"grow must be a bool, got numpy\.bool_? .*: give a Python bool, True or False"
    ):
        koila.batch(grow=np.bool_(True))
    budget = Budget(limit=64)
    call = batch_calls(budget, koila.GlobalCache(), initial=128, grow=True, grow_after=np.int64(2))
    plain = batch_calls(Budget(limit=64), koila.GlobalCache(), initial=128, grow=True, grow_after=2)
    assert run(call, 6) == run(plain, 6)  # as the int it holds


class _Halves:
    def __call__(self, failed: int) -> int | None:
        return failed // 2 or None


class _GrowsNot(_Halves):
    grow = 5


class _GrowsWithout(_Halves):
    def grow(self) -> int:
        return 64


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        (_GrowsNot(), r"schedule.grow must be callable, given the size that fitted, got int 5"),
        (_GrowsWithout(), r"schedule.grow .*the size that fitted, one int"),
    ],
)
def test_a_schedules_grow_that_cannot_be_called_is_refused_when_decorating(schedule: Any, message: str) -> None:
    # It was first called after an OOM and grow_after successes, hours into a run, with Python's own error.
    with pytest.raises(TypeError, match=message):
        koila.batch(initial=64, schedule=schedule, grow=True, grow_after=1)
    koila.batch(initial=64, schedule=schedule)  # not called without grow=True: not looked at
