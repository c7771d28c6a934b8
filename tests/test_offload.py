"""Tests for lending a model's memory to the CPU and back (koila_retry._diagnostics.offload)."""

from __future__ import annotations

import contextlib
import copy
import gc
import sys
import warnings
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

import koila_retry as koila
from koila_retry._core import memory
from koila_retry._diagnostics import offload
from koila_retry.testing import make_oom, simulated_device


class Saved(NamedTuple):
    """A tensor as it was: the object, its bytes and its layout in its storage."""

    tensor: torch.Tensor
    bits: torch.Tensor
    dtype: torch.dtype
    shape: torch.Size
    stride: tuple[int, ...]
    offset: int
    device: torch.device
    storage: int  # data_ptr of its storage


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """Return the tensor's values as raw bytes, so that NaNs and -0.0 compare exactly."""
    return tensor.detach().clone().reshape(-1).view(torch.uint8)


def save(tensor: torch.Tensor) -> Saved:
    return Saved(
        tensor,
        bits(tensor),
        tensor.dtype,
        tensor.shape,
        tensor.stride(),
        tensor.storage_offset(),
        tensor.device,
        tensor.untyped_storage().data_ptr(),
    )


def held(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, torch.Tensor]:
    """Return every tensor the model and optimizer hold, by a name of its own (not the library's walk)."""
    found: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        found[name] = tensor
        if tensor.grad is not None:
            found[f"{name}.grad"] = tensor.grad
    if optimizer is not None:
        names = {id(tensor): name for name, tensor in model.named_parameters()}
        for parameter, state in optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    found[f"state[{names[id(parameter)]}][{key}]"] = value
    return found


def snapshot(tensors: dict[str, torch.Tensor]) -> dict[str, Saved]:
    return {name: save(tensor) for name, tensor in tensors.items()}


def assert_as_before(
    tensors: dict[str, torch.Tensor], before: dict[str, Saved], *, same_storage: bool | None = None
) -> None:
    """Assert that every tensor is the same object with the same bits and layout, on the same device.

    ``same_storage`` says whether it must still have the same memory; ``None`` does not check, as
    after a round trip, where the allocator may hand out the address that was freed again.
    """
    assert tensors.keys() == before.keys()
    for name, saved in before.items():
        tensor = tensors[name]
        assert tensor is saved.tensor, name
        assert tensor.dtype == saved.dtype, name
        assert tensor.shape == saved.shape, name
        assert tensor.stride() == saved.stride, name
        assert tensor.storage_offset() == saved.offset, name
        assert tensor.device == saved.device, name
        assert torch.equal(bits(tensor), saved.bits), name
        if same_storage is not None:
            assert (tensor.untyped_storage().data_ptr() == saved.storage) is same_storage, name


