"""The cyclic garbage collector, paused while estimates and profiles run, by any number of threads at once.

A collection in the middle of a meta or counting run frees cyclic garbage at a moment of its own
choosing (figures that differ from run to run), and was seen to fire the weak-reference callbacks of
meta storages still in use. The collector is the process's, so the pauses are counted: the first
records whether it ran, and only the last to end starts it again. Two threads that each saved and
restored it themselves left it off for good when their runs overlapped (probe 77E).
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Iterator

from koila_retry._common.forks import locks_renewed_in_child

__all__ = ["collector_paused"]

# Reentrant: a finalizer that runs an estimate may be collected while this thread holds it.
_lock = threading.RLock()
_pauses: dict[int, int] = {}  # by thread, how many of its runs hold the collector paused
_was_on = [False]  # whether it ran before the first of them


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic collector for the block; it runs again once no thread's block holds it."""
    thread = threading.get_ident()
    with _lock:
        if not _pauses:
            _was_on[0] = gc.isenabled()
        _pauses[thread] = _pauses.get(thread, 0) + 1
        gc.disable()
    try:
        yield
    finally:
        with _lock:
            _let_go(thread)


def _let_go(thread: int) -> None:
    left = _pauses.get(thread, 0) - 1
    if left > 0:
        _pauses[thread] = left
        return
    if len(_pauses) - (thread in _pauses) == 0 and _was_on[0]:
        gc.enable()  # before the last pause goes: a child forked in between finds one, and starts it again
    _pauses.pop(thread, None)
    if not _pauses and _was_on[0]:  # again: a pause that began and ended in between (a signal's handler) stopped it
        gc.enable()


def _after_fork_in_child() -> None:
    # Only the thread that forked lives on, and the child seldom returns through its run (a data loader's
    # worker): no pause held in the parent ends here, and none starts the collector again.
    if _pauses:
        _pauses.clear()
        if _was_on[0]:
            gc.enable()


locks_renewed_in_child(globals(), "_lock")  # another thread may have held it
if hasattr(os, "register_at_fork"):  # not on Windows, which does not fork
    os.register_at_fork(after_in_child=_after_fork_in_child)
