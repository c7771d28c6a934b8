"""koila.estimate while other threads use the same model: nothing they see of it changes (issue 27).

The estimate lends the thread that makes it meta copies of a model's tensors. Two kinds of
test: threads that run together many times (a race would show in some trial), and runs that
pause the estimate in the middle of its run, while it holds the model, for another thread to
use the model then (deterministic: they fail every time lending leaks).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import pickle
import subprocess
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from _layers import SelfHooked
from _turns import Turns
from torch import nn

import koila_retry as koila

# Seconds a thread waits for another: never reached when all is well, and it keeps a broken
# build from hanging the suite.
WAIT = 60
TRIALS = 10


# --------------------------------------------------------------------------- helpers


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 4))


def batchnorm() -> nn.Module:
    """Buffers that a forward in training writes: running statistics, num_batches_tracked."""
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4)).train()


def encoder() -> nn.Module:
    """In eval, the estimate gives it a forward of its own (the CPU's fused fast path) while it runs."""
    return nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()


class Recurrent(nn.Module):
    """An LSTM: it keeps its weights in a list too (``_flat_weights``), which it rebuilds when they change."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(16, 32, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "mlp": (mlp, (8, 16)),
    "batchnorm": (batchnorm, (8, 16)),
    "encoder": (encoder, (8, 5, 16)),
    "lstm": (Recurrent, (8, 5, 16)),
}


def made(name: str) -> tuple[nn.Module, torch.Tensor]:
    factory, shape = MODELS[name]
    torch.manual_seed(0)
    return factory(), torch.randn(shape)


class Held:
    """Every parameter, buffer and gradient of a model: by identity, device and value."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.tables = [(m, dict(m._parameters), dict(m._buffers)) for m in model.modules()]
        self.values = [(t, t.device, t.detach().clone()) for t in (*model.parameters(), *model.buffers())]
        self.grads = [(p, p.grad) for p in model.parameters()]

    def assert_unchanged(self) -> None:
        for module, parameters, buffers in self.tables:
            assert type(module._parameters) is dict
            assert type(module._buffers) is dict
            assert module._parameters.keys() == parameters.keys()
            assert all(module._parameters[key] is value for key, value in parameters.items())
            assert module._buffers.keys() == buffers.keys()
            assert all(module._buffers[key] is value for key, value in buffers.items())
        for tensor, device, value in self.values:
            assert tensor.device == device
            assert torch.equal(tensor, value)
        for parameter, grad in self.grads:
            assert parameter.grad is grad


def together(*workers: Callable[[], None]) -> list[BaseException]:
    """Run each worker in a thread of its own, all starting at once; return what they raised."""
    barrier = threading.Barrier(len(workers))
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run(worker: Callable[[], None]) -> None:
        try:
            barrier.wait(WAIT)
            worker()
        except BaseException as error:
            with lock:
                errors.append(error)

    threads = [threading.Thread(target=run, args=(worker,), daemon=True) for worker in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(4 * WAIT)
    assert not any(thread.is_alive() for thread in threads), "a thread hung"
    return errors


def figures(found: koila.MemoryEstimate) -> tuple[Any, ...]:
    """What an estimate says, all of it: equal for two estimates of one call."""
    return (
        found.sizes,
        found.measured,
        found.started,
        found.resident,
        found.notes,
        [(found.peak(n), found.phase(n), found.breakdown(n)) for n in (1, 8, 100, 4096)],
        found.module_peaks(8),
    )


class Pause:
    """A point in the estimate's run where it waits for another thread, once.

    The estimated call calls :meth:`here`; the first time it does, on the estimating thread,
    it sets ``reached`` and waits for ``resume``. Meanwhile, the estimate holds the model.
    """

    def __init__(self) -> None:
        self.armed = False
        self.reached = threading.Event()
        self.resume = threading.Event()

    def here(self) -> None:
        if self.armed:
            self.armed = False
            self.reached.set()
            assert self.resume.wait(WAIT), "the other thread never let the estimate go on"

    def after(self, model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        """Return a call of ``model`` that pauses here once its forward returned."""

        def call(rows: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = model(rows)
            self.here()
            return out

        return call

    @contextlib.contextmanager
    def during(self) -> Iterator[None]:
        """Wait until the estimate pauses, run the block, and let it go on (also if the block fails)."""
        assert self.reached.wait(WAIT), "the estimate never paused"
        try:
            yield
        finally:
            self.resume.set()


def estimating(
    pause: Pause, fn: Callable[..., Any], *args: Any, device: str | None = None
) -> tuple[Callable[[], None], list[Any]]:
    """Return a worker that estimates ``fn`` with the pause armed, and the list it puts the estimate in."""
    found: list[Any] = []

    def worker() -> None:
        pause.armed = True
        found.append(koila.estimate(fn, *args, device=device))

    return worker, found


# --------------------------------------------------------------------------- threads that run together


@pytest.mark.parametrize(("threads", "name"), [(2, "mlp"), (4, "mlp"), (4, "batchnorm"), (4, "encoder"), (4, "lstm")])
def test_threads_that_estimate_one_model_at_once_agree_and_leave_it_as_it_was(threads: int, name: str) -> None:
    model, x = made(name)
    held = Held(model)
    alone = figures(koila.estimate(model, x))
    for trial in range(TRIALS):
        found: list[tuple[Any, ...]] = []
        errors = together(*[lambda found=found: found.append(figures(koila.estimate(model, x)))] * threads)
        assert errors == [], f"trial {trial}"
        assert found == [alone] * threads, f"trial {trial}"
        held.assert_unchanged()


@pytest.mark.parametrize("name", ["mlp", "encoder"])
def test_concurrent_first_calls_of_one_auto_chunked_function(name: str) -> None:
    model, _ = made(name)
    x = torch.randn(64, *MODELS[name][1][1:])
    with torch.no_grad():
        expected = model.eval()(x)
    held = Held(model)
    runs_of_one_estimate = len(koila.estimate(model, x).sizes)
    for trial in range(TRIALS // 2):
        estimated: list[int] = []

        @koila.chunked(initial="auto")
        def encode(rows: torch.Tensor, estimated: list[int] = estimated) -> torch.Tensor:
            if rows.device.type == "meta":
                estimated.append(len(rows))
            with torch.no_grad():
                out: torch.Tensor = model(rows)
            return out

        results: list[torch.Tensor] = []
        errors = together(*[lambda results=results, encode=encode: results.append(encode(x))] * 4)
        assert errors == [], f"trial {trial}"
        assert len(results) == 4
        for result in results:
            torch.testing.assert_close(result, expected)
        held.assert_unchanged()
        assert len(estimated) == runs_of_one_estimate  # one thread estimated; the others waited for it


def test_inference_goes_on_while_another_thread_estimates_again_and_again() -> None:
    model, x = made("batchnorm")
    model.eval()
    with torch.no_grad():
        expected = model(x)
    finished = threading.Event()
    failures: list[str] = []
    inferred = 0

    def estimate() -> None:
        try:
            for _ in range(2 * TRIALS):
                koila.estimate(model, x)
        finally:
            finished.set()

    def infer() -> None:
        nonlocal inferred
        while not (finished.is_set() and inferred):
            try:
                with torch.no_grad():
                    out = model(x)
            except Exception as error:
                failures.append(repr(error))
                continue
            if not torch.equal(out, expected):
                failures.append("another output")
            inferred += 1

    assert together(estimate, infer) == []
    assert failures == []
    assert inferred > 0


def test_training_goes_on_while_another_thread_estimates_a_step_again_and_again() -> None:
    # The threads take turns only where the training assigns .grad (zero_grad), which PyTorch
    # does not make safe against the estimate reading it (tests/_turns.py): each estimate runs
    # against the training's forward and backward, whose AccumulateGrad sets .grad in C++.
    model, x = made("batchnorm")
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    turns = Turns()

    def step(rows: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        model(rows).square().mean().backward()
        optimizer.step()

    model(x).square().mean().backward()
    expected = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    finished = threading.Event()
    failures: list[str] = []
    trained = beside = 0

    def estimate() -> None:
        try:
            for _ in range(2 * TRIALS):
                with turns.estimating():
                    koila.estimate(step, x)
        finally:
            turns.end()
            finished.set()

    def train() -> None:
        nonlocal trained, beside
        while not (finished.is_set() and trained):
            with turns.writing():
                model.zero_grad(set_to_none=True)
            beside += turns.beside()
            try:
                model(x).square().mean().backward()
            except Exception as error:
                failures.append(repr(error))
                continue
            grads = [p.grad for p in model.parameters()]
            if not all(g is not None and torch.equal(g, e) for g, e in zip(grads, expected, strict=True)):
                failures.append("other gradients")
            trained += 1
        turns.finish()

    assert together(estimate, train) == []
    assert failures == []
    assert beside >= TRIALS, "the training ran beside no estimate: the test tests nothing"
    assert optimizer.state == {}  # the estimate's steps made their state on their own copies
    assert all(p is q for p, q in zip(optimizer.param_groups[0]["params"], model.parameters(), strict=True))


# --------------------------------------------------------------------------- while the estimate holds the model


# An estimate for the meta device runs PyTorch's own LSTM kernel, which reads the weights from
# the LSTM's list of them; one for the CPU runs a stand-in of oneDNN's.
@pytest.mark.parametrize(("name", "device"), [*((name, None) for name in MODELS), ("lstm", "meta")])
def test_inference_in_another_thread_while_the_estimate_holds_the_model(name: str, device: str | None) -> None:
    model, x = made(name)
    model.eval()
    with torch.no_grad():
        expected = model(x)
    pause = Pause()
    call = pause.after(model)

    alone = figures(koila.estimate(call, x, device=device))
    held = Held(model)
    seen: list[torch.Tensor] = []

    def infer() -> None:
        with pause.during(), torch.no_grad():
            seen.append(model(x))
        assert {t.device.type for t in (*model.parameters(), *model.buffers())} == {"cpu"}

    worker, found = estimating(pause, call, x, device=device)
    assert together(worker, infer) == []
    assert torch.equal(seen[0], expected)
    assert figures(found[0]) == alone
    held.assert_unchanged()


@pytest.mark.parametrize("name", list(MODELS))
def test_training_in_another_thread_while_the_estimate_holds_the_model(name: str) -> None:
    model, x = made(name)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(x).square().mean().backward()
    expected = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    pause = Pause()

    def step(rows: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = model(rows).square().mean()
        pause.here()  # the forward's activations alive, the parameters lent
        loss.backward()
        optimizer.step()

    alone = koila.estimate(step, x)
    parameters = [(p, p.detach().clone()) for p in model.parameters()]

    def train() -> None:
        with pause.during():
            model(x).square().mean().backward()

    worker, found = estimating(pause, step, x)
    assert together(worker, train) == []
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.equal(g, e) for g, e in zip(grads, expected, strict=True))
    assert all(torch.equal(p, value) and p.device.type == "cpu" for p, value in parameters)
    assert optimizer.state == {}
    # The run the other thread trained during counted what it held when it began; the next
    # run began with the gradients the other thread had made by then, and counted them.
    assert (found[0].started[8], found[0].measured[8]) == (alone.started[8], alone.measured[8])
    assert found[0].started[16] > alone.started[16]


def test_a_hook_another_thread_registers_while_the_estimate_runs_stays() -> None:
    model, x = made("mlp")
    pause = Pause()
    call = pause.after(model)

    calls: list[str] = []
    handles: list[Any] = []

    def register() -> None:
        with pause.during():
            handles.append(model.register_forward_hook(lambda *_: calls.append("model")))
            handles.append(model[0].register_forward_pre_hook(lambda *_: calls.append("first"), prepend=True))

    worker, _ = estimating(pause, call, x)
    assert together(worker, register) == []
    calls.clear()  # the estimate's later runs called them too, as they call every hook a model has
    with torch.no_grad():
        model(x)
    assert calls == ["first", "model"]
    for handle in handles:
        handle.remove()  # handles made while the estimate ran still remove their hooks
    calls.clear()
    model(x)
    assert calls == []
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def hooked_by_another_thread(estimated: bool) -> tuple[weakref.ref[nn.Module], list[Any]]:
    """Another thread hooks the model while a call of it pauses; return the model, weakly, and the handles."""
    model, x = SelfHooked(16, 4), torch.randn(8, 16)
    pause = Pause()
    call = pause.after(model)

    handles: list[Any] = []

    def register() -> None:
        with pause.during():
            handles.append(model.register_forward_hook(lambda *_: None))

    def run() -> None:
        pause.armed = True
        if estimated:
            koila.estimate(call, x)
        else:
            call(x)

    assert together(run, register) == []
    assert len(model._forward_hooks) == 2
    handles[0].remove()  # the handle still removes its hook
    assert len(model._forward_hooks) == 1
    return weakref.ref(model), handles


@pytest.mark.parametrize("estimated", [False, True])
def test_a_model_another_thread_hooked_while_the_estimate_ran_is_freed_with_its_handle(estimated: bool) -> None:
    freed, handles = hooked_by_another_thread(estimated)
    gc.collect()
    assert freed() is None
    assert handles  # the handle outlives the model, as it does without an estimate


def test_a_hook_the_estimated_call_registers_stays_with_it() -> None:
    model, x = made("mlp")
    pause = Pause()
    fired: set[int] = set()

    def call(rows: torch.Tensor) -> torch.Tensor:
        model.register_forward_hook(lambda *_: fired.add(threading.get_ident()))  # never removed
        out: torch.Tensor = model(rows)
        pause.here()
        return out

    estimator: list[int] = []
    worker, _ = estimating(pause, call, x)

    def estimate() -> None:
        estimator.append(threading.get_ident())
        worker()

    def infer() -> None:
        with pause.during(), torch.no_grad():
            model(x)

    assert together(estimate, infer) == []
    assert fired == set(estimator)
    assert all(not m._forward_hooks for m in model.modules())


class Gated(nn.Module):
    """Two layers, with a pause between them: the estimate waits there while another thread trains."""

    def __init__(self, pause: Pause) -> None:
        super().__init__()
        self.first = nn.Linear(16, 32)
        self.second = nn.Linear(32, 256)
        self.pause = pause

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x).relu()
        self.pause.here()
        out: torch.Tensor = self.second(h)
        return out


class PausingSGD(torch.optim.SGD):
    """SGD whose step, when armed, lets the estimate go on and waits for it to finish its call."""

    def __init__(self, params: Any, pause: Pause, finished: threading.Event) -> None:
        super().__init__(params, lr=0.1)
        self.pause, self.finished = pause, finished
        self.armed = False

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        if self.armed:
            self.armed = False
            self.pause.resume.set()
            assert self.finished.wait(WAIT), "the estimate never finished its call"
        return super().step(closure)


def test_the_estimates_hooks_ignore_another_threads_forward_backward_and_step() -> None:
    torch.manual_seed(0)
    pause, finished = Pause(), threading.Event()
    net = Gated(pause)
    optimizer = torch.optim.Adam(net.parameters())
    other = nn.Linear(16, 8)
    other_optimizer = PausingSGD(other.parameters(), pause, finished)
    x = torch.randn(8, 16)

    def step(rows: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        net(rows).square().mean().backward()
        optimizer.step()
        if pause.reached.is_set():
            finished.set()

    alone = figures(koila.estimate(step, x))
    other(x).sum().backward()
    expected_grad = other.weight.grad.clone()
    expected_weight = other.weight.detach().add(expected_grad, alpha=-0.1)  # as SGD adds it
    other.zero_grad(set_to_none=True)
    worker, found = estimating(pause, step, x)

    def estimate() -> None:
        try:
            worker()
        finally:
            finished.set()

    def train_another_model() -> None:
        # While the estimate waits inside its forward, this thread's modules run their forward and
        # backward (a module tracker that heard them would lose track of where the estimate is), then
        # its optimizer steps, and waits inside the step while the estimate goes on (an optimizer hook
        # that heard it would count the estimate's forward as a step).
        assert pause.reached.wait(WAIT)
        try:
            other(x).sum().backward()
            other_optimizer.armed = True
            other_optimizer.step()
        finally:
            pause.resume.set()

    assert together(estimate, train_another_model) == []
    assert figures(found[0]) == alone
    assert torch.equal(other.weight.grad, expected_grad)
    assert torch.equal(other.weight, expected_weight)


def test_the_estimate_leaves_another_threads_random_numbers_alone() -> None:
    model, x = made("mlp")
    pause = Pause()
    call = pause.after(model)

    states: list[torch.Tensor] = []

    def draw() -> None:
        with pause.during():
            torch.rand(4)
            states.append(torch.get_rng_state())

    worker, _ = estimating(pause, call, x)
    assert together(worker, draw) == []
    # Not rewound: the thread's next draw is a new one, not the one it drew again.
    assert torch.equal(torch.get_rng_state(), states[0])


def test_another_thread_saves_and_copies_the_model_while_the_estimate_holds_it() -> None:
    model, x = made("batchnorm")
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(x).square().mean().backward()
    optimizer.step()
    pause = Pause()

    def step(rows: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        model(rows).square().mean().backward()
        optimizer.step()
        pause.here()  # the step's writes made: BatchNorm's statistics, the optimizer's state and step count

    expected = {key: value.clone() for key, value in model.state_dict().items()}
    expected_steps = [float(state["step"]) for state in optimizer.state.values()]
    saved: list[Any] = []

    def save() -> None:
        with pause.during():
            saved.append(model.state_dict())
            saved.append(optimizer.state_dict())
            saved.append(copy.deepcopy(model))
            saved.append(pickle.loads(pickle.dumps(model)))

    worker, _ = estimating(pause, step, x)
    assert together(worker, save) == []
    state, optimizer_state, *copies = saved
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[key], value) for key, value in expected.items())
    assert [float(s["step"]) for s in optimizer_state["state"].values()] == expected_steps
    assert all(v.device.type == "cpu" for s in optimizer_state["state"].values() for v in s.values())
    for made_copy in copies:
        for module in made_copy.modules():
            assert type(module._parameters) is dict
            assert type(module._forward_hooks) is OrderedDict
        copied = made_copy.state_dict()
        assert all(torch.equal(copied[key], value) for key, value in expected.items())


_OVERLAPPING = """
import gc, threading
import torch
from torch import nn
import koila_retry as koila

model, x = nn.Linear(4, 4), torch.randn(2, 4)
first_in, first_may_end, first_out, second_in = (threading.Event() for _ in range(4))
during = []

def held(x):
    first_in.set()
    assert first_may_end.wait(60)
    return model(x).sum()

def overlapping(x):
    if not second_in.is_set():  # an estimate runs it more than once
        second_in.set()
        assert first_out.wait(60)
        during.append(gc.isenabled())
    return model(x).sum()

def run_first():
    koila.profile(held, x)
    first_out.set()

assert gc.isenabled()
threads = [threading.Thread(target=run_first), threading.Thread(target=koila.{second}, args=(overlapping, x))]
threads[0].start()
assert first_in.wait(60)
threads[1].start()
assert second_in.wait(60)
first_may_end.set()
for thread in threads:
    thread.join(60)
print(during, gc.isenabled())
"""


@pytest.mark.parametrize("second", ["profile", "estimate"])
def test_overlapping_runs_keep_the_collector_paused_until_the_last_ends(second: str) -> None:
    # Each run saved and restored the collector itself: one that began while another held it paused saw it
    # off, and the first to end started it in the middle of the other's run; in another order it was left
    # off for the rest of the process (probe 77E). In a process of its own: two threads' profiles there
    # left this worker's torch.compile recompiling at every call of the compile tests after it.
    script = _OVERLAPPING.replace("{second}", second)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[False]", "True"]  # paused while the second ran on; running after both


def test_a_child_forked_inside_a_profile_collects_garbage() -> None:
    # The child kept the pause of the run it was forked in, which never ends there (a data loader's worker
    # forked inside a profiled step): its collector stayed off for life (probe 77H).
    read, write = os.pipe()

    def forks(x: torch.Tensor) -> torch.Tensor:
        child = os.fork()
        if child == 0:  # pragma: no cover - the child's
            os.write(write, b"1" if gc.isenabled() else b"0")
            os._exit(0)
        os.waitpid(child, 0)
        return x.sum()

    assert gc.isenabled()
    koila.profile(forks, torch.ones(2))
    os.close(write)
    assert os.read(read, 1) == b"1"
    os.close(read)
    assert gc.isenabled()


def test_the_collector_runs_again_before_the_last_pause_is_let_go(monkeypatch: pytest.MonkeyPatch) -> None:
    # Let go first, then started: a child forked between the two found no pause and the collector off (probe 77H).
    from koila_retry._common import collector

    held: list[dict[int, int]] = []
    enable = gc.enable
    monkeypatch.setattr(gc, "enable", lambda: (held.append(dict(collector._pauses)), enable())[1])
    with collector.collector_paused():
        pass
    assert held[0] == {threading.get_ident(): 1}
    assert gc.isenabled()


def test_a_pause_taken_while_the_pauses_are_counted_waits_for_nothing() -> None:
    # A finalizer that runs an estimate, collected while this thread counts a pause, waited on itself (probe 77H).
    from koila_retry._common import collector

    done = threading.Event()

    def nested() -> None:
        with collector._lock, collector.collector_paused():
            done.set()

    thread = threading.Thread(target=nested, daemon=True)
    thread.start()
    assert done.wait(WAIT)
    assert gc.isenabled()


def test_a_pause_that_begins_and_ends_as_the_last_is_let_go_leaves_the_collector_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A pause taken by this thread between the collector's start and the last pause's going (a signal's
    # handler that runs an estimate) stopped it, and nothing started it again (probe 77L).
    from koila_retry._common import collector

    enable, nested = gc.enable, []

    def enable_then_pause() -> None:
        enable()
        if not nested:
            nested.append(True)
            with collector.collector_paused():
                pass

    monkeypatch.setattr(gc, "enable", enable_then_pause)
    with collector.collector_paused():
        pass
    assert nested == [True]
    assert gc.isenabled()
