"""Train an unchanged LightningModule whose batches do not fit, with the whole batch's gradient.

A simulated device stands in for a small GPU: the tensors created inside it count
against its limit, and going over the limit raises a real ``torch.OutOfMemoryError``.
First a plain ``lightning.Trainer`` runs out of memory on the first batch. Then the same
trainer with the ``OOMRecovery`` callback trains the same module: its training step runs
out of memory too, and runs again as micro-batches whose losses are weighted by their
share of the rows; the optimizer, gradient clipping and the learning-rate schedule see the
whole batch's gradient, once per batch. Validation runs in chunks when a batch does not
fit, with the whole batch's metrics.

At the end, the weights and the validation loss are compared with those of an unlimited
run. Everything is in float64, so the two runs differ by rounding only. (With
``--memory 3MiB`` the callback trains the whole batches where the plain Trainer runs out
of memory: it frees the previous step's gradients before the forward, when Lightning
would free them before the backward.)

With koila-retry installed from a clone, as the README says
(``pip install -c constraints.txt '.[progress,plot]'``), and its ``lightning`` extra, run::

    pip install -c constraints.txt '.[lightning]'
    python examples/trainer_lightning.py
    python examples/trainer_lightning.py --memory 4MiB --batch 512
"""

from __future__ import annotations

import argparse
import warnings
from typing import Any

import lightning
import torch
from torch.nn import functional as F

from koila_retry import OOMEvent
from koila_retry.integrations.lightning import OOMRecovery
from koila_retry.testing import simulated_device


class Classifier(lightning.LightningModule):
    """A plain LightningModule: nothing in it knows about koila-retry."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
            torch.nn.Linear(256, 8),
        ).double()  # fmt: skip

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        loss = F.cross_entropy(self.net(inputs), targets)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        inputs, targets = batch
        self.log("val_loss", F.cross_entropy(self.net(inputs), targets))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)}


def data(rows: int, batch: int, seed: int) -> torch.utils.data.DataLoader[Any]:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(rows, 32, dtype=torch.float64, generator=generator)
    targets = (inputs[:, :8].argmax(dim=1) + (inputs[:, 8] > 1).long()) % 8
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs, targets), batch_size=batch)


def trainer(steps: int, *callbacks: Any) -> lightning.Trainer:
    return lightning.Trainer(
        accelerator="cpu",
        max_steps=steps,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=list(callbacks),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--memory", default="2.5MiB", help="the simulated device's memory (default 2.5MiB)")
    parser.add_argument("--batch", type=int, default=256, help="rows per batch (default 256)")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps (default 6)")
    args = parser.parse_args()
    try:  # read as the simulated device reads it
        limit = simulated_device(args.memory).limit
    except ValueError as error:
        parser.error(f"--memory: {error}")
    if limit < 1:
        parser.error(f"--memory must be more than 0 bytes, like 16MiB, got {args.memory!r}")
    if args.batch < 1 or args.steps < 1:
        parser.error("--batch and --steps must be >= 1")
    warnings.filterwarnings("ignore", module="lightning")
    train, val = data(args.batch * 3, args.batch, 0), data(args.batch * 2, args.batch, 1)

    print(f"A plain Trainer, batches of {args.batch} rows, on a simulated device of {args.memory}:")
    try:
        with simulated_device(args.memory):
            trainer(args.steps).fit(Classifier(), train, val)
        print("  it fitted; try a smaller --memory")
    except torch.OutOfMemoryError as error:
        print(f"  {type(error).__name__}: {str(error).splitlines()[0][:90]}...")

    def report(event: OOMEvent) -> None:
        print(f"  {event.function}: out of memory at {event.batch_size} rows at a time, next {event.next_batch_size}")

    print("The same Trainer with callbacks=[OOMRecovery()]:")
    model = Classifier()
    recovering = trainer(args.steps, OOMRecovery(on_oom=report))
    with simulated_device(args.memory) as device:
        recovering.fit(model, train, val)
        (validated,) = recovering.validate(model, val, verbose=False)
    print(f"  trained {recovering.global_step} optimizer steps; peak {device.peak / 2**20:.2f} MiB")

    reference = Classifier()
    unlimited = trainer(args.steps)
    unlimited.fit(reference, train, val)
    (expected,) = unlimited.validate(reference, val, verbose=False)
    same = all(torch.allclose(p, q, rtol=1e-10, atol=1e-12) for p, q in zip(model.parameters(), reference.parameters()))
    print(f"Parameters match an unlimited run: {same}")
    print(f"Validation loss {validated['val_loss']:.6f}, unlimited {expected['val_loss']:.6f}")


if __name__ == "__main__":
    try:
        main()
    except torch.OutOfMemoryError as error:  # before the first retry: the model itself does not fit
        raise SystemExit(f"error: {str(error).splitlines()[0]} (try a larger --memory)") from None
