"""Memory that operators use inside a call, where the dispatcher never sees a tensor.

On the CPU, oneDNN's convolutions reorder into channel-blocked buffers that live only during
the call (a third of a small CNN's real peak; measured here operator by operator, oneDNN 3.12,
AVX2). On CUDA, PyTorch's reduction kernel (``Reduce.cuh``) can split an output's inputs across
blocks, which meet in a staging buffer from the caching allocator (64 MiB for the bias gradient
of a ``[8192, 1024]`` float32 activation on an H100). Also the CUDA allocator's rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

__all__ = [
    "ASSUMED_CARD",
    "CudaCard",
    "cuda_card",
    "cuda_reduction_buffers",
    "cuda_reduction_workspace",
    "cuda_rounding",
    "device_workspace",
    "onednn_convolution_workspace",
]

_FORWARD = torch.ops.aten.convolution.default
_BACKWARD = torch.ops.aten.convolution_backward.default


def _vector_width() -> int:
    """Return the channels oneDNN blocks by: 16 with AVX-512, else 8."""
    return 16 if "512" in torch.backends.cpu.get_cpu_capability() else 8


def _padded(channels: int, width: int) -> int:
    return -(-channels // width) * width


def _uses_onednn(
    x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int], dilation: Sequence[int], groups: int
) -> bool:
    """Return whether PyTorch sends this convolution to oneDNN (as its own ``use_mkldnn`` decides)."""
    available = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
    if not (torch.backends.mkldnn.enabled and available) or x.dtype != torch.float32:
        return False
    kernel = list(weight.shape[2:])
    one_by_one = all(k == 1 for k in kernel[-2:])
    strided, dilated = any(s != 1 for s in stride), any(d != 1 for d in dilation)
    if not (strided or dilated or x.shape[0] >= 16 or not one_by_one or torch.get_num_threads() > 1):
        return False
    large_kernel = len(kernel) >= 2 and kernel[-1] > 3 and kernel[-2] > 3
    # PyTorch counts the input's elements over its first four sizes only: a 3-d
    # convolution's depth does not count.
    return groups > 1 or large_kernel or x.shape[0] > 1 or math.prod(x.shape[:4]) > 20480


def onednn_convolution_workspace(func: Any, args: tuple[Any, ...], out: Any) -> int:
    """Return the bytes a CPU convolution (forward or backward) holds during its call beyond its tensors."""
    if func is _FORWARD:
        x, weight = args[0], args[1]
        stride, _padding, dilation, transposed, _output_padding, groups = args[3:9]
    elif func is _BACKWARD:
        grad_output, x, weight = args[0], args[1], args[2]
        stride, _padding, dilation, transposed, _output_padding, groups, mask = args[4:11]
    else:
        return 0
    if transposed or not _uses_onednn(x, weight, stride, dilation, groups):
        return 0
    if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
        return int(weight.numel() * weight.element_size())  # channels-last: only the weight is reordered
    width, size = _vector_width(), x.element_size()
    rows, channels_in, channels_out = x.shape[0], x.shape[1], weight.shape[0]
    kernel = list(weight.shape[2:])
    spatial_in = math.prod(x.shape[2:])
    # Kernels for a first layer read the dense input as it is: forward below the vector
    # width, the weights' gradient only at exactly three channels (images).
    reads_dense = groups == 1 and not all(k == 1 for k in kernel)
    reads_dense = reads_dense and (channels_in < width if func is _FORWARD else channels_in == 3)
    per_group = _padded(max(channels_in // groups, 1), width if groups == 1 else 1)
    blocked_weight = _padded(channels_out, width) * per_group * math.prod(kernel) * size
    blocked_input = 0 if reads_dense else rows * _padded(channels_in, width) * spatial_in * size
    dense_input = x.numel() * size
    if func is _FORWARD:
        blocked_output = rows * _padded(channels_out, width) * math.prod(out.shape[2:]) * size
        dense_output = out.numel() * size
        held = max(blocked_input + blocked_weight + blocked_output, blocked_output + dense_output)
        return int(max(held - dense_output, 0))
    blocked_grad_output = rows * _padded(channels_out, width) * math.prod(grad_output.shape[2:]) * size
    results = sum(t.numel() * t.element_size() for t in out if isinstance(t, torch.Tensor))
    held = grad_input_alive = 0
    if mask[0]:  # the input's gradient
        if any(s != 1 for s in stride):  # strided: a channels-last kernel, then two dense copies
            held = max(grad_output.numel() * size + blocked_weight + dense_input, 3 * dense_input)
        else:
            blocked_grad_input = rows * _padded(channels_in, width) * spatial_in * size
            held = max(blocked_grad_output + blocked_weight + blocked_grad_input, blocked_grad_input + dense_input)
        grad_input_alive = dense_input
    if mask[1] or mask[2]:  # the weight's and the bias's gradients, after the input's
        weights = max(blocked_grad_output + blocked_input + blocked_weight, blocked_weight + weight.numel() * size)
        held = max(held, grad_input_alive + weights)
    return int(max(held - results, 0))


# --- CUDA's reduction kernel -------------------------------------------------------


class CudaCard(NamedTuple):
    """What PyTorch's reduction launcher reads of a card to size its grid."""

    multiprocessors: int
    threads_per_multiprocessor: int
    warp_size: int = 32


