"""Sizes between powers of two (issue 31, part 1): ``refine=True`` searches between the size that fits and the
smallest that failed, over the next calls, and never tries a size that failed again under the same key.

The memory is real: a simulated device in which 100 rows fit and 101 do not.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import koila_retry as koila
from koila_retry._core import decision
from koila_retry._core.decision import Rules, State
from koila_retry.testing import make_oom, oom_above, simulated_device

ROW = 256 * 1024  # float32 elements: 1 MiB a row
LIMIT = 100 * 2**20 + 2**19  # 100 rows fit, 101 do not


@pytest.mark.parametrize(
    ("fits", "failed", "probe"),
    [(64, 128, 96), (96, 128, 112), (96, 112, 104), (96, 104, 96), (100, 104, 100), (5, 10, 7), (7, 8, 7), (1, 2, 1)],
)
def test_the_probe_is_halfway_in_multiples_of_8_from_64(fits: int, failed: int, probe: int) -> None:
    assert decision.between(fits, failed) == probe


def test_the_probe_stays_under_the_ceiling_and_needs_a_bound() -> None:
    rules = Rules("f", 128, refine=True)
    assert decision.refined(rules, State(64, 128, 1, 64), None) == 64
    assert decision.refined(rules, State(64, 128, 1, 64), 64) == 64
    assert decision.refined(rules, State(64, 80, 1, 64), 128) == 80
    assert decision.refined(Rules("f", 128), State(64, 128, 1, 64), 128) == 64  # refine off
    assert decision.failed_at(None, 112) == (112, 0)
    assert decision.failed_at((104, 0), 112) == (104, 0)
    assert decision.still_failed((104, 0), 96) == (104, 0)
    assert decision.still_failed((104, 0), 104) is None  # it fitted after all: memory came back


def test_batch_settles_within_an_eighth_of_what_fits_and_then_costs_nothing() -> None:
    sizes: list[int] = []

    @koila.batch(initial=128, refine=True)
    def run(batch_size: int) -> int:
        sizes.append(batch_size)
        torch.empty(batch_size, ROW)
        return batch_size

    with simulated_device(LIMIT):
        got = [run() for _ in range(8)]
        ooms = run.stats.ooms
        later = [run() for _ in range(5)]
    assert later == [96] * 5
    assert run.stats.ooms == ooms  # later calls add no out-of-memory error
    assert sizes[:2] == [128, 64]
    # Halving settles at 64, a third below the 100 that fit; the search ends within 12.5% below them.
    assert got[-1] == 96
    assert 100 * 0.875 <= got[-1] <= 100
    failed = [size for size in sizes if size > 100]
    assert len(failed) == len(set(failed)), "a size that failed was tried again"
    assert len(failed) <= 1 + 3  # the first error, and at most log2(64 / 8) probes


def test_refine_goes_on_after_the_first_call_moves_free_memory_down_a_bucket() -> None:
    # State made by the first call (an optimizer's) moved the free memory down a bucket: the stack cache
    # took the size from the bucket above but not the size that failed there, and refine stopped at 32,
    # half what fits, with no sign (probe 72F).
    state: list[torch.Tensor] = []
    sizes: list[int] = []

    @koila.batch(initial=128, refine=True)
    def run(batch_size: int) -> int:
        sizes.append(batch_size)
        if not state:
            state.append(torch.empty(40 * 2**20, dtype=torch.uint8))  # free memory falls below 64 MiB
        torch.empty(batch_size, ROW)
        return batch_size

    with simulated_device(LIMIT):
        got = [run() for _ in range(8)]
    assert len(run.cache_info.__self__) == 2  # a size under each bucket  # type: ignore[attr-defined]
    assert got[0] == 32
    assert 60 * 0.875 <= got[-1] <= 60  # 60 rows fit beside the state
    failed = [size for size in sizes if size > 60]
    assert len(failed) == len(set(failed)), "a size that failed was tried again"


def test_without_refine_powers_of_two_stay() -> None:
    @koila.batch(initial=128)
    def run(batch_size: int) -> int:
        torch.empty(batch_size, ROW)
        return batch_size

    with simulated_device(LIMIT):
        assert [run() for _ in range(4)] == [64] * 4


def test_chunked_refines_between_its_chunks_with_exact_results() -> None:
    seen: list[int] = []

    def double(chunk: torch.Tensor) -> torch.Tensor:
        seen.append(len(chunk))
        torch.empty(len(chunk), ROW)
        return chunk * 2

    x = torch.arange(2000.0).unsqueeze(1)
    with simulated_device(LIMIT):
        out = koila.chunked(double, x, initial=128, refine=True)
    assert torch.equal(out, x * 2)
    assert seen[:3] == [128, 64, 96]
    assert 88 <= max(size for size in seen[-5:]) <= 100
    failed = [size for size in seen if size > 100]
    assert len(failed) == len(set(failed))


def test_accumulate_refines_with_the_whole_batchs_gradient() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).double()
    x, y = torch.randn(256, 4, dtype=torch.float64), torch.randn(256, 1, dtype=torch.float64)
    torch.nn.functional.mse_loss(model(x), y).backward()
    expected = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    rows: list[int] = []

    @koila.accumulate(initial=128, refine=True)
    def step(xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        rows.append(len(xs))
        if len(xs) > 100:
            raise make_oom()
        return torch.nn.functional.mse_loss(model(xs), ys)

    for _ in range(6):
        model.zero_grad(set_to_none=True)
        step(x, y)
        # Micro-batches that do not divide the batch (96, 96, 64) still give its gradient exactly.
        for got, want in zip(model.parameters(), expected, strict=True):
            torch.testing.assert_close(got.grad, want, rtol=1e-12, atol=1e-14)
    assert step.stats.batch_size == 96
    assert 96 in rows


def test_refine_across_six_threads_settles_with_every_call_exact() -> None:
    fits = oom_above(100)

    @koila.batch(initial=128, refine=True)
    def step(batch_size: int, value: int) -> list[int]:
        fits(batch_size)
        return [value] * batch_size

    start = threading.Barrier(6)
    results: list[list[int]] = [[] for _ in range(6)]
    errors: list[str] = []

    def work(number: int) -> None:
        start.wait()
        try:
            for call in range(20):
                got = step(value=number * 100 + call)
                assert set(got) == {number * 100 + call}  # this thread's call, not another's
                results[number].append(len(got))
        except BaseException as exc:  # reported below, on the main thread
            errors.append(repr(exc))

    threads = [threading.Thread(target=work, args=(number,)) for number in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert all(len(sizes) == 20 and max(sizes) <= 100 for sizes in results)
    assert [sizes[-1] for sizes in results] == [96] * 6


def test_refine_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="refine must be a bool"):
        koila.batch(refine="yes")(lambda batch_size: None)


# -- each next chunk of a pass probes (issue 39, finding 9) -----------------------------------


def _chunked(tried: list[int]) -> list[torch.Tensor]:
    def double(chunk: torch.Tensor) -> torch.Tensor:
        tried.append(len(chunk))
        torch.empty(len(chunk), ROW)
        return chunk * 2

    x = torch.arange(2000.0).unsqueeze(1)
    return [koila.chunked(double, x, initial=128, refine=True), x * 2]


def _range(tried: list[int]) -> list[torch.Tensor]:
    def double(begin: int, end: int) -> torch.Tensor:
        tried.append(end - begin)
        torch.empty(end - begin, ROW)
        return torch.arange(float(begin), float(end)) * 2

    got = koila.range(double, 0, 2000, initial=128, refine=True)
    return [torch.cat(got), torch.arange(2000.0) * 2]


@pytest.mark.parametrize("run", [_chunked, _range], ids=["chunked", "range"])
def test_each_next_chunk_of_a_pass_probes_halfway_until_none_is_left(run: Any) -> None:
    tried: list[int] = []
    with simulated_device(LIMIT):
        got, want = run(tried)
    assert torch.equal(got, want)
    # 128 fails, 64 fits; then each next chunk probes halfway: 96 fits, 112 and 104 fail and
    # go back to 96 within their chunk, and nothing is left between 96 and 104.
    assert tried[:8] == [128, 64, 96, 112, 96, 104, 96, 96]
    assert set(tried[8:-1]) == {96}
    failed = [size for size in tried if size > 100]
    assert failed == [128, 112, 104]  # none tried twice


# -- the bound within a size class (issue 39, finding 11) ------------------------------------

UNIT = 64 * 1024  # bytes per row and element of its length
CLASS_LIMIT = 3300 * UNIT + UNIT // 2  # rows x length up to 3300 fit


def test_the_bound_is_scaled_within_a_size_class() -> None:
    cache = koila.StackMemoryCache()  # one key for lengths 33 to 64 (one size class), from one line

    def encode(x: torch.Tensor) -> torch.Tensor:
        with simulated_device(CLASS_LIMIT):
            return koila.chunked(work, x, initial=128, refine=True, cache=cache)

    def work(chunk: torch.Tensor) -> torch.Tensor:
        tried.append(len(chunk))
        torch.empty(len(chunk), chunk.shape[1] * UNIT // 4)  # memory in proportion to rows x length
        return chunk[:, 0] * 2

    failed: list[int] = []  # rows x length of each size that ran out of memory, in order
    passes = {}
    for number, length in enumerate([33, 40, 60, 33]):
        tried: list[int] = []
        x = torch.arange(1500.0).unsqueeze(1).expand(1500, length).contiguous()
        assert torch.equal(encode(x), x[:, 0] * 2)
        for size in tried:
            if size * length > 3300:
                # No size holds as many bytes of rows as one that failed before, at any length.
                assert not failed or size * length < min(failed), (length, tried)
                failed.append(size * length)
        passes[number] = tried
    assert passes[0][:6] == [128, 64, 96, 112, 96, 104]  # 104 rows of 33 failed: 3432
    # 60 x 58 = 3480 would hold more than failed: the probes stay below 58 rows.
    assert max(passes[2]) < 58
    # Back at 33, the pass climbs back to the 96 rows found there, never past the bound.
    assert passes[3][-2] == 96
    assert max(passes[3]) <= 100


def test_a_bound_failed_on_other_samples_is_scaled_to_as_many_bytes() -> None:
    # 88 rows of 40 failed: 88 x 40 = 3520; at 60, 59 rows hold as many bytes (58 do not).
    bound = decision.failed_at(None, 88, 40)
    assert bound == (88, 40)
    assert decision.bound_rows(bound, 60) == 59
    assert decision.bound_rows(bound, 33) == 107  # 106 x 33 = 3498: shorter rows, more of them
    assert decision.bound_rows(bound, 0) == 88  # bytes not known: rows as they are
    rules = Rules("f", 128, refine=True)
    assert decision.refined(rules, State(53, 128, 1, 53), decision.bound_rows(bound, 60)) == 56
    # A failure holding fewer bytes replaces the bound; one holding more leaves it.
    assert decision.failed_at(bound, 58, 60) == (58, 60)
    assert decision.failed_at(bound, 60, 60) == bound
    # A success at as many bytes as failed means memory came back: the bound is forgotten.
    assert decision.still_failed(bound, 58, 60) == bound
    assert decision.still_failed(bound, 59, 60) is None


def test_the_probe_reaches_the_last_multiple_of_8_below_any_bound() -> None:
    # A scaled bound need not be a multiple of 8: 96 lies between 88 and 102.
    assert decision.between(88, 102) == 96
    assert decision.between(96, 102) == 96
    assert decision.between(53, 58) == 55


# -- initial="auto" (issue 39, finding 12) -----------------------------------------------------


def test_auto_refines_between_the_estimates_size_and_twice_it() -> None:
    tried: list[int] = []

    def double(chunk: torch.Tensor) -> torch.Tensor:
        if chunk.device.type != "meta":  # the estimate's runs are on meta tensors
            tried.append(len(chunk))
        torch.empty(len(chunk), ROW)
        return chunk * 2

    x = torch.arange(2000.0).unsqueeze(1)
    with simulated_device(LIMIT):
        out = koila.chunked(double, x, initial="auto", refine=True)
    assert torch.equal(out, x * 2)
    # A probe that the estimate's correction measures, which then chooses 64, the largest
    # power of two it finds to fit: 128 does not, and stands for the size that failed. The
    # next chunks search between them.
    assert tried[:7] == [8, 96, 112, 96, 104, 96, 96]
    assert max(tried) < 128
    assert [size for size in tried if size > 100] == [112, 104]


def test_auto_without_refine_stays_at_the_estimates_size() -> None:
    tried: list[int] = []

    def double(chunk: torch.Tensor) -> torch.Tensor:
        if chunk.device.type != "meta":
            tried.append(len(chunk))
        torch.empty(len(chunk), ROW)
        return chunk * 2

    x = torch.arange(2000.0).unsqueeze(1)
    with simulated_device(LIMIT):
        out = koila.chunked(double, x, initial="auto")
    assert torch.equal(out, x * 2)
    assert set(tried[1:-1]) == {64}


# -- max_attempts (issue 39, finding 12) ------------------------------------------------------


def test_max_attempts_1_makes_no_probe_it_could_not_go_back_from() -> None:
    tried: list[int] = []
    fits = oom_above(100)

    def step(batch_size: int) -> int:
        tried.append(batch_size)
        fits(batch_size)
        return batch_size

    cache = koila.GlobalCache()
    assert koila.batch(initial=128, refine=True, cache=cache)(step)() == 64  # 128 failed, 64 fits
    limited = koila.batch(initial=128, refine=True, max_attempts=1, cache=cache)(step)
    tried.clear()
    # A probe that failed would need a second attempt to go back to 64: none is made.
    assert [limited() for _ in range(3)] == [64, 64, 64]
    assert tried == [64, 64, 64]
    # With two attempts, the probes and their fall-backs fit in the budget.
    twice = koila.batch(initial=128, refine=True, max_attempts=2, cache=cache)(step)
    tried.clear()
    assert [twice() for _ in range(4)] == [96, 96, 96, 96]
    assert tried == [96, 112, 96, 104, 96, 96]


def test_max_attempts_1_chunks_make_no_probe() -> None:
    tried: list[int] = []
    fits = oom_above(100)

    def double(chunk: torch.Tensor) -> torch.Tensor:
        tried.append(len(chunk))
        fits(len(chunk))
        return chunk * 2

    cache = koila.GlobalCache()
    x = torch.arange(130.0).unsqueeze(1)
    assert torch.equal(koila.chunked(double, x, initial=128, refine=True, cache=cache), x * 2)
    assert tried == [128, 64, 66]  # 128 failed, 64 fits; the 66 rows left prove nothing
    tried.clear()
    x = torch.arange(1000.0).unsqueeze(1)
    out = koila.chunked(double, x, initial=128, refine=True, max_attempts=1, cache=cache)
    assert torch.equal(out, x * 2)
    assert tried == [64] * 15 + [40]


def test_a_refine_probe_is_no_growth_probe_so_growing_back_keeps_its_wait() -> None:
    """250 rows, of which 100 fit: a refine probe on the short last chunk made the key due to grow at once."""
    x = torch.arange(250.0).unsqueeze(1)
    seen: list[list[int]] = []

    def run(refine: bool) -> int:
        seen.clear()

        @koila.chunked(initial=128, grow=True, grow_after=50, refine=refine)
        def double(chunk: torch.Tensor) -> torch.Tensor:
            seen[-1].append(len(chunk))
            torch.empty(len(chunk), ROW)
            return chunk * 2

        with simulated_device(LIMIT):
            for _ in range(6):  # far fewer chunks than grow_after: no growth probe is due
                seen.append([])
                assert torch.equal(double(x), x * 2)
        return double.stats.ooms

    assert run(refine=False) == 1
    assert all(128 not in sizes for sizes in seen[1:])
    ooms = run(refine=True)
    assert all(128 not in sizes for sizes in seen[1:]), seen  # no pass after the first starts with a probe to 128
    assert ooms == 3  # 128, then refine's probes between 64 and 128 that do not fit (112, 104)


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_growing_back_climbs_past_a_size_that_failed_while_memory_was_short(kind: str, tmp_path: Path) -> None:
    """Refined during a dip to 168 (176 failed), the size stayed 168 once 200 fitted again: each growth
    probe went to 256, failed, and left 176 the bound, so refine never searched above it (probe 77C)."""
    limit, tried = [200], []
    cache = koila.GlobalCache() if kind == "memory" else koila.DiskCache(tmp_path / "sizes.json")

    def step(batch_size: int) -> int:
        tried.append(batch_size)
        if batch_size > limit[0]:
            raise make_oom()
        return batch_size

    def run(calls: int) -> list[int]:
        # A DiskCache is read again, as by the next run of the script.
        used = cache if kind == "memory" else koila.DiskCache(tmp_path / "sizes.json")
        wrapped = koila.batch(initial=256, refine=True, grow=True, grow_after=2, cache=used)(step)
        return [wrapped() for _ in range(calls)]

    assert run(8)[-1] == 200
    limit[0] = 170
    assert run(8)[-1] == 168
    limit[0] = 200
    tried.clear()
    sizes = run(30)
    assert sizes[-10:] == [200] * 10
    assert tried[0] == 168
    assert 176 in tried  # the size that failed in the dip is probed before any power of two above it
    assert tried.index(176) < tried.index(256)


class _Clock:
    """Seconds that pass as the steps say: each call costs a fixed 50 ms and 1 ms a row."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_growth_probe_to_the_size_that_failed_is_not_weighed_by_grow_gain() -> None:
    """Its few rows more ran hardly faster: grow_gain stopped growth for good at 168, where 256 fits (probe 77G)."""
    clock, limit, tried = _Clock(), [200], []

    def step(batch_size: int) -> int:
        tried.append(batch_size)
        if batch_size > limit[0]:
            raise make_oom()
        clock.now += 0.05 + batch_size / 1000
        return batch_size

    options: Any = {"refine": True, "grow": True, "grow_after": 2, "grow_gain": 0.05, "clock": clock}
    wrapped = koila.batch(initial=256, cache=koila.GlobalCache(), **options)(step)
    [wrapped() for _ in range(8)]
    limit[0] = 170
    assert [wrapped() for _ in range(8)][-1] == 168
    limit[0] = 1000
    tried.clear()
    assert [wrapped() for _ in range(20)][-5:] == [256] * 5
    assert tried.index(176) < tried.index(256)


