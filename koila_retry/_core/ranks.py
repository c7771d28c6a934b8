"""Where a wrapper's calls agree across ranks: each call's agreement and plan, and the parallel modules they reach."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

from koila_retry._core import distributed, sharded
from koila_retry._core.cache import SizeCache
from koila_retry._core.call import Call
from koila_retry._core.decision import Rules
from koila_retry._core.policy import Policy
from koila_retry._core.strategies import compose
from koila_retry._core.strategy import Plan

__all__ = ["Ranks", "alone"]

# torch.distributed's record of the default process group, when this torch has the layout
# that distributed reads: whether it is None decides, on every call, that nothing agrees.
WORLD: Any = distributed.world if distributed.FAST else None


def alone() -> bool:
    """Return whether no default process group runs (the usual case), decided without a call when torch allows."""
    return WORLD is not None and WORLD._default_pg is None


class Ranks:
    """One wrapper's agreement across ranks: whether a call agrees, and the plan of one that does."""

    def __init__(self, name: str, policy: Policy, rules: Rules, cache: SizeCache, code: object = None) -> None:
        self.name, self.policy, self.rules, self.cache = name, policy, rules, cache
        self.source = (name, code)  # whose collectives FSDP2's records are (see sharded.Shards)
        self.parallel: list[weakref.ref[Any]] | None = None  # the modules the first agreeing call reached
        self.norms: list[weakref.ref[Any]] = []  # its SyncBatchNorm layers: refused while they train
        # The process group of the DDP modules it reached, where they share one of a subgroup and no group
        # was given: the ranks outside it never make the call (accumulate's ddp= sets the same).
        self.group: weakref.ref[Any] | None = None

    def agreement(self) -> distributed.Agreement | None:
        """Return the agreement of a call about to start, or ``None`` when it agrees with no other rank."""
        sync = self.policy.sync
        if sync is False or (sync is None and alone()):
            return None  # the usual case, decided without a call: it costs every call
        return distributed.agreement(sync, self.policy.group)

    def plan(self, base: Plan, agreement: distributed.Agreement | None, call: Call) -> Plan:
        """Return the plan of a call: ``base``, unless it agrees (after a look at what it reaches) or measures."""
        first = call.first if call.first is not None and call.first.meter is not None else None
        if agreement is None:
            return base if first is None else compose(self.policy, self.rules, self.cache, first=first)
        self.reach(call.roots, agreement)
        group = None if self.group is None else self.group()
        if group is not None:
            agreement = distributed.agreement(self.policy.sync, group) or agreement
        if self.norms:
            distributed.check_norms((norm for norm in (ref() for ref in self.norms) if norm is not None), self.name)
        alive = self.alive()
        distributed.check_join(alive, self.name)
        distributed.broadcast_before_inference(alive)
        modules = [module for module in alive if sharded.is_fsdp2(module)]
        # A rank that fails plays along their collectives (see sharded.py).
        shards = sharded.Shards(modules, agreement, self.source) if modules else None
        return compose(self.policy, self.rules, self.cache, agreement, shards, first)

    def alive(self) -> list[Any]:
        """Return the modules the first agreeing call reached, still alive."""
        return [module for module in (ref() for ref in self.parallel or ()) if module is not None]

    def reach(self, roots: Iterable[Any], agreement: distributed.Agreement) -> None:
        """Look, once, at the modules an agreeing call reaches from ``roots``; every rank does, so all raise alike."""
        if self.parallel is None:
            found = distributed.supported_modules(roots, self.name)
            for module in sharded.fsdp_modules(found):
                sharded.check_mesh(module, agreement.world_size, self.name)
                sharded.check_state(module, self.name)
            self.parallel = [weakref.ref(module) for module in found]
            self.norms = [weakref.ref(norm) for norm in distributed.synced_norms(roots)]
            groups = [distributed.ddp_group(module) for module in found]
            if self.policy.group is None and groups and groups[0] is not None and all(g is groups[0] for g in groups):
                self.group = weakref.ref(groups[0])

    def agree_on_nothing(self) -> None:
        """Take part, with nothing to cover, in the ranks' check that they cover as much."""
        if self.policy.sync is not False:
            agreement = distributed.agreement(self.policy.sync, self.policy.group)
            if agreement is not None:
                agreement.start(0, span=0)
