"""Out-of-memory errors on demand, for this project's tests and yours.

* :func:`simulated_device` gives a block of code a memory limit. Real models run
  forward and backward for real on the CPU, every storage they create is counted,
  and an allocation past the limit raises a genuine ``torch.OutOfMemoryError``
  with the CUDA message, deterministically, on any machine.
* :func:`oom_above` and :func:`oom_for` raise realistic out-of-memory errors at
  chosen batch sizes or calls, for unit tests that need no tensors.

.. versionadded:: 0.1.0
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import threading
from collections.abc import Container, Iterable
from types import TracebackType
from typing import Any, cast

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from koila_retry._common.forks import lock_renewed_in_child
from koila_retry._common.tracking import LiveStorageTracker, following_storages, simulated
from koila_retry._common.units import as_int, format_bytes, parse_bytes

__all__ = ["OOMInjector", "SimulatedDevice", "make_oom", "oom_above", "oom_for", "simulated_device"]

_KINDS = ("cuda", "cpu", "mps")


def make_oom(kind: str = "cuda", nbytes: int = 2**31) -> RuntimeError:
    """Return an out-of-memory error as PyTorch raises it on a kind of device.

    Args:
        kind (str): ``"cuda"`` for the caching allocator's
            ``torch.OutOfMemoryError``; ``"cpu"`` for the CPU allocator's plain
            ``RuntimeError`` (Linux message); ``"mps"`` for Apple's.
        nbytes (int): the size of the allocation that failed.

    Returns:
        RuntimeError: the error, not raised.

    Raises:
        TypeError: if ``nbytes`` is not an int.
        ValueError: if ``kind`` is not one of the kinds above, or ``nbytes`` is negative.
    """
    size = as_int(nbytes)  # numpy's ints too
    if size is None:
        raise TypeError(f"nbytes must be an int, the bytes of the allocation that failed, got {nbytes!r}")
    nbytes = size
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, the bytes of the allocation that failed, got {nbytes}")
    if kind == "cuda":
        return torch.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate {format_bytes(nbytes)}. GPU 0 has a total capacity of "
            "79.25 GiB of which 1.06 GiB is free. Of the allocated memory 76.73 GiB is allocated by "
            "PyTorch, and 723.41 MiB is reserved by PyTorch but unallocated."
        )
    if kind == "cpu":
        return RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
            f"you tried to allocate {nbytes} bytes. Error code 12 (Cannot allocate memory)"
        )
    if kind == "mps":
        return RuntimeError(
            "MPS backend out of memory (MPS allocated: 17.00 GB, other allocations: 1.23 GB, max allowed: "
            f"18.13 GB). Tried to allocate {format_bytes(nbytes)} on private pool."
        )
    raise ValueError(f"kind must be one of {_KINDS}, got {kind!r}")


class _DeviceTracker(LiveStorageTracker):  # type: ignore[no-untyped-call]
    """The simulated device's accounting, which lets ``torch.compile`` work under it."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Dynamo refuses to compile under a dispatch mode that does not ignore its
        # internals, runs the model eagerly, and marks its forward as never to be compiled
        # again, outside the block too. With this, the mode is off while Dynamo compiles
        # and on while the graph runs, so a graph's operators count against the limit
        # (with "eager" and "aot_eager"; inductor's kernels allocate past the dispatcher).
        return True

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if self.retired:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)

    # A device left while one entered after it is still active (a generator's block closed inside
    # another) stops counting at once, but PyTorch's stack of modes is only popped from the top: it
    # leaves the stack when the modes above it have.
    retired = False


def _pop_retired() -> None:
    stack = _get_current_dispatch_mode_stack()
    while stack and isinstance(stack[-1], _DeviceTracker) and stack[-1].retired:
        stack.pop().__exit__(None, None, None)  # type: ignore[no-untyped-call]


