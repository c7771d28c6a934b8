"""Frames that ``torch.compile`` runs as they are written, compiling the frames they call.

Dynamo traces a ``try`` (or ``with attempt:``) around work that it can trace whole as if
nothing in it raised: the graph it makes runs outside the handler, and an out-of-memory error
raised while that graph runs would pass the retry by. The wrappers a compiled caller calls are
therefore skipped, and so is every other frame of the library (Dynamo compiles each frame a
skipped one calls: compiled, they warned of the library's internals and recompiled as the
micro-batches went by), without importing ``torch._dynamo``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from koila_retry._common.forks import locks_renewed_in_child

__all__ = ["compiled_code_runs_eagerly", "not_traced", "not_traced_package"]

F = TypeVar("F", bound=Callable[..., Any])

try:  # what torch._dynamo.skip() sets, in torch's C module: importing torch._dynamo takes a second
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

    # Skip the frame itself, and let Dynamo compile the frames it calls (the user's function) as ever.
    _SKIP: Any = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.DEFAULT)
except (ImportError, AttributeError, TypeError):  # a torch without Dynamo, or with another API
    _SKIP = None


def not_traced(function: F) -> F:
    """Return ``function``, whose frame torch.compile runs as written and a compiled caller calls, not inlines."""
    if _SKIP is not None:
        code = getattr(function, "__code__", None)
        if code is not None:
            set_code_exec_strategy(code, _SKIP)
            function._torchdynamo_disable = True  # type: ignore[attr-defined]
    return function


def not_traced_package(package: str) -> None:
    """Let torch.compile run every function of the imported modules of ``package`` as written."""
    if _SKIP is None:
        return
    # The folder as the code objects name it (a wheel compiled elsewhere names another than __file__).
    folder = os.path.dirname(os.path.dirname(not_traced_package.__code__.co_filename)) + os.sep
    for name, module in list(sys.modules.items()):
        if name == package or name.startswith(package + "."):
            for code in _codes(vars(module).values(), package, set()):
                # The package's own: a decorator's wrapper (contextlib's, functools.wraps'd) is shared by others.
                if code.co_filename.startswith(folder):
                    set_code_exec_strategy(code, _SKIP)


def _codes(values: Any, package: str, seen: set[int]) -> Iterator[types.CodeType]:
    # The functions and classes defined in the package, with their methods and the functions they nest.
    for value in values:
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        elif isinstance(value, property):
            yield from _codes((value.fget, value.fset, value.fdel), package, seen)
            continue
        if not str(getattr(value, "__module__", "")).startswith(package):
            continue
        if isinstance(value, types.FunctionType):
            yield from _nested(value.__code__)
        elif isinstance(value, type):
            yield from _codes(vars(value).values(), package, seen)


def _nested(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            yield from _nested(constant)


# Threads that estimate or profile now, and the stance to put back when the last is done.
_eager: list[Any] = [0, None]
_eager_lock = threading.Lock()
locks_renewed_in_child(globals(), "_eager_lock")  # a fork while another thread held it


@contextlib.contextmanager
def compiled_code_runs_eagerly() -> Iterator[None]:
    """Run compiled code as written while the block runs, in every thread.

    Dynamo meeting one of the library's counting dispatch modes runs the frame eagerly and marks its code
    never to be compiled again, for the process: the user's compiled model would stay eager.
    """
    if "torch._dynamo" not in sys.modules:  # nothing was compiled: importing it takes a second
        yield
        return
    import torch

    with _eager_lock:
        if _eager[0] == 0:
            _eager[1] = _outside_compiled(lambda: torch.compiler.set_stance("force_eager"))
        _eager[0] += 1
    try:
        yield
    finally:
        with _eager_lock:
            _eager[0] -= 1
            if _eager[0] == 0:
                stance, _eager[1] = _eager[1], None
                # Put back only where it is still this one: a stance another thread set meanwhile stays.
                if torch._dynamo.eval_frame._stance is stance.stance:
                    _outside_compiled(lambda: stance.__exit__(None, None, None))


def _outside_compiled(call: Callable[[], Any]) -> Any:
    """Return ``call()`` with this thread's frames out of Dynamo's hands: torch refuses a stance inside them."""
    from torch._C._dynamo.eval_frame import set_eval_frame

    prior = set_eval_frame(None)  # the thread's own, as a compiled caller set it
    try:
        return call()
    finally:
        set_eval_frame(prior)
