"""The front ends ``batch`` and ``attempts``: a call, or a block, whose every attempt the engine runs."""

from __future__ import annotations

import copy
import dis
import functools
import inspect
import io
import sys
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import CodeType, FrameType, MethodType
from typing import Any, Concatenate, NoReturn, ParamSpec, Protocol, TypeVar, cast, overload

import torch

from koila_retry._common.batches import positional_names
from koila_retry._common.callables import seen_through
from koila_retry._common.dynamo import not_traced
from koila_retry._common.tensors import TensorBase
from koila_retry._common.walk import FrameValues
from koila_retry._core.attempt import Block
from koila_retry._core.cache import (
    CacheInfo,
    NoCache,
    SizeCache,
    StackMemoryCache,
    function_identity,
    innermost,
    weak_method,
)
from koila_retry._core.disk import DiskCache
from koila_retry._core.engine import Attempt, Call, Controller, run_async
from koila_retry._core.memory import default_device, resolve_device
from koila_retry._core.policy import DEFAULT_INITIAL, Options, Policy
from koila_retry._core.stats import Stats
from koila_retry._diagnostics import exhausted

# At run time too: typing.get_type_hints() reads the options' annotations.
if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # the backport torch depends on
    from typing_extensions import Unpack

__all__ = [
    "Batched",
    "Bindable",
    "attempts",
    "batch",
    "batched",
    "bindable",
    "callable_name",
    "device_of",
    "refuse_generator",
    "refuse_iterators",
    "unwrap_binding",
    "with_controller",
]

P = ParamSpec("P")
P2 = ParamSpec("P2")
R = TypeVar("R")
R2 = TypeVar("R2")
R_co = TypeVar("R_co", covariant=True)
S = TypeVar("S")


class Batched(Protocol[P, R_co]):
    """A function wrapped by :func:`batch`: call it without the batch size.

    Besides being callable, it has ``stats`` (a :class:`Stats`), and
    ``cache_info()`` and ``cache_clear()`` for its cache. It is a protocol for
    annotations, which ``isinstance`` does not take: test for ``stats``.

    Type checkers see the wrapped function's parameters (without the batch size,
    for :func:`batch`; any, with ``param=``) and its result. A wrapped method,
    looked up on an instance, binds it as a function does. mypy binds the class
    or instance only that way: under ``@classmethod`` it asks for the class as
    the first argument, and a ``@staticmethod``, a method under ``batch`` with
    ``param=``, or a wrapper of a ``*args``-only function set on a class, looked
    up on an instance, loses its first parameter there. Look those up on the
    class, or annotate the instance's attribute.
    """

    stats: Stats

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R_co: ...

    def cache_info(self) -> CacheInfo: ...

    def cache_clear(self) -> None: ...

    # Bound as a function is: looked up on an instance, the wrapper of a method takes its other arguments.
    @overload
    def __get__(self, instance: None, owner: type[Any] | None = None) -> Batched[P, R_co]: ...

    @overload
    def __get__(
        self: Batched[Concatenate[S, P2], R2], instance: S, owner: type[Any] | None = None
    ) -> Batched[P2, R2]: ...


class _BatchDecorator(Protocol):
    """What ``batch(...)`` with options returns: it decorates a function, or a method (the size after ``self``)."""

    @overload
    def __call__(self, fn: Callable[Concatenate[int, P], R], /) -> Batched[P, R]: ...

    @overload
    def __call__(self, fn: Callable[Concatenate[S, int, P], R], /) -> Batched[Concatenate[S, P], R]: ...


