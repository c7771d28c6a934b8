"""The estimator's hand-written tables, derived again from the installed PyTorch where the CPU can.

Each table in ``koila_retry/_estimation`` restates a rule of PyTorch's (``versions.RULE_SETS``
lists them with the torch versions they were checked on). The tests below ask the installed
PyTorch itself and fail when a table and PyTorch disagree, so that a torch upgrade fails here
instead of mis-estimating in silence:

- autocast's lists (``autocast.POLICIES``, ``autocast.OVERLOADS_LEFT_ALONE``). Which operators,
  and which of their overloads, each list holds comes from the dispatcher: those with a kernel
  behind ``AutocastCPU`` or ``AutocastCUDA``, both of which a CPU-only build registers (all but
  ``_cudnn_rnn``'s, which only builds with cuDNN register: that one is not derived). How each
  is cast comes from calling it under autocast and recording, below the autocast key, the
  casts of its own arguments beyond those the same call makes without autocast: on real CPU
  tensors in bfloat16 and float16, and for CUDA's list on fake CUDA tensors
  (``FakeTensorMode``, no autograd), whose dispatch keys reach the CUDA autocast kernels of
  this build without a GPU. Common operators on neither list, and some on the other device's
  list only, must keep their inputs' types.
- the CPU's choice of attention kernel (``attention.choose_backend``) against PyTorch's own
  selector, ``torch._fused_sdp_choice``: one condition at a time, then up to three at once.
- the inference fast path of ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer``:
  whether an estimate follows the layer's and the attention's fused paths, against whether a
  real CPU run calls their fused operators.
- when a CPU convolution runs through oneDNN (``workspace._uses_onednn``) against PyTorch's
  own ``torch._C._select_conv_backend``. On a CPU with native 16-bit floats (AVX-512 BF16,
  AMX) oneDNN also runs bfloat16 and float16 convolutions, which the workspace rule does not
  cover: those cases are skipped there, with the reason.

Not derived here, for want of a GPU: CUDA's attention gates and their order, the recurrent
kernels' rules (oneDNN's LSTM workspace was measured, cuDNN's reserve is a model) and the
CUDA caching allocator's rounding. Their versions come from runs on the device alone.
"""

from __future__ import annotations

import contextlib
import itertools
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import pytest
import torch
from _dispatch import Operators, cuda_autocast
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import koila_retry as koila
from koila_retry._estimation import attention, workspace
from koila_retry._estimation.attention import FLASH, MATH, Attention, choose_backend
from koila_retry._estimation.autocast import OVERLOADS_LEFT_ALONE, POLICIES, autocast_like

F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64

# ============================================================================ autocast's lists

LOWER, FP32, FP32_DTYPE, PROMOTE, BANNED = "lower", "fp32", "fp32 dtype", "promote", "banned"
_AUTOCAST_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}
# Registered behind AutocastCUDA only where PyTorch is built with cuDNN (aten/src/ATen/cudnn/AutocastRNN.cpp).
_CUDNN_ONLY = set() if torch.backends.cudnn.is_available() else {"_cudnn_rnn"}  # type: ignore[no-untyped-call]


class Maker:
    """Make one call's tensors: the floating ones in a scheme's types, on the CPU (random) or as fake CUDA tensors.

    Schemes: ``"f32"`` (all float32), ``"lower"`` (all in the lower precision) and
    ``"mixed"`` (the first in the lower precision, the others float32).
    """

    def __init__(self, device: str, scheme: str, lower: torch.dtype) -> None:
        self.device, self.scheme, self.lower = device, scheme, lower
        self.made = 0

    def _dtype(self) -> torch.dtype:
        self.made += 1
        if self.scheme == "f32" or (self.scheme == "mixed" and self.made > 1):
            return F32
        return self.lower

    def f(self, *shape: int) -> torch.Tensor:
        """Return a floating tensor with values in [0.25, 0.75] (fake CUDA tensors cannot be random)."""
        if self.device == "cpu":
            return (torch.rand(shape) * 0.5 + 0.25).to(self._dtype())
        return torch.full(shape, 0.5, dtype=self._dtype(), device=self.device)

    def like(self, tensor: torch.Tensor) -> torch.Tensor:
        """Return ``tensor``, made in float32 on the CPU, in the scheme's next type and on the device."""
        return tensor.to(self.device, self._dtype())

    def spd(self, n: int) -> torch.Tensor:
        """Return a well-conditioned symmetric positive definite matrix, for the factorisations."""
        a = torch.rand(n, n) if self.device == "cpu" else torch.full((n, n), 0.5)
        return self.like(a @ a.mT + n * torch.eye(n))

    def i(self, *shape: int, value: int = 0) -> torch.Tensor:
        """Return an integer tensor (class indices, lengths, positions) filled with ``value``."""
        return torch.full(shape, value, dtype=torch.long, device=self.device)


Args = tuple[tuple[Any, ...], dict[str, Any]]


def _a(*args: Any, **kwargs: Any) -> Args:
    return args, kwargs


def _one(m: Maker) -> Args:
    return _a(m.f(4))


def _two(m: Maker) -> Args:
    return _a(m.f(4), m.f(4))


def _three(m: Maker) -> Args:
    return _a(m.f(4), m.f(4), m.f(4))


def _wide(m: Maker) -> Args:
    return _a(m.f(3, 4))


def _tall(m: Maker) -> Args:
    return _a(m.f(4, 3))


def _spd(m: Maker) -> Args:
    return _a(m.spd(3))


def _signal(m: Maker) -> Args:
    return _a(m.f(8))


def _image(m: Maker) -> Args:
    return _a(m.f(4, 8))


def _grid_2d(m: Maker) -> Args:
    return _a(m.f(1, 2, 4, 4), m.f(1, 3, 3, 2), 0, 0, False)


def _quantiles(m: Maker) -> Args:
    return _a(m.f(8), m.f(2))


def _classes(m: Maker) -> Args:
    return _a(m.f(2, 3), m.i(2))


def _resize(dims: int, *flags: Any) -> Callable[[Maker], Args]:
    return lambda m: _a(m.f(1, 2, *[4] * dims), [8] * dims, *flags)


def _conv(m: Maker) -> tuple[Any, ...]:
    return (m.f(1, 2, 8, 8), m.f(3, 2, 3, 3), None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)


def _lu_factors(m: Maker) -> tuple[torch.Tensor, torch.Tensor]:
    lu, pivots = torch.linalg.lu_factor(torch.rand(3, 3) + 3 * torch.eye(3))
    return m.like(lu), pivots.to(m.device)


def _cell(gates: int) -> Callable[[Maker], Args]:
    return lambda m: _a(m.f(2, 4), m.f(2, 4), m.f(gates * 4, 4), m.f(gates * 4, 4), m.f(gates * 4), m.f(gates * 4))


def _mha(m: Maker) -> Args:
    x = m.f(1, 4, 8)
    return _a(x, x, x, 8, 2, m.f(24, 8), m.f(24), m.f(8, 8), m.f(8))


