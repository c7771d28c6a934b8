"""Peak memory of a call, estimated without data: ``estimate`` and ``suggest_batch_size``.

The call runs for real, operator by operator, on meta tensors (shapes and no
data) at a few batch sizes, while a dispatch mode counts the bytes their storages
would hold. The user's modules and optimizers are lent meta copies of their tensors
for the duration, for the estimating thread only (``lending.py``), and given their own
back afterwards, so nothing they own is read as data or written, and other threads
using them meanwhile see the real ones. (PyTorch's ``FakeTensorMode`` does the same
job with fake CPU tensors at three times the cost per operator, and fake CUDA tensors
abort the process in autograd on a machine without CUDA.)
"""

from __future__ import annotations

import gc
import importlib
import itertools
import math
import sys
import threading
import time
import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from types import FrameType
from typing import Any, NamedTuple, cast

import torch
from cachetools import LRUCache
from torch.utils._python_dispatch import _disable_current_modes, is_traceable_wrapper_subclass
from torch.utils.module_tracker import ModuleTracker

from koila_retry._common.batches import Split
from koila_retry._common.places import levels_to_caller
from koila_retry._common.tensors import same_device, tensors_in
from koila_retry._common.tracking import LiveStorageTracker
from koila_retry._common.units import format_bytes, parse_bytes
from koila_retry._common.walk import reachable
from koila_retry._core.cache import NoCache, SizeCache
from koila_retry._core.decision import in_samples
from koila_retry._core.engine import Controller
from koila_retry._core.memory import DeviceLike, PeakMeter, free_memory, peak_meter, recent_free_memory, resolve_device
from koila_retry._core.policy import Policy
from koila_retry._estimation.attention import device_kernels
from koila_retry._estimation.autocast import autocast_like, settle
from koila_retry._estimation.calibration import (
    LARGEST,
    Calibration,
    Corrected,
    Fitting,
    gap_of,
    largest_power,
    probe_size,
)
from koila_retry._estimation.lending import Loan, ThreadTracker, borrowing, exclusive
from koila_retry._estimation.reads import ValueReads
from koila_retry._estimation.recurrent import recurrent_kernels
from koila_retry._estimation.sharding import Emulation, Sharding, plan
from koila_retry._estimation.versions import warn_if_unchecked
from koila_retry._estimation.workspace import cuda_rounding, device_workspace
from koila_retry.exceptions import BatchSizeExhausted

__all__ = ["MemoryEstimate", "estimate", "estimate_batch", "suggest_batch_size"]

CATEGORIES = ("parameters", "gradients", "optimizer state", "inputs", "activations", "temporaries")


# Fake runs cost the same at any batch size; this keeps shapes far from 32-bit limits.
_LARGEST_RUN = 1 << 20
DEFAULT_MARGIN = 0.1

_LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default
_GLOBAL = frozenset({"Global"})  # what torch's ModuleTracker calls being in no module

# Bytes an operator holds during its call beyond its arguments and results.
Workspace = Callable[[Any, tuple[Any, ...], Any], int]


class _Moment(NamedTuple):
    """One moment of a run: the bytes alive, where the call was, and what they were."""

    total: int  # bytes alive (as the device's allocator rounds them), with operators' workspaces
    raw: int  # the same before rounding: these grow exactly linearly with the batch
    phase: str
    modules: frozenset[str]
    parts: tuple[int, ...]  # bytes by category, in the order of CATEGORIES
    raw_parts: tuple[int, ...]


class _Run(NamedTuple):
    """Every moment of one run, at one batch size, and what it could not model exactly."""

    batch_size: int
    moments: list[_Moment]
    notes: tuple[str, ...] = ()

    def phase_peaks(self) -> dict[str, _Moment]:
        peaks: dict[str, _Moment] = {}
        for moment in self.moments:
            best = peaks.get(moment.phase)
            if best is None or moment.total > best.total:
                peaks[moment.phase] = moment
        return peaks

    def module_peaks(self) -> dict[tuple[str, str], int]:
        peaks: dict[tuple[str, str], int] = {}
        for moment in self.moments:
            direction = "backward" if moment.phase == "backward" else "forward"
            for name in moment.modules:
                key = (name, direction)
                if moment.total > peaks.get(key, -1):
                    peaks[key] = moment.total
        return peaks

    def aligned(self, other: _Run) -> bool:
        """Return whether both runs went through the same moments, in the same places."""
        if len(self.moments) != len(other.moments):
            return False
        return all(
            mine.phase == theirs.phase and mine.modules == theirs.modules
            for mine, theirs in zip(self.moments, other.moments, strict=True)
        )


class _Line(NamedTuple):
    """Bytes alive at one moment of the call, as ``intercept + slope * batch_size``."""

    slope: float
    intercept: float
    phase: str
    parts: tuple[tuple[float, float], ...]  # (slope, intercept) per category

    def at(self, batch_size: float) -> float:
        return self.intercept + self.slope * batch_size


def _through(small: int, large: int, low: float, high: float, *, slope: float | None = None) -> tuple[float, float]:
    """Return (slope, intercept) of the line through two values, or with ``slope`` through the second."""
    if slope is None:
        slope = (high - low) / (large - small)
    return slope, high - slope * large


def _joining(small: int, large: int, first: _Moment, second: _Moment) -> _Line:
    """Return the line of one moment's bytes through two runs.

    Its slope is that of the bytes before rounding, which grow exactly linearly; it
    passes through the rounded bytes at the larger size. (Rounded bytes alone can
    hide growth: 8 and 16 rows of a small layer are one 512-byte block each.)
    """
    slope, intercept = _through(small, large, first.raw, second.raw)
    slope, intercept = _through(small, large, first.total, second.total, slope=slope)
    parts = tuple(
        _through(small, large, 0, rounded, slope=_through(small, large, low, high)[0])
        for low, high, rounded in zip(first.raw_parts, second.raw_parts, second.parts, strict=True)
    )
    return _Line(slope, intercept, first.phase, parts)


def _envelope(lines: Iterable[_Line], low: float) -> list[_Line]:
    """Return the lines that are the highest somewhere from batch size ``low`` up, by slope."""
    steepest: dict[float, _Line] = {}
    for line in lines:
        kept = steepest.get(line.slope)
        if kept is None or line.intercept > kept.intercept:
            steepest[line.slope] = line
    hull: list[_Line] = []
    for line in sorted(steepest.values()):
        # The last line is never above both neighbours once the new one crosses the one before it first.
        while len(hull) >= 2:
            first, last = hull[-2], hull[-1]
            if (line.intercept - first.intercept) * (last.slope - first.slope) >= (last.intercept - first.intercept) * (
                line.slope - first.slope
            ):
                hull.pop()
            else:
                break
        hull.append(line)
    while len(hull) >= 2 and hull[1].at(low) >= hull[0].at(low):
        hull.pop(0)
    return hull


class _Segment(NamedTuple):
    """The lines that hold between two batch sizes run at (from 1 for the first, with no end for the last)."""

    low: float
    high: float
    lines: list[_Line]
    modules: dict[tuple[str, str], list[_Line]]

    def covers(self, batch_size: int) -> bool:
        return self.low <= batch_size <= self.high


def _model(runs: list[_Run]) -> list[_Segment]:
    """Return, between each two sizes run at, the lines whose highest is the peak.

    Where two runs went through the same moments, each moment's bytes are exactly a
    line through them, which holds at every size that takes the same path through
    the call. Between two runs that took different paths, each phase's peak is
    taken as the straight line joining them.
    """
    segments = []
    for index, (small, large) in enumerate(itertools.pairwise(runs)):
        a, b = small.batch_size, large.batch_size
        low, high = small.phase_peaks(), large.phase_peaks()
        lines = [_joining(a, b, low[phase], high[phase]) for phase in low if phase in high]
        modules: dict[tuple[str, str], list[_Line]] = defaultdict(list)
        low_modules, high_modules = small.module_peaks(), large.module_peaks()
        for key, value in low_modules.items():
            if key in high_modules:
                modules[key].append(_Line(*_through(a, b, value, high_modules[key]), key[1], ()))
        if small.aligned(large):
            for first, second in zip(small.moments, large.moments, strict=True):
                line = _joining(a, b, first, second)
                lines.append(line)
                direction = "backward" if first.phase == "backward" else "forward"
                for name in first.modules:
                    modules[(name, direction)].append(line)
        start = 1.0 if index == 0 else float(a)
        end = math.inf if index == len(runs) - 2 else float(b)
        enveloped = {key: _envelope(found, start) for key, found in sorted(modules.items())}
        segments.append(_Segment(start, end, _envelope(lines, start), enveloped))
    return segments


