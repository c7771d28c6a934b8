"""initial="auto": notes on what the estimate cannot model, a split step's own memory, and the memo's lifetime."""

from __future__ import annotations

import copy
import gc
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import koila_retry as koila
from koila_retry.testing import simulated_device

MiB = 2**20
INTEGER_READ = "reading an integer from a tensor"


@pytest.fixture
def caught() -> Iterator[list[warnings.WarningMessage]]:
    """Every warning raised in the test, none filtered out as a repeat."""
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        yield records


def inexact(records: list[warnings.WarningMessage]) -> list[str]:
    return [str(record.message) for record in records if "may be inexact" in str(record.message)]


def trimmed_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(4 * 8, 16), nn.ReLU(), nn.Linear(16, 1))


def trimming(model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A loss over the time steps the longest sequence uses: a size read from a tensor's values."""

    def loss(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        longest = int(lengths.max())
        padded = F.pad(x[:, :longest], (0, 0, 0, 4 - longest))
        return model(padded).square().mean()

    return loss


def sequences(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(rows, 4, 8), torch.full((rows,), 3)


def adam_step() -> tuple[Callable[[torch.Tensor, torch.Tensor], None], torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.Adam(model.parameters())

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()  # reads its step counts with .item(): placeholders of their own

    x, y = torch.randn(8, 8), torch.randn(8, 1)
    step(x, y)  # the optimizer's state exists, as in every later step
    return step, x, y


# --------------------------------------------------------------------------- notes


def test_an_integer_read_from_a_tensor_is_noted_on_the_estimate_and_in_its_description() -> None:
    found = koila.estimate(trimming(trimmed_model()), *sequences(8))
    (note,) = found.notes
    assert note.startswith(INTEGER_READ)
    first, second = found.describe(8).splitlines()
    assert first.startswith("estimated peak")
    assert second == f"  may be inexact: {note}"


def test_an_estimate_of_exact_operators_has_no_notes() -> None:
    step, x, y = adam_step()
    found = koila.estimate(step, x, y)
    assert found.notes == ()
    assert len(found.describe(8).splitlines()) == 1


def test_a_cuda_estimate_notes_the_convolution_workspace_it_does_not_model() -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(1))
    x = torch.randn(2, 3, 8, 8)
    model(x)

    def step(x: torch.Tensor) -> None:
        model(x).sum().backward()

    assert koila.estimate(step, x).notes == ()  # oneDNN's buffers on the CPU are modelled
    (note,) = koila.estimate(step, x, device="cuda").notes
    assert "cuDNN" in note


def test_suggest_batch_size_warns_once_when_the_estimate_has_notes(caught: list[warnings.WarningMessage]) -> None:
    size = koila.suggest_batch_size(trimming(trimmed_model()), *sequences(8), budget="64MiB")
    (message,) = inexact(caught)
    assert f"koila.suggest_batch_size chose {size} for " in message
    assert INTEGER_READ in message
    caught.clear()
    step, x, y = adam_step()
    koila.suggest_batch_size(step, x, y, budget="64MiB")
    assert inexact(caught) == []


def test_auto_warns_once_per_decorated_function(caught: list[warnings.WarningMessage]) -> None:
    model = trimmed_model()
    first = koila.accumulate(initial="auto")(trimming(model))
    second = koila.accumulate(initial="auto", cache=koila.NoCache())(trimming(model))
    with simulated_device("64MiB"):
        for rows in (8, 8, 16):
            first(*sequences(rows))
            second(*sequences(rows))
    messages = inexact(caught)
    assert len(messages) == 2
    assert all(INTEGER_READ in message and "initial='auto' chose the first size of" in message for message in messages)


def test_chunked_auto_warns_once_for_repeated_calls(caught: list[warnings.WarningMessage]) -> None:
    model = trimmed_model()

    def forward(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return model(x[:, : int(lengths.max())].sum(1, keepdim=True).expand(-1, 4, -1))

    with simulated_device("64MiB"), torch.no_grad():
        for _ in range(3):
            koila.chunked(forward, *sequences(8), initial="auto")
    assert len(inexact(caught)) == 1


def test_auto_logs_its_warnings_where_a_filter_makes_them_errors(caplog: pytest.LogCaptureFixture) -> None:
    # The estimate is kept after the first call, which alone warns: as an error, it would fail that call only.
    def doubled(x: torch.Tensor) -> torch.Tensor:
        return x * 2 if int(x.sum()) > -1 else x  # a value read: the estimate has a note

    def unestimable(x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "meta":
            raise RuntimeError("no meta kernel here")
        return x * 2

    x = torch.ones(64, 8)
    with warnings.catch_warnings(), simulated_device("64MiB"), torch.no_grad():
        warnings.simplefilter("error")
        for _ in range(2):
            assert torch.equal(koila.chunked(doubled, x, initial="auto"), x * 2)
            assert torch.equal(koila.chunked(unestimable, x, initial="auto"), x * 2)
    logged = [record.getMessage() for record in caplog.records if record.name == "koila_retry"]
    assert len(logged) == 2
    assert "initial='auto' chose the first size of" in logged[0]
    assert "may be inexact (see MemoryEstimate.notes): reading a float from a tensor" in logged[0]
    assert "a warnings filter made this warning an error" in logged[0]
    assert "initial='auto' could not estimate" in logged[1]
    assert "no meta kernel here" in logged[1]


def test_auto_without_notes_does_not_warn(caught: list[warnings.WarningMessage]) -> None:
    model = nn.Linear(8, 1)

    @koila.accumulate(initial="auto")
    def step(x: torch.Tensor) -> torch.Tensor:
        return model(x).mean()

    with simulated_device("64MiB"):
        step(torch.randn(8, 8))
    assert caught == []


# --------------------------------------------------------------------------- a split step's own memory


def test_auto_runs_the_whole_batch_where_only_the_whole_batch_fits() -> None:
    # The gradient is 64 MiB. A split step holds it and the next micro-batch's incoming one: 128 MiB.
    torch.manual_seed(0)
    reference = nn.Linear(4096, 4096)
    x, y = torch.randn(64, 4096), torch.randn(64, 4096)
    model = copy.deepcopy(reference)
    events: list[koila.OOMEvent] = []
    with simulated_device("72MiB") as device:

        @koila.accumulate(initial="auto", on_oom=events.append)
        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(model(x), y)

        step(x, y)
        assert device.peak < 72 * MiB
        gradient = model.weight.grad
        model.zero_grad(set_to_none=True)

        @koila.accumulate(initial=32, minimum=32)
        def split(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(model(x), y)

        with pytest.raises(koila.BatchSizeExhausted):
            split(x, y)
    assert events == []
    assert step.stats.batch_size == 64
    assert model.weight.grad is None, "the split that failed left no gradient behind"
    F.mse_loss(reference(x), y).backward()
    torch.testing.assert_close(gradient, reference.weight.grad)


def test_inputs_already_on_the_device_are_not_counted_against_its_free_memory() -> None:
    """2 MiB of inputs made on the device, and a step or a pass that needs little more: both run whole.

    The estimate's peak counts the inputs, and the free memory had them taken already: counted twice,
    the step was split in micro-batches of 16 rows and the pass in chunks of 16.
    """
    torch.manual_seed(0)
    model = nn.Linear(4096, 1).double()
    rows: list[int] = []

    def forward(x: torch.Tensor) -> torch.Tensor:
        rows.append(len(x))
        return model(x)

    with simulated_device("2700KiB"):
        x, y = torch.randn(64, 4096, dtype=torch.float64), torch.randn(64, 1, dtype=torch.float64)
        step = koila.accumulate(lambda x, y: F.mse_loss(forward(x), y), initial="auto", cache=koila.NoCache())
        step(x, y)
        assert rows[-1] == 64, rows
        assert (step.stats.batch_size, step.stats.ooms) == (64, 0)
        rows.clear()
        with torch.no_grad():
            koila.chunked(forward, x, initial="auto", cache=koila.NoCache())
        assert rows[-1] == 64, rows


def test_inputs_sliced_from_a_dataset_on_the_device_count_for_their_own_bytes() -> None:
    """A batch sliced from 16 MiB of rows on the device: the room it counts is the batch's, not the dataset's."""
    torch.manual_seed(0)
    with simulated_device("64GiB") as probe:
        model = nn.Sequential(nn.Linear(64, 2048), nn.ReLU(), nn.Linear(2048, 1))
        data = torch.randn(65536, 64)
        held = probe.live
    events: list[koila.OOMEvent] = []
    with simulated_device(held + 512 * 1024), torch.no_grad():
        model = nn.Sequential(nn.Linear(64, 2048), nn.ReLU(), nn.Linear(2048, 1))
        data = torch.randn(65536, 64)
        out = koila.chunked(model, data[:256], initial="auto", cache=koila.NoCache(), on_oom=events.append)
    assert events == []  # the dataset counted as room: 8 out-of-memory errors, the size sent up after each
    assert out.shape == (256, 1)


def test_a_split_pass_counts_as_room_the_inputs_of_its_chunks_not_of_every_row() -> None:
    """16 MiB of inputs on the device and 2 MiB free: chunks of a size that fits, from the first.

    Credited the whole batch's inputs at every size, a chunk's size was chosen with room that other
    rows' inputs took: out-of-memory errors at 1024 and 512 rows, then back up to 1024 after the probe.
    """
    torch.manual_seed(0)
    with simulated_device("64GiB") as probe:
        model = nn.Sequential(nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 1024)).eval()
        data, out = torch.randn(4096, 1024), torch.empty(4096, 1024)
        held = probe.live
    events: list[koila.OOMEvent] = []
    with simulated_device(held + 2 * MiB), torch.no_grad():
        model = nn.Sequential(nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 1024)).eval()
        data, out = torch.randn(4096, 1024), torch.empty(4096, 1024)  # out=: no result of chunked's own
        koila.chunked(model, data, initial="auto", cache=koila.NoCache(), out=out, on_oom=events.append)
    assert [event.batch_size for event in events] == []
    with torch.no_grad():
        torch.testing.assert_close(out, model(data))


def mlp_and_batch() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024)), *(torch.randn(1024, 1024),) * 2


def test_auto_splits_at_the_largest_size_whose_split_step_fits() -> None:
    # 8 MiB of gradients, and up to 4 MiB more incoming: a micro-batch of 512 rows fits on its own and not
    # after the first; 256 fits after it.
    reference, x, y = mlp_and_batch()
    model = copy.deepcopy(reference)
    events: list[koila.OOMEvent] = []
    with simulated_device("20MiB"):

        @koila.accumulate(initial="auto", on_oom=events.append)
        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(model(x), y)

        step(x, y)
        gradients = [parameter.grad for parameter in model.parameters()]
        model.zero_grad(set_to_none=True)

        @koila.accumulate(initial=512, minimum=512)
        def larger(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(model(x), y)

        with pytest.raises(koila.BatchSizeExhausted):
            larger(x, y)
    assert events == []
    assert step.stats.batch_size == 256
    F.mse_loss(reference(x), y).backward()
    for got, want in zip(gradients, reference.parameters(), strict=True):
        torch.testing.assert_close(got, want.grad, rtol=1e-5, atol=1e-6)


def test_a_split_step_keeps_its_losses_and_not_their_buffers() -> None:
    # The CPU's mse_loss returns its mean in the buffer of the elementwise losses, 512 KiB for 128 rows.
    reference, x, y = mlp_and_batch()
    model = copy.deepcopy(reference)
    with simulated_device("1GiB") as device:

        @koila.accumulate(initial=128)
        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(model(x), y)

        step(x, y)
        eight = device.peak
        model.zero_grad(set_to_none=True)
        device.reset_peak()
        step(x[:256], y[:256])
        two = device.peak
    assert eight - two < 1024  # eight micro-batches' losses, not eight buffers


# --------------------------------------------------------------------------- the memo follows the cache


def whole_step(model: nn.Module, **options: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    def loss(x: torch.Tensor) -> torch.Tensor:
        return model(x).square().mean()

    return koila.accumulate(initial="auto", **options)(loss)


def test_cache_clear_forgets_the_estimates(estimates: list[Callable[..., Any]]) -> None:
    step = whole_step(nn.Linear(8, 1))
    with simulated_device("64MiB"):
        step(torch.randn(8, 8))
        step(torch.randn(8, 8))
        assert len(estimates) == 1
        step.cache_clear()
        step(torch.randn(8, 8))
    assert len(estimates) == 2


def test_no_cache_estimates_every_call(estimates: list[Callable[..., Any]]) -> None:
    step = whole_step(nn.Linear(8, 1), cache=koila.NoCache())
    with simulated_device("64MiB"):
        for _ in range(3):
            step(torch.randn(8, 8))
    assert len(estimates) == 3


def test_a_new_wrapper_estimates_afresh(estimates: list[Callable[..., Any]]) -> None:
    model = nn.Linear(8, 1)

    def loss(x: torch.Tensor) -> torch.Tensor:
        return model(x).square().mean()

    with simulated_device("64MiB"):
        for _ in range(2):
            koila.accumulate(initial="auto")(loss)(torch.randn(8, 8))
    assert len(estimates) == 2


def test_more_free_memory_later_lets_a_larger_size_be_chosen(estimates: list[Callable[..., Any]]) -> None:
    reference, x, y = mlp_and_batch()
    model = copy.deepcopy(reference)
    events: list[koila.OOMEvent] = []

    @koila.accumulate(initial="auto", on_oom=events.append)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)

    sizes = []
    for limit in ("20MiB", "256MiB", "20MiB"):
        model.zero_grad(set_to_none=True)
        with simulated_device(limit):
            step(x, y)
        sizes.append(step.stats.batch_size)
    assert sizes == [256, 1024, 256]
    assert events == []
    assert len(estimates) == 2  # a whole step and a split one: more memory needs no new estimate


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_auto_counts_the_loss_a_split_steps_backward_keeps(reduction: str) -> None:
    """A sum's micro-batch weighs 1: its loss itself is backpropagated, and mse_loss's buffer lives through it.

    The estimate weighed every split step's loss, which let the buffer go: with a sum, two sizes ran out of memory.
    """
    torch.manual_seed(0)
    with simulated_device("6MiB"):
        net = nn.Sequential(nn.Linear(1024, 64), nn.ReLU(), nn.Linear(64, 1024))

        @koila.accumulate(initial="auto", reduction=reduction, cache=koila.NoCache())
        def step(x: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(net(x), x, reduction=reduction)

        step(torch.rand(512, 1024))
    assert step.stats.ooms == 0
    assert step.stats.batch_size < 512


def peak_of(device: Any, call: Callable[..., Any], *args: Any) -> int:
    """The simulated device's peak over ``call(*args)``, run twice: the first run fills initial="auto"'s memo."""
    call(*args)
    gc.collect()
    device.reset_peak()
    call(*args)
    peak: int = device.peak
    return peak


@pytest.mark.parametrize("rows", [64, 256])
def test_an_estimate_of_a_call_that_runs_chunked_auto_is_its_real_peak(rows: int) -> None:
    """The inner initial="auto" estimated its own call inside the first run of the outer estimate, counted there.

    The two runs disagreed (the second found the memo filled), and the estimate came out twice the real peak.
    """
    with simulated_device("1GiB") as device:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 1024), nn.ReLU(), nn.Linear(1024, 10))

        def forward(x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                out: torch.Tensor = model(x)
            return out

        def evaluate(x: torch.Tensor) -> torch.Tensor:
            return koila.chunked(forward, x, initial="auto").sum()

        found = koila.estimate(evaluate, torch.randn(64, 32))
        real = peak_of(device, evaluate, torch.randn(rows, 32))
    assert found.peak(rows) == pytest.approx(real, rel=0.01)


@pytest.mark.parametrize("rows", [64, 256])
def test_an_estimate_of_a_step_that_runs_accumulate_auto_is_its_real_peak(rows: int) -> None:
    with simulated_device("1GiB") as device:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 10))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

        @koila.accumulate(initial="auto")
        def loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(model(x), y)

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            optimizer.zero_grad()
            loss(x, y)
            optimizer.step()

        step(torch.randn(64, 32), torch.randint(0, 10, (64,)))
        found = koila.estimate(step, torch.randn(64, 32), torch.randint(0, 10, (64,)))
        real = peak_of(device, step, torch.randn(rows, 32), torch.randint(0, 10, (rows,)))
    assert found.peak(rows) == pytest.approx(real, rel=0.01)
