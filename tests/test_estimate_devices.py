"""Moves between devices in an estimated step: what they make on the device the estimate is for.

Every tensor of an estimate is on the meta device. A move was run as a copy to the meta device:
``x.to(device)`` where ``x`` already was (the commonest line of a training step) counted a copy of
the whole input, and on a machine without CUDA a step asking for CUDA tensors raised before any
dispatch, though the estimate was for ``device="cuda"``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import koila_retry as koila
from koila_retry.testing import simulated_device

ROWS = 64


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 16), nn.ReLU(), nn.Linear(16, 4))


def _peaks(make: Callable[[], Callable[[torch.Tensor], object]]) -> tuple[int, int]:
    """The real peak of the step ``make`` returns, on a simulated device where its model lives too, and its estimate."""
    with simulated_device("1GiB") as device:
        step = make()
        x = torch.randn(ROWS, 256)
        device.reset_peak()
        step(x)
        truth = device.peak
    return truth, koila.estimate(make(), torch.randn(ROWS, 256)).peak(ROWS)


@pytest.mark.parametrize(
    "move",
    ["to(device)", "to(device=device)", "cpu()", "model.to(device)", "to(dtype)", "type(FloatTensor)", "type(type())"],
)
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_a_move_to_where_a_tensor_is_makes_nothing(move: str, grad: bool) -> None:
    device = torch.device("cpu")

    def plain() -> Callable[[torch.Tensor], object]:
        model = _model()

        def step(x: torch.Tensor) -> None:
            with torch.set_grad_enabled(grad):
                out = model(x).sum()
                if grad:
                    out.backward()

        return step

    def moved() -> Callable[[torch.Tensor], object]:
        model = _model()

        def step(x: torch.Tensor) -> None:
            with torch.set_grad_enabled(grad):
                if move == "to(device)":
                    x = x.to(device)
                elif move == "to(device=device)":
                    x = x.to(device=device, non_blocking=True)
                elif move == "cpu()":
                    x = x.cpu()
                elif move == "to(dtype)":
                    x = x.to(torch.float32)  # the dtype it has
                elif move == "type(FloatTensor)":
                    x = x.type(torch.FloatTensor)  # the legacy type it has
                elif move == "type(type())":
                    x = x.type(x.type())  # the name of the type on the CPU, not the meta device's
                out = (model.to(device) if move == "model.to(device)" else model)(x).sum()
                if grad:
                    out.backward()

        return step

    truth, found = _peaks(plain)
    assert found == truth
    assert _peaks(moved) == (truth, truth)


@pytest.mark.parametrize("move", ["to(float64)", "to(device, copy=True)"])
def test_a_move_that_makes_a_tensor_is_counted(move: str) -> None:
    def plain() -> Callable[[torch.Tensor], object]:
        model = _model()
        return lambda x: model(x).sum().backward()

    def moved() -> Callable[[torch.Tensor], object]:
        model = _model()

        def step(x: torch.Tensor) -> None:
            y = x.to("cpu", torch.float64) if move == "to(float64)" else x.to("cpu", copy=True)
            model(y.to(torch.float32)).sum().backward()

        return step

    truth, found = _peaks(moved)
    assert found == truth
    assert truth > _peaks(plain)[0]


@pytest.mark.parametrize("move", ["cpu", "to"])
def test_a_move_to_another_memory_format_is_counted(move: str) -> None:
    """``.cpu(memory_format=...)`` was taken for a move that stays: the copy it makes was not counted."""

    def step(x: torch.Tensor) -> None:
        y = (
            x.cpu(memory_format=torch.channels_last)
            if move == "cpu"
            else x.to("cpu", memory_format=torch.channels_last)
        )
        del y

    with simulated_device("1GiB") as device:
        x = torch.randn(8, 3, 16, 16)
        device.reset_peak()
        step(x)
        truth = device.peak
    assert koila.estimate(step, x).peak(8) == truth == 2 * x.numel() * 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine without CUDA is the case")
@pytest.mark.parametrize(
    "ask",
    [
        "to('cuda')",
        "cuda()",
        "type(cuda.FloatTensor)",
        "zeros(device='cuda')",
        "to('cpu') for a GPU",
        "a real tensor to('cuda')",
        "pinned",
    ],
)
def test_a_step_that_asks_for_cuda_tensors_is_estimated_for_cuda_without_it(ask: str) -> None:
    with torch.device("meta"):
        model = nn.Linear(64, 4)
    x = torch.empty(16, 64, device="meta")
    table = torch.zeros(1 << 16)  # a real tensor of the caller's, on the host

    def plain(x: torch.Tensor) -> None:
        out = model(x)
        out.sum().backward()

    def asking(x: torch.Tensor) -> None:
        if ask == "to('cuda')":
            x = x.to("cuda")
        elif ask == "cuda()":
            x = x.cuda()
        elif ask == "type(cuda.FloatTensor)":
            assert x.type() == "torch.cuda.FloatTensor"  # as on the GPU the estimate is for
            x = x.type(torch.cuda.FloatTensor)
        elif ask == "pinned":
            x = x.pin_memory().cuda(non_blocking=True)  # the host copy is not on the GPU
        elif ask == "to('cpu') for a GPU":
            x = x.to("cpu")  # a host copy: not on the device the estimate is for
        extra = None
        if ask == "zeros(device='cuda')":
            extra = torch.zeros(1 << 16, device="cuda")
        elif ask == "a real tensor to('cuda')":
            extra = table.to("cuda")  # copied to the GPU in a real run
        out = model(x)
        out.sum().backward()
        del extra

    expected = koila.estimate(plain, x, device="cuda").peak(16)
    found = koila.estimate(asking, x, device="cuda").peak(16)
    if ask in ("zeros(device='cuda')", "a real tensor to('cuda')"):
        assert found == expected + (1 << 18)  # made on the GPU: counted
    else:
        assert found == expected


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_move_to_the_gpu_a_tensor_is_on_makes_nothing_there() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    model = _model().to(device)
    host = torch.zeros(1 << 20)  # a real host tensor: its move makes a GPU tensor, counted

    def step(x: torch.Tensor) -> None:
        x = x.to(device)
        table = host.to(device)
        model.to(device)(x).sum().backward()
        del table

    x = torch.randn(4096, 256, device=device)
    found = koila.estimate(step, x).peak(4096)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    step(x)
    torch.cuda.synchronize(device)
    assert found == pytest.approx(torch.cuda.max_memory_allocated(device), rel=0.01)
