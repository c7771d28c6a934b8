"""DiskCache: sizes that outlive the process, a file that never breaks the job, and its keys."""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import json
import logging
import os
import pickle
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from torch import nn

import koila_retry as koila
from koila_retry._core import decision, disk
from koila_retry._core.cache import class_identity, function_identity
from koila_retry._core.memory import describe_device
from koila_retry.testing import oom_above, simulated_device

ROOT = str(Path(koila.__file__).resolve().parent.parent)
CPU = torch.device("cpu")
FORMAT = "koila-retry size cache"
T = TypeVar("T")


def _content(path: Path) -> dict[str, Any]:
    content = json.loads(path.read_text(encoding="utf-8"))
    assert isinstance(content, dict)
    return content


def _sizes(path: Path) -> dict[str, int]:
    content = _content(path)
    assert content["format"] == FORMAT
    assert content["version"] == 1
    sizes = content["sizes"]
    assert isinstance(sizes, dict)
    return sizes


def _leftovers(folder: Path, name: str) -> list[str]:
    """Files in ``folder`` other than the cache file and its lock file."""
    return sorted(set(os.listdir(folder)) - {name, name + ".lock"})


def _run_scripts(script: Path, *runs: tuple[object, ...]) -> list[dict[str, Any]]:
    """Run ``script`` once per tuple of arguments, all at once, and return what each printed last."""
    processes = [
        subprocess.Popen(
            [sys.executable, str(script), *map(str, args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": ROOT},  # the koila_retry under test, wherever it is
        )
        for args in runs
    ]
    results = []
    try:
        for process in processes:
            stdout, stderr = process.communicate(timeout=120)
            assert process.returncode == 0, stderr
            # The scripts make CacheFileWarning an error; one at a write would be logged instead.
            assert "a warnings filter made this warning an error" not in stderr, stderr
            result = json.loads(stdout.strip().splitlines()[-1])
            assert isinstance(result, dict)
            results.append(result)
    finally:
        for process in processes:
            if process.poll() is None:  # another one failed: do not leave this one behind
                process.kill()
                process.wait()
    return results


@contextlib.contextmanager
def no_warnings() -> Iterator[None]:
    """Turn every warning inside the block into an error, and fail on one that koila logged instead."""
    logged: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = logged.append  # type: ignore[method-assign]
    logger = logging.getLogger("koila_retry")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            yield
    finally:
        logger.removeHandler(handler)
    assert [record.getMessage() for record in logged] == []


# -- a second process starts at the size that worked -------------------------------------------

SECOND_RUN_SCRIPT = textwrap.dedent(
    """
    import json, sys, warnings
    import torch
    import koila_retry as koila
    from koila_retry.testing import oom_above

    warnings.simplefilter("error", koila.CacheFileWarning)
    path, features = sys.argv[1], int(sys.argv[2])
    cache = koila.DiskCache(path)
    fits = oom_above(64)
    batches, chunks = [], []

    @koila.batch(initial=512, cache=cache)
    def evaluate(batch_size):
        batches.append(batch_size)
        fits(batch_size)
        return batch_size

    def encode(rows):
        chunks.append(rows.shape[0])
        fits(rows.shape[0])
        return rows * 2

    evaluate()
    x = torch.arange(1000.0).unsqueeze(1).expand(1000, features).contiguous()
    assert torch.equal(koila.chunked(encode, x, initial=512, cache=cache), x * 2)
    print(json.dumps({"batches": batches, "chunks": chunks, "ooms": fits.raised}))
    """
)


@pytest.mark.slow
def test_a_second_process_starts_at_the_size_that_worked(tmp_path: Path) -> None:
    script = tmp_path / "evaluate.py"
    script.write_text(SECOND_RUN_SCRIPT, encoding="utf-8")
    path = tmp_path / "cache" / "sizes.json"

    (first,) = _run_scripts(script, (path, 8))
    assert first["batches"] == [512, 256, 128, 64]
    assert first["chunks"][:4] == [512, 256, 128, 64]
    assert first["ooms"] == 6
    stored = _sizes(path)
    assert sorted(stored.values()) == [64, 64]
    assert any(key.startswith(f"evaluate ({script}:") for key in stored)
    assert any(key.startswith(f"encode ({script}:") for key in stored)

    # Both read the file when they start (the second stores nothing new, so they may run at once).
    second, third = _run_scripts(script, (path, 8), (path, 16))
    # The same script again: both start at 64, and nothing runs out of memory.
    assert second["batches"] == [64]
    assert second["chunks"] == [64] * 15 + [1000 - 15 * 64]
    assert second["ooms"] == 0
    # Another feature dimension: chunked's key holds the per-sample shape, so it starts
    # afresh; batch sees no inputs, its key is the same and it starts at 64.
    assert third["batches"] == [64]
    assert third["chunks"][:4] == [512, 256, 128, 64]
    assert third["ooms"] == 3
    final = _sizes(path)
    assert sorted(final.values()) == [64, 64, 64]
    assert {key: final[key] for key in stored} == stored
    assert _leftovers(path.parent, path.name) == []


CONCURRENT_SCRIPT = textwrap.dedent(
    """
    import os, sys, time, warnings
    import koila_retry as koila

    warnings.simplefilter("error", koila.CacheFileWarning)
    path, name, barrier = sys.argv[1:4]
    open(os.path.join(barrier, name), "w").close()
    deadline = time.monotonic() + 60
    while len(os.listdir(barrier)) < 2:  # both processes have imported torch: start together
        if time.monotonic() > deadline:
            sys.exit("the other process never came")
        time.sleep(0.001)
    cache = koila.DiskCache(path)
    for number in range(50):
        cache[f"{name} key {number}"] = number + 1
    print("{}")
    """
)


@pytest.mark.slow
def test_two_processes_writing_at_once_leave_a_valid_file(tmp_path: Path) -> None:
    script = tmp_path / "write.py"
    script.write_text(CONCURRENT_SCRIPT, encoding="utf-8")
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    path = tmp_path / "sizes.json"
    assert _run_scripts(script, (path, "first", barrier), (path, "second", barrier)) == [{}, {}]

    content = _content(path)
    assert set(content) == {"format", "version", "sizes"}
    sizes = _sizes(path)
    assert all(isinstance(size, int) and size >= 1 for size in sizes.values())
    assert _leftovers(tmp_path, path.name) == ["barrier", "write.py"]
    if disk.fcntl is not None:  # with the lock, each writer merges what the other wrote
        expected = {f"{name} key {number}": number + 1 for name in ("first", "second") for number in range(50)}
        assert sizes == expected


# -- files that are not ours, or not readable ---------------------------------------------------

NOT_OURS = {
    "invalid JSON": (b'{"format": "koila-retry size cache", "version": 1, "sizes": {"a": 1', "is not valid JSON"),
    "foreign JSON": (b'{"theme": "dark", "font size": 12}\n', "is not a koila-retry size cache"),
    "JSON list": (b"[1, 2, 3]", "is not a koila-retry size cache"),
    "a newer version": (  # a newer koila-retry's, which shares the file: not to delete
        b'{"format": "koila-retry size cache", "version": 2, "sizes": {"a": 1}}',
        r"was written by a newer koila-retry \(file version 2; this one reads 1\)",
    ),
    "version true": (  # True == 1 in Python, and is still not our version
        b'{"format": "koila-retry size cache", "version": true, "sizes": {"a": 1}}',
        "is not a koila-retry size cache",
    ),
    "version 1.0": (
        b'{"format": "koila-retry size cache", "version": 1.0, "sizes": {"a": 1}}',
        "is not a koila-retry size cache",
    ),
    "sizes not a mapping": (
        b'{"format": "koila-retry size cache", "version": 1, "sizes": [["a", 1]]}',
        "is not a koila-retry size cache",
    ),
    "not text": (b"\xff\xfe\x00binary\x80", "cannot be read"),
    "nested too deeply": (
        b"[" * 100_000 + b"]" * 100_000,
        r"is not valid JSON \(nested deeper than Python.s parser goes\)",
    ),
}


@pytest.mark.parametrize("kind", sorted(NOT_OURS))
def test_a_file_that_is_not_ours_is_ignored_with_a_warning_and_never_overwritten(tmp_path: Path, kind: str) -> None:
    data, reason = NOT_OURS[kind]
    path = tmp_path / "sizes.json"
    path.write_bytes(data)
    with pytest.warns(koila.CacheFileWarning, match=reason) as record:
        cache = koila.DiskCache(path)
    assert len(record) == 1
    assert str(path) in str(record[0].message)
    # Deleting is advised for a file that is not one (or no longer), never for one a newer version reads.
    assert ("Delete the file" in str(record[0].message)) == (kind not in ("a newer version", "not text"))
    assert record[0].filename == __file__  # points at the line that made the cache
    assert len(cache) == 0

    fits = oom_above(16)

    @koila.batch(initial=128, cache=cache)
    def run(batch_size: int) -> int:
        fits(batch_size)
        return batch_size

    with no_warnings():  # warned once, when the cache was made
        assert run() == 16
        cache["another"] = 3
        assert run() == 16  # remembered in memory
    assert fits.raised == 3
    assert cache["another"] == 3
    assert path.read_bytes() == data
    assert _leftovers(tmp_path, path.name) == []


def test_a_file_spoilt_after_the_cache_was_made_is_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "sizes.json"
    cache = koila.DiskCache(path)
    cache["first"] = 8
    assert _sizes(path) == {"first": 8}
    path.write_text("this is someone's notes", encoding="utf-8")
    with pytest.warns(koila.CacheFileWarning, match="is not valid JSON"):
        cache["second"] = 4
    assert path.read_text(encoding="utf-8") == "this is someone's notes"
    assert (cache["first"], cache["second"]) == (8, 4)


@pytest.mark.parametrize("text", ["", "  \n"], ids=["empty", "blank"])
def test_an_empty_file_is_an_empty_cache(tmp_path: Path, text: str) -> None:
    path = tmp_path / "sizes.json"
    path.write_text(text, encoding="utf-8")
    with no_warnings():
        cache = koila.DiskCache(path)
        assert len(cache) == 0
        cache["key"] = 32
    assert _sizes(path) == {"key": 32}


def test_bad_entries_are_dropped_and_good_ones_kept(tmp_path: Path) -> None:
    path = tmp_path / "sizes.json"
    sizes = {
        "good": 32,
        "float": 1.5,
        "string": "64",
        "bool": True,
        "zero": 0,
        "negative": -4,
        "null": None,
        "list": [8],
        "also good": 7,
    }
    path.write_text(json.dumps({"format": FORMAT, "version": 1, "sizes": sizes}), encoding="utf-8")
    with pytest.warns(koila.CacheFileWarning, match="dropping 7 entries"):
        cache = koila.DiskCache(path)
    assert dict(cache.items()) == {"good": 32, "also good": 7}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the write drops them from the file without a second warning
        cache["new"] = 16
    assert _sizes(path) == {"good": 32, "also good": 7, "new": 16}


def test_a_folder_at_the_path_is_warned_about(tmp_path: Path) -> None:
    path = tmp_path / "sizes.json"
    path.mkdir()
    with pytest.warns(koila.CacheFileWarning, match="is a folder, not a regular file"):
        cache = koila.DiskCache(path)
    cache["key"] = 2
    assert cache["key"] == 2
    assert path.is_dir()


# -- a place that cannot be written --------------------------------------------------------------


def _keeps_working_without_warning(cache: koila.DiskCache) -> None:
    fits = oom_above(4)

    @koila.batch(initial=16, cache=cache)
    def run(batch_size: int) -> int:
        fits(batch_size)
        return batch_size

    with no_warnings():  # warned once: later stores say nothing more
        cache["second"] = 2
        assert run() == 4
        assert run() == 4
    assert fits.raised == 2  # the second call started at the remembered size
    assert cache["second"] == 2


@pytest.mark.skipif(not hasattr(os, "geteuid"), reason="POSIX permissions")
def test_a_read_only_folder_warns_once_and_keeps_sizes_in_memory(tmp_path: Path) -> None:
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o500)
    path = folder / "sizes.json"
    try:
        if os.geteuid() == 0 and os.access(folder, os.W_OK):
            pytest.skip("root ignores folder permissions")
        cache = koila.DiskCache(path)  # nothing to read: no warning yet
        with pytest.warns(koila.CacheFileWarning, match="cannot write the size cache file") as record:
            cache["first"] = 8
        assert len(record) == 1
        assert str(path) in str(record[0].message)
        _keeps_working_without_warning(cache)
        assert cache["first"] == 8
        assert os.listdir(folder) == []
    finally:
        folder.chmod(0o700)


@pytest.mark.skipif(not hasattr(os, "geteuid"), reason="POSIX permissions")
def test_a_read_only_file_is_read_and_never_replaced_even_in_a_writable_folder(tmp_path: Path) -> None:
    path = tmp_path / "sizes.json"
    koila.DiskCache(path)["frozen"] = 16
    text = path.read_text(encoding="utf-8")
    path.chmod(0o444)  # frozen: a new file renamed over it would replace it all the same (as root too)
    try:
        cache = koila.DiskCache(path)
        assert cache["frozen"] == 16
        with pytest.warns(koila.CacheFileWarning, match="cannot write the size cache file.*read-only") as record:
            cache["new"] = 8
        assert len(record) == 1
        _keeps_working_without_warning(cache)
        assert cache["new"] == 8
        assert path.read_text(encoding="utf-8") == text
        assert stat.S_IMODE(path.stat().st_mode) == 0o444
    finally:
        path.chmod(0o644)


_NOBODY = 65534  # the uid and gid of "nobody" on Linux


def _nobodys_file(tmp_path: Path) -> Path:
    """A cache file of another user's (nobody's, mode 0644) in a folder anyone may write, as /tmp is."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("needs root, to give a file to another user")
    path = tmp_path / "sizes.json"
    koila.DiskCache(path)["theirs"] = 16
    os.chown(path, _NOBODY, _NOBODY)
    path.chmod(0o644)
    tmp_path.chmod(0o777)
    return path


def test_another_users_file_this_process_may_not_write_is_read_and_never_replaced(tmp_path: Path) -> None:
    # Root without its capabilities (setpriv) may not write a file of nobody's, but may rename a
    # new file over it in the folder: that would make the file its own.
    path = _nobodys_file(tmp_path)
    script = textwrap.dedent(
        f"""
        import warnings, koila_retry as koila
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cache = koila.DiskCache({str(path)!r})
            cache["mine"] = 8
        assert cache["theirs"] == 16 and cache["mine"] == 8
        print([str(warning.message) for warning in caught])
        """
    )
    try:
        ran = subprocess.run(
            ["setpriv", "--inh-caps=-all", "--bounding-set=-all", sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except FileNotFoundError:
        pytest.skip("no setpriv here")
    assert ran.returncode == 0, ran.stderr
    assert "may not write the file" in ran.stdout
    assert ran.stdout.count("cannot write the size cache file") == 1
    assert (path.stat().st_uid, stat.S_IMODE(path.stat().st_mode)) == (_NOBODY, 0o644)
    assert json.loads(path.read_text(encoding="utf-8"))["sizes"] == {"theirs": 16}


def test_another_users_file_that_root_writes_stays_theirs(tmp_path: Path) -> None:
    path = _nobodys_file(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        koila.DiskCache(path)["mine"] = 8
    found = path.stat()
    assert (found.st_uid, found.st_gid, stat.S_IMODE(found.st_mode)) == (_NOBODY, _NOBODY, 0o644)
    assert json.loads(path.read_text(encoding="utf-8"))["sizes"] == {"theirs": 16, "mine": 8}


def test_a_file_shared_through_its_group_stays_writable_by_the_group() -> None:
    # Another member of the file's group may replace it: the new file is the writer's, and keeps the group
    # and the mode, so that the one who shared it still writes it.
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("needs root, to act as two users of one group")
    team, alice, bob = 4321, 4001, 4002
    # Not under pytest's folder, which only root may enter.
    with tempfile.TemporaryDirectory() as folder:
        os.chmod(folder, 0o777)
        _shared_through_a_group(Path(folder) / "sizes.json", team, alice, bob)


def _shared_through_a_group(path: Path, team: int, alice: int, bob: int) -> None:
    script = textwrap.dedent(
        f"""
        import os, sys, warnings, koila_retry as koila
        os.setgroups([{team}]); os.setgid(int(sys.argv[1])); os.setuid(int(sys.argv[1])); os.umask(0o002)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            koila.DiskCache({str(path)!r})[sys.argv[2]] = 8
        print([str(warning.message) for warning in caught])
        """
    )

    def store(user: int, key: str) -> str:
        ran = subprocess.run(
            [sys.executable, "-c", script, str(user), key], capture_output=True, text=True, timeout=120
        )
        assert ran.returncode == 0, ran.stderr
        return ran.stdout

    assert store(alice, "alice's") == "[]\n"
    for made in (path, Path(f"{path}.lock")):  # Alice shares it with her team
        os.chown(made, alice, team)
        made.chmod(0o664)
    assert store(bob, "bob's") == "[]\n"
    assert (path.stat().st_gid, stat.S_IMODE(path.stat().st_mode)) == (team, 0o664)
    assert store(alice, "alice's again") == "[]\n", "she still writes the file she shared"
    assert set(json.loads(path.read_text(encoding="utf-8"))["sizes"]) == {"alice's", "bob's", "alice's again"}


def test_a_path_below_a_file_warns_once_and_keeps_sizes_in_memory(tmp_path: Path) -> None:
    # Unusable even for root: the folder would have to be where a file is. Reading it
    # already fails (not a directory), so the warning comes when the cache is made.
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a folder", encoding="utf-8")
    path = blocker / "sizes.json"
    with pytest.warns(koila.CacheFileWarning, match="cannot be read") as record:
        cache = koila.DiskCache(path)
    assert len(record) == 1
    assert str(path) in str(record[0].message)
    _keeps_working_without_warning(cache)
    assert blocker.read_text(encoding="utf-8") == "a file, not a folder"


# -- writing ------------------------------------------------------------------------------------


def test_the_file_is_ours_and_written_without_temporary_files_left(tmp_path: Path) -> None:
    path = tmp_path / "made" / "on" / "demand" / "sizes.json"
    cache = koila.DiskCache(path)
    assert not path.parent.exists()  # nothing stored, nothing written
    for number in range(10):
        cache[f"key {number}"] = number + 1
    assert _content(path) == {
        "format": FORMAT,
        "version": 1,
        "sizes": {f"key {number}": number + 1 for number in range(10)},
    }
    assert _leftovers(path.parent, path.name) == []
    assert dict(koila.DiskCache(path).items()) == dict(cache.items())  # a new cache reads it back


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_a_failed_write_leaves_the_old_file_and_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    path = tmp_path / "sizes.json"
    cache = koila.DiskCache(path)
    cache["kept"] = 8
    before = path.read_bytes()

    def full_disk(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk.os, failing, full_disk)
    with pytest.warns(koila.CacheFileWarning, match="No space left on device") as record:
        cache["lost"] = 4
    assert len(record) == 1
    with no_warnings():  # warned once: from now on sizes stay in memory, quietly
        cache["quiet"] = 2
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert _leftovers(tmp_path, path.name) == []
    assert (cache["lost"], cache["quiet"]) == (4, 2)  # still in memory


def test_a_cached_call_does_not_rewrite_the_file(tmp_path: Path) -> None:
    path = tmp_path / "sizes.json"
    fits = oom_above(8)

    @koila.batch(initial=64, cache=koila.DiskCache(path))
    def run(batch_size: int) -> int:
        fits(batch_size)
        return batch_size

    assert run() == 8
    written = os.stat(path)
    for _ in range(10):
        assert run() == 8
    after = os.stat(path)
    # Each write renames a new file over the old one: a new inode.
    assert (after.st_ino, after.st_mtime_ns) == (written.st_ino, written.st_mtime_ns)


def test_non_string_keys_stay_in_memory(tmp_path: Path) -> None:
    path = tmp_path / "sizes.json"
    cache = koila.DiskCache(path)
    cache[("a", "tuple")] = 4
    assert cache[("a", "tuple")] == 4
    assert not path.exists()


def test_the_user_folder_is_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    cache = koila.DiskCache("~/koila/sizes.json")
    assert cache.path == str(tmp_path / "koila" / "sizes.json")
    cache["key"] = 2
    assert _sizes(tmp_path / "koila" / "sizes.json") == {"key": 2}


def test_a_relative_path_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cache = koila.DiskCache("sizes.json")
    monkeypatch.chdir("/")
    cache["key"] = 2
    assert _sizes(tmp_path / "sizes.json") == {"key": 2}


@pytest.mark.parametrize("path", [123, None, b"sizes.json", ["sizes.json"]], ids=repr)
def test_a_path_of_the_wrong_type_is_refused(path: object) -> None:
    with pytest.raises(TypeError, match=f"path must be a str or os.PathLike, got {type(path).__name__}"):
        koila.DiskCache(path)  # type: ignore[arg-type]


def test_an_empty_path_is_refused() -> None:
    """It named the working folder, which the cache then warned was a folder, and kept sizes in memory."""
    with pytest.raises(ValueError, match="path='' names no file"):
        koila.DiskCache("")


def test_maxsize_bounds_memory_and_file_keeping_the_most_recently_stored(tmp_path: Path) -> None:
    path = tmp_path / "sizes.json"
    cache = koila.DiskCache(path, maxsize=3)
    for number in range(5):
        cache[f"k{number}"] = number + 1
    assert sorted(cache) == ["k2", "k3", "k4"]
    assert list(_sizes(path)) == ["k2", "k3", "k4"]
    cache["k2"] = 30  # stored again: now the most recent
    cache["k5"] = 6
    assert sorted(cache) == ["k2", "k4", "k5"]  # k3 was the least recently stored
    assert _sizes(path) == {"k4": 5, "k2": 30, "k5": 6}
    # A smaller cache on the same file reads the most recently stored.
    assert dict(koila.DiskCache(path, maxsize=2).items()) == {"k2": 30, "k5": 6}


def test_maxsize_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="maxsize must be an int >= 1, got 0"):
        koila.DiskCache(tmp_path / "sizes.json", maxsize=0)


def test_cache_clear_forgets_the_sizes_in_the_file(tmp_path: Path) -> None:
    path = tmp_path / "sizes.json"
    cache = koila.DiskCache(path)
    cache["old"] = 8
    cache.cache_clear()
    cache["new"] = 4
    assert dict(koila.DiskCache(path).items()) == {"new": 4}


def test_a_deleted_key_is_deleted_from_the_file(tmp_path: Path) -> None:
    path = tmp_path / "sizes.json"
    cache = koila.DiskCache(path)
    cache["old"] = 8
    cache["kept"] = 4
    cache["popped"] = 1
    del cache["old"]
    assert cache.pop("popped") == 1
    cache["new"] = 2
    assert dict(koila.DiskCache(path).items()) == {"kept": 4, "new": 2}


def test_a_cache_pickled_or_copied_reads_its_file_again_in_a_cache_of_its_own(tmp_path: Path) -> None:
    # Its lock made it unpicklable (mp.spawn's args, a spawned DataLoader worker), and copy.copy shared its
    # sizes and its lock with the original (probe 73F).
    path = tmp_path / "sizes.json"
    cache = koila.DiskCache(path, 8, key=koila.global_key)
    assert _reducing(cache)() == 16
    for other in (pickle.loads(pickle.dumps(cache)), copy.copy(cache), copy.deepcopy(cache)):
        assert (other.path, other.cache_info().maxsize, other.key_function) == (cache.path, 8, koila.global_key)
        assert dict(other.items()) == dict(cache.items())
        other.cache_clear()
        assert len(cache) == 1
    assert _content(path)["sizes"] == {}  # each cleared the file they share, as a second process would


def test_a_deep_copy_reads_the_file_again_and_holds_nothing_of_the_original(tmp_path: Path) -> None:
    # Copied deep as an in-memory cache, it missed what another process wrote since, and its refine bounds
    # wrote through the original, which it kept alive (probe 76E).
    path = tmp_path / "sizes.json"
    cache = koila.DiskCache(path)
    cache["k"] = 4
    koila.DiskCache(path)["j"] = 8  # another process's
    other = copy.deepcopy(cache)
    assert dict(other.items()) == {"k": 4, "j": 8}
    original = weakref.ref(cache)
    del cache
    gc.collect()
    assert original() is None
    other.bounds.update("k", lambda _: (2, 0))
    assert _content(path)["bounds"] == {"k": 2}


class _ProjectCache(koila.DiskCache):
    """A cache whose __init__ takes other arguments than DiskCache's."""

    def __init__(self, folder: Path, project: str) -> None:
        self.project = project
        super().__init__(folder / f"{project}.json")


class _Guarded(koila.DiskCache):
    """A cache with DiskCache's arguments and a lock of its own, which its state could not pickle."""

    def __init__(self, path: Path, maxsize: int = 256, *, key: Any = None) -> None:
        super().__init__(path, maxsize, key=key)
        self.guard = threading.Lock()


def test_a_subclass_that_takes_disk_caches_arguments_is_pickled_by_them(tmp_path: Path) -> None:
    # Pickled from its state since it has an __init__ of its own, its lock made that a TypeError (probe 76M).
    cache = _Guarded(tmp_path / "sizes.json", 8)
    cache["k"] = 4
    other = pickle.loads(pickle.dumps(cache))
    assert (type(other), other.cache_info().maxsize, dict(other.items())) == (_Guarded, 8, {"k": 4})
    mine = _ProjectCache(tmp_path, "bert")
    mine._pending.append(lambda entries: None)  # a change a held lock kept from the file: this process's own
    assert pickle.loads(pickle.dumps(mine))._pending == []


class _Named(koila.DiskCache):
    """A cache whose __init__ binds DiskCache's call, its first argument a name, not a path."""

    folder = Path()

    def __init__(self, name: str, maxsize: int = 256, *, key: Any = None, tag: str = "default") -> None:
        super().__init__(self.folder / f"{name}.json", maxsize, key=key)
        self.tag = tag


def test_a_subclass_whose_arguments_mean_something_else_is_made_from_its_state(tmp_path: Path) -> None:
    # Made again as _Named(path, maxsize, key=...) because that call binds, it opened "<path>.json.json",
    # and lost its tag (probe 76N).
    _Named.folder = tmp_path
    cache = _Named("bert", 8, tag="run-42")
    cache["k"] = 4
    for other in (pickle.loads(pickle.dumps(cache)), copy.copy(cache)):
        assert (other.path, other.tag, dict(other.items())) == (cache.path, "run-42", {"k": 4})


def test_a_subclass_with_its_own_init_is_copied_and_pickled_with_its_state(tmp_path: Path) -> None:
    # Made again through the class, as DiskCache is, it was called with (path, maxsize, key=...) (probe 76I, 76L).
    cache = _ProjectCache(tmp_path, "bert")
    cache["k"] = 4
    cache.note = "set after"  # type: ignore[attr-defined]
    for other in (copy.copy(cache), copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))):
        assert type(other) is _ProjectCache
        assert (other.project, other.note, dict(other.items())) == ("bert", "set after", {"k": 4})  # type: ignore[attr-defined]
        _ProjectCache(tmp_path, "bert")["j"] = 8  # another process's: each copy reads the file at its making
    assert dict(copy.copy(cache).items()) == {"k": 4, "j": 8}


