"""koila.is_oom: which exceptions mean "out of memory"."""

from __future__ import annotations

import asyncio
import builtins
import sys
import weakref
from typing import Any

import pytest
import torch
from _fake_cuda import FakeCuda
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import koila_retry as koila
from koila_retry._core import memory
from koila_retry._core.detect import MAX_CAUSES, MEMORY_SHORT_MESSAGES
from koila_retry.testing import make_oom, simulated_device

# Messages as PyTorch and its backends print them (see FACTS.md), one per failure mode.
OOM_ERRORS = {
    "cuda caching allocator": torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.25 GiB of which "
        "1.06 GiB is free. Including non-PyTorch memory, this process has 78.19 GiB memory in use."
    ),
    "hip caching allocator": torch.OutOfMemoryError("HIP out of memory. Tried to allocate 1.00 GiB."),
    "xpu caching allocator": torch.OutOfMemoryError("XPU out of memory. Tried to allocate 1.00 GiB."),
    "cuda as plain RuntimeError (older torch)": RuntimeError(
        "CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 7.79 GiB total capacity)"
    ),
    "cpu allocator, linux": RuntimeError(
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
        "allocate 4294967296 bytes. Error code 12 (Cannot allocate memory)"
    ),
    "cpu allocator, windows": RuntimeError(
        "[enforce fail at C:\\actions-runner\\_work\\pytorch\\pytorch\\c10\\core\\impl\\alloc_cpu.cpp:72] data. "
        "DefaultCPUAllocator: not enough memory: you tried to allocate 1073741824 bytes."
    ),
    "mps": RuntimeError(
        "MPS backend out of memory (MPS allocated: 17.00 GB, other allocations: 1.23 GB, max allowed: 18.13 GB). "
        "Tried to allocate 256.00 MB on private pool. Use PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable upper "
        "limit for memory allocations (may cause system failure)."
    ),
    "cuda kernel launch": RuntimeError(
        "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some other API call"
    ),
    "cublas": RuntimeError(
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    ),
    "cudnn alloc": RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
    "hip kernel launch": RuntimeError("HIP error: out of memory\nHIP kernel errors might be asynchronously reported"),
    # c10's C10_CUDA_DRIVER_CHECK: "CUDA driver error: " and cuGetErrorString's text.
    "cuda driver call": RuntimeError("CUDA driver error: out of memory"),
    # Triton's launcher (triton/backends/nvidia/driver.c, gpuAssert): "Triton Error [CUDA]: " and the same text;
    # inductor's kernels on a GPU load and run through it.
    "triton on cuda": RuntimeError("Triton Error [CUDA]: out of memory"),
    "triton on rocm": RuntimeError("Triton Error [HIP]: out of memory"),
    # Triton's ROCm launcher (third_party/amd/backend/driver.c) adds HIP's code; the typo is Triton's.
    "triton on rocm, with the code": RuntimeError("Triton Error [HIP]:  Code: 2, Messsage: out of memory"),
    # Out-of-tree backends, and what accelerate's own tests raise on a machine without a GPU.
    "ascend npu": RuntimeError("NPU out of memory. Tried to allocate 20.00 MiB (NPU 0; 60.97 GiB total capacity)"),
    "cambricon mlu": RuntimeError("MLU out of memory. Tried to allocate 2.00 GiB (MLU 0; 31.88 GiB total capacity)"),
    "moore threads musa": RuntimeError("MUSA out of memory. Tried to allocate 1.00 GiB."),
    "accelerate's fake cpu": RuntimeError("CPU out of memory."),
    "intel gaudi": RuntimeError("FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed for size::1073741824 (1024)MB"),
    "batch size exhausted": koila.BatchSizeExhausted("nothing fits", batch_size=1, attempts=3),
}

