"""The front ends that cover rows or indices in chunks: ``chunked`` and ``range``.

A pass over ``[start, stop)`` is one call of the engine, and each chunk one step
of it: a chunk that runs out of memory is retried on its own at the next smaller
size, starting at its own first row, so finished chunks are neither recomputed
nor dropped.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import sys
from collections.abc import Callable
from types import CoroutineType, FunctionType, MethodType
from typing import Any, Literal, NoReturn, ParamSpec, TypeVar, cast, overload

import torch

from koila_retry._common.batches import Split, positional_names
from koila_retry._common.dynamo import not_traced
from koila_retry._common.units import as_int, check_flag, checked_dim
from koila_retry._core.cache import StackMemoryCache, function_identity
from koila_retry._core.engine import Attempt, Call, Controller, cover
from koila_retry._core.memory import default_device
from koila_retry._core.policy import DEFAULT_INITIAL, Options, Policy
from koila_retry._diagnostics import exhausted
from koila_retry._estimation.auto import AUTO, AutoFirst, check_auto
from koila_retry._estimation.estimate import MemoryEstimate, estimate_batch
from koila_retry._frontends.batch import (
    Batched,
    bindable,
    call_signature,
    refuse_generator,
    refuse_iterators,
    unwrap_binding,
    with_controller,
)
from koila_retry._frontends.joining import Results
from koila_retry.exceptions import BatchSizeExhausted

# At run time too: typing.get_type_hints() reads the options' annotations.
if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # the backport torch depends on
    from typing_extensions import Unpack

__all__ = ["chunked", "range"]

P = ParamSpec("P")
R = TypeVar("R")

# Passes started by ``koila.chunked(fn, x)`` and ``koila.range(fn, 0, n)`` share one
# cache; keys hold the function's place in the code and the call site.
calls_cache = StackMemoryCache()


# The keywords of a call form that are options; every other keyword is the function's.
_OPTIONS = frozenset(Options.__annotations__)

# The options each front end takes besides the shared ones, as its errors list them.
_OWN_OPTIONS = {"koila.chunked": ("initial", "dim", "progress", "out"), "koila.range": ("initial", "progress")}

# What a keyword argument that a function takes may be.
_KEYWORD_KINDS = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def _arguments_of_fn(fn: object, options: dict[str, Any], front_end: str, own: dict[str, Any]) -> dict[str, Any]:
    """Take the keywords that are not options out of a call form's, as the function's own, and check fn takes them.

    ``own`` holds the front end's own options given other than as their defaults.
    """
    if fn is None or not (options or own):
        return {}
    given = {name: options.pop(name) for name in [name for name in options if name not in _OPTIONS]}
    found = _keywords_of(fn)
    if found is None:  # no signature to read (a builtin such as torch.add): fn is the judge
        return given
    takes, anything = found
    for name, value in [*own.items(), *options.items()]:
        if name in takes:
            _refuse_option(fn, name, value, front_end)
    if anything:
        return given
    for name in given:
        if name not in takes:
            _refuse_keyword(fn, name, takes, front_end)
    return given


def _keywords_of(fn: object) -> tuple[list[str], bool] | None:
    """Return the names ``fn`` takes by keyword and whether it takes any (``**kwargs``); None if unreadable."""
    # A function's read from its code: a call form in a loop would read a signature (20 us) at every call.
    function = fn.__func__ if type(fn) is MethodType else fn
    if type(function) is FunctionType and not {"__wrapped__", "__signature__"} & function.__dict__.keys():
        code = function.__code__
        bound = function is not fn and code.co_argcount > 0 and not code.co_posonlyargcount  # self, given already
        names = list(code.co_varnames[code.co_posonlyargcount + bound : code.co_argcount + code.co_kwonlyargcount])
        return names, bool(code.co_flags & inspect.CO_VARKEYWORDS)
    try:
        parameters = call_signature(cast(Callable[..., Any], fn)).parameters.values()
    except (TypeError, ValueError):
        return None
    takes = [parameter.name for parameter in parameters if parameter.kind in _KEYWORD_KINDS]
    return takes, any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters)


def _changed(**own: Any) -> dict[str, Any]:
    """Return those of a front end's own options given other than as their defaults."""
    return {name: value for name, value in own.items() if value is not None and not _is_default(name, value)}


