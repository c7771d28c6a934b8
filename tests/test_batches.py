"""The one splitter of a call's arguments: tensors in containers, which are split, and the slices' containers."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections import OrderedDict, UserDict, defaultdict
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from types import MappingProxyType
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import koila_retry as koila
from koila_retry._common.batches import DEPTH, Split
from koila_retry.testing import oom_above


class Encoding(UserDict[str, Any]):
    """Shaped like a tokenizer's BatchEncoding: a UserDict with state of its own and attribute access."""

    def __init__(self, data: dict[str, Any], encodings: object = None) -> None:
        super().__init__(data)
        self.encodings = encodings

    def __getattr__(self, name: str) -> Any:
        try:
            return self.data[name]
        except KeyError:
            raise AttributeError(name) from None


class Pair(NamedTuple):
    inputs: torch.Tensor
    targets: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Frozen:
    pixels: torch.Tensor
    name: str = "batch"


class Plain(tuple):  # type: ignore[type-arg]
    """A tuple subclass that keeps tuple.__new__, with an attribute set on the instance."""


class Fields(tuple):  # type: ignore[type-arg]
    """A tuple subclass whose constructor takes one argument per item."""

    def __new__(cls, inputs: Any, targets: Any) -> Fields:
        return super().__new__(cls, (inputs, targets))


class Items(tuple):  # type: ignore[type-arg]
    """A tuple subclass whose constructor takes its items as one iterable, and more."""

    def __new__(cls, items: Any, scale: float = 1.0) -> Items:
        return super().__new__(cls, items)


class Sealed(tuple):  # type: ignore[type-arg]
    """A tuple subclass that cannot be remade: its constructor takes keywords only."""

    def __new__(cls, *, first: Any, second: Any) -> Sealed:
        return super().__new__(cls, (first, second))


class Keywords(Mapping[str, Any]):
    """A read-only mapping whose constructor takes keywords only."""

    def __init__(self, **items: Any) -> None:
        self._items = dict(items)

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


class Store(MutableMapping[str, Any]):
    """A mutable mapping with no __copy__: copy.copy would share its storage with the original."""

    def __init__(self, items: dict[str, Any] | None = None) -> None:
        self._items = dict(items or {})

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._items[key] = value

    def __delitem__(self, key: str) -> None:
        del self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


class Filled(Store):
    """A mutable mapping made empty, then filled."""

    def __init__(self) -> None:
        super().__init__()


class Pairs(Keywords):
    """A read-only mapping that cannot be remade: its constructor takes keys and values apart."""

    def __init__(self, keys: list[str], values: list[Any]) -> None:
        self._items = dict(zip(keys, values, strict=True))


def rows(n: int, *rest: int) -> torch.Tensor:
    return torch.arange(float(n * math.prod(rest))).reshape(n, *rest)


def test_containers_come_back_as_their_own_types_with_their_rows() -> None:
    marker = object()
    batch = {
        "encoding": Encoding({"input_ids": rows(5, 3), "attention_mask": rows(5, 3)}, encodings=marker),
        "ordered": OrderedDict(a=rows(5)),
        "default": defaultdict(list, b=rows(5)),
        "pair": Pair(rows(5, 2), rows(5)),
        "frozen": Frozen(rows(5, 4)),
        "nested": [(rows(5),), "text", 3],
    }
    split = Split((batch,), {}, 0, "test")
    assert split.rows == 5
    pieces = list(split.pieces(2))
    assert [n for _, _, n in pieces] == [2, 2, 1]
    begin = 0
    for args, kwargs, n in pieces:
        (piece,) = args
        assert kwargs == {}
        assert type(piece) is dict
        assert type(piece["encoding"]) is Encoding
        assert piece["encoding"].encodings is marker
        assert piece["encoding"].input_ids.shape == (n, 3)
        assert torch.equal(piece["encoding"]["attention_mask"], batch["encoding"]["attention_mask"][begin : begin + n])
        assert type(piece["ordered"]) is OrderedDict
        assert type(piece["default"]) is defaultdict
        assert piece["default"].default_factory is list
        assert type(piece["pair"]) is Pair
        assert torch.equal(piece["pair"].targets, rows(5)[begin : begin + n])
        assert type(piece["frozen"]) is Frozen
        assert piece["frozen"].pixels.shape == (n, 4)
        assert piece["frozen"].name == "batch"
        assert type(piece["nested"]) is list
        assert type(piece["nested"][0]) is tuple
        assert piece["nested"][1:] == ["text", 3]
        begin += n
    # The caller's containers are untouched.
    assert batch["encoding"]["input_ids"].shape == (5, 3)
    assert batch["frozen"].pixels.shape == (5, 4)


def test_keyword_containers_are_split_like_positional_ones() -> None:
    mask = rows(6, 2)
    split = Split((rows(6),), {"batch": {"mask": mask}, "flag": True}, 0, "test")
    chunk_args, chunk_kwargs = split.chunk(2, 5)
    assert torch.equal(chunk_args[0], rows(6)[2:5])
    assert torch.equal(chunk_kwargs["batch"]["mask"], mask[2:5])
    assert chunk_kwargs["flag"] is True


def test_one_row_and_zero_dim_tensors_pass_whole_and_their_containers_are_not_copied() -> None:
    position_ids = torch.arange(7).unsqueeze(0)  # (1, 7): broadcasts over the rows
    scale = torch.tensor(0.5)
    constants = {"position_ids": position_ids, "scale": scale}
    split = Split((rows(4, 7), constants), {}, 0, "test")
    assert split.rows == 4
    for args, _, _ in split.pieces(3):
        assert args[1] is constants


def test_a_batch_of_one_row_splits_its_one_row_tensors() -> None:
    split = Split((rows(1, 3), torch.ones(1)), {}, 0, "test")
    assert (split.rows, split.split) == (1, [0, 1])


def test_an_ambiguous_tensor_is_named_by_its_path() -> None:
    batch = {"input_ids": rows(8, 5), "position_ids": rows(5)}

    def step(batch: dict[str, torch.Tensor]) -> None:
        pass

    with pytest.raises(
        ValueError, match=r"the tensor batch\['input_ids'\] has 8, the tensor batch\['position_ids'\] has 5"
    ):
        Split((batch,), {}, 0, "test", step)


def test_fields_are_named_as_attributes() -> None:
    with pytest.raises(ValueError, match=r"the tensor args\[0\]\.inputs has 4, the tensor args\[0\]\.targets has 3"):
        Split((Pair(rows(4), rows(3)),), {}, 0, "test")


def test_a_container_that_holds_itself_is_refused() -> None:
    loop: list[Any] = [rows(2)]
    loop.append(loop)
    with pytest.raises(ValueError, match=rf"nested at most {DEPTH} deep, and args\[0\]\[1\]\[1\]"):
        Split((loop,), {}, 0, "test")


def test_a_read_only_mapping_is_remade_from_its_items() -> None:
    split = Split((MappingProxyType({"x": rows(4), "name": "a"}),), {}, 0, "test")
    pieces = [args[0] for args, _, _ in split.pieces(3)]
    assert [type(piece) for piece in pieces] == [MappingProxyType, MappingProxyType]
    assert torch.equal(pieces[1]["x"], rows(4)[3:])
    assert pieces[1]["name"] == "a"