def _mkldnn_lstm(m: Maker) -> Args:
    weights_and_states = (m.f(16, 4), m.f(16, 4), m.f(16), m.f(16), m.f(2, 4), m.f(2, 4))
    return _a(m.f(3, 2, 4), *weights_and_states, False, [], 2, 4, 1, True, False, False, False)


def _each(names: str, build: Callable[[Maker], Args]) -> dict[str, Callable[[Maker], Args]]:
    return dict.fromkeys(names.split(), build)


# A call of each ATen operator on either list (and of the common ones on neither), as tiny tensors.
BUILDERS: dict[str, Callable[[Maker], Args]] = {
    # products, convolutions, attention, recurrent cells
    "mm": lambda m: _a(m.f(4, 4), m.f(4, 4)),
    "bmm": lambda m: _a(m.f(2, 4, 4), m.f(2, 4, 4)),
    "baddbmm": lambda m: _a(m.f(2, 4, 4), m.f(2, 4, 4), m.f(2, 4, 4)),
    "addbmm": lambda m: _a(m.f(4, 4), m.f(2, 4, 4), m.f(2, 4, 4)),
    "addmm": lambda m: _a(m.f(4, 4), m.f(4, 4), m.f(4, 4)),
    "_addmm_activation": lambda m: _a(m.f(4, 4), m.f(4, 4), m.f(4, 4)),
    "addmv": lambda m: _a(m.f(4), m.f(4, 4), m.f(4)),
    "addr": lambda m: _a(m.f(4, 4), m.f(4), m.f(4)),
    "matmul": lambda m: _a(m.f(4, 4), m.f(4, 4)),
    "mv": lambda m: _a(m.f(4, 4), m.f(4)),
    "dot": _two,
    "vdot": _two,
    "linalg_vecdot": lambda m: _a(m.f(2, 4), m.f(2, 4)),
    "linear": lambda m: _a(m.f(2, 4), m.f(3, 4), m.f(3)),
    "chain_matmul": lambda m: _a([m.f(2, 3), m.f(3, 4), m.f(4, 2)]),
    "linalg_multi_dot": lambda m: _a([m.f(2, 3), m.f(3, 4), m.f(4, 2)]),
    "einsum": lambda m: _a("ij,jk->ik", [m.f(2, 3), m.f(3, 4)]),
    "tensordot": lambda m: _a(m.f(2, 3), m.f(3, 2), [1], [0]),
    "bilinear": lambda m: _a(m.f(2, 3), m.f(2, 4), m.f(5, 3, 4), m.f(5)),
    "prelu": lambda m: _a(m.f(2, 3, 4), m.f(3)),
    "conv1d": lambda m: _a(m.f(1, 2, 8), m.f(3, 2, 3)),
    "conv2d": lambda m: _a(m.f(1, 2, 8, 8), m.f(3, 2, 3, 3)),
    "conv3d": lambda m: _a(m.f(1, 2, 4, 4, 4), m.f(3, 2, 3, 3, 3)),
    "conv_transpose1d": lambda m: _a(m.f(1, 2, 8), m.f(2, 3, 3)),
    "conv_transpose2d": lambda m: _a(m.f(1, 2, 8, 8), m.f(2, 3, 3, 3)),
    "conv_transpose3d": lambda m: _a(m.f(1, 2, 4, 4, 4), m.f(2, 3, 3, 3, 3)),
    "conv_tbc": lambda m: _a(m.f(8, 1, 2), m.f(3, 2, 3), m.f(3)),
    "convolution": lambda m: _a(*_conv(m)),
    # The CPU lists _convolution's deprecated overload (these arguments), CUDA both.
    "_convolution": lambda m: _a(*_conv(m), False, False, True),
    "cudnn_convolution": lambda m: _a(m.f(1, 2, 8, 8), m.f(3, 2, 3, 3), [0, 0], [1, 1], [1, 1], 1, False, False, True),
    "cudnn_convolution_transpose": lambda m: _a(
        m.f(1, 2, 8, 8), m.f(2, 3, 3, 3), [0, 0], [0, 0], [1, 1], [1, 1], 1, False, False, True
    ),
    "scaled_dot_product_attention": lambda m: _a(m.f(1, 2, 4, 8), m.f(1, 2, 4, 8), m.f(1, 2, 4, 8)),
    "_scaled_dot_product_flash_attention": lambda m: _a(m.f(1, 2, 4, 8), m.f(1, 2, 4, 8), m.f(1, 2, 4, 8)),
    "_native_multi_head_attention": _mha,
    "mkldnn_rnn_layer": _mkldnn_lstm,
    "_thnn_fused_lstm_cell": lambda m: _a(m.f(2, 16), m.f(2, 16), m.f(2, 4), m.f(16), m.f(16)),
    "_thnn_fused_gru_cell": lambda m: _a(m.f(2, 12), m.f(2, 12), m.f(2, 4), m.f(12), m.f(12)),
    "lstm_cell": lambda m: _a(m.f(2, 4), [m.f(2, 4), m.f(2, 4)], m.f(16, 4), m.f(16, 4), m.f(16), m.f(16)),
    "gru_cell": _cell(3),
    "rnn_tanh_cell": _cell(1),
    "rnn_relu_cell": _cell(1),
    # pointwise, normalisation, reductions
    **_each(
        "acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan softplus prod sum norm "
        "linalg_vector_norm relu gelu sigmoid tanh sin cos sqrt abs neg mean var silu",
        _one,
    ),
    **_each("pow atan2 dist maximum add mul div sub", _two),
    **_each("addcdiv addcmul", _three),
    "where": lambda m: _a(torch.zeros(4, dtype=torch.bool, device=m.device), m.f(4), m.f(4)),
    "cross": lambda m: _a(m.f(2, 3), m.f(2, 3)),
    "layer_norm": lambda m: _a(m.f(2, 4), [4], m.f(4), m.f(4)),
    "native_layer_norm": lambda m: _a(m.f(2, 4), [4], m.f(4), m.f(4), 1e-5),
    "rms_norm": lambda m: _a(m.f(2, 4), [4], m.f(4)),
    "group_norm": lambda m: _a(m.f(2, 4, 3), 2, m.f(4), m.f(4)),
    "batch_norm": lambda m: _a(m.f(2, 4, 3), m.f(4), m.f(4), m.f(4), m.f(4), False, 0.1, 1e-5, True),
    "frobenius_norm": lambda m: _a(m.f(3, 3), [0, 1]),
    "nuclear_norm": lambda m: _a(m.f(3, 3)),
    "linalg_matrix_norm": lambda m: _a(m.f(3, 3), 1),
    "cosine_similarity": lambda m: _a(m.f(2, 4), m.f(2, 4)),
    "pdist": _wide,
    "cdist": lambda m: _a(m.f(3, 4), m.f(5, 4)),
    "renorm": lambda m: _a(m.f(3, 4), 2, 0, 1.0),
    "logsumexp": lambda m: _a(m.f(3, 4), [1]),
    "amax": lambda m: _a(m.f(3, 4), [1]),
    "softmax": lambda m: _a(m.f(2, 4), 1),
    "log_softmax": lambda m: _a(m.f(2, 4), 1),
    "cumprod": lambda m: _a(m.f(4), 0),
    "cumsum": lambda m: _a(m.f(4), 0),
    "clamp": lambda m: _a(m.f(4), 0.3, 0.6),
    "trace": lambda m: _a(m.f(4, 4)),
    "quantile": _quantiles,
    "nanquantile": _quantiles,
    "polar": _two,
    "view_as_complex": lambda m: _a(m.f(4, 2)),
    "fake_quantize_per_tensor_affine": lambda m: _a(m.f(4), 0.1, 0, 0, 255),
    # joining, indexing, embedding
    "cat": lambda m: _a([m.f(2), m.f(2)]),
    "stack": lambda m: _a([m.f(2), m.f(2)]),
    "index_copy": lambda m: _a(m.f(4, 2), 0, m.i(2), m.f(2, 2)),
    "index_put": lambda m: _a(m.f(4), [m.i(2)], m.f(2)),
    "scatter_add": lambda m: _a(m.f(4), 0, m.i(2), m.f(2)),
    "embedding": lambda m: _a(m.f(5, 3), m.i(2)),
    # sampling, pooling, padding, resizing
    "grid_sampler": _grid_2d,
    "grid_sampler_2d": _grid_2d,
    "_grid_sampler_2d_cpu_fallback": _grid_2d,
    "grid_sampler_3d": lambda m: _a(m.f(1, 2, 4, 4, 4), m.f(1, 3, 3, 3, 3), 0, 0, False),
    **_each("avg_pool3d max_pool3d adaptive_avg_pool3d", lambda m: _a(m.f(1, 2, 4, 4, 4), [2, 2, 2])),
    **_each("avg_pool2d max_pool2d adaptive_avg_pool2d", lambda m: _a(m.f(1, 2, 4, 4), [2, 2])),
    "adaptive_max_pool3d": lambda m: _a(m.f(1, 2, 4, 4, 4), [2, 2, 2]),
    "max_unpool2d": lambda m: _a(m.f(1, 2, 2, 2), m.i(1, 2, 2, 2), [4, 4]),
    "max_unpool3d": lambda m: _a(m.f(1, 2, 2, 2, 2), m.i(1, 2, 2, 2, 2), [4, 4, 4], [2, 2, 2], [0, 0, 0]),
    "fractional_max_pool2d": lambda m: _a(m.f(1, 2, 5, 5), [2, 2], [2, 2], m.f(1, 2, 2)),
    "fractional_max_pool3d": lambda m: _a(m.f(1, 2, 5, 5, 5), [2, 2, 2], [2, 2, 2], m.f(1, 2, 3)),
    **_each("reflection_pad1d replication_pad1d", lambda m: _a(m.f(1, 2, 4), [1, 1])),
    **_each("reflection_pad2d replication_pad2d", lambda m: _a(m.f(1, 2, 4, 4), [1] * 4)),
    "replication_pad3d": lambda m: _a(m.f(1, 2, 4, 4, 4), [1] * 6),
    **_each("upsample_nearest1d _upsample_nearest_exact1d", _resize(1)),
    **_each("upsample_nearest2d _upsample_nearest_exact2d", _resize(2)),
    **_each("upsample_nearest3d _upsample_nearest_exact3d", _resize(3)),
    "upsample_linear1d": _resize(1, False),
    **_each("upsample_bilinear2d _upsample_bilinear2d_aa upsample_bicubic2d _upsample_bicubic2d_aa", _resize(2, False)),
    "upsample_trilinear3d": _resize(3, False),
    # losses
    **_each(
        "binary_cross_entropy binary_cross_entropy_with_logits mse_loss smooth_l1_loss l1_loss huber_loss "
        "soft_margin_loss kl_div hinge_embedding_loss",
        _two,
    ),
    "poisson_nll_loss": lambda m: _a(m.f(4), m.f(4), True, False, 1e-8, 1),
    "cosine_embedding_loss": lambda m: _a(m.f(2, 4), m.f(2, 4), m.i(2, value=1)),
    "margin_ranking_loss": _three,
    "triplet_margin_loss": lambda m: _a(m.f(2, 4), m.f(2, 4), m.f(2, 4)),
    **_each("nll_loss cross_entropy_loss multi_margin_loss", _classes),
    "nll_loss2d": lambda m: _a(m.f(1, 3, 2, 2), m.i(1, 2, 2)),
    "multilabel_margin_loss": lambda m: _a(m.f(2, 3), m.i(2, 3)),
    "multilabel_margin_loss_forward": lambda m: _a(m.f(2, 3), m.i(2, 3), 1),
    "ctc_loss": lambda m: _a(m.f(6, 1, 4), m.i(1, 2, value=1), [6], [2]),
    # spectral
    **_each("fft_fft fft_ifft fft_rfft fft_irfft fft_hfft fft_ihfft", _signal),
    **_each("fft_fft2 fft_ifft2 fft_fftn fft_ifftn fft_rfft2 fft_irfft2 fft_rfftn fft_irfftn", _image),
    "stft": lambda m: _a(m.f(64), 16, window=m.like(torch.ones(16)), return_complex=True),
    # linear algebra
    **_each(
        "cholesky cholesky_inverse inverse linalg_cholesky linalg_cholesky_ex linalg_inv linalg_inv_ex linalg_cond "
        "linalg_eig linalg_eigvals linalg_eigh linalg_eigvalsh _lu_with_info",
        _spd,
    ),
    **_each("pinverse svd linalg_svd linalg_svdvals", _wide),
    **_each("geqrf qr linalg_qr", _tall),
    "linalg_matrix_rank": lambda m: _a(m.spd(3), 0.1),
    **_each("cholesky_solve triangular_solve", lambda m: _a(m.f(3, 2), m.spd(3))),
    "linalg_solve": lambda m: _a(m.spd(3), m.f(3, 2)),
    "lu_solve": lambda m: _a(m.f(3, 2), *_lu_factors(m)),
    "linalg_lstsq": lambda m: _a(m.f(4, 3), m.f(4, 2)),
    **_each("orgqr linalg_householder_product", lambda m: _a(m.f(4, 3), m.f(3))),
    "ormqr": lambda m: _a(m.f(4, 3), m.f(3), m.f(4, 2)),
    "linalg_tensorinv": lambda m: _a(m.like(torch.eye(4).reshape(4, 2, 2) * 2), 1),
    "linalg_tensorsolve": lambda m: _a(m.like(torch.eye(4).reshape(2, 2, 2, 2) * 2), m.f(2, 2)),
}
# The operators whose call above takes a ``dtype``, which the "fp32 dtype" policy fills in.
TAKES_DTYPE = {"prod", "sum", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm", "linalg_matrix_norm"}
# Common operators on neither list, and some on the other device's list only: each keeps its inputs' types.
_COMMON = "add mul div sub relu gelu silu sigmoid tanh sin cos sqrt abs neg mean var maximum amax clamp where"
_COMMON += " batch_norm embedding avg_pool2d max_pool2d adaptive_avg_pool2d"
UNLISTED = {
    "cpu": f"{_COMMON} layer_norm group_norm rms_norm softmax log_softmax exp log sum cumsum logsumexp pow "
    "upsample_bilinear2d addcmul",
    "cuda": f"{_COMMON} cat stack avg_pool3d max_pool3d trace",
}


class _Casts(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Record, below autocast, the casts of a call's own arguments, and whether the call reached its kernels."""

    def __init__(self, inputs: list[torch.Tensor]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.inputs = inputs
        self.casts: list[tuple[torch.dtype, torch.dtype]] = []
        self.reached = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and any(args[0] is tensor for tensor in self.inputs):
            self.casts.append((args[0].dtype, kwargs.get("dtype", args[0].dtype)))
        else:
            self.reached = True
        return func(*args, **kwargs)


@contextlib.contextmanager
def _autocast(device: str, lower: torch.dtype) -> Iterator[None]:
    if device == "cpu":
        with torch.autocast("cpu", dtype=lower):
            yield
        return
    with cuda_autocast(lower):  # torch.autocast("cuda") switches itself off without CUDA
        yield


class _Observed(NamedTuple):
    casts: Counter[tuple[torch.dtype, torch.dtype]]
    result: torch.dtype | None


def _floating_result(out: Any) -> torch.dtype | None:
    leaves, _ = tree_flatten(out)
    found = [leaf.dtype for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.dtype.is_floating_point]
    found += [leaf.dtype for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.dtype.is_complex]
    return found[0] if found else None


def _observe(op: str, device: str, scheme: str, lower: torch.dtype, autocast: bool, **extra: Any) -> _Observed:
    """Call ``op`` on tensors of ``scheme``, with autocast or without; return its arguments' casts and result type.

    Autocast casts before the operator's kernels run, so a call that fails in them (oneDNN's LSTM in
    bfloat16 without AVX-512, cuDNN's kernels on fake CUDA tensors, a kernel without bfloat16) still
    shows autocast's casts; one that fails before reaching them (a call that matches no schema) raises.
    """
    args, kwargs = BUILDERS[op](Maker(device, scheme, lower))
    kwargs = {**kwargs, **extra}
    recorder = _Casts([leaf for leaf in tree_flatten((args, kwargs))[0] if isinstance(leaf, torch.Tensor)])
    with torch.no_grad(), contextlib.ExitStack() as stack:
        if autocast:
            stack.enter_context(_autocast(device, lower))
        stack.enter_context(recorder)
        try:
            out = getattr(torch.ops.aten, op)(*args, **kwargs)
        except Exception:
            # A plain call is only a reference (many kernels take no bfloat16): its failure is no news.
            if autocast and not recorder.reached:
                raise
            return _Observed(Counter(recorder.casts), None)
    return _Observed(Counter(recorder.casts), _floating_result(out))


def _by_autocast(op: str, device: str, scheme: str, lower: torch.dtype, **extra: Any) -> _Observed:
    """Return what autocast adds to a plain call: the casts beyond the plain call's, and the result's type."""
    cast = _observe(op, device, scheme, lower, True, **extra)
    plain = _observe(op, device, scheme, lower, False, **extra)
    return _Observed(cast.casts - plain.casts, cast.result if cast.result != plain.result else None)


def derive_policy(op: str, device: str, lower: torch.dtype) -> str | None:
    """Return how autocast on ``device`` casts ``op``'s arguments, as calls of it show; None if it does not."""
    try:
        high = _by_autocast(op, device, "f32", lower)
    except RuntimeError as error:
        if "unsafe to autocast" in str(error):
            return BANNED
        raise
    if (F32, lower) in high.casts or high.result == lower:
        return LOWER
    low = _by_autocast(op, device, "lower", lower)
    if (lower, F32) in low.casts or low.result in (F32, torch.complex64):
        # "fp32 dtype" passes dtype=float32 unless one is given; "fp32" casts the arguments anyway.
        if op in TAKES_DTYPE and (lower, F32) not in _by_autocast(op, device, "lower", lower, dtype=lower).casts:
            return FP32_DTYPE
        return FP32
    if (lower, F32) in _by_autocast(op, device, "mixed", lower).casts:
        return PROMOTE
    return None


def _derive(op: str, device: str, lower: torch.dtype) -> str | None:
    if device == "cpu":
        return derive_policy(op, "cpu", lower)
    with FakeTensorMode():
        return derive_policy(op, "cuda", lower)


def _registered(key: str) -> set[str]:
    """Return the ATen operators (without overload) that have a kernel behind the dispatch key ``key``."""
    names = torch._C._dispatch_get_all_op_names()
    found = {name for name in names if torch._C._dispatch_has_kernel_for_dispatch_key(name, key)}
    return {name.split("::", 1)[1].split(".")[0] for name in found if name.startswith("aten::")}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_each_autocast_list_holds_the_operators_pytorch_casts(device: str) -> None:
    registered = _registered(_AUTOCAST_KEYS[device])
    listed = set(POLICIES[device]) - (_CUDNN_ONLY if device == "cuda" else set())
    assert registered - listed == set(), f"PyTorch casts these on {device}, the table does not list them"
    assert listed - registered == set(), f"the table lists these on {device}, PyTorch does not cast them"


# Overloads that PyTorch has no autocast kernel for while the estimate's kernels cast them: each is one
# that TorchScript alone knows (never dispatched) or a composite that casts inside, where it calls a
# listed overload (the resizes' output-size-or-scales variants, convolutions with string padding).
_RESIZES = "upsample_nearest1d upsample_nearest2d upsample_nearest3d upsample_linear1d upsample_bilinear2d"
_RESIZES += " upsample_bicubic2d upsample_trilinear3d _upsample_bilinear2d_aa _upsample_bicubic2d_aa"
_RESIZES += " _upsample_nearest_exact1d _upsample_nearest_exact2d _upsample_nearest_exact3d"
_CAST_INSIDE = {
    "cpu": set(),
    "cuda": {"conv1d.padding", "conv2d.padding", "conv3d.padding", "einsum.sublist", "index_put.hacked_twin"}
    | {f"{name}.vec" for name in _RESIZES.split()},
}


_REAL_KEYS = ("CPU", "CUDA", "Meta", "CompositeExplicitAutograd", "CompositeImplicitAutograd")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_estimate_casts_the_overloads_pytorch_casts(device: str) -> None:
    key, names = _AUTOCAST_KEYS[device], set(torch._C._dispatch_get_all_op_names())
    ours, theirs = set(), set()
    for name in set(POLICIES[device]) - _CUDNN_ONLY:
        packet = getattr(torch.ops.aten, name)
        for overload in packet.overloads():
            schema = getattr(packet, overload)._schema
            qualified = name if overload == "default" else f"{name}.{overload}"
            dispatched = f"aten::{qualified}" in names
            if dispatched and torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{qualified}", key):
                theirs.add(qualified)
            if schema.is_mutable or not any("Tensor" in str(argument.type) for argument in schema.arguments):
                continue  # the estimate registers no kernel for it
            if qualified not in OVERLOADS_LEFT_ALONE[device]:
                ours.add(qualified)
    assert theirs - ours == set()
    assert ours - theirs == _CAST_INSIDE[device]
    for qualified in _CAST_INSIDE[device]:
        # Never run by PyTorch's own kernels (known to TorchScript alone: the estimate's autocast
        # kernels register it with the dispatcher, and nothing else does), or a composite.
        name = f"aten::{qualified}"
        kernels = {
            key for key in _REAL_KEYS if name in names and torch._C._dispatch_has_kernel_for_dispatch_key(name, key)
        }
        assert kernels <= {"CompositeImplicitAutograd"}, f"{qualified} runs kernels of its own: {kernels}"


def test_the_estimate_leaves_alone_the_overloads_autocast_leaves_alone() -> None:
    args = _conv(Maker("cpu", "f32", BF16))
    meta = [arg.to("meta") if isinstance(arg, torch.Tensor) else arg for arg in args]
    found = {}
    for overload, flags in (("default", (False, False, True, True)), ("deprecated", (False, False, True))):
        op = getattr(torch.ops.aten._convolution, overload)
        with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
            real = op(*args, *flags).dtype
            with autocast_like(torch.device("cpu"), lambda what, why: None):
                found[overload] = (real, op(*meta, *flags).dtype)
    assert found == {"default": (F32, F32), "deprecated": (BF16, BF16)}


def _policy_cases(device: str, dtypes: tuple[torch.dtype, ...]) -> list[Any]:
    cases = []
    for op, dtype in itertools.product(sorted(POLICIES[device]), dtypes):
        name = f"{op}-{str(dtype).removeprefix('torch.')}"
        if device == "cuda" and op in _CUDNN_ONLY:
            reason = "registered only in builds with cuDNN"
            cases.append(pytest.param(op, dtype, id=f"{name}-skipped:{reason}", marks=pytest.mark.skip(reason=reason)))
        else:
            cases.append(pytest.param(op, dtype, id=name))
    return cases


@pytest.mark.parametrize(("op", "lower"), _policy_cases("cpu", (BF16, F16)))
def test_the_cpu_list_casts_as_autocast_on_the_cpu_does(op: str, lower: torch.dtype) -> None:
    assert derive_policy(op, "cpu", lower) == POLICIES["cpu"][op]


@pytest.mark.parametrize(("op", "lower"), _policy_cases("cuda", (F16, BF16)))
def test_the_cuda_list_casts_as_autocast_on_fake_cuda_tensors_does(op: str, lower: torch.dtype) -> None:
    assert _derive(op, "cuda", lower) == POLICIES["cuda"][op]


@pytest.mark.parametrize(("device", "op"), [(device, op) for device, names in UNLISTED.items() for op in names.split()])
def test_an_operator_off_a_list_keeps_its_types(device: str, op: str) -> None:
    assert op not in POLICIES[device]
    assert _derive(op, device, BF16) is None


# ============================================================================ the CPU's attention kernel

_CHOSEN = {SDPBackend.FLASH_ATTENTION.value: FLASH, SDPBackend.MATH.value: MATH}


class Sdpa(NamedTuple):
    """One call of scaled_dot_product_attention, described; ``call()`` makes it on the CPU."""

    dtype: torch.dtype = F32
    batch: int = 2
    heads: int = 4
    kv_heads: int = 4
    queries: int = 3
    keys: int = 5
    head: int = 8
    value_head: int = 8
    dims: int = 4
    layouts: tuple[str, str, str] = ("contiguous", "contiguous", "contiguous")
    key_dtype: torch.dtype | None = None
    mask: str = "none"
    mask_dtype: torch.dtype | None = torch.bool
    dropout: float = 0.0
    causal: bool = False
    gqa: bool = False
    grad: bool = False

    def _tensor(self, shape: tuple[int, ...], dtype: torch.dtype, layout: str) -> torch.Tensor:
        if layout == "transposed":  # (batch, length, heads, head) seen as (batch, heads, length, head)
            made = torch.zeros(*shape[:-3], shape[-2], shape[-3], shape[-1], dtype=dtype).transpose(-2, -3)
        elif layout == "strided":  # every other element of the last dimension
            made = torch.zeros(*shape[:-1], 2 * shape[-1], dtype=dtype)[..., ::2]
        else:
            made = torch.zeros(shape, dtype=dtype)
        return made.requires_grad_(self.grad and dtype.is_floating_point)

    def call(self) -> Attention:
        lead = (self.batch,) if self.dims == 3 else (self.batch, self.heads)
        kv_lead = (self.batch,) if self.dims == 3 else (self.batch, self.kv_heads)
        shapes = [(*lead, self.queries, self.head), (*kv_lead, self.keys, self.head)]
        shapes.append((*kv_lead, self.keys, self.value_head))
        dtypes = [self.dtype, self.key_dtype or self.dtype, self.dtype]
        q, k, v = (self._tensor(s, d, lay) for s, d, lay in zip(shapes, dtypes, self.layouts))
        return Attention(q, k, v, self._mask(), self.dropout, self.causal, self.gqa)

    def _mask(self) -> torch.Tensor | None:
        b, h, lq, lk = self.batch, self.heads, self.queries, self.keys
        shapes: dict[str, tuple[int, ...]] = {
            "2d": (lq, lk),
            "broadcast-4d": (1, 1, lq, lk),
            "per-batch": (b, 1, lq, lk),
            "per-head": (1, h, lq, lk),
            "full": (b, h, lq, lk),
            "3d": (b, lq, lk),
            "one-query-row": (1, 1, 1, lk),
            "one-key-column": (lq, 1),
            "wrong-size": (lq + 1, lk),
            "strided": (lq, lk),
            "needs-grad": (lq, lk),
        }
        if self.mask == "none":
            return None
        dtype = self.mask_dtype or self.dtype
        shape = shapes[self.mask]
        if self.mask == "strided":
            return torch.zeros(*shape[:-1], 2 * shape[-1], dtype=dtype)[..., ::2]
        return torch.zeros(shape, dtype=dtype, requires_grad=self.mask == "needs-grad" and dtype.is_floating_point)


def _pytorchs_choice(call: Attention) -> str:
    q, k, v = call.tensors
    chosen = torch._fused_sdp_choice(q, k, v, call.mask, call.dropout, call.causal, scale=None, enable_gqa=call.gqa)
    return _CHOSEN[chosen]


# From a call the CPU's flash kernel takes, each condition changed on its own.
_ONE_CHANGE: dict[str, dict[str, Any]] = {
    "flash": {},
    **{f"dtype-{str(d)[6:]}": {"dtype": d} for d in (F64, BF16, F16)},
    "key-of-another-dtype": {"key_dtype": F64},
    **{f"head-{n}": {"head": n, "value_head": n} for n in (1, 3, 64, 256, 512)},
    "value-head-differs": {"value_head": 4},
    "one-query": {"queries": 1},
    "no-queries": {"queries": 0},
    "no-keys": {"keys": 0},
    "one-batch-one-head": {"batch": 1, "heads": 1, "kv_heads": 1},
    "three-dimensional": {"dims": 3},
    **{f"query-{layout}": {"layouts": (layout, "contiguous", "contiguous")} for layout in ("transposed", "strided")},
    **{f"key-{layout}": {"layouts": ("contiguous", layout, "contiguous")} for layout in ("transposed", "strided")},
    **{f"value-{layout}": {"layouts": ("contiguous", "contiguous", layout)} for layout in ("transposed", "strided")},
    **{
        f"mask-{kind}": {"mask": kind}
        for kind in ("2d", "broadcast-4d", "per-batch", "per-head", "full", "3d", "one-query-row", "one-key-column")
    },
    "mask-wrong-size": {"mask": "wrong-size"},
    "mask-strided": {"mask": "strided"},
    "mask-float": {"mask": "2d", "mask_dtype": None},
    "mask-float-needs-grad": {"mask": "needs-grad", "mask_dtype": None},
    "dropout": {"dropout": 0.1},
    "causal": {"causal": True},
    "causal-and-mask": {"causal": True, "mask": "2d"},
    "requires-grad": {"grad": True},
    "requires-grad-with-dropout": {"grad": True, "dropout": 0.1},
    "grouped-heads": {"kv_heads": 2, "gqa": True},
    "grouped-heads-one": {"kv_heads": 1, "gqa": True},
    "grouped-heads-without-the-flag": {"kv_heads": 2},
    "grouped-heads-uneven": {"heads": 3, "kv_heads": 2, "gqa": True},
}


@pytest.mark.parametrize("change", list(_ONE_CHANGE))
def test_the_cpu_chooses_the_attention_kernel_pytorch_chooses(change: str) -> None:
    call = Sdpa(**_ONE_CHANGE[change]).call()
    assert choose_backend("cpu", call) == _pytorchs_choice(call)


def test_the_cpu_follows_the_kernels_switched_off() -> None:
    call = Sdpa().call()
    with sdpa_kernel([SDPBackend.MATH]):
        assert choose_backend("cpu", call) == _pytorchs_choice(call) == MATH
    assert choose_backend("cpu", call) == _pytorchs_choice(call) == FLASH


@st.composite
def _calls(draw: st.DrawFn) -> Sdpa:
    """Draw a call the flash kernel could take, then up to three of the changes above at once."""
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    head = draw(st.sampled_from([4, 8, 16, 24]))
    base = Sdpa(
        dtype=draw(st.sampled_from([F32, F64, BF16, F16])),
        batch=draw(st.sampled_from([1, 2, 3])),
        heads=heads,
        kv_heads=heads,
        queries=draw(st.sampled_from([1, 2, 5])),
        keys=draw(st.sampled_from([1, 3, 8])),
        head=head,
        value_head=head,
        mask_dtype=draw(st.sampled_from([torch.bool, None])),
    )
    for change in draw(st.lists(st.sampled_from(list(_ONE_CHANGE)), max_size=3)):
        base = base._replace(**_ONE_CHANGE[change])
    return base


@pytest.mark.slow
@settings(max_examples=400)
@given(_calls())
def test_the_cpu_chooses_the_attention_kernel_pytorch_chooses_over_a_grid(described: Sdpa) -> None:
    call = described.call()
    assert choose_backend("cpu", call) == _pytorchs_choice(call), described


# ============================================================================ the transformer fast path

_FUSED_LAYER, _FUSED_ATTENTION = "aten::_transformer_encoder_layer_fwd", "aten::_native_multi_head_attention"


WIDTH, ROWS, LENGTH = 16, 3, 4
_PADDING = torch.tensor([[False, False, True, True]] * ROWS)
_CAUSAL = nn.Transformer.generate_square_subsequent_mask(LENGTH)
_ATTN_MASK = torch.tensor([[False, True, True, True], [False, False, True, True]] + [[False] * LENGTH] * 2)


def _layer(**options: Any) -> nn.TransformerEncoderLayer:
    torch.manual_seed(0)
    options = {"batch_first": True, "dropout": 0.0, **options}
    return nn.TransformerEncoderLayer(WIDTH, options.pop("heads", 2), 32, **options).eval()


def _mha_module(**options: Any) -> nn.MultiheadAttention:
    torch.manual_seed(0)
    options = {"batch_first": True, **options}
    return nn.MultiheadAttention(WIDTH, options.pop("heads", 2), **options).eval()


def _encoder(nested: bool, **options: Any) -> nn.TransformerEncoder:
    encoder = nn.TransformerEncoder(_layer(**options), 2, enable_nested_tensor=nested)
    return encoder.eval()


class _Subclass(nn.TransformerEncoderLayer):
    """A subclass that keeps the layer's forward."""


class _OwnForward(nn.TransformerEncoderLayer):
    """A subclass with a forward of its own, which calls the layer's."""

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        out: torch.Tensor = super().forward(*args, **kwargs)
        return out


def _hook(module: nn.Module, which: str = "module", pre: bool = False) -> nn.Module:
    target = module if which == "module" else module.get_submodule(which)
    if pre:
        target.register_forward_pre_hook(lambda *_: None)
    else:
        target.register_forward_hook(lambda *_: None)
    return module


def _modified(module: nn.Module, change: Callable[[Any], object]) -> nn.Module:
    change(module)
    return module


class FastCase(NamedTuple):
    """A module, how it is called, and the state around the call."""

    make: Callable[[], nn.Module]
    call: Callable[[Any, torch.Tensor, torch.Tensor], Any] = lambda m, x, p: m(x)  # p: a padding mask
    grad: str = "no_grad"  # or "enabled", "frozen" (enabled, parameters without gradients), "inference"
    autocast: bool = False
    fastpath: bool = True
    dtype: torch.dtype = F32


def _mha_call(**kwargs: Any) -> Callable[[Any, torch.Tensor, torch.Tensor], Any]:
    return lambda m, x, p: m(x, x, x, **kwargs)


FAST_CASES: dict[str, FastCase] = {
    # nn.TransformerEncoderLayer
    "layer": FastCase(_layer),
    "layer-train": FastCase(lambda: _layer().train()),
    "layer-grad": FastCase(_layer, grad="enabled"),
    "layer-frozen-grad": FastCase(_layer, grad="frozen"),
    "layer-inference-mode": FastCase(_layer, grad="inference"),
    "layer-sequence-first": FastCase(lambda: _layer(batch_first=False)),
    "layer-unbatched": FastCase(_layer, call=lambda m, x, p: m(x[0])),
    "layer-padding": FastCase(_layer, call=lambda m, x, p: m(x, src_key_padding_mask=p)),
    "layer-float-padding": FastCase(_layer, call=lambda m, x, p: m(x, src_key_padding_mask=p.float())),
    "layer-mask": FastCase(_layer, call=lambda m, x, p: m(x, src_mask=_ATTN_MASK)),
    "layer-both-masks": FastCase(_layer, call=lambda m, x, p: m(x, src_mask=_ATTN_MASK, src_key_padding_mask=p)),
    "layer-causal": FastCase(
        _layer,
        call=lambda m, x, p: m(x, src_mask=nn.Transformer.generate_square_subsequent_mask(LENGTH), is_causal=True),
    ),
    "layer-autocast": FastCase(_layer, autocast=True),
    "layer-fast-path-off": FastCase(_layer, fastpath=False),
    "layer-float64": FastCase(lambda: _layer().double(), dtype=F64),
    "layer-gelu": FastCase(lambda: _layer(activation="gelu")),
    "layer-gelu-function": FastCase(lambda: _layer(activation=F.gelu)),
    "layer-other-activation": FastCase(lambda: _layer(activation=F.silu)),
    "layer-norm-first": FastCase(lambda: _layer(norm_first=True)),
    "layer-no-bias": FastCase(lambda: _layer(bias=False)),
    "layer-odd-heads": FastCase(lambda: _layer(heads=1)),
    "layer-norms-differ": FastCase(lambda: _modified(_layer(), lambda m: setattr(m.norm2, "eps", 1e-6))),
    "layer-hooked": FastCase(lambda: _hook(_layer())),
    "layer-pre-hooked": FastCase(lambda: _hook(_layer(), pre=True)),
    "layer-submodule-hooked": FastCase(lambda: _hook(_layer(), "linear1")),
    "layer-subclass": FastCase(lambda: _Subclass(WIDTH, 2, 32, dropout=0.0, batch_first=True).eval()),
    # nn.TransformerEncoder, with and without its nested tensors
    "encoder": FastCase(lambda: _encoder(True)),
    "encoder-nested-padding": FastCase(lambda: _encoder(True), call=lambda m, x, p: m(x, src_key_padding_mask=p)),
    "encoder-padding": FastCase(lambda: _encoder(False), call=lambda m, x, p: m(x, src_key_padding_mask=p)),
    "encoder-nested-both-masks": FastCase(
        lambda: _encoder(True), call=lambda m, x, p: m(x, mask=_ATTN_MASK, src_key_padding_mask=p)
    ),
    "encoder-train": FastCase(lambda: _encoder(True).train(), call=lambda m, x, p: m(x, src_key_padding_mask=p)),
    # nn.MultiheadAttention
    "mha": FastCase(_mha_module, call=_mha_call()),
    "mha-no-weights": FastCase(_mha_module, call=_mha_call(need_weights=False)),
    "mha-weights-per-head": FastCase(_mha_module, call=_mha_call(average_attn_weights=False)),
    "mha-train": FastCase(lambda: _mha_module().train(), call=_mha_call()),
    "mha-grad": FastCase(_mha_module, call=_mha_call(), grad="enabled"),
    "mha-frozen-grad": FastCase(_mha_module, call=_mha_call(), grad="frozen"),
    "mha-inference-mode": FastCase(_mha_module, call=_mha_call(), grad="inference"),
    "mha-sequence-first": FastCase(lambda: _mha_module(batch_first=False), call=_mha_call()),
    "mha-padding": FastCase(_mha_module, call=lambda m, x, p: m(x, x, x, key_padding_mask=p)),
    "mha-float-padding": FastCase(_mha_module, call=lambda m, x, p: m(x, x, x, key_padding_mask=p.float())),
    "mha-mask": FastCase(_mha_module, call=_mha_call(attn_mask=_ATTN_MASK)),
    "mha-float-mask": FastCase(_mha_module, call=_mha_call(attn_mask=_ATTN_MASK.float())),
    "mha-both-masks": FastCase(_mha_module, call=lambda m, x, p: m(x, x, x, attn_mask=_ATTN_MASK, key_padding_mask=p)),
    "mha-cross": FastCase(_mha_module, call=lambda m, x, p: m(x, x + 0, x + 0)),
    "mha-key-is-value": FastCase(_mha_module, call=lambda m, x, p: m(x, x + 0, x)),
    "mha-kdim": FastCase(lambda: _mha_module(kdim=8, vdim=8), call=lambda m, x, p: m(x, x[..., :8], x[..., :8])),
    "mha-bias-kv": FastCase(lambda: _mha_module(add_bias_kv=True), call=_mha_call()),
    "mha-zero-attn": FastCase(lambda: _mha_module(add_zero_attn=True), call=_mha_call()),
    "mha-no-bias": FastCase(lambda: _mha_module(bias=False), call=_mha_call()),
    "mha-odd-heads": FastCase(lambda: _mha_module(heads=1), call=_mha_call()),
    "mha-autocast": FastCase(_mha_module, call=_mha_call(), autocast=True),
    "mha-fast-path-off": FastCase(_mha_module, call=_mha_call(), fastpath=False),
    "mha-float64": FastCase(lambda: _mha_module().double(), call=_mha_call(), dtype=F64),
    "mha-unbatched": FastCase(_mha_module, call=lambda m, x, p: m(x[0], x[0], x[0])),
    "mha-hooked": FastCase(lambda: _hook(_mha_module()), call=_mha_call()),
}


@contextlib.contextmanager
def _state(case: FastCase) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        if case.grad == "inference":
            stack.enter_context(torch.inference_mode())
        else:
            stack.enter_context(torch.set_grad_enabled(case.grad != "no_grad"))
        if case.autocast:
            stack.enter_context(torch.autocast("cpu", dtype=BF16))
        yield


def _fast_paths_taken(case: FastCase, monkeypatch: pytest.MonkeyPatch) -> tuple[tuple[bool, bool], tuple[bool, bool]]:
    """Return whether a real CPU run, and an estimate, take the layer's and the attention's fused paths.

    The attention's counts only outside a fused layer, which runs attention inside itself.
    """
    module = case.make()
    if case.grad == "frozen":
        module.requires_grad_(False)
    x = torch.randn(ROWS, LENGTH, WIDTH, dtype=case.dtype, generator=torch.Generator().manual_seed(0))

    def step(x: torch.Tensor, padding: torch.Tensor) -> Any:
        with _state(case):
            return case.call(module, x, padding)

    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(case.fastpath)
    try:
        return _both_runs(step, x, monkeypatch)
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)


def _both_runs(
    step: Callable[[torch.Tensor, torch.Tensor], Any], x: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> tuple[tuple[bool, bool], tuple[bool, bool]]:
    """Run ``step`` on the CPU and estimate it; return which fused paths each took."""
    with Operators() as operators:
        step(x, _PADDING)
    layer = _FUSED_LAYER in operators.seen
    real = (layer, _FUSED_ATTENTION in operators.seen and not layer)
    followed: dict[type[nn.Module], bool] = {}

    def spy(kind: type[nn.Module], fast: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            found = fast(*args, **kwargs)
            followed[kind] = followed.get(kind, False) or found is not None
            return found

        return run

    for kind, fast in list(attention._FAST_PATHS.items()):
        monkeypatch.setitem(attention._FAST_PATHS, kind, spy(kind, fast))
    koila.estimate(step, x, _PADDING)
    estimated = (followed.get(nn.TransformerEncoderLayer, False), followed.get(nn.MultiheadAttention, False))
    return real, estimated


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
@pytest.mark.parametrize("name", list(FAST_CASES))
def test_an_estimate_takes_the_fast_path_where_the_cpu_does(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    real, estimated = _fast_paths_taken(FAST_CASES[name], monkeypatch)
    assert real == estimated, "(the layer's fused path, the attention's): the CPU's, then the estimate's"


@pytest.mark.xfail(
    strict=True, reason="documented: a subclass with a forward of its own runs its own, on meta tensors the composite"
)
def test_a_subclass_with_its_own_forward_is_not_followed(monkeypatch: pytest.MonkeyPatch) -> None:
    case = FastCase(lambda: _OwnForward(WIDTH, 2, 32, dropout=0.0, batch_first=True).eval())
    real, estimated = _fast_paths_taken(case, monkeypatch)
    assert real == estimated


def test_the_fast_path_grid_has_both_outcomes(monkeypatch: pytest.MonkeyPatch) -> None:
    outcomes = {_fast_paths_taken(FAST_CASES[name], monkeypatch)[0] for name in ("layer", "layer-train", "mha")}
    assert outcomes == {(True, False), (False, False), (False, True)}


# ============================================================================ oneDNN's convolutions


class Conv(NamedTuple):
    """One CPU convolution, described."""

    dims: int = 2
    rows: int = 4
    channels: int = 4
    out_channels: int = 8
    groups: int = 1
    kernel: int = 3
    size: int = 8
    stride: int = 1
    dilation: int = 1
    dtype: torch.dtype = F32
    channels_last: bool = False
    threads: int = 1
    onednn: bool = True


def _pytorch_runs_onednn(conv: Conv) -> tuple[bool, bool]:
    """Return whether PyTorch, and the workspace rule, send ``conv`` to oneDNN."""
    x = torch.zeros(conv.rows, conv.channels, *[conv.size] * conv.dims, dtype=conv.dtype)
    if conv.channels_last and conv.dims > 1:
        x = x.contiguous(memory_format=torch.channels_last if conv.dims == 2 else torch.channels_last_3d)
    weight = torch.zeros(conv.out_channels, conv.channels // conv.groups, *[conv.kernel] * conv.dims, dtype=conv.dtype)
    stride, dilation, zeros = [conv.stride] * conv.dims, [conv.dilation] * conv.dims, [0] * conv.dims
    threads, enabled = torch.get_num_threads(), torch.backends.mkldnn.enabled
    torch.set_num_threads(conv.threads)
    torch.backends.mkldnn.enabled = conv.onednn  # type: ignore[assignment]
    try:
        backend = torch._C._select_conv_backend(x, weight, None, stride, zeros, dilation, False, zeros, conv.groups)
        theirs = backend == torch._C._ConvBackend.Mkldnn  # type: ignore[attr-defined]
        return theirs, workspace._uses_onednn(x, weight, stride, dilation, conv.groups)
    finally:
        torch.set_num_threads(threads)
        torch.backends.mkldnn.enabled = enabled


_CONV_CHANGES: dict[str, dict[str, Any]] = {
    "plain": {},
    "one-row": {"rows": 1},
    "one-row-one-thread-1x1": {"rows": 1, "kernel": 1},
    "one-row-two-threads-1x1": {"rows": 1, "kernel": 1, "threads": 2},
    "sixteen-rows-1x1": {"rows": 16, "kernel": 1},
    "fifteen-rows-1x1": {"rows": 15, "kernel": 1},
    "one-row-strided-1x1": {"rows": 1, "kernel": 1, "stride": 2},
    "one-row-dilated": {"rows": 1, "dilation": 2},
    "one-row-large-kernel": {"rows": 1, "kernel": 5},
    "one-row-large-input": {"rows": 1, "size": 80},
    "one-row-grouped": {"rows": 1, "groups": 2},
    "depthwise": {"groups": 4, "out_channels": 4},
    "strided": {"stride": 2},
    "dilated": {"dilation": 2},
    "1d": {"dims": 1},
    "3d": {"dims": 3},
    # A 3-d input of one row: PyTorch counts elements over the first four sizes, not the depth.
    "3d-one-row-deep": {"dims": 3, "rows": 1, "size": 40},
    "3d-one-row-deep-two-threads": {"dims": 3, "rows": 1, "size": 40, "threads": 2},
    "1d-one-row": {"dims": 1, "rows": 1},
    "channels-last": {"channels_last": True},
    "channels-last-3d": {"dims": 3, "channels_last": True},
    **{f"dtype-{str(d)[6:]}": {"dtype": d} for d in (BF16, F16, F64)},
    "onednn-off": {"onednn": False},
}


# A CPU with native 16-bit floats (AVX-512 BF16, AMX) runs bfloat16 and float16 convolutions
# through oneDNN too; the workspace rule was measured on CPUs without them, and counts none.
_NATIVE_HALF = "this CPU runs 16-bit convolutions through oneDNN, whose buffers the rule does not cover"


@pytest.mark.parametrize("change", list(_CONV_CHANGES))
def test_a_cpu_convolution_runs_through_onednn_where_pytorch_sends_it(change: str) -> None:
    conv = Conv(**_CONV_CHANGES[change])
    theirs, ours = _pytorch_runs_onednn(conv)
    if theirs and conv.dtype in (BF16, F16):
        pytest.skip(_NATIVE_HALF)
    assert ours == theirs


@pytest.mark.slow
@settings(max_examples=300)
@given(
    st.builds(
        Conv,
        dims=st.sampled_from([1, 2, 2, 3]),
        rows=st.sampled_from([1, 2, 15, 16, 32]),
        channels=st.sampled_from([4, 8]),
        out_channels=st.sampled_from([4, 8]),
        groups=st.sampled_from([1, 1, 2, 4]),
        kernel=st.sampled_from([1, 1, 3, 5]),
        size=st.sampled_from([5, 8, 40]),
        stride=st.sampled_from([1, 1, 2]),
        dilation=st.sampled_from([1, 1, 2]),
        dtype=st.sampled_from([F32, F32, F32, BF16, F64]),
        channels_last=st.booleans(),
        threads=st.sampled_from([1, 2]),
    )
)
def test_a_cpu_convolution_runs_through_onednn_where_pytorch_sends_it_over_a_grid(conv: Conv) -> None:
    assume(conv.dilation * (conv.kernel - 1) + 1 <= conv.size)  # else no output: PyTorch refuses the call
    theirs, ours = _pytorch_runs_onednn(conv)
    assume(not (theirs and conv.dtype in (BF16, F16)))  # see _NATIVE_HALF
    assert ours == theirs, conv
