"""The ranks' side of test_fsdp.py: ``koila.accumulate`` over FSDP2 modules, on spawned gloo groups.

A model of three sharded blocks and a root (``fully_shard`` on each block, then on the whole), float64,
with a layer in the middle block that runs out of memory on chosen forward calls, in its forward or
in its backward, and FSDP's own collectives that can be made to run out of memory as they allocate
their buffers. How the scenarios run and what they save: tests/_spawn.py.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import sys
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from _layers import CheckpointedMiddle, Inject
from _spawn import Scenarios
from torch import nn
from torch.nn import functional as F

import koila_retry as koila
from koila_retry._core import distributed, sharded
from koila_retry.compat.toma import explicit
from koila_retry.testing import make_oom, simulated_device

GROUPS = {"one": (1, 60), "two": (2, 60), "three": (3, 60)}
scenario = Scenarios(GROUPS)
DTYPE = torch.float64
ROWS = 12  # each rank's rows


def main(rank: int, group: str, port: int, directory: str) -> None:
    """The body of one spawned rank (see tests/_spawn.py)."""
    scenario.run(rank, group, port, directory)


def model(twice: bool = False) -> nn.Sequential:
    """Three blocks and a head; with ``twice``, the last block runs twice in each forward (shared weights)."""
    torch.manual_seed(0)
    blocks = [
        nn.Sequential(nn.Linear(6, 8), nn.Tanh()),
        nn.Sequential(nn.Linear(8, 8), Inject(), nn.Tanh()),
        nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
    ]
    return nn.Sequential(*blocks, *blocks[2:] * twice, nn.Linear(8, 1)).to(DTYPE)


def shard(net: nn.Sequential, **options: Any) -> nn.Sequential:
    """Shard each block, then the whole net, with ``fully_shard``'s ``options`` for the blocks."""
    from torch.distributed.fsdp import fully_shard

    # On the CPU, also where CUDA is present (fully_shard's default mesh is on the accelerator).
    mesh = cpu_mesh()
    for block in net[:3]:
        fully_shard(block, mesh=mesh, **options)
    fully_shard(net, mesh=mesh)
    return net


def cpu_mesh() -> Any:
    """The default process group's ranks, as a mesh of CPU devices."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def batch(world: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(world * ROWS, 6, generator=generator, dtype=DTYPE)
    return x, torch.randn(world * ROWS, 1, generator=generator, dtype=DTYPE)


def local(tensor: torch.Tensor, rank: int) -> torch.Tensor:
    return tensor[rank * ROWS : (rank + 1) * ROWS]


def full(tensors: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Every rank's shards gathered (a collective, on every rank in the same order)."""
    return [None if t is None else t.full_tensor() if hasattr(t, "full_tensor") else t for t in tensors]


