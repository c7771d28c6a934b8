"""What a step of ``accumulate`` returns: each micro-batch's result checked as it comes, all combined at the end."""

from __future__ import annotations

import dataclasses
import functools
import numbers
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, Protocol, cast

import torch
from torch.utils._pytree import (
    SUPPORTED_NODES,
    GetAttrKey,
    MappingKey,
    SequenceKey,
    TreeSpec,
    keystr,
    tree_flatten,
    tree_unflatten,
)

from koila_retry._common.places import levels_to_caller
from koila_retry._common.results import flatten, flatten_with_path, in_order, structure
from koila_retry._common.tensors import TensorBase
from koila_retry._core.engine import Controller

__all__ = ["Results", "Step", "describe", "loss_of", "padded_cat", "padded_shape"]


class Step(Protocol):
    """The decorated step whose results are combined: its name, the dimension of its rows, a warning's state."""

    controller: Controller
    dim: int
    warned_dropped: bool
    # An integration's (accumulator's pad=): the value that pads joined parts which differ outside dim,
    # or None to leave torch.cat's error. Asked only when they differ.
    pad: Callable[[], float | None] | None


# What becomes of each leaf of a result: the loss; one row per row of the batch, joined;
# a list of one string per row, joined; a number or per-batch tensor of floats, weighted
# like the loss; one of integers (a count), added up; anything else, dropped.
_LOSS, _JOIN, _STRINGS, _WEIGH, _COUNT, _DROP = "loss", "join", "strings", "weigh", "count", "drop"
_KINDS = {
    _LOSS: "the loss",
    _JOIN: "one row per row of it",
    _STRINGS: "a list of strings, one per row",
    _WEIGH: "a value of the whole micro-batch",
    _COUNT: "a count of the whole micro-batch",
    _DROP: "a value that comes back as None",
}
_LEAF_SPEC = tree_flatten(0)[1]
_EXACT = (torch.float32, torch.float64)  # dtypes a loss times its weight keeps to the last bit or so
_UNSET: Any = object()  # Results.combined before finish()


