"""Tests for koila_retry.testing: the simulated device and OOM injection."""

from __future__ import annotations

import contextlib
import dis
import gc
import itertools
import os
import re
import subprocess
import sys
import textwrap
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import koila_retry as koila
from koila_retry._common import tracking
from koila_retry._core import memory
from koila_retry.testing import OOMInjector, SimulatedDevice, make_oom, oom_above, oom_for, simulated_device

MiB = 2**20
FOUR_MIB_TENSOR = (1024, 1024)  # float32: 4 MiB


# ---------------------------------------------------------------------------
# simulated_device: limits
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("limit", "expected"),
    [
        (4096, 4096),
        (0, 0),
        ("512MiB", 512 * MiB),
        ("1GB", 10**9),
        ("1.5 KiB", 1536),
        ("2 GiB", 2 * 2**30),
    ],
)
def test_simulated_device_reads_ints_and_sizes(limit: int | str, expected: int) -> None:
    device = simulated_device(limit)
    assert isinstance(device, SimulatedDevice)
    assert device.limit == expected


def test_simulated_device_takes_numpys_ints() -> None:
    numpy = pytest.importorskip("numpy")
    assert simulated_device(numpy.int64(5 * MiB)).limit == 5 * MiB  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("limit", "error", "shown"),
    [
        (-1, ValueError, "-1"),
        ("-1", ValueError, "'-1'"),
        ("12 parsecs", ValueError, "12 parsecs"),
        (1.5, TypeError, "1.5"),
        (None, TypeError, "None"),
        (True, TypeError, "True"),
    ],
)
def test_simulated_device_rejects_bad_limits(limit: object, error: type[Exception], shown: str) -> None:
    with pytest.raises(error) as excinfo:
        simulated_device(limit)  # type: ignore[arg-type]
    assert shown in str(excinfo.value)


# ---------------------------------------------------------------------------
# simulated_device: accounting
# ---------------------------------------------------------------------------


def test_live_counts_storages_created_inside() -> None:
    with simulated_device("100MiB") as device:
        assert device.live == 0
        first = torch.zeros(*FOUR_MIB_TENSOR)
        assert device.live == 4 * MiB
        second = torch.ones(1024)
        assert device.live == 4 * MiB + 4096
        assert first.numel() + second.numel() == 1024 * 1024 + 1024


def test_views_and_in_place_ops_add_nothing() -> None:
    with simulated_device("100MiB") as device:
        tensor = torch.zeros(*FOUR_MIB_TENSOR)
        before = device.live
        view = tensor.view(-1)
        sliced = tensor[10:20]
        transposed = tensor.t()
        tensor.add_(1)
        tensor.mul_(2)
        view.zero_()
        assert device.live == before == 4 * MiB
        assert sliced.shape == (10, 1024)
        assert transposed.shape == FOUR_MIB_TENSOR


def test_freeing_a_tensor_returns_its_bytes_and_peak_keeps_the_maximum() -> None:
    with simulated_device("100MiB") as device:
        keep = torch.zeros(1024)
        big = torch.zeros(*FOUR_MIB_TENSOR)
        assert device.live == 4 * MiB + 4096
        del big
        assert device.live == 4096
        assert device.peak == 4 * MiB + 4096
        assert keep.numel() == 1024


def test_peak_counts_temporaries_that_are_already_gone() -> None:
    with simulated_device("100MiB") as device:
        base = torch.zeros(1024)  # 4 KiB, stays
        total = (torch.ones(*FOUR_MIB_TENSOR) * 2).sum()  # two 4 MiB temporaries alive at once, then freed
        assert device.live == 4096 + 4  # base and the scalar sum
        assert device.peak == 4096 + 2 * 4 * MiB
        assert total.item() == 2 * 1024 * 1024
        assert base.numel() == 1024


def test_reset_peak_makes_the_peak_the_live_bytes() -> None:
    with simulated_device("100MiB") as device:
        keep = torch.zeros(1024)
        temporary = torch.zeros(*FOUR_MIB_TENSOR)
        del temporary
        assert device.peak == 4 * MiB + 4096
        device.reset_peak()
        assert device.peak == device.live == 4096
        again = torch.zeros(2048)
        assert device.peak == 4096 + 8192
        assert keep.numel() + again.numel() == 3072


def test_free_is_limit_minus_live() -> None:
    with simulated_device("10MiB") as device:
        assert device.free == 10 * MiB
        tensor = torch.zeros(*FOUR_MIB_TENSOR)
        assert device.free == device.limit - device.live == 6 * MiB
        del tensor
        assert device.free == 10 * MiB


def test_tensors_created_before_the_block_are_not_counted() -> None:
    before = torch.zeros(*FOUR_MIB_TENSOR)
    with simulated_device("5MiB") as device:
        assert device.live == 0
        doubled = before * 2  # a new storage: counted
        assert device.live == 4 * MiB
        assert doubled.shape == before.shape


def test_tensors_created_in_other_threads_are_not_counted() -> None:
    made: list[torch.Tensor] = []
    with simulated_device("1MiB") as device:
        worker = threading.Thread(target=lambda: made.append(torch.zeros(*FOUR_MIB_TENSOR)))
        worker.start()
        worker.join()
        assert device.live == 0
    assert made[0].shape == FOUR_MIB_TENSOR


