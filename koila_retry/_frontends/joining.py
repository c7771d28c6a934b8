"""``koila.chunked``'s result: each chunk's checked against the first's and written where its rows go.

The whole result (or ``out``) is made beside the first chunk that has fewer than every row,
inside that chunk's attempt: a result that does not fit is that attempt's out-of-memory
error, and no join at the end can lose the chunks that finished.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from typing import Any, NoReturn, cast

import torch
from torch.utils._pytree import GetAttrKey, MappingKey, SequenceKey, TreeSpec, keystr, tree_flatten, tree_unflatten

from koila_retry._common.batches import Split, positional_names
from koila_retry._common.places import levels_to_caller
from koila_retry._common.results import flatten, flatten_with_path, in_order, strings, structure
from koila_retry._common.tensors import TensorBase
from koila_retry._common.units import format_bytes
from koila_retry._common.warn import warn_or_log
from koila_retry._core.detect import is_oom

__all__ = ["Results"]

_NONE_SPEC = tree_flatten(None)[1]

# The types of a result's leaves that hold values, not tensors (flatten's, with strings): one per row, or not.
_VALUES = (list, tuple)


class Results:
    """The results of the chunks: checked as they come, and written into one result (or ``out``) as they come."""

    def __init__(self, dim: int, rows: int, out: Any) -> None:
        self.dim, self.rows, self.out = dim, rows, out
        self.spec: TreeSpec | None = None
        # Where each leaf's rows go: ``out``'s tensors, or the result's, allocated at the first chunk: the
        # peak is the result plus one chunk, and no final join can lose the finished chunks. A list of
        # one string per row goes into a list of every row's.
        self.targets: list[torch.Tensor | list[Any] | None] | None = None
        self.strings = out is None  # whether lists of strings are leaves, joined where one per row
        self.single: Any = None  # a first chunk that held every row: the result as it is
        # The rows of the first chunk beside which the result could not be made, in the last attempt
        # that ran, and the result's bytes and device.
        self.unfit: tuple[int, int, torch.device] | None = None
        self.none = False
        self.plain = False  # whether results are plain tensors, written without flattening
        # The leaves whose rows go into inference tensors, made so because fn returned inference tensors
        # there, and written in inference mode: outside it, torch refuses the writes.
        self.inference: frozenset[int] = frozenset()
        # out's tensors that are an input's own elements (out=x) under grad mode, with that input's name:
        # refused where a result requires grad, before anything is written (_refuse_aliased).
        self.aliased: list[tuple[str, str]] = []
        self.filled = False  # whether the result has None where out has nothing: returned with None there
        self.least_dims = dim + 1 if dim >= 0 else -dim  # the dims a result needs to have ``dim``
        if out is not None:
            self.plain = type(out) is torch.Tensor
            if self.plain:
                self.targets = [out]
            # Everything about out is checked before any chunk runs; what it is matched
            # with is known at the first chunk's result (_matched).
            writes_record_grad = torch.is_grad_enabled()
            inference = torch.is_inference_mode_enabled()
            paths = []
            for path, leaf in flatten_with_path(out):
                where = f"out{keystr(path)}"
                if leaf is None:  # where fn's result has None too (_matched)
                    continue
                if not isinstance(leaf, TensorBase):
                    raise TypeError(
                        f"out must hold tensors, got {type(leaf).__name__} at {where} (None is taken where fn's "
                        "result has None)"
                    )
                paths.append((path, leaf))
                if leaf.layout is not torch.strided or leaf.is_nested:
                    raise ValueError(
                        f"out must hold dense, strided tensors, got a {_layout_name(leaf)} tensor at {where}: "
                        "koila.chunked writes each chunk's rows into a slice of out. Pass a dense tensor "
                        "(torch.empty of the result's shape), or leave out=None and join the results yourself"
                    )
                if not -leaf.dim() <= dim < leaf.dim() or leaf.size(dim) != rows:
                    raise ValueError(
                        f"{where} has shape {tuple(leaf.shape)}; it needs {rows} rows along dim {dim}, "
                        "one per input row"
                    )
                if writes_record_grad and _grad_leaf(cast(torch.Tensor, leaf)):
                    raise ValueError(
                        f"{where} requires grad and is a leaf tensor (or a view of one): koila.chunked writes "
                        "each chunk's rows into out in place, and autograd refuses in-place writes into a leaf "
                        f"that requires grad. Pass {where}.detach() (or a tensor made without "
                        "requires_grad=True), or call koila.chunked under torch.no_grad()"
                    )
                if not inference and leaf.is_inference():
                    raise ValueError(
                        f"{where} is an inference tensor (made under torch.inference_mode()), and koila.chunked "
                        "is called outside inference mode, where torch refuses the in-place writes it makes into "
                        "out. Call koila.chunked under torch.inference_mode() too, or pass a tensor made outside "
                        f"it ({where}.clone() outside inference mode makes one)"
                    )
                if _overlaps_itself(cast(torch.Tensor, leaf)):
                    raise ValueError(
                        f"{where} has elements that share memory (a tensor made by expand, say, whose stride 0 "
                        "repeats one row): koila.chunked writes one result row into each of its rows, and rows "
                        "that share memory would overwrite each other. Pass a tensor with memory of its own for "
                        f"every element ({where}.clone(), or torch.empty of its shape)"
                    )
            if len(paths) > 1:
                _refuse_shared(paths)

    def refuse_overlap(self, split: Split) -> None:
        """Refuse an ``out`` tensor that shares memory with an input, other than a split input's own elements."""
        outs = _tensors(self.out)
        tensors = split.tensors
        # By the addresses of their memory, not by storage: two storages (torch.from_numpy of one array,
        # say) may hold the same memory.
        spans = [*map(_span, tensors), *(_span(leaf) for _, leaf in outs)]
        count, rowed = len(tensors), set(split.split)
        for index, place in sorted(_meeting(spans), key=lambda pair: (pair[1], pair[0])):
            if index >= count or place < count:  # two inputs, or two of out's tensors (_refuse_shared)
                continue
            path, leaf = outs[place - count]
            tensor = tensors[index]
            # Exactly the input's elements: each chunk's rows are written once fn returned for them, where
            # no later chunk reads, as torch's own out= takes an input that is the output.
            if index in rowed and _same_elements(leaf, tensor):
                if torch.is_grad_enabled():  # the writes may record a graph: refused where a result requires grad
                    self.aliased.append((f"out{keystr(path)}", _input_name(split, index)))
                    self.plain = False  # checked by add's general path: any other out costs nothing more
                continue
            if _share(leaf, tensor):
                how = "is split into the chunks" if index in rowed else "is passed whole to every chunk"
                raise ValueError(
                    f"out{keystr(path)} shares memory with {_input_name(split, index)}, of shape "
                    f"{tuple(tensor.shape)}, which {how}, without being that tensor's own elements (a view "
                    "of the same memory shifted by a row, say): koila.chunked writes each chunk's rows into "
                    "out as the chunk finishes, and later chunks would read input rows already overwritten, a "
                    "wrong result (torch's own out= refuses such an overlap too). Pass an out with memory of "
                    "its own (torch.empty_like, or .clone()), or the input tensor itself"
                )

    def add(self, begin: int, end: int, result: Any) -> None:
        targets = self.targets
        if self.plain and type(result) is torch.Tensor and result.dim() >= self.least_dims:
            self._write(cast(torch.Tensor, cast(list[Any], targets)[0]), result, begin, end, result, 0)
            return  # the usual case, checked and written without flattening
        if result is None and self.out is None:
            if self.spec is not None and not self.none:
                self._changed(self.spec, None)
            self.none, self.spec = True, _NONE_SPEC
            return
        leaves, result = self._checked(result, begin, end)
        targets = self.targets
        if targets is None:
            if end - begin == self.rows:
                # As it is, but held to the rules every chunk is: one row per input row, and a layout that
                # can be joined, whatever the memory.
                rowed = []
                for index, leaf in enumerate(leaves):
                    if isinstance(leaf, TensorBase):
                        if leaf.layout is not torch.strided or leaf.is_nested:
                            self._unstrided(result, index, leaf)
                        if leaf.size(self.dim) != self.rows:
                            tensor = cast(torch.Tensor, leaf)
                            self._mismatch(tensor, tensor, begin, end, result, index)
                    elif self._values_per_row(leaf, self.rows):
                        rowed.append(index)
                if rowed:  # None, as when the rows take more chunks
                    self._dropped(result, leaves, rowed, self.rows)
                    kept = [None if index in rowed else leaf for index, leaf in enumerate(leaves)]
                    result = tree_unflatten(kept, cast(TreeSpec, self.spec))
                self.single = result
                return
            targets = self._allocate(leaves, end - begin, result)
        if self.aliased:
            self._refuse_aliased(leaves, begin, end)
        if self.out is not None and len(targets) > 1:
            leaves = _apart(leaves, targets)
        for index, (target, leaf) in enumerate(zip(targets, leaves, strict=True)):
            if type(target) is list:
                target[begin:end] = leaf  # one per row: _checked saw as many as the rows
            elif target is not None:
                if self.inference and index in self.inference:
                    if leaf.requires_grad:  # its graph would be dropped in the inference tensor, silently
                        self._inference_then_graph(result, index, begin, end)
                    with torch.inference_mode():
                        self._write(cast(torch.Tensor, target), leaf, begin, end, result, index)
                else:
                    self._write(cast(torch.Tensor, target), leaf, begin, end, result, index)

    def _inference_then_graph(self, result: Any, index: int, begin: int, end: int) -> NoReturn:
        """Refuse a chunk's tensor that requires grad where the first chunk's was an inference tensor."""
        where = f"the result{keystr(flatten_with_path(result, values=self.strings)[index][0])}"
        raise ValueError(
            f"fn returned an inference tensor at {where} for the first chunk (made under "
            f"torch.inference_mode()), and a tensor that requires grad there for the rows {begin} to {end}: "
            "koila.chunked makes the result an inference tensor when the first chunk's is one, which cannot "
            "hold a graph, so the later chunks' gradients would be lost. Make fn return the same kind of "
            "tensor for every chunk (run it all under torch.inference_mode(), or none of it)"
        )

    def _refuse_aliased(self, leaves: list[Any], begin: int, end: int) -> None:
        """Refuse, before a row of it is written, an ``out`` that is an input, if the chunk's result requires grad."""
        if not any(isinstance(leaf, TensorBase) and leaf.requires_grad for leaf in leaves):
            return
        where, name = self.aliased[0]
        raise ValueError(
            f"{where} holds the same elements as {name} (out=x), and fn's result for the rows {begin} to {end} "
            "requires grad: koila.chunked writes each chunk's rows into out in place, over the input rows that "
            "autograd may have saved for the backward pass (a Linear saves its input), which would then fail "
            "(torch's own out= refuses autograd). Pass an out of its own (torch.empty_like, say), or call "
            "koila.chunked under torch.no_grad()"
        )

    def make(self, begin: int, end: int, result: Any) -> None:
        """Check the first chunk's result, of fewer than every row, and make the result's tensors beside it."""
        if result is not None or self.out is not None:  # None throughout: there is nothing to make
            leaves, result = self._checked(result, begin, end)
            if self.targets is None:
                self._allocate(leaves, end - begin, result)

    def ready(self, begin: int, end: int, result: Any) -> Any:
        """Make, inside the attempt, the copies that writing a chunk's result into ``out`` needs; return the result.

        :meth:`add` runs once every rank's attempt succeeded, where an out-of-memory error is not retried.
        """
        if self.plain and type(result) is torch.Tensor:
            leaves: list[Any] = [result]
        else:
            leaves, result = self._checked(result, begin, end)
        targets = cast(list[Any], self.targets)
        kept = _apart(leaves, targets) if len(targets) > 1 else list(leaves)
        for index, (target, leaf) in enumerate(zip(targets, kept, strict=True)):
            if not isinstance(target, torch.Tensor) or not isinstance(leaf, torch.Tensor) or leaf is not leaves[index]:
                continue
            if leaf.is_nested or leaf.dim() != target.dim():  # refused by add, with the error that names it
                continue
            view = target.narrow(self.dim, begin, end - begin)
            if view.shape != leaf.shape:
                continue
            if _reads_from(leaf, view):
                kept[index] = leaf.clone()
            elif leaf.device != view.device and not leaf.is_contiguous():  # as copy_ would there (not run on a GPU)
                kept[index] = leaf.contiguous()
        if all(map(operator.is_, kept, leaves)):
            return result
        return kept[0] if leaves[0] is result else tree_unflatten(kept, cast(TreeSpec, self.spec))

    def _checked(self, result: Any, begin: int, end: int) -> tuple[list[Any], Any]:
        """Check a chunk's result against the first chunk's structure (or ``out``); return its leaves and it.

        A result whose dicts have the first's keys in another order is returned with its leaves, and
        remade, in the first's order.
        """
        leaves, spec = flatten(result, values=self.strings)
        if self.spec is None:
            if self.out is not None:
                self.targets = self._matched(result)
            self.spec = spec
        elif spec != self.spec or self.none:
            order = None if self.none else in_order(spec, self.spec)
            if order is None:
                self._changed(None if self.none else self.spec, spec)
            leaves = [leaves[index] for index in order]
            result = tree_unflatten(leaves, self.spec)  # for the errors below, which name leaves by index
        dim, joined, targets, rows = self.dim, False, self.targets, end - begin
        for index, leaf in enumerate(leaves):  # every chunk's: a short last chunk is where squeeze() bites
            target = None if targets is None else targets[index]
            if isinstance(leaf, TensorBase):
                joined = True
                if not -leaf.dim() <= dim < leaf.dim() or (targets is not None and not isinstance(target, TensorBase)):
                    self._explain(result, begin, end)
            elif self.strings and type(leaf) in _VALUES and not isinstance(target, TensorBase):  # strings, numbers
                if len(leaf) == rows and strings(leaf):
                    joined = True
                elif type(target) is list:  # one string per row before, not here: as a few strings would be
                    self._unjoined(index, leaf, begin, end)
            elif target is not None or (self.out is not None and leaf is not None):  # None: where out has none
                self._explain(result, begin, end)
        if not joined and (leaves or end > begin):  # no rows at all: an empty result is the whole one
            self._explain(result, begin, end)
        return leaves, result

    def _unjoined(self, index: int, leaf: list[Any] | tuple[Any, ...], begin: int, end: int) -> None:
        """Return as ``None`` a list of strings that was one per row until the chunk ``begin``-``end``."""
        cast(list[Any], self.targets)[index] = None
        count = len(leaf)
        if strings(leaf):
            what = f"a list of {count} {'string' if count == 1 else 'strings'}"
        else:
            what = f"a {type(leaf).__name__} of {count} {'value' if count == 1 else 'values'}, not all strings,"
        warn_or_log(
            f"fn returned {what} for the rows {begin} to {end}, where it had returned one string per row for the "
            "chunks before: koila.chunked returns that list as None",
            UserWarning,
            stacklevel=levels_to_caller(),
        )

    def _allocate(self, leaves: list[Any], first: int, result: Any) -> list[torch.Tensor | list[Any] | None]:
        """Make the result's tensors (and lists), each with every row, where the first chunk's lie (else ``None``).

        An allocation that runs out of memory records what did not fit, in ``unfit``, and
        propagates: it is the first chunk's attempt's error, retried smaller like any other.
        """
        rowed = [strings(leaf) and len(leaf) == first for leaf in leaves]  # strings, one per row
        dropped = [index for index, leaf in enumerate(leaves) if not (isinstance(leaf, TensorBase) or rowed[index])]
        kept = [leaf if isinstance(leaf, TensorBase) else None for leaf in leaves]
        tensors = [leaf for leaf in kept if leaf is not None]
        for index, leaf in enumerate(kept):
            if leaf is not None and (leaf.layout is not torch.strided or leaf.is_nested):
                self._unstrided(result, index, leaf)
        dim, shapes = self.dim, []
        for leaf in tensors:
            shape = list(leaf.shape)
            shape[dim] = self.rows
            shapes.append(shape)
        # fn's own inference tensors (its model run under torch.inference_mode()) are what one chunk
        # returns: the result of several is one too, made and written in inference mode.
        inference = not torch.is_inference_mode_enabled() and any(leaf.is_inference() for leaf in tensors)
        try:
            made = iter([_empty(leaf, shape, inference) for leaf, shape in zip(tensors, shapes, strict=True)])
        except RuntimeError as error:
            if is_oom(error):
                size = sum(math.prod(shape) * leaf.element_size() for leaf, shape in zip(tensors, shapes, strict=True))
                self.unfit = (first, size, tensors[0].device)
            raise
        targets = self.targets = [
            next(made) if leaf is not None else [None] * self.rows if per_row else None
            for leaf, per_row in zip(kept, rowed, strict=True)
        ]
        if inference:
            self.inference = frozenset(
                index for index, leaf in enumerate(kept) if leaf is not None and leaf.is_inference()
            )
        self.plain = type(result) is torch.Tensor and not inference  # written by add's general path
        if dropped:
            self._dropped(result, leaves, dropped, first)
        return targets

    def _values_per_row(self, leaf: Any, rows: int) -> bool:
        """Return whether ``leaf`` is a list or tuple of one value per row that is not joined: not strings."""
        return self.strings and type(leaf) in _VALUES and len(leaf) == rows and not strings(leaf)

    def _dropped(self, result: Any, leaves: list[Any], dropped: list[int], rows: int) -> None:
        """Warn that the result's leaves at ``dropped``, of a chunk of ``rows`` rows, come back as ``None``."""
        paths = flatten_with_path(result, values=self.strings)
        rowed = [index for index in dropped if self._values_per_row(leaves[index], rows)]
        others = [index for index in dropped if index not in rowed and leaves[index] is not None]  # None stays None
        # Warned once the result is made (not at each retry of a first chunk beside which it did not
        # fit), and logged where a filter would raise it: raised, it would end the recovery.
        if rowed:
            named = ", ".join(f"the result{keystr(paths[i][0])} ({type(leaves[i]).__name__})" for i in rowed)
            warn_or_log(
                f"fn returned one value per row that is not a tensor at {named}: koila.chunked joins tensors, and "
                "lists of one string per row, and returns other lists and tuples of one value per row (the numbers "
                "of .tolist(), say) as None, whether the rows take one chunk or more. Return the values as a "
                "tensor (the tensor before .tolist(), or torch.tensor(values)), or as a list of strings",
                UserWarning,
                stacklevel=levels_to_caller(),
            )
        if others:
            named = ", ".join(f"the result{keystr(paths[i][0])} ({type(leaves[i]).__name__})" for i in others)
            warn_or_log(
                f"fn returned {named}: koila.chunked joins tensors, and lists of one string per row, and returns "
                "other objects (a model's key-value cache, a string, a flag) as None when the rows take more than "
                "one chunk",
                UserWarning,
                stacklevel=levels_to_caller(),
            )

    def _unstrided(self, result: Any, index: int, leaf: TensorBase) -> NoReturn:
        path = keystr(flatten_with_path(result, values=self.strings)[index][0])
        if leaf.is_nested:
            raise ValueError(
                f"fn returned a nested tensor (layout {leaf.layout}) at the result{path}: koila.chunked writes each "
                "chunk's rows into one tensor of every row, which only a dense strided tensor can be, and refuses "
                "it whether the rows take one chunk or more. Return it padded (torch.nested.to_padded_tensor) with "
                "a mask, or join the chunks yourself under koila.batch"
            )
        raise ValueError(
            f"fn returned a tensor of layout {leaf.layout} at the result{path}: koila.chunked writes each chunk's "
            "rows into one tensor of every row, which only a strided tensor can be, and refuses it whether the rows "
            "take one chunk or more. Return it dense (.to_dense()), or join the chunks yourself under koila.batch"
        )

    def note_unfit(self, error: BaseException, minimum: int, max_attempts: int | None) -> None:
        """Add to a give-up that a cap ended before one row the note that the result did not fit beside it."""
        first, size, device = cast(tuple[int, int, torch.device], self.unfit)
        if first <= minimum:
            cap, advice = f"minimum={minimum}", "Lower minimum"
        elif max_attempts is not None:
            cap, advice = f"max_attempts={max_attempts}", "Raise max_attempts"
        else:
            cap, advice = "the search", "Lower minimum or raise max_attempts"
        if hasattr(error, "add_note"):  # Python 3.11 on
            error.add_note(
                f"koila.chunked could not allocate its result, {self.rows} rows ({format_bytes(size)} on {device}), "
                f"beside the first chunk at {first} rows, the last size tried; {cap} ended the search before a "
                f"smaller first chunk, beside which it may fit, was tried. {advice}, or pass out= a tensor with "
                "room for every row"
            )

    def refuse(self) -> NoReturn:
        """Raise the error that says the result does not fit beside even a first chunk of one row."""
        first, size, device = cast(tuple[int, int, torch.device], self.unfit)
        rows = "1 row" if first == 1 else f"{first} rows"
        raise torch.OutOfMemoryError(
            f"koila.chunked cannot allocate its result: {self.rows} rows ({format_bytes(size)} on {device}) do "
            f"not fit beside the first chunk even at {rows}, the smallest size it could try, before any other "
            "chunk ran: smaller chunks would not help. Pass out= a tensor with room for every row, on the CPU "
            "(pinned memory for a fast copy) if the device has no room, or cover fewer rows per call"
        )

    def _write(self, target: torch.Tensor, leaf: torch.Tensor, begin: int, end: int, result: Any, index: int) -> None:
        """Check one leaf of a chunk's result against where its rows go, and write them there."""
        dim, rows = self.dim, end - begin
        if leaf.is_nested:  # whose shape torch cannot give
            self._unstrided(result, index, leaf)
        view = target.narrow(dim, begin, rows)
        if view.shape != leaf.shape or (
            leaf.dtype != target.dtype and (self.out is None or not torch.can_cast(leaf.dtype, target.dtype))
        ):
            self._mismatch(view, leaf, begin, end, result, index)
        if self.out is not None and _reads_from(leaf, view):
            leaf = leaf.clone()
        try:
            if (leaf.requires_grad or target.requires_grad) and self.out is None and _plain_autograd():
                _Written.apply(target, leaf, dim, begin)  # type: ignore[no-untyped-call]
            else:
                view.copy_(leaf)
        except RuntimeError:
            if leaf.layout is not torch.strided:  # torch's copy_ from a sparse tensor: said as without out=
                self._unstrided(result, index, leaf)
            raise

    def _matched(self, result: Any) -> list[torch.Tensor | list[Any] | None]:
        """Return ``out``'s tensors in the order of the first result's leaves, matched by key (in any order)."""
        paths = flatten_with_path(result)
        targets: list[torch.Tensor | list[Any] | None] = []
        used: set[int] = set()
        for path, leaf in paths:
            target, depth = _at(self.out, path)
            if leaf is None and (target is None or target is _MISSING):  # nothing to write: None comes back
                self.filled = self.filled or target is _MISSING
                targets.append(None)
                continue
            if not isinstance(target, TensorBase):
                what = "a tensor" if isinstance(leaf, TensorBase) else f"a {type(leaf).__name__}"
                named = path
                if isinstance(leaf, str) and path:  # one of a list of strings: the list is what fn returned
                    what, named = "a list of strings", path[:-1]
                if target is _MISSING:
                    holder = _at(self.out, path[:depth])[0]
                    there = (
                        f"nothing there (out{keystr(path[:depth])} is a {type(holder).__name__} "
                        f"without {keystr(path[depth : depth + 1])})"
                    )
                else:
                    there = f"a {type(target).__name__} there"
                if isinstance(leaf, str):  # lists of strings are joined only without out=
                    there += "; with out=, fn may return only tensors and None: a list of strings per row is "
                    there += "joined where no out= is given"
                self._unmatched(paths, f"fn returned {what} at the result{keystr(named)}, and out has {there}")
            targets.append(cast(torch.Tensor, target))
            used.add(id(target))
        extra = [path for path, leaf in _tensors(self.out) if id(leaf) not in used]
        if extra:
            self._unmatched(paths, f"out has a tensor at out{keystr(extra[0])}, and fn's result has none there")
        return targets

    def _unmatched(self, paths: list[tuple[Any, Any]], first: str) -> NoReturn:
        """Raise the error that says where ``out`` and the result differ, listing where each has tensors."""

        def listed(name: str, found: list[tuple[Any, Any]]) -> str:
            if not found:
                return "no tensor"
            shown = [f"{name}{keystr(path)}" for path, _ in found[:_LISTED]]
            more = f" and {len(found) - _LISTED} more" if len(found) > _LISTED else ""
            return "them at " + ", ".join(shown) + more

        tensors = [(path, leaf) for path, leaf in paths if isinstance(leaf, TensorBase)]
        raise ValueError(
            f"{first}: out needs one tensor at each place where fn's result has one, matched by key (the keys "
            f"of a dict in any order), and nothing (or None) where it has None. The result has "
            f"{listed('the result', tensors)}; out has {listed('out', _tensors(self.out))}"
        )

    def _mismatch(
        self, view: torch.Tensor, leaf: torch.Tensor, begin: int, end: int, result: Any, index: int
    ) -> NoReturn:
        """Raise the error that says how a chunk's result does not fit where its rows go, and what to do."""
        path = keystr(flatten_with_path(result, values=self.strings)[index][0])
        rows, dim = end - begin, self.dim
        at = f"at the result{path} for rows {begin} to {end}"
        if leaf.size(dim) != rows:
            raise ValueError(
                f"fn returned a tensor of shape {tuple(leaf.shape)} and dtype {leaf.dtype} {at}: it has "
                f"{leaf.size(dim)} rows along dim {dim}, and koila.chunked needs one result row per input row, "
                f"{rows} here"
            )
        returned, needed = _row_shape(leaf.shape, dim), _row_shape(view.shape, dim)
        if self.out is not None:
            target = cast(list[torch.Tensor], self.targets)[index]
            if view.shape != leaf.shape:
                shape = list(leaf.shape)
                shape[dim] = self.rows
                raise ValueError(
                    f"fn returned a tensor of shape {tuple(leaf.shape)} {at}, whose rows have shape {returned}, "
                    f"and out{path} has shape {tuple(target.shape)}, whose rows have shape {needed}: out's rows "
                    f"need the shape of the result's (out is never filled by broadcasting). Give out{path} the "
                    f"shape {tuple(shape)}"
                )
            raise ValueError(
                f"fn returned a tensor of dtype {leaf.dtype} {at}, and out{path} has dtype {target.dtype}, which "
                f"{leaf.dtype} cannot be cast to without changing its kind (torch.can_cast({leaf.dtype}, "
                f"{target.dtype}) is False). Give out{path} the dtype {leaf.dtype}, or one that it can be cast "
                f"to, or return {target.dtype} from fn"
            )
        if view.shape != leaf.shape:
            raise ValueError(
                f"fn returned a tensor of shape {tuple(leaf.shape)} {at}, whose rows have shape {returned}, and "
                f"the first chunk's rows there have shape {needed}: every chunk's result must have the first "
                f"chunk's shape, but for its number of rows along dim {dim}"
            )
        raise ValueError(
            f"fn returned a tensor of dtype {leaf.dtype} {at}, and the first chunk returned {view.dtype} there: "
            f"every chunk's result must have the first chunk's dtype at each place. Return {view.dtype} from fn "
            f"for every chunk (with .to({view.dtype}), say)"
        )

    @staticmethod
    def _changed(before: TreeSpec | None, after: TreeSpec | None) -> NoReturn:
        # None: the chunk returned None (a spec of a leaf would read as a value).
        raise ValueError(
            "fn returned results of different structures for different chunks: "
            f"{structure(before)} and then {structure(after)}"
        )

    def _explain(self, result: Any, begin: int, end: int) -> NoReturn:
        """Raise the error that names the leaf of chunk ``begin``'s ``result`` that cannot be joined."""
        leaves = flatten_with_path(result, values=self.strings)
        targets = self.targets
        alone = not any(isinstance(leaf, TensorBase) for _, leaf in leaves)
        for index, (path, leaf) in enumerate(leaves):
            where = f"the result{keystr(path)}"
            target = None if targets is None else targets[index]
            if leaf is None and target is None and self.out is not None:
                continue  # where out has nothing, or None: the result has None there
            if strings(leaf) and len(leaf) == end - begin and not isinstance(target, TensorBase):
                continue  # strings, one per row: joined
            if leaf is None and isinstance(target, TensorBase) and self.out is None:
                raise ValueError(
                    f"fn returned None at {where} for the chunk from row {begin}, where the first chunk returned a "
                    "tensor: a result joined from several chunks needs a tensor there from every chunk (None "
                    "throughout is fine)"
                )
            if type(leaf) in _VALUES and isinstance(target, TensorBase) and self.out is None:
                what = "strings" if strings(leaf) else "values"
                raise ValueError(
                    f"fn returned a {type(leaf).__name__} of {what} at {where} for the chunk from row {begin}, where "
                    "the first chunk returned a tensor"
                )
            if not isinstance(leaf, TensorBase):
                if self.out is not None or target is not None or alone:
                    if type(leaf) in _VALUES:  # name what in it is not a string: a float of .tolist()
                        path, leaf = _first_value(path, leaf) or (path, leaf)
                        where = f"the result{keystr(path)}"
                    # A subclass of dict or list is one leaf to pytree, unless registered with it.
                    kind = next(
                        (base.__name__ for base in (dict, list) if isinstance(leaf, base) and type(leaf) is not base),
                        None,
                    )
                    subclass = "" if kind is None else f" (a subclass of {kind}, which torch.utils._pytree takes whole)"
                    returned = f"fn returned {type(leaf).__name__}{subclass} at {where} for the chunk from row {begin}"
                    if self.out is not None:
                        raise TypeError(
                            f"{returned}; with out=, koila.chunked writes the tensors fn returns into out's, so fn "
                            "must return a tensor at each place where out has one (None is for a function that "
                            "writes its results itself, called without out=)"
                        )
                    raise TypeError(
                        f"{returned}; koila.chunked joins tensors along dim {self.dim}, and lists of one string "
                        "per row, so fn must return those, or a tuple, list or dict that holds them, or None"
                    )
            elif not -leaf.dim() <= self.dim < leaf.dim():
                raise ValueError(
                    f"fn returned a tensor of shape {tuple(leaf.shape)} at {where}, which has no dim "
                    f"{self.dim} to join chunks along"
                )
            elif targets is not None and not isinstance(target, TensorBase):
                raise ValueError(
                    f"fn returned a tensor at {where} for the chunk from row {begin}, where the first chunk "
                    "returned an object that is not a tensor"
                )
        shape = structure(flatten(result, values=self.strings)[1])
        raise TypeError(
            f"fn returned {shape} for the chunk from row {begin}, which holds "
            "nothing to join: no tensor, and no list of one string per row"
        )

    def drop(self) -> None:
        """Let go of what the finished chunks made: an error's traceback holds this object."""
        self.targets = self.single = None

    def finish(self) -> Any:
        if self.out is not None:
            return tree_unflatten(cast(list[Any], self.targets), cast(TreeSpec, self.spec)) if self.filled else self.out
        if self.none:
            return None
        if self.targets is None:
            return self.single
        return tree_unflatten(self.targets, cast(TreeSpec, self.spec))


