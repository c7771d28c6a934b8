"""Agreement across the ranks of a ``torch.distributed`` job: ranks try the same sizes and leave together.

Every collective here runs outside any ``except`` block, on a tensor made before the attempt, so that a
rank that just ran out of memory neither keeps the failed attempt alive while it waits nor needs fresh
memory to take part. A call agrees before its first attempt (the smallest start, and a floor: the largest
minimum) and after every attempt (whether a rank failed, and the size all try next).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from koila_retry._common.walk import reachable

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

__all__ = [
    "Agreement",
    "GradientSync",
    "RanksFailed",
    "agreement",
    "broadcast_before_inference",
    "check_group",
    "check_norms",
    "check_sync",
    "ddp_modules",
    "given_ddp",
    "is_running",
    "joined",
    "modules_of",
    "supported_modules",
    "synced_norms",
]

AVAILABLE = torch.distributed.is_available()
if AVAILABLE:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

_CPU = torch.device("cpu")
_NEUTRAL = 2**62  # what an unused place of an exchange holds: no rank's value is above it
# Where a rank makes the exchange of an attempt's outcome: inside it (Agreement.check_others), or after it.
_INSIDE_SHARDED, _INSIDE, _FAILED, _SUCCEEDED = 0, 1, 2, 3  # inside: at an FSDP2 micro-batch, or after DDP's


# dist.is_initialized() and dist.group.WORLD read a property through a metaclass (~0.3 us),
# which every call of a decorated function would pay; the attribute behind them is read
# directly when torch has it.
world = getattr(distributed_c10d, "_world", None) if AVAILABLE else None
FAST = world is not None and hasattr(world, "_default_pg")


def is_running() -> bool:
    """Return whether a default process group is initialized (FSDP2 needs one)."""
    if not AVAILABLE:
        return False
    default = world._default_pg if FAST else dist.group.WORLD  # type: ignore[union-attr]
    return default is not None


def check_sync(sync: object) -> None:
    """Refuse a ``sync`` option that is not ``None`` or a bool."""
    if sync is not None and not isinstance(sync, bool):
        raise TypeError(f"sync must be True, False or None (agree when a process group is running), got {sync!r}")


def _outside(group: object) -> bool:
    """Return whether ``group`` is what ``dist.new_group()`` gives a rank it left out."""
    return AVAILABLE and isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER


def check_group(group: object) -> None:
    """Refuse a ``group`` option that is not ``None`` or a process group."""
    if group is not None and not _outside(group) and not (AVAILABLE and isinstance(group, dist.ProcessGroup)):
        raise TypeError(
            f"group must be a torch.distributed process group (from dist.new_group()) or None, "
            f"got {type(group).__name__} {group!r}"
        )


def agreement(sync: bool | None, group: Any) -> Agreement | None:
    """Return the agreement one call needs, or ``None`` if it runs alone (``sync=None``: fewer than 2 ranks)."""
    default = world._default_pg if FAST else dist.group.WORLD if AVAILABLE else None  # type: ignore[union-attr]
    if default is None:
        if sync:
            raise RuntimeError(
                "sync=True needs torch.distributed: call torch.distributed.init_process_group() first "
                "(torchrun sets up what it needs), or pass sync=None to agree only when it is running"
            )
        return None
    if group is not None and _outside(group):  # dist.new_group() left this rank out: it runs alone
        if sync:
            raise RuntimeError(
                f"sync=True with a group that this rank (global rank {dist.get_rank()}) is not a member of: "
                "nothing to agree with. Pass sync=None to run alone on the ranks outside the group"
            )
        return None
    key = default if group is None else group
    made = _agreements.get(key)
    if made is None:
        if len(_agreements) >= 8:  # groups destroyed and made again: keep only the recent ones
            _agreements.clear()
        made = _agreements[key] = Agreement(group)
    if sync is None and made.world_size < 2:
        return None
    return made


# One agreement per process group, made at its first call (~10 us) and reused: calls of one
# process do not overlap in a group, whose collectives must be issued in one order anyway.
# Weakly keyed, and the agreement holds its group weakly: a group that destroy_process_group()
# let go must be freed, since only its destructor stops gloo's threads, and one of them
# releasing a collective's tensors while the interpreter exits aborts the process.
_agreements: weakref.WeakKeyDictionary[Any, Agreement] = weakref.WeakKeyDictionary()


class RanksFailed(Exception):
    """Another rank's attempt ran out of memory: raised inside this rank's step; the attempt catches it."""


class Agreement:
    """The collectives that agree on sizes across the ranks of ``group`` (``None``: all)."""

    __slots__ = ("_after", "_group", "_start", "rank", "settled", "world_size")

    def __init__(self, group: Any) -> None:
        rank = dist.get_rank(group)
        if rank < 0:
            raise RuntimeError(f"this process (global rank {dist.get_rank()}) is not a member of the group {group!r}")
        self._group = None if group is None else weakref.ref(group)
        self.rank = rank
        self.world_size = dist.get_world_size(group)
        # Made now, before any attempt: after an OOM there may be no memory for them. Each is
        # always reduced whole, so that no exchange slices it (slicing costs more than the fills).
        device = backend_device(group)
        self._start = _Exchange(5, device)
        self._after = _Exchange(5, device)
        # What an exchange made inside an attempt (as an FSDP2 micro-batch begins, or before a collective of a
        # kind still recorded) learned: a rank's failure, which the exchange after the attempt takes as its own.
        self.settled: tuple[int | None, int | None, bool] | None = None

    @property
    def group(self) -> Any:
        """The process group that agrees (``None`` for the default group)."""
        return None if self._group is None else self._group()

    def _minimum(self, exchange: _Exchange, *values: int) -> list[int]:
        for cell, value in zip(exchange.cells, values, strict=True):
            cell.fill_(value)
        dist.all_reduce(exchange.buffer, op=dist.ReduceOp.MIN, group=self.group)
        return exchange.buffer.tolist()

    def start(
        self, size: int, span: int | None = None, minimum: int = 1, initial: int | None = None, whole: bool = False
    ) -> tuple[int, int]:
        """Return the smallest start over the ranks and the floor, their largest ``minimum``, in one collective."""
        # The spans (rows a run covers) and initials ride in the same exchange, so that every rank refuses
        # a mismatch alike; the floor keeps any rank from trying a size another rank's minimum forbids.
        # A rank whose start runs its whole batch (whole) holds no other rank to its rows, which may be
        # fewer: when every rank's does, each runs its own whole batch. It still takes another rank's smaller
        # start: after a forward that no backward followed, DDP syncs in a split rank's first backward and
        # at a whole one's end, and ranks that split unlike each other would agree out of step.
        ceiling = _NEUTRAL if initial is None else initial
        spans = (_NEUTRAL, _NEUTRAL) if span is None else (span, -span)
        agreed, fewest, most, floor, lowest = self._minimum(
            self._start, _NEUTRAL if whole else size, *spans, -minimum, ceiling
        )
        if agreed == _NEUTRAL:
            agreed = size
        floor = -floor
        if span is not None and fewest != -most:
            raise ValueError(
                f"ranks agreeing on a chunk size, or on a micro-batch size over FSDP2, must cover the same number "
                f"of rows or indices, so that they run the same chunks or micro-batches (and FSDP2 the same "
                f"collectives): this rank has {span}, and the ranks have from {fewest} to {-most}. "
                "Pad the inputs to the same length (DistributedSampler does, unless drop_last=True); for "
                "chunks of a model that is not sharded, sync=False lets each rank choose alone"
            )
        if floor > lowest:
            raise ValueError(
                f"ranks agreeing on a batch size must allow a size that suits every rank: the largest minimum "
                f"of the ranks ({floor}) exceeds their smallest initial ({lowest}); this rank has "
                f"minimum={minimum} and initial={initial}. Give every rank the same minimum and initial, or "
                "pass sync=False to let each rank choose alone"
            )
        return agreed, floor

    def check_others(self, sharded: bool = False) -> None:
        """Make :meth:`after`'s exchange inside an attempt: as an FSDP2 micro-batch begins, or after DDP's buckets.

        Raises:
            RanksFailed: if another rank's attempt failed; every rank then abandons the attempt.
        """
        # A rank that failed makes its exchange after its attempt (after playing along); the others meet
        # it here, at their next exchange inside the attempt, and keep what it said in settled.
        result = self.after(False, None, inside=_INSIDE_SHARDED if sharded else _INSIDE)
        if result[0] is not None:
            self.settled = result
            raise RanksFailed(f"rank {result[0]} ran out of memory; every rank abandons the attempt together")

    def after(
        self, failed: bool, next_size: int | None, vote: bool = True, inside: int | None = None
    ) -> tuple[int | None, int | None, bool]:
        """Exchange an attempt's outcome: the lowest failed rank, the size all try next, whether all voted yes.

        Raises:
            RuntimeError: if a rank made this exchange inside its attempt (``inside``) while another made it
                after an attempt that succeeded: their collectives went out of step (every rank raises).
        """
        if self.settled is not None:  # made inside the attempt already
            settled, self.settled = self.settled, None
            return settled
        # A rank whose attempt worked says nothing about the next size: fewer rows of its
        # own (a short last micro-batch) must not hold back the ranks that failed.
        proposal = (next_size or 0) if failed else _NEUTRAL
        # Inside an attempt, a rank meets one that failed and agrees after it: never one whose attempt
        # succeeded, which has the same exchange to make. The lowest and highest of these tell.
        kind = inside if inside is not None else _FAILED if failed else _SUCCEEDED
        failing, agreed, votes, lowest, highest = self._minimum(
            self._after, self.rank if failed else self.world_size, proposal, int(vote), kind, -kind
        )
        if lowest == _INSIDE_SHARDED and -highest == _SUCCEEDED:
            raise RuntimeError(
                "the ranks' collectives went out of step: some ranks agreed as a micro-batch over FSDP2 modules "
                "began, while others agreed after their attempt ended: they ran different numbers of micro-batches "
                "(or chunks), from different numbers of rows. Once a call over FSDP2 modules splits, every rank "
                "must have as many rows: pad the inputs to one length (DistributedSampler does, unless "
                "drop_last=True); koila.chunked checks it before it begins"
            )
        if lowest == _INSIDE and -highest == _SUCCEEDED:
            raise RuntimeError(
                "the ranks' collectives went out of step: some ranks agreed inside their attempt, after DDP "
                "all-reduced in their first backward, while others agreed after an attempt whose only "
                "backward was its last (with fewer rows, or a first micro-batch whose loss needs no "
                "gradient). DDP all-reduces in the first backward that follows a forward of the DDP module in "
                "grad mode whose output got no backward (a sample logged, say): run such forwards under "
                "torch.no_grad() or on model.module, or give every rank as many rows"
            )
        return (None if failing >= self.world_size else failing), (agreed or None), votes == 1


class _Exchange:
    """A tensor that one collective reduces whole, and a view of each of its cells to fill."""

    __slots__ = ("buffer", "cells")

    def __init__(self, size: int, device: torch.device) -> None:
        self.buffer = torch.zeros(size, dtype=torch.int64, device=device)
        self.cells = [self.buffer[index] for index in range(size)]


def backend_device(group: Any) -> torch.device:
    """Return the device a collective of ``group``'s backend takes its tensors on."""
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or backend == "mpi":  # "cpu:gloo,cuda:nccl" too: the CPU is the cheaper
        return _CPU
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        return _CPU
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


