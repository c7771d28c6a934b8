"""Stock Hugging Face losses that are no mean over the labels that are not -100, under ``adapt``.

A split step was weighed by each micro-batch's share of those labels whatever the model's loss:
a CTC loss (a mean over rows, or a sum) and a semantic segmentation loss (a mean over the pixels
that are not its ignore index, 255) came out wrong, silently. A loss that no weight per
micro-batch adds up (a pre-training head's masked tokens and next-sentence labels, a detector's,
an MoE router loss) is warned of once. Each model is tiny and built from a config, in float64
where it computes so; the plain trainer runs the same step whole, in the same test.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _hf_trainer import make_trainer  # noqa: E402 (after the skip)

from koila_retry.integrations.transformers import adapt  # noqa: E402
from koila_retry.testing import make_oom  # noqa: E402

ROWS = 8


@pytest.fixture(autouse=True)
def no_mixed_precision_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers 4 leaves a bf16 or fp16 trainer's precision in os.environ, for every later trainer."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")


def fails_first(module: torch.nn.Module) -> list[int]:
    """Make the first forward of ``module`` run out of memory: ``adapt`` splits that step. Return each call's rows."""
    rows: list[int] = []

    def hook(layer: Any, args: Any, kwargs: Any) -> None:
        first = next(value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor))
        rows.append(first.shape[0])
        if len(rows) == 1:
            raise make_oom()

    module.register_forward_pre_hook(hook, with_kwargs=True)
    return rows


def trainer(
    tmp_path: Path, model: Any, data: list[dict[str, Any]], collate: Callable[..., Any], **arguments: Any
) -> Any:
    settings: dict[str, Any] = {
        "per_device_train_batch_size": ROWS,
        "per_device_eval_batch_size": ROWS,
        "max_steps": 1,
        "max_grad_norm": 0,
        "remove_unused_columns": False,
    }
    return make_trainer(tmp_path, model=model, data=data, data_collator=collate, **(settings | arguments))


def logged(trainer: Any, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def assert_same_weights(adapted: Any, plain: Any) -> None:
    for (name, mine), (_, theirs) in zip(adapted.model.named_parameters(), plain.model.named_parameters()):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-10, msg=name)


# A CTC model: speech of different lengths, transcripts of 2 to 11 tokens.


def speech() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(ROWS):
        frames = int(torch.randint(400, 1600, (1,), generator=generator))
        tokens = int(torch.randint(2, 12, (1,), generator=generator))
        rows.append(
            {
                "input_values": torch.randn(frames, generator=generator, dtype=torch.float64),
                "labels": torch.randint(3, 12, (tokens,), generator=generator),
            }
        )
    return rows


