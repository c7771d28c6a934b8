"""The ranks' side of test_integration_ddp.py: the trainers' integrations under DDP, every rank in turn.

Each rank is launched as torchrun would launch it (its rank and the group's address in the
environment), so Hugging Face's Trainer and Lightning's Trainer both find a process group
already made (tests/_spawn.py) and wrap the model in DistributedDataParallel. Rank 1 alone
runs on a simulated device with little memory; rank 0 has all it wants. How the scenarios
run and what they save: tests/_spawn.py.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from _spawn import Scenarios, launched

import koila_retry as koila
from koila_retry._core import distributed
from koila_retry.testing import simulated_device

# One group of two ranks; a collective that waits longer than this raises, so a hang ends the
# scenario instead of the group.
GROUPS = {"two": (2, 60)}
scenario = Scenarios(GROUPS)


def main(rank: int, group: str, port: int, directory: str) -> None:
    """The body of one spawned rank: its place in the group where the trainers look for it."""
    launched(rank, GROUPS[group][0], port)
    scenario.run(rank, group, port, directory)


def limited(rank: int, limit: str) -> contextlib.AbstractContextManager[Any]:
    """Rank 1's simulated device of ``limit``; all the memory there is on the other ranks."""
    return simulated_device(limit) if rank == 1 else contextlib.nullcontext()


def _issuer() -> str:
    """Return the name of the module whose code is giving the warning being shown now."""
    frame = sys._getframe(2)  # below _issuer and the showwarning hook
    while frame is not None and frame.f_globals.get("__name__") in ("warnings", __name__):
        frame = frame.f_back
    return "" if frame is None else str(frame.f_globals.get("__name__", ""))


@contextlib.contextmanager
def koila_warnings() -> Iterator[list[str]]:
    """Record the warnings that koila-retry's own code gives; the trainers' own notices are not this library's.

    A warning counts by the module that gives it, read off the stack while it is shown, not by
    the file it names: ``stacklevel`` points that at the caller, and every file's path holds the
    name of the folder the checkout was cloned into (``koila-retry``, as the README clones it).
    """
    found: list[str] = []

    def record(message: Warning | str, *args: Any) -> None:
        if _issuer().partition(".")[0] == "koila_retry":
            found.append(str(message))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        yield found


@contextlib.contextmanager
def koila_averages() -> Iterator[list[int]]:
    """Count the steps whose gradients koila-retry averaged across the ranks itself (not DDP)."""
    counted = [0]
    reduce = distributed.GradientSync.reduce

    def counting(self: distributed.GradientSync, *args: Any, **kwargs: Any) -> None:
        counted[0] += 1
        reduce(self, *args, **kwargs)

    distributed.GradientSync.reduce = counting  # type: ignore[method-assign]
    try:
        yield counted
    finally:
        distributed.GradientSync.reduce = reduce  # type: ignore[method-assign]


def parameters(model: torch.nn.Module) -> list[torch.Tensor]:
    return [parameter.detach().clone() for parameter in model.parameters()]


def caught(run: Callable[[], Any]) -> dict[str, Any]:
    """Run ``run``; return what it returned, or the type and message of what it raised."""
    try:
        return {"returned": run()}
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc)}


# --------------------------------------------------------------------------- Hugging Face

HF_TRAIN_LIMIT = "768KiB"  # 4 padded rows (and DDP's buckets) do not fit at once; 2 do
HF_EVAL_LIMIT = "128KiB"


def _hf_trainer(**arguments: Any) -> Any:
    from _hf_trainer import make_trainer

    settings = {"ddp_backend": "gloo", "gradient_accumulation_steps": 2, "per_device_train_batch_size": 4}
    return make_trainer(tempfile.mkdtemp(), **{**settings, **arguments})


@scenario("two")
def hf_training_and_evaluation(rank: int, world: int) -> dict[str, Any]:
    """The plain trainer with all the memory, then the adapted one with rank 1 limited."""
    from _hf_trainer import logged

    from koila_retry.integrations.transformers import adapt

    reference = _hf_trainer()
    reference.train()
    expected = reference.evaluate()["eval_loss"]
    events: list[koila.OOMEvent] = []
    trainer = adapt(_hf_trainer(), on_oom=events.append)
    with koila_warnings() as said, koila_averages() as averaged:
        with limited(rank, HF_TRAIN_LIMIT):
            trainer.train()
        training = trainer.training_step.stats
        with limited(rank, HF_EVAL_LIMIT):
            evaluated = trainer.evaluate()["eval_loss"]
    return {
        "distributed": str(trainer.accelerator.distributed_type).split(".")[-1],
        "wrapped": type(trainer.model_wrapped).__name__,
        "find_unused": getattr(trainer.model_wrapped, "find_unused_parameters", None),
        "parameters": parameters(trainer.model),
        "expected": parameters(reference.model),
        "steps": (trainer.state.global_step, reference.state.global_step),
        "losses": (logged(trainer, "loss"), logged(reference, "loss")),
        "grad_norms": (logged(trainer, "grad_norm"), logged(reference, "grad_norm")),
        "training_ooms": training.ooms,
        "evaluation_ooms": trainer.prediction_step.stats.ooms,
        "events": [(event.batch_size, event.rank) for event in events],
        "eval_loss": (evaluated, expected),
        "warnings": said,
        "averaged": averaged[0],
    }