class MemoryEstimate:
    """The estimated peak memory of a call, as a function of its batch size.

    Made by :func:`estimate`. The model: the bytes alive at any one moment of the
    call grow linearly with the batch size (for a call that takes the same path
    through its code at every size), so the peak, the largest of them, is the
    highest of a set of lines, and convex. Two runs that took the same path
    give every moment's line exactly. Where runs took different paths, the straight
    line joining two sizes' peaks, which is never below a convex curve between
    them, stands in. So at small batch sizes the optimizer step, which hardly
    depends on the batch, can set the peak, and at large ones the forward or
    backward pass does.

    Attributes:
        device (torch.device): the device the estimate is for.
        sizes (tuple of int): the batch sizes the call was run at.
        measured (dict): the peak bytes measured at each of them.
        started (dict): the bytes alive as the call started, at each of them:
            the parameters, gradients and optimizer state there were, and the
            inputs. What a device's allocator reports as the rise of a real run
            is its peak less these.
        resident (int): bytes of the counted tensors (parameters, buffers,
            gradients, optimizer state) that already exist on ``device``; they
            are part of every peak, and not of the device's free memory.
        seconds (float): how long the estimate took.
        notes (tuple of str): what the call ran that the estimate knows it
            does not model exactly, one ``"what: why"`` each (an attention
            kernel the device would fuse, say); empty when everything it ran
            is modelled. See :doc:`/estimate`.
        fsdp (int or None): under FSDP2, the ranks the model is sharded over:
            the estimate is then one rank's (see :ref:`estimate-fsdp`); ``None``
            otherwise.

    .. versionadded:: 0.1.0
    """

    def __init__(self, device: torch.device, runs: list[_Run], resident: int, seconds: float) -> None:
        self.device = device
        self.sizes = tuple(run.batch_size for run in runs)
        self.resident = resident
        self.seconds = seconds
        self.notes = tuple(dict.fromkeys(note for run in runs for note in run.notes))
        self.measured = {run.batch_size: max(moment.total for moment in run.moments) for run in runs}
        self.started = {run.batch_size: run.moments[0].total for run in runs}
        self.fsdp: int | None = None
        self._segments = _model(runs)

    def _highest(self, batch_size: int) -> _Line:
        _check_batch_size(batch_size)
        lines = (line for segment in self._segments if segment.covers(batch_size) for line in segment.lines)
        return max(lines, key=lambda line: line.at(batch_size))

    @property
    def fixed(self) -> int:
        """int: bytes of the peak that do not depend on the batch size, at large sizes."""
        return max(round(self._segments[-1].lines[-1].intercept), 0)

    @property
    def per_sample(self) -> int:
        """int: bytes the peak grows by per sample, at large sizes."""
        return max(math.ceil(self._segments[-1].lines[-1].slope), 0)

    def peak(self, batch_size: int) -> int:
        """Return the estimated peak bytes of the call at ``batch_size``.

        Args:
            batch_size (int): the rows along ``dim``; at least 1.

        Returns:
            int: the most bytes the call holds at once, everything counted.
        """
        return max(math.ceil(self._highest(batch_size).at(batch_size)), 0)

    def phase(self, batch_size: int) -> str:
        """Return the phase of the call in which its peak falls at ``batch_size``.

        Args:
            batch_size (int): the rows along ``dim``.

        Returns:
            str: ``"forward"`` (which includes whatever runs outside backward and
            the optimizer step), ``"backward"`` or ``"optimizer step"``.
        """
        return self._highest(batch_size).phase

    def breakdown(self, batch_size: int) -> dict[str, int]:
        """Return the bytes held at the peak, by what they are.

        Args:
            batch_size (int): the rows along ``dim``.

        Returns:
            dict: bytes of ``"parameters"`` (buffers included),
            ``"gradients"``, ``"optimizer state"``, ``"inputs"``, ``"activations"``
            (made by the forward pass) and ``"temporaries"`` (made by backward or
            the optimizer step, neither gradients nor state, and operators'
            workspaces); they add up to :meth:`peak`, give or take rounding.
        """
        parts = self._highest(batch_size).parts
        return {
            category: max(round(intercept + slope * batch_size), 0)
            for category, (slope, intercept) in zip(CATEGORIES, parts, strict=True)
        }

    def module_peaks(self, batch_size: int) -> dict[str, tuple[int, int]]:
        """Return the peak bytes held while each module ran, forward and backward.

        Args:
            batch_size (int): the rows along ``dim``.

        Returns:
            dict: per module name (its type, then the path
            of attribute names, as ``"Sequential.0"``), the most bytes alive
            while its forward ran and while its backward ran (0 if it had none).
        """
        _check_batch_size(batch_size)
        highest: dict[tuple[str, str], float] = {}
        for segment in self._segments:
            if segment.covers(batch_size):
                for key, lines in segment.modules.items():
                    highest[key] = max(highest.get(key, 0.0), *(line.at(batch_size) for line in lines))
        peaks: dict[str, tuple[int, int]] = {}
        for (name, direction), value in highest.items():
            forward, backward = peaks.get(name, (0, 0))
            bytes_ = max(math.ceil(value), 0)
            peaks[name] = (bytes_, backward) if direction == "forward" else (forward, bytes_)
        return peaks

    def fits(self, batch_size: int, budget: int | str, *, margin: float = 0.1) -> bool:
        """Return whether the peak at ``batch_size``, plus ``margin``, fits in ``budget`` bytes.

        Args:
            batch_size (int): the rows along ``dim``.
            budget (int or str): bytes available to the call, everything counted
                (``"80GiB"`` for a whole card).
            margin (float): the fraction of the peak kept free for what is not
                modelled. Default: 0.1.

        Returns:
            bool: ``peak(batch_size) * (1 + margin) <= budget``.
        """
        return self.peak(batch_size) * (1 + _check_margin(margin)) <= parse_bytes(budget)

    def largest_fitting(self, budget: int | str, *, margin: float = 0.1, maximum: int | None = None) -> int | None:
        """Return the largest power of two whose peak, plus ``margin``, fits in ``budget``.

        Args:
            budget (int or str): bytes available to the call, everything counted.
            margin (float): the fraction of the peak kept free. Default: 0.1.
            maximum (int, optional): no larger size is returned.

        Returns:
            int or None: the batch size, or ``None`` if even 1 does not fit.
        """
        limit = parse_bytes(budget)
        factor = 1 + _check_margin(margin)
        ceiling = LARGEST if maximum is None else _check_batch_size(maximum, "maximum")
        return largest_power(lambda size: self.peak(size) * factor <= limit, ceiling)

    def describe(self, batch_size: int) -> str:
        """Return the peak at ``batch_size`` and what it is made of, then the notes, if any.

        Args:
            batch_size (int): the rows along ``dim``.

        Returns:
            str: one line, and one more per note (see :attr:`notes`).
        """
        parts = ", ".join(
            f"{category} {format_bytes(value)}" for category, value in self.breakdown(batch_size).items() if value
        )
        where = "" if self.fsdp is None else f" per rank of FSDP2 over {self.fsdp}"
        line = (
            f"estimated peak {format_bytes(self.peak(batch_size))}{where} at batch size {batch_size} "
            f"(during the {self.phase(batch_size)}: {parts})"
        )
        return "\n".join([line, *(f"  may be inexact: {note}" for note in self.notes)])

    def __repr__(self) -> str:
        return (
            f"MemoryEstimate(device={str(self.device)!r}, fixed={format_bytes(self.fixed)}, "
            f"per_sample={format_bytes(self.per_sample)}, sizes={self.sizes})"
        )


