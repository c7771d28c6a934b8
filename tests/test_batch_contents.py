"""A step that changes its batch (``batch.pop("labels")``) and then runs out of memory is retried on the batch given."""

from __future__ import annotations

import dataclasses
from collections import UserDict
from typing import Any

import pytest
import torch
from _layers import OOMInBackward
from torch.nn import functional as F

import koila_retry as koila
from koila_retry._common.contents import Contents
from koila_retry.testing import oom_above


def _model() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2).double()


def _expected(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, weight: float) -> list[torch.Tensor]:
    model.zero_grad()
    (F.cross_entropy(model(x), y) * weight).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return expected


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_step_that_pops_from_its_dict_is_retried_on_the_dict_as_given_and_leaves_it_so(where: str) -> None:
    model = _model()
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randint(0, 2, (8,))
    expected = _expected(model, x, y, 2.0)
    fits = oom_above(4)

    @koila.accumulate
    def step(batch: dict[str, Any]) -> torch.Tensor:
        labels, weight, tag = batch.pop("labels"), batch.pop("weight", 1.0), batch.pop("tag")
        assert tag == "kept"
        if where == "forward":
            fits(len(labels))
        loss = F.cross_entropy(model(batch["x"]), labels) * weight
        return OOMInBackward.apply(loss) if where == "backward" and len(labels) > 4 else loss

    batch = {"x": x, "labels": y, "weight": 2.0, "tag": "kept"}
    step(batch)
    assert step.stats.batch_size == 4
    for mine, theirs in zip([p.grad for p in model.parameters()], expected, strict=True):
        torch.testing.assert_close(mine, theirs)
    assert list(batch) == ["x", "labels", "weight", "tag"]
    assert batch["labels"] is y
    assert batch["weight"] == 2.0


def test_a_call_that_runs_whole_leaves_the_batch_as_the_step_did() -> None:
    model = _model()

    @koila.accumulate
    def step(batch: dict[str, Any]) -> torch.Tensor:
        return F.cross_entropy(model(batch["x"]), batch.pop("labels"))

    batch = {"x": torch.randn(8, 4, dtype=torch.float64), "labels": torch.randint(0, 2, (8,))}
    step(batch)
    assert list(batch) == ["x"]  # as a plain call leaves it


@dataclasses.dataclass
class _Batch:
    x: torch.Tensor
    labels: torch.Tensor
    extra: dict[str, Any]


def test_lists_nested_dicts_and_dataclass_fields_the_step_changed_are_put_back() -> None:
    model = _model()
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randint(0, 2, (8,))
    expected = _expected(model, x * 2, y, 3.0)
    fits = oom_above(4)

    @koila.accumulate
    def step(pair: list[Any], record: _Batch) -> torch.Tensor:
        pair[0] = pair[0] * 2  # an augmentation written back into the list
        weight = record.extra.pop("weight")
        record.labels = record.labels.flip(0)  # a field replaced
        fits(len(pair[0]))
        return F.cross_entropy(model(pair[0]), record.labels.flip(0)) * weight

    pair, record = [x, y], _Batch(x, y, {"weight": 3.0, "rows": x})
    step(pair, record)
    assert step.stats.batch_size == 4
    for mine, theirs in zip([p.grad for p in model.parameters()], expected, strict=True):
        torch.testing.assert_close(mine, theirs)
    assert pair[0] is x
    assert record.labels is y
    assert record.extra == {"weight": 3.0, "rows": x}


def test_contents_put_back_mappings_sequences_and_attributes_in_their_order() -> None:
    inner = {"a": 1, "b": [1, 2]}
    encoded = UserDict({"ids": torch.ones(2), "inner": inner})
    kept = Contents((encoded,), {"more": [inner["b"]]})
    encoded.pop("ids")
    encoded["new"] = 0
    inner["b"].append(3)
    del inner["a"]
    kept.restore()
    assert list(encoded) == ["ids", "inner"]
    assert encoded["inner"] is inner
    assert inner == {"a": 1, "b": [1, 2]}


def test_a_long_list_is_taken_whole_and_its_items_are_not_looked_into() -> None:
    records = [{"id": row} for row in range(100)]  # one per row
    kept = Contents(records)
    records[0]["id"] = -1
    records.pop()
    kept.restore()
    assert len(records) == 100
    assert records[0] == {"id": -1}  # left as changed: a record's own items are the step's to change
