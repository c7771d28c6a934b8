"""A CUDA device made of numbers, for the code that reads one: free memory, the process's share, the driver.

On a machine without CUDA, the functions of ``torch.accelerator`` and ``torch.cuda`` that
koila-retry reads are replaced with ones that report the numbers of a :class:`FakeCuda`.
Nothing can allocate on it: it tests what is computed from the readings.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from koila_retry._core import memory

GiB = 2**30


@dataclass
class FakeCuda:
    """What the driver and the caching allocator report, in bytes; ``fraction`` as the allocator has it."""

    total: int = 80 * GiB
    driver_free: int = 70 * GiB
    reserved: int = 8 * GiB
    allocated: int = 6 * GiB
    fraction: float = 1.0
    initialized: bool = True

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Make this process see this device as ``cuda:0``, for the rest of the test."""
        cuda = torch.device("cuda")
        monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
        monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: cuda)
        monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
        monkeypatch.setattr(torch.accelerator, "get_memory_info", lambda device=None: (self.driver_free, self.total))
        monkeypatch.setattr(torch.accelerator, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(torch.accelerator, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: self.initialized)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (self.driver_free, self.total))
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: self.fraction)
        # An H100's, as the estimator's choice of attention kernel reads them.
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        monkeypatch.setattr(
            torch.cuda,
            "get_device_properties",
            lambda device=None: SimpleNamespace(
                name="H100 (fake)",
                total_memory=self.total,
                major=9,
                minor=0,
                multi_processor_count=132,
                max_threads_per_multi_processor=2048,
                warp_size=32,
            ),
        )
        # default_device() asks once per process whether there is an accelerator, and
        # describe_device() remembers each device: both are given back as they were.
        monkeypatch.setattr(memory, "_accelerator_known", False)
        monkeypatch.setattr(memory, "_accelerator_type", None)
        monkeypatch.setattr(memory, "_descriptions", {})
        memory.forget_free_memory()
