"""Where code lives: this package, PyTorch, code that ``torch.compile`` generated, and the user's."""

from __future__ import annotations

import os
import sys
from types import TracebackType

import torch

__all__ = ["PACKAGE_DIR", "TORCH_DIR", "is_ours", "levels_to_caller", "where"]

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_LIBRARY_DIRS = (PACKAGE_DIR + os.sep, TORCH_DIR + os.sep)


def is_ours(filename: str) -> bool:
    """Return whether ``filename`` is a module of this package (any of its subpackages)."""
    return os.path.abspath(filename).startswith(PACKAGE_DIR + os.sep)


def levels_to_caller() -> int:
    """Return the ``stacklevel`` of the first frame outside this package, for a warning raised by our caller."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and is_ours(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level


def where(tb: TracebackType | None) -> str:
    """Return ``"file:line in function"`` of the frame of a traceback worth naming.

    An out-of-memory error surfaces inside PyTorch (or the simulated device's
    check), but the line worth naming is the user's that called it: the deepest
    frame of the user's own code. Without one (``chunked(model, x)`` calls the
    model from this package), the deepest frame of PyTorch's public modules (the
    layer that allocated), not of its machinery (``torch/_dynamo``,
    ``torch/utils``) or of this package.

    Args:
        tb (TracebackType or None): the traceback, from its outermost frame.

    Returns:
        str: the place, or ``"an unknown place"``.
    """
    deepest = users = torch_public = None
    while tb is not None:
        code = tb.tb_frame.f_code
        deepest = f"{code.co_filename}:{tb.tb_lineno} in {code.co_name}"
        filename = code.co_filename
        # Code that torch.compile generated (FX graphs, inductor's kernels) is not the user's.
        if not filename.startswith(_LIBRARY_DIRS) and not _generated(filename):
            users = deepest
        elif filename.startswith(_LIBRARY_DIRS[1]) and not filename[len(TORCH_DIR) + 1 :].startswith(("_", "utils")):
            torch_public = deepest
        tb = tb.tb_next
    return users or torch_public or deepest or "an unknown place"


def _generated(filename: str) -> bool:
    if filename.startswith("<eval_with_key>") or "torchinductor_" in filename:  # FX graphs, inductor's default
        return True
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return cache is not None and cache != "" and filename.startswith(cache)
