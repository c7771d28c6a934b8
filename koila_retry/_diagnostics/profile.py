"""Attribute the memory of one call to the modules or source lines that allocated it.

Scopes open and close around each module's forward and backward, or each watched line, while
:mod:`koila_retry._diagnostics.counting` counts the storages alive. With ``fake=True`` the same runs on meta
copies lent as :func:`koila_retry.estimate` lends them: only the tensors' source differs, so the figures are a
real CPU run's.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import linecache
import os
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, Literal, NamedTuple, TypeVar, overload

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.hooks import RemovableHandle

from koila_retry._common.callables import seen_through
from koila_retry._common.collector import collector_paused
from koila_retry._common.dynamo import compiled_code_runs_eagerly
from koila_retry._common.units import format_bytes
from koila_retry._common.walk import call_references, reachable
from koila_retry._common.warn import global_hooks_added, global_hooks_removed
from koila_retry._core.memory import DeviceLike, resolve_device
from koila_retry._diagnostics.counting import Scope, StorageCounter, Tally, storage_of
from koila_retry._diagnostics.report import require_present
from koila_retry._diagnostics.table import html_table, text_table
from koila_retry._estimation.autocast import autocast_like
from koila_retry._estimation.lending import Owned
from koila_retry._estimation.recorder import META
from koila_retry._estimation.steps import follow_steps

__all__ = ["LineRow", "MemoryProfile", "ModuleRow", "profile"]

_BY = ("module", "line")


class ModuleRow(NamedTuple):
    """What one module's forward and backward did to the bytes alive.

    A peak is how far the bytes alive rose above those alive when the module
    started (its forward, or its backward); a net is the bytes alive when it
    ended less those alive when it started. Over several calls, a peak is the
    highest of the calls' and a net the sum of theirs.

    .. versionadded:: 0.1.0
    """

    name: str
    """The module's dotted path from the root module (``"features.0"``); ``""`` for the root."""
    type: str
    """The module's class name (``"Conv2d"``)."""
    calls: int
    """How many times its forward ran."""
    forward_peak: int
    """The most bytes alive while its forward ran, less those alive when it started."""
    forward_net: int
    """The bytes its forward left allocated, such as its outputs and the tensors saved for backward."""
    backward_peak: int | None
    """As ``forward_peak``, for its backward; ``None`` if no backward ran through it."""
    backward_net: int | None
    """As ``forward_net``, for its backward (gradients made, less saved tensors freed); may be negative."""


class LineRow(NamedTuple):
    """What one source line did to the bytes alive, each time it ran.

    .. versionadded:: 0.1.0
    """

    file: str
    """The file the line is in, as its code object names it."""
    line: int
    """The line number, from 1."""
    function: str
    """The qualified name of the function the line is in."""
    source: str
    """The line's text, stripped."""
    runs: int
    """How many times the line started running."""
    peak: int
    """The most bytes alive while it ran, less those alive when it started (the highest over its runs)."""
    net: int
    """The bytes alive when it ended less those alive when it started, summed over its runs."""


RowT = TypeVar("RowT", ModuleRow, LineRow)


