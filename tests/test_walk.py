"""The object-graph walk: what an object refers to, what a call holds, what is reachable, and frame variables."""

from __future__ import annotations

import dataclasses
import functools
import sys
import types
import weakref
from typing import Any, cast

import pytest
import torch

from koila_retry._common.walk import (
    MAX_DEPTH,
    MAX_ITEMS,
    FrameValues,
    call_references,
    frame_locals,
    global_names,
    reachable,
    references,
)

SCALE = 3.0
GLOBAL_MODEL = torch.nn.Linear(2, 2)


def _function_with_everything() -> tuple[Any, torch.Tensor]:
    weight = torch.ones(2)

    def fn(x: torch.Tensor, factor: float = 2.0, *, bias: float = 1.0) -> torch.Tensor:
        return x * weight * factor * SCALE + bias

    return fn, weight


class _Holder:
    def __init__(self, value: Any) -> None:
        self.value = value

    def method(self) -> Any:
        return self.value


class _CallableHolder(_Holder):
    def __call__(self) -> Any:
        return GLOBAL_MODEL(self.value)


class _Scheduler:
    """Saves and loads a state_dict, like a learning-rate scheduler, and holds an optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def _nested(value: Any, levels: int) -> Any:
    """Return ``value`` inside ``levels`` one-item lists: ``levels`` references from the outermost."""
    for _ in range(levels):
        value = [value]
    return value


# --- global_names ----------------------------------------------------------------------


def test_global_names_include_those_of_nested_code() -> None:
    def outer() -> Any:
        return [GLOBAL_MODEL(x) for x in range(2)], lambda: SCALE

    assert {"GLOBAL_MODEL", "SCALE"} <= global_names(outer.__code__)


# --- references --------------------------------------------------------------------------


def test_references_of_a_function_are_its_defaults_closure_and_globals_by_name() -> None:
    fn, weight = _function_with_everything()
    found = references(fn)
    assert [name for name, _ in found] == ["factor", "bias", "weight", "SCALE"]
    values = dict(found)
    assert values["factor"] == 2.0
    assert values["bias"] == 1.0
    assert values["weight"] is weight
    assert values["SCALE"] == SCALE


def test_an_empty_closure_cell_is_skipped() -> None:
    def outer() -> Any:
        def inner() -> Any:
            return later

        found = references(inner)
        later = 1
        return found, later

    found, _ = outer()
    assert found == []


def test_references_of_a_bound_method_are_self_and_the_function() -> None:
    holder = _Holder(1)
    assert references(holder.method) == [("self", holder), ("__func__", _Holder.method)]


class _Slotted:
    __slots__ = ("__private", "model", "unset")

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.__private = model, 2

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self.model(x))


class _MoreSlots(_Slotted):
    __slots__ = "extra"


@dataclasses.dataclass(slots=True)
class _SlottedTrainer:
    model: torch.nn.Module


def test_references_of_an_object_with_slots_are_the_slots_set_and_its_call() -> None:
    # Nothing was found in an object without __dict__: an estimate of a dataclass(slots=True)'s method
    # refused the model it holds as "reached some way other than ... bound as self" (probe 75B).
    model = torch.nn.Linear(2, 2)
    holder = _MoreSlots(model)
    holder.extra = 5
    assert references(holder) == [("extra", 5), ("__private", 2), ("model", model)]
    assert references(_Slotted(model))[-1] == ("__call__", _Slotted.__call__)
    assert references(_SlottedTrainer(model)) == [("model", model)]
    assert model in list(reachable([_SlottedTrainer(model)]))


def test_references_of_a_partial_are_its_function_arguments_and_keywords() -> None:
    model = torch.nn.Linear(2, 2)
    partial = functools.partial(_Holder.method, model, scale=2)
    assert references(partial) == [("func", _Holder.method), ("args[0]", model), ("scale", 2)]


@pytest.mark.parametrize("kind", [list, tuple])
def test_references_of_a_sequence_are_its_items_by_position(kind: type) -> None:
    items = [torch.nn.Linear(2, 2), "text", 3]
    assert references(kind(items)) == [("[0]", items[0]), ("[1]", "text"), ("[2]", 3)]


@pytest.mark.parametrize("kind", [set, frozenset])
def test_references_of_a_set_are_its_items(kind: type) -> None:
    found = references(kind({1, 2, 3}))
    assert sorted(value for _, value in found) == [1, 2, 3]


def test_references_of_a_mapping_are_its_values_by_key() -> None:
    key = torch.ones(3)  # a tensor's repr prints its values: such a key is named by position
    mapping = {"model": 1, 7: 2, key: 3}
    assert references(mapping) == [("['model']", 1), ("[7]", 2), ("values()[2]", 3)]
    assert references(types.MappingProxyType({"a": 1})) == [("['a']", 1)]


@pytest.mark.parametrize("kind", [list, dict])
def test_only_the_first_items_of_a_container_are_looked_at(kind: type) -> None:
    items = list(range(MAX_ITEMS + 10))
    container = items if kind is list else {str(item): item for item in items}
    found = references(container)
    assert [value for _, value in found] == items[:MAX_ITEMS]


def test_references_of_an_object_are_its_attributes() -> None:
    holder = _Holder(5)
    holder.other = "x"  # type: ignore[attr-defined]
    assert references(holder) == [("value", 5), ("other", "x")]


def test_a_callable_objects_own_call_is_among_its_references() -> None:
    holder = _CallableHolder(5)
    assert references(holder) == [("value", 5), ("__call__", _CallableHolder.__call__)]


@pytest.mark.parametrize("leaf", [torch, torch.nn.Linear, torch.ones(2), "text", b"bytes", 1, 1.5, 2j, True, None])
def test_leaves_refer_to_nothing(leaf: object) -> None:
    assert references(leaf) == []


def test_references_of_an_object_without_attributes_are_none() -> None:
    assert references(object()) == []


# --- reachable ------------------------------------------------------------------------


def test_a_module_two_levels_deep_through_a_closure_and_a_dict_is_reachable() -> None:
    model = torch.nn.Linear(2, 2)
    held = {"model": model}

    def fn() -> Any:
        return held

    assert list(reachable([fn])) == [model]


def test_the_walk_stops_after_the_depth_limit() -> None:
    model = torch.nn.Linear(2, 2)
    assert list(reachable([_nested(model, MAX_DEPTH)])) == [model]
    assert list(reachable([_nested(model, MAX_DEPTH + 1)])) == []
    assert MAX_DEPTH == 6


def test_an_object_reached_first_at_the_depth_limit_is_walked_by_its_shorter_path() -> None:
    # Depth first, the long path (the last root, taken first) marked the holder seen at the limit, and its
    # model was never reached by the short one.
    model = torch.nn.Linear(2, 2)
    holder = _Holder(model)
    assert list(reachable([[holder], _nested(holder, MAX_DEPTH)])) == [model]


def test_a_budget_bounds_the_references_looked_at_nearest_first() -> None:
    model = torch.nn.Linear(2, 2)
    data = [[list(range(500)) for _ in range(3)] for _ in range(100)]  # a tokenized dataset's shape
    deep = _Holder(_Holder(_Holder(model)))  # the model 3 references away, as the dataset's ints are
    assert list(reachable([data, deep])) == [model]
    # 100 lists, the holders' 2 and the 300 lists of ints are looked at before the budget runs out in
    # the ints, which are never queued; the innermost holder, though reached, is not looked into.
    assert list(reachable([data, deep], budget=1000)) == []
    assert list(reachable([data, _Holder(_Holder(model))], budget=1000)) == [model]
    assert list(reachable([_Holder(model)], budget=0)) == []


def test_modules_and_optimizers_are_yielded_without_their_insides() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    found = list(reachable([_Holder([model, optimizer])]))
    assert len(found) == 2
    assert {id(value) for value in found} == {id(model), id(optimizer)}


def test_a_stateful_object_is_yielded_and_walked_into() -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = _Scheduler(optimizer)
    found = list(reachable([scheduler]))
    assert [id(value) for value in found] == [id(scheduler), id(optimizer)]


def test_a_class_with_state_dict_methods_is_not_stateful() -> None:
    assert list(reachable([_Scheduler])) == []


def test_cycles_are_walked_once() -> None:
    model = torch.nn.Linear(2, 2)
    loop: list[Any] = [model]
    loop.append(loop)
    holder = _Holder(None)
    holder.value = holder
    holder.model = model  # type: ignore[attr-defined]
    assert list(reachable([loop, holder, loop])) == [model]


def test_reachable_from_a_call_sees_its_self_arguments_closure_and_globals() -> None:
    argument = torch.nn.Linear(2, 2)
    closed = torch.nn.Linear(2, 2)
    owner = torch.nn.Linear(2, 2)
    holder = _Holder(owner)

    def step(x: Any) -> Any:
        return closed(x) + GLOBAL_MODEL(x)

    found = {id(value) for value in reachable((step, (argument,), {})) if isinstance(value, torch.nn.Module)}
    assert found == {id(argument), id(closed), id(GLOBAL_MODEL)}
    assert [id(value) for value in reachable([holder.method])] == [id(owner)]


# --- call_references --------------------------------------------------------------------


def test_call_references_are_labelled_in_order() -> None:
    holder = _Holder(None)
    closed = torch.nn.Linear(2, 2)

    def step(x: Any, *, y: Any) -> Any:
        return closed(x) + GLOBAL_MODEL(y) * SCALE

    bound = types.MethodType(step, holder)
    found = call_references(bound, (1, 2), {"y": 3})
    assert [label for label, _ in found] == [
        "the step",
        "self",
        "argument 0",
        "argument 1",
        "argument 'y'",
        "'closed'",
        "'GLOBAL_MODEL'",
        "'SCALE'",
    ]
    values = [value for _, value in found]
    assert values[0] is bound
    assert values[1] is holder
    assert values[2:5] == [1, 2, 3]
    assert values[5] is closed
    assert values[6] is GLOBAL_MODEL


def test_call_references_look_through_a_partial() -> None:
    holder = _Holder(None)
    partial = functools.partial(holder.method)
    found = call_references(partial, (), {})
    assert found[0] == ("the step", partial)
    assert found[1] == ("self", holder)


def test_call_references_of_a_module_are_the_module_and_its_arguments() -> None:
    model = torch.nn.Linear(2, 2)
    x = torch.ones(1, 2)
    found = call_references(model, (x,), {})
    assert [label for label, _ in found] == ["the step", "argument 0"]
    assert found[0][1] is model
    assert found[1][1] is x


# --- frame_locals ---------------------------------------------------------------------


def test_frame_locals_returns_the_variables() -> None:
    first, second = 1, "two"
    found = dict(frame_locals(sys._getframe()))
    assert found["first"] == first
    assert found["second"] == second


@pytest.mark.skipif(sys.version_info >= (3, 13), reason="f_locals keeps no snapshot from Python 3.13 (PEP 667)")
def test_frame_locals_leaves_no_snapshot_behind() -> None:
    tensor = torch.zeros(10)
    reference = weakref.ref(tensor)
    frame = sys._getframe()
    assert any(value is tensor for _, value in frame_locals(frame))
    del tensor
    assert reference() is None
    # A plain f_locals read, for contrast, keeps the snapshot (this is what frame_locals undoes).
    kept = torch.zeros(10)
    kept_reference = weakref.ref(kept)
    assert "kept" in frame.f_locals
    del kept
    assert kept_reference() is not None
    frame.f_locals.clear()
    del frame


@pytest.mark.skipif(sys.version_info >= (3, 13), reason="f_locals keeps no snapshot from Python 3.13 (PEP 667)")
def test_frame_locals_leaves_a_namespace_the_user_took_with_locals_as_it_is() -> None:
    # Before PEP 667, locals() returns the very dict that f_locals fills: emptying it, once
    # done to drop the snapshot, emptied the user's namespace too.
    epoch, loss = 3, 0.5
    namespace = locals()
    found = dict(frame_locals(sys._getframe()))
    assert (found["epoch"], found["loss"]) == (3, 0.5)
    assert (namespace["epoch"], namespace["loss"]) == (epoch, loss)


@pytest.mark.skipif(sys.version_info >= (3, 13), reason="f_locals keeps no snapshot from Python 3.13 (PEP 667)")
def test_frame_locals_leaves_a_namespace_a_caller_holds_as_it_is() -> None:
    def inner(frame: types.FrameType) -> list[tuple[str, Any]]:
        return frame_locals(frame)

    def outer() -> tuple[dict[str, Any], list[tuple[str, Any]]]:
        value = 7
        namespace = locals()  # the frame's snapshot, held by its own variable and returned
        return namespace, [*inner(sys._getframe()), ("value", value)]

    namespace, found = outer()
    assert namespace["value"] == 7
    assert ("value", 7) in found


def test_frame_values_are_read_afresh_on_every_iteration_and_kept_by_nobody() -> None:
    model = torch.nn.Linear(2, 2)
    tensor = torch.zeros(10)
    reference = weakref.ref(tensor)
    values = FrameValues(sys._getframe())
    assert any(value is model for value in values)
    assert any(value is tensor for value in values)  # a second walk (the ranks make two) sees them too
    del tensor
    assert reference() is None
    later = torch.ones(3)
    assert any(value is later for value in values)


class _ItemDict(dict[str, Any]):
    __getattr__ = dict.__getitem__  # a missing attribute raises KeyError, not AttributeError


def test_reachable_walks_a_dict_whose_getattr_raises_key_error() -> None:
    """It asked the batch for state_dict with getattr(): koila.estimate raised KeyError 'state_dict'."""
    model = torch.nn.Linear(2, 2)
    found = list(reachable([_ItemDict(model=model, x=torch.ones(2))]))
    assert found == [model]


def test_reachable_passes_over_a_proxy_of_a_module() -> None:
    """Lightning holds a weakref.proxy of its module: it was found as a module named CallableProxyType."""
    model = torch.nn.Linear(2, 2)
    holder = types.SimpleNamespace(proxy=weakref.proxy(model))
    assert list(reachable([holder])) == []
    assert list(reachable([holder, model])) == [model]


class _Unhashable(type):
    """A metaclass whose classes cannot be hashed (``__eq__`` without ``__hash__``)."""

    def __eq__(cls, other: object) -> bool:
        return cls is other

    __hash__ = None  # type: ignore[assignment]


class _HeldByUnhashable(metaclass=_Unhashable):
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model


def test_references_of_an_object_whose_class_cannot_be_hashed_are_its_attributes() -> None:
    # The check for a Mapping hashes the class: TypeError, and koila.estimate and profile crashed (probe 75H).
    model = torch.nn.Linear(2, 2)
    assert references(_HeldByUnhashable(model)) == [("model", model)]
    assert model in list(reachable([_HeldByUnhashable(model)]))