class SimulatedDevice:
    """A memory limit on the tensors a block of code creates in one thread; see :func:`simulated_device`.

    Attributes:
        limit (int): the limit in bytes: the device's capacity.
        fraction (float): the share of ``limit`` the block may use, as
            :meth:`set_memory_fraction` set it; 1.0 by default.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.fraction = 1.0
        self._tracker: _DeviceTracker | None = None
        self._resizes: contextlib.ExitStack | None = None
        self._peak = 0

    @property
    def allowed(self) -> int:
        """int: the bytes the block may hold at once, ``limit`` times ``fraction``."""
        return int(self.limit * self.fraction)

    def set_memory_fraction(self, fraction: float) -> None:
        """Let the block use only a share of the device, as ``torch.cuda.set_per_process_memory_fraction`` does.

        A shared GPU is often split this way between processes. Allocations past
        ``fraction * limit`` raise the out-of-memory error, whose message says how
        much is allowed, and :func:`koila_retry.free_memory` reports what is left of
        the share.

        Args:
            fraction (float): the share, from 0.0 to 1.0.

        Raises:
            TypeError: if ``fraction`` is not a number.
            ValueError: if ``fraction`` is outside ``[0, 1]``.

        .. versionadded:: 0.1.0
        """
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
            raise TypeError(f"fraction must be a number from 0.0 to 1.0, got {type(fraction).__name__} {fraction!r}")
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction must be from 0.0 to 1.0, got {fraction!r}")
        self.fraction = float(fraction)

    @property
    def live(self) -> int:
        """Bytes of storages created inside the block that are still alive."""
        return self._tracker.live if self._tracker is not None else 0

    @property
    def peak(self) -> int:
        """The most bytes that were alive at once since entering (or :meth:`reset_peak`)."""
        return self._tracker.peak if self._tracker is not None else self._peak

    @property
    def free(self) -> int:
        """Bytes that can still be allocated before the limit (or the share :attr:`allowed`)."""
        return max(self.allowed - self.live, 0)

    def live_storages(self) -> list[torch.UntypedStorage]:
        """Return the storages created inside the block that are still alive.

        Returns:
            list of torch.UntypedStorage: each once, however many tensors view it.

        .. versionadded:: 0.1.0
        """
        return self._tracker.live_storages() if self._tracker is not None else []

    def reset_peak(self) -> None:
        """Make the peak the bytes alive now."""
        if self._tracker is not None:
            self._tracker.reset_peak()

    def _check(self, new_bytes: int, live: int) -> None:
        allowed = self.allowed
        if live + new_bytes > allowed:
            simulated.refusing(self)
            share = "" if allowed == self.limit else f"{format_bytes(allowed)} allowed; "
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {format_bytes(new_bytes)}. Simulated device has a "
                f"total capacity of {format_bytes(self.limit)} of which {format_bytes(self.limit - live)} "
                f"is free. {share}{format_bytes(live)} is allocated by tensors created under "
                "koila_retry.testing.simulated_device."
            )

    def __enter__(self) -> SimulatedDevice:
        if self._tracker is not None:
            raise RuntimeError("this simulated device is already active; make a new one to nest")
        _pop_retired()
        self._tracker = _DeviceTracker(check=self._check)
        self._tracker.__enter__()  # type: ignore[no-untyped-call]
        self._resizes = contextlib.ExitStack()
        self._resizes.enter_context(following_storages(self._tracker))
        simulated.enter(self)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        tracker, self._tracker = self._tracker, None
        resizes, self._resizes = self._resizes, None
        simulated.leave(self)
        if resizes is not None:
            resizes.close()
        if tracker is not None:
            self._peak = tracker.peak
            stack = _get_current_dispatch_mode_stack()
            if stack and stack[-1] is tracker:
                tracker.__exit__(exc_type, exc, tb)  # type: ignore[no-untyped-call]
                _pop_retired()
            else:
                tracker.retired = True

    def __repr__(self) -> str:
        share = "" if self.fraction == 1.0 else f", fraction={self.fraction}"
        return (
            f"SimulatedDevice(limit={format_bytes(self.limit)}{share}, live={format_bytes(self.live)}, "
            f"peak={format_bytes(self.peak)})"
        )


def simulated_device(limit: int | str) -> SimulatedDevice:
    """Limit the memory of the tensors created inside a ``with`` block.

    Inside the block, every storage an operator creates (forward, backward,
    optimizer steps, factory functions) counts against ``limit`` until it is
    freed; views and in-place results count nothing extra. An operator that
    would go past the limit raises ``torch.OutOfMemoryError`` with a CUDA-style
    message, and its result is dropped, as if the allocation had failed.
    Tensors created before the block do not count. A storage resized in place
    (``untyped_storage().resize_()``, as FSDP2 frees and gathers its unsharded
    parameters) counts its new size, and one made before the block counts from
    the moment it grows from empty. Code compiled by ``torch.compile`` with
    ``backend="aot_eager"`` counts as eager code does; the kernels of the default
    backend, inductor, allocate past the operators the device sees and count
    nothing, so compile with ``"aot_eager"`` in tests that need the limit.

    The block belongs to the thread that entered it, as a PyTorch dispatch
    mode does: the limit applies to that thread's operators alone. Tensors that
    other threads create meanwhile neither count against it nor run into it,
    and other threads see no simulated device: their
    :func:`koila_retry.free_memory`, cache keys and estimates are those of the
    real device. In the thread that entered it, while the block is active,
    :func:`koila_retry.free_memory` reports the simulated free memory. Exit the
    block in the thread that entered it.

    Args:
        limit (int or str): bytes, or a size such as ``"512MiB"`` or ``"2GB"``.

    Returns:
        SimulatedDevice: a context manager with ``live``, ``peak``, ``free``
        and ``limit``.

    Raises:
        TypeError: if ``limit`` is neither an int nor a str.
        ValueError: if ``limit`` is negative, not a size, or not a whole number of
            bytes (``"0.1B"``, ``"0.1 KiB"``).

    Example::

        >>> import torch
        >>> from koila_retry.testing import simulated_device
        >>> with simulated_device("1MiB") as device:
        ...     small = torch.zeros(1024)  # 4 KiB
        ...     device.live
        4096
        >>> with simulated_device("1MiB"):
        ...     torch.zeros(1024, 1024)  # 4 MiB
        Traceback (most recent call last):
        ...
        torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 MiB. ...
    """
    return SimulatedDevice(parse_bytes(limit, whole=True))


class OOMInjector:
    """A callable that raises an out-of-memory error on chosen calls.

    Call it inside the code under test, with the batch size if it decides by
    size. ``calls`` counts the calls and ``raised`` the errors raised.
    """

    def __init__(
        self, *, above: int | None = None, on_calls: Container[int] | None = None, first: int = 0, kind: str
    ) -> None:
        make_oom(kind)  # validates kind
        self._above = above
        self._on_calls = on_calls
        self._first = first  # the first calls that fail, counted, not listed: oom_for(sys.maxsize) is every call
        self._kind = kind
        self._lock = threading.Lock()
        lock_renewed_in_child(self, "_lock")  # a forked child's calls: the parent's may be held by another thread
        self.calls = 0
        self.raised = 0

    def __getstate__(self) -> dict[str, Any]:
        # Pickled (an argument of torch.multiprocessing.spawn) or deep-copied, each copy counts its own calls.
        state = dict(vars(self))
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update(state)
        self._lock = threading.Lock()
        lock_renewed_in_child(self, "_lock")

    def __call__(self, batch_size: int | None = None) -> None:
        """Count a call, and raise an out-of-memory error if this call is chosen.

        Args:
            batch_size (int, optional): the size in use; required by
                :func:`oom_above` injectors.

        Raises:
            RuntimeError: the out-of-memory error (``torch.OutOfMemoryError``
                for ``kind="cuda"``), when this call is chosen.
            TypeError: if an :func:`oom_above` injector is called without a size.
        """
        with self._lock:
            self.calls += 1
            if self._above is not None:
                if batch_size is None:
                    raise TypeError("an oom_above() injector must be called with the batch size")
                fail = batch_size > self._above
            else:
                fail = self.calls <= self._first or (self._on_calls is not None and self.calls in self._on_calls)
            if fail:
                self.raised += 1
        if fail:
            raise make_oom(self._kind)


def oom_above(limit: int, *, kind: str = "cuda") -> OOMInjector:
    """Return an injector that raises out-of-memory errors for sizes above ``limit``.

    Args:
        limit (int): the largest batch size that "fits".
        kind (str): the kind of error, as in :func:`make_oom`.

    Returns:
        OOMInjector: call it as ``inject(batch_size)``.

    Raises:
        TypeError: if ``limit`` is not an int (numpy's ints are).
        ValueError: if ``limit`` is negative or ``kind`` unknown.

    Example::

        >>> import koila_retry as koila
        >>> from koila_retry.testing import oom_above
        >>> fits = oom_above(100)
        >>> @koila.batch(initial=1000)
        ... def run(batch_size):
        ...     fits(batch_size)
        ...     return batch_size
        >>> run()
        64
    """
    largest = as_int(limit)  # numpy's ints too, as make_oom and oom_for take them
    if largest is None:
        raise TypeError(f"limit must be an int, the largest batch size that fits, got {type(limit).__name__} {limit!r}")
    if largest < 0:
        raise ValueError(f"limit must be an int >= 0, the largest batch size that fits, got {largest}")
    return OOMInjector(above=largest, kind=kind)


def oom_for(calls: int | Iterable[int], *, kind: str = "cuda") -> OOMInjector:
    """Return an injector that raises out-of-memory errors on chosen calls.

    Args:
        calls (int or iterable of int): an int ``n`` fails the first ``n`` calls;
            a finite iterable gives the numbers of the calls to fail, counting
            from 1 (a ``range``, kept as it is, may be as long as you like).
        kind (str): the kind of error, as in :func:`make_oom`.

    Returns:
        OOMInjector: call it as ``inject()``.

    Raises:
        TypeError: if ``calls`` is a bool, neither an int nor an iterable, or an
            iterator of ``itertools`` that may never end (``count``, ``cycle``,
            ``repeat`` without a count).
        ValueError: if a count or call number is below the allowed range, or
            ``kind`` is unknown.
    """
    # An array of call numbers is iterable, and has __index__ too: taken as numbers; one of no dimensions
    # (a 0-d tensor) is a count, and iterating it would raise.
    listed = isinstance(calls, Iterable) and getattr(calls, "ndim", 1) != 0
    count = None if listed else as_int(calls)
    if (count is None and not listed) or isinstance(calls, (str, bytes)):
        raise TypeError(f"calls must be an int or an iterable of ints, got {type(calls).__name__} {calls!r}")
    if count is not None:
        if count < 0:
            raise ValueError(f"calls must be >= 0, got {count}")
        return OOMInjector(first=count, kind=kind)
    if isinstance(calls, range):  # kept as it is: range(1, 10**9, 2) asks nothing of memory
        lowest = min(calls[0], calls[-1]) if calls else 1  # not min(calls), which would read every number
        if lowest < 1:
            raise ValueError(f"call numbers are ints counting from 1, got {calls!r}, which holds {lowest}")
        return OOMInjector(on_calls=calls, kind=kind)
    # A repeat with a count says its length; a cycle is endless but for one over nothing.
    endless = isinstance(calls, (itertools.count, itertools.cycle)) or (
        isinstance(calls, itertools.repeat) and operator.length_hint(calls, -1) < 0
    )
    if endless:
        raise TypeError(
            f"calls must be a finite iterable of call numbers, got {calls!r}, which may never end: give a range "
            "instead, as range(1, 10**9, 2) for every other call, or a list"
        )
    else:
        given = list(cast(Iterable[Any], calls))
        numbers = [as_int(n) for n in given]
        bad = [n for n, number in zip(given, numbers, strict=True) if number is None or number < 1]
        if bad:
            raise ValueError(f"call numbers are ints counting from 1, got {sorted(bad, key=repr)}")
        chosen = frozenset(cast(list[int], numbers))
    return OOMInjector(on_calls=chosen, kind=kind)
