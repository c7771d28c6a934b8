"""The ranks' side of test_distributed.py: scenarios that every rank of a spawned gloo group runs in turn.

How they run and what they save: tests/_spawn.py. Scenarios that must raise catch the error and return
its type and message.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import functools
import gc
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, NamedTuple, cast

import torch
import torch.distributed as dist
from _dispatch import FailCast, FailCombining
from _layers import CheckpointedMiddle, Inject
from _spawn import Scenarios
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import koila_retry as koila
from koila_retry._core import distributed, overlap
from koila_retry._diagnostics.report import HoldsGradients
from koila_retry.testing import make_oom, simulated_device

DTYPE = torch.float64
KIB = 1024

# The groups of processes, by name: how many ranks, and how long a collective may wait before it raises.
# "crash" runs the scenarios where a regression would kill or hang a rank (DDP collectives out of step):
# apart, with a shorter timeout, so that the other groups still run. A rank may wait that long for
# another one in a correct run too (while it estimates, say), and a busy machine makes it wait several
# times as long as an idle one: the timeouts guard against hangs, with room to spare.
GROUPS = {"two": (2, 60), "three": (3, 60), "crash": (2, 30)}

scenario = Scenarios(GROUPS)


def main(rank: int, group: str, port: int, directory: str) -> None:
    """The body of one spawned rank (see tests/_spawn.py)."""
    scenario.run(rank, group, port, directory)


# --------------------------------------------------------------------------- helpers


def gradients_of_step() -> dict[int, torch.Tensor]:
    """Return the gradients that the running ``koila.accumulate`` step computed so far (tests/test_hygiene.py)."""
    frame = sys._getframe(1)
    while frame is not None:
        for value in frame.f_locals.values():
            if isinstance(value, HoldsGradients):
                return value.gradients_of_step()
        frame = frame.f_back
    raise AssertionError("no koila.accumulate step is running")


def data(n: int, *shape: int, seed: int) -> torch.Tensor:
    return torch.randn(n, *shape, generator=torch.Generator().manual_seed(seed), dtype=DTYPE)


def caught(run: Callable[[], Any]) -> dict[str, Any]:
    """Run ``run``; return what it returned, or the type and message of what it raised."""
    try:
        return {"returned": run()}
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc), "attributes": dict(vars(exc))}


def event_dict(event: koila.OOMEvent) -> dict[str, Any]:
    return {
        "batch_size": event.batch_size,
        "next_batch_size": event.next_batch_size,
        "attempt": event.attempt,
        "where": event.where,
        "rank": event.rank,
    }


class Fixed(koila.GlobalCache):
    """One key for every call: a cache that can be filled before the first call."""

    def key(self, *args: Any, **kwargs: Any) -> str:
        return "key"


def grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def full_grads(model: nn.Module, loss: Callable[[nn.Module], torch.Tensor]) -> list[torch.Tensor | None]:
    """The gradient of ``loss(copy)`` for a fresh copy of ``model``, with no gradients before."""
    reference = copy.deepcopy(model)
    reference.zero_grad(set_to_none=True)
    loss(reference).backward()
    return grads(reference)


def mean_of(many: list[list[torch.Tensor | None]]) -> list[torch.Tensor | None]:
    """Average lists of gradients, a None counting as zeros; None where every one is None."""
    averaged: list[torch.Tensor | None] = []
    for column in zip(*many, strict=True):
        present = [g for g in column if g is not None]
        averaged.append(None if not present else sum(present) / len(column))
    return averaged


def injected_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), Inject(), nn.Linear(8, 1)).to(DTYPE)


def global_batch(world: int, rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of the whole job: ``rows`` rows for each rank, rank r's from ``r * rows``."""
    return data(world * rows, 6, seed=seed), data(world * rows, 1, seed=seed + 1)


def local(tensor: torch.Tensor, rank: int, rows: int) -> torch.Tensor:
    return tensor[rank * rows : (rank + 1) * rows]


def sizes_tried(events: list[koila.OOMEvent], stats: koila.Stats) -> list[int]:
    return [event.batch_size for event in events] + [stats.batch_size]


# --------------------------------------------------------------------------- 1. batch, attempts, chunked, range

# The largest size that fits on each rank where a scenario fails above a size (different on each rank).
FITS = {0: 16, 1: 4, 2: 8}


@scenario("two", "three")
def batch_simulated(rank: int, world: int) -> dict[str, Any]:
    # 2 KiB a row: on rank 0 sizes up to 128 fit, rank 1 32, rank 2 64.
    x = data(1000, 256, seed=rank)
    limit = {0: 400 * KIB, 1: 100 * KIB, 2: 200 * KIB}[rank]
    seen: list[int] = []

    @koila.batch(initial=512, cache=koila.NoCache())
    def total(batch_size: int, x: torch.Tensor) -> torch.Tensor:
        seen.append(batch_size)
        # Slices, not x.split(): under a simulated device, split() would import torch._dynamo (seconds).
        return torch.stack([x[i : i + batch_size].exp().sum() for i in range(0, len(x), batch_size)]).sum()

    with simulated_device(limit):
        result = total(x)
    return {
        "seen": seen,
        "size": total.stats.batch_size,
        "ooms": total.stats.ooms,
        "result": result,
        "expected": x.exp().sum(),
    }


@scenario("two")
def accelerate_compat(rank: int, world: int) -> dict[str, Any]:
    # accelerate's own decorator would leave rank 0 at 128 and rank 1 at 92, and the
    # ranks' collectives out of step; on the engine both take the 90% steps together.
    from koila_retry.compat.accelerate import find_executable_batch_size

    seen: list[int] = []

    @find_executable_batch_size(starting_batch_size=128)
    def train(batch_size: int) -> int:
        seen.append(batch_size)
        if rank == 1 and batch_size > 100:
            raise make_oom()
        return batch_size

    return {"seen": seen, "size": train()}


@scenario("two")
def toma_compat(rank: int, world: int) -> dict[str, Any]:
    """toma's forms run on each rank alone, as toma does, unless a call reaches a DDP module.

    They agreed under any process group: a call on rank 0 alone (an evaluation) paired its agreement
    with the job's next collective (rank 1 aborted), and shards of their own sizes were refused.
    """
    from koila_retry.compat.toma import toma

    @toma.batch(initial_batchsize=8)
    def evaluate(batch_size: int) -> int:
        return batch_size

    evaluated = evaluate() if rank == 0 else None
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)  # the job's next collective, on every rank
    shard = torch.arange(10.0 if rank == 0 else 7.0)  # shards of their own sizes
    sums: list[float] = []

    def add(chunk: torch.Tensor, begin: int, end: int) -> None:
        if rank == 1 and len(chunk) > 2:  # rank 1 runs out of memory alone, and retries alone
            raise make_oom()
        sums.append(float(chunk.sum()))

    toma.explicit.chunked(add, shard, 4)
    torch.manual_seed(0)
    ddp = DDP(nn.Linear(3, 1).double())
    x = torch.randn(6, 3, dtype=torch.float64)
    seen: list[int] = []

    def forward(chunk: torch.Tensor, begin: int, end: int, out: torch.Tensor) -> None:
        seen.append(len(chunk))
        if rank == 1 and len(chunk) > 3:  # over a DDP module the ranks agree: both run smaller
            raise make_oom()
        with torch.no_grad():
            out[begin:end] = ddp(chunk)

    out = torch.empty(6, 1, dtype=torch.float64)
    toma.explicit.chunked(forward, x, 6, out)
    with torch.no_grad():
        expected = ddp.module(x)

    def predict(model: nn.Module) -> torch.Tensor:
        # A helper's closure: one per call, each over the model it is given, looked at anew.
        def fill(chunk: torch.Tensor, begin: int, end: int, out: torch.Tensor) -> None:
            with torch.no_grad():
                out[begin:end] = model(chunk)

        out = torch.empty(6, 1, dtype=torch.float64)
        toma.explicit.chunked(fill, x, 6, out)
        return out

    predict(ddp)  # over the DDP module, on every rank: agreed
    alone = predict(ddp.module) if rank == 0 else None  # over the plain module, on rank 0 alone
    dist.all_reduce(total)
    return {
        "evaluated": evaluated,
        "total": float(total),
        "sum": sum(sums),
        "seen": seen,
        "equal": bool(torch.equal(out, expected)),
        "alone": alone is None or bool(torch.equal(alone, expected)),
    }


@scenario("two", "three")
def batch_async(rank: int, world: int) -> dict[str, Any]:
    seen: list[int] = []

    @koila.batch(initial=64, cache=koila.NoCache())
    async def double(batch_size: int, value: int) -> int:
        seen.append(batch_size)
        await asyncio.sleep(0)
        if batch_size > FITS[rank]:
            raise make_oom()
        return 2 * value + batch_size

    result = asyncio.run(double(rank))
    return {"seen": seen, "result": result, "size": double.stats.batch_size}


@scenario("two", "three")
def attempts_injected(rank: int, world: int) -> dict[str, Any]:
    x = data(100, 3, seed=rank)
    seen: list[int] = []
    for attempt in koila.attempts(initial=64, cache=koila.NoCache()):
        with attempt:
            seen.append(attempt.batch_size)
            if attempt.batch_size > FITS[rank]:
                raise make_oom()
            value = torch.stack([chunk.square().sum() for chunk in x.split(attempt.batch_size)]).sum()
    return {
        "seen": seen,
        "size": attempt.batch_size,
        "ooms": attempt.stats.ooms,
        "result": value,
        "expected": x.square().sum(),
    }


@scenario("two", "three")
def chunked_injected(rank: int, world: int) -> dict[str, Any]:
    # Chunks above FITS * 4 rows fail on each rank; the last rank also fails its 4th call, a later chunk.
    x = data(200, 5, seed=rank)
    rows: list[int] = []

    @koila.chunked(initial=64, cache=koila.NoCache())
    def twice_exp(x: torch.Tensor) -> torch.Tensor:
        rows.append(x.shape[0])
        if x.shape[0] > 4 * FITS[rank] or (rank == world - 1 and len(rows) == 4):
            raise make_oom()
        return x.exp() * 2

    result = twice_exp(x)
    return {"rows": rows, "size": twice_exp.stats.batch_size, "result": result, "expected": x.exp() * 2}


@scenario("two", "three")
def range_injected(rank: int, world: int) -> dict[str, Any]:
    spans: list[tuple[int, int]] = []

    def squares(begin: int, end: int) -> list[int]:
        spans.append((begin, end))
        if end - begin > FITS[rank]:
            raise make_oom()
        return [i * i for i in range(begin, end)]

    result = koila.range(squares, 0, 50, initial=32, cache=koila.NoCache())
    return {
        "spans": spans,
        "result": [value for part in result for value in part],
        "expected": [i * i for i in range(50)],
    }


@scenario("two")
def batch_grow(rank: int, world: int) -> dict[str, Any]:
    # Growing back is agreed too: every rank probes, and falls back, together.
    seen: list[int] = []

    @koila.batch(initial=64, grow=True, grow_after=1)
    def run(batch_size: int) -> int:
        seen.append(batch_size)
        if batch_size > FITS[rank]:
            raise make_oom()
        return batch_size

    return {"results": [run() for _ in range(4)], "seen": seen}


# --------------------------------------------------------------------------- 2. accumulate with DDP


def _accumulate_ddp(
    rank: int,
    world: int,
    *,
    failures: dict[int, dict[int, str]],
    initial: int | None,
    passed: bool,
    rows: int = 12,
) -> dict[str, Any]:
    """One step of a DDP model, with OOMs injected per rank (``failures[rank][forward call] = where``)."""
    model = injected_mlp()
    x_all, y_all = global_batch(world, rows)
    expected = full_grads(model, lambda m: F.mse_loss(m(x_all), y_all))
    x, y = local(x_all, rank, rows), local(y_all, rank, rows)
    with torch.no_grad():
        expected_loss = F.mse_loss(copy.deepcopy(model)(x), y)
    ddp = DDP(model)
    model[2].failures = failures.get(rank, {})
    events: list[koila.OOMEvent] = []

    @koila.accumulate(initial=initial, cache=koila.NoCache(), on_oom=events.append, ddp=ddp if passed else None)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(ddp(x), y)

    loss = step(x, y)
    return {
        "grads": grads(model),
        "expected": expected,
        "loss": loss,
        "expected_loss": expected_loss,
        "size": step.stats.batch_size,
        "ooms": step.stats.ooms,
        "tried": sizes_tried(events, step.stats),
        "events": [event_dict(event) for event in events],
        "rows": model[2].rows,
    }


@scenario("two", "three")
def accumulate_forward_first(rank: int, world: int) -> dict[str, Any]:
    # The last rank fails the whole batch's forward; the DDP module is found through the closure.
    return _accumulate_ddp(rank, world, failures={world - 1: {0: "forward"}}, initial=None, passed=False)


@scenario("two", "three")
def accumulate_forward_later(rank: int, world: int) -> dict[str, Any]:
    # Micro-batches of 4 (calls 0, 1, 2): rank 0 fails the third one's forward.
    return _accumulate_ddp(rank, world, failures={0: {2: "forward"}}, initial=4, passed=True)


@scenario("two", "three")
def accumulate_backward_first(rank: int, world: int) -> dict[str, Any]:
    return _accumulate_ddp(rank, world, failures={1: {0: "backward"}}, initial=None, passed=False)


