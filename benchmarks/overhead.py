"""Measure what an OOM-retry decorator costs per call when nothing runs out of memory.

One process, one run, side by side: a plain call of a trivial function
``f(batch_size, x)``; the same function under ``@koila.batch`` with each cache
(``StackMemoryCache``, the default, ``GlobalCache`` and ``NoCache``), called from a
loop so that the cache answers every call after the first; and, when they are
installed, the same function under toma's ``@toma.batch(initial_batchsize=...)`` and
accelerate's ``find_executable_batch_size(starting_batch_size=...)``. The koila rows
are measured twice: with a tensor argument (the device comes from the tensor) and
with a plain int (the device is resolved through ``torch.accelerator``). The stand-ins
in ``koila_retry.compat`` for toma's and accelerate's decorators are timed too.

The candidates are interleaved: every round times a block of calls of each, in an
order rotated from round to round, so that machine noise falls on all of them alike.
The table reports the median and the minimum over rounds of the time per call, the
time added over the plain call, and how many times a koila call the peers take. The
per-call time includes the timing loop (a few tens of nanoseconds, the same for all);
the added time does not. The garbage collector stays enabled, as in real use.

The target, from the issue that asked for this benchmark: koila's cached happy path
adds at most 5 microseconds per call over a plain call.

Run it with::

    tox -e bench                          # installs the peers, runs the 8 scripts tox.ini lists
    tox -e bench -- --quick               # a fast, noisier run
    python benchmarks/overhead.py --help  # without tox; missing peers are skipped

The exit status is 0 whether or not the target is met; the verdict is printed.

With ``--against REV`` (a git revision: ``HEAD~3``, a tag, a commit hash), the script compares
two versions of the package in one run: it copies REV's ``koila_retry`` into a temporary folder
(``git archive``, removed at exit), starts two long-lived worker processes of this interpreter,
one importing that copy ("base") and one importing this working tree, uncommitted changes
included ("this tree"), and prints the ``koila_retry`` file each imported. Each worker builds the
plain call, the koila rows and the compat stand-ins (those its version has); every round asks
both in turn (base first on even rounds, this tree first on odd ones) to time a block of calls
of each, so that machine noise falls on both alike. Each version's added time is taken over its
own plain call, in its own process; the table gives both and the difference, this tree minus
base. The timing code is this script's for both; toma and accelerate are not timed. From the
repository root::

    PYTHONPATH=. python benchmarks/overhead.py --against HEAD~1
    PYTHONPATH=. python benchmarks/overhead.py --quick --against HEAD  # both columns should agree
"""

from __future__ import annotations

import argparse
import gc
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
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import repeat
from pathlib import Path
from typing import IO, Any

import torch
from common import print_rst, version_of  # the script's own folder is on sys.path
from common import print_text as print_ab_text

import koila_retry as koila

TARGET_US = 5.0
INITIAL = 512


def f(batch_size: int, x: object) -> int:
    """The trivial function every candidate wraps."""
    return batch_size


@dataclass
class Candidate:
    name: str
    call: Callable[..., Any]
    args: tuple[Any, ...]
    calls: int  # calls per round
    peer: bool = False
    cache: Any = None
    times: list[float] = field(default_factory=list)  # seconds per call, one per round

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def best(self) -> float:
        return min(self.times)


def time_per_call(call: Callable[..., Any], args: tuple[Any, ...], calls: int) -> float:
    """Return the seconds per call of ``calls`` calls made from one loop (one call site)."""
    start = time.perf_counter()
    for _ in repeat(None, calls):
        call(*args)
    return (time.perf_counter() - start) / calls


