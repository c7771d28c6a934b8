"""CUDA's kernels where a meta run would take another path: dropout, and the attention inside nn.MultiheadAttention.

Checked without a GPU, from what PyTorch's CUDA code allocates and from the H100 run of
2026-11-25 (torch 2.11, ``benchmarks/runs/2026-11-25-h100/pytest.log``):

- In training, ``aten::dropout`` sends a CUDA tensor to its fused kernel, ``native_dropout``
  (``aten/src/ATen/native/Dropout.cpp``: out of place, ``0 < p < 1``, elements to drop), which
  returns the output and a boolean mask, and autograd keeps the mask. A meta tensor (or a CPU
  one) takes the composite path: a noise tensor in the input's dtype, kept for backward. Counted
  that way, the H100's ``nn.TransformerEncoder`` training step was over-estimated by 69 MiB.
- ``F.multi_head_attention_forward`` calls ``scaled_dot_product_attention`` inside itself, where a
  torch-function mode no longer sees it unless it runs the function's body past its hand-off. On
  the H100 (torch 2.11) the attention inside ``nn.MultiheadAttention`` was counted by its math path
  (training +47%, eval under bfloat16 autocast +61%): an estimate in a process whose torch lacks
  ``torch.overrides.redispatch_function``, which the estimate relied on, gives those figures to the
  0.1 MiB. The estimate now runs that body itself, on any torch version; such a child process
  checks it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _benchmarks import BENCHMARKS, imported
from _dispatch import Operators, cuda_autocast
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import koila_retry as koila
from koila_retry._estimation import workspace

MiB = 2**20
HERE = Path(__file__).resolve()

# The H100's peaks (torch.cuda.max_memory_allocated less what was allocated before the
# model was built), in MiB, for two rows of benchmarks/gpu.py's zoo.
H100_TRANSFORMER_TRAIN_FP32 = 364.9  # train, batch 64, float32, memory-efficient attention
H100_TRANSFORMER_EVAL_BF16 = 129.6  # eval, batch 256, bfloat16 autocast, flash or memory-efficient attention


def operators_of(run: Callable[[], Any]) -> set[str]:
    """Return the operators ``run()`` calls, as ``aten::name``."""
    with Operators() as operators:
        run()
    return operators.seen


def estimated(fn: Callable[..., Any], *args: Any, device: str) -> tuple[koila.MemoryEstimate, set[str]]:
    """Return the estimate of ``fn(*args)`` for ``device`` and the operators its meta runs called."""
    found: list[koila.MemoryEstimate] = []
    seen = operators_of(lambda: found.append(koila.estimate(fn, *args, device=device)))
    return found[0], seen


# --------------------------------------------------------------------------- dropout

WIDTH, OUT = 256, 4096


def dropout_after_a_layer(dtype: torch.dtype) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]:
    """A linear layer (256 to 4096 features) whose output goes through dropout, in training."""
    torch.manual_seed(0)
    layer = nn.Linear(WIDTH, OUT).to(dtype)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return F.dropout(layer(x), p=0.1, training=True)

    return forward, torch.randn(8, WIDTH, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_cuda_dropout_keeps_a_one_byte_mask_where_meta_keeps_noise(dtype: torch.dtype) -> None:
    forward, x = dropout_after_a_layer(dtype)
    size = torch.empty((), dtype=dtype).element_size()
    # A row at dropout's end: the input, the layer's output (freed right after: nothing keeps
    # it), dropout's output, and what autograd keeps for dropout's backward.
    cuda, seen = estimated(forward, x, device="cuda")
    assert "aten::native_dropout" in seen
    assert "aten::bernoulli_" not in seen
    assert cuda.per_sample == WIDTH * size + 2 * OUT * size + OUT  # the mask: one byte an element
    cpu, seen = estimated(forward, x, device="cpu")
    assert "aten::bernoulli_" in operators_of(lambda: forward(x))  # the real CPU run's path
    assert "aten::bernoulli_" in seen
    assert "aten::native_dropout" not in seen
    assert cpu.per_sample == WIDTH * size + 3 * OUT * size  # the noise, in the input's dtype


@pytest.mark.parametrize(
    "call",
    [
        lambda x: F.dropout(x, p=0.1, training=False),
        lambda x: F.dropout(x, p=0.0, training=True),
        lambda x: F.dropout(x, p=1.0, training=True),
        lambda x: F.dropout(x * 1, p=0.1, training=True, inplace=True),
        lambda x: F.dropout2d(x.view(-1, 4, 8, 8), p=0.1, training=True),
    ],
    ids=["eval", "p=0", "p=1", "in place", "dropout2d"],
)
def test_cuda_dropout_takes_the_composite_path_where_cuda_does(call: Callable[[torch.Tensor], Any]) -> None:
    x = torch.randn(8, WIDTH)
    _, seen = estimated(call, x, device="cuda")
    assert "aten::native_dropout" not in seen


def test_dropout_by_its_aten_name_takes_the_fused_kernel_on_cuda() -> None:
    _, seen = estimated(lambda x: torch.dropout(x, 0.1, True), torch.randn(8, WIDTH), device="cuda")
    assert "aten::native_dropout" in seen


# --------------------------------------------------------------------------- attention inside nn.MultiheadAttention

FUSED_TRAINING = {
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_efficient_attention_backward",
    "aten::native_dropout",
}
MATH_PATH = {"aten::_safe_softmax", "aten::_softmax", "aten::bernoulli_"}


def encoder_layer_step() -> tuple[Callable[[torch.Tensor], None], torch.Tensor]:
    """One ``nn.TransformerEncoderLayer`` (width 64, 4 heads, dropout 0.1) in training, with backward."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True)

    def step(x: torch.Tensor) -> None:
        layer.zero_grad(set_to_none=True)
        layer(x).sum().backward()

    return step, torch.randn(4, 16, 64)


