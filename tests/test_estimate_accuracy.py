"""The estimate against the real peak on the CPU: a small, fast subset of ``benchmarks/estimator_accuracy.py``.

The truth is measured in a child process from its resident set (glibc told to give freed
blocks back, the high-water mark reset before the step), so the estimate is checked
against the memory the process really touched, oneDNN's hidden buffers included.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

import koila_retry as koila

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="the truth reads Linux's /proc"),
]


@pytest.fixture(scope="module")
def accuracy() -> Iterator[ModuleType]:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import estimator_accuracy

        yield estimator_accuracy
    finally:
        sys.path.remove(str(BENCHMARKS))


# Cases whose activations are most of the peak, one per kind of layer the estimate must get
# right: matrix products, convolutions with oneDNN's own buffers, batch norm, attention.
@pytest.mark.parametrize(
    ("model", "mode", "batch"),
    [("mlp", "infer", 1024), ("cnn", "train", 32), ("resnet", "infer", 32), ("attention", "train", 32)],
)
def test_estimate_is_within_five_percent_of_the_real_peak(
    accuracy: ModuleType, model: str, mode: str, batch: int
) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(accuracy.THREADS)  # as in the child: oneDNN's choices depend on it
    try:
        step, args = accuracy.build(model, mode, batch)
        estimated = koila.estimate(step, *args).peak(batch)
    finally:
        torch.set_num_threads(threads)
    true = accuracy.measure_true_peak(model, mode, batch, repeats=2)
    assert abs(estimated / true - 1) <= 0.05, f"{model} {mode} at {batch}: estimated {estimated}, true {true}"
