"""Refuse, where an option is given, a callable that cannot be called as the library will call it.

Checked once per function: a call form (``koila.chunked(fn, x, on_oom=...)`` in a loop) checks
the options at every call, and ``inspect.signature`` costs some 20 µs.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["check_takes", "seen_through"]

# What each function was found to take, by number of positional arguments (a method's self counted).
_CHECKED: weakref.WeakKeyDictionary[Any, set[int]] = weakref.WeakKeyDictionary()


def check_takes(name: str, function: Callable[..., object], given: str, *arguments: object) -> None:
    """Raise ``TypeError`` if ``function`` cannot be called with ``arguments``, which ``given`` describes."""
    target: Any = function
    count = len(arguments)
    if isinstance(function, types.MethodType):  # made anew at each attribute read: its function is kept
        target, count = function.__func__, count + 1
    try:
        if count in _CHECKED.get(target, ()):
            return
    except TypeError:  # not hashable, or not referable weakly (a builtin): checked every time
        target = None
    try:
        # The wrapper's own signature: a decorator may supply some of the wrapped function's arguments.
        signature = inspect.signature(function, follow_wrapped=False)
    except (TypeError, ValueError):  # a builtin without a signature: called as it is
        return
    try:
        signature.bind(*arguments)
    except TypeError as error:
        raise TypeError(f"{name} is called with {given}, but {function!r:.200} takes {signature}: {error}") from None
    if target is not None:
        with contextlib.suppress(TypeError):
            _CHECKED.setdefault(target, set()).add(count)


def seen_through(fn: object) -> list[object]:
    """Return ``fn``, and a callable instance's ``__call__``: what decides what a call of ``fn`` makes."""
    # Not what a decorator's wrapper wraps: a sync wrapper may run the coroutine or consume the generator
    # itself (asyncio.run, list) or pass it on, and only its code tells which.
    if inspect.isroutine(fn) or isinstance(fn, functools.partial):
        return [fn]
    return [fn, type(fn).__call__]  # an async def __call__, or type.__call__
