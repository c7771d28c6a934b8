"""Decide which exceptions mean "out of memory"."""

from __future__ import annotations

import builtins
import re

import torch

from koila_retry._core import memory

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
    "HIP error: out of memory",  # the same on ROCm
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed",  # Intel Gaudi (HPU)
)

# Library statuses that a failed allocation inside the library turns into, and other
# failures too: out of memory only when the device is nearly full as they are raised.
# With the card full, cuDNN's first call raised INTERNAL_ERROR on an H100 (2026-11-25);
# cuDNN reports a workspace it could not get as NOT_SUPPORTED, and cuBLAS fails to
# create its handle as NOT_INITIALIZED.
MEMORY_SHORT_MESSAGES: tuple[str, ...] = (
    "CUDNN_STATUS_INTERNAL_ERROR",
    "CUDNN_STATUS_EXECUTION_FAILED",
    "CUDNN_STATUS_NOT_SUPPORTED",
    "CUBLAS_STATUS_INTERNAL_ERROR",
    "CUBLAS_STATUS_EXECUTION_FAILED",
    "CUBLAS_STATUS_NOT_INITIALIZED",
)

# Out-of-tree backends copy the caching allocator's sentence with their own device name: "NPU out of
# memory." (Ascend), "MLU out of memory." (Cambricon), "MUSA out of memory.". The name must be a word in
# capitals, so "the worker ran out of memory." is not one.
OOM_PATTERN = re.compile(r"\b[A-Z][A-Z0-9]* out of memory\.")

# Python 3.11's exception groups (asyncio.TaskGroup raises one); None before.
_GROUP: type[Exception] | None = getattr(builtins, "ExceptionGroup", None)

# How many explicit causes (``raise ... from ...``) is_oom follows; the chain may also loop.
MAX_CAUSES = 32


def is_oom(exc: BaseException) -> bool:
    """Return whether an exception means that a device ran out of memory.

    ``torch.OutOfMemoryError`` (CUDA, ROCm, XPU, and :class:`BatchSizeExhausted`)
    always counts. A plain ``RuntimeError`` counts when its message is one of the
    out-of-memory messages PyTorch and its backends raise as text: the CPU
    allocator on Linux and Windows, MPS, ``CUDA error: out of memory``, cuBLAS and
    cuDNN allocation failures (``*_STATUS_ALLOC_FAILED``), Gaudi's device-memory
    allocation failure, and a device name in capitals followed by ``out of
    memory.`` (``NPU out of memory.``).

    cuDNN's and cuBLAS's statuses that a failed allocation inside the library turns
    into, among other causes (``CUDNN_STATUS_INTERNAL_ERROR``,
    ``CUDNN_STATUS_EXECUTION_FAILED``, ``CUDNN_STATUS_NOT_SUPPORTED``,
    ``CUBLAS_STATUS_INTERNAL_ERROR``, ``CUBLAS_STATUS_EXECUTION_FAILED`` and
    ``CUBLAS_STATUS_NOT_INITIALIZED``) count only when the current CUDA device is
    nearly full as the error is classified: at most 5% of it free at the driver,
    or at most 5% of the process's share left under
    ``torch.cuda.set_per_process_memory_fraction`` (inside
    :func:`koila_retry.testing.simulated_device`, 5% of its memory left). With
    memory to spare they are other failures, and pass through. Nothing else
    counts, ``KeyboardInterrupt`` and Python's own ``MemoryError`` included.

    An error raised *from* an out-of-memory error (``raise RuntimeError("forward
    failed") from error``) counts too: its ``__cause__`` is followed, through up
    to 32 links (a loop of causes ends there). An error that was merely raised *while handling*
    one (its ``__context__``, such as a failure in an ``except`` block that logs
    the out-of-memory error) is a different failure, and does not count. Neither
    do ``KeyboardInterrupt``, ``SystemExit`` and the other exceptions that are not
    an ``Exception``, whatever their cause. An ``ExceptionGroup`` (what
    ``asyncio.TaskGroup`` raises, Python 3.11 on) counts when every error it
    holds does.

    Args:
        exc (BaseException): the exception to classify.

    Returns:
        bool: ``True`` if ``exc`` is an out-of-memory error.

    Raises:
        TypeError: if ``exc`` is not an exception.

    Example::

        >>> import torch, koila_retry as koila
        >>> koila.is_oom(
        ...     torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
        ... )
        True
        >>> koila.is_oom(ValueError("shape mismatch"))
        False
    """
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if not isinstance(exc, BaseException):
        raise TypeError(f"is_oom() takes an exception, got {type(exc).__name__} {exc!r}")
    if not isinstance(exc, Exception):
        return False  # an interrupt or an exit is never retried, whatever it was raised from
    if _GROUP is not None and isinstance(exc, _GROUP):
        # asyncio.TaskGroup's, say: out of memory when every error it holds is (cancellations are not held).
        return all(map(is_oom, exc.exceptions))  # type: ignore[attr-defined]
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and len(seen) <= MAX_CAUSES and id(link) not in seen:
        if _says_out_of_memory(link):
            return True
        seen.add(id(link))
        link = link.__cause__
    return False


def _says_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if not isinstance(exc, RuntimeError) or not exc.args or not isinstance(exc.args[0], str):
        return False
    message = exc.args[0]
    if any(text in message for text in OOM_MESSAGES) or OOM_PATTERN.search(message) is not None:
        return True
    return any(text in message for text in MEMORY_SHORT_MESSAGES) and memory.nearly_full()
