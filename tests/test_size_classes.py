"""Batches padded to different lengths: sizes are kept per size class, and scaled to the samples' bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import koila_retry as koila
from koila_retry._common.batches import Split
from koila_retry.testing import make_oom, oom_above, simulated_device

VOCAB, ROWS = 50, 32
# Three size classes of padded lengths (9-16, 17-32, 33-64), nine lengths, twelve steps.
LENGTHS = [20, 12, 40, 24, 10, 30, 48, 14, 60, 18, 16, 36]


def test_the_key_holds_size_classes_and_the_exact_bytes_go_beside_it() -> None:
    short, long = (Split((torch.zeros(4, length, dtype=torch.long),), {}, 0, "test") for length in (17, 32))
    assert short.sample == long.sample == (((32,), "torch.int64"),)
    assert (short.per_sample, long.per_sample) == (17 * 8, 32 * 8)
    assert Split((torch.zeros(4, 33),), {}, 0, "test").sample == (((64,), "torch.float32"),)
    # What passes whole, in size classes too: a (1, n) position_ids of every padded length.
    whole = Split((torch.zeros(4, 17), torch.arange(17)[None]), {}, 0, "test").sample
    assert whole == (((32,), "torch.float32"), ((1, 32), "torch.int64"))


def test_a_one_row_nested_tensor_passed_whole_keeps_its_ragged_length_in_the_key() -> None:
    # Its length is a symbol (j1), which the size class crashed on (AttributeError; probe 72A), and which
    # each nested tensor makes anew: kept in the key, no call found the size the one before stored (72H).
    def nested() -> torch.Tensor:
        return torch.nested.nested_tensor([torch.randn(2, 3)], layout=torch.jagged)

    sample = Split((torch.zeros(4, 17), nested()), {}, 0, "test").sample
    assert sample == (((32,), "torch.float32"), ((1, -1, 4), "torch.float32"))
    assert Split((torch.zeros(4, 17), nested()), {}, 0, "test").sample == sample
    x = torch.randn(6, 3)
    fits = oom_above(2)

    @koila.chunked(initial=4)
    def twice(x: torch.Tensor, nested: torch.Tensor) -> torch.Tensor:
        fits(len(x))
        return x * 2

    for _ in range(3):
        assert torch.equal(twice(x, nested()), x * 2)
    assert twice.stats.ooms == 1


def test_a_padded_epoch_with_position_ids_passed_whole_runs_out_of_memory_once_per_size_class() -> None:
    # Each length of the (1, n) position_ids was a key of its own: 44 failed attempts over
    # 30 steps of one size class, where the same steps without it made 2 (probe 71G).
    embedding = nn.Embedding(VOCAB, 8)
    generator = torch.Generator().manual_seed(0)

    @koila.accumulate
    def step(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if ids.numel() > 16 * 64:  # 16 rows of 64 tokens fit at once
            raise make_oom()
        logits = (embedding(ids) + positions[..., None]) @ embedding.weight.T
        return F.cross_entropy(logits.flatten(0, 1), ids.flatten())

    for length in torch.randint(33, 65, (30,), generator=generator).tolist():
        step(torch.randint(0, VOCAB, (64, length), generator=generator), torch.arange(length)[None])
    assert step.stats.ooms == 2  # 64 and 32 rows, once


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


def _embed_pass(cache: koila.SizeCache, length: int, budget: int, tried: list[int]) -> None:
    """Run one chunked pass over 64 rows of ``length`` tokens, where ``budget`` tokens fit at once."""

    def embed(ids: torch.Tensor) -> torch.Tensor:
        tried.append(len(ids))
        if ids.numel() > budget:
            raise make_oom()
        return ids.float()

    koila.chunked(embed, torch.zeros(64, length, dtype=torch.long), initial=64, cache=cache)


def test_a_disk_cache_scales_a_size_proven_on_shorter_rows_in_the_next_run(tmp_path: Path) -> None:
    path = tmp_path / "sizes.json"
    first: list[int] = []
    _embed_pass(koila.DiskCache(path), 17, 17 * 16, first)  # 16 rows of 17 tokens fit
    assert first[-1] == 16
    stored = json.loads(path.read_text())
    assert list(stored["samples"].values()) == [17 * 8]  # the bytes of the sample it was proven on
    # The next run, with rows of 32 tokens: the same size class, so the same key. As many
    # bytes of samples as fitted, 8 rows, not the 16 rows of shorter ones.
    second: list[int] = []
    _embed_pass(koila.DiskCache(path), 32, 32 * 8, second)
    assert second[0] == 16 * 17 // 32
    assert second == [8] * 8  # no out-of-memory error: it started where the bytes fit


def test_a_cache_file_without_sample_bytes_is_read_as_before(tmp_path: Path) -> None:
    path = tmp_path / "sizes.json"
    tried: list[int] = []
    _embed_pass(koila.DiskCache(path), 17, 17 * 16, tried)
    stored = json.loads(path.read_text())
    del stored["samples"]  # as a file written before they were kept
    path.write_text(json.dumps(stored))
    cache = koila.DiskCache(path)
    assert list(cache.values()) == [16]
    assert cache.sample_bytes(next(iter(cache))) is None


def test_sample_bytes_go_with_their_size() -> None:
    cache = koila.GlobalCache(maxsize=2)
    cache.prove("missing", 10)  # no size there: nothing to prove
    assert cache.sample_bytes("missing") is None
    cache["a"] = 4
    cache.prove("a", 100)
    assert cache.sample_bytes("a") == 100
    cache["a"] = 2  # stored again: by a call that says its samples, if it does
    assert cache.sample_bytes("a") is None
    cache.prove("a", 50)
    cache["b"], cache["c"] = 1, 1  # "a" is evicted, and its bytes with it
    assert cache.sample_bytes("a") is None
    cache.prove("b", 7)
    del cache["b"]
    assert cache.sample_bytes("b") is None
    with pytest.raises(ValueError, match="nbytes must be an int >= 1, got 0"):
        cache.prove("c", 0)
    with pytest.raises(TypeError, match="nbytes must be an int >= 1, got float 2.5"):
        cache.prove("c", 2.5)  # type: ignore[arg-type]
    assert cache.sample_bytes("c") is None


def test_the_stack_cache_fallback_keeps_the_bytes_a_size_was_proven_on() -> None:
    cache = koila.StackMemoryCache()
    here = ("f", "cpu", 20, "file", "name", 0)
    above = ("f", "cpu", 21, "file", "name", 0)
    cache[above] = 8
    cache.prove(above, 64)
    assert cache.lookup(here) == 8
    assert cache.sample_bytes(here) == 64


def test_auto_scales_its_remembered_estimate_for_longer_rows_of_the_class() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, 64), nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, VOCAB))
    tried: list[int] = []

    @koila.chunked(initial="auto", cache=koila.GlobalCache())
    def logits(ids: torch.Tensor) -> torch.Tensor:
        tried.append(len(ids))
        return model(ids).mean(1)  # little to keep: the memory is in each chunk

    with torch.no_grad(), simulated_device("2MiB"):
        # 32 rows of 17 tokens fit whole: nothing is stored in the cache, and the estimate,
        # measured, is remembered for the size class of 17 to 32 tokens.
        logits(torch.zeros(32, 17, dtype=torch.long))
        assert logits.stats.ooms == 0
        tried.clear()
        logits(torch.zeros(32, 32, dtype=torch.long))  # the same class, nearly twice the bytes
    # It starts at as many bytes of samples as fitted, not at the rows of shorter ones.
    assert logits.stats.ooms == 0
    assert tried[0] == 32 * 17 // 32
