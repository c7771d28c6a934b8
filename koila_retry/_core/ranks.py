"""Where a wrapper's calls agree across ranks: each call's agreement and plan, and the parallel modules they reach."""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

import torch

from koila_retry._core import distributed, sharded
from koila_retry._core.cache import SizeCache
from koila_retry._core.call import Call
from koila_retry._core.decision import Rules
from koila_retry._core.policy import Policy
from koila_retry._core.strategies import compose
from koila_retry._core.strategy import Plan

__all__ = ["Found", "Ranks", "alone"]

T = TypeVar("T")

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
        # What the agreeing calls reached: another model as an argument, or another instance for a method,
        # reaches other parallel modules.
        self.reached: Found[_Reached] = Found(code)
        self.current = _NOTHING  # what the call starting reaches

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
        reached = self.current = self.reach(call.roots, agreement)
        group = None if reached.group is None else reached.group()
        if group is not None:
            agreement = distributed.agreement(self.policy.sync, group) or agreement
        if reached.norms:
            distributed.check_norms((norm for norm in (ref() for ref in reached.norms) if norm is not None), self.name)
        alive = self.alive()
        distributed.check_join(alive, self.name)
        distributed.broadcast_before_inference(alive)
        modules = [module for module in alive if sharded.is_fsdp2(module)]
        # A rank that fails plays along their collectives (see sharded.py).
        shards = sharded.Shards(modules, agreement, self.source) if modules else None
        return compose(self.policy, self.rules, self.cache, agreement, shards, first)

    def alive(self) -> list[Any]:
        """Return the parallel modules the call starting reaches, still alive."""
        return [module for module in (ref() for ref in self.current.parallel) if module is not None]

    def reach(self, roots: Iterable[Any], agreement: distributed.Agreement) -> _Reached:
        """Return what an agreeing call reaches from ``roots``, looked at once per :class:`Found`; every rank looks."""
        return self.reached.get(roots, lambda: self._look(roots, agreement))

    def _look(self, roots: Iterable[Any], agreement: distributed.Agreement) -> _Reached:
        found = distributed.supported_modules(roots, self.name, sharded.managed)  # raises on every rank alike
        for module in sharded.fsdp_modules(found):
            sharded.check_mesh(module, agreement.world_size, self.name)
            sharded.check_state(module, self.name)
        groups = [distributed.ddp_group(module) for module in found]
        shared = self.policy.group is None and groups and groups[0] is not None and all(g is groups[0] for g in groups)
        return _Reached(found, distributed.synced_norms(roots), groups[0] if shared else None)

    def agree_on_nothing(self) -> None:
        """Take part, with nothing to cover, in the ranks' check that they cover as much."""
        if self.policy.sync is not False:
            agreement = distributed.agreement(self.policy.sync, self.policy.group)
            if agreement is not None:
                agreement.start(0, span=0)


class Found(Generic[T]):
    """What was found from calls given the same objects (see :func:`_given`), a few kept while those live."""

    def __init__(self, code: object) -> None:
        self.entries: dict[tuple[int, ...], tuple[list[weakref.ref[Any]], T]] = {}
        # A method's function, decorated in its class, is given the instance first: told by this name on its class.
        self.method = code.co_name if isinstance(code, types.CodeType) and code.co_argcount else None

    def get(self, roots: Iterable[Any], find: Callable[[], T]) -> T:
        """Return what ``find`` found for a call given the objects ``roots`` give, found again when they change."""
        given = _given(roots, self.method)
        if given is None:  # nothing to know the objects by: found on every call
            return find()
        key = tuple(map(id, given))
        entry = self.entries.get(key)
        if entry is not None and all(ref() is not None for ref in entry[0]):
            return entry[1]
        value = find()
        # The entries whose objects were freed go; a few are kept (a GAN's two models, say).
        self.entries = {k: v for k, v in self.entries.items() if all(ref() is not None for ref in v[0])}
        if len(self.entries) >= _KEPT:
            del self.entries[next(iter(self.entries))]
        self.entries[key] = ([weakref.ref(obj) for obj in given], value)
        return value


class _Reached:
    """The parallel modules calls given the same objects reach, their SyncBatchNorm layers and DDP's subgroup."""

    __slots__ = ("group", "norms", "parallel")

    def __init__(self, parallel: list[Any], norms: Iterable[Any], group: Any) -> None:
        self.parallel = [weakref.ref(module) for module in parallel]
        self.norms = [weakref.ref(norm) for norm in norms]  # refused while they train
        # Where they share a subgroup and no group was given: the ranks outside it never make the call.
        self.group = None if group is None else weakref.ref(group)


_NOTHING = _Reached([], [], None)
_KEPT = 8
# What a first argument is when it is data, not the instance of a method (``sum(x)`` is not ``x.sum()``).
_DATA = frozenset((str, bytes, int, float, list, tuple, dict, set))


def _given(roots: Iterable[Any], method: str | None) -> list[Any] | None:
    """Return the modules a call is given and the instance it runs for; None for an instance with no weak reference."""
    # Top-level only, a few microseconds: the rest of what a call reaches (its function's globals, a batch's
    # containers) is looked at when these change, not at every call. Roots are (fn, args, kwargs), or toma's
    # (fn, tensor, args, kwargs); an attempts block's frame is looked at once.
    if type(roots) is not tuple or not roots:
        return []
    fn, *rest = roots
    values = [fn]
    for root in rest:
        values.extend(root.values() if type(root) is dict else root if type(root) is tuple else (root,))
    owner = getattr(fn.func if isinstance(fn, functools.partial) else fn, "__self__", None)
    if owner is None and method is not None and len(values) > 1:
        first = values[1]  # a method decorated in its class is given its instance first
        if type(first) not in _DATA and not isinstance(first, torch.Tensor) and hasattr(type(first), method):
            owner = first
    given = [value for value in values if isinstance(value, torch.nn.Module)]
    if owner is not None and not isinstance(owner, types.ModuleType) and not any(owner is value for value in given):
        try:
            weakref.ref(owner)
        except TypeError:  # a named tuple's method, say
            return None
        given.append(owner)
    return given
