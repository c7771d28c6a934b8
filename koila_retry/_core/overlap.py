"""DDP's overlap under agreement: the last micro-batch's backward all-reduces as DDP does it, during the backward.

A rank that runs out of memory before or inside that backward never launches some of the buckets the
other ranks wait in. So, before the ranks agree, it *plays along*: it works out which buckets its
reducer launched (those whose every gradient was written, in the reducer's order) and makes the rest,
with zeros, through DDP's own comm hook, as DDP's ``Join`` does for a rank with no input left. Then the
ranks agree once, and every rank resets its reducer (``_reset_state``), as DDP does when its process
group changes. docs/distributed.rst, "DDP: the overlap, kept", explains it to users.
"""

from __future__ import annotations

import operator
import weakref
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

__all__ = ["Overlap", "overlaps"]

# Per DDP module, looked at once: its parameters if a failed rank can play along (else None), its BatchNorms.
_KNOWN: weakref.WeakKeyDictionary[torch.nn.Module, tuple[list[torch.nn.Parameter] | None, list[torch.nn.Module]]] = (
    weakref.WeakKeyDictionary()
)
_HOOKS = operator.attrgetter("_post_accumulate_grad_hooks")
# What the reducer must have for a rank to play along and for the ranks to start again (torch >= 2.2).
_REDUCER = ("_get_zeros_like_grad_buckets", "_run_comm_hook", "_reset_state")


def overlaps(modules: list[DistributedDataParallel]) -> bool:
    """Return whether a step over ``modules`` can keep DDP's overlap; else it all-reduces after the backward."""
    if len(modules) != 1:  # two reducers interleave their buckets by readiness: no order to play along in
        return False
    module = modules[0]
    parameters = _parameters(module)
    # A hook that runs after a gradient is written may fail before DDP's sees it.
    return parameters is not None and not any(map(_HOOKS, parameters))


def _parameters(module: DistributedDataParallel) -> list[torch.nn.Parameter] | None:
    """Return the module's parameters if its reducer lets a failed rank play along, else None (looked at once)."""
    known = _KNOWN.get(module)
    if known is not None:
        return known[0]
    reducer = getattr(module, "reducer", None)
    # Readiness is read from the gradients: static graphs delay or count their hooks, the unused parameters
    # DDP finds are marked ready without one, a sparse gradient has no bucket of zeros, delayed parameters
    # are all-reduced by a hook of their own.
    served = (
        reducer is not None
        and all(hasattr(reducer, name) for name in _REDUCER)
        and not getattr(module, "static_graph", False)
        and not module.find_unused_parameters
        and not getattr(module, "skip_all_reduce_unused_params", False)
        and not getattr(module, "_use_python_reducer", False)
        and not getattr(module, "_delay_all_reduce_params", None)
        and not any(getattr(each, "sparse", False) for each in module.module.modules())
    )
    # DDP's parameters are fixed when it is built; so, usually, are the layers that hold them.
    parameters = list(module.parameters()) if served else None
    norms: list[torch.nn.Module] = [
        each for each in module.modules() if isinstance(each, torch.nn.modules.batchnorm._BatchNorm)
    ]
    _KNOWN[module] = (parameters, norms)
    return parameters