NOT_OOM_ERRORS = {
    "shape mismatch": RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x5)"),
    "cuda assert": RuntimeError("CUDA error: device-side assert triggered"),
    "python MemoryError": MemoryError(),
    "value error mentioning memory": ValueError("CUDA out of memory"),
    "keyboard interrupt": KeyboardInterrupt(),
    "system exit": SystemExit(1),
    "runtime error without args": RuntimeError(),
    "runtime error with non-str arg": RuntimeError(42),
    # accelerate counts any " out of memory." in a RuntimeError; a device name in capitals is asked for here.
    "a sentence that is no device's": RuntimeError("the data loader's worker ran out of memory."),
    "device message in a ValueError": ValueError("NPU out of memory."),
    "gaudi message in a ValueError": ValueError("FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed"),
    "triton's other failures": RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered"),
    "triton on rocm, another code": RuntimeError("Triton Error [HIP]:  Code: 1, Messsage: invalid argument"),
    "a driver call's other failure": RuntimeError("CUDA driver error: invalid argument"),
    "a message that mentions memory": RuntimeError("Triton Error [CUDA]: the log says we ran out of memory before"),
    "triton's message in a ValueError": ValueError("Triton Error [CUDA]: out of memory"),
}


@pytest.mark.parametrize("exc", OOM_ERRORS.values(), ids=OOM_ERRORS.keys())
def test_out_of_memory_errors_are_recognised(exc: BaseException) -> None:
    assert koila.is_oom(exc) is True


@pytest.mark.parametrize("exc", NOT_OOM_ERRORS.values(), ids=NOT_OOM_ERRORS.keys())
def test_other_errors_are_not_oom(exc: BaseException) -> None:
    assert koila.is_oom(exc) is False


def test_real_cpu_allocator_error_is_recognised() -> None:
    # An allocation no machine can satisfy fails in the real CPU allocator at once.
    with pytest.raises(RuntimeError) as excinfo:
        torch.empty(2**62, dtype=torch.uint8)
    assert koila.is_oom(excinfo.value)


