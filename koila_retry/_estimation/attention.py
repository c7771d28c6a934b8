"""The attention kernels the target device runs, followed on meta tensors.

On meta tensors ``scaled_dot_product_attention`` takes its math path (the whole attention
matrix, softmax's output kept for backward) and the fast path of ``nn.MultiheadAttention``
and ``nn.TransformerEncoderLayer`` is never taken. :func:`device_kernels` makes the run take
what the target would: the fused kernel chosen by the gates of PyTorch's ``sdp_utils``, the
fast path's operators, and on CUDA ``native_dropout``'s one-byte mask. A CUDA estimate made
without a CUDA device assumes compute capability 8.0 (A100).
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from koila_retry._estimation.autocast import cast_as

__all__ = [
    "ASSUMED_CAPABILITY",
    "CUDNN",
    "EFFICIENT",
    "FLASH",
    "MATH",
    "Attention",
    "choose_backend",
    "device_kernels",
]

FLASH, EFFICIENT, CUDNN, MATH = "flash", "efficient", "cudnn", "math"

# The card assumed for a CUDA estimate made where no CUDA device can be asked.
ASSUMED_CAPABILITY = (8, 0)

_SDPA = torch._C._nn.scaled_dot_product_attention
# The names by which a torch function written in Python asks whether to hand its call to a mode.
_HAND_OFF_CHECKS = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")
_aten = torch.ops.aten
# Whether the user left each fused kernel on (torch.nn.attention.sdpa_kernel switches them); the
# flash switch holds for the CPU's flash kernel too.
_SWITCHES: dict[str, Callable[[], bool]] = {
    FLASH: torch.backends.cuda.flash_sdp_enabled,
    EFFICIENT: torch.backends.cuda.mem_efficient_sdp_enabled,
    CUDNN: torch.backends.cuda.cudnn_sdp_enabled,
}
_MATH_SWITCH: Callable[[], bool] = torch.backends.cuda.math_sdp_enabled
_CUDNN_VERSION: Callable[[], int | None] = torch.backends.cudnn.version
_CPU_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_HALF = (torch.float16, torch.bfloat16)
_NEWEST = (12, 1)  # the newest compute capability PyTorch's fused kernels accept


class Attention(NamedTuple):
    """One call of ``scaled_dot_product_attention``: what the kernel choice looks at."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    mask: torch.Tensor | None = None
    dropout: float = 0.0
    causal: bool = False
    gqa: bool = False

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.query, self.key, self.value

    @property
    def training(self) -> bool:
        """Whether autograd records the call (the kernel then saves what backward needs)."""
        return torch.is_grad_enabled() and any(tensor.requires_grad for tensor in self.tensors)


# --- the gates shared by the backends -------------------------------------------------


def _four_dimensional(call: Attention) -> bool:
    return all(tensor.dim() == 4 for tensor in call.tensors)


def _heads_fit(call: Attention, *, kv_heads_may_differ: bool = False) -> bool:
    """Same batch; the same heads, or with ``enable_gqa`` query heads a multiple of the key's and value's."""
    q, k, v = call.tensors
    if not q.size(0) == k.size(0) == v.size(0):
        return False
    if q.size(-3) == k.size(-3) == v.size(-3):
        return True
    if not call.gqa or (not kv_heads_may_differ and k.size(-3) != v.size(-3)):
        return False
    return q.size(-3) % k.size(-3) == 0 and q.size(-3) % v.size(-3) == 0


def _lengths(call: Attention) -> bool:
    return call.query.size(-2) != 0 and call.key.size(-2) != 0


def _unit_stride(call: Attention, *, singleton_head_ok: bool, mask_too: bool) -> bool:
    dense = all(tensor.stride(-1) == 1 for tensor in call.tensors)
    dense = dense or (singleton_head_ok and call.query.size(-1) == 1)
    return dense and not (mask_too and call.mask is not None and call.mask.stride(-1) != 1)


