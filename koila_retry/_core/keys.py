"""The keys that caches file sizes under: one small function each, and a cache takes any of them.

Every key function has one signature, ``(function, caller, device, sample)``,
and returns a hashable key, or ``None`` for a call that is neither looked up
nor stored. The ones here also accept the three-argument call (``sample``
left out) that the engine makes when a front end sees no inputs.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Hashable
from types import FrameType
from typing import TypeAlias

import torch

from koila_retry._common.places import is_ours
from koila_retry._common.units import as_int
from koila_retry._core.memory import recent_free_memory

__all__ = [
    "KeyFunction",
    "deep_stack_key",
    "global_key",
    "is_stack_key",
    "no_key",
    "size_class_key",
    "stack_key",
]

#: What a cache calls to make a call's key: ``(function, caller, device, sample) -> key or None``.
KeyFunction: TypeAlias = Callable[[object, FrameType | None, torch.device, Hashable], Hashable | None]


def stack_key(function: object, caller: FrameType | None, device: torch.device, sample: Hashable = None) -> Hashable:
    """Key a call by its function, device, free-memory level, sample and calling line.

    The key of :class:`~koila_retry.StackMemoryCache`, the default cache: a tuple
    ``(function, device, bucket, sample, filename, function name, offset)``, where
    ``bucket`` is ``free_memory(device).bit_length()`` (free memory in power-of-two
    steps, read at most once a second), ``sample`` is left out when it is ``None``,
    and the last three name the calling line (the caller's code file and name, and
    its bytecode offset), read from ``caller`` without ``inspect``.

    Args:
        function (object): the decorated function, or a hashable description of it.
        caller (FrameType or None): the frame that made the call.
        device (torch.device): the device the call runs on.
        sample (Hashable, optional): the shape class of one sample of the inputs,
            from front ends that see them; ``None`` otherwise.

    Returns:
        Hashable: the key.

    .. versionadded:: 0.1.0
    """
    if caller is not None and caller.f_code.co_filename not in _OTHER_FILES:
        caller = _past_torch(caller)
    if caller is not None and sample is None:  # every cached call of a loop: one tuple, nothing else
        # File, function name and bytecode offset: the strings cache their hashes (hashing a
        # code object rehashes its bytecode on every call), and the offset is read directly
        # where f_lineno searches the line table.
        code = caller.f_code
        bucket = recent_free_memory(device).bit_length()
        return (function, device, bucket, code.co_filename, code.co_name, caller.f_lasti)
    if caller is not None:  # every call of accumulate or chunked: _ONE_FRAME's tuple, made without its walk
        code = caller.f_code
        bucket = recent_free_memory(device).bit_length()
        return (function, device, bucket, sample, code.co_filename, code.co_name, caller.f_lasti)
    return _ONE_FRAME(function, caller, device, sample)


def deep_stack_key(depth: int) -> KeyFunction:
    """Make a :func:`stack_key` that names the call site by its innermost ``depth`` frames.

    The same key as :func:`stack_key`, with file, function name and offset of each
    of ``depth`` frames, from ``caller`` outwards, this library's own left out: a
    helper called from two places gets a size for each. ``sys.maxsize`` takes the
    whole stack.

    Args:
        depth (int): how many calling frames identify a call site, >= 1.

    Returns:
        KeyFunction: the key function; :func:`stack_key` itself for a depth of 1.

    Raises:
        ValueError: if ``depth`` is not an int >= 1.

    .. versionadded:: 0.1.0
    """
    frames = as_int(depth)  # numpy's ints too, as Options take them
    if frames is None or frames < 1:
        raise ValueError(f"depth must be an int >= 1, got {depth!r}")
    # Deeper than any stack is the whole stack.
    return stack_key if frames == 1 else _stack_key_of(min(frames, sys.maxsize))


# torch's frames between a call site and a decorated function (a decorated forward's Module.__call__,
# @torch.no_grad() or @torch.autocast() above it, checkpoint, a compiled module's wrapper, a Sequential)
# would be every call's call site: the first frame outside torch is. Files sorted as met, in sets, so
# that a call from a file seen before costs no call.
_TORCH = os.path.dirname(torch.__file__) + os.sep
_TORCH_FILES: set[str] = set()
_OTHER_FILES: set[str] = set()


def _is_torch(filename: str) -> bool:
    if filename in _TORCH_FILES:
        return True
    if filename in _OTHER_FILES:
        return False
    if len(_OTHER_FILES) > _KNOWN:  # generated code (FX, notebook cells) names files without end
        _OTHER_FILES.clear()
    torchs = filename.startswith(_TORCH)
    (_TORCH_FILES if torchs else _OTHER_FILES).add(filename)
    return torchs


def _past_torch(frame: FrameType) -> FrameType:
    """Return the first frame from ``frame`` outwards that is not torch's (``frame`` if every one is)."""
    found: FrameType | None = frame
    while found is not None and _is_torch(found.f_code.co_filename):
        found = found.f_back
    return frame if found is None else found


