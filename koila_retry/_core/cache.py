"""Caches that remember which batch size worked."""

from __future__ import annotations

import copy
import functools
import os
import re
import sys
import threading
import types
import warnings
import weakref
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable, ItemsView, Iterator, KeysView, MutableMapping, ValuesView
from types import FrameType
from typing import Any, Generic, NamedTuple, TypeVar, cast

import cachetools
import torch

from koila_retry._common.callables import check_takes
from koila_retry._common.counter import Counter
from koila_retry._common.forks import lock_renewed_in_child
from koila_retry._common.places import levels_to_caller
from koila_retry._common.units import as_int, type_name
from koila_retry._common.walk import slots_of
from koila_retry._core.keys import KeyFunction, deep_stack_key, global_key, is_stack_key, no_key, stack_key

__all__ = [
    "Bound",
    "CacheInfo",
    "GlobalCache",
    "NoCache",
    "PerKey",
    "SizeCache",
    "Sizes",
    "StackMemoryCache",
    "Streak",
    "class_identity",
    "function_identity",
    "innermost",
    "made",
    "weak_method",
]


_PARALLEL = (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)


def function_identity(function: object) -> tuple[str, int, str]:
    """Return ``(filename, first line, qualified name)`` of a callable; a tuple is a description already."""
    # Never the callable itself: a key that held it would keep a model, or a lambda's captured
    # tensors, alive for as long as the key is cached.
    if isinstance(function, tuple):
        return function
    function = _runs(function)
    code = getattr(function, "__code__", None)
    if code is None:
        qualname = getattr(function, "__qualname__", None)
        if isinstance(qualname, str):  # a builtin such as torch.sin, or a class
            return (str(getattr(function, "__module__", None)), 0, qualname)
        # An object: name it by its forward (modules) or __call__. A wrapper's forward is every wrapped
        # model's (torch.compile's _forward_unimplemented, DDP's): named by the model it wraps.
        if isinstance(function, torch.nn.Module):
            function = innermost(function)
        kind = type(function)
        if isinstance(function, torch.jit.ScriptModule):  # one class for every scripted or traced model
            return (kind.__module__, 0, _script_name(function))
        # A decorated forward (@torch.no_grad(), every Hugging Face model's) by the function it wraps.
        method = _runs(getattr(kind, "forward", None) or kind.__call__)
        code = getattr(method, "__code__", None)
        if code is None:  # no Python code: (module, 0, qualified name of the type)
            return (kind.__module__, 0, kind.__qualname__)
    return (code.co_filename, code.co_firstlineno, getattr(code, "co_qualname", code.co_name))  # 3.10: no qualname


