"""Lend one thread meta copies of what a call owns, while every other thread keeps the real objects.

Each container attribute of each object lent (a module's ``_parameters``, an optimizer's
``state``) is replaced, by one store into the object's ``__dict__``, with a :class:`Lent`
proxy that answers the borrowing thread from an overlay of meta copies and every other
thread from the real container. Attributes themselves cannot be told apart by thread:
another thread that rebinds one of a lent object while the loan lasts loses that write
(docs/estimate.rst, "Estimating a model that other threads use").
"""

from __future__ import annotations

import contextlib
import copy
import threading
import weakref
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch
from torch.nn.modules import module as module_globals
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten
from torch.utils.module_tracker import ModuleTracker

from koila_retry._common.forks import locks_renewed_in_child, renewed_in_child
from koila_retry._common.tensors import same_device
from koila_retry._common.walk import reachable
from koila_retry._common.warn import global_hooks_added, global_hooks_removed
from koila_retry._estimation.reads import READS, ValueReads
from koila_retry._estimation.recorder import META, Recorder
from koila_retry._estimation.sharding import Emulation, Sharding

__all__ = ["Lent", "Loan", "Owned", "Swapping", "ThreadTracker", "borrowed", "borrowing", "exclusive"]

# Estimates run one at a time in a process: two loans of the same object would nest
# their proxies, and the first to end would take the second's away mid-run. The lock is
# reentrant for a call that estimates inside an estimate. Real calls never take it.
_ONE_AT_A_TIME = threading.RLock()
# Made anew in a child forked while another thread estimated: waiting for that estimate before forking
# deadlocked one that waits for the fork (a multiprocessing pool's own thread forks its workers, probe 75H).
locks_renewed_in_child(globals(), "_ONE_AT_A_TIME")
_local = threading.local()

# How deep into a container the overlay copies containers (an optimizer's groups hold
# dicts that hold lists of parameters; a gradient scaler's record holds a dict per
# optimizer that holds a dict per device): the run writes into those copies, not the real ones.
_DEPTH = 3
_MISSING = object()


@contextlib.contextmanager
def exclusive() -> Iterator[None]:
    """Hold the process's one estimate lock for the block; the thread counts as borrowing meanwhile."""
    with _ONE_AT_A_TIME:
        _local.depth = getattr(_local, "depth", 0) + 1
        try:
            yield
        finally:
            _local.depth -= 1


def borrowing() -> bool:
    """Return whether this thread is inside an estimate (holds the estimate lock)."""
    return bool(getattr(_local, "depth", 0))


# --- the proxies ------------------------------------------------------------------