def test_a_bound_refine_left_in_a_file_steers_no_growth_without_refine(tmp_path: Path) -> None:
    """A run without refine read the bound a refining run left, probed it, and grow_gain stopped growth (probe 77G)."""
    clock, limit = _Clock(), [100]

    def step(batch_size: int) -> int:
        if batch_size > limit[0]:
            raise make_oom()
        clock.now += 0.05 + batch_size / 1000
        return batch_size

    path = tmp_path / "sizes.json"
    refining = koila.batch(initial=256, refine=True, cache=koila.DiskCache(path))(step)
    [refining() for _ in range(8)]
    assert json.loads(path.read_text())["bounds"]
    limit[0] = 1000
    options: Any = {"grow": True, "grow_after": 2, "grow_gain": 0.05, "clock": clock}
    growing = koila.batch(initial=256, cache=koila.DiskCache(path), **options)(step)
    assert [growing() for _ in range(12)][-3:] == [256] * 3


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_deleting_a_key_forgets_what_refine_learnt_of_it(kind: str, tmp_path: Path) -> None:
    """``del cache[key]`` dropped the size and kept the bound: a search afresh stayed below an old failure."""
    cache = koila.GlobalCache() if kind == "memory" else koila.DiskCache(tmp_path / "sizes.json")
    limit = [100]

    @koila.batch(initial=128, refine=True, cache=cache)
    def step(batch_size: int) -> int:
        if batch_size > limit[0]:
            raise make_oom()
        return batch_size

    for _ in range(5):
        step()
    (key,) = cache.keys()
    assert cache.bounds.get(key) is not None
    del cache[key]
    assert cache.bounds.get(key) is None
    if kind == "disk":  # nor in the file, for the next process
        assert not json.loads((tmp_path / "sizes.json").read_text()).get("bounds")
    limit[0] = 120  # memory was freed: a search afresh finds what a new cache finds
    assert [step() for _ in range(6)][-1] == 120


