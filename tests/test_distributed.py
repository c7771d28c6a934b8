"""Ranks of a torch.distributed job agree on every size: real gloo processes on 127.0.0.1 (issue 6).

Spawning processes costs seconds, so each group of processes (two ranks, three ranks, and two more for
the scenarios where a regression would kill a rank) runs every scenario of ``tests/_ranks.py`` in turn, each rank saving
what it saw; each test below checks one scenario. A group that has not finished within ``DEADLINE``
seconds is killed, and the scenarios it did not finish fail with a message saying that the ranks hung.
"""

from __future__ import annotations

import math
import weakref
from pathlib import Path
from typing import Any

import _ranks
import pytest
import torch
from _spawn import Groups
from torch import nn

import koila_retry as koila
from koila_retry._core import distributed, overlap
from koila_retry._core.aside import SetAside

# Seconds a group of processes may take for all its scenarios: a guard against ranks that hang, not a
# measure of speed. About 40 s here when idle; a busy machine takes several times as long.
DEADLINE = 300.0
RTOL, ATOL = 1e-7, 1e-12  # float64; a split step sums in another order than the full one
# The groups of processes (tests/_ranks.py GROUPS), for the scenarios that two and three ranks run.
WORLDS = ["two", "three"]
# The test that first needs a group waits for it, and the first test waits for two of them.
pytestmark = pytest.mark.timeout(2 * DEADLINE + 120)


# --------------------------------------------------------------------------- spawning


@pytest.fixture(scope="module")
def groups(tmp_path_factory: pytest.TempPathFactory) -> Groups:
    return Groups(_ranks, tmp_path_factory, DEADLINE)


# --------------------------------------------------------------------------- assertions


def same_on_every_rank(values: list[Any], key: str) -> Any:
    """Assert that every rank has the same ``values[rank][key]``, and return it."""
    first = values[0][key]
    for rank, value in enumerate(values):
        assert value[key] == first, f"{key} on rank {rank} differs from rank 0's: {value[key]!r} != {first!r}"
    return first


def assert_grads(actual: list[torch.Tensor | None], expected: list[torch.Tensor | None], where: str = "") -> None:
    assert len(actual) == len(expected), where
    for index, (got, want) in enumerate(zip(actual, expected, strict=True)):
        if want is None:
            assert got is None, f"{where}parameter {index} has a gradient; expected None"
        else:
            assert got is not None, f"{where}parameter {index} has no gradient"
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m, i=index: f"{where}param {i}: {m}")


def assert_error(caught: dict[str, Any], kind: type[BaseException], *fragments: str) -> None:
    assert caught.get("type") == kind.__name__, f"expected {kind.__name__}, got {caught}"
    for fragment in fragments:
        assert fragment in caught["message"]


def test_every_group_finishes(groups: Groups) -> None:
    for name in WORLDS:
        problem = groups(name).problem
        assert problem is None, problem


# --------------------------------------------------------------------------- 1. batch, attempts, chunked, range


@pytest.mark.parametrize("group", WORLDS)
def test_batch_ranks_with_different_limits_try_the_same_sizes(groups: Groups, group: str) -> None:
    # Simulated devices that fit 128, 32 and 64 rows: every rank goes down to 32 together.
    values = groups(group)["batch_simulated"]
    assert same_on_every_rank(values, "seen") == [512, 256, 128, 64, 32]
    assert same_on_every_rank(values, "size") == 32
    assert same_on_every_rank(values, "ooms") == 4  # a rank that fitted counts the attempts it retried
    for value in values:
        torch.testing.assert_close(value["result"], value["expected"])


def test_accelerate_compat_ranks_agree(groups: Groups) -> None:
    values = groups("two")["accelerate_compat"]
    assert same_on_every_rank(values, "seen") == [128, 115, 103, 92]
    assert same_on_every_rank(values, "size") == 92


def test_toma_compat_ranks_agree_only_over_a_parallel_module(groups: Groups) -> None:
    first, second = groups("two")["toma_compat"]
    assert first["evaluated"] == 8
    assert second["evaluated"] is None
    assert first["total"] == second["total"] == 6.0  # the all-reduces after rank 0's calls alone
    assert first["alone"]
    assert second["alone"]
    assert (first["sum"], second["sum"]) == (45.0, 21.0)
    # Over the DDP module rank 1 failed at 6 and 4 rows: both ranks ran the same smaller sizes.
    assert first["seen"] == second["seen"] == [6, 3, 3]
    assert first["equal"]
    assert second["equal"]


@pytest.mark.parametrize("group", WORLDS)
def test_async_batch_ranks_agree(groups: Groups, group: str) -> None:
    values = groups(group)["batch_async"]
    assert same_on_every_rank(values, "seen") == [64, 32, 16, 8, 4]
    assert same_on_every_rank(values, "size") == 4
    assert [value["result"] for value in values] == [2 * rank + 4 for rank in range(len(values))]


@pytest.mark.parametrize("group", WORLDS)
def test_attempts_ranks_agree(groups: Groups, group: str) -> None:
    values = groups(group)["attempts_injected"]
    assert same_on_every_rank(values, "seen") == [64, 32, 16, 8, 4]
    assert same_on_every_rank(values, "size") == 4
    assert same_on_every_rank(values, "ooms") == 4
    for value in values:
        torch.testing.assert_close(value["result"], value["expected"])


@pytest.mark.parametrize("group", WORLDS)
def test_chunked_ranks_run_the_same_chunks(groups: Groups, group: str) -> None:
    # Rank 1 fits 16 rows; the last rank also fails its 4th call (rows 16-32), so the rest go by 8.
    values = groups(group)["chunked_injected"]
    assert same_on_every_rank(values, "rows") == [64, 32, 16, 16] + [8] * 23
    assert same_on_every_rank(values, "size") == 8
    for value in values:
        torch.testing.assert_close(value["result"], value["expected"])


@pytest.mark.parametrize("group", WORLDS)
def test_range_ranks_run_the_same_ranges(groups: Groups, group: str) -> None:
    values = groups(group)["range_injected"]
    spans = same_on_every_rank(values, "spans")
    assert spans[:4] == [(0, 32), (0, 16), (0, 8), (0, 4)]
    assert all(end - begin == 4 for begin, end in spans[4:-1])
    assert spans[-1] == (48, 50)
    for value in values:
        assert value["result"] == value["expected"]


def test_growing_back_is_agreed(groups: Groups) -> None:
    values = groups("two")["batch_grow"]
    # Probes at 8 fail on rank 1, on both ranks at once; each call returns at the size that fits both.
    assert same_on_every_rank(values, "seen") == [64, 32, 16, 8, 4, 8, 4, 4, 8, 4]
    assert same_on_every_rank(values, "results") == [4, 4, 4, 4]


# --------------------------------------------------------------------------- 2. accumulate with DDP

ACCUMULATE = {
    # scenario: the sizes tried, and the rank that runs out of memory (in forward or backward)
    "accumulate_forward_first": ([12, 8], "last", "forward"),
    "accumulate_forward_later": ([4, 2], 0, "forward"),
    "accumulate_backward_first": ([12, 8], 1, "backward"),
    "accumulate_backward_later": ([4, 2], "last", "backward"),
}


