"""Walk the objects a call can reach, and read a running frame's variables without keeping them alive."""

from __future__ import annotations

import functools
import inspect
import itertools
import sys
import types
from collections.abc import Iterable, Iterator, Mapping
from types import FrameType
from typing import Any

import torch

__all__ = ["MAX_DEPTH", "MAX_ITEMS", "call_references", "frame_locals", "global_names", "reachable", "references"]

# Models and optimizers sit a few references from a call (a closure's trainer's model);
# past this, a walk would wander into whole libraries' state.
MAX_DEPTH = 6
# A container's first items are looked at: one that holds modules holds them all alike.
MAX_ITEMS = 1000

# Nothing inside these is training state, and some (modules, classes) lead everywhere.
_LEAVES = (types.ModuleType, type, torch.Tensor, str, bytes, int, float, complex, bool, type(None), torch.dtype)
# Mapping keys that name their values cheaply; any other key's repr could print a tensor's values or run user code.
_PLAIN_KEYS = (str, int)

# Before Python 3.13 (PEP 667), reading ``f_locals`` of a function's frame copies its
# variables into a dict that the frame keeps until it returns: a tensor the function
# deletes afterwards would stay alive through it.
_SNAPSHOTS = sys.version_info < (3, 13)


def global_names(code: types.CodeType) -> set[str]:
    """Return the names a code object uses as globals or attributes, with those of the code nested in it.

    Args:
        code (types.CodeType): the code of a function (its lambdas, comprehensions
            and inner functions are nested code objects).

    Returns:
        set of str: the names (``co_names``) of ``code`` and every code object in its constants.
    """
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= global_names(constant)
    return names


def references(value: Any) -> list[tuple[str, Any]]:
    """Return the objects ``value`` refers to directly, each with the name it knows it by.

    Args:
        value (Any): any object. Modules of code, classes, tensors, strings,
            numbers, ``None`` and dtypes refer to nothing here.

    Returns:
        list of tuple: ``(name, object)`` pairs. A function: its defaults (by
        parameter name), its closure cells (by free variable name) and the globals
        its code names (by name, sorted). A bound method: ``("self", __self__)``
        and ``("__func__", __func__)``. A ``functools.partial``: ``"func"``,
        ``"args[i]"`` and its keywords by name. A list, tuple, set or frozenset:
        its first :data:`MAX_ITEMS` items as ``"[i]"``. A mapping: its first
        :data:`MAX_ITEMS` values as ``"[key]"`` (``"values()[i]"`` for a key
        that is neither a str nor an int). Any other object with a ``__dict__``:
        its attributes by name, and ``("__call__", function)`` where its class
        defines ``__call__`` in Python.
    """
    if isinstance(value, _LEAVES):
        return []
    if isinstance(value, types.MethodType):
        return [("self", value.__self__), ("__func__", value.__func__)]
    if isinstance(value, types.FunctionType):
        return [*_defaults(value), *_code_references(value)]
    if isinstance(value, functools.partial):
        return [
            ("func", value.func),
            *((f"args[{index}]", item) for index, item in enumerate(value.args)),
            *value.keywords.items(),
        ]
    if isinstance(value, (list, tuple, set, frozenset)):
        return [(f"[{index}]", item) for index, item in enumerate(itertools.islice(value, MAX_ITEMS))]
    if isinstance(value, Mapping):
        return [
            (f"[{key!r}]" if type(key) in _PLAIN_KEYS else f"values()[{index}]", item)
            for index, (key, item) in enumerate(itertools.islice(value.items(), MAX_ITEMS))
        ]
    attributes = getattr(value, "__dict__", None)
    if isinstance(attributes, dict):
        found = list(attributes.items())
        call = vars(type(value)).get("__call__")  # a callable object's own code names globals too
        if isinstance(call, types.FunctionType):
            found.append(("__call__", call))
        return found
    return []