def test_a_path_of_bytes_is_refused_through_a_path_like_too(tmp_path: Path) -> None:
    # A plain bytes path was refused; one through os.PathLike was taken, and no store could write it.
    class BytesPath:
        def __fspath__(self) -> bytes:
            return bytes(tmp_path / "sizes.json")

    with pytest.raises(TypeError, match=r"^path must name the file as text, got a path of bytes b'"):
        koila.DiskCache(BytesPath())  # type: ignore[arg-type]


class _Prefixed(koila.DiskCache):
    """A cache whose keys say whose they are, in a file shared with others."""

    def key(self, function: Any, caller: Any, device: Any, sample: Any = None) -> Any:
        return f"project A: {super().key(function, caller, device, sample)}"


def test_a_subclass_pickled_or_copied_keeps_its_own_keys(tmp_path: Path) -> None:
    # Made again as a DiskCache, its copy keyed sizes the default way, missing its own (probe 73K).
    cache = _Prefixed(tmp_path / "sizes.json")
    for other in (pickle.loads(pickle.dumps(cache)), copy.copy(cache), copy.deepcopy(cache)):
        assert type(other) is _Prefixed


def test_repr_names_the_path(tmp_path: Path) -> None:
    cache = koila.DiskCache(tmp_path / "sizes.json", maxsize=4)
    cache["key"] = 2
    path = str(tmp_path / "sizes.json")
    assert repr(cache) == f"DiskCache(maxsize=4, currsize=1, hits=0, misses=0, path={path!r})"