class MethodRef:
    """A bound method that holds its object weakly: what a wrapper of one (made in ``__init__``) is keyed by.

    Equal to the method itself while its object lives, and hashed alike (``cache[step.__wrapped__]``
    finds it); never equal to anything once the object is gone.
    """

    __slots__ = ("__func__", "_hash", "_object")

    def __init__(self, method: types.MethodType, hashed: int) -> None:
        self.__func__ = method.__func__
        self._object = weakref.ref(method.__self__)
        self._hash = hashed

    @property
    def __self__(self) -> object:
        return self._object()

    def method(self) -> object:
        """Return the bound method while its object lives, else this reference."""
        owner = self._object()
        return self if owner is None else types.MethodType(self.__func__, owner)

    def __getattr__(self, name: str) -> Any:  # __name__, __qualname__, __wrapped__ ...: the function's
        if name == "__func__":  # not set yet (a subclass's copy): no recursion
            raise AttributeError(name)
        return getattr(self.__func__, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        owner = self._object()
        if owner is None:
            raise ReferenceError(f"the object of {self!r} no longer exists")
        return self.__func__(owner, *args, **kwargs)

    def __eq__(self, other: object) -> bool:
        if other is self:
            return True
        if type(other) is MethodRef:
            owner = other._object()
        elif type(other) is types.MethodType:
            owner = other.__self__
        else:
            return NotImplemented
        return owner is not None and owner is self._object() and bool(other.__func__ == self.__func__)

    def __hash__(self) -> int:
        return self._hash

    def __copy__(self) -> MethodRef:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> MethodRef:
        return self

    def __reduce__(self) -> str | tuple[Any, ...]:
        # Pickled (with a cache), the method while its object lives, as before it was kept weakly.
        owner = self._object()
        if owner is None:
            return tuple, (("a method of an object that no longer exists", *function_identity(self.__func__)),)
        return types.MethodType(self.__func__, owner).__reduce__()

    def __repr__(self) -> str:
        owner = self._object()
        qualname = getattr(self.__func__, "__qualname__", self.__func__)
        return f"<bound method {qualname} of {'an object that no longer exists' if owner is None else repr(owner)}>"


def weak_method(function: object) -> object:
    """Return ``function``, or a :class:`MethodRef` of it where it is a bound method of a weakly referable object."""
    if type(function) is not types.MethodType:
        return function
    try:
        return MethodRef(function, hash(function))
    except TypeError:  # its object takes no weak reference (__slots__), or its function cannot be hashed
        return function


def class_identity(kind: type, name: str) -> tuple[str, int, str]:
    """Return the identity of ``name``, a step of class ``kind``: by the module that defines it, or a script's file."""
    where = kind.__module__
    # Every script's name, and its name again in a process that multiprocessing's spawn started (a rank of
    # ddp_spawn's): its file tells one from another.
    if where in ("__main__", "__mp_main__"):
        path = getattr(sys.modules.get(where), "__file__", None)
        where = os.path.realpath(path) if isinstance(path, str) else "__main__"  # not "//tmp/..." run from /
    return (where, 0, name)


def innermost(module: torch.nn.Module) -> torch.nn.Module:
    """Return the model that ``torch.compile``'s and (Distributed)DataParallel's wrappers of ``module`` run."""
    for _ in range(100):
        modules = module._modules  # a TorchScript module's is a mapping without get()
        inner = modules.get("_orig_mod") if isinstance(modules, dict) else None  # torch.compile's
        if inner is None and isinstance(module, _PARALLEL):
            inner = module.module
        if not isinstance(inner, torch.nn.Module):
            break
        module = inner
    return module


def _runs(function: object) -> object:
    """Return the function that runs: looked for through methods, partials and ``functools.wraps`` decorators."""
    for _ in range(100):
        if isinstance(function, functools.partial):
            function = function.func
        elif isinstance(function, types.MethodType | MethodRef):
            function = function.__func__
        elif isinstance(function, torch.jit.ScriptFunction) and isinstance(
            original := getattr(function, "_torchdynamo_inline", None), types.FunctionType
        ):
            function = original  # the Python function scripted: each class's __qualname__ is ScriptFunction's
        elif callable(wrapped := getattr(function, "__wrapped__", None)) and wrapped is not function:
            # Every @torch.no_grad() function runs the same wrapper, whose code would name them all alike
            # (and give them one size in a GlobalCache); so does torch.no_grad()(module), or of any callable.
            function = wrapped
        else:
            break
    return function


def _script_name(module: torch.jit.ScriptModule) -> str:
    """Name a TorchScript module by the class it was made from (``__torch__.mypackage.Net``, say)."""
    try:
        # Without the counter TorchScript adds to a class made again (each trace of one): one key for all.
        return re.sub(r"___torch_mangle_\d+\.", "", str(module._c._type().qualified_name()))
    except Exception:  # not in every version: the class's own name, then
        return str(getattr(module, "original_name", type(module).__qualname__))


_MISSING: Any = object()  # pop's default when none is given


class CacheInfo(NamedTuple):
    """Hits, misses and size of a cache, as ``functools.lru_cache`` reports them."""

    hits: int
    misses: int
    maxsize: int
    currsize: int


#: A key's successes in a row, and how many it waits for before it grows back.
Streak = tuple[int, int]
#: With ``refine=True``, the smallest size that failed under a key, and the bytes of one sample
#: it failed on (0 if not known): a key of a size class holds samples of several sizes.
Bound = tuple[int, int]
Kept = TypeVar("Kept")


class PerKey(Generic[Kept]):
    """A locked, bounded LRU of what is followed per key beside a size (streaks, bounds); tells ``changed``."""

    def __init__(
        self, maxsize: int, changed: Callable[[Hashable, Callable[[Kept | None], Kept | None]], None] | None = None
    ) -> None:
        self._lock = threading.Lock()
        lock_renewed_in_child(self, "_lock")
        self._keys: cachetools.LRUCache[Hashable, Kept] = cachetools.LRUCache(maxsize)
        self.changed = changed

    def update(self, key: Hashable, change: Callable[[Kept | None], Kept | None]) -> Kept | None:
        """Replace what ``key`` keeps by ``change(kept)`` (``None``: forget it); return what it kept before."""
        with self._lock:
            before = self._keys.get(key)
            after = change(before)
            if after is None:
                self._keys.pop(key, None)
            elif after != before:
                self._keys[key] = after
        if after != before and self.changed is not None:
            self.changed(key, change)
        return before

    def get(self, key: Hashable) -> Kept | None:
        """Return what ``key`` keeps, or ``None``."""
        with self._lock:
            return self._keys.get(key)

    def clear(self) -> None:
        """Forget every key."""
        with self._lock:
            self._keys.clear()

    def __getstate__(self) -> dict[str, Any]:
        with self._lock:
            return {"maxsize": self._keys.maxsize, "kept": list(self._keys.items()), "changed": self.changed}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["maxsize"], state["changed"])  # type: ignore[misc]
        self._keys.update(state["kept"])


