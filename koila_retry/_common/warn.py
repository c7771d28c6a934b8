"""Warnings that a warnings filter must not turn into a call's error.

Where warnings are errors (``pytest -W error``), a warning issued while an OOM is handled would
replace the recovery, and one issued after a call's work is done would make a call that succeeded
raise: those go through :func:`warn_or_log`. Warnings issued before a call changes anything follow
the filter as it is set.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import warnings

from koila_retry._common.forks import locks_renewed_in_child

__all__ = ["global_hooks_added", "global_hooks_removed", "warn_or_log"]

logger = logging.getLogger("koila_retry")


def warn_or_log(message: str, category: type[Warning] = UserWarning, stacklevel: int = 1) -> None:
    """Warn; where a warnings filter makes the warning an error, log it at ``WARNING`` level instead."""
    try:
        # ``stacklevel`` counts as if our caller called warnings.warn: ``levels_to_caller()`` works as is.
        warnings.warn(message, category, stacklevel=stacklevel + 1)  # + this frame
    except Warning:
        # Python shows the ``koila_retry`` logger on stderr even without logging set up.
        logger.warning(
            "%s: %s (a warnings filter made this warning an error; it is logged instead, so that the call goes on)",
            category.__name__,
            message,
        )


# torch warns, over a torch.compile(module) wrapper, that global module hooks fire for it too: while
# an estimate or a profile holds them, that is the library's doing, and it made their call fail under
# ``-W error``. The filter is the list's own entry, put in and taken out as it is: the filters' version
# stays, so no "once" warning of the user's shows again.
_HOOKS_WARNING = (
    "ignore",
    re.compile(re.escape("Using `torch.compile(module)` when there are global hooks"), re.I),
    UserWarning,
    None,  # any module: torch warns at the caller's line
    0,
)
_hooks_lock = threading.Lock()
locks_renewed_in_child(globals(), "_hooks_lock")  # a fork while another thread held it
_hooks_held = 0


def global_hooks_added() -> None:
    """Keep torch from warning of the library's global module hooks, until as many ``global_hooks_removed``."""
    global _hooks_held
    with _hooks_lock:
        _hooks_held += 1
        if _hooks_held == 1:
            warnings.filters.insert(0, _HOOKS_WARNING)  # type: ignore[attr-defined]


def global_hooks_removed() -> None:
    """Let torch warn of global module hooks again once the last of the library's is removed."""
    global _hooks_held
    with _hooks_lock:
        _hooks_held -= 1
        if _hooks_held == 0:
            # A catch_warnings that began before and ended since has put its own list back.
            with contextlib.suppress(ValueError):
                warnings.filters.remove(_HOOKS_WARNING)  # type: ignore[attr-defined]
