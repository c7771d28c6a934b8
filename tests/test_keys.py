"""Key functions: what each key holds, and caches that take one, the user's own included (issue 28)."""

from __future__ import annotations

import copy
import gc
import inspect
import json
import pickle
import re
import sys
import weakref
from collections.abc import Hashable
from pathlib import Path
from types import FrameType, MethodType
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import koila_retry as koila
from koila_retry._core.cache import weak_method
from koila_retry._core.memory import describe_device
from koila_retry.compat.toma import StacktraceMemoryBatchsizeCache
from koila_retry.testing import oom_above, simulated_device

CPU = torch.device("cpu")
MiB = 2**20
SAMPLE = (((8,), "torch.float32"),)


def evaluate(batch_size: int) -> int:
    return batch_size


def _called(key: koila.KeyFunction, sample: Hashable = None, device: torch.device = CPU) -> Any:
    """Make a key as a cache does: the caller waits at the line that called, here the line that calls this."""
    return key(evaluate, sys._getframe(1), device, sample)


def test_stack_key_is_the_function_device_free_memory_bucket_and_calling_line() -> None:
    with simulated_device("64MiB"):  # nothing allocated: 64 MiB free, bucket 27
        keys = []
        for _ in range(2):
            keys.append(_called(koila.stack_key))
        other_line = _called(koila.stack_key)
        with_sample = _called(koila.stack_key, SAMPLE)
        no_caller = koila.stack_key(evaluate, None, CPU)
    code = test_stack_key_is_the_function_device_free_memory_bucket_and_calling_line.__code__
    assert keys[0] == keys[1]  # one line
    assert keys[0][:5] == (evaluate, CPU, (64 * MiB).bit_length(), code.co_filename, code.co_name)
    assert other_line[:5] == keys[0][:5]
    assert other_line[5] != keys[0][5]
    assert isinstance(keys[0][5], int)
    assert len(keys[0]) == 6
    assert with_sample[:4] == (evaluate, CPU, 27, SAMPLE)
    assert len(with_sample) == 7
    assert no_caller == (evaluate, CPU, 27)
    with simulated_device("16MiB"):  # a quarter of the memory: another bucket
        assert _called(koila.stack_key)[2] == 25


def test_deep_stack_key_names_the_innermost_frames() -> None:
    key2 = koila.deep_stack_key(2)

    def helper() -> tuple[Hashable, Hashable]:
        return _called(key2), _called(koila.stack_key)

    def first() -> tuple[Hashable, Hashable]:
        return helper()

    def second() -> tuple[Hashable, Hashable]:
        return helper()

    with simulated_device("64MiB"):
        (deep_a, shallow_a), (deep_b, shallow_b) = first(), second()
        sampled = key2(evaluate, sys._getframe(0), CPU, SAMPLE)
    assert isinstance(deep_a, tuple)
    assert isinstance(shallow_a, tuple)
    assert isinstance(sampled, tuple)
    assert shallow_a == shallow_b  # one line in the helper
    assert deep_a != deep_b  # called from two places
    assert deep_a[:5] == (evaluate, CPU, 27, __file__, "helper")
    assert len(deep_a) == 3 + 2 * 3
    assert deep_a[6:8] == (first.__code__.co_filename, "first")  # then the frame that called it
    assert sampled[:4] == (evaluate, CPU, 27, SAMPLE)
    assert len(sampled) == 4 + 2 * 3


def test_deep_stack_key_of_one_is_the_stack_key_and_of_maxsize_the_whole_stack() -> None:
    assert koila.deep_stack_key(1) is koila.stack_key
    depth = 0
    walked: FrameType | None = sys._getframe(0)
    while walked is not None:
        depth, walked = depth + 1, walked.f_back
    toma = StacktraceMemoryBatchsizeCache()
    with simulated_device("64MiB"):
        # One line: the whole stack's key, the toma stand-in's, which is the same, and one
        # of more frames than the stack has.
        key, tomas, deeper = (
            _called(key) for key in (koila.deep_stack_key(sys.maxsize), toma.key, koila.deep_stack_key(10_000))
        )
    assert isinstance(key, tuple)
    assert len(key) == 3 + 3 * (depth + 1)  # and the generator's frame
    assert tomas == key
    assert deeper == key


