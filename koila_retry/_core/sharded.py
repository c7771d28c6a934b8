"""Steps over FSDP2 modules (``fully_shard``): collectives that learn of another rank's failure.

A rank that runs out of memory between two FSDP2 collectives (all-gathers, reduce-scatters) never makes
the next, and the others would wait in it forever: agreeing after the attempt, as under DDP, is too late.
So while a call runs, every FSDP2 collective first joins the attempt's exchange (:meth:`Agreement.after`).
Collectives of a group match in the order they are issued, so a failed rank's exchange after its attempt
meets the others' before their next collective: they raise :class:`RanksFailed` inside FSDP's hook, every
rank leaves having made the same collectives, and the agreement after the attempt reuses that exchange.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from koila_retry._core import distributed

__all__ = [
    "RanksFailed",
    "ShardedStep",
    "Shards",
    "check_mesh",
    "fsdp_modules",
    "is_fsdp2",
    "is_fsdp_hook",
    "param_groups",
    "reset",
    "state_of",
]

if distributed.AVAILABLE:
    import torch.distributed as dist


class RanksFailed(Exception):
    """Another rank's attempt ran out of memory: raised inside this rank's collective; the attempt catches it."""


class _Armed:
    """The agreement of the call running in this process, or None: FSDP2's collectives exchange with it first."""

    # One for the process, not per thread: autograd runs a GPU's backward, FSDP2's hooks included, on a
    # thread of its own. Calls of one process do not overlap in a process group.
    agreement: distributed.Agreement | None = None


_armed = _Armed()


@functools.cache
def _fsdp_module() -> type | None:
    # Imported at the first look, not with koila_retry: every agreeing call asks.
    if not distributed.AVAILABLE:
        return None
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


def is_fsdp2(module: torch.nn.Module) -> bool:
    """Return whether ``module`` was sharded with ``fully_shard`` (FSDP2)."""
    kind = _fsdp_module()
    return kind is not None and isinstance(module, kind)


def fsdp_modules(modules: Iterable[torch.nn.Module]) -> list[torch.nn.Module]:
    """Return the FSDP2 modules among ``modules``, each once."""
    found = {id(module): module for module in modules if is_fsdp2(module)}
    return list(found.values())


def state_of(module: torch.nn.Module) -> Any:
    """Return the FSDPState an FSDP2 module's hooks share (private: ``FSDPModule._get_fsdp_state()``)."""
    return module._get_fsdp_state()  # type: ignore[operator]


def param_groups(module: torch.nn.Module) -> list[Any]:
    """Return an FSDP2 module's FSDPParamGroup objects, one per mesh of its parameters (private state)."""
    state = state_of(module)
    groups = getattr(state, "_fsdp_param_groups", None)  # torch 2.13; torch 2.11 kept one or None
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group
    return [] if group is None else [group]


@functools.cache
def _state_type() -> type | None:
    if not distributed.AVAILABLE:
        return None
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    return FSDPState


def is_fsdp_hook(hook: object) -> bool:
    """Return whether a module hook is one of FSDP2's (a method of its private FSDPState)."""
    kind = _state_type()
    return kind is not None and isinstance(getattr(hook, "__self__", None), kind)


def check_mesh(module: torch.nn.Module, world_size: int, front_end: str) -> None:
    """Refuse an FSDP2 module sharded with HSDP, or over other ranks than those that agree."""
    for group in param_groups(module):
        mesh = group.mesh_info  # private: the FSDPMeshInfo of the group's parameters
        if getattr(mesh, "replicate_process_group", None) is not None:
            raise NotImplementedError(
                f"{front_end} found {type(module).__name__} sharded with HSDP (replicated and sharded): its "
                "all-reduce across replicas is not covered yet. Shard over one dimension (fully_shard with a 1-D "
                "mesh), or pass sync=False and choose the size yourself"
            )
        size = dist.get_world_size(mesh.shard_process_group)
        if size != world_size:
            raise NotImplementedError(
                f"{front_end} found {type(module).__name__} sharded over {size} ranks while {world_size} ranks "
                "agree: every rank that shards the module must agree. Pass group= the mesh's process group"
            )


class _Voting:
    """An FSDP2 collective that first takes part in the running call's exchange, then runs FSDP's ``comm``."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        tensor: torch.Tensor = self.comm.allocate(size, dtype=dtype, device=device)
        return tensor

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # FSDP allocated the collective's buffers (allocate) before this, and allocates nothing between
        # the exchange and the collective: a rank cannot run out of memory after saying it had not.
        agreement = _armed.agreement
        if agreement is not None and agreement.heard_of_failure():
            raise RanksFailed(
                f"rank {agreement.settled_rank} ran out of memory; every rank abandons the attempt "
                "before FSDP's next collective"
            )
        return self.comm(*args, **kwargs)


def _install(module: torch.nn.Module) -> None:
    """Put a voting comm in front of each of the module's FSDP collectives, once."""
    for group in param_groups(module):
        # Private: FSDPParamGroup._all_gather_comm and _reduce_scatter_comm, the comm objects that
        # set_custom_all_gather and set_custom_reduce_scatter (public) replace. Read so that a
        # custom comm of the user's is kept behind the vote.
        if not isinstance(group._all_gather_comm, _Voting):
            group._all_gather_comm = _Voting(group._all_gather_comm)
        if not isinstance(group._reduce_scatter_comm, _Voting):
            group._reduce_scatter_comm = _Voting(group._reduce_scatter_comm)