def trained(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Return a small model and its Adam optimizer after one step, with fresh gradients in .grad."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(8, 6)).square().mean().backward()
        optimizer.step()
    model(torch.randn(8, 6)).square().mean().backward()
    return model, optimizer


class FailingCopy:
    """Stand in for offload._copy_storage: copy for real, and raise on chosen calls."""

    def __init__(self, fail_on: set[int], error: BaseException | None = None, *, after_copy: bool = False) -> None:
        self.fail_on = fail_on
        self.calls = 0
        self.error = error
        self.after_copy = after_copy  # fail with the copy made, as a failed copy_ would
        self.copies: list[weakref.ref[torch.UntypedStorage]] = []
        self.real = offload._copy_storage

    def __call__(self, storage: torch.UntypedStorage, device: torch.device, *, pin: bool) -> torch.UntypedStorage:
        self.calls += 1
        if self.calls in self.fail_on and not self.after_copy:
            raise self.error if self.error is not None else make_oom()
        copied = self.real(storage, device, pin=pin)
        self.copies.append(weakref.ref(copied))
        if self.calls in self.fail_on:
            raise self.error if self.error is not None else make_oom()
        return copied

    def alive(self) -> int:
        return sum(ref() is not None for ref in self.copies)


@pytest.fixture
def failing_copy(monkeypatch: pytest.MonkeyPatch) -> Callable[..., FailingCopy]:
    def install(fail_on: set[int], error: BaseException | None = None, *, after_copy: bool = False) -> FailingCopy:
        fake = FailingCopy(fail_on, error, after_copy=after_copy)
        monkeypatch.setattr(offload, "_copy_storage", fake)
        return fake

    return install


# ---------------------------------------------------------------------------
# round trips
# ---------------------------------------------------------------------------


def test_round_trip_after_an_adam_step_keeps_objects_and_bits() -> None:
    model, optimizer = trained()
    tensors = held(model, optimizer)
    assert {"0.weight.grad", "state[0.weight][exp_avg]", "state[0.weight][exp_avg_sq]", "state[0.weight][step]"} <= set(
        tensors
    )
    before = snapshot(tensors)
    state_before = {id(p): dict(state) for p, state in optimizer.state.items()}

    with koila.offload(model, optimizer) as lent:
        assert lent.offloaded
        during = held(model, optimizer)
        for name, saved in before.items():
            tensor = during[name]
            assert tensor is saved.tensor, name
            assert tensor.device.type == "cpu", name
            assert tensor.untyped_storage().data_ptr() != saved.storage, name
            assert torch.equal(bits(tensor), saved.bits), name

    assert not lent.offloaded
    assert_as_before(held(model, optimizer), before)
    for parameter, state in optimizer.state.items():
        assert state.keys() == state_before[id(parameter)].keys()
        for key, value in state.items():
            assert value is state_before[id(parameter)][key]
    for parameter in model.parameters():
        assert parameter.grad is before[f"{_name(model, parameter)}.grad"].tensor


def _name(model: nn.Module, tensor: torch.Tensor) -> str:
    return next(name for name, parameter in model.named_parameters() if parameter is tensor)


def test_an_optimizer_step_after_the_block_matches_one_on_an_untouched_copy() -> None:
    model, optimizer = trained()
    reference_model, reference_optimizer = copy.deepcopy((model, optimizer))
    for parameter, twin in zip(model.parameters(), reference_model.parameters(), strict=True):
        assert parameter.grad is not None
        twin.grad = parameter.grad.clone()  # a deep copy of a Parameter leaves its .grad behind

    with koila.offload(model, optimizer):
        pass

    inputs = torch.randn(8, 6)
    for net, opt in ((model, optimizer), (reference_model, reference_optimizer)):
        opt.step()  # the gradients that were lent
        opt.zero_grad()
        net(inputs).square().mean().backward()
        opt.step()
    ours = held(model, optimizer)
    theirs = held(reference_model, reference_optimizer)
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(bits(ours[name]), bits(theirs[name])), name


def test_buffers_round_trip() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    model(torch.randn(16, 4))  # train mode: updates the running statistics
    buffers = dict(model.named_buffers())
    assert set(buffers) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    assert buffers["1.num_batches_tracked"].item() == 1
    before = snapshot(buffers)

    with koila.offload(model):
        for name, tensor in model.named_buffers():
            assert tensor is buffers[name]
            assert tensor.untyped_storage().data_ptr() != before[name].storage

    assert_as_before(dict(model.named_buffers()), before)
    model(torch.randn(16, 4))  # the buffers are still the ones the module updates
    assert buffers["1.num_batches_tracked"].item() == 2


def test_layouts_dtypes_and_tensor_flags_round_trip() -> None:
    module = nn.Module()
    module.transposed = nn.Parameter(torch.randn(3, 5).t())
    module.offset = nn.Parameter(torch.randn(20)[7:13])
    module.register_buffer("scalar", torch.tensor(2.5, dtype=torch.float64))
    module.register_buffer("empty", torch.empty(0, 4))
    module.register_buffer("halves", torch.randn(4, 4).half())
    module.register_buffer("flags", torch.tensor([True, False, True]))
    module.register_buffer("special", torch.tensor([float("nan"), -0.0, float("inf")]))
    module.register_buffer("conjugated", torch.randn(3, dtype=torch.complex64).conj())
    with torch.inference_mode():
        module.register_buffer("inference", torch.randn(3))
    tensors = dict(module.state_dict(keep_vars=True))
    before = snapshot(tensors)
    values = {name: tensor.clone() for name, tensor in tensors.items()}
    assert module.conjugated.is_conj()

    with koila.offload(module):
        assert module.conjugated.is_conj()
        assert torch.equal(module.conjugated, values["conjugated"])

    assert_as_before(dict(module.state_dict(keep_vars=True)), before)
    assert module.conjugated.is_conj()
    assert torch.equal(module.conjugated, values["conjugated"])
    assert module.inference.is_inference()
    assert not module.transposed.is_contiguous()
    assert module.offset.storage_offset() == 7


def test_lending_inside_inference_mode_leaves_normal_tensors_normal() -> None:
    model = nn.Linear(3, 2)
    with torch.inference_mode(), koila.offload(model):
        assert not model.weight.is_inference()
    assert not model.weight.is_inference()
    model(torch.randn(4, 3)).sum().backward()  # inference tensors could not be saved for backward
    assert model.weight.grad is not None


def test_optimizer_state_in_nested_lists_and_a_tensor_learning_rate_move_too() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    inputs, targets = torch.randn(10, 3), torch.randn(10, 1)
    lbfgs = torch.optim.LBFGS(model.parameters(), history_size=3, max_iter=4)

    def closure() -> torch.Tensor:
        lbfgs.zero_grad()
        loss = (model(inputs) - targets).square().mean()
        loss.backward()
        return loss

    lbfgs.step(closure)
    state = lbfgs.state[model.weight]
    directions = list(state["old_dirs"])
    assert directions
    adam = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01))
    learning_rate = adam.param_groups[0]["lr"]
    pointers = {id(t): t.untyped_storage().data_ptr() for t in [*directions, learning_rate]}

    with koila.offload(model, [lbfgs, adam]):
        for tensor in [*directions, learning_rate]:
            assert tensor.untyped_storage().data_ptr() != pointers[id(tensor)]
        assert lbfgs.state[model.weight]["old_dirs"][0] is directions[0]

    assert adam.param_groups[0]["lr"] is learning_rate
    assert learning_rate.item() == pytest.approx(0.01)