def _unhashable(key: object) -> str:
    """Return the error of a key that cannot be hashed, naming the part that cannot."""
    parts = [part for part in key if not _hashes(part)] if isinstance(key, tuple) else []
    part = f", of which {type(parts[0]).__name__} {parts[0]!r:.100} cannot be" if parts else ""
    return (
        f"a size cache's key must be hashable, and this call's key is {type(key).__name__} {key!r:.200}{part}. "
        "A key function of yours (key=) must return a tuple of hashable values (not a list), a string or a number"
    )


class _DictKey:
    """A key that == matches as a dict does: the same object, or the same hash and equal."""

    __slots__ = ("hash", "key")

    def __init__(self, key: Hashable) -> None:
        self.key, self.hash = key, hash(key)

    def __eq__(self, other: object) -> bool:
        if other is self.key:
            return True
        try:
            return self.hash == hash(other) and bool(self.key == other)
        except TypeError:  # unhashable: the dict's look-up says so
            return False

    __hash__ = None  # type: ignore[assignment]  # compared, never hashed


def _by_identity(function: object) -> bool:
    """Return whether == compares ``function`` as a dict finds it: a function, a :class:`MethodRef`, an identity."""
    kind = type(function)
    if kind is tuple:  # function_identity's (filename, line, name): chunked's, accumulate's and range's keys
        return all(type(part) is str or type(part) is int for part in cast(tuple[object, ...], function))
    return kind.__eq__ is object.__eq__ or kind is MethodRef or kind is types.MethodType


def _hashes(value: object) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def made(cache: Sizes) -> bool:
    """Return whether a cache's ``__init__`` ran: a subclass's own may leave out ``super().__init__()``."""
    return "_recent" in vars(cache)


