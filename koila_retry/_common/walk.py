"""Walk the objects a call can reach, and read a running frame's variables without keeping them alive."""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import itertools
import reprlib
import sys
import types
import weakref
from collections.abc import Iterable, Iterator, Mapping
from types import FrameType
from typing import Any

import torch

__all__ = [
    "MAX_DEPTH",
    "MAX_ITEMS",
    "FrameValues",
    "call_references",
    "frame_locals",
    "global_names",
    "reachable",
    "references",
    "slots_of",
    "trainable_module",
]

# Models and optimizers sit a few references from a call (a closure's trainer's model);
# past this, a walk would wander into whole libraries' state.
MAX_DEPTH = 6
# A container's first items are looked at: one that holds modules holds them all alike.
MAX_ITEMS = 1000

# Nothing inside these is training state, and some (modules, classes) lead everywhere.
_LEAVES = (types.ModuleType, type, torch.Tensor, str, bytes, int, float, complex, bool, type(None), torch.dtype)
# Mapping keys that name their values cheaply; any other key's repr could print a tensor's values or run user code.
# They are shortened (reprlib): a cache keyed by prompts would print each prompt.
_PLAIN_KEYS = (str, int)

# Before Python 3.13 (PEP 667), reading ``f_locals`` of a function's frame copies its
# variables into a dict that the frame keeps until it returns: a tensor the function
# deletes afterwards would stay alive through it.
_SNAPSHOTS = sys.version_info < (3, 13)
# The references to a snapshot that nobody else holds, as frame_locals counts them: the
# frame's own, frame_locals' variable and sys.getrefcount's argument.
_UNSHARED = 3


def global_names(code: types.CodeType) -> set[str]:
    """Return the ``co_names`` of a code object and of the code nested in it (lambdas, comprehensions)."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= global_names(constant)
    return names


def references(value: Any) -> list[tuple[str, Any]]:
    """Return the objects ``value`` refers to directly, as ``(name it knows it by, object)`` pairs."""
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
    if _is_mapping(value):
        return [
            (f"[{reprlib.repr(key)}]" if type(key) in _PLAIN_KEYS else f"values()[{index}]", item)
            for index, (key, item) in enumerate(itertools.islice(value.items(), MAX_ITEMS))
        ]
    attributes = getattr(value, "__dict__", None)
    found = list(attributes.items()) if isinstance(attributes, dict) else []
    # And those in __slots__ (a dataclass(slots=True) holding the model, probe 75B), each read as its slot.
    for name, slot in slots_of(type(value)):
        with contextlib.suppress(AttributeError):  # not set
            found.append((name, slot.__get__(value)))
    if not found and not isinstance(attributes, dict):
        return found
    call = vars(type(value)).get("__call__")  # a callable object's own code names globals too
    if isinstance(call, types.FunctionType):
        found.append(("__call__", call))
    return found


# Weakly: a class made for one object (a wrapper's, a parametrized module's) goes with it.
_SLOTS: weakref.WeakKeyDictionary[type, tuple[tuple[str, Any], ...]] = weakref.WeakKeyDictionary()


def slots_of(kind: type) -> tuple[tuple[str, Any], ...]:
    """Return the slots of ``kind``'s instances: each as declared, with its descriptor (named as stored)."""
    try:
        return _SLOTS[kind]
    except KeyError:
        _SLOTS[kind] = found = _slots_found(kind)
        return found
    except TypeError:  # a class that cannot be hashed (its metaclass's __eq__ without __hash__): not kept
        return _slots_found(kind)


def _slots_found(kind: type) -> tuple[tuple[str, Any], ...]:
    found = []
    for klass in kind.__mro__:
        names = vars(klass).get("__slots__", ())
        for name in (names,) if isinstance(names, str) else names:
            slot = vars(klass).get(_mangled(klass, name)) if isinstance(name, str) else None
            if type(slot) is types.MemberDescriptorType:  # not __dict__ or __weakref__
                found.append((name, slot))
    return tuple(found)


