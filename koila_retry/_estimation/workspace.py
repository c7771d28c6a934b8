"""Memory that operators use inside a call, where the dispatcher never sees a tensor.

On the CPU, oneDNN's convolutions convert their inputs to channel-blocked layouts
(channels padded to the vector width) and compute into a blocked result, which is
then reordered into PyTorch's dense output. Those buffers live only during the
call, and on a small convolutional network they were a third of the real peak. The
rules below were measured on this project's machines (oneDNN 3.12, AVX2) operator
by operator, against the resident set of a child process, to within ~0.3 MiB per
call; ``docs/performance.rst`` has the check on whole training steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["onednn_convolution_workspace"]

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
    return groups > 1 or large_kernel or x.shape[0] > 1 or x.numel() > 20480


def onednn_convolution_workspace(func: Any, args: tuple[Any, ...], out: Any) -> int:
    """Return the bytes a CPU convolution holds during the call beyond its inputs and outputs.

    Args:
        func (OpOverload): the operator; anything but ``aten.convolution`` and
            ``aten.convolution_backward`` uses none.
        args (tuple): its positional arguments.
        out (Tensor or tuple): what it returned.

    Returns:
        int: bytes alive during the call on top of its arguments and results.
    """
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