def _check_batch_size(value: object, name: str = "batch_size") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def _check_margin(margin: object) -> float:
    if isinstance(margin, bool) or not isinstance(margin, (int, float)):
        raise TypeError(f"margin must be a number, a fraction of the peak like 0.1, got {margin!r}")
    if not 0 <= margin < 10:
        raise ValueError(f"margin must be a number in [0, 10), a fraction of the peak, got {margin!r}")
    return float(margin)


def estimate(
    fn: Callable[..., Any],
    /,
    *args: Any,
    dim: int = 0,
    sizes: Iterable[int] | None = None,
    device: DeviceLike = None,
    fsdp: int | None = None,
    **kwargs: Any,
) -> MemoryEstimate:
    """Estimate the peak memory of ``fn(*args, **kwargs)`` at any batch size, without running it.

    ``fn`` runs on meta tensors (shapes, no data) at a few batch sizes: the
    example arguments' tensors are remade with that many rows along ``dim``, and
    the modules and optimizers ``fn`` reaches (as arguments, through its closure,
    the globals it names, its defaults or the object it is bound to) are lent
    meta copies of their parameters, buffers, gradients and state for the run, in
    the calling thread only: other threads that use them meanwhile see the real
    ones. They get their own back afterwards, untouched: nothing is read as data
    or written. Estimates in one process take turns. ``fn`` may be a forward pass
    or a whole training step, with ``backward()`` and ``optimizer.step()``.
    Models built on the meta device work the same way. Its Python side effects do
    happen: what it appends to a list, it appends; a value it reads with
    ``.item()`` reads as a placeholder (see :doc:`/estimate`).

    Args:
        fn (callable): the call to estimate.
        *args: its positional arguments; the tensors among them (and inside
            dicts, lists, tuples and dataclasses) with rows along ``dim`` are
            the batch, remade at each size; see :ref:`batches`.
        dim (int): the batch dimension. Default: 0.
        sizes (iterable of int, optional): the batch sizes to run at, at least
            two. Default: the example's rows (at least 2) and twice that; if the
            call takes different paths through its code at those two, also 1, a
            size at which the bytes that grow with the batch dwarf the rest, and
            twice that.
        device (torch.device, str, int or None): the device the estimate is for.
            On CUDA, each allocation is rounded as the caching allocator rounds
            it. Default: the device of the first tensor argument.
        fsdp (int, optional): estimate one rank's peak with the model sharded
            by FSDP2 over this many ranks, which need not be running: every
            module held in an ``nn.ModuleList`` is sharded, then the whole model
            (see :ref:`estimate-fsdp`). Modules already sharded with
            ``fully_shard`` are estimated per rank without it, over their mesh.
        **kwargs: its keyword arguments.

    Returns:
        MemoryEstimate: ``peak(batch_size)``, its breakdown and its fit.

    Raises:
        ValueError: if no argument is a tensor, the tensors disagree on their
            rows, ``dim`` or ``sizes`` is out of range, or ``fsdp`` is not an
            int >= 1 or differs from the mesh of modules sharded already.
        NotImplementedError: for FSDP2 set-ups the estimate cannot play (HSDP,
            CPU offload, ``fully_shard`` over several modules at once).
        Exception: what ``fn`` raised on meta tensors, with a note that says so.

    .. versionadded:: 0.1.0
    """
    if not callable(fn):
        raise TypeError(f"koila.estimate needs a callable, got {type(fn).__name__} {fn!r}")
    return estimate_batch(fn, Split(args, kwargs, dim, "koila.estimate", fn), sizes=sizes, device=device, fsdp=fsdp)


def estimate_batch(
    fn: Callable[..., Any],
    batch: Split,
    *,
    sizes: Iterable[int] | None = None,
    device: DeviceLike = None,
    fsdp: int | None = None,
) -> MemoryEstimate:
    """Estimate the peak memory of ``fn`` on the arguments ``batch`` holds, at any batch size.

    Args:
        fn (callable): the call to estimate.
        batch (Split): its arguments, with the tensors that hold the rows found.
        sizes (iterable of int, optional): as for :func:`estimate`.
        device (torch.device, str, int or None): as for :func:`estimate`.
        fsdp (int, optional): as for :func:`estimate`.

    Returns:
        MemoryEstimate: the estimate.

    Raises:
        ValueError: if the arguments have 0 rows, or ``sizes`` or ``fsdp`` is out of range.
        NotImplementedError: as for :func:`estimate`.
    """
    # Dispatch modes import torch._dynamo the first time they run (seconds): not the estimate's time.
    importlib.import_module("torch._dynamo")
    warn_if_unchecked()
    started = time.perf_counter()
    if batch.rows == 0:
        raise ValueError(f"the example arguments have 0 rows along dim {batch.dim}: nothing to scale from")
    chosen = _sizes(sizes)
    target = resolve_device(device) if device is not None else batch.device
    owned = Owned((fn, batch.args, batch.kwargs))
    sharding = plan(owned.modules, fsdp)
    round_bytes = cuda_rounding if target.type == "cuda" else None
    workspace = device_workspace(target)
    inexact = inexact_operators(target)

    def run(size: int) -> _Run:
        return _run(fn, batch, owned, size, round_bytes, workspace, inexact, target, sharding)

    with exclusive():  # one estimate at a time: see lending.py
        runs = _runs(run, batch.rows, chosen)
        resident = owned.resident(target, round_bytes)
    found = MemoryEstimate(target, runs, resident, time.perf_counter() - started)
    found.fsdp = sharding.world if sharding is not None else None
    return found


def _runs(run: Callable[[int], _Run], rows: int, chosen: list[int] | None) -> list[_Run]:
    """Run the call at the sizes chosen, or at those the default finds (see :func:`estimate`)."""
    # A collection during a run was seen to fire the weak-reference callbacks of meta
    # storages still in use (PyTorch keeps their Python objects alive for them, and a
    # collection of an earlier run's garbage can clear the references): none runs. The
    # collector is the process's: other threads' garbage waits for the estimate too.
    collecting = gc.isenabled()
    gc.disable()
    try:
        if chosen is None:
            base = max(rows, 2)
            runs = [run(base), run(2 * base)]
            if not runs[0].aligned(runs[1]):
                # The call takes another path at another size (a loop over chunks of its
                # own, say): the peak is measured at 1, and far out too, where it grows
                # at its final rate.
                one = run(1)
                large = _large_size(one, runs[0])
                runs = [one, *runs, run(large), run(2 * large)]
        else:
            runs = [run(size) for size in chosen]
    finally:
        if collecting:
            gc.enable()
    return runs