# -- links and special files ----------------------------------------------------------------------


def _reducing(cache: koila.SizeCache) -> Callable[[], int]:
    """A function that runs out of memory above 16 rows, from 128."""
    fits = oom_above(16)

    @koila.batch(initial=128, cache=cache)
    def run(batch_size: int) -> int:
        fits(batch_size)
        return batch_size

    return run


def _without_hanging(work: Callable[[], T], fifo: Path) -> T:
    """Return ``work()``, run in a thread; fail if it waits on ``fifo`` for a writer instead."""
    results: list[T] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            results.append(work())
        except BaseException as exc:  # pragma: no cover - only on failure
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(60)  # a guard against hanging for ever, not a measure of speed
    if thread.is_alive():  # pragma: no cover - only on failure
        # Opening a FIFO for reading waits for a writer: be one, so that the thread ends.
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join()
        pytest.fail(f"DiskCache waited for a writer to the FIFO {fifo}")
    if errors:  # pragma: no cover - only on failure
        raise errors[0]
    return results[0]


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="symbolic links")
@pytest.mark.parametrize("existing", [True, False], ids=["target", "dangling"])
def test_a_symlink_is_followed_and_its_target_replaced(tmp_path: Path, existing: bool) -> None:
    shared = tmp_path / "shared"
    target = shared / "sizes.json"
    if existing:
        koila.DiskCache(target)["stored elsewhere"] = 8
        target.chmod(0o644)  # readable by the others who share it
    link = tmp_path / "sizes.json"
    link.symlink_to(target)
    with no_warnings():
        cache = koila.DiskCache(link)
        assert dict(cache.items()) == ({"stored elsewhere": 8} if existing else {})
        assert _reducing(cache)() == 16
    assert link.is_symlink()
    assert os.readlink(link) == str(target)
    assert list(_sizes(target))[-1].startswith("_reducing.<locals>.run (")
    assert list(_sizes(target).values()) == ([8, 16] if existing else [16])
    assert sorted(os.listdir(tmp_path)) == ["shared", "sizes.json"]  # nothing written beside the link
    assert _leftovers(shared, target.name) == []
    if existing:
        assert stat.S_IMODE(target.stat().st_mode) == 0o644


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="POSIX FIFOs")
def test_a_fifo_is_never_opened_nor_replaced(tmp_path: Path) -> None:
    fifo = tmp_path / "sizes.json"
    os.mkfifo(fifo)
    with pytest.warns(koila.CacheFileWarning, match=r"is a FIFO \(named pipe\), not a regular file") as record:
        cache = _without_hanging(lambda: koila.DiskCache(fifo), fifo)
    assert len(record) == 1
    run = _reducing(cache)
    with no_warnings():
        assert run() == 16
        assert run() == 16  # remembered in memory
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert os.listdir(tmp_path) == ["sizes.json"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="POSIX FIFOs")
def test_a_fifo_at_the_lock_path_is_warned_about_not_waited_on(tmp_path: Path) -> None:
    path = tmp_path / "sizes.json"
    lock = tmp_path / "sizes.json.lock"
    os.mkfifo(lock)
    cache = koila.DiskCache(path)
    with pytest.warns(koila.CacheFileWarning, match="cannot write the size cache file") as record:
        assert _without_hanging(_reducing(cache), lock) == 16
    assert "sizes.json.lock" in str(record[0].message)  # no reader: ENXIO; with one, "not a regular file"
    assert not path.exists()


