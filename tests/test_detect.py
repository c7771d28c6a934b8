"""koila.is_oom: which exceptions mean "out of memory"."""

from __future__ import annotations

import pytest
import torch

import koila_retry as koila

# Messages as PyTorch and its backends print them (see FACTS.md), one per failure mode.
OOM_ERRORS = {
    "cuda caching allocator": torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.25 GiB of which "
        "1.06 GiB is free. Including non-PyTorch memory, this process has 78.19 GiB memory in use."
    ),
    "hip caching allocator": torch.OutOfMemoryError("HIP out of memory. Tried to allocate 1.00 GiB."),
    "xpu caching allocator": torch.OutOfMemoryError("XPU out of memory. Tried to allocate 1.00 GiB."),
    "cuda as plain RuntimeError (older torch)": RuntimeError(
        "CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 7.79 GiB total capacity)"
    ),
    "cpu allocator, linux": RuntimeError(
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
        "allocate 4294967296 bytes. Error code 12 (Cannot allocate memory)"
    ),
    "cpu allocator, windows": RuntimeError(
        "[enforce fail at C:\\actions-runner\\_work\\pytorch\\pytorch\\c10\\core\\impl\\alloc_cpu.cpp:72] data. "
        "DefaultCPUAllocator: not enough memory: you tried to allocate 1073741824 bytes."
    ),
    "mps": RuntimeError(
        "MPS backend out of memory (MPS allocated: 17.00 GB, other allocations: 1.23 GB, max allowed: 18.13 GB). "
        "Tried to allocate 256.00 MB on private pool. Use PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable upper "
        "limit for memory allocations (may cause system failure)."
    ),
    "cuda kernel launch": RuntimeError(
        "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some other API call"
    ),
    "cublas": RuntimeError(
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    ),
    "cudnn workspace": RuntimeError(
        "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input."
    ),
    "cudnn alloc": RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
    "batch size exhausted": koila.BatchSizeExhausted("nothing fits", batch_size=1, attempts=3),
}

NOT_OOM_ERRORS = {
    "shape mismatch": RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x5)"),
    "cuda assert": RuntimeError("CUDA error: device-side assert triggered"),
    "python MemoryError": MemoryError(),
    "value error mentioning memory": ValueError("CUDA out of memory"),
    "keyboard interrupt": KeyboardInterrupt(),
    "system exit": SystemExit(1),
    "runtime error without args": RuntimeError(),
    "runtime error with non-str arg": RuntimeError(42),
}


@pytest.mark.parametrize("exc", OOM_ERRORS.values(), ids=OOM_ERRORS.keys())
def test_out_of_memory_errors_are_recognised(exc: BaseException) -> None:
    assert koila.is_oom(exc) is True


@pytest.mark.parametrize("exc", NOT_OOM_ERRORS.values(), ids=NOT_OOM_ERRORS.keys())
def test_other_errors_are_not_oom(exc: BaseException) -> None:
    assert koila.is_oom(exc) is False


def test_real_cpu_allocator_error_is_recognised() -> None:
    # An allocation no machine can satisfy fails in the real CPU allocator at once.
    with pytest.raises(RuntimeError) as excinfo:
        torch.empty(2**62, dtype=torch.uint8)
    assert koila.is_oom(excinfo.value)


def test_subclass_of_runtime_error_with_oom_message_counts() -> None:
    class BackendError(RuntimeError):
        pass

    assert koila.is_oom(BackendError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"))


def test_non_exception_is_rejected() -> None:
    with pytest.raises(TypeError, match="takes an exception, got str"):
        koila.is_oom("CUDA out of memory")  # type: ignore[arg-type]