# --- what may take part ------------------------------------------------------------


def _modules(roots: Iterable[Any]) -> Iterator[torch.nn.Module]:
    """Yield every module reachable from ``roots``, and the modules inside them."""
    for value in reachable(roots):
        if isinstance(value, torch.nn.Module):
            yield from value.modules()


def modules_of(roots: Iterable[Any]) -> list[torch.nn.Module]:
    """Return every module reachable from ``roots``, and the modules inside them, each once."""
    return list({id(module): module for module in _modules(roots)}.values())


def ddp_modules(roots: Iterable[Any]) -> list[DistributedDataParallel]:
    """Return the ``DistributedDataParallel`` modules reachable from ``roots``, each once."""
    from torch.nn.parallel import DistributedDataParallel

    found = {id(module): module for module in _modules(roots) if isinstance(module, DistributedDataParallel)}
    return list(found.values())


def given_ddp(ddp: Any) -> list[Any]:
    """Check ``ddp=``: a ``DistributedDataParallel`` module, or a list or tuple of them."""
    if ddp is None:
        return []
    modules = list(ddp) if isinstance(ddp, (list, tuple)) else [ddp]
    parallel = torch.nn.parallel.DistributedDataParallel
    for module in modules:
        if not isinstance(module, parallel):
            raise TypeError(
                f"ddp must be a torch.nn.parallel.DistributedDataParallel module (the wrapped model) or a list "
                f"of them, got {type(module).__name__} {module!r:.200}"
            )
    return modules


