"""koila.chunked and koila.range: chunks that resume where they failed, never losing finished work."""

from __future__ import annotations

import dataclasses
import functools
import gc
import io
import logging
import os
import re
import sys
import types
import warnings
import weakref
from collections import namedtuple
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F
from torch.utils._pytree import tree_flatten

import koila_retry as koila
from koila_retry._core import memory
from koila_retry.testing import make_oom, oom_above, oom_for, simulated_device

# The same patch holds for every example, so a function-scoped fixture is safe here.
properties = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

KINDS = ("cuda", "cpu", "mps")


@pytest.fixture
def fast_release(monkeypatch: pytest.MonkeyPatch) -> None:
    """Skip the full garbage collection after each OOM (the engine calls ``memory.release``)."""
    monkeypatch.setattr(memory, "release", lambda device=None: None)


# --------------------------------------------------------------------------- helpers


def indexed(n: int, dim: int = 0) -> torch.Tensor:
    """Rows along ``dim`` whose first entry is the row's index: a chunk says where it starts."""
    rows = torch.arange(n, dtype=torch.float64)
    base = torch.stack([rows, rows * 0.5 - 3, -rows], dim=1)  # (n, 3)
    return base if dim in (0, -2) else base.t()


def first_row(chunk: torch.Tensor, dim: int) -> int:
    return int(chunk.select(dim, 0)[0])


def row_indices(chunk: torch.Tensor, dim: int) -> torch.Tensor:
    return chunk.movedim(dim, 0)[:, 0]


def pure(x: torch.Tensor, dim: int, structure: str) -> Any:
    """A row-wise function whose results do not depend on how rows are chunked."""
    other = 1 if dim in (0, -2) else 0
    y = x * 2 + 1
    if structure == "tensor":
        return y
    if structure == "tuple":
        return y, x.sum(dim=other, keepdim=True)
    return {"y": y, "nested": (x - 1, [x.neg()])}


def assert_same(actual: Any, expected: Any) -> None:
    """Both structures match, leaf for leaf, bit for bit."""
    actual_leaves, actual_spec = torch.utils._pytree.tree_flatten(actual)
    expected_leaves, expected_spec = torch.utils._pytree.tree_flatten(expected)
    assert actual_spec == expected_spec
    for got, want in zip(actual_leaves, expected_leaves, strict=True):
        assert got.shape == want.shape
        assert torch.equal(got, want)


def next_size(failed: int, minimum: int) -> int | None:
    """The specification of the schedule, written independently of the engine."""
    if failed <= minimum:
        return None
    power = 1
    while power * 2 < failed:
        power *= 2
    return max(power, minimum)


def predicted(
    n: int, initial: int, minimum: int, fails: Callable[[int, int], bool], max_attempts: int | None = None
) -> tuple[list[tuple[int, int, bool]], bool]:
    """The calls the spec predicts: ``(begin, end, failed)`` each, and whether it gives up."""
    size, begin, number = initial, 0, 1
    calls: list[tuple[int, int, bool]] = []
    while begin < n:
        rows = min(size, n - begin)
        failed = fails(len(calls) + 1, rows)
        calls.append((begin, begin + rows, failed))
        if not failed:
            begin, number = begin + rows, 1
            continue
        following = None if max_attempts is not None and number >= max_attempts else next_size(rows, minimum)
        if following is None:
            return calls, True
        size, number = following, number + 1
    return calls, False


def is_power_of_two(size: int) -> bool:
    return size > 0 and size & (size - 1) == 0


def check_calls(calls: list[tuple[int, int, bool]], start: int, stop: int, initial: int, minimum: int) -> int:
    """Check the properties every pass has, whatever failed; return where finished rows end."""
    done = start
    for i, (begin, end, failed) in enumerate(calls):
        assert begin == done, "each call starts at the first row not yet finished"
        assert begin < end <= stop
        if failed:
            if i + 1 < len(calls):
                assert calls[i + 1][0] == begin, "a failed chunk is retried from its own first row"
                assert calls[i + 1][1] - calls[i + 1][0] < end - begin, "and with fewer rows"
        else:
            done = end
        if end < stop:  # a chunk that is not the last: a size from the schedule
            size = end - begin
            assert size in (initial, minimum) or is_power_of_two(size)
    sizes = [end - begin for begin, end, _ in calls]
    assert sizes == sorted(sizes, reverse=True), "without grow=True sizes never grow"
    return done


@st.composite
def schedules(draw: st.DrawFn, max_rows: int = 300) -> dict[str, Any]:
    initial = draw(st.integers(1, 16) | st.integers(1, 512))  # small sizes make many chunks
    return {
        "n": draw(st.integers(0, max_rows)),
        "initial": initial,
        "minimum": draw(st.integers(1, initial)),
        "max_attempts": draw(st.none() | st.integers(1, 4)),
        "kind": draw(st.sampled_from(KINDS)),
    }


class Recorder:
    """``fn`` for chunked: records every call as ``(begin, end, failed)``, injects OOMs."""

    def __init__(self, dim: int, structure: str, inject: Callable[[int, int], None]) -> None:
        self.dim, self.structure, self.inject = dim, structure, inject
        self.calls: list[tuple[int, int, bool]] = []
        self.empty_calls = 0

    def __call__(self, x: torch.Tensor) -> Any:
        rows = x.size(self.dim)
        if rows == 0:
            self.empty_calls += 1
            return pure(x, self.dim, self.structure)
        begin = first_row(x, self.dim)
        assert torch.equal(row_indices(x, self.dim), torch.arange(begin, begin + rows, dtype=torch.float64))
        self.calls.append((begin, begin + rows, True))
        self.inject(len(self.calls), rows)
        self.calls[-1] = (begin, begin + rows, False)
        return pure(x, self.dim, self.structure)


def call_injector(failing: frozenset[int], kind: str) -> Callable[[int, int], None]:
    inject = oom_for(failing, kind=kind)
    return lambda number, rows: inject()


def threshold_injector(first: int, then: int, switch: int, kind: str) -> Callable[[int, int], None]:
    early, late = oom_above(first, kind=kind), oom_above(then, kind=kind)
    return lambda number, rows: (early if number <= switch else late)(rows)


# --------------------------------------------------------------------------- 1. properties


def run_chunked_property(
    params: dict[str, Any],
    fails: Callable[[int, int], bool],
    inject: Callable[[int, int], None],
    dim: int,
    structure: str,
    decorated: bool,
) -> None:
    n, initial, minimum, max_attempts = params["n"], params["initial"], params["minimum"], params["max_attempts"]
    x = indexed(n, dim)
    fn = Recorder(dim, structure, inject)
    options: dict[str, Any] = {
        "initial": initial,
        "minimum": minimum,
        "max_attempts": max_attempts,
        "dim": dim,
        "cache": koila.NoCache(),
    }
    wrapped = koila.chunked(**options)(fn) if decorated else None
    expected_calls, exhausted = predicted(n, initial, minimum, fails, max_attempts)

    def run() -> Any:
        return wrapped(x) if wrapped is not None else koila.chunked(fn, x, **options)

    if exhausted:
        with pytest.raises(koila.BatchSizeExhausted) as excinfo:
            run()
        done = check_calls(fn.calls, 0, n, initial, minimum)
        assert done < n
        assert excinfo.value.batch_size == fn.calls[-1][1] - fn.calls[-1][0]
        if sys.version_info >= (3, 11):
            assert excinfo.value.__notes__ == [f"{done} of {n} rows were finished before it gave up."]
    else:
        result = run()
        assert check_calls(fn.calls, 0, n, initial, minimum) == n
        assert_same(result, pure(x, dim, structure))
    assert fn.calls == expected_calls
    assert fn.empty_calls == (1 if n == 0 else 0)
    if wrapped is not None:
        failures = sum(failed for _, _, failed in fn.calls)
        assert wrapped.stats.ooms == failures
        assert wrapped.stats.exhausted == int(exhausted)
        assert wrapped.stats.calls == (0 if n == 0 else 1)


@pytest.mark.usefixtures("fast_release")
@properties
@given(
    params=schedules(),
    failing=st.frozensets(st.integers(1, 12) | st.integers(1, 40), max_size=12),
    dim=st.sampled_from([0, 1, -1]),
    structure=st.sampled_from(["tensor", "tuple", "dict"]),
    decorated=st.booleans(),
)
def test_chunked_property_failing_calls(
    params: dict[str, Any], failing: frozenset[int], dim: int, structure: str, decorated: bool
) -> None:
    """OOMs on chosen calls: same result as one call, rows tiled once, failed chunks resumed in place."""
    run_chunked_property(
        params,
        lambda number, rows: number in failing,
        call_injector(failing, params["kind"]),
        dim,
        structure,
        decorated,
    )


@pytest.mark.usefixtures("fast_release")
@properties
@given(
    params=schedules(),
    first=st.integers(0, 600),
    then=st.integers(0, 600),
    switch=st.integers(0, 30),
    structure=st.sampled_from(["tensor", "tuple", "dict"]),
)
def test_chunked_property_threshold_that_changes(
    params: dict[str, Any], first: int, then: int, switch: int, structure: str
) -> None:
    """Memory that fits ``first`` rows, then ``then`` rows after call ``switch``."""
    run_chunked_property(
        params,
        lambda number, rows: rows > (first if number <= switch else then),
        threshold_injector(first, then, switch, params["kind"]),
        0,
        structure,
        False,
    )


@pytest.mark.usefixtures("fast_release")
@properties
@given(
    n=st.integers(1, 300),
    initial=st.integers(1, 512),
    grow_after=st.integers(1, 3),
    fits=st.integers(1, 600),
    failing=st.frozensets(st.integers(1, 60), max_size=10),
)
def test_chunked_property_grow(n: int, initial: int, grow_after: int, fits: int, failing: frozenset[int]) -> None:
    """grow=True: still tiled once and correct; sizes climb by doubling, never above initial."""
    by_call, by_size = oom_for(failing), oom_above(fits)

    def inject(number: int, rows: int) -> None:
        by_call()
        by_size(rows)

    fn = Recorder(0, "tensor", inject)
    x = indexed(n)
    try:
        result = koila.chunked(fn, x, initial=initial, grow=True, grow_after=grow_after, cache=koila.NoCache())
    except koila.BatchSizeExhausted:
        assert fn.calls[-1][2], "it gives up only on a failure"
        assert fn.calls[-1][1] - fn.calls[-1][0] == 1
        finished = fn.calls[-1][0]
    else:
        assert_same(result, pure(x, 0, "tensor"))
        finished = n
    successes = [(b, e) for b, e, failed in fn.calls if not failed]
    assert [b for b, _ in successes] == [0, *(e for _, e in successes[:-1])][: len(successes)]
    assert (successes[-1][1] if successes else 0) == finished
    for (begin, end, failed), (next_begin, next_end, _) in zip(fn.calls, fn.calls[1:]):
        size, next_rows = end - begin, next_end - next_begin
        assert size <= initial
        if failed:
            assert next_begin == begin
            assert next_rows < size
        elif next_rows > size:  # growing: the next power of two up, capped at initial (and the rows left)
            assert next_rows == min(1 << size.bit_length(), initial, n - next_begin)


@st.composite
def spans(draw: st.DrawFn) -> tuple[int, int]:
    start = draw(st.integers(-300, 300))
    return start, start + draw(st.integers(0, 300))


@pytest.mark.usefixtures("fast_release")
@properties
@given(
    params=schedules(),
    span=spans(),
    failing=st.frozensets(st.integers(1, 40), max_size=12),
    threshold=st.none() | st.integers(0, 600),
    decorated=st.booleans(),
)
def test_range_property(
    params: dict[str, Any], span: tuple[int, int], failing: frozenset[int], threshold: int | None, decorated: bool
) -> None:
    """fn(begin, end) covers [start, stop) once, in order; results are the successful calls' results."""
    start, stop = span
    initial, minimum, max_attempts = params["initial"], params["minimum"], params["max_attempts"]
    by_call = oom_for(failing, kind=params["kind"])
    by_size = oom_above(threshold if threshold is not None else 10**9, kind=params["kind"])
    calls: list[tuple[int, int, bool]] = []

    def fn(begin: int, end: int) -> tuple[int, int]:
        calls.append((begin, end, True))
        by_call()
        by_size(end - begin)
        calls[-1] = (begin, end, False)
        return begin, end

    def fails(number: int, rows: int) -> bool:
        return number in failing or (threshold is not None and rows > threshold)

    options: dict[str, Any] = {
        "initial": initial,
        "minimum": minimum,
        "max_attempts": max_attempts,
        "cache": koila.NoCache(),
    }
    wrapped = koila.range(**options)(fn) if decorated else None

    def run() -> list[Any]:
        return wrapped(start, stop) if wrapped is not None else koila.range(fn, start, stop, **options)

    expected_calls, exhausted = predicted(stop - start, initial, minimum, fails, max_attempts)
    if exhausted:
        with pytest.raises(koila.BatchSizeExhausted) as excinfo:
            run()
        finished = check_calls(calls, start, stop, initial, minimum)
        assert finished < stop
        if sys.version_info >= (3, 11):
            (note,) = excinfo.value.__notes__
            assert note.startswith(f"{finished - start} of {stop - start} ")
    else:
        results = run()
        assert check_calls(calls, start, stop, initial, minimum) == stop
        assert results == [(begin, end) for begin, end, failed in calls if not failed]
    assert calls == [(start + b, start + e, failed) for b, e, failed in expected_calls]
    if wrapped is not None:
        assert wrapped.stats.ooms == sum(failed for _, _, failed in calls)


# --------------------------------------------------------------------------- 2. a real model


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 16)).eval()


def test_real_model_far_bigger_than_fits_matches_unconstrained_run() -> None:
    """Under a 1 MiB simulated device, 4096 rows in chunks give the unconstrained result."""
    model = mlp()
    x = torch.randn(4096, 64)
    with torch.no_grad():
        expected = model(x)
    events: list[koila.OOMEvent] = []
    with torch.no_grad(), simulated_device("1MiB") as device:
        result = koila.chunked(model, x, initial=4096, cache=koila.NoCache(), on_oom=events.append)
    assert [event.batch_size for event in events] == [4096, 2048, 1024, 512]
    assert [event.next_batch_size for event in events] == [2048, 1024, 512, 256]
    assert device.peak <= device.limit
    assert result.shape == (4096, 16)
    assert torch.allclose(result, expected, atol=1e-6)


