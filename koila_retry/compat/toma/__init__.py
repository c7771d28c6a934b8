"""A drop-in stand-in for toma 1.1.0, on koila-retry's engine.

Replace ``from toma import toma, explicit, simple`` with
``from koila_retry.compat.toma import toma, explicit, simple`` and the code runs
as before: the same decorators (``toma.batch``, ``toma.range``,
``toma.chunked``), the ``toma.execute`` forms that run a function at once, the
``explicit`` and ``simple`` calls, the same ``toma_*`` keyword arguments, the
same schedule (the size that ran out of memory is halved, ``100 → 50 → 25 →
12 → 6 → 3 → 1``, until size 1 fails too) and the same caches, which remember
the last size that worked and start later calls there, whatever initial size
they pass. toma itself need not be installed.

Each cache type (:class:`StacktraceMemoryBatchsizeCache`, the default;
:class:`GlobalBatchsizeCache`; :class:`NoBatchsizeCache`; or one of
koila_retry's own, such as :class:`koila_retry.StackMemoryCache`) gets one
instance per *context*: by default the decorated function, or for the
``toma.execute`` forms the call stack of the code that calls them. At most
``2**14`` contexts are kept, the least recently used going first.

Example::

    >>> import torch
    >>> from koila_retry.compat.toma import toma
    >>> @toma.batch(initial_batchsize=100)
    ... def total(batchsize, data):
    ...     if batchsize > 30:  # stands in for a real out-of-memory error
    ...         raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    ...     return sum(chunk.sum() for chunk in data.split(batchsize))
    >>> total(torch.ones(100))
    tensor(100.)

The differences from toma, each with its reason (toma's bugs fixed, giving up,
free-memory levels, cache types), are listed in :ref:`differences-from-toma`.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import functools
import inspect
import operator
import sys
import threading
import types
from collections.abc import Callable, Hashable
from types import FrameType
from typing import Any, Concatenate, ParamSpec, SupportsIndex, TypeVar, cast, overload

import cachetools
import torch

from koila_retry._core.cache import SizeCache, function_identity
from koila_retry._core.detect import is_oom
from koila_retry._core.engine import Call, Controller, cover
from koila_retry._core.memory import default_device
from koila_retry._core.policy import Policy, scaled
from koila_retry._diagnostics import exhausted
from koila_retry._frontends.batch import device_of
from koila_retry.compat.toma.batchsize_cache import (
    GlobalBatchsizeCache,
    NoBatchsizeCache,
    StacktraceMemoryBatchsizeCache,
)

__all__ = [
    "DEFAULT_CACHE_TYPE",
    "GlobalBatchsizeCache",
    "NoBatchsizeCache",
    "StacktraceMemoryBatchsizeCache",
    "explicit",
    "should_reduce_batch_size",
    "simple",
    "toma",
]

P = ParamSpec("P")
R = TypeVar("R")

#: The cache type of calls that name none; read when each call runs.
DEFAULT_CACHE_TYPE: type[SizeCache] = StacktraceMemoryBatchsizeCache

#: Whether an exception means "out of memory"; toma's name for :func:`koila_retry.is_oom`.
should_reduce_batch_size = is_oom

CONTEXT_CACHE_SIZE = 2**14

_INDICES = ("index", "indices", "range")
_ROWS = ("row", "rows", "chunk")


# toma halves the size that failed, and keeps the size of every success.
_POLICY = Policy(initial=None, schedule=scaled(0.5))


class _Context:
    """One cache instance, and a controller per function name that uses it."""

    __slots__ = ("cache", "controllers")

    def __init__(self, cache: SizeCache) -> None:
        self.cache = cache
        self.controllers: dict[str, Controller] = {}

    def controller(self, name: str) -> Controller:
        controller = self.controllers.get(name)
        if controller is None:  # two threads may both make one: either serves
            controller = Controller(name, _POLICY, default_cache=self.cache, explain=exhausted.message, keep_last=True)
            self.controllers[name] = controller
        return controller


_contexts: cachetools.LRUCache[tuple[type[SizeCache], Hashable], _Context] = cachetools.LRUCache(CONTEXT_CACHE_SIZE)
_contexts_lock = threading.Lock()


def _reset() -> None:
    """Forget every context and its cache (for tests)."""
    with _contexts_lock:
        _contexts.clear()


def _context_for(cache_type: type[SizeCache] | None, context: Hashable) -> _Context:
    key = (DEFAULT_CACHE_TYPE if cache_type is None else cache_type, context)
    try:
        with _contexts_lock:
            entry = _contexts.get(key)
    except TypeError:  # an unhashable cache_type: the check below names it
        entry = None
    if entry is None:  # a type in the registry was checked when it got there
        kind = _check_cache_type(key[0], "cache_type")
        with _contexts_lock:
            entry = _contexts.get(key)
            if entry is None:
                entry = _contexts[key] = _Context(kind())
    return entry


def _check_cache_type(cache_type: object, name: str) -> type[SizeCache]:
    if isinstance(cache_type, type) and issubclass(cache_type, SizeCache) and not inspect.isabstract(cache_type):
        return cache_type
    if isinstance(cache_type, SizeCache):
        hint = "; pass the class, not an instance"
    elif getattr(cache_type, "__module__", "").split(".")[0] == "toma":
        hint = "; toma's own cache classes do not work here, use the ones of koila_retry.compat.toma"
    else:
        hint = ""
    raise TypeError(
        f"{name} must be a koila_retry cache class: StacktraceMemoryBatchsizeCache (the default), "
        f"GlobalBatchsizeCache, NoBatchsizeCache, or another koila_retry.SizeCache subclass such as "
        f"koila_retry.StackMemoryCache; got {cache_type!r}{hint}"
    )


def _context_key(context: object, name: str) -> Hashable:
    """Return the registry's name for a context given by the caller."""
    if isinstance(context, (types.FunctionType, types.MethodType, functools.partial)):
        return function_identity(context)  # not the function itself: the registry would keep it alive
    try:
        hash(context)
    except TypeError:
        raise TypeError(
            f"{name} must be hashable (it names a cache), got {type(context).__name__} {context!r}"
        ) from None
    return context


