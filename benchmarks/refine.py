"""Sizes between powers of two, and growth that weighs throughput: what they choose, and what they cost.

**Sizes.** On the stand-in (:func:`koila_retry.testing.simulated_device`), a real training step
of an MLP (512 -> 1024 -> 512, AdamW, float32) whose memory grows with its rows, under a limit
at which exactly N rows fit (N = 7, 100 and 1500; the limit is measured, not assumed). Three
candidates, each called 12 times from a fresh start at the power of two above N:

- ``@koila.batch``, powers of two (the default);
- ``@koila.batch(refine=True)``;
- accelerate's ``find_executable_batch_size`` (x0.9 after each error), which keeps its size
  from one call to the next as koila's cache does.

For each: the out-of-memory errors, the size it settled on, how far below N that is, and the
rows the 12 calls ran.

**Throughput.** A real training step on the CPU (an MLP 512 -> 512 -> 10, SGD, one thread), timed
with the real clock, with ``grow=True, grow_after=1``: the first call runs out of memory down to 8 rows
(an injected error), and each later call probes the next power of two. With
``grow_gain=0.03`` growth stops at the first size that brings less than 3% more rows per
second than the one below; without, it grows to ``initial``. The rows per second of each size
(``stats.throughput``) are printed. Timings depend on the machine; the choice is what it
measured here.

It prints no verdict (it has no targets) and exits with status 0. Run it from the repository
root (``tox -e bench`` does not run it); without accelerate, its rows are skipped with a note::

    python benchmarks/refine.py
    python benchmarks/refine.py --rst
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import torch
from common import BatchSizeFinder, print_load, print_rst, print_text
from torch import nn

import koila_retry as koila
from koila_retry.testing import make_oom, simulated_device

CALLS = 12


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 512))
    return model, torch.optim.AdamW(model.parameters())


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, rows: int) -> None:
    x = torch.randn(rows, 512)
    model(x).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _limit(fits: int) -> int:
    """The simulated device's size at which exactly ``fits`` rows of the step fit (with its state made)."""
    model, optimizer = _model()
    _step(model, optimizer, 1)  # the optimizer's state exists, as in every call after the first
    peaks = []
    for rows in (fits, fits + 1):
        with simulated_device("64GiB") as device:
            _step(model, optimizer, rows)
            peaks.append(device.peak)
    return (peaks[0] + peaks[1]) // 2


def _accelerate() -> BatchSizeFinder | None:
    """accelerate's ``find_executable_batch_size``, or None where accelerate cannot be imported."""
    try:
        from accelerate.utils import find_executable_batch_size
    except ImportError:
        return None
    finder: BatchSizeFinder = find_executable_batch_size
    return finder


def _candidates(start: int) -> dict[str, Callable[[Callable[[int], None]], Callable[[], Any]]]:
    candidates: dict[str, Callable[[Callable[[int], None]], Callable[[], Any]]] = {
        "koila, powers of two": lambda work: koila.batch(initial=start)(work),
        "koila, refine=True": lambda work: koila.batch(initial=start, refine=True)(work),
    }
    finder = _accelerate()
    if finder is not None:  # main notes its absence
        candidates["accelerate, x0.9"] = lambda work: finder(starting_batch_size=start)(work)
    return candidates


def _settle(fits: int, limit: int, name: str, wrap: Callable[[Callable[[int], None]], Callable[[], Any]]) -> list[str]:
    """Call one candidate ``CALLS`` times under ``limit``; return its row of the table."""
    model, optimizer = _model()
    _step(model, optimizer, 1)
    tried: list[int] = []
    ooms = [0]

    def work(batch_size: int) -> None:
        tried.append(batch_size)
        try:
            _step(model, optimizer, batch_size)
        except torch.OutOfMemoryError:
            ooms[0] += 1
            optimizer.zero_grad(set_to_none=True)
            raise

    run = wrap(work)
    ran = []
    with simulated_device(limit):
        for _ in range(CALLS):
            run()
            ran.append(tried[-1])
    settled = ran[-1]
    shown = " ".join(map(str, tried[:12])) + (" ..." if len(tried) > 12 else "")
    return [str(fits), name, str(ooms[0]), str(settled), f"{(fits - settled) / fits:.1%}", str(sum(ran)), shown]


def sizes_table() -> list[list[str]]:
    table = []
    for fits, start in ((7, 8), (100, 128), (1500, 2048)):
        limit = _limit(fits)
        for name, wrap in _candidates(start).items():
            table.append(_settle(fits, limit, name, wrap))
    return table


def _grown(gain: float | None) -> list[str]:
    """Grow from 8 rows by throughput (or by size alone, ``gain=None``); return the row of the table."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = torch.randn(2048, 512)
    first = [True]

    def work(batch_size: int) -> None:
        if first[0] and batch_size > 8:
            raise make_oom()
        first[0] = False
        model(data[:batch_size]).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    run = koila.batch(initial=2048, grow=True, grow_after=1, grow_gain=gain, cache=koila.GlobalCache())(work)
    for _ in range(40):
        run()
    rates = ", ".join(f"{size}: {rate:,.0f}" for size, rate in run.stats.throughput.items())
    return ["none" if gain is None else f"{gain:.0%}", str(run.stats.batch_size), rates]


def throughput_table() -> list[list[str]]:
    return [_grown(0.03), _grown(None)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rst", action="store_true", help="also print the tables for docs/performance.rst")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print_load("before")
    if _accelerate() is None:
        print("note: accelerate not importable: its rows skipped (pip install accelerate==1.15.0)")
    sizes_header = ["N fit", "candidate", "OOMs", "settled", "below N", f"rows in {CALLS} calls", "sizes tried"]
    sizes = sizes_table()
    print_text(sizes_header, sizes)
    print()
    throughput_header = ["grow_gain", "settled", "rows/s by size (stats.throughput)"]
    rates = throughput_table()
    print_text(throughput_header, rates)
    print_load("after")
    if args.rst:
        print()
        print_rst(sizes_header, sizes, "Sizes between powers of two, on the stand-in")
        print()
        print_rst(throughput_header, rates, "Growth that weighs throughput, a real step on the CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