def test_real_model_decorator_counts_ooms() -> None:
    model = mlp()
    x = torch.randn(3000, 64)
    with torch.no_grad():
        expected = model(x)

    @koila.chunked(initial=2048, cache=koila.NoCache())
    @torch.no_grad()
    def embed(rows: torch.Tensor) -> torch.Tensor:
        return model(rows)

    with simulated_device("1MiB"):
        result = embed(x)
    assert embed.stats.ooms >= 2
    assert embed.stats.batch_size == 256
    assert torch.allclose(result, expected, atol=1e-6)


def test_real_model_writes_into_preallocated_out() -> None:
    model = mlp()
    x = torch.randn(4096, 64)
    with torch.no_grad():
        expected = model(x)
    out = torch.full((4096, 16), float("nan"))
    events: list[koila.OOMEvent] = []
    with torch.no_grad(), simulated_device("1MiB"):
        result = koila.chunked(model, x, initial=4096, out=out, cache=koila.NoCache(), on_oom=events.append)
    assert result is out
    assert len(events) >= 2
    assert not out.isnan().any()
    assert torch.allclose(out, expected, atol=1e-6)


# --------------------------------------------------------------------------- 3. result structures

Pair = namedtuple("Pair", ["double", "square"])


@pytest.mark.parametrize(
    ("build", "kind"),
    [
        (lambda r: r * 2, torch.Tensor),
        (lambda r: (r * 2, r.sum(1)), tuple),
        (lambda r: [r * 2, r.sum(1)], list),
        (lambda r: {"double": r * 2, "sum": r.sum(1)}, dict),
        (lambda r: {"a": (r * 2, {"b": [r.sum(1)]}), "c": r[:, :1]}, dict),
        (lambda r: Pair(r * 2, r * r), Pair),
    ],
    ids=["tensor", "tuple", "list", "dict", "nested", "namedtuple"],
)
def test_structures_are_joined_leaf_by_leaf(build: Callable[[torch.Tensor], Any], kind: type) -> None:
    x = torch.arange(30.0).reshape(10, 3)
    result = koila.chunked(build, x, initial=4)
    assert type(result) is kind
    assert_same(result, build(x))


def test_none_from_every_chunk_gives_none() -> None:
    seen: list[int] = []
    assert koila.chunked(lambda r: seen.append(len(r)), torch.zeros(10, 2), initial=4) is None
    assert seen == [4, 4, 2]


