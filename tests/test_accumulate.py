"""koila.accumulate: a training step split into micro-batches gives the full batch's gradient."""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import sys
import threading
import warnings
import weakref
from collections import namedtuple
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest
import torch
from _dispatch import FailCombining
from _layers import OOMInBackward, Recompute
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

import koila_retry as koila
from koila_retry.testing import make_oom, simulated_device

# float64 throughout: a split step and the full one differ only by summation order.
DTYPE = torch.float64
RTOL, ATOL = 1e-5, 1e-10
# Inside a simulated device the cache key's free-memory bucket is the simulated one: a roomy
# limit pins it, so that calls from one line share a key whatever the machine's free memory.
ROOMY = "1000MiB"


# --------------------------------------------------------------------------- helpers


def data(n: int, *shape: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, generator=generator, dtype=DTYPE)


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model=4, nhead=2, dim_feedforward=8, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(dim=1))


class Recurrent(nn.Module):
    def __init__(self, batch_first: bool = True) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.lstm = nn.LSTM(3, 5, batch_first=batch_first)
        self.head = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out[:, -1] if self.batch_first else out[-1])


class Embedder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(12, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(tokens).mean(dim=1))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 1))


# Each model, tiny, and a batch of n inputs for it.
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int], torch.Tensor]]] = {
    "mlp": (mlp, lambda n: data(n, 6)),
    "cnn": (cnn, lambda n: data(n, 2, 4, 4)),
    "transformer": (Transformer, lambda n: data(n, 3, 4)),
    "lstm": (Recurrent, lambda n: data(n, 4, 3)),
    "embedding": (Embedder, lambda n: torch.randint(0, 12, (n, 3), generator=torch.Generator().manual_seed(0))),
}


def build(name: str, n: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    make_model, make_inputs = MODELS[name]
    torch.manual_seed(0)
    return make_model().double(), make_inputs(n), data(n, 1, seed=1)


def full_step(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, reduction: str = "mean"
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The plain step on the whole batch: its loss and every parameter's gradient; grads left as found."""
    saved = [p.grad for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    loss = F.mse_loss(model(x), y, reduction=reduction)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]  # every model here uses all its parameters
    for p, grad in zip(model.parameters(), saved):
        p.grad = grad
    return loss.detach(), grads


def assert_grads(model: nn.Module, expected: list[torch.Tensor], *, rtol: float = RTOL, atol: float = ATOL) -> None:
    for (name, p), want in zip(model.named_parameters(), expected, strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, want, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


class Snapshot:
    """Every parameter's ``.grad``: the tensor object and a copy of its values (or None)."""

    def __init__(self, model: nn.Module) -> None:
        self.params = list(model.parameters())
        self.objects = [p.grad for p in self.params]
        self.values = [None if g is None else g.clone() for g in self.objects]

    def assert_unchanged(self) -> None:
        for p, obj, value in zip(self.params, self.objects, self.values, strict=True):
            if obj is None:
                assert p.grad is None
            else:
                assert p.grad is obj, "the same tensor object"
                assert torch.equal(p.grad, value)

    def assert_added(self, step_grads: list[torch.Tensor]) -> None:
        """Each grad is the one from before (same object) plus the step's, added once."""
        for p, obj, value, step in zip(self.params, self.objects, self.values, step_grads, strict=True):
            if obj is None:
                torch.testing.assert_close(p.grad, step, rtol=RTOL, atol=ATOL)
            else:
                assert p.grad is obj, "the same tensor object"
                torch.testing.assert_close(p.grad, value + step, rtol=RTOL, atol=ATOL)


def give_grads(model: nn.Module, which: Callable[[int], bool] = lambda i: True) -> None:
    """Set known nonzero ``.grad`` values on the parameters ``which`` picks (by index); None on the rest."""
    for i, p in enumerate(model.parameters()):
        p.grad = torch.full_like(p, 0.25 * (i + 1)) + data(p.numel(), seed=100 + i).view_as(p) if which(i) else None


def peak_bytes(run: Callable[[], object]) -> int:
    """The most bytes ``run`` had alive at once, measured on a simulated device with room to spare."""
    with simulated_device("1GiB") as device:
        run()
    return device.peak


class Inject(nn.Module):
    """An identity layer that runs out of memory, in forward or in backward, on chosen forward calls.

    ``at`` picks the numbers of the forward calls (from 0, counted once ``armed``) that fail,
    and only while the micro-batch has more than ``above`` rows, so a retry at a smaller
    size can succeed.
    """

    def __init__(self, where: str, at: Callable[[int], bool], above: int = 4) -> None:
        super().__init__()
        self.where, self.at, self.above = where, at, above
        self.armed = False
        self.rows: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.armed:
            return x
        call = len(self.rows)
        self.rows.append(x.shape[0])
        if self.at(call) and x.shape[0] > self.above:
            if self.where == "forward":
                raise make_oom()
            return OOMInBackward.apply(x)
        return x


def injected_mlp(inject: Inject) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), inject, nn.Linear(8, 1)).double()


# --------------------------------------------------------------------------- 1. gradients equal the full step's


def recording_step(model: nn.Module, initial: int, reduction: str) -> tuple[Any, list[int]]:
    """Return a mean-squared-error step split at ``initial`` rows, and the rows of its every forward."""
    seen: list[int] = []

    @koila.accumulate(initial=initial, reduction=reduction)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        seen.append(x.shape[0])
        return F.mse_loss(model(x), y, reduction=reduction)

    return step, seen


@pytest.mark.parametrize(("n", "initial", "sizes"), [(1000, 512, [512, 488]), (9, 8, [8, 1])])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_split_step_matches_full_step(name: str, reduction: str, n: int, initial: int, sizes: list[int]) -> None:
    model, x, y = build(name, n)
    expected_loss, expected_grads = full_step(model, x, y, reduction)
    step, seen = recording_step(model, initial, reduction)
    loss = step(x, y)
    assert seen == sizes, "split into powers of two, the last taking the remainder"
    assert step.stats.batch_size == initial
    assert not loss.requires_grad
    torch.testing.assert_close(loss, expected_loss, rtol=RTOL, atol=ATOL)
    assert_grads(model, expected_grads)


def test_split_along_dim_1_matches_full_step() -> None:
    """A sequence-first LSTM: rows along dim 1, and the other arguments split along it too."""
    torch.manual_seed(0)
    model = Recurrent(batch_first=False).double()
    x, y = data(13, 4, 3).transpose(0, 1), data(13, 1, seed=1).t()  # (seq, batch, 3) and (1, batch)
    expected_loss, expected_grads = full_step(model, x, y.t())

    @koila.accumulate(initial=4, dim=1)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        assert x.shape[1] == y.shape[1] <= 4
        return F.mse_loss(model(x), y.t())

    torch.testing.assert_close(step(x, y), expected_loss, rtol=RTOL, atol=ATOL)
    assert_grads(model, expected_grads)


def test_non_tensor_arguments_reach_every_micro_batch_unchanged() -> None:
    model, x, y = build("mlp", 20)
    expected_loss, expected_grads = full_step(model, x, y)
    scales: list[object] = []

    @koila.accumulate(initial=8)
    def step(x: torch.Tensor, scale: float, *, y: torch.Tensor) -> torch.Tensor:
        scales.append(scale)
        return F.mse_loss(model(x), y) * scale

    loss = step(x, 3.0, y=y)  # y, a keyword tensor, is split as well
    assert scales == [3.0, 3.0, 3.0]
    torch.testing.assert_close(loss, expected_loss * 3, rtol=RTOL, atol=ATOL)
    assert_grads(model, [g * 3 for g in expected_grads])


# --------------------------------------------------------------------------- 2. split by a real OOM


@pytest.mark.parametrize("name", sorted(MODELS))
def test_split_forced_by_real_oom_matches_full_step(name: str) -> None:
    model, x, y = build(name, 256)
    expected_loss, expected_grads = full_step(model, x, y)
    # Room for about half the whole step: the whole batch runs out of memory, a part fits.
    limit = int(peak_bytes(lambda: full_step(model, x, y)) * 0.6)

    @koila.accumulate
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)

    with simulated_device(limit):
        loss = step(x, y)
    assert step.stats.ooms >= 1
    assert step.stats.batch_size < 256
    torch.testing.assert_close(loss, expected_loss, rtol=RTOL, atol=ATOL)
    assert_grads(model, expected_grads)


# --------------------------------------------------------------------------- 3. OOM in micro-batch k


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("k", [0, 1, 2], ids=["first", "second", "last"])
def test_oom_in_micro_batch_k_discards_the_step_and_adds_grads_once(where: str, k: int) -> None:
    inject = Inject(where, at=lambda call: call == k)
    model = injected_mlp(inject)
    x, y = data(40, 6), data(40, 1, seed=1)
    expected_loss, expected_grads = full_step(model, x, y)
    inject.armed = True
    # Grads on the first layer and None on the last: a backward that fails half-way has
    # already written the last layer's.
    give_grads(model, lambda i: i < 2)
    before = Snapshot(model)

    events: list[koila.OOMEvent] = []

    @koila.accumulate(initial=16, on_oom=events.append)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)

    loss = step(x, y)
    assert inject.rows == [16, 16, 8][: k + 1] + [8] * 5, "the whole step again, at the next size"
    assert [(event.batch_size, event.next_batch_size) for event in events] == [(16, 8)]
    assert step.stats.ooms == 1
    assert step.stats.batch_size == 8
    torch.testing.assert_close(loss, expected_loss, rtol=RTOL, atol=ATOL)
    before.assert_added(expected_grads)


class Routed(nn.Module):
    """A shared layer, and an expert only for the rows whose first input is above 1 (a mixture of experts)."""

    def __init__(self, inject: Inject) -> None:
        super().__init__()
        self.shared, self.expert, self.inject = nn.Linear(6, 1), nn.Linear(6, 1), inject

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inject(self.shared(x))
        routed = x[:, 0] > 1
        if routed.any():  # rows no expert serves leave it out of the graph
            out = out + routed.unsqueeze(1) * self.expert(x)
        return out


@pytest.mark.parametrize("before", [True, False], ids=["grads-before", "no-grads-before"])
def test_parameter_reached_only_by_a_later_micro_batch(before: bool) -> None:
    """The expert's grads are written first by micro-batch 1; micro-batch 2 runs out of memory."""
    inject = Inject("forward", at=lambda call: call == 2)
    torch.manual_seed(0)
    model = Routed(inject).double()
    x, y = data(24, 6), data(24, 1, seed=1)
    x[:, 0] = -5.0
    x[9:12, 0] = 5.0  # routed rows, in the second micro-batch of 8 only
    expected_loss, expected_grads = full_step(model, x, y)  # the expert included
    inject.armed = True
    give_grads(model, lambda i: before)
    snapshot = Snapshot(model)

    @koila.accumulate(initial=8)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)

    loss = step(x, y)
    assert inject.rows == [8, 8, 8] + [4] * 6
    torch.testing.assert_close(loss, expected_loss, rtol=RTOL, atol=ATOL)
    snapshot.assert_added(expected_grads)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("where", ["inside", "after"])
@pytest.mark.parametrize("form", ["module", "partial-of-forward", "partial-of-call"])
def test_checkpointed_module_grads_are_discarded_on_oom(where: str, reentrant: bool, form: str) -> None:
    """Reentrant checkpointing writes its module's grads in a backward of its own, out of the graph's sight.

    ``form``: what is checkpointed. Hugging Face checkpoints a layer as ``partial(forward, layer, **kwargs)``
    (transformers 5) or ``partial(super().__call__, **kwargs)`` (transformers 4).
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Sequential(nn.Linear(6, 8), nn.Tanh()), nn.Linear(8, 1)).double()
    stem, block, head = model
    run = {
        "module": block,
        "partial-of-forward": functools.partial(type(block).forward, block),
        "partial-of-call": functools.partial(block.__call__),
    }[form]
    x, y = data(40, 6), data(40, 1, seed=1)
    expected_loss, expected_grads = full_step(model, x, y)
    give_grads(model, lambda i: i % 2 == 0)
    snapshot = Snapshot(model)
    calls: list[int] = []

    @koila.accumulate(initial=16)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        fail = len(calls) == 2
        h = stem(x)
        if fail and where == "inside":  # runs after the checkpoint's backward wrote the block's grads
            h = OOMInBackward.apply(h)
        h = torch.utils.checkpoint.checkpoint(run, h, use_reentrant=reentrant)
        if fail and where == "after":  # runs before it: only micro-batch 0 wrote the block's grads
            h = OOMInBackward.apply(h)
        return F.mse_loss(head(h), y)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = step(x, y)
    assert calls == [16, 16] + [8] * 5
    torch.testing.assert_close(loss, expected_loss, rtol=RTOL, atol=ATOL)
    snapshot.assert_added(expected_grads)


def test_checkpointed_function_that_is_not_a_module_warns_once() -> None:
    torch.manual_seed(0)
    stem, block = nn.Linear(6, 6).double(), nn.Linear(6, 1).double()

    @koila.accumulate(initial=4)
    def step(x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(lambda h: block(h), stem(x), use_reentrant=True).pow(2).mean()

    def twice() -> None:
        for _ in range(2):
            step(data(8, 6))

    caught = recorded(twice)
    assert len(caught) == 1
    assert "use_reentrant" in str(caught[0].message)
    assert caught[0].filename == __file__


class _Recomputed(nn.Module):
    """A block run through :class:`Recompute`: inside another, a backward inside a node of a backward."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, Recompute.apply(self.block, h))


