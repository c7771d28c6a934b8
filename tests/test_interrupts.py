"""An interrupt (Ctrl-C), or an error, anywhere in a step: the step's state is let go, and nothing lasts past it.

A ``KeyboardInterrupt`` is raised where Python runs a signal handler: as a Python function begins.
``sys.settrace`` raises it at the n-th such point of a step, for every n the step reaches.
"""

from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from torch.nn import functional as F

import koila_retry as koila
from koila_retry._estimation.auto import _Memo
from koila_retry._frontends import own_backward
from koila_retry._frontends.in_flight import IN_FLIGHT, InFlight
from koila_retry.testing import oom_above

_GENERATOR = 0x20  # inspect.CO_GENERATOR: a generator resumed to close it cannot raise (unraisable)


def _interrupted_at(point: int, call: Callable[[], Any], at: str = "call", only: tuple[str, ...] = ("",)) -> bool:
    """Run ``call`` with a KeyboardInterrupt raised as its ``point``-th Python function begins (or returns: ``at``).

    ``only``: count the functions of files whose path starts with one of these alone.
    """
    seen = 0

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal seen
        if frame.f_code.co_flags & _GENERATOR or not frame.f_code.co_filename.startswith(only):
            return None
        if event == at:
            seen += 1
            if seen == point:
                sys.settrace(None)
                raise KeyboardInterrupt
        return trace if at == "return" else None  # a function's return is seen by its frame's own tracer

    sys.settrace(trace)
    try:
        call()
    except KeyboardInterrupt:
        return True
    finally:
        sys.settrace(None)
    return False


def _points() -> Iterator[int]:
    point = 0
    while True:
        point += 1
        yield point


@pytest.mark.parametrize("size", [None, 4], ids=["whole", "split"])
@pytest.mark.parametrize("before", [False, True], ids=["grad-none", "grad-present"])
@pytest.mark.parametrize("at", ["call", "return"])  # as a function returns: after an add in place into .grad
def test_an_interrupt_anywhere_in_a_step_leaves_grad_whole_and_nothing_held(
    size: int | None, before: bool, at: str
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2).double()
    x, y = torch.randn(16, 8, dtype=torch.float64), torch.randn(16, 2, dtype=torch.float64)
    step = koila.accumulate(lambda x, y: F.mse_loss(model(x), y), initial=size)
    F.mse_loss(model(x), y).backward()
    full = [parameter.grad.clone() for parameter in model.parameters()]  # type: ignore[union-attr]
    # A collection in the sweep could run another test's weak-reference callbacks (Dynamo's), where an
    # interrupt is unraisable: collected before, and off during it.
    gc.collect()
    gc.disable()
    try:
        interrupted = _sweep(model, x, y, step, full, before, at)
    finally:
        gc.enable()
    assert interrupted > 20, "the sweep reached the step's insides"


@pytest.mark.parametrize("size", [None, 4], ids=["whole", "split"])
def test_an_interrupt_anywhere_in_a_step_with_backward_leaves_later_backwards_free(size: int | None) -> None:
    # backward= (a training engine's): an interrupt as the step's flag was put back left it set, and every
    # later backward of the thread refused, for good. In koila's functions and the test's alone: one inside
    # torch's own handling of a function mode (torch.overrides) breaks its mode stack, which is PyTorch's.
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2).double()
    x, y = torch.randn(16, 8, dtype=torch.float64), torch.randn(16, 2, dtype=torch.float64)
    step = koila.accumulate(lambda x, y: F.mse_loss(model(x), y), initial=size, backward=lambda loss: loss.backward())
    F.mse_loss(model(x), y).backward()
    full = [parameter.grad.clone() for parameter in model.parameters()]  # type: ignore[union-attr]
    gc.collect()
    gc.disable()
    try:
        interrupted = _sweep(model, x, y, step, full, False, "call", (str(Path(koila.__file__).parent), __file__))
    finally:
        gc.enable()
    assert interrupted > 20, "the sweep reached the step's insides"
    model.zero_grad(set_to_none=True)
    F.mse_loss(model(x), y).backward()  # refused if the flag was left set
    for parameter, grad in zip(model.parameters(), full, strict=True):
        torch.testing.assert_close(parameter.grad, grad)


