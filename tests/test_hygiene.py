"""Memory hygiene: a failed attempt leaves nothing alive when the retry starts (DESIGN rule 1)."""

from __future__ import annotations

import asyncio
import gc
import inspect
import subprocess
import sys
import traceback
import weakref
from typing import Any

import _ranks
import pytest
import torch
from _devices import CUDA
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import koila_retry as koila
from koila_retry.testing import make_oom, simulated_device


def _decorated_and_called(front_end: str) -> weakref.ref[nn.Module]:
    """Decorate a function that closes over a model, inside this one, call it, and return."""
    model = nn.Linear(4, 1)
    x = torch.randn(4, 4)
    if front_end == "batch":
        koila.batch(lambda batch_size: model(x[:batch_size]), initial=4)()
    elif front_end == "chunked":
        koila.chunked(lambda rows: model(rows))(x)
    elif front_end == "range":
        koila.range(lambda begin, end: model(x[begin:end]))(0, 4)
    else:
        koila.accumulate(lambda rows: model(rows).sum())(x)
    return weakref.ref(model)


@pytest.mark.parametrize("front_end", ["batch", "chunked", "range", "accumulate"])
def test_a_wrapper_let_go_of_lets_go_of_what_its_function_closes_over_at_once(front_end: str) -> None:
    # A step decorated inside a training function that returned: the wrapper's class, in a cycle as
    # every class is, kept the model (and a DDP step's process group) until a collection.
    gc.collect()
    gc.disable()
    try:
        model = _decorated_and_called(front_end)
        assert model() is None
    finally:
        gc.enable()


_CALLED_AT_EXIT = """
import torch
import koila_retry as koila
from koila_retry._core import memory

memory.FREE_MEMORY_TTL = 0  # every call reads the free memory again, at exit too (as after a slow run)

@koila.batch(initial=4)
def flush(batch_size):
    return batch_size

class Writer:
    def __del__(self):  # a writer that flushes as the interpreter ends
        print("flushed", flush(), flush=True)

writer = Writer()
print("called", flush(), flush=True)
"""


def test_a_wrapper_still_runs_as_the_interpreter_ends() -> None:
    # Let go of through weakref.finalize, the wrapper stopped being callable at exit ("'Bindable' object is
    # not callable" in a __del__), and its registry kept the module alive past its writer. The free memory
    # read at exit raised KeyError from psutil, whose modules were gone.
    completed = subprocess.run([sys.executable, "-c", _CALLED_AT_EXIT], capture_output=True, text=True, timeout=240)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.split() == ["called", "4", "flushed", "4"], completed.stderr


def test_tensor_of_failed_attempt_is_dead_when_retry_starts() -> None:
    refs: list[weakref.ref[torch.Tensor]] = []
    alive_at_start: list[bool] = []

    @koila.batch(initial=4, cache=koila.NoCache())
    def run(batch_size: int) -> int:
        alive_at_start.append(any(ref() is not None for ref in refs))
        activations = torch.ones(batch_size, 1024)
        refs.append(weakref.ref(activations))
        if batch_size > 1:
            raise make_oom()
        return batch_size

    assert run() == 1
    assert alive_at_start == [False, False, False]
    assert all(ref() is None for ref in refs[:-1])


def test_tensor_in_a_reference_cycle_is_dead_when_retry_starts() -> None:
    # A tensor reachable only through a cycle needs the garbage collector, not just refcounts.
    refs: list[weakref.ref[torch.Tensor]] = []
    alive_at_start: list[bool] = []

    class Node:
        pass

    @koila.batch(initial=2, cache=koila.NoCache())
    def run(batch_size: int) -> None:
        alive_at_start.append(any(ref() is not None for ref in refs))
        node = Node()
        node.self = node  # type: ignore[attr-defined]
        node.tensor = torch.ones(batch_size, 256)  # type: ignore[attr-defined]
        refs.append(weakref.ref(node.tensor))  # type: ignore[attr-defined]
        if batch_size > 1:
            raise make_oom()

    gc.disable()  # make sure it is the library's collection that frees the cycle
    try:
        run()
    finally:
        gc.enable()
    assert alive_at_start == [False, False]


def test_real_model_activations_are_freed_before_the_retry() -> None:
    torch.manual_seed(0)
    live_at_start: list[int] = []
    with simulated_device("6MiB") as device:
        model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
        baseline = device.live

        @koila.batch(initial=2048, cache=koila.NoCache())
        def step(batch_size: int) -> int:
            # A backward that failed half-way may have written some gradients: a train
            # step starts by dropping them, as the docs of koila.batch ask.
            model.zero_grad(set_to_none=True)
            live_at_start.append(device.live)
            out = model(torch.randn(batch_size, 256))
            out.sum().backward()
            return batch_size

        step()
    # Each retry starts with only the model: the failed attempt's activations are gone.
    assert len(live_at_start) > 1
    assert live_at_start == [baseline] * len(live_at_start)


