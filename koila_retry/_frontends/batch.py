"""The front ends: ``batch`` and ``attempts``. Each drives the engine's Controller."""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar, overload

import torch

from koila_retry._common.walk import frame_locals
from koila_retry._core.cache import CacheInfo, SizeCache, StackMemoryCache
from koila_retry._core.engine import DEFAULT_GROW_AFTER, DEFAULT_INITIAL, Attempt, Controller, OnOOM, Stats
from koila_retry._core.memory import DeviceLike, default_device, resolve_device

__all__ = ["Batched", "attempts", "batch"]

P = ParamSpec("P")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


class Batched(Protocol[P, R_co]):
    """A function wrapped by :func:`batch`: call it without the batch size.

    Besides being callable, it has ``stats`` (a :class:`Stats`), and
    ``cache_info()`` and ``cache_clear()`` for its cache.
    """

    stats: Stats

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R_co: ...

    def cache_info(self) -> CacheInfo: ...

    def cache_clear(self) -> None: ...


class _Injection:
    """Where the batch size goes in the wrapped function's arguments."""

    def __init__(self, fn: Callable[..., Any], param: str | None) -> None:
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"cannot read the signature of {fn!r} to inject the batch size: {exc}") from None
        params = list(signature.parameters.values())
        name = getattr(fn, "__qualname__", repr(fn))
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        if param is not None:
            if not isinstance(param, str):
                raise TypeError(f"param must be a parameter name (str), got {param!r}")
            target = signature.parameters.get(param)
            if target is None or target.kind not in (
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
                inspect.Parameter.KEYWORD_ONLY,
            ):
                raise TypeError(
                    f"{name}() has no parameter {param!r} that can be passed by keyword; "
                    f"its parameters are {[p.name for p in params]}"
                )
            self.position: int | None = None
        else:
            self.position = 1 if _is_method(fn, params) else 0
            if len(params) <= self.position or params[self.position].kind not in positional:
                where = "second (after self)" if self.position else "first"
                raise TypeError(
                    f"{name}() has no {where} positional parameter to receive the batch size; "
                    "add one, or name a keyword parameter with param=..."
                )
            target = params[self.position]
        self.name = target.name
        self.function_name = name
        rest = [p for p in params if p is not target]
        self.signature = signature.replace(parameters=rest)
        has_varargs = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
        # The most positional arguments a caller may pass; more means they passed the size.
        self.max_args = sys.maxsize if has_varargs or self.position is None else sum(p.kind in positional for p in rest)

    def refuse(self) -> TypeError:
        return TypeError(
            f"{self.function_name}() gets {self.name!r} from @koila.batch; call it without "
            f"{self.name!r} (the size is chosen and injected for you)"
        )


def _is_method(fn: Callable[..., Any], params: list[inspect.Parameter]) -> bool:
    # Defined directly in a class body ("Model.evaluate", not "outer.<locals>.evaluate")
    # with a self/cls first parameter: Python binds that first, the size comes second.
    qualname = getattr(fn, "__qualname__", "")
    owner = qualname.rpartition(".")[0].rpartition(".")[2]
    return bool(owner) and owner != "<locals>" and bool(params) and params[0].name in ("self", "cls")


# isinstance against torch.Tensor goes through its metaclass's __instancecheck__ (about
# 0.3 us for each non-tensor argument); its C base class answers the same question directly.
_TensorBase = torch._C.TensorBase


def _device_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    for value in args:
        if isinstance(value, _TensorBase):
            return value.device
    if kwargs:
        for value in kwargs.values():
            if isinstance(value, _TensorBase):
                return value.device
    return default_device()


@overload
def batch(fn: Callable[Concatenate[int, P], R], /) -> Batched[P, R]: ...


@overload
def batch(
    *,
    initial: int = ...,
    minimum: int = ...,
    cache: SizeCache | None = ...,
    max_attempts: int | None = ...,
    on_oom: OnOOM | None = ...,
    param: None = ...,
    device: DeviceLike = ...,
    grow: bool = ...,
    grow_after: int = ...,
    sync: bool | None = ...,
    group: Any = ...,
) -> Callable[[Callable[Concatenate[int, P], R]], Batched[P, R]]: ...


