"""Steps over FSDP2 modules (``fully_shard``): a rank that fails plays along the others' collectives, then all agree.

A rank that runs out of memory between two FSDP2 collectives (all-gathers, reduce-scatters) never makes
the next, and the others would wait in it forever. FSDP2's collectives come from the parameters, not the
data: a micro-batch makes the same ones, in the same order, on every rank and in every micro-batch of its
kind. So the first micro-batch of each kind runs with an exchange (:meth:`Agreement.heard_of_failure`)
before each collective, and its collectives are recorded once every rank got through it. After that, a
rank that fails makes the rest of its micro-batch's recorded collectives with buffers of zeros, and the
ranks agree once, as the next micro-batch begins or after the attempt. Collectives of a group match in
the order they are issued, so every rank leaves having made the same ones.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, TypeVar

import torch

from koila_retry._common.tensors import set_grads
from koila_retry._common.units import format_bytes
from koila_retry._core import distributed, memory
from koila_retry._core.aside import SetAside
from koila_retry._core.detect import is_oom

__all__ = [
    "ShardedStep",
    "Shards",
    "as_sharded",
    "check_mesh",
    "check_state",
    "fsdp_modules",
    "is_fsdp2",
    "is_fsdp_hook",
    "managed",
    "param_groups",
    "play",
    "reset",
    "state_of",
]

if distributed.AVAILABLE:
    import torch.distributed as dist

_T = TypeVar("_T", bound=torch.Tensor)
# What FSDP2 holds unsharded from a backward with gradient sync off: (FSDPParam, its unsharded parameter's
# .grad, its unsharded_accumulated_grad).
_Held = list[tuple[Any, torch.Tensor | None, torch.Tensor | None]]


class _Armed:
    """The shards of the call running in this process, or None: FSDP2's collectives report to them."""

    # One for the process, not per thread: autograd runs a GPU's backward, FSDP2's hooks included, on a
    # thread of its own. Calls of one process do not overlap in a process group.
    shards: Shards | None = None


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


def roots_of(modules: Iterable[torch.nn.Module]) -> list[torch.nn.Module]:
    """Return the FSDP2 modules among ``modules`` that no other FSDP2 module among them holds."""
    sharded = fsdp_modules(modules)
    inner = {id(sub) for module in sharded for sub in module.modules() if sub is not module and is_fsdp2(sub)}
    return [module for module in sharded if id(module) not in inner]


def as_sharded(modules: Iterable[torch.nn.Module], parameters: Iterable[_T]) -> list[_T]:
    """Return ``parameters``, each once, with the unsharded ones of the FSDP2 ``modules`` replaced by their shards."""
    # A module left gathered (the root after a forward with no backward, which FSDP2 does not reshard) has
    # its unsharded parameters registered in place of the sharded ones the optimizer holds and FSDP2's
    # reduce-scatter writes.
    shards = {}
    for fsdp_param in _fsdp_params(modules):
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        if unsharded is not None:
            shards[id(unsharded)] = fsdp_param.sharded_param
    found: dict[int, _T] = {}
    for parameter in parameters:
        parameter = shards.get(id(parameter), parameter)
        found[id(parameter)] = parameter
    return list(found.values())


def _fsdp_params(modules: Iterable[torch.nn.Module]) -> list[Any]:
    """Return the FSDPParam objects (private state) of the FSDP2 modules among ``modules``."""
    return [param for module in fsdp_modules(modules) for group in param_groups(module) for param in group.fsdp_params]


def managed(modules: Iterable[torch.nn.Module]) -> set[int]:
    """Return the ids of the parameters ``fully_shard`` manages in the FSDP2 modules among ``modules``."""
    # The sharded parameters, and the unsharded ones that stand in their place in a module left gathered.
    found = (
        getattr(param, name, None) for param in _fsdp_params(modules) for name in ("sharded_param", "_unsharded_param")
    )
    return {id(parameter) for parameter in found if parameter is not None}


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