def test_tuple_subclasses_and_mappings_without_a_copy_are_remade_as_their_own_types() -> None:
    plain = Plain((rows(5), "text"))
    plain.tag = "kept"  # type: ignore[attr-defined]
    stat = os.stat(".")  # a struct sequence with fields beyond its sequence
    stat_like = type(stat)((*stat[:6], rows(5), *stat[7:]), {"st_mtime_ns": 123})
    batch = {
        "max": torch.max(rows(5, 3), dim=1),
        "plain": plain,
        "fields": Fields(rows(5, 2), rows(5)),
        "items": Items([rows(5), 2]),
        "stat": stat_like,
        "keywords": Keywords(x=rows(5), name="a"),
        "proxy": MappingProxyType({"x": rows(5)}),
        "store": Store({"x": rows(5), "y": 1}),
        "filled": Filled(),
    }
    batch["filled"]["x"] = rows(5, 4)
    split = Split((batch,), {}, 0, "test")
    begin = 0
    for (piece,), _, n in split.pieces(2):
        end = begin + n
        assert {key: type(value) for key, value in piece.items()} == {key: type(value) for key, value in batch.items()}
        assert torch.equal(piece["max"].values, batch["max"].values[begin:end])
        assert torch.equal(piece["max"].indices, batch["max"].indices[begin:end])
        assert torch.equal(piece["plain"][0], rows(5)[begin:end])
        assert piece["plain"][1] == "text"
        assert piece["plain"].tag == "kept"
        assert torch.equal(piece["fields"][1], rows(5)[begin:end])
        assert piece["items"][1] == 2
        assert torch.equal(piece["stat"][6], rows(5)[begin:end])
        assert piece["stat"].st_mtime_ns == 123
        assert piece["keywords"]["name"] == "a"
        for key in ("keywords", "proxy", "store"):
            assert torch.equal(piece[key]["x"], rows(5)[begin:end])
        assert torch.equal(piece["filled"]["x"], rows(5, 4)[begin:end])
        begin = end
    # The caller's containers are untouched: the store's storage was not shared with a copy.
    assert batch["store"]["x"].shape == batch["filled"]["x"].shape[:1] == (5,)


def test_a_struct_sequence_s_tensors_are_named_by_field() -> None:
    with pytest.raises(ValueError, match=r"the tensor args\[0\]\.values has 4, the tensor args\[1\] has 3"):
        Split((torch.max(rows(4, 2), dim=1), rows(3)), {}, 0, "test")


@pytest.mark.parametrize(
    ("batch", "says"),
    [
        (Sealed(first=rows(4), second=rows(4)), r"a Sealed, and cannot remake a Sealed: it is a tuple subclass"),
        (Pairs(["x"], [rows(4)]), r"a Pairs, and cannot remake a Pairs: it is a read-only Mapping"),
    ],
    ids=["tuple", "mapping"],
)
def test_a_container_that_cannot_be_remade_is_refused_as_it_is_found(batch: Any, says: str) -> None:
    # Refused whether or not a slice is ever made: the walk alone raises.
    with pytest.raises(TypeError, match=rf"test splits the tensors in batch\[1\], {says}") as error:
        Split(([3, batch],), {}, 0, "test", lambda batch: None)
    assert "checked on every call, split or not" in str(error.value)
    # A container without tensors passes as it is, whatever it is.
    split = Split((rows(4), Sealed(first=1, second=2)), {}, 0, "test")
    assert split.chunk(0, 2)[0][1] == (1, 2)


def test_tensors_along_a_negative_dim() -> None:
    split = Split(({"x": rows(2, 6)},), {}, -1, "test")
    assert split.rows == 6
    (first, _, n), *_ = split.pieces(4)
    assert first[0]["x"].shape == (2, 4)
    assert n == 4


@dataclasses.dataclass
class Two:
    first: Any
    second: Any


# Every kind of container that holds two items, made from them.
PAIRS: dict[str, Any] = {
    "tuple": lambda a, b: (a, b),
    "plain": lambda a, b: Plain((a, b)),
    "fields": Fields,
    "items": lambda a, b: Items([a, b], scale=2.0),
    "structseq": lambda a, b: torch.return_types.max((a, b)),
    "named": Pair,
    "keywords": lambda a, b: Keywords(a=a, b=b),
    "proxy": lambda a, b: MappingProxyType({"a": a, "b": b}),
    "store": lambda a, b: Store({"a": a, "b": b}),
    "encoding": lambda a, b: Encoding({"a": a, "b": b}, encodings="kept"),
    "ordered": lambda a, b: OrderedDict(a=a, b=b),
    "dataclass": Two,
    "frozen": lambda a, b: Frozen(a, b),
}


@dataclasses.dataclass(frozen=True)
class Container:
    kind: str
    first: Any
    second: Any


nested = st.recursive(
    st.sampled_from(["row", "one", "scalar", "text"]),
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.dictionaries(st.sampled_from("abc"), children, max_size=3),
        st.builds(Container, st.sampled_from(sorted(PAIRS)), children, children),
    ),
    max_leaves=8,
)


def materialise(shape: Any, n: int, counter: list[int]) -> Any:
    if shape == "row":
        counter[0] += 1
        return torch.arange(n * 2.0).reshape(n, 2) + counter[0]
    if shape == "one":
        return torch.ones(1, 3)
    if shape == "scalar":
        return torch.tensor(3.0)
    if shape == "text":
        return "text"
    if isinstance(shape, list):
        return [materialise(item, n, counter) for item in shape]
    if isinstance(shape, Container):
        return PAIRS[shape.kind](materialise(shape.first, n, counter), materialise(shape.second, n, counter))
    return {key: materialise(value, n, counter) for key, value in shape.items()}


def parts(value: Any) -> list[tuple[Any, Any]] | None:
    """Return a container's items by key, or ``None`` for anything else."""
    if isinstance(value, Mapping):
        return list(value.items())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [(field.name, getattr(value, field.name)) for field in dataclasses.fields(value)]
    if isinstance(value, (list, tuple)):
        return list(enumerate(value))
    return None


def per_row(value: Any, n: int, depth: int) -> bool:
    """Return whether ``value`` is a list of records, or of strings or words inside an argument, one per row.

    ``depth``: 1 for an argument, more inside one; the outermost such list wins.
    """
    if type(value) not in (list, tuple) or len(value) != n or n < 2:
        return False
    # Strings, or a row's words (a list of strings, empty too): what a collate makes of a text field.
    words = all(
        isinstance(item, str) or (type(item) in (list, tuple) and all(type(w) is str for w in item)) for item in value
    )
    return all(isinstance(item, Mapping) for item in value) or (depth > 1 and words)


def check_slice(piece: Any, whole: Any, begin: int, end: int, n: int, depth: int = 0) -> None:
    """Check that ``piece`` is ``whole`` with the rows ``[begin, end)`` of the tensors that have ``n``."""
    if per_row(whole, n, depth):  # each piece gets its rows' records, as they are
        assert type(piece) is type(whole)
        assert len(piece) == end - begin
        assert all(got is want for got, want in zip(piece, whole[begin:end], strict=True))
        return
    if isinstance(whole, torch.Tensor):
        if whole.dim() and whole.size(0) == n:
            assert torch.equal(piece, whole[begin:end])
        else:
            assert piece is whole  # broadcasts: passed whole
        return
    expected = parts(whole)
    if expected is None:
        assert piece is whole
        return
    assert type(piece) is type(whole)
    found = parts(piece)
    assert found is not None
    assert [key for key, _ in found] == [key for key, _ in expected]
    for (_, item), (_, whole_item) in zip(found, expected, strict=True):
        check_slice(item, whole_item, begin, end, n, depth + 1)


def leaves(value: Any, n: int = 0, like: Any = None, depth: int = 0) -> list[Any]:
    """Return the leaves of ``value``; with ``n``, a list per row (in ``like``, the whole) is one leaf."""
    like = value if like is None else like
    found = None if n and per_row(like, n, depth) else parts(value)
    if found is None:
        return [value]
    shape = parts(like) or []
    pairs = zip(found, shape, strict=True)
    return [leaf for (_, item), (_, whole) in pairs for leaf in leaves(item, n, whole, depth + 1)]


