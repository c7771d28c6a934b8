"""koila.attempts: retrying a block with smaller sizes."""

from __future__ import annotations

import gc
import warnings
import weakref
from typing import Any

import pytest
import torch
from torch import nn

import koila_retry as koila
from koila_retry.testing import make_oom, oom_above, simulated_device


def test_block_retries_with_smaller_sizes_until_it_fits() -> None:
    fits = oom_above(100)
    tried: list[int] = []
    for attempt in koila.attempts(initial=1000):
        with attempt:
            tried.append(attempt.batch_size)
            fits(attempt.batch_size)
    assert tried == [1000, 512, 256, 128, 64]
    assert attempt.batch_size == 64
    assert attempt.number == 5
    assert attempt.stats.ooms == 4


def test_an_attempt_shows_its_size_and_number_under_the_public_name() -> None:
    shown = []
    for attempt in koila.attempts(initial=8):
        shown.append(repr(attempt))
        with attempt:
            if attempt.batch_size > 4:
                raise make_oom()
    assert shown[0].startswith("<koila_retry.Attempt of block at ")
    assert [entry.split(": ")[-1] for entry in shown] == ["batch_size=8, number=1>", "batch_size=4, number=2>"]


def test_success_ends_the_loop_at_once() -> None:
    bodies = 0
    for attempt in koila.attempts(initial=32):
        with attempt:
            bodies += 1
    assert bodies == 1
    assert attempt.batch_size == 32


def test_exhaustion_raises_from_the_loop() -> None:
    tried: list[int] = []
    with pytest.raises(
        koila.BatchSizeExhausted, match=r"out of memory\. Every batch size tried failed \(4 -> 2 -> 1\);"
    ):
        for attempt in koila.attempts(initial=4):
            with attempt:
                tried.append(attempt.batch_size)
                raise make_oom()
    assert tried == [4, 2, 1]


def test_other_errors_propagate_unchanged() -> None:
    error = ValueError("not memory")
    with pytest.raises(ValueError, match="not memory") as excinfo:
        for attempt in koila.attempts(initial=4):
            with attempt:
                raise error
    assert excinfo.value is error


def test_iterating_without_with_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="inside `with attempt:`"):
        for _attempt in koila.attempts(initial=4):
            pass


def test_entering_an_attempt_inside_its_own_block_is_an_error() -> None:
    tried: list[int] = []
    with pytest.raises(RuntimeError, match=r"attempt 1 \(batch size 8\) is already inside `with attempt:`"):
        for attempt in koila.attempts(initial=8, cache=koila.NoCache()):
            with attempt:
                tried.append(attempt.batch_size)
                with attempt:  # once, an OOM here was swallowed by the inner block and the outer one "succeeded"
                    raise make_oom()
    assert tried == [8]
    assert attempt.stats.ooms == 0


def test_entering_an_attempt_again_after_its_block_is_an_error() -> None:
    tried: list[int] = []

    def enter_twice() -> None:
        for attempt in koila.attempts(initial=8, cache=koila.NoCache()):
            with attempt:
                tried.append(attempt.batch_size)
                raise make_oom()
            with attempt:  # once, this block's success hid the first one's OOM: size 8 "fitted"
                tried.append(attempt.batch_size)

    with (
        pytest.warns(RuntimeWarning, match="left before it could retry it"),
        pytest.raises(RuntimeError, match=r"attempt 1 \(batch size 8\) already ran its block, which ran out of"),
    ):
        enter_twice()
    assert tried == [8]

    with pytest.raises(RuntimeError, match=r"already ran its block, which succeeded"):
        for attempt in koila.attempts(initial=8, cache=koila.NoCache()):
            with attempt:
                pass
            with attempt:
                pass


def _run_block(tried: list[int]) -> int:
    fits = oom_above(10)
    for attempt in koila.attempts(initial=64):
        with attempt:
            tried.append(attempt.batch_size)
            fits(attempt.batch_size)
    return attempt.batch_size


def test_same_block_starts_from_the_cached_size() -> None:
    tried: list[int] = []
    assert _run_block(tried) == 8
    assert tried == [64, 32, 16, 8]
    assert _run_block(tried) == 8
    assert tried[4:] == [8]