class Sizes(MutableMapping[Hashable, int]):
    """A thread-safe, bounded LRU mapping from keys to sizes and what each was proven on: :class:`SizeCache`'s."""

    def __init__(self, maxsize: int = 256) -> None:
        size = as_int(maxsize)  # numpy's ints too, as Options take them
        if size is None or size < 1:
            raise ValueError(f"maxsize must be an int >= 1, got {maxsize!r}")
        self._maxsize = size
        # Readers (every cached call) take no lock, so they never add or remove a key: they
        # read ``_sizes`` and move a key to the end of ``_order``, each one C call, atomic
        # under the GIL. Writers, rare (after an OOM), hold the lock and change both, and
        # evict with ``popitem``, which no reader's move can interrupt (iterating could).
        self._sizes: dict[Hashable, int] = {}
        self._order: OrderedDict[Hashable, None] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()  # held through a DiskCache's write: made anew in a forked child
        lock_renewed_in_child(self, "_lock")
        self._hits = Counter()
        self._misses = Counter()
        # The latest key looked up and its size, in a one-item list that writers replace
        # whole after every change (see lookup).
        self._recent: list[tuple[object, int | None] | None] = [None]
        # The bytes of one sample each size was proven on, for keys that name a class of
        # sample shapes (see sample_bytes); kept and forgotten with the sizes.
        self._samples: dict[Hashable, int] = {}
        # Whether the keys are koila's own: tuples whose parts == compares as a dict does (strings, ints,
        # devices, functions, shapes). Any other latest key is remembered as a _DictKey (see lookup).
        self._plain = False

    def lookup(self, key: Hashable) -> int | None:
        """Return the size stored under ``key``, counting a hit or a miss."""
        # A loop calls from the same place again and again: answer a repeat of the
        # latest key without the LRU's bookkeeping. One tuple, replaced whole, so a
        # racing thread sees either the old pair or the new one. It goes into the list
        # read first: a writer that changed a size since then has put a new list in its
        # place, so a pair read before the change is never remembered after it.
        # Misses are remembered too: a function that never runs out of memory stores
        # nothing (see decision.decide: a success at the ceiling stores nothing), and is asked about
        # on every call. The latest key matches as a dict would find it: a tensor in a key compares by
        # its elements, where a dict hashes it by its identity, so only koila's own keys are compared
        # with == alone, the rest through a _DictKey, at no cost to the former.
        remembered = self._recent
        recent = remembered[0]
        if recent is not None and recent[0] == key:
            if recent[1] is None:
                self._misses.increment()
            else:
                self._hits.increment()
            return recent[1]
        try:
            size = self._sizes.get(key)
        except TypeError:  # zero-cost until raised
            raise TypeError(_unhashable(key)) from None
        if size is None:
            size = self._fallback(key)
            if size is None:
                self._misses.increment()
                remembered[0] = (self._latest(key), None)
                return None
            if key not in self._sizes:  # a fallback may have stored it, with what it was proven on
                self[key] = size  # later calls find it directly
        else:
            # try/except, not contextlib.suppress: making its context manager would double a lookup's cost.
            try:  # noqa: SIM105
                self._order.move_to_end(key)  # most recently used
            except KeyError:
                pass  # a writer removed it meanwhile
        self._hits.increment()
        remembered[0] = (self._latest(key), size)
        return size

    def _latest(self, key: Hashable) -> object:
        """Return ``key`` as the latest key is remembered: as it is if == matches it as a dict does."""
        # Its function is the user's object as it is: one with an == of its own (a dataclass) compares as it says.
        plain = self._plain and type(key) is tuple and (not key or _by_identity(key[0]))
        return key if plain else _DictKey(key)

    def _fallback(self, key: Hashable) -> int | None:
        """Return a size for a key that is not stored, from a related key, or ``None``."""
        return None

    def cache_info(self) -> CacheInfo:
        """Return hits, misses, the bound and the number of keys stored."""
        with self._lock:
            return CacheInfo(self._hits.value, self._misses.value, self._maxsize, len(self._sizes))

    def cache_clear(self) -> None:
        """Forget every size and reset the hit and miss counts."""
        with self._lock:
            self._sizes.clear()
            self._order.clear()
            self._recent = [None]
            self._samples.clear()
            self._hits, self._misses = Counter(), Counter()

    def __getitem__(self, key: Hashable) -> int:
        size = self._sizes[key]
        try:  # noqa: SIM105 (as in lookup)
            self._order.move_to_end(key)  # most recently used
        except KeyError:
            pass  # a writer removed it meanwhile
        return size

    def __setitem__(self, key: Hashable, size: int) -> None:
        if type(size) is not int:
            number = as_int(size)  # an int subclass (an IntEnum member) or numpy's: keep the number
            if number is None:
                raise TypeError(f"a batch size must be an int, got {type_name(size)} {size!r} for key {key!r}")
            size = number
        if size < 1:
            raise ValueError(f"a batch size must be >= 1, got {size} for key {key!r}")
        if type(key) is types.MethodType or (type(key) is tuple and any(type(p) is types.MethodType for p in key)):
            # Yours (cache[step.__wrapped__] = 64), kept as the key: it held the object alive (probe 75G).
            key = tuple(weak_method(part) for part in key) if type(key) is tuple else weak_method(key)
        evicted = []
        with self._lock:
            sizes, order = self._sizes, self._order
            if key in sizes:
                order.move_to_end(key)
            else:
                # The order holds every stored key (added first, removed last), and a key whose size an
                # interrupt (Ctrl-C) kept from being stored: dropped with no harm.
                while len(order) >= self._maxsize:
                    evicted.append(order.popitem(last=False)[0])
                    sizes.pop(evicted[-1], None)
                    self._samples.pop(evicted[-1], None)
                order[key] = None
            sizes[key] = size
            self._samples.pop(key, None)  # proven on the samples of the call that stores it, if it says
            self._recent = [(self._latest(key), size)]  # after the change: the insertion may have evicted the last key
        if evicted:
            self._evicted(evicted)

    def _evicted(self, keys: list[Hashable]) -> None:
        """Forget what is kept beside the sizes of ``keys``, evicted to make room."""

    def __delitem__(self, key: Hashable) -> None:
        if self._discard(key) is None:
            raise KeyError(key)

    def pop(self, key: Hashable, default: Any = _MISSING, /) -> Any:
        """Remove ``key`` and return its size; if it is missing, return ``default`` or raise KeyError.

        Atomic: two threads popping one key never both find it, and neither raises.
        """
        size = self._discard(key)
        if size is not None:
            return size
        if default is _MISSING:
            raise KeyError(key)
        return default

    def _discard(self, key: Hashable) -> int | None:
        """Remove ``key``; return its size, or ``None`` if it was not stored."""
        with self._lock:
            size = self._sizes.pop(key, None)
            self._order.pop(key, None)
            self._samples.pop(key, None)
            self._recent = [None]
            return size

    def popitem(self) -> tuple[Hashable, int]:
        """Remove and return the earliest stored key and its size; raise KeyError if empty."""
        while True:
            with self._lock:
                if not self._sizes:
                    raise KeyError(f"{type(self).__name__} is empty")
                key = next(iter(self._sizes))
            size = self._discard(key)  # again through the hook that subclasses extend
            if size is not None:
                return key, size

    def __contains__(self, key: object) -> bool:
        return key in self._sizes  # looking is not using: the LRU order stays

    def _snapshot(self) -> dict[Hashable, int]:
        with self._lock:
            return dict(self._sizes)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._snapshot())

    def keys(self) -> KeysView[Hashable]:
        return self._snapshot().keys()

    def items(self) -> ItemsView[Hashable, int]:
        return self._snapshot().items()

    def values(self) -> ValuesView[int]:
        return self._snapshot().values()

    def __len__(self) -> int:
        return len(self._sizes)

    # A copy, a deep copy and a pickle are caches of their own, with the sizes this one holds: neither
    # its lock nor the containers it goes on changing. The keys stay the objects they are (a deep
    # copy of a model kept as a key would never be looked up).
    def __getstate__(self) -> dict[str, Any]:
        with self._lock:  # every dict copied (the sizes, the samples, derived estimates), and the bounds
            state = {name: _copied(value) for name, value in vars(self).items()}
            state.update(_order=OrderedDict(self._order), _recent=[None])
        state.update(_hits=self._hits.value, _misses=self._misses.value)
        del state["_lock"]
        # A subclass's __slots__, which vars() leaves out.
        slots = {
            slot.__name__: getattr(self, slot.__name__)
            for _, slot in slots_of(type(self))
            if hasattr(self, slot.__name__)
        }
        return {"state": state, "slots": slots}

    def __setstate__(self, saved: dict[str, Any]) -> None:
        state = saved["state"]
        vars(self).update(state, _hits=Counter(state["_hits"]), _misses=Counter(state["_misses"]))
        for name, value in saved["slots"].items():
            setattr(self, name, value)
        self._lock = threading.Lock()
        lock_renewed_in_child(self, "_lock")

    def __deepcopy__(self, memo: dict[int, Any]) -> Sizes:
        # What a subclass adds is copied deep; what is held under keys is copied as a copy() copies it.
        clone = memo[id(self)] = type(self).__new__(type(self))  # first: what refers back to it finds the clone
        saved = self.__getstate__()
        state, slots = saved["state"], saved["slots"]
        saved["state"] = {
            name: value if name in _KEYED else copy.deepcopy(value, memo) for name, value in state.items()
        }
        saved["slots"] = {name: copy.deepcopy(value, memo) for name, value in slots.items()}
        clone.__setstate__(saved)
        return clone

    def __repr__(self) -> str:
        hits, misses, maxsize, currsize = self.cache_info()
        return f"{type(self).__name__}(maxsize={maxsize}, currsize={currsize}, hits={hits}, misses={misses})"


