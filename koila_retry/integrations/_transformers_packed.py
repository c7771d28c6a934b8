"""Hugging Face: a packed batch's sequence boundaries, kept out of what ``accumulate`` splits.

``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` packs a batch into one row and adds
the boundaries of its sequences, ``cu_seq_lens_q`` and ``cu_seq_lens_k``, one entry per sequence
and one more. Being the only tensors with more than one row, they would be taken for the batch's
rows and cut, while every part ran the whole packed row with a part of its boundaries.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["apart", "joined"]

_BOUNDARIES = ("cu_seq_lens_q", "cu_seq_lens_k")


def apart(inputs: Any) -> tuple[Any, dict[str, Any]]:
    """Return ``inputs`` without a packed row's sequence boundaries, and those boundaries (empty if none)."""
    if not isinstance(inputs, Mapping) or not any(key in inputs for key in _BOUNDARIES):
        return inputs, {}
    rest = {key: value for key, value in inputs.items() if key not in _BOUNDARIES}
    # Only around one packed row: boundaries beside several rows cannot go whole to each part of them.
    if any(isinstance(value, torch.Tensor) and value.dim() and value.shape[0] != 1 for value in rest.values()):
        return inputs, {}
    return rest, {key: inputs[key] for key in _BOUNDARIES if key in inputs}


def joined(inputs: Any, boundaries: dict[str, Any]) -> Any:
    """Return the batch (or the part of it) ``inputs`` with the boundaries :func:`apart` took put back."""
    return {**inputs, **boundaries} if boundaries else inputs
