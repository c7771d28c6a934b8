"""koila.estimate and koila.suggest_batch_size: peak memory from runs on meta tensors; initial="auto"."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc
import sys
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import psutil
import pytest
import torch
from _layers import SelfHooked
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks
from torch.utils._python_dispatch import _get_current_dispatch_mode

import koila_retry as koila
from koila_retry._common.tracking import LiveStorageTracker
from koila_retry._common.units import format_bytes
from koila_retry._estimation import auto
from koila_retry._estimation.workspace import cuda_rounding
from koila_retry._frontends import chunked
from koila_retry.testing import simulated_device

np = pytest.importorskip("numpy")

MiB = 2**20
CLASSES = 10
# Rows of the example batch; the estimate runs at 8 and 16 and is checked elsewhere too.
ROWS = 8
CHECKED = (1, 8, 100, 512)


# --------------------------------------------------------------------------- helpers


def generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class Encoder(nn.Module):
    """Two small ``nn.TransformerEncoderLayer`` (dropout 0.1), mean-pooled into a linear head."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(1))


class Recurrent(nn.Module):
    """A two-layer GRU or LSTM over a sequence; its last hidden state classifies it."""

    def __init__(self, kind: type[nn.RNNBase]) -> None:
        super().__init__()
        self.rnn = kind(16, 32, num_layers=2, batch_first=True)
        self.head = nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


