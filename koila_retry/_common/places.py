"""Where code lives: this package, PyTorch, other libraries, code that ``torch.compile`` generated, and the user's."""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import site
import sys
import sysconfig
from types import FrameType, TracebackType

import torch

__all__ = [
    "PACKAGE_DIR",
    "SUSPENDABLE",
    "TORCH_DIR",
    "Replayed",
    "is_ours",
    "is_users",
    "levels_to_caller",
    "place_of",
    "release_ours",
    "replayable",
    "where",
]

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
# Frames of these kinds may be suspended rather than finished: clearing one would close its generator.
SUSPENDABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR
# The command line's programs use the library as a user's code does: the demo's training
# loop is named where a failure happened, as a user's would be.
_APPLICATIONS = (os.path.join(PACKAGE_DIR, "_cli") + os.sep, os.path.join(PACKAGE_DIR, "__main__.py"))
# Inside PyTorch, the machinery between the user's call and the layer that allocated;
# ``overrides`` dispatches to function modes, such as the one accumulate runs backward in, and
# ``Module.__call__`` to a layer's forward, which may be another library's.
_TORCH_MACHINERY = ("_", "utils", "autograd", "overrides", os.path.join("nn", "modules", "module.py"))
_MODULE = os.path.join(TORCH_DIR, "nn", "modules", "module.py")
# Autograd's functions that run a backward pass, and where they live.
_BACKWARDS = frozenset({"backward", "_engine_run_backward", "grad"})
_AUTOGRAD = os.path.join(TORCH_DIR, "autograd") + os.sep


def _installed() -> tuple[str, ...]:
    """Return the folders of the standard library and of installed packages, each ending in a separator."""
    paths = sysconfig.get_paths()
    folders = {paths[name] for name in ("stdlib", "platstdlib", "purelib", "platlib") if name in paths}
    folders.update(getattr(site, "getsitepackages", list)())
    return tuple(sorted(os.path.abspath(folder) + os.sep for folder in folders if folder))


_INSTALLED = _installed()
_USER, _TORCH, _LIBRARY = "user", "torch", "library"


@functools.lru_cache(maxsize=1024)  # read for every frame of a stack key's walk
def is_ours(filename: str) -> bool:
    """Return whether ``filename`` is a module of this library (any subpackage but the command line's)."""
    path = os.path.abspath(filename)
    return path.startswith(PACKAGE_DIR + os.sep) and not path.startswith(_APPLICATIONS)


def release_ours(error: BaseException) -> None:
    """Clear the finished frames of this package that ``error`` passed through: the user's keep their locals."""
    # They hold what a step made (a micro-batch's result, the parts kept of the others), which the error
    # that the user holds, or a debugger, would keep alive for nothing.
    tb = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if is_ours(frame.f_code.co_filename) and not frame.f_code.co_flags & SUSPENDABLE:
            with contextlib.suppress(RuntimeError):  # still running: the handler's own
                frame.clear()
        tb = tb.tb_next


def is_users(filename: str) -> bool:
    """Return whether ``filename`` is the user's code: not a library's (this one, PyTorch, installed ones, Python's)."""
    return _kind(filename) is _USER


def levels_to_caller() -> int:
    """Return the ``stacklevel`` of the first frame outside this package, for a warning raised by our caller."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and is_ours(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level


def where(tb: TracebackType | None) -> str:
    """Return ``"file:line in function"`` of the frame of a traceback (from its outermost) worth naming."""
    deepest = users = torch_public = layer = None
    backward = called = False
    outermost = tb.tb_frame if tb is not None else None
    while tb is not None:
        code = tb.tb_frame.f_code
        deepest = f"{code.co_filename}:{tb.tb_lineno} in {code.co_name}"
        kind = _kind(code.co_filename)
        if called:  # the forward that Module.__call__ ran: a layer's, PyTorch's or another library's
            layer = deepest
        called = code.co_filename == _MODULE
        if kind is _USER:
            users = deepest
        elif kind is _TORCH:
            torch_public = deepest
        elif code.co_name in _BACKWARDS and code.co_filename.startswith(_AUTOGRAD):
            backward = True
        tb = tb.tb_next
    # An OOM surfaces inside PyTorch, but the line worth naming is the user's deepest. Without one, PyTorch's
    # deepest public frame, else the deepest layer's forward: the layer that allocated, when
    # ``chunked(model, x)`` calls the model from here. Without that either (``accumulate`` runs ``backward()``
    # for the user), the user's line that called us, said to be the backward's: it allocated nothing itself.
    found = users or torch_public or layer
    if found is not None:
        return found
    caller = _callers(outermost)
    if caller is not None:
        return f"{caller} (in the backward pass it ran)" if backward else caller
    return deepest or "an unknown place"


class Replayed(torch.OutOfMemoryError):
    """An out-of-memory error that an integration caught, raised again from its message and first place."""

    def __init__(self, message: str, place: str = "") -> None:
        super().__init__(message)
        self.place = place


def replayable(error: BaseException) -> tuple[str, str]:
    """Return what is kept of a caught error to raise it again as :class:`Replayed`: its message and place."""
    return str(error), where(error.__traceback__)


def place_of(error: BaseException) -> str:
    """Return where ``error`` was raised: a replayed error's first place, else :func:`where` of its traceback."""
    if isinstance(error, Replayed) and error.place:
        return error.place
    return where(error.__traceback__)


def _callers(frame: FrameType | None) -> str | None:
    """Return the place of the first user's frame above ``frame``."""
    frame = frame.f_back if frame is not None else None
    while frame is not None:
        code = frame.f_code
        if _kind(code.co_filename) is _USER:
            return f"{code.co_filename}:{frame.f_lineno} in {code.co_name}"
        frame = frame.f_back
    return None


def _kind(filename: str) -> str:
    """Say whose code ``filename`` is: the user's, PyTorch's public modules', or a library's."""
    if filename.startswith(PACKAGE_DIR + os.sep):
        return _USER if filename.startswith(_APPLICATIONS) else _LIBRARY
    if filename.startswith(TORCH_DIR + os.sep):
        return _LIBRARY if filename[len(TORCH_DIR) + 1 :].startswith(_TORCH_MACHINERY) else _TORCH
    if filename.startswith((*_INSTALLED, "<frozen ")) or _generated(filename):
        return _LIBRARY
    return _USER


def _generated(filename: str) -> bool:
    if filename.startswith("<eval_with_key>") or "torchinductor_" in filename:  # FX graphs, inductor's default
        return True
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return cache is not None and cache != "" and filename.startswith(cache)