def _in_thread(work: Callable[[], None]) -> tuple[threading.Thread, list[BaseException]]:
    """Start ``work`` in a thread; return it and the list that will hold what it raised."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as error:  # pragma: no cover - only on failure
            errors.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, errors


def test_a_device_another_thread_entered_is_not_this_thread_s() -> None:
    inside, done = threading.Barrier(2, timeout=60), threading.Barrier(2, timeout=60)

    def worker() -> None:
        with simulated_device("16MiB"):
            assert koila.free_memory() == 16 * MiB
            inside.wait()  # the main thread reads its own memory now
            done.wait()

    thread, errors = _in_thread(worker)
    try:
        inside.wait()
        assert tracking.simulated.device() is None
        assert koila.free_memory() != 16 * MiB  # the machine's memory, not the other thread's device
        assert not memory.nearly_full()
        assert not memory.describe_device(torch.device("cpu")).startswith("simulated")
        assert memory.recent_free_memory(torch.device("cpu")) != 16 * MiB
    finally:
        done.wait()
        thread.join()
    assert errors == []


def test_threads_that_enter_and_leave_devices_out_of_step_each_keep_their_own() -> None:
    # A enters, B enters, A leaves while B is inside, then B leaves.
    a_in, b_in, a_out = (threading.Barrier(2, timeout=60) for _ in range(3))
    seen: dict[str, list[int | None]] = {"a": [], "b": []}

    def thread_a() -> None:
        with simulated_device("10MiB"):
            a_in.wait()
            b_in.wait()
            seen["a"].append(koila.free_memory())
        seen["a"].append(tracking.simulated.limit())
        a_out.wait()

    def thread_b() -> None:
        a_in.wait()
        with simulated_device("20MiB") as device:
            b_in.wait()
            a_out.wait()
            seen["b"].append(koila.free_memory())
            seen["b"].append(tracking.simulated.limit())
            assert tracking.simulated.device() is device
        seen["b"].append(tracking.simulated.limit())

    (a, a_errors), (b, b_errors) = _in_thread(thread_a), _in_thread(thread_b)
    a.join()
    b.join()
    assert a_errors == b_errors == []
    assert seen == {"a": [10 * MiB, None], "b": [20 * MiB, 20 * MiB, None]}
    assert tracking.simulated.active == []


def test_a_thread_runs_out_of_its_own_memory_while_another_allocates_freely() -> None:
    inside, done = threading.Barrier(2, timeout=60), threading.Barrier(2, timeout=60)
    sizes: list[int] = []

    def small_device() -> None:
        with simulated_device("1MiB") as device:
            inside.wait()
            with pytest.raises(torch.OutOfMemoryError, match=r"total capacity of 1\.00 MiB"):
                torch.zeros(*FOUR_MIB_TENSOR)
            done.wait()  # the other thread's tensors are made and alive by now
            assert device.live == 0  # none of them counts here

    def double(rows: torch.Tensor) -> torch.Tensor:
        if rows.device.type != "meta":  # the estimate's runs are not chunks
            sizes.append(len(rows))
        return rows * 2

    thread, errors = _in_thread(small_device)
    try:
        inside.wait()
        big = torch.zeros(*FOUR_MIB_TENSOR)  # no limit in this thread
        # The size is chosen from this thread's memory: every row at once.
        result = koila.chunked(double, torch.ones(16_384, 64), initial="auto", cache=koila.NoCache())
    finally:
        done.wait()
        thread.join()
    assert errors == []
    assert sizes == [16_384]
    assert big.numel() + result.numel() == 2 * 2**20


@pytest.mark.parametrize(
    "operation",
    [
        pytest.param(lambda t: t.view(-1), id="view"),
        pytest.param(lambda t: t[:10], id="slice"),
        pytest.param(lambda t: t.add_(1), id="in-place"),
    ],
)
def test_views_and_in_place_ops_of_tensors_from_before_the_block_count_nothing(operation: object) -> None:
    """Regression: the tracker counted the whole storage of a pre-block tensor viewed or modified in the block."""
    before = torch.zeros(*FOUR_MIB_TENSOR)
    with simulated_device("100MiB") as device:
        result = operation(before)  # type: ignore[operator]
        assert device.live == 0
    assert result is not None


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(lambda t: t.to_sparse(), id="coo"),
        pytest.param(lambda t: t.to_sparse_csr(), id="csr"),
    ],
)
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_a_sparse_tensor_counts_its_parts_and_their_views_count_nothing(layout: object) -> None:
    dense = torch.eye(256)
    before = layout(dense)  # type: ignore[operator]
    with simulated_device("1KiB") as device:
        values = before.values()  # a view of a tensor made before the block
        assert device.live == 0
    with simulated_device("64MiB") as device:
        made = layout(dense)  # type: ignore[operator]
        indices = (made._indices(),) if made.layout == torch.sparse_coo else (made.crow_indices(), made.col_indices())
        parts = (made.values(), *indices)
        storages = {id(part.untyped_storage()): part.untyped_storage().nbytes() for part in parts}
        assert device.live == sum(storages.values())  # a CSR's column indices may view a larger buffer
    assert values.numel() == 256


def _sparse_bytes(tensor: torch.Tensor) -> int:
    return sum(part.untyped_storage().nbytes() for part in (tensor._indices(), tensor._values()))


@pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled")  # torch's, once per process
def test_an_in_place_operator_on_a_sparse_tensor_counts_its_new_parts() -> None:
    # a.add_(b) gives a indices and values of new storages: they were taken for the input's, and live
    # fell by a's old parts (probe 74H); so did a sparse embedding's gradient, accumulated.
    rows = torch.arange(256).view(1, -1)
    with simulated_device("64MiB") as device:
        # Indices of their own: made before the block, rows' storage would count for neither.
        a = torch.sparse_coo_tensor(rows.clone(), torch.ones(256, 16, dtype=torch.float64), (4096, 16))
        b = torch.sparse_coo_tensor(rows.clone(), torch.ones(256, 16, dtype=torch.float64), (4096, 16))
        a.add_(b)
        assert device.live == _sparse_bytes(a) + _sparse_bytes(b)
        embedding = torch.nn.Embedding(4096, 16, sparse=True)
        for _ in range(3):
            embedding(torch.arange(128)).sum().backward()  # type: ignore[no-untyped-call]
        grad = embedding.weight.grad
        assert grad is not None
        weight = embedding.weight.untyped_storage().nbytes()
        assert device.live == _sparse_bytes(a) + _sparse_bytes(b) + weight + _sparse_bytes(grad)
    with simulated_device("40KiB") as device:
        a = torch.sparse_coo_tensor(rows.clone(), torch.ones(256, 16), (4096, 16))
        b = torch.sparse_coo_tensor(rows.clone(), torch.ones(256, 16), (4096, 16))
        a.add_(b)  # over the limit: counted, not refused, as it has run (a refusal left a changed and uncounted)
        assert device.live == _sparse_bytes(a) + _sparse_bytes(b) > 40 * 1024
        with pytest.raises(torch.OutOfMemoryError):
            torch.ones(1)  # the next allocation is


@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")  # torch's, of a non-empty out=
def test_an_operator_that_grows_a_tensor_it_is_given_counts_the_growth() -> None:
    rows = torch.ones(128, 128)  # 64 KiB
    before = torch.empty(0)
    with simulated_device("1MiB") as device:
        out = torch.empty(0)
        torch.cat([rows] * 4, out=out)
        assert device.live == out.nbytes == 4 * 64 * 1024
        grown = torch.empty(0)
        grown.resize_(1000)
        assert device.live == out.nbytes + 4000
        torch.cat([rows] * 2, out=before)  # made before the block, and empty: counts from empty
        assert device.live == out.nbytes + 4000 + before.nbytes
        target, left, right = torch.empty(5, 4).t(), torch.ones(512, 8), torch.ones(8, 512)
        peak = device.peak
        with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 4\.00 MiB"):
            grown.resize_(MiB)
        assert (grown.shape, grown.untyped_storage().nbytes()) == ((1000,), 4000)
        with pytest.raises(torch.OutOfMemoryError):
            torch.mm(left, right, out=target)  # 1 MiB: refused
        # Put back as it was: shape, strides and storage, as a device that fails before the kernel leaves it.
        assert (target.shape, target.stride(), target.untyped_storage().nbytes()) == ((4, 5), (1, 4), 80)
        assert device.peak == peak
        del out
        assert device.live == 4000 + before.nbytes + 80 + left.nbytes + right.nbytes


def test_a_growth_an_inner_device_refuses_leaves_the_outer_device_s_count_as_it_was() -> None:
    with simulated_device("16MiB") as outer:
        with simulated_device("1MiB") as inner:
            tensor = torch.zeros(10)
            with pytest.raises(torch.OutOfMemoryError):
                tensor.resize_(MiB)  # 4 MiB: the outer device's room, not the inner's
            assert (inner.live, outer.live) == (40, 40)
        assert koila.free_memory() == 16 * MiB - 40
        del tensor
        assert outer.live == 0


def test_a_refused_operator_leaves_what_it_writes_besides_its_result_as_it_was() -> None:
    norm = nn.BatchNorm1d(256)
    inputs = torch.randn(4096, 256) + 5  # its 4 MiB output does not fit
    with simulated_device("1MiB"), pytest.raises(torch.OutOfMemoryError):
        norm(inputs)
    assert torch.equal(norm.running_mean, torch.zeros(256))
    assert torch.equal(norm.running_var, torch.ones(256))
    assert int(norm.num_batches_tracked) == 1  # a separate in-place add before the kernel, as on a device
    with simulated_device("64MiB"):
        norm(inputs)
    assert not torch.equal(norm.running_mean, torch.zeros(256))


def test_forward_of_a_model_built_before_the_block_counts_only_new_storages() -> None:
    """Regression: aten.t returns a view of the weight, and the tracker counted the weight's storage."""
    linear = nn.Linear(256, 256)
    with simulated_device("100MiB") as device:
        x = torch.zeros(1, 256)
        out = linear(x)
        assert device.live == x.nbytes + out.nbytes  # 1 KiB + 1 KiB, not the 256 KiB weight


