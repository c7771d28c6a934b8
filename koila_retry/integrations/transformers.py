"""Adapt a constructed Hugging Face ``transformers.Trainer`` to the memory it has: ``adapt``.

Hugging Face's callbacks cannot change a step, so :func:`adapt` replaces the
trainer instance's ``training_step`` and ``prediction_step`` with wrappers that
run the original through :func:`koila_retry.accumulate`: the whole batch first,
and, after an out-of-memory error, micro-batches of the same batch. A split
micro-batch is to the batch what a batch is to an accumulation window in the
trainer's own gradient accumulation: with ``num_items_in_batch``, each
micro-batch's summed loss is divided by the whole window's count, and the
micro-batches are added up; without it, each micro-batch's mean loss is weighed
by its share of the items Hugging Face counts (labels that are not -100, shifted
for causal language models), or of the rows when there are no labels.

``transformers`` is imported when :func:`adapt` is called, never before.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from koila_retry._core.policy import Options, Policy
from koila_retry._frontends.accumulate import accumulate

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["adapt"]

T = TypeVar("T")

NAME = "koila_retry.integrations.transformers.adapt"
# Set on an adapted trainer: its original steps, so that adapting twice is refused.
MARK = "koila_adapted_steps"
IGNORED = -100
# Accelerate's distributed types that wrap the model in DistributedDataParallel: the ones adapt serves.
DDP_TYPES = frozenset(
    f"MULTI_{device}" for device in ("CPU", "GPU", "NPU", "XPU", "MLU", "MUSA", "SDAA", "HPU", "NEURON")
)
_OPTIONS = frozenset(Options.__annotations__)


def adapt(trainer: T, **options: Unpack[Options]) -> T:
    """Make a Hugging Face ``Trainer`` run a step that does not fit as micro-batches of the same batch.

    Training: each call of the trainer's ``training_step`` runs the original
    once, on the whole batch, with its backward (``self.accelerator.backward``)
    run by :func:`koila_retry.accumulate`. When that runs out of memory, the
    memory is released and the step runs again over micro-batches of the batch
    (powers of two rows), each with its own forward and backward, normalised as
    the trainer normalises the whole batch: with ``num_items_in_batch`` (a model
    that takes loss keywords, or ``compute_loss_func``), each micro-batch's loss
    is its summed loss over the whole batch's count, and they are added up;
    otherwise each micro-batch's mean loss is weighed by its share of the labels
    that are not -100 (shifted by one for a causal language model), or of the
    rows without labels. The gradient the optimizer sees, the loss the trainer
    logs, ``per_device_train_batch_size``, ``gradient_accumulation_steps``,
    ``global_step`` and the learning-rate schedule are those of the whole batch,
    to floating-point rounding. Gradient clipping, mixed precision and the
    trainer's gradient accumulation run as before, on the full gradient. A step
    that fails leaves ``.grad`` as it was. Later steps start at the size that
    worked (kept per size class of the batch, as :func:`~koila_retry.accumulate`
    keeps it).

    Evaluation and prediction: a ``prediction_step`` that runs out of memory runs
    again in chunks of its rows, without gradients, and returns the whole batch's
    loss (the chunks' losses weighed by their items, as above), logits and labels.

    DDP (several processes, ``torchrun``): the ranks agree on every micro-batch
    size, as :func:`~koila_retry.accumulate` makes them agree, so a rank that
    runs out of memory makes every rank run the same step again in micro-batches
    (or give up with it) instead of leaving them waiting in an all-reduce. Each
    micro-batch runs under DDP's ``no_sync()``, and the step's gradients are
    averaged across the ranks once, after they agreed that it succeeded: the
    averaged gradient is the one DDP gives, but it is no longer all-reduced while
    the backward runs. The batch's item count, which ``prediction_step`` gathers
    from every rank, is gathered once per step, before any attempt.

    Args:
        trainer (transformers.Trainer): a constructed ``Trainer``, or an instance
            of any subclass, on one device per process: one process, or several
            under DistributedDataParallel. A subclass's own
            ``training_step`` must run its backward through
            ``self.accelerator.backward``, once per call (as ``Trainer``'s does, and
            any override that calls ``super().training_step``).
        **options (Options): the shared options, the sizes being those of
            micro-batches (see :ref:`options`); checked now. ``initial`` is not one:
            each step tries its whole batch first.

    Returns:
        transformers.Trainer: ``trainer`` itself, adapted. Its ``training_step``
        and ``prediction_step`` have ``stats`` (:class:`koila_retry.Stats`).

    Raises:
        ImportError: if ``transformers`` is not installed.
        TypeError: if ``trainer`` is not a ``transformers.Trainer``, or an option is
            unknown or has the wrong type.
        ValueError: if an option is out of range, or the trainer is adapted already.
        NotImplementedError: if the trainer runs under DeepSpeed, FSDP, XLA or
            Megatron-LM, over several GPUs of one process (``DataParallel``), with
            tensor, context or sequence parallelism, SageMaker model parallelism
            or a LOMO optimizer, or its
            ``training_step`` runs no ``self.accelerator.backward``: each of those
            runs a step in a way that micro-batches would change. A step of an
            override that turns out to run a backward of its own, or none, raises
            ``RuntimeError`` when it is first run, before an optimizer step.

    Example::

        from transformers import Trainer
        from koila_retry.integrations.transformers import adapt

        trainer = adapt(Trainer(model=model, args=args, train_dataset=train))
        trainer.train()

    .. versionadded:: 0.2.0
    """
    transformers = _transformers()
    if not isinstance(trainer, transformers.Trainer):
        raise TypeError(
            f"{NAME}() takes a transformers.Trainer (or an instance of a subclass), got {type(trainer).__name__}"
        )
    if MARK in vars(trainer):
        raise ValueError(f"{NAME}() was given a trainer it adapted already: adapt each trainer once")
    unknown = sorted(set(options) - _OPTIONS)
    if unknown:
        why = "; each step tries its whole batch first" if unknown[0] == "initial" else ""
        raise TypeError(
            f"{NAME}() got an unexpected keyword argument {unknown[0]!r}{why}; its options are "
            f"{', '.join(sorted(_OPTIONS))}"
        )
    Policy.of(NAME, None, options, rows=True)
    _refuse_unservable(trainer, transformers)
    training = _Training(trainer, type(trainer).training_step is not transformers.Trainer.training_step, options)
    prediction = _Prediction(trainer, options)
    original_training, original_prediction = trainer.training_step, trainer.prediction_step
    training_step = functools.wraps(original_training)(training)
    prediction_step = functools.wraps(original_prediction)(prediction)
    vars(trainer)[MARK] = (original_training, original_prediction)
    trainer.training_step = training_step
    trainer.prediction_step = prediction_step
    return trainer


def _transformers() -> ModuleType:
    try:
        return importlib.import_module("transformers")
    except ImportError as error:
        raise ImportError(f"{NAME}() needs transformers: pip install 'koila-retry[transformers]' ({error})") from error


def _refuse_unservable(trainer: Any, transformers: ModuleType) -> None:
    """Raise ``NotImplementedError`` naming why, for a trainer whose steps micro-batches would change."""
    args = trainer.args
    reasons = []
    if getattr(trainer, "is_deepspeed_enabled", False):
        reasons.append(
            "it runs under DeepSpeed, whose engine runs the backward and the gradient accumulation itself "
            "(and partitions the gradients with ZeRO)"
        )
    if getattr(trainer, "is_fsdp_enabled", False):
        reasons.append("it runs under FSDP, whose gradients are sharded and reduced in each backward")
    distributed = str(getattr(trainer.accelerator, "distributed_type", "NO")).split(".")[-1]
    if distributed not in ("NO", *DDP_TYPES):
        reasons.append(
            f"it runs distributed as {distributed}, which communicates inside each forward or backward; adapt "
            "serves one process, or several under DistributedDataParallel"
        )
    if getattr(args, "n_gpu", 1) > 1:
        reasons.append(f"it runs DataParallel over {args.n_gpu} GPUs; make one visible (CUDA_VISIBLE_DEVICES)")
    for size in ("get_tp_size", "get_cp_size", "get_sp_size"):
        method = getattr(trainer, size, None)
        if callable(method) and method() > 1:
            reasons.append(f"it runs {size[4:6]}-parallel over {method()} devices, which share each batch")
    sagemaker = getattr(getattr(transformers, "trainer", None), "is_sagemaker_mp_enabled", None)
    if callable(sagemaker) and sagemaker():
        reasons.append("it runs SageMaker model parallelism, whose forward and backward are one call")
    optim = str(getattr(args, "optim", "")).lower()
    if "lomo" in optim:
        reasons.append(f"its optimizer ({args.optim}) updates the parameters inside each backward")
    if reasons:
        raise NotImplementedError(f"{NAME}() cannot serve {type(trainer).__name__}: " + "; ".join(reasons))
    step = inspect.unwrap(type(trainer).training_step)
    code = getattr(step, "__code__", None)
    if step is not transformers.Trainer.training_step and code is not None:
        names = _names(code)
        if "accelerator" not in names and "training_step" not in names:
            raise NotImplementedError(
                f"{NAME}() cannot serve {type(trainer).__name__}: its training_step neither calls "
                "self.accelerator.backward nor super().training_step, so it runs its backward some other way, "
                "which adapt cannot split into micro-batches (it runs each micro-batch's backward through "
                "self.accelerator.backward)"
            )


def _names(code: Any) -> set[str]:
    """The global and attribute names a function's code uses, its nested functions' included."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if hasattr(constant, "co_names"):
            names |= _names(constant)
    return names


def _shifts_labels(trainer: Any) -> bool:
    """Whether the trainer's model shifts its labels (a causal language model): its first label predicts nothing.

    The trainer's own answer, or, where its config names no loss type, the loss
    function the model uses.
    """
    if getattr(trainer, "_loss_shifts_labels", False):
        return True
    model = trainer.model
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        return False
    try:
        causal = importlib.import_module("transformers.loss.loss_utils").ForCausalLMLoss
    except (ImportError, AttributeError):  # pragma: no cover - older transformers
        return False
    return getattr(model, "loss_function", None) is causal


def _labels_counted(trainer: Any, inputs: Any, shifts: bool) -> torch.Tensor | None:
    """The labels whose entries that are not -100 Hugging Face counts as items of a loss, or ``None``."""
    if not isinstance(inputs, Mapping):
        return None
    labels = inputs.get("shift_labels")
    if labels is None:
        labels = inputs.get("labels")
        if isinstance(labels, torch.Tensor) and shifts:
            labels = labels[..., 1:]
    return labels if isinstance(labels, torch.Tensor) else None


def _items(trainer: Any, shifts: bool) -> Callable[..., Any]:
    """Return ``weight=`` for a step: the items a micro-batch's mean loss averages over, as Hugging Face counts them.

    Counted on this rank only, without a collective: ranks may split their batches
    into different micro-batches.

    Args:
        trainer (transformers.Trainer): the trainer.
        shifts (bool): whether the model shifts its labels (see :func:`_shifts_labels`).
    """

    def items(model: Any, inputs: Any, *rest: Any) -> Any:
        labels = _labels_counted(trainer, inputs, shifts)
        if labels is None:  # checked before the weighted step is chosen
            raise RuntimeError("the batch lost its labels")
        return labels.ne(IGNORED).sum()

    return items


class _Training:
    """An adapted trainer's ``training_step``: the original, run by ``accumulate``, whole or in micro-batches."""

    def __init__(self, trainer: Any, overridden: bool, options: Options) -> None:
        self.trainer, self.overridden = trainer, overridden
        self.original: Callable[..., Any] = trainer.training_step
        self.shifts = _shifts_labels(trainer)

        def backward(loss: torch.Tensor, **kwargs: Any) -> None:
            trainer.accelerator.backward(loss, **kwargs)

        def training_step(model: Any, inputs: Any, num_items_in_batch: Any) -> tuple[torch.Tensor, Any]:
            return self.run(model, inputs, num_items_in_batch)

        training_step.__qualname__ = f"{type(trainer).__name__}.training_step"  # as errors and logs name it
        # With num_items_in_batch, each micro-batch's loss is its share already: they add up.
        self.summed = accumulate(reduction="sum", backward=backward, **options)(training_step)
        self.weighted = accumulate(weight=_items(trainer, self.shifts), backward=backward, **options)(training_step)
        self.by_rows = accumulate(backward=backward, **options)(training_step)
        self.stats = self.summed.stats

    def __call__(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        trainer = self.trainer
        scaled = trainer.loss_is_scaled_for_ga
        if scaled is None:
            scaled = (
                trainer.model_accepts_loss_kwargs and num_items_in_batch is not None
            ) or trainer.compute_loss_func is not None
        step = _chosen(self, scaled and num_items_in_batch is not None, inputs)
        return step(model, inputs, num_items_in_batch)[1]

    def run(self, model: Any, inputs: Any, num_items_in_batch: Any) -> tuple[torch.Tensor, Any]:
        """Run the original step on (part of) the batch with its backward held back; return the loss and its result."""
        accelerator = self.trainer.accelerator
        held: list[torch.Tensor] = []

        def hold(loss: torch.Tensor, **kwargs: Any) -> None:
            if kwargs:
                raise NotImplementedError(
                    f"{NAME}: the trainer's training_step called accelerator.backward with {sorted(kwargs)}, "
                    "which adapt cannot pass on per micro-batch"
                )
            held.append(loss)

        before = _gradients(model) if self.overridden else None
        with _swapped(accelerator, "backward", hold):
            returned = self.original(model, inputs, num_items_in_batch)
        if before is not None and _gradients(model) != before:
            raise RuntimeError(
                f"{NAME}: the training_step of {type(self.trainer).__name__} wrote .grad itself (a backward "
                "outside self.accelerator.backward): adapt cannot split such a step, and the gradients of this "
                "one are not the batch's. Run the backward through self.accelerator.backward"
            )
        if len(held) != 1:
            raise RuntimeError(
                f"{NAME}: the training_step of {type(self.trainer).__name__} called self.accelerator.backward "
                f"{len(held)} times; adapt serves a step that calls it once"
            )
        loss = held.pop()
        if not isinstance(returned, torch.Tensor) or returned.numel() != 1:
            returned = loss.detach()
        return loss, returned


def _chosen(steps: _Training | _Prediction, summed: bool, inputs: Any) -> Any:
    """Choose the decorated step that normalises this batch as Hugging Face does, and keep its ``stats``.

    ``summed`` when each call's loss is a summed loss over the whole batch's
    count; else one weighed by the labels Hugging Face counts, or by rows.
    """
    if summed:
        step = steps.summed
    elif _labels_counted(steps.trainer, inputs, steps.shifts) is not None:
        step = steps.weighted
    else:
        step = steps.by_rows
    steps.stats = step.stats
    return step


@contextlib.contextmanager
def _swapped(owner: Any, name: str, value: Any) -> Iterator[None]:
    """Put ``value`` on the object ``owner`` as ``name`` for the block, then what was there (not thread-safe)."""
    attributes = vars(owner)
    own, saved = name in attributes, attributes.get(name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if own:
            setattr(owner, name, saved)
        else:
            delattr(owner, name)


def _gradients(model: Any) -> list[tuple[int, int]]:
    """Each parameter's gradient, as its identity and version: what tells that a backward wrote it."""
    return [(id(p.grad), p.grad._version) if p.grad is not None else (0, 0) for p in model.parameters()]


class _Prediction:
    """An adapted trainer's ``prediction_step``: the original, run by ``accumulate`` without gradients.

    Hugging Face's ``prediction_step`` counts the batch's items itself, and under
    DDP gathers that count from every rank: a collective inside the step, which a
    rank that split its batch would make once per micro-batch, and one that ran
    out of memory might never make. So the count is taken once per step, before
    any attempt, with the trainer's own ``_get_num_items_in_batch``, and every
    call of the original inside the step is given that count: each micro-batch's
    loss is then its summed loss over the whole batch's count, and they add up.
    """

    def __init__(self, trainer: Any, options: Options) -> None:
        self.trainer = trainer
        self.original: Callable[..., Any] = trainer.prediction_step
        self.shifts = _shifts_labels(trainer)
        self.count: Callable[..., Any] | None = getattr(trainer, "_get_num_items_in_batch", None)
        self.lossless = False

        def prediction_step(model: Any, inputs: Any, prediction_loss_only: bool, ignore_keys: Any) -> dict[str, Any]:
            loss, logits, labels = self.original(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
            if loss is None:  # accumulate needs a loss to weigh; this one stands for none
                self.lossless = True
                loss = torch.zeros((), device=trainer.args.device)
            # Only what there is: a None would be warned about as an object accumulate cannot combine.
            found = {"loss": loss, "logits": logits, "labels": labels}
            return {key: value for key, value in found.items() if value is not None}

        prediction_step.__qualname__ = f"{type(trainer).__name__}.prediction_step"
        self.summed = accumulate(reduction="sum", **options)(prediction_step)
        self.weighted = accumulate(weight=_items(trainer, self.shifts), **options)(prediction_step)
        self.by_rows = accumulate(**options)(prediction_step)
        self.stats = self.weighted.stats

    def __call__(
        self, model: Any, inputs: Any, prediction_loss_only: bool, ignore_keys: Any = None
    ) -> tuple[Any, Any, Any]:
        trainer = self.trainer
        counted = None if self.count is None else self.count([inputs], trainer.args.device)
        step = _chosen(self, counted is not None, inputs)
        self.lossless = False
        swap = (
            _swapped(trainer, "_get_num_items_in_batch", lambda batches, device: counted)
            if self.count is not None
            else contextlib.nullcontext()
        )
        with swap, torch.no_grad():
            found = step(model, inputs, prediction_loss_only, ignore_keys)
        loss = None if self.lossless else found["loss"]
        return loss, found.get("logits"), found.get("labels")
