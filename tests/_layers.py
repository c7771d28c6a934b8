"""Layers that run out of memory on purpose, shared by the tests of one process and of many."""

from __future__ import annotations

import weakref
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


class Recompute(torch.autograd.Function):
    """A checkpoint written by hand (as DeepSpeed's and fairscale's): the backward runs the block again, and its own."""

    @staticmethod
    def forward(ctx: Any, run: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        ctx.run = run
        ctx.save_for_backward(x)
        with torch.no_grad():
            return run(x)  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor | None]:
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            out = ctx.run(x)
        torch.autograd.backward(out, grad)  # writes the block's .grad, which no walk of the graph finds
        return None, x.grad


class CheckpointedMiddle(torch.nn.Sequential):
    """Three blocks, the middle one under a reentrant checkpoint: around itself (``"module"``), around a closure
    that calls it (``"closure"``), or :class:`Recompute` (``"function"``). Each backward of it is one of its own."""

    def __init__(self, mode: str) -> None:
        torch.manual_seed(0)
        super().__init__(
            torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh()),
            torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()),
            torch.nn.Linear(8, 1),
        )
        self.mode = mode
        self.to(torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        x = self[0](x)
        middle = self[1]
        if self.mode == "module":
            x = checkpoint(middle, x, use_reentrant=True)
        elif self.mode == "closure":
            x = checkpoint(lambda h: middle(h), x, use_reentrant=True)
        else:
            x = Recompute.apply(middle, x)
        return self[2](x)  # type: ignore[no-any-return]


class Marker:
    """An object only a graph's node holds, to tell by a weak reference whether the graph is alive."""


class Marked(torch.autograd.Function):
    """The identity, whose node holds a marker: alive as long as a graph through it is, after its backward too."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, marker: Marker) -> torch.Tensor:
        ctx.marker = marker
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class SelfHooked(torch.nn.Module):
    """A linear layer whose forward hook is a bound method of its own: the hook refers back to the module."""

    def __init__(self, width: int, out: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, out)
        self.register_forward_hook(self.on_forward)

    def on_forward(self, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear(x)
        return out


class WatchFreed(torch.autograd.Function):
    """The identity, whose backward fails once the gradients of ``params`` are written, watching them freed.

    When each is freed, ``freed`` gets whether every other one's ``.grad`` was let go of by then (its own is
    not read: inside its setter, that read is the crash the watch is about).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, params: list[torch.Tensor], freed: list[bool], error: str = "oom") -> Any:
        ctx.params, ctx.freed, ctx.error = params, freed, error
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        params, freed = ctx.params, ctx.freed
        for param in params:
            if param.grad is not None:  # written by this failed backward, freed when it is dropped
                others = [other for other in params if other is not param]
                weakref.finalize(param.grad, lambda others=others: freed.append(all(p.grad is None for p in others)))
        raise make_oom() if ctx.error == "oom" else RuntimeError("a hook of the user's")
