"""koila.accumulate(backward=...): the backward of a training engine (accelerate, Lightning Fabric).

Each test imports its engine with ``pytest.importorskip``, so that the tests of one engine
skip alone when it is missing. The models are float64, so that a split step and the full
one differ only by the order of additions, and out-of-memory errors are real: a simulated
device's limit, or a backward that raises ``torch.OutOfMemoryError`` inside autograd.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from _layers import OOMInBackward
from torch import nn
from torch.nn import functional as F

import koila_retry as koila
from koila_retry.testing import simulated_device

DTYPE = torch.float64
RTOL, ATOL = 1e-5, 1e-10
ROWS = 256


# --------------------------------------------------------------------------- helpers


def data(n: int, *shape: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, generator=generator, dtype=DTYPE)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 1)).double()


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return data(ROWS, 6, seed=seed), data(ROWS, 1, seed=1000 + seed)


def full_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    """The plain step on the whole batch, ``loss.backward()``: its loss and gradients; ``.grad`` left as found."""
    saved = [p.grad for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    loss = F.mse_loss(model(x), y)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    for p, grad in zip(model.parameters(), saved):
        p.grad = grad
    return loss.item(), grads


def splitting_limit(
    x: torch.Tensor, y: torch.Tensor, make: Callable[[], nn.Module] = make_model, fraction: float = 0.6
) -> int:
    """A share of the peak memory of the plain step on the whole batch: by default, half the batch fits."""
    return int(peak_bytes(lambda: full_step(make(), x, y)) * fraction)


def peak_bytes(run: Callable[[], object]) -> int:
    """The most bytes ``run`` had alive at once, measured on a simulated device with room to spare."""
    with simulated_device("1GiB") as device:
        run()
    return device.peak


def assert_grads(model: nn.Module, expected: list[torch.Tensor]) -> None:
    for (name, p), want in zip(model.named_parameters(), expected, strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, want, rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"{name}: {m}")


class Counting:
    """An engine's backward, called through: counts the calls it ``started``, records the ``calls`` that finished.

    Pass its ``forget`` as ``on_oom=``: what a failed attempt recorded is then dropped
    with the attempt, and ``calls`` holds the backward calls of the attempt that succeeded.
    """

    def __init__(self, backward: Callable[..., Any]) -> None:
        self.backward = backward
        self.started = 0
        self.calls: list[tuple[float, dict[str, Any], str]] = []  # the loss, the keywords, the loss's device

    def __call__(self, loss: torch.Tensor, **kwargs: Any) -> None:
        self.started += 1
        self.backward(loss, **kwargs)
        self.calls.append((loss.item(), kwargs, loss.device.type))  # a number: no tensor is kept

    def forget(self, event: object = None) -> None:
        self.calls.clear()


def micro_batches(rows: int, size: int) -> int:
    return math.ceil(rows / size)


@pytest.fixture
def accelerator() -> Iterator[Callable[..., Any]]:
    """Make an ``accelerate.Accelerator`` on the CPU; its process-wide state is reset after the test."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    def make(**options: Any) -> Any:
        return accelerate.Accelerator(cpu=True, **options)

    yield make
    AcceleratorState._reset_state()
    GradientState._reset_state()


def fabric(**options: Any) -> Any:
    lightning_fabric = pytest.importorskip("lightning_fabric")
    return lightning_fabric.Fabric(accelerator="cpu", devices=1, **options)


@pytest.fixture(params=["accelerate", "fabric"])
def engine(request: pytest.FixtureRequest) -> Callable[[nn.Module], tuple[nn.Module, Callable[..., Any]]]:
    """Set a model up with an engine (each skips alone); return the model to train and the engine's backward."""
    if request.param == "accelerate":
        accelerator = request.getfixturevalue("accelerator")()

        def prepare(model: nn.Module) -> tuple[nn.Module, Callable[..., Any]]:
            return accelerator.prepare(model), accelerator.backward

        return prepare
    runner = fabric()

    def setup(model: nn.Module) -> tuple[nn.Module, Callable[..., Any]]:
        return runner.setup(model), runner.backward

    return setup


# --------------------------------------------------------------------------- accelerate


