"""A drop-in stand-in for toma 1.1.0, on koila-retry's engine.

Import ``toma``, ``explicit`` and ``simple`` from here instead of from toma
(which need not be installed), and the code runs as before: the same forms and
``toma_*`` keywords, the same schedule (the size that failed is halved, ``100 →
50 → 25 → 12 → 6 → 3 → 1``; a range or chunk that fails runs again from its own
start, and finished ones never do), and caches that start later calls at the
last size that worked. Each cache type (:class:`StacktraceMemoryBatchsizeCache`, the
default, or another :class:`koila_retry.SizeCache` class) has one instance per
*context*: the decorated function, or for ``toma.execute`` the caller's call
stack, unless a ``context`` is given; the ``2**14`` most recently used are kept.

Every form raises ``TypeError`` for an argument of the wrong type (a missing
initial size, an unhashable context and a cache type that is not a koila_retry
cache class included), ``ValueError`` for an initial size below 1,
``IndexError`` for a dimension out of range, and
:class:`~koila_retry.BatchSizeExhausted` when size 1 runs out of memory too.
Decorators check their own options when they decorate, and a call's when it runs.

Example::

    >>> import torch
    >>> from koila_retry.compat.toma import toma
    >>> @toma.batch(initial_batchsize=100)
    ... def total(batchsize, data):
    ...     if batchsize > 30:  # stands in for a real out-of-memory error
    ...         raise torch.OutOfMemoryError(
    ...             "CUDA out of memory. Tried to allocate 2.00 GiB"
    ...         )
    ...     return sum(chunk.sum() for chunk in data.split(batchsize))
    >>> total(torch.ones(100))
    tensor(100.)

The differences from toma, each with its reason, are in :ref:`differences-from-toma`.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import threading
import traceback
import types
import weakref
from collections.abc import Callable, Hashable, Mapping
from typing import Any, Concatenate, NamedTuple, ParamSpec, TypedDict, TypeVar, cast, overload

import cachetools
import torch

from koila_retry._common.forks import locks_renewed_in_child
from koila_retry._common.places import is_ours
from koila_retry._core import distributed
from koila_retry._core.cache import SizeCache, function_identity
from koila_retry._core.detect import MEMORY_SHORT_MESSAGES, OOM_MESSAGES, is_oom
from koila_retry._core.engine import ROWS, Call, Controller, cover
from koila_retry._core.memory import default_device
from koila_retry._core.policy import scaled
from koila_retry._core.ranks import Found
from koila_retry._core.sharded import fsdp_modules
from koila_retry._diagnostics import exhausted
from koila_retry._frontends.batch import device_of
from koila_retry.compat._adapter import Option, Table, integer
from koila_retry.compat.toma.batchsize_cache import (
    GlobalBatchsizeCache,
    NoBatchsizeCache,
    StacktraceMemoryBatchsizeCache,
)
from koila_retry.exceptions import BatchSizeExhausted

# At run time too: typing.get_type_hints() reads the options' annotations.
if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # the backport torch depends on
    from typing_extensions import Unpack

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

#: A ``cache_type``: a koila_retry cache class, of which each context gets an instance.
CacheType = type[SizeCache]

#: The cache type of calls that name none; read when each call runs.
DEFAULT_CACHE_TYPE: CacheType = StacktraceMemoryBatchsizeCache

#: Whether an exception means "out of memory"; toma's name for :func:`koila_retry.is_oom`.
should_reduce_batch_size = is_oom

CONTEXT_CACHE_SIZE = 2**14

_INDICES = ("index", "indices", "range")
_NOTHING: dict[str, Any] = {}  # the keyword arguments of a call that has none


def _cache_type(value: object, name: str) -> CacheType:
    if isinstance(value, type) and issubclass(value, SizeCache) and not inspect.isabstract(value):
        return value
    if isinstance(value, SizeCache):
        hint = "; pass the class, not an instance"
    elif getattr(value, "__module__", "").split(".")[0] == "toma":
        hint = "; toma's own cache classes do not work here, use the ones of koila_retry.compat.toma"
    else:
        hint = ""
    raise TypeError(
        f"{name} must be a koila_retry cache class: StacktraceMemoryBatchsizeCache (the default), "
        f"GlobalBatchsizeCache, NoBatchsizeCache, or another koila_retry.SizeCache subclass such as "
        f"koila_retry.StackMemoryCache; got {value!r}{hint}"
    )


def _context(value: object, name: str) -> Hashable:
    if isinstance(value, (types.FunctionType, types.MethodType, functools.partial)):
        return function_identity(value)  # not the function itself: the registry would keep it alive
    try:
        hash(value)
    except TypeError:
        raise TypeError(f"{name} must be hashable (it names a cache), got {type(value).__name__} {value!r}") from None
    return value


#: toma's options (each also per call, as ``toma_<name>``) and what they become.
TABLE = Table(
    "toma",
    {
        prefix + name: option
        for prefix in ("", "toma_")
        for name, option in {
            "initial_batchsize": Option("initial", integer(1)),  # None: the call gives it
            "initial_step": Option("initial", integer(1)),
            "cache_type": Option("cache_type", _cache_type),  # None: DEFAULT_CACHE_TYPE when the call runs
            "context": Option("context", _context),  # None: the function, or the stack of execute's caller
            "dimension": Option("dimension", integer(), 0),
        }.items()
    },
    # toma halves the size that failed; its caches keep every success (the controller's keep_last).
    fixed={"schedule": lambda: scaled(0.5)},
)
_POLICY = TABLE.policy(TABLE.read({}), rows=True)
# toma's calls run on each rank alone (evaluation on rank 0 only, shards of their own sizes): they
# agree only where a rank retrying alone would hang the others, a call reaching a DDP or FSDP2 module.
_ALONE = dataclasses.replace(_POLICY, sync=False)
_KEPT_FUNCTIONS = 64
_index = integer()


#: Where a call's sizes are kept: its cache type (``None``: the default when it runs) and context.
_Where = tuple[CacheType | None, Hashable]


class _Context(NamedTuple):
    """One cache instance, and a controller per function name that uses it, and whether its ranks agree."""

    cache: SizeCache
    controllers: dict[tuple[str, bool], Controller]
    # Whether a function's calls reach a DDP or FSDP2 module, under a process group (by id of the function).
    parallel: dict[int, tuple[weakref.ref[Any], Found[bool]]]


_contexts: cachetools.LRUCache[tuple[CacheType, Hashable], _Context] = cachetools.LRUCache(CONTEXT_CACHE_SIZE)
_contexts_lock = threading.Lock()
locks_renewed_in_child(globals(), "_contexts_lock")  # a fork while another thread held it


def _reset() -> None:
    """Forget every context and its cache (for tests)."""
    with _contexts_lock:
        _contexts.clear()


def _context_for(where: _Where) -> _Context:
    key = (DEFAULT_CACHE_TYPE if where[0] is None else where[0], where[1])
    with _contexts_lock:
        try:
            entry = _contexts.get(key)
        except TypeError:  # an unhashable cache_type: the check below names it
            entry = None
        if entry is None:  # a type in the registry was checked when it got there
            entry = _contexts[key] = _Context(TABLE.convert("cache_type", key[0])(), {}, {})
    return entry


def _run(
    func: Callable[..., Any],
    size: int,
    where: _Where,
    caller: types.FrameType | None,
    args: Any = (),
    kwargs: Any = _NOTHING,
    span: range | None = None,
    tensor: torch.Tensor | None = None,
    dim: int = 0,
) -> Any:
    """Run a call in the engine, the stand-in's one use of it: a batch, or a range or a tensor's chunks in steps."""
    entry = _context_for(where)
    name = getattr(func, "__qualname__", None)
    name = name if isinstance(name, str) else type(func).__qualname__
    roots: tuple[Any, ...] = (func, args, kwargs) if tensor is None else (func, tensor, args, kwargs)
    agrees = distributed.is_running() and _reaches_parallel(entry, func, roots)
    controller = entry.controllers.get((name, agrees))
    if controller is None:  # two threads may both make one: either serves
        policy = _POLICY if agrees else _ALONE
        controller = Controller(name, policy, default_cache=entry.cache, explain=exhausted.message, keep_last=True)
        entry.controllers[name, agrees] = controller
    try:
        if tensor is not None:
            span, device, unit = range(tensor.size(dim)), tensor.device, ROWS
            work = lambda begin, end: func(tensor.narrow(dim, begin, end - begin), begin, end, *args, **kwargs)  # noqa: E731
        elif span is not None:
            device, unit = default_device(), _INDICES
            work = lambda begin, end: func(begin, end, *args, **kwargs)  # noqa: E731
        else:
            batch = lambda batch_size: func(batch_size, *args, **kwargs)  # noqa: E731
            return controller.call(where[1], caller, device_of(args, kwargs), batch, roots, rows=size)
        # An empty range runs nothing, as in toma; toma's ranges and chunks return nothing.
        attempt = (
            controller.start(Call(where[1], caller, device, rows=size, span=len(span), roots=roots)) if span else None
        )
        return cover(controller, attempt, span.start, span.stop, work, lambda *_: None, unit=unit)
    except BatchSizeExhausted as exc:
        _backend_text_first(exc)
        raise


def _backend_text_first(exc: BatchSizeExhausted) -> None:
    """Begin the message with the last error's line that says it ran out of memory: toma re-raises that error."""
    cause = exc.__cause__
    text = str(cause.args[0]) if cause is not None and cause.args else ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    # Its first line, unless a later one says it (a DataParallel replica's or a worker's re-raised error).
    said = OOM_MESSAGES + MEMORY_SHORT_MESSAGES  # what toma's and Lightning's checks look for is among them
    first = next((line for line in lines if any(words in line for words in said)), lines[0] if lines else "")
    if first and exc.args and isinstance(exc.args[0], str) and not exc.args[0].startswith(first):
        exc.args = (f"{first}\n{exc.args[0]}",)