def koila_candidates(calls: int, notes: list[str]) -> list[Candidate]:
    """Return the plain call, ``koila.batch`` with each cache and argument, and the compat stand-ins.

    What the imported version of the package lacks (an older one, under ``--against``) is noted and skipped.
    """
    tensor = torch.zeros(8)
    candidates = [Candidate("plain call f(batch_size, x)", f, (INITIAL, tensor), calls)]
    caches = [
        (cache_name, getattr(koila, cache_name, None)) for cache_name in ("StackMemoryCache", "GlobalCache", "NoCache")
    ]
    for cache_name, cache_type in caches:
        if cache_type is None:
            notes.append(f"koila_retry has no {cache_name}: its rows skipped")
    for argument, value in (("tensor x", tensor), ("int x", 1)):
        for cache_name, cache_type in caches:
            if cache_type is None:
                continue
            cache = cache_type()
            wrapped: Callable[..., Any] = koila.batch(initial=INITIAL, cache=cache)(f)  # as the stand-ins' below
            name = f"koila.batch, {cache_name}, {argument}"
            candidates.append(Candidate(name, wrapped, (value,), calls, cache=cache))

    # The stand-ins for the peers run on the same engine; one wrapper layer more.
    try:
        from koila_retry.compat.toma import toma as compat_toma
    except ImportError:
        notes.append("koila_retry.compat.toma not importable: skipped")
    else:
        wrapped = compat_toma.batch(initial_batchsize=INITIAL)(f)
        candidates.append(Candidate("koila_retry.compat.toma toma.batch", wrapped, (tensor,), calls))
    try:
        from koila_retry.compat.accelerate import find_executable_batch_size as compat_find
    except ImportError:
        notes.append("koila_retry.compat.accelerate not importable: skipped")
    else:
        wrapped = compat_find(starting_batch_size=INITIAL)(f)
        name = "koila_retry.compat.accelerate find_executable_batch_size"
        candidates.append(Candidate(name, wrapped, (tensor,), calls))
    return candidates


def build(args: argparse.Namespace) -> tuple[list[Candidate], list[str]]:
    notes: list[str] = []
    candidates = koila_candidates(args.calls, notes)
    tensor = candidates[0].args[1]  # the plain call's
    if args.no_peers:
        notes.append("peers skipped (--no-peers)")
        return candidates, notes
    try:
        import toma
    except ImportError:
        notes.append("toma not installed: skipped (pip install toma==1.1.0, or run tox -e bench)")
    else:
        wrapped = toma.toma.batch(initial_batchsize=INITIAL)(f)
        candidates.append(Candidate("toma.batch (StacktraceMemory cache)", wrapped, (tensor,), args.peer_calls, True))
    try:
        from accelerate.utils import find_executable_batch_size
    except ImportError:
        notes.append("accelerate not installed: skipped (pip install accelerate==1.15.0, or run tox -e bench)")
    else:
        wrapped = find_executable_batch_size(starting_batch_size=INITIAL)(f)
        candidates.append(Candidate("accelerate find_executable_batch_size", wrapped, (tensor,), args.peer_calls, True))
    return candidates, notes


def prepare(candidates: list[Candidate]) -> None:
    """Check that every candidate calls f with the initial batch size, then warm each up."""
    for candidate in candidates:
        result = candidate.call(*candidate.args)
        if result != INITIAL:
            raise SystemExit(f"{candidate.name} called f with batch size {result}, expected {INITIAL}")
        if candidate.cache is not None:
            candidate.cache.cache_clear()
        time_per_call(candidate.call, candidate.args, 1)  # warm up: fills the cache of the timing loop's call site


def time_round(candidates: list[Candidate], number: int) -> None:
    """Time one block of calls of every candidate, in an order rotated by the round's number."""
    shift = number % len(candidates)
    for candidate in candidates[shift:] + candidates[:shift]:
        candidate.times.append(time_per_call(candidate.call, candidate.args, candidate.calls))


def run(candidates: list[Candidate], rounds: int) -> None:
    prepare(candidates)
    for number in range(rounds):
        time_round(candidates, number)
        print(f"  round {number + 1}/{rounds} done", file=sys.stderr, flush=True)


def cache_warnings(candidates: list[Candidate]) -> list[str]:
    """Say which caches stored a size or hit: f never runs out of memory, so none should."""
    warnings = []
    no_cache = getattr(koila, "NoCache", ())  # isinstance(x, ()) is False
    for candidate in candidates:
        if candidate.cache is not None and not isinstance(candidate.cache, no_cache):
            # f never runs out of memory, so nothing is stored (a size equal to ``initial``
            # says nothing about memory) and every call is a lookup of the same key,
            # answered by the cache's memo of its latest key.
            info = candidate.cache.cache_info()
            if info.currsize != 0 or info.hits != 0:
                warnings.append(f"{candidate.name}'s cache stored a size or hit ({info}); expected neither")
    return warnings


