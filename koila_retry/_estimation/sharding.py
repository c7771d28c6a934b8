"""One rank's memory of a step over FSDP2 (``fully_shard``) modules, estimated without a collective.

FSDP2's own hooks make collectives and change state that other threads and ranks use, so the
step runs unsharded and :class:`Emulation` plays FSDP2's part in the borrowing thread: each
managed parameter lent as its shard, full-size copies swapped in around each module, FSDP2's
buffers allocated and freed when it does. Order and lifetimes follow ``unshard``,
``wait_for_unshard``, ``post_backward`` and ``foreach_reduce`` in ``_fsdp_param_group.py`` and
``_fsdp_collectives.py`` (torch 2.13; 2.11 allocates the same). Only :func:`plan` reads
FSDP2's private state.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from koila_retry._common.units import as_int, type_name
from koila_retry._core import sharded

__all__ = ["Emulation", "Sharding", "plan"]

_META = torch.device("meta")


def shard_size(size: torch.Size, world: int) -> torch.Size:
    """Return the shape of one rank's shard of ``size``: FSDP2 pads dim 0 to a multiple of ``world``."""
    return torch.Size([-(-size[0] // world), *size[1:]]) if size else size


@dataclass
class Unit:
    """One FSDP2 parameter group: a sharded module and the parameters it manages."""

    module: torch.nn.Module
    places: list[tuple[torch.nn.Module, str, torch.Tensor]]  # where each parameter sits, with it
    params: list[torch.Tensor]  # each once
    root: bool
    reshard_after_forward: bool
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    reduce_grads: bool = True
    cast_inputs: bool = False
    # Read before the loan: during the run, a lent parameter reads as its shard.
    sizes: list[torch.Size] = field(default_factory=list)
    dtype: torch.dtype = torch.float32
    # A module gathered as the call starts (the root after a forward without backward): what
    # its modules hold now, by the id of the shard it stands for.
    holding: dict[int, torch.Tensor] = field(default_factory=dict)
    # FSDP2's gathered parameter objects, which it swaps into its modules (lent, not counted).
    swapped: list[torch.Tensor] = field(default_factory=list)
    # The run's state, made by Emulation.
    state: str = "idle"
    flat: torch.Tensor | None = None
    gathered: list[torch.Tensor] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)


class Sharding:
    """What the estimate plays of FSDP2: the ranks each parameter is sharded over, and the units, root first."""

    def __init__(self, world: int, units: list[Unit]) -> None:
        self.world = world
        self.units = sorted(units, key=lambda unit: not unit.root)
        self._shapes: dict[int, torch.Size] = {}
        self._held = {id(held) for unit in units for held in (*unit.holding.values(), *unit.swapped)}
        for unit in units:
            unit.sizes = [param.size() for param in unit.params]  # a DTensor's is the whole tensor's
            if unit.params:
                unit.dtype = unit.params[0].dtype
            for param, size in zip(unit.params, unit.sizes, strict=True):
                self._shapes[id(param)] = shard_size(size, world)

    def shape_of(self, tensor: torch.Tensor, owner: torch.Tensor | None = None) -> torch.Size | None:
        """Return the padded shape of one rank's copy of ``tensor`` (of ``owner``'s, for its grad or state), or None."""
        found = self._shapes.get(id(tensor))
        if found is not None:
            return found
        if _is_dtensor(tensor):
            return shard_size(tensor.size(), self.world) if tensor.dim() > 0 else None
        if owner is not None and id(owner) in self._shapes and tensor.size() == owner.size():
            # A managed parameter's gradient or moment, as it is before FSDP2 shards it.
            return self._shapes[id(owner)]
        return None

    def held(self, tensor: torch.Tensor) -> bool:
        """Return whether ``tensor`` is one of FSDP2's gathered parameters (held now, or swapped in later)."""
        # Its meta copy is not counted: the gathered buffers the emulation allocates stand for it.
        return id(tensor) in self._held

    def gathered(self) -> list[torch.Tensor]:
        """Return FSDP2's gathered parameter objects, to lend whether a module holds them now or not."""
        return [tensor for unit in self.units for tensor in unit.swapped]

    def emulation(self, copy_of: Callable[[torch.Tensor], torch.Tensor | None]) -> Emulation:
        """Return what plays FSDP2 in the run (not installed yet), given the lent copies (``Loan.copy_of``)."""
        return Emulation(self, copy_of)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "_local_tensor") and hasattr(tensor, "device_mesh")


# --- which modules, from the model ---------------------------------------------------


def plan(modules: Iterable[torch.nn.Module], fsdp: int | None) -> Sharding | None:
    """Return what to play of FSDP2 over ``fsdp`` ranks for a call that reaches ``modules``; None if unsharded."""
    # Modules already sharded with fully_shard are read as they are (their mesh gives the world).
    # Otherwise, with fsdp=N, FSDP2's usual recipe: the outermost modules in an nn.ModuleList, then the root.
    if fsdp is not None:
        ranks = as_int(fsdp)  # numpy's ints too
        if ranks is None:
            raise TypeError(
                f"fsdp must be an int >= 1, the number of ranks to shard over, got {type_name(fsdp)} {fsdp!r}"
            )
        if ranks < 1:
            raise ValueError(f"fsdp must be an int >= 1, the number of ranks to shard over, got {fsdp!r}")
        fsdp = ranks
    modules = list({id(module): module for module in modules}.values())
    real = sharded.fsdp_modules(modules)
    if real:
        return _from_fsdp(real, fsdp)
    if fsdp is None:
        return None
    return _recipe(modules, fsdp)


def _from_fsdp(modules: list[torch.nn.Module], fsdp: int | None) -> Sharding:
    worlds: set[int] = set()
    units: list[Unit] = []
    seen_states: set[int] = set()
    inside = _descendants(modules)
    for module in modules:
        state = sharded.state_of(module)
        if id(state) in seen_states:
            continue
        seen_states.add(id(state))
        if len(state._modules) > 1:  # private: the modules one fully_shard call grouped
            raise NotImplementedError(
                f"koila.estimate cannot play FSDP2 for fully_shard([...]) over several modules "
                f"({', '.join(type(m).__name__ for m in state._modules)}): shard each module on its own, "
                "or estimate without the grouping"
            )
        groups = sharded.param_groups(module)
        if len(groups) > 1:
            raise NotImplementedError(
                f"koila.estimate cannot play FSDP2 for {type(module).__name__}, whose parameters are sharded "
                "over several meshes (shard_placement_fn): shard them over one"
            )
        policy = state._mp_policy  # private: the MixedPrecisionPolicy given to fully_shard
        root = id(module) not in inside
        unit = Unit(module, [], [], root=root, reshard_after_forward=True)
        unit.param_dtype, unit.reduce_dtype = policy.param_dtype, policy.reduce_dtype
        unit.cast_inputs = bool(policy.cast_forward_inputs and policy.param_dtype is not None)
        if groups:
            group = groups[0]
            mesh = group.mesh_info  # private: FSDPMeshInfo
            if getattr(mesh, "replicate_process_group", None) is not None:
                raise NotImplementedError(
                    f"koila.estimate cannot play HSDP (a 2-D mesh with replicas) for {type(module).__name__}: "
                    "estimate with fsdp=N, N the ranks of one replica"
                )
            worlds.add(int(mesh.shard_mesh_size))
            # Not resharded after forward: the root by default, and reshard_after_forward=False.
            auto = bool(state._auto_reshard_after_forward)  # private: reshard_after_forward was left as None
            unit.reshard_after_forward = group.post_forward_mesh_info is not None and not (root and auto)
            unit.reduce_grads = bool(group.reduce_grads)
            gathered = bool(group.is_unsharded)
            for param in group.fsdp_params:
                if param.fsdp_placement.dim != 0 or param.offload_to_cpu:
                    raise NotImplementedError(
                        f"koila.estimate cannot play FSDP2 for {type(module).__name__}: a parameter is "
                        + ("offloaded to the CPU" if param.offload_to_cpu else "sharded along a dim other than 0")
                    )
                info = param._module_info  # private: ParamModuleInfo, where the parameter sits
                real = param.sharded_param
                if gathered:
                    unit.holding[id(real)] = param.unsharded_param
                # FSDP2 swaps this one parameter object in and out of its module at every forward
                # (made at the first all-gather, then kept): lent too, a thread that trains the
                # model meanwhile cannot put a real tensor where this thread reads.
                swapped = getattr(param, "_unsharded_param", None)  # private: FSDPParam's
                if swapped is not None:
                    unit.swapped.append(swapped)
                unit.params.append(real)
                unit.places.append((info.module, info.param_name, real))
                for owner, name in zip(info.shared_modules, info.shared_param_names, strict=True):
                    unit.places.append((owner, name, real))
        units.append(unit)
    if len(worlds) > 1:
        raise NotImplementedError(f"koila.estimate cannot play FSDP2 over meshes of different sizes: {sorted(worlds)}")
    world = worlds.pop() if worlds else (fsdp or 1)
    if fsdp is not None and fsdp != world:
        raise ValueError(
            f"fsdp={fsdp} differs from the {world} ranks the model is sharded over with fully_shard; "
            "leave fsdp out to estimate for the mesh it has"
        )
    return Sharding(world, units)


def _descendants(modules: list[torch.nn.Module]) -> set[int]:
    """Return the ids of the modules among ``modules`` that lie inside another of them."""
    wanted = {id(module) for module in modules}
    inside: set[int] = set()
    for module in modules:
        for child in module.modules():
            if child is not module and id(child) in wanted:
                inside.add(id(child))
    return inside


def _recipe(modules: list[torch.nn.Module], world: int) -> Sharding:
    inside = _descendants(modules)
    units: list[Unit] = []
    owner_of: dict[int, Unit] = {}
    for root in (module for module in modules if id(module) not in inside):
        blocks: list[torch.nn.Module] = []
        _blocks(root, blocks)
        # Blocks first: a parameter belongs to the innermost sharded module holding it.
        for block in [*blocks, root]:
            unit = Unit(block, [], [], root=block is root, reshard_after_forward=block is not root)
            for owner in block.modules():
                for name, param in owner._parameters.items():
                    if param is None or owner_of.setdefault(id(param), unit) is not unit:
                        continue
                    if not any(param is mine for mine in unit.params):
                        unit.params.append(param)
                    unit.places.append((owner, name, param))
            units.append(unit)
    return Sharding(world, units)


def _blocks(module: torch.nn.Module, found: list[torch.nn.Module]) -> None:
    for child in module.children():
        if isinstance(child, torch.nn.ModuleList):
            found.extend(child)
        else:
            _blocks(child, found)


# --- playing FSDP2 in the run -------------------------------------------------------


class _AfterBackward(torch.autograd.Function):
    """Identity on a module's inputs whose backward is that module's post-backward, as FSDP2's."""

    @staticmethod
    def forward(ctx: Any, emulation: Emulation, unit: Unit, *inputs: torch.Tensor) -> Any:
        ctx.emulation, ctx.unit = emulation, unit
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.emulation.post_backward(ctx.unit)
        return (None, None, *grads)


class Emulation:
    """FSDP2's allocations, played on meta tensors in the borrowing thread."""

    def __init__(self, sharding: Sharding, copy_of: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
        self.world = sharding.world
        self.units = sharding.units
        self.mark: Callable[[str, torch.Tensor], None] = lambda category, tensor: None
        self.shards: dict[int, torch.Tensor] = {}  # id of a real parameter -> its lent shard
        self.full: dict[int, torch.Tensor] = {}  # id of a real parameter -> its full-size copy, not counted
        self.order: list[Unit] = []
        self.reduce_scatters: list[torch.Tensor] = []
        self.gathering: torch.Tensor | None = None  # the last flat all-gather output kept in forward
        self.handles: list[Any] = []
        self.callback_queued = False
        # Made outside the run's accounting: FSDP2's gathered buffers stand for them.
        with _disable_current_modes():
            for unit in self.units:
                for param, size in zip(unit.params, unit.sizes, strict=True):
                    shard = copy_of(param)
                    if shard is not None:
                        self.shards[id(param)] = shard
                    held = unit.holding.get(id(param))
                    full = copy_of(held) if held is not None else None
                    if full is None:
                        full = torch.empty(size, dtype=unit.param_dtype or unit.dtype, device=_META)
                        full = torch.nn.Parameter(full, requires_grad=param.requires_grad)
                    self.full[id(param)] = full

    # -- sizes --

    def _numels(self, unit: Unit) -> list[int]:
        """Each parameter's padded full numel, as FSDP2 gathers it."""
        return [math.prod(shard_size(size, self.world)) * self.world if size else 1 for size in unit.sizes]

    def _alloc(self, numel: int, dtype: torch.dtype, category: str) -> torch.Tensor:
        tensor = torch.empty((numel,), dtype=dtype, device=_META)
        self.mark(category, tensor)
        return tensor

    def _dtype(self, unit: Unit) -> torch.dtype:
        return unit.param_dtype or unit.dtype

    # -- installing --

    def install(self, mark: Callable[[str, torch.Tensor], None]) -> None:
        """Take FSDP2's forward hooks out of the borrower's hook dicts and put this one's in; ``mark`` categorises."""
        # After the loan began, so that what it writes lands in the borrower's dicts.
        self.mark = mark
        for unit in self.units:
            if unit.holding:
                unit.gathered = [self._alloc(numel, self._dtype(unit), "parameters") for numel in self._numels(unit)]
            module = unit.module
            for table in (module._forward_pre_hooks, module._forward_hooks):
                for key, hook in list(table.items()):
                    if sharded.is_fsdp_hook(hook):
                        del table[key]
            self.handles.append(
                module.register_forward_pre_hook(self._pre_forward_hook(unit), prepend=True, with_kwargs=True)
            )
            self.handles.append(module.register_forward_hook(self._post_forward_hook(unit)))

    def uninstall(self) -> None:
        """Remove this one's hooks and drop what it holds; the loan's end puts FSDP2's back."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for unit in self.units:
            unit.flat, unit.gathered, unit.indices, unit.state = None, [], [], "idle"
        self.reduce_scatters.clear()
        self.gathering = None
        self.order.clear()

    # -- FSDP2's steps --

    def _swap(self, unit: Unit, table: dict[int, torch.Tensor]) -> None:
        for owner, name, param in unit.places:
            copy = table.get(id(param))
            if copy is not None:
                owner._parameters[name] = copy  # type: ignore[assignment]

    def unshard(self, unit: Unit) -> None:
        """Issue the all-gather: FSDP2 allocates its flat output (the input is a view of it)."""
        if unit.gathered or unit.flat is not None or not unit.params:
            return
        if self.world > 1:
            unit.flat = self._alloc(sum(self._numels(unit)), self._dtype(unit), "parameters")

    def wait_for_unshard(self, unit: Unit, forward: bool) -> None:
        """Copy out into each parameter's own buffer; free the flat output when FSDP2 does."""
        if unit.gathered or not unit.params:
            return
        self.unshard(unit)
        dtype = self._dtype(unit)
        # FSDP2 drops the previous module's flat output (kept for overlap in forward) from its
        # context before the copy-out, but a local still holds it until the copy-out is done.
        unit.gathered = [self._alloc(numel, dtype, "parameters") for numel in self._numels(unit)]
        flat, unit.flat = unit.flat, None
        if forward:
            self.gathering = flat
        del flat
        self._swap(unit, self.full)

    def reshard(self, unit: Unit) -> None:
        """Free the gathered buffers and put the shards back."""
        if unit.gathered:
            unit.gathered = []
            self._swap(unit, self.shards)

    def _pre_forward_hook(self, unit: Unit) -> Callable[..., Any]:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            unit.state = "forward"
            self.wait_for_unshard(unit, forward=True)
            flat, spec = torch.utils._pytree.tree_flatten((args, kwargs))
            if unit.cast_inputs:
                # As FSDP2's MixedPrecisionPolicy(cast_forward_inputs=True) does.
                dtype = unit.param_dtype
                flat = [
                    leaf.to(dtype) if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() else leaf
                    for leaf in flat
                ]
                args, kwargs = torch.utils._pytree.tree_unflatten(flat, spec)
            if not torch.is_grad_enabled():
                return args, kwargs
            wanted = [i for i, leaf in enumerate(flat) if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
            if not wanted:
                return args, kwargs
            passed = _AfterBackward.apply(self, unit, *(flat[i] for i in wanted))  # type: ignore[no-untyped-call]
            for i, tensor in zip(wanted, passed, strict=True):
                flat[i] = tensor
            return torch.utils._pytree.tree_unflatten(flat, spec)

        return hook

    def _post_forward_hook(self, unit: Unit) -> Callable[..., Any]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> Any:
            if unit.state == "pre_backward":
                return None  # recomputed in backward (activation checkpointing)
            if unit.reshard_after_forward:
                self.reshard(unit)
            unit.indices.append(len(self.order))
            self.order.append(unit)
            unit.state = "idle"
            if unit.root:
                self.gathering = None
            if torch.is_grad_enabled():
                tensors = [t for t in torch.utils._pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
                tensors = [t for t in tensors if t.requires_grad]
                if tensors:
                    torch.autograd.graph.register_multi_grad_hook(
                        tensors, lambda _grads: self.pre_backward(unit), mode="any"
                    )
            return None

        return hook

    def pre_backward(self, unit: Unit) -> None:
        """Gather the module again, then prefetch the one before it in forward order."""
        if not self.callback_queued:
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._final)
        if unit.state == "pre_backward":
            return
        unit.state = "pre_backward"
        self.wait_for_unshard(unit, forward=False)
        if unit.indices:
            index = unit.indices.pop()
            if index > 0:
                self.unshard(self.order[index - 1])

    def post_backward(self, unit: Unit) -> None:
        """Reduce-scatter the module's gradients into its shards' and free the full ones, as FSDP2 does."""
        if unit.state == "post_backward":
            return
        unit.state = "post_backward"
        fulls = [self.full[id(param)] for param in unit.params]
        if not unit.reduce_grads:
            self.reshard(unit)  # the full gradients stay, to be added to
            return
        grads = []
        numels = []
        shards: list[tuple[torch.Tensor | None, torch.Size]] = []
        for param, full, size, numel in zip(unit.params, fulls, unit.sizes, self._numels(unit), strict=True):
            if full.grad is not None:
                grads.append(full.grad)
                full.grad = None
                numels.append(numel)
                shards.append((self.shards.get(id(param)), shard_size(size, self.world)))
        self.reshard(unit)
        self.reduce_scatters.clear()  # the previous module's input, kept until now
        if not grads:
            return
        reduce_dtype = unit.reduce_dtype or grads[0].dtype
        scatter = self._alloc(sum(numels), reduce_dtype, "gradients")
        grads.clear()
        output = self._alloc(sum(numels) // self.world, reduce_dtype, "gradients")
        if unit.dtype != reduce_dtype:
            output = self._alloc(sum(numels) // self.world, unit.dtype, "gradients")
        offset = 0
        for shard, size in shards:
            numel = math.prod(size)
            if shard is not None:
                part = output[offset : offset + numel].view(size)
                if shard.grad is None:
                    shard.grad = part
                else:
                    shard.grad.add_(part)
            offset += numel
        del output
        self.reduce_scatters.append(scatter)

    def _final(self) -> None:
        self.callback_queued = False
        for unit in reversed(self.units):
            if unit.state != "post_backward" and (unit.gathered or unit.state != "idle"):
                self.post_backward(unit)
        for unit in self.units:
            unit.state = "idle"
            unit.flat = None
            unit.indices.clear()
        self.reduce_scatters.clear()
        self.order.clear()
