"""@koila.batch: injection, signatures, methods, async, hooks, logs, stats, errors, real models."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import sys
import time
import traceback
from typing import Any

import pytest
import torch
from torch import nn

import koila_retry as koila
from koila_retry.testing import make_oom, oom_above, simulated_device


def test_bare_and_called_forms() -> None:
    @koila.batch
    def bare(batch_size: int) -> int:
        return batch_size

    @koila.batch()
    def called(batch_size: int) -> int:
        return batch_size

    @koila.batch(initial=64)
    def configured(batch_size: int) -> int:
        return batch_size

    assert bare() == 512
    assert called() == 512
    assert configured() == 64


def test_size_goes_first_and_arguments_pass_through() -> None:
    @koila.batch(initial=8)
    def collect(batch_size: int, a: int, b: int = 0, *, c: int = 0) -> tuple[int, int, int, int]:
        return batch_size, a, b, c

    assert collect(1, 2, c=3) == (8, 1, 2, 3)
    assert collect(a=5) == (8, 5, 0, 0)


def test_param_injects_a_keyword() -> None:
    @koila.batch(initial=16, param="chunk")
    def run(data: list[int], *, chunk: int) -> tuple[list[int], int]:
        return data, chunk

    assert run([1, 2]) == ([1, 2], 16)
    assert list(inspect.signature(run).parameters) == ["data"]


def test_signature_and_metadata_omit_the_injected_parameter() -> None:
    def evaluate(batch_size: int, model: nn.Module, data: torch.Tensor) -> torch.Tensor:
        """Evaluate in batches."""
        return data

    wrapped = koila.batch(evaluate)
    assert list(inspect.signature(wrapped).parameters) == ["model", "data"]
    assert wrapped.__name__ == "evaluate"
    assert wrapped.__doc__ == "Evaluate in batches."
    assert wrapped.__wrapped__ is evaluate  # type: ignore[attr-defined]


def test_caller_passing_the_size_gets_a_type_error() -> None:
    @koila.batch(initial=4)
    def run(batch_size: int, x: int) -> int:
        return batch_size + x

    with pytest.raises(TypeError, match="gets 'batch_size' from @koila.batch"):
        run(1, 2)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="gets 'batch_size' from @koila.batch"):
        run(2, batch_size=3)  # type: ignore[call-arg]


def test_caller_passing_a_named_size_gets_a_type_error() -> None:
    @koila.batch(param="bs")
    def run(x: int, bs: int = 1) -> int:
        return x + bs

    with pytest.raises(TypeError, match="gets 'bs' from @koila.batch"):
        run(1, bs=2)


def test_param_makes_the_parameters_after_it_keyword_only_in_the_signature() -> None:
    # The size goes by keyword, so a later parameter passed by position would land on it.
    @koila.batch(param="n", initial=8)
    def predict(x: int, n: int, scale: float = 1.0, *rest: int, flag: bool = False) -> tuple[int, int, float]:
        return x, n, scale

    signature = inspect.signature(predict)
    assert str(signature) == ("(x: 'int', *, scale: 'float' = 1.0, flag: 'bool' = False) -> 'tuple[int, int, float]'")
    assert predict(1, scale=2.0) == (1, 8, 2.0)
    assert signature.bind(1, scale=2.0).arguments == {"x": 1, "scale": 2.0}
    with pytest.raises(TypeError, match="too many positional arguments"):
        signature.bind(1, 2.0)
    message = (
        r"predict\(\) takes 1 positional argument \('x'\) under @koila.batch\(param='n'\), which passes 'n' "
        r"by keyword, but got 2: pass 'scale' by keyword"
    )
    with pytest.raises(TypeError, match=message):
        predict(1, 2.0)  # type: ignore[call-arg]


def test_param_over_a_function_with_keyword_arguments_counts_only_its_positional_parameters() -> None:
    # **options was counted among the positional ones: "takes 2 positional arguments ('inputs', 'options')".
    @koila.batch(initial=8, param="chunk_size")
    def predict(inputs: list[int], chunk_size: int, **options: Any) -> tuple[Any, ...]:
        return inputs, chunk_size, options

    assert predict([1, 2], flag=True) == ([1, 2], 8, {"flag": True})
    message = r"\.predict\(\) takes 1 positional argument \('inputs'\) under @koila.batch\(param='chunk_size'\)"
    with pytest.raises(TypeError, match=message):
        predict([1, 2], 64)  # type: ignore[call-arg]


def test_param_keeps_the_signature_of_a_keyword_only_size_and_of_what_comes_before_it() -> None:
    @koila.batch(param="n", initial=8)
    def predict(x: int, /, y: int, *rest: int, n: int, scale: float = 1.0) -> tuple[int, ...]:
        return (x, y, *rest, n)

    assert str(inspect.signature(predict)) == (
        "(x: 'int', /, y: 'int', *rest: 'int', scale: 'float' = 1.0) -> 'tuple[int, ...]'"
    )
    assert predict(1, 2, 3, 4) == (1, 2, 3, 4, 8)


class Evaluator:
    def __init__(self, offset: int) -> None:
        self.offset = offset

    @koila.batch(initial=32)
    def evaluate(self, batch_size: int, x: int) -> int:
        return self.offset + batch_size + x

    @classmethod
    @koila.batch(initial=16)
    def build(cls, batch_size: int) -> tuple[type, int]:
        return cls, batch_size

    @staticmethod
    @koila.batch(initial=8)
    def helper(batch_size: int, x: int) -> int:
        return batch_size * x


def test_methods_get_the_size_after_self() -> None:
    assert Evaluator(100).evaluate(1) == 133
    assert list(inspect.signature(Evaluator.evaluate).parameters) == ["self", "x"]
    assert list(inspect.signature(Evaluator(0).evaluate).parameters) == ["x"]


def test_classmethods_and_staticmethods() -> None:
    assert Evaluator.build() == (Evaluator, 16)
    assert Evaluator.helper(2) == 16


def test_method_recovers_from_oom() -> None:
    fits = oom_above(10)

    class Model:
        @koila.batch(initial=100)
        def run(self, batch_size: int) -> int:
            fits(batch_size)
            return batch_size

    assert Model().run() == 8


class Renamed:
    """Methods whose first parameter is not called self."""

    @koila.batch(initial=32)
    def run(this, batch_size: int, x: int) -> tuple[object, int, int]:
        return this, batch_size, x

    @koila.batch(initial=8)
    async def fetch(this, batch_size: int) -> tuple[object, int]:
        return this, batch_size


class Subclass(Renamed):
    def run(self, x: int) -> tuple[object, int, int]:
        return super().run(x + 1)  # type: ignore[no-any-return]


def test_a_method_gets_the_size_after_its_instance_whatever_its_first_parameter_is_called() -> None:
    model = Renamed()
    assert model.run(1) == (model, 32, 1)
    assert Subclass().run(1)[1:] == (32, 2)
    assert asyncio.run(model.fetch()) == (model, 8)
    assert inspect.iscoroutinefunction(model.fetch)
    assert list(inspect.signature(model.run).parameters) == ["x"]


def test_a_method_under_another_decorator_that_binds_gets_the_size_after_its_instance() -> None:
    """@torch.no_grad() above @koila.batch binds and calls the wrapper with the instance first: not as the size."""

    class Scorer:
        scale = 3

        @torch.no_grad()
        @koila.batch(initial=16)
        def score(self, batch_size: int, x: torch.Tensor) -> torch.Tensor:
            return torch.cat([chunk * self.scale for chunk in x.split(batch_size)]) + batch_size

        @property
        @koila.batch(initial=4)
        def size(self, batch_size: int) -> tuple[object, int]:
            return self, batch_size

    scorer = Scorer()
    assert torch.equal(scorer.score(torch.ones(4)), torch.full((4,), 19.0))
    assert scorer.size == (scorer, 4)
    # A first parameter of another name is the size when called as it is, as documented.
    assert koila.batch(initial=2)(lambda n, x: n + x)(1) == 3


def test_a_method_looked_up_on_its_class_takes_the_instance_first() -> None:
    model = Renamed()
    assert Renamed.run(model, 1) == (model, 32, 1)
    assert list(inspect.signature(Renamed.run).parameters) == ["this", "x"]


def test_a_decorated_function_attached_to_a_class_later_is_bound_as_a_method() -> None:
    fits = oom_above(4)

    def run(self: object, batch_size: int, x: int) -> tuple[object, int, int]:
        fits(batch_size)
        return self, batch_size, x

    class Model:
        pass

    Model.run = koila.batch(initial=16)(run)  # type: ignore[attr-defined]
    model = Model()
    assert model.run(2) == (model, 4, 2)  # type: ignore[attr-defined]
    assert model.run.stats.ooms == 2  # type: ignore[attr-defined]


def test_binding_decides_where_the_size_goes_not_parameter_names() -> None:
    def pair(first: object, second: object) -> tuple[object, object]:
        return first, second

    wrapped = koila.batch(initial=8)(pair)

    class Holder:
        method = wrapped

    holder = Holder()
    assert wrapped("plain") == (8, "plain")  # called as it is: the size goes first
    assert holder.method() == (holder, 8)  # bound: after the instance


def test_classmethods_and_staticmethods_under_the_decorator() -> None:
    class Factory:
        @koila.batch(initial=16)
        @classmethod
        def build(klass, batch_size: int) -> tuple[type, int]:
            return klass, batch_size

        @koila.batch(initial=4)
        @staticmethod
        def helper(batch_size: int, x: int) -> tuple[int, int]:
            return batch_size, x

    assert Factory.build() == (Factory, 16)
    assert Factory().build() == (Factory, 16)
    assert Factory.helper(2) == (4, 2)
    assert Factory().helper(3) == (4, 3)
    assert Factory().build.stats.calls == 2


def test_the_bound_form_shares_the_stats_and_the_cache() -> None:
    fits = oom_above(2)

    class Model:
        @koila.batch(initial=8)
        def run(self, batch_size: int) -> int:
            fits(batch_size)
            return batch_size

    model = Model()
    assert model.run() == 2
    assert model.run.stats is Model.run.stats is Model.__dict__["run"].stats
    assert (model.run.stats.calls, model.run.stats.ooms) == (1, 2)
    assert model.run.cache_info().currsize == 1
    model.run.cache_clear()
    assert Model.__dict__["run"].cache_info().currsize == 0


def test_a_method_without_a_parameter_after_its_instance_is_refused_when_bound() -> None:
    class Model:
        @koila.batch(initial=8)
        def run(self) -> object:
            return self

    with pytest.raises(TypeError, match=r"run\(\) is called through an instance .* no second positional parameter"):
        Model().run()


def test_a_method_under_a_simulated_device_settles_on_a_size_that_fits() -> None:
    torch.manual_seed(0)

    class Scorer:
        def __init__(self) -> None:
            self.model = nn.Linear(256, 1024)

        @koila.batch(initial=1024, cache=koila.NoCache())
        def score(me, batch_size: int, data: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():  # each part's output: batch_size x 1024 floats, 4 MiB at 1024 rows
                return sum(me.model(part).sum() for part in data.split(batch_size))

    scorer = Scorer()
    data = torch.randn(1024, 256)
    with simulated_device("3MiB"):
        total = scorer.score(data)
    assert torch.allclose(total, scorer.model(data).sum(), rtol=1e-4)
    assert (scorer.score.stats.ooms, scorer.score.stats.batch_size) == (1, 512)


def test_a_module_level_wrapper_pickles_by_name() -> None:
    import pickle

    assert pickle.loads(pickle.dumps(picklable)) is picklable


@koila.batch(initial=2)
def picklable(batch_size: int) -> int:
    return batch_size


def test_async_function() -> None:
    fits = oom_above(20)
    tried: list[int] = []

    @koila.batch(initial=128)
    async def fetch(batch_size: int, delay: float) -> int:
        tried.append(batch_size)
        await asyncio.sleep(delay)
        fits(batch_size)
        return batch_size

    assert inspect.iscoroutinefunction(fetch)
    assert asyncio.run(fetch(0)) == 16
    assert tried == [128, 64, 32, 16]
    assert asyncio.run(fetch(0)) == 16  # the cache carries over
    assert tried[4:] == [16]


def test_an_object_whose_call_is_an_async_def_is_retried_as_async() -> None:
    # Its call makes a coroutine: run as a plain function, the OOM came when the caller awaited it,
    # outside the retry, and the stats said the call had worked (probe 71B).
    fits = oom_above(64)

    class Scorer:
        async def __call__(self, batch_size: int) -> int:
            fits(batch_size)
            return batch_size

    score = koila.batch(initial=512)(Scorer())
    assert inspect.iscoroutinefunction(score)
    assert asyncio.run(score()) == 64
    assert (score.stats.calls, score.stats.ooms) == (1, 3)


def test_a_sync_wrapper_of_an_async_def_or_a_generator_is_run_as_the_sync_function_it_is() -> None:
    # What a decorator's wrapper returns is in its code, not in what it wraps: these run the coroutine
    # and consume the generator themselves (probe 71F, of a first fix that read through them).
    def synced(fn: Any) -> Any:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            return asyncio.run(fn(*args, **kwargs))

        return run

    def listed(fn: Any) -> Any:
        @functools.wraps(fn)
        def collect(*args: Any, **kwargs: Any) -> Any:
            return list(fn(*args, **kwargs))

        return collect

    fits = oom_above(2)

    @synced
    async def total(batch_size: int, x: torch.Tensor) -> torch.Tensor:
        fits(batch_size)
        return x[:batch_size].sum()

    @listed
    def per_row(batch_size: int, x: torch.Tensor) -> Any:
        fits(batch_size)
        yield from x[:batch_size].sum(1)

    assert koila.batch(initial=8)(total)(torch.ones(4)) == 2
    assert koila.batch(initial=8)(per_row)(torch.ones(4, 3)) == [3, 3]
    joined = koila.chunked(listed(lambda rows: (yield rows.sum(1))), torch.ones(4, 3), initial=2)
    assert len(joined) == 1
    torch.testing.assert_close(joined[0], torch.full((4,), 3.0))


def test_a_callable_whose_call_is_a_generator_is_refused() -> None:
    class Rows:
        def __call__(self, batch_size: int) -> Any:
            yield batch_size

    with pytest.raises(TypeError, match=r"cannot retry .*: it is a generator function"):
        koila.batch(Rows())


def test_a_method_of_an_object_that_is_its_own_iterator_is_retried() -> None:
    # The object a method is bound to is not an argument that an attempt may have consumed
    # in part: retried as accumulate's and chunked's methods are (probe 71B).
    fits = oom_above(64)

    class Stream:
        def __init__(self, items: list[int]) -> None:
            self.items = iter(items)

        def __iter__(self) -> Stream:
            return self

        def __next__(self) -> int:
            return next(self.items)

        @koila.batch(initial=512)
        def score(self, batch_size: int, x: torch.Tensor) -> int:
            fits(batch_size)
            return batch_size

        @koila.batch(initial=512, param="size")
        def named(self, x: torch.Tensor, size: int = 0) -> int:
            fits(size)
            return size

    stream = Stream([1, 2, 3])
    assert stream.score(torch.ones(3)) == stream.named(torch.ones(3)) == 64
    assert Stream.score(stream, torch.ones(3)) == 64
    assert list(stream) == [1, 2, 3], "the instance was not iterated"
    with pytest.raises(TypeError, match=r"argument 0 \(list_iterator\) is an iterator"):
        stream.score(iter([torch.ones(3)]))  # an argument that is one is still refused a retry


def test_a_method_looked_up_on_its_class_and_called_without_an_instance_says_so() -> None:
    # It was an IndexError from koila's own lambda, inside the attempt (probe 71B).
    class Model:
        @koila.batch(initial=8)
        def run(self, batch_size: int) -> int:
            return batch_size

        @koila.batch(initial=8, param="size")
        def named(self, size: int = 0) -> int:
            return size

    for method, name in ((Model.run, "run"), (Model.named, "named")):
        with pytest.raises(TypeError, match=rf"^.*Model\.{name}\(\) is a method: call it on an instance, or pass"):
            method()
    assert Model.run.stats.calls == Model.named.stats.calls == 0


def test_sequence_of_sizes_and_stats() -> None:
    tried: list[int] = []
    fits = oom_above(100)

    @koila.batch(initial=1000)
    def run(batch_size: int) -> int:
        tried.append(batch_size)
        fits(batch_size)
        return batch_size

    def call_site() -> int:
        return run()

    assert call_site() == 64
    assert tried == [1000, 512, 256, 128, 64]
    assert run.stats.calls == 1
    assert run.stats.ooms == 4
    assert run.stats.batch_size == 64
    assert run.stats.seconds_lost > 0
    assert run.stats.exhausted == 0
    assert call_site() == 64  # same call site: starts at the size that worked
    assert tried[5:] == [64]
    assert run.stats.as_dict()["calls"] == 2


def test_real_model_settles_on_largest_power_of_two_that_fits() -> None:
    torch.manual_seed(0)
    tried: list[int] = []
    with simulated_device("24MiB") as device:
        model = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(8 * 16 * 16, 64),
            nn.ReLU(),
            nn.Linear(64, 10),
        )

        @koila.batch(initial=1024)
        def train_step(batch_size: int) -> float:
            tried.append(batch_size)
            x = torch.randn(batch_size, 3, 16, 16)
            y = torch.randint(0, 10, (batch_size,))
            model.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            return loss.item()

        train_step()
        settled = train_step.stats.batch_size
        assert tried == [1024, 512, 256, 128][: len(tried)]
        assert tried[-1] == settled
        assert len(tried) > 1  # 1024 must not fit in 24 MiB
        # The settled size fits and twice that size does not: it is the largest power of two.
        model.zero_grad(set_to_none=True)
        with pytest.raises(torch.OutOfMemoryError):
            x = torch.randn(settled * 2, 3, 16, 16)
            nn.functional.cross_entropy(model(x), torch.zeros(settled * 2, dtype=torch.long)).backward()
        assert device.peak <= device.limit


def test_model_on_parameters_keeps_weights_after_failed_attempts() -> None:
    # A failed attempt must not leave the model half-updated: nothing here steps before the OOM.
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with simulated_device("1MiB"):

        @koila.batch(initial=4096)
        def forward(batch_size: int) -> torch.Tensor:
            with torch.no_grad():
                return model(torch.ones(batch_size, 64)).sum()

        forward()
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name])


def test_on_oom_hook_gets_events_without_the_exception() -> None:
    events: list[koila.OOMEvent] = []
    fits = oom_above(300)

    @koila.batch(initial=1000, on_oom=events.append)
    def run(batch_size: int) -> int:
        fits(batch_size)
        return batch_size

    run()
    assert [(e.batch_size, e.next_batch_size, e.attempt) for e in events] == [(1000, 512, 1), (512, 256, 2)]
    event = events[0]
    assert event.function.endswith("test_on_oom_hook_gets_events_without_the_exception.<locals>.run")
    assert event.device == torch.device("cpu")
    assert event.free_bytes > 0
    assert event.seconds >= 0
    assert "test_batch.py" in event.where  # the line that called the injector, not the injector
    assert not any(isinstance(value, BaseException) for value in vars(event).values())


def test_on_oom_hook_sees_the_final_failure() -> None:
    events: list[koila.OOMEvent] = []

    @koila.batch(initial=2, on_oom=events.append)
    def run(batch_size: int) -> None:
        raise make_oom()

    with pytest.raises(koila.BatchSizeExhausted):
        run()
    assert [e.next_batch_size for e in events] == [1, None]


def test_stats_name_a_size_that_ran_when_an_on_oom_hook_raises() -> None:
    class Stop(Exception):
        pass

    def hook(event: koila.OOMEvent) -> None:
        seen.append(run.stats.batch_size)
        if len(seen) == 1:
            raise Stop

    seen: list[int] = []
    fits = oom_above(300)

    @koila.batch(initial=1000, on_oom=hook)
    def run(batch_size: int) -> int:
        fits(batch_size)
        return batch_size

    with pytest.raises(Stop):
        run()
    # The hook sees the size that failed, and 512 never ran: the stats keep 1000.
    assert (seen, run.stats.batch_size) == ([1000], 1000)
    assert run() == 256  # the next call, whose hook lets it go on
    assert (seen, run.stats.batch_size) == ([1000, 1000, 512], 256)


def test_a_hook_that_calls_the_wrapper_again_leaves_the_outer_calls_size_in_the_stats() -> None:
    sizes: list[tuple[int, int]] = []

    def hook(event: koila.OOMEvent) -> None:
        if len(sizes) < 2:
            run(fits=10**6)  # an inner call at the start size, which fits

    def body(batch_size: int, fits: int) -> int:
        sizes.append((batch_size, run.stats.batch_size))  # each attempt's size, and what the stats say it is
        oom_above(fits)(batch_size)
        return batch_size

    run = koila.batch(initial=1000, cache=koila.NoCache(), on_oom=hook)(body)
    assert run(fits=300) == 256
    assert sizes == [(1000, 1000), (1000, 1000), (512, 512), (256, 256)]
    assert run.stats.batch_size == 256


def test_each_reduction_is_logged_at_info(caplog: pytest.LogCaptureFixture) -> None:
    fits = oom_above(200)

    @koila.batch(initial=1000)
    def run(batch_size: int) -> int:
        fits(batch_size)
        return batch_size

    with caplog.at_level(logging.INFO, logger="koila_retry"):
        run()
    reductions = [r for r in caplog.records if r.name == "koila_retry"]
    assert [r.levelno for r in reductions] == [logging.INFO] * 3
    assert "out of memory at batch size 1000" in reductions[0].getMessage()
    assert "retrying at 512" in reductions[0].getMessage()
    assert "retrying at 128" in reductions[2].getMessage()


def test_exhaustion_raises_from_the_last_oom() -> None:
    @koila.batch(initial=4)
    def run(batch_size: int) -> None:
        raise make_oom("cpu")

    with pytest.raises(koila.BatchSizeExhausted) as excinfo:
        run()
    error = excinfo.value
    assert isinstance(error, torch.OutOfMemoryError)  # existing handlers still catch it
    assert error.batch_size == 1
    assert error.attempts == 3
    assert isinstance(error.__cause__, RuntimeError)
    assert "DefaultCPUAllocator" in str(error.__cause__)
    message = str(error)
    assert "4 -> 2 -> 1" in message
    assert "batch size 1 is the minimum" in message
    assert "test_batch.py" in message  # where the last error was raised
    assert "free on cpu" in message
    assert run.stats.exhausted == 1


def test_the_free_memory_a_give_up_reports_is_said_to_be_after_the_release() -> None:
    """It read "12.00 KiB free" beside a diagnosis of 8 KiB asked for with 4 KiB free: two moments, unsaid."""
    with simulated_device("16KiB"), pytest.raises(koila.BatchSizeExhausted) as info:
        koila.batch(lambda batch_size: torch.ones(batch_size, 1024), initial=8, minimum=8, cache=koila.NoCache())()
    message = str(info.value)
    assert "Once the failed attempt was released, " in message
    assert message.index("Once the failed attempt was released") < message.index("Diagnosis: capacity (asked for")


def test_exhaustion_with_minimum() -> None:
    @koila.batch(initial=100, minimum=30)
    def run(batch_size: int) -> None:
        raise make_oom()

    with pytest.raises(koila.BatchSizeExhausted, match=r"100 -> 64 -> 32 -> 30\); batch size 30 is the minimum"):
        run()


def test_exhaustion_message_for_max_attempts() -> None:
    @koila.batch(initial=100, max_attempts=2)
    def run(batch_size: int) -> None:
        raise make_oom()

    with pytest.raises(koila.BatchSizeExhausted, match="gave up after max_attempts=2 attempts"):
        run()


def test_exhaustion_message_for_a_schedule_that_gives_up() -> None:
    """A schedule that returns None ends the call there: the message says so, not max_attempts."""

    def halve_once(size: int) -> int | None:
        return size // 2 if size > 50 else None

    @koila.batch(initial=100, schedule=halve_once, cache=koila.NoCache())
    def run(batch_size: int) -> None:
        raise make_oom()

    with pytest.raises(koila.BatchSizeExhausted) as caught:
        run()
    message = str(caught.value)
    assert "(100 -> 50); the schedule gave up after batch size 50 (it returned None)." in message
    assert "max_attempts" not in message


def test_batch_size_exhausted_pickles() -> None:
    import pickle

    error = koila.BatchSizeExhausted("nothing fits", batch_size=2, attempts=5)
    error.add_note("3 of 8 rows were finished before it gave up.")  # chunked's note: lost by pickle once
    copy = pickle.loads(pickle.dumps(error))
    assert (type(copy), str(copy), copy.batch_size, copy.attempts) == (koila.BatchSizeExhausted, "nothing fits", 2, 5)
    assert copy.__notes__ == ["3 of 8 rows were finished before it gave up."]


def _raise_value_error() -> None:
    raise ValueError("bad input")


@pytest.mark.parametrize("error", [ValueError("bad input"), KeyboardInterrupt(), SystemExit(3)])
def test_other_exceptions_pass_through_untouched(error: BaseException) -> None:
    calls: list[int] = []

    @koila.batch(initial=64)
    def run(batch_size: int) -> None:
        calls.append(batch_size)
        raise error

    with pytest.raises(type(error)) as excinfo:
        run()
    assert excinfo.value is error
    assert calls == [64]  # no retry
    assert run.stats.ooms == 0
    # The original traceback is intact: it still reaches the line that raised.
    frames = [frame.name for frame in traceback.extract_tb(excinfo.value.__traceback__)]
    assert frames[-1] == "run"


def test_pass_through_keeps_the_deepest_frame() -> None:
    @koila.batch(initial=8)
    def run(batch_size: int) -> None:
        _raise_value_error()

    with pytest.raises(ValueError, match="bad input") as excinfo:
        run()
    assert traceback.extract_tb(excinfo.value.__traceback__)[-1].name == "_raise_value_error"


def test_non_oom_after_an_oom_passes_through() -> None:
    calls: list[int] = []

    @koila.batch(initial=8)
    def run(batch_size: int) -> None:
        calls.append(batch_size)
        if batch_size == 8:
            raise make_oom()
        raise ValueError("later failure")

    with pytest.raises(ValueError, match="later failure"):
        run()
    assert calls == [8, 4]


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"initial": 0}, ValueError, "initial must be >= 1, got 0"),
        ({"initial": -5}, ValueError, "initial must be >= 1, got -5"),
        ({"initial": 2.5}, TypeError, "initial must be an int, got float 2.5"),
        ({"initial": True}, TypeError, "initial must be an int, got bool True"),
        ({"minimum": 0}, ValueError, "minimum must be >= 1, got 0"),
        ({"initial": 8, "minimum": 16}, ValueError, r"minimum \(16\) must not exceed initial \(8\)"),
        ({"max_attempts": 0}, ValueError, "max_attempts must be >= 1, got 0"),
        ({"on_oom": "print"}, TypeError, "on_oom must be callable, got str 'print'"),
        # A callable the engine cannot call as it will ended the call at the first out-of-memory error.
        ({"on_oom": lambda: None}, TypeError, r"on_oom is called with one OOMEvent, but .* takes \(\)"),
        ({"schedule": lambda failed, floor: 1}, TypeError, r"schedule is called with the batch size that failed"),
        ({"grow": True, "clock": lambda start: 0.0}, TypeError, r"clock is called with no arguments"),
        ({"cache": {}}, TypeError, "cache must be a koila_retry cache"),
        (
            {"cache": koila.GlobalCache},
            TypeError,
            r"another SizeCache\), got the class GlobalCache: give an instance, GlobalCache\(\)",
        ),
        ({"schedule": koila.scaled}, TypeError, r"got the class scaled: give an instance of it \(koila.scaled\(0.5\)"),
        ({"device": 3.5}, TypeError, "device must be a torch.device"),
        ({"device": "nonsense"}, ValueError, "'nonsense' is not a device PyTorch knows"),
    ],
)
def test_bad_options(options: dict[str, object], error: type[Exception], message: str) -> None:
    def run(batch_size: int) -> int:
        return batch_size

    with pytest.raises(error, match=message):
        koila.batch(**options)(run)  # type: ignore[call-overload]


def _two_arguments(event: object, log: str) -> None:
    pass


def _with_a_logger(function: Any) -> Any:
    @functools.wraps(function)
    def wrapper(event: object) -> None:
        function(event, "log")

    return wrapper


def test_callables_that_take_what_the_engine_gives_are_accepted() -> None:
    events: list[koila.OOMEvent] = []
    for options in (
        {"on_oom": events.append},  # a builtin method
        {"on_oom": lambda *events: None},
        {"on_oom": lambda event, *, extra=1: None},
        {"schedule": lambda failed, floor=1: failed // 2},
        {"schedule": koila.scaled(0.5)},
        {"grow": True, "clock": time.process_time},
        {"on_oom": _with_a_logger(_two_arguments)},  # functools.wraps: the wrapper's signature, not the inner's
    ):
        assert koila.batch(initial=8, **options)(lambda batch_size: batch_size)() == 8  # type: ignore[call-overload]


def test_an_options_callables_are_checked_once_not_at_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call form in a loop read the signatures at every call, some 20 us each."""
    calls: list[object] = []
    signature = inspect.signature

    def counted(function: Any, **options: Any) -> inspect.Signature:
        calls.append(function)
        return signature(function, **options)

    def on_oom(event: object) -> None:
        pass

    monkeypatch.setattr(inspect, "signature", counted)
    for _ in range(5):
        koila.chunked(lambda rows: rows * 2, torch.ones(8, 3), on_oom=on_oom, schedule=koila.scaled(0.5))
    assert calls == [on_oom]


