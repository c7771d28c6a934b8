"""koila.estimate of calls that loop until a value says stop, and of activation checkpointing."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

import koila_retry as koila
from koila_retry._estimation import recorder
from koila_retry.testing import simulated_device

# The CPU's estimate is within a few percent of the real peak (docs/estimate.rst, and the 5% of
# tests/test_estimate_accuracy.py).
ACCURACY = 0.05

# --------------------------------------------------------------------------- loops that a value ends


def until_every_row_finished(layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """A step that loops until no row is unfinished, as Hugging Face's generate() does: one pass here."""

    def step(x: torch.Tensor) -> torch.Tensor:
        unfinished = torch.ones(x.shape[0], dtype=torch.long)
        while True:
            x = layer(x)
            unfinished = unfinished * 0  # every row finishes after one pass
            if unfinished.max() == 0:  # the read that ends the loop
                break
        return x.sum()

    return step


@pytest.mark.timeout(120)  # a guard: without an end, the estimate never returned
def test_estimate_of_a_loop_that_a_value_ends_raises_naming_its_line() -> None:
    step = until_every_row_finished(nn.Linear(8, 8))
    step(torch.randn(4, 8))  # ends for real
    lines, first = inspect.getsourcelines(step)
    read = first + next(index for index, line in enumerate(lines) if "unfinished.max() == 0" in line)
    with pytest.raises(
        RuntimeError, match=rf"test_estimate_loops\.py, line {read} \(in step\) read a tensor's value 1025"
    ):
        koila.estimate(step, torch.randn(4, 8))


@pytest.mark.timeout(120)
def test_chunked_auto_of_a_loop_that_a_value_ends_warns_and_runs_the_whole_batch() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(8, 8)
    step = until_every_row_finished(layer)

    def rows(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return step(x).reshape(1).expand(x.shape[0])

    x = torch.randn(16, 8)
    plain = rows(x)
    chunked: Any = koila.chunked(rows, initial="auto")
    with pytest.warns(UserWarning, match="could not estimate .* read a tensor's value 1025 times"):
        out = chunked(x)
    assert torch.equal(out, plain)
    assert chunked.stats.batch_size == 16
    # Nothing of the failed estimate is left behind: the next one in the process runs.
    assert koila.estimate(lambda x: layer(x).sum(), x).peak(16) > 0


def tiny_gpt2() -> Any:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=512)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture
def fewer_reads(monkeypatch: pytest.MonkeyPatch) -> int:
    """Stop a run after 32 reads at one line, not 1024: each of generate()'s steps is a forward on meta tensors."""
    monkeypatch.setattr(recorder, "_READS_AT_ONE_LINE", 32, raising=False)
    return 32


def test_a_fixed_loop_that_reads_a_value_each_step_is_told_apart_in_the_error(fewer_reads: int) -> None:
    # A NaN check per time step of an RNN unrolled over more steps than a line may read: the error named
    # only loops that a value ends, which this one is not.
    cell = nn.RNNCell(4, 8)

    def step(x: torch.Tensor) -> None:
        h = torch.zeros(x.shape[0], 8)
        for t in range(x.shape[1]):
            h = cell(x[:, t], h)
            if torch.isnan(h).any():
                raise FloatingPointError(t)
        h.sum().backward()

    x = torch.randn(2, fewer_reads + 8, 4)
    step(x)  # ends for real
    with pytest.raises(RuntimeError, match="a loop of fixed length that reads a value in each step"):
        koila.estimate(step, x)