def _holding(lock: str) -> subprocess.Popen[str]:
    """Start a process that takes the lock file ``lock`` and holds it until its input ends."""
    code = (
        "import fcntl, os, sys; descriptor = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT); "
        "fcntl.flock(descriptor, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()"
    )
    pipe = subprocess.PIPE
    child = subprocess.Popen([sys.executable, "-c", code, lock], stdin=pipe, stdout=pipe, text=True)
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "held"
    return child


def _without_waiting_on(work: Callable[[], T], holder: subprocess.Popen[str]) -> T:
    """Return ``work()``, run in a thread; fail if it waits for the lock that ``holder`` holds instead."""
    results: list[T] = []
    thread = threading.Thread(target=lambda: results.append(work()), daemon=True)
    thread.start()
    thread.join(60)  # a guard against waiting for ever, not a measure of speed
    if thread.is_alive():  # pragma: no cover - only on failure
        holder.communicate("")  # lets the lock go, so that the thread ends
        thread.join()
        pytest.fail("DiskCache waited for the lock of a process that held it")
    return results[0]


@pytest.mark.skipif(disk.fcntl is None, reason="no lock file without fcntl")
def test_a_lock_another_process_holds_for_long_is_warned_about_not_waited_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A store waited for the lock with no limit: a job stopped with Ctrl-Z while it wrote held every other
    # job's next size store for good, just after a call that succeeded (probe 73F).
    monkeypatch.setattr(disk, "LOCK_WAIT", 0.2)
    path = tmp_path / "sizes.json"
    child = _holding(f"{path}.lock")
    try:
        cache = koila.DiskCache(path)
        with pytest.warns(koila.CacheFileWarning, match="another process has held its lock for over 0.2 s"):
            result = _without_waiting_on(_reducing(cache), child)
        assert result == 16
        assert not path.exists()
        assert cache.cache_info().currsize == 1  # kept in memory
    finally:
        child.communicate("")
    # The lock is free: written again, where a timeout turned writing off for good (probe 73J), the change the
    # lock kept from the file with it (probe 73K).
    cache["later"] = 8
    assert len(_content(path)["sizes"]) == 2
    assert _content(path)["sizes"]["later"] == 8


