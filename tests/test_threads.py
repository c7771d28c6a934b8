"""One decorated function called from many threads at once, with OOMs injected."""

from __future__ import annotations

import threading

import koila_retry as koila
from koila_retry.testing import oom_above

THREADS, CALLS = 8, 40


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