@pytest.mark.parametrize("at", ["call", "return"])
def test_an_interrupt_as_a_sparse_grad_is_given_back_leaves_grad_mode_on(at: str) -> None:
    # A sparse .grad is added into with grad mode off: an interrupt in torch.no_grad()'s own Python left it
    # off for good, and every later step of accumulate ran no backward.
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(50, 4, sparse=True).double()
    ids, y = torch.randint(0, 50, (16, 3)), torch.randn(16, 3, 4, dtype=torch.float64)
    step = koila.accumulate(lambda ids, y: (embedding(ids) - y).pow(2).mean(), cache=koila.NoCache())
    indices, values = torch.tensor([[1, 2]]), torch.ones(2, 4, dtype=torch.float64)
    gc.collect()
    gc.disable()  # as above
    try:
        for point in _points():
            embedding.weight.grad = torch.sparse_coo_tensor(indices, values, (50, 4), check_invariants=True).coalesce()
            stopped = _interrupted_at(point, lambda: step(ids, y), at)
            assert torch.is_grad_enabled(), f"grad mode left off at point {point}"
            if not stopped:
                break
    finally:
        gc.enable()
    assert point > 20, "the sweep reached the step's insides"


def _sweep(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    step: Any,
    full: Any,
    before: bool,
    at: str,
    only: tuple[str, ...] = ("",),
) -> int:
    interrupted = 0
    for point in _points():
        for parameter in model.parameters():
            parameter.grad = torch.ones_like(parameter) if before else None
        given = [None if parameter.grad is None else parameter.grad.clone() for parameter in model.parameters()]
        stopped = _interrupted_at(point, lambda: step(x, y), at, only)
        # Held leaves would send every later step of the model down the captured path, and make
        # another thread's step wait for them forever.
        assert (IN_FLIGHT.owners, IN_FLIGHT.shared, IN_FLIGHT.held) == ({}, {}, {}), f"held at point {point}"
        assert torch.is_grad_enabled(), f"grad mode left off at point {point}"
        # A flag left set refuses every later backward of the thread; a hook left in the list holds its step.
        thread = own_backward.THREAD
        assert (thread.step, thread.engine, own_backward.BACKWARDS) == (None, False, []), f"left at point {point}"
        got = [parameter.grad for parameter in model.parameters()]
        whole = [g if b is None else b + g for b, g in zip(given, full, strict=True)]
        if all(isinstance(g, torch.Tensor) and torch.allclose(g, w) for g, w in zip(got, whole, strict=True)):
            pass  # the step's gradients, all of them: given before the interrupt came
        else:
            assert stopped, f"a step that ended gave another gradient (point {point})"
            # Rolled back whole: as the step found it.
            for g, b in zip(got, given, strict=True):
                assert (g is None) == (b is None), f"mixed at point {point}"
                assert g is None or torch.equal(g, b), f"mixed at point {point}"
        interrupted += stopped
        if not stopped:
            break
    return interrupted


