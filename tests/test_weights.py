"""accumulate(weight=...): micro-batches weighted by the items their mean loss averages over."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch.nn import functional as F

import koila_retry as koila
from koila_retry.testing import simulated_device

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
    # Where weight= is, and that Lightning's OOMRecovery, which takes none, weighs by rows (it told to pass it).
    assert "pass weight= to koila.accumulate" in str(caught[0].message)
    assert "OOMRecovery weighs by rows only" in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(batch)
        koila.accumulate(lambda batch: mean_over_tokens(model, batch))(batch)  # whole: no split, no warning


@pytest.mark.parametrize("form", ["positional", "keyword", "tuple"])
def test_ignored_labels_outside_a_dict_are_warned_about_too(form: str) -> None:
    # step(ids, labels), step(ids, labels=labels), Lightning's (x, y) batch: weighed by rows as a dict's is.
    model, batch = token_batch()

    def step(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return mean_over_tokens(model, {"ids": ids, "labels": labels})

    ids, labels = batch["ids"], batch["labels"]
    calls = {
        "positional": lambda: koila.accumulate(step, initial=4)(ids, labels),
        "keyword": lambda: koila.accumulate(step, initial=4)(ids, labels=labels),
        "tuple": lambda: koila.accumulate(lambda pair: step(*pair), initial=4)((ids, labels)),
    }
    with pytest.warns(UserWarning, match=r"labels with ignored entries \(-100\)"):
        calls[form]()
    with warnings.catch_warnings():  # the ids themselves are integers without -100: nothing to warn about
        warnings.simplefilter("error")
        koila.accumulate(lambda ids: model(ids).sum(), initial=4)(ids)


def test_the_look_for_ignored_labels_needs_no_memory_of_the_batchs_size() -> None:
    # A large field of integers the step barely reads: a mask of it, made in every split attempt, ran
    # out of memory at every size where the hand loop fits. And a batch on meta has no values to look at.
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    x, ids, y = torch.randn(64, 16), torch.randint(0, 1000, (64, 65536)), torch.randint(0, 4, (64,))

    def loss(x: torch.Tensor, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x) + ids[:, :1].float() * 0, y)

    with simulated_device("2MiB") as device:
        for rows in range(0, 64, 32):  # the hand loop
            (loss(x[rows : rows + 32], ids[rows : rows + 32], y[rows : rows + 32]) * 0.5).backward()
        hand = device.peak
    model.zero_grad()
    step = koila.accumulate(loss, initial=32, cache=koila.NoCache())
    with simulated_device("2MiB") as device:
        step(x, ids, y)
    assert step.stats.batch_size == 32
    assert device.peak <= hand + 1024, (device.peak, hand)
    meta = torch.nn.Linear(16, 4, device="meta")
    split = koila.accumulate(lambda x, y: F.cross_entropy(meta(x), y), initial=4)
    split(torch.randn(8, 16, device="meta"), torch.full((8,), -100, device="meta"))


class CountedReads(torch.overrides.TorchFunctionMode):
    """Count the least-entry reads of integer tensors (each a device sync on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.amin and not args[0].is_floating_point():
            self.reads += 1
        return func(*args, **(kwargs or {}))


def test_the_look_for_ignored_labels_is_made_in_few_split_steps() -> None:
    # Each look reads a value: on a GPU, a sync in every split step of every classifier. Looked at in the
    # 1st, 2nd, 4th, 8th... split step: labels with -100 first in the 3rd are warned of in the 4th.
    model, batch = token_batch()
    clean = {"ids": batch["ids"], "labels": batch["ids"].clone()}
    step = koila.accumulate(lambda batch: mean_over_tokens(model, batch), initial=4)
    with warnings.catch_warnings(record=True) as early:
        warnings.simplefilter("always")
        step(clean)
        step(clean)
        step(batch)  # the 3rd: not looked at
        koila.accumulate(lambda batch: mean_over_tokens(model, batch))(batch)  # whole: not counted
    assert [str(w.message) for w in early] == []
    with pytest.warns(UserWarning, match=r"labels with ignored entries \(-100\)"):
        step(batch)
    quiet = koila.accumulate(lambda batch: mean_over_tokens(model, batch), initial=4)
    with CountedReads() as counted:
        for _ in range(20):
            quiet(clean)
    assert counted.reads == 2 * 5  # two integer tensors, in steps 1, 2, 4, 8 and 16


def test_a_step_that_initial_auto_splits_is_warned_about_too() -> None:
    # Its first micro-batch is measured, and weighed on another path: that path warned of nothing.
    model, batch = token_batch(rows=16)
    step = koila.accumulate(lambda batch: mean_over_tokens(model, batch), initial="auto", cache=koila.NoCache())
    with simulated_device("6KiB"), pytest.warns(UserWarning, match=r"labels with ignored entries \(-100\)"):
        step(batch)
    assert step.stats.batch_size < 16, "the step ran whole: nothing to warn about"


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


class Routed(torch.nn.Module):
    """Rows of kind 1 go through a head of their own (an expert, a task's head); a body recomputed."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(4, 4).double()
        self.shared, self.special = torch.nn.Linear(4, 3).double(), torch.nn.Linear(4, 3).double()

    def forward(self, x: torch.Tensor, kind: torch.Tensor) -> torch.Tensor:
        # A reentrant checkpoint of a plain function: its backward runs inside the step's, unseen by a walk.
        x = torch.utils.checkpoint.checkpoint(lambda rows: torch.tanh(self.body(rows)), x, use_reentrant=True)
        rows = torch.nonzero(kind == 1).squeeze(1)
        out = self.shared(x)
        return out.index_copy(0, rows, self.special(x[rows])) if len(rows) else out


@pytest.mark.parametrize("before", ["none", "present"])
@pytest.mark.parametrize("gives_up", [False, True], ids=["fits", "gives-up-after-it"])
@pytest.mark.filterwarnings("ignore:.*reentrant")  # the step's warning of a checkpoint it cannot undo part-way
def test_a_micro_batch_that_counts_nothing_runs_no_backward_on_one_device(before: str, gives_up: bool) -> None:
    """Its loss is 0/0: a backward of it wrote nan through the checkpoint. What only it reaches stays as it was."""
    model = Routed()
    x, y = torch.randn(8, 4, dtype=torch.float64, requires_grad=False), torch.randint(0, 3, (8,))
    kind = torch.tensor([1, 1, 0, 0, 0, 0, 0, 0])
    y[:4] = IGNORED  # the first micro-batch, which holds the special rows, counts nothing

    def loss_of(x: torch.Tensor, kind: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        counted = (y != IGNORED).double()
        each = F.cross_entropy(model(x.requires_grad_(), kind), y.clamp(min=0), reduction="none")
        return (each * counted).sum() / counted.sum()  # a masked mean, as Hugging Face's: 0/0 over no items

    def start() -> list[torch.Tensor | None]:
        for parameter in model.parameters():
            parameter.grad = torch.ones_like(parameter) if before == "present" else None
        return [parameter.grad for parameter in model.parameters()]

    start()
    loss_of(x.clone(), kind, y).backward()
    expected = {name: parameter.grad.clone() for name, parameter in model.named_parameters()}  # type: ignore[union-attr]
    found = start()
    inject = koila.testing.oom_for({2} if gives_up else set())  # the second micro-batch, after the first

    def step(x: torch.Tensor, kind: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        inject()
        return loss_of(x.clone(), kind, y)

    counted = koila.accumulate(
        step, initial=4, minimum=4, weight=lambda x, kind, y: (y != IGNORED).sum(), cache=koila.NoCache()
    )
    if gives_up:
        with pytest.raises(koila.BatchSizeExhausted):
            counted(x, kind, y)
        for parameter, grad in zip(model.parameters(), found):
            assert parameter.grad is grad if grad is None else torch.equal(parameter.grad, grad)
        return
    counted(x, kind, y)
    for name, parameter in model.named_parameters():
        if name.startswith("special"):  # only the rows that count nothing reach it: as it was (docs)
            assert (
                parameter.grad is None if before == "none" else torch.equal(parameter.grad, torch.ones_like(parameter))
            )
        else:
            torch.testing.assert_close(parameter.grad, expected[name], rtol=1e-12, atol=0)


def _mean_over_nothing(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A token mean written as a sum over a count, as Hugging Face's losses are: 0 / 0 over no tokens."""
    logits = model(batch["ids"])
    total = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORED, reduction="sum")
    return total / (batch["labels"] != IGNORED).sum()