@pytest.mark.skipif(disk.fcntl is None, reason="no lock file without fcntl")
def test_a_lock_that_changes_hands_is_waited_for_while_the_file_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The wait was counted from the first try: with many writers in turn, each holding it for milliseconds,
    # the last in line gave up, said that one had held it for long, and wrote no more (probe 73J). Here the
    # file changes at every look, as writers finish, for longer than the wait, and then the lock is let go.
    monkeypatch.setattr(disk, "LOCK_WAIT", 0.05)
    path = tmp_path / "sizes.json"
    child = _holding(f"{path}.lock")
    looks: list[str] = []

    def changing(target: str) -> tuple[int, int]:
        looks.append(target)
        if len(looks) == 40:  # some 1.5 s of waiting: thirty times the wait
            assert child.stdin is not None
            child.stdin.close()
        return (0, len(looks))

    try:
        cache = koila.DiskCache(path)
        monkeypatch.setattr(disk, "_version_of", changing)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cache["step"] = 16
    finally:
        assert child.stdin is not None
        assert child.stdout is not None
        if not child.stdin.closed:
            child.stdin.close()
        child.wait()
        child.stdout.close()
    assert not [warning for warning in caught if issubclass(warning.category, koila.CacheFileWarning)]
    assert len(looks) >= 40
    assert _content(path)["sizes"] == {"step": 16}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX permissions")
