"""Run the checks a session with a GPU owes, in one call of the device tool, and keep every log.

A session is lent a GPU by chance, for 15 minutes of device time, the machine's start
included (see ``benchmarks/runs/README.md``). This script is the one command such a session
runs: every check that needs CUDA, most needed first, each with its own timeout, stopping
before the time it is given runs out. Its plan:

1. the environment: the commit, ``nvidia-smi``, Python, torch, CUDA, cuDNN and
   transformers (``env.txt``);
2. the CUDA tests, ``pytest -m cuda tests -s -rA``, each file in a process of its own
   (``tests/_isolation.py``: in one process they interfered, on 2026-11-28);
3. ``benchmarks/gpu.py --only speed --quick``: ``accumulate`` whole and split against the
   plain step and the hand loop, issue 40's targets on a GPU;
4. ``benchmarks/ddp.py --nccl --quick``: a process group of one over NCCL, what the ranks'
   agreement costs where each exchange synchronises with the device (issue 42).

Each command's log starts with the command and ends with its exit status and duration, one
file per command, as ``benchmarks/runs/README.md`` asks. A command whose timeout would
outlast what is left of ``--budget`` is not started, and the summary says so. ``README.md`` in the run's
folder lists the commands in order with their outcome, and those the time did not allow.
The folder is packed into one ``run.tar.gz`` in ``--out``, since the device tool brings back
at most eight files; unpack it into ``benchmarks/runs/`` and write the run's ``RECORD.md``.

On the device machine, from the checkout's root, with the wheels it lacks carried in
``.whl`` (``cachetools``; see the device tool's README)::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \\
    export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 && \\
    python3 benchmarks/gpu_session.py --out "$OUT" --budget 540 --commit <commit>

``--commit`` names the commit when the copy of the working tree has no ``.git``. Here,
``python benchmarks/gpu_session.py --dry-run`` prints the plan. The exit status is 0 when
every command that ran exited with 0 or 5 (pytest's status when it selected no test to
run), else 1: a timeout, or any other status. A command not started for lack of time does
not make it 1.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Seconds kept back from the budget for packing the logs and the transfer back.
RESERVE = 20
# Outcomes: pytest's exit status 5 is a file whose CUDA tests were all deselected or skipped.
PASSED, SKIPPED, NOT_RUN = "exit status 0", "exit status 5", "not run"
_KEEP_GOING = ("--continue-on-collection-errors",)


@dataclass(frozen=True)
class Command:
    """One command of the plan: its log's name, its arguments and its own timeout in seconds."""

    log: str
    argv: tuple[str, ...]
    timeout: int


def plan(python: str = sys.executable) -> list[Command]:
    """Return the commands a GPU session runs, most needed first."""
    return [
        # Each CUDA test file runs in a process of its own there (tests/_isolation.py). A test file
        # that a package missing there keeps from importing must not stop the others.
        Command(
            "pytest.log",
            (python, "-m", "pytest", "-m", "cuda", "tests", "-s", "-rA", "--timeout", "150", *_KEEP_GOING),
            240,
        ),
        Command("bench.log", (python, "benchmarks/gpu.py", "--only", "speed", "--quick"), 150),
        Command("ddp-nccl.log", (python, "benchmarks/ddp.py", "--nccl", "--quick"), 120),
    ]


def environment(commit: str | None, root: Path = ROOT) -> str:
    """Return what ``env.txt`` holds: the commit, the GPU and the versions, each item labelled."""
    lines = [f"date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}"]
    found = _output(["git", "rev-parse", "HEAD"], root)
    changes = _output(["git", "status", "--short"], root)
    lines.append(f"commit: {found or commit or 'unknown'}")
    lines.append(f"local changes: {'unknown (no git)' if found is None else changes or 'none'}")
    lines.append(f"python: {platform.python_version()}")
    probe = (
        "import torch; print('torch:', torch.__version__); print('cuda:', torch.version.cuda); "
        "print('cudnn:', torch.backends.cudnn.version()); "
        "print('device:', torch.cuda.get_device_name() if torch.cuda.is_available() else 'none')"
    )
    lines.append(_output([sys.executable, "-c", probe], root) or "torch: not importable")
    lines.append(
        _output([sys.executable, "-c", "import transformers; print('transformers:', transformers.__version__)"], root)
        or "transformers: not importable"
    )
    lines.append("nvidia-smi:")
    lines.append(_output(["nvidia-smi"], root) or "not available")
    return "\n".join(lines) + "\n"