# -- a probe capped at the call's own rows (initial=None; probe 68c, finding 1) --------------


def test_a_chunked_call_whose_rows_cap_the_probe_keeps_what_was_learnt() -> None:
    """100 rows after 96 was stored: the probe, capped at the call's 100 rows, fitted and forgot the key,
    and the next pass ran out of memory at 1000, 512, 256 and 128 again."""
    tried: list[int] = []

    def double(chunk: torch.Tensor) -> torch.Tensor:
        tried.append(len(chunk))
        torch.empty(len(chunk), ROW)
        return chunk * 2

    cache = koila.GlobalCache()
    passes = []
    for rows in (200, 100, 1000):
        tried.clear()
        x = torch.arange(float(rows)).unsqueeze(1)
        with simulated_device(LIMIT):
            out = koila.chunked(double, x, initial=None, refine=True, cache=cache)
        assert torch.equal(out, x * 2)
        passes.append((list(tried), list(cache.values()), [cache.bounds.get(key) for key in cache]))
    (first, second, third) = passes
    assert first == ([200, 128, 64, 96, 40], [96], [(128, 4)])  # the 40 rows left prove nothing
    # The call's 100 rows fit: a size that worked, stored, and the bound stays.
    assert second == ([100], [100], [(128, 4)])
    # The next pass starts there and searches above it: 112 and 104 fail, each once, and 100 stays.
    assert third[0][:5] == [112, 100, 104, 100, 100]
    assert set(third[0][5:]) == {100}
    assert third[0].count(100) == 10  # the 1000 rows, in chunks of 100
    assert third[1:] == ([100], [(104, 4)])
    assert cache.cache_info().misses == 1  # only the first call started with nothing stored


