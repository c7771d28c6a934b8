"""koila.chunked's results and out=: what is joined, what is refused, whatever the memory lets a chunk hold."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, cast

import pytest
import torch

import koila_retry as koila
from koila_retry._core import memory
from koila_retry.testing import oom_above, simulated_device

# Rows per chunk that memory allows: every row at once, and chunks of 4, 4, 2; 3, 3, 3, 1; and 2 each.
LIMITS = [None, 4, 3, 2]


@pytest.fixture
def fast_release(monkeypatch: pytest.MonkeyPatch) -> None:
    """Skip the full garbage collection after each OOM (the engine calls ``memory.release``)."""
    monkeypatch.setattr(memory, "release", lambda device=None: None)


def with_memory_for(fn: Callable[[torch.Tensor], Any], limit: int | None) -> Callable[[torch.Tensor], Any]:
    """Return ``fn``, run out of memory above ``limit`` rows (never, for ``None``)."""
    if limit is None:
        return fn
    fits = oom_above(limit)

    def short(rows: torch.Tensor) -> Any:
        fits(len(rows))
        return fn(rows)

    return short


def outcome(
    fn: Callable[[torch.Tensor], Any], x: torch.Tensor, limit: int | None
) -> tuple[tuple[type, str] | None, Any, list[str]]:
    """Call ``fn`` chunked with memory for ``limit`` rows: the error it raised, or what it returned, and warnings."""
    raised, result = None, None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = koila.chunked(with_memory_for(fn, limit), x, initial=16, cache=koila.NoCache())
        except Exception as error:  # compared: whether a call raises must not depend on memory
            raised = (type(error), str(error))
    return raised, result, [str(warning.message) for warning in caught if "one value per row" in str(warning.message)]


# --------------------------------------------------------------------------- nested results


def ragged(rows: torch.Tensor) -> torch.Tensor:
    """Each row's first few entries, without padding: a nested tensor of the default (strided) layout."""
    return torch.nested.nested_tensor([row[: index % 3 + 1] for index, row in enumerate(rows)])


def ragged_jagged(rows: torch.Tensor) -> torch.Tensor:
    return torch.nested.nested_tensor([row[: index % 3 + 1] for index, row in enumerate(rows)], layout=torch.jagged)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("fn", [ragged, ragged_jagged], ids=["strided", "jagged"])
@pytest.mark.parametrize("initial", [8, 2], ids=["one-chunk", "chunks"])
def test_a_nested_result_is_refused_whether_the_rows_take_one_chunk_or_more(
    fn: Callable[[torch.Tensor], torch.Tensor], initial: int
) -> None:
    x = torch.randn(6, 3)
    assert fn(x).is_nested  # what the plain function returns
    with pytest.raises(ValueError, match=r"^fn returned a nested tensor \(layout torch\.\w+\) at the result: "):
        koila.chunked(fn, x, initial=initial)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("out", [False, True], ids=["joined", "out"])
def test_a_nested_result_after_dense_ones_is_refused_naming_the_place(out: bool) -> None:
    calls = iter(range(100))

    def fn(rows: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"x": rows if next(calls) == 0 else ragged(rows)}

    buffers = {"x": torch.empty(6, 3)} if out else None
    with pytest.raises(ValueError, match=r"^fn returned a nested tensor \(layout torch.strided\) at the result\['x'\]"):
        koila.chunked(fn, torch.randn(6, 3), initial=2, out=buffers)


# --------------------------------------------------------------------------- lists of one value per row


