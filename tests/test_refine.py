"""Sizes between powers of two (issue 31, part 1): ``refine=True`` searches between the size that fits and the
smallest that failed, over the next calls, and never tries a size that failed again under the same key.

The memory is real: a simulated device in which 100 rows fit and 101 do not.
"""

from __future__ import annotations

import pytest
import torch

import koila_retry as koila
from koila_retry._core import decision
from koila_retry._core.decision import Rules, State
from koila_retry.testing import make_oom, simulated_device

ROW = 256 * 1024  # float32 elements: 1 MiB a row
LIMIT = 100 * 2**20 + 2**19  # 100 rows fit, 101 do not


@pytest.mark.parametrize(
    ("fits", "failed", "probe"),
    [(64, 128, 96), (96, 128, 112), (96, 112, 104), (96, 104, 96), (100, 104, 100), (5, 10, 7), (7, 8, 7), (1, 2, 1)],
)
def test_the_probe_is_halfway_in_multiples_of_8_from_64(fits: int, failed: int, probe: int) -> None:
    assert decision.between(fits, failed) == probe


def test_the_probe_stays_under_the_ceiling_and_needs_a_bound() -> None:
    rules = Rules("f", 128, refine=True)
    assert decision.refined(rules, State(64, 128, 1, 64), None) == 64
    assert decision.refined(rules, State(64, 128, 1, 64), 64) == 64
    assert decision.refined(rules, State(64, 80, 1, 64), 128) == 80
    assert decision.refined(Rules("f", 128), State(64, 128, 1, 64), 128) == 64  # refine off
    assert decision.failed_at(None, 112) == 112
    assert decision.failed_at(104, 112) == 104
    assert decision.still_failed(104, 96) == 104
    assert decision.still_failed(104, 104) is None  # it fitted after all: memory came back


def test_batch_settles_within_an_eighth_of_what_fits_and_then_costs_nothing() -> None:
    sizes: list[int] = []

    @koila.batch(initial=128, refine=True)
    def run(batch_size: int) -> int:
        sizes.append(batch_size)
        torch.empty(batch_size, ROW)
        return batch_size

    with simulated_device(LIMIT):
        got = [run() for _ in range(8)]
        ooms = run.stats.ooms
        later = [run() for _ in range(5)]
    assert later == [96] * 5
    assert run.stats.ooms == ooms  # later calls add no out-of-memory error
    assert sizes[:2] == [128, 64]
    # Halving settles at 64, a third below the 100 that fit; the search ends within 12.5% below them.
    assert got[-1] == 96
    assert 100 * 0.875 <= got[-1] <= 100
    failed = [size for size in sizes if size > 100]
    assert len(failed) == len(set(failed)), "a size that failed was tried again"
    assert len(failed) <= 1 + 3  # the first error, and at most log2(64 / 8) probes


def test_without_refine_powers_of_two_stay() -> None:
    @koila.batch(initial=128)
    def run(batch_size: int) -> int:
        torch.empty(batch_size, ROW)
        return batch_size

    with simulated_device(LIMIT):
        assert [run() for _ in range(4)] == [64] * 4


def test_chunked_refines_between_its_chunks_with_exact_results() -> None:
    seen: list[int] = []

    def double(chunk: torch.Tensor) -> torch.Tensor:
        seen.append(len(chunk))
        torch.empty(len(chunk), ROW)
        return chunk * 2

    x = torch.arange(2000.0).unsqueeze(1)
    with simulated_device(LIMIT):
        out = koila.chunked(double, x, initial=128, refine=True)
    assert torch.equal(out, x * 2)
    assert seen[:3] == [128, 64, 96]
    assert 88 <= max(size for size in seen[-5:]) <= 100
    failed = [size for size in seen if size > 100]
    assert len(failed) == len(set(failed))


def test_accumulate_refines_with_the_whole_batchs_gradient() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).double()
    x, y = torch.randn(256, 4, dtype=torch.float64), torch.randn(256, 1, dtype=torch.float64)
    torch.nn.functional.mse_loss(model(x), y).backward()
    expected = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    rows: list[int] = []

    @koila.accumulate(initial=128, refine=True)
    def step(xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        rows.append(len(xs))
        if len(xs) > 100:
            raise make_oom()
        return torch.nn.functional.mse_loss(model(xs), ys)

    for _ in range(6):
        model.zero_grad(set_to_none=True)
        step(x, y)
        # Micro-batches that do not divide the batch (96, 96, 64) still give its gradient exactly.
        for got, want in zip(model.parameters(), expected, strict=True):
            torch.testing.assert_close(got.grad, want, rtol=1e-12, atol=1e-14)
    assert step.stats.batch_size == 96
    assert 96 in rows


def test_refine_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="refine must be a bool"):
        koila.batch(refine="yes")(lambda batch_size: None)
