"""A call's arguments as a tree: the tensors that hold its rows, found once, and the arguments of any slice.

Every front end that splits rows uses this one walk; each slice gets the same containers back, copied
where a tensor changed. How each container is remade (``docs/batches.rst``) is decided as the walk finds
it, on every call: one that holds a tensor and cannot be remade fails the first call, not the first that
runs short of memory. The tensors that share the size along ``dim`` are split; 0-dimensional and one-row
tensors broadcast and pass whole; any other size is ambiguous, an error (``docs/accumulate.rst``).
"""

from __future__ import annotations

import builtins
import copy
import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any, cast

import torch
from torch.nn.utils.rnn import PackedSequence

from koila_retry._common.contents import Contents
from koila_retry._common.tensors import TensorBase
from koila_retry._common.units import checked_dim

__all__ = [
    "CONSTRUCTED",
    "Split",
    "faithful",
    "is_structseq",
    "positional_names",
    "remake",
    "shallow_copy",
    "state_of",
    "tuple_remaking",
]

# Deeper than any batch is nested; a walk that goes deeper is following a cycle or a mistake.
DEPTH = 32

# Types that are never containers, answered without the slower checks.
_LEAVES = frozenset({int, float, bool, str, bytes, type(None), torch.Size, torch.dtype, torch.device, slice})

# How a container is taken apart and put back together. _TUPLE_LIKE and _MAPPING are
# decided further (_remaking) once the walk knows the container holds a tensor.
(
    _LIST,
    _TUPLE,
    _NAMED,
    _STRUCTSEQ,
    _TUPLE_LIKE,
    _TUPLE_NEW,
    _TUPLE_ITERABLE,
    _TUPLE_ARGUMENTS,
    _SEQUENCE,
    _DICT,
    _MAPPING,
    _COPIED,
    _MAPPING_DICT,
    _MAPPING_KEYWORDS,
    _MAPPING_FILLED,
    _FIELDS,
) = builtins.range(16)
# Remade by a constructor of the user's, which is trusted only as far as it gives back
# exactly the items it was given.
CONSTRUCTED = frozenset({_TUPLE_ITERABLE, _TUPLE_ARGUMENTS, _MAPPING_DICT, _MAPPING_KEYWORDS, _MAPPING_FILLED})
_TUPLES = frozenset({_STRUCTSEQ, _TUPLE_NEW, _TUPLE_ITERABLE, _TUPLE_ARGUMENTS})


class _Node:
    """A container that holds tensors: its children that do, by key, and how to remake it."""

    __slots__ = ("children", "kind", "per_row", "rows", "splits", "value")

    def __init__(self, value: Any, kind: int, children: list[tuple[Any, _Node | int]]) -> None:
        self.value, self.kind, self.children = value, kind, children
        self.splits = True  # whether a tensor that is split lies below: else the container passes as it is
        self.per_row = False  # a list of records, one per row: each piece gets its rows' records (see Split)
        self.rows = 0  # the call's rows where they are along dim 0, else 0

    def marked(self, split: set[int], rows: int) -> bool:
        """Note whether a tensor in ``split`` lies below, or the node is per row, and return it."""
        self.rows = rows
        # Every child is marked (a list, not a generator that any() would stop): each needs its rows.
        marks = [child in split if isinstance(child, int) else child.marked(split, rows) for _, child in self.children]
        self.splits = self.per_row or any(marks)
        return self.splits

    def below(self) -> Iterator[int]:
        """Yield the ``id`` of every node below."""
        for _, child in self.children:
            if not isinstance(child, int):
                yield id(child)
                yield from child.below()

    def leaves(self) -> Iterator[int]:
        """Yield the index of every tensor below."""
        for _, child in self.children:
            if isinstance(child, int):
                yield child
            else:
                yield from child.leaves()

    def remade(self, leaves: list[Any], every: bool, span: tuple[int, int]) -> Any:
        """Return the container with each child remade from ``leaves``; unless ``every``, only where one is split."""
        kind, value = self.kind, self.value
        if not (every or self.splits):
            return value
        if self.per_row:  # the records of the rows in span, remade only to take other leaves (every)
            records = [*value] if not every else self._remade(leaves, every, span)
            begin, end = span
            taken = [records[row % len(records)] for row in builtins.range(begin, end)]  # past the end: again
            return taken if kind == _LIST else tuple(taken)
        return self._remade(leaves, every, span)

    def _remade(self, leaves: list[Any], every: bool, span: tuple[int, int]) -> Any:
        kind, value = self.kind, self.value
        changed = [
            (key, leaves[child] if isinstance(child, int) else child.remade(leaves, every, span))
            for key, child in self.children
        ]
        if kind in (_LIST, _TUPLE):
            items = list(value)
            for key, item in changed:
                items[key] = item
            return items if kind == _LIST else tuple(items)
        if kind == _NAMED:
            return value._replace(**dict(changed))
        if kind == _DICT:
            new = dict(value)
            new.update(changed)
            return new
        if kind == _FIELDS:
            new = copy.copy(value)
            for key, item in changed:
                if type(key) is not _Attribute:
                    object.__setattr__(new, key, item)  # frozen dataclasses too
            _settle(value, new, changed)
            return new
        if kind in (_SEQUENCE, _COPIED):
            new = copy.copy(value)  # keeps the type and its other state (a BatchEncoding's encodings)
            if new is value:
                raise TypeError(
                    f"koila_retry cannot copy a {type(value).__name__}: copy.copy() returned the same object"
                )
            for key, item in changed:
                if type(key) is not _Attribute:
                    new[key] = item
            _settle(value, new, changed)
            # From the instance's dict, not getattr(): an AttrDict's __getattr__ raises KeyError.
            state = getattr(value, "__dict__", None)
            encodings = state.get("_encodings") if isinstance(state, dict) else None
            if isinstance(encodings, list) and self.splits:
                # A fast tokenizer's BatchEncoding, whose word_ids(i), tokens(i) ... read encoding i: a piece
                # keeps its own rows' encodings, or none (those raise) where they are not one per row.
                begin, end = span
                new._encodings = encodings[begin:end] if len(encodings) == self.rows else None  # type: ignore[attr-defined]
            return new
        return _remade_around(value, kind, changed)


