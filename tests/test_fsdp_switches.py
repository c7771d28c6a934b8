"""FSDP2's public switches flipped around ``koila.accumulate`` steps, on two gloo ranks on 127.0.0.1.

Each group runs one scenario of ``tests/_fsdp_switch_ranks.py`` (see tests/_spawn.py): a switch that
changes FSDP2's collectives, flipped after a step recorded them, then failures on one rank; an all-reduce
hook of the user's; FSDP2's own comm setters after a step. Every step's gradients are compared with a
hand FSDP2 step's on a copy of the model, sharded and switched the same way. A group that hangs is
killed at ``DEADLINE``, and its scenario fails saying so.
"""

from __future__ import annotations

from typing import Any

import _fsdp_switch_ranks
import pytest
import torch
from _fsdp_ranks import ROWS
from _spawn import Groups

# Seconds a group may take: a guard against ranks that hang, not a measure of speed. About 10 s a group here.
DEADLINE = 240.0
pytestmark = pytest.mark.timeout(2 * DEADLINE + 120)


@pytest.fixture(scope="module")
def groups(tmp_path_factory: pytest.TempPathFactory) -> Groups:
    return Groups(_fsdp_switch_ranks, tmp_path_factory, DEADLINE)


def _check_steps(value: dict[str, Any], rank: int, name: str) -> None:
    """Every step's gradients and the final parameters are the hand FSDP2 step's; the failing steps failed."""
    for number, step in enumerate(value["steps"]):
        assert (step["ooms"] >= 1) is (number > 0), (rank, name, number, step["ooms"])
        if number:  # the first size failed on rank 1: every rank went on with smaller micro-batches
            assert step["rows"][0] == ROWS // 2 > step["rows"][-1], (rank, name, number, step["rows"])
        for index, (got, want) in enumerate(zip(step["grads"], step["expected"], strict=True)):
            torch.testing.assert_close(
                got, want, rtol=1e-10, atol=1e-12, msg=lambda m, i=index, n=number: f"{name}, step {n}, param {i}: {m}"
            )
    for got, want in zip(value["parameters"], value["expected_parameters"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("group", list(_fsdp_switch_ranks.GROUPS))
def test_no_group_hangs_or_aborts(groups: Groups, group: str) -> None:
    problem = groups(group).problem
    assert problem is None, problem


@pytest.mark.parametrize("name", list(_fsdp_switch_ranks.SWITCHES))
def test_a_switch_flipped_between_steps_makes_a_new_kind_voted_then_played(groups: Groups, name: str) -> None:
    """The failed rank played the old record's collectives while the other waited in the exchange: a hang."""
    values = groups(name)[f"fsdp_switch_{name}"]
    for rank, value in enumerate(values):
        _check_steps(value, rank, name)
        # The step after the switch ran its first micro-batch under the vote: nothing was played.
        assert value["steps"][1]["plays"] == 0, (rank, name)
    # The step after that found the new kind recorded, and the failed rank played along, unless its
    # all-gathers are a custom comm's, which keep the vote.
    played = [value["steps"][2]["plays"] for value in values]
    assert (played[1] > 0) is (name != "custom_all_gather"), (name, played)
    assert played[0] == 0, (name, played)


def test_an_all_reduce_hook_that_makes_a_collective_keeps_the_vote(groups: Groups) -> None:
    """The hook's all-reduce was neither recorded nor played: gloo aborted the job on a size mismatch."""
    for rank, value in enumerate(groups("hook")["fsdp_all_reduce_hook"]):
        _check_steps(value, rank, "hook")
        # The last micro-batch, whose reduce-scatters the hook follows, is voted: nothing to play.
        assert [step["plays"] for step in value["steps"]] == [0, 0, 0], rank


def test_fsdps_comm_setters_work_after_a_step_and_the_next_steps_recover(groups: Groups) -> None:
    """A comm koila left in front of FSDP2's made its setters raise AssertionError after any step."""
    plain = ["DefaultAllGather", "DefaultReduceScatter"]
    allocated = ["ProcessGroupAllocAllGather", "ProcessGroupAllocReduceScatter"]
    values = groups("setters")["fsdp_comm_setters"]
    for rank, value in enumerate(values):
        _check_steps(value, rank, "setter")
        # Between calls, FSDP2's own comms; the setter's stay through the steps after it.
        assert [step["comms"] for step in value["steps"]] == [plain, allocated, allocated], rank
        assert value["turned_off"] == plain, rank
    # The setter's comms make the plain collectives: the record still served, and the failed rank played along.
    assert values[1]["steps"][2]["plays"] > 0