def joined(given: list[Any], found: list[Any]) -> list[Any]:
    """Return the DDP modules ``ddp=`` gave, then those the search found that it did not give."""
    if not given:
        return found
    named = {id(module) for module in given}
    return [*given, *(module for module in found if id(module) not in named)]


def ddp_group(module: Any) -> Any:
    """Return the process group of a DDP module if it is a subgroup of the default one's ranks, else ``None``."""
    from torch.nn.parallel import DistributedDataParallel

    group = getattr(module, "process_group", None) if isinstance(module, DistributedDataParallel) else None
    if group is None or group is dist.group.WORLD or dist.get_world_size(group) == dist.get_world_size():
        return None
    return group


def supported_modules(
    roots: Iterable[Any], front_end: str, managed: Callable[[Iterable[torch.nn.Module]], set[int]]
) -> list[torch.nn.Module]:
    """Return the DDP and FSDP2 modules reachable from ``roots``; refuse the parallelisms that could hang.

    ``managed`` gives the ids of the parameters that ``fully_shard`` manages in the modules found (sharded.py's).
    """
    # FSDP1 and tensor parallelism communicate inside the forward and backward, where nothing of ours takes
    # part: a rank that runs out of memory there leaves the others in a collective it never joins. FSDP2's
    # collectives are covered (sharded.py); HSDP's all-reduce across replicas is not.
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    found: dict[int, torch.nn.Module] = {}
    sharded = False
    parallel: list[tuple[torch.nn.Module, DTensor]] = []
    for module in _modules(roots):
        if isinstance(module, FullyShardedDataParallel):
            raise NotImplementedError(
                f"{front_end} found {type(module).__name__} (FSDP1), which is not supported: it gathers and "
                "scatters parameters inside the forward and backward, so a rank that runs out of memory there "
                "would leave the others waiting in a collective. Shard with FSDP2 (torch.distributed.fsdp."
                "fully_shard), use DistributedDataParallel, or pass sync=False and choose the size yourself"
            )
        if isinstance(module, (DistributedDataParallel, FSDPModule)):
            found[id(module)] = module
            sharded = sharded or isinstance(module, FSDPModule)
        for parameter in module.parameters(recurse=False):
            if isinstance(parameter, DTensor):
                parallel.append((module, parameter))
    # Tensor parallelism beside FSDP2 modules is refused as without them: only what fully_shard manages is covered.
    owned = managed(found.values()) if sharded and parallel else set()
    for module, tensor in parallel:
        dimensions = tensor.device_mesh.ndim
        if id(tensor) in owned and dimensions > 1:
            raise NotImplementedError(
                f"{front_end} found {type(module).__name__} sharded over a {dimensions}-D mesh: HSDP (replicated "
                "and sharded) or FSDP2 with tensor parallelism, whose all-reduce across replicas or layers' "
                "collectives are not covered yet. Shard with fully_shard over a 1-D mesh, or pass sync=False and "
                "choose the size yourself"
            )
        if id(tensor) not in owned:
            raise NotImplementedError(
                f"{front_end} found DTensor parameters in {type(module).__name__} (tensor or sequence "
                "parallelism), which is not supported yet: its layers communicate inside the forward and "
                "backward, so a rank that runs out of memory there would leave the others waiting in a "
                "collective. Pass sync=False and choose the size yourself"
            )
    return list(found.values())


