"""Which leaves the koila steps in flight write, so that no step sets a ``.grad`` another adds into.

Autograd's lock covers its own adds into ``.grad``, not an assignment from Python: a direct step
holds its leaves alone, and a captured one waits for them before it delivers.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any, Protocol

from koila_retry._common.forks import renewed_in_child

__all__ = ["IN_FLIGHT", "Holder", "InFlight"]


class Holder(Protocol):
    """A step that holds leaves: the thread its backward runs on."""

    thread: int


class InFlight:
    """The leaves koila steps in flight write, by ``id``: held by one direct step, or shared by delivering ones."""

    __slots__ = ("__weakref__", "condition", "held", "lock", "owners", "shared", "waiting", "weak")

    def __init__(self) -> None:
        # The condition's own lock, taken directly where nothing waits: the condition's
        # ``with`` is a call into Python, which each step pays for.
        self.lock = threading.Lock()
        self.condition = threading.Condition(self.lock)
        self.owners: dict[int, Holder] = {}  # the direct step holding each leaf
        # How many leaves each holds: a release lets go of exactly those, whatever the step noted of them
        # (an interrupt, Ctrl-C, may land between a take and the step's note of it).
        self.held: dict[Holder, int] = {}
        self.shared: dict[int, int] = {}  # how many captured steps wait to deliver into each leaf, or deliver
        # The leaves held by reference only (not parameters: a gradient penalty's input), whose ids a leaf
        # made after they die may take, in any thread; a subset of owners.
        self.weak: dict[int, weakref.ref[Any]] = {}
        self.waiting = 0

    def take(self, owner: Holder, keys: Sequence[int]) -> bool:
        """Hold the leaves ``keys`` (their ``id``) for ``owner``'s direct writes: all, or none if another holds any."""
        with self.lock:
            owners, shared, held, weak = self.owners, self.shared, self.held, self.weak
            if owners or shared:  # another step may be in flight: the one case that pays per leaf
                for key in keys:
                    if key in shared:
                        return False
                    if owners.get(key, owner) is not owner:
                        ref = weak.get(key)
                        if ref is None or ref() is not None:
                            return False
                if weak:
                    # An id held weakly whose leaf died, reused by the leaf given now: let go first.
                    for key in keys:
                        if weak.pop(key, None) is not None:
                            holder = owners.pop(key)
                            held[holder] -= 1
            before = len(owners)
            owners.update(dict.fromkeys(keys, owner))
            held[owner] = held.get(owner, 0) + len(owners) - before  # those it held already count once
        return True

    def weakly(self, refs: dict[int, weakref.ref[Any]]) -> None:
        """Mark leaves just taken as held through ``refs``: once one dies, its id is free for another step."""
        with self.lock:
            self.weak.update(refs)

    def release(self, owner: Holder) -> None:
        """Let go of every leaf ``owner`` holds, and wake the steps waiting for them."""
        with self.lock:
            owners, weak = self.owners, self.weak
            if self.held.pop(owner, 0) == len(owners):  # held by ``owner`` alone: the only step in flight
                owners.clear()
                weak.clear()
            else:
                for key in [key for key, holder in owners.items() if holder is owner]:
                    del owners[key]
                    if weak:
                        weak.pop(key, None)
            if self.waiting:
                self.condition.notify_all()

    def enter(self, keys: Sequence[int], thread: int) -> None:
        """Wait until no direct step of another ``thread`` holds any of ``keys``, then hold them shared."""
        counted = False
        try:
            # The condition's lock, whose exit (in C) no interrupt comes between: one that comes anywhere
            # else is caught below, so the keys are held shared for a caller's try, or not at all.
            with self.lock:
                shared, owners = self.shared, self.owners
                # First, so that no direct step takes them from now on; all at once.
                shared.update({key: shared.get(key, 0) + 1 for key in keys})
                counted = True
                # A step of this thread (one called inside another) runs no backward now: not waited for.
                while any(key in owners and owners[key].thread != thread for key in keys):
                    self.waiting += 1
                    try:
                        self.condition.wait()
                    finally:
                        self.waiting -= 1
        except BaseException:  # interrupted (Ctrl-C): it delivers nothing
            if counted:
                self.leave(keys)
            raise

    def leave(self, keys: Sequence[int]) -> None:
        """Let go of what :meth:`enter` held."""
        with self.condition:
            self._drop(keys)

    def _drop(self, keys: Sequence[int]) -> None:
        shared = self.shared
        for key in keys:
            count = shared.get(key, 1) - 1  # none after a fork made the registry anew (see renew)
            if count:
                shared[key] = count
            else:
                shared.pop(key, None)
        if self.waiting:
            self.condition.notify_all()

    def renew(self) -> None:
        """Start again in a child process: the steps of the threads that did not fork hold nothing there."""
        thread = threading.get_ident()
        self.lock = threading.Lock()
        self.condition = threading.Condition(self.lock)
        self.owners = {key: owner for key, owner in self.owners.items() if owner.thread == thread}
        self.held = {owner: count for owner, count in self.held.items() if owner.thread == thread}
        self.weak = {key: ref for key, ref in self.weak.items() if key in self.owners}
        self.shared, self.waiting = {}, 0


# Every koila step's, for the process.
IN_FLIGHT = InFlight()
renewed_in_child(IN_FLIGHT, InFlight.renew)