# The private state of FSDP2 that the reset writes, the play-along and a micro-batch's kind read, as
# fully_shard makes it (FSDP2 makes its communication context, and each parameter's unsharded tensor, at
# the first forward).
_PRIVATE = {
    "FSDPState": (
        "_training_state",
        "_modules_to_run_forward",
        "_state_ctx",
        "_comm_ctx",
        "_states_to_forward_prefetch",
        "_states_to_backward_prefetch",
        "_is_root",
    ),
    "FSDPStateContext": ("iter_forward_root", "post_backward_final_callback_queued", "is_last_backward"),
    "FSDPParamGroup": (
        "_all_gather_result",
        "_post_reduce_event",
        "_partial_reduce_output",
        "_all_reduce_state",
        "_all_gather_comm",
        "_reduce_scatter_comm",
        "_training_state",
        "_sharded_state",
        "fsdp_params",
        "reduce_grads",
        "reshard_after_backward",
        "post_forward_mesh_info",
        "unshard_in_backward",
        "_all_reduce_hook",
        "mesh_info",
    ),
    "FSDPParam": ("unsharded_accumulated_grad",),
}


def check_state(module: torch.nn.Module, front_end: str) -> None:
    """Refuse an FSDP2 module whose private state lacks what the play-along and the reset need (another torch)."""
    state = state_of(module)
    owners = {"FSDPState": [state], "FSDPStateContext": [state._state_ctx], "FSDPParamGroup": param_groups(module)}
    owners["FSDPParam"] = [group.fsdp_params[0] for group in owners["FSDPParamGroup"] if group.fsdp_params]
    missing = [
        f"{kind}.{name}"
        for kind, names in _PRIVATE.items()
        for owner in owners[kind][:1]
        for name in names
        if not hasattr(owner, name)
    ]
    if missing:
        raise NotImplementedError(
            f"{front_end} found {type(module).__name__} sharded with FSDP2 by torch {torch.__version__}, whose "
            f"private state lacks {', '.join(missing)}: koila-retry reads that state to know FSDP2's collectives, "
            "and puts FSDP2 back through it after an out-of-memory error, and cannot here. Use a torch release "
            "whose FSDP2 has it (2.13 has), or pass sync=False and choose a size that fits on every rank"
        )


class _Collective(NamedTuple):
    """One FSDP2 collective as a micro-batch made it: what a rank that failed makes again to play along."""

    gather: bool  # an all-gather, else a reduce-scatter
    output: int
    input: int
    dtype: torch.dtype
    device: torch.device
    group: weakref.ref[Any]
    op: Any

    def play(self) -> None:
        """Make this collective with zeros: the others' results are thrown away with their attempt."""
        group = self.group()
        if group is None:  # the module is gone, and its collectives with it
            return
        source = torch.zeros(self.input, dtype=self.dtype, device=self.device)
        target = torch.empty(self.output, dtype=self.dtype, device=self.device)
        if self.gather:
            _all_gather()(target, source, group=group)
        else:
            _reduce_scatter()(target, source, op=self.op, group=group)


def play(collectives: Sequence[_Collective]) -> None:
    """Make the collectives with zeros; an out-of-memory error on the way gets a note that the others now wait."""
    try:
        for collective in collectives:
            collective.play()
    except BaseException as error:
        if is_oom(error) and hasattr(error, "add_note"):  # Python 3.11 on
            largest = max(collective.output * collective.dtype.itemsize for collective in collectives)
            error.add_note(
                f"koila-retry: this rank ran out of memory again while it played along the other ranks' "
                f"{len(collectives)} remaining FSDP2 collectives (the largest buffer {format_bytes(largest)}): the "
                "other ranks wait in their collective until the process group's timeout. A rank needs room for "
                "one collective's buffers beside what the failed attempt left (docs/distributed.rst)."
            )
        raise


# torch 2.13 renamed the single-tensor collectives; the old names warn (FutureWarning) there.
@functools.cache
def _all_gather() -> Any:
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@functools.cache
def _reduce_scatter() -> Any:
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# FSDP2's own comm objects, whose collectives a plain torch.distributed call matches; a custom
# one (set_custom_all_gather) may make others, so micro-batches that use one keep the vote.
_PLAIN = {"DefaultAllGather", "DefaultReduceScatter", "ProcessGroupAllocAllGather", "ProcessGroupAllocReduceScatter"}
_NAMES = ("output_tensor", "input_tensor", "group", "op")