def test_accelerate_backward_in_a_step_split_by_real_oom_gives_the_full_batch_gradient(
    accelerator: Callable[..., Any],
) -> None:
    engine = accelerator()
    model, reference = make_model(), make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = engine.prepare(model, optimizer)
    x, y = batch()
    expected_loss, expected_grads = full_step(reference, x, y)
    backward = Counting(engine.backward)

    @koila.accumulate(backward=backward, on_oom=backward.forget)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)

    with simulated_device(splitting_limit(x, y)):
        loss = step(x, y)
    assert step.stats.ooms >= 1
    assert step.stats.batch_size < ROWS, "the step really split"
    # Every backward of the attempt that succeeded went through accelerate, one per micro-batch,
    # on the micro-batch's weighted loss: together they add up to the whole batch's loss.
    assert len(backward.calls) == micro_batches(ROWS, step.stats.batch_size) > 1
    assert [(kwargs, device) for _, kwargs, device in backward.calls] == [({}, "cpu")] * len(backward.calls)
    assert math.isclose(sum(value for value, _, _ in backward.calls), expected_loss, rel_tol=1e-12)
    assert math.isclose(loss.item(), expected_loss, rel_tol=1e-12)
    assert_grads(model, expected_grads)


def test_accelerate_gradient_accumulation_steps_divide_each_call(accelerator: Callable[..., Any]) -> None:
    # accelerate's backward divides every loss it is given by gradient_accumulation_steps (only
    # DeepSpeed does its own division), so that the gradients of that many calls add up to their
    # mean. One koila call puts the whole batch's gradient / 2 in .grad; two calls under
    # accelerator.accumulate(), with an optimizer step that accelerate skips until the second,
    # step on the mean of the two batches' gradients. The loss koila returns is not divided.
    engine = accelerator(gradient_accumulation_steps=2)
    model, reference = make_model(), make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = engine.prepare(model, optimizer)
    batches = [batch(0), batch(1)]
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    results = [full_step(reference, x, y) for x, y in batches]
    for p, first, second in zip(reference.parameters(), results[0][1], results[1][1], strict=True):
        p.grad = (first + second) / 2
    plain.step()
    backward = Counting(engine.backward)

    @koila.accumulate(backward=backward, on_oom=backward.forget)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)

    with simulated_device(splitting_limit(*batches[0])):
        for i, (x, y) in enumerate(batches):
            with engine.accumulate(model):
                loss = step(x, y)
                if i == 0:
                    assert_grads(model, [g / 2 for g in results[0][1]])
                assert math.isclose(loss.item(), results[i][0], rel_tol=1e-12), "the loss, not the loss / 2"
                optimizer.step()  # skipped by accelerate at i == 0
                optimizer.zero_grad()
    assert step.stats.batch_size < ROWS
    assert len(backward.calls) == 2 * micro_batches(ROWS, step.stats.batch_size)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)
        assert p.grad is None, "zeroed once the optimizer stepped"


def test_initial_auto_estimates_without_calling_the_engine(accelerator: Callable[..., Any]) -> None:
    # The estimate runs the step on meta tensors with a plain backward: the engine's backward
    # only ever sees the real micro-batches' losses.
    engine = accelerator()
    model = engine.prepare(make_model())
    x, y = batch()
    _, expected_grads = full_step(make_model(), x, y)
    backward = Counting(engine.backward)

    @koila.accumulate(initial="auto", backward=backward, on_oom=backward.forget)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)

    with simulated_device(splitting_limit(x, y)):
        step(x, y)
    assert step.stats.batch_size < ROWS
    assert step.stats.ooms == 0, "the estimate found a size that fits"
    # One more than the size's micro-batches: the first is a smaller probe, measured on the
    # (simulated) device, whose gradient counts as every other's.
    assert backward.started == len(backward.calls) == micro_batches(ROWS, step.stats.batch_size) + 1
    assert {device for _, _, device in backward.calls} == {"cpu"}, "never a meta tensor"
    assert_grads(model, expected_grads)


# --------------------------------------------------------------------------- Lightning Fabric


def test_fabric_backward_in_a_step_split_by_real_oom_steps_as_the_full_batch() -> None:
    runner = fabric()
    model, reference = make_model(), make_model()
    model, optimizer = runner.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    plain = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    backward = Counting(runner.backward)

    @koila.accumulate(backward=backward, on_oom=backward.forget)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)

    x, y = batch()
    limit = splitting_limit(x, y)
    for seed in (0, 1):  # the second step starts at the size the first found
        x, y = batch(seed)
        expected_loss, expected_grads = full_step(reference, x, y)
        optimizer.zero_grad()
        with simulated_device(limit):
            loss = step(x, y)
        assert step.stats.batch_size < ROWS, "the step really split"
        assert len(backward.calls) == micro_batches(ROWS, step.stats.batch_size) > 1
        assert math.isclose(loss.item(), expected_loss, rel_tol=1e-12)
        assert_grads(model, expected_grads)
        optimizer.step()
        for p, want in zip(reference.parameters(), expected_grads, strict=True):
            p.grad = want
        plain.step()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)
        backward.forget()
    assert step.stats.ooms == 1