# ---------------------------------------------------------------------------
# simulated_device: out of memory
# ---------------------------------------------------------------------------


def test_allocation_past_the_limit_raises_a_genuine_cuda_style_oom() -> None:
    with simulated_device("10MiB") as device:
        fits = torch.zeros(2048, 1024)  # 8 MiB
        with pytest.raises(torch.OutOfMemoryError) as excinfo:
            torch.zeros(1024, 1024)  # 4 MiB more: 12 MiB > 10 MiB
        assert device.live == 8 * MiB
        assert fits.numel() == 2 * 1024 * 1024
    error = excinfo.value
    assert type(error) is torch.OutOfMemoryError
    assert isinstance(error, RuntimeError)
    assert str(error).startswith("CUDA out of memory")
    assert "Tried to allocate 4.00 MiB" in str(error)
    assert koila.is_oom(error)


def test_allocation_exactly_at_the_limit_fits() -> None:
    with simulated_device(4 * MiB) as device:
        tensor = torch.zeros(*FOUR_MIB_TENSOR)
        assert device.live == device.limit
        assert device.free == 0
        with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 4 bytes"):
            torch.zeros(1)
        assert tensor.numel() == 1024 * 1024


def test_after_an_oom_the_refused_tensor_is_not_counted_and_smaller_ones_fit() -> None:
    with simulated_device("6MiB") as device:
        keep = torch.zeros(*FOUR_MIB_TENSOR)
        live = device.live
        with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 4\.00 MiB"):
            torch.ones(*FOUR_MIB_TENSOR)
        assert device.live == live
        assert device.peak == live
        smaller = torch.ones(256, 1024)  # 1 MiB
        assert device.live == live + MiB
        assert smaller.sum().item() == 256 * 1024
        assert keep.numel() == 1024 * 1024


def test_the_refused_storage_is_really_freed() -> None:
    # The outer device sees the refused storage being created, then freed; refused, it is in no peak.
    with simulated_device("100MiB") as outer:
        with simulated_device("1MiB") as inner, pytest.raises(torch.OutOfMemoryError):
            torch.zeros(*FOUR_MIB_TENSOR)
        assert inner.live == 0
        assert outer.live == 0
        assert outer.peak == 0


