"""Measure what ``@koila.accumulate`` costs per training step, whole or split into micro-batches.

One process, one run, side by side. Three small models, each a training step of about 2 to
15 ms over the whole batch on one thread (``torch.set_num_threads(1)``), the MLP's the
shortest, on the machine of docs/performance.rst: an MLP (64 -> 128 -> 128 -> 10, 1,000
rows), a transformer encoder (token embedding, two ``nn.TransformerEncoderLayer`` of width
32, four heads, feed-forward 64, no dropout, 120 sequences of 8 tokens) and a CNN (two 3x3
convolutions of 8 and 16 channels on 250 images of 12x12). The loss is ``cross_entropy``, a
mean over the rows. No optimizer step is taken: the parameters stay as they are, so every
step does the same work and has the same gradient.

For each model, four settings:

- the whole batch fits: ``@koila.accumulate`` (``initial=None``) next to the plain step
  ``loss = loss_fn(model(x), y); loss.backward()``;
- split into k = 2, 4 and 8 micro-batches of m rows, the last one shorter (for the MLP,
  m = 512, 256 and 128 on 1,000 rows: 512 + 488, 3 x 256 + 232, 7 x 128 + 104):
  ``@koila.accumulate(initial=m)`` next to a hand-written accumulation loop,
  ``for xb, yb in zip(x.split(m), y.split(m)): (loss_fn(model(xb), yb) * len(xb) / N).backward()``.

Every candidate calls ``opt.zero_grad(set_to_none=True)`` before its step. The other
candidates: the baseline again, as a check of the noise; the whole batch in one step,
for the price of splitting at all; "unweighted (koila 0.1.1 style)", each micro-batch's mean
loss backpropagated as it is, without a weight (the behaviour the issue describes for
koila 0.1.1, written by hand here, and timed too); and, when
accelerate is installed (``--no-peers`` leaves it out), its gradient accumulation:
``Accelerator(cpu=True, gradient_accumulation_steps=k)`` and, for each of the k micro-batches,
``with accelerator.accumulate(model): accelerator.backward(loss)``. accelerate 1.15.0's
``Accelerator.backward`` divides every loss by ``gradient_accumulation_steps`` (outside
DeepSpeed), whatever the micro-batch's rows, so an uneven split weights the short last
micro-batch like the others and the gradient differs from the full batch's; the table
shows by how much. Its ``GradientState`` is shared by every ``Accelerator`` of the
process, so each setting makes its own, with its k, just before it is timed. On the CPU
``prepare(model)`` returns the model itself, which the script checks (it skips accelerate
with a note otherwise): its forward is the same as the other candidates'.

Each candidate's gradient is checked once against the full-batch gradient of the plain
step: the "grad. error" column is the largest, over the parameters, of
``||g - g_full|| / ||g_full||``. The hand loop, with its weights, agrees to float32
rounding, and so must koila: the script stops if koila's error exceeds 1e-4, if the loss
it returns differs from the whole batch's, or if it leaves its happy path (an
out-of-memory error, another micro-batch size, a size in its cache). A wrapper around
the model records the rows of every forward, and every timed block is checked to have
seen exactly the intended micro-batches.

The candidates are interleaved: every round times a block of steps of each (about
40 ms), in an order rotated from round to round, so that machine noise falls on all of
them alike. The tables give the median and the minimum over rounds of the time per
step and, paired within each round, the median of the time added over the baseline
and of the ratio to it; "throughput" is the baseline's time over the candidate's
(median of the per-round ratios). The garbage collector stays enabled.

The clock is the wall clock (``time.perf_counter``) unless ``--clock cpu`` asks for
``time.thread_time``, the CPU time of the thread that runs the steps: with one thread, the
forward and the backward (autograd runs a graph of CPU tensors on the thread that calls
``backward()``) are all its work, and time spent waiting for a core while other jobs use
the machine does not count. On a busy machine, the noise-check rows say which to trust.

The targets, from the issues that asked for this benchmark and for a step as light as
the hand loop (issue 40): when the batch fits, ``@koila.accumulate`` costs at most 2%
over the plain step; split into k micro-batches, its throughput is at least 97% of the
hand loop's at the same micro-batch size.

Run it with::

    tox -e bench                             # installs the peers, runs the 8 scripts tox.ini lists
    tox -e bench -- --quick                  # a fast, noisier run
    python benchmarks/accumulate.py --help   # without tox; a missing accelerate is skipped
    python benchmarks/accumulate.py --clock cpu --rst   # how docs/performance.rst was made

The exit status is 0 whether or not the targets are met; the verdict is printed.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from common import (  # the script's own folder is on sys.path
    add_run_flags,
    duration,
    percent,
    print_rst,
    print_text,
    settle_rounds,
    version_of,
)
from torch import nn
from torch.nn import functional

import koila_retry as koila

TARGET_FIT = 1.02  # koila / plain step, when the batch fits
TARGET_SPLIT = 0.97  # throughput of koila / that of the hand loop, split into micro-batches
KOILA_TOLERANCE = 1e-4  # the largest gradient error koila may show
BLOCK_SECONDS = 0.04  # about how long one block of steps takes
# With one thread, the forward and the backward (on the CPU, autograd runs it on the calling
# thread) are all work of the thread that times them.
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}

PLAIN = "plain step"
HAND = "hand loop, weighted by rows"
KOILA = "@koila.accumulate"


# The models -----------------------------------------------------------------------------------


class Encoder(nn.Module):
    """A small transformer encoder that classifies sequences of tokens."""

    def __init__(self, vocabulary: int = 100, length: int = 8, width: int = 32) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, width)
        self.position = nn.Parameter(torch.randn(length, width) * 0.02)
        layer = nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(width, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(self.encoder(self.embedding(tokens) + self.position).mean(1))
        return logits


@dataclass
class Workload:
    """One model with its batch: ``x``, ``y`` of ``rows`` rows, and the micro-batch sizes to split into."""

    name: str
    model: nn.Module
    x: torch.Tensor
    y: torch.Tensor
    sizes: tuple[int, ...]  # micro-batch sizes, for k = 2, 4 and 8

    @property
    def rows(self) -> int:
        return self.x.shape[0]


def workloads() -> list[Workload]:
    generator = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    encoder = Encoder()
    cnn = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )

    def labels(rows: int) -> torch.Tensor:
        return torch.randint(0, 10, (rows,), generator=generator)

    return [
        Workload(
            "MLP 64-128-128-10, 1000 rows",
            mlp,
            torch.randn(1000, 64, generator=generator),
            labels(1000),
            (512, 256, 128),
        ),
        Workload(
            "transformer encoder, 2 layers of width 32, 120 sequences of 8 tokens",
            encoder,
            torch.randint(0, 100, (120, 8), generator=generator),
            labels(120),
            (64, 32, 16),
        ),
        Workload(
            "CNN 8-16 channels, 250 images of 12x12",
            cnn,
            torch.randn(250, 1, 12, 12, generator=generator),
            labels(250),
            (128, 64, 32),
        ),
    ]


# The candidates -------------------------------------------------------------------------------


@dataclass
class Candidate:
    name: str
    call: Callable[[], Any]  # one training step
    expected: list[int]  # the rows of every forward of one step
    peer: bool = False
    check: Callable[[], str | None] | None = None  # a problem, or None
    error: float = float("nan")  # the gradient's largest relative error, over the parameters
    steps: int = 1  # steps per block
    times: list[float] = field(default_factory=list)  # seconds per step, one per round


@dataclass
class Setting:
    """One table's worth of a workload: the whole batch (``size`` None) or micro-batches of ``size`` rows."""

    workload: Workload
    size: int | None
    candidates: list[Candidate] = field(default_factory=list)

    @property
    def pieces(self) -> list[int]:
        rows = self.workload.rows
        size = self.size or rows
        return [min(size, rows - begin) for begin in range(0, rows, size)]

    @property
    def label(self) -> str:
        pieces = self.pieces
        if len(pieces) == 1:
            return f"whole batch ({pieces[0]})"
        return f"k={len(pieces)} ({pieces[0]} x {len(pieces) - 1} + {pieces[-1]})"


