"""torch.compile across out-of-memory retries: bounded recompiles, and nothing of a failed attempt kept.

Out-of-memory errors raised inside compiled code come from two real sources:

* in this process, a simulated device whose dispatch mode lets Dynamo compile
  (``ignore_compile_internals``): the compiled graph's operators (backend
  ``"aot_eager"``) count against the limit, and one past it raises a genuine
  ``torch.OutOfMemoryError`` from inside the graph;
* in a subprocess under ``RLIMIT_AS``, the real CPU allocator fails inside code
  compiled with ``"aot_eager"`` and with ``"inductor"``.

Compilations are counted with Dynamo's own counters: every graph Dynamo compiles,
the first or a recompilation, adds one to ``counters["stats"]["unique_graphs"]``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import types
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import cast

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

import koila_retry as koila
from koila_retry.testing import SimulatedDevice, simulated_device

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

ROOT = Path(__file__).resolve().parents[1]
BACKEND = "aot_eager"  # compiles through AOT autograd like inductor, in a fraction of the time
LIMIT = 7 * 2**20  # 128 rows of the model below fit, 256 do not


class Wide(nn.Module):
    """An MLP whose hidden activations take 16 KiB a row (32 KiB with the ReLU's copy)."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(16, 4096)
        self.out = nn.Linear(4096, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x)))


@pytest.fixture
def device() -> Callable[[], SimulatedDevice]:
    """Make simulated devices of ``LIMIT`` bytes that compiled code runs under."""
    return lambda: simulated_device(LIMIT)


def compiles() -> int:
    """Return how many graphs Dynamo has compiled since the counters were cleared."""
    return counters["stats"]["unique_graphs"]


Model = Callable[[torch.Tensor], torch.Tensor]


def make_model(dynamic: bool | None = None) -> tuple[nn.Module, Model]:
    """Return the model, in eval mode, and its compiled form (backend ``BACKEND``)."""
    torch.manual_seed(0)
    model = Wide().eval()
    return model, cast(Model, torch.compile(model, backend=BACKEND, dynamic=dynamic))


def test_batch_third_size_runs_without_a_new_compile(device: Callable[[], SimulatedDevice]) -> None:
    model, compiled = make_model()
    data = torch.randn(1000, 16)
    tried: list[tuple[int, int]] = []  # (batch size, graphs compiled before the attempt)
    events: list[koila.OOMEvent] = []

    @koila.batch(initial=512, on_oom=events.append)
    def predict(batch_size: int, data: torch.Tensor) -> torch.Tensor:
        tried.append((batch_size, compiles()))
        with torch.no_grad():
            return compiled(data[:batch_size].clone())

    outs = []
    for _ in range(2):  # the second call starts at the size the cache remembers
        with device():
            outs.append(predict(data))
    # 512 compiled with static shapes and failed inside the graph; 256 recompiled with a
    # dynamic batch dimension and failed; 128 ran the dynamic graph as it was, and so did
    # the next call.
    assert tried == [(512, 0), (256, 1), (128, 2), (128, 2)]
    assert predict.stats.ooms == 2
    # Named by the model's forward, not by the FX graph that Dynamo generated from it.
    assert len(events) == 2
    for event in events:
        assert event.where.startswith(__file__), event.where
        assert event.where.endswith(" in forward"), event.where
    assert compiles() == 2
    assert counters["frames"]["ok"] == 2
    with torch.no_grad():
        expected = model(data[:128])
        for out in outs:
            torch.testing.assert_close(out, expected)
        for rows in (100, 64, 3, 2):  # any other size from 2 up runs the same graph
            torch.testing.assert_close(compiled(data[:rows]), model(data[:rows]))
    assert compiles() == 2