def _plain_autograd() -> bool:
    """Whether a graph is recorded, by reverse mode alone: no forward-mode level, no torch.func transform."""
    # Under those, _Written (a Function with neither jvp nor setup_context) is refused: copy_ serves them.
    return (
        torch.is_grad_enabled()
        and torch.autograd.forward_ad._current_level < 0
        and not torch._C._are_functorch_transforms_active()
    )


class _Written(torch.autograd.Function):
    """Write a chunk's rows into the result in place, its backward a view of the result's gradient.

    A plain ``copy_`` into a slice makes a node whose backward copies the whole result's gradient,
    once per chunk: a pass of a thousand chunks took half a minute to run backward. The rows of
    the result before they were written had no graph, so its gradient passes on as it is.
    """

    @staticmethod
    def forward(ctx: Any, target: torch.Tensor, leaf: torch.Tensor, dim: int, begin: int) -> torch.Tensor:
        ctx.where, ctx.dtype = (dim, begin, leaf.size(dim)), leaf.dtype
        target.narrow(dim, begin, leaf.size(dim)).copy_(leaf)
        ctx.mark_dirty(target)
        return target

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        dim, begin, rows = ctx.where
        return grad, grad.narrow(dim, begin, rows).to(ctx.dtype), None, None


# Where out and a result differ, the places an error lists of each.
_LISTED = 8

