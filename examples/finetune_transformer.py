"""Train a Hugging Face language model whose padded batches do not fit, with the whole batch's token mean.

A small GPT-2 is built from a config (random weights, nothing downloaded), with a word
tokenizer made from the training text itself. A ``DataLoader`` with Hugging Face's
language-modelling collator pads each batch to its longest sentence and marks the padding
with the label -100, as in real fine-tuning. The loss of a causal language model is the
mean over the tokens that are not padding, and rows hold very different numbers of them,
so splitting a batch by rows would give the wrong gradient. ``weight=`` tells
``koila.accumulate`` how many tokens each micro-batch's loss averages over; each
micro-batch's loss is weighted by its share of the batch's tokens, and the gradient is the
whole batch's.

A simulated device stands in for a small GPU: the tensors created inside it count against
its limit, and going over the limit raises a real ``torch.OutOfMemoryError``. The batches
do not fit whole; the steps run in micro-batches. At the end, the weights are compared with
those of the same steps taken on whole batches with no memory limit. The model is in
float64 and Hugging Face computes the loss in float32, so the two runs differ by float32
rounding only.

With koila-retry installed from a clone, as the README says
(``pip install -c constraints.txt '.[progress,plot]'``), and its ``transformers`` extra, run::

    pip install -c constraints.txt '.[transformers]'
    python examples/finetune_transformer.py
    python examples/finetune_transformer.py --memory 8MiB --batch 64
"""

from __future__ import annotations

import argparse
import copy
import random
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import DataCollatorForLanguageModeling, GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

import koila_retry as koila
from koila_retry.testing import simulated_device

WORDS = [
    "the",
    "a",
    "one",
    "two",
    "three",
    "red",
    "blue",
    "green",
    "cat",
    "dog",
    "bird",
    "runs",
    "sleeps",
    "sings",
    "near",
    "under",
    "over",
    "and",
]


def make_sentences(batches: int, rows: int, seed: int) -> list[str]:
    """Return sentences from a small vocabulary, their lengths varying within a batch and between batches."""
    rng = random.Random(seed)
    sentences = []
    for _ in range(batches):
        longest = rng.choice([10, 20, 30, 40])
        sentences += [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, longest))) for _ in range(rows)]
    return sentences


def make_tokenizer() -> PreTrainedTokenizerFast:
    """Return a word-level tokenizer with a padding token, made without downloading anything."""
    vocabulary = {word: index for index, word in enumerate(["[PAD]", "[UNK]", *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocabulary, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]")


def make_model(vocabulary: int) -> GPT2LMHeadModel:
    """Return a two-layer GPT-2 with dropout off, in float64, so a split step equals the whole one."""
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=vocabulary,
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config).double()


def tokens(batch: Any) -> torch.Tensor:
    """Count the tokens a micro-batch's loss averages over: the model shifts its labels by one."""
    return (batch["labels"][:, 1:] != -100).sum()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory", default="12MiB", help="the simulated device's memory (default: 12MiB)")
    parser.add_argument("--batch", type=int, default=32, help="sentences per batch (default: 32)")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps (default: 8)")
    options = parser.parse_args()
    try:  # read as the simulated device reads it
        limit = simulated_device(options.memory).limit
    except ValueError as error:
        parser.error(f"--memory: {error}")
    if limit < 1:
        parser.error(f"--memory must be more than 0 bytes, like 16MiB, got {options.memory!r}")
    if options.batch < 1 or options.steps < 1:
        parser.error("--batch and --steps must be >= 1")

    transformers.logging.set_verbosity_error()  # its notes about the tiny config's defaults
    tokenizer = make_tokenizer()
    sentences = make_sentences(options.steps, options.batch, seed=0)
    encoded = [tokenizer(sentence) for sentence in sentences]
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    loader = torch.utils.data.DataLoader(encoded, batch_size=options.batch, collate_fn=collator)

    model = make_model(len(tokenizer))
    reference = copy.deepcopy(model)
    # SGD, so that the comparison below sees gradients: Adam would divide a gradient that is
    # zero in exact arithmetic (a key's bias, under softmax) by its own rounding noise.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)

    @koila.accumulate(weight=tokens)
    def train_step(batch: Any) -> torch.Tensor:
        return model(**batch).loss  # the mean over the micro-batch's own tokens, as HF computes it

    batches = list(loader)
    losses = []
    with simulated_device(options.memory):
        for number, batch in enumerate(batches, start=1):
            optimizer.zero_grad()
            loss = train_step(batch)
            optimizer.step()
            losses.append(loss)
            rows, length = batch["input_ids"].shape
            print(
                f"step {number}: {rows} sentences padded to {length} tokens, {tokens(batch).item()} counted, "
                f"micro-batches of {train_step.stats.batch_size} rows, loss {loss.item():.4f}"
            )

    # The same steps on whole batches, with no memory limit.
    agree = True
    for batch, loss in zip(batches, losses):
        reference_optimizer.zero_grad()
        whole = reference(**batch).loss
        whole.backward()
        reference_optimizer.step()
        agree = agree and torch.allclose(loss, whole.detach(), rtol=1e-6, atol=0)
    stats = train_step.stats
    print(f"{stats.ooms} out-of-memory errors over {stats.calls} steps.")
    print(f"Losses match the whole batches' at every step: {agree}")
    # The model is in float64, but Hugging Face computes the loss in float32: the two runs
    # differ by float32 rounding.
    same = all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(model.parameters(), reference.parameters()))
    print(f"Parameters match whole-batch training: {same}")


if __name__ == "__main__":
    try:
        main()
    except torch.OutOfMemoryError as error:  # before the first retry: the model itself does not fit
        raise SystemExit(f"error: {str(error).splitlines()[0]} (try a larger --memory)") from None
