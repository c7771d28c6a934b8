"""The size schedule: powers of two after an OOM, never below the minimum, always ending."""

from __future__ import annotations

import itertools
import re
import traceback
import weakref
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import koila_retry as koila
from koila_retry._core import decision, memory
from koila_retry._core.engine import Call, Controller
from koila_retry._core.policy import Policy
from koila_retry.testing import make_oom, oom_above

# The same patch holds for every example, so a function-scoped fixture is safe here.
properties = settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(autouse=True)
def _no_release(monkeypatch: pytest.MonkeyPatch) -> None:
    """Skip the full garbage collection after each OOM: these tests are about sizes only."""
    monkeypatch.setattr(memory, "release", lambda device=None: None)


def schedule(initial: int, minimum: int) -> list[int]:
    """Every size tried when nothing fits, by running the engine."""
    tried: list[int] = []

    @koila.batch(initial=initial, minimum=minimum, cache=koila.NoCache())
    def never_fits(batch_size: int) -> None:
        tried.append(batch_size)
        raise koila.testing.make_oom()

    with pytest.raises(koila.BatchSizeExhausted):
        never_fits()
    return tried


def next_batch_size(failed: int, minimum: int) -> int | None:
    """The size the default policy tries after ``failed`` ran out of memory."""
    step = decision.shrink(decision.Rules("f", None, minimum), failed, 1, minimum)
    return step.size if isinstance(step, decision.Try) else None


@pytest.mark.parametrize(
    ("failed", "expected"),
    [(500, 256), (512, 256), (513, 512), (256, 128), (3, 2), (2, 1), (1000, 512), (1025, 1024)],
)
def test_next_size_is_largest_power_of_two_below(failed: int, expected: int) -> None:
    assert next_batch_size(failed, 1) == expected


def test_next_size_respects_minimum() -> None:
    assert next_batch_size(64, 48) == 48
    assert next_batch_size(48, 48) is None
    assert next_batch_size(1, 1) is None


def test_schedule_from_500() -> None:
    assert schedule(500, 1) == [500, 256, 128, 64, 32, 16, 8, 4, 2, 1]


def test_schedule_stops_at_minimum() -> None:
    assert schedule(500, 100) == [500, 256, 128, 100]


@properties
@given(initial=st.integers(1, 2**20), minimum=st.integers(1, 2**20))
def test_schedule_properties(initial: int, minimum: int) -> None:
    if minimum > initial:
        initial, minimum = minimum, initial
    tried = schedule(initial, minimum)
    assert tried[0] == initial
    assert tried[-1] == minimum
    assert all(later < earlier for earlier, later in itertools.pairwise(tried))  # strictly decreasing
    assert all(size >= minimum for size in tried)
    # After the first OOM, every size is a power of two, or the minimum it was raised to.
    assert all(size & (size - 1) == 0 or size == minimum for size in tried[1:])
    assert len(tried) <= initial.bit_length() + 1  # terminates quickly


@properties
@given(initial=st.integers(1, 2**16), fits=st.integers(0, 2**16), minimum=st.integers(1, 64))
def test_settles_on_largest_power_of_two_that_fits(initial: int, fits: int, minimum: int) -> None:
    minimum = min(minimum, initial)
    inject = oom_above(fits)

    @koila.batch(initial=initial, minimum=minimum, cache=koila.NoCache())
    def run(batch_size: int) -> int:
        inject(batch_size)
        return batch_size

    if fits < minimum:
        with pytest.raises(koila.BatchSizeExhausted):
            run()
        return
    size = run()
    if initial <= fits:
        assert size == initial
    else:
        assert size <= fits
        assert size == minimum or size * 2 > fits or size * 2 >= initial
        assert size & (size - 1) == 0 or size == minimum


@properties
@given(max_attempts=st.integers(1, 12))
def test_max_attempts_bounds_the_attempts(max_attempts: int) -> None:
    calls: list[int] = []

    @koila.batch(initial=4096, max_attempts=max_attempts, cache=koila.NoCache())
    def never_fits(batch_size: int) -> None:
        calls.append(batch_size)
        raise koila.testing.make_oom()

    with pytest.raises(koila.BatchSizeExhausted) as excinfo:
        never_fits()
    assert len(calls) == max_attempts
    assert excinfo.value.attempts == max_attempts
    assert excinfo.value.batch_size == calls[-1]