def broadcast_before_inference(modules: Iterable[torch.nn.Module]) -> None:
    """Make, on every rank, the buffer broadcast a DDP module makes at the start of a forward without grad."""
    # DDP broadcasts buffers before the first such forward and stops after it, in its post-forward: a rank
    # that ran out of memory in between would broadcast again at its retry, alone. Made here, before the
    # attempts, with the flag cleared as that post-forward clears it, no attempt's forward makes it.
    if torch.is_grad_enabled():
        return
    from torch.nn.parallel import DistributedDataParallel

    for module in modules:
        if not isinstance(module, DistributedDataParallel) or not getattr(module, "require_forward_param_sync", False):
            continue
        _broadcast_buffers(module)
        module.require_forward_param_sync = False


def _broadcast_buffers(module: DistributedDataParallel) -> None:
    """Make the broadcast of buffers from rank 0 that DDP makes at the start of a forward, if it makes one."""
    # Private parts of DDP, each used only if this torch has it.
    syncs = getattr(module, "forward_sync_buffers", getattr(module, "broadcast_buffers", False))
    sync_buffers = getattr(module, "_sync_buffers", None)
    if syncs and getattr(module, "modules_buffers", None) and callable(sync_buffers):
        sync_buffers()


def synced_norms(roots: Iterable[Any]) -> list[torch.nn.Module]:
    """Return the SyncBatchNorm layers reachable from ``roots`` that synchronise over more than one rank."""
    found = {}
    for module in _modules(roots):
        if isinstance(module, torch.nn.SyncBatchNorm):
            group = module.process_group or dist.group.WORLD
            if dist.get_world_size(group) > 1:
                found[id(module)] = module
    return list(found.values())


