"""Calibration: ``initial="auto"`` and ``suggest_batch_size(calibrate=True)`` measure a real run on the device.

The stand-in for a device whose kernels allocate what the estimate cannot see is a layer
that, run for real, holds a workspace during its call (as cuDNN's and cuBLAS's kernels
do on CUDA), and run on meta tensors does not; and, the other way round, one whose meta
run makes a buffer the real run does not. Under
:func:`~koila_retry.testing.simulated_device`, whose count of live storages is the
device's allocator, the estimate is then about 5 times under the truth, or 3 times over.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import koila_retry as koila
from koila_retry._core import memory
from koila_retry._estimation import auto
from koila_retry._estimation.calibration import (
    DISTRUST,
    Calibration,
    Corrected,
    gap_of,
    own_bytes,
    probe_size,
    starting,
)
from koila_retry.testing import simulated_device

MiB = 2**20
WIDTH = 256


class Opaque(nn.Module):
    """A linear layer whose real run holds ``workspace`` times its output during the call; its meta run, ``phantom``."""

    def __init__(self, workspace: float = 0.0, phantom: float = 0.0) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.workspace, self.phantom = workspace, phantom
        self.real_rows: list[int] = []  # the rows of each real run, the measured ones included

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if not y.is_meta:
            self.real_rows.append(len(x))
        extra = self.phantom if y.is_meta else self.workspace
        if extra:
            scratch = torch.empty(int(extra * y.numel()), dtype=y.dtype, device=y.device)
            y = y + 0  # made while the workspace is held
            del scratch
        return y


def net(workspace: float = 0.0, phantom: float = 0.0, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Linear(64, WIDTH), nn.ReLU(), Opaque(workspace, phantom), nn.ReLU(), nn.Linear(WIDTH, 1)]
    return nn.Sequential(*layers).to(dtype)


def opaque(model: nn.Sequential) -> Opaque:
    return next(module for module in model if isinstance(module, Opaque))


# The settings that make the estimate of each kind of call about 5 times under, or 3 times over.
UNDER = {"infer": {"workspace": 7.0}, "train": {"workspace": 17.0}}
OVER = {"infer": {"phantom": 3.0}, "train": {"phantom": 9.0}}


def inference(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    def infer(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out: torch.Tensor = model(x)
            return out

    return infer


def loss_of(model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)

    return loss


def batch(rows: int = 1024, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(rows, 64, generator=generator, dtype=dtype), torch.randn(
        rows, 1, generator=generator, dtype=dtype
    )


def rise(run: Callable[[], Any]) -> int:
    """Return what a real run allocates at most, over what was allocated as it began."""
    with simulated_device("64GiB") as device:
        run()
        return device.peak


def truth(kind: str, model: nn.Sequential, rows: int) -> int:
    x, y = batch(rows)
    if kind == "infer":
        return rise(lambda: inference(model)(x))
    try:
        return rise(lambda: loss_of(model)(x, y).backward())
    finally:
        model.zero_grad(set_to_none=True)


def largest_power_that_fits(kind: str, model: nn.Sequential, limit: int) -> int:
    """Return the largest power of two that runs under ``limit``: a chunk, or the micro-batch of a split step."""
    size = 1024
    while size > 1 and not (truth(kind, model, size) <= limit if kind == "infer" else splits(model, size, limit)):
        size //= 2  # from the top: a step split into many micro-batches of a few rows takes long
    return size


def splits(model: nn.Sequential, size: int, limit: int) -> bool:
    """Return whether a step over 1024 rows in micro-batches of ``size`` runs under ``limit``.

    A split step holds every gradient, and the next micro-batch's, beside a micro-batch:
    more than a whole step of as many rows.
    """
    x, y = batch()
    step = koila.accumulate(initial=size, minimum=size)(loss_of(model))
    try:
        with simulated_device(limit):
            step(x, y)
    except koila.BatchSizeExhausted:
        return False
    finally:
        model.zero_grad(set_to_none=True)
        opaque(model).real_rows.clear()
    return True


def ratio(kind: str, model: nn.Sequential, rows: int) -> float:
    """Return the truth over the estimate, of the bytes the call makes of its own."""
    x, y = batch(rows)
    found = koila.estimate(inference(model), x) if kind == "infer" else koila.estimate(_backward(model), x, y)
    return truth(kind, model, rows) / own_bytes(found, rows)


def _backward(model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], None]:
    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss_of(model)(x, y).backward()

    return step


# A limit at which the largest power of two that fits is 128 rows (of 1024).
LIMIT_ROWS = 128


def limit_for(kind: str, model: nn.Sequential) -> int:
    return (truth(kind, model, LIMIT_ROWS) + truth(kind, model, 2 * LIMIT_ROWS)) // 2


# --------------------------------------------------------------------------- the stand-in is what it says


@pytest.mark.parametrize("kind", ["infer", "train"])
def test_the_stand_in_estimates_5_times_under_and_3_times_over(kind: str) -> None:
    assert ratio(kind, net(), 256) == pytest.approx(1.0, rel=0.01)
    assert 4.5 <= ratio(kind, net(**UNDER[kind]), 256) <= 5.5
    assert 1 / 3.5 <= ratio(kind, net(**OVER[kind]), 256) <= 1 / 2.5


# --------------------------------------------------------------------------- the targets


def calls_of(kind: str, model: nn.Sequential, limit: int, calls: int = 3) -> tuple[list[list[int]], int]:
    """Run ``calls`` calls of an ``initial="auto"`` front end over 1024 rows.

    Returns the rows of each real run, per call, and the out-of-memory errors in all.
    """
    x, y = batch()
    layer, sizes = opaque(model), []
    if kind == "infer":
        wrapped: Any = koila.chunked(initial="auto")(inference(model))
    else:
        wrapped = koila.accumulate(initial="auto")(loss_of(model))
    with simulated_device(limit):
        for _ in range(calls):
            layer.real_rows.clear()
            if kind == "infer":
                wrapped(x)
            else:
                wrapped(x, y)
                model.zero_grad(set_to_none=True)
            sizes.append(list(layer.real_rows))
    return sizes, wrapped.stats.ooms


@pytest.mark.parametrize("direction", ["under", "over"])
@pytest.mark.parametrize("kind", ["infer", "train"])
def test_calibration_meets_its_targets_on_the_stand_in(kind: str, direction: str) -> None:
    model = net(**(UNDER if direction == "under" else OVER)[kind])
    limit = limit_for(kind, model)
    fits = largest_power_that_fits(kind, model, limit)
    assert fits in (LIMIT_ROWS // 2, LIMIT_ROWS)
    sizes, ooms = calls_of(kind, model, limit)
    assert ooms <= 1, sizes
    for later in sizes[1:]:
        # Every run but a short last one is at least half the largest power of two that fits.
        assert min(later[:-1] or later) >= fits // 2, sizes
        assert sum(later) == 1024


@pytest.mark.parametrize("direction", ["under", "over"])
@pytest.mark.parametrize("kind", ["infer", "train"])
def test_without_calibration_the_same_estimate_misses(kind: str, direction: str) -> None:
    # What calibration is for: on a device that cannot be measured (the CPU, here by
    # turning the meter off), the estimate alone runs out of memory again and again when
    # it is under the truth, and leaves memory unused when it is over.
    model = net(**(UNDER if direction == "under" else OVER)[kind])
    limit = limit_for(kind, model)
    fits = largest_power_that_fits(kind, model, limit)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(koila._estimation.auto, "peak_meter", lambda device: None)
        sizes, ooms = calls_of(kind, model, limit)
    if direction == "under":
        assert ooms >= 2
    else:
        assert ooms == 0
        assert max(max(call) for call in sizes) < fits, "memory left unused, call after call"


# --------------------------------------------------------------------------- what is measured is kept


def test_chunked_keeps_the_measured_chunk() -> None:
    model = net(**UNDER["infer"])
    x, _ = batch()
    limit = limit_for("infer", model)
    layer = opaque(model)
    layer.real_rows.clear()
    infer = koila.chunked(initial="auto")(inference(model))
    with simulated_device(limit):
        out = infer(x)
    assert sum(layer.real_rows) == 1024, "every row ran once: the measured chunk is part of the result"
    assert len(set(layer.real_rows[1:-1])) <= 1
    assert layer.real_rows[0] < layer.real_rows[1], "a small probe first, then the corrected size"
    with torch.no_grad():
        torch.testing.assert_close(out, model(x))


def test_chunked_leaves_room_for_the_result_it_makes_after_the_measured_chunk() -> None:
    """A 2 MiB result on 3 MiB: the size corrected by the probe ran out of memory beside it, twice at one size."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 1024), nn.GELU(), nn.Linear(1024, 64)).double().eval()
    x = torch.randn(4096, 64, dtype=torch.float64)
    ooms: list[int] = []
    with simulated_device("3MiB"), torch.no_grad():
        out = koila.chunked(model, x, initial="auto", cache=koila.NoCache(), on_oom=lambda e: ooms.append(e.batch_size))
    assert ooms == []
    with torch.no_grad():
        torch.testing.assert_close(out, model(x))