@pytest.mark.timeout(120)
def test_estimate_of_generate_raises_naming_the_line_in_transformers(fewer_reads: int) -> None:
    model = tiny_gpt2()
    ids = torch.randint(1, 50, (4, 6), generator=torch.Generator().manual_seed(1))

    def generate(ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
        return out

    assert generate(ids).shape == (4, 9)  # ends for real
    with pytest.raises(RuntimeError, match=rf"transformers[/\\].* read a tensor's value {fewer_reads + 1} times"):
        koila.estimate(generate, ids)


@pytest.mark.timeout(120)
def test_chunked_auto_of_generate_warns_and_equals_the_plain_generate(fewer_reads: int) -> None:
    model = tiny_gpt2()
    ids = torch.randint(1, 50, (4, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)

    def generate(ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out: torch.Tensor = model.generate(ids, attention_mask=attention_mask, max_new_tokens=3, do_sample=False)
        return out

    plain = generate(ids, mask)
    with pytest.warns(UserWarning, match="could not estimate .* read a tensor's value"):
        out = koila.chunked(generate, ids, attention_mask=mask, initial="auto")
    assert torch.equal(out, plain)


# --------------------------------------------------------------------------- activation checkpointing


class Block(nn.Module):
    """Self-attention through scaled_dot_product_attention (the CPU's flash kernel), checkpointed or not."""

    def __init__(self, reentrant: bool | None, dropout: float = 0.0) -> None:
        super().__init__()
        self.qkv = nn.Linear(64, 192)
        self.dropout = dropout
        self.reentrant = reentrant

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        projected = self.qkv(F.dropout(x, self.dropout, self.training))
        q, k, v = projected.view(*x.shape[:2], 3, 4, 16).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return out.transpose(1, 2).reshape(x.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reentrant is None:
            return self.inner(x)
        out: torch.Tensor = checkpoint(self.inner, x, use_reentrant=self.reentrant)
        return out


def blocks(reentrant: bool | None, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(reentrant, dropout) for _ in range(4)])


def real_and_estimated(build: Callable[[], nn.Module], step: Callable[..., Any], *shape: int) -> tuple[int, int]:
    """The peak of a real step on a simulated device, model and batch made there, and the estimate's."""
    with simulated_device("4GiB") as device:
        model = build()
        batch = torch.randn(*shape)
        step(model, batch)
    model.zero_grad(set_to_none=True)  # as before the real step
    found = koila.estimate(lambda x: step(model, x), torch.randn(*shape))
    return device.peak, found.peak(shape[0])


def backward(model: nn.Module, x: torch.Tensor) -> None:
    model(x.requires_grad_()).sum().backward()


def grad(model: nn.Module, x: torch.Tensor) -> None:
    loss = model(x.requires_grad_()).sum()
    for parameter, gradient in zip(model.parameters(), torch.autograd.grad(loss, list(model.parameters()))):
        parameter.grad = gradient


# Reentrant checkpointing does not support torch.autograd.grad.
@pytest.mark.parametrize(
    ("reentrant", "how"),
    [(False, backward), (True, backward), (False, grad)],
    ids=["non-reentrant", "reentrant", "non-reentrant-autograd.grad"],
)
def test_checkpointed_attention_is_estimated_within_the_accuracy_of_the_real_peak(
    reentrant: bool, how: Callable[[nn.Module, torch.Tensor], None]
) -> None:
    real, estimated = real_and_estimated(lambda: blocks(reentrant), how, 8, 128, 64)
    assert estimated == pytest.approx(real, rel=ACCURACY)
    # Checkpointing keeps less than the plain blocks do, in the estimate as on the device.
    plain_real, plain_estimated = real_and_estimated(lambda: blocks(None), how, 8, 128, 64)
    assert estimated < plain_estimated
    assert plain_estimated == pytest.approx(plain_real, rel=ACCURACY)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_dropout_and_attention_on_cuda_are_estimated(reentrant: bool) -> None:
    """CUDA's kernels (fused dropout, memory-efficient attention) are taken again when backward recomputes."""
    model = blocks(reentrant, dropout=0.1).train()
    plain = blocks(None, dropout=0.1).train()
    x = torch.randn(8, 128, 64)
    checkpointed = koila.estimate(lambda x: backward(model, x), x, device="cuda").peak(8)
    assert checkpointed < koila.estimate(lambda x: backward(plain, x), x, device="cuda").peak(8)


@pytest.mark.parametrize("reentrant", [False, True])
def test_hugging_face_gradient_checkpointing_is_estimated_within_the_accuracy_of_the_real_peak(reentrant: bool) -> None:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()

    def build() -> nn.Module:
        torch.manual_seed(0)
        config = transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=100, attn_pdrop=0, resid_pdrop=0, embd_pdrop=0
        )
        model = transformers.GPT2LMHeadModel(config).train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        built: nn.Module = model
        return built

    ids = torch.randint(0, 100, (8, 128), generator=torch.Generator().manual_seed(1))

    # Without an attention mask: whether one is all ones is a value the estimate reads as a placeholder.
    def step(model: nn.Module, ids: torch.Tensor) -> None:
        model(input_ids=ids, labels=ids).loss.backward()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' own, on use_cache and the loss
        with simulated_device("4GiB") as device:
            model = build()
            step(model, ids.clone())
        model.zero_grad(set_to_none=True)
        estimated = koila.estimate(lambda ids: step(model, ids), ids).peak(8)
    assert estimated == pytest.approx(device.peak, rel=ACCURACY)


# --------------------------------------------------------------------------- a loop over chunks of its own


class _ChunkedNorm(nn.Module):
    """A training BatchNorm over chunks of 8 rows: the path changes with the rows, and a chunk of 1 fails."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.layers(chunk) for chunk in x.split(8)])


def test_a_call_whose_path_changes_and_that_fails_at_one_row_is_measured_at_two() -> None:
    # The estimate's own extra run at 1 row raised BatchNorm's "Expected more than 1 value per channel",
    # which the call at its own rows never meets (probe 72C).
    model = _ChunkedNorm()
    x = torch.randn(32, 16)

    def step(x: torch.Tensor) -> None:
        model(x).sum().backward()

    found = koila.estimate(step, x)
    assert found.sizes[:3] == (2, 32, 64)
    given = koila.estimate(step, x, sizes=(2, 32, 64, *found.sizes[3:]))
    assert found.peak(32) == given.peak(32)
    assert koila.suggest_batch_size(step, x, budget="1GiB") > 32
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        koila.estimate(step, x, sizes=(1, 32))  # a size the user chose is run as it is
