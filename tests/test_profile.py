"""koila.profile: the memory of one call, by module (forward and backward) and by source line."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import json
import subprocess
import sys
import threading
import types
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F
from torch.nn.modules import module as module_registry
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

import koila_retry as koila
from koila_retry._diagnostics.profile import LineRow, ModuleRow

KiB, MiB = 2**10, 2**20
FLOAT = 4  # bytes per float32
INDEX = 8  # bytes per int64
N, C, H, W = 8, 3, 32, 32
CHANNELS = 16


class CNN(nn.Module):
    """Conv2d -> ReLU -> MaxPool2d -> Flatten -> Linear, on 3x32x32 images."""

    def __init__(self, channels: int = CHANNELS) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(C, channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten())
        self.head = nn.Linear(channels * (H // 2) * (W // 2), 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def images(rows: int = N) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(rows, C, H, W, generator=generator), torch.randint(0, 10, (rows,), generator=generator)


def training_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[torch.Tensor, torch.Tensor], None]:
    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()

    return step


def by_name(found: koila.MemoryProfile[ModuleRow]) -> dict[str, ModuleRow]:
    return {row.name: row for row in found.rows}


def global_hooks() -> tuple[int, ...]:
    """Count every process-wide hook and mode a profile could leave behind."""
    return (
        len(module_registry._global_forward_pre_hooks),
        len(module_registry._global_forward_hooks),
        len(module_registry._global_forward_hooks_always_called),
        len(_global_optimizer_pre_hooks),
        len(_global_optimizer_post_hooks),
        torch._C._len_torch_dispatch_stack(),
        len(torch.overrides._get_current_function_mode_stack()),
    )


@pytest.fixture
def cnn() -> CNN:
    torch.manual_seed(0)
    return CNN()


# --------------------------------------------------------------------------- by module


def test_forward_peaks_are_the_activations_made(cnn: CNN) -> None:
    x, _ = images()
    found = koila.profile(cnn, x)
    rows = by_name(found)
    conv = N * CHANNELS * H * W * FLOAT
    pooled = N * CHANNELS * (H // 2) * (W // 2)
    # The convolution's output, ReLU's, the pooled values with their int64 indices, the logits.
    assert rows["features.0"].forward_peak == pytest.approx(conv, rel=0.05)
    assert rows["features.1"].forward_peak == pytest.approx(conv, rel=0.05)
    assert rows["features.2"].forward_peak == pytest.approx(pooled * (FLOAT + INDEX), rel=0.05)
    assert rows["features.3"].forward_peak == 0  # a view
    assert rows["head"].forward_peak == pytest.approx(N * 10 * FLOAT, rel=0.05)
    # Both the convolution's and ReLU's outputs are alive at once inside the Sequential.
    assert rows["features"].forward_peak == pytest.approx(2 * conv, rel=0.05)
    assert [(row.name, row.type) for row in found.rows] == [
        ("", "CNN"),
        ("features", "Sequential"),
        ("features.0", "Conv2d"),
        ("features.1", "ReLU"),
        ("features.2", "MaxPool2d"),
        ("features.3", "Flatten"),
        ("head", "Linear"),
    ]
    assert all(row.calls == 1 and row.backward_peak is None and row.backward_net is None for row in found.rows)


def test_forward_nets_are_what_the_modules_leave_allocated(cnn: CNN) -> None:
    x, _ = images()
    with torch.no_grad():  # nothing is saved for backward: a module leaves its output alone
        rows = by_name(koila.profile(cnn, x))
    conv = N * CHANNELS * H * W * FLOAT
    assert rows["features.0"].forward_net == conv
    assert rows["features.1"].forward_net == conv
    # Without grad, max pooling makes no indices.
    assert rows["features.2"].forward_net == N * CHANNELS * (H // 2) * (W // 2) * FLOAT
    assert rows["head"].forward_net == N * 10 * FLOAT


def test_backward_figures_exist_when_the_call_runs_backward(cnn: CNN) -> None:
    optimizer = torch.optim.SGD(cnn.parameters(), lr=0.1)
    x, y = images()
    rows = by_name(koila.profile(training_step(cnn, optimizer), x, y))
    assert all(row.backward_peak is not None and row.backward_net is not None for row in rows.values())
    conv = N * CHANNELS * H * W * FLOAT
    # ReLU's backward makes the gradient of its input, and frees the gradient of its
    # output and the output it saved.
    assert rows["features.1"].backward_peak == conv
    assert rows["features.1"].backward_net == -conv
    # The convolution's backward makes its weights' gradients (its input needs none).
    weights = sum(parameter.numel() for parameter in cnn.features[0].parameters()) * FLOAT
    assert rows["features.0"].backward_peak == weights
    assert rows["features.0"].backward_net == weights - conv
    root = rows[""].backward_peak
    assert root is not None
    assert root >= conv


def test_a_module_called_several_times_has_one_row_with_its_calls() -> None:
    layer = nn.Linear(64, 64)

    def fn(x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = layer(x)
        return x

    with torch.no_grad():
        found = koila.profile(fn, torch.randn(32, 64))
    (row,) = found.rows
    assert (row.name, row.calls, row.forward_peak) == ("", 3, 32 * 64 * FLOAT)
    assert row.forward_net == 3 * 32 * 64 * FLOAT  # summed over the calls (the caller frees them)


def test_what_an_operator_grows_in_place_counts_as_what_it_makes() -> None:
    rows = torch.ones(256, 256)

    def grown(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.empty(0)
        torch.cat([rows] * 16, out=out)  # 4 MiB into an empty out=
        return out, torch.empty(0).resize_(2**20)  # and 4 MiB by a resize

    def made(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat([rows] * 16), torch.empty(2**20)

    found, expected = koila.profile(grown, rows, by="line"), koila.profile(made, rows, by="line")
    assert found.peak - found.start == expected.peak - expected.start == 8 * 2**20


def test_several_modules_are_named_by_what_the_call_binds_them_to(cnn: CNN) -> None:
    criterion = nn.CrossEntropyLoss()

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        criterion(cnn(x), y).backward()

    found = koila.profile(step, *images())
    names = [row.name for row in found.rows]
    assert names == ["cnn", "cnn.features", *[f"cnn.features.{i}" for i in range(4)], "cnn.head", "criterion"]
    assert found.rows[-1].type == "CrossEntropyLoss"


def test_in_place_modules_and_pass_throughs_keep_their_backward_apart() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Identity(), nn.Linear(64, 64), nn.ReLU(inplace=True), nn.Linear(64, 64))
    x = torch.randn(32, 64, requires_grad=True)

    def fn(inputs: torch.Tensor) -> None:
        model(inputs).sum().backward()

    hidden = x * 1  # not a leaf: the first layer's input has a node of its own
    rows = by_name(koila.profile(fn, hidden))
    assert (rows["0"].backward_peak, rows["0"].backward_net) == (None, None)  # nothing to do in backward
    # ReLU's backward, hooked after the in-place change: it makes the gradient of its
    # input, and frees its output's gradient and the output it saved (the Linear's, changed in place).
    assert rows["2"].backward_peak == 32 * 64 * FLOAT
    assert rows["2"].backward_net == -32 * 64 * FLOAT
    assert rows["1"].backward_peak is not None
    # Backward goes on into the graph that made a real argument (a meta one is a leaf), after the modules'.
    assert koila.profile(fn, x * 1, fake=True).rows == koila.profile(fn, x * 1).rows
    # The hooks were on autograd's nodes: the caller's tensors hold none.
    assert x._backward_hooks is None
    assert hidden._backward_hooks is None
    assert all(parameter._backward_hooks is None for parameter in model.parameters())


def test_a_leaf_input_ends_its_modules_backward_where_its_gradient_is_made() -> None:
    # A learnable query passed as it is: its gradient node, made anew in the forward, lacked the hook,
    # and the small module's backward ran on through the big branch's (1 MiB, not 52 bytes; probe 72D).
    torch.manual_seed(0)
    big = nn.Sequential(nn.Linear(256, 1024), nn.Tanh(), nn.Linear(1024, 1))
    small = nn.Linear(4, 1)
    x = torch.randn(8, 256)

    def fn(query: torch.Tensor, copied: bool) -> None:
        loss = big(x).sum()
        (loss + small(query * 1 if copied else query).sum()).backward()

    query = torch.randn(8, 4, requires_grad=True)
    leaf = by_name(koila.profile(fn, query, False))["small"]
    query.grad = None
    inner = by_name(koila.profile(fn, query, True))["small"]
    assert leaf.backward_peak == inner.backward_peak
    assert leaf.backward_peak is not None
    assert leaf.backward_peak < 1024


@pytest.mark.parametrize("leaf", [False, True], ids=["graph-dropped", "saliency"])
def test_a_loop_whose_graphs_are_dropped_peaks_as_one_pass_of_it(leaf: bool) -> None:
    # The fix above first kept every input's node until the profile ended: each pass's graph (its saved
    # activations), or each leaf input with its gradient, stayed, and the peak grew with the passes (72I).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))

    def passes(x: torch.Tensor) -> list[float]:
        kept = []
        for chunk in x.split(16):
            if leaf:
                chunk = chunk.clone().requires_grad_()
                model(chunk).sum().backward()
                kept.append(float(chunk.grad.abs().max()))  # type: ignore[union-attr]
            else:
                kept.append(float(model(chunk).sum().detach()))  # its graph dropped at once
        return kept

    x = torch.randn(128, 64)
    # From the second pass on: the first made the parameters' gradients, which later ones add into.
    peaks = [koila.profile(passes, x[:rows]).peak for rows in (32, 64, 128)]
    assert peaks[0] == peaks[1] == peaks[2]


def test_fake_takes_an_argument_made_by_a_graph_that_the_call_changes_in_place() -> None:
    # Remade on meta as a view of a leaf, autograd refused the in-place change that the real run makes (72I).
    layer = nn.Linear(16, 16)
    base = torch.randn(8, 16, requires_grad=True)

    def fn(hidden: torch.Tensor) -> None:
        hidden.mul_(2)
        layer(hidden).sum().backward()

    fake = koila.profile(fn, base * 1.0, fake=True)  # first: the real run leaves the gradients
    real = koila.profile(fn, base * 1.0)
    assert fake.rows == real.rows


def test_a_call_that_takes_gradients_with_autograd_grad_is_profiled() -> None:
    # torch refuses to tell, inside autograd.grad, whether a leaf's node will run: profile raised it, and
    # so did any accumulate step on its captured path (a post-accumulate-grad hook, DDP, backward=).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    x = torch.randn(8, 4)

    def step(x: torch.Tensor) -> Any:
        return torch.autograd.grad(model(x).sum(), list(model.parameters()))

    for fake in (False, True):
        rows = by_name(koila.profile(step, x, fake=fake))
        assert rows["0"].backward_peak is not None
    model[0].weight.register_post_accumulate_grad_hook(lambda parameter: None)
    accumulated = koila.accumulate(lambda x: model(x).sum(), initial=4)
    assert by_name(koila.profile(accumulated, x))["2"].calls == 2
    assert model[0].weight.grad is not None


def test_a_generator_or_async_function_is_refused() -> None:
    # Their bodies run once the result is iterated or awaited, after the profile: it came back empty.
    def numbers() -> Iterator[torch.Tensor]:
        yield torch.ones(4)

    async def infer() -> torch.Tensor:
        return torch.ones(4)

    async def stream() -> AsyncIterator[torch.Tensor]:
        yield torch.ones(4)

    class Infer:
        async def __call__(self) -> torch.Tensor:
            return torch.ones(4)

    for fn in (numbers, infer, stream, Infer()):
        with pytest.raises(TypeError, match=r"^koila.profile cannot profile .*\(\): it is a generator or async"):
            koila.profile(fn)
    assert koila.profile(lambda: list(numbers())).peak == 16
    assert koila.profile(lambda: asyncio.run(infer())).peak == 16


def test_partials_and_bound_methods_are_profiled_as_their_function(cnn: CNN) -> None:
    x, _ = images()
    with torch.no_grad():
        whole = koila.profile(cnn, x)
        # Calling forward itself skips the module's __call__, and so the root's row.
        assert koila.profile(cnn.forward, x).rows == whole.rows[1:]
        assert koila.profile(functools.partial(cnn, x)).rows == whole.rows
        assert str(koila.profile(functools.partial(work), by="line")).startswith("Memory of work by line")


def test_device_filters_the_storages_counted(cnn: CNN) -> None:
    x, _ = images()
    assert koila.profile(cnn, x).device == torch.device("cpu")
    elsewhere = koila.profile(cnn, x, device="meta")
    assert elsewhere.device == torch.device("meta")
    assert elsewhere.peak == elsewhere.start == 0
    assert all(row.forward_peak == 0 for row in elsewhere.rows)

    def no_tensors() -> None:
        torch.zeros(1024)

    assert koila.profile(no_tensors).device == torch.device("cpu")


def test_start_and_peak_count_what_was_alive_before(cnn: CNN) -> None:
    x, _ = images()
    with torch.no_grad():
        found = koila.profile(cnn, x)
    parameters = sum(parameter.numel() for parameter in cnn.parameters()) * FLOAT
    assert found.start == parameters + x.numel() * FLOAT
    assert found.peak == found.start + by_name(found)[""].forward_peak


def test_other_threads_are_not_counted(cnn: CNN) -> None:
    other = nn.Linear(1024, 1024)

    def fn(x: torch.Tensor) -> None:
        with torch.no_grad():
            thread = threading.Thread(target=lambda: other(torch.ones(256, 1024)))
            thread.start()
            thread.join()
            cnn(x)

    found = koila.profile(fn, images()[0])
    assert "other" not in [row.name for row in found.rows]
    assert found.peak - found.start == by_name(found)["cnn"].forward_peak


# --------------------------------------------------------------------------- by line


def allocate(rows: int) -> torch.Tensor:
    return torch.empty(rows, 256)


def work() -> int:
    small = torch.ones(16)
    big = torch.zeros(1024, 1024)
    other = allocate(256)
    return small.numel() + big.numel() + other.numel()


def looping() -> None:
    kept = []
    for _ in range(3):
        kept.append(torch.zeros(64, 64))


def failing() -> None:
    big = torch.zeros(1024, 1024)
    raise ValueError(f"failed after {big.numel()} zeros")


def row_of(found: koila.MemoryProfile[LineRow], text: str) -> LineRow:
    (row,) = [row for row in found.rows if row.source == text]
    return row


def test_the_line_that_allocates_gets_it_with_its_source() -> None:
    found = koila.profile(work, by="line")
    big = row_of(found, "big = torch.zeros(1024, 1024)")
    assert (big.peak, big.net, big.runs) == (4 * MiB, 4 * MiB, 1)
    assert big.file == __file__
    assert big.line == work.__code__.co_firstlineno + 2
    assert big.function == "work"
    assert row_of(found, "small = torch.ones(16)").net == 16 * FLOAT
    assert [row.line - work.__code__.co_firstlineno for row in found.rows] == [1, 2, 3, 4]


def test_a_line_calling_an_unwatched_function_gets_its_allocations() -> None:
    found = koila.profile(work, by="line")
    call = row_of(found, "other = allocate(256)")
    assert (call.peak, call.net) == (256 * 256 * FLOAT, 256 * 256 * FLOAT)
    assert all(row.function == "work" for row in found.rows)
    watched = koila.profile(work, by="line", watch=[work, allocate])
    inside = row_of(watched, "return torch.empty(rows, 256)")
    assert (inside.function, inside.peak) == ("allocate", 256 * 256 * FLOAT)
    assert row_of(watched, "other = allocate(256)").peak == 256 * 256 * FLOAT  # what its callee did, too


def test_a_function_decorated_by_a_front_end_has_its_own_lines_profiled() -> None:
    """The README's profile of an @koila.accumulate step showed one row: a line of koila's wrapper."""
    model = torch.nn.Linear(16, 4)

    @koila.accumulate
    def train_step(inputs: torch.Tensor) -> torch.Tensor:
        outputs = model(inputs)
        return outputs.square().mean()

    @koila.batch(initial=8)
    def evaluate(batch_size: int, data: torch.Tensor) -> torch.Tensor:
        return torch.cat([model(chunk) for chunk in data.split(batch_size)])

    for fn, args in ((train_step, (torch.ones(32, 16),)), (evaluate, (torch.ones(32, 16),))):
        found = koila.profile(fn, *args, by="line")
        assert found.rows
        assert {row.file for row in found.rows} == {__file__}, found
        assert {row.function for row in found.rows} == {fn.__qualname__}, found
    model.zero_grad(set_to_none=True)


class _LoopingWrapped:
    """A callable whose ``__wrapped__`` leads back to one like it: inspect.unwrap raises ValueError."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        doubled = x * 2
        return doubled

    @property
    def __wrapped__(self) -> _LoopingWrapped:
        return _LoopingWrapped()


