"""Train with Hugging Face's ``Trainer`` on batches that do not fit: ``adapt`` turns the OOM into micro-batches.

A small GPT-2 is built from a config (random weights, nothing downloaded) and trained by a
plain ``transformers.Trainer`` on padded batches of 8 rows whose padding is labelled -100.
A simulated device stands in for a small GPU: tensors created inside it count against its
limit, and going over it raises a real ``torch.OutOfMemoryError``. The plain trainer
crashes there. The same trainer after ``adapt(trainer)`` runs each step that does not fit
as micro-batches of the same batch, normalised as the trainer normalises the whole batch
(its ``num_items_in_batch``), so it logs the same losses and ends at the same weights as an
unlimited run: the batch size, the accumulation steps and the schedule are unchanged.

With koila-retry installed from a clone, as the README says
(``pip install -c constraints.txt '.[progress,plot]'``), and its ``transformers`` extra, run::

    pip install -c constraints.txt '.[transformers]'
    python examples/trainer_transformers.py
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers

from koila_retry.integrations.transformers import adapt
from koila_retry.testing import simulated_device

VOCAB = 100


def model() -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=64)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0  # dropout would differ per micro-batch
    return transformers.GPT2LMHeadModel(config)


def rows(count: int = 32) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(2, 24, (count,), generator=generator).tolist()
    return [{"input_ids": torch.randint(1, VOCAB, (n,), generator=generator)} for n in lengths]


def collate(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    length = max(len(row["input_ids"]) for row in batch)
    ids = torch.zeros(len(batch), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for index, row in enumerate(batch):
        ids[index, : len(row["input_ids"])] = row["input_ids"]
        mask[index, : len(row["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def trainer(output: str, steps: int) -> Any:
    args = transformers.TrainingArguments(
        output_dir=output,
        per_device_train_batch_size=8,
        max_steps=steps,
        learning_rate=0.1,
        optim="sgd",
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=1,
        seed=0,
    )
    return transformers.Trainer(model=model(), args=args, train_dataset=rows(), data_collator=collate)


def losses(done: Any) -> list[float]:
    return [entry["loss"] for entry in done.state.log_history if "loss" in entry]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--memory", default="1MiB", help="the simulated device's memory (default: 1MiB)")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps (default: 4)")
    options = parser.parse_args()
    try:  # read as the simulated device reads it
        limit = simulated_device(options.memory).limit
    except ValueError as error:
        parser.error(f"--memory: {error}")
    if limit < 1:
        parser.error(f"--memory must be more than 0 bytes, like 16MiB, got {options.memory!r}")
    if options.steps < 1:
        parser.error("--steps must be >= 1")
    transformers.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as output:
        unlimited = trainer(output, options.steps)
        unlimited.train()
        plain = trainer(output, options.steps)
        try:
            with simulated_device(options.memory):
                plain.train()
            print(f"The plain trainer fits in {options.memory}: try a smaller --memory.")
        except torch.OutOfMemoryError as error:
            print(f"The plain trainer on {options.memory}: {str(error).split('.')[0]}.")

        def said(event: Any) -> None:  # on_oom: called after each out-of-memory error, once memory is released
            print(f"  {event.function}: out of memory at {event.batch_size} rows, next {event.next_batch_size}")

        adapted = adapt(trainer(output, options.steps), on_oom=said)
        with simulated_device(options.memory):
            adapted.train()
    print(
        f"The adapted trainer on {options.memory}: {adapted.state.global_step} steps of 8 rows, as asked, "
        f"with gradient_accumulation_steps={adapted.args.gradient_accumulation_steps}."
    )
    same_losses = torch.allclose(torch.tensor(losses(adapted)), torch.tensor(losses(unlimited)), rtol=1e-5)
    print(f"Logged losses match an unlimited run: {same_losses}")
    same = all(
        torch.allclose(mine, theirs, rtol=1e-5, atol=1e-6)
        for mine, theirs in zip(adapted.model.parameters(), unlimited.model.parameters())
    )
    print(f"Parameters match an unlimited run: {same}")


if __name__ == "__main__":
    try:
        main()
    except torch.OutOfMemoryError as error:  # before the first retry: the model itself does not fit
        raise SystemExit(f"error: {str(error).splitlines()[0]} (try a larger --memory)") from None