def _reaches_parallel(entry: _Context, func: Callable[..., Any], roots: tuple[Any, ...]) -> bool:
    """Return whether a call reaches a DDP or FSDP2 module, looked at again for another function or given modules."""

    def look() -> bool:
        return bool(distributed.ddp_modules(roots) or fsdp_modules(distributed.modules_of(roots)))

    # By the function object, not its code: each closure a helper makes may hold another model.
    target = getattr(func, "__func__", func)  # a bound method's instance is among what the call is given
    try:
        ref = weakref.ref(target)
    except TypeError:
        return look()  # nothing to know it by: looked at on every call
    kept = entry.parallel.get(id(target))
    if kept is None or kept[0]() is not target:
        if len(entry.parallel) >= _KEPT_FUNCTIONS:  # closures made per call: the dead go
            for key in [key for key, (each, _) in list(entry.parallel.items()) if each() is None]:
                entry.parallel.pop(key, None)  # another thread's prune may have taken it
        kept = entry.parallel[id(target)] = (ref, Found(getattr(target, "__code__", None)))
    return kept[1].get(roots, look)


def _size(value: object, name: str, missing: str | None = None) -> int:
    """Check a size given as ``name``; ``missing`` says where a size could have come from."""
    size: int | None = TABLE.convert(name, value)
    if size is None:
        raise TypeError(f"no initial size was given: pass {missing or name}")
    return size


