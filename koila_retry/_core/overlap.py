"""DDP's overlap under agreement: the last micro-batch's backward all-reduces as DDP does it, during the backward.

A rank that runs out of memory before or inside that backward never launches some of the buckets the
other ranks wait in. So, before the ranks agree, it *plays along*: it works out how many buckets its
reducer launched (with one collective per bucket, the process group's count of those the backward made;
else, in the reducer's order, those whose every parameter it marked ready) and makes the rest, with zeros, through
DDP's own comm hook, as DDP's ``Join`` does for a rank with no input left, then the all-reduce of the
used parameters that ``find_unused_parameters`` adds. Then the ranks agree once, and every rank resets
its reducer (``_reset_state``), as DDP does when its process group changes. After a forward in grad mode
that no backward followed, the reducer all-reduces in a split step's first backward too: the ranks whose
first backward did agree right after it, where a rank that failed meets them. docs/distributed.rst,
"DDP: the overlap, kept", explains it to users.
"""

from __future__ import annotations

import contextlib
import operator
import weakref
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from koila_retry._common.places import levels_to_caller
from koila_retry._common.tensors import set_grads
from koila_retry._common.warn import warn_or_log
from koila_retry._core import memory
from koila_retry._core.aside import SetAside

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

    from koila_retry._core.distributed import Agreement

__all__ = ["Overlap", "overlaps"]


class _Known(NamedTuple):
    """What a DDP module's step needs, looked at once: DDP fixes its parameters when it is built."""

    parameters: list[torch.nn.Parameter]  # all of them, to set aside: DDP leaves ignored ones to accumulate
    reduced: list[torch.nn.Parameter]  # the reducer's, in its order (a variable's index into backward stats)
    norms: list[torch.nn.Module]  # BatchNorm layers, for the warning of a split step


# Per DDP module: what its steps need, or None where a failed rank cannot play along.
_KNOWN: weakref.WeakKeyDictionary[torch.nn.Module, _Known | None] = weakref.WeakKeyDictionary()
# Per DDP module: the collectives its last backward that got through made, and whether they were DDP's alone
# (one per bucket): a step's own in its backward (torch.distributed.nn's) would count as buckets launched.
_CLEAN: weakref.WeakKeyDictionary[torch.nn.Module, tuple[int, bool]] = weakref.WeakKeyDictionary()
_HOOKS = operator.attrgetter("_post_accumulate_grad_hooks")
_ABSENT: Any = object()
# The forwards of norm layers that read their running statistics only in eval mode, where nothing changes them.
_NORMS = {torch.nn.modules.batchnorm._BatchNorm.forward, torch.nn.modules.instancenorm._InstanceNorm.forward}
# The modules warned of a broadcast of changed buffers that a step kept from happening (see Overlap._skipped).
_WARNED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
# What the reducer must have for a rank to play along and for the ranks to start again (torch >= 2.2).
_REDUCER = ("_get_zeros_like_grad_buckets", "_run_comm_hook", "_reset_state", "get_backward_stats")
# PyTorch's own hooks whose every bucket's future completes by itself (not its wrappers of other hooks).
_PER_BUCKET = {
    ("torch.distributed.algorithms.ddp_comm_hooks.default_hooks", name)
    for name in ("allreduce_hook", "fp16_compress_hook", "bf16_compress_hook")
}


def overlaps(modules: list[DistributedDataParallel]) -> bool:
    """Return whether a step over ``modules`` can keep DDP's overlap; else it all-reduces after the backward."""
    if len(modules) != 1:  # two reducers interleave their buckets by readiness: no order to play along in
        return False
    known = _known(modules[0])
    # A hook that runs after a gradient is written may fail before DDP's sees it.
    return known is not None and not any(map(_HOOKS, known.parameters))


