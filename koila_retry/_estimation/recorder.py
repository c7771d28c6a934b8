"""The dispatch mode under which a call runs on meta tensors, counting the bytes it would hold.

Everything stays on the meta device: a tensor asked for elsewhere is made there, a real
tensor an operator is given is read through a meta copy, and a read of a value answers
a placeholder, which the estimate notes unless it is an optimizer's own step count or a
gradient scaler's check.
"""

from __future__ import annotations

import math
import os
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import FrameType
from typing import Any

import torch
from torch.utils.module_tracker import ModuleTracker

from koila_retry._common.tensors import tensors_in
from koila_retry._common.tracking import LiveStorageTracker, sparse_parts
from koila_retry._estimation.autocast import settle
from koila_retry._estimation.fit import CATEGORIES, Moment

__all__ = ["META", "Recorder", "Truths", "Workspace", "inexact_operators", "value_shaped_note"]

META = torch.device("meta")

_LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default
_GLOBAL = frozenset({"Global"})  # what torch's ModuleTracker calls being in no module

# Bytes an operator holds during its call beyond its arguments and results.
Workspace = Callable[[Any, tuple[Any, ...], Any], int]


# --- what the estimate knows it does not model exactly -----------------------------

# A value read from a tensor, by its kind: what it reads as outside and inside an optimizer
# step, and what is made of such reads. The optimizer's own values (its step count, the
# scalars of its state) and a gradient scaler's (whether any gradient is infinite) read as a
# step that is taken, which is what the estimate models; they are not noted.
_VALUE_READS = {
    "integer": ("1", "1", "sizes and branches made from it"),
    "float": ("0.0", "1.0", "branches and sizes made from it (a NaN guard, a threshold)"),
    "truth value": (
        "False, or what the check it came from usually finds (finite values, no NaN, all() of those, "
        "torch.equal and torch.allclose true)",
        "False, or what the check it came from usually finds",
        "the branches taken (`if t:`, `if x.sum() > 0:`, `if torch.isfinite(loss):`)",
    ),
}
_VALUE_READ = (
    "{where}, the value reads as a placeholder, {placeholder}, since meta tensors hold none: "
    '{what} may differ from those of the real run. Where the device can be measured, initial="auto" and '
    "suggest_batch_size(calibrate=True) measure a real run instead"
)
# What a float an optimizer keeps in its state reads as inside its step, by its key, where not 1.0
# (its step count's, which keeps the bias corrections finite): NAdam divides by 1 minus the product
# of its momentum factors, each below 1, which at 1.0 is zero.
_STATE_FLOATS = {"mu_product": 0.5}
# LBFGS decides from values (the loss, the gradient's size, the curvature of each step) how many
# closures its step runs and which steps it keeps in its history, the bytes of its peak. While its
# step runs, its tolerances read as -inf (in the estimating thread's copy of its parameter group)
# and a check whose answer is not known reads true: every iteration runs and is kept.
_LBFGS = (
    "{name}'s step: it decides from values read from tensors (the loss, the gradient, each step's "
    "curvature) how many closures to run and which steps to keep in its history, and meta tensors hold none: "
    "the estimate runs its longest step, max_iter iterations (at most max_eval closures) with each kept in "
    "its history (up to history_size) and each line search ended at its first closure. A real step that stops "
    "sooner holds less; one whose line search runs more closures, up to two more copies of the gradient"
)
# torch.amp's gradient scaler, whose reads of its inf checks the estimate answers as "none found".
_SCALER_FILE = ("torch", "amp", "grad_scaler.py")
# A loop that runs until a value read says stop (Hugging Face's generate() stops once every row has
# finished, `bool(unfinished.max() == 0)`) never ends on placeholders, which read the same each
# time, and the run would hold the estimate lock while its memory grows. A model reads a value at
# one line once per layer, time step or row at most, a few hundred times a run; past 1024 reads,
# or 4 per row of the run's batch where that is more, the run stops with an error.
_READS_AT_ONE_LINE = 1024
_READS_PER_ROW = 4
# Frames of these packages are not where a read is asked for: the first frame outside them is.
_INSIDE = tuple(
    os.path.dirname(module.__file__) + os.sep
    for module in (torch, sys.modules[__name__.split(".")[0]])
    if module.__file__ is not None
)
_OPTIM = os.path.dirname(torch.optim.__file__ or "") + os.sep  # PyTorch's optimizers
_ENDLESS = (
    "{where} read a tensor's value {count} times in one run on meta tensors, which hold no values: each "
    "read gives the same placeholder, so a loop that ends when a value says so (a decoding loop such as "
    "Hugging Face's generate(), `while x.max() > 0:`) never ends there, and the run stops at that many "
    "reads of one line, a loop of fixed length that reads a value in each step (a NaN check per time step) "
    'included. Such a call cannot be estimated: give initial= a batch size rather than "auto", estimate one '
    "step of the loop (the model's forward), or read the value less often"
)
# Operators whose result's shape depends on the values of a tensor (a boolean mask's index runs
# nonzero), by what the user called. On meta tensors PyTorch raises an error written for its
# compiler, which names its settings and fake implementations: the estimate adds what to do.
_VALUE_SHAPED = {
    "nonzero": "torch.nonzero (argwhere, where(condition), nonzero(as_tuple=True))",
    "masked_select": "torch.masked_select",
    "_unique": "torch.unique",
    "_unique2": "torch.unique",
    "unique_dim": "torch.unique",
    "unique_consecutive": "torch.unique_consecutive",
    "unique_dim_consecutive": "torch.unique_consecutive",
    "bincount": "torch.bincount",
    "index": "indexing with a boolean mask (x[mask])",
}
_VALUE_SHAPED_WHY = "the shape of its result depends on the values of a tensor"
_VALUE_SHAPED_NOTE = (
    "{what}: " + _VALUE_SHAPED_WHY + ", which an estimate cannot know (meta tensors hold none; the settings and "
    "fake implementations named above are for PyTorch's compiler, and do not help here). Estimate the part of the "
    'call before it (the model\'s forward up to the mask, say), or give initial= a batch size rather than "auto"'
)
_CUDNN_CONVOLUTION = (
    "convolution: the workspace cuDNN takes on CUDA is not modelled (on an H100 a backward took 280 MiB): "
    'the estimate may be below the real peak; initial="auto" measures it on the device'
)


