"""What occupies a device's memory, storage by storage, named from the model and optimizer."""

from __future__ import annotations

import gc
from collections.abc import Iterable, Iterator
from types import FrameType
from typing import Any, NamedTuple, Protocol, TypeVar, runtime_checkable

import torch
from torch._subclasses.fake_tensor import FakeTensor

from koila_retry._common import tracking
from koila_retry._common.places import is_ours, is_users
from koila_retry._common.tensors import named_tensors_in, same_device
from koila_retry._common.units import as_int, format_bytes, type_name
from koila_retry._common.walk import frame_locals, reachable, references
from koila_retry._core import memory
from koila_retry._core.memory import DeviceLike
from koila_retry._diagnostics.table import html_table, text_table

# When one storage has names of several kinds, the row shows the first kind here.
_KINDS = ("parameter", "buffer", "gradient", "optimizer state", "tensor", "no tensor", "not reached")
_HEADERS = ("name", "kind", "shape", "dtype", "bytes")
_NUMERIC = frozenset({"bytes"})
# The names and views a row keeps; the rest are counted. Parameters cut from one flat buffer (FSDP's,
# DeepSpeed's) put thousands of names on one storage, which would make a line of the table, or of the
# message of a call that gave up, as long as all of them.
_KEPT = 5
# References a give-up's walk looks at, nearest first: the caller's frames may hold a dataset of Python lists.
_GIVE_UP_WALK = 100_000


class ReportRow(NamedTuple):
    """One storage in a :class:`MemoryReport`: the names it has, and its bytes.

    Attributes:
        names (tuple of str): the names of the tensors on the storage, as reached
            from the model and optimizer (tied weights have several), the first
            five of them; a tensor no name reaches is described by its shape and
            dtype.
        kind (str): ``"parameter"``, ``"buffer"``, ``"gradient"``,
            ``"optimizer state"``, ``"tensor"`` (found, not named) or
            ``"no tensor"`` (storages a simulated device counts that no Python
            tensor holds; see :func:`report`). In the message of a call that
            gave up, ``"not reached"``: the storages a simulated device counts
            that the names the message looks at do not lead to.
        shape (tuple of int or None): the shape of the first named tensor.
        dtype (str or None): its dtype, as ``"float32"``.
        nbytes (int): the bytes of the storage, counted once however many
            tensors share it.
        views (tuple of str): the other tensors on the storage that no name
            reaches (views or aliases of it), as ``"float32[10, 4]"``, the first
            five of them.
        storages (int): how many storages the row stands for: 1, or, in the
            one row of ``"no tensor"`` or ``"not reached"``, all of them.
            Default: 1.
        more_names (int): how many names the storage has beyond ``names``.
            Default: 0.
        more_views (int): how many views it has beyond ``views``. Default: 0.
        base (str or None): the tensor that spans the whole storage, where the
            named tensors view only parts of it (parameters cut from one flat
            buffer): its name where one reaches it, else its dtype and shape;
            ``None`` if there is none. Default: ``None``.
    """

    names: tuple[str, ...]
    kind: str
    shape: tuple[int, ...] | None
    dtype: str | None
    nbytes: int
    views: tuple[str, ...]
    storages: int = 1
    more_names: int = 0
    more_views: int = 0
    base: str | None = None