def test_a_callable_whose_wrapped_loops_is_profiled_as_itself() -> None:
    found = koila.profile(_LoopingWrapped(), torch.ones(4, 4), by="line")
    assert [row.source for row in found.rows] == ["doubled = x * 2", "return doubled"]


def test_a_line_in_a_loop_counts_its_runs_and_sums_its_nets() -> None:
    found = koila.profile(looping, by="line")
    row = row_of(found, "kept.append(torch.zeros(64, 64))")
    assert (row.runs, row.peak, row.net) == (3, 64 * 64 * FLOAT, 3 * 64 * 64 * FLOAT)
    assert row_of(found, "for _ in range(3):").runs == 4  # the last run finds the range empty


def test_a_module_is_watched_through_its_forward(cnn: CNN) -> None:
    x, _ = images()
    with torch.no_grad():
        found = koila.profile(cnn, x, by="line")
        (row,) = found.rows
        assert row.source == "return self.head(self.features(x))"
        assert row.function == "CNN.forward"
        assert koila.profile(lambda x: cnn(x), x, by="line", watch=cnn).rows == found.rows


def tracer(frame: types.FrameType, event: str, arg: Any) -> None:
    return None


@pytest.mark.parametrize("installed", [None, tracer], ids=["no tracer", "a tracer"])
def test_the_tracer_before_is_the_tracer_after(installed: Any) -> None:
    previous = sys.gettrace()
    sys.settrace(installed)
    try:
        koila.profile(work, by="line")
        after = sys.gettrace()
        with pytest.raises(ValueError, match="failed after"):
            koila.profile(failing, by="line")
        after_error = sys.gettrace()
    finally:
        sys.settrace(previous)
    assert after is installed
    assert after_error is installed


