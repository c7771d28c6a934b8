"""Lightning: ``OOMRecovery``, a callback that runs a step that does not fit as micro-batches.

It lets an unchanged ``LightningModule`` survive out-of-memory errors with its training
unchanged (docs/trainers.rst). The one fact to know: Lightning runs ``training_step``, then
``zero_grad``, then its own backward. On one device a step first runs whole, its backward
left to the loop's, where a failure can be undone and the step run again inside that
backward (``_whole``, ``_backward_of_whole``). Otherwise the step runs its micro-batches'
backward inside ``training_step``, takes the gradients out of ``.grad`` and hands them to
the loop's backward (``_hand_over``, ``_Delivery``, or ``_hand_over_uncounted`` in the first
step of DDP's static graph): everything after the backward sees the whole batch's gradient,
once. Where the loop runs no backward (the BatchNorm epoch of SWA), neither does the step:
whole, or split under ``no_grad`` (``_unbacked``).
"""

from __future__ import annotations

import functools
import operator
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import BatchSizeFinder, Callback
    from lightning.pytorch.strategies import ModelParallelStrategy, SingleDeviceStrategy
except ImportError as _missing:  # as the transformers integration says it
    raise ImportError(
        f"koila_retry.integrations.lightning needs lightning (koila-retry's lightning extra): {_missing}"
    ) from _missing

from koila_retry._common.batches import Split
from koila_retry._common.contents import Contents
from koila_retry._common.places import replayable
from koila_retry._common.tensors import set_grads
from koila_retry._core.cache import class_identity
from koila_retry._core.detect import is_oom
from koila_retry._core.outcomes import clear_frames
from koila_retry._core.policy import Options, Policy
from koila_retry._core.sharded import as_sharded
from koila_retry._core.stats import OOMEvent
from koila_retry._frontends.accumulate import accumulator
from koila_retry._frontends.batch import Batched
from koila_retry._frontends.gradients import made_again
from koila_retry._frontends.other_leaves import OtherLeaves, added_back
from koila_retry._frontends.whole import Whole, unsplittable
from koila_retry.integrations._lightning_logging import WHOLE, Logs
from koila_retry.integrations._lightning_module import ABSENT, holds_a_wrapper, leave_out, let_go, trainable
from koila_retry.integrations._lightning_strategies import (
    PLUGIN,
    SCALED,
    check_trainer,
    counts_gradients,
    micro_backward,
    plain_backward,
)
from koila_retry.integrations._lightning_tensors import restored, suspended, watched, without_graphs

# At run time too: typing.get_type_hints() reads the options' annotations.
if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # the backport torch depends on
    from typing_extensions import Unpack

__all__ = ["OOMRecovery"]

_EVALUATION = ("validation_step", "test_step", "predict_step")
# The hooks Lightning calls once per batch (or per backward) that do nothing here; ``on_train_batch_start``
# notes the batch's index.
_IDLE = (
    "on_train_batch_end",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_test_batch_start",
    "on_test_batch_end",
    "on_predict_batch_start",
    "on_predict_batch_end",
)