@pytest.mark.parametrize("loss", [mean_over_tokens, _mean_over_nothing], ids=["cross_entropy mean", "sum over count"])
@pytest.mark.parametrize("initial", [None, 2, "auto"])
def test_a_batch_that_counts_nothing_gives_what_the_whole_batch_gives_split_or_not(
    loss: Callable[[torch.nn.Module, dict[str, torch.Tensor]], torch.Tensor], initial: int | str | None
) -> None:
    """A mean over no items is the loss's own business (nan here): split or not, whatever the memory, the same.

    ``"auto"``: an estimated first size on a simulated device, its first micro-batch measured.
    """
    model, batch = token_batch(rows=64)
    batch["labels"][:] = IGNORED
    whole = loss(model, batch)
    whole.backward()
    expected = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)
    step = koila.accumulate(lambda batch: loss(model, batch), initial=initial, weight=counted, cache=koila.NoCache())
    with simulated_device("64KiB") if initial == "auto" else contextlib.nullcontext():
        got = step(batch)
    if initial is None:
        assert step.stats.batch_size == 64
    else:  # split: by the size given, or by the estimate on the simulated device
        assert step.stats.batch_size < 64
    torch.testing.assert_close(got, whole.detach(), equal_nan=True)
    for parameter, grad in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(parameter.grad, grad, equal_nan=True)