class Attention(nn.Module):
    """Token ids into an embedding, one ``nn.MultiheadAttention`` (dropout 0.1), a residual LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(100, 32)
        self.attention = nn.MultiheadAttention(32, 4, dropout=0.1, batch_first=True)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embedding(tokens)
        attended, _ = self.attention(h, h, h)
        return self.head(self.norm(h + attended).mean(1))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, CLASSES))


# Each model and a batch of n inputs for it.
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int], torch.Tensor]]] = {
    "mlp": (mlp, lambda n: torch.randn(n, 32, generator=generator())),
    "transformer": (Encoder, lambda n: torch.randn(n, 6, 32, generator=generator())),
    "gru": (lambda: Recurrent(nn.GRU), lambda n: torch.randn(n, 7, 16, generator=generator())),
    "lstm": (lambda: Recurrent(nn.LSTM), lambda n: torch.randn(n, 7, 16, generator=generator())),
    "attention": (Attention, lambda n: torch.randint(0, 100, (n, 6), generator=generator())),
}


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name][0]()


def batch(name: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return MODELS[name][1](n), torch.randint(0, CLASSES, (n,), generator=generator(1))


def train_step(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[torch.Tensor, torch.Tensor], None]:
    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def held(model: nn.Module, opt: torch.optim.Optimizer | None = None) -> list[torch.Tensor]:
    """Every tensor a model and its optimizer hold: parameters, buffers, gradients and state."""
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    if opt is not None:
        tensors += [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes of the storages under ``tensors``, each storage once."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def true_peak(fn: Callable[..., object], *args: torch.Tensor, model: nn.Module, opt: Any = None) -> int:
    """The peak of a real run, as the dispatch sees it: the bytes alive before it plus the most it added."""
    before = storage_bytes([*held(model, opt), *args])
    with LiveStorageTracker() as tracker:
        fn(*args)
    return before + tracker.peak


def param_bytes(model: nn.Module, rounding: Callable[[int], int] = lambda n: n) -> int:
    return sum(rounding(p.untyped_storage().nbytes()) for p in model.parameters())


@pytest.fixture
def no_mha_fastpath() -> Iterator[None]:
    """Make eval-mode attention take the composite path on real tensors, as it does on meta ones."""
    enabled = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    yield
    torch.backends.mha.set_fastpath_enabled(enabled)


# --------------------------------------------------------------------------- 1. accuracy against a real run

WITHOUT_ONEDNN = "-without-onednn"


@contextlib.contextmanager
def kernels_of(name: str) -> Iterator[str]:
    """Yield the model of a test case; for ``"lstm-without-onednn"``, with oneDNN off while it runs.

    Without oneDNN, the CPU runs an LSTM as it runs a GRU, one cell at a time. oneDNN's LSTM
    asks for a workspace of which its forward pass writes a third: the peak of the tensors,
    these tests' truth, counts all of it, and is not the memory the step takes;
    tests/test_estimate_accuracy.py checks it against the resident set instead.
    """
    enabled = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = not name.endswith(WITHOUT_ONEDNN)
    try:
        yield name.removesuffix(WITHOUT_ONEDNN)
    finally:
        torch.backends.mkldnn.enabled = enabled


@pytest.mark.parametrize("case", ["mlp", "transformer", "attention", "gru", "lstm" + WITHOUT_ONEDNN])
def test_training_step_peak_equals_a_real_run(case: str) -> None:
    with kernels_of(case) as name:
        training_step_peaks_equal_a_real_run(name)


def training_step_peaks_equal_a_real_run(name: str) -> None:
    model = build(name)
    opt = torch.optim.Adam(model.parameters())
    step = train_step(model, opt)
    step(*batch(name, ROWS))  # warm-up: the optimizer's state exists from here on
    opt.zero_grad(set_to_none=True)
    found = koila.estimate(step, *batch(name, ROWS))
    assert found.sizes == (ROWS, 2 * ROWS)
    for rows in CHECKED:  # 1, 100 and 512 were never run at
        opt.zero_grad(set_to_none=True)
        truth = true_peak(step, *batch(name, rows), model=model, opt=opt)
        assert found.peak(rows) == pytest.approx(truth, rel=0.01), f"batch of {rows}"


def inference_peaks(name: str) -> list[tuple[int, int, int]]:
    """(rows, estimate, truth) of ``model(x)`` under no_grad, the model in eval mode."""
    model = build(name).eval()

    def infer(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(x)

    found = koila.estimate(infer, batch(name, ROWS)[0])
    peaks = []
    for rows in CHECKED:
        x = batch(name, rows)[0]
        peaks.append((rows, found.peak(rows), true_peak(infer, x, model=model)))
    return peaks


@pytest.mark.parametrize("case", ["mlp", "transformer", "attention", "gru", "lstm" + WITHOUT_ONEDNN])
@pytest.mark.usefixtures("no_mha_fastpath")
def test_inference_peak_equals_a_real_run(case: str) -> None:
    with kernels_of(case) as name:
        for rows, found, truth in inference_peaks(name):
            assert found == pytest.approx(truth, rel=0.01), f"batch of {rows}"


# With the fast path on, the real peak includes what the fused kernels allocate inside themselves, which
# no dispatch mode sees: tests/test_kernels.py and tests/test_estimate_accuracy.py check it against the
# resident set of a child process.


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, CLASSES),
    )


@pytest.mark.parametrize("mode", ["train", "infer"])
def test_convolutional_peak_covers_a_real_run(mode: str) -> None:
    """Convolutions may hold workspaces the dispatch never sees: the estimate is at least the tensors' peak."""
    torch.manual_seed(0)
    model = cnn()
    opt = torch.optim.Adam(model.parameters())
    step = train_step(model, opt)

    def images(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 3, 16, 16, generator=generator()), torch.randint(0, CLASSES, (n,), generator=generator())

    def infer(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(x)

    if mode == "train":
        step(*images(ROWS))
        opt.zero_grad(set_to_none=True)
    else:
        model.eval()
    fn = step if mode == "train" else infer
    found = koila.estimate(fn, *images(ROWS))
    for rows in CHECKED:
        opt.zero_grad(set_to_none=True)
        truth = true_peak(fn, *images(rows), model=model, opt=opt)
        assert truth <= found.peak(rows) <= 1.6 * truth, f"batch of {rows}"


@pytest.mark.parametrize(
    "make",
    [
        lambda params: torch.optim.Adam(params),
        lambda params: torch.optim.AdamW(params, weight_decay=0.1),
        lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    ],
    ids=["Adam", "AdamW", "SGD-momentum"],
)
def test_optimizers_and_item_in_the_step(make: Callable[[Any], torch.optim.Optimizer]) -> None:
    model = build("mlp")
    opt = make(model.parameters())
    logged: list[object] = []

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        logged.append(loss.item())
        loss.backward()
        opt.step()

    step(*batch("mlp", ROWS))
    opt.zero_grad(set_to_none=True)
    logged.clear()
    found = koila.estimate(step, *batch("mlp", ROWS))
    # The side effect happens, once per run, with a placeholder where the value would be.
    assert len(logged) == len(found.sizes)
    assert all(type(value) is float for value in logged)
    for rows in (1, 300):
        opt.zero_grad(set_to_none=True)
        truth = true_peak(step, *batch("mlp", rows), model=model, opt=opt)
        assert found.peak(rows) == pytest.approx(truth, rel=0.01), f"batch of {rows}"
    # Adam keeps two tensors per parameter (and a step count), SGD one momentum buffer.
    state = storage_bytes(v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    assert state >= param_bytes(model)
    assert found.breakdown(1)["optimizer state"] == state


@pytest.mark.parametrize("name", ["mlp", "attention"])
def test_gradients_held_before_the_call_are_counted(name: str) -> None:
    """A step that accumulates into the gradients it finds: they are alive throughout."""
    model = build(name)

    def accumulate(x: torch.Tensor, y: torch.Tensor) -> None:
        F.cross_entropy(model(x), y).backward()

    accumulate(*batch(name, ROWS))
    assert all(p.grad is not None for p in model.parameters())
    found = koila.estimate(accumulate, *batch(name, ROWS))
    for rows in CHECKED:
        truth = true_peak(accumulate, *batch(name, rows), model=model)
        assert found.peak(rows) == pytest.approx(truth, rel=0.01), f"batch of {rows}"
    assert found.breakdown(1)["gradients"] == param_bytes(model)
    assert found.resident == 2 * param_bytes(model)


# --------------------------------------------------------------------------- 2. what the call owns is left alone


def regularised() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, scheduler


class Snapshot:
    """A model, its optimizer, inputs and the RNG: every object by identity, every tensor by value."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, inputs: Iterable[torch.Tensor]) -> None:
        self.model, self.opt = model, opt
        self.attributes = [(m, dict(vars(m)), dict(m._parameters), dict(m._buffers)) for m in model.modules()]
        self.training = [m.training for m in model.modules()]
        self.grads = [(p, p.grad) for p in model.parameters()]
        self.opt_attributes = dict(vars(opt))
        self.state = {p: dict(values) for p, values in opt.state.items()}
        self.groups = [(group, dict(group), list(group["params"])) for group in opt.param_groups]
        tensors = [*held(model, opt), *inputs]
        self.values = [(t, t.detach().clone(), t.dtype, t.device) for t in tensors]
        self.rng = torch.get_rng_state()

    def assert_unchanged(self) -> None:
        for module, attributes, parameters, buffers in self.attributes:
            now = vars(module)
            assert now.keys() == attributes.keys(), type(module).__name__
            for key, value in attributes.items():
                assert now[key] is value, f"{type(module).__name__}.{key}"
            assert module._parameters.keys() == parameters.keys()
            assert all(module._parameters[key] is value for key, value in parameters.items())
            assert module._buffers.keys() == buffers.keys()
            assert all(module._buffers[key] is value for key, value in buffers.items())
        assert [m.training for m in self.model.modules()] == self.training
        for parameter, grad in self.grads:
            assert parameter.grad is grad
        assert vars(self.opt).keys() == self.opt_attributes.keys()
        for key, value in self.opt_attributes.items():
            assert vars(self.opt)[key] is value, f"optimizer.{key}"
        assert list(self.opt.state) == list(self.state)
        for parameter, values in self.state.items():
            now = self.opt.state[parameter]
            assert now.keys() == values.keys()
            assert all(now[key] is value for key, value in values.items())
        assert len(self.opt.param_groups) == len(self.groups)
        for (group, saved, params), now in zip(self.groups, self.opt.param_groups, strict=True):
            assert now is group
            assert group.keys() == saved.keys()
            assert group["params"] is saved["params"]
            assert all(a is b for a, b in zip(group["params"], params, strict=True))
            assert {k: v for k, v in group.items() if k != "params"} == {
                k: v for k, v in saved.items() if k != "params"
            }
        for tensor, value, dtype, device in self.values:
            assert tensor.dtype == dtype
            assert tensor.device == device
            assert torch.equal(tensor, value)
        assert torch.equal(torch.get_rng_state(), self.rng)


@pytest.mark.parametrize("fails", [False, True], ids=["returns", "raises"])
def test_estimate_leaves_model_optimizer_inputs_and_rng_as_they_were(fails: bool) -> None:
    model, opt, scheduler = regularised()
    ran: list[int] = []

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        torch.manual_seed(1000 + len(ran))  # a step that seeds itself: the estimate puts the RNG back
        model.train()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        scheduler.step()
        model.extra = torch.zeros(3)  # an attribute the step adds
        ran.append(x.shape[0])
        if fails and x.device.type == "meta":
            raise LookupError("the step failed")

    x, y = torch.randn(ROWS, 8), torch.randint(0, 3, (ROWS,))
    for _ in range(3):  # Adam's state, BatchNorm's running statistics and a decayed learning rate exist
        step(x, y)
    del model.extra
    model.eval()
    before = Snapshot(model, opt, [x, y])
    assert all(p.grad is not None for p in model.parameters())
    if fails:
        with pytest.raises(LookupError, match="the step failed") as info:
            koila.estimate(step, x, y)
        if sys.version_info >= (3, 11):
            assert any("koila.estimate" in note for note in info.value.__notes__)
    else:
        koila.estimate(step, x, y)
    assert len(ran) == 3 + (1 if fails else 2)
    before.assert_unchanged()
    assert not hasattr(model, "extra")


def test_estimate_leaves_the_lr_scheduler_as_it_was() -> None:
    model, opt, scheduler = regularised()
    step = train_step(model, opt)

    def scheduled(x: torch.Tensor, y: torch.Tensor) -> None:
        step(x, y)
        scheduler.step()

    x, y = torch.randn(ROWS, 8), torch.randint(0, 3, (ROWS,))
    scheduled(x, y)
    before = (scheduler.last_epoch, scheduler._step_count, list(scheduler.get_last_lr()))
    koila.estimate(scheduled, x, y)
    assert (scheduler.last_epoch, scheduler._step_count, scheduler.get_last_lr()) == before
    assert scheduler.get_last_lr() == [group["lr"] for group in opt.param_groups]


def test_no_meta_tensor_outlives_the_estimate() -> None:
    model = build("mlp")
    opt = torch.optim.Adam(model.parameters())
    step = train_step(model, opt)
    step(*batch("mlp", ROWS))
    params = list(model.parameters())
    made: list[weakref.ref[torch.Tensor]] = []

    def watched(x: torch.Tensor, y: torch.Tensor) -> None:
        activation = model(x)
        lent = next(model.parameters())  # a fake, lent for the run
        made.extend(weakref.ref(t) for t in (activation, x, lent))
        step(x, y)

    hooks = len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks)
    koila.estimate(watched, *batch("mlp", ROWS))
    gc.collect()
    assert made
    assert all(ref() is None for ref in made)
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
    assert all(t.device.type == "cpu" for t in held(model, opt))
    assert all(p is q for p, q in zip(opt.param_groups[0]["params"], params, strict=True))
    assert all(key is p for key, p in zip(opt.state, params, strict=True))
    # Nothing of the machinery stays installed.
    assert gc.isenabled()
    assert _get_current_dispatch_mode() is None
    assert torch.empty(1).device.type == "cpu"
    assert (len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks)) == hooks


def hooked_and_dropped(estimated: bool) -> tuple[weakref.ref[nn.Module], list[Any]]:
    """Run a step that registers a hook once and keeps its handle; return the model, weakly, and the handles."""
    model = SelfHooked(32, CLASSES)
    handles: list[Any] = []

    def step(x: torch.Tensor) -> None:
        if not handles:  # registered once, lazily, and its handle kept
            handles.append(model.register_forward_hook(lambda *_: None))
        model(x).sum().backward()

    x = torch.randn(ROWS, 32)
    if estimated:
        koila.estimate(step, x)
    else:
        step(x)
    return weakref.ref(model), handles


@pytest.mark.parametrize("estimated", [False, True])
def test_a_model_whose_step_keeps_a_hook_handle_is_freed_after_the_estimate(estimated: bool) -> None:
    freed, handles = hooked_and_dropped(estimated)
    del handles
    gc.collect()
    assert freed() is None


def test_machinery_is_removed_when_the_call_raises() -> None:
    model = build("mlp")

    def broken(x: torch.Tensor) -> None:
        model(x)
        raise ArithmeticError("no")

    with pytest.raises(ArithmeticError):
        koila.estimate(broken, batch("mlp", ROWS)[0])
    assert gc.isenabled()
    assert _get_current_dispatch_mode() is None
    assert torch.empty(1).device.type == "cpu"
    assert all(p.device.type == "cpu" for p in model.parameters())


GLOBAL_MODEL = nn.Linear(32, CLASSES)


class Trainer:
    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(self, x: torch.Tensor) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.model(x).sum().backward()
        self.opt.step()

    def __call__(self, x: torch.Tensor) -> None:
        self.step(x)


def uses_the_global(x: torch.Tensor) -> None:
    GLOBAL_MODEL(x).sum().backward()


def takes_a_default(x: torch.Tensor, model: nn.Module = GLOBAL_MODEL) -> None:
    model(x).sum().backward()


def takes_an_argument(x: torch.Tensor, model: nn.Module) -> None:
    model(x).sum().backward()


@pytest.mark.parametrize(
    "make",
    [
        lambda: uses_the_global,
        lambda: takes_a_default,
        lambda: functools.partial(takes_an_argument, model=GLOBAL_MODEL),
        lambda: Trainer(GLOBAL_MODEL).step,
        lambda: Trainer(GLOBAL_MODEL),
    ],
    ids=["global", "default", "partial", "bound-method", "callable-object"],
)
def test_modules_reached_every_way_are_lent_fakes(make: Callable[[], Callable[[torch.Tensor], None]]) -> None:
    GLOBAL_MODEL.zero_grad(set_to_none=True)
    weight = GLOBAL_MODEL.weight.detach().clone()
    found = koila.estimate(make(), torch.randn(ROWS, 32))
    assert found.peak(4) >= param_bytes(GLOBAL_MODEL) * 2  # parameters and their gradients
    assert GLOBAL_MODEL.weight.grad is None
    assert torch.equal(GLOBAL_MODEL.weight, weight)


# --------------------------------------------------------------------------- 3. a model on the meta device


@pytest.mark.slow
def test_billion_parameter_model_on_the_meta_device_for_cuda() -> None:
    rss = psutil.Process().memory_info().rss
    with torch.device("meta"):
        layer = nn.TransformerEncoderLayer(2048, 16, 8192, batch_first=True)
        model = nn.TransformerEncoder(layer, 20, enable_nested_tensor=False)
    opt = torch.optim.AdamW(model.parameters())
    count = sum(p.numel() for p in model.parameters())
    assert count > 1e9

    def step(x: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        opt.step()

    found = koila.estimate(step, torch.empty(2, 16, 2048, device="meta"), device="cuda")
    grown = psutil.Process().memory_info().rss - rss
    assert grown < 500 * MiB, f"the estimate allocated {grown / MiB:.0f} MiB"
    assert found.device.type == "cuda"
    assert found.resident == 0  # nothing lies on a CUDA device
    assert found.peak(1) >= 16 * count  # parameters, gradients and AdamW's two moments, 4 bytes each
    assert found.phase(1) == "optimizer step"
    parts = found.breakdown(1)
    assert parts["parameters"] == param_bytes(model, cuda_rounding)
    assert parts["gradients"] == parts["parameters"]
    assert parts["optimizer state"] >= 2 * parts["parameters"]
    assert all(p.device.type == "meta" for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())
    assert not opt.state


# --------------------------------------------------------------------------- 4. phases and the breakdown


def big_mlp() -> tuple[nn.Module, torch.optim.Optimizer, Callable[[torch.Tensor, torch.Tensor], None]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, CLASSES))
    opt = torch.optim.Adam(model.parameters())
    step = train_step(model, opt)
    step(torch.randn(4, 16), torch.randint(0, CLASSES, (4,)))
    opt.zero_grad(set_to_none=True)
    return model, opt, step


def test_phase_and_breakdown_of_an_adam_step() -> None:
    model, opt, step = big_mlp()
    found = koila.estimate(step, torch.randn(ROWS, 16), torch.randint(0, CLASSES, (ROWS,)))
    weights = param_bytes(model)
    steps = storage_bytes(s["step"] for s in opt.state.values())
    assert 0 < steps < 100
    # Small batches: the optimizer step holds parameters, gradients, two moments and its temporaries.
    for rows in (1, ROWS, 64):
        assert found.phase(rows) == "optimizer step", rows
        parts = found.breakdown(rows)
        assert parts["parameters"] == weights
        assert parts["gradients"] == weights
        assert parts["optimizer state"] == 2 * weights + steps
        assert parts["inputs"] == rows * (16 * 4 + 8)
        assert abs(sum(parts.values()) - found.peak(rows)) <= len(parts)
    # Huge batches: the activations dwarf the rest.
    for rows in (2**16, 2**20):
        assert found.phase(rows) in ("forward", "backward"), rows
        parts = found.breakdown(rows)
        assert parts["activations"] + parts["temporaries"] > found.peak(rows) / 2
        assert abs(sum(parts.values()) - found.peak(rows)) <= len(parts)
    description = found.describe(1)
    assert "optimizer step" in description
    assert format_bytes(found.peak(1)) in description


def test_fixed_and_per_sample_describe_large_batches() -> None:
    _, _, step = big_mlp()
    found = koila.estimate(step, torch.randn(ROWS, 16), torch.randint(0, CLASSES, (ROWS,)))
    assert found.per_sample > 0
    assert found.fixed > 0
    for rows in (2**16, 2**20):
        assert -1 <= found.fixed + found.per_sample * rows - found.peak(rows) <= rows + 1
    assert found.measured == {ROWS: found.peak(ROWS), 2 * ROWS: found.peak(2 * ROWS)}
    assert found.seconds > 0
    assert "per_sample" in repr(found)


def test_fits_and_largest_fitting_agree_with_peak() -> None:
    _, _, step = big_mlp()
    found = koila.estimate(step, torch.randn(ROWS, 16), torch.randint(0, CLASSES, (ROWS,)))
    peak = found.peak(4096)
    assert found.fits(4096, peak, margin=0)
    assert not found.fits(4096, peak - 1, margin=0)
    assert not found.fits(4096, peak, margin=0.1)
    assert found.fits(4096, int(peak * 1.11) + 1, margin=0.1)
    assert found.largest_fitting(peak, margin=0) == 4096
    assert found.largest_fitting(peak - 1, margin=0) == 2048
    assert found.largest_fitting(peak, margin=0, maximum=1000) == 512
    assert found.largest_fitting(found.peak(1) - 1, margin=0) is None
    assert found.largest_fitting(f"{peak}B", margin=0) == 4096


def test_sizes_given_are_the_sizes_run_at() -> None:
    model = build("mlp")

    def forward(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(x)

    found = koila.estimate(forward, batch("mlp", ROWS)[0], sizes=[50, 3, 50, 700])
    assert found.sizes == (3, 50, 700)
    assert set(found.measured) == {3, 50, 700}
    for rows, measured in found.measured.items():
        assert measured == true_peak(forward, batch("mlp", rows)[0], model=model)
        assert found.peak(rows) == measured


@pytest.mark.parametrize(
    ("bad", "error"), [(0, ValueError), (-3, ValueError), (2.0, TypeError), (True, TypeError), ("8", TypeError)]
)
def test_batch_size_out_of_range_is_named(bad: object, error: type[Exception]) -> None:
    found = koila.estimate(lambda x: x * 2, torch.ones(4, 2))
    with pytest.raises(error, match="batch_size must be an int >= 1") as info:
        found.peak(bad)  # type: ignore[arg-type]
    assert repr(bad) in str(info.value)


# --------------------------------------------------------------------------- 5. module peaks


def test_module_peaks_name_every_module_forward_and_backward() -> None:
    model, _, step = big_mlp()
    found = koila.estimate(step, torch.randn(ROWS, 16), torch.randint(0, CLASSES, (ROWS,)))
    for rows in (1, 1000):
        peaks = found.module_peaks(rows)
        assert set(peaks) == {"Sequential", *(f"Sequential.{i}" for i in range(len(model)))}
        for name in ("Sequential.0", "Sequential.2", "Sequential.4"):  # the linear layers
            forward, backward = peaks[name]
            assert forward > param_bytes(model), name
            assert backward > param_bytes(model), name
        outer_forward = peaks["Sequential"][0]
        assert all(outer_forward >= forward for forward, _ in peaks.values())
        assert max(max(pair) for pair in peaks.values()) <= found.peak(rows)
    # The first layer's backward holds every activation's gradient path: more at a larger batch.
    assert found.module_peaks(1000)["Sequential.0"][1] > found.module_peaks(1)["Sequential.0"][1]


# --------------------------------------------------------------------------- 6. CUDA rounding


@pytest.mark.parametrize(
    ("nbytes", "rounded"),
    [
        (0, 0),
        (1, 512),
        (512, 512),
        (513, 1024),
        (MiB - 1, MiB),
        (MiB, MiB),
        (MiB + 1, 2 * MiB),
        (2 * MiB, 2 * MiB),
        (3 * MiB, 4 * MiB),
        (4 * MiB + 1, 6 * MiB),
    ],
)
def test_cuda_rounding(nbytes: int, rounded: int) -> None:
    assert cuda_rounding(nbytes) == rounded


def tiny_layers() -> tuple[nn.Module, Callable[[torch.Tensor, torch.Tensor], None], tuple[torch.Tensor, ...]]:
    """40 layers of 2 by 2, SGD with momentum: 160 tensors of 16 and 8 bytes, each a 512-byte CUDA block."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(2, 2) for _ in range(40)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = train_step(model, opt)
    x, y = torch.randn(ROWS, 2), torch.randint(0, 2, (ROWS,))
    step(x, y)
    opt.zero_grad(set_to_none=True)
    return model, step, (x, y)


def adam_transformer() -> tuple[nn.Module, Callable[[torch.Tensor, torch.Tensor], None], tuple[torch.Tensor, ...]]:
    model = build("transformer")
    for module in model.modules():  # CUDA's dropout keeps a one-byte mask, the CPU's its noise: none on either
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    opt = torch.optim.Adam(model.parameters())
    step = train_step(model, opt)
    step(*batch("transformer", ROWS))
    opt.zero_grad(set_to_none=True)
    return model, step, batch("transformer", ROWS)


def test_cuda_estimate_rounds_every_allocation() -> None:
    _, step, inputs = tiny_layers()
    cpu = koila.estimate(step, *inputs)
    cuda = koila.estimate(step, *inputs, device="cuda")
    assert cuda.device.type == "cuda"
    assert cpu.breakdown(1)["parameters"] == 40 * (16 + 8)
    assert cuda.breakdown(1)["parameters"] == 80 * 512
    assert cuda.breakdown(1)["optimizer state"] == 80 * 512
    for rows in cuda.sizes:
        assert cuda.measured[rows] >= 10 * cpu.measured[rows], rows
    assert cuda.peak(1) > 10 * cpu.peak(1)
    assert cpu.resident == 2 * 40 * (16 + 8)  # parameters and momentum; the gradients were set to None
    assert cuda.resident == 0


def test_cuda_estimate_of_a_transformer_rounds_its_parameters() -> None:
    model, step, inputs = adam_transformer()
    with sdpa_kernel([SDPBackend.MATH]):  # the same attention kernel on both: only the rounding differs
        cpu = koila.estimate(step, *inputs)
        cuda = koila.estimate(step, *inputs, device="cuda")
    assert cuda.breakdown(1)["parameters"] == param_bytes(model, cuda_rounding) > param_bytes(model)
    for rows in cuda.sizes:
        assert cuda.measured[rows] >= cpu.measured[rows], rows


@pytest.mark.parametrize("make", [tiny_layers, adam_transformer], ids=["tiny-layers", "transformer"])
def test_cuda_estimate_is_never_below_the_cpu_one(make: Callable[[], Any]) -> None:
    _, step, inputs = make()
    with sdpa_kernel([SDPBackend.MATH]):  # CUDA's memory-efficient attention would hold less than the CPU's math
        cpu = koila.estimate(step, *inputs)
        cuda = koila.estimate(step, *inputs, device="cuda")
    assert cuda.per_sample >= cpu.per_sample
    for rows in (*CHECKED, 10**6):
        assert cuda.peak(rows) >= cpu.peak(rows), rows


# --------------------------------------------------------------------------- 7. suggest_batch_size


def wide() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, CLASSES))