class MemoryProfile(Generic[RowT]):
    """The memory of one call, attributed to its modules or to its source lines.

    Made by :func:`profile`. Rows are in the order their module or line first
    started running; sort :attr:`rows` by a peak for the largest first.

    Attributes:
        by (str): ``"module"`` or ``"line"``.
        device (torch.device): the device whose storages were counted.
        fake (bool): whether the call ran on meta tensors.
        start (int): bytes alive when the call started that were counted: the
            tensor arguments' storages and those of the parameters, buffers,
            gradients and optimizer state the call reaches, on ``device``.
        peak (int): the most bytes alive at once during the call, ``start``
            included.
        rows (list of ModuleRow or LineRow): one per module or source line.

    .. versionadded:: 0.1.0
    """

    def __init__(
        self, by: str, device: torch.device, fake: bool, start: int, peak: int, rows: list[RowT], name: str
    ) -> None:
        self.by = by
        self.device = device
        self.fake = fake
        self.start = start
        self.peak = peak
        self.rows: list[RowT] = rows
        self._name = name

    def to_dict(self) -> dict[str, Any]:
        """Return the profile as plain data (str, int, None, lists and dicts), ready for JSON.

        Returns:
            dict: ``by``, ``device`` (a str), ``fake``, ``start``, ``peak`` and
            ``rows``, a list of dicts with the rows' fields.
        """
        return {
            "by": self.by,
            "device": str(self.device),
            "fake": self.fake,
            "start": self.start,
            "peak": self.peak,
            "rows": [row._asdict() for row in self.rows],
        }

    def _table(self) -> tuple[list[str], list[list[str]], str, list[str]]:
        cells: list[list[str]]
        rows: list[Any] = list(self.rows)  # one row type or the other, told apart below
        if self.by == "module":
            headers = ["module", "calls", "forward peak", "forward net", "backward peak", "backward net"]
            cells = [_module_cells(row) for row in rows if isinstance(row, ModuleRow)]
        else:
            headers = ["line", "runs", "peak", "net", "source"]
            cells = [_line_cells(row) for row in rows if isinstance(row, LineRow)]
        on = f"{self.device}, on meta tensors" if self.fake else str(self.device)
        title = (
            f"Memory of {self._name} by {self.by} ({on}): peak {format_bytes(self.peak)}, "
            f"{format_bytes(self.start)} alive at the start"
        )
        footer = [
            "peak: how far the bytes alive rose above those at its start; net: the change from its start to its end"
        ]
        return headers, cells, title, footer

    def __str__(self) -> str:
        headers, cells, title, footer = self._table()
        return text_table(headers, cells, numeric=_NUMERIC, title=title, footer=footer)

    def _repr_html_(self) -> str:
        headers, cells, title, footer = self._table()
        return html_table(headers, cells, numeric=_NUMERIC, title=title, footer=footer)

    def __repr__(self) -> str:
        return (
            f"MemoryProfile(by={self.by!r}, device={str(self.device)!r}, fake={self.fake}, "
            f"start={format_bytes(self.start)}, peak={format_bytes(self.peak)}, rows={len(self.rows)})"
        )


_NUMERIC = frozenset({"calls", "runs", "forward peak", "forward net", "backward peak", "backward net", "peak", "net"})


def _signed(count: int) -> str:
    return f"+{format_bytes(count)}" if count > 0 else format_bytes(count)


def _module_cells(row: ModuleRow) -> list[str]:
    name = f"{row.name} ({row.type})" if row.name else row.type
    backward_peak = "-" if row.backward_peak is None else format_bytes(row.backward_peak)
    backward_net = "-" if row.backward_net is None else _signed(row.backward_net)
    return [
        name,
        str(row.calls),
        format_bytes(row.forward_peak),
        _signed(row.forward_net),
        backward_peak,
        backward_net,
    ]


def _line_cells(row: LineRow) -> list[str]:
    where = f"{os.path.basename(row.file)}:{row.line}"
    return [where, str(row.runs), format_bytes(row.peak), _signed(row.net), row.source]


class _ModuleTally(NamedTuple):
    name: str
    type: str
    forward: Tally
    backward: Tally

    def row(self) -> ModuleRow:
        ran = self.backward.runs > 0
        return ModuleRow(
            self.name,
            self.type,
            self.forward.runs,
            self.forward.peak,
            self.forward.net,
            self.backward.peak if ran else None,
            self.backward.net if ran else None,
        )


class _LineTally(NamedTuple):
    code: types.CodeType
    line: int
    tally: Tally

    def row(self) -> LineRow:
        file = self.code.co_filename
        function = getattr(self.code, "co_qualname", self.code.co_name)
        source = linecache.getline(file, self.line).strip()
        return LineRow(file, self.line, function, source, self.tally.runs, self.tally.peak, self.tally.net)