def _stack(frame: FrameType | None) -> tuple[tuple[str, int, str], ...]:
    """Return the file, line and function of ``frame`` and every frame that called it."""
    frames = []
    while frame is not None:
        code = frame.f_code
        frames.append((code.co_filename, frame.f_lineno, code.co_name))
        frame = frame.f_back
    return tuple(frames)


def _size(value: object, name: str, missing: str | None = None) -> int:
    """Check a size given as ``name``; ``missing`` says where a size could have come from."""
    if value is None:
        raise TypeError(f"no initial size was given: pass {missing or name}")
    size = _bound(value, name)
    if size < 1:
        raise ValueError(f"{name} must be >= 1, got {size}")
    return size


def _bound(value: object, name: str) -> int:
    if type(value) is int:
        return value
    # Another integer, such as numpy.int64, is one; a bool is more likely a mistake.
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return operator.index(cast(SupportsIndex, value))


def _dimension(tensor: object, dimension: object, name: str) -> tuple[torch.Tensor, int]:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"the tensor to chunk must be a torch.Tensor, got {type(tensor).__name__}")
    dim = _bound(dimension, name)
    ndim = tensor.dim()
    if not -ndim <= dim < ndim:
        allowed = f"[{-ndim}, {ndim - 1}]" if ndim else "none, the tensor is 0-dimensional"
        shape = tuple(tensor.shape)
        raise IndexError(f"{name} {dim} is out of range for a tensor of shape {shape}; allowed: {allowed}")
    return tensor, dim


def _name(func: object) -> str:
    name = getattr(func, "__qualname__", None)
    return name if isinstance(name, str) else type(func).__qualname__


def _ignore(begin: int, end: int, result: object) -> None:
    """Drop a range's result: toma's ranges return nothing."""


def _run_batch(
    func: Callable[..., R],
    size: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    cache_type: type[SizeCache] | None,
    context: Hashable,
    caller: FrameType | None,
) -> R:
    controller = _context_for(cache_type, context).controller(_name(func))
    work: Callable[[int], R] = lambda batch_size: func(batch_size, *args, **kwargs)  # noqa: E731
    return controller.call(context, caller, device_of(args, kwargs), work, (func, args, kwargs), rows=size)


def _run_steps(
    func: Callable[..., object],
    start: int,
    end: int,
    step: int,
    work: Callable[[int, int], object],
    roots: tuple[Any, ...],
    cache_type: type[SizeCache] | None,
    context: Hashable,
    caller: FrameType | None,
    device: torch.device,
    unit: tuple[str, str, str],
) -> None:
    controller = _context_for(cache_type, context).controller(_name(func))
    if end <= start:  # toma runs nothing, and so do we
        cover(controller, None, start, end, work, _ignore)
        return
    attempt = controller.start(Call(context, caller, device, rows=step, span=end - start, roots=roots))
    cover(controller, attempt, start, end, work, _ignore, unit=unit)