def deep() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, CLASSES))


SUGGESTED: dict[str, tuple[Callable[[], nn.Module], Callable[[Any], torch.optim.Optimizer], Callable[[int], Any], str]]
SUGGESTED = {
    "wide-adam": (wide, torch.optim.Adam, lambda n: torch.randn(n, 64), "8MiB"),
    "deep-sgd": (deep, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), lambda n: torch.randn(n, 32), "3MiB"),
    "transformer-adamw": (Encoder, torch.optim.AdamW, lambda n: torch.randn(n, 6, 32), "16MiB"),
}


@pytest.mark.parametrize("name", sorted(SUGGESTED))
def test_suggested_size_runs_and_twice_it_runs_out_of_memory(name: str) -> None:
    make_model, make_opt, make_inputs, limit = SUGGESTED[name]
    with simulated_device(limit):
        torch.manual_seed(0)
        model = make_model()
        opt = make_opt(model.parameters())

        def step(x: torch.Tensor) -> None:
            opt.zero_grad(set_to_none=True)
            model(x).pow(2).mean().backward()
            opt.step()

        step(make_inputs(2))
        opt.zero_grad(set_to_none=True)
        size = koila.suggest_batch_size(step, make_inputs(ROWS), margin=0)
        assert size >= 64
        assert size & (size - 1) == 0, "a power of two"
        step(make_inputs(size))
        opt.zero_grad(set_to_none=True)
        gc.collect()
        with pytest.raises(torch.OutOfMemoryError):
            step(make_inputs(2 * size))
        opt.zero_grad(set_to_none=True)


