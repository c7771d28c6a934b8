"""koila_retry.compat.accelerate, side by side with accelerate's own helpers where it is installed."""

from __future__ import annotations

import asyncio
import gc
import inspect
import logging
import subprocess
import sys
import textwrap
import typing
import weakref
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

import koila_retry as koila
from koila_retry.compat import accelerate as compat
from koila_retry.testing import make_oom, simulated_device

# What accelerate's rule, int(size * 0.9), tries from 128 when 20 rows fit.
NINETY_PERCENT_FROM_128 = [128, 115, 103, 92, 82, 73, 65, 58, 52, 46, 41, 36, 32, 28, 25, 22, 19]


@pytest.fixture(params=["koila", "accelerate"])
def helpers(request: pytest.FixtureRequest) -> ModuleType:
    """This module's helpers, then accelerate's (skipped where accelerate is not installed)."""
    if request.param == "accelerate":
        return pytest.importorskip("accelerate.utils")
    return compat


def fits_up_to(limit: int, tried: list[int], kind: str = "cuda") -> Callable[..., Any]:
    def train(batch_size: int, *args: Any, **kwargs: Any) -> Any:
        tried.append(batch_size)
        if batch_size > limit:
            raise make_oom(kind)
        return batch_size, args, kwargs

    return train


# --------------------------------------------------------------------------- the schedule


def test_default_schedule_takes_ninety_percent_rounded_down(helpers: ModuleType) -> None:
    tried: list[int] = []
    train = helpers.find_executable_batch_size(fits_up_to(20, tried), starting_batch_size=128)
    assert train()[0] == 19
    assert tried == NINETY_PERCENT_FROM_128


def test_a_later_call_starts_where_the_last_one_ended(helpers: ModuleType) -> None:
    tried: list[int] = []
    train = helpers.find_executable_batch_size(fits_up_to(100, tried), starting_batch_size=128)
    train()
    tried.clear()
    assert train()[0] == 92
    assert tried == [92]


def test_the_default_starting_size_is_128(helpers: ModuleType) -> None:
    tried: list[int] = []
    helpers.find_executable_batch_size(fits_up_to(1000, tried))()
    assert tried == [128]


def test_reaching_zero_raises_accelerates_error(helpers: ModuleType) -> None:
    tried: list[int] = []
    train = helpers.find_executable_batch_size(fits_up_to(0, tried), starting_batch_size=4)
    with pytest.raises(RuntimeError, match=r"^No executable batch size found, reached zero\."):
        train()
    assert tried == [4, 3, 2, 1]


def test_giving_up_raises_batch_size_exhausted_from_the_last_oom() -> None:
    train = compat.find_executable_batch_size(fits_up_to(0, []), starting_batch_size=2)
    with pytest.raises(koila.BatchSizeExhausted) as caught:
        train()
    assert isinstance(caught.value.__cause__, torch.OutOfMemoryError)
    assert caught.value.__cause__.__traceback__ is None  # it cannot pin the failed attempt
    assert "out of memory. Every batch size tried failed (2 -> 1);" in str(caught.value)


def test_after_giving_up_the_next_call_tries_again() -> None:
    # accelerate stays at zero for ever; memory may have been freed since.
    limit = [0]
    tried: list[int] = []

    def train(batch_size: int) -> int:
        tried.append(batch_size)
        if batch_size > limit[0]:
            raise make_oom()
        return batch_size

    wrapped = compat.find_executable_batch_size(train, starting_batch_size=8)
    with pytest.raises(RuntimeError, match="reached zero"):
        wrapped()
    limit[0] = 8
    assert wrapped() == 8


def test_a_starting_size_of_zero_raises_at_the_call(helpers: ModuleType) -> None:
    tried: list[int] = []
    train = helpers.find_executable_batch_size(fits_up_to(10, tried), starting_batch_size=0)
    with pytest.raises(RuntimeError, match=r"^No executable batch size found, reached zero\.$"):
        train()
    assert tried == []