@overload
def batch(
    *,
    initial: int = ...,
    minimum: int = ...,
    cache: SizeCache | None = ...,
    max_attempts: int | None = ...,
    on_oom: OnOOM | None = ...,
    param: str,
    device: DeviceLike = ...,
    grow: bool = ...,
    grow_after: int = ...,
    sync: bool | None = ...,
    group: Any = ...,
) -> Callable[[Callable[..., R]], Batched[..., R]]: ...


def batch(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    initial: int = DEFAULT_INITIAL,
    minimum: int = 1,
    cache: SizeCache | None = None,
    max_attempts: int | None = None,
    on_oom: OnOOM | None = None,
    param: str | None = None,
    device: DeviceLike = None,
    grow: bool = False,
    grow_after: int = DEFAULT_GROW_AFTER,
    sync: bool | None = None,
    group: Any = None,
) -> Any:
    """Call a function with the largest batch size that fits, shrinking it on OOM.

    The decorated function receives the batch size as its first positional
    parameter (the second for methods, after ``self``; or the keyword parameter
    named by ``param``), and callers call it without one. If it runs out of
    memory, the memory of the failed attempt is released and it is called again
    with the largest power of two below the failed size, down to ``minimum``.
    The size that worked is remembered in ``cache``, so the next call from the
    same place starts there. ``async def`` functions work too.

    The function must be safe to run again: if it calls ``backward()``, it should
    zero the gradients first (``optimizer.zero_grad()``), because a backward that
    ran out of memory half-way may already have written some of them.

    Use it bare (``@koila.batch``) or called (``@koila.batch(initial=256)``).

    Args:
        fn (callable): the function, when used bare.
        initial (int): the first size to try. Default: 512.
        minimum (int): the smallest size to try. Default: 1.
        cache (SizeCache, optional): where sizes that worked are kept. Default:
            a new :class:`StackMemoryCache` for this function.
        max_attempts (int, optional): the most attempts one call may make.
        on_oom (callable, optional): called with an :class:`OOMEvent` after each
            out-of-memory failure.
        param (str, optional): inject the size as this keyword argument instead
            of the first positional one.
        device (torch.device, str or int, optional): the device whose memory
            the call uses. Default: the device of the first tensor argument,
            else the current accelerator, else the CPU.
        grow (bool): after a reduction, try the next power of two up (never
            above ``initial``) once ``grow_after`` calls in a row succeeded;
            see :ref:`growing-back`. Default: ``False``.
        grow_after (int): successful calls in a row before growing; doubled
            after each probe that runs out of memory. Default: 50.
        sync (bool or None): whether the ranks of a ``torch.distributed`` job
            agree on every size, so that they try the same sizes and return
            together; every rank must then make each call. ``None`` agrees
            when a process group of more than one rank is initialized; see
            :doc:`distributed`. Default: ``None``.
        group (ProcessGroup, optional): the ranks that agree. Default: all.

    Returns:
        Batched: the wrapped function, with ``stats``, ``cache_info()`` and
        ``cache_clear()``.

    Raises:
        TypeError: if the function has no parameter to inject into, or an
            option has the wrong type.
        ValueError: if ``initial``, ``minimum``, ``max_attempts`` or
            ``grow_after`` is out of range.

    Example::

        >>> import torch, koila_retry as koila
        >>> @koila.batch(initial=1024)
        ... def total(batch_size, data):
        ...     if batch_size > 256:  # stands in for a real OOM
        ...         raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
        ...     return sum(chunk.sum() for chunk in data.split(batch_size))
        >>> total(torch.ones(1000))
        tensor(1000.)
        >>> total.stats.batch_size
        256

    .. versionadded:: 0.1.0
    """

    def decorate(function: Callable[..., Any]) -> Any:
        return _batched(
            function,
            initial=initial,
            minimum=minimum,
            cache=cache,
            max_attempts=max_attempts,
            on_oom=on_oom,
            param=param,
            device=device,
            grow=grow,
            grow_after=grow_after,
            sync=sync,
            group=group,
        )

    if fn is None:
        return decorate
    return decorate(fn)


