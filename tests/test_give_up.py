"""A call that gives up: its message names the user's line, and it costs what the call holds, not the process."""

from __future__ import annotations

import copy
import gc
import inspect
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import koila_retry as koila
from koila_retry._cli import demo
from koila_retry.testing import make_oom, simulated_device


def _line_of(function: Callable[..., Any], text: str) -> int:
    """Return the number of the line of ``function``'s source that contains ``text``."""
    lines, first = inspect.getsourcelines(function)
    (index,) = [index for index, line in enumerate(lines) if text in line]
    return first + index


def _this_line() -> int:
    frame = inspect.currentframe()
    assert frame is not None
    assert frame.f_back is not None
    return frame.f_back.f_lineno


def _big() -> nn.Module:
    # 8 MiB of weights: with their gradients, 16 MiB.
    return nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))


# --------------------------------------------------------------------------- the user's line


def test_an_oom_in_the_backward_that_accumulate_runs_names_the_users_call() -> None:
    # The weights fit, and any batch's forward; their gradients never do: every size fails in backward.
    with simulated_device("12MiB"):
        model = _big()

        @koila.accumulate(initial=4, cache=koila.NoCache())
        def step(inputs: torch.Tensor) -> torch.Tensor:
            return model(inputs).square().mean()

        inputs = torch.randn(4, 1024)
        with pytest.raises(koila.BatchSizeExhausted) as caught:
            line = _this_line() + 1
            step(inputs)
    message = str(caught.value)
    assert f"The last error was raised at {__file__}:{line} in " in message
    assert (
        f":{line} in test_an_oom_in_the_backward_that_accumulate_runs_names_the_users_call (in the backward pass"
        in message
    )
    assert "graph.py" not in message