class _Watched:
    """An FSDP2 collective that reports to the running call's shards, after an exchange while they vote."""

    def __init__(self, comm: Any, gather: bool, group: Any = None) -> None:
        self.comm, self.gather, self.group = comm, gather, group
        self.plain = _plain(comm)

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        tensor: torch.Tensor = self.comm.allocate(size, dtype=dtype, device=device)
        return tensor

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        shards = _armed.shards
        if shards is None:
            return self.comm(*args, **kwargs)
        recording = shards.recording
        if recording is not None or shards.kind is None:  # unrecorded, or outside any micro-batch (an inner module
            # called alone): a rank that fails could not play it. FSDP allocated the collective's buffers (allocate)
            # before this, and nothing between the exchange and the collective: a rank cannot run out of memory
            # after saying it had not.
            shards.vote()
        result = self.comm(*args, **kwargs)
        shards.count += 1
        if recording is not None:
            recording.append(self._described(args, kwargs) if self._playable() else None)
        return result

    def _playable(self) -> bool:
        # An all-reduce hook of the user's (set_all_reduce_hook) runs after the group's reduce-scatter and may
        # make collectives of its own, which no record holds: that kind keeps the vote, as a custom comm's.
        return self.plain and (self.gather or getattr(self.group, "_all_reduce_hook", None) is None)

    def _described(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Collective:
        values = dict(zip(_NAMES, args)) | kwargs  # FSDP2 passes keywords; an older one may not
        output, source = values["output_tensor"], values["input_tensor"]
        return _Collective(
            self.gather,
            *(output.numel(), source.numel(), source.dtype, source.device),
            weakref.ref(values["group"]),
            values.get("op"),
        )


def _plain(comm: Any) -> bool:
    """Return whether a comm (watched or not) makes only the collectives a plain torch.distributed call matches."""
    return comm.plain if isinstance(comm, _Watched) else type(comm).__name__ in _PLAIN


# Private: FSDPParamGroup._all_gather_comm and _reduce_scatter_comm, the comm objects that
# set_custom_all_gather and set_custom_reduce_scatter (public) replace; a custom comm of the user's is kept
# behind the watch.
_COMMS = (("_all_gather_comm", True), ("_reduce_scatter_comm", False))
_Put = list[tuple[Any, str, _Watched]]


def _watch(groups: list[Any]) -> _Put:
    """Put a watching comm in front of each of the groups' FSDP2 collectives that has none; return those put."""
    put = []
    for group in groups:
        for name, gather in _COMMS:
            comm = getattr(group, name)
            if not isinstance(comm, _Watched):  # else watched by a call this one runs inside
                watched = _Watched(comm, gather, group)
                setattr(group, name, watched)
                put.append((group, name, watched))
    return put


def _unwatch(put: _Put) -> None:
    """Put back the comms :func:`_watch` watched: FSDP2's own setters refuse a comm of a type they do not know."""
    for group, name, watched in put:
        if getattr(group, name) is watched:  # else replaced since, and the new comm is the user's
            setattr(group, name, watched.comm)


# The roots whose forward begins a micro-batch of the forward front ends: hooked once, for good.
_hooked: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def _root_forward(module: torch.nn.Module, args: Any) -> None:
    """Before FSDP2's own pre-forward (its all-gather): a micro-batch of a call that is not a training step begins."""
    shards = _armed.shards
    if shards is not None and not shards.steps:
        shards.micro_batch("forward", exchange=True, root=module)


# What the calls over a model recorded, by its first root: a micro-batch kind's collectives, in order.
# By model, not by wrapper: chunked() and attempts() make a wrapper per call.
_schedules: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple[Any, ...], list[_Collective]]] = (
    weakref.WeakKeyDictionary()
)