def test_an_accumulate_call_whose_rows_cap_the_probe_keeps_what_was_learnt() -> None:
    """The short last batch of an epoch (90 rows, 64 stored) wiped the key: the next epoch's first batch ran
    out of memory at 512, 256 and 128 again."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).double()
    rows: list[int] = []
    cache = koila.GlobalCache()

    @koila.accumulate(refine=True, cache=cache)  # initial=None: the whole batch first
    def step(xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        rows.append(len(xs))
        torch.empty(len(xs), ROW)
        return torch.nn.functional.mse_loss(model(xs), ys)

    seen = []
    for size in (512, 90, 512):
        x, y = torch.randn(size, 4, dtype=torch.float64), torch.randn(size, 1, dtype=torch.float64)
        model.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()  # the plain step, on the whole batch
        expected = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
        model.zero_grad(set_to_none=True)
        rows.clear()
        with simulated_device(LIMIT):
            step(x, y)
        for got, want in zip(model.parameters(), expected, strict=True):
            torch.testing.assert_close(got.grad, want, rtol=1e-12, atol=1e-14)
        seen.append((list(rows), list(cache.values())))
    assert seen[0] == ([512, 256, 128] + [64] * 8, [64])
    assert seen[1] == ([90], [90])  # the probe, capped at the batch's 90 rows, fitted: stored, not forgotten
    # The next full batch starts at 90, and probes once between it and 128, which failed before.
    assert seen[2] == ([104, 90, 90, 90, 90, 90, 62], [90])
    assert step.stats.ooms == 4


def test_a_numpy_bool_for_refine_is_refused_naming_numpy() -> None:
    """refine=np.bool_(True) said "refine must be a bool, got bool np.True_": a bool, it seemed."""
    np = pytest.importorskip("numpy")
    with pytest.raises(TypeError, match=r"refine must be a bool, got numpy\.bool_? .*: give a Python bool"):
        koila.batch(refine=np.bool_(True))
    with pytest.raises(TypeError, match=r"refine must be a bool, got int 1$"):  # Python's own types as they were
        koila.batch(refine=1)  # type: ignore[arg-type]


def test_a_key_evicted_from_a_full_cache_searches_afresh() -> None:
    # Its size went, its bound stayed: the new failures above the old bound were not recorded, the first
    # success above it deleted it, and refine never searched between the new fit and the next failure
    # (probe 75C: 256 for good, where 296 fit).
    cache = koila.GlobalCache(maxsize=1)
    limits, tried = {"refined": 100, "other": 100}, {"refined": [], "other": []}

    def step_of(name: str, refine: bool) -> Any:
        @koila.batch(initial=1024, refine=refine, cache=cache)
        def step(batch_size: int) -> int:
            tried[name].append(batch_size)
            oom_above(limits[name])(batch_size)
            return batch_size

        return step

    refined, other = step_of("refined", True), step_of("other", False)
    for _ in range(4):
        refined()
    assert len(cache.bounds._keys) == 1  # what refine learnt: 104 failed
    other()  # stores its size, evicting refined's (maxsize=1)
    assert len(cache.bounds._keys) == 0
    limits["refined"] = 300
    tried["refined"].clear()
    for _ in range(6):
        refined()
    assert tried["refined"] == [1024, 512, 256, 384, 256, 320, 256, 288, 304, 288, 296]
    assert refined() == 296


def test_an_evicted_key_s_bound_leaves_a_disk_cache_s_file_with_its_size(tmp_path: Path) -> None:
    path = tmp_path / "sizes.json"
    cache = koila.DiskCache(path, maxsize=1)
    cache["a"] = 96
    cache.bounds.update("a", lambda _: (104, 0))
    cache["b"] = 8  # evicts a
    assert "a" not in cache
    assert cache.bounds.get("a") is None
    content = json.loads(path.read_text())
    assert content["sizes"] == {"b": 8}
    assert "a" not in content.get("bounds", {})  # the next run would have started its search from it


def test_a_disk_cache_s_file_keeps_no_bound_of_a_key_whose_size_it_trimmed(tmp_path: Path) -> None:
    # The file trims its sizes in the order they were stored, the memory evicts in the order they were used:
    # a's bound stayed in the file without a's size, and the next run stopped refine's search for it (probe 75G).
    path = tmp_path / "sizes.json"
    cache = koila.DiskCache(path, maxsize=2)
    cache["a"] = 96
    cache.bounds.update("a", lambda _: (104, 0))
    cache["b"] = 8
    cache.bounds.update("b", lambda _: (16, 0))
    assert cache.lookup("a") == 96  # the most recently used in memory
    cache["c"] = 8  # memory evicts b, the file trims a
    content = json.loads(path.read_text())
    assert set(content.get("bounds", {})) <= set(content["sizes"])
    assert koila.DiskCache(path, maxsize=2).bounds.get("a") is None


def test_a_disk_cache_opened_with_a_smaller_maxsize_loads_no_bound_without_its_size(tmp_path: Path) -> None:
    # The sizes and the bounds were each cut to the last maxsize: a bound whose size was left out was loaded,
    # and refine never searched above it again (probe 75K: 256 for good where 296 fitted).
    path = tmp_path / "sizes.json"
    first = koila.DiskCache(path, maxsize=4)
    first["w"] = 96
    first.bounds.update("w", lambda _: (104, 0))
    first["x"], first["y"], first["z"] = 8, 8, 8
    second = koila.DiskCache(path, maxsize=2)
    assert "w" not in second
    assert second.bounds.get("w") is None
