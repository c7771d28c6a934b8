"""Free memory per device, and releasing memory after a failed attempt.

A :func:`koila_retry.testing.simulated_device` the calling thread entered stands for every device here.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Iterable
from typing import Any, cast

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
    """Turn a device argument into an indexed ``torch.device``: ``None`` is the current accelerator, else the CPU."""
    if device is None:
        return default_device()
    parsed = _parsed(device)
    if parsed is None and isinstance(device, int):  # an index
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is None:
            raise ValueError(f"device index {device} given, but no accelerator is available")
        parsed = torch.device(accelerator.type, device)
    return _indexed(cast(torch.device, parsed))


def _parsed(device: DeviceLike) -> torch.device | None:
    """Return the device a str or ``torch.device`` names, ``None`` for an index; raise for anything else."""
    if isinstance(device, torch.device):
        return device
    if isinstance(device, bool) or not isinstance(device, (str, int)):
        raise TypeError(
            f"device must be a torch.device, a str such as 'cuda:1', an int index or None, "
            f"got {type(device).__name__} {device!r}"
        )
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"device index must be >= 0, got {device}")
        return None
    try:
        return torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"{device!r} is not a device PyTorch knows: {exc}") from None


_accelerator_type: str | None = None
_accelerator_known = False


def default_device() -> torch.device:
    """Return the current accelerator device, or the CPU when there is none."""
    # Whether there is an accelerator is asked once per process; which device is current
    # (torch.cuda.set_device may change it) on every call.
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
    asking the driver), and never more than the process's own limit leaves: under
    ``torch.cuda.set_per_process_memory_fraction(f)`` the caching allocator refuses
    to hold more than ``f`` of the card, so the process can still allocate that
    share less what it has reserved. On the CPU: the memory the operating system
    reports available, capped by what is left of the process's ``RLIMIT_AS``
    address-space limit. On the meta device, which stores no data, ``2**63 - 1``. Inside
    a :func:`koila_retry.testing.simulated_device` block that the calling thread
    entered, the simulated device's free bytes, whatever device ``device`` names (an
    accelerator absent here included); other threads read the real device.

    Args:
        device (torch.device, str, int or None): the device; ``None`` means the
            current accelerator device, or the CPU when there is none.

    Returns:
        int: free bytes, never negative.

    Raises:
        TypeError: if ``device`` is of none of the types above.
        ValueError: if ``device`` is not a device PyTorch knows, or (outside a
            simulated device) is of a type this process has no accelerator for.
    """
    simulated = tracking.simulated.free()
    if simulated is not None:
        if device is not None:
            _parsed(device)  # refused as outside: a test must not pass what would fail for real
        return simulated
    return _device_free(resolve_device(device))


def _device_free(device: torch.device) -> int:
    if device.type == "cpu":
        return _cpu_free()
    if device.type == "meta":
        return UNLIMITED  # meta tensors have shapes and no data
    if not on_accelerator(device):
        raise ValueError(f"cannot read free memory of {device}: this process has no {device.type} device")
    free, total = torch.accelerator.get_memory_info(device)
    reserved = torch.accelerator.memory_reserved(device)
    usable = free + reserved - torch.accelerator.memory_allocated(device)
    fraction = memory_fraction(device)
    if fraction < 1.0:
        # The allocator refuses a new segment once its segments would pass ``fraction * total``:
        # what it reserves counts, cached blocks included, and a cached block serves only a
        # request that fits in it. On the H200 of 2026-11-26 the share less what was
        # allocated was 85 MiB too much: the share less what is reserved is what is left.
        usable = min(usable, int(fraction * total) - reserved)
    return max(usable, 0)


def memory_fraction(device: torch.device) -> float:
    """Return what ``set_per_process_memory_fraction`` set for the device's backend; 1.0 where none is read."""
    read = getattr(getattr(torch, device.type, None), "get_per_process_memory_fraction", None)
    if read is None:
        return 1.0
    try:
        fraction = float(read(device))
    except (RuntimeError, AssertionError, ValueError, TypeError, AttributeError):
        return 1.0
    return min(max(fraction, 0.0), 1.0)


class PeakMeter:
    """Measure ``rise``: the most bytes a block allocated at once, over what was allocated before it."""

    def __init__(self, device: torch.device, simulated: tracking.Simulated | None) -> None:
        self.device, self.simulated = device, simulated
        self.before = 0
        self.rise = 0

    def __enter__(self) -> PeakMeter:
        simulated = self.simulated
        if simulated is not None:
            self.before = simulated.live
            simulated.reset_peak()
        else:
            self.before = torch.accelerator.memory_allocated(self.device)
            torch.accelerator.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        simulated = self.simulated
        # On a real device other threads' allocations count too, so the rise is never below the
        # block's own; a simulated device counts its own thread's alone.
        peak = simulated.peak if simulated is not None else torch.accelerator.max_memory_allocated(self.device)
        self.rise = max(peak - self.before, 0)


def peak_meter(device: torch.device) -> PeakMeter | None:
    """Return a meter of the peak of work on ``device``, or ``None`` where no allocator keeps one (the CPU)."""
    simulated = tracking.simulated.device()
    if simulated is not None:
        return PeakMeter(device, simulated)
    if device.type in ("cpu", "meta") or not on_accelerator(device):
        return None
    return PeakMeter(device, None)


#: The share of its memory a device has left when a library's failure there counts as out of memory.
NEARLY_FULL = 0.05


