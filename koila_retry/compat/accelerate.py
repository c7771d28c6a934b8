"""``accelerate.utils``' out-of-memory helpers, on koila-retry's engine.

Change the import and nothing else::

    from koila_retry.compat.accelerate import find_executable_batch_size, release_memory

The signatures, the default reduction (``int(batch_size * 0.9)``), the size a
later call starts at, and the errors are accelerate's (1.x). ``accelerate`` need
not be installed.

The differences are on purpose, and :doc:`/migrating` lists them with their
reasons: memory is released after leaving the ``except`` block and never
collected when nothing fails, more errors count as out of memory, giving up
raises :class:`koila_retry.BatchSizeExhausted` (a ``RuntimeError`` with
accelerate's message first), a ``reduce_batch_size_fn`` must shrink the size,
an iterator argument is refused at a retry, and the ranks of a distributed job
agree. For sizes that are powers of two, use :func:`koila_retry.batch` with a
:class:`koila_retry.GlobalCache`.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Coroutine
from typing import Any, overload

from koila_retry._core.cache import GlobalCache
from koila_retry._core.detect import is_oom
from koila_retry._core.memory import DeviceLike, release
from koila_retry._core.policy import scaled
from koila_retry._core.stats import OnOOM, Stats
from koila_retry._frontends.batch import batched, bindable, call_signature, callable_name, unwrap_binding
from koila_retry.compat._adapter import REQUIRED, Option, Table, integer
from koila_retry.exceptions import BatchSizeExhausted

__all__ = ["find_executable_batch_size", "release_memory", "should_reduce_batch_size"]

_REACHED_ZERO = "No executable batch size found, reached zero."


@overload
def find_executable_batch_size(
    function: None = ...,
    starting_batch_size: int = ...,
    reduce_batch_size_fn: Callable[[], int] | None = ...,
    *,
    on_oom: OnOOM | None = ...,
    device: DeviceLike = ...,
    sync: bool | None = ...,
    group: Any = ...,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]: ...


@overload
def find_executable_batch_size(
    function: Callable[..., Any],
    starting_batch_size: int = ...,
    reduce_batch_size_fn: Callable[[], int] | None = ...,
    *,
    on_oom: OnOOM | None = ...,
    device: DeviceLike = ...,
    sync: bool | None = ...,
    group: Any = ...,
) -> Callable[..., Any]: ...


def find_executable_batch_size(
    function: Callable[..., Any] | None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[], int] | None = None,
    *,
    on_oom: OnOOM | None = None,
    device: DeviceLike = None,
    sync: bool | None = None,
    group: Any = None,
) -> Any:
    """Call ``function`` with a batch size that fits, reducing it after each out-of-memory error.

    A drop-in for ``accelerate.utils.find_executable_batch_size``. ``function``
    takes the batch size as its first argument, and callers call the wrapper
    without it. After an out-of-memory error the size becomes
    ``int(batch_size * 0.9)`` (or what ``reduce_batch_size_fn()`` returns), and
    the call gives up when it reaches 0. Later calls start at the size the
    previous one ended at.

    Args:
        function (callable, optional): the function; without it, return a decorator.
        starting_batch_size (int): the first size to try. Default: 128.
        reduce_batch_size_fn (callable, optional): called with no arguments
            after each out-of-memory error; returns the next size, below the
            one that failed, or 0 to give up.
        on_oom (callable, optional): called with a :class:`koila_retry.OOMEvent`
            after each out-of-memory failure (not in accelerate).
        device (torch.device, str or int, optional): the device whose memory
            the call uses. Default: that of the first tensor argument, else the
            current accelerator, else the CPU (not in accelerate).
        sync (bool or None): whether the ranks of a ``torch.distributed`` job
            agree on every size; ``None`` agrees when a process group of more
            than one rank is initialized (not in accelerate).
        group (ProcessGroup, optional): the ranks that agree (not in accelerate).

    Returns:
        callable: the wrapped function, or a decorator when ``function`` is ``None``.

    Raises:
        TypeError: if ``starting_batch_size`` is not an int, ``function`` or
            ``reduce_batch_size_fn`` is not callable, or ``function`` has no
            parameter for the batch size; from the wrapper, if it is given the
            batch size (accelerate's error).
        ValueError: if ``starting_batch_size`` is negative; from the wrapper, if
            ``reduce_batch_size_fn`` returns a size that is not smaller.
        RuntimeError: from the wrapper: if ``starting_batch_size`` is 0
            (accelerate's error), or, as :class:`koila_retry.BatchSizeExhausted`,
            when the size reaches 0.

    Example::

        >>> import torch
        >>> from koila_retry.compat.accelerate import find_executable_batch_size
        >>> tried = []
        >>> @find_executable_batch_size(starting_batch_size=128)
        ... def train(batch_size, data):
        ...     tried.append(batch_size)
        ...     if batch_size > 100:  # stands in for a real OOM
        ...         raise torch.OutOfMemoryError(
        ...             "CUDA out of memory. Tried to allocate 2.00 GiB."
        ...         )
        ...     return len(data) // batch_size
        >>> train(range(1000))
        10
        >>> tried
        [128, 115, 103, 92]
    """
    values = {
        "starting_batch_size": starting_batch_size,
        "reduce_batch_size_fn": reduce_batch_size_fn,
        "on_oom": on_oom,
        "device": device,
        "sync": sync,
        "group": group,
    }
    if function is None:
        return functools.partial(find_executable_batch_size, **values)
    given_function = function  # a staticmethod or classmethod as it is: koila.batch binds it as its class would
    function, binding = unwrap_binding(function)
    if not callable(function):
        raise TypeError(f"find_executable_batch_size wraps a callable, got {type(function).__name__} {function!r}")
    settings = TABLE.read(values)
    try:  # accelerate's guard against passing the batch size counts every parameter (a module's forward's)
        whole = call_signature(function)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"cannot read the signature of {function!r} to pass it the batch size: {exc}") from None
    parameters = list(whole.parameters)
    name = getattr(function, "__name__", None) or callable_name(function)
    # A starting size of 0 is accelerate's error at the first call, not at decoration.
    batched_function: Any = None  # a koila.batch wrapper (it binds as a method does), or None
    if settings["initial"] != 0:
        batched_function = batched(given_function, TABLE.policy(settings), front_end="find_executable_batch_size")

    def run(target: Callable[..., Any], given: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if len(parameters) < len(given) + 1:
            passed = ", ".join(f"{param}={value}" for param, value in zip(parameters[1:], given[1:]))
            raise TypeError(
                f"Batch size was passed into `{name}` as the first argument when called."
                f"Remove this as the decorator already does so: `{name}({passed})`"
            )
        if target is None:
            raise RuntimeError(_REACHED_ZERO)
        try:
            result = target(*args, **kwargs)
        except BatchSizeExhausted as exc:
            _prefixed(exc)
            raise
        return _awaited(result) if inspect.iscoroutine(result) else result

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return run(batched_function, args, args, kwargs)

    # Bound to an instance, the size goes after it, as koila.batch's does (see batch.Bindable).
    @functools.wraps(function)
    def method(instance: Any, *args: Any, **kwargs: Any) -> Any:
        owner = (None, instance) if binding == "classmethod" else (instance, type(instance))  # instance: the class
        bound: Any = None if batched_function is None else batched_function.__get__(*owner)
        if bound is batched_function:  # a callable no class binds (an object with a __call__): given the instance
            return run(bound, (instance, *args), (instance, *args), kwargs)  # after the size, as accelerate's
        return run(bound, (instance, *args), args, kwargs)

    if batched_function is None:
        cache = settings["cache"]
        stats, cache_info, cache_clear = Stats(0), cache.cache_info, cache.cache_clear
    else:
        stats = batched_function.stats
        cache_info, cache_clear = batched_function.cache_info, batched_function.cache_clear
    forms: tuple[Any, ...] = (wrapper, method)
    # Without the size, as koila.batch's forms: the first parameter called plainly, the one after self (or
    # cls) bound, whichever form bindable shows unbound. functools.wraps' signature refused calls made by it.
    given = list(whole.parameters.values())
    hinted = getattr(function, "__annotations__", {})
    shapes = []
    for at in (0, 1):
        kept = given[:at] + given[at + 1 :]
        size = given[at].name if at < len(given) else None
        shapes.append((whole.replace(parameters=kept), {key: value for key, value in hinted.items() if key != size}))
    for form, (signature, hints) in zip(forms, shapes, strict=True):
        form.stats, form.cache_info, form.cache_clear = stats, cache_info, cache_clear
        form.__signature__, form.__annotations__ = signature, hints
    # As accelerate's wrapper, a function, any other callable binds to an instance of a class that holds it.
    binds = (binding,) if given_function is not function else ()
    return bindable(function, wrapper, method, functools.partial(find_executable_batch_size, **values), *binds)


def _prefixed(exc: BatchSizeExhausted) -> None:
    """Begin the message with accelerate's: code written for accelerate looks for it."""
    exc.args = (f"{_REACHED_ZERO} {exc.args[0]}",)


async def _awaited(call: Coroutine[Any, Any, Any]) -> Any:
    """Await an ``async def`` function's attempts, which give up only there."""
    try:
        return await call
    except BatchSizeExhausted as exc:
        _prefixed(exc)
        raise


def _asking(reduce_batch_size_fn: object, name: str) -> Callable[[int], int | None]:
    """Make a schedule that asks ``reduce_batch_size_fn`` for the next size, and checks it."""
    if not callable(reduce_batch_size_fn):
        raise TypeError(
            f"{name} must be callable (with no arguments), got "
            f"{type(reduce_batch_size_fn).__name__} {reduce_batch_size_fn!r}"
        )
    reduce: Callable[[], object] = reduce_batch_size_fn

    def schedule(failed: int) -> int | None:
        size = reduce()
        if size == 0 and not isinstance(size, bool):
            return None
        if isinstance(size, bool) or not isinstance(size, int) or not 0 < size < failed:
            raise ValueError(
                f"{name} returned {size!r} after batch size {failed} ran out of memory; "
                f"it must return a smaller batch size, an int from 0 (give up) to {failed - 1}"
            )
        return size

    return schedule


#: accelerate's options, and what each becomes in koila.
TABLE = Table(
    "find_executable_batch_size",
    {
        # 128 when not given, as in accelerate's signature; 0 raises at the first call.
        "starting_batch_size": Option("initial", integer(0, indexes=False), REQUIRED),
        # int(batch_size * 0.9) when not given, as accelerate's loop takes it.
        "reduce_batch_size_fn": Option("schedule", _asking, scaled(0.9)),
        # koila's own, not in accelerate.
        **{name: Option(name) for name in ("on_oom", "device", "sync", "group")},
    },
    # accelerate keeps one size per decorated function, the last that worked.
    fixed={"cache": GlobalCache},
)


def release_memory(*objects: Any) -> list[None]:
    """Return ``None`` for each object, after collecting garbage and emptying the device's cache.

    A drop-in for ``accelerate.utils.release_memory``: rebind the names to the
    result (``model, optimizer = release_memory(model, optimizer)``); the
    objects are freed when nothing else refers to them. The cache is emptied
    before that rebinding, as in accelerate; for memory released after it, call
    :func:`koila_retry.release` afterwards, or ``del`` the names and call it.

    Args:
        *objects (Any): what to release.

    Returns:
        list: as many ``None`` as there were objects.
    """
    released: list[None] = [None] * len(objects)
    del objects  # our own references, at least, are gone before the collection
    release()
    return released


def should_reduce_batch_size(exception: BaseException) -> bool:
    """Return whether ``exception`` means out of memory (:func:`koila_retry.is_oom`).

    Stands in for ``accelerate.utils.should_reduce_batch_size``, and recognises
    more out-of-memory errors (see :func:`koila_retry.is_oom`).

    Args:
        exception (BaseException): the error.

    Returns:
        bool: ``True`` if it is an out-of-memory error.
    """
    return is_oom(exception)
