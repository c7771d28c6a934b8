"""Real Hugging Face models, built from tiny configs (no downloads): dict batches, token means, model outputs."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import koila_retry as koila
from koila_retry.testing import simulated_device

transformers = pytest.importorskip("transformers")

VOCAB, IGNORED = 97, -100


def gradients(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def worst_relative_error(split: list[torch.Tensor], whole: list[torch.Tensor]) -> float:
    """The largest error over parameters, each relative to its gradient's largest entry.

    A gradient that is zero in exact arithmetic (a key's bias under softmax) is rounding
    noise 1e-20 of the model's: each is measured against a millionth of the largest at least.
    """
    assert len(split) == len(whole) > 0
    floor = 1e-6 * max(b.abs().max().item() for b in whole)
    return max(((a - b).abs().max() / b.abs().max().clamp_min(floor)).item() for a, b in zip(split, whole))


def assert_same_gradients(split: list[torch.Tensor], whole: list[torch.Tensor]) -> None:
    assert worst_relative_error(split, whole) < 1e-6


def whole_and_split(model: torch.nn.Module, step: Callable[[Any], Any], batch: Any, **options: Any) -> Any:
    """Return the gradients of the whole batch and of ``accumulate``, and what the split step returned."""
    model.zero_grad()
    loss = step(batch)
    (loss if isinstance(loss, torch.Tensor) else loss.loss).backward()
    whole = gradients(model)
    model.zero_grad()
    wrapped = koila.accumulate(step, **options)
    returned = wrapped(batch)
    assert wrapped.stats.batch_size < len(batch["input_ids" if "input_ids" in batch else "pixel_values"])
    return whole, gradients(model), returned, loss


def gpt2(**config: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    settings: dict[str, Any] = {"n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": VOCAB, "n_positions": 64}
    settings.update(bos_token_id=0, eos_token_id=0, **config)
    # Dropout off, as in most modern models: a split step then equals the whole one bit for bit in float64.
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**settings)).double()
    return model.eval()


def padded_lm_batch(rows: int = 6, length: int = 12) -> Any:
    """A right-padded causal-LM batch as a collator returns it: rows with very different token counts."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (rows, length), generator=generator)
    mask = torch.ones(rows, length, dtype=torch.long)
    for row, kept in enumerate([12, 3, 9, 5, 12, 2][:rows]):
        mask[row, kept:] = 0
    labels = ids.masked_fill(mask == 0, IGNORED)
    return transformers.BatchEncoding({"input_ids": ids, "attention_mask": mask, "labels": labels})


def tokens(batch: Any) -> torch.Tensor:
    # The model shifts its labels: the first token of each row predicts nothing.
    return (batch["labels"][:, 1:] != IGNORED).sum()


def test_causal_lm_token_mean_is_exact_with_weight() -> None:
    model, batch = gpt2(), padded_lm_batch()

    def step(batch: Any) -> torch.Tensor:
        assert type(batch) is transformers.BatchEncoding
        return model(**batch).loss

    whole, split, loss, expected = whole_and_split(model, step, batch, initial=2, weight=tokens)
    assert_same_gradients(split, whole)
    # HF computes the loss in float32, whatever the model's dtype.
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-6, atol=0)


def test_causal_lm_without_weight_is_warned_about_and_off() -> None:
    model, batch = gpt2(), padded_lm_batch()

    def step(batch: Any) -> torch.Tensor:
        return model(**batch).loss

    with pytest.warns(UserWarning, match=r"labels with ignored entries \(-100\).*pass weight="):
        whole, split, _, _ = whole_and_split(model, step, batch, initial=2)
    assert worst_relative_error(split, whole) > 0.01  # rows weighed alike: not the token mean, hence the warning


