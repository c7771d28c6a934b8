"""A tiny Lightning module and Trainer for the tests: an MLP in float64 on the CPU."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F

# Lightning's own notices, not this library's: a module without a val_dataloader, and its
# use of a pytree name this torch deprecates. A test file's ``pytestmark``.
NOTICES = [
    pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`"),
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated"),
]


@pytest.fixture(autouse=True)
def quiet() -> Iterator[None]:
    """Lightning's warnings off, for a test file that imports this fixture."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="lightning")
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        yield


# A batch of 64 rows through a 16 -> 512 -> 4 MLP in float64: the whole batch's training
# step needs some 800 KB and its validation step some 530 KB; split, both fit in less.
FIT_LIMIT = "600KiB"
EVAL_LIMIT = "400KiB"


class MLP(L.LightningModule):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 512), torch.nn.ReLU(), torch.nn.Linear(512, 4)).double()

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return {"loss": loss, "correct": (self.net(x).argmax(1) == y).sum()}

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_max", logits.max(), reduce_fx="max")
        return F.cross_entropy(logits, y)

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        return {"logits": self.net(batch[0]), "classes": self.net(batch[0]).argmax(1)}

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


def loader(rows: int = 64, batch: int = 64) -> torch.utils.data.DataLoader[Any]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(rows, 16, dtype=torch.float64, generator=generator)
    y = torch.randint(0, 4, (rows,), generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)


def trainer(*callbacks: Any, **options: Any) -> Any:
    settings = {
        "accelerator": "cpu",
        "max_steps": 3,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        **options,
    }
    return L.Trainer(callbacks=list(callbacks), **settings)


def assert_same_parameters(model: Any, reference: Any, **tolerance: float) -> None:
    for parameter, expected in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(parameter, expected, **tolerance)


def stand_in(**attributes: Any) -> Any:
    """A ``Trainer`` not constructed, whose attributes are these (``strategy``: setup reads its type first)."""
    kind = type("Trainer", (L.Trainer,), attributes)
    return object.__new__(kind)