class Results:
    """The results of a step's micro-batches: checked as they come, combined at the end."""

    __slots__ = (
        "columns",
        "combined",
        "held",
        "inputs",
        "kinds",
        "read",
        "shared",
        "size",
        "spec",
        "starts",
        "step",
        "versions",
        "whole",
    )

    def __init__(self, step: Step, size: int, inputs: Sequence[torch.Tensor] | None = ()) -> None:
        # No inputs: a step of one micro-batch, whose parts have no earlier one to overwrite.
        self.step, self.size, self.whole, self.inputs = step, size, inputs is None, inputs or ()
        # The inputs by storage, and their versions, as the first joined part is checked: a view of an input
        # that the step does not write is read, no buffer written each micro-batch; one of an input it writes
        # (a scratch buffer passed whole) may be. Not made before: a step that joins nothing pays nothing.
        self.read: dict[tuple[torch.device, int], list[int]] | None = None
        self.held: set[tuple[torch.device, int]] = set()  # every input's storage, made with read
        self.versions: list[int] = []
        self.starts: set[tuple[tuple[int, torch.device, int], int]] = set()
        self.spec: TreeSpec | None = None
        self.kinds: list[str] = []
        self.columns: list[list[Any]] = []
        # Per joined leaf and storage, the parts of its column in that storage: a buffer written again.
        self.shared: dict[tuple[int, torch.device, int], list[int]] = {}
        self.combined: Any = _UNSET  # finish()'s result, once made

    def add(self, result: Any, weight: float, rows: int) -> torch.Tensor:
        """Check one micro-batch's result, keep its parts (weighted by ``weight``), and return its loss."""
        # The usual case, a scalar tensor, kept without flattening: what loss_of would return, checked as it checks.
        if isinstance(result, TensorBase) and result.numel() == 1 and result.is_floating_point():
            if self.spec is None:
                self.spec, self.kinds, self.columns = _LEAF_SPEC, [_LOSS], [[]]
            elif self.spec is not _LEAF_SPEC:
                self._changed(_LEAF_SPEC)
            self.columns[0].append((_kept(result), weight))
            # Not cast(), a call, which every call of a step would make.
            return result  # type: ignore[return-value]  # a TensorBase, as loss_of returns it
        try:
            loss = loss_of(result, self.step.controller.name)  # a container's loss, or the error for any other
        except (TypeError, ValueError) as error:
            # What the whole batch may never return (all its labels masked, say). Notes: Python 3.11 on.
            if self.spec is not None and hasattr(error, "add_note"):
                error.add_note(
                    f"It was returned for a micro-batch of {rows} rows; the micro-batches before it in the step "
                    "returned a loss."
                )
            raise
        leaves, spec = flatten(result, strings=True)  # a list of strings is one leaf, whatever its length
        # The loss where loss_of took it: an entry that is the same tensor in some micro-batches only (a loss
        # without its auxiliary term, returned beside it) is a value of the micro-batch, as another tensor is.
        found = [index for index, leaf in enumerate(leaves) if leaf is loss]
        first = found[0] if len(found) == 1 else _loss_index(result, found)
        kinds = [_LOSS if index == first else self._kind(leaf, rows) for index, leaf in enumerate(leaves)]
        if self.spec is None:
            self.spec, self.kinds, self.columns = spec, kinds, [[] for _ in leaves]
            if _DROP in kinds:
                self._dropping(result, kinds)
        elif spec != self.spec:
            # A dict's keys in another order are matched by key, as the whole batch's would be: put in the first's.
            order = in_order(spec, self.spec)
            if order is None:
                self._changed(spec)
            leaves, kinds = [leaves[index] for index in order], [kinds[index] for index in order]
            result = tree_unflatten(leaves, self.spec)  # for the errors below, which name leaves by index
        if kinds != self.kinds:
            kinds = self._rows_changed(result, kinds, rows)
        for index, (column, kind, leaf) in enumerate(zip(self.columns, kinds, leaves, strict=True)):
            if kind == _DROP:
                continue
            # A value of the whole micro-batch is added or stacked: its shape must be the first's (joined
            # parts are padded by an integration's pad=, or refused by torch.cat).
            if column and kind in (_WEIGH, _COUNT) and isinstance(leaf, TensorBase):
                earlier = column[0].first if isinstance(column[0], _Total) else column[0][0]
                if isinstance(earlier, TensorBase) and earlier.shape != leaf.shape:
                    self._shape_changed(result, index, earlier, rows)
            if kind == _STRINGS:
                column.append(leaf)
            elif kind == _JOIN:
                part = leaf.detach()
                if not self.whole and _plain(leaf):
                    storage = leaf.untyped_storage()
                    # Kept until the step ends, a view would hold all its memory: every micro-batch's whole
                    # output (h of h[:, 0]), which no split brings under the whole batch's. Not an input's,
                    # which the caller holds anyway.
                    copy = storage.nbytes() > leaf.numel() * leaf.element_size() and not self._of_an_input(storage)
                    # Memory an earlier micro-batch's part holds, not broadcast along the rows (a parameter's
                    # expand): a buffer the function writes each time, whose earlier rows are lost.
                    if (
                        _written(leaf)
                        and leaf.stride(self.step.dim) != 0
                        and self._overwrites(index, column, leaf, storage, copy)
                    ):
                        self._reused(result, index, rows)
                    if copy:
                        part = part.clone()
                # Rows of other sizes (trimmed to the micro-batch's longest) cannot be joined: said now, by
                # name, not by torch.cat once every micro-batch ran; an integration's pad= pads them.
                if (
                    column
                    and self.step.pad is None
                    and _across(leaf, self.step.dim) != _across(column[0], self.step.dim)
                ):
                    self._shape_changed(result, index, column[0], rows, joined=True)
                column.append(part)
            elif kind != _LOSS and column and isinstance(column[0], _Total):
                if not isinstance(leaf, TensorBase):  # a number where the first micro-batch returned a tensor
                    self._shape_changed(result, index, column[0].first, rows)
                column[0].add(leaf.detach(), weight)
            elif kind != _LOSS and isinstance(leaf, TensorBase) and leaf.numel() > 1 and column:
                # A tensor where the first micro-batch returned a number: added up, it would make the result's
                # type depend on the split.
                if not isinstance(column[0], tuple) or not isinstance(column[0][0], TensorBase):
                    self._shape_changed(result, index, column[0][0], rows)
                column.append((_kept(leaf), weight))
            elif kind != _LOSS and not self.whole and isinstance(leaf, TensorBase) and leaf.numel() > 1:
                # Added up as it comes, as a hand loop adds into one tensor: kept one per micro-batch, a
                # confusion matrix would cost as many as there are micro-batches.
                column.append(_Total(leaf.detach(), weight, kind))
            else:
                column.append((_kept(leaf) if isinstance(leaf, TensorBase) else leaf, weight))
        return loss

    def _of_an_input(self, memory: torch.UntypedStorage) -> bool:
        """Return whether ``memory`` is an input's, which the caller holds for the whole step anyway."""
        return (memory.device, memory.data_ptr()) in self._read()[1]

    def _read(self) -> tuple[dict[tuple[torch.device, int], list[int]], set[tuple[torch.device, int]]]:
        """Return the inputs with a version, by storage, and every input's storage: looked at once, when needed."""
        if self.read is None:
            self.read, self.held, self.versions = {}, set(), [_version(tensor) for tensor in self.inputs]
            for at, tensor in enumerate(self.inputs):
                if _plain(tensor):
                    storage = (tensor.device, tensor.untyped_storage().data_ptr())
                    self.held.add(storage)
                    if not tensor.is_inference():  # which has no version to read
                        self.read.setdefault(storage, []).append(at)
        return self.read, self.held

    def _overwrites(
        self, index: int, column: list[Any], leaf: torch.Tensor, memory: torch.UntypedStorage, copied: bool
    ) -> bool:
        """Return whether ``leaf`` overlaps a part of ``column`` that an earlier micro-batch returned.

        A part kept ``copied`` is compared, not remembered: a later write cannot reach its copy, and the
        memory it leaves may be handed to a later micro-batch's output.
        """
        storage = (leaf.device, memory.data_ptr())
        read = self._read()[0] if self.read is None else self.read
        key = (index, *storage)
        start = (key, leaf.data_ptr())
        earlier = self.shared.get(key)
        if earlier is None:  # memory no earlier part of the entry lies in: a fresh output, the usual case
            if not copied:
                self.shared[key] = [len(column)]
                self.starts.add(start)
            return False
        inputs = read.get(storage)
        # Kept unread while the inputs are unwritten (windows of one series, one a micro-batch: no cost per
        # earlier part); once one is written, every earlier part is compared. A write that leaves the version
        # as it was (through .data, to an inference tensor, by NumPy) is still met where a part starts where
        # an earlier one did, which no two windows or rows side by side do.
        unwritten = inputs is not None and all(_version(self.inputs[at]) == self.versions[at] for at in inputs)
        # Not for one row, where a row broadcast over the rows (an expanded prompt) starts where it did too.
        overlaps = (start in self.starts and leaf.size(self.step.dim) > 1) or (
            not unwritten and any(_overlap(leaf, column[position]) for position in earlier)
        )
        if not copied:
            self.starts.add(start)
            earlier.append(len(column))
        return overlaps

    def _reused(self, result: Any, index: int, rows: int) -> NoReturn:
        path = keystr(flatten_with_path(result, strings=True)[index][0])
        raise ValueError(
            f"{self.step.controller.name} returned, at the result{path} for a micro-batch of {rows} rows, the "
            "memory it returned for an earlier micro-batch: the rows are joined when the step ends, so where the "
            "function writes there each time (a reused buffer), the earlier ones would read as the later ones. "
            "Return a new tensor there (buffer.clone())"
        )

    def _shape_changed(self, result: Any, index: int, first: Any, rows: int, joined: bool = False) -> NoReturn:
        path, leaf = flatten_with_path(result, strings=True)[index]
        what = (
            f"rows joined along dim {self.step.dim} must have the same size in every other dim in every one"
            if joined
            else f"a value of the whole micro-batch (not one per row along dim {self.step.dim}) must have the same "
            "shape in every one"
        )
        raise ValueError(
            f"{self.step.controller.name} returned {describe(leaf)} at the result{keystr(path)} for a micro-batch "
            f"of {rows} rows, and {describe(first)} for the first: {what}, or the step's result would depend on "
            f"the split. {'Pad them to one length' if joined else 'Return one entry per row, or pad it to one shape'}"
        )

    def drop(self) -> None:
        """Let go of what the micro-batches returned: an error's traceback holds this object."""
        self.columns, self.inputs = [], ()

    def weighed(self, weighted: torch.Tensor) -> None:
        """Keep the last micro-batch's loss as its backward ran it, weighted: it then adds up as it is.

        Fewer operations at the end, each of which costs tens of microseconds after a
        micro-batch's compute has left the caches cold. Not for a half-precision loss,
        whose weights are kept exact in :meth:`finish`.
        """
        if weighted.dtype in _EXACT:
            column = self.columns[self.kinds.index(_LOSS)]
            column[-1] = (weighted.detach(), 1.0)

    @staticmethod
    def _whole(kind: str, column: list[Any]) -> bool:
        if kind == _DROP:
            return not column
        return len(column) == 1 and (kind in (_JOIN, _STRINGS) or (type(column[0]) is tuple and column[0][1] == 1.0))

    def _changed(self, spec: TreeSpec) -> NoReturn:
        raise ValueError(
            f"{self.step.controller.name} returned results of different structures for different "
            f"micro-batches: {structure(self.spec)} and then {structure(spec)}"
        )

    def _kind(self, leaf: Any, rows: int) -> str:
        if not isinstance(leaf, TensorBase):
            if type(leaf) is list:  # of strings (see flatten)
                return _STRINGS if len(leaf) == rows else _DROP
            # NumPy's scalars (np.float32, np.int64) too, not a Decimal, which a float weight cannot multiply.
            if isinstance(leaf, bool) or not isinstance(leaf, numbers.Complex):
                return _DROP
            return _COUNT if isinstance(leaf, numbers.Integral) else _WEIGH
        dim = self.step.dim
        if -leaf.dim() <= dim < leaf.dim() and leaf.size(dim) == rows:
            return _JOIN
        # A value of the whole micro-batch (a mean, a count per class): the same shape
        # whatever the rows, so that the result's shape never depends on the split.
        return _WEIGH if leaf.is_floating_point() or leaf.is_complex() else _COUNT

    def _rows_changed(self, result: Any, kinds: list[str], rows: int) -> list[str]:
        """Drop a list of strings one per row in some micro-batches only and return the kinds; raise for others."""
        changed = [index for index, (kind, before) in enumerate(zip(kinds, self.kinds, strict=True)) if kind != before]
        if all({kinds[index], self.kinds[index]} == {_STRINGS, _DROP} for index in changed):
            for index in changed:
                kinds[index] = self.kinds[index] = _DROP
                self.columns[index].clear()
            self._dropping(result, kinds)
            return kinds
        path, leaf = flatten_with_path(result, strings=True)[changed[0]]
        kind, before = kinds[changed[0]], self.kinds[changed[0]]
        raise ValueError(
            f"{self.step.controller.name} returned {describe(leaf)} at the result{keystr(path)} for a micro-batch "
            f"of {rows} rows, {_KINDS[kind]}, where the micro-batches before returned {_KINDS[before]}: a "
            f"tensor with as many rows along dim {self.step.dim} as its micro-batch is joined, a number or any "
            "other tensor is a value of the whole micro-batch, and anything else comes back as None; each must "
            "be the same kind in every micro-batch (an output present in some micro-batches only is not)"
        )

    def _dropping(self, result: Any, kinds: list[str]) -> None:
        """Warn, once per step, that the leaves of ``result`` that cannot be combined come back as ``None``."""
        step = self.step
        if step.warned_dropped:
            return
        paths = flatten_with_path(result, strings=True)
        dropped = [
            f"the result{keystr(path)} ({type(leaf).__name__})"
            for (path, leaf), kind in zip(paths, kinds, strict=True)
            if kind == _DROP and leaf is not None  # None stays None: nothing is lost
        ]
        if not dropped:
            return
        step.warned_dropped = True
        warnings.warn(
            f"{step.controller.name} returned {', '.join(dropped)}: koila.accumulate combines tensors and "
            "numbers across micro-batches, and returns other objects (a model's key-value cache, strings, "
            "flags) as None, split or not. This warning is shown once.",
            UserWarning,
            stacklevel=levels_to_caller(),
        )

    def finish(self) -> Any:
        """Return the step's result, combined from its micro-batches' once (the same object on later calls)."""
        # Every step combines inside its attempt: the combining may run out of memory too, and after the attempt
        # that error would escape unretried (after the ranks agreed, raised by one rank alone).
        if self.combined is _UNSET:
            try:
                self.combined = self._combined()
            except BaseException as error:
                # Its traceback holds this object and _combined's frame: what the micro-batches returned would
                # live as long as the error. Where it was raised is in its message (torch.cat's sizes, say).
                self.columns = []
                if error.__traceback__ is not None:
                    error.__traceback__.tb_next = None
                raise
        return self.combined

    def _combined(self) -> Any:
        if self.spec is _LEAF_SPEC and len(self.columns[0]) == 1:  # one loss, as it came
            return self.columns[0][0][0]
        if all(self._whole(kind, column) for kind, column in zip(self.kinds, self.columns, strict=True)):
            # One micro-batch of weight 1, the whole batch: each part as it came (detached).
            parts = [
                None if kind == _DROP else column[0] if kind in (_JOIN, _STRINGS) else column[0][0]
                for kind, column in zip(self.kinds, self.columns, strict=True)
            ]
            return tree_unflatten(parts, cast(TreeSpec, self.spec))
        combined: list[Any] = []
        for kind, column in zip(self.kinds, self.columns, strict=True):
            if kind == _DROP:
                combined.append(None)
                continue
            if column and isinstance(column[0], _Total):
                combined.append(column[0].result())
                continue
            if kind in (_LOSS, _WEIGH):
                # A micro-batch that counts no items (weight=) adds nothing, not its loss's nan times 0.
                column = [entry for entry in column if entry[1] != 0.0]
            if kind == _STRINGS:
                combined.append([string for part in column for string in part])
            elif kind == _JOIN:
                combined.append(column[0] if len(column) == 1 else self._joined(column))
            elif kind == _COUNT:  # counts add up to the whole batch's, in their own type
                counts = [value for value, _ in column]
                if len(counts) == 1:
                    combined.append(counts[0])
                elif isinstance(counts[0], TensorBase):  # booleans add up to whether any is true
                    counts = [_like(value, counts[0]) for value in counts]
                    combined.append(torch.stack(counts).sum(0).to(counts[0].dtype))
                else:
                    combined.append(sum(counts))
            elif isinstance(column[0][0], TensorBase):  # sum(value * weight) in a few operations
                column = [(_like(value, column[0][0]), weight) for value, weight in column]
                if all(weight == 1.0 for _, weight in column):
                    first = column[0][0]
                    if first.dtype in _EXACT:  # one operation repeated, warm after the first
                        combined.append(sum((value for value, _ in column[1:]), first))
                    else:  # half precision: summed as sum() sums it, in float32
                        combined.append(torch.stack([value for value, _ in column]).sum(0))
                    continue
                values = torch.stack([value for value, _ in column])
                # A count's weighted sum is a fraction; a half-precision loss is summed in float32,
                # so that its weights are not rounded to bf16.
                dtype = values.dtype if values.is_floating_point() or values.is_complex() else torch.get_default_dtype()
                exact = torch.promote_types(dtype, torch.float32)
                # Each weight rounded once, from its float to the dtype summed in, as a float64
                # tensor converted would hold it, in one call.
                weights = torch.tensor([weight for _, weight in column], dtype=exact, device=values.device)
                # One number per micro-batch (a loss), the usual case: a dot, where tensordot reshapes first.
                summed = values.to(exact)
                if summed.dim() == 1:
                    total = torch.dot(weights, summed)
                else:  # one element each, or one micro-batch (see _Total): not a matrix product, which autocast casts
                    total = (summed * weights.view(-1, *(1,) * (summed.dim() - 1))).sum(0)
                combined.append(total.to(dtype))
            else:
                combined.append(sum(value if weight == 1.0 else value * weight for value, weight in column))
        self.columns.clear()
        return tree_unflatten(combined, cast(TreeSpec, self.spec))

    def _joined(self, column: list[torch.Tensor]) -> torch.Tensor:
        """Join the micro-batches' parts along ``dim``: padded to the largest where the step pads and sizes differ."""
        dim, pad = self.step.dim, self.step.pad
        if pad is not None:
            shape = padded_shape(column, dim)
            value = None if shape is None else pad()
            if shape is not None and value is not None:
                return padded_cat(column, dim, shape, value)
        # Tensors that differ outside dim, not padded: torch.cat's own error, which names the sizes.
        return torch.cat(column, dim=dim)