def _is_mapping(value: Any) -> bool:
    """Return whether ``value`` is a Mapping; not for a class that cannot be hashed, which ABC checks hash."""
    try:
        return isinstance(value, Mapping)
    except TypeError:  # its metaclass's __eq__ without __hash__ (probe 75H): a Mapping registers its classes
        return False


def _mangled(klass: type, name: str) -> str:
    """Return a private slot's attribute name (``__x`` of ``C`` is ``_C__x``)."""
    if name.startswith("__") and not name.endswith("__"):
        return f"_{klass.__name__.lstrip('_')}{name}"
    return name


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


def reachable(roots: Iterable[Any], budget: int | None = None) -> Iterator[Any]:
    """Yield once each module, optimizer and other stateful object reachable from ``roots``, not looking inside them.

    Nearest first, so that an object is reached by its shortest path and ``MAX_DEPTH`` counts along it. With
    ``budget``, the walk looks at that many references at most, and yields what it reached by then.
    """
    seen: set[int] = set()
    queue = collections.deque((root, 0) for root in roots)
    left = sys.maxsize if budget is None else budget
    while queue:
        value, depth = queue.popleft()
        if id(value) in seen or type(value) in weakref.ProxyTypes:
            continue  # a proxy (Lightning's of its module) passes isinstance as its referent, by another id and name
        seen.add(id(value))
        if isinstance(value, (torch.nn.Module, torch.optim.Optimizer)):
            yield value
            continue
        if _stateful(value):
            yield value  # a learning-rate scheduler or a gradient scaler, say; its optimizer is reached through it
        if depth == MAX_DEPTH or left <= 0:
            continue
        children = list(itertools.islice(_children(value), left))
        left -= len(children)
        # Leaves are left out before they are queued: a tokenized dataset held as lists is millions of ints.
        queue.extend((child, depth + 1) for child in children if not isinstance(child, _LEAVES))


def _children(value: Any) -> Iterable[Any]:
    """Return what ``value`` refers to, as ``references`` does, without naming it: plain containers cheaply."""
    if type(value) in (list, tuple, set, frozenset):
        return itertools.islice(value, MAX_ITEMS)
    if type(value) is dict:
        return itertools.islice(value.values(), MAX_ITEMS)
    return [child for _, child in references(value)]


def _stateful(value: object) -> bool:
    """Return whether ``value`` keeps training state of its own (it saves and loads a ``state_dict``)."""
    return (
        not isinstance(value, type)
        # The class's methods: an instance's __getattr__ (an AttrDict's) may raise anything.
        and callable(getattr(type(value), "state_dict", None))
        and callable(getattr(type(value), "load_state_dict", None))
        and isinstance(getattr(value, "__dict__", None), dict)
    )


def call_references(fn: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """Return what one call of ``fn`` holds directly, as ``(label, value)`` pairs in the order a message names them."""
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
    """Return the variables of ``frame`` as ``(name, value)`` pairs, leaving no copy behind in the frame."""
    variables = frame.f_locals
    items = list(variables.items())
    # A function's snapshot, not its namespace (which a module's or class body's is), and one
    # that only the frame holds: it is also the dict locals() returned, so one the user holds
    # (or a debugger does) must keep its contents, which the read refreshed as any would.
    if _SNAPSHOTS and frame.f_code.co_flags & inspect.CO_OPTIMIZED and sys.getrefcount(variables) <= _UNSHARED:
        variables.clear()
    return items


class FrameValues:
    """The values of a frame's variables, read afresh each time they are iterated: none is kept between reads."""

    __slots__ = ("frame",)

    def __init__(self, frame: FrameType) -> None:
        self.frame = frame

    def __iter__(self) -> Iterator[Any]:
        return iter([value for _, value in frame_locals(self.frame)])


def trainable_module(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Name a module with parameters requiring grad that the step reaches (its self, arguments, closure, globals)."""
    # Not inside a dict or list there: which of the models held so the step uses is not known.
    for label, value in call_references(fn, args, kwargs):
        if isinstance(value, torch.nn.Module) and any(p.requires_grad for p in value.parameters()):
            return f"the module {label} ({type(value).__name__})"
    return None