def test_fabric_precision_that_needs_its_own_backward_gets_it() -> None:
    # Fabric's mixed precision refuses a backward that it does not run (a hook on the model's
    # output raises): the step runs only because every backward goes through fabric.backward.
    runner = fabric(precision="bf16-mixed")
    torch.manual_seed(0)
    model = runner.setup(nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 1)))
    x, y = (t.float() for t in batch())

    @koila.accumulate
    def plain(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)

    with pytest.raises(RuntimeError, match=r"fabric\.backward"):
        plain(x, y)
    assert all(p.grad is None for p in model.parameters()), "the failed call wrote nothing"

    def whole() -> None:
        model.zero_grad()
        runner.backward(F.mse_loss(model(x), y))

    limit = int(peak_bytes(whole) * 0.6)
    whole()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    @koila.accumulate(backward=runner.backward)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)

    with simulated_device(limit):
        step(x, y)
    assert step.stats.ooms >= 1
    assert step.stats.batch_size < ROWS
    for p, want in zip(model.parameters(), expected, strict=True):
        # bfloat16 products, added up in another order per micro-batch: equal to bfloat16's precision.
        torch.testing.assert_close(p.grad, want, rtol=2e-2, atol=2e-3)


def test_initial_auto_under_fabric_mixed_precision_starts_from_the_whole_batch() -> None:
    # The estimate's plain backward on meta tensors trips the same hook: it cannot estimate,
    # says so, and the call starts from the whole batch, halving on out-of-memory errors.
    runner = fabric(precision="bf16-mixed")
    torch.manual_seed(0)
    model = runner.setup(nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 1)))
    x, y = (t.float() for t in batch())

    @koila.accumulate(initial="auto", backward=runner.backward)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)

    with pytest.warns(UserWarning, match=r"could not estimate the memory of .*fabric\.backward"):
        step(x, y)
    assert step.stats.batch_size == ROWS
    assert all(p.grad is not None for p in model.parameters())


# --------------------------------------------------------------------------- both engines


@pytest.mark.parametrize("initial", [None, 64], ids=["split-by-oom", "split-from-the-start"])
def test_grads_from_before_are_kept_and_added(engine: Callable[..., Any], initial: int | None) -> None:
    model, backward = engine(make_model())
    x, y = batch()
    _, expected_grads = full_step(make_model(), x, y)
    for i, p in enumerate(model.parameters()):
        p.grad = torch.full_like(p, 0.25 * (i + 1))
    before = [(p.grad, p.grad.clone()) for p in model.parameters()]
    counting = Counting(backward)

    @koila.accumulate(initial=initial, backward=counting, on_oom=counting.forget)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)

    with simulated_device(splitting_limit(x, y)):
        step(x, y)
    assert step.stats.ooms == (1 if initial is None else 0)
    assert len(counting.calls) == micro_batches(ROWS, step.stats.batch_size) > 1
    for p, (tensor, value), want in zip(model.parameters(), before, expected_grads, strict=True):
        assert p.grad is tensor, "the same tensor object"
        torch.testing.assert_close(p.grad, value + want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(
    ("where", "initial", "tried"), [("simulated", None, 3), ("backward", None, 3), ("backward", 64, 1)]
)
def test_out_of_memory_at_the_minimum_leaves_grads_from_before(
    engine: Callable[..., Any], where: str, initial: int | None, tried: int
) -> None:
    torch.manual_seed(0)
    if where == "backward":  # every backward runs out of memory after writing the last layer's grads
        layers = [nn.Linear(6, 32), nn.Tanh(), _OOMEveryBackward(), nn.Linear(32, 1)]
    else:  # the simulated device is too small for even the minimum
        layers = [nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 1)]
    model, backward = engine(nn.Sequential(*layers).double())
    x, y = batch()
    for i, p in enumerate(model.parameters()):
        p.grad = torch.full_like(p, 0.25 * (i + 1))
    before = [(p.grad, p.grad.clone()) for p in model.parameters()]
    counting = Counting(backward)

    @koila.accumulate(initial=initial, minimum=64, backward=counting)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)

    limit = splitting_limit(x, y) // 8 if where == "simulated" else "1GiB"
    with simulated_device(limit), pytest.raises(koila.BatchSizeExhausted):
        step(x, y)
    assert step.stats.exhausted == 1
    assert step.stats.ooms == tried, "256, 128 and 64 rows, or 64 only"
    if where == "backward":
        assert counting.started == tried, "the engine's backward ran, and failed, in each attempt"
    assert not counting.calls
    for p, (tensor, value) in zip(model.parameters(), before, strict=True):
        assert p.grad is tensor, "the same tensor object"
        assert torch.equal(p.grad, value)