class Shards:
    """The FSDP2 modules a call reaches, under the call's agreement: what its attempts arm, play along and reset.

    A micro-batch starts at :meth:`micro_batch`: a training step's (``accumulate``), or a root's forward
    otherwise. Its kind is the front end's and FSDP2's switches that change its collectives.
    """

    __slots__ = (
        "agreement",
        "count",
        "groups",
        "hooks",
        "kept",
        "kind",
        "lazy",
        "modules",
        "params",
        "previous",
        "put",
        "recording",
        "roots",
        "schedules",
        "source",
        "states",
        "steps",
    )

    def __init__(self, modules: list[torch.nn.Module], agreement: distributed.Agreement, source: object = None) -> None:
        self.modules, self.agreement, self.source = modules, agreement, source
        self.previous: Shards | None = None
        roots = roots_of(modules)
        self.schedules = _schedules.setdefault(roots[0], {})
        self.roots = tuple(id(root) for root in roots)
        self.groups = [group for module in modules for group in param_groups(module)]
        self.states = [state_of(module) for module in modules]
        self.params = [param for group in self.groups for param in group.fsdp_params]
        self.put: _Put = []  # the watching comms an attempt put in front of FSDP2's (see arm)
        # What FSDP2 held unsharded as the attempt began (a backward of the caller's own, gradient sync off),
        # and the hooks that make a backward of the attempt add onto copies of it (see arm).
        self.kept: _Held = []
        self.hooks: list[Any] = []
        self.kind: tuple[Any, ...] | None = None  # the micro-batch running, if any
        self.count = 0  # the collectives it made
        self.recording: list[_Collective | None] | None = None  # while it votes: what it made
        self.steps = False
        self.lazy = True  # until a micro-batch finds FSDP2's lazy init done (see micro_batch)
        for root in roots:
            if root not in _hooked:
                # prepend: before FSDP2's pre-forward, registered as fully_shard ran.
                root.register_forward_pre_hook(_root_forward, prepend=True)
                _hooked.add(root)

    def arm(self) -> None:
        """From now until :meth:`disarm`, the modules' collectives report to these shards."""
        self.previous, _armed.shards = _armed.shards, self
        self.kind, self.recording, self.steps = None, None, False
        self.put = _watch(self.groups)
        # A failed attempt's reset drops what is unsharded and puts back what was there before it. A backward
        # inside the attempt (a function that trains, under batch or attempts) adds into those tensors in
        # place, autograd into .grad and FSDP2 into unsharded_accumulated_grad: each is copied as its
        # parameter's first gradient of the attempt arrives, and only then, so the tensors stay as found.
        self.kept = _held_of(self.params)
        self.hooks = [
            fsdp_param._unsharded_param.register_hook(functools.partial(_copy_before_adding, fsdp_param, grad, summed))
            for fsdp_param, grad, summed in self.kept
            if fsdp_param._unsharded_param.requires_grad
        ]

    def disarm(self) -> None:
        """Stop the reports :meth:`arm` began, at the end of the attempt's block."""
        _armed.shards, self.previous = self.previous, None
        self._unhook()
        put, self.put = self.put, []
        _unwatch(put)

    def _unhook(self) -> None:
        hooks, self.hooks = self.hooks, []
        for hook in hooks:
            hook.remove()

    def succeeded(self) -> None:
        """After an attempt that succeeded on every rank: what it found unsharded is the caller's again."""
        self.settled()
        self.kept = []

    def vote(self) -> None:
        """Make the exchange after an attempt now, inside it; raise ``RanksFailed`` if a rank failed."""
        self.agreement.check_others(sharded=True)

    def micro_batch(self, front: str, exchange: bool, root: torch.nn.Module | None = None) -> None:
        """Begin a micro-batch (at ``root``'s forward, if given); with ``exchange``, agree that none failed yet."""
        if exchange:
            self.vote()
        self.settled()
        if front == "step" and self.kept:  # a step adds onto copies of its own (see ShardedStep), dropped whole
            self._unhook()
            self.kept = []
        # What changes FSDP2's collectives makes another kind: its switches and state (see _switches), where it
        # reshards after the forward, and its modules' explicit prefetching; and the root whose forward began it,
        # where a call runs several models (a draft's and a target's forwards); and whose call it is (its
        # function's name and code): two steps over one model, Lightning's validation_step and predict_step
        # say, make collectives of their own. FSDP2's lazy init, at a root's first forward, stops resharding
        # that root after its forward: the micro-batch that runs it is recorded as those after it find FSDP2.
        self.lazy = self.lazy and any(state._is_root is None for state in self.states)
        resharded = tuple(map(_size_after_forward, self.groups))
        root_id = None if root is None else id(root)
        switches, ordered = tuple(map(_switches, self.groups)), _ordered(self.states)
        kind = (front, torch.is_grad_enabled(), self.roots, switches, resharded, ordered, root_id, self.source)
        self.kind = kind
        self.count = 0
        self.recording = [] if kind not in self.schedules else None

    def settled(self) -> None:
        """The micro-batch that ran got through on every rank: record its collectives, or check their number."""
        kind, recording = self.kind, self.recording
        if kind is None:
            return
        self.kind = None
        if recording is not None:
            if None not in recording:  # a custom comm's collectives are not played: its kind keeps the vote
                if self.lazy:  # where the micro-batches after it find the root resharding (see micro_batch)
                    kind = (*kind[:4], tuple(map(_size_after_forward, self.groups)), *kind[5:])
                self.schedules[kind] = recording  # type: ignore[assignment]
        elif self.count != len(self.schedules[kind]):
            del self.schedules[kind]  # the model's collectives changed: record them again, under the vote

    def play_along(self) -> None:
        """On a rank that failed: FSDP2 back to idle, then the rest of its micro-batch's collectives, with zeros."""
        reset(self.modules, self.kept)
        kind, self.kind = self.kind, None
        if kind is None or self.recording is not None:
            return  # between micro-batches, or voting: the others learn of it at their next exchange
        rest = self.schedules[kind][self.count :]
        if rest:
            # The failed attempt's frames may hold its tensors in reference cycles, and its backward its graph
            # in the autograd engine's queue: the engine releases them after the ranks agree, too late for the
            # buffers played with.
            memory.collect()
        play(rest)

    def reset(self) -> None:
        """After an attempt that failed on some rank: every module back to idle, resharded, as the attempt found it."""
        reset(self.modules, self.kept)