@given(shape=nested, n=st.integers(2, 9), size=st.integers(1, 10))
def test_slices_are_the_arguments_rows_in_the_same_containers(shape: Any, n: int, size: int) -> None:
    batch = [materialise(shape, n, [0]), rows(n)]  # always one tensor with rows
    before = [(leaf, leaf.shape if isinstance(leaf, torch.Tensor) else None) for leaf in leaves(batch)]
    split = Split(tuple(batch), {}, 0, "test")
    pieces = list(split.pieces(size))
    assert [count for _, _, count in pieces] == [min(size, n - begin) for begin in range(0, n, size)]
    begin = 0
    for args, kwargs, count in pieces:
        assert kwargs == {}
        check_slice(args, batch, begin, begin + count, n)
        begin += count
    # Put back together, the slices are the arguments; the arguments themselves are untouched.
    assert [(leaf, getattr(leaf, "shape", None)) for leaf in leaves(batch)] == before
    chunks = [leaves(list(args), n, batch) for args, _, _ in pieces]
    for index, whole in enumerate(leaves(batch, n)):
        column = [chunk[index] for chunk in chunks]
        if isinstance(whole, torch.Tensor) and whole.dim() and whole.size(0) == n:
            assert torch.equal(torch.cat(column), whole)
        elif isinstance(whole, (list, tuple)) and column[0] is not whole:  # per row: each piece its rows'
            assert [item for piece in column for item in piece] == list(whole)
        else:
            assert all(item is whole for item in column)


# --- the front ends ---------------------------------------------------------------


def test_chunked_splits_a_dict_and_a_dataclass() -> None:
    batch = {"x": rows(10, 2), "meta": {"offset": torch.tensor(1.0)}}
    frozen = Frozen(rows(10, 2))
    calls: list[int] = []

    def fn(batch: dict[str, Any], frozen: Frozen) -> torch.Tensor:
        calls.append(batch["x"].shape[0])
        return batch["x"] + frozen.pixels + batch["meta"]["offset"]

    result = koila.chunked(fn, batch, frozen, initial=4)
    assert torch.equal(result, rows(10, 2) * 2 + 1)
    assert calls == [4, 4, 2]


def test_accumulate_with_a_dict_batch_gives_the_whole_batch_gradient() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1).double()
    batch = Encoding({"inputs": torch.randn(10, 3, dtype=torch.float64), "targets": torch.randn(10, 1).double()})

    def loss(batch: Encoding) -> torch.Tensor:
        assert type(batch) is Encoding
        return torch.nn.functional.mse_loss(model(batch.inputs), batch.targets)

    loss(batch).backward()
    expected = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()
    step = koila.accumulate(loss, initial=4)
    step(batch)
    assert step.stats.batch_size == 4
    for parameter, grad in zip(model.parameters(), expected):
        torch.testing.assert_close(parameter.grad, grad, rtol=1e-12, atol=1e-12)


def test_estimate_of_a_dict_batch_equals_the_flat_one() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    x, y = torch.randn(8, 16), torch.randn(8, 1)

    def flat(x: torch.Tensor, y: torch.Tensor) -> None:
        torch.nn.functional.mse_loss(model(x), y).backward()

    def nested(batch: dict[str, Any]) -> None:
        flat(batch["x"], batch["pair"][0])

    a = koila.estimate(flat, x, y)
    b = koila.estimate(nested, {"x": x, "pair": (y,)})
    assert [a.peak(n) for n in (1, 8, 100)] == [b.peak(n) for n in (1, 8, 100)]


def test_suggest_batch_size_takes_a_dict_batch() -> None:
    model = torch.nn.Linear(64, 64)

    def forward(batch: dict[str, Any]) -> torch.Tensor:
        return model(batch["x"]) * batch["scale"]

    batch = {"x": torch.randn(4, 64), "scale": torch.tensor(2.0)}
    flat = koila.suggest_batch_size(lambda x: model(x) * 2.0, batch["x"], budget="1MiB", margin=0)
    assert koila.suggest_batch_size(forward, batch, budget="1MiB", margin=0) == flat


# Containers of a batch's inputs and targets, each of a kind that was once split as a
# list and failed to go back together.
BATCHES: dict[str, Any] = {
    "structseq": lambda x, y: torch.return_types.max((x, y)),
    "plain": lambda x, y: Plain((x, y)),
    "fields": Fields,
    "items": lambda x, y: Items([x, y]),
    "keywords": lambda x, y: Keywords(inputs=x, targets=y),
    "store": lambda x, y: Store({"inputs": x, "targets": y}),
}