def _is_default(name: str, value: object) -> bool:
    default = _OWN_DEFAULTS[name]
    if default is None or isinstance(default, bool):
        return value is default
    return as_int(value) == default  # numpy's 512 too


_OWN_DEFAULTS: dict[str, object] = {"initial": DEFAULT_INITIAL, "dim": 0, "progress": False, "out": None}


def _refuse_option(fn: object, name: str, value: object, front_end: str) -> NoReturn:
    """Raise the error for an option that ``fn`` takes too: the call form would give it to the front end alone."""
    # F.normalize(x, dim=1) is the user's meaning as often as chunked's: fn would be run without it.
    function = _name(fn)
    given = f"{name}={value!r}" if isinstance(value, (int, float, str)) else f"{name}=..."
    decorator = f"the decorator form, {front_end}({given})(fn)(...)"
    if name == "out":  # given per call: no decorator form
        decorator = f"a function that does not take one, lambda rows: {function}(rows)"
    if isinstance(fn, functools.partial) and name in fn.keywords:  # bound already: only the front end's is left
        raise TypeError(
            f"{front_end}() takes {given} as its own option, and the partial of {function}() binds {name!r} too: "
            f"in the call form an option is {front_end}()'s, which the partial's cannot be told from. Give "
            f"{front_end}()'s to {decorator}"
        )
    raise TypeError(
        f"{front_end}() takes {given} as its own option, and {function}() takes {name!r} too: in the call form "
        f"an option is {front_end}()'s alone, and {function}() would run without it. Bind {function}()'s with "
        f"functools.partial(fn, {given}), or give {front_end}()'s to {decorator}"
    )


def _refuse_keyword(fn: object, name: str, takes: list[str], front_end: str) -> NoReturn:
    """Raise the error for a keyword that is neither an option nor fn's, with the name it is closest to."""
    own = _OWN_OPTIONS[front_end]
    close = difflib.get_close_matches(name, [*own, *sorted(_OPTIONS), *takes], n=1)
    guess = f" (did you mean {close[0]!r}?)" if close else ""
    function = _name(fn)
    taken = f"takes {_listed(takes)} by keyword" if takes else "takes no keyword argument"
    raise TypeError(
        f"{front_end}() got an unexpected keyword argument {name!r}, which is neither one of its options nor a "
        f"parameter of {function}(){guess}; its options are {', '.join(own)} and {', '.join(sorted(_OPTIONS))}; "
        f"{function}() {taken}. In the call form, a keyword argument that is not an option is passed to fn, "
        "and refused before anything runs if fn's signature does not take it"
    )


def _listed(names: list[str]) -> str:
    """Join names as a sentence does: ``a, b and c``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _name(fn: object) -> str:
    """Name a function as its errors do: its own name (a partial's function's), or its type's."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", None) or type(fn).__name__


def _refuse_async(fn: object, front_end: str) -> None:
    """Refuse an async function: its calls only make coroutines, whose bodies run after the pass returned."""
    if inspect.iscoroutinefunction(fn):
        raise TypeError(
            f"{front_end} cannot run {getattr(fn, '__qualname__', repr(fn))}(): it is an async function, whose "
            f"body runs only when the coroutine each call returns is awaited, after {front_end} has returned, "
            "where an out-of-memory error cannot be retried. Pass a plain function (one that runs what is async "
            "with asyncio.run, say), or use @koila.batch, which awaits an async function itself"
        )


def _refuse_coroutine(result: CoroutineType[Any, Any, Any], front_end: str, where: str) -> NoReturn:
    """Close a coroutine fn returned, unawaited, and raise the error that says why it cannot be run."""
    result.close()  # never awaited, and never warned of as such
    raise TypeError(
        f"{front_end}: fn returned a coroutine for {where}: its body runs only when it is awaited, after "
        f"{front_end} has returned, where an out-of-memory error cannot be retried. Pass a function that "
        "returns the results themselves (one that runs what is async with asyncio.run, say)"
    )