@pytest.mark.parametrize("weighed", [False, True], ids=["by rows", "by items"])
def test_accumulate_keeps_the_measured_micro_batch_and_the_gradient_is_exact(weighed: bool) -> None:
    model = net(**UNDER["train"], dtype=torch.float64)
    reference = copy.deepcopy(model)
    x, y = batch(dtype=torch.float64)
    counted = (torch.arange(1024) % 3 != 0).to(torch.float64)  # items: two rows in three count
    limit = limit_for("train", net(**UNDER["train"]))

    def loss(x: torch.Tensor, y: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
        errors = (model(x) - y).square().squeeze(1)
        return (errors * counted).sum() / counted.sum() if weighed else errors.mean()

    options: dict[str, Any] = {"weight": lambda x, y, counted: counted.sum()} if weighed else {}
    cache = koila.GlobalCache()
    step = koila.accumulate(initial="auto", cache=cache, **options)(loss)
    layer = opaque(model)
    with simulated_device(limit * 2):  # float64: twice the bytes
        total = step(x, y, counted)
    assert sum(layer.real_rows) == 1024
    assert len(layer.real_rows) > 2
    # A probe, measured, then pieces as large or larger: the measurement did not take the size below the
    # probe's. The probe no longer takes the gradients eight times over with the rest (see calibration.py):
    # here it is the size the measurement then confirms.
    assert layer.real_rows[0] <= layer.real_rows[1], layer.real_rows
    (estimates,) = auto._memo_of(cache).estimates.values()
    assert estimates.calibration is not None, "the probe was measured"
    errors = (reference(x) - y).square().squeeze(1)
    expected = (errors * counted).sum() / counted.sum() if weighed else errors.mean()
    expected.backward()
    torch.testing.assert_close(total, expected.detach(), rtol=1e-12, atol=1e-12)
    for got, wanted in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, wanted.grad, rtol=1e-10, atol=1e-12)