# --------------------------------------------------------------------------- fake


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[int, torch.Tensor]]:
    """Every tensor the model and optimizer hold: its identity and a copy of its values."""
    tensors: list[torch.Tensor] = []
    for parameter in model.parameters():
        tensors.append(parameter)
        if parameter.grad is not None:
            tensors.append(parameter.grad)
    for state in optimizer.state.values():
        tensors.extend(value for value in state.values() if isinstance(value, torch.Tensor))
    return [(id(tensor), tensor.detach().clone()) for tensor in tensors]


def assert_untouched(
    model: nn.Module, optimizer: torch.optim.Optimizer, before: list[tuple[int, torch.Tensor]]
) -> None:
    after = snapshot(model, optimizer)
    assert [identity for identity, _ in after] == [identity for identity, _ in before]
    for (_, now), (_, then) in zip(after, before, strict=True):
        assert now.device == then.device
        assert torch.equal(now, then)


@pytest.mark.parametrize("by", ["module", "line"])
def test_fake_gives_the_rows_of_the_real_run(cnn: CNN, by: str) -> None:
    optimizer = torch.optim.Adam(cnn.parameters())
    step = training_step(cnn, optimizer)
    x, y = images()
    step(x, y)  # the optimizer's state exists, as in every later step
    before = snapshot(cnn, optimizer)
    fake = koila.profile(step, x, y, by=by, fake=True)
    assert_untouched(cnn, optimizer, before)
    real = koila.profile(step, x, y, by=by)
    assert fake.rows == real.rows
    assert (fake.start, fake.peak, fake.fake, real.fake) == (real.start, real.peak, True, False)
    assert len(real.rows) >= 4