def test_exhausted_error_does_not_pin_the_failed_attempt() -> None:
    refs: list[weakref.ref[torch.Tensor]] = []

    @koila.batch(initial=2, cache=koila.NoCache())
    def run(batch_size: int) -> None:
        activations = torch.ones(batch_size, 1024)
        refs.append(weakref.ref(activations))
        raise make_oom()

    with pytest.raises(koila.BatchSizeExhausted) as excinfo:
        run()
    cause = excinfo.value.__cause__
    assert cause is not None
    assert cause.__traceback__ is None
    assert cause.__context__ is None
    # While the caller holds the error, the failed attempts' tensors are already gone.
    assert [ref() for ref in refs] == [None, None]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception groups are from Python 3.11")
def test_exhausted_error_from_a_group_of_errors_does_not_pin_the_failed_attempt() -> None:
    # The group's own traceback was dropped, its members' were not: they held the attempt's frames.
    refs: list[weakref.ref[torch.Tensor]] = []

    def task(batch_size: int) -> None:
        activations = torch.ones(batch_size, 1024)
        refs.append(weakref.ref(activations))
        raise make_oom()

    @koila.batch(initial=2, cache=koila.NoCache())
    def run(batch_size: int) -> None:
        try:
            task(batch_size)
        except torch.OutOfMemoryError as error:
            raise ExceptionGroup("tasks", [error]) from None  # noqa: F821 (Python 3.11 on)

    with pytest.raises(koila.BatchSizeExhausted) as excinfo:
        run()
    group = excinfo.value.__cause__
    assert isinstance(group, BaseException)
    members = getattr(group, "exceptions", ())
    assert members
    assert all(member.__traceback__ is None for member in members)
    assert [ref() for ref in refs] == [None, None]


def test_nothing_keeps_the_exception_after_recovery() -> None:
    errors: list[weakref.ref[BaseException]] = []

    class TrackedOOM(torch.OutOfMemoryError):
        pass

    @koila.batch(initial=2, cache=koila.NoCache())
    def run(batch_size: int) -> int:
        if batch_size > 1:
            error = TrackedOOM("CUDA out of memory. Tried to allocate 1.00 GiB.")
            errors.append(weakref.ref(error))
            raise error
        return batch_size

    run()
    assert len(errors) == 1
    assert errors[0]() is None  # neither stats, cache, events nor logs keep it


def test_attempts_block_frees_what_a_helper_allocated() -> None:
    refs: list[weakref.ref[torch.Tensor]] = []
    alive_at_start: list[bool] = []

    def work(size: int) -> None:
        activations = torch.ones(size, 1024)
        refs.append(weakref.ref(activations))
        if size > 1:
            raise make_oom()

    for attempt in koila.attempts(initial=4, cache=koila.NoCache()):
        with attempt:
            alive_at_start.append(any(ref() is not None for ref in refs))
            work(attempt.batch_size)
    assert alive_at_start == [False, False, False]


def test_accumulate_gradients_of_a_failed_attempt_are_dead_when_the_retry_starts() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    refs: list[weakref.ref[torch.Tensor]] = []
    alive_at_start: list[bool] = []
    rows: list[int] = []

    @koila.accumulate(initial=8, cache=koila.NoCache())
    def step(x: torch.Tensor) -> torch.Tensor:
        rows.append(len(x))
        if len(rows) == 3:  # the third micro-batch of the first attempt: two have computed gradients
            refs.extend(weakref.ref(gradient) for gradient in _ranks.gradients_of_step().values())
            raise make_oom()
        if len(rows) == 4:  # the retry's first forward
            alive_at_start.append(any(ref() is not None for ref in refs))
        return model(x).square().mean()

    step(torch.randn(32, 8))
    assert rows == [8, 8, 8] + [4] * 8
    assert len(refs) == 4
    assert alive_at_start == [False]


