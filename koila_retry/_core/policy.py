"""The options every front end takes, checked once, and the schedules of sizes after a failure."""

from __future__ import annotations

import difflib
import math
import numbers
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, SupportsFloat, TypedDict

import torch

from koila_retry._common.callables import check_takes
from koila_retry._common.units import as_int, check_flag, type_name
from koila_retry._core import distributed
from koila_retry._core.cache import SizeCache, made
from koila_retry._core.memory import DeviceLike, resolve_device
from koila_retry._core.snapshot import Target, check_target
from koila_retry._core.stats import OnOOM

__all__ = ["DEFAULT_GROW_AFTER", "DEFAULT_INITIAL", "Options", "Policy", "Schedule", "powers_of_two", "scaled"]

DEFAULT_INITIAL = 512
DEFAULT_GROW_AFTER = 50

#: A schedule: given the size that ran out of memory, the size to try next, or ``None`` to give up.
Schedule = Callable[[int], "int | None"]


def powers_of_two(failed: int) -> int | None:
    """Return the largest power of two below ``failed``: the default schedule.

    500 → 256, 512 → 256, 513 → 512; ``None`` after 1, below which there is
    nothing to try.

    Args:
        failed (int): the size that ran out of memory.

    Returns:
        int or None: the next size, or ``None`` to give up.

    Raises:
        TypeError: if ``failed`` is not an int.

    Example::

        >>> import koila_retry as koila
        >>> [koila.powers_of_two(size) for size in (500, 512, 513, 1)]
        [256, 256, 512, None]

    .. versionadded:: 0.1.0
    """
    if type(failed) is not int:  # the engine's sizes are; a schedule of the user's may pass numpy's
        size = as_int(failed)
        if size is None:
            raise TypeError(f"powers_of_two takes the size that failed, an int, got {type(failed).__name__} {failed!r}")
        failed = size
    return 1 << ((failed - 1).bit_length() - 1) if failed > 1 else None


def _makes_schedules(cls: type) -> bool:
    """Return whether ``cls``'s instances are callable: called with a size, it makes a schedule, not a size."""
    return any("__call__" in vars(base) for base in cls.__mro__[:-1])


class scaled:  # named like a function: a strategy, called like the schedules it stands beside
    """A schedule that multiplies the size that failed by ``factor``, rounded down.

    ``scaled(0.5)`` halves (toma's schedule), ``scaled(0.9)`` takes 90%
    (accelerate's). When the product rounds down to 0, it gives up.

    Args:
        factor (float): strictly between 0 and 1.

    Raises:
        TypeError: if ``factor`` is not a real number (numpy's are).
        ValueError: if ``factor`` is not strictly between 0 and 1.

    Example::

        >>> import koila_retry as koila
        >>> schedule = koila.scaled(0.9)
        >>> schedule(128), schedule(1)
        (115, None)

    .. versionadded:: 0.1.0
    """

    __slots__ = ("factor",)

    def __init__(self, factor: float) -> None:
        # numbers.Real: numpy's floats and ints too (np.float32(0.9), read from a config array, say).
        if isinstance(factor, bool) or not isinstance(factor, (int, float, numbers.Real)):
            raise TypeError(f"factor must be a number, got {type(factor).__name__} {factor!r}")
        if not 0 < factor < 1:
            raise ValueError(f"factor must be strictly between 0 and 1, got {factor}")
        self.factor = as_read(factor)

    def __call__(self, failed: int) -> int | None:
        return int(failed * self.factor) or None

    def grow(self, size: int) -> int:
        """Return the size that growing back tries above ``size``: the smallest this schedule shrinks to it.

        ``scaled(0.5)`` doubles, ``scaled(0.9)`` adds about 11%: growing back
        retraces the steps that shrinking took.

        Args:
            size (int): the size that fitted.

        Returns:
            int: a size above ``size``.

        Example::

            >>> import koila_retry as koila
            >>> koila.scaled(0.9).grow(100), koila.scaled(0.5).grow(100)
            (112, 200)

        .. versionadded:: 0.1.0
        """
        # From the float estimate, step to the exact smallest n whose shrink is not below size. A few
        # steps do; past 2**53 a float's steps are coarser than 1, and more would never end.
        larger = max(size + 1, math.ceil(size / self.factor))
        for _ in range(64):
            if not (larger - 1 > size and int((larger - 1) * self.factor) >= size):
                break
            larger -= 1
        for _ in range(64):
            if int(larger * self.factor) >= size:
                break
            larger += 1
        return larger

    def __repr__(self) -> str:
        return f"scaled({self.factor})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, scaled) and other.factor == self.factor

    def __hash__(self) -> int:
        return hash((scaled, self.factor))


