"""What every front end does with the callables and arguments it is given: methods, generators, iterators."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import gc
import inspect
import io
import pickle
import typing
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from torch import nn

import koila_retry as koila
from koila_retry.compat.accelerate import find_executable_batch_size
from koila_retry.compat.toma import toma
from koila_retry.testing import make_oom, oom_above

# --------------------------------------------------------------------------- methods


def test_range_decorator_binds_a_method_before_the_range() -> None:
    class Index:
        def __init__(self) -> None:
            self.seen: list[tuple[int, int]] = []

        @koila.range(initial=4, cache=koila.NoCache())
        def build(this, begin: int, end: int, scale: int) -> int:
            this.seen.append((begin, end))
            return (end - begin) * scale

    index = Index()
    assert index.build(0, 10, 2) == [8, 8, 4]
    assert index.seen == [(0, 4), (4, 8), (8, 10)]
    assert Index.build(index, 0, 2, 1) == [2]  # looked up on the class: the instance comes first
    assert index.build.stats.calls == 2


def test_range_decorator_retries_a_method_from_the_failed_range() -> None:
    fits = oom_above(2)

    class Index:
        @koila.range(initial=4, cache=koila.NoCache())
        def build(self, begin: int, end: int) -> tuple[int, int]:
            fits(end - begin)
            return begin, end

    assert Index().build(0, 5) == [(0, 2), (2, 4), (4, 5)]


def test_chunked_and_accumulate_decorators_pass_the_instance_through() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(3, 1)

        @koila.chunked(initial=2, cache=koila.NoCache())
        def predict(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x)

        @koila.accumulate(initial=2, cache=koila.NoCache())
        def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return nn.functional.mse_loss(self.linear(x), y)

    torch.manual_seed(0)
    model, x, y = Model(), torch.randn(5, 3), torch.randn(5, 1)
    assert torch.allclose(model.predict(x), model.linear(x))
    loss = model.step(x, y)
    assert torch.allclose(loss, nn.functional.mse_loss(model.linear(x), y))


@dataclasses.dataclass(eq=False)
class _Trainer:
    model: nn.Module
    scales: torch.Tensor  # one per output: the object's, not the batch's, whatever its length

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.model(x) * self.scales, y)

    @koila.accumulate(initial=2, cache=koila.NoCache())
    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss(x, y)

    @koila.accumulate(initial=2, cache=koila.NoCache())
    @staticmethod
    def static_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(model(x), y)

    @koila.accumulate(initial=2, cache=koila.NoCache())
    @classmethod
    def class_step(cls, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        assert cls is _Trainer
        return nn.functional.cross_entropy(model(x), y)


@pytest.mark.parametrize("rows", [4, 8])  # as many rows as the class weights, and more
def test_accumulate_binds_a_dataclass_instance_instead_of_splitting_its_tensors(rows: int) -> None:
    torch.manual_seed(0)
    trainer = _Trainer(nn.Linear(3, 4), torch.tensor([1.0, 2.0, 3.0, 4.0]))
    x, y = torch.randn(rows, 3), torch.randint(0, 4, (rows,))
    trainer.loss(x, y).backward()
    expected = [parameter.grad.clone() for parameter in trainer.model.parameters()]  # type: ignore[union-attr]
    trainer.model.zero_grad()
    loss = trainer.step(x, y)
    assert trainer.step.stats.batch_size == 2
    torch.testing.assert_close(loss, trainer.loss(x, y))
    for parameter, grad in zip(trainer.model.parameters(), expected, strict=True):
        torch.testing.assert_close(parameter.grad, grad)
    trainer.model.zero_grad()
    _Trainer.step(trainer, x, y)  # looked up on the class: the instance comes first, bound all the same
    for parameter, grad in zip(trainer.model.parameters(), expected, strict=True):
        torch.testing.assert_close(parameter.grad, grad)


def test_accumulate_decorates_a_staticmethod_and_a_classmethod() -> None:
    torch.manual_seed(0)
    model, x, y = nn.Linear(3, 4), torch.randn(5, 3), torch.randint(0, 4, (5,))
    nn.functional.cross_entropy(model(x), y).backward()
    expected = model.weight.grad.clone()  # type: ignore[union-attr]
    for step in (_Trainer.static_step, _Trainer(model, torch.ones(4)).static_step, _Trainer.class_step):
        model.zero_grad()
        step(model, x, y)
        torch.testing.assert_close(model.weight.grad, expected)
    assert _Trainer.static_step.stats.batch_size == 2


def test_compat_accelerate_binds_a_method_whatever_its_first_parameter_is_called() -> None:
    class Trainer:
        @find_executable_batch_size(starting_batch_size=16)
        def train(this, batch_size: int, steps: int) -> tuple[Any, int, int]:
            if batch_size > 8:
                raise make_oom()
            return this, batch_size, steps

    trainer = Trainer()
    assert trainer.train(3) == (trainer, 8, 3)
    assert trainer.train.stats.batch_size == 8


def test_compat_accelerate_called_plainly_passes_the_size_first() -> None:
    @find_executable_batch_size(starting_batch_size=4)
    def train(batch_size: int, model: object) -> tuple[int, object]:
        return batch_size, model

    assert train("model") == (4, "model")


# --------------------------------------------------------------------------- generator functions


def numbers(batch_size: int) -> Iterator[int]:
    yield from range(batch_size)


async def async_numbers(batch_size: int) -> AsyncIterator[int]:
    for number in range(batch_size):
        yield number


DECORATORS: list[tuple[str, Callable[[Any], Any]]] = [
    ("@koila.batch", koila.batch),
    ("@koila.batch", koila.batch(initial=4)),
    ("@koila.accumulate", koila.accumulate),
    ("koila.chunked", koila.chunked),
    ("koila.range", koila.range),
    ("find_executable_batch_size", find_executable_batch_size),
]


@pytest.mark.parametrize(("front_end", "decorate"), DECORATORS)
@pytest.mark.parametrize("function", [numbers, async_numbers])
def test_generator_functions_are_refused_when_decorated(
    front_end: str, decorate: Callable[[Any], Any], function: Callable[..., Any]
) -> None:
    with pytest.raises(TypeError, match=rf"{front_end} cannot retry .*{function.__name__}\(\): it is a generator"):
        decorate(function)


def test_chunked_and_range_calls_refuse_a_generator_function() -> None:
    def rows(x: torch.Tensor) -> Iterator[torch.Tensor]:
        yield x

    def indices(begin: int, end: int) -> Iterator[int]:
        yield begin

    with pytest.raises(TypeError, match=r"koila.chunked cannot retry .*rows\(\): it is a generator function"):
        koila.chunked(rows, torch.ones(4))
    with pytest.raises(TypeError, match=r"koila.range cannot retry .*indices\(\): it is a generator function"):
        koila.range(indices, 0, 4)


# --------------------------------------------------------------------------- iterator arguments


def consume(numbers: Iterator[int], batch_size: int, limit: int) -> int:
    """Add up the numbers; with more than ``limit`` per batch, run out of memory part-way."""
    total = 0
    for count, number in enumerate(numbers):
        total += number
        if count == 3 and batch_size > limit:
            raise make_oom()
    return total


def test_an_iterator_a_failed_attempt_consumed_is_not_reused() -> None:
    @koila.batch(initial=8, cache=koila.NoCache())
    def total(batch_size: int, numbers: Iterator[int]) -> int:
        return consume(numbers, batch_size, limit=4)

    assert total(list(range(10))) == 45  # a list is iterated afresh by each attempt
    with pytest.raises(TypeError, match=r"total: out of memory at batch size 8.* argument 0 \(range_iterator\)"):
        total(iter(range(10)))  # today's retry would add up 4..9: 39
    assert total.stats.exhausted == 1


def test_the_error_names_a_keyword_argument_and_holds_no_frame_of_the_failed_attempt() -> None:
    made: list[weakref.ref[torch.Tensor]] = []

    @koila.batch(initial=8, cache=koila.NoCache())
    def total(batch_size: int, *, numbers: Iterator[int]) -> int:
        activations = torch.ones(1000)
        made.append(weakref.ref(activations))
        return consume(numbers, batch_size, limit=4)

    with pytest.raises(TypeError, match=r"keyword argument 'numbers' \(generator\).*list\(") as info:
        total(numbers=(n for n in range(10)))
    gc.collect()
    assert made[0]() is None  # the error, alive here, keeps no frame of the attempt
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
    assert info.value.__cause__.__traceback__ is None


def test_an_async_call_does_not_reuse_an_iterator() -> None:
    @koila.batch(initial=8, cache=koila.NoCache())
    async def total(batch_size: int, numbers: Iterator[int]) -> int:
        return consume(numbers, batch_size, limit=4)

    with pytest.raises(TypeError, match=r"argument 0 \(range_iterator\)"):
        asyncio.run(total(iter(range(10))))


def test_an_iterator_a_decorated_partial_binds_is_not_reused() -> None:
    def total(batch_size: int, numbers: Iterator[int]) -> int:
        return consume(numbers, batch_size, limit=4)

    by_keyword = koila.batch(initial=8, cache=koila.NoCache())(functools.partial(total, numbers=iter(range(10))))
    with pytest.raises(TypeError, match=r"keyword argument 'numbers' of the partial \(range_iterator\)"):
        by_keyword()  # the retry would add up 4..9: 39
    by_position = koila.batch(initial=8, cache=koila.NoCache(), param="batch_size")(
        functools.partial(lambda numbers, batch_size: total(batch_size, numbers), iter(range(10)))
    )
    with pytest.raises(TypeError, match=r"argument 0 of the partial \(range_iterator\)"):
        by_position()
    listed = koila.batch(initial=8, cache=koila.NoCache())(functools.partial(total, numbers=list(range(10))))
    assert listed() == 45


def test_a_method_does_not_reuse_an_iterator() -> None:
    class Summer:
        @koila.batch(initial=8, cache=koila.NoCache())
        def total(self, batch_size: int, numbers: Iterator[int]) -> int:
            return consume(numbers, batch_size, limit=4)

    with pytest.raises(TypeError, match=r"argument 0 \(list_iterator\)"):
        Summer().total(iter(list(range(10))))


def test_every_front_end_refuses_to_retry_with_an_iterator() -> None:
    rows = torch.ones(8, 2)

    @koila.accumulate(initial=8, cache=koila.NoCache())
    def step(x: torch.Tensor, weights: Iterator[float]) -> torch.Tensor:
        return x.sum() * consume(weights, len(x), limit=4)

    with pytest.raises(TypeError, match=r"the argument weights \(a list_iterator\)"):  # refused before it runs
        step(rows, iter([1.0] * 10))

    def scaled(x: torch.Tensor, weights: Iterator[float]) -> torch.Tensor:
        return x * consume(weights, len(x), limit=4)

    with pytest.raises(TypeError, match=r"the argument weights \(a list_iterator\)"):  # refused before it runs
        koila.chunked(scaled, rows, iter([1.0] * 10), initial=8, cache=koila.NoCache())

    @koila.range(initial=8, cache=koila.NoCache())
    def spans(begin: int, end: int, weights: Iterator[float]) -> float:
        return consume(weights, end - begin, limit=4)

    with pytest.raises(TypeError, match=r"the argument weights \(a list_iterator\)"):
        spans(0, 8, iter([1.0] * 10))

    @toma.batch(initial_batchsize=8, cache_type=toma.NoBatchsizeCache)
    def toma_total(batch_size: int, numbers: Iterator[int]) -> int:
        return consume(numbers, batch_size, limit=4)

    with pytest.raises(TypeError, match=r"argument 0 \(list_iterator\)"):
        toma_total(iter(list(range(10))))

    @find_executable_batch_size(starting_batch_size=8)
    def accelerate_total(batch_size: int, numbers: Iterator[int]) -> int:
        return consume(numbers, batch_size, limit=4)

    with pytest.raises(TypeError, match=r"argument 0 \(list_iterator\)"):
        accelerate_total(iter(list(range(10))))


@dataclasses.dataclass
class Settings:
    scales: Any


@pytest.mark.parametrize(
    ("wrap", "named"),
    [
        (lambda it: {"scales": it}, r"argument 0\['scales'\] \(list_iterator\)"),
        (lambda it: [1, (2, it)], r"argument 0\[1\]\[1\] \(list_iterator\)"),
        (lambda it: Settings(it), r"argument 0\.scales \(list_iterator\)"),
    ],
    ids=["dict", "list-of-tuple", "dataclass"],
)
def test_an_iterator_inside_an_argument_is_not_reused(wrap: Callable[[Any], Any], named: str) -> None:
    def scales_of(settings: Any) -> Iterator[int]:
        if isinstance(settings, dict):
            return cast(Iterator[int], settings["scales"])
        if isinstance(settings, list):
            return cast(Iterator[int], settings[1][1])
        return cast(Iterator[int], settings.scales)

    @koila.batch(initial=8, cache=koila.NoCache())
    def total(batch_size: int, settings: Any) -> int:
        return consume(scales_of(settings), batch_size, limit=4)

    assert total(wrap(list(range(10)))) == 45  # a list inside is iterated afresh
    with pytest.raises(TypeError, match=named):
        total(wrap(iter(list(range(10)))))  # the retry would add up 4..9: 39

    rows = torch.ones(8, 2)

    def scaled(x: torch.Tensor, settings: Any) -> torch.Tensor:
        return x * consume(scales_of(settings), len(x), limit=4)

    # chunked and accumulate refuse a top-level iterator before they run; one inside, at the failure.
    with pytest.raises(TypeError, match=named.replace("argument 0", "argument 1")):
        koila.chunked(scaled, rows, wrap(iter(list(range(10)))), initial=8, cache=koila.NoCache())

    @koila.accumulate(initial=8, cache=koila.NoCache())
    def step(x: torch.Tensor, settings: Any) -> torch.Tensor:
        return scaled(x, settings).sum()

    with pytest.raises(TypeError, match=named.replace("argument 0", "argument 1")):
        step(rows.requires_grad_(), wrap(iter(list(range(10)))))


@dataclasses.dataclass
class Lazy:
    rows: int
    cache: dict[str, int] = dataclasses.field(init=False)  # filled later, if ever: reading it raises


def test_the_look_for_iterators_never_replaces_the_retry() -> None:
    @koila.batch(initial=8, cache=koila.NoCache())
    def total(batch_size: int, settings: Any) -> int:
        return consume(iter(range(10)), batch_size, limit=4)

    assert total(Lazy(3)) == 45  # an unset field: its read raised AttributeError in place of the retry
    node: dict[str, Any] = {}
    node.update({f"edge {index}": node for index in range(50)})  # holds itself: walked once
    assert total(node) == 45
    long: list[Any] = [*range(3_000_000), iter([1])]  # only the first 10,000 values are taken in
    assert total(long) == 45  # the iterator past them: not seen (as documented), and no time lost
    with pytest.raises(TypeError, match=r"argument 0\[1\] \(list_iterator\)"):
        total([long, iter([1])])  # read level by level: the long list's items come after it


def test_a_file_nothing_reads_from_does_not_stop_a_retry(tmp_path: Any) -> None:
    @koila.batch(initial=8, cache=koila.NoCache())
    def logged(batch_size: int, log: Any, settings: dict[str, Any]) -> int:
        print(batch_size, file=log)
        return consume(iter(range(10)), batch_size, limit=4)

    with open(tmp_path / "log.txt", "w") as log:
        assert logged(log, {"also": log}) == 45  # written to, never read: retried
    assert (tmp_path / "log.txt").read_text().split() == ["8", "4"]
    with (
        open(tmp_path / "log.txt", "r+") as log,
        pytest.raises(TypeError, match=r"argument 0 \(TextIOWrapper") as caught,
    ):
        logged(log, {})  # readable: a retry would read on from where the failed attempt stopped
    assert "(TextIOWrapper, a file open for reading) is an iterator" in str(caught.value)
    with pytest.raises(TypeError, match=r"argument 0 \(StringIO, a buffer that can be read\)") as buffered:
        logged(io.StringIO(), {})
    assert str(buffered.value).endswith(
        "Append what the function writes to a list instead, or make the buffer inside the function"
    )
    assert str(caught.value).endswith(
        "Open it for writing only ('w' or 'a') if the function only writes to it, "
        "or pass its path and open it inside the function"
    )


def test_an_iterator_is_fine_when_nothing_fails_or_nothing_is_retried() -> None:
    @koila.batch(initial=4, cache=koila.NoCache())
    def total(batch_size: int, numbers: Iterator[int]) -> int:
        return consume(numbers, batch_size, limit=4)

    assert total(iter(range(10))) == 45

    @koila.batch(initial=8, minimum=8, cache=koila.NoCache())
    def last(batch_size: int, numbers: Iterator[int]) -> int:
        return consume(numbers, batch_size, limit=4)

    with pytest.raises(koila.BatchSizeExhausted):  # no retry left: the usual error
        last(iter(range(10)))


def test_toma_itself_retries_with_what_is_left_of_the_iterator() -> None:
    original = pytest.importorskip("toma")

    @original.toma.batch(initial_batchsize=8)
    def total(batch_size: int, numbers: Iterator[int]) -> int:
        return consume(numbers, batch_size, limit=4)

    assert total(iter(range(10))) == 39  # 4 + 5 + ... + 9: the difference compat.toma fixes


# --------------------------------------------------------------------------- copies, pickles, help()


def _sized(batch_size: int, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.cat([chunk * scale for chunk in x.split(batch_size)])


def _rows(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * scale


def _span(begin: int, end: int, scale: torch.Tensor) -> torch.Tensor:
    return torch.arange(float(begin), float(end)) * scale


def _mean(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x * scale).mean()


# Each front end's kind of function, the scale last; how to decorate one; how to call it plainly.
_WORK: dict[str, Callable[..., torch.Tensor]] = {"batch": _sized, "chunked": _rows, "range": _span, "accumulate": _mean}
_FRONT_ENDS: dict[str, Callable[..., Any]] = {
    "batch": koila.batch,
    "chunked": koila.chunked,
    "range": koila.range,
    "accumulate": koila.accumulate,
}
_FRONT_END_NAMES = list(_FRONT_ENDS)


def _decorated(front_end: str, fn: Callable[..., Any], **options: Any) -> Any:
    return _FRONT_ENDS[front_end](initial=4, **options)(fn)  # 10 rows: parts of 4, 4 and 2


def _through(front_end: str, call: Callable[..., Any], x: torch.Tensor) -> torch.Tensor:
    """Call a decorated function on ``x``'s 10 rows (a range: over them), with what it returns as one tensor."""
    if front_end == "range":
        return torch.cat(call(0, len(x)))
    return cast(torch.Tensor, call(x))