class OOMRecovery(Callback):
    """Run a Lightning step that runs out of memory as micro-batches of the same batch.

    A callback for :class:`lightning.pytorch.Trainer`: a ``training_step`` (automatic
    optimisation) that does not fit runs as micro-batches whose gradients add up to
    the whole batch's, and the optimizer step, gradient clipping and schedulers see
    that gradient once; a ``validation_step``, ``test_step`` or ``predict_step`` that
    does not fit runs in chunks whose outputs are joined into the whole batch's. The
    batch size, the number of optimizer steps and the learning-rate schedule do not
    change. On one device, under DDP or under FSDP2 (``ModelParallelStrategy`` with
    ``fully_shard`` in ``configure_model``), where the ranks agree on every size. See
    the module's documentation for how.

    Args:
        initial (int or None): the first micro-batch size to try; ``None``, the
            default, is the whole batch.
        reduction (str): ``"mean"``, the default, if ``training_step``'s loss is a
            mean over the batch's rows (each micro-batch's is weighted by its share
            of the rows), ``"sum"`` if it is a sum over them (``reduction="sum"``:
            each micro-batch's is added as it is); the floating-point values every
            step logs and returns are taken for the same.
        **options (Options): the shared options of every front end (``minimum``,
            ``cache``, ``max_attempts``, ``on_oom``, ``schedule``, ``grow`` ...);
            see :ref:`options`.

    Raises:
        TypeError: if an option is unknown or has the wrong type.
        ValueError: if an option is out of range, or ``reduction`` is neither
            ``"mean"`` nor ``"sum"``.
        RuntimeError: in ``setup``, if the trainer's strategy is none of one device,
            DDP and ``ModelParallelStrategy`` (FSDP1's ``FSDPStrategy``, DeepSpeed
            and XLA, ``SingleDeviceXLAStrategy`` too, are refused by name), or if a
            ``BatchSizeFinder`` is among its callbacks (``Tuner.scale_batch_size``
            adds one).

    Example::

        trainer = lightning.Trainer(callbacks=[OOMRecovery()])

    .. versionadded:: 0.1.0
    """

    def __init__(self, *, initial: int | None = None, reduction: str = "mean", **options: Unpack[Options]) -> None:
        Policy.of("OOMRecovery", initial, options, rows=True, own=("initial", "reduction"))
        if reduction not in ("mean", "sum"):
            raise ValueError(
                f"reduction must be 'mean' (training_step's loss is a mean over the batch's rows) or 'sum' (a sum "
                f"over them), got {reduction!r}"
            )
        self._options: dict[str, Any] = {"initial": initial, "reduction": reduction, **options}
        self._steps: dict[str, _Step] = {}
        # Lightning calls a callback's hook only if it is callable: one that does nothing is None on the
        # instance, unless a subclass gave it a body, which spares each batch its call (a profiler context...).
        for hook in _IDLE:
            if getattr(type(self), hook) is getattr(Callback, hook):
                vars(self)[hook] = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Put the wrappers in front of the module's steps (Lightning calls it)."""
        check_trainer(trainer)
        finders = [type(each).__name__ for each in cast(Any, trainer).callbacks if isinstance(each, BatchSizeFinder)]
        if finders:
            raise RuntimeError(
                f"OOMRecovery and {finders[0]} in one trainer: OOMRecovery splits every step that does not fit, "
                f"so {finders[0]} would never see an out-of-memory error and would double the batch size up to "
                "the dataset's, and it does not count OOMRecovery's BatchSizeExhausted as one. Use one of them: "
                f"{finders[0]} (or Tuner.scale_batch_size) to pick a batch size that fits whole, then OOMRecovery "
                "in the trainer that trains with it"
            )
        names = list(_EVALUATION)
        if pl_module.automatic_optimization:
            names.append("training_step")
        elif stage == "fit" and not holds_a_wrapper(pl_module):
            warnings.warn(
                f"{type(pl_module).__name__} uses manual optimisation: OOMRecovery leaves its training_step as it "
                "is (evaluation steps are still split). Decorate the loss computation inside training_step with "
                "koila_retry.accumulate(backward=self.manual_backward) instead.",
                UserWarning,
                stacklevel=2,
            )
        for name in names:
            # A step set on the module object is the module's own, and served; a wrapper of ours is
            # told by its mark: another OOMRecovery of this trainer serves it, one of an earlier
            # trainer that never took it away is taken away first.
            wrapper = _wrapper_of(vars(pl_module).get(name))
            if wrapper is not None:
                if wrapper.trainer is trainer:
                    continue
                wrapper.uninstall(pl_module)
            step = self._steps.get(name)
            if step is None:
                step = self._steps[name] = _Step(name, self._options)
            step.install(trainer, pl_module)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Note the batch's index: whether Lightning zeroes the gradients after its step (Lightning calls it)."""
        step = self._steps.get("training_step")
        if step is not None:
            step.batch_idx = batch_idx

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Take the wrappers away (Lightning calls it)."""
        for step in self._steps.values():
            step.uninstall(pl_module)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Take the wrappers away, and what a step held, when ``fit``, ``validate`` ... raise (Lightning calls it)."""
        # Lightning calls teardown only when they return. The exception is not kept.
        for step in self._steps.values():
            step.uninstall(pl_module)


class _Held:
    """What a split training step hands to the loop's backward: its gradients, once."""

    __slots__ = ("gradients", "scale", "unit")

    def __init__(self, gradients: list[torch.Tensor], scale: torch.Tensor | None, unit: bool) -> None:
        self.gradients, self.scale = gradients, scale
        self.unit = unit  # the loop's backward is known to bring a gradient of exactly 1

    def take(self, grad: torch.Tensor) -> list[torch.Tensor]:
        """Return the gradients, once, at the scale of the loop's backward, whose gradient of the loss is ``grad``."""
        gradients, self.gradients = self.gradients, []
        # The loop's backward scales (AMP) and divides the loss; the gradients are at the scaler's scale already.
        factor = grad if self.scale is None else grad / self.scale
        if gradients and not self.unit:  # times 1 would be a pass over every gradient for nothing
            if factor.dim() and factor.numel() == 1:  # a loss of shape (1,): _foreach_mul_ takes a 0-dim factor
                factor = factor.reshape(())
            torch._foreach_mul_(gradients, factor)  # one call for every gradient
        return gradients


class _Delivery(torch.autograd.Function):
    """The whole batch's loss as a function of the parameters; its backward gives the step's gradients."""

    @staticmethod
    def forward(ctx: Any, held: _Held, loss: torch.Tensor, *parameters: torch.Tensor) -> torch.Tensor:
        ctx.held = held
        return loss.view_as(loss)  # no memory of its own: after the ranks agreed, an allocation could fail on one alone

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        held: _Held = ctx.held
        return (None, None, *held.take(grad))