@scenario("two")
def hf_exhausted_on_one_rank(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 cannot run its smallest micro-batch allowed, the whole batch: every rank raises, none waits."""
    from koila_retry.integrations.transformers import adapt

    trainer = adapt(_hf_trainer(), minimum=4)
    with limited(rank, HF_TRAIN_LIMIT):
        return caught(trainer.train)


# --------------------------------------------------------------------------- Lightning


def _lightning(*callbacks: Any, **options: Any) -> Any:
    from _lightning_trainer import trainer

    settings = {"devices": 2, "strategy": "ddp", "gradient_clip_val": 0.1, "accumulate_grad_batches": 2}
    return trainer(*callbacks, **{**settings, **options})


def _lightning_run(rank: int, model: Any, reference: Any, **options: Any) -> dict[str, Any]:
    from _lightning_trainer import EVAL_LIMIT, FIT_LIMIT, loader

    from koila_retry.integrations.lightning import OOMRecovery

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="lightning")
        plain = _lightning(**options)
        plain.fit(reference, loader(rows=512))
        expected = plain.validate(reference, loader(rows=128), verbose=False)
        events: list[koila.OOMEvent] = []
        adapted = _lightning(OOMRecovery(on_oom=events.append), **options)
        with koila_warnings() as said, koila_averages() as averaged:
            with limited(rank, FIT_LIMIT):
                adapted.fit(model, loader(rows=512))
            trained = len(events)
            with limited(rank, EVAL_LIMIT):
                validated = adapted.validate(model, loader(rows=128), verbose=False)
    return {
        "strategy": type(adapted.strategy).__name__,
        "parameters": parameters(model),
        "expected": parameters(reference),
        "steps": (adapted.global_step, plain.global_step),
        "training_events": [(event.batch_size, event.rank) for event in events[:trained]],
        "validation_events": [(event.batch_size, event.rank) for event in events[trained:]],
        "validated": (validated, expected),
        "warnings": said,
        "averaged": averaged[0],
    }


@scenario("two")
def lightning_training_and_validation(rank: int, world: int) -> dict[str, Any]:
    from _lightning_trainer import MLP

    return _lightning_run(rank, MLP(), MLP())


@scenario("two")
def lightning_unused_parameters(rank: int, world: int) -> dict[str, Any]:
    """DDP that looks for unused parameters, in a module with a layer its steps never use."""
    from _lightning_trainer import MLP

    class Unused(MLP):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.spare = torch.nn.Linear(4, 4).double()

    return _lightning_run(rank, Unused(), Unused(), strategy="ddp_find_unused_parameters_true")


@scenario("two")
def lightning_parameter_hooks(rank: int, world: int) -> dict[str, Any]:
    """Hooks on a parameter: they run once per batch, on the whole batch's gradient, as without the callback."""
    from _lightning_trainer import MLP

    class Hooked(MLP):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.accumulations: list[int] = []  # the hooks must not hold the module: autograd keeps them
            weight = self.net[0].weight
            weight.register_hook(lambda gradient: gradient.clamp(-1e-3, 1e-3) * 2)  # not additive over micro-batches
            weight.register_post_accumulate_grad_hook(lambda parameter, seen=self.accumulations: seen.append(1))

    model, reference = Hooked(), Hooked()
    value = _lightning_run(rank, model, reference)
    value["accumulated"] = (len(model.accumulations), len(reference.accumulations))
    return value


@scenario("two")
def lightning_exhausted_on_one_rank(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 cannot run its smallest micro-batch allowed, the whole batch: every rank raises, none waits."""
    from _lightning_trainer import FIT_LIMIT, MLP, loader

    from koila_retry.integrations.lightning import OOMRecovery

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="lightning")
        adapted = _lightning(OOMRecovery(minimum=64), max_steps=1, accumulate_grad_batches=1)
        with limited(rank, FIT_LIMIT):
            return caught(lambda: adapted.fit(MLP(), loader(rows=256)))