def test_subclass_of_runtime_error_with_oom_message_counts() -> None:
    class BackendError(RuntimeError):
        pass

    assert koila.is_oom(BackendError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"))


def test_non_exception_is_rejected() -> None:
    with pytest.raises(TypeError, match="takes an exception, got str"):
        koila.is_oom("CUDA out of memory")  # type: ignore[arg-type]


# --- errors chained to an out-of-memory error -------------------------------------------


def _raise_from(cause: BaseException | None, error: BaseException) -> BaseException:
    """Return ``error`` as Python leaves it after ``raise error from cause``."""
    try:
        raise error from cause
    except BaseException as raised:  # KeyboardInterrupt is one of the cases
        return raised


def _raise_while_handling(handled: BaseException, error: BaseException) -> BaseException:
    """Return ``error`` as Python leaves it when raised inside ``except`` of ``handled``."""
    try:
        try:
            raise handled
        except BaseException:
            raise error  # noqa: B904 - an implicit context is what is tested
    except BaseException as raised:
        return raised


def test_an_error_raised_from_an_oom_is_oom() -> None:
    wrapped = _raise_from(make_oom(), RuntimeError("forward failed"))
    assert koila.is_oom(wrapped)
    assert koila.is_oom(_raise_from(wrapped, ValueError("step 3 failed")))  # two links
    assert koila.is_oom(_raise_from(make_oom("cpu"), ValueError("could not run the model")))


def test_an_error_raised_while_handling_an_oom_is_not_oom() -> None:
    # Logging the OOM failed: that failure is a different one, and retrying would hide it.
    during = _raise_while_handling(make_oom(), RuntimeError("could not write the log"))
    assert during.__context__ is not None
    assert koila.is_oom(during.__context__)
    assert not koila.is_oom(during)
    # ``from None`` leaves the context in place, and suppressed; still no OOM.
    suppressed = _raise_from(None, ValueError("no model"))
    assert suppressed.__suppress_context__
    assert not koila.is_oom(_raise_while_handling(make_oom(), suppressed))


@pytest.mark.parametrize("error", [KeyboardInterrupt(), SystemExit(1), GeneratorExit()], ids=type)
def test_an_interrupt_raised_from_an_oom_is_not_oom(error: BaseException) -> None:
    assert not koila.is_oom(_raise_from(make_oom(), error))


def test_a_cycle_of_causes_ends() -> None:
    first, second = RuntimeError("first"), RuntimeError("second")
    first.__cause__, second.__cause__ = second, first
    assert not koila.is_oom(first)
    first.__cause__ = first
    assert not koila.is_oom(first)


def test_causes_are_followed_to_a_bounded_depth() -> None:
    def chain(links: int) -> BaseException:
        error: BaseException = make_oom()
        for index in range(links):
            error = _raise_from(error, RuntimeError(f"wrapper {index}"))
        return error

    assert koila.is_oom(chain(MAX_CAUSES))
    assert not koila.is_oom(chain(MAX_CAUSES + 1))


@given(st.lists(st.sampled_from(["cause", "context"]), max_size=8))
def test_only_explicit_causes_lead_to_an_oom(links: list[str]) -> None:
    error: BaseException = make_oom()
    for index, link in enumerate(links):
        wrapper = RuntimeError(f"wrapper {index}")
        error = _raise_from(error, wrapper) if link == "cause" else _raise_while_handling(error, wrapper)
    assert koila.is_oom(error) == all(link == "cause" for link in links)


def test_batch_retries_a_real_oom_the_user_wrapped() -> None:
    model = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1))
    inputs = torch.randn(256, 64)
    sizes: list[int] = []

    @koila.batch(initial=256, cache=koila.NoCache())
    def predict(batch_size: int) -> int:
        sizes.append(batch_size)
        try:
            with torch.no_grad():
                for start in range(0, len(inputs), batch_size):
                    model(inputs[start : start + batch_size])
        except torch.OutOfMemoryError as error:
            raise RuntimeError(f"forward failed at batch size {batch_size}") from error
        return batch_size

    with simulated_device("1MiB"):
        fitted = predict()
    assert fitted < 256
    assert sizes[-1] == fitted
    assert len(sizes) > 1


def test_giving_up_on_a_wrapped_oom_keeps_the_oom_without_its_frames() -> None:
    refs: list[weakref.ref[torch.Tensor]] = []

    @koila.batch(initial=2, cache=koila.NoCache())
    def run(batch_size: int) -> None:
        activations = torch.ones(batch_size, 1024)
        refs.append(weakref.ref(activations))
        try:
            raise make_oom()
        except torch.OutOfMemoryError as error:
            raise RuntimeError("forward failed") from error

    with pytest.raises(koila.BatchSizeExhausted) as excinfo:
        run()
    wrapper = excinfo.value.__cause__
    assert isinstance(wrapper, RuntimeError)
    assert str(wrapper) == "forward failed"
    assert isinstance(wrapper.__cause__, torch.OutOfMemoryError)
    assert (wrapper.__traceback__, wrapper.__cause__.__traceback__) == (None, None)
    assert (wrapper.__context__, wrapper.__cause__.__context__) == (None, None)
    assert [ref() for ref in refs] == [None, None]


# --- library statuses: out of memory only when memory is short --------------------------

# As the libraries' errors reach Python through PyTorch.
MEMORY_SHORT_ERRORS = {
    "cudnn internal error (H100, card full)": RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR"),
    "cudnn execution failed": RuntimeError("cuDNN error: CUDNN_STATUS_EXECUTION_FAILED"),
    "cudnn workspace": RuntimeError(
        "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input."
    ),
    "cublas execution failed": RuntimeError(
        "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, opb, m, n, k, ...)`"
    ),
    "cublas internal error": RuntimeError("CUDA error: CUBLAS_STATUS_INTERNAL_ERROR when calling `cublasLtMatmul`"),
    "cublas handle": RuntimeError("CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`"),
}