def _mask_shape(call: Attention) -> bool:
    """A mask of 2 dimensions, or of 4 that broadcast over batch and heads; none that needs a gradient."""
    mask = call.mask
    if mask is None:
        return True
    if mask.requires_grad:
        return False

    def fits(size: int, target: int) -> bool:
        return size in (1, target)

    q = call.query
    if not (fits(mask.size(-2), q.size(2)) and fits(mask.size(-1), call.key.size(2))):
        return False
    return mask.dim() == 2 or (mask.dim() == 4 and fits(mask.size(0), q.size(0)) and fits(mask.size(1), q.size(1)))


def _dtype_in(call: Attention, allowed: Iterable[torch.dtype]) -> bool:
    dtype = call.query.dtype
    return call.key.dtype == dtype == call.value.dtype and dtype in tuple(allowed)


def _same_head_size(call: Attention) -> bool:
    return call.query.size(-1) == call.key.size(-1) == call.value.size(-1)


# --- the CPU --------------------------------------------------------------------------


def _cpu_backend(call: Attention) -> str:
    flash = (
        _SWITCHES[FLASH]()
        and call.dropout == 0  # the CPU's flash kernel has no dropout
        and _four_dimensional(call)
        and _heads_fit(call)
        and _mask_shape(call)
        and _same_head_size(call)
        and _lengths(call)
        and _unit_stride(call, singleton_head_ok=False, mask_too=False)
        and _dtype_in(call, _CPU_FLASH_DTYPES)
    )
    return FLASH if flash else MATH


# --- CUDA -----------------------------------------------------------------------------


def _within(capability: tuple[int, int], low: tuple[int, int]) -> bool:
    return low <= capability <= _NEWEST


def _cuda_flash(call: Attention, capability: tuple[int, int], cudnn: int | None) -> bool:
    head = call.query.size(-1)
    if not (_SWITCHES[FLASH]() and _four_dimensional(call) and call.mask is None):
        return False
    if not (_same_head_size(call) and head <= 256 and _within(capability, (8, 0))):
        return False
    # On sm86-89 and sm120-121 flash's backward has no kernel for some head sizes.
    narrow = (8, 6) <= capability <= (8, 9) or (12, 0) <= capability <= (12, 1)
    if call.training and narrow and not (head <= 192 or (call.dropout == 0 and head > 224)):
        return False
    if call.causal and call.query.size(-2) != call.key.size(-2):
        return False
    return (
        _dtype_in(call, _HALF)
        and _heads_fit(call)
        and _lengths(call)
        and _unit_stride(call, singleton_head_ok=True, mask_too=False)
    )


