"""Hugging Face: the parts of a split ``prediction_step``'s results that ``adapt`` joins itself, as the trainer would.

``accumulate`` joins a tensor with one entry per row of its chunk, and takes any other for a
value of the whole chunk: a mean, averaged over the chunks, or a count, added up. Labels are
targets, never values of the chunk: every label tensor of one dimension or more is set aside
at each chunk and the chunks' are concatenated along dim 0, in order, as the trainer joins its
batches (``nested_concat``): labels flattened over tokens (``labels.flatten()``) come back as the
whole batch's flattening. So are logits of integers that are not one entry per row (tokens
flattened, ``argmax(-1).flatten()``): a count per chunk of them would be a sum of token ids.
Parts that differ in size beyond dim 0 are padded at the end of those dimensions, as the
trainer pads its batches (see ``pad`` in :class:`Aside`; :func:`generated_pad` for generated tokens).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
from torch.utils._pytree import TreeSpec, tree_unflatten

from koila_retry._common.batches import Split
from koila_retry._common.results import flatten
from koila_retry._frontends.combine import padded_cat, padded_shape

__all__ = [
    "LABELS",
    "LOGITS",
    "Aside",
    "batch_rows",
    "generated_pad",
    "generation_state",
    "how_joined",
    "not_per_row",
    "one_per_row",
    "put_back",
    "several_per_row",
]

LOGITS, LABELS = "logits", "labels"


class Aside:
    """What one adapted ``prediction_step`` sets aside from its chunks' results and joins itself.

    Which leaves are set aside is decided at a step's first chunk, for all of its chunks and attempts alike;
    a chunk that starts at row 0 starts an attempt, and the last chunk of an attempt joins what was set
    aside, inside the attempt, where running out of memory is retried as any chunk's.
    """

    def __init__(self, pad: Callable[[], float | None]) -> None:
        # The value that pads parts which differ beyond dim 0, or None to leave torch.cat's error.
        self.pad = pad
        # Per part (LOGITS, LABELS), the indices of the leaves set aside and the part's structure.
        self.chosen: dict[str, list[int]] | None = None
        self.specs: dict[str, TreeSpec] = {}
        self.pieces: dict[tuple[str, int], list[torch.Tensor]] = {}
        self.joined: dict[tuple[str, int], torch.Tensor] = {}

    def start(self) -> None:
        """Forget the step before: the next chunk decides anew."""
        self.chosen, self.specs, self.pieces, self.joined = None, {}, {}, {}

    def drop(self) -> None:
        """Let go of the pieces of an attempt that failed."""
        self.pieces = {}

    def chunk(self, begin: int, rows: int, total: int, logits: Any, labels: Any) -> tuple[Any, Any]:
        """Take the leaves set aside out of a chunk's ``logits`` and ``labels`` (``None`` in their place)."""
        if begin == 0:  # an attempt starts: what an attempt that failed kept is dropped
            self.pieces, self.joined = {}, {}
        if self.chosen is None:
            self.chosen = {LOGITS: _integers_not_per_row(logits, rows), LABELS: _tensors(labels)}
        logits = self._taken(LOGITS, logits, rows)
        labels = self._taken(LABELS, labels, rows)
        if begin + rows >= total:
            self.joined = {key: self._concatenated(pieces) for key, pieces in self.pieces.items()}
            self.pieces = {}
        return logits, labels

    def restored(self, part: str, value: Any) -> Any:
        """Put the joined leaves back into the combined ``value`` of ``part``."""
        spec = self.specs.get(part)
        if spec is None:
            return value
        leaves = [None] * spec.num_leaves if value is None else flatten(value)[0]
        for index in _indices(self.chosen, part):
            leaves[index] = self.joined[(part, index)]
        return tree_unflatten(leaves, spec)

    def concatenated(self, part: str) -> list[int]:
        """The indices of the leaves of ``part`` that were set aside and concatenated in the step."""
        return _indices(self.chosen, part) if part in self.specs else []

    def _taken(self, part: str, value: Any, rows: int) -> Any:
        indices = _indices(self.chosen, part)
        if not indices or value is None:
            return value
        leaves, spec = flatten(value)
        if max(indices) >= len(leaves):  # another structure than the first chunk's: accumulate names it
            return value
        for index in indices:
            leaf = leaves[index]
            if not isinstance(leaf, torch.Tensor) or not leaf.dim():
                found = f"shape {tuple(leaf.shape)}" if isinstance(leaf, torch.Tensor) else type(leaf).__name__
                raise ValueError(
                    f"adapt's prediction_step joins the {part} tensor at leaf {index} of the batch's first chunk "
                    f"by concatenating the chunks' along dim 0, and a chunk of {rows} rows returned {found} there: "
                    f"return a tensor of one dimension or more there in every batch"
                )
            self.pieces.setdefault((part, index), []).append(leaf.detach())
            leaves[index] = None
        self.specs[part] = spec
        return tree_unflatten(leaves, spec)

    def _concatenated(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        if len(pieces) == 1:
            return pieces[0]
        # As the trainer's nested_concat pads batches: each piece at the start of every dimension past the rows.
        shape = padded_shape(pieces, 0)
        value = None if shape is None else self.pad()
        if shape is None or value is None:
            return torch.cat(pieces)  # its own error names the sizes that differ
        return padded_cat(pieces, 0, shape, value)


def _indices(chosen: dict[str, list[int]] | None, part: str) -> list[int]:
    """The indices of the leaves of ``part`` set aside: none before a step's first chunk decided."""
    return [] if chosen is None else chosen[part]


def not_per_row(value: Any, rows: int) -> list[torch.Tensor]:
    """The tensors of ``value`` that are not one entry per row of ``rows`` along their first dimension."""
    return [leaf for leaf in flatten(value)[0] if isinstance(leaf, torch.Tensor) and leaf.shape[:1] != (rows,)]


def how_joined(part: str, leaf: torch.Tensor, concatenated: bool) -> str:
    """Say what a split prediction step made of a tensor of its results that is not one entry per row."""
    tensor = f"the {part} tensor of shape {tuple(leaf.shape)} and dtype {leaf.dtype}"
    if concatenated:
        return (
            f"{tensor} was joined by concatenating the chunks' along dim 0, as the trainer joins its batches: "
            "the whole batch's where it holds the rows' entries one row after another (a tensor per token, "
            "flattened), not otherwise"
        )
    if leaf.is_floating_point() or leaf.is_complex():
        return (
            f"{tensor} was taken for a value of the whole chunk (an MoE model's aux_loss, say), and the chunks' "
            "were averaged, weighed by rows: it is not the whole batch's"
        )
    return (
        f"{tensor} was taken for a count of the whole chunk, and the chunks' were added up: it is not the whole batch's"
    )


def _integers_not_per_row(logits: Any, rows: int) -> list[int]:
    """The leaves of ``logits`` of integers (or flags) of one dimension or more that are not one entry per row."""
    if logits is None:
        return []
    return [
        index
        for index, leaf in enumerate(flatten(logits)[0])
        if isinstance(leaf, torch.Tensor)
        and leaf.dim()
        and leaf.shape[0] != rows
        and not (leaf.is_floating_point() or leaf.is_complex())
    ]


def _tensors(labels: Any) -> list[int]:
    """The leaves of ``labels`` that are tensors of one dimension or more."""
    if labels is None:
        return []
    return [index for index, leaf in enumerate(flatten(labels)[0]) if isinstance(leaf, torch.Tensor) and leaf.dim()]


def generated_pad(trainer: Any, generating: dict[str, Any]) -> float | None:
    """The token that pads a ``Seq2SeqTrainer``'s generated tokens, or ``None`` for a trainer that generates none."""
    # Each chunk of a split prediction step generates as long as its own longest row: joined, the
    # shorter are padded where the whole batch's generate padded its shorter rows, with generate's pad
    # token, else its first EOS token (the trainer's gen_kwargs first, then the model's generation
    # config); else the trainer's own pad token.
    if not getattr(trainer.args, "predict_with_generate", False):
        return None
    given = generating or getattr(trainer, "_gen_kwargs", None) or {}  # a call's replace the trainer's
    configs = (given.get("generation_config"), getattr(trainer.model, "generation_config", None))
    for name in ("pad_token_id", "eos_token_id"):
        token = given.get(name)
        for config in configs:
            token = getattr(config, name, None) if token is None else token
        if isinstance(token, (list, tuple)):
            token = token[0] if token else None
        if token is not None:
            return cast(float, token)
    padded = getattr(trainer, "_pad_tensors_to_max_len", None)
    if not callable(padded):
        return None
    try:  # the trainer's own choice: its tokenizer's pad (or EOS) token, else the model config's pad token
        return cast(float, padded(torch.zeros((1, 0), dtype=torch.long), 1).item())
    except ValueError:  # none: the chunks' tokens are not joined (torch.cat's error)
        return None


def generation_state(trainer: Any) -> tuple[Any, Any, dict[str, Any]] | None:
    """Return the model a ``Seq2SeqTrainer`` generates with, its generation config and that config's state; or None."""
    # Its prediction step changes the config after its first generate (max_length filled in from the
    # defaults): a retry, or a chunk after the first, would generate by another config than the batch's.
    if not getattr(trainer.args, "predict_with_generate", False):
        return None
    model = trainer.model
    config = getattr(model, "generation_config", None)
    state = getattr(config, "__dict__", None)
    return (model, config, copy.deepcopy(state)) if isinstance(state, dict) else None


def put_back(held: tuple[Any, Any, dict[str, Any]]) -> None:
    """Give the model :func:`generation_state` found its generation config back, with the state it had."""
    model, config, state = held
    # A step of the user's may have swapped in a config of its own, or another model (an average's): the
    # model is given back its own, and another model keeps its own.
    if model.generation_config is not config:
        model.generation_config = config
    vars(config).clear()
    vars(config).update(copy.deepcopy(state))


def batch_rows(args: tuple[Any, ...]) -> int | None:
    """The rows that accumulate splits a prediction step's arguments into, or ``None`` where it cannot split them."""
    inputs = args[1]
    if isinstance(inputs, Mapping):  # the usual batch: its first tensor that does not broadcast
        for value in inputs.values():
            if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] != 1:
                return int(value.shape[0])
    try:  # as accumulate finds them
        return Split(args, {}, 0, "koila_retry.integrations.transformers.adapt").rows
    except (ValueError, TypeError, RuntimeError, AttributeError):  # accumulate raises its own error
        return None


def one_per_row(value: Any, rows: int) -> bool:
    """Whether ``value`` is a tensor of one entry per row of ``rows`` along its first dimension."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows


def several_per_row(tokens: Any, rows: int | None) -> bool:
    """Whether ``tokens`` hold several sequences for each of ``rows`` rows, one after another."""
    if not isinstance(tokens, torch.Tensor) or not rows or tokens.dim() < 2:
        return False
    return tokens.shape[0] != rows and tokens.shape[0] % rows == 0
