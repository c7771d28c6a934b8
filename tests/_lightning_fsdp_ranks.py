"""The ranks' side of test_lightning_fsdp.py: Lightning's ModelParallelStrategy (FSDP2), on a spawned gloo group.

Each rank is launched as torchrun would launch it (see tests/_trainer_ranks.py), so Lightning finds
a process group already made. The module shards its blocks and itself with ``fully_shard`` in
``configure_model``, over the strategy's data-parallel mesh, as Lightning documents; a layer in
its middle block runs out of memory on chosen forward calls of rank 1, in its forward or in its
backward (tests/_layers.py). How the scenarios run and what they save: tests/_spawn.py.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from _fsdp_ranks import Count
from _layers import Inject
from _spawn import Scenarios, launched
from _trainer_ranks import caught, koila_warnings

import koila_retry as koila

GROUPS = {"two": (2, 60)}
scenario = Scenarios(GROUPS)
ROWS = 16  # each rank's batch
# Rank 1 runs out of memory in the forward of its first whole batch (16 rows), while the ranks still
# agree before each of FSDP2's collectives; then in the backward of the last micro-batch (8 rows) of
# the next batch, a kind recorded by then: rank 1 plays along the rest of the others' collectives.
FAILURES = {0: "forward", 4: "backward"}
# The first batch after the second validation: its kind (the root gathered) was recorded after the first.
_AFTER_VALIDATION = {6: "forward"}


def main(rank: int, group: str, port: int, directory: str) -> None:
    """The body of one spawned rank: its place in the group where Lightning looks for it."""
    launched(rank, GROUPS[group][0], port)
    scenario.run(rank, group, port, directory)


def _module(failures: dict[int, str]) -> Any:
    import lightning as L

    class Sharded(L.LightningModule):  # type: ignore[misc]
        """Three blocks in float64, each sharded with fully_shard, then the whole net."""

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.inject = Inject()
            self.inject.failures = dict(failures)
            self.net = torch.nn.Sequential(
                torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh()),
                torch.nn.Sequential(torch.nn.Linear(32, 32), self.inject, torch.nn.Tanh()),
                torch.nn.Linear(32, 4),
            ).double()

        def configure_model(self) -> None:
            from torch.distributed.fsdp import FSDPModule, fully_shard

            if isinstance(self.net, FSDPModule):  # sharded by an earlier fit or validate
                return
            mesh = self.device_mesh["data_parallel"]
            for block in self.net[:2]:
                fully_shard(block, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.log("val_loss", loss, sync_dist=True)
            return loss

        def predict_step(self, batch: Any, batch_idx: int) -> Any:
            x, _ = batch
            return self.net(x) + self.net(x * 0.5)  # twice validation_step's collectives

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)

    return Sharded()


def _loader(rows: int) -> Any:
    from _lightning_trainer import loader  # imports lightning: only where a scenario runs

    return loader(rows, ROWS)


def _trainer(*callbacks: Any, **options: Any) -> Any:
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    settings = {
        "accelerator": "cpu",
        "devices": 2,
        "strategy": ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        "max_steps": 3,
        "accumulate_grad_batches": 2,
        "gradient_clip_val": 0.1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        **options,
    }
    return L.Trainer(callbacks=list(callbacks), **settings)


def gathered(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every parameter whole, gathered from the shards (a collective, in the same order on every rank)."""
    return [
        (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()  # type: ignore[operator]
        for p in model.parameters()
    ]


@scenario("two")
def lightning_fsdp2_training_and_validation(rank: int, world: int) -> dict[str, Any]:
    """The plain trainer with nothing failing, then OOMRecovery's with rank 1 out of memory."""
    from koila_retry.integrations.lightning import OOMRecovery

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="lightning")
        reference = _module({})
        plain = _trainer()
        plain.fit(reference, _loader(ROWS * world * 6))
        expected = plain.validate(reference, _loader(ROWS * world), verbose=False)
        model = _module(FAILURES if rank == 1 else {})
        events: list[koila.OOMEvent] = []
        adapted = _trainer(OOMRecovery(on_oom=events.append))
        with koila_warnings() as said, Count() as count:
            adapted.fit(model, _loader(ROWS * world * 6))
            trained, trained_rows = len(events), len(model.inject.rows)
            if rank == 1:
                model.inject.failures = {len(model.inject.rows): "forward"}
            validated = adapted.validate(model, _loader(ROWS * world), verbose=False)
    return {
        "strategy": type(adapted.strategy).__name__,
        "sharded": type(next(model.parameters())).__name__,
        "parameters": gathered(model),
        "expected": gathered(reference),
        "steps": (adapted.global_step, plain.global_step),
        "training_events": [(event.batch_size, event.rank) for event in events[:trained]],
        "validation_events": [(event.batch_size, event.rank) for event in events[trained:]],
        "rows": (model.inject.rows[:trained_rows], model.inject.rows[trained_rows:]),
        "plays": count.plays,
        "validated": (validated, expected),
        "warnings": said,
    }


@scenario("two")
def lightning_fsdp2_validation_inside_fit(rank: int, world: int) -> dict[str, Any]:
    """Validation every two batches inside fit: each training step after it finds the root gathered."""
    from koila_retry.integrations.lightning import OOMRecovery

    failures = _AFTER_VALIDATION if rank == 1 else {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="lightning")
        reference = _module({})
        plain = _trainer(val_check_interval=2)
        plain.fit(reference, _loader(ROWS * world * 6), _loader(ROWS * world))
        model = _module(failures)
        events: list[koila.OOMEvent] = []
        adapted = _trainer(OOMRecovery(on_oom=events.append), val_check_interval=2)
        with koila_warnings() as said, Count() as count:
            adapted.fit(model, _loader(ROWS * world * 6), _loader(ROWS * world))
    return {
        "parameters": gathered(model),
        "expected": gathered(reference),
        "steps": (adapted.global_step, plain.global_step),
        "events": [(event.batch_size, event.rank) for event in events],
        "rows": model.inject.rows,
        "plays": count.plays,
        "warnings": said,
    }


@scenario("two")
def lightning_fsdp2_predict_after_validate(rank: int, world: int) -> dict[str, Any]:
    """A validation that records its collectives, then a prediction, of two forwards, that rank 1 fails at once."""
    from koila_retry.integrations.lightning import OOMRecovery

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="lightning")
        reference = _module({})
        expected = _trainer().predict(reference, _loader(ROWS * world))
        model = _module({})
        events: list[koila.OOMEvent] = []
        adapted = _trainer(OOMRecovery(on_oom=events.append))
        adapted.validate(model, _loader(ROWS * world), verbose=False)
        if rank == 1:
            model.inject.failures = {len(model.inject.rows): "forward"}
        before = len(model.inject.rows)
        predicted = adapted.predict(model, _loader(ROWS * world))
    return {
        "predicted": (predicted, expected),
        "events": [(event.batch_size, event.rank) for event in events],
        "rows": model.inject.rows[before:],
    }


@scenario("two")
def lightning_fsdp2_exhausted_on_one_rank(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 cannot run its smallest micro-batch allowed, the whole batch: every rank raises, none waits."""
    from koila_retry.integrations.lightning import OOMRecovery

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="lightning")
        adapted = _trainer(OOMRecovery(minimum=ROWS), max_steps=1, accumulate_grad_batches=1)
        model = _module({0: "forward"} if rank == 1 else {})
        return caught(lambda: adapted.fit(model, _loader(ROWS * world)))