def collate_speech(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    longest = max(len(row["input_values"]) for row in rows)
    values = torch.stack(
        [torch.nn.functional.pad(row["input_values"], (0, longest - len(row["input_values"]))) for row in rows]
    )
    mask = torch.stack([torch.arange(longest) < len(row["input_values"]) for row in rows]).long()
    labels = torch.nn.utils.rnn.pad_sequence([row["labels"] for row in rows], batch_first=True, padding_value=-100)
    return {"input_values": values, "attention_mask": mask, "labels": labels}


def wav2vec2(reduction: str) -> Any:
    torch.manual_seed(0)
    config = transformers.Wav2Vec2Config(
        vocab_size=12,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        conv_dim=(8, 8),
        conv_kernel=(10, 3),
        conv_stride=(5, 2),
        num_feat_extract_layers=2,
        num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2,
        hidden_dropout=0.0,
        activation_dropout=0.0,
        attention_dropout=0.0,
        feat_proj_dropout=0.0,
        final_dropout=0.0,
        layerdrop=0.0,
        mask_time_prob=0.0,
        pad_token_id=0,
        ctc_loss_reduction=reduction,
        feat_extract_norm="layer",
        do_stable_layer_norm=True,
    )
    return transformers.Wav2Vec2ForCTC(config).double()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_split_ctc_step_trains_as_the_plain_trainer(tmp_path: Path, reduction: str) -> None:
    """A CTC loss is a mean over rows ("mean": each row's over its target length) or a sum: weighed as such."""
    data = speech()
    plain = trainer(tmp_path / "plain", wav2vec2(reduction), data, collate_speech, learning_rate=1e-3)
    plain.train()
    model = wav2vec2(reduction)
    rows = fails_first(model.wav2vec2.encoder)
    adapted = adapt(trainer(tmp_path / "adapted", model, data, collate_speech, learning_rate=1e-3))
    adapted.train()
    assert rows[0] == ROWS
    assert max(rows[1:]) < ROWS  # split
    # The CTC loss is computed in float32 (its log-softmax), its gradient flows back into float64.
    torch.testing.assert_close(logged(adapted, "loss"), logged(plain, "loss"), rtol=1e-6, atol=0)
    torch.testing.assert_close(logged(adapted, "grad_norm"), logged(plain, "grad_norm"), rtol=1e-9, atol=0)
    assert_same_weights(adapted, plain)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_split_ctc_evaluation_has_the_plain_trainers_loss(tmp_path: Path, reduction: str) -> None:
    data = speech()
    plain = trainer(tmp_path / "plain", wav2vec2(reduction), data, collate_speech).evaluate()
    model = wav2vec2(reduction)
    rows = fails_first(model.wav2vec2.encoder)
    adapted = adapt(trainer(tmp_path / "adapted", model, data, collate_speech)).evaluate()
    assert max(rows[1:]) < ROWS
    torch.testing.assert_close(adapted["eval_loss"], plain["eval_loss"], rtol=1e-6, atol=0)  # in float32


# A semantic segmentation model: label maps with few or many pixels of its ignore index (255).


def scenes() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    rows = []
    for index in range(ROWS):
        labels = torch.randint(0, 3, (16, 16), generator=generator)
        ignored = torch.rand(16, 16, generator=generator) < (0.9 if index < ROWS // 2 else 0.1)
        rows.append(
            {
                "pixel_values": torch.randn(3, 16, 16, generator=generator, dtype=torch.float64),
                "labels": labels.masked_fill(ignored, 255),
            }
        )
    return rows


def collate_scenes(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([row[key] for row in rows]) for key in ("pixel_values", "labels")}


def segformer() -> Any:
    torch.manual_seed(0)
    config = transformers.SegformerConfig(
        num_channels=3,
        num_encoder_blocks=1,
        depths=[1],
        sr_ratios=[1],
        hidden_sizes=[8],
        patch_sizes=[3],
        strides=[2],
        num_attention_heads=[1],
        mlp_ratios=[2],
        decoder_hidden_size=8,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout_prob=0.0,
        drop_path_rate=0.0,
    )
    model = transformers.SegformerForSemanticSegmentation(config).double()
    model.decode_head.batch_norm = torch.nn.Identity()  # which sees each micro-batch's statistics
    return model


def test_a_split_segmentation_step_weighs_the_pixels_its_loss_averages_over(tmp_path: Path) -> None:
    """Its loss is a mean over the pixels that are not 255: a micro-batch of mostly ignored pixels weighs little."""
    data = scenes()
    plain = trainer(tmp_path / "plain", segformer(), data, collate_scenes)
    plain.train()
    model = segformer()
    rows = fails_first(model.segformer)
    adapted = adapt(trainer(tmp_path / "adapted", model, data, collate_scenes))
    adapted.train()
    assert max(rows[1:]) < ROWS
    torch.testing.assert_close(logged(adapted, "loss"), logged(plain, "loss"), rtol=1e-9, atol=0)
    assert_same_weights(adapted, plain)


# A pre-training head: its loss adds a mean over the masked tokens and a mean over the rows.


def sentences() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    rows = []
    for index in range(2 * ROWS):
        length = int(torch.randint(6, 24, (1,), generator=generator))
        ids = torch.randint(5, 100, (length,), generator=generator)
        masked = torch.randperm(length, generator=generator)[: 1 + index % 5]
        labels = torch.full((length,), -100).index_copy(0, masked, ids[masked])
        rows.append({"input_ids": ids, "labels": labels, "next_sentence_label": torch.tensor(index % 2)})
    return rows


def collate_sentences(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    def padded(key: str, value: int) -> torch.Tensor:
        return torch.nn.utils.rnn.pad_sequence([row[key] for row in rows], batch_first=True, padding_value=value)

    ids = padded("input_ids", 0)
    return {
        "input_ids": ids,
        "attention_mask": (ids != 0).long(),
        "labels": padded("labels", -100),
        "next_sentence_label": torch.stack([row["next_sentence_label"] for row in rows]),
    }


def bert_for_pretraining() -> Any:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        max_position_embeddings=64,
    )
    return transformers.BertForPreTraining(config).double()


def test_a_split_pretraining_step_is_warned_of_once(tmp_path: Path) -> None:
    """No weight per micro-batch adds a mean over masked tokens and one over rows up: warned of, naming why."""
    data = sentences()
    model = bert_for_pretraining()
    fails_first(model.bert.encoder)
    adapted = adapt(trainer(tmp_path, model, data, collate_sentences, max_steps=2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        adapted.train()
    said = [str(warning.message) for warning in caught if "no weight per micro-batch" in str(warning.message)]
    assert adapted.state.global_step == 2
    assert adapted.training_step.stats.batch_size < ROWS  # both steps split
    assert len(said) == 1
    assert "'next_sentence_label'" in said[0]
    assert "minimum=" in said[0]


# A mixture of experts whose config adds its router's load-balancing loss, over each forward's tokens.


def mixtral(coefficient: float) -> Any:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=100,
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=coefficient,
        max_position_embeddings=64,
        attention_dropout=0.0,
    )
    return transformers.MixtralForCausalLM(config)


def tokens() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        {"input_ids": torch.randint(1, 100, (int(torch.randint(2, 24, (1,), generator=generator)),))}
        for _ in range(ROWS)
    ]


def collate_tokens(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    ids = torch.nn.utils.rnn.pad_sequence([row["input_ids"] for row in rows], batch_first=True)
    mask = (ids != 0).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_a_split_step_of_a_router_loss_is_warned_of(tmp_path: Path) -> None:
    """Mixtral's load-balancing loss is over the tokens of each forward: a micro-batch's, not the batch's."""
    model = mixtral(0.5)
    fails_first(model.model.layers[0])
    adapted = adapt(trainer(tmp_path, model, tokens(), collate_tokens))
    with pytest.warns(UserWarning, match="output_router_logits=True"):
        adapted.train()
    assert adapted.training_step.stats.batch_size < ROWS


# A detector: its loss type says that its loss is normalised by the batch's boxes.


class TinyForObjectDetection(transformers.PreTrainedModel):  # type: ignore[misc]
    """A model whose class name gives it a detector's loss type, as Hugging Face names it; a loss of its own."""

    config_class = transformers.PretrainedConfig

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.backbone = torch.nn.Linear(4, 4)

    def forward(self, pixel_values: torch.Tensor, labels: Any = None, **kwargs: Any) -> Any:
        logits = self.backbone(pixel_values)
        loss = None
        if labels is not None:
            boxes = torch.stack([target["boxes"].mean(0) for target in labels])
            loss = (logits - boxes).square().sum(1).mean()
        return transformers.utils.ModelOutput(loss=loss, logits=logits)


def boxes() -> list[dict[str, Any]]:
    generator = torch.Generator().manual_seed(0)
    return [
        {
            "pixel_values": torch.randn(4, generator=generator, dtype=torch.float64),
            "labels": {"boxes": torch.rand(1 + index % 3, 4, generator=generator, dtype=torch.float64)},
        }
        for index in range(ROWS)
    ]


def collate_boxes(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "pixel_values": torch.stack([row["pixel_values"] for row in rows]),
        "labels": [row["labels"] for row in rows],
    }


def test_a_split_step_of_a_detectors_loss_type_is_warned_of(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyForObjectDetection(transformers.PretrainedConfig()).double()  # loss_type, or else its class name
    fails_first(model.backbone)
    adapted = adapt(trainer(tmp_path, model, boxes(), collate_boxes))
    with pytest.warns(UserWarning, match=r"normalised by the whole batch's boxes"):
        adapted.train()
    assert adapted.training_step.stats.batch_size < ROWS


# A contrastive model: no labels, and a loss over pairs of the batch's rows (CLIP's, with return_loss=True).


def clip() -> Any:
    torch.manual_seed(0)
    config = transformers.CLIPConfig(
        text_config={
            "vocab_size": 100,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "max_position_embeddings": 16,
        },
        vision_config={
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 8,
            "patch_size": 4,
        },
        projection_dim=8,
    )
    return transformers.CLIPModel(config).double()


def pairs() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        {
            "input_ids": torch.randint(1, 100, (6,), generator=generator),
            "pixel_values": torch.randn(3, 8, 8, generator=generator, dtype=torch.float64),
        }
        for _ in range(ROWS)
    ]


def collate_pairs(rows: list[dict[str, torch.Tensor]], return_loss: bool | None = True) -> dict[str, Any]:
    batch: dict[str, Any] = {
        "input_ids": torch.stack([row["input_ids"] for row in rows]),
        "pixel_values": torch.stack([row["pixel_values"] for row in rows]),
    }
    return batch if return_loss is None else {**batch, "return_loss": return_loss}


def test_a_split_step_of_a_contrastive_loss_is_warned_of(tmp_path: Path) -> None:
    # Each micro-batch compares its rows with its own others only: the logged loss fell from about
    # log 8 to log 4 and the parameters differed, without a word (probe 71E).
    model = clip()
    fails_first(model.text_model)
    adapted = adapt(trainer(tmp_path, model, pairs(), collate_pairs))
    with pytest.warns(UserWarning, match=r"compares each row with the others a forward is given .* as CLIP's"):
        adapted.train()
    assert adapted.training_step.stats.batch_size < ROWS


@pytest.mark.parametrize("return_loss", [True, None], ids=["with-loss", "outputs-only"])
def test_a_split_prediction_step_of_a_contrastive_model_is_warned_of(tmp_path: Path, return_loss: bool | None) -> None:
    # Its logits per image hold a column per text of a micro-batch: (8, 4) where the plain trainer
    # gives (8, 8), and with no loss asked for, nothing was said (probe 71F).
    model = clip()
    fails_first(model.text_model)
    collate = functools.partial(collate_pairs, return_loss=return_loss)
    adapted = adapt(trainer(tmp_path, model, pairs(), collate))
    with pytest.warns(UserWarning, match=r"prediction step of CLIPModel .* as with a smaller eval batch size"):
        adapted.predict(pairs())
    assert adapted.prediction_step.stats.batch_size < ROWS