class _Injection:
    """Where the batch size goes in the wrapped function's arguments: after ``after`` of them (1 for a method)."""

    def __init__(self, fn: Callable[..., Any], param: str | None, after: int, front_end: str = "@koila.batch") -> None:
        named = front_end == "@koila.batch"  # whether the front end offers param= (find_executable_batch_size does not)
        self.front_end = front_end
        signature = _signature(fn)
        params = list(signature.parameters.values())
        name = callable_name(fn)
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
            self.position = after
            if len(params) <= after or params[after].kind not in positional:
                keyword = ", or name a keyword parameter with param=..." if named else ""
                if after:
                    raise TypeError(
                        f"{name}() is called through an instance (or its class), so the batch size goes after "
                        "the object it is bound to, and it has no second positional parameter to receive it; "
                        f"add one, make it a staticmethod{keyword}"
                    )
                raise TypeError(
                    f"{name}() has no first positional parameter to receive the batch size; add one{keyword}"
                )
            target = params[after]
        self.name = target.name
        self.function_name = name
        index = params.index(target)
        earlier, later = params[:index], params[index + 1 :]
        has_varargs = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
        # The most positional arguments a caller may pass; more means they passed the size.
        self.max_args = (
            sys.maxsize if has_varargs or self.position is None else sum(p.kind in positional for p in earlier + later)
        )
        self.by_keyword = [p.name for p in later if p.kind in positional]
        # A size passed by keyword to a parameter that could be positional takes its place: a
        # positional argument for a later parameter would land on it, so those are keyword-only
        # in the signature, the parameters before it are all a caller may pass by position, and
        # *args is out of reach.
        self.takes_place = self.position is None and target.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
        if self.takes_place:
            self.max_args = len(earlier)
            later = [
                p.replace(kind=inspect.Parameter.KEYWORD_ONLY) if p.kind in positional else p
                for p in later
                if p.kind is not inspect.Parameter.VAR_POSITIONAL
            ]
        self.signature = signature.replace(parameters=earlier + later)

    def refuse(self, given: int, named: bool) -> TypeError:
        """Return the error for a call that passed the size by name, or more positional arguments than it takes."""
        if self.takes_place and not named:
            positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
            names = [repr(p.name) for p in self.signature.parameters.values() if p.kind in positional]
            takes = f"{len(names)} positional argument{'' if len(names) == 1 else 's'}"
            if names:
                takes += f" ({', '.join(names)})"
            later = ", ".join(repr(name) for name in self.by_keyword)
            return TypeError(
                f"{self.function_name}() takes {takes} under @koila.batch(param={self.name!r}), which passes "
                f"{self.name!r} by keyword, but got {given}" + (f": pass {later} by keyword" if later else "")
            )
        return TypeError(
            f"{self.function_name}() gets {self.name!r} from {self.front_end}; call it without "
            f"{self.name!r} (the size is chosen and injected for you)"
        )


def callable_name(fn: Any) -> str:
    """Name a callable without ``repr``: a copy's wrapper is made while the object it is bound to is copied."""
    inner = _unpartial(fn)
    name = getattr(inner, "__qualname__", None)
    return name if isinstance(name, str) else type(inner).__qualname__


def _unpartial(fn: Any) -> Any:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn


def call_signature(fn: Callable[..., Any]) -> inspect.Signature:
    """Return what ``fn`` takes: a module's forward's; ``TypeError`` or ``ValueError`` as ``inspect`` raises them."""
    if isinstance(fn, torch.nn.Module):
        # A module's call is (*args, **kwargs), whatever its forward takes, which it passes them to:
        # through torch.compile's and DataParallel's, unless the module's class has a call of its own.
        inner = innermost(fn)
        # A call of its class's own (which the wrapper calls in the end) takes what its signature says.
        return inspect.signature(inner.forward if type(inner).__call__ is torch.nn.Module.__call__ else inner)
    return inspect.signature(fn)


def _signature(fn: Callable[..., Any]) -> inspect.Signature:
    try:
        return call_signature(fn)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"cannot read the signature of {fn!r} to inject the batch size: {exc}") from None