@pytest.mark.parametrize("scenario", list(ACCUMULATE))
@pytest.mark.parametrize("group", WORLDS)
def test_accumulate_with_ddp_gives_the_full_batch_gradient_on_every_rank(
    groups: Groups, group: str, scenario: str
) -> None:
    values = groups(group)[scenario]
    tried, failing, phase = ACCUMULATE[scenario]
    failing = len(values) - 1 if failing == "last" else failing
    assert same_on_every_rank(values, "tried") == tried
    assert same_on_every_rank(values, "size") == tried[-1]
    assert same_on_every_rank(values, "ooms") == 1
    for rank, value in enumerate(values):
        assert_grads(value["grads"], value["expected"], f"rank {rank}: ")
        torch.testing.assert_close(value["loss"], value["expected_loss"])  # this rank's own loss
        (event,) = value["events"]
        assert event["rank"] == failing
        if rank == failing:
            assert event["where"].endswith(f"in {phase}"), event["where"]
        else:
            assert event["where"] == f"rank {failing}"


OVERLAPPED = [
    # (scenario, the rank that fails)
    ("overlap_whole_batch_fails_mid_backward", lambda world: 1),
    ("overlap_last_micro_batch_fails_mid_backward", lambda world: world - 1),
    ("overlap_earlier_micro_batch_fails", lambda world: 0),
]


@pytest.mark.parametrize("group", WORLDS)
@pytest.mark.parametrize(("name", "failing"), OVERLAPPED, ids=[name for name, _ in OVERLAPPED])
def test_ddp_all_reduces_during_the_backward_and_a_failed_rank_plays_along(
    groups: Groups, group: str, name: str, failing: Any
) -> None:
    values = groups(group)[name]
    failed = failing(len(values))
    # Four buckets once DDP rebuilt them after the first step, one before: what the play-along reads.
    assert same_on_every_rank(values, "buckets") == [1, 4]
    for rank, value in enumerate(values):
        assert value["ooms"] == 1, f"rank {rank}"
        # Exact: the first step's average plus the second's, after the retry.
        assert_grads(value["grads"], value["expected"], f"rank {rank}: ")
        calls = value["in_backward"]
        if rank == failed:  # the buckets its reducer never launched: made after the backward, with zeros
            assert False in calls, f"rank {rank} played no bucket along"
        else:  # every bucket all-reduced while the backward ran: DDP's overlap
            assert all(calls), f"rank {rank}: {calls}"
    # The same number of all-reduces on every rank: none waits for one another rank never makes.
    same_on_every_rank([{"count": len(value["in_backward"])} for value in values], "count")


@pytest.mark.parametrize("group", WORLDS)
def test_a_failed_attempt_leaves_nothing_in_leaves_outside_the_ddp_module(groups: Groups, group: str) -> None:
    """A tensor the step holds and the input, both needing a gradient: DDP's parameters are not all it writes."""
    values = groups(group)["overlap_leaves_outside_the_module"]
    for rank, value in enumerate(values):
        assert value["ooms"] == 1, f"rank {rank}"
        assert value["rows"] == [12, 8, 4], f"rank {rank}"
        assert_grads(value["grads"], value["expected"], f"rank {rank}: ")
        # Once, not the failed attempt's part and then the whole: added into the gradient from before, in place.
        torch.testing.assert_close(value["scale"], value["expected_scale"], rtol=RTOL, atol=ATOL)
        assert value["same_tensor"], f"rank {rank}: the gradient from before was not added into"
        torch.testing.assert_close(value["input"], value["expected_input"], rtol=RTOL, atol=ATOL)


def recovered_in_four_buckets(values: list[Any]) -> None:
    """Assert that every rank of an ``_overlapped`` scenario recovered from its one failure to the exact gradients."""
    assert same_on_every_rank(values, "buckets") == [1, 4]
    for rank, value in enumerate(values):
        assert value["ooms"] == 1, f"rank {rank}"
        assert_grads(value["grads"], value["expected"], f"rank {rank}: ")


@pytest.mark.parametrize("name", ["overlap_default_hook", "overlap_gradients_as_bucket_views"])
def test_ddp_overlap_without_a_hook_and_with_gradients_as_bucket_views(groups: Groups, name: str) -> None:
    recovered_in_four_buckets(groups("two")[name])


@pytest.mark.parametrize("name", ["overlap_stats_that_tie", "overlap_stats_that_tie_hooked"])
def test_a_failed_rank_knows_its_launched_buckets_when_the_reducers_stats_tie(groups: Groups, name: str) -> None:
    # The reducer's stats of a backward tied with the last one's now and then: a bucket launched seemed not
    # to be, the failed rank played it again, and gloo aborted the job on mismatched sizes.
    values = groups("two")[name]
    recovered_in_four_buckets(values)
    if name.endswith("hooked"):
        # The first step's one bucket; then the two last layers' buckets went during the failed backward, the
        # two others were played after it; then the retry's four.
        assert values[1]["in_backward"] == [True] * 3 + [False] * 2 + [True] * 4, values[1]["in_backward"]
        same_on_every_rank([{"count": len(value["in_backward"])} for value in values], "count")


@pytest.mark.parametrize(
    "name", ["overlap_collective_of_the_steps_own_in_the_backward", "overlap_a_parameter_given_no_gradient"]
)
def test_a_failed_rank_counts_only_the_buckets_its_reducer_launched(groups: Groups, name: str) -> None:
    # A collective of the step's own in the backward counted as a bucket launched, and a parameter DDP marked
    # ready without writing its .grad as one not launched: either way the rank played the wrong buckets.
    for rank, value in enumerate(groups("two")[name]):
        assert value["ooms"] == 1, f"rank {rank}"
        assert_grads(value["grads"], value["expected"], f"rank {rank}: ")


def test_a_backend_that_keeps_no_count_of_collectives_leaves_the_count_to_the_reducers_record() -> None:
    # A plugin backend (oneCCL's, say) raises when asked: a DDP step over one raised, with nothing failing.
    class Backend:
        def _get_sequence_number_for_group(self) -> int:
            raise RuntimeError("ProcessGroup custom does not yet support sequence numbers.")

    class Group:
        def _get_backend(self, device: torch.device) -> Backend:
            return Backend()

    assert overlap._sequence(Group(), torch.device("cpu")) is None


def test_gradients_as_bucket_views_from_before_cost_one_copy_and_roll_back_exactly(groups: Groups) -> None:
    """The step adds into the buckets .grad views, as the hand loop does; the copy set aside is all it adds.

    It added two gradients' worth: the copy, and the step's own gradients merged apart from the buckets.
    """
    for rank, value in enumerate(groups("two")["overlap_bucket_views_with_gradients_from_before"]):
        gradient_bytes = value["gradient_bytes"]
        for parts in (1, 4):
            outcome = value[f"k={parts}"]
            where = f"rank {rank}, k={parts}: "
            for name in ("fits", "retried"):
                run = outcome[name]
                assert run["result"] == {"returned": True}, where + name
                assert run["peak"] <= outcome["hand_peak"] + gradient_bytes + 1024, (where + name, run["peak"])
                assert_grads(run["grads"], outcome["hand"], where + name + ": ")
                assert run["same_tensors"], where + name + ": .grad no longer views the buckets"
            # A hand loop would have all-reduced a partial bucket; the step leaves .grad as it was, on both ranks.
            given_up = outcome["gives up"]
            assert_error(given_up["result"], koila.BatchSizeExhausted)
            assert_grads(given_up["grads"], outcome["before"], where + "gives up: ")


