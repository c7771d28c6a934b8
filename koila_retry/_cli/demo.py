"""``python -m koila_retry demo``: watch a training epoch shrink its batch to fit."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from koila_retry._common.units import format_bytes
from koila_retry._core.stats import OOMEvent
from koila_retry._frontends.batch import batch
from koila_retry.testing import simulated_device


def run_demo(limit: str = "48MiB", initial: int = 8192, epochs: int = 3, print_: Callable[[str], None] = print) -> int:
    """Train a small model under a simulated memory limit, narrate each reduction, return the size settled on."""
    torch.manual_seed(0)
    rows, features, hidden, classes = 8192, 256, 1024, 10
    data = torch.randn(rows, features)
    targets = (data[:, :classes] * 3).argmax(dim=1)

    def narrate(event: OOMEvent) -> None:
        then = "giving up" if event.next_batch_size is None else f"trying {event.next_batch_size}"
        print_(
            f"  out of memory at batch size {event.batch_size:5d}; "
            f"released, {format_bytes(event.free_bytes)} free; {then}"
        )

    @batch(initial=initial, on_oom=narrate)
    def train_epoch(batch_size: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> float:
        total = 0.0
        for start in range(0, rows, batch_size):
            x, y = data[start : start + batch_size], targets[start : start + batch_size]
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            total += loss.item() * len(x)
        return total / rows

    print_(f"Training a 3-layer MLP on {rows} random rows, in a simulated device of {limit}.")
    print_(f"The epoch starts at batch size {initial}.\n")
    with simulated_device(limit) as device:
        model = nn.Sequential(
            nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, classes)
        )
        # Plain SGD keeps no state, so free memory at the start of each epoch is the same
        # and the cache, keyed by call site and free memory, is hit from epoch 2 on.
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        for epoch in range(1, epochs + 1):
            before, hits = train_epoch.stats.ooms, train_epoch.cache_info().hits
            device.reset_peak()  # this epoch's peak, failed attempts included
            started = time.perf_counter()
            loss = train_epoch(model, optimizer)
            ooms = train_epoch.stats.ooms - before
            if ooms:
                how = f"after {ooms} out-of-memory error{'s' if ooms > 1 else ''}"
            elif train_epoch.cache_info().hits > hits:
                how = "straight from the cache, no error"
            else:
                how = "at the first size tried, no error"
            print_(
                f"epoch {epoch}: loss {loss:.4f} at batch size {train_epoch.stats.batch_size} ({how}, "
                f"{time.perf_counter() - started:.1f} s, peak {format_bytes(device.peak)})"
            )
    hits, misses, _, _ = train_epoch.cache_info()
    tally = f"{hits} hit{'s' * (hits != 1)}, {misses} miss{'es' * (misses != 1)}"
    print_(f"\nCache: {tally}. Lost to failed attempts: {train_epoch.stats.seconds_lost:.2f} s.")
    return train_epoch.stats.batch_size
