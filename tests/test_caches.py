"""Caches: one contract every cache keeps, then what each one remembers."""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import re
import sys
import threading
import warnings
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import pytest
import torch

import koila_retry as koila
from koila_retry._core import keys, memory
from koila_retry._core.cache import function_identity
from koila_retry.testing import make_oom, oom_above, simulated_device

CPU = torch.device("cpu")
CACHES: dict[str, Callable[..., koila.SizeCache]] = {
    "StackMemoryCache": koila.StackMemoryCache,
    "GlobalCache": koila.GlobalCache,
    "NoCache": koila.NoCache,
    "DiskCache": koila.DiskCache,  # needs a path: make caches with the make_cache fixture
}
REMEMBERING = {"StackMemoryCache", "GlobalCache", "DiskCache"}


@pytest.fixture(params=sorted(CACHES))
def cache_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_cache(cache_name: str, tmp_path: Path) -> Callable[..., koila.SizeCache]:
    """Make a cache of the kind under test; a DiskCache gets a fresh file of its own."""
    if cache_name == "DiskCache":
        return functools.partial(koila.DiskCache, tmp_path / "sizes.json")
    return CACHES[cache_name]


def _some_key(cache_name: str, *parts: object) -> object:
    # DiskCache's keys are strings (what its key() makes, and what JSON can hold); a key of
    # another type would be kept in memory only, so the contract gives it string keys.
    return " ".join(map(str, parts)) if cache_name == "DiskCache" else parts


def _key(cache: koila.SizeCache, function: object) -> object:
    return cache.key(function, sys._getframe(1), CPU)


# -- the contract ----------------------------------------------------------------------


def test_contract_lookup_after_store(cache_name: str, make_cache: Callable[..., koila.SizeCache]) -> None:
    cache = make_cache()
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


def test_contract_cache_info_and_clear(cache_name: str, make_cache: Callable[..., koila.SizeCache]) -> None:
    cache = make_cache(maxsize=8)
    assert cache.cache_info() == koila.CacheInfo(hits=0, misses=0, maxsize=8, currsize=0)

    fits = oom_above(16)

    @koila.batch(initial=32, cache=cache)
    def run(batch_size: int) -> int:
        fits(batch_size)
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


def test_contract_second_call_starts_at_the_size_that_worked(
    cache_name: str, make_cache: Callable[..., koila.SizeCache]
) -> None:
    tried: list[int] = []
    fits = oom_above(40)

    @koila.batch(initial=256, cache=make_cache())
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


def test_contract_bounded(cache_name: str, make_cache: Callable[..., koila.SizeCache]) -> None:
    cache = make_cache(maxsize=2)
    for number in range(5):
        cache[_some_key(cache_name, "key", number)] = number + 1  # sizes are >= 1
    assert len(cache) <= 2
    if cache_name in REMEMBERING:
        # least recently used went first
        assert sorted(cache) == [_some_key(cache_name, "key", 3), _some_key(cache_name, "key", 4)]


def test_contract_threads(cache_name: str, make_cache: Callable[..., koila.SizeCache], tmp_path: Path) -> None:
    cache = make_cache(maxsize=16)
    errors: list[BaseException] = []
    # Each store into a DiskCache rewrites (and fsyncs) its file: fewer rounds keep it quick.
    rounds = 20 if cache_name == "DiskCache" else 300

    def hammer(offset: int) -> None:
        try:
            for number in range(rounds):
                key = _some_key(cache_name, "key", (number + offset) % 40)
                cache[key] = number + 1  # sizes are >= 1
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
        assert info.hits + info.misses == 6 * rounds
    if cache_name == "DiskCache":  # and the file is whole, bounded like the memory
        content = json.loads((tmp_path / "sizes.json").read_text(encoding="utf-8"))
        assert 1 <= len(content["sizes"]) <= 16
        assert set(content["sizes"]) <= {_some_key(cache_name, "key", number) for number in range(40)}


def test_contract_bad_maxsize(make_cache: Callable[..., koila.SizeCache]) -> None:
    with pytest.raises(ValueError, match="maxsize must be an int >= 1, got 0"):
        make_cache(maxsize=0)


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
    monkeypatch.setattr(keys, "recent_free_memory", lambda device: free)
    key = koila.StackMemoryCache().key(test_free_memory_bucket_is_the_bit_length, sys._getframe(0), CPU)
    assert key[2] == bucket


