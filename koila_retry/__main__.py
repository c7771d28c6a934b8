"""The command line: ``koila-retry demo`` and ``koila-retry estimate``, or ``python -m koila_retry ...``."""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import re
import sys
import textwrap
from collections.abc import Sequence

from koila_retry._cli import estimate as estimate_command
from koila_retry._version import __version__

# A model in the repository's examples (not installed with the package), estimated with what the
# README installs; its inputs are token ids, hence --input-dtype int64.
ESTIMATE_EXAMPLE = "examples/profile_model.py:Classifier --input 16 --input-dtype int64 --memory 1GiB"


def _prog() -> str:
    """Return how the command was invoked, for its usage lines: ``koila-retry`` or ``python -m koila_retry``."""
    # The console script runs with argv[0] the script's path (koila-retry.exe on Windows); under
    # ``-m``, this file's path.
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if name.lower().removesuffix(".exe") == "koila-retry":
        return "koila-retry"
    return "python -m koila_retry"


# Options whose value may start with a minus sign. argparse takes "-5MiB" after one of them for
# another option ("expected one argument"); given as "--memory=-5MiB", the value reaches its check,
# which says what is wrong with it.
_VALUE_OPTIONS = frozenset({"--memory", "--margin", "--input", "--initial", "--epochs"})
_NEGATIVE = re.compile(r"^-[\d.]")


def _attach_negative_values(argv: Sequence[str]) -> list[str]:
    """Join ``--memory -5MiB`` into ``--memory=-5MiB``, for each option of ``_VALUE_OPTIONS``."""
    joined: list[str] = []
    values = iter(argv)
    for arg in values:
        if arg == "--":
            joined += [arg, *values]
            break
        if arg in _VALUE_OPTIONS:
            following = next(values, None)
            if following is not None and _NEGATIVE.match(following):
                joined.append(f"{arg}={following}")
                continue
            joined.append(arg)
            if following is not None:
                joined.append(following)
            continue
        joined.append(arg)
    return joined


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line.

    Args:
        argv (sequence of str, optional): the arguments; default ``sys.argv[1:]``.

    Returns:
        int: the exit status.
    """
    # A class name the terminal's encoding lacks is escaped, not an error; the caller's setting is put back.
    streams = [(stream, stream.errors) for stream in (sys.stdout, sys.stderr) if isinstance(stream, io.TextIOWrapper)]
    for stream, _ in streams:
        stream.reconfigure(errors="backslashreplace")
    try:
        try:
            return _main(argv)
        finally:  # after --help's exit too: a reader gone shows here, not as an error ignored at exit
            if sys.stdout is not None:  # none at all: pythonw, or a closed descriptor
                sys.stdout.flush()
    except BrokenPipeError:
        # The reader stopped reading (``| head -1``): the rest goes nowhere, and the status is a shell's
        # for a writer that a broken pipe ended (128 + SIGPIPE).
        with contextlib.suppress(AttributeError, OSError, ValueError):  # a stream with no descriptor: none to move
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    finally:
        for stream, errors in streams:
            with contextlib.suppress(OSError, ValueError):  # a broken or closed stream's flush
                stream.reconfigure(errors=errors)


def _main(argv: Sequence[str] | None) -> int:
    prog = _prog()
    parser = argparse.ArgumentParser(prog=prog, description="koila-retry: OOM becomes a smaller batch.")
    parser.add_argument("--version", action="version", version=f"koila-retry {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="train a small model in a simulated device that is too small for its batch",
        description="Train a small model in a simulated device too small for its batch: koila.batch runs the "
        "epoch again at the next smaller power of two until it fits, and the later epochs start at the size that fit. "
        "Nothing is written to disk.",
    )
    demo.add_argument("--memory", default="48MiB", help="the simulated device's memory (default: 48MiB)")
    demo.add_argument("--initial", type=int, default=8192, help="the batch size to start from (default: 8192)")
    demo.add_argument("--epochs", type=int, default=3, help="how many epochs to train (default: 3)")
    demo.add_argument("-v", "--verbose", action="store_true", help="also show koila_retry's log")
    estimate = commands.add_parser(
        "estimate",
        help="estimate a model's peak memory at every batch size, and the largest that fits, without running it",
        description=textwrap.fill(
            "Build a model on the meta device and estimate the peak memory of its training step (or "
            "forward pass) at every batch size, without data and without allocating it. The training step's "
            "loss is the mean of the output's floating tensors: a real one (a cross-entropy over a large "
            "vocabulary) can peak higher; estimate your own step with koila.estimate for that. Exit status: 0 "
            "if some batch size fits, 1 if none does or the model failed, 2 for usage errors.",
            width=78,
        ),
        # On one line, to be copied whole.
        epilog=f"example, from the root of koila-retry's repository:\n  {prog} estimate {ESTIMATE_EXAMPLE}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    estimate_command.configure(estimate)
    args = parser.parse_args(_attach_negative_values(sys.argv[1:] if argv is None else argv))

    if args.command == "estimate":
        return estimate_command.run(args, estimate)

    if args.command == "demo":
        from koila_retry._cli.demo import run_demo
        from koila_retry._common.units import parse_bytes

        if args.verbose:
            logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
        try:
            if args.memory.strip().startswith("-") or parse_bytes(args.memory) < 1:
                raise ValueError(f"give --memory as a size of more than 0 bytes, like 48MiB, got {args.memory!r}")
            if args.initial < 1 or args.epochs < 1:
                raise ValueError(f"--initial and --epochs must be >= 1, got {args.initial} and {args.epochs}")
        except (TypeError, ValueError) as exc:
            demo.error(str(exc))  # with the demo's usage, as argparse's own errors of its options
        import torch

        from koila_retry.exceptions import BatchSizeExhausted

        try:
            run_demo(limit=args.memory, initial=args.initial, epochs=args.epochs)
        except BatchSizeExhausted as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        except torch.OutOfMemoryError:
            # Raised outside any retry: building the model itself did not fit.
            print(f"error: the demo's model does not fit in --memory {args.memory}; try 16MiB or more", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
