"""Memory snapshots (``snapshot=``): the allocator's history, recorded at each out-of-memory error."""

from __future__ import annotations

from koila_retry._core.outcomes import Failure
from koila_retry._core.snapshot import Snapshots, Target
from koila_retry._core.strategy import Course, Strategy

__all__ = ["Snapshotting"]


class Snapshotting(Strategy):
    """Record a snapshot inside the handler of each out-of-memory error, while the attempt's memory is held."""

    def __init__(self, target: Target, each_oom: bool) -> None:
        self.target, self.each_oom = target, each_oom

    def out_of_memory(self, course: Course, failure: Failure, final: bool) -> None:
        if failure.snapshots is None:
            failure.snapshots = Snapshots(self.target, self.each_oom, course.call.device, course.owner.name)
        failure.snapshots.failed(course.state.number, final)
