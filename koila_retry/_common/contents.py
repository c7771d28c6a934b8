"""What a batch's containers hold, to put back after an attempt that may have changed them.

A step may change the batch it is given (``labels = batch.pop("labels")``, ``batch[0] = augment(batch[0])``):
an attempt that fails must not leave the retry a batch it changed. Where the retry's caller also sees the
batch (a trainer's later hooks), the containers are put back as they were, not copied. Putting back is
done as well as each container allows, and never raises: the error that ended the attempt is the one to
see (a ``ModelOutput`` refuses ``update``, a ``deque`` slices).
"""

from __future__ import annotations

from collections.abc import MutableMapping, MutableSequence
from typing import Any

import torch

__all__ = ["Contents"]

# A list longer than this is of values, one per row (strings, numbers): looked into only if its first item is not
# one (records, one dict, tuple or dataclass per row), whose every one is then taken.
_ITEMS = 16
_VALUES = (str, bytes, int, float, bool, type(None), torch.Tensor)
# Deeper than any batch is nested.
_DEPTH = 8
_MAPPING, _SEQUENCE, _ATTRIBUTES = 0, 1, 2
_MISSING = object()


class Contents:
    """The items of every mutable container in some values (lists, dicts, mappings, dataclasses), as they are now."""

    __slots__ = ("kept", "seen")

    def __init__(self, *values: Any) -> None:
        self.kept: list[tuple[Any, int, Any]] = []
        self.seen: set[int] = set()  # a container held in several places (a label map in every record) once
        for value in values:
            self._take(value, _DEPTH)
        self.seen = set()

    def _take(self, value: Any, depth: int) -> None:
        kind = type(value)
        if kind is torch.Tensor or kind is int or kind is str or depth == 0 or id(value) in self.seen:
            return
        self.seen.add(id(value))
        children: Any
        if kind is dict or (isinstance(value, MutableMapping) and kind is not list):
            items: Any = dict(value)
            self.kept.append((value, _MAPPING, items))
            children = list(items.values())
        elif kind is list or isinstance(value, MutableSequence):
            items = list(value)
            self.kept.append((value, _SEQUENCE, items))
            children = items
        elif isinstance(value, tuple):
            children = value
        elif hasattr(kind, "__dataclass_fields__") and isinstance(getattr(value, "__dict__", None), dict):
            items = dict(vars(value))
            self.kept.append((value, _ATTRIBUTES, items))
            children = list(items.values())
        else:
            return
        # Decided by its first item that is not None (a None may mark an ignored row's entry).
        if len(children) <= _ITEMS or not isinstance(next((c for c in children if c is not None), None), _VALUES):
            for child in children:
                self._take(child, depth - 1)

    def restore(self) -> None:
        """Put back the items of every container whose items changed; one that refuses is left as it is."""
        for container, kind, items in self.kept:
            try:
                if kind == _SEQUENCE:
                    _put_back_sequence(container, items)
                else:
                    _put_back_mapping(container if kind == _MAPPING else vars(container), items)
            except Exception:  # a container that cannot take its items back stays as the step left it
                continue


def _put_back_mapping(held: Any, items: dict[Any, Any]) -> None:
    if len(held) == len(items) and all(held.get(key, _MISSING) is value for key, value in items.items()):
        return
    if type(held) is dict:  # in its order; refilled even if a Ctrl-C comes between the two calls
        try:
            held.clear()
        finally:
            held.update(items)
        return
    try:
        if held.keys() != items.keys():  # every key again, in its order
            for key in list(held):
                del held[key]
    finally:
        for key, value in items.items():
            if held.get(key, _MISSING) is not value:
                held[key] = value


def _put_back_sequence(held: Any, items: list[Any]) -> None:
    if len(held) == len(items) and all(map(_same, held, items)):
        return
    try:
        held[:] = items
        return
    except TypeError:  # a deque takes no slices; an array, slices of arrays only
        pass
    try:
        try:
            del held[:]
        except TypeError:
            held.clear()
    finally:  # refilled even if a Ctrl-C comes after the clearing, and not where the clearing failed
        if not len(held):
            held.extend(items)


def _same(first: object, second: object) -> bool:
    return first is second