def test_free_memory_is_read_at_most_once_per_ttl(monkeypatch: pytest.MonkeyPatch) -> None:
    readings: list[int] = []
    now = [1000.0]
    monkeypatch.setattr(memory.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(memory, "_device_free", lambda device: readings.append(1) or 2**30)

    @koila.batch(initial=8)
    def run(batch_size: int) -> int:
        return batch_size

    for _ in range(100):
        run()
    assert len(readings) == 1
    now[0] += memory.FREE_MEMORY_TTL + 0.01
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


def test_a_cache_whose_key_needs_a_sample_is_refused_at_decoration() -> None:
    """batch calls key without a sample: a key(function, caller, device, sample) failed at the first call."""

    class PerDevice(koila.SizeCache):
        def key(self, function: object, caller: object, device: torch.device, sample: object) -> object:  # type: ignore[override]
            return (function, device, sample)

    cache = PerDevice()
    with pytest.raises(TypeError, match=r"a cache's key is called with .*give sample a default \(sample=None\)"):
        koila.batch(initial=8, cache=cache)
    with pytest.raises(TypeError, match="give sample a default"):
        koila.chunked(lambda rows: rows, torch.ones(4), cache=cache)
    assert len(cache) == 0


def test_a_cache_whose_init_leaves_out_sizecaches_is_refused_at_decoration() -> None:
    # Taken, it failed at the first call with AttributeError: '_recent' (probe 71A).
    class Unmade(koila.SizeCache):
        def __init__(self) -> None:
            self.kept: dict[object, int] = {}

        def key(self, function: object, caller: object, device: torch.device, sample: object = None) -> object:
            return device

    with pytest.raises(
        TypeError, match=r"^cache Unmade was not made: its __init__ does not call super\(\)\.__init__\(\)"
    ):
        koila.batch(initial=8, cache=Unmade())


def test_a_cache_class_made_by_exec_is_taken() -> None:
    """A class exec made (a doctest's) has functions whose __module__ is None: the check raised AttributeError."""
    namespace: dict[str, Any] = {"koila": koila}
    source = "class PerDevice(koila.SizeCache):\n    def key(self, function, caller, device, sample=None):\n"
    exec(source + "        return device", namespace)
    cache = namespace["PerDevice"]()
    assert koila.batch(initial=4, cache=cache)(lambda batch_size: batch_size)() == 4
    assert cache.cache_info().misses == 1


def test_a_key_function_without_a_sample_is_refused_where_the_cache_is_made() -> None:
    """A koila cache calls its key function with four arguments: a three-argument one failed at the first call."""
    with pytest.raises(TypeError, match=r"key is called with \(function, caller, device, sample\), but .* takes"):
        koila.GlobalCache(key=lambda function, caller, device: function)
    assert koila.GlobalCache(key=lambda function, caller, device, sample: function).key_function is not None


def test_a_cache_that_cannot_store_costs_a_call_that_succeeded_nothing_but_a_warning() -> None:
    """A store that raised (a size store elsewhere, unreachable) made the call raise, its result lost."""

    class Remote(koila.GlobalCache):
        def __setitem__(self, key: Hashable, size: int) -> None:
            raise OSError("size store unreachable")

    ran: list[int] = []

    @koila.batch(initial=8, cache=Remote())
    def evaluate(batch_size: int) -> str:
        ran.append(batch_size)
        if batch_size > 2:
            raise make_oom()
        return f"result at {batch_size}"

    with pytest.warns(RuntimeWarning, match=r"Remote could not keep .*\(OSError: size store unreachable\)") as caught:
        assert evaluate() == "result at 2"
    assert ran == [8, 4, 2]
    assert caught[0].filename == __file__  # the user's line, not koila's
    # Once per call: chunked's every chunk tried the store again, and warned again.
    rows = torch.arange(64.0)
    fits = oom_above(2)
    with pytest.warns(RuntimeWarning, match="could not keep") as caught:
        joined = koila.chunked(lambda chunk: fits(len(chunk)) or chunk * 2, rows, initial=8, cache=Remote())
    assert len(caught) == 1
    torch.testing.assert_close(joined, rows * 2)


def test_sizes_and_depths_take_numpys_ints_as_options_do() -> None:
    numpy = pytest.importorskip("numpy")
    assert koila.GlobalCache(numpy.int64(3)).cache_info().maxsize == 3
    stack = koila.StackMemoryCache(numpy.int32(4), depth=numpy.int64(2))
    assert (stack.cache_info().maxsize, stack.depth, type(stack.depth)) == (4, 2, int)
    assert koila.deep_stack_key(numpy.int64(1)) is koila.stack_key
    buckets = koila.StackMemoryCache(fallback_buckets=numpy.int64(2)).fallback_buckets  # was a ValueError
    assert (buckets, type(buckets)) == (2, int)
    cache = koila.GlobalCache()
    cache["key"] = numpy.int64(4)  # was a TypeError, as were these (probes 74E, 74I)
    assert (cache.lookup("key"), type(cache.lookup("key"))) == (4, int)
    cache.prove("key", numpy.int64(100))
    assert (cache.sample_bytes("key"), type(cache.sample_bytes("key"))) == (100, int)
    with pytest.raises(TypeError, match="nbytes must be an int >= 1, got torch.Tensor tensor\\(True\\)"):
        cache.prove("key", torch.tensor(True))  # a bool, as True is
    for attempt in koila.attempts(initial=8, cache=koila.NoCache()):
        attempt.narrow(numpy.int64(4))
        with attempt:
            assert attempt.batch_size == 8
    rows = torch.arange(6.0).reshape(2, 3)
    joined = koila.chunked(lambda part: part * 2, rows, dim=numpy.int64(1), initial=2, cache=koila.NoCache())
    torch.testing.assert_close(joined, rows * 2)
    step = koila.accumulate(lambda x: x.mean(), dim=numpy.int64(0), initial=1, cache=koila.NoCache())
    torch.testing.assert_close(step(torch.arange(3.0, requires_grad=True)), torch.tensor(1.0))
    assert koila.report(top=numpy.int64(2)) is not None
    with pytest.raises(TypeError, match=r"progress must be a bool, got numpy.bool_? np.True_: give a Python bool"):
        koila.chunked(lambda part: part, rows, progress=numpy.True_)


def test_a_depth_beyond_any_stack_is_the_whole_stack() -> None:
    # Taken, then every call raised OverflowError: repeat() takes no more than sys.maxsize (probe 71A).
    cache = koila.StackMemoryCache(depth=10**30)

    fits = oom_above(4)

    @koila.batch(initial=8, cache=cache)
    def size(batch_size: int) -> int:
        fits(batch_size)
        return batch_size

    assert [size() for _ in range(2)] == [4, 4]  # from one place
    assert size.stats.ooms == 1, "the second call started at the size the first stored"


def test_a_cache_written_before_sample_existed_still_works_for_batch() -> None:
    """Custom caches with the three-argument ``key`` of the first release keep working."""

    class PerFunction(koila.SizeCache):
        def key(self, function: object, caller: object, device: torch.device) -> object:  # type: ignore[override]
            return function

    cache = PerFunction()

    @koila.batch(initial=64, cache=cache)
    def run(batch_size: int) -> int:
        if batch_size > 16:
            raise make_oom()
        return batch_size

    assert run() == 16
    assert list(cache.values()) == [16]


def test_contract_a_size_equal_to_initial_is_not_stored(
    cache_name: str, make_cache: Callable[..., koila.SizeCache]
) -> None:
    """A call that never ran out of memory says nothing about memory: nothing is stored."""
    cache = make_cache()

    @koila.batch(initial=32, cache=cache)
    def run(batch_size: int) -> int:
        return batch_size

    for _ in range(3):
        assert run() == 32
    assert len(cache) == 0
    assert cache.cache_info().misses == (3 if cache_name in REMEMBERING else 0)  # NoCache never looks


def test_contract_growing_back_to_initial_lifts_the_stored_limit(
    cache_name: str, make_cache: Callable[..., koila.SizeCache]
) -> None:
    """Once a call succeeds at ``initial`` again, the smaller size stored before is dropped."""
    cache = make_cache()
    limit = [16]

    @koila.batch(initial=32, cache=cache, grow=True, grow_after=1)
    def run(batch_size: int) -> int:
        if batch_size > limit[0]:
            raise make_oom()
        return batch_size

    sizes, stored = [], []
    for call in range(3):  # one line, so that StackMemoryCache gives every call one key
        limit[0] = 16 if call == 0 else 32
        sizes.append(run())
        stored.append(len(cache))
    # The first call reduces to 16 and stores it; the second probes 32 (grow_after=1), which
    # fits: 16 is forgotten, and the third call starts at 32 with nothing stored.
    assert sizes == [16, 32, 32]
    assert stored == ([1, 0, 0] if cache_name in REMEMBERING else [0, 0, 0])


def test_a_larger_initial_at_the_same_call_site_is_not_held_back() -> None:
    """A size stored because it was ``initial`` would cap a later call that asks for more."""
    sizes = []
    for initial in (32, 256):
        sizes.append(koila.range(lambda begin, end: end - begin, 0, 1000, initial=initial)[0])
    assert sizes == [32, 256]


# -- what comes out of a cache, and what goes in -------------------------------------------------


class Answers(koila.GlobalCache):
    """A cache that keeps its sizes elsewhere, and answers ``value`` for every key."""

    def __init__(self, value: object) -> None:
        super().__init__()
        self.value = value

    def lookup(self, key: object) -> Any:
        return self.value


@pytest.mark.parametrize("value", [2.5, True, "x", 0, -3, 1.0, [4]], ids=repr)
def test_a_looked_up_value_that_is_not_a_size_is_ignored_with_one_warning(value: object) -> None:
    tried: list[object] = []
    fits = oom_above(4)

    @koila.batch(initial=8, cache=Answers(value))
    def run(batch_size: int) -> int:
        tried.append(batch_size)
        fits(batch_size)
        return batch_size

    with pytest.warns(UserWarning, match="a batch size is an int >= 1") as record:
        assert [run(), run()] == [4, 4]
    assert tried == [8, 4, 8, 4]  # every call starts as if nothing were stored
    assert all(type(size) is int for size in tried)
    assert len(record) == 1  # once per cache: the second call says nothing
    message = str(record[0].message)
    assert repr(value) in message
    assert repr(run.__wrapped__) in message  # type: ignore[attr-defined]  # the key: GlobalCache's is the function
    assert record[0].filename == __file__  # the line that called


def test_a_looked_up_int_subclass_is_its_number() -> None:
    class Size(enum.IntEnum):
        SMALL = 2

    tried: list[object] = []

    @koila.batch(initial=8, cache=Answers(Size.SMALL))
    def run(batch_size: int) -> int:
        tried.append(batch_size)
        return batch_size

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert run() == 2
    assert type(tried[0]) is int


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (2.5, TypeError, "a batch size must be an int, got float 2.5 for key 'k'"),
        (True, TypeError, "a batch size must be an int, got bool True for key 'k'"),
        ("x", TypeError, "a batch size must be an int, got str 'x' for key 'k'"),
        (None, TypeError, "a batch size must be an int, got NoneType None for key 'k'"),
        (0, ValueError, "a batch size must be >= 1, got 0 for key 'k'"),
        (-3, ValueError, "a batch size must be >= 1, got -3 for key 'k'"),
    ],
    ids=repr,
)
def test_storing_what_is_not_a_size_is_refused(
    cache_name: str, make_cache: Callable[..., koila.SizeCache], value: object, error: type[Exception], message: str
) -> None:
    cache = make_cache()
    if cache_name not in REMEMBERING:
        cache["k"] = value  # type: ignore[assignment]  # NoCache keeps nothing, whatever it is given
        assert len(cache) == 0
        return
    with pytest.raises(error, match=re.escape(message)):
        cache["k"] = value  # type: ignore[assignment]
    assert "k" not in cache


