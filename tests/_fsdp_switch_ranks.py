"""The ranks' side of test_fsdp_switches.py: FSDP2's public switches flipped around ``koila.accumulate`` steps.

The model of tests/_fsdp_ranks.py (three sharded blocks and a sharded root, float64), stepped by
``koila.accumulate`` in two micro-batches, beside a copy of it sharded the same way and stepped by hand:
a whole-batch FSDP2 step, with the same switches. A first step records the micro-batches' collectives;
then a switch is flipped on both models, and the next two steps fail on rank 1. How the scenarios run
and what they save: tests/_spawn.py. Each group runs one scenario, so that one that hangs or aborts the
job takes no other with it; collectives wait 30 s before they raise.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _fsdp_ranks import ROWS, Count, batch, full, local, model, shard
from _layers import Inject
from _spawn import Scenarios
from torch import nn
from torch.nn import functional as F

import koila_retry as koila
from koila_retry._core import sharded

# A group of two ranks for each switch, then the hook's and the setters'.
NAMES = ("reshard_after_forward", "unshard_in_backward", "custom_all_gather", "hook", "setters")
GROUPS = dict.fromkeys(NAMES, (2, 30))
scenario = Scenarios(GROUPS)
Switch = Callable[[nn.Module], None]


def main(rank: int, group: str, port: int, directory: str) -> None:
    """The body of one spawned rank (see tests/_spawn.py)."""
    scenario.run(rank, group, port, directory)


def _comms(net: nn.Module) -> list[str]:
    """The types of the comm objects (private FSDP2 state) of every parameter group of ``net``."""
    groups = [group for module in sharded.fsdp_modules(net.modules()) for group in sharded.param_groups(module)]
    return sorted(
        {type(comm).__name__ for group in groups for comm in (group._all_gather_comm, group._reduce_scatter_comm)}
    )


def _steps(
    rank: int, world: int, switch: Switch, failures: list[dict[int, str]], setup: Switch | None = None
) -> dict[str, Any]:
    """Three steps of koila's and of the hand FSDP2 step; ``switch`` flipped on both after the first.

    Rank 1's layer in the middle block runs out of memory in the second and third steps, at their
    ``failures`` (forward call: where); a koila step starts at two micro-batches of ``ROWS // 2`` rows.
    """
    plain = model()
    hand = shard(copy.deepcopy(plain))
    net = shard(plain)
    for module in (net, hand):
        if setup is not None:
            setup(module)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    hand_optimizer = torch.optim.SGD(hand.parameters(), lr=0.1)

    @koila.accumulate(initial=ROWS // 2, cache=koila.NoCache())
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(net(x), y)

    inject: Inject = net[1][1]
    steps = []
    for number in range(3):
        if number == 1:
            switch(net)
            switch(hand)
        x_all, y_all = batch(world, seed=40 + number)
        x, y = local(x_all, rank), local(y_all, rank)
        inject.failures = failures[number - 1] if number and rank == 1 else {}
        inject.rows = []
        ooms = step.stats.ooms
        with Count() as count:
            step(x, y)
        F.mse_loss(hand(x), y).backward()
        steps.append(
            {
                "grads": full([p.grad for p in net.parameters()]),
                "expected": full([p.grad for p in hand.parameters()]),
                "rows": list(inject.rows),
                "ooms": step.stats.ooms - ooms,
                "plays": count.plays,
                "comms": _comms(net),
            }
        )
        for each in (optimizer, hand_optimizer):
            each.step()
            each.zero_grad()
    return {
        "steps": steps,
        "parameters": full(list(net.parameters())),
        "expected_parameters": full(list(hand.parameters())),
    }


class _GatherAndReduce:
    """A comm of the user's for FSDP2's all-gathers that makes another collective first: not the plain one."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False
    ) -> Any:
        dist.all_reduce(torch.zeros(3, dtype=input_tensor.dtype), group=group)
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def _custom_gather(net: nn.Module) -> None:
    for module in sharded.fsdp_modules(net.modules()):
        module.set_custom_all_gather(_GatherAndReduce())  # type: ignore[operator]


# By name: what is flipped between the first step and the second (on every FSDP2 module of the model).
# Rank 1 then fails in the first micro-batch's backward (gradient sync off), then in the last one's, where
# the blocks' reduce-scatters are left to play.
BACKWARDS = [{0: "backward"}, {1: "backward"}]
SWITCHES: dict[str, Switch] = {
    # No all-gather before each block's backward any more.
    "reshard_after_forward": lambda net: net.set_reshard_after_forward(False),  # type: ignore[operator]
    # The first block's input needs no gradient: its backward needs no gathered weight, and makes no all-gather.
    "unshard_in_backward": lambda net: net[0].set_unshard_in_backward(False),  # type: ignore[operator]
    # All-gathers that make another collective than the plain one a failed rank would play.
    "custom_all_gather": _custom_gather,
}


def _register(name: str, switch: Switch) -> None:
    def run(rank: int, world: int) -> dict[str, Any]:
        return _steps(rank, world, switch, BACKWARDS)

    run.__name__ = f"fsdp_switch_{name}"
    run.__doc__ = f"{name}, flipped after a step recorded the micro-batches' collectives; rank 1 then fails twice."
    scenario(name)(run)


for _name, _switch in SWITCHES.items():
    _register(_name, _switch)


def _all_reduce_hook(net: nn.Module) -> None:
    """An all-reduce hook of the user's on every FSDP2 module, that makes a collective of its own."""

    def hook(output: torch.Tensor) -> None:
        dist.all_reduce(output)
        output.div_(dist.get_world_size())

    for module in sharded.fsdp_modules(net.modules()):
        module.set_all_reduce_hook(hook)  # type: ignore[operator]


@scenario("hook")
def fsdp_all_reduce_hook(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 fails in the last micro-batch's backward, whose reduce-scatters the hook follows."""
    return _steps(rank, world, lambda net: None, [{1: "backward"}] * 2, setup=_all_reduce_hook)


def _allocate_from_group(enable: bool) -> Switch:
    """FSDP2's own comm setter, on every FSDP2 module of a model (it sets the module's own groups only)."""

    def switch(net: nn.Module) -> None:
        for module in sharded.fsdp_modules(net.modules()):
            module.set_allocate_memory_from_process_group_for_comm(enable)  # type: ignore[operator]

    return switch


@scenario("setters")
def fsdp_comm_setters(rank: int, world: int) -> dict[str, Any]:
    """FSDP2's own comm setter, called after a koila step; the next step fails on rank 1, and another after it."""
    value = _steps(rank, world, _allocate_from_group(True), BACKWARDS)
    net = shard(model())
    _allocate_from_group(True)(net)

    @koila.accumulate(cache=koila.NoCache())
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(net(x), y)

    x, y = batch(world, seed=50)
    step(local(x, rank), local(y, rank))
    _allocate_from_group(False)(net)  # and back, after a call
    value["turned_off"] = _comms(net)
    return value