# How a wrapper binds when it is looked up on a class or an instance.
_METHOD, _CLASSMETHOD, _STATICMETHOD = "method", "classmethod", "staticmethod"
# A callable no class binds (an object with a __call__, a partial before Python 3.14): returned as it is
# when looked up, and still called as a method where its first parameter is self (a partial of one).
_UNBOUND = "unbound"


class Bindable:
    """A wrapper that learns from binding whether its function is called as a method, made by :func:`bindable`."""

    _method: Callable[..., Any]
    _binding: str
    _remake: _Remake
    __wrapped__: Any

    def __get__(self, instance: object, owner: type | None = None) -> Any:
        binding = self._binding
        if binding is _METHOD:
            return self._method if instance is None else MethodType(self._method, instance)
        if binding is _CLASSMETHOD:
            return MethodType(self._method, type(instance) if owner is None else owner)
        return self

    def __copy__(self) -> Bindable:
        return self  # as a function's or a bound method's copy is

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        # A function's wrapper is itself, as the function is to deepcopy (a closure's too: its stats and
        # cache go with it). One of a bound method, a partial or a module (made in __init__) is made again
        # from a deep copy of it: bound to the copied instance (copy's memo), the options shared.
        wrapped = self.__wrapped__
        if inspect.isfunction(wrapped):
            return self
        return self._remake(copy.deepcopy(wrapped, memo))

    def __reduce__(self) -> str | tuple[Any, ...]:
        # One its module-level name finds (a decorated function) is pickled by that name, as the function
        # it stands for was (multiprocessing's spawn needs it). Any other is made again from its callable,
        # pickled, with the same options.
        name = getattr(self, "__qualname__", None)
        if isinstance(name, str) and _named(self, getattr(self, "__module__", None), name):
            return name
        return self._remake, (self.__wrapped__,)

    def __repr__(self) -> str:
        return f"<koila_retry wrapper of {getattr(self, '__wrapped__', None)!r}>"


def _named(wrapper: Bindable, module: object, qualname: str) -> bool:
    """Return whether ``qualname`` in the imported ``module`` is ``wrapper``, looked up as pickle looks up a global."""
    # A method's wrapper held by its class is not: looked up, it binds (pickle refuses it either way).
    target: object = sys.modules.get(module) if isinstance(module, str) else None
    try:
        for part in qualname.split("."):
            target = getattr(target, part, None)
    except Exception:  # a property or a module's __getattr__ of the user's: not a name to go by
        return False
    return target is wrapper


class _Remake:
    """Makes a wrapper again from its callable, with the options its front end was given: for copy and pickle."""

    __slots__ = ("binding", "decorator")

    def __init__(self, decorator: functools.partial[Any], binding: str) -> None:
        self.decorator, self.binding = decorator, binding

    def __call__(self, fn: Any) -> Any:
        if self.binding == _STATICMETHOD:
            fn = staticmethod(fn)
        elif self.binding == _CLASSMETHOD:
            fn = classmethod(fn)
        return self.decorator()(fn)

    def __reduce__(self) -> tuple[Any, ...]:
        options = dict(self.decorator.keywords)
        options.update(options.pop("options", None) or {})  # accumulate's integrations pass them as one
        for name, value in options.items():
            # A cache given to wrappers made in __init__ holds their bound methods in its keys, and with
            # them their objects: pickled, it pickles them, and one pickled before them cannot be loaded.
            if isinstance(value, SizeCache) and not isinstance(value, (NoCache, DiskCache)):  # text keys, or none
                raise TypeError(
                    f"cannot pickle a koila_retry wrapper made with {name}={value!r}: the cache is shared, and "
                    f"its keys hold the objects of the wrappers made with it. Leave {name}= out (each wrapper "
                    "then gets a new cache of its own), or make the wrapper again after loading (in __setstate__)"
                )
        return _Remake, (self.decorator, self.binding)


