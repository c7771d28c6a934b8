"""Free memory per device, and releasing memory after a failed attempt."""

from __future__ import annotations

import gc
import time

import psutil
import torch

from koila_retry._common import tracking

try:
    import resource
except ImportError:  # Windows has no address-space limit to respect
    resource = None  # type: ignore[assignment]

DeviceLike = torch.device | str | int | None

_CPU = torch.device("cpu")
UNLIMITED = 2**63 - 1  # what free_memory reports for the meta device
_PROCESS = psutil.Process()

# Free-memory readings reused for cache keys. Reading system memory costs ~80 us, far
# more than a cached call may, so a reading is reused for a short while and forgotten
# whenever memory is released.
FREE_MEMORY_TTL = 1.0
_free_readings: dict[torch.device, tuple[float, int]] = {}


def resolve_device(device: DeviceLike = None) -> torch.device:
    """Turn a device argument into a ``torch.device`` with an index.

    ``None`` means the current accelerator device (``torch.accelerator``) when one
    is available, else the CPU. An int is an index of the current accelerator.

    Args:
        device (torch.device, str, int or None): the device to resolve.

    Returns:
        torch.device: the device, with an index for accelerators.

    Raises:
        ValueError: if ``device`` is not a device PyTorch knows, or is an
            accelerator index while no accelerator is available.
    """
    if device is None:
        return default_device()
    if isinstance(device, torch.device):
        resolved = device
    elif isinstance(device, bool) or not isinstance(device, (str, int)):
        raise TypeError(
            f"device must be a torch.device, a str such as 'cuda:1', an int index or None, "
            f"got {type(device).__name__} {device!r}"
        )
    elif isinstance(device, int):
        if device < 0:
            raise ValueError(f"device index must be >= 0, got {device}")
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is None:
            raise ValueError(f"device index {device} given, but no accelerator is available")
        resolved = torch.device(accelerator.type, device)
    else:
        try:
            resolved = torch.device(device)
        except RuntimeError as exc:
            raise ValueError(f"{device!r} is not a device PyTorch knows: {exc}") from None
    return _indexed(resolved)


_accelerator_type: str | None = None
_accelerator_known = False


def default_device() -> torch.device:
    """Return the current accelerator device, or the CPU when there is none.

    Whether there is an accelerator is asked once per process; which device is
    current (``torch.cuda.set_device``) is asked on every call.
    """
    global _accelerator_type, _accelerator_known
    if not _accelerator_known:
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        _accelerator_type = None if accelerator is None else accelerator.type
        _accelerator_known = True
    if _accelerator_type is None:
        return _CPU
    return torch.device(_accelerator_type, torch.accelerator.current_device_index())


def _indexed(device: torch.device | None) -> torch.device:
    if device is None:
        return _CPU
    if device.type in ("cpu", "meta") or device.index is not None:
        return device
    if on_accelerator(device):
        return torch.device(device.type, torch.accelerator.current_device_index())
    return torch.device(device.type, 0)


def on_accelerator(device: torch.device) -> bool:
    """Return whether ``device`` is of this process's accelerator type (CUDA, XPU, MPS ...)."""
    if not torch.accelerator.is_available():
        return False
    accelerator = torch.accelerator.current_accelerator()
    return accelerator is not None and accelerator.type == device.type


def free_memory(device: DeviceLike = None) -> int:
    """Return how many bytes this process can still allocate on a device.

    On CUDA and other accelerators: the device's free memory plus what PyTorch's
    caching allocator holds reserved but unallocated (blocks it can reuse without
    asking the driver). On the CPU: the memory the operating system reports
    available, capped by what is left of the process's ``RLIMIT_AS`` address-space
    limit. On the meta device, which stores no data, ``2**63 - 1``. Inside
    :func:`koila_retry.testing.simulated_device`, the simulated device's free
    bytes, whatever ``device`` says.

    Args:
        device (torch.device, str, int or None): the device; ``None`` means the
            current accelerator device, or the CPU when there is none.

    Returns:
        int: free bytes, never negative.

    Raises:
        ValueError: if ``device`` is not a device PyTorch knows, or is of a type
            this process has no accelerator for.
    """
    simulated = tracking.simulated.free()
    if simulated is not None:
        return simulated
    return _device_free(resolve_device(device))