# What _at finds where a container has no such key.
_MISSING = object()


def _at(value: Any, path: tuple[Any, ...]) -> tuple[Any, int]:
    """Return what ``value`` holds at a pytree key path, or ``_MISSING``, and how many keys were found."""
    for depth, key in enumerate(path):
        if isinstance(key, MappingKey):
            found = value[key.key] if isinstance(value, Mapping) and key.key in value else _MISSING
        elif isinstance(key, SequenceKey):
            inside = isinstance(value, (list, tuple)) and 0 <= key.idx < len(value)
            found = value[key.idx] if inside else _MISSING
        elif isinstance(key, GetAttrKey):
            found = getattr(value, key.name, _MISSING)
        else:
            found = _MISSING
        if found is _MISSING:
            return found, depth
        value = found
    return value, len(path)


def _tensors(tree: Any) -> list[tuple[Any, torch.Tensor]]:
    """Return the paths and tensors of ``out``, or of a result, leaving out its ``None``."""
    return [(path, cast(torch.Tensor, leaf)) for path, leaf in flatten_with_path(tree) if isinstance(leaf, TensorBase)]


def _empty(leaf: TensorBase, shape: list[int], inference: bool) -> torch.Tensor:
    """Return an empty tensor like ``leaf`` (memory format, inference or not) of ``shape``."""
    if inference and leaf.is_inference():
        with torch.inference_mode():
            return _empty(leaf, shape, False)
    # In the first chunk's memory format, as torch.cat keeps it: the result's strides do not depend on the memory free.
    for form, dims in ((torch.channels_last, 4), (torch.channels_last_3d, 5)):
        if leaf.dim() == dims and not leaf.is_contiguous() and leaf.is_contiguous(memory_format=form):
            return leaf.new_empty_strided(shape, torch.empty(shape, device="meta", memory_format=form).stride())
    return leaf.new_empty(shape)