@pytest.mark.parametrize(
    ("returned", "shown"),
    [
        (-1, "-1"),
        ("many", "'many'"),
        (float("nan"), "nan"),
        (True, "True"),
        (torch.ones(2), "shape (2,)"),
        (torch.tensor(1 + 0j), "shape () and dtype torch.complex64"),  # one element, but no count
    ],
)
def test_weight_must_return_a_count(returned: Any, shown: str) -> None:
    model, batch = token_batch(rows=4)
    step = koila.accumulate(lambda batch: mean_over_tokens(model, batch), initial=2, weight=lambda batch: returned)
    with pytest.raises(ValueError, match="weight= returned") as info:
        step(batch)
    assert shown in str(info.value)


@pytest.mark.parametrize("count", [np.int64(3), np.int32(3), np.float32(3.0)])
def test_weight_may_return_a_numpy_number(count: Any) -> None:
    # mask.numpy().sum() is a numpy int: a count like any other, not "a number >= 0" refused.
    model, batch = token_batch(rows=4)
    step = koila.accumulate(lambda batch: mean_over_tokens(model, batch), initial=2, weight=lambda batch: count)
    loss = step(batch)
    as_int = koila.accumulate(lambda batch: mean_over_tokens(model, batch), initial=2, weight=lambda batch: 3)
    torch.testing.assert_close(loss, as_int(batch), rtol=0, atol=0)


def test_weight_is_checked_when_decorating() -> None:
    with pytest.raises(TypeError, match="weight must be a callable .* got int 3"):
        koila.accumulate(weight=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reduction='sum' adds them unweighted: drop one of them"):
        koila.accumulate(weight=counted, reduction="sum")


@pytest.mark.parametrize("initial", [None, "auto"])
def test_weight_is_not_called_when_the_whole_batch_runs(initial: str | None) -> None:
    """``"auto"`` too, whose measured whole batch was counted twice."""
    model, batch = token_batch(rows=4)
    calls: list[int] = []

    def weight(batch: dict[str, torch.Tensor]) -> int:
        calls.append(1)
        return 1

    step = koila.accumulate(lambda batch: mean_over_tokens(model, batch), initial=initial, weight=weight)
    with simulated_device("1GiB") if initial == "auto" else contextlib.nullcontext():
        step(batch)
    assert step.stats.batch_size == 4
    assert calls == []


def test_weight_counts_a_split_that_initial_auto_measures_once_ahead_and_once_per_micro_batch() -> None:
    """The first micro-batch is counted once, the rows after it once whole (their sizes follow its measure), then each.

    The first was counted twice, and so was the whole batch when it ran at once.
    """
    model, batch = token_batch(rows=64)
    rows: list[int] = []

    def weight(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        rows.append(len(batch["labels"]))
        return counted(batch)

    step = koila.accumulate(lambda batch: mean_over_tokens(model, batch), initial="auto", weight=weight)
    with simulated_device("64KiB"):
        step(batch)
    first, rest, *later = rows
    assert first < 64
    assert first + rest == 64
    assert sum(later) == rest
    assert len(later) == -(-rest // step.stats.batch_size)