# ---------------------------------------------------------------------------
# shared storages
# ---------------------------------------------------------------------------


class Tied(nn.Module):
    """An embedding tied to the output layer, and two parameters that overlap in one storage."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.out = nn.Linear(4, 5, bias=False)
        self.out.weight = self.embed.weight
        base = torch.arange(12, dtype=torch.float32)
        self.first = nn.Parameter(base[:8])
        self.second = nn.Parameter(base[4:].view(2, 4))  # elements 4 to 7 are also first[4:8]
        del base  # only the parameters hold the storage


def assert_shared(module: Tied) -> None:
    assert module.out.weight is module.embed.weight
    assert module.first.untyped_storage().data_ptr() == module.second.untyped_storage().data_ptr()
    assert module.first.storage_offset() == 0
    assert module.second.storage_offset() == 4
    assert module.second.stride() == (4, 1)
    with torch.no_grad():
        module.first[5] += 100.0
        assert module.second[0, 1].item() == 105.0
        module.first[5] -= 100.0


def test_tied_weights_and_views_of_one_storage_stay_shared_during_and_after() -> None:
    module = Tied()
    before = snapshot(dict(module.state_dict(keep_vars=True)))
    pointer = module.first.untyped_storage().data_ptr()

    with koila.offload(module) as lent:
        assert_shared(module)
        assert module.first.untyped_storage().data_ptr() != pointer

    assert_shared(module)
    assert_as_before(dict(module.state_dict(keep_vars=True)), before)
    # Each storage is copied once: the tied weight once, the 12 floats under first and second once.
    assert lent.nbytes == 5 * 4 * 4 + 12 * 4
    assert lent.retained_nbytes == 0


def test_optimizer_state_that_shares_one_storage_stays_shared() -> None:
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    flat = torch.arange(8, dtype=torch.float32)
    optimizer.state[model.weight]["momentum_buffer"] = flat[:6].view(2, 3)
    optimizer.state[model.bias]["momentum_buffer"] = flat[6:]
    del flat

    def shared() -> bool:
        weight = optimizer.state[model.weight]["momentum_buffer"]
        bias = optimizer.state[model.bias]["momentum_buffer"]
        return weight.untyped_storage().data_ptr() == bias.untyped_storage().data_ptr() and bias.storage_offset() == 6

    with koila.offload(model, optimizer):
        assert shared()
    assert shared()
    assert optimizer.state[model.bias]["momentum_buffer"].tolist() == [6.0, 7.0]


def test_a_storage_held_outside_the_model_is_counted_as_retained_and_not_shared_any_more() -> None:
    base = torch.zeros(10)
    module = nn.Module()
    module.part = nn.Parameter(base[2:5])
    with koila.offload(module) as lent, torch.no_grad():
        module.part.fill_(1.0)
    assert lent.retained_nbytes == lent.nbytes == 40
    # The tensor outside keeps the old memory; the parameter has new memory of its own.
    assert base.sum().item() == 0.0
    assert module.part.sum().item() == 3.0


# ---------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------


def test_an_error_in_the_block_moves_everything_back_and_propagates_unchanged() -> None:
    model, optimizer = trained()
    before = snapshot(held(model, optimizer))
    error = ValueError("from the body")

    with pytest.raises(ValueError) as info, koila.offload(model, optimizer) as lent:
        raise error

    assert info.value is error
    assert not getattr(error, "__notes__", [])
    assert not lent.offloaded
    assert_as_before(held(model, optimizer), before)


@pytest.mark.parametrize("failing_call", [1, 4, "last"])
def test_a_failure_while_moving_off_leaves_everything_as_it_was(
    failing_copy: Callable[..., FailingCopy], failing_call: int | str
) -> None:
    model, optimizer = trained()
    tensors = held(model, optimizer)
    before = snapshot(tensors)
    storages = len({tensor.untyped_storage().data_ptr() for tensor in tensors.values()})
    call = storages if failing_call == "last" else int(failing_call)
    fake = failing_copy({call})
    lent = koila.offload(model, optimizer)

    body_ran = False
    try:
        with lent:
            body_ran = True
    except torch.OutOfMemoryError as error:
        # Even while the error is being handled, the copies made before it are gone.
        copies_alive = fake.alive()
        notes = getattr(error, "__notes__", [])
    else:
        pytest.fail("the failing copy did not raise")

    assert not body_ran
    assert fake.calls == call
    assert len(fake.copies) == call - 1
    assert copies_alive == 0
    if sys.version_info >= (3, 11):
        assert any("nothing was moved" in note for note in notes)
    assert not lent.offloaded
    assert_as_before(held(model, optimizer), before, same_storage=True)


def test_a_copy_that_fails_after_allocating_is_freed_while_the_error_is_handled(
    failing_copy: Callable[..., FailingCopy],
) -> None:
    model, optimizer = trained()
    before = snapshot(held(model, optimizer))
    fake = failing_copy({3}, after_copy=True)
    try:
        with koila.offload(model, optimizer):
            pytest.fail("the block ran")
    except torch.OutOfMemoryError:
        # The failing frame's local still named the third copy; the traceback keeps that frame.
        copies_alive = fake.alive()
    assert len(fake.copies) == 3
    assert copies_alive == 0
    assert_as_before(held(model, optimizer), before, same_storage=True)


class FailingPoint:
    """Stand in for offload._point: point tensors for real, and raise on one call."""

    def __init__(self, fail_on: int) -> None:
        self.fail_on = fail_on
        self.calls = 0
        self.real = offload._point

    def __call__(self, tensor: torch.Tensor, storage: torch.UntypedStorage) -> None:
        self.calls += 1
        if self.calls == self.fail_on:
            raise RuntimeError("cannot point this tensor")
        self.real(tensor, storage)


@pytest.mark.parametrize("back", [False, True])
def test_a_failure_while_pointing_tensors_at_the_copies_puts_back_those_already_pointed(
    monkeypatch: pytest.MonkeyPatch, back: bool
) -> None:
    model, optimizer = trained()
    lent = koila.offload(model, optimizer)
    if back:
        lent.__enter__()
    before = snapshot(held(model, optimizer))
    failing = FailingPoint(7)
    monkeypatch.setattr(offload, "_point", failing)
    with pytest.raises(RuntimeError, match="cannot point this tensor"):
        lent.restore() if back else lent.__enter__()
    assert failing.calls > failing.fail_on  # the 6 tensors moved were pointed back
    assert lent.offloaded is back
    assert_as_before(held(model, optimizer), before, same_storage=True)
    monkeypatch.undo()
    lent.restore()
    assert not lent.offloaded


@pytest.mark.parametrize("failing_call", [1, 5])
def test_a_failure_while_moving_back_keeps_the_values_on_the_cpu_and_restore_tries_again(
    monkeypatch: pytest.MonkeyPatch, failing_call: int
) -> None:
    model, optimizer = trained()
    before = snapshot(held(model, optimizer))
    failing = FailingCopy({failing_call})

    with pytest.raises(torch.OutOfMemoryError) as info, koila.offload(model, optimizer) as lent:
        during = snapshot(held(model, optimizer))
        monkeypatch.setattr(offload, "_copy_storage", failing)

    assert failing.calls == failing_call
    assert len(failing.copies) == failing_call - 1
    assert failing.alive() == 0  # what was copied back before the failure is freed
    if sys.version_info >= (3, 11):
        assert any("lent.restore()" in note for note in info.value.__notes__)
    del info
    assert lent.offloaded
    assert "offloaded=True" in repr(lent)
    # Every tensor is still on its CPU copy, with its values, and usable there.
    assert_as_before(held(model, optimizer), during, same_storage=True)
    model.eval()
    assert model(torch.randn(2, 6)).shape == (2, 3)

    monkeypatch.setattr(offload, "_copy_storage", failing.real)
    lent.restore()
    assert not lent.offloaded
    assert_as_before(held(model, optimizer), before)
    assert_as_before(
        held(model, optimizer),
        {n: s._replace(device=torch.device("cpu")) for n, s in during.items()},
        same_storage=False,
    )
    after = snapshot(held(model, optimizer))
    lent.restore()  # nothing left to do
    assert_as_before(held(model, optimizer), after, same_storage=True)


def test_running_out_of_memory_on_the_way_back_frees_the_partial_copies() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))  # 2 x 16.25 KiB
    before = snapshot(held(model))
    with koila.offload(model) as lent:
        with simulated_device("20KiB") as device:
            with pytest.raises(torch.OutOfMemoryError):
                lent.restore()
            assert device.live == 0
        assert lent.offloaded
        with pytest.raises(torch.OutOfMemoryError), simulated_device("20KiB"):
            lent.restore()
        assert lent.offloaded
    assert not lent.offloaded
    assert_as_before(held(model), before)


def test_an_error_in_the_block_and_a_failure_on_the_way_back_raise_the_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = nn.Linear(3, 3)
    body = ValueError("from the body")
    with pytest.raises(torch.OutOfMemoryError) as info, koila.offload(model) as lent:
        monkeypatch.setattr(offload, "_copy_storage", FailingCopy({1}))
        raise body
    assert info.value.__context__ is body
    assert lent.offloaded
    monkeypatch.undo()
    lent.restore()
    assert not lent.offloaded


def test_a_block_given_up_on_after_its_way_back_failed_leaves_nothing_lent() -> None:
    # Its storages' addresses stayed lent for the rest of the process: a later offload skipped, and did
    # not move, any tensor whose storage was made at one of them again (27 of 30 rounds here).
    skipped = []
    for _ in range(30):
        model = nn.Linear(64, 64)  # 16.25 KiB in 2 tensors: the way back needs more than 24 KiB
        with contextlib.suppress(torch.OutOfMemoryError), simulated_device("24KiB"), koila.offload(model) as lent:
            pass
        assert lent.offloaded  # still on the CPU, and given up on
        skipped.append(16640 - lent.nbytes)  # weight and bias, each storage counted once
        del lent, model
        gc.collect()
    assert skipped == [0] * 30
    assert not offload._LENT


def test_restore_inside_the_block_moves_back_early_and_leaving_does_nothing_more() -> None:
    model, optimizer = trained()
    before = snapshot(held(model, optimizer))
    with koila.offload(model, optimizer) as lent:
        lent.restore()
        assert not lent.offloaded
        after = snapshot(held(model, optimizer))
    assert_as_before(held(model, optimizer), before)
    assert_as_before(held(model, optimizer), after, same_storage=True)


def test_changes_in_place_inside_the_block_are_carried_back_and_replaced_storages_left_alone() -> None:
    model = nn.Linear(3, 2)
    weight, bias = model.weight, model.bias
    with koila.offload(model), torch.no_grad():
        weight.fill_(2.0)  # in place, on the lent copy
        bias.data = torch.full((2,), 5.0)  # a storage of the user's own
        replaced = bias.untyped_storage().data_ptr()
    assert model.weight is weight
    assert weight.eq(2.0).all()
    assert bias.untyped_storage().data_ptr() == replaced
    assert bias.tolist() == [5.0, 5.0]


def test_entering_twice_is_refused_and_entering_again_after_leaving_works() -> None:
    model = nn.Linear(2, 2)
    lent = koila.offload(model)
    with lent:
        pointer = model.weight.untyped_storage().data_ptr()
        with pytest.raises(RuntimeError, match="already lent"):
            lent.__enter__()
        assert model.weight.untyped_storage().data_ptr() == pointer
    with lent:
        assert lent.offloaded
    assert not lent.offloaded
    koila.offload(model).restore()  # never entered: nothing to do


def test_the_handle_keeps_no_exception() -> None:
    model = nn.Linear(2, 2)
    with koila.offload(model) as lent:
        with pytest.raises(torch.OutOfMemoryError) as info, simulated_device("8B"):
            lent.restore()
        error = info.value
        del info
        assert lent.offloaded
        assert sys.getrefcount(error) == 2  # this name, and the call's argument
        for value in vars(lent).values():
            assert not isinstance(value, BaseException)


@pytest.mark.parametrize(
    ("model", "optimizer", "message"),
    [
        (lambda m: m.parameters(), lambda m: None, r"model must be a torch\.nn\.Module.*got generator"),
        (lambda m: m.weight, lambda m: None, r"model must be .*got a Parameter of shape \(2, 2\)"),
        (lambda m: "model", lambda m: None, r"got str 'model'"),
        (lambda m: [m, 3], lambda m: None, r"model\[1\] must be a torch\.nn\.Module, got int 3"),
        (lambda m: m, lambda m: m, r"optimizer must be a torch\.optim\.Optimizer, .* or None, got Linear"),
        (lambda m: m, lambda m: {"lr": 0.1}, r"optimizer must be .*got dict"),
        (lambda m: m, lambda m: [torch.optim.SGD(m.parameters()), "adam"], r"optimizer\[1\] .*got str 'adam'"),
    ],
)
def test_bad_arguments_raise_type_errors_naming_the_value(
    model: Callable[[nn.Module], Any], optimizer: Callable[[nn.Module], Any], message: str
) -> None:
    linear = nn.Linear(2, 2)
    with pytest.raises(TypeError, match=message):
        koila.offload(model(linear), optimizer(linear))


def test_meta_tensors_are_left_alone() -> None:
    model = nn.Sequential(nn.Linear(3, 3, device="meta"), nn.Linear(3, 2))
    meta_weight = model[0].weight
    before = snapshot({"1.weight": model[1].weight, "1.bias": model[1].bias})
    with koila.offload(model) as lent:
        assert model[0].weight is meta_weight
        assert meta_weight.device.type == "meta"
    assert model[0].weight is meta_weight
    assert meta_weight.device.type == "meta"
    assert lent.nbytes == (3 * 2 + 2) * 4
    assert_as_before({"1.weight": model[1].weight, "1.bias": model[1].bias}, before)


def test_a_lazy_modules_parameters_are_left_alone() -> None:
    """An uninitialised parameter has no data; reading its storage raised PyTorch's own ValueError."""
    model = nn.Sequential(nn.LazyLinear(3), nn.Linear(3, 2))
    lazy = model[0].weight
    with koila.offload(model) as lent:
        assert model[0].weight is lazy
    assert lent.nbytes == (3 * 2 + 2) * 4
    assert torch.nn.parameter.is_lazy(model[0].weight)
    assert model(torch.ones(4, 5)).shape == (4, 2)  # and it still initialises on its first call