@pytest.mark.parametrize("depth", [0, -1, True, 2.0, "2"])
def test_deep_stack_key_rejects_a_bad_depth(depth: object) -> None:
    with pytest.raises(ValueError, match=f"depth must be an int >= 1, got {depth!r}"):
        koila.deep_stack_key(depth)  # type: ignore[arg-type]


def test_global_size_class_and_no_key() -> None:
    frame = sys._getframe(0)
    assert koila.global_key(evaluate, frame, CPU, SAMPLE) == evaluate
    # Neither the calling line nor the free memory plays a part in the size-class key.
    with simulated_device("64MiB"):
        here = koila.size_class_key(evaluate, frame, CPU, SAMPLE)
    with simulated_device("1GiB"):
        elsewhere = koila.size_class_key(evaluate, None, CPU, SAMPLE)
    assert here == elsewhere == (evaluate, CPU, SAMPLE)
    assert koila.size_class_key(evaluate, frame, CPU) == (evaluate, CPU, None)
    assert koila.size_class_key(evaluate, frame, torch.device("meta"), SAMPLE) != here
    assert koila.no_key(evaluate, frame, CPU, SAMPLE) is None  # type: ignore[func-returns-value]


def test_each_cache_applies_its_key_function(tmp_path: Path) -> None:
    assert koila.StackMemoryCache().key_function is koila.stack_key
    assert koila.GlobalCache().key_function is koila.global_key
    assert koila.NoCache().key_function is koila.no_key
    assert koila.DiskCache(tmp_path / "sizes.json").key_function is koila.size_class_key
    with simulated_device("64MiB"):
        cached, made = (_called(key) for key in (koila.StackMemoryCache(depth=2).key, koila.deep_stack_key(2)))
    assert cached == made
    # The default cache's key() is the key function itself: a cached call pays for no
    # wrapper around it.
    assert koila.StackMemoryCache().key is koila.stack_key


# -- a key function of the user's ----------------------------------------------------------------


