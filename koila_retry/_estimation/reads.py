"""Reads of a meta tensor's values that never reach the estimate's dispatch mode, answered with placeholders.

``.item()`` and ``if t:`` reach the dispatch mode (``Recorder.placeholder``); ``tolist()``,
``numpy()``, formatting, ``torch.equal`` and ``torch.allclose`` read below every mode or
refuse meta tensors. :class:`ValueReads` answers them from the function mode the estimating
thread has already (``lending.Swapping``): values read as their tensor's placeholder, and a
comparison of whole tensors as what such a check usually finds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["READS", "Placeholder", "ValueReads"]

#: Reads a placeholder for the values of a tensor and notes the read: ``Recorder.placeholder``.
Placeholder = Callable[[torch.Tensor], "bool | int | float"]


class ValueReads:
    """Answer ``tolist()``, ``numpy()``, formatting, ``torch.equal`` and ``torch.allclose`` of meta tensors."""

    def __init__(self, placeholder: Placeholder) -> None:
        self.placeholder = placeholder

    def __call__(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run ``func``, one of :data:`READS`, from a function mode: from placeholders where it reads a meta tensor."""
        read = _READS[func]
        if any(isinstance(arg, torch.Tensor) and arg.is_meta for arg in args[:2]):
            return read(self, *args, **kwargs)
        # Real tensors the call reaches (a constant in a closure) hold values: read them, past
        # the estimate's dispatch mode, which would read them through meta copies.
        with torch._C._DisableTorchDispatch():
            return func(*args, **kwargs)

    def tolist(self, tensor: torch.Tensor) -> Any:
        """Return ``tensor.tolist()`` with every value the placeholder; an empty tensor reads nothing."""
        value = self._value(tensor) if tensor.numel() else None
        return _nested(tuple(tensor.shape), value)

    def numpy(self, tensor: torch.Tensor, *, force: bool = False) -> Any:
        """Return ``tensor.numpy()`` filled with the placeholder, or raise what the real call raises."""
        # PyTorch's own conversion of an empty CPU tensor like this one, outside every mode,
        # refuses what it refuses (a tensor that requires grad, bfloat16, no NumPy) with its
        # own errors, and gives the array's dtype otherwise.
        with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
            like = torch.empty(0, dtype=tensor.dtype, device="cpu", requires_grad=tensor.requires_grad)
            dtype = like.numpy(force=force).dtype
        import numpy  # there: the conversion above needs it

        value = self._value(tensor) if tensor.numel() else 0
        return numpy.full(tuple(tensor.shape), value, dtype=dtype)

    def array(self, tensor: torch.Tensor, dtype: Any = None) -> Any:
        """Return ``numpy.asarray(tensor, dtype)``, as ``Tensor.__array__`` makes it."""
        values = self.numpy(tensor)
        return values if dtype is None else values.astype(dtype, copy=False)

    def format(self, tensor: torch.Tensor, spec: str) -> str:
        """Return ``format(tensor, spec)``: a scalar formats its placeholder, as it formats its ``.item()``."""
        if tensor.dim() == 0 and type(tensor) is torch.Tensor:
            return format(self._value(tensor), spec)
        return object.__format__(tensor, spec)

    def equal(self, first: torch.Tensor, second: torch.Tensor) -> bool:
        """Return ``torch.equal``: ``False`` for other shapes, else what ``(first == second).all()`` reads."""
        if first.shape != second.shape:
            return False  # known without a value
        # Through the modes below this one, to the estimate's dispatch mode: the comparison
        # is counted as on CUDA, where torch.equal makes it, and its read answered there.
        return bool((first == second).all())

    def allclose(
        self,
        first: torch.Tensor,
        second: torch.Tensor,
        rtol: float = 1e-05,
        atol: float = 1e-08,
        equal_nan: bool = False,
    ) -> bool:
        """Return ``torch.allclose`` as PyTorch defines it: ``isclose(...).all()``, read."""
        return bool(torch.isclose(first, second, rtol=rtol, atol=atol, equal_nan=equal_nan).all())

    def _value(self, tensor: torch.Tensor) -> bool | int | float | complex:
        value = self.placeholder(tensor)
        return complex(value) if tensor.dtype.is_complex else value


def _nested(shape: tuple[int, ...], value: Any) -> Any:
    return value if not shape else [_nested(shape[1:], value) for _ in range(shape[0])]


_READS: dict[Any, Callable[..., Any]] = {
    torch.Tensor.tolist: ValueReads.tolist,
    torch.Tensor.numpy: ValueReads.numpy,
    torch.Tensor.__array__: ValueReads.array,
    torch.Tensor.__format__: ValueReads.format,
    torch.equal: ValueReads.equal,
    torch.Tensor.equal: ValueReads.equal,
    torch.allclose: ValueReads.allclose,
    torch.Tensor.allclose: ValueReads.allclose,
}
#: The torch functions :class:`ValueReads` answers.
READS = frozenset(_READS)
