"""A tiny Hugging Face Trainer for the tests: a 2-layer GPT-2 from a config, padded token rows, no downloads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

VOCAB, IGNORED = 100, -100


def tiny_gpt2() -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    # Dropout off: a split step then equals the whole one to rounding (its masks would differ).
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    return transformers.GPT2LMHeadModel(config)


def float64_gpt2(failures: dict[int, str] | None = None) -> Any:
    """The tiny GPT-2 in float64, with an Inject layer (tests/_layers.py) before its first block's activation."""
    from _layers import Inject

    model = tiny_gpt2()
    inject = Inject()
    inject.failures = dict(failures or {})
    mlp = model.transformer.h[0].mlp
    mlp.act = torch.nn.Sequential(inject, mlp.act)
    return model.double()


def injected(model: Any) -> Any:
    """The Inject layer of a :func:`float64_gpt2`."""
    return model.transformer.h[0].mlp.act[0]


def float64_loss_func(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
    """A causal LM's loss as Hugging Face divides it, in the logits' precision: the summed loss over the count.

    The model's own loss computes in float32 (``ForCausalLMLoss`` casts the logits); this keeps a float64
    model's step in float64, so that a split step can be compared with the whole one closely.
    """
    logits, labels = outputs.logits[..., :-1, :].flatten(0, 1), labels[..., 1:].flatten()
    return torch.nn.functional.cross_entropy(logits, labels, ignore_index=IGNORED, reduction="sum") / num_items_in_batch


class Rows(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Token rows of very different lengths, so that padded batches have rows of different token counts."""

    def __init__(self, count: int = 16, seed: int = 1) -> None:
        generator = torch.Generator().manual_seed(seed)
        lengths = torch.randint(2, 24, (count,), generator=generator).tolist()
        self.rows = [torch.randint(1, VOCAB, (length,), generator=generator) for length in lengths]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[index]}


def collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest row; padding's labels are -100."""
    length = max(len(row["input_ids"]) for row in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for index, row in enumerate(rows):
        ids[index, : len(row["input_ids"])] = row["input_ids"]
        mask[index, : len(row["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORED)}


def make_trainer(
    tmp_path: Path,
    cls: Any = None,
    *,
    model: Any = None,
    compute_loss_func: Any = None,
    data: Any = None,
    data_collator: Any = None,
    **arguments: Any,
) -> Any:
    """A trainer of ``cls`` over the tiny GPT-2 (or ``model``, with ``data`` for training and evaluation and its
    ``data_collator``); ``arguments`` are the TrainingArguments'."""
    settings: dict[str, Any] = {
        "output_dir": str(tmp_path),
        "per_device_train_batch_size": 8,
        "per_device_eval_batch_size": 8,
        "max_steps": 3,
        "learning_rate": 0.1,
        "optim": "sgd",
        "lr_scheduler_type": "linear",
        "max_grad_norm": 0.5,  # clipped on the full batch's gradient (its norm is about 1)
        "report_to": [],
        "save_strategy": "no",
        "use_cpu": True,
        "disable_tqdm": True,
        "logging_steps": 1,
        "seed": 0,
        "dataloader_num_workers": 0,
    }
    settings.update(arguments)
    trainer_class = cls or transformers.Trainer
    # Only where given: Trainer takes compute_loss_func from transformers 4.46 on.
    extra = {} if compute_loss_func is None else {"compute_loss_func": compute_loss_func}
    return trainer_class(
        model=tiny_gpt2() if model is None else model,
        args=transformers.TrainingArguments(**settings),
        train_dataset=Rows() if data is None else data,
        eval_dataset=Rows(8, seed=2) if data is None else data,
        data_collator=collate if data_collator is None else data_collator,
        **extra,
    )


def shifted_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
    """A causal LM's loss: the mean over the shifted labels, or their sum over ``num_items_in_batch`` when given."""
    logits, labels = logits[..., :-1, :].flatten(0, 1).float(), labels[..., 1:].flatten()
    if num_items_in_batch is None:
        return torch.nn.functional.cross_entropy(logits, labels, ignore_index=IGNORED)
    return torch.nn.functional.cross_entropy(logits, labels, ignore_index=IGNORED, reduction="sum") / num_items_in_batch


class MeanLoss(transformers.Trainer):  # type: ignore[misc]
    """The most common override: the model's own mean loss over the batch, ``num_items_in_batch`` ignored."""

    def compute_loss(
        self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        outputs = model(**inputs)
        return (outputs.loss, outputs) if return_outputs else outputs.loss


class SummedLoss(transformers.Trainer):  # type: ignore[misc]
    """An override that uses ``num_items_in_batch`` as Hugging Face's models do: the summed loss over that count."""

    def compute_loss(
        self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        outputs = model(**{key: value for key, value in inputs.items() if key != "labels"})
        loss = shifted_cross_entropy(outputs.logits, inputs["labels"], num_items_in_batch)
        return (loss, outputs) if return_outputs else loss


def mean_loss_func(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
    """A ``compute_loss_func`` that returns the batch's mean, ``num_items_in_batch`` ignored."""
    return shifted_cross_entropy(outputs.logits, labels)


def summed_loss_func(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
    """A ``compute_loss_func`` that divides the summed loss by ``num_items_in_batch``, as Hugging Face documents."""
    return shifted_cross_entropy(outputs.logits, labels, num_items_in_batch)


class CausalWrapper(torch.nn.Module):
    """A module around a causal LM that returns a tuple: nothing on it says that its labels shift."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = tiny_gpt2()

    def forward(
        self, input_ids: torch.Tensor, attention_mask: Any = None, labels: Any = None
    ) -> tuple[torch.Tensor, ...]:
        outputs = self.lm(input_ids=input_ids, attention_mask=attention_mask, labels=labels, use_cache=False)
        return (outputs.logits,) if labels is None else (outputs.loss, outputs.logits)


def logged(trainer: Any, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def assert_same_training(adapted: Any, reference: Any) -> None:
    assert adapted.state.global_step == reference.state.global_step
    # transformers 4 logs the loss rounded to 4 decimals: float rounding can flip the last one.
    places = 1e-4 if int(transformers.__version__.split(".")[0]) < 5 else 1e-6
    torch.testing.assert_close(logged(adapted, "loss"), logged(reference, "loss"), rtol=1e-5, atol=places)
    torch.testing.assert_close(logged(adapted, "grad_norm"), logged(reference, "grad_norm"), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logged(adapted, "learning_rate"), logged(reference, "learning_rate"))
    for (name, mine), (_, theirs) in zip(adapted.model.named_parameters(), reference.model.named_parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6, msg=name)


def tiny_bart(eos: int | None) -> Any:
    """A 1-layer BART in float64 whose generation stops at ``eos`` (none: at max_length only)."""
    torch.manual_seed(0)
    config = transformers.BartConfig(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=1024,  # wide: a prediction step of 8 rows runs out of memory where 2 rows fit
        decoder_ffn_dim=1024,
        max_position_embeddings=64,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=eos,
        decoder_start_token_id=0,
        forced_eos_token_id=None,
        init_std=1.0,  # confident logits: greedy tokens that rounding does not change
    )
    model = transformers.BartForConditionalGeneration(config).double()
    generation = model.generation_config
    generation.max_length = 20
    generation.eos_token_id, generation.forced_eos_token_id = eos, None
    generation.no_repeat_ngram_size, generation.num_beams = 0, 1
    return model


class Pairs(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Source and target token rows of different lengths, for a sequence-to-sequence model."""

    def __init__(self, count: int = 8, seed: int = 11) -> None:
        generator = torch.Generator().manual_seed(seed)

        def rows() -> list[torch.Tensor]:
            lengths = torch.randint(4, 20, (count,), generator=generator).tolist()
            return [torch.randint(3, VOCAB, (length,), generator=generator) for length in lengths]

        self.sources, self.targets = rows(), rows()

    def __len__(self) -> int:
        return len(self.sources)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.sources[index], "labels": self.targets[index]}


def collate_pairs(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad the sources with BART's pad token (1), the labels with -100."""
    sources = torch.nn.utils.rnn.pad_sequence([row["input_ids"] for row in rows], batch_first=True, padding_value=1)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(row["input_ids"]) for row in rows], batch_first=True)
    labels = torch.nn.utils.rnn.pad_sequence([row["labels"] for row in rows], batch_first=True, padding_value=IGNORED)
    return {"input_ids": sources, "attention_mask": mask, "labels": labels}


def make_seq2seq_trainer(tmp_path: Path, eos: int | None) -> Any:
    """A ``Seq2SeqTrainer`` over :func:`tiny_bart` that predicts by generating up to 40 tokens."""
    arguments = transformers.Seq2SeqTrainingArguments(
        output_dir=str(tmp_path),
        per_device_eval_batch_size=8,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        predict_with_generate=True,
        generation_max_length=40,  # beyond the model's own max_length, 20, up to which the trainer pads
        generation_num_beams=1,
    )
    return transformers.Seq2SeqTrainer(
        model=tiny_bart(eos), args=arguments, data_collator=collate_pairs, eval_dataset=Pairs()
    )
