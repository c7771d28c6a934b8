"""Hugging Face: what ``adapt`` weighs a split step's micro-batches by, as the loss that runs normalises.

Most of Hugging Face's losses are a mean over the labels that are not -100 (a causal language
model's shifted by one), or their sum over ``num_items_in_batch``: each micro-batch is weighed by
its share of those labels. The model's loss type says where it is otherwise: a CTC loss is a mean
over rows (``ctc_loss_reduction="mean"``, each row's loss over its target length) or a sum; a
semantic segmentation loss leaves out its own ignore index, an RNN-T loss its blank token. A loss
that adds means over different things (a pre-training head's masked tokens and next-sentence
labels, a detector's boxes and queries, an MoE model's router loss over the batch's tokens) has no
single weight per micro-batch: a split step of it is warned of once.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

import torch

from koila_retry._common.places import levels_to_caller
from koila_retry._common.warn import warn_or_log

__all__ = ["IGNORED", "ITEMS", "ROWS", "SUM", "Inexact", "Weighing", "shifts_labels", "weighing_of"]

IGNORED = -100
# How a loss is normalised: a mean over counted labels, a mean over rows, a sum (weighed 1 each).
ITEMS, ROWS, SUM = "items", "rows", "sum"
# Class name endings that name a model's loss where its loss type does not (transformers before 4.46, or
# a head that computes its own loss): those of the heads whose loss is not a mean over counted labels.
_ENDINGS = (
    "ForCTC",
    "ForSemanticSegmentation",
    "ForObjectDetection",
    "ForSegmentation",
    "ForInstanceSegmentation",
    "ForUniversalSegmentation",
)
_DETECTION = (
    "its loss is normalised by the whole batch's boxes or masks, and weighs the queries that match none apart "
    "from the others"
)


class Weighing:
    """How a trainer's loss is normalised, which decides how ``adapt`` weighs a split step's micro-batches."""

    def __init__(
        self, mode: str, shifts: bool | None, ignored: tuple[int, ...] = (IGNORED,), inexact: str | None = None
    ) -> None:
        self.mode = mode
        self.shifts = shifts  # whether the counted labels are shifted by one; None: nothing tells
        self.ignored = ignored  # the label values a loss over the labels leaves out
        self.inexact = inexact  # why no weight per micro-batch adds the loss up, if none does

    def counted(self, trainer: Any, inputs: Any) -> torch.Tensor | None:
        """The tensor whose items (``ITEMS``: the labels) or rows (``ROWS``) the loss is normalised by, or ``None``."""
        if self.mode == ITEMS:
            return labels_counted(trainer, inputs, self.shifts)
        return _first(inputs) if self.mode == ROWS else None

    def items(self, counted: torch.Tensor) -> torch.Tensor:
        """The items of a tensor :meth:`counted` returned (its rows: on the CPU, where they are known)."""
        if self.mode == ROWS:
            return torch.tensor(counted.shape[0])
        return self.kept(counted).sum()

    def kept(self, labels: torch.Tensor) -> torch.Tensor:
        kept = labels.ne(IGNORED)
        for value in self.ignored:
            if value != IGNORED:
                kept &= labels.ne(value)
        return kept

    def shared(self, count: Any, part: torch.Tensor | None, whole: torch.Tensor | None, model: Any) -> Any:
        """Return ``num_items_in_batch`` for a micro-batch: ``count`` times its share of the batch's items."""
        if count is None or part is None or whole is None or part.shape[:1] == whole.shape[:1]:
            return count
        items, total = self.items(part), self.items(whole)
        if not bool(items):  # weighed 0, its loss counts for nothing; its share would divide by 0
            return count
        if isinstance(count, torch.Tensor):
            # Computed in float64 and rounded once to the finest of the default dtype (an integer count's quotient
            # was in it), the model's parameters' and the count's: in float32, a float64 model's split step would
            # lose digits; in a bfloat16 model's dtype, every model's would.
            dtype = torch.promote_types(torch.get_default_dtype(), _precision(model))
            if count.is_floating_point():
                dtype = torch.promote_types(count.dtype, dtype)
            device = count.device
            share = count.double() * items.to(device, torch.float64) / total.to(device, torch.float64)
            return share.to(dtype)
        return count * int(items) / int(total)

    def weight(self, trainer: Any) -> Callable[..., Any]:
        """Return ``weight=`` for a step: the items a micro-batch's mean loss averages over."""
        unwarned = [self.shifts is None and self.mode == ITEMS]  # called only for a split batch: warned of once

        def items(model: Any, inputs: Any, *rest: Any) -> Any:
            labels = self.counted(trainer, inputs)
            if labels is None:  # checked before the weighted step is chosen
                raise RuntimeError("the batch lost its labels")
            if unwarned[0] and labels.dim() >= 2 and bool(labels.eq(IGNORED).any()):
                unwarned[0] = False
                _warn_unshifted(model)
            if self.mode == ROWS:  # a mean over rows, weighed by rows without accumulate's warning of -100s
                return labels.shape[0]
            return self.items(labels)  # this rank's, without a collective: ranks may split differently

        return items