class ShardedStep(SetAside):
    """What a training step over FSDP2 modules (``accumulate``) does about the gradients of all they reach."""

    def __init__(self, modules: list[torch.nn.Module], alone: bool = False) -> None:
        # Every module the step reaches: FSDP2's hooks write the sharded parameters' .grad, a plain
        # backward the others'.
        self.sharded = fsdp_modules(modules)
        reached: list[torch.Tensor] = [p for module in modules for p in module.parameters() if p.requires_grad]
        super().__init__(as_sharded(self.sharded, reached))
        # alone (one rank, or sync=False): no agreement resets FSDP2 state after a failure, so undo does.
        self.alone = alone
        self.roots = roots_of(self.sharded)
        # What a backward of the caller's own with gradient sync off left unsharded. Each attempt adds onto
        # copies, since a failed one's reset drops them: the one buffer the exact rollback costs, and only
        # where such gradients are.
        self.unsharded: _Held = []
        # Gradient sync as the step found it, per parameter group (the caller may have set it on some modules
        # only): the step syncs, then puts it back.
        self.groups = [group for module in self.sharded for group in param_groups(module)]
        self.syncs: list[tuple[Any, bool, bool | None]] = []

    def before(self) -> None:
        """Set the gradients aside: the parameters', and what FSDP2 holds unsharded from the caller's backward."""
        super().before()
        self.unsharded = _held_unsharded(self.sharded)
        self.syncs = [(group, group.reduce_grads, getattr(group, "all_reduce_grads", None)) for group in self.groups]

    def accumulated(self) -> list[torch.Tensor]:
        """Return the parameters, and the unsharded ones FSDP2 backpropagates into (it clears those)."""
        unsharded = (getattr(fsdp_param, "_unsharded_param", None) for fsdp_param in _fsdp_params(self.sharded))
        return [*super().accumulated(), *(leaf for leaf in unsharded if leaf is not None)]

    def micro_batch(self, last: bool, first: bool) -> None:
        """Begin a micro-batch: its gradients reduce-scattered after its backward only if it is the last."""
        if first and self.unsharded:
            self._put_back(copy=False)  # as the micro-batch will find them, for its kind; nothing allocated yet
        for root in self.roots:
            root.set_requires_gradient_sync(last)  # type: ignore[operator]
        shards = _armed.shards
        if shards is not None:  # under agreement: the ranks agree that the one before got through
            shards.steps = True
            shards.micro_batch("step", exchange=not first)
        if first and self.unsharded:
            # The copies the attempt adds onto, made inside the micro-batch: a rank that cannot make them
            # plays all its collectives along, where the others make them without a vote.
            self._put_back(copy=True)

    def undo(self) -> None:
        """After an attempt that failed on some rank: its gradients dropped, gradient sync back on."""
        if self.alone:
            reset(self.sharded)
        super().undo()
        for root in self.roots:
            root.set_requires_gradient_sync(True)  # type: ignore[operator]

    def restore(self) -> None:
        """After the step: the parameters' gradients set aside added back (the unsharded ones went into the step's)."""
        self.unsharded = []
        super().restore()
        _put_syncs(self.syncs)

    def give_back(self) -> None:
        """After a step that raised: every gradient set aside as it was, the unsharded ones included."""
        super().give_back()
        self._put_back(copy=False)
        self.unsharded = []
        _put_syncs(self.syncs)

    def _put_back(self, copy: bool) -> None:
        _hand_back(self.unsharded, copy)