@pytest.mark.parametrize("depth", [1, 2], ids=["one", "one-inside-another"])
@pytest.mark.parametrize("where", ["inside", "after", "gives-up"])
@pytest.mark.parametrize("before", [True, False], ids=["grads-before", "no-grads-before"])
def test_a_functions_own_backward_writes_count_once_and_go_with_a_failed_attempt(
    where: str, before: bool, depth: int
) -> None:
    # Two deep (a recomputation inside a recomputation), the inner backward ran in a graph task of its own,
    # which the step did not take: a failed attempt's gradient stayed in .grad, silently.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Sequential(nn.Linear(6, 8), nn.Tanh()), nn.Linear(8, 1)).double()
    stem, block, head = model
    run = block if depth == 1 else _Recomputed(block)
    x, y = data(40, 6), data(40, 1, seed=1)
    expected_loss, expected_grads = full_step(model, x, y)
    give_grads(model, lambda i: before and i % 2 == 0)
    snapshot = Snapshot(model)
    calls: list[int] = []

    @koila.accumulate(initial=16, minimum=16 if where == "gives-up" else 1)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        fail = len(calls) == 2
        h = stem(x)
        if fail and where != "after":  # runs after the Function's backward wrote the block's grads
            h = OOMInBackward.apply(h)
        h = Recompute.apply(run, h)
        if fail and where == "after":  # runs before it
            h = OOMInBackward.apply(h)
        return F.mse_loss(head(h), y)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if where == "gives-up":
            with pytest.raises(koila.BatchSizeExhausted):
                step(x, y)
            snapshot.assert_unchanged()
            return
        loss = step(x, y)
    assert calls == [16, 16] + [8] * 5
    torch.testing.assert_close(loss, expected_loss, rtol=RTOL, atol=ATOL)
    snapshot.assert_added(expected_grads)


class _PlainWeights(nn.Module):
    """A block whose weights are plain tensors that need a gradient, not parameters, as older code has them."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = data(6, 8, seed=3).requires_grad_()
        self.bias = data(8, seed=4).requires_grad_()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h @ self.weight + self.bias)


@pytest.mark.parametrize("checkpoint", ["function", "reentrant"])
@pytest.mark.parametrize("where", ["inside", "after", "gives-up"])
@pytest.mark.parametrize("before", [True, False], ids=["grads-before", "no-grads-before"])
def test_plain_tensors_a_backward_inside_a_node_writes_count_once_and_go_with_a_failed_attempt(
    checkpoint: str, where: str, before: bool
) -> None:
    """Their gradients were left to the backward: a failed attempt's stayed, added into the retry's."""
    torch.manual_seed(0)
    stem, block, head = nn.Linear(6, 6).double(), _PlainWeights(), nn.Linear(8, 1).double()
    tensors = [*stem.parameters(), block.weight, block.bias, *head.parameters()]

    def forward(x: torch.Tensor, fail: str | None = None) -> torch.Tensor:
        h = stem(x)
        if fail == "inside":  # runs after the block's own backward wrote its .grad
            h = OOMInBackward.apply(h)
        if checkpoint == "function":
            h = Recompute.apply(block, h)
        else:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=True)
        if fail == "after":  # runs before it
            h = OOMInBackward.apply(h)
        return head(h)

    x, y = data(40, 6), data(40, 1, seed=1)
    F.mse_loss(forward(x), y).backward()
    expected = [tensor.grad.clone() for tensor in tensors]
    given = [data(t.numel(), seed=100 + i).view_as(t) if before and i % 2 else None for i, t in enumerate(tensors)]
    for tensor, grad in zip(tensors, given, strict=True):
        tensor.grad = None if grad is None else grad.clone()
    calls: list[int] = []

    @koila.accumulate(initial=16, minimum=16 if where == "gives-up" else 1)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return F.mse_loss(forward(x, ("after" if where == "after" else "inside") if len(calls) == 2 else None), y)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if where == "gives-up":
            with pytest.raises(koila.BatchSizeExhausted):
                step(x, y)
        else:
            step(x, y)
    _assert_added(tensors, expected, given, gave_up=where == "gives-up")
    assert calls == ([16, 16] if where == "gives-up" else [16, 16] + [8] * 5)


def _assert_added(
    tensors: list[torch.Tensor], expected: list[torch.Tensor], given: list[torch.Tensor | None], gave_up: bool
) -> None:
    """Each tensor's .grad: what was given before the step, plus the step's gradient unless it gave up."""
    for index, (tensor, want, grad) in enumerate(zip(tensors, expected, given, strict=True)):
        wanted = grad if gave_up else want if grad is None else want + grad
        if wanted is None:
            assert tensor.grad is None, index
        else:
            torch.testing.assert_close(tensor.grad, wanted, rtol=RTOL, atol=ATOL, msg=lambda m, i=index: f"{i}: {m}")


@pytest.mark.parametrize("checkpoint", ["function", "reentrant"])
@pytest.mark.parametrize("gives_up", [False, True], ids=["retried", "gives-up"])
@pytest.mark.parametrize("before", [True, False], ids=["grads-before", "no-grads-before"])
def test_plain_tensors_written_in_a_node_then_by_the_graph_keep_nothing_of_a_failed_attempt(
    checkpoint: str, gives_up: bool, before: bool
) -> None:
    """Checkpointed only in micro-batches of more than 8 rows, the block's weights are reached by the graph after.

    The step set their gradient aside as one from before the step when the graph first reached them,
    though it was the step's own, written in the node: a failed attempt's part of it stayed.
    """
    torch.manual_seed(0)
    stem, block, head = nn.Linear(6, 6).double(), _PlainWeights(), nn.Linear(8, 1).double()
    tensors = [*stem.parameters(), block.weight, block.bias, *head.parameters()]

    def forward(x: torch.Tensor, fail: bool = False) -> torch.Tensor:
        h = stem(x)
        if x.shape[0] <= 8:
            h = block(h)
        elif checkpoint == "function":
            h = Recompute.apply(block, h)
        else:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=True)
        return head(OOMInBackward.apply(h) if fail else h)

    x, y = data(40, 6), data(40, 1, seed=1)
    F.mse_loss(forward(x), y).backward()
    expected = [tensor.grad.clone() for tensor in tensors]
    given = [data(t.numel(), seed=100 + i).view_as(t) if before else None for i, t in enumerate(tensors)]
    for tensor, grad in zip(tensors, given, strict=True):
        tensor.grad = None if grad is None else grad.clone()
    calls: list[int] = []

    @koila.accumulate(initial=16, minimum=16 if gives_up else 1, cache=koila.NoCache())
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return F.mse_loss(forward(x, fail=len(calls) == 3), y)  # the 8 rows after two checkpointed 16s

    if gives_up:
        with pytest.raises(koila.BatchSizeExhausted):
            step(x, y)
    else:
        step(x, y)
    _assert_added(tensors, expected, given, gave_up=gives_up)


@pytest.mark.parametrize("hooked", [False, True], ids=["", "hooked"])
@pytest.mark.parametrize("initial", [None, 16], ids=["whole", "split"])
@pytest.mark.parametrize("before", [True, False], ids=["grads-before", "no-grads-before"])
def test_a_backward_with_create_graph_leaves_grad_with_its_graph(
    initial: int | None, before: bool, hooked: bool
) -> None:
    """A Hessian-vector product through ``.grad`` (AdaHessian, Sophia): ``.grad`` was handed over without a graph.

    ``hooked``: a parameter with a tensor hook of the user's, whose sum goes to its AccumulateGrad directly.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    reference = copy.deepcopy(model)
    if hooked:
        for net in (model, reference):
            net[0].weight.register_hook(lambda grad: grad * 2)
    x, y = data(40, 6), data(40, 1, seed=1)
    if before:
        give_grads(model)
        give_grads(reference)

    def hessian_times_ones(net: nn.Module) -> list[torch.Tensor]:
        params = list(net.parameters())
        grads = [p.grad for p in params]
        return list(torch.autograd.grad(grads, params, [torch.ones_like(p) for p in params]))

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Using backward\\(\\) with create_graph")
        F.mse_loss(reference(x), y).backward(create_graph=True)

        @koila.accumulate(initial=initial, backward=lambda loss, **kw: loss.backward(create_graph=True, **kw))
        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(model(x), y)

        step(x, y)
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        assert got.grad is not None
        assert got.grad.requires_grad
        torch.testing.assert_close(got.grad, want.grad, rtol=RTOL, atol=ATOL)
    for got, want in zip(hessian_times_ones(model), hessian_times_ones(reference), strict=True):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("fails", [True, False], ids=["retried", "whole"])
def test_a_backward_inside_another_threads_graph_is_left_to_it(fails: bool) -> None:
    """Another thread's plain training runs a reentrant checkpoint while a step's backward waits in a node."""
    torch.manual_seed(0)
    mine, theirs = nn.Linear(4, 1).double(), nn.Sequential(nn.Linear(4, 4), nn.Tanh()).double()
    inside, done = threading.Event(), threading.Event()

    class Gate(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            if not inside.is_set():
                inside.set()
                done.wait(30)  # the other thread's backward runs now, while this step's waits here
            return grad

    attempts: list[int] = []

    @koila.accumulate(initial=8)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        attempts.append(len(x))
        h = mine(x)
        if fails and len(attempts) == 1:
            h = OOMInBackward.apply(h)  # after the gate: the first attempt fails once the other thread is done
        return F.mse_loss(Gate.apply(h), y)

    xb = data(3, 4, seed=2)
    for p in theirs.parameters():
        p.grad = torch.ones_like(p)
    before = [p.grad for p in theirs.parameters()]
    copies = [p.detach().clone().requires_grad_() for p in theirs.parameters()]
    added = list(torch.autograd.grad(torch.tanh(xb @ copies[0].T + copies[1]).sum(), copies))
    seen: dict[str, Any] = {}

    def other() -> None:
        inside.wait(30)
        torch.utils.checkpoint.checkpoint(theirs, xb.clone().requires_grad_(), use_reentrant=True).sum().backward()
        seen["same"] = [p.grad is b for p, b in zip(theirs.parameters(), before, strict=True)]
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    step(data(8, 4), data(8, 1, seed=1))
    thread.join()
    assert attempts == ([8, 4, 4] if fails else [8])
    assert seen["same"] == [True, True]  # the other thread's .grad was never set aside
    for p, add in zip(theirs.parameters(), added, strict=True):
        torch.testing.assert_close(p.grad, 1 + add, rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------- 4. training


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_training_loop_under_memory_limit_matches_plain_loop(optimizer: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 1)).double()
    reference, start = copy.deepcopy(model), copy.deepcopy(model)
    batches = [(data(128, 6, seed=i), data(128, 1, seed=1000 + i)) for i in range(50)]

    def make(params: Iterator[nn.Parameter]) -> torch.optim.Optimizer:
        if optimizer == "sgd":
            return torch.optim.SGD(params, lr=0.05, momentum=0.9)
        return torch.optim.Adam(params, lr=0.01)

    plain = make(reference.parameters())
    for x, y in batches:
        plain.zero_grad()
        F.mse_loss(reference(x), y).backward()
        plain.step()

    opt = make(model.parameters())

    @koila.accumulate
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)

    limit = int(peak_bytes(lambda: full_step(model, *batches[0])) * 0.6)
    with simulated_device(limit):
        for x, y in batches:
            opt.zero_grad()
            step(x, y)
            opt.step()
    assert step.stats.ooms == 1, "every step after the first starts at the remembered size"
    assert step.stats.batch_size < 128
    assert step.stats.calls == 50
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-7, atol=1e-9)
    assert not torch.allclose(model[0].weight, start[0].weight), "it trained"


# --------------------------------------------------------------------------- 5. BatchNorm


def batchnorm_step(norm: nn.Module, initial: int | None) -> tuple[Callable[..., torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), norm, nn.Linear(4, 1)).double()

    @koila.accumulate(initial=initial)
    def step(x: torch.Tensor) -> torch.Tensor:
        return model(x).pow(2).mean()

    return step, data(12, 6)


def recorded(run: Callable[[], object]) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [w for w in caught if issubclass(w.category, UserWarning)]


@pytest.mark.parametrize("norm", [nn.BatchNorm1d(4), nn.SyncBatchNorm(4)], ids=["BatchNorm1d", "SyncBatchNorm"])
def test_batchnorm_in_a_split_step_warns_once_at_the_caller(norm: nn.Module) -> None:
    step, x = batchnorm_step(norm, initial=4)  # micro-batches of 4 rows: BatchNorm can train on them

    def three_calls() -> None:
        for _ in range(3):
            step(x)

    caught = recorded(three_calls)
    assert len(caught) == 1
    assert "BatchNorm layer in training mode" in str(caught[0].message)
    assert caught[0].filename == __file__
    # Once per decorated function: another one warns on its own.
    other, _ = batchnorm_step(nn.BatchNorm1d(4), initial=4)
    assert len(recorded(lambda: other(x))) == 1


def test_batchnorm_in_a_split_caused_by_oom_warns() -> None:
    inject = Inject("forward", at=lambda call: True)  # every micro-batch of more than 4 rows runs out of memory
    inject.armed = True
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4), inject, nn.Linear(4, 1)).double()

    @koila.accumulate
    def step(x: torch.Tensor) -> torch.Tensor:
        return model(x).pow(2).mean()

    caught = recorded(lambda: step(data(12, 6)))
    assert inject.rows == [12, 8, 4, 4, 4]
    assert len(caught) == 1
    assert "BatchNorm layer in training mode" in str(caught[0].message)
    assert caught[0].filename == __file__