def _across(tensor: torch.Tensor, dim: int) -> tuple[int, ...] | None:
    """Return a tensor's shape but for ``dim``, which rows are joined along; None where it has no such dim."""
    shape = tuple(tensor.shape)
    if not -len(shape) <= dim < len(shape):
        return None
    dim %= len(shape)
    return shape[:dim] + shape[dim + 1 :]


def padded_shape(column: list[torch.Tensor], dim: int) -> list[int] | None:
    """The shape of ``column`` joined along ``dim``, each other dim the largest; ``None`` if none differs (or can)."""
    first = column[0]
    count = first.dim()
    if not -count <= dim < count:
        return None
    dim %= count
    largest = list(first.shape)
    differ = False
    for part in column[1:]:
        if part.dim() != count:
            return None
        for index, size in enumerate(part.shape):
            if size != largest[index] and index != dim:
                differ = True
                largest[index] = max(largest[index], size)
    if not differ:
        return None
    largest[dim] = sum(part.shape[dim] for part in column)
    return largest


def padded_cat(column: list[torch.Tensor], dim: int, shape: list[int], value: float) -> torch.Tensor:
    """``torch.cat(column, dim)`` into a tensor of ``shape`` filled with ``value``: each part at the start."""
    first = column[0]
    dim %= first.dim()
    dtype = functools.reduce(torch.promote_types, (part.dtype for part in column))
    joined = torch.full(shape, value, dtype=dtype, device=first.device)
    start = 0
    for part in column:
        rows = part.shape[dim]
        where = [slice(0, size) for size in part.shape]
        where[dim] = slice(start, start + rows)
        joined[tuple(where)] = part
        start += rows
    return joined