def duration(seconds: float) -> str:
    micro = seconds * 1e6
    if abs(micro) >= 1000:
        return f"{micro / 1000:.1f} ms"
    return f"{micro:.2f} us"


def rows(candidates: list[Candidate]) -> tuple[list[str], list[list[str]]]:
    plain = candidates[0]
    koila_default = candidates[1]
    header = ["candidate", "calls x rounds", "per call (median)", "per call (min)", "added over plain", "x koila"]
    table = []
    for candidate in candidates:
        added = "" if candidate is plain else duration(candidate.median - plain.median)
        ratio = f"{candidate.median / koila_default.median:,.0f}x" if candidate.peer else ""
        table.append(
            [
                candidate.name,
                f"{candidate.calls} x {len(candidate.times)}",
                duration(candidate.median),
                duration(candidate.best),
                added,
                ratio,
            ]
        )
    return header, table


def print_text(header: list[str], table: list[list[str]]) -> None:
    widths = [max(len(line[i]) for line in [header, *table]) for i in range(len(header))]
    for number, line in enumerate([header, *table]):
        cells = [
            cell.ljust(width) if i == 0 else cell.rjust(width) for i, (cell, width) in enumerate(zip(line, widths))
        ]
        print("  ".join(cells))
        if number == 0:
            print("  ".join("-" * width for width in widths))


def signed(seconds: float) -> str:
    """Format a difference of times per call in microseconds, with its sign."""
    return f"{round(seconds * 1e6, 2) + 0.0:+.2f} us"  # + 0.0: no "-0.00"


def send(channel: IO[str], message: dict[str, Any]) -> None:
    channel.write(json.dumps(message) + "\n")
    channel.flush()


def serve(calls: int) -> int:
    """Serve ``--against``: build the candidates, then time a round of them per command read from stdin.

    The replies, one JSON line each, go to the original stdout; anything else printed to stdout
    (by the package, say) goes to stderr instead, so that it cannot garble them.
    """
    sys.stdout.flush()
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    notes: list[str] = []
    candidates = koila_candidates(calls, notes)
    prepare(candidates)
    hello = {
        "file": koila.__file__,
        "version": getattr(koila, "__version__", "unknown"),
        "names": [candidate.name for candidate in candidates],
        "notes": notes,
    }
    send(replies, hello)
    while line := sys.stdin.readline():
        command = json.loads(line)
        if command["do"] == "round":
            time_round(candidates, command["number"])
            send(replies, {"times": [candidate.times[-1] for candidate in candidates]})
        elif command["do"] == "finish":
            send(replies, {"warnings": cache_warnings(candidates)})
            break
        else:
            raise SystemExit(f"overhead.py worker: unknown command {command!r}")
    return 0


