"""Results as trees: ``torch.utils._pytree``, taught the tuple subclasses it leaves whole.

pytree takes a tuple subclass other than a named tuple or struct sequence for a leaf: a
``class Pair(tuple)`` in a result could not be joined. Such a tuple is wrapped, before pytree
sees it, in a node type registered here, which unflattens to the user's type, remade the way
:mod:`koila_retry._common.batches` remakes the arguments' tuples.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch.utils._pytree import (
    KeyPath,
    SequenceKey,
    TreeSpec,
    register_pytree_node,
    tree_flatten,
    tree_flatten_with_path,
    tree_leaves,
    tree_unflatten,
)

from koila_retry._common.batches import CONSTRUCTED, faithful, remake, state_of, tuple_remaking
from koila_retry._common.tensors import TensorBase

__all__ = ["flatten", "flatten_with_path", "in_order", "strings", "structure"]


class _Remade:
    """How a tuple subclass in a result is remade: the context of its node in a ``TreeSpec``."""

    __slots__ = ("cls", "how", "state")

    def __init__(self, cls: type, how: int, state: dict[str, Any] | None) -> None:
        self.cls, self.how, self.state = cls, how, state

    def __eq__(self, other: object) -> bool:
        # The attributes, kept from the first piece's result, must not make the pieces' structures differ.
        return isinstance(other, _Remade) and self.cls is other.cls and self.how == other.how

    def __hash__(self) -> int:
        return hash((self.cls, self.how))

    def __repr__(self) -> str:
        return self.cls.__qualname__


class _Lifted:
    """A tuple subclass of a result, as a node that pytree takes apart."""

    __slots__ = ("context", "items")

    def __init__(self, items: list[Any], context: _Remade) -> None:
        self.items, self.context = items, context


def _flatten(node: _Lifted) -> tuple[list[Any], _Remade]:
    return node.items, node.context


def _flatten_with_keys(node: _Lifted) -> tuple[list[tuple[SequenceKey[Any], Any]], _Remade]:
    return [(SequenceKey(index), item) for index, item in enumerate(node.items)], node.context


def _unflatten(children: Any, context: _Remade) -> Any:
    items = list(children)
    new = remake(context.cls, context.how, items, context.state)
    if context.how in CONSTRUCTED and not faithful(new, context.cls, items):
        raise TypeError(
            f"koila_retry remade the result's {context.cls.__qualname__} with its constructor, as it did the "
            "first piece's, and got back other items than it gave: the constructor treats these items differently"
        )
    return new


register_pytree_node(
    _Lifted,
    _flatten,
    _unflatten,
    flatten_with_keys_fn=_flatten_with_keys,  # type: ignore[arg-type]
    serialized_type_name="koila_retry._common.results._Lifted",
)


def _lifted(result: Any, whole: Callable[[Any], bool] | None) -> Any:
    """Return ``result`` with each tuple subclass pytree leaves whole wrapped as a node, if it can be remade."""
    leaves, spec = tree_flatten(result, is_leaf=whole)
    # The usual result holds no such tuple, and is flattened once.
    if not any(isinstance(leaf, tuple) for leaf in leaves):
        return result
    return tree_unflatten([_lift(leaf, whole) for leaf in leaves], spec)


def _lift(leaf: Any, whole: Callable[[Any], bool] | None) -> Any:
    if not isinstance(leaf, tuple) or type(leaf) is tuple:  # a plain tuple is a leaf only where ``whole`` says
        return leaf
    how = tuple_remaking(leaf)
    if how is None:  # left a leaf: the front end says it cannot join it
        return leaf
    return _Lifted([_lifted(item, whole) for item in leaf], _Remade(type(leaf), how, state_of(leaf, how)))


def strings(value: Any) -> bool:
    """Return whether ``value`` is a list of strings, which a front end may join: one per row.

    Some, or all, may be ``None`` (a name missing), and the items may be such lists themselves (a row's
    labels or tokens, empty or not).
    """
    if type(value) is not list or not value:
        return False
    for item in value:
        if type(item) is list:
            if item and not strings(item):
                return False
        elif type(item) is not str and item is not None:
            return False
    return True


def _values(value: Any) -> bool:
    """Return whether ``value`` is a list or tuple that holds no tensor, which a front end takes whole.

    Strings, or numbers (``.tolist()``'s): whatever their number, one piece's structure is every piece's.
    """
    if type(value) not in (list, tuple) or not value:
        return False
    return strings(value) or (_tensor_free(value) and _holds_a_value(value))


def _tensor_free(value: Any) -> bool:
    """Return whether a list, tuple or mapping holds no tensor, at any depth; stop at the first it holds."""
    for item in value.values() if isinstance(value, Mapping) else value:
        if type(item) in _SCALARS:
            continue
        if isinstance(item, TensorBase):
            return False
        if isinstance(item, (tuple, list, Mapping)):  # tuple subclasses too, which pytree leaves whole
            if not _tensor_free(item):
                return False
        else:  # a type registered with pytree may hold tensors
            inside = [leaf for leaf in tree_leaves(item) if leaf is not item]
            if inside and not _tensor_free(inside):
                return False
    return True


def _holds_a_value(value: Any) -> bool:
    """Return whether a list, tuple or mapping holds a value other than None: one of None alone keeps its shape."""
    for item in value.values() if isinstance(value, Mapping) else value:
        if isinstance(item, (tuple, list, Mapping)):
            if _holds_a_value(item):
                return True
        elif item is not None:
            return True
    return False


# The items of a result's lists that are values, not containers: one type lookup each.
_SCALARS = frozenset({int, float, complex, bool, str, bytes, type(None)})


def flatten(result: Any, strings: bool = False, values: bool = False) -> tuple[list[Any], TreeSpec]:
    """Return the leaves of a piece's result and its ``TreeSpec``, tuple subclasses taken apart.

    With ``strings``, a list of strings is one leaf; with ``values``, so is a list or tuple that holds
    no tensor (strings, numbers): the same structure whatever its length.
    """
    whole = _whole(strings, values)
    return tree_flatten(_lifted(result, whole), is_leaf=whole)


def flatten_with_path(result: Any, strings: bool = False, values: bool = False) -> list[tuple[KeyPath, Any]]:
    """Return the ``(path, leaf)`` pairs of a piece's result, in the order of :func:`flatten`."""
    whole = _whole(strings, values)
    return tree_flatten_with_path(_lifted(result, whole), is_leaf=whole)[0]


def _whole(strings_: bool, values: bool) -> Callable[[Any], bool] | None:
    # accumulate adds the numbers of a tuple across micro-batches (strings); chunked joins none (values).
    return _values if values else (strings if strings_ else None)


def structure(spec: TreeSpec | None) -> str:
    """Return a result's structure on one line for an error: ``None``, a value, or its containers of ``*``."""
    if spec is None:
        return "None"
    if spec.is_leaf():
        return "a value"
    return _shape(spec)


def _shape(spec: TreeSpec) -> str:
    if spec.is_leaf():
        return "*"
    # torch 2.13 deprecates children_specs for children(), which earlier releases lack.
    every = spec.children() if hasattr(spec, "children") else spec.children_specs
    children = [_shape(child) for child in every]
    kind, context = spec.type, spec.context
    if isinstance(context, _Remade):
        kind = context.cls
    if isinstance(context, list) and len(context) == len(children):  # a mapping's keys
        inside = ", ".join(f"{key!r}: {child}" for key, child in zip(context, children, strict=True))
        return "{" + inside + "}" if kind is dict else f"{kind.__name__}({{{inside}}})"
    inside = ", ".join(children)
    if kind is list:
        return f"[{inside}]"
    return f"({inside})" if kind is tuple else f"{kind.__name__}({inside})"


def in_order(spec: TreeSpec, first: TreeSpec) -> list[int] | None:
    """Return the indices of ``spec``'s leaves in ``first``'s order, if only the order of plain dicts' keys differs."""
    return _in_order(spec, first, 0)


def _in_order(spec: TreeSpec, first: TreeSpec, start: int) -> list[int] | None:
    """Return the indices of ``spec``'s leaves (from ``start``) in ``first``'s order, if only dicts' orders differ."""
    if spec.is_leaf() or first.is_leaf():
        return [start] if spec.is_leaf() and first.is_leaf() else None
    children, firsts = _children(spec), _children(first)
    if spec.type is not first.type or len(children) != len(firsts):
        return None
    starts = [start]
    for child in children[:-1]:
        starts.append(starts[-1] + child.num_leaves)
    if spec.type is dict:  # a plain dict's keys, in any order; an OrderedDict's order is part of it
        place = {key: index for index, key in enumerate(spec.context)}
        if any(key not in place for key in first.context):
            return None
        pairs = [(children[place[key]], starts[place[key]]) for key in first.context]
    elif spec.context != first.context:
        return None
    else:
        pairs = list(zip(children, starts, strict=True))
    order: list[int] = []
    for (child, begin), first_child in zip(pairs, firsts, strict=True):
        inside = _in_order(child, first_child, begin)
        if inside is None:
            return None
        order.extend(inside)
    return order


def _children(spec: TreeSpec) -> list[TreeSpec]:
    # torch 2.13 deprecates children_specs for children(), which earlier releases lack.
    return list(spec.children() if hasattr(spec, "children") else spec.children_specs)