class Lent:
    """A container that answers its borrowing thread from an overlay and every other thread from the real one."""

    # Every method is forwarded to the calling thread's view; the proxy's own storage mirrors
    # the real container for C code that reads it directly (PyDict_GetItem, a list's items).
    _real: Any
    _overlay: Any
    _thread: int | None
    _kind: Any  # the container type it stands for, whose methods read and write its own storage
    _weak: weakref.ref[Any]  # the real container, once released

    def _view(self) -> Any:
        return self._overlay if threading.get_ident() == self._thread else self._real

    def _mirror(self) -> None:
        """Make the proxy's own storage hold what the real container holds."""
        raise NotImplementedError

    def retire(self) -> None:
        """End the loan: from now on every thread, the borrower too, reads and writes the real container."""
        self._thread = None
        self._overlay = None

    def release(self) -> bool:
        """Refer to the real container weakly from now on, mirroring nothing; ``False`` where it cannot be."""
        # A retired proxy kept for a weak referrer must not keep what the container holds alive: a
        # hook that is a bound method of its module would keep the module, the proxy's owner, for ever.
        real = self._real
        try:
            self._weak = weakref.ref(real)
        except TypeError:  # a dict or a list, which nothing outside a loan can refer to weakly either
            return False
        self.__class__ = _RELEASED[type(self)]
        # A method of another thread that began before the line above may still read _real: a weak
        # proxy answers it as the container would.
        self._real = weakref.proxy(real)
        self._kind.clear(self)
        return True

    def _plain(self) -> Any:
        """Return the container this thread sees, past any proxy it is a proxy of."""
        view = self._view()
        while isinstance(view, Lent):
            view = view._view()
        return view

    # Copied or pickled, a proxy is the plain container this thread sees.
    def __copy__(self) -> Any:
        return copy.copy(self._plain())

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return copy.deepcopy(self._plain(), memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Rebuilt by the container type itself, so that loading it needs nothing of this package.
        view = self._plain()
        if isinstance(view, defaultdict):
            return type(view), (view.default_factory, list(view.items()))
        if isinstance(view, dict):
            return type(view), (list(view.items()),)
        return type(view), (list(view),)

    def __reduce__(self) -> Any:
        return self.__reduce_ex__(2)


# Methods that only read, and methods that write (after which the mirror follows the real container).
_READS = ["__getitem__", "__contains__", "__iter__", "__reversed__", "__len__", "__eq__", "__ne__", "__repr__", "copy"]
_DICT_READS = [*_READS, "__or__", "__ror__", "get", "keys", "values", "items"]
_DICT_WRITES = ["__setitem__", "__delitem__", "pop", "popitem", "setdefault", "update", "clear", "move_to_end"]
_LIST_READS = [*_READS, "__lt__", "__le__", "__gt__", "__ge__", "__add__", "__mul__", "__rmul__", "index", "count"]
_LIST_WRITES = ["__setitem__", "__delitem__", "append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse"]


def _forwarding(name: str, writes: bool, in_place: str | None = None) -> Callable[..., Any]:
    """Return the proxy's method ``name``; with ``in_place``, an operator that calls that one and returns the proxy."""

    def method(self: Lent, /, *args: Any, **kwargs: Any) -> Any:
        view = self._view()
        out = getattr(view, in_place or name)(*args, **kwargs)
        if writes and view is self._real:
            self._mirror()
        return out if in_place is None else self

    method.__name__ = method.__qualname__ = name
    return method


class _LentMapping(Lent):
    def _mirror(self) -> None:
        base, real = self._kind, self._real
        for key in [key for key in base.keys(self) if key not in real]:
            base.__delitem__(self, key)
        for key, value in real.items():
            base.__setitem__(self, key, value)


class _LentSequence(Lent):
    _kind = list

    def _mirror(self) -> None:
        list.__setitem__(self, slice(None), list(self._real))  # type: ignore[call-overload]


for _name in _DICT_READS:
    setattr(_LentMapping, _name, _forwarding(_name, writes=False))
for _name in _DICT_WRITES:
    setattr(_LentMapping, _name, _forwarding(_name, writes=True))
for _name in _LIST_READS:
    setattr(_LentSequence, _name, _forwarding(_name, writes=False))
for _name in _LIST_WRITES:
    setattr(_LentSequence, _name, _forwarding(_name, writes=True))
# In-place operators give back the proxy, so that ``proxy += x`` keeps the attribute a proxy.
_LentMapping.__ior__ = _forwarding("__ior__", True, "update")  # type: ignore[attr-defined]
_LentSequence.__iadd__ = _forwarding("__iadd__", True, "extend")  # type: ignore[attr-defined]
_LentSequence.__imul__ = _forwarding("__imul__", True, "__imul__")  # type: ignore[attr-defined]


class _LentDict(_LentMapping, dict):  # type: ignore[type-arg]
    _kind = dict


class _LentOrderedDict(_LentMapping, OrderedDict):  # type: ignore[type-arg]
    _kind = OrderedDict


class _LentDefaultDict(_LentMapping, defaultdict):  # type: ignore[type-arg]
    _kind = defaultdict


class _LentList(_LentSequence, list):  # type: ignore[type-arg]
    pass


class _Released(Lent):
    """A retired proxy kept for its weak referrers (see ``_retain``): it holds the real container weakly."""

    def _view(self) -> Any:
        real = self._weak()
        return self._kind() if real is None else real  # gone with its owner: an empty one

    def _mirror(self) -> None:
        pass


class _ReleasedDict(_Released, _LentDict):
    pass


class _ReleasedOrderedDict(_Released, _LentOrderedDict):
    pass


class _ReleasedDefaultDict(_Released, _LentDefaultDict):
    pass


class _ReleasedList(_Released, _LentList):
    pass


_RELEASED: dict[type, type] = {
    _LentDict: _ReleasedDict,
    _LentOrderedDict: _ReleasedOrderedDict,
    _LentDefaultDict: _ReleasedDefaultDict,
    _LentList: _ReleasedList,
}

# Exactly these types are lent: a subclass of one may keep state or behaviour of its own.
_PROXIES: dict[type, type] = {
    dict: _LentDict,
    OrderedDict: _LentOrderedDict,
    defaultdict: _LentDefaultDict,
    list: _LentList,
}


def borrowed(value: Any) -> Any:
    """Return the copy of the lent container ``value`` that this thread borrows; ``None`` where it sees the real one."""
    if isinstance(value, Lent) and value._thread == threading.get_ident():
        return value._overlay
    return None


def _seen(value: Any) -> Any:
    """Return what this thread sees of ``value``: the plain container behind a proxy, anything else itself."""
    return value._plain() if isinstance(value, Lent) else value


def _proxy(real: Any, overlay: Any, thread: int) -> Lent:
    """Return a proxy of ``real`` (a container, or a proxy of one) that shows ``overlay`` to ``thread``."""
    kind = _PROXIES[type(_seen(real))]
    made: Lent = kind(real.default_factory) if isinstance(real, defaultdict) else kind()
    made._real, made._overlay, made._thread = real, overlay, thread
    made._mirror()
    return made


# --- the loan ---------------------------------------------------------------------

_MOVES = frozenset((torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu, torch.Tensor.pin_memory, torch.Tensor.type))
# The legacy type names of Tensor.type, by dtype.
_TYPES = {
    torch.float32: "FloatTensor",
    torch.float64: "DoubleTensor",
    torch.float16: "HalfTensor",
    torch.bfloat16: "BFloat16Tensor",
    torch.int64: "LongTensor",
    torch.int32: "IntTensor",
    torch.int16: "ShortTensor",
    torch.int8: "CharTensor",
    torch.uint8: "ByteTensor",
    torch.bool: "BoolTensor",
    torch.complex64: "ComplexFloatTensor",
    torch.complex128: "ComplexDoubleTensor",
}
_DTYPES = {name: dtype for dtype, name in _TYPES.items()}


def _typed(tensor: torch.Tensor, rest: list[Any], options: dict[str, Any], target: torch.device) -> Any:
    """Run ``Tensor.type`` as on ``target``: its name there, or a move to the legacy type's device and dtype."""
    kind = rest[0] if rest else options.get("dtype")
    if tensor.device.type != "meta" or (kind is not None and not isinstance(kind, (str, type))):
        return torch.Tensor.type(tensor, *rest, **options)  # a real tensor of the caller's, or a dtype
    if kind is None:  # the name: the target's, not the meta device's
        cuda = "cuda." if target.type == "cuda" else ""
        return f"torch.{cuda}{_TYPES.get(tensor.dtype, 'Tensor')}"
    name = (
        kind if isinstance(kind, str) else f"torch.{'cuda.' if getattr(kind, 'is_cuda', False) else ''}{kind.__name__}"
    )
    parts = name.split(".")
    dtype = _DTYPES.get(parts[-1])
    if dtype is None:
        return torch.Tensor.type(tensor, *rest, **options)  # PyTorch's own error
    device = torch.device("cuda") if "cuda" in parts else target if "meta" in parts else torch.device("cpu")
    options = {key: value for key, value in options.items() if key == "non_blocking"}
    return _moved(torch.Tensor.to, (tensor, device, dtype), options, target)


def _moved(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], target: torch.device) -> Any:
    """Run a move of a tensor to a device as the run on ``target`` would: the tensor itself if it stays there."""
    tensor, *rest = args
    options = dict(kwargs)
    copy = bool(options.pop("copy", False))
    if func is torch.Tensor.pin_memory:  # a host copy for a GPU to read, where no CPU peak is estimated
        return tensor if tensor.device.type == "meta" else func(*args, **kwargs)
    if func is torch.Tensor.type:
        return _typed(tensor, rest, options, target)
    layout: torch.memory_format | None
    try:
        if func is torch.Tensor.to:
            device, dtype, non_blocking, layout = torch._C._nn._parse_to(*rest, **options)
        else:
            device = torch.device("cpu") if func is torch.Tensor.cpu else torch.device("cuda")
            dtype, non_blocking = None, bool(options.get("non_blocking", False))
            layout = options.get("memory_format")
    except (TypeError, RuntimeError):
        return func(*args, **kwargs)  # PyTorch's own error, or a form not parsed here
    if device is not None and device != META:
        here = target if tensor.device.type == "meta" else tensor.device  # a real tensor of the caller's
        stays = device.type == here.type and (device.index is None or here.index in (None, device.index))
        if stays and not copy and dtype in (None, tensor.dtype) and layout in (None, torch.preserve_format):
            return tensor  # already there: a real move returns the tensor itself, making nothing
        device = META  # on the meta device, as everything of the run, without starting CUDA
    return torch.Tensor.to(
        tensor,
        device=device,
        dtype=dtype,
        non_blocking=non_blocking,
        copy=copy,
        memory_format=layout or torch.preserve_format,
    )


