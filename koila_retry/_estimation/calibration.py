"""An estimate corrected by what a real run on the device allocated.

The meta estimate counts the storages the dispatcher sees. On a device, opaque kernels
allocate more (cuDNN's workspaces and reserves, cuBLAS's, the buffers of a reduction) or
fused ones less, and no rule written beside the estimate can follow every library
version and card. So where the device keeps a peak (CUDA's allocator, a simulated
device), ``initial="auto"`` and ``suggest_batch_size(calibrate=True)`` treat the estimate
as a prior: a real run of some rows is measured, and its rise (the allocator's peak less
what was allocated as it began) is set against the estimate's own bytes at those rows
(its peak less what was alive as the call started). What the call started with
(parameters, gradients, optimizer state, inputs) is not corrected: it is what it is.

The gap between the two, measured at one size, does not say how it grows with the rows.
Two readings are taken, and at each size the one that asks more memory is used: the
gap grows in proportion to the rows (as most kernels' workspaces do), or it stays as it
was (a buffer made once, or an over-count of the gradients). A second run at another
size, the first real step or chunk at the corrected size, settles it: through the two
gaps goes a line, as the estimate's own moments are lines.

Before anything is measured the estimate is not trusted far: the first real run is a
probe, the largest power of two at which the estimate's own bytes, :data:`DISTRUST`
times over, still fit; an estimate that far under the truth still runs its probe
without running out of memory.
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
    "Fitting",
    "gap_of",
    "largest_power",
    "own_bytes",
    "probe_size",
    "starting",
]

#: How many times its own bytes the truth may be, for the probe before the first measurement.
DISTRUST = 8.0


class Estimated(Protocol):
    """What a correction reads of an estimate: :class:`~koila_retry.MemoryEstimate`'s peak and starts."""

    @property
    def started(self) -> dict[int, int]: ...

    def peak(self, batch_size: int) -> int: ...


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
    """What measured runs said of an estimate: the gap between each run's rise and the estimate's own bytes.

    Attributes:
        points (tuple): ``(rows, gap)`` of at most two runs of different rows, the
            gap in bytes (below 0 where the estimate was over), the larger rows last.
    """

    points: tuple[tuple[int, float], ...]

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
    """Return a run's rise less the estimate's own bytes at its rows.

    Args:
        found (MemoryEstimate): the estimate of the work that ran.
        rows (int): the rows it ran, at least 1.
        rise (int): its peak on the device less what was allocated as it began.

    Returns:
        float: the gap in bytes; below 0 where the estimate was over.
    """
    return rise - own_bytes(found, rows)


class Corrected:
    """An estimate corrected by a :class:`Calibration`: its peak, fits and largest fit as the estimate's.

    Args:
        found (MemoryEstimate): the estimate.
        calibration (Calibration): what measured runs said of it (or of an estimate
            of the same work, such as a whole step for a split one).
        times (float): a factor on the estimate's own bytes instead, for a probe
            that distrusts the estimate (1.0 with a calibration).
    """

    def __init__(self, found: Estimated, calibration: Calibration | None = None, times: float = 1.0) -> None:
        self.found, self.calibration, self.times = found, calibration, times

    def peak(self, batch_size: int) -> int:
        """Return the corrected peak bytes at ``batch_size``; never below what the call starts with."""
        own = self.times * own_bytes(self.found, batch_size)
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


def probe_size(found: Estimated, budget: int, first: int, margin: float) -> int:
    """Return the rows to measure first: ``first`` if it fits distrusted, else the largest power of two that does.

    Args:
        found (MemoryEstimate): the estimate of one step or chunk.
        budget (int): the bytes the call may use, everything counted.
        first (int): the size the estimate itself chose.
        margin (float): the share of the peak kept free.

    Returns:
        int: at least 1, at most ``first``.
    """
    distrusted = Corrected(found, times=DISTRUST)
    if distrusted.fits(first, budget, margin=margin):
        return first
    size = distrusted.largest_fitting(budget, margin=margin, maximum=first)
    return 1 if size is None else size
