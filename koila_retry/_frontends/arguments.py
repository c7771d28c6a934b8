"""The arguments of one call whose tensors hold its rows: checked, and sliced into chunks."""

from __future__ import annotations

import builtins
from collections.abc import Iterator
from typing import Any, NoReturn

from koila_retry._common.tensors import TensorBase

__all__ = ["Split"]


class Split:
    """The tensor arguments of one call, checked, and their slices.

    ``front_end`` names the caller in errors; ``names`` are the function's positional
    parameters, when known, to name arguments by.
    """

    __slots__ = ("args", "device", "dim", "kwargs", "names", "positions", "rows", "sample")

    def __init__(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], dim: int, front_end: str, names: tuple[str, ...] = ()
    ) -> None:
        self.args, self.kwargs, self.dim = args, kwargs, dim
        # Every call pays for this: labels for errors are made only when one is raised.
        self.positions = [i for i, value in enumerate(args) if isinstance(value, TensorBase)]
        self.names = [name for name, value in kwargs.items() if isinstance(value, TensorBase)] if kwargs else []
        tensors = [args[i] for i in self.positions] + [kwargs[name] for name in self.names]
        if not tensors:
            raise ValueError(
                f"{front_end} splits tensor arguments along dim, and none of the arguments is a tensor "
                f"(got {[type(value).__name__ for value in (*args, *kwargs.values())]})"
            )
        sample = []
        rows = -1
        for tensor in tensors:
            shape = tensor.shape
            axis = dim + len(shape) if dim < 0 else dim
            if not 0 <= axis < len(shape) or (rows != shape[axis] and rows != -1):
                self._refuse(tensors, names)
            rows = shape[axis]
            sample.append((tuple(shape[:axis] + shape[axis + 1 :]), str(tensor.dtype)))
        self.rows = rows
        self.device = tensors[0].device
        self.sample = tuple(sample)

    def _refuse(self, tensors: list[Any], names: tuple[str, ...]) -> NoReturn:
        """Raise the error that names the argument whose shape does not fit."""
        labels = [f"argument {names[i]!r}" if i < len(names) else f"argument {i}" for i in self.positions]
        labels += [f"argument {name!r}" for name in self.names]
        dim = self.dim
        for label, tensor in zip(labels, tensors, strict=True):
            if not -tensor.dim() <= dim < tensor.dim():
                allowed = f"[{-tensor.dim()}, {tensor.dim() - 1}]" if tensor.dim() else "none: it is 0-dimensional"
                raise ValueError(
                    f"dim {dim} is out of range for {label} of shape {tuple(tensor.shape)}; allowed: {allowed}"
                )
        # Every dim is in range, so the sizes differ: name the first that differs from the first.
        rows = tensors[0].size(dim)
        label, size = next((label, t.size(dim)) for label, t in zip(labels, tensors) if t.size(dim) != rows)
        raise ValueError(
            f"every tensor argument must have the same size along dim {dim}: {labels[0]} has {rows}, {label} has {size}"
        )

    def pieces(self, size: int) -> Iterator[tuple[list[Any], dict[str, Any], int]]:
        """Yield the arguments of each chunk of ``size`` rows (the last takes the rest), and its rows."""
        args, kwargs, dim = self.args, self.kwargs, self.dim
        # One split() per tensor makes every chunk's view at once, where narrow() makes one.
        columns = [args[position].split(size, dim) for position in self.positions]
        named = [kwargs[name].split(size, dim) for name in self.names]
        for index, begin in enumerate(builtins.range(0, self.rows, size)):
            chunk_args = list(args)
            for position, column in zip(self.positions, columns, strict=True):
                chunk_args[position] = column[index]
            chunk_kwargs = kwargs
            if named:
                chunk_kwargs = dict(kwargs)
                for name, column in zip(self.names, named, strict=True):
                    chunk_kwargs[name] = column[index]
            yield chunk_args, chunk_kwargs, min(size, self.rows - begin)

    def chunk(self, begin: int, end: int) -> tuple[list[Any], dict[str, Any]]:
        args, kwargs, dim = list(self.args), self.kwargs, self.dim
        for position in self.positions:
            args[position] = args[position].narrow(dim, begin, end - begin)
        if self.names:
            kwargs = dict(kwargs)
            for name in self.names:
                kwargs[name] = kwargs[name].narrow(dim, begin, end - begin)
        return args, kwargs