def test_gpt2_default_outputs_with_its_key_value_cache() -> None:
    model, batch = gpt2(), padded_lm_batch()
    assert model.config.use_cache  # the default: past_key_values in every output

    def step(batch: Any) -> Any:
        return model(**batch)

    with pytest.warns(UserWarning, match=r"the result\['past_key_values'\] \(DynamicCache\)"):
        whole, split, output, expected = whole_and_split(model, step, batch, initial=4, weight=tokens)
    assert_same_gradients(split, whole)
    assert type(output) is type(expected)
    assert output.past_key_values is None
    torch.testing.assert_close(output.logits, expected.logits.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(output.loss, expected.loss.detach(), rtol=1e-6, atol=0)


def bert_classifier() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForSequenceClassification(config).double()


def classification_batch(rows: int = 7) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    mask = torch.ones(rows, 10, dtype=torch.long)
    mask[::2, 6:] = 0
    return {
        "input_ids": torch.randint(1, VOCAB, (rows, 10), generator=generator),
        "attention_mask": mask,
        "token_type_ids": torch.zeros(rows, 10, dtype=torch.long),
        "labels": torch.randint(0, 3, (rows,), generator=generator),
    }


def test_bert_classifier_with_a_dict_batch() -> None:
    model, batch = bert_classifier(), classification_batch()

    def step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(**batch).loss

    whole, split, _, _ = whole_and_split(model, step, batch, initial=2)
    assert_same_gradients(split, whole)


def test_vit_with_keyword_tensors_split_by_a_real_out_of_memory_error() -> None:
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        image_size=16,
        patch_size=4,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=4,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = transformers.ViTForImageClassification(config).double()
    pixels = torch.randn(16, 3, 16, 16, dtype=torch.float64)
    labels = torch.randint(0, 4, (16,))

    def loss(pixel_values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return model(pixel_values=pixel_values, labels=labels).loss

    model.zero_grad()
    loss(pixels, labels).backward()
    whole = gradients(model)
    model.zero_grad()
    step = koila.accumulate(loss, cache=koila.NoCache())
    with simulated_device("1.5MiB"):  # the whole step peaks at 1.8 MiB, half of it at 0.9 MiB
        step(pixel_values=pixels, labels=labels)
    assert step.stats.ooms >= 1
    assert step.stats.batch_size < 16
    assert_same_gradients(gradients(model), whole)


def test_chunked_inference_over_an_encoder_with_keyword_tensors_equals_the_whole_pass() -> None:
    model = bert_classifier().bert.eval()
    batch = classification_batch(9)
    del batch["labels"]
    with torch.no_grad():
        whole = model(**batch)
        chunked = koila.chunked(model, **batch, initial=4, cache=koila.NoCache())
    assert type(chunked) is type(whole)
    torch.testing.assert_close(chunked.last_hidden_state, whole.last_hidden_state, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(chunked.pooler_output, whole.pooler_output, rtol=1e-12, atol=1e-12)


def test_chunked_gpt2_with_its_default_config() -> None:
    model, batch = gpt2(), padded_lm_batch()
    del batch["labels"]
    with torch.no_grad():
        whole = model(**batch)
        with pytest.warns(UserWarning, match=r"past_key_values"):
            chunked = koila.chunked(
                model, input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], initial=4
            )
    torch.testing.assert_close(chunked.logits, whole.logits, rtol=1e-12, atol=1e-12)
    assert chunked.past_key_values is None


def test_estimate_takes_a_batch_encoding() -> None:
    model, batch = gpt2(), padded_lm_batch()

    def step(batch: Any) -> None:
        model(**batch).loss.backward()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found = koila.estimate(step, batch)
    assert found.peak(12) > found.peak(6) > 0
    assert all(p.grad is None for p in model.parameters())  # the estimate wrote nothing


def fast_tokenizer() -> Any:
    """A fast tokenizer built from a word-level vocabulary: its encodings are per row (word_ids, tokens)."""
    tokenizers = pytest.importorskip("tokenizers")
    words = ["the", "a", "cat", "dog", "sat", "on", "mat", "big", "small", "red", "blue", "ran"]
    vocab = {"[PAD]": 0, "[UNK]": 1} | {word: index + 2 for index, word in enumerate(words)}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=model, pad_token="[PAD]", unk_token="[UNK]")


TEXTS = ["the cat", "a big red dog sat", "the mat", "small blue cat ran on the mat", "dog", "the a", "red", "cat"]


def last_words(batch: Any) -> torch.Tensor:
    """Each row's position of its last word's first token, read from the tokenizer's per-row alignment."""
    positions = []
    for row in range(len(batch["input_ids"])):
        words = batch.word_ids(row)
        positions.append(words.index(max(word for word in words if word is not None)))
    return torch.tensor(positions) + 0 * batch["input_ids"][:, 0]


def test_a_chunk_of_a_fast_tokenizers_batch_reads_its_own_rows_alignment() -> None:
    batch = fast_tokenizer()(TEXTS, padding=True, return_tensors="pt")
    expected = last_words(batch)
    assert len(set(expected.tolist())) > 2  # the rows differ: another row's answer would show
    # A real out-of-memory error splits the pass: each chunk's word_ids(i) is its own row i's.
    events: list[koila.OOMEvent] = []
    with simulated_device("1KiB"):
        got = koila.chunked(
            lambda b: last_words(b) + torch.zeros(len(b["input_ids"]), 64)[:, 0].long(), batch, on_oom=events.append
        )
    assert torch.equal(got, expected)
    assert events
    assert torch.equal(koila.chunked(last_words, batch, initial=3), expected)
    assert batch.word_ids(0) == [0, 1, None, None, None, None, None]  # the caller's batch keeps its encodings


def test_a_fast_tokenizers_batch_beside_tensors_or_another_batch_keeps_its_rows_alignment() -> None:
    tokenizer = fast_tokenizer()
    batch, other = (
        tokenizer(TEXTS, padding=True, return_tensors="pt"),
        tokenizer(TEXTS[::-1], return_tensors="pt", padding=True),
    )
    expected = last_words(batch)
    got = koila.chunked(lambda b: last_words(b["batch"]), {"mask": batch["attention_mask"], "batch": batch}, initial=3)
    assert torch.equal(got, expected)
    both = koila.chunked(
        lambda pair: torch.stack([last_words(pair[0]), last_words(pair[1])], 1), (other, batch), initial=3
    )
    assert torch.equal(both, torch.stack([last_words(other), expected], 1))
    along = koila.chunked(lambda b: last_words(b)[:, None], batch, initial=3, dim=-2)  # rows along dim -2 too
    assert torch.equal(along, expected[:, None])


def test_a_fast_tokenizers_batch_split_along_tokens_has_no_alignment_to_give() -> None:
    batch = fast_tokenizer()(TEXTS, padding=True, return_tensors="pt")
    with pytest.raises(ValueError, match="word_ids"):
        koila.chunked(last_words, batch, initial=3, dim=1)