def test_a_failed_rank_plays_along_a_hook_that_completes_its_buckets_at_the_last_one(groups: Groups) -> None:
    """DDP calls every bucket's hook before it waits for any: a hook may complete them all at the last."""
    values = groups("crash")["overlap_hook_completing_at_the_last_bucket"]
    assert same_on_every_rank(values, "buckets") == [1, 4]
    for rank, value in enumerate(values):
        assert value["ooms"] == 1, f"rank {rank}"
        assert value["rows"] == [12, 12, 8, 4], f"rank {rank}"
        assert_grads(value["grads"], value["expected"], f"rank {rank}: ")


def test_a_failed_rank_plays_along_once_the_failed_attempt_held_in_a_cycle_is_collected(groups: Groups) -> None:
    for rank, value in enumerate(groups("crash")["overlap_play_along_after_an_attempt_held_in_a_cycle"]):
        assert "returned" in value["result"], f"rank {rank}: {value['result']}"
        assert value["failed"] == [(16, 1)], f"rank {rank}: {value['failed']}"
        assert value["calls"] == [16, 8, 8], f"rank {rank}: {value['calls']}"
        assert_grads(value["grads"], value["expected"], f"rank {rank}: ")


@pytest.mark.parametrize("path", ["overlap", "fallback"])
def test_combining_the_micro_batches_losses_is_part_of_the_attempt(groups: Groups, path: str) -> None:
    for rank, value in enumerate(groups("crash")["combining_the_losses_runs_out_of_memory"]):
        outcome = value[path]
        assert "returned" in outcome["result"], f"rank {rank}: {outcome['result']}"
        assert outcome["failed"] == [(8, 1)], f"rank {rank}: {outcome['failed']}"
        assert_grads(outcome["grads"], outcome["expected"], f"rank {rank}: ")


# (scenario, the rows each rank's Inject layer saw, step then retry, rank by rank); "fails" in the name: one OOM
_RETRIED = [2] * 6
STRAY = [
    ("stray_forward_nothing_fails", [[4, 4, 4]] * 2),
    # Rank 0 leaves after the first micro-batch: the exchange after its early buckets told it of rank 1.
    ("stray_forward_first_forward_fails", [[4, *_RETRIED]] * 2),
    ("stray_forward_first_backward_fails", [[4, *_RETRIED]] * 2),
    ("stray_forward_second_forward_fails", [[4, 4, 4, *_RETRIED], [4, 4, *_RETRIED]]),
    ("stray_forward_last_backward_fails", [[4, 4, 4, *_RETRIED]] * 2),
    ("stray_forward_first_backward_fails_hooked", [[4, *_RETRIED]] * 2),
    ("stray_forward_first_forward_fails_hooked", [[4, *_RETRIED]] * 2),
    # The first micro-batch weighs nothing: its backward runs all the same, and writes zeros.
    ("stray_forward_first_micro_batch_weighs_nothing", [[4, 4, 4]] * 2),
    ("stray_forward_first_micro_batch_weighs_nothing_first_forward_fails", [[4, *_RETRIED]] * 2),
    ("stray_forward_first_micro_batch_weighs_nothing_on_one_rank", [[6, 6]] * 2),
    # DDP's last backward runs though its micro-batch weighs nothing, and writes zeros, not 0/0's nan.
    ("ddp_last_micro_batch_weighs_nothing", [[4, 4, 4]] * 2),
    # Without a stray forward, the first backward writes .grad and launches no bucket: all four are played.
    ("stray_forward_none_first_backward_fails_hooked", [[4, 4, 4, *_RETRIED], [4, *_RETRIED]]),
    # Off the overlap the backward is captured: DDP's reducer sees none of it, and rank 0 agrees at the end.
    ("stray_forward_first_forward_fails_off_the_overlap", [[4, 4, 4, *_RETRIED], [4, *_RETRIED]]),
]


@pytest.mark.parametrize(("name", "rows"), STRAY, ids=[name for name, _ in STRAY])
def test_a_step_after_a_forward_that_no_backward_followed_agrees_after_ddps_early_buckets(
    groups: Groups, name: str, rows: list[list[int]]
) -> None:
    """A forward in grad mode left DDP's reducer expecting a backward: the first micro-batch's all-reduces.

    On every rank, that backward all-reduced every bucket, under ``no_sync()`` too; a rank that failed before
    its last micro-batch played only that one's buckets along, and gloo aborted the job ("40 vs 8").
    """
    failed = "fails" in name.removesuffix("nothing_fails")
    for rank, value in enumerate(groups("crash")[name]):
        assert value["ooms"] == failed, f"rank {rank}"
        assert value["rows"] == [*rows[rank], 12], f"rank {rank}"
        assert math.isfinite(value["loss"]), f"rank {rank}: {value['loss']}"
        assert_grads(value["grads"], value["expected"], f"rank {rank}: ")
        # A step of the hand loop's after it: the reducer is as DDP leaves a step.
        assert_grads(value["hand"], value["hand_expected"], f"rank {rank}, hand step after: ")


@pytest.mark.parametrize("name", list(_ranks.TWO_MODELS))
def test_a_step_over_another_ddp_model_than_its_first_recovers_it(groups: Groups, name: str) -> None:
    """The modules a step reaches are looked for again when it is given another model, or runs for another instance."""
    for rank, value in enumerate(groups("crash")[name]):
        assert value["rows"] == [8, 4, 4], f"rank {rank}: the whole batch (rank 1's failed), then micro-batches of 4"
        assert_grads(value["grads"], value["expected"], f"rank {rank}: ")


# (scenario, the rows Inject saw, rank by rank: two forwards per micro-batch, then the retry's in twos)
TWO_VIEWS = [
    ("two_views_nothing_fails", [[4] * 6] * 2),
    ("two_views_whole_first_forward_fails", [[12, 12, 8, 8, 4, 4], [12, 8, 8, 4, 4]]),
    ("two_views_first_micro_batch_fails", [[4] * 6 + [2] * 12, [4] + [2] * 12]),
    ("two_views_last_micro_batch_first_forward_fails", [[4] * 6 + [2] * 12, [4] * 5 + [2] * 12]),
    ("two_views_last_micro_batch_second_forward_fails", [[4] * 6 + [2] * 12] * 2),
    ("two_views_through_forward_first_micro_batch_fails", [[4] * 6 + [2] * 12, [4] + [2] * 12]),
]


@pytest.mark.parametrize(("name", "rows"), TWO_VIEWS, ids=[name for name, _ in TWO_VIEWS])
def test_a_step_that_runs_the_ddp_module_twice_broadcasts_no_buffers_inside(
    groups: Groups, name: str, rows: list[list[int]]
) -> None:
    """The second forward of a micro-batch that syncs broadcast DDP's buffers: not on a rank that failed first."""
    for rank, value in enumerate(groups("crash")[name]):
        assert value["ooms"] == ("fails" in name.removesuffix("nothing_fails")), f"rank {rank}"
        assert value["rows"] == [*rows[rank], 12], f"rank {rank}"
        assert_grads(value["grads"], value["expected"], f"rank {rank}: ")
        # Rank 1's, changed after the step, is rank 0's again: the hand step's forward broadcast it.
        assert value["scale"] == [0.5] * 8, f"rank {rank}"
        assert_grads(value["hand"], value["hand_expected"], f"rank {rank}, hand step after: ")
        assert value["warnings"] == [], f"rank {rank}: nothing changed the buffer"


