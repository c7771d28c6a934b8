"""Caches: one contract every cache keeps, then what each one remembers."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

import pytest
import torch

import koila_retry as koila
from koila_retry import _cache, _memory
from koila_retry.testing import oom_above, simulated_device

CPU = torch.device("cpu")
CACHES: dict[str, Callable[..., koila.SizeCache]] = {
    "StackMemoryCache": koila.StackMemoryCache,
    "GlobalCache": koila.GlobalCache,
    "NoCache": koila.NoCache,
}
REMEMBERING = {"StackMemoryCache", "GlobalCache"}


@pytest.fixture(params=sorted(CACHES))
def cache_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _key(cache: koila.SizeCache, function: object) -> object:
    return cache.key(function, sys._getframe(1), CPU)


# -- the contract ----------------------------------------------------------------------


def test_contract_lookup_after_store(cache_name: str) -> None:
    cache = CACHES[cache_name]()
    key = _key(cache, test_contract_lookup_after_store)
    if cache_name not in REMEMBERING:
        assert key is None  # the engine neither looks up nor stores
        cache["anything"] = 3
        assert len(cache) == 0
        return
    assert cache.lookup(key) is None
    cache[key] = 64
    assert cache.lookup(key) == 64
    assert cache[key] == 64
    assert key in cache
    assert list(cache) == [key]
    assert len(cache) == 1
    del cache[key]
    assert cache.lookup(key) is None


def test_contract_cache_info_and_clear(cache_name: str) -> None:
    cache = CACHES[cache_name](maxsize=8)
    assert cache.cache_info() == koila.CacheInfo(hits=0, misses=0, maxsize=8, currsize=0)

    @koila.batch(initial=32, cache=cache)
    def run(batch_size: int) -> int:
        return batch_size

    for _ in range(3):
        run()
    info = cache.cache_info()
    assert info == run.cache_info()
    if cache_name in REMEMBERING:
        assert (info.hits, info.misses, info.currsize) == (2, 1, 1)
    else:
        assert (info.hits, info.misses, info.currsize) == (0, 0, 0)
    run.cache_clear()
    assert cache.cache_info() == koila.CacheInfo(hits=0, misses=0, maxsize=8, currsize=0)


def test_contract_second_call_starts_at_the_size_that_worked(cache_name: str) -> None:
    tried: list[int] = []
    fits = oom_above(40)

    @koila.batch(initial=256, cache=CACHES[cache_name]())
    def run(batch_size: int) -> int:
        tried.append(batch_size)
        fits(batch_size)
        return batch_size

    def call_site() -> int:
        return run()

    assert call_site() == 32
    assert tried == [256, 128, 64, 32]
    tried.clear()
    assert call_site() == 32
    assert tried == ([32] if cache_name in REMEMBERING else [256, 128, 64, 32])


def test_contract_bounded(cache_name: str) -> None:
    cache = CACHES[cache_name](maxsize=2)
    for number in range(5):
        cache[("key", number)] = number
    assert len(cache) <= 2
    if cache_name in REMEMBERING:
        assert sorted(cache) == [("key", 3), ("key", 4)]  # least recently used went first


def test_contract_threads(cache_name: str) -> None:
    cache = CACHES[cache_name](maxsize=16)
    errors: list[BaseException] = []

    def hammer(offset: int) -> None:
        try:
            for number in range(300):
                key = ("key", (number + offset) % 40)
                cache[key] = number
                cache.lookup(key)
                cache.cache_info()
        except BaseException as exc:  # pragma: no cover - only on failure
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(offset,)) for offset in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(cache) <= 16
    info = cache.cache_info()
    if cache_name in REMEMBERING:
        assert info.hits + info.misses == 6 * 300


def test_contract_bad_maxsize(cache_name: str) -> None:
    with pytest.raises(ValueError, match="maxsize must be an int >= 1, got 0"):
        CACHES[cache_name](maxsize=0)


# -- what each cache remembers ------------------------------------------------------------


def _sizes_from_two_sites(cache: koila.SizeCache) -> tuple[list[int], list[int]]:
    first: list[int] = []
    second: list[int] = []
    fits = oom_above(20)

    @koila.batch(initial=64, cache=cache)
    def run(batch_size: int, log: list[int]) -> int:
        log.append(batch_size)
        fits(batch_size)
        return batch_size

    run(first)
    run(second)  # another line: another call site
    return first, second


def test_stack_memory_cache_separates_call_sites() -> None:
    first, second = _sizes_from_two_sites(koila.StackMemoryCache())
    assert first == [64, 32, 16]
    assert second == [64, 32, 16]


def test_global_cache_shares_one_size_per_function() -> None:
    first, second = _sizes_from_two_sites(koila.GlobalCache())
    assert first == [64, 32, 16]
    assert second == [16]


def test_stack_memory_cache_depth_tells_callers_apart() -> None:
    shallow, deep = koila.StackMemoryCache(depth=1), koila.StackMemoryCache(depth=2)

    def helper(cache: koila.SizeCache) -> object:
        return cache.key(helper, sys._getframe(0), CPU)

    def caller_a(cache: koila.SizeCache) -> object:
        return helper(cache)

    def caller_b(cache: koila.SizeCache) -> object:
        return helper(cache)

    assert caller_a(shallow) == caller_b(shallow)
    assert caller_a(deep) != caller_b(deep)


def test_shared_cache_keeps_functions_apart() -> None:
    cache = koila.StackMemoryCache()

    @koila.batch(initial=64, cache=cache)
    def small(batch_size: int) -> int:
        oom_above(4)(batch_size)
        return batch_size

    @koila.batch(initial=64, cache=cache)
    def large(batch_size: int) -> int:
        return batch_size

    def same_line() -> tuple[int, int]:
        return small(), large()

    assert same_line() == (4, 64)
    assert same_line() == (4, 64)


def test_stack_memory_cache_starts_afresh_with_much_more_free_memory() -> None:
    tried: list[int] = []

    @koila.batch(initial=64)
    def run(batch_size: int) -> int:
        tried.append(batch_size)
        if batch_size * 1024 > koila.free_memory():
            raise koila.testing.make_oom()
        return batch_size

    def call(limit: str) -> int:
        with simulated_device(limit):
            return run()

    assert call("20KiB") == 16  # 16 KiB fits in 20 KiB
    assert call("20KiB") == 16
    assert tried == [64, 32, 16, 16]
    # Four times the memory is another bucket, with more free memory: start again from the top.
    tried.clear()
    assert call("80KiB") == 64
    assert tried == [64]


def test_stack_memory_cache_falls_back_to_the_size_at_more_free_memory() -> None:
    tried: list[int] = []

    @koila.batch(initial=1024)
    def run(batch_size: int) -> int:
        tried.append(batch_size)
        if batch_size > 100:
            raise koila.testing.make_oom()
        return batch_size

    def call(limit: str) -> int:
        with simulated_device(limit):
            return run()

    assert call("64MiB") == 64
    tried.clear()
    # Less free memory than before (gradients, optimizer state): no size for this bucket, so
    # start from the one that worked with more memory instead of from 1024.
    assert call("20MiB") == 64
    assert tried == [64]
    assert run.cache_info().hits == 1


@pytest.mark.parametrize(("free", "bucket"), [(0, 0), (2**30, 31), (2**31 - 1, 31), (2**31, 32)])
def test_free_memory_bucket_is_the_bit_length(monkeypatch: pytest.MonkeyPatch, free: int, bucket: int) -> None:
    monkeypatch.setattr(_cache, "recent_free_memory", lambda device: free)
    key = koila.StackMemoryCache().key(test_free_memory_bucket_is_the_bit_length, sys._getframe(0), CPU)
    assert key[2] == bucket


def test_free_memory_is_read_at_most_once_per_ttl(monkeypatch: pytest.MonkeyPatch) -> None:
    readings: list[int] = []
    now = [1000.0]
    monkeypatch.setattr(_memory.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(_memory, "_device_free", lambda device: readings.append(1) or 2**30)

    @koila.batch(initial=8)
    def run(batch_size: int) -> int:
        return batch_size

    for _ in range(100):
        run()
    assert len(readings) == 1
    now[0] += _memory.FREE_MEMORY_TTL + 0.01
    run()
    assert len(readings) == 2


def test_bad_stack_memory_cache_options() -> None:
    with pytest.raises(ValueError, match="depth must be an int >= 1, got 0"):
        koila.StackMemoryCache(depth=0)
    with pytest.raises(ValueError, match="fallback_buckets must be an int >= 0, got -1"):
        koila.StackMemoryCache(fallback_buckets=-1)


def test_repr_names_the_counts() -> None:
    cache = koila.GlobalCache(maxsize=4)
    cache["f"] = 2
    cache.lookup("f")
    assert repr(cache) == "GlobalCache(maxsize=4, currsize=1, hits=1, misses=0)"
