"""Warnings that a warnings filter must not turn into a call's error.

Where warnings are errors (``pytest -W error``, ``PYTHONWARNINGS=error``), a warning
issued while an out-of-memory error is handled would take the place of the recovery,
and one issued after a call's work is done (its gradients in ``.grad``, its size stored)
would make a call that succeeded raise, with its effects already in place. Those are
issued with :func:`warn_or_log`. Warnings issued before a call changes anything, or that
end an attempt which leaves everything as it was, follow the filter as it is set.
"""

from __future__ import annotations

import logging
import warnings

__all__ = ["warn_or_log"]

logger = logging.getLogger("koila_retry")


def warn_or_log(message: str, category: type[Warning] = UserWarning, stacklevel: int = 1) -> None:
    """Warn; where a warnings filter makes the warning an error, log it at ``WARNING`` level instead.

    The message then goes to the ``koila_retry`` logger, which Python shows on stderr even
    without logging set up, and the caller goes on.

    Args:
        message (str): the warning's text.
        category (type[Warning]): its class. Default: ``UserWarning``.
        stacklevel (int): as for :func:`warnings.warn` called where this is called: 1
            names the caller's line, 2 its caller's (``levels_to_caller()`` works as is).
    """
    try:
        warnings.warn(message, category, stacklevel=stacklevel + 1)  # + this frame
    except Warning:
        logger.warning(
            "%s: %s (a warnings filter made this warning an error; it is logged instead, so that the call goes on)",
            category.__name__,
            message,
        )
