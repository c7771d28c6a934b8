"""Live-storage accounting: the bytes of tensor storages alive at each moment.

One dispatch mode counts the storages created while it is active and forgets each when it is
freed; ``koila_retry.testing.simulated_device`` enforces a limit on it, the estimator reuses it.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _disable_current_modes,
    _get_current_dispatch_mode_stack,
    is_traceable_wrapper_subclass,
)
from torch.utils._pytree import tree_flatten

from koila_retry._common.forks import locks_renewed_in_child, renewed_in_child

# Called with (bytes about to become live, bytes live now) before new storages are
# counted; raising refuses the allocation.
AllocationCheck = Callable[[int, int], None]


class LiveStorageTracker(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Count the bytes of storages that operators create while the mode is active (meta tensors aside)."""

    def __init__(self, check: AllocationCheck | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._check = check
        # Weak references: a storage is forgotten when PyTorch frees it.
        self._storages: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self._sizes: dict[int, int] = {}  # bytes counted for each live storage, which a resize changes
        # Re-entrant: the collector may free a tracked storage, and run its forget(), while this thread holds it.
        self._lock = threading.RLock()
        # A thread of the parent may have held it at a fork: a storage that dies in the child takes it (probe 77D).
        renewed_in_child(self, _new_rlock)
        self.live = 0
        self.peak = 0
        # The peak before the last operator that raised it, and the ids of the storages it counted: a
        # device entered inside this one refuses an allocation after this one counted it (see refused).
        self._rise: tuple[int, list[int]] | None = None

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
        kwargs = kwargs or {}
        effects = _effects(func)
        before = kept = None
        if effects is not None:
            before = growable(func, args, kwargs)
            if self._check is not None:
                # Copies of koila's own, which the devices entered before this one must not count (or refuse).
                with _disable_current_modes():
                    kept = [(tensor, tensor.clone()) for tensor in _at(effects[1], args, kwargs)]
        # The inputs' storages as they are before the operator: an in-place one on a sparse tensor
        # (a.add_(b), a sparse gradient accumulated) gives it indices and values of new storages.
        sparse: list[torch.Tensor] = []
        held = _storages((args, kwargs), sparse)
        out = func(*args, **kwargs)
        fresh = self._fresh_storages(out, held)
        grown = [geometry for geometry in before if geometry.grew()] if before else []
        if not fresh and not grown:
            return out
        # The parts a sparse input was given in place are counted, never refused: the operator has
        # changed it already, and nothing here could put it back as it was.
        regrown = {id(storage) for storage in _storages(sparse)} if sparse else ()
        new_bytes = sum(storage.nbytes() for storage in fresh if id(storage) not in regrown)
        new_bytes += sum(self.growth(geometry) for geometry in grown)
        if self._check is not None and new_bytes:
            try:
                self._check(new_bytes, self.live)
            except BaseException:
                # The trackers entered before this one ran the operator first and counted it: the
                # allocation did not happen, so it must not stay in their peaks.
                refused = [*fresh, *(geometry.tensor.untyped_storage() for geometry in grown)]
                for mode in _get_current_dispatch_mode_stack():
                    if isinstance(mode, LiveStorageTracker) and mode is not self:
                        mode.refused(refused)
                # Like a failed allocation, the refused result must not outlive the error (neither this
                # frame nor the list may keep it), and what the operator wrote is put back: a real device
                # fails before the kernel runs (BatchNorm's running statistics, an out= tensor's size).
                del out, fresh, refused
                for geometry in grown:
                    geometry.restore()
                for tensor, value in kept or ():
                    tensor.copy_(value)
                raise
        peak = self.peak
        for storage in fresh:
            self._add(storage)
        for geometry in grown:
            self.count_growth(geometry)
        if self.peak != peak:
            counted = [id(storage) for storage in fresh]
            self._rise = (peak, counted + [id(geometry.tensor.untyped_storage()) for geometry in grown])
        return out

    def refused(self, storages: list[torch.UntypedStorage]) -> None:
        """Take back the peak that counting ``storages`` raised: a tracker entered after this one refused them."""
        rise, self._rise = self._rise, None
        if rise is None:
            return
        before, counted = rise
        given = {id(storage): storage for storage in storages}
        for key in counted:
            # By identity, alive: an id of a storage freed since may have been reused.
            reference = self._storages.get(key)
            if key not in given or reference is None or reference() is not given[key]:
                return  # the last operator that raised the peak was another one: it stands
        with self._lock:
            self.peak = before  # nothing else was counted between the two

    def growth(self, geometry: Geometry) -> int:
        """Bytes that ``geometry``'s tensor allocated by growing (or replacing) its storage, as counted here."""
        storage = geometry.tensor.untyped_storage()
        if storage is not geometry.storage:
            return 0 if id(storage) in self._storages else storage.nbytes()
        if id(storage) in self._storages:
            return storage.nbytes() - geometry.nbytes
        # Made before the mode, as a resize counts it: from the moment it grows from empty.
        return storage.nbytes() if geometry.nbytes == 0 else 0

    def count_growth(self, geometry: Geometry) -> None:
        """Count what ``geometry``'s tensor grew by, as :meth:`growth` measured it."""
        storage = geometry.tensor.untyped_storage()
        key = id(storage)
        if key not in self._storages:
            if storage is not geometry.storage or geometry.nbytes == 0:
                self._add(storage)
            return
        with self._lock:
            if key in self._sizes:
                # Worked out before live is read: a collection at a call in between (Python 3.12 checks at
                # each) would run forget() here, re-entrant, and a write of what was read would undo it.
                size = storage.nbytes()
                grown = size - self._sizes[key]
                self.live += grown
                self._sizes[key] = size
                self._rose(self.live)

    def _fresh_storages(self, out: Any, held: list[torch.UntypedStorage]) -> list[torch.UntypedStorage]:
        # A result sharing an input's storage (a view, an in-place result) allocated
        # nothing, even when that input was made before the mode and is not tracked.
        seen = {id(storage) for storage in held}
        fresh: dict[int, torch.UntypedStorage] = {}
        for storage in _storages(out):
            key = id(storage)
            if key not in self._storages and key not in seen and key not in fresh:
                fresh[key] = storage
        return list(fresh.values())

    def _add(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)

        def forget(_: object) -> None:
            with self._lock:
                if self._storages.pop(key, None) is not None:
                    size = self._sizes.pop(key, 0)  # before live is read, as in count_growth
                    self.live -= size

        reference = weakref.ref(storage, forget)  # an allocation, where the collector may run: not under the lock
        with self._lock:
            self._storages[key] = reference
            size = storage.nbytes()
            self._sizes[key] = size
            self.live += size
            self._rose(self.live)

    def resizing(self, storage: torch.UntypedStorage, before: int, after: int) -> None:
        """Check a resize of ``storage`` from ``before`` to ``after`` bytes, before it happens, with ``check``."""
        if self._check is None or after <= before:
            return
        if id(storage) in self._storages:
            self._check(after - before, self.live)
        elif before == 0:
            # Made elsewhere and empty: FSDP2 frees its unsharded parameters by resizing their storage to 0,
            # and allocates them again by resizing it back.
            self._check(after, self.live)

    def copying(self, storage: torch.UntypedStorage) -> None:
        """Check a copy of ``storage`` (``UntypedStorage.clone``, which no operator makes) before it is made."""
        if self._check is not None and storage.nbytes():
            self._check(storage.nbytes(), self.live)

    def copied(self, storage: torch.UntypedStorage) -> None:
        """Count ``storage``, a copy ``UntypedStorage.clone`` made."""
        if id(storage) not in self._storages:
            self._add(storage)

    def resized(self, storage: torch.UntypedStorage, before: int) -> None:
        """Count a resize of ``storage`` from ``before`` bytes to its size now."""
        key, after = id(storage), storage.nbytes()
        if key not in self._storages:
            if before == 0 and after > 0:
                self._add(storage)
            return
        with self._lock:
            if key in self._sizes:
                grown = after - self._sizes[key]
                self.live += grown
                self._sizes[key] = after
                self._rose(self.live)

    def _rose(self, live: int) -> None:
        """Note that the bytes alive rose to ``live``; called with the lock held."""
        if live > self.peak:
            self.peak = live


# Where an operator may grow a tensor argument's storage (an ``out=`` tensor, ``resize_``), and the tensors
# it writes besides the results it makes (BatchNorm's running statistics): by operator, from its schema.
_EFFECTS: dict[Any, tuple[tuple[tuple[int, str], ...], tuple[tuple[int, str], ...]] | None] = {}
_RESIZERS = frozenset({"resize_", "resize_as_", "_resize_output_"})
# BatchNorm's kernels that update the running statistics their schemas do not mark as written.
_STATISTICS = ((3, "running_mean"), (4, "running_var"))
_UNMARKED = {f"aten::{name}": _STATISTICS for name in ("native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm")}


def _effects(func: Any) -> tuple[tuple[tuple[int, str], ...], tuple[tuple[int, str], ...]] | None:
    try:
        return _EFFECTS[func]
    except KeyError:
        pass
    schema = getattr(func, "_schema", None)
    grows: list[tuple[int, str]] = []
    keeps: list[tuple[int, str]] = []
    if schema is not None and schema.is_mutable:
        makes = any(returned.alias_info is None for returned in schema.returns)
        returned: set[str] = set()
        for result in schema.returns:
            if result.alias_info is not None:
                returned |= result.alias_info.before_set
        resizes = schema.name.split("::")[-1] in _RESIZERS
        for index, argument in enumerate(schema.arguments):
            info = argument.alias_info
            if info is None or not info.is_write:
                continue
            if argument.kwarg_only or resizes:
                grows.append((index, argument.name))
            elif makes and not info.before_set & returned:
                keeps.append((index, argument.name))
    elif schema is not None and not schema.overload_name:
        keeps.extend(_UNMARKED.get(schema.name, ()))
    effects = (tuple(grows), tuple(keeps)) if grows or keeps else None
    _EFFECTS[func] = effects
    return effects


def growable(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Geometry] | None:
    """Return the tensors that ``func`` may grow in place, as they are before it runs; ``None`` if none."""
    effects = _effects(func)
    if effects is None or not effects[0]:
        return None
    return [Geometry(tensor) for tensor in _at(effects[0], args, kwargs)]


def _at(where: tuple[tuple[int, str], ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The strided tensors (not on meta) that an operator was given at ``where``."""
    found: list[torch.Tensor] = []
    for index, name in where:
        value = args[index] if index < len(args) else kwargs.get(name)
        for tensor in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(tensor, torch.Tensor) and tensor.layout == torch.strided and tensor.device.type != "meta":
                found.append(tensor)
    return found


class Geometry:
    """A tensor's storage, its size, and the tensor's place in it, before an operator that may grow it."""

    __slots__ = ("nbytes", "offset", "shape", "storage", "stride", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.storage = tensor.untyped_storage()
        self.nbytes = self.storage.nbytes()
        self.shape, self.stride, self.offset = tensor.shape, tensor.stride(), tensor.storage_offset()

    def grew(self) -> bool:
        storage = self.tensor.untyped_storage()
        return storage is not self.storage or storage.nbytes() > self.nbytes

    def restore(self) -> None:
        """Put the tensor back in its storage as it was, the storage at its size."""
        # First: set_ grows a storage too small for the tensor (an emptied one, FSDP2's freed parameter's).
        self.tensor.set_(self.storage, self.offset, self.shape, self.stride)
        if self.storage.nbytes() > self.nbytes:
            # Through the method, followed or not: a device outside the one refusing counted the growth.
            self.storage.resize_(self.nbytes)


def _storages(tree: Any, sparse: list[torch.Tensor] | None = None) -> list[torch.UntypedStorage]:
    """Return the storages ``tree``'s tensors hold; its sparse tensors are added to ``sparse``, if given."""
    storages: list[torch.UntypedStorage] = []
    for leaf in tree_flatten(tree)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
            if sparse is not None and leaf.layout in _SPARSE_PARTS:
                sparse.append(leaf)
            _add_storages(leaf, storages)
        elif isinstance(leaf, torch.UntypedStorage):  # set_'s: a tensor given one allocates nothing
            storages.append(leaf)
    return storages


def _add_storages(tensor: torch.Tensor, storages: list[torch.UntypedStorage]) -> None:
    if is_traceable_wrapper_subclass(tensor):
        # A wrapper (DTensor) reports a storage the size of the whole tensor and holds
        # none: what is allocated is what it wraps, one rank's shard for a DTensor.
        names, _ = tensor.__tensor_flatten__()
        for name in names:
            inner = getattr(tensor, name)
            if isinstance(inner, torch.Tensor):
                _add_storages(inner, storages)
        return
    parts = _SPARSE_PARTS.get(tensor.layout)
    if parts is not None:
        # A sparse tensor has no storage of its own: its indices and values hold the memory, and a
        # .values() taken of one made before the mode is a view of them, not an allocation.
        for part in parts:
            _add_storages(getattr(tensor, part)(), storages)
        return
    # Layouts without a storage (MKL-DNN's) count nothing.
    with contextlib.suppress(RuntimeError, NotImplementedError):
        storages.append(tensor.untyped_storage())


def sparse_parts(tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
    """Return the named tensors a sparse tensor's memory is held in; ``None`` for any other layout."""
    parts = _SPARSE_PARTS.get(tensor.layout)
    if parts is None:
        return None
    with torch.no_grad():  # a compressed layout's values() is differentiable: a node of its own, not the tensor's
        return [(part.lstrip("_"), getattr(tensor, part)()) for part in parts]


_SPARSE_PARTS = {
    torch.sparse_coo: ("_indices", "_values"),
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}


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
    """The simulated devices active in the calling thread, innermost last."""

    # Per thread, as the dispatch mode that counts a device's storages is: a thread inside a 16 MiB
    # block leaves another thread's :func:`koila_retry.free_memory` and estimates on the real device.
    def __init__(self) -> None:
        # Run once in each thread that uses the registry: each starts with none active.
        self.active: list[Simulated] = []
        self.refused: Simulated | None = None  # the last to refuse an allocation, while it is active

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
                if self.refused is device:
                    self.refused = None
                with _counting:
                    anywhere[0] -= 1
                return

    def free(self) -> int | None:
        # Every active device counts what the innermost one does: the tightest says what fits.
        active = self.active
        return min(device.free for device in active) if active else None

    def limit(self) -> int | None:
        active = self.active
        return active[-1].limit if active else None

    def device(self) -> Simulated | None:
        active = self.active
        return active[-1] if active else None

    def refusing(self, device: Simulated) -> None:
        """Note that ``device`` refused an allocation: the one a diagnosis then describes."""
        self.refused = device

    def stand_in(self) -> Simulated | None:
        """Return the device a diagnosis describes: the last to refuse, else the one with the least free."""
        active = self.active
        if not active:
            return None
        # Nested devices each refuse what passes their own limit: an outer one, tighter, refuses
        # what an inner one would take.
        refused = self.refused
        return refused if refused is not None else min(reversed(active), key=lambda device: device.free)


# ``free_memory`` reports the innermost simulated device's free bytes while one is
# active in the calling thread, so caches and the estimator see the memory the test
# simulates.
simulated = _SimulatedRegistry()
#: How many simulated devices are active in any thread. Read without a lock on every cached
#: call: while it is 0, as it is outside tests, nothing need look at the thread's own
#: registry, whose every read costs a thread-local lookup.
anywhere = [0]
_counting = threading.Lock()
locks_renewed_in_child(globals(), "_counting")  # a fork while another thread held it


# --- storages resized in place ------------------------------------------------------
#
# ``UntypedStorage.resize_`` allocates or frees without an operator that a dispatch mode
# sees; FSDP2 frees its unsharded parameters between uses this way. Trackers that follow
# resizes (a simulated device's) learn of them through a wrapper put on the method the
# first time one is asked for, in any thread; in threads that follow none it only adds a
# thread-local lookup to a call that allocates anyway.


class _Followers(threading.local):
    def __init__(self) -> None:
        self.trackers: list[LiveStorageTracker] = []


_followers = _Followers()
_resize_lock = threading.Lock()
locks_renewed_in_child(globals(), "_resize_lock")  # a fork while another thread held it
_unwrapped_resize: list[Callable[..., Any]] = []
_unwrapped_clone: list[Callable[..., Any]] = []


def _resize(storage: torch.UntypedStorage, size: int) -> Any:
    trackers = _followers.trackers
    if not trackers:
        return _unwrapped_resize[0](storage, size)
    before = storage.nbytes()
    for tracker in trackers:
        tracker.resizing(storage, before, int(size))
    result = _unwrapped_resize[0](storage, size)
    for tracker in trackers:
        tracker.resized(storage, before)
    return result


def _clone(storage: torch.UntypedStorage) -> Any:
    # What copy.deepcopy of a tensor (a state_dict's, a model's) allocates, outside any operator.
    trackers = _followers.trackers
    if not trackers or storage.device.type == "meta":  # meta tensors count nothing
        return _unwrapped_clone[0](storage)
    for tracker in trackers:
        tracker.copying(storage)
    copy = _unwrapped_clone[0](storage)
    for tracker in trackers:
        tracker.copied(copy)
    return copy


@contextlib.contextmanager
def following_storages(tracker: LiveStorageTracker) -> Any:
    """Let ``tracker`` count, in this thread, the storages resized in place or copied while the block runs."""
    with _resize_lock:
        if not _unwrapped_resize:
            _unwrapped_resize.append(torch.UntypedStorage.resize_)
            torch.UntypedStorage.resize_ = _resize  # type: ignore[method-assign,assignment]
            _unwrapped_clone.append(torch.UntypedStorage.clone)
            torch.UntypedStorage.clone = _clone  # type: ignore[method-assign,assignment]
    _followers.trackers.append(tracker)
    try:
        yield
    finally:
        _followers.trackers.remove(tracker)


def _new_rlock(tracker: Any) -> None:
    tracker._lock = threading.RLock()