def _batched(
    fn: Callable[..., Any],
    *,
    initial: int,
    minimum: int,
    cache: SizeCache | None,
    max_attempts: int | None,
    on_oom: OnOOM | None,
    param: str | None,
    device: DeviceLike,
    grow: bool,
    grow_after: int,
    sync: bool | None,
    group: Any,
    schedule: Callable[[int], int | None] | None = None,
) -> Any:
    if not callable(fn):
        raise TypeError(f"@koila.batch decorates a callable, got {type(fn).__name__} {fn!r}")
    injection = _Injection(fn, param)
    controller = Controller(
        name=injection.function_name,
        initial=initial,
        minimum=minimum,
        cache=StackMemoryCache() if cache is None else cache,
        max_attempts=max_attempts,
        on_oom=on_oom,
        grow=grow,
        grow_after=grow_after,
        sync=sync,
        group=group,
        schedule=schedule,
    )
    fixed_device = None if device is None else resolve_device(device)
    start = controller.start
    getframe = sys._getframe
    name, position, max_args = injection.name, injection.position, injection.max_args

    # The injection is spelled out inline: every call of the wrapper pays for each
    # extra Python call, and this is the whole cost of a cached call.
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            if len(args) > max_args or name in kwargs:
                raise injection.refuse()
            attempt = start(fn, getframe(1), fixed_device or _device_of(args, kwargs))
            if attempt._agreement is not None:
                controller.reach((fn, args, kwargs))
            while True:
                with attempt:
                    if position == 0:
                        result = await fn(attempt.batch_size, *args, **kwargs)
                    elif position == 1:
                        result = await fn(args[0], attempt.batch_size, *args[1:], **kwargs)
                    else:
                        result = await fn(*args, **kwargs, **{name: attempt.batch_size})
                if attempt.succeeded():
                    return result
                result = None  # this rank's result of an attempt another rank failed
                attempt.retry()

        wrapper: Any = async_wrapper
    else:

        @functools.wraps(fn)
        def sync_wrapper(*args: Any, **kwargs: Any) -> Any:
            if len(args) > max_args or name in kwargs:
                raise injection.refuse()
            attempt = start(fn, getframe(1), fixed_device or _device_of(args, kwargs))
            if attempt._agreement is not None:
                return _run_attempts(controller, attempt, fn, position, name, args, kwargs)
            while True:
                with attempt:
                    if position == 0:
                        return fn(attempt.batch_size, *args, **kwargs)
                    if position == 1:
                        return fn(args[0], attempt.batch_size, *args[1:], **kwargs)
                    return fn(*args, **kwargs, **{name: attempt.batch_size})
                attempt.retry()  # reached only when the block swallowed an OOM

        wrapper = sync_wrapper
    wrapper.__signature__ = injection.signature
    return _with_controller(wrapper, controller)