def test_an_int_subclass_is_stored_as_its_number() -> None:
    class Size(enum.IntEnum):
        SMALL = 2

    cache = koila.GlobalCache()
    cache["k"] = Size.SMALL
    assert type(cache["k"]) is int
    assert cache["k"] == 2


def test_contract_pop_and_popitem(cache_name: str, make_cache: Callable[..., koila.SizeCache]) -> None:
    cache = make_cache()
    if cache_name not in REMEMBERING:
        return
    first, second = _some_key(cache_name, "first"), _some_key(cache_name, "second")
    cache[first], cache[second] = 4, 2
    assert cache.pop(first) == 4
    assert cache.pop(first, None) is None
    with pytest.raises(KeyError):
        cache.pop(first)
    assert cache.popitem() == (second, 2)
    with pytest.raises(KeyError, match="is empty"):
        cache.popitem()
    assert cache.lookup(first) is None  # a size popped is not remembered as the latest either


def test_contract_reading_a_key_keeps_it_and_looking_does_not(
    cache_name: str, make_cache: Callable[..., koila.SizeCache]
) -> None:
    if cache_name not in REMEMBERING:
        return
    a, b, c, d = (_some_key(cache_name, name) for name in "abcd")
    cache = make_cache(maxsize=2)
    cache[a], cache[b] = 1, 2
    assert cache[a] == 1  # used: now b is the least recently used
    cache[c] = 3
    assert sorted(cache) == sorted([a, c])
    assert b not in cache
    assert a in cache  # looking is not using: a stays the least recently used
    assert dict(cache.items()) == {a: 1, c: 3}
    cache[d] = 4
    assert sorted(cache) == sorted([c, d])


