"""Threads sharing one CUDA model run koila.accumulate steps: .grad ends as the sum of their full-batch gradients."""

import threading

import torch

import koila_retry as koila

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()
batches = [(torch.randn(256, 1024, device="cuda"), torch.randn(256, 1024, device="cuda")) for _ in range(2)]


def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


reference = []
for x, y in batches:
    model.zero_grad(set_to_none=True)
    loss_of(x, y).backward()
    reference.append([p.grad.clone() for p in model.parameters()])
expected = [a + b for a, b in zip(*reference, strict=True)]


@koila.accumulate(initial=64)
def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return loss_of(x, y)


worst = 0.0
for trial in range(5):
    model.zero_grad(set_to_none=True)
    barrier = threading.Barrier(2)

    def run(x: torch.Tensor, y: torch.Tensor) -> None:
        barrier.wait()
        step(x, y)

    threads = [threading.Thread(target=run, args=batch) for batch in batches]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    torch.cuda.synchronize()
    for p, e in zip(model.parameters(), expected, strict=True):
        worst = max(worst, ((p.grad - e).abs().max() / e.abs().max()).item())
print(f"accumulate, 2 threads sharing one CUDA model, 5 trials, micro-batches of 64 of 256 rows: worst relative error {worst:.2e}")
assert worst < 1e-4, worst
print("OK")