def test_a_users_key_function_decides_hits_and_misses_of_a_real_out_of_memory() -> None:
    mode = ["short"]
    seen: list[tuple[object, ...]] = []

    def by_mode(function: object, caller: FrameType | None, device: torch.device, sample: Hashable) -> Hashable:
        seen.append((function, caller, device, sample))
        return (function, mode[0])

    cache = koila.StackMemoryCache(key=by_mode)
    tried: list[int] = []

    @koila.batch(initial=64, cache=cache)
    def run(batch_size: int) -> int:
        tried.append(batch_size)
        with simulated_device("20MiB"):
            torch.empty(batch_size * MiB // 4)  # a MiB per row: 16 rows fit
        return batch_size

    assert run() == 16
    assert tried == [64, 32, 16]
    tried.clear()
    assert run() == 16  # another line: a stack key would miss; this key is the same
    assert tried == [16]
    mode[0] = "long"
    tried.clear()
    assert run() == 16  # another key: a miss, from the initial size
    assert tried == [64, 32, 16]
    identity = run.__wrapped__  # type: ignore[attr-defined]  # batch keys the function itself
    assert sorted(cache.items()) == [((identity, "long"), 16), ((identity, "short"), 16)]
    assert cache.cache_info()[:2] == (1, 2)
    # Called with all four arguments, the sample too, though batch sees no inputs.
    assert seen[0][0] == identity
    assert seen[0][2] == CPU
    assert seen[0][3] is None
    assert isinstance(seen[0][1], FrameType)


def _run_twice(cache: koila.SizeCache) -> tuple[int, object]:
    """Call a function where 16 rows fit twice, from two lines; return the OOMs raised, and the function."""
    fits = oom_above(16)

    @koila.batch(initial=64, cache=cache)
    def run(batch_size: int) -> int:
        fits(batch_size)
        return batch_size

    assert run() == 16
    assert run() == 16
    return fits.raised, run.__wrapped__  # type: ignore[attr-defined]


def test_a_users_key_function_that_returns_none_keeps_nothing() -> None:
    cache = koila.GlobalCache(key=lambda function, caller, device, sample: None)
    assert _run_twice(cache)[0] == 4  # 64 and 32, twice: nothing was remembered
    assert len(cache) == 0


def test_a_users_key_function_gets_no_free_memory_fallback() -> None:
    # Keys with the stack key's layout, from a function of the user's: its third part is
    # not a free-memory level, and a neighbouring value is not a related key.
    cache = koila.StackMemoryCache(key=lambda function, caller, device, sample: (function, device, 5))
    cache[(evaluate, CPU, 6)] = 8
    assert cache.lookup((evaluate, CPU, 5)) is None
    for stack in (koila.stack_key, koila.deep_stack_key(3)):
        cache = koila.StackMemoryCache(key=stack)
        cache[(evaluate, CPU, 6, "file", "name", 2)] = 8
        assert cache.lookup((evaluate, CPU, 5, "file", "name", 2)) == 8


def test_a_subclass_that_overrides_key_still_decides() -> None:
    class PerFunction(koila.StackMemoryCache):
        def key(
            self, function: object, caller: FrameType | None, device: torch.device, sample: Hashable = None
        ) -> Hashable:
            parent = super().key(function, caller, device, sample)
            assert isinstance(parent, tuple)
            assert parent[0] == function  # the stack key, through super()
            return ("mine", function)

    cache = PerFunction()
    raised, run = _run_twice(cache)
    assert raised == 2  # another line, the same key
    assert list(cache) == [("mine", run)]


@pytest.mark.parametrize("make", [koila.StackMemoryCache, koila.GlobalCache])
@pytest.mark.parametrize("key", [3, "stack", (koila.stack_key,)])
def test_a_key_that_is_not_callable_is_refused(make: type[koila.SizeCache], key: object) -> None:
    with pytest.raises(TypeError, match="key must be a function .* got " + re.escape(f"{type(key).__name__} {key!r}")):
        make(key=key)  # type: ignore[arg-type]


def test_disk_cache_refuses_a_key_that_is_not_callable(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="key must be a function .* got int 3"):
        koila.DiskCache(tmp_path / "sizes.json", key=3)  # type: ignore[arg-type]


def test_depth_and_key_are_not_both_given() -> None:
    with pytest.raises(ValueError, match="depth applies to the stack key: give depth=2 or key=.*global_key"):
        koila.StackMemoryCache(depth=2, key=koila.global_key)
    with pytest.raises(ValueError, match="depth must be an int >= 1, got 0"):
        koila.StackMemoryCache(depth=0, key=koila.global_key)


# -- DiskCache: keys as text ---------------------------------------------------------------------


def test_disk_cache_default_key_text_is_the_first_releases(tmp_path: Path) -> None:
    filename, line = evaluate.__code__.co_filename, evaluate.__code__.co_firstlineno
    before = f"evaluate ({filename}:{line}) on {describe_device(CPU)}"
    for cache in (
        koila.DiskCache(tmp_path / "default.json"),
        koila.DiskCache(tmp_path / "given.json", key=koila.size_class_key),
    ):
        assert cache.key(evaluate, sys._getframe(0), CPU) == before
        assert cache.key(evaluate, None, CPU, SAMPLE) == f"{before} for samples {SAMPLE}"


def test_disk_cache_reads_a_file_written_in_the_first_releases_format(tmp_path: Path) -> None:
    fits = oom_above(16)

    def run(batch_size: int) -> int:
        fits(batch_size)
        return batch_size

    filename, line = run.__code__.co_filename, run.__code__.co_firstlineno
    stored = {f"{run.__qualname__} ({filename}:{line}) on {describe_device(CPU)}": 16}
    path = tmp_path / "sizes.json"
    path.write_text(json.dumps({"format": "koila-retry size cache", "version": 1, "sizes": stored}))
    assert koila.batch(initial=64, cache=koila.DiskCache(path))(run)() == 16
    assert fits.raised == 0


def test_disk_cache_writes_a_users_key_as_stable_text(tmp_path: Path) -> None:
    def tagged(function: object, caller: FrameType | None, device: torch.device, sample: Hashable) -> Hashable:
        return (evaluate, device, "tag", 3, None, (1.5,))

    cache = koila.DiskCache(tmp_path / "sizes.json", key=tagged)
    filename, line = evaluate.__code__.co_filename, evaluate.__code__.co_firstlineno
    text = f"(evaluate ({filename}:{line}), {describe_device(CPU)}, 'tag', 3, None, (1.5,))"
    assert cache.key(evaluate, None, CPU) == text
    assert koila.DiskCache(tmp_path / "str.json", key=lambda *call: "mine").key(evaluate, None, CPU) == "mine"
    assert koila.DiskCache(tmp_path / "none.json", key=koila.no_key).key(evaluate, None, CPU) is None


def test_disk_cache_with_a_users_key_starts_the_next_run_at_the_size_that_worked(tmp_path: Path) -> None:
    path = tmp_path / "sizes.json"

    def per_device(function: object, caller: FrameType | None, device: torch.device, sample: Hashable) -> Hashable:
        return ("evaluation", device)  # one size for every function, per device

    def run_once() -> tuple[int, int]:
        fits = oom_above(16)

        @koila.batch(initial=64, cache=koila.DiskCache(path, key=per_device))
        def run(batch_size: int) -> int:
            fits(batch_size)
            return batch_size

        return run(), fits.raised

    assert run_once() == (16, 2)
    assert json.loads(path.read_text())["sizes"] == {f"('evaluation', {describe_device(CPU)})": 16}
    assert run_once() == (16, 0)  # a new cache on the file: a hit, with no OOM


def test_stack_key_with_a_sample_is_the_innermost_frame_of_a_deep_key() -> None:
    # accumulate's keys (with a sample) are made without the deep key's walk: the same tuple.
    def keys_of(caller: FrameType) -> tuple[Hashable, Hashable, int]:
        # The caller waits at one bytecode offset while this runs.
        made = koila.stack_key(evaluate, caller, CPU, SAMPLE), koila.deep_stack_key(2)(evaluate, caller, CPU, SAMPLE)
        return (*made, caller.f_lasti)

    frame = sys._getframe(0)
    with simulated_device("64MiB"):
        shallow, deep, offset = keys_of(frame)
    code = frame.f_code
    assert shallow == (evaluate, CPU, 27, SAMPLE, code.co_filename, code.co_name, offset)
    assert isinstance(deep, tuple)
    assert deep[:7] == shallow


def test_the_files_a_deep_key_has_met_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    # One entry per file name ever met on a stack: generated code (FX, notebook cells) names without end (72K).
    from koila_retry._core import keys

    monkeypatch.setattr(keys, "_OURS", {})
    monkeypatch.setattr(keys, "_KNOWN", 8)
    key = koila.deep_stack_key(3)
    for number in range(50):
        code = compile("key(None, sys._getframe(), CPU)", f"<generated-{number}>", "eval")
        eval(code, {"key": key, "sys": sys, "CPU": CPU})
    assert len(keys._OURS) <= 9 + 3


_SEEN: list[Hashable] = []


def _recording(function: object, caller: FrameType | None, device: torch.device, sample: Hashable = None) -> Hashable:
    key = _KEY[0](function, caller, device, sample)
    _SEEN.append(key)
    return key


_KEY: list[koila.KeyFunction] = [koila.stack_key]


class _Scorer(torch.nn.Module):
    @koila.batch(initial=8, cache=koila.StackMemoryCache(key=_recording))
    def forward(self, batch_size: int, x: torch.Tensor) -> torch.Tensor:
        return x * batch_size


@torch.no_grad()
@koila.batch(initial=8, cache=koila.StackMemoryCache(key=_recording))
def _scored(batch_size: int, x: torch.Tensor) -> torch.Tensor:
    return x * batch_size


@torch.autocast("cpu", enabled=False)
@koila.batch(initial=8, cache=koila.StackMemoryCache(key=_recording))
def _cast(batch_size: int, x: torch.Tensor) -> torch.Tensor:
    return x * batch_size


@pytest.mark.parametrize("depth", [1, 2])
def test_a_call_through_torchs_frames_is_keyed_by_the_line_that_called_it(depth: int) -> None:
    # Not by torch's Module.__call__, no_grad's or autocast's wrapper, a Sequential's forward or checkpoint,
    # which every call passes through: each had one size for every line.
    scorer, x = _Scorer(), torch.ones(2)
    hooked = _Scorer()
    hooked.register_forward_hook(lambda module, args, out: None)  # Module.__call__ then runs it in a closure
    stacked = nn.Sequential(nn.Identity(), _Scorer())
    _KEY[0] = koila.deep_stack_key(depth)
    _SEEN.clear()
    try:
        for _ in range(2):  # each line twice
            scorer(x)
            scorer(x)
            hooked(x)
            _scored(x)
            _scored(x)
            _cast(x)
            stacked(x)
            checkpoint(scorer, x, use_reentrant=False)
    finally:
        _KEY[0] = koila.stack_key
    code = test_a_call_through_torchs_frames_is_keyed_by_the_line_that_called_it.__code__
    lines = 8
    first = [key[3:6] for key in _SEEN[:lines]]
    assert [key[3:6] for key in _SEEN[lines:]] == first
    assert all(where[:2] == (code.co_filename, code.co_name) for where in first)
    assert len(set(first)) == lines  # a key for each line


class _Shared(nn.Module):
    """Decorates its own method in ``__init__`` with a cache it is given (a sweep of models sharing one)."""

    def __init__(self, cache: koila.SizeCache, fits: Any) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.fits = fits
        self.run = koila.batch(initial=8, cache=cache)(self._work)

    def _work(self, batch_size: int, x: torch.Tensor) -> torch.Tensor:
        self.fits(batch_size)
        return torch.cat([self.lin(rows) for rows in x.split(batch_size)])


@pytest.mark.parametrize(
    "make",
    [koila.StackMemoryCache, koila.GlobalCache, lambda: koila.StackMemoryCache(key=lambda f, c, d, s: (f, d))],
    ids=["stack", "global", "users"],
)
def test_a_cache_shared_by_wrappers_made_in_init_keeps_none_of_their_objects_alive(make: Any) -> None:
    # Its keys held each wrapper's bound method, and with it the model: every model of a sweep lived as
    # long as the cache (probe 74M).
    cache, fits = make(), oom_above(4)
    models: list[weakref.ref[_Shared]] = []
    for _ in range(3):
        model = _Shared(cache, fits)
        model.run(torch.randn(10, 4))
        assert model.run.stats.batch_size == 4
        assert model.run(torch.randn(10, 4)).shape == (10, 2)
        models.append(weakref.ref(model))
        del model
    gc.collect()
    assert len(cache) >= 3
    assert [model() for model in models] == [None, None, None]
    assert all("no longer exists" in repr(key) for key in cache)
    # A model made now, perhaps where a gone one lived, finds none of their sizes: it starts at 8.
    fresh = _Shared(cache, oom_above(100))
    fresh.run(torch.randn(10, 4))
    assert fresh.run.stats.batch_size == 8


def test_a_method_s_weak_key_is_the_method_while_its_object_lives(tmp_path: Path) -> None:
    cache, model = koila.GlobalCache(), _Shared(koila.NoCache(), oom_above(100))
    model.run = koila.batch(initial=8, cache=cache)(model._work)
    cache[model.run.__wrapped__] = 2  # the documented way to set a size (recovery.rst)
    model.run(torch.randn(10, 4))
    assert model.run.stats.batch_size == 2
    assert cache.cache_info().hits == 1
    (key,) = cache.keys()  # yours, stored as the wrapper's own stores are: holding the object weakly
    assert type(key) is not MethodType
    assert key == model._work
    assert model._work == key
    assert hash(key) == hash(model._work)
    assert key != _Shared(cache, oom_above(100))._work  # another object's
    assert key.__qualname__ == "_Shared._work"
    assert key.__self__ is model
    assert torch.equal(key(3, torch.ones(1, 4)), model._work(3, torch.ones(1, 4)))  # callable as the method
    assert copy.deepcopy(key) is key
    # Pickled with the cache, it is the method: its object goes along, as it did before it was held weakly.
    owner = _Counted()
    loaded = pickle.loads(pickle.dumps(weak_method(owner.count)))
    assert loaded.__func__ is _Counted.count
    assert loaded.__self__.total == 7
    # A DiskCache names it as it names the method (the text the next run reads).
    disk = koila.DiskCache(tmp_path / "sizes.json", key=koila.global_key)
    assert disk.key(key, None, CPU) == disk.key(model._work, None, CPU)
    assert "_Shared._work (" in disk.key(key, None, CPU)


def test_a_weak_key_s_object_gone_matches_nothing_and_pickles_as_a_description() -> None:
    cache = koila.GlobalCache()
    model = _Shared(cache, oom_above(4))
    model.run(torch.randn(10, 4))
    (key,) = cache.keys()
    del model
    gc.collect()
    assert key.__self__ is None
    assert key != key.__func__
    assert "no longer exists" in repr(key)
    with pytest.raises(ReferenceError, match="no longer exists"):
        key(4, torch.ones(1, 4))
    assert "_Shared._work" in pickle.loads(pickle.dumps(key))


class _Counted:
    def __init__(self) -> None:
        self.total = 7

    def count(self, batch_size: int) -> int:
        return self.total


_FITS_2 = oom_above(2)


class _Slotted:
    """An object without weak references: its method stays the key, as before."""

    __slots__ = ("seen",)

    def __init__(self) -> None:
        self.seen: list[int] = []

    def work(self, batch_size: int) -> int:
        self.seen.append(batch_size)
        _FITS_2(batch_size)
        return batch_size


def test_an_object_without_weak_references_is_keyed_by_its_method() -> None:
    cache, owner = koila.GlobalCache(), _Slotted()
    run = koila.batch(initial=8, cache=cache)(owner.work)
    assert run() == 2
    (key,) = cache
    assert type(key) is MethodType
    assert key == owner.work
    assert run() == 2
    assert owner.seen == [8, 4, 2, 2]


def test_a_size_you_set_by_the_method_keeps_none_of_a_sweep_s_models_alive() -> None:
    # cache[step.__wrapped__] = 4 stored the bound method itself as the key, and the wrapper's own stores
    # reused it: every model of the sweep stayed alive (probe 75G).
    cache = koila.GlobalCache()
    models: list[weakref.ref[_Shared]] = []
    for _ in range(3):
        model = _Shared(cache, oom_above(4))
        cache[model.run.__wrapped__] = 4
        assert model.run(torch.randn(64, 4)).shape == (64, 2)
        assert model.run.stats.batch_size == 4
        models.append(weakref.ref(model))
        del model
    gc.collect()
    assert [model() for model in models] == [None, None, None]


def test_a_key_function_of_yours_gets_a_method_as_it_is() -> None:
    # It got the weak reference koila's own keys hold: its __module__, __doc__ and signature were the
    # reference's, so a key of f"{f.__module__}.{f.__qualname__}" changed, and inspect.ismethod was False.
    given: list[Any] = []

    def mine(function: Any, caller: Any, device: torch.device, sample: Hashable = None) -> Hashable:
        given.append(function)
        return f"{function.__module__}.{function.__qualname__}"

    model = _Shared(koila.StackMemoryCache(key=mine), oom_above(4))
    model.run(torch.randn(10, 4))
    assert inspect.ismethod(given[0])
    assert given[0] == model._work
    assert given[0].__module__ == __name__
    assert next(iter(model.run.cache_info.__self__)) == f"{__name__}._Shared._work"