def test_a_new_file_is_as_readable_as_the_umask_allows(tmp_path: Path) -> None:
    """Others who share the cache can read it: a new file was the temporary file's 0600."""
    path = tmp_path / "sizes.json"
    old = os.umask(0o022)
    try:
        koila.DiskCache(path)["key"] = 8
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_temporary_files_of_a_writer_killed_before_its_rename_are_swept(tmp_path: Path) -> None:
    path = tmp_path / "sizes.json"
    koila.DiskCache(path)["key"] = 8
    killed = [tmp_path / f"sizes.json.{name}.tmp" for name in ("k0bq9z1a", "x_7rt2mm")]
    for each in killed:
        each.write_text(path.read_text())  # each a whole copy, left by a writer killed before its rename
    # Another cache's, one whose name starts with this one's (it may be writing it now), and a user's own.
    others = ["other.json.k0bq9z1a.tmp", "sizes.json.eval.json.k0bq9z1a.tmp", "sizes.json.backup.tmp"]
    for name in others:
        (tmp_path / name).write_text("{}")
    koila.DiskCache(path)["another key"] = 16
    assert _leftovers(tmp_path, path.name) == sorted(others)  # left alone
    assert _sizes(path) == {"key": 8, "another key": 16}


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="symbolic links")
def test_temporary_files_are_named_and_swept_after_the_target_of_a_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Named after the link, a killed writer's file was never swept: the sweep looks for the target's name.
    target = tmp_path / "shared" / "sizes.json"
    koila.DiskCache(target)["key"] = 8
    link = tmp_path / "link.json"
    link.symlink_to(target)
    renamed: list[str] = []
    replace = os.replace
    monkeypatch.setattr(disk.os, "replace", lambda source, to: (renamed.append(str(source)), replace(source, to)))
    koila.DiskCache(link)["another key"] = 16
    (source,) = renamed
    assert Path(source).parent == target.parent
    assert Path(source).name.startswith("sizes.json.")
    assert _leftovers(target.parent, target.name) == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX permissions")
@pytest.mark.parametrize("lock_mode", [0o444, 0o200])
def test_a_lock_file_of_another_mode_leaves_a_new_file_readable_and_writable_by_its_owner(
    tmp_path: Path, lock_mode: int
) -> None:
    path = tmp_path / "sizes.json"
    lock = tmp_path / "sizes.json.lock"
    lock.touch()
    lock.chmod(lock_mode)
    try:
        with no_warnings():
            koila.DiskCache(path)["key"] = 8
    finally:
        lock.chmod(0o644)
    assert stat.S_IMODE(path.stat().st_mode) & 0o600 == 0o600
    assert _sizes(path) == {"key": 8}


def _device_node(tmp_path: Path) -> Path:
    """Return a character device to give DiskCache, where no mistake of the cache could do harm."""
    null = os.stat("/dev/null") if os.path.exists("/dev/null") else None
    if null is None or not stat.S_ISCHR(null.st_mode):
        pytest.skip("no /dev/null")
    node = tmp_path / "sizes.json"
    with contextlib.suppress(AttributeError, OSError):  # mknod needs root (or CAP_MKNOD)
        os.mknod(node, stat.S_IFCHR | 0o600, null.st_rdev)  # the null device, in a folder of ours
        return node
    if os.geteuid() == 0:
        pytest.skip("no device node can be made here, and /dev/null itself would be at risk as root")
    return Path("/dev/null")  # not root: nothing in /dev can be replaced or made, whatever the cache tried


@pytest.mark.skipif(not hasattr(os, "geteuid"), reason="POSIX devices")
def test_a_device_node_is_never_replaced(tmp_path: Path) -> None:
    node = _device_node(tmp_path)
    device = os.stat(node).st_rdev
    with pytest.warns(koila.CacheFileWarning, match="is a character device, not a regular file"):
        cache = koila.DiskCache(node)
    run = _reducing(cache)
    with no_warnings():
        assert run() == 16
        assert run() == 16  # remembered in memory
    assert stat.S_ISCHR(os.lstat(node).st_mode)
    assert os.stat(node).st_rdev == device
    if node.parent == tmp_path:
        assert os.listdir(tmp_path) == [node.name]  # no lock file, no temporary file


@pytest.mark.parametrize("spoil", ["nested too deeply", "FIFO", "unexpected error"])
def test_a_file_spoilt_after_the_cache_was_made_never_costs_a_call_its_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spoil: str
) -> None:
    path = tmp_path / "sizes.json"
    cache = koila.DiskCache(path)
    cache["first"] = 8
    if spoil == "nested too deeply":
        path.write_bytes(NOT_OURS[spoil][0])
        reason = r"is not valid JSON \(nested deeper than Python.s parser goes\)"
    elif spoil == "FIFO":
        if not hasattr(os, "mkfifo"):
            pytest.skip("POSIX FIFOs")
        path.unlink()
        os.mkfifo(path)
        reason = r"is a FIFO \(named pipe\)"
    else:

        def unexpected(*args: object) -> None:
            raise RuntimeError("an error nobody expected")

        monkeypatch.setattr(disk, "_store", unexpected)
        reason = "cannot write the size cache file .*RuntimeError: an error nobody expected"
    before = os.lstat(path)
    run = _reducing(cache)
    with pytest.warns(koila.CacheFileWarning, match=reason) as record:
        assert _without_hanging(run, path) == 16  # the call that stores its size returns it
    assert len(record) == 1
    with no_warnings():
        assert run() == 16  # remembered in memory, without another warning
    after = os.lstat(path)
    assert (after.st_ino, after.st_mode, after.st_size) == (before.st_ino, before.st_mode, before.st_size)
    assert cache["first"] == 8


# -- the key ------------------------------------------------------------------------------------


def evaluate(batch_size: int) -> int:
    return batch_size


class Model:
    def evaluate(self, batch_size: int) -> int:
        return batch_size


class Encoder(nn.Module):
    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return rows


class Scorer:
    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        return rows


def _where(function: Any) -> tuple[str, int]:
    return function.__code__.co_filename, function.__code__.co_firstlineno