def test_budget_as_string_or_int_and_maximum() -> None:
    _, _, step = big_mlp()
    x, y = torch.randn(ROWS, 16), torch.randint(0, CLASSES, (ROWS,))
    found = koila.estimate(step, x, y)
    size = koila.suggest_batch_size(step, x, y, budget="64MiB")
    assert size == koila.suggest_batch_size(step, x, y, budget=64 * MiB)
    assert found.peak(size) * 1.1 <= 64 * MiB < found.peak(2 * size) * 1.1
    assert koila.suggest_batch_size(step, x, y, budget="64MiB", margin=0) >= size
    assert koila.suggest_batch_size(step, x, y, budget="64MiB", maximum=5) == 4
    assert koila.suggest_batch_size(step, x, y, budget="64MiB", maximum=1) == 1
    assert koila.suggest_batch_size(step, x, y, budget="1TiB") == found.largest_fitting("1TiB") > 2**20


def test_default_budget_is_free_memory_plus_what_the_call_holds() -> None:
    with simulated_device("8MiB") as device:
        torch.manual_seed(0)
        model = wide()
        x = torch.randn(ROWS, 64)

        def forward(x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return model(x)

        found = koila.estimate(forward, x)
        assert found.resident == param_bytes(model)
        expected = found.largest_fitting(device.free + found.resident)
        assert koila.suggest_batch_size(forward, x) == expected


def test_batch_size_exhausted_when_even_one_does_not_fit() -> None:
    _, _, step = big_mlp()
    x, y = torch.randn(ROWS, 16), torch.randint(0, CLASSES, (ROWS,))
    with pytest.raises(koila.BatchSizeExhausted, match="estimated peak") as info:
        koila.suggest_batch_size(step, x, y, budget="1MiB")
    assert info.value.attempts == 0
    assert info.value.batch_size == 1
    assert "optimizer step" in str(info.value)
    assert "1.00 MiB" in str(info.value)


@pytest.mark.parametrize(
    ("options", "error", "shown"),
    [
        ({"margin": -0.1}, ValueError, "-0.1"),
        ({"margin": 10}, ValueError, "10"),
        ({"margin": "0.1"}, TypeError, "'0.1'"),
        ({"margin": True}, TypeError, "True"),
        ({"maximum": 0}, ValueError, "maximum must be an int >= 1, got 0"),
        ({"maximum": 2.5}, TypeError, "maximum must be an int >= 1, got float 2.5"),
        ({"calibrate": np.True_}, TypeError, "calibrate must be a bool, got numpy.bool"),
        ({"budget": "lots"}, ValueError, "'lots'"),
        ({"budget": -5}, ValueError, "-5"),
        ({"budget": 3.5}, TypeError, "3.5"),
        ({"budget": [1]}, TypeError, "[1]"),
    ],
)
def test_bad_suggest_options_are_named(options: dict[str, Any], error: type[Exception], shown: str) -> None:
    with pytest.raises(error) as info:
        koila.suggest_batch_size(lambda x: x * 2, torch.ones(4, 2), **options)
    assert shown in str(info.value)


def test_numpys_numbers_are_taken_where_python_s_are() -> None:
    # maximum=np.int64(64) was a ValueError, margin=np.float32(0.2) a TypeError: as the options take them.
    fn, x = (lambda x: x * 2), torch.ones(4, 2)
    plain = koila.suggest_batch_size(fn, x, maximum=64, margin=0.25)
    assert koila.suggest_batch_size(fn, x, maximum=np.int64(64), margin=np.float32(0.25)) == plain
    assert koila.estimate(fn, x, sizes=np.array([2, 4])).sizes == koila.estimate(fn, x, sizes=[2, 4]).sizes


# --------------------------------------------------------------------------- 8. initial="auto"


def remembered(cache: koila.SizeCache) -> list[tuple[int, int]]:
    """What initial="auto" found for calls on ``cache``, per free-memory level: the power of two and the most rows."""
    return [(fit.split(None, "")[0], fit.whole) for fit in auto._memo_of(cache).fits.values()]


def regression(rows: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1)).double()
    x = torch.randn(rows, 64, generator=generator(), dtype=torch.float64)
    y = torch.randn(rows, 1, generator=generator(1), dtype=torch.float64)
    return model, x, y