def _put_syncs(syncs: list[tuple[Any, bool, bool | None]]) -> None:
    """Put back what set_requires_gradient_sync wrote: each group's reduce_grads and all_reduce_grads (private)."""
    for group, reduce, all_reduce in syncs:
        group.reduce_grads = reduce
        if all_reduce is not None:
            group.all_reduce_grads = all_reduce


def _held_unsharded(modules: Iterable[torch.nn.Module]) -> _Held:
    """Return what the FSDP2 modules hold unsharded: (FSDPParam, its unsharded .grad, unsharded_accumulated_grad)."""
    return _held_of(_fsdp_params(modules))


def _held_of(fsdp_params: Iterable[Any]) -> _Held:
    """Return what these FSDPParams hold unsharded, as :func:`_held_unsharded` does."""
    # A loop, not comprehensions: it runs as every attempt of a call over FSDP2 modules begins.
    held = []
    for param in fsdp_params:
        summed = param.unsharded_accumulated_grad
        unsharded = getattr(param, "_unsharded_param", None)
        grad = None if unsharded is None else unsharded.grad
        if grad is not None or summed is not None:
            held.append((param, grad, summed))
    return held


def _copy_before_adding(
    fsdp_param: Any, grad: torch.Tensor | None, summed: torch.Tensor | None, incoming: torch.Tensor
) -> None:
    """Before a backward adds into what FSDP2 held unsharded as the attempt began: swap in copies, once."""
    unsharded = fsdp_param._unsharded_param
    if grad is not None and unsharded.grad is grad:
        unsharded.grad = grad.clone()
    if summed is not None and fsdp_param.unsharded_accumulated_grad is summed:
        fsdp_param.unsharded_accumulated_grad = summed.clone()


