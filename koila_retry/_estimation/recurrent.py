"""Recurrent layers on meta tensors, with the memory of the kernels the target device runs.

On meta tensors ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` run cell by cell: thousands of
operators, and not the memory of a real device. :class:`RecurrentKernels` runs instead a
stand-in that allocates what the device's kernel allocates, when it does: the CPU's
oneDNN LSTM and generic path (measured here: oneDNN 3.12, AVX-512), and CUDA's cuDNN
(fitted to one H100 run, cuDNN 9.19, and noted as such). Packed sequences, LSTMs with
projections and other devices keep PyTorch's path, and the estimate notes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from koila_retry._estimation.autocast import cast_as, casts_on

__all__ = ["RecurrentKernels", "recurrent_kernels"]

_LSTM, _GRU, _TANH, _RELU = "LSTM", "GRU", "RNN_TANH", "RNN_RELU"
_CELLS: dict[Callable[..., Any], str] = {
    torch.lstm: _LSTM,
    torch.gru: _GRU,
    torch.rnn_tanh: _TANH,
    torch.rnn_relu: _RELU,
}
_GATES = {_LSTM: 4, _GRU: 3, _TANH: 1, _RELU: 1}
_ONEDNN_LSTM = 2  # ideep::rnn_kind::LSTM, the ``mode`` argument of aten::mkldnn_rnn_layer
_PAGE = 4096


@dataclass(frozen=True)
class _Call:
    """One call of ``torch._VF.<cell>`` on a padded (not packed) sequence."""

    cell: str
    input: torch.Tensor
    hx: torch.Tensor
    cx: torch.Tensor | None
    params: Sequence[torch.Tensor]
    has_biases: bool
    num_layers: int
    dropout: float
    train: bool
    bidirectional: bool
    batch_first: bool

    @property
    def directions(self) -> int:
        return 2 if self.bidirectional else 1

    def weights(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Return ``w_ih, w_hh, b_ih, b_hh`` of one layer and direction (``index = layer * directions + d``)."""
        stride = 4 if self.has_biases else 2
        found = list(self.params[index * stride : (index + 1) * stride])
        if not self.has_biases:
            return found[0], found[1], None, None
        return found[0], found[1], found[2], found[3]


def _parse(cell: str, args: tuple[Any, ...]) -> _Call | None:
    """Return the call, or ``None`` for what keeps PyTorch's path (packed sequences, projections)."""
    if len(args) != 9 or not all(isinstance(flag, bool) for flag in args[-3:]):
        return None
    if cell == _LSTM:
        if not isinstance(args[1], (list, tuple)) or len(args[1]) != 2:
            return None  # the packed overload: (data, batch_sizes, hx, ...)
        hx, cx = args[1]
        if hx.shape[-1] != cx.shape[-1]:
            return None  # projections: oneDNN refuses them, and the generic path differs
    else:
        if not isinstance(args[2], (list, tuple)):
            return None
        hx, cx = args[1], None
    x, _, params, has_biases, num_layers, dropout, train, bidirectional, batch_first = args
    tensors = [x, hx, *params] + ([] if cx is None else [cx])
    if not all(isinstance(tensor, torch.Tensor) and tensor.device.type == "meta" for tensor in tensors):
        return None
    if x.dim() != 3 or x.numel() == 0:
        return None
    return _Call(cell, x, hx, cx, params, has_biases, num_layers, float(dropout), train, bidirectional, batch_first)


def _touch(nbytes: int, device: torch.device) -> None:
    """Allocate ``nbytes`` and free them at once: a kernel's scratch space, alive during its call."""
    # Even 0 bytes: every batch size then takes the same moments, which the fit joins into lines.
    torch.empty(max(nbytes, 0), dtype=torch.uint8, device=device)


