"""What a strategy is: the hooks a call's attempts run at each event, each a no-op unless a strategy overrides it.

Each feature that changes what happens next is one :class:`Strategy` in a module of its
own, composed into a :class:`Plan` by :func:`koila_retry._core.strategies.compose`; the
driver (``Mechanics``) only runs the plan's hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from koila_retry._core.cache import SizeCache
from koila_retry._core.call import Call
from koila_retry._core.decision import Done, Rules, State, Step
from koila_retry._core.outcomes import Explain, Failure
from koila_retry._core.policy import Policy
from koila_retry._core.stats import OOMEvent, Stats

if TYPE_CHECKING:
    from koila_retry._core.distributed import Agreement

__all__ = [
    "ALONE",
    "FAILED",
    "HOOKS",
    "PENDING",
    "READY",
    "RUNNING",
    "SUCCEEDED",
    "Alone",
    "Course",
    "Owner",
    "Plan",
    "Strategy",
]

# Where a call's current attempt is. PENDING: its body succeeded here, and the ranks have yet
# to agree that it did everywhere.
READY, RUNNING, SUCCEEDED, FAILED, PENDING = range(5)


class Owner(Protocol):
    """What the attempts of a call need of the wrapper they belong to (a ``Controller``)."""

    name: str
    rules: Rules
    policy: Policy
    cache: SizeCache
    stats: Stats
    explain: Explain


class Course(Protocol):
    """What a strategy sees of a call's attempts (:class:`~koila_retry._core.attempt.Mechanics`)."""

    owner: Owner
    call: Call
    state: State
    key: Hashable | None
    phase: int
    clocked: float
    failure: Failure | None
    plan: Plan

    def resize(self, size: int) -> None: ...

    def succeed(self) -> None: ...

    def fail(self, place: str) -> Failure: ...


class Strategy:
    """A feature of the decision; each hook runs at one event of a call, in the plan's order."""

    def start(self, course: Course, first: bool) -> None:
        """At the start of a call (``first``) or of a step of a run of steps: may move to another size."""

    def begin(self, course: Course) -> None:
        """As an attempt's body begins."""

    def end(self, course: Course) -> None:
        """As it ends, whatever it raised."""

    def judge(self, course: Course, done: Done) -> Done:
        """After a success, before it is stored: return the decision, with this strategy's facts."""
        return done

    def stored(self, course: Course, done: Done) -> None:
        """After a success was stored."""

    def out_of_memory(self, course: Course, failure: Failure, final: bool) -> None:
        """Inside the handler of an out-of-memory error here (plain values only); ``final``: it may end the call."""

    def exchanging(self, course: Course) -> None:
        """Before the exchange that settles an attempt across ranks, outside the handler."""

    def releasing(self, course: Course) -> None:
        """Outside the handler, before the failed attempt's memory is released."""

    def failed(self, course: Course, event: OOMEvent, step: Step) -> None:
        """After a failure was released and reported (``event``); ``step`` is what follows it."""

    def calibrated(self, course: Course) -> None:
        """After a measured run moved the call to the size its corrected estimate chooses."""


#: The events of :class:`Strategy`, in the order a call meets them.
HOOKS = (
    "start",
    "begin",
    "end",
    "judge",
    "stored",
    "out_of_memory",
    "exchanging",
    "releasing",
    "failed",
    "calibrated",
)


class Alone:
    """How an attempt of a call that agrees with no other rank is settled: by itself."""

    waits = False  # a success or a failure is final here, with no exchange to wait for
    unanimous = True  # after an exchange, whether every rank's vote was yes
    rank: int | None = None
    world_size: int | None = None
    agreement: Agreement | None = None  # the exchanges of the ranks it agrees with

    def succeeded(self, course: Course) -> None:
        """Carry out a success at once."""
        course.succeed()

    def settle(self, course: Course, vote: bool) -> bool:
        """Return whether a failed attempt succeeded: never, here."""
        return False


ALONE = Alone()


class Plan:
    """A wrapper's strategies, as the hooks of each event that they override, and how attempts settle."""

    __slots__ = (*HOOKS, "settling", "short", "strategies")

    start: tuple[Callable[[Course, bool], None], ...]
    begin: tuple[Callable[[Course], None], ...]
    end: tuple[Callable[[Course], None], ...]
    judge: tuple[Callable[[Course, Done], Done], ...]
    stored: tuple[Callable[[Course, Done], None], ...]
    out_of_memory: tuple[Callable[[Course, Failure, bool], None], ...]
    exchanging: tuple[Callable[[Course], None], ...]
    releasing: tuple[Callable[[Course], None], ...]
    failed: tuple[Callable[[Course, OOMEvent, Step], None], ...]
    calibrated: tuple[Callable[[Course], None], ...]

    def __init__(self, strategies: Sequence[Strategy], settling: Alone = ALONE) -> None:
        self.strategies = tuple(strategies)
        self.settling = settling
        for hook in HOOKS:
            default = getattr(Strategy, hook)
            found: tuple[Callable[..., Any], ...] = tuple(
                getattr(each, hook) for each in self.strategies if getattr(type(each), hook) is not default
            )
            setattr(self, hook, found)
        # A call's first attempt may run before its attempts are made when nothing acts before a failure.
        self.short = settling is ALONE and not any(getattr(self, hook) for hook in HOOKS[:5])
