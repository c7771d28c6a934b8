"""A training step whose backward writes ``.grad`` directly, with what was there set aside meanwhile.

Steps over FSDP2 modules and over a DDP module that keeps its overlap run a plain backward, since
their hooks must see it write ``.grad``. Exactness then rests on this: the gradients from before the
call wait here, and the step's start from none, so a failed attempt's can be dropped whole.
"""

from __future__ import annotations

import torch

from koila_retry._common.tensors import set_grads

__all__ = ["SetAside"]


class SetAside:
    """The parameters' gradients from before a step, set aside while it runs and added back after it."""

    copies = False  # set aside copies, where the step's backward writes into the tensors .grad holds

    def __init__(self, parameters: list[torch.Tensor]) -> None:
        self.parameters = parameters
        self.aside: list[torch.Tensor | None] = []
        self.copied = False

    def before(self) -> None:
        """Set the gradients the parameters have aside, so that the step's start from none."""
        self.aside = [parameter.grad for parameter in self.parameters]
        self.copied = False
        for parameter in self.parameters:
            parameter.grad = None

    def copy(self) -> None:
        """Make the copies :attr:`copies` asks for, once: at the start of an attempt, before its first backward."""
        # Inside the attempt, not before it: a rank that runs out of memory for them fails an attempt the
        # ranks agree on, where before it, it would leave the others waiting in the attempt's collectives.
        # Until they are made, what is set aside is the tensors themselves, which no backward wrote yet.
        if self.copies and not self.copied:
            self.aside = [None if grad is None else grad.clone() for grad in self.aside]
            self.copied = True

    def accumulated(self) -> list[torch.Tensor]:
        """Return the leaves whose gradients this object looks after, which a backward accumulates into."""
        return list(self.parameters)

    def owned(self) -> set[int]:
        """Return the ids of :meth:`accumulated`'s leaves."""
        return {id(leaf) for leaf in self.accumulated()}

    def undo(self) -> None:
        """After an attempt that failed on some rank: drop its gradients."""
        set_grads((parameter, None) for parameter in self.parameters)

    def restore(self) -> None:
        """After the step: add the gradients set aside back, in place, as a backward adds into ``.grad``."""
        aside, self.aside = self.aside, []
        failed: BaseException | None = None
        for parameter, before in zip(self.parameters, aside, strict=True):
            if before is not None and parameter.grad is not None:
                try:
                    before.add_(parameter.grad)
                except RuntimeError as error:  # one that cannot be added into (an expanded one): as it was
                    failed = failed or error
        set_grads((parameter, before) for parameter, before in zip(self.parameters, aside) if before is not None)
        if failed is not None:  # after every other parameter got its own back (probe 75L)
            raise failed

    def give_back(self) -> None:
        """After a step that raised: the gradients set aside, as they were."""
        self.undo()
        aside, self.aside = self.aside, []
        for parameter, before in zip(self.parameters, aside, strict=True):
            parameter.grad = before