@dataclass
class Worker:
    """A worker process of ``--against``, and the times per call it reported, by candidate."""

    label: str
    root: Path  # the folder on its PYTHONPATH, where its koila_retry must come from
    process: subprocess.Popen[str]
    names: list[str] = field(default_factory=list)
    times: dict[str, list[float]] = field(default_factory=dict)

    def ask(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None
        assert self.process.stdout is not None
        if command:
            send(self.process.stdin, command)
        line = self.process.stdout.readline()
        if not line:
            status = self.process.wait()
            raise SystemExit(f"the worker of {self.label} exited with status {status} (its error is above)")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def start(self) -> dict[str, Any]:
        """Read the worker's greeting: which koila_retry it imported, and its candidates."""
        hello = self.ask({})
        imported = Path(hello["file"]).resolve()
        if not imported.is_relative_to((self.root / "koila_retry").resolve()):
            raise SystemExit(f"the worker of {self.label} imported {imported}, not the copy in {self.root}")
        self.names = hello["names"]
        self.times = {name: [] for name in self.names}
        return hello

    def round(self, number: int) -> None:
        times = self.ask({"do": "round", "number": number})["times"]
        for name, seconds in zip(self.names, times):
            self.times[name].append(seconds)


def spawn(label: str, root: Path, cwd: Path, calls: int) -> Worker:
    """Start a worker of this interpreter that imports the koila_retry in ``root``, and only that one."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(root)  # replaces the caller's (PYTHONPATH=. would lead base to this tree)
    env["PYTHONUNBUFFERED"] = "1"
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--calls", str(calls)]
    # cwd: a folder without koila_retry in it; the script's own folder, first on sys.path, has none either.
    process = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return Worker(label, root, process)


def git(root: Path, *arguments: str) -> bytes:
    done = subprocess.run(["git", "-C", str(root), *arguments], capture_output=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"git {' '.join(arguments)} failed: {done.stderr.decode(errors='replace').strip()}")
    return done.stdout


def ab_rows(base: Worker, this: Worker, calls: int) -> tuple[list[str], list[list[str]]]:
    """The table of ``--against``: per candidate, each version's median and added time, and the changes."""
    header = [
        "candidate",
        "calls x rounds",
        "base per call",
        "this tree per call",
        "base added",
        "this tree added",
        "change per call",
        "change in added",
    ]
    names = this.names + [name for name in base.names if name not in this.names]
    plain = names[0]
    table = []
    for name in names:
        medians = [statistics.median(w.times[name]) if name in w.times else None for w in (base, this)]
        added = [
            None if median is None else median - statistics.median(w.times[plain])
            for w, median in zip((base, this), medians)
        ]
        rounds = max(len(w.times.get(name, ())) for w in (base, this))
        line = [name, f"{calls} x {rounds}"]
        line += ["n/a" if median is None else duration(median) for median in medians]
        if name == plain:
            line += ["", ""]
        else:
            line += ["n/a" if extra is None else duration(extra) for extra in added]
        (base_median, this_median), (base_added, this_added) = medians, added
        line.append("n/a" if base_median is None or this_median is None else signed(this_median - base_median))
        if name == plain:
            line.append("")
        else:
            line.append("n/a" if base_added is None or this_added is None else signed(this_added - base_added))
        table.append(line)
    return header, table


def against(args: argparse.Namespace) -> int:
    """Compare the happy path of REV's koila_retry with this tree's, in two workers timed in turn."""
    root = Path(__file__).resolve().parent.parent
    commit = git(root, "rev-parse", "--verify", f"{args.against}^{{commit}}").decode().strip()
    dirty = git(root, "status", "--porcelain", "--", "koila_retry").strip()
    head = git(root, "rev-parse", "--short", "HEAD").decode().strip()
    print(f"Python {platform.python_version()} on {platform.machine()} {platform.system()}, {os.cpu_count()} CPUs")
    print(f"torch {torch.__version__} (accelerator: {torch.accelerator.current_accelerator()})")
    if hasattr(os, "getloadavg"):
        print("load average before the run: " + ", ".join(f"{load:.2f}" for load in os.getloadavg()))
    print(f"base:      {args.against} = {commit[:12]}, koila_retry/ copied with git archive")
    print(f"this tree: {root} (HEAD {head}{', uncommitted changes to koila_retry/' if dirty else ''})")
    if not args.no_peers:
        print("note: toma and accelerate are not timed under --against (they are the same for both versions)")

    with tempfile.TemporaryDirectory(prefix="koila-overhead-") as folder:
        base_root, cwd = Path(folder, "base"), Path(folder, "cwd")
        base_root.mkdir()
        cwd.mkdir()
        tar = io.BytesIO(git(root, "archive", "--format=tar", commit, "koila_retry"))
        with tarfile.open(fileobj=tar) as archive:
            if hasattr(tarfile, "data_filter"):
                archive.extractall(base_root, filter="data")
            else:  # Python 3.10 and 3.11 before their security releases of 2023
                archive.extractall(base_root)  # git's own archive of a commit
        workers = [spawn("base", base_root, cwd, args.calls), spawn("this tree", root, cwd, args.calls)]
        try:
            for worker in workers:
                hello = worker.start()
                print(f"{worker.label} worker imported koila_retry {hello['version']} from {hello['file']}")
                for note in hello["notes"]:
                    print(f"note ({worker.label}): {note}")
            print(f"timing {args.rounds} rounds, base and this tree in turn ...", flush=True)
            for number in range(args.rounds):
                for worker in workers if number % 2 == 0 else workers[::-1]:
                    worker.round(number)
                print(f"  round {number + 1}/{args.rounds} done", file=sys.stderr, flush=True)
            for worker in workers:
                for warning in worker.ask({"do": "finish"})["warnings"]:
                    print(f"warning ({worker.label}): {warning}")
                worker.process.wait()
        finally:
            for worker in workers:
                if worker.process.poll() is None:
                    worker.process.kill()
                    worker.process.wait()
                for stream in (worker.process.stdin, worker.process.stdout):
                    if stream is not None:
                        stream.close()

    base, this = workers
    print()
    header, table = ab_rows(base, this, args.calls)
    print_ab_text(header, table)
    print(
        "added: a version's median time per call less that of its own plain call; "
        "change: this tree's less base's (negative: this tree is faster)"
    )
    if args.rst:
        print()
        print_rst(header, table)

    plain, default = this.names[0], this.names[1]
    print()
    print(f"Target: koila's cached happy path adds at most {TARGET_US:g} us per call over a plain call.")
    for worker in workers:
        if default not in worker.times:
            continue
        added_us = (statistics.median(worker.times[default]) - statistics.median(worker.times[plain])) * 1e6
        verdict = "meets" if added_us <= TARGET_US else "does NOT meet"
        print(f"{worker.label}: {default} adds {added_us:.2f} us (median over rounds): it {verdict} the target.")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--calls", type=int, help="calls per round of plain and koila (default 10000; 2000 with --quick)"
    )
    parser.add_argument(
        "--peer-calls", type=int, help="calls per round of toma and accelerate (default 3; 1 with --quick)"
    )
    parser.add_argument(
        "--rounds", type=int, help="rounds; each times every candidate once (default 11; 3 with --quick)"
    )
    parser.add_argument("--quick", action="store_true", help="a fast, noisier run; explicit options still apply")
    parser.add_argument("--no-peers", action="store_true", help="measure plain and koila only")
    parser.add_argument("--rst", action="store_true", help="also print the table as a reStructuredText csv-table")
    parser.add_argument(
        "--against",
        metavar="REV",
        help="compare the koila rows with those of the git revision REV, timed in turn in two workers",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a worker of --against
    args = parser.parse_args(argv)
    for name, full, quick in (("calls", 10000, 2000), ("peer_calls", 3, 1), ("rounds", 11, 3)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.worker:
        return serve(args.calls)
    if min(args.calls, args.peer_calls, args.rounds) < 1:
        parser.error("--calls, --peer-calls and --rounds must be >= 1")
    if args.against is not None:
        return against(args)

    candidates, notes = build(args)
    print(f"Python {platform.python_version()} on {platform.machine()} {platform.system()}, {os.cpu_count()} CPUs")
    print(
        f"torch {torch.__version__} (accelerator: {torch.accelerator.current_accelerator()}), "
        f"koila-retry {koila.__version__}, toma {version_of('toma')}, accelerate {version_of('accelerate')}"
    )
    if hasattr(os, "getloadavg"):
        print("load average before the run: " + ", ".join(f"{load:.2f}" for load in os.getloadavg()))
    print(f"{len(gc.get_objects())} objects tracked by the garbage collector (a full gc.collect() walks them all)")
    for note in notes:
        print(f"note: {note}")
    print(f"timing {len(candidates)} candidates, {args.rounds} rounds ...", flush=True)
    run(candidates, args.rounds)

    print()
    header, table = rows(candidates)
    print_text(header, table)
    if any(candidate.peer for candidate in candidates):
        print(f"x koila: a peer's median time per call divided by that of {candidates[1].name}")
    for warning in cache_warnings(candidates):
        print(f"warning: {warning}")
    if args.rst:
        print()
        print_rst(header, table)

    plain, default = candidates[0], candidates[1]
    added_us = (default.median - plain.median) * 1e6
    verdict = "meets" if added_us <= TARGET_US else "does NOT meet"
    print()
    print(
        f"Target: koila's cached happy path adds at most {TARGET_US:g} us per call over a plain call.\n"
        f"Measured: {default.name} adds {added_us:.2f} us (median over rounds): it {verdict} the target."
    )
    for candidate in candidates[2:]:
        if not candidate.peer:
            extra = (candidate.median - plain.median) * 1e6
            print(f"          {candidate.name}: {extra:.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