@pytest.mark.parametrize("dim", [1, -1, 2, -2])
def test_split_and_join_along_other_dims(dim: int) -> None:
    x = torch.arange(2 * 9 * 5.0).reshape(2, 9, 5)
    sizes: list[int] = []

    def fn(chunk: torch.Tensor) -> torch.Tensor:
        sizes.append(chunk.size(dim))
        return chunk.cumsum(0) + 1

    result = koila.chunked(fn, x, initial=2, dim=dim)
    assert torch.equal(result, x.cumsum(0) + 1)
    total = x.size(dim)
    assert sizes == [2] * (total // 2) + [1] * (total % 2)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes are new in Python 3.11")
def test_a_view_that_a_chunk_along_another_dim_refuses_is_noted_on_the_error() -> None:
    """Chunks are views: along dim 1 they are not contiguous, and .view() refuses what it took whole."""

    def per_step(steps: torch.Tensor) -> torch.Tensor:  # (batch, time, features), batch and time flattened
        b, t, f = steps.shape
        return (steps.view(b * t, f) * 2).view(b, t, f)

    series = torch.arange(36.0).reshape(2, 6, 3)
    assert torch.equal(koila.chunked(per_step, series, dim=1, initial=8), series * 2)  # one chunk: the input
    with pytest.raises(RuntimeError, match="view size is not compatible") as info:
        koila.chunked(per_step, series, dim=1, initial=4)
    notes = getattr(info.value, "__notes__", [])
    assert len(notes) == 1
    assert notes[0].startswith("koila.chunked split the input along dim 1, and handed fn the rows 0 to 4: a chunk")
    assert "Use .reshape() (or .contiguous()) on the chunk in fn" in notes[0]
    with pytest.raises(RuntimeError, match="view size is not compatible") as info:  # not contiguous whole: no note
        koila.chunked(per_step, series.transpose(0, 1).contiguous().transpose(0, 1), dim=1, initial=4)
    assert not hasattr(info.value, "__notes__")


def test_non_tensor_arguments_reach_every_call_unchanged() -> None:
    config = {"scale": 3}
    items = [torch.ones(1)]  # one row broadcasts: the list passes as it is
    seen: list[tuple[object, object, float]] = []

    def fn(rows: torch.Tensor, cfg: dict[str, int], extra: list[torch.Tensor], offset: float) -> torch.Tensor:
        seen.append((cfg, extra, offset))
        return rows * cfg["scale"] + offset

    x = torch.arange(10.0)
    result = koila.chunked(fn, x, config, items, 0.5, initial=4)
    assert torch.equal(result, x * 3 + 0.5)
    assert len(seen) == 3
    assert all(cfg is config and extra is items and offset == 0.5 for cfg, extra, offset in seen)


def test_every_tensor_argument_is_split_alike() -> None:
    x, y = torch.arange(10.0), torch.arange(10.0) * 10
    pairs: list[tuple[list[float], list[float]]] = []

    def fn(a: torch.Tensor, label: str, b: torch.Tensor) -> torch.Tensor:
        pairs.append((a.tolist(), b.tolist()))
        return a + b

    assert torch.equal(koila.chunked(fn, x, "label", y, initial=4), x + y)
    assert pairs[1] == ([4.0, 5.0, 6.0, 7.0], [40.0, 50.0, 60.0, 70.0])


def test_keyword_tensors_are_split_in_the_decorator_form() -> None:
    seen: list[tuple[int, int, float]] = []

    @koila.chunked(initial=4)
    def masked(x: torch.Tensor, *, mask: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        seen.append((len(x), len(mask), fill))
        return torch.where(mask, x, torch.full_like(x, fill))

    x = torch.arange(10.0)
    mask = x % 3 == 0
    result = masked(x, mask=mask, fill=-1.0)
    assert torch.equal(result, torch.where(mask, x, torch.full_like(x, -1.0)))
    assert seen == [(4, 4, -1.0), (4, 4, -1.0), (2, 2, -1.0)]


def test_chunks_are_views_of_the_input_rows() -> None:
    x = torch.arange(20.0).reshape(10, 2)
    chunks: list[torch.Tensor] = []
    koila.chunked(lambda r: chunks.append(r), x, initial=4)
    assert [c.tolist() for c in chunks] == [x[0:4].tolist(), x[4:8].tolist(), x[8:10].tolist()]
    assert all(c.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for c in chunks)


def test_a_single_chunk_result_is_returned_as_fn_returned_it() -> None:
    """The docstring: a result of a single chunk is returned as fn returned it."""
    returned: list[Any] = []

    def fn(rows: torch.Tensor) -> list[torch.Tensor]:
        result = [rows * 2]
        returned.append(result)
        return result

    result = koila.chunked(fn, torch.arange(8.0), initial=8)
    assert result is returned[0]
    tensor_out = torch.arange(3.0)
    assert koila.chunked(lambda rows: tensor_out, torch.zeros(3), initial=8) is tensor_out


def test_a_failed_single_chunk_is_retried_as_two_and_joined(fast_release: None) -> None:
    inject = oom_for(1)
    returned: list[torch.Tensor] = []

    def fn(rows: torch.Tensor) -> torch.Tensor:
        inject()
        returned.append(rows + 1)
        return returned[-1]

    # 8 rows at 16 fails as a short chunk of 8; the retry at 4 needs two chunks.
    result = koila.chunked(fn, torch.arange(8.0), initial=16, cache=koila.NoCache())
    assert torch.equal(result, torch.arange(8.0) + 1)
    assert len(returned) == 2


def test_docstring_examples() -> None:
    x = torch.arange(10.0).reshape(5, 2)
    assert torch.equal(koila.chunked(lambda rows: rows * 2, x, initial=2), x * 2)
    assert koila.range(lambda begin, end: (begin, end), 0, 10, initial=4) == [(0, 4), (4, 8), (8, 10)]


# --------------------------------------------------------------------------- 4. errors


def test_tensors_of_different_sizes_name_both_arguments() -> None:
    calls: list[int] = []

    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return a

    with pytest.raises(ValueError, match=r"same size along dim 0 .*: the tensor a has 10, the tensor args\[2\] has 7"):
        koila.chunked(fn, torch.zeros(10), "x", torch.zeros(7))
    assert calls == []


def test_a_modules_arguments_are_named_as_its_forward_names_them() -> None:
    # A module's own signature is (*args, **kwargs): they were args[0] and args[1].
    class Masked(nn.Module):
        def forward(self, features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return features * mask

    with pytest.raises(ValueError, match=r"the tensor features has 4, the tensor mask has 3"):
        koila.chunked(Masked(), torch.ones(4, 2), torch.ones(3, 2), initial=2)


def test_keyword_tensor_of_different_size_is_named() -> None:
    @koila.chunked
    def fn(a: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
        return a

    with pytest.raises(ValueError, match=r"the tensor a has 10, the tensor mask has 9"):
        fn(torch.zeros(10), mask=torch.zeros(9))


def test_no_tensor_argument() -> None:
    with pytest.raises(
        ValueError, match=r"none of the arguments is a tensor \(got \['list', 'int'\]\): koila.range takes data"
    ):
        koila.chunked(lambda a, b: a, [1, 2], 3)


@pytest.mark.parametrize("dim", [2, -3, 5])
def test_dim_out_of_range_for_an_input(dim: int) -> None:
    with pytest.raises(
        ValueError, match=rf"dim {dim} is out of range for the tensor r of shape \(4, 3\); allowed: \[-2, 1\]"
    ):
        koila.chunked(lambda r: r, torch.zeros(4, 3), dim=dim)


def test_zero_dim_tensor_argument_passes_whole() -> None:
    scale = torch.tensor(2.0)
    seen: list[torch.Tensor] = []

    def fn(r: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        seen.append(t)
        return r * t

    assert torch.equal(koila.chunked(fn, torch.arange(4.0), scale, initial=2), torch.arange(4.0) * 2)
    assert len(seen) == 2
    assert all(t is scale for t in seen)


def test_only_zero_dim_tensors_have_no_rows() -> None:
    with pytest.raises(ValueError, match=r"along dim 0, and every tensor is 0-dimensional \(got \['Tensor'\]\)"):
        koila.chunked(lambda t: t, torch.tensor(2.0))


@pytest.mark.parametrize("out", [False, True], ids=["joined", "out"])
@pytest.mark.parametrize("initial", [512, 2], ids=["one-chunk", "split"])
def test_a_sparse_result_is_refused_whether_the_rows_take_one_chunk_or_more(initial: int, out: bool) -> None:
    buffers = {"d": torch.empty(7, 3), "s": torch.empty(7, 3)} if out else None
    with pytest.raises(
        ValueError,
        match=r"^fn returned a tensor of layout torch.sparse_coo at the result\['s'\]: koila.chunked writes each "
        r"chunk's rows into one tensor of every row, .* whether the rows take one chunk or more. Return it dense",
    ):
        koila.chunked(lambda r: {"d": r, "s": r.to_sparse()}, torch.randn(7, 3), initial=initial, out=buffers)


def test_dim_out_of_range_for_a_result() -> None:
    with pytest.raises(ValueError, match=r"shape \(4,\) at the result\['sum'\], which has no dim 1"):
        koila.chunked(lambda r: {"sum": r.sum(1)}, torch.zeros(4, 3), dim=1)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda r: 3, r"fn returned int at the result for the chunk from row 0; koila.chunked joins tensors"),
        (lambda r: r.tolist(), r"fn returned float at the result\[0\] for the chunk from row 0"),
        (lambda r: {"name": "alice"}, r"fn returned str at the result\['name'\]"),
    ],
    ids=["int", "list-of-floats", "dict-str"],
)
def test_a_result_without_a_tensor_names_the_type_and_place(build: Callable[[torch.Tensor], Any], message: str) -> None:
    with pytest.raises(TypeError, match=message):
        koila.chunked(build, torch.arange(4.0), initial=2)


def test_other_objects_beside_tensors_come_back_as_none_with_a_warning() -> None:
    class Cache:  # stands in for a model's key-value cache
        pass

    def fn(rows: torch.Tensor) -> dict[str, Any]:
        return {"logits": rows * 2, "past_key_values": Cache(), "extra": (rows, [rows, 1.5])}

    with pytest.warns(UserWarning, match=r"the result\['past_key_values'\] \(Cache\), the result\['extra'\]\[1\]\[1\]"):
        result = koila.chunked(fn, torch.arange(4.0), initial=2)
    assert result["past_key_values"] is None
    assert result["extra"][1][1] is None
    assert torch.equal(result["logits"], torch.arange(4.0) * 2)
    assert torch.equal(result["extra"][1][0], torch.arange(4.0))
    # Rows that fit in one chunk come back as fn returned them.
    whole = koila.chunked(fn, torch.arange(4.0), initial=4)
    assert isinstance(whole["past_key_values"], Cache)


def labelled(rows: torch.Tensor) -> dict[str, Any]:
    """Per row: a total, and a string, as a decoder returns text."""
    totals = rows.sum(1)
    scratch = torch.zeros(len(rows), 64)  # memory per row, for the simulated device to run short of
    return {"total": totals + scratch[:, 0], "text": [f"row of {int(total)}" for total in totals.tolist()]}


def test_lists_of_one_string_per_row_are_joined_when_an_oom_changes_the_chunks() -> None:
    x = torch.arange(24.0).reshape(12, 2)
    expected = labelled(x)
    events: list[koila.OOMEvent] = []
    with simulated_device("2KiB"), warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing comes back as None
        got = koila.chunked(labelled, x, initial=8, on_oom=events.append)
    assert [(event.batch_size, event.next_batch_size) for event in events] == [(8, 4)]
    assert torch.equal(got["total"], expected["total"])
    assert got["text"] == expected["text"]


def test_a_result_that_is_only_a_list_of_strings_is_joined() -> None:
    got = koila.chunked(lambda rows: [f"<{int(v)}>" for v in rows.tolist()], torch.arange(5.0), initial=2)
    assert got == ["<0>", "<1>", "<2>", "<3>", "<4>"]


@pytest.mark.parametrize("rows", [5, 8, 11])
def test_a_list_of_strings_that_is_not_one_per_row_comes_back_as_none_whatever_the_chunks(rows: int) -> None:
    def fn(x: torch.Tensor) -> dict[str, Any]:
        return {"rows": x, "classes": ["cat", "dog", "bird"]}

    # 5 rows in chunks of 3: one per row in the first chunk, not in the second; 8 and 11: never, or not at first.
    with pytest.warns(UserWarning, match=r"the result\['classes'\]|a list of 3 strings for the rows 3 to 5, where"):
        got = koila.chunked(fn, torch.arange(float(rows)), initial=3 if rows == 5 else 4)
    assert got["classes"] is None
    assert torch.equal(got["rows"], torch.arange(float(rows)))


def test_a_list_of_strings_per_row_in_a_later_chunk_only_stays_none() -> None:
    def fn(x: torch.Tensor) -> dict[str, Any]:
        return {"rows": x, "names": ["a", "b"]}  # a chunk of 2 rows has as many

    with pytest.warns(UserWarning, match=r"the result\['names'\] \(list\)"):
        got = koila.chunked(fn, torch.arange(6.0), initial=4)
    assert got["names"] is None


def test_lists_of_numbers_per_row_are_not_joined() -> None:
    with pytest.raises(TypeError, match=r"fn returned float at the result\[0\] for the chunk from row 0"):
        koila.chunked(lambda rows: rows.tolist(), torch.arange(4.0), initial=2)


class _Out(dict):  # type: ignore[type-arg]
    pass


def test_a_dict_subclass_in_a_result_is_refused_saying_why() -> None:
    # The message told to return "a dict", which the result was: pytree takes a subclass for one leaf.
    with pytest.raises(TypeError, match=r"fn returned _Out \(a subclass of dict, which torch.utils._pytree takes"):
        koila.chunked(lambda rows: _Out(rows=rows), torch.arange(4.0), initial=2)


def test_a_list_of_strings_without_a_row_each_and_no_tensor_is_refused() -> None:
    with pytest.raises(TypeError, match=r"fn returned list at the result for the chunk from row 0"):
        koila.chunked(lambda rows: ["one"], torch.arange(4.0), initial=2)


def test_a_list_of_strings_per_row_with_out_is_refused() -> None:
    def fn(rows: torch.Tensor) -> dict[str, Any]:
        return {"rows": rows, "text": ["x"] * len(rows)}

    # It said "a str at the result['text'][0]": the list is what fn returned (probe 72A).
    with pytest.raises(ValueError, match=r"fn returned a list of strings at the result\['text'\], and out has no"):
        koila.chunked(fn, torch.arange(4.0), initial=2, out={"rows": torch.empty(4)})
    with pytest.raises(ValueError, match=r"^fn returned a list of strings at the result, and out has nothing there"):
        koila.chunked(lambda rows: ["x"] * len(rows), torch.arange(4.0), initial=2, out=torch.empty(4))
    with pytest.raises(ValueError, match=r"a list of strings at the result, .* The result has no tensor; out has"):
        koila.chunked(lambda rows: ["x"] * len(rows), torch.arange(4.0), initial=2, out={"a": torch.empty(4)})


def test_a_later_chunk_that_returns_strings_where_the_first_returned_a_tensor_names_the_place() -> None:
    calls = iter(range(100))

    def fn(rows: torch.Tensor) -> dict[str, Any]:
        return {"a": rows, "b": rows if next(calls) == 0 else ["s"] * len(rows)}

    with pytest.raises(ValueError, match=r"a list of strings at the result\['b'\] for the chunk from row 2, where"):
        koila.chunked(fn, torch.arange(4.0), initial=2)


def test_a_later_chunk_that_returns_none_where_the_first_returned_a_tensor_names_the_place() -> None:
    calls = iter(range(100))

    def fn(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return rows * 2, rows if next(calls) == 0 else None

    with pytest.raises(ValueError, match=r"^fn returned None at the result\[1\] for the chunk from row 2, where"):
        koila.chunked(fn, torch.arange(4.0), initial=2)


def test_no_rows_give_the_empty_list_of_strings_and_a_result_of_nothing_is_refused() -> None:
    assert koila.chunked(lambda rows: [str(v) for v in rows.tolist()], torch.zeros(0)) == []
    for empty in ({}, []):
        with pytest.raises(TypeError, match=rf"fn returned {re.escape(repr(empty))} for the chunk from row 0, which"):
            koila.chunked(lambda rows, empty=empty: empty, torch.zeros(4), initial=2)


def test_a_later_chunk_that_returns_a_tensor_where_the_first_returned_strings_names_the_place() -> None:
    calls = iter(range(100))

    def fn(rows: torch.Tensor) -> dict[str, Any]:
        return {"a": rows, "b": ["s"] * len(rows) if next(calls) == 0 else rows}

    with pytest.raises(ValueError, match=r"a tensor at the result\['b'\] for the chunk from row 2, where the first"):
        koila.chunked(fn, torch.arange(4.0), initial=2)


@pytest.mark.parametrize("initial", [4, 16], ids=["chunks", "one-chunk"])
@pytest.mark.parametrize(
    ("fn", "shown"),
    [(lambda rows: rows[rows[:, 0] > 0], "rows along dim 0"), (lambda rows: rows.T, "has 2 rows along dim 0")],
    ids=["filtered", "transposed"],
)
def test_a_result_without_a_row_per_input_row_is_refused_however_many_chunks(
    initial: int, fn: Callable[[torch.Tensor], torch.Tensor], shown: str
) -> None:
    x = torch.arange(16.0).reshape(8, 2) - 6  # some rows pass the filter, some do not
    with pytest.raises(ValueError, match=rf"{shown}, and koila.chunked needs one result row per input row"):
        koila.chunked(fn, x, initial=initial)


def test_zero_dim_result() -> None:
    with pytest.raises(ValueError, match=r"fn returned a tensor of shape \(\) at the result, which has no dim 0"):
        koila.chunked(lambda r: r.sum(), torch.arange(4.0), initial=2)


def test_zero_dim_result_from_a_later_chunk() -> None:
    # Squeezing a 1-row last chunk is the classic way to get there.
    with pytest.raises(ValueError, match=r"shape \(\) at the result, which has no dim 0"):
        koila.chunked(lambda r: r.squeeze(), torch.arange(5.0).reshape(5, 1), initial=4)


def test_zero_dim_result_from_a_later_chunk_with_out() -> None:
    with pytest.raises(ValueError, match=r"no dim 0"):
        koila.chunked(lambda r: r.squeeze(), torch.arange(5.0).reshape(5, 1), initial=4, out=torch.empty(5))


def test_non_tensor_result_from_a_later_chunk_names_the_place() -> None:
    calls = iter(range(100))

    def fn(rows: torch.Tensor) -> dict[str, Any]:
        return {"a": rows} if next(calls) == 0 else {"a": 3}

    with pytest.raises(TypeError, match=r"fn returned int at the result\['a'\] for the chunk from row 4"):
        koila.chunked(fn, torch.arange(5.0), initial=4)


@pytest.mark.parametrize(
    ("results", "shown"),
    [
        ([lambda r: (r, r), lambda r: {"a": r}], "(*, *) and then {'a': *}"),
        ([lambda r: None, lambda r: r], "None and then a value"),
        ([lambda r: None, lambda r: (r,)], "None and then (*)"),
        ([lambda r: (r, r), lambda r: (r, r, r)], "(*, *) and then (*, *, *)"),
        ([lambda r: {"a": r}, lambda r: {"b": r}], "{'a': *} and then {'b': *}"),
        ([lambda r: r, lambda r: None], "a value and then None"),
        ([lambda r: [r, {"a": r}], lambda r: [r, r]], "[*, {'a': *}] and then [*, *]"),
    ],
    ids=[
        "tuple-then-dict",
        "none-then-tensor",
        "none-then-tuple",
        "pair-then-triple",
        "other-keys",
        "tensor-then-none",
        "nested",
    ],
)
def test_structure_changing_between_chunks_is_shown_on_one_line(
    results: list[Callable[[torch.Tensor], Any]], shown: str
) -> None:
    # Printed as TreeSpecs, None and a tensor both read "*", and containers spread over lines.
    calls = iter(range(100))

    def fn(rows: torch.Tensor) -> Any:
        return results[min(next(calls), 1)](rows)

    with pytest.raises(ValueError, match="fn returned results of different structures for different chunks") as caught:
        koila.chunked(fn, torch.arange(6.0), initial=2)
    assert str(caught.value).endswith(f"chunks: {shown}")


def test_out_with_wrong_rows() -> None:
    calls: list[int] = []
    with pytest.raises(ValueError, match=r"out has shape \(5, 2\); it needs 10 rows along dim 0, one per input row"):
        koila.chunked(lambda r: calls.append(1), torch.zeros(10, 2), out=torch.zeros(5, 2))
    assert calls == []


def test_out_without_the_dim() -> None:
    with pytest.raises(ValueError, match=r"out\[1\] has shape \(10,\); it needs 10 rows along dim 1"):
        koila.chunked(lambda r: r, torch.zeros(4, 10), dim=1, out=(torch.zeros(4, 10), torch.zeros(10)))


def test_out_holding_a_non_tensor() -> None:
    with pytest.raises(TypeError, match=r"out must hold tensors, got int at out\['b'\]"):
        koila.chunked(lambda r: r, torch.zeros(4), out={"a": torch.zeros(4), "b": 3})


def test_out_with_a_different_structure() -> None:
    with pytest.raises(
        ValueError,
        match=r"fn returned a tensor at the result\[0\], and out has nothing there \(out is a Tensor without \[0\]\): "
        r"out needs one tensor at each "
        r"place where fn's result has one, matched by key .* The result has them at the result\[0\], the "
        r"result\[1\]; out has them at out$",
    ):
        koila.chunked(lambda r: (r, r), torch.zeros(4), out=torch.zeros(4))


def test_a_dict_out_is_matched_by_key_in_any_order() -> None:
    out = {"b": torch.zeros(6), "a": torch.zeros(6, dtype=torch.float64)}

    def fn(rows: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"a": rows * 2, "b": rows + 1}

    result = koila.chunked(fn, torch.arange(6.0), initial=4, out=out)
    assert result is out
    assert out["a"].tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    assert out["b"].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    nested = {"pair": (torch.zeros(6), torch.zeros(6)), "x": {"z": torch.zeros(6), "y": torch.zeros(6)}}
    koila.chunked(lambda r: {"x": {"y": r, "z": -r}, "pair": (r, r * 3)}, torch.arange(6.0), initial=4, out=nested)
    assert nested["x"]["z"].tolist() == [-0.0, -1.0, -2.0, -3.0, -4.0, -5.0]
    assert nested["pair"][1].tolist() == [0.0, 3.0, 6.0, 9.0, 12.0, 15.0]


@pytest.mark.parametrize(
    ("out", "says"),
    [
        (
            {"a": torch.zeros(4)},
            r"fn returned a tensor at the result\['b'\], and out has nothing there \(out is a dict without \['b'\]\)",
        ),
        (
            {"a": torch.zeros(4), "b": torch.zeros(4), "c": torch.zeros(4)},
            r"out has a tensor at out\['c'\], and fn's result has none there",
        ),
        ({"a": torch.zeros(4), "b": {"x": torch.zeros(4)}}, r"the result\['b'\], and out has a dict there"),
    ],
    ids=["missing", "extra", "nested"],
)
def test_a_dict_out_with_missing_or_extra_keys_says_which(out: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=rf"{says}: out needs one tensor at each place .* The result has them at "):
        koila.chunked(lambda r: {"b": r, "a": r}, torch.arange(4.0), initial=2, out=out)
    assert not any(tensor.any() for tensor in tree_flatten(out)[0])  # refused before a row was written


def test_strings_per_row_with_out_are_refused_saying_they_join_without_out() -> None:
    # The refusal spoke of tensors only, at a place that held a string (probe 71G).
    buffer = torch.zeros(4)
    with pytest.raises(ValueError, match=r"with out=, fn may return only tensors and None: a list of strings per row"):
        koila.chunked(
            lambda r: {"x": r * 2, "text": [str(v) for v in r.tolist()]}, torch.arange(4.0), out={"x": buffer}
        )
    joined = koila.chunked(lambda r: {"x": r * 2, "text": [str(v) for v in r.tolist()]}, torch.arange(4.0), initial=2)
    assert joined["text"] == ["0.0", "1.0", "2.0", "3.0"]


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.zeros(4, 2, requires_grad=True),
        lambda: torch.zeros(8, 2, requires_grad=True)[:4],
    ],
    ids=["leaf", "view-of-a-leaf"],
)
def test_out_that_requires_grad_is_refused_before_anything_runs(make: Callable[[], torch.Tensor]) -> None:
    calls: list[int] = []

    def fn(rows: torch.Tensor) -> dict[str, torch.Tensor]:
        calls.append(len(rows))
        return {"x": rows * 2}

    with pytest.raises(
        ValueError,
        match=r"out\['x'\] requires grad and is a leaf tensor \(or a view of one\): koila.chunked writes each "
        r"chunk's rows into out in place, .* Pass out\['x'\].detach\(\) .* or call koila.chunked under "
        r"torch.no_grad\(\)",
    ):
        koila.chunked(fn, torch.ones(4, 2), initial=2, out={"x": make()})
    assert calls == []
    # Under no_grad, writing into it is allowed, as it is to any in-place operation.
    out = {"x": make()}
    with torch.no_grad():
        koila.chunked(fn, torch.ones(4, 2), initial=2, out=out)
    assert out["x"].tolist() == [[2.0, 2.0]] * 4
    # A tensor that requires grad and is not a leaf records the writes.
    weight = torch.ones(4, 2, requires_grad=True)
    written = weight * 0
    koila.chunked(lambda r: r * weight[: len(r)], torch.ones(4, 2), initial=2, out=written)
    written.sum().backward()
    assert weight.grad is not None


@pytest.mark.parametrize(
    ("make", "shown"),
    [
        (lambda buffer: (buffer[:6], buffer[:6]), r"out\[0\] and out\[1\]"),
        (lambda buffer: {"a": buffer[:6, :2], "b": buffer[:6, 1:3]}, r"out\['a'\] and out\['b'\]"),
        (lambda buffer: [buffer[:6, 0], buffer[:6, :1].squeeze(1)], r"out\[0\] and out\[1\]"),
        (lambda buffer: (buffer[:6, 0], buffer[2:, 0]), r"out\[0\] and out\[1\]"),
    ],
    ids=["same-tensor", "overlapping-columns", "same-column", "shifted-rows"],
)
def test_out_tensors_that_share_memory_are_refused_before_fn_runs(
    make: Callable[[torch.Tensor], Any], shown: str
) -> None:
    calls: list[int] = []
    with pytest.raises(ValueError, match=rf"^{shown} share memory \(the same tensor, or views of one that overlap\)"):
        koila.chunked(lambda r: calls.append(len(r)), torch.ones(6, 2), initial=4, out=make(torch.zeros(8, 4)))
    assert calls == []


def test_out_tensors_side_by_side_in_one_buffer_are_taken() -> None:
    x = torch.arange(12.0).reshape(6, 2)
    buffer = torch.zeros(6, 2, 3)
    out = (buffer[:, :, 0], buffer[:, :, 1], buffer[..., 2])  # interleaved, one column each
    result = koila.chunked(lambda r: (r, r * 10, r * 100), x, initial=4, out=out)
    assert result is out
    assert torch.equal(buffer, torch.stack([x, x * 10, x * 100], dim=2))
    columns = torch.zeros(6, 5)
    koila.chunked(lambda r: {"a": r, "b": -r}, x, initial=4, out={"a": columns[:, :2], "b": columns[:, 3:]})
    assert torch.equal(columns, torch.cat([x, torch.zeros(6, 1), -x], dim=1))


@pytest.mark.parametrize(
    "make",
    [lambda: torch.randn(6, 3, 3), lambda: torch.randn(6, 3, 6)[:, :, ::2]],
    ids=["dense", "strided"],
)
@pytest.mark.parametrize("initial", [2, 8])
def test_out_x_with_fn_returning_its_rows_reshaped_is_exact(make: Callable[[], torch.Tensor], initial: int) -> None:
    # rows.mT is the chunk's own memory read in another order: copied as it was, the strided one came out
    # wrong and the dense one was torch's overlap error.
    x = make()
    expected = x.mT.clone()
    twice = torch.zeros(6, 3, 3)
    with torch.no_grad():
        result = koila.chunked(lambda rows: (rows.mT, rows * 2), x, initial=initial, out=(x, twice))
    assert result[0] is x
    assert torch.equal(x, expected)
    assert torch.equal(twice, expected.mT * 2)


@pytest.mark.parametrize("initial", [2, 8])
def test_out_whose_places_a_chunk_reads_from_gets_what_fn_returned(initial: int) -> None:
    # out=(x, saved) of fn returning (rows * 10, rows): writing x's rows first changed the rows that saved
    # then got, the new values for the old; and out=(x, y) of fn swapping them (probe 72H).
    x = torch.arange(8.0).reshape(8, 1)
    old = x.clone()
    saved = torch.empty_like(x)
    with torch.no_grad():
        new, kept = koila.chunked(lambda rows: (rows * 10, rows), x, initial=initial, out=(x, saved))
    assert torch.equal(new, old * 10)
    assert torch.equal(kept, old)
    a, b = torch.arange(8.0), -torch.arange(8.0)
    with torch.no_grad():
        koila.chunked(lambda p, q: (q, p), a, b, initial=initial, out=(a, b))
    assert torch.equal(a, -torch.arange(8.0))
    assert torch.equal(b, torch.arange(8.0))
    # The same memory through two storage objects, which storage pointers did not tell (probe 72J).
    numpy = pytest.importorskip("numpy")
    array = numpy.arange(9.0, dtype=numpy.float32).reshape(9, 1)
    kept = torch.empty(8, 1)
    with torch.no_grad():
        koila.chunked(
            lambda rows: (rows * 10, rows),
            torch.from_numpy(array[1:]),
            initial=initial,
            out=(torch.from_numpy(array)[1:], kept),
        )
    assert torch.equal(kept, torch.arange(1.0, 9.0).reshape(8, 1))
    square = numpy.arange(8 * 9.0, dtype=numpy.float32).reshape(8, 3, 3)
    expected = torch.from_numpy(square.copy()).mT.clone()
    with torch.no_grad():
        koila.chunked(
            lambda rows: rows.mT, torch.from_numpy(square[1:]), initial=initial, out=torch.from_numpy(square)[1:]
        )
    assert torch.equal(torch.from_numpy(square)[1:], expected[1:])


@pytest.mark.parametrize(
    "make",
    [lambda: torch.zeros(1, 2).expand(6, 2), lambda: torch.zeros(13).as_strided((6, 2), (1, 1))],
    ids=["expand", "overlapping-strides"],
)
def test_an_out_whose_rows_share_memory_is_refused_before_fn_runs(make: Callable[[], torch.Tensor]) -> None:
    calls: list[int] = []

    def fn(rows: torch.Tensor) -> torch.Tensor:
        calls.append(len(rows))
        return rows

    with pytest.raises(ValueError, match=r"^out\['x'\] has elements that share memory .* \(out\['x'\].clone\(\), or"):
        koila.chunked(lambda r: {"x": fn(r)}, torch.ones(6, 2), initial=4, out={"x": make()})
    assert calls == []
    out = torch.zeros(13).as_strided((6, 2), (2, 1))  # strides that do not overlap: taken
    assert torch.equal(koila.chunked(fn, torch.ones(6, 2), initial=4, out=out), torch.ones(6, 2))


def test_an_inference_out_is_refused_outside_inference_mode_before_fn_runs() -> None:
    calls: list[int] = []

    def fn(rows: torch.Tensor) -> torch.Tensor:
        calls.append(len(rows))
        return rows * 2

    with torch.inference_mode():
        out = torch.zeros(6, 2)
    refused = (
        r"^out is an inference tensor \(made under torch.inference_mode\(\)\), and koila.chunked is called outside "
        r"inference mode, .* \(out.clone\(\) outside inference mode makes one\)$"
    )
    for guard in (torch.enable_grad, torch.no_grad):
        with guard(), pytest.raises(ValueError, match=refused):
            koila.chunked(fn, torch.ones(6, 2), initial=4, out=out)
    assert calls == []
    with torch.inference_mode():  # inside it, the writes are allowed
        koila.chunked(fn, torch.ones(6, 2), initial=4, out=out)
    assert torch.equal(out, torch.full((6, 2), 2.0))


def test_with_out_a_function_that_returns_none_is_told_none_is_for_calls_without_out() -> None:
    with pytest.raises(
        TypeError,
        match=r"^fn returned NoneType at the result for the chunk from row 0; with out=, koila.chunked writes the "
        r"tensors fn returns into out's, so fn must return a tensor at each place where out has one \(None is for a "
        r"function that writes its results itself, called without out=\)$",
    ):
        koila.chunked(lambda r: None, torch.ones(3, 1), initial=2, out=torch.empty(3, 1))


@pytest.mark.parametrize("out", [False, True], ids=["joined", "out"])
@pytest.mark.parametrize("initial", [8, 2], ids=["one-chunk", "split"])
def test_a_dict_whose_keys_come_in_another_order_in_a_chunk_is_matched_by_key(out: bool, initial: int) -> None:
    def fn(rows: torch.Tensor) -> dict[str, Any]:
        first = rows[0, 0] == 0
        parts = {"a": rows * 1, "b": (rows * 2, rows[:, 0])}
        return parts if first else {"b": parts["b"], "a": parts["a"]}

    x = torch.arange(15.0).reshape(5, 3)
    buffers = {"b": (torch.empty(5, 3), torch.empty(5)), "a": torch.empty(5, 3)} if out else None
    result = koila.chunked(fn, x, initial=initial, out=buffers, cache=koila.NoCache())
    assert list(result) == (["b", "a"] if out else ["a", "b"])  # out's, or the first chunk's order
    assert torch.equal(result["a"], x)
    assert torch.equal(result["b"][0], x * 2)
    assert torch.equal(result["b"][1], x[:, 0])
    with pytest.raises(ValueError, match=r"different structures for different chunks: \{'a': \*, 'b': \(\*, \*\)\}"):
        koila.chunked(lambda r: fn(r) if r[0, 0] == 0 else {"a": r, "b": r}, x, initial=2)


@pytest.mark.parametrize("out", [None, torch.zeros(4)], ids=["joined", "out"])
def test_a_result_with_other_rows_than_its_chunk_is_refused(out: torch.Tensor | None) -> None:
    with pytest.raises(
        ValueError,
        match=r"shape \(1,\) .* at the result for rows 0 to 2: it has 1 rows along dim 0, and koila.chunked needs "
        r"one result row per input row, 2 here",
    ):
        koila.chunked(lambda r: r[:1], torch.zeros(4), initial=2, out=out)


def test_a_later_chunk_with_other_rows_is_refused_too() -> None:
    with pytest.raises(ValueError, match=r"\['b'\] for rows 2 to 4: it has 3 rows"):
        koila.chunked(lambda r: {"a": r, "b": torch.zeros(2 if r[0] == 0 else 3)}, torch.arange(4), initial=2)


def test_out_of_another_shape_is_a_value_error_before_torch_sees_it() -> None:
    with pytest.raises(
        ValueError,
        match=r"fn returned a tensor of shape \(2, 4\) at the result\['x'\] for rows 0 to 2, whose rows have shape "
        r"\(4,\), and out\['x'\] has shape \(4, 3\), whose rows have shape \(3,\): .* Give out\['x'\] the shape "
        r"\(4, 4\)$",
    ):
        koila.chunked(lambda r: {"x": r.repeat(1, 2)}, torch.zeros(4, 2), initial=2, out={"x": torch.zeros(4, 3)})


def test_out_is_not_filled_by_broadcasting() -> None:
    out = torch.zeros(4, 3)
    with pytest.raises(ValueError, match=r"shape \(2, 1\) .* out has shape \(4, 3\), .* never filled by broadcasting"):
        koila.chunked(lambda r: r, torch.ones(4, 1), initial=2, out=out)
    assert not out.any()


def test_out_takes_dtypes_that_cast_safely_and_refuses_others() -> None:
    wide = koila.chunked(lambda r: r * 2, torch.arange(4.0), initial=2, out=torch.zeros(4, dtype=torch.float64))
    assert wide.dtype == torch.float64
    assert wide.tolist() == [0.0, 2.0, 4.0, 6.0]
    with pytest.raises(
        ValueError,
        match=r"^fn returned a tensor of dtype torch.float32 at the result\[1\] for rows 0 to 2, and out\[1\] has "
        r"dtype torch.int64, which torch.float32 cannot be cast to without changing its kind \(torch.can_cast\("
        r"torch.float32, torch.int64\) is False\). Give out\[1\] the dtype torch.float32, or one that it can be "
        r"cast to, or return torch.int64 from fn$",
    ):
        koila.chunked(
            lambda r: (r.long(), r * 2),
            torch.arange(4.0),
            initial=2,
            out=(torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long)),
        )