def _known(module: DistributedDataParallel) -> _Known | None:
    """Return what the module's steps need, or None if a failed rank cannot play along its reducer."""
    if module in _KNOWN:
        return _KNOWN[module]
    reducer: Any = getattr(module, "reducer", None)
    # Static graphs delay or count their hooks, a sparse gradient has no bucket of zeros, delayed
    # parameters and skipped buckets are all-reduced, or not, by rules of their own.
    served = (
        reducer is not None
        and all(hasattr(reducer, name) for name in _REDUCER)
        and not getattr(module, "static_graph", False)
        and not getattr(module, "skip_all_reduce_unused_params", False)
        and not getattr(module, "_use_python_reducer", False)
        and not getattr(module, "_delay_all_reduce_params", None)
        and not any(getattr(each, "sparse", False) for each in module.module.modules())
        and callable(getattr(module, "_sync_buffers", None))  # what a forward calls to broadcast buffers
    )
    known = None
    if served:
        reduced = _reducer_order(module)
        if len(reduced) == len(reducer.get_backward_stats()):
            norms: list[torch.nn.Module] = [
                each for each in module.modules() if isinstance(each, torch.nn.modules.batchnorm._BatchNorm)
            ]
            known = _Known(list(module.parameters()), reduced, norms)
    _KNOWN[module] = known
    return known


def _reducer_order(module: DistributedDataParallel) -> list[torch.nn.Parameter]:
    """Return the parameters DDP gave its reducer, in its order: each module's own, those that need a gradient."""
    ignored: set[str] = getattr(module, "parameters_to_ignore", set())
    seen: set[int] = set()
    order = []
    for prefix, each in module.module.named_modules():
        for name, parameter in each.named_parameters(recurse=False):
            if parameter.requires_grad and f"{prefix}.{name}" not in ignored and id(parameter) not in seen:
                seen.add(id(parameter))
                order.append(parameter)
    return order


class _Unallocated(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Make ``zeros_like`` return a zero expanded to the shape asked for: its size, without its memory."""

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func is torch.ops.aten.zeros_like.default:
            like = args[0]
            return torch.zeros((), dtype=like.dtype, device=like.device).expand(like.shape)
        return func(*args, **(kwargs or {}))


def _counted(module: DistributedDataParallel) -> Any:
    """Return the process group in which the module's backward makes one collective per bucket, or None."""
    hooks = getattr(module, "_comm_hooks", ())
    if not all(_per_bucket(hook) for hook, _ in hooks):
        return None
    # A hook of PyTorch's all-reduces in its state, the default group where that is None.
    return (hooks[0][1] or torch.distributed.group.WORLD) if hooks else module.process_group


def _sequence(group: Any, device: torch.device) -> int | None:
    """Return how many collectives the group's backend for ``device`` made, or None where it keeps no count."""
    try:  # gloo, NCCL, XCCL and UCC count; other backends raise
        return int(group._get_backend(device)._get_sequence_number_for_group())
    except (AttributeError, RuntimeError):
        return None


def _per_bucket(hook: Any) -> bool:
    """Return whether a DDP communication hook completes each bucket's future without waiting for a later one."""
    where = getattr(hook, "__module__", None), getattr(hook, "__qualname__", None)
    return where in _PER_BUCKET


def _one_at_a_time(
    reducer: Any, played: list[Any], buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor]
) -> None:
    """Play the buckets' collectives in turn, with one buffer of zeros per dtype and device (kept in ``buffers``)."""
    # Kept for the call's later play-alongs, not made again: a new one each time ran out of memory now and
    # then where one fits, most likely beside the last, which a collective's work (gloo's worker thread)
    # may still hold a moment after its wait returned.
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    for bucket in played:
        like = bucket.buffer()
        sizes[like.dtype, like.device] = max(sizes.get((like.dtype, like.device), 0), like.numel())
    for key, size in sizes.items():
        if key not in buffers or buffers[key].numel() < size:
            buffers.pop(key, None)
            buffers[key] = torch.empty(size, dtype=key[0], device=key[1])
    for bucket in played:
        like = bucket.buffer()
        bucket.set_buffer(buffers[like.dtype, like.device][: like.numel()].zero_())
        del like
        reducer._run_comm_hook(bucket).wait()  # the next bucket's zeros overwrite this one's sum


def _changed(module: DistributedDataParallel, before: dict[str, tuple[torch.Tensor, int]]) -> bool:
    """Return whether a buffer DDP broadcasts changed since ``before``, but those norm layers read only in eval mode."""
    # Looked at only where DDP would broadcast inside the step. By name: a layer may assign a new tensor.
    ignored: set[str] = getattr(module, "parameters_to_ignore", set())
    stock = {
        f"{prefix}.{name}" if prefix else name
        for prefix, each in module.module.named_modules()
        if getattr(type(each), "forward", None) in _NORMS  # a TorchScript class has none to read
        for name, _ in each.named_buffers(recurse=False)
    }
    for name, buffer in module.module.named_buffers():
        if name in ignored or name in stock:
            continue
        was = before.get(name)
        if was is None or was[0] is not buffer or was[1] != buffer._version:
            return True
    return False


