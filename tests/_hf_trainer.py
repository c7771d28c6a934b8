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


def make_trainer(tmp_path: Path, cls: Any = None, **arguments: Any) -> Any:
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
    return trainer_class(
        model=tiny_gpt2(),
        args=transformers.TrainingArguments(**settings),
        train_dataset=Rows(),
        eval_dataset=Rows(8, seed=2),
        data_collator=collate,
    )


def logged(trainer: Any, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def assert_same_training(adapted: Any, reference: Any) -> None:
    assert adapted.state.global_step == reference.state.global_step
    torch.testing.assert_close(logged(adapted, "loss"), logged(reference, "loss"), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logged(adapted, "grad_norm"), logged(reference, "grad_norm"), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logged(adapted, "learning_rate"), logged(reference, "learning_rate"))
    for (name, mine), (_, theirs) in zip(adapted.model.named_parameters(), reference.model.named_parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6, msg=name)
