"""Shared fixtures: every test starts from clean global state."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from koila_retry import _chunked, _estimate, _frontends, _memory, _tracking


@pytest.fixture(autouse=True)
def _reset_global_state() -> Iterator[None]:
    """Clear the caches and readings that outlive a call, before and after each test."""
    _frontends._attempts_cache.cache_clear()
    _chunked._calls_cache.cache_clear()
    _memory.forget_free_memory()
    _estimate._suggestions.clear()
    yield
    _frontends._attempts_cache.cache_clear()
    _chunked._calls_cache.cache_clear()
    _memory.forget_free_memory()
    _estimate._suggestions.clear()
    leaked = list(_tracking.simulated.active)
    _tracking.simulated.active.clear()
    assert not leaked, "a test left a simulated device active"