class Overlap:
    """One DDP module's side of a step: gradients set aside, the last micro-batch synced, the play-along."""

    def __init__(self, module: DistributedDataParallel) -> None:
        self.module = module
        self.reducer: Any = module.reducer
        self.parameters = [parameter for parameter in _parameters(module) or () if parameter.requires_grad]
        # With gradients as bucket views, the reducer writes the bucket that .grad is a view of: what is
        # set aside must be a copy (the one buffer the exact rollback costs, and only when .grad is present).
        self.copies = bool(getattr(module, "gradient_as_bucket_view", False))
        self.aside: list[torch.Tensor | None] = []
        self.running = False  # an attempt began and has not finished its last micro-batch
        self.synced = False  # the last micro-batch began: its backward launches buckets
        self.before_sync: list[tuple[torch.Tensor | None, int]] | None = None  # each gradient, and its version

    def before(self) -> None:
        """Set the gradients the parameters have aside, so that the step's start from none."""
        aside = self.aside = [parameter.grad for parameter in self.parameters]
        if self.copies:
            self.aside = [None if grad is None else grad.clone() for grad in aside]
        for parameter in self.parameters:
            parameter.grad = None

    def micro_batch(self, last: bool, first: bool) -> None:
        """Begin a micro-batch: DDP all-reduces in its backward only if it is the last."""
        # Plain flags, written past Module.__setattr__ (some 5 us each). Buffers were broadcast once, before
        # the step: no forward of it broadcasts them again (DDP asks for it after a forward that syncs), or a
        # rank that failed before its forward would miss the broadcast.
        attributes = vars(self.module)
        if first:
            self.running, self.synced, self.before_sync = True, False, None
            attributes["require_forward_param_sync"] = False
            attributes["require_backward_grad_sync"] = last
        elif last:
            attributes["require_backward_grad_sync"] = True
        if last:
            self.synced = True
            if not first:  # what the earlier micro-batches wrote: the backward adds into it, or replaces it
                self.before_sync = [
                    (grad, -1 if grad is None else grad._version)
                    for grad in (parameter.grad for parameter in self.parameters)
                ]

    def finished(self) -> None:
        """End an attempt whose micro-batches all ran."""
        self.running, self.before_sync = False, None

    def play_along(self) -> bool:
        """After an attempt that failed here: make the buckets this rank never launched; return True (the vote)."""
        if not self.running:
            return True
        self.running = False
        before, self.before_sync = self.before_sync, None
        written = set()
        if self.synced:
            for index, parameter in enumerate(self.parameters):
                grad = parameter.grad
                was, version = (None, -1) if before is None else before[index]
                if grad is not None and (grad is not was or grad._version != version):
                    written.add(id(parameter))
        del before
        for parameter in self.parameters:
            parameter.grad = None  # the attempt failed: its gradients go now, before the buckets of zeros
        # Each bucket's zeros are made here, while no activation of the attempt is left.
        buckets = self.reducer._get_zeros_like_grad_buckets()
        launched = 0
        for bucket in buckets:
            if not all(id(parameter) in written for parameter in bucket.parameters()):
                break
            launched += 1
        futures = [self.reducer._run_comm_hook(bucket) for bucket in buckets[launched:]]
        del buckets
        for future in futures:
            future.wait()
        return True

    def undo(self) -> None:
        """After an attempt that failed on some rank: its gradients dropped, the reducer as before a backward."""
        self.running, self.before_sync = False, None
        for parameter in self.parameters:
            parameter.grad = None
        # Every rank: a reducer that finished its backward expects a rebuild of its buckets otherwise
        # that the failed rank's would not make.
        self.reducer._reset_state()
        self._sync_on()

    def restore(self) -> None:
        """After the step: add the gradients set aside back, in place, as a backward adds into ``.grad``."""
        self._sync_on()
        aside, self.aside = self.aside, []
        for parameter, before in zip(self.parameters, aside, strict=True):
            if before is None:
                continue
            if parameter.grad is not None:
                before.add_(parameter.grad)
            parameter.grad = before

    def give_back(self) -> None:
        """After a step that raised: the gradients set aside, as they were."""
        for parameter in self.parameters:
            parameter.grad = None
        self._sync_on()
        aside, self.aside = self.aside, []
        for parameter, before in zip(self.parameters, aside, strict=True):
            parameter.grad = before

    def batchnorm_trains(self) -> bool:
        """Return whether a BatchNorm layer of the module is in training mode."""
        norms = _KNOWN[self.module][1]
        return any(norm.training for norm in norms) if norms else False

    def _sync_on(self) -> None:
        # As after a step DDP synchronised itself: its next forward outside koila broadcasts buffers.
        attributes = vars(self.module)
        attributes["require_backward_grad_sync"] = attributes["require_forward_param_sync"] = True
