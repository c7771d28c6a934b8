"""``torch.compile`` with inductor on CUDA: a real out-of-memory error inside compiled code, and no recompile storm.

``tests/test_compile.py`` checks the same on the CPU, with ``aot_eager`` under a simulated
device and with inductor under ``RLIMIT_AS``. Here the kernels are inductor's own CUDA
kernels, whose buffers come from the caching allocator, limited with
``torch.cuda.set_per_process_memory_fraction`` (see ``tests/_devices.py``). Compilations
are counted with Dynamo's counters, as there.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from _devices import CUDA, CudaDevice
from torch import nn
from torch._dynamo.utils import counters

import koila_retry as koila

pytestmark = [*CUDA, pytest.mark.usefixtures("fresh_dynamo")]

SIZE = 512  # the size that fits: its hidden activations take 16 MiB, 2 * SIZE's twice that
WIDTH = 8192


def compiles() -> int:
    """Return how many graphs Dynamo has compiled since the counters were cleared."""
    return int(counters["stats"]["unique_graphs"])


def test_batch_retries_a_real_cuda_oom_in_inductor_code_without_a_recompile_storm() -> None:
    device = CudaDevice()
    where = device.torch_device
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 4))
    model.to(where).eval()
    data = torch.randn(8 * SIZE, 16, device=where)

    # The limit comes from the compiled code's own peak: inductor fuses and reuses
    # buffers, so eager's would be another. A graph with a dynamic batch dimension
    # plans the same buffers at every size.
    sizing = torch.compile(model, backend="inductor", dynamic=True)

    def rise(rows: int) -> int:
        with torch.no_grad():
            sizing(data[:rows])  # compiles, and warms the kernels
            with device.measuring() as meter:
                before = meter.allocated()
                sizing(data[:rows])
                return meter.peak() - before

    fits, too_big = rise(SIZE), rise(2 * SIZE)
    assert too_big > fits * 1.5
    torch._dynamo.reset()
    counters.clear()

    compiled = torch.compile(model, backend="inductor")
    tried: list[tuple[int, int]] = []  # (batch size, graphs compiled before the attempt)

    @koila.batch(initial=8 * SIZE)
    def predict(batch_size: int) -> torch.Tensor:
        tried.append((batch_size, compiles()))
        with torch.no_grad():
            return compiled(data[:batch_size])

    with device.limited((fits + too_big) // 2):
        # Both calls from one line: the default cache keys a size by the line that called,
        # so the second starts at the size the first settled on.
        first, second = [predict() for _ in range(2)]
    # 4096 compiled with static shapes and failed inside the graph; 2048 recompiled with
    # a dynamic batch dimension and failed; 1024 and 512 ran that graph as it was.
    assert tried == [(8 * SIZE, 0), (4 * SIZE, 1), (2 * SIZE, 2), (SIZE, 2), (SIZE, 2)]
    assert predict.stats.ooms == 3
    assert compiles() == 2
    with torch.no_grad():
        expected = model(data[:SIZE])
    torch.testing.assert_close(first, expected)
    torch.testing.assert_close(second, expected)