class Allocations:
    """FSDP's communication buffers, watched by weak reference; the Nth made may run out of memory."""

    def __init__(self, fail_at: set[int]) -> None:
        self.fail_at, self.made = fail_at, 0
        self.alive: list[weakref.ref[torch.Tensor]] = []
        self.original = sharded._Watched.allocate

    def __enter__(self) -> Allocations:
        watch = self

        def allocate(comm: Any, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            watch.made += 1
            if watch.made in watch.fail_at:
                raise make_oom()
            tensor: torch.Tensor = watch.original(comm, size, dtype=dtype, device=device)
            watch.alive.append(weakref.ref(tensor))
            return tensor

        sharded._Watched.allocate = allocate  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        sharded._Watched.allocate = self.original  # type: ignore[method-assign]

    def live(self) -> int:
        return sum(ref() is not None for ref in self.alive)


class CopyFails:
    """The first copy koila's FSDP2 code makes (``Tensor.clone`` called from sharded.py) runs out of memory."""

    def __init__(self, armed: bool) -> None:
        self.armed, self.original = armed, torch.Tensor.clone

    def __enter__(self) -> CopyFails:
        watch = self

        def clone(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if watch.armed and sys._getframe(1).f_code.co_filename == sharded.__file__:
                watch.armed = False
                raise make_oom()
            copied: torch.Tensor = watch.original(tensor, *args, **kwargs)
            return copied

        torch.Tensor.clone = clone  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        torch.Tensor.clone = self.original  # type: ignore[method-assign]


def _unsharded(net: nn.Module) -> list[torch.Tensor]:
    """The unsharded parameters (private FSDP2 state: FSDPParam._unsharded_param) made so far."""
    found = []
    for module in net.modules():
        if sharded.is_fsdp2(module):
            for group in sharded.param_groups(module):
                for fsdp_param in group.fsdp_params:
                    unsharded = getattr(fsdp_param, "_unsharded_param", None)
                    if unsharded is not None:
                        found.append(unsharded)
    return found


def unsharded_alive(net: nn.Module) -> int:
    """Parameters whose unsharded storage is allocated."""
    return sum(unsharded.untyped_storage().size() > 0 for unsharded in _unsharded(net))


def unsharded_grads(net: nn.Module) -> int:
    """Unsharded parameters that hold a gradient: a failed backward's, if the reset left it (the trap)."""
    return sum(unsharded.grad is not None for unsharded in _unsharded(net))


class Count:
    """Counts, while in force, the collectives a failed rank played along and the agreement's exchanges."""

    def __init__(self) -> None:
        self.plays = self.exchanges = 0
        self.play, self.minimum = sharded._Collective.play, distributed.Agreement._minimum

    def __enter__(self) -> Count:
        count = self

        def play(collective: Any) -> None:
            count.plays += 1
            count.play(collective)

        def minimum(agreement: Any, *args: Any) -> list[int]:
            count.exchanges += 1
            result: list[int] = count.minimum(agreement, *args)
            return result

        sharded._Collective.play = play  # type: ignore[method-assign]
        distributed.Agreement._minimum = minimum  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        sharded._Collective.play = self.play  # type: ignore[method-assign]
        distributed.Agreement._minimum = self.minimum  # type: ignore[method-assign]


def _step(
    rank: int,
    world: int,
    *,
    failures: dict[int, dict[int, str]] | None = None,
    allocations: dict[int, set[int]] | None = None,
    initial: int | None = None,
    sync: bool | None = None,
    failing: int = 1,
    custom: bool = False,
    sharding: dict[str, Any] | None = None,
    twice: bool = False,
    warm: bool = False,
) -> dict[str, Any]:
    """Steps of a sharded model with SGD, OOMs injected on the first ``failing``, then one without; checked.

    With ``failing=2`` the second step fails as the first did, after the first recorded its micro-batches'
    collectives: a rank that fails then plays along the others' collectives. With ``warm``, a step without
    failures comes first, and records the whole batch's. With ``custom``, the model's all-gathers go through
    a comm of the user's (:class:`Gather`).
    """
    plain = model(twice)
    reference = copy.deepcopy(plain)
    net = shard(plain, **(sharding or {}))
    if custom:
        for module in sharded.fsdp_modules(net.modules()):
            module.set_custom_all_gather(Gather())  # type: ignore[operator]
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    events: list[koila.OOMEvent] = []
    seen: dict[str, int] = {}

    def on_oom(event: koila.OOMEvent) -> None:
        events.append(event)
        # After the memory of the failed attempt is released: nothing of it may be left.
        seen["unsharded"] = max(seen.get("unsharded", 0), unsharded_alive(net))
        seen["unsharded_grads"] = max(seen.get("unsharded_grads", 0), unsharded_grads(net))
        # gloo's worker thread drops a finished collective's last reference to its buffer itself,
        # once it holds the interpreter: let it (a buffer that koila kept would stay alive).
        deadline = time.monotonic() + 10
        while watch.live() and time.monotonic() < deadline:
            time.sleep(0.01)
        seen["buffers"] = max(seen.get("buffers", 0), watch.live())

    @koila.accumulate(initial=initial, cache=koila.NoCache(), on_oom=on_oom, sync=sync)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(net(x), y)

    steps = []
    for number in range(warm + failing + 1):
        x_all, y_all = batch(world, seed=10 + number)
        inject: Inject = net[1][1]
        fails = warm <= number < warm + failing
        inject.failures = (failures or {}).get(rank, {}) if fails else {}
        inject.rows = []
        failing_allocations = (allocations or {}).get(rank, set()) if fails else set()
        with Allocations(failing_allocations) as watch, Count() as count:
            loss = step(local(x_all, rank), local(y_all, rank))
        reference_optimizer.zero_grad()
        F.mse_loss(reference(x_all), y_all).backward()
        steps.append(
            {
                "loss": loss.detach(),
                "grads": full([p.grad for p in net.parameters()]),
                "expected": [p.grad.clone() for p in reference.parameters()],
                "size": step.stats.batch_size,
                "rows": list(inject.rows),
                "plays": count.plays,
                "exchanges": count.exchanges,
            }
        )
        optimizer.step()
        reference_optimizer.step()
        optimizer.zero_grad()
    return {
        "steps": steps,
        "parameters": full(list(net.parameters())),
        "expected_parameters": [p.detach().clone() for p in reference.parameters()],
        "events": [(event.batch_size, event.next_batch_size, event.rank) for event in events],
        "seen": seen,
        "ooms": step.stats.ooms,
    }


# Forward call 0 is the whole batch's; a split step's later calls are its micro-batches.
SCENARIOS: dict[str, Callable[[int], dict[str, Any]]] = {
    # The last rank's forward runs out of memory at the first attempt.
    "forward_first": lambda world: {"failures": {world - 1: {0: "forward"}}},
    # Rank 0's backward runs out of memory at the first attempt.
    "backward_first": lambda world: {"failures": {0: {0: "backward"}}},
    # Every rank fails: the even ranks in their forward, the odd ones in their backward.
    "every_rank": lambda world: {
        "failures": {rank: {0: "forward" if rank % 2 == 0 else "backward"} for rank in range(world)}
    },
    # Rank 1 fails the whole batch, and at the next size its second micro-batch's backward.
    "later_attempt": lambda world: {"failures": {1: {0: "forward", 2: "backward"}}},
    # Rank 0 runs out of memory as FSDP allocates its third all-gather's buffer (the last block's, in
    # the first forward), rank 1 as it allocates a reduce-scatter's (in the first backward).
    "in_collectives": lambda world: {"allocations": {0: {3}, 1: {6}}},
    # Without agreement (sync=False, or one rank): every rank fails alike, and retries alone.
    "alone": lambda world: {"failures": {rank: {0: "backward", 2: "forward"} for rank in range(world)}, "sync": False},
}
# The scenarios one rank runs, where there is nothing to agree on.
ALONE = ("forward_first", "backward_first", "alone")
# After a step that records the whole batch's collectives, run twice (failing=2): the second time, the failed
# ranks play along. "first_micro_batch": rank 1 fails the
# whole batch, then the backward of its first micro-batch of 6 rows (gradient sync off).
PLAYED = {
    **{name: SCENARIOS[name] for name in ("forward_first", "backward_first", "every_rank", "later_attempt")},
    "in_collectives": lambda world: {"allocations": {0: {3}, 1: {6}}},
    "first_micro_batch": lambda world: {"failures": {1: {0: "forward", 1: "backward"}}},
    # Blocks kept gathered after their forward: no all-gather in the backward, another schedule.
    "kept_gathered": lambda world: {
        "failures": {1: {0: "backward"}},
        "sharding": {"reshard_after_forward": False},
    },
    # A block that runs twice per forward reduce-scatters once more in a micro-batch that follows one with
    # gradient sync off than in one that does not: a failed rank must play the schedule of the right one.
    "block_used_twice": lambda world: {"failures": {1: {0: "forward", 2: "backward"}}, "twice": True},
}


class Gather:
    """A comm of the user's for FSDP2's all-gathers (``set_custom_all_gather``): the plain collective, as FSDP2's."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False
    ) -> Any:
        import torch.distributed as dist

        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


@scenario("two")
def fsdp_custom_comm(rank: int, world: int) -> dict[str, Any]:
    """A custom all-gather: koila cannot tell what its collectives are, so every micro-batch votes, none plays."""
    return _step(rank, world, failures={0: {0: "backward"}}, failing=2, custom=True)


@scenario("two", "three")
def fsdp_played_before_forward(rank: int, world: int) -> dict[str, Any]:
    """The last rank fails in the function, before its first forward: the others learn of it as theirs begins."""
    before = [rank == world - 1]
    options: dict[str, Any] = {}

    @koila.batch(initial=ROWS, cache=koila.NoCache(), on_oom=lambda event: options["on_oom"](event))
    def predict(batch_size: int, net: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if options["armed"] and before[0]:
            before[0] = False
            raise make_oom()
        return torch.cat([net(x[begin : begin + batch_size]) for begin in range(0, len(x), batch_size)])

    def run(net: nn.Module, x: torch.Tensor, on_oom: Callable[[koila.OOMEvent], None]) -> torch.Tensor:
        options["on_oom"], options["armed"] = on_oom, len(options.get("calls", ())) == 2
        options.setdefault("calls", []).append(None)
        return predict(net, x)

    value = _forward_only(rank, world, run, warm=True, inject=False)
    value["failed_before"] = not before[0] and rank == world - 1
    return value


@scenario("two", "three")
def fsdp_fails_before_the_models_first_forward(rank: int, world: int) -> dict[str, Any]:
    """The last rank fails in the step before a new sharded model's first forward, which makes FSDP2's state.

    Putting FSDP2 back read state that its first forward makes: the failed rank raised AttributeError and
    the others waited in their forward's all-gather. A step and an inference, each on a model of its own.
    """
    values: dict[str, Any] = {}
    for kind in ("accumulate", "batch"):
        plain = model()
        reference = copy.deepcopy(plain)
        net = shard(plain)
        armed = [rank == world - 1]

        def fail_first(armed: list[bool] = armed) -> None:
            if armed[0]:
                armed[0] = False
                raise make_oom()

        x_all, y_all = batch(world, seed=31)
        x, y = local(x_all, rank), local(y_all, rank)
        if kind == "accumulate":

            @koila.accumulate(cache=koila.NoCache())
            def step(xb: torch.Tensor, yb: torch.Tensor, net: nn.Module = net) -> torch.Tensor:
                fail_first()
                return F.mse_loss(net(xb), yb)

            step(x, y)
            F.mse_loss(reference(x_all), y_all).backward()
            got, expected = full([p.grad for p in net.parameters()]), [p.grad for p in reference.parameters()]
        else:

            @koila.batch(initial=ROWS, cache=koila.NoCache())
            def predict(batch_size: int, rows: torch.Tensor, net: nn.Module = net) -> torch.Tensor:
                fail_first()
                with torch.no_grad():
                    return torch.cat([net(rows[at : at + batch_size]) for at in range(0, len(rows), batch_size)])

            got, expected = [predict(x)], [reference(x).detach()]
            step = predict
        failed = rank == world - 1 and not armed[0]
        values[kind] = {"got": got, "expected": expected, "failed": failed, "ooms": step.stats.ooms}
    return values


def _register(name: str, played: bool) -> None:
    def run(rank: int, world: int) -> dict[str, Any]:
        options = (PLAYED if played else SCENARIOS)[name](world)
        return _step(rank, world, **options, failing=2 if played else 1, warm=played)

    run.__name__ = f"fsdp_{'played_' if played else ''}{name}"
    scenario("two", "three", *(("one",) if name in ALONE and not played else ()))(run)


for _name in SCENARIOS:
    _register(_name, played=False)
for _name in PLAYED:
    _register(_name, played=True)


@scenario("two")
def fsdp_private_state(rank: int, world: int) -> dict[str, list[str]]:
    """The private FSDP2 state the reset reads and writes, looked for on a sharded model that trained a step."""
    net = shard(model())
    x, y = batch(world, seed=3)
    F.mse_loss(net(local(x, rank)), local(y, rank)).backward()
    state = net._get_fsdp_state()
    group = sharded.param_groups(net)[0]
    # torch 2.13 names a list of groups and of reduce-scatter inputs kept; torch 2.11 one of each.
    groups = "_fsdp_param_groups" if hasattr(state, "_fsdp_param_groups") else "_fsdp_param_group"
    kept = "reduce_scatter_states" if hasattr(state._comm_ctx, "reduce_scatter_states") else "reduce_scatter_state"
    wanted = {
        # What the reset reads and writes (koila_retry/_core/sharded.py), and what the estimate reads
        # to play FSDP2 (koila_retry/_estimation/sharding.py).
        "state": (
            state,
            [
                groups,
                "_training_state",
                "_modules_to_run_forward",
                "_state_ctx",
                "_comm_ctx",
                "_modules",
                "_mp_policy",
                "_auto_reshard_after_forward",
            ],
        ),
        "context": (state._state_ctx, ["iter_forward_root", "post_backward_final_callback_queued"]),
        "comms": (state._comm_ctx, ["all_gather_state", "post_forward_order", kept]),
        "group": (
            group,
            [
                "_all_gather_result",
                "_post_reduce_event",
                "_partial_reduce_output",
                "_all_reduce_state",
                "_all_gather_comm",
                "_reduce_scatter_comm",
                "_training_state",
                "fsdp_params",
                "mesh_info",
                "post_forward_mesh_info",
                "reduce_grads",
                "reshard_after_backward",
                "_sharded_state",
                "is_unsharded",
            ],
        ),
        "mesh": (group.mesh_info, ["shard_mesh_size"]),
        "param": (
            group.fsdp_params[0],
            [
                "unsharded_accumulated_grad",
                "_unsharded_param",
                "_module_info",
                "sharded_param",
                "unsharded_param",
                "fsdp_placement",
                "offload_to_cpu",
                "free_unsharded_param",
                "all_gather_outputs",
            ],
        ),
    }
    return {place: [name for name in names if not hasattr(owner, name)] for place, (owner, names) in wanted.items()}


Forward = Callable[[nn.Module, torch.Tensor, Callable[[koila.OOMEvent], None]], torch.Tensor]


def _forward_only(rank: int, world: int, run: Forward, warm: bool = False, inject: bool = True) -> dict[str, Any]:
    """A sharded model's forward over this rank's rows, its last rank failing the first call's forward.

    With ``warm``, two calls that fail nowhere run first and record the collectives (the first call's forward
    gathers the root, which a forward without backward leaves gathered): the failed rank plays along.
    """
    plain = model()
    reference = copy.deepcopy(plain)
    net = shard(plain)
    layer: Inject = net[1][1]
    x = local(batch(world, seed=20)[0], rank)
    unsharded: list[int] = []

    def on_oom(event: koila.OOMEvent) -> None:
        unsharded.append(unsharded_alive(net))  # after the failed attempt's memory was released

    with torch.no_grad():
        for _ in range(2 if warm else 0):
            run(net, x, on_oom)
            layer.rows = []
        layer.failures = {0: "forward"} if rank == world - 1 and inject else {}
        with Count() as count:
            got = run(net, x, on_oom)
        expected = reference(x)
    return {"got": got, "expected": expected, "rows": layer.rows, "unsharded": unsharded, "plays": count.plays}


def _batch() -> Forward:
    # One wrapper for both calls of a scenario, as a user's would be.
    options: dict[str, Any] = {}

    @koila.batch(initial=ROWS, cache=koila.NoCache(), on_oom=lambda event: options["on_oom"](event))
    def predict(batch_size: int, net: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([net(x[begin : begin + batch_size]) for begin in range(0, len(x), batch_size)])

    def run(net: nn.Module, x: torch.Tensor, on_oom: Callable[[koila.OOMEvent], None]) -> torch.Tensor:
        options["on_oom"] = on_oom
        return predict(net, x)

    return run


def _chunked() -> Forward:
    return lambda net, x, on_oom: koila.chunked(net, x, initial=ROWS, cache=koila.NoCache(), on_oom=on_oom)


def _attempts() -> Forward:
    def run(net: nn.Module, x: torch.Tensor, on_oom: Callable[[koila.OOMEvent], None]) -> torch.Tensor:
        for attempt in koila.attempts(initial=ROWS, cache=koila.NoCache(), on_oom=on_oom):
            with attempt:
                size = attempt.batch_size
                out = torch.cat([net(x[begin : begin + size]) for begin in range(0, ROWS, size)])
        return out

    return run


FORWARDS = {"batch": _batch, "chunked": _chunked, "attempts": _attempts}


def _register_forward(name: str, warm: bool) -> None:
    def run(rank: int, world: int) -> dict[str, Any]:
        return _forward_only(rank, world, FORWARDS[name](), warm=warm)

    run.__name__ = f"fsdp_{'played_' if warm else ''}{name}"
    scenario("two", "three")(run)


for _name in FORWARDS:
    _register_forward(_name, warm=False)
for _name in FORWARDS:
    _register_forward(_name, warm=True)


@scenario("two")
def fsdp_batch_over_uneven_rows(rank: int, world: int) -> dict[str, Any]:
    """``batch`` over FSDP2 with fewer rows on the last rank, which fails above half of them: every rank raises.

    The message spoke of DDP's first backward and model.module, none of which a sharded forward has.
    """
    net = shard(model())
    layer: Inject = net[1][1]
    x = local(batch(world, seed=27)[0], rank)[: ROWS // 2 if rank == world - 1 else ROWS]
    layer.failures = {0: "forward"} if rank == world - 1 else {}
    predict = _batch()
    with torch.no_grad():
        try:
            predict(net, x, lambda event: None)
            caught = ""
        except RuntimeError as exc:
            caught = str(exc)
        layer.failures = {}
        again = predict(net, local(batch(world, seed=27)[0], rank), lambda event: None)
    return {"caught": caught, "again": list(again.shape)}


@scenario("two")
def fsdp_with_a_ddp_module_in_one_step(rank: int, world: int) -> dict[str, Any]:
    """A DDP student and an FSDP2 teacher in one step (distillation): refused on every rank, before it runs.

    A rank that failed played FSDP2's collectives along but not DDP's buckets, and gloo aborted the job.
    Then the teacher's outputs computed before a step of the student's own, as the message says.
    """
    from torch.nn.parallel import DistributedDataParallel

    teacher = shard(model())
    student = DistributedDataParallel(model())
    x, _ = batch(world, seed=26)
    x = local(x, rank)
    ran: list[int] = []

    @koila.accumulate(initial=ROWS, cache=koila.NoCache())
    def step(x: torch.Tensor) -> torch.Tensor:
        ran.append(len(x))
        with torch.no_grad():
            target = teacher(x)
        return F.mse_loss(student(x), target)

    @koila.accumulate(initial=ROWS, cache=koila.NoCache())
    def student_step(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        ran.append(len(x))
        return F.mse_loss(student(x), target)

    try:
        step(x)
        error = ""
    except NotImplementedError as exc:
        error = str(exc)
    refused = {"error": error, "ran": list(ran), "grads": [p.grad is None for p in student.parameters()]}
    with torch.no_grad():
        target = teacher(x)
    student_step(x, target)
    return {**refused, "then": ran[len(refused["ran"]) :]}


@scenario("two")
def fsdp_two_models(rank: int, world: int) -> dict[str, Any]:
    """Two models sharded apart, one after the other in each forward (a draft's and a target's), no grad.

    For each forward front end, three calls; the last rank fails inside the second model's forward in the
    first call, then in the third (after calls that recorded the collectives). Each root holds a head.
    """
    first = model()
    torch.manual_seed(1)
    second = nn.Sequential(nn.Sequential(nn.Linear(1, 8), nn.Tanh()), Inject(), nn.Linear(8, 2)).to(DTYPE)
    references = copy.deepcopy(first), copy.deepcopy(second)
    shard(first)
    from torch.distributed.fsdp import fully_shard

    fully_shard(second[0], mesh=cpu_mesh())
    fully_shard(second, mesh=cpu_mesh())
    layer: Inject = second[1]
    x = local(batch(world, seed=24)[0], rank)
    with torch.no_grad():
        expected = references[1](references[0](x))
    both = _Both(first, second)
    outcomes: dict[str, Any] = {}
    with torch.no_grad():
        for name, make in FORWARDS.items():
            runs = []
            for call in range(3):
                layer.rows = []
                layer.failures = {0: "forward"} if rank == world - 1 and call in (0, 2) else {}
                got = make()(both, x, lambda event: None)
                runs.append({"equal": bool(torch.allclose(got, expected, rtol=1e-12, atol=1e-12)), "rows": layer.rows})
            outcomes[name] = runs
    return outcomes


class _Predicting(nn.Sequential):
    @koila.chunked(initial=ROWS, cache=koila.NoCache())
    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self(x)


def _fill(chunk: torch.Tensor, begin: int, end: int, net: nn.Module, out: torch.Tensor) -> None:
    out[begin:end] = net(chunk)


@scenario("two")
def fsdp_one_wrapper_two_models(rank: int, world: int) -> dict[str, Any]:
    """One wrapper called over a sharded model, then another, the last rank failing in the second's forward.

    The parallel modules were looked for at the first call only: the second model's forward had no hook of
    koila's, a rank that failed there never played its all-gathers along, and the ranks hung.
    """
    first, second = _Predicting(*model()), _Predicting(*model())
    with torch.no_grad():
        for parameter in second.parameters():
            parameter.mul_(0.5)
    reference = copy.deepcopy(second)
    shard(first)
    shard(second)
    x = local(batch(world, seed=25)[0], rank)
    with torch.no_grad():
        expected = reference(x)

    @koila.chunked(initial=ROWS, cache=koila.NoCache())
    def infer(x: torch.Tensor, net: nn.Module) -> torch.Tensor:
        return net(x)

    def toma(net: nn.Module) -> torch.Tensor:
        out = torch.empty(ROWS, 1, dtype=DTYPE)
        explicit.chunked(_fill, x, ROWS, net, out)  # toma's roots: (fn, tensor, args, kwargs)
        return out

    predict = _batch()
    runs: dict[str, Callable[[_Predicting], torch.Tensor]] = {
        "chunked": lambda net: infer(x, net=net),
        "batch": lambda net: predict(net, x, lambda event: None),
        "chunked method": lambda net: net.predict(x),  # the instance is the bound method's, not an argument
        "toma": toma,
    }
    layer: Inject = second[1][1]
    outcomes: dict[str, Any] = {}
    with torch.no_grad():
        for name, run in runs.items():
            run(first)
            layer.rows = []
            layer.failures = {0: "forward"} if rank == world - 1 else {}
            got = run(second)
            outcomes[name] = {"equal": bool(torch.allclose(got, expected, rtol=1e-12, atol=1e-12)), "rows": layer.rows}
    return outcomes


@scenario("two")
def fsdp_alone_wrapper_given_a_sharded_model_after_a_plain_one(rank: int, world: int) -> dict[str, Any]:
    """A ``sync=False`` step first given a model outside FSDP, then a sharded one whose backward fails on every rank.

    The sharded modules were looked for at the first call only: the second model's gradients were captured
    apart, FSDP2's hooks saw none to reduce, and its parameters kept no gradient.
    """
    plain = model()
    reference = copy.deepcopy(plain)
    net = shard(plain)
    inject: Inject = net[1][1]

    @koila.accumulate(cache=koila.NoCache(), sync=False)
    def step(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(module(x), y)

    x_all, y_all = batch(world, seed=27)
    x, y = local(x_all, rank), local(y_all, rank)
    step(model(), x, y)
    inject.rows = []
    inject.failures = {0: "backward"}
    step(net, x, y)
    F.mse_loss(reference(x_all), y_all).backward()
    return {
        "grads": full([p.grad for p in net.parameters()]),
        "expected": [p.grad for p in reference.parameters()],
        "rows": inject.rows,
        "ooms": step.stats.ooms,
    }


@scenario("two")
def fsdp_two_steps_of_one_model(rank: int, world: int) -> dict[str, Any]:
    """Two steps over one sharded model, the second with two forwards: each its own record of collectives.

    The first step records its collectives; the last rank then fails the second step's first forward at its
    first call, which must not play along the first step's (fewer, and others) as if they were its own.
    """
    plain = model()
    reference = copy.deepcopy(plain)
    net = shard(plain)
    inject: Inject = net[1][1]

    def two_forwards(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(module(x) + module(x * 0.5), y)

    @koila.accumulate(cache=koila.NoCache())
    def once(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(net(x), y)

    @koila.accumulate(cache=koila.NoCache())
    def twice(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return two_forwards(net, x, y)

    x_all, y_all = batch(world, seed=30)
    x, y = local(x_all, rank), local(y_all, rank)
    once(x, y)
    net.zero_grad()
    inject.rows = []
    inject.failures = {0: "forward"} if rank == world - 1 else {}
    with Count() as count:
        twice(x, y)
    two_forwards(reference, x_all, y_all).backward()
    return {
        "grads": full([p.grad for p in net.parameters()]),
        "expected": [p.grad for p in reference.parameters()],
        "rows": inject.rows,
        "plays": count.plays,
        "ooms": twice.stats.ooms,
    }


@scenario("two")
def fsdp_step_after_a_forward_without_backward(rank: int, world: int) -> dict[str, Any]:
    """A step after a forward without backward, which leaves the root gathered, fails on the last rank.

    FSDP2 does not reshard the root after its forward, and with no backward to follow, its unsharded
    parameters stay registered on it: the step's gradients of the sharded ones must still be set aside.
    """
    plain = model()
    reference = copy.deepcopy(plain)
    net = shard(plain)
    inject: Inject = net[1][1]
    sharded = list(net.parameters())  # as the optimizer holds them

    @koila.accumulate(cache=koila.NoCache())
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(net(x), y)

    x_all, y_all = batch(world, seed=31)
    x, y = local(x_all, rank), local(y_all, rank)
    registered = []
    for failures in ({}, {0: "forward"} if rank == world - 1 else {}):
        with torch.no_grad():
            net(x)  # an evaluation: the root stays gathered
        registered.append(any(p is not q for p, q in zip(net.parameters(), sharded, strict=True)))
        for parameter in sharded:
            parameter.grad = None
        inject.rows, inject.failures = [], failures
        with Count() as count:
            step(x, y)
    F.mse_loss(reference(x_all), y_all).backward()
    return {
        "grads": full([p.grad for p in sharded]),
        "expected": [p.grad for p in reference.parameters()],
        "registered": registered,
        "rows": inject.rows,
        "plays": count.plays,
        "ooms": step.stats.ooms,
    }


class _Both(nn.Module):
    def __init__(self, first: nn.Module, second: nn.Module) -> None:
        super().__init__()
        self.first, self.second = first, second

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


@scenario("two")
def fsdp_refusals(rank: int, world: int) -> dict[str, Any]:
    """HSDP (replicas of a sharded model) and an FSDP2 model over other ranks than agree are refused."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    x, y = batch(world, seed=30)
    hsdp = fully_shard(model(), mesh=init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard")))
    outcomes = {}

    @koila.accumulate(cache=koila.NoCache())
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(hsdp(x), y)

    outcomes["hsdp"] = _refusal(lambda: step(local(x, rank), local(y, rank)))
    net = shard(model())

    @koila.accumulate(initial="auto", cache=koila.NoCache())
    def estimated(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(net(x), y)

    outcomes["auto"] = _refusal(lambda: estimated(local(x, rank), local(y, rank)))

    @koila.accumulate(initial="auto", cache=koila.NoCache())
    def given(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(module(x), y)

    given(model(), local(x, rank), local(y, rank))  # estimated: no sharded module
    outcomes["auto later"] = _refusal(lambda: given(net, local(x, rank), local(y, rank)))
    # A torch whose FSDP2 lacks private state the reset writes: refused before the step, not at a failure.
    older = shard(model())
    group = sharded.param_groups(older[1])[0]
    del group._post_reduce_event

    @koila.accumulate(cache=koila.NoCache())
    def old_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(older(x), y)

    outcomes["private"] = _refusal(lambda: old_step(local(x, rank), local(y, rank)))
    return outcomes


def _refusal(call: Callable[[], object]) -> str:
    """What ``call`` raised as NotImplementedError, or "ran"."""
    try:
        call()
    except NotImplementedError as error:
        return str(error)
    return "ran"


@scenario("two")
def fsdp_uneven_rows(rank: int, world: int) -> dict[str, Any]:
    """Ranks with different numbers of rows would run different numbers of micro-batches: refused on both."""
    net = shard(model())
    rows = ROWS if rank == 0 else ROWS - 4
    x, y = torch.randn(rows, 6, dtype=DTYPE), torch.randn(rows, 1, dtype=DTYPE)

    @koila.accumulate(initial=4, cache=koila.NoCache())
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(net(x), y)

    try:
        step(x, y)
        refused = "ran"
    except ValueError as error:
        refused = f"ValueError: {error}"
    even = torch.randn(ROWS, 6, dtype=DTYPE), torch.randn(ROWS, 1, dtype=DTYPE)
    step(*even)  # the same wrapper, given as many rows as the other rank: served
    return {
        "refused": refused,
        "then": step.stats.batch_size,
        "grads": sum(p.grad is not None for p in net.parameters()),
    }


@scenario("two")
def fsdp_leaves_outside_modules(rank: int, world: int) -> dict[str, Any]:
    """A scale the step holds, with a gradient from before, and the input: leaves of no module it reaches."""
    plain = model()
    reference = copy.deepcopy(plain)
    net = shard(plain)
    net[1][1].failures = {0: "backward"} if rank == 0 else {}
    x_all, y_all = batch(world, seed=44)
    x, y = local(x_all, rank), local(y_all, rank)
    before = torch.full((1,), 0.25, dtype=DTYPE)
    scale = torch.ones(1, dtype=DTYPE, requires_grad=True)
    scale.grad = before.clone()
    aside = scale.grad
    x.requires_grad_(True)

    @koila.accumulate(cache=koila.NoCache())
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(net(x) * scale, y)

    step(x, y)
    # FSDP averages the sharded model's gradients over the ranks; the scale's and the input's are this rank's.
    local_scale = torch.ones(1, dtype=DTYPE, requires_grad=True)
    local_x = x.detach().clone().requires_grad_(True)
    F.mse_loss(copy.deepcopy(reference)(local_x) * local_scale, y).backward()
    F.mse_loss(reference(x_all), y_all).backward()
    return {
        "grads": full([p.grad for p in net.parameters()]),
        "expected": [p.grad for p in reference.parameters()],
        "scale": scale.grad,
        "expected_scale": before + local_scale.grad,
        "same_tensor": scale.grad is aside,
        "input": x.grad,
        "expected_input": local_x.grad,
        "size": step.stats.batch_size,
    }


def _after_a_backward_without_sync(
    rank: int, world: int, failing: set[int], where: str, sync: bool, played: bool = False
) -> dict[str, Any]:
    """A backward of the caller's own with gradient sync off, then a step whose first attempt fails on ``failing``.

    ``played``: a step before records the collectives, so that the failed rank plays along.
    """
    plain = model()
    reference = copy.deepcopy(plain)
    net = shard(plain)
    first_all, first_y_all = batch(world, seed=46)
    x_all, y_all = batch(world, seed=48)

    @koila.accumulate(cache=koila.NoCache(), sync=sync)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(net(x) * 1.0, y)

    calls = 0
    if played:  # a step after a backward of the caller's own, as below: it records that kind of micro-batch
        net.set_requires_gradient_sync(False)
        F.mse_loss(net(local(first_all, rank)), local(first_y_all, rank)).backward()
        net.set_requires_gradient_sync(True)
        step(local(first_all, rank), local(first_y_all, rank))
        net.zero_grad(set_to_none=True)
        calls = 2
    net.set_requires_gradient_sync(False)
    F.mse_loss(net(local(first_all, rank)), local(first_y_all, rank)).backward()
    net.set_requires_gradient_sync(True)
    kept = [fsdp_param.unsharded_param.grad for fsdp_param in sharded.param_groups(net[1])[0].fsdp_params]
    copies = [grad.clone() for grad in kept]
    if where != "copy":
        net[1][1].failures = {calls + 1: where} if rank in failing else {}  # the caller's own forward came before
    with (
        warnings.catch_warnings(record=True) as caught,
        Count() as count,
        CopyFails(where == "copy" and rank in failing) as fails,
    ):
        warnings.simplefilter("always")
        step(local(x_all, rank), local(y_all, rank))
    assert not fails.armed, "no copy ran out of memory"
    F.mse_loss(reference(first_all), first_y_all).backward()
    F.mse_loss(reference(x_all), y_all).backward()
    return {
        "grads": full([p.grad for p in net.parameters()]),
        "expected": [p.grad for p in reference.parameters()],
        "kept_unchanged": all(torch.equal(grad, copy) for grad, copy in zip(kept, copies, strict=True)),
        "size": step.stats.batch_size,
        "unsharded_grads": unsharded_grads(net),
        "warnings": [str(each.message) for each in caught],
        "played": count.plays > 0,
    }


@scenario("two")
def fsdp_after_a_backward_without_sync_in_mixed_precision(rank: int, world: int) -> dict[str, Any]:
    """As above with a reduce dtype above the parameters': FSDP2 keeps the unsharded sum in its own attribute.

    Compared with a twin trained by hand in the micro-batches koila ends at, in the same order.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float64)
    plain = model()
    nets = [plain, copy.deepcopy(plain)]
    mesh = cpu_mesh()
    for net in nets:
        for block in net[:3]:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(net, mesh=mesh, mp_policy=policy)
    first_all, first_y_all = batch(world, seed=46)
    x_all, y_all = batch(world, seed=48)
    x, y = local(x_all, rank), local(y_all, rank)
    for net in nets:
        net.set_requires_gradient_sync(False)
        F.mse_loss(net(local(first_all, rank)), local(first_y_all, rank)).backward()
        net.set_requires_gradient_sync(True)
    kept = sharded.param_groups(nets[0][1])[0].fsdp_params[0].unsharded_accumulated_grad
    net, hand = nets
    for index, (rows, targets) in enumerate(zip(x.split(8), y.split(8), strict=True)):
        hand.set_requires_gradient_sync(index == 1)
        (F.mse_loss(hand(rows), targets) * len(rows) / ROWS).backward()
    net[1][1].failures = {1: "backward"} if rank == 0 else {}

    @koila.accumulate(cache=koila.NoCache())
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(net(x), y)

    step(x, y)
    return {
        "kept_dtype": None if kept is None else str(kept.dtype),
        "size": step.stats.batch_size,
        "grads": full([p.grad for p in net.parameters()]),
        "expected": full([p.grad for p in hand.parameters()]),
    }


@scenario("two")
def fsdp_after_a_backward_without_sync_gives_up(rank: int, world: int) -> dict[str, Any]:
    """A step that gives up hands back the very tensors the caller's backward left unsharded, unwritten."""
    net = shard(model())
    first_all, first_y_all = batch(world, seed=46)
    x_all, y_all = batch(world, seed=48)
    net.set_requires_gradient_sync(False)
    F.mse_loss(net(local(first_all, rank)), local(first_y_all, rank)).backward()
    net.set_requires_gradient_sync(True)
    fsdp_params = sharded.param_groups(net[1])[0].fsdp_params
    kept = [fsdp_param.unsharded_param.grad for fsdp_param in fsdp_params]
    copies = [grad.clone() for grad in kept]
    net[1][1].failures = {1: "backward"} if rank == 0 else {}

    @koila.accumulate(cache=koila.NoCache(), minimum=ROWS)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(net(x) * 1.0, y)

    try:
        step(local(x_all, rank), local(y_all, rank))
    except koila.BatchSizeExhausted:
        gave_up = True
    else:
        gave_up = False
    now = [fsdp_param.unsharded_param.grad for fsdp_param in fsdp_params]
    return {
        "gave_up": gave_up,
        "same_tensors": all(a is b for a, b in zip(now, kept, strict=True)),
        "unchanged": all(torch.equal(grad, copy) for grad, copy in zip(kept, copies, strict=True)),
        "sharded_grads": sum(p.grad is not None for p in net.parameters()),
    }


@scenario("two")
def fsdp_after_a_backward_without_sync(rank: int, world: int) -> dict[str, Any]:
    """A backward of the caller's own with gradient sync off, then a step: FSDP2's unsharded gradients add up."""
    return _after_a_backward_without_sync(rank, world, set(), "", sync=True)


@scenario("two")
def fsdp_after_a_backward_without_sync_a_forward_fails(rank: int, world: int) -> dict[str, Any]:
    return _after_a_backward_without_sync(rank, world, {0}, "forward", sync=True)


@scenario("two")
def fsdp_after_a_backward_without_sync_a_backward_fails(rank: int, world: int) -> dict[str, Any]:
    return _after_a_backward_without_sync(rank, world, {0}, "backward", sync=True)


@scenario("two")
def fsdp_after_a_backward_without_sync_a_played_backward_fails(rank: int, world: int) -> dict[str, Any]:
    """As above, after a step that recorded the collectives: the failed rank plays along the rest."""
    return _after_a_backward_without_sync(rank, world, {0}, "backward", sync=True, played=True)


@scenario("two")
def fsdp_after_a_backward_without_sync_a_played_copy_fails(rank: int, world: int) -> dict[str, Any]:
    """As above, the copy of the caller's unsharded gradients running out of memory: the rank plays it all along."""
    return _after_a_backward_without_sync(rank, world, {0}, "copy", sync=True, played=True)


@scenario("two")
def fsdp_after_a_backward_without_sync_a_forward_front_end_fails(rank: int, world: int) -> dict[str, Any]:
    """A hand loop's first micro-batch (sync off), an evaluation in chunks that fails on the last rank, the second."""
    plain = model()
    reference = copy.deepcopy(plain)
    net = shard(plain)
    x_all, y_all = batch(world, seed=49)
    x, y = local(x_all, rank), local(y_all, rank)
    outputs = []
    for failing in (False, True):  # the first records the evaluation's collectives: the failed rank plays along
        for p in net.parameters():
            p.grad = None
        net.set_requires_gradient_sync(False)
        (F.mse_loss(net(x[:6]), y[:6]) * 0.5).backward()
        net[1][1].rows = []
        net[1][1].failures = {0: "forward"} if failing and rank == world - 1 else {}
        with torch.no_grad(), Count() as count:
            outputs.append(koila.chunked(net, x, cache=koila.NoCache()))
        net.set_requires_gradient_sync(True)
        (F.mse_loss(net(x[6:]), y[6:]) * 0.5).backward()
    for part in (slice(0, 6), slice(6, ROWS)):
        rows = torch.cat([local(x_all, r)[part] for r in range(world)])
        targets = torch.cat([local(y_all, r)[part] for r in range(world)])
        (F.mse_loss(reference(rows), targets) * 0.5).backward()
    with torch.no_grad():
        expected_output = reference(x)
    return {
        "grads": full([p.grad for p in net.parameters()]),
        "expected": [p.grad for p in reference.parameters()],
        "outputs": outputs,
        "expected_output": expected_output,
        "rows": net[1][1].rows,
        "plays": count.plays,
    }


@scenario("two")
def fsdp_after_a_backward_without_sync_every_backward_fails_alone(rank: int, world: int) -> dict[str, Any]:
    """Without agreement (``sync=False``): every rank fails alike, and each resets FSDP2 itself."""
    return _after_a_backward_without_sync(rank, world, {0, 1}, "backward", sync=False)


@scenario("two")
def fsdp_unsharded_head(rank: int, world: int) -> dict[str, Any]:
    """A head outside FSDP: its backward runs before the failing one, and what it wrote must not stay."""
    plain = model()
    reference = copy.deepcopy(plain)
    net = shard(plain)
    torch.manual_seed(1)
    head = nn.Linear(1, 1).to(DTYPE)
    reference_head = copy.deepcopy(head)
    net[1][1].failures = {0: "backward"} if rank == 0 else {}
    x_all, y_all = batch(world, seed=40)
    x, y = local(x_all, rank), local(y_all, rank)

    @koila.accumulate(cache=koila.NoCache())
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(head(net(x)), y)

    step(x, y)
    # FSDP averages the sharded model's gradients over the ranks; the head's are this rank's alone.
    local_head = copy.deepcopy(reference_head)
    F.mse_loss(local_head(copy.deepcopy(reference)(x)), y).backward()
    F.mse_loss(reference_head(reference(x_all)), y_all).backward()
    return {
        "grads": full([p.grad for p in net.parameters()]),
        "expected": [p.grad for p in reference.parameters()],
        "head": [p.grad for p in head.parameters()],
        "expected_head": [p.grad for p in local_head.parameters()],
        "size": step.stats.batch_size,
    }


@scenario("two")
def fsdp_play_along_after_an_attempt_held_in_a_cycle(rank: int, world: int) -> dict[str, Any]:
    """Rank 1's first forward runs out of memory beside a tensor its frame holds in a reference cycle.

    On rank 1's simulated device, that tensor leaves less than one all-gather's buffers free, and
    automatic collection is off: the zeros rank 1 plays along with fit only once the frame is collected.
    Played before any collection, rank 1 raised alone and rank 0 waited for its collectives.
    """
    plain = model()
    reference = copy.deepcopy(plain)
    net = shard(plain)
    limit, calls = 64 * 1024, []
    events: list[koila.OOMEvent] = []

    @koila.accumulate(initial=ROWS, cache=koila.NoCache(), on_oom=events.append)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if calls == [ROWS] and rank == 1:
            held = torch.empty(limit - 512, dtype=torch.uint8)  # noqa: F841 (held by the frame)
            frame = sys._getframe()  # noqa: F841 (the frame refers to itself: freed by a collection only)
        calls.append(len(x))
        return F.mse_loss(net(x), y)

    x_all, y_all = batch(world, seed=50)
    x, y = local(x_all, rank), local(y_all, rank)
    step(x, y)  # the whole batch's collectives, recorded
    net.zero_grad(set_to_none=True)
    with Count() as count:
        gc.disable()
        try:
            with simulated_device(limit) if rank == 1 else contextlib.nullcontext():
                result = "returned" if step(x, y) is not None else "none"
        except Exception as exc:  # reported to the test
            result = f"{type(exc).__name__}: {exc}"
        finally:
            gc.enable()
    F.mse_loss(reference(x_all), y_all).backward()
    return {
        "result": result,
        "calls": calls,
        "failed": [(event.batch_size, event.rank) for event in events],
        "plays": count.plays,
        "grads": full([p.grad for p in net.parameters()]),
        "expected": [p.grad for p in reference.parameters()],
    }


def _masked_loss(out: torch.Tensor, y: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """The mean squared error over the rows ``kept`` holds: 0/0 (nan) where it holds none, as many losses are."""
    return ((out - y) ** 2 * kept).sum() / kept.sum()


def _weighing_nothing(rank: int, world: int, weightless: dict[int, slice], failures: dict[int, str]) -> dict[str, Any]:
    """Micro-batches of 4 rows, some of which weigh nothing (``weight=`` counts no row of theirs), on some ranks.

    ``weightless``: by rank, the rows its mask drops; ``failures``: the last rank's forward calls that fail.
    """
    plain = model()
    reference = copy.deepcopy(plain)
    net = shard(plain)
    inject: Inject = net[1][1]
    x_all, y_all = batch(world, seed=61)
    masks = [torch.ones(ROWS, 1, dtype=DTYPE) for _ in range(world)]
    for where, rows in weightless.items():
        masks[where][rows] = 0
    for other in range(world):  # each rank's own mean, averaged over the ranks by the reduce-scatter
        (_masked_loss(reference(local(x_all, other)), local(y_all, other), masks[other]) / world).backward()
    inject.failures = failures if rank == world - 1 else {}

    @koila.accumulate(initial=4, cache=koila.NoCache(), weight=lambda x, y, kept: kept.sum())
    def step(x: torch.Tensor, y: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        return _masked_loss(net(x), y, kept)

    loss = step(local(x_all, rank), local(y_all, rank), masks[rank])
    return {
        "loss": float(loss),
        "grads": full([p.grad for p in net.parameters()]),
        "expected": [p.grad for p in reference.parameters()],
        "rows": inject.rows,
        "ooms": step.stats.ooms,
    }


@scenario("two")
def fsdp_last_micro_batch_weighs_nothing(rank: int, world: int) -> dict[str, Any]:
    # Its backward was skipped: the earlier micro-batches' gradients, accumulated unsharded, were never
    # reduce-scattered, and the step returned with no gradient at all on the sharded parameters.
    return _weighing_nothing(rank, world, {r: slice(8, None) for r in range(world)}, {})


@scenario("two")
def fsdp_first_micro_batch_weighs_nothing_on_one_rank(rank: int, world: int) -> dict[str, Any]:
    # Rank 0 skipped the backward of its first micro-batch, and the re-gathering collectives of it that
    # rank 1 made: the ranks waited in each other's collectives until the group's timeout.
    return _weighing_nothing(rank, world, {0: slice(0, 4)}, {})


@scenario("two")
def fsdp_a_micro_batch_that_weighs_nothing_fails(rank: int, world: int) -> dict[str, Any]:
    # The last rank runs out of memory in the backward of its last micro-batch, which weighs nothing.
    return _weighing_nothing(rank, world, {r: slice(8, None) for r in range(world)}, {2: "backward"})


def _weightless_through_a_checkpoint(rank: int, world: int, mode: str) -> dict[str, Any]:
    """As ``_weighing_nothing``, the middle micro-batch on every rank, with ``CheckpointedMiddle(mode)``."""
    plain = CheckpointedMiddle(mode)
    reference = copy.deepcopy(plain)
    net = shard(plain)
    x_all, y_all = batch(world, seed=63)
    kept = torch.ones(ROWS, 1, dtype=DTYPE)
    kept[4:8] = 0
    for other in range(world):
        (_masked_loss(reference(local(x_all, other)), local(y_all, other), kept) / world).backward()

    @koila.accumulate(initial=4, cache=koila.NoCache(), weight=lambda x, y, kept: kept.sum())
    def step(x: torch.Tensor, y: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        return _masked_loss(net(x), y, kept)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the walk's, that a reentrant checkpoint hides leaves
        step(local(x_all, rank), local(y_all, rank), kept)
    return {"grads": full([p.grad for p in net.parameters()]), "expected": [p.grad for p in reference.parameters()]}


@scenario("two")
def fsdp_weightless_micro_batch_through_reentrant_checkpoints(rank: int, world: int) -> dict[str, Any]:
    """The middle micro-batch weighs nothing on every rank; the middle block is checkpointed reentrantly.

    A checkpoint's own backward wrote the 0/0 of a mean over no rows into the unsharded parameters, which
    the walk of the graph does not show, and the reduce-scatter spread nan to every rank.
    """
    return {mode: _weightless_through_a_checkpoint(rank, world, mode) for mode in ("module", "closure", "function")}


@scenario("two")
def fsdp_gives_up_after_allocating_part_of_an_all_gathers_outputs(rank: int, world: int) -> dict[str, Any]:
    """The last rank runs out of memory allocating the second parameter's all-gather output of a group.

    The group stayed sharded, so the reset's reshard freed nothing of it: the first parameter's output, a
    whole unsharded parameter, stayed allocated after the step gave up.
    """
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    net = shard(model())
    x_all, y_all = batch(world, seed=65)
    x, y = local(x_all, rank), local(y_all, rank)

    @koila.accumulate(initial=ROWS, minimum=ROWS, cache=koila.NoCache())
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(net(x), y)

    step(x, y)  # FSDP2's buffers as they are between steps
    net.zero_grad(set_to_none=True)
    original = FSDPParam.alloc_all_gather_outputs
    calls = [0]

    def alloc_all_gather_outputs(self: Any) -> None:
        calls[0] += 1
        if calls[0] == 2:
            raise make_oom()
        original(self)

    if rank == world - 1:
        FSDPParam.alloc_all_gather_outputs = alloc_all_gather_outputs  # type: ignore[method-assign]
    try:
        step(x, y)
        outcome = "returned"
    except koila.BatchSizeExhausted:
        outcome = "gave up"
    finally:
        FSDPParam.alloc_all_gather_outputs = original  # type: ignore[method-assign]
    left = [
        fsdp_param._param_fqn
        for module in sharded.fsdp_modules(list(net.modules()))
        for group in sharded.param_groups(module)
        for fsdp_param in group.fsdp_params
        if any(output.untyped_storage().nbytes() for output in fsdp_param.all_gather_outputs)
    ]
    return {"outcome": outcome, "calls": calls[0], "left": left, "grads": [p.grad for p in net.parameters()]}


def _trains_in_a_forward_front_end(rank: int, world: int, front: str, warm: bool, held: bool) -> dict[str, Any]:
    """A function that trains (``zero_grad()``, then a backward per micro-batch) under ``batch`` or ``attempts``.

    The last rank's backward runs out of memory in the last call's whole batch. With ``warm``, a call that fails
    nowhere comes first and records the collectives: the failed rank plays along. With ``held``, each call follows
    a backward of the caller's own with gradient sync off, whose unsharded gradients the first micro-batch adds
    onto. A twin, sharded alike, runs the same micro-batches by hand.
    """
    plain = model()
    net, hand = shard(copy.deepcopy(plain)), shard(plain)
    layer: Inject = net[1][1]
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    x_all, y_all = batch(world, seed=51)
    before_all, before_y_all = batch(world, seed=52)
    x, y, before, before_y = (local(tensor, rank) for tensor in (x_all, y_all, before_all, before_y_all))

    def train(module: nn.Module, size: int) -> None:
        for begin in range(0, ROWS, size):
            rows, targets = x[begin : begin + size], y[begin : begin + size]
            (F.mse_loss(module(rows), targets) * (len(rows) / ROWS)).backward()

    @koila.batch(initial=ROWS, cache=koila.NoCache())
    def trained(batch_size: int) -> int:
        optimizer.zero_grad()  # as batch's docs ask of a function that calls backward()
        train(net, batch_size)
        return batch_size

    def attempted() -> int:
        for attempt in koila.attempts(initial=ROWS, cache=koila.NoCache()):
            with attempt:
                optimizer.zero_grad()
                train(net, attempt.batch_size)
        return attempt.batch_size

    run = trained if front == "batch" else attempted
    calls = []
    for call in range(1 + warm):
        for module in (net, hand) if held else ():
            module.set_requires_gradient_sync(False)
            F.mse_loss(module(before), before_y).backward()
            module.set_requires_gradient_sync(True)
        layer.rows = []
        layer.failures = {0: "backward"} if call == warm and rank == world - 1 else {}
        with Count() as count:
            size = run()
        for parameter in hand.parameters():
            parameter.grad = None
        train(hand, size)
        calls.append(
            {
                "size": size,
                "rows": list(layer.rows),
                "plays": count.plays,
                "grads": full([p.grad for p in net.parameters()]),
                "expected": full([p.grad for p in hand.parameters()]),
                "unsharded_grads": unsharded_grads(net),
            }
        )
    return {"calls": calls}


def _register_training(front: str, warm: bool, held: bool) -> None:
    def run(rank: int, world: int) -> dict[str, Any]:
        return _trains_in_a_forward_front_end(rank, world, front, warm, held)

    run.__name__ = f"fsdp_{front}_trains{'_played' if warm else ''}{'_after_a_backward_without_sync' if held else ''}"
    scenario("two", *(("three",) if not held else ()))(run)


for _front in ("batch", "attempts"):
    for _warm in (False, True):
        for _held in (False, True):
            _register_training(_front, _warm, _held)


@scenario("two")
def fsdp_tensor_parallel_beside_a_sharded_block(rank: int, world: int) -> dict[str, str]:
    """Layers parallelized on a 1-D mesh (``DTensor`` parameters that no ``fully_shard`` manages) beside FSDP2."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(6, 8), nn.Tanh()).to(DTYPE)
    fully_shard(block, mesh=cpu_mesh())
    # A rank that ran out of memory between its layers would leave the others in their all-reduce: gloo aborts.
    parallel = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)).to(DTYPE)
    parallelize_module(parallel, cpu_mesh(), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    net = nn.Sequential(block, parallel)
    x = local(batch(world, seed=53)[0], rank)
    y = torch.zeros(ROWS, 8, dtype=DTYPE)

    @koila.accumulate(cache=koila.NoCache())
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(net(x), y)

    @koila.batch(initial=ROWS, cache=koila.NoCache())
    def predict(batch_size: int) -> torch.Tensor:
        return torch.cat([net(x[begin : begin + batch_size]) for begin in range(0, ROWS, batch_size)])

    return {"accumulate": _refusal(lambda: step(x, y)), "batch": _refusal(predict)}


def _sync_flags(net: nn.Module) -> list[bool]:
    """Each FSDP2 parameter group's gradient sync (private: FSDPParamGroup.reduce_grads), in module order."""
    return [
        group.reduce_grads for module in sharded.fsdp_modules(net.modules()) for group in sharded.param_groups(module)
    ]


@scenario("two")
def fsdp_step_keeps_the_callers_gradient_sync(rank: int, world: int) -> dict[str, Any]:
    """Steps with gradient sync off (on the whole model, or on one block only): a step that succeeds at once, one
    whose first attempt fails on the last rank, and one that gives up. Each syncs, and leaves the flags as found.
    """
    outcomes: dict[str, Any] = {}
    for whole in (True, False):
        plain = model()
        reference = copy.deepcopy(plain)
        net = shard(plain)
        layer: Inject = net[1][1]

        @koila.accumulate(cache=koila.NoCache(), minimum=4)
        def step(x: torch.Tensor, y: torch.Tensor, net: nn.Module = net) -> torch.Tensor:
            return F.mse_loss(net(x), y)

        runs = []
        for number, failures in enumerate(({}, {0: "backward"}, {0: "backward", 1: "forward", 2: "forward"})):
            x_all, y_all = batch(world, seed=54 + number)
            if whole:
                net.set_requires_gradient_sync(False)
            else:
                net[1].set_requires_gradient_sync(False, recurse=False)
            found = _sync_flags(net)
            layer.rows = []
            layer.failures = failures if rank == world - 1 else {}
            try:
                step(local(x_all, rank), local(y_all, rank))
                outcome = "returned"
            except koila.BatchSizeExhausted:
                outcome = "gave up"
            left = _sync_flags(net)
            net.set_requires_gradient_sync(True)
            reference.zero_grad(set_to_none=True)
            if outcome == "returned":
                F.mse_loss(reference(x_all), y_all).backward()
            runs.append(
                {
                    "outcome": outcome,
                    "found": found,
                    "left": left,
                    "grads": full([p.grad for p in net.parameters()]),
                    "expected": [p.grad for p in reference.parameters()],
                }
            )
            for parameter in net.parameters():
                parameter.grad = None
        outcomes["whole" if whole else "one block"] = runs
    return outcomes