class _OOMEveryBackward(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return OOMInBackward.apply(x)


class Watched(nn.Module):
    """Records, at the start of each forward, whether a tensor made by an earlier forward is alive.

    With ``fail_above``, the backward of a micro-batch of more rows runs out of memory: the
    error is raised inside the engine's backward, whose frames hold the loss.
    """

    def __init__(self, fail_above: int | None) -> None:
        super().__init__()
        self.hidden, self.out = nn.Linear(6, 16), nn.Linear(16, 1)
        self.fail_above = fail_above
        self.made: list[weakref.ref[torch.Tensor]] = []
        self.alive: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.alive.append(any(ref() is not None for ref in self.made))
        h = torch.tanh(self.hidden(x))
        self.made.append(weakref.ref(h))
        if self.fail_above is not None and x.shape[0] > self.fail_above:
            h = OOMInBackward.apply(h)
        out = self.out(h)
        self.made.append(weakref.ref(out))
        return out


@pytest.mark.parametrize("where", ["simulated", "backward"])
def test_failed_attempt_is_freed_before_the_retry(engine: Callable[..., Any], where: str) -> None:
    torch.manual_seed(0)
    watched = Watched(fail_above=64 if where == "backward" else None).double()
    model, backward = engine(watched)
    x, y = batch()
    counting = Counting(backward)
    made_when_failed: list[int] = []

    @koila.accumulate(backward=counting, on_oom=lambda event: made_when_failed.append(len(watched.made)))
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)

    # Room for the whole batch's forward, not for its backward too.
    limit = splitting_limit(x, y, lambda: Watched(None).double(), 0.8) if where == "simulated" else "1GiB"
    with simulated_device(limit):
        step(x, y)
    assert step.stats.ooms >= 1
    assert made_when_failed[0] >= 1, "the failed attempt made a tensor"
    assert counting.started > len(counting.calls), "an attempt failed inside the engine's backward"
    assert len(watched.alive) > 1
    assert not any(watched.alive), "no attempt's or micro-batch's tensors outlive it"
    assert all(ref() is None for ref in watched.made)


def test_a_graph_from_before_the_call_is_retained_through_the_engine(engine: Callable[..., Any]) -> None:
    # step(encoder(x), y): every micro-batch backs through the encoder's graph, so each engine
    # backward gets retain_graph=True, which the engines pass on to Tensor.backward.
    torch.manual_seed(0)
    encoder = nn.Linear(6, 6).double()
    head, backward = engine(make_model())
    x, y = batch()
    reference_encoder, reference_head = nn.Linear(6, 6).double(), make_model()
    reference_encoder.load_state_dict(encoder.state_dict())
    F.mse_loss(reference_head(reference_encoder(x)), y).backward()
    counting = Counting(backward)

    @koila.accumulate(initial=64, backward=counting)
    def step(features: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(head(features), y)

    step(encoder(x), y)
    assert [kwargs for _, kwargs, _ in counting.calls] == [{"retain_graph": True}] * 4
    for module, reference in ((encoder, reference_encoder), (head, reference_head)):
        assert_grads(module, [p.grad for p in reference.parameters()])


def test_no_backward_runs_under_no_grad(engine: Callable[..., Any]) -> None:
    model, backward = engine(make_model())
    counting = Counting(backward)

    @koila.accumulate(initial=64, backward=counting)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)

    with torch.no_grad():
        step(*batch())
    assert counting.started == 0
    assert all(p.grad is None for p in model.parameters())


# --------------------------------------------------------------------------- errors


def test_backward_that_is_not_callable_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"^backward must be a callable .* got str 'accelerator\.backward'$"):
        koila.accumulate(backward="accelerator.backward")  # type: ignore[arg-type]


def test_an_async_backward_is_a_type_error() -> None:
    # Its call made a coroutine, never awaited: no backward ran, and .grad stayed None, silently.
    async def backward(loss: torch.Tensor) -> None:
        loss.backward()  # type: ignore[no-untyped-call]

    with pytest.raises(TypeError, match=r"^backward must be a callable .*\(not an async def\), got function"):
        koila.accumulate(backward=backward)  # type: ignore[arg-type]


class _Engine:
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        loss.backward(**kwargs)  # type: ignore[no-untyped-call]