def _loss_index(result: Any, found: list[int]) -> int:
    """Return which of the leaves that are the loss tensor sits where :func:`loss_of` takes the loss from."""
    if isinstance(result, dict):
        place: object = MappingKey("loss")
    elif "loss" in getattr(type(result), "_fields", ()):
        place = GetAttrKey("loss")
    else:
        place = SequenceKey(0)
    paths = flatten_with_path(result, strings=True)
    return next((index for index in found if paths[index][0] == (place,)), found[0] if found else -1)


def _version(tensor: torch.Tensor) -> int:
    """Return a tensor's version counter, or -1 for an inference tensor, which has none."""
    try:
        return tensor._version
    except RuntimeError:
        return -1


def _written(leaf: torch.Tensor) -> bool:
    """Return whether ``leaf``, plain memory, could be a buffer written in place, not a graph's fresh output."""
    # A view that requires grad may be one, of memory a graph wrote (bank[:n] = h with grad on); not one of
    # a parameter (a class token's expand), which the step reads.
    base = leaf._base
    return not leaf.requires_grad or (base is not None and base.grad_fn is not None)


def _plain(tensor: torch.Tensor) -> bool:
    """Return whether ``tensor`` is plain, strided memory with a data pointer to compare."""
    # A subclass, a sparse or a meta tensor has none (0, or an error).
    return (
        type(tensor) is torch.Tensor
        and tensor.layout is torch.strided
        and tensor.device.type != "meta"
        and tensor.numel() > 0
        and tensor.data_ptr() != 0
    )


