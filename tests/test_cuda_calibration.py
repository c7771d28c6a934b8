"""Calibration on a real CUDA device: ``initial="auto"`` measures what cuDNN's kernels really allocate.

``tests/test_calibration.py`` checks the same targets on the CPU stand-in, with a layer whose
real run holds a workspace that its meta run does not. Here the workspaces are cuDNN's own
(a recurrent layer's, a convolution's backward), and the limit is a fraction of the card
(``tests/_devices.py``). Marked ``cuda``; skipped without a CUDA device.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _devices import CUDA, CudaDevice
from torch import nn
from torch.nn import functional

import koila_retry as koila
from koila_retry._core import memory

pytestmark = CUDA

MiB = 2**20
ROWS = 4096


class Recurrent(nn.Module):
    """A two-layer GRU over 64 steps, whose last state classifies the sequence: cuDNN's workspace dominates."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(32, 128, num_layers=2, batch_first=True)
        self.head = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, hidden = self.gru(x)
        out: torch.Tensor = self.head(hidden[-1])
        return out


class Convolutional(nn.Module):
    """Two convolutions and a head: cuDNN's backward-weight workspace comes on top of the activations."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU())
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.body(x).mean((2, 3)))
        return out


def rise(device: CudaDevice, run: Any) -> int:
    run()  # a warm-up: cuDNN's and cuBLAS's handles and workspaces, kept for the process
    with device.measuring() as meter:
        before = meter.allocated()
        run()
        return meter.peak() - before


def test_the_meter_reads_the_allocators_peak() -> None:
    device = CudaDevice()
    meter = memory.peak_meter(device.torch_device)
    assert meter is not None
    with meter:
        block = torch.empty(64 * MiB, dtype=torch.uint8, device=device.torch_device)
        del block
    assert 64 * MiB <= meter.rise <= 66 * MiB


def test_chunked_auto_calibrates_on_cudnns_recurrent_workspace() -> None:
    device = CudaDevice()
    where = device.torch_device
    torch.manual_seed(0)
    model = Recurrent().to(where).eval()
    x = torch.randn(ROWS, 64, 32, device=where)

    def infer(rows: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out: torch.Tensor = model(rows)
            return out

    fits = 256  # the limit lies halfway between what 256 and 512 rows take
    limit = (rise(device, lambda: infer(x[:fits])) + rise(device, lambda: infer(x[: 2 * fits]))) // 2
    seen: list[int] = []

    @koila.chunked(initial="auto")
    def encode(rows: torch.Tensor) -> torch.Tensor:
        if not rows.is_meta:
            seen.append(len(rows))
        return infer(rows)

    calls = []
    with device.limited(limit):
        for _ in range(3):
            seen.clear()
            out = encode(x)
            calls.append(list(seen))
    print(f"\nchunks per call: {calls}; out-of-memory errors: {encode.stats.ooms}")
    assert encode.stats.ooms <= 1
    for later in calls[1:]:
        assert min(later[:-1] or later) >= fits // 2
    expected = torch.cat([infer(rows) for rows in x.split(fits)])
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)  # cuDNN's sums differ by batch size


@pytest.mark.parametrize("model_of", [Recurrent, Convolutional], ids=["gru", "conv"])
def test_accumulate_auto_calibrates_a_training_step(model_of: type[nn.Module]) -> None:
    device = CudaDevice()
    where = device.torch_device
    torch.manual_seed(0)
    model = model_of().to(where)
    shape = (64, 32) if model_of is Recurrent else (3, 32, 32)
    x = torch.randn(ROWS // 4, *shape, device=where)
    y = torch.randint(0, 10, (ROWS // 4,), device=where)

    def by_hand(size: int) -> None:
        model.zero_grad(set_to_none=True)
        for xb, yb in zip(x.split(size), y.split(size)):
            (functional.cross_entropy(model(xb), yb) * len(xb) / len(x)).backward()
        model.zero_grad(set_to_none=True)

    fits = 64
    limit = (rise(device, lambda: by_hand(fits)) + rise(device, lambda: by_hand(2 * fits))) // 2

    @koila.accumulate(initial="auto")
    def step(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return functional.cross_entropy(model(xb), yb)

    sizes = []
    with device.limited(limit):
        for _ in range(3):
            step(x, y)
            model.zero_grad(set_to_none=True)
            sizes.append(step.stats.batch_size)
    print(f"\nsize after each call: {sizes}; out-of-memory errors: {step.stats.ooms}")
    assert step.stats.ooms <= 1
    assert min(sizes) >= fits // 2
