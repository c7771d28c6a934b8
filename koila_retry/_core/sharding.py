"""Sharded models (FSDP2) under agreement: their collectives learn of another rank's failure inside an attempt."""

from __future__ import annotations

from koila_retry._core.sharded import Shards
from koila_retry._core.strategy import Course, Strategy

__all__ = ["Sharding"]


class Sharding(Strategy):
    """Arm the call's FSDP2 modules while an attempt runs, and reset their state before a failure is released."""

    def __init__(self, shards: Shards) -> None:
        self.shards = shards

    def begin(self, course: Course) -> None:
        self.shards.arm()

    def end(self, course: Course) -> None:
        self.shards.disarm()

    def releasing(self, course: Course) -> None:
        self.shards.reset()  # FSDP2's state holds the attempt's buffers
