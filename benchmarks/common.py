"""What the benchmark scripts share: versions of peers, and how numbers and tables are printed."""

from __future__ import annotations

import argparse
import csv
import io
import os
import subprocess
import tarfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Protocol, TypeVar

T = TypeVar("T")


class BatchSizeRetry(Protocol):
    """What ``find_executable_batch_size(starting_batch_size=...)`` returns: a decorator that passes the size."""

    def __call__(self, function: Callable[[int], T], /) -> Callable[[], T]: ...


class BatchSizeFinder(Protocol):
    """accelerate's ``find_executable_batch_size`` as the scripts call it: accelerate ships no types."""

    def __call__(
        self, *, starting_batch_size: int = 128, reduce_batch_size_fn: Callable[[], int] | None = None
    ) -> BatchSizeRetry: ...


def version_of(distribution: str) -> str:
    """Return the installed version of a distribution, or say that it is not installed."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def duration(seconds: float) -> str:
    """Format a time per call or step in microseconds or milliseconds."""
    micro = seconds * 1e6
    if abs(micro) >= 1000:
        return f"{micro / 1000:.2f} ms"
    return f"{micro:.1f} us"


def percent(ratio: float) -> str:
    """Format a ratio to a baseline as a change in percent, or as a factor when it is large."""
    change = (ratio - 1) * 100
    if abs(change) >= 100:
        return f"{ratio:,.1f}x"
    return f"{change:+.2f}%"


def print_rst(header: list[str], table: list[list[str]], title: str = "") -> None:
    """Print a table as a reStructuredText csv-table, one line a row, for docs/performance.rst."""
    print(f".. csv-table:: {title}".rstrip())
    print("   :header-rows: 1")
    print()
    for line in [header, *table]:
        row = io.StringIO()
        csv.writer(row, lineterminator="").writerow(line)
        print(f"   {row.getvalue()}")


def print_text(header: list[str], table: list[list[str]]) -> None:
    """Print a table as aligned text: the first two columns to the left, the rest to the right."""
    widths = [max(len(line[i]) for line in [header, *table]) for i in range(len(header))]
    for number, line in enumerate([header, *table]):
        cells = [cell.ljust(width) if i < 2 else cell.rjust(width) for i, (cell, width) in enumerate(zip(line, widths))]
        print("  ".join(cells).rstrip())
        if number == 0:
            print("  ".join("-" * width for width in widths))


def labelled(label: str, rows: list[list[str]]) -> list[list[str]]:
    """Return a group of rows of a table: ``label`` before the first of ``rows``, an empty cell before the others."""
    return [[label if number == 0 else "", *row] for number, row in enumerate(rows)]


def print_load(when: str) -> None:
    """Print the 1-, 5- and 15-minute load averages, ``when`` ("before", "after") the run, where the system has them."""
    if hasattr(os, "getloadavg"):
        print(f"load average {when} the run: " + ", ".join(f"{value:.2f}" for value in os.getloadavg()), flush=True)


def print_summary(header: list[str], table: list[list[str]], rst: list[tuple[str, list[str], list[list[str]]]]) -> None:
    """Print the summary table, then each of ``rst`` (title, header, rows) as a csv-table (none without ``--rst``)."""
    print("\nSummary:")
    print_text(header, table)
    for title, rst_header, rst_table in rst:
        print()
        print_rst(rst_header, rst_table, title)


def print_verdict(target: str, subject: str, missed: list[str]) -> None:
    """Print the target, and whether ``subject`` meets it: the sentence names what ``missed`` it."""
    print()
    print(f"Target: {target}")
    verdict = "does NOT meet" if missed else "meets"
    print(f"Measured: {subject} {verdict} it" + (f" (missed: {'; '.join(missed)})." if missed else "."))


def add_run_flags(parser: argparse.ArgumentParser, *, no_peers: str) -> None:
    """Add the flags a timed benchmark shares: ``--quick``, ``--no-peers`` (helped by ``no_peers``), ``--rst``."""
    parser.add_argument("--quick", action="store_true", help="a fast, noisier run; explicit options still apply")
    parser.add_argument("--no-peers", action="store_true", help=no_peers)
    parser.add_argument("--rst", action="store_true", help="also print the tables as reStructuredText csv-tables")


def settle_rounds(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Default ``--rounds`` to 30 (4 with ``--quick``), and refuse fewer than 1."""
    if args.rounds is None:
        args.rounds = 4 if args.quick else 30
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")


def unpack_revision(revision: str, folder: Path) -> str:
    """Copy ``koila_retry/`` as of a git revision of this repository into ``folder``, for ``--against``.

    Args:
        revision (str): a commit, a tag, ``HEAD~1``...
        folder (Path): an existing folder; ``folder / "koila_retry"`` is created.

    Returns:
        str: the full hash of the revision's commit.

    Raises:
        SystemExit: if git cannot resolve the revision or archive it, with git's message.
    """
    root = Path(__file__).resolve().parent.parent

    def git(*arguments: str) -> bytes:
        done = subprocess.run(["git", "-C", str(root), *arguments], capture_output=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"git {' '.join(arguments)} failed: {done.stderr.decode(errors='replace').strip()}")
        return done.stdout

    commit = git("rev-parse", "--verify", f"{revision}^{{commit}}").decode().strip()
    with tarfile.open(fileobj=io.BytesIO(git("archive", "--format=tar", commit, "koila_retry"))) as archive:
        if hasattr(tarfile, "data_filter"):
            archive.extractall(folder, filter="data")
        else:  # Python 3.10 and 3.11 before their security releases of 2023
            archive.extractall(folder)  # git's own archive of a commit
    return commit
