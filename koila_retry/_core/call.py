"""One call of a wrapper, as a front end describes it to the engine."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from types import FrameType
from typing import Any, Protocol

import torch

from koila_retry._core.memory import PeakMeter

__all__ = ["Call", "FirstSize"]


class FirstSize(Protocol):
    """The first size of a call the cache knows nothing of, from an estimate (``initial="auto"``)."""

    meter: PeakMeter | None  # after the call: what measures the first run, when it is a probe that corrects

    def __call__(self, measure: bool) -> int:
        """Return the first size; a probe to measure only if ``measure``."""

    def figures(self) -> tuple[int, int] | None:
        """Return the estimate's per-sample and fixed bytes, if one was made."""

    def corrected(self, rows: int, rise: int) -> int:
        """Correct the estimate by a run of ``rows`` that rose by ``rise`` bytes; return the size for what follows."""

    def after_oom(self, size: int) -> int:
        """Return the size to measure next, after the run to be measured ran out of memory at ``size``."""


@dataclass(frozen=True, slots=True)
class Call:
    """What one call is: what its key names, where it runs, and what it is given."""

    function: object  # what the cache key names: a function or a description of one
    caller: FrameType | None
    device: torch.device
    sample: Hashable = None  # the shape class of one input sample, for the key
    rows: int = 0  # the call's first size when the policy has no initial
    # Asked for the first size when the cache knows none. For a probe to measure, the front end
    # measures the first run that succeeds (Attempt.meter) and hands it back (Attempt.calibrate).
    first: FirstSize | None = None
    span: int | None = None  # the rows a run of steps covers; ranks that agree must have the same
    roots: Iterable[Any] = ()  # what the call reaches, looked at when ranks agree or an attempt fails
    per_sample: int = 0  # the bytes of one sample, when sample names a class of sizes rather than one