def test_function_without_a_parameter_to_inject_into() -> None:
    def nothing() -> None:
        pass

    def only_keywords(*, size: int) -> None:
        pass

    with pytest.raises(TypeError, match=r"nothing\(\) has no first positional parameter"):
        koila.batch(nothing)
    with pytest.raises(TypeError, match=r"only_keywords\(\) has no first positional parameter"):
        koila.batch(only_keywords)
    with pytest.raises(TypeError, match=r"has no parameter 'bs' that can be passed by keyword"):
        koila.batch(param="bs")(nothing)


def test_a_module_whose_forward_takes_the_size_first_is_decorated_by_its_forward() -> None:
    # A module's call takes (*args, **kwargs): it was refused, said to have no first positional
    # parameter, where its forward has one (probe 71B).
    fits = oom_above(4)

    class Head(nn.Module):
        def forward(self, batch_size: int, x: torch.Tensor) -> torch.Tensor:
            fits(batch_size)
            return x[:batch_size]

    head = koila.batch(Head(), initial=16)
    assert str(inspect.signature(head)) == "(x: 'torch.Tensor') -> 'torch.Tensor'"
    assert head(torch.ones(10)).shape == (4,)
    assert (head.stats.ooms, head.stats.batch_size) == (2, 4)
    # Through the wrappers that call the module they hold (probe 71F).
    for wrapped in (torch.compile(Head(), backend="eager"), nn.DataParallel(Head())):
        assert koila.batch(wrapped, initial=4)(torch.ones(10)).shape == (4,)