# --------------------------------------------------------------------------- a schedule of the caller's


def run_with_schedule(schedule: object, initial: int = 100, minimum: int = 1, fits: int = 0) -> list[int]:
    """Every size a call of the engine tries with ``schedule``, until one fits or it gives up."""
    policy = Policy(initial=initial, minimum=minimum, cache=koila.NoCache(), schedule=schedule)  # type: ignore[arg-type]
    controller = Controller("f", policy)
    tried: list[int] = []
    for attempt in controller.start(Call("f", None, memory.resolve_device("cpu"))):
        with attempt:
            tried.append(attempt.batch_size)
            if attempt.batch_size > fits:
                raise koila.testing.make_oom()
    return tried


def test_a_schedule_decides_every_next_size() -> None:
    assert run_with_schedule(lambda failed: failed // 2, fits=10) == [100, 50, 25, 12, 6]


def test_a_schedule_is_not_asked_at_the_minimum() -> None:
    asked: list[int] = []

    def halve(failed: int) -> int:
        asked.append(failed)
        return max(failed // 2, 1)

    with pytest.raises(koila.BatchSizeExhausted, match=r"\(100 -> 50 -> 25 -> 12\)"):
        run_with_schedule(halve, minimum=12)
    assert asked == [100, 50, 25]


def test_a_schedule_that_returns_none_gives_up() -> None:
    with pytest.raises(koila.BatchSizeExhausted, match=r"\(100\)"):
        run_with_schedule(lambda failed: None)


@pytest.mark.parametrize("returned", [100, 101, 0, -3, 7.5, True, "50"])
def test_a_schedule_must_shrink_within_the_range(returned: object) -> None:
    with pytest.raises(ValueError, match=rf"the schedule returned {returned!r} after batch size 100 .* from 1"):
        run_with_schedule(lambda failed: returned)


@pytest.mark.parametrize(("minimum", "told"), [(1, "from 1 to 99, or None"), (4, "(raised to the minimum, 4,")])
def test_a_schedules_bad_size_says_what_it_may_return(minimum: int, told: str) -> None:
    # With minimum=1 it said "from 1 to 99 (raised to the minimum, 1, if below it)": a 0 would be raised.
    with pytest.raises(ValueError, match="the schedule returned 0") as caught:
        run_with_schedule(lambda failed: 0, minimum=minimum)
    assert told in str(caught.value)
    assert ("raised to the minimum" in str(caught.value)) == (minimum > 1)


@pytest.mark.parametrize("front_end", ["batch", "attempts"])
def test_a_schedules_bad_size_is_raised_without_the_failed_attempt_and_its_tensors(front_end: str) -> None:
    """Raised in the handler, the ValueError kept the out-of-memory error, its frames and their tensors."""
    from koila_retry.testing import simulated_device

    refs: list[weakref.ref[torch.Tensor]] = []

    def work(size: int) -> int:
        activations = torch.ones(size, 4096)  # 1 MiB at 64 rows
        refs.append(weakref.ref(activations))
        torch.ones(size, 8192)  # over the limit: a real out-of-memory error
        return size

    def run() -> None:
        if front_end == "batch":
            koila.batch(initial=64, schedule=lambda failed: failed, cache=koila.NoCache())(work)()
            return
        for attempt in koila.attempts(initial=64, schedule=lambda failed: failed, cache=koila.NoCache()):
            with attempt:
                work(attempt.batch_size)

    with simulated_device("1536KiB"), pytest.raises(ValueError, match="the schedule returned 64") as caught:
        run()
    assert caught.value.__context__ is None
    assert caught.value.__cause__ is None
    assert [ref() for ref in refs] == [None]


@pytest.mark.parametrize("front_end", ["batch", "attempts", "accumulate"])
def test_an_error_of_the_schedules_own_is_raised_without_the_failed_attempt_and_its_tensors(front_end: str) -> None:
    """A schedule's own bug (not a bad size) raised in the handler: it kept the failed attempt alive too."""
    import sys

    from koila_retry.testing import simulated_device

    refs: list[weakref.ref[torch.Tensor]] = []

    def work(size: int) -> torch.Tensor:
        activations = torch.ones(size, 4096)  # 1 MiB at 64 rows
        refs.append(weakref.ref(activations))
        torch.ones(size, 8192)  # over the limit: a real out-of-memory error
        return activations.sum()

    def broken(failed: int) -> int:
        return failed // 0

    weight = torch.ones(1, requires_grad=True)

    def run() -> None:
        if front_end == "batch":
            koila.batch(initial=64, schedule=broken, cache=koila.NoCache())(work)()
        elif front_end == "accumulate":
            koila.accumulate(initial=64, schedule=broken, cache=koila.NoCache())(lambda rows: work(len(rows)) * weight)(
                torch.ones(64, 1)
            )
        else:
            for attempt in koila.attempts(initial=64, schedule=broken, cache=koila.NoCache()):
                with attempt:
                    work(attempt.batch_size)

    with simulated_device("1536KiB") as device, pytest.raises(ZeroDivisionError) as caught:
        run()
    assert caught.value.__context__ is None
    assert [ref() for ref in refs] == [None]
    assert device.live == 0  # nothing of the attempt, while the error is held
    if sys.version_info >= (3, 11):
        assert any("raised by the schedule= function" in note for note in caught.value.__notes__)
    assert "broken" in [frame.name for frame in traceback.extract_tb(caught.value.__traceback__)]
    assert weight.grad is None


@pytest.mark.parametrize("front_end", ["batch", "attempts"])
def test_a_value_error_of_the_schedules_own_keeps_its_frames_and_note_and_the_oom_is_counted(front_end: str) -> None:
    """The user's ValueError was taken for the engine's check: no note, no frame of the schedule, and the
    out-of-memory error it followed was neither counted in stats.ooms nor told to on_oom."""
    import sys

    from koila_retry.testing import simulated_device

    refs: list[weakref.ref[torch.Tensor]] = []
    ran_out: list[int] = []
    events: list[koila.OOMEvent] = []

    def work(size: int) -> int:
        activations = torch.ones(size, 4096)  # 1 MiB at 64 rows
        refs.append(weakref.ref(activations))
        try:
            torch.ones(size, 8192)  # over the limit at 32 rows and more: a real out-of-memory error
        except torch.OutOfMemoryError:
            ran_out.append(size)
            raise
        return size

    def refusing(failed: int) -> int:
        if failed < 64:
            raise ValueError(f"my schedule refuses {failed}")
        return failed // 2

    options: dict[str, Any] = {"initial": 64, "schedule": refusing, "on_oom": events.append, "cache": koila.NoCache()}
    stats: list[koila.Stats] = []

    def run() -> None:
        if front_end == "batch":
            wrapped = koila.batch(**options)(work)
            stats.append(wrapped.stats)
            wrapped()
            return
        for attempt in koila.attempts(**options):
            stats[:] = [attempt.stats]
            with attempt:
                work(attempt.batch_size)

    with simulated_device("1280KiB") as device, pytest.raises(ValueError, match="my schedule refuses 32") as caught:
        run()
    assert [ref() for ref in refs] == [None, None]
    assert device.live == 0  # the schedule's frames are kept, the failed attempt's are not
    assert caught.value.__context__ is None
    assert "refusing" in [frame.name for frame in traceback.extract_tb(caught.value.__traceback__)]
    if sys.version_info >= (3, 11):
        assert any("raised by the schedule= function" in note for note in caught.value.__notes__)
    # Every out-of-memory error is counted and told, the last one too, with nothing tried after it.
    assert stats[0].ooms == len(ran_out) == len(events)
    assert [(event.batch_size, event.next_batch_size) for event in events] == list(
        zip(ran_out, [*ran_out[1:], None], strict=True)
    )
    assert stats[0].exhausted == 0


def test_the_engines_own_check_of_a_size_keeps_its_plain_form() -> None:
    with pytest.raises(ValueError, match="the schedule returned 100") as caught:
        run_with_schedule(lambda failed: failed)
    assert getattr(caught.value, "__notes__", None) is None
    assert caught.value.__context__ is None


def test_a_schedule_must_be_callable() -> None:
    with pytest.raises(TypeError, match="schedule must be callable, got int 3"):
        run_with_schedule(3)


def test_a_schedules_class_is_refused_before_any_attempt() -> None:
    # Called with a size, the class makes a schedule: the first failure used to raise "factor must be ...".
    with pytest.raises(TypeError, match="got the class scaled: give an instance of it"):
        run_with_schedule(koila.scaled)


def test_a_class_whose_instances_are_no_schedules_is_taken_as_one() -> None:
    class Halves:  # called with the size that failed, it makes the next one: a schedule, if an odd one
        def __new__(cls, failed: int) -> Any:
            return failed // 2 or None

    assert run_with_schedule(Halves, initial=100, fits=20) == [100, 50, 25, 12]


def test_scaled_takes_numpys_numbers() -> None:
    numpy = pytest.importorskip("numpy")
    assert koila.scaled(numpy.float32(0.9))(100) == 90  # as it reads: float32's 0.8999999761... gave 89
    for factor in (numpy.float32(0.9), numpy.float64(0.5), numpy.float16(0.75)):
        plain = koila.scaled(float(str(factor)))
        schedule = koila.scaled(factor)
        assert schedule == plain
        assert [schedule(size) for size in (1000, 128, 3, 1)] == [plain(size) for size in (1000, 128, 3, 1)]
        assert schedule.grow(100) == plain.grow(100)
    with pytest.raises(ValueError, match="factor must be strictly between 0 and 1, got 1"):
        koila.scaled(numpy.int64(1))
    for wrong in (numpy.bool_(True), True, "0.5", torch.tensor(0.5)):
        with pytest.raises(TypeError, match="factor must be a number"):
            koila.scaled(wrong)


def test_a_schedule_and_its_grow_may_return_numpys_ints() -> None:
    """A schedule reading a size from an array returned numpy.int64(20): refused, where the options take it."""
    numpy = pytest.importorskip("numpy")

    class FromArray:
        def __call__(self, failed: int) -> Any:
            return numpy.int64(failed // 4)

        def grow(self, size: int) -> Any:
            return numpy.int64(size * 4)

    tried: list[int] = []

    @koila.batch(initial=100, schedule=FromArray(), cache=koila.NoCache())
    def run(batch_size: int) -> int:
        tried.append(batch_size)
        if batch_size > 30:
            raise make_oom()
        return batch_size

    assert run() == 25
    assert [type(size) for size in tried] == [int, int]
    assert decision.grow_by(FromArray(), 25) == 100
    assert type(decision.grow_by(FromArray(), 25)) is int


def test_powers_of_two_takes_numpys_ints() -> None:
    numpy = pytest.importorskip("numpy")
    assert koila.powers_of_two(numpy.int64(500)) == 256  # type: ignore[arg-type]


@pytest.mark.parametrize("failed", [1.5, "8", True, None, torch.tensor(8.0)])
def test_powers_of_two_takes_an_int(failed: object) -> None:
    with pytest.raises(
        TypeError, match=f"powers_of_two takes the size that failed, an int, got .*{re.escape(repr(failed))}"
    ):
        koila.powers_of_two(failed)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- initial=None


@pytest.mark.parametrize("front_end", [koila.batch, koila.attempts])
def test_initial_none_is_refused_where_the_rows_are_unknown(front_end: Any) -> None:
    name = front_end.__name__
    with pytest.raises(TypeError, match=rf"koila.{name}\(\) got initial=None: .* koila.{name} is not given"):
        front_end(initial=None)


def test_initial_none_runs_every_index_of_a_range_at_once() -> None:
    spans: list[tuple[int, int]] = []

    def span(begin: int, end: int) -> int:
        spans.append((begin, end))
        fits(end - begin)
        return end - begin

    fits = oom_above(1000)
    assert koila.range(span, 0, 1000, initial=None) == [1000]
    fits = oom_above(300)
    assert koila.range(span, 0, 1000, initial=None, cache=koila.NoCache()) == [256, 256, 256, 232]
    assert spans[1:3] == [(0, 1000), (0, 512)]  # then 256 from the start of the range that failed


def test_initial_none_runs_every_row_of_a_chunked_call_at_once() -> None:
    sizes: list[int] = []

    @koila.chunked(initial=None)
    def double(x: torch.Tensor) -> torch.Tensor:
        sizes.append(len(x))
        return x * 2

    assert torch.equal(double(torch.ones(1000)), torch.full((1000,), 2.0))
    assert sizes == [1000]


def test_policy_of_takes_none_only_from_front_ends_that_know_the_rows() -> None:
    assert Policy.of("koila.chunked", None, {}, rows=True).initial is None
    with pytest.raises(TypeError, match=r"koila.x\(\) got initial=None"):
        Policy.of("koila.x", None, {})
