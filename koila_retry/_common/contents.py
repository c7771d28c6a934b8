"""What a batch's containers hold, to put back after a run of the whole batch that may have changed them.

A step may change the batch it is given (``labels = batch.pop("labels")``, ``batch[0] = augment(batch[0])``):
an attempt that fails must not leave the retry a batch it changed. Where the retry's caller also sees the
batch (a trainer's later hooks), the containers are put back as they were, not copied.
"""

from __future__ import annotations

from collections.abc import MutableMapping, MutableSequence
from typing import Any

import torch

__all__ = ["Contents"]

# A list longer than this is of records, one per row (strings, dicts): its items are not looked into.
_ITEMS = 16
# Deeper than any batch is nested.
_DEPTH = 8
_MAPPING, _SEQUENCE, _ATTRIBUTES = 0, 1, 2


class Contents:
    """The items of every mutable container in some values (lists, dicts, mappings, dataclasses), as they are now."""

    __slots__ = ("kept",)

    def __init__(self, *values: Any) -> None:
        self.kept: list[tuple[Any, int, Any]] = []
        for value in values:
            self._take(value, _DEPTH)

    def _take(self, value: Any, depth: int) -> None:
        kind = type(value)
        if kind is torch.Tensor or kind is int or kind is str or depth == 0:
            return
        children: Any
        if kind is dict or (isinstance(value, MutableMapping) and kind is not list):
            items: Any = dict(value)
            self.kept.append((value, _MAPPING, items))
            children = items.values()
        elif kind is list or isinstance(value, MutableSequence):
            items = list(value)
            self.kept.append((value, _SEQUENCE, items))
            children = items
        elif isinstance(value, tuple):
            children = value
        elif hasattr(kind, "__dataclass_fields__") and isinstance(getattr(value, "__dict__", None), dict):
            items = dict(vars(value))
            self.kept.append((value, _ATTRIBUTES, items))
            children = items.values()
        else:
            return
        if len(children) <= _ITEMS:
            for child in children:
                self._take(child, depth - 1)

    def restore(self) -> None:
        """Put every container's items back as they were taken."""
        for container, kind, items in self.kept:
            if kind == _SEQUENCE:
                container[:] = items
            else:
                held = container if kind == _MAPPING else vars(container)
                held.clear()
                held.update(items)
