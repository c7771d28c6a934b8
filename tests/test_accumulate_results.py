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
