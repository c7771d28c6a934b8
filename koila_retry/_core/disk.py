"""A size cache kept in a JSON file, so that the next run starts at the size that worked."""

from __future__ import annotations

import contextlib
import errno
import functools
import inspect
import json
import os
import re
import stat
import tempfile
import time
import warnings
from collections.abc import Callable, Hashable, Iterator
from types import FrameType
from typing import IO, Any

import torch

from koila_retry._common.places import levels_to_caller
from koila_retry._common.warn import warn_or_log
from koila_retry._core.cache import Bound, SizeCache, function_identity
from koila_retry._core.keys import KeyFunction, size_class_key
from koila_retry._core.memory import describe_device
from koila_retry.exceptions import CacheFileWarning

try:
    import fcntl
except ImportError:  # Windows: writes stay atomic, but two writers may drop each other's new sizes
    fcntl = None  # type: ignore[assignment]

__all__ = ["DiskCache"]

_FORMAT = "koila-retry size cache"
_VERSION = 1
# Opening a FIFO for reading waits for a writer; without blocking it returns at once, and
# the descriptor's type is checked before anything is read. (Windows has no FIFOs.)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
# How long a store waits for another process's lock on the file: a writer holds it for milliseconds; one
# that holds it longer is stopped (Ctrl-Z, SIGSTOP) or on a file system that hangs, and would hold every job.
LOCK_WAIT = 10.0
_SPECIAL = (
    (stat.S_ISDIR, "folder"),
    (stat.S_ISFIFO, "FIFO (named pipe)"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
    (stat.S_ISSOCK, "socket"),
)


class DiskCache(SizeCache):
    """Remember sizes in a JSON file, across runs and processes.

    The key (:func:`~koila_retry.size_class_key`) is the function's qualified
    name and where it is defined, the device's kind, model and total memory, and
    the shape class and dtype of one sample of the inputs when the front end
    sees them (:func:`chunked`), written as text:
    ``"<qualified name> (<file>:<first line>) on <device> for samples <sample>"``.
    So a second run of the same script on the same kind of device starts at the
    size that worked, and a run on a different device starts afresh. With
    ``refine=True``, the smallest size that failed under each key is kept too
    (``bounds``; in the file under ``"bounds"``, with the bytes of one sample it
    failed on under ``"bound_samples"``), so the next run searches above the size
    it starts at; files without them load as before.

    With a key function of your own, its key is written as text too: a str as
    it is; anything else part by part, a tuple as ``"(part, part)"``, a device
    by its kind, model and memory, a function, method or module by
    ``"<qualified name> (<file>:<first line>)"``, and any other value by its
    ``repr``, which must then be the same in every run (an object's default
    ``repr`` holds its address, which is not).

    The file is read when the cache is made and rewritten whenever a new size
    is stored: merged with what other processes wrote meanwhile (under a lock
    file, ``<path>.lock``, where the platform has ``fcntl``, waited for at most
    10 seconds where the file does not change meanwhile), written to a
    temporary file beside it and renamed over it, so readers never see half a
    file. A symbolic link is followed: its target is the file read and
    replaced (keeping its permissions), with the lock file beside it. Only a
    regular file is read or replaced: a folder, FIFO, device
    or socket at the path, a file that cannot be read, is not valid JSON or is
    not a koila-retry cache is ignored with a :class:`CacheFileWarning` and never
    overwritten (the path might name a file of yours); a file that cannot be
    written is warned about once. Either way, sizes are then kept in memory
    only: the cache never breaks the job it serves, and never costs a call
    that succeeded its result.

    Args:
        path (str or os.PathLike): the JSON file. Its folder is made if missing.
        maxsize (int): how many keys to keep, in memory and in the file. In
            memory the least recently used go first; in the file, which
            other processes write too, the least recently stored. Default: 256.
        key (KeyFunction, optional): another key function. Default: ``None``,
            :func:`~koila_retry.size_class_key`.

    Raises:
        TypeError: if ``path`` is not a str or path, or ``key`` is not callable.
        ValueError: if ``maxsize`` is not a positive int, or ``path`` is empty.

    .. versionadded:: 0.1.0
    """

    def __init__(self, path: str | os.PathLike[str], maxsize: int = 256, *, key: KeyFunction | None = None) -> None:
        super().__init__(maxsize, key=size_class_key if key is None else key)
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__} {path!r}")
        if not isinstance(os.fspath(path), str):  # a PathLike of bytes: the file's name is written as text
            raise TypeError(f"path must name the file as text, got a path of bytes {os.fspath(path)!r}")
        if not os.fspath(path):  # would be the working folder
            raise ValueError("path='' names no file: give the path of a JSON file, '~/.cache/project/sizes.json' say")
        self.path = os.path.abspath(os.path.expanduser(os.fspath(path)))
        self._writable = True
        self._dropped_warned = False
        self._held_warned = False  # of a lock another process held for long
        self._pending: list[Callable[[_Entries], object]] = []  # the changes such a lock kept from the file
        self._made = False  # see _warn
        self._load(maxsize)
        self._made = True

    def _load(self, maxsize: int) -> None:
        """Take the sizes and bounds of the file into memory, kept by ``maxsize``; from now on write bounds to it."""
        stored = self._read(self.path)
        if stored is not None:
            for text, size in list(stored.items())[-maxsize:]:
                SizeCache.__setitem__(self, text, size)  # in memory: the file has it already
                nbytes = stored.samples.get(text)
                if nbytes is not None:
                    SizeCache.prove(self, text, nbytes)
            # Not a bound whose size a smaller maxsize left out: refine would start its search from it (75K).
            kept = [(text, bound) for text, bound in stored.bounds.items() if text not in stored or text in self]
            for text, bound in kept[-maxsize:]:
                self.bounds.update(text, functools.partial(_replaced, bound))  # not written back: changed is unset
        # With refine=True, the smallest size that failed is kept in the file too, so that the next
        # run does not start below it without knowing what lies between.
        self.bounds.changed = self._bound_changed

    def key(
        self, function: object, caller: FrameType | None, device: torch.device, sample: Hashable = None
    ) -> str | None:
        key = self.key_function(self._given(function), caller, device, sample)
        if key is None:
            return None
        if self.key_function is size_class_key:
            # The text of the first release, which the files written since hold.
            function, device, sample = key  # type: ignore[misc]
            filename, line, qualname = function_identity(function)
            text = f"{qualname} ({filename}:{line}) on {describe_device(device)}"
            return text if sample is None else f"{text} for samples {sample}"
        return _stable_text(key)

    def __setitem__(self, key: Hashable, size: int) -> None:
        super().__setitem__(key, size)
        if isinstance(key, str):
            self._update(lambda sizes: _store(sizes, key, size))

    def prove(self, key: Hashable, nbytes: int) -> None:
        super().prove(key, nbytes)
        if isinstance(key, str) and self.sample_bytes(key) == nbytes:
            self._update(lambda sizes: _prove(sizes, key, nbytes))

    def _bound_changed(self, key: Hashable, change: Callable[[Bound | None], Bound | None]) -> None:
        """Apply a change of ``key``'s bound to the file, to the bound there (another process's, maybe)."""
        if isinstance(key, str):
            self._update(lambda entries: _bound(entries, key, change))

    def _discard(self, key: Hashable) -> int | None:
        size = super()._discard(key)  # del, pop and popitem all come here
        if size is not None and isinstance(key, str):
            self._update(lambda sizes: sizes.pop(key, None))
        return size

    def cache_clear(self) -> None:
        """Forget every size, in memory and in the file, and reset the hit and miss counts."""
        super().cache_clear()
        self._update(lambda sizes: sizes.clear())

    def _read(self, path: str) -> _Entries | None:
        """Return the sizes in the file at ``path``; none if there is no file; ``None`` if it is not ours."""
        try:
            # Only a regular file is opened: opening a device may act on it (a tape rewinds).
            kind = _special(os.stat(path).st_mode)
            if kind is None:
                with open(os.open(path, os.O_RDONLY | _NONBLOCK), encoding="utf-8") as file:
                    kind = _special(os.fstat(file.fileno()).st_mode)  # in case one took its place since
                    text = "" if kind is not None else file.read()
        except FileNotFoundError:
            return _Entries()
        except (OSError, UnicodeDecodeError) as exc:
            self._refuse(f"cannot be read ({exc})", delete=False)
            return None
        if kind is not None:
            self._refuse(f"is a {kind}, not a regular file", delete=False)
            return None
        if not text.strip():
            return _Entries()  # an empty file, as `touch` leaves it: nothing stored yet
        try:
            content = json.loads(text)
        except ValueError as exc:
            self._refuse(f"is not valid JSON ({exc})", delete=True)
            return None
        except RecursionError:
            self._refuse("is not valid JSON (nested deeper than Python's parser goes)", delete=True)
            return None
        if not _is_ours(content):
            version = content.get("version") if isinstance(content, dict) and content.get("format") == _FORMAT else None
            if type(version) is int and version > _VERSION:  # a newer koila-retry's, which shares the file
                self._refuse(f"was written by a newer koila-retry (file version {version}; this one reads {_VERSION})")
            else:
                self._refuse(f"is not a koila-retry size cache (no {_FORMAT!r} version {_VERSION})", delete=True)
            return None
        entries = content["sizes"]
        sizes = _Entries(
            (key, size)
            for key, size in entries.items()
            if isinstance(key, str) and type(size) is int and size >= 1  # bools are ints, and no sizes
        )
        samples = content.get("samples")
        if isinstance(samples, dict):  # absent from files written before it was kept
            sizes.samples.update(
                (key, nbytes) for key, nbytes in samples.items() if key in sizes and type(nbytes) is int and nbytes >= 1
            )
        bounds, nbytes_of = content.get("bounds"), content.get("bound_samples")
        if isinstance(bounds, dict):  # as "samples"; a bound only narrows a search, so a bad one is left out
            nbytes_of = nbytes_of if isinstance(nbytes_of, dict) else {}
            for key, size in bounds.items():
                if isinstance(key, str) and type(size) is int and size >= 1:
                    nbytes = nbytes_of.get(key)
                    sizes.bounds[key] = (size, nbytes if type(nbytes) is int and nbytes >= 1 else 0)
        if len(sizes) < len(entries) and not self._dropped_warned:
            self._dropped_warned = True  # once: the next write leaves them out of the file
            self._warn(
                f"koila_retry: dropping {len(entries) - len(sizes)} entries of the size cache file {self.path} "
                "that are not sizes (ints >= 1)."
            )
        return sizes

    def _refuse(self, reason: str, delete: bool = False) -> None:
        self._writable = False
        advice = "Delete the file, or give DiskCache another path" if delete else "Give DiskCache another path"
        self._warn(
            f"koila_retry: ignoring the size cache file {self.path}: it {reason}. It will not be "
            f"overwritten; sizes are kept in memory only. {advice}."
        )

    def _warn(self, message: str) -> None:
        # Made, the cache is written after a call succeeded (a size) or while an out-of-memory
        # error is handled (refine=True's bound): a warning that a filter makes an error there
        # would cost a call its result or its recovery, so it is logged instead. Reading the
        # file as the cache is made, nothing has run yet: the filter is followed.
        if self._made:
            warn_or_log(message, CacheFileWarning, stacklevel=levels_to_caller())
        else:
            warnings.warn(message, CacheFileWarning, stacklevel=levels_to_caller())

    def _update(self, change: Callable[[_Entries], object]) -> None:
        """Apply ``change`` to the sizes in the file, merged with what other processes wrote."""
        if not self._writable:
            return
        with self._lock:
            try:
                self._write(change)
            except Warning:
                raise  # another library's warning that a filter made an error (ours are logged: see _warn)
            except Exception as exc:  # whatever the file does, the call that stores a size keeps its result
                self._cannot_write(exc)

    def _write(self, change: Callable[[_Entries], object]) -> None:
        pending = [*self._pending, change]

        def changes(entries: _Entries) -> None:
            for each in pending:
                each(entries)

        try:
            _replace(self.path, self._maxsize, changes, self._read)
        except _Held as exc:  # for now: the next write that gets the lock makes this change too
            self._pending = pending
            if not self._held_warned:
                self._held_warned = True
                self._warn(
                    f"koila_retry: cannot write the size cache file {self.path} now ({exc}); the change is kept "
                    "in memory, and made in the file with the next one once the lock is free. This warning is "
                    "shown once."
                )
        except OSError as exc:
            self._cannot_write(exc)
        else:
            self._pending = []

    def _cannot_write(self, exc: Exception) -> None:
        self._writable = False
        self._warn(
            f"koila_retry: cannot write the size cache file {self.path} ({type(exc).__name__}: {exc}); sizes "
            "are kept in memory only from now on."
        )

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, path={self.path!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        # Its path, size and key: another process (mp.spawn's, a DataLoader worker's) reads the file again,
        # and a copy is a cache of its own. Its lock and what it holds in memory are this process's.
        maxsize = self.cache_info().maxsize
        if _made_as_disk_cache(type(self)):
            return (_reopened, (type(self), self.path, maxsize, self.key_function))
        # A subclass's own __init__ that takes other arguments (or __new__, or metaclass): made as objects are, from
        # its state (less the changes a held lock kept from the file, this process's own).
        saved = self.__getstate__()
        saved["state"]["_pending"] = []
        return (_new, (type(self),), saved)

    def __setstate__(self, saved: dict[str, Any]) -> None:
        # A copy's or an unpickled subclass's (see __reduce__), and a deep copy's: the sizes and bounds read from
        # the file again (copied from memory, its bounds would write through the original, kept alive).
        super().__setstate__(saved)
        self.bounds.changed = None
        self._pending = []
        SizeCache.cache_clear(self)  # in memory only: the file is the copy's too
        self._load(self.cache_info().maxsize)


def _made_as_disk_cache(kind: type[DiskCache]) -> bool:
    """Return whether ``kind`` is made as ``DiskCache`` is: ``kind(path, maxsize, key=key)``, meaning the same."""
    if kind.__init__ is DiskCache.__init__:
        return True
    # By the names and kinds of its parameters: that a call binds says nothing of what its arguments mean.
    if kind.__new__ is not DiskCache.__new__ or type(kind).__call__ is not type(DiskCache).__call__:
        return False
    try:
        parameters = inspect.signature(kind.__init__).parameters.values()
    except (TypeError, ValueError):
        return False
    return [(p.name, p.kind) for p in parameters] == _DISK_CACHES_INIT


# What DiskCache.__init__ takes, by name and kind.
_DISK_CACHES_INIT = [
    ("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
    ("path", inspect.Parameter.POSITIONAL_OR_KEYWORD),
    ("maxsize", inspect.Parameter.POSITIONAL_OR_KEYWORD),
    ("key", inspect.Parameter.KEYWORD_ONLY),
]


def _new(kind: type[DiskCache]) -> DiskCache:
    return kind.__new__(kind)  # its state given after (__setstate__)


def _reopened(kind: type[DiskCache], path: str, maxsize: int, key: KeyFunction) -> DiskCache:
    return kind(path, maxsize, key=key)  # a subclass's own key() kept: made again as DiskCache is made


def _replace(
    path: str, maxsize: int, change: Callable[[_Entries], object], read: Callable[[str], _Entries | None]
) -> None:
    """Apply ``change`` to the sizes of the file at ``path`` as ``read`` finds them, and replace the file whole."""
    # A symbolic link is followed: replacing the link itself would leave its target,
    # the file that others read, as it was.
    target = os.path.realpath(path)
    folder = os.path.dirname(target)
    os.makedirs(folder, exist_ok=True)
    with _locked(target + ".lock", target) as created:
        _sweep(target)
        stored = read(target)  # other processes may have stored sizes since we last looked
        if stored is None:
            return
        change(stored)
        entries = dict(list(stored.items())[-maxsize:])
        content: dict[str, Any] = {"format": _FORMAT, "version": _VERSION, "sizes": entries}
        samples = {key: nbytes for key, nbytes in stored.samples.items() if key in entries}
        if samples:
            content["samples"] = samples
        # What refine learnt of a key whose size this write trims goes with it (probe 75G): the next run
        # would start its search from it. A bound of a key that never had a size stays.
        trimmed = stored.keys() - entries.keys()
        bounds = [(key, bound) for key, bound in stored.bounds.items() if key not in trimmed][-maxsize:]
        if bounds:
            content["bounds"] = {key: size for key, (size, _) in bounds}
            nbytes_of = {key: nbytes for key, (_, nbytes) in bounds if nbytes}
            if nbytes_of:
                content["bound_samples"] = nbytes_of
        mode = found = None
        with contextlib.suppress(FileNotFoundError):
            found = os.stat(target)
            mode = stat.S_IMODE(found.st_mode)
        if mode is not None and not mode & 0o222:
            # Made read-only to freeze it: renaming over it would write it all the same (and does, as root).
            raise PermissionError(errno.EACCES, "the file is read-only (no write permission for anyone)", target)
        if mode is not None and not os.access(target, os.W_OK):
            # Another user's, say: a writable folder lets a new file be renamed over it, which would be ours.
            raise PermissionError(errno.EACCES, "this process may not write the file (another user's, say)", target)
        if mode is None and created is not None:
            # A new file as readable as the umask allows (a lock file made by us shows it): a temporary file
            # is private. Its owner reads and writes it whatever the lock file's mode.
            mode = created | 0o600
        with tempfile.NamedTemporaryFile(
            "w", encoding="utf-8", dir=folder, prefix=os.path.basename(target) + ".", suffix=".tmp", delete=False
        ) as temporary:
            try:
                json.dump(content, temporary, indent=1, sort_keys=False)
                temporary.flush()
                os.fsync(temporary.fileno())
                if mode is not None:  # a file others share stays as readable as it was
                    os.chmod(temporary.name, mode)
                if found is not None and (found.st_uid, found.st_gid) != (os.geteuid(), os.getegid()):
                    # Root writing another user's file: it stays theirs. Anyone else may keep its group only
                    # (a member of it), so that the others who shared the file through it still write it.
                    try:
                        os.chown(temporary.name, found.st_uid, found.st_gid)
                    except OSError:
                        with contextlib.suppress(OSError):
                            os.chown(temporary.name, -1, found.st_gid)
            except BaseException:
                _remove(temporary)
                raise
        try:
            os.replace(temporary.name, target)
        except BaseException:
            _remove(temporary)
            raise


def _stable_text(key: object) -> str:
    """Write a key of a user's key function as text that means the same in every run (see DiskCache)."""
    return key if isinstance(key, str) else _text(key)


def _text(part: object) -> str:
    if isinstance(part, torch.device):
        return describe_device(part)
    if isinstance(part, tuple):
        return "(" + ", ".join(_text(item) for item in part) + ("," if len(part) == 1 else "") + ")"
    if isinstance(part, (str, int, float, type(None))) or not callable(part):
        return repr(part)
    filename, line, qualname = function_identity(part)
    return f"{qualname} ({filename}:{line})"


def _is_ours(content: Any) -> bool:
    return (
        isinstance(content, dict)
        and content.get("format") == _FORMAT
        and type(content.get("version")) is int  # True and 1.0 equal 1, and are not our version
        and content["version"] == _VERSION
        and isinstance(content.get("sizes"), dict)
    )


def _special(mode: int) -> str | None:
    """Name the kind of a file that is not a regular file; ``None`` for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _SPECIAL if test(mode)), "special file")


class _Entries(dict[str, int]):
    """A cache file's sizes by key, with each one's sample bytes (``samples``) and refine's bounds (``bounds``)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.samples: dict[str, int] = {}
        self.bounds: dict[str, Bound] = {}

    def pop(self, key: str, default: Any = None) -> Any:
        self.samples.pop(key, None)
        return super().pop(key, default)

    def clear(self) -> None:
        self.samples.clear()
        self.bounds.clear()
        super().clear()


def _store(sizes: _Entries, key: str, size: int) -> None:
    sizes.pop(key, None)  # re-inserted last: the most recently stored go last, and stay longest
    sizes[key] = size


def _prove(sizes: _Entries, key: str, nbytes: int) -> None:
    if key in sizes:
        sizes.samples[key] = nbytes


def _replaced(bound: Bound, before: Bound | None) -> Bound:
    return bound


def _bound(entries: _Entries, key: str, change: Callable[[Bound | None], Bound | None]) -> None:
    bound = change(entries.bounds.pop(key, None))  # re-inserted last: the most recently changed stay longest
    if bound is not None:
        entries.bounds[key] = bound


def _remove(temporary: IO[str]) -> None:
    with contextlib.suppress(OSError):
        os.unlink(temporary.name)


@contextlib.contextmanager
def _locked(path: str, target: str) -> Iterator[int | None]:
    """Hold the lock file at ``path`` for ``target``; yield the mode a new file gets here (None where nothing locks)."""
    if fcntl is None:
        yield None
        return
    # Not blocking: a FIFO put at the path would wait for a reader forever.
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NONBLOCK, 0o666)
    with open(descriptor, "a"):  # closes the descriptor
        found = os.fstat(descriptor)
        if not stat.S_ISREG(found.st_mode):
            raise OSError(errno.EINVAL, "the lock file is not a regular file", path)
        _lock(descriptor, path, target)
        try:
            yield stat.S_IMODE(found.st_mode) & 0o666
        finally:
            fcntl.flock(descriptor, fcntl.LOCK_UN)


class _Held(TimeoutError):
    """The lock on the cache file was held by another process for longer than :data:`LOCK_WAIT` seconds."""


def _lock(descriptor: int, path: str, target: str) -> None:
    """Take the lock on ``descriptor``, or raise :class:`_Held` once one holder has kept it :data:`LOCK_WAIT` s."""
    # The wait starts again whenever the file changes: other writers are done in turn, however many queue.
    deadline, pause, seen = time.monotonic() + LOCK_WAIT, 0.001, _version_of(target)
    while True:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            now, version = time.monotonic(), _version_of(target)
            if version != seen:
                deadline, seen = now + LOCK_WAIT, version
            elif now >= deadline:
                raise _Held(
                    errno.ETIMEDOUT, f"another process has held its lock for over {LOCK_WAIT:g} s", path
                ) from None
            time.sleep(pause)
            pause = min(pause * 2, 0.05)


def _version_of(path: str) -> tuple[int, int] | None:
    try:
        found = os.stat(path)
    except OSError:
        return None
    return (found.st_ino, found.st_mtime_ns)


def _sweep(target: str) -> None:
    # Under the lock, a temporary file of ours is a writer's that was killed before its rename: each is a
    # whole copy of the cache, left there for good.
    if fcntl is None:
        return
    folder, name = os.path.split(target)
    # Only tempfile's names for this file (8 of its characters between): not another cache's whose name
    # starts with this one's, nor a file of the user's.
    ours = re.compile(re.escape(name) + r"\.[a-z0-9_]{8}\.tmp")
    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            if ours.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