# --- by module ----------------------------------------------------------------------


class _Names:
    """The dotted path of every module, from the modules the call reaches."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._names: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
        self._taken: set[str] = set()
        roots = [value for value in reachable((fn, args, kwargs)) if isinstance(value, torch.nn.Module)]
        inner = {id(child) for root in roots for child in root.modules() if child is not root}
        roots = [root for root in roots if id(root) not in inner]
        bound = _bindings(fn, args, kwargs)
        main = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
        # One root needs no prefix; several are told apart by the names they are bound to.
        for root in sorted(roots, key=lambda root: root is not main):
            if len(roots) == 1 or root is main:
                self._name_tree(root, "")
            else:
                self._name_tree(root, self._free(bound.get(id(root), type(root).__name__)))

    def _free(self, label: str) -> str:
        candidate, number = label, 1
        while candidate in self._taken:
            number += 1
            candidate = f"{label}#{number}"
        return candidate

    def _name_tree(self, root: torch.nn.Module, label: str) -> None:
        for path, module in root.named_modules():
            if module not in self._names:
                name = ".".join(part for part in (label, path) if part)
                self._names[module] = name
                self._taken.add(name)

    def __call__(self, module: torch.nn.Module) -> str:
        name = self._names.get(module)
        if name is None:
            # Made inside the call, or reached some way not looked at: named by its type.
            self._name_tree(module, self._free(type(module).__name__))
            name = self._names[module]
        return name


def _bindings(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[int, str]:
    """Return the names the call's own code gives the objects it holds directly, by their id."""
    names: dict[int, str] = {}
    for label, value in call_references(fn, args, kwargs):
        if label == "self":
            if isinstance(getattr(value, "__dict__", None), dict):
                for name, attribute in vars(value).items():
                    names.setdefault(id(attribute), name)
                for name, module in getattr(value, "_modules", {}).items():
                    names.setdefault(id(module), name)
        elif label.startswith("'"):
            # A variable it closes over or a global it names, labelled by the repr of its name (an identifier).
            names.setdefault(id(value), label[1:-1])
    try:
        bound = inspect.signature(fn).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return names
    for name, value in bound.arguments.items():
        names.setdefault(id(value), name)
    return names


class _Backward:
    """When one forward call's backward starts (an output's gradient is computed) and ends, and its scope."""

    # The engine runs nodes in the reverse order of their making, so the call's nodes all run before those
    # that made its inputs: it ends when an input's gradient is computed or, with no input that requires
    # grad, when the gradients of its parameters are accumulated, or else when the backward ends.
    __slots__ = (
        "__weakref__",
        "accumulators",
        "inputs",
        "leaves",
        "profiler",
        "remaining",
        "scope",
        "tally",
        "task",
        "uses_inputs",
    )

    def __init__(self, profiler: _ModuleProfiler, tally: Tally) -> None:
        self.profiler = profiler
        self.tally = tally
        self.uses_inputs = False
        self.inputs: set[int] = set()  # ids of the nodes that made the inputs, alive while the forward runs
        self.accumulators: list[Any] = []
        # A leaf input's gradient node lives only while something holds it: one the forward made anew would
        # lack the hook, and the module's backward would run on to the end. Held as long as this object is,
        # which the call's graph holds (its output nodes' hooks), and hooked weakly, so as not to hold it.
        self.leaves: list[Any] = []
        self.task = -1
        self.scope: Scope | None = None
        self.remaining = 0

    def begin(self, *_: Any) -> None:
        task = torch._C._current_graph_task_id()
        if task == self.task:
            return
        if self.scope is not None:  # a backward through part of the graph that never reached the inputs
            self.finish()
        self.task = task
        self.scope = self.profiler.counter.open()
        self.profiler.opened(self, task)
        if not self.uses_inputs:
            try:
                self.remaining = sum(map(torch._C._will_engine_execute_node, self.accumulators))
            except RuntimeError:  # inside torch.autograd.grad, which does not tell of leaves: ends with the backward
                self.remaining = len(self.accumulators) + 1

    def input_ready(self, *_: Any) -> None:
        if self.scope is not None and torch._C._current_graph_task_id() == self.task:
            self.finish()

    def accumulated(self, *_: Any) -> None:
        if self.scope is not None and torch._C._current_graph_task_id() == self.task:
            self.remaining -= 1
            if self.remaining <= 0:
                self.finish()

    def finish(self) -> None:
        scope, self.scope = self.scope, None
        if scope is not None:
            self.tally.add(*self.profiler.counter.close(scope))


