"""Evaluate a model on more rows than fit in memory at once, without a GPU.

A simulated device stands in for a small GPU: the tensors created inside it count
against its limit, and going over the limit raises a real ``torch.OutOfMemoryError``.
The first batch size does not fit, so koila-retry releases the failed attempt's
memory and tries the next smaller power of two until one fits. The outputs are then
compared with a run that had all the memory it wanted.

With koila-retry installed from a clone, as the README says
(``pip install -c constraints.txt '.[progress,plot]'``), run::

    python examples/evaluate_in_batches.py
"""

from __future__ import annotations

import time

import torch
from torch import nn

import koila_retry as koila
from koila_retry.testing import simulated_device

ROWS, FEATURES, HIDDEN, CLASSES = 50_000, 64, 512, 10
MEMORY = "32MiB"
INITIAL = 16_384


def report(event: koila.OOMEvent) -> None:
    """Print each out-of-memory error as the wrapper recovers from it."""
    print(f"  batch size {event.batch_size:>6}: out of memory, retrying at {event.next_batch_size}")


@koila.batch(initial=INITIAL, on_oom=report)
def predict(batch_size: int, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """Return the model's outputs for every row, computed ``batch_size`` rows at a time."""
    with torch.no_grad():
        return torch.cat([model(chunk) for chunk in inputs.split(batch_size)])


def main() -> None:
    torch.manual_seed(0)
    with simulated_device(MEMORY) as device:
        # Built inside the simulated device, so that they take up its memory as they
        # would on a real one.
        model = nn.Sequential(
            nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES)
        ).eval()
        inputs = torch.randn(ROWS, FEATURES)
        print(f"Evaluating {ROWS} rows on a simulated device of {MEMORY}, starting at batch size {INITIAL}:")
        started = time.perf_counter()
        outputs = predict(model, inputs)
        print(
            f"Settled on batch size {predict.stats.batch_size} after {predict.stats.ooms} out-of-memory "
            f"errors, in {time.perf_counter() - started:.1f} s (peak {device.peak / 2**20:.1f} MiB)."
        )

    with torch.no_grad():
        reference = model(inputs)  # all rows at once, no memory limit
    torch.testing.assert_close(outputs, reference)
    print(f"Outputs match an unconstrained run (largest difference {(outputs - reference).abs().max().item():.1e}).")


if __name__ == "__main__":
    main()
