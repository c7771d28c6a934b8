"""The diagnosis and the snapshot on a real CUDA device (issue 31): capacity, fragmentation, PyTorch's snapshot.

Each state is made in a process of its own, under a 2 GiB memory fraction, as the H100 states of
``tests/data/oom_states.json`` were: a call that asks for more than the share has left, and a call that
asks for 400 MiB where a 1800 MiB segment of the cache is cut into 40 MiB pieces, every other one free.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from _devices import needs_cuda, run_json

PRELUDE = """
import json, pickle, sys
import torch
import koila_retry as koila

MiB = 2**20
torch.cuda.init()
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction(2 * 2**30 / total)
keep = []
"""

CAPACITY = """
keep.append(torch.empty(1536 * MiB, dtype=torch.uint8, device="cuda"))

@koila.batch(initial=4, minimum=4, device="cuda")
def run(batch_size):
    return torch.empty(batch_size * 256 * MiB, dtype=torch.uint8, device="cuda")  # 1 GiB
"""

FRAGMENTATION = """
big = torch.empty(1800 * MiB, dtype=torch.uint8, device="cuda")
del big  # one cached segment, cut by the pieces below
blocks = [torch.empty(40 * MiB, dtype=torch.uint8, device="cuda") for _ in range(45)]
keep.extend(blocks[1::2])
del blocks

@koila.batch(initial=1, minimum=1, device="cuda", snapshot=sys.argv[1])
def run(batch_size):
    return torch.empty(400 * MiB, dtype=torch.uint8, device="cuda")
"""

REPORT = """
try:
    run()
    found = {"raised": False}
except koila.BatchSizeExhausted as exc:
    d = exc.diagnosis
    found = {"raised": True, "kind": d.kind, "requested": d.requested, "free": d.free,
             "unused": d.reserved_unused, "largest": d.largest_free_block, "message": str(exc)}
print(json.dumps(found))
"""


def _run(body: str, *args: str) -> dict[str, Any]:
    return run_json(textwrap.dedent(PRELUDE) + textwrap.dedent(body) + textwrap.dedent(REPORT), *args)


@needs_cuda
def test_a_real_capacity_oom_is_diagnosed_capacity() -> None:
    found = _run(CAPACITY)
    assert found["raised"]
    assert found["kind"] == "capacity", found
    assert found["requested"] == 2**30
    assert "Diagnosis: capacity" in found["message"]


@needs_cuda
def test_a_real_fragmented_cache_is_diagnosed_fragmentation_and_snapshotted(tmp_path: Path) -> None:
    path = tmp_path / "oom-{rank}.pickle"
    found = _run(FRAGMENTATION, str(path))
    assert found["raised"]
    assert found["kind"] == "fragmentation", found
    assert found["requested"] == 400 * 2**20
    assert found["largest"] == 40 * 2**20
    assert found["unused"] >= 800 * 2**20
    snapshot = run_json(
        "import pickle, json, sys; s = pickle.load(open(sys.argv[1], 'rb')); "
        "print(json.dumps({'segments': len(s['segments']), 'keys': sorted(s)}))",
        str(tmp_path / "oom-0.pickle"),
    )
    # PyTorch's own format, as its memory visualizer reads it.
    assert snapshot["segments"] >= 1
    assert "device_traces" in snapshot["keys"]