def check_norms(norms: Iterable[torch.nn.Module], front_end: str) -> None:
    """Refuse a call while a SyncBatchNorm layer it reaches trains: its collectives would hang a rank that failed."""
    # In training mode SyncBatchNorm all-gathers its statistics in every forward and all-reduces in every
    # backward, collectives that nothing of ours can play along: every rank raises alike, before any exchange.
    training = [norm for norm in norms if norm.training]
    if training:
        raise NotImplementedError(
            f"{front_end} reaches {len(training)} SyncBatchNorm layer(s) in training mode, which is not supported: "
            "they exchange statistics across the ranks inside every forward and backward, so a rank that runs "
            "out of memory there would leave the others waiting in a collective it never joins. Use BatchNorm in "
            "their place (each rank then normalises over its own micro-batches), put them in eval mode, or pass "
            "sync=False and choose a size that fits on every rank"
        )


def check_join(modules: Iterable[Any], front_end: str) -> None:
    """Refuse a call inside ``torch.distributed.algorithms.Join`` over a DDP module it reaches."""
    # Under Join every DDP forward all-reduces twice of its own (whether this rank has joined), and a rank
    # that joined shadows DDP's collectives, not the agreement: a failed rank, or a joined one, mismatches.
    joined = [module for module in modules if getattr(getattr(module, "_join_config", None), "enable", False)]
    if joined:
        raise NotImplementedError(
            f"{front_end} runs inside torch.distributed.algorithms.Join over a DistributedDataParallel module, "
            "which is not supported: under Join each DDP forward makes collectives of its own, which a rank that "
            "runs out of memory before its forward cannot make, and a rank that has joined shadows DDP's "
            "collectives, not the agreement on sizes, so the ranks' collectives no longer match (gloo aborts the "
            "process). Give every rank as many batches (DistributedSampler pads them; or drop the last ones) "
            "and leave Join out"
        )