def test_a_key_function_that_returns_an_unhashable_key_is_named_in_the_error() -> None:
    def per_phase(function: object, caller: object, device: object, sample: object = None) -> Any:
        return ["eval", device]  # a list, not a tuple

    @koila.batch(initial=8, cache=koila.GlobalCache(key=per_phase))
    def work(batch_size: int) -> int:
        return batch_size

    with pytest.raises(TypeError, match=r"key must be hashable, and this call's key is list \['eval'") as info:
        work()
    assert "A key function of yours (key=) must return a tuple" in str(info.value)


def test_a_key_that_holds_an_unhashable_part_names_it() -> None:
    def per_phase(function: object, caller: object, device: object, sample: object = None) -> Any:
        return ("eval", {"phase": 1})

    @koila.batch(initial=8, cache=koila.GlobalCache(key=per_phase))
    def work(batch_size: int) -> int:
        return batch_size

    with pytest.raises(TypeError, match=r"of which dict \{'phase': 1\} cannot be\."):
        work()


@dataclasses.dataclass
class _Evaluator:
    """A callable object with ``__eq__`` and no ``__hash__``, as a dataclass makes it."""

    scale: float

    def __call__(self, batch_size: int) -> float:
        if batch_size > 16:
            raise make_oom()
        return self.scale * batch_size


