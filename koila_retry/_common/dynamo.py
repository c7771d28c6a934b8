"""Frames that ``torch.compile`` runs as they are written, compiling the frames they call.

Dynamo traces a ``try`` (or ``with attempt:``) around work that it can trace whole as if
nothing in it raised: the graph it makes runs outside the handler, and an out-of-memory error
raised while that graph runs would pass the retry by. The engine's frames that hold an attempt,
and the wrappers in front of them, are therefore skipped, without importing ``torch._dynamo``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["not_traced"]

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