def test_fake_before_the_first_step_leaves_the_optimizer_without_state(cnn: CNN) -> None:
    optimizer = torch.optim.Adam(cnn.parameters())
    step = training_step(cnn, optimizer)
    x, y = images()
    state, groups = optimizer.state, optimizer.param_groups
    parameters = {name: (parameter, parameter.detach().clone()) for name, parameter in cnn.named_parameters()}
    fake = koila.profile(step, x, y, fake=True)
    assert optimizer.state is state
    assert len(state) == 0
    assert optimizer.param_groups is groups
    for name, parameter in cnn.named_parameters():
        original, values = parameters[name]
        assert parameter is original
        assert parameter.grad is None
        assert torch.equal(parameter, values)
    assert fake.rows == koila.profile(step, x, y).rows


@settings(max_examples=8, deadline=None)
@given(rows=st.integers(1, 6), channels=st.integers(1, 6), by=st.sampled_from(["module", "line"]))
def test_fake_equals_real_at_any_shape(rows: int, channels: int, by: str) -> None:
    model = CNN(channels)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = training_step(model, optimizer)
    x, y = images(rows)
    step(x, y)
    fake = koila.profile(step, x, y, by=by, fake=True)
    real = koila.profile(step, x, y, by=by)
    assert (fake.rows, fake.start, fake.peak) == (real.rows, real.start, real.peak)


