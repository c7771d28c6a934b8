"""Refuse a backward pass that a step of ``accumulate`` runs itself, before it writes any ``.grad``.

``accumulate`` runs each micro-batch's backward; one the step runs too would add into ``.grad`` again.
Every backward that writes ``.grad`` from Python goes through ``torch.autograd.graph._engine_run_backward``
with ``accumulate_grad=True``; it is wrapped once, as PyTorch wraps it for tracing, and raises while a
step's own code runs on the thread. That costs one Python call per backward of the process: a hook per
parameter, or a ``TorchFunctionMode`` over the forward, would cost per parameter or per operation.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

from koila_retry._common.forks import locks_renewed_in_child

__all__ = ["BACKWARDS", "THREAD", "allowed", "call", "guard", "seen"]


class _Running(threading.local):
    """This thread's step whose own code is running, and how many backward passes were refused in it."""

    def __init__(self) -> None:
        self.step: str | None = None
        self.refused = 0
        # Whether a training engine's backward= runs now, each backward pass it starts seen as it starts
        # (by a function mode): one that reaches the engine unseen would write .grad where no rollback finds it.
        self.engine = False


# Set and restored by the callers in a finally, with stores and C calls alone: a context manager's
# __exit__ is a Python call, where a Ctrl-C can land before it restores anything.
THREAD = _Running()
_lock = threading.Lock()
locks_renewed_in_child(globals(), "_lock")  # a fork while another thread held it
_guarded: list[Callable[..., Any]] = []  # the wrapper, once installed
# The steps whose backward runs now, in any thread (autograd runs a device's nodes on a thread of its own):
# each is told of a backward that a node runs inside another, and takes it if the node is one of its own.
BACKWARDS: list[Callable[[Any], None]] = []
# A backward started inside a node's backward (not from the code that started the outer one).
_inside_a_node = getattr(torch._C, "_current_autograd_node", lambda: None)


def guard() -> bool:
    """Wrap PyTorch's entry into the autograd engine, once, so that :func:`call` can refuse a backward."""
    if _guarded:
        return True
    graph = torch.autograd.graph
    with _lock:
        original = getattr(graph, "_engine_run_backward", None)
        if _guarded or original is None:  # False on a PyTorch without the entry: nothing is refused
            return bool(_guarded)

        @functools.wraps(original)
        def guarded(t_outputs: Any, *args: Any, **kwargs: Any) -> Any:
            running = THREAD
            # The engine's own default is to accumulate: a caller that does not say writes .grad.
            writes = kwargs.get("accumulate_grad", args[5] if len(args) > 5 else True)
            if running.step is not None and writes:
                running.refused += 1
                raise RuntimeError(_refusal(running.step))
            if running.engine and writes and _inside_a_node() is None:
                raise RuntimeError(_UNSEEN)
            if BACKWARDS and writes and _inside_a_node() is not None:
                # A custom Function's backward that runs one of its own (a hand-made recomputation):
                # the step whose graph the node is in takes the leaves it writes as its own first.
                for tell in list(BACKWARDS):
                    tell(t_outputs)
            return original(t_outputs, *args, **kwargs)

        # Both names: torch.autograd calls it by the one it imported, and PyTorch's own
        # wrapper for tracing reads graph's and puts back what it read into both.
        graph._engine_run_backward = guarded
        setattr(torch.autograd, "_engine_run_backward", guarded)  # noqa: B010 (not in the stubs)
        _guarded.append(guarded)
    return True


def allowed(backward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Return ``backward(*args, **kwargs)``, a backward pass the step that :func:`call` runs may start itself."""
    # A trainer's step run as the trainer runs it: its one backward through the trainer's engine, not another.
    outer, THREAD.step = THREAD.step, None
    try:
        return backward(*args, **kwargs)
    finally:
        THREAD.step = outer


def seen(plain: Callable[[], None]) -> None:
    """Run ``plain()``, a backward that the engine's ``backward=`` started and koila saw start."""
    outer, THREAD.engine = THREAD.engine, False
    try:
        plain()
    finally:
        THREAD.engine = outer


_UNSEEN = (
    "the backward= of koila.accumulate started a backward pass that no torch function reached as it started "
    "(torch.autograd.backward of GradientEdge outputs, say), so koila cannot see which .grad it writes: a "
    "micro-batch that failed after it would leave its gradient in .grad. Refused before it wrote any. Start "
    "the backward from the loss tensor (loss.backward() or torch.autograd.backward(loss, ...))"
)


def call(fn: Callable[..., Any], name: str, args: Any, kwargs: dict[str, Any]) -> Any:
    """Run a step's own code, ``fn(*args, **kwargs)``, with a backward pass inside it refused."""
    running = THREAD
    outer, refused = running.step, running.refused
    try:
        running.step = name
        result = fn(*args, **kwargs)
    finally:
        running.step = outer
    if running.refused != refused:  # raised again even where the step caught the refusal
        raise RuntimeError(_refusal(name))
    return result


def _refusal(name: str) -> str:
    """Return the error of a step that ran a backward pass itself."""
    return (
        f"{name} ran a backward pass itself (loss.backward() or torch.autograd.backward inside the step, or "
        "another step decorated with koila.accumulate, which runs its own: steps do not nest), "
        "refused before it wrote any .grad: koila.accumulate runs the backward of the loss the step returns, "
        "once per micro-batch, so that backward would add the gradient a second time, and again in every "
        "micro-batch and retry. Return the loss and let accumulate run its backward; for a training engine's "
        "backward (accelerator.backward, fabric.backward), pass it as backward=; for a gradient the step needs "
        "itself (a gradient penalty), use torch.autograd.grad, which writes no .grad"
    )
