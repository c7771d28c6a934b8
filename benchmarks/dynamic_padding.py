"""Count the out-of-memory errors of an epoch of padded batches under ``@koila.accumulate``, per cache.

A data loader with dynamic padding pads each batch to its own longest sequence, so every
batch can have a shape of its own. ``@koila.accumulate`` keeps the micro-batch size that
worked in a cache whose key holds the shape of one sample; this script measures how
often an epoch of such batches runs out of memory with each cache, side by side in one
run.

The epoch: 12 training steps of 32 sequences each, made from a fixed seed. Step by step
the batches are padded to 20, 12, 40, 24, 12, 30, 48, 14, 60, 20, 16 and 40 tokens: nine
lengths, in three size classes of koila's key (9 to 16, 17 to 32 and 33 to 64 tokens).
Within a batch, each sequence has between half its padded length and all of it (one
sequence has all of it), as a length-grouped sampler gives. The labels are the next tokens,
shifted by the collator, ``-100`` where there is padding. The model is a small token model
in plain PyTorch: an embedding of 512 tokens in 64 dimensions, a per-token MLP (64 -> 256
-> 64, GELU, with a residual connection) and an LM head; the loss is
``cross_entropy(..., ignore_index=-100)``, a mean over the tokens that are not padding.
Each step is ``@koila.accumulate(weight=tokens)``, ``tokens`` counting those tokens, then
an SGD step. Each step runs under ``koila_retry.testing.simulated_device`` with a limit of
6 MiB: the whole batches of 20 tokens or fewer fit, the longer ones do not (the per-step
table gives each whole step's peak). The model and the batches are made outside the
device, so what counts is the step's activations and gradients.

The candidates, each with a fresh model from the same seed and a fresh cache per epoch:

- koila's default cache (``StackMemoryCache``), whose key holds the sample's shape in
  size classes (each length up to a power of two);
- ``GlobalCache``, one size for every shape;
- ``NoCache``: every step starts from the whole batch, as a plain loop would, and splits
  after an OOM; the baseline of the "vs NoCache" column;
- with ``--against REV``: the default cache of revision REV (``--against e03fba2``: a key
  per padded length). REV's ``koila_retry`` is copied into a temporary folder
  (``git archive``) and every round runs in two fresh processes, one importing that copy
  and one importing this tree, in turn. A revision without ``weight=`` runs the steps
  without it (micro-batches weighted by rows): the memory is the same, the gradient not;
- accelerate's ``find_executable_batch_size``, when installed (``--no-peers`` leaves it
  out). It does not split a step: on an OOM, accelerate 1.15.0 multiplies the batch size
  by 0.9 and runs the decorated function again from its start, here the epoch with a fresh
  model and the batches made again from the same sequences at the new size, and that size
  stays for the rest of training. Hugging Face's ``Trainer(auto_find_batch_size=True)``
  calls it.

What is counted: the OOMs over the epoch (``stats.ooms``), the micro-batch size of each
step (``stats.batch_size`` after the call) and the micro-batches run, the time lost to
failed attempts (``stats.seconds_lost``: the attempts that failed and the release of their
memory) and the time of the epoch's steps. The OOMs and the sizes are the same in every
round (the script says so if not); the times are medians over ``--rounds`` rounds, each an
epoch of every candidate, in an order rotated from round to round. In the first round,
each loss koila returns is checked against the whole batch's token mean, computed outside
the simulated device: the script stops if they differ.

Run it from the repository root::

    PYTHONPATH=. python benchmarks/dynamic_padding.py
    PYTHONPATH=. python benchmarks/dynamic_padding.py --against e03fba2 --rst   # docs/performance.rst

The exit status is 0 whatever the counts are.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import torch
from common import (  # the script's own folder is on sys.path
    BatchSizeFinder,
    add_run_flags,
    duration,
    print_rst,
    print_text,
    settle_rounds,
    unpack_revision,
    version_of,
)
from torch import nn
from torch.nn import functional

import koila_retry as koila
from koila_retry.testing import simulated_device

ROOT = Path(__file__).resolve().parent.parent
VOCABULARY, WIDTH, ROWS = 512, 64, 32
PADDED = (20, 12, 40, 24, 12, 30, 48, 14, 60, 20, 16, 40)  # each step's padded length
LIMIT = 6 * 2**20  # the simulated device's memory: whole batches of up to 20 tokens fit
TOLERANCE = 1e-5  # how far koila's loss may be from the whole batch's, relative
CACHES = ("default", "global", "none")  # koila's candidates, by the name a worker is given
ACCELERATE = "accelerate"
# Whether the koila_retry imported has accumulate(weight=); an older revision under --against may not.
WEIGHTED = "weight" in inspect.signature(koila.accumulate).parameters


class TokenModel(nn.Module):
    """An embedding, a per-token MLP with a residual connection, and an LM head."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCABULARY, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
        self.head = nn.Linear(WIDTH, VOCABULARY)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embedding(ids)
        logits: torch.Tensor = self.head(hidden + self.mlp(hidden))
        return logits