class MemoryReport:
    """The tensors alive on a device, one row per storage, largest first; see :func:`report`.

    Attributes:
        device (torch.device): the device reported on.
        rows (list of ReportRow): the ``top`` largest storages.
        total (int): the bytes of every storage found, the rows not shown included.
        storages (int): how many storages were found.
        allocated (int or None): on an accelerator, the bytes PyTorch's caching
            allocator has handed out to tensors (``torch.accelerator.memory_allocated``).
        reserved (int or None): on an accelerator, the bytes the allocator holds
            (``memory_reserved``); the rest of it is cached, free for PyTorch's next tensors.
        simulated (tuple of int or None): inside
            :func:`koila_retry.testing.simulated_device`, its ``(live, limit)`` bytes.

    .. versionadded:: 0.1.0
    """

    def __init__(
        self,
        device: torch.device,
        rows: list[ReportRow],
        total: int,
        storages: int,
        allocated: int | None,
        reserved: int | None,
        simulated: tuple[int, int] | None,
    ) -> None:
        self.device = device
        self.rows = rows
        self.total = total
        self.storages = storages
        self.allocated = allocated
        self.reserved = reserved
        self.simulated = simulated

    @property
    def omitted(self) -> int:
        """int: the bytes of the storages found but not in :attr:`rows`."""
        return self.total - sum(row.nbytes for row in self.rows)

    def notes(self) -> list[str]:
        """Return the lines that explain the totals: rows left out, and the allocator's own figures.

        Returns:
            list of str: one sentence per line.
        """
        lines = []
        hidden = self.storages - sum(row.storages for row in self.rows)
        if hidden > 0:
            lines.append(
                f"{hidden} smaller storage{'s' if hidden > 1 else ''} not shown: {format_bytes(self.omitted)}."
            )
        if self.allocated is not None and self.reserved is not None:
            unseen = self.allocated - self.total
            cached = format_bytes(self.reserved - self.allocated)
            lines.append(
                f"PyTorch's allocator: {format_bytes(self.allocated)} allocated, "
                f"{format_bytes(self.reserved)} reserved ({cached} of it cached for reuse)."
            )
            if unseen > 0:
                lines.append(
                    f"{format_bytes(unseen)} allocated are in no tensor Python can reach: tensors autograd saved for "
                    "backward, tensors only C++ holds, and each block's rounding up to 512 bytes."
                )
        if self.simulated is not None:
            live, limit = self.simulated
            lines.append(
                f"Simulated device: {format_bytes(live)} of {format_bytes(limit)} in use, counting only the tensors "
                "made inside it."
            )
        return lines

    def _cells(self) -> list[tuple[str, ...]]:
        cells: list[tuple[str, ...]] = []
        for row in self.rows:
            shape = "" if row.shape is None else str(list(row.shape))
            cells.append((_printable(_names(row)), row.kind, shape, row.dtype or "", format_bytes(row.nbytes)))
            first = _printable(row.names[0]) if row.names else ""
            if row.base is not None:
                cells.append((f"  base of {first}: {_printable(row.base)}", "base", "", "", ""))
            cells += [(f"  view of {first}: {view}", "view", "", "", "") for view in row.views]
            if row.more_views:
                more = f"{row.more_views} more view{'s' if row.more_views > 1 else ''}"
                cells.append((f"  and {more} of {first}", "view", "", "", ""))
        return cells

    def _title(self) -> str:
        plural = "" if self.storages == 1 else "s"
        return f"Memory on {self.device}: {format_bytes(self.total)} in {self.storages} storage{plural}"

    def __str__(self) -> str:
        return text_table(_HEADERS, self._cells(), numeric=_NUMERIC, title=self._title(), footer=self.notes())

    def _repr_html_(self) -> str:
        return html_table(_HEADERS, self._cells(), numeric=_NUMERIC, title=self._title(), footer=self.notes())

    def __repr__(self) -> str:
        return f"MemoryReport(device={str(self.device)!r}, total={self.total}, storages={self.storages})"

    def to_dict(self) -> dict[str, Any]:
        """Return the report as plain values (for JSON, logs and programs).

        Returns:
            dict: ``device`` (str), ``total``, ``storages``, ``omitted``,
            ``allocated``, ``reserved``, ``simulated`` (a dict of ``live`` and
            ``limit``, or ``None``) and ``rows``, a list of dicts with the
            fields of :class:`ReportRow` (tuples as lists).
        """
        return {
            "device": str(self.device),
            "total": self.total,
            "storages": self.storages,
            "omitted": self.omitted,
            "allocated": self.allocated,
            "reserved": self.reserved,
            "simulated": None if self.simulated is None else dict(zip(("live", "limit"), self.simulated, strict=True)),
            "rows": [
                {key: list(value) if isinstance(value, tuple) else value for key, value in row._asdict().items()}
                for row in self.rows
            ],
        }

    def summary(self, top: int = 5) -> str:
        """Return the largest storages and the total in one sentence, for an error message.

        Args:
            top (int): how many storages to name. Default: 5.

        Returns:
            str: like ``"Largest on cpu (12.00 MiB in 9 storages): fc.weight (parameter) 4.00 MiB, ..."``.
        """
        named = [" ".join(filter(None, (_names(row), _what(row), format_bytes(row.nbytes)))) for row in self.rows[:top]]
        rest = self.total - sum(row.nbytes for row in self.rows[:top])
        # One row may stand for many storages (those the call does not reach): count storages, not rows.
        more = self.storages - sum(row.storages for row in self.rows[:top])
        if more > 0:
            named.append(f"{more} more {format_bytes(rest)}")
        plural = "" if self.storages == 1 else "s"
        found = f"{format_bytes(self.total)} in {self.storages} storage{plural}"
        return f"Largest on {self.device} ({found}): {'; '.join(named) or 'nothing'}."