def test_every_memory_short_status_is_among_the_cases() -> None:
    assert {text for text in MEMORY_SHORT_MESSAGES if any(text in str(e) for e in MEMORY_SHORT_ERRORS.values())} == set(
        MEMORY_SHORT_MESSAGES
    )


@pytest.mark.parametrize("exc", MEMORY_SHORT_ERRORS.values(), ids=MEMORY_SHORT_ERRORS.keys())
def test_a_library_status_is_no_oom_without_a_device_to_be_full(exc: RuntimeError) -> None:
    assert not memory.nearly_full()
    assert koila.is_oom(exc) is False


@pytest.mark.parametrize("exc", MEMORY_SHORT_ERRORS.values(), ids=MEMORY_SHORT_ERRORS.keys())
def test_a_library_status_is_oom_on_a_nearly_full_simulated_device(exc: RuntimeError) -> None:
    with simulated_device("100MiB"):
        assert koila.is_oom(exc) is False  # all of it free
        held = torch.empty(94 * 2**20, dtype=torch.uint8)
        assert koila.is_oom(exc) is False  # 6% free
        more = torch.empty(2 * 2**20, dtype=torch.uint8)
        assert koila.is_oom(exc) is True  # 4% free
        assert koila.is_oom(_raise_from(exc, RuntimeError("the forward failed"))) is True
        del held, more
    assert koila.is_oom(exc) is False


def test_a_simulated_share_is_what_can_be_nearly_full() -> None:
    error = MEMORY_SHORT_ERRORS["cudnn internal error (H100, card full)"]
    with simulated_device("100MiB") as device:
        device.set_memory_fraction(0.5)
        held = torch.empty(48 * 2**20, dtype=torch.uint8)  # 2 of 50 MiB left: 4%
        assert koila.is_oom(error) is True
        device.set_memory_fraction(1.0)  # 52 of 100 MiB left
        assert koila.is_oom(error) is False
        del held


@pytest.mark.parametrize("exc", MEMORY_SHORT_ERRORS.values(), ids=MEMORY_SHORT_ERRORS.keys())
def test_a_library_status_is_oom_when_the_driver_has_almost_nothing_free(
    fake_cuda: FakeCuda, exc: RuntimeError
) -> None:
    gib = 2**30
    fake_cuda.driver_free = 10 * gib  # 12.5% of 80 GiB free at the driver
    assert koila.is_oom(exc) is False
    fake_cuda.driver_free = 3 * gib  # 3.75%: the libraries allocate from there, whatever PyTorch's cache holds
    fake_cuda.reserved, fake_cuda.allocated = 77 * gib, 40 * gib
    assert koila.is_oom(exc) is True
    fake_cuda.initialized = False  # no CUDA call made yet: the error cannot be about its memory
    assert koila.is_oom(exc) is False


def test_a_library_status_is_oom_when_the_processs_share_is_nearly_used(fake_cuda: FakeCuda) -> None:
    gib = 2**30
    error = MEMORY_SHORT_ERRORS["cublas handle"]
    fake_cuda.fraction, fake_cuda.driver_free = 0.05, 76 * gib  # a 4 GiB share of a card that is mostly free
    fake_cuda.reserved = fake_cuda.allocated = int(3.9 * gib)
    assert koila.is_oom(error) is True
    fake_cuda.reserved = fake_cuda.allocated = 3 * gib
    assert koila.is_oom(error) is False


def test_an_unreadable_device_makes_a_library_status_no_oom(
    fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(device: object = None) -> tuple[int, int]:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "mem_get_info", broken)
    assert koila.is_oom(MEMORY_SHORT_ERRORS["cudnn execution failed"]) is False