def _plainly(front_end: str, call: Callable[..., Any], x: torch.Tensor) -> torch.Tensor:
    """Call the undecorated function on the whole of ``x``, as the decorated one's parts add up to."""
    if front_end == "batch":
        return cast(torch.Tensor, call(len(x), x))
    if front_end == "range":
        return cast(torch.Tensor, call(0, len(x)))
    return cast(torch.Tensor, call(x))


class _Scaled(nn.Module):
    """A module whose forward is one front end's kind of function."""

    def __init__(self, front_end: str) -> None:
        super().__init__()
        self.front_end = front_end
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, first: Any, *rest: Any) -> torch.Tensor:
        return _WORK[self.front_end](first, *rest, self.scale)


class _Callable:
    """A callable instance that is one front end's kind of function."""

    def __init__(self, front_end: str) -> None:
        self.front_end = front_end
        self.scale = torch.tensor(2.0, requires_grad=True)

    def __call__(self, first: Any, *rest: Any) -> torch.Tensor:
        return _WORK[self.front_end](first, *rest, self.scale)


class _Net(nn.Module):
    """Decorates its own method in ``__init__``, for a cache of its own (docs/recovery.rst), or not at all."""

    def __init__(self, front_end: str, koila_on: bool, **options: Any) -> None:
        super().__init__()
        self.front_end = front_end
        self.lin = nn.Linear(4, 2)
        self.run = _decorated(front_end, self._work, **options) if koila_on else self._work

    def _work(self, first: Any, *rest: Any) -> torch.Tensor:
        if self.front_end == "batch":
            return torch.cat([self.lin(chunk) for chunk in rest[0].split(first)])
        if self.front_end == "range":
            return self.lin(torch.arange(float(first * 4), float(rest[0] * 4)).reshape(-1, 4))
        if self.front_end == "chunked":
            return cast(torch.Tensor, self.lin(first))
        return self.lin(first).pow(2).mean()