def report(
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    device: DeviceLike = None,
    top: int = 20,
) -> MemoryReport:
    """Return what occupies a device's memory: every tensor alive on it, named where possible.

    Tensors are found through the garbage collector's list of objects (no
    collection is run, and nothing is freed or moved) and deduplicated by
    storage: a storage's bytes count once, however many tensors view it. They
    are named from ``model`` (``layer.weight``, ``layer.weight.grad``,
    ``norm.running_mean``) and ``optimizer``
    (``optimizer.state[layer.weight].exp_avg``); a weight tied to two layers is
    listed under both names; a tensor that views a named storage is shown as a
    view of it; the rest by shape and dtype. Tensors that autograd saved for
    backward, made inside PyTorch's C++ code, are invisible to Python: on an
    accelerator the allocator's own figures are given beside the total, with the
    difference. Inside :func:`koila_retry.testing.simulated_device` every tensor
    passes through Python and is found; the storages it counts that no tensor
    holds (a bare ``untyped_storage()``, say) make a row of their own.

    Args:
        model (torch.nn.Module, optional): names parameters, buffers and gradients.
        optimizer (torch.optim.Optimizer, optional): names its state, and any
            parameter ``model`` does not.
        device (torch.device, str, int or None): the device to report on.
            Default: ``model``'s device, else the current accelerator, else the CPU.
        top (int): how many of the largest storages make rows; the totals
            count them all. Default: 20.

    Returns:
        MemoryReport: printable as a table, with ``rows`` and ``to_dict()``.

    Raises:
        TypeError: if ``model``, ``optimizer`` or ``top`` has the wrong type.
        ValueError: if ``top`` is below 1, or ``device`` is not a device, or is
            of a type this process has no accelerator for (as
            :func:`koila_retry.free_memory` says).

    Example::

        >>> import torch, koila_retry as koila
        >>> model = torch.nn.Linear(256, 256)
        >>> print(koila.report(model, device="cpu", top=1))  # doctest: +SKIP
        Memory on cpu: 257.00 KiB in 2 storages
        ...

    .. versionadded:: 0.1.0
    """
    if model is not None and not isinstance(model, torch.nn.Module):
        shown = f"of shape {tuple(model.shape)}" if isinstance(model, torch.Tensor) else repr(model)[:100]
        raise TypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__} {shown}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
    number = as_int(top)  # numpy's ints too
    if number is None:
        raise TypeError(f"top must be an int, got {type_name(top)} {top!r}")
    top = number
    if top < 1:
        raise ValueError(f"top must be >= 1, got {top}")
    if device is None and model is not None:
        target = next((t.device for t in (*model.parameters(), *model.buffers())), None)
        resolved = memory.resolve_device(target)
    else:
        resolved = require_present(memory.resolve_device(device), "report on")
    modules = [("", model)] if model is not None else []
    optimizers = [("optimizer", optimizer)] if optimizer is not None else []
    return build(resolved, modules, optimizers, top)


def require_present(device: torch.device, what: str) -> torch.device:
    """Return ``device``; raise, as free_memory does, if this process has no device of its type."""
    if device.type not in ("cpu", "meta") and not memory.on_accelerator(device):
        raise ValueError(f"cannot {what} {device}: this process has no {device.type} device")
    return device