def test_a_training_encoder_layer_runs_cudas_fused_kernels() -> None:
    step, x = encoder_layer_step()
    found, seen = estimated(step, x, device="cuda")
    assert seen >= FUSED_TRAINING
    assert not MATH_PATH & seen
    assert not [note for note in found.notes if note.startswith("torch.nn.functional.multi_head_attention_forward")]


def test_attention_weights_asked_for_take_the_math_path_with_cudas_dropout() -> None:
    torch.manual_seed(0)
    module = nn.MultiheadAttention(64, 4, dropout=0.1, batch_first=True)

    def step(x: torch.Tensor) -> None:
        out, weights = module(x, x, x, need_weights=True)
        (out.sum() + weights.sum()).backward()

    _, seen = estimated(step, torch.randn(4, 16, 64), device="cuda")
    assert "aten::_softmax" in seen  # the weights are the softmax's output: no fused kernel returns them
    assert "aten::native_dropout" in seen  # the dropout inside, as CUDA runs it
    assert "aten::bernoulli_" not in seen


# Run first in the child, before koila_retry is imported: torch's one-hop redispatch taken away.
WITHOUT_REDISPATCH = """
import torch
for owner, name in ((torch.overrides, "redispatch_function"), (torch._C, "_skip_one_hop_torch_function")):
    if hasattr(owner, name):
        delattr(owner, name)
"""