@scenario("two", "three")
def accumulate_backward_later(rank: int, world: int) -> dict[str, Any]:
    # The last micro-batch's backward: the one DDP would all-reduce in without no_sync().
    return _accumulate_ddp(rank, world, failures={world - 1: {2: "backward"}}, initial=4, passed=True)


def _wide() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 256), nn.Tanh(), nn.Linear(256, 1)).to(DTYPE)


def _peak(model: nn.Module, x: torch.Tensor, y: torch.Tensor, size: int, *, backward: bool = True) -> int:
    """The peak bytes of a step of ``size`` rows per micro-batch (or of one forward only), on a copy."""
    probe = copy.deepcopy(model)
    with simulated_device("1GiB") as device:
        if backward:
            step = koila.accumulate(initial=size, minimum=size, sync=False, cache=koila.NoCache())(
                lambda a, b: F.mse_loss(probe(a), b)
            )
            step(x, y)
        else:
            loss = F.mse_loss(probe(x[:size]), y[:size])
            del loss
    return device.peak


@scenario("two", "three")
def accumulate_simulated(rank: int, world: int) -> dict[str, Any]:
    """Each rank gets a memory limit that fits a different micro-batch size (16, 4 and 8 rows of 32)."""
    rows = 32
    model = _wide()
    x_all, y_all = data(world * rows, 4, seed=5), data(world * rows, 1, seed=6)
    x, y = local(x_all, rank, rows), local(y_all, rank, rows)
    fits = FITS[rank]
    limit = (_peak(model, x, y, fits) + _peak(model, x, y, 2 * fits)) // 2
    expected = full_grads(model, lambda m: F.mse_loss(m(x_all), y_all))
    step, events = _step_under(model, x, y, limit)
    return {
        "grads": grads(model),
        "expected": expected,
        "size": step.stats.batch_size,
        "tried": sizes_tried(events, step.stats),
    }


def _step_under(model: nn.Module, x: torch.Tensor, y: torch.Tensor, limit: int) -> tuple[Any, list[koila.OOMEvent]]:
    """Run one accumulate step of ``model`` in DDP under a simulated device of ``limit`` bytes."""
    ddp = DDP(model)
    events: list[koila.OOMEvent] = []

    @koila.accumulate(cache=koila.NoCache(), on_oom=events.append)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(ddp(x), y)

    with simulated_device(limit):
        step(x, y)
    return step, events


@scenario("two", "three")
def accumulate_simulated_backward(rank: int, world: int) -> dict[str, Any]:
    """Rank 1's limit fits the forward of all 32 rows, not their backward; 16 rows fit whole."""
    rows = 32
    model = _wide()
    x_all, y_all = data(world * rows, 4, seed=7), data(world * rows, 1, seed=8)
    x, y = local(x_all, rank, rows), local(y_all, rank, rows)
    forward, whole, half = _peak(model, x, y, rows, backward=False), _peak(model, x, y, rows), _peak(model, x, y, 16)
    limit = (forward + whole) // 2 if rank == 1 else 1 << 30
    expected = full_grads(model, lambda m: F.mse_loss(m(x_all), y_all))
    step, events = _step_under(model, x, y, limit)
    return {
        "peaks": (forward, half, whole, limit),
        "grads": grads(model),
        "expected": expected,
        "size": step.stats.batch_size,
        "tried": sizes_tried(events, step.stats),
        "events": [event_dict(event) for event in events],
    }


@scenario("two")
def accumulate_two_ddp_modules(rank: int, world: int) -> dict[str, Any]:
    """A step that trains two DDP modules; passed as a list, then found."""
    rows = 8
    torch.manual_seed(1)
    encoder = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), Inject()).to(DTYPE)
    head = nn.Linear(8, 1).to(DTYPE)
    x_all, y_all = global_batch(world, rows, seed=20)
    expected = full_grads(nn.Sequential(encoder, head), lambda m: F.mse_loss(m(x_all), y_all))
    x, y = local(x_all, rank, rows), local(y_all, rank, rows)
    ddp_encoder, ddp_head = DDP(encoder), DDP(head)
    # Rank 1 fails the whole batch's backward in both calls (forward calls 0 and 3).
    encoder[2].failures = {0: "backward", 3: "backward"} if rank == 1 else {}
    results = {}
    for passed in (True, False):
        encoder.zero_grad(set_to_none=True)
        head.zero_grad(set_to_none=True)

        @koila.accumulate(cache=koila.NoCache(), ddp=[ddp_encoder, ddp_head] if passed else None)
        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(ddp_head(ddp_encoder(x)), y)

        step(x, y)
        results["passed" if passed else "found"] = {
            "grads": grads(nn.Sequential(encoder, head)),
            "size": step.stats.batch_size,
        }
    results["expected"] = expected
    return results


# --------------------------------------------------------------------------- 2b. DDP's overlap, and playing along


def _overlapped(
    rank: int,
    world: int,
    *,
    failures: dict[int, dict[int, str]],
    initial: int | None,
    hooked: bool,
    view: bool = False,
    deferred: bool = False,
) -> dict[str, Any]:
    """A step that succeeds, then one a rank fails, of a DDP model in four buckets; no zero_grad between them.

    ``failures[rank][forward call]`` as in ``_accumulate_ddp`` (the first step's forwards come first). With
    ``hooked``, a comm hook records, for each bucket it all-reduces, whether a backward was running. With
    ``deferred``, the hook completes every bucket's future at the last bucket, in one all-reduce.
    """
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), Inject(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)
    ).to(DTYPE)
    rows = 12
    batches = [global_batch(world, rows, seed=80), global_batch(world, rows, seed=82)]
    firsts = [full_grads(model, lambda m, b=b: F.mse_loss(m(b[0]), b[1])) for b in batches]
    expected = [_add(a, b) for a, b in zip(*firsts, strict=True)]
    # Buckets of about one layer each, once DDP rebuilt them after the first step.
    ddp = DDP(model, bucket_cap_mb=0.0001, gradient_as_bucket_view=view)
    in_backward: list[bool] = []
    if hooked:
        # Unannotated: DDP checks a hook's annotations, which are strings here (PEP 563).
        def hook(state, bucket):  # type: ignore[no-untyped-def]
            in_backward.append(torch._C._current_graph_task_id() != -1)
            return default_hooks.allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, hook)
    elif deferred:
        ddp.register_comm_hook([], _at_the_last_bucket)
    model[4].failures = failures.get(rank, {})
    events: list[koila.OOMEvent] = []

    @koila.accumulate(initial=initial, cache=koila.NoCache(), on_oom=events.append)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(ddp(x), y)

    buckets = []
    for x_all, y_all in batches:
        step(local(x_all, rank, rows), local(y_all, rank, rows))
        buckets.append(len(ddp.reducer._get_zeros_like_grad_buckets()))
    return {
        "grads": grads(model),
        "expected": expected,
        "in_backward": in_backward,
        "buckets": buckets,
        "ooms": len(events),
        "rows": model[4].rows,
    }


# Unannotated: DDP checks a hook's annotations, which are strings here (PEP 563).
def _at_the_last_bucket(state, bucket):  # type: ignore[no-untyped-def]
    """A comm hook that completes every bucket's future when the last bucket comes (DDP waits after the last)."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    state.append((bucket.buffer(), future))
    if bucket.is_last():
        pending = list(state)
        state.clear()
        flat = torch.cat([buffer.flatten() for buffer, _ in pending])
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        for (buffer, each), part in zip(pending, flat.split([buffer.numel() for buffer, _ in pending]), strict=True):
            each.set_result(buffer.copy_(part.view_as(buffer)))  # the bucket's own tensor, as allreduce_hook's
    return future


@scenario("crash")
def overlap_hook_completing_at_the_last_bucket(rank: int, world: int) -> dict[str, Any]:
    # Rank 1 fails the second step's whole batch mid-backward: a play-along that waits for each bucket's
    # future before calling the hook for the next never sees this one's complete.
    return _overlapped(rank, world, failures={1: {1: "backward"}}, initial=None, hooked=False, deferred=True)


@scenario("two", "three")
def overlap_whole_batch_fails_mid_backward(rank: int, world: int) -> dict[str, Any]:
    # The second step's whole batch (call 1): rank 1's backward fails after the two last layers' buckets.
    return _overlapped(rank, world, failures={1: {1: "backward"}}, initial=None, hooked=True)


@scenario("two", "three")
def overlap_last_micro_batch_fails_mid_backward(rank: int, world: int) -> dict[str, Any]:
    # Micro-batches of 4 (calls 0-2, then 3-5): the last rank fails the second step's last backward.
    return _overlapped(rank, world, failures={world - 1: {5: "backward"}}, initial=4, hooked=True)


@scenario("two", "three")
def overlap_earlier_micro_batch_fails(rank: int, world: int) -> dict[str, Any]:
    # Rank 0 fails the second step's second forward, under no_sync: it plays every bucket along.
    return _overlapped(rank, world, failures={0: {4: "forward"}}, initial=4, hooked=True)


@scenario("two")
def overlap_default_hook(rank: int, world: int) -> dict[str, Any]:
    return _overlapped(rank, world, failures={1: {1: "backward"}}, initial=None, hooked=False)


@scenario("two")
def overlap_gradients_as_bucket_views(rank: int, world: int) -> dict[str, Any]:
    # The first step's gradients are views of DDP's buckets, which the second step's backward writes.
    return _overlapped(rank, world, failures={1: {5: "backward"}}, initial=4, hooked=False, view=True)


class _StillStats:
    """A DDP reducer whose backward stats never change: each time the reducer marks, the same as the last."""

    def __init__(self, reducer: Any) -> None:
        self.reducer = reducer

    def get_backward_stats(self) -> list[int]:
        return [0] * len(self.reducer.get_backward_stats())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.reducer, name)


@contextlib.contextmanager
def _stats_that_tie() -> Iterator[None]:
    """Every step's reducer reports stats that tie with its last backward's (as they did now and then, to the ns)."""
    original = overlap.Overlap.__init__

    def init(self: overlap.Overlap, module: DDP, agreement: distributed.Agreement) -> None:
        original(self, module, agreement)
        self.reducer = _StillStats(self.reducer)

    overlap.Overlap.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        overlap.Overlap.__init__ = original  # type: ignore[method-assign]


@scenario("two")
def overlap_stats_that_tie(rank: int, world: int) -> dict[str, Any]:
    # As overlap_default_hook: rank 1 fails the second step's whole batch after two of four buckets went.
    with _stats_that_tie():
        return _overlapped(rank, world, failures={1: {1: "backward"}}, initial=None, hooked=False)


@scenario("two")
def overlap_stats_that_tie_hooked(rank: int, world: int) -> dict[str, Any]:
    # A hook of the user's: how many collectives it makes per bucket is its own; the gradients written say.
    with _stats_that_tie():
        return _overlapped(rank, world, failures={1: {1: "backward"}}, initial=None, hooked=True)


class _AllReducedInBackward(torch.autograd.Function):
    """The identity, whose backward all-reduces its gradient: a collective of the step's own in the backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad / dist.get_world_size()


class _NoGradientFor(torch.autograd.Function):
    """``x * scale``, whose backward gives ``scale`` no gradient: DDP marks it ready, its .grad stays as it was."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(scale)
        return x * scale

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (scale,) = ctx.saved_tensors
        return grad * scale, None


class _Between(nn.Module):
    """Put between the layers where the rank fails and the last, so its part of the backward ran before the failure."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.scale = None if kind == "collective" else nn.Parameter(torch.ones((), dtype=DTYPE))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            return _AllReducedInBackward.apply(x)
        return _NoGradientFor.apply(x, self.scale)


def _backward_of_its_own(rank: int, world: int, kind: str, hooked: bool) -> dict[str, Any]:
    """Two steps of a DDP model; rank 1 fails the second's backward once its own part (see _Between) ran."""
    results = []
    for failing in (True, False):
        torch.manual_seed(0)
        inject = Inject()
        model = nn.Sequential(
            nn.Linear(6, 8),
            nn.Tanh(),
            nn.Linear(8, 8),
            inject,
            nn.Tanh(),
            nn.Linear(8, 8),
            _Between(kind),
            nn.Linear(8, 1),
        ).to(DTYPE)
        ddp = DDP(model, bucket_cap_mb=0.0001)
        if hooked:

            def hook(state, bucket):  # type: ignore[no-untyped-def]
                return default_hooks.allreduce_hook(state, bucket)

            ddp.register_comm_hook(None, hook)
        inject.failures = {1: "backward"} if failing and rank == 1 else {}
        events: list[koila.OOMEvent] = []

        @koila.accumulate(cache=koila.NoCache(), on_oom=events.append)
        def step(x: torch.Tensor, y: torch.Tensor, ddp: DDP = ddp) -> torch.Tensor:
            return F.mse_loss(ddp(x), y)

        for seed in (40, 42):
            x_all, y_all = global_batch(world, 12, seed=seed)
            step(local(x_all, rank, 12), local(y_all, rank, 12))
        results.append({"grads": grads(model), "ooms": len(events)})
    return {"grads": results[0]["grads"], "expected": results[1]["grads"], "ooms": results[0]["ooms"]}


@scenario("two")
def overlap_collective_of_the_steps_own_in_the_backward(rank: int, world: int) -> dict[str, Any]:
    # It counts with DDP's: the collectives made since the backward began are not buckets alone.
    with _stats_that_tie():
        return _backward_of_its_own(rank, world, "collective", hooked=False)


@scenario("two")
def overlap_a_parameter_given_no_gradient(rank: int, world: int) -> dict[str, Any]:
    # A hook of the user's: DDP marked the parameter ready, launching its bucket, but its .grad did not change.
    return _backward_of_its_own(rank, world, "no gradient", hooked=True)