def unwrap_binding(fn: Any) -> tuple[Any, str]:
    """Return the function a ``staticmethod`` or ``classmethod`` holds, and how it binds."""
    if isinstance(fn, staticmethod):
        return fn.__func__, _STATICMETHOD
    if isinstance(fn, classmethod):
        return fn.__func__, _CLASSMETHOD
    if not hasattr(type(fn), "__get__"):
        # Held by a class, Python binds no callable object, partial (before 3.14) or bound method.
        return fn, _UNBOUND
    return fn, _METHOD


def bindable(
    fn: Callable[..., Any],
    plain: Callable[..., Any],
    method: Callable[..., Any],
    decorator: functools.partial[Any],
    binding: str = _METHOD,
) -> Any:
    """Return a :class:`Bindable` that runs ``plain`` when called, and ``method`` (object first) when bound.

    ``decorator()`` returns what decorated ``fn``, with the same options (the front end, given them):
    a copy or a pickle of the wrapper is made again with it.
    """
    # A class of its own, whose __call__ is the plain form itself: calling the wrapper then
    # costs about what calling a function does, where a __call__ that forwarded would add
    # a Python frame to every call.
    # A function whose first parameter is ``self`` is a method even when called as it is: through a
    # decorator above this one (@torch.no_grad() on a method), which binds and passes the instance on.
    call = method if binding in (_METHOD, _UNBOUND) and positional_names(fn)[:1] == ("self",) else plain
    kind = type("Bindable", (Bindable,), {"__slots__": (), "__call__": staticmethod(call)})
    wrapper = kind()
    # Every class is in a reference cycle of its own, freed only by a collection: its __call__ would keep
    # what the function closes over (a model, a process group) alive that long after the wrapper is gone
    # (a step decorated inside a training function that returned). Let go with the wrapper, through a weak
    # reference the class holds: weakref.finalize's registry would hold the function until then, and run
    # at exit, while a __del__ may still call the wrapper.
    kind._released = weakref.ref(wrapper, lambda _: delattr(kind, "__call__"))  # type: ignore[attr-defined]
    functools.update_wrapper(wrapper, fn)
    vars(wrapper).update(vars(call))  # __wrapped__, __signature__, stats ... of the form a call runs
    wrapper.__annotations__ = getattr(call, "__annotations__", {})  # without an injected size
    wrapper._method, wrapper._binding, wrapper._remake = method, binding, _Remake(decorator, binding)
    if inspect.iscoroutinefunction(plain):
        # inspect.iscoroutinefunction() takes an object with a function's attributes for one.
        wrapper.__code__, wrapper.__defaults__, wrapper.__kwdefaults__ = plain.__code__, None, None
        if not isinstance(getattr(wrapper, "__name__", None), str):  # an instance with an async def __call__
            wrapper.__name__ = type(fn).__name__
    return wrapper


def _is_async(fn: object) -> bool:
    """Return whether calling ``fn`` makes a coroutine, as far as it and its type tell."""
    return any(inspect.iscoroutinefunction(each) for each in seen_through(fn))


def refuse_generator(fn: Callable[..., Any], front_end: str) -> None:
    """Refuse a generator or async generator function, whose work runs after the call returns."""
    if any(inspect.isgeneratorfunction(each) or inspect.isasyncgenfunction(each) for each in seen_through(fn)):
        name = getattr(fn, "__qualname__", repr(fn))
        raise TypeError(
            f"{front_end} cannot retry {name}(): it is a generator function, whose body runs while the "
            "caller iterates, after the call has returned, where an out-of-memory error cannot be retried. "
            "Decorate a function that returns the results instead (a list of them, say), or one that "
            "consumes the generator"
        )