@pytest.mark.parametrize("outer", [False, True], ids=["decorated", "caller"])
def test_batch_compiled_whole_retries(device: Callable[[], SimulatedDevice], outer: bool) -> None:
    # torch.compile over the decorated function itself, or over a function that calls it.
    # Dynamo would trace the engine's first attempt, its try with it, and the user's function
    # into one graph, whose out-of-memory error then passed the handler by: the caller got it.
    torch.manual_seed(0)
    model = Wide().eval()
    data = torch.randn(1000, 16)

    @koila.batch(initial=512, cache=koila.NoCache())
    def predict(batch_size: int, data: torch.Tensor) -> torch.Tensor:
        return model(data[:batch_size])

    def caller(data: torch.Tensor) -> torch.Tensor:
        return predict(data)

    compiled = torch.compile(caller if outer else predict, backend=BACKEND)
    with device(), torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compiled(data)
    # The wrapper's frames run as written: Dynamo no longer meets sys._getframe in them, and says nothing.
    assert not [str(each.message) for each in caught if "_getframe" in str(each.message)]
    assert predict.stats.ooms == 2
    assert predict.stats.batch_size == 128
    # The user's function is still compiled: 512 with static shapes, 256 with a dynamic
    # batch dimension, and 128 ran that graph.
    assert compiles() == 2
    with torch.no_grad():
        torch.testing.assert_close(out, model(data[:128]))


def _library_codes() -> list[types.CodeType]:
    """The code of every function of the library's imported modules: methods and nested functions too."""
    found: list[types.CodeType] = []

    def add(code: types.CodeType) -> None:
        found.append(code)
        for constant in code.co_consts:
            if isinstance(constant, types.CodeType):
                add(constant)

    for name, module in list(sys.modules.items()):
        if name.startswith("koila_retry"):
            for value in vars(module).values():
                owners = [*vars(value).values()] if isinstance(value, type) else [value]
                for owner in owners:
                    function = getattr(owner, "__func__", getattr(owner, "fget", owner))
                    if isinstance(function, types.FunctionType) and function.__module__.startswith("koila_retry"):
                        add(function.__code__)
    return found


