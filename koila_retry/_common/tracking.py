"""Live-storage accounting: the bytes of tensor storages alive at each moment.

One dispatch mode counts every storage created while it is active and forgets it
when the storage is freed. ``koila_retry.testing.simulated_device`` enforces a limit
on top of it; the estimator reuses it on fake tensors.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# Called with (bytes about to become live, bytes live now) before new storages are
# counted; raising refuses the allocation.
AllocationCheck = Callable[[int, int], None]


class LiveStorageTracker(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Count the bytes of storages that operators create while the mode is active.

    Storages are deduplicated (views and in-place results add nothing) and
    forgotten through a weak reference when PyTorch frees them. Meta tensors and
    tensors without a storage are not counted.

    Args:
        check (callable, optional): called as ``check(new_bytes, live_bytes)``
            after each operator that created storages, before they are counted.
            If it raises, the new storages are dropped and the exception
            propagates from the operator, like a failed allocation.
    """

    def __init__(self, check: AllocationCheck | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._check = check
        self._storages: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self._lock = threading.Lock()
        self.live = 0
        self.peak = 0

    def reset_peak(self) -> None:
        """Set the peak to the bytes live now."""
        self.peak = self.live

    def live_storages(self) -> list[torch.UntypedStorage]:
        """Return the storages counted and still alive."""
        with self._lock:
            references = list(self._storages.values())
        return [storage for storage in (reference() for reference in references) if storage is not None]

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        fresh = self._fresh_storages(out, (args, kwargs))
        if not fresh:
            return out
        new_bytes = sum(storage.nbytes() for storage in fresh)
        if self._check is not None:
            try:
                self._check(new_bytes, self.live)
            except BaseException:
                # Like a failed allocation, the refused result must not outlive the
                # error: neither this frame nor the list may keep it.
                del out, fresh
                raise
        for storage in fresh:
            self._add(storage)
        return out

    def _fresh_storages(self, out: Any, inputs: Any) -> list[torch.UntypedStorage]:
        # A result sharing an input's storage (a view, an in-place result) allocated
        # nothing, even when that input was made before the mode and is not tracked.
        seen = {id(storage) for storage in _storages(inputs)}
        fresh: dict[int, torch.UntypedStorage] = {}
        for storage in _storages(out):
            key = id(storage)
            if key not in self._storages and key not in seen and key not in fresh:
                fresh[key] = storage
        return list(fresh.values())

    def _add(self, storage: torch.UntypedStorage) -> None:
        key, nbytes = id(storage), storage.nbytes()

        def forget(_: object) -> None:
            with self._lock:
                if self._storages.pop(key, None) is not None:
                    self.live -= nbytes

        with self._lock:
            self._storages[key] = weakref.ref(storage, forget)
            self.live += nbytes
            self._rose(self.live)

    def _rose(self, live: int) -> None:
        """Note that the bytes alive rose to ``live``; called with the lock held."""
        if live > self.peak:
            self.peak = live


def _storages(tree: Any) -> list[torch.UntypedStorage]:
    storages = []
    for leaf in tree_flatten(tree)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
            # Sparse, nested and other layouts have no single storage to count.
            with contextlib.suppress(RuntimeError, NotImplementedError):
                storages.append(leaf.untyped_storage())
    return storages


class Simulated(Protocol):
    """What the registry needs of a simulated device."""

    @property
    def limit(self) -> int: ...

    @property
    def allowed(self) -> int: ...

    @property
    def free(self) -> int: ...

    @property
    def live(self) -> int: ...

    @property
    def peak(self) -> int: ...

    def reset_peak(self) -> None: ...

    def live_storages(self) -> list[torch.UntypedStorage]: ...


class _SimulatedRegistry(threading.local):
    """The simulated devices active in the calling thread, innermost last.

    Per thread, as the dispatch mode that counts a device's storages is: a device limits
    and counts what the thread that entered it allocates, so it is also the memory that
    only that thread reads. A thread inside a 16 MiB block leaves another thread's
    :func:`koila_retry.free_memory`, cache keys and estimates on the real device.
    """

    def __init__(self) -> None:
        # Run once in each thread that uses the registry: each starts with none active.
        self.active: list[Simulated] = []

    def enter(self, device: Simulated) -> None:
        """Make ``device`` this thread's innermost active device."""
        with _counting:
            anywhere[0] += 1
        self.active.append(device)

    def leave(self, device: Simulated) -> None:
        """Remove ``device`` from this thread's active devices, wherever it is among them."""
        active = self.active
        for index in range(len(active) - 1, -1, -1):
            if active[index] is device:
                del active[index]
                with _counting:
                    anywhere[0] -= 1
                return

    def free(self) -> int | None:
        active = self.active
        return active[-1].free if active else None

    def limit(self) -> int | None:
        active = self.active
        return active[-1].limit if active else None

    def device(self) -> Simulated | None:
        active = self.active
        return active[-1] if active else None


# ``free_memory`` reports the innermost simulated device's free bytes while one is
# active in the calling thread, so caches and the estimator see the memory the test
# simulates.
simulated = _SimulatedRegistry()
#: How many simulated devices are active in any thread. Read without a lock on every cached
#: call: while it is 0, as it is outside tests, nothing need look at the thread's own
#: registry, whose every read costs a thread-local lookup.
anywhere = [0]
_counting = threading.Lock()
