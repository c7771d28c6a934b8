"""Embed more rows than fit in memory at once, in chunks that resume where they failed.

A simulated device stands in for a small GPU: the tensors created inside it count
against its limit, and going over the limit raises a real ``torch.OutOfMemoryError``.
``koila.chunked`` runs a small model over the rows a chunk at a time. The results of
finished chunks are kept for the join, so memory gets shorter as the pass goes on, and a
chunk part-way through runs out of memory. Only that chunk is run again, from its own
first row, at half the size; the finished chunks are kept. A second pass writes into a
preallocated buffer with ``out=``, which saves the copy that joining costs. Both results
are compared with a plain loop that had all the memory it wanted.

The model and the inputs are made before the simulated device, so its limit is the
memory left for the pass itself: each chunk's activations, and the results.

With koila-retry installed from a clone, as the README says
(``pip install -c constraints.txt '.[progress,plot]'``), run::

    python examples/embed_large_tensor.py
    python examples/embed_large_tensor.py --progress   # a progress bar: the progress extra
    python examples/embed_large_tensor.py --rows 20000 --memory 4.5MiB --initial 1024
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from torch import nn

import koila_retry as koila
from koila_retry.testing import simulated_device

FEATURES, HIDDEN, DIMENSIONS = 32, 512, 16


class Tally:
    """The rows whose chunk finished, to say where an out-of-memory error happened."""

    def __init__(self, write: Callable[[str], object] = print) -> None:
        self.rows = 0
        self.write = write  # tqdm.write under a progress bar, which a plain print would break

    def report(self, event: koila.OOMEvent) -> None:
        """Print each out-of-memory error as ``koila.chunked`` recovers from it."""
        self.write(
            f"  after {self.rows:>7} rows: a chunk of {event.batch_size} rows ran out of memory; "
            f"resuming at row {self.rows} with chunks of {event.next_batch_size}"
        )


def encode(model: nn.Module, rows: torch.Tensor, tally: Tally) -> torch.Tensor:
    """Return the embeddings of a chunk of rows.

    ``koila.chunked`` splits the tensor argument, ``rows``, and passes the model and the
    tally as they are. A chunk that runs out of memory raises inside ``model(rows)``, so
    it never reaches the count: a side effect placed after the work counts each row once.
    """
    with torch.no_grad():
        embeddings = model(rows)
    tally.rows += len(rows)
    return embeddings


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200_000, help="rows to embed (default: %(default)s)")
    parser.add_argument(
        "--memory", default="36MiB", help="the simulated memory left for the pass (default: %(default)s)"
    )
    parser.add_argument("--initial", type=int, default=8192, help="the first chunk size (default: %(default)s)")
    parser.add_argument("--progress", action="store_true", help="show a progress bar; needs tqdm (the progress extra)")
    args = parser.parse_args(argv)
    try:  # read as the simulated device reads it
        limit = simulated_device(args.memory).limit
    except ValueError as error:
        parser.error(f"--memory: {error}")
    if limit < 1:
        parser.error(f"--memory must be more than 0 bytes, like 16MiB, got {args.memory!r}")
    if args.rows < 1 or args.initial < 1:
        parser.error("--rows and --initial must be >= 1")

    # The first simulated device of a process makes PyTorch import its compiler stack, which
    # takes a few seconds: pay for it before any clock starts.
    with simulated_device(args.memory):
        torch.zeros(1).add_(1)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, DIMENSIONS)).eval()
    inputs = torch.randn(args.rows, FEATURES)

    # Under a progress bar, tqdm.write keeps the messages off the bar's line.
    write: Callable[[str], object] = print
    if args.progress:
        from tqdm import tqdm

        write = tqdm.write

    # The decorated function has stats; the options apply to every call.
    tally = Tally(write)
    embed = koila.chunked(initial=args.initial, on_oom=tally.report, progress=args.progress)(encode)
    print(f"Embedding {args.rows} rows with {args.memory} of simulated memory, in chunks of {args.initial} at first:")
    with simulated_device(args.memory) as device:
        started = time.perf_counter()
        joined = embed(model, inputs, tally)
        seconds = time.perf_counter() - started
    stats = embed.stats
    print(
        f"Joined: {tally.rows} rows in {seconds:.2f} s ({tally.rows / seconds:,.0f} rows/s), "
        f"{stats.ooms} out-of-memory error(s), last chunk size {stats.batch_size}, "
        f"{stats.seconds_lost:.2f} s lost to failures, peak {device.peak / 2**20:.1f} MiB."
    )

    # out=: each chunk's result is copied into the buffer, and nothing is joined at the end.
    tally = Tally(write)
    print("Writing into a preallocated buffer with out=:")
    with simulated_device(args.memory) as device:
        buffer = torch.empty(args.rows, DIMENSIONS)
        started = time.perf_counter()
        result = koila.chunked(
            encode, model, inputs, tally, initial=args.initial, out=buffer, on_oom=tally.report, progress=args.progress
        )
        seconds = time.perf_counter() - started
    print(
        f"Written: {tally.rows} rows in {seconds:.2f} s ({tally.rows / seconds:,.0f} rows/s), "
        f"peak {device.peak / 2**20:.1f} MiB, the buffer included; the result is the buffer: {result is buffer}."
    )

    with torch.no_grad():  # a plain loop, no memory limit
        reference = torch.cat([model(chunk) for chunk in inputs.split(16_384)])
    torch.testing.assert_close(joined, reference)
    torch.testing.assert_close(buffer, reference)
    largest = max((joined - reference).abs().max().item(), (buffer - reference).abs().max().item())
    print(f"Both match an unconstrained run (largest difference {largest:.1e}).")


if __name__ == "__main__":
    try:
        main()
    except torch.OutOfMemoryError as error:  # before the first retry: the model itself does not fit
        raise SystemExit(f"error: {str(error).splitlines()[0]} (try a larger --memory)") from None