class _Call(NamedTuple):
    module: torch.nn.Module
    tally: _ModuleTally
    scope: Scope
    backward: _Backward


class _ModuleProfiler:
    """Open and close a scope around every module's forward, and every module's backward."""

    def __init__(self, counter: StorageCounter, names: _Names) -> None:
        self.counter = counter
        self.names = names
        self.thread = threading.get_ident()
        self.tallies: dict[str, _ModuleTally] = {}
        self.stack: list[_Call] = []
        self.handles: list[RemovableHandle] = []
        self.open_backward: dict[int, list[_Backward]] = {}

    def attach(self) -> list[RemovableHandle]:
        return [
            torch.nn.modules.module.register_module_forward_pre_hook(self.pre),
            torch.nn.modules.module.register_module_forward_hook(self.post, always_call=True),
        ]

    def pre(self, module: torch.nn.Module, inputs: tuple[Any, ...]) -> None:
        if threading.get_ident() != self.thread:
            return
        name = self.names(module)
        tally = self.tallies.get(name)
        if tally is None:
            tally = self.tallies[name] = _ModuleTally(name, type(module).__name__, Tally(), Tally())
        backward = _Backward(self, tally.backward)
        if torch.is_grad_enabled():
            # Hooked before the forward runs, on the node that made the input as it came
            # in, whatever the forward does to it in place. Hooks on nodes, not on
            # tensors, leave the caller's tensors as they were.
            for tensor in _grad_tensors(inputs):
                node = torch.autograd.graph.get_gradient_edge(tensor).node
                if tensor.grad_fn is None:
                    backward.leaves.append(node)
                    self.handles.append(node.register_prehook(_weakly(backward.input_ready)))
                else:
                    self.handles.append(node.register_prehook(backward.input_ready))
                backward.inputs.add(id(node))
                backward.uses_inputs = True
        self.stack.append(_Call(module, tally, self.counter.open(), backward))

    def post(self, module: torch.nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
        if threading.get_ident() != self.thread:
            return
        call = None
        # A module that raised inside a forward the call caught may have left calls unclosed.
        while self.stack:
            candidate = self.stack.pop()
            if candidate.module is module:
                call = candidate
                break
            self.counter.close(candidate.scope)
        if call is None:
            return
        call.tally.forward.add(*self.counter.close(call.scope))
        backward = call.backward
        # An output the forward passed through untouched (nn.Identity's) has no backward in it.
        made = [
            tensor.grad_fn
            for tensor in _grad_tensors(output)
            if tensor.grad_fn is not None and id(tensor.grad_fn) not in backward.inputs
        ]
        backward.inputs.clear()
        if not made:
            return
        if not backward.uses_inputs:
            for parameter in module.parameters():
                if parameter.requires_grad:
                    node = torch.autograd.graph.get_gradient_edge(parameter).node
                    backward.accumulators.append(node)
                    self.handles.append(node.register_hook(backward.accumulated))
        for node in made:
            self.handles.append(node.register_prehook(backward.begin))

    def opened(self, backward: _Backward, task: int) -> None:
        waiting = self.open_backward.get(task)
        if waiting is None:
            waiting = self.open_backward[task] = []
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(self.task_done, task))
        waiting.append(backward)

    def task_done(self, task: int) -> None:
        for backward in self.open_backward.pop(task, []):
            if backward.task == task:
                backward.finish()

    def rows(self) -> list[ModuleRow]:
        return [tally.row() for tally in self.tallies.values()]

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.stack.clear()
        self.open_backward.clear()