class Options(TypedDict, total=False):
    """The keyword options every front end takes; :ref:`options` describes each.

    .. versionadded:: 0.1.0
    """

    minimum: int
    cache: SizeCache | None
    max_attempts: int | None
    on_oom: OnOOM | None
    device: DeviceLike
    grow: bool
    grow_after: int
    grow_gain: float | None
    clock: Callable[[], float]
    refine: bool
    sync: bool | None
    group: Any
    schedule: Schedule
    snapshot: Target | None
    snapshot_each_oom: bool


_NAMES = frozenset(Options.__annotations__)


# What each option that only growing reads does, for the error that refuses it without grow=True.
_GROWING_OPTIONS = {
    "grow_after": "how many calls in a row must succeed before a larger size is tried",
    "grow_gain": "the least gain in rows per second a larger size must bring",
    "clock": "what times the attempts, when grow_gain weighs throughput",
}


def _refuse_growing_options(front_end: str, options: Mapping[str, Any]) -> None:
    """Refuse an option that only growing back reads, given without ``grow=True``: it would do nothing."""
    for name, does in _GROWING_OPTIONS.items():
        if name in options and not (name == "grow_gain" and options[name] is None):  # None: the default
            raise ValueError(
                f"{front_end}() got {name}={options[name]!r} without grow=True: {name} is {does}, and only "
                f"grow=True grows back. Give grow=True too, or leave {name} out"
            )


def as_read(number: SupportsFloat) -> float:
    """Return ``number`` as a float; a narrower float as it reads (np.float32(0.9) is 0.8999999761...)."""
    if isinstance(number, (int, float)):
        return float(number)
    try:
        return float(str(number))
    except ValueError:  # a Fraction reads "3/100"
        return float(number)


def _positive_int(name: str, value: object) -> int:
    # numbers.Integral: numpy's ints too (read from a config array, say), as scaled() and the schedules take them.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type_name(value)} {value!r}")
    number = int(value)
    if number < 1:
        raise ValueError(f"{name} must be >= 1, got {number}")
    return number