def _gemm_alignment(dtype: torch.dtype, capability: tuple[int, int]) -> int:
    """Return the elements the memory-efficient kernel's matrix products need the head size to be a multiple of."""
    half = dtype in _HALF
    tensor_cores = capability[0] >= 8 or (capability[0] >= 7 and half)
    alignment = 4 if capability[0] >= 8 else 1
    return max(alignment, 128 // (16 if half else 32)) if tensor_cores else alignment


def _cuda_efficient(call: Attention, capability: tuple[int, int], cudnn: int | None) -> bool:
    if not (_SWITCHES[EFFICIENT]() and _within(capability, (5, 0))):
        return False
    if not _four_dimensional(call):
        return False
    q, k, v = call.tensors
    alignment = _gemm_alignment(q.dtype, capability)
    if not (q.size(-1) == k.size(-1) and q.size(-1) % alignment == 0 and v.size(-1) % alignment == 0):
        return False
    if q.size(-1) <= 0 or v.size(-1) <= 0:
        return False
    # From sm80 on, the kernel reads whole vectors: each tensor must start on one.
    if capability[0] >= 8 and any(t.numel() and t.storage_offset() % alignment for t in call.tensors):
        return False
    dtypes = (torch.float16, torch.float32, torch.bfloat16) if capability[0] >= 8 else (torch.float16, torch.float32)
    return (
        _lengths(call)
        and _unit_stride(call, singleton_head_ok=False, mask_too=True)
        and _heads_fit(call)
        and _dtype_in(call, dtypes)
    )


def _cudnn_d256(capability: tuple[int, int], cudnn: int) -> bool:
    """Return whether cuDNN takes head sizes up to 256 on this card."""
    return (capability == (9, 0) or capability[0] == 10) and cudnn > 92200


def _cuda_cudnn(call: Attention, capability: tuple[int, int], cudnn: int | None) -> bool:
    if cudnn is None or cudnn < 90000 or not _SWITCHES[CUDNN]():
        return False
    if call.dropout > 0 and 91100 < cudnn < 91400:
        return False
    if torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled():
        return False
    if not (_four_dimensional(call) and _dtype_in(call, _HALF) and _mask_shape(call) and _within(capability, (8, 0))):
        return False
    if call.dropout * 16 != math.floor(call.dropout * 16):  # cuDNN's dropout comes in sixteenths
        return False
    if not (_lengths(call) and _unit_stride(call, singleton_head_ok=True, mask_too=True)):
        return False
    if not _heads_fit(call, kv_heads_may_differ=True):
        return False
    q, k, v = call.tensors
    if q.size(0) > 65535 or q.size(1) > 65535:
        return False
    wide = _cudnn_d256(capability, cudnn)
    limit = 256 if wide else 128
    if q.size(-1) > limit or v.size(-1) > limit or q.size(-1) % 8 or v.size(-1) % 8:
        return False
    if k.size(-2) == 1 or (call.dropout > 0 and q.size(-2) == 1):
        return False
    if call.training and wide:
        sizes = (q.size(-1), v.size(-1))
        return (sizes[0] <= 128 and sizes[1] <= 128) or sizes in ((192, 128), (256, 256))
    return True


def _cudnn_first(capability: tuple[int, int], cudnn: int | None) -> bool:
    """Return whether PyTorch tries cuDNN's attention first on this card (Hopper and Blackwell, cuDNN > 9.15)."""
    if cudnn is None or cudnn <= 91500 or os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "0") not in ("0", ""):
        return False
    if capability[0] not in (9, 10):
        return False
    built = torch.version.cuda
    return built is None or int(built.split(".")[0]) >= 13 or capability[1] in (0, 3)


_CUDA_GATES: dict[str, Callable[[Attention, tuple[int, int], int | None], bool]] = {
    CUDNN: _cuda_cudnn,
    FLASH: _cuda_flash,
    EFFICIENT: _cuda_efficient,
}


def _cuda_backend(call: Attention, capability: tuple[int, int], cudnn: int | None) -> str:
    order = [CUDNN, FLASH, EFFICIENT] if _cudnn_first(capability, cudnn) else [FLASH, EFFICIENT]
    for backend in order:
        if _CUDA_GATES[backend](call, capability, cudnn):
            return backend
    return MATH


def _card(target: torch.device) -> tuple[tuple[int, int], int | None]:
    """Return the compute capability and cuDNN version of a CUDA target, or what is assumed without one."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_capability(target), _CUDNN_VERSION()
    return ASSUMED_CAPABILITY, None


def choose_backend(
    target: torch.device | str,
    call: Attention,
    *,
    capability: tuple[int, int] | None = None,
    cudnn: int | None = None,
) -> str:
    """Return the attention kernel ``target`` (with the CUDA card and cuDNN version given) runs for ``call``."""
    device = torch.device(target)
    if device.type == "cpu":
        return _cpu_backend(call)
    if device.type != "cuda":
        return MATH
    if capability is None:
        capability, found = _card(device)
        cudnn = found if cudnn is None else cudnn
    return _cuda_backend(call, capability, cudnn)


# --- running the chosen kernel on meta tensors ------------------------------------------


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Return a boolean mask as the additive float mask the fused kernels read (a new tensor, as on the device)."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    zero = torch.scalar_tensor(0.0, dtype=dtype, device=mask.device)
    return torch.where(mask, zero, torch.scalar_tensor(-math.inf, dtype=dtype, device=mask.device))


def _efficient_bias(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Return the bias the memory-efficient kernel reads: padded to 16 columns, or copied if its strides are not."""
    bias = mask.expand(query.size(0), query.size(1), query.size(2), key.size(2))
    columns = bias.size(-1)
    if columns % 16:
        padded = F.pad(bias, (0, 16 - columns % 16))
        return padded[..., :columns]
    if any(stride % 16 for stride in bias.stride()[:3]):
        return bias.contiguous()
    return bias