def refuse_iterators(
    fn: object, args: Sequence[Any], kwargs: Mapping[str, Any], front_end: str, piece: str, before: int = 0
) -> None:
    """Refuse an argument that is an iterator: passed whole to every ``piece`` of a call, the first would use it up."""
    # Refused on every call, one piece or many: how many a call takes depends on the memory free,
    # and whether a call works must not. Files are iterators too, but a piece writes to one or
    # reads it by position: they pass. Two plain loops: accumulate's every step pays for them.
    for position, value in enumerate(args):
        if not isinstance(value, TensorBase) and isinstance(value, Iterator) and not isinstance(value, io.IOBase):
            names = positional_names(cast(Callable[..., Any], fn))
            at = position + before
            _refuse_iterator(fn, names[at] if at < len(names) else f"args[{at}]", value, front_end, piece)
    for name, value in kwargs.items():
        if not isinstance(value, TensorBase) and isinstance(value, Iterator) and not isinstance(value, io.IOBase):
            _refuse_iterator(fn, name, value, front_end, piece)


def _refuse_iterator(fn: object, name: str, value: object, front_end: str, piece: str) -> NoReturn:
    function = getattr(fn, "__name__", None) or type(fn).__name__
    raise TypeError(
        f"{front_end} passes the argument {name} (a {type(value).__name__}) whole to every {piece}'s call "
        f"of {function}(), and an iterator is used up by the first {piece}: the others would see it empty. "
        f"Pass a list (list(...) of the iterator) or a tuple, or make the iterator inside {function}(); an "
        f"iterator that {function}() uses without iterating it can reach it through a closure or "
        "functools.partial. This is checked on every call, however many pieces it would take"
    )