def _library_call(workspace: int) -> None:
    """Stand for a library that allocates a workspace of its own and reports failing to as an internal error."""
    try:
        scratch = torch.empty(workspace, dtype=torch.uint8)
    except torch.OutOfMemoryError:
        scratch = None
    if scratch is None:  # raised outside the handler, as the library's status carries no cause
        raise RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR")


def test_a_library_that_fails_with_the_device_full_is_retried_smaller() -> None:
    tried: list[int] = []

    @koila.batch(initial=64)
    def run(batch_size: int) -> int:
        tried.append(batch_size)
        activations = torch.empty(batch_size * 3 * 2**19, dtype=torch.uint8)  # 1.5 MiB a row
        _library_call(5 * 2**20)
        return activations.numel()

    with simulated_device("100MiB"):
        assert run() == 48 * 2**20
    # At 64 the activations fit, with 4% left, and the library's workspace does not: its
    # status counts as out of memory. At 32 there is room.
    assert tried == [64, 32]
    assert run.stats.ooms == 1


def test_a_library_status_with_memory_to_spare_reaches_the_caller_unchanged() -> None:
    raised: list[BaseException] = []

    @koila.batch(initial=64)
    def run(batch_size: int) -> None:
        try:
            raise RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if ...")
        except RuntimeError as error:
            raised.append(error)
            raise

    with simulated_device("1GiB"), pytest.raises(RuntimeError, match="NOT_SUPPORTED") as excinfo:
        run()
    assert excinfo.value is raised[0]
    assert len(raised) == 1
    assert run.stats.ooms == 0


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception groups are from Python 3.11")
def test_an_exception_group_is_out_of_memory_when_every_error_it_holds_is() -> None:
    group = builtins.ExceptionGroup  # type: ignore[attr-defined]  # not in Python 3.10's builtins
    oom = make_oom()
    assert koila.is_oom(group("tasks", [oom]))
    assert koila.is_oom(group("tasks", [oom, group("inner", [make_oom(), make_oom()])]))
    assert not koila.is_oom(group("tasks", [oom, ValueError("shape mismatch")]))
    assert not koila.is_oom(builtins.BaseExceptionGroup("tasks", [oom, KeyboardInterrupt()]))  # type: ignore[attr-defined]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.TaskGroup is from Python 3.11")
def test_an_out_of_memory_error_in_a_task_group_is_retried() -> None:
    tried: list[int] = []

    @koila.batch(initial=4, cache=koila.NoCache())
    async def infer(batch_size: int) -> int:
        async def shard() -> int:
            tried.append(batch_size)
            if batch_size > 1:
                raise make_oom()
            return batch_size

        async with asyncio.TaskGroup() as group:  # type: ignore[attr-defined]
            task = group.create_task(shard())
        return task.result()

    assert asyncio.run(infer()) == 1
    assert tried == [4, 2, 1]
    assert infer.stats.ooms == 2