def test_an_oom_in_a_backward_the_user_calls_names_that_line() -> None:
    class Doubling(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            # A real autograd backward whose allocation fails, as the caching allocator's would.
            raise make_oom()

    events: list[koila.OOMEvent] = []

    @koila.batch(initial=2, cache=koila.NoCache(), on_oom=events.append)
    def train(batch_size: int) -> None:
        x = torch.ones(batch_size, 3, requires_grad=True)
        Doubling.apply(x).sum().backward()

    with pytest.raises(koila.BatchSizeExhausted) as caught:
        train()
    raised = f"{__file__}:{_line_of(Doubling.backward, 'raise make_oom()')} in backward"
    assert f"The last error was raised at {raised}." in str(caught.value)
    assert [event.where for event in events] == [raised, raised]


def test_the_demo_names_its_own_backward_line() -> None:
    lines: list[str] = []
    with pytest.raises(koila.BatchSizeExhausted) as caught:
        demo.run_demo(limit="6MiB", initial=4, epochs=1, print_=lines.append)
    backward = _line_of(demo.run_demo, "loss.backward()")
    assert f"The last error was raised at {demo.__file__}:{backward} in train_epoch." in str(caught.value)


def test_an_oom_inside_another_library_names_the_users_line() -> None:
    # copy.deepcopy (the standard library) copies the weights: the user's line is the deepcopy call.
    events: list[koila.OOMEvent] = []
    with simulated_device("10MiB"):
        model = _big()

        @koila.batch(initial=2, cache=koila.NoCache(), on_oom=events.append)
        def ensemble(batch_size: int) -> list[nn.Module]:
            return [copy.deepcopy(model) for _ in range(batch_size)]

        with pytest.raises(koila.BatchSizeExhausted):
            ensemble()
    line = _line_of(ensemble, "copy.deepcopy(model)")
    assert [event.where for event in events] == [f"{__file__}:{line} in <listcomp>"] * 2


# --------------------------------------------------------------------------- the cost


class _Spy:
    """Counts the garbage collector's full collections and object lists while it is installed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.collections: list[int] = []
        self.object_lists = 0
        collect, get_objects = gc.collect, gc.get_objects

        def counting_collect(generation: int = 2) -> int:
            self.collections.append(generation)
            return collect(generation)

        def counting_get_objects(*args: Any, **kwargs: Any) -> list[Any]:
            self.object_lists += 1
            return get_objects(*args, **kwargs)

        monkeypatch.setattr(gc, "collect", counting_collect)
        monkeypatch.setattr(gc, "get_objects", counting_get_objects)


def test_giving_up_neither_collects_every_object_nor_lists_them(monkeypatch: pytest.MonkeyPatch) -> None:
    with simulated_device("20MiB"):
        encoder = _big()

        @koila.batch(initial=4, cache=koila.NoCache())
        def run(batch_size: int, data: torch.Tensor) -> torch.Tensor:
            return encoder(data[:batch_size].repeat(2000, 1))

        spy = _Spy(monkeypatch)
        with pytest.raises(koila.BatchSizeExhausted) as caught:
            run(torch.randn(4, 1024))
    # A retry collects everything: the hygiene rule. Giving up collects the young generations.
    assert spy.collections == [2, 2, 1]
    assert spy.object_lists == 0
    # What the message says is still there: what the call holds, by name, and the device's total.
    message = str(caught.value)
    assert "Largest on cpu (" in message
    assert "0.weight (parameter) 4.00 MiB; 2.weight (parameter) 4.00 MiB; tensor float32[4, 1024] 16.00 KiB" in message


def _evaluate(model: nn.Module) -> None:
    @koila.batch(initial=2, cache=koila.NoCache())
    def run(batch_size: int) -> None:
        model(torch.randn(batch_size, 1024))
        raise make_oom()

    run()


def test_the_message_names_what_the_users_frames_further_up_hold() -> None:
    # The optimizer is in neither the call nor its caller, but in the frame that called that.
    model = nn.Linear(1024, 1024)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 1024)).sum().backward()
    optimizer.step()
    with pytest.raises(koila.BatchSizeExhausted) as caught:
        _evaluate(model)
    message = str(caught.value)
    assert "optimizer.state[weight].exp_avg (optimizer state) 4.00 MiB" in message
    assert "optimizer.state[weight].exp_avg_sq (optimizer state) 4.00 MiB" in message


# What a module holds, out of reach of a call's frames.
_ELSEWHERE: list[torch.Tensor] = []


def test_the_message_counts_what_the_call_does_not_reach_on_a_simulated_device() -> None:
    with simulated_device("6MiB") as device:
        _ELSEWHERE.append(torch.zeros(256, 1024))  # 1 MiB that no variable of the call or its callers holds

        @koila.batch(initial=2, cache=koila.NoCache())
        def run(batch_size: int) -> None:
            raise make_oom()

        def caller() -> None:
            weights = torch.zeros(512, 1024)  # 2 MiB, a variable of the caller
            run()
            del weights

        with pytest.raises(koila.BatchSizeExhausted) as caught:
            caller()
        live = device.live
        _ELSEWHERE.clear()
    message = str(caught.value)
    assert "weights float32[512, 1024] 2.00 MiB" in message
    assert "1 storage not found among the call's names 1.00 MiB" in message
    assert "(3.00 MiB in 2 storages)" in message
    assert live == 3 * 2**20


def test_the_message_counts_each_storage_the_call_does_not_reach_in_its_totals() -> None:
    with simulated_device("6MiB") as device:
        _ELSEWHERE.extend(torch.zeros(1024) for _ in range(20))  # 20 storages of 4 KiB no variable of the call holds

        @koila.batch(initial=2, cache=koila.NoCache())
        def run(batch_size: int) -> None:
            raise make_oom()

        def caller() -> None:
            first, second = torch.zeros(512, 1024), torch.zeros(256, 1024)  # 2 MiB and 1 MiB, variables of the caller
            run()
            del first, second

        with pytest.raises(koila.BatchSizeExhausted) as caught:
            caller()
        storages = len(device.live_storages())
        _ELSEWHERE.clear()
    message = str(caught.value)
    assert storages == 22
    assert "(3.08 MiB in 22 storages)" in message
    assert "20 storages not found among the call's names 80.00 KiB" in message


def test_giving_up_frees_a_cycle_the_last_attempt_made() -> None:
    refs: list[weakref.ref[torch.Tensor]] = []

    class Node:
        def __init__(self, size: int) -> None:
            self.tensor = torch.ones(size, 1024)
            self.me = self

    @koila.batch(initial=2, cache=koila.NoCache())
    def run(batch_size: int) -> None:
        node = Node(batch_size)
        refs.append(weakref.ref(node.tensor))
        raise make_oom()

    gc.disable()  # only the library's own collections run
    try:
        with pytest.raises(koila.BatchSizeExhausted):
            run()
        assert [ref() for ref in refs] == [None, None]
    finally:
        gc.enable()


def _train_taking_locals(lr: float) -> dict[str, Any]:
    config = locals()  # {'lr': lr}, for a log line say

    @koila.batch(initial=4, minimum=2, cache=koila.NoCache())
    def evaluate(batch_size: int) -> None:
        raise make_oom()

    with pytest.raises(koila.BatchSizeExhausted):
        evaluate()
    return config


def test_giving_up_leaves_a_namespace_taken_with_locals_in_the_users_frames() -> None:
    # The message walks the user's frames; before Python 3.13, reading a frame's variables
    # fills the dict locals() returned, and emptying it after the read emptied the user's.
    config = _train_taking_locals(0.1)
    assert config["lr"] == 0.1
    assert "{lr}".format(**config) == "0.1"


def _holds_then_drops(references: list[weakref.ref[torch.Tensor]]) -> None:
    @koila.batch(initial=2, cache=koila.NoCache())
    def run(batch_size: int) -> None:
        raise make_oom()

    kept = torch.zeros(1000)
    references.append(weakref.ref(kept))
    with pytest.raises(koila.BatchSizeExhausted):
        run()  # the message's walk reads this frame's variables, kept among them
    del kept
    assert references[0]() is None  # the read left no copy of them behind in the frame


def test_giving_up_leaves_no_copy_of_the_users_variables_behind() -> None:
    references: list[weakref.ref[torch.Tensor]] = []
    _holds_then_drops(references)
    assert len(references) == 1


def test_the_full_report_still_lists_every_tensor() -> None:
    kept = torch.zeros(3, 5, 7)
    rows = koila.report(device="cpu", top=10_000).rows
    assert any(row.shape == (3, 5, 7) for row in rows)
    del kept


# --------------------------------------------------------------------------- what a simulated device counts


def test_on_a_simulated_device_the_message_lists_only_what_it_counts() -> None:
    # Weights made before the block do not count against its limit: listing them as the
    # largest holders (16 MiB on a 64 KiB device) would point at what cannot be the cause.
    model = nn.Linear(2048, 2048)  # 16 MiB of weights, outside the device

    @koila.batch(initial=8, cache=koila.NoCache())
    def run(batch_size: int) -> torch.Tensor:
        return model(torch.randn(batch_size, 2048).repeat(8, 1))

    def caller() -> None:
        kept = torch.zeros(4096)  # 16 KiB, made inside: counted
        run()
        del kept

    with simulated_device("64KiB") as device, pytest.raises(koila.BatchSizeExhausted) as caught:
        caller()
    assert device.live == 0
    message = str(caught.value)
    assert "weight (parameter)" not in message
    assert "bias (parameter)" not in message
    assert "Largest on cpu (16.00 KiB in 1 storage): kept float32[4096] 16.00 KiB." in message


def test_on_a_simulated_device_that_holds_nothing_the_message_lists_nothing() -> None:
    model = nn.Linear(2048, 2048)

    @koila.batch(initial=2, cache=koila.NoCache())
    def run(batch_size: int) -> torch.Tensor:
        return model(torch.randn(batch_size, 2048).repeat(16, 1))

    with simulated_device("64KiB"), pytest.raises(koila.BatchSizeExhausted) as caught:
        run()
    assert "Largest on cpu (0 bytes in 0 storages): nothing." in str(caught.value)
