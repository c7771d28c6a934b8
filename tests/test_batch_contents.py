"""A step that changes its batch (``batch.pop("labels")``) and then runs out of memory is retried on the batch given."""

from __future__ import annotations

import dataclasses
from array import array
from collections import UserDict, deque
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


@pytest.mark.parametrize(("rows", "fits"), [(17, 8), (8, 2)])
def test_per_row_records_a_failed_attempt_changed_are_put_back(rows: int, fits: int) -> None:
    # A detection batch, one dict per row: a failed split attempt changed the caller's records, and more than
    # 16 of them were not looked into at all; the boxes were scaled again at each attempt (probe 76H).
    model = _model()
    x = torch.randn(rows, 4, dtype=torch.float64)
    records = [{"boxes": torch.full((2,), float(row), dtype=torch.float64)} for row in range(rows)]

    def loss_of(x: torch.Tensor, records: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        boxes = torch.stack([record["boxes"].sum() for record in records])
        return ((model(x)[:, 0] - boxes) ** 2).mean()

    (loss_of(x, [{"boxes": record["boxes"] * 2} for record in records])).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    injector = oom_above(fits)

    @koila.accumulate
    def step(x: torch.Tensor, records: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        for record in records:
            record["boxes"] = record["boxes"] * 2  # an augmentation written back into the record
        injector(len(x))
        return loss_of(x, records)

    step(x, records)
    assert step.stats.batch_size == fits
    for mine, theirs in zip([p.grad for p in model.parameters()], expected, strict=True):
        torch.testing.assert_close(mine, theirs)
    assert all(torch.equal(record["boxes"], torch.full((2,), 2.0 * row)) for row, record in enumerate(records))


class _Refusing(UserDict[str, Any]):
    """A mapping that refuses update() and pop(), as a transformers ModelOutput does."""

    def update(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("You cannot use ``update`` on this instance.")

    def pop(self, *args: Any) -> Any:
        raise RuntimeError("You cannot use ``pop`` on this instance.")


def test_containers_that_refuse_to_be_put_back_or_were_not_changed_are_left_alone() -> None:
    # A ModelOutput (the teacher's, in distillation) was cleared and then refused update(): the out-of-memory
    # error became that error, and the object was left empty; a deque refused slices (probe 76H).
    model = _model()
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randint(0, 2, (8,))
    teacher = _Refusing()
    teacher.data["logits"] = torch.zeros(8, 2, dtype=torch.float64)
    recent, samples = deque([0.5, 0.7], maxlen=4), array("d", [1.0, 2.0])
    fits = oom_above(4)

    @koila.accumulate
    def step(x: torch.Tensor, y: torch.Tensor, teacher: Any, extra: dict[str, Any]) -> torch.Tensor:
        fits(len(x))
        return F.cross_entropy(model(x) + teacher["logits"], y) * extra["recent"][0] * extra["samples"][0]

    step(x, y, teacher, {"recent": recent, "samples": samples, "rows": x})
    assert step.stats.batch_size == 4
    assert list(teacher) == ["logits"]
    assert (list(recent), list(samples)) == ([0.5, 0.7], [1.0, 2.0])
    kept = Contents(recent, samples, teacher)
    recent.append(0.9)
    samples.append(3.0)
    kept.restore()  # each as well as it allows: the deque and the array through clear() and extend()
    assert (list(recent), list(samples)) == ([0.5, 0.7], [1.0, 2.0])


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


def test_a_long_list_of_values_is_taken_whole_and_one_of_records_record_by_record() -> None:
    values = list(range(100))  # one per row
    records = [{"id": row} for row in range(100)]
    kept = Contents({"values": values, "records": records})
    values.pop()
    records[0]["id"] = -1
    records.pop()
    kept.restore()
    assert values == list(range(100))
    assert records == [{"id": row} for row in range(100)]


@dataclasses.dataclass
class _Object:
    weight: float


def test_long_lists_of_tuples_and_dataclasses_are_looked_into_and_shared_items_taken_once() -> None:
    # Only a long list whose first item was a dict or list was looked into (probe 76L).
    pairs = [(row, {"weight": 1.0}) for row in range(20)]
    objects = [_Object(1.0) for _ in range(20)]
    labels = {"names": ["a", "b"]}
    kept = Contents([{"labels": labels, "pairs": pairs}, {"labels": labels, "objects": objects}])
    assert sum(1 for container, _, _ in kept.kept if container is labels) == 1
    for _, held in pairs:
        held["weight"] *= 2
    for each in objects:
        each.weight *= 2
    kept.restore()
    assert {held["weight"] for _, held in pairs} == {each.weight for each in objects} == {1.0}
    marked = [None, *({"box": 1.0} for _ in range(20))]  # None: an ignored object (probe 76M)
    kept = Contents(marked)
    for each in marked[1:]:
        each["box"] *= 2  # type: ignore[index]
    kept.restore()
    assert {each["box"] for each in marked[1:]} == {1.0}  # type: ignore[index]
