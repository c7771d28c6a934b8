"""Batches padded to different lengths: sizes are kept per size class, and scaled to the samples' bytes."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

import koila_retry as koila
from koila_retry._common.batches import Split
from koila_retry.testing import simulated_device

VOCAB, ROWS = 50, 32
# Three size classes of padded lengths (9-16, 17-32, 33-64), nine lengths, twelve steps.
LENGTHS = [20, 12, 40, 24, 10, 30, 48, 14, 60, 18, 16, 36]


def test_the_key_holds_size_classes_and_the_exact_bytes_go_beside_it() -> None:
    short, long = (Split((torch.zeros(4, length, dtype=torch.long),), {}, 0, "test") for length in (17, 32))
    assert short.sample == long.sample == (((32,), "torch.int64"),)
    assert (short.per_sample, long.per_sample) == (17 * 8, 32 * 8)
    assert Split((torch.zeros(4, 33),), {}, 0, "test").sample == (((64,), "torch.float32"),)


def test_a_padded_epoch_runs_out_of_memory_once_per_size_class() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, 64), nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, VOCAB))
    generator = torch.Generator().manual_seed(0)

    @koila.accumulate
    def step(ids: torch.Tensor) -> torch.Tensor:
        logits = model(ids)  # memory grows with the rows times the length
        return F.cross_entropy(logits.flatten(0, 1), ids.flatten())

    failing_steps: dict[int, int] = {}  # per size class, the steps that ran out of memory
    with simulated_device("1.5MiB"):  # 32 rows of 14 tokens fit whole; of 16, they do not
        for length in LENGTHS:
            before = step.stats.ooms
            model.zero_grad()
            step(torch.randint(0, VOCAB, (ROWS, length), generator=generator))
            size_class = 1 << (length - 1).bit_length()
            failing_steps[size_class] = failing_steps.get(size_class, 0) + (step.stats.ooms > before)
    # A batch of a class starts where the class settled, scaled down for longer rows: after
    # its first failure, a class never runs out of memory again. With a key per length, each
    # new length did: nine steps failed, four in each of the two larger classes.
    assert failing_steps == {16: 1, 32: 1, 64: 1}