def _run_range(
    func: Callable[..., object],
    start: object,
    end: object,
    step: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    cache_type: type[SizeCache] | None,
    context: Hashable,
    caller: FrameType | None,
) -> None:
    begin, stop = _bound(start, "start"), _bound(end, "end")

    def work(first: int, last: int) -> object:
        return func(first, last, *args, **kwargs)

    _run_steps(
        func, begin, stop, step, work, (func, args, kwargs), cache_type, context, caller, default_device(), _INDICES
    )


def _run_chunked(
    func: Callable[..., object],
    tensor: torch.Tensor,
    dim: int,
    step: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    cache_type: type[SizeCache] | None,
    context: Hashable,
    caller: FrameType | None,
) -> None:
    def work(begin: int, end: int) -> object:
        return func(tensor.narrow(dim, begin, end - begin), begin, end, *args, **kwargs)

    roots = (func, tensor, args, kwargs)
    _run_steps(func, 0, tensor.size(dim), step, work, roots, cache_type, context, caller, tensor.device, _ROWS)


def _execute_context(cache_type: object, context: Hashable, caller: FrameType) -> Hashable:
    """Check a ``toma.execute`` form's cache type; return its context: given, else the caller's stack."""
    if cache_type is not None:
        _check_cache_type(cache_type, "cache_type")
    return _stack(caller) if context is None else _context_key(context, "context")


class _Decorator:
    """What a ``toma.batch``/``range``/``chunked`` decorator was given, checked once.

    ``size`` and ``option`` name the decorator's size and its per-call override
    (``initial_step`` and ``toma_initial_step``).
    """

    def __init__(self, front_end: str, size: object, option: str, cache_type: object, context: object) -> None:
        self.option, self.override = option, f"toma_{option}"
        self.missing = f"{option}= to toma.{front_end}, or {self.override}= to the call"
        self.size = None if size is None else _size(size, option)
        self.cache_type = None if cache_type is None else _check_cache_type(cache_type, "cache_type")
        self.context = None if context is None else _context_key(context, "context")

    def default_context(self, function: object) -> Hashable:
        """Return the context of calls that give none: the decorator's, else the function's."""
        return function_identity(function) if self.context is None else self.context

    def call(self, default: Hashable, size: object, context: Hashable) -> tuple[int, Hashable]:
        """Return a call's size and context, its own where it gave them, else the decorator's."""
        chosen = _size(self.size, self.option, self.missing) if size is None else _size(size, self.override)
        return chosen, default if context is None else _context_key(context, "toma_context")


