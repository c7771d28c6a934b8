"""The ranks' side of test_estimate_fsdp.py: one rank's estimated peak under FSDP2 against a real run.

Each rank builds a model, shards it with ``fully_shard`` (each block of its ``nn.ModuleList``, then
the root) inside a simulated device, and trains two steps; before each, ``koila.estimate`` gives its
peak, and the simulated device measures the real one (FSDP2's buffers, resized in place, included).
How the scenarios run and what they save: tests/_spawn.py.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from typing import Any

import torch
from _fsdp_ranks import cpu_mesh
from _spawn import Scenarios
from _turns import Turns
from torch import nn

import koila_retry as koila
from koila_retry._core import sharded
from koila_retry.testing import simulated_device

GROUPS = {"one": (1, 60), "two": (2, 60), "three": (3, 60)}
scenario = Scenarios(GROUPS)


def main(rank: int, group: str, port: int, directory: str) -> None:
    """The body of one spawned rank (see tests/_spawn.py)."""
    scenario.run(rank, group, port, directory)


class Blocks(nn.Module):
    """Residual MLP blocks, with odd sizes that FSDP2 pads."""

    def __init__(self, width: int = 64, hidden: int = 129, depth: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, width)) for _ in range(depth)
        )
        self.head = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


class Tiny(nn.Module):
    """A small transformer language model: embedding, encoder layers, head."""

    def __init__(self, vocab: int = 101, width: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True) for _ in range(depth)
        )
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


# name -> (model, its example inputs at some rows, rows, fully_shard's options by name, train or infer)
Case = tuple[Callable[[], nn.Module], Callable[[int], tuple[torch.Tensor, ...]], int, str, bool]


def _options(name: str) -> dict[str, Any]:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if name == "mixed":
        return {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    if name == "kept":
        return {"reshard_after_forward": False}
    return {}


def _mlp_rows(rows: int) -> tuple[torch.Tensor, ...]:
    return (torch.randn(rows, 64),)


def _tokens(rows: int) -> tuple[torch.Tensor, ...]:
    return (torch.randint(0, 101, (rows, 9)),)


CASES: dict[str, Case] = {
    "mlp": (Blocks, _mlp_rows, 16, "", True),
    "transformer": (Tiny, _tokens, 4, "", True),
    "mixed": (Blocks, _mlp_rows, 16, "mixed", True),
    "kept": (Blocks, _mlp_rows, 16, "kept", True),
    "inference": (Tiny, _tokens, 4, "", False),
}


def shard(net: nn.Module, options: dict[str, Any]) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    mesh = cpu_mesh()  # also where CUDA is present
    blocks = net.blocks if isinstance(net, Blocks) else net.layers
    for block in blocks:
        fully_shard(block, mesh=mesh, **options)
    root = {key: value for key, value in options.items() if key != "reshard_after_forward"}
    fully_shard(net, mesh=mesh, **root)
    return net


def step_of(net: nn.Module, optimizer: torch.optim.Optimizer | None) -> Callable[..., Any]:
    if optimizer is None:

        def infer(*inputs: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return net(*inputs).float().softmax(-1)

        return infer

    def train(*inputs: torch.Tensor) -> None:
        loss = net(*inputs).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return train


def _real_steps(
    make: Callable[[], nn.Module],
    examples: list[tuple[torch.Tensor, ...]],
    rows: int,
    options: dict[str, Any],
    training: bool,
    seed: int,
    estimating: bool,
) -> tuple[list[int], list[tuple[int, bool]]]:
    """Shard a new model and run a step on each example: each step's real peak and, if ``estimating``, its estimate."""
    peaks: list[int] = []
    estimates: list[tuple[int, bool]] = []
    torch.manual_seed(seed)
    with simulated_device("16GiB") as device:
        net = shard(make(), options)
        optimizer = torch.optim.Adam(net.parameters()) if training else None
        step = step_of(net, optimizer)
        for rows_of_step in examples:
            example = tuple(tensor.clone() for tensor in rows_of_step)  # made on the device, as the step's own
            if estimating:
                estimate = koila.estimate(step, *example)
                estimates.append((estimate.peak(rows), estimate.fsdp))
            # A collection in the step would free earlier garbage at a moment that varies.
            gc.collect()
            gc.disable()
            try:
                device.reset_peak()
                step(*example)
            finally:
                gc.enable()
            peaks.append(device.peak)
        del net, optimizer, step
        gc.collect()
    return peaks, estimates


@scenario("one", "two", "three")
def estimate_per_rank(rank: int, world: int) -> dict[str, Any]:
    """For each case: the real peak of two steps, the estimate before each, and the same model's on meta.

    The real peak is the smaller of two runs of the same model on the same rows. gloo's worker
    thread drops a finished collective's last reference to its buffers itself, once it holds the
    interpreter: now and then a buffer is still alive at the peak, one collective's more than the
    step needs (9 to 17 KiB of 280 to 510 KiB here, in about one case of ten).
    """
    found: dict[str, Any] = {}
    for name, (make, inputs, rows, option, training) in CASES.items():
        options = _options(option)
        torch.manual_seed(rank)
        examples = [inputs(rows) for _ in range(2)]
        first, estimates = _real_steps(make, examples, rows, options, training, rank, estimating=True)
        second, _ = _real_steps(make, examples, rows, options, training, rank, estimating=False)
        pairs = [
            (min(one, other), estimated, fsdp)
            for one, other, (estimated, fsdp) in zip(first, second, estimates, strict=True)
        ]
        # The same model built on the meta device, sharded by fsdp= over a world that is not running.
        with torch.device("meta"):
            plain = make()
        meta_step = step_of(plain, torch.optim.Adam(plain.parameters()) if training else None)
        meta = koila.estimate(meta_step, *inputs(rows), fsdp=world).peak(rows) if not options else None
        found[name] = {"pairs": pairs, "meta": meta}
    return found