def _span(start: object, end: object) -> range:
    return range(_index(start, "start"), _index(end, "end"))


def _dimension(tensor: object, dimension: object, name: str) -> tuple[torch.Tensor, int]:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"the tensor to chunk must be a torch.Tensor, got {type(tensor).__name__}")
    dim, ndim = _index(dimension, name), tensor.dim()
    if not -ndim <= dim < ndim:
        allowed = f"[{-ndim}, {ndim - 1}]" if ndim else "none, the tensor is 0-dimensional"
        raise IndexError(
            f"{name} {dim} is out of range for a tensor of shape {tuple(tensor.shape)}; allowed: {allowed}"
        )
    return tensor, dim


def _called(func: object, cache_type: CacheType | None, context: object) -> _Where:
    """Return where an ``explicit`` or ``simple`` call keeps its sizes: its ``toma_context``, else ``func``."""
    return (cache_type, function_identity(func) if context is None else _context(context, "toma_context"))


def _executed(cache_type: object, context: object, caller: types.FrameType | None) -> _Where:
    """Return where a ``toma.execute`` form keeps its sizes: its ``context``, else its caller's stack."""
    kind: CacheType | None = TABLE.convert("cache_type", cache_type)
    if context is not None:
        return (kind, _context(context, "context"))
    # Not this library's frames, which differ between a call that found its size and one that did not.
    stack = traceback.walk_stack(caller)
    return (
        kind,
        tuple((f.f_code.co_filename, line, f.f_code.co_name) for f, line in stack if not is_ours(f.f_code.co_filename)),
    )