def _layout_name(tensor: TensorBase) -> str:
    """Name ``tensor``'s layout as an error says it: nested, or torch's name (sparse_coo, sparse_csr...)."""
    return "nested" if tensor.is_nested else str(tensor.layout).removeprefix("torch.")


def _input_name(split: Split, index: int) -> str:
    """Name the input tensor ``split.tensors[index]`` by the argument it is, or lies in."""
    names = positional_names(split.fn) if split.fn is not None else ()
    arguments = [
        (names[position] if position < len(names) else f"args[{position}]", node) for position, node in split.positional
    ]
    for name, node in [*arguments, *split.named]:
        if node == index if isinstance(node, int) else index in node.leaves():
            return f"the input {name}" if isinstance(node, int) else f"a tensor in the input {name}"
    return "an input tensor"


def _first_value(path: tuple[Any, ...], value: Any) -> tuple[tuple[Any, ...], Any] | None:
    """Return the path and value of the first item of a list or tuple that is not a string (nor ``None``)."""
    if type(value) in _VALUES:
        for index, item in enumerate(value):
            found = _first_value((*path, SequenceKey(index)), item)
            if found is not None:
                return found
        return None
    return None if value is None or type(value) is str else (path, value)


def _row_shape(shape: torch.Size, dim: int) -> tuple[int, ...]:
    """Return a shape without ``dim``: the shape of each of its rows."""
    axis = dim + len(shape) if dim < 0 else dim
    return tuple(shape[:axis]) + tuple(shape[axis + 1 :])