def test_reduce_batch_size_fn_is_asked_with_no_arguments(helpers: ModuleType) -> None:
    tried: list[int] = []
    size = 128

    def halve() -> int:
        nonlocal size
        size //= 2
        return size

    train = helpers.find_executable_batch_size(fits_up_to(40, tried), 128, halve)
    assert train()[0] == 32
    assert tried == [128, 64, 32]
    assert size == 32  # asked once per out-of-memory error


def test_reduce_batch_size_fn_returning_zero_gives_up(helpers: ModuleType) -> None:
    tried: list[int] = []
    train = helpers.find_executable_batch_size(fits_up_to(0, tried), 16, lambda: 0)
    with pytest.raises(RuntimeError, match="reached zero"):
        train()
    assert tried == [16]


@pytest.mark.parametrize("returned", [16, 17, -1, 2.5, None, True])
def test_reduce_batch_size_fn_must_shrink(returned: object) -> None:
    tried: list[int] = []
    train = compat.find_executable_batch_size(fits_up_to(0, tried), 16, lambda: returned)
    with pytest.raises(ValueError, match=rf"reduce_batch_size_fn returned {returned!r} after batch size 16"):
        train()
    assert tried == [16]


# --------------------------------------------------------------------------- calling


def test_arguments_and_result_pass_through(helpers: ModuleType) -> None:
    tried: list[int] = []
    train = helpers.find_executable_batch_size(fits_up_to(64, tried), starting_batch_size=64)
    assert train(1, "two", three=3) == (64, (1, "two"), {"three": 3})


def test_bare_positional_and_called_forms(helpers: ModuleType) -> None:
    tried: list[int] = []
    find = helpers.find_executable_batch_size
    assert find(fits_up_to(100, tried))()[0] == 92
    assert find(fits_up_to(100, tried), 64)()[0] == 64
    assert find(starting_batch_size=32)(fits_up_to(100, tried))()[0] == 32
    assert find()(fits_up_to(1000, tried))()[0] == 128


def test_passing_the_batch_size_raises_accelerates_type_error(helpers: ModuleType) -> None:
    def train(batch_size: int, model: str) -> None:
        raise AssertionError("not called")

    wrapped = helpers.find_executable_batch_size(train, starting_batch_size=8)
    with pytest.raises(TypeError) as caught:
        wrapped(8, "model")
    assert str(caught.value) == (
        "Batch size was passed into `train` as the first argument when called."
        "Remove this as the decorator already does so: `train(model=model)`"
    )


def test_other_errors_propagate_untouched(helpers: ModuleType) -> None:
    error = ValueError("not memory")
    calls: list[int] = []

    def train(batch_size: int) -> None:
        calls.append(batch_size)
        raise error

    with pytest.raises(ValueError) as caught:
        helpers.find_executable_batch_size(train, starting_batch_size=8)()
    assert caught.value is error
    assert calls == [8]


def test_a_cpu_out_of_memory_error_is_recognised(helpers: ModuleType) -> None:
    tried: list[int] = []
    helpers.find_executable_batch_size(fits_up_to(3, tried, kind="cpu"), starting_batch_size=4)()
    assert tried == [4, 3]


def test_more_out_of_memory_errors_are_recognised_than_by_accelerate() -> None:
    original = pytest.importorskip("accelerate.utils.memory")
    error = RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported")
    assert compat.should_reduce_batch_size(error)
    assert not original.should_reduce_batch_size(error)
    assert compat.should_reduce_batch_size(make_oom())
    assert original.should_reduce_batch_size(make_oom())
    assert not compat.should_reduce_batch_size(ValueError("out of memory."))


# accelerate's device types (its test_utils's torch_device), out-of-tree backends, and Gaudi.
BACKEND_MESSAGES = [
    *(
        f"{device.upper()} out of memory. Tried to allocate 2.00 GiB."
        for device in ("cuda", "hip", "xpu", "npu", "mlu", "musa", "sdaa", "hpu", "neuron", "mps", "cpu")
    ),
    "CPU out of memory.",  # what accelerate's own tests raise without a GPU
    "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed for size::1073741824 (1024)MB",
]


