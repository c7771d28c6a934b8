"""koila_retry.compat.toma: toma's API on the engine, side by side with the real toma where installed.

Tests parametrized over ``impl`` run the same code against ours and, when toma is
importable, against toma itself, and expect the same sizes, ranges and results from
both; a ``[toma]`` case is skipped without toma. The ``test_bug_*`` tests expect
different outcomes: the fix from ours, the bug from toma, so that the list of
differences in the module's docstring stays honest.
"""

from __future__ import annotations

import gc
import inspect
import itertools
import os
import re
import subprocess
import sys
import textwrap
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cachetools
import pytest
import torch
from torch import nn

import koila_retry as koila
import koila_retry.compat.toma as ct
from koila_retry._core import memory
from koila_retry._core.cache import function_identity
from koila_retry._core.memory import default_device
from koila_retry.compat.toma import batchsize_cache
from koila_retry.testing import make_oom, simulated_device

REPO = Path(__file__).resolve().parent.parent
OOM_MESSAGE = "CUDA out of memory. Tried to allocate 2.00 GiB"  # toma recognises it too


def oom() -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError(OOM_MESSAGE)


@dataclass(frozen=True)
class Impl:
    """One implementation of toma's API: ours, or toma's own."""

    name: str
    toma: Any
    explicit: Any
    simple: Any
    caches: dict[str, Any]


OURS = Impl(
    "ours",
    ct.toma,
    ct.explicit,
    ct.simple,
    {"no": ct.NoBatchsizeCache, "global": ct.GlobalBatchsizeCache, "stack": ct.StacktraceMemoryBatchsizeCache},
)


@pytest.fixture(autouse=True)
def _reset_compat() -> Iterator[None]:
    """Start every test with no toma contexts and the default cache type."""
    default = ct.DEFAULT_CACHE_TYPE
    ct._reset()
    yield
    ct._reset()
    ct.DEFAULT_CACHE_TYPE = default


