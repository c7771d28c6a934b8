"""Sharded models (FSDP2) under agreement: a rank that fails plays along the others' collectives (see sharded.py)."""

from __future__ import annotations

from koila_retry._core.decision import Done
from koila_retry._core.sharded import Shards
from koila_retry._core.strategy import FAILED, Course, Strategy

__all__ = ["Sharding"]


class Sharding(Strategy):
    """Arm the call's FSDP2 modules while an attempt runs, play along after a failure here, reset them after any."""

    def __init__(self, shards: Shards) -> None:
        self.shards = shards

    def begin(self, course: Course) -> None:
        self.shards.arm()

    def end(self, course: Course) -> None:
        self.shards.disarm()

    def stored(self, course: Course, done: Done) -> None:
        self.shards.succeeded()  # every rank got through the attempt's last micro-batch

    def exchanging(self, course: Course) -> None:
        if course.phase == FAILED:
            self.shards.play_along()

    def releasing(self, course: Course) -> None:
        self.shards.reset()  # FSDP2's state holds the attempt's buffers
