"""``koila.accumulate`` over FSDP2 (``fully_shard``): two and three gloo ranks on 127.0.0.1 (issue 30).

Each group runs every scenario of ``tests/_fsdp_ranks.py`` in turn (see tests/_spawn.py): a sharded
model's step with out-of-memory errors injected in a rank's forward, another's backward, every rank,
a later attempt, and FSDP's own collectives as they allocate their buffers; then a second step that
runs normally. A group that hangs is killed at ``DEADLINE``, and its scenarios fail saying so.
"""

from __future__ import annotations

import math
import weakref

import _fsdp_ranks
import pytest
import torch
from _spawn import Groups

from koila_retry._core import sharded
from koila_retry.testing import simulated_device

# Seconds a group may take for all its scenarios: a guard against ranks that hang, not a measure of
# speed. About 15 s here when idle.
DEADLINE = 300.0
pytestmark = pytest.mark.timeout(2 * DEADLINE + 120)
WORLDS = ["two", "three"]
SCENARIOS = [f"fsdp_{name}" for name in _fsdp_ranks.SCENARIOS]
PLAYED = [f"fsdp_played_{name}" for name in _fsdp_ranks.PLAYED]


@pytest.fixture(scope="module")
def groups(tmp_path_factory: pytest.TempPathFactory) -> Groups:
    return Groups(_fsdp_ranks, tmp_path_factory, DEADLINE)


@pytest.mark.parametrize("world", ["one", *WORLDS])
def test_no_group_hangs(groups: Groups, world: str) -> None:
    problem = groups(world).problem
    assert problem is None, problem


