"""The scripts in examples/ run and say what their docs say they say."""

from __future__ import annotations

import os
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
