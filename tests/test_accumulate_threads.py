"""koila.accumulate with threads that share one model: each step's gradient is added once, whole, into ``.grad``.

Four threads train one model at once, each running a step over its own batch that runs out
of memory once part-way through. Plain concurrent ``loss.backward()`` on one model adds
every batch's gradient into ``.grad`` (autograd locks each leaf while it adds), so after
the threads are joined ``.grad`` holds the sum of the four batches' gradients; the steps
must leave the same, however their micro-batches and failures interleave.
"""

from __future__ import annotations

import copy
import threading
import warnings
from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
from _layers import OOMInBackward, Recompute, WatchFreed
from torch import nn
from torch.nn import functional as F

import koila_retry as koila
from koila_retry._frontends.gradients import EARLY_BYTES as _EARLY_BYTES
from koila_retry._frontends.gradients import Gradients as _Gradients
from koila_retry._frontends.in_flight import InFlight as _InFlight
from koila_retry.testing import make_oom, simulated_device

DTYPE = torch.float64
RTOL, ATOL = 1e-7, 1e-10
THREADS, ROWS, TRIALS = 4, 64, 5  # the code before failed every variant on its first trial


def _data(n: int, *shape: int, seed: int) -> torch.Tensor:
    return torch.randn(n, *shape, generator=torch.Generator().manual_seed(seed), dtype=DTYPE)


def _model() -> nn.Module:
    # The middle weight's gradient (128 KiB) is added into the step's as autograd computes it; the
    # others' (under 64 KiB) at the end of their micro-batch's backward: both ways are exercised.
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 1)).to(DTYPE)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(_data(ROWS, 16, seed=2 * i), _data(ROWS, 1, seed=2 * i + 1)) for i in range(THREADS)]


def _plain_gradients(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """The sum of the batches' full-batch gradients, one plain backward each, on one thread."""
    model.zero_grad(set_to_none=True)
    for x, y in batches:
        F.mse_loss(model(x), y).backward()
    sums = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)
    return sums


def _give_grads(model: nn.Module) -> list[torch.Tensor]:
    """Set nonzero gradients on every parameter; return each as it is, the tensor object itself."""
    for i, p in enumerate(model.parameters()):
        p.grad = torch.full_like(p, 0.5) + _data(p.numel(), seed=100 + i).view_as(p)
    return [p.grad for p in model.parameters()]  # type: ignore[misc]


def _run_together(work: Callable[[int], None]) -> None:
    """Run ``work(number)`` in ``THREADS`` threads released by one barrier; re-raise what one raised."""
    barrier = threading.Barrier(THREADS)
    errors: list[BaseException] = []

    def worker(number: int) -> None:
        barrier.wait()
        try:
            work(number)
        except BaseException as exc:  # pragma: no cover - only on failure
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(number,)) for number in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


class _OncePerThread:
    """Runs out of memory once in each thread, on the thread's ``fail_on``-th call (from 1), in forward or backward."""

    def __init__(self, where: str, fail_on: int = 2) -> None:
        self.where, self.fail_on = where, fail_on
        self.local = threading.local()

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        calls = getattr(self.local, "calls", 0) + 1
        self.local.calls = calls
        if calls != self.fail_on:
            return h
        if self.where == "forward":
            raise make_oom()
        return OOMInBackward.apply(h)  # its backward runs after the head's gradients were computed


def _engine(loss: torch.Tensor, **options: Any) -> None:
    """A training engine's ``backward=``, as accelerate's calls ``torch.autograd.backward``."""
    torch.autograd.backward(loss, **options)