def test_fake_casts_under_autocast_and_steps_every_optimizer_as_the_estimate_does() -> None:
    # Fake ignored autocast (its peak a third low) and crashed on NAdam's products (ZeroDivisionError) and a
    # fused optimizer's first step, which the estimate serves (probe 76J).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    x = torch.randn(8, 64)

    def infer(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x).float().sum()

    assert koila.profile(infer, x, fake=True).peak == koila.profile(infer, x).peak
    for optimizer in (torch.optim.NAdam(model.parameters()), torch.optim.Adam(model.parameters(), fused=True)):
        step = training_step(model, optimizer)
        fake = koila.profile(step, x, torch.randint(0, 64, (8,)), fake=True)
        assert fake.peak > 0
        assert optimizer.state == {}  # the meta run's state was lent, not kept


@dataclasses.dataclass
class _Hidden:
    states: torch.Tensor


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> _Hidden:
        return _Hidden(self.proj(x).relu())


def test_a_module_that_returns_a_dataclass_has_its_backward_figures() -> None:
    # pytree took the dataclass whole: no tensor of it was watched, and the backward showed "-" (probe 76J).
    encoder, head = _Encoder(), nn.Linear(16, 1)
    found = by_name(koila.profile(lambda x: head(encoder(x).states).sum().backward(), torch.randn(8, 16)))
    assert sorted(found) == ["encoder", "encoder.proj", "head"]
    assert found["encoder"].backward_peak is not None
    assert found["encoder.proj"].backward_peak is not None