def test_the_block_leaves_no_reference_cycle_holding_what_it_lent() -> None:
    """A recursive helper kept every lent tensor alive until the collector ran: a .grad set to None stayed."""
    with simulated_device("4MiB") as device:
        model = nn.Linear(256, 256, bias=False)  # 256 KiB of weight
        model(torch.ones(1, 256)).sum().backward()  # and as much of gradient
        gradient = weakref.ref(model.weight.grad)
        gc.disable()
        try:
            with koila.offload(model):
                model.weight.grad = None
            assert gradient() is None
            assert device.live == 256 * 256 * 4
        finally:
            gc.enable()


def _sparse_gradient() -> nn.Module:
    model = nn.Sequential(nn.Embedding(10, 3, sparse=True), nn.Linear(3, 1))
    model(torch.tensor([1, 2])).sum().backward()
    assert model[0].weight.grad is not None
    assert model[0].weight.grad.is_sparse
    return model


def _sparse_buffer() -> nn.Module:
    model = nn.Linear(2, 2)
    model.register_buffer("table", torch.eye(3).to_sparse())
    return model


def _quantized_buffer() -> nn.Module:
    model = nn.Linear(2, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated in PyTorch 2.13
        model.register_buffer("codes", torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.qint8))
    return model


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (_sparse_gradient, r"the gradient of parameter '0\.weight' \(set it to None.*layout torch\.sparse_coo"),
        (_sparse_buffer, r"buffer 'table': it has layout torch\.sparse_coo"),
        (_quantized_buffer, r"buffer 'codes': it is quantized"),
    ],
)
def test_tensors_without_a_plain_strided_storage_are_refused_before_anything_moves(
    make: Callable[[], nn.Module], message: str
) -> None:
    model = make()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dense = {name: t for name, t in model.named_parameters() if t.layout == torch.strided}
    before = snapshot(dense)
    lent = koila.offload(model, optimizer)
    with pytest.raises(NotImplementedError, match=message), lent:
        pytest.fail("the block ran")
    assert not lent.offloaded
    assert_as_before({name: t for name, t in model.named_parameters() if name in dense}, before, same_storage=True)