def test_chunks_of_another_shape_than_the_first_are_refused() -> None:
    def fn(rows: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"x": rows[:, :2] if rows[0, 0] == 0 else rows}

    with pytest.raises(
        ValueError,
        match=r"^fn returned a tensor of shape \(2, 3\) at the result\['x'\] for rows 2 to 4, whose rows have shape "
        r"\(3,\), and the first chunk's rows there have shape \(2,\): every chunk's result must have the first "
        r"chunk's shape, but for its number of rows along dim 0$",
    ):
        koila.chunked(fn, torch.arange(12.0).reshape(4, 3), initial=2)


def test_chunks_of_another_dtype_than_the_first_are_refused() -> None:
    def fn(rows: torch.Tensor) -> torch.Tensor:
        return rows.double() if rows[0] > 0 else rows

    with pytest.raises(
        ValueError,
        match=r"^fn returned a tensor of dtype torch.float64 at the result for rows 2 to 4, and the first chunk "
        r"returned torch.float32 there: every chunk's result must have the first chunk's dtype at each place. "
        r"Return torch.float32 from fn for every chunk \(with .to\(torch.float32\), say\)$",
    ):
        koila.chunked(fn, torch.arange(4.0), initial=2)


def test_the_result_is_written_as_the_chunks_come_so_the_end_needs_no_second_copy() -> None:
    """Ten chunks of 1 MiB results on a 12 MiB device: joining them at the end would need 20 MiB."""
    x = torch.arange(10 * 2**18, dtype=torch.float32).reshape(10, 2**18)  # 1 MiB a row, made outside
    calls: list[int] = []

    def double(rows: torch.Tensor) -> torch.Tensor:
        calls.append(len(rows))
        return rows * 2

    with simulated_device("12MiB") as device:
        result = koila.chunked(double, x, initial=1, cache=koila.NoCache())
        peak = device.peak
    assert calls == [1] * 10  # no chunk failed, none was run again
    assert torch.equal(result, x * 2)
    assert peak <= 11 * 2**20  # the result and one chunk's


def test_a_result_that_does_not_fit_beside_even_the_smallest_first_chunk_is_said_before_any_other_chunk() -> None:
    x = torch.zeros(10, 2**18)  # 1 MiB a row
    calls: list[int] = []

    def double(rows: torch.Tensor) -> torch.Tensor:
        calls.append(len(rows))
        return rows * 2

    with simulated_device("6MiB"), pytest.raises(torch.OutOfMemoryError) as info:
        koila.chunked(double, x, initial=2, cache=koila.NoCache())
    assert calls == [2, 1]  # the first chunk was tried smaller, down to one row; no other chunk ran
    message = str(info.value)
    assert "koila.chunked cannot allocate its result: 10 rows (10.00 MiB on cpu) do not fit beside the" in message
    assert "even at 1 row, the smallest size it could try" in message
    assert "Pass out= a tensor with room for every row, on the CPU" in message
    assert not isinstance(info.value, koila.BatchSizeExhausted)
    assert info.value.__context__ is None  # raised outside the handler: no attempt's frames pinned
    assert info.value.__cause__ is None
    # With out= on the host, the same pass runs: a result given needs no allocation.
    calls.clear()
    out = torch.empty(10, 2**18)
    with simulated_device("6MiB"):
        koila.chunked(double, x, initial=2, cache=koila.NoCache(), out=out)
    assert torch.equal(out, x * 2)
    assert calls == [2] * 5


