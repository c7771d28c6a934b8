"""Test helpers that reach into PyTorch's dispatch: CUDA's autocast without CUDA, and the operators a run calls."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from koila_retry.testing import make_oom


@contextlib.contextmanager
def cuda_autocast(dtype: torch.dtype = torch.float16) -> Iterator[None]:
    """CUDA's autocast state, switched on directly (``torch.autocast("cuda")`` switches itself off without CUDA)."""
    enabled, previous = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", previous)


class Operators(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Record the name of every operator that runs while the mode is active."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.seen.add(func._schema.name)
        return func(*args, **(kwargs or {}))


class FailCombining(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Run out of memory at the first operator of ``accumulate`` combining its micro-batches' results."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.failed = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        frame = sys._getframe(1)
        while frame is not None and not self.failed:
            if frame.f_code.co_name == "_combined":
                self.failed = True
                raise make_oom(nbytes=16)
            frame = frame.f_back
        return func(*args, **(kwargs or {}))


class FailCast(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Run out of memory at the ``at``-th cast to ``dtype`` (from 1): a comm hook compressing a bucket, say."""

    def __init__(self, dtype: torch.dtype, at: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.dtype, self.at, self.seen = dtype, at, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == self.dtype:
            self.seen += 1
            if self.seen == self.at:
                raise make_oom(nbytes=16)
        return func(*args, **kwargs)