def suggest_batch_size(
    fn: Callable[..., Any],
    /,
    *args: Any,
    dim: int = 0,
    device: DeviceLike = None,
    budget: int | str | None = None,
    margin: float = DEFAULT_MARGIN,
    maximum: int | None = None,
    sizes: Iterable[int] | None = None,
    calibrate: bool = False,
    fsdp: int | None = None,
    **kwargs: Any,
) -> int:
    """Return the largest power of two whose estimated peak fits in the memory there is.

    With ``calibrate=True``, the estimate is corrected by a real run before the
    size is chosen: ``fn`` runs once, for real, on the first rows of the example
    arguments (as many as fit even if the estimate were 8 times under the truth,
    at most all of them), and the device's peak over that run scales the bytes the
    estimate says the call makes of its own (see :doc:`/estimate`). That is the
    only way to see what opaque kernels allocate (cuDNN's and cuBLAS's workspaces,
    a reduction's buffers), and what a branch on a tensor's value really does. The
    run is real: a training step updates the model and the optimizer, once.

    Args:
        fn (callable): the call, as for :func:`estimate`.
        *args: its positional arguments, as for :func:`estimate`.
        dim (int): the batch dimension. Default: 0.
        device (torch.device, str, int or None): as for :func:`estimate`.
        budget (int or str, optional): bytes available to the call, everything
            counted (``"80GiB"`` for a whole card). Default: the device's free
            memory (:func:`free_memory`) plus what of the call's parameters,
            gradients and optimizer state already lies on it.
        margin (float): the fraction of the peak kept free for what the
            estimate does not model. Default: 0.1.
        maximum (int, optional): no larger size is suggested.
        sizes (iterable of int, optional): as for :func:`estimate`.
        calibrate (bool): run ``fn`` once for real and correct the estimate by
            the device's peak over that run. Only where the device keeps a peak
            (CUDA and the other accelerators, or inside
            :func:`~koila_retry.testing.simulated_device`); elsewhere (the CPU)
            the estimate stands, with a warning. Not for a model sharded
            with FSDP2, whose real run would make collectives on this rank
            alone. Default: ``False``.
        fsdp (int, optional): the batch size of one rank of FSDP2 over this
            many ranks, as for :func:`estimate`.
        **kwargs: its keyword arguments.

    Returns:
        int: the batch size (per rank, under FSDP2).

    Raises:
        BatchSizeExhausted: if even a batch of 1 does not fit; the message
            holds the estimate.
        ValueError: if ``budget``, ``margin`` or ``maximum`` is out of range, or
            no budget is given for an estimate on the meta device, or
            ``calibrate=True`` for a device other than the one the example
            arguments lie on.
        TypeError: if ``calibrate`` is not a bool.
        NotImplementedError: for ``calibrate=True`` under FSDP2, and as for
            :func:`estimate`.

    .. versionadded:: 0.1.0
    """
    _check_margin(margin)
    if maximum is not None:
        _check_batch_size(maximum, "maximum")
    if not isinstance(calibrate, bool):
        raise TypeError(f"calibrate must be a bool, got {type(calibrate).__name__} {calibrate!r}")
    limit = None if budget is None else parse_bytes(budget)  # refused before the estimate, not after
    if not callable(fn):
        raise TypeError(f"koila.suggest_batch_size needs a callable, got {type(fn).__name__} {fn!r}")
    batch = Split(args, kwargs, dim, "koila.suggest_batch_size", fn)
    found = estimate_batch(fn, batch, sizes=sizes, device=device, fsdp=fsdp)
    if calibrate and found.fsdp is not None:
        raise NotImplementedError(
            "calibrate=True runs the call for real, and over FSDP2 that makes collectives on this rank alone: "
            "estimate without it, or measure with koila.accumulate's recovery instead"
        )
    if limit is None and found.device.type == "meta":
        raise ValueError(
            "the estimate is for the meta device (the inputs are meta tensors), which has no memory to fit in: "
            "pass budget= (like '80GiB') or the device= it is for"
        )
    available = free_memory(found.device) + found.resident if limit is None else limit
    fitting: Fitting = _calibrated(fn, batch, found, available, margin) if calibrate else found
    size = fitting.largest_fitting(available, margin=margin, maximum=maximum)
    if size is None:
        first, *notes = found.describe(1).splitlines()
        raise BatchSizeExhausted(
            "\n".join(
                [
                    f"even a batch of 1 does not fit: {first}, plus a margin of {margin:.0%}, "
                    f"and {format_bytes(available)} are available on {found.device}",
                    *notes,
                ]
            ),
            batch_size=1,
            attempts=0,
        )
    if found.notes and fitting is found:  # a measured run followed the real branches
        warn_inexact(found, f"koila.suggest_batch_size chose {size} for {_name_of(fn)}")
    return size


def _calibrated(fn: Callable[..., Any], batch: Split, found: MemoryEstimate, budget: int, margin: float) -> Fitting:
    """Return the estimate corrected by one real run of ``fn`` on the first rows of ``batch``, where it can be."""
    device = found.device
    if not same_device(batch.device, device):
        raise ValueError(
            f"calibrate=True runs the call for real on its example arguments, which lie on {batch.device}, and "
            f"measures the device the estimate is for, {device}: pass example arguments on {device}"
        )
    meter = peak_meter(device)
    if meter is None:
        warnings.warn(
            f"calibrate=True measures the peak of a real run, and {device} keeps none (a CPU allocator has no "
            "peak to read): the estimate stands as it is. It is measured on CUDA and other accelerators, and inside "
            "koila_retry.testing.simulated_device",
            UserWarning,
            stacklevel=levels_to_caller(),
        )
        return found
    name = _name_of(fn)

    def measured(size: int) -> tuple[int, int]:
        args, kwargs = batch.chunk(0, size)
        with meter:
            fn(*args, **kwargs)
        return size, meter.rise

    # An estimate more than 8 times under the truth runs out of memory even so: the engine
    # retries the run at the next smaller size, and gives up with BatchSizeExhausted at 1.
    probe = min(probe_size(found, budget, batch.rows, margin), batch.rows)
    policy = Policy.of("koila.suggest_batch_size", probe, {"cache": NoCache(), "sync": False})
    controller = Controller(f"koila.suggest_batch_size({name})", policy)
    rows, rise = controller.call(fn, None, device, measured)
    return Corrected(found, Calibration(((rows, gap_of(found, rows, rise)),)))


def warn_inexact(found: MemoryEstimate, what: str) -> None:
    """Warn, once for the caller to see, that ``what`` rests on an estimate with notes.

    Args:
        found (MemoryEstimate): the estimate; its :attr:`~MemoryEstimate.notes` are quoted.
        what (str): what was decided from it, as the start of a sentence.
    """
    warnings.warn(
        f"{what}, from an estimate that may be inexact (see MemoryEstimate.notes): {'; '.join(found.notes)}",
        UserWarning,
        stacklevel=levels_to_caller(),
    )


def _name_of(fn: object) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


# --- the batch -------------------------------------------------------------------


def _sizes(sizes: Iterable[int] | None) -> list[int] | None:
    if sizes is None:
        return None
    if isinstance(sizes, (int, str)):
        raise TypeError(f"sizes must be an iterable of batch sizes, like (1, 64, 128), got {sizes!r}")
    chosen = sorted({_check_batch_size(size, "every size") for size in sizes})
    if len(chosen) < 2:
        raise ValueError(f"sizes must hold at least two different batch sizes, got {chosen}")
    return chosen


def _large_size(one: _Run, base: _Run) -> int:
    """Return a power of two at which the bytes that grow with the batch dwarf the rest."""
    fixed = max(moment.total for moment in one.moments)
    low, high = one.phase_peaks(), base.phase_peaks()
    growth = max(high[phase].total - low[phase].total for phase in low if phase in high) / (base.batch_size - 1)
    wanted = 8 * fixed / growth if growth > 0 else 0
    large = 1 << max(math.ceil(math.log2(max(wanted, 1))), 0)
    return min(max(large, 4 * base.batch_size), max(_LARGEST_RUN, 4 * base.batch_size))


# --- what the call owns ------------------------------------------------------------