def test_several_modules_and_optimizers_are_lent_together() -> None:
    generator, discriminator = nn.Linear(4, 4), nn.Linear(4, 1)
    optimizers = (torch.optim.SGD(generator.parameters(), lr=0.1), torch.optim.SGD(discriminator.parameters()))
    tensors = {**held(generator), **{f"d.{name}": t for name, t in held(discriminator).items()}}
    before = snapshot(tensors)
    with koila.offload([generator, discriminator], optimizers) as lent:
        for name, saved in before.items():
            assert tensors[name].untyped_storage().data_ptr() != saved.storage, name
    assert lent.nbytes == (16 + 4 + 4 + 1) * 4
    assert_as_before(tensors, before)

    discriminator.register_buffer("table", torch.eye(2).to_sparse())
    with pytest.raises(NotImplementedError, match=r"buffer 'model\[1\]\.table'"):
        koila.offload((generator, discriminator)).__enter__()


def test_repr_and_nbytes() -> None:
    model = nn.Linear(4, 2)
    lent = koila.offload(model)
    assert repr(lent) == "Offload(offloaded=False, tensors=0, nbytes=0 bytes, devices=[])"
    with lent:
        assert repr(lent) == "Offload(offloaded=True, tensors=2, nbytes=40 bytes, devices=['cpu'])"
    assert repr(lent) == "Offload(offloaded=False, tensors=2, nbytes=40 bytes, devices=['cpu'])"
    assert lent.nbytes == 40