@pytest.mark.parametrize("cache", [None, koila.GlobalCache()], ids=["default", "global"])
def test_a_callable_that_cannot_be_hashed_is_keyed_by_its_code(cache: koila.GlobalCache | None) -> None:
    """It was the key itself: every call raised that a key must be hashable."""
    evaluate = koila.batch(_Evaluator(2.0), initial=64, **({} if cache is None else {"cache": cache}))
    for _ in range(2):  # one line: one key for the default cache too
        assert evaluate() == 32.0
    assert evaluate.stats.ooms == 2  # 64 and 32 failed once; the second call started at the size that worked


def test_a_key_an_interrupt_kept_from_being_stored_is_evicted_without_error() -> None:
    # A Ctrl-C between the two writes of a store leaves the key in the LRU's order without a size.
    cache = koila.GlobalCache(maxsize=2)
    cache._order["interrupted"] = None
    for index, key in enumerate(["a", "b", "c"]):
        cache[key] = 8 + index
    assert dict(cache.items()) == {"b": 9, "c": 10}
    del cache["c"]
    cache._order["cut short"] = None  # and a removal cut short: the size gone, the order not
    cache["d"] = 4
    cache["e"] = 2
    assert dict(cache.items()) == {"d": 4, "e": 2}


@pytest.mark.parametrize(
    "wrap",
    [
        lambda model: torch.compile(model, backend="eager"),
        torch.nn.DataParallel,
        lambda model: torch.compile(torch.nn.DataParallel(model), backend="eager"),
    ],
    ids=["compiled", "data-parallel", "both"],
)
def test_a_wrapped_model_is_keyed_by_the_model_it_wraps(wrap: Callable[[torch.nn.Module], Any]) -> None:
    # Every compiled model's forward is Module._forward_unimplemented: one key would hold all their sizes.
    small, big = torch.nn.Linear(4, 2), torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    cache = koila.GlobalCache()
    fits = oom_above(16)
    big.register_forward_pre_hook(lambda module, args: fits(len(args[0])))
    x = torch.randn(64, 4)
    with torch.no_grad():
        koila.chunked(wrap(big), x, initial=64, cache=cache)
        rows: list[int] = []
        small.register_forward_pre_hook(lambda module, args: rows.append(len(args[0])))
        koila.chunked(wrap(small), x, initial=64, cache=cache)
    assert rows == [64], "the small model started at the big one's size"
    assert [key[2] for key in cache] == ["Sequential.forward"]