def test_different_blocks_do_not_share_sizes() -> None:
    sizes = []
    for limit in (10, 1000):
        fits = oom_above(limit)
        for attempt in koila.attempts(initial=64):
            with attempt:
                fits(attempt.batch_size)
        sizes.append(attempt.batch_size)
    # One loop, two runs from the same line: the second starts where the first settled.
    assert sizes == [8, 8]

    fits = oom_above(1000)
    for attempt in koila.attempts(initial=64):  # another line, another block
        with attempt:
            fits(attempt.batch_size)
    assert attempt.batch_size == 64


def _our_attempts(**options: Any) -> koila.Attempt:
    """A project's helper around ``koila.attempts``: it is called here, its loops are elsewhere."""
    return koila.attempts(initial=64, **options)


def _through_the_helper(limit: int) -> list[int]:
    fits, tried = oom_above(limit), []
    for attempt in _our_attempts():
        with attempt:
            tried.append(attempt.batch_size)
            fits(attempt.batch_size)
    return tried


def _another_block_through_the_helper(limit: int) -> list[int]:
    # The same as the above on purpose: a block elsewhere in the code, whose key must be its own.
    fits, tried = oom_above(limit), []
    for attempt in _our_attempts():
        with attempt:
            tried.append(attempt.batch_size)
            fits(attempt.batch_size)
    return tried


def test_blocks_of_a_helper_that_returns_attempts_are_keyed_by_their_loops() -> None:
    """They were named by the helper's line: every block through it shared one size."""
    assert _through_the_helper(10) == [64, 32, 16, 8]
    assert _another_block_through_the_helper(1000) == [64]
    assert _through_the_helper(1000) == [8]  # its own block: where it settled
    features = torch.zeros(1000)
    reference = weakref.ref(features)
    with pytest.raises(koila.BatchSizeExhausted) as info:
        for attempt in _our_attempts(minimum=64):
            with attempt:
                features.sum()
                raise make_oom()
    # Named by its loop, here, not by the helper.
    assert "in test_blocks_of_a_helper_that_returns_attempts_are_keyed_by_their_loops" in str(info.value)
    assert "in _our_attempts" not in str(info.value)
    steps = _our_attempts(cache=koila.NoCache())
    steps.narrow(10)  # before the loop: kept when the loop starts it again
    for attempt in steps:
        with attempt:
            if attempt.number == 1:
                raise make_oom()
    assert attempt.batch_size < 10
    del features, info
    assert reference() is None  # the loop's variables are held by neither start


def test_explicit_cache_and_hook() -> None:
    events: list[koila.OOMEvent] = []
    cache = koila.GlobalCache()
    fits = oom_above(3)
    for attempt in koila.attempts(initial=16, cache=cache, on_oom=events.append):
        with attempt:
            fits(attempt.batch_size)
    assert [e.batch_size for e in events] == [16, 8, 4]
    assert events[0].function.startswith("block at ")
    assert list(cache.values()) == [2]


def test_bad_options() -> None:
    with pytest.raises(ValueError, match="initial must be >= 1, got 0"):
        koila.attempts(initial=0)
    with pytest.raises(TypeError, match="on_oom must be callable"):
        koila.attempts(on_oom=5)  # type: ignore[arg-type]


def test_inference_block_under_a_simulated_device() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 8))
    data = torch.randn(2048, 128)
    with torch.no_grad():
        expected = model(data)
    with simulated_device("2MiB"):
        for attempt in koila.attempts(initial=2048):
            with attempt, torch.no_grad():
                outputs = torch.cat([model(chunk) for chunk in data.split(attempt.batch_size)])
    assert attempt.batch_size < 2048
    torch.testing.assert_close(outputs, expected)


def test_retry_without_a_failed_attempt_is_an_error() -> None:
    for attempt in koila.attempts(initial=4):
        with attempt:
            pass
    with pytest.raises(RuntimeError, match="retry\\(\\) follows an attempt that ran out of memory"):
        attempt.retry()


def test_retry_moves_to_the_next_size() -> None:
    loop = iter(koila.attempts(initial=100, cache=koila.NoCache()))
    attempt = next(loop)
    with attempt:
        raise make_oom()
    assert attempt.retry() is attempt
    assert (attempt.batch_size, attempt.number) == (64, 2)
    loop.close()


def test_next_step_requires_a_step_that_succeeded() -> None:
    attempt = koila.attempts(initial=8, cache=koila.NoCache())
    with pytest.raises(RuntimeError, match="next_step\\(\\) follows a step that succeeded"):
        attempt.next_step()