class Owned:
    """The modules, optimizers and other training state a call can reach, and how to lend them meta tensors."""

    def __init__(self, roots: Iterable[Any]) -> None:
        modules: dict[int, torch.nn.Module] = {}
        optimizers: dict[int, torch.optim.Optimizer] = {}
        others: dict[int, object] = {}
        for value in reachable(roots):
            if isinstance(value, torch.nn.Module):
                for module in value.modules():
                    modules.setdefault(id(module), module)
            elif isinstance(value, torch.optim.Optimizer):
                optimizers.setdefault(id(value), value)
            else:
                others.setdefault(id(value), value)
        self.modules = list(modules.values())
        self.optimizers = list(optimizers.values())
        self.others = list(others.values())

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield every tensor the modules and optimizers hold, with its category."""
        for module in self.modules:
            for tensor in (*module._parameters.values(), *module._buffers.values()):
                if tensor is not None:
                    yield "parameters", tensor
                    if tensor.grad is not None:
                        yield "gradients", tensor.grad
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                for parameter in group["params"]:
                    yield "parameters", parameter
                    if parameter.grad is not None:
                        yield "gradients", parameter.grad
            for state in optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        yield "optimizer state", value

    def resident(self, device: torch.device, round_bytes: Callable[[int], int] | None) -> int:
        """Return the bytes of the tensors held that lie on ``device`` now."""
        seen: set[int] = set()
        total = 0
        for _, found in self.tensors():
            # A DTensor (FSDP2's shards) holds its rank's part, which is what lies on the device.
            tensor = found._local_tensor if is_traceable_wrapper_subclass(found) else found
            if same_device(tensor.device, device) and tensor.layout == torch.strided:
                storage = tensor.untyped_storage()
                if id(storage) not in seen:
                    seen.add(id(storage))
                    total += round_bytes(storage.nbytes()) if round_bytes else storage.nbytes()
        return total

    def lend(self, recorder: Recorder, sharding: Sharding | None = None) -> Callable[[], None]:
        """Lend this thread meta copies of every module's and optimizer's tensors; return what ends the loan.

        Other threads go on seeing the real tensors, containers and hooks (see
        ``lending.py``); the loan holds the estimate lock until it ends. Must run
        under ``recorder``, which counts the copies.

        Args:
            recorder (Recorder): the dispatch mode of the run; its ``category``
                names what each copy is.
            sharding (Sharding, optional): FSDP2 to play in the run: sharded
                tensors are lent as one rank's shard (see ``sharding.py``).

        Returns:
            callable: ends the loan; call it on this thread.
        """
        loan = Loan()
        loan.mode.reads = ValueReads(recorder.placeholder)  # the reads that never reach the recorder
        loan.hold()
        emulation: Emulation | None = None

        def fake_of(tensor: torch.Tensor, category: str, owner: torch.Tensor | None = None) -> torch.Tensor:
            fake = loan.copy_of(tensor)
            if fake is None:
                recorder.category = category
                shape = sharding.shape_of(tensor, owner) if sharding is not None else None
                if shape is not None:
                    fake = torch.empty(shape, dtype=tensor.dtype, device=META)
                elif sharding is not None and sharding.held(tensor):
                    with _disable_current_modes():  # counted as FSDP2's gathered buffers instead
                        fake = torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, device=META)
                else:
                    fake = torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, device=META)
                if isinstance(tensor, torch.nn.Parameter):
                    fake = torch.nn.Parameter(fake, requires_grad=tensor.requires_grad)
                elif tensor.requires_grad:
                    fake.requires_grad_(True)
                grad = tensor.grad if tensor.is_leaf else None
                if grad is not None and grad.layout == torch.strided:
                    fake.grad = fake_of(grad, "gradients", tensor)
                loan.add(tensor, fake)
            return fake

        try:
            for module in self.modules:
                for table in (module._parameters, module._buffers):
                    for tensor in table.values():
                        if tensor is not None:
                            fake_of(tensor, "parameters")
            for optimizer in self.optimizers:
                for group in optimizer.param_groups:
                    for parameter in group["params"]:
                        fake_of(parameter, "parameters")
                for parameter, values in optimizer.state.items():
                    fake_of(parameter, "parameters")
                    for value in values.values():
                        if isinstance(value, torch.Tensor):
                            fake_of(value, "optimizer state", parameter)
            if sharding is not None:
                # FSDP2 keeps every shard, also of a module whose gathered parameters it holds now.
                for unit in sharding.units:
                    for parameter in unit.params:
                        fake_of(parameter, "parameters")
                for tensor in sharding.gathered():
                    fake_of(tensor, "parameters")  # not counted: see Sharding.held
                emulation = sharding.emulation(loan.copy_of)
            # Their other attributes are put back as they were too: a scheduler's epoch, a scaler's record.
            loan.lend([*self.others, *self.modules, *self.optimizers])
            if emulation is not None:
                emulation.install(lambda category, tensor: recorder.mark([(category, tensor)]))
        except BaseException:
            loan.end()
            raise
        if emulation is None:
            return loan.end

        def end() -> None:
            try:
                emulation.uninstall()
            finally:
                loan.end()

        return end

    def gradients_and_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield the gradients and optimizer state the run holds now (after ``lend``)."""
        for category, tensor in self.tensors():
            if category != "parameters":
                yield category, tensor


# --- what the estimate knows it does not model exactly -----------------------------

# A value read from a tensor outside an optimizer step, by its kind: what it reads as, and
# what is made of such reads. The optimizer's own reads (its step count) and a gradient
# scaler's (whether any gradient is infinite) read as a step that is taken, which is what
# the estimate models; they are not noted.
_VALUE_READS = {
    "integer": ("1", "sizes and branches made from it"),
    "float": ("0.0", "branches and sizes made from it (a NaN guard, a threshold)"),
    "truth value": (
        "False, or what the check it came from usually finds (finite values, no NaN, all() of those, "
        "torch.equal and torch.allclose true)",
        "the branches taken (`if t:`, `if x.sum() > 0:`, `if torch.isfinite(loss):`)",
    ),
}
_VALUE_READ = (
    "outside an optimizer step, the value reads as a placeholder, {placeholder}, since meta tensors hold none: "
    '{what} may differ from those of the real run. Where the device can be measured, initial="auto" and '
    "suggest_batch_size(calibrate=True) measure a real run instead"
)
# torch.amp's gradient scaler, whose reads of its inf checks the estimate answers as "none found".
_SCALER_FILE = ("torch", "amp", "grad_scaler.py")
_CUDNN_CONVOLUTION = (
    "convolution: the workspace cuDNN takes on CUDA is not modelled (on an H100 a backward took 280 MiB): "
    'the estimate may be below the real peak; initial="auto" measures it on the device'
)


def inexact_operators(device: torch.device) -> dict[Any, str]:
    """Return the operators whose memory on ``device`` the estimate knows it does not model exactly.

    The :class:`Recorder` looks every operator it runs up in this table (one dict
    lookup) and puts the notes of those it meets on the estimate
    (:attr:`MemoryEstimate.notes`), so that an estimate is never silently wrong
    where it knows better. An operator that is inexact only in some cases is noted
    by the code that models it, with :meth:`Recorder.note_inexact`. Known today
    (torch 2.13):

    * on CUDA, ``aten.convolution`` and its backward: cuDNN's workspace;
    * a value read from a tensor outside an optimizer step and a gradient
      scaler (``int(t)``, ``float(t)``, ``.item()``, ``if t:``, and through
      ``reads.py`` ``tolist()``, ``numpy()``, ``torch.equal``, ``torch.allclose``),
      which reads as a placeholder: noted by the Recorder itself;
    * what ``attention.py`` and ``recurrent.py`` cannot run as the device's
      kernels, noted by them with :meth:`Recorder.note_inexact`.

    Not noted, because they are modelled: oneDNN's convolution buffers on the CPU
    (``workspace.py``), the attention kernels and fast paths and CUDA's fused dropout
    (``attention.py``), the recurrent kernels (``recurrent.py``, though cuDNN's,
    fitted to one GPU's measurements, note themselves) and the CUDA allocator's
    rounding.
    Not noted, because meta tensors cannot run them at all, so the estimate fails
    with their error instead: operators whose result's shape depends on values
    (``nonzero``, ``unique``, ``masked_select``, indexing with a boolean mask).

    Args:
        device (torch.device): the device the estimate is for.

    Returns:
        dict: the note of each operator overload, as ``"what: why"``.
    """
    if device.type != "cuda":
        return {}
    return {
        torch.ops.aten.convolution.default: _CUDNN_CONVOLUTION,
        torch.ops.aten.convolution_backward.default: _CUDNN_CONVOLUTION,
    }


# --- one run on meta tensors ------------------------------------------------------