class Overlap(SetAside):
    """One DDP module's side of a step: gradients set aside, the last micro-batch synced, the play-along."""

    def __init__(self, module: DistributedDataParallel, agreement: Agreement) -> None:
        self.known = cast(_Known, _known(module))  # overlaps() said there is one
        super().__init__([parameter for parameter in self.known.parameters if parameter.requires_grad])
        self.module, self.agreement = module, agreement
        self.reducer: Any = module.reducer
        # With gradients as bucket views, the reducer writes the bucket that .grad is a view of: what is
        # set aside must be a copy (the one buffer the exact rollback costs, and only when .grad is present).
        self.copies = bool(getattr(module, "gradient_as_bucket_view", False))
        # Gradient sync as the step found it: off inside the caller's own ``no_sync()``.
        self.syncs = bool(vars(module).get("require_backward_grad_sync", True))
        self.running = False  # an attempt began and has not finished its last micro-batch
        # A split attempt's first backward has yet to run: DDP may all-reduce in it (see backward_begins).
        self.unchecked = False
        self.synced = False  # the backward last noted ran with gradient sync on
        self.merging = False  # see before()
        # Bucket views and a sync: .grad as the step found it, added to in place as a hand loop's (see before()).
        self.in_place = False
        self.kept: list[torch.Tensor | None] = []  # the tensors .grad held, with copies
        self.versions: list[int] = []  # their version counters as each attempt began, with in_place
        # As the last micro-batch's backward began (see backward_begins), where each bucket is one collective:
        # the process group and its count of collectives made.
        self.counted: Any = None
        self.issued: int | None = None
        # Else, where that count is not trusted: the reducer's time of each variable's readiness (one that has
        # changed since was marked by this backward, unused ones included; it ties with the last backward's
        # now and then, to the nanosecond), and, without bucket views, each .grad and its version (one the
        # backward changed was marked, tie or not).
        self.stats: list[int] | None = None
        self.written: list[tuple[torch.Tensor | None, int]] | None = None
        self.played_with: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}  # see _one_at_a_time
        # While the step runs: what the module's own attributes held as _sync_buffers (_ABSENT: nothing), and
        # DDP's buffers by name, with their versions, as the step began (see _skipped).
        self.quiet: Any = None
        self.buffers: dict[str, tuple[torch.Tensor, int]] = {}

    def before(self) -> None:
        """Set the gradients aside; those from before the step are averaged with its own, if it syncs."""
        # A hand loop's synced backward averages all that .grad holds, a backward of the caller's own under
        # no_sync() included: so the last micro-batch starts from them added to the step's (see micro_batch).
        # Without it, one rank's own gradients would stay its own, and the ranks' parameters drift apart.
        present = any(parameter.grad is not None for parameter in self.parameters)
        self.in_place = self.copies and self.syncs and present
        if self.in_place:
            # The step's backward writes the buckets .grad views: a copy is set aside in any case, so the
            # step adds into .grad in place, as the hand loop does, and the copy alone is what it costs. Set
            # aside and merged as below, it cost two gradients' worth.
            self.merging, self.copied = False, False
            self.kept = [parameter.grad for parameter in self.parameters]
            self.aside = list(self.kept)  # copied as the first attempt begins (see SetAside.copy)
            return
        super().before()
        self.merging = self.syncs and present
        # Inside the caller's own no_sync(): the copies go back into these, which .grad viewed (see restore()).
        self.kept = list(self.aside) if self.copies else []

    def micro_batch(self, last: bool, first: bool) -> None:
        """Begin a micro-batch: DDP all-reduces in its backward only if it is the last."""
        # Plain flags, written past Module.__setattr__ (some 5 us each). Buffers were broadcast once, before
        # the step: no forward of it broadcasts them again (the flag here, and _no_broadcast), or a rank that
        # failed before that forward would miss the broadcast.
        attributes = vars(self.module)
        if first:
            self.running, self.unchecked = True, not last
            self._forget()
            self.copy()  # with running set: a rank that fails for the copies plays along the whole backward
            if self.in_place:
                self.versions = [-1 if grad is None else grad._version for grad in self.kept]
            attributes["require_forward_param_sync"] = False
            attributes["require_backward_grad_sync"] = last
            if self.quiet is None:
                self._no_broadcast(attributes)
        elif last:
            attributes["require_backward_grad_sync"] = True
        if last and self.merging:
            self._merge()

    def backward_begins(self, last: bool) -> None:
        """Note, as a backward that may all-reduce begins, what tells a play-along which buckets it launched.

        That is the last micro-batch's, and a split attempt's first: after a forward in grad mode that no
        backward followed (a sample logged, say), DDP's reducer all-reduces every bucket in the next
        backward, under ``no_sync()`` too, on every rank.
        """
        if not (last or self.unchecked):
            return
        self.synced = last
        self.unchecked = self.unchecked and not last  # DDP all-reduces in a synced one anyway
        group = _counted(self.module)
        if group is not None:
            self.counted, self.issued = group, _sequence(group, self.known.reduced[0].device)
        clean = _CLEAN.get(self.module)
        if self.issued is not None and clean is not None and clean[1]:
            return  # the count says which buckets went (see play_along)
        self.stats = self.reducer.get_backward_stats()
        if not self.copies:
            self.written = [(p.grad, -1 if p.grad is None else p.grad._version) for p in self.known.reduced]

    def backward_ended(self) -> None:
        """After a backward that got through: if DDP all-reduced in a split attempt's first, agree that none failed.

        Raises:
            RanksFailed: if another rank failed: it played these buckets along, and agreed after them.
        """
        if not self.unchecked:
            return
        self.unchecked = False
        early = self._launched()
        self._forget()  # a later failure plays along the last micro-batch's buckets, all of them
        if early:
            # A rank that failed in this backward, or before it, made the buckets and then the exchange
            # after its attempt: made here too. A rank whose buckets all went has none to play along.
            self.running = False
            self.agreement.check_others()
            self.running = True

    def _launched(self) -> bool:
        """Return whether DDP's reducer launched buckets in the backward that :meth:`backward_begins` noted last."""
        if self.stats is None:  # the count is trusted, or no backward was noted
            return bool(self._made())
        return bool(self.reducer.get_backward_stats() != self.stats)

    def _made(self) -> int | None:
        """Return the collectives made since the last micro-batch's backward began, where that says which buckets."""
        now = None if self.issued is None else _sequence(self.counted, self.known.reduced[0].device)
        return None if now is None or self.issued is None else now - self.issued

    def _learn(self) -> None:
        # After a backward that got through: whether its collectives were DDP's alone, one per bucket and the
        # used map's. Looked at again only when their number changes (a rebuild, a step's own collectives).
        made = self._made()
        seen = _CLEAN.get(self.module)
        if made is not None and (seen is None or seen[0] != made):
            with _Unallocated():  # type: ignore[no-untyped-call]
                buckets = len(self.reducer._get_zeros_like_grad_buckets())
            _CLEAN[self.module] = (made, made == buckets + bool(self.module.find_unused_parameters))

    def _merge(self) -> None:
        # Into the step's own tensors, or a copy: what was set aside stays as it was until the step succeeds.
        for parameter, before in zip(self.parameters, self.aside, strict=True):
            if before is not None:
                grad = parameter.grad
                if grad is None:
                    parameter.grad = before.clone()
                else:
                    grad.add_(before)

    def finished(self, name: str) -> None:
        """End an attempt whose micro-batches all ran.

        Raises:
            RuntimeError: if the module's parameters got gradients while its own forward did not run
                in the last micro-batch: nothing all-reduced them.
        """
        launched = self._launched()
        self._learn()
        self.running = False
        self._forget()
        # DDP sets the flag after a forward that syncs, and clears it after one without grad (a sample logged
        # after the loss's): its reducer then still launched the buckets. It was cleared as the micro-batch
        # began. Every rank raises alike, before any collective: none was made.
        if not vars(self.module)["require_forward_param_sync"] and not launched and self._written():
            raise RuntimeError(
                f"{name} trains a DistributedDataParallel module whose parameters got gradients in a micro-batch "
                "that did not call the module itself (its .module, say): DDP all-reduces only the gradients of a "
                "backward that follows its own forward, so they would not be averaged across the ranks. Call the "
                "DDP module itself in the step, as DDP requires"
            )

    def _written(self) -> bool:
        # Whether this attempt's backward wrote a gradient: with in_place, into one from before too.
        if not self.in_place:
            return any(parameter.grad is not None for parameter in self.parameters)
        return any(
            parameter.grad is not kept or (kept is not None and kept._version != version)
            for parameter, kept, version in zip(self.parameters, self.kept, self.versions, strict=True)
        )

    def play_along(self) -> bool:
        """After an attempt that failed here: make the collectives this rank never made; return True (the vote)."""
        if not self.running:
            return True
        self.running = False
        # Where backward_begins trusted the count it took no stats; else the parameters marked say, and the
        # count, where there is one, caps them: the reducer marks a bucket's parameters before it calls the
        # hook, which may run out of memory before its collective (fp16_compress_hook casting the bucket).
        counted = self._made()
        made = counted if self.stats is None else None
        ready = self._ready() if made is None else set()
        self._forget()
        set_grads((parameter, None) for parameter in self.parameters)  # the attempt failed: its gradients go now
        # The failed attempt's frames may hold its tensors in reference cycles, and its backward its graph in
        # the autograd engine's queue: the engine releases them after the ranks agree, too late for the
        # buffers played with.
        memory.collect()
        # The rank ran out of memory: zeros for every bucket at once would be one more gradient's worth (where
        # the model's gradients outweigh its activations, more than the failed attempt gave back). So the
        # buckets come without memory, and one buffer per dtype, the largest played bucket's, serves them in
        # turn, each bucket's hook waited for before the next: unless a hook of the user's may complete a
        # bucket only when a later one comes (DDP calls every bucket's before it waits for any).
        one_buffer = all(_per_bucket(hook) for hook, _ in getattr(self.module, "_comm_hooks", ()))
        with _Unallocated() if one_buffer else contextlib.nullcontext():  # type: ignore[no-untyped-call]
            buckets = self.reducer._get_zeros_like_grad_buckets()
        launched = 0
        if made is not None:  # DDP's alone; with find_unused_parameters, the used map's follows the last bucket
            launched = min(made, len(buckets))
        else:
            for bucket in buckets:
                if not all(id(parameter) in ready for parameter in bucket.parameters()):
                    break
                launched += 1
            if counted is not None:
                launched = min(launched, counted)
        played = buckets[launched:]
        del buckets
        if one_buffer:
            _one_at_a_time(self.reducer, played, self.played_with)
        else:  # the zeros DDP made, every bucket's hook called before any is waited for, as DDP does
            futures = [self.reducer._run_comm_hook(bucket) for bucket in played]
            for future in futures:
                future.wait()
            del futures
        if played and self.module.find_unused_parameters:
            # Which parameters each rank used, all-reduced once the last bucket was launched.
            used = torch.zeros_like(self.reducer._get_local_used_map())
            torch.distributed.all_reduce(used, group=self.module.process_group)
        return True

    def _forget(self) -> None:
        # What told a play-along which buckets went: of one attempt's last micro-batch only.
        self.stats, self.issued, self.written = None, None, None

    def _ready(self) -> set[int]:
        """Return the ids of the parameters the reducer marked ready in the last micro-batch's backward."""
        ready = set()
        if self.stats is not None:  # marked without a gradient (unused, or None from a Function): the stats say
            now = self.reducer.get_backward_stats()
            ready = {id(p) for p, was, is_ in zip(self.known.reduced, self.stats, now, strict=True) if is_ != was}
        # A .grad the backward wrote: its hook marked it (a tie in the stats or not), if the reducer expected
        # the backward: under no_sync(), only where it marked any.
        if self.written is not None and (self.synced or ready):
            ready |= {
                id(p)
                for p, (grad, version) in zip(self.known.reduced, self.written, strict=True)
                if p.grad is not grad or (grad is not None and grad._version != version)
            }
        return ready

    def undo(self) -> None:
        """After an attempt that failed on some rank: its gradients dropped, the reducer as before a backward."""
        self.running = False
        self._forget()
        if self.in_place:
            self._put_back()
        else:
            super().undo()
        # Every rank, not only the failed one: a reset reducer rebuilds its buckets (a broadcast) after
        # its next backward, and a rebuild that only some ranks made would leave the others waiting.
        self.reducer._reset_state()
        self._settle_sync()

    def _put_back(self) -> None:
        # The values from before into the tensors .grad held: an attempt may have added to them in place.
        for kept, before in zip(self.kept, self.aside, strict=True):
            if kept is not None and before is not None and before is not kept:  # not copied: nothing wrote it
                kept.copy_(before)
        set_grads(zip(self.parameters, self.kept, strict=True))

    def give_back(self) -> None:
        """After a step that raised: the gradients from before, as they were, in the tensors that held them."""
        self._loud_again()
        self.played_with = {}
        if not self.copies:
            super().give_back()
            return
        self.undo()
        if not self.in_place:  # undo() put them back with in_place
            self._put_back()
        self._done()

    def _no_broadcast(self, attributes: dict[str, Any]) -> None:
        # DDP broadcasts buffers in every forward that follows one with gradient sync on: where a step runs
        # the module twice (two views of a batch), on every rank but one that failed before the second
        # forward, which the others then waited for. Its forward calls _sync_buffers for it, whether the
        # module is called or its forward() is: the broadcast before the first attempt is the step's only one.
        self.quiet = attributes.get("_sync_buffers", _ABSENT)
        attributes["_sync_buffers"] = self._skipped
        if self.module not in _WARNED:  # the warning's only: shown once
            named = getattr(self.module, "named_module_buffers", None) or {}  # DDP's, made again at each broadcast
            self.buffers = {name: (buffer, buffer._version) for name, buffer in named.items()}

    def _skipped(self) -> None:
        """Stand in for DDP's broadcast of buffers inside the step: warn, once, if one it would carry changed."""
        if self.module in _WARNED or not self.buffers or not _changed(self.module, self.buffers):
            return
        _WARNED.add(self.module)
        warn_or_log(
            "A koila.accumulate step ran a DistributedDataParallel module again after a forward that changed its "
            "buffers: DDP alone would broadcast rank 0's buffers before this forward, which the step does not (a "
            "rank that ran out of memory before it would never join that broadcast, and the others would wait "
            "forever), so each rank's forward reads its own. Where a layer reads in training mode a buffer it "
            "updates from the data (a running normaliser, BatchRenorm), the other ranks' losses and gradients then "
            "differ from DDP's alone; a buffer every rank updates alike (a counter, spectral_norm's vectors) makes "
            "no difference. Run the views in one forward (torch.cat) to have both. This warning is shown once per "
            "module.",
            UserWarning,
            stacklevel=levels_to_caller(),
        )

    def _loud_again(self) -> None:
        if self.quiet is None:
            return
        attributes = vars(self.module)
        if self.quiet is _ABSENT:
            attributes.pop("_sync_buffers", None)
        else:
            attributes["_sync_buffers"] = self.quiet
        self.quiet, self.buffers = None, {}

    def _done(self) -> None:
        self.aside, self.kept, self.versions, self.in_place = [], [], [], False

    def restore(self) -> None:
        """After the step: gradient sync as DDP leaves it, and the gradients set aside added back."""
        self._loud_again()
        self.played_with = {}
        self._settle_sync()
        if self.in_place:  # the step's average of .grad already holds them
            self._done()
            return
        if not self.merging:
            if self.copies:
                self._added_back()
            else:
                super().restore()
            return
        # The step's average already holds them. Written into the tensors .grad held before, unless those were
        # bucket views: the average is in DDP's bucket, which .grad views again.
        aside, self.aside, self.merging = self.aside, [], False
        if not self.copies:
            for parameter, before in zip(self.parameters, aside, strict=True):
                if before is not None and parameter.grad is not None:
                    parameter.grad = before.copy_(parameter.grad)

    def _added_back(self) -> None:
        # Into .grad, which DDP's synced backward made the bucket views again, as a hand loop leaves it: added
        # the other way round, as SetAside does, .grad would end up a copy beside the buckets.
        aside, kept = self.aside, self.kept
        self._done()
        for parameter, original, before in zip(self.parameters, kept, aside, strict=True):
            if before is None:
                continue
            grad = parameter.grad
            if grad is not None:
                grad.add_(before)
                continue
            if original is not None and original is not before:
                original.copy_(before)
            parameter.grad = original

    def batchnorm_trains(self) -> bool:
        """Return whether a BatchNorm layer of the module is in training mode."""
        return any(norm.training for norm in self.known.norms)

    def _settle_sync(self) -> None:
        # As after a step DDP synchronised itself: its next forward outside koila broadcasts buffers. The
        # step's own gradients are averaged once even inside the caller's no_sync(), which stays on after it.
        attributes = vars(self.module)
        attributes["require_forward_param_sync"] = True
        attributes["require_backward_grad_sync"] = self.syncs