class _Decorated(torch.nn.Module):
    def __init__(self, fits: int) -> None:
        super().__init__()
        self.fits = oom_above(fits)

    @torch.no_grad()  # a decorated forward, as every Hugging Face model's is
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.fits(len(x))
        return x * 2


class _Big(_Decorated):
    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.fits(len(x))
        return x * 3


def test_models_whose_forward_is_decorated_are_keyed_by_their_own_forward() -> None:
    # Both were keyed by torch's decorator's wrapper: the small model started at the big one's size, and
    # being a cached size, never grew back; every Hugging Face model shared one key (probe 71A).
    cache = koila.GlobalCache()
    x = torch.randn(64, 4)
    koila.chunked(_Big(16), x, initial=64, cache=cache)
    rows: list[int] = []
    small = _Decorated(32)
    small.register_forward_pre_hook(lambda module, args: rows.append(len(args[0])))
    koila.chunked(small, x, initial=64, cache=cache)
    assert rows == [64, 32, 32], "the small model started at the big one's size"
    assert sorted((key[2], size) for key, size in cache.items()) == [("_Big.forward", 16), ("_Decorated.forward", 32)]


@pytest.mark.filterwarnings("ignore:`torch.jit.:DeprecationWarning")
def test_torchscript_models_are_run_and_keyed_by_the_class_they_were_made_from() -> None:
    # A scripted or traced model crashed every front end with an AttributeError (its _modules has no
    # get()); past that, every one would have had the same key (probe 71A).
    small, big = torch.nn.Linear(4, 2), torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    x = torch.randn(64, 4)
    scripted, traced = torch.jit.script(small), torch.jit.trace(big, x[:2])
    with torch.no_grad():
        for model in (scripted, traced):
            torch.testing.assert_close(koila.chunked(model, x, initial=16, cache=koila.GlobalCache()), model(x))
    retraced = torch.jit.trace(big, x[:2])  # a class made again, its name counted by TorchScript
    assert [function_identity(model)[2] for model in (scripted, traced, retraced)] == [
        "__torch__.torch.nn.modules.linear.Linear",
        "__torch__.torch.nn.modules.container.Sequential",
        "__torch__.torch.nn.modules.container.Sequential",
    ]


@dataclasses.dataclass(frozen=True)
class _Weighted:
    """A callable whose == is its fields' (a dataclass's), hashed by the tensor's identity."""

    weight: torch.Tensor
    fails: bool = dataclasses.field(compare=False)

    def __call__(self, batch_size: int) -> int:
        if self.fails and batch_size > 2:
            raise make_oom()
        return batch_size


