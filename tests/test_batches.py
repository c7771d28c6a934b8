"""The one splitter of a call's arguments: tensors in containers, which are split, and the slices' containers."""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict, UserDict, defaultdict
from types import MappingProxyType
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import koila_retry as koila
from koila_retry._common.batches import DEPTH, Split


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


def test_tensors_along_a_negative_dim() -> None:
    split = Split(({"x": rows(2, 6)},), {}, -1, "test")
    assert split.rows == 6
    (first, _, n), *_ = split.pieces(4)
    assert first[0]["x"].shape == (2, 4)
    assert n == 4


nested = st.recursive(
    st.sampled_from(["row", "one", "scalar", "text"]),
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.dictionaries(st.sampled_from("abc"), children, max_size=3),
        st.tuples(children, children),
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
    if isinstance(shape, tuple):
        return tuple(materialise(item, n, counter) for item in shape)
    return {key: materialise(value, n, counter) for key, value in shape.items()}


def joined(pieces: list[Any], whole: Any, n: int) -> Any:
    """Put the slices back together: tensors with rows concatenated, what passed whole checked and kept."""
    if isinstance(whole, torch.Tensor):
        if whole.dim() and whole.size(0) == n:
            return torch.cat(pieces)
        assert all(piece is whole for piece in pieces)
        return whole
    if isinstance(whole, dict):
        return {key: joined([piece[key] for piece in pieces], value, n) for key, value in whole.items()}
    if isinstance(whole, (list, tuple)):
        return type(whole)(joined([piece[i] for piece in pieces], value, n) for i, value in enumerate(whole))
    assert all(piece == whole for piece in pieces)
    return whole


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


@given(shape=nested, n=st.integers(2, 9), size=st.integers(1, 10))
def test_slices_put_back_together_are_the_arguments(shape: Any, n: int, size: int) -> None:
    batch = [materialise(shape, n, [0]), rows(n)]  # always one tensor with rows
    split = Split(tuple(batch), {}, 0, "test")
    pieces = list(split.pieces(size))
    assert [count for _, _, count in pieces] == [min(size, n - begin) for begin in range(0, n, size)]
    assert same(joined([args for args, _, _ in pieces], batch, n), batch)


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