def test_a_step_interrupted_as_it_took_its_leaves_lets_another_threads_step_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The interrupt lands after the registry gave the leaves, before the step noted them."""
    model = torch.nn.Linear(8, 2).double()
    x, y = torch.randn(16, 8, dtype=torch.float64), torch.randn(16, 2, dtype=torch.float64)
    step = koila.accumulate(lambda x, y: F.mse_loss(model(x), y))
    take = InFlight.take

    def taken_then_interrupted(self: InFlight, owner: Any, keys: Any) -> bool:
        take(self, owner, keys)
        raise KeyboardInterrupt

    monkeypatch.setattr(InFlight, "take", taken_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        step(x, y)
    monkeypatch.undo()
    assert (IN_FLIGHT.owners, IN_FLIGHT.held) == ({}, {})
    _another_thread_steps_exactly(model, lambda: step(x, y), lambda: F.mse_loss(model(x), y))


def _another_thread_steps_exactly(
    model: torch.nn.Module, step: Callable[[], Any], loss: Callable[[], torch.Tensor]
) -> None:
    """Run ``step`` in another thread: it must end (no leaf held for good) with the gradient of ``loss``."""
    model.zero_grad(set_to_none=True)
    other = threading.Thread(target=step, daemon=True)
    other.start()
    other.join(60)
    assert not other.is_alive(), "another thread's step waits for leaves no step holds"
    expected = torch.autograd.grad(loss(), list(model.parameters()))
    for parameter, gradient in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(parameter.grad, gradient)


class _Holder:
    def __init__(self, thread: int) -> None:
        self.thread = thread


def test_a_release_lets_go_of_exactly_what_its_holder_holds() -> None:
    registry = InFlight()
    first, second = _Holder(1), _Holder(2)
    assert registry.take(first, [1, 2])
    assert registry.take(first, [2, 3])  # held already: counted once
    assert registry.take(second, [4])
    assert not registry.take(second, [3])  # the first's
    registry.release(first)
    assert registry.owners == {4: second}
    assert registry.held == {second: 1}
    registry.release(first)  # twice: nothing more
    registry.release(second)
    assert (registry.owners, registry.held) == ({}, {})


def test_an_error_as_a_step_hands_its_gradients_back_lets_another_threads_step_run() -> None:
    """A .grad that cannot be added into (an expanded one): the step raises as a plain backward does."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    step = koila.accumulate(lambda x, y: F.cross_entropy(model(x), y))
    expanded = torch.zeros(1, 1).expand(3, 4)
    model.weight.grad = expanded
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        step(x, y)
    assert (IN_FLIGHT.owners, IN_FLIGHT.shared, IN_FLIGHT.held) == ({}, {}, {})
    assert model.weight.grad is expanded, "the .grad the step could not add into is as it was"
    _another_thread_steps_exactly(model, lambda: step(x, y), lambda: F.cross_entropy(model(x), y))


def test_two_interrupts_in_a_row_in_the_hand_over_let_go_of_the_leaves(monkeypatch: pytest.MonkeyPatch) -> None:
    # Ctrl-C as the step gives a set-aside gradient back, and again in its clean-up's restore: the leaves
    # stayed held, and another thread's step of the model waited for them for ever.
    from koila_retry._frontends import gradients

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2).double()
    x, y = torch.randn(16, 8, dtype=torch.float64), torch.randn(16, 2, dtype=torch.float64)
    step = koila.accumulate(lambda x, y: F.mse_loss(model(x), y))
    real, calls = gradients.summed, [0]

    def summed(before: torch.Tensor, written: torch.Tensor | None) -> torch.Tensor:
        calls[0] += 1
        if calls[0] <= 2:
            raise KeyboardInterrupt
        return real(before, written)

    monkeypatch.setattr(gradients, "summed", summed)
    for parameter in model.parameters():
        parameter.grad = torch.ones_like(parameter)
    with pytest.raises(KeyboardInterrupt):
        step(x, y)
    assert calls[0] == 2
    assert not IN_FLIGHT.owners
    assert not IN_FLIGHT.held
    monkeypatch.undo()
    model.zero_grad()
    other = threading.Thread(target=step, args=(x, y), daemon=True)
    other.start()
    other.join(60)
    assert not other.is_alive()


def test_a_leaf_that_cannot_take_its_gradient_back_lets_go_all_the_same() -> None:
    # The step cast its parameters (a lazy cast): neither the sum nor the float64 gradient set aside
    # fits them now. The first error is raised, and nothing stays held.
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2).double()
    x, y = torch.randn(16, 8), torch.randn(16, 2)

    def loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for parameter in model.parameters():
            parameter.data = parameter.data.float()
        return F.mse_loss(model(x), y)

    for parameter in model.parameters():
        parameter.grad = torch.ones_like(parameter)
    with pytest.raises(RuntimeError, match="dtype"):
        koila.accumulate(loss)(x, y)
    assert not IN_FLIGHT.owners
    assert not IN_FLIGHT.held
    model.zero_grad()
    koila.accumulate(loss)(x, y)  # the next step runs, and writes its gradient
    assert all(parameter.grad is not None for parameter in model.parameters())