def test_accumulate_with_a_sum_keeps_every_micro_batch_unweighted() -> None:
    model = net(**UNDER["train"], dtype=torch.float64)
    reference = copy.deepcopy(model)
    x, y = batch(dtype=torch.float64)

    @koila.accumulate(initial="auto", reduction="sum")
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y, reduction="sum")

    with simulated_device(limit_for("train", net(**UNDER["train"])) * 2):
        step(x, y)
    assert len(opaque(model).real_rows) > 2
    F.mse_loss(reference(x), y, reduction="sum").backward()
    for got, wanted in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, wanted.grad, rtol=1e-10, atol=1e-10)


# --------------------------------------------------------------------------- when it measures


class Counting:
    """Counts the runs measured, by wrapping the meter the estimate's front ends get."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered = 0
        real = memory.PeakMeter.__enter__

        def counted(meter: memory.PeakMeter) -> memory.PeakMeter:
            self.entered += 1
            return real(meter)

        monkeypatch.setattr(memory.PeakMeter, "__enter__", counted)


def test_a_call_that_reuses_a_remembered_size_measures_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    measured = Counting(monkeypatch)
    model = net(**UNDER["infer"])
    x, _ = batch()
    infer = koila.chunked(initial="auto")(inference(model))
    with simulated_device(limit_for("infer", model)):
        infer(x)
        assert measured.entered == 2  # the probe, then the first chunk at the size it chose
        for _ in range(3):
            infer(x)
    assert measured.entered == 2


def test_a_calibrated_estimate_is_remembered_for_another_level_of_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    measured = Counting(monkeypatch)
    model = net(**UNDER["train"])
    x, y = batch()
    step = koila.accumulate(initial="auto")(loss_of(model))
    limit = limit_for("train", model)
    for room in (limit, 64 * limit):
        with simulated_device(room):
            step(x, y)
        model.zero_grad(set_to_none=True)
    assert measured.entered == 2  # the first call's probe and the rest of its step
    assert step.stats.ooms <= 1
    assert step.stats.batch_size == 1024  # with 64 times the memory, the corrected estimate fits it all


def test_no_cache_measures_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    measured = Counting(monkeypatch)
    model = net()
    x, _ = batch(64)
    infer = koila.chunked(initial="auto", cache=koila.NoCache())(inference(model))
    with simulated_device("64MiB"):
        for _ in range(3):
            infer(x)
    assert measured.entered == 3  # the whole batch fits at once: one run a call, measured


def test_nothing_is_measured_where_the_device_keeps_no_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    measured = Counting(monkeypatch)
    model = net()
    x, y = batch(64)
    assert memory.peak_meter(torch.device("cpu")) is None
    koila.accumulate(initial="auto")(loss_of(model))(x, y)
    koila.chunked(initial="auto")(inference(model))(x)
    assert measured.entered == 0
    assert opaque(model).real_rows == [64, 64], "the whole batch, at once, as the estimate chose"


def test_a_probe_that_runs_out_of_memory_is_followed_by_a_smaller_one_that_is_measured() -> None:
    # About 40 times under: more than the probe distrusts. The probe runs out of memory; the
    # next run, a smaller probe, is measured, and corrects the rest of the call.
    model = net(workspace=79.0)
    assert ratio("infer", model, 256) > 2 * DISTRUST
    limit = limit_for("infer", model)
    sizes, ooms = calls_of("infer", model, limit)
    assert ooms >= 1
    assert sizes[1] == sizes[2], "the second call settled it"
    assert max(sizes[1]) >= largest_power_that_fits("infer", model, limit) // 2


def test_accumulate_measures_a_whole_step_that_the_estimate_fits_without_splitting_it() -> None:
    model = net()
    x, y = batch(64)
    step = koila.accumulate(initial="auto")(loss_of(model))
    with simulated_device("64MiB"):
        step(x, y)
    assert opaque(model).real_rows == [64]


# --------------------------------------------------------------------------- the engine's part


def test_calibrate_without_a_measurement_to_make_is_refused() -> None:
    attempt = koila.attempts(initial=8)
    assert attempt.meter is None
    with pytest.raises(RuntimeError, match="calibrate\\(\\) follows a run measured"):
        attempt.calibrate(8, 1024)


# --------------------------------------------------------------------------- the arithmetic


def test_one_measurement_takes_the_reading_that_asks_more_and_two_draw_a_line() -> None:
    model = net()
    x, y = batch(64)
    found = koila.estimate(_backward(model), x, y)  # its own bytes hold the gradients, which the rows do not change
    for rows in (1, 64, 1000):
        assert starting(found, rows) + own_bytes(found, rows) == pytest.approx(found.peak(rows))
    own = own_bytes(found, 64)
    assert gap_of(found, 64, int(3 * own)) == pytest.approx(2 * own, abs=1)

    def corrected_own(calibration: Calibration, rows: int) -> float:
        return Corrected(found, calibration).peak(rows) - starting(found, rows)

    under = Calibration(((64, 1000.0),))  # 1000 bytes more than the estimate, on 64 rows
    assert corrected_own(under, 640) == pytest.approx(own_bytes(found, 640) + 10_000, abs=1)  # grows with the rows
    assert corrected_own(under, 8) == pytest.approx(own_bytes(found, 8) + 1000, abs=1)  # and never shrinks
    over = Calibration(((64, -1000.0),))
    assert corrected_own(over, 640) == pytest.approx(own_bytes(found, 640) - 1000, abs=1)  # an over-count stays
    assert corrected_own(over, 8) == pytest.approx(own_bytes(found, 8) - 125, abs=1)
    assert Corrected(found, Calibration(((64, -1e12),))).peak(64) == math.ceil(starting(found, 64))  # never below
    line = over.adding(256, -4000.0)
    assert line.points == ((64, -1000.0), (256, -4000.0))
    assert corrected_own(line, 1024) == pytest.approx(own_bytes(found, 1024) - 16_000, abs=1)  # the line through both
    assert line.adding(256, -2000.0).points == ((64, -1000.0), (256, -2000.0))  # the latest at the same rows
    assert line.adding(1024, 0.0).points == ((256, -4000.0), (1024, 0.0))  # the two largest rows kept
    # Taken 3 times over: the activations and temporaries, not the gradients (the parameters' sizes, exactly).
    parts = found.breakdown(64)
    unseen = parts["activations"] + parts["temporaries"]
    assert 0 < unseen < own
    assert Corrected(found, times=3).peak(64) == math.ceil(starting(found, 64) + own + 2 * unseen)


def test_the_probe_fits_an_estimate_distrusted_eightfold() -> None:
    model = net()
    x, _ = batch(64)
    found = koila.estimate(inference(model), x)
    budget = found.peak(1024)
    probe = probe_size(found, budget, 1024, 0.0)
    assert probe & (probe - 1) == 0
    distrusted = Corrected(found, times=DISTRUST)
    assert distrusted.fits(probe, budget, margin=0.0)
    assert not distrusted.fits(2 * probe, budget, margin=0.0)
    assert probe_size(found, 64 * budget, 1000, 0.0) == 1000  # the first size itself, when it fits so
    assert probe_size(found, 1, 1000, 0.0) == 1


def test_a_probe_is_not_one_row_for_gradients_that_take_an_eighth_of_the_memory() -> None:
    """4 MiB of gradients, a BatchNorm, and 16 MiB: the step is split, and its probe must hold a BatchNorm's rows.

    Taken eight times over with the activations, the gradients left no probe but one row, and BatchNorm
    raised PyTorch's ValueError (more than one value per channel), where a step without the estimate ran.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.BatchNorm1d(1024), nn.Linear(1024, 1))
    x, y = torch.randn(2048, 1024), torch.randn(2048, 1)
    rows: list[int] = []

    @koila.accumulate(initial="auto", cache=koila.NoCache())
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if x.device.type != "meta":
            rows.append(len(x))
        return F.mse_loss(model(x), y)

    with simulated_device("16MiB"), pytest.warns(UserWarning, match="while a BatchNorm layer in training mode"):
        step(x, y)
    assert len(rows) > 1, "split: the whole step does not fit"
    assert rows[0] > 1, rows
    assert sum(rows) >= 2048