class RoutedNorm(nn.Module):
    """A BatchNorm only for the rows whose first input is above 1."""

    def __init__(self) -> None:
        super().__init__()
        self.shared, self.norm = nn.Linear(6, 1), nn.BatchNorm1d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = x[:, 0] > 1
        out = self.shared(x)
        if routed.any():
            out = out + routed.unsqueeze(1) * self.norm(x).sum(dim=1, keepdim=True)
        return out


def test_batchnorm_only_in_a_later_micro_batch_warns() -> None:
    torch.manual_seed(0)
    model = RoutedNorm().double()
    x = data(12, 6)
    x[:, 0] = -5.0
    x[4:8, 0] = 5.0  # routed rows: the second micro-batch of 4, all of it

    @koila.accumulate(initial=4)
    def step(x: torch.Tensor) -> torch.Tensor:
        return model(x).pow(2).mean()

    caught = recorded(lambda: step(x))
    assert model.norm.num_batches_tracked.item() == 1, "the BatchNorm trained on one micro-batch"
    assert len(caught) == 1


@pytest.mark.parametrize(
    ("norm", "initial", "train"),
    [
        (nn.BatchNorm1d(4), None, True),  # the batch fits: no split
        (nn.BatchNorm1d(4), 12, True),  # initial is the whole batch
        (nn.BatchNorm1d(4), 4, False),  # split, in eval mode
        (nn.GroupNorm(2, 4), 4, True),
        (nn.LayerNorm(4), 4, True),
    ],
    ids=["fits", "initial-is-batch", "eval", "GroupNorm", "LayerNorm"],
)
def test_no_batchnorm_warning_without_a_split_training_batchnorm(
    norm: nn.Module, initial: int | None, train: bool
) -> None:
    step, x = batchnorm_step(norm, initial)
    norm.train(train)

    def twice() -> None:
        step(x)
        step(x)

    assert recorded(twice) == []


def instancenorm_step(norm: nn.Module, initial: int) -> tuple[Callable[..., torch.Tensor], nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(3, 4, 3), norm, nn.Flatten(), nn.Linear(4 * 6, 1)).double()

    @koila.accumulate(initial=initial)
    def step(x: torch.Tensor) -> torch.Tensor:
        return model(x).pow(2).mean()

    return step, model


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("running", [False, True], ids=["no-running-stats", "running-stats"])
@pytest.mark.parametrize("initial", [4, 1])  # one row: as BatchNorm's graph on one row, told apart by the modules
def test_instancenorm_in_a_split_step_is_exact_and_warns_of_no_batchnorm(
    train: bool, running: bool, initial: int
) -> None:
    """InstanceNorm runs batch normalisation on a batch of one row: each row normalised alone, split or not."""
    x = torch.randn(12, 3, 8, dtype=torch.float64)
    step, model = instancenorm_step(nn.InstanceNorm1d(4, affine=True, track_running_stats=running), initial=initial)
    model.train(train)
    assert recorded(lambda: step(x)) == []
    split = [parameter.grad.clone() for parameter in model.parameters()]
    model.zero_grad()
    model(x).pow(2).mean().backward()
    for got, expected in zip(split, (parameter.grad for parameter in model.parameters()), strict=True):
        torch.testing.assert_close(got, expected)