def test_key_names_the_function_its_place_and_the_device(tmp_path: Path) -> None:
    cache = koila.DiskCache(tmp_path / "sizes.json")
    key = cache.key(evaluate, sys._getframe(0), CPU)
    filename, line = _where(evaluate)
    assert isinstance(key, str)
    assert key.startswith(f"evaluate ({filename}:{line})")
    assert describe_device(CPU) in key
    assert "samples" not in key
    # The calling frame plays no part: a key must mean the same in the next run.
    assert cache.key(evaluate, None, CPU) == key


def test_key_holds_the_sample_when_given(tmp_path: Path) -> None:
    cache = koila.DiskCache(tmp_path / "sizes.json")
    narrow = (((8,), "torch.float32"),)
    wide = (((16,), "torch.float32"),)
    key = cache.key(evaluate, None, CPU, narrow)
    assert str(narrow) in key
    assert key.startswith(cache.key(evaluate, None, CPU))
    assert cache.key(evaluate, None, CPU, wide) != key
    assert cache.key(evaluate, None, CPU, (((8,), "torch.float16"),)) != key


def test_chunked_keys_the_sample_shape_and_dtype(tmp_path: Path) -> None:
    cache = koila.DiskCache(tmp_path / "sizes.json")

    fits = oom_above(2)  # every pass reduces from 4 to 2, and stores 2 under its key

    def double(rows: torch.Tensor) -> torch.Tensor:
        fits(len(rows))
        return rows * 2

    koila.chunked(double, torch.ones(10, 3, 2), initial=4, cache=cache)
    koila.chunked(double, torch.ones(20, 3, 2), initial=4, cache=cache)  # other rows, same samples
    koila.chunked(double, torch.ones(10, 5, 2), initial=4, cache=cache)
    koila.chunked(double, torch.ones(10, 3, 2, dtype=torch.float64), initial=4, cache=cache)
    keys = list(cache)
    assert len(keys) == 3
    assert all(key.startswith("test_chunked_keys_the_sample_shape_and_dtype.<locals>.double (") for key in keys)
    # Each length of a sample in its size class, rounded up to a power of two.
    assert "(4, 2)" in keys[0]
    assert "(8, 2)" in keys[1]
    assert "torch.float64" in keys[2]


def test_another_device_description_is_another_key(tmp_path: Path) -> None:
    cache = koila.DiskCache(tmp_path / "sizes.json")
    outside = cache.key(evaluate, None, CPU)
    with simulated_device("1MiB"):
        inside = cache.key(evaluate, None, CPU)
        assert describe_device(CPU) in inside
    assert inside != outside
    assert f"simulated {2**20}" in inside
    assert cache.key(evaluate, None, torch.device("meta")) != outside


def test_sizes_are_kept_per_device_description(tmp_path: Path) -> None:
    tried: list[int] = []
    limit = [64]

    @koila.batch(initial=256, cache=koila.DiskCache(tmp_path / "sizes.json"))
    def run(batch_size: int) -> int:
        tried.append(batch_size)
        oom_above(limit[0])(batch_size)
        return batch_size

    assert run() == 64
    with simulated_device("1GiB"):  # "another device": starts afresh
        limit[0] = 256
        assert run() == 256
    limit[0] = 64
    assert run() == 64
    assert tried == [256, 128, 64, 256, 64]


def test_function_identity_sees_through_bound_methods_and_partials() -> None:
    method = Model().evaluate
    expected = (*_where(Model.evaluate), "Model.evaluate")
    assert function_identity(method) == expected
    assert function_identity(functools.partial(method)) == expected
    assert function_identity(functools.partial(functools.partial(evaluate, 1))) == (*_where(evaluate), "evaluate")


def test_function_identity_sees_through_decorators_that_wrap() -> None:
    # Every @torch.no_grad() function runs one wrapper: named by it, unrelated functions
    # would share one size in a GlobalCache, and one entry in a DiskCache.
    @torch.no_grad()
    def first(rows: torch.Tensor) -> torch.Tensor:
        return rows

    @torch.no_grad()
    def second(rows: torch.Tensor) -> torch.Tensor:
        return rows

    assert function_identity(first) == (*_where(first.__wrapped__), first.__wrapped__.__qualname__)
    assert function_identity(first) != function_identity(second)
    assert function_identity(functools.partial(first)) == function_identity(first)


def test_function_identity_of_modules_lambdas_and_callable_objects() -> None:
    assert function_identity(Encoder()) == (*_where(Encoder.forward), "Encoder.forward")
    assert function_identity(Scorer()) == (*_where(Scorer.__call__), "Scorer.__call__")
    square = lambda rows: rows**2  # noqa: E731
    assert function_identity(square) == (
        __file__,
        square.__code__.co_firstlineno,
        "test_function_identity_of_modules_lambdas_and_callable_objects.<locals>.<lambda>",
    )
    assert function_identity(("file.py", 3, "block")) == ("file.py", 3, "block")  # a description already


def test_class_identity_names_a_scripts_class_by_the_scripts_file() -> None:
    # Every script's classes are __main__'s: two scripts' LitModel shared their sizes in one file (probe 73H).
    script = type("LitModel", (), {"__module__": "__main__"})
    where = getattr(sys.modules["__main__"], "__file__", None)
    expected = os.path.realpath(where) if isinstance(where, str) else "__main__"
    assert class_identity(script, "LitModel.training_step") == (expected, 0, "LitModel.training_step")
    # Run again as __mp_main__ in a process that multiprocessing's spawn started (probe 73I).
    spawned = type("LitModel", (), {"__module__": "__mp_main__"})
    module = types.ModuleType("__mp_main__")
    module.__file__ = str(Path("train.py").resolve())
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "__mp_main__", module)
        assert class_identity(spawned, "LitModel.training_step")[0] == module.__file__
    assert class_identity(nn.Linear, "Linear.forward") == ("torch.nn.modules.linear", 0, "Linear.forward")


def test_function_identity_tells_builtins_apart() -> None:
    assert function_identity(torch.sin) != function_identity(torch.cos)


def test_two_attempts_blocks_in_one_function_have_their_own_sizes(tmp_path: Path) -> None:
    cache = koila.DiskCache(tmp_path / "sizes.json")
    fits = oom_above(4)
    for attempt in koila.attempts(initial=64, cache=cache):
        with attempt:
            fits(attempt.batch_size)
    for other in koila.attempts(initial=64, cache=cache):
        with other:
            pass
    assert (attempt.batch_size, other.batch_size) == (4, 64)


def _lambda_holding_a_tensor() -> tuple[Any, weakref.ref[torch.Tensor]]:
    big = torch.zeros(2**16)
    fits = oom_above(2)  # so that chunked reduces, and stores a size under the lambda's key
    return (lambda rows: fits(len(rows)) or rows + big.sum()), weakref.ref(big)