# Without a CUDA device to ask: an A100, the card attention.py assumes (compute capability 8.0).
ASSUMED_CARD = CudaCard(multiprocessors=108, threads_per_multiprocessor=2048)

_aten = torch.ops.aten
# The reductions that launch the kernel themselves, and whether their second argument lists dims.
_REDUCTIONS: dict[Any, bool] = {
    _aten.sum.dim_IntList: True,
    _aten.sum.default: False,
    _aten.mean.dim: True,
    _aten.mean.default: False,
}
_HALF_FLOATS = (torch.float16, torch.bfloat16)
# The launcher's limits (Reduce.cuh): threads a block, and the values one thread should sum
# before blocks are split (at least) and at most.
_BLOCK_THREADS = 512
_BLOCK_THREADS_COMPLEX128 = 256
_MIN_VALUES_PER_THREAD = 16
_MAX_VALUES_PER_THREAD = 256
_SEMAPHORE = 4  # one int per column of blocks
# The CUDA caching allocator hands out blocks in multiples of 512 bytes, and rounds
# allocations above 1 MiB up to whole 2 MiB pieces of its segments; the estimate rounds
# storages (recorder.py) and workspaces (here) by it.
_CUDA_BLOCK = 512
_CUDA_SMALL = 1 << 20
_CUDA_LARGE_ROUND = 2 << 20