@pytest.mark.parametrize(
    ("max_attempts", "minimum", "says", "advice"),
    [
        (2, 1, "gave up after max_attempts=2 attempts", "max_attempts=2 ended the search"),
        (None, 2, "batch size 2 is the minimum", "minimum=2 ended the search"),
    ],
    ids=["max_attempts", "minimum"],
)
def test_a_result_that_a_cap_kept_from_a_smaller_first_chunk_gives_up_as_any_chunk_does(
    max_attempts: int | None, minimum: int, says: str, advice: str
) -> None:
    """8 rows of 512 KiB results on 4.75 MiB: the result fits beside a first chunk of one row, not of two."""
    x = torch.zeros(8, 2**16)  # made outside the device: not counted
    calls: list[int] = []

    def wide(rows: torch.Tensor) -> torch.Tensor:
        calls.append(len(rows))
        return rows.repeat(1, 2)

    with simulated_device("4.75MiB"), pytest.raises(koila.BatchSizeExhausted, match=says) as info:
        koila.chunked(wide, x, initial=4, cache=koila.NoCache(), max_attempts=max_attempts, minimum=minimum)
    told = "\n".join([str(info.value), *getattr(info.value, "__notes__", [])])
    assert calls == [4, 2]
    assert "smaller chunks would not help" not in told
    if sys.version_info >= (3, 11):
        assert f"beside the first chunk at 2 rows, the last size tried; {advice}" in told
    calls.clear()
    with simulated_device("4.75MiB"):  # without the cap, a first chunk of one row leaves room for it
        result = koila.chunked(wide, x, initial=4, cache=koila.NoCache())
    assert torch.equal(result, x.repeat(1, 2))
    assert calls == [4, 2, *[1] * 8]


def test_auto_sizes_chunks_alike_whether_out_is_a_tensor_or_holds_one() -> None:
    """out's tensors were there before the estimate: only a result the call makes is held beside the chunks."""

    def sizes_with(wrap: Callable[[Any], Any]) -> list[int]:
        sizes: list[int] = []

        def embed(rows: torch.Tensor) -> Any:
            sizes.append(len(rows))
            with torch.no_grad():
                return wrap(model(rows))

        torch.manual_seed(0)
        with simulated_device("16MiB"):
            model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 64)).eval()
            inputs, buffer = torch.randn(12_000, 64), torch.empty(12_000, 64)
            koila.chunked(embed, inputs, initial="auto", out=wrap(buffer), cache=koila.NoCache())
        with torch.no_grad():
            torch.testing.assert_close(buffer, model(inputs))
        return sizes

    plain = sizes_with(lambda tensor: tensor)
    assert len(plain) > 3  # split: the result would not fit with a chunk of every row
    assert sizes_with(lambda tensor: {"y": tensor}) == plain
    assert sizes_with(lambda tensor: (tensor,)) == plain


def test_a_result_that_does_not_fit_beside_the_first_chunk_makes_it_smaller() -> None:
    """300 rows of 1 KiB on 450 KiB: the result and a chunk of 128 rows fit, with one of 256 they do not."""
    x = torch.randn(300, 256)  # made outside the device: not counted
    calls: list[int] = []
    outputs: list[weakref.ref[torch.Tensor]] = []

    def double(rows: torch.Tensor) -> torch.Tensor:
        # The output of the first chunk that was too large is gone before its retry starts.
        assert all(output() is None for output in outputs)
        calls.append(len(rows))
        result = rows * 2
        if len(rows) == 256:
            outputs.append(weakref.ref(result))
        return result

    wrapped = koila.chunked(initial=256, cache=koila.NoCache())(double)
    with simulated_device("450KiB"):
        result = wrapped(x)
    assert torch.equal(result, x * 2)
    assert calls == [256, 128, 128, 44]
    assert wrapped.stats.ooms == 1
    assert wrapped.stats.exhausted == 0


def test_a_cached_first_chunk_beside_which_the_result_does_not_fit_is_made_smaller() -> None:
    x = torch.randn(300, 256)  # 1 KiB a row
    first_pass = [True]
    calls: list[int] = []
    inject = oom_above(256)

    @koila.chunked(initial=512)
    def double(rows: torch.Tensor) -> torch.Tensor:
        calls.append(len(rows))
        if first_pass[0]:  # 300 rows fail, and half a row of result each leaves room beside 256
            inject(len(rows))
            return rows[:, :128] * 2
        return rows * 2

    passes: list[list[int]] = []
    expected = [x[:, :128] * 2, x * 2]  # made outside the device
    with simulated_device("450KiB"):  # one device and one call site: the cache's key
        for _ in range(2):
            first_pass[0], calls[:] = not passes, []
            equal = torch.equal(double(x), expected[len(passes)])  # and the result is gone
            passes.append(list(calls))
            assert equal
    assert passes == [[300, 256, 44], [256, 128, 128, 44]]  # the second pass starts at the 256 cached
    assert double.stats.ooms == 2


def test_out_given_to_the_decorator_factory() -> None:
    with pytest.raises(TypeError, match=r"out= is given per call: koila.chunked\(fn, x, out=buffer\)"):
        koila.chunked(out=torch.zeros(3))
    with pytest.raises(TypeError, match="out= is given per call"):
        koila.chunked(lambda r: r, out=torch.zeros(3))


@pytest.mark.parametrize(("initial", "message"), [(0, "initial must be >= 1, got 0"), (-4, "initial must be >= 1")])
def test_initial_below_one(initial: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        koila.chunked(lambda r: r, torch.zeros(4), initial=initial)
    with pytest.raises(ValueError, match=message):
        koila.chunked(initial=initial)(lambda r: r)
    with pytest.raises(ValueError, match=message):
        koila.range(lambda b, e: None, 0, 4, initial=initial)


def test_initial_of_the_wrong_type() -> None:
    with pytest.raises(TypeError, match="initial must be an int, got float 4.0"):
        koila.chunked(lambda r: r, torch.zeros(4), initial=4.0)  # type: ignore[arg-type]


def test_minimum_above_initial() -> None:
    with pytest.raises(ValueError, match=r"minimum \(8\) must not exceed initial \(4\)"):
        koila.chunked(lambda r: r, torch.zeros(4), initial=4, minimum=8)


@pytest.mark.parametrize(("dim", "shown"), [(True, "bool True"), (False, "bool False"), (1.0, "float 1.0")])
def test_dim_must_be_an_int(dim: object, shown: str) -> None:
    with pytest.raises(TypeError, match=f"dim must be an int, got {shown}"):
        koila.chunked(lambda r: r, torch.zeros(4, 4), dim=dim)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=f"dim must be an int, got {shown}"):
        koila.chunked(dim=dim)  # type: ignore[call-overload]


@pytest.mark.parametrize("progress", [1, "yes", None])
def test_progress_must_be_a_bool(progress: object) -> None:
    with pytest.raises(TypeError, match=f"progress must be a bool, got {type(progress).__name__}"):
        koila.chunked(lambda r: r, torch.zeros(4), progress=progress)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="progress must be a bool"):
        koila.range(lambda b, e: None, 0, 4, progress=progress)  # type: ignore[arg-type]


def test_fn_must_be_callable() -> None:
    with pytest.raises(TypeError, match="koila.chunked needs a callable, got int 3"):
        koila.chunked(3, torch.zeros(4))  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="koila.chunked needs a callable, got str 'f'"):
        koila.chunked("f")  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="koila.range needs a callable, got int 3"):
        koila.range(3, 0, 4)  # type: ignore[call-overload]


def test_range_called_as_pythons_after_a_star_import_says_whose_it_is() -> None:
    with pytest.raises(TypeError, match=r"got int 3 \(this is koila.range, not Python's range, which `from koila"):
        koila.range(3)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match=r"got str 'f'$"):
        koila.range("f")  # type: ignore[call-overload]
    numpy = pytest.importorskip("numpy")
    with pytest.raises(TypeError, match=r"\(this is koila.range, not Python's range"):
        koila.range(numpy.int64(3))  # type: ignore[call-overload]


@pytest.mark.parametrize(("start", "stop"), [(5, 2), (5, 4), (-3, -4)])
def test_range_stop_below_start(start: int, stop: int) -> None:
    calls: list[int] = []
    with pytest.raises(ValueError, match=rf"stop \({stop}\) must be at least start \({start}\)"):
        koila.range(lambda b, e: calls.append(b), start, stop)
    assert calls == []


@pytest.mark.parametrize(
    ("start", "stop", "message"),
    [
        (0.0, 4, "start must be an int, got float 0.0"),
        (0, "4", "stop must be an int, got str '4'"),
        (True, 4, "start must be an int, got bool True"),
        (0, False, "stop must be an int, got bool False"),
    ],
)
def test_range_bounds_must_be_ints(start: object, stop: object, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        koila.range(lambda b, e: None, start, stop)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match=message):
        koila.range(lambda b, e: None)(start, stop)  # type: ignore[arg-type]


def test_range_given_one_end_or_the_ends_by_keyword_says_how_to_call_it() -> None:
    """Python's range(n) habit said "stop must be an int, got NoneType None"; keywords, that start is no option."""
    calls: list[int] = []
    with pytest.raises(
        TypeError, match=r"it got start=10 and no stop: to cover 0 to 10, call koila.range\(fn, 0, 10\)"
    ):
        koila.range(lambda b, e: calls.append(b), 10)  # type: ignore[call-overload]
    with pytest.raises(
        TypeError, match=r"takes both ends of the range, by position; it got start=0, stop=10 by keyword"
    ):
        koila.range(lambda b, e: calls.append(b), start=0, stop=10)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match=r"it got start=0 by position and stop=10 by keyword"):
        koila.range(lambda b, e: calls.append(b), 0, stop=10)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="stop must be an int, got NoneType None"):
        koila.range(lambda b, e: calls.append(b))(0, None)  # type: ignore[arg-type]
    assert calls == []


@pytest.mark.parametrize("initial", ["8", "auto"])
def test_range_says_what_its_initial_may_be(initial: str) -> None:
    # A string said "an int >= 1, None or 'auto'", and range refuses 'auto'.
    with pytest.raises(TypeError, match=rf"initial must be an int >= 1 or None, got '{initial}' \('auto' is for"):
        koila.range(lambda begin, end: None, 0, 4, initial=initial)  # type: ignore[arg-type]


def test_range_takes_bounds_with_an_index_as_pythons_range_does_and_passes_ints() -> None:
    numpy = pytest.importorskip("numpy")
    spans = koila.range(lambda b, e: (type(b), b, e), numpy.int64(0), numpy.int64(5), initial=2)
    assert spans == [(int, 0, 2), (int, 2, 4), (int, 4, 5)]


# --------------------------------------------------------------------------- 5. empty input


def test_empty_input_calls_fn_once_for_the_structure() -> None:
    seen: list[tuple[int, ...]] = []

    def fn(rows: torch.Tensor) -> dict[str, Any]:
        seen.append(tuple(rows.shape))
        return {"emb": rows @ torch.ones(3, 5), "pair": (rows, rows[:, 0])}

    result = koila.chunked(fn, torch.zeros(0, 3))
    assert seen == [(0, 3)]
    assert result["emb"].shape == (0, 5)
    assert result["pair"][0].shape == (0, 3)
    assert result["pair"][1].shape == (0,)


def test_empty_input_along_dim_1() -> None:
    result = koila.chunked(lambda r: r * 2, torch.zeros(4, 0), dim=1)
    assert result.shape == (4, 0)


def test_empty_input_with_out_does_not_call_fn() -> None:
    calls: list[int] = []
    out = torch.zeros(0, 5)
    assert koila.chunked(lambda r: calls.append(1), torch.zeros(0, 3), out=out) is out
    assert calls == []


def test_empty_input_in_the_decorator_form_counts_no_call() -> None:
    @koila.chunked
    def fn(rows: torch.Tensor) -> torch.Tensor:
        return rows + 1

    assert fn(torch.zeros(0, 2)).shape == (0, 2)
    assert fn.stats.calls == 0


def test_empty_range_calls_nothing() -> None:
    calls: list[int] = []
    assert koila.range(lambda b, e: calls.append(b), 7, 7) == []
    assert koila.range(lambda b, e: calls.append(b), -3, -3, initial=1) == []
    assert calls == []


# --------------------------------------------------------------------------- 6. decorator forms


def test_bare_chunked_decorator() -> None:
    sizes: list[int] = []

    @koila.chunked
    def double(rows: torch.Tensor) -> torch.Tensor:
        sizes.append(len(rows))
        return rows * 2

    x = torch.arange(1100.0)
    assert torch.equal(double(x), x * 2)
    assert sizes == [512, 512, 76]  # the default initial size


def test_called_chunked_decorator() -> None:
    sizes: list[int] = []

    @koila.chunked(initial=3, dim=1)
    def double(cols: torch.Tensor) -> torch.Tensor:
        sizes.append(cols.size(1))
        return cols * 2

    x = torch.arange(14.0).reshape(2, 7)
    assert torch.equal(double(x), x * 2)
    assert sizes == [3, 3, 1]


def test_bare_range_decorator() -> None:
    @koila.range
    def span(begin: int, end: int) -> tuple[int, int]:
        return begin, end

    assert span(0, 1030) == [(0, 512), (512, 1024), (1024, 1030)]


def test_called_range_decorator_passes_extra_arguments_after_begin_and_end() -> None:
    seen: list[tuple[int, int, object, int]] = []
    data = object()

    @koila.range(initial=4)
    def process(begin: int, end: int, source: object, *, scale: int = 1) -> int:
        seen.append((begin, end, source, scale))
        return (end - begin) * scale

    assert process(-2, 7, data, scale=10) == [40, 40, 10]
    assert seen == [(-2, 2, data, 10), (2, 6, data, 10), (6, 7, data, 10)]