@dataclass(frozen=True)
class Policy:
    """One front end's ``initial`` and :class:`Options`, checked once; ``initial=None``: each call's rows."""

    initial: int | None
    minimum: int = 1
    cache: SizeCache | None = None
    max_attempts: int | None = None
    on_oom: OnOOM | None = None
    device: torch.device | None = None
    grow: bool = False
    grow_after: int = DEFAULT_GROW_AFTER
    grow_gain: float | None = None
    clock: Callable[[], float] = time.perf_counter
    refine: bool = False
    sync: bool | None = None
    group: Any = None
    schedule: Schedule = powers_of_two
    snapshot: Target | None = None
    snapshot_each_oom: bool = False

    @classmethod
    def of(
        cls,
        front_end: str,
        initial: int | None,
        options: Mapping[str, Any],
        *,
        rows: bool = False,
        own: Sequence[str] = ("initial",),
    ) -> Policy:
        """Check a front end's options (``own``: its own); with ``rows`` calls know their rows (``initial=None``)."""
        unknown = sorted(set(options) - _NAMES)
        if unknown:
            close = difflib.get_close_matches(unknown[0], [*own, *sorted(_NAMES)], n=1)
            guess = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(
                f"{front_end}() got an unexpected keyword argument {unknown[0]!r}{guess}; "
                f"its options are {', '.join(own)} and {', '.join(sorted(_NAMES))}"
            )
        if isinstance(initial, str) and initial == "auto":
            raise TypeError(
                f"{front_end}() got initial='auto': the estimated first size is for koila.chunked and "
                f"koila.accumulate, which are given their inputs; give {front_end} an int"
            )
        if initial is None and not rows:
            raise TypeError(
                f"{front_end}() got initial=None: initial must be an int (default {DEFAULT_INITIAL}). None means "
                f"all the rows at once, for the front ends that are given them (koila.chunked, koila.range and "
                f"koila.accumulate); {front_end} is not given its rows"
            )
        policy = cls(initial=initial, **options)
        if not policy.grow:
            _refuse_growing_options(front_end, options)
        return policy

    def __post_init__(self) -> None:
        distributed.check_sync(self.sync)
        distributed.check_group(self.group)
        # Kept as ints: numpy's would reach the sizes, the cache and its file.
        if self.initial is not None:
            object.__setattr__(self, "initial", _positive_int("initial", self.initial))
        object.__setattr__(self, "minimum", _positive_int("minimum", self.minimum))
        if self.initial is not None and self.minimum > self.initial:
            raise ValueError(f"minimum ({self.minimum}) must not exceed initial ({self.initial})")
        if self.max_attempts is not None:
            object.__setattr__(self, "max_attempts", _positive_int("max_attempts", self.max_attempts))
        if self.cache is not None and not isinstance(self.cache, SizeCache):
            raise TypeError(
                "cache must be a koila_retry cache (StackMemoryCache, GlobalCache, NoCache or another SizeCache), "
                + (
                    f"got the class {self.cache.__name__}: give an instance, {self.cache.__name__}()"
                    if isinstance(self.cache, type)
                    else f"got {type(self.cache).__name__} {self.cache!r:.200}"
                )
            )
        cache = self.cache
        if cache is not None and not made(cache):  # it failed at the first call, on a missing attribute
            raise TypeError(
                f"cache {type(cache).__name__} was not made: its __init__ does not call super().__init__(), SizeCache's"
            )
        # None for a class that exec made (a doctest's).
        module = getattr(getattr(type(cache), "key", None), "__module__", None)
        if cache is not None and not (isinstance(module, str) and module.startswith("koila_retry.")):  # yours
            # batch, attempts and range see no inputs: they call it without a sample, as caches before sample had it.
            given = "function, caller and device, and sample where there is one: give sample a default (sample=None)"
            check_takes("a cache's key", cache.key, given, None, None, None)
        if self.on_oom is not None and not callable(self.on_oom):
            raise TypeError(f"on_oom must be callable, got {type(self.on_oom).__name__} {self.on_oom!r}")
        if self.on_oom is not None:
            check_takes("on_oom", self.on_oom, "one OOMEvent", None)
        check_flag("grow", self.grow)
        object.__setattr__(self, "grow_after", _positive_int("grow_after", self.grow_after))
        gain = self.grow_gain
        if gain is not None and (isinstance(gain, bool) or not isinstance(gain, numbers.Real)):
            raise TypeError(f"grow_gain must be a number like 0.03, or None, got {type_name(gain)} {gain!r}")
        if gain is not None and not 0 <= gain < 10:  # NaN fails it too
            raise ValueError(
                f"grow_gain must be at least 0 and below 10 (0 <= grow_gain < 10), the least gain in rows per "
                f"second that growing must bring (0.03 for 3%), or None, got {gain!r}"
            )
        if gain is not None and not isinstance(gain, float):  # a narrower float as it reads, as in scaled()
            object.__setattr__(self, "grow_gain", as_read(gain))
        check_flag("refine", self.refine)
        if not callable(self.clock):
            raise TypeError(f"clock must be callable (seconds, like time.perf_counter), got {self.clock!r}")
        if self.clock is not time.perf_counter:
            check_takes("clock", self.clock, "no arguments, as time.perf_counter is")
        check_target(self.snapshot, self.snapshot_each_oom)
        if isinstance(self.snapshot, str) and not self.snapshot:
            raise ValueError(
                "snapshot='' names no file: give a path like 'oom/rank{rank}.pickle' (with {rank} and "
                "{attempt} filled in), a callable given the snapshot (a dict), or None for no snapshot"
            )
        if self.snapshot_each_oom and self.snapshot is None:
            raise ValueError(
                "snapshot_each_oom=True writes a snapshot at every out-of-memory error, and snapshot= says where: "
                "give snapshot= a path like 'oom/rank{rank}-{attempt}.pickle' or a callable, or leave "
                "snapshot_each_oom=False"
            )
        if not callable(self.schedule):
            raise TypeError(f"schedule must be callable, got {type(self.schedule).__name__} {self.schedule!r}")
        if isinstance(self.schedule, type) and _makes_schedules(self.schedule):  # koila.scaled, not scaled(0.5)
            raise TypeError(
                f"schedule must be a schedule, a callable given the size that failed, got the class "
                f"{self.schedule.__name__}: give an instance of it (koila.scaled(0.5), say)"
            )
        if self.schedule is not powers_of_two and type(self.schedule) is not scaled:  # the library's own take one
            check_takes("schedule", self.schedule, "the batch size that failed, one int", 1)
            grow = getattr(self.schedule, "grow", None)
            if self.grow and grow is not None:  # first called after an OOM and grow_after successes: hours in
                if not callable(grow):
                    raise TypeError(
                        f"schedule.grow must be callable, given the size that fitted, got {type(grow).__name__} "
                        f"{grow!r}: give the schedule a grow(size) method that returns a larger size, or none "
                        "(the next power of two is tried)"
                    )
                check_takes("schedule.grow", grow, "the size that fitted, one int", 1)
        if self.device is not None and not isinstance(self.device, torch.device):
            object.__setattr__(self, "device", resolve_device(self.device))
