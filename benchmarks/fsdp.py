"""Measure what ``@koila.accumulate`` costs per FSDP2 training step: one exchange per micro-batch.

Two processes on this machine, started by the script itself (``torch.multiprocessing``,
the ``gloo`` backend on 127.0.0.1, one thread each: ``torch.set_num_threads(1)``), train
one model sharded with FSDP2: ``blocks`` blocks of ``Linear(width, width)`` and ``ReLU``,
then a ``Linear(width, 10)`` head, float32. Each block is sharded with ``fully_shard``,
then the whole model (the root, which holds the head). The loss is ``cross_entropy``, a
mean over the rows. No optimizer step is taken: the parameters stay as they are, so every
step does the same work. Two configurations, the same rows per rank: 8 blocks of width 512
(``--blocks``, ``--width``), and half as many blocks of twice the width (4 of 1024), with
four times the compute and the bytes per collective and half as many collectives. 64 rows
per rank and step (``--rows``).

While a call of koila-retry runs over FSDP2 modules, a rank that runs out of memory plays
along the rest of its micro-batch's FSDP2 collectives (all-gathers, reduce-scatters), as
the first micro-batch of each kind recorded them, and the ranks then agree once: one
exchange of the ranks' agreement, an ``all_reduce`` of five int64, per micro-batch (see
``koila_retry/_core/sharded.py``). Only the first micro-batch of each kind, which records,
makes an exchange before each collective; the checks below run it. Besides those, a call
makes one exchange for the starting size before its first attempt. This script measures
what that costs. Per configuration:

- k = 1, the whole batch: the plain FSDP2 step, ``loss_fn(model(x), y).backward()`` (the
  hand loop at k = 1); ``@koila.accumulate(cache=koila.NoCache())`` over
  ``lambda x, y: loss_fn(model(x), y)``; and ``@koila.accumulate(initial=rows)`` over the
  same, with the default cache;
- k = 4 micro-batches of m = rows / k: the hand loop, ``for i, (xb, yb) in
  enumerate(zip(x.split(m), y.split(m)))``, ``model.set_requires_gradient_sync(i == k - 1)``
  then the backward of ``loss_fn(model(xb), yb) * len(xb) / rows`` (the gradients are
  reduce-scattered once, after the last micro-batch, as FSDP2 documents for gradient
  accumulation); and ``@koila.accumulate(initial=m)``, which runs the same micro-batches
  the same way.

In both, the baseline again with bare exchanges: the same step of a twin model (the same
weights, sharded the same way) whose FSDP2 collectives each first make an ``all_reduce`` of
five int64 and read it back, without koila: the comm objects of FSDP2's public
``set_custom_all_gather`` and ``set_custom_reduce_scatter``, which then run the collective
as FSDP2's default ones do. It is what koila's earlier design, an exchange before every
collective, cost by itself.

Every candidate sets each parameter's ``.grad`` to None before its step; the baseline (the
plain step, the hand loop) runs a second time as a check of the noise. Once per run and
per setting, the script checks that koila's gradients (``p.grad.full_tensor()``) are
``allclose`` to the baseline's, and stops if they are not; after every block, that koila
stayed on its happy path (``step.stats.ooms == 0``, the expected micro-batch size). It
also counts, during one step of each candidate on each rank, the calls of FSDP2's
collectives (``torch.distributed.all_gather_single``, ``all_gather_into_tensor``,
``reduce_scatter_single``, ``reduce_scatter_tensor``) and of ``all_reduce`` (koila's
exchanges: FSDP2 makes none here), by wrapping those functions for that step.

The candidates are interleaved: every round times a block of steps of each (about 0.25 s),
in an order rotated from round to round, in the same two processes, each block begun
together after a barrier. A block's time is the slower rank's. The table gives the median
and the minimum over rounds of the time per step and, paired within each round, the median
of the ratio to the baseline; the summary adds the time added per exchange, paired the
same way (the candidate's time less the baseline's, over the candidate's exchanges per
step). The garbage collector stays enabled.

The targets (issue 42): at k = 1, koila's time per step at most 1.03 times the plain
step's; at k = 4, koila's throughput at least 97% of the hand loop's, that is a time per
step at most 1 / 0.97 = 1.031 times the hand loop's. The bare exchanges have no target.

Run it with::

    tox -e bench                          # the 8 scripts tox.ini lists, this one among them
    tox -e bench -- --quick               # a fast, noisier run
    python benchmarks/fsdp.py --rst       # how docs/performance.rst was made
    python benchmarks/fsdp.py --rows 256  # more compute per collective

The exit status is 0; the verdict is printed. ``--no-peers`` is accepted, as by every
benchmark, and changes nothing: there is no peer.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist

# Imported before the process group is made, on purpose (see examples/ddp_train.py): imported
# after it, its functions' default arguments keep the group alive after destroy_process_group().
import torch.distributed.nn
import torch.multiprocessing as mp

# The script's own folder is on sys.path.
from common import add_run_flags, duration, labelled, percent, print_load, print_summary, print_text, settle_rounds
from ddp import free_port, ratio, run  # the interleaved blocks of two ranks, as there
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn import functional

import koila_retry as koila

WORLD_SIZE = 2
BLOCKS, WIDTH = 8, 512  # the first configuration, by default; the second has half the blocks, twice as wide
ROWS = 64  # per rank and step, by default
CLASSES = 10
SPLITS = (1, 4)  # micro-batches per step
BLOCK_SECONDS = 0.25  # about how long one block of steps takes
PLAIN = "plain FSDP2 step"
HAND = "hand loop, gradient sync on the last"
KOILA = "@koila.accumulate"
# The collectives counted during one step, by the name of their function in torch.distributed.
COUNTED = {
    "all_gather_single": "gather",
    "all_gather_into_tensor": "gather",
    "reduce_scatter_single": "scatter",
    "reduce_scatter_tensor": "scatter",
    "all_reduce": "exchange",
}


@dataclass
class Candidate:
    name: str
    call: Callable[[], Any]  # one training step, on every rank
    check: Callable[[], str | None] | None = None  # a problem, or None
    model: nn.Module | None = None  # the model it trains, if not the setting's (the twin with bare exchanges)
    equal: bool | None = None  # whether its gradients are allclose to the baseline's (all but the baseline's)
    counts: dict[str, int] = field(default_factory=dict)  # collectives per step, by kind
    times: list[float] = field(default_factory=list)  # seconds per step, one per round


@dataclass
class Setting:
    shape: str  # the configuration: "8 x 512"
    k: int
    size: int
    steps: int = 1  # steps per block
    candidates: list[Candidate] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.shape}, k={self.k} ({self.k} x {self.size})"


class Exchanging:
    """An FSDP2 comm that first makes a bare exchange: an ``all_reduce`` of five int64, read back, as koila's.

    Given to ``set_custom_all_gather`` or ``set_custom_reduce_scatter``; then runs the collective
    as FSDP2's default comm does. No koila in it: what one more small collective before each of
    FSDP2's costs by itself.

    Args:
        collective (str): the function of ``torch.distributed`` it runs, looked up at each call.
    """

    def __init__(self, collective: str) -> None:
        self.collective = collective
        self.buffer = torch.zeros(5, dtype=torch.int64)

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, *, output_tensor: torch.Tensor, input_tensor: torch.Tensor, **options: Any) -> Any:
        dist.all_reduce(self.buffer, op=dist.ReduceOp.MIN)
        self.buffer.tolist()
        return getattr(dist, self.collective)(output_tensor, input_tensor, **options)


def sharded_model(blocks: int, width: int, exchanging: bool = False) -> nn.Sequential:
    """Build the model with the same weights on every rank, each block sharded, then the root.

    With ``exchanging``, each of its FSDP2 collectives makes a bare exchange first (:class:`Exchanging`).
    """
    torch.manual_seed(0)
    model = nn.Sequential(
        *(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(blocks)), nn.Linear(width, CLASSES)
    )
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # fully_shard's default is CUDA where present
    for block in [*list(model)[:blocks], model]:
        sharded = fully_shard(block, mesh=mesh)  # the block itself, now an FSDPModule
        if exchanging:
            # torch types these as its ABCs AllGather and ReduceScatter; FSDP2 only calls them, with keywords.
            sharded.set_custom_all_gather(Exchanging("all_gather_single"))  # type: ignore[arg-type]
            sharded.set_custom_reduce_scatter(Exchanging("reduce_scatter_single"))  # type: ignore[arg-type]
    return model


def gradients(model: nn.Module) -> list[torch.Tensor]:
    """Each parameter's whole gradient, gathered from the ranks' shards (a collective)."""
    # FSDP2 makes each gradient a DTensor, sharded as its parameter.
    return [cast(DTensor, p.grad).full_tensor() for p in model.parameters()]


def allclose_everywhere(found: list[torch.Tensor], expected: list[torch.Tensor]) -> bool:
    """Whether ``found`` is allclose to ``expected`` on every rank: a collective, the same answer on each."""
    close = all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(found, expected, strict=True))
    flag = torch.tensor([int(close)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def count_collectives(call: Callable[[], Any]) -> dict[str, int]:
    """Run ``call`` once with torch.distributed's collectives wrapped, and count the calls of each kind."""
    counts = dict.fromkeys(COUNTED.values(), 0)
    depth = [0]  # a collective that calls another counts once

    def counting(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if depth[0] == 0:
                counts[COUNTED[name]] += 1
            depth[0] += 1
            try:
                return original(*args, **kwargs)
            finally:
                depth[0] -= 1

        return wrapper

    originals = {name: getattr(dist, name) for name in COUNTED if hasattr(dist, name)}
    for name, original in originals.items():
        setattr(dist, name, counting(name, original))
    try:
        call()
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return counts


def build(shape: str, k: int, models: tuple[nn.Module, nn.Module], x: torch.Tensor, y: torch.Tensor) -> Setting:
    """Make the candidates of one k, check their gradients, count collectives, size the blocks (on every rank).

    ``models``: the sharded model, and its twin whose FSDP2 collectives make bare exchanges first.
    """
    rows = x.shape[0]
    m = rows // k
    setting = Setting(shape, k, m)
    model, twin = models
    parameters = list(model.parameters())
    loss_fn = functional.cross_entropy

    def baseline(net: nn.Module) -> Callable[[], None]:
        """The plain step (k = 1) or the hand loop of ``net``, ``.grad`` set to None first."""
        parameters = list(net.parameters())
        sharded = cast(FSDPModule, net)  # fully_shard made it one: the same object

        def step() -> None:
            for parameter in parameters:
                parameter.grad = None
            last = k - 1
            # Tensor.split and Tensor.backward are unannotated in torch (hence the type: ignores).
            for i, (xb, yb) in enumerate(zip(x.split(m), y.split(m))):  # type: ignore[no-untyped-call]
                if k == 1:
                    loss_fn(net(xb), yb).backward()  # type: ignore[no-untyped-call]
                else:
                    sharded.set_requires_gradient_sync(i == last)
                    (loss_fn(net(xb), yb) * len(xb) / rows).backward()  # type: ignore[no-untyped-call]

        return step

    def koila_candidate(name: str, size: int, **options: Any) -> Candidate:
        @koila.accumulate(**options)
        def step(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
            return loss_fn(model(xb), yb)

        def call() -> None:
            for parameter in parameters:
                parameter.grad = None
            step(x, y)

        def check() -> str | None:
            stats = step.stats
            return f"{stats!r}" if stats.ooms or stats.batch_size != size else None

        return Candidate(name, call, check)

    name = f"{PLAIN} (= hand loop)" if k == 1 else HAND
    base = Candidate(name, baseline(model))
    bare = Candidate(f"{name}, bare exchanges", baseline(twin), model=twin)
    if k == 1:
        koilas = [
            koila_candidate(f"{KOILA}(cache=NoCache())", rows, cache=koila.NoCache()),
            koila_candidate(f"{KOILA}(initial={rows})", rows, initial=rows),
        ]
    else:
        koilas = [koila_candidate(f"{KOILA}(initial={m})", m, initial=m)]
    again = Candidate(f"{PLAIN if k == 1 else HAND} again (noise check)", base.call)

    base.call()
    expected = gradients(model)
    for candidate in [bare, *koilas]:
        candidate.call()
        found = gradients(candidate.model or model)
        candidate.equal = allclose_everywhere(found, expected)
        if not candidate.equal:  # on every rank, so that every rank stops
            worst = max((a - b).abs().max().item() for a, b in zip(found, expected, strict=True))
            raise SystemExit(f"{setting.label}: {candidate.name}'s gradients differ from the baseline's by {worst:.2e}")
        problem = candidate.check() if candidate.check is not None else None
        if problem:
            raise SystemExit(f"{setting.label}: {candidate.name} is not on its happy path: {problem}")
    setting.candidates = [base, bare, *koilas, again]
    for candidate in setting.candidates:  # a counted step each, which is also a warm-up
        candidate.counts = count_collectives(candidate.call)

    # Steps per block: from rank 0's warm step, the same on every rank.
    dist.barrier()
    start = time.perf_counter()
    base.call()
    steps = torch.tensor([max(1, round(BLOCK_SECONDS / (time.perf_counter() - start)))])
    dist.broadcast(steps, 0)
    setting.steps = int(steps.item())
    return setting


def per_exchange(candidate: Candidate, base: Candidate) -> str:
    """The median over rounds of the time the candidate adds to the baseline's, per exchange it makes."""
    added = candidate.counts["exchange"]
    pairs = zip(candidate.times, base.times, strict=True)
    return duration(statistics.median((t - b) / added for t, b in pairs)) if added else "-"


def table_rows(settings: list[Setting]) -> tuple[list[str], list[list[str]]]:
    header = ["setting", "candidate", "steps x rounds", "per step (median)", "per step (min)", "vs baseline"]
    table = []
    for setting in settings:
        base = setting.candidates[0]
        rows = [
            [
                candidate.name,
                f"{setting.steps} x {len(candidate.times)}",
                duration(statistics.median(candidate.times)),
                duration(min(candidate.times)),
                "" if candidate is base else f"{ratio(candidate, base):.3f} ({percent(ratio(candidate, base))})",
            ]
            for candidate in setting.candidates
        ]
        table += labelled(setting.label, rows)
    return header, table


def count_rows(settings: list[Setting]) -> tuple[list[str], list[list[str]]]:
    header = ["configuration", "candidate", "FSDP2 all-gathers", "FSDP2 reduce-scatters", "all_reduce"]
    table = []
    for shape in dict.fromkeys(setting.shape for setting in settings):
        candidates = [c for s in settings if s.shape == shape for c in s.candidates[:-1]]  # not the noise check
        counts = [[c.name, *(str(c.counts[kind]) for kind in ("gather", "scatter", "exchange"))] for c in candidates]
        table += labelled(shape, counts)
    return header, table


TARGETS = {1: 1.03, 4: 1 / 0.97}  # by k: koila's time per step over the baseline's, at most


def target_of(candidate: Candidate, setting: Setting) -> str:
    """The target of a candidate's ratio, with whether it was met; "-" for one without (the bare exchanges)."""
    if not candidate.name.startswith(KOILA):
        return "-"
    limit = TARGETS[setting.k]
    return f"<= {limit:.3f}: {'met' if ratio(candidate, setting.candidates[0]) <= limit else 'NOT met'}"


def verdicts(settings: list[Setting]) -> tuple[list[str], list[list[str]]]:
    header = ["setting", "candidate", "vs baseline", "exchanges", "added per exchange", "noise check", "target"]
    table = []
    for setting in settings:
        base, again = setting.candidates[0], setting.candidates[-1]
        rows = [
            [
                candidate.name.removeprefix(base.name).removeprefix(", ") or candidate.name,
                f"{ratio(candidate, base):.3f}",
                str(candidate.counts["exchange"]),
                per_exchange(candidate, base),
                f"{ratio(again, base):.3f}",
                target_of(candidate, setting),
            ]
            for candidate in setting.candidates[1:-1]
        ]
        table += labelled(setting.label, rows)
    return header, table


def worker(rank: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    try:
        measure(rank, args)
        dist.barrier()  # no rank leaves while another still finishes a collective
    finally:
        dist.destroy_process_group()


def measure(rank: int, args: argparse.Namespace) -> None:
    began = time.perf_counter()
    shapes = [(args.blocks, args.width), (max(1, args.blocks // 2), 2 * args.width)]
    generator = torch.Generator().manual_seed(1 + rank)  # each rank its own rows
    settings = []
    for blocks, width in shapes:
        model, twin = sharded_model(blocks, width), sharded_model(blocks, width, exchanging=True)
        x = torch.randn(args.rows, width, generator=generator)
        y = torch.randint(0, CLASSES, (args.rows,), generator=generator)
        if rank == 0:
            parameters = sum(p.numel() for p in model.parameters())
            print(
                f"{blocks} sharded blocks of {width} x {width} and a {width} x {CLASSES} head in the sharded root "
                f"({parameters / 1e6:.1f} M parameters) on {WORLD_SIZE} gloo processes, {args.rows} rows per rank",
                flush=True,
            )
        settings += [build(f"{blocks} x {width}", k, (model, twin), x, y) for k in SPLITS]
    if rank == 0:
        print(f"k = {', '.join(map(str, SPLITS))}; {args.rounds} rounds ...", flush=True)
        for setting in settings:
            for candidate in setting.candidates:
                if candidate.equal is not None:
                    print(
                        f"  {setting.label}: gradients of {candidate.name} and the baseline allclose: "
                        f"{candidate.equal}",
                        flush=True,
                    )
    run(settings, args.rounds, rank, torch.device("cpu"))  # gloo, on the CPU
    if rank == 0:
        report(settings, args, began)


def report(settings: list[Setting], args: argparse.Namespace, began: float) -> None:
    """Print the tables, the load and the verdict (on rank 0)."""
    header, table = table_rows(settings)
    print()
    print_text(header, table)
    print(
        "per step: the slower rank's time per step in a block; vs baseline: median over rounds of the ratio to the\n"
        "setting's first row (the plain step, the hand loop) in the same round"
    )
    count_header, counts = count_rows(settings)
    print("\nCollectives per step (rank 0, one counted step; the noise check's are the baseline's):")
    print_text(count_header, counts)
    summary_header, summary = verdicts(settings)
    print_summary(
        summary_header,
        summary,
        [
            ("@koila.accumulate over FSDP2, the plain step and the hand loop, 2 gloo processes", header, table),
            ("FSDP2's collectives and koila's exchanges per step", count_header, counts),
            ("@koila.accumulate over FSDP2: the cost, against its targets", summary_header, summary),
        ]
        if args.rst
        else [],
    )
    print(
        "bare exchanges: the baseline on a twin model whose FSDP2 collectives each make an all_reduce of three\n"
        "int64 first, without koila; exchanges: all_reduce calls per step; added per exchange: median over rounds\n"
        "of the time added to the baseline's, over those exchanges. Every candidate's gradients were allclose to\n"
        "the baseline's (checked once per run: the script stops otherwise)"
    )
    print()
    print_load("after")
    print(f"the run took {time.perf_counter() - began:.0f} s")
    ratios = [float(row[2]) for row in summary if row[1].startswith(KOILA)]
    missed = [
        f"{setting.label}, {candidate.name}"
        for setting in settings
        for candidate in setting.candidates[1:-1]
        if "NOT met" in target_of(candidate, setting)
    ]
    print()
    print(
        "Target: @koila.accumulate over FSDP2 at most 1.03 times the plain step (k = 1) and at least 97% of the\n"
        "hand loop's throughput (k = 4, at most 1.031 times its time)."
    )
    print(
        f"Measured: {min(ratios):.3f} to {max(ratios):.3f} times the baseline's time per step; "
        + ("every target met." if not missed else f"NOT met: {'; '.join(missed)}.")
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, help="rounds (default 30; 4 with --quick)")
    parser.add_argument("--blocks", type=int, default=BLOCKS, help="sharded blocks (default %(default)s)")
    parser.add_argument("--width", type=int, default=WIDTH, help="width of a block (default %(default)s)")
    parser.add_argument("--rows", type=int, default=ROWS, help="rows per rank and step (default %(default)s)")
    add_run_flags(parser, no_peers="accepted for tox -e bench; there is no peer here")
    args = parser.parse_args(argv)
    settle_rounds(parser, args)
    if args.blocks < 1 or args.width < 1:
        parser.error("--blocks and --width must be >= 1")
    if args.rows < max(SPLITS) or args.rows % max(SPLITS):
        parser.error(f"--rows must be a multiple of {max(SPLITS)}")
    print(f"Python {platform.python_version()} on {platform.machine()} {platform.system()}, {os.cpu_count()} CPUs")
    print(f"torch {torch.__version__} (gloo, 1 thread per process), koila-retry {koila.__version__}")
    print_load("before")
    # torch.multiprocessing.spawn is public, but unannotated and missing from the module's __all__.
    mp.spawn(worker, args=(free_port(), args), nprocs=WORLD_SIZE)  # type: ignore[attr-defined,no-untyped-call]
    return 0


if __name__ == "__main__":
    sys.exit(main())
