"""``torch.autocast`` on meta tensors: the casts the target device would make.

Autocast casts in the dispatcher, behind an autocast key that meta tensors do not carry, so
without help a step under ``torch.autocast`` is counted in float32. :func:`autocast_like`
adds a spare autocast key no backend in the process uses (IPU's, HPU's or PrivateUse1's),
behind which a kernel per listed operator casts as the target would, above autograd as real
autocast does. Stand-ins for fused kernels, above the dispatcher, call :func:`cast_as`.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from koila_retry._common.forks import lock_renewed_in_child
from koila_retry._common.tensors import tensors_in

__all__ = ["autocast_like", "cast_as", "casts_on", "settle"]

# The operators autocast casts, by policy, as PyTorch 2.13 lists them for each device type (versions.py
# names the versions checked; tests/test_tables.py derives both lists from the installed PyTorch).
_LOWER, _FP32, _FP32_DTYPE, _PROMOTE, _BANNED = "lower", "fp32", "fp32 dtype", "promote", "banned"


def _each(names: str, policy: str) -> dict[str, str]:
    return dict.fromkeys(names.split(), policy)


_CPU: dict[str, str] = {
    **_each(
        (
            "conv1d conv2d conv3d bmm mm linalg_vecdot baddbmm addmm _addmm_activation addbmm linear _convolution "
            "matmul conv_tbc mkldnn_rnn_layer conv_transpose1d conv_transpose2d conv_transpose3d prelu "
            "scaled_dot_product_attention _native_multi_head_attention"
        ),
        _LOWER,
    ),
    **_each(
        (
            "avg_pool3d binary_cross_entropy grid_sampler polar prod quantile nanquantile stft cdist "
            "grid_sampler_2d _grid_sampler_2d_cpu_fallback grid_sampler_3d trace view_as_complex cholesky "
            "cholesky_inverse cholesky_solve inverse lu_solve orgqr ormqr pinverse max_pool3d max_unpool2d "
            "max_unpool3d adaptive_avg_pool3d reflection_pad1d reflection_pad2d replication_pad1d "
            "replication_pad2d replication_pad3d mse_loss cosine_embedding_loss nll_loss nll_loss2d "
            "hinge_embedding_loss poisson_nll_loss smooth_l1_loss cross_entropy_loss l1_loss huber_loss "
            "margin_ranking_loss soft_margin_loss triplet_margin_loss multi_margin_loss ctc_loss kl_div "
            "multilabel_margin_loss binary_cross_entropy_with_logits fft_fft fft_ifft fft_fft2 fft_ifft2 "
            "fft_fftn fft_ifftn fft_rfft fft_irfft fft_rfft2 fft_irfft2 fft_rfftn fft_irfftn fft_hfft fft_ihfft "
            "linalg_cond linalg_matrix_rank linalg_solve linalg_cholesky linalg_svdvals linalg_eigvals "
            "linalg_eigvalsh linalg_inv linalg_householder_product linalg_tensorinv linalg_tensorsolve "
            "fake_quantize_per_tensor_affine geqrf _lu_with_info qr svd triangular_solve fractional_max_pool2d "
            "fractional_max_pool3d adaptive_max_pool3d multilabel_margin_loss_forward linalg_qr "
            "linalg_cholesky_ex linalg_svd linalg_eig linalg_eigh linalg_lstsq linalg_inv_ex"
        ),
        _FP32,
    ),
    **_each("stack cat index_copy", _PROMOTE),
}
_CUDA: dict[str, str] = {
    **_each(
        (
            "_convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d conv_transpose3d "
            "convolution prelu addmm addmv addr matmul einsum mm mv linalg_vecdot linear addbmm baddbmm bmm "
            "chain_matmul linalg_multi_dot _thnn_fused_lstm_cell _thnn_fused_gru_cell lstm_cell gru_cell "
            "rnn_tanh_cell rnn_relu_cell _scaled_dot_product_flash_attention scaled_dot_product_attention "
            "cudnn_convolution cudnn_convolution_transpose _cudnn_rnn"
        ),
        _LOWER,
    ),
    **_each(
        (
            "acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow softplus "
            "layer_norm native_layer_norm group_norm frobenius_norm nuclear_norm cosine_similarity "
            "poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div l1_loss "
            "smooth_l1_loss huber_loss mse_loss margin_ranking_loss multilabel_margin_loss soft_margin_loss "
            "triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits dist pdist cdist renorm "
            "logsumexp upsample_nearest1d _upsample_nearest_exact1d upsample_nearest2d _upsample_nearest_exact2d "
            "upsample_nearest3d _upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d "
            "_upsample_bilinear2d_aa upsample_trilinear3d upsample_bicubic2d _upsample_bicubic2d_aa norm rms_norm"
        ),
        _FP32,
    ),
    **_each("prod softmax log_softmax cumprod cumsum linalg_vector_norm linalg_matrix_norm sum", _FP32_DTYPE),
    **_each("addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add", _PROMOTE),
    "binary_cross_entropy": _BANNED,
}
POLICIES: dict[str, dict[str, str]] = {"cpu": _CPU, "cuda": _CUDA}
# PyTorch lists overloads and the tables above operators: the overloads of listed operators that autocast
# leaves alone on each device type (out_dtype and quantized variants; on the CPU, _convolution's own
# overload, as only its deprecated one is listed there).
OVERLOADS_LEFT_ALONE: dict[str, frozenset[str]] = {
    "cpu": frozenset(
        {"_convolution", "addmm.dtype", "baddbmm.dtype", "bmm.dtype", "mm.dtype"}
        | {"fake_quantize_per_tensor_affine.tensor_qparams"}
    ),
    "cuda": frozenset(
        {"addmm.dtype", "baddbmm.dtype", "bmm.dtype", "mm.dtype", "norm.ScalarOpt_dim_dtype", "norm.ScalarOpt_dtype"}
        | {"_scaled_dot_product_flash_attention.quantized"}
    ),
}

_BANNED_MESSAGE = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast: use "
    "torch.nn.functional.binary_cross_entropy_with_logits or torch.nn.BCEWithLogitsLoss, which are safe to "
    "autocast (raised as PyTorch raises it under autocast on CUDA)"
)
# Spare autocast keys, for backends this process does not load; the first one free is used.
_SPARE = ("AutocastIPU", "AutocastHPU", "AutocastPrivateUse1")


class _Emulation:
    """One meta run's autocast: the target's device type, its policies and its cache of cast parameters."""

    def __init__(self, device_type: str, note: Callable[[str, str], None], followed: bool) -> None:
        self.device_type = device_type
        self.policies = POLICIES.get(device_type) if followed else None
        # why a region of the device's autocast is not followed, said once if one opens; None if it is
        self.unfollowed: str | None = None
        if self.policies is None:
            self.unfollowed = _ELSEWHERE.format(device=device_type) if followed else _NO_KEY
        self.followed = followed
        self.note = note
        # id of a parameter -> (a weak reference to it, its cast); cleared as PyTorch clears its own
        self.cache: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}

    def say_unfollowed(self) -> None:
        """Note, once, that a region of the device's autocast is met and not followed."""
        if self.unfollowed is not None:
            self.note("torch.autocast", self.unfollowed)
            self.unfollowed = None

    def enabled(self) -> bool:
        settle()
        return torch.is_autocast_enabled(self.device_type)

    def cast(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Cast one argument as autocast's ``cached_cast`` does."""
        if not _eligible(tensor) or tensor.dtype == dtype:
            return tensor
        lower = torch.get_autocast_dtype(self.device_type)
        cacheable = (
            dtype == lower
            and tensor.dtype == torch.float32
            and tensor.requires_grad
            and tensor.is_leaf
            and not tensor._is_view()
            and torch.is_autocast_cache_enabled()
        )
        if not cacheable:
            return tensor.to(dtype)
        found = self.cache.get(id(tensor))
        if found is not None and found[0]() is tensor:
            return found[1]
        cast = tensor.to(dtype)
        self.cache[id(tensor)] = (weakref.ref(tensor), cast)
        return cast

    def apply(self, policy: str, schema: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        """Return the arguments of one call as autocast, under ``policy``, passes them on."""
        if policy == _BANNED:
            raise RuntimeError(_BANNED_MESSAGE)
        if policy == _FP32_DTYPE:
            first = args[0] if args else None
            if isinstance(first, torch.Tensor) and _eligible(first):
                return _with_float_dtype(schema, args, kwargs)
            return args, kwargs
        if policy == _LOWER:
            dtype = torch.get_autocast_dtype(self.device_type)
        elif policy == _FP32:
            dtype = torch.float32
        else:
            dtype = _widest(torch.get_autocast_dtype(self.device_type), args, kwargs)
        cast: tuple[Any, Any] = tree_map_only(torch.Tensor, lambda tensor: self.cast(tensor, dtype), (args, kwargs))
        return cast


def _eligible(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() and tensor.dtype != torch.float64


def _widest(lower: torch.dtype, *trees: Any) -> torch.dtype:
    found = lower
    for tensor in (tensor for tree in trees for tensor in tensors_in(tree)):
        if _eligible(tensor) and tensor.dtype != found:
            found = torch.float32  # float32 itself, or two lower precisions that meet there
    return found


def _with_float_dtype(schema: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """Return the arguments with ``dtype=torch.float32`` where the operator takes one and none was given."""
    names = [argument.name for argument in schema.arguments]
    if "dtype" not in names:
        return args, kwargs
    position = names.index("dtype")
    if position < len(args):
        if args[position] is not None:
            return args, kwargs
        return (*args[:position], torch.float32, *args[position + 1 :]), kwargs
    if kwargs.get("dtype") is not None:
        return args, kwargs
    return args, {**kwargs, "dtype": torch.float32}


def _nesting() -> int:
    """Return how many autocast regions are open now (PyTorch has no getter: one up and one down)."""
    level = torch.autocast_increment_nesting()
    torch.autocast_decrement_nesting()
    return level - 1


_local = threading.local()


def _current() -> _Emulation | None:
    emulation: _Emulation | None = getattr(_local, "emulation", None)
    return emulation


class _Registry:
    """The kernels behind the spare key, registered once per process on first use."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        lock_renewed_in_child(self, "lock")
        self.key: Any = None
        self.failed = False
        self.libraries: list[torch.library.Library] = []

    def ready(self) -> Any:
        """Return the spare dispatch key with every kernel behind it, or None where none is free."""
        with self.lock:
            if self.key is None and not self.failed:
                self.key = self._register()
                self.failed = self.key is None
            return self.key

    def _register(self) -> Any:
        for name in _SPARE:
            if not _free(name):
                continue
            fallback = torch.library.Library("_", "IMPL")  # type: ignore[no-untyped-call]
            kernels = torch.library.Library("aten", "IMPL")  # type: ignore[no-untyped-call]
            try:
                fallback.fallback(torch.library.fallthrough_kernel, name)  # type: ignore[no-untyped-call]
                _register_kernels(kernels, name)
            except RuntimeError:  # a backend holds the key after all (a fallback of its own): the next one
                kernels._destroy()  # type: ignore[no-untyped-call]
                fallback._destroy()  # type: ignore[no-untyped-call]
                continue
            self.libraries = [fallback, kernels]
            return getattr(torch._C.DispatchKey, name)
        return None


def _register_kernels(kernels: torch.library.Library, name: str) -> None:
    """Register, behind the key ``name``, a kernel for every out-of-place overload on autocast's lists."""
    excluded = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, name))
    for op_name in sorted(set(_CPU) | set(_CUDA)):
        packet = getattr(torch.ops.aten, op_name, None)
        if packet is None:  # not in this build of PyTorch
            continue
        for overload_name in packet.overloads():
            overload = getattr(packet, overload_name)
            schema = overload._schema
            if schema.is_mutable or not any("Tensor" in str(argument.type) for argument in schema.arguments):
                continue
            qualified = op_name if overload_name == "default" else f"{op_name}.{overload_name}"
            kernel = _kernel(op_name, qualified, overload, excluded)
            kernels.impl(qualified, kernel, name)  # type: ignore[no-untyped-call]


def _free(name: str) -> bool:
    if name == "AutocastPrivateUse1" and torch._C._get_privateuse1_backend_name() != "privateuseone":
        return False
    key = getattr(torch._C.DispatchKey, name, None)
    return key is not None and not any(
        torch._C._dispatch_has_kernel_for_dispatch_key(op, key) for op in ("aten::add.Tensor", "aten::mm")
    )


def _kernel(op_name: str, qualified: str, overload: Any, excluded: Any) -> Callable[..., Any]:
    schema = overload._schema

    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(excluded), torch._C.DisableTorchFunction():
            emulation = _current()
            if emulation is not None and emulation.enabled():
                if emulation.policies is None:
                    emulation.say_unfollowed()
                else:
                    policy = emulation.policies.get(op_name)
                    if policy is not None and qualified not in OVERLOADS_LEFT_ALONE[emulation.device_type]:
                        args, kwargs = emulation.apply(policy, schema, args, kwargs)
            return overload(*args, **kwargs)

    return kernel


_REGISTRY = _Registry()


@contextlib.contextmanager
def autocast_like(device: torch.device, note: Callable[[str, str], None]) -> Iterator[None]:
    """Make the meta run cast as ``torch.autocast`` does on ``device`` (CPU or CUDA lists) while the block runs."""
    # On another device a region is noted once, through note(what, why), and counted in the types it has.
    if device.type == "meta":
        yield
        return
    key = _REGISTRY.ready()
    previous = _current()
    _local.emulation = _Emulation(device.type, note, followed=key is not None)
    try:
        if key is None:
            yield
            return
        was_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded(key)
        torch._C._dispatch_tls_set_dispatch_key_excluded(key, False)
        try:
            with torch._C._IncludeDispatchKeyGuard(key):
                yield
        finally:
            torch._C._dispatch_tls_set_dispatch_key_excluded(key, was_excluded)
    finally:
        _local.emulation = previous


_ELSEWHERE = "its casts on {device} are not modelled: the run is counted in the types it has"
_NO_KEY = (
    "its casts are not modelled, as this process loads a backend for every spare autocast key (IPU, HPU, "
    "PrivateUse1): the run is counted in the types it has"
)


def settle() -> None:
    """Drop the cached casts once the outermost autocast region has ended, as PyTorch does on leaving it."""
    # Called before each operator, so the casts are gone before anything after the region allocates.
    emulation = _current()
    if emulation is None:
        return
    if emulation.cache and _nesting() == 0:
        emulation.cache.clear()
    # Without a key, no kernel of ours runs to see a region open. Below autograd (in the
    # estimate's dispatch mode) autocast always reads as off, but the count of regions is plain.
    if not emulation.followed and emulation.unfollowed is not None and _nesting() > 0:
        emulation.say_unfollowed()


def casts_on() -> bool:
    """Return whether the meta run now casts as autocast does (an autocast region of the target is open)."""
    emulation = _current()
    return emulation is not None and emulation.enabled()


def cast_as(op_name: str, *tensors: Any) -> tuple[Any, ...]:
    """Return ``tensors`` (tensors, lists of them, None) as autocast would pass them to ATen's ``op_name`` now."""
    emulation = _current()
    if emulation is None or emulation.policies is None or not emulation.enabled():
        return tensors
    policy = emulation.policies.get(op_name)
    if policy is None or policy in (_FP32_DTYPE, _BANNED):
        return tensors
    cast_args, _ = emulation.apply(policy, None, tensors, {})
    return tuple(cast_args)