class Recorder(LiveStorageTracker):  # type: ignore[no-untyped-call]
    """Count live storages, by phase and category, with the peaks of each phase and module.

    Every storage made is logged with the event clock at which it was made and
    freed, so the bytes alive at a phase's peak can be told apart, by category,
    after the run: whether a storage became a gradient or optimizer state is known
    only later.
    """

    def __init__(
        self,
        round_bytes: Callable[[int], int] | None,
        workspace: Workspace | None,
        inexact: Mapping[Any, str] | None = None,
    ) -> None:
        super().__init__()
        self.round_bytes = round_bytes
        self.workspace = workspace
        self.inexact = inexact or {}  # operator -> its note (see inexact_operators)
        self.notes: dict[str, None] = {}  # what the run could not model exactly, in the order met
        self.category = "inputs"
        self.running = False
        self.in_step = 0
        self.clock = 0
        self.entries: list[list[Any]] = []  # [bytes, category, made at, freed at or None, bytes unrounded]
        self.index: dict[int, int] = {}  # id of a live storage -> its entry
        self.observed: list[tuple[int, int, str, frozenset[str]]] = []  # (clock, transient bytes, phase, modules)
        self.modules: ModuleTracker | None = None
        self.reclassify: Callable[[], None] | None = None
        self._callback_queued = False
        self.truths = Truths()

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func is _LOCAL_SCALAR:
            return self.placeholder(args[0])
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
        seen: set[int] = set()
        args = _on_meta(args, seen, func)
        if kwargs:
            kwargs = _on_meta(kwargs, seen, func)
        out = func(*args, **kwargs)
        fresh = False
        for tensor in tensors_in(out):
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

    def placeholder(self, tensor: torch.Tensor) -> Any:
        """Return what ``tensor``'s values read as, and note the read; see ``reads.py`` for reads of many."""
        # Meta tensors hold no values. An optimizer reads its step count (1 keeps the
        # bias corrections finite); elsewhere 0 and False keep checks for infinities
        # (a gradient scaler's, say) from skipping the step, and a truth value is what
        # the checks it came from usually find (see Truths). Every other read is noted:
        # whatever it decides, it decides from the placeholder.
        dtype = tensor.dtype
        value: bool | float | int
        if dtype == torch.bool:
            kind, value = "truth value", self.truths.usual(tensor)
        elif dtype.is_floating_point or dtype.is_complex:
            kind, value = "float", 1.0 if self.in_step else 0.0
        else:
            kind, value = "integer", 1
        if not self.in_step and not _in_scaler():
            placeholder, what = _VALUE_READS[kind]
            self.note_inexact(
                f"reading {'an' if kind == 'integer' else 'a'} {kind} from a tensor",
                _VALUE_READ.format(placeholder=placeholder, what=what),
            )
        return value

    def note_inexact(self, operator: str, why: str) -> None:
        """Say that the run met something it cannot model exactly; the estimate shows it once.

        For the code that models an operator's kernel (the Recorder's dispatch, or a
        hook it calls) when the case at hand is one it knows it gets wrong. An
        operator that is always inexact on some device belongs in
        :func:`inexact_operators` instead.

        Args:
            operator (str): what it is, as a user knows it (``"torch.nn.LSTM"``,
                ``"scaled_dot_product_attention"``).
            why (str): how the device's memory differs from the estimate's, and
                in which direction if known.
        """
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

    def moments(self) -> list[_Moment]:
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
            moments.append(_Moment(sum(now), sum(raw_now), phase, modules, tuple(now), tuple(raw_now)))
        return moments


META = torch.device("meta")

_aten = torch.ops.aten
# What a truth value made by these operators usually is, for a read of it on meta tensors:
# ``True``/``False``; ``"not"``, ``"and"``, ``"or"`` of their arguments' usual values;
# ``"all"``/``"any"``, their argument's, or (when nothing is known of it) True for all()
# (validations: every mask entry set, every position in order) and False for any()
# (a NaN anywhere, an ignored label); ``"self"``: whether both arguments are one tensor
# (``x == x`` holds where x is not NaN; ``isfinite`` is made of it).
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
}
_TRUTH_RULES: dict[Any, bool | str] = {
    getattr(getattr(_aten, name), overload): kind
    for name, kind in _TRUTH_KINDS.items()
    for overload in getattr(_aten, name).overloads()
}


class Truths:
    """What the truth values a meta run makes would usually be, so that a read of one follows the usual branch.

    Remembered per tensor for as long as it lives, and only for the operators of
    ``_TRUTH_RULES``; a read of any other truth value reads ``False``.
    """

    def __init__(self) -> None:
        self._usual: dict[int, tuple[weakref.ref[torch.Tensor], bool]] = {}

    def usual(self, tensor: torch.Tensor) -> bool:
        """Return what ``tensor``'s value usually is; ``False`` if nothing is known of it."""
        return self._known(tensor) is True

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
        else:  # x != inf: finite
            usual = True if len(args) > 1 and isinstance(args[1], float) and math.isinf(args[1]) else None
        if usual is not None:
            if len(self._usual) > 4096:  # a long run's dead entries: forget them
                self._usual = {key: entry for key, entry in self._usual.items() if entry[0]() is not None}
            self._usual[id(out)] = (weakref.ref(out), usual)


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
    """Return an operator's arguments with every tensor on the meta device; note their storages.

    A real tensor the call reaches some other way than through a module or optimizer
    it can see (a constant in a closure, say) is read through a meta copy: its values
    are never written, and its memory is not counted.
    """
    if isinstance(tree, torch.Tensor):
        if tree.device.type == "meta":
            seen.add(id(tree.untyped_storage()))
            return tree
        if tree.requires_grad:
            raise RuntimeError(
                f"running the call on meta tensors, {func} was given a real tensor of shape {tuple(tree.shape)} "
                "that requires grad, "
                "which the call reached some way other than through a module or optimizer it can see (as an "
                "argument, in its closure, in a global it names, or bound as self), so autograd would write to "
                "it. Pass that module, or a function that closes over it"
            )
        copy = torch.empty_strided(tree.size(), tree.stride(), dtype=tree.dtype, device=META)
        seen.add(id(copy.untyped_storage()))
        return copy
    if isinstance(tree, (tuple, list)):
        return type(tree)(_on_meta(item, seen, func) for item in tree)
    if isinstance(tree, dict):
        return {key: _on_meta(value, seen, func) for key, value in tree.items()}
    return tree


def _on_meta_device(tensor: torch.Tensor, shape: list[int]) -> torch.Tensor:
    return torch.empty(shape, dtype=tensor.dtype, device=META, requires_grad=tensor.requires_grad)


def _put_back_a_reseeded_rng(seed: int, state: torch.Tensor) -> None:
    """Put the global random number generator back to ``state`` if the run seeded it anew.

    Operators on meta tensors draw no random numbers, so the run itself never
    advances the generator; what changes it meanwhile is the call seeding it
    (``torch.manual_seed``), which is put back, or another thread drawing from it,
    which is not: rewinding would make that thread draw the same numbers again.
    """
    if torch.initial_seed() == seed:
        # Compared as the CPU tensors they are, past the modes of an estimate this one may run inside.
        with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
            now = torch.get_rng_state()
            seeded = torch.Generator().manual_seed(seed).get_state()
            if torch.equal(now, state) or not torch.equal(now, seeded):
                return  # unchanged, or drawn from: not seeded anew
    torch.set_rng_state(state)