def nearly_full() -> bool:
    """Return whether the current CUDA device, where cuDNN and cuBLAS errors (naming none) ran, is nearly full."""
    simulated = tracking.simulated.device()
    if simulated is not None:
        return simulated.free <= NEARLY_FULL * simulated.allowed
    try:
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):  # type: ignore[no-untyped-call]
            return False
        device = torch.device("cuda", torch.cuda.current_device())
        free, total = torch.cuda.mem_get_info(device)
        if free <= NEARLY_FULL * total:  # a library's own allocations draw on the driver's free memory
            return True
        allowed = memory_fraction(device) * total  # PyTorch's allocator stops at the process's share
        return allowed - torch.cuda.memory_allocated(device) <= NEARLY_FULL * allowed
    except (RuntimeError, AssertionError, ValueError):
        return False  # a device in an error state: the error itself is what the user needs


def _cpu_free() -> int:
    available: int = psutil.virtual_memory().available
    if resource is not None:
        soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            available = min(available, soft - _PROCESS.memory_info().vms)
    return max(available, 0)


def recent_free_memory(device: torch.device) -> int:
    """Return the device's free bytes, reusing a reading younger than ``FREE_MEMORY_TTL``; ``-1`` if unreadable."""
    if tracking.anywhere[0]:
        simulated = tracking.simulated.free()
        if simulated is not None:
            return simulated
    now = time.monotonic()
    reading = _free_readings.get(device)
    if reading is not None and now < reading[0]:
        return reading[1]
    try:
        free = _device_free(device)
    # A backend without torch.accelerator, or psutil as the interpreter ends (it looks itself up in
    # sys.modules, emptied by then: a wrapper called from a __del__): a cache key must not break the call.
    except Exception:
        free = -1
    _free_readings[device] = (now + FREE_MEMORY_TTL, free)
    return free


_descriptions: dict[torch.device, str] = {}


def describe_device(device: torch.device) -> str:
    """Name a device by kind, model and total memory, not index: keys that outlive the process use it."""
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
    use the memory. Before collecting, it drains what a backward that raised on
    this thread left in the autograd engine's queue: PyTorch keeps the nodes that
    were ready, and the graph through them, until the thread's next backward. It
    does so with a backward of one CPU scalar, except inside a backward or under
    compiled autograd.
    Call it after leaving an ``except`` block: inside one, the traceback still
    holds the failed frames and their tensors.

    Args:
        device (torch.device, str, int or None): the device whose cache to empty;
            ``None`` means the current accelerator device, if any.

    Raises:
        ValueError: if ``device`` is not a device PyTorch knows.
        TypeError: if ``device`` is not a ``torch.device``, a str, an int or ``None``.
    """
    _release(resolve_device(device), 2)


def release_young(device: DeviceLike = None) -> None:
    """Release memory as :func:`release` does, for a call that gives up, collecting young objects only."""
    # A failed attempt's cycles (its frames, the traceback) are young; a full collection walks
    # every object of the process (a tenth of a second with torch and a few libraries imported).
    _release(resolve_device(device), 1)


def _release(device: torch.device, generation: int) -> None:
    collect(generation)
    empty_caches((device,))


def collect(generation: int = 2) -> None:
    """Free what a failed attempt held: what its backward left queued on this thread, then reference cycles."""
    # A backward that raised while several of its nodes were ready leaves them in this thread's queue of
    # the autograd engine, and through them the rest of its graph, activations included, until the
    # thread's next backward. A backward of one CPU scalar drains it: through the engine directly, so
    # that no hook on torch.autograd.backward takes it for a step's (its scalars pass the modes in force).
    # Not inside a backward (reentrant), nor where compiled autograd would compile this one.
    if _graph_task() == -1 and not _compiled_autograd():
        try:
            leaf = torch.zeros((), requires_grad=True, device="cpu")
            _ENGINE.run_backward((leaf,), (torch.ones((), device="cpu"),), False, False, (), True, True)
        except Exception:  # not even a scalar fits, or a mode refused one: best effort
            pass  # the queue waits for the thread's next backward, as without this
    gc.collect(generation)


def _compiled_autograd() -> bool:
    compiled = sys.modules.get("torch._dynamo.compiled_autograd")  # not imported: not in use
    return compiled is not None and bool(getattr(compiled, "compiled_autograd_enabled", False))


# The autograd engine, and the graph task it runs on this thread (-1 outside a backward).
_ENGINE: Any = torch.autograd.Variable._execution_engine
_graph_task: Any = getattr(torch._C, "_current_graph_task_id", lambda: -1)


def empty_caches(devices: Iterable[torch.device], *, host: bool = False) -> None:
    """Give the devices' cached, unused allocator blocks back to the driver; ``host`` also empties pinned memory."""
    try:
        for device in devices:
            if device.type != "cpu" and on_accelerator(device):
                with torch.accelerator.device_index(device.index):
                    torch.accelerator.empty_cache()
        if host:
            _empty_host_cache()
    finally:
        forget_free_memory()


def _empty_host_cache() -> None:
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    empty = getattr(torch.accelerator, "empty_host_cache", None)  # absent from older PyTorch
    # Only CUDA and XPU have a host allocator; on MPS, PyTorch 2.13 crashes emptying it (pytorch#197561).
    if accelerator is not None and accelerator.type in ("cuda", "xpu") and empty is not None:
        empty()