def test_a_module_with_a_call_of_its_own_is_decorated_by_that_call() -> None:
    # Its forward's parameters were read first, where its __call__ takes the size (probe 71F).
    class Sliced(nn.Module):
        def __call__(self, batch_size: int, x: torch.Tensor) -> torch.Tensor:
            return super().__call__(x[:batch_size])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.sum()

    assert koila.batch(Sliced(), initial=2)(torch.ones(10)) == 2
    # Compiled, or in a wrapper that forwards to it: by that call too (refused as taking no size, probe 76I).
    compiled = koila.batch(torch.compile(Sliced(), backend="eager"), initial=2)
    assert str(inspect.signature(compiled)) == "(x: 'torch.Tensor') -> 'torch.Tensor'"
    assert compiled(torch.ones(10)) == 2


def test_positional_only_parameter_cannot_be_named() -> None:
    def run(bs: int, /) -> None:
        pass

    with pytest.raises(TypeError, match="has no parameter 'bs'"):
        koila.batch(param="bs")(run)


def test_not_a_callable() -> None:
    with pytest.raises(TypeError, match="decorates a callable, got int 3"):
        koila.batch(3)  # type: ignore[call-overload]


def test_explicit_device_is_used() -> None:
    events: list[koila.OOMEvent] = []
    fits = oom_above(1)

    @koila.batch(initial=4, device="cpu", on_oom=events.append)
    def run(batch_size: int) -> int:
        fits(batch_size)
        return batch_size

    run()
    assert {e.device for e in events} == {torch.device("cpu")}