@pytest.mark.parametrize("message", BACKEND_MESSAGES)
def test_every_backend_message_accelerate_recognises_is_recognised(message: str) -> None:
    original = pytest.importorskip("accelerate.utils.memory")
    assert original.should_reduce_batch_size(RuntimeError(message))
    assert compat.should_reduce_batch_size(RuntimeError(message))
    tried: list[int] = []

    def train(batch_size: int) -> int:
        tried.append(batch_size)
        if batch_size > 10:
            raise RuntimeError(message)
        return batch_size

    assert compat.find_executable_batch_size(train, starting_batch_size=12)() == 10
    assert tried == [12, 10]


def test_a_method_receives_the_size_after_self() -> None:
    class Trainer:
        @compat.find_executable_batch_size(starting_batch_size=16)
        def train(self, batch_size: int, steps: int) -> tuple[Any, int, int]:
            if batch_size > 8:
                raise make_oom()
            return self, batch_size, steps

    trainer = Trainer()
    assert trainer.train(3) == (trainer, 8, 3)  # after 16, 14, 12, 10 and 9
    assert trainer.train.stats.batch_size == 8


def test_a_staticmethod_or_classmethod_under_it_binds_as_its_class_would() -> None:
    # Above @staticmethod, a call through an instance passed the instance on as an argument (epochs=<Trainer>,
    # silently); above @classmethod, the class was refused at its definition (probe 76D).
    class Trainer:
        @compat.find_executable_batch_size(starting_batch_size=16)  # type: ignore[misc]
        @staticmethod
        def run(batch_size: int, epochs: int = 1, verbose: bool = False) -> tuple[int, int, bool]:
            if batch_size > 8:
                raise make_oom()
            return batch_size, epochs, verbose

        @compat.find_executable_batch_size(starting_batch_size=8)  # type: ignore[misc]
        @classmethod
        def tune(cls, batch_size: int, steps: int) -> tuple[str, int, int]:
            return cls.__name__, batch_size, steps

    assert Trainer.run(3) == (8, 3, False)
    assert Trainer().run(3) == (8, 3, False)
    assert Trainer.tune(2) == Trainer().tune(2) == ("Trainer", 8, 2)


def test_a_module_is_given_the_size_first_in_its_forward_and_its_signature_says_so() -> None:
    # The guard and the signature read the module's (*args, **kwargs): a call made right was refused.
    class Net(torch.nn.Module):
        def forward(self, batch_size: int, x: torch.Tensor, y: int) -> tuple[int, int]:
            if batch_size > 4:
                raise make_oom()
            return batch_size, y

    wrapped = compat.find_executable_batch_size(Net(), 16)
    assert str(inspect.signature(wrapped)) == "(x: 'torch.Tensor', y: 'int') -> 'tuple[int, int]'"
    assert wrapped(torch.zeros(2), 3) == (4, 3)
    with pytest.raises(TypeError, match=r"Batch size was passed into `[\w.<>]*Net` as the first argument"):
        wrapped(8, torch.zeros(2), 3)