@pytest.mark.parametrize("elements", [1, 3])
def test_callables_with_an_eq_of_their_own_are_told_apart_as_a_dict_tells_them(elements: int) -> None:
    # koila's key holds the callable as it is: the latest-key shortcut compared two with their own == (probe
    # 76E), which raised for tensors of several elements and, for one, gave one object the other's entry.
    cache = koila.StackMemoryCache()
    failing = koila.batch(_Weighted(torch.ones(elements), True), initial=8, cache=cache)
    fitting = koila.batch(_Weighted(torch.ones(elements), False), initial=8, cache=cache)
    sizes = []
    for _ in range(2):
        for step in (failing, fitting):  # from one place: keys that differ by the callable alone
            sizes.append(step())
    assert sizes == [2, 8, 2, 8]
    assert (failing.stats.ooms, fitting.stats.ooms) == (2, 0)  # the second call of each found its own size


def test_the_latest_key_of_a_function_or_its_identity_is_remembered_as_it_is() -> None:
    # As it is, a repeat is matched by tuple ==; as a _DictKey, by hash and == on every hit (twice the cost).
    cache = koila.StackMemoryCache()
    cpu = torch.device("cpu")
    for function in (_doubled, function_identity(_doubled)):
        key = (function, cpu, 30, "file.py", "main", 42)
        cache[key] = 8
        assert cache.lookup(key[:1] + key[1:]) == 8  # equal, not the same tuple
        assert type(cache._recent[0][0]) is tuple  # type: ignore[index]


def test_callables_behind_a_context_decorator_are_keyed_by_what_each_wraps() -> None:
    # torch.no_grad()(module) and the like ran one wrapper: every one shared its key (probe 76I).
    class Fails(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if len(x) > 2:
                raise make_oom()
            return x * 2

    rows: list[int] = []

    class Fits(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            rows.append(len(x))
            return x + 1

    cache = koila.GlobalCache()
    x = torch.ones(16, 3)
    koila.chunked(torch.inference_mode()(Fails()), x, initial=16, cache=cache)
    koila.chunked(torch.inference_mode()(Fits()), x, initial=16, cache=cache)
    assert rows == [16]
    assert [key[2] for key in cache] == [
        "test_callables_behind_a_context_decorator_are_keyed_by_what_each_wraps.<locals>.Fails.forward"
    ]


def _doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _plus_one(x: torch.Tensor) -> torch.Tensor:
    return x + 1


@pytest.mark.filterwarnings("ignore:`torch.jit.:DeprecationWarning")
def test_scripted_functions_are_keyed_by_the_function_each_was_made_from(tmp_path: Path) -> None:
    # Every ScriptFunction was ("torch.jit", 0, "torch.jit.ScriptFunction"): one size for all, in a DiskCache too.
    doubled, plus_one = torch.jit.script(_doubled), torch.jit.script(_plus_one)
    assert function_identity(doubled) == function_identity(_doubled)
    assert function_identity(plus_one) == function_identity(_plus_one)
    cache = koila.GlobalCache()
    cache[function_identity(doubled)] = 2
    x = torch.ones(8, 2)
    assert torch.equal(koila.chunked(plus_one, x, initial=8, cache=cache), x + 1)
    assert cache.cache_info().hits == 0
    disk = koila.DiskCache(tmp_path / "sizes.json")
    cpu = torch.device("cpu")
    assert disk.key(doubled, None, cpu) != disk.key(plus_one, None, cpu)


def test_the_latest_key_is_matched_as_a_dict_matches_keys_even_keys_holding_tensors() -> None:
    """A key function that returned ("phase", tensor): the second call raised "Boolean value of Tensor with more than
    one value is ambiguous", the latest-key shortcut comparing keys with == where a dict hashes a tensor by its id."""
    fits = oom_above(4)
    cache = koila.GlobalCache(key=lambda *parts: ("phase", torch.tensor([1.0, 2.0])))  # a new tensor every call

    @koila.batch(initial=16, cache=cache)
    def step(batch_size: int) -> int:
        fits(batch_size)
        return batch_size

    assert [step(), step()] == [4, 4]
    assert cache.cache_info().misses == 2  # each call's key is another to a dict: a miss, not an error

    # One-element tensors: == says True, where a dict tells two of them apart (and finds the same one again).
    one = koila.GlobalCache()
    kept = torch.tensor(1.0)
    one[kept] = 8
    plain: dict[object, int] = {kept: 8}
    for key in (kept, torch.tensor(1.0), kept, torch.tensor(1.0)):
        assert one.lookup(key) == plain.get(key)
