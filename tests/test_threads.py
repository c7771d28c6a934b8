"""Many threads at once: one decorated function with OOMs injected, and the caches it uses."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

import koila_retry as koila
from koila_retry.testing import oom_above

THREADS, CALLS = 8, 40
CPU = torch.device("cpu")


def test_concurrent_calls_with_injected_ooms() -> None:
    fits = oom_above(64)
    results: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    @koila.batch(initial=512)
    def run(batch_size: int) -> int:
        fits(batch_size)
        return batch_size

    barrier = threading.Barrier(THREADS)

    def worker() -> None:
        barrier.wait()
        try:
            for _ in range(CALLS):
                size = run()
                with lock:
                    results.append(size)
        except BaseException as exc:  # pragma: no cover - only on failure
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert errors == []
    assert results == [64] * (THREADS * CALLS)
    stats = run.stats.as_dict()
    assert stats["calls"] == THREADS * CALLS
    assert stats["ooms"] == fits.raised  # every injected OOM counted once
    assert fits.calls == THREADS * CALLS + fits.raised
    assert stats["exhausted"] == 0
    assert stats["batch_size"] == 64
    info = run.cache_info()
    assert info.hits + info.misses == THREADS * CALLS


# -- the caches under threads that evict ---------------------------------------------------------


def _in_threads(work: Callable[[int], None], threads: int = THREADS) -> list[str]:
    """Run ``work(number)`` in ``threads`` threads started together; return what they raised."""
    errors: list[str] = []
    barrier = threading.Barrier(threads)

    def worker(number: int) -> None:
        barrier.wait()
        try:
            work(number)
        except BaseException as exc:  # pragma: no cover - only on failure
            errors.append(f"{type(exc).__name__}: {exc}")

    started = [threading.Thread(target=worker, args=(number,)) for number in range(threads)]
    for thread in started:
        thread.start()
    for thread in started:
        thread.join()
    return errors


@pytest.mark.parametrize("kind", [koila.StackMemoryCache, koila.GlobalCache])
def test_the_mapping_api_never_raises_while_other_threads_evict(
    frequent_switches: None, kind: Callable[..., koila.SizeCache]
) -> None:
    # Twelve keys in a cache of four: nearly every store evicts one that another thread reads.
    cache = kind(maxsize=4)

    def hammer(number: int) -> None:
        for step in range(1500):
            key = ("key", (number * 7 + step) % 12)
            other = ("key", (number + step + 5) % 12)
            cache[key] = step + 1
            popped = cache.pop(other, None)
            assert popped is None or 1 <= popped <= 1500
            cache.get(key)
            assert (other in cache) in (True, False)
            assert 0 <= len(cache) <= 4
            assert all(isinstance(size, int) for size in cache.values())
            assert len(list(cache)) <= 4
            assert len(dict(cache.items())) <= 4
            cache.lookup(other)
            cache.setdefault(other, 3)

    assert _in_threads(hammer) == []
    assert len(cache) <= 4
    assert sorted(cache.keys()) == sorted(dict(cache.items()))


def test_a_growing_function_never_raises_from_the_cache_in_many_threads(frequent_switches: None) -> None:
    """Reaching ``initial`` again pops the stored size: threads that pop one key at once must not raise."""
    cache = koila.GlobalCache()

    @koila.batch(initial=2, grow=True, grow_after=1, cache=cache)
    def run(batch_size: int) -> int:
        return batch_size

    key = cache.key(run.__wrapped__, None, CPU)  # type: ignore[attr-defined]
    stop = threading.Event()

    def store_a_smaller_size() -> None:
        # Every call then starts at 1, grows back to 2 at its next call, and pops the 1.
        while not stop.is_set():
            cache[key] = 1

    writer = threading.Thread(target=store_a_smaller_size)
    writer.start()
    try:
        sizes: list[int] = []
        errors = _in_threads(lambda number: sizes.extend(run() for _ in range(1000)))
    finally:
        stop.set()
        writer.join()
    assert errors == []
    assert set(sizes) <= {1, 2}
    assert len(sizes) == THREADS * 1000


def test_a_size_removed_while_a_lookup_reads_it_is_not_remembered_by_that_lookup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lookup that read a size just before another thread removed it must not keep answering it."""
    cache = koila.GlobalCache()
    cache["key"] = 4
    cache.lookup("another key")  # the lookup below is not answered from its memo

    class PopOnHit:
        """Counting the hit is where a lookup is between its read and its memo: another thread pops there."""

        def increment(self) -> None:
            cache.pop("key", None)

    monkeypatch.setattr(cache, "_hits", PopOnHit())
    assert cache.lookup("key") == 4  # read before the pop: a valid answer then
    monkeypatch.undo()
    assert "key" not in cache
    assert cache.lookup("key") is None  # not the popped 4, remembered as the latest answer
