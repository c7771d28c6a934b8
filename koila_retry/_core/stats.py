"""What a wrapper tells those who watch it: an event per out-of-memory failure, and counters."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from koila_retry._common.counter import Counter
from koila_retry._common.forks import lock_renewed_in_child

__all__ = ["OOMEvent", "OnOOM", "Stats"]


@dataclass(frozen=True)
class OOMEvent:
    """What an ``on_oom`` hook is told about one out-of-memory failure.

    It never holds the exception: an exception's traceback would keep the failed
    attempt's tensors alive.

    Attributes:
        function (str): the qualified name of the decorated function or block.
        batch_size (int): the size that ran out of memory.
        next_batch_size (int or None): the size tried next, ``None`` if the call
            gives up and raises :class:`BatchSizeExhausted`.
        attempt (int): the number of the failed attempt within the call, from 1.
        device (torch.device): the device the call runs on.
        free_bytes (int): free memory on the device after releasing the failed
            attempt's memory; ``-1`` if the device's memory cannot be read.
        seconds (float): time spent in the failed attempt and the release.
        where (str): the file, line and function where the error was raised:
            the deepest frame of the user's code (outside koila_retry, PyTorch,
            other installed packages and the standard library); without one, the
            PyTorch layer that allocated, or else the user's line that called
            into the library (see :doc:`diagnostics`); for a rank that retries
            because another rank ran out of memory, ``"rank 1"``.
        rank (int or None): when ranks agree (see :doc:`distributed`), the
            rank that ran out of memory, the lowest if several did; ``None``
            in a process that agrees with no other.

    .. versionadded:: 0.1.0
    """

    function: str
    batch_size: int
    next_batch_size: int | None
    attempt: int
    device: torch.device
    free_bytes: int
    seconds: float
    where: str
    rank: int | None = None


OnOOM = Callable[[OOMEvent], object]


class Stats:
    """Counters of one decorated function, updated as it is called.

    Attributes:
        calls (int): calls started with something to run: a ``chunked`` call
            of 0 rows, or a ``range`` call of 0 indices, runs no attempt and
            counts nothing.
        ooms (int): out-of-memory failures recovered from or given up on.
        exhausted (int): calls that gave up after running out of memory: those
            that raised :class:`BatchSizeExhausted`, and those that could not
            retry because an argument is an iterator (their ``TypeError``); not
            a call that an error of its ``schedule`` ended.
        batch_size (int): the size of the latest attempt.
        seconds_lost (float): time spent in failed attempts and in releasing
            their memory.
        throughput (dict): with ``grow=True`` and a ``grow_gain``, the rows per
            second of the attempts that succeeded, by size (the mean of each
            size's, over all the calls, whatever their cache key: ``grow_gain``
            weighs each key's own); for ``accumulate``, by micro-batch size, of
            the whole steps.

    ``copy.copy``, ``copy.deepcopy`` and ``pickle`` take a snapshot, which
    counts nothing more (to send from a worker process, say).

    .. versionadded:: 0.1.0
    """

    def __init__(self, batch_size: int) -> None:
        self.calls_counter = Counter()
        self._lock = threading.Lock()
        lock_renewed_in_child(self, "_lock")
        self.batch_size = batch_size
        self.ooms = 0
        self.exhausted = 0
        self.seconds_lost = 0.0
        self._timed: dict[int, tuple[int, float]] = {}  # size -> (attempts timed, their mean rows/s)

    @property
    def throughput(self) -> dict[int, float]:
        with self._lock:
            return {size: mean for size, (_, mean) in sorted(self._timed.items())}

    def record_time(self, size: int, seconds: float, rows: int) -> float | None:
        """Count an attempt at ``size`` that ran ``rows`` rows in ``seconds``; return the mean rows/s of its size.

        Returns:
            float or None: the mean, or ``None`` if ``seconds`` is not positive (a clock that did not move).
        """
        if seconds <= 0:
            return None
        rate = rows / seconds
        with self._lock:
            count, mean = self._timed.get(size, (0, 0.0))
            count += 1
            mean += (rate - mean) / count
            self._timed[size] = (count, mean)
            return mean

    def rate(self, size: int) -> float | None:
        """Return the mean rows/s of ``size``, or ``None`` if none was timed."""
        with self._lock:
            found = self._timed.get(size)
        return None if found is None else found[1]

    @property
    def calls(self) -> int:
        return self.calls_counter.value

    def record_oom(self, seconds: float) -> None:
        """Count one out-of-memory failure and the time it cost."""
        with self._lock:
            self.ooms += 1
            self.seconds_lost += seconds

    def record_exhausted(self) -> None:
        """Count a call that gives up after running out of memory."""
        with self._lock:
            self.exhausted += 1

    def ran_whole(self, rows: int) -> None:
        """Count a call that ran its whole batch as it came, outside the engine (a trainer's step that fit).

        Args:
            rows (int): the rows of that batch, the call's ``batch_size``.
        """
        self.calls_counter.increment()
        self.batch_size = rows

    def as_dict(self) -> dict[str, float]:
        """Return the counters as a dict, the failure counters read consistently."""
        with self._lock:
            return self._counters()

    def _counters(self) -> dict[str, float]:
        """The counters as a dict, read under the caller's hold of the lock."""
        return {
            "calls": self.calls,
            "ooms": self.ooms,
            "exhausted": self.exhausted,
            "batch_size": self.batch_size,
            "seconds_lost": self.seconds_lost,
        }

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={value!r}" for name, value in self.as_dict().items())
        return f"Stats({fields})"

    def __getstate__(self) -> dict[str, Any]:
        # pickle, copy.copy and copy.deepcopy take a snapshot, with a lock and a counter of its own.
        with self._lock:
            return {**self._counters(), "timed": dict(self._timed)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["batch_size"])  # type: ignore[misc]
        self.calls_counter = Counter(state["calls"])
        self.ooms, self.exhausted, self.seconds_lost = state["ooms"], state["exhausted"], state["seconds_lost"]
        self._timed = state["timed"]