def test_steps_keep_the_reduced_size_and_count_attempts_per_step() -> None:
    steps = koila.attempts(initial=8, cache=koila.NoCache(), max_attempts=2)
    for attempt in steps:
        with attempt:
            if attempt.number == 1:
                raise make_oom()
    assert (steps.batch_size, steps.number) == (4, 2)
    steps.next_step()
    assert (steps.batch_size, steps.number) == (4, 1)
    # A fresh step may again make max_attempts=2 attempts: one failure is retried.
    for attempt in steps:
        with attempt:
            if attempt.number == 1:
                raise make_oom()
    assert (steps.batch_size, steps.number) == (2, 2)


def test_a_narrowed_step_that_fails_continues_below_the_rows_it_tried() -> None:
    events: list[koila.OOMEvent] = []
    steps = koila.attempts(initial=256, cache=koila.NoCache(), on_oom=events.append)
    steps.narrow(100)
    for attempt in steps:
        with attempt:
            if attempt.number == 1:
                raise make_oom()
    assert steps.batch_size == 64
    assert (events[0].batch_size, events[0].next_batch_size) == (100, 64)


@pytest.mark.parametrize(("rows", "error"), [(0, ValueError), (-5, ValueError), (2.5, TypeError), (True, TypeError)])
def test_narrow_takes_a_count_of_rows(rows: Any, error: type[Exception]) -> None:
    """It took anything: 0 gave up naming 0 as a size tried, 2.5 failed in the schedule."""
    steps = koila.attempts(initial=64, cache=koila.NoCache())
    with pytest.raises(error, match=f"narrow takes the rows the coming attempt uses.*got .*{rows!r}"):
        steps.narrow(rows)
    for attempt in steps:  # unchanged: the loop runs at 64
        with attempt:
            pass
    assert attempt.batch_size == 64


def test_a_narrowed_step_that_succeeds_stores_nothing() -> None:
    # Fewer rows than the size in force prove neither that size nor a smaller one.
    cache = koila.GlobalCache()
    steps = koila.attempts(initial=256, cache=cache)
    steps.narrow(100)
    for attempt in steps:
        with attempt:
            pass
    assert len(cache) == 0
    steps = koila.attempts(initial=256, cache=cache)
    for attempt in steps:
        with attempt:  # a whole step at 128: stored
            if attempt.number == 1:
                raise make_oom()
    steps.next_step()
    steps.narrow(10)
    for attempt in steps:
        with attempt:
            pass
    assert list(cache.values()) == [128]


# --------------------------------------------------------------------------- what the block's frame keeps


def _fits_after_the_cache_is_dropped() -> tuple[int, bool]:
    with simulated_device("1MiB"):
        cache: torch.Tensor | None = torch.zeros(150_000)  # 600 KiB, made before the loop
        reference = weakref.ref(cache)
        for attempt in koila.attempts(initial=4, minimum=1, cache=koila.NoCache()):
            with attempt:
                if attempt.number > 1:
                    cache = None  # made room for the retry
                work = torch.zeros(150_000)  # 600 KiB more: fits only once the cache is gone
        del work
    return attempt.number, reference() is None


def test_a_tensor_the_block_drops_is_freed_for_its_retry() -> None:
    # Once, attempts() kept every variable of its caller, the cache here, for the whole loop.
    assert _fits_after_the_cache_is_dropped() == (2, True)


def test_the_loop_keeps_no_variable_of_its_frame_alive() -> None:
    features = torch.zeros(1000)
    reference = weakref.ref(features)
    for attempt in koila.attempts(initial=64, cache=koila.NoCache()):
        with attempt:
            features[: attempt.batch_size].sum()
    del features
    assert reference() is None  # attempt is still bound
    assert attempt.batch_size == 64


def _block_returning_its_attempt(references: list[weakref.ref[torch.Tensor]]) -> koila.Attempt:
    features = torch.zeros(1000)
    references.append(weakref.ref(features))
    for attempt in koila.attempts(initial=64, cache=koila.NoCache()):
        with attempt:
            features.sum()
    return attempt