def test_fake_uses_no_memory_for_a_big_call() -> None:
    def huge(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(1 << 20, 1 << 20) @ x  # 4 TiB, if it were real

    found = koila.profile(huge, torch.ones(1 << 20, 4), by="line", fake=True)
    (row,) = found.rows
    assert row.peak == (1 << 40) * FLOAT + (1 << 20) * 4 * FLOAT


def test_fake_reads_values_as_placeholders(cnn: CNN) -> None:
    def fn(x: torch.Tensor) -> float:
        return float(cnn(x).sum().item())

    x, _ = images()
    assert koila.profile(fn, x, fake=True).rows == koila.profile(fn, x).rows


def test_fake_notes_what_the_call_raised(cnn: CNN) -> None:
    def fn(x: torch.Tensor) -> None:
        cnn(x[:, :2])  # two channels where the convolution takes three

    before = global_hooks()
    with pytest.raises(RuntimeError) as raised:
        koila.profile(fn, images()[0], fake=True)
    assert any("meta tensors" in note for note in getattr(raised.value, "__notes__", []))
    assert global_hooks() == before
    assert all(parameter.device.type == "cpu" for parameter in cnn.parameters())


# --------------------------------------------------------------------------- what it shows


def column_ends(rule: str) -> list[int]:
    return [
        index + 1
        for index, char in enumerate(rule)
        if char == "-" and (index + 1 == len(rule) or rule[index + 1] == " ")
    ]


def test_str_is_an_aligned_table_naming_the_modules(cnn: CNN) -> None:
    optimizer = torch.optim.SGD(cnn.parameters(), lr=0.1)
    found = koila.profile(training_step(cnn, optimizer), *images())
    text = str(found)
    lines = text.splitlines()
    assert lines[0].startswith("Memory of ")
    assert "peak" in lines[0]
    header, rule, *rows = lines[1:-1]
    assert header.split("  ")[0] == "module"
    assert len(rows) == len(found.rows)
    ends = column_ends(rule)
    for line in [header, *rows]:
        for end in ends[1:]:  # the figures are right-aligned, each ending where its column does
            assert line[end - 1] != " ", (line, end)
            assert end == len(line) or line[end] == " "
    assert "features.0 (Conv2d)" in text
    assert "head (Linear)" in text
    assert "512.00 KiB" in text


def test_str_by_line_shows_file_line_and_source() -> None:
    text = str(koila.profile(work, by="line"))
    first = work.__code__.co_firstlineno
    assert f"test_profile.py:{first + 2}" in text
    assert "big = torch.zeros(1024, 1024)" in text
    assert "4.00 MiB" in text


def test_html_and_dict(cnn: CNN) -> None:
    x, _ = images()
    found = koila.profile(cnn, x)
    page = found._repr_html_()
    assert "<table>" in page
    assert "features.0 (Conv2d)" in page
    data = found.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["rows"][2] == found.rows[2]._asdict()
    assert (data["by"], data["device"], data["peak"]) == ("module", "cpu", found.peak)
    lines = koila.profile(work, by="line").to_dict()
    assert json.loads(json.dumps(lines)) == lines
    assert repr(found).startswith("MemoryProfile(by='module', device='cpu', fake=False")


# --------------------------------------------------------------------------- errors and hygiene


def test_bad_arguments_are_refused_naming_the_value() -> None:
    with pytest.raises(ValueError, match="'module', 'line'.*'lines'"):
        koila.profile(work, by="lines")
    with pytest.raises(TypeError, match="callable.*42"):
        koila.profile(42)  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="by='line'"):
        koila.profile(work, watch=work)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="watch=.*int 7"):
        koila.profile(work, by="line", watch=7)
    with pytest.raises(TypeError, match="watch=.*builtin"):
        koila.profile(work, by="line", watch=torch.relu)
    with pytest.raises(TypeError, match="fake must be True or False"):
        koila.profile(work, fake="yes")  # type: ignore[call-overload]