def test_batchnorm_on_micro_batches_of_one_row_warns() -> None:
    """A BatchNorm2d can train on one row (its statistics over the pixels): split to one row, it differs, and warns."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.Flatten(), nn.Linear(3 * 4 * 4, 1)).double()

    @koila.accumulate(initial=1)
    def step(x: torch.Tensor) -> torch.Tensor:
        return model(x).pow(2).mean()

    caught = recorded(lambda: step(torch.randn(3, 2, 6, 6, dtype=torch.float64)))
    assert len(caught) == 1
    assert "BatchNorm layer in training mode" in str(caught[0].message)


def test_batchnorm_beside_instancenorm_on_micro_batches_of_one_row_warns() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3), nn.InstanceNorm2d(3), nn.BatchNorm2d(3), nn.Flatten(), nn.Linear(3 * 4 * 4, 1)
    ).double()

    @koila.accumulate(initial=1)
    def step(x: torch.Tensor) -> torch.Tensor:
        return model(x).pow(2).mean()

    caught = recorded(lambda: step(torch.randn(3, 2, 6, 6, dtype=torch.float64)))
    assert [str(warning.message)[:60] for warning in caught] == [
        "koila.accumulate split a step of test_batchnorm_beside_insta"
    ]
    assert "BatchNorm layer in training mode" in str(caught[0].message)


# --------------------------------------------------------------------------- 6. errors


def test_tensors_of_different_sizes_are_named_before_anything_runs() -> None:
    model, x, y = build("mlp", 10)
    give_grads(model)
    before = Snapshot(model)
    calls: list[int] = []

    @koila.accumulate(initial=4)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return F.mse_loss(model(x), y)

    with pytest.raises(ValueError) as positional:
        step(x, y[:9])
    with pytest.raises(ValueError) as keyword:
        step(x, y=y[:9])
    for excinfo in (positional, keyword):
        assert "the tensor x has 10, the tensor y has 9" in str(excinfo.value)
    assert calls == []
    before.assert_unchanged()


@pytest.mark.parametrize(
    "result",
    [
        lambda loss: None,
        lambda loss: loss.item(),
        lambda loss: (),
        lambda loss: [],
        lambda loss: {"logits": loss},
        lambda loss: {"Loss": loss},
    ],
    ids=["None", "item", "empty-tuple", "empty-list", "dict-without-loss", "dict-wrong-key"],
)
@pytest.mark.parametrize("initial", [None, 4])
def test_result_without_a_loss_is_a_type_error(result: Callable[[torch.Tensor], Any], initial: int | None) -> None:
    model, x, y = build("mlp", 10)
    give_grads(model)
    before = Snapshot(model)

    @koila.accumulate(initial=initial)
    def step(x: torch.Tensor, y: torch.Tensor) -> Any:
        return result(F.mse_loss(model(x), y))

    with pytest.raises(TypeError) as excinfo:
        step(x, y)
    assert "loss" in str(excinfo.value)
    assert "step" in str(excinfo.value), "names the function"
    before.assert_unchanged()


def test_a_micro_batch_without_a_loss_is_said_to_be_one() -> None:
    # A step whose last rows are all masked returns None for them alone: only once split.
    model, x, y = build("mlp", 10)
    before = Snapshot(model)

    @koila.accumulate(initial=4)
    def step(x: torch.Tensor, y: torch.Tensor) -> Any:
        return None if len(x) < 4 else F.mse_loss(model(x), y)

    with pytest.raises(TypeError, match="returned None") as excinfo:
        step(x, y)
    if sys.version_info >= (3, 11):  # exceptions have notes
        assert excinfo.value.__notes__ == [
            "It was returned for a micro-batch of 2 rows; the micro-batches before it in the step returned a loss."
        ]
    before.assert_unchanged()


def test_non_scalar_loss_names_its_shape() -> None:
    model, x, y = build("mlp", 10)
    give_grads(model)
    before = Snapshot(model)

    @koila.accumulate
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y, reduction="none")

    with pytest.raises(ValueError) as excinfo:
        step(x, y)
    assert "(10, 1)" in str(excinfo.value)
    before.assert_unchanged()


@pytest.mark.parametrize("initial", [None, 4])
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize(
    "returned",
    [
        lambda out: (out > 0).sum(),
        lambda out: (out > 0).any(),
        lambda out: ((out > 0).sum(), out.mean()),
        lambda out: torch.complex(out.mean(), out.sum()),
    ],
    ids=["count", "flag", "count-first-in-a-tuple", "complex"],
)
def test_a_loss_that_is_not_floating_point_is_refused(
    initial: int | None, grad: bool, returned: Callable[[torch.Tensor], Any]
) -> None:
    # Weighted by each micro-batch's rows, a count became 0.6 and a flag 2 only when the step was split.
    model, x, y = build("mlp", 10)
    give_grads(model)
    before = Snapshot(model)

    @koila.accumulate(initial=initial, cache=koila.NoCache())
    def step(x: torch.Tensor, y: torch.Tensor) -> Any:
        return returned(model(x))

    with (
        torch.set_grad_enabled(grad),
        pytest.raises(TypeError, match=r"step returned a loss of dtype torch\.(int64|bool|complex\d+)"),
    ):
        step(x, y)
    before.assert_unchanged()

    @koila.accumulate(initial=initial, cache=koila.NoCache())
    def beside(x: torch.Tensor, y: torch.Tensor) -> Any:
        out = model(x)
        return F.mse_loss(out, y), (out > 0).sum()  # a count beside the loss: added up, in its own type

    with torch.set_grad_enabled(grad):
        loss, count = beside(x, y)
    assert loss.dtype == x.dtype
    assert count.dtype == torch.int64
    assert count.item() == int((model(x) > 0).sum())


@pytest.mark.parametrize("initial", [None, 4])
def test_detached_loss_names_the_module(initial: int | None) -> None:
    model, x, y = build("mlp", 10)
    give_grads(model, lambda i: i % 2 == 0)
    before = Snapshot(model)

    @koila.accumulate(initial=initial)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y).detach()

    with pytest.raises(RuntimeError) as excinfo:
        step(x, y)
    assert "'model'" in str(excinfo.value)
    assert "Sequential" in str(excinfo.value)
    before.assert_unchanged()


def test_detached_loss_with_the_model_passed_as_an_argument() -> None:
    model, x, y = build("mlp", 10)

    @koila.accumulate
    def step(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(net(x), y).detach()

    with pytest.raises(RuntimeError) as excinfo:
        step(model, x, y)
    assert "Sequential" in str(excinfo.value)
    assert all(p.grad is None for p in model.parameters())


def test_a_frozen_models_loss_beside_a_trainable_model_in_a_dict_is_not_refused() -> None:
    # Which models of a dict the step uses is not known: refusing for the trainable one it does not use
    # broke an evaluation of the frozen one under grad mode.
    teacher, student = nn.Linear(3, 1).double().requires_grad_(False), nn.Linear(3, 1).double()
    models = {"teacher": teacher, "student": student}
    x, y = data(8, 3), data(8, 1, seed=1)

    @koila.accumulate(cache=koila.NoCache())
    def evaluate(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(models["teacher"](x), y)

    torch.testing.assert_close(evaluate(x, y), F.mse_loss(teacher(x), y))
    assert student.weight.grad is None


# Results that are fine for 8 rows and wrong for fewer: only the last micro-batch (4 rows) is bad.
LATE_FAILURES: dict[str, tuple[Callable[[torch.Tensor], Any], type[Exception], str]] = {
    "non-scalar": (lambda loss: loss.expand(2), ValueError, "(2,)"),
    "no-loss": (lambda loss: None, TypeError, "None"),
    "other-structure": (lambda loss: (loss, 1.0), ValueError, "different structures"),
}


def test_a_dict_whose_keys_come_in_another_order_in_a_micro_batch_is_matched_by_key() -> None:
    """It was refused only when the step was split: whether a step raises must not depend on the memory."""
    model, x, y = build("mlp", 20)
    first = x[0].clone()

    def step(x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        loss = F.mse_loss(model(x), y)
        parts = {"loss": loss, "rows": torch.tensor(len(x)), "scores": model(x).detach()}
        return parts if torch.equal(x[0], first) else {key: parts[key] for key in ("scores", "rows", "loss")}

    whole = step(x, y)
    whole["loss"].backward()
    expected = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()
    split = koila.accumulate(step, initial=8)(x, y)
    assert list(split) == ["loss", "rows", "scores"]  # the first micro-batch's order
    torch.testing.assert_close(split["loss"], whole["loss"].detach())
    assert int(split["rows"]) == len(x)
    torch.testing.assert_close(split["scores"], whole["scores"])
    for parameter, grad in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(parameter.grad, grad)
    with pytest.raises(ValueError, match="different structures"):  # other keys are still another structure
        koila.accumulate(lambda x, y: {"loss": step(x, y)["loss"], len(x): 1}, initial=8)(x, y)


@pytest.mark.parametrize("failure", sorted(LATE_FAILURES))
def test_bad_result_in_a_later_micro_batch_leaves_grads_as_they_were(failure: str) -> None:
    make_bad, error, shown = LATE_FAILURES[failure]
    model, x, y = build("mlp", 20)
    give_grads(model, lambda i: i < 2)  # and None on the last layer, which the earlier micro-batches wrote
    before = Snapshot(model)
    seen: list[int] = []

    @koila.accumulate(initial=8)
    def step(x: torch.Tensor, y: torch.Tensor) -> Any:
        seen.append(x.shape[0])
        loss = F.mse_loss(model(x), y)
        return loss if x.shape[0] >= 8 else make_bad(loss)

    with pytest.raises(error) as excinfo:
        step(x, y)
    assert shown in str(excinfo.value)
    assert seen == [8, 8, 4]
    before.assert_unchanged()


@pytest.mark.parametrize(
    ("early", "late", "said"),
    [
        (
            lambda x: x.sum(),
            lambda x: None,
            "a value that comes back as None, where the micro-batches before returned a value of the whole micro-batch",
        ),
        (
            lambda x: None,
            lambda x: x.sum(),
            "a value of the whole micro-batch, where the micro-batches before returned a value that comes back as None",
        ),
        (
            lambda x: x,
            lambda x: x.sum(),
            "a value of the whole micro-batch, where the micro-batches before returned one row per row of it",
        ),
        (
            lambda x: 1.5,
            lambda x: 2,
            "a count of the whole micro-batch, where the micro-batches before returned a "
            "value of the whole micro-batch",
        ),
    ],
    ids=["value-then-none", "none-then-value", "rows-then-value", "float-then-int"],
)
def test_an_output_of_another_kind_in_a_later_micro_batch_names_both_kinds(
    early: Callable[[torch.Tensor], Any], late: Callable[[torch.Tensor], Any], said: str
) -> None:
    # The message said "is not one row per row of it, unlike for the micro-batch before" of a None after a
    # 0-d tensor, which is not one row per row either.
    model, x, y = build("mlp", 20)
    before = Snapshot(model)

    @koila.accumulate(initial=8)
    def step(x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
        return {"loss": F.mse_loss(model(x), y), "aux": early(x) if len(x) == 8 else late(x)}

    with pytest.raises(ValueError, match=rf"result\['aux'\] for a micro-batch of 4 rows, {said}: .* present"):
        step(x, y)
    before.assert_unchanged()


@pytest.mark.parametrize("first", [True, False], ids=["loss-first", "loss-second"])
def test_an_entry_that_is_the_loss_in_some_micro_batches_only_is_combined_as_a_value(first: bool) -> None:
    # {"loss": ce + aux, "ce": ce} with the auxiliary term in some micro-batches: where there was none,
    # "ce" was the loss tensor itself, and its kind changed between micro-batches (KeyError; probe 72H).
    model, x, y = build("mlp", 16)
    has_aux = torch.tensor([0] * 8 + [1] * 8)

    def step(x: torch.Tensor, y: torch.Tensor, has_aux: torch.Tensor) -> dict[str, torch.Tensor]:
        ce = F.mse_loss(model(x), y)
        loss = ce + 0.1 * has_aux.double().mean() * model[0].weight.pow(2).sum() if has_aux.any() else ce
        # Not first: the first leaf that is the loss tensor was taken for it, "ce" (probe 72J).
        return {"loss": loss, "ce": ce} if first else {"ce": ce, "loss": loss}

    halves = [step(x[rows], y[rows], has_aux[rows]) for rows in (slice(0, 8), slice(8, 16))]
    sum(part["loss"] for part in halves).backward()
    expected = [p.grad.clone() / 2 for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()
    result = koila.accumulate(step, initial=8)(x, y, has_aux)
    torch.testing.assert_close(result["ce"], sum(part["ce"].detach() for part in halves) / 2)
    torch.testing.assert_close(result["loss"], sum(part["loss"].detach() for part in halves) / 2)
    for parameter, grad in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(parameter.grad, grad)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_value_whose_shape_changes_between_micro_batches_is_refused_before_its_backward(reduction: str) -> None:
    model, x, y = build("mlp", 20)
    give_grads(model, lambda i: i < 2)
    before = Snapshot(model)
    seen: list[int] = []

    @koila.accumulate(initial=8, reduction=reduction)
    def step(x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        seen.append(x.shape[0])
        out = model(x)
        # The outputs of the rows that pass a filter: neither one per row nor one shape (sum broadcast them).
        return {"loss": F.mse_loss(out, y), "positive": out[out > 0].detach()[: len(seen)]}

    with pytest.raises(ValueError, match=r"at the result\['positive'\] for a micro-batch of 8 rows, and a tensor"):
        step(x, y)
    assert seen == [8, 8]  # refused as the second micro-batch's result came, before its backward
    before.assert_unchanged()


def test_rows_returned_in_a_reused_buffer_are_refused_and_a_broadcast_parameter_is_joined() -> None:
    model, x, y = build("mlp", 20)
    buffer = torch.empty(8, 1, dtype=torch.float64)  # a micro-batch's rows: returned whole, so kept as it is
    token = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)

    @koila.accumulate(initial=8)
    def step(x: torch.Tensor, y: torch.Tensor, reuse: bool) -> dict[str, torch.Tensor]:
        out = model(x)
        kept = buffer[: len(x)]
        kept.copy_(out.detach())  # a workspace written each time: the earlier micro-batch's rows are lost
        per_row = kept if reuse else kept.clone()
        return {"loss": F.mse_loss(out, y), "rows": per_row, "token": token.expand(len(x), 3)}

    before = Snapshot(model)
    with pytest.raises(ValueError, match=r"at the result\['rows'\] for a micro-batch of 8 rows, the memory it"):
        step(x, y, True)
    before.assert_unchanged()
    result = step(x, y, False)
    torch.testing.assert_close(result["rows"], model(x).detach())
    assert result["token"].shape == (20, 3)  # the same memory every micro-batch, broadcast: joined as before


def test_rows_in_a_larger_buffer_written_each_micro_batch_are_copied_and_joined() -> None:
    # A view of more memory than its rows is copied as it comes (it would hold all of it till the step
    # ended): the later writes cannot reach the copy, and the rows join as the whole batch's.
    model, x, y = build("mlp", 20)
    buffer = torch.empty(32, 1, dtype=torch.float64)

    @koila.accumulate(initial=8)
    def step(x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        out = model(x)
        buffer[: len(x)].copy_(out.detach())
        return {"loss": F.mse_loss(out, y), "rows": buffer[: len(x)]}

    result = step(x, y)
    assert step.stats.batch_size == 8
    torch.testing.assert_close(result["rows"], model(x).detach())


@pytest.mark.parametrize("where", ["right-aligned", "two-in-turn"])
def test_rows_in_a_buffer_that_an_earlier_micro_batch_returned_are_refused(where: str) -> None:
    # Only the memory of the micro-batch just before was compared: a buffer's tail (8 rows, then 4 that
    # overlap them) or two buffers in turn (A, B, A) joined rows that the later writes had overwritten.
    # The later part, a view of a larger buffer, is copied; the earlier, all of it, is not, and was written.
    model, x, y = build("mlp", 12 if where == "right-aligned" else 20)
    buffers = [torch.empty(8, 1, dtype=torch.float64) for _ in range(2)]
    calls: list[int] = []

    @koila.accumulate(initial=8)
    def step(x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        out = model(x)
        calls.append(len(x))
        kept = buffers[0][-len(x) :] if where == "right-aligned" else buffers[len(calls) % 2][: len(x)]
        kept.copy_(out.detach())
        return {"loss": F.mse_loss(out, y), "rows": kept}

    before = Snapshot(model)
    with pytest.raises(ValueError, match=r"at the result\['rows'\] for a micro-batch of \d rows, the memory it"):
        step(x, y)
    assert calls == ([8, 4] if where == "right-aligned" else [8, 8, 4])
    before.assert_unchanged()


@pytest.mark.parametrize("dim", [0, 1])
def test_views_of_the_input_returned_per_micro_batch_are_joined(dim: int) -> None:
    # Side by side in one storage, and along dim 1 their spans of bytes interleave: no element is shared.
    model, x, y = build("mlp", 20)
    inputs = x if dim == 0 else x.T.contiguous()

    @koila.accumulate(initial=8, dim=dim)
    def step(x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        rows, target = (x, y) if dim == 0 else (x.T, y.T)
        return {"loss": F.mse_loss(model(rows), target), "rows": x}

    result = step(inputs, y if dim == 0 else y.T.contiguous())
    assert torch.equal(result["rows"], inputs)


@pytest.mark.parametrize("write", ["no-grad", "data", "inference"])
def test_a_buffer_passed_in_that_the_step_writes_each_micro_batch_is_refused(write: str) -> None:
    # A scratch buffer passed whole (one row along dim 0): its views were taken for the input's, which a step
    # reads, and the first rows came back as the last micro-batch's (probe 72J); then so did a write that
    # leaves the version counter (.data, an inference tensor) and one with grad on (a view that requires
    # grad was never compared; probe 72K).
    model = nn.Linear(4, 3)
    x, y = torch.randn(16, 4), torch.randn(16, 3)
    with torch.inference_mode(write == "inference"):
        scratch = torch.zeros(1, 16, 3)

    @koila.accumulate(initial=8)
    def step(x: torch.Tensor, y: torch.Tensor, scratch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = scratch[0, : len(x)]
        with torch.no_grad(), torch.inference_mode(write == "inference"):
            hidden = model(x)
            (out.data if write == "data" else out).copy_(hidden)
        return F.mse_loss(model(x), y), out

    with pytest.raises(ValueError, match=r"at the result\[1\] for a micro-batch of 8 rows, the memory it returned"):
        step(x, y, scratch)
    assert model.weight.grad is None


def test_a_buffer_written_with_grad_on_each_micro_batch_is_refused() -> None:
    # bank[:n] = h with grad on makes bank part of the graph: its views require grad and were never compared,
    # and the rows came back as the last micro-batch's (probe 72K).
    model = nn.Linear(4, 3)
    x, y = torch.randn(16, 4), torch.randn(16, 3)
    bank = torch.zeros(8, 3)

    @koila.accumulate(initial=8)
    def step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = model(x)
        bank[: len(x)] = hidden
        return F.mse_loss(hidden, y), bank[: len(x)]

    with pytest.raises(ValueError, match=r"at the result\[1\] for a micro-batch of 8 rows, the memory it returned"):
        step(x, y)
    assert model.weight.grad is None


@pytest.mark.parametrize("returned", ["class-token", "shared-prompt", "expanded-input"])
def test_a_row_broadcast_over_the_rows_is_joined_at_one_row_micro_batches(returned: str) -> None:
    # At one row an expand has no stride 0 to tell it by, and every micro-batch's part starts where the one
    # before did: refused as a reused buffer once memory was tight enough for one row (probe 72L).
    torch.manual_seed(0)
    token = nn.Parameter(torch.randn(1, 1, 4))
    head = nn.Linear(4, 1)
    x, y = torch.randn(8, 3, 4), torch.randn(8, 1)
    prompt = torch.randn(1, 4)  # one row: passed whole to every micro-batch
    positions = torch.arange(4.0).expand(8, 4)

    def step(x: torch.Tensor, y: torch.Tensor, prompt: torch.Tensor, positions: torch.Tensor) -> Any:
        tokens = token.expand(len(x), -1, -1)
        loss = F.mse_loss(head(torch.cat([tokens, x], 1).mean(1)), y)
        if returned == "class-token":
            return loss, tokens
        return loss, prompt.expand(len(x), -1) if returned == "shared-prompt" else positions.reshape(len(x), 2, 2)

    whole = step(x, y, prompt, positions)
    _, joined = koila.accumulate(step, initial=1)(x, y, prompt, positions)
    assert torch.equal(joined, whole[1].detach())


def test_views_of_an_input_whose_rows_overlap_are_joined_at_one_row_micro_batches() -> None:
    # Sliding windows of one series, read only: one-row views overlap each other, which was refused as a
    # reused buffer, and every micro-batch was compared with every earlier one (probe 72H).
    model = nn.Linear(16, 1)
    series = torch.randn(40)
    windows = series.unfold(0, 16, 1)[:8]
    target = torch.randn(8, 1)

    @koila.accumulate(initial=1)
    def step(w: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.mse_loss(model(w), y), w

    loss, joined = step(windows, target)
    assert torch.equal(joined, windows)
    torch.testing.assert_close(loss, F.mse_loss(model(windows), target).detach())


def test_a_number_first_and_a_tensor_later_still_combine_and_outputs_without_memory_join() -> None:
    model, x, y = build("mlp", 12)

    seen: list[int] = []

    @koila.accumulate(initial=4)
    def step(x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
        seen.append(len(x))
        out = model(x)
        aux = 0.0 if len(seen) == 1 else out.detach().mean()  # 0.0 first, as a sum that starts from it
        return {"loss": F.mse_loss(out, y), "aux": aux, "sparse": out.detach().to_sparse()}

    result = step(x, y)
    assert seen == [4, 4, 4]
    assert isinstance(result["aux"], torch.Tensor)
    torch.testing.assert_close(result["sparse"].to_dense(), model(x).detach())  # no memory of its own to compare


@pytest.mark.parametrize("grad_before", [False, True], ids=["grad None", "grad present"])
def test_combining_the_micro_batches_results_is_part_of_the_attempt(grad_before: bool) -> None:
    # Combined after the attempt, an out-of-memory error there escaped as it was, unretried.
    model, x, y = build("mlp", 16)
    if grad_before:
        for parameter in model.parameters():
            parameter.grad = torch.ones_like(parameter)
    loss, expected = full_step(model, x, y)
    events: list[koila.OOMEvent] = []

    @koila.accumulate(initial=8, cache=koila.NoCache(), on_oom=events.append)
    def step(x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        out = model(x)
        return {"loss": F.mse_loss(out, y), "mean": out.detach().mean()}

    with FailCombining() as failing:
        result = step(x, y)
    assert failing.failed
    assert [(event.batch_size, event.next_batch_size) for event in events] == [(8, 4)]
    torch.testing.assert_close(result["loss"], loss)
    torch.testing.assert_close(result["mean"], model(x).detach().mean())
    assert_grads(model, [want + 1 for want in expected] if grad_before else expected)


def sum_over_labelled_rows(model: nn.Module, x: torch.Tensor, y: torch.Tensor, labelled: torch.Tensor) -> torch.Tensor:
    if not labelled.any():  # a common guard: no labelled rows, nothing to learn, a constant zero loss
        return x.new_zeros(())
    return F.mse_loss(model(x[labelled]), y[labelled], reduction="sum")


@pytest.mark.parametrize("unlabelled", ["first", "last"])
def test_micro_batch_whose_loss_needs_no_grad_is_skipped(unlabelled: str) -> None:
    """Only some micro-batches' losses need a gradient: the step works split as it does whole."""
    model, x, y = build("mlp", 8)
    labelled = torch.arange(8) >= 4 if unlabelled == "first" else torch.arange(8) < 4
    sum_over_labelled_rows(model, x, y, labelled).backward()  # the unsplit step works
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)

    @koila.accumulate(initial=4, reduction="sum")
    def step(x: torch.Tensor, y: torch.Tensor, labelled: torch.Tensor) -> torch.Tensor:
        return sum_over_labelled_rows(model, x, y, labelled)

    step(x, y, labelled)
    assert_grads(model, expected)