def test_an_optimizer_steps_temporaries_are_not_distrusted() -> None:
    """Adam's foreach buffers (the parameters' sizes) taken eight times over: a one-row probe, where BatchNorm raised.

    At small sizes the peak is the optimizer step's.
    """
    torch.manual_seed(0)
    with simulated_device("48MiB"):
        model = nn.Sequential(nn.Linear(1024, 1024), nn.BatchNorm1d(1024), nn.Linear(1024, 1))
        optimizer = torch.optim.Adam(model.parameters())
        x, y = torch.randn(256, 1024), torch.randn(256, 1)

        def train(x: torch.Tensor, y: torch.Tensor) -> None:
            optimizer.zero_grad(set_to_none=True)
            F.mse_loss(model(x), y).backward()
            optimizer.step()

        found = koila.estimate(train, x, y)
        assert found.phase(1) == "optimizer step"
        assert found.breakdown(1)["temporaries"] > 0
        assert Corrected(found, times=DISTRUST).peak(1) < found.peak(1) + found.breakdown(1)["temporaries"]
        assert koila.suggest_batch_size(train, x, y, calibrate=True) > 1


def _wide_adam_step() -> tuple[Callable[[torch.Tensor, torch.Tensor], None], torch.Tensor, torch.Tensor]:
    """A step whose peak is its optimizer step's at small sizes (foreach Adam over 4 MiB of weights)."""
    torch.manual_seed(0)
    first, second = nn.Linear(64, 4096), nn.Linear(4096, 64)
    optimizer = torch.optim.Adam([*first.parameters(), *second.parameters()], foreach=True)

    def train(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        F.mse_loss(second(F.relu(first(x))), y).backward()
        optimizer.step()

    return train, torch.randn(256, 64), torch.randn(256, 64)


def test_the_probe_distrusts_every_phase_not_only_the_peaks() -> None:
    """Where the peak is the optimizer step's, a backward's unseen workspace is what runs out: distrusted too."""
    train, x, y = _wide_adam_step()
    found = koila.estimate(train, x, y)
    size = 32
    moments = found.moments(size)
    assert found.phase(size) == "optimizer step"
    assert {"backward", "optimizer step"} <= set(moments)
    assert moments[found.phase(size)] == found.breakdown(size)
    assert max(sum(parts.values()) for parts in moments.values()) == pytest.approx(found.peak(size), abs=8)
    backward = moments["backward"]
    unseen = backward["activations"] + backward["temporaries"]
    assert Corrected(found, times=DISTRUST).peak(size) >= sum(backward.values()) + (DISTRUST - 1) * unseen - 8


# --------------------------------------------------------------------------- suggest_batch_size(calibrate=True)


def test_suggest_batch_size_calibrated_fits_where_the_estimate_alone_does_not() -> None:
    model = net(**UNDER["infer"])
    x, _ = batch()
    limit = limit_for("infer", model)
    fits = largest_power_that_fits("infer", model, limit)
    layer = opaque(model)
    layer.real_rows.clear()
    with simulated_device(limit), warnings.catch_warnings():
        warnings.simplefilter("error")  # calibrated: no warning about notes
        alone = koila.suggest_batch_size(inference(model), x, margin=0.0)
        assert layer.real_rows == []  # the estimate alone runs nothing
        measured = koila.suggest_batch_size(inference(model), x, calibrate=True)
    assert alone > fits, "the estimate alone would run out of memory"
    assert fits // 2 <= measured <= fits
    assert len(layer.real_rows) == 1, "one real run"


def test_suggest_batch_size_calibrated_says_so_where_nothing_can_be_measured() -> None:
    model = net()
    x, _ = batch(64)
    with pytest.warns(UserWarning, match="keeps none.*the estimate stands"):
        size = koila.suggest_batch_size(inference(model), x, budget="1GiB", calibrate=True)
    assert size == koila.suggest_batch_size(inference(model), x, budget="1GiB")
    assert opaque(model).real_rows == []


def test_suggest_batch_size_refuses_a_calibration_that_is_no_bool() -> None:
    with pytest.raises(TypeError, match="calibrate must be a bool, got str 'yes'"):
        koila.suggest_batch_size(inference(net()), batch(8)[0], calibrate="yes")  # type: ignore[arg-type]


def test_suggest_batch_size_refuses_to_calibrate_another_device_than_the_inputs() -> None:
    with simulated_device("1GiB"), pytest.raises(ValueError, match="lie on cpu.*measures the device"):
        koila.suggest_batch_size(inference(net()), batch(8)[0], device="meta", budget="1GiB", calibrate=True)


def test_a_corrected_size_stays_below_one_that_ran_out_of_memory_in_the_call() -> None:
    """A step whose first rows take a cheap path: each probe measured says more fit than did."""
    torch.manual_seed(0)
    cheap = torch.nn.Linear(8, 2).double()
    costly = torch.nn.Sequential(torch.nn.Linear(8, 256), torch.nn.Tanh(), torch.nn.Linear(256, 2)).double()
    x, y = torch.randn(32, 8, dtype=torch.float64), torch.randint(0, 2, (32,))
    hard = torch.arange(32) >= 8  # sorted data: the first 8 rows are easy
    failed: list[int] = []

    @koila.accumulate(initial="auto", cache=koila.NoCache(), on_oom=lambda event: failed.append(event.batch_size))
    def step(x: torch.Tensor, hard: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        zeros = torch.zeros(len(x), 2, dtype=x.dtype)
        out = torch.where(hard[:, None], costly(x), zeros) if hard.any() else cheap(x)
        return torch.nn.functional.cross_entropy(out, y)

    with simulated_device(60_000), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "initial='auto' chose the first size")  # hard.any(): a branch on a value
        step(x, hard, y)
    assert len(failed) >= 2
    # Once as the estimate's or a halving's, once as a correction: a correction that ran out of memory caps
    # the next (three times each before).
    assert max(failed.count(size) for size in failed) <= 2, failed


def test_an_out_of_memory_error_before_any_correction_does_not_cap_what_the_probe_measured() -> None:
    """A transient failure of the estimate's first size: the probe after it still chooses what it measured."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 64))
    x = torch.randn(16384, 64)

    def chunk_counts(transient: bool) -> list[int]:
        inject = koila.testing.oom_for([1] if transient else [])
        sizes: list[int] = []

        def fn(rows: torch.Tensor) -> torch.Tensor:
            if rows.device.type != "meta":
                sizes.append(len(rows))
                inject()
            return model(rows)

        run = koila.chunked(fn, initial="auto", cache=koila.StackMemoryCache())
        counts = []
        with torch.no_grad(), simulated_device("24MiB"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(3):
                sizes.clear()
                run(x)
                counts.append(len(sizes))
        return counts

    steady = chunk_counts(transient=False)
    assert chunk_counts(transient=True)[1:] == steady[1:]