@pytest.mark.parametrize(
    ("world", "name"),
    [(world, name) for world in WORLDS for name in SCENARIOS] + [("one", f"fsdp_{name}") for name in _fsdp_ranks.ALONE],
)
def test_a_sharded_step_recovers_to_the_whole_batchs_gradient(groups: Groups, world: str, name: str) -> None:
    values = groups(world)[name]
    first = values[0]
    for rank, value in enumerate(values):
        assert value["ooms"] >= 1, f"rank {rank} saw no out-of-memory error: the scenario tests nothing"
        # The same sizes on every rank, in the same order.
        assert value["events"] == first["events"], f"rank {rank} tried other sizes than rank 0"
        assert value["steps"][0]["size"] == first["steps"][0]["size"] < _fsdp_ranks.ROWS
        for number, step in enumerate(value["steps"]):
            for index, (got, want) in enumerate(zip(step["grads"], step["expected"], strict=True)):
                torch.testing.assert_close(
                    got, want, rtol=1e-10, atol=1e-12, msg=lambda m, i=index, n=number: f"step {n}, param {i}: {m}"
                )
        # The second step ran whole, without an out-of-memory error, at the size the first settled on.
        assert value["steps"][1]["rows"] == [value["steps"][1]["size"]] * len(value["steps"][1]["rows"])
        for got, want in zip(value["parameters"], value["expected_parameters"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        # Nothing of a failed attempt outlives it: no unsharded parameter, no communication buffer.
        # The trap: a failed backward's gradients left on FSDP2's unsharded parameters would add into the retry's.
        assert value["seen"] == {"unsharded": 0, "buffers": 0, "unsharded_grads": 0}, value["seen"]


@pytest.mark.parametrize(("world", "name"), [(world, name) for world in WORLDS for name in PLAYED])
def test_a_rank_that_fails_after_the_collectives_were_recorded_plays_along(
    groups: Groups, world: str, name: str
) -> None:
    values = groups(world)[name]
    first = values[0]
    # The second failing step (after the warm one) failed as the first did, with every kind of micro-batch it
    # ran recorded by then.
    assert sum(value["steps"][2]["plays"] for value in values) > 0, "no rank played along: the test tests nothing"
    for rank, value in enumerate(values):
        assert value["events"] == first["events"], f"rank {rank} tried other sizes than rank 0"
        assert len(value["events"]) >= 2 * (len(value["events"]) // 2) > 0
        for number, step in enumerate(value["steps"]):
            assert step["size"] == first["steps"][number]["size"]
            for index, (got, want) in enumerate(zip(step["grads"], step["expected"], strict=True)):
                torch.testing.assert_close(
                    got, want, rtol=1e-10, atol=1e-12, msg=lambda m, i=index, n=number: f"step {n}, param {i}: {m}"
                )
        for got, want in zip(value["parameters"], value["expected_parameters"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        assert value["seen"] == {"unsharded": 0, "buffers": 0, "unsharded_grads": 0}, value["seen"]
        # With nothing failing, a whole batch's step makes two exchanges (the start's and the one after
        # the attempt), not one before each of FSDP2's collectives.
        last = value["steps"][-1]
        assert last["rows"] == [_fsdp_ranks.ROWS], last["rows"]
        assert (last["exchanges"], last["plays"]) == (2, 0)


def test_a_custom_comm_keeps_the_vote_before_each_collective(groups: Groups) -> None:
    for rank, value in enumerate(groups("two")["fsdp_custom_comm"]):
        # Its collectives may be other than the plain ones a failed rank would play: nothing is recorded.
        assert [step["plays"] for step in value["steps"]] == [0, 0, 0], rank
        assert value["steps"][0]["size"] == value["steps"][1]["size"] < _fsdp_ranks.ROWS
        last = value["steps"][-1]
        assert last["rows"] == [_fsdp_ranks.ROWS], last
        assert last["exchanges"] > 2, last
        for number, step in enumerate(value["steps"]):
            for got, want in zip(step["grads"], step["expected"], strict=True):
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=lambda m, n=number: f"step {n}: {m}")
        assert value["seen"] == {"unsharded": 0, "buffers": 0, "unsharded_grads": 0}, value["seen"]


@pytest.mark.parametrize("world", WORLDS)
def test_a_rank_that_fails_before_its_forward_meets_the_others_as_theirs_begins(groups: Groups, world: str) -> None:
    values = groups(world)["fsdp_played_before_forward"]
    assert values[-1]["failed_before"], "the last rank did not fail: the test tests nothing"
    for value in values:
        torch.testing.assert_close(value["got"], value["expected"], rtol=1e-12, atol=1e-12)
        # Nothing was left to play: the failed rank had made no collective of the call.
        assert value["plays"] == 0
        # The others' first forward stopped at the exchange before it, then every rank ran smaller.
        assert max(value["rows"]) < _fsdp_ranks.ROWS, value["rows"]


@pytest.mark.parametrize("world", WORLDS)
def test_a_rank_that_fails_before_a_new_models_first_forward_meets_the_others(groups: Groups, world: str) -> None:
    """FSDP2 makes part of its state at the first forward: there was none to put back, and the rank raised."""
    values = groups(world)["fsdp_fails_before_the_models_first_forward"]
    for rank, value in enumerate(values):
        for kind, found in value.items():
            assert found["failed"] == (rank == len(values) - 1), f"rank {rank}, {kind}"
            assert found["ooms"] == 1, f"rank {rank}, {kind}"  # every rank ran the retry
            for got, want in zip(found["got"], found["expected"], strict=True):
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=lambda m, k=kind: f"{k}: {m}")


class _Shards:
    """What a watched collective reads of the running call's shards."""

    def __init__(self, kind: tuple[str, ...] | None, recording: list[object] | None) -> None:
        self.kind, self.recording, self.count, self.votes = kind, recording, 0, 0

    def vote(self) -> None:
        self.votes += 1


@pytest.mark.parametrize(
    ("kind", "recording", "votes", "recorded"),
    [
        (None, None, 0, None),  # no call running: the collective as it is
        (("step",), [], 1, 1),  # the first micro-batch of its kind: a vote, and a record
        (("step",), None, 0, None),  # recorded: neither
        ((), None, 1, None),  # outside any micro-batch (an inner module called alone): a vote
    ],
)
def test_a_watched_collective_votes_only_where_a_failed_rank_could_not_play_it(
    kind: tuple[str, ...] | None, recording: list[object] | None, votes: int, recorded: int | None
) -> None:
    from koila_retry._core import sharded

    class Comm:
        def __call__(self, *args: object, **kwargs: object) -> str:
            return "made"

    made = sharded._Watched(Comm(), gather=True)
    shards = None if kind is None else _Shards(None if kind == () else kind, recording)
    sharded._armed.shards = shards  # type: ignore[assignment]
    try:
        tensor = torch.zeros(2)
        assert made(output_tensor=tensor, input_tensor=tensor, group=Comm()) == "made"
    finally:
        sharded._armed.shards = None
    if shards is not None:
        assert (shards.votes, shards.count) == (votes, 1)
        assert (None if shards.recording is None else len(shards.recording)) == recorded
        if recorded:  # a custom comm's collective is recorded as one no rank can play
            assert shards.recording == [None]


def test_the_private_fsdp2_state_the_reset_touches_is_still_there(groups: Groups) -> None:
    """FSDP2 has no public way to abandon a step; the reset (koila_retry/_core/sharded.py) writes these."""
    for missing in groups("two")["fsdp_private_state"]:
        assert missing == {"state": [], "context": [], "comms": [], "group": [], "mesh": [], "param": []}, missing
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    assert TrainingState.IDLE.name == "IDLE"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("played", [False, True], ids=["voted", "played"])
@pytest.mark.parametrize("name", ["batch", "chunked", "attempts"])
def test_the_forward_front_ends_recover_over_a_sharded_model(
    groups: Groups, world: str, name: str, played: bool
) -> None:
    values = groups(world)[f"fsdp_{'played_' if played else ''}{name}"]
    # After a call that recorded the forward's collectives, the failed rank played along the rest of them.
    assert (values[-1]["plays"] > 0) is played, values[-1]["plays"]
    for rank, value in enumerate(values):
        torch.testing.assert_close(value["got"], value["expected"], rtol=1e-12, atol=1e-12)
        # The first forward ran the whole batch, and failed on the last rank: every rank then ran smaller.
        assert value["rows"][0] == _fsdp_ranks.ROWS
        assert max(value["rows"][1:]) < _fsdp_ranks.ROWS, f"rank {rank} ran {value['rows']}"
        # Nothing of the failed attempt outlived it (the root keeps its parameters unsharded after a
        # forward that succeeded, as FSDP2 does).
        assert value["unsharded"] == [0], value["unsharded"]


def test_a_call_over_two_models_sharded_apart_recovers_in_the_second_ones_forward(groups: Groups) -> None:
    # The second model's forward began a micro-batch of the same kind as the first's: the failed rank
    # played the first model's all-gathers while the others made the second's, and gloo aborted the job.
    for rank, value in enumerate(groups("two")["fsdp_two_models"]):
        for name, runs in value.items():
            for call, run in enumerate(runs):
                assert run["equal"], f"rank {rank}, {name}, call {call}"
                if call != 1:  # the last rank failed: every rank ran smaller after the whole batch
                    assert run["rows"][0] == _fsdp_ranks.ROWS, (rank, name, call, run["rows"])
                    assert max(run["rows"][1:]) < _fsdp_ranks.ROWS, (rank, name, call, run["rows"])


def test_a_sharded_forward_over_uneven_rows_is_said_to_need_as_many_rows_on_every_rank(groups: Groups) -> None:
    for rank, value in enumerate(groups("two")["fsdp_batch_over_uneven_rows"]):
        assert value["caught"].startswith("the ranks' collectives went out of step: some ranks agreed as a micro")
        assert "pad the inputs to one length" in value["caught"]
        assert "DDP" not in value["caught"], rank
        assert value["again"] == [_fsdp_ranks.ROWS, 1]  # the ranks stayed in step


def test_a_step_over_a_ddp_module_and_an_fsdp2_one_is_refused_on_every_rank(groups: Groups) -> None:
    for rank, value in enumerate(groups("two")["fsdp_with_a_ddp_module_in_one_step"]):
        assert "step trains a DistributedDataParallel module in a step that also reaches an FSDP2" in value["error"]
        assert value["ran"] == []  # before the function ran
        assert all(value["grads"])
        assert value["then"] == [_fsdp_ranks.ROWS], rank  # the ranks stayed in step


def test_one_wrapper_over_another_sharded_model_than_its_first_recovers_it(groups: Groups) -> None:
    for rank, value in enumerate(groups("two")["fsdp_one_wrapper_two_models"]):
        for name, run in value.items():
            assert run["equal"], f"rank {rank}, {name}"
            # The last rank failed the whole batch: every rank ran smaller after it.
            assert run["rows"][0] == _fsdp_ranks.ROWS, (rank, name, run["rows"])
            assert max(run["rows"][1:]) < _fsdp_ranks.ROWS, (rank, name, run["rows"])


def test_a_wrapper_without_agreement_given_a_sharded_model_after_a_plain_one_reduces_its_gradients(
    groups: Groups,
) -> None:
    for rank, value in enumerate(groups("two")["fsdp_alone_wrapper_given_a_sharded_model_after_a_plain_one"]):
        assert value["ooms"] == 1, rank
        assert value["rows"][0] == _fsdp_ranks.ROWS, value["rows"]
        assert max(value["rows"][1:]) < _fsdp_ranks.ROWS, value["rows"]
        for index, (got, want) in enumerate(zip(value["grads"], value["expected"], strict=True)):
            assert got is not None, f"rank {rank}, param {index}: no gradient"
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=lambda m, i=index: f"param {i}: {m}")


def test_a_step_after_a_forward_without_backward_sets_aside_the_sharded_gradients(groups: Groups) -> None:
    # The root's unsharded parameters were registered on it: the sharded ones' gradients, which the healthy
    # rank's finished attempt had reduce-scattered, were never dropped, and the retry added onto them.
    values = groups("two")["fsdp_step_after_a_forward_without_backward"]
    assert values[-1]["plays"] > 0, "the failed rank did not play along a recorded micro-batch"
    for rank, value in enumerate(values):
        assert value["registered"] == [True, True], f"rank {rank}: the root was not left gathered"
        assert value["ooms"] == 1, f"rank {rank}: {value['ooms']}"
        assert max(value["rows"][1:]) < _fsdp_ranks.ROWS, (rank, value["rows"])
        for index, (got, want) in enumerate(zip(value["grads"], value["expected"], strict=True)):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=lambda m, i=index: f"param {i}: {m}")


def test_two_steps_over_one_model_keep_records_of_their_own(groups: Groups) -> None:
    # The second step's micro-batch was of the same kind as the first's: the failed rank played the first
    # step's collectives while the others made the second's two forwards', and gloo aborted the job.
    for rank, value in enumerate(groups("two")["fsdp_two_steps_of_one_model"]):
        assert value["ooms"] == 1, f"rank {rank}: {value['ooms']}"
        # Its first call recorded under the vote: the failed rank had nothing to play along.
        assert value["plays"] == 0, f"rank {rank} played {value['plays']} collectives"
        assert value["rows"][0] == _fsdp_ranks.ROWS, (rank, value["rows"])
        assert max(value["rows"][1:]) < _fsdp_ranks.ROWS, (rank, value["rows"])
        for index, (got, want) in enumerate(zip(value["grads"], value["expected"], strict=True)):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=lambda m, i=index: f"param {i}: {m}")


