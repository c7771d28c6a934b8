"""The torch versions the estimator's hand-written rules were checked on, and a warning outside them.

Several rules restate what PyTorch does inside itself (attention kernels, autocast's lists,
oneDNN's convolutions, recurrent kernels, CUDA's rounding), which changes between versions
without notice. A version goes into :data:`RULE_SETS` only once checked: against its source
and behaviour, or derived again by ``tests/test_tables.py`` (``derived``), or run on the device.
"""

from __future__ import annotations

import re
import threading
import warnings
from typing import NamedTuple

import torch

from koila_retry._common.forks import locks_renewed_in_child
from koila_retry._common.places import levels_to_caller

__all__ = ["RULE_SETS", "RuleSet", "checked_minor", "installed", "reset_warning", "unchecked", "warn_if_unchecked"]


class RuleSet(NamedTuple):
    """One set of rules the estimator takes from PyTorch, and the torch minor versions it was checked on."""

    name: str
    where: str
    checked: tuple[str, ...]
    derived: str = ""  # what tests/test_tables.py derives again from the installed torch


RULE_SETS: tuple[RuleSet, ...] = (
    RuleSet(
        "which attention kernel scaled_dot_product_attention runs, by the CPU's and CUDA's gates and their order",
        "koila_retry/_estimation/attention.py: choose_backend",
        ("2.13",),
        "the CPU's choice, against torch._fused_sdp_choice",
    ),
    RuleSet(
        "the inference fast path of nn.MultiheadAttention and nn.TransformerEncoderLayer",
        "koila_retry/_estimation/attention.py: _attention_fast, _encoder_layer_fast",
        ("2.13",),
        "whether the CPU takes it, against a real CPU run",
    ),
    RuleSet(
        "which operators torch.autocast casts, and how, on the CPU and CUDA",
        "koila_retry/_estimation/autocast.py: POLICIES, OVERLOADS_LEFT_ALONE",
        ("2.13",),
        "both lists: operators and overloads from the dispatcher's autocast kernels, how each is cast "
        "from real CPU runs and from fake CUDA tensors",
    ),
    RuleSet(
        "when a CPU convolution runs through oneDNN, and the workspace it holds",
        "koila_retry/_estimation/workspace.py",
        ("2.13",),
        "when oneDNN runs, against torch._C._select_conv_backend (the workspace's size was measured, not derived)",
    ),
    RuleSet(
        "what oneDNN's LSTM holds on the CPU",
        "koila_retry/_estimation/recurrent.py: _OnednnLayer",
        ("2.13",),
    ),
    RuleSet(
        "what cuDNN's recurrent layers hold on CUDA: reserve, workspace, copies",
        "koila_retry/_estimation/recurrent.py: _CudnnStack",
        # 2.11: fitted to the grid the H100 run of 2026-11-25 measured (torch 2.11.0+cu130, cuDNN 9.19,
        # benchmarks/runs/2026-11-25-h100/diag2.txt); 2.13: what aten/src/ATen/native/cudnn/RNN.cpp allocates.
        ("2.11", "2.13"),
    ),
    RuleSet(
        "the staging buffer CUDA's reduction kernel takes when it splits a sum or mean across blocks",
        "koila_retry/_estimation/workspace.py: cuda_reduction_buffers",
        # 2.11: it gives the 64 MiB the H100 run recorded under sum for a [8192, 1024] bias gradient
        # (benchmarks/runs/2026-11-25-h100/diag2.txt); 2.13: aten/src/ATen/native/cuda/Reduce.cuh's launch rules.
        ("2.11", "2.13"),
    ),
    RuleSet(
        "CUDA's fused dropout in training, which keeps a one-byte mask",
        "koila_retry/_estimation/attention.py: _cuda_dropout",
        # 2.11: the H100 run's dropout allocations (benchmarks/runs/2026-11-25-h100/diag.txt) match it to the
        # 0.01 MiB printed; 2.13: where torch.nn.functional.dropout sends a CUDA call.
        ("2.11", "2.13"),
    ),
    RuleSet(
        "how CUDA's caching allocator rounds each allocation",
        "koila_retry/_estimation/workspace.py: cuda_rounding",
        # 2.11: in the H100 run of 2026-11-25 (torch 2.11.0+cu130, benchmarks/runs/2026-11-25-h100/pytest.log),
        # the estimate of the eval rows that no unmodelled kernel touches, this rounding included, matched the
        # allocator's own peak to the 0.1 MiB printed (+0.00%: mlp eval in float32 and bfloat16, transformer
        # eval in float32, BERT eval in float32 and bfloat16).
        ("2.11", "2.13"),
    ),
)

# Read at each call rather than bound to torch.__version__, so that a test can stand in another version.
installed = str(torch.__version__)

_lock = threading.Lock()
locks_renewed_in_child(globals(), "_lock")  # a fork while another thread held it
_warned = False


def checked_minor(version: str) -> str:
    """Return the ``major.minor`` of a torch version (``2.13.0a0+git1234abc`` counts as 2.13), else the version."""
    found = re.match(r"\s*(\d+)\.(\d+)", version)
    return f"{int(found.group(1))}.{int(found.group(2))}" if found else version


def unchecked(version: str) -> list[RuleSet]:
    """Return the rule sets not checked on torch ``version``'s ``major.minor``."""
    minor = checked_minor(version)
    return [rules for rules in RULE_SETS if minor not in rules.checked]


def _message(version: str, outside: list[RuleSet]) -> str:
    lines = [
        f"koila_retry's memory estimate follows rules taken from PyTorch, and torch {version} is not a version "
        "they were checked on:"
    ]
    lines += [f"  - {rules.name} ({rules.where}): checked on torch {', '.join(rules.checked)}" for rules in outside]
    lines.append(
        'The estimate may be off. Where the device is present, initial="auto" and suggest_batch_size(calibrate=True) '
        "measure a real run there and correct it. Please report how far it was off (the model, the estimate and the "
        "measured peak) to koila-retry's issue tracker."
    )
    return "\n".join(lines)


def warn_if_unchecked(version: str | None = None) -> None:
    """Warn, once per process (a flag check after that), when torch ``version`` is not one the rules were checked on."""
    global _warned
    if _warned:
        return
    with _lock:
        if _warned:
            return
        _warned = True
    version = installed if version is None else version
    outside = unchecked(version)
    if outside:
        warnings.warn(_message(version, outside), UserWarning, stacklevel=levels_to_caller())


def reset_warning() -> None:
    """Forget that the check ran, so that the next call of :func:`warn_if_unchecked` judges again (for tests)."""
    global _warned
    with _lock:
        _warned = False
