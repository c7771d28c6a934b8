"""State made anew in a child process: a lock another thread held when the process forked is never let go there.

Only the thread that forked lives on in the child; what the others held (a cache's lock while it wrote
its file, a step's leaves) would make the child's first call that needs it wait for ever.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["renewed_in_child"]

T = TypeVar("T")
_lock = threading.Lock()
_owners: dict[int, tuple[weakref.ref[Any], Callable[[Any], None]]] = {}


def renewed_in_child(owner: T, renew: Callable[[T], None]) -> None:
    """Call ``renew(owner)`` in the child of every fork while ``owner`` lives, before anything else runs there."""

    def forget(_: object, key: int = id(owner)) -> None:
        with _lock:
            _owners.pop(key, None)

    with _lock:
        _owners[id(owner)] = (weakref.ref(owner, forget), renew)


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # the parent's may have been held by another thread
    for reference, renew in list(_owners.values()):
        owner = reference()
        if owner is not None:
            renew(owner)


if hasattr(os, "register_at_fork"):  # not on Windows, which does not fork
    os.register_at_fork(after_in_child=_after_fork_in_child)