def test_free_memory_reports_the_simulated_device_while_it_is_active() -> None:
    with simulated_device("10MiB") as device:
        assert koila.free_memory() == 10 * MiB
        tensor = torch.zeros(*FOUR_MIB_TENSOR)
        assert koila.free_memory() == device.free == 6 * MiB
        assert koila.free_memory("cpu") == 6 * MiB
        assert koila.free_memory(torch.device("cuda")) == 6 * MiB  # "whatever device says"
        del tensor
        assert koila.free_memory() == 10 * MiB
    assert tracking.simulated.active == []
    real = koila.free_memory()
    assert isinstance(real, int)
    assert real > 10 * MiB  # the machine's memory again, not the simulated 10 MiB


def test_nested_devices_apply_the_inner_limit_while_it_is_active() -> None:
    with simulated_device("100MiB") as outer:
        with simulated_device("5MiB") as inner:
            assert koila.free_memory() == 5 * MiB
            with pytest.raises(torch.OutOfMemoryError, match=r"total capacity of 5\.00 MiB"):
                torch.zeros(2 * 1024 * 1024)  # 8 MiB fits the outer device, not the inner one
            small = torch.zeros(1024)
            assert inner.live == 4096
            assert outer.live == 4096  # the outer device is still active and counts it too
        assert koila.free_memory() == outer.free == 100 * MiB - 4096
        big = torch.zeros(2 * 1024 * 1024)  # the inner limit is gone
        assert outer.live == 4096 + 8 * MiB
        assert small.numel() + big.numel() == 1024 + 2 * 1024 * 1024


def test_free_memory_inside_nested_devices_is_the_tightest_of_them() -> None:
    with simulated_device("1MiB") as outer:
        held = torch.zeros(192 * 1024)  # 768 KiB of the outer device
        with simulated_device("16MiB") as inner:
            assert koila.free_memory() == outer.free == 256 * 1024
            assert inner.free == 16 * MiB
            with pytest.raises(torch.OutOfMemoryError, match=r"total capacity of 1\.00 MiB"):
                torch.zeros(256 * 1024)  # 1 MiB: the inner device's room, not the outer's
    assert held.numel() == 192 * 1024


def _entered(limit: str) -> Iterator[None]:
    with simulated_device(limit):
        yield


def test_a_device_left_before_one_entered_after_it_stops_counting_at_once() -> None:
    # A generator's block (a fixture's) closed while a later block is active: PyTorch pops only the
    # top of its stack of modes, which is the later block's.
    block = _entered("1MiB")
    next(block)
    with simulated_device("64MiB") as big:
        block.close()
        assert koila.free_memory() == big.free == 64 * MiB
        tensor = torch.zeros(MiB)  # 4 MiB: fits the 64 MiB device, not the closed 1 MiB one
        assert big.live == 4 * MiB
    assert tracking.simulated.active == []
    assert not any(isinstance(mode, tracking.LiveStorageTracker) for mode in _dispatch_modes())
    assert tensor.numel() == MiB


def test_a_device_left_out_of_order_leaves_the_stack_of_modes_with_the_last_block() -> None:
    first, second = simulated_device("8MiB"), simulated_device("16MiB")
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    tensor = torch.zeros(1024)
    assert (first.live, second.live) == (0, 4096)
    third = simulated_device("32MiB")
    with third:  # entered above the one left: the stack stays in order
        assert koila.free_memory() == second.free  # the tighter of the two still active
    second.__exit__(None, None, None)
    assert not any(isinstance(mode, tracking.LiveStorageTracker) for mode in _dispatch_modes())
    assert tensor.numel() == 1024


def _dispatch_modes() -> list[object]:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return list(_get_current_dispatch_mode_stack())


def test_re_entering_an_active_device_raises_runtime_error() -> None:
    device = simulated_device("1MiB")
    with device:
        with pytest.raises(RuntimeError, match="already active"), device:
            pass
        assert len(tracking.simulated.active) == 1
        tensor = torch.zeros(1024)
        assert device.live == 4096  # the failed re-entry did not disturb the active device
    assert tracking.simulated.active == []
    assert tensor.numel() == 1024


def test_device_is_deactivated_when_the_block_raises() -> None:
    device = simulated_device("1MiB")
    with pytest.raises(torch.OutOfMemoryError), device:
        torch.zeros(*FOUR_MIB_TENSOR)
    assert tracking.simulated.active == []
    tensor = torch.zeros(*FOUR_MIB_TENSOR)  # no limit any more
    assert tensor.numel() == 1024 * 1024


def test_a_model_step_counts_params_grads_and_optimizer_state() -> None:
    params = (256 * 128 + 128) * 4  # nn.Linear(256, 128): weight and bias
    inputs = 64 * 256 * 4
    outputs = 64 * 128 * 4
    torch.manual_seed(0)
    with simulated_device("100MiB") as device:
        model = nn.Linear(256, 128)
        assert device.live == params
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        assert device.live == params  # Adam creates its state lazily
        x = torch.randn(64, 256)
        assert device.live == params + inputs
        device.reset_peak()

        loss = model(x).sum()
        after_forward = params + inputs + 4  # the output is freed once summed; the scalar loss stays
        assert device.live == after_forward
        assert device.peak == after_forward + outputs

        loss.backward()
        after_backward = after_forward + params  # one gradient per parameter
        assert device.live == after_backward

        optimizer.step()
        state = device.live - after_backward
        # exp_avg and exp_avg_sq per parameter, plus a small step counter each.
        assert 2 * params <= state <= 2 * params + 64
        assert device.live <= device.peak <= device.live + 4 * params