class Swapping(TorchFunctionMode):
    """Give torch functions the borrower's view: meta copies for lent tensors, plain lists for proxied ones."""

    # PyTorch keeps a stack of function modes per thread, so this one is the borrower's alone. It acts
    # above autograd: a lent tensor reached other than through a container (an RNN's _flat_weights)
    # never enters the graph, its meta copy does. It also answers the value reads that never reach a
    # dispatch mode (reads.py), rather than a second mode that would tax every torch function.

    def __init__(self, target: torch.device = META) -> None:
        super().__init__()
        # id of a lent tensor -> (the tensor, its meta copy); the copy lives as long as what holds it.
        self.table: dict[int, tuple[torch.Tensor, weakref.ref[torch.Tensor]]] = {}
        self.reads: ValueReads | None = None
        self.target = target  # the device the estimate is for, where the run's tensors are

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if self.table:
            args = self._swapped(args)
            if kwargs:
                kwargs = {key: self._one(value) for key, value in kwargs.items()}
        if self.reads is not None and func in READS:
            return self.reads(func, args, kwargs or {})
        if func in _MOVES:
            return _moved(func, args, kwargs or {}, self.target)
        if kwargs and "device" in kwargs:
            # Made on the meta device as the recorder would, but before PyTorch's parsing of a
            # device starts CUDA, which raises on a machine without one.
            kwargs = {**kwargs, "device": META}
        return func(*args, **(kwargs or {}))

    def _swapped(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        swapped = tuple(self._one(arg) for arg in args)
        return args if all(a is b for a, b in zip(args, swapped, strict=True)) else swapped

    def _one(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            found = self.table.get(id(value))
            if found is not None and found[0] is value:
                fake = found[1]()
                if fake is not None:
                    return fake
            return value
        if isinstance(value, Lent):
            value = copy.copy(value._plain())  # C code would read the proxy's own storage: the real entries
        if type(value) in (list, tuple):
            items = [self._one(item) for item in value]
            if any(a is not b for a, b in zip(value, items, strict=True)):
                return type(value)(items)
        return value


class _Installed(NamedTuple):
    """The proxies put on one object, and its attributes as they were."""

    owner: Any
    saved: dict[str, Any]
    proxies: list[Lent]
    kind: type  # its class: a parametrization registered in the run swaps it for a subclass of its own
    own_class: dict[str, Any] | None  # that subclass's attributes, where it has one already (parametrized)


# Proxies that something still refers to weakly (a hook's RemovableHandle, made by another
# thread while the loan lasted, refers to its hook dict so): kept alive with their owner,
# forwarding to the real container, so that such a handle can still remove its hook. They
# refer to it weakly (Lent.release), or the entry would keep its own key alive.
_RETAINED: weakref.WeakKeyDictionary[Any, list[Lent]] = weakref.WeakKeyDictionary()
_RETAINED_LOCK = threading.Lock()
locks_renewed_in_child(globals(), "_RETAINED_LOCK")  # a fork while another thread held it


class Loan:
    """One run's loan of meta copies to the calling thread: ``hold``, ``add`` each copy, ``lend``, then ``end``."""

    def __init__(self, target: torch.device = META) -> None:
        self.thread = threading.get_ident()
        self.installed: list[_Installed] = []
        self.mode = Swapping(target)
        self._copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._held = contextlib.ExitStack()
        self._entered = False

    def hold(self) -> None:
        """Take the estimate lock for the loan's duration."""
        self._held.enter_context(exclusive())

    def add(self, tensor: torch.Tensor, meta: torch.Tensor) -> None:
        """Lend ``meta`` for ``tensor``: the borrower's containers hold it where they held ``tensor``."""
        self._copies[id(tensor)] = (tensor, meta)

    def copy_of(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Return the meta copy lent for ``tensor``, if one was (before :meth:`lend`)."""
        found = self._copies.get(id(tensor))
        return found[1] if found is not None and found[0] is tensor else None

    def lend(self, owners: Iterable[Any]) -> None:
        """Give each of ``owners`` a proxy for every container attribute, then start the function mode."""
        for owner in owners:
            attributes = vars(owner)
            saved = dict(attributes)
            proxies: list[Lent] = []
            # A parametrized module's class is its own, and parametrizing another tensor (or removing one)
            # in the run changes that class: its attributes are put back too (probe 75H). Recorded before
            # any proxy is set: a Ctrl-C in between leaves end() what to put back (probe 77D).
            own_class = dict(vars(type(owner))) if _parametrized(owner) else None
            self.installed.append(_Installed(owner, saved, proxies, type(owner), own_class))
            for name, value in saved.items():
                # A proxy this thread borrows already (an estimate inside an estimate) is lent on in turn.
                seen = _seen(value)
                if type(seen) in _PROXIES:
                    proxy = _proxy(value, self._copied(seen, _DEPTH), self.thread)
                    proxies.append(proxy)  # first: retired with the others, set or not
                    attributes[name] = proxy
        # The copies now live as long as the borrower's containers hold them, as the real ones do.
        self.mode.table = {key: (tensor, weakref.ref(meta)) for key, (tensor, meta) in self._copies.items()}
        self._copies.clear()
        self.mode.__enter__()  # type: ignore[no-untyped-call]
        self._entered = True

    def _copied(self, value: Any, depth: int) -> Any:
        """Return the borrower's copy of a container: its containers copied, its lent tensors swapped."""
        if isinstance(value, torch.Tensor):
            meta = self.copy_of(value)
            return value if meta is None else meta
        if isinstance(value, weakref.ref) and type(value) is weakref.ref:
            target = value()
            meta = self.copy_of(target) if isinstance(target, torch.Tensor) else None
            return value if meta is None else weakref.ref(meta)
        kind = type(value)
        if depth == 0 or kind not in (*_PROXIES, tuple):
            return value
        if kind is list or kind is tuple:
            return kind(self._copied(item, depth - 1) for item in value)
        made = kind(value.default_factory) if kind is defaultdict else kind()
        for key, item in value.items():
            made[self._copied(key, 0) if isinstance(key, torch.Tensor) else key] = self._copied(item, depth - 1)
        return made

    def end(self) -> None:
        """Put back the attributes that changed, retire the proxies, and release the lock."""
        # The borrower never changed a real container, so none is cleared or refilled.
        try:
            if self._entered:
                self._entered = False
                self.mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
            self.mode.table = {}
            self._copies.clear()
            for installed in reversed(self.installed):
                try:
                    _put_back(installed.owner, installed.saved)
                finally:  # each owner's class, even if another's could not be put back
                    if type(installed.owner) is not installed.kind:
                        # Its new class (a parametrization's, probe 75B) reads what the run added, which is gone;
                        # set as object does it, not through the new class's __setattr__ (probe 75H).
                        object.__setattr__(installed.owner, "__class__", installed.kind)
                    if installed.own_class is not None:
                        _class_put_back(installed.kind, installed.own_class)
                for proxy in installed.proxies:
                    proxy.retire()
                _retain(installed.owner, installed.proxies)
            self.installed.clear()
        finally:
            self._held.close()


def _parametrized(owner: Any) -> bool:
    """Return whether ``owner`` is a module with parametrizations (whose class is its own)."""
    return isinstance(owner, torch.nn.Module) and torch.nn.utils.parametrize.is_parametrized(owner)


def _class_put_back(kind: type, saved: dict[str, Any]) -> None:
    """Put back the attributes of a module's own class (a parametrized one's) that differ from ``saved``."""
    now = dict(vars(kind))
    for name in now.keys() - saved.keys():
        delattr(kind, name)
    for name, before in saved.items():
        if now.get(name, _MISSING) is not before:
            setattr(kind, name, before)


def _put_back(owner: Any, saved: dict[str, Any]) -> None:
    """Put back the attributes of ``owner`` that differ from ``saved``, one store each."""
    attributes = vars(owner)
    now = dict(attributes)
    for name, before in saved.items():
        if now.get(name, _MISSING) is not before:
            attributes[name] = before
    for name in now.keys() - saved.keys():
        attributes.pop(name, None)


def _retain(owner: Any, proxies: list[Lent]) -> None:
    """Keep alive, as long as ``owner`` lives, the retired proxies that something refers to weakly."""
    referred = [proxy for proxy in proxies if weakref.getweakrefcount(proxy) and proxy.release()]
    try:
        if not referred and owner not in _RETAINED:
            return  # the usual case
        with _RETAINED_LOCK:
            # Those of earlier loans that nothing refers to any more go, at the owner's next loan.
            kept = [proxy for proxy in _RETAINED.get(owner, ()) if weakref.getweakrefcount(proxy)] + referred
            if kept:
                _RETAINED[owner] = kept
            else:
                _RETAINED.pop(owner, None)
    except TypeError:  # an owner that cannot be referred to weakly: its proxies go with the handles' references
        pass


# --- hooks that fire in every thread -----------------------------------------------


class ThreadTracker(ModuleTracker):
    """torch's ``ModuleTracker``, deaf to other threads than the one that entered it; its hooks hold no tensor."""

    # Its hooks are process-wide: another thread's modules would enter its record. Only the forward
    # hooks need the check: backward on meta tensors runs on the calling thread (autograd's device
    # threads run only CUDA tensors' backward). ModuleTracker's multi-grad hooks hold the grad_fns of
    # the tensors they sit on, a cycle that keeps a graph the call drops alive until the cyclic
    # collector runs (never during a run), and they ask the engine which nodes it will run, which
    # raises in autograd.grad with respect to a leaf. Plain tensor hooks that hold only the
    # module's name do neither: its backward starts at its outputs' first gradient and ends at
    # the first gradient of an input that is not a leaf. A leaf's (queries passed as a Parameter)
    # comes as soon as its own branch is done, whatever the module's other branches; waiting for
    # every input's would wait for their other users too (a U-Net's skip), and for ever for an
    # input that gets none. Two inputs of separate branches inside the module still end it early.

    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()
        # Per module call, the versions of its positional tensor inputs as it began: an output that is one
        # of them, at that version, was passed through untouched (nn.Identity's, a Dropout of p=0's), and no
        # backward runs in the module; one changed in place since (ReLU(inplace=True)'s) starts it.
        self.versions: dict[int, list[dict[int, int]]] = {}
        # Called as a module's forward or backward begins, after its name joined ``parents``.
        self.on_enter: Callable[[], None] | None = None

    def enter(self, name: str) -> None:
        """Record that the module ``name`` runs from now on."""
        if name not in self.parents:
            self.parents.add(name)
            if self.on_enter is not None:
                self.on_enter()

    def __enter__(self) -> ThreadTracker:
        # The post-hook takes the keyword inputs (HF's ``self_attn(hidden_states=...)``), which a
        # global pre-hook never gets. The positional ones are hooked before the forward, at the version
        # the module reads: one it changes in place (``ReLU(inplace=True)``) is its output after.
        self._fw_pre_handle = register_module_forward_pre_hook(self._fw_pre_hook)
        self._fw_post_handle = register_module_forward_hook(self._fw_post_hook, with_kwargs=True)
        global_hooks_added()
        self._entered = True
        renewed_in_child(self, ThreadTracker._forked)
        return self

    def _forked(self) -> None:
        """In a child forked while another thread's run followed its modules: its hooks go (that thread did)."""
        if self._entered and threading.get_ident() != self.thread:  # not one that exited (kept by a traceback)
            self._entered = False
            self._fw_pre_handle.remove()
            self._fw_post_handle.remove()
            module_globals._global_forward_hooks_with_kwargs.pop(self._fw_post_handle.id, None)
            global_hooks_removed()

    def __exit__(self, *args: object) -> None:
        super().__exit__(*args)  # type: ignore[no-untyped-call]
        # The handle forgets the hook's with_kwargs mark (torch 2.13): left, every later
        # ``torch.compile(module)`` call would warn of a global hook.
        module_globals._global_forward_hooks_with_kwargs.pop(self._fw_post_handle.id, None)
        self._entered = False
        global_hooks_removed()

    def _hooks_gradients(self) -> bool:
        """Return whether the module running now has its backward followed too."""
        return True

    def _fw_pre_hook(self, mod: Any, input: Any) -> None:
        if threading.get_ident() == self.thread:
            name: str = self._get_mod_name(mod)  # type: ignore[no-untyped-call]
            self.enter(name)
            if self._hooks_gradients():
                self._hook(input, _left(weakref.ref(self), name), leaves=False)
                # Of those gradients reach (an inference tensor has no version to read).
                tensors = [tensor for tensor in _tensors(input) if tensor.requires_grad]
                self.versions.setdefault(id(mod), []).append({id(tensor): tensor._version for tensor in tensors})

    def _fw_post_hook(self, mod: Any, input: Any, kwargs: Any, output: Any = None) -> None:  # type: ignore[override]
        if threading.get_ident() == self.thread:
            name: str = self._get_mod_name(mod)  # type: ignore[no-untyped-call]
            self.parents.discard(name)
            if self._hooks_gradients():
                calls = self.versions.get(id(mod))
                versions = calls.pop() if calls else {}
                given = {id(tensor) for tensor in _tensors(kwargs)}
                outputs = _tensors(output)
                # A keyword input that is an output was passed through, or changed in place where no
                # hook can still reach the version the module read: no backward of its own is followed.
                passed = {id(tensor) for tensor in outputs if id(tensor) in given}
                passed.update(
                    id(tensor)
                    for tensor in outputs
                    if id(tensor) in versions and versions[id(tensor)] == tensor._version
                )
                self._hook([t for t in _tensors(kwargs) if id(t) not in passed], _left(weakref.ref(self), name), False)
                self._hook([t for t in outputs if id(t) not in passed], _entered(weakref.ref(self), name))

    def _hook(self, values: Any, hook: Callable[[torch.Tensor], None], leaves: bool = True) -> None:
        for value in tree_flatten(values)[0]:
            if isinstance(value, torch.Tensor) and value.requires_grad and (leaves or value.grad_fn is not None):
                self._hooks.append(value.register_hook(hook))  # type: ignore[no-untyped-call]


def _tensors(values: Any) -> list[torch.Tensor]:
    return [value for value in tree_flatten(values)[0] if isinstance(value, torch.Tensor)]


def _entered(tracker: weakref.ref[ThreadTracker], name: str) -> Callable[[torch.Tensor], None]:
    """Return the gradient hook of a module's output: its backward starts."""

    def hook(_: torch.Tensor) -> None:
        found = tracker()
        if found is not None:
            found._maybe_set_engine_callback()  # which empties the record when backward ends
            found.enter(name)

    return hook


def _left(tracker: weakref.ref[ThreadTracker], name: str) -> Callable[[torch.Tensor], None]:
    """Return the gradient hook of a module's inputs that are not leaves: its backward is over."""

    def hook(_: torch.Tensor) -> None:
        found = tracker()
        if found is not None:
            found.parents.discard(name)

    return hook


# --- what the call owns ------------------------------------------------------------


class Owned:
    """The modules, optimizers and other training state a call can reach, and how to lend them meta tensors."""

    def __init__(self, roots: Iterable[Any]) -> None:
        modules: dict[int, torch.nn.Module] = {}
        optimizers: dict[int, torch.optim.Optimizer] = {}
        others: dict[int, object] = {}
        for value in reachable(roots):
            if isinstance(value, torch.nn.Module):
                for module in value.modules():
                    modules.setdefault(id(module), module)
            elif isinstance(value, torch.optim.Optimizer):
                optimizers.setdefault(id(value), value)
            else:
                others.setdefault(id(value), value)
        self.modules = list(modules.values())
        self.optimizers = list(optimizers.values())
        self.others = list(others.values())

    def _held(self) -> Iterator[tuple[str, torch.Tensor, torch.Tensor | None]]:
        """Yield the modules' and optimizers' tensors (not gradients), with their category and owning parameter."""
        for module in self.modules:
            for tensor in (*module._parameters.values(), *module._buffers.values()):
                if tensor is not None:
                    yield "parameters", tensor, None
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                for parameter in group["params"]:
                    yield "parameters", parameter, None
            for parameter, state in optimizer.state.items():
                yield "parameters", parameter, None
                for value in state.values():
                    # LBFGS keeps lists of tensors too: its history of steps and their curvatures.
                    for tensor in value if type(value) is list else (value,):
                        if isinstance(tensor, torch.Tensor):
                            yield "optimizer state", tensor, parameter

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield every tensor the modules and optimizers hold, with its category."""
        for category, tensor, _ in self._held():
            yield category, tensor
            if category == "parameters" and tensor.grad is not None:
                yield "gradients", tensor.grad

    def resident(self, device: torch.device, round_bytes: Callable[[int], int] | None) -> int:
        """Return the bytes of the tensors held that lie on ``device`` now."""
        seen: set[int] = set()
        total = 0
        for _, found in self.tensors():
            # A DTensor (FSDP2's shards) holds its rank's part, which is what lies on the device.
            tensor = found._local_tensor if is_traceable_wrapper_subclass(found) else found
            if same_device(tensor.device, device) and tensor.layout == torch.strided:
                storage = tensor.untyped_storage()
                if id(storage) not in seen:
                    seen.add(id(storage))
                    total += round_bytes(storage.nbytes()) if round_bytes else storage.nbytes()
        return total

    def lend(
        self, recorder: Recorder, sharding: Sharding | None = None, target: torch.device = META
    ) -> Callable[[], None]:
        """Lend this thread meta copies of every tensor held, under ``recorder``; return what ends the loan."""
        # Under FSDP2 (sharding), sharded tensors are lent as one rank's shard. The loan holds the
        # estimate lock until it ends, on this thread.
        self._refuse_unrunnable()
        loan = Loan(target)
        loan.mode.reads = ValueReads(recorder.placeholder)  # the reads that never reach the recorder
        loan.hold()
        emulation: Emulation | None = None

        def fake_of(tensor: torch.Tensor, category: str, owner: torch.Tensor | None = None) -> torch.Tensor:
            fake = loan.copy_of(tensor)
            if fake is None:
                recorder.category = category
                shape = sharding.shape_of(tensor, owner) if sharding is not None else None
                if shape is not None:
                    fake = torch.empty(shape, dtype=tensor.dtype, device=META)
                else:
                    held = sharding is not None and sharding.held(tensor)  # counted as FSDP2's gathered buffers
                    with _disable_current_modes() if held else contextlib.nullcontext():
                        fake = torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, device=META)
                if isinstance(tensor, torch.nn.Parameter):
                    fake = torch.nn.Parameter(fake, requires_grad=tensor.requires_grad)
                elif tensor.requires_grad:
                    fake.requires_grad_(True)
                grad = tensor.grad if tensor.is_leaf else None
                if grad is not None and grad.layout == torch.strided:
                    fake.grad = fake_of(grad, "gradients", tensor)
                loan.add(tensor, fake)
            return fake

        try:
            for category, tensor, owner in self._held():
                fake_of(tensor, category, owner)
            if sharding is not None:
                # FSDP2 keeps every shard, also of a module whose gathered parameters it holds now.
                for unit in sharding.units:
                    for parameter in unit.params:
                        fake_of(parameter, "parameters")
                for tensor in sharding.gathered():
                    fake_of(tensor, "parameters")  # not counted: see Sharding.held
                emulation = sharding.emulation(loan.copy_of)
            # Their other attributes are put back as they were too: a scheduler's epoch, a scaler's record.
            loan.lend([*self.others, *self.modules, *self.optimizers])
            if emulation is not None:
                emulation.install(lambda category, tensor: recorder.mark([(category, tensor)]))
        except BaseException:
            loan.end()
            raise
        if emulation is None:
            return loan.end

        def end() -> None:
            try:
                emulation.uninstall()
            finally:
                loan.end()

        return end

    def _refuse_unrunnable(self) -> None:
        """Raise an error naming the first module that a meta run cannot run: scripted, or not made yet (lazy)."""
        # A lazy module makes them in its first forward, from the input's shape: a run on meta copies
        # has nothing to copy, and PyTorch's own error names neither the module nor a way out.
        for module in self.modules:
            if isinstance(module, torch.jit.ScriptModule):  # its code reads no lent tensor: torch's error names none
                raise TypeError(
                    f"{_name_of(module, self.modules)} is a TorchScript module (torch.jit.script or trace), whose "
                    "compiled code cannot run on meta tensors: estimate it (or profile it with fake=True) before "
                    "scripting or tracing it, profile it with fake=False, or, under koila.accumulate, pass initial= "
                    "a batch size"
                )
            for key, tensor in (*module._parameters.items(), *module._buffers.items()):
                if tensor is not None and torch.nn.parameter.is_lazy(tensor):
                    raise ValueError(
                        f"{_name_of(module, self.modules)} has {key!r} not initialised yet (a lazy module, like "
                        "nn.LazyLinear, makes its parameters in its first call), and a run on meta tensors cannot "
                        "make them: run the model once on a real batch before estimating its memory or profiling it "
                        "with fake=True (a lazy module the call never runs needs a call of its own), or, under "
                        "koila.accumulate, pass initial= a batch size"
                    )

    def gradients_and_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield the gradients and optimizer state the run holds now (after ``lend``)."""
        for category, tensor in self.tensors():
            if category != "parameters":
                yield category, tensor


def _name_of(module: torch.nn.Module, modules: list[torch.nn.Module]) -> str:
    """Return ``module``'s name as the estimate's module names spell it (``Sequential.0``), from a module holding it."""
    for owner in modules:
        for path, child in owner.named_modules():
            if child is module and path:
                return f"{type(owner).__name__}.{path} ({type(module).__name__})"
    return type(module).__name__