class simple:
    """Retry without a cache: every call starts at the initial size it is given.

    .. versionadded:: 0.1.0
    """

    @staticmethod
    def batch(func: Callable[Concatenate[int, P], R], initial_batchsize: int, *args: Any, **kwargs: Any) -> R:
        """Call ``func(batchsize, *args, **kwargs)``, halving ``batchsize`` on out-of-memory errors.

        Args:
            func (callable): called with the batch size, then ``args`` and ``kwargs``.
            initial_batchsize (int): the first size to try.
            *args: passed on to ``func`` after the batch size.
            **kwargs: passed on to ``func``.

        Returns:
            object: what ``func`` returned.

        Raises:
            TypeError: if ``initial_batchsize`` is missing or not an int.
            ValueError: if ``initial_batchsize`` is below 1.
            BatchSizeExhausted: if size 1 runs out of memory too.

        .. versionadded:: 0.1.0
        """
        size = _size(initial_batchsize, "initial_batchsize")
        return _run_batch(func, size, args, kwargs, NoBatchsizeCache, function_identity(func), sys._getframe(1))

    @staticmethod
    def range(func: Callable[..., object], start: int, end: int, initial_step: int, *args: Any, **kwargs: Any) -> None:
        """Call ``func(begin, stop, *args, **kwargs)`` over consecutive ranges covering ``[start, end)``.

        A range that runs out of memory is run again, from its own ``begin``,
        with half the indices; finished ranges are not run again.

        Args:
            func (callable): called with each range's first index and one past its last.
            start (int): the first index.
            end (int): one past the last index; if not above ``start``, nothing runs.
            initial_step (int): the first range size to try.
            *args: passed on to ``func`` after the range.
            **kwargs: passed on to ``func``.

        Raises:
            TypeError: if ``initial_step`` is missing, or a bound or size is not an int.
            ValueError: if ``initial_step`` is below 1.
            BatchSizeExhausted: if a range of one index runs out of memory.

        .. versionadded:: 0.1.0
        """
        step = _size(initial_step, "initial_step")
        identity = function_identity(func)
        _run_range(func, start, end, step, args, kwargs, NoBatchsizeCache, identity, sys._getframe(1))

    @staticmethod
    def chunked(func: Callable[..., object], tensor: torch.Tensor, initial_step: int, dimension: int = 0) -> None:
        """Call ``func(chunk, begin, end)`` over consecutive chunks of ``tensor`` along ``dimension``.

        Args:
            func (callable): called with each chunk (a view, from
                ``tensor.narrow``) and the range of rows it covers.
            tensor (torch.Tensor): the tensor to chunk.
            initial_step (int): the first chunk size to try.
            dimension (int): the dimension to chunk along. Default: 0.

        Raises:
            TypeError: if ``tensor`` is not a tensor, or ``initial_step`` is
                missing or not an int.
            ValueError: if ``initial_step`` is below 1.
            IndexError: if ``dimension`` is out of range for ``tensor``.
            BatchSizeExhausted: if a chunk of one row runs out of memory.

        .. versionadded:: 0.1.0
        """
        step = _size(initial_step, "initial_step")
        tensor, dim = _dimension(tensor, dimension, "dimension")
        identity = function_identity(func)
        _run_chunked(func, tensor, dim, step, (), {}, NoBatchsizeCache, identity, sys._getframe(1))