def _grad_leaf(tensor: torch.Tensor) -> bool:
    """Return whether autograd refuses in-place writes into ``tensor``: a leaf that requires grad, or a view of one."""
    if not tensor.requires_grad:
        return False
    base = tensor._base
    return tensor.is_leaf or (base is not None and base.is_leaf)


# The most runs of memory of an out tensor compared element by element (half a MiB of offsets, a few
# milliseconds); past it, a tensor whose strides alone cannot rule out overlap is taken as torch takes it.
_RUNS_CHECKED = 1 << 16


def _runs(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Return the sorted starts and ends, in bytes from its first element, of the runs of memory ``tensor`` covers."""
    dims = sorted((stride, length) for stride, length in zip(tensor.stride(), tensor.shape, strict=True) if length > 1)
    run = 1  # elements that follow each other in memory from each start
    while dims and dims[0][0] == run:
        run *= dims.pop(0)[1]
    if math.prod(length for _, length in dims) > _RUNS_CHECKED:
        return None
    starts = torch.zeros(1, dtype=torch.int64)
    for stride, length in dims:
        starts = (starts[:, None] + torch.arange(length, dtype=torch.int64) * stride).flatten()
    size = tensor.element_size()
    starts = starts.sort().values * size
    return starts, starts + run * size


def _overlaps_itself(tensor: torch.Tensor) -> bool:
    """Return whether two elements of ``tensor`` share memory (an ``expand``), where its strides can tell."""
    if tensor.numel() <= 1 or tensor.layout is not torch.strided or tensor.is_contiguous():
        return False
    dims = sorted((stride, length) for stride, length in zip(tensor.stride(), tensor.shape, strict=True) if length > 1)
    reach = 1  # the elements the dims so far span, from the first to one past the last
    for stride, length in dims:
        if stride == 0:
            return True
        if stride < reach:  # strides that interleave (as_strided, unfold): compared run by run
            runs = _runs(tensor)
            return runs is not None and bool((runs[0][1:] < runs[1][:-1]).any())
        reach += stride * (length - 1)
    return False


def _span(tensor: torch.Tensor) -> tuple[torch.device, int, int] | None:
    """Return a tensor's device and the addresses its elements' bytes lie between; ``None`` where none can be told."""
    if tensor.numel() == 0 or tensor.layout is not torch.strided or tensor.is_nested or tensor.device.type == "meta":
        return None
    try:
        begin = tensor.data_ptr()
        reach = sum(stride * (length - 1) for stride, length in zip(tensor.stride(), tensor.shape, strict=True))
    except (RuntimeError, NotImplementedError):  # a subclass without memory of its own: nothing to compare
        return None
    if begin == 0:
        return None
    return tensor.device, begin, begin + (reach + 1) * tensor.element_size()


def _meeting(spans: list[tuple[torch.device, int, int] | None]) -> list[tuple[int, int]]:
    """Return the pairs of indices ``(i, j)``, ``i < j``, of ``spans`` on one device whose addresses meet."""
    pairs: list[tuple[int, int]] = []
    reaching: list[tuple[int, int]] = []  # the spans begun so far, by where they end
    for begin, index in sorted((span[1], index) for index, span in enumerate(spans) if span is not None):
        device, _, end = cast(tuple[torch.device, int, int], spans[index])
        reaching = [(reach, other) for reach, other in reaching if reach > begin]
        for _, other in reaching:
            if cast(tuple[torch.device, int, int], spans[other])[0] == device:
                pairs.append((min(index, other), max(index, other)))
        reaching.append((end, index))
    return sorted(pairs)


def _same_elements(first: torch.Tensor, second: torch.Tensor) -> bool:
    """Return whether two tensors are views of the same elements, row for row: ``out=x``."""
    if first.data_ptr() != second.data_ptr() or first.dtype != second.dtype or first.shape != second.shape:
        return False
    pairs = zip(first.stride(), second.stride(), first.shape, strict=True)
    return all(stride == other or length == 1 for stride, other, length in pairs)


def _refuse_shared(paths: list[tuple[Any, Any]]) -> None:
    """Raise the error that names two of ``out``'s tensors that share memory, if any do."""
    for index, other in _meeting([_span(leaf) for _, leaf in paths]):  # usually none
        (path, leaf), (other_path, tensor) = paths[index], paths[other]
        if _share(leaf, tensor):
            raise ValueError(
                f"out{keystr(path)} and out{keystr(other_path)} share memory (the same tensor, or views "
                "of one that overlap): koila.chunked writes a result into each, and the later write would "
                "overwrite the earlier's rows. Give each its own memory (a tensor of its own, or .clone())"
            )


def _share(first: torch.Tensor, second: torch.Tensor) -> bool:
    """Return whether two tensors whose addresses meet have an element in the same memory, where it can be told."""
    shift = second.data_ptr() - first.data_ptr()  # in bytes: they may lie in two storages of one memory
    if shift == 0:
        return True
    size = first.element_size()
    same = first.shape == second.shape and first.stride() == second.stride() and first.dtype == second.dtype
    if same and shift % size == 0:
        shifted = _shifted_onto(first, shift // size)
        if shifted is not None:  # column groups of one buffer, told apart in microseconds
            return shifted
    runs, others = _runs(first), _runs(second)
    if runs is None or others is None:
        return False
    starts, ends = others[0] + shift, others[1] + shift
    # The last run of ``second`` that starts before each run of ``first`` ends: they share memory if it ends
    # after that run starts (the runs of ``second`` do not overlap each other, so their ends are sorted too).
    last = torch.searchsorted(starts, runs[1]) - 1
    reached = ends[last.clamp(min=0)]
    return bool(((last >= 0) & (reached > runs[0])).any())


def _shifted_onto(tensor: torch.Tensor, shift: int) -> bool | None:
    """Return whether ``tensor`` moved by ``shift`` elements meets itself; ``None`` where its strides interleave."""
    dims = sorted((stride, length) for stride, length in zip(tensor.stride(), tensor.shape, strict=True) if length > 1)
    reach = 0  # how far the dims so far reach, in elements
    for stride, length in dims:
        if stride <= reach:
            return None
        reach += stride * (length - 1)
    # Each dim's index moves by a whole number of its strides, and the smaller dims together reach less than
    # one: the shift is met by at most the two nearest multiples at each dim, from the largest.
    remainders = [abs(shift)]
    for stride, length in reversed(dims):
        remainders = [
            rest - steps * stride
            for rest in remainders
            for steps in {rest // stride, -(-rest // stride)}
            if abs(steps) < length
        ]
    return 0 in remainders


def _apart(leaves: list[Any], targets: list[Any]) -> list[Any]:
    """Return the leaves, those in the memory of another leaf's place in ``out`` copied: it is written first."""
    # out=(x, saved) of fn returning (rows * 10, rows): writing x's rows changed the rows saved was given.
    # By address, as refuse_overlap compares: the same memory may be two storage objects (from_numpy).
    places = len(targets)
    spans = [_span(target) if isinstance(target, torch.Tensor) else None for target in targets]
    spans += [_span(leaf) if isinstance(leaf, torch.Tensor) else None for leaf in leaves]
    kept = list(leaves)
    for place, other in _meeting(spans):  # place < other: a place and a leaf, or two places (side by side)
        if place < places <= other and other - places != place:
            kept[other - places] = leaves[other - places].clone()
    return kept


def _reads_from(leaf: torch.Tensor, view: torch.Tensor) -> bool:
    """Return whether ``leaf`` lies in ``out``'s memory other than as ``view``'s own elements, as they are."""
    # fn may return its rows reshaped (``rows.mT`` of ``out=x``): copy_ would overwrite elements it has yet
    # to read, and torch's overlap check gives up on memory that is not dense, so the rows come out wrong.
    return bool(_meeting([_span(leaf), _span(view)])) and not _same_elements(leaf, view)