def _hand_back(held: _Held, copy: bool) -> None:
    """Put what :func:`_held_unsharded` returned back on FSDP2's unsharded parameters, or copies of it."""

    def kept(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return tensor.clone() if copy and tensor is not None else tensor

    for fsdp_param, grad, accumulated in held:
        fsdp_param._unsharded_param.grad = kept(grad)
        fsdp_param.unsharded_accumulated_grad = kept(accumulated)


def _switches(group: Any) -> tuple[Any, ...]:
    """Return what of an FSDP2 parameter group's switches and state decides the collectives a micro-batch makes."""
    # Private state, as FSDPModule's setters write it (gradient sync, resharding after the forward and after
    # the backward, unsharding in the backward, custom comms, an all-reduce hook, reduce-scattering unused
    # parameters, the reduce operation, a reduce-scatter group of its own), and as a micro-batch finds it:
    # groups gathered already (a root after a forward without backward) or with an all-gather in flight, and
    # gradients accumulated unsharded (a block used twice reduce-scatters once more after those). Switches a
    # torch before 2.13 lacks read as their default.
    return (
        group.reduce_grads,
        group.reshard_after_backward,
        group.unshard_in_backward,
        _plain(group._all_gather_comm),
        _plain(group._reduce_scatter_comm),
        group._all_reduce_hook is not None,
        getattr(group, "reduce_scatter_unused_params", False),
        getattr(group, "gradient_divide_factor", None),
        getattr(group, "force_sum_reduction_for_comms", False),
        # By name, given alike on every rank: the ranks must find a kind recorded, or not, alike.
        getattr(getattr(group.mesh_info, "reduce_scatter_process_group", None), "group_name", None),
        group._sharded_state,
        group._all_gather_result is not None,
        _accumulated(group),
    )


def _ordered(states: list[Any]) -> tuple[Any, ...]:
    """Return what orders the collectives of the FSDP2 states set by hand: explicit prefetching, last backward."""
    # Private: what set_modules_to_forward_prefetch, set_modules_to_backward_prefetch and
    # set_is_last_backward (the end of a last backward finishes all-gathers prefetched for nothing) write.
    found = [
        (index, state)
        for index, state in enumerate(states)
        if state._states_to_forward_prefetch
        or state._states_to_backward_prefetch
        or not state._state_ctx.is_last_backward
    ]
    if not found:
        return ()
    # The modules prefetched by their places among the call's, not by id: the ranks must find a kind
    # recorded, or not, alike.
    places = {id(state): index for index, state in enumerate(states)}
    return tuple(
        (
            index,
            tuple(places.get(id(other), -1) for other in state._states_to_forward_prefetch),
            tuple(places.get(id(other), -1) for other in state._states_to_backward_prefetch),
            state._state_ctx.is_last_backward,
        )
        for index, state in found
    )


def _size_after_forward(group: Any) -> int | None:
    """Return how many ranks an FSDP2 group reshards its parameters over after its forward; None: kept gathered."""
    after = group.post_forward_mesh_info
    return None if after is None else int(after.shard_mesh_size)


def _accumulated(group: Any) -> bool:
    """Return whether an FSDP2 parameter group holds gradients accumulated unsharded, with gradient sync off."""
    return any(
        _unsharded_grad(fsdp_param) is not None or fsdp_param.unsharded_accumulated_grad is not None
        for fsdp_param in group.fsdp_params
    )


def _unsharded_grad(fsdp_param: Any) -> torch.Tensor | None:
    """Return the gradient on an FSDPParam's unsharded parameter (private), if it has one."""
    unsharded = getattr(fsdp_param, "_unsharded_param", None)
    return None if unsharded is None else unsharded.grad


def reset(modules: Iterable[torch.nn.Module], kept: _Held | None = None) -> None:
    """Put FSDP2 modules back to what a new forward expects, resharded, after an attempt that failed.

    Every unsharded gradient is dropped, the failed attempt's with the rest; ``kept``, what the modules held
    unsharded as the attempt began (a backward of the caller's own, gradient sync off), is put back. Its
    tensors are as found: the attempt added onto copies of them (see Shards.arm, ShardedStep).
    """
    modules = fsdp_modules(modules)
    for module in modules:
        _reset(module)
    for module in modules:
        module.reshard()  # type: ignore[operator]
        for group in param_groups(module):
            # A group whose all-gather ran out of memory part-way through allocating its outputs stays
            # sharded, and the reshard frees nothing of it: the outputs made before would stay alive.
            if group._sharded_state.name == "SHARDED":
                for fsdp_param in group.fsdp_params:
                    fsdp_param.free_unsharded_param()
    _hand_back(kept or [], copy=False)


def _reset(module: torch.nn.Module) -> None:
    """Put one FSDP2 module's private state back to what a new forward expects."""
    # FSDP2 has no public way to abandon a forward or a backward part-way. tests/test_fsdp.py pins every
    # attribute read here, so that a PyTorch that renames one fails there first.
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    state = state_of(module)
    unsharded_params = []
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
                unsharded_params.append(unsharded)
    set_grads((unsharded, None) for unsharded in unsharded_params)
    state._training_state = TrainingState.IDLE
    state._modules_to_run_forward.clear()
    context, comms = state._state_ctx, state._comm_ctx
    context.iter_forward_root = None
    context.post_backward_final_callback_queued = False
    if not hasattr(comms, "post_forward_order"):  # made at the root's first forward: an attempt failed before
        return
    comms.all_gather_state = None
    comms.post_forward_order.clear()
    if hasattr(comms, "reduce_scatter_states"):  # torch 2.13: the inputs kept in flight
        comms.reduce_scatter_states.clear()
    else:  # torch 2.11: the one kept
        comms.reduce_scatter_state = None