class explicit:
    """Retry with a cache, given every setting in the call.

    .. versionadded:: 0.1.0
    """

    @staticmethod
    def batch(
        func: Callable[Concatenate[int, P], R],
        initial_batchsize: int,
        *args: Any,
        toma_context: Hashable = None,
        toma_cache_type: type[SizeCache] | None = None,
        **kwargs: Any,
    ) -> R:
        """Call ``func(batchsize, *args, **kwargs)``, halving ``batchsize`` on out-of-memory errors.

        The first size is the one the cache remembers for this call, if any
        (even above ``initial_batchsize``, as in toma), else ``initial_batchsize``.

        Args:
            func (callable): called with the batch size, then ``args`` and ``kwargs``.
            initial_batchsize (int): the first size to try when the cache knows none.
            *args: passed on to ``func`` after the batch size.
            toma_context (Hashable, optional): names the cache instance to use.
                Default: ``func``.
            toma_cache_type (type, optional): the cache type. Default:
                ``DEFAULT_CACHE_TYPE`` at the time of the call.
            **kwargs: passed on to ``func``.

        Returns:
            object: what ``func`` returned.

        Raises:
            TypeError: if ``initial_batchsize`` is missing or not an int,
                ``toma_context`` is not hashable, or ``toma_cache_type`` is
                not a koila_retry cache class.
            ValueError: if ``initial_batchsize`` is below 1.
            BatchSizeExhausted: if size 1 runs out of memory too.

        .. versionadded:: 0.1.0
        """
        size = _size(initial_batchsize, "initial_batchsize")
        context = function_identity(func) if toma_context is None else _context_key(toma_context, "toma_context")
        return _run_batch(func, size, args, kwargs, toma_cache_type, context, sys._getframe(1))

    @staticmethod
    def range(
        func: Callable[..., object],
        start: int,
        end: int,
        initial_step: int,
        *args: Any,
        toma_context: Hashable = None,
        toma_cache_type: type[SizeCache] | None = None,
        **kwargs: Any,
    ) -> None:
        """Call ``func(begin, stop, *args, **kwargs)`` over consecutive ranges covering ``[start, end)``.

        A range that runs out of memory is run again, from its own ``begin``,
        with half the indices; finished ranges are not run again. The first
        step is the one the cache remembers, if any, else ``initial_step``.

        Args:
            func (callable): called with each range's first index and one past its last.
            start (int): the first index.
            end (int): one past the last index; if not above ``start``, nothing runs.
            initial_step (int): the first range size to try when the cache knows none.
            *args: passed on to ``func`` after the range.
            toma_context (Hashable, optional): names the cache instance to use.
                Default: ``func``.
            toma_cache_type (type, optional): the cache type. Default:
                ``DEFAULT_CACHE_TYPE`` at the time of the call.
            **kwargs: passed on to ``func``.

        Raises:
            TypeError: if ``initial_step`` is missing, a bound or size is not
                an int, ``toma_context`` is not hashable, or
                ``toma_cache_type`` is not a koila_retry cache class.
            ValueError: if ``initial_step`` is below 1.
            BatchSizeExhausted: if a range of one index runs out of memory.

        .. versionadded:: 0.1.0
        """
        step = _size(initial_step, "initial_step")
        context = function_identity(func) if toma_context is None else _context_key(toma_context, "toma_context")
        _run_range(func, start, end, step, args, kwargs, toma_cache_type, context, sys._getframe(1))

    @staticmethod
    def chunked(
        func: Callable[..., object],
        tensor: torch.Tensor,
        initial_step: int,
        *args: Any,
        toma_dimension: int | None = None,
        toma_context: Hashable = None,
        toma_cache_type: type[SizeCache] | None = None,
        **kwargs: Any,
    ) -> None:
        """Call ``func(chunk, begin, end, *args, **kwargs)`` over consecutive chunks of ``tensor``.

        Args:
            func (callable): called with each chunk (a view, from
                ``tensor.narrow``), the range of rows it covers, then ``args``
                and ``kwargs``.
            tensor (torch.Tensor): the tensor to chunk.
            initial_step (int): the first chunk size to try when the cache knows none.
            *args: passed on to ``func`` after ``end``.
            toma_dimension (int, optional): the dimension to chunk along. Default: 0.
            toma_context (Hashable, optional): names the cache instance to use.
                Default: ``func``.
            toma_cache_type (type, optional): the cache type. Default:
                ``DEFAULT_CACHE_TYPE`` at the time of the call.
            **kwargs: passed on to ``func``.

        Raises:
            TypeError: if ``tensor`` is not a tensor, ``initial_step`` is
                missing or not an int, ``toma_context`` is not hashable, or
                ``toma_cache_type`` is not a koila_retry cache class.
            ValueError: if ``initial_step`` is below 1.
            IndexError: if ``toma_dimension`` is out of range for ``tensor``.
            BatchSizeExhausted: if a chunk of one row runs out of memory.

        .. versionadded:: 0.1.0
        """
        step = _size(initial_step, "initial_step")
        tensor, dim = _dimension(tensor, 0 if toma_dimension is None else toma_dimension, "toma_dimension")
        context = function_identity(func) if toma_context is None else _context_key(toma_context, "toma_context")
        _run_chunked(func, tensor, dim, step, args, kwargs, toma_cache_type, context, sys._getframe(1))


class _Namespace(type):
    """Make ``toma.DEFAULT_CACHE_TYPE`` the module's ``DEFAULT_CACHE_TYPE``, read and written."""

    @property
    def DEFAULT_CACHE_TYPE(cls) -> type[SizeCache]:
        return DEFAULT_CACHE_TYPE

    @DEFAULT_CACHE_TYPE.setter
    def DEFAULT_CACHE_TYPE(cls, value: type[SizeCache]) -> None:
        global DEFAULT_CACHE_TYPE
        DEFAULT_CACHE_TYPE = _check_cache_type(value, "DEFAULT_CACHE_TYPE")

    @DEFAULT_CACHE_TYPE.deleter
    def DEFAULT_CACHE_TYPE(cls) -> None:
        # Restores toma's default: what undoing a patch of the attribute (which was not in
        # the class's own __dict__) means, for pytest's monkeypatch and unittest.mock.
        global DEFAULT_CACHE_TYPE
        DEFAULT_CACHE_TYPE = StacktraceMemoryBatchsizeCache