def _output(argv: Sequence[str], root: Path) -> str | None:
    """Return what a short command printed, or None if it could not run or failed."""
    try:
        done = subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def run_plan(
    commands: Sequence[Command],
    folder: Path,
    budget: float,
    root: Path = ROOT,
    clock: Callable[[], float] = time.monotonic,
) -> list[tuple[Command, str]]:
    """Run each command while the budget allows, its log into ``folder``; return each command's outcome."""
    outcomes: list[tuple[Command, str]] = []
    deadline = clock() + budget - RESERVE
    for command in commands:
        left = deadline - clock()
        if left < command.timeout:  # started, it could outlast the budget: the rest waits for the next session
            outcomes.append((command, f"{NOT_RUN}: {max(left, 0):.0f} s left, it may take {command.timeout} s"))
            continue
        outcomes.append((command, _run(command, folder / command.log, root, clock)))
        print(f"{command.log}: {outcomes[-1][1]}", flush=True)
    return outcomes


def _run(command: Command, log: Path, root: Path, clock: Callable[[], float]) -> str:
    """Run one command into its log, which starts with the command and ends with its exit status."""
    started = clock()
    with log.open("w") as out:
        out.write(f"$ {shlex.join(command.argv)}\n")
        out.flush()
        try:
            status = subprocess.run(
                command.argv, cwd=root, stdout=out, stderr=subprocess.STDOUT, timeout=command.timeout, check=False
            ).returncode
            ending = f"exit status: {status}"
        except subprocess.TimeoutExpired:
            status, ending = None, f"killed after its timeout of {command.timeout} s"
        seconds = clock() - started
        out.write(f"\n{ending} ({seconds:.0f} s)\n")
    return f"exit status {status}" if status is not None else ending


def summary(outcomes: Sequence[tuple[Command, str]]) -> str:
    """Return the run's ``README.md``: each command, in order, with its log and outcome."""
    lines = ["# GPU session", "", "| log | command | outcome |", "| --- | --- | --- |"]
    lines += [f"| `{command.log}` | `{shlex.join(command.argv)}` | {outcome} |" for command, outcome in outcomes]
    return "\n".join(lines) + "\n"


def pack(folder: Path, out: Path) -> Path:
    """Pack ``folder`` into ``out/run.tar.gz``, under the folder's own name; return the archive's path."""
    archive = out / "run.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(folder, arcname=folder.name)
    return archive


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="where run.tar.gz goes (the device tool's $OUT)")
    parser.add_argument("--budget", type=float, default=540, help="seconds the whole run may take (default 540)")
    parser.add_argument("--commit", help="the commit tested, where the checkout has no .git")
    parser.add_argument("--name", help="the run's folder (default: <date>-<gpu model>)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and run nothing")
    args = parser.parse_args(argv)
    commands = plan()
    if args.dry_run:
        for command in commands:
            print(f"{command.log} (timeout {command.timeout} s): {shlex.join(command.argv)}")
        return 0
    if args.out is None:
        parser.error("--out is needed, except with --dry-run")
    name = args.name or f"{datetime.date.today().isoformat()}-{_gpu_model()}"
    # Outside --out, of which the device tool brings back eight files: only the archive goes there.
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / name
        folder.mkdir()
        (folder / "env.txt").write_text(environment(args.commit))
        outcomes = run_plan(commands, folder, args.budget)
        (folder / "README.md").write_text(summary(outcomes))
        args.out.mkdir(parents=True, exist_ok=True)
        archive = pack(folder, args.out)
    print(summary(outcomes))
    print(f"packed into {archive}")
    return 0 if all(outcome in (PASSED, SKIPPED) or outcome.startswith(NOT_RUN) for _, outcome in outcomes) else 1


def _gpu_model() -> str:
    """Return the GPU's model in lower case, as run folders are named (``h200``), or ``gpu``."""
    name = _output(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], ROOT) or ""
    for word in name.lower().replace("-", " ").split():
        if word[:1] in "abhlv" and any(character.isdigit() for character in word):
            return word
    return "gpu"


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