class Shards:
    """The FSDP2 modules a call reaches, under the call's agreement: what its attempts arm and reset."""

    __slots__ = ("agreement", "modules", "previous")

    def __init__(self, modules: list[torch.nn.Module], agreement: distributed.Agreement) -> None:
        self.modules, self.agreement = modules, agreement
        self.previous: distributed.Agreement | None = None
        for module in modules:
            _install(module)

    def arm(self) -> None:
        """From now until :meth:`disarm`, the modules' collectives exchange with the agreement first."""
        self.previous = _armed.agreement
        _armed.agreement = self.agreement

    def disarm(self) -> None:
        """Stop the exchanges :meth:`arm` began, at the end of the attempt's block."""
        _armed.agreement, self.previous = self.previous, None

    def reset(self) -> None:
        """After an attempt that failed on some rank: every module back to idle, resharded."""
        reset(self.modules)


class ShardedStep:
    """What a training step over FSDP2 modules (``accumulate``) does about the gradients of all they reach."""

    def __init__(self, modules: list[torch.nn.Module], alone: bool = False) -> None:
        # alone (one rank, or sync=False): no agreement resets FSDP2 state after a failure, so undo does.
        self.alone = alone
        sharded = [module for module in modules if is_fsdp2(module)]
        inner = {id(sub) for module in sharded for sub in module.modules() if sub is not module and is_fsdp2(sub)}
        self.roots = [module for module in sharded if id(module) not in inner]
        self.sharded = sharded
        self.parameters = list(
            {id(p): p for module in modules for p in module.parameters() if p.requires_grad}.values()
        )
        self.aside: list[torch.Tensor | None] = []

    def before(self) -> None:
        """Set the gradients the parameters have aside (by reference), so the step's start from none."""
        # FSDP2's hooks write the sharded parameters' .grad, so the step's backward runs as it is;
        # restore adds these back.
        self.aside = [parameter.grad for parameter in self.parameters]
        for parameter in self.parameters:
            parameter.grad = None

    def micro_batch(self, last: bool) -> None:
        """Reduce-scatter the gradients after this micro-batch's backward only if it is the last."""
        for root in self.roots:
            root.set_requires_gradient_sync(last)  # type: ignore[operator]

    def undo(self) -> None:
        """After an attempt that failed on some rank: its gradients dropped, gradient sync back on."""
        if self.alone:
            reset(self.sharded)
        for parameter in self.parameters:
            parameter.grad = None
        for root in self.roots:
            root.set_requires_gradient_sync(True)  # type: ignore[operator]

    def restore(self) -> None:
        """After the step: add the gradients set aside back, in place, as a backward adds into ``.grad``."""
        aside, self.aside = self.aside, []
        for parameter, before in zip(self.parameters, aside, strict=True):
            if before is None:
                continue
            if parameter.grad is not None:
                before.add_(parameter.grad)
            parameter.grad = before

    def give_back(self) -> None:
        """After a step that raised: the gradients set aside, as they were."""
        self.undo()
        aside, self.aside = self.aside, []
        for parameter, before in zip(self.parameters, aside, strict=True):
            parameter.grad = before


def reset(modules: Iterable[torch.nn.Module]) -> None:
    """Put FSDP2 modules back to what a new forward expects, resharded, after an attempt that failed."""
    modules = [module for module in modules if is_fsdp2(module)]
    for module in modules:
        _reset(module)
    for module in modules:
        module.reshard()  # type: ignore[operator]


def _reset(module: torch.nn.Module) -> None:
    """Put one FSDP2 module's private state back to what a new forward expects."""
    # FSDP2 has no public way to abandon a forward or a backward part-way. tests/test_fsdp.py pins every
    # attribute read here, so that a PyTorch that renames one fails there first.
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    state = state_of(module)
    for group in param_groups(module):
        # An all-gather issued (a prefetch, say) before the attempt was abandoned: wait for it,
        # so that every rank has finished it, then drop its buffers.
        result = group._all_gather_result
        if result is not None and result.all_gather_work is not None:
            result.all_gather_work.wait()
        group._all_gather_result = None
        group._training_state = TrainingState.IDLE
        group._post_reduce_event = None
        group._partial_reduce_output = None
        group._all_reduce_state = None
        for fsdp_param in group.fsdp_params:
            # The gradients the attempt accumulated unsharded (gradient sync off).
            fsdp_param.unsharded_accumulated_grad = None
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:
                unsharded.grad = None
    state._training_state = TrainingState.IDLE
    state._modules_to_run_forward.clear()
    context, comms = state._state_ctx, state._comm_ctx
    context.iter_forward_root = None
    context.post_backward_final_callback_queued = False
    comms.all_gather_state = None
    comms.post_forward_order.clear()
    if hasattr(comms, "reduce_scatter_states"):  # torch 2.13: the inputs kept in flight
        comms.reduce_scatter_states.clear()
    else:  # torch 2.11: the one kept
        comms.reduce_scatter_state = None