# A step that ran whole, until the loop's backward: its loss, batch, parameters, the gradients set
# aside as it began (none where they were released), back in .grad until that backward (see _whole),
# accumulate_grad_batches, and what the batch's containers held as it began.
_Pending = tuple[torch.Tensor, tuple[Any, ...], Any, list[torch.nn.Parameter], list[torch.Tensor | None], int, Contents]


def _hand_over(held: _Held, leaves: list[torch.Tensor], grad: torch.Tensor) -> None:
    """Write the step's gradients into ``.grad`` as the loop's backward reaches the loss, as accumulation would."""
    for leaf, gradient in zip(leaves, held.take(grad)):
        if leaf.grad is None:
            leaf.grad = gradient
        else:  # accumulate_grad_batches: Lightning keeps the window's gradients
            leaf.grad += gradient


def _hand_over_uncounted(held: _Held, leaves: list[torch.Tensor], grad: torch.Tensor) -> None:
    """Give the step's gradients to the leaves' accumulation nodes, with their hooks, unseen by DDP's reducer."""
    for leaf, gradient in zip(leaves, held.take(grad)):
        for hook in list((leaf._backward_hooks or {}).values()):  # as autograd runs them before the node
            changed = hook(gradient)
            if changed is not None:
                gradient = changed
        # Called directly, the node runs no post hook (the reducer's), and itself runs post-accumulate-grad hooks.
        cast(Any, torch.autograd.graph.get_gradient_edge(leaf).node)(gradient)


