"""Train with DistributedDataParallel on two ranks that have different amounts of memory.

Two CPU processes (the ``gloo`` backend) train one small MLP, wrapped in
``DistributedDataParallel``, on batches of 512 rows per rank, each rank's rows chosen
by a ``DistributedSampler``. The training step is decorated with ``koila.accumulate``.
Each rank trains inside a simulated device that stands in for its GPU, and rank 1's
is smaller: its whole batch does not fit. It runs out of memory in the first step,
and the ranks agree on it through ``torch.distributed``: both throw the step away and
run it again in micro-batches of the same smaller size (twice: rank 1 keeps, for the
rest of the step, the zeros it played along, and 256 rows no longer fit beside them),
and later steps start there. Every micro-batch but the last runs under DDP's
``no_sync()``, and the last one's backward all-reduces as DDP does it; a rank that runs
out of memory plays along the all-reduces it did not make, and the ranks agree on the
step before anyone keeps it, so an out-of-memory error on one rank never leaves the
other waiting in an all-reduce.

At the end, the parameters of both ranks are gathered and compared: they must be
identical, as in any DDP training.

With koila-retry installed from a clone, as the README says
(``pip install -c constraints.txt '.[progress,plot]'``), run::

    torchrun --nproc_per_node=2 examples/ddp_train.py

or, without torchrun, ``python examples/ddp_train.py``: the script then starts the
two processes itself with ``torch.multiprocessing`` (on 127.0.0.1, at a free port).
It takes a few seconds, most of them spent starting Python and importing PyTorch.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

# Imported before the process group is made, on purpose: imported after it (DistributedDataParallel
# imports it, through torch._dynamo), its functions' default arguments keep the default group
# alive after destroy_process_group(). Only the group's destructor stops gloo's threads, and one
# of them releasing a finished collective's tensors while the interpreter shuts down aborts the
# process ("terminate called without an active exception").
import torch.distributed.nn
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import koila_retry as koila
from koila_retry.testing import simulated_device

WORLD_SIZE = 2
ROWS, FEATURES, HIDDEN, CLASSES = 4096, 16, 256, 4
BATCH = 512  # rows per rank and step: one epoch is 4 steps on 2 ranks
# The simulated memory of each rank, for the training itself (the model and the data are
# made before it). Rank 0 has room for its 512 rows; rank 1 (and any other) stands in for a
# smaller GPU, where they do not fit.
LARGE, SMALL = "4MiB", "1.5MiB"


def make_data() -> TensorDataset:
    """Return the same synthetic classification data on every rank: the sampler splits it."""
    generator = torch.Generator().manual_seed(0)
    centres = torch.randn(CLASSES, FEATURES, generator=generator) * 2
    labels = torch.randint(0, CLASSES, (ROWS,), generator=generator)
    return TensorDataset(centres[labels] + torch.randn(ROWS, FEATURES, generator=generator), labels)


def train(rank: int, world_size: int) -> None:
    """Train on this rank; every rank runs this, and every collective, together."""
    torch.manual_seed(rank)  # different initial weights on purpose: DDP broadcasts rank 0's
    model = DistributedDataParallel(
        nn.Sequential(
            nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES)
        )
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sampler = DistributedSampler(make_data(), num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(sampler.dataset, batch_size=BATCH, sampler=sampler)

    def report(event: koila.OOMEvent) -> None:
        # Every rank hears of every failure (event.rank is the rank that ran out of memory);
        # rank 0 prints them, once.
        if rank == 0:
            print(
                f"  rank {event.rank} ran out of memory at {event.batch_size} rows per micro-batch; "
                f"every rank runs the step again at {event.next_batch_size}",
                flush=True,
            )

    # koila finds the DDP module the step reaches (here through its closure); ddp=model says so
    # explicitly. The step returns the mean loss of the rows it is given and calls no backward().
    @koila.accumulate(ddp=model, on_oom=report)
    def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(inputs), targets)

    sampler.set_epoch(0)
    # One simulated device for the whole loop, as a GPU would be: what outlives a step keeps
    # counting against the limit in the next (the optimizer's momentum, made by the first step).
    with simulated_device(LARGE if rank == 0 else SMALL):
        for number, (inputs, targets) in enumerate(loader, start=1):
            optimizer.zero_grad(set_to_none=True)
            loss = step(inputs, targets)  # this rank's loss over its whole batch, detached
            optimizer.step()
            # Gather (micro-batch size, loss) from every rank, so that rank 0 prints them together.
            mine = torch.tensor([float(step.stats.batch_size), loss.item()], dtype=torch.float64)
            gathered = [torch.empty_like(mine) for _ in range(world_size)]
            dist.all_gather(gathered, mine)
            sizes = ", ".join(f"rank {r}: {int(row[0])}" for r, row in enumerate(gathered))
            if rank == 0:
                mean_loss = sum(row[1].item() for row in gathered) / world_size
                print(
                    f"step {number}: micro-batch size {sizes} (of {BATCH} rows); mean loss {mean_loss:.4f}", flush=True
                )

    # DDP keeps the replicas equal only if every rank applied the same averaged gradients:
    # gather everyone's parameters and compare them with rank 0's, bit for bit.
    flat = torch.cat([parameter.detach().reshape(-1) for parameter in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(everyone, flat)
    if rank == 0:
        print(f"Settled on micro-batches of {sizes} rows.")
        print(f"Parameters identical on all ranks: {all(torch.equal(everyone[0], p) for p in everyone)}.")


def worker(rank: int, world_size: int) -> None:
    """Join the process group (its address is in the environment), train, and leave."""
    torch.set_num_threads(1)  # two processes on a small model: one thread each is fastest
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        train(rank, world_size)
        # Leave together: a rank that tears down its gloo connections while another is
        # still finishing its last collective can make that rank's process abort at exit.
        dist.barrier()
    finally:
        # Frees the group (nothing else holds it: see the import of torch.distributed.nn),
        # which joins gloo's threads while the interpreter is still whole.
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main() -> None:
    if "RANK" in os.environ:  # started by torchrun, which set the rank and the address
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
        return
    # Started with plain python: start the two ranks here, as torchrun would have.
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(worker, args=(WORLD_SIZE,), nprocs=WORLD_SIZE)


if __name__ == "__main__":
    main()