def _first(inputs: Any) -> torch.Tensor | None:
    """A batch's first tensor of one dimension or more, whose first dimension is its rows, or ``None``."""
    if not isinstance(inputs, Mapping):
        return None
    return next((value for value in inputs.values() if isinstance(value, torch.Tensor) and value.dim()), None)


def _precision(model: Any) -> torch.dtype:
    """The dtype of the model's first floating-point parameter: the precision its losses are computed in."""
    parameters = model.parameters() if isinstance(model, torch.nn.Module) else ()
    found = next((p.dtype for p in parameters if p.is_floating_point()), None)
    return torch.get_default_dtype() if found is None else found


def _warn_unshifted(model: Any) -> None:
    """Warn that a split step counts the labels of a model whose loss type nothing tells as they are."""
    warn_or_log(
        f"adapt split a step of a {type(model).__name__}, whose loss type nothing tells (it sets no loss_type and "
        "derives from no Hugging Face architecture), and weighs its "
        "micro-batches by their labels that are not -100, as they are: right for a loss over every label (a "
        "token classifier's), not for a causal language model's, which predicts each label from the tokens "
        "before it and averages over all but the first (a micro-batch of one-token rows counts none: its loss "
        "is nan). For such a model, set loss_type = 'ForCausalLM' on it, which Hugging Face's Trainer reads "
        "too: adapt then counts the labels shifted by one. This warning is shown once.",
        UserWarning,
        stacklevel=levels_to_caller(),
    )


def weighing_of(trainer: Any, transformers: ModuleType, shifts: bool | None) -> Weighing:
    """How the trainer's loss is normalised: by its model's loss type, where the model's loss is the one that runs."""
    default = Weighing(ITEMS, shifts)
    if getattr(trainer, "compute_loss_func", None) is not None or _smoothed(trainer, transformers):
        return default  # a loss of the trainer's: documented as a mean over the labels, or over the count
    model = trainer.model
    # As for the shift: every outermost Hugging Face model a wrapper (a PEFT model) holds, or the module itself.
    found = {_kind(held) for held in _outermost(model, transformers.PreTrainedModel) or [model]}
    if len(found) != 1:
        return default
    mode, ignored, inexact = found.pop()
    return Weighing(mode, shifts, ignored, inexact)


def _smoothed(trainer: Any, transformers: ModuleType) -> bool:
    """Whether the trainer's label smoother computes the loss (``Trainer``'s own ``compute_loss``)."""
    return (
        getattr(trainer, "label_smoother", None) is not None
        and getattr(trainer, "compute_loss_func", None) is None
        and type(trainer).compute_loss is transformers.Trainer.compute_loss
    )