def _state(value: Any) -> dict[str, Any] | None:
    """Return the attributes ``value`` holds of its own (its ``__dict__``), or ``None``."""
    try:  # not getattr(): a __getattr__ of the user's is not asked
        state = object.__getattribute__(value, "__dict__")
    except AttributeError:
        return None
    return state if isinstance(state, dict) else None


def _apart(value: Any) -> tuple[frozenset[str], frozenset[str]]:
    """Return the names of ``value``'s dataclass fields, and those its cached properties keep their values under."""
    cls: Any = type(value)  # Any: the cache takes Hashable, which typeshed does not take a type for
    return _apart_of(cls)


@functools.lru_cache(maxsize=256)
def _apart_of(cls: type[Any]) -> tuple[frozenset[str], frozenset[str]]:
    fields = (
        frozenset(field.name for field in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else frozenset()
    )
    cached = frozenset(
        member.attrname or name
        for klass in cls.__mro__
        for name, member in vars(klass).items()
        if isinstance(member, functools.cached_property)
    )
    return fields, cached


def _settle(value: Any, new: Any, changed: list[tuple[Any, Any]]) -> None:
    """Make the attributes of ``new``, a copy of ``value``, its own rows' where ``value``'s are its items or rows."""
    state = _state(value)
    if not state:
        return
    if state is value:  # the attributes are the items (``self.__dict__ = self``): the copy's are its own items
        object.__setattr__(new, "__dict__", new)
        return
    mine = _state(new)
    if mine is None or mine is state:
        if any(type(key) is _Attribute for key, _ in changed):
            raise TypeError(
                f"koila_retry cannot copy a {type(value).__name__}: copy.copy() shares its attributes with the "
                "original, and the copy's tensor attributes must hold its own rows"
            )
        return
    # A cached property's value is the whole batch's: dropped, it is computed again from the piece when read.
    for name in _apart(value)[1].intersection(mine):
        del mine[name]
    mapping = isinstance(value, Mapping)
    for key, item in changed:
        if type(key) is _Attribute:
            mine[key] = item
        elif mapping and key in state and state[key] is value[key]:
            mine[key] = item  # an attribute that is the item of its name, kept in step with it


def _remade_around(value: Any, kind: int, changed: list[tuple[Any, Any]]) -> Any:
    """Return a struct sequence, tuple subclass or mapping remade with the ``changed`` items."""
    items: list[Any] | dict[Any, Any]
    if kind in _TUPLES:
        items = list(value)
        for key, item in changed:
            if type(key) is not _Attribute:
                items[key] = item
    else:
        items = dict(value)
        items.update(changed)
    new = remake(type(value), kind, items, state_of(value, kind))
    if kind == _TUPLE_NEW:  # its attributes copied, as copy.copy would: they must be its rows'
        _settle(value, new, changed)
    if kind in CONSTRUCTED and not faithful(new, type(value), items):
        raise TypeError(
            f"koila_retry remade a {type(value).__qualname__} with its constructor, as it did the whole one, "
            "and got back other items than it gave: the constructor treats these items differently"
        )
    return new


def _records(items: Sequence[Any]) -> bool:
    """Return whether ``items`` are all mappings: one record per row if as many as the rows."""
    return all(isinstance(item, Mapping) for item in items)


def _texts(items: Sequence[Any]) -> bool:
    """Return whether ``items`` are strings, lists or tuples of strings (a row's words) or ``None``."""
    # All None too: a batch whose rows all lack a name is split as one where one row has it.
    for item in items:
        if item is None or type(item) is str:
            continue
        if not (isinstance(item, (list, tuple)) and all(type(word) is str for word in item)):
            return False
    return True


def _kind(value: Any) -> int | None:
    """Return how ``value`` is taken apart, or ``None`` if it is a leaf."""
    cls = type(value)
    if cls in _LEAVES:
        return None
    if cls is list:
        return _LIST
    if cls is tuple:
        return _TUPLE
    if cls is dict:
        return _DICT
    if isinstance(value, tuple):
        if hasattr(cls, "_fields"):  # the class's: an instance's __getattr__ may raise anything
            return _NAMED
        return _STRUCTSEQ if is_structseq(cls) else _TUPLE_LIKE
    if isinstance(value, list):
        return _SEQUENCE
    if isinstance(value, Mapping):
        return _MAPPING
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _FIELDS
    return None


def _items(value: Any, kind: int) -> Iterator[tuple[Any, Any]]:
    if kind == _NAMED:
        return zip(value._fields, value)
    if kind == _FIELDS:
        return ((field.name, getattr(value, field.name)) for field in dataclasses.fields(value))
    if kind in (_DICT, _MAPPING):
        return iter(value.items())
    return enumerate(value)


def is_structseq(cls: type) -> bool:
    """Return whether ``cls`` is a struct sequence, such as ``torch.return_types.max`` or ``os.stat_result``."""
    return cls.__bases__ == (tuple,) and all(
        isinstance(getattr(cls, name, None), int) for name in ("n_fields", "n_sequence_fields", "n_unnamed_fields")
    )


def tuple_remaking(value: tuple[Any, ...]) -> int | None:
    """Return how a tuple subclass that is not a named tuple is remade around new items, or ``None``."""
    cls = type(value)
    if is_structseq(cls):
        return _STRUCTSEQ
    if cls.__new__ is tuple.__new__:
        return _TUPLE_NEW
    items = list(value)
    return _first_faithful(value, (_TUPLE_ITERABLE, _TUPLE_ARGUMENTS), items)


def _remaking(value: Any, kind: int) -> int | None:
    """Return how a container found holding a tensor is remade, or ``None`` if it cannot be."""
    if kind == _TUPLE_LIKE:
        return tuple_remaking(value)
    if kind != _MAPPING:
        return kind
    if _copies(value):
        return _COPIED
    ways = (_MAPPING_DICT, _MAPPING_KEYWORDS, _MAPPING_FILLED)
    return _first_faithful(value, ways if isinstance(value, MutableMapping) else ways[:2], dict(value))


def _copies(value: Any) -> bool:
    """Return whether a mapping is remade with ``copy.copy``."""
    # A copy.copy of a mapping without a __copy__ of its own would share with the caller's mapping the
    # storage the new items go into.
    return isinstance(value, dict) or (isinstance(value, MutableMapping) and hasattr(type(value), "__copy__"))


def _first_faithful(value: Any, ways: tuple[int, ...], items: Any) -> int | None:
    """Return the first way that remakes ``value`` from its own items faithfully, or ``None``."""
    for way in ways:
        try:
            new = remake(type(value), way, items, None)
        except Exception:  # a constructor that takes its items otherwise: try the next way
            continue
        if faithful(new, type(value), items):
            return way
    return None


def shallow_copy(mapping: Any) -> Any:
    """Return a mapping of the same type around the same items, as a split remakes one; itself if it cannot be."""
    if type(mapping) is dict:
        return dict(mapping)
    if not isinstance(mapping, MutableMapping):  # nothing to change in it, or not a mapping
        return mapping
    try:
        way = _remaking(mapping, _MAPPING)
        if way == _COPIED:
            new = copy.copy(mapping)  # keeps its other state (a BatchEncoding's encodings)
            return mapping if new is mapping else new
        return mapping if way is None else remake(type(mapping), way, dict(mapping), None)
    except Exception:  # a mapping that cannot be copied runs as it did
        return mapping


def remake(cls: type[Any], kind: int, items: Any, state: dict[str, Any] | None) -> Any:
    """Return a container of type ``cls`` (a struct sequence, tuple subclass or mapping) around ``items``."""
    if kind == _STRUCTSEQ:
        return cls(items, state) if state else cls(items)
    if kind == _TUPLE_NEW:
        new = tuple.__new__(cls, items)
        if state:  # as copy.copy would: the attributes set on the instance
            new.__dict__.update(state)
        return new
    if kind in (_TUPLE_ITERABLE, _MAPPING_DICT):
        return cls(items)
    if kind == _TUPLE_ARGUMENTS:
        return cls(*items)
    if kind == _MAPPING_KEYWORDS:
        return cls(**items)
    if kind == _MAPPING_FILLED:
        new = cls()
        for key, item in items.items():
            new[key] = item
        return new
    raise AssertionError(f"no way {kind} to remake a {cls.__qualname__}")  # pragma: no cover


def state_of(value: Any, kind: int) -> dict[str, Any] | None:
    """Return what of ``value`` besides its items a container remade the ``kind`` way needs, or ``None``."""
    cls = type(value)
    if kind == _STRUCTSEQ:  # the fields beyond the sequence: os.stat_result's st_mtime_ns
        return value.__reduce__()[1][1] if cls.n_fields > cls.n_sequence_fields else None
    if kind == _TUPLE_NEW:
        return getattr(value, "__dict__", None) or None
    return None


def faithful(new: Any, cls: type[Any], items: Any) -> bool:
    """Return whether ``new`` is a ``cls`` and holds exactly ``items``, the same objects in the same places."""
    try:
        if type(new) is not cls or len(new) != len(items):
            return False
        if isinstance(items, dict):
            return all(new[key] is item for key, item in items.items())
        return all(mine is item for mine, item in zip(new, items, strict=True))
    except Exception:  # a container that cannot even be read back is not faithful
        return False


@functools.lru_cache(maxsize=256)
def _sample_of(shape: torch.Size, dtype: torch.dtype, dim: int) -> tuple[tuple[tuple[int, ...], str], int]:
    """Return one sample's size class and bytes, for a tensor split along ``dim``: the same every call of a loop."""
    axis = dim + len(shape) if dim < 0 else dim
    rest = shape[:axis] + shape[axis + 1 :]
    if any(type(length) is not int for length in rest):
        raise TypeError("a nested tensor's ragged length")  # which Split refuses by name
    return _whole_of(rest, dtype), math.prod(rest) * dtype.itemsize


@functools.lru_cache(maxsize=256)
def _whole_of(shape: tuple[Any, ...], dtype: torch.dtype) -> tuple[tuple[int, ...], str]:
    """Return the size class of a shape: each length up to a power of two, as a key holds it."""
    # A nested tensor's ragged length is a symbol made anew for each tensor (j1, j2): one class for all.
    return tuple(
        (1 << (length - 1).bit_length() if length > 1 else length) if type(length) is int else -1 for length in shape
    ), str(dtype)


_STRIDED = torch.strided


def _narrowed(tensor: torch.Tensor, dim: int, begin: int, length: int, front_end: str) -> torch.Tensor:
    """Return rows ``[begin, begin + length)`` of a tensor that is not strided: a copy (sparse ones have no views)."""
    if tensor.layout is not torch.sparse_coo:
        raise ValueError(
            f"{front_end} cannot split a tensor of layout {tensor.layout} along dim {dim}: it splits strided tensors "
            "and sparse COO ones. Pass it dense (.to_dense()) or as COO (.to_sparse())"
        )
    axis = dim + tensor.dim() if dim < 0 else dim
    return tensor.narrow_copy(axis, begin, min(length, tensor.shape[axis] - begin))


class Split:
    """The tensors of one call's arguments, which of them hold its rows, and the arguments of any slice."""

    __slots__ = (
        "args",
        "attributes",
        "device",
        "dim",
        "fn",
        "front_end",
        "kwargs",
        "named",
        "per_sample",
        "positional",
        "records",
        "rows",
        "sample",
        "split",
        "tensors",
    )

    def __init__(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        dim: int,
        front_end: str,
        fn: Callable[..., Any] | None = None,
    ) -> None:
        if type(dim) is not int:  # numpy's too; the usual int without a call
            dim = checked_dim(dim)
        self.args, self.kwargs, self.dim, self.front_end, self.fn = args, kwargs, dim, front_end, fn
        # Every tensor in the arguments, split or passed whole, in order, and where each
        # lies (kept only for errors).
        self.tensors: list[torch.Tensor] = []
        paths: list[tuple[Any, ...]] = []
        # What holds tensors, by position and by keyword: a tensor's index, or a container.
        self.positional: list[tuple[int, _Node | int]] = []
        self.named: list[tuple[str, _Node | int]] = []
        # Lists and tuples of mappings (a detection batch's targets, one dict per image), and of strings in an
        # argument: one record per row where there are as many as the rows the other tensors share (see _rows).
        self.records: list[_Node] = []
        # The tensors held as attributes beside a container's fields or items: split where they have the
        # rows, else passed whole, never ambiguous (a dataclass's class weights are its own, not a row's).
        self.attributes: set[int] = set()
        for position, value in enumerate(args):
            found = self._walk(value, (position,), paths)
            if found is not None:
                self.positional.append((position, found))
        for name, value in kwargs.items():
            found = self._walk(value, (name,), paths)
            if found is not None:
                self.named.append((name, found))
        try:
            self.rows, self.split = self._rows(paths)
        except (RuntimeError, AttributeError, TypeError):
            self._refuse_nested()
            raise
        chosen = set(self.split)
        # Whether the split is along each tensor's first dim, where a tokenizer's encodings are one per row.
        along_rows = dim == 0 or (dim < 0 and all(self.tensors[i].dim() + dim == 0 for i in self.split))
        for _, node in (*self.positional, *self.named):
            if not isinstance(node, int):
                node.marked(chosen, self.rows if along_rows else 0)
        tensors = [self.tensors[i] for i in self.split]
        self.device: torch.device = tensors[0].device
        # The key of the workload: each sample's shape in size classes (each length up to
        # a power of two), so that a batch padded to 37 tokens and one padded to 50 meet
        # the size the other settled on; ``per_sample``, the exact bytes, tells them apart.
        sample, per_sample = [], 0
        for tensor in tensors:
            try:
                entry, size = _sample_of(tensor.shape, tensor.dtype, dim)
            except (RuntimeError, AttributeError, TypeError):
                self._refuse_nested()
                raise
            sample.append(entry)
            per_sample += size
        if len(tensors) < len(self.tensors):
            # What passes whole takes memory too: its shape is part of the workload. Not the records' tensors,
            # whose sizes change from batch to batch (boxes per image): a key per batch would learn nothing.
            recorded = {index for node in self.records if node.per_row for index in node.leaves()}
            # In size classes too: a (1, n) position_ids of each padded length, a key each, retried each (71G).
            sample.extend(
                _whole_of(tuple(tensor.shape), tensor.dtype)
                for index, tensor in enumerate(self.tensors)
                if index not in chosen and index not in recorded
            )
        self.sample = tuple(sample)
        self.per_sample = per_sample

    def _walk(self, value: Any, path: tuple[Any, ...], paths: list[tuple[Any, ...]]) -> _Node | int | None:
        if isinstance(value, TensorBase):
            self.tensors.append(value)  # type: ignore[arg-type]
            paths.append(path)
            return len(self.tensors) - 1
        kind = _kind(value)
        if kind is None:
            return None
        if kind == _NAMED and isinstance(value, PackedSequence):
            raise ValueError(
                f"{self.front_end} cannot split the PackedSequence {self._label(path)}: its data holds every "
                "sequence's steps packed together, time step by time step, not one row per sequence. Pass the "
                "padded tensor and the lengths instead, and pack them inside the function "
                "(torch.nn.utils.rnn.pack_padded_sequence); with dim=1 (time-major), the lengths as "
                "lengths[None], of shape (1, rows), and lengths[0] inside"
            )
        if len(path) > DEPTH:
            raise ValueError(
                f"{self.front_end} looks for tensors in containers nested at most {DEPTH} deep, and "
                f"{self._label(path)} is deeper (a container that holds itself?)"
            )
        if kind in (_LIST, _TUPLE) and value and _texts(value):
            # Strings one per row (file names, texts, a row's words: what a DataLoader's collate makes of a string
            # field) are a list of records inside an argument. One given as an argument of its own (class prompts,
            # label names) is the call's, and would be split where its length met the rows: it passes whole.
            if len(path) == 1:
                return None
            node = _Node(value, kind, [])
            self.records.append(node)
            return node
        children: list[tuple[Any, _Node | int]] = []
        names = _field_names(value) if kind == _STRUCTSEQ else ()
        for key, item in _items(value, kind):
            label = _Attribute(key) if kind in (_FIELDS, _NAMED) else _Attribute(names[key]) if names else key
            found = self._walk(item, (*path, label), paths)
            if found is not None:
                children.append((key, found))
        if (
            kind in (_FIELDS, _SEQUENCE)
            or (kind == _MAPPING and _copies(value))
            or (kind == _TUPLE_LIKE and tuple_remaking(value) == _TUPLE_NEW)
        ):
            self._attributes(value, path, paths, children)  # a copy keeps them: they must be its rows'
        # Records hold a row's values, tensors or not (ids, per-row scales): a list of them is a node.
        records = kind in (_LIST, _TUPLE) and len(value) > 0 and _records(value)
        if not children and not records:
            return None
        # Decided here, on every call, and not when a slice is first made: a container
        # that cannot be remade fails the first call, not the first that runs short.
        how = _remaking(value, kind)
        if how is None:
            raise TypeError(self._unremakable(value, kind, path))
        node = _Node(value, how, children)
        if records:
            self.records.append(node)
        return node

    def _attributes(
        self, value: Any, path: tuple[Any, ...], paths: list[tuple[Any, ...]], children: list[tuple[Any, _Node | int]]
    ) -> None:
        """Add to ``children`` the tensors ``value`` holds as attributes of its own: split where they have the rows."""
        state = _state(value)
        if not state or state is value:  # none, or they are the items (see _settle)
            return
        fields, cached = _apart(value)
        for name, item in state.items():
            # Only tensors held directly: a BatchEncoding's data and encodings are its items and rows already.
            if not isinstance(item, TensorBase) or type(name) is not str or name in fields or name in cached:
                continue
            if isinstance(value, Mapping) and name in value and value[name] is item:
                continue  # the item of its name (a ModelOutput's), which _settle keeps in step
            key = _Attribute(name)
            index = cast(int, self._walk(item, (*path, key), paths))
            self.attributes.add(index)
            children.append((key, index))

    def _unremakable(self, value: Any, kind: int, path: tuple[Any, ...]) -> str:
        """Say that the container at ``path`` cannot be remade around slices, why, and what to do."""
        name = type(value).__qualname__
        where = f"{self.front_end} splits the tensors in {self._label(path)}, a {name}, and cannot remake a {name}"
        if kind == _TUPLE_LIKE:
            return (
                f"{where}: it is a tuple subclass with a __new__ of its own that takes neither its items as one "
                "iterable (as tuple's does) nor one argument per item. This is checked on every call, split "
                f"or not. Make {name} a NamedTuple or a dataclass, let its __new__ take its items, or pass "
                "the tensors in a tuple, list or dict"
            )
        mutable = isinstance(value, MutableMapping)
        return (
            f"{where}: it is a {'MutableMapping' if mutable else 'read-only Mapping'} that is not a dict and has "
            "no __copy__, and its constructor takes neither a dict of its items nor its items as keywords"
            f"{' nor, called with no arguments, item assignment' if mutable else ''}. This is checked on every "
            f"call, split or not. Let {name}'s constructor take a dict or keywords, give it a __copy__ (and a "
            "__setitem__), or pass the tensors in a dict"
        )

    def _rows(self, paths: list[tuple[Any, ...]]) -> tuple[int, list[int]]:
        """Return the rows and which tensors hold them; raise the error that names an ambiguous one."""
        sizes = self._sizes(paths)
        if self.records:
            # The rows the tensors outside every list of records share decide which lists are per row: those
            # that hold as many records. Their tensors belong to their records, and pass whole with them.
            inner = {id(node): set(node.leaves()) for node in self.records}
            beneath = set().union(*inner.values())
            outside = [size if index not in beneath else -1 for index, size in enumerate(sizes)]
            rows = self._shared(outside, paths)[0]
            if rows == -1 and 1 in outside:  # one row outside, none more: one image and its one dict of boxes
                rows = 1
            taken: set[int] = set()  # the nodes inside a list of records per row, which are its records'
            for node in reversed(self.records):  # found innermost first: a list inside a record is the record's
                node.per_row = len(node.value) == rows and id(node) not in taken
                if node.per_row:
                    taken.update(node.below())
            whole = {index for node in self.records if node.per_row for index in inner[id(node)]}
            sizes = [-1 if index in whole else size for index, size in enumerate(sizes)]
        attributes, given = self.attributes, sizes
        if attributes:  # the rows are the other tensors' (see __init__), unless attributes alone hold any
            sizes = [-1 if index in attributes else size for index, size in enumerate(sizes)]
            if all(size == -1 for size in sizes):
                sizes = given
        rows = self._shared(sizes, paths)[0]
        if rows == -1:
            if 1 not in sizes:
                shown = [type(value).__name__ for value in (*self.args, *self.kwargs.values())]
                what = "none of the arguments is a tensor" if not sizes else "every tensor is 0-dimensional"
                other = (
                    ": koila.range takes data that is not a tensor (a list of texts, a dataset), by index"
                    if self.front_end == "koila.chunked" and not sizes
                    else ""
                )
                raise ValueError(
                    f"{self.front_end} splits the tensors in its arguments along dim {self.dim}, and {what} "
                    f"(got {shown}){other}"
                )
            rows = 1
        return rows, [index for index, size in enumerate(given if attributes else sizes) if size == rows]

    def _sizes(self, paths: list[tuple[Any, ...]]) -> list[int]:
        """Return each tensor's size along ``dim``, -1 for a 0-dimensional one."""
        dim, sizes = self.dim, []
        for index, tensor in enumerate(self.tensors):
            shape = tensor.shape
            if not shape:
                sizes.append(-1)  # 0-dimensional: no rows, passes whole
                continue
            axis = dim + len(shape) if dim < 0 else dim
            if not 0 <= axis < len(shape):
                if index in self.attributes:  # the instance's own state, without the dim: it passes whole
                    sizes.append(-1)
                    continue
                raise ValueError(
                    f"dim {dim} is out of range for the tensor {self._label(paths[index])} of shape {tuple(shape)}; "
                    f"allowed: [{-len(shape)}, {len(shape) - 1}]"
                    # A value per row one dim short (a time-major batch's lengths): how to make it reach dim.
                    + (
                        f". To split a value per row along dim {dim}, give it a dim of size 1 in front (of shape "
                        f"{(1, *shape)}, with [None]) and take [0] of it inside the function"
                        if len(shape) == dim
                        else ""
                    )
                )
            sizes.append(shape[axis])
        return sizes

    def _shared(self, sizes: list[int], paths: list[tuple[Any, ...]]) -> tuple[int, int]:
        """Return the size along ``dim`` that the tensors which are not broadcast share, and the first; -1 if none."""
        rows = first = -1
        for index, size in enumerate(sizes):
            if size > 1 or size == 0:
                if rows == -1:
                    rows, first = size, index
                elif size != rows:
                    raise ValueError(
                        f"every tensor that is split must have the same size along dim {self.dim} (one row broadcasts, "
                        f"and passes whole): the tensor {self._label(paths[first])} has {rows}, "
                        f"the tensor {self._label(paths[index])} has {size}{self._listed(paths[first], paths[index])}"
                    )
        return rows, first

    def _listed(self, *paths: tuple[Any, ...]) -> str:
        """Return a hint for the first of ``paths`` that lies in a list of tensors, or nothing."""
        for path in paths:
            try:  # only for the error: the container the tensor lies in, from the arguments
                within = self.args[path[0]] if isinstance(path[0], int) else self.kwargs[path[0]]
                for key in path[1:-1]:
                    within = getattr(within, key) if isinstance(key, _Attribute) else within[key]
            except Exception:  # a container that cannot be read back the way the walk did: no hint
                continue
            if len(path) > 1 and type(within) in (list, tuple) and all(isinstance(i, TensorBase) for i in within):
                return (
                    f". {self._label(path[:-1])} is a {type(within).__name__} of tensors, and each of them is split "
                    f"along dim {self.dim} as a batch of its own: a list of one tensor per row (a batch's images) "
                    "must be stacked (torch.stack), or padded, into one tensor"
                )
        return ""

    def _refuse_nested(self) -> None:
        """Raise the error that names a nested tensor among the arguments, whose shape torch cannot give whole."""
        if any(tensor.is_nested for tensor in self.tensors):
            raise ValueError(
                f"{self.front_end} cannot split a nested tensor: torch gives no size along its ragged dimension "
                "and cannot narrow it along the rows. Pass the rows padded (torch.nested.to_padded_tensor) with a "
                "mask"
            ) from None

    def _label(self, path: tuple[Any, ...]) -> str:
        """Name a value by where it lies: ``batch['input_ids']``, ``args[1][0]``, ``mask``."""
        head = path[0]
        if isinstance(head, str):
            label = head
        else:
            names = positional_names(self.fn) if self.fn is not None else ()
            label = names[head] if head < len(names) else f"args[{head}]"
        for key in path[1:]:
            label += f".{key}" if isinstance(key, _Attribute) else f"[{key!r}]"
        return label

    def rebuilt(
        self, leaves: list[Any], span: tuple[int, int], every: bool = False
    ) -> tuple[list[Any], dict[str, Any]]:
        """Return the arguments of rows ``span``, tensors replaced by ``leaves`` (unless ``every``, where split)."""
        args, kwargs = list(self.args), self.kwargs
        for position, node in self.positional:
            args[position] = leaves[node] if isinstance(node, int) else node.remade(leaves, every, span)
        if self.named:
            kwargs = dict(kwargs)
            for name, node in self.named:
                kwargs[name] = leaves[node] if isinstance(node, int) else node.remade(leaves, every, span)
        return args, kwargs

    def contents(self) -> Contents | None:
        """Return what the containers that hold tensors hold now, to put back; None where there are none."""
        held = [node.value for _, node in (*self.positional, *self.named) if isinstance(node, _Node)]
        return Contents(*held) if held else None

    def pieces(self, size: int) -> Iterator[tuple[list[Any], dict[str, Any], int]]:
        """Yield the arguments of each slice of ``size`` rows (the last takes the rest), and its rows."""
        dim, leaves, tensors = self.dim, list(self.tensors), self.tensors
        # One split() per tensor makes every slice's view at once, where narrow() makes one.
        columns = [
            torch.split(tensors[index], size, dim)
            if tensors[index].layout is _STRIDED
            else [_narrowed(tensors[index], dim, begin, size, self.front_end) for begin in range(0, self.rows, size)]
            for index in self.split
        ]
        for number, begin in enumerate(builtins.range(0, self.rows, size)):
            for index, column in zip(self.split, columns, strict=True):
                leaves[index] = column[number]
            end = min(begin + size, self.rows)
            args, kwargs = self.rebuilt(leaves, (begin, end))
            yield args, kwargs, end - begin

    def chunk(self, begin: int, end: int) -> tuple[list[Any], dict[str, Any]]:
        """Return the arguments of rows ``[begin, end)``."""
        leaves, dim = list(self.tensors), self.dim
        for index in self.split:
            tensor = leaves[index]
            if tensor.layout is _STRIDED:
                leaves[index] = tensor.narrow(dim, begin, end - begin)
            else:
                leaves[index] = _narrowed(tensor, dim, begin, end - begin, self.front_end)
        return self.rebuilt(leaves, (begin, end))

    def resized(
        self, rows: int, make: Callable[[torch.Tensor, list[int]], torch.Tensor]
    ) -> tuple[list[Any], dict[str, Any]]:
        """Return the arguments with each tensor replaced by ``make(tensor, shape)``, the split ones at ``rows``."""
        # Records (one per row) are taken again from the first where rows is more than the batch has.
        leaves, dim = [make(tensor, list(tensor.shape)) for tensor in self.tensors], self.dim
        for index in self.split:
            tensor = self.tensors[index]
            shape = list(tensor.shape)
            shape[dim] = rows
            leaves[index] = make(tensor, shape)
        return self.rebuilt(leaves, (0, rows), every=True)


class _Attribute(str):
    """A key that is an attribute (a dataclass field, a named tuple's), labelled ``.name``."""

    __slots__ = ()


def _field_names(value: Any) -> tuple[str, ...]:
    """Return a struct sequence's field names, one per item, or none where some are unnamed."""
    names = getattr(type(value), "__match_args__", ())
    return names if len(names) == len(value) else ()


def positional_names(fn: Callable[..., Any]) -> tuple[str, ...]:
    """Return the names of ``fn``'s positional parameters, or none if it has no signature."""
    if isinstance(fn, torch.nn.Module):  # called with its forward's arguments; its own signature is (*args, **kwargs)
        fn = fn.forward
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return ()
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(parameter.name for parameter in parameters if parameter.kind in positional)
