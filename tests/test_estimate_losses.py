"""Losses whose kernel holds the loss of every element before reducing it, which their meta kernel never makes.

``mse_loss`` (the usual loss of regression and diffusion), ``smooth_l1_loss``,
``binary_cross_entropy`` and ``soft_margin_loss`` with a ``mean`` or ``sum`` write a tensor the
size of their inputs and reduce it; the estimate missed it, a third of an MSE step's forward, with
no note, and ``suggest_batch_size`` picked a size that ran out of memory.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.nn import functional as F

import koila_retry as koila
from koila_retry.testing import simulated_device

LOSSES: dict[str, Callable[..., torch.Tensor]] = {
    "mse_loss": F.mse_loss,
    "smooth_l1_loss": F.smooth_l1_loss,
    "binary_cross_entropy": F.binary_cross_entropy,
    "soft_margin_loss": F.soft_margin_loss,
    # Their temporaries are operators the estimate sees: exact before, kept so.
    "huber_loss": F.huber_loss,
    "l1_loss": F.l1_loss,
    "binary_cross_entropy_with_logits": F.binary_cross_entropy_with_logits,
}


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("name", list(LOSSES))
def test_a_losss_estimate_is_its_real_peak(name: str, reduction: str, grad: bool) -> None:
    loss = LOSSES[name]

    def step(x: torch.Tensor, target: torch.Tensor) -> None:
        with torch.set_grad_enabled(grad):
            out = loss(x, target, reduction=reduction)
            if grad:
                out.sum().backward()

    with simulated_device("1GiB") as device:
        x = torch.rand(64, 512, requires_grad=grad)
        target = torch.rand(64, 512)
        device.reset_peak()
        step(x, target)
        truth = device.peak
        x.grad = None
    assert koila.estimate(step, x, target).peak(64) == truth


def test_suggest_batch_size_fits_a_step_whose_loss_is_mse() -> None:
    """The probe's autoencoder: the size suggested ran out of memory at its first step."""
    torch.manual_seed(0)
    with simulated_device("16MiB"):
        model = torch.nn.Sequential(torch.nn.Linear(1024, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1024))

        def step(x: torch.Tensor) -> None:
            F.mse_loss(model(x), x).backward()

        x = torch.rand(64, 1024)
        size = koila.suggest_batch_size(step, x, margin=0.0)
        step(torch.rand(size, 1024))  # fits


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("name", list(LOSSES))
def test_a_losss_estimate_is_its_real_peak_on_cuda(name: str, reduction: str) -> None:
    """The storage the loss keeps follows ATen's code, the same on CUDA: checked where a GPU is lent."""
    device = torch.device("cuda", torch.cuda.current_device())
    loss = LOSSES[name]

    def step(x: torch.Tensor, target: torch.Tensor) -> None:
        out = loss(x, target, reduction=reduction)
        out.sum().backward()

    x = torch.rand(512, 4096, device=device, requires_grad=True)
    target = torch.rand(512, 4096, device=device)
    found = koila.estimate(step, x, target).peak(512)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    step(x, target)
    torch.cuda.synchronize(device)
    truth = torch.cuda.max_memory_allocated(device)
    assert found == pytest.approx(truth, rel=0.01)
