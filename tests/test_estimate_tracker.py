"""koila.estimate follows the modules that run, forward and backward, without changing the step.

The estimate records which modules run when memory peaks (``module_peaks``). Its module
tracker hooks the gradients of modules' inputs and outputs; those hooks must hold no tensor
and no graph node, so that a graph the step drops is freed at once, as in the real step,
and must not ask autograd's engine which nodes it will run, which raises in
``torch.autograd.grad`` with respect to a leaf. Also here: lazy modules, which an estimate
cannot run, a step whose peak is concave in the batch size between the sizes run at, and a
mixture of experts' grouped matrix product, whose meta kernel takes bfloat16 alone.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import koila_retry as koila
from koila_retry.testing import simulated_device

# The CPU's estimate is within a few percent of the real peak (docs/estimate.rst, and the 5% of
# tests/test_estimate_accuracy.py).
ACCURACY = 0.05


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 10))


def real_and_estimated(
    build: Callable[[], nn.Module], step: Callable[..., Any], *inputs: torch.Tensor
) -> tuple[int, int]:
    """The peak of a real step on a simulated device, model and batch made there, and the estimate's."""
    with simulated_device("4GiB") as device:
        step(build(), *[tensor.clone() for tensor in inputs])
    model = build()
    found = koila.estimate(lambda *batch: step(model, *batch), *inputs)
    return device.peak, found.peak(inputs[0].shape[0])


# --------------------------------------------------------------------------- graphs the step drops