def test_device_is_taken_from_tensor_arguments() -> None:
    events: list[koila.OOMEvent] = []
    fits = oom_above(1)

    @koila.batch(initial=4, on_oom=events.append)
    def run(batch_size: int, model: object, data: torch.Tensor) -> int:
        fits(batch_size)
        return batch_size

    run(object(), torch.zeros(2, device="meta"))
    assert {e.device for e in events} == {torch.device("meta")}


def test_nested_decorated_functions_compose() -> None:
    # An inner function that cannot fit even at its minimum raises BatchSizeExhausted, an OOM:
    # the outer function then shrinks its own size.
    outer_sizes: list[int] = []

    @koila.batch(initial=4, cache=koila.NoCache())
    def inner(batch_size: int, outer_size: int) -> int:
        if outer_size * batch_size > 8:
            raise make_oom()
        return batch_size

    @koila.batch(initial=64, cache=koila.NoCache())
    def outer(batch_size: int) -> tuple[int, int]:
        outer_sizes.append(batch_size)
        return batch_size, inner(batch_size)

    assert outer() == (8, 1)
    assert outer_sizes == [64, 32, 16, 8]


def test_recursion_limit_is_not_touched() -> None:
    # The wrapper adds a fixed number of frames, whatever the number of retries: the first
    # attempt runs in the engine's call, every retry one frame deeper, in its loop.
    depth: list[int] = []

    @koila.batch(initial=1024, cache=koila.NoCache())
    def run(batch_size: int) -> None:
        frame, count = sys._getframe(), 0
        while frame is not None:
            frame, count = frame.f_back, count + 1
        depth.append(count)
        if batch_size > 1:
            raise make_oom()

    run()
    assert len(depth) == 11
    assert len(set(depth[1:])) == 1
    assert depth[1] - depth[0] == 1