def test_decorated_functions_keep_name_doc_and_wrapped() -> None:
    def encode(rows: torch.Tensor) -> torch.Tensor:
        """Encode rows."""
        return rows

    def process(begin: int, end: int) -> None:
        """Process a range."""

    for wrapped, original in ((koila.chunked(encode), encode), (koila.range(initial=2)(process), process)):
        assert wrapped.__name__ == original.__name__
        assert wrapped.__doc__ == original.__doc__
        assert wrapped.__wrapped__ is original  # type: ignore[attr-defined]


def test_stats_cache_info_and_cache_clear(fast_release: None) -> None:
    fits = oom_above(16)
    sizes: list[int] = []

    @koila.chunked(initial=64)
    def double(rows: torch.Tensor) -> torch.Tensor:
        sizes.append(len(rows))
        fits(len(rows))
        return rows * 2

    x = torch.arange(100.0)
    for _ in range(2):
        assert torch.equal(double(x), x * 2)
    # The second pass starts at the 16 that worked.
    assert sizes == [64, 32] + [16] * 6 + [4] + [16] * 6 + [4]
    assert isinstance(double.stats, koila.Stats)
    assert double.stats.calls == 2
    assert double.stats.ooms == 2
    assert double.stats.exhausted == 0
    assert double.stats.batch_size == 16
    info = double.cache_info()
    assert (info.hits, info.misses, info.currsize) == (1, 1, 1)
    double.cache_clear()
    assert double.cache_info() == koila.CacheInfo(0, 0, info.maxsize, 0)
    sizes.clear()
    double(x)
    assert sizes[:3] == [64, 32, 16]  # forgotten: back to the initial size


def test_range_decorator_has_stats_and_cache(fast_release: None) -> None:
    fits = oom_above(8)

    @koila.range(initial=32)
    def run(begin: int, end: int) -> int:
        fits(end - begin)
        return end - begin

    for _ in range(2):
        assert run(0, 20) == [8, 8, 4]
    assert run.stats.calls == 2
    assert run.stats.ooms == 2  # 20 as a short chunk, then 16: the second pass starts at 8
    assert run.cache_info().currsize == 1
    run.cache_clear()
    assert run.cache_info().currsize == 0


def test_second_call_from_the_same_line_starts_at_the_reduced_size(fast_release: None) -> None:
    fits = oom_above(32)
    attempts: list[list[int]] = []

    def fn(rows: torch.Tensor) -> torch.Tensor:
        attempts[-1].append(len(rows))
        fits(len(rows))
        return rows

    x = torch.arange(100.0)
    for _ in range(2):
        attempts.append([])
        koila.chunked(fn, x, initial=128)
    assert attempts[0] == [100, 64, 32, 32, 32, 4]  # 100 rows fail as a short chunk, then 64
    assert attempts[1] == [32, 32, 32, 4]


def test_range_call_form_remembers_the_size(fast_release: None) -> None:
    fits = oom_above(10)
    attempts: list[list[int]] = []

    def fn(begin: int, end: int) -> None:
        attempts[-1].append(end - begin)
        fits(end - begin)

    for _ in range(2):
        attempts.append([])
        koila.range(fn, 0, 40, initial=64)
    assert attempts[0] == [40, 32, 16, 8, 8, 8, 8, 8]
    assert attempts[1] == [8] * 5


def test_another_call_site_or_sample_shape_starts_afresh(fast_release: None) -> None:
    fits = oom_above(16)
    sizes: list[int] = []

    def fn(rows: torch.Tensor) -> torch.Tensor:
        sizes.append(len(rows))
        fits(len(rows))
        return rows

    koila.chunked(fn, torch.zeros(40, 3), initial=32)
    sizes.clear()
    koila.chunked(fn, torch.zeros(40, 3), initial=32)  # another line
    assert sizes[0] == 32
    sizes.clear()
    for shape in ((40, 3), (40, 7)):  # the same line, another shape of a sample
        koila.chunked(fn, torch.zeros(shape), initial=32)
        assert sizes[0] == 32
        sizes.clear()


def test_nocache_always_starts_at_initial(fast_release: None) -> None:
    fits = oom_above(16)
    sizes: list[int] = []

    def fn(rows: torch.Tensor) -> torch.Tensor:
        sizes.append(len(rows))
        fits(len(rows))
        return rows

    first_sizes = []
    for _ in range(3):
        sizes.clear()
        koila.chunked(fn, torch.zeros(40), initial=64, cache=koila.NoCache())
        first_sizes.append(sizes[0])
    assert first_sizes == [40, 40, 40]


# --------------------------------------------------------------------------- 7. errors that are not OOMs


@pytest.mark.parametrize("error", [ValueError("bad row"), KeyboardInterrupt(), MemoryError("python's own")])
def test_other_errors_propagate_unchanged_from_chunked(error: BaseException) -> None:
    calls: list[int] = []

    def fn(rows: torch.Tensor) -> torch.Tensor:
        calls.append(len(rows))
        if len(calls) == 3:
            raise error
        return rows

    with pytest.raises(type(error)) as excinfo:
        koila.chunked(fn, torch.zeros(20), initial=4, cache=koila.NoCache())
    assert excinfo.value is error
    assert calls == [4, 4, 4]  # not retried, not resumed
    assert excinfo.traceback[-1].name == "fn"


@pytest.mark.parametrize("error", [ValueError("bad index"), KeyboardInterrupt()])
def test_other_errors_propagate_unchanged_from_range(error: BaseException) -> None:
    calls: list[int] = []

    def fn(begin: int, end: int) -> None:
        calls.append(begin)
        if begin == 8:
            raise error

    with pytest.raises(type(error)) as excinfo:
        koila.range(fn, 0, 20, initial=4, cache=koila.NoCache())
    assert excinfo.value is error
    assert calls == [0, 4, 8]


def test_error_after_an_oom_is_not_swallowed(fast_release: None) -> None:
    error = RuntimeError("CUDA error: device-side assert triggered")
    calls: list[int] = []

    @koila.chunked(initial=8, cache=koila.NoCache())
    def fn(rows: torch.Tensor) -> torch.Tensor:
        calls.append(len(rows))
        if len(calls) == 2:
            raise make_oom()
        if len(calls) == 3:
            raise error
        return rows

    with pytest.raises(RuntimeError) as excinfo:
        fn(torch.zeros(32))
    assert excinfo.value is error
    assert calls == [8, 8, 4]
    assert fn.stats.ooms == 1
    assert fn.stats.exhausted == 0


def test_batch_size_exhausted_is_an_out_of_memory_error_from_the_last_oom(fast_release: None) -> None:
    last: list[BaseException] = []

    def fn(rows: torch.Tensor) -> torch.Tensor:
        last[:] = [make_oom("cpu")]
        raise last[0]

    with pytest.raises(torch.OutOfMemoryError) as excinfo:
        koila.chunked(fn, torch.zeros(10), initial=4, cache=koila.NoCache())
    assert isinstance(excinfo.value, koila.BatchSizeExhausted)
    assert excinfo.value.__cause__ is last[0]
    assert excinfo.value.batch_size == 1
    assert excinfo.value.attempts == 3
    assert "(4 -> 2 -> 1); batch size 1 is the minimum" in str(excinfo.value)


# --------------------------------------------------------------------------- 8. memory hygiene


def test_tensor_of_a_failed_chunk_is_dead_when_its_retry_starts() -> None:
    refs: list[weakref.ref[torch.Tensor]] = []
    alive_at_start: list[bool] = []
    inject = oom_for({2, 3})  # the second chunk fails twice

    def fn(rows: torch.Tensor) -> torch.Tensor:
        alive_at_start.append(any(ref() is not None for ref in refs))
        activations = torch.ones(len(rows), 1024)
        refs.append(weakref.ref(activations))
        inject()
        return rows * 2

    x = torch.arange(16.0)
    assert torch.equal(koila.chunked(fn, x, initial=4, cache=koila.NoCache()), x * 2)
    # 0-4, then 4-8 and 4-6 fail, then twelve chunks of one row.
    assert alive_at_start == [False] * 15


def test_tensor_in_a_cycle_is_collected_before_the_retry() -> None:
    """Only the library's gc.collect() frees a cycle: checks release() runs before a chunk's retry."""
    refs: list[weakref.ref[torch.Tensor]] = []
    alive_at_start: list[bool] = []
    inject = oom_for({2})

    class Node:
        pass

    def fn(rows: torch.Tensor) -> torch.Tensor:
        alive_at_start.append(any(ref() is not None for ref in refs))
        node = Node()
        node.self = node  # type: ignore[attr-defined]
        node.tensor = torch.ones(len(rows), 256)  # type: ignore[attr-defined]
        if len(alive_at_start) == 2:
            refs.append(weakref.ref(node.tensor))  # type: ignore[attr-defined]
        inject()
        return rows

    gc.collect()
    gc.disable()
    try:
        koila.range(lambda b, e: fn(torch.zeros(e - b)), 0, 12, initial=4, cache=koila.NoCache())
    finally:
        gc.enable()
    # 0-4, 4-8 fails (its tensor sits in a cycle), then 4-6, 6-8, 8-10, 10-12.
    assert len(refs) == 1
    assert alive_at_start == [False] * 6


def test_live_memory_at_a_retry_is_what_it_was_before_the_failed_chunk() -> None:
    live_at_start: list[int] = []
    inject = oom_for({3, 4})
    x = torch.randn(64, 32)
    with simulated_device("64MiB") as device:

        def fn(rows: torch.Tensor) -> torch.Tensor:
            live_at_start.append(device.live)
            hidden = torch.relu(rows @ torch.ones(32, 1024))
            inject()
            return hidden[:, :4]

        koila.chunked(fn, x, initial=16, cache=koila.NoCache())
    # Calls: 0-16, 16-32, 32-48 F, 32-40 F, 32-36, ...: each retry starts where the failure did.
    assert live_at_start[3] == live_at_start[2]
    assert live_at_start[4] == live_at_start[2]
    assert live_at_start[2] > live_at_start[0]  # finished results are kept, not dropped


def test_exhausted_chunked_does_not_pin_the_failed_chunks() -> None:
    refs: list[weakref.ref[torch.Tensor]] = []

    def fn(rows: torch.Tensor) -> torch.Tensor:
        activations = torch.ones(len(rows), 1024)
        refs.append(weakref.ref(activations))
        raise make_oom()

    with pytest.raises(koila.BatchSizeExhausted) as excinfo:
        koila.chunked(fn, torch.zeros(10), initial=2, cache=koila.NoCache())
    cause = excinfo.value.__cause__
    assert cause is not None
    assert cause.__traceback__ is None
    assert [ref() for ref in refs] == [None, None]


# --------------------------------------------------------------------------- 9. progress