def _overlap(leaf: torch.Tensor, part: torch.Tensor) -> bool:
    """Return whether two tensors of one storage share an element, where that is cheap to tell."""
    if leaf.data_ptr() == part.data_ptr():
        return True
    # Dense, each lies in its span of bytes. Views of one input side by side along another dim (returned by
    # a micro-batch each) interleave their spans without sharing an element: taken.
    if not (leaf.is_contiguous() and part.is_contiguous()):
        return False
    start, begin = leaf.data_ptr(), part.data_ptr()
    return start < begin + part.numel() * part.element_size() and begin < start + leaf.numel() * leaf.element_size()


def _like(value: Any, first: TensorBase) -> Any:
    """Return a number of a column that began with a one-element tensor as such a tensor, to add up with it."""
    if isinstance(value, TensorBase):
        return value
    return torch.as_tensor(value, dtype=first.dtype, device=first.device).reshape(first.shape)


class _Total:
    """The sum of a column of tensors of the whole micro-batch, weighted like the loss or added as counts."""

    __slots__ = ("device", "first", "kind", "sum")

    def __init__(self, value: torch.Tensor, weight: float, kind: str) -> None:
        self.first = torch.empty(value.shape, dtype=value.dtype, device="meta")  # for the checks and errors
        self.device, self.kind = value.device, kind
        self.sum: torch.Tensor | None = None
        self.add(value, weight)

    def add(self, value: torch.Tensor, weight: float, compressed: bool = False) -> None:
        """Add one micro-batch's value: a count as it is, one to weigh times ``weight``."""
        if not compressed and value.layout is not torch.strided and value.layout is not torch.sparse_coo:
            try:  # a compressed layout (CSR, CSC...), of which torch adds few dtypes
                self.add(value, weight, compressed=True)
            except (RuntimeError, NotImplementedError) as error:
                raise ValueError(
                    f"a {str(value.layout).removeprefix('torch.')} tensor of {value.dtype} returned beside the loss "
                    f"cannot be added up over micro-batches ({str(error).splitlines()[0]}): return it dense, or as "
                    "sparse COO (.to_sparse())"
                ) from None
            return
        total = self.sum
        if self.kind == _COUNT:  # in its own type, as the whole batch's count; booleans: whether any is true
            if total is None:
                self.sum = value.clone()
            elif total.dtype == torch.bool and total.layout is torch.strided:
                total.logical_or_(value)
            elif total.dtype == torch.bool:  # sparse: no logical_or, nor an add of booleans; a sum of integers has it
                self.sum = (total.long() + value.long()).bool()
            else:
                total.add_(value)
        elif weight != 0.0:  # a micro-batch that counts no items (weight=) adds nothing, not its nan times 0
            if total is None:  # half precision summed in float32, its weights not rounded to bf16
                self.sum = total = value.to(torch.promote_types(value.dtype, torch.float32), copy=True)
                if weight != 1.0:
                    total.mul_(weight)
            else:
                total.add_(value, alpha=weight)

    def result(self) -> torch.Tensor:
        """Return the sum in the values' own type; NaN where every micro-batch counted no items."""
        if self.sum is None:
            return torch.full(self.first.shape, float("nan"), dtype=self.first.dtype, device=self.device)
        return self.sum.to(self.first.dtype)