@pytest.fixture(autouse=True)
def _fast_release(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Skip the engine's full garbage collection after each OOM (~0.1 s), unless a test asks for it."""
    if "real_release" not in request.fixturenames:
        monkeypatch.setattr(memory, "release", lambda device=None: None)


@pytest.fixture
def real_release() -> None:
    """Release memory after each OOM as the engine does: for tests of memory, not of sizes."""


@pytest.fixture
def real_toma(monkeypatch: pytest.MonkeyPatch) -> Impl:
    """The installed toma, made fast and deterministic without changing which sizes it tries."""
    toma_module = pytest.importorskip("toma")
    from toma import batchsize_cache as toma_caches

    # Two gc.collect() per call (~0.1 s each here) decide nothing about sizes.
    monkeypatch.setattr(toma_module, "gc_cuda", lambda: None)
    # Free CPU RAM in 256 MiB steps is part of toma's key: a step crossed between two
    # calls would start the second afresh. Ours reads its device's level once a second.
    monkeypatch.setattr(toma_caches.StacktraceMemoryBatchsizeCache, "TRACK_RAM", False)
    toma_module.get_cache_for_context.cache_clear()
    return Impl(
        "toma",
        toma_module.toma,
        toma_module.explicit,
        toma_module.simple,
        {
            "no": toma_caches.NoBatchsizeCache,
            "global": toma_caches.GlobalBatchsizeCache,
            "stack": toma_caches.StacktraceMemoryBatchsizeCache,
        },
    )


@pytest.fixture(params=["ours", "toma"])
def impl(request: pytest.FixtureRequest) -> Impl:
    if request.param == "ours":
        return OURS
    real: Impl = request.getfixturevalue("real_toma")
    return real


CACHES = ["no", "global", "stack"]


# --------------------------------------------------------------------------- 1. the same as toma


def batch_calls(impl: Impl, cache: str) -> tuple[list[object], list[int]]:
    tried: list[object] = []

    @impl.toma.batch(initial_batchsize=100, cache_type=impl.caches[cache])
    def run(batchsize: int, x: int, *, scale: int = 1) -> int:
        tried.append(batchsize)
        if batchsize > 30:
            raise oom()
        return batchsize * x * scale

    results = []
    for initial in (None, None, 200, 10):  # one line: a larger, then a smaller initial size
        overrides = {} if initial is None else {"toma_initial_batchsize": initial}
        results.append(run(2, scale=3, **overrides))
        tried.append("|")
    results.append(run(1))  # another line
    tried.append("|")
    return tried, results


@pytest.mark.parametrize(
    ("cache", "expected"),
    [
        ("no", [100, 50, 25, "|", 100, 50, 25, "|", 200, 100, 50, 25, "|", 10, "|", 100, 50, 25, "|"]),
        ("global", [100, 50, 25, "|", 25, "|", 25, "|", 25, "|", 25, "|"]),
        ("stack", [100, 50, 25, "|", 25, "|", 25, "|", 25, "|", 100, 50, 25, "|"]),
    ],
)
def test_batch_sizes_and_caches(impl: Impl, cache: str, expected: list[object]) -> None:
    tried, results = batch_calls(impl, cache)
    assert tried == expected
    last = 10 if cache == "no" else 25  # the cache starts above a smaller initial size, as toma does
    assert results == [150, 150, 150, last * 6, 25]


@pytest.mark.parametrize(
    ("cache", "expected"),
    [
        ("no", [20, "|", 200, 100, 50, 25, "|", 5, "|"]),
        ("global", [20, "|", 20, "|", 20, "|"]),
        ("stack", [20, "|", 20, "|", 20, "|"]),
    ],
)
def test_first_success_at_the_initial_size_is_remembered(impl: Impl, cache: str, expected: list[object]) -> None:
    tried: list[object] = []

    @impl.toma.batch(cache_type=impl.caches[cache])
    def run(batchsize: int) -> int:
        tried.append(batchsize)
        if batchsize > 30:
            raise oom()
        return batchsize

    for initial in (20, 200, 5):
        run(toma_initial_batchsize=initial)
        tried.append("|")
    assert tried == expected


def steps(start: int, end: int, step: int) -> list[tuple[int, int]]:
    return [(begin, min(begin + step, end)) for begin in range(start, end, step)]


FIRST_PASS = [(0, 64), (0, 32), *steps(0, 100, 16)]


@pytest.mark.parametrize(
    ("cache", "expected"),
    [
        ("no", [*FIRST_PASS, "|", *FIRST_PASS, "|", (10, 30), "|"]),
        ("global", [*FIRST_PASS, "|", *steps(0, 100, 16), "|", *steps(10, 30, 16), "|"]),
        ("stack", [*FIRST_PASS, "|", *steps(0, 100, 16), "|", (10, 30), "|"]),
    ],
)
def test_range_steps_and_caches(impl: Impl, cache: str, expected: list[object]) -> None:
    log: list[object] = []
    seen: list[int] = []

    @impl.toma.range(initial_step=64, cache_type=impl.caches[cache])
    def run(begin: int, end: int, out: list[int], *, offset: int = 0) -> str:
        log.append((begin, end))
        if end - begin > 20:
            raise oom()
        out.extend(range(begin + offset, end + offset))
        return "dropped"

    returned = []
    for _ in range(2):
        returned.append(run(0, 100, seen, offset=1000))
        log.append("|")
    returned.append(run(10, 30, seen))  # another line
    log.append("|")
    assert log == expected
    assert seen == [*range(1000, 1100), *range(1000, 1100), *range(10, 30)]  # every index once per call
    assert returned == [None, None, None]


@pytest.mark.parametrize(
    ("cache", "expected"),
    [
        ("no", [*FIRST_PASS, "|", *FIRST_PASS, "|", (0, 20), "|"]),
        ("global", [*FIRST_PASS, "|", *steps(0, 100, 16), "|", *steps(0, 20, 16), "|"]),
        ("stack", [*FIRST_PASS, "|", *steps(0, 100, 16), "|", (0, 20), "|"]),
    ],
)
def test_chunked_steps_with_a_remainder(impl: Impl, cache: str, expected: list[object]) -> None:
    log: list[object] = []
    chunks: list[tuple[int, int, int]] = []

    @impl.toma.chunked(initial_step=64, cache_type=impl.caches[cache])
    def run(chunk: torch.Tensor, begin: int, end: int, *, scale: int = 1) -> None:
        log.append((begin, end))
        if end - begin > 20:
            raise oom()
        chunks.append((int(chunk[0, 0]) * scale, chunk.shape[0], chunk.shape[1]))

    data = torch.arange(100).unsqueeze(1).repeat(1, 3)  # row i holds i
    returned = []
    for _ in range(2):
        returned.append(run(data, scale=2))
        log.append("|")
    returned.append(run(data[:20]))  # another line
    log.append("|")
    assert log == expected
    assert returned == [None, None, None]
    # Each chunk that ran is rows [begin, end) of the tensor; the keyword argument reached it.
    wanted, call = [], 0
    for entry in expected:
        if entry == "|":
            call += 1
        elif entry[1] - entry[0] <= 20:
            wanted.append((entry[0] * (2 if call < 2 else 1), entry[1] - entry[0], 3))
    assert chunks == wanted


def test_a_function_called_inside_another_finds_its_size_on_the_outers_next_call(impl: Impl) -> None:
    # The whole stack keyed the inner call, this library's frames too, which differ between an outer call
    # that found its size and one that did not: the inner's whole search ran again (probe 72E).
    tried: list[object] = []

    @impl.toma.batch(initial_batchsize=64)
    def inner(batchsize: int) -> int:
        tried.append(batchsize)
        if batchsize > 1:
            raise oom()
        return batchsize

    @impl.toma.batch(initial_batchsize=8)
    def outer(batchsize: int) -> int:
        @impl.toma.execute.batch(64)  # keyed by the caller's stack
        def also(size: int) -> int:
            tried.append(f"x{size}")
            if size > 2:
                raise oom()
            return size

        return inner()

    calls = []
    for _ in range(3):
        tried.clear()
        outer()
        calls.append(list(tried))
    assert calls[0] == ["x64", "x32", "x16", "x8", "x4", "x2", 64, 32, 16, 8, 4, 2, 1]
    assert calls[1:] == [["x2", 1], ["x2", 1]]


@pytest.mark.parametrize("cache", CACHES)
def test_execute_runs_at_once_and_caches_per_call_stack(impl: Impl, cache: str) -> None:
    log: list[object] = []
    bound: list[object] = []
    data = torch.zeros(50, 2)
    kind = impl.caches[cache]
    for _ in range(2):

        @impl.toma.execute.batch(100, cache_type=kind)
        def result(batchsize: int) -> int:
            log.append(("batch", batchsize))
            if batchsize > 30:
                raise oom()
            return batchsize

        @impl.toma.execute.range(0, 50, 32, cache_type=kind)
        def ranged(begin: int, end: int) -> None:
            log.append(("range", begin, end))
            if end - begin > 10:
                raise oom()

        @impl.toma.execute.chunked(data, 32, cache_type=kind)
        def chunked(chunk: torch.Tensor, begin: int, end: int) -> None:
            log.append(("chunked", begin, end, chunk.shape[0]))
            if end - begin > 10:
                raise oom()

        bound.append((result, ranged, chunked))
        log.append("|")
    fresh = [
        ("batch", 100),
        ("batch", 50),
        ("batch", 25),
        ("range", 0, 32),
        ("range", 0, 16),
        *[("range", b, e) for b, e in steps(0, 50, 8)],
        ("chunked", 0, 32, 32),
        ("chunked", 0, 16, 16),
        *[("chunked", b, e, e - b) for b, e in steps(0, 50, 8)],
        "|",
    ]
    cached = [("batch", 25), *[("range", b, e) for b, e in steps(0, 50, 8)]]
    cached += [*[("chunked", b, e, e - b) for b, e in steps(0, 50, 8)], "|"]
    assert log == fresh + (fresh if cache == "no" else cached)
    assert bound == [(25, None, None), (25, None, None)]  # the name is bound to the result


@pytest.mark.parametrize("cache", CACHES)
def test_explicit_passes_arguments_and_caches(impl: Impl, cache: str) -> None:
    log: list[object] = []
    kind = impl.caches[cache]

    def work(batchsize: int, a: int, b: int = 0, *, c: int = 0) -> int:
        log.append(("batch", batchsize, a, b, c))
        if batchsize > 30:
            raise oom()
        return batchsize + a + b + c

    def span(begin: int, end: int, a: int, *, c: int = 0) -> None:
        log.append(("range", begin, end, a, c))
        if end - begin > 10:
            raise oom()

    def piece(chunk: torch.Tensor, begin: int, end: int, *, c: int = 0) -> None:
        log.append(("chunked", begin, end, chunk.shape[0], c))
        if end - begin > 10:
            raise oom()

    data = torch.zeros(20, 2)
    results = []
    for _ in range(2):
        results.append(impl.explicit.batch(work, 100, 1, 2, c=3, toma_cache_type=kind))
        results.append(impl.explicit.range(span, 0, 20, 16, 7, c=8, toma_cache_type=kind))
        results.append(impl.explicit.chunked(piece, data, 16, c=9, toma_cache_type=kind))
        log.append("|")
    ranges = [("range", b, e, 7, 8) for b, e in steps(0, 20, 8)]
    chunks = [("chunked", b, e, e - b, 9) for b, e in steps(0, 20, 8)]
    fresh = [
        *[("batch", size, 1, 2, 3) for size in (100, 50, 25)],
        ("range", 0, 16, 7, 8),
        *ranges,
        ("chunked", 0, 16, 16, 9),
        *chunks,
        "|",
    ]
    cached = [("batch", 25, 1, 2, 3), *ranges, *chunks, "|"]
    assert log == fresh + (fresh if cache == "no" else cached)
    assert results == [31, None, None, 31, None, None]


def test_simple_passes_arguments_and_never_caches(impl: Impl) -> None:
    log: list[object] = []

    def work(batchsize: int, a: int, *, c: int = 0) -> int:
        log.append(("batch", batchsize, a, c))
        if batchsize > 30:
            raise oom()
        return batchsize + a + c

    def span(begin: int, end: int, a: int, *, c: int = 0) -> None:
        log.append(("range", begin, end, a, c))
        if end - begin > 10:
            raise oom()

    def piece(chunk: torch.Tensor, begin: int, end: int) -> None:
        log.append(("chunked", begin, end, tuple(chunk.shape)))
        if end - begin > 10:
            raise oom()

    rows, columns = torch.zeros(20, 2), torch.zeros(2, 20)
    results = []
    for _ in range(2):
        results.append(impl.simple.batch(work, 100, 1, c=3))
        results.append(impl.simple.range(span, 0, 20, 16, 7, c=8))
        results.append(impl.simple.chunked(piece, rows, 16))
        results.append(impl.simple.chunked(piece, columns, 16, 1))
        log.append("|")
    once = [
        *[("batch", size, 1, 3) for size in (100, 50, 25)],
        ("range", 0, 16, 7, 8),
        *[("range", b, e, 7, 8) for b, e in steps(0, 20, 8)],
        ("chunked", 0, 16, (16, 2)),
        *[("chunked", b, e, (e - b, 2)) for b, e in steps(0, 20, 8)],
        ("chunked", 0, 16, (2, 16)),
        *[("chunked", b, e, (2, e - b)) for b, e in steps(0, 20, 8)],
        "|",
    ]
    assert log == once + once
    assert results == [29, None, None, None] * 2


def test_contexts_name_the_cache_instance(impl: Impl) -> None:
    log: list[object] = []
    shared = impl.caches["global"]

    def first(batchsize: int) -> None:
        log.append(("first", batchsize))
        if batchsize > 30:
            raise oom()

    def second(batchsize: int) -> None:
        log.append(("second", batchsize))
        if batchsize > 30:
            raise oom()

    @impl.toma.batch(initial_batchsize=100, cache_type=shared)
    def third(batchsize: int) -> None:
        log.append(("third", batchsize))
        if batchsize > 30:
            raise oom()

    @impl.toma.range(initial_step=64, cache_type=shared, context="spans")
    def span_a(begin: int, end: int) -> None:
        log.append(("a", begin, end))
        if end - begin > 20:
            raise oom()

    @impl.toma.range(initial_step=64, cache_type=shared, context="spans")
    def span_b(begin: int, end: int) -> None:
        log.append(("b", begin, end))

    impl.explicit.batch(first, 100, toma_context="shared", toma_cache_type=shared)
    impl.explicit.batch(second, 100, toma_context="shared", toma_cache_type=shared)  # starts at first's
    impl.explicit.batch(second, 100, toma_cache_type=shared)  # its own context: the function
    impl.explicit.batch(second, 100, toma_context=second, toma_cache_type=shared)  # the same, named
    third(toma_context="shared")
    third()
    span_a(0, 100)
    span_b(0, 100)
    assert log == [
        *[("first", size) for size in (100, 50, 25)],
        ("second", 25),
        *[("second", size) for size in (100, 50, 25)],
        ("second", 25),
        ("third", 25),
        *[("third", size) for size in (100, 50, 25)],
        *[("a", begin, end) for begin, end in FIRST_PASS],
        *[("b", begin, end) for begin, end in steps(0, 100, 16)],
    ]


def test_giving_up_after_size_1_tries_every_halving(impl: Impl) -> None:
    tried: list[int] = []

    def run(batchsize: int) -> None:
        tried.append(batchsize)
        raise oom()

    with pytest.raises(torch.OutOfMemoryError) as excinfo:
        impl.explicit.batch(run, 100, toma_cache_type=impl.caches["no"])
    assert tried == [100, 50, 25, 12, 6, 3, 1]  # not powers of two, as in toma
    if impl is OURS:
        assert isinstance(excinfo.value, koila.BatchSizeExhausted)
        assert isinstance(excinfo.value.__cause__, torch.OutOfMemoryError)
        assert str(excinfo.value.__cause__) == OOM_MESSAGE
        assert excinfo.value.__cause__.__traceback__ is None  # holds no frame of the failed attempt
        assert "(100 -> 50 -> 25 -> 12 -> 6 -> 3 -> 1)" in str(excinfo.value)
    else:  # toma re-raises the last error itself
        assert str(excinfo.value) == OOM_MESSAGE
        assert excinfo.value.__traceback__ is not None


@pytest.mark.parametrize("form", ["batch", "range", "chunked"])
def test_giving_up_keeps_the_backends_text_that_handlers_match(impl: Impl, form: str) -> None:
    # toma re-raises the last error, and handlers (toma's should_reduce_batch_size, Lightning's
    # is_oom_error) look for "CUDA out of memory." in its first argument: the stand-in's error begins
    # with that error's first line.
    def run(*args: Any) -> None:
        raise oom()

    with pytest.raises(torch.OutOfMemoryError) as excinfo:
        if form == "batch":
            impl.explicit.batch(run, 4, toma_cache_type=impl.caches["no"])
        elif form == "range":
            impl.explicit.range(run, 0, 4, 4, toma_cache_type=impl.caches["no"])
        else:
            impl.explicit.chunked(run, torch.zeros(4), 4, toma_cache_type=impl.caches["no"])
    message = excinfo.value.args[0]
    assert message.startswith(OOM_MESSAGE)
    if impl is OURS:
        assert "Every batch size tried failed" in message
    toma = pytest.importorskip("toma")
    assert toma.should_reduce_batch_size(excinfo.value)


@pytest.mark.parametrize(
    "text",
    [
        "Caught OutOfMemoryError in replica 0 on device 0.\nOriginal Traceback:\n"
        f"torch.OutOfMemoryError: {OOM_MESSAGE}",
        f"\n{OOM_MESSAGE}",
    ],
    ids=["re-raised by a replica", "leading newline"],
)
def test_giving_up_keeps_the_line_that_says_out_of_memory(text: str) -> None:
    # The line that says it, where it is not the first: as toma's own re-raised error matches.
    def run(batchsize: int) -> None:
        raise torch.OutOfMemoryError(text)

    with pytest.raises(torch.OutOfMemoryError) as excinfo:
        ct.explicit.batch(run, 4, toma_cache_type=ct.NoBatchsizeCache)
    assert excinfo.value.args[0].split("\n", 1)[0].endswith(OOM_MESSAGE)
    toma = pytest.importorskip("toma")
    assert toma.should_reduce_batch_size(excinfo.value)
    assert toma.should_reduce_batch_size(torch.OutOfMemoryError(text))  # as the error toma re-raises


def test_a_range_that_gives_up_says_how_far_it_got() -> None:
    def run(begin: int, end: int) -> None:
        if begin >= 4:
            raise oom()

    with pytest.raises(koila.BatchSizeExhausted, match="out of memory. Every batch size tried failed") as excinfo:
        ct.explicit.range(run, 0, 10, 4)
    assert "4 of 10 indices were finished before it gave up." in excinfo.value.__notes__


@pytest.mark.parametrize("form", ["batch", "range", "chunked", "execute", "simple"])
def test_non_oom_errors_propagate_as_the_same_object(impl: Impl, form: str) -> None:
    error = ValueError("not a memory problem")
    tried: list[int] = []

    def fail(*args: Any) -> None:
        tried.append(args[0] if form == "batch" else args[-1])
        raise error

    with pytest.raises(ValueError) as excinfo:
        if form == "batch":
            impl.toma.batch(initial_batchsize=8)(fail)()
        elif form == "range":
            impl.toma.range(initial_step=8)(fail)(0, 20)
        elif form == "chunked":
            impl.explicit.chunked(fail, torch.zeros(20), 8)
        elif form == "execute":
            impl.toma.execute.range(0, 20, 8)(fail)
        else:
            impl.simple.batch(fail, 8)
    assert excinfo.value is error
    assert tried == [8]  # no retry


def test_an_empty_range_runs_nothing(impl: Impl) -> None:
    calls: list[object] = []

    def record(*args: Any) -> None:
        calls.append(args)

    assert impl.explicit.range(record, 5, 5, 4) is None
    assert impl.explicit.range(record, 5, 2, 4) is None  # end below start: nothing either, as in toma
    assert impl.toma.chunked(initial_step=4)(record)(torch.zeros(0, 3)) is None
    assert calls == []


def test_a_failed_call_leaves_the_cache_as_its_last_success_left_it(impl: Impl) -> None:
    tried: list[object] = []

    def run(batchsize: int) -> None:
        tried.append(batchsize)
        if batchsize == 50:
            raise ValueError("another error, after one reduction")
        if batchsize > 60:
            raise oom()

    with pytest.raises(ValueError, match="another error"):
        impl.explicit.batch(run, 100, toma_cache_type=impl.caches["global"])
    tried.append("|")
    with pytest.raises(ValueError, match="another error"):
        impl.explicit.batch(run, 100, toma_cache_type=impl.caches["global"])
    # Ours never stored 50, which failed; toma starts the next call there.
    assert tried == ([100, 50, "|", 100, 50] if impl is OURS else [100, 50, "|", 50])


# --------------------------------------------------------------------------- 2. toma's bugs, fixed


@pytest.mark.parametrize(
    ("impl", "expected"),
    [("ours", [((2, 4), 0, 4), ((2, 4), 4, 8)]), ("toma", [((2, 8), 0, 2)])],
    indirect=["impl"],
)
def test_bug_1_decorator_dimension(impl: Impl, expected: list[object]) -> None:
    chunks: list[object] = []

    @impl.toma.chunked(initial_step=4, dimension=1)
    def run(chunk: torch.Tensor, begin: int, end: int) -> None:
        chunks.append((tuple(chunk.shape), begin, end))

    run(torch.zeros(2, 8))
    assert chunks == expected


@pytest.mark.parametrize(
    ("impl", "expected"),
    [
        ("ours", [100, 50, 25, "|", 25, "|", 16, 8, 8, "|", 8, 8]),
        ("toma", [100, 50, 25, "|", 100, 50, 25, "|", 16, 8, 8, "|", 16, 8, 8]),
    ],
    indirect=["impl"],
)
def test_bug_2_called_forms_keep_their_context(impl: Impl, expected: list[object]) -> None:
    tried: list[object] = []
    shared = impl.caches["global"]

    @impl.toma.batch(initial_batchsize=100, cache_type=shared, context="batches")
    def first(batchsize: int) -> None:
        tried.append(batchsize)
        if batchsize > 30:
            raise oom()

    @impl.toma.batch(initial_batchsize=100, cache_type=shared, context="batches")
    def second(batchsize: int) -> None:
        tried.append(batchsize)
        if batchsize > 30:
            raise oom()

    @impl.toma.chunked(initial_step=16, cache_type=shared, context="chunks")
    def third(chunk: torch.Tensor, begin: int, end: int) -> None:
        tried.append(end - begin)
        if end - begin > 8:
            raise oom()

    @impl.toma.chunked(initial_step=16, cache_type=shared, context="chunks")
    def fourth(chunk: torch.Tensor, begin: int, end: int) -> None:
        tried.append(end - begin)
        if end - begin > 8:
            raise oom()

    first()
    tried.append("|")
    second()  # ours: starts where first() ended, as the shared context says
    tried.append("|")
    third(torch.zeros(16))
    tried.append("|")
    fourth(torch.zeros(16))
    assert tried == expected


@pytest.mark.parametrize(("impl", "expected"), [("ours", "raises"), ("toma", [8])], indirect=["impl"])
def test_bug_3_a_zero_initial_size_is_not_replaced(impl: Impl, expected: object) -> None:
    tried: list[int] = []

    @impl.toma.batch(initial_batchsize=8)
    def run(batchsize: int) -> None:
        tried.append(batchsize)

    if expected == "raises":
        with pytest.raises(ValueError, match="toma_initial_batchsize must be >= 1, got 0"):
            run(toma_initial_batchsize=0)
    else:
        run(toma_initial_batchsize=0)
        assert tried == expected


@pytest.mark.parametrize(
    ("impl", "expected"),
    [("ours", [100, 50, 25, "|", 100, 50, 25, "|", 100, 50, 25]), ("toma", [100, 50, 25, "|", 25, "|", 25])],
    indirect=["impl"],
)
def test_bug_3_a_falsy_context_is_a_context(impl: Impl, expected: list[object]) -> None:
    tried: list[object] = []
    shared = impl.caches["global"]

    @impl.toma.batch(initial_batchsize=100, cache_type=shared)
    def run(batchsize: int) -> None:
        tried.append(batchsize)
        if batchsize > 30:
            raise oom()

    run()
    tried.append("|")
    run(toma_context=0)  # toma: `0 or context or func`, the function's cache
    tried.append("|")
    impl.explicit.batch(run.__wrapped__, 100, toma_context=(), toma_cache_type=shared)
    assert tried == expected


@pytest.mark.parametrize(("impl", "fixed"), [("ours", True), ("toma", False)], indirect=["impl"])
def test_bug_4_explicit_chunked_passes_extra_positional_arguments(impl: Impl, fixed: bool) -> None:
    calls: list[object] = []

    def run(chunk: torch.Tensor, begin: int, end: int, a: int, b: int, *, c: int) -> None:
        calls.append((chunk.shape[0], begin, end, a, b, c))

    if fixed:
        impl.explicit.chunked(run, torch.zeros(5), 4, 1, 2, c=3)
        assert calls == [(4, 0, 4, 1, 2, 3), (1, 4, 5, 1, 2, 3)]
    else:  # toma hands the arguments to its own range body as well
        with pytest.raises(TypeError, match="positional argument"):
            impl.explicit.chunked(run, torch.zeros(5), 4, 1, 2, c=3)
        assert calls == []


@pytest.mark.parametrize(("impl", "fixed"), [("ours", True), ("toma", False)], indirect=["impl"])
def test_bug_5_a_missing_initial_size_is_an_error(impl: Impl, fixed: bool) -> None:
    tried: list[object] = []

    @impl.toma.batch
    def run(batchsize: int) -> None:
        tried.append(batchsize)

    if fixed:
        with pytest.raises(TypeError, match="pass initial_batchsize= to toma.batch, or toma_initial_batchsize="):
            run()
        assert tried == []
    else:
        run()
        assert tried == [None]


class Index:
    """An integer that is not an int (as numpy's are)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


def noop(*args: Any) -> None:
    pass


BAD_INPUTS: list[tuple[Callable[[], object], type[Exception], str]] = [
    (lambda: ct.explicit.batch(noop, None), TypeError, "no initial size was given: pass initial_batchsize"),
    (lambda: ct.simple.range(noop, 0, 4, None), TypeError, "no initial size was given: pass initial_step"),
    (lambda: ct.toma.range(noop)(0, 4), TypeError, "pass initial_step= to toma.range, or toma_initial_step="),
    (lambda: ct.toma.chunked(noop)(torch.zeros(3)), TypeError, "pass initial_step= to toma.chunked, or"),
    (lambda: ct.toma.execute.chunked(torch.zeros(3)), TypeError, "no initial size was given: pass initial_step"),
    (lambda: ct.explicit.batch(noop, 2.5), TypeError, "initial_batchsize must be an int, got float 2.5"),
    (lambda: ct.explicit.batch(noop, True), TypeError, "initial_batchsize must be an int, got bool True"),
    (lambda: ct.explicit.batch(noop, 0), ValueError, "initial_batchsize must be >= 1, got 0"),
    (lambda: ct.toma.batch(initial_batchsize=-1), ValueError, "initial_batchsize must be >= 1, got -1"),
    (lambda: ct.toma.execute.batch("8"), TypeError, "initial_batchsize must be an int, got str '8'"),
    (lambda: ct.toma.range(initial_step=4)(noop)(0, 8, toma_initial_step=0), ValueError, "toma_initial_step must"),
    (lambda: ct.explicit.range(noop, 0.0, 4, 2), TypeError, "start must be an int, got float 0.0"),
    (lambda: ct.toma.execute.range(0, "4", 2), TypeError, "end must be an int, got str '4'"),
    (
        lambda: ct.explicit.chunked(noop, torch.zeros(4, 3), 2, toma_dimension=2),
        IndexError,
        "toma_dimension 2 is out of range for a tensor of shape (4, 3); allowed: [-2, 1]",
    ),
    (lambda: ct.simple.chunked(noop, torch.zeros(4), 2, dimension=-2), IndexError, "dimension -2 is out of range"),
    (lambda: ct.toma.chunked(initial_step=2, dimension=3)(noop)(torch.zeros(4)), IndexError, "dimension 3 is out"),
    (lambda: ct.explicit.chunked(noop, torch.tensor(1.0), 2), IndexError, "allowed: none, the tensor is 0-dim"),
    (lambda: ct.toma.chunked(initial_step=2, dimension=1.0), TypeError, "dimension must be an int, got float 1.0"),
    (lambda: ct.explicit.chunked(noop, [1, 2], 2), TypeError, "must be a torch.Tensor, got list"),
    (lambda: ct.toma.batch(initial_batchsize=8, context=[1]), TypeError, "context must be hashable"),
    (lambda: ct.explicit.batch(noop, 8, toma_context={}), TypeError, "toma_context must be hashable (it names"),
    (lambda: ct.explicit.batch(noop, 8, toma_cache_type=dict), TypeError, "cache_type must be a koila_retry cache"),
    (lambda: ct.explicit.batch(noop, 8, toma_cache_type=[]), TypeError, "cache_type must be a koila_retry cache"),
    (lambda: ct.toma.batch(initial_batchsize=8, cache_type=koila.GlobalCache()), TypeError, "not an instance"),
    (lambda: ct.toma.range(initial_step=8, cache_type=koila.SizeCache), TypeError, "got <class 'koila_retry"),
    (lambda: ct.StacktraceMemoryBatchsizeCache(0), ValueError, "lru_cache_size must be >= 1, got 0"),
    (lambda: ct.StacktraceMemoryBatchsizeCache("big"), TypeError, "lru_cache_size must be an int or None"),
    (lambda: setattr(ct.toma, "DEFAULT_CACHE_TYPE", 3), TypeError, "DEFAULT_CACHE_TYPE must be a koila_retry"),
    # The size where the function goes: "no initial size was given", or 'int' object is not callable later.
    (
        lambda: ct.toma.batch(64),
        TypeError,
        "toma.batch wraps a callable, got int 64: pass the size as initial_batchsize=64",
    ),
    (lambda: ct.toma.batch(64, initial_batchsize=8), TypeError, "toma.batch wraps a callable, got int 64"),
    (lambda: ct.toma.range(32), TypeError, "toma.range wraps a callable, got int 32: pass the size as initial_step=32"),
]


@pytest.mark.parametrize(("call", "error", "message"), BAD_INPUTS, ids=[message for _, _, message in BAD_INPUTS])
def test_bug_5_bad_inputs_raise_errors_that_name_them(
    call: Callable[[], object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=re.escape(message)):
        call()


def test_integers_that_are_not_ints_are_sizes() -> None:
    assert ct.explicit.batch(lambda batchsize: batchsize, Index(6)) == 6


@pytest.mark.parametrize(("impl", "fixed"), [("ours", True), ("toma", False)], indirect=["impl"])
def test_bug_6_readme_names_exist(impl: Impl, fixed: bool) -> None:
    names = ("explicit", "GlobalBatchsizeCache", "NoBatchsizeCache", "StacktraceMemoryBatchsizeCache")
    assert [hasattr(impl.toma, name) for name in (*names, "DEFAULT_CACHE_TYPE")] == [fixed] * 5
    if fixed:
        assert impl.toma.explicit is ct.explicit
        assert impl.toma.GlobalBatchsizeCache is ct.GlobalBatchsizeCache is batchsize_cache.GlobalBatchsizeCache
        assert impl.toma.NoBatchsizeCache is ct.NoBatchsizeCache is batchsize_cache.NoBatchsizeCache
        stack = batchsize_cache.StacktraceMemoryBatchsizeCache
        assert impl.toma.StacktraceMemoryBatchsizeCache is ct.StacktraceMemoryBatchsizeCache is stack
        assert impl.toma.DEFAULT_CACHE_TYPE is ct.DEFAULT_CACHE_TYPE is stack


@pytest.mark.parametrize("spelling", ["module", "class"])
@pytest.mark.parametrize(("impl", "fixed"), [("ours", True), ("toma", False)], indirect=["impl"])
def test_bug_6_setting_default_cache_type_takes_effect(
    impl: Impl, fixed: bool, spelling: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    tried: list[object] = []

    @impl.toma.batch(initial_batchsize=100)  # made before the setting changes
    def run(batchsize: int) -> None:
        tried.append(batchsize)
        if batchsize > 30:
            raise oom()

    # As toma's README says; toma.toma has no such attribute, so setting it there adds one.
    where = sys.modules[impl.toma.__module__] if spelling == "module" else impl.toma
    monkeypatch.setattr(where, "DEFAULT_CACHE_TYPE", impl.caches["no"], raising=False)
    for _ in range(2):
        run()
        tried.append("|")
    assert tried == ([100, 50, 25, "|", 100, 50, 25, "|"] if fixed else [100, 50, 25, "|", 25, "|"])


def test_default_cache_type_has_one_value_under_both_names() -> None:
    ct.toma.DEFAULT_CACHE_TYPE = ct.GlobalBatchsizeCache
    assert ct.DEFAULT_CACHE_TYPE is ct.GlobalBatchsizeCache
    ct.DEFAULT_CACHE_TYPE = ct.NoBatchsizeCache
    assert ct.toma.DEFAULT_CACHE_TYPE is ct.NoBatchsizeCache
    del ct.toma.DEFAULT_CACHE_TYPE  # what undoing a patch does: back to toma's default
    assert ct.DEFAULT_CACHE_TYPE is ct.StacktraceMemoryBatchsizeCache
    ct.DEFAULT_CACHE_TYPE = dict  # type: ignore[assignment]  # not checked until a call reads it
    with pytest.raises(TypeError, match="cache_type must be a koila_retry cache class.*got <class 'dict'>"):
        ct.explicit.batch(noop, 8)


def test_bug_7_a_short_last_range_is_retried_at_half_its_rows(impl: Impl) -> None:
    log: list[tuple[int, int]] = []

    def run(begin: int, end: int) -> None:
        log.append((begin, end))
        if begin >= 96 and end - begin > 2:  # the last rows need more memory
            raise oom()

    impl.explicit.range(run, 0, 100, 32)
    if impl is OURS:
        assert log == [(0, 32), (32, 64), (64, 96), (96, 100), (96, 98), (98, 100)]
    else:  # steps of 16, 8 and 4 rerun the same 4 rows
        assert log == [(0, 32), (32, 64), (64, 96), *[(96, 100)] * 4, (96, 98), (98, 100)]


def test_bug_7_a_short_last_chunk_is_retried_at_half_its_rows(impl: Impl) -> None:
    log: list[tuple[int, int]] = []

    def run(chunk: torch.Tensor, begin: int, end: int) -> None:
        log.append((begin, end))
        if end - begin > 15:
            raise oom()

    impl.explicit.chunked(run, torch.zeros(30), 64)
    if impl is OURS:
        assert log == [(0, 30), (0, 15), (15, 30)]
    else:  # a step of 32 reruns the same 30 rows
        assert log == [(0, 30), (0, 30), (0, 16), *steps(0, 30, 8)]


@pytest.mark.usefixtures("real_release")
@pytest.mark.parametrize(("impl", "fixed"), [("ours", True), ("toma", False)], indirect=["impl"])
def test_bug_8_memory_is_released_after_leaving_except(
    impl: Impl, fixed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not fixed:  # toma's own collection, inside its except block
        from toma import torch_cuda_memory

        monkeypatch.setattr(sys.modules["toma"], "gc_cuda", torch_cuda_memory.gc_cuda)
    refs: list[weakref.ref[torch.Tensor]] = []
    alive_at_start: list[bool] = []

    class Node:
        tensor: torch.Tensor
        self: Node

    def run(batchsize: int) -> int:
        alive_at_start.append(any(ref() is not None for ref in refs))
        node = Node()
        node.self = node  # only the garbage collector frees it
        node.tensor = torch.ones(batchsize, 256)
        refs.append(weakref.ref(node.tensor))
        if batchsize > 1:
            raise make_oom()
        return batchsize

    gc.disable()  # the library's collection, not Python's own, must free the cycle
    try:
        impl.explicit.batch(run, 2, toma_cache_type=impl.caches["no"])
    finally:
        gc.enable()
    assert alive_at_start == [False, not fixed]


@pytest.mark.parametrize(("impl", "fixed"), [("ours", True), ("toma", False)], indirect=["impl"])
def test_bug_8_nothing_is_collected_or_inspected_when_nothing_fails(
    impl: Impl, fixed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not fixed:
        from toma import torch_cuda_memory

        monkeypatch.setattr(sys.modules["toma"], "gc_cuda", torch_cuda_memory.gc_cuda)

    @impl.toma.batch(initial_batchsize=8)
    def run(batchsize: int) -> int:
        return batchsize

    counts = {"collect": 0, "stack": 0}
    stack = inspect.stack

    def counting_collect(*args: Any) -> int:
        counts["collect"] += 1
        return 0  # counted, not run: a collection takes ~0.1 s here

    def counting_stack(*args: Any, **kwargs: Any) -> list[inspect.FrameInfo]:
        counts["stack"] += 1
        return stack(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(gc, "collect", counting_collect)
        patch.setattr(inspect, "stack", counting_stack)
        for _ in range(2):
            run()
    # toma: two collections a call, a stack a call and one more for its first cache
    assert counts == ({"collect": 0, "stack": 0} if fixed else {"collect": 4, "stack": 3})


@pytest.mark.parametrize("kind", ["mps", "cpu", "windows-cpu", "cublas"])
@pytest.mark.parametrize(("impl", "fixed"), [("ours", True), ("toma", False)], indirect=["impl"])
def test_bug_8_out_of_memory_detection_is_broader(impl: Impl, fixed: bool, kind: str) -> None:
    errors = {
        "mps": make_oom("mps"),
        "cpu": make_oom("cpu"),
        "windows-cpu": RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 8589934592 bytes."),
        "cublas": RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    }
    tried: list[int] = []

    def run(batchsize: int) -> int:
        tried.append(batchsize)
        if batchsize > 2:
            raise errors[kind]
        return batchsize

    if fixed or kind == "cpu":  # toma knows the CPU allocator's Linux message
        assert impl.explicit.batch(run, 8, toma_cache_type=impl.caches["no"]) == 2
        assert tried == [8, 4, 2]
    else:
        with pytest.raises(RuntimeError) as excinfo:
            impl.explicit.batch(run, 8, toma_cache_type=impl.caches["no"])
        assert excinfo.value is errors[kind]
        assert tried == [8]


# --------------------------------------------------------------------------- 3. caches and contexts


def test_the_table_maps_tomas_options_onto_koilas() -> None:
    for prefix in ("", "toma_"):  # each option also per call
        settings = ct.TABLE.read(
            {f"{prefix}initial_step": Index(8), f"{prefix}context": noop, f"{prefix}dimension": None}
        )
        assert settings == {
            "schedule": koila.scaled(0.5),
            "initial": 8,
            "context": function_identity(noop),  # the registry must not keep the function alive
            "dimension": 0,
        }
    policy = ct.TABLE.policy(ct.TABLE.read({}), rows=True)
    assert (policy.initial, policy.schedule) == (None, koila.scaled(0.5))
    with pytest.raises(TypeError, match="toma_cache_type must be a koila_retry cache class"):
        ct.TABLE.read({"toma_cache_type": dict})


def test_public_names() -> None:
    assert ct.__all__ == sorted(ct.__all__)
    assert ct.__all__ == [
        "DEFAULT_CACHE_TYPE",
        "GlobalBatchsizeCache",
        "NoBatchsizeCache",
        "StacktraceMemoryBatchsizeCache",
        "explicit",
        "should_reduce_batch_size",
        "simple",
        "toma",
    ]
    assert ct.should_reduce_batch_size is koila.is_oom
    for namespace in (ct.toma, ct.toma.execute, ct.explicit, ct.simple):
        assert all(callable(getattr(namespace, name)) for name in ("batch", "range", "chunked"))
    for name in batchsize_cache.__all__:
        assert getattr(ct, name) is getattr(batchsize_cache, name)


def test_cache_types_are_koila_caches() -> None:
    assert issubclass(ct.NoBatchsizeCache, koila.NoCache)
    assert issubclass(ct.GlobalBatchsizeCache, koila.GlobalCache)
    assert issubclass(ct.StacktraceMemoryBatchsizeCache, koila.StackMemoryCache)
    assert ct.StacktraceMemoryBatchsizeCache().cache_info().maxsize == 2**16
    assert ct.StacktraceMemoryBatchsizeCache(lru_cache_size=8).cache_info().maxsize == 8
    assert ct.StacktraceMemoryBatchsizeCache().depth == sys.maxsize  # the whole stack


def test_koilas_own_cache_types_work_too() -> None:
    tried: list[object] = []

    @ct.toma.batch(initial_batchsize=100, cache_type=koila.StackMemoryCache)
    def run(batchsize: int) -> None:
        tried.append(batchsize)
        if batchsize > 30:
            raise oom()

    for _ in range(2):
        run()
    assert tried == [100, 50, 25, 25]


def test_tomas_own_cache_classes_are_refused(real_toma: Impl) -> None:
    with pytest.raises(TypeError, match="toma's own cache classes do not work here"):
        ct.toma.batch(initial_batchsize=8, cache_type=real_toma.caches["global"])


def test_the_stack_cache_tells_call_sites_apart_through_the_whole_stack() -> None:
    tried: list[object] = []

    @ct.toma.batch(initial_batchsize=100)
    def run(batchsize: int) -> None:
        tried.append(batchsize)
        if batchsize > 30:
            raise oom()

    def outer() -> None:
        run()  # the same line, reached from two places

    for _ in range(2):
        outer()
        tried.append("|")
    outer()  # another line calling outer: another stack
    assert tried == [100, 50, 25, "|", 25, "|", 100, 50, 25]


def test_the_stack_cache_keys_free_memory_levels() -> None:
    tried: list[object] = []

    @ct.toma.batch(initial_batchsize=64)
    def run(batchsize: int) -> None:
        tried.append(batchsize)
        if batchsize > 8:
            raise oom()

    for limit in ("64MiB", "1GiB", "40MiB"):
        with simulated_device(limit):
            run()
        tried.append("|")
    # Much more free memory starts afresh; less starts at what worked with more.
    assert tried == [64, 32, 16, 8, "|", 64, 32, 16, 8, "|", 8, "|"]


def test_each_front_end_keys_the_device_it_runs_on() -> None:
    ct.explicit.batch(noop, 4, torch.zeros(3, device="meta"))
    ct.explicit.chunked(noop, torch.zeros(3, device="meta"), 4, toma_context="chunked")
    ct.explicit.range(noop, 0, 3, 4, toma_context="range")
    devices = {
        context: {key[1] for key in entry.cache}
        for (kind, context), entry in ct._contexts.items()
        if kind is ct.StacktraceMemoryBatchsizeCache
    }
    assert devices == {
        function_identity(noop): {torch.device("meta")},
        "chunked": {torch.device("meta")},
        "range": {default_device()},
    }


def test_the_registry_does_not_keep_functions_alive() -> None:
    def make() -> Callable[[int], int]:
        data = torch.zeros(4)

        def run(batchsize: int) -> int:
            return batchsize + int(data.sum())

        return run

    run = make()
    ref = weakref.ref(run)
    assert ct.explicit.batch(run, 4) == 4
    assert ct.toma.batch(initial_batchsize=4)(run)() == 4
    del run
    gc.collect()
    assert ref() is None


def test_the_registry_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ct._contexts.maxsize == ct.CONTEXT_CACHE_SIZE == 2**14  # as toma's
    monkeypatch.setattr(ct, "_contexts", cachetools.LRUCache(2))
    tried: list[object] = []

    def run(batchsize: int) -> None:
        tried.append(batchsize)
        if batchsize > 30:
            raise oom()

    for context in ("a", "b", "c", "a"):  # "a" is the least recently used when "c" comes
        ct.explicit.batch(run, 100, toma_context=context, toma_cache_type=ct.GlobalBatchsizeCache)
        tried.append("|")
    assert tried == [100, 50, 25, "|"] * 4


def test_a_cache_instance_per_type_and_context() -> None:
    for kind in (ct.GlobalBatchsizeCache, ct.NoBatchsizeCache, ct.GlobalBatchsizeCache):
        ct.explicit.batch(noop, 4, toma_context="one", toma_cache_type=kind)
    ct.explicit.batch(noop, 4, toma_context="two", toma_cache_type=ct.GlobalBatchsizeCache)
    keys = sorted((kind.__name__, context) for kind, context in ct._contexts)
    assert keys == [("GlobalBatchsizeCache", "one"), ("GlobalBatchsizeCache", "two"), ("NoBatchsizeCache", "one")]


# --------------------------------------------------------------------------- 4. real models, real OOMs


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 16)).eval()


@pytest.mark.usefixtures("real_release")
def test_real_model_batch_halves_until_a_train_step_fits() -> None:
    torch.manual_seed(0)
    tried: list[int] = []
    with simulated_device("4MiB") as device:
        model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))

        @ct.toma.batch(initial_batchsize=1000)
        def train_step(batchsize: int) -> float:
            tried.append(batchsize)
            model.zero_grad(set_to_none=True)
            x = torch.randn(batchsize, 256)
            loss = nn.functional.cross_entropy(model(x), torch.zeros(batchsize, dtype=torch.long))
            loss.backward()
            return loss.item()

        for _ in range(2):
            train_step()
    first, second = tried[:-1], tried[-1:]
    assert len(first) > 1  # 1000 rows do not fit in 4 MiB
    assert all(b == a // 2 for a, b in itertools.pairwise(first))  # 1000 -> 500 -> 250 ...
    assert second == first[-1:]  # the second call starts where the first ended, and fits
    assert device.peak <= device.limit


@pytest.mark.usefixtures("real_release")
def test_real_model_range_and_execute_batch() -> None:
    model = mlp()
    x = torch.randn(1500, 64)
    with torch.no_grad():
        expected = model(x)
    out = torch.full((1500, 16), float("nan"))
    steps_run: list[int] = []
    with torch.no_grad(), simulated_device("1MiB"):

        @ct.toma.range(initial_step=1500)
        def fill(begin: int, end: int, inputs: torch.Tensor) -> None:
            steps_run.append(end - begin)
            out[begin:end] = model(inputs[begin:end])

        fill(0, 1500, x)

        @ct.toma.execute.batch(1500)
        def rows(batchsize: int) -> int:
            model(x[:batchsize])
            return batchsize

    assert steps_run[:3] == [1500, 750, 375]
    assert steps_run[3:] == [375, 375, 375]
    assert torch.allclose(out, expected, atol=1e-6)
    assert rows == 375


@pytest.mark.usefixtures("real_release")
@pytest.mark.parametrize("form", ["decorator", "explicit", "execute", "simple"])
def test_real_model_chunked_forms(form: str) -> None:
    model = mlp()
    x = torch.randn(64, 1500)  # rows along dimension 1
    with torch.no_grad():
        expected = model(x.T).T
    out = torch.full((16, 1500), float("nan"))
    sizes: list[int] = []

    @torch.no_grad()
    def fill(chunk: torch.Tensor, begin: int, end: int, *extra: object) -> None:
        sizes.append(end - begin)
        out[:, begin:end] = model(chunk.T).T

    with simulated_device("1MiB") as device:
        if form == "decorator":
            ct.toma.chunked(initial_step=2048, dimension=1)(fill)(x)
        elif form == "explicit":
            ct.explicit.chunked(fill, x, 2048, "extra", toma_dimension=1)
        elif form == "execute":
            ct.toma.execute.chunked(x, 2048, dimension=1)(fill)
        else:
            ct.simple.chunked(fill, x, 2048, 1)
    assert sizes == [1500, 750, 375, 375, 375, 375]  # the first chunk is all 1500 rows, and fails
    assert torch.allclose(out, expected, atol=1e-6)
    assert device.peak <= device.limit


@pytest.mark.usefixtures("real_release")
def test_real_model_tensor_of_a_failed_chunk_is_dead_before_the_retry() -> None:
    model = mlp()
    refs: list[weakref.ref[torch.Tensor]] = []
    alive_at_start: list[bool] = []

    @torch.no_grad()
    def run(chunk: torch.Tensor, begin: int, end: int) -> None:
        alive_at_start.append(any(ref() is not None for ref in refs))
        hidden = model[0](chunk)
        refs.append(weakref.ref(hidden))
        model[2](model[1](hidden))

    with simulated_device("1MiB"):
        ct.toma.chunked(initial_step=2048)(run)(torch.randn(1500, 64))
    # 750 rows make their first layer's output, then fail: it is gone when 375 start.
    assert len(refs) > 8
    assert alive_at_start == [False] * len(alive_at_start)


# --------------------------------------------------------------------------- 5. without toma


TOP_LEVEL = """
import torch
tried = []

@toma.batch(initial_batchsize=100)
def run(batchsize):
    tried.append(batchsize)
    if batchsize > 30:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

run()
run()
print(tried)
"""


@pytest.fixture(scope="module", autouse=True)
def _top_level_process() -> Iterator[subprocess.Popen[str]]:
    """Run ours, then toma if it is installed, at the top level of one fresh interpreter.

    Started with the module's first test: the interpreter spends seconds importing
    torch, while the other tests run.
    """
    code = textwrap.dedent(
        """
        import sys
        import psutil
        # Free RAM is part of both stack caches' keys (toma's in 256 MiB steps): held still,
        # so that another process allocating between two calls cannot start one afresh.
        _reading = psutil.virtual_memory()._replace(available=8 * 2**30)
        psutil.virtual_memory = lambda: _reading
        import koila_retry.compat.toma
        assert "toma" not in sys.modules, "importing the stand-in imported toma"
        sys.modules["toma"] = None  # from here on, `import toma` fails
        from koila_retry.compat.toma import toma
        """
    )
    code += TOP_LEVEL
    code += 'del sys.modules["toma"]\ntry:\n    from toma import toma\nexcept ImportError:\n    print("no toma")\n'
    code += "else:\n" + textwrap.indent(TOP_LEVEL, "    ")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    yield process
    if process.poll() is None:  # its tests were not selected
        process.kill()
    process.communicate()


@pytest.fixture(scope="module")
def top_level(_top_level_process: subprocess.Popen[str]) -> list[str]:
    stdout, stderr = _top_level_process.communicate(timeout=120)
    assert _top_level_process.returncode == 0, stderr
    return stdout.splitlines()


@pytest.mark.slow
def test_imports_and_works_without_toma(top_level: list[str]) -> None:
    # Two lines of a script's top level: two call stacks, so the second starts afresh.
    assert top_level[0] == "[100, 50, 25, 100, 50, 25]"


@pytest.mark.slow
def test_toma_at_a_scripts_top_level_shares_sizes_across_lines(top_level: list[str]) -> None:
    pytest.importorskip("toma")
    # toma leaves the outermost frame out of its stacks (difference 14).
    assert top_level[1] == "[100, 50, 25, 25]"