def test_a_step_whose_second_forward_reads_a_buffer_the_first_changed_warns_once(groups: Groups) -> None:
    """DDP alone would broadcast rank 0's before the second view: the step keeps each rank's own, and says so."""
    for rank, value in enumerate(groups("crash")["two_views_reading_a_buffer_they_change"]):
        for name, found in value.items():
            first, second = found["warnings"]
            assert math.isfinite(found["loss"]), f"rank {rank}, {name}"
            assert found["synced"], f"rank {rank}, {name}: DDP's _sync_buffers was left replaced"
            assert second == [], f"rank {rank}, {name}: warned again: {second}"
            if not _ranks._READERS[name][1]:
                assert first == [], f"rank {rank}, {name}: {first}"
                continue
            assert len(first) == 1, f"rank {rank}, {name}: {first}"
            assert "DDP alone would broadcast rank 0's buffers" in first[0], first[0]
            assert "torch.cat" in first[0], first[0]


def test_a_compressing_hook_that_fails_before_its_collective_on_the_first_step_is_played_along(
    groups: Groups,
) -> None:
    for rank, value in enumerate(groups("crash")["overlap_compressing_hook_fails_on_the_first_step"]):
        assert "returned" in value["outcome"], f"rank {rank}: {value['outcome']}"
        assert value["ooms"] == 1, f"rank {rank}"
        for index, (got, want) in enumerate(zip(value["grads"], value["expected"], strict=True)):
            # All-reduced in float16: about three decimal digits.
            torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-4, msg=lambda m, i=index, r=rank: f"{r}, {i}: {m}")


def test_a_weightless_micro_batch_writes_zeros_through_reentrant_checkpoints(groups: Groups) -> None:
    for rank, value in enumerate(groups("two")["ddp_weightless_micro_batch_through_reentrant_checkpoints"]):
        for mode, found in value.items():
            assert_grads(found["grads"], found["expected"], f"rank {rank}, {mode}: ")


def test_ranks_whose_first_backward_differs_after_a_stray_forward_raise_together(groups: Groups) -> None:
    """Where one rank's first backward is its last and another's is not, DDP's early buckets cannot match up."""
    for rank, value in enumerate(groups("crash")["stray_forward_ranks_out_of_step"]):
        assert_error(value["caught"], RuntimeError, "went out of step", "torch.no_grad()", "as many rows")
        assert value["after"] == [None] * 4, f"rank {rank}: the step left gradients"
        assert_grads(value["grads"], value["expected"], f"rank {rank}, the hand step after: ")


def test_a_rank_without_memory_for_the_copy_set_aside_fails_an_attempt_the_ranks_agree_on(groups: Groups) -> None:
    """The copy of bucket-view gradients is made inside the first attempt: no rank is left waiting for it.

    Made before the attempt, rank 1's out-of-memory error escaped alone while rank 0 waited in the
    attempt's all-reduce. Inside the caller's own ``no_sync()``, ``.grad`` ended up the copies, beside
    the buckets: one more gradient's worth until DDP's next synced backward.
    """
    for rank, value in enumerate(groups("crash")["overlap_copy_set_aside_runs_out_of_memory"]):
        for name in ("never fits", "inside no_sync", "freed", "freed inside no_sync"):
            outcome, where = value[name], f"rank {rank}, {name}: "
            if name.startswith("freed"):
                assert "returned" in outcome["result"], where + str(outcome["result"])
                assert outcome["failed"] == [(16, 1)], where + str(outcome["failed"])  # rank 1, at the whole batch
                assert_grads(outcome["grads"], value["hand"], where)
            else:
                assert_error(outcome["result"], koila.BatchSizeExhausted)
                assert_grads(outcome["grads"], value["before"], where)
            assert outcome["same_tensors"], where + ".grad no longer views the buckets"


def test_which_ddp_set_ups_keep_the_overlap_and_what_a_comm_hook_sees(groups: Groups) -> None:
    for rank, value in enumerate(groups("two")["overlap_served"]):
        assert value["served"] == {
            "default": True,
            "gradient_as_bucket_view": True,
            "find_unused_parameters": True,
            "static_graph": False,
            "sparse embedding": False,
            "post-accumulate-grad hook": False,
            "two modules": False,
        }, f"rank {rank}"
        # shared (2), the nested layer's bias, the last weight: not the frozen weight or the ignored bias
        assert (value["order_matches"], value["order_length"]) == (True, 4), f"rank {rank}"
        hooks = value["hooks"]
        # One bucket, two steps, then one more inside the caller's no_sync(), which stays on after it.
        assert hooks["overlap"] == {
            "calls": 2,
            "warnings": [],
            "no_sync kept": True,
            "calls in no_sync": 1,
        }, f"rank {rank}"
        assert hooks["fallback"]["calls"] == hooks["fallback"]["calls in no_sync"] == 0, f"rank {rank}"
        assert hooks["fallback"]["no_sync kept"], f"rank {rank}"
        assert len(hooks["fallback"]["warnings"]) == 1, f"rank {rank}"
        assert "the hook is not called" in hooks["fallback"]["warnings"][0]


def test_inference_over_ddp_with_buffers_survives_a_failed_first_forward(groups: Groups) -> None:
    # Rank 1 ran out of memory in its first forward without grad, after DDP's broadcast of the buffers:
    # its retry broadcast again, alone, and the ranks hung until gloo's timeout.
    for outcome in groups("crash")["ddp_inference_with_buffers_after_a_failed_first_forward"]:
        assert outcome == {"chunked": {"returned": True}, "batch": {"returned": True}}


def test_a_start_agreed_below_a_ranks_own_is_not_stored_for_that_ranks_rows(groups: Groups) -> None:
    # Each rank stored the other's smaller start for its own shorter rows, scaled it down for its longer
    # ones the step after, and the agreed start fell to one row for good (4, 2, 1, 1, 1, 1).
    for outcome in groups("two")["ddp_lengths_that_differ_between_ranks_keep_their_sizes"]:
        assert outcome == {"sizes": [4, 2, 2, 2, 2, 2], "ooms": 2}  # 16, then 8, in the first step


def test_a_sample_logged_without_grad_through_ddp_in_the_step_is_no_bypass(groups: Groups) -> None:
    for rank, value in enumerate(groups("two")["overlap_a_sample_logged_without_grad_in_the_step"]):
        for initial, outcome in value["outcomes"].items():
            assert outcome["raised"] is None, f"rank {rank}, initial={initial}: {outcome['raised']}"
            assert_grads(outcome["grads"], value["expected"], f"rank {rank}, initial={initial}: ")


def test_a_step_that_bypasses_ddp_raises_on_every_rank(groups: Groups) -> None:
    for rank, value in enumerate(groups("two")["overlap_step_bypassing_ddp"]):
        assert_error(value["caught"], RuntimeError, "did not call the module itself", "would not be averaged")
        assert value["kept"], f"rank {rank}: .grad changed"