class Trainer:
    """Holds the model as an attribute, where accumulate does not look for modules that want a gradient."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    @koila.accumulate(initial=4, reduction="sum")
    def step(self, x: torch.Tensor, y: torch.Tensor, labelled: torch.Tensor) -> torch.Tensor:
        return sum_over_labelled_rows(self.model, x, y, labelled)


def test_gradients_of_later_micro_batches_are_not_silently_dropped() -> None:
    """Micro-batch 0's loss needs no grad, and nothing tells that the model wants one: later ones still count."""
    model, x, y = build("mlp", 8)
    labelled = torch.arange(8) >= 4  # micro-batch 0 (rows 0-3) has no labelled row
    _, expected = full_step(model, x[4:], y[4:], "sum")
    Trainer(model).step(x, y, labelled)
    assert all(p.grad is not None for p in model.parameters()), "the step's gradient was dropped"
    assert_grads(model, expected)


class StepFailed(Exception):
    pass


@pytest.mark.parametrize("raised", [StepFailed("micro-batch 2"), KeyboardInterrupt()], ids=["exception", "interrupt"])
@pytest.mark.parametrize("initial", [8, 16])
def test_other_exception_in_micro_batch_2_propagates_and_leaves_grads(raised: BaseException, initial: int) -> None:
    model, x, y = build("mlp", 20)
    give_grads(model, lambda i: i != 1)
    before = Snapshot(model)
    calls: list[int] = []

    @koila.accumulate(initial=initial)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        if len(calls) == 2:
            raise raised
        return F.mse_loss(model(x), y)

    with pytest.raises(type(raised)) as excinfo:
        step(x, y)
    assert excinfo.value is raised
    assert len(calls) == 2
    assert step.stats.ooms == 0
    before.assert_unchanged()


@pytest.mark.parametrize(
    ("options", "tried"),
    [
        ({"minimum": 8}, [40, 32, 16, 8]),
        ({"initial": 16, "minimum": 8}, [16, 8]),
        ({"max_attempts": 2}, [40, 32]),
    ],
)
def test_batch_size_exhausted_leaves_grads_as_they_were(options: dict[str, Any], tried: list[int]) -> None:
    # Every backward of more than 4 rows fails, after writing the last layer's grads.
    inject = Inject("backward", at=lambda call: True, above=4)
    model = injected_mlp(inject)
    x, y = data(40, 6), data(40, 1, seed=1)
    give_grads(model, lambda i: i in (0, 3))
    before = Snapshot(model)
    inject.armed = True

    @koila.accumulate(**options)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)

    with pytest.raises(koila.BatchSizeExhausted) as excinfo:
        step(x, y)
    assert excinfo.value.batch_size == tried[-1]
    assert step.stats.exhausted == 1
    assert inject.rows == tried, "each attempt fails in the backward of its first micro-batch"
    before.assert_unchanged()


async def _coroutine(x: torch.Tensor) -> torch.Tensor:
    return x.sum()


@pytest.mark.parametrize(
    ("options", "error", "shown"),
    [
        ({"reduction": "avg"}, ValueError, "'avg'"),
        ({"reduction": "Mean"}, ValueError, "'Mean'"),
        ({"dim": "0"}, TypeError, "dim"),
        ({"dim": True}, TypeError, "dim"),
        ({"scaler": object()}, TypeError, "scaler"),
        ({"scaler": 3}, TypeError, "(or have its scale()), got int 3"),
        ({"initial": 0}, ValueError, "initial"),
        ({"initial": -4}, ValueError, "initial"),
        ({"minimum": 0}, ValueError, "minimum"),
        ({"initial": 4, "minimum": 8}, ValueError, "minimum"),
    ],
)
def test_bad_options(options: dict[str, Any], error: type[Exception], shown: str) -> None:
    with pytest.raises(error) as excinfo:
        koila.accumulate(**options)(lambda x: x.sum())
    assert shown in str(excinfo.value)


def test_async_function_is_refused() -> None:
    with pytest.raises(TypeError) as excinfo:
        koila.accumulate(_coroutine)
    assert "async" in str(excinfo.value)


def test_batch_of_zero_rows() -> None:
    model, x, y = build("mlp", 10)
    calls: list[int] = []

    @koila.accumulate
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return F.mse_loss(model(x), y)

    with pytest.raises(ValueError) as excinfo:
        step(x[:0], y[:0])
    assert "0 rows" in str(excinfo.value)
    assert calls == []
    assert all(p.grad is None for p in model.parameters())


# --------------------------------------------------------------------------- 7. no backward needed


def test_no_grad_caller_gets_the_loss_and_no_grads() -> None:
    model, x, y = build("mlp", 20)
    expected_loss, _ = full_step(model, x, y)
    give_grads(model, lambda i: i < 2)
    before = Snapshot(model)

    @koila.accumulate(initial=8)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)

    with torch.no_grad():
        loss = step(x, y)
    assert step.stats.batch_size == 8
    torch.testing.assert_close(loss, expected_loss, rtol=RTOL, atol=ATOL)
    before.assert_unchanged()


def test_no_grad_caller_split_by_real_oom() -> None:
    model, x, y = build("mlp", 2000)
    expected_loss, _ = full_step(model, x, y)

    @koila.accumulate
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)

    with torch.no_grad():
        limit = int(peak_bytes(lambda: step.__wrapped__(x, y)) * 0.6)  # type: ignore[attr-defined]
        with simulated_device(limit):
            loss = step(x, y)
    assert step.stats.ooms >= 1
    assert step.stats.batch_size < 2000
    torch.testing.assert_close(loss, expected_loss, rtol=RTOL, atol=ATOL)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("initial", [None, 8])
