"""Read a running frame's variables without keeping them alive."""

from __future__ import annotations

import inspect
import sys
from types import FrameType
from typing import Any

# Before Python 3.13 (PEP 667), reading ``f_locals`` of a function's frame copies its
# variables into a dict that the frame keeps until it returns: a tensor the function
# deletes afterwards would stay alive through it.
_SNAPSHOTS = sys.version_info < (3, 13)


def frame_locals(frame: FrameType) -> list[tuple[str, Any]]:
    """Return the variables of ``frame`` as ``(name, value)`` pairs, leaving no copy behind in the frame.

    Args:
        frame (FrameType): a frame, running or not.

    Returns:
        list of tuple: the names and values, in the frame's order.
    """
    variables = frame.f_locals
    items = list(variables.items())
    if _SNAPSHOTS and frame.f_code.co_flags & inspect.CO_OPTIMIZED:
        # A function's snapshot, not its namespace (which a module's or class body's is).
        variables.clear()
    return items
