"""Lend a model's device memory away: parameters, gradients and optimizer state to CPU and back.

Every tensor keeps its identity: the same objects are pointed at new storages (``tensor.data = ...``,
as ``Module.cuda()`` does), each storage copied once and each tensor rebuilt as the view it was, so
the references others hold stay valid and tied weights stay tied.
"""

from __future__ import annotations

import contextlib
import gc
import reprlib
import sys
import threading
import traceback
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch

from koila_retry._common.forks import locks_renewed_in_child
from koila_retry._common.tensors import named_tensors_in
from koila_retry._common.units import format_bytes
from koila_retry._core import memory

__all__ = ["Offload", "offload"]

_CPU = torch.device("cpu")
# The storages (by _cdata) that live Offload blocks hold lent tensors on: a nested block leaves their
# tensors to the block that lent them, which alone knows where they go back.
_LENT: set[int] = set()
_LENT_LOCK = threading.Lock()
locks_renewed_in_child(globals(), "_LENT_LOCK")  # a fork while another thread held it
_PYTHON_KEY = torch._C.DispatchKey.Python


def _forget(addresses: list[int]) -> None:
    with _LENT_LOCK:
        _LENT.difference_update(addresses)


@dataclass(eq=False)
class _Shared:
    """One storage and every lent tensor that views it."""

    home: torch.device  # where the tensors were when they were lent
    pinned: bool  # whether their storage there was pinned memory (a CPU storage)
    storage: torch.UntypedStorage  # where they are now
    tensors: list[torch.Tensor]


