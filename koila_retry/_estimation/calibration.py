"""An estimate corrected by what a real run on the device allocated.

Opaque kernels (cuDNN's and cuBLAS's workspaces, a reduction's buffers) allocate what no
dispatch mode sees. Where the device keeps a peak, a real run's rise is set against the
estimate's own bytes (its peak less what the call started with, which is not corrected);
one gap is read both as fixed and as growing with the rows, whichever asks more, until a
second run at other rows draws a line. Before any run, the first is a probe that fits even
if the truth were :data:`DISTRUST` times the estimate's activations and temporaries.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple, Protocol

__all__ = [
    "DISTRUST",
    "LARGEST",
    "Calibration",
    "Corrected",
    "Credited",
    "Fitting",
    "gap_of",
    "largest_power",
    "own_bytes",
    "probe_size",
    "starting",
]

#: How many times its activations and temporaries the truth may be, for the probe before the first measurement.
DISTRUST = 8.0


class Estimated(Protocol):
    """What a correction reads of an estimate: :class:`~koila_retry.MemoryEstimate`'s peak and starts."""

    @property
    def started(self) -> dict[int, int]: ...

    def peak(self, batch_size: int) -> int: ...

    def breakdown(self, batch_size: int) -> dict[str, int]: ...

    def moments(self, batch_size: int) -> dict[str, dict[str, int]]: ...


class Fitting(Protocol):
    """What decides a size: :class:`~koila_retry.MemoryEstimate`'s fit, or a :class:`Corrected` one's."""

    def fits(self, batch_size: int, budget: int, *, margin: float = ...) -> bool: ...

    def largest_fitting(self, budget: int, *, margin: float = ..., maximum: int | None = ...) -> int | None: ...


#: Nothing larger is ever suggested: past this the estimate says more about the fit than the model.
LARGEST = 1 << 40


def largest_power(fits: Callable[[int], bool], ceiling: int) -> int | None:
    """Return the largest power of two up to ``ceiling`` that ``fits``, counting up from 1; ``None`` if 1 does not."""
    size, best = 1, None
    while size <= ceiling and fits(size):
        best, size = size, size * 2
    return best


def starting(found: Estimated, batch_size: int) -> float:
    """Return the bytes alive as the call starts at ``batch_size``: exactly a line (inputs grow with the rows)."""
    sizes = sorted(found.started)
    low, high = sizes[0], sizes[-1]
    slope = (found.started[high] - found.started[low]) / (high - low) if high != low else 0.0
    return found.started[low] + slope * (batch_size - low)


def own_bytes(found: Estimated, batch_size: int) -> float:
    """Return the estimate's own bytes at ``batch_size``: its peak less what the call started with."""
    return max(found.peak(batch_size) - starting(found, batch_size), 0.0)


class Calibration(NamedTuple):
    """What measured runs said of an estimate: the gap between each run's rise and the estimate's own bytes."""

    points: tuple[tuple[int, float], ...]  # (rows, gap) of at most two runs, larger rows last; gap < 0: over

    def gap(self, batch_size: int) -> float:
        """Return the bytes the estimate's own bytes are to be corrected by at ``batch_size``."""
        if len(self.points) == 1:
            (rows, gap) = self.points[0]
            return max(gap, gap * batch_size / rows)  # whichever asks more: fixed, or growing with the rows
        (low, low_gap), (high, high_gap) = self.points
        return low_gap + (high_gap - low_gap) * (batch_size - low) / (high - low)

    def adding(self, rows: int, gap: float) -> Calibration:
        """Return the calibration with the run of ``rows`` whose gap was ``gap``: the two largest distinct rows kept."""
        points = dict(self.points)
        points[rows] = gap
        return Calibration(tuple(sorted(points.items()))[-2:])


def gap_of(found: Estimated, rows: int, rise: int) -> float:
    """Return a run's ``rise`` (its peak less what was allocated as it began) less the estimate's own bytes."""
    return rise - own_bytes(found, rows)