def test_a_key_holds_no_reference_to_the_callable(tmp_path: Path) -> None:
    cache = koila.DiskCache(tmp_path / "sizes.json")
    shift, tensor_ref = _lambda_holding_a_tensor()
    function_ref = weakref.ref(shift)
    key = cache.key(shift, None, CPU)
    identity = function_identity(shift)
    out = koila.chunked(shift, torch.ones(8, 2), initial=4, cache=cache)
    assert torch.equal(out, torch.ones(8, 2))
    assert tensor_ref() is not None  # the lambda holds it ...
    del shift  # no collection needed: nothing, not even a reference cycle, holds it
    assert function_ref() is None  # ... and nothing holds the lambda
    assert tensor_ref() is None
    assert "<lambda>" in key
    assert identity[2].endswith("<lambda>")
    assert len(cache) == 1


# -- refine's bounds outlive the process (issue 39, finding 10) --------------------------------


def _refined(path: Path, tried: list[int]) -> Callable[[], int]:
    """A step where 100 rows fit, refining, with a DiskCache on ``path`` (one process's view)."""
    fits = oom_above(100)

    def step(batch_size: int) -> int:
        tried.append(batch_size)
        fits(batch_size)
        return batch_size

    return koila.batch(initial=128, refine=True, cache=koila.DiskCache(path))(step)


def test_the_smallest_size_that_failed_is_kept_in_the_file(tmp_path: Path) -> None:
    path = tmp_path / "sizes.json"
    tried: list[int] = []
    with no_warnings():
        assert _refined(path, tried)() == 64  # this process stops after its first reduction
    assert tried == [128, 64]
    content = _content(path)
    assert list(content["sizes"].values()) == [64]
    assert list(content["bounds"].values()) == [128]
    assert list(content["bounds"]) == list(content["sizes"])  # under the same key
    assert "bound_samples" not in content  # batch sees no samples

    # The next process reads the bound, and searches above 64 from its first call.
    tried.clear()
    with no_warnings():
        later = _refined(path, tried)
        assert [later() for _ in range(5)] == [96] * 5
    assert tried == [96, 112, 96, 104, 96, 96, 96]
    assert list(_content(path)["bounds"].values()) == [104]
    # And the one after starts at 96, with nothing left to try.
    tried.clear()
    with no_warnings():
        last = _refined(path, tried)
        assert [last() for _ in range(2)] == [96, 96]
    assert tried == [96, 96]


def test_a_bound_keeps_the_bytes_of_the_samples_it_failed_on(tmp_path: Path) -> None:
    path = tmp_path / "sizes.json"
    fits = oom_above(100)

    def double(chunk: torch.Tensor) -> torch.Tensor:
        fits(len(chunk))
        return chunk * 2

    x = torch.ones(150, 40)
    with no_warnings():
        koila.chunked(double, x, initial=128, refine=True, cache=koila.DiskCache(path))
    content = _content(path)
    (key,) = content["bounds"]
    assert content["bounds"][key] == 128
    assert content["bound_samples"][key] == 40 * 4
    cache = koila.DiskCache(path)
    assert cache.bounds.get(key) == (128, 160)
    assert cache.sample_bytes(key) == 160


def test_bounds_are_merged_with_what_other_processes_wrote(tmp_path: Path) -> None:
    path = tmp_path / "sizes.json"
    first, second = koila.DiskCache(path), koila.DiskCache(path)  # made at once, as two processes
    first.bounds.update("key", lambda bound: decision.failed_at(bound, 112))
    second.bounds.update("key", lambda bound: decision.failed_at(bound, 120))  # 112 failed, for the file
    assert second.bounds.get("key") == (120, 0)
    assert _content(path)["bounds"] == {"key": 112}
    assert koila.DiskCache(path).bounds.get("key") == (112, 0)
    second.bounds.update("key", lambda bound: decision.still_failed(bound, 120))  # memory came back
    assert "bounds" not in _content(path)
    assert koila.DiskCache(path).bounds.get("key") is None


def test_bounds_that_are_not_sizes_are_ignored_and_cleared_with_the_cache(tmp_path: Path) -> None:
    path = tmp_path / "sizes.json"
    content = {
        "format": FORMAT,
        "version": 1,
        "sizes": {"a": 64, "b": 64},
        "bounds": {"a": 128, "b": "128", "c": 0, "d": True, "e": 96},
        "bound_samples": {"a": 16, "e": -1},
    }
    path.write_text(json.dumps(content), encoding="utf-8")
    with no_warnings():
        cache = koila.DiskCache(path)
    assert cache.bounds.get("a") == (128, 16)
    assert cache.bounds.get("e") == (96, 0)
    assert [cache.bounds.get(key) for key in "bcd"] == [None, None, None]
    cache.cache_clear()
    assert cache.bounds.get("a") is None
    assert _content(path) == {"format": FORMAT, "version": 1, "sizes": {}}


BOUND_SCRIPT = textwrap.dedent(
    """
    import json, sys, warnings
    import koila_retry as koila
    from koila_retry.testing import oom_above

    warnings.simplefilter("error", koila.CacheFileWarning)
    fits, tried = oom_above(100), []

    @koila.batch(initial=128, refine=True, cache=koila.DiskCache(sys.argv[1]))
    def evaluate(batch_size):
        tried.append(batch_size)
        fits(batch_size)
        return batch_size

    results = [evaluate() for _ in range(int(sys.argv[2]))]
    print(json.dumps({"results": results, "tried": tried}))
    """
)


@pytest.mark.slow
def test_a_later_process_refines_above_the_size_an_earlier_one_stopped_at(tmp_path: Path) -> None:
    script = tmp_path / "evaluate.py"
    script.write_text(BOUND_SCRIPT, encoding="utf-8")
    path = tmp_path / "sizes.json"
    (first,) = _run_scripts(script, (path, 1))
    assert first == {"results": [64], "tried": [128, 64]}
    (second,) = _run_scripts(script, (path, 4))
    assert second == {"results": [96] * 4, "tried": [96, 112, 96, 104, 96, 96]}


# --- where warnings are errors (pytest -W error, PYTHONWARNINGS=error) (issue 39)


@pytest.mark.parametrize("refine", [False, True], ids=["stored-after-the-call", "bound-written-at-the-oom"])
def test_a_file_that_cannot_be_written_under_warnings_as_errors_costs_no_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, refine: bool
) -> None:
    # The file is written after a call succeeded (its size), or, with refine=True, while its
    # out-of-memory error is handled (the bound): the warning raised there by an "error"
    # filter cost the call its result, or its recovery.
    cache = koila.DiskCache(tmp_path / "sizes.json")
    fits = oom_above(4)

    @koila.batch(initial=16, refine=refine, cache=cache)
    def run(batch_size: int) -> int:
        fits(batch_size)
        return batch_size

    def full_disk(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk.os, "fsync", full_disk)
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, "koila_retry"):
        warnings.simplefilter("error")
        assert run() == 4
    monkeypatch.undo()
    (record,) = [r for r in caplog.records if r.name == "koila_retry" and "No space left" in r.getMessage()]
    assert "cannot write the size cache file" in record.getMessage()
    assert "a warnings filter made this warning an error" in record.getMessage()
    assert list(cache.values()) == [4]  # kept in memory
