"""The ranks' side of test_integration_fsdp.py: Hugging Face's Trainer under FSDP2, on a spawned gloo group.

Each rank is launched as torchrun would launch it (see tests/_trainer_ranks.py), and the trainer
shards its model with ``fully_shard`` through accelerate's FSDP plugin (``fsdp_config`` version 2).
The model is a tiny GPT-2 in float64 with a layer in its first block that runs out of memory on
chosen forward calls of rank 1, in its forward or in its backward (tests/_layers.py). How the
scenarios run and what they save: tests/_spawn.py.
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch
from _fsdp_ranks import Count
from _spawn import Scenarios, launched
from _trainer_ranks import caught, koila_warnings

import koila_retry as koila

# One group of two ranks; a collective that waits longer than this raises, so a hang ends the
# scenario instead of the group.
GROUPS = {"two": (2, 60)}
scenario = Scenarios(GROUPS)
BLOCK = "GPT2Block"  # the layers accelerate shards one by one; the root holds the rest
FSDP2 = {"version": 2, "transformer_layer_cls_to_wrap": [BLOCK]}
# Rank 1 runs out of memory in the forward of its first whole batch (4 rows), while the ranks still
# agree before each of FSDP2's collectives; then in the backward of the next optimizer step's whole
# batch, whose kind (gradient sync on, nothing accumulated unsharded) none of the micro-batches since
# recorded: the ranks agree before each collective again; then in the backward of that step's second
# micro-batch of 2 rows, after the blocks above the layer made theirs: a micro-batch of a kind recorded
# by then, so rank 1 plays along the rest of the others' collectives.
FAILURES = {0: "forward", 5: "backward", 7: "backward"}


def main(rank: int, group: str, port: int, directory: str) -> None:
    """The body of one spawned rank: its place in the group where the trainer looks for it."""
    launched(rank, GROUPS[group][0], port)
    fsdp_on_the_cpu()
    scenario.run(rank, group, port, directory)


def fsdp_on_the_cpu() -> None:
    """Make accelerate take its FSDP plugin on CPU processes, as it takes it on GPU ones.

    accelerate 1.15 turns a run with an FSDP plugin into an FSDP run only for accelerators
    (``AcceleratorState.__init__``: ``MULTI_GPU``, ``MULTI_XPU`` ...), and a CPU run silently
    stays DistributedDataParallel. FSDP2 itself runs on CPU tensors over gloo; this does what
    that branch does (the distributed type, the plugin) for a CPU run too.
    """
    from accelerate import state
    from accelerate.utils import DistributedType

    original = state.AcceleratorState.__init__
    if getattr(original, "fsdp_on_the_cpu", False):
        return

    def init(self: Any, *args: Any, fsdp_plugin: Any = None, **kwargs: Any) -> None:
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        # The state is shared: a later AcceleratorState() without a plugin (accelerate makes some) copies
        # the process's distributed type back in, and keeps the plugin an Accelerator gave.
        plugin = fsdp_plugin or vars(self).get("fsdp_plugin")
        if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = plugin

    init.fsdp_on_the_cpu = True  # type: ignore[attr-defined]
    state.AcceleratorState.__init__ = init  # type: ignore[method-assign]


def trainer(rank: int, failures: dict[int, str] | None = None, **arguments: Any) -> Any:
    """A trainer of the tiny GPT-2 sharded with FSDP2; rank 1's model fails where ``failures`` says."""
    from _hf_trainer import float64_gpt2, float64_loss_func, make_trainer

    settings: dict[str, Any] = {
        "ddp_backend": "gloo",
        "gradient_accumulation_steps": 2,
        "per_device_train_batch_size": 4,
        "fsdp": True,
        "fsdp_config": FSDP2,
    }
    model = float64_gpt2(failures if rank == 1 else None)
    return make_trainer(
        tempfile.mkdtemp(), model=model, compute_loss_func=float64_loss_func, **{**settings, **arguments}
    )