def _run(
    fn: Callable[..., Any],
    batch: Split,
    owned: Owned,
    batch_size: int,
    round_bytes: Callable[[int], int] | None,
    workspace: Workspace | None,
    inexact: Mapping[Any, str] | None = None,
    target: torch.device = META,
    sharding: Sharding | None = None,
) -> _Run:
    recorder = Recorder(round_bytes, workspace, inexact)
    seed, rng = torch.initial_seed(), torch.get_rng_state()
    handles: list[Any] = []
    undo: Callable[[], None] | None = None
    try:
        with META, recorder:
            try:
                undo = owned.lend(recorder, sharding)
                recorder.category = "inputs"
                args, kwargs = batch.resized(batch_size, _on_meta_device)
                recorder.mark(owned.gradients_and_state())

                def reclassify() -> None:
                    recorder.mark(owned.gradients_and_state())

                def entered_step(*_: Any) -> None:
                    recorder.in_step += 1
                    reclassify()

                def left_step(*_: Any) -> None:
                    recorder.in_step -= 1
                    reclassify()

                recorder.reclassify = reclassify
                # Each optimizer's own hooks, registered into the dicts lent to this thread: another
                # thread's step neither calls them nor meets a change to the process's hooks mid-loop.
                for optimizer in owned.optimizers:
                    handles.append(optimizer.register_step_pre_hook(entered_step))
                    handles.append(optimizer.register_step_post_hook(left_step))
                with ThreadTracker() as modules:
                    recorder.modules = modules
                    recorder.start()
                    try:
                        # The attention and recurrent kernels the target runs, and its autocast.
                        with (
                            device_kernels(target, owned.modules, recorder.note_inexact),
                            recurrent_kernels(target, owned.modules, recorder.note_inexact),
                            autocast_like(target, recorder.note_inexact),
                        ):
                            fn(*args, **kwargs)
                    except Exception as error:
                        if sys.version_info >= (3, 11):
                            error.add_note(
                                f"(raised while koila.estimate ran the call on meta tensors, which have shapes and "
                                f"no values, with a batch of {batch_size})"
                            )
                        raise
                    finally:
                        recorder.modules = None
                reclassify()
                del args, kwargs
                moments = recorder.moments()
            finally:
                for handle in handles:
                    handle.remove()
                handles.clear()
                if undo is not None:
                    undo()
                recorder.reclassify = None
    finally:
        _put_back_a_reseeded_rng(seed, rng)
    return _Run(batch_size, moments, tuple(recorder.notes))


# --- initial="auto" -----------------------------------------------------------------

AUTO = "auto"


def check_auto(initial: object) -> None:
    """Refuse a string ``initial`` other than ``"auto"``."""
    if isinstance(initial, str) and initial != AUTO:
        raise ValueError(f"initial must be an int >= 1, None or 'auto', got {initial!r}")


class _Estimates:
    """The estimates of one function on one input signature: its step whole, and split, and their correction.

    A split step's micro-batches after the first add their gradients into the
    first's, so they hold every gradient plus the incoming one: another estimate,
    made only when the whole batch does not fit. ``calibration`` is what a real run
    on the device said of the estimates' own bytes (see ``calibration.py``), once one
    was measured.
    """

    __slots__ = ("calibration", "memo", "sample_bytes", "split", "split_made", "whole")

    def __init__(self, memo: _Memo, whole: MemoryEstimate | None, sample_bytes: int = 0) -> None:
        self.memo = memo
        self.whole = whole  # None: it could not be made (and a warning said why)
        # The bytes of one input sample the estimates were made on: the memo's key names a
        # class of sample shapes, and a call with larger samples of the class scales down.
        self.sample_bytes = sample_bytes
        self.split: MemoryEstimate | None = None
        self.split_made = False
        self.calibration: Calibration | None = None

    def split_of(self, make: Callable[[], MemoryEstimate] | None, name: str) -> MemoryEstimate:
        """Return the estimate of a split step, made the first time; the whole step's if it has none."""
        if not self.split_made:
            if make is not None:
                self.split = self.memo.made(make, name, "the memory of a split step", "sizes micro-batches by one")
            self.split_made = True
        return self.split or cast(MemoryEstimate, self.whole)

    def fitting(self, found: MemoryEstimate) -> Fitting:
        """Return ``found`` as sizes are decided from it: corrected, once a run was measured."""
        return found if self.calibration is None else Corrected(found, self.calibration)


class _Fit:
    """What fits at one level of free memory: the most rows of a whole step, and the largest split.

    Each is found with the margin and without: the margin is for what the estimate
    does not model, and when nothing fits with it, the whole batch that fits without
    it is still the best start there is. A fit is of the estimates as corrected when
    it was made (``calibration``).
    """

    __slots__ = ("_split", "bare", "budget", "calibration", "estimates", "whole")

    def __init__(self, estimates: _Estimates, budget: int) -> None:
        found = estimates.fitting(cast(MemoryEstimate, estimates.whole))
        self.estimates, self.budget, self.calibration = estimates, budget, estimates.calibration
        self.whole = _most_rows(found, budget, DEFAULT_MARGIN)
        self.bare = _most_rows(found, budget, 0.0)
        self._split: tuple[int, int] | None = None

    def split(self, make: Callable[[], MemoryEstimate] | None, name: str) -> tuple[int, int]:
        """Return the largest power of two a split step fits at, with the margin and without (0: none)."""
        if self._split is None:
            found = self.estimates.fitting(self.estimates.split_of(make, name))
            self._split = (
                found.largest_fitting(self.budget, margin=DEFAULT_MARGIN) or 0,
                found.largest_fitting(self.budget, margin=0.0) or 0,
            )
        return self._split


def _most_rows(found: Fitting, budget: int, margin: float) -> int:
    """Return the most rows, of any number, whose estimated peak plus ``margin`` fits (0 if none)."""
    power = found.largest_fitting(budget, margin=margin)
    if power is None:
        return 0
    low, high = power, 2 * power  # the most rows lie between
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if found.fits(middle, budget, margin=margin) else (low, middle)
    return low


class _Memo:
    """What ``initial="auto"`` remembers beside one cache's sizes, and forgets with them.

    Estimates per function and input signature (the costly part), with what a
    measured run said of them, and what fits per level of free memory
    (power-of-two buckets, as :class:`StackMemoryCache` keys have), so that a call
    given far more memory later starts larger. A :class:`NoCache` keeps neither:
    every call estimates, and measures, afresh.
    """

    def __init__(self, keep: bool) -> None:
        self.keep = keep
        self.lock = threading.Lock()
        self.estimates: LRUCache[Hashable, _Estimates] = LRUCache(maxsize=64)
        self.fits: LRUCache[Hashable, _Fit] = LRUCache(maxsize=256)
        self.warned: set[Hashable] = set()  # what was warned about once: (function, why)
        self.making: dict[Hashable, threading.Event] = {}  # estimates being made, set when they are

    def estimates_of(
        self, key: Hashable, make: Callable[[], MemoryEstimate], name: str, sample_bytes: int = 0
    ) -> _Estimates:
        """Return the estimates of ``key``, made by the first thread to ask; the others wait for them.

        A thread that asks from inside an estimate (a call that estimates its own
        first size while it is being estimated) makes its own: it holds the estimate
        lock, which the thread making them would need.

        Args:
            key (Hashable): the function, its input signature and the device.
            make (callable): makes the estimate of one step.
            name (str): the function's name, for warnings.
            sample_bytes (int): the bytes of one input sample of the call that
                makes them (see :class:`AutoFirst`).

        Returns:
            _Estimates: the estimates; their ``whole`` is ``None`` if it could not be
            made (a warning said why).
        """
        while True:
            with self.lock:
                found = self.estimates.get(key)
                if found is not None:
                    return found
                making = self.making.get(key)
                if making is None or borrowing():
                    making = threading.Event()
                    if self.keep and key not in self.making:
                        self.making[key] = making
                    break
            making.wait()
        try:
            whole = self.made(
                make, name, "the memory", "starts from the whole batch and halves on out-of-memory errors"
            )
            found = _Estimates(self, whole, sample_bytes)
            if self.keep:
                with self.lock:
                    self.estimates[key] = found
        finally:
            with self.lock:
                if self.making.get(key) is making:
                    del self.making[key]
            making.set()
        return found

    def fit(self, key: Hashable, device: torch.device, estimates: _Estimates, budget: int | None = None) -> _Fit:
        """Return what fits at the device's level of free memory now; for ``budget`` bytes, if given, at that level."""
        level = (key, recent_free_memory(device).bit_length())
        with self.lock:
            fit = self.fits.get(level)
        if (
            fit is not None
            and budget is None
            and fit.estimates is estimates
            and fit.calibration == estimates.calibration
        ):
            return fit
        if budget is None:
            budget = free_memory(device) + cast(MemoryEstimate, estimates.whole).resident
        fit = _Fit(estimates, budget)
        if self.keep:
            with self.lock:
                self.fits[level] = fit
        return fit

    def first_time(self, what: Hashable) -> bool:
        """Return whether ``what`` is new here, and remember it."""
        with self.lock:
            new = what not in self.warned
            self.warned.add(what)
        return new

    def made(self, make: Callable[[], MemoryEstimate], name: str, what: str, then: str) -> MemoryEstimate | None:
        """Return the estimate ``make`` makes, or ``None`` after a warning (once) that says why it could not."""
        failure = None
        try:
            return make()
        except Exception as error:
            failure = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        if self.first_time((name, what, failure)):  # outside the handler, so that the error is gone
            warnings.warn(
                f"initial='auto' could not estimate {what} of {name} ({failure}); it {then}",
                UserWarning,
                stacklevel=levels_to_caller(),
            )
        return None