class _Pass:
    """What every pass of one ``chunked`` or ``range`` call or decorator is told: its policy and its own options."""

    def __init__(self, front_end: str, initial: int | str | None, progress: bool, options: Options) -> None:
        check_flag("progress", progress)
        self.front_end = front_end
        if front_end == "koila.range" and isinstance(initial, str):  # a TypeError, as koila.batch's
            raise TypeError(
                f"koila.range has no inputs to estimate memory from: initial must be an int >= 1 or None, got "
                f"{initial!r} ('auto' is for koila.chunked and koila.accumulate)"
            )
        check_auto(initial)
        self.auto = initial == AUTO
        initial = None if self.auto else cast("int | None", initial)
        self.policy = Policy.of(front_end, initial, options, rows=True, own=_OWN_OPTIONS[front_end])
        self.tqdm = _tqdm() if progress else None  # missing tqdm is an error now, not at the first row
        self.device = self.policy.device

    def controller(self, fn: object, *, decorated: bool) -> Controller:
        """Make the controller of one call, or of a decorated function (with a cache of its own)."""
        if not callable(fn):
            # range(3) after `from koila_retry import *` calls koila's: say whose it is.
            shadow = ""
            if self.front_end == "koila.range" and as_int(fn) is not None:  # numpy's ints too
                shadow = " (this is koila.range, not Python's range, which `from koila_retry import *` hides)"
            raise TypeError(f"{self.front_end} needs a callable, got {type(fn).__name__} {fn!r}{shadow}")
        refuse_generator(fn, self.front_end)
        _refuse_async(fn, self.front_end)
        name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
        default = StackMemoryCache() if decorated else calls_cache
        return Controller(name, self.policy, default_cache=default, explain=exhausted.message, function=fn)


def _tqdm() -> Callable[..., Any]:
    try:
        tqdm: Callable[..., Any] = importlib.import_module("tqdm.auto").tqdm  # an optional extra
    except ImportError:
        raise ImportError(
            "progress=True shows a tqdm progress bar, and tqdm is not installed; "
            "install it with: pip install tqdm (koila-retry's progress extra)"
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
    initial: int | Literal["auto"] | None = ...,
    dim: int = ...,
    progress: bool = ...,
    out: Any = ...,
    **options: Unpack[Options],
) -> R: ...


@overload
def chunked(
    *,
    initial: int | Literal["auto"] | None = ...,
    dim: int = ...,
    progress: bool = ...,
    **options: Unpack[Options],
) -> Callable[[Callable[P, R]], Batched[P, R]]: ...


@overload
def chunked(
    fn: Callable[..., R],
    /,
    *args: Any,
    initial: int | Literal["auto"] | None = ...,
    dim: int = ...,
    progress: bool = ...,
    out: Any = ...,
    **kwargs: Any,
) -> R: ...