# --- gradients of DDP modules -------------------------------------------------------


class GradientSync:
    """Average the step's gradients of DDP modules once, after the ranks agreed it succeeded everywhere."""

    # Where DDP's overlap cannot be kept (overlap.overlaps() is False: several modules, a post-accumulate-grad
    # hook, a static graph...), micro-batches run under no_sync(), and the step's own gradients (by id of
    # parameter, never .grad) are averaged here. What the all-reduce needs is made inside the attempt (prepare), so
    # that running out of memory for it is one more failure of the attempt, agreed on like any other.
    def __init__(self, modules: list[DistributedDataParallel]) -> None:
        self.modules = modules
        self._parts: list[_ModuleGradients] = []
        self.syncs = True  # gradient sync as the step found it: off inside the caller's own no_sync()
        # The step's sums that hold a gradient from before it, and that gradient (see prepare).
        self._merged: list[tuple[torch.Tensor, torch.Tensor]] = []

    def before_step(self, front_end: str) -> None:
        """Make, on every rank at once, the collectives DDP makes at the start of a forward.

        Raises:
            NotImplementedError: if a module was built with ``static_graph=True`` and has not run its first
                iteration, which DDP needs to all-reduce in its backward (every rank raises alike).
        """
        for module in self.modules:
            # Private: DDP sets it in the first backward of a static graph, which records the graph.
            if getattr(module, "static_graph", False) and not getattr(
                module, "_static_graph_delay_allreduce_enqueued", True
            ):
                raise NotImplementedError(
                    f"{front_end} trains a DistributedDataParallel module built with static_graph=True that has "
                    "not run its first iteration: DDP records a static graph from a first backward that "
                    "all-reduces, and fails with an internal assertion when that backward runs under no_sync(), as "
                    "the micro-batches of koila.accumulate do. Run one step without koila first (a forward and a "
                    "backward of the DDP module), or build DDP without static_graph=True"
                )
        # Rebuilding the buckets (after the first backward DDP synchronised) and broadcasting buffers
        # (broadcast_buffers=True): a rank that ran out of memory before its first forward would never
        # join them. Made here, before the first attempt; no_sync (or Overlap.micro_batch) keeps the forwards
        # from making them again.
        self.syncs = all(vars(module).get("require_backward_grad_sync", True) for module in self.modules)
        for module in self.modules:
            # Private parts of DDP, each used only if this torch has it.
            rebuild = getattr(getattr(module, "reducer", None), "_rebuild_buckets", None)
            if torch.is_grad_enabled() and callable(rebuild):
                rebuild()  # a no-op unless DDP is due to rebuild
            _broadcast_buffers(module)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Run the block without any of DDP's own communication: no gradient all-reduce, no buffer broadcast."""
        with contextlib.ExitStack() as stack:
            for module in self.modules:
                stack.enter_context(module.no_sync())
                module.require_forward_param_sync = False
                # As after a step DDP synchronised itself: its next forward outside koila broadcasts buffers.
                stack.callback(setattr, module, "require_forward_param_sync", True)
            yield

    @contextlib.contextmanager
    def silent(self) -> Iterator[None]:
        """Run the block with every DDP module calling the module it wraps directly, making no collectives."""
        # For initial="auto"'s estimate, which only the ranks whose cache knows no size run.
        with contextlib.ExitStack() as stack:
            for module in self.modules:
                attributes = vars(module)
                if "forward" not in attributes:
                    attributes["forward"] = module.module.forward
                    stack.callback(attributes.pop, "forward", None)
            yield

    def prepare(self, gradients: dict[int, torch.Tensor], leaves: dict[int, torch.Tensor]) -> None:
        """Make, after an attempt, what the all-reduce of ``gradients`` (by id of leaf, averaged in place) needs."""
        # A hand loop's synced backward averages all that .grad holds, a backward of the caller's own under
        # no_sync() included, and the .grad of a parameter this rank did not use: so does this all-reduce,
        # and reduce() takes it back out of the sum that delivery adds to .grad. Else one rank's own
        # gradients would stay its own, and the ranks' parameters drift apart.
        self._merged = []
        reduced = [_reduced(module) for module in self.modules]
        seen: set[int] = set()  # a parameter two modules share is summed once
        for parameters in reduced if self.syncs else ():
            for parameter in parameters:
                before = parameter.grad
                if before is None or id(parameter) in seen:
                    continue
                seen.add(id(parameter))
                total = gradients.get(id(parameter))
                if total is None:  # not used here: its .grad is this rank's part, as DDP's reducer takes it
                    total = gradients[id(parameter)] = before.clone()
                    leaves[id(parameter)] = parameter
                else:
                    total.add_(before)
                self._merged.append((total, before))
        self._parts = [
            _ModuleGradients(module, parameters, gradients, leaves)
            for module, parameters in zip(self.modules, reduced, strict=True)
        ]

    def used_everything(self) -> bool:
        """Return whether this rank's step wrote a gradient for every parameter (after :meth:`prepare`)."""
        return all(all(part.mine) for part in self._parts)

    def reduce(self, used_everywhere: bool = False) -> None:
        """All-reduce and average the step's gradients, where :meth:`prepare` found them; every rank must call it."""
        parts, self._parts = self._parts, []
        for part in parts:
            part.reduce(used_everywhere)
        merged, self._merged = self._merged, []
        for total, before in merged:
            total.sub_(before)

    def forget(self) -> None:
        """Drop what :meth:`prepare` made, after an attempt that failed on some rank."""
        self._parts, self._merged = [], []


