"""The scripts of benchmarks/, imported by the tests that check what they measure."""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@contextlib.contextmanager
def imported(name: str) -> Iterator[ModuleType]:
    """Import ``benchmarks/<name>.py``, with its folder on ``sys.path`` while in use (it imports ``common``)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))