@not_traced  # called inside a compiled function, it runs as written (see _common/dynamo.py)
def chunked(
    fn: Callable[..., Any] | None = None,
    /,
    *args: Any,
    initial: int | Literal["auto"] | None = DEFAULT_INITIAL,
    dim: int = 0,
    progress: bool = False,
    out: Any = None,
    **options: Any,
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
            ``dim``, are split, also inside dicts, lists, tuples and
            dataclasses; anything else is passed to every call (see
            :ref:`batches`).
        initial (int, str or None): the first chunk size to try. ``None``:
            all the rows at once. ``"auto"``: the
            largest power of two whose estimated memory (:func:`estimate`) fits
            in the device's free memory, all the rows if they fit, estimated once
            per input signature. Default: 512.
        dim (int): the dimension to split and join along. Default: 0.
        progress (bool): show a tqdm progress bar over the rows, with the
            current chunk size. Needs tqdm (the ``progress`` extra).
            Default: ``False``.
        out (tensor or structure of tensors, optional): where to write the
            results instead of concatenating them: a tensor wherever ``fn``'s
            result has one, matched by key (a dict's keys in any order), each
            with the full number of rows along ``dim``. Saves the copy that
            joining costs. Not for decorators. Under grad mode, not a leaf
            tensor that requires grad, nor a view of one (checked before
            ``fn`` runs), nor the input itself where ``fn``'s result
            requires grad (checked before a row is written).
        **options (Options): the shared options, each chunk being one step;
            see :ref:`options`. ``cache`` defaults to one
            :class:`StackMemoryCache` shared by ``chunked`` and ``range`` calls,
            a new one per decorated function. In the call form, every other
            keyword argument is ``fn``'s, split like ``args``:
            ``koila.chunked(model, input_ids=ids, attention_mask=mask)``; one
            that ``fn``'s signature does not take (it has no ``**kwargs``) is
            refused.

    Returns:
        The joined results (or ``out``); or, used as a decorator, the decorated
        function.

    Raises:
        ValueError: if there is no tensor argument, tensors differ in size
            along ``dim``, ``dim`` is out of range for an argument or a result,
            ``out`` does not match (a tensor missing or extra, a shape or a
            dtype that does not fit), requires grad as a leaf, shares memory
            with an input without being that input, or is that input while
            ``fn``'s result requires grad under grad mode, ``fn`` returns a
            sparse or nested tensor, or an option is out of range.
        TypeError: if ``fn`` is not callable or is an async or generator
            function, it returns something other than tensors (or ``None``), an
            argument is an iterator (which the first chunk would use up: pass a
            list), a keyword argument is neither an option nor ``fn``'s, an
            option other than its default is one ``fn`` takes by keyword too
            (in the call form), or an option has the wrong type.
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
    called = args or not options.keys() <= _OPTIONS  # not koila.chunked(fn, **options), the decorator
    own = _changed(initial=initial, dim=dim, progress=progress, out=out)
    given = _arguments_of_fn(fn if called else None, options, "koila.chunked", own)
    chunks = _Pass("koila.chunked", initial, progress, cast(Options, options))
    dim = checked_dim(dim)
    if fn is not None and (args or given):
        controller = chunks.controller(fn, decorated=False)
        return _run_chunked(controller, fn, args, given, dim, chunks, out, sys._getframe(1))
    if out is not None:
        raise TypeError("out= is given per call: koila.chunked(fn, x, out=buffer), not to a decorator")
    decorator = functools.partial(chunked, initial=initial, dim=dim, progress=progress, **options)

    def decorate(function: Callable[P, R]) -> Batched[P, R]:
        function, binding = unwrap_binding(function)
        controller = chunks.controller(function, decorated=True)
        getframe = sys._getframe

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return _run_chunked(controller, function, args, kwargs, dim, chunks, None, getframe(1))

        @functools.wraps(function)
        def method(instance: Any, /, *args: Any, **kwargs: Any) -> Any:
            # Bound to an instance (or a class), that is bound to the function, not split with the
            # arguments: a dataclass's tensors are the object's, whatever their rows.
            bound = MethodType(function, instance)
            return _run_chunked(controller, bound, args, kwargs, dim, chunks, None, getframe(1))

        plain, method = with_controller(wrapper, controller), with_controller(method, controller)
        return cast(Batched[P, R], bindable(function, plain, method, decorator, binding))

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
    refuse_iterators(fn, args, kwargs, "koila.chunked", "chunk")
    split = Split(args, kwargs, dim, "koila.chunked", fn)
    results = Results(dim, split.rows, out)
    if out is not None:
        results.refuse_overlap(split)  # before fn runs, as torch's out= refuses it before its kernel
    attempt: Attempt | None = None

    def work(begin: int, end: int) -> Any:
        chunk_args, chunk_kwargs = split.chunk(begin, end)
        results.unfit = None  # what the attempt that gives up failed at: fn, or the result beside it
        meter = None if attempt is None else attempt.meter
        try:
            if meter is None:
                result = fn(*chunk_args, **chunk_kwargs)
            else:
                with meter:  # initial="auto": the first chunk that fits corrects the estimate
                    result = fn(*chunk_args, **chunk_kwargs)
        except RuntimeError as error:
            if dim != 0 and _VIEW_REFUSED in str(error):
                _note_view(error, split, begin, end)
            raise
        if type(result) is CoroutineType:  # an object with an async __call__, which no signature tells
            _refuse_coroutine(result, "koila.chunked", f"the rows {begin} to {end}")
        if results.targets is None and end - begin < split.rows:
            # Made inside the attempt: a result that does not fit beside this chunk is this
            # chunk's out-of-memory error, which a smaller first chunk may avoid.
            results.make(begin, end, result)
            # The chunks that follow run beside it; out's tensors were there before the estimate.
            if meter is not None and first is not None and out is None:
                made: list[Any] = results.targets or []
                first.hold(sum(target.nbytes for target in made if isinstance(target, torch.Tensor)))
        if out is not None:  # the copies writing into out needs, inside the attempt: an OOM there is retried
            result = results.ready(begin, end, result)
        if meter is not None:  # after the result is made, which the size chosen must leave room for
            cast(Attempt, attempt).calibrate(end - begin, meter.rise)
        return result

    if split.rows == 0:
        cover(controller, None, 0, 0, work, results.add)
        if out is None:  # one call on the empty input gives the result its structure
            results.add(0, 0, work(0, 0))
    else:
        device = chunks.device or split.device
        identity = function_identity(fn)
        first: AutoFirst | None = None
        if chunks.auto:

            def make() -> MemoryEstimate:
                return estimate_batch(fn, split, device=device)

            first = AutoFirst(
                (identity, split.sample, device),
                split.rows,
                make,
                device,
                controller.name,
                controller.cache,
                sample_bytes=split.per_sample,
                inputs=split.tensors,
            )
        roots = (fn, args, kwargs)
        call = Call(identity, caller, device, split.sample, split.rows, first, split.rows, roots, split.per_sample)
        attempt = controller.start(call)
        try:
            cover(controller, attempt, 0, split.rows, work, results.add, progress=chunks.tqdm)
        except BaseException as error:
            unfit = results.unfit if isinstance(error, BatchSizeExhausted) else None
            if unfit is None or unfit[0] > 1:  # fn's own error, or a cap that stopped before one row
                if unfit is not None:  # a smaller first chunk may leave room for the result: a plain give-up
                    results.note_unfit(error, chunks.policy.minimum, chunks.policy.max_attempts)
                # Its traceback holds this frame: the finished chunks' result, which nothing
                # else reaches, would live as long as the caller keeps the error.
                results.drop()
                raise
        if results.unfit is not None:
            results.refuse()  # outside the handler: the error raised holds nothing of the attempts
    return results.finish()


# What torch says when .view() cannot reshape a tensor without copying it.
_VIEW_REFUSED = "is not compatible with input tensor's size and stride"


def _note_view(error: RuntimeError, split: Split, begin: int, end: int) -> None:
    """Say, on ``.view()``'s error, that the chunk is not contiguous where the input was, if it is so."""
    if not hasattr(error, "add_note"):  # Python 3.11 on
        return
    try:
        tensors = [split.tensors[index] for index in split.split]
        narrowed = any(
            tensor.is_contiguous() and not tensor.narrow(split.dim, begin, end - begin).is_contiguous()
            for tensor in tensors
        )
    except Exception:  # a note must never hide the error it explains
        return
    if narrowed:
        error.add_note(
            f"koila.chunked split the input along dim {split.dim}, and handed fn the rows {begin} to {end}: a "
            "chunk is a view of the input made with narrow, not a copy, and along a dim other than 0 it is not "
            "contiguous where the input is, so .view() may refuse it where it took the whole input. Use "
            ".reshape() (or .contiguous()) on the chunk in fn"
        )


@overload
def range(fn: Callable[P, R], /) -> Batched[P, list[R]]: ...


@overload
def range(
    fn: Callable[..., R],
    start: int,
    stop: int,
    /,
    *,
    initial: int | None = ...,
    progress: bool = ...,
    **options: Any,
) -> list[R]: ...


@overload
def range(
    *,
    initial: int | None = ...,
    progress: bool = ...,
    **options: Unpack[Options],
) -> Callable[[Callable[P, R]], Batched[P, list[R]]]: ...


@not_traced  # called inside a compiled function, it runs as written (see _common/dynamo.py)
def range(
    fn: Callable[..., Any] | None = None,
    start: int | None = None,
    stop: int | None = None,
    /,
    *,
    initial: int | None = DEFAULT_INITIAL,
    progress: bool = False,
    **options: Any,
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
        initial (int or None): the first range size to try; ``None``: all the
            indices at once. Default: 512.
        progress (bool): show a tqdm progress bar over the indices. Needs
            tqdm (the ``progress`` extra). Default: ``False``.
        **options (Options): the shared options, each range being one step;
            see :ref:`options`. ``cache`` defaults to one
            :class:`StackMemoryCache` shared by ``chunked`` and ``range`` calls,
            a new one per decorated function. In the call form, every other
            keyword argument is passed to every call of ``fn``, after ``begin``
            and ``end``; one that ``fn``'s signature does not take (it has no
            ``**kwargs``) is refused.

    Returns:
        list: what ``fn`` returned for each range, in order; or, used as a
        decorator, the decorated function.

    Raises:
        TypeError: if ``fn`` is not callable or is an async or generator
            function, an argument is an iterator (which the first range would
            use up: pass a list), a keyword argument is neither an option nor
            ``fn``'s, an option other than its default is one ``fn`` takes by
            keyword too, or ``start``, ``stop`` or an option has the wrong type.
        ValueError: if ``stop`` is below ``start``, or an option is out of range.
        BatchSizeExhausted: if a range runs out of memory at ``minimum``.

    Example::

        >>> import koila_retry as koila
        >>> koila.range(lambda begin, end: (begin, end), 0, 10, initial=4)
        [(0, 4), (4, 8), (8, 10)]

    .. versionadded:: 0.1.0
    """
    if fn is not None and stop is None and (start is not None or options.keys() & {"start", "stop"}):
        _range_by_position(start, options)
    own = _changed(initial=initial, progress=progress)
    given = _arguments_of_fn(fn if start is not None or stop is not None else None, options, "koila.range", own)
    ranges = _Pass("koila.range", initial, progress, cast(Options, options))
    if fn is not None and (start is not None or stop is not None):
        controller = ranges.controller(fn, decorated=False)
        return _run_range(controller, fn, start, stop, (), given, ranges, sys._getframe(1))
    decorator = functools.partial(range, initial=initial, progress=progress, **options)

    def decorate(function: Callable[P, R]) -> Batched[P, list[R]]:
        function, binding = unwrap_binding(function)
        controller = ranges.controller(function, decorated=True)
        getframe = sys._getframe

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> list[Any]:
            # The range by position only, as fn gets each range's: Python's own error would name this
            # wrapper's parameters, not fn's.
            if len(args) < 2:
                _missing_range(function, args, kwargs)
            return _run_range(controller, function, args[0], args[1], args[2:], kwargs, ranges, getframe(1))

        @functools.wraps(function)
        def method(instance: Any, /, *args: Any, **kwargs: Any) -> list[Any]:
            # Bound to an instance (or a class), the range comes after it: see batch.Bindable.
            bound = MethodType(function, instance)
            if len(args) < 2:
                _missing_range(bound, args, kwargs)
            return _run_range(controller, bound, args[0], args[1], args[2:], kwargs, ranges, getframe(1))

        plain, method = with_controller(wrapper, controller), with_controller(method, controller)
        _take_ranges(plain, function, 0)
        _take_ranges(method, function, 1)
        return cast(Batched[P, list[R]], bindable(function, plain, method, decorator, binding))

    return decorate if fn is None else decorate(fn)


def _range_by_position(start: object, options: dict[str, Any]) -> NoReturn:
    """Refuse a call form given one end of the range (Python's range(n) habit) or the ends by keyword."""
    keywords = ", ".join(f"{name}={options[name]!r:.40}" for name in ("start", "stop") if name in options)
    end = f"{start!r:.40}"
    if keywords:
        given = f"start={end} by position and " if start is not None else ""
        got = f"it got {given}{keywords} by keyword"
    else:
        got = f"it got start={end} and no stop: to cover 0 to {end}, call koila.range(fn, 0, {end})"
    raise TypeError(f"koila.range(fn, start, stop) takes both ends of the range, by position; {got}")


# What a parameter that takes a range's begin or end may be.
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _take_ranges(form: Any, fn: Callable[..., Any], before: int) -> None:
    """Give a decorated range function's form the signature it is called with: a range by position, a list back."""
    # inspect and typing.get_type_hints() read these, not the overloads a type checker sees.
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin, say: nothing to tell
        return
    parameters = list(signature.parameters.values())
    count = before + 2  # the object bound, then begin and end
    if len(parameters) < count or any(parameter.kind not in _POSITIONAL for parameter in parameters[:count]):
        return  # a *args, say, which takes the range as it is
    parameters[:count] = [
        parameter.replace(kind=inspect.Parameter.POSITIONAL_ONLY, default=inspect.Parameter.empty)
        for parameter in parameters[:count]
    ]
    returns = signature.return_annotation
    if returns is not signature.empty:
        returns = f"list[{returns}]" if isinstance(returns, str) else list[returns]  # type: ignore[valid-type]
        form.__annotations__ = {**getattr(fn, "__annotations__", {}), "return": returns}
    form.__signature__ = signature.replace(parameters=parameters, return_annotation=returns)


def _missing_range(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> NoReturn:
    """Raise the error for a decorated range function called without its start and stop by position."""
    name, names = _name(fn), positional_names(fn)[:2]
    parameters = f", as {_listed([*names])}" if len(names) == 2 else ""
    keywords = [key for key in kwargs if key in {"start", "stop", *names}]
    count = f"{len(args)} positional {'argument' if len(args) == 1 else 'arguments'}"
    given = f"{count}, and {_listed(keywords)} by keyword" if keywords else count
    raise TypeError(
        f"{name}() decorated with @koila.range takes the start and stop of the whole range as its first two "
        f"arguments, by position only (it calls {name}() with each range's begin and end there{parameters}); "
        f"got {given}. Call {name}(start, stop, ...), as {name}(0, n)"
    )


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
    bounds = []
    for name, value in (("start", start), ("stop", stop)):
        bound = as_int(value)  # as Python's range takes them (numpy's ints), and fn gets Python ints
        if bound is None:
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        bounds.append(bound)
    start, stop = bounds
    if stop < start:
        raise ValueError(f"stop ({stop}) must be at least start ({start})")
    refuse_iterators(fn, args, kwargs, "koila.range", "range", before=2)
    results: list[Any] = []

    def work(begin: int, end: int) -> Any:
        result = fn(begin, end, *args, **kwargs)
        if type(result) is CoroutineType:  # an object with an async __call__, which no signature tells
            _refuse_coroutine(result, "koila.range", f"the range {begin} to {end}")
        return result

    def keep(begin: int, end: int, result: Any) -> None:
        results.append(result)

    if stop == start:
        cover(controller, None, start, stop, work, keep)
        return results
    device = ranges.device or default_device()
    identity, span = function_identity(fn), stop - start
    # rows: with initial=None, every index at once
    attempt = controller.start(Call(identity, caller, device, rows=span, span=span, roots=(fn, args, kwargs)))
    try:
        cover(controller, attempt, start, stop, work, keep, progress=ranges.tqdm, unit=("index", "indices", "range"))
    except BaseException:
        results.clear()  # as a chunked pass's result (see _run_chunked)
        raise
    return results