def _run_attempts(
    controller: Controller,
    attempt: Attempt,
    fn: Callable[..., Any],
    position: int | None,
    name: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Run a call's attempts until one fits; when ranks agree, a success counts once every rank had one."""
    if attempt._agreement is not None:
        controller.reach((fn, args, kwargs))
    while True:
        with attempt:
            size = attempt.batch_size
            if position == 0:
                result = fn(size, *args, **kwargs)
            elif position == 1:
                result = fn(args[0], size, *args[1:], **kwargs)
            else:
                result = fn(*args, **kwargs, **{name: size})
        if attempt.succeeded():
            return result
        result = None  # this rank's result of an attempt another rank failed: freed before the release
        attempt.retry()


def _with_controller(wrapper: Any, controller: Controller) -> Any:
    """Give a wrapper its controller's ``stats``, ``cache_info()`` and ``cache_clear()``."""
    wrapper.stats = controller.stats
    wrapper.cache_info = controller.cache.cache_info
    wrapper.cache_clear = controller.cache.cache_clear
    return wrapper


# Blocks under ``attempts`` share one cache; keys hold the block's code and line.
_attempts_cache = StackMemoryCache()


def attempts(
    *,
    initial: int = DEFAULT_INITIAL,
    minimum: int = 1,
    cache: SizeCache | None = None,
    max_attempts: int | None = None,
    on_oom: OnOOM | None = None,
    device: DeviceLike = None,
    grow: bool = False,
    grow_after: int = DEFAULT_GROW_AFTER,
    sync: bool | None = None,
    group: Any = None,
) -> Attempt:
    """Retry a block of code with smaller batch sizes until it fits in memory.

    A ``with`` block cannot run itself again, so the retry loop is a ``for``
    loop around it. An out-of-memory error inside ``with attempt:`` is
    swallowed, the memory released, and the loop runs the block again with
    ``attempt.batch_size`` at the next smaller power of two. Success ends the
    loop; running out of sizes raises :class:`BatchSizeExhausted`; any other
    error propagates unchanged. Locals the block assigned before failing are
    still bound in your frame: rebind or delete them if they hold large tensors.

    Args:
        initial (int): the first size to try. Default: 512.
        minimum (int): the smallest size to try. Default: 1.
        cache (SizeCache, optional): where sizes that worked are kept. Default:
            one :class:`StackMemoryCache` shared by all blocks, keyed by the
            block's place in the code.
        max_attempts (int, optional): the most attempts the block may make.
        on_oom (callable, optional): called with an :class:`OOMEvent` after each
            out-of-memory failure.
        device (torch.device, str or int, optional): the device whose memory the
            block uses. Default: the current accelerator, else the CPU.
        grow (bool): after a reduction, try the next power of two up once
            ``grow_after`` runs of the block in a row succeeded; see
            :ref:`growing-back`. Default: ``False``.
        grow_after (int): successful runs in a row before growing. Default: 50.
        sync (bool or None): whether the ranks of a ``torch.distributed`` job
            agree on every size; every rank must then run the block, and run
            the loop to its end (no ``break``). ``None`` agrees when a process
            group of more than one rank is initialized; see
            :doc:`distributed`. Default: ``None``.
        group (ProcessGroup, optional): the ranks that agree. Default: all.

    Returns:
        Attempt: an iterator over the attempts of the block; each attempt is
        that same object, a context manager with ``batch_size`` and ``number``.

    Raises:
        TypeError: if an option has the wrong type.
        ValueError: if ``initial``, ``minimum``, ``max_attempts`` or
            ``grow_after`` is out of range.
        BatchSizeExhausted: from the loop, when even ``minimum`` runs out of memory.

    Example::

        >>> import koila_retry as koila
        >>> for attempt in koila.attempts(initial=64, cache=koila.NoCache()):
        ...     with attempt:
        ...         if attempt.batch_size > 16:  # stands in for a real OOM
        ...             raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
        ...         size = attempt.batch_size
        >>> size
        16

    .. versionadded:: 0.1.0
    """
    caller = sys._getframe(1)
    code = caller.f_code
    line = caller.f_lineno
    # Names the block for the cache as a function is named, by file, line and name: strings
    # cache their hashes, where a code object would be rehashed on every use. The line is
    # the block's own, so two blocks in one function have keys of their own in every cache.
    block = (code.co_filename, line, getattr(code, "co_qualname", code.co_name))
    controller = Controller(
        name=f"block at {code.co_filename}:{line} in {code.co_name}",
        initial=initial,
        minimum=minimum,
        cache=_attempts_cache if cache is None else cache,
        max_attempts=max_attempts,
        on_oom=on_oom,
        grow=grow,
        grow_after=grow_after,
        sync=sync,
        group=group,
    )
    attempt = controller.start(block, caller, resolve_device(device))
    if attempt._agreement is not None:  # the block's modules are those its function's variables hold
        controller.reach(value for _, value in frame_locals(caller))
    return attempt