def sequences() -> list[torch.Tensor]:
    """Return the epoch's sequences of tokens in order, ``ROWS`` a step, the longest as long as the step's padding."""
    generator = torch.Generator().manual_seed(0)
    found = []
    for length in PADDED:
        lengths = torch.randint(length // 2 + 1, length + 1, (ROWS,), generator=generator)
        lengths[torch.randint(0, ROWS, (1,), generator=generator)] = length
        found += [torch.randint(1, VOCABULARY, (int(size),), generator=generator) for size in lengths]
    return found


def collate(batch: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad sequences to the longest of them; the labels are the next tokens, -100 past the end."""
    length = max(len(sequence) for sequence in batch)
    ids = torch.zeros(len(batch), length, dtype=torch.long)
    labels = torch.full((len(batch), length), -100, dtype=torch.long)
    for row, sequence in enumerate(batch):
        ids[row, : len(sequence)] = sequence
        labels[row, : len(sequence) - 1] = sequence[1:]
    return ids, labels


def batches(rows: int = ROWS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Return the epoch's batches of ``rows`` sequences, each padded to its own longest."""
    found = sequences()
    return [collate(found[begin : begin + rows]) for begin in range(0, len(found), rows)]


def loss_of(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Return the mean loss over the tokens that are not padding."""
    return functional.cross_entropy(model(ids).flatten(0, 1), labels.flatten(), ignore_index=-100)


def tokens(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Count the tokens a micro-batch's loss averages over: ``weight=`` of the step."""
    return (labels != -100).sum()


def peaks() -> list[int]:
    """Return the peak memory of each whole step, in bytes, on a simulated device with room for it."""
    torch.manual_seed(0)
    model = TokenModel()
    found = []
    for ids, labels in batches():
        model.zero_grad(set_to_none=True)
        with simulated_device(2**40) as device:
            loss_of(model, ids, labels).backward()  # type: ignore[no-untyped-call]  # unannotated in torch
        found.append(device.peak)
    return found


# One epoch of each candidate ---------------------------------------------------------------------


def koila_epoch(cache: str, data: list[tuple[torch.Tensor, torch.Tensor]], check: bool) -> dict[str, Any]:
    """Train one epoch with ``@koila.accumulate`` and the cache named; return what it counted."""
    torch.manual_seed(0)
    model = TokenModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    options: dict[str, Any] = {}
    if cache == "global":
        options["cache"] = koila.GlobalCache()
    elif cache == "none":
        options["cache"] = koila.NoCache()
    if WEIGHTED:
        options["weight"] = tokens

    @koila.accumulate(**options)
    def step(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return loss_of(model, ids, labels)

    stats = step.stats
    sizes, ooms, seconds = [], [], 0.0
    for ids, labels in data:
        optimizer.zero_grad(set_to_none=True)
        if check and WEIGHTED:
            with torch.no_grad():  # outside the device: the whole batch does not fit in it
                expected = loss_of(model, ids, labels).item()
        before = stats.ooms
        started = time.perf_counter()
        with simulated_device(LIMIT):
            loss = step(ids, labels)
        seconds += time.perf_counter() - started
        optimizer.step()
        sizes.append(stats.batch_size)
        ooms.append(stats.ooms - before)
        if check and WEIGHTED and not math.isclose(loss.item(), expected, rel_tol=TOLERANCE):
            raise SystemExit(
                f"koila's loss {loss.item()!r} ({cache} cache, step {len(sizes)}) is not the whole batch's "
                f"token mean {expected!r}"
            )
    return {
        "ooms": ooms,
        "sizes": sizes,
        "micro-batches": sum(math.ceil(len(ids) / size) for (ids, _), size in zip(data, sizes, strict=True)),
        "lost": stats.seconds_lost,
        "seconds": seconds,
    }


def accelerate_epoch() -> dict[str, Any]:
    """Train one epoch under accelerate's ``find_executable_batch_size``; return what it counted."""
    from accelerate.utils import find_executable_batch_size

    finder: BatchSizeFinder = find_executable_batch_size  # its signature: accelerate ships no types
    found = sequences()
    runs: list[tuple[int, float]] = []  # each run's batch size and when it started
    done: list[int] = []  # the batches of the run that finished

    @finder(starting_batch_size=ROWS)
    def train(batch_size: int) -> None:
        runs.append((batch_size, time.perf_counter()))
        torch.manual_seed(0)
        model = TokenModel()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        data = [collate(found[begin : begin + batch_size]) for begin in range(0, len(found), batch_size)]
        for ids, labels in data:
            optimizer.zero_grad(set_to_none=True)
            with simulated_device(LIMIT):
                loss_of(model, ids, labels).backward()  # type: ignore[no-untyped-call]  # unannotated in torch
            optimizer.step()
        done.append(len(data))

    started = time.perf_counter()
    train()
    ended = time.perf_counter()
    size, last = runs[-1]
    return {
        "ooms": [len(runs) - 1],
        "sizes": [size] * done[0],
        "runs": [batch_size for batch_size, _ in runs],
        "micro-batches": done[0],
        "lost": last - started,  # the runs that failed, and accelerate's cleanup after each
        "seconds": ended - started,
    }


def warm_up(data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Run a step that runs out of memory once, so that no candidate pays for what a first one initialises."""
    torch.manual_seed(0)
    model = TokenModel()
    # weight= as the timed steps pass it: without it koila warns that it weighs by rows.
    options: dict[str, Any] = {"weight": tokens} if WEIGHTED else {}

    @koila.accumulate(cache=koila.NoCache(), **options)
    def step(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return loss_of(model, ids, labels)

    ids, labels = max(data, key=lambda batch: batch[0].shape[1])
    with simulated_device(LIMIT):
        step(ids, labels)


def measure(names: list[str], number: int) -> dict[str, Any]:
    """Run round ``number``: an epoch of each candidate named, in an order rotated by ``number``."""
    data = batches()
    warm_up(data)
    shift = number % len(names)
    results = {}
    for name in names[shift:] + names[:shift]:
        results[name] = accelerate_epoch() if name == ACCELERATE else koila_epoch(name, data, check=number == 0)
    return {
        "file": koila.__file__,
        "version": koila.__version__,
        "weighted": WEIGHTED,
        "results": results,
    }


def in_process(root: Path, names: list[str], number: int, cwd: str) -> dict[str, Any]:
    """Run :func:`measure` in a fresh process that imports ``koila_retry`` from ``root``, and only that one."""
    env = {**os.environ, "PYTHONPATH": str(root)}  # replaced: PYTHONPATH=. would lead the base to this tree
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", ",".join(names), "--round", str(number)]
    done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the worker importing koila_retry from {root} failed:\n{done.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


# The tables ---------------------------------------------------------------------------------------


def same(runs: list[dict[str, Any]], field: str) -> Any:
    """Return a field of the first round, or ``None`` if the rounds disagree on it."""
    first = runs[0][field]
    return first if all(run[field] == first for run in runs) else None


def summary(columns: dict[str, list[dict[str, Any]]], baseline: str) -> tuple[list[str], list[list[str]]]:
    header = [
        "candidate",
        "OOMs",
        "OOMs vs NoCache",
        "micro-batch sizes",
        "micro-batches",
        "time lost (median)",
        "(min)",
        "epoch (median)",
    ]
    base_ooms = sum(columns[baseline][0]["ooms"])
    table = []
    for label, runs in columns.items():
        counts = sorted({sum(run["ooms"]) for run in runs})
        ooms = counts[0]
        lost = [run["lost"] for run in runs]
        table.append(
            [
                label,
                str(ooms) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}",
                f"{ooms / base_ooms:.2f}x" if base_ooms else "n/a",
                ", ".join(str(size) for size in sorted(set(runs[0]["sizes"]), reverse=True)),
                str(runs[0]["micro-batches"]),
                duration(statistics.median(lost)),
                duration(min(lost)),
                duration(statistics.median(run["seconds"] for run in runs)),
            ]
        )
    return header, table


def per_step(columns: dict[str, list[dict[str, Any]]], heads: dict[str, str]) -> tuple[list[str], list[list[str]]]:
    header = ["step", "padded length", "size class", "tokens", "whole step, peak", *heads.values()]
    table = []
    data = batches()
    for number, ((ids, labels), peak) in enumerate(zip(data, peaks(), strict=True)):
        length = ids.shape[1]
        line = [
            str(number + 1),
            str(length),
            f"{(1 << (length - 1).bit_length()) // 2 + 1}-{1 << (length - 1).bit_length()}",
            str(int(tokens(ids, labels))),
            f"{peak / 2**20:.2f} MiB" + (" (fits)" if peak <= LIMIT else ""),
        ]
        for label in heads:
            runs = columns[label]
            size, ooms = runs[0]["sizes"][number], runs[0]["ooms"][number]
            line.append(f"{size}" + (f" ({ooms} OOM{'s' if ooms > 1 else ''})" if ooms else ""))
        table.append(line)
    return header, table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, help="epochs of each candidate (default 30; 4 with --quick)")
    parser.add_argument(
        "--against", metavar="REV", help="also run REV's default cache, each round in a process beside this tree's"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # a worker of --against: the candidates to run
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    add_run_flags(parser, no_peers="leave accelerate out")
    args = parser.parse_args(argv)
    settle_rounds(parser, args)
    torch.set_num_threads(1)
    if args.worker is not None:
        print(json.dumps(measure(args.worker.split(","), args.round)))
        return 0

    began = time.perf_counter()
    notes: list[str] = []
    names: list[str] = list(CACHES)
    if args.no_peers:
        notes.append("accelerate skipped (--no-peers)")
    elif version_of("accelerate") == "not installed":
        notes.append("accelerate not installed: skipped (pip install accelerate==1.15.0, or run tox -e bench)")
    else:
        names.append(ACCELERATE)
    print(f"Python {platform.python_version()} on {platform.machine()} {platform.system()}, {os.cpu_count()} CPUs")
    print(
        f"torch {torch.__version__} ({torch.get_num_threads()} thread), koila-retry {koila.__version__}, "
        f"accelerate {version_of('accelerate')}"
    )
    if hasattr(os, "getloadavg"):
        print("load average before the run: " + ", ".join(f"{load:.2f}" for load in os.getloadavg()))
    print(
        f"epoch: {len(PADDED)} steps of {ROWS} sequences padded to {', '.join(map(str, PADDED))} tokens "
        f"({len(set(PADDED))} lengths); simulated device of {LIMIT / 2**20:g} MiB; {args.rounds} rounds"
    )

    labels = {
        "default": "StackMemoryCache (default), this tree",
        "global": "GlobalCache",
        "none": "NoCache (whole batch first)",
        ACCELERATE: f"accelerate {version_of('accelerate')} find_executable_batch_size",
    }
    heads = {labels["default"]: "default", labels["global"]: "GlobalCache", labels["none"]: "NoCache"}
    rounds: dict[str, list[dict[str, Any]]] = {}  # per version: what each round's measure returned
    if args.against is None:
        print(f"koila_retry from {koila.__file__}")
        rounds["this tree"] = []
        for number in range(args.rounds):
            rounds["this tree"].append(measure(names, number))
            print(f"  round {number + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    else:
        with tempfile.TemporaryDirectory(prefix="koila-padding-") as folder:
            base, cwd = Path(folder, "base"), Path(folder, "cwd")
            base.mkdir()
            cwd.mkdir()  # a folder without koila_retry in it
            commit = unpack_revision(args.against, base)
            print(f"base: {args.against} = {commit[:12]}, koila_retry/ copied with git archive; this tree: {ROOT}")
            roots = {"base": (base, ["default"]), "this tree": (ROOT, names)}
            rounds = {"base": [], "this tree": []}
            for number in range(args.rounds):
                for version in ("base", "this tree") if number % 2 == 0 else ("this tree", "base"):
                    root, chosen = roots[version]
                    rounds[version].append(in_process(root, chosen, number, str(cwd)))
                print(f"  round {number + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        for version, results in rounds.items():
            print(f"{version}: koila_retry {results[0]['version']} from {results[0]['file']}")
        if not rounds["base"][0]["weighted"]:
            notes.append(
                f"{args.against} has no accumulate(weight=): its steps weigh micro-batches by rows (same memory)"
            )
        label = f"StackMemoryCache (default), {args.against}"
        labels["base"] = label
        heads = {labels["default"]: "default", label: f"default, {args.against}", **dict(list(heads.items())[1:])}

    columns: dict[str, list[dict[str, Any]]] = {}
    for version, results in rounds.items():
        for name in results[0]["results"]:
            columns[labels["base" if version == "base" else name]] = [result["results"][name] for result in results]
    order = [labels[name] for name in ("default", "base", "global", "none", ACCELERATE) if name in labels]
    columns = {label: columns[label] for label in order if label in columns}
    for label, runs in columns.items():
        if same(runs, "sizes") is None or same(runs, "ooms") is None:
            notes.append(f"{label}: the OOMs or sizes differed between rounds; the tables give the first round's")

    step_header, steps = per_step(columns, heads)
    header, table = summary(columns, labels["none"])
    print("\nPer step: the micro-batch size koila settled on, and the OOMs on the way:")
    print_text(step_header, steps)
    print("\nOver the epoch:")
    print_text(header, table)
    print(
        "OOMs: out-of-memory errors over the epoch (stats.ooms); vs NoCache: their ratio to NoCache's, which starts\n"
        "every step from the whole batch; micro-batches: those run in the attempts that finished; time lost:\n"
        "stats.seconds_lost, the failed attempts and the release of their memory; epoch: the steps' time"
    )
    if ACCELERATE in names:
        runs = columns[labels[ACCELERATE]]
        sizes, steps_run = runs[0]["runs"], runs[0]["micro-batches"]
        explained = (
            "accelerate's find_executable_batch_size does not split a step. After each OOM it multiplied the batch "
            f"size by 0.9 and ran the epoch again from its first step ({' -> '.join(map(str, sizes))} rows), and "
            f"the last size stays for the rest of training: {steps_run} optimizer steps of {sizes[-1]} rows instead "
            f"of {len(PADDED)} of {ROWS}, so the optimizer sees another batch size. Its OOMs are the runs of the "
            "epoch that failed, its time lost their time and accelerate's cleanup after each."
        )
        print("\n" + textwrap.fill(explained, 110))
    for note in dict.fromkeys(notes):
        print(f"note: {note}")
    if args.rst:
        print()
        print_rst(step_header, steps, "The micro-batch size of each step, and its OOMs")
        print()
        print_rst(header, table, "OOMs over an epoch of padded batches")
    if hasattr(os, "getloadavg"):
        print("\nload average after the run: " + ", ".join(f"{load:.2f}" for load in os.getloadavg()))
    print(f"the run took {time.perf_counter() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