def test_an_interrupt_as_the_first_auto_estimate_is_registered_leaves_later_calls_free() -> None:
    # A Ctrl-C right after the "being made" event was registered, as the lock was let go, escaped before the
    # try that sets it: every later call of the step waited on it for ever (probe 75E).
    model = torch.nn.Linear(4, 2)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    step = koila.accumulate(lambda x, y: F.mse_loss(model(x), y), initial="auto")
    code = _Memo.estimates_of.__code__
    raised = []

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code is not code:
            return None

        def local(frame: FrameType, event: str, arg: Any) -> Any:
            memo, key = frame.f_locals["self"], frame.f_locals["key"]
            if event == "line" and not raised and key in memo.making:  # the first line after registering it
                raised.append(frame.f_lineno)
                raise KeyboardInterrupt
            return local

        return local

    sys.settrace(trace)
    try:
        with pytest.raises(KeyboardInterrupt):
            step(x, y)
    finally:
        sys.settrace(None)
    assert raised
    done = threading.Thread(target=step, args=(x, y), daemon=True)
    done.start()
    done.join(120)  # a hang, not a time: it waits for ever without the fix
    assert not done.is_alive()


class _Interrupting(dict[Any, Any]):
    """The memo's estimates being made, whose second look-up from the main thread is interrupted (a Ctrl-C)."""

    calls = 0

    def get(self, *args: Any) -> Any:
        found = super().get(*args)
        if threading.current_thread() is threading.main_thread():
            _Interrupting.calls += 1
            if _Interrupting.calls == 2:  # the one in the finally, after the estimate was made
                raise KeyboardInterrupt
        return found


def test_an_interrupt_as_an_auto_estimate_is_let_go_of_leaves_waiting_threads_free() -> None:
    # The event was set after the look-up that removes it: interrupted there, a thread already waiting for
    # the estimate waited for ever (probe 75H).
    cache = koila.StackMemoryCache()
    memo = _Memo(keep=True)
    memo.making = _Interrupting()
    cache.derived["auto"] = memo
    model = torch.nn.Linear(4, 2)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    asked, results = threading.Event(), []

    def waiting() -> None:
        asked.set()
        results.append(float(step(x, y)))

    waiter = threading.Thread(target=waiting, daemon=True)

    def loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if x.is_meta and not waiter.is_alive() and not results:  # another thread asks while the estimate runs
            waiter.start()
            asked.wait()
        return F.mse_loss(model(x), y)

    step = koila.accumulate(loss, initial="auto", cache=cache)
    with pytest.raises(KeyboardInterrupt):
        step(x, y)
    waiter.join(120)  # a hang, not a time: it waits for ever without the fix
    assert not waiter.is_alive()
    assert results


def _interrupted_after(function: str, call: str, when: Callable[[FrameType], bool] = lambda frame: True) -> Any:
    """A profile function that raises KeyboardInterrupt once, as a Ctrl-C would, as ``call`` returns to ``function``."""

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        named = event == "c_return" and frame.f_code.co_name == function and getattr(arg, "__name__", "") == call
        if named and when(frame):
            sys.setprofile(None)
            raise KeyboardInterrupt

    return profile


def test_a_ctrl_c_while_an_estimate_lends_the_model_leaves_it_its_own_tensors() -> None:
    # The proxy of an owner's parameters was set before its record: interrupted in between, the loan's end
    # put nothing back, and the model kept meta parameters in this thread for good (probe 77D).
    torch.manual_seed(0)
    model, x = torch.nn.Linear(4, 2), torch.randn(16, 4)
    weight = model.weight
    sys.setprofile(_interrupted_after("lend", "append", lambda frame: frame.f_locals.get("name") == "_parameters"))
    try:
        with pytest.raises(KeyboardInterrupt):
            koila.chunked(model, x, initial="auto", cache=koila.NoCache())
    finally:
        sys.setprofile(None)
    assert type(vars(model)["_parameters"]) is dict
    assert model.weight is weight
    assert torch.equal(koila.chunked(model, x, initial="auto", cache=koila.NoCache()), model(x))


def test_a_ctrl_c_while_a_batch_is_put_back_leaves_it_whole() -> None:
    # The dict was cleared and then refilled, two calls: interrupted in between, the caller's batch was empty.
    model, fits = torch.nn.Linear(4, 2), oom_above(4)

    @koila.accumulate(cache=koila.NoCache())
    def step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        labels = batch.pop("labels")
        fits(len(labels))
        return F.cross_entropy(model(batch["x"]), labels)

    batch = {"x": torch.randn(8, 4), "labels": torch.randint(0, 2, (8,))}
    sys.setprofile(_interrupted_after("_put_back_mapping", "clear"))
    try:
        with pytest.raises(KeyboardInterrupt):
            step(batch)
    finally:
        sys.setprofile(None)
    assert list(batch) == ["x", "labels"]
