"""The gradients of leaves a plan does not look after, in a step over DDP or FSDP2 modules, and in the trainers'.

A step over DDP or FSDP2 modules writes its parameters' gradients into ``.grad`` with a plain backward,
whose hooks reduce them; the plan sets those aside. What else the backward writes is found here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from koila_retry._common.tensors import set_grads
from koila_retry._frontends.gradients import Gradients, summed

__all__ = ["OtherLeaves", "added_back"]


def added_back(leaves: Sequence[torch.Tensor], before: Sequence[torch.Tensor | None]) -> None:
    """Add the gradients ``leaves`` had before a backward into what it wrote, in the tensors they were."""
    olds, news = [], []
    for leaf, old in zip(leaves, before, strict=True):
        new = leaf.grad
        if old is None:
            continue
        leaf.grad = old  # the same tensor as before, as a backward adds into it
        if new is not None:
            olds.append(old)
            news.append(new)
    if olds:
        mode = torch.is_grad_enabled()
        try:  # not torch.no_grad(): an interrupt in its Python could leave grad mode off (see summed)
            torch._C._set_grad_enabled(False)
            torch._foreach_add_(olds, news)
        finally:
            torch._C._set_grad_enabled(mode)


class OtherLeaves:
    """The leaves a plain backward writes besides those a plan looks after: found by a walk, set aside as first seen.

    A step over DDP or FSDP2 modules sets aside their parameters' gradients; an argument or a
    tensor of the step's own that needs a gradient is found in each micro-batch's graph instead.
    """

    __slots__ = ("aside", "known", "owned", "walker")

    def __init__(self, owned: Callable[[], set[int]]) -> None:
        # Asked once a graph has been made: FSDP2 makes its unsharded parameters in the first forward.
        self.owned = owned
        self.known: set[int] | None = None
        self.walker: Gradients | None = None  # made at the first walk: a trainer's step may make none
        self.aside: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def see(self, loss: torch.Tensor) -> list[torch.Tensor]:
        """Before a backward of ``loss``: set aside the gradient of each leaf it writes that nothing looks after yet.

        Returns:
            list[torch.Tensor]: every leaf the backward writes, those looked after included.
        """
        aside, known = self.aside, self.known
        walker = self.walker
        if walker is None:
            walker = self.walker = Gradients()
        leaves = walker.reached(loss)
        for leaf in leaves:
            key = id(leaf)
            if key in aside:
                continue
            if known is None:
                known = self.known = self.owned()
            if key not in known:
                aside[key] = (leaf, leaf.grad)
                leaf.grad = None
        return leaves

    def found(self) -> bool:
        """Return whether a walk found any leaf that nothing else looks after."""
        return bool(self.aside)

    def written(self) -> list[torch.Tensor]:
        """Return the gradients written into those leaves since they were set aside."""
        return [leaf.grad for leaf, _ in self.aside.values() if leaf.grad is not None]

    def taken(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Return the leaves a step wrote and what it wrote, each leaf given back the gradient it had before."""
        leaves, written = [], []
        for leaf, before in self.aside.values():
            if leaf.grad is not None:
                leaves.append(leaf)
                written.append(leaf.grad)
            leaf.grad = before
        self.aside = {}
        return leaves, written

    def undo(self) -> None:
        """After an attempt that failed: drop what it wrote."""
        set_grads((leaf, None) for leaf, _ in self.aside.values())

    def restore(self) -> None:
        """After the step: add the gradients set aside back into what it wrote, as a backward adds into ``.grad``."""
        set_grads((leaf, summed(before, leaf.grad)) for leaf, before in self.aside.values() if before is not None)
        self.aside = {}

    def give_back(self) -> None:
        """After a step that raised: the gradients set aside, as they were."""
        set_grads(self.aside.values())
        self.aside = {}
