"""Hugging Face's Trainer under FSDP2 (accelerate's plugin, ``fully_shard``): two gloo ranks on 127.0.0.1 (issue 42).

Both ranks run every scenario of ``tests/_trainer_fsdp_ranks.py`` in turn (see tests/_spawn.py): a
plain trainer with nothing failing, then the adapted one whose rank 1 runs out of memory in a
forward and in a backward. No rank may wait for another that split its step: a failed rank plays
along the others' collectives and the ranks agree on every micro-batch size; a hang ends the group
at ``DEADLINE``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
import _trainer_fsdp_ranks
from _spawn import Group, Groups

# Seconds the group may take for all its scenarios: a guard against ranks that hang, not a
# measure of speed. About 20 s here when idle.
DEADLINE = 300.0
pytestmark = pytest.mark.timeout(DEADLINE + 120)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Group:
    return Groups(_trainer_fsdp_ranks, tmp_path_factory, DEADLINE)("two")


def test_no_rank_hangs(ranks: Group) -> None:
    assert ranks.problem is None, ranks.problem


def test_hf_trainer_under_fsdp2_trains_and_evaluates_as_with_nothing_failing(ranks: Group) -> None:
    values = ranks["hf_fsdp2_training"]
    for index, (mine, theirs) in enumerate(zip(values[0]["parameters"], values[1]["parameters"], strict=True)):
        assert torch.equal(mine, theirs), f"parameter {index} differs between the ranks"
    for rank, value in enumerate(values):
        # Sharded by accelerate's FSDP2 plugin, not wrapped in DistributedDataParallel.
        assert value["distributed"] == ("FSDP", "FSDP")
        assert (value["wrapped"], value["sharded"]) == ("FSDPGPT2LMHeadModel", "DTensor")
        assert value["warnings"] == []
        # Rank 1 ran out of memory twice at a whole batch of 4 rows (in a forward, then in a backward),
        # and once in a micro-batch of 2: every rank ran the same steps again in smaller micro-batches;
        # then in an evaluation forward.
        assert value["events"][:3] == [(4, 1), (4, 1), (2, 1)], value["events"]
        assert value["ooms"] == 3
        assert value["evaluation_ooms"] == 1
        assert value["events"][3][1] == 1, value["events"]
        evaluated, expected = value["eval_loss"]
        assert evaluated == pytest.approx(expected, rel=1e-12)
        steps, expected_steps = value["steps"]
        assert steps == expected_steps == 3
        # float64 throughout (the loss included): what differs is the order of the sums.
        torch.testing.assert_close(*value["losses"], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(*value["grad_norms"], rtol=1e-10, atol=1e-12)
        for index, (mine, theirs) in enumerate(zip(value["parameters"], value["expected"], strict=True)):
            torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-12, msg=f"rank {rank}, parameter {index}")
    trained, evaluated = values[1]["rows"]
    # The forwards that failed ran the whole batch, and the ranks ran it again in micro-batches.
    assert trained[0] == trained[5] == 4, trained
    assert trained[6:8] == [2, 2], trained
    assert max(evaluated[1:]) < evaluated[0], evaluated
    # The micro-batch's backward failed with its kind's collectives recorded: rank 1 played along the rest.
    assert values[1]["plays"] > 0, values[1]["plays"]
    assert values[0]["plays"] == 0, values[0]["plays"]


def test_hf_trainer_under_fsdp2_trains_after_each_evaluation_as_with_nothing_failing(ranks: Group) -> None:
    # An evaluation leaves FSDP2's root gathered, its unsharded parameters registered on it: the sharded
    # ones' gradients of the attempt rank 1 failed (rank 0's reduce-scattered) were never dropped.
    values = ranks["hf_fsdp2_training_after_evaluation"]
    assert values[1]["plays"] > 0, "rank 1 did not play along a recorded micro-batch"
    for rank, value in enumerate(values):
        assert value["warnings"] == []
        assert value["steps"] == (3, 3)
        assert value["events"] == [(4, 1)], value["events"]
        assert value["rows"] == [4, 8, 4, 8, 4, 2, 2, 8], value["rows"]  # each step, then its evaluation
        for index, (mine, theirs) in enumerate(zip(value["parameters"], value["expected"], strict=True)):
            torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-14, msg=f"rank {rank}, parameter {index}")


def test_hf_trainer_under_fsdp2_gives_up_on_every_rank_together(ranks: Group) -> None:
    values = ranks["hf_fsdp2_exhausted_on_one_rank"]
    for value in values:
        assert value.get("type") == "BatchSizeExhausted", value
    assert "Rank 1 of 2 ran out of memory" in values[0]["message"]


def test_hf_trainer_under_fsdp1_is_refused_by_name(ranks: Any) -> None:
    for value in ranks["hf_fsdp1_refused"]:
        assert value["version"] == 1
        assert value.get("type") == "NotImplementedError", value
        assert "runs under FSDP1 (FullyShardedDataParallel)" in value["message"], value["message"]
        assert "adapt serves FSDP2: fsdp_config={'version': 2" in value["message"], value["message"]


def test_a_model_sharded_as_transformers_loaded_it_is_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its trainer all-reduces the gradients of trainable parameters outside FSDP2 inside each backward."""
    from _hf_trainer import make_trainer

    from koila_retry.integrations.transformers import adapt

    trainer = make_trainer(tmp_path)
    # Loading a model sharded needs a process group and a checkpoint: the flag the trainer sets for it stands in.
    monkeypatch.setattr(trainer, "is_distributed_loading_by_transformers", True, raising=False)
    with pytest.raises(NotImplementedError, match=r"its model was sharded as transformers loaded it \(from_pretrained"):
        adapt(trainer)
    assert "koila_adapted_steps" not in vars(trainer)