def _run_kernel(backend: str, target: torch.device, call: Attention, scale: float | None) -> torch.Tensor:
    """Run the fused attention operator ``backend`` names on the call's meta tensors; return its output."""
    q, k, v = call.tensors
    mask = _additive(call.mask, q.dtype)
    out: torch.Tensor
    if target.type == "cpu":
        out = _aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, call.dropout, call.causal, attn_mask=mask, scale=scale
        )[0]
        return out
    if backend == FLASH:
        # The CUDA kernel takes head sizes in multiples of 8: others are padded by copies.
        size = q.size(-1)
        if size % 8:
            scale = 1 / math.sqrt(size) if scale is None else scale
            q, k, v = (F.pad(tensor, (0, 8 - size % 8)) for tensor in (q, k, v))
        out = _aten._scaled_dot_product_flash_attention(q, k, v, call.dropout, call.causal, False, scale=scale)[0]
        return out[..., :size] if size % 8 else out
    if q.size(-3) != k.size(-3) or q.size(-3) != v.size(-3):
        # Grouped keys and values, repeated for every query head: their backward makes gradients per query head.
        k, v = (t.repeat_interleave(q.size(-3) // t.size(-3), -3) for t in (k, v))
    if backend == EFFICIENT:
        bias = None if mask is None else _efficient_bias(mask, q, k)
        out = _aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, call.training, call.dropout, call.causal, scale=scale
        )[0]
        return out
    out = _aten._scaled_dot_product_cudnn_attention(
        q, k, v, mask, call.training, call.dropout, call.causal, False, scale=scale
    )[0]
    return out


# Called as note(what, why) for what the estimate runs but knows it does not model exactly.
Note = Callable[[str, str], None]

_LEFT_ALIGNED = torch._nested_tensor_from_mask_left_aligned
_PADDED = (
    "with a src_key_padding_mask in eval mode it packs the batch into a nested tensor, whose size depends on "
    "the mask's values: the padded batch is counted, so the estimate may be above the real peak"
)
_UNMODELLED_BACKWARD = (
    "the backward of CUDA's fused attention kernels allocates float32 accumulators inside itself (flash: "
    "the queries' gradient in float32), which are not modelled: the estimate may be below the real peak"
)
_NO_KERNEL = (
    "no kernel CUDA has switched on takes this call (torch.nn.attention.sdpa_kernel left the math path off), "
    "where CUDA raises: its math path is counted, with the whole attention matrix, above what a call that "
    "reaches a fused kernel holds (a mask, or a branch, made from a value the estimate reads as a placeholder "
    "can cause it)"
)
_MATH_DROPOUT = (
    "its math path with dropout is counted with the noise tensor that meta tensors draw, in the attention "
    "matrix's dtype, where CUDA keeps a one-byte mask: the estimate may be above the real peak"
)


def _attention(
    target: torch.device,
    card: tuple[tuple[int, int], int | None],
    note: Note,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    # Autocast casts before PyTorch chooses a kernel, which then sees the lower precision.
    query, key, value, attn_mask = cast_as("scaled_dot_product_attention", query, key, value, attn_mask)
    call = Attention(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    meta = all(tensor.device.type == "meta" and not tensor.is_nested for tensor in call.tensors)
    backend = choose_backend(target, call, capability=card[0], cudnn=card[1]) if meta else MATH
    if target.type not in ("cpu", "cuda"):
        note(
            "scaled_dot_product_attention",
            f"its math path is counted, with the whole attention matrix; {target.type} may run a fused kernel",
        )
    elif backend != MATH and target.type == "cuda" and call.training:
        note("scaled_dot_product_attention", _UNMODELLED_BACKWARD)
    elif backend == MATH and target.type == "cuda":
        if meta and not _MATH_SWITCH():
            note("scaled_dot_product_attention", _NO_KERNEL)
        if 0 < dropout_p < 1:
            note("scaled_dot_product_attention", _MATH_DROPOUT)
    if backend == MATH:
        return _SDPA(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    return _run_kernel(backend, target, call, scale)


# --- the fast path of nn.TransformerEncoderLayer and nn.MultiheadAttention ---------------


def _plain(tensors: Iterable[torch.Tensor | None]) -> bool:
    """Return whether no tensor is a subclass (one would make the fast path step aside) or needs a gradient now."""
    present = [tensor for tensor in tensors if tensor is not None]
    if any(type(tensor) not in (torch.Tensor, nn.Parameter) for tensor in present):
        return False
    return not (torch.is_grad_enabled() and any(tensor.requires_grad for tensor in present))


def _hooked(module: nn.Module) -> bool:
    return any(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in module.modules())


def _native_attention(
    target: torch.device,
    card: tuple[tuple[int, int], int | None],
    x: torch.Tensor,
    heads: int,
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    mask: torch.Tensor | None,
    need_weights: bool,
    average: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run ``aten::_native_multi_head_attention``'s operators for self-attention over ``x``, as the device does."""
    x, *cast, mask = cast_as("_native_multi_head_attention", x, *weights, mask)
    in_weight, in_bias, out_weight, out_bias = cast
    batch, length, width = x.shape
    head = width // heads
    if target.type == "cuda" and not need_weights and mask is None and head % 8 == 0:
        # CUDA projects and calls a fused attention kernel where one takes the unprojected views.
        views = x.view(batch, length, heads, head).transpose(1, 2)
        backend = choose_backend(target, Attention(views, views, views), capability=card[0], cudnn=card[1])
        if backend != MATH:
            projected = F.linear(x, in_weight, in_bias)
            q, k, v = (part.view(batch, -1, heads, head).transpose(1, 2) for part in projected.chunk(3, -1))
            attended = _run_kernel(backend, target, Attention(q, k, v), None)
            out = F.linear(attended.transpose(1, 2).reshape(batch, -1, width), out_weight, out_bias)
            return out, None
    # The general path (the CPU's only one): one projection, a packed copy of q, k and v with the
    # bias added (its kernel has no meta function: an empty tensor of its size stands in), the
    # scores, softmax in place (or into a new tensor under a mask), the context written over q,
    # the scores dropped unless returned, then q's heads gathered for the output projection.
    projected = torch.mm(x.reshape(-1, width), in_weight.t())
    packed = torch.empty((3, batch, heads, length, head), dtype=x.dtype, device=x.device)
    del projected
    q, k = packed[0].reshape(batch * heads, length, head), packed[1].reshape(batch * heads, length, head)
    scores = torch.bmm(q, k.transpose(1, 2))
    if mask is not None:
        flags = mask if mask.dtype == torch.bool else mask.to(torch.bool)
        scores = torch.empty_like(scores)
        del flags
    if not need_weights:
        del scores
    gathered = packed[0].permute(0, 2, 1, 3).contiguous()
    out = torch.addmm(out_bias, gathered.view(-1, width), out_weight.t()).view(batch, length, width)
    del gathered
    if not need_weights:
        return out, None
    per_head = scores.view(batch, heads, length, length)
    return out, (per_head.sum(dim=1).div_(heads) if average else per_head)


def _encoder_layer_fast(
    layer: nn.TransformerEncoderLayer,
    target: torch.device,
    card: tuple[tuple[int, int], int | None],
    src: torch.Tensor,
    src_mask: torch.Tensor | None = None,
    src_key_padding_mask: torch.Tensor | None = None,
    is_causal: bool = False,
) -> torch.Tensor | None:
    """Return the layer's output by the fused fast path if the target takes it, else None (nothing run)."""
    attention = layer.self_attn
    if not (
        torch.backends.mha.get_fastpath_enabled()
        and src.dim() == 3
        and not layer.training
        and attention.batch_first
        and attention.in_proj_bias is not None
        and attention._qkv_same_embed_dim
        and layer.activation_relu_or_gelu
        and layer.norm1.eps == layer.norm2.eps
        and attention.num_heads % 2 == 0
        and not torch.is_autocast_enabled()
        and not _hooked(layer)
    ):
        return None
    weights = (attention.in_proj_weight, attention.in_proj_bias, attention.out_proj.weight, attention.out_proj.bias)
    norms = (layer.norm1.weight, layer.norm1.bias, layer.norm2.weight, layer.norm2.bias)
    feed = (layer.linear1.weight, layer.linear1.bias, layer.linear2.weight, layer.linear2.bias)
    if not _plain((src, *weights, *norms, *feed)):
        return None
    merged = _merged_masks(attention, src, src_mask, "src_mask", src_key_padding_mask, "src_key_padding_mask")
    width, eps = attention.embed_dim, layer.norm1.eps
    x = src if not layer.norm_first else F.layer_norm(src, (width,), norms[0], norms[1], eps)
    x = _native_attention(target, card, x, attention.num_heads, weights, merged, False, True)[0]
    x.add_(src)
    if not layer.norm_first:
        x = F.layer_norm(x, (width,), norms[0], norms[1], eps)
    residual = x
    if layer.norm_first:
        x = F.layer_norm(x, (width,), norms[2], norms[3], eps)
    batch, length = x.shape[:2]
    hidden = torch._addmm_activation(
        feed[1], x.reshape(batch * length, width), feed[0].t(), use_gelu=layer.activation_relu_or_gelu == 2
    )
    x = torch.addmm(feed[3], hidden, feed[2].t()).view(batch, length, width)
    del hidden
    x.add_(residual)
    return x if layer.norm_first else F.layer_norm(x, (width,), norms[2], norms[3], eps)


def _attention_fast(
    module: nn.MultiheadAttention,
    target: torch.device,
    card: tuple[tuple[int, int], int | None],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    need_weights: bool = True,
    attn_mask: torch.Tensor | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Return the module's output by the fused fast path if the target takes it, else None (nothing run)."""
    if any(mask is not None and torch.is_floating_point(mask) for mask in (attn_mask, key_padding_mask)):
        return None
    weights = (module.in_proj_weight, module.in_proj_bias, module.out_proj.weight, module.out_proj.bias)
    if not (
        torch.backends.mha.get_fastpath_enabled()
        and query.dim() == 3
        and query is key
        and key is value
        and weights[0] is not None
        and weights[1] is not None
        and query.dtype == weights[0].dtype == weights[1].dtype
        and not module.training
        and module.num_heads % 2 == 0
        and module.batch_first
        and module.bias_k is None
        and module.bias_v is None
        and not module.add_zero_attn
        and module._qkv_same_embed_dim
        and not torch.is_autocast_enabled()
        and _plain((query, *weights))
    ):
        return None
    merged = _merged_masks(module, query, attn_mask, "attn_mask", key_padding_mask, "key_padding_mask")
    return _native_attention(
        target,
        card,
        query,
        module.num_heads,
        weights,
        merged,
        need_weights,
        average_attn_weights,
    )


def _merged_masks(
    module: nn.MultiheadAttention,
    query: torch.Tensor,
    mask: torch.Tensor | None,
    mask_name: str,
    padding: torch.Tensor | None,
    padding_name: str,
) -> torch.Tensor | None:
    """Return the attention and padding masks as the fast path merges them, checked as PyTorch checks them."""
    padding = F._canonical_mask(
        mask=padding,
        mask_name=padding_name,
        other_type=F._none_or_dtype(mask),
        other_name=mask_name,
        target_type=query.dtype,
    )
    mask = F._canonical_mask(
        mask=mask, mask_name=mask_name, other_type=None, other_name="", target_type=query.dtype, check_other=False
    )
    merged: torch.Tensor | None = module.merge_masks(mask, padding, query)[0]
    return merged


_FAST_PATHS: dict[type[nn.Module], Callable[..., Any]] = {
    nn.TransformerEncoderLayer: _encoder_layer_fast,
    nn.MultiheadAttention: _attention_fast,
}


def _follow_fast_path(module: nn.Module, target: torch.device, card: tuple[tuple[int, int], int | None]) -> bool:
    """Give an eligible module a forward that takes the fused fast path where the target would; return if given."""
    own = getattr(type(module), "forward", None)  # a TorchScript class has none to read
    kind = next((kind for kind in _FAST_PATHS if own is kind.forward), None)
    if kind is None or "forward" in vars(module):
        return False
    fast, composite = _FAST_PATHS[kind], kind.forward
    thread = threading.get_ident()

    def forward(*args: Any, **kwargs: Any) -> Any:
        # An attribute of the module is every thread's: another thread that calls the module
        # while the estimate runs gets the forward of its class, as it would without it.
        if threading.get_ident() != thread:
            return composite(module, *args, **kwargs)
        found = fast(module, target, card, *args, **kwargs)
        return composite(module, *args, **kwargs) if found is None else found

    vars(module)["forward"] = forward
    return True


# --- dropout, as CUDA runs it ------------------------------------------------------------


def _functional_dropout(
    input: Any, p: float = 0.5, training: bool = True, inplace: bool = False
) -> tuple[Any, float, bool, bool]:
    return input, p, training, inplace


def _aten_dropout(input: Any, p: float, train: bool) -> tuple[Any, float, bool, bool]:
    return input, p, train, False


# Each way of calling dropout, and how it names its arguments: (input, p, training, in place).
_DROPOUTS: tuple[tuple[Any, Callable[..., tuple[Any, float, bool, bool]]], ...] = (
    (F.dropout, _functional_dropout),
    (torch.dropout, _aten_dropout),
)


def _cuda_dropout(input: Any, p: float, training: bool, inplace: bool) -> torch.Tensor | None:
    """Return dropout's output as CUDA's fused kernel makes it, or None where CUDA takes the composite path too."""
    # aten::dropout calls native_dropout for a CUDA tensor out of place in training with 0 < p < 1,
    # and autograd keeps its boolean mask; elsewhere (meta too) it keeps a noise tensor in the input's dtype.
    if not (training and not inplace and isinstance(p, float | int) and 0 < p < 1):
        return None
    if type(input) not in (torch.Tensor, nn.Parameter) or input.layout != torch.strided or input.is_nested:
        return None
    if input.numel() == 0:
        return None
    out: torch.Tensor = torch.native_dropout(input, float(p), True)[0]
    return out


# --- the mode that applies the rules ----------------------------------------------------


def _no_override(*_: Any) -> bool:
    return False


def _past_hand_off(func: Callable[..., Any]) -> Callable[..., Any] | None:
    """Return a copy of a Python torch function whose ``has_torch_function`` check finds no mode, or None."""
    # Handed to a mode, such a function's original runs with the mode off the stack, so what its body
    # calls escapes the mode; the copy, run with the mode on, lets them reach it. Not
    # torch.overrides.redispatch_function: torch 2.11 lacks it (the H100 run of 2026-11-25 counted
    # nn.MultiheadAttention's inner attention by its math path).
    code, names = getattr(func, "__code__", None), getattr(func, "__globals__", None)
    if not isinstance(code, types.CodeType) or not isinstance(names, dict):
        return None
    checks = [name for name in _HAND_OFF_CHECKS if name in code.co_names]
    if not checks:
        return None
    scope = {**names, **dict.fromkeys(checks, _no_override)}
    copy = types.FunctionType(code, scope, code.co_name, getattr(func, "__defaults__", None), func.__closure__)
    copy.__kwdefaults__ = getattr(func, "__kwdefaults__", None)
    return copy


# Autograd's entries hand their call to the function modes, each of which runs it with itself off
# the stack, so backward would run outside them all: a checkpointed region, recomputed there, would
# take the math path and CUDA's composite dropout where its forward took the stand-ins, and
# torch.utils.checkpoint raises CheckpointError (reentrant checkpointing counted 5 times the truth).
# Their bodies, past that hand-off, run with the modes on.
_BACKWARD_BODIES: dict[Any, Callable[..., Any]] = {
    entry: body
    for entry in (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad)
    if (body := _past_hand_off(entry)) is not None
}

_INNER_ATTENTION = (
    "its body could not be run past its hand-off to the estimate, so the attention inside it is counted by "
    "its math path, with the whole attention matrix: the estimate may be above the real peak"
)


class _Kernels(TorchFunctionMode):
    """Send ``scaled_dot_product_attention`` to the kernel the target would choose, and CUDA's dropout to its own."""

    def __init__(
        self, target: torch.device, card: tuple[tuple[int, int], int | None], note: Note, later: list[Any]
    ) -> None:
        super().__init__()
        self.target, self.card, self.note = target, card, note
        self.inside_attention = False  # running multi_head_attention_forward's body
        self.later = later  # the run's function modes entered after this one

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func is _SDPA:
            return _attention(self.target, self.card, self.note, *args, **(kwargs or {}))
        if func is _LEFT_ALIGNED:
            # nn.TransformerEncoder asks whether a padding mask's rows are left-aligned, to pack the batch
            # into a nested tensor, which meta tensors cannot be: the padded batch is counted instead.
            self.note("torch.nn.TransformerEncoder", _PADDED)
            return False
        if func is F.multi_head_attention_forward:
            return self._multi_head_attention(func, args, kwargs or {})
        backward = _BACKWARD_BODIES.get(func)
        if backward is not None:
            return self._backward(backward, args, kwargs or {})
        bind = next((bind for known, bind in _DROPOUTS if func is known), None) if self.target.type == "cuda" else None
        if bind is not None:
            fused = _cuda_dropout(*bind(*args, **(kwargs or {})))
            if fused is not None:
                return fused
        return func(*args, **(kwargs or {}))

    def _multi_head_attention(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run the function's body with this mode on the stack: the attention and dropout inside it reach the mode."""
        body = None if self.inside_attention else _past_hand_off(func)
        if body is None:  # not Python, or its body handed the call on after all: it runs as it comes
            self.note("torch.nn.functional.multi_head_attention_forward", _INNER_ATTENTION)
            return func(*args, **kwargs)
        self.inside_attention = True
        try:
            with self:
                return body(*args, **kwargs)
        finally:
            self.inside_attention = False

    def _backward(self, body: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run autograd's backward with this mode and those entered after it on the stack, as the forward ran."""
        with contextlib.ExitStack() as modes:
            for mode in (self, *(mode for mode in self.later if isinstance(mode, TorchFunctionMode))):
                modes.enter_context(mode)
            return body(*args, **kwargs)


def _ignore(what: str, why: str) -> None:
    pass


@contextlib.contextmanager
def device_kernels(
    target: torch.device, modules: Iterable[nn.Module], note: Note = _ignore, later: Iterable[object] = ()
) -> Iterator[None]:
    """Make a meta run take the attention and dropout kernels and the fast paths ``target`` takes, in the block.

    ``later`` are the contexts the run enters inside this one: those that are function modes stay
    on, with this one, while backward runs.
    """
    # On a device other than the CPU or CUDA the math path runs and is noted. Subclasses of the
    # fast-path modules that define their own forward keep it.
    if target.type == "meta":
        yield
        return
    card = _card(target) if target.type == "cuda" else (ASSUMED_CAPABILITY, None)
    fused = target.type in ("cpu", "cuda")
    followed = [module for module in modules if fused and _follow_fast_path(module, target, card)]
    try:
        with _Kernels(target, card, note, list(later)):
            yield
    finally:
        for module in followed:
            vars(module).pop("forward", None)