def _bytes_of(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def _recording(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(tensor is not None and tensor.requires_grad for tensor in tensors)


# --- the CPU: oneDNN's LSTM ---------------------------------------------------------------


def _good_ld(dim: int, size: int) -> int:
    """Return oneDNN's leading dimension for ``dim`` elements: 64-byte aligned, not a multiple of 256."""
    step = 64 // size
    ld = -(-dim // step) * step
    return ld + step if ld % 256 == 0 else ld


def _pages(nbytes: int) -> int:
    return -(-nbytes // _PAGE) * _PAGE


@dataclass(frozen=True)
class _OnednnLayer:
    """The bytes one ``mkldnn_rnn_layer`` (one LSTM layer and direction) holds, by oneDNN's layout."""

    # The workspace: gates, projections, states, cell states, states' gradients (each page-aligned).
    # Forward writes the gates and every step's cell states but the last's; backward the gradients.
    # Measured against the pages resident after each (mincore).

    steps: int
    rows: int
    features: int
    hidden: int
    size: int  # bytes of an element of the input

    @property
    def weights(self) -> int:
        return 4 * self.hidden * (self.features + self.hidden) * self.size

    @property
    def gates(self) -> int:
        """Bytes of one step's gates, in the layout of the workspace."""
        return self.rows * _good_ld(4 * self.hidden, self.size) * self.size

    def kept(self) -> int:
        """Return the resident bytes of the workspace after the forward pass, kept for backward."""
        return _pages(self.steps * self.gates) + _pages((self.steps - 1) * self.rows * self.hidden * 4)

    def forward_scratch(self) -> tuple[int, int]:
        """Return the scratch space of a training forward: one step's gates, and every step's below 128 rows."""
        # Two moments, so that each grows in a straight line with the batch.
        merged = self.steps * self.gates + self.weights if self.rows < 128 else 0
        return self.gates + self.weights, merged

    def inference_scratch(self) -> int:
        """Return the scratch space of a forward without autograd: every step's hidden state, one step's gates."""
        # And half the weights, for their reordered copy (measured: the rest stays resident between calls).
        return self.steps * self.rows * self.hidden * self.size + self.gates + self.weights // 2

    def backward_scratch(self) -> int:
        """Return what backward writes beyond its gradients: the states' gradients, every step's gates, weights."""
        gradients = _good_ld(max(self.features, self.hidden), 4) * 4
        states = (3 * self.steps + 1) * self.rows * gradients + (self.steps + 1) * self.rows * self.hidden * 4
        return states + self.steps * self.gates + 2 * self.weights


def _onednn_usable(call: _Call) -> bool:
    """Return whether the CPU sends this LSTM to oneDNN (as PyTorch's own ``use_mkldnn`` decides)."""
    available = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
    if call.cell != _LSTM or not (available and torch.backends.mkldnn.enabled):
        return False
    dtype = call.input.dtype
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return not torch.is_grad_enabled() and bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


def _onednn_layer(
    call: _Call, layer_input: torch.Tensor, index: int, hx: torch.Tensor, cx: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run one layer and direction as ``aten::mkldnn_rnn_layer`` (its meta kernel), with its workspace."""
    w_ih, w_hh, b_ih, b_hh = call.weights(index)
    if b_ih is None or b_hh is None:
        b_ih, b_hh = torch.zeros_like(w_ih), torch.zeros_like(w_hh)  # as PyTorch passes them
    steps, rows, features = layer_input.shape
    hidden = hx.shape[-1]
    device = layer_input.device
    output, hy, cy, _ = torch.ops.aten.mkldnn_rnn_layer(
        layer_input,
        w_ih,
        w_hh,
        b_ih,
        b_hh,
        hx,
        cx,
        index % call.directions == 1,
        [],
        _ONEDNN_LSTM,
        hidden,
        call.num_layers,
        call.has_biases,
        call.bidirectional,
        call.batch_first,
        call.train,
    )
    # In the output's type: under autocast the dispatcher cast the call to the lower precision.
    sizes = _OnednnLayer(steps, rows, features, hidden, output.element_size())
    node = output.grad_fn
    if not torch.is_grad_enabled():
        _touch(sizes.inference_scratch(), device)
    elif node is None:  # nothing needs a gradient: the workspace is written, then dropped
        for scratch in sizes.forward_scratch():
            _touch(sizes.kept() + scratch, device)
    else:
        # PyTorch's meta kernel returns an empty workspace; autograd keeps this one with
        # the node, and the hook lets it go when the node has run, as autograd does.
        for scratch in sizes.forward_scratch():
            _touch(scratch, device)
        kept = [torch.empty(sizes.kept(), dtype=torch.uint8, device=device)]
        results = [_bytes_of(result) for result in (output, hy, cy)]  # not the tensors: the hook outlives them

        def backward(_: Sequence[torch.Tensor | None], grads: Sequence[torch.Tensor | None]) -> None:
            # The kernel makes contiguous copies of its incoming gradients, and zeros for the missing ones.
            copies = sum(nbytes for nbytes, grad in zip(results, grads) if grad is None or not grad.is_contiguous())
            _touch(copies + sizes.backward_scratch(), device)
            kept.clear()

        node.register_hook(backward)
    return output, hy, cy


def _onednn_lstm(call: _Call, cx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run an LSTM, of cell state ``cx``, as PyTorch's ``mkldnn_rnn`` does: a oneDNN layer per layer and direction."""
    # The contiguous input (a copy, for batch_first) lives until the whole stack has run.
    contiguous = (call.input.transpose(0, 1) if call.batch_first else call.input).contiguous()
    layer_input = contiguous
    hx, cx = call.hx.contiguous(), cx.contiguous()
    hys, cys = [], []
    for layer in range(call.num_layers):
        outputs = []
        for direction in range(call.directions):
            index = layer * call.directions + direction
            output, hy, cy = _onednn_layer(call, layer_input, index, hx[index], cx[index])
            outputs.append(output)
            hys.append(hy)
            cys.append(cy)
        layer_input = outputs[0] if len(outputs) == 1 else torch.cat(outputs, -1)
        if call.dropout and call.train and layer < call.num_layers - 1:
            layer_input = torch.dropout(layer_input, call.dropout, True)
    output = layer_input.transpose(0, 1) if call.batch_first else layer_input
    hy, cy = torch.stack(hys), torch.stack(cys)
    del contiguous
    return output, hy, cy


# --- the CPU: the generic path ---------------------------------------------------------------


@dataclass(frozen=True)
class _Cell:
    """What one time step of a cell holds on the CPU's generic path, in hidden-sized pieces per row."""

    # Counted from a real CPU run's operators (torch 2.13), checked against whole runs of one to
    # three layers, each direction, with and without autograd.

    saved: int  # kept for backward, the new hidden (and cell) state among them
    scratch: int  # alive only during the step, with autograd
    plain: int  # alive during a step without autograd, the new states included
    carry: int  # the previous step's states beside the hidden state, without autograd
    # Backward, as the most alive above its start: the largest ``pieces + w * dw_hh + b * db_hh``
    # over the terms of sequences of at least ``steps``: the first step's temporaries against
    # the later steps' sums of the weights' gradients (the third step's hold the most). With a
    # gradient for the layer's output, and with one for its last hidden state only.
    backward: tuple[tuple[int, int, int, int], ...]  # (pieces, w, b, steps)
    backward_hidden: tuple[tuple[int, int, int, int], ...]
    end: int  # alive beside the gates' gradients when they are stacked, against what is counted
    keeps_hidden: bool  # whether the last step's hidden state is kept for backward too


# A plain RNN's step, with tanh or relu.
_PLAIN = _Cell(
    saved=1,
    scratch=1,
    plain=2,
    carry=0,
    backward=((1, 0, 0, 1), (0, 1, 1, 1), (2, 1, 1, 2), (-1, 3, 1, 2), (2, 2, 2, 3), (1, 3, 1, 3)),
    backward_hidden=((1, 0, 0, 1), (-1, 1, 1, 1), (1, 1, 1, 2), (-2, 3, 1, 2), (0, 3, 1, 3)),
    end=0,
    keeps_hidden=True,
)
# A GRU step keeps its hidden gates and four hidden-sized tensors (two of them copies made
# before in-place products); an LSTM step its gates, the cell state, its tanh and the new
# hidden state; a plain RNN step only its new hidden state.
_GENERIC = {
    _GRU: _Cell(
        saved=7,
        scratch=0,
        plain=5,
        carry=0,
        backward=((2, 0, 0, 1), (0, 1, 1, 1), (4, 0, 0, 2), (2, 1, 1, 2), (-8, 3, 1, 2), (-7, 3, 1, 3)),
        backward_hidden=((2, 0, 0, 1), (-1, 1, 1, 1), (3, 0, 0, 2), (1, 1, 1, 2), (-9, 3, 1, 2), (-8, 3, 1, 3)),
        end=3,
        keeps_hidden=False,
    ),
    _LSTM: _Cell(
        saved=7,
        scratch=1,
        plain=7,
        carry=1,
        backward=((4, 0, 0, 1), (-2, 1, 1, 1), (5, 0, 0, 2), (0, 1, 1, 2), (-6, 3, 1, 2), (-4, 3, 1, 3)),
        backward_hidden=((3, 0, 0, 1), (-3, 1, 1, 1), (4, 0, 0, 2), (-1, 1, 1, 2), (-7, 3, 1, 2), (-5, 3, 1, 3)),
        end=0,
        keeps_hidden=False,
    ),
    _TANH: _PLAIN,
    _RELU: _PLAIN,
}


class _Directions:
    """What the directions of one layer share on the generic path."""

    # Both run in one function on the CPU: the forward direction's input projection lives until the
    # reverse one's is made (pending); in backward their joined output's gradient goes once both used it.

    def __init__(self, count: int) -> None:
        self.count = count
        self.left = count  # the directions whose backward has not run
        self.pending: list[torch.Tensor] = []

    def consumed(self, gradient: torch.Tensor | None) -> int:
        """Return the bytes the real path has freed of ``gradient`` when this direction's steps are done."""
        self.left -= 1
        if gradient is None or self.left != 0:
            return 0
        nbytes = gradient.untyped_storage().nbytes()
        return nbytes if nbytes <= self.count * _bytes_of(gradient) else 0  # a view of more may live on


class _GenericLayer(torch.autograd.Function):
    """One layer and direction of the CPU's generic path, as the memory it allocates and frees."""

    @staticmethod
    def forward(
        ctx: Any,
        cell: _Cell,
        recording: bool,
        layer: _Directions,
        x: torch.Tensor,
        hx: torch.Tensor,
        cx: torch.Tensor | None,
        w_ih: torch.Tensor,
        w_hh: torch.Tensor,
        b_ih: torch.Tensor | None,
        b_hh: torch.Tensor | None,
    ) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)  # a gradient that never came is no tensor on the real path either
        steps, rows, features = x.shape
        hidden, gates = w_hh.shape[1], w_ih.shape[0]
        device, dtype = x.device, x.dtype
        piece = rows * hidden * x.element_size()

        new = functools.partial(torch.empty, dtype=dtype, device=device)

        # The input projection of the whole sequence, in one product: a 2-D view of a
        # contiguous input is multiplied as it is, the bias added in the same call; any
        # other is copied first, and the bias added into a new tensor. The product keeps
        # its input for the weight's gradient.
        keeps_input = recording and w_ih.requires_grad
        copy = None
        if x.is_contiguous():
            projected = new(steps, rows, gates)
        else:
            copy = new(steps, rows, features)
            projected = new(steps, rows, gates)
            if not keeps_input:
                copy = None
            if b_ih is not None:
                projected = new(steps, rows, gates)  # allocated before the product it replaces is freed
        layer.pending.clear()  # what the direction before left alive until this projection was made
        if recording:
            # The last step's states are the results, kept for backward only by a plain RNN
            # (whose tanh or relu keeps its result): then the hidden state is part of what is kept.
            last = 0 if cell.keeps_hidden else 1 if cx is None else 2
            kept = new(steps * cell.saved - last, rows, hidden)
            _touch(cell.scratch * piece, device)
        else:
            # Each step's hidden state lives until the outputs are stacked, an LSTM's cell
            # state until the next step has made its own; the rest, during its step.
            kept = torch.empty((steps - 1) * piece, dtype=torch.uint8, device=device)
            carried = torch.empty(cell.carry * piece if steps > 1 else 0, dtype=torch.uint8, device=device)
            _touch(cell.plain * piece, device)
            del carried
        hy = kept[-1] if recording and cell.keeps_hidden else new(rows, hidden)
        cy = None if cx is None else new(rows, hidden)
        output = new(steps, rows, hidden)
        del projected
        if not recording:
            del kept
            return (output, hy) if cy is None else (output, hy, cy)
        # The products keep their inputs for the weights' gradients: the layer's input
        # (or its copy) and the first step's hidden (and cell) state.
        ctx.states = [state for state in (hx, cx) if state is not None]
        ctx.input = x if keeps_input and copy is None else copy
        ctx.cell, ctx.kept, ctx.layer = cell, kept, layer
        ctx.shapes = (steps, rows, features, hidden, gates)
        ctx.weights = (w_ih, w_hh, b_ih, b_hh)
        ctx.dtype, ctx.device = dtype, device
        return (output, hy) if cy is None else (output, hy, cy)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        cell: _Cell = ctx.cell
        steps, rows, features, hidden, gates = ctx.shapes
        w_ih, w_hh, b_ih, b_hh = ctx.weights
        needed = ctx.needs_input_grad
        dtype, device = ctx.dtype, ctx.device
        size = dtype.itemsize
        piece = rows * hidden * size

        new = functools.partial(torch.empty, dtype=dtype, device=device)

        # Steps run last to first, each freeing what it kept: the first ones, with
        # everything still kept, hold the most.
        w_hh_grad = new(*w_hh.shape) if needed[7] else None
        b_hh_grad = new(*b_hh.shape) if b_hh is not None and needed[9] else None
        weight, bias = _bytes_of(w_hh_grad), _bytes_of(b_hh_grad)
        # One moment per term, so that each grows in a straight line with the batch.
        table = cell.backward if grads[0] is not None else cell.backward_hidden
        for pieces, w, b, least in table:
            if steps >= least:
                _touch(pieces * piece + (w - 1) * weight + (b - 1) * bias, device)
        ctx.kept = ctx.states = None  # the first step's states go with its products
        # Each step's gradient of its projected input, then all of them stacked. By then the
        # steps have used up the output's gradient, which the real path frees and autograd
        # holds here until this function returns: the stacked gradients stand in smaller.
        # (A gradient of the last hidden state only holds one hidden-sized piece less, all through.)
        end = cell.end - (grads[0] is None)
        each = torch.empty(steps * rows * gates * size + end * piece, dtype=torch.uint8, device=device)
        stacked = torch.empty(
            max(steps * rows * gates * size - ctx.layer.consumed(grads[0]), 0), dtype=torch.uint8, device=device
        )
        del each
        b_ih_grad = new(*b_ih.shape) if b_ih is not None and needed[8] else None
        w_ih_grad = new(*w_ih.shape) if needed[6] else None
        x_grad = new(steps, rows, features) if needed[3] else None
        del stacked
        ctx.input = None
        hx_grad = new(rows, hidden) if needed[4] else None
        cx_grad = new(rows, hidden) if needed[5] else None
        return None, None, None, x_grad, hx_grad, cx_grad, w_ih_grad, w_hh_grad, b_ih_grad, b_hh_grad


def _hiddens(recording: bool, steps: int, rows: int, hidden: int, like: torch.Tensor) -> torch.Tensor | None:
    """Return the step outputs a layer without autograd still holds (with autograd, they are counted as kept)."""
    return None if recording else torch.empty(steps, rows, hidden, dtype=like.dtype, device=like.device)


def _generic(call: _Call) -> tuple[torch.Tensor, ...]:
    """Run a recurrent layer stack as the CPU's generic path does, each layer and direction as one stand-in."""
    cell = _GENERIC[call.cell]
    x = call.input.transpose(0, 1) if call.batch_first else call.input
    hxs = call.hx.unbind(0)
    cxs = None if call.cx is None else call.cx.unbind(0)
    hys, cys = [], []
    for layer in range(call.num_layers):
        outputs: list[torch.Tensor] = []
        directions = _Directions(call.directions)
        for direction in range(call.directions):
            index = layer * call.directions + direction
            weights = call.weights(index)
            cx = None if cxs is None else cxs[index]
            recording = _recording(x, hxs[index], cx, *weights)
            results = _GenericLayer.apply(  # type: ignore[no-untyped-call]
                cell, recording, directions, x, hxs[index], cx, *weights
            )
            outputs.append(results[0])
            hys.append(results[1])
            if cx is not None:
                cys.append(results[2])
            del results
            if direction == 0 and call.bidirectional:
                # Both directions run in one function, which keeps the forward direction's
                # input projection until the reverse one's is made, and the step outputs of
                # both (kept anyway with autograd) until their outputs are joined.
                steps, rows, _ = x.shape
                gates, hidden = weights[0].shape[0], weights[1].shape[1]
                directions.pending.append(torch.empty(steps, rows, gates, dtype=x.dtype, device=x.device))
                forward_steps = _hiddens(recording, steps - 1, rows, hidden, x)
        if len(outputs) == 1:
            x = outputs[0]
        else:
            projected = torch.empty(steps, rows, gates, dtype=x.dtype, device=x.device)
            reverse_steps = _hiddens(recording, steps - 1, rows, hidden, x)
            x = torch.cat(outputs, -1)
            del projected, forward_steps, reverse_steps
        del outputs
        if call.dropout and call.train and layer < call.num_layers - 1:
            x = torch.dropout(x, call.dropout, True)
    output = x.transpose(0, 1) if call.batch_first else x
    if cxs is None:
        return output, torch.stack(hys)
    return output, torch.stack(hys), torch.stack(cys)


# --- CUDA: cuDNN ---------------------------------------------------------------------------

# What cuDNN's RNN allocates beside its outputs, fitted to one run: an H100 80GB with cuDNN 9.19 and
# torch 2.11.0+cu130 on 2026-11-25 (benchmarks/runs/2026-11-25-h100/: diag2.txt's grid of GRUs and
# LSTMs in float32 and bfloat16, 1 and 2 layers, hidden 128 and 512, 16 and 64 steps, 64 and 1024 rows,
# 32 features, one direction; and the zoo's two-layer GRU and LSTM in eval mode and under bfloat16
# autocast, diag.txt and pytest.log). cuDNN picks its algorithms and their sizes by version and card:
# others may differ.
#
# The reserve a training-mode forward keeps for backward, per row and step, in elements of the call's
# dtype: this many times the hidden size per layer and direction, and each layer's input past the first
# (the layer below's output). Exact on every row of the grid. A plain RNN's (tanh or relu) was not
# measured: taken as its state and one gate, as an LSTM's is its four gates and its cell state.
_RESERVE = {_LSTM: 5, _GRU: 6, _TANH: 2, _RELU: 2}
# The workspace of each call (the forward, in training or eval mode, and both halves of backward, which
# ask cudnnGetRNNTempSpaceSizes for the training size), by algorithm: a fixed part per layer and direction,
# a copy of the weights, and the terms of _Workspace. Within 3.2% of the workspace the grid implies where
# that is 50 MiB or more, and 1.6 MiB where less.
_FIXED_WORKSPACE = 8_570_000  # bytes per layer and direction (fitted: 8.17 MiB)


@dataclass(frozen=True)
class _Workspace:
    """The workspace of one cuDNN algorithm for one kind of cell, beside its fixed part, in elements of the dtype."""

    per_row: float  # per row, layer and direction, times the hidden size
    per_step: float  # per row and step, times the hidden size and the directions: one layer's worth
    padding: float  # per row, step and direction
    deeper: float  # per row, step and direction of each layer past the first, times the hidden size
    eval_less: float  # less per row, step and direction, times the hidden size, for a forward in eval mode


# The standard algorithm: one layer's gates and state over the whole sequence, and a little padding
# (fitted to the grid's hidden 512 rows, and its bfloat16 rows at 128, which take these sizes too).
# In eval mode its workspace was not measured: taken as in training (the persistent algorithm's below
# was never more in eval mode than in training).
_STANDARD = {
    _GRU: _Workspace(per_row=4.8, per_step=_GATES[_GRU] + 1, padding=52, deeper=0, eval_less=0),
    _LSTM: _Workspace(per_row=10.1, per_step=_GATES[_LSTM] + 1, padding=32, deeper=0, eval_less=0),
}
# The persistent algorithm for small hidden sizes (CUDNN_RNN_ALGO_PERSIST_STATIC_SMALL_H), which PyTorch
# picks for hidden sizes up to 192 in the forward and 128 in backward (384 and 256 for a plain RNN): far
# more per step. Fitted to the grid's float32 rows at hidden 128, the only size measured (the terms are
# taken to grow with the hidden size); float16 (what autocast runs cuDNN's RNN in, whatever its dtype)
# matched them in the zoo's autocast rows, bfloat16 did not. In eval mode: the zoo's float32 rows.
_SMALL_HIDDEN = {
    _GRU: _Workspace(per_row=5.6, per_step=18.6, padding=0, deeper=0.82, eval_less=3.31),
    _LSTM: _Workspace(per_row=7.2, per_step=21.5, padding=0, deeper=0, eval_less=0),
}
# A plain RNN's workspace was not measured: taken as the GRU's, but for its one gate's projection.
_STANDARD[_TANH] = _STANDARD[_RELU] = dataclasses.replace(_STANDARD[_GRU], per_step=_GATES[_TANH] + 1)
_SMALL_HIDDEN[_TANH] = _SMALL_HIDDEN[_RELU] = _SMALL_HIDDEN[_GRU]
# PyTorch's choice of the persistent algorithm for small hidden sizes (``use_rnn_persist_small_h``),
# by cell: the largest hidden size in the forward, and in backward.
_SMALL_LIMITS = {_LSTM: (192, 128), _GRU: (192, 128), _TANH: (384, 256), _RELU: (384, 256)}
# The dtypes cuDNN takes weights in one flat buffer of (``torch.backends.cudnn.is_acceptable``):
# ``nn.RNNBase`` flattens its own into one on CUDA. Others (bfloat16) are copied into one at each call.
_FLAT_DTYPES = (torch.float16, torch.float32, torch.float64)


@dataclass(frozen=True)
class _CudnnShape:
    """One ``aten::_cudnn_rnn`` call, as cuDNN's memory depends on it."""

    cell: str
    dtype: torch.dtype  # what cuDNN runs in: float16 under autocast
    steps: int
    rows: int
    hidden: int
    layers: int
    directions: int
    weights: int  # bytes of the weights in one flat buffer, in ``dtype``

    def reserve(self) -> int:
        """Return the bytes a training-mode forward keeps for backward."""
        pieces = self.layers * self.directions * _RESERVE[self.cell] + (self.layers - 1) * self.directions
        return self.steps * self.rows * self.hidden * pieces * self.dtype.itemsize

    def small_hidden(self, forward: bool) -> bool:
        """Return whether cuDNN runs the persistent algorithm for small hidden sizes, as PyTorch picks it."""
        if self.dtype not in (torch.float32, torch.float16):  # float64 never; bfloat16 was measured without it
            return False
        return self.hidden <= _SMALL_LIMITS[self.cell][0 if forward else 1]

    def workspace(self, forward: bool, train: bool) -> int:
        """Return the bytes of cuDNN's workspace during a forward (``forward``) or a backward call."""
        rule = (_SMALL_HIDDEN if self.small_hidden(forward) else _STANDARD)[self.cell]
        hidden, sequences = self.hidden, self.rows * self.directions
        per_step = rule.per_step * hidden + rule.padding + rule.deeper * (self.layers - 1) * hidden
        if forward and not train:
            per_step -= rule.eval_less * hidden
        elements = rule.per_row * self.layers * sequences * hidden + per_step * self.steps * sequences
        fixed = self.layers * self.directions * _FIXED_WORKSPACE + self.weights
        return fixed + round(elements * self.dtype.itemsize)


class _CudnnStack(torch.autograd.Function):
    """A whole recurrent stack as one ``aten::_cudnn_rnn``, as the memory it allocates and frees."""

    # A reserve is kept for backward in training mode (module.train(), with or without autograd).
    # Not measured, taken as the standard algorithm: float16's persistent one for one-layer LSTMs and
    # plain RNNs (hidden a multiple of 128, up to 128 rows). Not counted: cuDNN's process-wide dropout
    # state (about 2 MiB).

    @staticmethod
    def forward(
        ctx: Any,
        call: _Call,
        recording: bool,
        dtype: torch.dtype,
        x: torch.Tensor,
        hx: torch.Tensor,
        cx: torch.Tensor | None,
        *params: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        steps, rows = (x.shape[1], x.shape[0]) if call.batch_first else (x.shape[0], x.shape[1])
        device, hidden = x.device, hx.shape[-1]
        weights = sum(param.numel() for param in params) * dtype.itemsize
        shape = _CudnnShape(call.cell, dtype, steps, rows, hidden, call.num_layers, call.directions, weights)
        time_major = x.transpose(0, 1) if call.batch_first else x
        copy = None if time_major.is_contiguous() else torch.empty(time_major.shape, dtype=x.dtype, device=device)
        output = torch.empty(steps, rows, call.directions * hidden, dtype=dtype, device=device)
        hy = torch.empty(hx.shape, dtype=dtype, device=device)
        cy = None if cx is None else torch.empty(cx.shape, dtype=dtype, device=device)
        # Under autocast (float16 here) the weights come cast already: autocast.py's cache of
        # their casts stands for the real path's flat buffer of float16 weights, made at each call.
        flat = dtype in _FLAT_DTYPES
        weight_copy = None if flat else torch.empty(weights, dtype=torch.uint8, device=device)
        reserve = torch.empty(shape.reserve(), dtype=torch.uint8, device=device) if call.train else None
        _touch(shape.workspace(forward=True, train=call.train), device)
        del copy
        if call.batch_first:
            output = output.transpose(0, 1)
        if not recording:  # nothing keeps them: they go when the call returns
            reserve = weight_copy = None
        ctx.call, ctx.shape, ctx.reserve, ctx.weight_copy = call, shape, reserve, weight_copy
        if recording:
            ctx.save_for_backward(x, hx, cx, output)
        return (output, hy) if cy is None else (output, hy, cy)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        call: _Call = ctx.call
        shape: _CudnnShape = ctx.shape
        x, hx, cx, output = ctx.saved_tensors
        needed = ctx.needs_input_grad
        params = call.params
        if all(grad is None for grad in grads):
            ctx.reserve = ctx.weight_copy = None
            return (None,) * (6 + len(params))
        device = x.device

        def time_major(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.transpose(0, 1) if call.batch_first else tensor

        def copy_unless_contiguous(tensor: torch.Tensor) -> torch.Tensor | None:
            if tensor.is_contiguous():
                return None
            return torch.empty(tensor.shape, dtype=tensor.dtype, device=device)

        # Zeros for the outputs that got no gradient, alive until the call returns.
        grad_output, grad_hy = grads[0], grads[1]
        grad_cy = grads[2] if len(grads) > 2 else None
        if grad_output is None:
            grad_output = torch.empty(output.shape, dtype=output.dtype, device=device)
        if grad_hy is None:
            grad_hy = torch.empty(hx.shape, dtype=shape.dtype, device=device)
        if cx is not None and grad_cy is None:
            grad_cy = torch.empty(cx.shape, dtype=shape.dtype, device=device)
        # The inputs' gradients, always (cuDNN's pass for them also readies the reserve for the weights').
        copies = [copy_unless_contiguous(time_major(x)), copy_unless_contiguous(time_major(grad_output))]
        copies += [copy_unless_contiguous(grad) for grad in (grad_hy, grad_cy) if grad is not None]
        x_grad = torch.empty(time_major(x).shape, dtype=x.dtype, device=device)
        hx_grad = torch.empty(hx.shape, dtype=hx.dtype, device=device)
        cx_grad = None if cx is None else torch.empty(cx.shape, dtype=cx.dtype, device=device)
        _touch(shape.workspace(forward=False, train=True), device)
        del copies
        # The weights' gradients: one flat buffer, handed out as views.
        views: list[torch.Tensor | None] = [None] * len(params)
        if any(needed[6:]):
            copy = copy_unless_contiguous(time_major(x))
            flat = torch.empty(sum(param.numel() for param in params), dtype=params[0].dtype, device=device)
            _touch(shape.workspace(forward=False, train=True), device)
            del copy
            offset = 0
            for index, param in enumerate(params):
                views[index] = flat[offset : offset + param.numel()].view(param.shape)
                offset += param.numel()
            del flat
        ctx.reserve = ctx.weight_copy = None  # autograd lets the saved reserve go once the node has run
        return (
            None,
            None,
            None,
            time_major(x_grad) if needed[3] else None,
            hx_grad if needed[4] else None,
            cx_grad if needed[5] else None,
            *views,
        )


def _cudnn(call: _Call) -> tuple[torch.Tensor, ...]:
    """Run a recurrent stack as cuDNN does, in one call."""
    # Autocast's wrapper of aten::_cudnn_rnn casts to float16 whatever autocast's dtype (its tensors
    # come here cast to that dtype, of the same size), flattening the weights into a new buffer.
    lower = casts_on() and call.input.dtype in (torch.float32, torch.float16, torch.bfloat16)
    call = _cast(call, "_cudnn_rnn")
    dtype = torch.float16 if lower else call.input.dtype
    recording = _recording(call.input, call.hx, call.cx, *call.params)
    results: tuple[torch.Tensor, ...] = _CudnnStack.apply(  # type: ignore[no-untyped-call]
        call, recording, dtype, call.input, call.hx, call.cx, *call.params
    )
    return results


# --- the mode -----------------------------------------------------------------------------


class RecurrentKernels(TorchFunctionMode):
    """Run ``torch._VF``'s recurrent layers on meta tensors with the memory of the target device's kernels."""

    def __init__(self, device: torch.device, note: Callable[[str, str], None] | None = None) -> None:
        super().__init__()
        self.device = device
        self.note = note

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        cell = _CELLS.get(func)
        if cell is None:
            return func(*args, **(kwargs or {}))
        call = None if kwargs else _parse(cell, args)
        kind = self.device.type
        if call is None or kind not in ("cpu", "cuda") or (kind == "cuda" and not torch.backends.cudnn.enabled):
            self._note(cell, _UNMODELLED if call is None else _ELSEWHERE.format(device=kind))
            return func(*args, **(kwargs or {}))
        if kind == "cuda":
            self._note(cell, _CUDNN)
            if cell in (_TANH, _RELU) or call.bidirectional:
                self._note(cell, _CUDNN_UNMEASURED)
            return _cudnn(call)
        if call.cx is not None and _onednn_usable(call):
            if casts_on():  # autocast casts each layer's aten::mkldnn_rnn_layer, in the dispatcher
                self._note(cell, _ONEDNN_LOWER)
            if call.bidirectional:
                self._note(cell, _ONEDNN_TWO_WAYS)
            return _onednn_lstm(call, call.cx)
        if casts_on():
            self._note(cell, _MIXED)
        return _generic(call)

    def _note(self, cell: str, why: str) -> None:
        if self.note is not None:
            self.note(f"torch.nn.{_MODULES[cell]}", why)


def _cast(call: _Call, op_name: str) -> _Call:
    """Return the call with its tensors as autocast passes them to the device's kernel ``op_name``."""
    x, hx, cx, *params = cast_as(op_name, call.input, call.hx, call.cx, *call.params)
    return dataclasses.replace(call, input=x, hx=hx, cx=cx, params=params)


_MODULES = {_LSTM: "LSTM", _GRU: "GRU", _TANH: "RNN", _RELU: "RNN"}
_UNMODELLED = (
    "a packed sequence, or an LSTM with projections, runs cell by cell on meta tensors, not as the device's "
    "kernel does: the estimate may be below or above the real peak"
)
_ELSEWHERE = (
    "on {device} the estimate counts PyTorch's cell-by-cell path, not the device's kernel: it may be below or "
    "above the real peak"
)
_ONEDNN_LOWER = (
    "under autocast oneDNN's workspace is taken to shrink with the lower precision's element size, which was not "
    "measured: the estimate may be below or above the real peak"
)
_ONEDNN_TWO_WAYS = (
    "oneDNN's memory for two directions is counted as two one-direction layers, and real CPU runs hold more, not "
    "modelled: up to 50% above the estimate without autograd and 15% with it (one and two layers, measured "
    "2026-11-30): the estimate may be below the real peak"
)
_MIXED = (
    "under autocast the CPU runs its cells in mixed precision (products in the lower one, states in float32), "
    "which is counted in float32: the estimate may be above the real peak"
)
_CUDNN = (
    "cuDNN's reserve and workspace on CUDA follow rules fitted to one H100 run's grid (cuDNN 9.19, torch 2.11), "
    "unverified on other cards and cuDNN versions, which may choose other algorithms and sizes: the estimate may "
    'be below or above the real peak; initial="auto" calibrates on the device and corrects it'
)
_CUDNN_UNMEASURED = (
    "cuDNN's memory for plain RNNs and for two directions was not measured: its rules are extended from those of "
    "one-direction GRUs and LSTMs, and the estimate may be below or above the real peak"
)


def recurrent_kernels(
    device: torch.device, modules: Iterable[torch.nn.Module], note: Callable[[str, str], None] | None = None
) -> contextlib.AbstractContextManager[object]:
    """Return a context in which recurrent layers have the memory of ``device``'s kernels."""
    # Without an nn.RNNBase no mode is entered, so the call's other operators pay nothing.
    if device.type == "meta" or not any(isinstance(module, torch.nn.RNNBase) for module in modules):
        return contextlib.nullcontext()
    return RecurrentKernels(device, note)
