"""koila_retry.integrations.transformers.adapt: a real Hugging Face Trainer, tiny GPT-2, no downloads."""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools
import gc
import importlib.util
import inspect
import json
import subprocess
import sys
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, cast

import pytest
import torch

import koila_retry as koila
from koila_retry import BatchSizeExhausted
from koila_retry.testing import make_oom, simulated_device

transformers = pytest.importorskip("transformers")
from _hf_trainer import (  # noqa: E402 (after the skip)
    VOCAB,
    CausalWrapper,
    MeanLoss,
    Pairs,
    Rows,
    SummedLoss,
    assert_same_training,
    collate,
    collate_pairs,
    float64_gpt2,
    float64_loss_func,
    injected,
    logged,
    make_seq2seq_trainer,
    make_trainer,
    mean_loss_func,
    shifted_cross_entropy,
    summed_loss_func,
    tiny_gpt2,
)
from _layers import RaiseInBackward, WatchFreed  # noqa: E402

from koila_retry.integrations.transformers import adapt  # noqa: E402

# The whole batch of 8 padded rows needs more than this for a training step; 4 rows fit.
TRAIN_LIMIT = "1MiB"


@pytest.fixture(autouse=True)
def no_mixed_precision_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers 4 leaves a bf16 or fp16 trainer's precision in os.environ, for every later trainer."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The plain trainer, with all the memory it wants."""
    trainer = make_trainer(tmp_path_factory.mktemp("reference"))
    trainer.train()
    return trainer


def test_the_plain_trainer_runs_out_of_memory_at_the_limit(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path)
    with simulated_device(TRAIN_LIMIT), pytest.raises(torch.OutOfMemoryError):
        trainer.train()


def test_an_adapted_trainer_trains_as_with_all_the_memory(tmp_path: Path, reference: Any) -> None:
    trainer = adapt(make_trainer(tmp_path))
    assert trainer.args.max_grad_norm == 0.5
    with simulated_device(TRAIN_LIMIT):
        trainer.train()
    stats = trainer.training_step.stats
    assert stats.ooms >= 1
    assert stats.batch_size < 8  # it ran micro-batches
    assert trainer.args.per_device_train_batch_size == 8
    assert trainer.args.gradient_accumulation_steps == 1
    assert_same_training(trainer, reference)


def test_the_steps_statistics_count_every_step_in_one_object(tmp_path: Path) -> None:
    # Three accumulators weigh micro-batches three ways; the wrapper showed the Stats of whichever ran last.
    trainer = adapt(make_trainer(tmp_path))
    stats = trainer.training_step.stats
    trainer.train()  # with memory to spare: 3 steps run whole
    assert (stats.calls, stats.ooms) == (3, 0)
    with simulated_device(TRAIN_LIMIT):
        trainer.train()  # 3 more, split
    assert trainer.training_step.stats is stats
    assert stats.calls == 6
    assert stats.ooms >= 1
    assert stats.batch_size < 8
    predicted = trainer.prediction_step.stats
    trainer.evaluate()
    assert trainer.prediction_step.stats is predicted
    assert predicted.calls >= 1


def test_gradient_accumulation_windows_are_kept(tmp_path: Path) -> None:
    reference = make_trainer(tmp_path, gradient_accumulation_steps=2, per_device_train_batch_size=4)
    reference.train()
    trainer = adapt(make_trainer(tmp_path, gradient_accumulation_steps=2, per_device_train_batch_size=4))
    with simulated_device("512KiB"):  # 4 rows do not fit at once, 2 do
        trainer.train()
    assert trainer.training_step.stats.ooms >= 1
    assert trainer.args.gradient_accumulation_steps == 2
    assert_same_training(trainer, reference)


class Detector(torch.nn.Module):
    """A box per image, each scored against its own image's targets, paired by position as DETR pairs them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.head = torch.nn.Linear(8, 4)
        self.seen: list[list[int]] = []  # per forward: the first box of each image's targets, as ids

    def forward(self, pixel_values: torch.Tensor, labels: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        boxes = self.head(torch.relu(self.conv(pixel_values)).mean((2, 3)))
        self.seen.append([int(target["class_labels"][0]) for target in labels])
        losses = [torch.nn.functional.l1_loss(box, target["boxes"].mean(0)) for box, target in zip(boxes, labels)]
        return {"loss": torch.stack(losses).mean(), "pred_boxes": boxes}


class Images(torch.utils.data.Dataset[dict[str, Any]]):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(1)
        self.images = torch.randn(16, 3, 32, 32, generator=generator)
        self.boxes = [torch.rand(1 + index % 3, 4, generator=generator) for index in range(16)]

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> dict[str, Any]:
        boxes = self.boxes[index]
        labels = {"class_labels": torch.full((len(boxes),), index), "boxes": boxes}
        return {"pixel_values": self.images[index], "labels": labels}


def detection_trainer(tmp_path: Path) -> Any:
    """A trainer whose batches hold one dict of targets per image, as Hugging Face's detection models take them."""

    def collate(items: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "pixel_values": torch.stack([item["pixel_values"] for item in items]),
            "labels": [i["labels"] for i in items],
        }

    trainer = make_trainer(tmp_path, model=Detector(), max_steps=2, remove_unused_columns=False)
    trainer.train_dataset, trainer.data_collator = Images(), collate
    return trainer


def test_a_detection_batch_is_split_with_each_images_own_targets(tmp_path: Path) -> None:
    reference = detection_trainer(tmp_path / "plain")
    reference.train()
    trainer = adapt(detection_trainer(tmp_path / "adapted"))
    with simulated_device("600KiB"):  # 8 images do not fit a step, 4 do
        trainer.train()
    assert trainer.training_step.stats.ooms >= 1
    # Each micro-batch saw its own images' targets: all eight were passed to every one, paired by position.
    assert min(len(seen) for seen in trainer.model.seen) < 8
    assert_same_training(trainer, reference)