def device_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Return the device of the first tensor argument, else the default device."""
    for value in args:
        if isinstance(value, TensorBase):
            return value.device
    if kwargs:
        for value in kwargs.values():
            if isinstance(value, TensorBase):
                return value.device
    return default_device()


@overload
def batch(fn: Callable[Concatenate[int, P], R], /) -> Batched[P, R]: ...


@overload
def batch(fn: Callable[Concatenate[S, int, P], R], /) -> Batched[Concatenate[S, P], R]: ...


@overload
def batch(*, initial: int = ..., param: None = ..., **options: Unpack[Options]) -> _BatchDecorator: ...


@overload
def batch(
    *, initial: int = ..., param: str, **options: Unpack[Options]
) -> Callable[[Callable[..., R]], Batched[..., R]]: ...


def batch(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    initial: int = DEFAULT_INITIAL,
    param: str | None = None,
    **options: Unpack[Options],
) -> Any:
    """Call a function with the largest batch size that fits, shrinking it on OOM.

    The decorated function receives the batch size as its first positional
    parameter (or the keyword parameter named by ``param``), and callers call it
    without one. Called as a method, bound to an instance (or looked up on its
    class), it receives the size after the instance, whatever its first
    parameter is called: the wrapper binds as a function does. If it runs out of
    memory, the memory of the failed attempt is released and it is called again
    with the largest power of two below the failed size, down to ``minimum``.
    The size that worked is remembered in ``cache``, so the next call from the
    same place starts there. ``async def`` functions work too.

    The function must be safe to run again: if it calls ``backward()``, it should
    zero the gradients first (``optimizer.zero_grad()``), because a backward that
    ran out of memory half-way may already have written some of them; and it
    should leave ``optimizer.step()`` to its caller, since a step that ran out
    of memory half-way has updated some parameters already. A call
    whose argument is an iterator, which the failed attempt may have consumed in
    part, is not retried: it raises ``TypeError``.

    Use it bare (``@koila.batch``) or called (``@koila.batch(initial=256)``).

    Args:
        fn (callable): the function, when used bare; or a ``staticmethod`` or
            ``classmethod`` of one.
        initial (int): the first size to try. Default: 512.
        param (str, optional): inject the size as this keyword argument instead
            of the first positional one. The parameters after it are then
            keyword-only: a positional argument would land on the size.
        **options (Options): the shared options; see :ref:`options`. ``cache``
            defaults to a new :class:`StackMemoryCache` for this function.

    Returns:
        Batched: the wrapped function, with ``stats``, ``cache_info()`` and
        ``cache_clear()``.

    Raises:
        TypeError: if the function has no parameter to inject into, is a
            generator function or already a koila_retry wrapper (decorate the
            undecorated function once), or an option is unknown or has the
            wrong type (``initial=None`` too). When called: if an attempt ran out of memory
            and an argument is an iterator; if it is given the size, or, with
            ``param``, a positional argument for a parameter after it.
        ValueError: if an option is out of range.

    Example::

        >>> import torch, koila_retry as koila
        >>> @koila.batch(initial=1024)
        ... def total(batch_size, data):
        ...     if batch_size > 256:  # stands in for a real OOM
        ...         raise torch.OutOfMemoryError(
        ...             "CUDA out of memory. Tried to allocate 2.00 GiB."
        ...         )
        ...     return sum(chunk.sum() for chunk in data.split(batch_size))
        >>> total(torch.ones(1000))
        tensor(1000.)
        >>> total.stats.batch_size
        256

    .. versionadded:: 0.1.0
    """
    policy = Policy.of("koila.batch", initial, options, own=("initial", "param"))
    decorator = functools.partial(batch, initial=initial, param=param, **options)

    def decorate(function: Callable[..., Any]) -> Any:
        return batched(function, policy, param, decorator=decorator)

    if fn is None:
        return decorate
    return decorate(fn)


def batched(
    fn: Any,
    policy: Policy,
    param: str | None = None,
    *,
    keep_last: bool = False,
    front_end: str = "@koila.batch",
    decorator: functools.partial[Any] | None = None,
) -> Any:
    """Wrap ``fn`` so that each call runs its attempts in the engine, with the size injected.

    ``decorator`` is as :func:`bindable` takes it; without it, a copy is made again by this function.
    """
    fn, binding = unwrap_binding(fn)
    if not callable(fn):
        raise TypeError(f"{front_end} decorates a callable, got {type(fn).__name__} {fn!r}")
    inner = _unpartial(fn)
    # A decorated method looked up on its class or instance is a function (or its bound method) with stats.
    target = getattr(inner, "__func__", inner)
    if isinstance(inner, Bindable) or (
        inspect.isfunction(target) and isinstance(getattr(target, "stats", None), Stats)
    ):
        _refuse_wrapper(inner, front_end)
    refuse_generator(fn, front_end)
    injection = _Injection(fn, param, 0, front_end)
    controller = Controller(
        injection.function_name, policy, explain=exhausted.message, keep_last=keep_last, function=fn
    )
    plain = _wrapper(fn, injection, controller, policy.device)
    if binding is _STATICMETHOD:
        method = plain  # a staticmethod never binds
    elif param is not None:  # by keyword, the size goes to one place, bound or not
        method = _wrapper(fn, injection, controller, policy.device, bound=True)
    else:
        try:
            method = _wrapper(fn, _Injection(fn, None, 1, front_end), controller, policy.device)
        except TypeError as exc:
            # Too few parameters to be a method: an error if it is ever called as one.
            method = _refusing(fn, str(exc), controller)
    if decorator is None:
        # An inner wrapper (compat.accelerate's): made again as this call made it.
        decorator = functools.partial(
            functools.partial, batched, policy=policy, param=param, keep_last=keep_last, front_end=front_end
        )
    return bindable(fn, plain, method, decorator, binding)


def _refuse_wrapper(fn: Any, front_end: str) -> NoReturn:
    """Refuse a koila_retry wrapper (or a decorated method, looked up): it would take the size for an argument."""
    name = callable_name(getattr(getattr(fn, "__func__", fn), "__wrapped__", fn))
    raise TypeError(
        f"{front_end} cannot decorate {fn!r}: it is already a koila_retry wrapper (of {name}), which chooses "
        f"its own batch size and takes its caller's arguments without one, so the size {front_end} injects "
        f"would land on {name}()'s first argument. Decorate the undecorated function once, with the options "
        "you want"
    )


def _keyed(fn: Callable[..., Any]) -> Any:
    """Return what a cache keys ``fn``'s calls by: the function, or its code where it cannot be hashed."""
    try:
        hash(fn)
    except TypeError:  # an instance with __eq__ and no __hash__, such as a dataclass's
        return function_identity(fn)
    # A method bound in __init__, held weakly: a cache shared by many objects' wrappers kept them all alive.
    return weak_method(fn)


