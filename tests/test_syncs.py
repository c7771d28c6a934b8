"""A call that nothing fails reads no tensor value: on a GPU, each read is a device sync that stalls the queue."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import koila_retry as koila

# What .item(), int(), float() and bool() of a tensor dispatch to, and the operations that read values to
# decide a shape or an answer.
READS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.is_nonzero.default,
    torch.ops.aten.equal.default,
    torch.ops.aten.nonzero.default,
}


class Reads(TorchDispatchMode):
    """Count the operations that read a tensor's values on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in READS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def reads(call: Any, times: int = 15) -> int:
    with Reads() as counted:
        for _ in range(times):
            call()
    return counted.count


@pytest.fixture
def classifier() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    return model, torch.randn(32, 8), torch.randint(0, 3, (32,))


@pytest.mark.parametrize("initial", [None, 8])
@pytest.mark.parametrize("grad", ["none", "present"])
@pytest.mark.parametrize("form", ["tuple", "dict"])
def test_accumulate_reads_nothing(classifier: Any, initial: int | None, grad: str, form: str) -> None:
    # Integer labels in every split step: the look for ignored ones (-100) read them in each, until it was
    # made in the 1st, 2nd, 4th, 8th... split attempt only. Steps 17 to 31 are none of those.
    model, x, y = classifier
    pair = koila.accumulate(lambda x, y: F.cross_entropy(model(x), y), initial=initial)
    mapping = koila.accumulate(lambda b: F.cross_entropy(model(b["x"]), b["labels"]), initial=initial)

    def train() -> None:
        if grad == "none":
            model.zero_grad(set_to_none=True)
        if form == "tuple":
            pair(x, y)
        else:
            mapping({"x": x, "labels": y})

    for _ in range(16):
        train()
    assert reads(train) == 0


def test_batch_and_chunked_read_nothing(classifier: Any) -> None:
    model, x, _ = classifier

    @koila.batch(initial=16)
    def predict(batch_size: int) -> list[torch.Tensor]:
        return [model(rows) for rows in x.split(batch_size)]

    with torch.no_grad():
        predict()
        assert reads(predict) == 0
        assert reads(lambda: koila.chunked(model, x, initial=8)) == 0


def test_lightning_oom_recovery_reads_no_more_than_lightning() -> None:
    pytest.importorskip("lightning")
    from _lightning_trainer import MLP, loader, trainer

    from koila_retry.integrations.lightning import OOMRecovery

    def fit(*callbacks: Any) -> int:
        with warnings.catch_warnings(), Reads() as counted:
            warnings.filterwarnings("ignore", module="lightning")
            trainer(*callbacks, max_steps=6).fit(MLP(), loader(rows=256))
        return counted.count

    assert fit(OOMRecovery()) == fit()


def test_hugging_face_adapt_reads_no_more_than_the_trainer(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from _hf_trainer import make_trainer

    from koila_retry.integrations.transformers import adapt

    def train(adapted: bool) -> int:
        made = make_trainer(tmp_path / str(adapted), max_steps=4)
        trainer = adapt(made) if adapted else made
        with Reads() as counted:
            trainer.train()
        return counted.count

    assert train(True) == train(False)
