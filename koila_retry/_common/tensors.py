"""Tensor checks more than one module needs: what is a tensor, where it lies, which tensors a value holds."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

__all__ = ["TensorBase", "named_tensors_in", "same_device", "set_grads", "tensors_in", "zeroed"]

# isinstance against torch.Tensor goes through its metaclass's __instancecheck__ (about
# 0.3 us for each non-tensor argument); its C base class answers the same question directly.
TensorBase = torch._C.TensorBase


def same_device(device: torch.device, target: torch.device) -> bool:
    """Return whether ``device`` is ``target``, where a device without an index matches any index of its type."""
    if device.type != target.type:
        return False
    return device.index is None or target.index is None or device.index == target.index


def tensors_in(tree: Any) -> Iterator[torch.Tensor]:
    """Yield the tensors of an operator's arguments or result: flat, in lists and tuples, or a dict's values."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (tuple, list)):
        for item in tree:
            if isinstance(item, torch.Tensor):
                yield item
            elif isinstance(item, (tuple, list)):
                yield from tensors_in(item)
    elif isinstance(tree, dict):
        yield from tensors_in(list(tree.values()))


def named_tensors_in(
    value: Any, where: str = "", within: frozenset[int] = frozenset()
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the tensors in nested dicts, lists and tuples, with their paths (LBFGS keeps lists)."""
    if isinstance(value, torch.Tensor):
        yield where, value
    elif id(value) in within:  # a container inside itself
        return
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from named_tensors_in(item, f"{where}[{key!r}]", within | {id(value)})
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from named_tensors_in(item, f"{where}[{index}]", within | {id(value)})


def set_grads(pairs: Iterable[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
    """Give each leaf its gradient; the gradients replaced are freed once every one is given, not in the setter.

    Freed inside ``.grad``'s setter, a gradient is destroyed while Python code the freeing runs (a finalizer,
    another thread's step reading that ``.grad`` for its diagnosis) may read it: a crash (probes 75F, 75G).
    """
    replaced = []
    for leaf, gradient in pairs:
        replaced.append(leaf.grad)
        leaf.grad = gradient
    del replaced


@contextlib.contextmanager
def zeroed(leaves: Sequence[torch.Tensor]) -> Iterator[None]:
    """Make every gradient that a backward in the block writes into ``leaves`` zeros, whatever it computed."""
    once = {id(leaf): leaf for leaf in leaves if leaf.requires_grad}.values()
    handles = [leaf.register_hook(torch.zeros_like) for leaf in once]  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
