"""``initial="auto"``: a call's first size from an estimate, corrected by its first measured run.

What it remembers (the estimates, what fits per level of free memory) lives in the
call's cache beside its sizes, and is forgotten with them; a ``NoCache`` keeps none.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterable
from typing import Any, cast

import torch
from cachetools import LRUCache
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from koila_retry._common import tracking
from koila_retry._common.forks import renewed_in_child
from koila_retry._common.places import levels_to_caller
from koila_retry._common.tensors import same_device
from koila_retry._common.warn import warn_or_log
from koila_retry._core.cache import NoCache, SizeCache
from koila_retry._core.decision import in_samples
from koila_retry._core.memory import PeakMeter, free_memory, peak_meter, recent_free_memory
from koila_retry._estimation.calibration import Calibration, Corrected, Credited, Fitting, gap_of, probe_size
from koila_retry._estimation.estimate import DEFAULT_MARGIN, MemoryEstimate, warn_inexact
from koila_retry._estimation.lending import borrowing
from koila_retry._estimation.recorder import value_shaped_note

__all__ = ["AUTO", "AutoFirst", "check_auto"]

AUTO = "auto"


def check_auto(initial: object) -> None:
    """Refuse a string ``initial`` other than ``"auto"``."""
    if isinstance(initial, str) and initial != AUTO:
        raise ValueError(f"initial must be an int >= 1, None or 'auto', got {initial!r}")


class _Estimates:
    """The estimates of one function on one input signature: its step whole, and split, and their correction."""

    __slots__ = ("calibration", "memo", "sample_bytes", "split", "split_made", "whole")

    def __init__(self, memo: _Memo, whole: MemoryEstimate | None, sample_bytes: int = 0) -> None:
        self.memo = memo
        self.whole = whole  # None: it could not be made (and a warning said why)
        # The bytes of one input sample the estimates were made on: the memo's key names a
        # class of sample shapes, and a call with larger samples of the class scales down.
        self.sample_bytes = sample_bytes
        # A split step's later micro-batches hold every gradient plus their own: another
        # estimate, made only when the whole batch does not fit.
        self.split: MemoryEstimate | None = None
        self.split_made = False
        self.calibration: Calibration | None = None  # what a measured run said of the estimates

    def split_of(self, make: Callable[[], MemoryEstimate] | None, name: str) -> MemoryEstimate:
        """Return the estimate of a split step, made the first time; the whole step's if it has none."""
        if not self.split_made:
            if make is not None:
                self.split = self.memo.made(make, name, "the memory of a split step", "sizes micro-batches by one")
            self.split_made = True
        return self.split or cast(MemoryEstimate, self.whole)

    def fitting(self, found: MemoryEstimate) -> MemoryEstimate | Corrected:
        """Return ``found`` as sizes are decided from it: corrected, once a run was measured."""
        return found if self.calibration is None else Corrected(found, self.calibration)