def _reduced(module: DistributedDataParallel) -> list[torch.nn.Parameter]:
    """Return the parameters whose gradients DDP averages: those that need one, but the ones it ignores."""
    ignored: set[str] = getattr(module, "parameters_to_ignore", set())
    return [
        parameter
        for name, parameter in module.module.named_parameters()
        if parameter.requires_grad and name not in ignored
    ]


_BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket_cap_mb
# From this size up a gradient is all-reduced in place: copying it into a bucket and back
# costs more than the latency of a collective of its own.
_ALONE_BYTES = 1024 * 1024


class _ModuleGradients:
    """One DDP module's gradients of one step (the step's own, never ``.grad``), and what to all-reduce them in."""

    def __init__(
        self,
        module: DistributedDataParallel,
        parameters: list[torch.nn.Parameter],
        gradients: dict[int, torch.Tensor],
        leaves: dict[int, torch.Tensor],
    ) -> None:
        self.group = module.process_group
        self.world_size = dist.get_world_size(self.group)
        self.gradients, self.leaves = gradients, leaves
        self.parameters = parameters  # what DDP averages (_reduced)
        for parameter in self.parameters:
            gradient = gradients.get(id(parameter))
            if gradient is not None and gradient.layout != torch.strided:
                raise NotImplementedError(
                    f"koila.accumulate with DistributedDataParallel all-reduces dense gradients; a parameter of "
                    f"shape {tuple(parameter.shape)} has a {gradient.layout} gradient (sparse embeddings "
                    "are not supported yet)"
                )
        device = backend_device(self.group)
        self.used = torch.tensor(
            [1 if id(parameter) in gradients else 0 for parameter in self.parameters],
            dtype=torch.int32,
            device=device,
        )
        self.mine = self.used.tolist()
        # Large gradients are all-reduced in place, each alone; small ones share buckets. Which is which
        # depends only on the parameters, so that every rank issues the same collectives in the same order.
        self.alone = {
            id(parameter)
            for parameter in self.parameters
            if parameter.is_contiguous() and parameter.numel() * parameter.element_size() >= _ALONE_BYTES
        }
        cap = int(getattr(module, "bucket_bytes_cap", _BUCKET_BYTES)) or _BUCKET_BYTES
        sizes: dict[tuple[torch.device, torch.dtype], int] = {}
        largest: dict[tuple[torch.device, torch.dtype], int] = {}
        for parameter in self.parameters:
            if id(parameter) not in self.alone:
                kind, numel = (parameter.device, parameter.dtype), parameter.numel()
                sizes[kind] = sizes.get(kind, 0) + numel
                largest[kind] = max(largest.get(kind, 0), numel)
        self.buffers = {
            kind: torch.empty(min(numel, max(cap // kind[1].itemsize, largest[kind])), dtype=kind[1], device=kind[0])
            for kind, numel in sizes.items()
        }
        # Made now, not after the agreement, when there might be no memory for them: a zero
        # gradient for each parameter this rank did not use (another rank may have, and its
        # average is then this rank's gradient too), and a contiguous copy of a gradient to
        # all-reduce in place that is not contiguous.
        self.spare: dict[int, torch.Tensor] = {}
        for parameter, mine in zip(self.parameters, self.mine, strict=True):
            key = id(parameter)
            if not mine:
                self.spare[key] = torch.zeros(parameter.shape, dtype=parameter.dtype, device=parameter.device)
            elif key in self.alone and not gradients[key].is_contiguous():
                gradients[key] = gradients[key].contiguous()

    def reduce(self, used_everywhere: bool) -> None:
        if used_everywhere:
            anywhere = self.mine
        else:
            dist.all_reduce(self.used, op=dist.ReduceOp.MAX, group=self.group)
            anywhere = self.used.tolist()
        pending: list[tuple[Any, torch.nn.Parameter, int, torch.Tensor]] = []
        buckets: dict[tuple[torch.device, torch.dtype], list[tuple[torch.nn.Parameter, int]]] = {}
        filled: dict[tuple[torch.device, torch.dtype], int] = {}
        for parameter, mine, used in zip(self.parameters, self.mine, anywhere, strict=True):
            if not used:  # as with DDP: a parameter no rank used keeps its gradient, or None
                continue
            if id(parameter) in self.alone:
                gradient = self.gradients[id(parameter)] if mine else self.spare[id(parameter)]
                work = dist.all_reduce(gradient, group=self.group, async_op=True)
                pending.append((work, parameter, mine, gradient))
                continue
            kind, numel = (parameter.device, parameter.dtype), parameter.numel()
            buffer = self.buffers[kind]
            bucket = buckets.setdefault(kind, [])
            if filled.get(kind, 0) + numel > buffer.numel():
                self._reduce_bucket(buffer, bucket)
                bucket.clear()
                filled[kind] = 0
            bucket.append((parameter, mine))
            filled[kind] = filled.get(kind, 0) + numel
        for kind, bucket in buckets.items():
            if bucket:
                self._reduce_bucket(self.buffers[kind], bucket)
        for work, parameter, mine, gradient in pending:
            work.wait()
            gradient.div_(self.world_size)
            self._settle(parameter, mine, gradient)
        self.buffers.clear()
        self.spare.clear()

    def _settle(self, parameter: torch.nn.Parameter, mine: int, average: torch.Tensor) -> None:
        """Make the averaged gradient the step's gradient of ``parameter``."""
        key = id(parameter)
        target = self.gradients[key] if mine else self.spare[key]
        if average is not target:
            target.copy_(average.view_as(target))
        if not mine:
            self.gradients[key] = target
            self.leaves[key] = parameter

    def _reduce_bucket(self, buffer: torch.Tensor, bucket: list[tuple[torch.nn.Parameter, int]]) -> None:
        offset = 0
        for parameter, mine in bucket:
            numel = parameter.numel()
            target = buffer[offset : offset + numel]
            if mine:
                target.view_as(parameter).copy_(self.gradients[id(parameter)])
            else:
                target.zero_()
            offset += numel
        flat = buffer[:offset]
        dist.all_reduce(flat, group=self.group)
        flat.div_(self.world_size)
        offset = 0
        for parameter, mine in bucket:
            numel = parameter.numel()
            self._settle(parameter, mine, flat[offset : offset + numel])
            offset += numel