class BucketViews(NamedTuple):
    """A DDP model whose ``.grad`` views its buckets, with gradients from before, and its local batch."""

    ddp: DDP
    x: torch.Tensor
    y: torch.Tensor
    inject: Inject
    before: list[torch.Tensor]

    @property
    def model(self) -> nn.Module:
        return self.ddp.module

    @property
    def gradient_bytes(self) -> int:
        return sum(gradient.numel() * gradient.element_size() for gradient in self.before)

    def reset(self) -> None:
        """Give ``.grad`` the gradients from before again, in the tensors that view the buckets."""
        # Two backward passes first: after a failed step reset the reducer, the first records the order of
        # the gradients and the forward of the second rebuilds the buckets, which no step's memory should count.
        self.inject.failures = {}
        for _ in range(2):
            F.mse_loss(self.ddp(self.x), self.y).backward()
        for parameter, value in zip(self.model.parameters(), self.before, strict=True):
            parameter.grad.copy_(value)  # type: ignore[union-attr]

    def same_tensors(self, at_start: list[torch.Tensor | None]) -> bool:
        return all(p.grad is g for p, g in zip(self.model.parameters(), at_start, strict=True))


def bucket_views(rank: int, world: int, rows: int) -> BucketViews:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), Inject(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    model = model.to(DTYPE)
    ddp = DDP(model, bucket_cap_mb=0.001, gradient_as_bucket_view=True)
    x_all, y_all = global_batch(world, rows, seed=120)
    x, y = local(x_all, rank, rows), local(y_all, rank, rows)
    for _ in range(2):  # DDP rebuilds its buckets after the first; .grad then views them
        F.mse_loss(ddp(x), y).backward()
    before = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return BucketViews(ddp, x, y, model[2], before)


@scenario("two")
def overlap_bucket_views_with_gradients_from_before(rank: int, world: int) -> dict[str, Any]:
    """Gradients as bucket views, present at the start: the step against the hand loop from the same ones.

    For each split, on the simulated device: the hand loop's and the step's peaks and gradients, then
    the step again with rank 1's last backward failing once (retried), and failing always (given up).
    """
    rows = 16
    views = bucket_views(rank, world, rows)
    ddp, x, y, inject, before, model, reset = (
        views.ddp,
        views.x,
        views.y,
        views.inject,
        views.before,
        views.model,
        views.reset,
    )
    results: dict[str, Any] = {"gradient_bytes": views.gradient_bytes}
    for parts in (1, 4):
        size = rows // parts
        reset()
        with simulated_device("1GiB") as device:
            for index, (xb, yb) in enumerate(zip(x.split(size), y.split(size), strict=True)):
                with ddp.no_sync() if index < parts - 1 else contextlib.nullcontext():
                    (F.mse_loss(ddp(xb), yb) * len(xb) / rows).backward()
            hand_peak = device.peak
        hand = grads(model)
        outcome: dict[str, Any] = {"hand_peak": hand_peak, "hand": hand}
        for name, failures, minimum in (
            ("fits", {}, 1),
            ("retried", {parts - 1: "backward"}, 1),
            ("gives up", None, 0),
        ):
            reset()
            calls = len(inject.rows)
            if failures is None:  # every backward of rank 1's last micro-batch, and no smaller size allowed
                failures = {calls + n: "backward" for n in range(parts - 1, 4 * parts, parts)}
                minimum = size
            else:
                failures = {calls + n: where for n, where in failures.items()}
            inject.failures = failures if rank == 1 else {}

            @koila.accumulate(initial=size, minimum=minimum, cache=koila.NoCache())
            def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                return F.mse_loss(ddp(x), y)

            # DDP rebuilds its buckets after a reset: the tensors .grad holds now, not those of the first step.
            at_start = [p.grad for p in model.parameters()]
            with simulated_device("1GiB") as device:
                result = caught(lambda: step(x, y) is not None)
                outcome[name] = {
                    "peak": device.peak,
                    "result": result,
                    "grads": grads(model),
                    "same_tensors": views.same_tensors(at_start),
                }
        outcome["before"] = before
        results[f"k={parts}"] = outcome
    return results


@scenario("crash")
def overlap_copy_set_aside_runs_out_of_memory(rank: int, world: int) -> dict[str, Any]:
    """Gradients as bucket views, present at the start: rank 1 runs out of memory for the copy set aside.

    Made before the first attempt, the copy left rank 1 raising while rank 0 waited in the attempt's
    all-reduce. Now a failed attempt: where the copy never fits, both ranks give up (in the caller's
    own ``no_sync()`` too); where ``on_oom`` frees a cache of rank 1's, the step retries and succeeds.
    Either way ``.grad`` ends in the tensors that view the buckets, as a hand loop leaves it.
    """
    rows = 16
    views = bucket_views(rank, world, rows)
    results: dict[str, Any] = {"before": views.before}
    views.reset()
    F.mse_loss(views.ddp(views.x), views.y).backward()  # the hand loop's whole batch, from the same .grad
    results["hand"] = grads(views.model)
    hog: list[torch.Tensor] = []

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(views.ddp(x), y)

    for name, own_no_sync, frees in (
        ("never fits", False, False),
        ("inside no_sync", True, False),
        ("freed", False, True),
        ("freed inside no_sync", True, True),
    ):
        views.reset()
        at_start = [p.grad for p in views.model.parameters()]
        events: list[koila.OOMEvent] = []

        def on_oom(event: koila.OOMEvent, frees: bool = frees, events: list[koila.OOMEvent] = events) -> None:
            events.append(event)
            if frees:
                hog.clear()

        decorated = koila.accumulate(step, initial=rows, cache=koila.NoCache(), on_oom=on_oom)
        limit = 64 * KIB
        with simulated_device(limit) if rank == 1 else contextlib.nullcontext():
            # Room for all but the copy's last tensor, until on_oom frees the cache: enough for the largest
            # bucket (8,448 bytes), which a rank plays along with, not for zeros of every bucket at once.
            hog.append(torch.empty(limit - (views.gradient_bytes - 512), dtype=torch.uint8))
            with views.ddp.no_sync() if own_no_sync else contextlib.nullcontext():
                result = caught(functools.partial(decorated, views.x, views.y))
            hog.clear()
        results[name] = {
            "result": result,
            "grads": grads(views.model),
            "same_tensors": views.same_tensors(at_start),
            "failed": [(event.batch_size, event.rank) for event in events],
        }
    return results


@scenario("crash")
def overlap_play_along_after_an_attempt_held_in_a_cycle(rank: int, world: int) -> dict[str, Any]:
    """Rank 1's first forward runs out of memory beside a tensor of 60 KiB its frame holds in a reference cycle.

    On a simulated device of 64 KiB, the buffer rank 1 plays along with fits only once that frame is
    collected, and automatic collection is off. Played before any collection, rank 1 raised alone.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    model = model.to(DTYPE)
    rows = 16
    ddp = DDP(model, bucket_cap_mb=0.001)
    x_all, y_all = global_batch(world, rows, seed=130)
    x, y = local(x_all, rank, rows), local(y_all, rank, rows)
    expected = mean_of(
        [
            full_grads(model, lambda m, r=r: F.mse_loss(m(local(x_all, r, rows)), local(y_all, r, rows)))
            for r in range(world)
        ]
    )
    for _ in range(2):  # DDP rebuilds its buckets after the first: four, each played with one buffer
        F.mse_loss(ddp(x), y).backward()
    model.zero_grad(set_to_none=True)
    limit, calls = 64 * KIB, []
    events: list[koila.OOMEvent] = []

    @koila.accumulate(initial=rows, cache=koila.NoCache(), on_oom=events.append)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not calls:
            held = torch.empty(limit - 4 * KIB, dtype=torch.uint8)  # noqa: F841 (held by the frame)
            frame = sys._getframe()  # noqa: F841 (the frame refers to itself: freed by a collection only)
        calls.append(len(x))
        return F.mse_loss(ddp(x), y)

    gc.disable()
    try:
        with simulated_device(limit) if rank == 1 else contextlib.nullcontext():
            result = caught(functools.partial(step, x, y))
    finally:
        gc.enable()
    return {
        "result": result,
        "calls": calls,
        "failed": [(event.batch_size, event.rank) for event in events],
        "grads": grads(model),
        "expected": expected,
    }


def _mse_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), y)


@scenario("crash")
def combining_the_losses_runs_out_of_memory(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 runs out of memory combining the losses of two micro-batches, on DDP's overlap and its fallback.

    Combined after the ranks agreed, rank 1 raised alone while rank 0 returned.
    """
    results: dict[str, Any] = {}
    rows = 12
    x_all, y_all = global_batch(world, rows, seed=140)
    x, y = local(x_all, rank, rows), local(y_all, rank, rows)
    expected = mean_of(
        [
            full_grads(injected_mlp(), lambda m, r=r: F.mse_loss(m(local(x_all, r, rows)), local(y_all, r, rows)))
            for r in range(world)
        ]
    )
    for path in ("overlap", "fallback"):
        model = injected_mlp()
        ddp = DDP(model)
        if path == "fallback":  # a post-accumulate-grad hook keeps the overlap off
            for parameter in model.parameters():
                parameter.register_post_accumulate_grad_hook(lambda _: None)
        events: list[koila.OOMEvent] = []

        step = koila.accumulate(functools.partial(_mse_of, ddp), initial=8, cache=koila.NoCache(), on_oom=events.append)
        with FailCombining() if rank == 1 else contextlib.nullcontext():
            result = caught(functools.partial(step, x, y))
        results[path] = {
            "result": result,
            "failed": [(event.batch_size, event.rank) for event in events],
            "grads": grads(model),
            "expected": expected,
        }
    return results


@scenario("two", "three")
def overlap_leaves_outside_the_module(rank: int, world: int) -> dict[str, Any]:
    """Leaves outside the DDP module: a scale the step holds, with a gradient from before, and the input.

    Rank 1's whole-batch backward fails after both got their gradients; then micro-batches of 8. They
    must end with what one step gives: the scale its gradient from before plus this rank's (DDP averages
    only its module's), the input its own.
    """
    model = injected_mlp()
    rows = 12
    x_all, y_all = global_batch(world, rows, seed=90)
    x, y = local(x_all, rank, rows), local(y_all, rank, rows)
    before = torch.full((1,), 0.25, dtype=DTYPE)
    scale = torch.ones(1, dtype=DTYPE, requires_grad=True)
    reference, reference_scale, reference_x = copy.deepcopy(model), scale.detach().clone(), x.clone()
    reference_scale.requires_grad_(True)
    reference_x.requires_grad_(True)
    F.mse_loss(reference(reference_x) * reference_scale, y).backward()
    expected = mean_of(
        [
            full_grads(model, lambda m, r=r: F.mse_loss(m(local(x_all, r, rows)) * 1.0, local(y_all, r, rows)))
            for r in range(world)
        ]
    )
    ddp = DDP(model)
    model[2].failures = {0: "backward"} if rank == 1 else {}
    scale.grad = before.clone()
    aside = scale.grad
    x.requires_grad_(True)
    events: list[koila.OOMEvent] = []

    @koila.accumulate(cache=koila.NoCache(), on_oom=events.append)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(ddp(x) * scale, y)

    step(x, y)
    return {
        "grads": grads(model),
        "expected": expected,
        "scale": scale.grad.clone(),
        "expected_scale": before + cast_grad(reference_scale),
        "same_tensor": scale.grad is aside,
        "input": x.grad.clone(),
        "expected_input": cast_grad(reference_x),
        "ooms": len(events),
        "rows": model[2].rows,
    }


def cast_grad(tensor: torch.Tensor) -> torch.Tensor:
    """Return ``tensor.grad``, which must be there."""
    assert tensor.grad is not None
    return tensor.grad.clone()


@scenario("two")
def overlap_peak_memory(rank: int, world: int) -> dict[str, Any]:
    """Peak bytes of a DDP step on a simulated device: the hand loop's, then koila's, whole and in 4."""
    model = _wide()
    ddp = DDP(model)
    x, y = data(32, 4, seed=90 + rank), data(32, 1, seed=92 + rank)
    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    def hand(k: int) -> None:
        pieces = list(zip(x.split(32 // k), y.split(32 // k), strict=True))
        for index, (xb, yb) in enumerate(pieces):
            with ddp.no_sync() if index < k - 1 else contextlib.nullcontext():
                (F.mse_loss(ddp(xb), yb) * len(xb) / 32).backward()

    peaks: dict[str, int] = {}
    for k in (1, 4):
        step = koila.accumulate(initial=32 // k, cache=koila.NoCache())(lambda a, b: F.mse_loss(ddp(a), b))
        for present in (False, True):
            for name, run in (("hand", functools.partial(hand, k)), ("koila", functools.partial(step, x, y))):
                run()  # .grad as bucket views or not, DDP's buckets rebuilt: as in a loop's later steps
                if not present:
                    model.zero_grad(set_to_none=True)
                with simulated_device("1GiB") as device:
                    run()
                peaks[f"{name} k={k}{' .grad present' if present else ''}"] = device.peak
    return {"peaks": peaks, "gradient_bytes": gradient_bytes}


@scenario("two")
def overlap_served(rank: int, world: int) -> dict[str, Any]:
    """Which DDP set-ups keep the overlap, and what a communication hook sees on each path."""

    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)).to(DTYPE)

    hooked = net()
    hooked[0].weight.register_post_accumulate_grad_hook(lambda parameter: None)
    embedding = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1)).to(DTYPE)
    cases = {
        "default": [DDP(net())],
        "gradient_as_bucket_view": [DDP(net(), gradient_as_bucket_view=True)],
        "find_unused_parameters": [DDP(net(), find_unused_parameters=True)],
        "static_graph": [DDP(net(), static_graph=True)],
        "sparse embedding": [DDP(embedding)],
        "post-accumulate-grad hook": [DDP(hooked)],
        "two modules": [DDP(net()), DDP(net())],
    }
    served = {name: overlap.overlaps(modules) for name, modules in cases.items()}
    # The reducer's order, which play_along reads its backward stats by: as DDP builds it, with a
    # shared layer, a frozen weight, nested modules and an ignored parameter.
    shared = nn.Linear(4, 4)
    tricky = nn.Sequential(shared, nn.Sequential(nn.Linear(4, 4), shared), nn.Linear(4, 1)).to(DTYPE)
    tricky[1][0].weight.requires_grad_(False)
    DDP._set_params_and_buffers_to_ignore_for_model(tricky, ["2.bias"])
    ddp = DDP(tricky)
    order_matches = overlap._reducer_order(ddp) == ddp._build_params_for_reducer()[0]
    order_length = len(overlap._reducer_order(ddp))
    # A communication hook: called by DDP's reducer when the step keeps the overlap; on the
    # fallback (a post-accumulate-grad hook here) not called, and a warning says so, once.
    hooks: dict[str, Any] = {}
    for name in ("overlap", "fallback"):
        model = net()
        if name == "fallback":
            model[0].weight.register_post_accumulate_grad_hook(lambda parameter: None)
        ddp = DDP(model)
        calls: list[int] = []

        def hook(state, bucket, calls=calls):  # type: ignore[no-untyped-def]
            calls.append(1)
            return default_hooks.allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, hook)
        step = koila.accumulate(cache=koila.NoCache())(lambda x, y, ddp=ddp: F.mse_loss(ddp(x), y))
        x, y = data(8, 4, seed=95 + rank), data(8, 1, seed=97 + rank)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step(x, y)
            step(x, y)
        said = [str(w.message) for w in caught if "communication hook" in str(w.message)]
        hooks[name] = {"calls": len(calls), "warnings": said}
        # Inside the caller's own no_sync(): the step's gradients averaged once, and no_sync still on after it.
        with ddp.no_sync():
            step(x, y)
            hooks[name]["no_sync kept"] = not ddp.require_backward_grad_sync
        hooks[name]["calls in no_sync"] = len(calls) - hooks[name]["calls"]
    return {"served": served, "hooks": hooks, "order_matches": order_matches, "order_length": order_length}