class SizeCache(Sizes, ABC):
    """A thread-safe, bounded mapping from a call's key to the batch size that worked.

    Subclasses decide what a key is (:meth:`key`): the caches of koila_retry
    apply a key function, theirs or the one given as ``key``. The mapping
    itself is a least-recently-used cache of at most ``maxsize`` entries. One
    cache may be shared by several decorated functions: keys include the
    function. A subclass's ``__init__`` calls ``super().__init__()``; a cache
    whose ``__init__`` did not is refused where it is given.

    Reads take no lock, so a cached call stays cheap; stores, deletions and
    evictions take one. No operation fails because another thread changed the
    cache meanwhile: ``pop(key, default)`` is atomic, and iteration and the
    ``keys()``, ``items()`` and ``values()`` views are snapshots.

    Args:
        maxsize (int): how many keys to keep; the least recently used go first.
            Default: 256.
        key (KeyFunction, optional): makes each call's key from
            ``(function, caller, device, sample)``, or ``None`` for a call to
            neither look up nor store (see :ref:`key-functions`). Default:
            the subclass's own; :func:`~koila_retry.stack_key` for a subclass
            of yours, whose :meth:`key` (abstract here: a direct subclass
            defines it, or subclasses :class:`GlobalCache`) may return
            ``super().key(...)``.

    Raises:
        ValueError: if ``maxsize`` is not a positive int.
        TypeError: if ``key`` is not callable with ``(function, caller, device, sample)``.

    .. versionadded:: 0.1.0
    """

    _warned_size = False  # whether checked_size warned about a value of this cache

    def __init__(self, maxsize: int = 256, *, key: KeyFunction | None = None) -> None:
        super().__init__(maxsize)
        if key is None:
            key = stack_key
        elif not callable(key):
            raise TypeError(
                "key must be a function (function, caller, device, sample) -> key, such as koila.stack_key, "
                f"got {type(key).__name__} {key!r}"
            )
        else:
            check_takes("key", key, "(function, caller, device, sample)", None, None, None, None)
        self._key_function = key
        # A key function of yours is given a method as it is, where koila's own get it held weakly (MethodRef).
        self._own_key = getattr(key, "__module__", None) == stack_key.__module__
        if type(self).key is _apply_key and self._own_key:
            # A cached call costs microseconds: with no subclass's key() in the way, the
            # engine calls koila's own key function directly, saving a call. (Those accept
            # the three-argument call the engine makes; a user's function gets all four.)
            vars(self)["key"] = key
            self._plain = True
        #: With ``refine=True``, the smallest size that failed under each key, with the bytes
        #: of one sample it failed on (a :data:`Bound`): a size too, which a DiskCache keeps.
        self.bounds: PerKey[Bound] = PerKey(maxsize)
        #: How many times the cache was cleared: what the engine follows beside it follows this.
        self.generation = 0
        #: What front ends work out for this cache's calls besides their sizes, under keys of
        #: their own (``initial="auto"``'s memory estimates); forgotten with the sizes.
        self.derived: dict[Hashable, Any] = {}

    @abstractmethod
    def key(
        self, function: object, caller: FrameType | None, device: torch.device, sample: Hashable = None
    ) -> Hashable | None:
        """Return the key for one call, or ``None`` to neither look up nor store.

        The caches of koila_retry apply their key function
        (:attr:`key_function`); a subclass of theirs may override this method
        too. A subclass of yours returns its own key, or ``super().key(...)``,
        the key of its key function.

        Args:
            function (object): identifies the decorated function or block: a
                function, or a hashable description of it such as
                ``(filename, first line, qualified name)``; a bound method comes
                as a reference that holds its object weakly, equal to the method
                (its function is ``function.__func__``).
            caller (FrameType or None): the frame that made the call.
            device (torch.device): the device the call runs on.
            sample (Hashable, optional): the shape and dtype of one sample of
                the inputs, from front ends that see them (:func:`chunked`);
                ``None`` otherwise.

        Returns:
            Hashable or None: the key.
        """
        return self._key_function(function, caller, device, sample)

    def _given(self, function: object) -> object:
        """Return what the key function is given for ``function``: a bound method as it is to one of yours."""
        if type(function) is MethodRef and not getattr(self, "_own_key", False):  # a cache pickled before it
            return function.method()
        return function

    @property
    def key_function(self) -> KeyFunction:
        """The key function that :meth:`key` applies.

        .. versionadded:: 0.1.0
        """
        return self._key_function

    def sample_bytes(self, key: Hashable) -> int | None:
        """Return the bytes of one sample the size stored under ``key`` was proven on, if known.

        A key that names a class of sample shapes (rows padded to 37 tokens and to
        50 share one) holds the size that fitted the samples of the class it was
        proven on; a call with larger samples of the class scales it down to as
        many bytes of samples.

        Args:
            key (Hashable): a key of this cache.

        Returns:
            int or None: the bytes, or ``None`` if none were recorded.

        .. versionadded:: 0.1.0
        """
        return self._samples.get(key)

    def prove(self, key: Hashable, nbytes: int) -> None:
        """Record that the size stored under ``key`` fitted samples of ``nbytes`` bytes each.

        Nothing is recorded for a key that holds no size. The record goes with the
        size: evicted, removed and cleared with it.

        Args:
            key (Hashable): a key of this cache.
            nbytes (int): the bytes of one sample of the call that stored the size.

        Raises:
            TypeError: if ``nbytes`` is not an int.
            ValueError: if ``nbytes`` is below 1.

        .. versionadded:: 0.1.0
        """
        number = as_int(nbytes)  # numpy's ints too
        if number is None:
            raise TypeError(f"nbytes must be an int >= 1, got {type_name(nbytes)} {nbytes!r}")
        if number < 1:
            raise ValueError(f"nbytes must be an int >= 1, got {nbytes!r}")
        with self._lock:
            if key in self._sizes:
                self._samples[key] = number

    def checked_size(self, key: Hashable, size: object) -> int | None:
        """Return ``size`` if it can be a batch size (an int >= 1), else ``None``, warning once per cache.

        The engine checks what :meth:`lookup` returns with this before using it: a
        subclass may keep sizes anywhere, and a corrupt value must cost a call its
        cached start, never the call itself.
        """
        if isinstance(size, int) and not isinstance(size, bool) and size >= 1:
            return int(size)  # an int subclass too, such as an IntEnum member
        if not self._warned_size:  # a cache that returns junk for every key would warn on every call
            self._warned_size = True
            warnings.warn(
                f"koila_retry: ignoring {size!r} ({type(size).__name__}), returned by {type(self).__name__} for the "
                f"key {key!r}: a batch size is an int >= 1. The call starts as if nothing were stored; further "
                "values of this cache that are not sizes are ignored without a warning.",
                UserWarning,
                stacklevel=levels_to_caller(),
            )
        return None

    def _discard(self, key: Hashable) -> int | None:
        # With the size goes what refine learnt of the key (del, pop, a call at its ceiling).
        size = super()._discard(key)
        if self.bounds.get(key) is not None:
            self.bounds.update(key, lambda _: None)
        return size

    def _evicted(self, keys: list[Hashable]) -> None:
        # An evicted key searches afresh: a bound kept without its size stopped refine's search (probe 75C).
        for key in keys:
            if self.bounds.get(key) is not None:
                self.bounds.update(key, lambda _: None)

    def cache_clear(self) -> None:
        """Forget every size, what grows back and what was derived, and reset the hit and miss counts."""
        super().cache_clear()
        self.generation += 1  # the engine forgets each key's growth streak with it
        self.bounds.clear()
        self.derived.clear()


