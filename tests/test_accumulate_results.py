"""koila.accumulate's results: what comes back beside the loss, combined over the micro-batches as the plain step's."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest
import torch

import koila_retry as koila

np = pytest.importorskip("numpy")


def test_numpy_scalars_are_combined_as_numbers() -> None:
    # They came back as None with a warning, where the docs say every number is combined.
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).double()
    features, labels = torch.randn(12, 3, dtype=torch.float64), torch.randint(0, 2, (12,))

    def step(features: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        logits = model(features)
        correct = (logits.argmax(1) == labels).numpy()
        return {
            "loss": torch.nn.functional.cross_entropy(logits, labels),
            "accuracy": np.float32(correct.mean()),  # a mean: weighted like the loss
            "correct": np.int64(correct.sum()),  # a count: added up
            "mean": np.float64(features.mean().item()),
        }

    plain = step(features, labels)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is dropped
        got = koila.accumulate(step, initial=5, cache=koila.NoCache())(features, labels)
    assert type(got["accuracy"]) is np.float32
    assert type(got["correct"]) is np.int64
    assert got["correct"] == plain["correct"]
    assert got["accuracy"] == pytest.approx(plain["accuracy"], rel=1e-6)
    assert got["mean"] == pytest.approx(plain["mean"], rel=1e-9)
    torch.testing.assert_close(got["loss"], plain["loss"].detach())


@dataclasses.dataclass
class Output:
    loss: torch.Tensor
    logits: torch.Tensor


class Out(dict[str, Any]):
    """An AttrDict or EasyDict a model returns: one leaf to pytree."""


@pytest.mark.parametrize("initial", [None, 4])
def test_a_dict_subclass_pytree_takes_whole_is_refused_whole_and_split(initial: int | None) -> None:
    """Whole, its loss was thrown away (None came back); split, an internal "'loss' is not in list"."""
    model = torch.nn.Linear(4, 2)
    x, y = torch.randn(10, 4), torch.randn(10, 2)

    def step(x: torch.Tensor, y: torch.Tensor) -> Out:
        logits = model(x)
        return Out(loss=torch.nn.functional.mse_loss(logits, y), logits=logits)

    with pytest.raises(TypeError, match=r"returned Out, a subclass of dict that torch.utils._pytree takes whole"):
        koila.accumulate(step, initial=initial, cache=koila.NoCache())(x, y)
    assert model.weight.grad is None


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_a_complex_value_beside_the_loss_keeps_its_imaginary_part_when_split(dtype: torch.dtype) -> None:
    """Weighed as a real value, it was cast to float32: the imaginary part was lost, with a warning."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    x, y, z = torch.randn(8, 4), torch.randn(8, 2), torch.randn(8, dtype=dtype)

    def step(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.nn.functional.mse_loss(model(x), y), z.mean()

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # PyTorch warns when a cast discards the imaginary part
        _, mean = koila.accumulate(step, initial=4, cache=koila.NoCache())(x, y, z)
    assert mean.dtype == dtype
    torch.testing.assert_close(mean, z.mean())


def test_a_dataclass_returned_whole_is_refused_by_its_type_without_its_tensors() -> None:
    # The error printed the result's repr, cut inside a tensor's, and did not say why its loss was not found.
    model = torch.nn.Linear(3, 2)
    features = torch.randn(64, 3)

    def step(features: torch.Tensor) -> Output:
        logits = model(features)
        return Output(logits.pow(2).mean(), logits)

    assert isinstance(step(features).loss, torch.Tensor)  # the plain step returns it
    with pytest.raises(TypeError, match=r"returned an instance of Output, a dataclass; .* a dict") as raised:
        koila.accumulate(step, initial=16, cache=koila.NoCache())(features)
    assert "tensor(" not in str(raised.value)
    assert model.weight.grad is None


@pytest.mark.parametrize(("dtype", "scale"), [(torch.bfloat16, 1.0), (torch.float16, 300.0)])
def test_a_weighted_tensor_is_combined_in_float32_under_autocast(dtype: torch.dtype, scale: float) -> None:
    # Weighted by a matrix product, which autocast ran in its lower precision: bf16 values in a float32
    # result, and inf above float16's 65504.
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    x, y = torch.randn(40, 6) * scale, torch.randn(40, 3)

    def step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        per_column = ((model(x).float() - y) ** 2).mean(0)  # a mean over the rows: weighted like the loss
        return per_column.sum(), per_column, per_column.sum().view(1, 1)  # one element, not a loss: stacked

    with torch.autocast("cpu", dtype=dtype):
        loss, per_column, one = koila.accumulate(step, initial=16, cache=koila.NoCache())(x, y)
        with torch.no_grad():
            parts = [step(x[begin : begin + 16], y[begin : begin + 16])[1] for begin in (0, 16, 32)]
    expected = (parts[0] * 16 + parts[1] * 16 + parts[2] * 8) / 40
    assert per_column.dtype == torch.float32
    assert torch.isfinite(per_column).all()
    torch.testing.assert_close(per_column, expected, rtol=1e-6, atol=0.0)
    torch.testing.assert_close(loss, expected.sum(), rtol=1e-6, atol=0.0)
    torch.testing.assert_close(one, expected.sum().view(1, 1), rtol=1e-6, atol=0.0)


def test_a_number_and_a_tensor_in_one_place_are_refused_by_name() -> None:
    # The value added up as it comes was made at a later micro-batch too, then read as an entry (TypeError
    # of an internal object), and a number after a tensor failed on .detach() (probe 74I).
    x = torch.randn(8, 3, dtype=torch.float64)
    seen: list[int] = []

    def step(x: torch.Tensor, number_first: bool) -> dict[str, Any]:
        seen.append(1)
        first = len(seen) == 1
        stat: Any = 0.0 if first == number_first else x.mean(0)
        return {"loss": x.pow(2).mean(), "stat": stat}

    # Either order: the result's type would depend on the split (a float whole, a tensor split).
    with pytest.raises(ValueError, match=r"returned a tensor of shape \(3,\) .* at the result\['stat'\] .* float 0.0"):
        koila.accumulate(initial=2, cache=koila.NoCache())(step)(x, True)
    seen.clear()
    with pytest.raises(ValueError, match=r"returned float 0.0 at the result\['stat'\] .* a tensor of shape \(3,\)"):
        koila.accumulate(initial=2, cache=koila.NoCache())(step)(x, False)


@pytest.mark.parametrize(
    ("first", "later", "expected"),
    [
        (torch.tensor(0.5, dtype=torch.float64), 0.0, torch.tensor(0.125, dtype=torch.float64)),
        (torch.tensor([0.5], dtype=torch.float64), 0.0, torch.tensor([0.125], dtype=torch.float64)),
        (torch.tensor(3), 0, torch.tensor(3)),
        (0.0, torch.tensor(0.5, dtype=torch.float64), torch.tensor(0.375, dtype=torch.float64)),
    ],
)
def test_a_one_element_tensor_and_a_number_in_one_place_add_up(first: Any, later: Any, expected: Any) -> None:
    # A recall that is 0.0 for a micro-batch with no positive rows: a tensor then a number failed in
    # torch.stack once every micro-batch had run (probe 74L), where the reverse order added up.
    x = torch.randn(8, 3, dtype=torch.float64)
    calls: list[int] = []

    def step(x: torch.Tensor) -> dict[str, Any]:
        calls.append(1)
        return {"loss": x.pow(2).mean(), "stat": first if len(calls) == 1 else later}

    got = koila.accumulate(initial=2, cache=koila.NoCache())(step)(x)["stat"]
    torch.testing.assert_close(got, expected)