def metric_then_train(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A step that looks at a forward's output (a metric) and drops its graph, then trains."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    logits = model(x)
    accuracy: torch.Tensor = (logits.argmax(1) == y).float().mean()
    del logits
    torch.autograd.backward(F.cross_entropy(model(x), y))
    optimizer.step()
    return accuracy


def test_a_graph_the_step_drops_is_freed_in_the_estimate_as_in_the_real_step() -> None:
    x, y = torch.randn(256, 64), torch.randint(0, 10, (256,))
    real, estimated = real_and_estimated(mlp, metric_then_train, x, y)
    assert estimated == pytest.approx(real, rel=ACCURACY)


def augmented_predictions(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Eight forwards with gradients on, of which only the argmax is kept (test-time augmentation)."""
    return torch.stack([model(x + shift).argmax(1) for shift in range(8)])


def test_forwards_whose_graphs_are_dropped_one_by_one_are_estimated_as_the_real_call() -> None:
    real, estimated = real_and_estimated(mlp, augmented_predictions, torch.randn(256, 64))
    assert estimated == pytest.approx(real, rel=ACCURACY)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 256)
        self.down = nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.down(F.gelu(self.up(x)))
        return out


class FrozenMiddle(nn.Module):
    """Three blocks, the middle one run under no_grad: the graph of the first is cut off and freed."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(32, 64)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.last = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        for index, block in enumerate(self.blocks):
            with torch.no_grad() if index == 1 else torch.enable_grad():
                h = block(h)
        out: torch.Tensor = self.last(h)
        return out


def frozen_middle() -> nn.Module:
    torch.manual_seed(0)
    return FrozenMiddle()


def backward(model: nn.Module, x: torch.Tensor) -> None:
    model(x).sum().backward()


def test_a_module_run_under_no_grad_mid_model_frees_the_graph_before_it_in_the_estimate_too() -> None:
    real, estimated = real_and_estimated(frozen_middle, backward, torch.randn(32, 32))
    assert estimated == pytest.approx(real, rel=ACCURACY)


# --------------------------------------------------------------------------- autograd.grad of a leaf


def gradient_penalty(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The gradient of the output with respect to the input, a leaf, penalised (WGAN-GP, say)."""
    x = x.requires_grad_()
    out = model(x)
    (gradient,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    loss: torch.Tensor = out.mean() + gradient.pow(2).mean()
    return loss


def penalised_step(model: nn.Module, x: torch.Tensor) -> None:
    torch.autograd.backward(gradient_penalty(model, x))


def test_autograd_grad_with_respect_to_a_leaf_input_is_estimated_as_the_real_step() -> None:
    x = torch.randn(128, 64)
    real, estimated = real_and_estimated(mlp, penalised_step, x)
    assert estimated == pytest.approx(real, rel=ACCURACY)
    # The modules' backward is still followed, through autograd.grad and backward.
    model = mlp()
    peaks = koila.estimate(lambda x: penalised_step(model, x), x).module_peaks(128)
    assert all(peaks[f"Sequential.{index}"][1] > 0 for index in (0, 2, 4))


def test_auto_estimates_a_step_with_autograd_grad_of_a_leaf_without_a_warning() -> None:
    model = mlp()
    plain = mlp()
    x = torch.randn(16, 64)
    torch.autograd.backward(gradient_penalty(plain, x.clone()))
    wrapped: Any = koila.accumulate(initial="auto", cache=koila.NoCache())(lambda x: gradient_penalty(model, x))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with simulated_device("4GiB"):
            wrapped(x.clone())
    assert [str(w.message) for w in caught if "could not estimate" in str(w.message)] == []
    for mine, theirs in zip(model.parameters(), plain.parameters(), strict=True):
        assert mine.grad is not None
        assert theirs.grad is not None
        torch.testing.assert_close(mine.grad, theirs.grad)


# --------------------------------------------------------------------------- lazy modules


def lazy() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.LazyLinear(32), nn.ReLU(), nn.LazyLinear(4))


def lazy_after_seed(seed: int) -> nn.Sequential:
    """A lazy model, and the global generator seeded for the values it draws in its first call."""
    model = lazy()
    torch.manual_seed(seed)
    return model


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mem = nn.Sequential(nn.Linear(256, 4096), nn.ReLU(), nn.Linear(4096, 256))
        self.q = nn.Linear(256, 256)

    def forward(self, queries: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        m = self.mem(memory)  # runs first: its backward runs after the queries'
        return self.q(queries).mean(0) + m


class WithQueries(nn.Module):
    """Learned queries passed to a block as a Parameter, as DETR's decoder takes them: a leaf input."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.queries = nn.Parameter(torch.randn(8, 256))
        self.enc = nn.Linear(256, 256)
        self.dec = Decoder()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(self.queries, self.enc(x))


def twice(model: nn.Module) -> Callable[[torch.Tensor], None]:
    def step(x: torch.Tensor) -> None:
        loss = model(x).pow(2).mean()
        loss.backward(retain_graph=True)
        loss.backward()

    return step


@pytest.mark.parametrize("backward", ["once", "twice"])
def test_a_module_given_a_leaf_runs_in_backward_until_its_other_inputs_have_their_gradient(backward: str) -> None:
    # The leaf's gradient comes as soon as its own branch is done: a module left at it was over before
    # its other branch's backward ran, which then counted for its parent only. In each backward pass.
    model = WithQueries()
    step = twice(model) if backward == "twice" else lambda x: model(x).pow(2).mean().backward()
    peaks = koila.estimate(step, torch.randn(64, 256)).module_peaks(64)
    assert peaks["WithQueries.dec"][1] >= peaks["WithQueries.dec.mem"][1]


class Up(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(512, 64)

    def forward(self, h: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.cat([h, skip], 1))


class UNetish(nn.Module):
    """A skip connection: the input ``skip`` of ``up`` feeds the encoder too."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(32, 256)
        self.encoder = nn.Sequential(nn.Linear(256, 8192), nn.ReLU(), nn.Linear(8192, 256))
        self.up = Up()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.stem(x)
        return self.up(self.encoder(skip), skip)


def test_a_module_whose_input_feeds_others_too_ends_before_their_backward() -> None:
    # The skip's whole gradient comes after the encoder's backward: a module that waited for every
    # input's gradient ran through the encoder's backward, and took its peak.
    model = UNetish()
    peaks = koila.estimate(lambda x: model(x).sum().backward(), torch.randn(256, 32)).module_peaks(256)
    assert peaks["UNetish.up"][1] == peaks["UNetish.up.lin"][1]
    assert peaks["UNetish.up"][1] < peaks["UNetish.encoder"][1]


class ByKeyword(UNetish):
    """The same skip, passed to ``up`` by keyword, as Hugging Face models call their blocks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.stem(x)
        return self.up(h=self.encoder(skip), skip=skip)


class InPlace(nn.Module):
    """A block that changes its input in place (its input is its output after), after a wide one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wide = nn.Sequential(nn.Linear(32, 8192), nn.ReLU(), nn.Linear(8192, 64))
        self.act = nn.ReLU(inplace=True)
        self.last = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.act(self.wide(x)))


def test_a_module_given_its_inputs_by_keyword_ends_its_backward_at_theirs() -> None:
    # Keyword inputs reach no global pre-hook: a module given only those never left in backward,
    # and took the peaks of every backward after it.
    model = ByKeyword()
    peaks = koila.estimate(lambda x: model(x).sum().backward(), torch.randn(256, 32)).module_peaks(256)
    assert peaks["ByKeyword.up"][1] == peaks["ByKeyword.up.lin"][1]
    assert peaks["ByKeyword.up"][1] < peaks["ByKeyword.encoder"][1]


def test_a_module_that_changes_its_input_in_place_ends_its_backward_before_the_next_one() -> None:
    model = InPlace()
    peaks = koila.estimate(lambda x: model(x).sum().backward(), torch.randn(256, 32)).module_peaks(256)
    assert peaks["InPlace.act"][1] < peaks["InPlace.wide"][1]


class PassedOn(nn.Module):
    """A module after a wide one that passes its input on: untouched, or changed in place by keyword."""

    def __init__(self, middle: nn.Module, by_keyword: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wide = nn.Sequential(nn.Linear(32, 8192), nn.ReLU(), nn.Linear(8192, 64))
        self.middle, self.by_keyword = middle, by_keyword
        self.last = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.wide(x)
        return self.last(self.middle(input=hidden) if self.by_keyword else self.middle(hidden))


@pytest.mark.parametrize(
    ("middle", "by_keyword"),
    [(nn.Identity(), False), (nn.Dropout(0.0), False), (nn.ReLU(inplace=True), True)],
    ids=["identity", "dropout-0", "in-place-by-keyword"],
)
def test_a_module_whose_output_is_its_input_is_not_counted_through_the_backward_after_it(
    middle: nn.Module, by_keyword: bool
) -> None:
    # Left at its input's gradient and entered again at its output's, the same tensor's, it stayed in the
    # record to the end of the backward and took the peaks of every module before it (HF's Dropout(p=0)).
    model = PassedOn(middle, by_keyword)
    peaks = koila.estimate(lambda x: model(x).sum().backward(), torch.randn(256, 32)).module_peaks(256)
    assert peaks.get("PassedOn.middle", (0, 0))[1] <= peaks["PassedOn.last"][1]
    assert peaks["PassedOn.wide"][1] > peaks["PassedOn.last"][1]


def test_an_estimate_leaves_no_global_module_hook_behind() -> None:
    # One left would make every later torch.compile(module) call warn of global hooks.
    assert not torch.nn.modules.module._has_any_global_hook()
    model = ByKeyword()
    koila.estimate(lambda x: model(x).sum().backward(), torch.randn(8, 32))
    assert not torch.nn.modules.module._has_any_global_hook()


def test_estimate_of_a_lazy_module_not_run_yet_names_it_and_what_to_do() -> None:
    model = lazy()
    with pytest.raises(ValueError, match=r"Sequential\.0 \(LazyLinear\) has 'weight' not initialised.*run the model"):
        koila.estimate(lambda x: model(x).sum(), torch.randn(8, 16))


def test_a_lazy_module_is_left_lazy_by_the_estimate_and_estimated_once_run() -> None:
    model = lazy()
    with pytest.raises(ValueError, match="initial="):
        koila.estimate(lambda x: model(x).sum(), torch.randn(8, 16))
    assert isinstance(model[0].weight, nn.parameter.UninitializedParameter)
    x = torch.randn(8, 16)
    torch.manual_seed(1)  # a lazy module draws its initial values in its first call
    out = model(x)
    torch.testing.assert_close(out, lazy_after_seed(1)(x))  # the real call initialises it as it would have
    assert koila.estimate(lambda x: model(x).sum(), x).peak(8) > 0


def test_auto_of_a_lazy_module_warns_and_runs_the_whole_batch() -> None:
    model = lazy()
    x = torch.randn(16, 16)
    expected = lazy_after_seed(1)(x)
    chunked: Any = koila.chunked(lambda x: model(x), initial="auto")
    torch.manual_seed(1)
    with pytest.warns(UserWarning, match="could not estimate .*LazyLinear"):
        out = chunked(x)
    torch.testing.assert_close(out, expected)
    assert chunked.stats.batch_size == 16


@pytest.mark.filterwarnings("ignore:`torch.jit.:DeprecationWarning")
@pytest.mark.parametrize("how", ["script", "trace"])
def test_a_torchscript_model_is_refused_by_name_and_auto_falls_back_to_the_whole_batch(how: str) -> None:
    # The estimate crashed with "'_CachedForward' object has no attribute '__getattr__'" (probe 76G).
    linear = nn.Sequential(nn.Linear(16, 4), nn.ReLU())
    x = torch.randn(8, 16)
    model = torch.jit.script(linear) if how == "script" else torch.jit.trace(linear, x)
    with pytest.raises(TypeError, match=r"is a TorchScript module \(torch.jit.script or trace\), whose compiled code"):
        koila.estimate(model, x)
    with pytest.raises(TypeError, match=r"is a TorchScript module"):
        koila.profile(model, x, fake=True)
    chunked: Any = koila.chunked(model, initial="auto")
    with pytest.warns(UserWarning, match="could not estimate .*TorchScript module"), torch.no_grad():
        out = chunked(x)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x))
    assert chunked.stats.batch_size == 8


# --------------------------------------------------------------------------- a peak concave in the batch


def chunked_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 8192), nn.ReLU(), nn.Linear(8192, 4))


def in_chunks_of_16(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A forward over fixed chunks: its peak grows up to one chunk's rows, and hardly after."""
    with torch.no_grad():
        return torch.cat([model(chunk) for chunk in torch.split(x, 16)])


def real_peak(rows: int) -> int:
    with simulated_device("1GiB") as device:
        in_chunks_of_16(chunked_model(), torch.randn(rows, 64))
    return device.peak


def test_with_sizes_at_every_power_of_two_a_concave_peak_gets_a_suggestion_that_fits() -> None:
    """docs/estimate.rst: the line between sizes run at can be below a concave peak; ``sizes=`` helps."""
    model = chunked_model()
    x = torch.randn(64, 64)
    default = koila.estimate(lambda x: in_chunks_of_16(model, x), x)
    budget = int(default.peak(16) * 1.1) + 1
    powers = (1, 2, 4, 8, 16, 32, 64)
    size = koila.suggest_batch_size(lambda x: in_chunks_of_16(model, x), x, budget=budget, sizes=powers)
    assert real_peak(size) * 1.1 <= budget
    found = koila.estimate(lambda x: in_chunks_of_16(model, x), x, sizes=powers)
    assert found.peak(2 * size) == pytest.approx(real_peak(2 * size), rel=ACCURACY)


# --------------------------------------------------------------------------- a mixture of experts' product


class Experts(nn.Module):
    """Four experts' weights in one grouped matrix product, as transformers' MoE layers run them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(4, 128, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(1, 5, dtype=torch.int32) * (x.shape[0] // 4)  # each expert's rows, cumulated
        return F.grouped_mm(x, self.weight.transpose(-2, -1), offs=offsets)


@pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="torch.nn.functional.grouped_mm is from torch 2.9")
def test_a_grouped_matrix_product_in_float32_is_estimated_as_the_real_step() -> None:
    # Its meta kernel takes bfloat16 alone, where the CPU's takes float32: the estimate of a float32 MoE
    # model on the CPU raised, and suggest_batch_size with it.
    def step(model: nn.Module, x: torch.Tensor) -> None:
        model(x).square().sum().backward()

    real, estimated = real_and_estimated(Experts, step, torch.randn(16, 64, requires_grad=True))
    assert abs(estimated - real) <= ACCURACY * real


# --------------------------------------------------------------------------- modules that allocate nothing


class Halves(nn.Module):
    """Returns a view of its input: it allocates nothing, forward or backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], 2, -1)


def reshaping() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.Flatten(),
        nn.Identity(),
        nn.Unflatten(1, (4, 30, 30)),
        nn.Flatten(),
        Halves(),
        nn.Flatten(),
        nn.Linear(3600, 2),
    )


def test_a_module_that_allocates_nothing_has_the_bytes_alive_while_it_ran() -> None:
    # Only moments at which something was allocated were observed: such a module had no entry at all.
    x = torch.randn(4, 3, 32, 32)
    alive: dict[str, int] = {}
    with simulated_device("4GiB") as device:
        model = reshaping()
        for name, child in model.named_children():

            def entered(*_: Any, name: str = f"Sequential.{name}") -> None:
                alive.setdefault(name, device.live)

            child.register_forward_pre_hook(entered)
        model(x.clone()).sum().backward()
    model = reshaping()
    peaks = koila.estimate(lambda x: model(x).sum().backward(), x).module_peaks(4)
    assert set(peaks) == {"Sequential", *alive}
    for name in ("Sequential.1", "Sequential.2", "Sequential.3", "Sequential.4", "Sequential.5", "Sequential.6"):
        assert peaks[name][0] == alive[name], name
    assert peaks["Sequential.1"][1] > 0  # Flatten's backward is a view of its output's gradient
    assert peaks["Sequential.2"][1] == 0  # Identity returns its input: no backward of its own