@pytest.mark.parametrize(
    ("name", "worlds", "size"),
    [
        ("ddp_after_a_backward_without_sync", ("two", "three"), 8),
        ("ddp_after_a_backward_without_sync_a_backward_fails", ("two", "three"), 2),
        ("ddp_after_a_backward_without_sync_as_bucket_views", ("two",), 4),
        ("ddp_after_a_backward_without_sync_off_the_overlap", ("two",), 4),
        ("ddp_after_a_backward_without_sync_a_step_inside_it", ("two",), 4),
        ("ddp_after_a_backward_without_sync_a_step_inside_it_off_the_overlap", ("two",), 4),
    ],
)
def test_a_backward_of_the_callers_own_without_sync_is_averaged_with_the_step(
    groups: Groups, name: str, worlds: tuple[str, ...], size: int
) -> None:
    """As a hand loop's synced backward averages all that .grad holds: the ranks end with the same gradients.

    Inside the caller's own ``no_sync()`` too, the step's gradients alone are averaged, added to each rank's own.
    """
    for world in worlds:
        values = groups(world)[name]
        for value in values:
            assert value["size"] == size
            # Added into the tensors the caller's backward made; with bucket views, .grad views DDP's bucket.
            assert value["same_tensors"] is ("bucket_views" not in name)
            for got, want in zip(value["grads"], value["expected"], strict=True):
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_a_static_graph_before_its_first_iteration_is_refused_then_served(groups: Groups) -> None:
    """PyTorch fails a first static-graph iteration under no_sync() with an internal assertion: said plainly."""
    for value in groups("two")["static_graph_first_iteration"]:
        assert_error(value["refused"], NotImplementedError, "static_graph=True", "has not run its first iteration")
        assert value["untouched"]
        assert value["size"] == 4  # rank 1's whole batch failed: both ranks ran two micro-batches
        for got, want in zip(value["grads"], value["expected"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_ddp_step_peaks_as_the_hand_loop(groups: Groups) -> None:
    # Peak bytes counted exactly on a simulated device, against the hand loop in the same process.
    for rank, value in enumerate(groups("two")["overlap_peak_memory"]):
        peaks = value["peaks"]
        for k in (1, 4):
            assert peaks[f"koila k={k}"] <= 1.02 * peaks[f"hand k={k}"], f"rank {rank}: {peaks}"
            # .grad present: set aside while the step runs, the one gradient buffer exactness costs.
            present = peaks[f"koila k={k} .grad present"]
            allowed = 1.02 * peaks[f"hand k={k} .grad present"] + value["gradient_bytes"]
            assert present <= allowed, f"rank {rank}: {peaks}"


@pytest.mark.parametrize("group", WORLDS)
def test_accumulate_ranks_with_different_memory_limits(groups: Groups, group: str) -> None:
    # Simulated devices fitting micro-batches of 16, 4 and 8 of 32 rows: all settle on 4.
    values = groups(group)["accumulate_simulated"]
    assert same_on_every_rank(values, "tried") == [32, 16, 8, 4]
    for rank, value in enumerate(values):
        assert_grads(value["grads"], value["expected"], f"rank {rank}: ")


@pytest.mark.parametrize("group", WORLDS)
def test_accumulate_simulated_oom_in_the_backward(groups: Groups, group: str) -> None:
    values = groups(group)["accumulate_simulated_backward"]
    forward, half, whole, limit = values[1]["peaks"]
    assert forward < limit < whole, "rank 1's limit fits the forward of 32 rows, not their backward"
    assert half < limit, "rank 1's limit fits a whole step of 16 rows"
    assert same_on_every_rank(values, "tried") == [32, 16]
    (event,) = values[1]["events"]
    # The backward that accumulate runs has no line of the user's: the line that called the step is named.
    assert "_ranks.py" in event["where"]
    assert event["where"].endswith("in _step_under (in the backward pass it ran)")
    for rank, value in enumerate(values):
        assert_grads(value["grads"], value["expected"], f"rank {rank}: ")


def test_accumulate_with_two_ddp_modules(groups: Groups) -> None:
    for rank, value in enumerate(groups("two")["accumulate_two_ddp_modules"]):
        for how in ("passed", "found"):
            assert value[how]["size"] == 4
            assert_grads(value[how]["grads"], value["expected"], f"rank {rank}, ddp {how}: ")


# --------------------------------------------------------------------------- 3. gradients from before the call


@pytest.mark.parametrize("group", WORLDS)
def test_accumulate_twice_adds_both_full_batch_gradients(groups: Groups, group: str) -> None:
    values = groups(group)["accumulate_twice"]
    # Forward calls: 8 rows (rank 1 fails), 4 + 4; then 8 rows (rank 0's backward fails), 4 + 4.
    assert same_on_every_rank(values, "rows") == [8, 4, 4, 8, 4, 4]
    for rank, value in enumerate(values):
        assert_grads(value["after_first"], value["expected_first"], f"rank {rank}, first call: ")
        assert_grads(value["grads"], value["expected"], f"rank {rank}, second call: ")


# --------------------------------------------------------------------------- 4. unused parameters


@pytest.mark.parametrize(
    ("group", "scenario"),
    [
        ("two", "accumulate_unused_parameters"),
        ("three", "accumulate_unused_parameters"),
        ("two", "accumulate_unused_parameters_small_buckets"),
        ("three", "accumulate_unused_parameters_small_buckets"),
        ("two", "accumulate_unused_parameters_fallback"),
    ],
)
def test_parameters_used_on_some_ranks_or_none(groups: Groups, group: str, scenario: str) -> None:
    values = groups(group)[scenario]
    for rank, value in enumerate(values):
        calls = value["in_backward"]
        if scenario.endswith("fallback"):  # all-reduced by koila after the backward; the hook never called
            assert calls == [], f"rank {rank}"
        elif scenario.endswith("small_buckets"):
            assert value["buckets"] == 4
            # Per attempt, each bucket all-reduced in the backward (True) or played along after it (False).
            # Rank 1 failed the first call's forward: it played all four. Rank 0 failed the second call's
            # backward after two buckets had gone, never's marked ready by DDP as unused: it played two.
            played = {1: [False] * 4, 0: [True] * 2 + [False] * 2}.get(rank, [True] * 4)
            first = played if rank == 1 else [True] * 4
            second = played if rank == 0 else [True] * 4
            assert calls == first + [True] * 4 + second + [True] * 4, f"rank {rank}"
        names = value["names"]
        for call, (after, expected) in enumerate(zip(value["after"], value["expected"], strict=True)):
            assert_grads(after, expected, f"rank {rank}, after call {call + 1}: ")
            grads = dict(zip(names, after, strict=True))
            assert grads["never.weight"] is None
            assert grads["never.bias"] is None
            assert grads["extra.weight"] is not None  # used on rank 0 only, averaged everywhere


# --------------------------------------------------------------------------- 5. different cached sizes


@pytest.mark.parametrize("group", WORLDS)
def test_different_cached_sizes_agree_on_the_smallest_before_the_first_attempt(groups: Groups, group: str) -> None:
    values = groups(group)["cached_sizes_differ"]
    fits = [_ranks.FITS[rank] for rank in range(len(values))]
    assert [value["alone"] for value in values] == fits  # sync=False: each rank alone, cached apart
    assert same_on_every_rank(values, "seen_agreed") == [min(fits)]  # the first attempt is the smallest
    assert same_on_every_rank(values, "agreed") == min(fits)
    assert same_on_every_rank(values, "chunk_rows") == [4] * 5  # caches filled with 16, 4 (and 8)
    assert same_on_every_rank(values, "micro_batch_rows") == [2] * 6  # caches filled with 8, 2 (and 4)
    for rank, value in enumerate(values):
        torch.testing.assert_close(value["halved"], value["expected_halved"])
        assert_grads(value["grads"], value["expected"], f"rank {rank}: ")


# --------------------------------------------------------------------------- 6. exhausted on every rank


@pytest.mark.parametrize("group", WORLDS)
def test_one_rank_exhausted_exhausts_every_rank(groups: Groups, group: str) -> None:
    values = groups(group)["exhausted_everywhere"]
    world = len(values)
    assert same_on_every_rank(values, "seen") == [16, 8, 4]
    for rank, value in enumerate(values):
        batch = value["batch"]
        assert_error(batch, koila.BatchSizeExhausted, "(16 -> 8 -> 4)", "batch size 4 is the minimum")
        diagnosis = batch["attributes"].pop("diagnosis")
        assert batch["attributes"] == {"batch_size": 4, "attempts": 3}
        if rank == world - 1:
            assert "The last error was raised at" in batch["message"]
            # Its own error, raised by hand on the CPU: the allocator's figures say nothing of it.
            assert diagnosis is not None
            assert diagnosis.kind == "unknown"
        else:
            assert f"Rank {world - 1} of {world} ran out of memory" in batch["message"]
            assert diagnosis is None  # it ran out of nothing itself
        # accumulate: rank 0 fails 12, 8 and 6 rows; every rank gives up, its gradients untouched
        accumulate = value["accumulate"]
        assert_error(accumulate, koila.BatchSizeExhausted, "(12 -> 8 -> 6)")
        if rank != 0:
            assert f"Rank 0 of {world} ran out of memory" in accumulate["message"]
        assert value["grads"] == [None] * 4


def test_a_rank_that_gives_up_with_another_says_why_not_max_attempts(groups: Groups) -> None:
    healthy, failed = groups("two")["exhausted_by_a_rank_with_one_row"]
    assert_error(failed, koila.BatchSizeExhausted, "(1)", "batch size 1 is the minimum")
    # It could have gone below 4: the other rank, with its one row, could not (it said max_attempts=None).
    assert_error(healthy, koila.BatchSizeExhausted, "(4)", "the rank that ran out of memory has no smaller batch")
    assert "max_attempts" not in healthy["message"]
    assert "Rank 1 of 2 ran out of memory" in healthy["message"]


@pytest.mark.parametrize("group", WORLDS)
def test_no_rank_goes_below_the_largest_minimum(groups: Groups, group: str) -> None:
    """Rank 0 has minimum=6, the others 1: every rank stops at 6, and gives up there together (issue 18)."""
    values = groups(group)["minimums_differ"]
    last = len(values) - 1
    for rank, value in enumerate(values):
        # The last rank fits 6: the schedule's 4 is raised to the largest minimum, and 6 succeeds everywhere.
        assert value["batch fits 6"]["seen"] == [32, 16, 8, 6]
        # ... and then fits 2 only: after 6 every rank gives up, although the others' minimum is 1.
        assert value["batch fits 2"]["seen"] == [32, 16, 8, 6]
        # The rank with the largest minimum fails at it: every rank gives up, as when the minimums are equal.
        assert value["batch largest fails"]["seen"] == [32, 16, 8, 6]
        assert value["batch fits 6"]["outcome"] == {"returned": 6}
        batch = value["batch fits 2"]["outcome"]
        assert_error(batch, koila.BatchSizeExhausted, "(32 -> 16 -> 8 -> 6)", "batch size 6 is the minimum")
        assert {key: value for key, value in batch["attributes"].items() if key != "diagnosis"} == {
            "batch_size": 6,
            "attempts": 4,
        }
        assert_error(value["batch largest fails"]["outcome"], koila.BatchSizeExhausted, "(32 -> 16 -> 8 -> 6)")

        # accumulate, 12 rows a rank: micro-batches of 12, then 8 (8 + 4, the last rank fails the 8), then 6.
        fits_6, fits_2 = value["accumulate fits 6"], value["accumulate fits 2"]
        assert fits_6["outcome"].get("type") is None, fits_6["outcome"]
        assert fits_6["rows"] == ([12, 8, 6, 6] if rank == last else [12, 8, 4, 6, 6])
        assert_grads(fits_6["grads"], fits_6["expected"], f"rank {rank}: ")
        assert fits_2["rows"] == ([12, 8, 6] if rank == last else [12, 8, 4, 6, 6])
        assert_error(fits_2["outcome"], koila.BatchSizeExhausted, "(12 -> 8 -> 6)")
        assert fits_2["grads"] == [None] * 4
        # Without an initial, the other ranks' 2 rows do not split rank 0's 12, which fit.
        rows = value["accumulate rows"]
        assert rows["outcome"].get("type") is None, rows["outcome"]
        assert rows["rows"] == ([12] if rank == 0 else [2])
        # An initial below another rank's minimum leaves no size that suits every rank.
        assert_error(
            value["initial below"],
            ValueError,
            "largest minimum of the ranks (6)",
            "smallest initial (4)",
            f"this rank has minimum={6 if rank == 0 else 1} and initial={32 if rank == 0 else 4}",
        )


# --------------------------------------------------------------------------- 7. different spans


@pytest.mark.parametrize("group", WORLDS)
def test_different_numbers_of_rows_raise_on_every_rank(groups: Groups, group: str) -> None:
    for rank, value in enumerate(groups(group)["spans_differ"]):
        assert_error(value["rows"], ValueError, "same number of rows or indices", f"this rank has {10 + rank}")
        assert_error(value["empty"], ValueError, "same number of rows or indices")
        assert_error(value["indices"], ValueError, "same number of rows or indices")
        # the function ran only for the call after them, which still agrees: 6 rows in chunks of 4 and 2
        assert value["calls"] == [4, 2]
        torch.testing.assert_close(value["same"], torch.ones(6, 2))


# --------------------------------------------------------------------------- 8. sync=False makes no collective call

FRONT_ENDS = ["batch", "attempts", "chunked", "range", "accumulate"]


@pytest.mark.parametrize("group", WORLDS)
def test_sync_false_makes_no_collective_call(groups: Groups, group: str) -> None:
    for rank, value in enumerate(groups(group)["sync_false_makes_no_collective_call"]):
        assert value["false"] == {name: {} for name in FRONT_ENDS}, f"rank {rank}"
        for name in FRONT_ENDS:  # the control: the same calls, agreeing, all-reduce and nothing else
            counts = value["none"][name]
            assert set(counts) == {"all_reduce"}, (rank, name, counts)
            assert counts["all_reduce"] >= 2, (rank, name, counts)  # the start, and after each attempt


# --------------------------------------------------------------------------- 9. memory of a discarded attempt


def test_a_discarded_successful_attempt_is_released_before_the_retry(groups: Groups) -> None:
    values = groups("two")["discarded_attempt_is_released"]
    for rank, value in enumerate(values):  # rank 0 succeeded and retried; rank 1 failed
        assert value["batch_dead"] == [[], [True]], f"rank {rank}"
        # chunked: the first chunk's result was written into the whole result and let go; the
        # second's, dropped because rank 1 failed, is dead when the retry starts
        assert value["chunked_dead"][2] == [True, True], f"rank {rank}"
        # accumulate: the gradients written by the discarded step are dead when the retry starts
        assert value["accumulate_dead"] == [[], [True] * 4], f"rank {rank}"
    assert same_on_every_rank(values, "rows") == [4, 4, 4, 2, 2, 2, 2, 2, 2]


# --------------------------------------------------------------------------- 10. on_oom events


@pytest.mark.parametrize("group", WORLDS)
def test_events_name_the_lowest_rank_that_failed(groups: Groups, group: str) -> None:
    values = groups(group)["events_name_the_failing_rank"]
    for rank, value in enumerate(values):  # ranks 1 and up failed 16
        assert value["result"] == 8
        assert value["ooms"] == 1
        (event,) = value["events"]
        assert (event["batch_size"], event["next_batch_size"], event["attempt"], event["rank"]) == (16, 8, 1, 1)
        if rank == 0:
            assert event["where"] == "rank 1"
        else:
            assert "_ranks.py" in event["where"]
            assert event["where"].endswith("in run")


# --------------------------------------------------------------------------- 11. FSDP and tensor parallelism


def test_fsdp1_and_tensor_parallel_modules_are_refused_on_every_rank(groups: Groups) -> None:
    for value in groups("two")["sharded_modules_are_refused"]:
        assert sorted(value) == sorted(
            [f"{front} {kind}" for front in ("batch", "accumulate") for kind in ("fsdp2", "fsdp1", "dtensor")]
            + ["chunked fsdp2"]
        )
        expected = {
            "fsdp1": ("(FSDP1), which is not supported", "fully_shard"),
            "dtensor": ("DTensor", "not supported yet"),
        }
        for name, caught in value.items():
            kind = name.split()[1]
            if kind == "fsdp2":  # covered: tests/test_fsdp.py
                assert "returned" in caught, caught
                continue
            assert_error(caught, NotImplementedError, *expected[kind])


def test_sync_batchnorm_is_refused_on_every_rank_while_it_trains(groups: Groups) -> None:
    for value in groups("two")["sync_batchnorm_in_training_is_refused"]:
        assert "returned" in value["accumulate eval"], value["accumulate eval"]
        for name in ("accumulate train", "batch train"):
            assert_error(value[name], NotImplementedError, "SyncBatchNorm", "training mode", "eval mode")
        assert value["grads"] == [False, False, False, False, False, False]  # the eval step's; none since


def test_a_ddp_module_over_a_subgroup_found_in_the_closure_agrees_over_its_group(groups: Groups) -> None:
    # It agreed over all the ranks: the members waited for rank 2, which never makes the call.
    values = groups("three")["ddp_over_a_subgroup_found_in_the_closure"]
    assert values[2] == {}
    for value in values[:2]:
        assert "returned" in value["outcome"], value["outcome"]
        assert value["seen"] == [8, 4, 4]  # rank 1 failed whole; both ran the same micro-batches
    assert all(torch.equal(a, b) for a, b in zip(values[0]["grads"], values[1]["grads"], strict=True))


def test_join_over_a_ddp_module_is_refused_on_every_rank(groups: Groups) -> None:
    # Under Join each DDP forward all-reduces of its own: a rank that failed before its forward, or had
    # joined, met the others' collectives with other sizes, and gloo aborted the process.
    for value in groups("two")["join_is_refused"]:
        for name in ("accumulate", "batch"):
            assert_error(value[name], NotImplementedError, "torch.distributed.algorithms.Join", "leave Join out")
        assert value["grads"] == [True, True]


# --------------------------------------------------------------------------- options


def test_ddp_with_sync_false_is_refused(groups: Groups) -> None:
    for value in groups("two")["ddp_with_sync_false"]:
        assert_error(value, ValueError, "sync=False")


def test_a_group_of_some_ranks_agrees_among_them(groups: Groups) -> None:
    values = groups("three")["group_of_some_ranks"][:2]
    for value in values:
        assert value["result"] == {"returned": 4}
    assert same_on_every_rank(values, "seen") == [64, 32, 16, 8, 4]


def test_a_rank_outside_the_group_runs_alone_or_refuses_sync_true(groups: Groups) -> None:
    outside = groups("three")["group_of_some_ranks"][2]
    assert outside["result"] == {"returned": 8}  # sync=None: not a member, so it runs alone
    assert_error(outside["forced"], RuntimeError, "not a member")


# --------------------------------------------------------------------------- found while building it


def test_accumulate_rank_with_fewer_rows_does_not_exhaust_the_others(groups: Groups) -> None:
    values = groups("two")["accumulate_fewer_rows_on_one_rank"]
    for value in values:
        assert value["outcome"].get("type") is None, value["outcome"]
    assert values[0]["seen"][:2] == [8, 4]
    assert same_on_every_rank(values, "size") == 4


def test_accumulate_ranks_with_different_rows_that_fit_each_run_their_whole_batch(groups: Groups) -> None:
    # The smaller rank's rows were the agreed start: the other split its 9 rows into 7 and 2, for nothing.
    values = groups("two")["accumulate_ranks_with_different_rows_each_run_whole"]
    assert [value["seen"] for value in values] == [[[7]], [[9]]]
    assert [value["size"] for value in values] == [7, 9]
    assert [value["ooms"] for value in values] == [0, 0]


def test_a_rank_that_never_ran_out_of_memory_runs_its_batch_whole_again_after_another_did(groups: Groups) -> None:
    # It stored the 4 rows rank 1's failure led every rank to, and split its 9 rows from then on.
    values = groups("two")["accumulate_a_rank_that_never_failed_stores_no_size_another_forced"]
    assert values[0]["seen"] == [[9, 4, 4, 1], [9]]
    assert values[1]["seen"] == [[7, 4, 3], [3]]


def test_a_rank_that_ran_out_of_memory_keeps_its_size_when_another_rank_fails_after_it(groups: Groups) -> None:
    # Rank 1 failed last, so rank 0 took the final size for another rank's and stored nothing of its own
    # failure: it failed at 8 rows again in the next step.
    values = groups("two")["accumulate_a_rank_that_failed_first_stores_its_size_when_another_fails_after"]
    assert values[0]["seen"] == [[8, 4, 4, 2, 2, 2, 2], [2, 2, 2, 2]]
    assert [value["ooms"] for value in values] == [2, 2], "no failure in the second step"


def test_a_rank_that_fits_whole_takes_a_smaller_start_after_a_forward_no_backward_followed(groups: Groups) -> None:
    # Running its 8 rows whole beside a rank that split its own, it synced at a different point of the step
    # after a logged forward (DDP syncs in a split rank's first backward): both ranks raised.
    values = groups("two")["accumulate_a_rank_that_fits_whole_is_held_to_a_smaller_start_after_a_stray_forward"]
    for value in values:
        assert value["seen"] == [[8, 4, 4], [4, 4]]
        assert_grads(value["grads"], value["expected"])


def test_accumulate_oom_before_the_first_forward_of_a_ddp_model_with_buffers(groups: Groups) -> None:
    values = groups("crash")["ddp_buffers_first_forward"]
    for value in values:
        assert value["outcome"].get("type") is None, value["outcome"]
    for rank, value in enumerate(values):
        assert_grads(value["grads"], values[0]["grads"], f"rank {rank}: ")


def test_accumulate_auto_with_ddp_when_only_one_rank_estimates(groups: Groups) -> None:
    values = groups("crash")["auto_estimate_with_ddp"]
    for value in values:
        assert value["outcome"].get("type") is None, value["outcome"]
    assert same_on_every_rank(values, "size") == 6
    for rank, value in enumerate(values):
        assert_grads(value["grads"], value["expected"], f"rank {rank}: ")


# --------------------------------------------------------------------------- one process, no process group


def _batch(**options: Any) -> Any:
    return koila.batch(initial=4, cache=koila.NoCache(), **options)(lambda size: size)()


def _attempts(**options: Any) -> Any:
    for attempt in koila.attempts(initial=4, cache=koila.NoCache(), **options):
        with attempt:
            size = attempt.batch_size
    return size


def _chunked(**options: Any) -> Any:
    return koila.chunked(lambda x: x + 1, torch.zeros(4, 2), initial=2, cache=koila.NoCache(), **options)


def _range(**options: Any) -> Any:
    return koila.range(lambda b, e: e - b, 0, 4, initial=2, cache=koila.NoCache(), **options)


def _accumulate(**options: Any) -> Any:
    model = nn.Linear(2, 1)
    step = koila.accumulate(cache=koila.NoCache(), **options)(lambda x: model(x).sum())
    return step(torch.ones(4, 2))


CALLS = {"batch": _batch, "attempts": _attempts, "chunked": _chunked, "range": _range, "accumulate": _accumulate}


@pytest.mark.parametrize("front_end", list(CALLS))
def test_sync_true_without_a_process_group_is_refused(front_end: str) -> None:
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match=r"sync=True needs torch\.distributed: call .*init_process_group"):
        CALLS[front_end](sync=True)


@pytest.mark.parametrize("sync", [None, False])
@pytest.mark.parametrize("front_end", list(CALLS))
def test_without_a_process_group_sync_none_and_false_run_alone(front_end: str, sync: bool | None) -> None:
    expected = {"batch": 4, "attempts": 4, "range": [2, 2]}
    result = CALLS[front_end](sync=sync)
    if front_end in expected:
        assert result == expected[front_end]
    elif front_end == "chunked":
        torch.testing.assert_close(result, torch.ones(4, 2))
    else:
        assert result.requires_grad is False


DECORATORS = {
    "batch": lambda **options: koila.batch(**options)(lambda size: size),
    "attempts": lambda **options: koila.attempts(**options),
    "chunked": lambda **options: koila.chunked(**options)(lambda x: x),
    "range": lambda **options: koila.range(**options)(lambda begin, end: end - begin),
    "accumulate": lambda **options: koila.accumulate(**options)(lambda x: x.sum()),
}


@pytest.mark.parametrize("sync", ["yes", 1, 0, torch.tensor(True)])
@pytest.mark.parametrize("front_end", list(DECORATORS))
def test_sync_that_is_not_a_bool_is_refused_when_decorating(front_end: str, sync: object) -> None:
    with pytest.raises(TypeError, match="sync must be True, False or None"):
        DECORATORS[front_end](sync=sync)


@pytest.mark.parametrize("group", ["all", 0, object()])
@pytest.mark.parametrize("front_end", list(DECORATORS))
def test_group_that_is_not_a_process_group_is_refused_when_decorating(front_end: str, group: object) -> None:
    with pytest.raises(TypeError, match="group must be a torch.distributed process group"):
        DECORATORS[front_end](group=group)


@pytest.mark.parametrize("ddp", [nn.Linear(2, 1), [nn.Linear(2, 1)], "model"])
def test_ddp_that_is_not_a_ddp_module_is_refused(ddp: object) -> None:
    with pytest.raises(TypeError, match="ddp must be a torch.nn.parallel.DistributedDataParallel module") as caught:
        koila.accumulate(ddp=ddp)
    assert str(caught.value).endswith(" 'model'" if ddp == "model" else "in_features=2, out_features=1, bias=True)")


def test_accumulate_broadcasts_ddp_buffers_from_rank_zero_before_the_step(groups: Groups) -> None:
    for value in groups("two")["ddp_buffers_from_rank_zero"]:
        assert value["seen"] == [2.0, 2.0]  # two micro-batches of 4 rows, both with rank 0's buffer


def test_agreements_keep_no_process_group_alive(tmp_path: Path) -> None:
    """Issue 27: koila-retry kept the group destroy_process_group() let go, and with it gloo's threads.

    Only the group's destructor stops them, and one of them still running when the interpreter
    shuts down can abort the process (``terminate called without an active exception``).
    """
    dist = pytest.importorskip("torch.distributed")
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=(tmp_path / "store").as_uri(), rank=0, world_size=1)
    try:
        subgroup = dist.new_group([0])
        for group in (None, subgroup):
            made = distributed.agreement(True, group)
            assert made is not None
            assert made.start(4) == (4, 1)  # one collective, as a call makes
            assert made.group is group
        groups = [weakref.ref(dist.group.WORLD), weakref.ref(subgroup)]
        del subgroup, made, group
    finally:
        dist.destroy_process_group()
    assert [group() for group in groups] == [None, None]


