"""Warnings that a warnings filter must not turn into a call's error.

Where warnings are errors (``pytest -W error``), a warning issued while an OOM is handled would
replace the recovery, and one issued after a call's work is done would make a call that succeeded
raise: those go through :func:`warn_or_log`. Warnings issued before a call changes anything follow
the filter as it is set.
"""

from __future__ import annotations

import logging
import warnings

__all__ = ["warn_or_log"]

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
