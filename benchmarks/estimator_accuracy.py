"""Measure how close ``koila.estimate`` comes to the true peak memory of a forward or a training step on the CPU.

A zoo of small but real models, each in two modes, at three or four batch sizes (``ZOO`` lists them;
the largest peaks are 40 to 630 MiB), the transformer, LSTM and GRU each at dropout 0 and 0.1:

- MLP: 512 -> 1024 -> 1024 -> 10, ReLU;
- CNN: three 3x3 convolutions (32, 64, 128 channels) with ReLU, two 2x2 max-poolings, global average
  pooling and a linear head, on images of 3x32x32;
- ResNet: a 3x3 stem and six basic blocks (two convolutions, ``BatchNorm2d``, in-place ReLU, a skip
  connection, 1x1 projections where the shape changes) in three stages of 16, 32 and 64 channels, on
  images of 3x32x32;
- transformer: ``nn.TransformerEncoder`` of four layers of width 256 (8 heads, feed-forward 1024, the
  default dropout of 0.1, ``batch_first=True``) over sequences of 64 vectors, mean-pooled into a linear head;
  ``transformer-dropout0`` is the same without dropout;
- LSTM: ``nn.LSTM(32, 128, num_layers=2, batch_first=True)`` over sequences of 64 steps, its last hidden
  state into a linear head; ``lstm-dropout0.1`` drops 0.1 of the first layer's outputs in training;
- GRU: the same with ``nn.GRU``, and ``gru-dropout0.1``;
- attention: token ids (a vocabulary of 10,000) into ``nn.Embedding`` of width 256 plus learned positions,
  one ``nn.MultiheadAttention`` (8 heads, its default ``need_weights=True``), a residual ``LayerNorm``,
  mean-pooled into a linear head; its inputs are integers;
- with ``transformers`` installed, Hugging Face GPT-2 and BERT over 128 tokens and ViT over 3x32x32
  images, two layers of width 128 from small configs (nothing downloaded), at dropout 0 and 0.1.

Three of them reach fused CPU kernels that allocate inside themselves, where no tensor operator shows
it: ``aten::mkldnn_rnn_layer`` (the LSTM, both modes), and, under ``no_grad`` in eval mode, PyTorch's
fast paths ``aten::_transformer_encoder_layer_fwd`` and ``aten::_native_multi_head_attention``. The
LSTM's training forward also returns a oneDNN workspace of which the forward pass writes only about a
third (61.1 MiB per layer at batch 128, 20.4 MiB resident) and backward most of the rest: the truth,
which counts resident pages, sees what is written when it is written. The GRU runs PyTorch's own
cells, after one product for the whole sequence's inputs: each step's tensors, a row of 128 floats
per sample, are below glibc's threshold for their own pages under 256 rows, and come from heap memory
that the warm-up step freed and the process kept resident, which the rise does not see. Its batch
sizes start at 256.

The modes: ``train`` is the step ``opt.zero_grad(set_to_none=True); loss = cross_entropy(model(x), y);
loss.backward(); opt.step()`` with ``AdamW``, measured after one warm-up step, so that the gradients and
the optimizer's state exist when it starts; ``infer`` is ``model(x)`` under ``torch.no_grad()`` after
``model.eval()``, measured after one warm-up forward. :func:`build` makes both, with fixed seeds.

The truth is measured in a child process per (model, mode, batch size), with
``MALLOC_MMAP_THRESHOLD_=65536`` so that glibc gives every block of 64 KiB or more back to the system
when it is freed: after the warm-up and ``gc.collect()``, the child writes 5 to ``/proc/self/clear_refs``
(which resets the high-water mark of its resident set), reads ``VmRSS`` from ``/proc/self/status``, runs
the step once and reads ``VmHWM``. The true peak is the bytes of the tensors the step can see before it
starts (parameters, buffers, gradients, the optimizer's state and the inputs, each storage once) plus the
rise ``VmHWM - VmRSS``, the smallest of a few repetitions in the same child (5; 2 with ``--quick``). On
the smallest cases the rises of one child differ by up to 0.3 MiB, and the smallest of three once put
the ResNet's 11 MiB training step 0.2 MiB high. The
"spread" column is the largest rise less the smallest: how noisy the truth is.

The estimate runs in this process, on the same model, inputs and optimizer state (same seeds, after the
same warm-up): ``koila.estimate(step, *inputs).peak(batch)``, with inputs of ``batch`` rows. Until
koila-retry has ``estimate``, or with ``--estimator tensors``, a stand-in counts instead the bytes of the
live tensor storages while the real step runs, under a ``TorchDispatchMode`` (the peak of what PyTorch's
operators hold, without what a kernel allocates inside itself): the gap between it and the truth says how
much of the truth is not tensors.

Every row gives the true and the estimated peak, the relative error ``estimate / truth - 1`` and the
activations' share of the truth, ``(truth - static) / truth``, where static is the parameters, buffers,
gradients and optimizer state before the step (the inputs count with the activations). The summary
gives, per model and mode, the median and the worst absolute error over the batch sizes whose
activations' share is at least 50%: below that, the estimate mostly restates the model's size. The
targets, from the estimator-fidelity issue: a median of at most 2% over every counted row of the zoo, a
worst of at most 5%, never more than 2% under the truth at any batch size (counted or not), and every
estimate in under 1 s. The summary also gives each model's and mode's own median. Both
processes use 2 threads (``torch.set_num_threads(2)``; ``--threads`` changes it). The slowest estimate is
named at the end, with the estimate's own ``seconds`` next to the time of the call.

Run it with::

    python benchmarks/estimator_accuracy.py --quick   # one batch size per model and mode, about 2 minutes
    python benchmarks/estimator_accuracy.py --rst     # the tables for docs/performance.rst
    python benchmarks/estimator_accuracy.py --help

Only on Linux (it reads ``/proc``). The exit status is 0 whether or not the targets are met; the verdict
is printed. A test can import :func:`build` and :func:`measure_true_peak` to check one small case.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from common import percent, print_rst, print_text, version_of  # the script's own folder is on sys.path
from torch import nn
from torch.nn import functional
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

TARGET_MEDIAN = 0.02  # the median absolute relative error, over the batch sizes counted
TARGET_WORST = 0.05  # the worst absolute relative error, over the batch sizes counted
TARGET_UNDER = 0.02  # the most any estimate may be under the truth, at every batch size
TARGET_SECONDS = 1.0  # every estimate in the zoo
MIN_SHARE = 0.5  # the activations' share of the true peak from which a batch size counts
THREADS = 2
MMAP_THRESHOLD = 65536  # bytes; glibc serves blocks from this size up with mmap and unmaps them when freed
MIB = 2**20
MODES = ("train", "infer")


# The zoo ----------------------------------------------------------------------------------------


class BasicBlock(nn.Module):
    """A ResNet basic block: two 3x3 convolutions with batch norm, and a skip connection."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        activations: torch.Tensor = self.relu(out + self.shortcut(x))
        return activations