# ---------------------------------------------------------------------------
# CUDA
# ---------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_go_to_pinned_memory_and_back_to_their_device() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    model, optimizer = trained()
    model.to(device)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 6, device=device)).sum().backward()
    optimizer.step()
    tensors = held(model, optimizer)
    before = snapshot(tensors)
    on_cuda = sum(
        {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors.values() if t.is_cuda}.values()
    )
    torch.cuda.synchronize(device)
    allocated = torch.cuda.memory_allocated(device)

    with koila.offload(model, optimizer) as lent:
        for name, saved in before.items():
            tensor = tensors[name]
            assert tensor.device.type == "cpu", name
            assert tensor.is_pinned() == (saved.device.type == "cuda"), name
            assert torch.equal(bits(tensor), saved.bits.cpu()), name
        assert torch.cuda.memory_allocated(device) <= allocated - on_cuda

    assert_as_before(tensors, before)
    assert lent.retained_nbytes == 0
    optimizer.step()

    view = model[0].weight[0]
    with pytest.warns(UserWarning, match="stayed allocated"), koila.offload(model) as lent:
        assert lent.retained_nbytes > 0
    del view


# ---------------------------------------------------------------------------
# releasing: through koila_retry._core.memory, the one way memory is released
# ---------------------------------------------------------------------------