class _Options(TypedDict, total=False):  # the options of toma's decorators, for the overloads
    cache_type: CacheType | None
    context: Hashable


class _BatchOptions(_Options, total=False):
    initial_batchsize: int | None


class _StepOptions(_Options, total=False):
    initial_step: int | None


class _ChunkOptions(_StepOptions, total=False):
    dimension: int | None


_Step = Callable[..., object]  # what toma.range and toma.chunked decorate
_Stepped = Callable[..., None]  # and what they make of it


class _Decorator:
    """A ``toma.batch``, ``range`` or ``chunked`` decorator: its options, read once through the table."""

    def __init__(self, front_end: str, options: Mapping[str, object], names: type) -> None:
        unknown = [name for name in options if name not in names.__annotations__]
        if unknown:
            raise TypeError(f"toma.{front_end}() got an unexpected keyword argument {unknown[0]!r}")
        self.front_end = front_end
        self.option = "initial_batchsize" if front_end == "batch" else "initial_step"
        self.missing = f"{self.option}= to toma.{front_end}, or toma_{self.option}= to the call"
        settings = TABLE.read(options)
        self.size: int | None = settings.get("initial")
        self.cache_type: CacheType | None = settings.get("cache_type")
        self.context: Hashable = settings.get("context")
        self.dimension: int = settings.get("dimension", 0)

    def __call__(self, func: Callable[..., Any] | None) -> Any:
        """Return ``func`` wrapped or, when it is ``None``, the decorator that wraps."""
        if func is not None and not callable(func):  # @toma.batch(64): the size given where func goes
            hint = f": pass the size as {self.option}={func!r}" if isinstance(func, int) else ""
            raise TypeError(f"toma.{self.front_end} wraps a callable, got {type(func).__name__} {func!r}{hint}")
        return self.wrap if func is None else self.wrap(func)

    def call(self, default: Hashable, kwargs: dict[str, Any]) -> tuple[int, _Where]:
        """Take a call's own size and context out of ``kwargs``; return them, else the decorator's."""
        size, context = kwargs.pop(f"toma_{self.option}", None), kwargs.pop("toma_context", None)
        chosen = _size(self.size, self.option, self.missing) if size is None else _size(size, f"toma_{self.option}")
        return chosen, (self.cache_type, default if context is None else _context(context, "toma_context"))

    def wrap(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """Return the wrapper of ``function`` that the decorator's form calls it through."""
        default = function_identity(function) if self.context is None else self.context
        call, dimension, getframe = self.call, self.dimension, sys._getframe

        def batched(*args: Any, **kwargs: Any) -> Any:
            size, where = call(default, kwargs)
            return _run(function, size, where, getframe(1), args, kwargs)

        def ranged(start: int, end: int, *args: Any, **kwargs: Any) -> None:
            step, where = call(default, kwargs)
            _run(function, step, where, getframe(1), args, kwargs, _span(start, end))

        def chunked(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            step, where = call(default, kwargs)
            if (own := kwargs.pop("toma_dimension", None)) is None:
                chunks, dim = _dimension(tensor, dimension, "dimension")
            else:
                chunks, dim = _dimension(tensor, own, "toma_dimension")
            _run(function, step, where, getframe(1), args, kwargs, tensor=chunks, dim=dim)

        wrappers: dict[str, Callable[..., Any]] = {"batch": batched, "range": ranged, "chunked": chunked}
        return functools.wraps(function)(wrappers[self.front_end])


class explicit:
    """Retry with a cache, given every setting in the call.

    A call starts at the size its cache remembers, if any (even above the
    initial size, as in toma), else at the initial size. Besides the arguments
    below, each form takes ``toma_context`` (Hashable), which names the cache
    instance (default: ``func``), and ``toma_cache_type`` (type; default:
    ``DEFAULT_CACHE_TYPE`` when the call runs); the rest go on to ``func``.

    .. versionadded:: 0.1.0
    """

    @staticmethod
    def batch(
        func: Callable[Concatenate[int, P], R],
        initial_batchsize: int,
        *args: Any,
        toma_context: Hashable = None,
        toma_cache_type: CacheType | None = None,
        **kwargs: Any,
    ) -> R:
        """Call ``func(batchsize, *args, **kwargs)``, halving ``batchsize`` on out-of-memory errors.

        Args:
            func (callable): takes the batch size, then ``args`` and ``kwargs``.
            initial_batchsize (int): the first size to try when the cache knows none.

        Returns:
            object: what ``func`` returned.
        """
        size = _size(initial_batchsize, "initial_batchsize")
        return cast(R, _run(func, size, _called(func, toma_cache_type, toma_context), sys._getframe(1), args, kwargs))

    @staticmethod
    def range(
        func: Callable[..., object],
        start: int,
        end: int,
        initial_step: int,
        *args: Any,
        toma_context: Hashable = None,
        toma_cache_type: CacheType | None = None,
        **kwargs: Any,
    ) -> None:
        """Call ``func(begin, stop, *args, **kwargs)`` over consecutive ranges covering ``[start, end)``.

        Args:
            func (callable): takes a range's first index and one past its last, then ``args`` and ``kwargs``.
            start (int): the first index.
            end (int): one past the last index; if not above ``start``, nothing runs.
            initial_step (int): the first range size to try when the cache knows none.
        """
        step, where = _size(initial_step, "initial_step"), _called(func, toma_cache_type, toma_context)
        _run(func, step, where, sys._getframe(1), args, kwargs, _span(start, end))

    @staticmethod
    def chunked(
        func: Callable[..., object],
        tensor: torch.Tensor,
        initial_step: int,
        *args: Any,
        toma_dimension: int | None = None,
        toma_context: Hashable = None,
        toma_cache_type: CacheType | None = None,
        **kwargs: Any,
    ) -> None:
        """Call ``func(chunk, begin, end, *args, **kwargs)`` over consecutive chunks of ``tensor``.

        Args:
            func (callable): takes a chunk (a view, ``tensor.narrow``), its range of rows, ``args`` and ``kwargs``.
            tensor (torch.Tensor): the tensor to chunk.
            initial_step (int): the first chunk size to try when the cache knows none.
            toma_dimension (int, optional): the dimension to chunk along. Default: 0.
        """
        step = _size(initial_step, "initial_step")
        tensor, dim = _dimension(tensor, 0 if toma_dimension is None else toma_dimension, "toma_dimension")
        where = _called(func, toma_cache_type, toma_context)
        _run(func, step, where, sys._getframe(1), args, kwargs, tensor=tensor, dim=dim)


class simple:
    """Retry without a cache: as :class:`explicit` does, but every keyword argument goes on to ``func``.

    .. versionadded:: 0.1.0
    """

    @staticmethod
    def batch(func: Callable[Concatenate[int, P], R], initial_batchsize: int, *args: Any, **kwargs: Any) -> R:
        """Call ``func(batchsize, *args, **kwargs)``, halving ``batchsize`` on out-of-memory errors."""
        size = _size(initial_batchsize, "initial_batchsize")
        return cast(R, _run(func, size, _called(func, NoBatchsizeCache, None), sys._getframe(1), args, kwargs))

    @staticmethod
    def range(func: Callable[..., object], start: int, end: int, initial_step: int, *args: Any, **kwargs: Any) -> None:
        """Call ``func(begin, stop, *args, **kwargs)`` over consecutive ranges covering ``[start, end)``."""
        where = _called(func, NoBatchsizeCache, None)
        _run(func, _size(initial_step, "initial_step"), where, sys._getframe(1), args, kwargs, _span(start, end))

    @staticmethod
    def chunked(func: Callable[..., object], tensor: torch.Tensor, initial_step: int, dimension: int = 0) -> None:
        """Call ``func(chunk, begin, end)`` over consecutive chunks of ``tensor`` along ``dimension`` (int)."""
        step = _size(initial_step, "initial_step")
        tensor, dim = _dimension(tensor, dimension, "dimension")
        _run(func, step, _called(func, NoBatchsizeCache, None), sys._getframe(1), tensor=tensor, dim=dim)


class _Namespace(type):
    """Make ``toma.DEFAULT_CACHE_TYPE`` the module's ``DEFAULT_CACHE_TYPE``, read and written."""

    @property
    def DEFAULT_CACHE_TYPE(cls) -> CacheType:
        return DEFAULT_CACHE_TYPE

    @DEFAULT_CACHE_TYPE.setter
    def DEFAULT_CACHE_TYPE(cls, value: CacheType) -> None:
        global DEFAULT_CACHE_TYPE
        DEFAULT_CACHE_TYPE = _cache_type(value, "DEFAULT_CACHE_TYPE")

    @DEFAULT_CACHE_TYPE.deleter
    def DEFAULT_CACHE_TYPE(cls) -> None:
        # Undoing a patch of an attribute that was not in the class's own __dict__ deletes it
        # (pytest's monkeypatch, unittest.mock): that must restore toma's default.
        global DEFAULT_CACHE_TYPE
        DEFAULT_CACHE_TYPE = StacktraceMemoryBatchsizeCache


class toma(metaclass=_Namespace):
    """Decorators that retry a function with smaller sizes when it runs out of memory.

    Use each bare (``@toma.batch``: each call gives its size) or called with
    options: the initial size, ``cache_type`` and ``context`` (default: the
    function), as in :class:`explicit`. A call may give its own size
    (``toma_initial_batchsize`` or ``toma_initial_step``) and ``toma_context``.
    Each returns the wrapped function, or a decorator when ``func`` is not given.
    ``toma.explicit``, the cache types and ``toma.DEFAULT_CACHE_TYPE`` (the
    module's; deleting it restores the default) are here too, as in toma's README.

    .. versionadded:: 0.1.0
    """

    explicit = explicit
    GlobalBatchsizeCache = GlobalBatchsizeCache
    NoBatchsizeCache = NoBatchsizeCache
    StacktraceMemoryBatchsizeCache = StacktraceMemoryBatchsizeCache

    @overload
    @staticmethod
    def batch(func: Callable[Concatenate[int, P], R], **options: Unpack[_BatchOptions]) -> Callable[..., R]: ...
    @overload
    @staticmethod
    def batch(
        func: None = ..., **options: Unpack[_BatchOptions]
    ) -> Callable[[Callable[Concatenate[int, P], R]], Callable[..., R]]: ...
    @staticmethod
    def batch(func: Callable[..., Any] | None = None, **options: Unpack[_BatchOptions]) -> Any:
        """Make ``func(batchsize, ...)`` callable as ``func(...)``, with the largest batch size that fits.

        Args:
            func (callable, optional): the function, when used bare.
            **options: ``initial_batchsize`` (int), ``cache_type`` and ``context``.
        """
        return _Decorator("batch", options, _BatchOptions)(func)

    @overload
    @staticmethod
    def range(func: _Step, **options: Unpack[_StepOptions]) -> _Stepped: ...
    @overload
    @staticmethod
    def range(func: None = ..., **options: Unpack[_StepOptions]) -> Callable[[_Step], _Stepped]: ...
    @staticmethod
    def range(func: _Step | None = None, **options: Unpack[_StepOptions]) -> Any:
        """Make ``func(begin, stop, ...)`` run over consecutive ranges when called as ``func(start, end, ...)``.

        Args:
            func (callable, optional): the function, when used bare.
            **options: ``initial_step`` (int), ``cache_type`` and ``context``.
        """
        return _Decorator("range", options, _StepOptions)(func)

    @overload
    @staticmethod
    def chunked(func: _Step, **options: Unpack[_ChunkOptions]) -> _Stepped: ...
    @overload
    @staticmethod
    def chunked(func: None = ..., **options: Unpack[_ChunkOptions]) -> Callable[[_Step], _Stepped]: ...
    @staticmethod
    def chunked(func: _Step | None = None, **options: Unpack[_ChunkOptions]) -> Any:
        """Make ``func(chunk, begin, end, ...)`` run over the chunks of a tensor when called as ``func(tensor, ...)``.

        A call may give its own ``toma_dimension``.

        Args:
            func (callable, optional): the function, when used bare.
            **options: ``initial_step`` (int), ``dimension`` (int, default: 0),
                ``cache_type`` and ``context``.
        """
        return _Decorator("chunked", options, _ChunkOptions)(func)

    class execute:
        """Decorators that run the decorated function at once, and bind its name to the result.

        Each checks its arguments and returns a decorator that runs its :class:`explicit`
        namesake on the function, with ``cache_type`` and ``context`` (default: the
        call stack of the code that calls ``toma.execute.*``) for the ``toma_*`` keywords.

        .. versionadded:: 0.1.0
        """

        @staticmethod
        def batch(
            initial_batchsize: int, cache_type: CacheType | None = None, context: Hashable = None
        ) -> Callable[[Callable[[int], R]], R]:
            """Return a decorator that calls ``func(batchsize)`` at once, and returns its result."""
            size = _size(initial_batchsize, "initial_batchsize")
            where = _executed(cache_type, context, sys._getframe(1))
            return lambda func: _run(func, size, where, sys._getframe(1))

        @staticmethod
        def range(
            start: int, end: int, initial_step: int, cache_type: CacheType | None = None, context: Hashable = None
        ) -> Callable[[Callable[[int, int], object]], None]:
            """Return a decorator that runs ``func(begin, stop)`` over ``[start, end)`` at once."""
            step, span = _size(initial_step, "initial_step"), _span(start, end)
            where = _executed(cache_type, context, sys._getframe(1))
            return lambda func: _run(func, step, where, sys._getframe(1), span=span)

        @staticmethod
        def chunked(
            tensor: torch.Tensor,
            initial_step: int | None = None,
            dimension: int | None = None,
            cache_type: CacheType | None = None,
            context: Hashable = None,
        ) -> Callable[[Callable[[torch.Tensor, int, int], object]], None]:
            """Return a decorator that runs ``func(chunk, begin, end)`` over ``tensor`` at once.

            ``initial_step`` is required, although toma's signature lets it be omitted.
            """
            step = _size(initial_step, "initial_step")
            chunks, dim = _dimension(tensor, 0 if dimension is None else dimension, "dimension")
            where = _executed(cache_type, context, sys._getframe(1))
            return lambda func: _run(func, step, where, sys._getframe(1), tensor=chunks, dim=dim)