@scenario("two")
def static_graph_first_iteration(rank: int, world: int) -> dict[str, Any]:
    """DDP(static_graph=True) records its graph from a first backward that all-reduces: refused before it ran."""
    rows = 8
    model = injected_mlp()
    first, second = global_batch(world, rows, seed=18), global_batch(world, rows, seed=20)
    expected = mean_of(
        [
            full_grads(model, lambda m, r=r: F.mse_loss(m(local(second[0], r, rows)), local(second[1], r, rows)))
            for r in range(world)
        ]
    )
    ddp = DDP(model, static_graph=True)

    @koila.accumulate(cache=koila.NoCache())
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(ddp(x), y)

    refused = caught(lambda: step(local(first[0], rank, rows), local(first[1], rank, rows)))
    untouched = all(p.grad is None for p in model.parameters())
    F.mse_loss(ddp(local(first[0], rank, rows)), local(first[1], rank, rows)).backward()  # the first iteration
    model.zero_grad(set_to_none=True)
    model[2].failures = {1: {1: "backward"}}.get(rank, {})  # the whole batch's backward, on rank 1
    step(local(second[0], rank, rows), local(second[1], rank, rows))
    return {
        "refused": refused,
        "untouched": untouched,
        "grads": grads(model),
        "expected": expected,
        "size": step.stats.batch_size,
    }


@scenario("two")
def overlap_step_bypassing_ddp(rank: int, world: int) -> dict[str, Any]:
    """A step that calls ``ddp.module``: DDP would average nothing, so every rank raises, .grad as it was."""
    model = _wide()
    ddp = DDP(model)
    before = [torch.full_like(p, 0.5) for p in model.parameters()]
    for parameter, grad in zip(model.parameters(), before, strict=True):
        parameter.grad = grad.clone()
    step = koila.accumulate(cache=koila.NoCache())(lambda x, y: F.mse_loss(ddp.module(x), y))
    caught_error = caught(lambda: step(data(8, 4, seed=99), data(8, 1, seed=98)))
    # Still in step with each other: a collective after it completes.
    dist.barrier()
    kept = all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), before, strict=True))
    return {"caught": caught_error, "kept": kept}


class _Halved(nn.Module):
    """Multiply by a buffer: something for DDP's ``broadcast_buffers=True`` to broadcast."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.full((8,), 0.5, dtype=DTYPE))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def _two_views(rank: int, world: int, failures: dict[int, str], size: int, direct: bool = False) -> dict[str, Any]:
    """A step that runs the DDP module twice, on two views of its micro-batch (a model with a buffer).

    DDP broadcasts buffers in a forward that follows one that synced: the last micro-batch's second forward
    did, on every rank but one that failed before it, and gloo aborted. ``failures``: rank 1's forward calls
    of the step (from 0) that run out of memory; ``direct``: the step calls ``ddp.forward``, which runs no
    hook of the module's.
    """
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(6, 8), nn.Tanh(), _Halved(), Inject(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)
    ).to(DTYPE)
    rows = 12
    x, y = global_batch(world, rows, seed=88)

    def loss_of(module: nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(module(xb), yb) + F.mse_loss(module(xb * 0.5), yb)

    expected = mean_of(
        [full_grads(model, lambda m, r=r: loss_of(m, local(x, r, rows), local(y, r, rows))) for r in range(world)]
    )
    hand = mean_of(
        [full_grads(model, lambda m, r=r: F.mse_loss(m(local(x, r, rows)), local(y, r, rows))) for r in range(world)]
    )
    ddp = DDP(model, bucket_cap_mb=0.0001)  # broadcast_buffers=True, DDP's default
    F.mse_loss(ddp(local(x, rank, rows)), local(y, rank, rows)).backward()  # a hand step first
    model.zero_grad()
    before = len(model[3].rows)
    model[3].failures = {before + call: where for call, where in failures.items()} if rank == 1 else {}
    events: list[koila.OOMEvent] = []

    @koila.accumulate(initial=size, cache=koila.NoCache(), on_oom=events.append)
    def step(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return loss_of(ddp.forward if direct else ddp, xb, yb)

    with warnings.catch_warnings(record=True) as caught_warnings:
        warnings.simplefilter("always")
        step(local(x, rank, rows), local(y, rank, rows))
    after = grads(model)
    model.zero_grad()
    if rank == 1:  # DDP's next forward broadcasts rank 0's again, as after a hand step
        model[2].scale.fill_(2.0)
    F.mse_loss(ddp(local(x, rank, rows)), local(y, rank, rows)).backward()  # and one after
    return {
        "grads": after,
        "expected": expected,
        "hand": grads(model),
        "hand_expected": hand,
        "ooms": len(events),
        "rows": model[3].rows[before:],
        "scale": model[2].scale.tolist(),
        "warnings": [str(warning.message) for warning in caught_warnings],
    }


class _TupleHolder(NamedTuple):
    """A holder whose method runs for an instance with no weak reference to know it by."""

    module: nn.Module

    @koila.accumulate(cache=koila.NoCache())
    def step(self, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.module(xb), yb)


def _two_models(rank: int, world: int, where: str, holder: str) -> dict[str, Any]:
    """One step called over one DDP model, then another: given as an argument, or held by two instances.

    The parallel modules were looked for at the first call only: the second model's step kept the first's
    plan, and a rank that ran out of memory in it crashed the job (``where`` "backward") or hung it ("forward").
    ``holder``: "argument", "method", "this" (a method whose instance is not named self) or "named tuple".
    """
    rows = 8
    x, y = global_batch(world, rows, seed=89)
    models = [injected_mlp(), injected_mlp()]

    def loss_of(module: nn.Module, r: int) -> torch.Tensor:
        return F.mse_loss(module(local(x, r, rows)), local(y, r, rows))

    expected = mean_of([full_grads(models[1], lambda m, r=r: loss_of(m, r)) for r in range(world)])
    ddps = [DDP(model) for model in models]

    @koila.accumulate(cache=koila.NoCache())
    def step(module: nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(module(xb), yb)

    class Holder:
        def __init__(self, module: nn.Module) -> None:
            self.module = module

        @koila.accumulate(cache=koila.NoCache())
        def step(self, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(self.module(xb), yb)

    class This(Holder):
        @koila.accumulate(cache=koila.NoCache())
        def step(this, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:  # its instance, not named self
            return F.mse_loss(this.module(xb), yb)

    kinds: dict[str, Callable[[nn.Module], Any]] = {"method": Holder, "this": This, "named tuple": _TupleHolder}
    holders = [kinds[holder](ddp) for ddp in ddps] if holder != "argument" else []
    for index in range(2):
        models[1][2].failures = {0: where} if rank == 1 and index == 1 else {}
        if holders:
            holders[index].step(local(x, rank, rows), local(y, rank, rows))
        else:
            step(ddps[index], local(x, rank, rows), local(y, rank, rows))
    return {"grads": grads(models[1]), "expected": expected, "rows": models[1][2].rows}


# Where rank 1 fails, and how the step is given the second model: by argument, or as a method of its holder.
TWO_MODELS = {
    "two_models_one_step_backward_fails": ("backward", "argument"),
    "two_models_one_step_forward_fails": ("forward", "argument"),
    "two_models_one_method_backward_fails": ("backward", "method"),
    "two_models_one_method_of_another_name_forward_fails": ("forward", "this"),
    "two_models_one_method_of_a_named_tuple_forward_fails": ("forward", "named tuple"),
}


def _register_two_models(name: str, where: str, holder: str) -> None:
    def run(rank: int, world: int) -> dict[str, Any]:
        return _two_models(rank, world, where, holder)

    run.__name__ = name
    scenario("crash")(run)


for _name, (_where, _holder) in TWO_MODELS.items():
    _register_two_models(_name, _where, _holder)


@scenario("two")
def exhausted_by_a_rank_with_one_row(rank: int, world: int) -> dict[str, Any]:
    """The last rank has one row and runs out of memory with it: the others give up above their minimum."""
    model = injected_mlp()
    rows = 1 if rank == world - 1 else 8
    x, y = data(rows, 6, seed=90), data(rows, 1, seed=91)
    model[2].failures = {0: "forward"} if rank == world - 1 else {}

    @koila.accumulate(initial=4, cache=koila.NoCache())
    def step(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(xb), yb)

    return caught(lambda: step(x, y))


@scenario("crash")
def two_views_nothing_fails(rank: int, world: int) -> dict[str, Any]:
    return _two_views(rank, world, {}, size=4)


@scenario("crash")
def two_views_whole_first_forward_fails(rank: int, world: int) -> dict[str, Any]:
    return _two_views(rank, world, {0: "forward"}, size=16)


@scenario("crash")
def two_views_first_micro_batch_fails(rank: int, world: int) -> dict[str, Any]:
    return _two_views(rank, world, {0: "forward"}, size=4)


@scenario("crash")
def two_views_last_micro_batch_first_forward_fails(rank: int, world: int) -> dict[str, Any]:
    return _two_views(rank, world, {4: "forward"}, size=4)


@scenario("crash")
def two_views_last_micro_batch_second_forward_fails(rank: int, world: int) -> dict[str, Any]:
    return _two_views(rank, world, {5: "forward"}, size=4)


@scenario("crash")
def two_views_through_forward_first_micro_batch_fails(rank: int, world: int) -> dict[str, Any]:
    return _two_views(rank, world, {0: "forward"}, size=4, direct=True)


class _RunningCentre(nn.Module):
    """Subtract a running mean that each forward in training mode updates first: it reads what it changed."""

    def __init__(self, reassigned: bool = False) -> None:
        super().__init__()
        self.reassigned = reassigned  # a new tensor each time, not the buffer updated in place
        self.register_buffer("mean", torch.zeros(8, dtype=DTYPE))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                if self.reassigned:
                    self.mean = self.mean * 0.5 + x.mean(0) * 0.5
                else:
                    self.mean.mul_(0.5).add_(x.mean(0), alpha=0.5)
        return x - self.mean


class _Renorm(nn.BatchNorm1d):
    """A BatchNorm whose training forward reads its running mean too, as BatchRenorm does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + 0.1 * cast(torch.Tensor, self.running_mean)