def test_an_oom_inside_backward_is_a_torch_out_of_memory_error() -> None:
    torch.manual_seed(0)
    with simulated_device("14MiB") as device:
        model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))  # ~8 MiB
        loss = model(torch.randn(256, 1024)).sum()
        assert device.live < device.limit - MiB  # the forward pass fitted
        with pytest.raises(torch.OutOfMemoryError, match=r"^CUDA out of memory\. Tried to allocate") as excinfo:
            loss.backward()  # needs ~8 MiB more for the gradients
        assert device.live <= device.limit
    assert type(excinfo.value) is torch.OutOfMemoryError
    assert koila.is_oom(excinfo.value)


@pytest.mark.usefixtures("fresh_dynamo")
def test_code_compiled_with_aot_eager_runs_into_the_limit_as_eager_code_does() -> None:
    # What testing.rst promises of torch.compile under the stand-in: with backend="aot_eager"
    # the graph's operators are seen (inductor's kernels allocate past the dispatcher, and are not).
    if not torch._dynamo.is_dynamo_supported():
        pytest.skip("torch.compile is not supported on this Python")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 4096), nn.ReLU(), nn.Linear(4096, 4)).eval()
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(64, 16)  # the hidden activations: 1 MiB
    with torch.no_grad():
        expected = compiled(x)  # compiled outside the block, as a model usually is before the test
        peaks = []
        for run in (model, compiled):
            with simulated_device("4MiB") as device:
                assert torch.equal(run(x), expected)
            peaks.append(device.peak)
            with simulated_device("1MiB"), pytest.raises(torch.OutOfMemoryError, match="Simulated device"):
                run(x)
    assert peaks[1] >= MiB
    assert peaks[1] == peaks[0]


def test_repr_shows_limit_live_and_peak() -> None:
    with simulated_device("1MiB") as device:
        tensor = torch.zeros(1024)
        text = repr(device)
    assert text == "SimulatedDevice(limit=1.00 MiB, live=4.00 KiB, peak=4.00 KiB)"
    assert tensor.numel() == 1024


# ---------------------------------------------------------------------------
# make_oom
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "error_type", "start"),
    [
        ("cuda", torch.OutOfMemoryError, "CUDA out of memory. Tried to allocate 2.00 GiB."),
        ("cpu", RuntimeError, "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate"),
        ("mps", RuntimeError, "MPS backend out of memory"),
    ],
)
def test_make_oom_kinds_are_recognised(kind: str, error_type: type[Exception], start: str) -> None:
    error = make_oom(kind)
    assert type(error) is error_type
    assert str(error).startswith(start)
    assert koila.is_oom(error)


def test_make_oom_names_the_size() -> None:
    assert "Tried to allocate 1.00 KiB." in str(make_oom("cuda", 1024))
    assert "you tried to allocate 1024 bytes." in str(make_oom("cpu", 1024))
    assert "Tried to allocate 1.00 KiB on private pool." in str(make_oom("mps", 1024))


def test_make_oom_defaults_to_cuda() -> None:
    assert type(make_oom()) is torch.OutOfMemoryError


def test_make_oom_takes_any_integer_such_as_numpys() -> None:
    numpy = pytest.importorskip("numpy")
    assert "you tried to allocate 8 bytes" in str(make_oom("cpu", nbytes=numpy.int64(8)))