def test_hsdp_the_estimate_and_an_fsdp2_without_the_private_state_are_refused_on_every_rank(groups: Groups) -> None:
    for value in groups("two")["fsdp_refusals"]:
        assert "sharded over a 2-D mesh: HSDP (replicated and sharded)" in value["hsdp"], value
        for name in ("auto", "auto later"):  # a sharded model given after another is refused too
            assert "with initial='auto': the estimate does not cover sharded modules yet" in value[name], value
        assert "private state lacks FSDPParamGroup._post_reduce_event" in value["private"], value


def test_leaves_of_no_module_keep_no_gradient_of_a_failed_attempt(groups: Groups) -> None:
    """A tensor the step holds, with a gradient from before, and the input: once each, after the retry."""
    for value in groups("two")["fsdp_leaves_outside_modules"]:
        assert value["size"] < _fsdp_ranks.ROWS
        for got, want in zip(value["grads"], value["expected"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(value["scale"], value["expected_scale"], rtol=1e-10, atol=1e-12)
        assert value["same_tensor"], "the gradient from before was not added into"
        torch.testing.assert_close(value["input"], value["expected_input"], rtol=1e-10, atol=1e-12)


def test_a_step_after_a_backward_without_gradient_sync_adds_onto_fsdps_unsharded_gradients(groups: Groups) -> None:
    """FSDP2's unsharded parameters are its own to clear: the walk for other leaves leaves them alone."""
    for value in groups("two")["fsdp_after_a_backward_without_sync"]:
        assert value["size"] == _fsdp_ranks.ROWS
        assert value["unsharded_grads"] == 0  # reduce-scattered, then cleared by FSDP2
        for got, want in zip(value["grads"], value["expected"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "name",
    [
        "fsdp_after_a_backward_without_sync_a_forward_fails",
        "fsdp_after_a_backward_without_sync_a_backward_fails",
        "fsdp_after_a_backward_without_sync_a_played_backward_fails",
        # The copy of those gradients the attempt adds onto: the healthy rank, in a micro-batch of a recorded
        # kind, made its collectives without a vote, and the failed rank, not yet in that micro-batch, played
        # none of them: both waited until the group's timeout.
        "fsdp_after_a_backward_without_sync_a_played_copy_fails",
        "fsdp_after_a_backward_without_sync_every_backward_fails_alone",
    ],
)
def test_a_failed_attempt_keeps_the_unsharded_gradients_of_the_callers_own_backward(groups: Groups, name: str) -> None:
    """What a backward of the caller's own left unsharded (sync off) survives the reset after a failed attempt."""
    values = groups("two")[name]
    assert [value["played"] for value in values] == ["played" in name, False]
    for value in values:
        assert value["size"] < _fsdp_ranks.ROWS  # the first attempt failed
        assert value["kept_unchanged"]  # the tensors the caller's backward left were never written
        assert value["unsharded_grads"] == 0
        assert value["warnings"] == []  # the play-along's collectives by their current names (torch 2.13)
        for got, want in zip(value["grads"], value["expected"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_a_forward_front_end_that_fails_keeps_the_unsharded_gradients_of_the_callers_own_backward(
    groups: Groups,
) -> None:
    # An evaluation in chunks between a hand loop's micro-batches: its reset after the failed attempt
    # dropped what the first micro-batch had accumulated unsharded, and the step's gradient was the second's.
    values = groups("two")["fsdp_after_a_backward_without_sync_a_forward_front_end_fails"]
    assert values[-1]["plays"] > 0, "the failed rank did not play along"
    for rank, value in enumerate(values):
        # The evaluation's whole batch failed, then ran in chunks; then the hand loop's second micro-batch.
        assert value["rows"] == [_fsdp_ranks.ROWS, 8, 4, 6], (rank, value["rows"])
        for output in value["outputs"]:
            torch.testing.assert_close(output, value["expected_output"], rtol=1e-10, atol=1e-12)
        for index, (got, want) in enumerate(zip(value["grads"], value["expected"], strict=True)):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=lambda m, i=index: f"param {i}: {m}")


def test_a_failed_attempt_keeps_the_callers_own_unsharded_sum_in_mixed_precision(groups: Groups) -> None:
    for value in groups("two")["fsdp_after_a_backward_without_sync_in_mixed_precision"]:
        assert value["kept_dtype"] == "torch.float64"  # FSDP2's unsharded_accumulated_grad, in the reduce dtype
        assert value["size"] == 8
        for got, want in zip(value["grads"], value["expected"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_a_step_that_gives_up_hands_back_the_unsharded_gradients_of_the_callers_own_backward(groups: Groups) -> None:
    for value in groups("two")["fsdp_after_a_backward_without_sync_gives_up"]:
        assert value == {"gave_up": True, "same_tensors": True, "unchanged": True, "sharded_grads": 0}


def test_ranks_with_different_numbers_of_rows_are_refused_on_every_rank_before_any_collective(groups: Groups) -> None:
    """Else the rank with more rows runs a micro-batch more, and waits in its all-gather forever."""
    for rank, value in enumerate(groups("two")["fsdp_uneven_rows"]):
        assert value["refused"].startswith("ValueError: ranks agreeing on a chunk size, or on a micro-batch size")
        assert f"this rank has {_fsdp_ranks.ROWS - 4 * rank}" in value["refused"]
        assert "Pad the inputs to the same length" in value["refused"]
        assert value["then"] == 4
        assert value["grads"] == 8


def test_a_module_outside_fsdp_keeps_no_gradient_of_a_failed_attempt(groups: Groups) -> None:
    for value in groups("two")["fsdp_unsharded_head"]:
        assert value["size"] < _fsdp_ranks.ROWS
        for got, want in zip(value["grads"], value["expected"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        for got, want in zip(value["head"], value["expected_head"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_a_failed_rank_plays_along_once_the_failed_attempt_held_in_a_cycle_is_collected(groups: Groups) -> None:
    for rank, value in enumerate(groups("two")["fsdp_play_along_after_an_attempt_held_in_a_cycle"]):
        assert value["result"] == "returned", f"rank {rank}: {value['result']}"
        assert value["failed"] == [(_fsdp_ranks.ROWS, 1)], f"rank {rank}: {value['failed']}"
        assert value["calls"][:2] == [_fsdp_ranks.ROWS] * 2, f"rank {rank}: {value['calls']}"
        assert max(value["calls"][2:]) < _fsdp_ranks.ROWS, f"rank {rank}: {value['calls']}"
        # Rank 1 failed in its forward, and played the rest of the whole batch's collectives.
        assert (value["plays"] > 0) == (rank == 1), f"rank {rank}: {value['plays']} played"
        for got, want in zip(value["grads"], value["expected"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "name",
    [
        "fsdp_last_micro_batch_weighs_nothing",
        "fsdp_first_micro_batch_weighs_nothing_on_one_rank",
        "fsdp_a_micro_batch_that_weighs_nothing_fails",
    ],
)
def test_a_micro_batch_that_weighs_nothing_runs_its_backward_with_zeros(groups: Groups, name: str) -> None:
    """FSDP2's collectives follow the backward: a micro-batch that ``weight=`` gives no item still runs it.

    Its loss is a mean over no rows (nan), whose own backward would spread 0/0: the gradients it writes are zeros.
    """
    for rank, value in enumerate(groups("two")[name]):
        assert value["ooms"] == ("fails" in name), f"rank {rank}: {value['ooms']}"
        assert math.isfinite(value["loss"]), f"rank {rank}: {value['loss']}"
        for index, (got, want) in enumerate(zip(value["grads"], value["expected"], strict=True)):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=lambda m, i=index: f"param {i}: {m}")


def test_a_weightless_micro_batch_writes_zeros_through_reentrant_checkpoints(groups: Groups) -> None:
    for rank, value in enumerate(groups("two")["fsdp_weightless_micro_batch_through_reentrant_checkpoints"]):
        for mode, found in value.items():
            for index, (got, want) in enumerate(zip(found["grads"], found["expected"], strict=True)):
                torch.testing.assert_close(
                    got, want, rtol=1e-10, atol=1e-12, msg=lambda m, i=index, w=mode, r=rank: f"{r}, {w}, {i}: {m}"
                )


def test_a_give_up_after_part_of_an_all_gathers_outputs_leaves_none_of_them_alive(groups: Groups) -> None:
    values = groups("two")["fsdp_gives_up_after_allocating_part_of_an_all_gathers_outputs"]
    assert values[-1]["calls"] >= 2, "the second allocation of all-gather outputs never came"
    for rank, value in enumerate(values):
        assert value["outcome"] == "gave up", f"rank {rank}: {value['outcome']}"
        assert value["left"] == [], f"rank {rank}: all-gather outputs still allocated: {value['left']}"
        assert value["grads"] == [None] * len(value["grads"]), f"rank {rank}: the step left gradients"


@pytest.mark.parametrize(
    ("world", "front", "played", "held"),
    [
        (world, front, played, held)
        for front in ("batch", "attempts")
        for played in (False, True)
        for held in (False, True)
        for world in (WORLDS[:1] if held else WORLDS)  # after a backward of the caller's own: two ranks
    ],
)
def test_a_function_that_trains_under_a_forward_front_end_gets_the_hand_loops_gradients(
    groups: Groups, world: str, front: str, played: bool, held: bool
) -> None:
    """Its own backward runs out of memory on the last rank: what that backward wrote goes with the attempt.

    The failed attempt's gradients left on FSDP2's unsharded parameters were kept and added into the retry's
    (wrong gradients on every rank), and the failed rank's next micro-batch was of another kind than the
    others' (one voted, the other did not: a hang). What a backward of the caller's own left there is kept.
    """
    name = f"fsdp_{front}_trains{'_played' if played else ''}{'_after_a_backward_without_sync' if held else ''}"
    values = groups(world)[name]
    assert (values[-1]["calls"][-1]["plays"] > 0) is played, values[-1]["calls"][-1]["plays"]
    for rank, value in enumerate(values):
        last = value["calls"][-1]
        assert last["rows"][0] == _fsdp_ranks.ROWS, (rank, last["rows"])
        assert max(last["rows"][1:]) < _fsdp_ranks.ROWS, (rank, last["rows"])
        for number, call in enumerate(value["calls"]):
            assert call["size"] == values[0]["calls"][number]["size"]
            assert call["unsharded_grads"] == 0, (rank, number)
            for index, (got, want) in enumerate(zip(call["grads"], call["expected"], strict=True)):
                torch.testing.assert_close(
                    got, want, rtol=1e-10, atol=1e-12, msg=lambda m, i=index, n=number: f"call {n}, param {i}: {m}"
                )


def test_tensor_parallel_layers_beside_a_sharded_block_are_refused_on_every_rank(groups: Groups) -> None:
    for value in groups("two")["fsdp_tensor_parallel_beside_a_sharded_block"]:
        for front, refused in value.items():
            assert "found DTensor parameters in Linear (tensor or sequence parallelism)" in refused, (front, refused)


def test_a_step_leaves_the_callers_gradient_sync_as_it_found_it(groups: Groups) -> None:
    """The step reduce-scatters its gradients whatever the flags (as under DDP's no_sync()), and puts them back."""
    for rank, value in enumerate(groups("two")["fsdp_step_keeps_the_callers_gradient_sync"]):
        for where, runs in value.items():
            assert [run["outcome"] for run in runs] == ["returned", "returned", "gave up"], (rank, where)
            for number, run in enumerate(runs):
                assert False in run["found"], (rank, where, number)
                assert run["left"] == run["found"], (rank, where, number)
                if run["outcome"] == "gave up":
                    assert run["grads"] == [None] * len(run["grads"]), (rank, where)
                    continue
                for got, want in zip(run["grads"], run["expected"], strict=True):
                    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_a_rank_short_of_memory_to_play_along_is_told_that_the_others_wait() -> None:
    """It raised a plain out-of-memory error from koila's code while the other ranks waited, unexplained."""

    class Group:  # never reached: the zeros to play with do not fit
        pass

    group = Group()
    collective = sharded._Collective(
        True, 1 << 16, 1 << 15, torch.float32, torch.device("cpu"), weakref.ref(group), None
    )
    with simulated_device("64KiB"), pytest.raises(torch.OutOfMemoryError) as caught:
        sharded.play([collective])
    (note,) = caught.value.__notes__
    assert "played along the other ranks' 1 remaining FSDP2 collectives" in note
    assert "(the largest buffer 256.00 KiB)" in note
    assert "the other ranks wait in their collective" in note