def test_a_class_s_own_backward_is_refused_when_decorating() -> None:
    # Accelerator.backward, the class's, not an accelerator's: the loss became its self, and the first call
    # failed after the forward, with PyTorch's words about a missing argument (probe 71C).
    with pytest.raises(TypeError, match=r"^backward is called with the loss, but .*_Engine\.backward.* takes \(self, "):
        koila.accumulate(backward=_Engine.backward)
    koila.accumulate(backward=_Engine().backward)  # an engine's is taken


def test_the_gradscaler_class_as_scaler_is_refused_when_decorating() -> None:
    # GradScaler without its parentheses: its scale() is callable, but not with a loss (probe 71C).
    with pytest.raises(
        TypeError,
        match=r"^scaler must be a torch\.amp\.GradScaler .* got type <class 'torch\.amp.*: give an instance",
    ):
        koila.accumulate(scaler=torch.amp.GradScaler)
    koila.accumulate(scaler=torch.amp.GradScaler("cpu"))


class _Scaler:
    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss


def test_backward_with_a_scaler_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"engine's backward does its own loss scaling .* pass one of them"):
        koila.accumulate(backward=lambda loss, **kwargs: loss.backward(**kwargs), scaler=_Scaler())


def backward_of_the_edge(loss: torch.Tensor, **kwargs: Any) -> None:
    """An engine that starts its backward from the loss's gradient edge, which no torch function sees."""
    edge = torch.autograd.graph.get_gradient_edge(loss)
    torch.autograd.backward(edge, grad_tensors=torch.ones((), dtype=loss.dtype), **kwargs)  # type: ignore[arg-type]


def test_an_engine_backward_that_koila_cannot_see_start_is_refused_before_it_writes() -> None:
    # Unseen, it wrote .grad directly: a micro-batch that failed after it left its gradient there, and
    # a retry added the step's again (1.4 to 2.2 times the gradient), or a give-up left it in .grad.
    model = make_model()
    x, y = batch()
    before = [torch.ones_like(p) for p in model.parameters()]
    for parameter, gradient in zip(model.parameters(), before, strict=True):
        parameter.grad = gradient.clone()
    calls = [0]

    @koila.accumulate(initial=64, backward=backward_of_the_edge, cache=koila.NoCache())
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return F.mse_loss(model(x), y)

    with pytest.raises(RuntimeError, match="GradientEdge"):
        step(x, y)
    assert calls == [1], "refused in the first micro-batch's backward, whatever memory there is"
    for parameter, gradient in zip(model.parameters(), before, strict=True):
        assert torch.equal(parameter.grad, gradient)


@pytest.mark.parametrize("gives_up", [False, True])
def test_a_grad_scaler_that_ran_out_of_memory_making_its_state_makes_it_again(gives_up: bool) -> None:
    # GradScaler makes its scale, then its growth tracker, at its first scale(): an out-of-memory error
    # between the two left a scale without a tracker, which no later scale() made, and scaler.step()
    # asserted, after a call that succeeded or after the next batch's (probe 77I).
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    scaler = torch.amp.GradScaler("cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    @koila.accumulate(cache=koila.NoCache(), scaler=scaler, minimum=64 if gives_up else 1)
    def step(x: torch.Tensor) -> torch.Tensor:
        return model(x).norm()  # keeps only its output and the loss: the scaler's 8 bytes decide

    batch, next_batch = torch.randn(64, 8), torch.randn(8, 8)
    with simulated_device(264):  # the output of 64 rows, the loss and a scale fit; the tracker does not
        if gives_up:
            with pytest.raises(koila.BatchSizeExhausted):
                step(batch)
            step(next_batch)  # the loop's next batch
        else:
            step(batch)
            assert step.stats.batch_size < 64
    assert scaler._growth_tracker is not None
    scaler.step(optimizer)
    scaler.update()


def test_an_engine_that_takes_no_retain_graph_is_refused_saying_why_where_it_needs_it() -> None:
    # An argument that carries a graph from before the call needs retain_graph=True on each backward: a
    # backward= that takes only the loss failed with Python's "unexpected keyword argument" (probe 77I).
    torch.manual_seed(0)
    encoder, head = nn.Linear(4, 4).double(), nn.Linear(4, 1).double()
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64)

    @koila.accumulate(backward=lambda loss: loss.backward(), cache=koila.NoCache())
    def step(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(head(h), y)

    step(encoder(x).detach(), y)  # no graph before the call: the loss alone
    before = [parameter.grad.clone() for parameter in head.parameters()]
    with pytest.raises(TypeError, match=r"takes no retain_graph: an argument of this call carries a graph"):
        step(encoder(x), y)
    assert all(torch.equal(p.grad, was) for p, was in zip(head.parameters(), before, strict=True))
    assert all(p.grad is None for p in encoder.parameters())
