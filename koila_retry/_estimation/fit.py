"""The model an estimate fits to its runs: the bytes alive against the batch size.

Where two runs take the same path through the call, every moment's bytes are exactly
a line through them, so the peak is the upper envelope of lines: convex in the batch.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Iterable
from typing import NamedTuple

__all__ = ["CATEGORIES", "Line", "Moment", "Run", "Segment", "segments_of"]

CATEGORIES = ("parameters", "gradients", "optimizer state", "inputs", "activations", "temporaries")


class Moment(NamedTuple):
    """One moment of a run: the bytes alive, where the call was, and what they were."""

    total: int  # bytes alive (as the device's allocator rounds them), with operators' workspaces
    raw: int  # the same before rounding: these grow exactly linearly with the batch
    phase: str
    modules: frozenset[str]
    parts: tuple[int, ...]  # bytes by category, in the order of CATEGORIES
    raw_parts: tuple[int, ...]


class Run(NamedTuple):
    """Every moment of one run, at one batch size, and what it could not model exactly."""

    batch_size: int
    moments: list[Moment]
    notes: tuple[str, ...] = ()

    def phase_peaks(self) -> dict[str, Moment]:
        peaks: dict[str, Moment] = {}
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

    def aligned(self, other: Run) -> bool:
        """Return whether both runs went through the same moments, in the same places."""
        if len(self.moments) != len(other.moments):
            return False
        return all(
            mine.phase == theirs.phase and mine.modules == theirs.modules
            for mine, theirs in zip(self.moments, other.moments, strict=True)
        )


class Line(NamedTuple):
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


def _joining(small: int, large: int, first: Moment, second: Moment) -> Line:
    """Return the line of one moment's bytes through two runs."""
    # The slope of the unrounded bytes, which grow exactly linearly, through the rounded bytes
    # at the larger size: rounded bytes alone can hide growth (8 and 16 rows of a small layer
    # are one 512-byte block each).
    slope, intercept = _through(small, large, first.raw, second.raw)
    slope, intercept = _through(small, large, first.total, second.total, slope=slope)
    parts = tuple(
        _through(small, large, 0, rounded, slope=_through(small, large, low, high)[0])
        for low, high, rounded in zip(first.raw_parts, second.raw_parts, second.parts, strict=True)
    )
    return Line(slope, intercept, first.phase, parts)


def _envelope(lines: Iterable[Line], low: float) -> list[Line]:
    """Return the lines that are the highest somewhere from batch size ``low`` up, by slope."""
    steepest: dict[float, Line] = {}
    for line in lines:
        kept = steepest.get(line.slope)
        if kept is None or line.intercept > kept.intercept:
            steepest[line.slope] = line
    hull: list[Line] = []
    for line in sorted(steepest.values()):
        # The last line is never above both neighbours once the new one crosses the one before it first.
        while len(hull) >= 2:
            first, last = hull[-2], hull[-1]
            crossing = (line.intercept - first.intercept) * (last.slope - first.slope)
            if crossing < (last.intercept - first.intercept) * (line.slope - first.slope):
                break
            hull.pop()
        hull.append(line)
    while len(hull) >= 2 and hull[1].at(low) >= hull[0].at(low):
        hull.pop(0)
    return hull


class Segment(NamedTuple):
    """The lines that hold between two batch sizes run at (from 1 for the first, with no end for the last)."""

    low: float
    high: float
    lines: list[Line]
    modules: dict[tuple[str, str], list[Line]]

    def covers(self, batch_size: int) -> bool:
        return self.low <= batch_size <= self.high


def segments_of(runs: list[Run]) -> list[Segment]:
    """Return, between each two sizes run at, the lines whose highest is the peak."""
    segments = []
    for index, (small, large) in enumerate(itertools.pairwise(runs)):
        a, b = small.batch_size, large.batch_size
        low, high = small.phase_peaks(), large.phase_peaks()
        # Between runs that took different paths, each phase's peak is the line joining them:
        # exact at both, and below a peak that is concave between them (docs/estimate.rst).
        lines = [_joining(a, b, low[phase], high[phase]) for phase in low if phase in high]
        modules: dict[tuple[str, str], list[Line]] = defaultdict(list)
        low_modules, high_modules = small.module_peaks(), large.module_peaks()
        for key, value in low_modules.items():
            if key in high_modules:
                modules[key].append(Line(*_through(a, b, value, high_modules[key]), key[1], ()))
        if small.aligned(large):  # each moment's line is exact at every size taking this path
            for first, second in zip(small.moments, large.moments, strict=True):
                line = _joining(a, b, first, second)
                lines.append(line)
                direction = "backward" if first.phase == "backward" else "forward"
                for name in first.modules:
                    modules[(name, direction)].append(line)
        start = 1.0 if index == 0 else float(a)
        end = math.inf if index == len(runs) - 2 else float(b)
        enveloped = {key: _envelope(found, start) for key, found in sorted(modules.items())}
        segments.append(Segment(start, end, _envelope(lines, start), enveloped))
    return segments
