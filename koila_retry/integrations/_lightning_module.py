"""The module object as ``OOMRecovery`` sees it: its trainable parameters, whether it holds a wrapper of
koila's, and its copies and pickles while the callback's wrappers are on it.

The callback sets its wrappers on the module object. ``copy.copy``, ``copy.deepcopy`` and
pickle (``torch.save``) take an object's attributes from its ``__getstate__``, looked up on
the object first: the one set there beside the wrappers gives them the module's own, so that
a copy runs its own steps, not the original's, and a pickle holds nothing of koila's.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch

from koila_retry._core.stats import Stats

__all__ = ["ABSENT", "holds_a_wrapper", "leave_out", "let_go", "trainable"]

ABSENT: Any = object()  # an attribute the module object did not have of its own


class _State:
    """A module object's ``__getstate__``: its class's, each attribute as ``own`` says the module has it."""

    __slots__ = ("module", "own")

    def __init__(self, module: Any, own: Callable[[Any], Any]) -> None:
        self.module, self.own = module, own

    def __call__(self) -> Any:
        state = type(self.module).__getstate__(self.module)
        if not isinstance(state, dict):
            return state
        own, kept = self.own, {}
        for name, value in state.items():
            value = ABSENT if value is self else own(value)
            if value is not ABSENT:
                kept[name] = value
        return kept


def leave_out(module: Any, own: Callable[[Any], Any]) -> None:
    """Make copies and pickles of ``module`` hold ``own(value)`` for each attribute (none for ``ABSENT``)."""
    if "__getstate__" not in vars(module):  # one of the module object's own is left as it is
        vars(module)["__getstate__"] = _State(module, own)


def let_go(module: Any) -> None:
    """Leave copies and pickles of ``module`` to its class again."""
    if isinstance(vars(module).get("__getstate__"), _State):
        del vars(module)["__getstate__"]


def trainable(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Return ``module.parameters()`` that require a gradient, each once, read without a generator per module."""
    kind, plain = type(module), torch.nn.Module
    if (
        kind.parameters is not plain.parameters
        or kind.named_parameters is not plain.named_parameters
        or kind._named_members is not plain._named_members
        or kind.named_modules is not plain.named_modules
    ):
        return [parameter for parameter in module.parameters() if parameter.requires_grad]
    found: list[torch.nn.Parameter] = []
    seen: set[int] = set()  # ids, of the parameters and the modules: a tensor's hash is a call into Python
    stack = [module]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        if type(current).named_modules is not torch.nn.Module.named_modules:
            return [parameter for parameter in module.parameters() if parameter.requires_grad]
        seen.add(id(current))
        for parameter in current._parameters.values():
            if parameter is not None and id(parameter) not in seen:
                seen.add(id(parameter))
                if parameter.requires_grad:
                    found.append(parameter)
        children = current._modules
        if children:  # depth first, in order, as named_modules
            stack.extend([child for child in reversed(children.values()) if child is not None])
    return found


def holds_a_wrapper(pl_module: pl.LightningModule) -> bool:
    """Return whether the module or its class holds a koila-retry wrapper, as the manual-optimisation docs show."""
    # Its own: no warning that tells it to do what it did (a decorated attribute, or a decorated method).
    values = [*vars(pl_module).values(), *(value for kind in type(pl_module).__mro__ for value in vars(kind).values())]
    # Or kept in a dict, list or tuple of them (a GAN's losses, one wrapper each).
    values += [item for value in values if type(value) in (dict, list, tuple) for item in _items(value)]
    # Looked up statically: nothing of the user's runs (a Trainer's, a submodule's __getattr__).
    return any(isinstance(inspect.getattr_static(value, "stats", None), Stats) for value in values)


def _items(value: dict[Any, Any] | list[Any] | tuple[Any, ...]) -> list[Any]:
    return list(value.values()) if isinstance(value, dict) else list(value)