@pytest.mark.parametrize("start", [8, 0])
def test_the_wrappers_signature_leaves_the_size_out_as_koila_batchs_does(start: int) -> None:
    # It said (batch_size, data, epochs=1), and a call made as it said was refused (probe 72E).
    def train(batch_size: int, data: list[int], epochs: int = 1) -> int:
        return batch_size

    wrapped = compat.find_executable_batch_size(train, start)
    assert str(inspect.signature(wrapped)) == str(inspect.signature(koila.batch(train, initial=8)))
    assert str(inspect.signature(wrapped)) == "(data: 'list[int]', epochs: 'int' = 1) -> 'int'"
    assert "batch_size" not in typing.get_type_hints(wrapped)
    bound = inspect.signature(wrapped).bind([1, 2, 3])
    if start:
        assert wrapped(*bound.args, **bound.kwargs) == 8

    class Trainer:
        @compat.find_executable_batch_size(starting_batch_size=start)
        def fit(self, batch_size: int, steps: int) -> int:
            return batch_size

        @classmethod
        @compat.find_executable_batch_size(starting_batch_size=start)
        def tune(cls, batch_size: int, steps: int) -> int:
            return batch_size

    def cls_first(cls: int, batch_size: int) -> int:  # called plainly: the size goes into cls
        return cls

    assert str(inspect.signature(compat.find_executable_batch_size(cls_first, start))) == "(batch_size: 'int') -> 'int'"
    # At start 0, self was taken for the size; a classmethod's hints kept it (probe 72I).
    assert str(inspect.signature(Trainer.fit)) == "(self, steps: 'int') -> 'int'"
    for method in (Trainer().fit, Trainer.tune):
        assert str(inspect.signature(method)) == "(steps: 'int') -> 'int'"
        assert typing.get_type_hints(method) == {"steps": int, "return": int}


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"starting_batch_size": "64"}, TypeError, "starting_batch_size must be an int, got str '64'"),
        ({"starting_batch_size": True}, TypeError, "starting_batch_size must be an int, got bool True"),
        ({"starting_batch_size": -1}, ValueError, "starting_batch_size must be >= 0, got -1"),
        ({"reduce_batch_size_fn": 0.5}, TypeError, "reduce_batch_size_fn must be callable"),
    ],
)
def test_bad_options_are_refused_at_decoration(options: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        compat.find_executable_batch_size(lambda batch_size: None, **options)


def test_a_function_without_a_batch_size_parameter_is_refused() -> None:
    with pytest.raises(TypeError, match="no first positional parameter"):
        compat.find_executable_batch_size(lambda: None)
    with pytest.raises(TypeError, match="wraps a callable, got int 3"):
        compat.find_executable_batch_size(3)  # type: ignore[call-overload]


def test_the_table_maps_accelerates_options_onto_koilas() -> None:
    asked: list[int] = []
    first = compat.TABLE.read({"starting_batch_size": 64, "reduce_batch_size_fn": None, "sync": False})
    second = compat.TABLE.read({"starting_batch_size": 64, "reduce_batch_size_fn": lambda: asked.append(1) or 40})
    assert (first["initial"], first["schedule"], first["sync"]) == (64, koila.scaled(0.9), False)
    assert isinstance(first["cache"], koila.GlobalCache)
    assert first["cache"] is not second["cache"]  # one cache per wrapper
    policy = compat.TABLE.policy(second)
    assert (policy.initial, policy.schedule(64), asked) == (64, 40, [1])
    with pytest.raises(TypeError, match="starting_batch_size must be an int, got NoneType None"):
        compat.TABLE.read({"starting_batch_size": None})  # None stands for no default here


# --------------------------------------------------------------------------- the engine underneath


def test_a_happy_call_collects_no_garbage(helpers: ModuleType) -> None:
    collections: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    train = helpers.find_executable_batch_size(fits_up_to(1000, []), starting_batch_size=8)
    gc.disable()
    gc.callbacks.append(count)
    try:
        for _ in range(3):
            train()
    finally:
        gc.callbacks.remove(count)
        gc.enable()
    if helpers is compat:
        assert collections == []
    else:
        assert collections.count(2) >= 3  # accelerate collects at every call


class Rows(nn.Module):
    """A real model whose activations grow with the batch: 4 KiB a row at width 512."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(64, 512)
        self.outer = nn.Linear(512, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(torch.relu(self.inner(x)))


def test_a_real_out_of_memory_error_is_retried_and_its_memory_released() -> None:
    torch.manual_seed(0)
    model = Rows().eval()
    data = torch.randn(300, 64)
    expected = model(data).detach()
    tried: list[int] = []
    failed: list[weakref.ref[torch.Tensor]] = []
    alive_at_retry: list[bool] = []

    @compat.find_executable_batch_size(starting_batch_size=256)
    def predict(batch_size: int, data: torch.Tensor) -> torch.Tensor:
        tried.append(batch_size)
        alive_at_retry.extend(ref() is not None for ref in failed)
        outputs = []
        for start in range(0, len(data), batch_size):
            rows = data[start : start + batch_size]
            failed.append(weakref.ref(rows))
            outputs.append(model(rows))
        return torch.cat(outputs)

    with torch.no_grad(), simulated_device(256 * 1024):
        result = predict(data)
    torch.testing.assert_close(result, expected)
    assert tried[:3] == [256, 230, 207]
    assert len(tried) > 1
    assert not any(alive_at_retry)


def test_logs_hooks_and_stats_come_from_the_engine(caplog: pytest.LogCaptureFixture) -> None:
    events: list[koila.OOMEvent] = []
    train = compat.find_executable_batch_size(fits_up_to(100, []), starting_batch_size=128, on_oom=events.append)
    with caplog.at_level(logging.INFO, logger="koila_retry"):
        train()
    assert [(event.batch_size, event.next_batch_size) for event in events] == [(128, 115), (115, 103), (103, 92)]
    assert "out of memory at batch size 128" in caplog.text
    assert train.stats.ooms == 3
    assert train.stats.batch_size == 92
    train.cache_clear()
    assert train.cache_info().currsize == 0


# --------------------------------------------------------------------------- release_memory


def test_release_memory_returns_a_none_per_object(helpers: ModuleType) -> None:
    a, b = torch.ones(10), torch.ones(10)
    refs = [weakref.ref(a), weakref.ref(b)]
    released = helpers.release_memory(a, b)
    assert released == [None, None]
    a, b = released
    assert [ref() for ref in refs] == [None, None]
    assert helpers.release_memory() == []


def test_release_memory_collects_cycles() -> None:
    class Node:
        def __init__(self) -> None:
            self.tensor = torch.ones(10)
            self.me = self

    node = Node()
    ref = weakref.ref(node.tensor)
    node = None
    assert ref() is not None  # only a collection frees a cycle
    compat.release_memory()
    assert ref() is None


def test_importing_needs_no_accelerate() -> None:
    code = textwrap.dedent(
        """
        import sys
        sys.modules["accelerate"] = None  # any import of accelerate now fails
        from koila_retry.compat.accelerate import find_executable_batch_size, release_memory
        print(find_executable_batch_size(lambda batch_size: batch_size, 8)(), release_memory(1))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["8", "[None]"]


def test_errors_at_wrapping_name_this_function_and_give_advice_that_it_takes() -> None:
    def keyword_only(*, batch_size: int) -> int:
        return batch_size

    def generator(batch_size: int) -> Iterator[int]:
        yield batch_size

    with pytest.raises(TypeError, match=r"no first positional parameter to receive the batch size; add one$"):
        compat.find_executable_batch_size(keyword_only, 8)  # which takes no param=
    with pytest.raises(TypeError, match=r"^find_executable_batch_size cannot retry .*generator\(\)"):
        compat.find_executable_batch_size(generator, 8)


def test_an_async_function_that_gives_up_raises_with_accelerates_message() -> None:
    # Given up as it is awaited, past the wrapper's own try: the message lost accelerate's start.
    tried: list[int] = []

    @compat.find_executable_batch_size(starting_batch_size=4)
    async def train(batch_size: int) -> int:
        tried.append(batch_size)
        raise make_oom()

    with pytest.raises(
        koila.BatchSizeExhausted, match=r"^No executable batch size found, reached zero\. \S*train: out of memory"
    ):
        asyncio.run(train())
    assert tried == [4, 3, 2, 1]


def test_a_batch_size_passed_by_keyword_is_refused_naming_the_stand_in() -> None:
    @compat.find_executable_batch_size(starting_batch_size=8)
    def train(batch_size: int, epochs: int = 1) -> int:
        return batch_size

    with pytest.raises(TypeError, match=r"train\(\) gets 'batch_size' from find_executable_batch_size;"):
        train(batch_size=4)


class _TopK:
    def __call__(self, batch_size: int, k: int = 5) -> tuple[int, Any]:
        return batch_size, k


def test_a_callable_object_held_by_a_class_gets_the_instance_after_the_size(helpers: ModuleType) -> None:
    # accelerate's wrapper is a function, which a class binds: the object gets the size, then the instance.
    # Its inner koila.batch binds no callable object: the instance was dropped (probe 74G).
    class Holder:
        scored = helpers.find_executable_batch_size(starting_batch_size=8)(_TopK())

    holder = Holder()
    assert holder.scored() == (8, holder)
