"""The trainers' integrations under DDP: two gloo ranks on 127.0.0.1, rank 1 short of memory (issue 29).

Both ranks run every scenario of ``tests/_trainer_ranks.py`` in turn (see tests/_spawn.py): a plain
trainer with all the memory it wants, then the adapted one with rank 1 on a simulated device
where the whole batch does not fit. No rank may wait for another that split its step: the ranks
agree on every micro-batch size, and a hang ends the group at ``DEADLINE``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import koila_retry as koila

pytest.importorskip("transformers")
pytest.importorskip("lightning")
import _trainer_ranks
from _spawn import Groups

# Seconds the group may take for all its scenarios: a guard against ranks that hang, not a
# measure of speed. About 30 s here when idle.
DEADLINE = 300.0
pytestmark = pytest.mark.timeout(DEADLINE + 120)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return Groups(_trainer_ranks, tmp_path_factory, DEADLINE)("two")


def test_koila_warnings_are_told_apart_by_the_code_that_gives_them(tmp_path: Path) -> None:
    """Issue 38: in a checkout cloned into ``koila-retry``, every file's path holds "koila"."""
    clone = tmp_path / "koila-retry" / ".tox" / "py" / "site-packages" / "lightning" / "loops.py"
    trainer_code = compile('warnings.warn("Skipping val loop.", stacklevel=2)', str(clone), "exec")
    broken = tmp_path / "koila-retry-sizes.json"
    broken.write_text("[1, 2]")
    with _trainer_ranks.koila_warnings() as said:
        exec(trainer_code, {"__name__": "lightning.pytorch.loops", "warnings": warnings})
        koila.DiskCache(broken)  # warns with stacklevel pointing here, at the caller
    assert len(said) == 1
    assert "is not a koila-retry size cache" in said[0]


def assert_equal_on_both_ranks(values: list[dict[str, Any]]) -> None:
    """Both ranks end with the same parameters, bit for bit: DDP averaged the same gradients."""
    for index, (mine, theirs) in enumerate(zip(values[0]["parameters"], values[1]["parameters"], strict=True)):
        assert torch.equal(mine, theirs), f"parameter {index} differs between the ranks"


def test_hf_trainer_under_ddp_trains_and_evaluates_as_with_all_the_memory(ranks: Any) -> None:
    values = ranks["hf_training_and_evaluation"]
    assert_equal_on_both_ranks(values)
    for rank, value in enumerate(values):
        assert value["distributed"] == "MULTI_CPU"
        assert value["wrapped"] == "DistributedDataParallel"
        assert value["find_unused"] is True
        assert value["warnings"] == []
        # Rank 1 ran out of memory at the whole batch of 4 rows, as the plain trainer would; both
        # ranks then ran the same step as micro-batches.
        assert (4, 1) in value["events"], value["events"]
        assert value["training_ooms"] >= 1
        # DDP's own reducer averaged them, in each step's last backward (find_unused_parameters=True, as
        # the trainer wraps a PreTrainedModel): koila's fallback all-reduce never ran.
        assert value["averaged"] == 0
        assert value["evaluation_ooms"] >= 1
        steps, expected_steps = value["steps"]
        assert steps == expected_steps == 3
        torch.testing.assert_close(*value["losses"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(*value["grad_norms"], rtol=1e-5, atol=1e-6)
        for index, (mine, theirs) in enumerate(zip(value["parameters"], value["expected"], strict=True)):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6, msg=f"rank {rank}, parameter {index}")
        evaluated, expected = value["eval_loss"]
        assert evaluated == pytest.approx(expected, rel=1e-6)


def test_hf_trainer_under_ddp_gives_up_on_every_rank_together(ranks: Any) -> None:
    values = ranks["hf_exhausted_on_one_rank"]
    for value in values:
        assert value.get("type") == "BatchSizeExhausted", value
    assert "Rank 1 of 2 ran out of memory" in values[0]["message"]


@pytest.mark.parametrize(
    "name", ["lightning_training_and_validation", "lightning_unused_parameters", "lightning_parameter_hooks"]
)
def test_lightning_under_ddp_trains_and_validates_as_with_all_the_memory(ranks: Any, name: str) -> None:
    values = ranks[name]
    assert_equal_on_both_ranks(values)
    for rank, value in enumerate(values):
        assert value["strategy"] == "DDPStrategy"
        assert value["warnings"] == []
        assert (64, 1) in value["training_events"], value["training_events"]
        assert any(where == 1 for _, where in value["validation_events"]), value["validation_events"]
        assert value["steps"][0] == value["steps"][1] == 3
        assert value["averaged"] == 0  # DDP's own backward averaged them, once per batch
        for index, (mine, theirs) in enumerate(zip(value["parameters"], value["expected"], strict=True)):
            torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12, msg=f"rank {rank}, parameter {index}")
        validated, expected = value["validated"]
        assert validated[0].keys() == expected[0].keys() == {"val_loss", "val_max"}
        for metric in expected[0]:
            assert validated[0][metric] == pytest.approx(expected[0][metric], rel=1e-12)


def test_lightning_under_ddp_runs_a_parameters_hooks_once_per_batch(ranks: Any) -> None:
    for value in ranks["lightning_parameter_hooks"]:
        mine, plain = value["accumulated"]
        assert mine == plain > 0, value["accumulated"]


def test_lightning_under_ddp_gives_up_on_every_rank_together(ranks: Any) -> None:
    values = ranks["lightning_exhausted_on_one_rank"]
    for value in values:
        assert value.get("type") == "BatchSizeExhausted", value
    assert "Rank 1 of 2 ran out of memory" in values[0]["message"]