def inexact_operators(device: torch.device) -> dict[Any, str]:
    """Return the note (``"what: why"``) of each operator always inexact on ``device``, for the estimate's notes."""
    # What is inexact only in some cases is noted by the code that models it, with
    # Recorder.note_inexact: value reads (Recorder.placeholder), attention.py, recurrent.py.
    # Operators whose result's shape depends on values (nonzero, masked_select) cannot
    # run on meta tensors at all: the estimate fails with their error, and a note of its own.
    if device.type != "cuda":
        return {}
    return {
        torch.ops.aten.convolution.default: _CUDNN_CONVOLUTION,
        torch.ops.aten.convolution_backward.default: _CUDNN_CONVOLUTION,
    }


# --- one run on meta tensors ------------------------------------------------------

# What a run on meta tensors misses of a step with sparse gradients: their backward and optimizer step (76M).
_SPARSE_MADE = (
    "counted by its indices and values, but the backward and optimizer step around it are not followed, and the "
    "estimate runs low (by half, for an embedding's step): give initial= a size, not 'auto'"
)


class Recorder(LiveStorageTracker):  # type: ignore[no-untyped-call]
    """Count live storages, by phase and category, with the peaks of each phase and module."""

    def __init__(
        self,
        round_bytes: Callable[[int], int] | None,
        workspace: Workspace | None,
        inexact: Mapping[Any, str] | None = None,
        rows: int = 0,
    ) -> None:
        super().__init__()
        self.round_bytes = round_bytes
        self.workspace = workspace
        self.inexact = inexact or {}  # operator -> its note (see inexact_operators)
        self.notes: dict[str, None] = {}  # what the run could not model exactly, in the order met
        self.category = "inputs"
        self.running = False
        self.in_step = 0
        self.stepping: list[Any] = []  # the optimizers whose step runs now, innermost last
        self._held: dict[int, tuple[weakref.ref[torch.Tensor], str]] | None = None  # what they hold: see _held_as
        self.clock = 0
        # Every storage with the clock at which it was made and freed: whether it became a gradient
        # or optimizer state is known only later, so the categories at each moment are summed after the run.
        self.entries: list[list[Any]] = []  # [bytes, category, made at, freed at or None, bytes unrounded]
        self.index: dict[int, int] = {}  # id of a live storage -> its entry
        self.observed: list[tuple[int, int, str, frozenset[str]]] = []  # (clock, transient bytes, phase, modules)
        self.modules: ModuleTracker | None = None
        self.reclassify: Callable[[], None] | None = None
        self._callback_queued = False
        self.truths = Truths()
        self.reads: dict[tuple[str, int], int] = {}  # placeholder reads noted, by the line that asked
        self.most_reads = max(_READS_AT_ONE_LINE, _READS_PER_ROW * rows)

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if torch._C._len_torch_function_stack():
            # Function modes on the stack (the run's, in backward: attention.py's device_kernels):
            # the count's own calls pass them by, as they do where the call came through them.
            with torch._C.DisableTorchFunction():
                return self._dispatch(func, args, kwargs)
        return self._dispatch(func, args, kwargs)

    def _dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> Any:
        if func is _LOCAL_SCALAR:
            return self.placeholder(args[0])
        if func in _FUSED_STEPS:
            return None
        settle()  # autocast's cached casts go when its region ends, before anything after it allocates
        known = self.inexact.get(func)
        if known is not None:
            self.notes[known] = None
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and device != META:
            # A tensor asked for on another device (x.to("cuda"), .cpu(), device="cpu")
            # is made on the meta device too: everything stays shapes without data.
            kwargs = {**kwargs, "device": META}
        operands = _SAME_DTYPE.get(func)
        if operands is not None:
            _check_dtypes(func, args, operands)
        seen: set[int] = set()
        args = _on_meta(args, seen, func)
        if kwargs:
            kwargs = _on_meta(kwargs, seen, func)
        try:
            out = _grouped_mm(args, kwargs) if func is _GROUPED_MM else func(*args, **kwargs)
        except Exception as error:
            _note_value_shaped(error, func, args)
            raise
        index = _UNREDUCED.get(func)
        if index is not None and not (len(args) > index and args[index] == 0):  # reduction="none": nothing kept
            out = _on_the_unreduced_loss(out, args)
        fresh = False
        for tensor in tensors_in(out):
            if tensor.layout is not torch.strided:  # a sparse gradient (Embedding(sparse=True)): its parts' memory
                if self.in_step or torch._C._current_graph_task_id() != -1:  # not a forward's (a graph's adjacency)
                    self.note_inexact("a sparse gradient", _SPARSE_MADE)
                for _, part in sparse_parts(tensor) or ():
                    fresh = self._fresh(part.untyped_storage(), seen) or fresh
                continue
            storage = tensor.untyped_storage()
            key = id(storage)
            if key not in seen and key not in self._storages:
                seen.add(key)
                self._add(storage)
                fresh = True
        if self.running:
            transient = self.workspace(func, args, out) if self.workspace is not None else 0
            if fresh or transient:
                self._observe(transient)
        rule = _TRUTH_RULES.get(func)
        if rule is not None and isinstance(out, torch.Tensor):
            self.truths.remember(out, rule, args)
        return out

    def _fresh(self, storage: torch.UntypedStorage, seen: set[int]) -> bool:
        """Count ``storage`` if it is new; return whether it was."""
        key = id(storage)
        if key in seen or key in self._storages:
            return False
        seen.add(key)
        self._add(storage)
        return True

    def placeholder(self, tensor: torch.Tensor) -> Any:
        """Return what ``tensor``'s values read as, and note the read; see ``reads.py`` for reads of many."""
        # Meta tensors hold no values. An optimizer reads its step count (1 keeps the
        # bias corrections finite); elsewhere 0 and False keep checks for infinities
        # (a gradient scaler's, say) from skipping the step, and a truth value is what
        # the checks it came from usually find (see Truths); inside LBFGS's step, a
        # check whose answer is not known is true (see _LBFGS). Every other read is
        # noted: whatever it decides, it decides from the placeholder.
        stepping = self.stepping[-1] if self.stepping else None
        longest = isinstance(stepping, torch.optim.LBFGS)
        held = self._held_as(tensor) if self.in_step and not longest else None
        dtype = tensor.dtype
        value: bool | float | int
        if dtype == torch.bool:
            kind, value = "truth value", self.truths.usual(tensor, unknown=longest)
        elif dtype.is_floating_point or dtype.is_complex:
            kind, value = "float", _STATE_FLOATS.get(held or "", 1.0) if self.in_step else 0.0
        else:
            kind, value = "integer", 1
        if longest:
            self.notes[_LBFGS.format(name=type(stepping).__name__)] = None
        elif self.in_step:
            # PyTorch's optimizers other than LBFGS read their step counts and compute per-parameter
            # scalars from values (Adafactor's scale from a norm), whose placeholders change no tensor's
            # size. Of other code inside a step, a read of what the optimizer holds is its own.
            if held is None and not _asked_from(_OPTIM) and not _in_scaler():
                _, placeholder, what = _VALUE_READS[kind]
                where = f"inside {type(stepping).__name__ if stepping is not None else 'an optimizer'}'s step"
                self._note_read(kind, f"{where}, other than its own step count", placeholder, what)
        elif not _in_scaler():
            # A loop that a read ends runs here; an optimizer's loops are over its parameters, or its iterations.
            self._count_read()
            placeholder, _, what = _VALUE_READS[kind]
            self._note_read(kind, "outside an optimizer step", placeholder, what)
        return value

    def _note_read(self, kind: str, where: str, placeholder: str, what: str) -> None:
        self.note_inexact(
            f"reading {'an' if kind == 'integer' else 'a'} {kind} from a tensor",
            _VALUE_READ.format(where=where, placeholder=placeholder, what=what),
        )

    def _held_as(self, tensor: torch.Tensor) -> str | None:
        """Return the key under which an optimizer stepping now holds ``tensor`` in its state or groups, or None."""
        if self._held is None:  # gathered once a step, at its first read
            self._held = {
                id(value): (weakref.ref(value), key)
                for optimizer in self.stepping
                for key, value in _tensors_held(optimizer)
            }
        found = self._held.get(id(tensor))
        return found[1] if found is not None and found[0]() is tensor else None

    def enter_step(self, optimizer: Any) -> None:
        """Follow ``optimizer``'s step, which starts now."""
        self.in_step += 1
        self.stepping.append(optimizer)
        self._held = None

    def leave_step(self) -> None:
        """Stop following the innermost optimizer step, which has ended."""
        self.in_step -= 1
        if self.stepping:
            self.stepping.pop()
        self._held = None

    def _count_read(self) -> None:
        """Count a read at the line that asked for it; raise once a line has asked more than a run allows."""
        frame: FrameType | None = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename.startswith(_INSIDE):
            frame = frame.f_back
        site = ("<unknown>", 0) if frame is None else (frame.f_code.co_filename, frame.f_lineno)
        count = self.reads.get(site, 0) + 1
        self.reads[site] = count
        if count > self.most_reads:
            where = (
                "the call" if frame is None else f"the code at {site[0]}, line {site[1]} (in {frame.f_code.co_name})"
            )
            raise RuntimeError(_ENDLESS.format(where=where, count=count))

    def note_inexact(self, operator: str, why: str) -> None:
        """Note once that the run met ``operator`` (as a user knows it) in a case it models inexactly, and ``why``."""
        self.notes[f"{operator}: {why}"] = None

    def phase(self) -> str:
        if torch._C._current_graph_task_id() != -1:
            return "backward"
        return "optimizer step" if self.in_step else "forward"

    def _add(self, storage: torch.UntypedStorage) -> None:
        key, raw = id(storage), storage.nbytes()
        nbytes = raw if self.round_bytes is None else self.round_bytes(raw)
        if self.running:
            phase = self.phase()
            category = "activations" if phase == "forward" else "temporaries"
            if phase == "backward" and not self._callback_queued and self.reclassify is not None:
                self._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)
        else:
            category = self.category
        self.clock += 1
        index = len(self.entries)
        self.entries.append([nbytes, category, self.clock, None, raw])
        self.index[key] = index
        entries, table = self.entries, self.index

        def forget(_: object) -> None:
            if self._storages.pop(key, None) is not None:
                if table.get(key) == index:
                    del table[key]
                self.clock += 1
                entries[index][3] = self.clock
                self.live -= nbytes

        self._storages[key] = weakref.ref(storage, forget)
        self.live += nbytes

    def _after_backward(self) -> None:
        self._callback_queued = False
        if self.reclassify is not None:
            self.reclassify()

    def entered_module(self) -> None:
        """Observe the bytes alive as a module's forward or backward begins: one that allocates nothing has them."""
        if self.running:
            self._observe(0)

    def _observe(self, transient: int) -> None:
        parents = self.modules.parents if self.modules is not None else ()
        self.observed.append((self.clock, transient, self.phase(), frozenset(parents) - _GLOBAL))

    def mark(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Give the storages of these tensors, where logged and alive, their category."""
        for category, tensor in tensors:
            try:
                key = id(tensor.untyped_storage())
            except (RuntimeError, NotImplementedError):
                continue
            index = self.index.get(key)
            if index is not None:
                self.entries[index][1] = category

    def start(self) -> None:
        """End the set-up: what is alive now is the start of the forward phase."""
        self.running = True
        self._observe(0)

    def moments(self) -> list[Moment]:
        """Return every moment observed, with the bytes alive by their final category."""
        slot = {category: index for index, category in enumerate(CATEGORIES)}
        changes: list[tuple[int, int, int, int]] = []  # (clock, category, bytes, bytes unrounded)
        for nbytes, category, made, freed, raw in self.entries:
            changes.append((made, slot[category], nbytes, raw))
            if freed is not None:
                changes.append((freed, slot[category], -nbytes, -raw))
        changes.sort(key=lambda change: change[0])
        parts, raw_parts, moments, position = [0] * len(CATEGORIES), [0] * len(CATEGORIES), [], 0
        temporaries = slot["temporaries"]
        for clock, transient, phase, modules in self.observed:
            while position < len(changes) and changes[position][0] <= clock:
                _, category, nbytes, raw = changes[position]
                parts[category] += nbytes
                raw_parts[category] += raw
                position += 1
            now, raw_now = list(parts), list(raw_parts)
            now[temporaries] += transient
            raw_now[temporaries] += transient
            moments.append(Moment(sum(now), sum(raw_now), phase, modules, tuple(now), tuple(raw_now)))
        return moments


_aten = torch.ops.aten

# Losses whose kernel writes the loss of every element into a tensor the size of its inputs, and
# returns its mean or sum as a 0-d tensor on that same storage: the whole buffer lives as long as
# the loss does (measured on the CPU; the same ATen code runs on CUDA). The meta kernel makes the
# 0-d result alone. By the index of their ``reduction`` argument (a mean by default).
_UNREDUCED: dict[Any, int] = {
    _aten.mse_loss.default: 2,
    _aten.smooth_l1_loss.default: 2,
    _aten.soft_margin_loss.default: 2,
    _aten.binary_cross_entropy.default: 3,
}


def _on_the_unreduced_loss(out: torch.Tensor, args: tuple[Any, ...]) -> torch.Tensor:
    """Return a 0-d loss on a storage of its inputs' size, as the real kernel returns it."""
    size = math.prod(torch.broadcast_shapes(args[0].shape, args[1].shape))  # type: ignore[no-untyped-call]
    return torch.empty(max(size, 1), dtype=out.dtype, device=META).as_strided((), ())


# Matrix products whose meta kernels, unlike the CPU's and CUDA's, take operands of two dtypes: by
# the positions of the operands that must share one. A float32 Linear given float64 or int64 rows
# would be estimated, and a size suggested, for a call that fails at every size.
_SAME_DTYPE: dict[Any, tuple[int, ...]] = {
    _aten.mm.default: (0, 1),
    _aten.addmm.default: (1, 2, 0),
    _aten.mv.default: (0, 1),
    _aten.addmv.default: (1, 2, 0),
    _aten.dot.default: (0, 1),
}


# A mixture of experts' grouped matrix product (transformers' MoE layers): its meta kernel takes bfloat16
# alone, where the CPU's kernel takes float32 too. Its result's shape depends on the shapes only: the
# meta kernel is asked it in bfloat16, and the result made in the dtype the kernel would give.
_GROUPED_MM: Any = getattr(getattr(_aten, "_grouped_mm", None), "default", None)


def _grouped_mm(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """Return the meta result of ``aten._grouped_mm`` for operands of any floating dtype."""
    first = args[0]
    if first.dtype == torch.bfloat16:
        return _GROUPED_MM(*args, **kwargs)  # type: ignore[no-any-return]
    dtype = kwargs.get("out_dtype") or (args[4] if len(args) > 4 and args[4] is not None else first.dtype)

    def bf16(value: Any) -> Any:
        return value.to(torch.bfloat16) if isinstance(value, torch.Tensor) and value.is_floating_point() else value

    shaped = _GROUPED_MM(
        *map(bf16, args[:4]), **{key: bf16(value) for key, value in kwargs.items() if key != "out_dtype"}
    )
    return torch.empty(shaped.shape, dtype=dtype, device=META)


def _check_dtypes(func: Any, args: tuple[Any, ...], operands: tuple[int, ...]) -> None:
    """Raise the error the device's kernel raises for ``func``'s operands of different dtypes."""
    dtypes = [args[index].dtype for index in operands if index < len(args) and isinstance(args[index], torch.Tensor)]
    if len(set(dtypes)) > 1:
        names = " and ".join(str(dtype).removeprefix("torch.") for dtype in dict.fromkeys(dtypes))
        raise RuntimeError(
            f"{func.__name__}: its operands must have the same dtype, but got {names} (as on the device: PyTorch's "
            "meta kernel does not check it). Give the model inputs of its parameters' dtype, or run it under "
            "torch.autocast"
        )


# What a truth value made by these operators usually is, for a read of it on meta tensors:
# ``True``/``False``; ``"not"``, ``"and"``, ``"or"`` of their arguments' usual values;
# ``"all"``/``"any"``, their argument's, or (when nothing is known of it) True for all()
# (validations: every mask entry set, every position in order) and False for any()
# (a NaN anywhere, an ignored label); ``"self"``: whether both arguments are one tensor
# (``x == x`` holds where x is not NaN; ``isfinite`` is made of it); ``"above"``/``"below"``: a
# comparison with an infinity, what it is for finite values (``x < inf`` true, ``x > inf`` false).
_TRUTH_KINDS: dict[str, bool | str] = {
    "isnan": False,
    "isinf": False,
    "isposinf": False,
    "isneginf": False,
    "logical_not": "not",
    "bitwise_not": "not",
    "logical_and": "and",
    "bitwise_and": "and",
    "mul": "and",
    "logical_or": "or",
    "bitwise_or": "or",
    "all": "all",
    "any": "any",
    "eq": "self",
    "ne": "finite",
    "gt": "above",
    "ge": "above",
    "lt": "below",
    "le": "below",
}
_TRUTH_RULES: dict[Any, bool | str] = {
    getattr(getattr(_aten, name), overload): kind
    for name, kind in _TRUTH_KINDS.items()
    for overload in getattr(_aten, name).overloads()
}


class Truths:
    """What the truth values of a meta run (made by ``_TRUTH_RULES``) usually are, per live tensor."""

    def __init__(self) -> None:
        self._usual: dict[int, tuple[weakref.ref[torch.Tensor], bool]] = {}

    def usual(self, tensor: torch.Tensor, unknown: bool = False) -> bool:
        """Return what ``tensor``'s value usually is; ``unknown`` if nothing is known of it."""
        known = self._known(tensor)
        return unknown if known is None else known

    def _known(self, value: Any) -> bool | None:
        if not isinstance(value, torch.Tensor):
            return None
        found = self._usual.get(id(value))
        return found[1] if found is not None and found[0]() is value else None

    def remember(self, out: torch.Tensor, rule: bool | str, args: tuple[Any, ...]) -> None:
        """Remember what ``out``, made by an operator of rule ``rule`` from ``args``, usually is."""
        if out.dtype != torch.bool:
            return
        first = self._known(args[0]) if args else None
        second = self._known(args[1]) if len(args) > 1 else None
        if isinstance(rule, bool):
            usual: bool | None = rule
        elif rule == "not":
            usual = None if first is None else not first
        elif rule == "and":
            usual = None if first is None or second is None else first and second
        elif rule == "or":
            usual = None if first is None or second is None else first or second
        elif rule == "all":
            usual = True if first is None else first
        elif rule == "any":
            usual = False if first is None else first
        elif rule == "self":  # x == x: not NaN
            usual = True if len(args) > 1 and args[0] is args[1] else None
        elif rule in ("above", "below"):  # x > -inf, x < inf: finite values are; x > inf, x < -inf: none is
            bound = args[1] if len(args) > 1 else None
            usual = (bound < 0) == (rule == "above") if isinstance(bound, float) and math.isinf(bound) else None
        else:  # x != inf: finite
            usual = True if len(args) > 1 and isinstance(args[1], float) and math.isinf(args[1]) else None
        if usual is not None:
            if len(self._usual) > 4096:  # a long run's dead entries: forget them
                self._usual = {key: entry for key, entry in self._usual.items() if entry[0]() is not None}
            self._usual[id(out)] = (weakref.ref(out), usual)


def _asked_from(directory: str) -> bool:
    """Return whether the first frame that asked for a read, past koila and the rest of torch, is in ``directory``."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(directory):
            return True
        if not name.startswith(_INSIDE):
            return False
        frame = frame.f_back
    return False


def _tensors_held(optimizer: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the tensors ``optimizer`` holds in its state and its parameter groups, but its parameters, by key."""
    for state in optimizer.state.values():
        if isinstance(state, Mapping):
            yield from ((key, value) for key, value in state.items() if isinstance(value, torch.Tensor))
    for group in optimizer.param_groups:
        yield from ((key, value) for key, value in group.items() if key != "params" and isinstance(value, torch.Tensor))


# PyTorch's fused optimizer steps update their arguments in place and return nothing, and some
# have no meta kernel (SGD's, Adagrad's, Adam's with a tensor learning rate): on meta tensors
# there is nothing to compute, and the kernels allocate nothing that a dispatch mode sees.
_FUSED_STEPS = frozenset(
    overload
    for name in ("_fused_sgd_", "_fused_adam_", "_fused_adamw_", "_fused_adagrad_")
    if hasattr(_aten, name)
    for overload in (getattr(getattr(_aten, name), kind) for kind in getattr(_aten, name).overloads())
    if not overload._schema.returns
)


def _note_value_shaped(error: Exception, func: Any, args: tuple[Any, ...]) -> None:
    """Add to ``error`` the note of an operator whose result's shape depends on values, if ``func`` is one."""
    name = getattr(getattr(func, "overloadpacket", None), "__name__", None)
    what = _VALUE_SHAPED.get(name) if isinstance(name, str) else None
    if what is None or sys.version_info < (3, 11):
        return
    if name == "index":  # integer indices have a shape known without values
        indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
        if not any(isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8) for index in indices):
            return
    error.add_note(_VALUE_SHAPED_NOTE.format(what=what))


def value_shaped_note(error: BaseException) -> str | None:
    """Return the estimate's note on ``error`` that an operator's result's shape depends on values, if it has one."""
    for note in getattr(error, "__notes__", ()):
        if isinstance(note, str) and _VALUE_SHAPED_WHY in note:
            return note
    return None


def _in_scaler() -> bool:
    """Return whether torch.amp's gradient scaler is on the stack (a read of its inf checks)."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        parts = frame.f_code.co_filename.replace("\\", "/").rsplit("/", 3)[-3:]
        if tuple(parts) == _SCALER_FILE:
            return True
        frame = frame.f_back
    return False


def _on_meta(tree: Any, seen: set[int], func: Any) -> Any:
    """Return an operator's arguments with every tensor on the meta device; note their storages."""
    if isinstance(tree, torch.Tensor):
        if tree.device.type == "meta":
            if tree.layout is torch.strided:
                seen.add(id(tree.untyped_storage()))
            else:  # a sparse one (a sparse gradient): its parts hold the memory
                seen.update(id(part.untyped_storage()) for _, part in sparse_parts(tree) or ())
            return tree
        if tree.requires_grad:
            raise RuntimeError(
                f"running the call on meta tensors, {func} was given a real tensor of shape {tuple(tree.shape)} "
                "that requires grad, "
                "which the call reached some way other than through a module or optimizer it can see (as an "
                "argument, in its closure, in a global it names, or bound as self), so autograd would write to "
                "it. Pass that module, or a function that closes over it"
            )
        # A real tensor reached other than through a module or optimizer (a constant in a closure):
        # read through a meta copy, never written, not counted.
        copy = torch.empty_strided(tree.size(), tree.stride(), dtype=tree.dtype, device=META)
        seen.add(id(copy.untyped_storage()))
        return copy
    if isinstance(tree, (tuple, list)):
        return type(tree)(_on_meta(item, seen, func) for item in tree)
    if isinstance(tree, dict):
        return {key: _on_meta(value, seen, func) for key, value in tree.items()}
    return tree