def _defaults(function: types.FunctionType) -> list[tuple[str, Any]]:
    """Return a function's default values, by the names of their parameters."""
    defaults = function.__defaults__ or ()
    positional = function.__code__.co_varnames[: function.__code__.co_argcount]
    # The defaults belong to the last positional parameters; a __defaults__ set by hand may not fit them.
    names = positional[len(positional) - len(defaults) :] if len(defaults) <= len(positional) else ()
    found = [(names[index] if names else f"__defaults__[{index}]", default) for index, default in enumerate(defaults)]
    return found + list((function.__kwdefaults__ or {}).items())


def _code_references(function: types.FunctionType) -> list[tuple[str, Any]]:
    """Return the variables a function closes over and the globals its code names, by name."""
    found: list[tuple[str, Any]] = []
    for name, cell in zip(function.__code__.co_freevars, function.__closure__ or (), strict=False):
        try:
            found.append((name, cell.cell_contents))
        except ValueError:  # an empty cell
            continue
    names = function.__globals__
    # Sorted, so that every process walks them in the same order (a set of str's is not).
    found += [(name, names[name]) for name in sorted(global_names(function.__code__)) if name in names]
    return found


def reachable(roots: Iterable[Any]) -> Iterator[Any]:
    """Yield the modules, optimizers and other stateful objects reachable from ``roots``.

    The walk follows :func:`references` up to :data:`MAX_DEPTH` references from a
    root, visits each object once, and does not look inside the modules and
    optimizers it yields.

    Args:
        roots (Iterable[Any]): where to start: a function, its arguments, a frame's variables.

    Returns:
        Iterator[Any]: every ``torch.nn.Module`` and ``torch.optim.Optimizer``
        found (not the modules inside them), and every other object that saves
        and loads a ``state_dict`` (a learning-rate scheduler, a gradient scaler),
        each once.
    """
    seen: set[int] = set()
    stack: list[tuple[Any, int]] = [(root, 0) for root in roots]
    while stack:
        value, depth = stack.pop()
        if id(value) in seen or depth > MAX_DEPTH:
            continue
        seen.add(id(value))
        if isinstance(value, (torch.nn.Module, torch.optim.Optimizer)):
            yield value
            continue
        if _stateful(value):
            yield value  # a learning-rate scheduler or a gradient scaler, say; its optimizer is reached through it
        stack.extend((child, depth + 1) for _, child in references(value))


def _stateful(value: object) -> bool:
    """Return whether ``value`` keeps training state of its own (it saves and loads a ``state_dict``)."""
    return (
        not isinstance(value, type)
        and callable(getattr(value, "state_dict", None))
        and callable(getattr(value, "load_state_dict", None))
        and isinstance(getattr(value, "__dict__", None), dict)
    )


def call_references(fn: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """Return what one call of ``fn`` holds directly, labelled, in the order a message should name them.

    A ``functools.partial`` is looked through to the function it wraps.

    Args:
        fn (Any): the callable.
        args (tuple): its positional arguments.
        kwargs (Mapping[str, Any]): its keyword arguments.

    Returns:
        list of tuple: ``(label, value)`` pairs: ``("the step", fn)``; ``("self",
        object)`` if it is bound to one; ``("argument 0", value)``, ... for the
        positional arguments; ``("argument 'name'", value)`` for the keyword
        ones; then, for a Python function or method, the variables it closes
        over and the globals its code names (sorted), each labelled with the
        ``repr`` of its name (``"'model'"``).
    """
    found: list[tuple[str, Any]] = [("the step", fn)]
    target: Any = fn.func if isinstance(fn, functools.partial) else fn
    owner = getattr(target, "__self__", None)
    if owner is not None:
        found.append(("self", owner))
    found += [(f"argument {index}", value) for index, value in enumerate(args)]
    found += [(f"argument {name!r}", value) for name, value in kwargs.items()]
    function = getattr(target, "__func__", target)
    if isinstance(function, types.FunctionType):
        found += [(repr(name), value) for name, value in _code_references(function)]
    return found


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
