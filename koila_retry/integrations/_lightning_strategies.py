"""What ``OOMRecovery`` reads off a Lightning trainer's strategy and precision plugin: whether it
serves the strategy, how a micro-batch's backward runs, and whether the loop's backward is
Lightning's own.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
    Strategy,
)
from lightning.pytorch.strategies.single_xla import SingleDeviceXLAStrategy
from lightning.pytorch.strategies.xla import XLAStrategy

__all__ = ["PLUGIN", "SCALED", "check_trainer", "counts_gradients", "micro_backward", "plain_backward"]

# How a split step's micro-batches run their backward (None: loss.backward(), accumulate's default).
SCALED, PLUGIN = "scaled by AMP's scaler", "through the precision plugin"


def check_trainer(trainer: Any) -> None:
    """Refuse, in ``setup``, a trainer or a strategy that ``OOMRecovery`` does not serve."""
    if not isinstance(trainer, pl.Trainer):
        # pytorch_lightning's Trainer, say: the same release under its old name, whose classes are not these.
        kind = f"{type(trainer).__module__}.{type(trainer).__qualname__}"
        raise TypeError(
            f"OOMRecovery is a callback of lightning.pytorch's Trainer, and this trainer is a {kind}. The "
            "lightning and pytorch_lightning packages do not mix: import Trainer and LightningModule from "
            "lightning.pytorch (pip install 'koila-retry[lightning]')"
        )
    check_strategy(trainer.strategy)


def check_strategy(strategy: Strategy) -> None:
    """Refuse a strategy that ``OOMRecovery`` does not serve."""
    name = type(strategy).__name__
    # XLA on one core is a SingleDeviceStrategy too: refused by name, as XLA on several.
    if isinstance(strategy, (XLAStrategy, SingleDeviceXLAStrategy)):
        raise RuntimeError(
            f"OOMRecovery does not serve XLA: the trainer runs {name}, under which XLA computes the step's "
            "tensors lazily, as a graph it runs after the step returned, so an out-of-memory error there never "
            "reaches the step to be split. Use one CUDA or CPU device, strategy='ddp', or ModelParallelStrategy"
        )
    # ModelParallelStrategy: the module shards itself with fully_shard (FSDP2) in configure_model, and
    # accumulate plays FSDP2's collectives along; FSDPStrategy (FSDP1) and DeepSpeed stay refused.
    served = isinstance(strategy, (SingleDeviceStrategy, DDPStrategy, ModelParallelStrategy))
    if not served or isinstance(strategy, DeepSpeedStrategy):
        raise RuntimeError(
            f"OOMRecovery serves one device, DDP or FSDP2 (ModelParallelStrategy); the trainer runs {name}, "
            "whose forward or backward communicates between the ranks, so a rank that splits its step while "
            "another does not would leave that one waiting. Use strategy='ddp', ModelParallelStrategy with "
            "fully_shard in configure_model, or one device"
        )


def counts_gradients(strategy: Strategy) -> bool:
    """Return whether the strategy's DDP module has ``static_graph=True`` and is in its first iteration."""
    # DDP's reducer then counts every gradient each parameter gets, in any backward, to know how many
    # to wait for in later iterations. Private: DDP sets it in the first backward of a static graph.
    model: Any = strategy.model if isinstance(strategy, DDPStrategy) else None
    return bool(getattr(model, "static_graph", False)) and not getattr(
        model, "_static_graph_delay_allreduce_enqueued", True
    )


def micro_backward(trainer: pl.Trainer) -> str | None:
    """Return how a micro-batch's backward runs: as the loop's, less the module's ``backward`` and its hooks."""
    # Those run once per batch, in the loop's backward of the delivered loss; a precision plugin or
    # strategy with a backward of its own gets each micro-batch's loss.
    plugin, strategy = trainer.precision_plugin, trainer.strategy
    if (
        type(strategy).backward is not Strategy.backward
        or type(plugin).backward is not Precision.backward
        or type(plugin).pre_backward not in (Precision.pre_backward, MixedPrecision.pre_backward)
    ):
        return PLUGIN
    return None if getattr(plugin, "scaler", None) is None else SCALED


def plain_backward(trainer: pl.Trainer, module: pl.LightningModule) -> bool:
    """Return whether the loop's backward is Lightning's own: it scales the loss by AMP's scaler only."""
    plugin, strategy = trainer.precision_plugin, trainer.strategy
    return (
        "backward" not in vars(module)
        and type(module).backward is pl.LightningModule.backward
        and type(strategy).backward is Strategy.backward
        and type(plugin).backward is Precision.backward
        and type(plugin).pre_backward in (Precision.pre_backward, MixedPrecision.pre_backward)
    )
