"""The ranks' side of test_integration_lightning.py's DDP tests: Lightning's DDPStrategy on a spawned gloo group.

Each rank is launched as torchrun would launch it (see tests/_trainer_ranks.py), so Lightning finds
a process group already made and wraps the module in DistributedDataParallel. The plain trainer
runs with all the memory it wants; then the one with ``OOMRecovery``, on every rank with all the
memory, and again with rank 1 alone on a simulated device where the whole batch does not fit.
How the scenarios run and what they save: tests/_spawn.py.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, cast

from _spawn import Scenarios, launched
from _trainer_ranks import koila_warnings, limited, parameters

GROUPS = {"two": (2, 60)}  # a collective that waits longer than 60 s raises: a hang ends the scenario
scenario = Scenarios(GROUPS)
STEPS = 4  # DDP's static graph is recorded in the first step and followed from the second on


def main(rank: int, group: str, port: int, directory: str) -> None:
    """The body of one spawned rank: its place in the group where Lightning looks for it."""
    launched(rank, GROUPS[group][0], port)
    scenario.run(rank, group, port, directory)


def _static(module: type, rank: int) -> dict[str, Any]:
    """Fit ``module`` with ``DDPStrategy(static_graph=True)``: plain, then with OOMRecovery, unlimited and limited."""
    from _lightning_trainer import FIT_LIMIT, loader, trainer
    from lightning.pytorch.strategies import DDPStrategy

    from koila_retry.integrations.lightning import OOMRecovery

    def fit(model: Any, *callbacks: Any) -> Any:
        ran = trainer(*callbacks, devices=2, strategy=DDPStrategy(static_graph=True), max_steps=STEPS)
        ran.fit(model, loader(rows=512))  # each rank its own 4 batches of 64 rows (DistributedSampler)
        return ran

    value: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="lightning")
        reference = module()
        value["plain_steps"] = fit(reference).global_step
        value["expected"] = parameters(reference)
        value["plain_accumulated"] = len(reference.accumulations)
        for name, limit in (("all_the_memory", None), ("rank_1_limited", FIT_LIMIT)):
            model, events = module(), cast("list[Any]", [])
            with koila_warnings() as said, limited(rank, limit) if limit else contextlib.nullcontext():
                ran = fit(model, OOMRecovery(on_oom=events.append))
            value[name] = {
                "parameters": parameters(model),
                "steps": ran.global_step,
                "events": [(event.batch_size, event.rank) for event in events],
                "warnings": said,
                "accumulated": len(model.accumulations),
            }
    return value


def _modules() -> tuple[type, type]:
    from _lightning_trainer import MLP

    class Counted(MLP):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.accumulations: list[int] = []

    class Hooked(Counted):
        """Hooks on a parameter: run once per batch, on the whole batch's gradient, as without the callback."""

        def __init__(self) -> None:
            super().__init__()
            weight = self.net[0].weight  # the hooks must not hold the module: autograd keeps them
            weight.register_hook(lambda gradient: gradient.clamp(-1e-3, 1e-3) * 2)  # not additive over micro-batches
            weight.register_post_accumulate_grad_hook(lambda parameter, seen=self.accumulations: seen.append(1))

    return Counted, Hooked


@scenario("two")
def lightning_static_graph(rank: int, world: int) -> dict[str, Any]:
    return _static(_modules()[0], rank)


@scenario("two")
def lightning_static_graph_hooks(rank: int, world: int) -> dict[str, Any]:
    return _static(_modules()[1], rank)