def cuda_rounding(nbytes: int) -> int:
    """Return the bytes the CUDA caching allocator takes for an allocation of ``nbytes``."""
    if nbytes <= 0:
        return 0
    rounded = -(-nbytes // _CUDA_BLOCK) * _CUDA_BLOCK
    if rounded > _CUDA_SMALL:
        rounded = -(-rounded // _CUDA_LARGE_ROUND) * _CUDA_LARGE_ROUND
    return rounded


def cuda_card(device: torch.device) -> CudaCard:
    """Return what the reduction launcher would read of CUDA ``device``, or :data:`ASSUMED_CARD` without CUDA."""
    if not torch.cuda.is_available():
        return ASSUMED_CARD
    properties = torch.cuda.get_device_properties(device)
    return CudaCard(
        multiprocessors=int(properties.multi_processor_count),
        threads_per_multiprocessor=int(
            getattr(properties, "max_threads_per_multi_processor", ASSUMED_CARD.threads_per_multiprocessor)
        ),
        warp_size=int(getattr(properties, "warp_size", ASSUMED_CARD.warp_size)),
    )


def _floor_power_of_two(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _iteration_order(
    sizes: Sequence[int], in_strides: Sequence[int], out_strides: Sequence[int]
) -> list[tuple[int, int, int]]:
    """Return the reduction's dims as ``TensorIterator`` walks them, fastest first: (size, out stride, in stride)."""
    # Reduced dims first, the rest by input stride, ties to the smaller size; pairs its insertion sort
    # leaves undecided keep their places. Then neighbours one stride covers merge, and size-1 dims go.
    dims = [(sizes[i], out_strides[i], in_strides[i]) for i in reversed(range(len(sizes)))]

    def goes_after(a: tuple[int, int, int], b: tuple[int, int, int]) -> int:
        (size_a, out_a, in_a), (size_b, out_b, in_b) = a, b
        if (out_a == 0) != (out_b == 0):
            return 1 if out_b == 0 else -1
        for stride_a, stride_b in ((out_a, out_b), (in_a, in_b)):
            if stride_a == 0 or stride_b == 0:
                continue
            if stride_a != stride_b:
                return -1 if stride_a < stride_b else 1
            if size_a > size_b:
                return 1
        return 0

    for i in range(1, len(dims)):
        moving = i
        for j in range(i - 1, -1, -1):
            verdict = goes_after(dims[j], dims[moving])
            if verdict > 0:
                dims[j], dims[moving] = dims[moving], dims[j]
                moving = j
            elif verdict < 0:
                break
    merged: list[list[int]] = []
    for size, out_stride, in_stride in dims:
        if merged:
            last = merged[-1]
            joins = last[0] * last[1] == out_stride and last[0] * last[2] == in_stride
            if last[0] == 1 or size == 1 or joins:
                if last[0] == 1:
                    last[1], last[2] = out_stride, in_stride
                last[0] *= size
                continue
        merged.append([size, out_stride, in_stride])
    return [(size, out_stride, in_stride) for size, out_stride, in_stride in merged]


def _output_vector(offset: int, dims: Sequence[tuple[int, int, int]], reduced: int, item: int) -> int:
    """Return how many neighbouring outputs one thread loads together (4, 2 or 1) when it sums across rows."""
    width = 4
    checks = [offset, dims[reduced][0]]
    checks += [in_stride // item for index, (_, _, in_stride) in enumerate(dims) if index != reduced]
    for value in checks:
        while value % width:
            width //= 2
    return width


def cuda_reduction_buffers(
    x: torch.Tensor,
    dims: Sequence[int] | None,
    out_strides: Sequence[int],
    accumulator_size: int,
    card: CudaCard,
) -> tuple[int, int]:
    """Return the unrounded staging buffer and semaphore bytes CUDA's reduction kernel allocates for ``x``."""
    # A model of setReduceConfig/ReduceConfig in ATen/native/cuda/Reduce.cuh (torch 2.13, not ROCm):
    # blocks of at most 512 threads, a warp's lanes along the fastest dim, warps splitting the inputs
    # when a thread would sum min(16 x warps, 256) values or more, blocks splitting them when it still
    # sums 256 or more and the grid does not fill every multiprocessor. out_strides: in elements, per
    # dim of x, 0 for a reduced dim the result drops.
    ndim, item = x.dim(), x.element_size()
    reduced = set(range(ndim)) if not dims else {d % ndim for d in dims}
    sizes = list(x.shape)
    if math.prod(sizes) == 0:
        return 0, 0
    out_bytes = [0 if d in reduced and sizes[d] != 1 else s for d, s in enumerate(out_strides)]
    order = _iteration_order(sizes, [s * item for s in x.stride()], out_bytes)
    reduce_dims = next((i for i, (_, out_stride, _) in enumerate(order) if out_stride != 0), len(order))
    outputs = math.prod(size for size, out_stride, _ in order if out_stride != 0)
    inputs = math.prod(sizes) // outputs
    # Lanes run along the reduced dim where it is the fastest-moving one; else along the outputs.
    along_reduced = not order or reduce_dims == len(order) or order[0][2] < order[reduce_dims][2]
    if along_reduced:
        lanes, rows, fastest = inputs, outputs, (order[0][2] if order else item)
    else:
        lanes, rows, fastest = outputs, inputs, order[reduce_dims][2]
    loaded = 1
    if fastest == item:
        if along_reduced and lanes >= 128 and reduce_dims == 1:
            lanes //= 8 if item == 2 else 4  # a thread reads this many neighbouring inputs at once
        elif not along_reduced:
            loaded = _output_vector(int(x.storage_offset()), order, reduce_dims, item)
            lanes //= loaded
    limit = (_BLOCK_THREADS_COMPLEX128 if x.dtype == torch.complex128 else _BLOCK_THREADS) // loaded
    lanes_cap = _floor_power_of_two(lanes) if lanes < limit else limit
    rows_cap = _floor_power_of_two(rows) if rows < limit else limit
    width = min(lanes_cap, card.warp_size)
    height = min(rows_cap, limit // width)
    width = min(lanes_cap, limit // height)
    input_step, output_step = (width, 1) if along_reduced else (1, width)
    warps_split = -(-inputs // input_step) >= min(height * 16, _MAX_VALUES_PER_THREAD)
    if warps_split:
        input_step *= height
    else:
        output_step *= height
    per_thread = -(-inputs // input_step)
    grid = -(-(outputs // loaded) // output_step)
    full_grid = card.multiprocessors * (card.threads_per_multiprocessor // (width * height))
    if not warps_split or per_thread < _MAX_VALUES_PER_THREAD or grid > full_grid:
        return 0, 0
    blocks = max(
        min(-(-full_grid // grid), -(-per_thread // _MIN_VALUES_PER_THREAD)),
        -(-per_thread // _MAX_VALUES_PER_THREAD),
    )
    if blocks <= 1:
        return 0, 0
    # The buffer is sized per output and block, times the lanes (and their loaded outputs) when
    # lanes hold different outputs: more than the kernel writes, but what it asks the allocator for.
    staging = accumulator_size * outputs * blocks * (1 if along_reduced else width * loaded)
    return staging, _SEMAPHORE * grid


def _accumulator_size(kernel_input: torch.dtype, result: torch.Tensor) -> int:
    """Return the bytes of the accumulator CUDA's sum and mean kernels use: float for half types, else the result's."""
    if kernel_input in _HALF_FLOATS:
        return 4
    if kernel_input == torch.complex32:
        return 8
    return int(result.element_size())


def _result_strides(x: torch.Tensor, dims: Sequence[int] | None, result: torch.Tensor) -> list[int]:
    """Return the result's strides, one per dim of ``x``, as the reduction views its result."""
    if result.dim() == x.dim():
        return list(result.stride())
    reduced = set(range(x.dim())) if not dims else {d % x.dim() for d in dims}
    kept = iter(result.stride())
    return [0 if d in reduced else next(kept) for d in range(x.dim())]


def _reduction_bytes(x: torch.Tensor, dims: Sequence[int] | None, result: torch.Tensor, card: CudaCard) -> int:
    """Return what a CUDA ``sum``/``mean`` of ``x`` into ``result`` allocates inside the call, rounded."""
    if x.dim() == 0 or result.numel() == 0:
        return 0
    # Half and bfloat16 inputs summed into float32 are read as they are; any other input whose
    # dtype is not the result's is first copied into it (ReduceOpsUtils.h, make_reduction).
    kernel_input = x.dtype if x.dtype in _HALF_FLOATS and result.dtype == torch.float32 else result.dtype
    converted = 0
    if kernel_input != x.dtype:
        x = torch.empty_like(x, dtype=kernel_input, device="meta")  # the strides x.to(kernel_input) gives its copy
        converted = cuda_rounding(x.numel() * x.element_size())
    staging, semaphores = cuda_reduction_buffers(
        x, dims, _result_strides(x, dims, result), _accumulator_size(kernel_input, result), card
    )
    return converted + cuda_rounding(staging) + cuda_rounding(semaphores)


def cuda_reduction_workspace(func: Any, args: tuple[Any, ...], out: Any, card: CudaCard = ASSUMED_CARD) -> int:
    """Return the bytes ``sum``, ``mean`` or a bias gradient allocates on CUDA during its call, rounded."""
    lists_dims = _REDUCTIONS.get(func)
    if lists_dims is not None:
        dims = args[1] if lists_dims and len(args) > 1 else None
        return _reduction_bytes(args[0], dims, out, card)
    if func is _BACKWARD and args[10][2]:
        # Outside cuDNN, the bias gradient is grad_output summed over every dim but the channels'.
        grad_output = args[0]
        dims = [d for d in range(grad_output.dim()) if d != 1]
        return _reduction_bytes(grad_output, dims, out[2], card)
    return 0


def device_workspace(device: torch.device) -> Callable[[Any, tuple[Any, ...], Any], int] | None:
    """Return ``workspace(func, args, out) -> bytes`` for ``device``, or ``None`` where none is modelled."""
    if device.type == "cpu":
        return onednn_convolution_workspace
    if device.type == "cuda" and torch.version.hip is None:
        card = cuda_card(device)

        def workspace(func: Any, args: tuple[Any, ...], out: Any) -> int:
            return cuda_reduction_workspace(func, args, out, card)

        return workspace
    return None
