"""What ``OOMRecovery`` does to a training step's tensors: its parameters' hooks, taken off while
its micro-batches run and put back, and the graphs its output holds besides the loss.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_unflatten

from koila_retry._common.results import flatten

__all__ = ["Hooks", "restored", "suspended", "watched", "without_graphs"]

Hooks = list[tuple[torch.Tensor, dict[Any, Any], dict[Any, Any]]]


def watched(parameters: list[torch.nn.Parameter]) -> bool:
    """Return whether a parameter has a hook (``register_hook``, post-accumulate)."""
    return any(
        parameter._backward_hooks or getattr(parameter, "_post_accumulate_grad_hooks", None) for parameter in parameters
    )


def suspended(parameters: list[torch.nn.Parameter]) -> Hooks:
    """Take the hooks off the parameters that have any (``register_hook``, post-accumulate); return them."""
    # Emptied in place: autograd holds these dicts themselves.
    taken: Hooks = []
    for parameter in parameters:
        before, after = parameter._backward_hooks, getattr(parameter, "_post_accumulate_grad_hooks", None)
        if before or after:
            taken.append((parameter, dict(before or {}), dict(after or {})))
            if before:
                before.clear()
            if after:
                after.clear()
    return taken


def restored(taken: Hooks) -> None:
    """Put back the hooks :func:`suspended` took, before any the step added."""
    for parameter, before, after in taken:
        for name, kept in (("_backward_hooks", before), ("_post_accumulate_grad_hooks", after)):
            hooks: dict[Any, Any] | None = getattr(parameter, name)
            if kept and hooks is not None:  # emptied, never replaced
                added = dict(hooks)
                hooks.clear()
                hooks.update(kept)
                hooks.update(added)


def without_graphs(output: Mapping[str, Any], loss: torch.Tensor) -> dict[str, Any]:
    """Return a step's output with ``loss`` for its loss, and its other tensors that have a graph detached."""
    # Lightning keeps the other entries (ClosureResult.extra) through its backward of the loss: a
    # tensor with a graph there (logits) would hold the whole batch's graph, which a failure of that
    # backward must let go of before the step runs again in micro-batches.
    return {key: loss if key == "loss" else _detached(value) for key, value in output.items()}


def _detached(value: Any) -> Any:
    """Return ``value`` with its tensors that have a graph detached, in containers remade around them."""
    if isinstance(value, torch.Tensor):
        return value.detach() if value.grad_fn is not None else value
    if value is None or isinstance(value, (str, int, float)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = [field.name for field in dataclasses.fields(value) if hasattr(value, field.name)]
        fields = {name: getattr(value, name) for name in names}
        detached = {name: _detached(field) for name, field in fields.items()}
        if all(detached[name] is fields[name] for name in fields):
            return value
        # A copy whose fields are set as they are, frozen or not: its __init__ and __post_init__ (which may
        # scale or check them) do not run again, and fields it sets itself are kept.
        try:
            copied = copy.copy(value)
            for name, field in detached.items():
                object.__setattr__(copied, name, field)
        except Exception:  # one that cannot be copied: left as returned
            return value
        return copied
    leaves, spec = flatten(value)
    if len(leaves) == 1 and leaves[0] is value:  # not a container torch can remake: left as returned
        return value
    parts = [_detached(leaf) for leaf in leaves]
    if any(new is not old for new, old in zip(parts, leaves, strict=True)):
        with contextlib.suppress(TypeError, ValueError):  # one that cannot be remade: left as returned
            return tree_unflatten(parts, spec)
    return value
