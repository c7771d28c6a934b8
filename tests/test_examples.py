"""The scripts in examples/ run and say what their docs say they say."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_evaluate_in_batches_settles_and_matches() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    completed = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "evaluate_in_batches.py")],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert completed.returncode == 0, completed.stderr
    assert "out of memory, retrying at" in completed.stdout
    assert "Settled on batch size" in completed.stdout
    assert "Outputs match an unconstrained run" in completed.stdout


@pytest.mark.slow
def test_embed_large_tensor_resumes_mid_way_and_matches() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    completed = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "embed_large_tensor.py"),
            *("--rows", "20000", "--memory", "4.5MiB", "--initial", "1024"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert completed.returncode == 0, completed.stderr
    joined, written = completed.stdout.split("Writing into a preallocated buffer with out=:")
    # The joined pass runs out of memory part-way, as the results pile up, and goes on
    # from the failed chunk's first row at half the size.
    resumed = re.search(r"after +(\d+) rows: a chunk of 1024 rows ran out of memory; resuming at row (\d+)", joined)
    assert resumed is not None, completed.stdout
    assert 0 < int(resumed.group(1)) == int(resumed.group(2)) < 20000
    assert "Joined: 20000 rows" in joined
    assert "Written: 20000 rows" in written
    assert "the result is the buffer: True" in written
    assert "Both match an unconstrained run" in written