@pytest.mark.parametrize("group", WORLDS)
def test_refine_probes_the_same_sizes_on_every_rank(groups: Groups, group: str) -> None:
    """Every rank keeps the smallest size that failed on any rank, so their probes agree (issue 31)."""
    values = groups(group)["refine_agrees"]
    tried = same_on_every_rank(values, "tried")
    got = same_on_every_rank(values, "got")
    assert tried[0] == [128, 64]
    # Between the powers of two, up to what the rank with least memory fits, within 12.5%.
    assert 88 <= got[-1] <= 100
    assert got[-3:] == [got[-1]] * 3
    failed = [size for call in tried for size in call if size > 100]
    assert len(failed) == len(set(failed)), "a size that failed on a rank was tried again"


# --------------------------------------------------------------------------- DDP modules given and found; grad mode


def test_accumulate_covers_ddp_modules_given_and_found(groups: Groups) -> None:
    # ddp= named one of the two DDP modules the step trains, so the other was not covered: it all-reduced in
    # every micro-batch, and rank 1's out-of-memory error left rank 0 waiting in it until gloo's timeout.
    values = groups("crash")["accumulate_ddp_given_beside_one_found"]
    for rank, value in enumerate(values):
        assert value["outcome"] is None, f"rank {rank}: {value['outcome']}"
    same_on_every_rank(values, "size")  # the hand loop ran at it
    assert values[1]["calls"][:3] == [4, 4, values[1]["size"]]  # its second micro-batch of 4 failed
    for rank, value in enumerate(values):
        assert_grads(value["parameters"], value["hand"], f"rank {rank}: ")
        assert_grads(value["parameters"], values[0]["parameters"], f"rank {rank} against rank 0: ")


@pytest.mark.parametrize("first", ["added into", "not added into"])
def test_a_gradient_that_cannot_be_added_into_in_place_leaves_the_others_given_back(first: str) -> None:
    # Every sum was made before any was given back: one that raised lost them all; then the error stopped
    # the loop, and every later parameter kept only what the step wrote (probes 75K, 75L).
    good, bad = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    good.grad = torch.full((3,), 10.0)  # the window's gradient so far
    bad.grad = torch.zeros(1).expand(3)  # one that cannot be added into in place
    aside = SetAside([good, bad] if first == "added into" else [bad, good])
    aside.before()
    (good.sum() + bad.sum()).backward()
    with pytest.raises(RuntimeError, match="unsupported operation"):
        aside.restore()
    torch.testing.assert_close(good.grad, torch.full((3,), 11.0))
