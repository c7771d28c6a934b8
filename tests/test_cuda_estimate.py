"""The estimate against the peak a device really reaches, over the zoo of ``benchmarks/gpu.py``.

On CUDA (marked ``cuda``), the truth is ``torch.cuda.max_memory_allocated`` during the
step, in float32 and under bfloat16 autocast, with flash and memory-efficient attention.
On the CPU stand-in, it is the peak of the storages that ``simulated_device`` counts,
with the settings under which that count is the whole truth: oneDNN off (its
convolutions' buffers are invisible to it), the math attention kernel and no fused
``nn.TransformerEncoderLayer`` fast path (fused kernels allocate inside themselves). The
targets: a median absolute error of at most 3% and a worst of at most 8%. The reserved
peak and the fragmentation are printed beside them (``pytest -s``), not checked.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch
from _benchmarks import imported
from _devices import Device, device_fixture

device = device_fixture()


@pytest.fixture(scope="module")
def gpu() -> Iterator[ModuleType]:
    with imported("gpu") as module:
        yield module


@contextlib.contextmanager
def stand_in_settings() -> Iterator[None]:
    """Run on the CPU only what the stand-in's count sees whole (see the module's docstring)."""
    fast_path, onednn = torch.backends.mha.get_fastpath_enabled(), torch.backends.mkldnn.enabled
    torch.backends.mha.set_fastpath_enabled(False)
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(fast_path)
        torch.backends.mkldnn.enabled = onednn


# Until a GPU has run them, the rules derived from the H100 run of 2026-11-25 are unchecked,
# and one kernel's memory is not modelled at all: the CUDA variants may fail for it.
UNVERIFIED = (
    "unverified on a GPU: the CUDA rules derived from the H100 run of 2026-11-25 (cuDNN's recurrent layers, "
    "CUDA's fused dropout, attention inside nn.MultiheadAttention, the reduction buffer of a sum) have not "
    "run on a GPU since, and cuDNN's convolution workspace is not modelled (ResNet training was 39% under "
    "there; calibration measures it): docs/gpu.rst"
)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_estimate_is_within_target_of_the_peak_the_device_reaches(
    device: Device, precision: str, gpu: ModuleType, request: pytest.FixtureRequest
) -> None:
    kind = "cuda" if device.name == "cuda" else "cpu"
    if kind == "cuda":
        request.applymarker(pytest.mark.xfail(reason=UNVERIFIED, strict=False))
    chosen = gpu.variants(kind, precision)
    settings = stand_in_settings() if kind == "cpu" else contextlib.nullcontext()
    with settings:
        rows = [gpu.measure(case, device.torch_device, precision, kernel, device.measuring) for case, kernel in chosen]
    table = "\n".join("  ".join(row.cells()) for row in rows)
    print(f"\n{'  '.join(gpu.HEADER)}\n{table}")
    median, worst = gpu.verdict(rows)
    assert worst <= gpu.TARGET_WORST, f"worst {worst:.2%}, median {median:.2%}:\n{table}"
    assert median <= gpu.TARGET_MEDIAN, f"median {median:.2%}:\n{table}"
    lowest = min(row.error for row in rows)
    assert lowest >= -gpu.TARGET_UNDER, f"a row {lowest:.2%} under the truth:\n{table}"