class Emptied(NamedTuple):
    devices: set[torch.device]
    host: bool


@pytest.fixture
def emptied(monkeypatch: pytest.MonkeyPatch) -> list[Emptied]:
    """Record each call of ``memory.empty_caches``, which still runs."""
    calls: list[Emptied] = []
    real = memory.empty_caches

    def recording(devices: Any, *, host: bool = False) -> None:
        devices = set(devices)
        calls.append(Emptied(devices, host))
        real(devices, host=host)

    monkeypatch.setattr(memory, "empty_caches", recording)
    return calls


def test_lending_releases_the_devices_it_moved_from_and_restoring_forgets_the_readings(
    emptied: list[Emptied],
) -> None:
    model = nn.Linear(3, 3)
    with koila.offload(model):
        assert emptied == [Emptied({torch.device("cpu")}, False)]
        memory.recent_free_memory(torch.device("cpu"))  # a reading the keys would reuse
    # Back: no device to empty, and no pinned copy on a CPU-only model, but the free
    # memory has changed, so the reading is gone.
    assert emptied[1:] == [Emptied(set(), False)]
    assert memory._free_readings == {}


def test_a_failed_move_releases_the_copies_target(
    emptied: list[Emptied], failing_copy: Callable[..., FailingCopy]
) -> None:
    model = nn.Linear(3, 3)
    failing_copy({2})
    with pytest.raises(torch.OutOfMemoryError), koila.offload(model):
        pass
    assert emptied == [Emptied({torch.device("cpu")}, False)]