def test_an_oom_while_compiling_is_retried_through_backend_compiler_failed() -> None:
    """torch.compile wraps a backend's error in BackendCompilerFailed, quoting it: docs/compile.rst."""

    def backend(graph: torch.fx.GraphModule, inputs: list[Any]) -> Any:
        rows = next(each for each in inputs if isinstance(each, torch.Tensor)).shape[0]
        if rows > 128:  # as max-autotune benchmarking a kernel on a full GPU fails, through Triton
            raise RuntimeError("Triton Error [CUDA]: out of memory")
        return graph.forward

    torch._dynamo.reset()
    compiled = torch.compile(lambda rows: (rows * 2).sum(1), backend=backend)
    data = torch.randn(600, 4)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as caught:
        compiled(data[:512])
    assert koila.is_oom(caught.value)
    tried: list[int] = []

    @koila.batch(initial=512, cache=koila.NoCache())
    def predict(batch_size: int) -> torch.Tensor:
        tried.append(batch_size)
        return torch.cat([compiled(chunk) for chunk in data.split(batch_size)])

    torch.testing.assert_close(predict(), (data * 2).sum(1))
    assert tried == [512, 256, 128]
    torch._dynamo.reset()


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.TaskGroup is from Python 3.11")
def test_an_error_raised_from_a_task_groups_oom_is_retried() -> None:
    tried: list[int] = []

    @koila.batch(initial=8, cache=koila.NoCache())
    async def step(batch_size: int) -> int:
        tried.append(batch_size)

        async def task() -> None:
            if batch_size > 2:
                raise make_oom()

        try:
            async with asyncio.TaskGroup() as tasks:  # type: ignore[attr-defined]
                tasks.create_task(task())
        except builtins.ExceptionGroup as group:  # type: ignore[attr-defined]
            raise RuntimeError("forward failed") from group  # a wrapper, as recovery.rst says is retried
        return batch_size

    assert asyncio.run(step()) == 2
    assert tried == [8, 4, 2]
    group = builtins.ExceptionGroup  # type: ignore[attr-defined]
    assert koila.is_oom(_raise_from(group("tasks", [make_oom()]), RuntimeError("forward failed")))
    assert koila.is_oom(_raise_from(group("tasks", [make_oom(), make_oom()]), ValueError("step failed")))
    assert not koila.is_oom(_raise_from(group("tasks", [make_oom(), ValueError("bad")]), RuntimeError("failed")))
    interrupted = builtins.BaseExceptionGroup("tasks", [make_oom(), KeyboardInterrupt()])  # type: ignore[attr-defined]
    assert not koila.is_oom(_raise_from(interrupted, RuntimeError("forward failed")))


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception groups are from Python 3.11")
def test_the_walk_through_groups_keeps_its_limits() -> None:
    group = builtins.ExceptionGroup  # type: ignore[attr-defined]
    # A loop through a group's errors ends.
    wrapper = RuntimeError("forward failed")
    looped = group("tasks", [wrapper])
    wrapper.__cause__ = looped
    assert not koila.is_oom(looped)
    assert not koila.is_oom(wrapper)
    # The same error held twice counts both times.
    oom = make_oom()
    assert koila.is_oom(_raise_from(group("tasks", [oom, oom]), RuntimeError("forward failed")))
    # A group's errors are followed through what is left of the links, not from the start again: the
    # wrapper and the group are two of them.
    error: BaseException = make_oom()
    for index in range(MAX_CAUSES - 2):
        error = _raise_from(error, RuntimeError(f"wrapper {index}"))
    assert koila.is_oom(_raise_from(group("tasks", [error]), RuntimeError("outer")))
    deeper = _raise_from(error, RuntimeError("one more"))
    assert not koila.is_oom(_raise_from(group("tasks", [deeper]), RuntimeError("outer")))
    # Groups that share their errors are walked once each: 2**40 paths, answered at once.
    shared: BaseException = ValueError("no memory here")
    for _ in range(40):
        shared = group("level", [shared, shared])
    assert not koila.is_oom(shared)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception groups are Python 3.11's")
def test_a_group_s_verdict_does_not_depend_on_the_order_of_its_errors() -> None:
    """A group's verdict was kept from a visit that ran out of links, and stood for a later one with more."""

    def oom() -> BaseException:
        return torch.OutOfMemoryError("CUDA out of memory.")

    group = builtins.ExceptionGroup  # type: ignore[attr-defined]  # not in Python 3.10's builtins
    raised_from = RuntimeError("w")
    raised_from.__cause__ = oom()
    inner = group("g", [raised_from])
    chain: BaseException = inner
    for index in range(30):  # each raised from the next, ending in the group: 31 links of 33
        link = RuntimeError(f"c{index}")
        link.__cause__ = chain
        chain = link
    outer = group("h", [chain])
    outer.__cause__ = oom()
    assert koila.is_oom(inner)
    assert koila.is_oom(outer)
    assert koila.is_oom(group("t", [inner, outer]))
    assert koila.is_oom(group("t", [outer, inner]))