def _wrapper(
    fn: Callable[..., Any], injection: _Injection, controller: Controller, fixed_device: Any, bound: bool = False
) -> Any:
    """Return the function that runs a call of ``fn`` in ``controller``, with the size injected.

    ``bound``: the method form, given the object it is bound to first (so is every form with ``position`` 1).
    """
    start, call = controller.start, controller.call
    getframe = sys._getframe
    name, position, max_args = injection.name, injection.position, injection.max_args
    key = _keyed(fn)
    bound = bound or position == 1
    unbound = f"{injection.function_name}() is a method: call it on an instance, or pass the instance first"

    # The injection is spelled out inline: every call of the wrapper pays for each
    # extra Python call, and this is the whole cost of a cached call. The object a method is
    # bound to is a root of its own, not an argument: an iterator instance is not refused a retry.
    if _is_async(fn):

        @functools.wraps(fn)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            if len(args) > max_args or name in kwargs:
                raise injection.refuse(len(args), name in kwargs)
            if bound and not args:
                raise TypeError(unbound)
            roots = (fn, args[0], args[1:], kwargs) if bound else (fn, args, kwargs)
            attempt = start(Call(key, getframe(1), fixed_device or device_of(args, kwargs), roots=roots))
            if position == 0:
                return await run_async(attempt, lambda size: fn(size, *args, **kwargs))
            if position == 1:
                return await run_async(attempt, lambda size: fn(args[0], size, *args[1:], **kwargs))
            return await run_async(attempt, lambda size: fn(*args, **kwargs, **{name: size}))

        wrapper: Any = async_wrapper
    else:

        @functools.wraps(fn)
        def sync_wrapper(*args: Any, **kwargs: Any) -> Any:
            if len(args) > max_args or name in kwargs:
                raise injection.refuse(len(args), name in kwargs)
            device = fixed_device or device_of(args, kwargs)
            if position == 0:
                return call(key, getframe(1), device, lambda size: fn(size, *args, **kwargs), (fn, args, kwargs))
            if bound and not args:
                raise TypeError(unbound)
            if position == 1:
                work = lambda size: fn(args[0], size, *args[1:], **kwargs)  # noqa: E731
            else:
                work = lambda size: fn(*args, **kwargs, **{name: size})  # noqa: E731
            return call(
                key, getframe(1), device, work, (fn, args[0], args[1:], kwargs) if bound else (fn, args, kwargs)
            )

        wrapper = sync_wrapper
    wrapper.__signature__ = injection.signature
    # As the signature: typing.get_type_hints() (jsonargparse, pydantic) must not see the size either.
    wrapper.__annotations__ = {key: value for key, value in getattr(fn, "__annotations__", {}).items() if key != name}
    return with_controller(wrapper, controller)


def _refusing(fn: Callable[..., Any], message: str, controller: Controller) -> Any:
    """Return a method form that raises ``TypeError(message)`` when called."""

    @functools.wraps(fn)
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise TypeError(message)

    return with_controller(refuse, controller)


def with_controller(wrapper: Any, controller: Controller) -> Any:
    """Give a wrapper its controller's ``stats``, ``cache_info()`` and ``cache_clear()``."""
    # Every front end's wrapper comes here: torch.compile runs it as written (see _common/dynamo.py).
    not_traced(wrapper)
    wrapper.stats = controller.stats
    wrapper.cache_info = controller.cache.cache_info
    wrapper.cache_clear = controller.cache.cache_clear
    return wrapper


# Blocks under ``attempts`` share one cache; keys hold the block's code and line.
attempts_cache = StackMemoryCache()