def test_stats_copy_and_pickle_as_a_snapshot_that_counts_no_more() -> None:
    import copy
    import pickle

    fits = oom_above(8)

    @koila.batch(initial=32, cache=koila.NoCache())
    def run(batch_size: int) -> int:
        fits(batch_size)
        return batch_size

    run()
    for snapshot in (copy.copy(run.stats), copy.deepcopy(run.stats), pickle.loads(pickle.dumps(run.stats))):
        assert snapshot.as_dict() == run.stats.as_dict()
        assert (snapshot.calls, snapshot.ooms) == (1, 2)
        assert repr(snapshot) == repr(run.stats)
    taken = copy.copy(run.stats)
    run()
    assert (taken.calls, run.stats.calls) == (1, 2)  # the copy's counter is its own


@pytest.mark.parametrize(
    ("front_end", "given", "guess", "own"),
    [
        (koila.batch, {"parm": "b"}, "param", "initial, param"),
        (koila.chunked, {"dimm": 1}, "dim", "initial, dim, progress, out"),
        (koila.range, {"progres": True}, "progress", "initial, progress"),
        (koila.accumulate, {"reductoin": "sum"}, "reduction", "initial, dim, reduction, weight, scaler, backward, ddp"),
        (koila.attempts, {"minimun": 2}, "minimum", "initial"),
    ],
)
def test_a_misspelt_option_is_named_with_the_front_ends_own_options(
    front_end: Any, given: dict[str, Any], guess: str, own: str
) -> None:
    """The list left out the front end's own options, which are the ones most often misspelt, and guessed none."""
    (name,) = given
    with pytest.raises(
        TypeError, match=rf"argument '{name}' \(did you mean '{guess}'\?\); its options are {own} and cache,"
    ):
        front_end(**given)


@pytest.mark.parametrize("front_end", [koila.batch, koila.attempts])
def test_initial_auto_is_refused_with_where_it_serves(front_end: Any) -> None:
    with pytest.raises(TypeError, match=r"got initial='auto': the estimated first size is for koila.chunked and"):
        front_end(initial="auto")
