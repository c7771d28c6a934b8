"""Train with a batch that does not fit in memory, split into micro-batches with the full batch's gradient.

A simulated device stands in for a small GPU: the tensors created inside it count
against its limit, and going over the limit raises a real ``torch.OutOfMemoryError``.
A small convolutional network learns to classify synthetic images, with batches of 256
that do not fit. Its training step is decorated with ``koila.accumulate``: the first
step runs out of memory, so what it wrote is thrown away and the step runs again in
micro-batches of the next smaller power of two, each micro-batch's loss weighted by its
share of the rows so that the gradients add up to those of the whole batch. Later steps
start at the size that worked. The optimizer still takes one step per batch of 256.

At the end, the weights are compared with those of the same steps, from the same
initial weights and in the same order, each taken on the whole batch at once with no
memory limit. Everything is in float64, so the two runs differ by rounding only. Run it
with another ``--memory``: the micro-batches change size, and the losses stay the same.

The model and the data are made before the simulated device, so its limit is the memory
for the training itself: the batch, its activations, the gradients and the optimizer's
momentum.

With koila-retry installed from a clone, as the README says
(``pip install -c constraints.txt '.[progress,plot]'``), run::

    python examples/train_with_accumulation.py
    python examples/train_with_accumulation.py --memory 3MiB --batch 512 --epochs 10
"""

from __future__ import annotations

import argparse
import copy
import time
from statistics import mean

import torch
from torch import nn
from torch.nn import functional as F

import koila_retry as koila
from koila_retry.testing import simulated_device

ROWS, SIDE, CLASSES = 2048, 12, 10
NOISE = 1.0  # how far each image is from its class's prototype
LEARNING_RATE, MOMENTUM = 0.1, 0.9


def make_data(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Return noisy copies of one random prototype image per class, and their labels."""
    prototypes = torch.randn(CLASSES, 1, SIDE, SIDE, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, CLASSES, (ROWS,), generator=generator)
    noise = torch.randn(ROWS, 1, SIDE, SIDE, generator=generator, dtype=torch.float64)
    return prototypes[labels] + NOISE * noise, labels


def make_model() -> nn.Module:
    """Return a small convolutional classifier, in float64.

    GroupNorm normalises each image on its own, so a micro-batch gives each image the
    same output as the whole batch would. BatchNorm in training mode would not: it
    normalises over the rows it is given, and ``koila.accumulate`` warns about it.
    """
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.GroupNorm(4, 16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1, stride=2),
        nn.GroupNorm(4, 32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, CLASSES),
    ).double()


def make_schedule(batch: int, epochs: int, generator: torch.Generator) -> list[list[torch.Tensor]]:
    """Return the row indices of every batch of every epoch, shuffled once, for both runs."""
    return [list(torch.randperm(ROWS, generator=generator).split(batch)) for _ in range(epochs)]


class Log:
    """The step being run, to say where an out-of-memory error happened."""

    def __init__(self) -> None:
        self.step = 0

    def report(self, event: koila.OOMEvent) -> None:
        """Print each out-of-memory error as ``koila.accumulate`` recovers from it."""
        print(
            f"  step {self.step}: out of memory at {event.batch_size} rows at a time; what the step wrote is "
            f"discarded, and it runs again at {event.next_batch_size} rows at a time"
        )


def train_in_micro_batches(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    schedule: list[list[torch.Tensor]],
    memory: str,
) -> list[float]:
    """Train ``model`` with ``koila.accumulate`` on a simulated device; return the loss of every step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM)
    log = Log()

    # The step returns the mean loss of the rows it is given. It calls neither backward()
    # nor the optimizer: koila.accumulate runs the backward of each micro-batch.
    @koila.accumulate(on_oom=log.report)
    def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(inputs), targets)

    losses: list[float] = []
    with simulated_device(memory) as device:
        for epoch, batches in enumerate(schedule, start=1):
            started, first = time.perf_counter(), len(losses)
            for index in batches:
                log.step += 1
                optimizer.zero_grad()
                loss = step(images[index], labels[index])  # the whole batch's loss, detached
                optimizer.step()
                losses.append(loss.item())
            print(
                f"  epoch {epoch}: mean loss {mean(losses[first:]):.4f} "
                f"({time.perf_counter() - started:.1f} s, micro-batches of {step.stats.batch_size} rows)"
            )
    stats = step.stats
    print(
        f"Settled on micro-batches of {stats.batch_size} rows: {stats.ooms} out-of-memory error(s) in "
        f"{stats.calls} steps, {stats.seconds_lost:.2f} s lost to failures, peak {device.peak / 2**20:.2f} MiB."
    )
    return losses


def train_whole_batches(
    model: nn.Module, images: torch.Tensor, labels: torch.Tensor, schedule: list[list[torch.Tensor]]
) -> list[float]:
    """Take the same steps the plain way, each on its whole batch, with no memory limit."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM)
    losses: list[float] = []
    for batches in schedule:
        for index in batches:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images[index]), labels[index])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return losses


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--memory", default="6MiB", help="the simulated memory left for training (default: %(default)s)"
    )
    parser.add_argument("--batch", type=int, default=256, help="rows per optimizer step (default: %(default)s)")
    parser.add_argument("--epochs", type=int, default=5, help="passes over the data (default: %(default)s)")
    args = parser.parse_args(argv)
    try:  # read as the simulated device reads it
        limit = simulated_device(args.memory).limit
    except ValueError as error:
        parser.error(f"--memory: {error}")
    if limit < 1:
        parser.error(f"--memory must be more than 0 bytes, like 16MiB, got {args.memory!r}")
    if args.batch < 1 or args.epochs < 1:
        parser.error("--batch and --epochs must be >= 1")

    # Tensors this small run faster on one thread than on several, and the timings vary less.
    torch.set_num_threads(1)
    # The first simulated device of a process makes PyTorch import its compiler stack, which
    # takes a few seconds: pay for it before any clock starts.
    with simulated_device(args.memory):
        torch.zeros(1).add_(1)

    generator = torch.Generator().manual_seed(0)
    images, labels = make_data(generator)
    schedule = make_schedule(args.batch, args.epochs, generator)
    torch.manual_seed(0)
    model = make_model()
    reference = copy.deepcopy(model)  # the same initial weights, for the plain run

    print(
        f"Training on {ROWS} images for {args.epochs} epochs, {len(schedule[0])} steps of up to {args.batch} rows "
        f"each, with {args.memory} of simulated memory:"
    )
    losses = train_in_micro_batches(model, images, labels, schedule, args.memory)
    steps = len(schedule[0])
    print(f"Mean loss per epoch: {mean(losses[:steps]):.4f} in the first, {mean(losses[-steps:]):.4f} in the last.")

    expected = train_whole_batches(reference, images, labels, schedule)
    difference = max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    same_losses = all(abs(a - b) <= 1e-9 * abs(b) for a, b in zip(losses, expected))
    print(f"Losses match the whole batches' at every step: {same_losses}.")
    print(f"Parameters match an unconstrained run: {difference < 1e-9} (largest difference {difference:.1e}).")


if __name__ == "__main__":
    try:
        main()
    except torch.OutOfMemoryError as error:  # before the first retry: the model itself does not fit
        raise SystemExit(f"error: {str(error).splitlines()[0]} (try a larger --memory)") from None
