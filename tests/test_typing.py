"""Types a user's checker sees: run here, and checked by ``mypy --strict`` in tox's ``type`` env."""

from __future__ import annotations

import asyncio
import inspect
import typing

import torch
from torch import Tensor
from typing_extensions import assert_type  # typing's from Python 3.11; mypy checks for 3.10

import koila_retry as koila


@koila.batch
def doubled(batch_size: int, data: Tensor) -> Tensor:
    return torch.cat([data[start : start + batch_size] * 2 for start in range(0, len(data), batch_size)])


@koila.chunked(initial=4)
def encoded(data: Tensor) -> Tensor:
    return data + 1


class Model:
    """Every front end on methods: looked up on an instance, ``self`` is bound as for a function."""

    def __init__(self) -> None:
        self.weight = torch.ones(3, 1, requires_grad=True)

    def layer(self, data: Tensor) -> Tensor:
        return data @ self.weight

    @koila.batch(initial=4)
    def evaluate(self, batch_size: int, data: Tensor) -> Tensor:
        return torch.cat([self.layer(data[start : start + batch_size]) for start in range(0, len(data), batch_size)])

    @koila.batch
    def evaluate_bare(self, batch_size: int, data: Tensor) -> Tensor:
        return self.layer(data[:batch_size])

    @koila.accumulate
    def step(self, data: Tensor) -> Tensor:
        return self.layer(data).square().mean()

    @koila.accumulate(initial=2)
    def step_split(self, data: Tensor) -> Tensor:
        return self.layer(data).square().mean()

    @koila.chunked
    def encode(self, data: Tensor) -> Tensor:
        return self.layer(data)

    @koila.range(initial=4)
    def count(self, begin: int, end: int) -> int:
        return end - begin

    @koila.batch(param="size")
    def evaluate_by_keyword(self, data: Tensor, *, size: int) -> Tensor:
        return data[:size]

    @koila.batch
    async def evaluate_async(self, batch_size: int, data: Tensor) -> Tensor:
        return data[:batch_size]

    @staticmethod
    @koila.chunked
    def scaled(data: Tensor) -> Tensor:
        return data * 3

    @classmethod
    @koila.batch
    def made(cls, batch_size: int) -> int:
        return batch_size


def test_functions_keep_their_parameters_and_results() -> None:
    data = torch.ones(6, 3)
    assert_type(doubled(data), Tensor)
    assert_type(encoded(data), Tensor)
    assert_type(doubled.stats.calls, int)
    assert torch.equal(doubled(data), data * 2)
    assert torch.equal(encoded(data), data + 1)


def test_methods_bind_their_instance() -> None:
    model, data = Model(), torch.ones(6, 3)
    assert_type(model.evaluate(data), Tensor)
    assert_type(model.evaluate_bare(data), Tensor)
    assert_type(model.step(data), Tensor)
    assert_type(model.step_split(data), Tensor)
    assert_type(model.encode(data), Tensor)
    assert_type(model.count(0, 10), list[int])
    assert_type(Model.scaled(data), Tensor)
    # With param=, any arguments (a checker cannot drop a named one), and mypy binds them as a method's too.
    assert_type(model.evaluate_by_keyword(data), Tensor)  # type: ignore[call-arg]
    assert_type(Model.evaluate_by_keyword(model, data), Tensor)
    # On an instance, mypy binds a staticmethod's wrapper as a method's: look it up on the class (Batched's doc).
    assert_type(model.scaled(data), Tensor)  # type: ignore[call-arg]
    # mypy binds ``cls`` under @classmethod only for a function, not for a callable object such as the wrapper.
    assert_type(Model.made(), int)  # type: ignore[call-arg]
    assert_type(model.step.stats.ooms, int)
    with torch.no_grad():
        expected = model.layer(data)
        assert torch.equal(model.evaluate(data), expected)
        assert torch.equal(model.encode(data), expected)
        assert torch.equal(asyncio.run(model.evaluate_async(data)), data)
    assert model.evaluate_bare(data).shape == (6, 1)
    assert model.step(data).shape == ()
    assert model.step_split(data).shape == ()
    assert sum(model.count(0, 10)) == 10
    assert torch.equal(Model.scaled(data), data * 3)
    assert torch.equal(model.scaled(data), data * 3)  # type: ignore[call-arg]
    assert model.evaluate_by_keyword(data).shape == (6, 3)  # type: ignore[call-arg]
    assert Model.made() == Model.made.stats.batch_size  # type: ignore[call-arg]


def test_a_method_looked_up_on_its_class_takes_the_instance_first() -> None:
    model, data = Model(), torch.ones(2, 3)
    assert_type(Model.step(model, data), Tensor)
    assert_type(Model.encode(model, data), Tensor)
    assert Model.encode(model, data).shape == (2, 1)


def test_type_hints_omit_the_injected_size_as_the_signature_does() -> None:
    for wrapper in (doubled, Model.evaluate, Model().evaluate, Model.made):
        hints = typing.get_type_hints(wrapper)
        assert "batch_size" not in hints
        assert hints.keys() - {"return"} == inspect.signature(wrapper).parameters.keys() - {"self", "cls"}
    assert typing.get_type_hints(doubled) == {"data": Tensor, "return": Tensor}
    assert "batch_size" in typing.get_type_hints(inspect.unwrap(doubled))  # the user's function is left alone
