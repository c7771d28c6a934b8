"""``refine=True`` against a real CUDA device's out-of-memory errors (issue 31).

Each case runs in a process of its own: a call that needs a fixed number of bytes per row, called
again and again from one line, as a training loop calls its step. The search must end on a size that
fits, within 8 rows of the smallest size that failed, never try a failed size again, and raise
nothing. Two ways a card runs out: the whole card (no share set, a gibibyte a row), and a 2 GiB
share of it (``set_per_process_memory_fraction``, 16 MiB a row), where the caching allocator's
reserved blocks count against the share and the free-memory reading moves as they are cached.
"""

from __future__ import annotations

import textwrap
from typing import Any

import pytest
from _devices import needs_cuda, run_json

SCRIPT = """
import json, sys
import torch
import koila_retry as koila

MiB = 2**20
row = int(sys.argv[1]) * MiB
torch.cuda.init()
if sys.argv[2] != "whole":
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(int(sys.argv[2]) * 2**30 / total)
tried, fitted = [], []

@koila.batch(initial=int(sys.argv[3]), refine=True, device="cuda")
def run(batch_size):
    tried.append(batch_size)
    block = torch.empty(batch_size * row, dtype=torch.uint8, device="cuda")
    block[-1] = 1  # touched: the memory is the kernel's, not only reserved
    torch.cuda.synchronize()
    fitted.append(batch_size)
    return batch_size

results = [run() for _ in range(12)]
print(json.dumps({"results": results, "tried": tried, "fitted": fitted,
                  "total": torch.cuda.get_device_properties(0).total_memory}))
"""


def _run(row_mib: int, share: str, initial: int) -> dict[str, Any]:
    return run_json(textwrap.dedent(SCRIPT), str(row_mib), share, str(initial))


@needs_cuda
@pytest.mark.parametrize(("row_mib", "share", "initial"), [(1024, "whole", 256), (16, "2", 256)])
def test_refine_settles_within_8_rows_of_what_fails_on_a_real_card(row_mib: int, share: str, initial: int) -> None:
    found = _run(row_mib, share, initial)
    print(found)  # the run's record, for docs/gpu.rst
    results, tried, fitted = found["results"], found["tried"], found["fitted"]
    failed = sorted({size for size in tried if size not in fitted})
    final = results[-1]
    assert failed, found  # it ran out of memory at least once: the case tests something
    assert final in fitted
    assert results[-3:] == [final] * 3, found  # settled
    assert all(size > final for size in failed), found
    assert min(failed) - final <= 8, found
    # No size failed twice: every probe that failed was remembered.
    assert len([size for size in tried if size in failed]) == len(failed), found
    limit = found["total"] if share == "whole" else int(share) * 2**30
    assert final * row_mib * 2**20 <= limit