class _Step:
    """One step hook of a module (``training_step``, ``validation_step`` ...), wrapped."""

    def __init__(self, name: str, options: dict[str, Any]) -> None:
        self.name, self.options = name, options
        self.train = name == "training_step"
        self.trainer: pl.Trainer | None = None
        self.module: pl.LightningModule | None = None
        self.target: Callable[..., Any] = _unset
        self.owner: tuple[type, str | None] | None = None  # the module class and its micro-batches' backward
        self.run: Batched[..., Any] = cast("Batched[..., Any]", _unset)
        # Runs a batch that cannot be split, whole (see _call).
        self.unsplit = Whole(_unset, name, lambda whole: cast("Batched[..., Any]", _unset), "", "")
        self.given: tuple[tuple[Any, ...], dict[str, Any]] = ((), {})  # a splittable batch's, while it runs
        # Of the step running, as accumulate splits its batch (1 for one it cannot split), counted
        # only once a micro-batch needs it (0 until then): a batch that runs whole needs no count.
        self.rows = 0
        self.whole: Any = None  # its output, while its last attempt ran the whole batch
        self.logs = Logs()
        self.saved: Any = ABSENT  # a step of the module object's own, which the wrapper wraps
        self.scale: torch.Tensor | None = None
        self.batch_idx: int | None = None  # of the training batch running, from on_train_batch_start
        self.trusting = True  # whether this step may run as the loop runs it (_whole, _evaluate): until an OOM there
        self.unbacked = True  # the same, for a step whose backward the loop skips (_unbacked)
        self.failure: tuple[str, str] | None = None  # a whole step's OOM, until accumulate raises it again (replay)
        # The loss of a step that ran whole, its batch and parameters, until the loop's backward of it.
        self.pending: _Pending | None = None
        self.walks: bool | None = None  # whether its graph reaches other leaves (_train, _backward_of_whole)
        self.others: OtherLeaves | None = None  # a split step's leaves besides the parameters (_train)

    def install(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.trainer, self.module = trainer, module
        self.saved = vars(module).get(self.name, ABSENT)
        self.target = getattr(module, self.name)
        self.logs.attach(module)
        how = micro_backward(trainer) if self.train else None
        if self.owner != (type(module), how):  # a new decorated step per module class: its own cache
            self.owner = (type(module), how)
            self.run, self.unsplit = self._decorated(f"{type(module).__qualname__}.{self.name}", how)
            self.trusting, self.unbacked, self.walks = True, True, None
        # A cache that knows a size (a DiskCache of an earlier run, say) knows better than the whole batch.
        self.trusting = self.trusting and not self.run.cache_info().currsize
        run = self._train if self.train else self._evaluate

        @functools.wraps(self.target)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return run(*args, **kwargs)

        vars(wrapper)[_MARK] = self  # tells it from a step the module object has of its own
        vars(module)[self.name] = wrapper
        leave_out(module, _own)  # a copy made meanwhile (the best model so far, say) runs its own steps

    def uninstall(self, module: pl.LightningModule) -> None:
        """Leave the module object as :meth:`install` found it, and keep nothing of it or of a step that ran."""
        if self.module is not module:
            return
        if _wrapper_of(vars(module).get(self.name)) is self:
            if self.saved is ABSENT:
                del vars(module)[self.name]
            else:
                vars(module)[self.name] = self.saved
            if not any(map(_wrapper_of, vars(module).values())):
                let_go(module)
        self._forget(module)
        self.module = self.trainer = None
        self.target, self.saved = _unset, ABSENT
        self.logs.detach()
        self.scale = self.whole = self.others = self.unsplit.stand_in = None
        self.given, self.rows, self.batch_idx = ((), {}), 0, None

    def installed(self) -> tuple[pl.Trainer, pl.LightningModule]:
        if self.trainer is None or self.module is None:
            raise RuntimeError(f"OOMRecovery: {self.name} is not installed on a module (setup was not called)")
        return self.trainer, self.module

    def _decorated(self, name: str, how: str | None) -> tuple[Batched[..., Any], Whole]:
        """Return the step as ``koila.accumulate`` runs it, named after the module's own, and as it runs whole."""
        if self.train:

            def part(*args: Any, **kwargs: Any) -> Any:
                self.logs.calls = []
                output = self.target(*args, **kwargs)
                self.logs.parts.append((self._rows_of(args, kwargs), self.logs.calls))
                if output is None:  # Lightning's "skip this batch"; accumulate needs a loss to go on
                    raise _Skipped
                loss = output.get("loss") if isinstance(output, Mapping) else output
                if self.others is not None and isinstance(loss, torch.Tensor):
                    self.others.see(loss)  # handed over with the parameters' gradients (_train)
                return output

        else:

            def part(*args: Any, **kwargs: Any) -> Any:
                self.logs.calls, self.whole = [], None
                output = self.target(*args, **kwargs)
                rows = self._rows_of(args, kwargs)
                self.logs.parts.append((rows, self.logs.calls))
                if rows == WHOLE or rows == self.rows:
                    # Returned as it is, strings and objects included, if it stays the last: nothing to join.
                    self.whole = output
                    return torch.zeros(())
                if output is None:  # the usual validation_step: nothing to join, and nothing to warn about
                    return torch.zeros(())
                return torch.zeros(()), output  # no loss: accumulate only splits and joins

        part.__qualname__ = part.__name__ = name
        options = dict(self.options)
        initial = options.pop("initial")
        # Every step's: a validation step that logs the same sum as the training step's loss adds it up too.
        reduction = options.pop("reduction")
        self.logs.summed = reduction == "sum"
        told = options.get("on_oom")

        def on_oom(event: OOMEvent) -> None:
            # What the failed attempt logged goes with it: with enable_graph=True, a value holds its graph.
            self.logs.drop()
            if told is not None:
                told(event)

        options["on_oom"] = on_oom
        # Under DDP the step runs inside DDP's forward, and the loop's backward after it, through DDP,
        # averages the gradients the step hands over (see _Delivery): the ranks only agree on sizes.
        decorate = accumulator(
            initial=initial,
            reduction=reduction,
            identity=class_identity(type(self.module), name),  # the module's step: not this wrapper, every module's
            backward={None: None, SCALED: self._scaled, PLUGIN: self._backward}[how],
            averages=False,
            replay=self._replayed,
            options=cast(Options, options),
        )
        advice = (
            "make the batch a dataclass, a tuple, list, dict or named tuple (nested as deep as needed) of tensors "
            "that share their rows along dim 0 (one entry per example), for instance in the data loader's collate_fn"
        )
        return decorate(part), Whole(part, name, decorate, "OOMRecovery", advice)

    def _replayed(self) -> tuple[str, str] | None:
        """Return, once, the message and place of the error with which the step that ran whole ran out of memory."""
        failure, self.failure = self.failure, None
        return failure

    def _scaled(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Run one micro-batch's backward of the loss scaled by AMP's gradient scaler."""
        scaler = self.installed()[0].precision_plugin.scaler  # type: ignore[attr-defined]
        made_again(scaler)  # half made by the loop's own backward, which ran out of memory
        if self.scale is None:
            self.scale = scaler.scale(torch.ones((), device=loss.device))
        scaler.scale(loss).backward(**kwargs)

    def _backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Run one micro-batch's backward through the trainer's precision plugin, which has a backward of its own."""
        trainer, module = self.installed()
        plugin = trainer.precision_plugin
        scaler = getattr(plugin, "scaler", None)
        if scaler is not None:
            made_again(scaler)
            if self.scale is None:
                self.scale = scaler.scale(torch.ones((), device=loss.device))
            loss = scaler.scale(loss)
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        plugin.backward(loss, module, optimizer, **kwargs)

    def _rows_of(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        """Return the rows of a micro-batch, as ``accumulate`` split them, or ``WHOLE`` for the batch as given."""
        if self.unsplit.held is not None:
            return WHOLE
        # The whole batch is the step's own arguments, not remade: no need to count its rows.
        given_args, given_kwargs = self.given
        if (  # compared in C, through map: a generator would be a call per step
            len(args) == len(given_args)
            and all(map(operator.is_, args, given_args))
            and kwargs.keys() == given_kwargs.keys()
            and all(map(operator.is_, map(kwargs.__getitem__, given_kwargs), given_kwargs.values()))
        ):
            return WHOLE
        if not self.rows:  # the whole batch's, counted once, for the logs of its micro-batches (see Logs.replay)
            self.rows = Split(*self.given, 0, "OOMRecovery").rows
        return Split(args, kwargs, 0, "OOMRecovery").rows

    def _call(self, module: pl.LightningModule, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run the step through ``accumulate``; a batch it cannot split, whole, as it runs without the callback."""
        # accumulate splits the batch before it calls the step: whether it could is asked only
        # when it raised before that, so that a batch it can split is looked at once, by accumulate.
        self.rows, self.given = 0, (args, kwargs)
        try:
            return self.run(*args, **kwargs)
        except (TypeError, ValueError):
            reason = unsplittable(args, kwargs, "OOMRecovery")
            if reason is None:  # splittable: the step's own error, or a batch of 0 rows, which accumulate refuses
                # Nothing to split: run whole, as without the callback, on one device; under DDP or FSDP2 the
                # other ranks' steps run through accumulate, and a rank running whole would not match them.
                if not _no_rows(args, kwargs) or not isinstance(module.trainer.strategy, SingleDeviceStrategy):
                    raise
                reason = ""
        finally:
            self.given = ((), {})
        self.rows = 1
        batch = args[0] if args else next(iter(kwargs.values()), None)
        return self.unsplit(module.device, batch, args, kwargs, reason)

    def _released(self, trainer: pl.Trainer, module: pl.LightningModule) -> set[int]:
        """Return the ids of the parameters whose ``.grad`` Lightning sets to ``None`` right after this step."""
        batch_idx, optimizers = self.batch_idx, trainer.optimizers
        if batch_idx is None or getattr(trainer.fit_loop, "_skip_backward", True) or len(optimizers) != 1:
            return set()
        if batch_idx % trainer.accumulate_grad_batches != 0:  # zero_grad runs on a group's first batch only
            return set()
        # Only the default zero_grad (set_to_none=True), and no on_before_zero_grad hook to look at the gradients.
        lightning = pl.LightningModule
        if "optimizer_zero_grad" in vars(module) or "on_before_zero_grad" in vars(module):
            return set()
        if type(module).optimizer_zero_grad is not lightning.optimizer_zero_grad:
            return set()
        if type(module).on_before_zero_grad is not lightning.on_before_zero_grad:
            return set()
        callbacks: list[Callback] = getattr(trainer, "callbacks", [])  # set by Lightning, not declared
        for callback in callbacks:
            if _looks_before_zero_grad(callback):
                return set()
        optimizer = optimizers[0]
        if "zero_grad" in vars(optimizer) or type(optimizer).zero_grad is not torch.optim.Optimizer.zero_grad:
            return set()
        return {id(parameter) for group in optimizer.param_groups for parameter in group["params"]}

    def _train(self, *args: Any, **kwargs: Any) -> Any:
        trainer, module = self.installed()
        self._forget(module)  # a step whose loss the loop did not backpropagate
        self.failure = None
        if getattr(trainer.fit_loop, "_skip_backward", False):  # no zero_grad, no backward (SWA's BatchNorm epoch)
            self.batch_idx = None
            return self._unbacked(trainer, module, args, kwargs)
        parameters = trainable(module)
        if isinstance(trainer.strategy, ModelParallelStrategy):  # the sharded ones, a gathered root's too
            parameters = as_sharded(module.modules(), parameters)
        # Those Lightning is about to set to None are released now, not set aside: the step
        # then runs as a hand loop does, with no earlier gradient alive (see _released).
        released = self._released(trainer, module)
        batch_idx, self.batch_idx = self.batch_idx, None
        zeroes = self._trusted(trainer, module, parameters, released, batch_idx)
        if zeroes is not None:
            output = self._whole(module, parameters, args, kwargs, zeroes, trainer.accumulate_grad_batches)
            if output is not _FAILED:
                return output
        aside = [None if id(parameter) in released else parameter.grad for parameter in parameters]
        self.logs.parts, self.scale = [], None
        # Other leaves, found in each micro-batch's graph, are handed over too: Lightning's backward divides them.
        self.others = OtherLeaves(lambda: {id(p) for p in parameters}) if self.walks is not False else None
        # The parameters' hooks run once, on the whole batch's gradients as Lightning's backward
        # accumulates them (see deliver), as without the callback: not in the step's micro-batches.
        hooks = suspended(parameters)
        ooms = self.run.stats.ooms
        try:
            for parameter in parameters:
                parameter.grad = None
            output, skipped = self._logged(module, args, kwargs)
            gradients = [parameter.grad for parameter in parameters]
            # An OOM here: the later steps run through accumulate from the size it found, not whole first.
            self.trusting = self.trusting and self.run.stats.ooms == ooms
        finally:
            restored(hooks)
            for parameter, gradient in zip(parameters, aside):
                parameter.grad = gradient
            others, self.others = self.others, None
            if others is not None and self.walks is None:
                self.walks = others.found()
            extra = ([], []) if others is None else others.taken()
        if skipped:
            self._skipped()
            return None
        self.logs.replay(self.rows)
        leaves: list[torch.Tensor] = []
        parts: list[torch.Tensor] = []
        for parameter, gradient in zip(parameters, gradients):
            if gradient is not None:
                leaves.append(parameter)
                parts.append(gradient)
        leaves += extra[0]
        parts += extra[1]
        scale, self.scale = self.scale, None
        unit = scale is None and trainer.accumulate_grad_batches == 1 and plain_backward(trainer, module)
        # On one device, where no parameter has a hook to run, the gradients need not go through the
        # engine's accumulation of each parameter (a node each): a leaf stands in for the loss, and its
        # hook writes them.
        direct = type(trainer.strategy) is SingleDeviceStrategy and not hooks
        # DDP's static graph counts, in its first iteration, the gradients accumulate delivered: the loop's
        # backward must not reach the parameters' nodes again, or DDP waits for two in every later step.
        counted = not direct and counts_gradients(trainer.strategy)

        def deliver(loss: torch.Tensor) -> torch.Tensor:
            held = _Held(parts, scale, unit)
            if direct or counted:
                stand_in = loss.detach().requires_grad_()
                hand_over = _hand_over if direct else _hand_over_uncounted
                stand_in.register_hook(functools.partial(hand_over, held, leaves))  # type: ignore[no-untyped-call]
                # A node for DDP's sink to reach: its backward queues the static graph's first all-reduce.
                return stand_in.view_as(stand_in) if counted else stand_in
            delivered: torch.Tensor = _Delivery.apply(held, loss, *leaves)  # type: ignore[no-untyped-call]
            return delivered

        if isinstance(output, torch.Tensor):
            return deliver(output)
        if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
            return {**output, "loss": deliver(output["loss"])}
        return output

    def _logged(self, module: pl.LightningModule, args: tuple[Any, ...], kwargs: Any) -> tuple[Any, bool]:
        """Run the step through accumulate, its logs held; return its output and whether it returned None."""
        self.logs.hold(module)
        try:
            return self._call(module, args, kwargs), False
        except _Skipped:
            return None, True
        finally:
            self.logs.release(module)

    def _skipped(self) -> None:
        """Log what a step that returned None logged, as Lightning would."""
        # Skipped as Lightning skips it, with no gradient of it. Ran whole, it logs as it called,
        # as without the callback; split, the batch has no whole value to log.
        ran = self.logs.parts
        ran_whole = bool(ran) and ran[-1][0] in (WHOLE, self.rows)
        self.logs.parts = ran[-1:] if ran_whole else []
        self.logs.replay(self.rows)

    def _unbacked(self, trainer: pl.Trainer, module: pl.LightningModule, args: tuple[Any, ...], kwargs: Any) -> Any:
        """Run a step whose backward the loop skips: whole, else in micro-batches under ``no_grad``."""
        # With no backward of koila's either: .grad untouched, and the plain step's peak where it fits.
        # Whole, BatchNorm's running statistics are the batch's, as without the callback.
        if self.unbacked and self.options.get("initial") is None and type(trainer.strategy) is SingleDeviceStrategy:
            output = self._ran(module, args, kwargs)
            if output is not _FAILED:
                return output
            self.unbacked = False  # tried once: each later step of that epoch would fail as well
        self.logs.parts = []
        with torch.no_grad():  # no graph to keep: accumulate runs no backward
            output, skipped = self._logged(module, args, kwargs)
        if skipped:
            self._skipped()
            return None
        self.logs.replay(self.rows)
        return output

    def _trusted(
        self,
        trainer: pl.Trainer,
        module: pl.LightningModule,
        parameters: list[torch.nn.Parameter],
        released: set[int],
        batch_idx: int | None,
    ) -> bool | None:
        """Return whether Lightning zeroes the gradients after a step that may run whole; None if it may not."""
        # The loop's backward must be a plain one of the loss on one device, into gradients that
        # no hook watches, and that are released (where Lightning zeroes them after the step) or
        # can be set aside: a failure there can then be undone, and the step run again in
        # micro-batches in its place.
        if not (
            self.trusting
            and self.options.get("initial") is None
            and type(trainer.strategy) is SingleDeviceStrategy
            and self.owner is not None
            and self.owner[1] is None
            and batch_idx is not None
            and not getattr(trainer.fit_loop, "_skip_backward", True)  # the loop's backward comes
            and len(trainer.optimizers) == 1
            and bool(parameters)
            and not watched(parameters)
            and plain_backward(trainer, module)
        ):
            return None
        if batch_idx % trainer.accumulate_grad_batches == 0 and all(id(p) in released for p in parameters):
            return True  # the first of a window: zeroed after the step
        # Else set aside while the step runs, and read again before its backward: what a zero_grad of the
        # module's own (set_to_none=True) let go of is not kept (probe 75D: 1.34x the trainer's peak).
        for parameter in parameters:
            gradient = parameter.grad
            if gradient is not None and gradient.layout != torch.strided:
                return None
        return False

    def _whole(
        self,
        module: pl.LightningModule,
        parameters: list[torch.nn.Parameter],
        args: tuple[Any, ...],
        kwargs: Any,
        zeroes: bool,
        steps: int,
    ) -> Any:
        """Run the step whole, as without the callback, its loss's backward left to the loop; ``_FAILED`` on an OOM."""
        # Released where Lightning sets them to None after this step (see _released); else set aside, so
        # that a step that writes .grad itself and then fails leaves them as they were.
        before = [] if zeroes else [parameter.grad for parameter in parameters]
        for parameter in parameters:
            parameter.grad = None
        output: Any = _FAILED
        kept = Contents(args, kwargs)  # put back for a retry after the backward's OOM too
        try:
            output = self._ran(module, args, kwargs, kept)
        finally:
            if output is _FAILED:  # out of memory, an error of the step's own, or one replaying its logs
                set_grads(zip(parameters, before, strict=False))
        if output is _FAILED:
            return _FAILED
        loss = output.get("loss") if isinstance(output, Mapping) else output
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            if before:
                added_back(parameters, before)
            return output  # skipped (None), or nothing to backpropagate: as without the callback
        # Back in .grad until the loop's backward, for the zero and on_before_backward to see as without the
        # callback, with what the step wrote itself added in (probe 75I: added back after the zero cleared only
        # the step's); _backward_of_whole sets them aside again.
        if before:
            added_back(parameters, before)
        # The loop backpropagates a leaf of the same value; the module's backward the loss (_backward_of_whole).
        self.pending = (loss, args, kwargs, parameters, before, steps, kept)
        vars(module)["backward"] = self._backward_of_whole
        stand_in = loss.detach().requires_grad_()
        # Its other entries detached, as a split step's are: they would hold the graph through that backward.
        return stand_in if isinstance(output, torch.Tensor) else without_graphs(output, stand_in)

    def _ran(self, module: pl.LightningModule, args: tuple[Any, ...], kwargs: Any, kept: Contents | None = None) -> Any:
        """Run the step as the loop would, its logs held until it returned; ``_FAILED`` if it ran out of memory."""
        kept = Contents(args, kwargs) if kept is None else kept  # a batch.pop("labels") is put back for the retry
        self.logs.calls = []
        self.logs.hold(module)
        failed = False
        try:
            output = self.target(*args, **kwargs)
        except BaseException as error:
            if not is_oom(error):
                raise
            # Handled outside the except block, once the attempt's frames are gone; its message and place kept.
            # Cleared: a step that keeps its error would keep the attempt's locals through the retry.
            failed, self.failure = True, replayable(error)
            clear_frames(error)
        finally:
            self.logs.release(module)
        if failed:
            kept.restore()
            self.trusting, self.logs.calls = False, []  # accumulate runs this step from now on, this call first
            return _FAILED
        self.logs.flush()
        return output

    def _backward_of_whole(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Run the backward of the step that ran whole; if it runs out of memory, the step again in micro-batches."""
        trainer, module = self.installed()
        pending, self.pending = self.pending, None
        vars(module).pop("backward", None)
        if pending is None:
            module.backward(tensor, *args, **kwargs)
            return
        loss, batch_args, batch_kwargs, parameters, before, steps, kept = pending
        del pending
        # Aside again, as the hooks left them (one may have scaled or replaced them).
        for index, parameter in enumerate(parameters):
            if index < len(before) and before[index] is not None:
                before[index], parameter.grad = parameter.grad, None
        # Other leaves (a tensor of the module's own) are set aside: in every step if the first step's walk found any.
        others = OtherLeaves(lambda: {id(parameter) for parameter in parameters})
        if self.walks is not False:
            others.see(loss)
            if self.walks is None:
                self.walks = others.found()
        failed = False
        try:
            # Lightning's backward, of the loss divided by accumulate_grad_batches (_trusted: nothing scales it).
            type(module).backward(module, loss / steps if steps != 1 else loss, *args, **kwargs)
        except BaseException as error:
            if not is_oom(error):  # the gradients as the step found them, not part of a backward
                set_grads(zip(parameters, before or [None] * len(parameters), strict=True))
                others.give_back()
                raise
            failed, self.failure = True, replayable(error)
            clear_frames(error)
        if not failed:
            others.restore()
            if before:
                added_back(parameters, before)
            return
        del loss  # the graph, and what its nodes not yet run hold
        others.undo()  # what they had before stays aside: accumulate's gradients are divided first
        set_grads((parameter, None) for parameter in parameters)  # None before this backward (see _whole)
        self.trusting = False
        kept.restore()
        # Through accumulate, whose attempt of the whole batch is the failure above: its gradients
        # reach .grad directly. What the step logs is dropped: the whole batch's were logged already.
        self.logs.parts, self.rows = [], 0
        self.logs.hold(module)
        try:
            with trainer.precision_plugin.train_step_context():  # autocast, as for the step itself
                self._call(module, batch_args, batch_kwargs)
        except _Skipped:
            pass  # a micro-batch returned None: the batch is skipped, with no gradient, as the step asked
        except BaseException:
            set_grads(zip(parameters, before, strict=False))  # as the step found them
            others.give_back()
            raise
        finally:
            self.logs.release(module)
            self.logs.drop()
        if steps != 1:  # accumulate's are the undivided loss's
            divided = [parameter.grad for parameter in parameters if parameter.grad is not None]
            divided += others.written()
            with torch.no_grad():
                torch._foreach_div_(divided, steps)
        if before:
            added_back(parameters, before)
        others.restore()

    def _forget(self, module: pl.LightningModule) -> None:
        """Drop the loss of a step that ran whole and whose backward did not come (its gradients are in .grad)."""
        if self.pending is not None:
            self.pending = None
            vars(module).pop("backward", None)

    def _evaluate(self, *args: Any, **kwargs: Any) -> Any:
        trainer, module = self.installed()
        self.failure = None
        # On one device, nothing to undo: an evaluation step writes no gradient. Under DDP the ranks
        # agree on every size, so every rank runs through accumulate.
        if self.trusting and self.options.get("initial") is None and type(trainer.strategy) is SingleDeviceStrategy:
            output = self._ran(module, args, kwargs)
            if output is not _FAILED:
                return output
        self.logs.parts = []
        self.logs.hold(module)
        try:
            result = self._call(module, args, kwargs)
            output = result[1] if isinstance(result, tuple) else None
            if self.whole is not None:  # it ran whole: the step's own output, not a copy joined by accumulate
                output = self.whole
        finally:
            self.logs.release(module)
            self.whole = None
        self.logs.replay(self.rows)
        return output


# Where a wrapper of ours keeps its _Step, which tells it from a step of the module object's own.
_MARK = "_koila_step"
# What _Step._ran and _Step._whole return for a step that ran out of memory (a step may return None).
_FAILED = object()


def _no_rows(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Return whether a batch has no rows, as ``accumulate`` counts them (it refuses such a batch)."""
    # The usual batch, tensors in tuples, lists and dicts, told by its first tensor with a row count
    # that decides (not one row, which broadcasts); any other, by a Split, which costs more.
    stack: list[Any] = [args]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            if value.dim() and value.shape[0] != 1:
                return value.shape[0] == 0
        elif type(value) in (tuple, list):
            stack.extend(reversed(value))
        elif type(value) is dict:
            stack.extend(reversed(value.values()))
        elif value is not None and not isinstance(value, (int, float, str)):
            try:
                return Split(args, kwargs, 0, "OOMRecovery").rows == 0
            except (TypeError, ValueError):
                return False  # cannot be split: runs whole, as accumulate would run it
    return bool(kwargs) and _no_rows(tuple(kwargs.values()), {})


class _Skipped(Exception):
    """A training step (or one of its micro-batches) returned ``None``: the batch is skipped, whole."""


def _looks_before_zero_grad(callback: Callback) -> bool:
    """Return whether Lightning calls an ``on_before_zero_grad`` of ``callback`` that does something."""
    # Its own or its class's (a LambdaCallback sets its hooks on the instance); one that is not
    # callable, Lightning skips (see OOMRecovery.__init__).
    hook = getattr(callback, "on_before_zero_grad", None)
    return callable(hook) and getattr(hook, "__func__", None) is not Callback.on_before_zero_grad


def _unset(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("OOMRecovery: the step is not installed on a module")


def _own(value: Any) -> Any:
    """Return what the module object holds in place of ``value`` without the callback (``ABSENT``: nothing)."""
    step = _wrapper_of(value)
    if step is not None:
        return step.saved
    holder = getattr(value, "__self__", None)  # a bound method: self.log held back, the whole step's backward
    return holder.saved if isinstance(holder, Logs) else ABSENT if isinstance(holder, _Step) else value


def _wrapper_of(step: Any) -> _Step | None:
    """Return the ``_Step`` whose wrapper ``step`` is, or None for a step that is not one of ours."""
    owner = getattr(step, "__dict__", {}).get(_MARK) if callable(step) else None
    return owner if isinstance(owner, _Step) else None