def full_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    model = copy.deepcopy(model)
    F.mse_loss(model(x), y).backward()
    return [p.grad for p in model.parameters()]


def whole_step_limit(model: nn.Module, x: torch.Tensor, y: torch.Tensor, share: float) -> int:
    """A limit with room for what exists before the step plus ``share`` of what the whole step adds."""
    with simulated_device("1GiB") as device:
        model, x, y = copy.deepcopy(model), x.clone(), y.clone()
        before = device.live
        F.mse_loss(model(x), y).backward()
        return before + int((device.peak - before) * share)


def test_accumulate_auto_starts_at_a_size_that_fits(estimates: list[Callable[..., Any]]) -> None:
    reference, x, y = regression(4096)
    expected = full_gradients(reference, x, y)
    limit = whole_step_limit(reference, x, y, 0.35)
    events: list[koila.OOMEvent] = []
    with simulated_device(limit):
        model, x, y = copy.deepcopy(reference), x.clone(), y.clone()

        @koila.accumulate(initial="auto", on_oom=events.append)
        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(model(x), y)

        step(x, y)
        sizes = [step.stats.batch_size]
        gradients = [p.grad.clone() for p in model.parameters()]
        for clear in (False, True):  # the size stored, then estimated again: cache_clear() forgets the estimates
            model.zero_grad(set_to_none=True)
            if clear:
                step.cache_clear()
            step(x, y)
            sizes.append(step.stats.batch_size)
    assert len(events) <= 1
    assert sizes[0] < 4096
    assert sizes[1] == sizes[2] == sizes[0]
    assert len(estimates) == 4  # a step over the whole batch and a split one, before and after cache_clear()
    for got, want in zip(gradients, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-10)


def test_accumulate_auto_runs_a_batch_that_fits_whole(estimates: list[Callable[..., Any]]) -> None:
    reference, x, y = regression(256)
    expected = full_gradients(reference, x, y)
    with simulated_device("64MiB"):
        model, x, y = copy.deepcopy(reference), x.clone(), y.clone()

        @koila.accumulate(initial="auto")
        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(model(x), y)

        for _ in range(2):  # nothing is stored for a whole batch: the second call asks for the suggestion again
            model.zero_grad(set_to_none=True)
            step(x, y)
            assert step.stats.batch_size == 256
    assert step.stats.ooms == 0
    assert len(estimates) == 1
    for p, want in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=1e-10)


def test_accumulate_auto_estimates_once_per_sample_shape(estimates: list[Callable[..., Any]]) -> None:
    model = nn.Linear(4, 1)

    @koila.accumulate(initial="auto")
    def step(x: torch.Tensor) -> torch.Tensor:
        return model(x).mean()

    with simulated_device("64MiB"):
        for rows, features in ((8, 4), (16, 4), (8, 4)):
            step(torch.randn(rows, features))
        step(torch.randn(8, 2, 4))
    assert len(estimates) == 2


