"""Layers that run out of memory on purpose, shared by the tests of one process and of many."""

from __future__ import annotations

from typing import Any

import torch

from koila_retry.testing import make_oom


class OOMInBackward(torch.autograd.Function):
    """The identity, whose backward runs out of memory."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise make_oom()