def _step(model: nn.Module, fail: _OncePerThread, engine: bool = False) -> Any:
    backward = {"backward": _engine} if engine else {}

    # NoCache: no thread starts at a size another thread found, so every step fails once.
    @koila.accumulate(initial=ROWS // 2, cache=koila.NoCache(), **backward)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = model[:2](x)
        return F.mse_loss(model[2:](fail(h)), y)

    return step


@pytest.mark.usefixtures("frequent_switches")
@pytest.mark.parametrize(
    ("before", "where", "shared", "engine"),
    [
        *(
            pytest.param(
                before,
                where,
                shared,
                False,
                id=f"{'grads-before' if before else 'no-grads-before'}-{where}-"
                f"{'one-decorated-function' if shared else 'one-per-thread'}",
            )
            for before in (False, True)
            for where in ("forward", "backward")
            for shared in (True, False)
        ),
        # An engine's backward=, direct as a plain one, where the threads meet.
        pytest.param(True, "backward", True, True, id="grads-before-backward-one-decorated-function-engine"),
    ],
)
def test_threads_sharing_a_model_leave_the_sum_of_their_batches_gradients(
    shared: bool, where: str, before: bool, engine: bool
) -> None:
    model, batches = _model(), _batches()
    expected = _plain_gradients(model, batches)
    for trial in range(TRIALS):
        model.zero_grad(set_to_none=True)
        given = _give_grads(model) if before else [None] * len(expected)
        values = [None if g is None else g.clone() for g in given]
        fail = _OncePerThread(where)
        if shared:
            steps = [_step(model, fail, engine)] * THREADS
        else:
            steps = [_step(model, fail, engine) for _ in range(THREADS)]

        def work(number: int, steps: list[Any] = steps) -> None:
            steps[number](*batches[number])

        _run_together(work)
        assert sum(step.stats.ooms for step in set(steps)) == THREADS, "each step ran out of memory once"
        for (name, p), want, grad, value in zip(model.named_parameters(), expected, given, values, strict=True):
            assert p.grad is not None, name
            if grad is not None:
                assert p.grad is grad, f"{name}: the gradient from before is the same tensor, added to in place"
                want = want + value
            torch.testing.assert_close(
                p.grad, want, rtol=RTOL, atol=ATOL, msg=lambda m, name=name, trial=trial: f"trial {trial}, {name}: {m}"
            )


@pytest.mark.usefixtures("frequent_switches")
def test_threads_sharing_a_model_with_a_tensor_hook_apply_it_once_per_backward() -> None:
    model, batches = _model(), _batches()
    expected = _plain_gradients(model, batches)
    model[0].weight.register_hook(lambda grad: grad * 10)
    expected[0] = expected[0] * 10  # as a plain backward gives, with the hook
    for trial in range(TRIALS // 2):
        model.zero_grad(set_to_none=True)
        fail = _OncePerThread("backward")
        step = _step(model, fail)
        _run_together(lambda number, step=step: step(*batches[number]))
        assert step.stats.ooms == THREADS
        for (name, p), want in zip(model.named_parameters(), expected, strict=True):
            torch.testing.assert_close(
                p.grad, want, rtol=RTOL, atol=ATOL, msg=lambda m, name=name, trial=trial: f"trial {trial}, {name}: {m}"
            )


# --------------------------------------------------------------------------- where the step's gradients live


def _snapshot(model: nn.Module) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
    return [(p.grad, None if p.grad is None else p.grad.clone()) for p in model.parameters()]


def _unchanged(model: nn.Module, snapshot: list[tuple[torch.Tensor | None, torch.Tensor | None]]) -> bool:
    return all(
        p.grad is grad and (value is None or torch.equal(p.grad, value))
        for p, (grad, value) in zip(model.parameters(), snapshot, strict=True)
    )


@pytest.mark.parametrize("path", ["captured", "direct"])
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_grad_is_untouched_while_the_step_runs_and_after_an_oom(where: str, path: str) -> None:
    """Captured, nothing of the step is in ``.grad`` before it succeeded: between micro-batches, after a failure.

    Direct (a plain backward, nothing else in flight), the step writes ``.grad`` as a hand
    loop does, the gradients from before set aside: after it, the same tensors, added to.
    """
    model, ((x, y), *_) = _model(), _batches()
    expected = _plain_gradients(model, [(x, y)])
    given = _give_grads(model)
    model[4].bias.grad = None  # one with no gradient before
    snapshot = _snapshot(model)
    fail = _OncePerThread(where)
    untouched: list[bool] = []
    if path == "captured":  # a post-accumulate-grad hook runs once per step: at the delivery
        model[0].weight.register_post_accumulate_grad_hook(lambda parameter: None)

    @koila.accumulate(initial=16, cache=koila.NoCache())
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        untouched.append(_unchanged(model, snapshot))
        return F.mse_loss(model[2:](fail(model[:2](x))), y)

    step(x, y)
    assert step.stats.ooms == 1
    if path == "captured":
        assert untouched == [True] * (2 + ROWS // 8), "at every forward of both attempts"
    else:
        assert untouched[0], "before the first backward"
    for p, grad, value, want in zip(model.parameters(), given, [v for _, v in snapshot], expected, strict=True):
        if p is model[4].bias:
            torch.testing.assert_close(p.grad, want, rtol=RTOL, atol=ATOL)
        else:
            assert p.grad is grad
            torch.testing.assert_close(p.grad, value + want, rtol=RTOL, atol=ATOL)


def test_a_step_that_gives_up_leaves_grad_as_it_was() -> None:
    model, ((x, y), *_) = _model(), _batches()
    _give_grads(model)
    model[4].bias.grad = None
    snapshot = _snapshot(model)
    calls: list[int] = []

    @koila.accumulate(initial=16, minimum=8, cache=koila.NoCache())
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls.append(len(x))
        h = model[:2](x)
        if len(calls) in (2, 4):  # the second micro-batch of each attempt, once the first's gradients exist
            h = OOMInBackward.apply(h)
        return F.mse_loss(model[2:](h), y)

    with pytest.raises(koila.BatchSizeExhausted):
        step(x, y)
    assert calls == [16, 16, 8, 8]
    assert _unchanged(model, snapshot)


def _backward(loss: torch.Tensor, retain: bool) -> None:
    loss.backward(retain_graph=retain)  # type: ignore[no-untyped-call]


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_delivery_hands_over_the_step_gradient_when_grad_is_none(micro_batches: int) -> None:
    model, ((x, y), *_) = _model(), _batches()
    expected = _plain_gradients(model, [(x, y)])
    gradients = _Gradients()
    for xb, yb in zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True):
        gradients.backward(_backward, F.mse_loss(model(xb), yb) * len(xb) / len(x), False)
    assert all(p.grad is None for p in model.parameters()), "nothing in .grad before the delivery"
    addresses = [gradients.sums[id(p)].data_ptr() for p in model.parameters()]
    gradients.deliver()
    assert gradients.sums == {}
    assert [p.grad.data_ptr() for p in model.parameters()] == addresses, "the sums themselves, not copies"  # type: ignore[union-attr]
    for p, want in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, want, rtol=RTOL, atol=ATOL)


def test_delivery_adds_into_an_existing_grad_in_place() -> None:
    model, ((x, y), *_) = _model(), _batches()
    expected = _plain_gradients(model, [(x, y)])
    given = _give_grads(model)
    values = [g.clone() for g in given]
    gradients = _Gradients()
    gradients.backward(_backward, F.mse_loss(model(x), y), False)
    assert all(p.grad is g for p, g in zip(model.parameters(), given, strict=True))
    gradients.deliver()
    for p, grad, value, want in zip(model.parameters(), given, values, expected, strict=True):
        assert p.grad is grad
        torch.testing.assert_close(p.grad, value + want, rtol=RTOL, atol=ATOL)


def test_discarded_gradients_never_reach_grad() -> None:
    model, ((x, y), *_) = _model(), _batches()
    gradients = _Gradients()
    gradients.backward(_backward, F.mse_loss(model(x), y), False)
    gradients.discard()
    gradients.deliver()
    assert all(p.grad is None for p in model.parameters())


# --------------------------------------------------------------------------- hooks


@pytest.mark.parametrize("before", [False, True], ids=["no-grads-before", "grads-before"])
@pytest.mark.parametrize(("initial", "fail"), [(None, None), (16, None), (16, "backward"), (16, "forward")])
def test_a_tensor_hook_on_a_parameter_applies_once(initial: int | None, fail: str | None, before: bool) -> None:
    """A linear hook (times 10) gives ten times the gradient, split or not: never applied twice."""
    model, ((x, y), *_) = _model(), _batches()
    expected = _plain_gradients(model, [(x, y)])
    hooked = model[2].weight
    hooked.register_hook(lambda grad: grad * 10)
    given = _give_grads(model) if before else [None] * len(expected)
    values = [None if g is None else g.clone() for g in given]
    failing = _OncePerThread(fail) if fail is not None else (lambda h: h)

    @koila.accumulate(initial=initial, cache=koila.NoCache())
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model[2:](failing(model[:2](x))), y)

    step(x, y)
    assert step.stats.ooms == (fail is not None)
    for p, grad, value, want in zip(model.parameters(), given, values, expected, strict=True):
        want = want * 10 if p is hooked else want
        if grad is not None:
            assert p.grad is grad
            want = value + want
        torch.testing.assert_close(p.grad, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(("initial", "fail"), [(None, None), (16, None), (16, "backward")])
def test_post_accumulate_grad_hooks_run_once_per_step(initial: int | None, fail: str | None) -> None:
    model, ((x, y), *_) = _model(), _batches()
    expected = _plain_gradients(model, [(x, y)])
    seen: dict[int, list[torch.Tensor]] = {id(p): [] for p in model.parameters()}
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: seen[id(p)].append(p.grad.clone()))  # type: ignore[union-attr]
    failing = _OncePerThread(fail) if fail is not None else (lambda h: h)

    @koila.accumulate(initial=initial, cache=koila.NoCache())
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model[2:](failing(model[:2](x))), y)

    for call in range(2):
        step(x, y)
        for p, want in zip(model.parameters(), expected, strict=True):
            assert len(seen[id(p)]) == call + 1, "once per step"
            torch.testing.assert_close(seen[id(p)][-1], (call + 1) * want, rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------- backward passes autograd.grad cannot run


@pytest.mark.parametrize("where", ["every", "second"], ids=["every-micro-batch", "second-micro-batch-only"])
def test_reentrant_checkpoint_stays_exact_with_hooks_and_an_oom(where: str) -> None:
    """A reentrant checkpoint's backward writes .grad itself; the step's gradient is still added once."""
    model, ((x, y), *_) = _model(), _batches()
    expected = _plain_gradients(model, [(x, y)])
    model[2].weight.register_hook(lambda grad: grad * 10)
    expected[2] = expected[2] * 10
    given = _give_grads(model)
    values = [g.clone() for g in given]
    calls: list[int] = []

    @koila.accumulate(initial=16, cache=koila.NoCache())
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls.append(len(x))
        h = model[:2](x)
        if where == "every" or len(calls) % 2 == 0:
            h = torch.utils.checkpoint.checkpoint(model[2:4], h, use_reentrant=True)
        else:
            h = model[2:4](h)
        if len(calls) == 3:  # the third micro-batch's backward, after the checkpoint's wrote .grad
            h = OOMInBackward.apply(h)
        return F.mse_loss(model[4](h), y)

    step(x, y)
    assert calls == [16, 16, 16] + [8] * 8
    for p, grad, value, want in zip(model.parameters(), given, values, expected, strict=True):
        assert p.grad is grad
        torch.testing.assert_close(p.grad, value + want, rtol=RTOL, atol=ATOL)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True:UserWarning")
@pytest.mark.parametrize("engine", ["autograd-backward", "inputs", "create-graph"])
def test_an_engines_backward_is_captured_as_it_asks(engine: str) -> None:
    """``backward=`` may call ``torch.autograd.backward``, or ask for some ``inputs`` only, as a plain backward may."""
    model, ((x, y), *_) = _model(), _batches()
    expected = _plain_gradients(model, [(x, y)])
    first = model[0].weight
    given = _give_grads(model)
    values = [g.clone() for g in given]

    def backward(loss: torch.Tensor, **options: Any) -> None:
        if engine == "autograd-backward":
            torch.autograd.backward([loss / 2, loss / 2], **options)
        elif engine == "inputs":
            loss.backward(inputs=[first], **options)
        else:
            loss.backward(create_graph=True, **options)

    fail = _OncePerThread("backward")

    @koila.accumulate(initial=16, backward=backward, cache=koila.NoCache())
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model[2:](fail(model[:2](x))), y)

    step(x, y)
    assert step.stats.ooms == 1
    for p, grad, value, want in zip(model.parameters(), given, values, expected, strict=True):
        # With create_graph=True, autograd makes .grad anew, with its graph, as a plain backward does.
        assert p.grad.requires_grad if engine == "create-graph" else p.grad is grad
        if engine == "inputs" and p is not first:
            assert torch.equal(p.grad, value)
        else:
            torch.testing.assert_close(p.grad.detach(), value + want, rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------- memory


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "reentrant-checkpoint"])
@pytest.mark.parametrize("size", [256, 64])
def test_a_split_step_needs_no_more_memory_than_a_hand_written_accumulation(size: int, checkpointed: bool) -> None:
    """Each micro-batch's gradients are added into the step's as autograd computes them, not all held at once."""
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(512, 512), nn.Sequential(nn.ReLU(), nn.Linear(512, 512)))
    x, y = torch.randn(512, 512), torch.randn(512, 512)
    model, hand = copy.deepcopy(reference), copy.deepcopy(reference)

    def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if checkpointed:  # its backward writes .grad itself: the step's fallback
            return F.mse_loss(torch.utils.checkpoint.checkpoint(model[1], model[0](x), use_reentrant=True), y)
        return F.mse_loss(model(x), y)

    @koila.accumulate(initial=size, cache=koila.NoCache())
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return loss(model, x, y)

    with simulated_device("1GiB") as device:
        step(x, y)
    with simulated_device("1GiB") as by_hand:
        for xb, yb in zip(x.split(size), y.split(size), strict=True):
            (loss(hand, xb, yb) * len(xb) / len(x)).backward()
    # The step's losses, kept for its result, and the small gradients, held whole until the end of each backward.
    small = sum(p.numel() * p.element_size() for p in model.parameters() if p.numel() * p.element_size() < _EARLY_BYTES)
    assert device.peak <= by_hand.peak + 1024 + small
    for p, q in zip(model.parameters(), hand.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_the_registry_holds_leaves_for_one_step_at_a_time_and_lets_go_of_only_its_own() -> None:
    registry = _InFlight()
    first, second = _Gradients(direct=True), _Gradients(direct=True)
    assert registry.take(first, [1, 2])  # nothing in flight: held at once
    assert registry.owners == {1: first, 2: first}
    assert not registry.take(second, [2, 3])  # 2 is the first step's: none of them is taken
    assert registry.owners == {1: first, 2: first}
    assert registry.take(first, [1, 2])  # its own again
    assert registry.take(second, [3])
    registry.release(first)  # two steps in flight: only its own go
    assert registry.owners == {3: second}
    registry.release(second)
    assert registry.owners == {}
    registry.enter([4], threading.get_ident())  # a captured step delivering into 4
    assert not registry.take(first, [4])
    assert registry.owners == {}
    registry.leave([4])
    assert registry.take(first, [4])
    registry.release(first)
    assert registry.owners == {}
    assert registry.shared == {}
    assert registry.held == {}


class _Gate(torch.autograd.Function):
    """The identity, whose backward runs ``action`` first: it fixes when each thread's backward goes on."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, action: Callable[[], None]) -> torch.Tensor:
        ctx.action = action
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.action()
        return grad, None


@pytest.mark.parametrize("parameter", [False, True], ids=["plain tensor", "parameter"])
def test_two_steps_sharing_a_weight_a_node_writes_are_warned_of(parameter: bool) -> None:
    """A weight two threads' steps share, written by a recompute in a node, while the first step's attempt fails.

    The second step set the first's write aside as its own gradient from before, and the first's failure then
    dropped the second's: the two cannot share it. Of a weight that is a parameter it was warned; of a plain
    tensor it was not.
    """
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(6, 6), nn.Tanh()).double()
    if not parameter:  # plain tensor attributes, as older code has weights
        for name in ("weight", "bias"):
            tensor = getattr(block[0], name).detach().clone().requires_grad_()
            delattr(block[0], name)
            setattr(block[0], name, tensor)
        assert not list(block.parameters())
    stems = {name: nn.Linear(6, 6).double() for name in "ab"}
    heads = {name: nn.Linear(6, 1).double() for name in "ab"}
    wrote, second_wrote = threading.Event(), threading.Event()
    failed: list[int] = []

    def first_action() -> None:
        if not failed:
            failed.append(1)
            wrote.set()
            second_wrote.wait(30)
            raise make_oom()  # after the block's backward wrote the shared weight's .grad

    def second_action() -> None:
        second_wrote.set()

    def loss_of(name: str, x: torch.Tensor, y: torch.Tensor, action: Callable[[], None]) -> torch.Tensor:
        h = _Gate.apply(stems[name](x), action)  # its backward runs after the block's
        return F.mse_loss(heads[name](Recompute.apply(block, h)), y)

    first = koila.accumulate(lambda x, y: loss_of("a", x, y, first_action), initial=8, cache=koila.NoCache())
    second = koila.accumulate(lambda x, y: loss_of("b", x, y, second_action), initial=8, cache=koila.NoCache())
    xa, ya, xb, yb = _data(8, 6, seed=1), _data(8, 1, seed=2), _data(8, 6, seed=3), _data(8, 1, seed=4)
    caught: list[warnings.WarningMessage] = []

    def run_second() -> None:
        wrote.wait(30)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            second(xb, yb)
        caught.extend(record)

    thread = threading.Thread(target=run_second)
    thread.start()
    first(xa, ya)
    thread.join(60)
    assert not thread.is_alive()
    assert any("cannot all be found" in str(warning.message) for warning in caught), [str(w.message) for w in caught]


def test_a_failed_attempt_s_gradients_are_freed_after_every_grad_is_cleared() -> None:
    # Freed inside the .grad setter, one as each was cleared, they crashed another thread's step that read
    # .grad as it gave up (its diagnosis) within seconds (probe 75F: 3 runs of 3, a segmentation fault).
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(6)])
    above = list(model[1:].parameters())
    freed: list[bool] = []

    @koila.accumulate(initial=2, cache=koila.NoCache())
    def step(x: torch.Tensor) -> torch.Tensor:
        h = model[0](x)
        if len(x) == 2:
            h = WatchFreed.apply(h, above, freed)
        return cast(torch.Tensor, model[1:](h).sum())

    step(torch.randn(2, 4))
    assert len(freed) == len(above)
    assert all(freed)