def test_a_call_no_switched_on_kernel_takes_is_counted_by_the_math_path_and_noted() -> None:
    # HF's GPT-2 builds a causal mask where a placeholder read says its positions are packed: flash
    # takes no mask, and with only flash switched on CUDA would raise.
    x = torch.randn(2, 4, 16, 32, dtype=torch.bfloat16)
    causal = torch.ones(16, 16, dtype=torch.bool).tril()

    def attend(x: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(x, x, x, attn_mask=causal)

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        found, seen = estimated(attend, x, device="cuda")
    assert "aten::_scaled_dot_product_flash_attention" not in seen
    assert [note for note in found.notes if "no kernel CUDA has switched on takes this call" in note]
    with sdpa_kernel([SDPBackend.MATH]):
        found, _ = estimated(lambda x: F.scaled_dot_product_attention(x, x, x, dropout_p=0.1), x, device="cuda")
    assert [note for note in found.notes if "CUDA keeps a one-byte mask" in note]
    assert not [note for note in found.notes if "no kernel CUDA has switched on" in note]


def transformer_row(gpu: Any, mode: str, batch: int) -> tuple[Callable[..., Any], tuple[torch.Tensor, ...]]:
    """Build a transformer row of the GPU zoo on the CPU, in float32, warmed up as ``gpu.measure`` does."""
    step, args = gpu.build(gpu.Case("transformer", mode, batch), torch.device("cpu"), "fp32")
    if mode == "train":
        step(*args)  # gradients and AdamW's state exist after it, as on the H100
    return step, args


@pytest.mark.slow
def test_the_transformer_training_row_is_within_3_percent_of_the_h100() -> None:
    with imported("gpu") as gpu:
        step, args = transformer_row(gpu, "train", 64)
    found = koila.estimate(step, *args, device="cuda")
    # 537.4 MiB on the H100 (+47%): the math path inside nn.MultiheadAttention, and dropout's noise.
    assert found.peak(64) / MiB == pytest.approx(H100_TRANSFORMER_TRAIN_FP32, rel=0.03)


@pytest.mark.slow
def test_without_redispatch_function_attention_inside_multi_head_attention_is_fused() -> None:
    # A child process whose torch lacks redispatch_function (as the H100's estimates show torch 2.11's did).
    paths = [str(HERE.parent.parent), str(HERE.parent), str(BENCHMARKS)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    command = [
        sys.executable,
        "-c",
        f"{WITHOUT_REDISPATCH}\nimport runpy\nrunpy.run_path({str(HERE)!r}, run_name='__main__')",
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert not result["redispatch"]
    assert set(result["layer"]) >= FUSED_TRAINING
    assert not MATH_PATH & set(result["layer"])
    # 209.0 MiB on the H100 (+61%), and 537.4 MiB in training (+47%).
    assert result["eval_bf16"] == pytest.approx(H100_TRANSFORMER_EVAL_BF16, rel=0.01)
    assert result["train_fp32"] == pytest.approx(H100_TRANSFORMER_TRAIN_FP32, rel=0.03)


def _child() -> None:
    """Estimate a layer's step and two rows of the GPU zoo, in a process whose torch may lack redispatch_function."""
    import gpu  # benchmarks/, on the child's path

    step, x = encoder_layer_step()
    _, layer = estimated(step, x, device="cuda")
    infer, args = transformer_row(gpu, "eval", 256)

    def under_autocast(x: torch.Tensor) -> torch.Tensor:
        with cuda_autocast(torch.bfloat16):
            out: torch.Tensor = infer(x)
        return out

    eval_bf16 = koila.estimate(under_autocast, *args, device="cuda").peak(256) / MiB
    train, args = transformer_row(gpu, "train", 64)
    train_fp32 = koila.estimate(train, *args, device="cuda").peak(64) / MiB
    redispatch = hasattr(torch.overrides, "redispatch_function")
    result = {"redispatch": redispatch, "layer": sorted(layer), "eval_bf16": eval_bf16, "train_fp32": train_fp32}
    print(json.dumps(result))


# --------------------------------------------------------------------------- CUDA's reduction staging buffer
#
# PyTorch's CUDA reduction kernel (ATen/native/cuda/Reduce.cuh) splits an output's inputs across
# thread blocks when each thread would otherwise sum 256 values or more and the grid is smaller
# than the card holds; the blocks meet in a buffer it takes from the caching allocator for the
# call. On the H100 run of 2026-11-25 (benchmarks/runs/2026-11-25-h100/diag2.txt), the bias gradient of the
# zoo's MLP, grad_output.sum(0) of a [8192, 1024] float32 tensor, held 64 MiB that way.

H100 = workspace.CudaCard(multiprocessors=132, threads_per_multiprocessor=2048, warp_size=32)
A100 = workspace.CudaCard(multiprocessors=108, threads_per_multiprocessor=2048, warp_size=32)
H100_MLP_TRAIN = {"fp32": 198.2, "bf16": 158.2}  # MiB, batch 8192 (pytest.log of that run)
_aten = torch.ops.aten


def summed(rows: int, columns: int = 1024, dtype: torch.dtype = torch.float32, card: workspace.CudaCard = H100) -> int:
    """Return the staging bytes of a bias gradient: a ``[rows, columns]`` tensor summed over its rows."""
    x = torch.empty(rows, columns, dtype=dtype, device="meta")
    staging, _ = workspace.cuda_reduction_buffers(x, [0], [0, 1], 4, card)
    return staging


def workspace_of(func: Any, args: tuple[Any, ...], card: workspace.CudaCard = H100) -> int:
    """Return the CUDA workspace of ``func(*args)`` on meta tensors, as the estimate's hook sees it."""
    return workspace.cuda_reduction_workspace(func, args, func(*args), card)


def test_the_h100s_bias_gradient_stages_64_mib() -> None:
    x = torch.empty(8192, 1024, device="meta")
    result = _aten.sum.dim_IntList(x, [0], True)  # what autograd's sum_to asks for
    # 128 blocks per output (8192 rows / 4 warps / 16 values a thread), 256 outputs of 4 columns
    # over 32 lanes: the buffer is sized 4 bytes x 1024 outputs x 128 blocks x 32 lanes x 4 columns.
    assert workspace.cuda_reduction_buffers(x, [0], list(result.stride()), 4, H100) == (64 * MiB, 4 * 8)
    assert workspace_of(_aten.sum.dim_IntList, (x, [0], True)) == 64 * MiB + 512  # the semaphores: one block
    assert summed(8192, card=A100) == 64 * MiB  # the A100's grid would take more blocks than the rows ask


@settings(max_examples=40)
@given(st.integers(1, 1020), st.sampled_from([10, 64, 1024, 4096]))
def test_no_buffer_while_a_block_sums_each_output_alone(rows: int, columns: int) -> None:
    # A thread sums under 256 values (ceil(rows / 4) where 4 warps of 32 lanes cover 1024 columns
    # or more; narrower, a block has more warps): one block an output, nothing staged.
    assert summed(rows, columns) == 0
    assert workspace_of(_aten.sum.dim_IntList, (torch.empty(rows, columns, device="meta"), [0], True)) == 0
    assert summed(1021) > 0  # 256 values a thread: the rows are split across blocks


@settings(max_examples=40)
@given(st.integers(1, 2**19), st.integers(1, 2**19))
def test_the_buffer_never_shrinks_as_rows_grow(a: int, b: int) -> None:
    low, high = sorted((a, b))
    assert summed(low) <= summed(high)


@pytest.mark.parametrize("rows", [1024, 2048, 8192, 16384])
def test_the_buffer_is_twice_the_input_until_the_grid_fills_the_card(rows: int) -> None:
    # Blocks per output = a thread's values / 16 = rows / 64, and each block stages 128 floats an output.
    assert summed(rows) == 2 * rows * 1024 * 4


@pytest.mark.parametrize(("card", "blocks"), [(H100, 132 * 16 // 8), (A100, 108 * 16 // 8)])
def test_then_it_stays_at_what_fills_the_card(card: workspace.CudaCard, blocks: int) -> None:
    # 16 blocks of 128 threads a multiprocessor, over a grid of 8 columns of blocks; it grows
    # again only once a thread would sum more than 256 values (past 256 x 4 x blocks rows).
    plateau = 4 * 1024 * blocks * 128
    first = blocks * 64
    assert summed(first - 64, card=card) < plateau
    assert summed(first, card=card) == summed(2 * first, card=card) == summed(1024 * blocks, card=card) == plateau
    assert summed(1024 * blocks + 4096, card=card) > plateau


def test_bfloat16_accumulates_in_float() -> None:
    x = torch.empty(8192, 1024, dtype=torch.bfloat16, device="meta")
    assert summed(8192, dtype=torch.bfloat16) == summed(8192) == 64 * MiB  # four times its own input
    assert workspace_of(_aten.sum.dim_IntList, (x, [0], True)) == 64 * MiB + 512
    # Summed into float32, bfloat16 is read as it is: no copy of the input.
    assert (
        workspace.cuda_reduction_workspace(
            _aten.sum.dim_IntList, (x, [0], True), _aten.sum.dim_IntList(x, [0], True, dtype=torch.float32), H100
        )
        == 64 * MiB + 512
    )


def test_mean_and_sum_over_several_dims_take_the_same_kernel() -> None:
    x = torch.empty(8192, 1024, device="meta")
    assert workspace_of(_aten.mean.dim, (x, [0])) == 64 * MiB + 512
    # A transformer's bias gradient: batch and positions merge into one run of rows.
    tokens = torch.empty(64, 128, 1024, device="meta")
    assert workspace_of(_aten.sum.dim_IntList, (tokens, [0, 1], True)) == 64 * MiB + 512


def test_sums_along_the_fastest_dim_stage_one_value_per_block() -> None:
    # A loss's mean over every element, or a row's sum: the lanes reduce inside the block, and
    # blocks stage one float per output, a few KiB at most.
    assert 0 < workspace_of(_aten.sum.default, (torch.empty(10**7, device="meta"),)) <= 4096
    assert 0 < workspace_of(_aten.mean.dim, (torch.empty(64, 10**6, device="meta"), [1])) <= 4096
    assert workspace_of(_aten.mean.default, (torch.empty(100, device="meta"),)) == 0


def test_an_integer_sum_reads_a_copy_in_int64() -> None:
    flags = torch.empty(10**6, dtype=torch.bool, device="meta")
    assert workspace_of(_aten.sum.default, (flags,)) >= 8 * 10**6


def test_the_copy_of_a_strided_input_keeps_its_dims_order() -> None:
    # x.to(int64), the copy a sum of int32 reads, gives a non-dense input dense strides in its own
    # dims' order (empty_like's preserve_format), not contiguous ones: here the rows stay the fastest
    # dim, so the lanes run along the reduced dim and no block stages its outputs.
    x = torch.empty(4096, 1024, dtype=torch.int32, device="meta")[::2].t()  # [1024, 2048], strides (1, 2048)
    copy = x.to(torch.int64)
    assert copy.stride() == (1, 1024)
    converted = workspace.cuda_rounding(copy.numel() * copy.element_size())
    expected = converted + workspace_of(_aten.sum.dim_IntList, (copy, [0], True))
    assert workspace_of(_aten.sum.dim_IntList, (x, [0], True)) == expected == 16 * MiB


@pytest.mark.parametrize(
    ("memory_format", "expected"),
    [(torch.channels_last, 32 * MiB + 512), (torch.contiguous_format, 2560 + 512)],
    ids=["channels_last", "contiguous"],
)
def test_a_convolutions_bias_gradient_is_summed_outside_cudnn(
    memory_format: torch.memory_format, expected: int
) -> None:
    def backward(mask: list[bool]) -> int:
        grad_output = torch.empty(256, 64, 32, 32, device="meta").to(memory_format=memory_format)
        x = torch.empty(256, 32, 32, 32, device="meta").to(memory_format=memory_format)
        weight = torch.empty(64, 32, 3, 3, device="meta").to(memory_format=memory_format)
        args = (grad_output, x, weight, [64], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, mask)
        return workspace_of(_aten.convolution_backward.default, args)

    # Channels last, the 64 channels are the fastest dim: lanes hold outputs, as for a linear layer.
    assert backward([True, True, True]) == expected
    assert backward([True, True, False]) == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the card assumed where no CUDA device can be asked")
def test_without_a_cuda_device_the_estimate_assumes_an_a100() -> None:
    assert workspace.cuda_card(torch.device("cuda")) == A100
    hook = workspace.device_workspace(torch.device("cuda"))
    assert hook is not None
    x = torch.empty(16384, 1024, device="meta")
    result = _aten.sum.dim_IntList(x, [0], True)
    assert hook(_aten.sum.dim_IntList, (x, [0], True), result) == 4 * 1024 * 216 * 128 + 512  # the A100's plateau
    assert workspace.device_workspace(torch.device("cpu")) is workspace.onednn_convolution_workspace


def mlp_training_step(gpu: Any, precision: str) -> tuple[Callable[..., Any], tuple[torch.Tensor, ...]]:
    """Build the zoo's MLP training row (batch 8192) on the CPU, warmed once, as the H100 ran it.

    ``gpu.build`` switches the CPU's autocast on for bfloat16; a CUDA estimate needs CUDA's, around
    the forward and loss only, as ``torch.autocast("cuda")`` is there.
    """
    if precision == "fp32":
        step, args = gpu.build(gpu.Case("mlp", "train", 8192), torch.device("cpu"), "fp32")
    else:
        spec = gpu.SPECS["mlp"]
        torch.manual_seed(0)
        model = spec.make()
        generator = torch.Generator().manual_seed(1)
        x = spec.inputs(8192, generator)
        y = spec.targets(x, generator)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            optimizer.zero_grad(set_to_none=True)
            with cuda_autocast(torch.bfloat16):
                loss = spec.loss(model, x, y)
            loss.backward()
            optimizer.step()
            return loss.detach()

        args = (x, y)
    step(*args)  # gradients and AdamW's state exist after it, as on the H100
    return step, args


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_mlp_training_row_counts_its_bias_gradients_buffer(precision: str) -> None:
    with imported("gpu") as gpu:
        step, args = mlp_training_step(gpu, precision)
    found = koila.estimate(step, *args, device="cuda")
    # Without the buffer: 162.2 MiB (-18%) and 108.2 MiB (-32%), as on the H100; with it, the
    # 64 MiB of the second layer's bias gradient sit on top of the backward's peak.
    assert found.peak(8192) / MiB == pytest.approx(H100_MLP_TRAIN[precision], rel=0.03)


if __name__ == "__main__":
    _child()