def _apply_key(
    self: SizeCache, function: object, caller: FrameType | None, device: torch.device, sample: Hashable = None
) -> Hashable | None:
    # The key() of the caches below: what their key function makes.
    return self._key_function(self._given(function), caller, device, sample)


class StackMemoryCache(SizeCache):
    """Remember sizes per call site and per free-memory level (the default cache).

    The key (:func:`~koila_retry.stack_key`) is the function, the place of the
    call in each of the innermost ``depth`` calling frames (file, function and
    position within it, read from ``sys._getframe``, no ``inspect``), the device,
    and the device's free memory in power-of-two buckets. The same loop calling
    again with about the same free memory starts at the size that last worked;
    another call site, or the same one with much more free memory, starts
    afresh. With less free memory than any stored level, it starts from the size
    that worked at the nearest level above (up to ``fallback_buckets`` buckets,
    each a factor of two, away): every larger size failed even with more memory.
    Free memory is read at most once a second per device, because a reading
    costs far more than a cached call.

    Args:
        maxsize (int): how many keys to keep; the least recently used go first.
            Default: 256.
        depth (int): how many calling frames identify a call site. Default: 1,
            the line that calls.
        fallback_buckets (int): how many free-memory buckets above the current
            one to look in when the current one has no size. Default: 4.
        key (KeyFunction, optional): another key function, instead of the stack
            key of ``depth`` frames. Only the stack keys
            (:func:`~koila_retry.stack_key` and those of
            :func:`~koila_retry.deep_stack_key`) fall back to another free-memory
            level: with any other, a call whose key holds no size starts afresh.
            Default: ``None``, the stack key.

    Raises:
        ValueError: if ``maxsize``, ``depth`` or ``fallback_buckets`` is out of
            range, or if both ``depth`` and ``key`` are given.
        TypeError: if ``key`` is not callable with ``(function, caller, device, sample)``.

    .. versionadded:: 0.1.0
    """

    key = _apply_key

    def __init__(
        self, maxsize: int = 256, *, depth: int = 1, fallback_buckets: int = 4, key: KeyFunction | None = None
    ) -> None:
        stack = deep_stack_key(depth)  # checks depth
        if key is not None and depth != 1:
            raise ValueError(f"depth applies to the stack key: give depth={depth!r} or key={key!r}, not both")
        super().__init__(maxsize, key=stack if key is None else key)
        buckets = as_int(fallback_buckets)  # numpy's ints too, as maxsize and depth
        if buckets is None or buckets < 0:
            raise ValueError(f"fallback_buckets must be an int >= 0, got {fallback_buckets!r}")
        self.depth = int(depth)  # checked above: an int, or numpy's
        self.fallback_buckets = buckets
        self._bucketed = is_stack_key(self.key_function)  # only a stack key's third part is a free-memory level

    def _fallback(self, key: Hashable) -> int | None:
        # Nothing stored at this free-memory level: take the size that worked at the
        # same call site with more free memory. Every larger size failed even then, so
        # starting there skips only attempts that would fail again. (Gradients left by
        # a previous step, or optimizer state made by the first one, move free memory
        # down a bucket between the first call and the second.)
        if not self._bucketed or not isinstance(key, tuple) or len(key) < 3 or not isinstance(key[2], int):
            return None
        head, bucket, tail = key[:2], key[2], key[3:]
        for more in range(1, self.fallback_buckets + 1):
            related = (*head, bucket + more, *tail)
            size = self.get(related)
            if size is not None:
                # And the smallest size that failed there, which fails here too: refine=True goes on from it.
                bound = self.bounds.get(related)
                if bound is not None:
                    self.bounds.update(key, functools.partial(_or_else, bound))
                nbytes = self._samples.get(related)
                if nbytes is not None:  # proven on samples of that size here too, once stored
                    self[key] = size
                    self.prove(key, nbytes)
                return size
        return None


