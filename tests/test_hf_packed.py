"""A packed batch under ``adapt``: one row of many sequences, whose sequence boundaries are never cut.

``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` adds ``cu_seq_lens_q`` and
``cu_seq_lens_k`` (one entry per sequence, and one more) to a row of all the sequences. As the only
tensors of more than one row, they were taken for the batch's rows: each part ran the whole row with
a part of the boundaries (wrong for flash attention's varlen kernel), and a prediction raised.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _hf_trainer import make_trainer  # noqa: E402 (after the skip)

import koila_retry as koila  # noqa: E402
from koila_retry.integrations.transformers import adapt  # noqa: E402
from koila_retry.testing import oom_for  # noqa: E402

SEQUENCES = 8


def packed(rows: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """Pack the rows into one, with the boundaries flash attention's varlen kernel reads."""
    ids = [row["input_ids"] for row in rows]
    lengths = torch.tensor([0] + [len(row) for row in ids])
    boundaries = lengths.cumsum(0).to(torch.int32)
    tokens = torch.cat(ids)[None]
    labels = torch.cat([torch.cat([torch.tensor([-100]), row[1:]]) for row in ids])[None]
    position_ids = torch.cat([torch.arange(len(row)) for row in ids])[None]
    longest = int(lengths.max())
    return {
        "input_ids": tokens,
        "labels": labels,
        "position_ids": position_ids,
        "cu_seq_lens_q": boundaries,
        "cu_seq_lens_k": boundaries.clone(),
        "max_length_q": longest,
        "max_length_k": longest,
    }


def trainer(tmp_path: Path) -> Any:
    made = make_trainer(tmp_path, per_device_train_batch_size=SEQUENCES, per_device_eval_batch_size=SEQUENCES)
    if not any(p.kind is p.VAR_KEYWORD for p in inspect.signature(made.model.forward).parameters.values()):
        pytest.skip("this transformers' GPT-2 takes no attention kwargs (cu_seq_lens_q)")
    made.data_collator = packed
    return made


def watched(model: Any) -> list[tuple[int, ...]]:
    """Record the boundaries every forward of ``model`` is given, and fail its first forward."""
    inject, seen = oom_for(1), []

    def hook(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        seen.append(tuple(kwargs["cu_seq_lens_q"].shape))
        inject()

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def test_a_packed_batch_trains_as_the_plain_trainer_trains_it(tmp_path: Path) -> None:
    plain = trainer(tmp_path / "plain")
    plain.train()
    adapted = adapt(trainer(tmp_path / "adapted"))
    adapted.train()
    for mine, theirs in zip(adapted.model.parameters(), plain.model.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs)


def test_a_packed_batch_that_runs_out_of_memory_is_one_row(tmp_path: Path) -> None:
    # Never cut: every forward gets every boundary, and the step gives up at its one row.
    adapted = adapt(trainer(tmp_path))
    seen = watched(adapted.model)
    with pytest.raises(koila.BatchSizeExhausted, match=r"tried failed \(1\)"):
        adapted.train()
    assert seen == [(SEQUENCES + 1,)]
    assert adapted.training_step.stats.ooms == 1


def test_a_packed_batch_predicted_out_of_memory_is_one_row(tmp_path: Path) -> None:
    adapted = adapt(trainer(tmp_path))
    seen = watched(adapted.model)
    with pytest.raises(koila.BatchSizeExhausted, match=r"tried failed \(1\)"):
        adapted.predict(adapted.train_dataset)
    assert seen == [(SEQUENCES + 1,)]


def test_boundaries_beside_several_rows_are_split_as_any_tensor() -> None:
    # Only one packed row passes its boundaries whole: beside several rows, each part would get them all.
    from koila_retry.integrations._transformers_packed import apart

    one = {"input_ids": torch.ones(1, 6), "cu_seq_lens_q": torch.tensor([0, 2, 6])}
    rest, boundaries = apart(one)
    assert set(rest) == {"input_ids"}
    assert set(boundaries) == {"cu_seq_lens_q"}
    several = {"input_ids": torch.ones(2, 6), "cu_seq_lens_q": torch.tensor([0, 6, 12])}
    assert apart(several) == (several, {})
