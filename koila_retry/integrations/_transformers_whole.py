"""Hugging Face: a batch ``accumulate`` cannot split, run whole, as the trainer runs it, under a one-row stand-in.

A vision-language model's batch (Qwen2-VL's ``pixel_values``, a row per image patch) holds tensors that do
not share their rows: no micro-batch can be cut from it. Such a step runs whole through ``accumulate`` over
one row of its own, so that its gradients are kept as any step's, the ranks of a job agree on it, and an
out-of-memory error gives up with what to change, where the split would have raised ``Split``'s error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from koila_retry._common.batches import Split
from koila_retry._frontends.accumulate import accumulator
from koila_retry.exceptions import BatchSizeExhausted

__all__ = ["Whole", "unsplittable"]


def unsplittable(*args: Any) -> str | None:
    """Return why ``accumulate`` cannot split a call given ``args``, or None where it can."""
    try:
        Split(args, {}, 0, "adapt")
    except (TypeError, ValueError) as error:
        return str(error)
    return None


class Whole:
    """Run a step's call whole through ``accumulate`` (its ``options``) over a one-row stand-in."""

    def __init__(self, step: Callable[..., Any], what: str, options: dict[str, Any]) -> None:
        self.what, self.held = what, ()

        def whole(stand_in: torch.Tensor) -> Any:
            return step(*self.held)

        whole.__qualname__ = getattr(step, "__qualname__", what)
        self.run = accumulator(**options)(whole)

    def __call__(self, reason: str, device: torch.device, *args: Any) -> Any:
        """Run ``step(*args)``; on giving up, raise :class:`BatchSizeExhausted` that says why it could not split."""
        self.held = args
        try:
            return self.run(torch.zeros(1, device=device))
        except BatchSizeExhausted as error:
            raise BatchSizeExhausted(
                f"adapt() cannot split the batch of the {self.what}: {reason}. It ran whole, as without adapt(), "
                "and ran out of memory. To let adapt() run it in micro-batches, make the batch's tensors share "
                "their rows along dim 0 (one entry per example), for instance in the data collator.\n"
                f"{error}",
                batch_size=error.batch_size,
                attempts=error.attempts,
                diagnosis=error.diagnosis,
            ) from error
        finally:
            self.held = ()