def _copied(how: str, net: nn.Module) -> Any:
    if how == "deepcopy":
        return copy.deepcopy(net)
    buffer = io.BytesIO()
    torch.save(net, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
@pytest.mark.parametrize("front_end", _FRONT_END_NAMES)
def test_a_copy_of_a_module_runs_its_per_instance_wrapper_with_the_copy_s_weights(front_end: str, how: str) -> None:
    # An EMA or teacher copy: the wrapper kept the original's bound method, and ran the original model.
    torch.manual_seed(0)
    net, plain = _Net(front_end, True), _Net(front_end, False)
    plain.load_state_dict(net.state_dict())
    copied, plain_copied = _copied(how, net), _copied(how, plain)
    for module in (copied, plain_copied):
        with torch.no_grad():
            module.lin.weight.mul_(-3.0)
    x = torch.randn(10, 4)
    torch.testing.assert_close(_through(front_end, copied.run, x), _plainly(front_end, plain_copied.run, x))
    torch.testing.assert_close(_through(front_end, net.run, x), _plainly(front_end, plain.run, x))
    if front_end == "accumulate":  # the copy's gradients, and none of the original's
        _plainly(front_end, plain_copied.run, x).backward()
        torch.testing.assert_close(copied.lin.weight.grad, plain_copied.lin.weight.grad)
    assert copied.run.stats.calls == 1


def test_a_copy_shares_the_cache_it_was_given_and_makes_its_default_anew() -> None:
    cache = koila.StackMemoryCache()
    given, default = _Net("batch", True, cache=cache), _Net("batch", True)
    assert copy.deepcopy(given).run.cache_info.__self__ is given.run.cache_info.__self__ is cache
    assert copy.deepcopy(default).run.cache_info.__self__ is not default.run.cache_info.__self__
    # Its keys hold the objects of the wrappers made with it: a checkpoint that pickled it before the
    # model, or two models sharing it, saved and could not be loaded (probe 74M). Refused when saving.
    with pytest.raises(
        TypeError, match=r"cannot pickle a koila_retry wrapper made with cache=StackMemoryCache.*shared"
    ):
        torch.save(given, io.BytesIO())


@pytest.mark.parametrize("kind", ["NoCache", "DiskCache"])
def test_a_wrapper_given_a_cache_whose_keys_are_text_or_none_is_pickled(kind: str, tmp_path: Path) -> None:
    # Refused, saying the cache's keys hold the wrappers' objects, which neither's do (probe 75E).
    cache = koila.NoCache() if kind == "NoCache" else koila.DiskCache(tmp_path / "sizes.json")
    net = _Net("batch", True, cache=cache)
    x = torch.randn(10, 4)
    # With initial="auto" called once, the cache holds its estimates' memo, whose lock pickle refused (probe 75I).
    auto = koila.chunked(initial="auto", cache=cache)(net.lin)
    auto(x)
    torch.save(auto, io.BytesIO())
    buffer = io.BytesIO()
    torch.save(net, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    torch.testing.assert_close(loaded.run(x), net.run(x))
    assert type(loaded.run.cache_info.__self__) is type(cache)


@pytest.mark.parametrize("make", [koila.StackMemoryCache, koila.GlobalCache, koila.NoCache])
@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_a_copied_cache_is_a_cache_of_its_own_with_the_sizes_it_held(make: type[koila.SizeCache], how: str) -> None:
    # A copy shared the original's sizes and lock (a change to it changed the original, which then
    # answered lookups with a size its items no longer held); a deep copy and a pickle raised TypeError
    # about a lock, and so did copy.deepcopy of a model that keeps its cache (an EMA copy).
    cache = make(maxsize=8)
    cache["kept"], cache["gone"] = 4, 2
    cache.prove("kept", 100)
    assert cache.lookup("gone") == (None if make is koila.NoCache else 2)
    copied = {"copy": copy.copy, "deepcopy": copy.deepcopy, "pickle": lambda c: pickle.loads(pickle.dumps(c))}[how](
        cache
    )
    assert type(copied) is make
    assert dict(copied.items()) == dict(cache.items())
    assert copied.cache_info() == cache.cache_info()
    assert copied.key_function is cache.key_function
    copied.pop("gone", None)
    copied["new"] = 1
    assert copied.lookup("gone") is None
    assert cache.lookup("gone") == (None if make is koila.NoCache else 2)
    assert "new" not in cache
    cache.bounds.update("kept", lambda _: (32, 100))  # what refine=True learnt: the copy's own too
    copied = {"copy": copy.copy, "deepcopy": copy.deepcopy, "pickle": lambda c: pickle.loads(pickle.dumps(c))}[how](
        cache
    )
    assert copied.bounds.get("kept") == (32, 100)
    copied.cache_clear()
    assert cache.bounds.get("kept") == (32, 100)
    if make is not koila.NoCache:
        assert copied.sample_bytes("kept") is None
        assert cache.sample_bytes("kept") == 100
        with copied._lock:  # not the original's
            assert cache._lock.acquire(blocking=False)
            cache._lock.release()
    model = nn.Linear(2, 2)
    model.sizes = cache  # type: ignore[assignment]
    assert dict(copy.deepcopy(model).sizes.items()) == dict(cache.items())


class _Tagged(koila.StackMemoryCache):
    __slots__ = ("__seen", "tag")

    def __init__(self) -> None:
        super().__init__()
        self.tag, self.__seen, self.history = "run-1", ["made"], ["made"]

    def seen(self) -> list[str]:
        return self.__seen


class _Reporting(koila.StackMemoryCache):
    def __init__(self) -> None:
        super().__init__()
        self.report = self.describe  # refers back to the cache

    def describe(self) -> str:
        return f"{len(self)} sizes"


def test_a_deep_copy_of_a_cache_that_refers_to_itself_refers_to_the_copy() -> None:
    cache = _Reporting()
    cache["k"] = 8
    copied = copy.deepcopy(cache)  # RecursionError, where the clone was registered after its state was copied
    assert copied.report.__self__ is copied
    assert copied.report() == "1 sizes"


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_a_copied_cache_keeps_a_subclass_s_slots_and_attributes(how: str) -> None:
    cache = _Tagged()
    cache["k"] = 4
    copied = {"copy": copy.copy, "deepcopy": copy.deepcopy, "pickle": lambda c: pickle.loads(pickle.dumps(c))}[how](
        cache
    )
    assert (copied.tag, copied.seen(), copied.history, dict(copied.items())) == ("run-1", ["made"], ["made"], {"k": 4})
    copied.history.append("copied")
    copied.seen().append("copied")
    shared = how == "copy"  # a shallow copy shares what a subclass holds, as copy.copy of any object does
    assert (cache.history == ["made"], cache.seen() == ["made"]) == (not shared, not shared)


@pytest.mark.parametrize(
    ("front_end", "kind"),
    # Not koila.batch of a module: the size's parameter is read from a signature, which nn.Module.__call__ hides.
    [
        (front_end, kind)
        for front_end in _FRONT_END_NAMES
        for kind in ("partial", "module", "instance")
        if (front_end, kind) != ("batch", "module")
    ],
)
def test_a_wrapper_of_a_callable_without_a_name_copies_and_pickles(front_end: str, kind: str) -> None:
    if kind == "partial":
        fn: Any = functools.partial(_WORK[front_end], scale=torch.tensor(2.0, requires_grad=True))
    else:
        fn = _Scaled(front_end) if kind == "module" else _Callable(front_end)
    wrapper = _decorated(front_end, fn)
    x = torch.randn(10, 1)
    for how in ("copy", "deepcopy", "pickle"):
        if how == "pickle":
            copied, plain = pickle.loads(pickle.dumps(wrapper)), pickle.loads(pickle.dumps(fn))
        else:
            operation = copy.copy if how == "copy" else copy.deepcopy
            copied, plain = operation(wrapper), operation(fn)
        scale = fn.keywords["scale"] if kind == "partial" else fn.scale
        with torch.no_grad():
            scale.add_(1.0)  # seen by a shallow copy, as by the plain one; not by a deep copy
        torch.testing.assert_close(_through(front_end, copied, x), _plainly(front_end, plain, x))


def _slow(batch_size: int, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([chunk * 2 for chunk in x.split(batch_size)])


fast = koila.batch(initial=4)(_slow)  # a module-level name other than the function's


@koila.chunked(initial=4)
def _doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_a_module_level_wrapper_of_another_name_pickles_and_a_decorated_function_pickles_by_name() -> None:
    x = torch.randn(10, 1)
    copied = pickle.loads(pickle.dumps(fast))
    torch.testing.assert_close(copied(x), _slow(len(x), x))
    assert pickle.loads(pickle.dumps(_doubled)) is _doubled  # by name, as spawn's workers find it
    assert copy.deepcopy(_doubled) is _doubled


def test_help_shows_no_library_comment_for_an_undocumented_decorated_method() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        @koila.batch(initial=4)
        def predict(self, batch_size: int, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)

        @koila.chunked(initial=4)
        def embed(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)

        @koila.range(initial=4)
        def load(self, begin: int, end: int) -> int:
            return end - begin

        @koila.accumulate
        def loss(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).sum()

        def plain(self, x: torch.Tensor) -> torch.Tensor:
            return x

    model = Model()
    assert inspect.getcomments(model.plain) is None  # what the decorated ones are compared with
    for name in ("predict", "embed", "load", "loss"):
        assert inspect.getcomments(getattr(model, name)) == inspect.getcomments(model.plain), name
        assert inspect.getcomments(getattr(Model, name)) == inspect.getcomments(Model.plain), name


def _total(batch_size: int, x: torch.Tensor) -> torch.Tensor:
    return sum((chunk.sum() for chunk in x.split(batch_size)), torch.zeros(()))


class _Predictor:
    @koila.batch(initial=4)
    def predict(self, batch_size: int, x: torch.Tensor) -> torch.Tensor:
        return _total(batch_size, x)


@pytest.mark.parametrize(
    "wrapped",
    [
        koila.batch(_total),
        koila.chunked(_rows),
        koila.range(_span),
        koila.accumulate(_mean),
        find_executable_batch_size(_total),
        find_executable_batch_size(_total, starting_batch_size=0),
        _Predictor().predict,
        _Predictor.predict,
        functools.partial(koila.batch(_total)),
    ],
    ids=[
        "batch",
        "chunked",
        "range",
        "accumulate",
        "accelerate",
        "accelerate-0",
        "bound method",
        "class method",
        "partial",
    ],
)
def test_batch_refuses_a_koila_wrapper_at_decoration(wrapped: Any) -> None:
    # Accepted, the first call handed the outer size to the wrapper, which blamed the data for being the size.
    x = torch.ones(10)
    for decorate in (koila.batch, koila.batch(initial=4), find_executable_batch_size):
        with pytest.raises(TypeError, match=r"already a koila_retry wrapper .*Decorate the undecorated function once"):
            decorate(wrapped)
    assert koila.batch(_total)(x) == _total(len(x), x)  # the undecorated function, decorated once


class _Pipeline:
    """A callable of the user's that shows its inner wrapper's stats: not a wrapper itself."""

    def __init__(self) -> None:
        self.inner = koila.chunked(initial=4)(lambda x: x * 2)
        self.stats = self.inner.stats

    def __call__(self, batch_size: int, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.inner(chunk) for chunk in x.split(batch_size)])


def test_batch_takes_a_callable_that_holds_a_wrappers_stats() -> None:
    x = torch.arange(10.0).reshape(10, 1)
    pipeline = _Pipeline()
    torch.testing.assert_close(koila.batch(initial=4)(pipeline)(x), pipeline(10, x))


class _Worker(nn.Module):
    """Wraps a partial of its own method, or its method through the accelerate stand-in, in ``__init__``."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        if how == "partial":
            self.run = koila.batch(initial=4)(functools.partial(self._work, scale=2.0))
        else:
            self.run = find_executable_batch_size(self._work, starting_batch_size=4)

    def _work(self, batch_size: int, x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
        return torch.cat([self.lin(chunk) for chunk in x.split(batch_size)]) * scale


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
@pytest.mark.parametrize("kind", ["partial", "accelerate"])
def test_a_copy_of_a_wrapper_of_a_partial_or_of_the_stand_in_runs_the_copys_weights(kind: str, how: str) -> None:
    # Both read the copied module's repr while it was half made, and raised AttributeError.
    net = _Worker(kind)
    copied = _copied(how, net)
    with torch.no_grad():
        copied.lin.weight.mul_(-3.0)
    x = torch.randn(10, 4)
    torch.testing.assert_close(copied.run(x), copied._work(10, x))
    torch.testing.assert_close(net.run(x), net._work(10, x))


def test_a_deep_copy_of_a_functions_wrapper_is_itself_as_the_functions_is() -> None:
    # A closure decorated where it is defined: its stats and cache go with it, as the function does.
    def make() -> Any:
        @koila.chunked(initial=4)
        def double(x: torch.Tensor) -> torch.Tensor:
            return x * 2

        return double

    double = make()
    double(torch.ones(10, 1))
    assert copy.deepcopy(double) is double
    assert copy.copy(double) is double
    total = koila.batch(_total)  # not found by its module-level name, which is the undecorated function's
    assert copy.deepcopy(total) is total


def test_a_decorated_range_function_says_it_takes_the_range_by_position_and_returns_a_list() -> None:
    def load(begin: int, end: int, scale: int = 1) -> int:
        return (end - begin) * scale

    class Index:
        @koila.range(initial=4)
        def load(self, begin: int, end: int, scale: int = 1) -> int:
            return (end - begin) * scale

    class Graphless:  # a decorator above, which binds the instance and passes it on
        @torch.no_grad()
        @koila.range(initial=4)
        def load(self, begin: int, end: int, scale: int = 1) -> int:
            return (end - begin) * scale

    returned = typing.get_type_hints(load)["return"]
    for wrapped in (koila.range(initial=4)(load), Index().load, Graphless().load):
        signature = inspect.signature(wrapped)
        begin, end, scale = signature.parameters.values()
        assert (begin.kind, end.kind) == (inspect.Parameter.POSITIONAL_ONLY,) * 2
        assert scale == inspect.signature(load).parameters["scale"]
        assert typing.get_type_hints(wrapped)["return"] == list[returned]  # type: ignore[valid-type]
        assert isinstance(wrapped(0, 10), typing.get_origin(list[returned]))  # type: ignore[valid-type]
        signature.bind(0, 10)
        with pytest.raises(TypeError):  # as the call refuses them
            signature.bind(begin=0, end=10)
        with pytest.raises(TypeError, match="by position only"):
            wrapped(begin=0, end=10)


class _Doubler:
    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        return rows * 2


class _TopK:
    def __call__(self, batch_size: int, k: int = 5) -> tuple[int, int]:
        return batch_size, k


def _scored(batch_size: int, k: int = 5) -> tuple[int, int]:
    return batch_size, k


class _Ranker:
    # Python binds neither a callable object nor (before 3.14) a partial held by a class: nor do their wrappers.
    plain = _TopK()
    score = koila.batch(initial=8, cache=koila.NoCache())(_TopK())
    partial = koila.batch(initial=8, cache=koila.NoCache())(functools.partial(_scored))
    doubled = koila.chunked(initial=2, cache=koila.NoCache())(_Doubler())


def test_a_callable_object_or_partial_held_by_a_class_is_not_bound_as_a_method() -> None:
    ranker = _Ranker()
    assert ranker.plain(8) == (8, 5)  # what Python does
    assert ranker.score() == (8, 5)
    assert ranker.score(3) == (8, 3)  # passed on, not taken for the size
    assert ranker.score(k=3) == (8, 3)
    if not hasattr(functools.partial, "__get__"):
        assert ranker.partial(3) == (8, 3)
    assert _Ranker.score(3) == (8, 3)
    assert ranker.score.stats.calls == 4
    assert torch.equal(ranker.doubled(torch.arange(5.0)), torch.arange(5.0) * 2)


@dataclasses.dataclass
class _Scaler:
    factor: torch.Tensor

    def step(self, batch_size: int, x: str, scale: int = 1) -> tuple[str, int, str, int]:
        return type(self).__name__, batch_size, x, scale

    def rows(self, x: torch.Tensor, shift: float = 0.0) -> torch.Tensor:
        return x * self.factor + shift


def test_a_partial_of_a_method_still_takes_its_instance_first() -> None:
    # Not bound by a class, but its first parameter is self: the size goes after it, as for the method.
    scaler = _Scaler(torch.full((3,), 2.0))
    stepped = koila.batch(initial=8, cache=koila.NoCache())(functools.partial(_Scaler.step, scale=3))
    assert stepped(scaler, "x") == ("_Scaler", 8, "x", 3)
    rows = koila.chunked(initial=2, cache=koila.NoCache())(functools.partial(_Scaler.rows, shift=1.0))
    torch.testing.assert_close(rows(scaler, torch.ones(5, 3)), torch.full((5, 3), 3.0))  # the instance not split