def _with_patches(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The batch with a vision model's patches: two rows of pixel_values per example, not one."""
    batch = collate(rows)
    batch["pixel_values"] = torch.ones(2 * len(rows), 3)
    return batch


class _PatchTrainer(transformers.Trainer):  # type: ignore[misc]
    def compute_loss(
        self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        inputs = dict(inputs)
        image_term = inputs.pop("pixel_values").mean() * 0
        counted = {} if num_items_in_batch is None else {"num_items_in_batch": num_items_in_batch}  # 4.46 on
        return model(**inputs, **counted).loss + image_term


def _patch_trainer(path: Path, model: Any = None) -> Any:
    return make_trainer(
        path, _PatchTrainer, model=model, data_collator=_with_patches, remove_unused_columns=False, max_steps=2
    )


def test_a_batch_whose_tensors_do_not_share_rows_runs_whole_and_gives_up_saying_why(tmp_path: Path) -> None:
    # Every step adapt sent through accumulate (a hook on a parameter here) raised Split's ValueError, and a
    # step that ran out of memory gave it in place of the out-of-memory error (probe 76A).
    reference = _patch_trainer(tmp_path / "plain")
    reference.train()
    hooked = tiny_gpt2()
    hooked.lm_head.weight.register_hook(lambda gradient: gradient)
    trainer = adapt(_patch_trainer(tmp_path / "hooked", hooked))
    trainer.train()
    assert_same_training(trainer, reference)

    failing = tiny_gpt2()
    failing.register_forward_pre_hook(lambda module, args, kwargs: _fails_above(4, kwargs), with_kwargs=True)
    before = [parameter.detach().clone() for parameter in failing.parameters()]
    trainer = adapt(_patch_trainer(tmp_path / "failing", failing))
    step = r"^adapt\(\) cannot split the batch of _PatchTrainer\.training_step, a dict: every"
    with pytest.raises(BatchSizeExhausted, match=step) as caught:
        trainer.train()
    assert isinstance(caught.value.__cause__, BatchSizeExhausted)
    assert "the tensor inputs['pixel_values'] has 16" in str(caught.value)
    assert "share their rows along dim 0 (one entry per example), in the data collator" in str(caught.value)
    assert all(torch.equal(mine, was) for mine, was in zip(failing.parameters(), before, strict=True))
    with pytest.raises(
        BatchSizeExhausted, match=r"^adapt\(\) cannot split the batch of _PatchTrainer\.prediction_step"
    ):
        trainer.evaluate()


def _fails_above(rows: int, kwargs: dict[str, Any]) -> None:
    if kwargs["input_ids"].shape[0] > rows:
        raise make_oom()


def _finder_recognises_our_give_up() -> bool:
    """Whether accelerate's finder takes any error with " out of memory." for one (1.x; 0.26 looks for CUDA's words)."""
    from accelerate.utils.memory import should_reduce_batch_size

    return bool(should_reduce_batch_size(RuntimeError("step: out of memory. Every batch size tried failed (4)")))


@pytest.mark.skipif(not _finder_recognises_our_give_up(), reason="this accelerate's finder looks for CUDA's words only")
def test_auto_find_batch_size_answers_a_give_up_at_the_minimum_with_a_smaller_batch(tmp_path: Path) -> None:
    limit = "540KiB"  # 8 rows and 4 rows do not fit a step, 2 rows do
    reference = make_trainer(tmp_path / "plain", auto_find_batch_size=True)
    with simulated_device(limit):
        reference.train()
    assert reference._train_batch_size == 2
    trainer = adapt(make_trainer(tmp_path / "adapted", auto_find_batch_size=True), minimum=4)
    with simulated_device(limit):
        trainer.train()  # 8 rows give up at 4 (the minimum); the finder restarts at 4, which gives up; then 2
    assert trainer._train_batch_size == 2
    assert_same_training(trainer, reference)


def test_a_mean_loss_without_num_items_in_batch_is_weighed_by_tokens(tmp_path: Path) -> None:
    """With model_accepts_loss_kwargs off, HF divides each batch's token mean by its accumulation steps."""
    reference = make_trainer(tmp_path, gradient_accumulation_steps=2, per_device_train_batch_size=4)
    reference.model_accepts_loss_kwargs = False
    reference.train()
    trainer = make_trainer(tmp_path, gradient_accumulation_steps=2, per_device_train_batch_size=4)
    trainer.model_accepts_loss_kwargs = False
    adapt(trainer)
    with simulated_device("512KiB"):
        trainer.train()
    assert trainer.training_step.stats.ooms >= 1
    assert_same_training(trainer, reference)


# A custom loss in each documented form: one that ignores num_items_in_batch and returns the batch's
# mean, and one that divides its sum by it, as compute_loss and as compute_loss_func.
LOSSES: dict[str, dict[str, Any]] = {
    "compute_loss returning a mean": {"cls": MeanLoss},
    "compute_loss using num_items_in_batch": {"cls": SummedLoss},
    "compute_loss_func returning a mean": {"compute_loss_func": mean_loss_func},
    "compute_loss_func using num_items_in_batch": {"compute_loss_func": summed_loss_func},
}


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("loss", list(LOSSES))
def test_a_custom_loss_split_gives_what_the_plain_trainer_gives(tmp_path: Path, loss: str, accumulation: int) -> None:
    """Whether a custom loss uses num_items_in_batch or not, a split step (and evaluation) is the whole one's.

    With gradient accumulation, a mean loss is its batch's mean and a summed one is over the window's count:
    the two are weighed differently, and the plain trainer is the reference of both.
    """
    if (
        "compute_loss_func" in LOSSES[loss]
        and "compute_loss_func" not in inspect.signature(transformers.Trainer).parameters
    ):
        pytest.skip(f"Trainer takes compute_loss_func from transformers 4.46 on, not {transformers.__version__}")
    rows = 8 // accumulation
    settings = {**LOSSES[loss], "gradient_accumulation_steps": accumulation, "per_device_train_batch_size": rows}
    _split_as_the_plain_trainer(tmp_path, settings)


def _split_as_the_plain_trainer(tmp_path: Path, settings: dict[str, Any], collator: Any = None) -> None:
    """Evaluate and train a plain trainer, then an adapted one under limits that split both: the same results."""
    reference = make_trainer(tmp_path, **settings)
    if collator is not None:
        reference.data_collator = collator
    expected = reference.evaluate()["eval_loss"]
    reference.train()
    trainer = adapt(make_trainer(tmp_path, **settings))
    if collator is not None:
        trainer.data_collator = collator
    with simulated_device("128KiB"):
        evaluated = trainer.evaluate()["eval_loss"]
    with simulated_device(TRAIN_LIMIT if settings["gradient_accumulation_steps"] == 1 else "512KiB"):
        trainer.train()
    assert trainer.prediction_step.stats.ooms >= 1
    assert trainer.training_step.stats.ooms >= 1
    assert trainer.training_step.stats.batch_size < settings["per_device_train_batch_size"]
    assert_same_training(trainer, reference)
    assert evaluated == pytest.approx(expected, rel=1e-6)


@dataclasses.dataclass
class DictLike:
    """A batch that is not a Mapping but answers ``in`` and ``[]``, as Hugging Face's Trainer reads its labels."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor

    def keys(self) -> list[str]:
        return [field.name for field in dataclasses.fields(self)]

    def items(self) -> list[tuple[str, torch.Tensor]]:
        return [(key, self[key]) for key in self.keys()]

    def __len__(self) -> int:
        return len(self.keys())

    def __contains__(self, key: object) -> bool:
        return key in self.keys()

    def __getitem__(self, key: str) -> torch.Tensor:
        return cast(torch.Tensor, getattr(self, key))

    def get(self, key: str, default: Any = None) -> Any:  # Trainer.prediction_step's
        return getattr(self, key) if key in self.keys() else default


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("cls", [MeanLoss, SummedLoss], ids=["a mean", "a sum over num_items_in_batch"])
def test_a_batch_that_is_not_a_mapping_is_weighed_by_its_labels(tmp_path: Path, cls: Any, accumulation: int) -> None:
    """HF counts the labels of any batch that answers ``in`` and ``[]``: so does the split, mean or sum.

    The labels were looked for in a Mapping only: such a batch's micro-batches were added up unweighted,
    and a mean loss came out as the sum of the micro-batches' means. A sum over the count adds up either
    way: its variants check that weighing by labels keeps it exact.
    """
    settings = {
        "cls": cls,
        "gradient_accumulation_steps": accumulation,
        "per_device_train_batch_size": 8 // accumulation,
    }
    _split_as_the_plain_trainer(tmp_path, settings, lambda rows: DictLike(**collate(rows)))


class FlatLogits(MeanLoss):
    """Logits flattened over tokens, (rows * tokens, vocabulary), as an MoE model's router logits are."""

    def compute_loss(
        self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        outputs = model(**inputs)
        flat = (outputs.logits.flatten(0, 1), (outputs.logits[..., :4].flatten(0, 1),))  # nested, as per layer
        return (outputs.loss, {"loss": outputs.loss, "flat": flat}) if return_outputs else outputs.loss


class ChunkValue(MeanLoss):
    """Logits and a value of the whole batch beside them, as an MoE model's ``aux_loss`` is."""

    def compute_loss(
        self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        outputs = model(**inputs)
        found = {"loss": outputs.loss, "logits": outputs.logits, "aux": outputs.logits.mean((0, 1))[:3]}
        return (outputs.loss, found) if return_outputs else outputs.loss


@pytest.mark.parametrize(
    "cls", [MeanLoss, FlatLogits, ChunkValue], ids=["logits per row", "logits per token", "a value of the batch"]
)
def test_a_split_evaluation_joins_logits_per_row_or_token_and_warns_of_others(tmp_path: Path, cls: Any) -> None:
    """Logits per row or per token of the rows are the whole batch's; any other is averaged, warned of once.

    Logits flattened over tokens (an MoE model's router logits) were taken for a value of each chunk and
    averaged over the chunks, and warned of: they are joined now, as the trainer joins its batches.
    """
    expected = make_trainer(tmp_path, cls).predict(make_trainer(tmp_path).eval_dataset)
    trainer = adapt(make_trainer(tmp_path, cls))
    with warnings.catch_warnings(record=True) as caught, simulated_device("256KiB"):
        warnings.simplefilter("always")
        first = trainer.predict(trainer.eval_dataset)  # evaluate() asks for the loss alone, without compute_metrics
        second = trainer.predict(trainer.eval_dataset)
    assert trainer.prediction_step.stats.ooms >= 1
    assert trainer.prediction_step.stats.batch_size < 8
    said = [str(warning.message) for warning in caught if "not one entry per row" in str(warning.message)]
    if cls is ChunkValue:
        assert len(said) == 1, said
        assert "keys_to_ignore_at_inference" in said[0]
        assert "(3,)" in said[0]
        assert "the chunks' were averaged, weighed by rows" in said[0]  # what was done with it
    else:
        assert said == []
        for found in (first, second):
            torch.testing.assert_close(found.predictions, expected.predictions, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(found.metrics["test_loss"], expected.metrics["test_loss"], rtol=1e-5, atol=0)


class Layers(tuple):  # type: ignore[type-arg]
    """A tuple subclass around router logits, which torch's pytree takes for one leaf."""


class OddOutputs(MeanLoss):
    """Out of memory above 4 rows; logits per token in a tuple subclass, or a table of the first chunk's size."""

    table = False
    capped = True
    first_size: int | None = None

    def compute_loss(
        self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        ids = inputs["input_ids"]
        if self.capped and len(ids) > 4:
            raise torch.OutOfMemoryError("more than 4 rows")
        outputs = model(**inputs)
        found: dict[str, Any] = {"loss": outputs.loss, "logits": outputs.logits}
        if self.table:  # of the whole batch, as many rows as the first chunk's tokens: it fits that chunk only
            self.first_size = self.first_size or ids.numel()
            found["table"] = outputs.logits.mean((0, 1))[:2].expand(self.first_size, 2)
        else:
            found["router"] = Layers((outputs.logits[..., :4].flatten(0, 1),))
        return (outputs.loss, found) if return_outputs else outputs.loss


def test_logits_per_token_in_a_tuple_subclass_are_joined_by_row(tmp_path: Path) -> None:
    """torch's pytree took a tuple subclass for a leaf: its logits per token were not folded (probe 61D)."""
    expected = make_trainer(tmp_path, OddOutputs, per_device_eval_batch_size=7)
    expected.capped = False
    found = expected.predict(expected.eval_dataset)
    trainer = adapt(make_trainer(tmp_path, OddOutputs, per_device_eval_batch_size=7))  # batches of 7 and 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        split = trainer.predict(trainer.eval_dataset)
    assert trainer.prediction_step.stats.ooms == 1
    assert [str(warning.message) for warning in caught if "per row" in str(warning.message)] == []
    (logits, router), (expected_logits, expected_router) = split.predictions, found.predictions
    torch.testing.assert_close(torch.from_numpy(logits), torch.from_numpy(expected_logits), rtol=1e-5, atol=1e-6)
    assert router[0].shape[0] > 8  # one entry per token
    torch.testing.assert_close(torch.from_numpy(router[0]), torch.from_numpy(expected_router[0]), rtol=1e-5, atol=1e-6)


def test_a_value_of_the_batch_that_fits_one_chunks_tokens_is_refused_clearly(tmp_path: Path) -> None:
    """One chunk decides what is folded, for every chunk and attempt: a misfit is a clear error, not an IndexError.

    The fold was decided chunk by chunk: a tensor folded in an attempt that failed stayed marked, and the
    step that then succeeded raised IndexError, or flattened a value of the whole batch (probe 61D).
    """
    trainer = adapt(make_trainer(tmp_path, OddOutputs, per_device_eval_batch_size=7))
    trainer.table = True
    said = r"entry per token of the rows \(\d+ per row\) at the batch's first chunk, and a chunk of 3 rows"
    with pytest.raises(ValueError, match=said):
        trainer.predict(trainer.eval_dataset)


def test_a_float64_model_split_keeps_its_precision(tmp_path: Path) -> None:
    """Each micro-batch's num_items_in_batch is its share of the count in float64 here, not rounded to float32."""
    if "compute_loss_func" not in inspect.signature(transformers.Trainer).parameters:
        pytest.skip(f"Trainer takes compute_loss_func from transformers 4.46 on, not {transformers.__version__}")
    reference = make_trainer(tmp_path, model=float64_gpt2(), compute_loss_func=float64_loss_func)
    reference.train()
    # Out of memory in the forward of the first whole batch: every later step runs in micro-batches.
    trainer = adapt(make_trainer(tmp_path, model=float64_gpt2({0: "forward"}), compute_loss_func=float64_loss_func))
    trainer.train()
    assert trainer.training_step.stats.ooms == 1
    assert trainer.training_step.stats.batch_size < 8
    torch.testing.assert_close(logged(trainer, "grad_norm"), logged(reference, "grad_norm"), rtol=1e-13, atol=0)
    for (name, mine), (_, theirs) in zip(trainer.model.named_parameters(), reference.model.named_parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-13, atol=1e-15, msg=name)


def test_a_module_around_a_causal_lm_is_weighed_by_its_shifted_labels(tmp_path: Path) -> None:
    """A plain module that wraps a causal LM and returns a tuple: its loss averages over the shifted labels.

    The rows' lengths differ (2 to 23 tokens, the rest -100), so each row's shifted count is its
    count less one, a share of the batch that differs from its unshifted one.
    """
    reference = make_trainer(tmp_path, model=CausalWrapper())
    assert not getattr(reference, "model_accepts_loss_kwargs", False)  # no num_items_in_batch: they are weighed
    expected = reference.evaluate()["eval_loss"]
    reference.train()
    trainer = adapt(make_trainer(tmp_path, model=CausalWrapper()))
    with simulated_device("128KiB"):
        evaluated = trainer.evaluate()["eval_loss"]
    with simulated_device(TRAIN_LIMIT):
        trainer.train()
    assert trainer.prediction_step.stats.ooms >= 1
    assert trainer.training_step.stats.ooms >= 1
    assert trainer.training_step.stats.batch_size < 8
    assert_same_training(trainer, reference)
    assert evaluated == pytest.approx(expected, rel=1e-6)


class PlainLM(torch.nn.Module):
    """A causal LM of plain modules (nanoGPT's kind): no Hugging Face model tells that its loss shifts the labels."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding, self.head = torch.nn.Embedding(VOCAB, 64), torch.nn.Linear(64, VOCAB)

    def forward(self, input_ids: Any, attention_mask: Any = None, labels: Any = None) -> dict[str, torch.Tensor]:
        logits = self.head(torch.tanh(self.embedding(input_ids)))
        return {"loss": shifted_cross_entropy(logits, labels), "logits": logits}


class TypedLM(PlainLM):
    loss_type = "ForCausalLM"  # as Hugging Face's models name their loss, and its Trainer reads it


@pytest.mark.parametrize("answer", ["trainer's", "model's alone"])  # the latter as transformers 4 has it
def test_a_plain_causal_lm_that_names_its_loss_is_weighed_by_its_shifted_labels(tmp_path: Path, answer: str) -> None:
    if importlib.util.find_spec("transformers.loss") is None:
        pytest.skip(f"models name their loss (loss_type) from transformers 4.46 on, not {transformers.__version__}")
    reference = make_trainer(tmp_path, model=TypedLM())
    reference.train()
    trainer = make_trainer(tmp_path, model=TypedLM())
    if answer != "trainer's":
        trainer._loss_shifts_labels = False
    trainer = adapt(trainer)
    with simulated_device("150KiB"), warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.train()
    assert trainer.training_step.stats.batch_size < 8
    assert_same_training(trainer, reference)


class _OwnConfig(transformers.PretrainedConfig):  # type: ignore[misc]
    model_type = "own-lm"


class _OwnPretrained(transformers.PreTrainedModel):  # type: ignore[misc]
    """A causal LM of the user's own on PreTrainedModel alone: neither a loss type nor an architecture tells."""

    config_class = _OwnConfig

    def __init__(self, config: Any = None) -> None:
        super().__init__(config or _OwnConfig())
        self.lm = PlainLM()

    def forward(self, input_ids: Any, attention_mask: Any = None, labels: Any = None) -> dict[str, torch.Tensor]:
        return cast("dict[str, torch.Tensor]", self.lm(input_ids, attention_mask, labels))


@pytest.mark.parametrize("model", [PlainLM, _OwnPretrained])
def test_a_model_whose_loss_nothing_names_is_warned_of_when_split(tmp_path: Path, model: Any) -> None:
    """Its labels are counted as they are, as a token classifier's loss averages over them: a causal LM's is not.

    A PreTrainedModel of the user's own was taken for one of unshifted labels, silently (probe 77F).
    """
    trainer = adapt(make_trainer(tmp_path, model=model()))
    with simulated_device("150KiB"), pytest.warns(UserWarning, match="whose loss type nothing tells") as caught:
        trainer.train()
    assert trainer.training_step.stats.batch_size < 8
    assert len([w for w in caught if "whose loss type nothing tells" in str(w.message)]) == 1
    assert "loss_type = 'ForCausalLM'" in str(caught[0].message)


def test_label_smoothing_split_gives_what_the_plain_trainer_gives(tmp_path: Path) -> None:
    """Trainer's label smoother computes the loss from the logits, shifted for a causal LM, over the count if given."""
    reference = make_trainer(tmp_path, label_smoothing_factor=0.1)
    reference.train()
    trainer = adapt(make_trainer(tmp_path, label_smoothing_factor=0.1))
    with simulated_device(TRAIN_LIMIT):
        trainer.train()
    assert trainer.training_step.stats.ooms >= 1
    assert trainer.training_step.stats.batch_size < 8
    assert_same_training(trainer, reference)


class _SmoothedWrapper(CausalWrapper):
    """A module around a causal LM with a config, as label smoothing needs: the smoother goes by its class name."""

    def __init__(self) -> None:
        super().__init__()
        self.config = self.lm.config


class _MyLM(transformers.GPT2LMHeadModel):  # type: ignore[misc]  # transformers is untyped
    """A causal LM under a class name of its own, with no loss keywords: its mean loss shifts as GPT-2's does."""

    def forward(self, input_ids: Any, attention_mask: Any = None, labels: Any = None) -> Any:
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels, use_cache=False)


def _my_lm() -> Any:
    reference = tiny_gpt2()
    model = _MyLM(reference.config)
    model.load_state_dict(reference.state_dict())
    return model


@pytest.mark.parametrize(
    ("model", "options", "cls"),
    [
        # The trainer's label smoother computes the loss: it shifts only for a class it names a causal LM,
        # which the wrapper is not, though it holds one.
        pytest.param(_SmoothedWrapper, {"label_smoothing_factor": 0.1}, None, id="label smoothing over a wrapper"),
        # The model's own loss, a mean: an unknown class name's loss is a causal LM's in transformers.
        pytest.param(_my_lm, {}, None, id="a subclass of a causal LM"),
        # A compute_loss of its own never runs the label smoother: the model's loss is the one.
        pytest.param(_my_lm, {"label_smoothing_factor": 0.1}, MeanLoss, id="label smoothing, compute_loss overridden"),
    ],
)
def test_the_labels_are_counted_as_the_loss_that_runs_counts_them(
    tmp_path: Path, model: Callable[[], Any], options: dict[str, Any], cls: Any
) -> None:
    reference = make_trainer(tmp_path, cls, model=model(), **options)
    assert not getattr(reference, "model_accepts_loss_kwargs", False)  # no num_items_in_batch: a mean, weighed
    expected = reference.evaluate()["eval_loss"]
    reference.train()
    trainer = adapt(make_trainer(tmp_path, cls, model=model(), **options))
    with simulated_device("128KiB"):
        evaluated = trainer.evaluate()["eval_loss"]
    with simulated_device(TRAIN_LIMIT):
        trainer.train()
    assert trainer.prediction_step.stats.ooms >= 1
    assert trainer.training_step.stats.batch_size < 8
    assert_same_training(trainer, reference)
    assert evaluated == pytest.approx(expected, rel=1e-6)


def test_reentrant_gradient_checkpointing_split_gives_what_the_plain_trainer_gives(tmp_path: Path) -> None:
    """Each layer's own backward writes its parameters out of the graph's sight: they are found through the layer.

    transformers 5 checkpoints ``partial(forward, layer, **kwargs)``; before, a layer's bound ``__call__``.
    """
    fields = {field.name for field in dataclasses.fields(transformers.TrainingArguments)}
    name = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    options = {name: True, f"{name}_kwargs": {"use_reentrant": True}}
    reference = make_trainer(tmp_path, **options)
    reference.train()
    trainer = adapt(make_trainer(tmp_path, **options))
    # A limit where a step's backward fails after a checkpointed layer's own backward wrote its gradients.
    with simulated_device("500KiB"), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # not "cannot be found" (a checkpointed function)
        trainer.train()
    assert trainer.training_step.stats.ooms >= 1
    assert trainer.training_step.stats.batch_size < 8
    assert_same_training(trainer, reference)


# transformers before 4.41 autocasts through torch.cpu.amp.autocast, which torch deprecates.
@pytest.mark.filterwarnings("ignore:`torch.cpu.amp.autocast\\(args...\\)` is deprecated:FutureWarning")
def test_bf16_mixed_precision_on_the_cpu(tmp_path: Path) -> None:
    try:
        reference = make_trainer(tmp_path, bf16=True)
        reference.train()
    except (ValueError, RuntimeError) as error:  # pragma: no cover - depends on the CPU and build
        pytest.skip(f"bf16 autocast does not run on this CPU: {error}")
    trainer = adapt(make_trainer(tmp_path, bf16=True))
    with simulated_device("512KiB"):  # bf16 activations take half the memory
        trainer.train()
    assert trainer.training_step.stats.ooms >= 1
    # bf16 matmuls round differently over fewer rows: close, not equal to float32 rounding.
    assert trainer.state.global_step == reference.state.global_step
    torch.testing.assert_close(logged(trainer, "loss"), logged(reference, "loss"), rtol=1e-2, atol=1e-2)
    for mine, theirs in zip(trainer.model.parameters(), reference.model.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-2, atol=1e-3)


def test_fp16_loss_scaling_is_applied_to_each_micro_batch_and_undone_once(tmp_path: Path) -> None:
    """accelerate makes no GradScaler on a CPU; one given to the accelerator before training stands in.

    Every micro-batch's backward must run on the scaled loss (through accelerator.backward), and the
    optimizer unscale once: a micro-batch left unscaled, or scaled twice, moves the weights 1024 times
    too little or too far. No clipping, which would hide that.
    """

    def scaled_trainer() -> Any:
        try:
            trainer = make_trainer(tmp_path, fp16=True, max_grad_norm=0.0)
        except ValueError as error:
            if "can only be used on CUDA" not in str(error):
                raise
            pytest.skip(f"transformers before 4.42 refuses fp16 on the CPU ({transformers.__version__})")
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        return trainer

    reference = scaled_trainer()
    reference.train()
    trainer = adapt(scaled_trainer())
    with simulated_device("512KiB"):
        trainer.train()
    assert trainer.training_step.stats.ooms >= 1
    assert trainer.accelerator.scaler.get_scale() == reference.accelerator.scaler.get_scale() == 2.0**10
    assert_same_training(trainer, reference)


def test_evaluate_and_predict_in_chunks_give_the_whole_batches_results(tmp_path: Path) -> None:
    plain = make_trainer(tmp_path)
    expected = plain.evaluate()
    predicted = plain.predict(Rows(8, seed=2))
    with simulated_device("128KiB"), pytest.raises(torch.OutOfMemoryError):
        plain.evaluate()
    with simulated_device("192KiB"), pytest.raises(torch.OutOfMemoryError):
        plain.predict(Rows(8, seed=2))
    trainer = adapt(make_trainer(tmp_path))
    with simulated_device("128KiB"):  # evaluate keeps the loss only
        metrics = trainer.evaluate()
    # predict keeps the logits, which must fit whole beside the chunks' (as they are joined)
    with simulated_device("192KiB"):
        chunked = trainer.predict(Rows(8, seed=2))
    assert trainer.prediction_step.stats.ooms >= 1
    assert trainer.prediction_step.stats.batch_size < 8
    assert metrics["eval_loss"] == pytest.approx(expected["eval_loss"], rel=1e-6)
    torch.testing.assert_close(torch.as_tensor(chunked.predictions), torch.as_tensor(predicted.predictions))
    torch.testing.assert_close(torch.as_tensor(chunked.label_ids), torch.as_tensor(predicted.label_ids))
    assert chunked.metrics["test_loss"] == pytest.approx(predicted.metrics["test_loss"], rel=1e-6)


def test_a_seq2seq_prediction_split_pads_each_chunks_generated_tokens_as_the_whole_batchs(tmp_path: Path) -> None:
    # Each chunk generates as long as its own longest row, which the trainer pads up to the model's max_length
    # (20) only: chunks whose rows stop at different lengths, past 20, return tokens of different widths.
    # Greedy tokens do not depend on the EOS token before a row emits it: a run without one shows where
    # each row stops for every token.
    probe = make_seq2seq_trainer(tmp_path, eos=None).predict(Pairs()).predictions.tolist()

    def widths(token: int, size: int) -> set[int]:
        stops = [next((at + 1 for at, each in enumerate(row) if at and each == token), len(row)) for row in probe]
        return {max(20, *stops[start : start + size]) for start in range(0, len(stops), size)}

    eos = next(token for token in range(3, 100) if all(len(widths(token, size)) > 1 for size in (2, 4)))
    expected = make_seq2seq_trainer(tmp_path, eos).predict(Pairs())
    with simulated_device(TRAIN_LIMIT), pytest.raises(torch.OutOfMemoryError):
        make_seq2seq_trainer(tmp_path, eos).predict(Pairs())
    trainer = adapt(make_seq2seq_trainer(tmp_path, eos))
    with simulated_device(TRAIN_LIMIT):
        predicted = trainer.predict(Pairs())
    stats = trainer.prediction_step.stats
    assert stats.ooms >= 1
    assert stats.batch_size in (2, 4)  # chunks whose tokens differ in width (chosen above)
    assert expected.predictions.shape[1] > 20
    assert predicted.predictions.shape == expected.predictions.shape
    assert torch.equal(torch.as_tensor(predicted.predictions), torch.as_tensor(expected.predictions))
    assert torch.equal(torch.as_tensor(predicted.label_ids), torch.as_tensor(expected.label_ids))
    assert predicted.metrics["test_loss"] == pytest.approx(expected.metrics["test_loss"], rel=1e-6)


def test_a_seq2seq_prediction_step_takes_generate_s_keywords_whole_and_split(tmp_path: Path) -> None:
    # A direct call with gen_kwargs (a custom evaluation loop's) raised TypeError once adapted (probe 74D).
    plain = make_seq2seq_trainer(tmp_path, 5)
    batch = collate_pairs([Pairs()[index] for index in range(8)])
    options = {"max_new_tokens": 3, "num_beams": 1}
    expected = plain.prediction_step(plain.model, dict(batch), False, **options)
    trainer = adapt(make_seq2seq_trainer(tmp_path, 5))
    for limit in (None, TRAIN_LIMIT):  # whole, then split
        with simulated_device(limit) if limit else contextlib.nullcontext():
            found = trainer.prediction_step(trainer.model, dict(batch), False, **options)
        assert torch.equal(found[1], expected[1])
        assert torch.equal(found[2], expected[2])
    assert trainer.prediction_step.stats.ooms >= 1


def test_a_split_prediction_keeps_nothing_of_its_last_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The last split batch's joined labels lived on in the adapted step till the next split step (probe 74D).
    trainer = adapt(make_seq2seq_trainer(tmp_path, 5))
    step, returned = trainer.prediction_step, []

    def spied(*args: Any, **kwargs: Any) -> Any:
        found = step(*args, **kwargs)
        returned.extend(weakref.ref(each) for each in found[1:] if isinstance(each, torch.Tensor))
        return found

    monkeypatch.setattr(trainer, "prediction_step", spied)
    with simulated_device(TRAIN_LIMIT):
        predicted = trainer.predict(Pairs())
    assert step.stats.ooms >= 1
    assert returned
    del predicted
    gc.collect()
    assert [ref() for ref in returned if ref() is not None] == []


def test_a_seq2seq_prediction_split_keeps_every_sequence_of_each_row(tmp_path: Path) -> None:
    # num_return_sequences=2 gives two rows of tokens per row of the batch: taken for a count, the chunks'
    # tokens were added up into a quarter of the rows (4 of 16), silently.
    options = {"num_beams": 2, "num_return_sequences": 2}
    expected = make_seq2seq_trainer(tmp_path, 5).predict(Pairs(), **options)
    trainer = adapt(make_seq2seq_trainer(tmp_path, 5))
    with simulated_device(TRAIN_LIMIT):
        predicted = trainer.predict(Pairs(), **options)
    assert trainer.prediction_step.stats.ooms >= 1
    assert predicted.predictions.shape == expected.predictions.shape == (2 * len(Pairs()), 40)
    assert torch.equal(torch.as_tensor(predicted.predictions), torch.as_tensor(expected.predictions))


class FlatLabels(transformers.Trainer):  # type: ignore[misc]
    """A prediction_step that returns its labels flattened over tokens: not one entry per row."""

    def prediction_step(self, model: Any, inputs: Any, prediction_loss_only: bool, ignore_keys: Any = None) -> Any:
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        return loss, logits, None if labels is None else labels.flatten()


class FlatTokens(FlatLabels):
    """The labels and the predicted tokens (integers) flattened over tokens."""

    def prediction_step(self, model: Any, inputs: Any, prediction_loss_only: bool, ignore_keys: Any = None) -> Any:
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        return loss, None if logits is None else logits.argmax(-1).flatten(), labels


class FlatFailing(FlatTokens):
    """Out of memory for a chunk of more than one row that holds the batch's sixth row: attempts fail part-way."""

    failing = True

    def prediction_step(self, model: Any, inputs: Any, prediction_loss_only: bool, ignore_keys: Any = None) -> Any:
        ids = inputs["input_ids"]
        sixth = collate([self.eval_dataset[5]])["input_ids"][0]
        if self.failing and len(ids) > 1 and (ids[:, : len(sixth)] == sixth).all(-1).any():
            raise torch.OutOfMemoryError("the sixth row in a chunk of several")
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)


def _token_metrics(found: Any) -> dict[str, float]:
    """Metrics of flattened tokens that tell a sum of chunks from their concatenation: their count and positions."""
    predictions, labels = torch.as_tensor(found.predictions), torch.as_tensor(found.label_ids)
    if predictions.dim() > 1:  # logits per row
        predictions = predictions.argmax(-1).flatten()
    real = labels != -100
    positions = torch.arange(len(labels), dtype=torch.float64)
    return {"tokens": float(len(labels)), "where": float(positions[real].sum()), "hits": float(predictions[real].sum())}


@pytest.mark.parametrize("call", ["predict", "evaluate"])
@pytest.mark.parametrize("cls", [FlatLabels, FlatTokens, FlatFailing], ids=["labels", "tokens", "failing part-way"])
def test_a_split_prediction_step_concatenates_labels_and_integer_logits_not_per_row(
    tmp_path: Path, cls: Any, call: str
) -> None:
    """Labels (and integer logits) flattened over tokens were taken for a count of each chunk and added up (probe 64B).

    The trainer concatenates each batch's along dim 0; so do the chunks' now, also after attempts that
    failed part-way. Integer logits so joined are warned of, saying so; labels, targets, are not.
    """
    expected, trainer = make_trainer(tmp_path, cls), adapt(make_trainer(tmp_path, cls))
    expected.failing = False
    for each in (expected, trainer):
        each.compute_metrics = _token_metrics

    def run(each: Any) -> Any:
        return each.predict(each.eval_dataset) if call == "predict" else each.evaluate()

    plain = [run(expected)] * 2
    with simulated_device("192KiB"), pytest.raises(torch.OutOfMemoryError):
        run(expected)
    found = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # each as short of memory: the results of the first count in a block
            with simulated_device("192KiB"):
                found.append(run(trainer))
    assert trainer.prediction_step.stats.ooms >= 1
    assert trainer.prediction_step.stats.batch_size < 8
    for split, whole in zip(found, plain, strict=True):
        if call == "predict":
            assert torch.equal(torch.as_tensor(split.label_ids), torch.as_tensor(whole.label_ids))
            split_logits, whole_logits = torch.as_tensor(split.predictions), torch.as_tensor(whole.predictions)
            torch.testing.assert_close(split_logits, whole_logits, rtol=1e-5, atol=1e-6)
            split, whole = split.metrics, whole.metrics
        prefix = "test" if call == "predict" else "eval"
        for name in ("tokens", "where", "hits"):
            assert split[f"{prefix}_{name}"] == whole[f"{prefix}_{name}"], name
        assert split[f"{prefix}_loss"] == pytest.approx(whole[f"{prefix}_loss"], rel=1e-5)
    said = [str(warning.message) for warning in caught if "adapt's prediction_step" in str(warning.message)]
    if cls is FlatLabels:
        assert said == []
    else:
        assert len(said) == 1, said
        assert "dtype torch.int64 was joined by concatenating the chunks' along dim 0" in said[0]
        assert "averaged" not in said[0]
        assert "added up" not in said[0]
        assert "labels tensor" not in said[0]


class Trimmed(transformers.Trainer):  # type: ignore[misc]
    """A prediction_step that trims its logits and labels to its batch's longest row: chunks differ in width."""

    def prediction_step(self, model: Any, inputs: Any, prediction_loss_only: bool, ignore_keys: Any = None) -> Any:
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        width = int(inputs["attention_mask"].sum(1).max())
        return loss, logits[:, :width], labels[:, :width]


class Generating(transformers.Trainer):  # type: ignore[misc]
    """A prediction_step that generates: each chunk as long as its own longest row, up to its first EOS token."""

    eos: int | None = None

    def prediction_step(self, model: Any, inputs: Any, prediction_loss_only: bool, ignore_keys: Any = None) -> Any:
        loss = super().prediction_step(model, inputs, True, ignore_keys)[0]
        ids = inputs["input_ids"]
        tokens = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=10,
            do_sample=False,
            eos_token_id=self.eos,
            pad_token_id=0,
        )
        return loss, tokens, inputs["labels"]


class Even(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Rows of 12 tokens, none padded: each row generates the same tokens in any batch."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(3)
        self.rows = [torch.randint(1, 100, (12,), generator=generator) for _ in range(8)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[index]}


@pytest.mark.parametrize("cls", [Trimmed, Generating], ids=["trimmed", "generated"])
def test_a_split_prediction_step_whose_chunks_differ_in_width_is_padded_as_the_trainer_pads_batches(
    tmp_path: Path, cls: Any
) -> None:
    """Chunks' logits of different widths raised torch.cat's bare error (probe 64B): padded with -100 now, warned of.

    The whole batch would have held its own values where a chunk is padded (the model's logits, generate's
    pad token): everything else is the whole batch's.
    """
    data = Rows(8, seed=2) if cls is Trimmed else Even()
    plain, trainer = make_trainer(tmp_path, cls), adapt(make_trainer(tmp_path, cls))
    if cls is Generating:
        # Greedy tokens do not depend on the EOS token before a row emits it: a run with one that no row
        # emits shows where each row stops for every token. Chosen so that chunks of 1 or 2 rows stop at
        # different widths.
        free = torch.as_tensor(plain.predict(data).predictions)[:, 12:].tolist()

        def widths(token: int, size: int) -> set[int]:
            stops = [next((at + 1 for at, each in enumerate(row) if each == token), len(row)) for row in free]
            return {max(stops[start : start + size]) for start in range(0, len(stops), size)}

        eos = next(token for token in range(1, 100) if all(len(widths(token, size)) > 1 for size in (1, 2)))
        plain.eos = trainer.eos = eos
    expected = plain.predict(data)
    with simulated_device("160KiB"), pytest.raises(torch.OutOfMemoryError):
        plain.predict(data)
    found = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # each as short of memory: the results of the first count in a block
            with simulated_device("160KiB"):
                found.append(trainer.predict(data))
    assert trainer.prediction_step.stats.ooms >= 1
    assert trainer.prediction_step.stats.batch_size in ((1, 2) if cls is Generating else range(1, 8))
    said = [str(warning.message) for warning in caught if "padded at the end with -100" in str(warning.message)]
    assert len(said) == 1, said
    whole = torch.as_tensor(expected.predictions)
    for split in found:
        assert torch.equal(torch.as_tensor(split.label_ids), torch.as_tensor(expected.label_ids))
        predictions = torch.as_tensor(split.predictions)
        assert predictions.shape == whole.shape
        kept = predictions != -100
        assert not kept.all()  # some chunk was padded
        torch.testing.assert_close(predictions[kept], whole[kept], rtol=1e-5, atol=1e-6)
        if cls is Trimmed:  # padded only past a chunk's longest row: where the whole batch's labels are padding
            assert (torch.as_tensor(expected.label_ids)[~kept.all(-1)] == -100).all()


def test_options_are_checked_when_adapting(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'minimun' \(did you mean 'minimum'\?\)"):
        adapt(trainer, minimun=2)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="'initial'; each step tries its whole batch first"):
        adapt(trainer, initial=4)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="minimum must be >= 1"):
        adapt(trainer, minimum=0)
    with pytest.raises(TypeError, match="takes a transformers.Trainer"):
        adapt(trainer.model)
    assert adapt(trainer, minimum=2) is trainer
    with pytest.raises(ValueError, match="adapted already"):
        adapt(trainer)


def test_an_adapted_trainer_refuses_a_deep_copy(tmp_path: Path, reference: Any) -> None:
    # A copy's steps were the original's wrappers, weighing micro-batches with the original's state:
    # the copy trained to other weights once a step was split.
    trainer = adapt(make_trainer(tmp_path))
    with pytest.raises(TypeError, match=r"adapted cannot be deep-copied: .* Copy the trainer before"):
        copy.deepcopy(trainer)
    copied = adapt(copy.deepcopy(make_trainer(tmp_path)))  # as the message says
    with simulated_device(TRAIN_LIMIT):
        copied.train()
    assert copied.training_step.stats.ooms
    assert_same_training(copied, reference)


def test_a_trainer_it_cannot_serve_is_refused_with_the_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = make_trainer(tmp_path)
    # Constructing a DeepSpeed or XLA trainer needs DeepSpeed or an XLA device: the flags
    # the trainer and its accelerator set for them stand in here.
    monkeypatch.setattr(trainer, "is_deepspeed_enabled", True)
    with pytest.raises(NotImplementedError, match="cannot serve Trainer: it runs under DeepSpeed"):
        adapt(trainer)
    monkeypatch.setattr(trainer, "is_deepspeed_enabled", False)
    accelerate = pytest.importorskip("accelerate")
    types = accelerate.utils.DistributedType
    xla = getattr(types, "XLA", None) or types.TPU  # TPU before accelerate 0.28
    distributed = property(lambda self: xla)
    monkeypatch.setattr(type(trainer.accelerator), "distributed_type", distributed)
    with pytest.raises(NotImplementedError, match="it runs distributed as (XLA|TPU), which communicates inside"):
        adapt(trainer)
    monkeypatch.undo()
    assert "koila_adapted_steps" not in vars(trainer)  # nothing was changed by a refusal


class OwnBackward(transformers.Trainer):  # type: ignore[misc]
    """A training_step that runs its backward itself: adapt cannot hold it back for micro-batches."""

    def training_step(self, model: Any, inputs: Any, *count: Any) -> torch.Tensor:
        model.train()
        loss = self.compute_loss(model, inputs)
        loss.backward()
        return loss.detach()


class SuperAndOwnBackward(transformers.Trainer):  # type: ignore[misc]
    """Calls the original step, then a backward of its own besides (an extra penalty)."""

    def training_step(self, model: Any, inputs: Any, *count: Any) -> torch.Tensor:
        loss = super().training_step(model, inputs, *count)
        penalty = sum(p.pow(2).sum() for p in model.parameters()) * 1e-6
        penalty.backward()
        return loss


class Logging(transformers.Trainer):  # type: ignore[misc]
    """An override that wraps the original step: served."""

    calls = 0

    def training_step(self, model: Any, inputs: Any, *count: Any) -> torch.Tensor:
        # *count: num_items_in_batch, which Trainer passes from transformers 4.46 on.
        self.calls += 1
        return super().training_step(model, inputs, *count)


def test_a_custom_training_step_is_served_or_refused(tmp_path: Path, reference: Any) -> None:
    with pytest.raises(NotImplementedError, match="neither calls self.accelerator.backward nor super"):
        adapt(make_trainer(tmp_path, OwnBackward))
    trainer = adapt(make_trainer(tmp_path, SuperAndOwnBackward))
    with pytest.raises(RuntimeError, match=r"training_step ran a backward pass itself"):
        trainer.train()
    served = adapt(make_trainer(tmp_path, Logging))
    with simulated_device(TRAIN_LIMIT):
        served.train()
    assert served.calls > 3  # once per attempt and micro-batch
    assert_same_training(served, reference)


def test_a_size_remembered_on_disk_is_the_models_not_every_adapted_trainers(tmp_path: Path) -> None:
    # Keyed by adapt's own wrapper, every adapted trainer's steps shared one entry: a model that fits its batch
    # whole started at the size a smaller one's run stored (probe 73F).
    path = tmp_path / "sizes.json"
    first = adapt(make_trainer(tmp_path), cache=koila.DiskCache(path))
    with simulated_device(TRAIN_LIMIT):
        first.train()
    assert first.training_step.stats.ooms
    (key,) = json.loads(path.read_text())["sizes"]
    assert key.startswith("Trainer.training_step of GPT2LMHeadModel (transformers.models.gpt2.")
    other = adapt(make_trainer(tmp_path, model=CausalWrapper()), cache=koila.DiskCache(path))
    other.train()  # no limit: its batch of 8 fits whole
    stats = other.training_step.stats
    assert (stats.batch_size, stats.ooms) == (8, 0)
    assert len(json.loads(path.read_text())["sizes"]) == 1


def test_import_koila_retry_imports_neither_transformers_nor_the_integrations() -> None:
    code = (
        "import sys, koila_retry; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers' or 'integrations' in m))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _backward_callers(trainer: Any) -> list[str]:
    """Record, on the trainer, the function that calls ``accelerator.backward`` each time."""
    callers: list[str] = []
    real = trainer.accelerator.backward

    def backward(loss: torch.Tensor, **kwargs: Any) -> None:
        caller = sys._getframe(1)
        while caller.f_code.co_name in ("allowed", "walked"):  # adapt's, which walks the graph first: its caller's
            caller = cast(FrameType, caller.f_back)
        callers.append(caller.f_code.co_name)
        real(loss, **kwargs)

    trainer.accelerator.backward = backward
    return callers


def test_nothing_failing_a_step_runs_as_the_trainer_runs_it(tmp_path: Path, reference: Any) -> None:
    """Trainer's own training_step, its backward included, with nothing of accumulate around it."""
    trainer = adapt(make_trainer(tmp_path))
    callers = _backward_callers(trainer)
    trainer.train()
    assert callers == ["training_step"] * 3
    # The first step's graph reached nothing but the parameters: the later steps' are not walked.
    assert trainer.training_step.walks is False
    stats = trainer.training_step.stats
    assert (stats.calls, stats.batch_size, stats.ooms) == (3, 8, 0)
    assert_same_training(trainer, reference)


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_an_oom_of_a_step_run_as_the_trainer_runs_it_is_accumulates_first_attempt(tmp_path: Path, where: str) -> None:
    """Reported once, at the whole batch, and the step goes on in micro-batches without running it whole again."""
    if "compute_loss_func" not in inspect.signature(transformers.Trainer).parameters:
        pytest.skip(f"Trainer takes compute_loss_func from transformers 4.46 on, not {transformers.__version__}")
    reference = make_trainer(tmp_path, model=float64_gpt2(), compute_loss_func=float64_loss_func)
    reference.train()
    events: list[Any] = []
    model = float64_gpt2({0: where})
    # A weak reference to the input of the first block's MLP in each forward, which its first layer saves for
    # a backward that reaches it after the Inject layer's: the failed attempt's must be gone by the next.
    activations: list[weakref.ref[torch.Tensor]] = []
    gone: list[bool] = []

    def look(module: Any, args: tuple[torch.Tensor, ...]) -> None:
        gone.append(all(reference() is None for reference in activations))
        activations.append(weakref.ref(args[0]))

    model.transformer.h[0].mlp.register_forward_pre_hook(look)
    trainer = adapt(make_trainer(tmp_path, model=model, compute_loss_func=float64_loss_func), on_oom=events.append)
    callers = _backward_callers(trainer)
    trainer.train()
    assert gone[1] is True, "the failed attempt's activations were alive when the step ran again"
    assert [event.batch_size for event in events] == [8]
    # Named where the trainer's own step raised it, not where accumulate raised it again.
    assert "_layers.py:" in events[0].where
    assert events[0].where.endswith(f" in {where}")
    # The whole batch, which failed, then micro-batches of 4 for this step and the next ones.
    assert injected(model).rows == [8, 4, 4, 4, 4, 4, 4]
    # The whole step's own backward, where it got that far; then accumulate's of each micro-batch.
    whole = 1 if where == "backward" else 0
    assert callers[:whole] == ["training_step"] * whole
    assert set(callers[whole:]) == {"backward"}
    assert trainer.training_step.stats.ooms == 1
    for (name, mine), (_, theirs) in zip(trainer.model.named_parameters(), reference.model.named_parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-13, atol=1e-15, msg=name)


@pytest.mark.parametrize("later", [False, True], ids=["first step", "later step of a window"])
def test_a_tensor_of_your_own_keeps_nothing_of_a_whole_step_whose_backward_failed(tmp_path: Path, later: bool) -> None:
    """A loss scale that needs a gradient, no parameter: found in the graph as accelerator.backward begins."""
    if "compute_loss_func" not in inspect.signature(transformers.Trainer).parameters:
        pytest.skip(f"Trainer takes compute_loss_func from transformers 4.46 on, not {transformers.__version__}")

    def scaled(scale: torch.Tensor) -> Any:
        def loss_func(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
            return float64_loss_func(outputs, labels, num_items_in_batch) * scale

        return loss_func

    # A window of two steps of 4 rows, the second failing, or the first step of 8 rows failing: after the
    # loss's scale got its gradient, in the backward of the first block.
    window = {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 4} if later else {}
    scale = torch.ones((), dtype=torch.float64, requires_grad=True)
    reference = make_trainer(tmp_path, model=float64_gpt2(), compute_loss_func=scaled(scale), **window)
    reference.train()
    expected, scale.grad = scale.grad, None
    assert expected is not None
    events: list[Any] = []
    model = float64_gpt2({1 if later else 0: "backward"})
    trainer = make_trainer(tmp_path, model=model, compute_loss_func=scaled(scale), **window)
    trainer = adapt(trainer, on_oom=events.append)
    trainer.train()
    assert [event.batch_size for event in events] == [4 if later else 8]
    torch.testing.assert_close(scale.grad, expected, rtol=1e-12, atol=1e-15)
    assert trainer.training_step.walks is True


def test_a_prediction_step_that_fits_runs_as_the_trainer_runs_it_and_one_that_does_not_in_chunks_at_once(
    tmp_path: Path,
) -> None:
    expected = make_trainer(tmp_path).evaluate()
    trainer = adapt(make_trainer(tmp_path))
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] == expected["eval_loss"]
    step = trainer.prediction_step
    assert [each.cache_info().misses for each in (step.summed, step.weighted, step.by_rows)] == [0, 0, 0]
    assert step.stats.batch_size == 8

    events: list[Any] = []
    trainer = adapt(make_trainer(tmp_path), on_oom=events.append)
    rows: list[int] = []
    trainer.model.register_forward_pre_hook(
        lambda module, args, kwargs: rows.append(len(kwargs["input_ids"])), with_kwargs=True
    )
    with simulated_device("128KiB"):
        metrics = trainer.evaluate()
    # The whole batch's error is accumulate's first attempt: reported once, at 8 rows, and the
    # batch runs in chunks at once, not whole a second time.
    assert [event.batch_size for event in events][:1] == [8]
    assert rows[0] == 8
    # Named where the trainer's own prediction step raised it (inside the model), not at the evaluate() call:
    # at the forward of the layer that allocated (GPT-2's are transformers'), not PyTorch's Module.__call__.
    assert "test_integration_transformers.py" not in events[0].where
    assert events[0].where.endswith(" in forward"), events[0].where
    assert 8 not in rows[1:]
    assert metrics["eval_loss"] == pytest.approx(expected["eval_loss"], rel=1e-6)


def test_every_step_of_an_accumulation_window_that_fits_runs_as_the_trainer_runs_it(tmp_path: Path) -> None:
    """The window's gradients so far set aside and added back: the trainer's own sum, to the last bit."""
    if "compute_loss_func" not in inspect.signature(transformers.Trainer).parameters:
        pytest.skip(f"Trainer takes compute_loss_func from transformers 4.46 on, not {transformers.__version__}")
    window = {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 4}
    reference = make_trainer(tmp_path, model=float64_gpt2(), compute_loss_func=float64_loss_func, **window)
    reference.train()
    trainer = adapt(make_trainer(tmp_path, model=float64_gpt2(), compute_loss_func=float64_loss_func, **window))
    callers = _backward_callers(trainer)
    trainer.train()
    assert callers == ["training_step"] * 6
    for (name, mine), (_, theirs) in zip(trainer.model.named_parameters(), reference.model.named_parameters()):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_an_oom_in_a_later_step_of_a_window_puts_the_windows_gradients_back(tmp_path: Path, where: str) -> None:
    """The second micro-step of the first window fails: the first's gradients are kept, the second runs split."""
    if "compute_loss_func" not in inspect.signature(transformers.Trainer).parameters:
        pytest.skip(f"Trainer takes compute_loss_func from transformers 4.46 on, not {transformers.__version__}")
    window = {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 4}
    reference = make_trainer(tmp_path, model=float64_gpt2(), compute_loss_func=float64_loss_func, **window)
    reference.train()
    events: list[Any] = []
    model = float64_gpt2({1: where})
    trainer = make_trainer(tmp_path, model=model, compute_loss_func=float64_loss_func, **window)
    trainer = adapt(trainer, on_oom=events.append)
    trainer.train()
    assert [event.batch_size for event in events] == [4]
    assert injected(model).rows[:4] == [4, 4, 2, 2]
    for (name, mine), (_, theirs) in zip(trainer.model.named_parameters(), reference.model.named_parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-13, atol=1e-15, msg=name)


class RetainingBackward(transformers.Trainer):  # type: ignore[misc]
    """An override that computes its loss and passes a keyword to accelerator.backward."""

    keyword: dict[str, Any] | None = None  # by default, retain_graph=False

    def training_step(self, model: Any, inputs: Any, *count: Any) -> torch.Tensor:
        model.train()
        # num_items_in_batch only where the trainer passes it: transformers before 4.46 takes none.
        loss = self.compute_loss(model, inputs, **({"num_items_in_batch": count[0]} if count else {}))
        self.accelerator.backward(loss, **(self.keyword or {"retain_graph": False}))
        return loss.detach()


def test_an_override_that_passes_retain_graph_to_the_backward_is_served(tmp_path: Path) -> None:
    plain = make_trainer(tmp_path, RetainingBackward)
    plain.train()
    trainer = adapt(make_trainer(tmp_path, RetainingBackward))
    with simulated_device(TRAIN_LIMIT):
        trainer.train()
    assert trainer.training_step.stats.ooms
    assert_same_training(trainer, plain)
    refused = adapt(make_trainer(tmp_path, RetainingBackward))
    refused.keyword = {"retain_graph": True, "create_graph": False}  # on the instance
    with pytest.raises(NotImplementedError, match=r"with \['create_graph'\], .*it accepts retain_graph"):
        refused.train()


def test_an_override_runs_as_the_trainer_runs_it_from_its_first_step(tmp_path: Path, reference: Any) -> None:
    """Its first step, checked, shows that it backpropagates through accelerator.backward, once."""
    trainer = adapt(make_trainer(tmp_path, Logging))
    callers = _backward_callers(trainer)
    trainer.train()
    assert callers == ["training_step"] * 3
    assert trainer.calls == 3
    assert trainer.training_step.checked
    assert_same_training(trainer, reference)


class FreezesRows(transformers.Trainer):  # type: ignore[misc]
    """An override that edits the gradients after its backward: only the embedding's later rows train."""

    def training_step(self, model: Any, inputs: Any, *count: Any) -> torch.Tensor:
        loss = super().training_step(model, inputs, *count)
        grad = model.get_input_embeddings().weight.grad
        self.seen = [*getattr(self, "seen", []), grad is not None]
        if grad is not None:
            grad[: VOCAB // 2] = 0
        return loss


class ClipsInTheStep(transformers.Trainer):  # type: ignore[misc]
    """An override that clips the gradients after its backward: the window's so far, in the trainer's own."""

    def training_step(self, model: Any, inputs: Any, *count: Any) -> torch.Tensor:
        loss = super().training_step(model, inputs, *count)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)
        return loss


@pytest.mark.parametrize("kind", [FreezesRows, ClipsInTheStep], ids=["edits-rows", "clips"])
def test_an_override_that_changes_the_gradients_after_its_backward_trains_as_the_trainer(
    tmp_path: Path, kind: type[Any]
) -> None:
    # Its first step ran through accumulate, whose backward runs after the step: the code after the backward
    # saw .grad None, and the frozen rows trained; later, each step's backward ran with the window's gradients
    # set aside, so a clip saw the step's alone (probe 73B).
    options = {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 4, "max_grad_norm": 0.0}
    plain = make_trainer(tmp_path, kind, model=float64_gpt2(), **options)
    plain.train()
    trainer = adapt(make_trainer(tmp_path, kind, model=float64_gpt2(), **options))
    with pytest.warns(UserWarning, match=r"changes \.grad after self\.accelerator\.backward") as warned:
        trainer.train()
    assert len([w for w in warned if "changes .grad" in str(w.message)]) == 1
    if kind is FreezesRows:
        assert all(trainer.seen)
        assert len(trainer.seen) == len(plain.seen)
    for (name, mine), (_, theirs) in zip(trainer.model.named_parameters(), plain.model.named_parameters()):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0, msg=name)


def test_an_override_that_changes_the_gradients_is_checked_whole_where_a_cache_knows_a_size(tmp_path: Path) -> None:
    # A cache that knew any size, another trainer's too, sent every step through accumulate, where the code
    # after the backward saw .grad None: the frozen rows trained, with no warning (probe 73G).
    path = tmp_path / "sizes.json"
    other = adapt(make_trainer(tmp_path), cache=koila.DiskCache(path))
    with simulated_device(TRAIN_LIMIT):
        other.train()
    assert koila.DiskCache(path).cache_info().currsize == 1
    options = {"model": float64_gpt2(), "max_grad_norm": 0.0}
    plain = make_trainer(tmp_path, FreezesRows, **options)
    before = plain.model.get_input_embeddings().weight.detach().clone()
    plain.train()
    trainer = adapt(
        make_trainer(tmp_path, FreezesRows, **{**options, "model": float64_gpt2()}), cache=koila.DiskCache(path)
    )
    with pytest.warns(UserWarning, match=r"changes \.grad after self\.accelerator\.backward"):
        trainer.train()
    assert trainer.training_step.stats.ooms == 0
    frozen = trainer.model.get_input_embeddings().weight[: VOCAB // 2]
    assert torch.equal(frozen, before[: VOCAB // 2])
    for (name, mine), (_, theirs) in zip(trainer.model.named_parameters(), plain.model.named_parameters()):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0, msg=name)


def test_an_override_seen_to_change_the_gradients_raises_when_a_step_runs_through_accumulate(tmp_path: Path) -> None:
    # Its code after the backward would run on no gradient there, silently.
    options = {"max_grad_norm": 0.0}
    trainer = adapt(make_trainer(tmp_path, FreezesRows, model=float64_gpt2({1: "forward"}), **options))
    with (
        pytest.warns(UserWarning, match=r"changes \.grad after"),
        pytest.raises(RuntimeError, match="changes .grad itself"),
    ):
        trainer.train()
    assert trainer.training_step.stats.ooms == 1


def _logged(step: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(step)
    def logged(*args: Any, **kwargs: Any) -> Any:
        return step(*args, **kwargs)

    return logged


class ClipsBehindADecorator(ClipsInTheStep):
    training_step = _logged(ClipsInTheStep.training_step)


def _clipped(step: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(step)
    def clipped(self: Any, model: Any, *args: Any) -> Any:
        loss = step(self, model, *args)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)
        return loss

    return clipped


class ClipsInItsDecorator(transformers.Trainer):  # type: ignore[misc]
    training_step = _clipped(transformers.Trainer.training_step)


@pytest.mark.parametrize(
    "kind", [ClipsInTheStep, ClipsBehindADecorator, ClipsInItsDecorator], ids=["plain", "decorated", "decorator"]
)
def test_an_override_whose_code_names_the_gradients_is_warned_of_as_it_runs_through_accumulate(
    tmp_path: Path, kind: type[Any]
) -> None:
    # A hook on a parameter sends every step through accumulate, where the clip after the backward sees none;
    # behind a decorator, its code was the decorator's (probe 73I).
    trainer = make_trainer(tmp_path, kind)
    trainer.model.lm_head.weight.register_hook(lambda gradient: gradient)
    trainer = adapt(trainer)
    with pytest.warns(UserWarning, match=r"runs through accumulate .* sees no gradient") as warned:
        trainer.train()
    assert len([w for w in warned if "runs through accumulate" in str(w.message)]) == 1


class SkipsBadBatches(transformers.Trainer):  # type: ignore[misc]
    """An override that catches an error of its backward and skips the batch, as some do for bad data."""

    def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        self.calls = getattr(self, "calls", 0) + 1
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        return RaiseInBackward.apply(loss) if self.calls == 1 else loss

    def training_step(self, model: Any, inputs: Any, *count: Any) -> torch.Tensor:
        try:
            return super().training_step(model, inputs, *count)
        except ValueError:
            return torch.tensor(0.0)


def test_an_override_that_catches_an_error_of_its_backward_is_not_warned_of(tmp_path: Path) -> None:
    # The backward raised before it wrote .grad: nothing after it changed the gradients (probe 73G).
    trainer = adapt(make_trainer(tmp_path, SkipsBadBatches))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert trainer.training_step.checked
    assert not [warning for warning in caught if "changes .grad" in str(warning.message)]


class RunsOutAfterItsBackward(transformers.Trainer):  # type: ignore[misc]
    """An override that runs out of memory after its backward, in the second step of a window."""

    def training_step(self, model: Any, inputs: Any, *count: Any) -> torch.Tensor:
        loss = super().training_step(model, inputs, *count)
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 2:
            self.grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
            raise make_oom()
        return loss


def test_an_override_that_runs_out_of_memory_after_its_backward_in_a_window_raises_it(tmp_path: Path) -> None:
    # Its backward added the window's gradients back as it ended, as the trainer's own step leaves them: the
    # error is raised, with a note, not retried on gradients that hold the step's already.
    options = {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 4}
    trainer = adapt(make_trainer(tmp_path, RunsOutAfterItsBackward, **options))
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory") as raised:
        trainer.train()
    assert any("ran out of memory after its backward: not retried" in note for note in raised.value.__notes__)
    assert trainer.training_step.stats.ooms == 0
    for parameter, grad in zip(trainer.model.parameters(), trainer.grads, strict=True):
        assert grad is not None
        assert torch.equal(parameter.grad, grad)  # the window's and the step's, as the trainer leaves them


class FailsInAWindow(transformers.Trainer):  # type: ignore[misc]
    """Raises an error of its own in the second step of a window: in its loss, or in the loss's backward."""

    failure = "step"

    def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 2 and self.failure == "step":
            raise ValueError("the step's own error")
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        return RaiseInBackward.apply(loss) if self.calls == 2 else loss


class _Kept(transformers.TrainerCallback):  # type: ignore[misc]
    """Keeps a copy of the gradients after the first step of a window, on the trainer."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        parameters = self.trainer.model.parameters()
        self.trainer.before = [None if p.grad is None else p.grad.clone() for p in parameters]


@pytest.mark.parametrize("failure", ["step", "backward"])
@pytest.mark.parametrize("adapted", [False, True], ids=["plain", "adapted"])
def test_an_error_in_a_window_leaves_the_windows_gradients_as_they_were(
    tmp_path: Path, failure: str, adapted: bool
) -> None:
    # The second step of a window runs with the window's gradients set aside: they were lost.
    trainer = make_trainer(tmp_path, FailsInAWindow, gradient_accumulation_steps=2, per_device_train_batch_size=4)
    trainer.failure = failure
    trainer.add_callback(_Kept(trainer))
    if adapted:
        trainer = adapt(trainer)
    with pytest.raises(ValueError, match="own error"):
        trainer.train()
    assert any(before is not None for before in trainer.before), "the first step of the window ran its backward"
    for parameter, before in zip(trainer.model.parameters(), trainer.before, strict=True):
        if before is None:
            assert parameter.grad is None
        else:
            assert parameter.grad is not None, "a gradient of the window was lost"
            assert torch.equal(parameter.grad, before)


def _weighted_rows() -> list[dict[str, torch.Tensor]]:
    """A first batch of short rows that fits whole, and a second with a long row that does not."""
    generator = torch.Generator().manual_seed(1)
    lengths = [4] * 8 + [24, 3, 5, 7, 9, 2, 4, 6]
    return [{"input_ids": torch.randint(1, VOCAB, (length,), generator=generator)} for length in lengths]


def _collate_weighted(rows: list[dict[str, torch.Tensor]], kind: type[Any] = dict) -> Any:
    return kind({**collate(rows), "weight": torch.arange(1.0, len(rows) + 1)})


class PopsItsWeights(transformers.Trainer):  # type: ignore[misc]
    """An override that takes a weight per row out of its inputs before the model sees them."""

    default = False  # pop with a default: a mapping without the weights weighs every row 1, silently
    kinds: list[type[Any]]

    def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
        return torch.utils.data.SequentialSampler(self.train_dataset)

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        model.train()
        self.kinds.append(type(inputs))
        weight = inputs.pop("weight", None) if self.default else inputs.pop("weight")
        weight = torch.ones(len(inputs["input_ids"])) if weight is None else weight
        inputs = self._prepare_inputs(inputs)
        labels = inputs.pop("labels")
        logits = model(**inputs).logits[:, :-1]
        losses = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), labels[:, 1:].flatten(), reduction="none"
        ).view(len(labels), -1)
        loss = (losses.sum(1) * weight).sum() / num_items_in_batch
        self.accelerator.backward(loss)
        return loss.detach()


@pytest.mark.parametrize(
    ("default", "kind"),
    [(False, dict), (True, dict), (False, transformers.BatchEncoding), (False, collections.OrderedDict)],
    ids=["pop", "pop-with-default", "BatchEncoding", "OrderedDict"],
)
def test_an_override_that_pops_from_its_inputs_and_runs_out_of_memory_is_retried_on_the_whole_mapping(
    tmp_path: Path, default: bool, kind: type[Any]
) -> None:
    """Its second step runs whole and fails: the retry splits the mapping as the trainer made it, weights included."""
    if "compute_loss_func" not in inspect.signature(transformers.Trainer).parameters:
        pytest.skip(
            "the override's loss needs num_items_in_batch, given from transformers 4.46 on, "
            f"not {transformers.__version__}"
        )

    def made() -> Any:
        trainer = make_trainer(
            tmp_path,
            PopsItsWeights,
            data=_weighted_rows(),
            data_collator=functools.partial(_collate_weighted, kind=kind),
            max_steps=2,
            remove_unused_columns=False,
        )
        trainer.default, trainer.kinds = default, []
        return trainer

    plain = made()
    plain.train()
    trainer = adapt(made())
    with simulated_device(TRAIN_LIMIT):
        trainer.train()
    stats = trainer.training_step.stats
    assert (stats.calls, stats.ooms) == (2, 1)
    assert stats.batch_size < 8
    assert set(trainer.kinds) == {kind}  # a copy of the trainer's mapping, of its type, whole or split
    for (name, mine), (_, theirs) in zip(trainer.model.named_parameters(), plain.model.named_parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6, msg=name)


class PopsItsTexts(transformers.Trainer):  # type: ignore[misc]
    """A prediction_step override that takes the rows' texts out of its inputs, then runs the trainer's own."""

    def prediction_step(self, model: Any, inputs: Any, prediction_loss_only: bool, ignore_keys: Any = None) -> Any:
        inputs.pop("text")
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)


def _collate_texts(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {**collate(rows), "text": [row["text"] for row in rows]}


def test_a_prediction_override_that_pops_from_its_inputs_and_runs_out_of_memory_is_retried_on_the_whole_mapping(
    tmp_path: Path,
) -> None:
    data = [{"input_ids": row["input_ids"], "text": f"row {index}"} for index, row in enumerate(Rows(16, seed=2))]

    def made() -> Any:
        return make_trainer(
            tmp_path, PopsItsTexts, data=data, data_collator=_collate_texts, remove_unused_columns=False
        )

    expected = made().predict(data)
    trainer = adapt(made())
    with simulated_device("384KiB"):  # a chunk fits beside the logits kept so far; the whole step does not
        predicted = trainer.predict(data)
    stats = trainer.prediction_step.stats
    assert stats.ooms >= 1
    assert stats.batch_size < 8
    torch.testing.assert_close(torch.as_tensor(predicted.predictions), torch.as_tensor(expected.predictions))
    torch.testing.assert_close(torch.as_tensor(predicted.label_ids), torch.as_tensor(expected.label_ids))
    assert predicted.metrics["test_loss"] == pytest.approx(expected.metrics["test_loss"], rel=1e-6)


class _Watched(torch.nn.Module):
    def __init__(self, error: str) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 16), torch.nn.Linear(16, 1)
        self.error, self.freed = error, cast(list[bool], [])

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = self.a(x)
        if len(x) == 8:  # the whole batch's step fails; its micro-batches' run
            hidden = WatchFreed.apply(hidden, list(self.b.parameters()), self.freed, self.error)
        return {"loss": ((self.b(torch.relu(hidden)).squeeze(1) - labels) ** 2).mean()}


@pytest.mark.parametrize("error", ["oom", "other"])
def test_a_failed_whole_backward_s_gradients_are_freed_after_every_grad_is_given_back(
    error: str, tmp_path: Path
) -> None:
    # Given back one by one in .grad's setter, the failed backward's gradients were freed there, where a read
    # of that .grad (another thread's step, koila.report) crashes the process (probe 75K: a segfault).
    model = _Watched(error)
    rows = [{"x": torch.randn(4), "labels": torch.randn(())} for _ in range(8)]
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        max_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        optim="sgd",
        learning_rate=0.1,
    )
    trainer = adapt(transformers.Trainer(model=model, args=arguments, train_dataset=rows))
    if error == "oom":
        trainer.train()  # again in micro-batches
    else:
        with pytest.raises(RuntimeError, match="a hook of the user's"):
            trainer.train()
    assert model.freed == [True, True]


# transformers' own, in the plain trainer's run as in the adapted one's: a config without a max_length.
@pytest.mark.filterwarnings("ignore:Using the model-agnostic default `max_length`:UserWarning")
def test_a_seq2seq_prediction_generates_by_its_config_as_the_batch_began_in_every_attempt(tmp_path: Path) -> None:
    # Seq2SeqTrainer's prediction step fills in the model's generation config after its first generate
    # (max_length from the defaults): a retry of the first batch, and its chunks, generated by the changed
    # config, and the predictions came out a token narrower than the plain trainer's (probe 77F).
    if not hasattr(transformers.GenerationConfig, "_get_default_generation_params"):
        pytest.skip(f"transformers {transformers.__version__} generates by no config without a max_length")

    def made() -> Any:
        trainer = make_seq2seq_trainer(tmp_path, 5)
        trainer.args.generation_max_length = None
        trainer.model.generation_config.max_length = None
        return trainer

    expected = made().predict(Pairs())
    trainer = adapt(made())
    with simulated_device(TRAIN_LIMIT):
        predicted = trainer.predict(Pairs())
    assert trainer.prediction_step.stats.ooms >= 1
    assert predicted.predictions.shape == expected.predictions.shape
    assert torch.equal(torch.as_tensor(predicted.predictions), torch.as_tensor(expected.predictions))
    assert torch.equal(torch.as_tensor(predicted.label_ids), torch.as_tensor(expected.label_ids))


class _Saliency(transformers.Trainer):  # type: ignore[misc]
    """Predicts each token's saliency, by ``autograd.grad``: of a sum over rows, so a row's is its own alone."""

    def prediction_step(self, model: Any, inputs: Any, prediction_loss_only: bool, ignore_keys: Any = None) -> Any:
        inputs = self._prepare_inputs(inputs)
        embeds = model.get_input_embeddings()(inputs["input_ids"]).detach().requires_grad_(True)
        out = model(inputs_embeds=embeds, attention_mask=inputs["attention_mask"], labels=inputs["labels"])
        (gradient,) = torch.autograd.grad(out.logits.logsumexp(-1).sum(), embeds)
        return out.loss.detach(), gradient.norm(dim=-1), inputs["labels"]


def test_a_prediction_step_that_takes_gradients_runs_in_the_trainer_s_grad_mode_whole_and_split(
    tmp_path: Path,
) -> None:
    # The evaluation loop leaves grad mode on; adapt ran every step through accumulate under no_grad, so
    # after an out-of-memory error (and under DDP, always) such a step failed: its loss had no grad_fn (probe 77F).
    expected = make_trainer(tmp_path / "plain", _Saliency).predict(Rows(8, seed=2))
    model = tiny_gpt2()
    model.register_forward_pre_hook(
        lambda module, args, kwargs: _fails_above(2, {"input_ids": kwargs["inputs_embeds"]}), with_kwargs=True
    )
    trainer = adapt(make_trainer(tmp_path / "adapted", _Saliency, model=model))
    predicted = trainer.predict(Rows(8, seed=2))
    assert trainer.prediction_step.stats.ooms >= 1
    assert trainer.prediction_step.stats.batch_size == 2
    torch.testing.assert_close(torch.as_tensor(predicted.predictions), torch.as_tensor(expected.predictions))
    assert predicted.metrics["test_loss"] == pytest.approx(expected.metrics["test_loss"], rel=1e-6)


def test_a_prediction_batch_run_whole_for_its_patches_is_not_warned_of_as_split(tmp_path: Path) -> None:
    # With pixel_values first, their 17 patches were taken for the batch's rows, and the step run whole over
    # its one-row stand-in for a split into rows of 1: a warning that the logits were averaged (probe 77F).
    def patches_first(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return {"pixel_values": torch.ones(2 * len(rows) + 1, 3), **collate(rows)}  # no whole number a row

    class Evaluated(transformers.Trainer):  # type: ignore[misc]
        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kwargs: Any) -> Any:
            inputs = dict(inputs)
            image_term = inputs.pop("pixel_values").mean() * 0
            outputs = model(**inputs)
            loss = outputs.loss + image_term
            return (loss, outputs) if return_outputs else loss

    def made(path: Path) -> Any:
        return make_trainer(path, Evaluated, data_collator=patches_first, remove_unused_columns=False)

    expected = made(tmp_path / "plain").predict(Rows(8, seed=2))
    trainer = adapt(made(tmp_path / "adapted"))
    trainer.prediction_step.kept.trusting = False  # through accumulate, as under DDP or after an OOM
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        predicted = trainer.predict(Rows(8, seed=2))
    assert [str(each.message) for each in caught if "koila" in each.filename or "adapt" in str(each.message)] == []
    torch.testing.assert_close(torch.as_tensor(predicted.predictions), torch.as_tensor(expected.predictions))
    assert predicted.metrics["test_loss"] == pytest.approx(expected.metrics["test_loss"], rel=1e-6)


class _OwnGenerationConfig(transformers.Seq2SeqTrainer):  # type: ignore[misc]
    """Predicts by an evaluation generation config of its own, swapped in at each step."""

    def prediction_step(self, model: Any, inputs: Any, prediction_loss_only: bool, **options: Any) -> Any:
        self.model.generation_config = self.evaluated_by
        return super().prediction_step(model, inputs, prediction_loss_only, **options)


def test_a_generation_config_a_step_swaps_in_is_left_its_own_state(tmp_path: Path) -> None:
    # The state of the config the batch began with was written into whatever config the model held at each
    # retry: the user's own, swapped in by the failed attempt, which then generated by the other's (probe 77H).
    def made() -> Any:
        trainer = make_seq2seq_trainer(tmp_path, 5)
        trainer.__class__ = _OwnGenerationConfig
        trainer.evaluated_by = transformers.GenerationConfig(
            max_length=30, min_length=25, eos_token_id=5, pad_token_id=1, decoder_start_token_id=0, bos_token_id=0
        )
        return trainer

    plain = made()
    expected = plain.predict(Pairs())
    trainer = adapt(made())
    with simulated_device(TRAIN_LIMIT):
        predicted = trainer.predict(Pairs())
    assert trainer.prediction_step.stats.ooms >= 1
    assert (trainer.evaluated_by.min_length, trainer.evaluated_by.max_length) == (25, 30)
    assert predicted.predictions.shape == expected.predictions.shape
    assert torch.equal(torch.as_tensor(predicted.predictions), torch.as_tensor(expected.predictions))


class _PerShard(transformers.Trainer):  # type: ignore[misc]
    """Counts the items one per shard (as DataParallel's gather makes them): a tensor of 2, not of the rows."""

    def _get_num_items_in_batch(self, batch_samples: Any, device: Any) -> Any:
        count = super()._get_num_items_in_batch(batch_samples, device)
        return None if count is None else torch.stack([count, count])

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **options: Any) -> Any:
        return model(**inputs).loss


def test_a_step_that_its_count_of_items_keeps_from_splitting_runs_whole(tmp_path: Path) -> None:
    # Whether the step could be split was asked of its batch alone: a count of 2 next to 8 rows let Split's
    # ValueError through, where the step had run whole (probe 77K).
    model = tiny_gpt2()
    model.lm_head.weight.register_hook(lambda gradient: gradient)  # through accumulate, not as the trainer runs it
    trainer = adapt(make_trainer(tmp_path, _PerShard, model=model, max_steps=2))
    trainer.train()
    assert trainer.state.global_step == 2


class _SwapsModel(transformers.Seq2SeqTrainer):  # type: ignore[misc]
    """Predicts with an average of the model (its own object, with its own generation config)."""

    def prediction_step(self, model: Any, inputs: Any, prediction_loss_only: bool, **options: Any) -> Any:
        self.model = self.average
        return super().prediction_step(self.average, inputs, prediction_loss_only, **options)


def test_a_step_that_swaps_in_another_model_keeps_that_model_s_generation_config(tmp_path: Path) -> None:
    # The config the batch began with was put on whatever model the trainer held at the retry: the average's
    # own was replaced for good, and it generated by the first model's (probe 77L).
    def made() -> Any:
        trainer = make_seq2seq_trainer(tmp_path, 5)
        trainer.__class__ = _SwapsModel
        trainer.average = copy.deepcopy(trainer.model)
        trainer.average.generation_config = transformers.GenerationConfig(
            max_length=20, no_repeat_ngram_size=1, eos_token_id=5, pad_token_id=1, decoder_start_token_id=0
        )
        return trainer

    expected = made().predict(Pairs())
    trainer = adapt(made())
    own = trainer.average.generation_config
    with simulated_device(TRAIN_LIMIT):
        predicted = trainer.predict(Pairs())
    assert trainer.prediction_step.stats.ooms >= 1
    assert trainer.average.generation_config is own
    assert own.no_repeat_ngram_size == 1
    assert torch.equal(torch.as_tensor(predicted.predictions), torch.as_tensor(expected.predictions))