def test_chunked_auto_starts_at_a_size_that_fits(estimates: list[Callable[..., Any]]) -> None:
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1)).double()
    x = torch.randn(8192, 64, generator=generator(), dtype=torch.float64)
    with torch.no_grad():
        expected = reference(x)
    with simulated_device("1GiB") as device:
        model, inputs = copy.deepcopy(reference), x.clone()
        before = device.live
        with torch.no_grad():
            model(inputs)
        limit = before + (device.peak - before) // 3
    events: list[koila.OOMEvent] = []
    with simulated_device(limit), torch.no_grad():
        model, inputs = copy.deepcopy(reference), x.clone()

        seen: list[int] = []

        def encode(rows: torch.Tensor) -> torch.Tensor:
            if rows.device.type != "meta":
                seen.append(rows.shape[0])
            return model(rows)

        out = koila.chunked(encode, inputs, initial="auto", on_oom=events.append)
    assert len(events) <= 1
    assert len(estimates) == 1
    ((power, whole),) = remembered(chunked.calls_cache)
    assert power <= whole < 8192
    # The first chunk is a probe, measured on the (simulated) device; the next are the size suggested.
    assert seen[0] < power
    assert set(seen[1:-1]) == {power}, "after the probe, the suggested size"
    assert sum(seen) == 8192
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-10)


def test_chunked_auto_runs_rows_that_fit_whole(estimates: list[Callable[..., Any]]) -> None:
    model = nn.Linear(8, 3)
    seen: list[int] = []

    @koila.chunked(initial="auto")
    def encode(rows: torch.Tensor) -> torch.Tensor:
        if rows.device.type != "meta":  # the estimate calls it too
            seen.append(rows.shape[0])
        return model(rows)

    x = torch.randn(300, 8)
    with simulated_device("64MiB"), torch.no_grad():
        first, second = encode(x), encode(x)
    assert seen == [300, 300]
    assert encode.stats.ooms == 0
    assert encode.stats.batch_size == 300
    assert len(estimates) == 1
    torch.testing.assert_close(first, second)


def test_chunked_auto_runs_whole_rows_that_fit_between_two_powers_of_two(estimates: list[Callable[..., Any]]) -> None:
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 8))
    x = torch.randn(300, 64, generator=generator())

    def forward(rows: torch.Tensor) -> torch.Tensor:
        return reference(rows)

    with torch.no_grad():
        found = koila.estimate(forward, x)
    # Room for 300 rows with the 10% margin, and not for 512, beside the result (300 rows of 8 floats),
    # which chunked makes after the first chunk and holds while the rest runs.
    budget = int(found.peak(300) * 1.1) + 64
    assert not found.fits(512, budget)
    seen: list[int] = []
    with simulated_device(storage_bytes([x]) + budget + 300 * 8 * 4) as device, torch.no_grad():
        model, inputs = copy.deepcopy(reference), x.clone()
        assert device.live == storage_bytes([*model.parameters(), inputs])

        def encode(rows: torch.Tensor) -> torch.Tensor:
            if rows.device.type != "meta":
                seen.append(rows.shape[0])
            return model(rows)

        out = koila.chunked(encode, inputs, initial="auto")
    # A probe, measured on the (simulated) device, then every row left: the estimate held.
    assert len(seen) == 2
    assert seen[0] < seen[1]
    assert sum(seen) == 300
    ((power, whole),) = remembered(chunked.calls_cache)
    assert power == 256

    # The inputs, on the device already, are part of the estimate's peak: at each size, they count as room too.
    def fits(size: int) -> bool:
        return (found.peak(size) - min(storage_bytes([x]), found.breakdown(size)["inputs"])) * 1.1 <= budget

    assert whole == max(size for size in range(256, 512) if fits(size))
    assert whole >= 300
    assert len(estimates) == 1
    with torch.no_grad():
        torch.testing.assert_close(out, reference(x))


def test_range_has_no_auto() -> None:
    # A TypeError, as koila.batch's and koila.attempts' for the same mistake (it was a ValueError; probe 72C).
    with pytest.raises(TypeError, match="koila.range has no inputs to estimate memory from"):
        koila.range(lambda begin, end: None, 0, 4, initial="auto")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "call",
    [
        lambda: koila.accumulate(initial="big"),
        lambda: koila.chunked(lambda x: x, torch.ones(3), initial="big"),
        lambda: koila.chunked(initial="big"),
    ],
    ids=["accumulate", "chunked", "chunked-decorator"],
)
def test_initial_other_string_is_named(call: Callable[[], object]) -> None:
    with pytest.raises(ValueError, match="'big'"):
        call()
    with pytest.raises(TypeError, match="'big'"):  # range takes no string at all, as batch and attempts
        koila.range(lambda begin, end: None, 0, 4, initial="big")  # type: ignore[arg-type]


def data_dependent(x: torch.Tensor) -> torch.Tensor:
    kept = torch.nonzero(x[:, 0] > -1e9).shape[0]  # every row, but only the values can tell
    return x[:kept] * 2


def refuses_meta(x: torch.Tensor) -> torch.Tensor:
    if x.device.type == "meta":
        raise RuntimeError("this call needs values")
    return x * 2


def run_unestimable(front_end: str, body: Callable[[torch.Tensor], torch.Tensor]) -> tuple[Any, list[Any]]:
    """Call a front end with initial="auto" twice on 16 rows; return it and the warnings it gave."""
    model = nn.Linear(3, 1)
    if front_end == "accumulate":

        def loss(x: torch.Tensor) -> torch.Tensor:
            return model(body(x)).mean()

        wrapped = koila.accumulate(initial="auto")(loss)
    else:
        wrapped = koila.chunked(initial="auto")(body)
    x = torch.randn(16, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            wrapped(x)
    return wrapped, [w for w in caught if "could not estimate" in str(w.message)]


@pytest.mark.parametrize("body", [data_dependent, refuses_meta], ids=["nonzero", "refuses-meta"])
@pytest.mark.parametrize("front_end", ["accumulate", "chunked"])
def test_call_that_cannot_be_estimated_warns_once_and_runs_whole(
    front_end: str, body: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    wrapped, caught = run_unestimable(front_end, body)
    assert len(caught) == 1
    assert caught[0].category is UserWarning
    assert wrapped.__name__ in str(caught[0].message)
    assert wrapped.stats.batch_size == 16
    assert wrapped.stats.ooms == 0


@pytest.mark.parametrize("front_end", ["accumulate", "chunked"])
def test_warning_for_a_call_that_cannot_be_estimated_points_at_the_caller(front_end: str) -> None:
    _, caught = run_unestimable(front_end, refuses_meta)
    assert len(caught) == 1
    assert caught[0].filename == __file__


# --------------------------------------------------------------------------- 9. errors


def takes_two(a: torch.Tensor, b: torch.Tensor | None = None) -> None:
    pass


@pytest.mark.parametrize(
    ("call", "error", "shown"),
    [
        (lambda: koila.estimate(takes_two, 3), ValueError, "none of the arguments is a tensor"),
        (lambda: koila.estimate(takes_two, torch.ones(3, 2), b=torch.ones(4, 2)), ValueError, "tensor b has 4"),
        (lambda: koila.estimate(takes_two, torch.ones(3, 2), torch.ones(4, 2)), ValueError, "tensor a has 3"),
        (lambda: koila.estimate(takes_two, torch.ones(3, 2), dim=2), ValueError, "dim 2 is out of range"),
        (lambda: koila.estimate(takes_two, torch.ones(3, 2), dim=-3), ValueError, "allowed: [-2, 1]"),
        (lambda: koila.estimate(takes_two, torch.tensor(1.0)), ValueError, "every tensor is 0-dimensional"),
        (lambda: koila.estimate(takes_two, torch.ones(0, 2)), ValueError, "0 rows"),
        (lambda: koila.estimate(takes_two, torch.ones(3, 2), sizes=[4]), ValueError, "at least two"),
        (lambda: koila.estimate(takes_two, torch.ones(3, 2), sizes=[4, 4]), ValueError, "at least two"),
        (lambda: koila.estimate(takes_two, torch.ones(3, 2), sizes=[0, 4]), ValueError, "got 0"),
        (lambda: koila.estimate(takes_two, torch.ones(3, 2), sizes=5), TypeError, "got 5"),
        (lambda: koila.estimate(takes_two, torch.ones(3, 2), dim=True), TypeError, "True"),
        (lambda: koila.estimate(3, torch.ones(3, 2)), TypeError, "callable, got int 3"),  # type: ignore[arg-type]
    ],
)
def test_bad_arguments_are_named(call: Callable[[], object], error: type[Exception], shown: str) -> None:
    with pytest.raises(error) as info:
        call()
    assert shown in str(info.value)


def test_rows_are_compared_inside_containers() -> None:
    with pytest.raises(ValueError, match="every tensor that is split must have the same size") as info:
        koila.estimate(takes_two, [torch.ones(3, 2), {"k": torch.ones(5, 2)}])
    assert "the tensor a[0] has 3, the tensor a[1]['k'] has 5" in str(info.value)


def test_real_tensor_requiring_grad_reached_outside_a_module_is_refused() -> None:
    weight = torch.randn(3, 3, requires_grad=True)
    value = weight.detach().clone()
    holder = [weight]

    def step(x: torch.Tensor) -> None:
        (x @ holder[0]).sum().backward()

    with pytest.raises(RuntimeError, match="requires grad") as info:
        koila.estimate(step, torch.randn(4, 3))
    assert "(3, 3)" in str(info.value)
    assert weight.grad is None
    assert torch.equal(weight, value)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4, 8), (4, 3, 8)], ids=["rows", "sequences"])