def _device_free(device: torch.device) -> int:
    if device.type == "cpu":
        return _cpu_free()
    if device.type == "meta":
        return UNLIMITED  # meta tensors have shapes and no data
    if not on_accelerator(device):
        raise ValueError(f"cannot read free memory of {device}: this process has no {device.type} device")
    free, _total = torch.accelerator.get_memory_info(device)
    reusable = torch.accelerator.memory_reserved(device) - torch.accelerator.memory_allocated(device)
    return max(free + reusable, 0)


def _cpu_free() -> int:
    available: int = psutil.virtual_memory().available
    if resource is not None:
        soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            available = min(available, soft - _PROCESS.memory_info().vms)
    return max(available, 0)


def recent_free_memory(device: torch.device) -> int:
    """Return the device's free bytes, reusing a reading younger than ``FREE_MEMORY_TTL``.

    Never raises: a device whose memory cannot be read (a backend without
    ``torch.accelerator`` support) reads as ``-1``, so that a cache key or a log
    line cannot break the user's call.
    """
    if tracking.simulated.active:
        return tracking.simulated.active[-1].free
    now = time.monotonic()
    reading = _free_readings.get(device)
    if reading is not None and now < reading[0]:
        return reading[1]
    try:
        free = _device_free(device)
    except (ValueError, RuntimeError):
        free = -1
    _free_readings[device] = (now + FREE_MEMORY_TTL, free)
    return free


_descriptions: dict[torch.device, str] = {}


def describe_device(device: torch.device) -> str:
    """Name a device by its kind, model and total memory, the same in every run.

    A size that fits one device fits another of the same model and memory, so
    keys that outlive the process (:class:`DiskCache`) use this and not the
    device's index. Inside a simulated device, its limit stands for the memory.
    Never raises: what cannot be read is left out.
    """
    limit = tracking.simulated.limit()
    if limit is not None:
        return f"simulated {limit}"
    description = _descriptions.get(device)
    if description is None:
        description = _descriptions[device] = _describe(device)
    return description


def _describe(device: torch.device) -> str:
    if device.type == "cpu":
        return f"cpu {psutil.virtual_memory().total}"
    try:
        properties = getattr(torch, device.type).get_device_properties(device.index or 0)
        return f"{device.type} {properties.name} {properties.total_memory}"
    except (AttributeError, RuntimeError, AssertionError, ValueError):
        return device.type


def forget_free_memory() -> None:
    """Drop every reused free-memory reading, so the next one is fresh."""
    _free_readings.clear()


def release(device: DeviceLike = None) -> None:
    """Give memory that nothing references any more back to the device.

    Runs a full garbage collection (tensors held only by reference cycles, such
    as frames of a failed attempt, are freed) and empties the caching allocator
    of the device's backend, so other processes and differently sized blocks can
    use the memory. Call it after leaving an ``except`` block: inside one, the
    traceback still holds the failed frames and their tensors.

    Args:
        device (torch.device, str, int or None): the device whose cache to empty;
            ``None`` means the current accelerator device, if any.

    Raises:
        ValueError: if ``device`` is not a device PyTorch knows.
    """
    _release(resolve_device(device), 2)


def release_young(device: DeviceLike = None) -> None:
    """Release memory as :func:`release` does, collecting the young generations of objects only.

    For a call that gives up. The reference cycles a failed attempt leaves (its
    frames and the error's traceback) are made when it fails, so they are young;
    collecting them costs time in proportion to what was made since the last
    collection, where a full collection costs it in proportion to every object
    of the process (a tenth of a second with torch and a few libraries imported).

    Args:
        device (torch.device, str, int or None): as for :func:`release`.

    Raises:
        ValueError: if ``device`` is not a device PyTorch knows.
    """
    _release(resolve_device(device), 1)


def _release(device: torch.device, generation: int) -> None:
    gc.collect(generation)
    if on_accelerator(device):
        with torch.accelerator.device_index(device.index):
            torch.accelerator.empty_cache()
    forget_free_memory()