def gradients(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def relative_error(found: list[torch.Tensor], full: list[torch.Tensor]) -> float:
    worst = 0.0
    for got, want in zip(found, full, strict=True):
        scale = want.norm().item()
        difference = (got - want).norm().item()
        worst = max(worst, difference / scale if scale > 0 else difference)
    return worst


def build(setting: Setting, args: argparse.Namespace, notes: list[str]) -> None:
    workload = setting.workload
    model, x, y, rows = workload.model, workload.x, workload.y, workload.rows
    size = setting.size
    m = size or rows
    k = len(setting.pieces)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = functional.cross_entropy
    seen: list[int] = []  # the rows of every forward since the last check
    record = seen.append

    def forward(rows_in: torch.Tensor) -> torch.Tensor:
        record(rows_in.shape[0])
        logits: torch.Tensor = model(rows_in)
        return logits

    def plain() -> None:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(forward(x), y)
        loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch

    def hand() -> None:
        opt.zero_grad(set_to_none=True)
        # Tensor.split and Tensor.backward are unannotated in torch (hence the type: ignores).
        for xb, yb in zip(x.split(m), y.split(m)):  # type: ignore[no-untyped-call]
            (loss_fn(forward(xb), yb) * len(xb) / rows).backward()  # type: ignore[no-untyped-call]

    def unweighted() -> None:
        opt.zero_grad(set_to_none=True)
        for xb, yb in zip(x.split(m), y.split(m)):  # type: ignore[no-untyped-call]  # unannotated in torch
            loss_fn(forward(xb), yb).backward()  # type: ignore[no-untyped-call]  # unannotated in torch

    def step(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return loss_fn(forward(xb), yb)

    decorated = koila.accumulate(step) if size is None else koila.accumulate(initial=size)(step)

    def koila_step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        return decorated(x, y)

    def koila_check() -> str | None:
        stats, info = decorated.stats, decorated.cache_info()
        if stats.ooms or stats.batch_size != m or info.currsize:
            return f"{stats!r}, {info}"
        return None

    pieces = setting.pieces
    baseline = PLAIN if size is None else HAND
    base_call = plain if size is None else hand
    candidates = [
        Candidate(baseline, base_call, pieces),
        Candidate(KOILA if size is None else f"{KOILA}(initial={size})", koila_step, pieces, check=koila_check),
        Candidate(f"{baseline} again (noise check)", base_call, pieces),
    ]
    if size is not None:
        candidates.append(Candidate("whole batch, one step (for scale)", plain, [rows]))
        candidates.append(Candidate("unweighted (koila 0.1.1 style)", unweighted, pieces))
    if not args.no_peers:
        try:
            from accelerate import Accelerator
        except ImportError:
            pass
        else:
            # One GradientState for every Accelerator of the process: this one's k holds until the next setting.
            accelerator = Accelerator(cpu=True, gradient_accumulation_steps=k)
            if accelerator.prepare(model) is not model:
                notes.append("accelerate's prepare() wrapped the model: skipped (the benchmark expects it unwrapped)")
            else:

                def accelerated() -> None:
                    opt.zero_grad(set_to_none=True)
                    for xb, yb in zip(x.split(m), y.split(m)):  # type: ignore[no-untyped-call]  # unannotated in torch
                        with accelerator.accumulate(model):
                            accelerator.backward(loss_fn(forward(xb), yb))

                def accelerate_check() -> str | None:
                    steps = accelerator.gradient_accumulation_steps
                    return None if steps == k else f"gradient_accumulation_steps is {steps}, not {k}"

                name = f"accelerate, Accelerator(gradient_accumulation_steps={k})"
                candidates.append(Candidate(name, accelerated, pieces, True, accelerate_check))

    # The full-batch gradient, then each candidate's, once; then a block of warm-up steps.
    loss = loss_fn(forward(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch
    full = gradients(model)
    for candidate in candidates:
        result = candidate.call()
        candidate.error = relative_error(gradients(model), full)
        seen.clear()
        if candidate.call is koila_step and not torch.allclose(result, loss.detach(), rtol=1e-5, atol=0):
            raise SystemExit(f"{candidate.name} returned the loss {result.item()}, the full batch's is {loss.item()}")
    start = time.perf_counter()
    base_call()
    steps = max(1, round(BLOCK_SECONDS / (time.perf_counter() - start)))
    for candidate in candidates:
        candidate.steps = steps
        seen.clear()
        for _ in range(steps):
            candidate.call()
        if seen != candidate.expected * steps:
            raise SystemExit(f"{candidate.name}: forwards of {sorted(set(seen))} rows, expected {pieces}")
        problem = candidate.check() if candidate.check is not None else None
        if problem:
            raise SystemExit(f"{candidate.name} is not on its happy path: {problem}")
    seen.clear()
    koila_row = candidates[1]
    if not koila_row.error <= KOILA_TOLERANCE:
        raise SystemExit(f"{koila_row.name}: gradient differs from the full batch's by {koila_row.error:.2e}")
    # Every block checks the forwards it ran; the check is outside the timing.
    for candidate in candidates:
        previous = candidate.check

        def check(candidate: Candidate = candidate, previous: Callable[[], str | None] | None = previous) -> str | None:
            problem = None if seen == candidate.expected * candidate.steps else f"forwards of {sorted(set(seen))} rows"
            seen.clear()
            return problem or (previous() if previous is not None else None)

        candidate.check = check
    setting.candidates = candidates


def time_block(candidate: Candidate, clock: Callable[[], float]) -> float:
    """Return the seconds per step of one block of steps made from one line."""
    call, steps = candidate.call, candidate.steps
    start = clock()
    for _ in range(steps):
        call()
    return (clock() - start) / steps


def run(setting: Setting, rounds: int, clock: Callable[[], float]) -> None:
    candidates = setting.candidates
    for number in range(rounds):
        shift = number % len(candidates)
        for candidate in candidates[shift:] + candidates[:shift]:
            candidate.times.append(time_block(candidate, clock))
            problem = candidate.check() if candidate.check is not None else None
            if problem:
                raise SystemExit(f"{candidate.name} left its happy path: {problem}")
    print(f"  {setting.workload.name}, {setting.label}: {rounds} rounds done", file=sys.stderr, flush=True)


def paired(candidate: Candidate, base: Candidate) -> tuple[float, float, float]:
    """Return the medians over rounds of the seconds added over ``base``, of the ratio to it and of its inverse."""
    added = statistics.median(t - b for t, b in zip(candidate.times, base.times))
    ratio = statistics.median(t / b for t, b in zip(candidate.times, base.times))
    throughput = statistics.median(b / t for t, b in zip(candidate.times, base.times))
    return added, ratio, throughput


def table_rows(settings: list[Setting]) -> tuple[list[str], list[list[str]]]:
    header = [
        "split",
        "candidate",
        "steps x rounds",
        "per step (median)",
        "per step (min)",
        "added per step",
        "vs baseline",
        "throughput",
        "grad. error",
    ]
    table = []
    for setting in settings:
        base = setting.candidates[0]
        for number, candidate in enumerate(setting.candidates):
            added, ratio, throughput = paired(candidate, base)
            table.append(
                [
                    setting.label if number == 0 else "",
                    candidate.name,
                    f"{candidate.steps} x {len(candidate.times)}",
                    duration(statistics.median(candidate.times)),
                    duration(min(candidate.times)),
                    "" if candidate is base else duration(added),
                    "" if candidate is base else percent(ratio),
                    "" if candidate is base else f"{throughput:.1%}",
                    f"{candidate.error:.1e}",
                ]
            )
    return header, table


def verdicts(settings: list[Setting]) -> tuple[list[str], list[list[str]], bool]:
    header = ["model", "split", "baseline per step", "koila vs baseline", "noise check", "target", "met"]
    table, all_met = [], True
    for setting in settings:
        base, koila_row, again = setting.candidates[:3]
        _, ratio, throughput = paired(koila_row, base)
        _, noise, _ = paired(again, base)
        if setting.size is None:
            met = ratio <= TARGET_FIT
            measured = percent(ratio)
            target = f"<= {percent(TARGET_FIT)} time"
        else:
            met = throughput >= TARGET_SPLIT
            measured = f"{percent(ratio)} time, {throughput:.1%} throughput"
            target = f">= {TARGET_SPLIT:.0%} throughput"
        all_met = all_met and met
        table.append(
            [
                setting.workload.name.split(",")[0],
                setting.label,
                duration(statistics.median(base.times)),
                measured,
                percent(noise),
                target,
                "yes" if met else "NO",
            ]
        )
    return header, table, all_met


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, help="rounds per setting (default 30; 4 with --quick)")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall: time.perf_counter (default); cpu: time.thread_time, the CPU time of the thread that runs the "
        "steps, which other jobs on a busy machine do not inflate",
    )
    add_run_flags(parser, no_peers="leave accelerate out")
    args = parser.parse_args(argv)
    settle_rounds(parser, args)

    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    began = time.perf_counter()
    torch.set_num_threads(1)
    notes: list[str] = []
    if args.no_peers:
        notes.append("peers skipped (--no-peers)")
    elif version_of("accelerate") == "not installed":
        notes.append("accelerate not installed: skipped (pip install accelerate==1.15.0, or run tox -e bench)")
    print(f"Python {platform.python_version()} on {platform.machine()} {platform.system()}, {os.cpu_count()} CPUs")
    print(
        f"torch {torch.__version__} (accelerator: {torch.accelerator.current_accelerator()}, "
        f"{torch.get_num_threads()} thread), koila-retry {koila.__version__}, accelerate {version_of('accelerate')}"
    )
    print(f"clock: {args.clock} ({CLOCKS[args.clock].__module__}.{CLOCKS[args.clock].__name__})")
    if load is not None:
        print("load average before the run: " + ", ".join(f"{value:.2f}" for value in load))
    for note in notes:
        print(f"note: {note}")
    shown = len(notes)

    tables = []
    everything: list[Setting] = []
    for workload in workloads():
        settings = [Setting(workload, None)] + [Setting(workload, size) for size in workload.sizes]
        print(
            f"timing {workload.name}: {', '.join(s.label for s in settings)}, {args.rounds} rounds each ...", flush=True
        )
        for setting in settings:
            build(setting, args, notes)
            run(setting, args.rounds, CLOCKS[args.clock])
        tables.append((workload, *table_rows(settings)))
        everything += settings
    for workload, header, table in tables:
        print(f"\n{workload.name}:")
        print_text(header, table)
    print(
        "baseline: the first row of each split (the plain step for the whole batch, the hand loop for micro-batches);\n"
        "added per step, vs baseline, throughput: medians over rounds of the difference from, the ratio to and the\n"
        "inverse ratio to the baseline's time in the same round; grad. error: max over parameters of\n"
        "||g - g_full|| / ||g_full||, g_full from the plain step over the whole batch"
    )
    for note in dict.fromkeys(notes[shown:]):
        print(f"note: {note}")

    summary_header, summary, all_met = verdicts(everything)
    print("\nSummary:")
    print_text(summary_header, summary)
    if args.rst:
        for workload, header, table in tables:
            print()
            print_rst(header, table, workload.name)
        print()
        print_rst(summary_header, summary, "@koila.accumulate against the targets")

    if load is not None:
        print("\nload average after the run: " + ", ".join(f"{value:.2f}" for value in os.getloadavg()))
    print(f"the run took {time.perf_counter() - began:.0f} s")
    print()
    print(
        f"Targets: when the batch fits, @koila.accumulate at most {percent(TARGET_FIT)} over the plain step; "
        f"split into micro-batches, at least {TARGET_SPLIT:.0%} of the hand loop's throughput."
    )
    verdict = "meets" if all_met else "does NOT meet"
    missed = [f"{row[0]}, {row[1]}" for row in summary if row[-1] != "yes"]
    print(f"Measured: @koila.accumulate {verdict} them" + (f" (missed: {'; '.join(missed)})." if missed else "."))
    return 0


if __name__ == "__main__":
    sys.exit(main())