def test_no_grad_caller_of_a_step_that_turns_grad_on_gets_no_backward(initial: int | None) -> None:
    # A saliency map: the step turns grad on for its own torch.autograd.grad, and its loss requires grad;
    # called under no_grad, as the plain function is, no backward runs, whole or split.
    model, x, y = build("mlp", 20)
    give_grads(model, lambda i: i < 2)
    before = Snapshot(model)

    def saliency(x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        with torch.enable_grad():
            inputs = x.clone().requires_grad_()
            out = model(inputs)
            (grad,) = torch.autograd.grad(out.sum(), inputs, retain_graph=True)
            return {"loss": F.mse_loss(out, y), "saliency": grad}

    def leaky(x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        torch.set_grad_enabled(True)  # for good, not in a with: the caller's mode still decides
        return {"loss": F.mse_loss(model(x), y)}

    for step in (saliency, leaky):
        with torch.no_grad():
            expected = step(x, y)
        with torch.no_grad():
            result = koila.accumulate(step, initial=initial, cache=koila.NoCache())(x, y)
        for key in expected:
            torch.testing.assert_close(result[key], expected[key].detach(), rtol=RTOL, atol=ATOL)
        before.assert_unchanged()


@pytest.mark.parametrize("initial", [None, 4])
def test_a_step_that_turns_grad_off_for_good_trains_every_micro_batch(initial: int | None) -> None:
    # An evaluation helper that forgets to turn grad back on: the split step crashed on its weighted loss,
    # then, once that was mended, ran the later micro-batches' forwards without a graph.
    model, x, y = build("mlp", 20)
    expected_loss, expected = full_step(model, x, y)
    model.zero_grad(set_to_none=True)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        torch.set_grad_enabled(False)
        return loss

    try:
        loss = koila.accumulate(step, initial=initial, cache=koila.NoCache())(x, y)
    finally:
        torch.set_grad_enabled(True)
    torch.testing.assert_close(loss, expected_loss, rtol=RTOL, atol=ATOL)
    for parameter, grad in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(parameter.grad, grad, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("initial", [None, 8])
def test_frozen_model_with_grad_mode_on(initial: int | None) -> None:
    model, x, y = build("mlp", 20)
    expected_loss, _ = full_step(model, x, y)
    model.requires_grad_(False)

    @koila.accumulate(initial=initial)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)

    loss = step(x, y)
    torch.testing.assert_close(loss, expected_loss, rtol=RTOL, atol=ATOL)
    assert all(p.grad is None for p in model.parameters())


# --------------------------------------------------------------------------- 8. other results

Output = namedtuple("Output", ["loss", "logits"])


@pytest.mark.parametrize(
    ("pack", "kind"),
    [
        (lambda loss, logits: (loss, logits), tuple),
        (lambda loss, logits: [loss, logits], list),
        (lambda loss, logits: Output(loss, logits), Output),
    ],
    ids=["tuple", "list", "namedtuple"],
)
@pytest.mark.parametrize("initial", [None, 8])
def test_sequence_result_joins_the_logits(
    pack: Callable[[torch.Tensor, torch.Tensor], Any], kind: type, initial: int | None
) -> None:
    model, x, y = build("mlp", 20)
    expected_loss, expected_grads = full_step(model, x, y)
    with torch.no_grad():
        expected_logits = model(x)

    @koila.accumulate(initial=initial)
    def step(x: torch.Tensor, y: torch.Tensor) -> Any:
        logits = model(x)
        return pack(F.mse_loss(logits, y), logits)

    result = step(x, y)
    assert type(result) is kind
    loss, logits = result
    torch.testing.assert_close(loss, expected_loss, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(logits, expected_logits, rtol=RTOL, atol=ATOL)
    assert not logits.requires_grad
    assert not loss.requires_grad
    assert_grads(model, expected_grads)


Predicted = namedtuple("Predicted", ["prediction", "loss"])


@pytest.mark.parametrize("initial", [None, 4, 1])
def test_a_named_tuples_loss_field_is_the_loss_wherever_it_is(initial: int | None) -> None:
    # Its first item was taken: per-row predictions, refused as no scalar, but for 1-row micro-batches,
    # where a prediction of one element passed for the loss and was trained on, silently.
    model, x, y = build("mlp", 20)
    expected_loss, expected_grads = full_step(model, x, y)

    @koila.accumulate(initial=initial, cache=koila.NoCache())
    def step(x: torch.Tensor, y: torch.Tensor) -> Predicted:
        prediction = model(x)
        return Predicted(prediction, F.mse_loss(prediction, y))

    result = step(x, y)
    assert type(result) is Predicted
    torch.testing.assert_close(result.loss, expected_loss, rtol=RTOL, atol=ATOL)
    with torch.no_grad():
        torch.testing.assert_close(result.prediction, model(x), rtol=RTOL, atol=ATOL)
    assert_grads(model, expected_grads)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_dict_result_weighs_numbers_like_the_loss(reduction: str) -> None:
    model, x, y = build("mlp", 20)
    expected_loss, expected_grads = full_step(model, x, y, reduction)
    parts: list[tuple[int, int]] = []  # (rows, correct) of each micro-batch

    def correct_of(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((logits > 0) == (y > 0)).sum()

    @koila.accumulate(initial=8, reduction=reduction)
    def step(x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
        logits = model(x)
        correct = correct_of(logits, y)
        parts.append((x.shape[0], int(correct)))
        # acc is a mean over rows and correct a count: each adds up like the loss for one reduction
        acc = correct.double() / x.shape[0] if reduction == "mean" else correct.double()
        return {
            "loss": F.mse_loss(logits, y, reduction=reduction),
            "logits": logits,
            "correct": int(correct),
            "acc": acc,
        }

    result = step(x, y)
    assert list(result) == ["loss", "logits", "correct", "acc"]
    assert [rows for rows, _ in parts] == [8, 8, 4]
    with torch.no_grad():
        logits = model(x)
    total = int(correct_of(logits, y))
    torch.testing.assert_close(result["loss"], expected_loss, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(result["logits"], logits, rtol=RTOL, atol=ATOL)
    # An int is a count: added up, whatever the reduction, and an int still.
    assert result["correct"] == total
    assert type(result["correct"]) is int
    if reduction == "mean":
        torch.testing.assert_close(result["acc"], torch.tensor(total / 20, dtype=DTYPE))
    else:
        torch.testing.assert_close(result["acc"], torch.tensor(float(total), dtype=DTYPE))
    assert result["acc"].dim() == 0
    assert not result["acc"].requires_grad
    assert_grads(model, expected_grads)


@pytest.mark.parametrize("initial", [None, 4])
def test_values_of_the_whole_batch_keep_their_shape_and_type_when_split(initial: int | None) -> None:
    torch.manual_seed(0)
    classifier = nn.Linear(3, 3)
    x, y = torch.randn(10, 3), torch.randint(0, 3, (10,))
    sizes: list[int] = []

    @koila.accumulate(initial=initial)  # 4, 4 and 2 rows, or 10
    def step(x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
        sizes.append(len(x))
        logits = classifier(x)
        pred = logits.argmax(dim=1)
        return {
            "loss": F.cross_entropy(logits, y),
            "per_class": torch.bincount(pred, minlength=3),  # a count per class: (3,), whatever the rows
            "class_mean": logits.mean(0).detach(),  # a mean over rows, per class: (3,)
            "correct": int((pred == y).sum()),
            "hits": (pred == y).sum(),  # a 0-dimensional count
        }

    result = step(x, y)
    assert sizes == ([10] if initial is None else [4, 4, 2])
    with torch.no_grad():
        logits = classifier(x)
    pred = logits.argmax(dim=1)
    assert result["per_class"].shape == (3,)
    assert result["per_class"].dtype == torch.int64
    assert torch.equal(result["per_class"], torch.bincount(pred, minlength=3))
    torch.testing.assert_close(result["class_mean"], logits.mean(0))
    assert type(result["correct"]) is int
    assert result["correct"] == int((pred == y).sum())
    assert result["hits"].dtype == torch.int64
    assert int(result["hits"]) == int((pred == y).sum())


def test_a_tensor_with_a_row_per_row_in_one_micro_batch_only_is_named() -> None:
    classifier = nn.Linear(3, 3)

    @koila.accumulate(initial=3)  # 3, 3, 3 and 1 rows
    def step(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = classifier(x)
        return logits.pow(2).mean(), torch.bincount(logits.argmax(dim=1), minlength=3)

    with pytest.raises(ValueError, match=r"at the result\[1\] for a micro-batch of 1 rows, a count of the whole"):
        step(torch.randn(10, 3))
    assert classifier.weight.grad is None


def test_zero_dim_tensor_with_grad_is_weighted_and_detached() -> None:
    model, x, y = build("mlp", 20)
    expected_loss, _ = full_step(model, x, y)

    @koila.accumulate(initial=8)
    def step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        loss = F.mse_loss(model(x), y)
        return loss, loss * 2  # a second number that needs grad, never backpropagated

    loss, twice = step(x, y)
    torch.testing.assert_close(loss, expected_loss, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(twice, expected_loss * 2, rtol=RTOL, atol=ATOL)
    assert not twice.requires_grad


@pytest.mark.parametrize(
    ("extra", "where"),
    [
        ({"name": "mlp"}, "['name'] (str)"),
        ({"flag": True}, "['flag'] (bool)"),
        ({"nested": {"deep": "x"}}, "['nested']['deep'] (str)"),
    ],
)
@pytest.mark.parametrize("initial", [None, 8])
def test_result_entry_that_cannot_be_combined_comes_back_as_none_with_one_warning(
    extra: dict[str, Any], where: str, initial: int | None
) -> None:
    model, x, y = build("mlp", 20)

    @koila.accumulate(initial=initial)
    def step(x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
        return {"loss": F.mse_loss(model(x), y), **extra}

    with pytest.warns(UserWarning, match="returns other objects") as caught:
        result = step(x, y)
    assert [w.filename for w in caught] == [__file__]
    assert where in str(caught[0].message)
    key = next(iter(extra))
    assert result[key] is None or result[key] == {"deep": None}
    torch.testing.assert_close(result["loss"], F.mse_loss(model(x), y).detach(), rtol=RTOL, atol=ATOL)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(x, y)  # once per step


@pytest.mark.parametrize("initial", [None, 8])
def test_a_result_entry_that_is_none_stays_none_without_a_warning(initial: int | None) -> None:
    model, x, y = build("mlp", 20)

    @koila.accumulate(initial=initial)
    def step(x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
        return {"loss": F.mse_loss(model(x), y), "attentions": None, "nested": (None, {"cache": None})}

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = step(x, y)
    assert result["attentions"] is None
    assert result["nested"] == (None, {"cache": None})

    @koila.accumulate(initial=initial)
    def other(x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
        return {"loss": F.mse_loss(model(x), y), "attentions": None, "name": "mlp"}

    with pytest.warns(UserWarning, match="returns other objects") as caught:
        other(x, y)
    assert "['name'] (str)" in str(caught[0].message)
    assert "attentions" not in str(caught[0].message)


@pytest.mark.parametrize("initial", [None, 8, 3])
def test_a_list_of_one_string_per_row_is_joined_as_the_rows_are(initial: int | None) -> None:
    # Names collated with the batch, returned beside the loss: pytree took each string for a leaf, each was
    # dropped, and micro-batches of unequal rows (8, 8, 4) had results of different structures: a ValueError.
    model, x, y = build("mlp", 20)
    names = [f"row {index}" for index in range(20)]

    @koila.accumulate(initial=initial)
    def step(batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
        # A field of the batch, split with its rows (docs/batches.rst).
        return F.mse_loss(model(batch["x"]), batch["y"]), {"names": batch["names"], "labels": ["a", "b", "c"]}

    with pytest.warns(UserWarning, match="returns other objects") as caught:
        loss, extra = step({"x": x, "y": y, "names": names})
    assert len(caught) == 1
    assert "['labels'] (list)" in str(caught[0].message)  # the list, not each of its strings
    assert "names" not in str(caught[0].message)
    assert extra == {"names": names, "labels": None}
    torch.testing.assert_close(loss, F.mse_loss(model(x), y).detach(), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("initial", [None, 2, 3])
def test_a_rows_list_of_labels_or_a_missing_name_is_joined_as_the_rows_are(initial: int | None) -> None:
    # A list per row (a row's top labels) as long as a micro-batch's rows was taken for one of its rows, and the
    # rows came back scrambled; a None among the names made the micro-batches' results of different structures.
    model, x, y = build("mlp", 4)
    names = ["a", "b", "c", "d"]

    @koila.accumulate(initial=initial)
    def step(batch: dict[str, Any]) -> tuple[torch.Tensor, list[list[str]], list[str | None]]:
        labels = [[f"{name}:cat", f"{name}:dog"][: 2 if name != "b" else 0] for name in batch["names"]]
        found = [None if name == "d" else name.upper() for name in batch["names"]]
        return F.mse_loss(model(batch["x"]), batch["y"]), labels, found

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing comes back as None
        _, labels, found = step({"x": x, "y": y, "names": names})
    assert labels == [["a:cat", "a:dog"], [], ["c:cat", "c:dog"], ["d:cat", "d:dog"]]
    assert found == ["A", "B", "C", None]


def test_a_list_of_strings_one_per_row_in_some_micro_batches_only_comes_back_as_none() -> None:
    model, x, y = build("mlp", 20)
    classes = [f"class {index}" for index in range(8)]  # as many as the rows of 8, not of 4

    @koila.accumulate(initial=8)
    def step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, list[str]]:
        return F.mse_loss(model(x), y), classes

    with pytest.warns(UserWarning, match="returns other objects") as caught:
        loss, joined = step(x, y)
    assert len(caught) == 1
    assert "the result[1] (list)" in str(caught[0].message)
    assert joined is None
    torch.testing.assert_close(loss, F.mse_loss(model(x), y).detach(), rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------- 9. mixed precision


def test_grad_scaler_with_autocast_matches_the_unsplit_amp_step() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    reference = copy.deepcopy(model)
    x, y = data(40, 6).float(), data(40, 1, seed=1).float()

    ref_opt, ref_scaler = torch.optim.SGD(reference.parameters(), lr=0.1), torch.amp.GradScaler("cpu")
    assert ref_scaler.is_enabled()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss = F.mse_loss(reference(x), y)
    ref_scaler.scale(ref_loss).backward()
    ref_scaler.unscale_(ref_opt)

    opt, scaler = torch.optim.SGD(model.parameters(), lr=0.1), torch.amp.GradScaler("cpu")

    @koila.accumulate(initial=16, scaler=scaler)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = step(x, y)
    assert step.stats.batch_size == 16
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=2e-2, atol=1e-3)
    # The grads hold the scale until unscale_: far larger than the unscaled ones.
    assert model[0].weight.grad.abs().max() > 1000 * reference[0].weight.grad.abs().max()
    scaler.unscale_(opt)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=2e-3)
    scaler.step(opt)
    scaler.update()
    ref_scaler.step(ref_opt)
    ref_scaler.update()
    assert scaler.get_scale() == ref_scaler.get_scale()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=2e-2, atol=2e-3)


class TimesScaler:
    """A stand-in for GradScaler: counts its calls and scales by 1024."""

    def __init__(self) -> None:
        self.calls = 0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return loss * 1024


@pytest.mark.parametrize(("initial", "backwards"), [(None, 1), (8, 3)])
def test_every_backward_goes_through_the_scaler(initial: int | None, backwards: int) -> None:
    model, x, y = build("mlp", 20)
    expected_loss, expected_grads = full_step(model, x, y)
    scaler = TimesScaler()

    @koila.accumulate(initial=initial, scaler=scaler)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)

    loss = step(x, y)
    assert scaler.calls == backwards
    assert step.stats.batch_size == (20 if initial is None else 8)
    torch.testing.assert_close(loss, expected_loss, rtol=RTOL, atol=ATOL)  # the loss, not the scaled loss
    assert_grads(model, [g * 1024 for g in expected_grads])


# --------------------------------------------------------------------------- 10. grads from before the call


@pytest.mark.parametrize("initial", [None, 8])
def test_grads_from_before_are_kept_by_identity_and_summed(initial: int | None) -> None:
    model, x, y = build("mlp", 20)
    _, expected_grads = full_step(model, x, y)
    give_grads(model)
    before = Snapshot(model)

    @koila.accumulate(initial=initial)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)

    step(x, y)
    before.assert_added(expected_grads)


class WithSpare(nn.Module):
    """A block with a layer its forward never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.spare, self.idle = mlp(), nn.Linear(6, 1), nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "reentrant-checkpoint"])
@pytest.mark.parametrize("initial", [None, 8])
def test_parameter_the_step_does_not_use_keeps_its_grad(initial: int | None, checkpointed: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), WithSpare()).double()
    stem, block = model
    x, y = data(20, 6), data(20, 1, seed=1)
    block.spare.weight.grad = data(6, seed=5).view(1, 6)
    grad, value = block.spare.weight.grad, block.spare.weight.grad.clone()

    @koila.accumulate(initial=initial)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if checkpointed:  # a reentrant checkpoint's own backward may write any of its module's parameters
            return F.mse_loss(torch.utils.checkpoint.checkpoint(block, stem(x), use_reentrant=True), y)
        return F.mse_loss(model(x), y)

    step(x, y)
    assert block.spare.weight.grad is grad
    assert torch.equal(block.spare.weight.grad, value)
    assert block.spare.bias.grad is None
    assert block.idle.weight.grad is None
    assert block.body[0].weight.grad is not None


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_inputs_that_require_grad_get_the_full_batch_gradient(reduction: str) -> None:
    model, x, y = build("mlp", 20)
    x_full = x.clone().requires_grad_(True)
    F.mse_loss(model(x_full), y, reduction=reduction).backward()
    model.zero_grad(set_to_none=True)
    x.requires_grad_(True)

    @koila.accumulate(initial=8, reduction=reduction)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y, reduction=reduction)

    step(x, y)
    assert x.grad is not None
    torch.testing.assert_close(x.grad, x_full.grad, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("oom", [False, True], ids=["no-oom", "oom-in-micro-batch-1"])
def test_argument_made_by_a_graph_outside_the_step(oom: bool) -> None:
    """``step(encoder(x), y)``: every micro-batch, and a retry, backpropagates into the encoder."""
    inject = Inject("backward", at=lambda call: call == 1)
    torch.manual_seed(0)
    encoder, head = nn.Sequential(nn.Linear(6, 8), nn.Tanh()).double(), nn.Sequential(inject, nn.Linear(8, 1)).double()
    model = nn.Sequential(encoder, head)
    x, y = data(40, 6), data(40, 1, seed=1)
    expected_loss, expected_grads = full_step(model, x, y)
    inject.armed = oom

    @koila.accumulate(initial=16)
    def step(features: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(head(features), y)

    loss = step(encoder(x), y)
    assert step.stats.ooms == int(oom)
    torch.testing.assert_close(loss, expected_loss, rtol=RTOL, atol=ATOL)
    assert_grads(model, expected_grads)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="notes on exceptions are from Python 3.11")
def test_a_graph_from_before_the_call_reached_without_an_argument_is_named_when_a_split_step_meets_it() -> None:
    torch.manual_seed(0)
    encoder, head = nn.Linear(3, 4).double(), nn.Linear(4, 1).double()
    x, y = data(8, 4), data(8, 1, seed=1)
    shift = encoder(data(1, 3, seed=2))  # a graph, used by the step from outside its arguments
    head.weight.grad = torch.ones_like(head.weight)
    before = head.weight.grad.clone()

    @koila.accumulate(initial=4)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(head(x + shift), y)

    with pytest.raises(RuntimeError, match="a second time") as caught:
        step(x, y)
    notes = getattr(caught.value, "__notes__", [])
    assert any("Pass it to the step as an argument" in note for note in notes), notes
    assert torch.equal(head.weight.grad, before)  # as it was
    assert encoder.weight.grad is None

    @koila.accumulate(initial=4)
    def passed(x: torch.Tensor, y: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(head(x + shift), y)

    shift = encoder(data(1, 3, seed=2))
    passed(x, y, shift)  # as the note says: its graph is kept for the whole step
    assert encoder.weight.grad is not None


@pytest.mark.skipif(sys.version_info < (3, 11), reason="notes on exceptions are from Python 3.11")
def test_a_step_that_frees_its_own_graph_is_told_to_retain_it() -> None:
    # Its own torch.autograd.grad freed the graph: not a graph from outside, which the note blamed alone.
    torch.manual_seed(0)
    model = nn.Linear(3, 1).double()
    x, y = data(8, 3), data(8, 1, seed=1)

    @koila.accumulate(initial=4)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        (gradient,) = torch.autograd.grad(loss, [model.weight])
        return loss + 0 * gradient.sum()

    with pytest.raises(RuntimeError, match="a second time") as caught:
        step(x, y)
    notes = getattr(caught.value, "__notes__", [])
    assert any("retain_graph=True there" in note for note in notes), notes
    assert model.weight.grad is None


@pytest.mark.skipif(sys.version_info < (3, 11), reason="notes on exceptions are from Python 3.11")
def test_a_parametrization_cached_around_a_split_step_is_named_and_inside_it_is_exact() -> None:
    from torch.nn.utils import parametrizations, parametrize

    torch.manual_seed(0)
    layer = parametrizations.weight_norm(nn.Linear(3, 1).double())
    x, y = data(8, 3), data(8, 1, seed=1)

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(layer(x), y)

    loss_of(x, y).backward()
    expected = [p.grad.clone() for p in layer.parameters()]  # type: ignore[union-attr]
    layer.zero_grad()

    around = koila.accumulate(initial=4)(loss_of)
    with parametrize.cached(), pytest.raises(RuntimeError, match="a second time") as caught:
        around(x, y)
    notes = getattr(caught.value, "__notes__", [])
    assert any("parametrize.cached()" in note for note in notes), notes
    assert all(p.grad is None for p in layer.parameters())  # as it was

    @koila.accumulate(initial=4)
    def inside(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with parametrize.cached():
            return loss_of(x, y)

    inside(x, y)
    for parameter, want in zip(layer.parameters(), expected, strict=True):
        torch.testing.assert_close(parameter.grad, want)


@pytest.mark.parametrize("initial", [None, 2], ids=["whole", "split"])
def test_an_iterator_argument_is_refused_before_the_step_runs_split_or_not(initial: int | None) -> None:
    # Passed whole to every micro-batch, the first used it up and the others saw it empty: a wrong gradient.
    model = nn.Linear(1, 1, bias=False)
    ran: list[int] = []

    @koila.accumulate(initial=initial, cache=koila.NoCache())
    def step(rows: torch.Tensor, weights: Any) -> torch.Tensor:
        ran.append(len(rows))
        return (model(rows) * sum(weights)).mean()

    for weights in (iter([1.0, 2.0]), (w for w in [1.0, 2.0]), map(float, [1, 2])):
        with pytest.raises(TypeError, match=r"argument weights \(a \w+\) whole to every micro-batch"):
            step(torch.ones(6, 1), weights)
        with pytest.raises(TypeError, match=r"argument weights"):
            step(torch.ones(6, 1), weights=weights)
    assert ran == []
    assert model.weight.grad is None
    step(torch.ones(6, 1), [1.0, 2.0])  # a list passes, and every micro-batch sees all of it
    torch.testing.assert_close(model.weight.grad, torch.full((1, 1), 3.0))


def test_dense_grad_from_before_keeps_its_identity_under_a_sparse_step_grad() -> None:
    torch.manual_seed(0)
    embedding = nn.Embedding(10, 3, sparse=True).double()
    tokens = torch.randint(0, 10, (12,), generator=torch.Generator().manual_seed(0))
    embedding(tokens).sum().backward()
    step_grad = embedding.weight.grad.to_dense()
    embedding.weight.grad = torch.ones(10, 3, dtype=DTYPE)  # dense, as plain PyTorch keeps it
    grad = embedding.weight.grad

    @koila.accumulate(initial=4, reduction="sum")
    def step(tokens: torch.Tensor) -> torch.Tensor:
        return embedding(tokens).sum()

    step(tokens)
    torch.testing.assert_close(embedding.weight.grad.to_dense(), 1 + step_grad)
    assert embedding.weight.grad is grad, "plain loss.backward() adds a sparse grad into a dense one in place"


def test_sparse_grads_are_summed_in_place() -> None:
    torch.manual_seed(0)
    embedding = nn.Embedding(10, 3, sparse=True).double()
    tokens = torch.randint(0, 10, (12,), generator=torch.Generator().manual_seed(0))
    weights = data(12, 3)
    embedding(tokens).mul(weights).sum().backward()
    grad, step_grad = embedding.weight.grad, embedding.weight.grad.to_dense().clone()

    @koila.accumulate(initial=4, reduction="sum")
    def step(tokens: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return embedding(tokens).mul(weights).sum()

    step(tokens, weights)
    assert embedding.weight.grad is grad
    torch.testing.assert_close(embedding.weight.grad.to_dense(), 2 * step_grad, rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------- 11. the cache


class Budget:
    """A fake device: micro-batches of more than ``rows`` run out of memory in forward."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.seen: list[int] = []

    def __call__(self, x: torch.Tensor) -> None:
        self.seen.append(x.shape[0])
        if x.shape[0] > self.rows:
            raise make_oom()

    def take(self) -> list[int]:
        seen, self.seen = self.seen, []
        return seen


def budget_step(budget: Budget, **options: Any) -> tuple[Any, nn.Module]:
    torch.manual_seed(0)
    model = nn.Linear(6, 1).double()

    @koila.accumulate(**options)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        budget(x)
        return F.mse_loss(model(x.flatten(1)[:, :6]), y)

    return step, model


def test_second_call_starts_at_the_remembered_size() -> None:
    budget = Budget(16)
    step, _ = budget_step(budget)
    x, y = data(64, 6), data(64, 1, seed=1)
    seen = []
    with simulated_device(ROOMY):
        for _ in range(3):
            step(x, y)  # one call site
            seen.append(budget.take())
    assert seen == [[64, 32, 16, 16, 16, 16], [16] * 4, [16] * 4]
    assert step.stats.ooms == 2
    assert step.cache_info().hits == 2


def test_another_sample_shape_does_not_reuse_the_size() -> None:
    budget = Budget(16)
    step, _ = budget_step(budget)
    y = data(64, 1, seed=1)
    seen = []
    with simulated_device(ROOMY):
        for length in (2, 3, 2):
            step(data(64, length, 6), y)
            seen.append(budget.take())
    # Sequences of 3 are another key: they start from the whole batch again.
    assert seen == [[64, 32, 16, 16, 16, 16], [64, 32, 16, 16, 16, 16], [16] * 4]
    info = step.cache_info()
    assert (info.hits, info.misses, info.currsize) == (1, 2, 2)


def test_cache_clear_forgets_the_size() -> None:
    budget = Budget(16)
    step, _ = budget_step(budget)
    x, y = data(64, 6), data(64, 1, seed=1)
    seen = []
    with simulated_device(ROOMY):
        for clear in (False, True, False):
            if clear:
                step.cache_clear()
            step(x, y)
            seen.append(budget.take())
    assert seen == [[64, 32, 16, 16, 16, 16], [64, 32, 16, 16, 16, 16], [16] * 4]


def test_smaller_batch_runs_whole_and_stores_nothing() -> None:
    budget = Budget(32)
    step, _ = budget_step(budget)
    seen = []
    with simulated_device(ROOMY):
        for rows in (128, 20, 128, 40):
            step(data(rows, 6), data(rows, 1, seed=1))
            seen.append(budget.take())
    assert seen == [
        [128, 64, 32, 32, 32, 32],
        [20],  # fewer rows than the remembered 32: the whole batch
        [32, 32, 32, 32],  # 32 is still the size: the 20 rows proved nothing about it
        [32, 8],  # more rows than 32 start at 32, the last micro-batch takes the rest
    ]
    assert step.cache_info().currsize == 1


def test_smaller_batch_that_runs_out_of_memory_goes_below_its_own_rows() -> None:
    budget = Budget(64)
    step, _ = budget_step(budget)
    seen = []
    with simulated_device(ROOMY):
        for rows in (128, 20):
            if rows == 20:
                budget.rows = 16  # less memory than when 64 was remembered
            step(data(rows, 6), data(rows, 1, seed=1))
            seen.append(budget.take())
    # 20 rows fail whole: the next size is 16, below 20, not 32 (below the remembered 64)
    assert seen == [[128, 64, 64], [20, 16, 4]]


def test_split_step_after_cached_size_matches_full_step() -> None:
    budget = Budget(16)
    step, model = budget_step(budget)
    x, y = data(50, 6), data(50, 1, seed=1)
    with simulated_device(ROOMY):
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            step(x, y)  # the second time from the remembered size
    assert budget.take() == [50, 32, 16, 16, 16, 2, 16, 16, 16, 2]
    _, expected_grads = full_step(model, x, y)
    assert_grads(model, expected_grads)


# --------------------------------------------------------------------------- 12. memory hygiene


class Watched(nn.Module):
    """Records, at the start of each forward, whether a tensor made by an earlier forward is alive.

    Watched: the hidden activation and the output (which the step returns beside the loss).
    Forward call number ``fail_on`` (from 1) runs out of memory once its activation exists.
    """

    def __init__(self, fail_on: int) -> None:
        super().__init__()
        self.hidden, self.out = nn.Linear(6, 16), nn.Linear(16, 1)
        self.fail_on = fail_on
        self.calls = 0
        self.made: list[weakref.ref[torch.Tensor]] = []
        self.alive: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.alive.append(any(ref() is not None for ref in self.made))
        self.calls += 1
        h = torch.tanh(self.hidden(x))
        self.made.append(weakref.ref(h))
        if self.calls == self.fail_on:
            raise make_oom()
        out = self.out(h)
        self.made.append(weakref.ref(out))
        return out


@pytest.mark.parametrize("fail_on", [1, 2])
def test_failed_attempt_is_freed_before_the_retry_runs(fail_on: int) -> None:
    torch.manual_seed(0)
    model = Watched(fail_on).double()
    x, y = data(32, 6), data(32, 1, seed=1)

    @koila.accumulate(initial=16)
    def step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(x)
        return F.mse_loss(logits, y), logits

    _, logits = step(x, y)
    assert step.stats.ooms == 1
    assert logits.shape == (32, 1)
    retry_starts = fail_on  # the retry's first forward comes right after the failed one
    assert len(model.alive) == fail_on + 4
    assert model.alive[retry_starts] is False, "the failed attempt's activation is dead when the retry begins"
    assert not any(model.alive), "no micro-batch's activations outlive it"


def test_real_oom_attempt_is_freed_before_the_retry_runs() -> None:
    torch.manual_seed(0)
    model = Watched(fail_on=0).double()
    x, y = data(256, 6), data(256, 1, seed=1)
    limit = int(peak_bytes(lambda: full_step(model, x, y)) * 0.6)
    model.made.clear()
    model.alive.clear()

    @koila.accumulate
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)

    with simulated_device(limit):
        step(x, y)
    assert step.stats.ooms >= 1
    assert not any(model.alive)


# --------------------------------------------------------------------------- 13. property


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), initial=st.integers(1, 16), reduction=st.sampled_from(["mean", "sum"]))
def test_property_split_step_equals_full_step(n: int, initial: int, reduction: str) -> None:
    torch.manual_seed(n)
    model = nn.Linear(3, 2).double()
    x, y = data(n, 3, seed=n), data(n, 2, seed=n + 1)
    expected_loss, expected_grads = full_step(model, x, y, reduction)
    step, seen = recording_step(model, initial, reduction)
    loss = step(x, y)
    assert sum(seen) == n
    assert seen[:-1] == [initial] * (len(seen) - 1)
    assert 0 < seen[-1] <= initial
    torch.testing.assert_close(loss, expected_loss, rtol=RTOL, atol=ATOL)
    assert_grads(model, expected_grads)


# --------------------------------------------------------------------------- 14. growing back


def test_grow_tries_the_next_power_of_two_after_grow_after_calls() -> None:
    budget = Budget(16)
    step, _ = budget_step(budget, grow=True, grow_after=3)
    x, y = data(64, 6), data(64, 1, seed=1)
    seen, sizes = [], []
    with simulated_device(ROOMY):
        for call in range(5):
            if call == 3:
                budget.rows = 64  # memory freed: the probe will fit
            step(x, y)
            seen.append(budget.take())
            sizes.append(step.stats.batch_size)
    assert seen == [[64, 32, 16, 16, 16, 16], [16] * 4, [16] * 4, [32, 32], [32, 32]]
    assert sizes == [16, 16, 16, 32, 32]


# --------------------------------------------------------------------------- 15. a backward inside the step


def _own_backward(kind: str) -> Callable[[torch.Tensor], None]:
    """What a step that runs its own backward calls on its loss (issue 39, finding 4)."""
    if kind == "retain_graph":
        return lambda loss: loss.backward(retain_graph=True)
    if kind == "plain":
        return lambda loss: loss.backward()
    return lambda loss: torch.autograd.backward([loss])


@pytest.mark.parametrize("kind", ["retain_graph", "plain", "autograd.backward"])
@pytest.mark.parametrize("grads", ["none", "present"])
@pytest.mark.parametrize("initial", [None, 8], ids=["whole", "split"])
def test_a_backward_the_step_runs_itself_is_refused_before_grad_is_touched(
    kind: str, grads: str, initial: int | None
) -> None:
    # Run as it is, retain_graph=True gave 2x the gradient whole and 4.57x split, and a plain
    # backward left .grad written under PyTorch's "backward through the graph a second time".
    model, x, y = build("mlp", 20)
    if grads == "present":
        give_grads(model)
    before = Snapshot(model)
    run_backward = _own_backward(kind)
    calls: list[int] = []

    @koila.accumulate(initial=initial)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        loss = F.mse_loss(model(x), y)
        run_backward(loss)
        return loss

    with pytest.raises(
        RuntimeError,
        match=r"step ran a backward pass itself .*refused before it wrote any \.grad"
        r".*Return the loss.*backward=.*torch\.autograd\.grad",
    ) as info:
        step(x, y)
    before.assert_unchanged()
    assert calls == [20 if initial is None else 8]  # refused in the first micro-batch, not retried
    assert "backward through the graph" not in str(info.value)  # not PyTorch's, after .grad was written
    assert step.stats.ooms == 0


def test_a_backward_refused_inside_the_step_is_refused_even_if_the_step_catches_it() -> None:
    model, x, y = build("mlp", 12)
    give_grads(model)
    before = Snapshot(model)

    @koila.accumulate
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        with contextlib.suppress(RuntimeError):  # the refusal, swallowed
            loss.backward(retain_graph=True)
        return loss

    with pytest.raises(RuntimeError, match="ran a backward pass itself"):
        step(x, y)
    before.assert_unchanged()


def test_a_step_that_calls_another_step_is_refused_and_says_steps_do_not_nest() -> None:
    model, x, y = build("mlp", 12)
    give_grads(model)
    before = Snapshot(model)

    @koila.accumulate
    def inner(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)

    @koila.accumulate
    def outer(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return inner(x, y) + F.mse_loss(model(x), y)

    with pytest.raises(RuntimeError, match=r"outer ran a backward pass itself .*steps do not nest"):
        outer(x, y)
    before.assert_unchanged()


def test_a_backward_in_another_thread_while_a_step_runs_is_not_refused() -> None:
    # What is refused is the step's own code, on its thread: a plain loop on another thread
    # keeps its backward.
    model, x, y = build("mlp", 8)
    other = copy.deepcopy(model)
    inside, done = threading.Event(), threading.Event()
    errors: list[str] = []

    @koila.accumulate
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        inside.set()
        done.wait(30)
        return F.mse_loss(model(x), y)

    def plain() -> None:
        inside.wait(30)
        try:
            F.mse_loss(other(x), y).backward()
        except Exception as exc:  # reported as text, not kept
            errors.append(repr(exc))
        finally:
            done.set()

    thread = threading.Thread(target=plain)
    thread.start()
    _, expected = full_step(model, x, y)
    step(x, y)
    thread.join()
    assert errors == []
    assert_grads(other, expected)
    assert_grads(model, expected)


def penalised_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A mean-squared error plus a gradient penalty on the inputs, made with ``torch.autograd.grad``."""
    x = x.clone().requires_grad_(True)
    out = model(x)
    (slope,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    return F.mse_loss(out, y) + slope.pow(2).sum(dim=1).mean()


@pytest.mark.parametrize("grads", ["none", "present"])
@pytest.mark.parametrize("initial", [None, 8], ids=["whole", "split"])
def test_a_gradient_penalty_by_autograd_grad_inside_the_step_is_exact(grads: str, initial: int | None) -> None:
    # torch.autograd.grad writes no .grad: a step may use it, and the penalty's double
    # backward is part of the loss that accumulate backpropagates.
    model, x, y = build("mlp", 20)
    reference = copy.deepcopy(model)
    expected_loss = penalised_loss(reference, x, y)
    expected_loss.backward()
    expected = [p.grad.clone() for p in reference.parameters()]
    if grads == "present":
        give_grads(model)
    before = Snapshot(model)

    @koila.accumulate(initial=initial)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return penalised_loss(model, x, y)

    loss = step(x, y)
    torch.testing.assert_close(loss, expected_loss.detach(), rtol=RTOL, atol=ATOL)
    before.assert_added(expected)


# --------------------------------------------------------------------------- where warnings are errors (issue 39)
# pytest -W error, PYTHONWARNINGS=error: a warning issued after the step's gradients are in
# .grad, or in the retry an out-of-memory error made, is logged instead of raised.


def logged(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.name == "koila_retry" and text in record.getMessage()]


def micro_batch_loop(model: nn.Module, x: torch.Tensor, size: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The hand-written split step: mean losses weighted by rows, backward into fresh grads; grads left as found."""
    saved = [p.grad for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    rows, loss = x.shape[0], torch.zeros((), dtype=DTYPE)
    for begin in range(0, rows, size):
        part = x[begin : begin + size]
        weighted = model(part).pow(2).mean() * (part.shape[0] / rows)
        weighted.backward()
        loss = loss + weighted.detach()
    grads = [p.grad.clone() for p in model.parameters()]
    for p, grad in zip(model.parameters(), saved):
        p.grad = grad
    return loss, grads


def test_batchnorm_warning_under_warnings_as_errors_is_logged_after_the_split_step_succeeds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The warning came after the gradients were delivered: under an "error" filter the step
    # raised it, with .grad already written by a call that then failed.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)).double()
    x = data(64, 6)
    give_grads(model)
    before = Snapshot(model)
    reference = copy.deepcopy(model)

    @koila.accumulate
    def step(x: torch.Tensor) -> torch.Tensor:
        return model(x).pow(2).mean()

    limit = int(peak_bytes(lambda: full_step(reference, x, data(64, 1))) * 0.6)
    with simulated_device(limit), warnings.catch_warnings(), caplog.at_level(logging.WARNING, "koila_retry"):
        warnings.simplefilter("error")
        loss = step(x)
    assert step.stats.ooms >= 1
    size = step.stats.batch_size
    assert size < 64, "the step was split"
    # BatchNorm normalises each micro-batch by its own statistics: the step is the hand loop's
    # over the same micro-batches, whose .grad is added once to the one from before.
    expected_loss, expected_grads = micro_batch_loop(reference, x, size)
    torch.testing.assert_close(loss, expected_loss, rtol=RTOL, atol=ATOL)
    before.assert_added(expected_grads)
    (record,) = logged(caplog, "BatchNorm layer in training mode")
    assert record.levelno == logging.WARNING
    assert "a warnings filter made this warning an error" in record.getMessage()


def test_checkpoint_warning_under_warnings_as_errors_is_logged_after_the_step_succeeds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    torch.manual_seed(0)
    stem, block = nn.Linear(6, 6).double(), nn.Linear(6, 1).double()
    x = data(8, 6)
    plain = block(stem(x)).pow(2).mean()
    plain.backward()
    expected = [p.grad.clone() for p in (*stem.parameters(), *block.parameters())]
    for p in (*stem.parameters(), *block.parameters()):
        p.grad = None

    @koila.accumulate(initial=4)
    def step(x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(lambda h: block(h), stem(x), use_reentrant=True).pow(2).mean()

    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, "koila_retry"):
        warnings.simplefilter("error")
        loss = step(x)
    torch.testing.assert_close(loss, plain.detach(), rtol=RTOL, atol=ATOL)
    for p, want in zip((*stem.parameters(), *block.parameters()), expected, strict=True):
        torch.testing.assert_close(p.grad, want, rtol=RTOL, atol=ATOL)
    assert len(logged(caplog, "use_reentrant=True")) == 1


def test_ignored_labels_warning_under_warnings_as_errors_cannot_stop_the_recovery(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Warned in the retry that splits the step, the warning became the call's error, and the
    # out-of-memory error that the split would have recovered from was never recovered.
    inject = Inject("forward", at=lambda call: True)  # more than 4 rows run out of memory
    model = injected_mlp(inject)
    x, y = data(12, 6), data(12, 2, seed=1)
    labels = torch.zeros(12, 2, dtype=torch.long)
    labels[:, 1] = -100  # as many ignored entries in every row: weighing by rows stays exact
    target = y[:, :1]
    expected_loss, expected_grads = full_step(model, x, target)
    inject.armed = True

    @koila.accumulate
    def step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        kept = batch["labels"] != -100
        return F.mse_loss(model(batch["x"]), batch["y"][kept].view(-1, 1))

    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, "koila_retry"):
        warnings.simplefilter("error")
        loss = step({"x": x, "y": y, "labels": labels})
    assert inject.rows == [12, 8, 4, 4, 4]
    torch.testing.assert_close(loss, expected_loss, rtol=RTOL, atol=ATOL)
    assert_grads(model, expected_grads)
    assert len(logged(caplog, "labels with ignored entries (-100)")) == 1


def test_a_warning_that_ends_an_attempt_under_warnings_as_errors_leaves_grad_as_it_was() -> None:
    # Issued before the step's first backward, a warning that a filter makes an error ends the
    # call as the user asked, and the call changes nothing.
    model = mlp().double()
    give_grads(model)
    before = Snapshot(model)

    @koila.accumulate(initial=4)
    def step(x: torch.Tensor) -> tuple[torch.Tensor, str]:
        return model(x).pow(2).mean(), "a tag"

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="returns other objects"):
            step(data(8, 6))
    before.assert_unchanged()


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_batch_shorter_than_initial_that_fails_whole_retries_below_its_own_rows(where: str) -> None:
    """``initial`` above the batch's rows runs it whole; after an OOM the next size is below those rows.

    The short way, where the first attempt runs before the call's attempts are made, narrows
    the failed attempt to the rows it had, as the loop does: 100 rows fail, then 64 + 36.
    """
    model, x, y = build("mlp", 100)
    expected_loss, expected_grads = full_step(model, x, y)
    seen: list[int] = []

    @koila.accumulate(initial=1024, cache=koila.NoCache())
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        seen.append(len(x))
        h = model[:2](x)
        if len(x) == 100:
            if where == "forward":
                raise make_oom()
            h = OOMInBackward.apply(h)
        return F.mse_loss(model[2:](h), y)

    loss = step(x, y)
    assert seen == [100, 64, 36]
    assert step.stats.ooms == 1
    torch.testing.assert_close(loss, expected_loss, rtol=RTOL, atol=ATOL)
    assert_grads(model, expected_grads)


def test_a_replayed_failure_is_the_first_attempt_of_the_whole_batch() -> None:
    """``accumulator(replay=...)``: a whole batch that an integration ran itself and that ran out of memory."""
    from koila_retry._frontends.accumulate import accumulator

    model = nn.Linear(3, 1)
    failures = [("CUDA out of memory. Tried to allocate 2.00 GiB", "model.py:12 in forward")]
    rows: list[int] = []
    events: list[Any] = []

    def replay() -> tuple[str, str] | None:
        return failures.pop() if failures else None

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        rows.append(len(x))
        return F.mse_loss(model(x), y)

    decorated = accumulator(replay=replay, options={"on_oom": events.append})(step)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    losses, grads = [], []
    for _ in range(2):  # one call site: the second call finds the size the first stored
        model.zero_grad()
        losses.append(decorated(x, y))
        grads.append(model.weight.grad.clone())
    model.zero_grad()
    F.mse_loss(model(x), y).backward()
    # The whole batch is never run: its failure is replayed once, as the first call's first attempt.
    assert rows == [4, 4, 4, 4]
    assert [event.batch_size for event in events] == [8]
    # Named where the integration caught it, not where accumulate raised it again.
    assert events[0].where == "model.py:12 in forward"
    assert decorated.stats.ooms == 1
    for loss, grad in zip(losses, grads, strict=True):
        torch.testing.assert_close(grad, model.weight.grad)
        torch.testing.assert_close(loss, F.mse_loss(model(x), y).detach())


def test_an_integrations_pad_joins_parts_that_differ_outside_the_rows_dim() -> None:
    """``accumulator(pad=...)``: joined parts of different sizes padded at the end of each other dim."""
    from koila_retry._frontends.accumulate import accumulator

    model = nn.Linear(3, 1)
    x, lengths = torch.randn(7, 3), torch.tensor([1, 3, 2, 2, 5, 1, 4])

    def step(x: torch.Tensor, lengths: torch.Tensor) -> dict[str, torch.Tensor]:
        # As generate pads: each row's tokens, then -1 up to its batch's longest row (in two dims here).
        longest = int(lengths.max())
        tokens = torch.full((len(x), longest, longest), -1)
        for row, length in enumerate(lengths.tolist()):
            tokens[row, :length, :length] = length
        return {"loss": model(x).sum(), "tokens": tokens, "outputs": model(x)}

    asked: list[int] = []

    def pad() -> float | None:
        asked.append(1)
        return -1

    expected = step(x, lengths)
    # Micro-batches of 2 rows, then 1: 3, 2, 5 and 4 tokens long.
    padded = accumulator(initial=2, reduction="sum", pad=pad, options={"cache": koila.NoCache()})(step)
    joined = padded(x, lengths)
    assert joined["tokens"].shape == (7, 5, 5)
    assert torch.equal(joined["tokens"], expected["tokens"])
    torch.testing.assert_close(joined["outputs"], expected["outputs"].detach())
    assert asked == [1]  # once, for the parts that differ outside dim: not for those that differ in rows only

    # Without a pad, the parts are not joined: said at the micro-batch whose part differs, by name (probe
    # 71G); with one that gives none, torch.cat's own error, once the step ended.
    plain = accumulator(initial=2, reduction="sum", options={"cache": koila.NoCache()})(step)
    with pytest.raises(
        ValueError, match=r"at the result\['tokens'\] for a micro-batch of 2 rows, .* rows joined along"
    ):
        plain(x, lengths)
    refused = accumulator(initial=2, reduction="sum", pad=lambda: None, options={"cache": koila.NoCache()})(step)
    with pytest.raises(RuntimeError, match="Sizes of tensors must match except in dimension 0"):
        refused(x, lengths)


@pytest.mark.parametrize("initial", [None, 8])
def test_counts_in_a_tuple_beside_the_loss_add_up_as_the_whole_batchs(initial: int | None) -> None:
    # A tuple that holds no tensor is one value to chunked's joins; here each count is added across micro-batches.
    model, x, y = build("mlp", 32)

    def step(x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
        out = model(x)
        return {"loss": F.mse_loss(out, y), "counts": (int((out > y).sum()), len(x))}

    expected = step(x, y)["counts"]
    model.zero_grad()
    result = koila.accumulate(step, initial=initial, cache=koila.NoCache())(x, y)
    assert result["counts"] == expected
