"""Measure what ``@koila.accumulate`` costs per DDP training step, next to a hand-written accumulation loop.

Two processes on this machine, started by the script itself (``torch.multiprocessing``,
the ``gloo`` backend on 127.0.0.1, one thread each: ``torch.set_num_threads(1)``), train
one MLP wrapped in ``DistributedDataParallel``: 512 -> 2048 -> 512 -> 10, about 2.1
million parameters (8 MiB of float32 gradients to all-reduce every step), on 64 rows per
rank (``--rows``). The loss is ``cross_entropy``, a mean over the rows. No optimizer
step is taken: the parameters stay as they are, so every step does the same work.

For k = 1, 4 and 8 micro-batches of m = rows / k (64, 16 and 8 rows), two candidates:

- the hand loop: ``for i, (xb, yb) in enumerate(zip(x.split(m), y.split(m)))``, the
  backward of ``loss_fn(ddp(xb), yb) * len(xb) / rows`` under ``ddp.no_sync()`` for all
  but the last micro-batch, whose backward runs DDP's bucketed all-reduce, overlapped
  with the rest of that backward (for k = 1, the plain DDP step). DDP's first bucket is
  small (1 MiB): here it holds the last two layers and is all-reduced while the first
  layer's backward runs;
- ``@koila.accumulate(initial=m, ddp=ddp)`` on ``lambda xb, yb: loss_fn(ddp(xb), yb)``:
  the same micro-batches, the last one's backward all-reducing as DDP does it, overlapped
  (a rank that fails plays along the buckets it never launched: docs/distributed.rst,
  "DDP: the overlap, kept"); then the agreement across ranks that the step succeeded. It
  also agrees on the starting size (an all-reduce of a few numbers).

A fourth candidate, *bare exchanges*, is the hand loop with the agreement's two exchanges
around it, made without koila (an ``all_reduce`` of five int64 before the step and one of
three after it, each read back): what agreeing costs by itself, a floor for any step that
agrees with the other ranks.

Every candidate calls ``opt.zero_grad(set_to_none=True)`` before its step; the hand loop
runs a second time as a check of the noise. Once per run and per k, the script checks
that koila's gradients (averaged over the ranks) are ``allclose`` to the hand loop's,
and stops if they are not, or if koila leaves its happy path (an out-of-memory error,
another micro-batch size).

The candidates are interleaved: every round times a block of steps of each (about 0.25 s),
in an order rotated from round to round, in the same two processes, each block begun
together after a barrier. A block's time is the slower rank's. The table gives the
median and the minimum over rounds of the time per step and, paired within each round,
the median of the ratio to the hand loop. The garbage collector stays enabled.

The target, from issue 42: ``@koila.accumulate`` at 97% or more of the hand loop's
throughput at the same micro-batch size (a ratio of time of at most 1 / 0.97 = 1.031).

Run it with::

    tox -e bench                        # the 8 scripts tox.ini lists, this one among them
    tox -e bench -- --quick             # a fast, noisier run
    python benchmarks/ddp.py --rst      # how docs/performance.rst was made
    python benchmarks/ddp.py --rows 256 # more compute per all-reduce
    python benchmarks/ddp.py --nccl     # one GPU: a process group of one over nccl

With ``--nccl``, one process on one GPU (``cuda:0``) forms a process group of one over
``nccl``. koila then agrees with itself (``sync=True``), so the table gives what the
agreement and the overlap cost where collectives and the backward run on a GPU. Without
a CUDA device that run says so and exits with status 1.

The exit status is 0 whether or not the target is met; the verdict is printed.
``--no-peers`` is accepted, as by every benchmark, and changes nothing: there is no peer.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import (  # the script's own folder is on sys.path
    add_run_flags,
    duration,
    percent,
    print_rst,
    print_text,
    settle_rounds,
)
from torch import nn
from torch.nn import functional
from torch.nn.parallel import DistributedDataParallel

import koila_retry as koila

WORLD_SIZE = 2
ROWS = 64  # per rank and step, by default
SPLITS = (1, 4, 8)  # micro-batches per step
TARGET = 1 / 0.97  # koila / hand loop, per step: 97% of the hand loop's throughput
BLOCK_SECONDS = 0.25  # about how long one block of steps takes
HAND = "hand loop, no_sync() but the last"
KOILA = "@koila.accumulate"
BARE = "hand loop and the agreement's 2 exchanges (bare)"


@dataclass
class Candidate:
    name: str
    call: Callable[[], Any]  # one training step, on every rank
    check: Callable[[], str | None] | None = None  # a problem, or None
    times: list[float] = field(default_factory=list)  # seconds per step, one per round


@dataclass
class Setting:
    k: int
    size: int
    steps: int = 1  # steps per block
    equal: bool = False  # whether koila's gradients are allclose to the hand loop's
    candidates: list[Candidate] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"k={self.k} ({self.k} x {self.size})"


class TimedCandidate(Protocol):
    """What :func:`run` and :func:`ratio` use of a candidate: this script's :class:`Candidate`, and fsdp.py's."""

    @property
    def name(self) -> str: ...

    @property
    def call(self) -> Callable[[], Any]: ...

    @property
    def check(self) -> Callable[[], str | None] | None: ...

    @property
    def times(self) -> list[float]: ...


class TimedSetting(Protocol):
    """What :func:`run` uses of a setting: this script's :class:`Setting`, and fsdp.py's."""

    @property
    def steps(self) -> int: ...

    @property
    def candidates(self) -> Sequence[TimedCandidate]: ...


def gradients(model: nn.Module) -> list[torch.Tensor]:
    # Every parameter has a gradient: the model's backward has just run.
    return [cast(torch.Tensor, p.grad).detach().clone() for p in model.parameters()]


def build(k: int, ddp: DistributedDataParallel, x: torch.Tensor, y: torch.Tensor) -> Setting:
    """Make the candidates of one k, check their gradients, and size their blocks (the same on every rank)."""
    rows = x.shape[0]
    m = rows // k
    setting = Setting(k, m)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    loss_fn = functional.cross_entropy

    def hand() -> None:
        opt.zero_grad(set_to_none=True)
        last = k - 1
        # Tensor.split and Tensor.backward are unannotated in torch (hence the type: ignores).
        for i, (xb, yb) in enumerate(zip(x.split(m), y.split(m))):  # type: ignore[no-untyped-call]
            if i < last:
                with ddp.no_sync():
                    (loss_fn(ddp(xb), yb) * len(xb) / rows).backward()  # type: ignore[no-untyped-call]
            else:  # the last backward all-reduces the gradients, overlapped with itself
                (loss_fn(ddp(xb), yb) * len(xb) / rows).backward()  # type: ignore[no-untyped-call]

    @koila.accumulate(initial=m, ddp=ddp, sync=True)  # sync=True: a group of one (--nccl) agrees too
    def step(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return loss_fn(ddp(xb), yb)

    def koila_step() -> None:
        opt.zero_grad(set_to_none=True)
        step(x, y)

    # The agreement by itself: its two exchanges (the start before the step, the outcome after it),
    # as koila makes them, around the hand loop. What any step that agrees pays, whatever else it does.
    start_cells = torch.zeros(5, dtype=torch.int64, device=x.device)
    after_cells = torch.zeros(3, dtype=torch.int64, device=x.device)

    def bare_agreement() -> None:
        dist.all_reduce(start_cells, op=dist.ReduceOp.MIN)
        start_cells.tolist()
        hand()
        dist.all_reduce(after_cells, op=dist.ReduceOp.MIN)
        after_cells.tolist()

    def koila_check() -> str | None:
        stats = step.stats
        return f"{stats!r}" if stats.ooms or stats.batch_size != m else None

    hand()
    expected = gradients(ddp.module)
    koila_step()
    found = gradients(ddp.module)
    equal = all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(found, expected, strict=True))
    # Equal on every rank, or the run stops on every rank.
    flag = torch.tensor([int(equal)], device=x.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    setting.equal = bool(flag.item())
    if not setting.equal:
        worst = max((a - b).abs().max().item() for a, b in zip(found, expected, strict=True))
        raise SystemExit(f"k={k}: koila's gradients differ from the hand loop's by up to {worst:.2e}")
    problem = koila_check()
    if problem:
        raise SystemExit(f"k={k}: {KOILA} is not on its happy path: {problem}")

    # Steps per block: from rank 0's warm step, the same on every rank.
    dist.barrier()
    start = time.perf_counter()
    hand()
    synchronize(x.device)
    steps = torch.tensor([max(1, round(BLOCK_SECONDS / (time.perf_counter() - start)))], device=x.device)
    dist.broadcast(steps, 0)
    setting.steps = int(steps.item())
    setting.candidates = [
        Candidate(HAND, hand),
        Candidate(f"{KOILA}(initial={m})", koila_step, koila_check),
        Candidate(f"{HAND} again (noise check)", hand),
        Candidate(BARE, bare_agreement),
    ]
    for candidate in setting.candidates:  # a warm-up block each
        for _ in range(setting.steps):
            candidate.call()
    return setting


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, before a clock is read (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_block(candidate: TimedCandidate, steps: int, device: torch.device) -> float:
    """Return the seconds per step of one block, on the slower rank; every rank calls it."""
    call = candidate.call
    dist.barrier()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        call()
    synchronize(device)
    seconds = torch.tensor([(time.perf_counter() - start) / steps], dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds.item())


def run(settings: Sequence[TimedSetting], rounds: int, rank: int, device: torch.device) -> None:
    """Time every candidate of every setting, interleaved: a block of each per round, rotated."""
    blocks = [(setting, candidate) for setting in settings for candidate in setting.candidates]
    for number in range(rounds):
        shift = number % len(blocks)
        for setting, candidate in blocks[shift:] + blocks[:shift]:
            candidate.times.append(time_block(candidate, setting.steps, device))
            problem = candidate.check() if candidate.check is not None else None
            if problem:
                raise SystemExit(f"{candidate.name} left its happy path: {problem}")
        if rank == 0 and (number + 1) % 10 == 0:
            print(f"  {number + 1} of {rounds} rounds done", file=sys.stderr, flush=True)


def ratio(candidate: TimedCandidate, base: TimedCandidate) -> float:
    """The median over rounds of the candidate's time over the baseline's in the same round."""
    return statistics.median(t / b for t, b in zip(candidate.times, base.times, strict=True))


def table_rows(settings: list[Setting]) -> tuple[list[str], list[list[str]]]:
    header = ["split", "candidate", "steps x rounds", "per step (median)", "per step (min)", "vs hand loop"]
    table = []
    for setting in settings:
        base = setting.candidates[0]
        for number, candidate in enumerate(setting.candidates):
            table.append(
                [
                    setting.label if number == 0 else "",
                    candidate.name,
                    f"{setting.steps} x {len(candidate.times)}",
                    duration(statistics.median(candidate.times)),
                    duration(min(candidate.times)),
                    "" if candidate is base else f"{ratio(candidate, base):.3f} ({percent(ratio(candidate, base))})",
                ]
            )
    return header, table


def verdicts(settings: list[Setting]) -> tuple[list[str], list[list[str]], bool]:
    header = ["split", "hand loop per step", "koila / hand loop", "bare exchanges", "noise check", "allclose", "met"]
    table, all_met = [], True
    for setting in settings:
        base, koila_row, again, bare = setting.candidates
        measured = ratio(koila_row, base)
        met = measured <= TARGET
        all_met = all_met and met
        table.append(
            [
                setting.label,
                duration(statistics.median(base.times)),
                f"{measured:.3f}",
                f"{ratio(bare, base):.3f}",
                f"{ratio(again, base):.3f}",
                "yes" if setting.equal else "NO",
                "yes" if met else "NO",
            ]
        )
    return header, table, all_met


def worker(rank: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    backend = "nccl" if args.nccl else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size(args))
    try:
        measure(rank, args)
    finally:
        dist.destroy_process_group()


def measure(rank: int, args: argparse.Namespace) -> None:
    began = time.perf_counter()
    torch.manual_seed(0)
    device = torch.device("cuda", rank) if args.nccl else torch.device("cpu")
    model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 512), nn.ReLU(), nn.Linear(512, 10))
    ddp = DistributedDataParallel(model.to(device), device_ids=[rank] if args.nccl else None)
    generator = torch.Generator().manual_seed(1 + rank)  # each rank its own rows
    x = torch.randn(args.rows, 512, generator=generator).to(device)
    y = torch.randint(0, 10, (args.rows,), generator=generator).to(device)
    parameters = sum(p.numel() for p in ddp.parameters())
    if rank == 0:
        print(
            f"MLP 512-2048-512-10 ({parameters / 1e6:.1f} M parameters) in DistributedDataParallel on "
            f"{place(args)}, {args.rows} rows per rank; k = {', '.join(map(str, SPLITS))}, "
            f"{args.rounds} rounds ...",
            flush=True,
        )
    settings = [build(k, ddp, x, y) for k in SPLITS]
    if rank == 0:
        for setting in settings:
            print(f"  {setting.label}: gradients of koila and the hand loop allclose: {setting.equal}", flush=True)
    run(settings, args.rounds, rank, x.device)
    if rank != 0:
        return

    header, table = table_rows(settings)
    print()
    print_text(header, table)
    print(
        "per step: the slower rank's time per step in a block; vs hand loop: median over rounds of the ratio to\n"
        "the hand loop's time in the same round"
    )
    summary_header, summary, all_met = verdicts(settings)
    print("\nSummary:")
    print_text(summary_header, summary)
    if args.rst:
        print()
        print_rst(header, table, f"@koila.accumulate with DDP, {place(args)}")
        print()
        print_rst(summary_header, summary, "@koila.accumulate with DDP against the target")
    if hasattr(os, "getloadavg"):
        print("\nload average after the run: " + ", ".join(f"{value:.2f}" for value in os.getloadavg()))
    print(f"the run took {time.perf_counter() - began:.0f} s")
    print()
    print(f"Target: @koila.accumulate at most {percent(TARGET)} over the hand loop (a ratio of at most {TARGET:.3f}).")
    missed = [row[0] for row in summary if row[-1] != "yes"]
    verdict = "meets" if all_met else "does NOT meet"
    print(f"Measured: @koila.accumulate {verdict} it" + (f" (missed: {'; '.join(missed)})." if missed else "."))


def world_size(args: argparse.Namespace) -> int:
    return 1 if args.nccl else WORLD_SIZE


def place(args: argparse.Namespace) -> str:
    return "a process group of one over nccl, on one GPU" if args.nccl else f"{WORLD_SIZE} gloo processes"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, help="rounds (default 30; 4 with --quick)")
    parser.add_argument("--rows", type=int, default=ROWS, help="rows per rank and step (default %(default)s)")
    parser.add_argument(
        "--nccl", action="store_true", help="one process on one GPU, agreeing over nccl (sync=True) with itself"
    )
    add_run_flags(parser, no_peers="accepted for tox -e bench; there is no peer here")
    args = parser.parse_args(argv)
    settle_rounds(parser, args)
    if args.rows < max(SPLITS) or args.rows % max(SPLITS):
        parser.error(f"--rows must be a multiple of {max(SPLITS)}")
    print(f"Python {platform.python_version()} on {platform.machine()} {platform.system()}, {os.cpu_count()} CPUs")
    print(f"torch {torch.__version__} (1 thread per process), koila-retry {koila.__version__}")
    if hasattr(os, "getloadavg"):
        print("load average before the run: " + ", ".join(f"{value:.2f}" for value in os.getloadavg()), flush=True)
    if args.nccl and not torch.cuda.is_available():
        print("--nccl needs a CUDA device; there is none here")
        return 1
    # torch.multiprocessing.spawn is public, but unannotated and missing from the module's __all__.
    mp.spawn(worker, args=(free_port(), args), nprocs=world_size(args))  # type: ignore[attr-defined,no-untyped-call]
    return 0


if __name__ == "__main__":
    sys.exit(main())