def _kept(tensor: torch.Tensor | TensorBase) -> torch.Tensor:
    """Return a loss or another number of a result detached, copied if it is a view of a larger storage."""
    # Kept until the step ends, a view would hold its whole storage: the CPU's mse_loss returns its
    # mean in the buffer of the elementwise losses, as large as the model's output.
    kept = tensor.detach()
    try:
        larger = kept.untyped_storage().nbytes() > kept.numel() * kept.element_size()
    except (RuntimeError, NotImplementedError):  # a layout or subclass without one storage
        return kept
    return kept.clone() if larger else kept


def loss_of(result: Any, name: str) -> torch.Tensor:
    """Return the loss in a step's result, or raise the error that says what is missing."""
    if isinstance(result, (tuple, list)):
        # A named tuple's loss field wherever it is (Out(pred, loss)), as a dict's "loss" entry: its first
        # item, per-row predictions of one element at 1-row micro-batches, would pass for a loss.
        fields = getattr(type(result), "_fields", ())
        loss = getattr(result, "loss", None) if "loss" in fields else (result[0] if result else None)
    elif isinstance(result, dict):
        if type(result) not in SUPPORTED_NODES:
            # One leaf to pytree: split, its parts could not be weighed or joined (a Hugging Face ModelOutput
            # is registered with it, an AttrDict is not).
            raise TypeError(
                f"{name} returned {type(result).__qualname__}, a subclass of dict that torch.utils._pytree takes "
                "whole; @koila.accumulate takes the loss, and weighs and joins the rest, from a dict: return "
                f"dict(...) of it, or register {type(result).__qualname__} with torch.utils._pytree"
            )
        loss = result.get("loss")
    else:
        loss = result
    if loss is result and dataclasses.is_dataclass(result) and not isinstance(result, type):
        # Named by its type only: its repr would print every tensor it holds.
        raise TypeError(
            f"{name} returned an instance of {type(result).__qualname__}, a dataclass; @koila.accumulate does not "
            "search a dataclass for a 'loss' field. Return the loss as a scalar tensor, or with the rest in a dict "
            "with a 'loss' entry, a tuple or list whose first item it is, or a named tuple with a 'loss' field"
        )
    if not isinstance(loss, TensorBase):
        raise TypeError(
            f"{name} returned {describe(result)}; @koila.accumulate needs the loss: a scalar tensor, a tuple "
            "or list whose first item is one, a named tuple with a 'loss' field, or a dict with a 'loss' entry"
        )
    if loss.numel() != 1:
        raise ValueError(
            f"{name} returned a loss of shape {tuple(loss.shape)}; it must be a scalar: reduce it with "
            ".mean() or .sum() (and say which with reduction=)"
        )
    if not loss.is_floating_point():
        # Weighted by each micro-batch's share of the rows, a count or a flag would change type and value,
        # and a complex value would lose its imaginary part (nor can autograd start from one).
        raise TypeError(
            f"{name} returned a loss of dtype {loss.dtype}; it must be a real floating-point tensor, which can "
            "be weighted by each micro-batch's rows. Return it as a float (.float(), or .abs() of a complex "
            "value), or beside the loss in a tuple or dict, where integers and flags are added up in their own "
            "type"
        )
    return cast(torch.Tensor, loss)


def describe(value: Any) -> str:
    if isinstance(value, TensorBase):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    if isinstance(value, dict):
        return f"a dict with keys {list(value)}"
    return "None" if value is None else f"{type(value).__name__} {value!r}"[:200]