class Offload:
    """Tensors lent to the CPU by :func:`offload`, and the way back to their devices.

    Use it as a context manager; :meth:`restore` moves the tensors back early, or
    again after moving them back failed.

    .. versionadded:: 0.1.0
    """

    def __init__(self, modules: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
        self._modules = modules
        self._optimizers = optimizers
        self._lent: list[_Shared] = []
        self._offloaded = False
        self._tensors = 0
        self._nbytes = 0
        self._retained = 0
        self._devices: list[str] = []
        self._forget: Callable[[], object] | None = None

    @property
    def offloaded(self) -> bool:
        """Whether the tensors are on the CPU now, waiting to be moved back."""
        return self._offloaded

    @property
    def nbytes(self) -> int:
        """Bytes copied to the CPU by the last ``with``: each storage once, however many tensors view it."""
        return self._nbytes

    @property
    def retained_nbytes(self) -> int:
        """Bytes of :attr:`nbytes` whose old storages stayed alive where they were.

        Something outside the modules and optimizers still referenced them when
        they were lent (a view of a weight, an autograd graph that saved one, a
        tensor the parameter was made from), so that memory was not freed.
        """
        return self._retained

    def __repr__(self) -> str:
        return (
            f"Offload(offloaded={self._offloaded}, tensors={self._tensors}, nbytes={format_bytes(self._nbytes)}, "
            f"devices={self._devices})"
        )

    def __enter__(self) -> Offload:
        if self._offloaded:
            raise RuntimeError(
                "koila.offload: these tensors are already lent to the CPU; leave the with block or call restore() "
                "before entering it again"
            )
        found = _lendable(self._modules, self._optimizers)  # refuses before anything moves
        with _LENT_LOCK:
            lent = [shared for shared in _by_storage(found) if shared.storage._cdata not in _LENT]
        try:
            probes = _transfer(lent, back=False)
        except BaseException as error:
            _note(error, "koila.offload: nothing was moved; every tensor is where it was")
            raise
        addresses = [shared.storage._cdata for shared in lent]
        with _LENT_LOCK:
            _LENT.update(addresses)
        # A block given up on (its way back failed, and the object dropped) must not leave its addresses
        # lent: storages made later at them would be skipped by every offload after. The object holds the
        # lent storages, so no other storage has their addresses while it lives.
        self._forget = weakref.finalize(self, _forget, addresses)
        self._lent, self._offloaded = lent, True
        self._tensors = sum(len(shared.tensors) for shared in lent)
        self._nbytes = sum(shared.storage.nbytes() for shared in lent)
        self._devices = sorted({str(shared.home) for shared in lent})
        try:
            self._retained = _retained(probes)
            del probes
            memory.empty_caches({shared.home for shared in lent})
        except BaseException:
            # A warning turned into an error must not leave the tensors lent with no
            # ``with`` block to bring them back.
            self.restore()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.restore()

    def restore(self) -> None:
        """Move the lent tensors back to their devices; do nothing if they are not lent.

        Moving back is all or nothing: if it fails, as it does when another job
        still holds the memory, every lent tensor stays on the CPU with its
        values, usable there, and calling ``restore()`` again tries again.

        Raises:
            torch.OutOfMemoryError: if a device has no room for its tensors yet
                (a ``RuntimeError`` on devices without that class); the error
                carries a note that ``restore()`` tries again.

        .. versionadded:: 0.1.0
        """
        if not self._offloaded:
            return
        try:
            _transfer(self._lent, back=True)
        except BaseException as error:
            _note(
                error,
                f"koila.offload: nothing was moved back; the {self._tensors} lent tensors "
                f"({format_bytes(self._nbytes)}) are on the CPU with their values, and restore() on the object "
                "offload() returned (`with koila.offload(...) as lent:`, then `lent.restore()`) tries again",
            )
            raise
        if self._forget is not None:
            self._forget()  # the addresses are no longer lent (once: the finalizer runs no more)
        pinned = _used_pinned(self._lent)
        self._lent, self._offloaded = [], False
        # The tensors are back: nothing to give back on their devices. But left in the
        # host cache, the pinned copies would hold a model's worth of page-locked RAM
        # for the rest of the process.
        with contextlib.suppress(RuntimeError):
            memory.empty_caches((), host=pinned)


def offload(
    model: torch.nn.Module | list[torch.nn.Module] | tuple[torch.nn.Module, ...],
    optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer] | tuple[torch.optim.Optimizer, ...] | None = None,
) -> Offload:
    """Move a model's tensors and its optimizer's state to the CPU for the length of a ``with`` block.

    Parameters, buffers, gradients and optimizer state go to fresh CPU
    storages (page-locked when they come from CUDA), the device's caching
    allocator gives the freed blocks back to the driver, and on leaving the
    block every tensor goes back to the device it came from. Another job can
    use the memory meanwhile, and training resumes without a checkpoint.

    The tensors stay the same objects; only their storages move. Values come
    back bit for bit, with their dtype, shape, strides and storage offsets, and
    tensors that shared a storage (tied weights, views) share one on the CPU and
    afterwards. Tensors on the CPU already are copied too (which frees nothing),
    tensors on the meta device are left alone.

    Args:
        model (torch.nn.Module, list or tuple): the module, or a list or tuple
            of modules, whose parameters, buffers and gradients to move,
            submodules included.
        optimizer (torch.optim.Optimizer, list or tuple, optional): an optimizer,
            or a list or tuple of them, whose state, parameters and tensor
            hyper-parameters to move too. Default: ``None``.

    Returns:
        Offload: the context manager; its :meth:`~Offload.restore` moves the
        tensors back after moving back failed.

    Raises:
        TypeError: if ``model`` or ``optimizer`` is not of a type above.
        NotImplementedError: on entering, if a tensor has no plain strided
            storage (sparse, quantized, nested or a subclass with its own
            dispatch); nothing has moved then.
        RuntimeError: on entering, if the tensors are lent already, or if the
            copies do not fit in host memory; nothing has moved then. On
            leaving, what :meth:`~Offload.restore` raises.

    Example::

        >>> import torch
        >>> import koila_retry as koila
        >>> model = torch.nn.Linear(4, 2)
        >>> weight = model.weight
        >>> before = weight.detach().clone()
        >>> with koila.offload(model) as lent:
        ...     lent
        Offload(offloaded=True, tensors=2, nbytes=40 bytes, devices=['cpu'])
        >>> model.weight is weight and torch.equal(weight, before)
        True

    .. versionadded:: 0.1.0
    """
    modules = _listed(model, "model", torch.nn.Module, "a torch.nn.Module")
    optimizers = _listed(optimizer, "optimizer", torch.optim.Optimizer, "a torch.optim.Optimizer", none_ok=True)
    return Offload(modules, optimizers)