@scenario("one", "two", "three")
def simulated_device_counts_shards(rank: int, world: int) -> dict[str, int]:
    """A DTensor counts its rank's shard on the simulated device, not the whole tensor's size."""
    with simulated_device("1GiB") as device:
        net = shard(Blocks(), {})
        live = device.live
    shards = sum(p.to_local().untyped_storage().nbytes() for p in net.parameters())  # type: ignore[attr-defined]
    whole = sum(p.numel() * p.element_size() for p in net.parameters())
    return {"live": live, "shards": shards, "whole": whole}


def _fingerprint(net: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    values = []
    for param in net.parameters():
        values.append(param.to_local().clone())  # type: ignore[attr-defined]
        if param.grad is not None:
            values.append(param.grad.to_local().clone())  # type: ignore[attr-defined]
    for state in optimizer.state.values():
        values.extend(v.to_local().clone() if hasattr(v, "to_local") else v.clone() for v in state.values())
    return values


def _fsdp_state(net: nn.Module) -> list[Any]:
    seen = []
    for module in sharded.fsdp_modules(net.modules()):
        state = sharded.state_of(module)
        seen.append((str(state._training_state), list(module._forward_pre_hooks), list(module._forward_hooks)))
        for group in sharded.param_groups(module):
            seen.append((str(group._training_state), group.is_sharded, group._all_gather_result is None))
    return seen


@scenario("two", "three")
def estimate_alone(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 alone estimates a step after a real one: a collective would hang it (the group's timeout ends it)."""
    torch.manual_seed(0)
    net = shard(Blocks(), {})
    optimizer = torch.optim.Adam(net.parameters())
    step = step_of(net, optimizer)
    example = _mlp_rows(16)
    loss = net(*example).pow(2).mean()
    loss.backward()
    optimizer.step()  # gradients kept: a DTensor each, lent as its shard
    before, state = _fingerprint(net, optimizer), _fsdp_state(net)
    peak = None
    if rank == 0:
        peak = koila.estimate(step, *example).peak(16)
    after = _fingerprint(net, optimizer)
    same = len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    # The model still trains, on every rank together.
    step(*example)
    return {"peak": peak, "same": same, "state": state == _fsdp_state(net), "checked": len(before)}


@scenario("one")
def estimate_beside_training(rank: int, world: int) -> dict[str, Any]:
    """One thread trains a sharded model while another estimates its step again and again.

    The estimate lends its copies to its own thread: the training thread sees FSDP2's own parameters,
    hooks and state throughout, and ends where the same training without estimates ends. The two take
    turns (``_turns.py``) only where the training assigns ``.grad`` (FSDP2's backward, the optimizer's
    ``zero_grad``), which PyTorch does not make safe against the estimate reading it: each estimate runs
    against the training's forward, FSDP2's all-gathers and gathered parameters in flight.
    """

    def train(steps: int | None) -> tuple[list[torch.Tensor], list[int], int, int]:
        """Train ``steps`` steps alone, or (``None``) beside estimates until three have ended."""
        torch.manual_seed(0)
        net = shard(Blocks(), {})
        optimizer = torch.optim.Adam(net.parameters())
        step = step_of(net, optimizer)
        turns = Turns()
        generator = torch.Generator().manual_seed(1)
        examples = [torch.randn(16, 64, generator=generator) for _ in range(8)]
        peaks: list[int] = []
        failures: list[str] = []
        stop = threading.Event()
        forwards = 0  # training forwards begun while an estimate ran

        def estimating() -> None:
            try:
                while not stop.is_set():
                    with turns.estimating():
                        peaks.append(koila.estimate(step, examples[0]).peak(16))
            except Exception as exc:
                failures.append(f"{type(exc).__name__}: {exc}")
            finally:
                turns.end()

        def trained(rows: torch.Tensor, beside: bool) -> None:
            nonlocal forwards
            forwards += beside and turns.beside()
            loss = net(rows).float().pow(2).mean()
            with turns.writing():
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()

        thread = threading.Thread(target=estimating) if steps is None else None
        taken = 0
        if thread is not None:
            thread.start()
        try:
            while (taken < steps) if steps is not None else (len(peaks) < 3 and not failures and taken < 2_000):
                trained(examples[taken % len(examples)], thread is not None)
                taken += 1
        finally:
            stop.set()
            turns.finish()
            if thread is not None:
                thread.join()
        assert not failures, failures[0]
        return [p.to_local().detach().clone() for p in net.parameters()], peaks, taken, forwards  # type: ignore[attr-defined]

    beside, peaks, taken, forwards = train(None)
    alone, _, _, _ = train(taken)
    return {
        "same": all(torch.equal(a, b) for a, b in zip(alone, beside, strict=True)),
        "estimates": len(peaks),
        "steps": taken,
        "forwards": forwards,
    }
