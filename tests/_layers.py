"""Layers that run out of memory on purpose, shared by the tests of one process and of many."""

from __future__ import annotations

from typing import Any

import torch

from koila_retry.testing import make_oom


class RaiseInBackward(torch.autograd.Function):
    """The identity, whose backward raises an error of its own (not about memory)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("the backward's own error")


class OOMInBackward(torch.autograd.Function):
    """The identity, whose backward runs out of memory."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise make_oom()


class Inject(torch.nn.Module):
    """An identity layer that runs out of memory, in forward or in backward, on chosen forward calls (from 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.failures: dict[int, str] = {}
        self.rows: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        call = len(self.rows)
        self.rows.append(x.shape[0])
        where = self.failures.get(call)
        if where == "forward":
            raise make_oom()
        if where == "backward":
            return OOMInBackward.apply(x)
        return x