class ResNet(nn.Module):
    """A small ResNet for 32x32 images: a stem and three stages of two basic blocks."""

    def __init__(self, widths: tuple[int, ...] = (16, 32, 64), classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU())
        blocks: list[nn.Module] = []
        cin = widths[0]
        for number, width in enumerate(widths):
            stride = 1 if number == 0 else 2
            blocks += [BasicBlock(cin, width, stride), BasicBlock(width, width, 1)]
            cin = width
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(functional.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1).flatten(1))
        return logits


class Transformer(nn.Module):
    """Four ``nn.TransformerEncoderLayer`` of width 256 over sequences of vectors, mean-pooled into a head."""

    def __init__(self, width: int = 256, layers: int = 4, classes: int = 10, dropout: float = 0.1) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(width, 8, 4 * width, dropout=dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(self.encoder(x).mean(1))
        return logits


class Recurrent(nn.Module):
    """A two-layer LSTM (or GRU) over a sequence; its last hidden state classifies the sequence."""

    def __init__(
        self,
        features: int = 32,
        hidden: int = 128,
        classes: int = 10,
        kind: type[nn.LSTM | nn.GRU] = nn.LSTM,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.rnn = kind(features, hidden, num_layers=2, dropout=dropout, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, state = self.rnn(x)
        hidden = state[0] if isinstance(state, tuple) else state  # an LSTM's is (hidden, cell)
        logits: torch.Tensor = self.head(hidden[-1])
        return logits


class Attention(nn.Module):
    """Token ids into an embedding with learned positions, one multi-head self-attention, mean-pooled."""

    def __init__(self, vocabulary: int = 10_000, length: int = 128, width: int = 256, classes: int = 10) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, width)
        self.position = nn.Parameter(torch.randn(length, width) * 0.02)
        self.attention = nn.MultiheadAttention(width, 8, dropout=0.1, batch_first=True)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embedding(tokens) + self.position
        attended, _ = self.attention(h, h, h)
        logits: torch.Tensor = self.head(self.norm(h + attended).mean(1))
        return logits


class HuggingFace(nn.Module):
    """A Hugging Face GPT-2, BERT or ViT body from a small config (nothing downloaded), mean-pooled into a head.

    ``transformers`` is imported when one is made, so that the rest of the zoo runs without it.
    """

    def __init__(self, kind: str, dropout: float, width: int = 128, classes: int = 10) -> None:
        super().__init__()
        import transformers

        common = {"num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 4 * width}
        rates = {"hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout}
        self.body: nn.Module
        if kind == "gpt2":
            self.body = transformers.GPT2Model(
                transformers.GPT2Config(
                    vocab_size=10_000,
                    n_positions=128,
                    n_embd=width,
                    n_layer=2,
                    n_head=4,
                    resid_pdrop=dropout,
                    embd_pdrop=dropout,
                    attn_pdrop=dropout,
                    use_cache=False,  # as in training; a cache would hold every layer's keys and values
                )
            )
        elif kind == "bert":
            config = transformers.BertConfig(
                vocab_size=10_000, hidden_size=width, max_position_embeddings=128, **common, **rates
            )
            self.body = transformers.BertModel(config, add_pooling_layer=False)
        else:
            config = transformers.ViTConfig(
                image_size=32, patch_size=4, num_channels=3, hidden_size=width, **common, **rates
            )
            self.body = transformers.ViTModel(config, add_pooling_layer=False)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(self.body(x).last_hidden_state.mean(1))
        return logits


def _tokens(rows: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 10_000, (rows, 128), generator=generator)


@dataclass(frozen=True)
class Spec:
    """One model of the zoo: how to make it, how to make ``rows`` inputs, and its batch sizes."""

    name: str
    model: Callable[[], nn.Module]
    inputs: Callable[[int, torch.Generator], torch.Tensor]
    train: tuple[int, ...]  # the batch sizes of the full run, in train mode
    infer: tuple[int, ...]  # and in infer mode
    description: str

    def batches(self, mode: str, quick: bool) -> tuple[int, ...]:
        """The batch sizes of the full run, or for --quick the one below the largest."""
        batches: tuple[int, ...] = getattr(self, mode)
        return batches[-2:-1] if quick else batches


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(128, 10),
    )


def _vectors(rows: int, generator: torch.Generator) -> torch.Tensor:
    """Sequences of 64 vectors of width 256, the transformers' inputs."""
    return torch.randn(rows, 64, 256, generator=generator)


def _steps(rows: int, generator: torch.Generator) -> torch.Tensor:
    """Sequences of 64 steps of 32 features, the recurrent nets' inputs."""
    return torch.randn(rows, 64, 32, generator=generator)


def _images(rows: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(rows, 3, 32, 32, generator=generator)


ZOO: dict[str, Spec] = {
    spec.name: spec
    for spec in (
        Spec(
            "mlp",
            lambda: nn.Sequential(
                nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
            ),
            lambda rows, generator: torch.randn(rows, 512, generator=generator),
            (1024, 2048, 4096, 8192),
            (1024, 2048, 4096, 8192),
            "MLP 512-1024-1024-10",
        ),
        Spec("cnn", _cnn, _images, (32, 64, 128, 256), (32, 64, 128, 256), "CNN 32-64-128 channels, 3x32x32"),
        Spec(
            "resnet",
            ResNet,
            _images,
            (8, 16, 32, 64),
            (16, 32, 64, 128),
            "ResNet, 6 basic blocks of 16-32-64 channels, 3x32x32",
        ),
        Spec(
            "transformer",
            Transformer,
            _vectors,
            (4, 8, 16),
            (16, 32, 64),
            "TransformerEncoder, 4 layers of width 256, 64 positions",
        ),
        Spec(
            "transformer-dropout0",
            functools.partial(Transformer, dropout=0.0),
            _vectors,
            (4, 8, 16),
            (16, 32, 64),
            "TransformerEncoder, 4 layers of width 256, 64 positions, dropout 0",
        ),
        Spec(
            "lstm",
            Recurrent,
            _steps,
            (32, 64, 128, 256),
            (32, 64, 128, 256),
            "LSTM 32-128, 2 layers, 64 steps",
        ),
        Spec(
            "gru",
            lambda: Recurrent(kind=nn.GRU),
            _steps,
            (256, 512, 1024),  # from 256 rows up, each step's tensors are large enough for the truth to see
            (256, 512, 1024),
            "GRU 32-128, 2 layers, 64 steps",
        ),
        Spec(
            "lstm-dropout0.1",
            functools.partial(Recurrent, dropout=0.1),
            _steps,
            (32, 64, 128, 256),
            (32, 64, 128, 256),
            "LSTM 32-128, 2 layers, 64 steps, dropout 0.1 between the layers",
        ),
        Spec(
            "gru-dropout0.1",
            functools.partial(Recurrent, kind=nn.GRU, dropout=0.1),
            _steps,
            (256, 512, 1024),
            (256, 512, 1024),
            "GRU 32-128, 2 layers, 64 steps, dropout 0.1 between the layers",
        ),
        *(
            Spec(
                f"{kind}-dropout{rate:g}",
                functools.partial(HuggingFace, kind, rate),
                _images if kind == "vit" else _tokens,
                (8, 16, 32),
                (16, 32, 64),
                f"Hugging Face {name} (transformers), 2 layers of width 128, dropout {rate:g}",
            )
            for kind, name in (("gpt2", "GPT-2, 128 tokens"), ("bert", "BERT, 128 tokens"), ("vit", "ViT, 3x32x32"))
            for rate in (0.0, 0.1)
            if importlib.util.find_spec("transformers") is not None  # an optional peer: without it, left out
        ),
        Spec(
            "attention",
            Attention,
            lambda rows, generator: torch.randint(0, 10_000, (rows, 128), generator=generator),
            (8, 16, 32, 64),
            (8, 16, 32, 64),
            "Embedding 10k x 256 + MultiheadAttention, 128 tokens",
        ),
    )
}


@dataclass
class Case:
    """A model, its optimizer (None for ``infer``), its inputs and the step that :func:`build` returns."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    step: Callable[..., Any]
    args: tuple[torch.Tensor, ...]


def make_case(model_name: str, mode: str, batch: int) -> Case:
    """Make a :class:`Case` with fixed seeds and run its step once, as a warm-up."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    spec = ZOO[model_name]
    torch.manual_seed(0)
    model = spec.model()
    generator = torch.Generator().manual_seed(1)
    x = spec.inputs(batch, generator)
    if mode == "infer":
        model.eval()

        def infer(x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                out: torch.Tensor = model(x)
                return out

        infer(x)
        return Case(model, None, infer, (x,))
    y = torch.randint(0, 10, (batch,), generator=generator)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = functional.cross_entropy

    def train(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch
        opt.step()
        return loss.detach()

    train(x, y)
    return Case(model, opt, train, (x, y))


def build(model_name: str, mode: str, batch: int) -> tuple[Callable[..., Any], tuple[torch.Tensor, ...]]:
    """Return the step of ``model_name`` in ``mode`` (``"train"`` or ``"infer"``) and its inputs of ``batch`` rows.

    The step has run once already (the warm-up): a training step's gradients and ``AdamW`` state exist.
    """
    case = make_case(model_name, mode, batch)
    return case.step, case.args


# The truth, in a child process --------------------------------------------------------------------


def storage_bytes(tensors: Iterable[torch.Tensor], seen: set[int] | None = None) -> int:
    """Return the bytes of the storages under ``tensors``, each once (``seen`` holds the data pointers counted)."""
    seen = set() if seen is None else seen
    total = 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def static_tensors(case: Case) -> list[torch.Tensor]:
    """The tensors of the model and its optimizer: parameters, buffers, gradients and optimizer state."""
    tensors = [*case.model.parameters(), *case.model.buffers()]
    tensors += [p.grad for p in case.model.parameters() if p.grad is not None]
    if case.optimizer is not None:
        for state in case.optimizer.state.values():
            tensors += [value for value in state.values() if isinstance(value, torch.Tensor)]
    return tensors


def _status(field_name: str) -> int:
    """Return a field of ``/proc/self/status`` in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"no {field_name} in /proc/self/status")


def _reset_high_water_mark() -> None:
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def child(model_name: str, mode: str, batch: int, repeats: int, threads: int) -> dict[str, Any]:
    """Measure the true peak of one case in this process; run by the parent in a fresh child process."""
    torch.set_num_threads(threads)
    case = make_case(model_name, mode, batch)
    seen: set[int] = set()
    static = storage_bytes(static_tensors(case), seen)
    inputs = storage_bytes(case.args, seen)
    rises, seconds = [], []
    for _ in range(repeats):
        gc.collect()
        _reset_high_water_mark()
        before = _status("VmRSS")
        start = time.perf_counter()
        out = case.step(*case.args)
        seconds.append(time.perf_counter() - start)
        rises.append(_status("VmHWM") - before)
        del out
    return {
        "model": model_name,
        "mode": mode,
        "batch": batch,
        "static": static,
        "inputs": inputs,
        "rises": rises,
        "true_peak": static + inputs + min(rises),
        "seconds": min(seconds),
        "threads": torch.get_num_threads(),
    }


def measure_truth(model_name: str, mode: str, batch: int, repeats: int = 3, threads: int = THREADS) -> dict[str, Any]:
    """Run :func:`child` in a fresh process and return what it measured (the true peak in ``"true_peak"``)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
    command = [sys.executable, os.path.abspath(__file__), "--child", model_name, mode, str(batch)]
    command += ["--repeats", str(repeats), "--threads", str(threads)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the child for {model_name} {mode} {batch} failed:\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def measure_true_peak(model_name: str, mode: str, batch: int, repeats: int = 3, threads: int = THREADS) -> int:
    """Return the true peak bytes of one case, measured in a fresh child process (see the module's docstring)."""
    return int(measure_truth(model_name, mode, batch, repeats, threads)["true_peak"])


# The estimate --------------------------------------------------------------------------------------


class LiveTensors(TorchDispatchMode):  # type: ignore[no-untyped-call]  # TorchDispatchMode is unannotated in torch
    """Count the bytes of live tensor storages while real operators run, and keep their peak.

    The stand-in for ``koila.estimate``: it runs the step for real, so what a kernel allocates inside
    itself, and what is not a tensor, is not counted.
    """

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # TorchDispatchMode is unannotated in torch
        self.live = 0
        self.peak = 0
        self.counted: set[int] = set()
        for tensor in tensors:
            self._track(tensor)

    def _free(self, pointer: int, nbytes: int) -> None:
        self.counted.discard(pointer)
        self.live -= nbytes

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer in self.counted or storage.nbytes() == 0:
            return
        self.counted.add(pointer)
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, pointer, storage.nbytes())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu":
                self._track(leaf)
        return out


@dataclass
class Estimate:
    peak: int  # bytes; 0 if the estimate failed
    seconds: float  # the time the estimate took, as it says
    wall: float = float("nan")  # the time the call took, on this process's clock
    failure: str = ""  # the exception, if the estimate raised one


def estimate_with_koila(case: Case, batch: int) -> Estimate:
    import koila_retry as koila

    start = time.perf_counter()
    result = koila.estimate(case.step, *case.args)
    wall = time.perf_counter() - start
    return Estimate(int(result.peak(batch)), float(result.seconds), wall)


def estimate_with_tensors(case: Case, batch: int) -> Estimate:
    start = time.perf_counter()
    gc.collect()
    tracker = LiveTensors([*static_tensors(case), *case.args])
    with tracker:
        out = case.step(*case.args)
    del out
    seconds = time.perf_counter() - start
    return Estimate(tracker.peak, seconds, seconds)


ESTIMATORS: dict[str, Callable[[Case, int], Estimate]] = {
    "koila": estimate_with_koila,
    "tensors": estimate_with_tensors,
}


def koila_has_estimate() -> bool:
    import koila_retry as koila

    return hasattr(koila, "estimate")


# The run -------------------------------------------------------------------------------------------


@dataclass
class Row:
    model: str
    mode: str
    batch: int
    truth: dict[str, Any]
    estimate: Estimate

    @property
    def true_peak(self) -> int:
        return int(self.truth["true_peak"])

    @property
    def error(self) -> float:
        return float("inf") if self.estimate.failure else self.estimate.peak / self.true_peak - 1

    @property
    def share(self) -> float:
        static: int = self.truth["static"]
        return (self.true_peak - static) / self.true_peak

    @property
    def spread(self) -> int:
        return int(max(self.truth["rises"]) - min(self.truth["rises"]))


@dataclass
class Summary:
    model: str
    mode: str
    errors: list[float] = field(default_factory=list)  # absolute, over the batch sizes counted
    lowest: float = float("inf")  # the most under (signed), over every batch size

    @property
    def met(self) -> bool | None:
        """Whether this model and mode keeps to the per-row targets (the median is the zoo's, over every row)."""
        if not self.errors:
            return None
        return max(self.errors) <= TARGET_WORST and self.lowest >= -TARGET_UNDER


def mib(nbytes: float) -> str:
    return f"{nbytes / MIB:,.1f}"


def detail_table(rows: list[Row], every_row: bool = False) -> tuple[list[str], list[list[str]]]:
    """The table of every batch size; the model and mode on the first row of each, or on ``every_row``."""
    header = [
        "model",
        "mode",
        "batch",
        "static MiB",
        "inputs MiB",
        "true MiB",
        "spread MiB",
        "estimated MiB",
        "error",
        "act. share",
        "estimate took",
    ]
    table, previous = [], ("", "")
    for row in rows:
        first = every_row or (row.model, row.mode) != previous
        previous = (row.model, row.mode)
        table.append(
            [
                row.model if first else "",
                row.mode if first else "",
                str(row.batch),
                mib(row.truth["static"]),
                mib(row.truth["inputs"]),
                mib(row.true_peak),
                mib(row.spread),
                "failed" if row.estimate.failure else mib(row.estimate.peak),
                "" if row.estimate.failure else percent(row.estimate.peak / row.true_peak),
                f"{row.share:.0%}" + ("" if row.share >= MIN_SHARE else " (-)"),
                "" if row.estimate.failure else f"{row.estimate.seconds:.2f} s",
            ]
        )
    return header, table


def summaries(rows: list[Row]) -> list[Summary]:
    found: dict[tuple[str, str], Summary] = {}
    for row in rows:
        summary = found.setdefault((row.model, row.mode), Summary(row.model, row.mode))
        summary.lowest = min(summary.lowest, row.error)
        if row.share >= MIN_SHARE:
            summary.errors.append(abs(row.error))
    return list(found.values())


def summary_table(found: list[Summary], rows: list[Row]) -> tuple[list[str], list[list[str]]]:
    header = ["model", "mode", "batches counted", "median abs. error", "worst abs. error", "lowest", "target", "met"]
    table = []
    for summary in found:
        counted = [
            str(row.batch)
            for row in rows
            if (row.model, row.mode) == (summary.model, summary.mode) and row.share >= MIN_SHARE
        ]
        errors = summary.errors
        table.append(
            [
                summary.model,
                summary.mode,
                ", ".join(counted) or "none",
                f"{statistics.median(errors):.1%}" if errors else "",
                f"{max(errors):.1%}" if errors else "",
                percent(summary.lowest + 1),
                f"worst <= {TARGET_WORST:.0%}, lowest >= -{TARGET_UNDER:.0%}",
                {True: "yes", False: "NO", None: "n/a"}[summary.met],
            ]
        )
    return header, table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="one batch size per model and mode, 2 repetitions of the truth"
    )
    parser.add_argument("--rst", action="store_true", help="also print the tables as reStructuredText csv-tables")
    parser.add_argument("--models", nargs="+", choices=sorted(ZOO), help="only these models (default: all)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="only these modes")
    parser.add_argument("--repeats", type=int, help="repetitions of the step in each child (default 5; 2 with --quick)")
    parser.add_argument("--threads", type=int, default=THREADS, help=f"torch threads, here and in children ({THREADS})")
    parser.add_argument(
        "--estimator",
        choices=("auto", *ESTIMATORS),
        default="auto",
        help="koila: koila.estimate; tensors: the stand-in that counts live tensors of the real step; "
        "auto (default): koila when koila_retry has estimate, else tensors",
    )
    # Accepted for tox -e bench, which passes the same options to every benchmark; nothing here uses them.
    parser.add_argument("--no-peers", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--child", nargs=3, metavar=("MODEL", "MODE", "BATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 2 if args.quick else 5
    if args.repeats < 1 or args.threads < 1:
        parser.error("--repeats and --threads must be >= 1")

    if args.child:
        model_name, mode, batch = args.child
        print(json.dumps(child(model_name, mode, int(batch), args.repeats, args.threads)))
        return 0

    began = time.perf_counter()
    torch.set_num_threads(args.threads)
    import koila_retry as koila

    notes = []
    estimator = args.estimator
    if estimator == "auto":
        estimator = "koila" if koila_has_estimate() else "tensors"
        if estimator == "tensors":
            notes.append(
                "koila_retry has no estimate(): the estimates are the stand-in's (live tensors of the real step)"
            )
    elif estimator == "koila" and not koila_has_estimate():
        parser.error("koila_retry has no estimate() (yet)")
    estimate = ESTIMATORS[estimator]
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print("command: " + " ".join(["python", *sys.argv]))
    print(f"Python {platform.python_version()} on {platform.machine()} {platform.system()}, {os.cpu_count()} CPUs")
    print(
        f"torch {torch.__version__} ({torch.get_num_threads()} threads, here and in every child), "
        f"koila-retry {koila.__version__} ({version_of('koila-retry')} installed)"
    )
    print(
        f"estimator: {'koila.estimate(step, *inputs).peak(batch)' if estimator == 'koila' else 'live tensors'}; "
        f"truth: {args.repeats} repetitions per child, MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}"
    )
    if load is not None:
        print("load average before the run: " + ", ".join(f"{value:.2f}" for value in load))
    for note in notes:
        print(f"note: {note}")

    rows: list[Row] = []
    shown = len(notes)
    for name in args.models or list(ZOO):
        spec = ZOO[name]
        for mode in args.modes:
            batches = spec.batches(mode, args.quick)
            start = time.perf_counter()
            for batch in batches:
                truth = measure_truth(name, mode, batch, args.repeats, args.threads)
                case = make_case(name, mode, batch)
                try:
                    guess = estimate(case, batch)
                except Exception as error:  # one failed estimate is a result too; the run goes on
                    guess = Estimate(0, float("nan"), failure=f"{type(error).__name__}: {error}".splitlines()[0][:200])
                    notes.append(f"the estimate of {name} {mode} at batch {batch} failed: {guess.failure}")
                del case
                rows.append(Row(name, mode, batch, truth, guess))
            took = time.perf_counter() - start
            sizes = ", ".join(map(str, batches))
            print(f"  {name} {mode}: batches {sizes} in {took:.0f} s", file=sys.stderr, flush=True)

    header, table = detail_table(rows)
    print("\nPeak memory per batch size:")
    print_text(header, table)
    print(
        "static: parameters, buffers, gradients and optimizer state before the step; true: static + inputs + the\n"
        "smallest rise of VmHWM over VmRSS during the step; spread: the largest rise - the smallest;\n"
        "error: estimated / true - 1; act. share: (true - static) / true, (-) where under 50%: not counted below;\n"
        "estimate took: the estimate's own seconds"
    )
    for note in notes[shown:]:
        print(f"note: {note}")
    found = summaries(rows)
    summary_header, summary = summary_table(found, rows)
    print("\nSummary (batch sizes whose activations are at least half the true peak):")
    print_text(summary_header, summary)
    counted = [error for item in found for error in item.errors]
    median = statistics.median(counted) if counted else None
    if median is not None:
        print(
            f"over all {len(counted)} counted rows: median |error| {median:.1%} (target <= {TARGET_MEDIAN:.0%}), "
            f"worst {max(counted):.1%}"
        )
    if args.rst:
        print()
        print_rst(*detail_table(rows, every_row=True), "Estimated and true peak memory")
        print()
        print_rst(summary_header, summary, "koila.estimate against the targets")

    print()
    timed = [row for row in rows if not row.estimate.failure]
    if timed:
        slowest = max(timed, key=lambda row: row.estimate.seconds)
        verdict = "meets" if slowest.estimate.seconds < TARGET_SECONDS else "does NOT meet"
        print(
            f"The slowest estimate, {slowest.model} {slowest.mode} at batch {slowest.batch}: "
            f"{slowest.estimate.seconds:.2f} s as it says, {slowest.estimate.wall:.2f} s for the call "
            f"({verdict} the target of < {TARGET_SECONDS:.0f} s for every estimate)"
        )
    if load is not None:
        print("load average after the run: " + ", ".join(f"{value:.2f}" for value in os.getloadavg()))
    print(f"the run took {time.perf_counter() - began:.0f} s")
    print(
        f"Targets: over every counted row, a median |error| of at most {TARGET_MEDIAN:.0%}; per model and mode, "
        f"a worst of at most {TARGET_WORST:.0%} over the rows counted, and never more than {TARGET_UNDER:.0%} under "
        "at any batch size."
    )
    missed = [f"{item.model} {item.mode}" for item in found if item.met is False]
    if median is not None and median > TARGET_MEDIAN:
        missed.append(f"the median over every counted row, {median:.1%}")
    unmeasured = [f"{item.model} {item.mode}" for item in found if item.met is None]
    verdict = "does NOT meet" if missed else "meets"
    print(
        f"Measured: {'koila.estimate' if estimator == 'koila' else 'the stand-in'} {verdict} them"
        + (f" (missed: {'; '.join(missed)})" if missed else "")
        + (f" (nothing counted for: {'; '.join(unmeasured)})" if unmeasured else "")
        + "."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
