"""Train a model sharded with FSDP2 on two ranks that have different amounts of memory.

Two CPU processes (the ``gloo`` backend) train one MLP sharded with ``fully_shard``
(each hidden block, then the whole model): every rank holds half of each parameter,
and FSDP2 all-gathers a block's parameters before its forward and backward and
reduce-scatters its gradients after. The training step is decorated with
``koila.accumulate``. Each rank trains inside a simulated device that stands in for
its GPU, and rank 1's is smaller: its whole batch does not fit.

When rank 1 runs out of memory in the middle of a forward, rank 0 is already on its
way to the next block's all-gather. Under koila, in a micro-batch of a kind that has
not got through yet (the whole batch; in a split step the first micro-batch, the later
ones and the last, which syncs the gradients), every FSDP2 collective first asks the
ranks whether one of them failed: rank 0 learns it there, before the all-gather that
rank 1 would never join, and both throw the step away, put FSDP2's state back and run
the step again in micro-batches of the same smaller size, with gradient sync only
after the last. Later steps start there. A micro-batch of a
kind that got through once makes its collectives without asking: a rank that fails in
it makes the rest of them itself, with zeros, and the ranks agree once it ends (see
"Training with FSDP2" in docs/distributed.rst).

At the end, each rank compares the model (gathered from its shards) with the same
training run in one process on every rank's rows: they must match.

With koila-retry installed from a clone, as the README says
(``pip install -c constraints.txt '.[progress,plot]'``), run::

    torchrun --nproc_per_node=2 examples/fsdp_train.py

or, without torchrun, ``python examples/fsdp_train.py``: the script then starts the
two processes itself with ``torch.multiprocessing`` (on 127.0.0.1, at a free port).
"""

from __future__ import annotations

import copy
import os
import socket
import sys

import torch
import torch.distributed as dist

# Imported before the process group is made: see examples/ddp_train.py.
import torch.distributed.nn
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn import functional as F

import koila_retry as koila
from koila_retry.testing import simulated_device

WORLD_SIZE = 2
FEATURES, HIDDEN, CLASSES = 16, 128, 4
BATCH, STEPS = 256, 4  # rows per rank and step
# The simulated memory of each rank for the training (the model and data are made before it).
LARGE, SMALL = "8MiB", "512KiB"


def make_model() -> nn.Sequential:
    torch.manual_seed(0)  # the same initial weights on every rank, and in the reference
    blocks = [nn.Sequential(nn.Linear(FEATURES if i == 0 else HIDDEN, HIDDEN), nn.ReLU()) for i in range(3)]
    return nn.Sequential(*blocks, nn.Linear(HIDDEN, CLASSES))


def make_batch(number: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of the whole job for step ``number``: rank r's rows are ``[r * BATCH, (r + 1) * BATCH)``."""
    generator = torch.Generator().manual_seed(number)
    inputs = torch.randn(world_size * BATCH, FEATURES, generator=generator)
    return inputs, (inputs[:, :CLASSES].sum(1) > 0).long() + (inputs[:, CLASSES] > 1).long()


def train(rank: int, world_size: int) -> None:
    """Train on this rank; every rank runs this, and every collective, together."""
    plain = make_model()
    reference = copy.deepcopy(plain)  # trained below in this process alone, on every rank's rows
    model = plain
    # A mesh of the CPU processes: fully_shard's default mesh would be on CUDA where CUDA is present.
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model[:3]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)

    def report(event: koila.OOMEvent) -> None:
        if rank == 0:  # every rank hears of every failure; rank 0 prints them, once
            print(
                f"  rank {event.rank} ran out of memory at {event.batch_size} rows per micro-batch; "
                f"every rank runs the step again at {event.next_batch_size}",
                flush=True,
            )

    # koila finds the FSDP2 modules the step reaches (here through its closure).
    @koila.accumulate(on_oom=report)
    def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(inputs), targets)

    with simulated_device(LARGE if rank == 0 else SMALL):
        for number in range(1, STEPS + 1):
            inputs, targets = make_batch(number, world_size)
            mine = slice(rank * BATCH, (rank + 1) * BATCH)
            optimizer.zero_grad(set_to_none=True)
            loss = step(inputs[mine], targets[mine])
            optimizer.step()
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
            dist.all_gather(sizes, torch.tensor([step.stats.batch_size]))
            if rank == 0:
                listed = ", ".join(f"rank {r}: {int(size)}" for r, size in enumerate(sizes))
                print(f"step {number}: micro-batch size {listed} (of {BATCH} rows); loss {loss.item():.4f}", flush=True)

    # The same training in one process, on every rank's rows at once, with all the memory it wants.
    for number in range(1, STEPS + 1):
        inputs, targets = make_batch(number, world_size)
        reference_optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(reference(inputs), targets).backward()
        reference_optimizer.step()
    # Each parameter gathered from the ranks' shards (a collective), against the reference.
    matches = all(
        torch.allclose(parameter.full_tensor(), expected, rtol=1e-5, atol=1e-6)
        for parameter, expected in zip(model.parameters(), reference.parameters(), strict=True)
    )
    flags = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(flags, torch.tensor([int(matches)]))
    if rank == 0:
        print(f"Settled on micro-batches of {step.stats.batch_size} rows.")
        print(f"Parameters match one process's training on every rank's rows: {all(int(f) for f in flags)}.")


def worker(rank: int, world_size: int) -> None:
    """Join the process group (its address is in the environment), train, and leave."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        train(rank, world_size)
        dist.barrier()  # leave together (see examples/ddp_train.py)
    finally:
        dist.destroy_process_group()
    # Leave without tearing the interpreter down. On torch 2.13, with or without koila,
    # FSDP2's sharded tensors keep the process group alive after destroy_process_group(),
    # so gloo's threads outlive it; one of them may still be releasing the last collectives'
    # tensors, which needs the interpreter, while it shuts down, and that aborts the
    # process ("terminate called without an active exception", about 1 run in 20 here).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main() -> None:
    if "RANK" in os.environ:  # started by torchrun, which set the rank and the address
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(worker, args=(WORLD_SIZE,), nprocs=WORLD_SIZE)


if __name__ == "__main__":
    main()
