"""Find out why a training step runs out of memory, without a GPU.

Four looks at one small classifier on a simulated device the size of a small GPU:

1. ``koila.report``: which tensors are alive after a step, named from the model and
   the optimizer.
2. ``koila.profile(by="module")``: how much each module adds while its forward and its
   backward run, measured on meta tensors (``fake=True``), so it needs no memory.
3. ``koila.profile(by="line")``: which line of the step allocates the most.
4. The ``BatchSizeExhausted`` error of a step that cannot fit at any batch size: its
   message names what holds the memory and what one sample needs.

With koila-retry installed from a clone, as the README says
(``pip install -c constraints.txt '.[progress,plot]'``), run::

    python examples/profile_model.py
"""

from __future__ import annotations

import torch
from torch import nn

import koila_retry as koila
from koila_retry.testing import simulated_device

VOCABULARY, EMBEDDING, HIDDEN, TOKENS, BATCH = 8192, 128, 512, 16, 256
MEMORY = "72MiB"


class Classifier(nn.Module):
    """Mean of token embeddings, one hidden layer, and a large output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCABULARY, EMBEDDING)
        self.hidden = nn.Linear(EMBEDDING, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCABULARY)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pooled = self.embed(tokens).mean(1)
        return self.head(torch.relu(self.hidden(pooled)))


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, targets: torch.Tensor) -> None:
    """Run one step: forward, loss, backward, optimizer step."""
    logits = model(tokens)
    loss = nn.functional.cross_entropy(logits, targets)
    loss.backward()
    optimizer.step()


def main() -> None:
    torch.manual_seed(0)
    tokens = torch.randint(0, VOCABULARY, (BATCH, TOKENS))
    targets = torch.randint(0, VOCABULARY, (BATCH,))

    model = Classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_step(model, optimizer, tokens, targets)
    print("1. What is alive after one step:\n")
    print(koila.report(model, optimizer, top=6))

    print("\n2. What each module adds during a step (on meta tensors, no memory used):\n")
    by_module = koila.profile(train_step, model, optimizer, tokens, targets, by="module", fake=True)
    print(by_module)

    print("\n3. Which line of the step allocates the most:\n")
    by_line = koila.profile(train_step, model, optimizer, tokens, targets, by="line", fake=True)
    print(by_line)

    print(f"\n4. The same step on a {MEMORY} device, keeping the gradients between steps:\n")
    with simulated_device(MEMORY):
        model = Classifier()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

        @koila.accumulate(initial="auto")
        def step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return nn.functional.cross_entropy(model(tokens), targets)

        try:
            for _ in range(2):
                optimizer.zero_grad(set_to_none=False)
                step(tokens, targets)
                optimizer.step()
        except koila.BatchSizeExhausted as error:
            print(str(error).replace(". ", ".\n"))


if __name__ == "__main__":
    main()