class _FailInTheMeansBackward(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Run out of memory once, in the backward of a mean (``aten.div.Scalar`` inside a backward)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.failed = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not self.failed and func is torch.ops.aten.div.Scalar and torch._C._current_graph_task_id() != -1:
            self.failed = True
            raise make_oom()
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("front_end", ["accumulate", "batch", "given up"])
def test_a_backward_that_failed_with_other_nodes_ready_leaves_its_graph_dead_when_the_retry_starts(
    front_end: str, kind: str
) -> None:
    # PyTorch keeps the nodes that were ready when a backward raised in this thread's queue of the autograd
    # engine, and the rest of the graph through them, until the thread's next backward: the retry's first
    # forward ran beside the failed attempt's activations. On CUDA, the device's own thread runs the
    # backward: whether it keeps anything there is what the cuda case finds out.
    torch.manual_seed(0)
    model = nn.Linear(8, 8).to(kind)
    refs: list[weakref.ref[torch.Tensor]] = []
    alive_at_start: list[bool] = []

    def loss_of(x: torch.Tensor) -> torch.Tensor:
        gc.collect()
        alive_at_start.append(any(ref() is not None for ref in refs))
        hidden = model(x).tanh()
        refs.append(weakref.ref(hidden))
        # The square's node is ready, queued, as the mean's backward runs out of memory.
        return hidden.square().sum() + hidden.mean()

    x = torch.randn(16, 8, device=kind)
    with _FailInTheMeansBackward() as failing:
        if front_end == "accumulate":
            koila.accumulate(cache=koila.NoCache())(loss_of)(x)
        elif front_end == "given up":
            with pytest.raises(koila.BatchSizeExhausted):
                koila.accumulate(cache=koila.NoCache(), minimum=16)(loss_of)(x)
            alive_at_start.append(refs[0]() is not None)  # as the caller holds the error
        else:

            @koila.batch(initial=16, cache=koila.NoCache())
            def step(batch_size: int) -> None:
                model.zero_grad(set_to_none=True)
                for part in x.split(batch_size):
                    loss_of(part).backward()

            step()
    assert failing.failed
    assert alive_at_start[:2] == [False, False], alive_at_start


def _gives_up_at_row_6(front_end: str, error: BaseException, rows: torch.Tensor, weight: torch.Tensor) -> None:
    """Run ``front_end`` over ``rows`` in pieces of 4, the piece with row 6 raising ``error`` at every size."""

    def piece(begin: int, end: int) -> torch.Tensor:
        if begin <= 6 < end:
            raise error
        return torch.ones(end - begin, 256, dtype=torch.float64)

    options: dict[str, Any] = {"initial": 4, "cache": koila.NoCache()}
    if front_end == "chunked":
        koila.chunked(lambda x: piece(int(x[0]), int(x[-1]) + 1), rows, **options)
    elif front_end == "range":
        koila.range(piece, 0, len(rows), **options)
    else:

        @koila.accumulate(**options)
        def step(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            # The second result is one per row: each micro-batch's is kept until the step is joined.
            return weight * x.double().mean(), piece(int(x[0]), int(x[-1]) + 1)

        step(rows)


@pytest.mark.parametrize("front_end", ["chunked", "range", "accumulate"])
@pytest.mark.parametrize("kind", ["given up", "an error of the function"])
def test_an_error_raised_part_way_does_not_pin_what_the_finished_pieces_made(front_end: str, kind: str) -> None:
    # The error's traceback holds the front end's frames: they held the joined result of the
    # chunks that had finished (or the list of a range's results), which nothing else reaches,
    # for as long as the caller kept the error (logged, or sys.last_value in a notebook).
    error: BaseException = make_oom() if kind == "given up" else KeyError("row 6")
    expected = koila.BatchSizeExhausted if kind == "given up" else KeyError
    rows, weight = torch.arange(10).unsqueeze(1), nn.Parameter(torch.ones((), dtype=torch.float64))
    with simulated_device("64MiB") as device:
        with pytest.raises(expected) as excinfo:
            _gives_up_at_row_6(front_end, error, rows, weight)
        gc.collect()
        held = device.live
    assert excinfo.value.__traceback__ is not None  # held, with its frames, as the caller holds it
    assert held == 0


@pytest.mark.parametrize("padding", [False, True], ids=["refused-at-add", "refused-by-cat"])
def test_an_error_combining_a_steps_results_does_not_pin_them(padding: bool) -> None:
    # Per-row outputs whose other dims differ (padded to each micro-batch's longest row) are refused where
    # one differs, or, where an integration's pad gives none, by torch.cat as the step ends: the traceback
    # held every micro-batch's outputs.
    from koila_retry._frontends.accumulate import accumulator

    weight = nn.Parameter(torch.ones((), dtype=torch.float64))
    rows = torch.ones(12, 40, dtype=torch.float64)

    def step(x: torch.Tensor) -> dict[str, torch.Tensor]:
        padded = x[:, : 20 + len(x)]  # 5, 5 and 2 rows: widths 25, 25 and 22
        return {"loss": (padded * weight).mean(), "hidden": padded * 2}

    pad = {"pad": lambda: None} if padding else {}
    decorated = accumulator(initial=5, options={"cache": koila.NoCache()}, **pad)(step)  # type: ignore[arg-type]
    error, said = (RuntimeError, "Sizes of tensors must match") if padding else (ValueError, "rows joined along")
    with simulated_device("64MiB") as device:
        with pytest.raises(error, match=said) as excinfo:
            decorated(rows)
        gc.collect()
        held = device.live
    assert excinfo.value.__traceback__ is not None
    assert weight.grad is None  # as it was
    assert held == 0


# An attempt holds 256 KiB a row and as much again as it doubles it: 2 rows fit in 1536 KiB, 4 do not.
_ROW = 64 * 1024
_FITS_2_ROWS = "1536KiB"


async def _forward(batch_size: int, refs: list[weakref.ref[torch.Tensor]]) -> torch.Tensor:
    await asyncio.sleep(0)
    hidden = torch.ones(batch_size, _ROW)
    refs.append(weakref.ref(hidden))
    return (hidden * 2).sum()


class _Worker:
    """A coroutine that runs jobs for others, hands each its error through a future, and goes on."""

    def __init__(self, refs: list[weakref.ref[torch.Tensor]]) -> None:
        self.refs = refs
        self.jobs: asyncio.Queue[tuple[asyncio.Future[torch.Tensor], int]] = asyncio.Queue()
        self.task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            future, batch_size = await self.jobs.get()
            try:
                future.set_result(await _forward(batch_size, self.refs))
            except torch.OutOfMemoryError as error:
                future.set_exception(error)  # its traceback holds this frame, suspended at the next job

    async def run(self, batch_size: int) -> torch.Tensor:
        # A retry that cleared the suspended frame would have closed the coroutine, and the job would wait forever.
        assert inspect.getcoroutinestate(self.task.get_coro()) != inspect.CORO_CLOSED  # type: ignore[arg-type]
        future = asyncio.get_running_loop().create_future()
        await self.jobs.put((future, batch_size))
        return await future


async def _run_forward(how: str, batch_size: int, refs: list[weakref.ref[torch.Tensor]], worker: _Worker) -> None:
    if how == "await":
        await _forward(batch_size, refs)
    elif how == "task":
        await asyncio.create_task(_forward(batch_size, refs))
    elif how == "gather":
        await asyncio.gather(_forward(batch_size, refs))
    elif how == "worker":
        await worker.run(batch_size)
    else:
        async with asyncio.TaskGroup() as group:  # type: ignore[attr-defined]
            group.create_task(_forward(batch_size, refs))


def _async_attempts(front_end: str, how: str) -> tuple[list[int], list[bool], int, int]:
    """Run an async step whose first attempt runs out of memory; return sizes tried, what was alive at each start."""
    refs: list[weakref.ref[torch.Tensor]] = []
    tried: list[int] = []
    alive_at_start: list[bool] = []

    async def attempt_at(batch_size: int, worker: _Worker) -> None:
        tried.append(batch_size)
        alive_at_start.append(any(ref() is not None for ref in refs))
        await _run_forward(how, batch_size, refs, worker)

    async def main() -> tuple[int, int]:
        worker = _Worker(refs)
        try:
            if front_end == "batch":
                step = koila.batch(initial=4, cache=koila.NoCache())(attempt_at)
                await step(worker)
                return step.stats.batch_size, step.stats.ooms
            for attempt in koila.attempts(initial=4, cache=koila.NoCache()):
                with attempt:
                    await attempt_at(attempt.batch_size, worker)
            return attempt.batch_size, attempt.stats.ooms
        finally:
            worker.task.cancel()

    with simulated_device(_FITS_2_ROWS):
        settled, ooms = asyncio.run(main())
    return tried, alive_at_start, settled, ooms


_TASK_GROUP = pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.TaskGroup is from Python 3.11")


@pytest.mark.parametrize("front_end", ["batch", "attempts"])
@pytest.mark.parametrize("how", [pytest.param("taskgroup", marks=_TASK_GROUP), "task", "gather", "worker"])
def test_an_async_step_whose_error_others_hold_leaves_nothing_alive_when_the_retry_starts(
    front_end: str, how: str
) -> None:
    # A TaskGroup's CancelledError, which asyncio's C code keeps, holds the group's __aexit__ frame and so
    # the group and its members' frames; a finished task holds its error until the next await; a worker
    # holds it in a future. The failed attempt's tensors were alive as the retry started, which then failed
    # too at a size that fits: settled smaller than the same step awaiting the forward itself.
    tried, alive_at_start, settled, ooms = _async_attempts(front_end, how)
    plain_tried, plain_alive, plain_settled, plain_ooms = _async_attempts(front_end, "await")
    assert plain_alive == [False] * len(plain_tried)
    assert alive_at_start == [False] * len(tried)
    assert (tried, settled, ooms) == (plain_tried, plain_settled, plain_ooms)


def _stored_error_attempts(store: bool) -> tuple[list[int], list[bool], int, BaseException | None]:
    """Run a step that may store its out-of-memory error on its object; return what ``_async_attempts`` does."""

    class Runner:
        last_error: BaseException | None = None

        def __init__(self) -> None:
            self.refs: list[weakref.ref[torch.Tensor]] = []
            self.tried: list[int] = []
            self.alive_at_start: list[bool] = []
            self.step = koila.batch(initial=4, cache=koila.NoCache())(self._step)

        def _step(self, batch_size: int) -> torch.Tensor:
            self.tried.append(batch_size)
            self.alive_at_start.append(any(ref() is not None for ref in self.refs))
            try:
                hidden = torch.ones(batch_size, _ROW)
                self.refs.append(weakref.ref(hidden))
                return (hidden * 2).sum()
            except torch.OutOfMemoryError as error:
                if store:
                    self.last_error = error  # for a log or a metrics callback, say
                raise

    runner = Runner()
    with simulated_device(_FITS_2_ROWS):
        runner.step()
    return runner.tried, runner.alive_at_start, runner.step.stats.batch_size, runner.last_error


def test_a_step_that_stores_its_error_leaves_nothing_alive_when_the_retry_starts() -> None:
    tried, alive_at_start, settled, stored = _stored_error_attempts(store=True)
    plain_tried, plain_alive, plain_settled, _ = _stored_error_attempts(store=False)
    assert plain_alive == [False] * len(plain_tried)
    assert alive_at_start == [False] * len(tried)
    assert (tried, settled) == (plain_tried, plain_settled)
    # The error the step kept still says where it was raised; only its frames' variables are gone.
    assert stored is not None
    printed = "".join(traceback.format_exception(type(stored), stored, stored.__traceback__))
    assert "in _step" in printed
    assert "(hidden * 2).sum()" in printed


def test_an_error_the_caller_handles_around_the_call_keeps_its_frames() -> None:
    # The out-of-memory error is raised while the caller handles another: its __context__, whose frames
    # are the caller's, not the attempt's.
    def lookup(table: dict[str, int]) -> int:
        return table["missing"]

    @koila.batch(initial=2, cache=koila.NoCache())
    def step(batch_size: int) -> int:
        if batch_size > 1:
            raise make_oom()
        return batch_size

    table = {"present": 1}
    try:
        lookup(table)
    except KeyError as handled:
        assert step() == 1
        inner = handled.__traceback__
        assert inner is not None
        assert inner.tb_next is not None
        assert inner.tb_next.tb_frame.f_locals.get("table") is table


class _Wide(nn.Module):
    """Allocates a row's worth per row of its input: past the device's limit above 2 rows."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.repeat(1, 8)


@pytest.mark.parametrize("hooked", [False, True])
def test_an_error_a_step_keeps_from_inside_a_module_with_hooks_pins_nothing(hooked: bool) -> None:
    # A module with hooks runs its forward in a closure made per call (Module._call_impl's inner): its
    # cleared frame still held the closure, whose cells held the module's input through the retry.
    wide = _Wide()
    if hooked:
        wide.register_forward_hook(lambda module, inputs, output: None)
    kept: list[BaseException] = []
    inputs: list[weakref.ref[torch.Tensor]] = []
    alive_at_start: list[bool] = []

    @koila.batch(initial=4, cache=koila.NoCache())
    def step(batch_size: int) -> torch.Tensor:
        alive_at_start.append(any(ref() is not None for ref in inputs))
        hidden = torch.ones(batch_size, _ROW // 4)
        inputs.append(weakref.ref(hidden))
        try:
            return wide(hidden).sum()
        except torch.OutOfMemoryError as error:
            kept.append(error)  # for a report at the end, say
            raise

    with simulated_device(_FITS_2_ROWS):
        step()
    assert kept, "the first attempt ran out of memory"
    assert alive_at_start == [False] * len(alive_at_start)