class FakeBar:
    """Records what chunked tells a tqdm bar."""

    bars: ClassVar[list[FakeBar]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs
        self.updates: list[int] = []
        self.postfixes: list[dict[str, Any]] = []
        self.closed = False
        FakeBar.bars.append(self)

    def update(self, n: int = 1) -> None:
        assert not self.closed
        # The chunk size is set before the rows are counted, so no redraw pairs the new
        # row count with the old chunk size.
        assert len(self.postfixes) == len(self.updates) + 1
        self.updates.append(n)

    def set_postfix(self, ordered_dict: dict[str, Any] | None = None, refresh: bool = True, **kwargs: Any) -> None:
        self.postfixes.append({**(ordered_dict or {}), **kwargs})

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake_tqdm(monkeypatch: pytest.MonkeyPatch) -> list[FakeBar]:
    import tqdm.auto

    FakeBar.bars = []
    monkeypatch.setattr(tqdm.auto, "tqdm", FakeBar)
    return FakeBar.bars


def test_progress_bar_over_rows_shows_the_chunk_size(fake_tqdm: list[FakeBar], fast_release: None) -> None:
    fits = oom_above(128)

    def embed(rows: torch.Tensor) -> torch.Tensor:
        fits(len(rows))
        return rows

    koila.chunked(embed, torch.zeros(1000), initial=256, progress=True, cache=koila.NoCache())
    (bar,) = fake_tqdm
    assert bar.kwargs["total"] == 1000
    assert bar.kwargs["unit"] == "row"
    assert "embed" in bar.kwargs["desc"]
    assert bar.updates == [128] * 7 + [104]
    assert sum(bar.updates) == 1000
    assert bar.postfixes == [{"chunk": 128}] * 8
    assert bar.closed


def test_progress_bar_over_a_range(fake_tqdm: list[FakeBar]) -> None:
    koila.range(lambda b, e: None, 10, 25, initial=4, progress=True)
    (bar,) = fake_tqdm
    assert bar.kwargs["total"] == 15
    assert bar.kwargs["unit"] == "index"
    assert bar.updates == [4, 4, 4, 3]
    assert bar.postfixes == [{"range": 4}] * 4
    assert bar.closed


def test_progress_bar_postfix_follows_reductions(fake_tqdm: list[FakeBar], fast_release: None) -> None:
    inject = oom_for({3})
    koila.chunked(lambda r: (inject(), r)[1], torch.zeros(40), initial=16, progress=True, cache=koila.NoCache())
    (bar,) = fake_tqdm
    assert bar.updates == [16, 16, 4, 4]
    assert [p["chunk"] for p in bar.postfixes] == [16, 16, 4, 4]  # 8 rows failed as a short chunk: 4 next


def test_progress_bar_is_closed_when_fn_raises(fake_tqdm: list[FakeBar]) -> None:
    def fn(rows: torch.Tensor) -> torch.Tensor:
        if rows[0] >= 8:
            raise ValueError("broken row")
        return rows

    with pytest.raises(ValueError, match="broken row"):
        koila.chunked(fn, torch.arange(20.0), initial=4, progress=True)
    (bar,) = fake_tqdm
    assert bar.updates == [4, 4]
    assert bar.closed


def test_progress_bar_is_closed_when_exhausted(fake_tqdm: list[FakeBar], fast_release: None) -> None:
    def fn(begin: int, end: int) -> None:
        raise make_oom()

    with pytest.raises(koila.BatchSizeExhausted):
        koila.range(fn, 0, 10, initial=2, progress=True, cache=koila.NoCache())
    (bar,) = fake_tqdm
    assert bar.updates == []
    assert bar.closed


def test_progress_with_real_tqdm_writes_a_bar(capsys: pytest.CaptureFixture[str]) -> None:
    def double(rows: torch.Tensor) -> torch.Tensor:
        return rows * 2

    koila.chunked(double, torch.zeros(300), initial=128, progress=True)
    err = capsys.readouterr().err
    assert "300/300" in err
    assert "chunk=128" in err
    assert "double" in err


@pytest.mark.parametrize("front_end", ["chunked", "range"])
def test_progress_without_tqdm_says_what_to_install(monkeypatch: pytest.MonkeyPatch, front_end: str) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    calls: list[int] = []
    with pytest.raises(ImportError, match=r"pip install tqdm \(koila-retry's progress extra\)"):
        if front_end == "chunked":
            koila.chunked(lambda r: calls.append(1), torch.zeros(4), progress=True)
        else:
            koila.range(lambda b, e: calls.append(1), 0, 4, progress=True)
    assert calls == []


# --------------------------------------------------------------------------- 10. max_attempts, on_oom, notes


def test_max_attempts_applies_to_each_chunk(fast_release: None) -> None:
    inject = oom_for({1, 3, 6})
    sizes: list[int] = []

    def fn(rows: torch.Tensor) -> torch.Tensor:
        sizes.append(len(rows))
        inject()
        return rows

    x = torch.arange(16.0)
    # Three failures in the whole pass, but never two in one chunk: max_attempts=2 is enough.
    assert torch.equal(koila.chunked(fn, x, initial=8, max_attempts=2, cache=koila.NoCache()), x)
    assert sizes == [8, 4, 4, 2, 2, 2] + [1] * 8


def test_max_attempts_exhausts_one_chunk(fast_release: None) -> None:
    inject = oom_for({2, 3})

    def fn(begin: int, end: int) -> None:
        inject()

    with pytest.raises(koila.BatchSizeExhausted, match="gave up after max_attempts=2 attempts") as excinfo:
        koila.range(fn, 0, 100, initial=16, max_attempts=2, cache=koila.NoCache())
    assert excinfo.value.attempts == 2
    assert excinfo.value.batch_size == 8


def test_on_oom_events_report_the_rows_of_a_short_last_chunk(fast_release: None) -> None:
    events: list[koila.OOMEvent] = []
    sizes: list[int] = []

    def encode(rows: torch.Tensor) -> torch.Tensor:
        sizes.append(len(rows))
        if len(rows) == 232:
            raise make_oom()
        return rows

    koila.chunked(encode, torch.zeros(1000), initial=256, on_oom=events.append, cache=koila.NoCache())
    assert sizes == [256, 256, 256, 232, 128, 104]
    (event,) = events
    assert event.batch_size == 232
    assert event.next_batch_size == 128
    assert event.attempt == 1
    assert event.function.endswith("encode")
    assert event.device == torch.device("cpu")
    assert __file__ in event.where
    assert "in encode" in event.where


def test_on_oom_events_count_attempts_per_chunk(fast_release: None) -> None:
    events: list[koila.OOMEvent] = []
    inject = oom_for({2, 3, 6})
    koila.range(lambda b, e: inject(), 0, 32, initial=8, on_oom=events.append, cache=koila.NoCache())
    assert [(e.batch_size, e.next_batch_size, e.attempt) for e in events] == [(8, 4, 1), (4, 2, 2), (2, 1, 1)]


def test_final_event_has_no_next_size(fast_release: None) -> None:
    events: list[koila.OOMEvent] = []

    def never_fits(rows: torch.Tensor) -> torch.Tensor:
        raise make_oom()

    with pytest.raises(koila.BatchSizeExhausted):
        koila.chunked(never_fits, torch.zeros(3), initial=2, on_oom=events.append)
    assert [(e.batch_size, e.next_batch_size) for e in events] == [(2, 1), (1, None)]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes are new in Python 3.11")
def test_exhausted_notes_say_how_many_rows_were_finished(fast_release: None) -> None:
    def fn(rows: torch.Tensor) -> torch.Tensor:
        if rows[0] >= 768:
            raise make_oom()
        return rows

    with pytest.raises(koila.BatchSizeExhausted) as excinfo:
        koila.chunked(fn, torch.arange(1000.0), initial=256, cache=koila.NoCache())
    assert excinfo.value.__notes__ == ["768 of 1000 rows were finished before it gave up."]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes are new in Python 3.11")
def test_range_exhausted_notes_spell_indices(fast_release: None) -> None:
    def fn(begin: int, end: int) -> None:
        if begin >= 4:
            raise make_oom()

    with pytest.raises(koila.BatchSizeExhausted) as excinfo:
        koila.range(fn, 0, 10, initial=4, cache=koila.NoCache())
    (note,) = excinfo.value.__notes__
    assert note.startswith("4 of 10 ")
    assert "indexs" not in note


def test_exhausted_leaves_finished_rows_in_out(fast_release: None) -> None:
    def fn(rows: torch.Tensor) -> torch.Tensor:
        if rows[0] >= 4:
            raise make_oom()
        return rows * 10

    out = torch.full((10,), -1.0)
    with pytest.raises(koila.BatchSizeExhausted):
        koila.chunked(fn, torch.arange(10.0), initial=4, out=out, cache=koila.NoCache())
    assert out.tolist() == [0.0, 10.0, 20.0, 30.0] + [-1.0] * 6


def test_exhausted_message_for_a_short_chunk_below_the_minimum(fast_release: None) -> None:
    def fn(rows: torch.Tensor) -> torch.Tensor:
        raise make_oom()

    with pytest.raises(koila.BatchSizeExhausted) as excinfo:
        koila.chunked(fn, torch.zeros(10), initial=64, minimum=32, cache=koila.NoCache())
    assert excinfo.value.batch_size == 10
    assert "batch size 10 is the minimum" not in str(excinfo.value)
    assert "32" in str(excinfo.value)


# --------------------------------------------------------------------------- 11. growing back within a pass


def grow_sizes(n: int, initial: int, grow_after: int, fits: Callable[[int], None]) -> list[int]:
    sizes: list[int] = []

    def fn(rows: torch.Tensor) -> torch.Tensor:
        sizes.append(len(rows))
        fits(len(rows))
        return rows

    x = torch.arange(float(n))
    assert torch.equal(
        koila.chunked(fn, x, initial=initial, grow=True, grow_after=grow_after, cache=koila.NoCache()), x
    )
    return sizes


def test_grow_doubles_after_grow_after_successes(fast_release: None) -> None:
    inject = oom_for({1})  # memory is short once, then plentiful
    sizes = grow_sizes(64 * 4, 64, 2, lambda rows: inject())
    assert sizes == [64, 32, 32, 64, 64, 64]


def test_grow_climbs_one_power_of_two_at_a_time(fast_release: None) -> None:
    inject = oom_for({1, 2, 3})  # 64 -> 32 -> 16 -> 8, then everything fits
    sizes = grow_sizes(8 * 3 + 16 * 3 + 32 * 3 + 64 * 2, 64, 3, lambda rows: inject())
    assert sizes == [64, 32, 16, 8, 8, 8, 16, 16, 16, 32, 32, 32, 64, 64]


def test_failed_probe_halves_again_and_doubles_the_wait(fast_release: None) -> None:
    sizes = grow_sizes(32 * 14 + 10, 64, 2, oom_above(32))
    f = 64  # a failed probe
    assert sizes == [f, 32, 32, f, 32, 32, 32, 32, f, 32, 32, 32, 32, 32, 32, 32, 32, 10]


def test_grow_never_goes_above_initial(fast_release: None) -> None:
    inject = oom_for({1})
    sizes = grow_sizes(48 + 32 * 2 + 48 * 2, 48, 2, lambda rows: inject())
    assert sizes == [48, 32, 32, 48, 48, 48]


def test_without_grow_the_reduced_size_stays(fast_release: None) -> None:
    inject = oom_for({1})
    sizes: list[int] = []
    koila.chunked(
        lambda r: (sizes.append(len(r)), inject(), r)[2],
        torch.zeros(200),
        initial=64,
        cache=koila.NoCache(),
    )
    assert sizes == [64] + [32] * 6 + [8]


def test_grow_in_range(fast_release: None) -> None:
    inject = oom_for({1})
    calls: list[tuple[int, int]] = []

    def fn(begin: int, end: int) -> None:
        calls.append((begin, end))
        inject()

    koila.range(fn, 5, 5 + 16 * 3 + 8, initial=16, grow=True, grow_after=2, cache=koila.NoCache())
    assert calls == [(5, 21), (5, 13), (13, 21), (21, 37), (37, 53), (53, 61)]


def test_a_probe_on_a_short_last_chunk_proves_nothing(fast_release: None) -> None:
    fits = oom_above(32)
    passes: list[list[int]] = []

    def fn(rows: torch.Tensor) -> torch.Tensor:
        passes[-1].append(len(rows))
        fits(len(rows))
        return rows

    cache = koila.StackMemoryCache()
    for _ in range(4):
        passes.append([])
        koila.chunked(fn, torch.zeros(74), initial=64, grow=True, grow_after=2, cache=cache)
    # The probe of pass 1 ran on the 10 rows left: the cache keeps the size proven by
    # whole chunks, and the probe, still due, runs first in pass 2. It fails, so the wait
    # doubles to 4: pass 3 runs at 32 throughout, its own probe again lands on 10 rows,
    # and pass 4 probes first once more.
    assert passes == [[64, 32, 32, 10], [64, 32, 32, 10], [32, 32, 10], [64, 32, 32, 10]]
    assert list(cache.values()) == [32]


def test_an_oom_inside_a_model_is_placed_at_the_layer_not_in_pytorch_machinery() -> None:
    """chunked(model, x) calls the model from koila_retry: the event names the torch.nn line."""
    model = nn.Sequential(nn.Linear(8, 256), nn.ReLU(), nn.Linear(256, 4)).eval()
    events: list[koila.OOMEvent] = []
    inputs = torch.randn(2048, 8)
    with torch.no_grad(), simulated_device("1MiB"):
        koila.chunked(model, inputs, initial=2048, cache=koila.NoCache(), on_oom=events.append)
    assert events
    where = events[0].where
    assert f"{os.sep}torch{os.sep}nn{os.sep}" in where, where


def test_keyword_tensors_in_the_call_form_are_split_and_options_stay_options() -> None:
    seen: list[tuple[int, int]] = []

    def encode(input_ids: torch.Tensor, attention_mask: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        seen.append((len(input_ids), len(attention_mask)))
        return input_ids * attention_mask * scale

    ids, mask = torch.arange(10.0), torch.ones(10)
    result = koila.chunked(encode, input_ids=ids, attention_mask=mask, scale=2.0, initial=4, cache=koila.NoCache())
    assert torch.equal(result, ids * 2)
    assert seen == [(4, 4), (4, 4), (2, 2)]
    with pytest.raises(TypeError, match="unexpected keyword argument 'minimun'"):
        koila.chunked(minimun=4)  # no function: a misspelt option is still refused


def test_range_call_form_passes_keywords_to_every_call() -> None:
    calls = koila.range(lambda begin, end, tag: (begin, end, tag), 0, 5, initial=2, tag="x")
    assert calls == [(0, 2, "x"), (2, 4, "x"), (4, 5, "x")]


def test_longer_rows_of_a_size_class_start_scaled_when_decorated_and_in_the_call_form() -> None:
    """What docs/chunked.rst says of sizes that worked, per size class of the rows."""
    tried: list[int] = []

    def encode(rows: torch.Tensor) -> torch.Tensor:
        tried.append(len(rows))
        if rows.numel() > 300 * 40:  # stands in for the memory of 300 rows of 40 features
            raise make_oom()
        return rows * 2

    decorated = koila.chunked(initial=1024)(encode)
    starts = []
    # A simulated device keeps the free memory, and so the cache key's bucket, the same in every pass.
    with simulated_device("1.5GiB"):
        passes = [("decorated", 40), ("decorated", 60), ("decorated", 100), ("call", 40), ("call", 60), ("call", 40)]
        for form, width in passes:
            tried.clear()
            x = torch.ones(2000, width)
            if form == "decorated":
                decorated(x)
            else:
                koila.chunked(encode, x, initial=1024)  # from one line: one call site
            starts.append((form, width, tried[0], tried[-2]))
    assert starts == [
        ("decorated", 40, 1024, 256),
        ("decorated", 60, 170, 170),  # 256 rows of 40 features, as many bytes of rows of 60
        ("decorated", 100, 1024, 64),  # another class: afresh
        ("call", 40, 1024, 256),
        ("call", 60, 170, 170),  # the cache keeps the bytes the size was proven on: scaled too
        ("call", 40, 256, 256),  # shorter rows start at the size stored for them
    ]


# --- where warnings are errors (pytest -W error, PYTHONWARNINGS=error): the recovery goes on (issue 39)


def test_the_warning_of_a_split_an_oom_made_cannot_stop_the_recovery(caplog: pytest.LogCaptureFixture) -> None:
    # The rows fitted in one chunk until memory ran out: the retry's chunks drop the tag with
    # a warning, which an "error" filter made the call's error in place of its recovery.
    fits = oom_above(4)

    def fn(rows: torch.Tensor) -> dict[str, Any]:
        fits(len(rows))
        return {"out": rows * 2, "tag": "a tag"}

    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, "koila_retry"):
        warnings.simplefilter("error")
        result = koila.chunked(fn, torch.arange(8.0), initial=8)
    assert fits.raised == 1
    assert torch.equal(result["out"], torch.arange(8.0) * 2)
    assert result["tag"] is None
    (record,) = [r for r in caplog.records if r.name == "koila_retry" and "the result['tag'] (str)" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert "a warnings filter made this warning an error" in record.getMessage()


# --------------------------------------------------------------------------- 12. what fn may be, and what reaches it


async def load(begin: int, end: int) -> tuple[int, int]:
    return begin, end


async def embed(rows: torch.Tensor) -> torch.Tensor:
    return rows * 2


ASYNC_FORMS: list[tuple[str, Callable[[], Any]]] = [
    ("koila.range", lambda: koila.range(load, 0, 10, initial=4)),
    ("koila.range", lambda: koila.range(initial=4)(load)),
    ("koila.range", lambda: koila.range(load)),
    ("koila.chunked", lambda: koila.chunked(embed, torch.ones(8, 2), initial=4)),
    ("koila.chunked", lambda: koila.chunked(initial=4)(embed)),
    ("koila.chunked", lambda: koila.chunked(embed)),
    ("koila.chunked", lambda: koila.chunked(initial=4)(staticmethod(embed))),
    ("koila.range", lambda: koila.range(initial=4)(classmethod(load))),
]


@pytest.mark.parametrize(("front_end", "form"), ASYNC_FORMS)
def test_an_async_function_is_refused_when_decorated_or_called(front_end: str, form: Callable[[], Any]) -> None:
    # Its calls would only make coroutines: the body would never run, nor its OOMs be retried.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(TypeError, match=rf"{front_end} cannot run .*\(\): it is an async function"):
            form()
        gc.collect()
    assert [w for w in caught if "never awaited" in str(w.message)] == []  # no coroutine was made


def test_a_function_that_returns_a_coroutine_is_refused_at_its_first_call() -> None:
    # A plain function (or an object with an async __call__) cannot be told from its signature.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(TypeError, match=r"koila.range: fn returned a coroutine for the range 0 to 4"):
            koila.range(lambda begin, end: load(begin, end), 0, 10, initial=4)
        with pytest.raises(TypeError, match=r"koila.chunked: fn returned a coroutine for the rows 0 to 4"):
            koila.chunked(lambda rows: embed(rows), torch.ones(8, 2), initial=4)
        gc.collect()
    assert [w for w in caught if "never awaited" in str(w.message)] == []  # the coroutine was closed


def scaler_class() -> type[Any]:
    """Make, when a test runs (a refused decorator fails that test only), methods of every kind."""

    class Scaler:
        """Each decorated above and below ``staticmethod`` and ``classmethod``."""

        factor: ClassVar[float] = 3.0

        def __init__(self) -> None:
            self.factor = 2.0

        @koila.chunked(initial=2, cache=koila.NoCache())
        @staticmethod
        def double_above(x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        @koila.chunked(initial=2, cache=koila.NoCache())
        def double_below(x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @koila.chunked(initial=2, cache=koila.NoCache())
        @classmethod
        def triple_above(cls, x: torch.Tensor) -> torch.Tensor:
            return x * cls.factor

        @classmethod
        @koila.chunked(initial=2, cache=koila.NoCache())
        def triple_below(cls, x: torch.Tensor) -> torch.Tensor:
            return x * cls.factor

        @koila.chunked(initial=2, cache=koila.NoCache())
        def scale(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.factor

        @koila.range(initial=2, cache=koila.NoCache())
        @classmethod
        def spans_above(cls, begin: int, end: int) -> tuple[str, int, int]:
            return cls.__name__, begin, end

        @classmethod
        @koila.range(initial=2, cache=koila.NoCache())
        def spans_below(cls, begin: int, end: int) -> tuple[str, int, int]:
            return cls.__name__, begin, end

        @koila.range(initial=2, cache=koila.NoCache())
        @staticmethod
        def plain_spans(begin: int, end: int) -> tuple[int, int]:
            return begin, end

    return Scaler


@pytest.mark.parametrize("on_instance", [False, True], ids=["class", "instance"])
def test_static_and_class_methods_in_either_order_bind_as_they_would_undecorated(on_instance: bool) -> None:
    Scaler = scaler_class()
    owner = Scaler() if on_instance else Scaler
    x = torch.arange(5.0)
    for name in ("double_above", "double_below"):
        assert torch.equal(getattr(owner, name)(x), x * 2), name
    for name in ("triple_above", "triple_below"):
        assert torch.equal(getattr(owner, name)(x), x * 3), name
    # From Python 3.13, a classmethod above no longer lets @koila.range bind (docs/chunked.rst).
    for name in ("spans_above", "spans_below")[: 1 if sys.version_info >= (3, 13) else 2]:
        assert getattr(owner, name)(0, 5) == [("Scaler", 0, 2), ("Scaler", 2, 4), ("Scaler", 4, 5)], name
    assert owner.plain_spans(0, 3) == [(0, 2), (2, 3)]
    assert owner.double_above.stats.calls == 1
    assert torch.equal(Scaler().scale(x), x * 2)
    assert torch.equal(Scaler.scale(Scaler(), x), x * 2)


def test_a_method_s_instance_is_not_split_nor_checked_as_an_argument() -> None:
    @dataclasses.dataclass
    class Encoder:
        weight: torch.Tensor  # as many rows as the input: it must pass whole, not be split with it

        @koila.chunked(initial=2, cache=koila.NoCache())
        def encode(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.weight.T

    class Stream:  # an iterator itself: an argument that is one is refused, the instance is not
        def __iter__(self) -> Stream:
            return self

        def __next__(self) -> int:
            raise StopIteration

        @koila.chunked(initial=2, cache=koila.NoCache())
        def double(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    encoder, x = Encoder(torch.ones(4, 3)), torch.ones(4, 3)
    assert torch.equal(encoder.encode(x), x @ encoder.weight.T)  # (4, 4): each row against all 4
    assert torch.equal(encoder.encode(torch.ones(6, 3)), torch.full((6, 4), 3.0))
    assert torch.equal(Stream().double(x), x * 2)


def test_a_keyword_that_is_neither_an_option_nor_fn_s_is_refused_before_anything_runs() -> None:
    calls: list[int] = []

    def encode(rows: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        calls.append(len(rows))
        return rows * scale

    def spans(begin: int, end: int, /, tag: str = "") -> tuple[int, int, str]:
        calls.append(begin)
        return begin, end, tag

    x = torch.ones(4, 2)
    with pytest.raises(
        TypeError,
        match=r"koila.chunked\(\) got an unexpected keyword argument 'minimun', which is neither one of its "
        r"options nor a parameter of encode\(\) \(did you mean 'minimum'\?\); its options are initial, dim, "
        r"progress, out and cache, .*, minimum, .*; encode\(\) takes rows and scale by keyword",
    ):
        koila.chunked(encode, x, initial=2, minimun=2)
    with pytest.raises(TypeError, match=r"'scael', .* \(did you mean 'scale'\?\)"):
        koila.chunked(encode, x, scael=2.0)  # close to a parameter of fn's: said too
    with pytest.raises(
        TypeError,
        match=r"koila.range\(\) got an unexpected keyword argument 'max_attemps', .*\(did you mean 'max_attempts'\?\); "
        r"its options are initial, progress and cache, ",
    ):
        koila.range(spans, 0, 4, initial=2, max_attemps=1)
    with pytest.raises(TypeError, match=r"'zzz', which is neither .* spans\(\); its options"):
        koila.range(spans, 0, 4, zzz=1)  # nothing close: no guess
    with pytest.raises(TypeError, match=r"'begin', which is neither"):
        koila.range(spans, 0, 4, begin=1)  # positional-only: not a keyword fn takes
    assert calls == []
    # What fn takes by keyword it is given, split like the positional arguments.
    assert torch.equal(koila.chunked(encode, x, scale=3.0, initial=2), x * 3)
    assert koila.range(spans, 0, 3, tag="t", initial=2) == [(0, 2, "t"), (2, 3, "t")]


def test_an_option_that_fn_takes_too_is_refused_in_the_call_form() -> None:
    # F.normalize(x, dim=1) ran normalised 512 columns at a time: dim= was chunked's, silently.
    x = torch.randn(4, 600)
    with pytest.raises(
        TypeError,
        match=r"koila.chunked\(\) takes dim=1 as its own option, and normalize\(\) takes 'dim' too: .*"
        r"functools.partial\(fn, dim=1\), or give koila.chunked\(\)'s to the decorator form, "
        r"koila.chunked\(dim=1\)\(fn\)",
    ):
        koila.chunked(F.normalize, x, dim=1)
    calls: list[int] = []

    def load(begin: int, end: int, minimum: int = 0) -> tuple[int, int, int]:
        calls.append(begin)
        return begin, end, minimum

    def written(rows: torch.Tensor, out: Any = None) -> torch.Tensor:
        calls.append(len(rows))
        return rows

    with pytest.raises(TypeError, match=r"koila.range\(\) takes minimum=2 as its own option, and load\(\)"):
        koila.range(load, 0, 4, initial=2, minimum=2)
    with pytest.raises(TypeError, match=r"takes minimum=2 as its own option, and load\(\)"):
        koila.range(load, 0, 4, minimum=2)
    with pytest.raises(TypeError, match=r"minimum=2 .*, and the partial of load\(\) binds 'minimum' too: .* "):
        koila.range(functools.partial(load, minimum=0), 0, 4, minimum=2)  # a partial's keyword can be given again

    class Normalize(nn.Module):
        def forward(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
            return F.normalize(x, dim=dim)

    with pytest.raises(TypeError, match=r"dim=1 as its own option, and Normalize\(\) takes 'dim' too"):
        koila.chunked(Normalize(), x, dim=1)  # its forward's, not Module.__call__'s (*args, **kwargs)

    def scaled(dim: int, rows: torch.Tensor) -> torch.Tensor:  # dim bound below: no keyword of the bound method
        return rows * dim

    halved = koila.chunked(types.MethodType(scaled, 2), x, dim=1, initial=512, cache=koila.NoCache())
    torch.testing.assert_close(halved, x * 2)

    def normalised(*args: Any, dim: int = 0) -> torch.Tensor:  # self in *args: dim is still its keyword
        return F.normalize(args[1], dim=dim)

    with pytest.raises(TypeError, match=r"dim=1 as its own option, and normalised\(\) takes 'dim' too"):
        koila.chunked(types.MethodType(normalised, object()), x, dim=1)
    with pytest.raises(TypeError, match=r"takes out=\.\.\. as its own option, .* lambda rows: written\(rows\)$"):
        koila.chunked(written, x, out=torch.empty(4, 600))
    assert calls == []
    # The decorator form, or a partial, says whose each one is; an option left at its default is nobody's.
    by_rows = koila.chunked(dim=1, initial=512, cache=koila.NoCache())(F.normalize)(x)
    assert not torch.allclose(by_rows, F.normalize(x, dim=1))  # chunked's dim, as asked
    bound = koila.chunked(functools.partial(F.normalize, dim=1), x, initial=2, cache=koila.NoCache())
    torch.testing.assert_close(bound, F.normalize(x, dim=1))
    assert koila.range(load, 0, 4, initial=4) == [(0, 4, 0)]


def test_a_keyword_fn_may_take_through_its_kwargs_or_unknown_signature_is_passed_on() -> None:
    seen: list[dict[str, Any]] = []

    def anything(rows: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        seen.append(kwargs)
        return rows

    koila.chunked(anything, torch.ones(4), minimun=2, initial=2)  # fn takes **kwargs: it is fn's
    assert seen == [{"minimun": 2}, {"minimun": 2}]
    # torch.add has no signature to read: the keyword goes to it, as before.
    assert torch.equal(
        koila.chunked(torch.add, torch.ones(4), torch.ones(4), alpha=3, initial=2), torch.full((4,), 4.0)
    )
    model = nn.Linear(2, 1)  # a module: its __call__ takes **kwargs
    with pytest.raises(TypeError, match="unexpected keyword argument 'minimun'"):
        koila.chunked(model, torch.ones(4, 2), minimun=2)


def scale_by(rows: torch.Tensor, factors: Any) -> torch.Tensor:
    return rows * sum(factors)


ITERATORS: list[Callable[[], Any]] = [
    lambda: iter([1, 2]),
    lambda: (n for n in (1, 2)),
    lambda: map(int, "12"),
    lambda: iter({1: None, 2: None}),
]


@pytest.mark.parametrize("make", ITERATORS)
@pytest.mark.parametrize("rows", [1, 2, 6])  # one chunk or many: refused alike, whatever the memory
def test_an_iterator_argument_is_refused_before_anything_runs(make: Callable[[], Any], rows: int) -> None:
    calls: list[int] = []

    def scale(rows: torch.Tensor, factors: Any) -> torch.Tensor:
        calls.append(len(rows))
        return rows * sum(factors)

    x = torch.ones(rows, 1)
    kind = type(make()).__name__
    with pytest.raises(
        TypeError,
        match=rf"koila.chunked passes the argument factors \(a {kind}\) whole to every chunk's call of scale\(\), "
        r"and an iterator is used up by the first chunk.*Pass a list",
    ):
        koila.chunked(scale, x, make(), initial=2)
    with pytest.raises(TypeError, match=rf"the argument factors \(a {kind}\)"):
        koila.chunked(scale, x, factors=make(), initial=2)
    decorated = koila.chunked(initial=2)(scale)
    with pytest.raises(TypeError, match=rf"the argument factors \(a {kind}\)"):
        decorated(x, make())

    @koila.range(initial=2)
    def spans(begin: int, end: int, weights: Any, *, more: Any = ()) -> int:
        calls.append(begin)
        return sum(weights)

    with pytest.raises(
        TypeError, match=rf"koila.range passes the argument weights \(a {kind}\) whole to every range's call of spans"
    ):
        spans(0, rows, make())
    with pytest.raises(TypeError, match=rf"the argument more \(a {kind}\)"):
        spans(0, rows, [1], more=make())
    with pytest.raises(TypeError, match=rf"the argument weights \(a {kind}\)"):
        koila.range(spans.__wrapped__, 0, rows, weights=make())  # type: ignore[attr-defined]
    assert calls == []


def test_collections_and_files_pass_to_every_chunk() -> None:
    x = torch.ones(6, 1)
    for factors in ([1, 2], (1, 2), {1: "a", 2: "b"}, range(1, 3)):
        assert torch.equal(koila.chunked(scale_by, x, factors, initial=2), x * 3), factors
    assert koila.range(lambda begin, end, word: word, 0, 3, initial=2, word="ab") == ["ab", "ab"]
    # A file is an iterator too, and the usual way for each range to write its results.
    log = io.StringIO()
    koila.range(lambda begin, end, to: to.write(f"{begin}-{end};"), 0, 5, initial=2, to=log)
    assert log.getvalue() == "0-2;2-4;4-5;"