def _kind(model: Any) -> tuple[str, tuple[int, ...], str | None]:
    """The mode, the ignored label values and why it is inexact, of a model's own loss."""
    config = getattr(model, "config", None)
    name = _loss_name(model)
    if name is None:  # nothing tells: the class it derives from
        name = next((end for kind in type(model).__mro__ for end in _ENDINGS if kind.__name__.endswith(end)), "")
    if name in ("ForCTCLoss", "ForCTC"):  # a mean over rows, each row's loss over its target length; or a sum
        return (SUM if getattr(config, "ctc_loss_reduction", "mean") == "sum" else ROWS), (IGNORED,), None
    if name in ("ForSemanticSegmentationLoss", "ForSemanticSegmentation"):
        if getattr(config, "num_labels", 2) == 1:  # Segformer's: a mean over every pixel of equal-sized maps
            return ROWS, (IGNORED,), None
        index = getattr(config, "semantic_loss_ignore_index", getattr(config, "loss_ignore_index", 255))
        return ITEMS, (IGNORED, int(index)), None
    if name == "ParakeetForRNNTLoss":  # "mean_volume": over the target tokens, which leave out the blank one
        return ITEMS, (IGNORED, int(getattr(config, "blank_token_id", IGNORED))), None
    if name == "ParakeetForTDTLoss":  # "mean": each row's loss over its target length, a mean over rows
        return ROWS, (IGNORED,), None
    if name.endswith(("ObjectDetectionLoss", "SegmentationLoss")) or name in _ENDINGS:
        return ITEMS, (IGNORED,), f"{_DETECTION} ({name})"
    if name.endswith("TTSForConditionalGenerationLoss"):
        return ITEMS, (IGNORED,), f"its loss ({name}) adds a mean over the target frames and one over end-of-speech"
    return ITEMS, (IGNORED,), None


def _loss_name(model: Any) -> str | None:
    """The name of the loss function a model's ``loss_type`` maps to, where Hugging Face tells it (4.46 on)."""
    try:
        losses = importlib.import_module("transformers.loss.loss_utils")
        function = losses.LOSS_MAPPING.get(getattr(model, "loss_type", None))
    except (ImportError, AttributeError):  # pragma: no cover - transformers before 4.46
        return None
    return None if function is None else str(getattr(function, "__name__", ""))


def shifts_labels(trainer: Any, transformers: ModuleType) -> bool | None:
    """Whether the trainer's loss shifts its labels (a causal language model's); None: a model nothing tells of."""
    model = trainer.model
    if _smoothed(trainer, transformers):
        # The trainer's label smoothing computes the loss: it shifts for the class names it lists, as its code does.
        peft = getattr(importlib.import_module("transformers.trainer"), "_is_peft_model", None)
        if peft is not None and peft(model):  # as the trainer names a PEFT model: by the model it adapts
            model = model.base_model.model
        return type(model).__name__ in _causal_names()
    if getattr(trainer, "_loss_shifts_labels", False):  # the trainer's own answer (transformers 5)
        return True
    # A module that is no PreTrainedModel (a wrapper, a PEFT model) shifts if every outermost one it holds does;
    # one that holds none, if its loss_type says so, which the trainer reads too (transformers 5).
    models = _outermost(model, transformers.PreTrainedModel)
    if not models and getattr(model, "loss_type", None) is None:
        return None
    if models and all(map(_unknown, models)):  # classes of the user's own on PreTrainedModel alone
        return None
    return all(_causal(model) for model in models or [model])


def _unknown(model: Any) -> bool:
    """Whether nothing tells what a Hugging Face model's loss is: no loss type, and no architecture it derives from."""
    if getattr(model, "loss_type", None) is not None:
        return False
    return not any(kind.__module__.startswith("transformers.models.") for kind in type(model).__mro__)


def _takes_return_loss(kind: Any) -> bool:
    """Whether a model class's ``forward`` has a ``return_loss`` parameter: a loss made over the batch's pairs."""
    try:
        return "return_loss" in inspect.signature(kind.forward).parameters
    except (TypeError, ValueError, AttributeError):
        return False