@not_traced  # called inside a compiled function, it runs as written (see _common/dynamo.py)
def attempts(*, initial: int = DEFAULT_INITIAL, **options: Unpack[Options]) -> Attempt:
    """Retry a block of code with smaller batch sizes until it fits in memory.

    A ``with`` block cannot run itself again, so the retry loop is a ``for``
    loop around it. An out-of-memory error inside ``with attempt:`` is
    swallowed, the memory released, and the loop runs the block again with
    ``attempt.batch_size`` at the next smaller power of two. Success ends the
    loop; running out of sizes raises :class:`BatchSizeExhausted`; any other
    error propagates unchanged. Locals the block assigned before failing are
    still bound in your frame: rebind or delete them if they hold large tensors.
    Statements of the loop's body after the block run after every attempt, the
    failed ones included: put all of an attempt's work inside ``with attempt:``.

    Each turn of the loop enters ``with attempt:`` once: entering it again,
    inside the block or after it, raises ``RuntimeError``, and so does entering
    it outside the loop (``with koila.attempts() as attempt:``), where nothing
    would retry the block. Leaving the loop (``break``, ``return``) after an
    attempt that ran out of memory, before the loop retried it, warns with a
    ``RuntimeWarning``: the block's work was not done.

    When the ranks of a ``torch.distributed`` job agree (see :doc:`distributed`),
    every rank must run the block, and run the loop to its end (no ``break``).

    Args:
        initial (int): the first size to try. Default: 512.
        **options (Options): the shared options; see :ref:`options`. ``cache``
            defaults to one :class:`StackMemoryCache` shared by all blocks, keyed
            by the block's place in the code.

    Returns:
        Attempt: an iterator over the attempts of the block; each attempt is
        that same object, a context manager with ``batch_size`` and ``number``.

    Raises:
        TypeError: if an option is unknown or has the wrong type (``initial=None`` too).
        ValueError: if an option is out of range.
        BatchSizeExhausted: from the loop, when even ``minimum`` runs out of memory.
        RuntimeError: from the loop, if an attempt's ``with`` block is entered
            twice; from ``with``, if it is entered outside the loop.

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
    policy = Policy.of("koila.attempts", initial, options)
    # A helper of the user's that returns koila.attempts(...) at once: its loop is its caller's.
    if _returned(caller.f_code, caller.f_lasti) and caller.f_back is not None:
        caller = caller.f_back
    return Block(_started(policy, caller))


@functools.lru_cache(maxsize=256)
def _returned(code: CodeType, offset: int) -> bool:
    """Return whether the call at ``offset`` in ``code`` is returned as soon as it returns."""
    instructions = list(dis.get_instructions(code))
    for index, instruction in enumerate(instructions[:-1]):
        if instruction.offset in (offset, 2 * offset):  # Python 3.10 counts in instructions
            return instructions[index + 1].opname == "RETURN_VALUE"
    return False


def _started(policy: Policy, caller: FrameType) -> Attempt:
    """Start the attempts of a block, named by ``caller``: the frame of its loop."""
    code = caller.f_code
    line = caller.f_lineno
    # Names the block for the cache as a function is named, by file, line and name: strings
    # cache their hashes, where a code object would be rehashed on every use. The line is
    # the block's own, so two blocks in one function have keys of their own in every cache.
    block = (code.co_filename, line, getattr(code, "co_qualname", code.co_name))
    controller = Controller(
        f"block at {code.co_filename}:{line} in {code.co_name}",
        policy,
        default_cache=attempts_cache,
        explain=exhausted.message,
    )
    # The block's modules are those its function's variables hold: read only if the ranks
    # agree (on the modules they reach), and only then, so that no copy of them outlives the
    # start, which a tensor the block deletes to make room for its retry would otherwise do.
    return controller.start(Call(block, caller, policy.device or resolve_device(None), roots=FrameValues(caller)))