def build(
    device: torch.device,
    modules: list[tuple[str, torch.nn.Module]],
    optimizers: list[tuple[str, torch.optim.Optimizer]],
    top: int,
    tensors: Iterable[tuple[str, torch.Tensor]] = (),  # named variables, where no module or optimizer names them
    aside: dict[int, torch.Tensor] | None = None,  # a step's gradients set aside, by ``id`` of their parameter
    *,
    # Every other tensor alive, from the garbage collector's objects: a time that grows with the process's
    # objects. Without it, a simulated device's other storages make one row, "not reached".
    scan: bool = True,
    step: dict[int, torch.Tensor] | None = None,  # a step's own gradients so far, kept apart from ``.grad``
    # In a simulated device, leave out what it does not count (made before the block, or by another thread).
    counted: bool = False,
) -> MemoryReport:
    """Return the report of ``device``, naming tensors from ``(prefix, module)`` and ``(prefix, optimizer)``."""
    found = _Found(device, counted)
    known: dict[int, str] = {}  # id of a parameter -> its first name, for the optimizer's state
    held = _Held(aside or {}, step or {})
    for prefix, module in modules:
        for name, kind, tensor in _module_tensors(prefix, module, held):
            known.setdefault(id(tensor), name)
            found.add(name, kind, tensor)
    for prefix, optimizer in optimizers:
        for name, kind, tensor in _optimizer_tensors(prefix, optimizer, known, held):
            found.add(name, kind, tensor)
    for name, tensor in tensors:
        found.add(name, "tensor", tensor, unless_named=True)
    if scan:
        found.scan()
    simulated = found.unreachable("no tensor" if scan else "not reached")
    allocated = reserved = None
    if memory.on_accelerator(device):
        allocated = torch.accelerator.memory_allocated(device)
        reserved = torch.accelerator.memory_reserved(device)
    rows = sorted(found.rows(), key=lambda row: -row.nbytes)
    total = sum(row.nbytes for row in rows)
    return MemoryReport(device, rows[:top], total, sum(row.storages for row in rows), allocated, reserved, simulated)


class _Held(NamedTuple):
    """The gradients a step in progress holds apart from ``.grad``, by ``id`` of their parameter."""

    aside: dict[int, torch.Tensor]  # from before the step, moved out of .grad while it runs
    step: dict[int, torch.Tensor]  # the step's own so far


def _gradients(name: str, parameter: torch.Tensor, held: _Held) -> Iterator[tuple[str, str, torch.Tensor]]:
    """Yield the gradients of ``parameter``: ``.grad`` (or the one set aside), and the step's."""
    gradient = parameter.grad
    if gradient is None:
        gradient = held.aside.get(id(parameter))
    if gradient is not None:
        yield f"{name}.grad", "gradient", gradient
    gradient = held.step.get(id(parameter))
    if gradient is not None:
        yield f"the step's {name}.grad", "gradient", gradient