def _listed(value: object, name: str, kind: type, what: str, *, none_ok: bool = False) -> list[Any]:
    """Return ``value``, one ``kind`` or a list or tuple of them (or ``None``, if ``none_ok``), as a list."""
    if value is None and none_ok:
        return []
    if isinstance(value, kind):
        return [value]
    allowed = f"{what}, a list or tuple of them, or None" if none_ok else f"{what}, or a list or tuple of them"
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"koila.offload: {name} must be {allowed}, got {_describe(value)}")
    for index, item in enumerate(value):
        if not isinstance(item, kind):
            raise TypeError(f"koila.offload: {name}[{index}] must be {what}, got {_describe(item)}")
    return list(value)


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):  # a tensor's repr prints its values
        return f"a {type(value).__name__} of shape {tuple(value.shape)}"
    return f"{type(value).__name__} {reprlib.repr(value)}"


# --- what is lent -----------------------------------------------------------------


def _lendable(modules: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """Return every tensor the modules and optimizers hold, each once; refuse any that cannot move."""
    found: dict[int, tuple[str, torch.Tensor]] = {}
    names: dict[int, str] = {}

    def add(label: str, tensor: torch.Tensor | None) -> None:
        # A loop, not recursion: a function that calls itself is a reference cycle, which would keep
        # ``found``, and every tensor lent, alive after the block until the collector ran.
        while tensor is not None and id(tensor) not in found:
            found[id(tensor)] = (label, tensor)
            tensor = tensor.grad if tensor.is_leaf else None  # .grad of a non-leaf warns
            label = f"the gradient of {label}"

    for index, module in enumerate(modules):
        prefix = f"model[{index}]." if len(modules) > 1 else ""
        for path, submodule in module.named_modules():
            for kind, table in (("parameter", submodule._parameters), ("buffer", submodule._buffers)):
                for key, tensor in table.items():
                    if tensor is not None:
                        name = repr(f"{prefix}{path}.{key}" if path else f"{prefix}{key}")
                        names.setdefault(id(tensor), name)
                        add(f"{kind} {name}", tensor)

    for index, optimizer in enumerate(optimizers):
        which = "the optimizer" if len(optimizers) == 1 else f"optimizer[{index}]"
        for number, group in enumerate(optimizer.param_groups):
            for position, parameter in enumerate(group["params"]):
                names.setdefault(id(parameter), f"param_groups[{number}]['params'][{position}] of {which}")
                add(f"parameter {names[id(parameter)]}", parameter)
            for key, value in group.items():
                if key != "params":  # a learning rate may be a tensor, on the device with capturable=True
                    for where, tensor in named_tensors_in(value):
                        add(f"param_groups[{number}][{key!r}]{where} of {which}", tensor)
        for key, value in optimizer.defaults.items():
            for where, tensor in named_tensors_in(value):
                add(f"defaults[{key!r}]{where} of {which}", tensor)
        for parameter, state in optimizer.state.items():
            owner = f"parameter {names.get(id(parameter), '(not in its param_groups)')}"
            for where, tensor in named_tensors_in(state):
                add(f"state{where} of {owner} in {which}", tensor)

    probe = torch.empty(0, device=_CPU)
    lendable = []
    for label, tensor in found.values():
        if torch.nn.parameter.is_lazy(tensor) or tensor.device.type == "meta":
            continue  # no data to move (a lazy module's parameter before its first call)
        reason = _unmovable(tensor, probe)
        if reason is not None:
            gradient = label.startswith("the gradient")
            hint = " (set it to None first, e.g. with optimizer.zero_grad())" if gradient else ""
            raise NotImplementedError(
                f"koila.offload cannot move {label}{hint}: it {reason}, and only tensors with a plain strided "
                "storage can be moved. Nothing was moved"
            )
        lendable.append(tensor)
    return lendable


def _unmovable(tensor: torch.Tensor, probe: torch.Tensor) -> str | None:
    """Return why ``tensor`` cannot be pointed at a copy of its storage, or ``None`` if it can."""
    if tensor.is_quantized:
        return "is quantized"
    if tensor.is_nested:
        return "is a nested tensor"
    if tensor.layout != torch.strided:
        return f"has layout {tensor.layout}"
    if torch._C._dispatch_keys(tensor).has(_PYTHON_KEY):
        return f"is a {type(tensor).__name__}, a tensor subclass with its own __torch_dispatch__"
    if not torch._has_compatible_shallow_copy_type(tensor, probe):
        return f"is on {tensor.device}, whose tensors cannot be pointed at CPU memory"
    return None


def _by_storage(tensors: Iterable[torch.Tensor]) -> list[_Shared]:
    """Group the tensors by the storage they view, in the order they were found."""
    shared: dict[int, _Shared] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        group = shared.get(storage._cdata)
        if group is None:
            pinned = storage.device.type == "cpu" and storage.is_pinned()
            group = shared[storage._cdata] = _Shared(storage.device, pinned, storage, [])
        group.tensors.append(tensor)
    return list(shared.values())


# --- moving -----------------------------------------------------------------------


def _copy_storage(storage: torch.UntypedStorage, device: torch.device, *, pin: bool) -> torch.UntypedStorage:
    """Return a copy of a whole storage on ``device``, in page-locked memory if ``pin``."""
    source = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    copy = torch.empty(storage.nbytes(), dtype=torch.uint8, device=device, pin_memory=pin)
    # Does not wait (the host side is pinned): the caller synchronizes before anything reads the copy.
    copy.copy_(source, non_blocking="cuda" in (storage.device.type, device.type))
    return copy.untyped_storage()


def _point(tensor: torch.Tensor, storage: torch.UntypedStorage) -> torch.Tensor | None:
    """Make ``tensor`` view ``storage`` at the offset, size and strides it has now; return what it was, if replaced.

    ``tensor.data = ...`` leaves a view's ``_base``, and with it the old storage, in place; a view that
    nothing else references gets a new implementation under the same Python object instead. The one
    returned then holds the old storage: dropping it lets that go, and :func:`_unpoint` puts it back.
    """
    # .data= makes the tensor what the view is: an inference tensor, or not, whatever mode the caller is in.
    with torch.inference_mode(tensor.is_inference()):
        view = torch.empty(0, dtype=tensor.dtype, device=storage.device)
        view.set_(storage, tensor.storage_offset(), tensor.size(), tensor.stride())
        # The copy is of the stored bytes; lazily negated or conjugated views read them so.
        if tensor.is_neg():
            view = view._neg_view()
        if tensor.is_conj():
            view = view.conj()
        if not _replaceable(tensor):
            tensor.data = view
            return None
        # A tensor made by .data= is no view, whatever ``view`` is (a conjugate is a view of its own).
        fresh = torch.empty(0, dtype=tensor.dtype, device=storage.device)
    fresh.data = view
    torch._C._autograd._unsafe_set_version_counter((fresh,), (tensor._version,))
    torch._C._swap_tensor_impl(tensor, fresh)
    return fresh


def _replaceable(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a view whose implementation can be swapped for another without anyone noticing."""
    # Not when it requires grad (its autograd state: grad, hooks, graph), is weakly referenced
    # (as torch.utils.swap_tensors refuses) or referenced from C++ (an autograd graph, DDP's gradient buckets).
    return (
        tensor._base is not None
        and not tensor.requires_grad
        and tensor.grad is None
        and not weakref.getweakrefs(tensor)
        and tensor._use_count() == 1  # type: ignore[attr-defined]  # untyped, as swap_tensors uses it
    )


def _unpoint(tensor: torch.Tensor, storage: torch.UntypedStorage, old: torch.Tensor | None) -> None:
    """Undo :func:`_point`: give ``tensor`` back the implementation it had, or point it at ``storage`` again."""
    if old is None:
        _point(tensor, storage)
    else:
        torch._C._swap_tensor_impl(tensor, old)


def _transfer(lent: list[_Shared], *, back: bool) -> list[tuple[weakref.ref[torch.UntypedStorage], int]]:
    """Copy every storage to the CPU, or ``back`` home, point its tensors at the copies; return the old ones' probes."""
    targets = [shared.home if back else _CPU for shared in lent]
    devices = {shared.storage.device for shared in lent} | set(targets)
    copies: list[torch.UntypedStorage] = []
    moved: list[tuple[torch.Tensor, torch.UntypedStorage, torch.Tensor | None]] = []
    owners = _grad_owners(lent, targets)
    taken: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parameter, its .grad) while the .grad is replaced
    try:
        # All or nothing: every copy is made before any tensor moves, so an error (a full device, most often)
        # leaves every tensor on the storage it had. Work queued on a stream that writes these tensors lands first.
        _synchronize(devices)
        for shared, target in zip(lent, targets, strict=True):
            pin = shared.pinned if back else shared.home.type == "cuda"
            copies.append(_copy_storage(shared.storage, target, pin=pin))
        _synchronize(devices)
        for index, shared in enumerate(lent):
            for tensor in shared.tensors:
                # A tensor given another storage inside the block is the user's now.
                if tensor.untyped_storage()._cdata == shared.storage._cdata:
                    owner = owners.get(id(tensor))
                    if owner is not None:
                        # Its parameter refers to it from C++, which would keep the old implementation as its
                        # .grad: let go of it while it is replaced, and take it again once both have moved.
                        owner.grad = None
                        taken.append((owner, tensor))
                    moved.append((tensor, shared.storage, _point(tensor, copies[index])))
        _give_grads(taken)
    except BaseException as error:
        for tensor, storage, old in reversed(moved):
            _unpoint(tensor, storage, old)
        moved.clear()
        for owner, grad in taken:  # both are where they were again
            with contextlib.suppress(RuntimeError):  # the error being raised is the one to report
                owner.grad = grad
        taken.clear()
        copies.clear()
        # The traceback keeps the frames it passed through, and their locals would keep
        # the copies made so far on the device that just ran out.
        traceback.clear_frames(error.__traceback__)
        del error
        with contextlib.suppress(Exception):  # the error being raised is the one to report
            _synchronize(devices)
            memory.empty_caches(set(targets), host=_used_pinned(lent))
        raise
    probes = [(weakref.ref(shared.storage), shared.storage.nbytes()) for shared in lent]
    moved.clear()
    for index, shared in enumerate(lent):
        shared.storage = copies[index]
    return probes


def _grad_owners(lent: list[_Shared], targets: list[torch.device]) -> dict[int, torch.Tensor]:
    """Return, by ``id`` of a lent ``.grad`` that is a view, the parameter that has it, where both move to one place."""
    # Only a view's implementation is replaced (_point), and only when nothing else refers to it.
    going: dict[int, torch.device] = {}
    for shared, target in zip(lent, targets, strict=True):
        for tensor in shared.tensors:
            if tensor.untyped_storage()._cdata == shared.storage._cdata:
                going[id(tensor)] = target
    owners = {}
    for shared in lent:
        for tensor in shared.tensors:
            grad = tensor.grad if tensor.is_leaf else None
            if grad is None or grad._base is None or id(grad) not in going or id(tensor) not in going:
                continue
            if going[id(grad)] == going[id(tensor)]:  # .grad= refuses a gradient on another device
                owners[id(grad)] = tensor
    return owners


def _give_grads(taken: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Give each parameter its ``.grad`` back, the same object; each one given is forgotten."""
    while taken:
        owner, grad = taken[-1]
        owner.grad = grad
        taken.pop()


def _synchronize(devices: Iterable[torch.device]) -> None:
    for device in devices:
        if device.type != "cpu" and memory.on_accelerator(device):
            torch.accelerator.synchronize(device)


def _used_pinned(lent: list[_Shared]) -> bool:
    return any(shared.home.type == "cuda" or shared.pinned for shared in lent)


def _retained(probes: list[tuple[weakref.ref[torch.UntypedStorage], int]]) -> int:
    """Return the bytes of the storages left behind that something still holds; warn if on a device."""
    if all(probe() is None for probe, _ in probes):
        return 0
    gc.collect()  # storages held only by garbage in reference cycles are not held
    held: dict[torch.device, int] = {}
    for probe, nbytes in probes:
        storage = probe()
        if storage is not None:
            held[storage.device] = held.get(storage.device, 0) + nbytes
            del storage
    on_devices = {device: nbytes for device, nbytes in held.items() if device.type != "cpu"}
    if on_devices:
        where = ", ".join(f"{format_bytes(nbytes)} on {device}" for device, nbytes in on_devices.items())
        warnings.warn(
            f"koila.offload moved the tensors to the CPU, but {where} stayed allocated: something outside the "
            "modules and optimizers still refers to those storages (a view of a weight, an autograd graph that "
            "saved one, the tensor a parameter was made from), and it no longer shares memory with the tensors",
            UserWarning,
            stacklevel=3,
        )
    return sum(held.values())


def _note(error: BaseException, note: str) -> None:
    if sys.version_info >= (3, 11):
        error.add_note(note)