class Corrected:
    """An estimate corrected by a :class:`Calibration`, or its own bytes taken ``times`` over for a probe."""

    def __init__(self, found: Estimated, calibration: Calibration | None = None, times: float = 1.0) -> None:
        self.found, self.calibration, self.times = found, calibration, times

    def peak(self, batch_size: int) -> int:
        """Return the corrected peak bytes at ``batch_size``; never below what the call starts with."""
        own = own_bytes(self.found, batch_size)
        if self.times != 1.0:
            # What a kernel may allocate unseen (workspaces, a fused kernel's buffers) is activations and
            # temporaries. Gradients and optimizer state are the parameters' sizes, exactly: distrusted too,
            # a model whose gradients take an eighth of the free memory was probed at one row.
            # At each phase's highest moment: the peak's may be the optimizer step's, and a backward's unseen
            # workspace the one that runs out. An optimizer step's temporaries (foreach buffers) are the
            # parameters' sizes too: taken 8 times over, Adam's alone left a probe of one row.
            peak = self.found.peak(batch_size)
            distrusted = max(
                sum(parts.values())
                + (self.times - 1.0)
                * (parts["activations"] + (0 if phase == "optimizer step" else parts["temporaries"]))
                for phase, parts in self.found.moments(batch_size).items()
            )
            own += max(distrusted - peak, 0.0)
        if self.calibration is not None:
            own = max(own + self.calibration.gap(batch_size), 0.0)
        return math.ceil(starting(self.found, batch_size) + own)

    def fits(self, batch_size: int, budget: int, *, margin: float = 0.1) -> bool:
        """Return whether the corrected peak, plus ``margin``, fits in ``budget`` bytes."""
        return self.peak(batch_size) * (1 + margin) <= budget

    def largest_fitting(self, budget: int, *, margin: float = 0.1, maximum: int | None = None) -> int | None:
        """Return the largest power of two whose corrected peak, plus ``margin``, fits (``None`` if 1 does not)."""
        ceiling = LARGEST if maximum is None else maximum
        return largest_power(lambda size: self.fits(size, budget, margin=margin), ceiling)


class Credited:
    """A fit less the estimate's inputs at each size, where the call's inputs (``inputs`` bytes) lie on the device."""

    # The peak counts each size's inputs as made for it; a call's micro-batches and chunks are views of
    # inputs that hold their memory already, which the free memory lacks: counted twice, a step that fitted
    # was split. Credited at each size, not the whole batch's at every size, which over-credits a split.
    def __init__(self, found: Estimated | Corrected, estimate: Estimated, inputs: int) -> None:
        self.found, self.estimate, self.inputs = found, estimate, inputs

    def fits(self, batch_size: int, budget: int, *, margin: float = 0.1) -> bool:
        """Return whether the peak less the inputs on the device, plus ``margin``, fits in ``budget`` bytes."""
        peak = self.found.peak(batch_size)
        if self.inputs:
            peak -= min(self.inputs, self.estimate.breakdown(batch_size)["inputs"])
        return peak * (1 + margin) <= budget

    def largest_fitting(self, budget: int, *, margin: float = 0.1, maximum: int | None = None) -> int | None:
        """Return the largest power of two that fits (``None`` if 1 does not)."""
        ceiling = LARGEST if maximum is None else maximum
        return largest_power(lambda size: self.fits(size, budget, margin=margin), ceiling)


def probe_size(found: Estimated, budget: int, first: int, margin: float, inputs: int = 0) -> int:
    """Return the rows to measure first: ``first`` if it fits distrusted, else the largest power of two that does."""
    distrusted = Credited(Corrected(found, times=DISTRUST), found, inputs)
    if distrusted.fits(first, budget, margin=margin):
        return first
    size = distrusted.largest_fitting(budget, margin=margin, maximum=first)
    return 1 if size is None else size
