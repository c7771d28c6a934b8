"""State made anew in a child process: a lock another thread held when the process forked is never let go there.

Only the thread that forked lives on in the child; what the others held (a cache's lock while it wrote
its file, a step's leaves) would make the child's first call that needs it wait for ever.
"""

from __future__ import annotations

import functools
import gc
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["lock_renewed_in_child", "locks_renewed_in_child", "renewed_in_child"]

T = TypeVar("T")
# No lock: the collector runs weakref callbacks in whatever thread allocates, also in the middle of a
# registration, so a lock taken by both would wait on itself. A dict's one operation needs none.
_owners: dict[int, tuple[weakref.ref[Any], Callable[[Any], None]]] = {}


def renewed_in_child(owner: T, renew: Callable[[T], None]) -> None:
    """Call ``renew(owner)`` in the child of every fork while ``owner`` lives, before anything else runs there."""

    def forget(_: object, key: int = id(owner)) -> None:
        _owners.pop(key, None)  # before its id can be another's: the object is not freed yet

    _owners[id(owner)] = (weakref.ref(owner, forget), renew)


def lock_renewed_in_child(owner: object, name: str) -> None:
    """Make ``owner``'s lock attribute ``name`` anew in the child of every fork while ``owner`` lives."""
    renewed_in_child(owner, functools.partial(_new_lock, name=name))


def _new_lock(owner: object, name: str) -> None:
    setattr(owner, name, threading.Lock())  # the parent's may have been held by another thread


def locks_renewed_in_child(namespace: dict[str, Any], *names: str) -> None:
    """Make the module's locks ``namespace[name]`` anew, of their kind, in the child of every fork."""

    def renew() -> None:
        for name in names:
            namespace[name] = threading.RLock() if isinstance(namespace[name], _RLOCK) else threading.Lock()

    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=renew)


_RLOCK = type(threading.RLock())


def _after_fork_in_child() -> None:
    enabled = gc.isenabled()
    gc.disable()  # a callback would change the dict as it is read
    try:
        owners = list(_owners.values())
    finally:
        if enabled:
            gc.enable()
    for reference, renew in owners:
        owner = reference()
        if owner is not None:
            renew(owner)


if hasattr(os, "register_at_fork"):  # not on Windows, which does not fork
    os.register_at_fork(after_in_child=_after_fork_in_child)
