"""The strategies a wrapper's calls compose, in the order each event runs them: the one table to extend.

A new strategy is a :class:`~koila_retry._core.strategy.Strategy` in a module of its
own and one row here; the driver does not change. The order matters where two
act at one event: at a call's start, growing back probes first, ``refine`` searches
below a bound only where no growth probe runs, the ranks then agree on the
smallest start, and an estimate's size is presumed after that, on the agreed one.
"""

from __future__ import annotations

from koila_retry._core.agreeing import Agreeing
from koila_retry._core.cache import SizeCache
from koila_retry._core.calibrating import Calibrating
from koila_retry._core.call import FirstSize
from koila_retry._core.decision import Rules
from koila_retry._core.distributed import Agreement
from koila_retry._core.growing import Growing, streaks
from koila_retry._core.notifying import Notifying
from koila_retry._core.policy import Policy
from koila_retry._core.refining import Presuming, Refining
from koila_retry._core.sharded import Shards
from koila_retry._core.sharding import Sharding
from koila_retry._core.snapshotting import Snapshotting
from koila_retry._core.strategy import ALONE, Plan, Strategy
from koila_retry._core.throughput import Throughput

__all__ = ["compose"]


def compose(
    policy: Policy,
    rules: Rules,
    cache: SizeCache,
    agreement: Agreement | None = None,
    shards: Shards | None = None,
    first: FirstSize | None = None,
) -> Plan:
    """Return the plan of a wrapper's calls: what its options (and a call's ranks and estimate) turn on, in order."""
    strategies: list[Strategy] = []
    if first is not None and first.meter is not None:  # first: its measures hold presuming back
        strategies.append(Calibrating(first))
    if policy.grow:
        strategies.append(Growing(streaks(cache), policy.grow_after))
    if rules.refine:
        strategies.append(Refining())
    agreeing = (
        None
        if agreement is None
        else Agreeing(agreement, on_steps=policy.grow or policy.refine, sharded=shards is not None)
    )
    if agreeing is not None:
        strategies.append(agreeing)
    if rules.refine:
        strategies.append(Presuming())
    if shards is not None:
        strategies.append(Sharding(shards))
    if rules.grow_gain is not None:
        strategies.append(Throughput())
    if policy.snapshot is not None:
        strategies.append(Snapshotting(policy.snapshot, policy.snapshot_each_oom))
    if policy.on_oom is not None:  # last: told once what follows a failure is settled
        strategies.append(Notifying(policy.on_oom))
    return Plan(strategies, ALONE if agreeing is None else agreeing)