def test_a_compiled_caller_compiles_no_frame_of_the_library(device: Callable[[], SimulatedDevice]) -> None:
    """torch.compile over a caller of a split step, chunked and attempts: only the user's frames are compiled.

    Dynamo compiled the library's frames that the skipped wrappers called, warned of what they use
    (lru_cache, _thread.get_ident, sys._getframe) and recompiled them as the micro-batches went by.
    """
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    torch.manual_seed(0)
    model = Wide()

    @koila.accumulate(initial=64, cache=koila.NoCache())
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(model(x), y)

    caches = koila.NoCache(), koila.NoCache()  # made outside: a cache makes a lock, which Dynamo warns of

    def caller(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = step(x, y)
        with torch.no_grad():
            out = koila.chunked(model, x, initial=64, cache=caches[0])
            for attempt in koila.attempts(initial=64, cache=caches[1]):
                with attempt:
                    out = out + model(x[: attempt.batch_size]).sum()
        return loss + out.sum()

    compiled = torch.compile(caller, backend="eager")
    x, y = torch.randn(640, 16), torch.randn(640, 4)
    with device(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model.zero_grad()
            compiled(x, y)
    assert step.stats.ooms == 0  # ten micro-batches of 64 rows, each a frame a compiled library would guard on
    assert model.hidden.weight.grad is not None
    assert [str(each.message) for each in caught] == []
    codes = _library_codes()
    assert len(codes) > 500
    compiled_codes = [code.co_qualname for code in codes if _debug_get_cache_entry_list(code)]
    assert compiled_codes == []


def test_an_out_of_memory_error_under_a_compiled_caller_compiles_no_abstract_class_hook() -> None:
    """Looking for iterators among the arguments of a call that ran out of memory used isinstance with
    collections.abc's classes, whose __subclasshook__ Dynamo compiled once per class it met (every
    Mapping subclass in the process, networkx's dozens among them) until its recompile limit."""
    import collections.abc

    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    model = nn.Linear(16, 4)
    fits = koila.testing.oom_above(128)

    @koila.batch(initial=512, cache=koila.NoCache())
    def predict(batch_size: int, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = model(x[:batch_size])
        fits(batch_size)
        return out

    def caller(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return predict(model, x)

    out = torch.compile(caller, backend="eager")(torch.randn(1000, 16))
    assert (tuple(out.shape), predict.stats.ooms) == ((128, 4), 2)
    hooks = {
        hook.__code__
        for value in vars(collections.abc).values()
        if isinstance(value, type)
        for hook in [getattr(vars(value).get("__subclasshook__"), "__func__", None)]
        if hook is not None
    }
    assert len(hooks) > 5
    assert [code.co_qualname for code in hooks if _debug_get_cache_entry_list(code)] == []


@pytest.mark.parametrize(
    "use",
    [
        pytest.param(lambda model, x: koila.estimate(model, x), id="estimate"),
        pytest.param(lambda model, x: koila.suggest_batch_size(model, x), id="suggest_batch_size"),
        pytest.param(lambda model, x: koila.profile(model, x), id="profile"),
        pytest.param(lambda model, x: koila.profile(model, x, fake=True), id="profile-fake"),
        pytest.param(
            lambda model, x: koila.chunked(model, x, initial="auto", cache=koila.NoCache()), id="chunked-auto"
        ),
    ],
)
def test_an_estimate_or_a_profile_leaves_a_compiled_model_compiled(use: Callable[..., object]) -> None:
    """The estimator's and profile's dispatch modes made Dynamo run the model eagerly and mark its code
    never to be compiled again, for the process: every later call ran eagerly."""
    from torch._dynamo.testing import CompileCounter

    def graphs(used: bool) -> int:
        torch._dynamo.reset()
        counter = CompileCounter()
        compiled = torch.compile(Wide(), backend=counter)
        x = torch.randn(16, 16)
        with torch.no_grad():
            if used:
                use(compiled, x)
            for rows in (8, 9, 10):
                compiled(torch.randn(rows, 16))
        return counter.frame_count

    assert graphs(used=True) == graphs(used=False) > 0


@pytest.mark.parametrize(
    "use",
    [
        pytest.param(lambda model, x: koila.estimate(model, x), id="estimate"),
        pytest.param(lambda model, x: koila.profile(model, x), id="profile"),
        pytest.param(lambda model, x: koila.chunked(model, x, initial="auto", cache=koila.NoCache()), id="auto"),
    ],
)
def test_the_warning_of_the_librarys_global_hooks_is_filtered_while_they_are_on(use: Callable[..., object]) -> None:
    # Under -W error, torch's warning that global hooks fire again over a compile wrapper made each of
    # these fail (initial="auto" warned that it could not estimate, an error too; probe 72G).
    compiled = torch.compile(Wide(), backend="eager")
    x = torch.randn(16, 16)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        before = list(warnings.filters)
        use(compiled, x)
        assert warnings.filters == before
        handle = torch.nn.modules.module.register_module_forward_hook(lambda *args: None)
        try:
            with pytest.warns(UserWarning, match="when there are global hooks"):  # the user's own still warn
                compiled(x)
        finally:
            handle.remove()


def test_an_estimate_inside_a_compiled_function_runs() -> None:
    """Under a compiled caller, torch refuses a stance: the estimate runs without one, as it did."""
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    found: list[koila.MemoryEstimate] = []

    def step(data: torch.Tensor) -> torch.Tensor:
        found.append(koila.estimate(model, data))
        return model(data)

    x = torch.randn(256, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # global module hooks over a compiled module
        torch.testing.assert_close(torch.compile(step, backend="eager")(x), model(x))
    assert len(found) == 1
    assert found[0].peak(256) > 0


class _Waits(nn.Module):
    """Doubles its input once told to go on: holds an estimate open while another thread works."""

    def __init__(self) -> None:
        super().__init__()
        self.inside, self.go_on = threading.Event(), threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inside.set()
        self.go_on.wait(30)
        return x * 2


def test_an_estimate_inside_a_compiled_function_keeps_another_thread_s_profile_compiled() -> None:
    """The stance is the process's: one set from inside a compiled caller too, kept while either runs."""
    from torch._dynamo.testing import CompileCounter

    waits = _Waits()

    def step(x: torch.Tensor) -> torch.Tensor:
        koila.estimate(waits, x)
        return x + 1

    other = threading.Thread(target=lambda: torch.compile(step, backend="eager")(torch.randn(4, 8)))
    counter = CompileCounter()
    model = torch.compile(nn.Linear(8, 8), backend=counter)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # global module hooks over a compiled module
        other.start()
        try:
            assert waits.inside.wait(30)
            with torch.no_grad():
                koila.profile(model, torch.randn(16, 8))
        finally:
            waits.go_on.set()
            other.join()
    assert torch._dynamo.eval_frame._stance.stance == "default"
    with torch.no_grad():
        for rows in (8, 9, 10):
            model(torch.randn(rows, 8))
    assert counter.frame_count == 2  # the first shape, then one dynamic graph: compiled as ever


def test_a_stance_another_thread_sets_during_an_estimate_stays() -> None:
    waits = _Waits()
    other = threading.Thread(target=lambda: koila.estimate(waits, torch.randn(4, 8)))
    other.start()
    try:
        assert waits.inside.wait(30)
        assert torch._dynamo.eval_frame._stance.stance == "force_eager"
        torch.compiler.set_stance("fail_on_recompile")
    finally:
        waits.go_on.set()
        other.join()
    try:
        assert torch._dynamo.eval_frame._stance.stance == "fail_on_recompile"
    finally:
        torch.compiler.set_stance("default")


def test_chunked_shrinks_and_runs_the_remainder_without_a_new_compile(
    device: Callable[[], SimulatedDevice],
) -> None:
    model, compiled = make_model()
    data = torch.randn(1000, 16)
    chunks: list[tuple[int, int]] = []  # (rows, graphs compiled before the chunk)

    def encode(rows: torch.Tensor) -> torch.Tensor:
        chunks.append((len(rows), compiles()))
        return compiled(rows)

    with device(), torch.no_grad():
        out = koila.chunked(encode, data, initial=512, cache=koila.NoCache())
    # Chunks are views at growing offsets: neither they nor the 104-row remainder recompile.
    assert chunks == [(512, 0), (256, 1), *[(128, 2)] * 7, (104, 2)]
    assert compiles() == 2
    with torch.no_grad():
        torch.testing.assert_close(out, model(data))


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_failed_attempts_memory_is_released_before_the_retry(
    device: Callable[[], SimulatedDevice], train: bool
) -> None:
    model, compiled = make_model()
    model.train(train)
    data = torch.randn(1000, 16)
    refs: list[weakref.ref[torch.Tensor]] = []
    alive_at_start: list[list[bool]] = []
    live_at_start: list[int] = []

    with device() as simulated:
        baseline = simulated.live

        @koila.batch(initial=512, cache=koila.NoCache())
        def step(batch_size: int) -> torch.Tensor:
            model.zero_grad(set_to_none=True)
            alive_at_start.append([ref() is not None for ref in refs])
            live_at_start.append(simulated.live)
            x = data[:batch_size] * 2  # made in the attempt; the compiled graph's input
            refs.append(weakref.ref(x))
            with torch.set_grad_enabled(train):
                out = compiled(x)
                if train:
                    out.sum().backward()
            return out.detach()

        step()
    assert step.stats.ooms == 2
    # The input of each failed attempt (the first also served as Dynamo's example input)
    # is dead when the next attempt starts, and after the call.
    assert alive_at_start == [[], [False], [False, False]]
    assert [ref() is not None for ref in refs[:2]] == [False, False]
    # So is every storage the failed graphs made, their intermediates included.
    assert live_at_start == [baseline] * 3
    assert compiles() == 2


@pytest.mark.parametrize(("norm", "warned"), [(nn.BatchNorm1d, True), (nn.LayerNorm, False)])
def test_a_split_step_of_a_compiled_model_with_batchnorm_warns_of_it(norm: type[nn.Module], warned: bool) -> None:
    # AOT autograd makes the whole forward one node, inside which the walk finds no batch normalisation.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), norm(32), nn.ReLU(), nn.Linear(32, 4))
    compiled = torch.compile(model, backend=BACKEND)
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))

    @koila.accumulate(initial=16, cache=koila.NoCache())
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(compiled(x), y)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(x, y)
        step(x, y)
    messages = [str(warning.message) for warning in caught if "BatchNorm" in str(warning.message)]
    assert len(messages) == (1 if warned else 0)


def test_size_one_is_compiled_once_more(device: Callable[[], SimulatedDevice]) -> None:
    # Dynamo's dynamic sizes assume >= 2 ("0/1 specialization"): a size of 1 gets a graph of
    # its own, once. Here a chunked pass over 897 rows ends with a remainder of one row.
    model, compiled = make_model()
    data = torch.randn(897, 16)
    outs = []
    for _ in range(2):  # the second pass starts at 128 (cached) and compiles nothing
        with device(), torch.no_grad():
            outs.append(koila.chunked(compiled, data, initial=512))
        assert compiles() == 3  # 512 static, 256 dynamic, the last row alone
    with torch.no_grad():
        expected = model(data)
    for out in outs:
        torch.testing.assert_close(out, expected)


@pytest.mark.parametrize(
    "mark", [torch._dynamo.maybe_mark_dynamic, torch._dynamo.mark_dynamic], ids=["maybe_mark", "mark"]
)
def test_marking_the_batch_dim_dynamic_compiles_once(
    device: Callable[[], SimulatedDevice], mark: Callable[[torch.Tensor, int], None]
) -> None:
    model, compiled = make_model()
    data = torch.randn(1000, 16)
    tried: list[tuple[int, int]] = []

    @koila.batch(initial=512, cache=koila.NoCache())
    def predict(batch_size: int) -> torch.Tensor:
        tried.append((batch_size, compiles()))
        x = data[:batch_size].clone()
        mark(x, 0)
        with torch.no_grad():
            return compiled(x)

    with device():
        out = predict()
    assert tried == [(512, 0), (256, 1), (128, 1)]
    assert compiles() == 1
    with torch.no_grad():
        torch.testing.assert_close(out, model(data[:128]))


def test_static_shapes_compile_every_size(device: Callable[[], SimulatedDevice]) -> None:
    # What the docs advise against: dynamic=False compiles once per size, up to the limit.
    _, compiled = make_model(dynamic=False)
    data = torch.randn(1000, 16)
    tried: list[tuple[int, int]] = []

    @koila.batch(initial=512, cache=koila.NoCache())
    def predict(batch_size: int) -> torch.Tensor:
        tried.append((batch_size, compiles()))
        with torch.no_grad():
            return compiled(data[:batch_size].clone())

    with device():
        predict()
    assert tried == [(512, 0), (256, 1), (128, 2)]
    assert compiles() == 3
    with torch.no_grad():
        compiled(data[:64])
    assert compiles() == 4


def test_a_simulated_device_lets_dynamo_compile_and_counts_the_graph() -> None:
    # A dispatch mode that does not ignore compile internals keeps Dynamo out: the model
    # runs eagerly, and its forward is marked never to be compiled again, outside the block too.
    _, compiled = make_model()
    x = torch.randn(8, 16)
    with simulated_device("64MiB") as device, torch.no_grad():
        compiled(x)
        assert compiles() == 1
        assert device.peak >= 8 * 4096 * 4  # the graph's hidden activations were counted
    with torch.no_grad():
        compiled(torch.randn(9, 16))
    assert compiles() == 2  # still compiled outside the block: the second size, dynamic


RLIMIT_SCRIPT = textwrap.dedent(
    """
    import json, resource, sys, weakref
    import psutil, torch, torch._dynamo, torch._inductor.config
    from torch._dynamo.utils import counters
    import koila_retry as koila

    torch.set_num_threads(1)  # no new threads (and their stacks) under the limit
    torch._inductor.config.compile_threads = 1  # compile in this process, no worker pool
    torch.manual_seed(0)
    # One intermediate of 1 MiB a row, the same with or without fusion: 128 rows take
    # 128 MiB, 256 rows 256 MiB, 512 rows 512 MiB.
    model = torch.nn.Sequential(torch.nn.Linear(16, 2**18), torch.nn.Linear(2**18, 4)).eval()
    data = torch.randn(1000, 16)
    with torch.no_grad():
        expected = model(data[:128])
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    results = {}
    for backend in sys.argv[1:]:
        # Load the compiler's modules on a throwaway graph, so the limit is spent on tensors.
        warm = torch.compile(torch.nn.Linear(3, 3), backend=backend)
        with torch.no_grad():
            warm(torch.randn(5, 3))
            warm(torch.randn(6, 3))
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(model, backend=backend)
        tried, refs, alive, headroom, where = [], [], [], [], []
        process = psutil.Process()

        @koila.batch(initial=512, cache=koila.NoCache(), on_oom=lambda event: where.append(event.where))
        def predict(batch_size):
            alive.append(sum(ref() is not None for ref in refs))
            tried.append([batch_size, counters["stats"]["unique_graphs"]])
            headroom.append((limit - process.memory_info().vms) >> 20)  # MiB, for failure messages
            x = data[:batch_size].clone()
            refs.append(weakref.ref(x))
            with torch.no_grad():
                return compiled(x)

        # 128 rows fit with 64 MiB to spare, 256 rows miss by 64 MiB.
        limit = process.memory_info().vms + 192 * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
        try:
            out = predict()
            with torch.no_grad():
                for rows in (100, 64, 3):
                    compiled(data[:rows].clone())
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
        results[backend] = {
            "tried": tried, "alive": alive, "dead_after": [ref() is None for ref in refs],
            "ooms": predict.stats.ooms, "graphs": counters["stats"]["unique_graphs"],
            "headroom_mib": headroom, "where": where,
            "equal": out.shape == expected.shape and bool(torch.allclose(out, expected, atol=1e-5)),
        }
    print(json.dumps(results))
    """
)


@pytest.mark.slow
def test_real_cpu_allocator_failure_inside_compiled_code(tmp_path: Path) -> None:
    backends = ["aot_eager", "inductor"]
    completed = subprocess.run(
        [sys.executable, "-c", RLIMIT_SCRIPT, *backends],
        capture_output=True,
        text=True,
        timeout=240,
        env={
            "PYTHONPATH": str(ROOT),
            "PATH": "/usr/bin:/bin",
            # A fresh inductor cache: the same compile work on every run, and nothing left in /tmp.
            "TORCHINDUCTOR_CACHE_DIR": str(tmp_path),
            # One malloc arena: a thread started by the compiler would otherwise reserve
            # 64 MiB of address space, a third of the budget.
            "MALLOC_ARENA_MAX": "1",
        },
    )
    assert completed.returncode == 0, completed.stderr
    results = json.loads(completed.stdout.strip().splitlines()[-1])
    for backend in backends:
        result = results[backend]
        message = f"{backend}: {result}"
        # 512 and 256 failed in the allocator inside the compiled graph; 128 fitted, and
        # neither it nor 100, 64 or 3 rows afterwards needed a third graph.
        assert result["tried"] == [[512, 0], [256, 1], [128, 2]], message
        assert result["ooms"] == 2, message
        assert result["graphs"] == 2, message
        assert result["equal"] is True, message
        # The failed attempts' inputs were dead when the next attempt started.
        assert result["alive"] == [0, 0, 0], message
        assert result["dead_after"] == [True, True, True], message
        # Named by the decorated function, not by the code the compiler generated.
        assert [place.endswith(" in predict") for place in result["where"]] == [True, True], message
