"""Optimizer steps on meta tensors: which optimizer steps when, LBFGS's longest step, and fused steps.

An optimizer's step is followed by its own pre- and post-hooks, registered in the estimating
thread's copy of its hooks. While a step runs, its parameter groups, in that thread's copy
(``lending``), are changed where PyTorch would decide from values meta tensors do not hold
(LBFGS's tolerances) or refuse meta tensors (a fused optimizer's first step); they are put
back as the step ends, and the real groups are never touched.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from koila_retry._estimation.lending import borrowed
from koila_retry._estimation.recorder import Recorder

__all__ = ["follow_steps"]

_MISSING = object()

_UNFUSED = (
    "before its first step, PyTorch's fused optimizers refuse meta tensors, so the estimate runs that step as "
    "the loop over parameters (fused=False, foreach=False), which makes temporaries the fused kernel does not "
    "(Adam's: up to three times the largest parameter): the optimizer step may be estimated above the real one "
    "by as much. Estimated after one real step, the fused step is followed as it is"
)


def follow_steps(
    recorder: Recorder, optimizers: Iterable[torch.optim.Optimizer], reclassify: Callable[[], None]
) -> list[RemovableHandle]:
    """Follow the steps of ``optimizers`` in ``recorder``; return the hooks' handles, to remove after the run."""
    changed: list[list[tuple[dict[str, Any], str, Any]]] = []  # per step running, the group entries it changed

    def entered(optimizer: torch.optim.Optimizer, *_: Any) -> None:
        recorder.enter_step(optimizer)
        changed.append(_prepare(optimizer, recorder))
        reclassify()

    def left(*_: Any) -> None:
        for group, key, before in reversed(changed.pop() if changed else []):
            if before is _MISSING:
                group.pop(key, None)
            else:
                group[key] = before
        recorder.leave_step()
        reclassify()

    handles = []
    # Each optimizer's own hooks, registered into the dicts lent to this thread: another thread's
    # step neither calls them nor meets a change to the process's hooks mid-loop.
    for optimizer in optimizers:
        handles.append(optimizer.register_step_pre_hook(entered))
        handles.append(optimizer.register_step_post_hook(left))
    return handles


def _prepare(optimizer: torch.optim.Optimizer, recorder: Recorder) -> list[tuple[dict[str, Any], str, Any]]:
    """Change the estimating thread's copies of ``optimizer``'s groups for the step beginning; return what changed."""
    groups = borrowed(vars(optimizer).get("param_groups"))
    if groups is None:  # the real groups: left alone
        return []
    changed: list[tuple[dict[str, Any], str, Any]] = []

    def put(group: dict[str, Any], key: str, value: Any) -> None:
        changed.append((group, key, group.get(key, _MISSING)))
        group[key] = value

    if isinstance(optimizer, torch.optim.LBFGS):
        # Every check against a tolerance fails, so that every iteration runs (see recorder._LBFGS).
        for group in groups:
            put(group, "tolerance_grad", -math.inf)
            put(group, "tolerance_change", -math.inf)
    unfused = False
    for group in groups:
        if group.get("fused") and _refuses_meta(optimizer, group):
            put(group, "fused", False)
            put(group, "foreach", False)
            unfused = True
    if unfused:
        recorder.note_inexact(f"{type(optimizer).__name__}(fused=True)", _UNFUSED)
        # A gradient scaler hands a fused optimizer its scale to unscale the gradients in place inside the
        # kernel, and PyTorch's loop refuses it: on meta tensors, unscaling computes and allocates nothing.
        for name in ("grad_scale", "found_inf"):
            if getattr(optimizer, name, None) is not None:
                setattr(optimizer, name, None)
    return changed


def _refuses_meta(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    """Return whether PyTorch's fused step of ``group`` checks its parameters' device now, which refuses meta."""
    # Adam and AdamW check as they make a parameter's state; SGD and Adagrad at their first step.
    if getattr(optimizer, "_need_device_dtype_check_for_fused", False):
        return True
    return any(parameter.grad is not None and not optimizer.state.get(parameter) for parameter in group["params"])
