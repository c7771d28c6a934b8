"""The real CPU allocator under RLIMIT_AS: recovery from the genuine RuntimeError."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

resource = pytest.importorskip("resource")

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import json, resource, weakref
    import psutil, torch
    import koila_retry as koila

    torch.set_num_threads(1)  # no new threads (and their stacks) under the limit
    limit = psutil.Process().memory_info().vms + 384 * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))

    # The genuine error, checked directly first.
    try:
        torch.ones(2**18, 1024)  # 1 GiB
        direct = None
    except RuntimeError as exc:
        direct = {"type": type(exc).__name__, "message": str(exc)[:300], "is_oom": koila.is_oom(exc)}

    tried, refs, alive = [], [], []

    @koila.batch(initial=2**18)  # 1 GiB of float32 rows of 1024
    def run(batch_size):
        alive.append(sum(ref() is not None for ref in refs))
        tried.append(batch_size)
        first = torch.ones(batch_size // 4, 1024)  # fits for longer than the second
        refs.append(weakref.ref(first))
        second = torch.ones(batch_size, 1024)  # fails in the CPU allocator when too big
        return float(first.sum() + second.sum())

    total = run()
    print(json.dumps({
        "direct": direct, "tried": tried, "alive": alive, "total": total,
        "ooms": run.stats.ooms, "free": koila.free_memory("cpu"),
    }))
    """
)


def run_limited(script: str) -> dict[str, Any]:
    """Run a script that limits its own address space; return the JSON of its last line."""
    completed = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=240,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert completed.returncode == 0, completed.stderr
    result: dict[str, Any] = json.loads(completed.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.slow
def test_batch_recovers_from_the_real_cpu_allocator() -> None:
    result = run_limited(SCRIPT)

    direct = result["direct"]
    assert direct is not None, "a 1 GiB tensor should not fit in a 384 MiB address-space budget"
    assert direct["type"] == "RuntimeError"  # the CPU allocator raises a plain RuntimeError
    assert "DefaultCPUAllocator: can't allocate memory" in direct["message"]
    assert direct["is_oom"] is True

    tried = result["tried"]
    assert tried[0] == 2**18
    assert len(tried) >= 2
    assert all(later * 2 == earlier for earlier, later in itertools.pairwise(tried))
    assert result["ooms"] == len(tried) - 1
    settled = tried[-1]
    assert result["total"] == settled // 4 * 1024 + settled * 1024
    # Each retry started with the failed attempt's tensors freed.
    assert result["alive"] == [0] * len(tried)
    assert len(tried) > 2  # some attempt failed after allocating `first`: its freeing is tested
    assert 0 < result["free"] <= 384 * 2**20


ACCUMULATE_SCRIPT = textwrap.dedent(
    """
    import json, resource
    import psutil, torch
    import koila_retry as koila

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 8192), torch.nn.ReLU(), torch.nn.Linear(8192, 1))
    x, y = torch.randn(3000, 64), torch.randn(3000, 1)

    torch.nn.functional.mse_loss(model(x), y).backward()  # the full batch, without a limit
    expected = [p.grad.clone() + 1 for p in model.parameters()]
    before = [torch.ones_like(p) for p in model.parameters()]  # gradients already there
    for p, grad in zip(model.parameters(), before):
        p.grad = grad

    # The whole batch's activations (about 3 x 94 MiB) do not fit in 160 MiB more.
    limit = psutil.Process().memory_info().vms + 160 * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))

    @koila.accumulate
    def step(x, y):
        return torch.nn.functional.mse_loss(model(x), y)

    loss = step(x, y)
    errors = [float(((p.grad - e).abs().max() / e.abs().max())) for p, e in zip(model.parameters(), expected)]
    print(json.dumps({
        "size": step.stats.batch_size, "ooms": step.stats.ooms, "error": max(errors),
        "same_tensors": all(p.grad is g for p, g in zip(model.parameters(), before)),
    }))
    """
)


@pytest.mark.slow
def test_accumulate_splits_after_the_real_cpu_allocator_fails() -> None:
    result = run_limited(ACCUMULATE_SCRIPT)
    assert result["ooms"] >= 1
    assert result["size"] < 3000
    # The split step's gradient, added to the gradients that were there, is the full batch's.
    assert result["error"] < 1e-4
    assert result["same_tensors"] is True