def test_after_the_function_returns_its_variables_die_without_a_collection() -> None:
    references: list[weakref.ref[torch.Tensor]] = []
    gc.disable()  # once, the attempt held the frame that held the attempt: a cycle only a collection freed
    try:
        _block_returning_its_attempt(references)
        assert references[0]() is None
        attempt = _block_returning_its_attempt(references)
        assert references[1]() is None
    finally:
        gc.enable()
    assert attempt.batch_size == 64


def test_a_namespace_taken_with_locals_is_left_as_it_was() -> None:
    epoch, loss = 3, 0.5
    namespace = locals()
    before = dict(namespace)
    for attempt in koila.attempts(initial=8, cache=koila.NoCache()):
        with attempt:
            pass
    assert namespace == before
    assert "{epoch}: {loss}".format(**namespace) == f"{epoch}: {loss}"
    assert attempt.number == 1


# --------------------------------------------------------------------------- the block needs its loop


def test_a_block_entered_without_its_loop_is_refused() -> None:
    # Once, the OOM was swallowed and nothing retried it: the block's work silently did not happen.
    done: list[int] = []

    def block() -> None:
        with koila.attempts(initial=8, cache=koila.NoCache()):
            raise make_oom()
        done.append(1)  # pragma: no cover - the with statement raises

    with pytest.raises(RuntimeError, match=r"for attempt in koila\.attempts\(\.\.\.\):"):
        block()
    assert done == []


def test_a_block_entered_without_its_loop_is_refused_even_when_it_would_succeed() -> None:
    ran: list[int] = []
    attempt = koila.attempts(initial=8, cache=koila.NoCache())
    with pytest.raises(RuntimeError, match=r"entered outside the `for` loop that retries it"), attempt:
        ran.append(attempt.batch_size)
    assert ran == []
    assert attempt.stats.ooms == 0


def test_an_attempt_outlived_by_its_finished_loop_is_refused() -> None:
    attempt = next(iter(koila.attempts(initial=8, cache=koila.NoCache())))  # the iterator is gone at once
    with pytest.raises(RuntimeError, match=r"outside the `for` loop that retries it"), attempt:
        raise make_oom()


def test_leaving_the_loop_after_an_attempt_that_ran_out_of_memory_warns() -> None:
    tried: list[int] = []

    def leave() -> None:
        for attempt in koila.attempts(initial=8, cache=koila.NoCache()):
            with attempt:
                tried.append(attempt.batch_size)
                raise make_oom()
            break  # the mistake: nothing retries the failed attempt

    with pytest.warns(RuntimeWarning, match=r"attempt 1 \(batch size 8\) ran out of memory.*left before it"):
        leave()
    assert tried == [8]


def test_an_iterator_closed_after_an_attempt_that_ran_out_of_memory_warns() -> None:
    loop = iter(koila.attempts(initial=8, cache=koila.NoCache()))
    attempt = next(loop)
    with attempt:
        raise make_oom()
    with pytest.warns(RuntimeWarning, match=r"ran out of memory, and the loop over koila.attempts\(\) was left"):
        loop.close()


def test_leaving_the_loop_after_a_success_does_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for attempt in koila.attempts(initial=8, cache=koila.NoCache()):
            with attempt:
                pass
            break
    assert attempt.number == 1


def test_numpy_ints_are_taken_as_the_ints_they_hold() -> None:
    """initial, minimum and max_attempts take any integer but a bool (numpy's, read from a config), as ints."""
    np = pytest.importorskip("numpy")

    def sizes(**options: Any) -> tuple[list[int], list[int]]:
        tried: list[int] = []
        cache = koila.GlobalCache()
        for attempt in koila.attempts(cache=cache, **options):
            with attempt:
                tried.append(attempt.batch_size)
                if attempt.batch_size > 20:
                    raise make_oom()
        assert all(type(size) is int for size in [*tried, *cache.values()])
        return tried, list(cache.values())

    assert sizes(initial=np.int64(100), minimum=np.int32(8), max_attempts=np.uint8(4)) == sizes(
        initial=100, minimum=8, max_attempts=4
    )
    with pytest.raises(TypeError, match=r"initial must be an int, got numpy\.float64 "):
        koila.attempts(initial=np.float64(8.0))
    with pytest.raises(TypeError, match=r"minimum must be an int, got numpy\.bool_? "):
        koila.attempts(minimum=np.bool_(True))
    with pytest.raises(ValueError, match=r"max_attempts must be >= 1, got 0"):
        koila.attempts(max_attempts=np.int64(0))
