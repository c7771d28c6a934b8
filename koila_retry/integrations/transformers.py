"""Hugging Face: ``adapt``, which runs a ``Trainer``'s step that does not fit as micro-batches.

Hugging Face's callbacks cannot change a step, so ``adapt`` replaces the instance's ``training_step``
and ``prediction_step``: the originals as the trainer runs them while that can be undone, and through
``accumulate`` from the first out-of-memory error on. The one fact to know: every Hugging Face loss
is linear in the loss the step backs through (the division by the accumulation steps, loss scaling),
so weighing each micro-batch by its share of the batch's items serves every ``Trainer.training_step``
(docs/huggingface.rst, "Custom losses under adapt"). ``transformers`` is imported by ``adapt``.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib
import inspect
import sys
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType
from typing import Any, NoReturn, TypeVar, cast

import torch
from torch.utils._pytree import tree_unflatten

from koila_retry._common.batches import shallow_copy
from koila_retry._common.places import levels_to_caller, replayable
from koila_retry._common.results import flatten
from koila_retry._common.tensors import set_grads
from koila_retry._common.warn import warn_or_log
from koila_retry._core import distributed
from koila_retry._core.cache import class_identity, innermost
from koila_retry._core.detect import is_oom
from koila_retry._core.outcomes import clear_frames
from koila_retry._core.policy import Options, Policy
from koila_retry._core.stats import Stats
from koila_retry._frontends import own_backward
from koila_retry._frontends.accumulate import accumulator
from koila_retry._frontends.other_leaves import OtherLeaves, added_back
from koila_retry._frontends.whole import Whole, unsplittable
from koila_retry.integrations._transformers_joins import (
    LABELS,
    LOGITS,
    Aside,
    batch_rows,
    generated_pad,
    generation_state,
    how_joined,
    not_per_row,
    one_per_row,
    put_back,
    several_per_row,
)
from koila_retry.integrations._transformers_losses import IGNORED, ROWS, SUM, Inexact, shifts_labels, weighing_of
from koila_retry.integrations._transformers_packed import apart, joined

# At run time too: typing.get_type_hints() reads the options' annotations.
if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # the backport torch depends on
    from typing_extensions import Unpack

__all__ = ["adapt"]

T = TypeVar("T")

NAME = "koila_retry.integrations.transformers.adapt"
# What a step whose batch cannot be split says to change (a batch stays a mapping: the model takes **inputs).
_ADVICE = "make the tensors of the batch share their rows along dim 0 (one entry per example), in the data collator"
# Set on an adapted trainer: its original steps, so that adapting twice is refused.
MARK = "koila_adapted_steps"
# Stands for an argument the caller did not pass.
ABSENT: Any = object()
# Accelerate's distributed types that wrap the model in DistributedDataParallel: the ones adapt serves.
DDP_TYPES = frozenset(
    f"MULTI_{device}" for device in ("CPU", "GPU", "NPU", "XPU", "MLU", "MUSA", "SDAA", "HPU", "NEURON")
)
_OPTIONS = frozenset(Options.__annotations__)


def adapt(trainer: T, **options: Unpack[Options]) -> T:
    """Make a Hugging Face ``Trainer`` run a step that does not fit as micro-batches of the same batch.

    Training: a step that fits runs as the trainer runs it, its
    ``self.accelerator.backward`` included, where a failure can be undone (one
    process, a batch of keyword tensors, no hook on a parameter); elsewhere,
    under DDP or FSDP2 say, it runs through :func:`koila_retry.accumulate`.
    When it runs out of memory, the gradients it began with are put back, the
    memory is released and the step runs again through ``accumulate`` over
    micro-batches of the batch (powers of two rows), each with its own forward
    and backward, as every later step of the trainer does. Each
    micro-batch's loss is weighed by its share of the batch's labels that are
    not -100 (shifted by one for a causal language model, a module that wraps
    one, or a module whose ``loss_type`` is ``"ForCausalLM"``; a module that holds
    no Hugging Face model and names no loss is warned of), or of its rows without
    labels, and its ``num_items_in_batch`` is the
    whole count times that share: a loss that is a mean over its labels (the
    model's own, or a custom ``compute_loss`` or ``compute_loss_func`` that
    ignores the count) and one that divides its sum by ``num_items_in_batch``
    both add up to the whole batch's. Where the model's loss type says its own
    loss averages otherwise, its micro-batches are weighed as it does: a CTC
    loss's by their rows (``ctc_loss_reduction="mean"``) or 1 each (``"sum"``),
    a semantic segmentation loss's by their labels other than its ignore index
    (docs/huggingface.rst). A split step whose loss no weight adds up (label
    fields besides ``labels`` whose items differ, as a pre-training head's; a
    detector's; an MoE router loss) is warned of once. The gradient the
    optimizer sees, the loss the trainer logs, ``per_device_train_batch_size``,
    ``gradient_accumulation_steps``, ``global_step`` and the learning-rate
    schedule are those of the whole batch, to floating-point rounding. Gradient
    clipping, mixed precision and the trainer's gradient accumulation run as
    before, on the full gradient. A step that fails leaves ``.grad`` as it was. Later steps start at the size that
    worked (kept per size class of the batch, as :func:`~koila_retry.accumulate`
    keeps it).

    Evaluation and prediction: a ``prediction_step`` that runs out of memory runs
    again in chunks of its rows, without gradients, and returns the whole batch's
    loss (the chunks' losses weighed by their items, as above), logits and labels.
    Labels, and logits of integers that are not one entry per row, are concatenated
    along dim 0 as the trainer joins its batches; chunks whose tensors differ in
    width are padded as it pads them: with -100, or generate's pad token for
    generated tokens (docs/trainers.rst).

    A custom loss that is a mean over something else than those labels (a mean
    over rows of labels with -100 entries, say) is weighed wrongly when a step
    is split; ``Trainer`` scales such a loss the same way in its own gradient
    accumulation. So is a sum that is not divided by ``num_items_in_batch``.

    Any ``transformers`` from 4.40 on: a ``Trainer`` older than 4.46 passes no
    ``num_items_in_batch`` to its ``training_step``, and none is passed on.

    DDP (several processes, ``torchrun``): the ranks agree on every micro-batch
    size, as :func:`~koila_retry.accumulate` makes them agree, so a rank that
    runs out of memory makes every rank run the same step again in micro-batches
    (or give up with it) instead of leaving them waiting in an all-reduce. Every
    micro-batch but the last runs under DDP's ``no_sync()``; the last one's
    backward all-reduces as DDP does it, and a rank that fails plays along the
    all-reduces it did not make (docs/distributed.rst, "DDP: the overlap,
    kept"). The batch's item count, which ``prediction_step`` gathers
    from every rank, is gathered once per step, before any attempt.

    FSDP2 (accelerate's FSDP plugin, ``fsdp_config={"version": 2, ...}``, which
    shards the model with ``fully_shard``): each ``training_step`` runs through
    :func:`~koila_retry.accumulate` over the sharded model, as any step over
    FSDP2 modules runs (docs/distributed.rst, "Training with FSDP2"): a rank
    that runs out of memory plays along the others' collectives, and every rank
    runs the step again in the same micro-batches. Gradient sync is off for all
    but the last micro-batch, and on for the last: each ``training_step``
    reduce-scatters its gradients once, also one that the trainer runs under
    ``no_sync`` for its gradient accumulation (as under DDP, where each is
    averaged once). Gradient clipping runs as before, on the sharded gradients.

    Args:
        trainer (transformers.Trainer): a constructed ``Trainer``, or an instance
            of any subclass, on one device per process: one process, or several
            under DistributedDataParallel or FSDP2. A subclass's own
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
        NotImplementedError: if the trainer runs under DeepSpeed, FSDP1, XLA or
            Megatron-LM, on a model sharded as ``transformers`` loaded it
            (``distributed_config``), over several GPUs of one process
            (``DataParallel``), with
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

    .. versionadded:: 0.1.0
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
        close = difflib.get_close_matches(unknown[0], sorted(_OPTIONS), n=1)
        why = f" (did you mean {close[0]!r}?)" if close else ""
        why = "; each step tries its whole batch first" if unknown[0] == "initial" else why
        raise TypeError(
            f"{NAME}() got an unexpected keyword argument {unknown[0]!r}{why}; its options are "
            f"{', '.join(sorted(_OPTIONS))}"
        )
    Policy.of(NAME, None, options, rows=True)
    _refuse_unservable(trainer, transformers)
    overridden = type(trainer).training_step is not transformers.Trainer.training_step
    inexact = Inexact(trainer, weighing_of(trainer, transformers, shifts_labels(trainer, transformers)), transformers)
    training = _Training(trainer, overridden, options, inexact)
    prediction = _Prediction(trainer, options, inexact)
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
        raise ImportError(
            f"{NAME}() needs transformers: pip install transformers (koila-retry's transformers extra) ({error})"
        ) from error


def _refuse_unservable(trainer: Any, transformers: ModuleType) -> None:
    """Raise ``NotImplementedError`` naming why, for a trainer whose steps micro-batches would change."""
    args = trainer.args
    reasons = []
    if getattr(trainer, "is_deepspeed_enabled", False):
        reasons.append(
            "it runs under DeepSpeed, whose engine runs the backward and the gradient accumulation itself "
            "(and partitions the gradients with ZeRO)"
        )
    fsdp = _fsdp_version(trainer)
    if fsdp not in (None, 2):
        reasons.append(
            f"it runs under FSDP{fsdp} (FullyShardedDataParallel), whose flat parameters adapt cannot reset after "
            "a failed forward or backward; adapt serves FSDP2: fsdp_config={'version': 2, ...}"
        )
    if getattr(trainer, "is_distributed_loading_by_transformers", False):
        reasons.append(
            "its model was sharded as transformers loaded it (from_pretrained(distributed_config=...)), whose "
            "trainer all-reduces the gradients of trainable parameters outside FSDP2 inside each backward; adapt "
            "serves FSDP2 through accelerate's FSDP plugin: fsdp_config={'version': 2, ...}"
        )
    distributed = str(getattr(trainer.accelerator, "distributed_type", "NO")).split(".")[-1]
    if distributed not in ("NO", *DDP_TYPES) and not (distributed == "FSDP" and fsdp is not None):
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


def _fsdp_version(trainer: Any) -> int | None:
    """The FSDP version the trainer shards its model with (accelerate's FSDP plugin), or ``None`` without FSDP."""
    if not getattr(trainer, "is_fsdp_enabled", False):
        return None
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    return int(getattr(plugin, "fsdp_version", 1))  # accelerate before 1.6 knew FSDP1 only


def _codes(function: Any) -> list[Any]:
    """The code of ``function`` and of each function it wraps (``__wrapped__``, as functools.wraps sets it)."""
    codes = []
    for _ in range(100):
        code = getattr(function, "__code__", None)
        if code is not None:
            codes.append(code)
        function = getattr(function, "__wrapped__", None)
        if function is None:
            break
    return codes


def _names(code: Any) -> set[str]:
    """The global and attribute names a function's code uses, its nested functions' included."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if hasattr(constant, "co_names"):
            names |= _names(constant)
    return names


class _Whole:
    """What an adapted step keeps of a whole batch the trainer's own step ran: whether it may, and its error."""

    def __init__(self, trusting: bool) -> None:
        self.trusting = trusting  # whether a step may run as the trainer runs it: until one runs out of memory
        # The message and place of the out-of-memory error of a step that ran whole, until accumulate's
        # first attempt of the batch raises it again (see accumulator's replay).
        self.failure: tuple[str, str] | None = None

    def replayed(self) -> tuple[str, str] | None:
        """Return, once, the message and place of the error with which the step that ran whole ran out of memory."""
        failure, self.failure = self.failure, None
        return failure


class _Bound:
    """A step bound to the trainer it adapted: its wrappers close over it, so a deep copy would share them."""

    def __deepcopy__(self, memo: dict[int, Any]) -> NoReturn:
        raise TypeError(
            f"a Trainer that {NAME}() adapted cannot be deep-copied: its steps' wrappers are bound to it, so "
            "the copy's steps would weigh its micro-batches with the original's state. Copy the trainer before "
            f"{NAME}(), and adapt the copy"
        )


class _Training(_Bound):
    """An adapted ``training_step``: as the trainer runs it where an OOM can be undone, else through ``accumulate``."""

    def __init__(self, trainer: Any, overridden: bool, options: Options, inexact: Inexact) -> None:
        self.trainer, self.overridden = trainer, overridden
        self.original: Callable[..., Any] = trainer.training_step
        self.given = True  # whether the trainer passed num_items_in_batch to this step (from transformers 4.46)
        self.inexact, self.weighing = inexact, inexact.weighing
        self.whole: torch.Tensor | None = None  # what the step's whole batch is weighed by, while it runs
        self.inputs: Any = None  # that batch, while it runs
        self.unseen: Any = None  # the step chosen for it, until a micro-batch shows that it split
        self.packed: dict[str, Any] = {}  # a packed row's sequence boundaries (see apart)

        def backward(loss: torch.Tensor, **kwargs: Any) -> None:
            trainer.accelerator.backward(loss, **kwargs)

        def training_step(model: Any, inputs: Any, num_items_in_batch: Any) -> tuple[torch.Tensor, Any]:
            return self.run(model, inputs, num_items_in_batch)

        training_step.__qualname__ = self.name = f"{type(trainer).__name__}.training_step"  # as errors name it
        self.kept = _Whole(True)
        replay = self.kept.replayed
        # One Stats for the three, which the wrapper shows: a step counts whichever of them runs it.
        self.stats = stats = Stats(batch_size=0)
        shared: Any = {"backward": backward, "replay": replay, "stats": stats, "options": options}
        shared["identity"] = _identity(trainer, "training_step")
        # For a batch with num_items_in_batch but no labels to count: a loss divided by the count adds up.
        self.summed = accumulator(reduction="sum", **shared)(training_step)
        self.weighted = accumulator(weight=self.weighing.weight(trainer), **shared)(training_step)
        self.by_rows = accumulator(**shared)(training_step)
        self.unsplit = Whole(training_step, self.name, accumulator(**shared), "adapt()", _ADVICE)
        # With its own backward (see _whole), unless a size was cached. An override's first step run so is
        # checked as accumulate would check it (see _checked): that it backs through accelerator.backward, once.
        self.kept.trusting = not self.by_rows.cache_info().currsize
        self.checked = not overridden
        self.edits = False  # whether an override was seen to change .grad after its backward
        # Whether its code names the gradients (p.grad, clip_grad_norm_): warned of once through accumulate.
        # Every layer's: a decorator's wrapper may clip after the step it wraps.
        self.reads = overridden and any(_names(code) & _GRADIENTS for code in _codes(type(trainer).training_step))
        # Whether the graph of a step run as the trainer runs it reaches leaves besides the parameters:
        # None until the first such step's walk says (see _whole).
        self.walks: bool | None = None

    def __call__(self, model: Any, inputs: Any, num_items_in_batch: Any = ABSENT) -> Any:
        self.kept.failure = None
        if self.kept.trusting or not self.checked:  # an override's first step is checked whole, a size cached or not
            returned = self._whole(model, inputs, num_items_in_batch)
            if returned is not _FAILED:
                return returned
        inputs, self.packed = apart(inputs)  # a packed row is one row: its boundaries pass whole
        # The original is called as the trainer calls this: with num_items_in_batch only where given.
        self.given = num_items_in_batch is not ABSENT
        count = num_items_in_batch if self.given else None
        self.whole = self.weighing.counted(self.trainer, inputs)
        self.inputs = inputs
        step = self.unseen = _chosen(self, count is not None, self.whole)
        reason = None
        try:
            try:
                returned = step(model, inputs, count)[1]
            except (TypeError, ValueError):  # from Split, before anything ran, or the step's own
                reason = unsplittable((), {"inputs": inputs, "num_items_in_batch": count}, "adapt")
                if reason is None:
                    raise
            if reason is not None:  # outside the handler, whose error is gone: the step runs whole
                step = self.unsplit.run
                device = self.trainer.args.device
                returned = self.unsplit(device, inputs, (model, inputs, count), {}, reason)[1]
        finally:
            self.whole = self.inputs = self.unseen = None
        if not self.checked:  # an override that passed accumulate's checks: as the trainer runs it from now on
            self.checked = True
            self.kept.trusting = not step.stats.ooms and not step.cache_info().currsize
        return returned

    def _whole(self, model: Any, inputs: Any, num_items_in_batch: Any) -> Any:
        """Run the step as the trainer would, where an OOM can be undone; ``_FAILED`` if not run or it ran out."""
        # One process, a batch whose rows show, and no hook on a parameter: a step that fails part-way
        # through its backward is undone by putting back the gradients it began with.
        rows = _rows_of(inputs)
        if not rows or distributed.is_running():
            return _FAILED
        parameters = [parameter for parameter in model.parameters() if parameter.requires_grad]
        for parameter in parameters:
            gradient = parameter.grad
            if parameter._backward_hooks or parameter._post_accumulate_grad_hooks:
                return _FAILED
            if gradient is not None and gradient.layout != torch.strided:  # added back as accumulate adds it
                return _FAILED
        # Within an accumulation window, the window's gradients so far are set aside while the step's
        # backward writes its own, and added back after it: the hand loop's sum, with one gradient
        # buffer more while it runs (as through accumulate).
        before = [parameter.grad for parameter in parameters]
        if any(gradient is not None for gradient in before):
            for parameter in parameters:
                parameter.grad = None
        else:
            before = []
        # What its backward writes besides the parameters (a tensor of your own, an input that needs a
        # gradient) is found in the loss's graph as accelerator.backward begins, and set aside too: in
        # every step if the first step's graph reached any, else in none (a walk costs a tenth of a
        # millisecond a step on a small GPT-2).
        others = OtherLeaves(lambda: {id(parameter) for parameter in parameters})
        backward = self.trainer.accelerator.backward
        checking = not self.checked
        # An override's code after its backward sees the window's gradients, as in the trainer's own step:
        # added back as the backward ends (an out-of-memory error after it is not undone, see below).
        early = self.overridden and bool(before)
        calls, after, added = 0, None, False

        def walked(loss: torch.Tensor, **kwargs: Any) -> Any:
            nonlocal calls, after, added, before
            if checking:
                calls += 1
                self._refuse_for_a_split(calls, kwargs)
            if self.walks is not False:
                others.see(loss)
                if self.walks is None:
                    self.walks = others.found()
            returned = own_backward.allowed(backward, loss, **kwargs) if checking else backward(loss, **kwargs)
            if early:
                others.restore()
                added_back(parameters, before)
                before, added = [], True
            if checking:
                after = _gradients(model)
            return returned

        failed = False
        wrapped = self.walks is not False or checking or early
        with _swapped(self.trainer.accelerator, "backward", walked) if wrapped else contextlib.nullcontext():
            try:
                # A copy: a step may change its mapping (pop a key it weighs rows by), and the retry after
                # its OOM splits the mapping as the trainer made it.
                args = (model, shallow_copy(inputs)) + (() if num_items_in_batch is ABSENT else (num_items_in_batch,))
                # An override's first step: a backward of its own besides is refused before it writes .grad.
                returned = own_backward.call(self.original, self.name, args, {}) if checking else self.original(*args)
            except BaseException as error:
                if added:  # the window's gradients are in .grad with the step's, as the trainer leaves them
                    if is_oom(error) and hasattr(error, "add_note"):  # Python 3.11 on
                        error.add_note(f"{NAME}: {self.name} ran out of memory after its backward: not retried")
                    raise
                if not is_oom(error):  # the gradients as the step found them, not part of a backward
                    _given_back(parameters, before, others)
                    raise
                # Undone outside the except block, once the attempt's frames are gone (cleared, as the engine
                # clears them: a compute_loss that kept the error pins nothing); only its message and place are kept.
                failed, self.kept.failure = True, replayable(error)
                clear_frames(error)
        if failed:
            _given_back(parameters, before, others)
            self.kept.trusting = False  # accumulate runs every step from now on, this one first
            return _FAILED
        if checking:
            self._checked(calls, after, model, lambda: _given_back(parameters, before, others))
        others.restore()
        if before:
            added_back(parameters, before)
        self.stats.ran_whole(rows)
        return returned

    def _refuse_for_a_split(self, calls: int, kwargs: dict[str, Any]) -> None:
        """Refuse, before it runs, a backward that an override asks for which a split step could not run."""
        if calls > 1:
            raise RuntimeError(
                f"{NAME}: the training_step of {type(self.trainer).__name__} called self.accelerator.backward more "
                "than once; adapt serves a step that calls it once"
            )
        kwargs = {key: value for key, value in kwargs.items() if key != "retain_graph"}
        if kwargs:
            raise NotImplementedError(
                f"{NAME}: the trainer's training_step called accelerator.backward with {sorted(kwargs)}, "
                "which adapt cannot pass on per micro-batch (it accepts retain_graph, and runs the backward "
                "after the step). Call self.accelerator.backward(loss) without them"
            )

    def _checked(self, calls: int, after: Any, model: Any, undo: Callable[[], None]) -> None:
        """After an override's first step, run whole: refuse what a split could not serve, warn of what it could not."""
        self.checked = True
        if calls != 1:
            undo()
            raise RuntimeError(
                f"{NAME}: the training_step of {type(self.trainer).__name__} called self.accelerator.backward "
                f"{calls} times; adapt serves a step that calls it once"
            )
        self.kept.trusting = True  # the whole batch fitted: a size a cache knew was not this batch's
        if after is not None and _gradients(model) != after:  # None: the backward raised, and the step caught it
            self.edits = True
            warn_or_log(
                f"{NAME}: the training_step of {type(self.trainer).__name__} changes .grad after "
                "self.accelerator.backward (zeroing rows, clipping): while its steps run whole, as the trainer "
                "runs them, it sees the gradients as in the trainer; a step split into micro-batches, after an "
                "out-of-memory error, could not run it on the batch's gradient, and raises RuntimeError then. "
                "Change the gradients in a callback's on_pre_optimizer_step instead.",
                UserWarning,
                stacklevel=levels_to_caller(),
            )

    def run(self, model: Any, inputs: Any, num_items_in_batch: Any) -> tuple[torch.Tensor, Any]:
        """Run the original step on (part of) the batch with its backward held back; return the loss and its result."""
        accelerator = self.trainer.accelerator
        held: list[torch.Tensor] = []

        def hold(loss: torch.Tensor, **kwargs: Any) -> None:
            # The backward runs after the step, kept as long as its micro-batches need: retain_graph says nothing.
            self._refuse_for_a_split(1, kwargs)
            held.append(loss)

        if self.edits:  # seen at the first step: code after the backward would run before it, on no gradient
            raise self._changed_grad()
        if self.reads:
            self.reads = False
            warn_or_log(
                f"{NAME}: {self.name} runs through accumulate (a step that ran out of memory, or under DDP, with "
                "a hook on a parameter, or a batch that is not a mapping), where its code after "
                "self.accelerator.backward runs before that backward: code there that reads or changes .grad "
                "(clipping, zeroing rows, logging a norm) sees no gradient, or a part of the batch's. Do it in a "
                "callback's on_pre_optimizer_step, which sees the batch's. This warning is shown once.",
                UserWarning,
                stacklevel=levels_to_caller(),
            )
        before = _gradients(model) if self.overridden else None
        whole = inputs is self.inputs
        if self.unseen is not None and not whole and _rows_of(inputs) != _rows_of(self.inputs):
            # Split: warned of once if no weight per micro-batch adds its loss up.
            self.inexact.check(self.inputs, "training step", self.unseen is self.summed)
            self.unseen = None
        inputs = joined(inputs, self.packed)
        with _swapped(accelerator, "backward", hold):
            if self.given:
                # The whole batch is the step's own inputs: what weighs it is counted already.
                part = self.whole if whole else self.weighing.counted(self.trainer, inputs)
                returned = self.original(
                    model, inputs, self.weighing.shared(num_items_in_batch, part, self.whole, model)
                )
            else:  # transformers before 4.46
                returned = self.original(model, inputs)
        if before is not None and _gradients(model) != before:
            raise self._changed_grad()
        if len(held) != 1:
            raise RuntimeError(
                f"{NAME}: the training_step of {type(self.trainer).__name__} called self.accelerator.backward "
                f"{len(held)} times; adapt serves a step that calls it once"
            )
        loss = held.pop()
        if not isinstance(returned, torch.Tensor) or returned.numel() != 1:
            returned = loss.detach()
        return loss, returned

    def _changed_grad(self) -> RuntimeError:
        return RuntimeError(
            f"{NAME}: the training_step of {type(self.trainer).__name__} changes .grad itself (a backward outside "
            "self.accelerator.backward, or code that edits the gradients after it): adapt cannot run such a step "
            "through accumulate, split or not, where its code after the backward runs on each micro-batch before "
            "its backward, on no gradient. Run the backward through self.accelerator.backward, and change the "
            "gradients in a callback's on_pre_optimizer_step"
        )


def _identity(trainer: Any, step: str) -> tuple[str, int, str]:
    """Name a trainer's step by its class and model's, which key the sizes it remembers: not adapt's wrapper."""
    model = type(innermost(trainer.model)) if isinstance(trainer.model, torch.nn.Module) else type(trainer.model)
    return class_identity(model, f"{type(trainer).__qualname__}.{step} of {model.__qualname__}")


def _rows_of(inputs: Any) -> int | None:
    """Return the rows of a batch of keyword inputs, by its first tensor, or ``None``."""
    if isinstance(inputs, Mapping):
        for value in inputs.values():
            if isinstance(value, torch.Tensor) and value.dim():
                return int(value.shape[0])
    return None


def _given_back(parameters: list[Any], before: list[Any], others: OtherLeaves) -> None:
    """Give every gradient a step that raised wrote back as the step found it (``before`` empty: all None)."""
    others.give_back()
    set_grads(zip(parameters, before or [None] * len(parameters), strict=True))


# Names in an override's code that read or change the gradients after its backward.
_GRADIENTS = frozenset({"grad", "clip_grad_norm_", "clip_grad_value_", "clip_grad_norm", "clip_grad_value"})
# What _Training._whole returns for a step it did not run, or that ran out of memory.
_FAILED: Any = object()


def _chosen(steps: _Training | _Prediction, counted: bool, labels: torch.Tensor | None) -> Any:
    """Choose the step that weighs this batch's micro-batches (by labels, unweighted, by rows)."""
    mode = steps.weighing.mode
    if mode == SUM:  # a loss that adds its rows' (a CTC loss's, say): weighed 1 each
        step = steps.summed
    elif labels is not None:  # the labels counted, or (a mean over rows) a tensor of the batch's rows
        step = steps.weighted
    elif counted and mode != ROWS:
        step = steps.summed
    else:
        step = steps.by_rows
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


class _Prediction(_Bound):
    """An adapted ``prediction_step``: as the trainer runs it alone until an OOM, else through ``accumulate``."""

    def __init__(self, trainer: Any, options: Options, inexact: Inexact) -> None:
        self.trainer = trainer
        self.original: Callable[..., Any] = trainer.prediction_step
        self.inexact, self.weighing = inexact, inexact.weighing
        self.count: Callable[..., Any] | None = getattr(trainer, "_get_num_items_in_batch", None)
        self.lossless = False
        self.rows_checked = False  # see _averaged
        # The logits' leaves folded to one entry per row, by index, with their entries per row (see _folded).
        self.folds: dict[int, int] | None = None
        self.total = 0  # the rows of the step's batch, as accumulate splits them
        # Per batch size, the rows' indices passed beside the batch: each chunk's tell where it starts.
        self.indices: dict[int, torch.Tensor] = {}
        self.padded = self.warned_padded = False  # whether the step's parts were padded with -100 (see pad)
        self.packed: dict[str, Any] = {}  # a packed row's sequence boundaries (see apart)
        self.generating: dict[str, Any] = {}  # a Seq2SeqTrainer's gen_kwargs given to the call
        self.generation: tuple[Any, Any, dict[str, Any]] | None = None  # its model's generation config, as it began
        self.grad_mode = False  # the call's, under which the step runs (accumulate runs it under no_grad)

        def prediction_step(
            model: Any, inputs: Any, prediction_loss_only: bool, ignore_keys: Any, where: torch.Tensor | None
        ) -> dict[str, Any]:
            try:
                ran = joined(inputs, self.packed)
                if self.generation is not None:  # as the batch began, in each attempt and chunk
                    put_back(self.generation)
                with torch.set_grad_enabled(self.grad_mode):  # the trainer's: an override may take gradients
                    found = self.original(model, ran, prediction_loss_only, ignore_keys=ignore_keys, **self.generating)
                loss, logits, labels = found
            except BaseException:
                self.aside.drop()  # before the memory of the failed attempt is released
                raise
            if loss is None:  # accumulate needs a loss to weigh; this one stands for none
                self.lossless = True
                loss = torch.zeros((), device=trainer.args.device)
            rows = _rows_of(inputs)
            if logits is not None and rows:
                logits = self._folded(logits, inputs, rows)
            if where is not None:
                logits, labels = self.aside.chunk(int(where[0]), len(where), self.total, logits, labels)
            # Only what there is: a None would be warned about as an object accumulate cannot combine.
            found = {"loss": loss, "logits": logits, "labels": labels}
            return {key: value for key, value in found.items() if value is not None}

        prediction_step.__qualname__ = f"{type(trainer).__name__}.prediction_step"
        self.kept = _Whole(True)
        replay = self.kept.replayed

        def pad() -> float | None:  # asked only when the chunks' parts differ in size beyond the rows
            if getattr(trainer.args, "predict_with_generate", False):
                return generated_pad(trainer, self.generating)
            # As the trainer pads its batches' (nested_concat's padding_index): a prediction_step that
            # generates, or trims to its batch's longest row. Warned of after the step.
            self.padded = True
            return IGNORED

        self.aside = Aside(pad)

        self.stats = stats = Stats(batch_size=0)  # one for the three, as in training
        shared: Any = {"replay": replay, "pad": pad, "stats": stats, "options": options}
        shared["identity"] = _identity(trainer, "prediction_step")
        self.summed = accumulator(reduction="sum", **shared)(prediction_step)
        self.weighted = accumulator(weight=self.weighing.weight(trainer), **shared)(prediction_step)
        self.by_rows = accumulator(**shared)(prediction_step)
        self.unsplit = Whole(prediction_step, prediction_step.__qualname__, accumulator(**shared), "adapt()", _ADVICE)
        self.kept.trusting = not self.by_rows.cache_info().currsize

    def __call__(
        self, model: Any, inputs: Any, prediction_loss_only: bool, ignore_keys: Any = None, **generating: Any
    ) -> tuple[Any, Any, Any]:
        trainer, kept = self.trainer, self.kept
        self.generating, self.generation = generating, generation_state(trainer)
        self.grad_mode = torch.is_grad_enabled()
        kept.failure = None
        # In one process, as the trainer runs it: a prediction step writes no gradient, so an error
        # leaves nothing to undo. Under DDP every rank runs through accumulate, whose ranks agree.
        rows = _rows_of(inputs) if kept.trusting else None
        if rows and not distributed.is_running():
            failed = False
            try:
                found = self.original(
                    model, shallow_copy(inputs), prediction_loss_only, ignore_keys=ignore_keys, **generating
                )
            except BaseException as error:
                if not is_oom(error):
                    raise
                failed, kept.failure = True, replayable(error)  # raised again as accumulate's first attempt
                clear_frames(error)  # as the engine does: a compute_loss that kept the error pins no tensor
            if not failed:
                self.stats.ran_whole(rows)
                return cast("tuple[Any, Any, Any]", found)
            kept.trusting = False
        inputs, self.packed = apart(inputs)  # a packed row is one row: its boundaries pass whole
        # Counted once per step, before any attempt: under DDP the trainer gathers the count from every
        # rank, a collective that a split rank would make per chunk and a rank out of memory never.
        counted = None if self.count is None else self.count([inputs], trainer.args.device)
        whole = self.weighing.counted(trainer, inputs)
        step = _chosen(self, counted is not None, whole)
        self.lossless = False

        def shared(batches: list[Any], device: Any) -> Any:  # each chunk's share of that count, as in training
            return self.weighing.shared(counted, self.weighing.counted(trainer, batches[0]), whole, trainer.model)

        swap = (
            _swapped(trainer, "_get_num_items_in_batch", shared) if self.count is not None else contextlib.nullcontext()
        )
        self.folds = None
        total = batch_rows((model, inputs, prediction_loss_only, ignore_keys))
        self.total = total or 0
        self.aside.start()
        self.padded = False
        where = None if total is None else self._where(total)
        reason = None
        with swap, torch.no_grad():
            try:
                found = step(model, inputs, prediction_loss_only, ignore_keys, where)
            except (TypeError, ValueError):  # as in training
                reason = unsplittable((), {"inputs": inputs}, "adapt")  # where: one row per row of them
                if reason is None:
                    raise
            if reason is not None:
                step = self.unsplit.run
                given = (model, inputs, prediction_loss_only, ignore_keys, where)
                found = self.unsplit(trainer.args.device, inputs, given, {}, reason)
        loss = None if self.lossless else found["loss"]
        try:
            logits = self.aside.restored(LOGITS, found.get("logits"))
            labels = self.aside.restored(LABELS, found.get("labels"))
        finally:  # the last batch's labels would live till the next split step
            self.aside.joined = {}
        if reason is None and total and step.stats.batch_size < total:  # split: not a batch run whole
            self.inexact.check(inputs, "prediction step", step is self.summed, lossless=loss is None)
            if not self.rows_checked and (logits is not None or labels is not None):
                self._averaged(logits, labels, total)
            if self.padded and not self.warned_padded:
                self._warn_padded(total)
        if self.folds:
            leaves, spec = flatten(logits)
            for index in self.folds:
                leaves[index] = leaves[index].flatten(0, 1)
            logits = tree_unflatten(leaves, spec)
        return loss, logits, labels

    def _where(self, total: int) -> torch.Tensor:
        """The indices of a batch's rows, on the CPU, where reading a chunk's first costs no device sync."""
        where = self.indices.get(total)
        if where is None:
            if len(self.indices) > 64:  # batch sizes seldom vary; some loaders' do, batch after batch
                self.indices.clear()
            where = self.indices[total] = torch.arange(total)
        return where

    def _folded(self, logits: Any, inputs: Any, rows: int) -> Any:
        """Fold each tensor of ``logits`` of several entries per row, row after row, to one per row: joined as rows."""
        # Unfolded after the join: a Seq2SeqTrainer's num_return_sequences, each row's sequences one after another,
        # and an MoE model's router logits, (rows * tokens, experts), are then the whole batch's, as the trainer
        # joins its batches along that dimension. Which are is decided at the step's first chunk, for all of its
        # chunks and attempts alike: a tensor of the whole batch whose size only happens to fit one chunk's rows
        # must not be folded in some.
        if self.folds is not None and not self.folds:  # decided: nothing to fold
            return logits
        leaves, spec = flatten(logits)
        if self.folds is None:
            if getattr(self.trainer.args, "predict_with_generate", False):
                self.folds = {0: len(logits) // rows} if several_per_row(logits, rows) else {}
            else:
                tokens = {value.shape[1] for value in inputs.values() if one_per_row(value, rows) and value.dim() > 1}
                self.folds = {
                    index: leaf.shape[0] // rows
                    for index, leaf in enumerate(leaves)
                    if isinstance(leaf, torch.Tensor)
                    and leaf.dim() > 1  # a vector of the whole batch (a count per expert) is too likely to fit
                    and leaf.shape[0] != rows
                    and leaf.shape[0] % rows == 0
                    and leaf.shape[0] // rows in tokens
                }
        if not self.folds or max(self.folds) >= len(leaves):  # nothing, or another structure: accumulate names it
            return logits
        for index, per_row in self.folds.items():
            leaf = leaves[index]
            if not isinstance(leaf, torch.Tensor) or leaf.dim() < 2 or leaf.shape[0] != rows * per_row:
                found = tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else type(leaf).__name__
                raise ValueError(
                    f"adapt's prediction_step took a tensor of the logits for one entry per token of the rows "
                    f"({per_row} per row) at the batch's first chunk, and a chunk of {rows} rows returned {found} "
                    "there: it is a value of the whole batch. Leave it out of the logits "
                    "(evaluate(ignore_keys=[...]), or the model config's keys_to_ignore_at_inference)"
                )
            leaves[index] = leaf.reshape(rows, per_row, *leaf.shape[1:])
        return tree_unflatten(leaves, spec)

    def _averaged(self, logits: Any, labels: Any, rows: int) -> None:
        """Warn of the results of the first split step that are not one row per row, saying how each was joined."""
        # The trainer joins every batch's results along their first dimension, as rows: one that is neither per row
        # nor per token (see _folded) was taken by accumulate for a value of the whole chunk (an MoE aux_loss), or
        # concatenated (see Aside). Looked at once: a model's outputs keep their kinds from batch to batch.
        self.rows_checked = True
        said = []
        for part, value in ((LOGITS, logits), (LABELS, labels)):
            leaves = [] if value is None else flatten(value)[0]
            joined = {id(leaves[index]) for index in self.aside.concatenated(part)}
            for leaf in not_per_row(value, rows):
                if part == LOGITS or id(leaf) not in joined:  # labels concatenated are joined as the trainer joins
                    said.append(how_joined(part, leaf, id(leaf) in joined))
        if not said:
            return
        warn_or_log(
            f"adapt's prediction_step ran a batch of {rows} rows in chunks, and its results hold {len(said)} "
            "tensor(s) that are not one entry per row, nor per token of the rows, along their first dimension: "
            f"{'; '.join(said)}. Leave such tensors out of the logits (evaluate(ignore_keys=[...]), or the model "
            "config's keys_to_ignore_at_inference), or set prediction_loss_only. This warning is shown once.",
            UserWarning,
            stacklevel=levels_to_caller(),
        )

    def _warn_padded(self, rows: int) -> None:
        self.warned_padded = True
        warn_or_log(
            f"adapt's prediction_step ran a batch of {rows} rows in chunks, whose logits or labels differed in size "
            "beyond the rows (a prediction_step that generates, or trims its results to its batch's longest row): "
            f"they were padded at the end with {IGNORED}, as the Trainer pads its batches to join them. The whole "
            "batch would have held its own values there (generate's pad token, or the model's logits), so the "
            "padded entries differ from the whole batch's. This warning is shown once.",
            UserWarning,
            stacklevel=levels_to_caller(),
        )