def _memo_of(cache: SizeCache) -> _Memo:
    memo = cache.derived.get(AUTO)
    if memo is None:
        memo = cache.derived.setdefault(AUTO, _Memo(keep=not isinstance(cache, NoCache)))
    return cast(_Memo, memo)


class AutoFirst:
    """The first size of an ``initial="auto"`` call, the estimate behind it, and its calibration.

    Asked by the engine when the cache holds no size for the call. The whole batch
    if the estimate of a step over all of it fits in the free memory (plus what of
    the call's parameters, gradients and optimizer state already lies on the
    device), with the margin; else the largest power of two at which a split step
    fits, estimated with its own memory (``split``); else the whole batch if it
    fits without the margin; else the largest split that does; else 1. Estimates
    and what fits are remembered in the cache (see :class:`_Memo`).

    Where the device keeps a peak (CUDA and the other accelerators, a simulated
    device) and no run of these estimates was measured yet, the estimate is a
    prior: the first size is a probe (``calibration.probe_size``), its real run is
    measured (:attr:`meter`), and :meth:`corrected` turns the measurement into the
    size for the rest of the call and, through the memo, for later calls.

    Args:
        key (Hashable): the function, its input signature and the device.
        rows (int): the rows of this call.
        make (callable): makes the estimate of one step over a batch.
        device (torch.device): the device the call runs on.
        name (str): the function's name, for warnings.
        cache (SizeCache): the cache of the call's sizes, which holds the memo.
        split (callable, optional): makes the estimate of a split step (two
            micro-batches, the second adding its gradients into the first's);
            by default a split step is estimated as a whole one.
        step (bool): the call is a training step (``accumulate``). A first size
            that covers every row is measured as it is, with no probe before it: a
            step split for a probe holds more (every gradient, and the next
            micro-batch's) than the whole step does. After a probe, the rest of the
            step is measured as a split step.
        sample_bytes (int): the bytes of one input sample of this call. ``key``
            names a class of sample shapes (rows padded to 37 tokens and to 50
            share it), and the remembered estimates were made on the first
            call's samples: for larger samples of the class, the sizes they
            choose are scaled down to as many bytes of samples, as the cache
            scales the sizes it stores.

    Attributes:
        meter (PeakMeter or None): after the first size was asked for with
            ``measure``: what measures the first run, when it is to be measured.
    """

    __slots__ = (
        "_cache",
        "_device",
        "_estimates",
        "_figures",
        "_fit",
        "_key",
        "_make",
        "_measured",
        "_name",
        "_rows",
        "_sample_bytes",
        "_split",
        "_step",
        "meter",
    )

    def __init__(
        self,
        key: Hashable,
        rows: int,
        make: Callable[[], MemoryEstimate],
        device: torch.device,
        name: str,
        cache: SizeCache,
        split: Callable[[], MemoryEstimate] | None = None,
        *,
        step: bool = False,
        sample_bytes: int = 0,
    ) -> None:
        self._key, self._rows, self._make, self._device, self._name = key, rows, make, device, name
        self._cache, self._split, self._step, self._sample_bytes = cache, split, step, sample_bytes
        self._measured = 0  # runs of this call measured so far
        self._figures: tuple[int, int] | None = None
        self._estimates: _Estimates | None = None
        self._fit: _Fit | None = None
        self.meter: PeakMeter | None = None

    def __call__(self, measure: bool = True) -> int:
        """Return the first size; a probe to measure if ``measure`` and nothing was measured yet.

        Args:
            measure (bool): whether the caller can measure the first run (the engine
                cannot when ranks agree, since each rank would measure its own).

        Returns:
            int: the first size, at least 1.
        """
        memo, rows, name = _memo_of(self._cache), self._rows, self._name
        estimates = self._estimates = memo.estimates_of(self._key, self._make, name, self._sample_bytes)
        whole = estimates.whole
        if whole is None:
            return rows
        if whole.notes and memo.first_time((name, whole.notes)):
            warn_inexact(whole, f"initial='auto' chose the first size of {name}")
        fit = self._fit = memo.fit(self._key, self._device, estimates)
        first = self._decide(fit)
        if measure and estimates.calibration is None:
            self.meter = peak_meter(self._device)
            if self.meter is not None and not (self._step and first >= rows):
                return probe_size(whole, fit.budget, first, DEFAULT_MARGIN)
        return first

    def after_oom(self, size: int) -> int:
        """Return the size to measure next, after the run to be measured ran out of memory at ``size``.

        The estimate is then under the truth by more than its margin: the next run
        is a probe, below ``size``, that fits even if it were 8 times under.

        Args:
            size (int): the size that ran out of memory.

        Returns:
            int: at least 1, at most half of ``size`` (or 1).
        """
        estimates, fit = self._estimates, self._fit
        below = max(size // 2, 1)
        if estimates is None or fit is None or estimates.whole is None or estimates.calibration is not None:
            return below
        return probe_size(estimates.whole, fit.budget, below, DEFAULT_MARGIN)

    def _scaled(self, size: int, estimates: _Estimates) -> int:
        """Return ``size`` rows of the samples the estimates were made on, as rows of this call's samples."""
        return in_samples(size, estimates.sample_bytes, self._sample_bytes)

    def _decide(self, fit: _Fit) -> int:
        rows, estimates = self._rows, fit.estimates
        whole = cast(MemoryEstimate, estimates.whole)
        self._figures = (whole.per_sample, whole.fixed)
        if rows <= self._scaled(fit.whole, estimates):
            return rows
        split, split_bare = (self._scaled(size, estimates) for size in fit.split(self._split, self._name))
        found = estimates.split or whole
        self._figures = (found.per_sample, found.fixed)
        if split:
            return split
        return rows if rows <= self._scaled(fit.bare, estimates) else split_bare or 1

    def corrected(self, rows: int, rise: int) -> int:
        """Correct the estimates by a measured run, and return the size for what follows.

        The first run measured is one step or chunk; a training step's second is the
        rest of a step split after a probe, set against the estimate of a split step.

        Args:
            rows (int): the rows of the run measured (of each micro-batch, for the
                rest of a split step).
            rise (int): its peak on the device less what was allocated as it began
                (for the rest of a split step, plus the gradients the step held).

        Returns:
            int: the size the corrected estimates choose, as the first size is chosen.
        """
        estimates, fit = self._estimates, self._fit
        if estimates is None or fit is None or estimates.whole is None:
            return self._rows
        found = estimates.whole
        if self._step and self._measured:
            found = estimates.split_of(self._split, self._name)
        self._measured += 1
        known = estimates.calibration or Calibration(())
        estimates.calibration = known.adding(rows, gap_of(found, rows, rise))
        # At the budget the call began with: what the call holds by now is in the estimates.
        fit = self._fit = _memo_of(self._cache).fit(self._key, self._device, estimates, fit.budget)
        return self._decide(fit)

    def split_rows(self) -> int:
        """Return the micro-batch size of a step already split, as the (corrected) estimate of a split step fits it."""
        fit = self._fit
        if fit is None or fit.estimates.whole is None:
            return max(self._rows // 2, 1)
        split, split_bare = (self._scaled(size, fit.estimates) for size in fit.split(self._split, self._name))
        return split or split_bare or 1

    def figures(self) -> tuple[int, int] | None:
        """Return the estimate's per-sample and fixed bytes, if one was made for this call's inputs."""
        if self._figures is not None:
            return self._figures
        memo = _memo_of(self._cache)
        with memo.lock:
            found = memo.estimates.get(self._key)
        whole = None if found is None else found.whole
        return None if whole is None else (whole.per_sample, whole.fixed)