def _outermost(module: Any, kind: type) -> list[Any]:
    """The modules of ``kind`` in ``module``, itself included, that no other of ``kind`` holds."""
    if isinstance(module, kind):
        return [module]
    children = module.children() if isinstance(module, torch.nn.Module) else ()
    return [found for child in children for found in _outermost(child, kind)]


def _causal(model: Any) -> bool:
    """Whether a Hugging Face model's loss is a causal language model's, as Hugging Face tells them apart."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    try:  # transformers 4.46 on: the loss a model type uses
        losses = importlib.import_module("transformers.loss.loss_utils")
        kind = losses.LOSS_MAPPING.get(getattr(model, "loss_type", None))
        if kind is not None:
            return bool(kind is losses.ForCausalLMLoss)
    except (ImportError, AttributeError):  # pragma: no cover - transformers before 4.46
        pass
    # A class of its own (loss_type None) computes the loss of the Hugging Face class it derives from.
    names = _causal_names()
    return any(kind.__name__ in names for kind in type(model).__mro__)


def _causal_names() -> set[str]:
    """The class names of causal language models: those ``Trainer``'s label smoothing shifts for, in every version."""
    auto = importlib.import_module("transformers.models.auto.modeling_auto")
    return set(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def labels_counted(trainer: Any, inputs: Any, shifts: bool | None) -> torch.Tensor | None:
    """The labels whose entries that are not -100 a loss averages over, as Hugging Face counts them, or ``None``."""
    labels = field(inputs, "shift_labels")
    if labels is None:
        labels = field(inputs, "labels")
        if isinstance(labels, torch.Tensor) and shifts and labels.dim() >= 2:  # a sequence per row
            labels = labels[..., 1:]
    return labels if isinstance(labels, torch.Tensor) else None


def field(inputs: Any, name: str) -> Any:
    """Return a batch's entry ``name`` as Hugging Face's Trainer reads it (``in``, then ``[]``), or ``None``."""
    if isinstance(inputs, Mapping):
        return inputs.get(name)
    # A class of the user's that is not a Mapping but answers both, whose labels the trainer counts all the
    # same: not weighed by them, a mean loss's micro-batches would add up to a sum of means.
    if isinstance(inputs, (torch.Tensor, tuple, list)) or not hasattr(type(inputs), "__getitem__"):
        return None
    try:
        return inputs[name] if name in inputs else None  # noqa: SIM401 (not a Mapping: may have no get)
    except (TypeError, KeyError, IndexError, AttributeError):  # answers one of them only for some names
        return None


class Inexact:
    """Warns once, for an adapted trainer, of a split step whose loss no weight per micro-batch adds up."""

    def __init__(self, trainer: Any, weighing: Weighing, transformers: ModuleType) -> None:
        self.trainer, self.weighing, self.transformers = trainer, weighing, transformers
        self.warned = False
        self.pairs: dict[type, bool] = {}  # whether each model class takes return_loss

    def check(self, inputs: Any, step: str, summed: bool, lossless: bool = False) -> None:
        """Warn if a split ``step`` of the whole batch ``inputs`` (weighed 1 each if ``summed``) is inexact.

        ``lossless``: a prediction step without a loss, whose outputs alone may be a micro-batch's.
        """
        if self.warned:
            return
        model = self.trainer.model
        found = (
            (self._in_batch(model, inputs),)
            if lossless
            else (
                self.weighing.inexact,
                _router(model, self.transformers),
                self._in_batch(model, inputs),
            )
        )
        reasons = [why for why in found if why]
        if not summed and not lossless:
            reasons += self._mixed(inputs)
        if not reasons:
            return
        self.warned = True
        training = step == "training step"
        what = "outputs are not those of the whole batch" if lossless else "loss no weight per micro-batch adds up"
        differ = (
            "loss and gradient differ from those of the batch run whole, as across the trainer's own gradient "
            "accumulation"
            if training
            else "loss and predictions are those of its micro-batches, as with a smaller eval batch size"
        )
        warn_or_log(
            f"adapt split a {step} of {type(model).__name__} into micro-batches of its rows, whose {what}: "
            f"{'; '.join(reasons)}. The split step's {differ}. To {'train on' if training else 'compute'} the "
            "whole batch's, make the batch fit, or pass adapt minimum= the batch size: it then raises "
            "BatchSizeExhausted rather than split (docs/huggingface.rst, 'What cannot be made exact'). This "
            "warning is shown once.",
            UserWarning,
            stacklevel=levels_to_caller(),
        )

    def _in_batch(self, model: Any, inputs: Any) -> str | None:
        """Why a loss without labels that compares the batch's rows with each other is inexact, if it is one."""
        # CLIP's and its kin's (SigLIP, CLAP, ALIGN...): no label fields, and a return_loss argument that
        # asks for the loss over the batch's pairs; a micro-batch holds fewer of them (probe 71E).
        if getattr(self.trainer, "label_names", None) or field(inputs, "return_loss") is False:
            return None
        held = _outermost(model, self.transformers.PreTrainedModel) or [model]
        kinds = self.pairs
        for each in held:  # a signature per class, once: read at every split step until it warns
            if type(each) not in kinds:
                kinds[type(each)] = _takes_return_loss(type(each))
        if not any(kinds[type(each)] for each in held):
            return None
        return (
            "its model compares each row with the others a forward is given (a return_loss argument and no labels, "
            "as CLIP's and SigLIP's: their loss, and their logits per image and per text), and a micro-batch holds "
            "fewer of them"
        )

    def _mixed(self, inputs: Any) -> list[str]:
        """Why the batch's label fields weigh its rows otherwise than its micro-batches are weighed, if they do."""
        # Each tensor of the trainer's label_names besides the labels counted: a loss that adds a mean over its
        # items is weighed exactly only where its share of the batch is the weight's, row by row.
        others = [
            (name, value)
            for name in getattr(self.trainer, "label_names", None) or ()
            if name not in ("labels", "shift_labels")
            and isinstance(value := field(inputs, name), torch.Tensor)
            and value.dim()
        ]
        if not others:
            return []
        weighing = self.weighing
        counted = weighing.counted(self.trainer, inputs) if weighing.mode == ITEMS else None
        if counted is not None and counted.dim():
            rows = counted.shape[0]
            basis, per_row = "its labels that are not -100", weighing.kept(counted).reshape(rows, -1).sum(1)
        else:  # weighed by its rows
            first = _first(inputs)
            if first is None:
                return []
            rows = first.shape[0]
            basis, per_row = "its rows", torch.ones(rows, dtype=torch.long, device=first.device)
        unequal = []
        for name, value in others:
            if value.shape[0] != rows:
                continue
            items = value.ne(IGNORED).reshape(rows, -1).sum(1).to(per_row.device)
            # Each row's share of the batch is the same by both, whatever the split: items / total == per_row / all.
            if bool(items.sum()) and not bool((items * per_row.sum() == per_row * items.sum()).all()):
                unequal.append(repr(name))
        if not unequal:
            return []
        return [
            f"its batch holds label fields ({', '.join(unequal)}) whose items are not in proportion to {basis}, by "
            "which each micro-batch is weighed, and a loss that adds a mean over each (a pre-training head's "
            "masked tokens and next-sentence labels, say) would need a weight per mean"
        ]


def _router(model: Any, transformers: ModuleType) -> str | None:
    """Why a mixture of experts' router loss makes a split step inexact, if the model's config adds one."""
    for held in _outermost(model, transformers.PreTrainedModel) or [model]:
        config = getattr(held, "config", None)
        if getattr(config, "output_router_logits", False) and any(
            getattr(config, name, 0.0) for name in ("router_aux_loss_coef", "router_z_loss_coef")
        ):
            return (
                "its config adds a mixture of experts' router (load-balancing) loss (output_router_logits=True), "
                "which each forward computes over its own tokens, not the whole batch's"
            )
    return None