def gathered(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every parameter whole, gathered from the shards (a collective, in the same order on every rank)."""
    return [
        (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()  # type: ignore[operator]
        for p in model.parameters()
    ]


@scenario("two")
def hf_fsdp2_training(rank: int, world: int) -> dict[str, Any]:
    """The plain trainer with nothing failing, then the adapted one with rank 1 out of memory twice."""
    from _hf_trainer import injected, logged

    from koila_retry.integrations.transformers import adapt

    reference = trainer(rank)
    reference.train()
    expected = reference.evaluate()["eval_loss"]
    events: list[koila.OOMEvent] = []
    adapted = adapt(trainer(rank, FAILURES), on_oom=events.append)
    distributed = str(adapted.accelerator.distributed_type).split(".")[-1]
    with koila_warnings() as said, Count() as count:
        adapted.train()
        # Before the evaluation: after a forward without backward, the root keeps its parameters whole.
        sharded = type(next(adapted.model.parameters())).__name__
        # Rank 1's first evaluation forward runs out of memory too: the ranks evaluate in chunks.
        inject = injected(adapted.model)
        trained = len(inject.rows)
        if rank == 1:
            inject.failures = {len(inject.rows): "forward"}
        evaluated = adapted.evaluate()["eval_loss"]
    return {
        "distributed": (distributed, str(adapted.accelerator.distributed_type).split(".")[-1]),
        "wrapped": type(adapted.model_wrapped).__name__,
        "sharded": sharded,
        "parameters": gathered(adapted.model),
        "expected": gathered(reference.model),
        "steps": (adapted.state.global_step, reference.state.global_step),
        "losses": (logged(adapted, "loss"), logged(reference, "loss")),
        "grad_norms": (logged(adapted, "grad_norm"), logged(reference, "grad_norm")),
        "ooms": adapted.training_step.stats.ooms,
        "evaluation_ooms": adapted.prediction_step.stats.ooms,
        "eval_loss": (evaluated, expected),
        "events": [(event.batch_size, event.rank) for event in events],
        "rows": (inject.rows[:trained], inject.rows[trained:]),
        "plays": count.plays,
        "warnings": said,
    }


@scenario("two")
def hf_fsdp2_training_after_evaluation(rank: int, world: int) -> dict[str, Any]:
    """An evaluation after every step, which leaves the root gathered; rank 1 fails the third step's forward.

    The second step, after the first evaluation, recorded the kind (the root gathered) that the third is of.
    """
    from _hf_trainer import injected

    from koila_retry.integrations.transformers import adapt

    settings = {"gradient_accumulation_steps": 1, "eval_strategy": "steps", "eval_steps": 1}
    reference = trainer(rank, **settings)
    reference.train()
    events: list[koila.OOMEvent] = []
    adapted = adapt(trainer(rank, {4: "forward"}, **settings), on_oom=events.append)
    with koila_warnings() as said, Count() as count:
        adapted.train()
    return {
        "parameters": gathered(adapted.model),
        "expected": gathered(reference.model),
        "steps": (adapted.state.global_step, reference.state.global_step),
        "events": [(event.batch_size, event.rank) for event in events],
        "rows": injected(adapted.model).rows,
        "plays": count.plays,
        "warnings": said,
    }


@scenario("two")
def hf_fsdp2_exhausted_on_one_rank(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 cannot run its smallest micro-batch allowed, the whole batch: every rank raises, none waits."""
    from koila_retry.integrations.transformers import adapt

    adapted = adapt(trainer(rank, {0: "forward"}), minimum=4)
    return caught(adapted.train)


@scenario("two")
def hf_fsdp1_refused(rank: int, world: int) -> dict[str, Any]:
    """FSDP1 (fsdp_config version 1) is refused by name when adapted, before anything runs."""
    from koila_retry.integrations.transformers import adapt

    # sync_module_states off: FSDP1's plugin looks for an accelerator to sync them on.
    plain = trainer(rank, fsdp_config={**FSDP2, "version": 1, "sync_module_states": False})
    return {"version": plain.accelerator.state.fsdp_plugin.fsdp_version, **caught(lambda: adapt(plain))}