@pytest.mark.parametrize("fake", [False, True])
@pytest.mark.parametrize("by", ["module", "line"])
def test_what_the_call_raises_propagates_and_nothing_stays_installed(cnn: CNN, by: str, fake: bool) -> None:
    made: list[weakref.ref[torch.Tensor]] = []

    def fn(x: torch.Tensor) -> None:
        out = cnn(x)
        made.append(weakref.ref(out))
        raise KeyError("stop")

    before, tracing = global_hooks(), sys.gettrace()
    with pytest.raises(KeyError, match="stop"):
        koila.profile(fn, images()[0], by=by, fake=fake)
    assert global_hooks() == before
    assert sys.gettrace() is tracing
    assert made[0]() is None  # nothing kept the failed call's tensors: no exception, no frame


@pytest.mark.parametrize("fake", [False, True])
@pytest.mark.parametrize("by", ["module", "line"])
def test_no_tensor_of_the_run_outlives_it(cnn: CNN, by: str, fake: bool) -> None:
    optimizer = torch.optim.SGD(cnn.parameters(), lr=0.1)
    step = training_step(cnn, optimizer)
    made: list[weakref.ref[torch.Tensor]] = []

    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = cnn(x)
        made.append(weakref.ref(logits))
        step(x, y)
        return logits

    before = global_hooks()
    found = koila.profile(fn, *images(), by=by, fake=fake)
    assert made[0]() is None
    assert global_hooks() == before
    assert found.rows


def test_the_result_is_dropped_and_the_arguments_kept(cnn: CNN) -> None:
    x, _ = images()
    kept = copy.deepcopy(x)
    koila.profile(cnn, x)
    assert torch.equal(x, kept)


def test_a_lazy_modules_first_call_is_profiled() -> None:
    """Its parameters, uninitialised when the profile began, refused to name their storage."""
    model = torch.nn.Sequential(torch.nn.LazyLinear(8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    found = koila.profile(model, torch.ones(4, 3))
    assert {"", "0", "1", "2"} <= {row.name for row in found.rows}
    assert not torch.nn.parameter.is_lazy(model[0].weight)


def test_import_has_no_side_effects() -> None:
    code = (
        "import sys, torch\n"
        "from torch.nn.modules import module\n"
        "import koila_retry\n"
        "print(sys.gettrace(), len(module._global_forward_hooks), len(module._global_forward_pre_hooks),"
        " torch._C._len_torch_dispatch_stack())"
    )
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.split() == ["None", "0", "0", "0"]


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state:UserWarning")
@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_a_fake_profile_counts_a_sparse_argument_as_its_dense_tensor(layout: str) -> None:
    # Meta has no kernels for sparse operands: profile(fake=True) raised PyTorch's NotImplementedError, where
    # koila.estimate counts the dense tensor (probe 77B).
    weight = torch.randn(64, 32)
    dense = torch.randn(16, 64).relu()
    sparse = dense.to_sparse() if layout == "coo" else dense.to_sparse_csr()
    found = koila.profile(lambda x: torch.sparse.mm(x, weight), sparse, fake=True)
    assert found.peak >= dense.nbytes + 16 * 32 * 4  # the input counted dense, and the result