def parted(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return (batch["inputs"], batch["targets"]) if isinstance(batch, Mapping) else (batch[0], batch[1])


@pytest.mark.parametrize("kind", sorted(BATCHES))
def test_accumulate_splits_every_container_and_gives_the_whole_batch_gradient(kind: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1).double()
    x, y = torch.randn(10, 3, dtype=torch.float64), torch.randn(10, 1, dtype=torch.float64)
    batch = BATCHES[kind](x, y)
    seen: list[type] = []

    def loss(batch: Any) -> torch.Tensor:
        seen.append(type(batch))
        inputs, targets = parted(batch)
        return torch.nn.functional.mse_loss(model(inputs), targets)

    loss(batch).backward()
    expected = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()
    step = koila.accumulate(loss, initial=4)
    step(batch)
    assert step.stats.batch_size == 4
    assert seen == [type(batch)] * 4  # the call above, then three micro-batches of the batch's type
    assert parted(batch)[0] is x  # the caller's batch is untouched
    for parameter, grad in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(parameter.grad, grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", sorted(BATCHES))
def test_chunked_splits_every_container(kind: str) -> None:
    batch = BATCHES[kind](rows(10, 2), rows(10))
    seen: list[type] = []

    def fn(batch: Any) -> torch.Tensor:
        seen.append(type(batch))
        inputs, targets = parted(batch)
        return inputs.sum(dim=1) + targets

    result = koila.chunked(fn, batch, initial=4)
    assert torch.equal(result, rows(10, 2).sum(dim=1) + rows(10))
    assert seen == [type(batch)] * 3
    assert parted(batch)[0].shape == (10, 2)  # the caller's batch is untouched


@pytest.mark.parametrize("kind", sorted(BATCHES))
def test_estimate_of_every_container_equals_the_flat_one(kind: str) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    x, y = torch.randn(8, 16), torch.randn(8, 1)

    def flat(x: torch.Tensor, y: torch.Tensor) -> None:
        torch.nn.functional.mse_loss(model(x), y).backward()

    def nested(batch: Any) -> None:
        flat(*parted(batch))

    a = koila.estimate(flat, x, y)
    b = koila.estimate(nested, BATCHES[kind](x, y))
    assert [a.peak(n) for n in (1, 8, 100)] == [b.peak(n) for n in (1, 8, 100)]


@pytest.mark.parametrize("front_end", ["accumulate", "chunked", "estimate"])
@pytest.mark.parametrize(
    "make", [lambda x: Sealed(first=x, second=x), lambda x: Pairs(["x"], [x])], ids=["tuple", "map"]
)
def test_a_container_that_cannot_be_remade_fails_every_call_even_one_that_is_not_split(
    front_end: str, make: Callable[[torch.Tensor], Any]
) -> None:
    batch = make(rows(4, 2))
    calls: list[int] = []

    def fn(batch: Any) -> torch.Tensor:
        calls.append(1)
        return rows(4, 2).sum()

    run: dict[str, Callable[[], object]] = {
        "accumulate": lambda: koila.accumulate(fn, initial=None)(batch),  # the whole batch at once
        "chunked": lambda: koila.chunked(fn, batch, initial=16),  # one chunk holds every row
        "estimate": lambda: koila.estimate(fn, batch),
    }
    name = type(batch).__name__
    for _ in range(2):
        with pytest.raises(TypeError, match=rf"koila\.{front_end} splits the tensors in batch, a {name}, and cannot"):
            run[front_end]()
    assert calls == []  # refused before anything ran


def test_results_that_are_tuple_subclasses_come_back_as_their_types_when_split() -> None:
    def fn(x: torch.Tensor) -> Any:
        doubled = Plain((x * 2, torch.max(x, dim=1)))
        doubled.tag = "kept"  # type: ignore[attr-defined]
        return {"doubled": doubled, "fields": Fields(x, x.sum(dim=1)), "items": Items([x])}

    x = rows(10, 3)
    result = koila.chunked(fn, x, initial=4)
    expected = fn(x)
    assert type(result["doubled"]) is Plain
    assert result["doubled"].tag == "kept"
    assert type(result["doubled"][1]) is torch.return_types.max
    torch.testing.assert_close(result["doubled"][1].indices, expected["doubled"][1].indices)
    assert type(result["fields"]) is Fields
    assert type(result["items"]) is Items
    torch.testing.assert_close(result["fields"][1], expected["fields"][1])
    torch.testing.assert_close(result["items"][0], x)


def test_a_step_that_returns_a_tuple_subclass_gets_it_back_when_split() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).double()
    x = torch.randn(10, 3, dtype=torch.float64)

    def loss(x: torch.Tensor) -> Plain:
        out = model(x)
        return Plain((out.pow(2).mean(), torch.max(out, dim=1)))

    whole = loss(x)
    step = koila.accumulate(loss, initial=4)
    result = step(x)
    assert step.stats.batch_size == 4
    assert type(result) is Plain
    assert type(result[1]) is torch.return_types.max
    torch.testing.assert_close(result[0], whole[0].detach())
    torch.testing.assert_close(result[1].values, whole[1].values.detach())
    torch.testing.assert_close(result[1].indices, whole[1].indices)


@given(
    shapes=st.lists(st.lists(st.integers(0, 3), max_size=3), min_size=1, max_size=4),
    dim=st.integers(-2, 2),
    half=st.booleans(),
)
def test_tensor_arguments_by_position_split_as_by_keyword(shapes: list[list[int]], dim: int, half: bool) -> None:
    # Tensors by position take a shorter way than by keyword or in containers: the same split, or the same refusal.
    tensors = [
        torch.zeros(shape, dtype=torch.float16 if half and i else torch.float32) for i, shape in enumerate(shapes)
    ]
    names = [f"t{i}" for i in range(len(tensors))]
    made: list[Split | str] = []
    for args, kwargs in ((tuple(tensors), {}), ((), dict(zip(names, tensors, strict=True)))):
        try:
            made.append(Split(args, kwargs, dim, "test"))
        except ValueError as error:
            made.append(type(error).__name__)
    by_position, by_keyword = made
    if isinstance(by_position, str) or isinstance(by_keyword, str):
        assert by_position == by_keyword
        return
    assert (by_position.rows, by_position.split) == (by_keyword.rows, by_keyword.split)
    assert (by_position.sample, by_position.per_sample) == (by_keyword.sample, by_keyword.per_sample)
    assert by_position.device == by_keyword.device
    assert all(mine is theirs for mine, theirs in zip(by_position.tensors, by_keyword.tensors, strict=True))
    end = min(by_position.rows, 1)
    positional, _ = by_position.chunk(0, end)
    _, named = by_keyword.chunk(0, end)
    assert [tensor.shape for tensor in positional] == [named[name].shape for name in names]


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_a_sparse_coo_tensor_is_split_by_rows_along_any_dim(dim: int) -> None:
    """A sparse tensor has no views: each slice is a copy of its rows (``narrow_copy``), by ``pieces`` and ``chunk``."""
    generator = torch.Generator().manual_seed(0)
    dense = torch.randn(7, 5, generator=generator)
    dense[dense < 0.3] = 0
    sparse = dense.to_sparse()
    split = Split((sparse, dense), {}, dim, "koila.chunked")
    rows = dense.shape[dim]
    pieces = list(split.pieces(3))
    assert [count for _, _, count in pieces] == [min(3, rows - begin) for begin in range(0, rows, 3)]
    for number, (args, _, count) in enumerate(pieces):
        assert args[0].layout is torch.sparse_coo
        expected = dense.narrow(dim, number * 3, count)
        assert torch.equal(args[0].to_dense(), expected)
        assert torch.equal(args[1], expected)
    args, _ = split.chunk(2, 5)
    assert torch.equal(args[0].to_dense(), dense.narrow(dim, 2, 3))


def test_chunked_and_accumulate_split_a_sparse_coo_input() -> None:
    torch.manual_seed(0)
    dense = torch.randn(10, 3)
    dense[dense < 0.3] = 0
    layer = torch.nn.Linear(3, 2)
    joined = koila.chunked(
        lambda rows: torch.sparse.mm(rows, layer.weight.t()) + layer.bias, dense.to_sparse(), initial=4
    )
    torch.testing.assert_close(joined, layer(dense))

    y = torch.randn(10, 2)

    @koila.accumulate(initial=4)
    def step(rows: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(torch.sparse.mm(rows, layer.weight.t()) + layer.bias, y)

    step(dense.to_sparse(), y)
    assert step.stats.batch_size == 4
    got = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    torch.nn.functional.mse_loss(layer(dense), y).backward()
    for mine, expected in zip(got, [p.grad for p in layer.parameters()], strict=True):
        torch.testing.assert_close(mine, expected)


def test_a_sparse_coo_tensor_of_integers_is_split_after_an_out_of_memory_error() -> None:
    # Bag-of-words counts: the look for ignored labels (-100) among the batch's integers has no sparse amin.
    torch.manual_seed(0)
    counts = (torch.rand(10, 6) < 0.4).long() * torch.randint(1, 4, (10, 6))
    y = torch.randint(0, 2, (10,))
    layer = torch.nn.Linear(6, 2).double()
    fits = oom_above(4)

    @koila.accumulate
    def step(bow: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        fits(len(y))
        return torch.nn.functional.cross_entropy(layer(bow.to_dense().double()), y)

    step(counts.to_sparse(), y)
    assert step.stats.batch_size == 4
    got = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    torch.nn.functional.cross_entropy(layer(counts.double()), y).backward()
    for mine, expected in zip(got, [p.grad for p in layer.parameters()], strict=True):
        torch.testing.assert_close(mine, expected)


def test_a_sparse_coo_boolean_of_the_whole_micro_batch_is_joined_as_whether_any_was_true() -> None:
    torch.manual_seed(0)
    counts, y = (torch.rand(10, 6) < 0.2).long(), torch.randint(0, 2, (10,))
    counts[7, 5] = 1  # a word only the last micro-batch sees
    layer = torch.nn.Linear(6, 2)

    @koila.accumulate(initial=4)
    def step(bow: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        seen = (bow.sum(0) > 0).to_sparse()
        return {"loss": torch.nn.functional.cross_entropy(layer(bow.float()), y), "seen": seen}

    seen = step(counts, y)["seen"]
    assert step.stats.batch_size == 4
    assert seen.layout is torch.sparse_coo
    assert seen.dtype is torch.bool
    assert torch.equal(seen.to_dense(), counts.sum(0) > 0)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")
@pytest.mark.parametrize("dtype", [torch.bool, torch.int64])
def test_a_sparse_csr_value_beside_the_loss_that_cannot_be_added_up_is_refused_by_layout(dtype: torch.dtype) -> None:
    layer = torch.nn.Linear(6, 2)
    x, y = torch.rand(8, 6), torch.randint(0, 2, (8,))
    before = [p.grad for p in layer.parameters()]

    @koila.accumulate(initial=4)
    def step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seen = (x.sum(0, keepdim=True) > 0.5).to(dtype).to_sparse_csr()
        return torch.nn.functional.cross_entropy(layer(x), y), seen

    with pytest.raises(
        ValueError, match=r"^a sparse_csr tensor of torch\.\w+ returned beside the loss cannot be added"
    ):
        step(x, y)
    assert [p.grad for p in layer.parameters()] == before


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("layout", [torch.jagged, torch.strided], ids=["jagged", "strided"])
def test_a_nested_tensor_to_split_is_refused_with_what_to_pass_instead(layout: torch.layout) -> None:
    rows = torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(4, 3), torch.ones(1, 3)], layout=layout)
    # Only advice that works: a list of ragged tensors was suggested, which a split refuses (probe 61A).
    with pytest.raises(ValueError, match=r"cannot split a nested tensor: .*to_padded_tensor\) with a mask$"):
        koila.chunked(lambda part: part, rows, initial=2)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")
def test_a_tensor_of_another_layout_is_refused_by_its_layout_and_a_sparse_result_by_its_place() -> None:
    compressed = torch.eye(6).to_sparse_csr()
    with pytest.raises(ValueError, match="cannot split a tensor of layout torch.sparse_csr along dim 0"):
        koila.chunked(lambda rows: rows.to_dense(), compressed, initial=4)
    with pytest.raises(ValueError, match=r"layout torch.sparse_coo at the result\['out'\]: .* Return it dense"):
        koila.chunked(lambda rows: {"out": rows * 2}, torch.eye(6).to_sparse(), initial=4)


# --- lists of records: one mapping per row (a detection batch's targets) ------------------


def detection_batch(boxes: list[int], seed: int = 0) -> dict[str, Any]:
    """Images and, per image, a dict of its boxes: as Hugging Face's DETR and YOLOS take their labels."""
    generator = torch.Generator().manual_seed(seed)
    labels = [
        {
            "class_labels": torch.randint(0, 3, (count,), generator=generator),
            "boxes": torch.rand(count, 4, generator=generator),
        }
        for count in boxes
    ]
    return {"pixel_values": torch.randn(len(boxes), 6, generator=generator, dtype=torch.float64), "labels": labels}


def detection_loss(model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """A mean over images of each image's loss against its own targets, paired by position as DETR pairs them."""
    predicted = model(batch["pixel_values"])
    assert len(batch["labels"]) == len(predicted)
    losses = [
        ((box - target["boxes"].double()) ** 2).mean() + 0.1 * target["class_labels"].double().sum() * box.sum()
        for box, target in zip(predicted.view(-1, 1, 4), batch["labels"])
    ]
    return torch.stack(losses).mean()


@pytest.mark.parametrize("boxes", [[1] * 8, [2, 1, 3, 1, 8, 2, 1, 4], [3, 3, 3, 3, 3, 3, 3, 3]])
def test_a_list_of_one_mapping_per_row_is_split_with_the_rows(boxes: list[int]) -> None:
    # One box per image made every target pass whole to every micro-batch (one row broadcasts); other counts
    # were refused as ambiguous; three boxes each would have been split along the boxes.
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4).double()
    batch = detection_batch(boxes)
    detection_loss(model, batch).backward()
    expected = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()
    seen: list[list[int]] = []

    @koila.accumulate(initial=2)
    def step(batch: dict[str, Any]) -> torch.Tensor:
        seen.append([len(target["boxes"]) for target in batch["labels"]])
        return detection_loss(model, batch)

    step(batch)
    assert seen == [boxes[begin : begin + 2] for begin in range(0, 8, 2)]
    for parameter, grad in zip(model.parameters(), expected):
        torch.testing.assert_close(parameter.grad, grad, rtol=1e-12, atol=1e-12)
    assert type(batch["labels"]) is list
    assert len(batch["labels"]) == 8


def test_a_step_over_records_that_runs_out_of_memory_gives_the_whole_batch_gradient() -> None:
    from koila_retry.testing import oom_above

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4).double()
    batch = detection_batch([2, 1, 3, 1, 8, 2, 1, 4])
    detection_loss(model, batch).backward()
    expected = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()

    inject = oom_above(2)  # more than two images do not fit

    @koila.accumulate
    def step(batch: dict[str, Any]) -> torch.Tensor:
        inject(len(batch["pixel_values"]))
        return detection_loss(model, batch)

    # The second batch, with other numbers of boxes, meets the size the first settled on.
    for number, each in enumerate([batch, detection_batch([5, 1, 1, 2, 2, 7, 1, 1], seed=1)]):
        step(each)
        if number == 0:
            for parameter, grad in zip(model.parameters(), expected):
                torch.testing.assert_close(parameter.grad, grad, rtol=1e-12, atol=1e-12)
    assert step.stats.ooms == 2
    assert step.stats.batch_size == 2


def test_records_as_a_tuple_or_inside_a_record_and_chunks_of_them() -> None:
    images = torch.arange(6.0).view(6, 1)
    targets = tuple(
        {"id": torch.tensor([index]), "parts": [{"a": torch.zeros(1)}, {"b": torch.ones(2)}]} for index in range(6)
    )
    got: list[Any] = []

    def fn(images: torch.Tensor, targets: tuple[dict[str, Any], ...]) -> torch.Tensor:
        got.append(targets)
        return images[:, 0] + torch.cat([target["id"] for target in targets])

    result = koila.chunked(fn, images, targets, initial=4)
    assert torch.equal(result, torch.arange(6.0) * 2)
    assert [type(piece) for piece in got] == [tuple, tuple]
    assert [[target["id"].item() for target in piece] for piece in got] == [[0, 1, 2, 3], [4, 5]]
    assert got[0][0] is targets[0]  # records pass as they are; a list of two records inside one is not per row
    split = Split((images, targets), {}, 0, "test")
    assert split.rows == 6
    assert split.split == [0]


def test_records_without_tensors_are_split_with_the_rows_as_records_with_them() -> None:
    """Records of plain values (ids, per-row scales) went whole to every piece, which zip paired with other rows."""
    rows = torch.arange(1.0, 9.0, dtype=torch.float64).unsqueeze(1)
    scales = [{"scale": float(index + 1), "name": f"row {index}"} for index in range(8)]
    ids = tuple({"id": index} for index in range(8))  # a second list of records beside the first, a tuple
    got: list[tuple[int, list[str], list[int]]] = []

    def scaled(x: torch.Tensor, records: list[dict[str, Any]], ids: tuple[dict[str, int], ...]) -> torch.Tensor:
        got.append((len(x), [record["name"] for record in records], [each["id"] for each in ids]))
        return torch.stack([row * record["scale"] for row, record in zip(x, records)])

    expected = scaled(rows, scales, ids)
    got.clear()
    assert torch.equal(koila.chunked(scaled, rows, scales, ids, initial=3), expected)
    assert got == [
        (3, ["row 0", "row 1", "row 2"], [0, 1, 2]),
        (3, ["row 3", "row 4", "row 5"], [3, 4, 5]),
        (2, ["row 6", "row 7"], [6, 7]),
    ]
    split = Split((rows, scales, ids), {}, 0, "test")
    assert (split.rows, split.split) == (8, [0])

    # Through accumulate, the per-row scales weigh each micro-batch's rows: the whole batch's gradient.
    weight = torch.ones(1, dtype=torch.float64, requires_grad=True)

    def loss(x: torch.Tensor, records: list[dict[str, Any]]) -> torch.Tensor:
        return (x[:, 0] * weight * torch.tensor([record["scale"] for record in records])).pow(2).mean()

    loss(rows, scales).backward()
    whole = weight.grad.clone()  # type: ignore[union-attr]
    weight.grad = None
    koila.accumulate(loss, initial=2)(rows, scales)
    torch.testing.assert_close(weight.grad, whole, rtol=1e-12, atol=1e-12)


def test_strings_one_per_row_in_a_batch_are_split_with_the_rows() -> None:
    """A collated string field (file names, texts) went whole to every piece, which zip paired with other rows."""
    rows = torch.arange(1.0, 9.0, dtype=torch.float64).unsqueeze(1)
    names = [f"image {index}.png" for index in range(8)]
    tags = tuple("ab"[index % 2] for index in range(8))  # a tuple of them, beside the list
    labels = ["cat", "dog"]  # two strings: not one per row, passed whole
    batch = {"x": rows, "names": names, "tags": tags, "labels": labels}  # as default_collate makes it
    got: list[tuple[list[str], tuple[str, ...], list[str]]] = []

    def scaled(batch: dict[str, Any]) -> torch.Tensor:
        got.append((batch["names"], batch["tags"], batch["labels"]))
        pairs = zip(batch["x"], batch["names"], strict=True)
        return torch.stack([row * float(name.split()[1][0]) for row, name in pairs])

    expected = scaled(batch)
    got.clear()
    assert torch.equal(koila.chunked(scaled, batch, initial=4), expected)
    assert got == [(names[:4], tags[:4], labels), (names[4:], tags[4:], labels)]
    mixed = ["a", 1, "c", "d", "e", "f", "g", "h"]  # not all strings (nor None): passes whole, as before
    assert next(Split(({"x": rows, "mixed": mixed},), {}, 0, "test").pieces(4))[0][0]["mixed"] is mixed

    # Through accumulate: each micro-batch's rows weighed by their own names' numbers.
    weight = torch.ones(1, dtype=torch.float64, requires_grad=True)

    def loss(batch: dict[str, Any]) -> torch.Tensor:
        scale = torch.tensor([float(name.split()[1][0]) for name in batch["names"]], dtype=torch.float64)
        return (batch["x"][:, 0] * weight * scale).pow(2).mean()

    loss(batch).backward()
    whole = weight.grad.clone()  # type: ignore[union-attr]
    weight.grad = None
    koila.accumulate(loss, initial=2)(batch)
    torch.testing.assert_close(weight.grad, whole, rtol=1e-12, atol=1e-12)


def test_strings_given_as_an_argument_of_their_own_pass_whole_whatever_their_length() -> None:
    # Class prompts scored against every row: split where their count met the rows, each chunk was
    # scored against some of the classes, and the pieces joined into a result of the wrong width.
    prompts = ["a cat", "a dog", "a bird", "a fish"]
    classes = torch.arange(1.0, 5.0, dtype=torch.float64)

    def scores(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        return images * classes[: len(prompts)]

    for rows in (3, 4, 5):
        images = torch.ones(rows, 1, dtype=torch.float64)
        torch.testing.assert_close(koila.chunked(scores, images, prompts, initial=2), scores(images, prompts))


def test_a_list_of_mappings_that_is_not_one_per_row_is_a_container_as_before() -> None:
    # Two tasks' batches of 4 rows each: the list has 2 items, the rows are 4.
    batch = [{"x": torch.arange(4.0)}, {"x": torch.arange(4.0) * 10}]
    got: list[Any] = []

    def fn(batch: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        got.append(batch)
        return batch[0]["x"] + batch[1]["x"]

    assert torch.equal(koila.chunked(fn, batch, initial=2), torch.arange(4.0) * 11)
    assert [[len(part["x"]) for part in piece] for piece in got] == [[2, 2], [2, 2]]
    with pytest.raises(ValueError, match=r"args\[0\]\[1\]\['x'\] has 3"):
        Split(([{"x": torch.zeros(4)}, {"x": torch.zeros(3)}],), {}, 0, "test")


def test_records_are_left_out_of_the_key_and_taken_again_for_a_larger_estimate() -> None:
    few, many = (
        Split((detection_batch([1] * 8),), {}, 0, "test"),
        Split((detection_batch([9] * 8, seed=3),), {}, 0, "test"),
    )
    assert few.sample == many.sample
    args, _ = few.resized(11, lambda tensor, shape: torch.empty(shape, dtype=tensor.dtype, device="meta"))
    labels = args[0]["labels"]
    assert args[0]["pixel_values"].shape == (11, 6)
    assert len(labels) == 11
    assert all(label["boxes"].device.type == "meta" for label in labels)


# --- one image and its one dict of boxes; attributes beside items; per-row word lists; PackedSequence ---------


def boxes_loss(
    model: torch.nn.Module, pixel_values: torch.Tensor, labels: list[dict[str, torch.Tensor]]
) -> torch.Tensor:
    """A mean over images of each image's nearest box to its one predicted box (none: the prediction's size)."""
    predicted = model(pixel_values)
    assert len(labels) == len(predicted)
    losses = [
        (box - target["boxes"]).pow(2).sum(1).min() if len(target["boxes"]) else box.pow(2).sum()
        for box, target in zip(predicted, labels)
    ]
    return torch.stack(losses).mean()


@pytest.mark.parametrize("boxes", [5, 0])
def test_one_image_and_its_one_dict_of_boxes_are_one_row_and_one_record(boxes: int) -> None:
    # The boxes of the one image were taken for the rows: split across micro-batches (a wrong gradient),
    # and an image without boxes was refused as a batch of 0 rows.
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4).double()
    batch = detection_batch([boxes])
    pixel_values, labels = batch["pixel_values"], batch["labels"]
    boxes_loss(model, pixel_values, labels).backward()
    expected = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()
    seen: list[list[int]] = []

    @koila.accumulate(initial=2, cache=koila.NoCache())
    def step(pixel_values: torch.Tensor, labels: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        seen.append([len(target["boxes"]) for target in labels])
        return boxes_loss(model, pixel_values, labels)

    step(pixel_values, labels)
    assert seen == [[boxes]]
    for parameter, grad in zip(model.parameters(), expected):
        torch.testing.assert_close(parameter.grad, grad, rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        got = koila.chunked(lambda pixel_values, labels: model(pixel_values), pixel_values, labels, initial=2)
        torch.testing.assert_close(got, model(pixel_values))
    split = Split((pixel_values, labels), {}, 0, "test")
    assert (split.rows, split.split) == (1, [0])
    # With no tensor outside it, the list is a container as before: its tensors hold the rows.
    assert Split((labels,), {}, 0, "test").rows == boxes


def test_one_image_that_runs_out_of_memory_gives_up_rather_than_split_its_boxes() -> None:
    from koila_retry.testing import simulated_device

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4).double()

    def step(pixel_values: torch.Tensor, labels: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        predicted = model(pixel_values)
        losses = []
        for box, target in zip(predicted, labels):
            scratch = torch.zeros(len(target["boxes"]), 4096, dtype=torch.float64)  # 32 KiB a box: a matching cost
            losses.append(((box - target["boxes"]).pow(2).sum(1) + scratch.sum(1)).min())
        return torch.stack(losses).mean()

    batch = detection_batch([8])
    step(batch["pixel_values"], batch["labels"]).backward()  # the plain step, with the memory it needs
    assert model.weight.grad is not None
    model.zero_grad(set_to_none=True)
    stepped = koila.accumulate(step, cache=koila.NoCache())
    with simulated_device("200KiB"), pytest.raises(koila.BatchSizeExhausted):
        stepped(batch["pixel_values"], batch["labels"])
    assert model.weight.grad is None  # no micro-batch of some of the boxes ran its backward


class AttrDict(dict[str, Any]):
    """The common recipe whose attributes are its items."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.__dict__ = self


@dataclasses.dataclass
class Cached:
    tokens: torch.Tensor

    def __post_init__(self) -> None:
        self.mask = self.tokens != 0  # an attribute that is not a field, of one row per row
        self.scale = torch.tensor(0.5, dtype=torch.float64)  # 0-dimensional: passes whole

    @functools.cached_property
    def lengths(self) -> torch.Tensor:
        return self.mask.sum(1)


def test_an_attribute_dict_s_attributes_are_each_piece_s_items() -> None:
    # b.x held the whole batch in every micro-batch while b["x"] held its rows: nothing was saved.
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1).double()
    batch = AttrDict(x=torch.randn(6, 3, dtype=torch.float64), y=torch.randn(6, 1, dtype=torch.float64))
    seen: list[tuple[int, int, int]] = []

    def step(b: AttrDict) -> dict[str, torch.Tensor]:
        seen.append((len(b["x"]), len(b.x), len(b.y)))
        return {"loss": (model(b.x) - b.y).pow(2).mean(), "pred": model(b.x)}

    plain = step(batch)
    plain["loss"].backward()
    expected = model.weight.grad.clone()  # type: ignore[union-attr]
    model.zero_grad()
    seen.clear()
    result = koila.accumulate(step, initial=2, cache=koila.NoCache())(batch)
    assert seen == [(2, 2, 2)] * 3
    torch.testing.assert_close(model.weight.grad, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(result["pred"], plain["pred"].detach())
    with torch.no_grad():
        torch.testing.assert_close(koila.chunked(lambda b: model(b.x), batch, initial=4), model(batch.x))
    assert batch.__dict__ is batch  # the caller's is as it was
    assert len(batch.x) == 6


class ItemDict(dict[str, Any]):
    """The other common recipe: attribute reads are item reads, so a missing one raises KeyError."""

    __getattr__ = dict.__getitem__


class KeyedTuple(tuple[Any, ...]):
    def __getattr__(self, name: str) -> Any:
        raise KeyError(name)


@pytest.mark.parametrize("kind", ["ItemDict", "KeyedTuple"])
def test_batches_whose_getattr_raises_key_error_are_split(kind: str) -> None:
    """batches.py read _encodings and _fields with getattr(): KeyError '_encodings' once the step was split."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1).double()
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 1, dtype=torch.float64)
    (model(x) - y).pow(2).mean().backward()
    expected = model.weight.grad.clone()  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)
    batch: Any = ItemDict(x=x, y=y) if kind == "ItemDict" else KeyedTuple((x, y))
    sizes: list[int] = []

    def read(b: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return (b.x, b.y) if kind == "ItemDict" else (b[0], b[1])

    def step(b: Any) -> torch.Tensor:
        inputs, targets = read(b)
        sizes.append(len(inputs))
        return (model(inputs) - targets).pow(2).mean()

    koila.accumulate(step, initial=2, cache=koila.NoCache())(batch)
    assert sizes == [2, 2, 2]
    torch.testing.assert_close(model.weight.grad, expected, rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        torch.testing.assert_close(koila.chunked(lambda b: model(read(b)[0]), batch, initial=4), model(x))


def test_an_attribute_dict_fits_where_a_dict_does() -> None:
    from koila_retry.testing import simulated_device

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    x, y = torch.randn(256, 16), torch.randn(256, 1)
    sizes = []
    for make in (dict, AttrDict):

        @koila.accumulate(cache=koila.NoCache())
        def train(b: dict[str, torch.Tensor]) -> torch.Tensor:
            return (model(b["x"] if type(b) is dict else b.x) - y[: len(b["y"])]).pow(2).mean()

        with simulated_device("400KiB"):
            train(make(x=x, y=y))
        sizes.append(train.stats.batch_size)
    assert sizes[0] < 256
    assert sizes[1] == sizes[0]


def test_a_dataclass_s_attributes_beside_its_fields_are_each_piece_s() -> None:
    # A cached property read before the call, and an attribute set in __post_init__, kept the whole batch's
    # tensor in every piece: a size mismatch, or a silently wrong result.
    tokens = torch.tensor([[1, 2, 0], [3, 0, 0], [4, 5, 6], [7, 0, 0]], dtype=torch.float64)
    weight = torch.ones(1, dtype=torch.float64, requires_grad=True)

    def mean(b: Cached) -> torch.Tensor:
        assert len(b.mask) == len(b.lengths) == len(b.tokens)
        return b.tokens.sum(1) * b.scale / b.lengths * weight

    for read in (False, True):
        batch = Cached(tokens)
        if read:
            _ = batch.lengths  # read once before the call: a sampler, a log line
        expected = mean(batch)
        torch.testing.assert_close(koila.chunked(mean, batch, initial=2), expected.detach())
        expected.pow(2).mean().backward()
        whole = weight.grad.clone()  # type: ignore[union-attr]
        weight.grad = None
        koila.accumulate(lambda b: mean(b).pow(2).mean(), initial=3, cache=koila.NoCache())(batch)
        torch.testing.assert_close(weight.grad, whole, rtol=1e-12, atol=1e-12)
        weight.grad = None
        assert len(vars(batch)["lengths"]) == 4  # the caller's keeps the whole batch's
    split = Split((Cached(tokens),), {}, 0, "test")
    assert [tuple(tensor.shape) for tensor in split.tensors] == [(4, 3), (4, 3), ()]
    assert split.split == [0, 1]


@dataclasses.dataclass
class _Weighted:
    x: torch.Tensor
    labels: torch.Tensor

    def __post_init__(self) -> None:
        self.class_weights = torch.tensor([1.0, 2.0, 0.5, 4.0], dtype=torch.float64)  # one per class, not per row


def test_a_tensor_attribute_of_another_size_passes_whole_and_decides_no_rows() -> None:
    # The batch's own state beside its fields: refused as ambiguous for a while, where it had worked.
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).double()

    def loss_of(batch: _Weighted) -> torch.Tensor:
        logits = model(batch.x)
        return torch.nn.functional.cross_entropy(logits, batch.labels, weight=batch.class_weights, reduction="sum")

    batch = _Weighted(torch.randn(6, 8, dtype=torch.float64), torch.randint(0, 4, (6,)))
    loss_of(batch).backward()
    whole = model.weight.grad.clone()  # type: ignore[union-attr]
    model.zero_grad()
    koila.accumulate(loss_of, initial=2, reduction="sum", cache=koila.NoCache())(batch)
    torch.testing.assert_close(model.weight.grad, whole)
    split = Split((batch,), {}, 0, "test")
    assert (split.rows, split.split) == (6, [0, 1])
    alone = Split((_Weighted(torch.ones(1, 8), torch.ones(1)),), {}, 0, "test")  # one row: the attribute is whole
    assert (alone.rows, alone.split) == (1, [0, 1])


def test_words_and_names_with_one_missing_in_a_batch_are_split_with_the_rows() -> None:
    # A list of lists of strings (words tokenized before the batch) and names with a None among them
    # went whole to every piece, which zip paired with other rows.
    rows = 6
    batch = {
        "scores": torch.arange(1.0, rows + 1, dtype=torch.float64),
        "words": [[f"w{index}"] * (index + 1) for index in range(rows)],  # row 5 holds as many words as rows
        "names": [f"n{index}" if index != 2 else None for index in range(rows)],
    }
    weight = torch.ones(1, dtype=torch.float64, requires_grad=True)

    def scored(b: dict[str, Any]) -> dict[str, Any]:
        per_row = torch.stack([score * len(words) for score, words in zip(b["scores"], b["words"], strict=True)])
        return {"scores": per_row * weight, "names": [name for _, name in zip(b["scores"], b["names"], strict=True)]}

    expected = scored(batch)
    got = koila.chunked(scored, batch, initial=4)
    torch.testing.assert_close(got["scores"], expected["scores"].detach())
    assert got["names"] == expected["names"] == batch["names"]
    expected["scores"].pow(2).mean().backward()
    whole = weight.grad.clone()  # type: ignore[union-attr]
    weight.grad = None
    koila.accumulate(lambda b: scored(b)["scores"].pow(2).mean(), initial=4, cache=koila.NoCache())(batch)
    torch.testing.assert_close(weight.grad, whole, rtol=1e-12, atol=1e-12)


def test_words_given_as_an_argument_of_their_own_pass_whole() -> None:
    # A vocabulary of phrases scored against every row: the call's, whatever its length, and so are its phrases.
    phrases = [["a", "cat"], ["a", "dog"], ["a", "b", "c", "d"], ["x", "y", "z", "w"]]
    got: list[list[list[str]]] = []

    def scores(images: torch.Tensor, phrases: list[list[str]]) -> torch.Tensor:
        got.append(phrases)
        return images * sum(len(phrase) for phrase in phrases)

    images = torch.ones(4, 1, dtype=torch.float64)
    torch.testing.assert_close(koila.chunked(scores, images, phrases, initial=2), scores(images, phrases))
    assert all(piece is phrases for piece in got)


@pytest.mark.parametrize("lengths", [(4, 3, 3, 2, 1), (1, 1, 1, 1, 1)])
def test_a_packed_sequence_is_refused_on_every_call(lengths: tuple[int, ...]) -> None:
    # Walked as a named tuple, its data and batch sizes were taken for rows: an unrelated error, or (every
    # sequence of one step) a wrong split.
    from torch.nn.utils.rnn import pack_sequence

    rnn = torch.nn.GRU(2, 3)
    packed = pack_sequence([torch.randn(length, 2) for length in lengths])
    with torch.no_grad():
        rnn(packed)  # the plain call runs
        for initial in (None, 2):
            with pytest.raises(
                ValueError,
                match=r"cannot split the PackedSequence packed: .*\(torch\.nn\.utils\.rnn\.pack_padded_sequence\)",
            ):
                koila.chunked(lambda packed: rnn(packed)[1][0], packed, initial=initial)
    with pytest.raises(ValueError, match=r"the PackedSequence batch\['packed'\]"):
        koila.accumulate(lambda batch: rnn(batch["packed"])[1].sum(), cache=koila.NoCache())({"packed": packed})


def test_an_ambiguous_tensor_in_a_list_of_tensors_says_to_stack_them() -> None:
    images = [torch.randn(3, 8, 8) for _ in range(2)]
    targets = [{"boxes": torch.rand(5, 4)} for _ in range(2)]
    with pytest.raises(ValueError, match=r"has 5\. images is a list of tensors, .* stacked \(torch\.stack\)"):
        koila.chunked(lambda images, targets: images[0], images, targets)


def test_words_per_row_with_a_row_of_none_are_split_with_the_rows() -> None:
    # A row with no words (None) beside rows of words: the list passed whole to every piece.
    torch.manual_seed(0)
    linear = torch.nn.Linear(4, 3).double()
    batch = {
        "x": torch.randn(4, 4, dtype=torch.float64),
        "y": torch.tensor([0, 1, 2, 1]),
        "words": [None, ["a", "b"], ["c"], ["d", "e", "f"]],
    }

    def loss_of(b: dict[str, Any]) -> torch.Tensor:
        counts = [len(words or []) for words in b["words"]]
        assert len(counts) == len(b["x"])
        scale = torch.tensor(counts, dtype=torch.float64)
        return (torch.nn.functional.cross_entropy(linear(b["x"]), b["y"], reduction="none") * scale).mean()

    loss_of(batch).backward()
    whole = linear.weight.grad.clone()  # type: ignore[union-attr]
    linear.zero_grad()
    koila.accumulate(loss_of, initial=2, cache=koila.NoCache())(batch)
    torch.testing.assert_close(linear.weight.grad, whole)


class _Pair(tuple):  # type: ignore[type-arg]
    """A tuple subclass that keeps tuple.__new__: its attributes are copied to each piece."""


def test_a_tuple_subclass_s_tensor_attribute_is_split_as_a_list_subclass_s() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(4, 3).double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))

    def loss_of(b: Any) -> torch.Tensor:
        return (torch.nn.functional.cross_entropy(linear(b[0]), b[1], reduction="none") * b.weights).mean()

    for kind in (_Pair, _Listed):
        batch = kind((x, y))
        batch.weights = torch.linspace(1, 2, 6, dtype=torch.float64)
        loss_of(batch).backward()
        whole = linear.weight.grad.clone()  # type: ignore[union-attr]
        linear.zero_grad()
        koila.accumulate(loss_of, initial=2, cache=koila.NoCache())(batch)
        torch.testing.assert_close(linear.weight.grad, whole)
        linear.zero_grad()
        assert len(batch.weights) == 6  # the caller's keeps the whole batch's


class _Listed(list):  # type: ignore[type-arg]
    pass


def test_names_all_missing_are_split_as_names_some_missing() -> None:
    # A batch whose rows all lack a name passed the list whole: each piece got every row's None.
    x = torch.randn(8, 2)

    def scaled(batch: dict[str, Any]) -> torch.Tensor:
        assert len(batch["names"]) == len(batch["x"])
        return batch["x"] * torch.tensor([[1.0 if name is None else 2.0] for name in batch["names"]])

    for names in (["a"] + [None] * 7, [None] * 8):
        batch = {"x": x, "names": names}
        torch.testing.assert_close(koila.chunked(scaled, batch, initial=3), scaled(batch))


@dataclasses.dataclass
class _Steps:
    x: torch.Tensor  # (time, rows, features): split along dim 1

    def __post_init__(self) -> None:
        self.class_weights = torch.tensor([1.0, 2.0, 3.0])  # the instance's own, with no dim 1


def test_an_attribute_without_the_dim_passes_whole() -> None:
    batch = _Steps(torch.randn(5, 8, 2))

    def weighed(b: _Steps) -> torch.Tensor:
        return b.x * b.class_weights.sum()

    torch.testing.assert_close(koila.chunked(weighed, batch, dim=1, initial=4), weighed(batch))
    with pytest.raises(ValueError, match=r"dim 1 is out of range for the tensor weights of shape \(3,\)"):
        koila.chunked(lambda x, weights: x, batch.x, torch.ones(3), dim=1)  # an argument: refused as before


def test_a_value_per_row_one_dim_short_of_dim_is_told_how_to_reach_it() -> None:
    # A time-major batch's lengths, for pack_padded_sequence: the refusal said nothing of a way (probe 71G).
    steps, lengths = torch.randn(6, 4, 2), torch.tensor([6, 5, 3, 2])
    with pytest.raises(ValueError, match=r"give it a dim of size 1 in front \(of shape \(1, 4\), with \[None\]\)"):
        koila.chunked(lambda x, lengths: x, steps, lengths, dim=1)
    joined = koila.chunked(lambda x, lengths: x * lengths[0][None, :, None], steps, lengths[None], dim=1, initial=2)
    torch.testing.assert_close(joined, steps * lengths[None, :, None])