class _OverRows(nn.Module):
    """An InstanceNorm1d over the rows of each of 8 features, with running statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.InstanceNorm1d(8, track_running_stats=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self.norm(x.t().unsqueeze(0))).squeeze(0).t()


# The layer between two linear ones, and whether a step that runs the module twice warns of it.
_READERS: dict[str, tuple[Callable[[], nn.Module], bool]] = {
    "in place": (_RunningCentre, True),
    "reassigned": (functools.partial(_RunningCentre, reassigned=True), True),
    "batchnorm reading its statistics": (functools.partial(_Renorm, 8), True),
    # Their running statistics change, but their forwards read them only in eval mode.
    "batchnorm": (functools.partial(nn.BatchNorm1d, 8), False),
    "instancenorm": (_OverRows, False),
}


@scenario("crash")
def two_views_reading_a_buffer_they_change(rank: int, world: int) -> dict[str, Any]:
    """DDP alone would broadcast rank 0's buffers before the second view; the step warns, once, where it matters.

    For each layer of ``_READERS``, two steps of two views each; nothing fails.
    """
    values = {}
    for name, (layer, _) in _READERS.items():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), layer(), nn.Tanh(), nn.Linear(8, 1)).to(DTYPE)
        ddp = DDP(model)
        x, y = (local(tensor, rank, 12) for tensor in global_batch(world, 12, seed=86))
        F.mse_loss(ddp(x), y).backward()  # a hand step first
        model.zero_grad()
        step = koila.accumulate(cache=koila.NoCache())(
            lambda xb, yb, ddp=ddp: F.mse_loss(ddp(xb), yb) + F.mse_loss(ddp(-xb), yb)
        )
        messages = []
        for _ in range(2):
            with warnings.catch_warnings(record=True) as caught_warnings:
                warnings.simplefilter("always")
                loss = step(x, y)
            messages.append([str(warning.message) for warning in caught_warnings])
        values[name] = {"warnings": messages, "loss": float(loss), "synced": "_sync_buffers" not in vars(ddp)}
    return values


# --------------------------------------------------------------------------- 3. gradients from before the call


@scenario("two")
def overlap_a_sample_logged_without_grad_in_the_step(rank: int, world: int) -> dict[str, Any]:
    """A step logs a sample through the DDP module under ``torch.no_grad()``, after its loss's forward.

    DDP clears ``require_forward_param_sync`` after such a forward, which the step read as its own forward not
    having run: every rank raised that the step bypassed DDP, where a hand loop trains as usual.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)).to(DTYPE)
    ddp = DDP(model, bucket_cap_mb=0.0001)
    x, y = global_batch(world, 12, seed=98)
    expected = mean_of(
        [full_grads(model, lambda m, r=r: F.mse_loss(m(local(x, r, 12)), local(y, r, 12))) for r in range(world)]
    )
    outcomes = {}
    for initial in (None, 4):

        @koila.accumulate(initial=initial, cache=koila.NoCache())
        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = F.mse_loss(ddp(x), y)
            with torch.no_grad():
                ddp(x[:1])  # a sample logged
            return loss

        model.zero_grad(set_to_none=True)
        outcome = caught(lambda: step(local(x, rank, 12), local(y, rank, 12)))
        outcomes[str(initial)] = {"raised": outcome.get("message"), "grads": grads(model)}
    return {"outcomes": outcomes, "expected": expected}


@scenario("two", "three")
def accumulate_twice(rank: int, world: int) -> dict[str, Any]:
    """Two calls without zero_grad: the gradients are the sum of both full-batch gradients."""
    rows = 8
    model = injected_mlp()
    first, second = global_batch(world, rows, seed=10), global_batch(world, rows, seed=12)
    expected_first = full_grads(model, lambda m: F.mse_loss(m(first[0]), first[1]))
    expected_second = full_grads(model, lambda m: F.mse_loss(m(second[0]), second[1]))
    ddp = DDP(model)
    # Forward calls: 0 is the first call's whole batch (fails on rank 1), 1 and 2 its micro-batches of 4;
    # 3 is the second call's whole batch, 4 and 5 its micro-batches, after rank 0's backward fails at 3.
    model[2].failures = {1: {0: "forward"}, 0: {3: "backward"}}.get(rank, {})

    @koila.accumulate(cache=koila.NoCache())
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(ddp(x), y)

    step(local(first[0], rank, rows), local(first[1], rank, rows))
    after_first = grads(model)
    step(local(second[0], rank, rows), local(second[1], rank, rows))
    return {
        "after_first": after_first,
        "expected_first": expected_first,
        "grads": grads(model),
        "expected": [a + b for a, b in zip(expected_first, expected_second, strict=True)],
        "rows": model[2].rows,
    }


def _after_a_backward_without_sync(
    rank: int, world: int, failures: dict[int, str], fallback: bool = False, inside: bool = False, **ddp_options: Any
) -> dict[str, Any]:
    """A backward of the caller's own under ``no_sync()``, then a step: averaged together, as by a hand loop.

    ``failures``: by rank, the step's forward calls (from 0, after the caller's own) that run out of memory.
    ``inside``: the step runs inside the caller's ``no_sync()`` too; its own gradients alone are averaged.
    """
    rows = 8
    model = injected_mlp()
    first, second = global_batch(world, rows, seed=14), global_batch(world, rows, seed=16)
    own = [
        full_grads(model, lambda m, r=r: F.mse_loss(m(local(first[0], r, rows)), local(first[1], r, rows)))
        for r in range(world)
    ]
    steps = [
        full_grads(model, lambda m, r=r: F.mse_loss(m(local(second[0], r, rows)), local(second[1], r, rows)))
        for r in range(world)
    ]
    if inside:  # this rank's own, and the step's average
        expected = [a + b for a, b in zip(own[rank], mean_of(steps), strict=True)]
    else:  # each rank's own gradients of both losses, averaged over the ranks: what the hand loop gives
        expected = mean_of([[a + b for a, b in zip(o, t, strict=True)] for o, t in zip(own, steps, strict=True)])
    ddp = DDP(model, **ddp_options)
    if fallback:  # off DDP's overlap: the step all-reduces its gradients after its backward
        model[0].weight.register_post_accumulate_grad_hook(lambda parameter: None)
    with ddp.no_sync():
        F.mse_loss(ddp(local(first[0], rank, rows)), local(first[1], rank, rows)).backward()
    kept = [p.grad for p in model.parameters()]
    model[2].failures = {1 + call: where for call, where in failures.items()} if rank == 1 else {}

    @koila.accumulate(cache=koila.NoCache())
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(ddp(x), y)

    with ddp.no_sync() if inside else contextlib.nullcontext():
        step(local(second[0], rank, rows), local(second[1], rank, rows))
    return {
        "grads": grads(model),
        "expected": expected,
        "same_tensors": all(p.grad is g for p, g in zip(model.parameters(), kept, strict=True)),
        "size": step.stats.batch_size,
    }


@scenario("two", "three")
def ddp_after_a_backward_without_sync(rank: int, world: int) -> dict[str, Any]:
    return _after_a_backward_without_sync(rank, world, {})


@scenario("two", "three")
def ddp_after_a_backward_without_sync_a_backward_fails(rank: int, world: int) -> dict[str, Any]:
    return _after_a_backward_without_sync(rank, world, {0: "backward", 2: "backward"})


@scenario("two")
def ddp_after_a_backward_without_sync_a_step_inside_it(rank: int, world: int) -> dict[str, Any]:
    return _after_a_backward_without_sync(rank, world, {0: "backward"}, inside=True)


@scenario("two")
def ddp_after_a_backward_without_sync_a_step_inside_it_off_the_overlap(rank: int, world: int) -> dict[str, Any]:
    return _after_a_backward_without_sync(rank, world, {0: "backward"}, fallback=True, inside=True)


@scenario("two")
def ddp_after_a_backward_without_sync_off_the_overlap(rank: int, world: int) -> dict[str, Any]:
    return _after_a_backward_without_sync(rank, world, {0: "backward"}, fallback=True)


@scenario("two")
def ddp_after_a_backward_without_sync_as_bucket_views(rank: int, world: int) -> dict[str, Any]:
    return _after_a_backward_without_sync(rank, world, {0: "forward"}, gradient_as_bucket_view=True)


def _after_a_stray_forward(
    rank: int,
    world: int,
    failures: dict[int, str],
    *,
    hooked: bool = False,
    fallback: bool = False,
    stray: bool = True,
    weightless: dict[int, slice] | None = None,
    size: int = 4,
) -> dict[str, Any]:
    """A forward of the DDP module in grad mode that no backward follows, then a step in micro-batches of ``size``.

    DDP's reducer stays armed after such a forward, so the next backward all-reduces every bucket, the first
    micro-batch's under ``no_sync()`` included, on every rank. ``failures``: rank 1's forward calls of the
    step (from 0) that run out of memory. ``hooked``: a comm hook of the user's, so that the play-along reads
    the reducer's stats, not the count of collectives; ``fallback``: off DDP's overlap (a post-accumulate-grad
    hook), the step all-reduces after its backward; ``stray``: whether that forward runs. The loss is a mean
    over the rows a mask keeps, which ``weight=`` counts: ``weightless`` drops rows, by rank (a micro-batch it
    drops whole weighs nothing, and its loss is 0/0).
    """
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), Inject(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)
    ).to(DTYPE)
    rows = 12
    batches = [global_batch(world, rows, seed=seed) for seed in (90, 92, 94)]
    first, second = batches[0], batches[2]
    masks = [torch.ones(rows, 1, dtype=DTYPE) for _ in range(world)]
    for where, dropped in (weightless or {}).items():
        masks[where][dropped] = 0

    def loss_of(out: torch.Tensor, y: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        return ((out - y) ** 2 * kept).sum() / kept.sum()

    expected = mean_of(
        [
            full_grads(model, lambda m, r=r: loss_of(m(local(second[0], r, rows)), local(second[1], r, rows), masks[r]))
            for r in range(world)
        ]
    )
    hand = mean_of(
        [
            full_grads(model, lambda m, r=r: F.mse_loss(m(local(first[0], r, rows)), local(first[1], r, rows)))
            for r in range(world)
        ]
    )
    ddp = DDP(model, bucket_cap_mb=0.0001)  # about one layer a bucket, once rebuilt after the first step
    if hooked:

        def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks a hook's annotations
            return default_hooks.allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, hook)
    if fallback:
        model[0].weight.register_post_accumulate_grad_hook(lambda parameter: None)
    F.mse_loss(ddp(local(first[0], rank, rows)), local(first[1], rank, rows)).backward()  # a hand step
    model.zero_grad()
    if stray:
        ddp(local(batches[1][0], rank, rows))  # logged, say: no backward
    before = len(model[4].rows)  # forward calls before the step's
    model[4].failures = {before + call: where for call, where in failures.items()} if rank == 1 else {}
    events: list[koila.OOMEvent] = []

    @koila.accumulate(initial=size, cache=koila.NoCache(), on_oom=events.append, weight=lambda x, y, kept: kept.sum())
    def step(x: torch.Tensor, y: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        return loss_of(ddp(x), y, kept)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's, that it calls no comm hook
        loss = step(local(second[0], rank, rows), local(second[1], rank, rows), masks[rank])
    after = grads(model)
    # Then a step of the hand loop's: the reducer is as DDP leaves it after a step.
    model.zero_grad()
    F.mse_loss(ddp(local(first[0], rank, rows)), local(first[1], rank, rows)).backward()
    return {
        "grads": after,
        "expected": expected,
        "hand": grads(model),
        "hand_expected": hand,
        "ooms": len(events),
        "loss": float(loss),
        "rows": model[4].rows[before:],
    }


@scenario("crash")
def stray_forward_nothing_fails(rank: int, world: int) -> dict[str, Any]:
    return _after_a_stray_forward(rank, world, {})


@scenario("crash")
def stray_forward_first_forward_fails(rank: int, world: int) -> dict[str, Any]:
    return _after_a_stray_forward(rank, world, {0: "forward"})


@scenario("crash")
def stray_forward_first_backward_fails(rank: int, world: int) -> dict[str, Any]:
    # Inject sits after the first two layers: the last two layers' buckets went before it failed.
    return _after_a_stray_forward(rank, world, {0: "backward"})


@scenario("crash")
def stray_forward_second_forward_fails(rank: int, world: int) -> dict[str, Any]:
    return _after_a_stray_forward(rank, world, {1: "forward"})


@scenario("crash")
def stray_forward_last_backward_fails(rank: int, world: int) -> dict[str, Any]:
    return _after_a_stray_forward(rank, world, {2: "backward"})


@scenario("crash")
def stray_forward_first_backward_fails_hooked(rank: int, world: int) -> dict[str, Any]:
    return _after_a_stray_forward(rank, world, {0: "backward"}, hooked=True)


@scenario("crash")
def stray_forward_first_forward_fails_hooked(rank: int, world: int) -> dict[str, Any]:
    return _after_a_stray_forward(rank, world, {0: "forward"}, hooked=True)


@scenario("crash")
def stray_forward_first_micro_batch_weighs_nothing_first_forward_fails(rank: int, world: int) -> dict[str, Any]:
    return _after_a_stray_forward(rank, world, {0: "forward"}, weightless={r: slice(0, 4) for r in range(world)})


@scenario("crash")
def stray_forward_first_micro_batch_weighs_nothing(rank: int, world: int) -> dict[str, Any]:
    return _after_a_stray_forward(rank, world, {}, weightless={r: slice(0, 4) for r in range(world)})


@scenario("crash")
def stray_forward_first_micro_batch_weighs_nothing_on_one_rank(rank: int, world: int) -> dict[str, Any]:
    # Two micro-batches. Rank 0 skipped that backward: its first backward was its last, and rank 1's check
    # after its own first met rank 0's exchange after the attempt. Rank 0 returned a wrong gradient, and
    # rank 1 waited in its last backward's buckets.
    return _after_a_stray_forward(rank, world, {}, weightless={0: slice(0, 6)}, size=6)


@scenario("crash")
def ddp_last_micro_batch_weighs_nothing(rank: int, world: int) -> dict[str, Any]:
    # DDP needs the last backward: it ran as loss * 0, whose 0/0 made every gradient nan.
    return _after_a_stray_forward(rank, world, {}, stray=False, weightless={r: slice(8, None) for r in range(world)})


@scenario("crash")
def overlap_compressing_hook_fails_on_the_first_step(rank: int, world: int) -> dict[str, Any]:
    """``fp16_compress_hook``; rank 1 runs out of memory casting the second bucket, in the first step's backward.

    The reducer had marked that bucket's parameters ready before it called the hook: with no count of
    collectives learned yet, the failed rank took the bucket for launched and played one bucket short.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)).to(DTYPE)
    ddp = DDP(model, bucket_cap_mb=0.0001)
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    x, y = global_batch(world, 12, seed=97)
    for _ in range(2):  # hand steps: DDP's buckets rebuilt, one a layer
        F.mse_loss(ddp(local(x, rank, 12)), local(y, rank, 12)).backward()
    model.zero_grad(set_to_none=True)
    events: list[koila.OOMEvent] = []

    @koila.accumulate(initial=6, cache=koila.NoCache(), on_oom=events.append)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(ddp(x), y)

    with FailCast(torch.float16, 2) if rank == 1 else contextlib.nullcontext():
        outcome = caught(lambda: step(local(x, rank, 12), local(y, rank, 12)))
    expected = mean_of(
        [full_grads(model, lambda m, r=r: F.mse_loss(m(local(x, r, 12)), local(y, r, 12))) for r in range(world)]
    )
    return {"outcome": outcome, "ooms": len(events), "grads": grads(model), "expected": expected}


def _weightless_through_a_checkpoint(rank: int, world: int, mode: str) -> dict[str, Any]:
    """The middle of three micro-batches weighs nothing, with ``CheckpointedMiddle(mode)`` under DDP."""
    model = CheckpointedMiddle(mode)
    ddp = DDP(model)
    x, y = global_batch(world, 12, seed=99)
    kept = torch.ones(12, 1, dtype=DTYPE)
    kept[4:8] = 0

    def loss_of(net: nn.Module, x: torch.Tensor, y: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        return ((net(x) - y) ** 2 * kept).sum() / kept.sum()

    expected = mean_of(
        [full_grads(model, lambda m, r=r: loss_of(m, local(x, r, 12), local(y, r, 12), kept)) for r in range(world)]
    )

    @koila.accumulate(initial=4, cache=koila.NoCache(), weight=lambda x, y, kept: kept.sum())
    def step(x: torch.Tensor, y: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        return loss_of(ddp, x, y, kept)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the walk's, that a reentrant checkpoint hides leaves
        step(local(x, rank, 12), local(y, rank, 12), kept)
    return {"grads": grads(model), "expected": expected}


@scenario("two")
def ddp_weightless_micro_batch_through_reentrant_checkpoints(rank: int, world: int) -> dict[str, Any]:
    """The middle of three micro-batches weighs nothing; the model's middle block is checkpointed reentrantly.

    Its backward ran as zeros only for the leaves its graph showed: a checkpoint's own backward wrote the 0/0
    of a mean over no rows into the parameters it reaches unseen, and DDP averaged nan into every rank's.
    """
    return {mode: _weightless_through_a_checkpoint(rank, world, mode) for mode in ("module", "closure", "function")}


@scenario("crash")
def stray_forward_ranks_out_of_step(rank: int, world: int) -> dict[str, Any]:
    """After a stray forward, rank 0's first backward is not its last, and rank 1's is (half the rows).

    Rank 0 agreed after its first backward's buckets and rank 1 after its attempt, and the two exchanges,
    alike in size, paired up: rank 1 returned a wrong gradient, and rank 0 waited in its last buckets.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)).to(DTYPE)
    ddp = DDP(model, bucket_cap_mb=0.0001)
    x, y = global_batch(world, 12, seed=96)
    rows = 12 if rank == 0 else 6
    F.mse_loss(ddp(local(x, rank, 12)), local(y, rank, 12)).backward()  # a hand step
    model.zero_grad()
    ddp(local(x, rank, 12))  # logged, say: no backward

    @koila.accumulate(initial=6, cache=koila.NoCache())
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(ddp(x), y)

    outcome = caught(lambda: step(local(x, rank, 12)[:rows], local(y, rank, 12)[:rows]))
    after = grads(model)
    F.mse_loss(ddp(local(x, rank, 12)), local(y, rank, 12)).backward()  # the hand loop goes on
    hand = mean_of(
        [full_grads(model, lambda m, r=r: F.mse_loss(m(local(x, r, 12)), local(y, r, 12))) for r in range(world)]
    )
    return {"caught": outcome, "after": after, "grads": grads(model), "expected": hand}