# Whether each file met in a stack is this library's: a dict read per frame costs less than a cached call.
_OURS: dict[str, bool] = {}
_KNOWN = 4096


def _stack_key_of(depth: int) -> KeyFunction:
    def deep_key(function: object, caller: FrameType | None, device: torch.device, sample: Hashable = None) -> Hashable:
        # Power-of-two buckets: readings within a factor of two usually share one, so small
        # fluctuations keep the cache warm while twice the memory gets a fresh start.
        # Built in a list: a whole stack is walked on every call (toma's stand-in), and
        # growing a tuple frame by frame copies it each time.
        parts: list[object] = [function, device, recent_free_memory(device).bit_length()]
        if sample is not None:
            parts.append(sample)
        # Not the library's own frames, which differ between a call that found its size and one that
        # did not: a decorated function called inside another would be keyed anew by the outer's path.
        frame, left, known = caller, depth, _OURS
        while frame is not None and left:
            code = frame.f_code
            filename = code.co_filename
            ours = known.get(filename)
            if ours is None:
                if len(known) > _KNOWN:  # generated code (FX, notebook cells) names files without end
                    known.clear()
                ours = known[filename] = is_ours(filename) or _is_torch(filename)
            if not ours:
                parts += (filename, code.co_name, frame.f_lasti)
                left -= 1
            frame = frame.f_back
        return tuple(parts)

    deep_key.__qualname__ = f"deep_stack_key({depth})"
    return deep_key


_ONE_FRAME = _stack_key_of(1)  # the stack key of a call without a caller, or with a sample
_STACK_CODES = (stack_key.__code__, _ONE_FRAME.__code__)


def is_stack_key(key: KeyFunction) -> bool:
    """Return whether ``key`` makes ``(function, device, bucket, ...)`` keys: :func:`stack_key` or a deep one."""
    # StackMemoryCache reads that layout to fall back to a level with more free memory.
    return getattr(key, "__code__", None) in _STACK_CODES


def global_key(function: object, caller: FrameType | None, device: torch.device, sample: Hashable = None) -> Hashable:
    """Key a call by its function alone: one size wherever, however and on whatever it runs.

    The key of :class:`~koila_retry.GlobalCache`.

    Args:
        function (object): the decorated function, or a hashable description of it.
        caller (FrameType or None): unused.
        device (torch.device): unused.
        sample (Hashable, optional): unused.

    Returns:
        Hashable: ``function``.

    .. versionadded:: 0.1.0
    """
    return function


def size_class_key(
    function: object, caller: FrameType | None, device: torch.device, sample: Hashable = None
) -> Hashable:
    """Key a call by its function, device and the shape class of its samples.

    One size per function and class of sample shapes (each length up to a power
    of two), whatever the call site or the free memory: the key of
    :class:`~koila_retry.DiskCache`, whose sizes must mean the same in the next run.

    Args:
        function (object): the decorated function, or a hashable description of it.
        caller (FrameType or None): unused.
        device (torch.device): the device the call runs on.
        sample (Hashable, optional): the shape class of one sample of the inputs,
            from front ends that see them; ``None`` otherwise.

    Returns:
        Hashable: ``(function, device, sample)``.

    .. versionadded:: 0.1.0
    """
    return (function, device, sample)


def no_key(function: object, caller: FrameType | None, device: torch.device, sample: Hashable = None) -> None:
    """Key no call: nothing is looked up or stored. The key of :class:`~koila_retry.NoCache`.

    Args:
        function (object): unused.
        caller (FrameType or None): unused.
        device (torch.device): unused.
        sample (Hashable, optional): unused.

    Returns:
        None: always.

    .. versionadded:: 0.1.0
    """
    return None
