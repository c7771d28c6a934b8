"""Make PyTorch code adapt to the memory it has.

An out-of-memory error becomes a smaller batch instead of a crash: decorate a
function with :func:`batch`, wrap a block in :func:`attempts`, run over rows
in chunks that resume where they failed with :func:`chunked` and :func:`range`,
or split a training step into micro-batches with the full batch's gradient with
:func:`accumulate`. Estimate the memory a call needs at any batch size without
running it, with :func:`estimate` and :func:`suggest_batch_size`.
"""

import typing as _typing
import warnings as _warnings

with _warnings.catch_warnings():
    # Imported without numpy, torch warns "Failed to initialize NumPy", though it
    # needs numpy only to convert tensors to and from arrays, which koila-retry never does. That
    # warning, and only it, is kept out of the first import of torch, when this is the first.
    _warnings.filterwarnings(
        "ignore", message="Failed to initialize NumPy: No module named 'numpy'", category=UserWarning
    )
    import torch as _torch  # noqa: F401

from koila_retry._common.dynamo import not_traced_package as _not_traced_package
from koila_retry._core.cache import CacheInfo, GlobalCache, NoCache, SizeCache, StackMemoryCache
from koila_retry._core.detect import is_oom
from koila_retry._core.disk import DiskCache
from koila_retry._core.engine import Attempt
from koila_retry._core.keys import KeyFunction, deep_stack_key, global_key, no_key, size_class_key, stack_key
from koila_retry._core.memory import free_memory, release
from koila_retry._core.policy import Options, powers_of_two, scaled
from koila_retry._core.stats import OOMEvent, Stats
from koila_retry._diagnostics.offload import Offload, offload
from koila_retry._diagnostics.profile import LineRow, MemoryProfile, ModuleRow, profile
from koila_retry._diagnostics.report import MemoryReport, ReportRow, report
from koila_retry._estimation.estimate import MemoryEstimate, estimate, suggest_batch_size
from koila_retry._frontends.accumulate import accumulate
from koila_retry._frontends.batch import Batched, attempts, batch
from koila_retry._frontends.chunked import chunked, range
from koila_retry._version import __version__
from koila_retry.exceptions import BatchSizeExhausted, CacheFileWarning, Diagnosis

_not_traced_package(__name__)  # torch.compile over a call runs the library as written (docs/compile.rst)

__all__ = [
    "Attempt",
    "BatchSizeExhausted",
    "Batched",
    "CacheFileWarning",
    "CacheInfo",
    "Diagnosis",
    "DiskCache",
    "GlobalCache",
    "KeyFunction",
    "LineRow",
    "MemoryEstimate",
    "MemoryProfile",
    "MemoryReport",
    "ModuleRow",
    "NoCache",
    "OOMEvent",
    "Offload",
    "Options",
    "ReportRow",
    "SizeCache",
    "StackMemoryCache",
    "Stats",
    "__version__",
    "accumulate",
    "attempts",
    "batch",
    "chunked",
    "deep_stack_key",
    "estimate",
    "free_memory",
    "global_key",
    "is_oom",
    "no_key",
    "offload",
    "powers_of_two",
    "profile",
    "range",
    "release",
    "report",
    "scaled",
    "size_class_key",
    "stack_key",
    "suggest_batch_size",
    "testing",
]

if _typing.TYPE_CHECKING:
    from koila_retry import testing
else:
    # Submodules loaded when first used: ``koila.testing`` works without ``import koila_retry.testing``,
    # and ``import koila_retry`` does not pay for it.
    _LAZY = frozenset({"testing"})

    def __getattr__(name: str) -> object:
        if name in _LAZY:
            import importlib

            return importlib.import_module(f"{__name__}.{name}")
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*globals(), *_LAZY})
