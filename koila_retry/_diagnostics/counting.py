"""Count the bytes of the storages alive on one device while scopes open and close.

The counting half of :func:`koila_retry.profile`: a dispatch mode (the estimator's
:class:`~koila_retry._estimation.recorder.Recorder`, which counts meta tensors with
``fake=True``) that raises the high mark of every scope open as the bytes alive rise.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from koila_retry._common.tensors import same_device, tensors_in
from koila_retry._common.tracking import LiveStorageTracker, growable
from koila_retry._estimation.recorder import Recorder

__all__ = ["Scope", "StorageCounter", "Tally", "storage_of"]


class Scope:
    """Bytes alive when a scope opened, and the most alive since."""

    __slots__ = ("high", "start")

    def __init__(self, start: int) -> None:
        self.start = start
        self.high = start


class StorageCounter(Recorder):  # type: ignore[no-untyped-call]
    """Count the bytes of storages alive on one device, for the scopes open now."""

    def __init__(self, device: torch.device, fake: bool) -> None:
        super().__init__(None, None)
        self.device = device
        self.fake = fake
        self.scopes: list[Scope] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if self.fake:
            # The estimator's recorder: every tensor made on meta, and all counted.
            return super().__torch_dispatch__(func, types, args, kwargs)
        kwargs = kwargs or {}
        before = growable(func, args, kwargs)
        out = func(*args, **kwargs)
        for geometry in before or ():
            if same_device(geometry.tensor.device, self.device) and geometry.grew():
                self.count_growth(geometry)
        # A result sharing an input's storage (a view, an in-place result) allocated nothing.
        seen: set[int] | None = None
        for tensor in tensors_in(out):
            if not same_device(tensor.device, self.device):
                continue
            storage = storage_of(tensor)
            if storage is None or id(storage) in self._storages:
                continue
            key = id(storage)
            if seen is None:
                seen = {id(found) for found in map(storage_of, tensors_in([args, kwargs])) if found is not None}
            if key not in seen:
                seen.add(key)
                self._add(storage)
        return out

    def _add(self, storage: torch.UntypedStorage) -> None:
        # The plain count of live bytes: not the estimator's log of categories and moments.
        LiveStorageTracker._add(self, storage)

    def _rose(self, live: int) -> None:
        super()._rose(live)
        for scope in self.scopes:
            if live > scope.high:
                scope.high = live

    def adopt(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count the storages of tensors made before the call, once each."""
        for tensor in tensors:
            if not self.fake and not same_device(tensor.device, self.device):
                continue
            storage = storage_of(tensor)
            if storage is not None and id(storage) not in self._storages:
                self._add(storage)

    def open(self) -> Scope:
        with self._lock:
            scope = Scope(self.live)
            self.scopes.append(scope)
        return scope

    def close(self, scope: Scope) -> tuple[int, int]:
        """Close ``scope``; return how far the bytes alive rose in it, and their net change."""
        with self._lock:
            # Scopes mostly close in the reverse order of opening: look from the end.
            for index in range(len(self.scopes) - 1, -1, -1):
                if self.scopes[index] is scope:
                    del self.scopes[index]
                    break
            return scope.high - scope.start, self.live - scope.start

    def clear(self) -> None:
        """Forget every storage and scope, so that nothing of the run outlives it."""
        with self._lock:
            self._storages.clear()
            self._sizes.clear()
            self.scopes.clear()


def storage_of(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    """Return a tensor's storage, or ``None`` for a layout without one (sparse, nested)."""
    if torch.nn.parameter.is_lazy(tensor) or tensor.layout != torch.strided:
        return None
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


class Tally:
    """The figures of one module direction or one line, over its runs."""

    __slots__ = ("net", "peak", "runs")

    def __init__(self) -> None:
        self.runs = 0
        self.peak = 0
        self.net = 0

    def add(self, rise: int, net: int) -> None:
        self.runs += 1
        self.peak = max(self.peak, rise)
        self.net += net
