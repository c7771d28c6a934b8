"""Peak memory of a call, estimated without data: ``estimate``, ``suggest_batch_size``, ``MemoryEstimate``.

The call runs operator by operator on meta tensors (shapes, no data) at a few batch
sizes (``meta``), counted by a dispatch mode (``recorder``), and a line is fitted to
each moment (``fit``). Not ``FakeTensorMode``: it costs three times as much per
operator, and fake CUDA tensors abort the process in autograd without CUDA.
"""

from __future__ import annotations

import importlib
import math
import numbers
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from koila_retry._common.batches import Split
from koila_retry._common.places import levels_to_caller
from koila_retry._common.tensors import same_device
from koila_retry._common.units import as_int, check_flag, format_bytes, parse_bytes, type_name
from koila_retry._core.cache import NoCache
from koila_retry._core.engine import Controller
from koila_retry._core.memory import DeviceLike, free_memory, peak_meter, resolve_device
from koila_retry._core.policy import Policy
from koila_retry._estimation.calibration import (
    LARGEST,
    Calibration,
    Corrected,
    Fitting,
    gap_of,
    largest_power,
    probe_size,
)
from koila_retry._estimation.fit import CATEGORIES, Line, Run, segments_of
from koila_retry._estimation.lending import Owned, exclusive
from koila_retry._estimation.meta import run_at_sizes, run_on_meta
from koila_retry._estimation.recorder import inexact_operators
from koila_retry._estimation.sharding import plan
from koila_retry._estimation.versions import warn_if_unchecked
from koila_retry._estimation.workspace import cuda_rounding, device_workspace
from koila_retry.exceptions import BatchSizeExhausted

__all__ = ["MemoryEstimate", "estimate", "estimate_batch", "suggest_batch_size"]

DEFAULT_MARGIN = 0.1


class MemoryEstimate:
    """The estimated peak memory of a call, as a function of its batch size.

    Made by :func:`estimate`. The model: the bytes alive at any one moment of the
    call grow linearly with the batch size (for a call that takes the same path
    through its code at every size), so the peak, the largest of them, is the
    highest of a set of lines, and convex. Two runs that took the same path
    give every moment's line exactly. Where runs took different paths, the straight
    line joining two sizes' peaks stands in: exact at both, it can be below the
    real peak in between (a call that loops over chunks of its own; see
    docs/estimate.rst). So at small batch sizes the optimizer step, which hardly
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

    def __init__(self, device: torch.device, runs: list[Run], resident: int, seconds: float) -> None:
        self.device = device
        self.sizes = tuple(run.batch_size for run in runs)
        self.resident = resident
        self.seconds = seconds
        self.notes = tuple(dict.fromkeys(note for run in runs for note in run.notes))
        self.measured = {run.batch_size: max(moment.total for moment in run.moments) for run in runs}
        self.started = {run.batch_size: run.moments[0].total for run in runs}
        self.fsdp: int | None = None
        self._segments = segments_of(runs)

    def _highest(self, batch_size: int) -> Line:
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
        return _parts_at(self._highest(batch_size), batch_size)

    def moments(self, batch_size: int) -> dict[str, dict[str, int]]:
        """Return the bytes held at the highest moment of each phase of the call, by what they are.

        Args:
            batch_size (int): the rows along ``dim``; at least 1.

        Returns:
            dict: per phase the call has (``"forward"``, ``"backward"``,
            ``"optimizer step"``), the :meth:`breakdown` of its highest moment at
            ``batch_size``; the highest of them is the peak's.

        .. versionadded:: 0.1.0
        """
        _check_batch_size(batch_size)
        highest: dict[str, Line] = {}
        for segment in self._segments:
            if segment.covers(batch_size):
                for line in segment.lines:
                    if line.phase not in highest or line.at(batch_size) > highest[line.phase].at(batch_size):
                        highest[line.phase] = line
        return {phase: _parts_at(line, batch_size) for phase, line in highest.items()}

    def module_peaks(self, batch_size: int) -> dict[str, tuple[int, int]]:
        """Return the peak bytes held while each module ran, forward and backward.

        Args:
            batch_size (int): the rows along ``dim``.

        Returns:
            dict: per module that ran, by name (its type, then the path
            of attribute names, as ``"Sequential.0"``), the most bytes alive
            while its forward ran and while its backward ran (0 if it had none);
            for a module that allocates nothing (``nn.Flatten``), the bytes
            alive as it ran.
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
            maximum (int, optional): no larger size is returned. Default: ``2**40``.

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
    number = as_int(value)  # numpy's ints too, as the options take them
    if number is None:
        raise TypeError(f"{name} must be an int >= 1, got {type_name(value)} {value!r}")
    if number < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return number


def _check_margin(margin: object) -> float:
    if isinstance(margin, bool) or not isinstance(margin, numbers.Real):  # numpy's floats too
        raise TypeError(f"margin must be a number, a fraction of the peak like 0.1, got {type_name(margin)} {margin!r}")
    fraction = float(margin)
    if not 0 <= fraction < 10:  # NaN too
        raise ValueError(f"margin must be a number in [0, 10), a fraction of the peak, got {margin!r}")
    return fraction


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
            call takes different paths through its code at those two, also 1 (or
            2, where the call fails at 1), a size at which the bytes that grow with
            the batch dwarf the rest, and twice that.
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
            rows, ``dim`` or ``sizes`` is out of range, or ``fsdp`` is below 1
            or differs from the mesh of modules sharded already.
        TypeError: if ``dim``, ``fsdp`` or a size is not an int (numpy's ints
            are taken).
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
    """Estimate the peak memory of ``fn`` on the arguments ``batch`` holds, as :func:`estimate` does."""
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

    def run(size: int) -> Run:
        return run_on_meta(fn, batch, owned, size, round_bytes, workspace, inexact, target, sharding)

    with exclusive():  # one estimate at a time: see lending.py
        runs = run_at_sizes(run, batch.rows, chosen)
        resident = owned.resident(target, round_bytes)
    found = MemoryEstimate(target, runs, resident, time.perf_counter() - started)
    found.fsdp = sharding.world if sharding is not None else None
    return found


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
        TypeError: if ``calibrate`` is not a bool, ``margin`` not a number or
            ``maximum`` not an int.
        NotImplementedError: for ``calibrate=True`` under FSDP2, and as for
            :func:`estimate`.

    .. versionadded:: 0.1.0
    """
    _check_margin(margin)
    if maximum is not None:
        _check_batch_size(maximum, "maximum")
    check_flag("calibrate", calibrate)
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
        described, *notes = found.describe(1).splitlines()
        message = (
            f"even a batch of 1 does not fit: {described}, plus a margin of {margin:.0%}, "
            f"and {format_bytes(available)} are available on {found.device}"
        )
        raise BatchSizeExhausted("\n".join([message, *notes]), batch_size=1, attempts=0)
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


def _parts_at(line: Line, batch_size: int) -> dict[str, int]:
    return {
        category: max(round(intercept + slope * batch_size), 0)
        for category, (slope, intercept) in zip(CATEGORIES, line.parts, strict=True)
    }


def warn_inexact(found: MemoryEstimate, what: str, warn: Callable[..., None] = warnings.warn) -> None:
    """Warn (through ``warn``) that ``what``, a sentence's start, was decided from an estimate with notes."""
    warn(
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