@scenario("crash")
def stray_forward_none_first_backward_fails_hooked(rank: int, world: int) -> dict[str, Any]:
    # No stray forward: the first backward, under no_sync(), wrote .grad with no bucket launched.
    return _after_a_stray_forward(rank, world, {0: "backward"}, hooked=True, stray=False)


@scenario("crash")
def stray_forward_first_forward_fails_off_the_overlap(rank: int, world: int) -> dict[str, Any]:
    return _after_a_stray_forward(rank, world, {0: "forward"}, fallback=True)


# --------------------------------------------------------------------------- 4. parameters some ranks do not use


class Branchy(nn.Module):
    """``extra`` takes part only when asked (on rank 0); ``never`` never does."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.trunk = nn.Linear(6, 8)
        self.inject = Inject()
        self.main = nn.Linear(8, 1)
        self.extra = nn.Linear(8, 2)
        self.never = nn.Linear(8, 1)
        self.to(DTYPE)

    def forward(self, x: torch.Tensor, extra: bool) -> torch.Tensor:
        h = self.inject(torch.tanh(self.trunk(x)))
        out = self.main(h)
        return out + self.extra(h).sum(dim=1, keepdim=True) if extra else out


def _unused(rank: int, world: int, *, fallback: bool = False, **ddp_options: Any) -> dict[str, Any]:
    """Two steps of ``Branchy``; rank 1 fails the first's forward, rank 0 the second's backward (whole batch).

    ``fallback``: a post-accumulate-grad hook on ``never`` keeps the step off DDP's overlap (see
    koila_retry/_core/overlap.py); else PyTorch's ``allreduce_hook`` records, per bucket, whether a backward
    was running (one collective per bucket: counted, not told by the reducer's stats, see _stats_that_tie).
    """
    rows = 8
    model = Branchy()
    batches = [global_batch(world, rows, seed=30), global_batch(world, rows, seed=32)]
    # What DDP averages: each rank's gradient of its own loss (rank 0 uses ``extra``), zeros where unused.
    per_call = [
        mean_of(
            [
                full_grads(
                    model,
                    lambda m, r=r, b=b: F.mse_loss(m(local(b[0], r, rows), r == 0), local(b[1], r, rows)),
                )
                for r in range(world)
            ]
        )
        for b in batches
    ]
    ddp = DDP(model, find_unused_parameters=True, **ddp_options)
    model.inject.failures = {1: {0: "forward"}, 0: {3: "backward"}}.get(rank, {})
    in_backward: list[bool] = []
    if fallback:
        model.never.weight.register_post_accumulate_grad_hook(lambda parameter: None)
    else:
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)

    @koila.accumulate(cache=koila.NoCache())
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(ddp(x, rank == 0), y)

    original = default_hooks._allreduce_fut

    def recorded(group: Any, tensor: torch.Tensor) -> Any:  # what allreduce_hook calls, looked up as it runs
        in_backward.append(torch._C._current_graph_task_id() != -1)
        return original(group, tensor)

    after = []
    default_hooks._allreduce_fut = recorded
    try:
        for x_all, y_all in batches:
            step(local(x_all, rank, rows), local(y_all, rank, rows))
            after.append(grads(model))
    finally:
        default_hooks._allreduce_fut = original
    names = [name for name, _ in model.named_parameters()]
    # No zero_grad() between the calls: after each, the sum of the averages so far.
    expected = [per_call[0], [_add(a, b) for a, b in zip(*per_call, strict=True)]]
    buckets = len(ddp.reducer._get_zeros_like_grad_buckets())
    return {"names": names, "after": after, "expected": expected, "in_backward": in_backward, "buckets": buckets}


def _add(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    return a if b is None else b if a is None else a + b


@scenario("two", "three")
def accumulate_unused_parameters(rank: int, world: int) -> dict[str, Any]:
    return _unused(rank, world)


@scenario("two", "three")
def accumulate_unused_parameters_small_buckets(rank: int, world: int) -> dict[str, Any]:
    # Four buckets, in order [extra.bias, never.*], [main.bias, extra.weight], [trunk.bias, main.weight],
    # [trunk.weight]: rank 0's backward fails after main's and extra's gradients, the first two buckets
    # launched (never's marked ready by DDP as unused), the other two and the used map played along.
    return _unused(rank, world, bucket_cap_mb=0.0001)


@scenario("two")
def accumulate_unused_parameters_fallback(rank: int, world: int) -> dict[str, Any]:
    # Off the overlap: gradients of 128 bytes and up all-reduced in place, each alone (from 1 MiB up,
    # usually), the rest in buckets of 13 float64 values, more than one used.
    alone = distributed._ALONE_BYTES
    distributed._ALONE_BYTES = 128
    try:
        return _unused(rank, world, fallback=True, bucket_cap_mb=0.0001)
    finally:
        distributed._ALONE_BYTES = alone


# --------------------------------------------------------------------------- 5. different cached sizes at the start


@scenario("two", "three")
def cached_sizes_differ(rank: int, world: int) -> dict[str, Any]:
    """Each rank's cache holds its own size; with agreement on, the first attempt is the smallest."""
    shared = koila.GlobalCache()

    def run(batch_size: int) -> int:
        seen.append(batch_size)
        if batch_size > FITS[rank]:
            raise make_oom()
        return batch_size

    seen: list[int] = []
    alone = koila.batch(initial=64, cache=shared, sync=False)(run)()  # fills the cache with this rank's size
    seen_alone, seen = seen, []
    agreed = koila.batch(initial=64, cache=shared)(run)()

    # chunked and accumulate, from a cache filled by hand with a size for each rank
    rows: list[int] = []

    def halve(x: torch.Tensor) -> torch.Tensor:
        rows.append(x.shape[0])
        return x / 2

    cache = Fixed()
    cache["key"] = FITS[rank]
    x = data(20, 3, seed=rank)
    halved = koila.chunked(halve, x, initial=32, cache=cache)

    model = injected_mlp()
    x_all, y_all = global_batch(world, 12, seed=40)
    expected = full_grads(model, lambda m: F.mse_loss(m(x_all), y_all))
    ddp = DDP(model)
    cache = Fixed()
    cache["key"] = {0: 8, 1: 2, 2: 4}[rank]

    @koila.accumulate(cache=cache)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(ddp(x), y)

    step(local(x_all, rank, 12), local(y_all, rank, 12))
    return {
        "alone": alone,
        "seen_alone": seen_alone,
        "agreed": agreed,
        "seen_agreed": seen,
        "chunk_rows": rows,
        "halved": halved,
        "expected_halved": x / 2,
        "micro_batch_rows": model[2].rows,
        "grads": grads(model),
        "expected": expected,
    }


# --------------------------------------------------------------------------- 6. exhausted on every rank


@scenario("two", "three")
def exhausted_everywhere(rank: int, world: int) -> dict[str, Any]:
    """The last rank fits nothing, not even the minimum: every rank raises BatchSizeExhausted."""
    seen: list[int] = []

    @koila.batch(initial=16, minimum=4, cache=koila.NoCache())
    def run(batch_size: int) -> int:
        seen.append(batch_size)
        if rank == world - 1:
            raise make_oom()
        return batch_size

    batch = caught(run)

    model = injected_mlp()
    ddp = DDP(model)
    # Rank 0 fails every forward of 6 rows or more: 12 -> 8 -> 6 (the minimum), then gives up.
    model[2].failures = dict.fromkeys(range(10), "forward") if rank == 0 else {}
    x_all, y_all = global_batch(world, 12, seed=50)

    @koila.accumulate(minimum=6, cache=koila.NoCache())
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(ddp(x), y)

    accumulate = caught(lambda: step(local(x_all, rank, 12), local(y_all, rank, 12)))
    return {"batch": batch, "seen": seen, "accumulate": accumulate, "grads": grads(model), "rows": model[2].rows}


def _batch_fitting(minimum: int, fits: int) -> dict[str, Any]:
    """koila.batch from 32 with ``minimum``, running out of memory above ``fits``."""
    seen: list[int] = []

    @koila.batch(initial=32, minimum=minimum, cache=koila.NoCache())
    def run(batch_size: int) -> int:
        seen.append(batch_size)
        if batch_size > fits:
            raise make_oom()
        return batch_size

    return {"outcome": caught(run), "seen": seen}


def _accumulate_fitting(rank: int, world: int, minimum: int, fits: int) -> dict[str, Any]:
    """koila.accumulate of a DDP step over 12 rows a rank with ``minimum``, out of memory above ``fits`` rows."""
    model = injected_mlp()
    ddp = DDP(model)
    x_all, y_all = global_batch(world, 12, seed=110)
    rows: list[int] = []

    @koila.accumulate(minimum=minimum, cache=koila.NoCache())
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        rows.append(x.shape[0])
        if x.shape[0] > fits:
            raise make_oom()
        return F.mse_loss(ddp(x), y)

    return {
        "outcome": caught(lambda: step(local(x_all, rank, 12), local(y_all, rank, 12))),
        "rows": rows,
        "grads": grads(model),
        "expected": full_grads(model, lambda m: F.mse_loss(m(x_all), y_all)),
    }


@scenario("two", "three")
def minimums_differ(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 has minimum=6, the others minimum=1; the last rank runs out of memory above 6, then above 2."""
    minimum = 6 if rank == 0 else 1
    everything = 1 << 20
    outcome = {
        "batch fits 6": _batch_fitting(minimum, 6 if rank == world - 1 else everything),
        "batch fits 2": _batch_fitting(minimum, 2 if rank == world - 1 else everything),
        # The rank with the largest minimum fails at it: every rank gives up, as with one minimum.
        "batch largest fails": _batch_fitting(minimum, 0 if rank == 0 else everything),
        "accumulate fits 6": _accumulate_fitting(rank, world, minimum, 6 if rank == world - 1 else everything),
        "accumulate fits 2": _accumulate_fitting(rank, world, minimum, 2 if rank == world - 1 else everything),
    }

    # accumulate's size is the rows when no initial is given: the others' 2 rows do not split rank 0's 12.
    torch.manual_seed(0)
    model = nn.Linear(3, 1).to(DTYPE)
    rows: list[int] = []

    @koila.accumulate(minimum=minimum, cache=koila.NoCache())
    def short(x: torch.Tensor) -> torch.Tensor:
        rows.append(x.shape[0])
        return model(x).sum()

    outcome["accumulate rows"] = {
        "outcome": caught(lambda: short(data(12 if rank == 0 else 2, 3, seed=120))),
        "rows": rows,
    }

    # An initial below another rank's minimum leaves no size that suits every rank: refused on every rank.
    refused = koila.batch(initial=32 if rank == 0 else 4, minimum=minimum, cache=koila.NoCache())(lambda size: size)
    outcome["initial below"] = caught(refused)
    return outcome


# --------------------------------------------------------------------------- 7. different spans


@scenario("two", "three")
def spans_differ(rank: int, world: int) -> dict[str, Any]:
    """chunked and range over different numbers of rows or indices: a ValueError on every rank."""
    calls: list[int] = []

    def ones(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return x + 1

    rows = caught(lambda: koila.chunked(ones, torch.zeros(10 + rank, 2), initial=4, cache=koila.NoCache()))
    # one rank with no rows at all
    empty = caught(lambda: koila.chunked(ones, torch.zeros(0 if rank == 0 else 4, 2), initial=4))
    indices = caught(lambda: koila.range(lambda b, e: e - b, 0, 10 * (rank + 1), initial=4, cache=koila.NoCache()))
    # ... and afterwards, the ranks still agree
    same = koila.chunked(ones, torch.zeros(6, 2), initial=4, cache=koila.NoCache())
    return {"rows": rows, "empty": empty, "indices": indices, "calls": calls, "same": same}


# --------------------------------------------------------------------------- 8. sync=False makes no collective call

_COLLECTIVES = (
    "all_reduce",
    "all_reduce_coalesced",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "broadcast_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "new_group",
)


@contextlib.contextmanager
def counted_collectives() -> Iterator[collections.Counter[str]]:
    """Count the calls of torch.distributed's collectives (in both of the modules that name them)."""
    counts: collections.Counter[str] = collections.Counter()
    modules = (dist, dist.distributed_c10d)
    saved = [
        (module, name, getattr(module, name)) for module in modules for name in _COLLECTIVES if hasattr(module, name)
    ]
    for module, name, original in saved:

        def counting(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            counts[_name] += 1
            return _original(*args, **kwargs)

        setattr(module, name, counting)
    try:
        yield counts
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def _every_front_end(sync: bool | None, calls: int) -> dict[str, dict[str, int]]:
    """Run each front end ``calls`` times with ``sync``, each call running out of memory once."""
    counts: dict[str, dict[str, int]] = {}
    model = injected_mlp()
    x, y = data(8, 6, seed=60), data(8, 1, seed=61)

    def front_end(name: str, run: Callable[[Callable[[], None]], None]) -> None:
        with counted_collectives() as counted:
            for _ in range(calls):
                failed = [False]

                def fail_once(failed: list[bool] = failed) -> None:
                    if not failed[0]:
                        failed[0] = True
                        raise make_oom()

                run(fail_once)
        counts[name] = dict(counted)

    def batch(fail: Callable[[], None]) -> None:
        koila.batch(initial=8, cache=koila.NoCache(), sync=sync)(lambda size: fail())()

    def attempts(fail: Callable[[], None]) -> None:
        for attempt in koila.attempts(initial=8, cache=koila.NoCache(), sync=sync):
            with attempt:
                fail()

    def chunked(fail: Callable[[], None]) -> None:
        def part(x: torch.Tensor) -> torch.Tensor:
            fail()
            return x

        koila.chunked(part, x, initial=4, cache=koila.NoCache(), sync=sync)

    def range_(fail: Callable[[], None]) -> None:
        koila.range(lambda b, e: fail(), 0, 8, initial=4, cache=koila.NoCache(), sync=sync)

    def accumulate(fail: Callable[[], None]) -> None:
        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            fail()
            return F.mse_loss(model(x), y)

        koila.accumulate(cache=koila.NoCache(), sync=sync)(step)(x, y)

    for name, run in (("batch", batch), ("attempts", attempts), ("chunked", chunked), ("range", range_)):
        front_end(name, run)
    front_end("accumulate", accumulate)
    return counts


@scenario("two", "three")
def sync_false_makes_no_collective_call(rank: int, world: int) -> dict[str, Any]:
    # Every rank makes a different number of calls: a collective would be left unmatched.
    return {"false": _every_front_end(False, calls=rank + 1), "none": _every_front_end(None, calls=1)}


# --------------------------------------------------------------------------- 9. memory of a discarded attempt


@scenario("two")
def discarded_attempt_is_released(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 succeeds and drops its result because rank 1 failed: the result is gone before the retry."""
    refs: list[weakref.ref[torch.Tensor]] = []
    batch_dead: list[list[bool]] = []

    @koila.batch(initial=16, cache=koila.NoCache())
    def ones(batch_size: int) -> torch.Tensor:
        batch_dead.append([ref() is None for ref in refs])
        result = torch.ones(batch_size, 1000)
        refs.append(weakref.ref(result))
        if rank == 1 and batch_size > 8:
            raise make_oom()
        return result

    ones()

    chunk_refs: list[weakref.ref[torch.Tensor]] = []
    chunked_dead: list[list[bool]] = []

    def doubled(x: torch.Tensor) -> torch.Tensor:
        chunked_dead.append([ref() is None for ref in chunk_refs])
        result = x * 2
        chunk_refs.append(weakref.ref(result))
        if rank == 1 and len(chunk_refs) == 2:  # the second chunk
            raise make_oom()
        return result

    koila.chunked(doubled, data(16, 100, seed=70), initial=4, cache=koila.NoCache())

    # accumulate: the gradients that the discarded step wrote
    model = injected_mlp()
    ddp = DDP(model)
    model[2].failures = {2: "backward"} if rank == 1 else {}
    x, y = local(global_batch(world, 12)[0], rank, 12), local(global_batch(world, 12)[1], rank, 12)
    grad_refs: list[weakref.ref[torch.Tensor]] = []
    accumulate_dead: list[list[bool]] = []

    @koila.accumulate(initial=4, cache=koila.NoCache())
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        call = len(model[2].rows)
        if call in (0, 3):  # the first micro-batch of each attempt
            accumulate_dead.append([ref() is None for ref in grad_refs])
        if call == 2:  # the last micro-batch of the first attempt: earlier ones wrote the gradients
            # into .grad, the step's own (DDP all-reduces them in the last one's backward)
            grad_refs.extend(weakref.ref(p.grad) for p in model.parameters() if p.grad is not None)
        return F.mse_loss(ddp(x), y)

    step(x, y)
    return {
        "batch_dead": batch_dead,
        "chunked_dead": chunked_dead,
        "accumulate_dead": accumulate_dead,
        "rows": model[2].rows,
    }


# --------------------------------------------------------------------------- 10. on_oom events


@scenario("two", "three")
def events_name_the_failing_rank(rank: int, world: int) -> dict[str, Any]:
    """Ranks 1 and up fail sizes above 8: the others are told that rank 1 did."""
    events: list[koila.OOMEvent] = []

    @koila.batch(initial=16, cache=koila.NoCache(), on_oom=events.append)
    def run(batch_size: int) -> int:
        if rank >= 1 and batch_size > 8:
            raise make_oom()
        return batch_size

    result = run()
    return {"result": result, "events": [event_dict(e) for e in events], "ooms": run.stats.ooms}


# --------------------------------------------------------------------------- 11. FSDP and tensor parallelism


@scenario("two")
def sharded_modules_are_refused(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    x, y = data(4, 6, seed=80), data(4, 1, seed=81)

    fsdp2 = nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 1)).to(DTYPE)
    fully_shard(fsdp2, mesh=mesh)
    fsdp1 = FullyShardedDataParallel(nn.Linear(6, 1).to(DTYPE), device_id=torch.device("cpu"))
    parallel = nn.Linear(6, 1).to(DTYPE)
    parallel.weight = nn.Parameter(distribute_tensor(parallel.weight.detach(), mesh, [Shard(0)]))

    outcomes: dict[str, dict[str, Any]] = {}
    for name, module in (("fsdp2", fsdp2), ("fsdp1", fsdp1), ("dtensor", parallel)):

        @koila.batch(initial=4, cache=koila.NoCache())
        def predict(batch_size: int, x: torch.Tensor, module: nn.Module = module) -> torch.Tensor:
            return module(x[:batch_size])

        @koila.accumulate(cache=koila.NoCache())
        def step(x: torch.Tensor, y: torch.Tensor, module: nn.Module = module) -> torch.Tensor:
            return F.mse_loss(module(x), y)

        outcomes[f"batch {name}"] = caught(lambda predict=predict: predict(x))
        outcomes[f"accumulate {name}"] = caught(lambda step=step: step(x, y))
    # a module handed over as an argument is reached too
    outcomes["chunked fsdp2"] = caught(lambda: koila.chunked(fsdp2, x, initial=2, cache=koila.NoCache()))
    return outcomes


@scenario("two")
def sync_batchnorm_in_training_is_refused(rank: int, world: int) -> dict[str, Any]:
    """SyncBatchNorm communicates inside forward and backward: refused while it trains, served in eval mode."""
    # No DDP around it: DDP refuses SyncBatchNorm on the CPU, and the layer is refused with or without one.
    net = nn.Sequential(nn.Linear(6, 4), nn.SyncBatchNorm(4), nn.Linear(4, 1)).to(DTYPE)
    x, y = data(8, 6, seed=82), data(8, 1, seed=83)

    @koila.accumulate(cache=koila.NoCache())
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(net(x), y)

    @koila.batch(initial=8, cache=koila.NoCache())
    def predict(batch_size: int, x: torch.Tensor) -> torch.Tensor:
        return net(x[:batch_size])

    outcomes = {}
    net.eval()  # SyncBatchNorm in eval mode normalises with its running statistics: nothing to exchange
    outcomes["accumulate eval"] = caught(lambda: step(x, y).item())
    net.train()  # the same wrappers, now training: each call looks again
    outcomes["accumulate train"] = caught(lambda: step(x, y))
    outcomes["batch train"] = caught(lambda: predict(x))
    outcomes["grads"] = [p.grad is None for p in net.parameters()]
    return outcomes


@scenario("two")
def join_is_refused(rank: int, world: int) -> dict[str, Any]:
    """Under Join, DDP's forwards make collectives a failed or joined rank cannot match: refused, before any."""
    from torch.distributed.algorithms import Join

    ddp = DDP(nn.Linear(6, 1).to(DTYPE))
    x, y = data(8, 6, seed=84), data(8, 1, seed=85)

    @koila.accumulate(cache=koila.NoCache())
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(ddp(x), y)

    @koila.batch(initial=8, cache=koila.NoCache())
    def predict(batch_size: int, x: torch.Tensor) -> torch.Tensor:
        return ddp(x[:batch_size])

    outcomes = {}
    with Join([ddp]):  # caught() keeps each refusal: both ranks leave Join together
        outcomes["accumulate"] = caught(lambda: step(x, y))
        outcomes["batch"] = caught(lambda: predict(x))
    outcomes["grads"] = [p.grad is None for p in ddp.parameters()]
    return outcomes


# --------------------------------------------------------------------------- options


@scenario("two")
def ddp_with_sync_false(rank: int, world: int) -> dict[str, Any]:
    ddp = DDP(nn.Linear(2, 1))
    return caught(lambda: koila.accumulate(ddp=ddp, sync=False)(lambda x: ddp(x).sum()))


@scenario("three")
def group_of_some_ranks(rank: int, world: int) -> dict[str, Any]:
    """Ranks 0 and 1 agree in their own group; rank 2, not a member, runs alone, or refuses sync=True."""
    group = dist.new_group([0, 1])
    seen: list[int] = []

    def run(batch_size: int) -> int:
        seen.append(batch_size)
        if batch_size > FITS[rank]:
            raise make_oom()
        return batch_size

    result = caught(lambda: koila.batch(initial=64, cache=koila.NoCache(), group=group)(run)())
    seen_first = list(seen)
    forced = None
    if rank == 2:  # the members make no second call: this one must not wait for them
        forced = caught(lambda: koila.batch(initial=64, cache=koila.NoCache(), group=group, sync=True)(run)())
    return {"group": repr(group), "result": result, "seen": seen_first, "forced": forced}


@scenario("three")
def ddp_over_a_subgroup_found_in_the_closure(rank: int, world: int) -> dict[str, Any]:
    """Ranks 0 and 1 train DDP over their own group, reached without ddp=; rank 2 only meets them after."""
    group = dist.new_group([0, 1])
    outcome: dict[str, Any] = {}
    if rank in (0, 1):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).to(DTYPE)
        ddp = DDP(model, process_group=group)
        x, y = data(8, 3, seed=94 + rank), data(8, 1, seed=96 + rank)
        seen: list[int] = []

        @koila.accumulate(cache=koila.NoCache())
        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            seen.append(x.shape[0])
            if rank == 1 and x.shape[0] > 4:
                raise make_oom()
            return F.mse_loss(ddp(x), y)

        outcome = {"outcome": caught(lambda: step(x, y)), "seen": seen, "grads": grads(model)}
    dist.barrier()  # the agreement was over the DDP module's group: rank 2 was never waited for
    return outcome


# --------------------------------------------------------------------------- found while building it


@scenario("two")
def accumulate_fewer_rows_on_one_rank(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 has 12 rows and fails micro-batches above 4; rank 1 has 2 rows, under initial=8."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).to(DTYPE)
    ddp = DDP(model)
    rows = 12 if rank == 0 else 2
    x, y = data(rows, 3, seed=90 + rank), data(rows, 1, seed=92 + rank)
    seen: list[int] = []

    @koila.accumulate(initial=8, minimum=2, cache=koila.NoCache(), ddp=ddp)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        seen.append(x.shape[0])
        if rank == 0 and x.shape[0] > 4:
            raise make_oom()
        return F.mse_loss(ddp(x), y)

    return {"outcome": caught(lambda: step(x, y)), "seen": seen, "size": step.stats.batch_size}


def _ddp_steps(batches: list[tuple[int, int]], fails: Callable[[int, int], bool], cache: Any) -> dict[str, Any]:
    """Run an accumulate step over DDP for each of ``batches`` (rows, tokens a row), out of memory where
    ``fails(rows, call)`` says; return each step's micro-batches' rows, the OOMs and the last size."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).to(DTYPE)
    ddp = DDP(model)
    seen: list[list[int]] = []
    calls = [0]

    @koila.accumulate(cache=cache, ddp=ddp)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        seen[-1].append(x.shape[0])
        calls[0] += 1
        if fails(x.shape[0], calls[0]):
            raise make_oom()
        return F.mse_loss(ddp(x).mean(1), y)

    for number, (rows, tokens) in enumerate(batches):
        seen.append([])
        step(data(rows * tokens, 3, seed=40 + number).view(rows, tokens, 3), data(rows, 1, seed=50 + number))
    return {"seen": seen, "ooms": step.stats.ooms, "size": step.stats.batch_size}


@scenario("two")
def accumulate_ranks_with_different_rows_each_run_whole(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 has 7 rows, rank 1 has 9, and both fit: each runs its own whole batch, as plain DDP does."""
    return _ddp_steps([(7 if rank == 0 else 9, 1)], lambda rows, call: False, koila.NoCache())


@scenario("two")
def accumulate_a_rank_that_never_failed_stores_no_size_another_forced(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 fits 4 rows and has 7, then 3; rank 0 has 9 each step and fits them: it runs them whole again."""
    batches = [(9, 1), (9, 1)] if rank == 0 else [(7, 1), (3, 1)]
    return _ddp_steps(batches, lambda rows, call: rank == 1 and rows > 4, koila.GlobalCache())


@scenario("two")
def accumulate_a_rank_that_failed_first_stores_its_size_when_another_fails_after(
    rank: int, world: int
) -> dict[str, Any]:
    """Rank 0 fits 6 rows of its 8; rank 1 fails once more, at 4: rank 0 keeps the 2 it ended at.

    In the second step, rank 1's rows are longer, a key its cache holds nothing under (a StackMemoryCache does
    not scale sizes between lengths): it starts whole, rank 0 at what it kept.
    """
    batches = [(8, 3), (8, 5 if rank == 1 else 3)]
    fails = (lambda rows, call: rows > 6) if rank == 0 else (lambda rows, call: call == 2)
    return _ddp_steps(batches, fails, koila.StackMemoryCache())


@scenario("two")
def accumulate_a_rank_that_fits_whole_is_held_to_a_smaller_start_after_a_stray_forward(
    rank: int, world: int
) -> dict[str, Any]:
    """Both ranks have 8 rows; rank 1 fits 4, which it keeps; a forward logged in grad mode before step 2."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 1)).to(DTYPE)
    x_all, y_all = global_batch(world, 8, seed=30)
    x, y = local(x_all, rank, 8), local(y_all, rank, 8)
    expected = full_grads(model, lambda m: F.mse_loss(m(x_all), y_all))
    ddp = DDP(model)
    seen: list[list[int]] = []

    @koila.accumulate(cache=koila.StackMemoryCache(), ddp=ddp)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        seen[-1].append(x.shape[0])
        if rank == 1 and x.shape[0] > 4:
            raise make_oom()
        return F.mse_loss(ddp(x), y)

    for number in range(2):
        if number == 1:
            model.zero_grad()
            ddp(x)  # a sample logged in grad mode: no backward follows
        seen.append([])
        step(x, y)
    return {"seen": seen, "grads": grads(model), "expected": expected}


@scenario("crash")
def ddp_buffers_first_forward(rank: int, world: int) -> dict[str, Any]:
    """A DDP model with buffers; rank 1 runs out of memory before its first forward (moving the batch, say).

    The DDP module has a group of its own, with half the default group's timeout, so that a collective
    left waiting fails first and leaves the default group, which the next scenarios use, as it was.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 1)).to(DTYPE)
    model.register_buffer("scale", torch.ones(1, dtype=DTYPE))  # any buffer: DDP broadcasts them
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=15))
    ddp = DDP(model, process_group=group)
    x, y = data(8, 3, seed=95 + rank), data(8, 1, seed=97 + rank)
    calls: list[int] = []

    @koila.accumulate(cache=koila.NoCache(), ddp=ddp)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        if rank == 1 and len(calls) == 1:
            raise make_oom()
        return F.mse_loss(ddp(x), y)

    return {"outcome": caught(lambda: step(x, y)), "calls": calls, "grads": grads(model)}


@scenario("crash")
def auto_estimate_with_ddp(rank: int, world: int) -> dict[str, Any]:
    """initial="auto" with a DDP step, when only rank 0's cache has no size: only rank 0 estimates."""
    rows = 12
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)).to(DTYPE)
    x_all, y_all = global_batch(world, rows, seed=99)
    expected = full_grads(model, lambda m: F.mse_loss(m(x_all), y_all))
    ddp = DDP(model)
    cache = Fixed()
    if rank == 1:
        cache["key"] = 6

    @koila.accumulate(initial="auto", cache=cache)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(ddp(x), y)

    outcome = caught(lambda: step(local(x_all, rank, rows), local(y_all, rank, rows)))
    return {"outcome": outcome, "size": step.stats.batch_size, "grads": grads(model), "expected": expected}


@scenario("two")
def ddp_buffers_from_rank_zero(rank: int, world: int) -> dict[str, Any]:
    """Buffers that differ between the ranks before a step: the step sees rank 0's, as DDP's broadcast gives."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).to(DTYPE)
    model.register_buffer("scale", torch.ones(1, dtype=DTYPE))
    ddp = DDP(model)
    with torch.no_grad():  # after DDP's broadcast at construction: the ranks now differ
        model.scale.fill_(rank + 2)
    seen: list[float] = []

    @koila.accumulate(initial=4, cache=koila.NoCache())
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        seen.append(float(model.scale))
        return F.mse_loss(ddp(x) * model.scale, y)

    step(data(8, 3, seed=101 + rank), data(8, 1, seed=103 + rank))
    return {"seen": seen}


class Hog(nn.Module):
    """Passes its input on, after allocating 10 kB a row, on the simulated device."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.empty(len(x) * 10_000, dtype=torch.uint8)
        return x


@scenario("crash")
def ddp_inference_with_buffers_after_a_failed_first_forward(rank: int, world: int) -> dict[str, Any]:
    """DDP broadcasts buffers at a first forward without grad: rank 1's retry would broadcast again, alone."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), Hog() if rank == 1 else nn.Identity(), nn.BatchNorm1d(8), nn.Linear(8, 2))
    model = model.to(DTYPE)
    ddp = DDP(model)
    x, y = data(32, 6, seed=111 + rank), data(32, 2, seed=113 + rank)
    outcomes: dict[str, Any] = {}
    # A training step (DDP then broadcasts at the next forward), and each front end in eval after it.
    step = koila.accumulate(cache=koila.NoCache())(lambda x, y: F.mse_loss(ddp(x), y))
    runs: dict[str, Callable[[], torch.Tensor]] = {
        "chunked": lambda: koila.chunked(ddp, x, initial=32, cache=koila.NoCache()),
        "batch": lambda: koila.batch(initial=32, cache=koila.NoCache())(
            lambda batch_size: torch.cat([ddp(x[i : i + batch_size]) for i in range(0, 32, batch_size)])
        )(),
    }
    for name, run in runs.items():
        ddp.train()
        step(x, y)
        ddp.eval()
        with torch.no_grad():
            with simulated_device("100KB"):  # rank 1 fits 8 rows, rank 0 every row
                outcome = caught(run)
            expected = model(x)  # with the buffers DDP broadcast from rank 0
        if "returned" in outcome:
            outcome["returned"] = torch.allclose(outcome["returned"], expected, rtol=1e-12, atol=1e-12)
        outcomes[name] = outcome
    return outcomes


class TokenHog(nn.Module):
    """Passes its input on, after allocating 500 bytes a token, on the simulated device."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.empty(x.shape[0] * x.shape[1] * 500, dtype=torch.uint8)
        return x


@scenario("two")
def ddp_lengths_that_differ_between_ranks_keep_their_sizes(rank: int, world: int) -> dict[str, Any]:
    """Rows of 16 and 32 tokens, each rank the other way round: the agreed start must not ratchet down."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), TokenHog(), nn.Tanh(), nn.Linear(8, 1)).to(DTYPE)
    ddp = DDP(model)

    @koila.accumulate(cache=koila.GlobalCache())
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(ddp(x).mean(1), y)

    sizes = []
    for number in range(6):
        tokens = 16 if number == 0 or (number + rank) % 2 == 0 else 32
        x, y = data(16 * tokens * 4, 1, seed=number).view(16, tokens, 4), data(16, 1, seed=number + 50)
        model.zero_grad()
        # Only the first step is limited: 8 rows of 16 tokens (64 KB) do not fit, 4 do.
        with simulated_device("50KB") if number == 0 else contextlib.nullcontext():
            step(x, y)
        sizes.append(step.stats.batch_size)
    return {"sizes": sizes, "ooms": step.stats.ooms}


@scenario("two", "three")
def refine_agrees(rank: int, world: int) -> dict[str, Any]:
    """refine=True across ranks (issue 31): the last rank fits 100 rows, the others 120; every rank probes the same."""
    fits = 100 if rank == world - 1 else 120
    tried: list[list[int]] = []

    @koila.batch(initial=128, refine=True)
    def run(batch_size: int) -> int:
        tried[-1].append(batch_size)
        if batch_size > fits:
            raise make_oom()
        return batch_size

    got = []
    for _ in range(8):
        tried.append([])
        got.append(run())
    return {"got": got, "tried": tried, "ooms": run.stats.ooms}


# --------------------------------------------------------------------------- DDP modules given and found; grad mode


@scenario("crash")
def accumulate_ddp_given_beside_one_found(rank: int, world: int) -> dict[str, Any]:
    """ddp= names one of the two DDP modules the step trains; rank 1 runs out of memory in micro-batch 2.

    The modules have a group of their own, with half the default group's timeout (as ddp_buffers_first_forward).
    """
    torch.manual_seed(0)
    first, second = nn.Linear(6, 1).to(DTYPE), nn.Linear(6, 1).to(DTYPE)
    hand_first, hand_second = copy.deepcopy(first), copy.deepcopy(second)
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=15))
    given, found = DDP(first, process_group=group), DDP(second, process_group=group)
    x, y = data(16, 6, seed=131 + rank), data(16, 1, seed=133 + rank)
    calls: list[int] = []

    @koila.accumulate(initial=4, cache=koila.NoCache(), ddp=given)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        if rank == 1 and len(calls) == 2:
            raise make_oom()
        return F.mse_loss(given(x) + found(x), y)

    outcome = caught(lambda: step(x, y))
    size = step.stats.batch_size
    # The loop a user writes by hand at the size the step settled on: no_sync() on both modules but in the last.
    hands = [DDP(hand_first, process_group=group), DDP(hand_second, process_group=group)]
    for begin in range(0, 16, size):
        with contextlib.ExitStack() as stack:
            if begin + size < 16:
                for hand in hands:
                    stack.enter_context(hand.no_sync())
            part = F.mse_loss(
                hands[0](x[begin : begin + size]) + hands[1](x[begin : begin + size]), y[begin : begin + size]
            )
            (part * (size / 16)).backward()
    for model in (first, second, hand_first, hand_second):
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    return {
        "outcome": outcome.get("type"),
        "calls": calls,
        "size": size,
        "parameters": [p.detach().clone() for p in (*first.parameters(), *second.parameters())],
        "hand": [p.detach().clone() for p in (*hand_first.parameters(), *hand_second.parameters())],
    }
