"""The front ends that cover rows or indices in chunks: ``chunked`` and ``range``.

A pass over ``[start, stop)`` is one call of the engine, and each chunk one step
of it: a chunk that runs out of memory is retried on its own at the next smaller
size, starting at its own first row, so finished chunks are neither recomputed
nor dropped.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, NoReturn, ParamSpec, TypeVar, cast, overload

import torch
from torch.utils._pytree import TreeSpec, keystr, tree_flatten, tree_flatten_with_path, tree_unflatten

from koila_retry._common.tensors import TensorBase
from koila_retry._core.cache import StackMemoryCache, function_identity
from koila_retry._core.engine import Controller
from koila_retry._core.memory import default_device
from koila_retry._core.policy import DEFAULT_INITIAL, Options, Policy
from koila_retry._diagnostics import exhausted
from koila_retry._estimation.estimate import AUTO, AutoFirst, MemoryEstimate, check_auto, estimate
from koila_retry._frontends.arguments import Split
from koila_retry._frontends.batch import Batched, with_controller

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["chunked", "range"]

P = ParamSpec("P")
R = TypeVar("R")

# Passes started by ``koila.chunked(fn, x)`` and ``koila.range(fn, 0, n)`` share one
# cache; keys hold the function's place in the code and the call site.
calls_cache = StackMemoryCache()

_NONE_SPEC = tree_flatten(None)[1]


class _Pass:
    """What every pass of one ``chunked`` or ``range`` call or decorator is told: its policy and its own options."""

    def __init__(self, front_end: str, initial: int | str, progress: bool, options: Options) -> None:
        if not isinstance(progress, bool):
            raise TypeError(f"progress must be a bool, got {type(progress).__name__} {progress!r}")
        self.front_end = front_end
        check_auto(initial)
        self.auto = initial == AUTO
        if self.auto and front_end == "koila.range":
            raise ValueError(
                "koila.range has no inputs to estimate memory from: initial='auto' is for koila.chunked "
                "and koila.accumulate; give koila.range an int"
            )
        self.policy = Policy.of(front_end, None if self.auto else cast("int | None", initial), options)
        self.tqdm = _tqdm() if progress else None  # missing tqdm is an error now, not at the first row
        self.device = self.policy.device

    def controller(self, fn: object, *, decorated: bool) -> Controller:
        """Make the controller of one call, or of a decorated function (with a cache of its own)."""
        if not callable(fn):
            raise TypeError(f"{self.front_end} needs a callable, got {type(fn).__name__} {fn!r}")
        name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
        default = StackMemoryCache() if decorated else calls_cache
        return Controller(name, self.policy, default_cache=default, explain=exhausted.message)


def _tqdm() -> Callable[..., Any]:
    try:
        tqdm: Callable[..., Any] = importlib.import_module("tqdm.auto").tqdm  # an optional extra
    except ImportError:
        raise ImportError(
            "progress=True shows a tqdm progress bar, and tqdm is not installed; "
            "install it with: pip install 'koila-retry[progress]'"
        ) from None
    return tqdm


@overload
def chunked(fn: Callable[P, R], /) -> Batched[P, R]: ...


@overload
def chunked(
    fn: Callable[..., R],
    first: Any,
    /,
    *args: Any,
    initial: int | Literal["auto"] = ...,
    dim: int = ...,
    progress: bool = ...,
    out: Any = ...,
    **options: Unpack[Options],
) -> R: ...


@overload
def chunked(
    *,
    initial: int | Literal["auto"] = ...,
    dim: int = ...,
    progress: bool = ...,
    **options: Unpack[Options],
) -> Callable[[Callable[P, R]], Batched[P, R]]: ...


def chunked(
    fn: Callable[..., Any] | None = None,
    /,
    *args: Any,
    initial: int | Literal["auto"] = DEFAULT_INITIAL,
    dim: int = 0,
    progress: bool = False,
    out: Any = None,
    **options: Unpack[Options],
) -> Any:
    """Apply a function to its tensor arguments in chunks of rows, and join the results.

    Every tensor argument is split along ``dim`` into chunks of the current size
    (the last chunk takes what remains), ``fn`` is called on each chunk with the
    other arguments passed as they are, and the results are concatenated along
    ``dim``. ``fn`` may return a tensor, or a tuple, list, dict or nested mix of
    tensors: the result has the same structure; or ``None`` throughout, and so
    does the result. If a chunk runs out of memory, its memory is released and
    it is tried again from its first row at the next smaller power of two:
    finished chunks are kept, never recomputed. The size that worked is
    remembered for the next call. A result of a single chunk is returned as
    ``fn`` returned it.

    Called with a function and no other positional argument, or with options
    only, it is a decorator: ``@koila.chunked(initial=4096)`` makes ``encode(x)``
    run in chunks. The decorated function also has ``stats``, ``cache_info()``
    and ``cache_clear()``.

    Args:
        fn (callable): the function to apply to each chunk.
        *args: the arguments of ``fn``: tensors, all with the same size along
            ``dim``, are split; anything else is passed to every call.
        initial (int or str): the first chunk size to try. ``"auto"``: the
            largest power of two whose estimated memory (:func:`estimate`) fits
            in the device's free memory, all the rows if they fit, estimated once
            per input signature. Default: 512.
        dim (int): the dimension to split and join along. Default: 0.
        progress (bool): show a tqdm progress bar over the rows, with the
            current chunk size. Needs ``pip install 'koila-retry[progress]'``.
            Default: ``False``.
        out (tensor or structure of tensors, optional): where to write the
            results instead of concatenating them: the same structure as
            ``fn``'s result, each tensor with the full number of rows along
            ``dim``. Saves the copy that joining costs. Not for decorators.
        **options: the options every front end takes, each chunk being one
            step: ``minimum``, ``cache`` (keys include the shape and dtype of
            one sample; default: one :class:`StackMemoryCache` shared by
            ``chunked`` and ``range`` calls, a new one per decorated function),
            ``max_attempts`` (per chunk), ``on_oom``, ``schedule``, ``device``
            (default: the device of the first tensor argument), ``grow`` and
            ``grow_after`` (counting chunks), ``sync`` (every rank must then
            make the call, over as many rows) and ``group``; see
            :ref:`options`.

    Returns:
        The joined results (or ``out``); or, used as a decorator, the decorated
        function.

    Raises:
        ValueError: if there is no tensor argument, tensors differ in size
            along ``dim``, ``dim`` is out of range for an argument or a result,
            ``out`` does not match, or an option is out of range.
        TypeError: if ``fn`` is not callable, it returns something other than
            tensors (or ``None``), or an option has the wrong type.
        BatchSizeExhausted: if a chunk runs out of memory at ``minimum``; rows
            before it are finished (and written to ``out``, if given).

    Example::

        >>> import torch, koila_retry as koila
        >>> x = torch.arange(10.0).reshape(5, 2)
        >>> koila.chunked(lambda rows: rows * 2, x, initial=2)
        tensor([[ 0.,  2.],
                [ 4.,  6.],
                [ 8., 10.],
                [12., 14.],
                [16., 18.]])

    .. versionadded:: 0.1.0
    """
    chunks = _Pass("koila.chunked", initial, progress, options)
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__} {dim!r}")
    if fn is not None and args:
        controller = chunks.controller(fn, decorated=False)
        return _run_chunked(controller, fn, args, {}, dim, chunks, out, sys._getframe(1))
    if out is not None:
        raise TypeError("out= is given per call: koila.chunked(fn, x, out=buffer), not to a decorator")

    def decorate(function: Callable[P, R]) -> Batched[P, R]:
        controller = chunks.controller(function, decorated=True)
        getframe = sys._getframe

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return _run_chunked(controller, function, args, kwargs, dim, chunks, None, getframe(1))

        return cast(Batched[P, R], with_controller(wrapper, controller))

    return decorate if fn is None else decorate(fn)


def _run_chunked(
    controller: Controller,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dim: int,
    chunks: _Pass,
    out: Any,
    caller: Any,
) -> Any:
    split = Split(args, kwargs, dim, "koila.chunked")
    results = _Results(dim, split.rows, out)

    def work(begin: int, end: int) -> Any:
        chunk_args, chunk_kwargs = split.chunk(begin, end)
        return fn(*chunk_args, **chunk_kwargs)

    if split.rows == 0:
        controller.cover(None, 0, 0, work, results.add)
        if out is None:  # one call on the empty input gives the result its structure
            results.add(0, 0, work(0, 0))
    else:
        device = chunks.device or split.device
        identity = function_identity(fn)
        first = None
        if chunks.auto:

            def make() -> MemoryEstimate:
                return estimate(fn, *args, dim=dim, device=device, **kwargs)

            first = AutoFirst((identity, split.sample, device), split.rows, make, device, controller.name)
        attempt = controller.start(
            identity, caller, device, split.sample, split.rows, first, span=split.rows, roots=(fn, args, kwargs)
        )
        controller.cover(attempt, 0, split.rows, work, results.add, progress=chunks.tqdm)
    return results.finish()


class _Results:
    """The results of the chunks: checked as they come, joined (or written to ``out``) at the end."""

    def __init__(self, dim: int, rows: int, out: Any) -> None:
        self.dim, self.rows, self.out = dim, rows, out
        self.spec: TreeSpec | None = None
        self.parts: list[list[torch.Tensor]] = []
        self.single: Any = None
        self.none = False
        self.joins_tensors = False
        self.least_dims = dim + 1 if dim >= 0 else -dim  # the dims a result needs to have ``dim``
        if out is not None:
            self.out_leaves, self.out_spec = tree_flatten(out)
            for path, leaf in tree_flatten_with_path(out)[0]:
                where = f"out{keystr(path)}"
                if not isinstance(leaf, TensorBase):
                    raise TypeError(f"out must hold tensors, got {type(leaf).__name__} at {where}")
                if not -leaf.dim() <= dim < leaf.dim() or leaf.size(dim) != rows:
                    raise ValueError(
                        f"{where} has shape {tuple(leaf.shape)}; it needs {rows} rows along dim {dim}, "
                        "one per input row"
                    )

    def add(self, begin: int, end: int, result: Any) -> None:
        if type(result) is torch.Tensor and self.joins_tensors and result.dim() >= self.least_dims:
            self.parts.append([result])  # the usual case, checked and kept without flattening
            return
        if result is None and self.out is None:
            if self.spec is not None and not self.none:
                self._changed(self.spec, _NONE_SPEC)
            self.none, self.spec = True, _NONE_SPEC
            return
        leaves, spec = tree_flatten(result)
        if self.spec is None:
            self.spec = spec
        elif spec != self.spec or self.none:
            self._changed(self.spec, spec)
        dim = self.dim
        for leaf in leaves:  # every chunk's: a short last chunk is where squeeze() bites
            if not isinstance(leaf, TensorBase) or not -leaf.dim() <= dim < leaf.dim():
                self._explain(result)
        if self.out is not None:
            if spec != self.out_spec:
                raise ValueError(f"fn's result has the structure {spec}, and out has {self.out_spec}")
            for target, leaf in zip(self.out_leaves, leaves, strict=True):
                if leaf.size(dim) != end - begin:
                    raise ValueError(
                        f"fn returned {leaf.size(dim)} rows along dim {dim} for a chunk of "
                        f"{end - begin}; out= needs one result row per input row"
                    )
                target.narrow(dim, begin, end - begin).copy_(leaf)
            return
        if not self.parts:
            self.single = result
            # From now on a plain tensor with a dim to join along needs no other check.
            self.joins_tensors = type(result) is torch.Tensor
        self.parts.append(leaves)

    @staticmethod
    def _changed(before: TreeSpec, after: TreeSpec) -> NoReturn:
        raise ValueError(f"fn returned results of different structures for different chunks: {before} and then {after}")

    def _explain(self, result: Any) -> None:
        """Raise the error that names the leaf of ``result`` that cannot be joined."""
        for path, leaf in tree_flatten_with_path(result)[0]:
            where = f"the result{keystr(path)}"
            if not isinstance(leaf, TensorBase):
                raise TypeError(
                    f"fn returned {type(leaf).__name__} at {where}; koila.chunked joins results along dim "
                    f"{self.dim}, so fn must return tensors (or a tuple, list or dict of them), or None"
                )
            if not -leaf.dim() <= self.dim < leaf.dim():
                raise ValueError(
                    f"fn returned a tensor of shape {tuple(leaf.shape)} at {where}, which has no dim "
                    f"{self.dim} to join chunks along"
                )

    def finish(self) -> Any:
        if self.out is not None:
            return self.out
        if self.none:
            return None
        if len(self.parts) == 1:
            return self.single
        joined = [torch.cat(column, dim=self.dim) for column in zip(*self.parts, strict=True)]
        self.parts.clear()
        return tree_unflatten(joined, cast(TreeSpec, self.spec))


@overload
def range(fn: Callable[P, R], /) -> Batched[P, list[R]]: ...


@overload
def range(
    fn: Callable[[int, int], R],
    start: int,
    stop: int,
    /,
    *,
    initial: int = ...,
    progress: bool = ...,
    **options: Unpack[Options],
) -> list[R]: ...


@overload
def range(
    *,
    initial: int = ...,
    progress: bool = ...,
    **options: Unpack[Options],
) -> Callable[[Callable[P, R]], Batched[P, list[R]]]: ...


def range(
    fn: Callable[..., Any] | None = None,
    start: int | None = None,
    stop: int | None = None,
    /,
    *,
    initial: int = DEFAULT_INITIAL,
    progress: bool = False,
    **options: Unpack[Options],
) -> Any:
    """Call ``fn(begin, end)`` over consecutive index ranges that cover ``[start, stop)`` once.

    Each range holds the current size of indices (the last takes what
    remains). If a call runs out of memory, its memory is released and the same
    range is started again, from ``begin``, at the next smaller power of two:
    ranges that finished are never run again. The size that worked is
    remembered for the next call.

    Called with a function only, or with options only, it is a decorator:
    ``@koila.range(initial=4096)`` makes ``process(0, n)`` run in ranges;
    further arguments of the decorated function are passed to every call, after
    ``begin`` and ``end``.

    Args:
        fn (callable): called as ``fn(begin, end)`` for each range.
        start (int): the first index.
        stop (int): one past the last index; at least ``start``.
        initial (int): the first range size to try. Default: 512.
        progress (bool): show a tqdm progress bar over the indices. Needs
            ``pip install 'koila-retry[progress]'``. Default: ``False``.
        **options: the options every front end takes, each range being one
            step: ``minimum``, ``cache`` (default: one :class:`StackMemoryCache`
            shared by ``chunked`` and ``range`` calls, a new one per decorated
            function), ``max_attempts`` (per range), ``on_oom``, ``schedule``,
            ``device`` (default: the current accelerator, else the CPU),
            ``grow`` and ``grow_after`` (counting ranges), ``sync`` (every rank
            must then make the call, over as many indices) and ``group``; see
            :ref:`options`.

    Returns:
        list: what ``fn`` returned for each range, in order; or, used as a
        decorator, the decorated function.

    Raises:
        TypeError: if ``fn`` is not callable, or ``start``, ``stop`` or an
            option has the wrong type.
        ValueError: if ``stop`` is below ``start``, or an option is out of range.
        BatchSizeExhausted: if a range runs out of memory at ``minimum``.

    Example::

        >>> import koila_retry as koila
        >>> koila.range(lambda begin, end: (begin, end), 0, 10, initial=4)
        [(0, 4), (4, 8), (8, 10)]

    .. versionadded:: 0.1.0
    """
    ranges = _Pass("koila.range", initial, progress, options)
    if fn is not None and (start is not None or stop is not None):
        controller = ranges.controller(fn, decorated=False)
        return _run_range(controller, fn, start, stop, (), {}, ranges, sys._getframe(1))

    def decorate(function: Callable[P, R]) -> Batched[P, list[R]]:
        controller = ranges.controller(function, decorated=True)
        getframe = sys._getframe

        @functools.wraps(function)
        def wrapper(start: int, stop: int, /, *args: Any, **kwargs: Any) -> list[Any]:
            return _run_range(controller, function, start, stop, args, kwargs, ranges, getframe(1))

        return cast(Batched[P, list[R]], with_controller(wrapper, controller))

    return decorate if fn is None else decorate(fn)


def _run_range(
    controller: Controller,
    fn: Callable[..., Any],
    start: Any,
    stop: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    ranges: _Pass,
    caller: Any,
) -> list[Any]:
    for name, value in (("start", start), ("stop", stop)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if stop < start:
        raise ValueError(f"stop ({stop}) must be at least start ({start})")
    results: list[Any] = []

    def work(begin: int, end: int) -> Any:
        return fn(begin, end, *args, **kwargs)

    def keep(begin: int, end: int, result: Any) -> None:
        results.append(result)

    if stop == start:
        controller.cover(None, start, stop, work, keep)
        return results
    device = ranges.device or default_device()
    attempt = controller.start(function_identity(fn), caller, device, span=stop - start, roots=(fn, args, kwargs))
    controller.cover(attempt, start, stop, work, keep, progress=ranges.tqdm, unit=("index", "indices", "range"))
    return results