def test_inputs_of_another_dtype_than_the_model_are_refused_as_the_device_refuses_them(
    dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    # PyTorch's meta kernels of mm and addmm take two dtypes: the estimate answered, and
    # suggest_batch_size named a size, for a call that fails at every size.
    model = nn.Linear(8, 4)
    x = torch.ones(shape, dtype=dtype)

    def step(x: torch.Tensor) -> torch.Tensor:
        return model(x).sum()

    with pytest.raises(RuntimeError, match="must have the same dtype"):
        step(x)  # the device's own refusal
    refused = r"its operands must have the same dtype, but got .+ and float32"
    for estimated in (lambda: koila.estimate(step, x), lambda: koila.suggest_batch_size(step, x, budget="1MiB")):
        with pytest.raises(RuntimeError, match=refused) as info:
            estimated()
        notes = getattr(info.value, "__notes__", [])
        assert any("meta tensors" in note for note in notes) or sys.version_info < (3, 11)
    assert koila.estimate(step, x.float()).peak(4) > 0  # the model's dtype: estimated
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts both before the product
        assert koila.estimate(step, x.float()).peak(4) > 0


def test_real_constant_reached_outside_a_module_is_read_not_written() -> None:
    counter = torch.zeros(3)

    def step(x: torch.Tensor) -> torch.Tensor:
        counter.add_(1)
        return x + counter

    found = koila.estimate(step, torch.randn(4, 3))
    assert torch.equal(counter, torch.zeros(3))
    assert found.peak(10) > 0


def test_dim_one_scales_the_second_dimension() -> None:
    model = nn.Linear(3, 5)

    def forward(x: torch.Tensor) -> torch.Tensor:  # x: (sequence, batch, features)
        with torch.no_grad():
            return model(x).sum(0)

    by_batch = koila.estimate(forward, torch.randn(7, ROWS, 3), dim=1)
    by_length = koila.estimate(forward, torch.randn(7, ROWS, 3), dim=-3)
    assert by_batch.sizes == (ROWS, 2 * ROWS)
    assert by_length.sizes == (7, 14)
    assert by_batch.peak(100) == true_peak(forward, torch.randn(7, 100, 3), model=model)
    assert by_length.peak(100) == true_peak(forward, torch.randn(100, ROWS, 3), model=model)


# --------------------------------------------------------------------------- 10. calls that take other paths


@pytest.fixture(scope="module")
def own_loop() -> tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor], koila.MemoryEstimate]:
    """A forward pass over chunks of 5 rows of its own, and its estimate from 8 rows: read only."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))

    def forward(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([model(part) for part in x.split(5)])

    return model, forward, koila.estimate(forward, torch.randn(ROWS, 16))


def test_call_with_its_own_loop_is_run_at_more_sizes(
    own_loop: tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor], koila.MemoryEstimate],
) -> None:
    model, forward, found = own_loop
    assert found.sizes[:3] == (1, ROWS, 2 * ROWS)
    assert len(found.sizes) == 5
    assert found.sizes[3] >= 4 * ROWS
    for rows in (ROWS, 16, 33, 100, 1000):
        assert found.peak(rows) >= true_peak(forward, torch.randn(rows, 16), model=model), rows


def test_call_with_its_own_loop_peaks_where_measured_and_far_out(
    own_loop: tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor], koila.MemoryEstimate],
) -> None:
    model, forward, found = own_loop
    assert {size: found.peak(size) for size in found.sizes} == found.measured
    truth = true_peak(forward, torch.randn(1000, 16), model=model)
    assert found.peak(1000) == pytest.approx(truth, rel=0.1)


# --------------------------------------------------------------------------- 11. property: forward passes


@settings(max_examples=25, deadline=None)
@given(
    widths=st.lists(st.integers(1, 48), min_size=1, max_size=4),
    features=st.integers(1, 48),
    rows=st.integers(1, 12),
    checked=st.lists(st.integers(1, 3000), min_size=1, max_size=3),
    activation=st.sampled_from([nn.ReLU, nn.Tanh, nn.GELU]),
)
def test_property_forward_peak_equals_a_real_run(
    widths: list[int], features: int, rows: int, checked: list[int], activation: type[nn.Module]
) -> None:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for before, after in zip([features, *widths], widths):
        layers += [nn.Linear(before, after), activation()]
    model = nn.Sequential(*layers)

    def forward(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(x)

    found = koila.estimate(forward, torch.randn(rows, features))
    assert found.sizes == (max(rows, 2), 2 * max(rows, 2))
    for size in checked:
        truth = true_peak(forward, torch.randn(size, features), model=model)
        assert found.peak(size) == pytest.approx(truth, rel=0.005), size
    sizes = sorted({1, 2, *checked, 10**6})
    peaks = [found.peak(size) for size in sizes]
    assert peaks == sorted(peaks), "the peak never falls as the batch grows"


def test_a_gradient_scaler_the_step_reaches_is_given_back_as_it_was() -> None:
    # The scaler marks in place, per optimizer, that it stepped; left so, the estimate's next
    # run at another size raised "step() has already been called since the last update()".
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")

    def step(x: torch.Tensor) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()

    x = torch.randn(8, 16)
    step(x)
    before = {name: repr(value) for name, value in vars(scaler).items()}
    found = koila.estimate(step, x)
    assert found.peak(64) > found.peak(8)
    assert {name: repr(value) for name, value in vars(scaler).items()} == before
    step(x)  # the real step still runs


# --------------------------------------------------------------------------- 12. shapes that depend on values


VALUE_SHAPED: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "indexing with a boolean mask": lambda h: h[h > 0],
    "torch.nonzero": lambda h: h[:, : torch.nonzero(h[0]).shape[0]],
    "torch.masked_select": lambda h: torch.masked_select(h, h > 0),
    "torch.unique": lambda h: h[:, : torch.unique(h.argmax(1)).numel()],
}


@pytest.mark.skipif(sys.version_info < (3, 11), reason="notes on exceptions are from Python 3.11")
@pytest.mark.parametrize("what", sorted(VALUE_SHAPED))
def test_an_operator_whose_shape_depends_on_values_gets_a_note_that_says_what_to_do(what: str) -> None:
    # PyTorch's own error points to its compiler's settings (torch.fx's meta_nonzero_assume_all_nonzero)
    # and fake implementations, which do not help an estimate.
    layer = nn.Linear(32, 64)

    def step(x: torch.Tensor) -> None:
        h = layer(x)
        (VALUE_SHAPED[what](h).sum() + h.sum()).backward()

    step(torch.randn(ROWS, 32))  # runs for real
    with pytest.raises((NotImplementedError, RuntimeError)) as info:
        koila.estimate(step, torch.randn(ROWS, 32))
    notes = info.value.__notes__
    assert notes[0].startswith(f"{what}")
    assert "the shape of its result depends on the values of a tensor" in notes[0]
    assert "Estimate the part of the call before it" in notes[0]
    assert "initial= a batch size" in notes[0]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="notes on exceptions are from Python 3.11")
def test_auto_warns_of_a_boolean_mask_with_the_note_not_pytorchs_message() -> None:
    model = nn.Linear(32, 64)

    @koila.chunked(initial="auto", cache=koila.NoCache())
    def infer(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            h = model(x)
            return h * h[h > 0].numel()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with simulated_device("64MiB"):
            infer(torch.randn(ROWS, 32))
    (warning,) = [w for w in caught if "could not estimate" in str(w.message)]
    assert "indexing with a boolean mask (x[mask]): the shape of its result depends on" in str(warning.message)
    assert "torch.fx" not in str(warning.message)


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_a_sparse_input_is_noted_as_counted_dense() -> None:
    # 10 non-zeros a row of 200,000 columns: 51 MB estimated for some 25 KB, silently, and initial="auto"
    # then ran the batch in 8 chunks where it fitted whole (probe 72C).
    rows = 64
    columns = torch.stack([torch.arange(rows).repeat_interleave(10), torch.randint(0, 200_000, (rows * 10,))])
    x = torch.sparse_coo_tensor(columns, torch.ones(rows * 10), (rows, 200_000))
    weight = torch.randn(200_000, 4)
    found = koila.estimate(lambda x: torch.sparse.mm(x, weight), x)
    (note,) = found.notes
    assert note.startswith("a sparse input: counted as the dense tensor it stands for")
    assert "initial= a size" in note
    assert koila.estimate(lambda x: x @ weight[:16], torch.randn(rows, 16)).notes == ()


@pytest.mark.parametrize("before", ["none", "sparse"])
def test_a_step_with_sparse_gradients_is_estimated_with_a_note_that_it_runs_low(before: str) -> None:
    # Embedding(sparse=True) made a sparse gradient on meta, whose storage the recorder asked for: estimate
    # raised NotImplementedError (probe 76K). Its backward and optimizer step are not followed (76M): noted.
    torch.manual_seed(0)
    embedding, head = nn.Embedding(1000, 16, sparse=True), nn.Linear(16, 2)
    optimizer = torch.optim.SparseAdam(list(embedding.parameters()))
    ids, labels = torch.randint(0, 1000, (64, 8)), torch.randint(0, 2, (64,))

    def step(ids: torch.Tensor, labels: torch.Tensor) -> None:
        embedding.zero_grad(set_to_none=before == "none")
        F.cross_entropy(head(embedding(ids).mean(1)), labels).backward()
        optimizer.step()

    step(ids, labels)
    found = koila.estimate(step, ids, labels)
    (note,) = found.notes
    assert note.startswith("a sparse gradient: counted by its indices and values, but the backward")
    assert "give initial= a size" in note
    assert found.peak(128) > found.peak(64) > 0

    def adjacent(x: torch.Tensor) -> torch.Tensor:  # a sparse tensor of the forward's, counted as it is (76N)
        rows = torch.arange(len(x)).repeat(2, 1)
        adjacency = torch.sparse_coo_tensor(rows, torch.ones(len(x)), (len(x), len(x)))
        return x * adjacency.shape[0]

    with torch.no_grad():
        assert koila.estimate(adjacent, torch.randn(64, 8)).notes == ()


def test_proxies_kept_for_dropped_handles_go_at_the_next_estimate() -> None:
    """Kept for a handle made during an estimate, they stayed after it was dropped until one made another."""
    from koila_retry._estimation import lending

    model = nn.Linear(4, 2)
    handles: list[Any] = []

    def hooking(x: torch.Tensor) -> None:
        handles.append(model.register_forward_hook(lambda *_: None))
        model(x).sum().backward()

    def plain(x: torch.Tensor) -> None:
        model(x).sum().backward()

    koila.estimate(hooking, torch.randn(8, 4))
    before = len(lending._RETAINED.get(model, ()))
    assert before > 0  # a handle made during the estimate keeps what it refers to
    for handle in handles:
        handle.remove()
    handles.clear()
    gc.collect()
    koila.estimate(plain, torch.randn(8, 4))
    assert len(lending._RETAINED.get(model, ())) < before
    assert model.weight.grad is None


@dataclasses.dataclass(slots=True)
class _SlottedTrainer:
    model: nn.Module

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.model(x), y)


def test_a_method_of_an_object_with_slots_is_estimated_with_the_model_it_holds() -> None:
    # Its slots were not looked into: "aten.t.default was given a real tensor ... reached some way other
    # than ... bound as self", and initial="auto" started from the whole batch (probe 75B).
    trainer = _SlottedTrainer(nn.Linear(8, 1))
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    estimate = koila.estimate(trainer.loss, x, y)
    assert estimate.peak(16) > 0


def test_a_parametrization_registered_in_the_step_leaves_the_module_as_it_was() -> None:
    # register_parametrization swaps the module's class for a subclass of its own, whose weight reads the
    # parametrizations the run added: the estimate put the attributes back and left the class, and the
    # model raised KeyError 'weight' ever after (probe 75B).
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    x = torch.randn(8, 16)

    def step(x: torch.Tensor) -> torch.Tensor:
        if not nn.utils.parametrize.is_parametrized(model[0]):
            nn.utils.parametrizations.weight_norm(model[0])  # set up lazily, on the first step
        return model(x).sum()

    koila.estimate(step, x)
    assert type(model[0]) is nn.Linear
    assert not nn.utils.parametrize.is_parametrized(model[0])
    assert model(x).shape == (8, 1)
    step(x).backward()  # the real step sets it up now
    assert nn.utils.parametrize.is_parametrized(model[0])
    assert model[0].parametrizations.weight.original0.grad is not None


class _Doubled(nn.Module):
    def forward(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor * 2


@pytest.mark.parametrize("change", ["parametrize another", "remove"])
def test_a_parametrized_module_s_own_class_is_put_back_after_the_step_changed_it(change: str) -> None:
    # Its class is its own: parametrizing another of its tensors adds a property to that class, removing one
    # deletes it, and the estimate put back the module's attributes but not its class's (probe 75H).
    model = nn.Linear(4, 4)
    nn.utils.parametrizations.weight_norm(model)
    x, y = torch.randn(8, 4), torch.randn(8, 4)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if change == "remove" and nn.utils.parametrize.is_parametrized(model, "weight"):
            nn.utils.parametrize.remove_parametrizations(model, "weight", leave_parametrized=True)
        elif change != "remove" and not nn.utils.parametrize.is_parametrized(model, "bias"):
            nn.utils.parametrize.register_parametrization(model, "bias", _Doubled())
        return F.mse_loss(model(x), y)

    expected = F.mse_loss(model(x), y)
    koila.estimate(step, x, y)
    torch.testing.assert_close(F.mse_loss(model(x), y), expected)
    assert nn.utils.parametrize.is_parametrized(model, "weight")
    assert not nn.utils.parametrize.is_parametrized(model, "bias")
    step(x, y).backward()  # the real step changes it now
    assert nn.utils.parametrize.is_parametrized(model, "bias") is (change != "remove")