class toma(metaclass=_Namespace):
    """Decorators that retry a function with smaller sizes when it runs out of memory.

    Also here, as toma's README has them: ``toma.explicit``, the cache types,
    and ``toma.DEFAULT_CACHE_TYPE`` (the same value as the module's, read when
    a call runs: setting either changes the default of later calls; deleting
    ``toma.DEFAULT_CACHE_TYPE`` restores :class:`StacktraceMemoryBatchsizeCache`).

    .. versionadded:: 0.1.0
    """

    explicit = explicit
    GlobalBatchsizeCache = GlobalBatchsizeCache
    NoBatchsizeCache = NoBatchsizeCache
    StacktraceMemoryBatchsizeCache = StacktraceMemoryBatchsizeCache

    @overload
    @staticmethod
    def batch(
        func: Callable[Concatenate[int, P], R],
        *,
        initial_batchsize: int | None = ...,
        cache_type: type[SizeCache] | None = ...,
        context: Hashable = ...,
    ) -> Callable[..., R]: ...

    @overload
    @staticmethod
    def batch(
        func: None = ...,
        *,
        initial_batchsize: int | None = ...,
        cache_type: type[SizeCache] | None = ...,
        context: Hashable = ...,
    ) -> Callable[[Callable[Concatenate[int, P], R]], Callable[..., R]]: ...

    @staticmethod
    def batch(
        func: Callable[..., Any] | None = None,
        *,
        initial_batchsize: int | None = None,
        cache_type: type[SizeCache] | None = None,
        context: Hashable = None,
    ) -> Any:
        """Make ``func(batchsize, ...)`` callable as ``func(...)``, with the largest batch size that fits.

        Each call starts at the size the cache remembers for it, else at the
        initial size, and halves it after each out-of-memory error. Use it
        bare (``@toma.batch``, then every call passes
        ``toma_initial_batchsize``) or called.

        The wrapper takes ``(*args, toma_initial_batchsize=None,
        toma_context=None, **kwargs)``: those two override ``initial_batchsize``
        and ``context`` for one call, and the rest go to ``func`` after the
        batch size.

        Args:
            func (callable): the function, when used bare.
            initial_batchsize (int, optional): the first size to try when the
                cache knows none.
            cache_type (type, optional): the cache type. Default:
                ``DEFAULT_CACHE_TYPE`` at the time of each call.
            context (Hashable, optional): names the cache instance to use.
                Default: ``func``.

        Returns:
            callable: the wrapped function, or a decorator when ``func`` is not given.

        Raises:
            TypeError: if an option has the wrong type, or ``context`` is not
                hashable; when called, if no initial size was given.
            ValueError: if an initial size is below 1.
            BatchSizeExhausted: when called, if size 1 runs out of memory too.

        .. versionadded:: 0.1.0
        """
        options = _Decorator("batch", initial_batchsize, "initial_batchsize", cache_type, context)
        if func is None:
            return functools.partial(
                toma.batch, initial_batchsize=initial_batchsize, cache_type=cache_type, context=context
            )
        function: Callable[..., Any] = func
        default, getframe = options.default_context(function), sys._getframe

        @functools.wraps(function)
        def wrapper(
            *args: Any, toma_initial_batchsize: int | None = None, toma_context: Hashable = None, **kwargs: Any
        ) -> Any:
            size, where = options.call(default, toma_initial_batchsize, toma_context)
            return _run_batch(function, size, args, kwargs, options.cache_type, where, getframe(1))

        return wrapper

    @overload
    @staticmethod
    def range(
        func: Callable[..., object],
        *,
        initial_step: int | None = ...,
        cache_type: type[SizeCache] | None = ...,
        context: Hashable = ...,
    ) -> Callable[..., None]: ...

    @overload
    @staticmethod
    def range(
        func: None = ...,
        *,
        initial_step: int | None = ...,
        cache_type: type[SizeCache] | None = ...,
        context: Hashable = ...,
    ) -> Callable[[Callable[..., object]], Callable[..., None]]: ...

    @staticmethod
    def range(
        func: Callable[..., object] | None = None,
        *,
        initial_step: int | None = None,
        cache_type: type[SizeCache] | None = None,
        context: Hashable = None,
    ) -> Any:
        """Make ``func(begin, stop, ...)`` run over consecutive ranges when called as ``func(start, end, ...)``.

        A range that runs out of memory is run again, from its own ``begin``,
        with half the indices; finished ranges are not run again. The first
        step is the one the cache remembers, else the initial step.

        The wrapper takes ``(start, end, *args, toma_initial_step=None,
        toma_context=None, **kwargs)`` and returns ``None``; ``end <= start``
        runs nothing.

        Args:
            func (callable): the function, when used bare.
            initial_step (int, optional): the first range size to try when the
                cache knows none.
            cache_type (type, optional): the cache type. Default:
                ``DEFAULT_CACHE_TYPE`` at the time of each call.
            context (Hashable, optional): names the cache instance to use.
                Default: ``func``.

        Returns:
            callable: the wrapped function, or a decorator when ``func`` is not given.

        Raises:
            TypeError: if an option has the wrong type, or ``context`` is not
                hashable; when called, if no initial step was given.
            ValueError: if an initial step is below 1.
            BatchSizeExhausted: when called, if a range of one index runs out of memory.

        .. versionadded:: 0.1.0
        """
        options = _Decorator("range", initial_step, "initial_step", cache_type, context)
        if func is None:
            return functools.partial(toma.range, initial_step=initial_step, cache_type=cache_type, context=context)
        function: Callable[..., object] = func
        default, getframe = options.default_context(function), sys._getframe

        @functools.wraps(function)
        def wrapper(
            start: int,
            end: int,
            *args: Any,
            toma_initial_step: int | None = None,
            toma_context: Hashable = None,
            **kwargs: Any,
        ) -> None:
            step, where = options.call(default, toma_initial_step, toma_context)
            _run_range(function, start, end, step, args, kwargs, options.cache_type, where, getframe(1))

        return wrapper

    @overload
    @staticmethod
    def chunked(
        func: Callable[..., object],
        *,
        initial_step: int | None = ...,
        dimension: int | None = ...,
        cache_type: type[SizeCache] | None = ...,
        context: Hashable = ...,
    ) -> Callable[..., None]: ...

    @overload
    @staticmethod
    def chunked(
        func: None = ...,
        *,
        initial_step: int | None = ...,
        dimension: int | None = ...,
        cache_type: type[SizeCache] | None = ...,
        context: Hashable = ...,
    ) -> Callable[[Callable[..., object]], Callable[..., None]]: ...

    @staticmethod
    def chunked(
        func: Callable[..., object] | None = None,
        *,
        initial_step: int | None = None,
        dimension: int | None = None,
        cache_type: type[SizeCache] | None = None,
        context: Hashable = None,
    ) -> Any:
        """Make ``func(chunk, begin, end, ...)`` run over the chunks of a tensor when called as ``func(tensor, ...)``.

        A chunk that runs out of memory is run again, from its own first row,
        with half the rows; finished chunks are not run again. The first step
        is the one the cache remembers, else the initial step.

        The wrapper takes ``(tensor, *args, toma_initial_step=None,
        toma_dimension=None, toma_context=None, **kwargs)`` and returns
        ``None``; ``func`` gets ``tensor.narrow(dimension, begin, end - begin)``,
        ``begin``, ``end``, then ``args`` and ``kwargs``.

        Args:
            func (callable): the function, when used bare.
            initial_step (int, optional): the first chunk size to try when the
                cache knows none.
            dimension (int, optional): the dimension to chunk along. Default: 0.
            cache_type (type, optional): the cache type. Default:
                ``DEFAULT_CACHE_TYPE`` at the time of each call.
            context (Hashable, optional): names the cache instance to use.
                Default: ``func``.

        Returns:
            callable: the wrapped function, or a decorator when ``func`` is not given.

        Raises:
            TypeError: if an option has the wrong type, or ``context`` is not
                hashable; when called, if no initial step was given or the
                first argument is not a tensor.
            ValueError: if an initial step is below 1.
            IndexError: when called, if the dimension is out of range for the tensor.
            BatchSizeExhausted: when called, if a chunk of one row runs out of memory.

        .. versionadded:: 0.1.0
        """
        options = _Decorator("chunked", initial_step, "initial_step", cache_type, context)
        if dimension is not None:
            _bound(dimension, "dimension")
        if func is None:
            return functools.partial(
                toma.chunked, initial_step=initial_step, dimension=dimension, cache_type=cache_type, context=context
            )
        function: Callable[..., object] = func
        default, getframe = options.default_context(function), sys._getframe

        @functools.wraps(function)
        def wrapper(
            tensor: torch.Tensor,
            *args: Any,
            toma_initial_step: int | None = None,
            toma_dimension: int | None = None,
            toma_context: Hashable = None,
            **kwargs: Any,
        ) -> None:
            step, where = options.call(default, toma_initial_step, toma_context)
            if toma_dimension is not None:
                chunks, dim = _dimension(tensor, toma_dimension, "toma_dimension")
            else:
                chunks, dim = _dimension(tensor, 0 if dimension is None else dimension, "dimension")
            _run_chunked(function, chunks, dim, step, args, kwargs, options.cache_type, where, getframe(1))

        return wrapper

    class execute:
        """Decorators that run the decorated function at once, and bind its name to the result.

        Without a ``context``, each cache instance belongs to the call stack of
        the code that calls ``toma.execute.*``.

        .. versionadded:: 0.1.0
        """

        @staticmethod
        def batch(
            initial_batchsize: int, cache_type: type[SizeCache] | None = None, context: Hashable = None
        ) -> Callable[[Callable[[int], R]], R]:
            """Return a decorator that calls ``func(batchsize)`` at once, like ``explicit.batch``.

            Args:
                initial_batchsize (int): the first size to try when the cache knows none.
                cache_type (type, optional): the cache type. Default:
                    ``DEFAULT_CACHE_TYPE`` at the time of the call.
                context (Hashable, optional): names the cache instance to
                    use. Default: the caller's call stack.

            Returns:
                callable: a decorator that runs the function and returns its result.

            Raises:
                TypeError: if ``initial_batchsize`` is missing or not an int,
                    or ``context`` is not hashable.
                ValueError: if ``initial_batchsize`` is below 1.

            .. versionadded:: 0.1.0
            """
            size = _size(initial_batchsize, "initial_batchsize")
            where = _execute_context(cache_type, context, sys._getframe(1))

            def run(func: Callable[[int], R]) -> R:
                return _run_batch(func, size, (), {}, cache_type, where, sys._getframe(1))

            return run

        @staticmethod
        def range(
            start: int,
            end: int,
            initial_step: int,
            cache_type: type[SizeCache] | None = None,
            context: Hashable = None,
        ) -> Callable[[Callable[[int, int], object]], None]:
            """Return a decorator that runs ``func(begin, stop)`` over ``[start, end)`` at once (``explicit.range``).

            Args:
                start (int): the first index.
                end (int): one past the last index; if not above ``start``, nothing runs.
                initial_step (int): the first range size to try when the cache knows none.
                cache_type (type, optional): the cache type. Default:
                    ``DEFAULT_CACHE_TYPE`` at the time of the call.
                context (Hashable, optional): names the cache instance to
                    use. Default: the caller's call stack.

            Returns:
                callable: a decorator that runs the function and returns ``None``.

            Raises:
                TypeError: if ``initial_step`` is missing, a bound or size is
                    not an int, or ``context`` is not hashable.
                ValueError: if ``initial_step`` is below 1.

            .. versionadded:: 0.1.0
            """
            step = _size(initial_step, "initial_step")
            begin, stop = _bound(start, "start"), _bound(end, "end")
            where = _execute_context(cache_type, context, sys._getframe(1))

            def run(func: Callable[[int, int], object]) -> None:
                _run_range(func, begin, stop, step, (), {}, cache_type, where, sys._getframe(1))

            return run

        @staticmethod
        def chunked(
            tensor: torch.Tensor,
            initial_step: int | None = None,
            dimension: int | None = None,
            cache_type: type[SizeCache] | None = None,
            context: Hashable = None,
        ) -> Callable[[Callable[[torch.Tensor, int, int], object]], None]:
            """Return a decorator that runs ``func(chunk, begin, end)`` at once (``explicit.chunked``).

            Args:
                tensor (torch.Tensor): the tensor to chunk.
                initial_step (int): the first chunk size to try when the cache
                    knows none; required, although toma's signature lets it be omitted.
                dimension (int, optional): the dimension to chunk along. Default: 0.
                cache_type (type, optional): the cache type. Default:
                    ``DEFAULT_CACHE_TYPE`` at the time of the call.
                context (Hashable, optional): names the cache instance to
                    use. Default: the caller's call stack.

            Returns:
                callable: a decorator that runs the function and returns ``None``.

            Raises:
                TypeError: if ``tensor`` is not a tensor, ``initial_step`` is
                    missing or not an int, or ``context`` is not hashable.
                ValueError: if ``initial_step`` is below 1.
                IndexError: if ``dimension`` is out of range for ``tensor``.

            .. versionadded:: 0.1.0
            """
            step = _size(initial_step, "initial_step")
            chunks, dim = _dimension(tensor, 0 if dimension is None else dimension, "dimension")
            where = _execute_context(cache_type, context, sys._getframe(1))

            def run(func: Callable[[torch.Tensor, int, int], object]) -> None:
                _run_chunked(func, chunks, dim, step, (), {}, cache_type, where, sys._getframe(1))

            return run