@pytest.mark.parametrize(("nbytes", "error"), [(-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_make_oom_rejects_sizes_that_are_no_allocation(nbytes: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=f"nbytes must be .*, got {nbytes!r}"):
        make_oom(nbytes=nbytes)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["tpu", "CUDA", ""])
def test_make_oom_rejects_unknown_kinds(kind: str) -> None:
    with pytest.raises(ValueError, match=repr(kind)):
        make_oom(kind)


# ---------------------------------------------------------------------------
# oom_above
# ---------------------------------------------------------------------------


def test_oom_above_raises_only_above_the_limit() -> None:
    inject = oom_above(100)
    assert isinstance(inject, OOMInjector)
    inject(1)
    inject(99)
    inject(100)
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        inject(101)
    with pytest.raises(torch.OutOfMemoryError):
        inject(10**9)
    assert inject.calls == 5
    assert inject.raised == 2


def test_oom_above_zero_fails_every_positive_size() -> None:
    inject = oom_above(0)
    inject(0)
    with pytest.raises(torch.OutOfMemoryError):
        inject(1)
    assert (inject.calls, inject.raised) == (2, 1)


@pytest.mark.parametrize(("kind", "error_type"), [("cpu", RuntimeError), ("mps", RuntimeError)])
def test_oom_above_raises_the_chosen_kind(kind: str, error_type: type[Exception]) -> None:
    inject = oom_above(1, kind=kind)
    with pytest.raises(RuntimeError) as excinfo:
        inject(2)
    assert type(excinfo.value) is error_type
    assert not isinstance(excinfo.value, torch.OutOfMemoryError)
    assert koila.is_oom(excinfo.value)


def test_oom_above_requires_the_batch_size() -> None:
    inject = oom_above(100)
    with pytest.raises(TypeError, match="batch size"):
        inject()


@pytest.mark.parametrize(
    ("limit", "error"), [(-1, ValueError), (1.5, TypeError), ("100", TypeError), (None, TypeError), (True, TypeError)]
)
def test_oom_above_rejects_bad_limits(limit: object, error: type[Exception]) -> None:
    # A wrong type is a TypeError, as make_oom's and oom_for's are.
    with pytest.raises(error, match=repr(limit).replace(".", r"\.")):
        oom_above(limit)  # type: ignore[arg-type]


def test_oom_above_rejects_unknown_kinds() -> None:
    with pytest.raises(ValueError, match="'tpu'"):
        oom_above(1, kind="tpu")


# ---------------------------------------------------------------------------
# oom_for
# ---------------------------------------------------------------------------


def _failing_calls(inject: OOMInjector, calls: int) -> list[int]:
    failed = []
    for number in range(1, calls + 1):
        try:
            inject()
        except torch.OutOfMemoryError:
            failed.append(number)
    return failed


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_an_injector_copied_or_pickled_counts_its_own_calls(how: str) -> None:
    # An argument of torch.multiprocessing.spawn is pickled: the lock made that a TypeError (probe 76E).
    import copy
    import pickle

    injector = oom_above(4)
    injector(2)
    copied = copy.deepcopy(injector) if how == "deepcopy" else pickle.loads(pickle.dumps(injector))
    with pytest.raises(torch.OutOfMemoryError):
        copied(8)
    assert (copied.calls, copied.raised) == (2, 1)
    assert (injector.calls, injector.raised) == (1, 0)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork() is POSIX")
def test_an_injector_works_in_a_child_forked_while_another_thread_held_its_lock() -> None:
    injector = oom_for(1)
    with injector._lock:  # as another thread's call holds it at the fork
        pid = os.fork()
        if pid == 0:  # the child: exits 0 if the call raised as chosen, else hangs until the parent's kill
            try:
                injector()
            except torch.OutOfMemoryError:
                os._exit(0)
            os._exit(1)
    for _ in range(600):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        threading.Event().wait(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the child waited for the lock its parent's other thread held")
    assert os.waitstatus_to_exitcode(status) == 0


def test_oom_for_an_int_fails_the_first_calls() -> None:
    inject = oom_for(3)
    assert _failing_calls(inject, 6) == [1, 2, 3]
    assert (inject.calls, inject.raised) == (6, 3)


def test_oom_for_zero_fails_nothing() -> None:
    inject = oom_for(0)
    assert _failing_calls(inject, 4) == []
    assert (inject.calls, inject.raised) == (4, 0)


def test_oom_for_call_numbers_fails_exactly_those_calls() -> None:
    inject = oom_for([2, 4])
    assert _failing_calls(inject, 8) == [2, 4]
    assert (inject.calls, inject.raised) == (8, 2)


def test_oom_for_accepts_any_iterable_and_ignores_the_batch_size() -> None:
    inject = oom_for(n for n in (1,))
    with pytest.raises(torch.OutOfMemoryError):
        inject(10**6)
    inject(1)
    assert (inject.calls, inject.raised) == (2, 1)


def test_oom_for_a_range_is_kept_as_it_is_and_an_endless_iterator_is_refused() -> None:
    # Listed, an endless iterator never returned, and range(1, 10**8, 2) took seconds and gigabytes (probe 73E).
    inject = oom_for(range(1, 10**12, 2))
    for call in range(1, 6):
        if call % 2:
            with pytest.raises(torch.OutOfMemoryError):
                inject()
        else:
            inject()
    assert (inject.calls, inject.raised) == (5, 3)
    with pytest.raises(ValueError, match=r"got range\(0, 5\), which holds 0"):
        oom_for(range(5))
    with pytest.raises(ValueError, match=r"which holds -4"):
        oom_for(range(10**12, -5, -1))
    with pytest.raises(TypeError, match=r"got count\(1, 2\), which may never end: give a range instead"):
        oom_for(itertools.count(1, 2))
    with pytest.raises(TypeError, match="which may never end"):
        oom_for(itertools.repeat(3))
    counted = oom_for(itertools.repeat(3, 2))  # a repeat with a count ends: refused too (probe 73J)
    counted()
    counted()
    with pytest.raises(torch.OutOfMemoryError):
        counted()


@pytest.mark.parametrize(("calls", "shown"), [(-1, "-1"), ([0], "[0]"), ([-1], "[-1]"), ([3, 0, 5], "[0]")])
def test_oom_for_rejects_bad_call_numbers(calls: object, shown: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        oom_for(calls)  # type: ignore[arg-type]
    assert shown in str(excinfo.value)


def test_oom_for_takes_numpys_ints() -> None:
    numpy = pytest.importorskip("numpy")
    inject = oom_for(numpy.int64(1))  # type: ignore[arg-type]
    with pytest.raises(torch.OutOfMemoryError):
        inject()
    inject()
    chosen = oom_for(numpy.array([2]))  # an array of call numbers, not a count
    chosen()
    with pytest.raises(torch.OutOfMemoryError):
        chosen()


def test_oom_for_a_count_beyond_any_run_fails_every_call_and_costs_nothing_to_make() -> None:
    # It made a set of every call number: oom_for(sys.maxsize) ran out of host memory (probe 71D).
    import sys

    inject = oom_for(sys.maxsize)
    assert _failing_calls(inject, 3) == [1, 2, 3]


def test_oom_for_a_tensor_of_no_dimensions_is_a_count() -> None:
    # It was iterated: PyTorch's "iteration over a 0-d tensor" (probe 71D).
    assert _failing_calls(oom_for(torch.tensor(2)), 4) == [1, 2]  # type: ignore[arg-type]


@pytest.mark.parametrize("calls", [1.5, None, True, "3", b"\x01"])
def test_oom_for_rejects_what_is_neither_a_count_nor_call_numbers(calls: object) -> None:
    with pytest.raises(TypeError, match=f"calls must be an int or an iterable of ints, got .*{re.escape(repr(calls))}"):
        oom_for(calls)  # type: ignore[arg-type]


def test_oom_for_rejects_unknown_kinds() -> None:
    with pytest.raises(ValueError, match="'tpu'"):
        oom_for(1, kind="tpu")


def _hammer(inject: Callable[[int], None], threads: int = 8, per_thread: int = 100) -> int:
    """Call ``inject(call_number)`` from several threads at once; return the OOMs they saw."""
    start = threading.Barrier(threads)
    oom_counts = [0] * threads

    def hammer(index: int) -> None:
        start.wait()
        for call in range(per_thread):
            try:
                inject(call)
            except torch.OutOfMemoryError:
                oom_counts[index] += 1

    workers = [threading.Thread(target=hammer, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return sum(oom_counts)


def test_injectors_count_exactly_under_threads() -> None:
    inject = oom_above(50)
    seen = _hammer(inject)  # sizes 0..99 in each thread: 49 of them (51..99) are above 50
    assert inject.calls == 800
    assert inject.raised == seen == 8 * 49


def test_oom_for_counts_exactly_under_threads() -> None:
    inject = oom_for(range(1, 801, 2))  # every odd call
    seen = _hammer(lambda call: inject())
    assert inject.calls == 800
    assert inject.raised == seen == 400


# ---------------------------------------------------------------------------
# With koila.batch
# ---------------------------------------------------------------------------


def test_batch_with_oom_above_settles_on_the_largest_power_of_two_that_fits() -> None:
    inject = oom_above(100)
    tried: list[int] = []

    @koila.batch(initial=1000, cache=koila.NoCache())
    def run(batch_size: int) -> int:
        tried.append(batch_size)
        inject(batch_size)
        return batch_size

    assert run() == 64
    assert tried == [1000, 512, 256, 128, 64]
    assert (inject.calls, inject.raised) == (5, 4)


def test_batch_under_a_simulated_device_shrinks_until_the_tensors_fit() -> None:
    tried: list[int] = []
    made: list[weakref.ref[torch.Tensor]] = []

    @koila.batch(initial=1024, cache=koila.NoCache())
    def run(batch_size: int) -> int:
        tried.append(batch_size)
        tensor = torch.zeros(batch_size, 1024)  # 4 KiB per row
        made.append(weakref.ref(tensor))
        return int(tensor.shape[0])

    with simulated_device("1MiB") as device:
        assert run() == 256  # 256 rows = 1 MiB, exactly the limit
        assert device.live == 0
    assert tried == [1024, 512, 256]
    assert all(ref() is None for ref in made)


def test_the_count_of_devices_active_anywhere_follows_every_enter_and_leave() -> None:
    # recent_free_memory (every cached call's key) looks at the thread's own devices only
    # while this count is above 0: it must come back to 0, whatever ended the blocks.
    before = tracking.anywhere[0]
    cpu = torch.device("cpu")
    with simulated_device("16MiB"):
        assert tracking.anywhere[0] == before + 1
        assert memory.recent_free_memory(cpu) == 16 * MiB
        with pytest.raises(RuntimeError, match="inner"), simulated_device("8MiB"):
            assert tracking.anywhere[0] == before + 2
            assert memory.recent_free_memory(cpu) == 8 * MiB
            raise RuntimeError("inner")
        assert tracking.anywhere[0] == before + 1
        assert memory.recent_free_memory(cpu) == 16 * MiB

    def worker() -> None:
        with simulated_device("4MiB"):
            pass

    thread, errors = _in_thread(worker)
    thread.join()
    assert errors == []
    assert tracking.anywhere[0] == before
    assert memory.recent_free_memory(cpu) != 16 * MiB


# --- storages resized in place (FSDP2 frees and gathers its unsharded parameters this way) ----------


def test_a_storage_resized_in_place_counts_its_new_size() -> None:
    with simulated_device("1MiB") as device:
        tensor = torch.empty(1000)
        storage = tensor.untyped_storage()
        assert device.live == 4000
        storage.resize_(0)
        assert device.live == 0
        storage.resize_(8000)
        assert device.live == 8000
        assert device.peak == 8000
        del tensor, storage
        assert device.live == 0


def test_a_tracked_storage_the_collector_frees_while_the_device_counts_is_forgotten_without_a_hang() -> None:
    # The collector may run in any allocation, the tracker's own weak reference's included, and free a tensor
    # made in the block: its callback took the tracker's lock again, which the thread held, and waited on itself
    # for good (probe 73E). Here the collection runs with the lock held; in a process of its own, to end it.
    code = textwrap.dedent(
        """
        import gc, torch
        from koila_retry.testing import simulated_device

        class Node:
            pass

        with simulated_device("1MiB") as device:
            node = Node()
            node.me, node.tensor = node, torch.ones(100)
            del node
            with device._tracker._lock:
                gc.collect()
            print(device.live)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout.strip()) == (0, "0"), done.stderr


class _Cyclic:
    """Garbage only a collection frees: an object in a reference cycle, holding a tensor."""

    tensor: torch.Tensor
    me: _Cyclic


def test_a_collection_after_any_call_while_the_device_counts_a_growth_loses_no_bytes() -> None:
    # Python 3.12 may collect at the check after each call: one between reading and writing the live count ran
    # forget() inside it, re-entrant since the lock is, and the write undid it, for good (probe 73J). Here the
    # collection is made to run there, after each call in turn.
    code = tracking.LiveStorageTracker.count_growth.__code__
    instructions = list(dis.get_instructions(code))
    after_calls = [ins.offset for before, ins in itertools.pairwise(instructions) if before.opname == "CALL"]
    reached = 0
    for offset in after_calls:
        fired: list[bool] = []

        def local(frame: Any, event: str, arg: Any, offset: int = offset, fired: list[bool] = fired) -> Any:
            if event == "opcode" and frame.f_lasti == offset and not fired:
                fired.append(True)
                gc.collect()
            return local

        def tracer(frame: Any, event: str, arg: Any) -> Any:
            if frame.f_code is code:
                frame.f_trace_opcodes = True
                return local
            return None

        with simulated_device("1MiB") as device:
            out = torch.zeros(0)  # no warning that it is resized: it has no elements
            garbage = _Cyclic()
            garbage.me, garbage.tensor = garbage, torch.ones(1000)
            del garbage
            gc.disable()
            sys.settrace(tracer)
            try:
                torch.add(torch.ones(100), 1, out=out)  # grows a storage it counts: count_growth
            finally:
                sys.settrace(None)
                gc.enable()
            reached += bool(fired)  # not every call is on this growth's path
            assert device.live == sum(storage.nbytes() for storage in device.live_storages()), offset
    assert reached >= 2


def test_an_emptied_storage_stays_empty_after_a_growth_it_could_not_fit_is_refused() -> None:
    # Put back with set_ after it was emptied, the storage grew again to the tensor's shape, counted nowhere:
    # 620 bytes under a 1 KiB limit, beside 800 counted (probe 73E).
    with simulated_device("1KiB") as device:
        parameter = torch.zeros(155)
        parameter.untyped_storage().resize_(0)  # freed, its shape kept: FSDP2's unsharded parameter
        x = torch.randn(200)
        with pytest.raises(torch.OutOfMemoryError):
            parameter.resize_(300)  # an out= operator of another shape resizes it so
        assert parameter.shape == (155,)
        assert parameter.untyped_storage().nbytes() == 0
        assert device.live == sum(storage.nbytes() for storage in device.live_storages()) == x.nbytes


def test_growing_past_the_limit_raises_and_leaves_the_storage_as_it_was() -> None:
    with simulated_device("64KiB") as device:
        storage = torch.empty(1000).untyped_storage()
        with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):
            storage.resize_(1 << 20)
        assert storage.nbytes() == 4000
        assert device.live == 4000


def test_a_storage_made_before_the_block_counts_once_it_grows_from_empty() -> None:
    early = torch.empty(1000)
    early.untyped_storage().resize_(0)
    kept = torch.empty(500)  # made before the block and never emptied: not counted
    with simulated_device("1MiB") as device:
        early.untyped_storage().resize_(4000)
        kept.untyped_storage().resize_(4000)
        assert device.live == 4000
        early.untyped_storage().resize_(0)
        assert device.live == 0
    early.untyped_storage().resize_(4000)  # outside the block: nothing to count, nothing raised
    assert early.untyped_storage().nbytes() == 4000


def test_a_deep_copy_counts_its_storages_and_runs_into_the_limit() -> None:
    # copy.deepcopy of a tensor clones its storage outside any operator: a copy of the best weights, an EMA
    # model and a state_dict counted nothing, and no copy ever ran out of memory (probe 71D).
    import copy

    with simulated_device("1MiB") as device:
        layer = nn.Linear(256, 256, bias=False)  # 256 KiB
        made = device.live
        best = copy.deepcopy(layer.state_dict())
        assert device.live == 2 * made
        teacher = copy.deepcopy(layer)
        assert device.live == 3 * made
        with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 300.00 KiB"):
            copy.deepcopy(torch.zeros(300, 256))
        assert device.live == 3 * made, "the refused copy is not counted"
        del best, teacher
        assert device.live == made
    kept = torch.zeros(4)
    assert torch.equal(copy.deepcopy(kept), kept)  # outside the block, as ever


def test_an_inner_device_s_own_copies_of_what_an_operator_writes_count_in_no_device() -> None:
    # The copies of BatchNorm's running statistics taken in case the inner device refuses the operator
    # counted in the outer one: a forward that fits ran out of memory (probe 71D).
    channels = 65536  # running mean and variance: 256 KiB each
    inputs = torch.randn(2, channels)
    with simulated_device(2 * MiB + 8) as outer:  # the module's 1 MiB and the forward's
        norm = nn.BatchNorm1d(channels)
        with simulated_device("1GiB"):
            norm(inputs)
        assert outer.peak == 2 * MiB


def test_another_threads_resizes_do_not_count() -> None:
    outside = torch.empty(0)
    done = threading.Event()

    def grow() -> None:
        outside.untyped_storage().resize_(1 << 20)
        done.set()

    with simulated_device("64KiB") as device:
        thread = threading.Thread(target=grow)
        thread.start()
        thread.join()
        assert done.is_set()
        assert device.live == 0


def test_oom_above_takes_numpys_ints_as_make_oom_and_oom_for_do() -> None:
    numpy = pytest.importorskip("numpy")
    plain, from_numpy = oom_above(3), oom_above(numpy.int64(3))
    for inject in (plain, from_numpy):
        for size in range(1, 6):
            with contextlib.suppress(torch.OutOfMemoryError):
                inject(size)
    assert (from_numpy.calls, from_numpy.raised) == (plain.calls, plain.raised)


@pytest.mark.parametrize("limit", ["0.1B", "0.1 MiB", "1.3 B"])
def test_simulated_device_refuses_a_limit_that_is_not_whole_bytes(limit: str) -> None:
    """ "0.1B" made a device of 0 bytes, silently."""
    with pytest.raises(ValueError, match=f"whole number of bytes, got {limit!r}"):
        simulated_device(limit)


@pytest.mark.parametrize("grows", [False, True])
def test_an_allocation_an_inner_device_refuses_counts_in_no_peak(grows: bool) -> None:
    """The outer device counted the refused allocation first, and kept it in its peak."""
    with simulated_device("100MiB") as outer:
        kept = torch.zeros(1024)
        with simulated_device("1MiB") as inner:
            out = torch.empty(0)
            before = (outer.peak, inner.peak)
            with pytest.raises(torch.OutOfMemoryError, match=r"total capacity of 1\.00 MiB"):
                if grows:
                    torch.zeros(*FOUR_MIB_TENSOR, out=out)  # grows ``out``'s storage
                else:
                    torch.zeros(*FOUR_MIB_TENSOR)
            assert (outer.peak, inner.peak) == before
            fits = torch.zeros(2048)  # what is allocated counts in both peaks, as before
            assert (outer.peak, inner.peak) == (outer.live, inner.live)
        bigger = torch.zeros(*FOUR_MIB_TENSOR)  # the inner limit is gone
        assert outer.peak == outer.live
    assert out.numel() == 0
    assert kept.numel() + fits.numel() + bigger.numel() == 1024 + 2048 + 1024 * 1024