def _weakly(method: Callable[..., None]) -> Callable[..., None]:
    """Return a hook that calls ``method`` while its object lives, without holding it."""
    reference = weakref.WeakMethod(method)

    def hook(*args: Any) -> None:
        bound = reference()
        if bound is not None:
            bound(*args)

    return hook


def _grad_tensors(tree: Any, depth: int = 8) -> Iterator[torch.Tensor]:
    for leaf in tree_flatten(tree)[0]:
        if isinstance(leaf, torch.Tensor):
            if leaf.requires_grad:
                yield leaf
        elif depth and dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):  # pytree takes it whole
            yield from _grad_tensors([getattr(leaf, field.name, None) for field in dataclasses.fields(leaf)], depth - 1)


# --- by line ---------------------------------------------------------------------


class _LineProfiler:
    """Open and close a scope around every line of the watched code objects, with ``sys.settrace``."""

    def __init__(self, counter: StorageCounter, codes: frozenset[types.CodeType]) -> None:
        self.counter = counter
        self.codes = codes
        self.tallies: dict[tuple[types.CodeType, int], _LineTally] = {}
        # Frames by id, not by reference: holding a frame would hold its tensors.
        self.running: dict[int, tuple[_LineTally, Scope]] = {}

    def trace(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code in self.codes:
            return self.local
        return None

    def local(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            self.end(id(frame))
            key = (frame.f_code, frame.f_lineno)
            tally = self.tallies.get(key)
            if tally is None:
                tally = self.tallies[key] = _LineTally(frame.f_code, frame.f_lineno, Tally())
            self.running[id(frame)] = (tally, self.counter.open())
        elif event == "return":  # also when an exception leaves the frame, and at a generator's yield
            self.end(id(frame))
        return self.local

    def end(self, frame: int) -> None:
        running = self.running.pop(frame, None)
        if running is not None:
            tally, scope = running
            tally.tally.add(*self.counter.close(scope))

    def rows(self) -> list[LineRow]:
        return [tally.row() for tally in self.tallies.values()]

    def attach(self) -> list[RemovableHandle]:
        return []  # no hooks: _call sets ``trace`` as the tracer

    def detach(self) -> None:
        self.running.clear()


def _code_of(target: Any) -> types.CodeType:
    """Return the code object that runs when ``target`` is called."""
    found: Any = target
    if not isinstance(found, (type, torch.nn.Module)):
        try:
            inner = inspect.unwrap(found)  # a koila front end's wrapper (functools.wraps'): the function it runs
        except Exception:  # a __wrapped__ that loops or raises: the target itself
            inner = found
        if not isinstance(inner, types.BuiltinFunctionType):
            found = inner
    if isinstance(found, type) and issubclass(found, torch.nn.Module):
        found = found.forward
    elif isinstance(found, torch.nn.Module):
        found = getattr(type(found), "forward", found)  # a TorchScript class has none to read
    if isinstance(found, functools.partial):
        found = found.func
    found = getattr(found, "__func__", found)
    if isinstance(found, types.FunctionType):
        found = inspect.unwrap(found)
        found = getattr(found, "__func__", found)
    elif callable(found) and not isinstance(found, (type, types.BuiltinFunctionType)):
        found = type(found).__call__
    code = getattr(found, "__code__", None)
    if not isinstance(code, types.CodeType):
        raise TypeError(
            f"watch= takes functions, methods and modules written in Python, got {type(target).__name__} {target!r}"
        )
    return code


def _watched(fn: Callable[..., Any], watch: Any) -> frozenset[types.CodeType]:
    if watch is None:
        try:
            return frozenset({_code_of(fn)})
        except TypeError:
            pass  # raised below, outside the handler, with a message about fn
        raise TypeError(
            f"by='line' profiles the lines of fn, and {fn!r} has none written in Python; "
            "pass the Python functions or modules it runs as watch="
        )
    if isinstance(watch, (str, bytes)) or not (callable(watch) or isinstance(watch, (torch.nn.Module, Iterable))):
        raise TypeError(
            f"watch= takes a function, a method, a module or an iterable of them, got {type(watch).__name__} {watch!r}"
        )
    if callable(watch) or isinstance(watch, torch.nn.Module):
        return frozenset({_code_of(watch)})
    return frozenset(_code_of(target) for target in watch)


# --- the run -------------------------------------------------------------------------


def _default_device(args: tuple[Any, ...], kwargs: dict[str, Any], owned: Owned) -> torch.device:
    for leaf in tree_flatten((args, kwargs))[0]:
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    for module in owned.modules:
        for parameter in module.parameters(recurse=False):
            return parameter.device
    return torch.device("cpu")


def _remade_on_meta(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Return the arguments with every tensor remade on meta, sharing storages as the originals do."""
    leaves, spec = tree_flatten((args, kwargs))
    storages: dict[int, torch.UntypedStorage] = {}
    for index, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            continue
        storage = storage_of(leaf)
        if leaf.layout is not torch.strided:  # meta has no kernels for sparse operands: the dense size, as estimate
            meta = torch.empty(leaf.shape, dtype=leaf.dtype, device=META)
        elif storage is not None:
            shared = storages.get(id(storage))
            if shared is None:
                shared = torch.UntypedStorage(storage.nbytes(), device=META)  # type: ignore[no-untyped-call]
                storages[id(storage)] = shared
            meta = torch.empty(0, dtype=leaf.dtype, device=META)
            meta.set_(shared, leaf.storage_offset(), leaf.size(), leaf.stride())
        else:
            meta = torch.empty_like(leaf, device=META)
        leaves[index] = meta.requires_grad_(leaf.requires_grad)
        if leaf.grad_fn is not None:
            # Not a leaf either, with a node made before the call's: its backward ends where the real one's does.
            # Not a view of one, which autograd would refuse to change in place.
            with torch.enable_grad():
                leaves[index] = _NotALeaf.apply(meta)  # type: ignore[no-untyped-call]
    remade_args, remade_kwargs = tree_unflatten(leaves, spec)
    return remade_args, remade_kwargs


class _NotALeaf(torch.autograd.Function):
    """The same memory, as a tensor with a node of its own before the call's, and no view."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach()

    @staticmethod
    def backward(ctx: Any, gradient: torch.Tensor) -> torch.Tensor:
        return gradient


def _argument_tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    return [leaf for leaf in tree_flatten((args, kwargs))[0] if isinstance(leaf, torch.Tensor)]


def _call(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    counter: StorageCounter,
    profiler: _ModuleProfiler | _LineProfiler,
) -> None:
    """Call ``fn`` with the profiler's hooks (or tracer) on; take them off again however it ends."""
    handles: list[RemovableHandle] = []
    previous = sys.gettrace()
    tracer = profiler.trace if isinstance(profiler, _LineProfiler) else None

    # Inside an optimizer's step, a value read from a meta tensor reads as 1.0.
    def entered(*_: Any) -> None:
        counter.in_step += 1

    def left(*_: Any) -> None:
        counter.in_step -= 1

    hooked = False
    try:
        handles += profiler.attach()
        if handles:  # global module hooks
            global_hooks_added()
            hooked = True
        handles += [register_optimizer_step_pre_hook(entered), register_optimizer_step_post_hook(left)]
        counter.reset_peak()
        if tracer is not None:
            sys.settrace(tracer)
        fn(*args, **kwargs)
    finally:
        if tracer is not None:
            sys.settrace(previous)
        for handle in handles:
            handle.remove()
        if hooked:
            global_hooks_removed()


def _run(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    owned: Owned,
    counter: StorageCounter,
    profiler: _ModuleProfiler | _LineProfiler,
) -> int:
    """Run the call once, real or on meta tensors; return the bytes alive at its start."""
    if not counter.fake:
        with compiled_code_runs_eagerly(), counter:
            counter.adopt(tensor for _, tensor in owned.tensors())
            counter.adopt(_argument_tensors(args, kwargs))
            start = counter.live
            _call(fn, args, kwargs, counter, profiler)
        return start
    meta_args, meta_kwargs = _remade_on_meta(args, kwargs)
    rng = torch.get_rng_state()
    undo: Callable[[], None] | None = None
    handles: list[RemovableHandle] = []
    with compiled_code_runs_eagerly(), META, counter:
        try:
            undo = owned.lend(counter)
            counter.adopt(_argument_tensors(meta_args, meta_kwargs))
            start = counter.live
            # As the estimate runs it: each optimizer's step prepared for meta tensors (a fused one unfused,
            # NAdam's products read), and autocast's casts made as on the device.
            handles += follow_steps(counter, owned.optimizers, lambda: None)
            try:
                with autocast_like(counter.device, counter.note_inexact):
                    _call(fn, meta_args, meta_kwargs, counter, profiler)
            except Exception as error:
                if sys.version_info >= (3, 11):
                    error.add_note(
                        "(raised while koila.profile ran the call on meta tensors, which have shapes and no values)"
                    )
                raise
            finally:
                del meta_args, meta_kwargs
        finally:
            for handle in handles:
                handle.remove()
            if undo is not None:
                undo()
            torch.set_rng_state(rng)
    return start


@overload
def profile(
    fn: Callable[..., Any],
    /,
    *args: Any,
    by: Literal["module"] = ...,
    device: DeviceLike = ...,
    fake: bool = ...,
    watch: None = ...,
    **kwargs: Any,
) -> MemoryProfile[ModuleRow]: ...


@overload
def profile(
    fn: Callable[..., Any],
    /,
    *args: Any,
    by: Literal["line"],
    device: DeviceLike = ...,
    fake: bool = ...,
    watch: Any = ...,
    **kwargs: Any,
) -> MemoryProfile[LineRow]: ...


@overload
def profile(
    fn: Callable[..., Any],
    /,
    *args: Any,
    by: str,
    device: DeviceLike = ...,
    fake: bool = ...,
    watch: Any = ...,
    **kwargs: Any,
) -> MemoryProfile[Any]: ...


def profile(
    fn: Callable[..., Any],
    /,
    *args: Any,
    by: str = "module",
    device: DeviceLike = None,
    fake: bool = False,
    watch: Any = None,
    **kwargs: Any,
) -> MemoryProfile[Any]:
    """Run ``fn(*args, **kwargs)`` once and attribute its memory to its modules or source lines.

    The bytes counted are those of the tensor storages alive on ``device``, as the
    dispatcher sees them (a storage counts once, however many views share it).
    Each module (``by="module"``) or source line (``by="line"``) gets a peak,
    how far the bytes alive rose above those alive when it started, and a net,
    the bytes it left allocated. By module, a forward and a backward figure each;
    by line, for the lines of the functions ``watch`` names, each line counting
    what the functions it calls allocate. ``fn``'s return value is dropped.

    Args:
        fn (callable): the call to profile: a forward pass, a training step, a
            module.
        *args: its positional arguments.
        by (str): ``"module"`` or ``"line"``. Default: ``"module"``.
        device (torch.device, str, int or None): only storages on this device
            count. Default: the device of the first tensor argument, else of the
            first parameter ``fn`` reaches, else the CPU.
        fake (bool): run on meta tensors, with no memory used: the modules and
            optimizers ``fn`` reaches are lent meta copies of their tensors and
            given their own back untouched, as :func:`estimate` does, and the
            tensor arguments are remade on meta. The figures are those of the
            real run on the CPU for a call whose path does not depend on values
            and whose operators allocate on the CPU what they do on meta (see
            :doc:`/profile` for those that do not); every tensor counts, on
            whatever device. Default: ``False``.
        watch (callable or iterable, optional): with ``by="line"``, the
            functions whose lines are profiled: a function, a method, a module
            (for its ``forward``), or an iterable of them. Default: ``fn``
            itself, or its ``forward`` if it is a module.
        **kwargs: its keyword arguments; one named ``by``, ``device``,
            ``fake`` or ``watch`` is this function's: bind ``fn``'s own of those
            names with ``functools.partial``.

    Returns:
        MemoryProfile: the rows, in the order their module or line first ran.

    Raises:
        TypeError: if ``fn`` is not callable, is a generator or async function
            (whose body runs after the call returns), or ``watch`` holds something
            that is not a function, method or module written in Python.
        ValueError: if ``by`` is neither ``"module"`` nor ``"line"``, ``watch``
            is given with ``by="module"``, or (unless ``fake``) ``device`` is of
            a type this process has no accelerator for.
        Exception: what ``fn`` raised; with ``fake=True``, with a note that says so.

    .. versionadded:: 0.1.0
    """
    if not callable(fn):
        raise TypeError(f"koila.profile needs a callable, got {type(fn).__name__} {fn!r}")
    for each in seen_through(fn):
        # Their bodies run when the result is iterated or awaited, after the profile ended: it would be empty.
        if inspect.isgeneratorfunction(each) or inspect.isasyncgenfunction(each) or inspect.iscoroutinefunction(each):
            raise TypeError(
                f"koila.profile cannot profile {getattr(fn, '__qualname__', repr(fn))}(): it is a generator or "
                "async function, whose body runs after the call returns. Profile a function that runs it "
                "(lambda: list(fn(...)), or lambda: asyncio.run(fn(...)))"
            )
    if by not in _BY:
        raise ValueError(f"by must be one of {', '.join(map(repr, _BY))}, got {by!r}")
    if watch is not None and by == "module":
        raise ValueError(f"watch= names functions whose lines to profile, which needs by='line'; got by={by!r}")
    if not isinstance(fake, bool):
        raise TypeError(f"fake must be True or False, got {type(fake).__name__} {fake!r}")
    codes = _watched(fn, watch) if by == "line" else frozenset()
    # Dispatch modes import torch._dynamo the first time they run, making tensors of its own: not the call's.
    importlib.import_module("torch._dynamo")
    owned = Owned((fn, args, kwargs))
    if device is None:
        target = _default_device(args, kwargs, owned)
    else:
        # On meta tensors every tensor counts, whatever its device: a device this process lacks is a label.
        target = resolve_device(device) if fake else require_present(resolve_device(device), "profile on")
    counter = StorageCounter(target, fake)
    profiler: _ModuleProfiler | _LineProfiler = _LineProfiler(counter, codes)
    if by == "module":
        profiler = _ModuleProfiler(counter, _Names(fn, args, kwargs))
    # A collection in the middle would free cyclic garbage at a moment of its own choosing, which
    # would differ from run to run, and was seen to fire weak-reference callbacks of meta storages
    # still in use: the figures follow reference counts alone.
    with collector_paused():
        try:
            start = _run(fn, args, kwargs, owned, counter, profiler)
        finally:
            profiler.detach()
            counter.clear()
    rows: list[Any] = profiler.rows()
    named = fn.func if isinstance(fn, functools.partial) else fn
    name = getattr(named, "__qualname__", None) or type(named).__name__
    return MemoryProfile(by, target, fake, start, counter.peak, rows, name)
