"""Values read from tensors during an estimate: each read is noted, and a truth value follows the usual branch.

Meta tensors hold no values. Whatever a call decides from one (a size, a branch) it decides
from a placeholder, and the estimate says so in its notes, for every kind of read: an
integer, a float, a truth value. A truth value reads as what the check it came from
usually finds, so that the common guards (``if torch.isfinite(loss):``, ``if
torch.isnan(x).any():``, Hugging Face's ``(positions == ...).all()``) run the branch a
real step runs.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

import koila_retry as koila
from koila_retry.testing import simulated_device

INTEGER, FLOAT, TRUTH = (f"reading {kind} from a tensor" for kind in ("an integer", "a float", "a truth value"))


def mlp() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
    return model, torch.optim.Adam(model.parameters())


def kinds(found: koila.MemoryEstimate) -> list[str]:
    return [note.split(":")[0] for note in found.notes]


def test_a_nan_guard_is_noted_and_estimated_down_the_branch_a_real_step_takes() -> None:
    model, optimizer = mlp()

    def guarded(x: torch.Tensor) -> None:
        loss = model(x).square().mean()
        if torch.isfinite(loss):
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

    def plain(x: torch.Tensor) -> None:
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    def skipping(x: torch.Tensor) -> None:
        loss = model(x).square().mean()
        if torch.isnan(loss).any() or not torch.logical_not(torch.isinf(loss)).all():
            return
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    x = torch.randn(8, 64)
    guard, whole, skip = (koila.estimate(fn, x) for fn in (guarded, plain, skipping))
    assert kinds(guard) == [TRUTH]
    assert kinds(skip) == [TRUTH]
    assert kinds(whole) == []
    for rows in (1, 64, 4096):
        assert guard.peak(rows) == whole.peak(rows) == skip.peak(rows), "the backward and the step are counted"


def test_a_branch_on_a_sum_is_noted() -> None:
    model, _ = mlp()

    def branching(x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return model(x).sum()
        return x.sum()

    found = koila.estimate(branching, torch.randn(8, 64))
    (note,) = found.notes
    assert note.startswith(TRUTH)
    assert "placeholder, False" in note
    assert 'initial="auto"' in note
    assert "calibrate=True" in note


def test_a_float_read_is_noted() -> None:
    model, _ = mlp()

    def reading(x: torch.Tensor) -> float:
        return float(model(x).mean().item())

    (note,) = koila.estimate(reading, torch.randn(8, 64)).notes
    assert note.startswith(FLOAT)
    assert "placeholder, 0.0" in note


def test_an_integer_read_is_noted() -> None:
    model, _ = mlp()

    def trimming(x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        return model(x[: int(n)]).sum()

    (note,) = koila.estimate(trimming, torch.randn(8, 64), torch.tensor(3)).notes
    assert note.startswith(INTEGER)


def test_every_kind_is_noted_once_each() -> None:
    model, _ = mlp()

    def everything(x: torch.Tensor) -> torch.Tensor:
        out = model(x)
        if out.sum() > 0:
            out = out * 2
        scale = float(out.detach().mean())
        first = int(torch.tensor(2))
        if (out > -1).all():
            out = out + scale
        return out[:first].sum()

    assert sorted(kinds(koila.estimate(everything, torch.randn(8, 64)))) == sorted([TRUTH, FLOAT, INTEGER])


def test_an_optimizer_and_a_gradient_scaler_reading_their_own_values_are_not_noted() -> None:
    model, optimizer = mlp()

    def step(x: torch.Tensor) -> None:
        scaler = torch.amp.GradScaler("cpu")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)  # reads whether a gradient was infinite
        scaler.update()
        optimizer.zero_grad()

    x = torch.randn(8, 64)
    step(x)  # Adam's state exists, and it reads its step counts
    assert koila.estimate(step, x).notes == ()


@pytest.mark.parametrize(
    ("check", "usual"),
    [
        (lambda x: torch.isfinite(x.sum()), True),
        (lambda x: torch.isnan(x).any(), False),
        (lambda x: torch.isinf(x).any(), False),
        (lambda x: (x == 0).all(), True),  # a validation: every entry as expected
        (lambda x: (x > 0).any(), False),
        (lambda x: torch.logical_not(torch.isnan(x)).all(), True),
        (lambda x: ~torch.isfinite(x).all(), False),
        (lambda x: torch.isnan(x).all(), False),
        (lambda x: x.sum() > 0, False),  # nothing known: the else
    ],
    ids=[
        "isfinite",
        "isnan-any",
        "isinf-any",
        "eq-all",
        "gt-any",
        "not-isnan-all",
        "not-isfinite-all",
        "isnan-all",
        "gt",
    ],
)
def test_a_truth_value_reads_as_what_its_check_usually_finds(
    check: Callable[[torch.Tensor], torch.Tensor], usual: bool
) -> None:
    taken: list[bool] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        taken.append(bool(check(x)))
        return x.sum()

    koila.estimate(fn, torch.randn(8, 4))
    assert taken
    assert set(taken) == {usual}


def caught_messages(run: Callable[[], object]) -> list[str]:
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        run()
    return [str(record.message) for record in records if "may be inexact" in str(record.message)]


def test_suggest_batch_size_and_auto_warn_of_a_read() -> None:
    model, _ = mlp()

    def branching(x: torch.Tensor) -> torch.Tensor:
        out = model(x)
        return out.sum() if out.mean() > 0 else out.square().sum()

    x = torch.randn(8, 64)
    (message,) = caught_messages(lambda: koila.suggest_batch_size(branching, x, budget="64MiB"))
    assert TRUTH in message
    assert "calibrate=True" in message

    step = koila.accumulate(initial="auto")(branching)
    with simulated_device("64MiB"):
        (message,) = caught_messages(lambda: step(x))
    assert TRUTH in message
    assert "initial='auto' chose the first size" in message


# --- reads of many values at once, and whole-tensor comparisons (issue 39) --------------------------


def test_tolist_reads_a_placeholder_for_every_value_and_is_noted() -> None:
    model, _ = mlp()
    runs: list[tuple[int, dict[str, object]]] = []

    def reading(x: torch.Tensor) -> torch.Tensor:
        out = model(x)
        lists = {
            "float": out.tolist(),
            "integer": out.argmax(dim=1).tolist(),
            "truth": torch.isnan(out).tolist(),
            "scalar": out.sum().tolist(),
            "empty": out[:0].tolist(),
        }
        runs.append((len(x), lists))
        return out.sum()

    found = koila.estimate(reading, torch.randn(8, 64))
    assert runs
    for rows, lists in runs:  # one run per batch size the estimate measures
        assert lists == {
            "float": [[0.0]] * rows,
            "integer": [1] * rows,
            "truth": [[False]] * rows,  # what isnan usually finds
            "scalar": 0.0,
            "empty": [],
        }
    assert sorted(kinds(found)) == sorted([FLOAT, INTEGER, TRUTH])


def test_numpy_reads_placeholders_as_the_real_run_would_convert() -> None:
    numpy = pytest.importorskip("numpy")
    model, _ = mlp()
    arrays: list[object] = []

    def reading(x: torch.Tensor) -> torch.Tensor:
        out = model(x)
        arrays.append(out.detach().numpy())
        arrays.append(numpy.asarray(out.detach().argmax(dim=1)))
        arrays.append(numpy.asarray(out.detach(), dtype=numpy.float64))
        arrays.append(out.numpy(force=True))
        return out.sum()

    found = koila.estimate(reading, torch.randn(8, 64))
    assert arrays
    for index in range(0, len(arrays), 4):  # four arrays per batch size the estimate measures
        floats, integers, doubles, forced = arrays[index : index + 4]
        assert isinstance(floats, numpy.ndarray)
        rows = len(floats)
        assert (floats.shape, floats.dtype, floats.tolist()) == ((rows, 1), numpy.float32, [[0.0]] * rows)
        assert isinstance(integers, numpy.ndarray)
        assert (integers.shape, integers.dtype, integers.tolist()) == ((rows,), numpy.int64, [1] * rows)
        assert isinstance(doubles, numpy.ndarray)
        assert (doubles.shape, doubles.dtype) == ((rows, 1), numpy.float64)
        assert isinstance(forced, numpy.ndarray)
        assert (forced.shape, forced.dtype) == ((rows, 1), numpy.float32)
    assert sorted(kinds(found)) == sorted([FLOAT, INTEGER])


def test_numpy_that_the_real_run_refuses_fails_as_in_the_real_run() -> None:
    pytest.importorskip("numpy")
    model, _ = mlp()
    x = torch.randn(8, 64)
    with pytest.raises(RuntimeError, match=r"Can't call numpy\(\) on Tensor that requires grad") as real:
        model(x).numpy()
    with pytest.raises(RuntimeError, match=r"Can't call numpy\(\) on Tensor that requires grad") as estimated:
        koila.estimate(lambda batch: model(batch).numpy(), x)
    assert str(estimated.value) == str(real.value)
    with pytest.raises(TypeError, match="BFloat16") as real_type:
        model(x).detach().bfloat16().numpy()
    with pytest.raises(TypeError, match="BFloat16") as estimated_type:
        koila.estimate(lambda batch: model(batch).detach().bfloat16().numpy(), x)
    assert str(estimated_type.value).startswith(str(real_type.value))


def test_equal_and_allclose_read_as_the_check_usually_finds_and_are_noted() -> None:
    model, _ = mlp()
    taken: list[bool] = []

    def validating(x: torch.Tensor) -> torch.Tensor:
        out = model(x)
        again = model(x)
        taken.append(torch.equal(out, again))
        taken.append(out.equal(again))
        taken.append(torch.allclose(out, again))
        taken.append(out.allclose(again, atol=1e-6))
        return out.sum()

    found = koila.estimate(validating, torch.randn(8, 64))
    assert taken
    assert set(taken) == {True}  # a validation: every entry as expected
    assert kinds(found) == [TRUTH]


def test_equal_of_tensors_of_different_shapes_is_false_without_a_read() -> None:
    taken: list[bool] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        taken.append(torch.equal(x, x[:1]))
        return x.sum()

    found = koila.estimate(fn, torch.randn(8, 4))
    assert set(taken) == {False}
    assert found.notes == ()


def test_allclose_of_shapes_that_do_not_broadcast_fails_as_in_the_real_run() -> None:
    def fn(x: torch.Tensor) -> bool:
        return torch.allclose(x, x[:, :3])

    with pytest.raises(RuntimeError, match="must match the size of tensor b"):
        fn(torch.randn(8, 4))
    # The meta kernels say it in their own words.
    with pytest.raises(RuntimeError, match=r"broadcast a dimension of length 3 .* broadcastable to \[8, 4\]"):
        koila.estimate(fn, torch.randn(8, 4))


def test_formatting_a_scalar_reads_a_placeholder() -> None:
    model, _ = mlp()
    logged: list[str] = []

    def logging(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).square().mean()
        logged.append(f"loss {loss:.3f}")
        return loss

    (note,) = koila.estimate(logging, torch.randn(8, 64)).notes
    assert note.startswith(FLOAT)
    assert set(logged) == {"loss 0.000"}


def test_a_real_tensor_reached_in_an_estimate_reads_its_real_values() -> None:
    numpy = pytest.importorskip("numpy")
    # Constants the call reaches, made outside it: what the call computes from them is meta.
    values = [[1.5, 2.5], [3.5, 4.5]]
    table, other, scale = torch.tensor(values), torch.zeros(2, 2), torch.tensor(1.5)
    read: list[object] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        read.extend([table.tolist(), table.numpy().tolist(), torch.equal(table, table), torch.equal(table, other)])
        read.extend([torch.allclose(table, table), f"{scale:.2f}", numpy.asarray(table).tolist() == values])
        return x.sum()

    found = koila.estimate(fn, torch.randn(8, 4))
    assert read[:7] == [values, values, True, False, True, "1.50", True]
    assert found.notes == ()
