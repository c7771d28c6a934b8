"""A trainer's step whose batch ``accumulate`` cannot split, run whole through ``accumulate`` over one row.

A batch whose tensors do not share their rows (a vision-language model's ``pixel_values``, a row per
image patch) or that is a class of the user's own yields no micro-batch. The trainer integrations run
such a step whole, as the trainer runs it, but through ``accumulate`` over a one-row stand-in of its
own: its gradients are kept as any step's, the ranks of a job agree on it, and an out-of-memory error
gives up saying what to change, where the split would have raised ``Split``'s error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from koila_retry._common.batches import Split
from koila_retry._frontends.batch import Batched
from koila_retry.exceptions import BatchSizeExhausted

__all__ = ["Whole", "unsplittable"]


def unsplittable(args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> str | None:
    """Return why ``accumulate`` cannot split a call given ``args`` and ``kwargs``, or None where it can."""
    try:
        Split(args, kwargs, 0, name)
    except (TypeError, ValueError) as error:
        return str(error)
    return None


class Whole:
    """Run ``step`` whole through ``accumulate`` (as ``decorate`` makes it), named ``name``, for ``tool``."""

    def __init__(
        self, step: Callable[..., Any], name: str, decorate: Callable[..., Batched[..., Any]], tool: str, advice: str
    ) -> None:
        self.name, self.tool, self.advice = name, tool, advice  # how a user makes a batch the tool can split
        self.held: tuple[tuple[Any, ...], dict[str, Any]] | None = None  # the step's arguments, while it runs
        self.stand_in: torch.Tensor | None = None

        def whole(stand_in: torch.Tensor) -> Any:
            args, kwargs = self.held or ((), {})
            return step(*args, **kwargs)

        whole.__qualname__ = whole.__name__ = name
        self.run = decorate(whole)

    def __call__(
        self, device: torch.device, batch: Any, args: tuple[Any, ...], kwargs: dict[str, Any], reason: str
    ) -> Any:
        """Run the step on ``args``; on giving up, raise :class:`BatchSizeExhausted` that says why it ran whole."""
        if self.stand_in is None or self.stand_in.device != device:
            with torch.inference_mode(False):  # made in an evaluation loop, kept for training steps too
                self.stand_in = torch.zeros(1, device=device)  # the one row accumulate sees
        self.held = (args, kwargs)
        try:
            return self.run(self.stand_in)
        except BatchSizeExhausted as error:
            tool = self.tool
            message = (
                f"{tool} cannot split the batch of {self.name}, a {type(batch).__qualname__}: {reason}. It ran "
                f"whole, as without {tool}, and ran out of memory. To let {tool} run it in micro-batches, "
                f"{self.advice} (see the docs: Batches, which tensors are split)."
                if reason
                else f"The batch of {self.name} has 0 rows: {tool} ran it whole, as without {tool}, and it ran out "
                "of memory."
            )
            raise BatchSizeExhausted(
                f"{message}\n{error}", batch_size=error.batch_size, attempts=error.attempts, diagnosis=error.diagnosis
            ) from error
        finally:
            self.held = None
