"""koila.estimate of optimizer steps that decide from values, and of fused optimizers.

Inside an optimizer's step, a value read from a meta tensor reads as a placeholder. PyTorch's
optimizers read their step counts and per-parameter scalars, which size nothing; LBFGS decides
from the loss and its curvature checks how many closures it runs and which steps it keeps, the
bytes of its peak: the estimate runs its longest step, and says so. Other code's reads inside a
step (a closure's) are noted. Fused optimizers refuse meta tensors before their first step: the
estimate runs that step as PyTorch's loop over parameters, in its own copy of the groups.

The truth is a real step on a simulated device, the model and its optimizer made there (so that
what the step frees of them, an old gradient or an LBFGS history entry, is freed there too).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import koila_retry as koila
from koila_retry.testing import simulated_device

ROWS = 16
Build = Callable[[], tuple[nn.Module, torch.optim.Optimizer, Callable[[torch.Tensor], None]]]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 8))


def lbfgs(line_search: str | None = None) -> Build:
    def build() -> tuple[nn.Module, torch.optim.Optimizer, Callable[[torch.Tensor], None]]:
        model = mlp()
        optimizer = torch.optim.LBFGS(model.parameters(), max_iter=6, history_size=8, line_search_fn=line_search)

        def step(x: torch.Tensor) -> None:
            def closure() -> torch.Tensor:
                optimizer.zero_grad()
                loss = (model(x) - 1).square().mean()
                loss.backward()
                return loss

            optimizer.step(closure)

        return model, optimizer, step

    return build


def trained(make: Callable[[Any], torch.optim.Optimizer]) -> Build:
    def build() -> tuple[nn.Module, torch.optim.Optimizer, Callable[[torch.Tensor], None]]:
        model = mlp()
        optimizer = make(model.parameters())

        def step(x: torch.Tensor) -> None:
            optimizer.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            optimizer.step()

        return model, optimizer, step

    return build


def estimated_and_real(build: Build, steps_before: int, rows: int = ROWS) -> tuple[koila.MemoryEstimate, int]:
    """The estimate of a step after ``steps_before`` real ones, and the peak of that step on a simulated device."""
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(0))
    _, optimizer, step = build()
    for _ in range(steps_before):
        step(x)
    optimizer.zero_grad(set_to_none=True)
    found = koila.estimate(step, x)
    with simulated_device("4GiB") as device:
        _, optimizer, step = build()
        for _ in range(steps_before):
            step(x)
        optimizer.zero_grad(set_to_none=True)
        batch = x.clone()
        device.reset_peak()
        step(batch)
    return found, device.peak


# --------------------------------------------------------------------------- LBFGS


@pytest.mark.parametrize("steps_before", [0, 1, 3], ids=["first", "second", "history-full"])
def test_an_lbfgs_step_is_estimated_at_the_peak_of_its_longest_step(steps_before: int) -> None:
    # Its convergence check read two placeholders alike and stopped after two closures: half the peak.
    found, real = estimated_and_real(lbfgs(), steps_before)
    assert found.peak(ROWS) == pytest.approx(real, rel=0.01)
    assert any(note.startswith("LBFGS's step:") for note in found.notes)


def test_an_lbfgs_step_with_a_line_search_misses_at_most_two_copies_of_the_gradient() -> None:
    # Each line search is taken to end at its first closure (the most iterations, the longest history);
    # a real one that runs more closures holds up to two more flat copies of the gradient meanwhile.
    flat = sum(parameter.numel() * parameter.element_size() for parameter in mlp().parameters())
    for steps_before in (0, 2):
        found, real = estimated_and_real(lbfgs("strong_wolfe"), steps_before)
        assert found.peak(ROWS) >= real - 2 * flat, steps_before
        assert any(note.startswith("LBFGS's step:") for note in found.notes)


def test_an_lbfgs_step_runs_as_many_closures_in_each_run_of_the_estimate_as_a_real_step() -> None:
    model = mlp()
    optimizer = torch.optim.LBFGS(model.parameters(), max_iter=6)
    closures: list[int] = []

    def step(x: torch.Tensor) -> None:
        def closure() -> torch.Tensor:
            closures.append(x.shape[0])
            optimizer.zero_grad()
            loss = (model(x) - 1).square().mean()
            loss.backward()
            return loss

        optimizer.step(closure)

    x = torch.randn(ROWS, 64)
    step(x)
    real = len(closures)
    closures.clear()
    found = koila.estimate(step, x)
    assert all(closures.count(size) == real for size in found.sizes)
    assert optimizer.param_groups[0]["tolerance_change"] == 1e-9  # -inf in the estimate's copy of the group only


def test_suggest_batch_size_for_an_lbfgs_step_fits_and_warns_of_the_longest_step() -> None:
    build = lbfgs()
    _, real = estimated_and_real(build, 0, rows=512)
    _, _, step = build()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        size = koila.suggest_batch_size(step, torch.randn(ROWS, 64), budget=real, margin=0)
    assert size <= 512
    assert any("LBFGS's step" in str(warning.message) for warning in caught)
    with simulated_device(real) as device:  # the real step at the size suggested, model and state included
        _, _, step = build()
        step(torch.randn(size, 64))
    assert device.peak <= real


def test_an_lbfgs_estimate_leaves_its_history_and_tolerances_as_they_were() -> None:
    _, optimizer, step = lbfgs()()
    x = torch.randn(ROWS, 64)
    step(x)
    state = optimizer.state[optimizer.param_groups[0]["params"][0]]
    history = list(state["old_dirs"])
    values = [tensor.clone() for tensor in history]
    group = dict(optimizer.param_groups[0])
    found = koila.estimate(step, x)
    assert found.breakdown(ROWS)["optimizer state"] >= sum(tensor.untyped_storage().nbytes() for tensor in history)
    assert all(a is b for a, b in zip(state["old_dirs"], history, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(history, values, strict=True))
    assert optimizer.param_groups[0] == group


# --------------------------------------------------------------------------- reads inside a step


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "Adam": lambda params: torch.optim.Adam(params, amsgrad=True),
    "AdamW-foreach": lambda params: torch.optim.AdamW(params, foreach=True),
    "SGD-nesterov": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True),
    "NAdam": lambda params: torch.optim.NAdam(params),
    "NAdam-foreach": lambda params: torch.optim.NAdam(params, foreach=True),
    "RAdam": lambda params: torch.optim.RAdam(params),
    "ASGD": lambda params: torch.optim.ASGD(params),
    "Adafactor": lambda params: torch.optim.Adafactor(params),
    "Adamax": lambda params: torch.optim.Adamax(params),
    "RMSprop": lambda params: torch.optim.RMSprop(params, centered=True),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_pytorchs_optimizers_reading_their_own_values_are_estimated_without_notes(name: str) -> None:
    # NAdam's product of momentum factors read 1.0, and the estimate divided by zero.
    found, real = estimated_and_real(trained(OPTIMIZERS[name]), 1)
    assert found.notes == ()
    assert found.peak(ROWS) == pytest.approx(real, rel=0.01)


class Clipped(torch.optim.SGD):
    """SGD that reads its own step count, kept as a tensor, and skips a step whose gradient is too large."""

    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for parameter in group["params"]:
                count = self.state[parameter].setdefault("count", torch.zeros(()))
                count.add_(1)
                if int(count) > 0 and parameter.grad is not None and parameter.grad.norm() > 100:
                    parameter.grad.zero_()
        return super().step(closure)


def test_a_read_inside_a_step_other_than_the_optimizers_own_is_noted_with_its_name() -> None:
    model = mlp()
    optimizer = Clipped(model.parameters(), lr=0.1)

    def step(x: torch.Tensor) -> None:
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()

    step(torch.randn(ROWS, 64))
    (note,) = koila.estimate(step, torch.randn(ROWS, 64)).notes
    assert note.startswith("reading a truth value from a tensor: inside Clipped's step, other than its own")


# --------------------------------------------------------------------------- fused optimizers


FUSED: dict[str, tuple[Callable[[Any], torch.optim.Optimizer], Callable[[Any], torch.optim.Optimizer]]] = {
    "Adam": (lambda p: torch.optim.Adam(p, fused=True), lambda p: torch.optim.Adam(p, foreach=False)),
    "AdamW": (lambda p: torch.optim.AdamW(p, fused=True), lambda p: torch.optim.AdamW(p, foreach=False)),
    "Adagrad": (lambda p: torch.optim.Adagrad(p, fused=True), lambda p: torch.optim.Adagrad(p, foreach=False)),
    "SGD": (
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=False),
    ),
    "Adam-tensor-lr": (
        lambda p: torch.optim.Adam(p, lr=torch.tensor(0.01), fused=True),
        lambda p: torch.optim.Adam(p, lr=torch.tensor(0.01), foreach=False),
    ),
}


@pytest.mark.parametrize("name", sorted(FUSED))
def test_the_first_step_of_a_fused_optimizer_is_estimated_as_its_loop_and_noted(name: str) -> None:
    # PyTorch's fused optimizers refuse meta tensors as they make their state: the estimate raised.
    fused, loop = FUSED[name]
    found, real = estimated_and_real(trained(fused), 0)
    _, real_loop = estimated_and_real(trained(loop), 0)
    assert found.peak(ROWS) == pytest.approx(real_loop, rel=0.01)
    # The loop's temporaries, which the fused kernel does not make: Adam's, three times the largest parameter.
    largest = max(parameter.numel() * parameter.element_size() for parameter in mlp().parameters())
    assert real <= found.peak(ROWS) <= real + 3 * largest
    assert any(note.startswith(f"{type(fused(mlp().parameters())).__name__}(fused=True)") for note in found.notes)


@pytest.mark.parametrize("name", sorted(FUSED))
def test_later_steps_of_a_fused_optimizer_are_estimated_as_the_fused_step(name: str) -> None:
    # SGD's, Adagrad's and a tensor learning rate's fused kernels have no meta kernel: the estimate raised.
    found, real = estimated_and_real(trained(FUSED[name][0]), 1)
    assert found.peak(ROWS) == pytest.approx(real, rel=0.01)
    assert found.notes == ()


@pytest.mark.parametrize("fails", [False, True], ids=["returns", "raises"])
def test_a_fused_optimizer_is_left_fused_by_the_estimate(fails: bool) -> None:
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)

    def step(x: torch.Tensor) -> None:
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
        if fails:
            raise RuntimeError("after the step")

    groups = [dict(group) for group in optimizer.param_groups]
    attributes = dict(vars(optimizer))
    if fails:
        with pytest.raises(RuntimeError, match="after the step"):
            koila.estimate(step, torch.randn(ROWS, 64))
    else:
        koila.estimate(step, torch.randn(ROWS, 64))
    assert [dict(group) for group in optimizer.param_groups] == groups
    assert all(group["fused"] is True for group in optimizer.param_groups)
    assert vars(optimizer) == attributes
    assert not optimizer.state


def test_the_first_step_of_a_fused_optimizer_under_a_gradient_scaler_is_estimated() -> None:
    def build() -> tuple[nn.Module, torch.optim.Optimizer, Callable[[torch.Tensor], None]]:
        model = mlp()
        optimizer = torch.optim.Adam(model.parameters(), fused=True)
        scaler = torch.amp.GradScaler("cpu")

        def step(x: torch.Tensor) -> None:
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().square().mean()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()

        return model, optimizer, step

    found, real = estimated_and_real(build, 0)
    largest = max(parameter.numel() * parameter.element_size() for parameter in mlp().parameters())
    assert real <= found.peak(ROWS) <= real + 3 * largest
    found, real = estimated_and_real(build, 1)
    assert found.peak(ROWS) == pytest.approx(real, rel=0.01)
