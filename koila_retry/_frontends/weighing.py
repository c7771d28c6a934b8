"""How a split step's micro-batches are weighed, so that their losses add up to the whole batch's.

A mean loss's micro-batch weighs its share of the rows, or of the items ``weight=`` counts; a sum's weighs 1.
"""

from __future__ import annotations

import builtins
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch

from koila_retry._common.batches import Split
from koila_retry._common.places import levels_to_caller
from koila_retry._common.tensors import TensorBase
from koila_retry._common.warn import warn_or_log
from koila_retry._frontends.combine import describe

__all__ = ["Weighing"]


class Weighing:
    """The weights of one decorated step's micro-batches."""

    def __init__(self, name: str, mean: bool) -> None:
        self.name, self.mean = name, mean
        self.weight: Callable[..., Any] | None = None  # given by weight=: items per micro-batch
        self.warned_ignored = False
        self.split_steps = 0  # see warn_if_ignored

    def items(self, split: Split, first: int) -> tuple[float, float, bool]:
        """Return the items ``weight=`` counts in the batch and its ``first`` rows, and True; or rows, and False."""
        # The later micro-batches' sizes follow the first's measure: the rest is counted whole before.
        if self.weight is not None and first < split.rows:
            head = self._count_of(*split.chunk(0, first))
            total = math.fsum([head, self._count_of(*split.chunk(first, split.rows))])
            if total:
                return total, head, True
        return float(split.rows), float(min(first, split.rows)), False  # none counted (or whole): see weights

    def _count_of(self, args: Sequence[Any], kwargs: dict[str, Any]) -> float:
        return _count(self.weight(*args, **kwargs), self.name)  # type: ignore[misc]

    def weight_of(self, args: Sequence[Any], kwargs: dict[str, Any], rows: int, total: float, by_items: bool) -> float:
        """Return one micro-batch's weight: its share of the items (or rows) of a mean loss; 1 for a sum."""
        if not self.mean:
            return 1.0
        return (self._count_of(args, kwargs) if by_items else rows) / total

    def warn_if_ignored(self, split: Split) -> None:
        """Warn, once, that a split step of a mean loss over labels with ignored entries is weighed by rows."""
        self.split_steps += 1  # looked at in the 1st, 2nd, 4th, 8th... split attempt: each look is a GPU sync
        looks = self.split_steps & (self.split_steps - 1) == 0
        if looks and self.mean and not self.warned_ignored and _ignores_labels(split):
            self.warned_ignored = True
            # Usually in the retry that an out-of-memory error made: raised by a filter, it would end the recovery.
            warn_or_log(
                f"koila.accumulate split a step of {self.name} whose batch has labels with "
                "ignored entries (-100), and weighs its micro-batches by rows: that is exact only if every "
                "row counts as many items. For a loss that is a mean over tokens, pass weight= to "
                "koila.accumulate, such as weight=lambda batch: (batch['labels'][:, 1:] != -100).sum() for a causal "
                "language model (see the docs: Training Hugging Face models). Hugging Face's adapt() counts the "
                "items of a batch that is a mapping with its labels under 'labels', as the trainer counts them; "
                "Lightning's OOMRecovery weighs by rows only (see the docs: Trainers). This warning is shown once.",
                UserWarning,
                stacklevel=levels_to_caller(),
            )

    def weights(self, split: Split, size: int) -> list[float]:
        """Return each micro-batch's weight: its share of the items ``weight=`` counts, or of the rows."""
        rows = split.rows
        if self.weight is None:
            self.warn_if_ignored(split)
            return _row_weights(rows, size) if self.mean else [1.0] * -(-rows // size)
        counts = [self._count_of(args, kwargs) for args, kwargs, _ in split.pieces(size)]
        total = math.fsum(counts)
        if not total:
            # A mean over no items: whatever the whole batch's loss gives (nan, most often, and a gradient of
            # zeros or nan), each micro-batch's weighed by its rows gives too, whatever the memory.
            return _row_weights(rows, size)
        return [count / total for count in counts]


def _row_weights(rows: int, size: int) -> list[float]:
    """Return each micro-batch's share of the rows, in slices of ``size``."""
    return [min(size, rows - begin) / rows for begin in builtins.range(0, rows, size)]


def _count(value: Any, name: str) -> float:
    """Return what ``weight=`` returned as a number of items, or raise the error that says why not."""
    if isinstance(value, TensorBase) and value.numel() == 1 and not value.is_complex():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise ValueError(
            f"weight= returned {describe(value)} for a micro-batch of {name}; it must return how many items the "
            "micro-batch's loss averages over: a number >= 0 (an int or a float, numpy's too, or a one-element tensor)"
        )
    return float(value)


def _ignores_labels(split: Split) -> bool:
    """Return whether a tensor of integers the batch splits holds ignored entries (-100), as HF's losses skip."""
    # Anywhere in the batch, not only under a "labels" key: Lightning's (x, y) tuples, step(ids, labels). By
    # the least entry, which labels with -100 have: a mask of the batch's size would need memory the attempt
    # may not have (an error that smaller sizes would meet again).
    integers = (torch.int8, torch.int16, torch.int32, torch.int64)
    # Strided only: a sparse one (bag-of-words counts) has no amin, and its -100 entries would be values anyway.
    tensors = (split.tensors[index] for index in split.split)
    tensors = (t for t in tensors if t.layout is torch.strided and t.dtype in integers)
    return any(t.numel() and t.device.type != "meta" and int(t.amin()) == -100 for t in tensors)