class CausalMask(nn.Module):
    """An attention layer's mask buffer as nanoGPT registers it: a view of a tensor nothing else holds."""

    def __init__(self, size: int = 64) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("bias", torch.tril(torch.ones(size, size)).view(1, 1, size, size))


def _mask_buffer() -> nn.Module:
    return CausalMask()


def _transposed_grad() -> nn.Module:
    module = nn.Linear(32, 32)
    module.weight.grad = torch.randn(32, 32).t()  # a non-contiguous view; nothing else holds its base
    return module


def _buffers_cut_from_a_dropped_flat_buffer() -> nn.Module:
    module = nn.Module()
    flat = torch.randn(2, 32, 32)
    module.register_buffer("x", flat[0])
    module.register_buffer("y", flat[1])
    return module


@pytest.mark.parametrize("make", [_mask_buffer, _transposed_grad, _buffers_cut_from_a_dropped_flat_buffer])
def test_a_lent_view_lets_its_old_storage_go_and_leaves_nothing_behind_after_the_block(
    make: Callable[[], nn.Module],
) -> None:
    with simulated_device("10MiB") as device:
        module = make()
        tensors = held(module)
        assert any(tensor._base is not None for tensor in tensors.values())
        before = snapshot(tensors)
        old = [weakref.ref(tensor.untyped_storage()) for tensor in tensors.values()]
        live = device.live
        with koila.offload(module) as lent:
            assert all(storage() is None for storage in old)
            assert device.live == live  # the lent copies take the place of the memory they came from
            assert lent.retained_nbytes == 0
        assert device.live == live
    assert_as_before(held(module), before)
    assert all(tensor._base is None for tensor in tensors.values())
    if "x" in tensors:  # views of one storage still share one afterwards
        assert tensors["x"].untyped_storage().data_ptr() == tensors["y"].untyped_storage().data_ptr()
        assert tensors["y"].storage_offset() == 32 * 32


@pytest.mark.parametrize("whole_outside", [True, False], ids=["whole-outside", "part-outside"])
def test_nested_blocks_over_shared_tensors_each_move_back_what_they_lent(whole_outside: bool) -> None:
    """The inner block took lent tensors for its own, moved them to new CPU storages, and the outer left them."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    before = snapshot(held(model))
    outer_modules, inner_modules = (model, model[0]) if whole_outside else (model[0], model)
    homes = {name: tensor.untyped_storage()._cdata for name, tensor in held(model).items()}
    with koila.offload(outer_modules) as outer:
        lent_outside = {name: tensor.untyped_storage()._cdata for name, tensor in held(model).items()}
        with koila.offload(inner_modules) as inner:
            # The tensors the outer block lent stay where it put them; the inner lends only the others.
            for name, tensor in held(model).items():
                if lent_outside[name] != homes[name]:
                    assert tensor.untyped_storage()._cdata == lent_outside[name], name
        assert inner.nbytes == (0 if whole_outside else outer.nbytes)
        assert not inner.offloaded
        after_inner = {name: tensor.untyped_storage()._cdata for name, tensor in held(model).items()}
    assert not outer.offloaded
    # Every tensor the outer block lent was moved back by it: none stays on the storage it had in the block.
    moved = [name for name in homes if lent_outside[name] != homes[name]]
    assert moved
    assert all(held(model)[name].untyped_storage()._cdata != after_inner[name] for name in moved)
    assert_as_before(held(model), before)
