"""Spawned gloo groups for the tests: scenarios every rank runs in turn, and the group that runs them.

A module of scenarios (``tests/_ranks.py``, ``tests/_trainer_ranks.py``) makes a :class:`Scenarios`,
registers its scenarios with it, and has a top-level ``main(rank, group, port, directory)`` for
``torch.multiprocessing`` to start. A scenario is a function of ``(rank, world)`` that every rank
calls; what it returns (plain values and tensors) is saved with ``torch.save`` for the tests to
compare across ranks. An error that escapes a scenario is saved with its traceback, and the ranks go
on with the next scenario. A test module makes a :class:`Groups` for its module of scenarios.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

Scenario = Callable[[int, int], Any]
# What the server the ranks are forked from imports first; torch.distributed.nn before any process
# group, as examples/ddp_train.py says why.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.nn", "koila_retry"]


class Scenarios:
    """The scenarios of one module, and the groups of processes that run them.

    Args:
        groups (dict): by name, how many ranks, and how long a collective may wait
            before it raises (seconds).
    """

    def __init__(self, groups: dict[str, tuple[int, int]]) -> None:
        self.groups = groups
        self.registered: dict[str, tuple[Scenario, tuple[str, ...]]] = {}

    def __call__(self, *groups: str) -> Callable[[Scenario], Scenario]:
        """Register a scenario, run by the named groups, in the order of definition."""

        def register(function: Scenario) -> Scenario:
            self.registered[function.__name__] = (function, groups)
            return function

        return register

    def names_for(self, group: str) -> list[str]:
        return [name for name, (_, groups) in self.registered.items() if group in groups]

    def run(self, rank: int, group: str, port: int, directory: str) -> None:
        """The body of one spawned rank: join the group, run every scenario, save what each gave."""
        torch.set_num_threads(1)
        world, timeout = self.groups[group]
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout),
        )
        try:
            for name in self.names_for(group):
                # Every retry runs a full garbage collection; with torch imported, one takes ~0.1 s. Objects
                # made before the scenario are kept out of them (the scenario's own are collected as usual).
                gc.collect()
                gc.freeze()
                started = time.perf_counter()
                try:
                    outcome: dict[str, Any] = {"value": self.registered[name][0](rank, world)}
                except Exception as exc:  # saved for the test, which shows the traceback
                    outcome = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
                outcome["seconds"] = time.perf_counter() - started
                path = os.path.join(directory, f"{name}.{rank}.pt")
                torch.save(outcome, path + ".part")
                os.replace(path + ".part", path)
                dist.barrier()  # the next scenario starts together on every rank
        finally:
            dist.destroy_process_group()


def launched(rank: int, world: int, port: int) -> None:
    """Set the environment a launcher (torchrun) gives a rank: where a trainer looks for its place in the group."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",  # as accelerate sets it, without its warning
    )


def free_port() -> int:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        return int(listener.getsockname()[1])


class Group:
    """One spawned group of ranks, run to its end (or killed at the deadline), and what each rank saved.

    Args:
        ranks (module): the module of scenarios: its ``scenario`` (:class:`Scenarios`) and ``main``.
        name (str): the group, one of the module's.
        directory (Path): where the ranks save what they saw.
        deadline (float): seconds the group may take for all its scenarios, a guard against
            ranks that hang, not a measure of speed.
    """

    def __init__(self, ranks: ModuleType, name: str, directory: Path, deadline: float) -> None:
        self.name, self.directory = name, directory
        self.scenarios: Scenarios = ranks.scenario
        self.world = self.scenarios.groups[name][0]
        self.problem: str | None = None
        # Forked from a server that has imported torch and koila-retry once, not each rank
        # importing them again: a spawned rank took about 2 s of CPU to start.
        multiprocessing.set_forkserver_preload(PRELOAD)
        context = mp.start_processes(
            ranks.main,
            args=(name, free_port(), str(directory)),
            nprocs=self.world,
            join=False,
            start_method="forkserver",
        )
        ends = time.monotonic() + deadline
        try:
            while not context.join(timeout=0.5):
                if time.monotonic() > ends:
                    self.problem = (
                        f"the ranks hung: the {self.world} processes of group {name!r} had not finished "
                        f"after {deadline:.0f} s, and were killed"
                    )
                    break
        except Exception as exc:  # a rank raised or died: join() ended the others
            self.problem = f"a rank of group {name!r} failed: {exc}"
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join()

    def outcomes(self, scenario: str) -> list[dict[str, Any]]:
        """What each rank saved for ``scenario``: ``value``, or ``error`` and ``traceback``."""
        assert scenario in self.scenarios.names_for(self.name), f"group {self.name!r} does not run {scenario!r}"
        saved = []
        for rank in range(self.world):
            path = self.directory / f"{scenario}.{rank}.pt"
            if not path.exists():
                pytest.fail(f"rank {rank} saved nothing for {scenario!r}: {self.problem or 'the scenario did not run'}")
            saved.append(torch.load(path, weights_only=False))
        return saved

    def __getitem__(self, scenario: str) -> list[Any]:
        """What each rank's ``scenario`` returned, by rank; fails the test if one raised."""
        values = []
        for rank, outcome in enumerate(self.outcomes(scenario)):
            if "error" in outcome:
                pytest.fail(f"{scenario!r} raised on rank {rank}:\n{outcome['traceback']}")
            values.append(outcome["value"])
        return values


class Groups:
    """The groups of one test module, each spawned when a test first needs it."""

    def __init__(self, ranks: ModuleType, factory: pytest.TempPathFactory, deadline: float) -> None:
        self._ranks, self._factory, self._deadline = ranks, factory, deadline
        self._groups: dict[str, Group] = {}

    def __call__(self, name: str) -> Group:
        if name not in self._groups:
            directory = self._factory.mktemp(f"ranks-{name}")
            self._groups[name] = Group(self._ranks, name, directory, self._deadline)
        return self._groups[name]
