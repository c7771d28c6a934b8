"""accumulate(weight=...): micro-batches weighted by the items their mean loss averages over."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch.nn import functional as F

import koila_retry as koila

IGNORED = -100


def token_batch(rows: int = 8, length: int = 6) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(20, 8), torch.nn.Linear(8, 20)).double()
    ids = torch.randint(0, 20, (rows, length))
    labels = ids.clone()
    for row in range(rows):
        labels[row, 1 + row % length :] = IGNORED  # rows count 1 to 6 tokens
    return model, {"ids": ids, "labels": labels}


def mean_over_tokens(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["ids"])
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORED)


def counted(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (batch["labels"] != IGNORED).sum()


@pytest.mark.parametrize("size", [1, 3, 5])
def test_weighted_micro_batches_give_the_token_mean_gradient_and_loss(size: int) -> None:
    model, batch = token_batch()
    whole = mean_over_tokens(model, batch)
    whole.backward()
    expected = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()
    step = koila.accumulate(lambda batch: mean_over_tokens(model, batch), initial=size, weight=counted)
    loss = step(batch)
    torch.testing.assert_close(loss, whole.detach(), rtol=1e-12, atol=0)
    for parameter, grad in zip(model.parameters(), expected):
        torch.testing.assert_close(parameter.grad, grad, rtol=1e-10, atol=1e-14)


def test_without_weight_a_dict_batch_with_ignored_labels_is_warned_about_once() -> None:
    model, batch = token_batch()
    step = koila.accumulate(lambda batch: mean_over_tokens(model, batch), initial=4)
    with pytest.warns(UserWarning, match=r"labels with ignored entries \(-100\)") as caught:
        step(batch)
    assert [w.filename for w in caught] == [__file__]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(batch)
        koila.accumulate(lambda batch: mean_over_tokens(model, batch))(batch)  # whole: no split, no warning


def test_a_micro_batch_that_counts_nothing_adds_nothing() -> None:
    model, batch = token_batch(rows=4)
    batch["labels"][:2] = IGNORED  # the first micro-batch of 2: every label ignored, its mean loss nan
    whole = mean_over_tokens(model, batch)
    whole.backward()
    expected = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()
    step = koila.accumulate(lambda batch: mean_over_tokens(model, batch), initial=2, weight=counted)
    loss = step(batch)
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, whole.detach())
    for parameter, grad in zip(model.parameters(), expected):
        torch.testing.assert_close(parameter.grad, grad)


def test_a_batch_that_counts_nothing_is_refused_and_leaves_gradients_alone() -> None:
    model, batch = token_batch(rows=4)
    batch["labels"][:] = IGNORED
    step = koila.accumulate(lambda batch: mean_over_tokens(model, batch), initial=2, weight=counted)
    with pytest.raises(ValueError, match="weight= counted 0 items in the whole batch"):
        step(batch)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(
    ("returned", "shown"),
    [(-1, "-1"), ("many", "'many'"), (float("nan"), "nan"), (True, "True"), (torch.ones(2), "shape (2,)")],
)
def test_weight_must_return_a_count(returned: Any, shown: str) -> None:
    model, batch = token_batch(rows=4)
    step = koila.accumulate(lambda batch: mean_over_tokens(model, batch), initial=2, weight=lambda batch: returned)
    with pytest.raises(ValueError, match="weight= returned") as info:
        step(batch)
    assert shown in str(info.value)


def test_weight_is_checked_when_decorating() -> None:
    with pytest.raises(TypeError, match="weight must be a callable .* got int 3"):
        koila.accumulate(weight=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reduction='sum' adds them unweighted: drop one of them"):
        koila.accumulate(weight=counted, reduction="sum")


def test_weight_is_not_called_when_the_whole_batch_runs() -> None:
    model, batch = token_batch(rows=4)
    calls: list[int] = []

    def weight(batch: dict[str, torch.Tensor]) -> int:
        calls.append(1)
        return 1

    koila.accumulate(lambda batch: mean_over_tokens(model, batch), weight=weight)(batch)
    assert calls == []