class GlobalCache(SizeCache):
    """Remember one size per function, wherever and however it is called.

    Args:
        maxsize (int): how many functions to keep; the least recently used go first.
            Default: 256.
        key (KeyFunction, optional): another key function. Default: ``None``,
            :func:`~koila_retry.global_key`.

    .. versionadded:: 0.1.0
    """

    key = _apply_key

    def __init__(self, maxsize: int = 256, *, key: KeyFunction | None = None) -> None:
        super().__init__(maxsize, key=global_key if key is None else key)


class NoCache(SizeCache):
    """Remember nothing: every call starts at the initial size.

    Its key function is :func:`~koila_retry.no_key`: no call has a key.

    .. versionadded:: 0.1.0
    """

    key = _apply_key

    def __init__(self, maxsize: int = 256) -> None:
        super().__init__(maxsize, key=no_key)

    def __setitem__(self, key: Hashable, size: int) -> None:
        pass  # remembering nothing is this cache's whole contract


def _copied(value: object) -> object:
    """Return what a copy of a cache holds for ``value``: a dict or a :class:`PerKey` of its own."""
    if type(value) is dict:
        return dict(value)
    return copy.copy(value) if isinstance(value, PerKey) else value


# A cache's own state whose keys name functions and modules: a deep copy keeps them the objects they are.
_KEYED = frozenset({"_sizes", "_order", "_samples", "_recent", "bounds", "derived", "_key_function", "key"})


def _or_else(default: Bound, kept: Bound | None) -> Bound:
    return default if kept is None else kept
