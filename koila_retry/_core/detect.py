"""Decide which exceptions mean "out of memory"."""

from __future__ import annotations

import torch

# The plain-RuntimeError messages PyTorch and its backends raise when memory runs out.
# Matching is by substring of the message; each entry names one real failure mode.
OOM_MESSAGES: tuple[str, ...] = (
    "CUDA out of memory",  # caching allocator, older releases raised a RuntimeError
    "HIP out of memory",
    "XPU out of memory",
    "DefaultCPUAllocator: can't allocate memory",  # Linux, macOS
    "DefaultCPUAllocator: not enough memory",  # Windows
    "MPS backend out of memory",
    "CUDA error: out of memory",  # kernel-launch path, outside the caching allocator
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    # cuDNN reports a workspace it could not allocate as "not supported".
    "CUDNN_STATUS_NOT_SUPPORTED",
)


def is_oom(exc: BaseException) -> bool:
    """Return whether an exception means that a device ran out of memory.

    ``torch.OutOfMemoryError`` (CUDA, ROCm, XPU, and :class:`BatchSizeExhausted`)
    always counts. A plain ``RuntimeError`` counts when its message is one of the
    out-of-memory messages PyTorch raises as text: the CPU allocator on Linux and
    Windows, MPS, ``CUDA error: out of memory``, cuBLAS and cuDNN allocation
    failures. Nothing else does, ``KeyboardInterrupt`` and Python's own
    ``MemoryError`` included.

    Args:
        exc (BaseException): the exception to classify.

    Returns:
        bool: ``True`` if ``exc`` is an out-of-memory error.

    Raises:
        TypeError: if ``exc`` is not an exception.

    Example::

        >>> import torch, koila_retry as koila
        >>> koila.is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB."))
        True
        >>> koila.is_oom(ValueError("shape mismatch"))
        False
    """
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if not isinstance(exc, BaseException):
        raise TypeError(f"is_oom() takes an exception, got {type(exc).__name__} {exc!r}")
    if not isinstance(exc, RuntimeError):
        return False
    message = exc.args[0] if exc.args and isinstance(exc.args[0], str) else ""
    return any(text in message for text in OOM_MESSAGES)
