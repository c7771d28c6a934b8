"""The ``on_oom`` hook: a user's callable, told of each out-of-memory failure after its memory was released."""

from __future__ import annotations

from koila_retry._core.decision import Step
from koila_retry._core.stats import OnOOM, OOMEvent
from koila_retry._core.strategy import Course, Strategy

__all__ = ["Notifying"]


class Notifying(Strategy):
    """Tell ``on_oom`` of each failure, after the strategies before it followed it."""

    def __init__(self, on_oom: OnOOM) -> None:
        self.on_oom = on_oom

    def failed(self, course: Course, event: OOMEvent, step: Step) -> None:
        self.on_oom(event)