def label_ints(rows: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    return rows.sum(1), rows[:, 0].long().tolist()  # per-row ints, as .tolist() gives


def label_tuple(rows: torch.Tensor) -> tuple[torch.Tensor, tuple[str, ...]]:
    return rows.sum(1), tuple(str(value) for value in rows[:, 0].tolist())  # per-row strings, in a tuple


def label_rows(rows: torch.Tensor) -> dict[str, Any]:
    return {"total": rows.sum(1), "rows": rows.tolist()}  # a list of lists of floats: one per row


@pytest.mark.parametrize("fn", [label_ints, label_tuple, label_rows], ids=["ints", "tuple-of-str", "nested-lists"])
def test_a_list_of_one_value_per_row_comes_back_as_none_whatever_the_memory(
    fn: Callable[[torch.Tensor], Any], fast_release: None
) -> None:
    x = torch.arange(20.0).reshape(10, 2)
    plain = fn(x)
    keys = range(len(plain)) if isinstance(plain, tuple) else list(plain)
    tensors = [key for key in keys if isinstance(plain[key], torch.Tensor)]
    values = [key for key in keys if key not in tensors]
    outcomes = []
    for limit in LIMITS:
        raised, result, warned = outcome(fn, x, limit)
        assert raised is None, f"memory for {limit} rows"
        assert len(warned) == 1, f"memory for {limit} rows: {warned}"
        for key in tensors:  # the tensors are joined, as the plain function returns them
            assert torch.equal(result[key], plain[key])
        outcomes.append([result[key] for key in values])
    assert outcomes == [[None] * len(values)] * len(LIMITS)


def test_a_tuple_of_nones_keeps_its_shape_whatever_the_memory(fast_release: None) -> None:
    # Holding no tensor, it was taken for one value per row, and came back as None with a warning.
    x = torch.arange(20.0).reshape(10, 2)
    for limit in LIMITS:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = koila.chunked(
                with_memory_for(lambda rows: {"total": rows.sum(1), "cache": (None, {"past": None})}, limit),
                x,
                initial=16,
                cache=koila.NoCache(),
            )
        assert [str(warning.message) for warning in caught] == [], f"memory for {limit} rows"
        assert result["cache"] == (None, {"past": None})
        assert torch.equal(result["total"], x.sum(1))


def test_a_none_beside_the_tensors_comes_back_without_a_warning(fast_release: None) -> None:
    # Nothing of it is lost: the warning that objects come back as None said nothing true.
    x = torch.arange(20.0).reshape(10, 2)
    for limit in LIMITS:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # recorded: an "error" filter has koila log its warnings
            result = koila.chunked(
                with_memory_for(lambda rows: {"logits": rows * 2, "loss": None}, limit), x, initial=16
            )
        assert [str(warning.message) for warning in caught] == [], f"memory for {limit} rows"
        assert result["loss"] is None
        assert torch.equal(result["logits"], x * 2)


def test_a_result_of_only_numbers_per_row_is_refused_whatever_the_memory(fast_release: None) -> None:
    x = torch.arange(20.0).reshape(10, 2)
    outcomes = [outcome(lambda rows: rows[:, 0].tolist(), x, limit)[0] for limit in LIMITS]
    raised = outcomes[0]
    assert raised is not None
    assert raised[0] is TypeError
    assert "fn returned float at the result[0] for the chunk from row 0" in raised[1]
    assert outcomes == [raised] * len(LIMITS)


def test_lists_of_one_string_per_row_are_still_joined_whatever_the_memory(fast_release: None) -> None:
    def fn(rows: torch.Tensor) -> tuple[torch.Tensor, list[str]]:
        return rows.sum(1), [f"row {int(value)}" for value in rows[:, 0].tolist()]

    x = torch.arange(20.0).reshape(10, 2)
    plain = fn(x)
    for limit in LIMITS:
        raised, result, warned = outcome(fn, x, limit)
        assert raised is None
        assert warned == []
        assert torch.equal(result[0], plain[0])
        assert result[1] == plain[1]


class Pair(tuple):  # type: ignore[type-arg]
    pass


def test_a_list_that_holds_tensors_in_a_tuple_subclass_is_still_joined(fast_release: None) -> None:
    def fn(rows: torch.Tensor) -> list[Pair]:
        return [Pair((rows, rows * 2))]

    x = torch.arange(20.0).reshape(10, 2)
    plain = fn(x)
    for limit in LIMITS:
        (pair,) = koila.chunked(with_memory_for(fn, limit), x, initial=16, cache=koila.NoCache())
        assert type(pair) is Pair
        assert torch.equal(pair[0], plain[0][0])
        assert torch.equal(pair[1], plain[0][1])


def test_numbers_where_earlier_chunks_returned_one_string_per_row_come_back_as_none() -> None:
    calls = iter(range(100))

    def fn(rows: torch.Tensor) -> tuple[torch.Tensor, list[Any]]:
        labels = rows[:, 0].tolist()
        return rows, [str(value) for value in labels] if next(calls) == 0 else labels

    x = torch.arange(8.0).reshape(4, 2)
    with pytest.warns(UserWarning, match=r"a list of 2 values, not all strings, for the rows 2 to 4, where it had"):
        result = koila.chunked(fn, x, initial=2)
    assert result[1] is None
    assert torch.equal(result[0], x)


# --------------------------------------------------------------------------- out= and the input's memory


def test_out_that_overlaps_the_input_is_refused_before_fn_runs() -> None:
    storage = torch.arange(22.0).reshape(11, 2)
    x, buffer = storage[:10], storage[1:]  # the buffer starts one row after the input: they overlap
    before = storage.clone()
    calls: list[int] = []

    def double(rows: torch.Tensor) -> torch.Tensor:
        calls.append(len(rows))
        return rows * 2

    with pytest.raises(ValueError, match=r"^out shares memory with the input rows, of shape \(10, 2\), which is split"):
        koila.chunked(double, x, initial=3, out=buffer)
    assert calls == []
    assert torch.equal(storage, before)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr", "nested"])
def test_out_that_is_not_dense_is_refused_before_fn_runs(layout: str) -> None:
    dense = torch.zeros(6, 2)
    buffers = {
        "sparse_coo": lambda: dense.to_sparse(),
        "sparse_csr": lambda: dense.to_sparse_csr(),
        "nested": lambda: torch.nested.nested_tensor([torch.zeros(2)] * 6),
    }
    calls: list[int] = []

    def double(rows: torch.Tensor) -> torch.Tensor:
        calls.append(len(rows))
        return rows * 2

    with pytest.raises(ValueError, match=rf"^out must hold dense, strided tensors, got a {layout} tensor at out:"):
        koila.chunked(double, torch.ones(6, 2), initial=4, out=buffers[layout]())
    assert calls == []


@pytest.mark.parametrize("form", ["channels_last", "channels_last_3d"])
def test_a_joined_result_keeps_the_memory_format_of_the_first_chunk(form: str) -> None:
    memory_format = getattr(torch, form)
    shape = (8, 3, 4, 5) if form == "channels_last" else (8, 3, 2, 4, 5)
    x = torch.randn(shape).contiguous(memory_format=memory_format)
    whole = koila.chunked(lambda rows: rows * 2, x, initial=16)
    joined = koila.chunked(lambda rows: rows * 2, x, initial=3)
    assert torch.equal(joined, x * 2)
    assert joined.stride() == whole.stride() == (x * 2).stride()


@pytest.mark.parametrize("form", ["pair", "transposed"])
def test_a_copy_that_writing_into_out_needs_is_made_inside_the_attempt_and_retried_smaller(form: str) -> None:
    # out=(x, saved) of (rows * 2, rows): the rows saved is given are copied before x's are written; out=x
    # of rows.mT: copied before they are written over. An out-of-memory error there is the chunk's.
    x = torch.arange(8 * 256.0).reshape(8, 16, 16)  # 1 KiB a row, made before the device: not counted
    saved = torch.empty(8, 16, 16)
    if form == "pair":
        expected: Any = (x * 2, x.clone())
        out: Any = (x, saved)

        def fn(rows: torch.Tensor) -> Any:
            sizes.append(len(rows))
            return rows * 2, rows

    else:
        expected, out = x.mT.clone(), x

        def fn(rows: torch.Tensor) -> Any:
            sizes.append(len(rows))
            return rows.mT

    sizes: list[int] = []
    with torch.no_grad(), simulated_device("6KiB" if form == "pair" else "3KiB"):
        result = koila.chunked(fn, x, initial=4, out=out, cache=koila.NoCache())
    assert result is out
    assert sizes == [4, 2, 2, 2, 2]
    if form == "pair":
        assert torch.equal(x, expected[0])
        assert torch.equal(saved, expected[1])
    else:
        assert torch.equal(x, expected)


def test_out_that_overlaps_a_tensor_passed_whole_is_refused() -> None:
    storage = torch.ones(11, 2)
    # One row, passed whole to every chunk and read by each, that out's row 5 would overwrite.
    scale, buffer = storage[6:7], storage[1:]
    with pytest.raises(ValueError, match=r"^out\['y'\] shares memory with the input scale, .* passed whole"):
        koila.chunked(lambda rows, scale: {"y": rows * scale}, torch.ones(10, 2), scale, initial=3, out={"y": buffer})


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("initial", [3, 16], ids=["chunks", "one-chunk"])
def test_out_that_is_the_input_itself_is_written_in_place(dim: int, initial: int) -> None:
    x = torch.arange(20.0).reshape(10, 2) if dim == 0 else torch.arange(20.0).reshape(2, 10)
    expected = x * 2 + 1  # the plain function on the whole input
    for out in (x, x.view(x.shape)):  # the tensor, or a view of exactly its elements
        inputs = x.clone()
        target = inputs if out is x else inputs.view(inputs.shape)
        result = koila.chunked(lambda rows: rows * 2 + 1, inputs, dim=dim, initial=initial, out=target)
        assert result is target
        assert torch.equal(inputs, expected)


def test_out_beside_the_input_in_one_buffer_is_accepted() -> None:
    columns = torch.zeros(10, 4)
    columns[:, :2] = torch.arange(20.0).reshape(10, 2)
    x, out = columns[:, :2], columns[:, 2:]  # one storage, no element in common
    expected = x * 3
    koila.chunked(lambda rows: rows * 3, x, initial=3, out=out)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("initial", [3, 16], ids=["chunks", "one-chunk"])
def test_out_that_is_the_input_is_refused_before_a_row_is_written_where_the_result_requires_grad(
    initial: int,
) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(4, 4)
    x = torch.randn(10, 4)
    linear(x).sum().backward()  # the plain call: autograd saves x's rows for the weight's gradient
    plain = cast(torch.Tensor, linear.weight.grad).clone()
    linear.weight.grad = None
    before = x.clone()
    with pytest.raises(ValueError, match=r"^out holds the same elements as the input input \(out=x\), and fn's res"):
        koila.chunked(linear, x, initial=initial, out=x)
    assert torch.equal(x, before)  # nothing of the user's changed
    # tanh saves its output, not its input: refused all the same, as torch's own out= refuses autograd.
    rows = torch.randn(10, 4, requires_grad=True) * 1
    with pytest.raises(ValueError, match=r"^out\['y'\] holds the same elements as the input x \(out=x\)"):
        koila.chunked(lambda x: {"y": torch.tanh(x)}, rows, initial=initial, out={"y": rows})
    # An out of its own records the graph, whose gradient is the plain call's.
    koila.chunked(linear, x, initial=initial, out=torch.empty(10, 4)).sum().backward()
    assert torch.allclose(cast(torch.Tensor, linear.weight.grad), plain)


@pytest.mark.parametrize("initial", [3, 16], ids=["chunks", "one-chunk"])
@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_out_that_is_the_input_is_written_in_place_where_no_graph_is_recorded(
    initial: int, mode: Callable[[], Any]
) -> None:
    linear = torch.nn.Linear(4, 4)
    with mode():
        x = torch.randn(10, 4)
        plain = linear(x)
        result = koila.chunked(linear, x, initial=initial, out=x)
    assert result is x
    assert torch.allclose(x, plain)


def encode_in_inference_mode(rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """A model run under torch.inference_mode() inside fn, beside a tensor made outside it."""
    with torch.inference_mode():
        embedded = rows * 3 + 1
    return {"embedded": embedded, "raw": rows * 2}


def refuses_in_place(tensor: torch.Tensor) -> bool:
    """Return whether torch refuses to change ``tensor`` in place here."""
    try:
        tensor.mul_(2)
    except RuntimeError:
        return True
    return False


def test_inference_tensors_that_fn_returns_come_back_as_such_whatever_the_memory(fast_release: None) -> None:
    x = torch.arange(20.0).reshape(10, 2)
    plain = encode_in_inference_mode(x)
    # What the plain call's results are, and whether an in-place change of each works (which changes it).
    expected = {key: (value.is_inference(), refuses_in_place(value)) for key, value in plain.items()}
    for limit in LIMITS:
        result = koila.chunked(with_memory_for(encode_in_inference_mode, limit), x, initial=16, cache=koila.NoCache())
        for key, value in result.items():
            assert torch.equal(value, encode_in_inference_mode(x)[key]), f"memory for {limit} rows"
            assert (value.is_inference(), refuses_in_place(value)) == expected[key], f"memory for {limit} rows: {key}"


def test_a_later_chunk_that_records_a_graph_after_an_inference_first_one_is_refused() -> None:
    # The result is an inference tensor where the first chunk's is one: a later chunk's graph was dropped
    # in it, silently, where torch.cat of the chunks keeps it.
    linear = torch.nn.Linear(4, 4)
    calls = 0

    def fn(rows: torch.Tensor) -> dict[str, torch.Tensor]:
        nonlocal calls
        calls += 1
        if calls == 1:
            with torch.inference_mode():
                return {"y": linear(rows)}
        return {"y": linear(rows)}

    with pytest.raises(ValueError, match=r"^fn returned an inference tensor at the result\['y'\] for the first chunk"):
        koila.chunked(fn, torch.randn(10, 4), initial=3, cache=koila.NoCache())


@pytest.mark.parametrize("initial", [3, 16], ids=["chunks", "one-chunk"])
def test_out_takes_nothing_or_none_where_the_result_has_none(initial: int) -> None:
    def fn(rows: torch.Tensor) -> dict[str, Any]:
        return {"logits": rows * 2, "loss": None}

    x = torch.arange(20.0).reshape(10, 2)
    plain = fn(x)
    buffers: dict[str, Any] = {"logits": torch.empty(10, 2)}
    result = koila.chunked(fn, x, initial=initial, out=buffers)
    assert result.keys() == plain.keys()
    assert result["loss"] is None
    assert result["logits"] is buffers["logits"]
    assert torch.equal(result["logits"], plain["logits"])
    buffers = {"logits": torch.empty(10, 2), "loss": None}
    assert koila.chunked(fn, x, initial=initial, out=buffers) is buffers
    assert torch.equal(buffers["logits"], plain["logits"])
    # The error lists where the result has tensors, and a None is not one.
    with pytest.raises(ValueError, match=r"The result has them at the result\['logits'\]; out has them at out\['x'\]$"):
        koila.chunked(fn, x, initial=initial, out={"x": torch.empty(10, 2)})


def test_out_that_overlaps_the_input_through_another_storage_is_refused_before_fn_runs() -> None:
    np = pytest.importorskip("numpy")
    memory = torch.arange(36.0).reshape(9, 4)
    x = memory[:8]
    shifted = torch.from_numpy(memory.numpy()[1:])  # rows 1 to 8 of the same memory, in a storage of its own
    before = memory.clone()
    calls: list[int] = []

    def fn(rows: torch.Tensor) -> torch.Tensor:
        calls.append(len(rows))
        return rows * 2 + 1

    with pytest.raises(ValueError, match=r"^out shares memory with the input rows, of shape \(8, 4\), which is split"):
        koila.chunked(fn, x, initial=3, out=shifted)
    assert calls == []
    assert torch.equal(memory, before)
    # The input's own elements through another storage are out=x; columns beside them share nothing.
    plain = fn(x)
    koila.chunked(fn, x, initial=3, out=torch.from_numpy(memory.numpy()[:8]))
    assert torch.equal(x, plain)
    columns = np.zeros((10, 4), dtype=np.float32)
    columns[:, :2] = np.arange(20.0).reshape(10, 2)
    inputs, written = torch.from_numpy(columns[:, :2]), torch.from_numpy(columns[:, 2:])
    plain = fn(inputs)
    koila.chunked(fn, inputs, initial=3, out=written)
    assert torch.equal(written, plain)


def test_two_out_tensors_that_overlap_through_other_storages_are_refused() -> None:
    np = pytest.importorskip("numpy")
    memory = np.zeros((11, 2), dtype=np.float32)
    out = (torch.from_numpy(memory[:10]), torch.from_numpy(memory[1:]))
    with pytest.raises(ValueError, match=r"^out\[0\] and out\[1\] share memory"):
        koila.chunked(lambda rows: (rows, rows * 2), torch.ones(10, 2), initial=3, out=out)
    assert not memory.any()


def test_an_empty_list_or_dict_comes_back_as_it_was_whatever_the_memory(fast_release: None) -> None:
    x = torch.arange(20.0).reshape(10, 2)
    for empty in ([], {}, ()):

        def fn(rows: torch.Tensor, empty: Any = empty) -> tuple[torch.Tensor, Any]:
            return rows * 2, empty

        plain = fn(x)
        for limit in LIMITS:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result = koila.chunked(with_memory_for(fn, limit), x, initial=16, cache=koila.NoCache())
            assert [str(warning.message) for warning in caught] == [], f"memory for {limit} rows"
            assert result[1] == plain[1]
            assert type(result[1]) is type(plain[1])
            assert torch.equal(result[0], plain[0])


# --------------------------------------------------------------------------- koila.range and progress


def test_a_decorated_range_called_by_keyword_names_its_own_parameters() -> None:
    @koila.range(initial=2)
    def spans(first: int, last: int, scale: int = 1) -> tuple[int, int]:
        return first * scale, last * scale

    with pytest.raises(TypeError, match=r"^spans\(\) decorated with @koila.range takes the start and stop of the"):
        spans(start=0, stop=5)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"there, as first and last\); got 1 positional argument, and last by keyword"):
        spans(0, last=5)
    plain = [(first * 10, last * 10) for first, last in [(0, 2), (2, 4), (4, 5)]]
    assert spans(0, 5, scale=10) == plain


def test_a_decorated_range_method_called_by_keyword_names_its_own_parameters() -> None:
    class Loader:
        @koila.range(initial=2)
        def spans(self, first: int, last: int) -> tuple[int, int]:
            return first, last

    with pytest.raises(TypeError, match=r"each range's begin and end there, as first and last\); got 0 positional"):
        Loader().spans(first=0, last=5)
    assert Loader().spans(0, 3) == [(0, 2), (2, 3)]


def test_progress_with_no_rows_shows_no_bar(capsys: pytest.CaptureFixture[str]) -> None:
    # As the docs say: no chunk runs, so no bar is drawn; with rows, one is.
    assert koila.chunked(lambda rows: rows * 2, torch.zeros(0, 3), progress=True).shape == (0, 3)
    assert koila.range(lambda begin, end: None, 4, 4, progress=True) == []
    assert capsys.readouterr().err == ""
    koila.chunked(lambda rows: rows * 2, torch.zeros(3, 3), progress=True)
    assert "3/3" in capsys.readouterr().err


def _node_names(root: Any) -> set[str]:
    names, stack, seen = set(), [root], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        names.add(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


@pytest.mark.parametrize("dim", [0, 1])
def test_a_joined_result_that_requires_grad_runs_backward_once_over_its_rows(dim: int) -> None:
    # Each chunk was copied into a slice of the result, a node whose backward copies the whole result's
    # gradient: a pass of a thousand chunks ran backward for half a minute, where a torch.cat took 30 ms.
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 6).double()
    x = torch.randn(24, 6, dtype=torch.float64, requires_grad=True)
    rows = x if dim == 0 else x.T.contiguous().detach().requires_grad_()

    def fn(part: torch.Tensor) -> dict[str, torch.Tensor]:
        out = model(part if dim == 0 else part.T)
        return {"y": out if dim == 0 else out.T, "half": (out if dim == 0 else out.T).float() / 2}

    joined = koila.chunked(fn, rows, dim=dim, initial=5, cache=koila.NoCache())
    assert "CopySlices" not in _node_names(joined["y"].grad_fn)
    (joined["y"].pow(2).sum() + joined["half"].sum()).backward()
    got = [p.grad.clone() for p in (*model.parameters(), rows)]  # type: ignore[union-attr]
    for p in (*model.parameters(), rows):
        p.grad = None
    whole = fn(rows)
    (whole["y"].pow(2).sum() + whole["half"].sum()).backward()
    for mine, theirs in zip(got, [p.grad for p in (*model.parameters(), rows)], strict=True):
        torch.testing.assert_close(mine, theirs)
    torch.testing.assert_close(joined["half"], whole["half"])
    assert joined["half"].dtype == torch.float32


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")  # torch.func's own, as it starts
def test_a_joined_result_serves_forward_mode_and_torch_func_transforms() -> None:
    # The write that hands each chunk a view of the gradient has no jvp and no setup_context: under forward
    # mode or a torch.func transform, where it raised, the chunks are copied as before (probe 74J).
    import torch.autograd.forward_ad as fwad

    x, tangent = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)

    def doubled(rows: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, koila.chunked(lambda part: part.sin() * 2, rows, initial=2, cache=koila.NoCache()))

    with fwad.dual_level():
        _, found = fwad.unpack_dual(doubled(fwad.make_dual(x, tangent)))
    torch.testing.assert_close(found, x.cos() * 2 * tangent)
    grad = torch.func.grad(lambda rows: doubled(rows).sum())(x)
    torch.testing.assert_close(grad, x.cos() * 2)


def test_a_chunk_without_a_graph_after_one_with_it_is_written_without_copying_the_gradient() -> None:
    model = torch.nn.Linear(3, 3).double()
    x = torch.randn(8, 3, dtype=torch.float64)
    calls: list[int] = []

    def fn(part: torch.Tensor) -> torch.Tensor:
        calls.append(len(calls))
        if len(calls) % 2:
            return cast(torch.Tensor, model(part))
        with torch.no_grad():
            return cast(torch.Tensor, model(part))

    joined = koila.chunked(fn, x, initial=2, cache=koila.NoCache())
    assert "CopySlices" not in _node_names(joined.grad_fn)
    joined.sum().backward()
    weight = model.weight.grad
    model.zero_grad()
    model(torch.cat([x[0:2], x[4:6]])).sum().backward()
    torch.testing.assert_close(weight, model.weight.grad)
