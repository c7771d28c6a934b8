"""Lightning's ModelParallelStrategy (FSDP2, ``fully_shard`` in ``configure_model``) under OOMRecovery (issue 42).

Both ranks run every scenario of ``tests/_lightning_fsdp_ranks.py`` in turn (see tests/_spawn.py): a
plain trainer with nothing failing, then OOMRecovery's, whose rank 1 runs out of memory in a forward
and in a backward. A hang ends the group at ``DEADLINE``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("lightning")
import _lightning_fsdp_ranks
from _spawn import Group, Groups

pytestmark = pytest.mark.timeout(300 + 120)
# Seconds the group may take for all its scenarios: a guard against ranks that hang, not a
# measure of speed. About 10 s here when idle.
DEADLINE = 300.0


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Group:
    return Groups(_lightning_fsdp_ranks, tmp_path_factory, DEADLINE)("two")


def test_no_rank_hangs(ranks: Group) -> None:
    assert ranks.problem is None, ranks.problem


def test_lightning_under_fsdp2_trains_and_validates_as_with_nothing_failing(ranks: Group) -> None:
    values = ranks["lightning_fsdp2_training_and_validation"]
    for index, (mine, theirs) in enumerate(zip(values[0]["parameters"], values[1]["parameters"], strict=True)):
        assert torch.equal(mine, theirs), f"parameter {index} differs between the ranks"
    for rank, value in enumerate(values):
        assert (value["strategy"], value["sharded"]) == ("ModelParallelStrategy", "DTensor")
        assert value["warnings"] == []
        # Rank 1 ran out of memory at the whole batch of 16 rows (forward), then at a micro-batch of
        # 8 (backward): every rank ran the same steps in smaller micro-batches.
        assert value["training_events"] == [(16, 1), (8, 1)], value["training_events"]
        assert value["validation_events"] == [(16, 1)], value["validation_events"]
        assert value["steps"][0] == value["steps"][1] == 3
        for index, (mine, theirs) in enumerate(zip(value["parameters"], value["expected"], strict=True)):
            torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-14, msg=f"rank {rank}, parameter {index}")
        validated, expected = value["validated"]
        assert validated[0]["val_loss"] == pytest.approx(expected[0]["val_loss"], rel=1e-12)
    trained, validated_rows = values[1]["rows"]
    assert trained[:5] == [16, 8, 8, 8, 8], trained
    assert max(trained[5:]) < 8, trained
    assert validated_rows == [16, 8, 8], validated_rows
    # The backward failed with its micro-batch's collectives recorded: rank 1 played along the rest.
    assert values[1]["plays"] > 0, values[1]["plays"]
    assert values[0]["plays"] == 0, values[0]["plays"]


def test_training_after_a_validation_inside_fit_hands_over_the_roots_gradients(ranks: Group) -> None:
    # A validation leaves FSDP2's root gathered, its unsharded parameters registered on it: the step's
    # gradients of the sharded ones, which the optimizer holds, were left in .grad for Lightning's
    # zero_grad to drop, with nothing failing, and every parameter drifted from the plain trainer's.
    values = ranks["lightning_fsdp2_validation_inside_fit"]
    # Rank 1 ran out of memory in the forward of a kind recorded after the first validation: it played along.
    assert values[1]["plays"] > 0, values[1]["plays"]
    for rank, value in enumerate(values):
        assert value["warnings"] == []
        assert value["steps"][0] == value["steps"][1] == 3
        assert value["events"] == [(16, 1)], value["events"]
        assert value["rows"][6:11] == [16, 8, 8, 8, 8], value["rows"]  # the failed batch again, and the next
        for index, (mine, theirs) in enumerate(zip(value["parameters"], value["expected"], strict=True)):
            torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-14, msg=f"rank {rank}, parameter {index}")


def test_predict_step_under_fsdp2_keeps_a_record_of_its_own(ranks: Group) -> None:
    # predict_step makes other collectives than validation_step: the failed rank played validation's
    # record along, while the other made predict_step's, and the ranks hung.
    for rank, value in enumerate(ranks["lightning_fsdp2_predict_after_validate"]):
        assert value["events"] == [(16, 1)], (rank, value["events"])
        assert value["rows"] == [16, 8, 8, 8, 8], (rank, value["rows"])  # two forwards per micro-batch
        predicted, expected = value["predicted"]
        assert len(predicted) == len(expected) == 1
        torch.testing.assert_close(predicted[0], expected[0], rtol=1e-12, atol=1e-14)


def test_lightning_under_fsdp2_gives_up_on_every_rank_together(ranks: Group) -> None:
    values = ranks["lightning_fsdp2_exhausted_on_one_rank"]
    for value in values:
        assert value.get("type") == "BatchSizeExhausted", value
    assert "Rank 1 of 2 ran out of memory" in values[0]["message"]


@pytest.mark.parametrize("name", ["FSDPStrategy", "DeepSpeedStrategy"])
def test_fsdp1_and_deepspeed_stay_refused_by_name(name: str) -> None:
    import lightning.pytorch.strategies as strategies
    from _lightning_trainer import MLP, stand_in

    from koila_retry.integrations.lightning import OOMRecovery

    kind = getattr(strategies, name)
    # Not constructed: DeepSpeed's needs deepspeed installed; setup reads only the strategy's type first.
    stand_in: Any = stand_in(strategy=kind.__new__(kind))
    model = MLP()
    with pytest.raises(RuntimeError, match=f"serves one device, DDP or FSDP2 .*; the trainer runs {name}"):
        OOMRecovery().setup(stand_in, model, "fit")
    assert "training_step" not in vars(model)