class _Fit:
    """What fits at one level of free memory, with the margin and without: the most rows whole, the largest split."""

    __slots__ = ("_split", "bare", "budget", "calibration", "estimates", "inputs", "whole")

    def __init__(self, estimates: _Estimates, budget: int, inputs: int = 0) -> None:
        whole = cast(MemoryEstimate, estimates.whole)
        found = Credited(estimates.fitting(whole), whole, inputs)
        self.estimates, self.budget, self.calibration = estimates, budget, estimates.calibration
        self.inputs = inputs
        self.whole = _most_rows(found, budget, DEFAULT_MARGIN)
        self.bare = _most_rows(found, budget, 0.0)  # when nothing fits with the margin, still the best start
        self._split: tuple[int, int] | None = None

    def split(self, make: Callable[[], MemoryEstimate] | None, name: str) -> tuple[int, int]:
        """Return the largest power of two a split step fits at, with the margin and without (0: none)."""
        if self._split is None:
            split = self.estimates.split_of(make, name)
            found = Credited(self.estimates.fitting(split), split, self.inputs)
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
    """What ``initial="auto"`` remembers beside one cache's sizes: estimates, and what fits per level of memory."""

    def __init__(self, keep: bool) -> None:
        self.keep = keep
        self.lock = threading.Lock()
        self.estimates: LRUCache[Hashable, _Estimates] = LRUCache(maxsize=64)
        # Per power-of-two level of free memory (as StackMemoryCache keys): given more later, a call starts larger.
        self.fits: LRUCache[Hashable, _Fit] = LRUCache(maxsize=256)
        self.warned: set[Hashable] = set()  # what was warned about once: (function, why)
        self.making: dict[Hashable, threading.Event] = {}  # estimates being made, set when they are
        renewed_in_child(self, _Memo.renewed)

    def renewed(self) -> None:
        """In a forked child: the lock anew, and no estimate being made by a thread the child has not."""
        self.lock, self.making = threading.Lock(), {}

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled with its cache (a wrapper's, in a checkpoint): made anew, its estimates made again when asked.
        return _Memo, (self.keep,)

    def estimates_of(
        self, key: Hashable, make: Callable[[], MemoryEstimate], name: str, sample_bytes: int = 0
    ) -> _Estimates:
        """Return the estimates of ``key``, made by the first thread to ask while the others wait."""
        # One try from the start: an interrupt (Ctrl-C) right after the event is registered, as the lock is
        # let go, left it never set, and every later call of the key waited on it for ever (probe 75E).
        making: threading.Event | None = None
        try:
            while True:
                with self.lock:
                    found = self.estimates.get(key)
                    if found is not None:
                        return found
                    other = self.making.get(key)
                    if other is None:
                        making = threading.Event()
                        if self.keep:
                            self.making[key] = making
                        break
                other.wait()
            whole = self.made(
                make, name, "the memory", "starts from the whole batch and halves on out-of-memory errors"
            )
            found = _Estimates(self, whole, sample_bytes)
            if self.keep:
                with self.lock:
                    self.estimates[key] = found
        finally:
            if making is not None:
                try:
                    with self.lock:
                        if self.making.get(key) is making:
                            del self.making[key]
                finally:  # set whatever happens: a Ctrl-C in the block above left the waiters waiting (75H)
                    making.set()
        return found

    def fit(
        self, key: Hashable, device: torch.device, estimates: _Estimates, budget: int | None = None, inputs: int = 0
    ) -> _Fit:
        """Return what fits at the device's level of free memory now (in ``budget`` bytes, if given)."""
        level = (key, recent_free_memory(device).bit_length(), inputs.bit_length())
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
            # The estimate's peak counts the parameters, gradients and optimizer state, already on the device
            # and not in its free memory; and the inputs, credited at each size (Credited).
            budget = free_memory(device) + cast(MemoryEstimate, estimates.whole).resident
        fit = _Fit(estimates, budget, inputs)
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
            # PyTorch's message of an operator whose shape depends on values is about its compiler: the note says more.
            reason = value_shaped_note(error) or (str(error).splitlines()[0] if str(error) else "")
            failure = f"{type(error).__name__}: {reason}"
        if self.first_time((name, what, failure)):  # outside the handler, so that the error is gone
            warn_or_log(
                f"initial='auto' could not estimate {what} of {name} ({failure}); it {then}",
                UserWarning,
                stacklevel=levels_to_caller(),
            )
        return None


def _bytes_on(device: torch.device, tensors: Iterable[torch.Tensor]) -> int:
    """Return the bytes ``tensors`` on ``device`` cover, each storage's at most once, that its free memory counts."""
    # What the views cover, not their storages: a batch sliced from a dataset on the device holds the
    # dataset's storage, which the estimate, of the batch alone, does not count.
    covered: dict[int, list[int]] = {}  # by storage: its bytes, and those its tensors cover
    for tensor in tensors:
        if (
            tensor.layout == torch.strided
            and not is_traceable_wrapper_subclass(tensor)  # a DTensor's storage is its rank's shard, or none
            and same_device(tensor.device, device)
        ):
            storage = tensor.untyped_storage()
            entry = covered.setdefault(storage.data_ptr(), [storage.nbytes(), 0])
            entry[1] += tensor.numel() * tensor.element_size()
    simulated = tracking.simulated.device()
    if simulated is not None and covered:  # it counts what was made inside it, alone
        made = {storage.data_ptr() for storage in simulated.live_storages()}
        covered = {pointer: entry for pointer, entry in covered.items() if pointer in made}
    return sum(min(nbytes, tensors_bytes) for nbytes, tensors_bytes in covered.values())


def _memo_of(cache: SizeCache) -> _Memo:
    memo = cache.derived.get(AUTO)
    if memo is None:
        memo = cache.derived.setdefault(AUTO, _Memo(keep=not isinstance(cache, NoCache)))
    return cast(_Memo, memo)


class AutoFirst:
    """The first size of an ``initial="auto"`` call, asked by the engine on a cache miss, and its correction."""

    __slots__ = (
        "_budget",
        "_cache",
        "_device",
        "_estimates",
        "_figures",
        "_fit",
        "_held",
        "_inputs",
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
        inputs: Iterable[torch.Tensor] = (),
    ) -> None:
        self._key, self._rows, self._make, self._device, self._name = key, rows, make, device, name
        # split: makes the estimate of a split step (None: estimated as a whole one). step: a training
        # step (accumulate). sample_bytes: one input sample's bytes; key names a class of sample shapes
        # (rows padded to 37 tokens and to 50 share it), and sizes for larger samples are scaled down.
        self._cache, self._split, self._step, self._sample_bytes = cache, split, step, sample_bytes
        self._inputs = _bytes_on(device, inputs)  # the call's inputs: on the device already, sliced as views
        self._measured = 0  # runs of this call measured so far
        self._figures: tuple[int, int] | None = None
        self._estimates: _Estimates | None = None
        self._fit: _Fit | None = None
        self._budget: int | None = None  # the free bytes the call began with
        self._held = 0  # bytes the call made after its measured run, and holds for the rest (see hold)
        self.meter: PeakMeter | None = None  # measures the first run, when it is to be measured

    def __call__(self, measure: bool = True) -> int:
        """Return the first size; a probe to measure if ``measure`` and nothing was measured yet."""
        if borrowing():
            # Run by koila.estimate, on meta tensors: the whole batch, as initial=None, in every run of
            # it. An estimate of its own here would be counted as the call's memory in the first run
            # alone (the memo has it in the next), and would wait for one another thread is making.
            return self._rows
        # The engine does not measure when ranks agree: each rank would measure its own.
        memo, rows, name = _memo_of(self._cache), self._rows, self._name
        estimates = self._estimates = memo.estimates_of(self._key, self._make, name, self._sample_bytes)
        whole = estimates.whole
        if whole is None:
            return rows
        if whole.notes and memo.first_time((name, whole.notes)):
            # Once per estimate, which is kept: a filter that makes it an error would fail this call and not the next.
            warn_inexact(whole, f"initial='auto' chose the first size of {name}", warn_or_log)
        fit = self._fit = memo.fit(self._key, self._device, estimates, inputs=self._inputs)
        self._budget = fit.budget
        first = self._decide(fit)
        if measure and estimates.calibration is None:
            # Where the device keeps a peak the estimate is a prior: a probe's real run is measured,
            # and corrected() makes that the size for the rest of the call and, through the memo,
            # for later calls. A whole step is measured as it is: split for a probe, it would hold
            # more (every gradient, and the next micro-batch's) than whole.
            self.meter = peak_meter(self._device)
            if self.meter is not None and not (self._step and first >= rows):
                return probe_size(whole, fit.budget, first, DEFAULT_MARGIN, self._inputs)
        return first

    def after_oom(self, size: int) -> int:
        """Return the size to measure next, after the run to be measured ran out of memory at ``size``."""
        # The estimate is under the truth by more than its margin: a probe below size that fits
        # even if it were 8 times under.
        estimates, fit = self._estimates, self._fit
        below = max(size // 2, 1)
        if estimates is None or fit is None or estimates.whole is None or estimates.calibration is not None:
            return below
        return probe_size(estimates.whole, fit.budget, below, DEFAULT_MARGIN, self._inputs)

    def _scaled(self, size: int, estimates: _Estimates) -> int:
        """Return ``size`` rows of the samples the estimates were made on, as rows of this call's samples."""
        return in_samples(size, estimates.sample_bytes, self._sample_bytes)

    def _decide(self, fit: _Fit) -> int:
        # The whole batch if it fits with the margin; else the largest split step that does; else
        # the whole batch without the margin; else the largest split without it; else 1.
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
        """Correct the estimates by a run of ``rows`` whose peak rose by ``rise``; return the size for what follows."""
        estimates, fit = self._estimates, self._fit
        if estimates is None or fit is None or estimates.whole is None:
            return self._rows
        found = estimates.whole
        if self._step and self._measured:  # the rest of a step split after a probe
            found = estimates.split_of(self._split, self._name)
        self._measured += 1
        known = estimates.calibration or Calibration(())
        estimates.calibration = known.adding(rows, gap_of(found, rows, rise))
        # At the budget the call began with: what the call holds by now is in the estimates, but for
        # what it made after the run (chunked's result), which the runs that follow must leave room for.
        budget = (fit.budget if self._budget is None else self._budget) - self._held
        fit = self._fit = _memo_of(self._cache).fit(self._key, self._device, estimates, budget, self._inputs)
        return self._decide(fit)

    def hold(self, nbytes: int) -> None:
        """Count ``nbytes`` the call made after its measured run and holds while the rest runs."""
        self._held += nbytes

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