def _joined(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _module_tensors(prefix: str, module: torch.nn.Module, held: _Held) -> Iterator[tuple[str, str, torch.Tensor]]:
    # Duplicates kept: a weight tied to two layers is named by both.
    for name, parameter in module.named_parameters(remove_duplicate=False):
        yield _joined(prefix, name), "parameter", parameter
        yield from _gradients(_joined(prefix, name), parameter, held)
    for name, buffer in module.named_buffers(remove_duplicate=False):
        yield _joined(prefix, name), "buffer", buffer


def _optimizer_tensors(
    prefix: str, optimizer: torch.optim.Optimizer, known: dict[int, str], held: _Held
) -> Iterator[tuple[str, str, torch.Tensor]]:
    for group_index, group in enumerate(optimizer.param_groups):
        for index, parameter in enumerate(group["params"]):
            name = known.get(id(parameter))
            if name is None:
                name = f"{prefix}.param_groups[{group_index}]['params'][{index}]"
                yield name, "parameter", parameter
                yield from _gradients(name, parameter, held)
            for key, value in optimizer.state.get(parameter, {}).items():
                for where, tensor in named_tensors_in(value, f".{key}"):  # LBFGS keeps lists of them
                    yield f"{prefix}.state[{name}]{where}", "optimizer state", tensor


class _Storage:
    """A storage being described: its names, its kind and the tensors that view it."""

    __slots__ = (
        "base",
        "count",
        "dtype",
        "kind",
        "more_names",
        "more_views",
        "names",
        "nbytes",
        "shape",
        "views",
        "whole",
    )

    def __init__(self, nbytes: int, kind: str, tensor: torch.Tensor | None, name: str = "", count: int = 1) -> None:
        self.nbytes = nbytes
        self.count = count  # the storages it stands for
        self.kind = kind
        self.names: list[str] = [name] if name else []
        self.views: list[str] = []
        self.more_names = self.more_views = 0
        self.base: str | None = None
        self.whole = tensor is not None and _covers(tensor, nbytes)  # a named tensor spans the storage
        self.shape = None if tensor is None else tuple(tensor.shape)
        self.dtype = None if tensor is None else _dtype_name(tensor.dtype)

    def name(self, name: str, tensor: torch.Tensor) -> None:
        """Add a name of ``tensor``, a tensor on the storage: kept among the first few, else counted."""
        if not self.whole and _covers(tensor, self.nbytes):
            self.whole = True
        if name in self.names:
            return
        if len(self.names) < _KEPT:
            self.names.append(name)
        else:
            self.more_names += 1  # names from modules and optimizers are distinct: no need to keep them all

    def view(self, tensor: torch.Tensor) -> None:
        """Add a tensor no name reaches: the base the named ones view, or one more view."""
        if self.base is None and not self.whole and _covers(tensor, self.nbytes):
            self.base = _describe(tensor)
            self.whole = True
        elif len(self.views) < _KEPT:
            self.views.append(_describe(tensor))
        else:
            self.more_views += 1


class _Found:
    """The storages on one device, by the address of their storage object in C++."""

    def __init__(self, device: torch.device, counted: bool = False) -> None:
        self.device = device
        self.storages: dict[int, _Storage] = {}
        self.named: set[int] = set()  # ids of the named tensors, not listed again as views
        # Inside a simulated device, with ``counted``: the storages it counts, the only ones listed.
        self.counted: set[int] | None = None
        # Of nested devices, the one that refused (an outer one may be tighter than the innermost).
        stand_in = tracking.simulated.stand_in()
        if counted and stand_in is not None and device.type == "cpu":
            self.counted = {storage._cdata for storage in stand_in.live_storages()}

    def _storage_of(self, tensor: torch.Tensor) -> tuple[int, int] | None:
        # Fake tensors hold no memory; torch.compile leaves some behind, with symbolic sizes.
        if issubclass(type(tensor), FakeTensor) or torch.nn.parameter.is_lazy(tensor):
            return None  # no memory held (a lazy module's parameters before its first call refuse to say)
        if not same_device(tensor.device, self.device) or tensor.layout != torch.strided or tensor.is_meta:
            return None
        if tensor.is_nested:  # strided in name, with no sizes to describe it by
            return None
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # subclasses and wrappers without one
            return None
        if self.counted is not None and storage._cdata not in self.counted:
            return None  # it takes none of the simulated device's memory
        return storage._cdata, storage.nbytes()

    def add(self, name: str, kind: str, tensor: torch.Tensor, *, unless_named: bool = False) -> None:
        """Add a named tensor; with ``unless_named``, only if its storage has no name yet."""
        parts = tracking.sparse_parts(tensor)
        if parts is not None:  # its memory is its indices' and values' (a sparse embedding's gradient)
            self.named.add(id(tensor))
            for part, held in parts:
                self.add(f"{name} ({part})", kind, held, unless_named=unless_named)
            return
        found = self._storage_of(tensor)
        if found is None:
            return
        key, nbytes = found
        entry = self.storages.get(key)
        if unless_named and entry is not None:
            if entry.base is None and not entry.whole and _covers(tensor, nbytes):
                # The tensor the named ones were cut from (a flat buffer of parameters), named as itself.
                self.named.add(id(tensor))
                entry.base = name
                entry.whole = True
            return
        self.named.add(id(tensor))
        if entry is None:
            entry = self.storages[key] = _Storage(nbytes, kind, tensor)
        elif _KINDS.index(kind) < _KINDS.index(entry.kind):
            entry.kind = kind
        entry.name(name, tensor)

    def scan(self) -> None:
        """Add every other tensor alive on the device, found without running a collection."""
        unnamed: dict[int, list[torch.Tensor]] = {}
        sparse: dict[int, tuple[str, torch.Tensor]] = {}  # by storage: a sparse tensor's part, and the tensor
        for value in gc.get_objects():
            # ``type`` rather than ``isinstance``: a proxy's ``__class__`` could run code.
            if not issubclass(type(value), torch.Tensor) or id(value) in self.named:
                continue
            parts = tracking.sparse_parts(value)
            for part, held in [("", value)] if parts is None else parts:
                found = self._storage_of(held)
                if found is None:
                    continue
                key, nbytes = found
                if part:
                    sparse[key] = (part, value)
                entry = self.storages.get(key)
                if entry is not None and entry.names:
                    entry.view(held)
                else:
                    unnamed.setdefault(key, []).append(held)
        for key, tensors in unnamed.items():
            nbytes = tensors[0].untyped_storage().nbytes()
            # The tensor that spans the whole storage is its base; the others view it.
            tensors.sort(key=lambda tensor: (not _covers(tensor, nbytes), -tensor.numel()))
            base = tensors[0]
            part, owner = sparse.get(key, ("", base))
            graph = owner.grad_fn  # a sparse tensor's, not its part's
            name = f"sparse tensor ({part})" if part else "tensor"
            if graph is not None:
                name = f"{name} ({type(graph).__name__} keeps its autograd graph)"
            entry = self.storages[key] = _Storage(nbytes, "tensor", base, name)
            for tensor in tensors[1:]:
                entry.view(tensor)
        unnamed.clear()

    def unreachable(self, kind: str) -> tuple[int, int] | None:
        """Add what a simulated device counts that was not found, as ``kind``; return its ``(live, limit)``."""
        device = tracking.simulated.stand_in()
        if device is None or self.device.type != "cpu":
            return None
        hidden = [storage for storage in device.live_storages() if storage._cdata not in self.storages]
        if hidden:
            nbytes = sum(storage.nbytes() for storage in hidden)
            plural = "s" if len(hidden) > 1 else ""
            holds = "no Python tensor holds" if kind == "no tensor" else "not found among the call's names"
            self.storages[-1] = _Storage(nbytes, kind, None, f"{len(hidden)} storage{plural} {holds}", len(hidden))
        return device.live, device.limit

    def rows(self) -> Iterable[ReportRow]:
        for entry in self.storages.values():
            names, views = tuple(entry.names), tuple(entry.views)
            yield ReportRow(
                names,
                entry.kind,
                entry.shape,
                entry.dtype,
                entry.nbytes,
                views,
                entry.count,
                entry.more_names,
                entry.more_views,
                entry.base,
            )


def _what(row: ReportRow) -> str:
    if row.kind == "tensor" and row.shape is not None:
        what = f"{row.dtype}{list(row.shape)}"
    else:
        what = "" if row.kind == "not reached" else f"({row.kind})"  # its name says it
    if row.base is not None:
        what = f"{what[:-1]}, views of {row.base})" if what.endswith(")") else f"{what} (views of {row.base})"
    return what


def _names(row: ReportRow) -> str:
    """The row's names, and how many more it has."""
    shown = ", ".join(row.names)
    more = row.more_names
    return f"{shown} and {more} more name{'s' if more > 1 else ''}" if more else shown


def _printable(text: str) -> str:
    """``text`` with its control characters escaped as ``repr`` does, to keep a table's lines whole."""
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _covers(tensor: torch.Tensor, nbytes: int) -> bool:
    return tensor.storage_offset() == 0 and tensor.numel() * tensor.element_size() == nbytes


def _describe(tensor: torch.Tensor) -> str:
    return f"{_dtype_name(tensor.dtype)}{list(tensor.shape)}"


# --- the report in BatchSizeExhausted's message ----------------------------------------


@runtime_checkable
class HoldsGradients(Protocol):  # not an import of the front end: it imports the engine, which imports this
    """What holds gradients of a step in progress apart from ``.grad`` (``koila.accumulate``'s, while it runs one)."""

    def gradients_aside(self) -> dict[int, torch.Tensor]:
        """Return the gradients from before the step set aside, by the ``id`` of the parameter (or other leaf)."""
        ...

    def gradients_of_step(self) -> dict[int, torch.Tensor]:
        """Return the step's own gradients so far, by the ``id`` of the parameter (or other leaf)."""
        ...


def explain(device: torch.device, frame: FrameType | None, top: int = 5) -> str:
    """Return, in one sentence, the largest storages on ``device``, named from what the failing call's frames hold."""
    modules: dict[int, tuple[str, torch.nn.Module]] = {}
    optimizers: dict[int, tuple[str, torch.optim.Optimizer]] = {}
    roots: list[Any] = []
    variables: list[tuple[str, torch.Tensor]] = []
    contents: list[tuple[str, torch.Tensor]] = []  # named after a variable holding them; other names come first
    aside: dict[int, torch.Tensor] = {}
    step: dict[int, torch.Tensor] = {}
    # Only our frames and the user's (not a test runner's), and what their locals hold, are looked at, not
    # every object as :func:`report` does: giving up takes a time that grows with what the user's code holds.
    while frame is not None:
        ours = is_ours(frame.f_code.co_filename)
        if not ours and not is_users(frame.f_code.co_filename):
            frame = frame.f_back
            continue
        for name, value in frame_locals(frame):
            if isinstance(value, HoldsGradients):
                held, own = value.gradients_aside(), value.gradients_of_step()
                if isinstance(held, dict) and isinstance(own, dict):  # a mock, say, claims to have every method
                    aside.update(held)
                    step.update(own)
            if isinstance(value, torch.Tensor):
                variables.append((name, value))
            else:  # the names of this package's own variables would mean nothing to the user
                contents += [("tensor" if ours else label, tensor) for label, tensor in _held(name, value)]
            if isinstance(value, torch.nn.Module):
                modules.setdefault(id(value), (name, value))
            elif isinstance(value, torch.optim.Optimizer):
                optimizers.setdefault(id(value), (name, value))
            roots.append(value)
        frame = frame.f_back
    frame = None
    variables += contents
    contents.clear()
    for value in reachable(roots, _GIVE_UP_WALK):
        if isinstance(value, torch.nn.Module):
            modules.setdefault(id(value), (type(value).__name__, value))
        elif isinstance(value, torch.optim.Optimizer):
            optimizers.setdefault(id(value), ("optimizer", value))
    roots.clear()
    inner = {id(child) for _, module in modules.values() for child in module.modules() if child is not module}
    tops = [entry for key, entry in modules.items() if key not in inner]
    named = [("" if len(tops) == 1 else prefix, module) for prefix, module in _distinct(tops)]
    opts = [("optimizer" if len(optimizers) == 1 else prefix, opt) for prefix, opt in _distinct(optimizers.values())]
    try:
        return build(device, named, opts, top, variables, aside, scan=False, step=step, counted=True).summary(top)
    finally:
        variables.clear()
        aside.clear()
        step.clear()


def _held(name: str, value: Any) -> list[tuple[str, torch.Tensor]]:
    """Return the tensors a variable holds directly: its items, or its attributes, named after it."""
    if isinstance(value, (torch.nn.Module, torch.optim.Optimizer)):
        return []  # named from their parameters and state instead
    # Numbered where two read alike: long keys are cut short (walk.references).
    return _distinct(
        (f"{name}{label}" if label.startswith("[") else f"{name}.{label}", child)
        for label, child in references(value)
        if isinstance(child, torch.Tensor)
    )


T = TypeVar("T")


def _distinct(entries: Iterable[tuple[str, T]]) -> list[tuple[str, T]]:
    """Return ``(name, value)`` pairs, a repeated name numbered (``Linear``, ``Linear#2``) as profile numbers it."""
    seen: dict[str, int] = {}
    named = []
    for name, value in entries:
        seen[name] = seen.get(name, 0) + 1
        named.append((name if seen[name] == 1 else f"{name}#{seen[name]}", value))
    return named
