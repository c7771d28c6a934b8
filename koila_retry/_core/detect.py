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
    "CUDA driver error: out of memory",  # c10's and AOTInductor's checks of driver calls
    "Triton Error [CUDA]: out of memory",  # Triton loading or launching a kernel (torch.compile's inductor)
    "Triton Error [HIP]: out of memory",  # the same on ROCm, in that form
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

# Triton's ROCm launcher puts HIP's code before the text: "Triton Error [HIP]:  Code: 2, Messsage: out
# of memory" (sic). Code 2 is hipErrorOutOfMemory, whose text older ROCm releases gave as its name.
TRITON_HIP_PATTERN = re.compile(r"Triton Error \[HIP\]: +Code: 2, Messs?age: (?:out of memory|hipErrorOutOfMemory)")

# Python 3.11's exception groups (asyncio.TaskGroup raises one); None before.
_GROUP: type[BaseException] | None = getattr(builtins, "BaseExceptionGroup", None)

# How many explicit causes (``raise ... from ...``) is_oom follows; the chain may also loop.
MAX_CAUSES = 32


def is_oom(exc: BaseException) -> bool:
    """Return whether an exception means that a device ran out of memory.

    ``torch.OutOfMemoryError`` (CUDA, ROCm, XPU, and :class:`BatchSizeExhausted`)
    always counts. A plain ``RuntimeError`` counts when its message is one of the
    out-of-memory messages PyTorch and its backends raise as text: the CPU
    allocator on Linux and Windows, MPS, ``CUDA error: out of memory``, ``CUDA
    driver error: out of memory``, Triton's launcher (``Triton Error [CUDA]: out of
    memory``, and its ROCm form), cuBLAS and
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
    holds does, and so does an error raised from such a group; the errors a group
    holds are followed through what is left of the 32 links.

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
    return _leads_to_oom(exc, MAX_CAUSES + 1, set(), {})


def _leads_to_oom(exc: BaseException, links: int, path: set[int], groups: dict[tuple[int, int], bool]) -> bool:
    """Whether ``exc`` says out of memory or was raised from one that does, within ``links`` links."""
    if not isinstance(exc, Exception):
        return False  # an interrupt or an exit is never retried, whatever it was raised from
    # ``path``: the links being looked at, so that a loop through a group's errors ends; ``groups``: each
    # group's verdict with as many links left, so that groups sharing their errors are not walked again and
    # again, and a verdict that ran out of links stands for none with more.
    entered: list[int] = []
    link: BaseException | None = exc
    try:
        while link is not None and links > 0 and id(link) not in path:
            if _says_out_of_memory(link):
                return True
            entered.append(id(link))
            path.add(id(link))
            links -= 1
            if _GROUP is not None and isinstance(link, _GROUP):
                # asyncio.TaskGroup's, say: out of memory when every error it holds is (cancellations are not
                # held), each followed through what is left of the links.
                verdict = groups.get((id(link), links))
                if verdict is None:
                    members = link.exceptions  # type: ignore[attr-defined]
                    verdict = all(_leads_to_oom(each, links, path, groups) for each in members)
                    groups[(id(link), links)] = verdict
                if verdict:
                    return True
            link = link.__cause__
        return False
    finally:
        path.difference_update(entered)


def _says_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if not isinstance(exc, RuntimeError) or not exc.args or not isinstance(exc.args[0], str):
        return False
    message = exc.args[0]
    if any(text in message for text in OOM_MESSAGES) or OOM_PATTERN.search(message) is not None:
        return True
    if "Triton Error [HIP]" in message and TRITON_HIP_PATTERN.search(message) is not None:
        return True
    return any(text in message for text in MEMORY_SHORT_MESSAGES) and memory.nearly_full()
