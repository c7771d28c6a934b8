"""Measure what a call that gives up costs: the time until ``BatchSizeExhausted`` reaches the caller.

A function decorated with ``@koila.batch(initial=1, cache=koila.NoCache())`` runs a small
model's forward on four rows and raises ``koila_retry.testing.make_oom()``: its only
attempt fails at the minimum, and the call gives up. What is timed is the whole call, from
the caller's line to the ``except koila.BatchSizeExhausted`` that catches it: the forward
(a fraction of a millisecond), the release of the failed attempt's memory, and the message
that names the sizes tried, where the error was raised and what holds the memory.

What a give-up costs grows with what it walks through: a full garbage collection, or a list
of every object the collector tracks, takes time in proportion to every object of the
process. So the script imports what a training script would (torch, and accelerate and
transformers when they are installed) and says how many objects the collector tracks. It
also counts, in a separate pass, the full collections (``gc.collect()`` of generation 2)
and the object lists (``gc.get_objects()``) one give-up makes.

With ``--against REV`` (a git revision), REV's ``koila_retry`` is copied into a temporary
folder (``git archive``) and the same measurement runs in turn in a process importing that
copy ("base") and in one importing this working tree ("this tree"), ``--rounds`` times
each, alternating, and the times are pooled per version. From the repository root::

    PYTHONPATH=. python benchmarks/give_up.py
    PYTHONPATH=. python benchmarks/give_up.py --against HEAD --rst
"""

from __future__ import annotations

import argparse
import csv
import gc
import importlib
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
# A training script's imports; each one adds objects that a full collection walks through.
LIBRARIES = ("accelerate", "transformers")


def measure(calls: int) -> dict[str, Any]:
    """Time ``calls`` give-ups in this process; return the times and what one give-up collects and lists."""
    imported = []
    for name in LIBRARIES:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        imported.append(name)
    import koila_retry as koila
    from koila_retry.testing import make_oom

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10))
    optimizer = torch.optim.Adam(model.parameters())
    inputs = torch.randn(4, 256)
    model(inputs).sum().backward()
    optimizer.step()

    @koila.batch(initial=1, cache=koila.NoCache())
    def step(batch_size: int, model: nn.Module, inputs: torch.Tensor) -> None:
        model(inputs[:batch_size])
        raise make_oom()

    def give_up() -> str:
        try:
            step(model, inputs)
        except koila.BatchSizeExhausted as error:
            return str(error)
        raise AssertionError("the call did not give up")

    message = give_up()  # warm: the first call reads the device and fills lazy caches
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        give_up()
        times.append(time.perf_counter() - started)

    counts = {"full collections": 0, "object lists": 0}
    collect, get_objects = gc.collect, gc.get_objects

    def counting_collect(generation: int = 2) -> int:
        counts["full collections"] += generation == 2
        return collect(generation)

    def counting_get_objects(*args: Any, **kwargs: Any) -> list[Any]:
        counts["object lists"] += 1
        return get_objects(*args, **kwargs)

    gc.collect, gc.get_objects = counting_collect, counting_get_objects
    try:
        give_up()
    finally:
        gc.collect, gc.get_objects = collect, get_objects
    return {
        "file": koila.__file__,
        "imported": imported,
        "objects": len(gc.get_objects()),
        "times": times,
        "counts": counts,
        "message": message,
    }


def git(*arguments: str) -> bytes:
    return subprocess.run(["git", *arguments], cwd=ROOT, capture_output=True, check=True).stdout


def in_process(root: Path, calls: int) -> dict[str, Any]:
    """Run :func:`measure` in a fresh process that imports ``koila_retry`` from ``root``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--calls", str(calls)]
    done = subprocess.run(command, env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def row(label: str, results: list[dict[str, Any]]) -> list[str]:
    times = [value for result in results for value in result["times"]]
    counts = results[-1]["counts"]
    return [
        label,
        f"{len(times)}",
        f"{results[-1]['objects']:,}",
        ms(statistics.median(times)),
        ms(min(times)),
        str(counts["full collections"]),
        str(counts["object lists"]),
    ]


HEADER = ["koila_retry", "give-ups", "objects tracked", "per give-up (median)", "(min)", "full gc", "object lists"]


def print_table(table: list[list[str]], rst: bool) -> None:
    widths = [max(len(line[index]) for line in [HEADER, *table]) for index in range(len(HEADER))]
    for number, line in enumerate([HEADER, *table]):
        print(
            "  ".join(
                cell.ljust(width) if index == 0 else cell.rjust(width)
                for index, (cell, width) in enumerate(zip(line, widths, strict=True))
            )
        )
        if number == 0:
            print("  ".join("-" * width for width in widths))
    if rst:
        print()
        print(".. csv-table:: The time a call that gives up takes (``benchmarks/give_up.py``)")
        print("   :header-rows: 1")
        print()
        for line in [HEADER, *table]:
            row = io.StringIO()
            csv.writer(row, lineterminator="").writerow(line)
            print(f"   {row.getvalue()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20, help="give-ups timed per run (default 20)")
    parser.add_argument("--rounds", type=int, default=3, help="with --against: runs of each version (default 3)")
    parser.add_argument("--against", metavar="REV", help="also measure REV's koila_retry, in turn with this tree's")
    parser.add_argument("--rst", action="store_true", help="also print the table as a reStructuredText csv-table")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.calls < 1 or args.rounds < 1:
        parser.error(f"--calls and --rounds must be >= 1, got {args.calls} and {args.rounds}")
    if args.worker:
        print(json.dumps(measure(args.calls)))
        return 0
    print(f"Python {platform.python_version()} on {platform.machine()} {platform.system()}, {os.cpu_count()} CPUs")
    print(f"torch {torch.__version__}")
    if hasattr(os, "getloadavg"):
        print("load average before the run: " + ", ".join(f"{load:.2f}" for load in os.getloadavg()))
    if args.against is None:
        results = [in_process(ROOT, args.calls)]
        print(f"koila_retry from {results[0]['file']}, with {', '.join(['torch', *results[0]['imported']])}")
        print_table([row("this tree", results)], args.rst)
        print(f"\nThe message:\n{results[0]['message']}")
        return 0
    commit = git("rev-parse", "--verify", f"{args.against}^{{commit}}").decode().strip()
    print(f"base: {args.against} = {commit[:12]}, koila_retry/ copied with git archive; this tree: {ROOT}")
    versions: dict[str, list[dict[str, Any]]] = {"base": [], "this tree": []}
    with tempfile.TemporaryDirectory(prefix="koila-give-up-") as folder:
        with tarfile.open(fileobj=io.BytesIO(git("archive", "--format=tar", commit, "koila_retry"))) as archive:
            if hasattr(tarfile, "data_filter"):
                archive.extractall(folder, filter="data")
            else:  # Python 3.10 and 3.11 before their security releases of 2023
                archive.extractall(folder)  # git's own archive of a commit
        roots = {"base": Path(folder), "this tree": ROOT}
        for number in range(args.rounds):
            for label in ("base", "this tree") if number % 2 == 0 else ("this tree", "base"):
                versions[label].append(in_process(roots[label], args.calls))
            print(f"  round {number + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    for label, results in versions.items():
        print(f"{label}: koila_retry from {results[0]['file']}, with {', '.join(['torch', *results[0]['imported']])}")
    print_table([row(label, results) for label, results in versions.items()], args.rst)
    for label, results in versions.items():
        print(f"\nThe message ({label}):\n{results[0]['message']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
