"""Measure koila-retry on a CUDA GPU: the estimate against the allocator's peak, and what the front ends cost.

It ran once, on an H100 on 2026-11-25: docs/gpu.rst has the results. Two parts, each printed as a table.

**Accuracy.** ``koila.estimate(step, *args).peak(batch)`` next to the peak that
``torch.cuda.max_memory_allocated`` reports for the same step, over a zoo of models, each
as a training step (``AdamW``, measured after one warm-up step, so gradients and the
optimizer's state exist) and as inference (``eval()`` and ``no_grad``):

- MLP 512-1024-1024-10, a ResNet of six basic blocks on 3x32x32 images,
  ``nn.TransformerEncoder`` of four layers of width 256 over 64 positions and a two-layer
  ``nn.LSTM`` over 64 steps: the models of ``benchmarks/estimator_accuracy.py``;
- a two-layer ``nn.GRU`` of the same sizes as the LSTM;
- Hugging Face GPT-2, BERT and ViT from small configs (two layers of width 128, 64 tokens
  or 8x8 patches; ``attn_implementation="sdpa"``; no download), when ``transformers`` is
  installed;

each in float32 and under ``torch.autocast`` with bfloat16, and each model that attends,
under every fused kernel of ``torch.nn.attention.sdpa_kernel`` that takes its dtype:
memory-efficient attention in float32, flash and memory-efficient attention in bfloat16.
The truth is the allocator's peak during the step less what was allocated before the
model was built; the CUDA libraries' own workspaces, which live as long as the process,
are made by a run of the same case before that. The table also gives, apart from the
target, the peak that the caching allocator reserved from the driver during the step
and the fragmentation, the share of the reserved peak that no tensor used at the
allocated peak (``1 - allocated / reserved``). The targets, from the issue that asked
for this suite: a median absolute error of at most 3% and a worst of at most 8%.
``tests/test_cuda_estimate.py`` imports :func:`variants`, :func:`measure` and
:func:`verdict` from here and checks the targets, on CUDA and on a CPU stand-in.

**Speed.** On an MLP (1024 -> 4096 -> 4096 -> 10, GELU) over a batch of 4,096 rows,
three settings, each timed side by side with its baseline in interleaved
rounds (every round times a block of steps of each candidate, with
``torch.cuda.synchronize()`` before reading the clock), reported as the median over rounds
of the ratio to the baseline:

- ``@koila.accumulate`` when the whole batch fits, next to the plain step
  ``loss_fn(model(x), y).backward()``; target: at most 1% slower (issue 40's target on a
  GPU; 2% before it);
- ``@koila.accumulate(initial=m)``, split into k = 2, 4 and 8 micro-batches, next to a
  hand-written accumulation loop at the same ``m``; target: at least 97% of its
  throughput (issue 40; 95% before it);
- ``@koila.batch`` on its happy path (an inference pass at the size its cache
  remembers), next to the same function called with that size.

Every call of a koila candidate is checked to stay on its happy path (no out-of-memory
error, the intended micro-batch size).

Run it on a machine with a CUDA device::

    python benchmarks/gpu.py                        # both parts
    python benchmarks/gpu.py --quick                # fewer rounds, fewer cases
    python benchmarks/gpu.py --only speed --rst     # the tables for docs/performance.rst

The exit status is 0 whether or not the targets are met; the verdict is printed. Without
a CUDA device the script says so and exits with status 1.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from common import percent, print_rst, print_text, settle_rounds, version_of  # the script's own folder
from estimator_accuracy import ZOO as CPU_ZOO
from estimator_accuracy import Recurrent, ResNet, Transformer
from torch import nn
from torch.nn import functional
from torch.nn.attention import SDPBackend, sdpa_kernel

import koila_retry as koila

TARGET_MEDIAN = 0.03  # the median absolute relative error of the estimate
TARGET_WORST = 0.08  # the worst absolute relative error of the estimate
TARGET_UNDER = 0.03  # no row's estimate more than this under the truth
TARGET_FITS = 1.01  # accumulate over the plain step, when the batch fits: at most this
TARGET_SPLIT = 0.97  # accumulate's throughput over the hand loop's, when split: at least this
MIB = 2**20
PRECISIONS = ("fp32", "bf16")
BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


# The zoo ----------------------------------------------------------------------------------------


class GRUNet(nn.Module):
    """A two-layer GRU over a sequence; its last hidden state classifies the sequence."""

    def __init__(self, features: int = 32, hidden: int = 128, classes: int = 10) -> None:
        super().__init__()
        self.gru = nn.GRU(features, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, hidden = self.gru(x)
        logits: torch.Tensor = self.head(hidden[-1])
        return logits


def _tokens(rows: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 1000, (rows, 64), generator=generator)


def _hugging_face(name: str) -> nn.Module:
    import transformers

    layers: dict[str, Any] = {"num_hidden_layers": 2, "num_attention_heads": 4, "attn_implementation": "sdpa"}
    model: nn.Module  # transformers' classes are Any to mypy here (pyproject.toml)
    if name == "gpt2":
        config = transformers.GPT2Config(
            n_layer=2,
            n_embd=128,
            n_head=4,
            vocab_size=1000,
            n_positions=64,
            use_cache=False,
            bos_token_id=0,
            eos_token_id=0,
            attn_implementation="sdpa",
        )
        model = transformers.GPT2LMHeadModel(config)
        return model
    layers.update(hidden_size=128, intermediate_size=512, num_labels=10)
    if name == "bert":
        config = transformers.BertConfig(vocab_size=1000, max_position_embeddings=64, **layers)
        model = transformers.BertForSequenceClassification(config)
        return model
    model = transformers.ViTForImageClassification(transformers.ViTConfig(image_size=32, patch_size=4, **layers))
    return model


@dataclass(frozen=True)
class Spec:
    """One model of the zoo: how to make it and its inputs, its loss and its inference output."""

    make: Callable[[], nn.Module]
    inputs: Callable[[int, torch.Generator], torch.Tensor]
    attends: bool  # whether it runs scaled_dot_product_attention
    hugging_face: bool = False
    causal: bool = False  # a causal language model: its labels are its inputs, shifted inside it

    def targets(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        if self.causal:
            return x.clone()
        return torch.randint(0, 10, (len(x),), generator=generator)

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not self.hugging_face:
            return functional.cross_entropy(model(x), y)
        name = "pixel_values" if x.is_floating_point() else "input_ids"
        loss: torch.Tensor = model(**{name: x}, labels=y).loss
        return loss

    def infer(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not self.hugging_face:
            out: torch.Tensor = model(x)
            return out
        name = "pixel_values" if x.is_floating_point() else "input_ids"
        logits: torch.Tensor = model(**{name: x}).logits
        return logits


SPECS: dict[str, Spec] = {
    "mlp": Spec(CPU_ZOO["mlp"].model, CPU_ZOO["mlp"].inputs, False),
    "resnet": Spec(ResNet, CPU_ZOO["resnet"].inputs, False),
    "transformer": Spec(Transformer, CPU_ZOO["transformer"].inputs, True),
    "gru": Spec(GRUNet, CPU_ZOO["lstm"].inputs, False),
    "lstm": Spec(Recurrent, CPU_ZOO["lstm"].inputs, False),
    "gpt2": Spec(functools.partial(_hugging_face, "gpt2"), _tokens, True, True, causal=True),
    "bert": Spec(functools.partial(_hugging_face, "bert"), _tokens, True, True),
    "vit": Spec(
        functools.partial(_hugging_face, "vit"),
        lambda rows, generator: torch.randn(rows, 3, 32, 32, generator=generator),
        True,
        True,
    ),
}


@dataclass(frozen=True)
class Case:
    """A model of the zoo, a mode (``"train"`` or ``"eval"``) and a batch size."""

    model: str
    mode: str
    batch: int

    def __str__(self) -> str:
        return f"{self.model} {self.mode} {self.batch}"


# Batch sizes per kind of device: on CUDA, peaks of a few hundred MiB to a few GiB, most
# of them activations; on the CPU (tests/test_cuda_estimate.py's stand-in), a few MiB.
_BATCHES: dict[str, dict[tuple[str, str], int]] = {
    "cuda": {
        ("mlp", "train"): 8192,
        ("mlp", "eval"): 16384,
        ("resnet", "train"): 256,
        ("resnet", "eval"): 512,
        ("transformer", "train"): 64,
        ("transformer", "eval"): 256,
        ("gru", "train"): 512,
        ("gru", "eval"): 1024,
        ("lstm", "train"): 512,
        ("lstm", "eval"): 1024,
        ("gpt2", "train"): 256,
        ("gpt2", "eval"): 512,
        ("bert", "train"): 256,
        ("bert", "eval"): 512,
        ("vit", "train"): 256,
        ("vit", "eval"): 512,
    },
    # No recurrent nets on the CPU: with oneDNN off (the stand-in's truth cannot see its
    # buffers), PyTorch's CPU LSTM and GRU take another path than the one users run.
    "cpu": {
        ("mlp", "train"): 256,
        ("mlp", "eval"): 512,
        ("resnet", "train"): 8,
        ("resnet", "eval"): 16,
        ("transformer", "train"): 4,
        ("transformer", "eval"): 8,
        ("gpt2", "train"): 2,
        ("gpt2", "eval"): 4,
        ("bert", "train"): 2,
        ("bert", "eval"): 4,
        ("vit", "train"): 4,
        ("vit", "eval"): 8,
    },
}


def cases(kind: str) -> list[Case]:
    """Return the zoo's cases for a kind of device (``"cuda"`` or ``"cpu"``); Hugging Face's if installed."""
    return [
        Case(model, mode, batch)
        for (model, mode), batch in _BATCHES[kind].items()
        if HAS_TRANSFORMERS or not SPECS[model].hugging_face
    ]


CASES = {kind: cases(kind) for kind in _BATCHES}


def variants(kind: str, precision: str) -> list[tuple[Case, str | None]]:
    """Return each case with the attention kernel it runs under (``None`` for models that do not attend).

    On CUDA, every fused kernel that takes the precision: memory-efficient attention in
    float32, flash and memory-efficient attention in bfloat16 (flash takes 16-bit inputs
    only). On the CPU, the math kernel, the one the estimate's run on meta tensors takes.
    """
    kernels = {"fp32": ["efficient"], "bf16": ["flash", "efficient"]}[precision] if kind == "cuda" else ["math"]
    return [(case, kernel) for case in CASES[kind] for kernel in (kernels if SPECS[case.model].attends else [None])]


def build(case: Case, device: torch.device, precision: str) -> tuple[Callable[..., Any], tuple[torch.Tensor, ...]]:
    """Return the step of a case on ``device``, in ``precision`` (``"fp32"``, ``"bf16"``), and its inputs."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    spec = SPECS[case.model]
    torch.manual_seed(0)
    model = spec.make().to(device)
    generator = torch.Generator().manual_seed(1)
    x = spec.inputs(case.batch, generator)
    autocast = functools.partial(torch.autocast, device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
    if case.mode == "eval":
        model.eval()

        def infer(x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad(), autocast():
                return spec.infer(model, x)

        return infer, (x.to(device),)
    y = spec.targets(x, generator)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            loss = spec.loss(model, x, y)
        loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch
        optimizer.step()
        return loss.detach()

    return train, (x.to(device), y.to(device))


class Meter(Protocol):
    """What :func:`measure` reads of a device (``tests/_devices.py`` has one for the CPU stand-in)."""

    def allocated(self) -> int: ...

    def peak(self) -> int: ...

    def reset_peak(self) -> None: ...

    def reserved_peak(self) -> int | None: ...


@dataclass(frozen=True)
class Row:
    """The estimate of one case against the peak it reached."""

    case: Case
    precision: str
    kernel: str | None
    true_peak: int  # bytes, over what was allocated before the model was built
    estimate: int
    reserved_peak: int | None  # bytes the allocator reserved at most, over what it held before

    @property
    def error(self) -> float:
        return self.estimate / self.true_peak - 1

    @property
    def fragmentation(self) -> float | None:
        if not self.reserved_peak:
            return None
        return 1 - self.true_peak / self.reserved_peak

    def cells(self) -> list[str]:
        reserved = "-" if self.reserved_peak is None else f"{self.reserved_peak / MIB:.1f}"
        fragmentation = "-" if self.fragmentation is None else f"{self.fragmentation:.1%}"
        return [
            str(self.case),
            self.precision,
            self.kernel or "-",
            f"{self.true_peak / MIB:.1f}",
            f"{self.estimate / MIB:.1f}",
            f"{self.error:+.2%}",
            reserved,
            fragmentation,
        ]


HEADER = ["case", "precision", "attention", "peak MiB", "estimate MiB", "error", "reserved MiB", "fragmentation"]


def measure(
    case: Case,
    device: torch.device,
    precision: str,
    kernel: str | None,
    measuring: Callable[[], AbstractContextManager[Meter]],
) -> Row:
    """Run one case for real inside ``measuring()`` and estimate it; return both peaks.

    Args:
        case (Case): the model, mode and batch size.
        device (torch.device): where the model and inputs go.
        precision (str): ``"fp32"``, or ``"bf16"`` for bfloat16 autocast.
        kernel (str or None): the attention kernel (a key of :data:`BACKENDS`), or ``None``.
        measuring (callable): returns a block whose meter reads the device, without a limit.

    Returns:
        Row: the true and the estimated peak.
    """
    attention = sdpa_kernel([BACKENDS[kernel]]) if kernel is not None else contextlib.nullcontext()
    with attention:
        if device.type == "cuda":
            # cuBLAS, cuBLASLt and cuDNN keep workspaces for the whole process, made at
            # their first call: a run of the case makes them before anything is counted.
            step, args = build(case, device, precision)
            step(*args)
            del step, args
        with measuring() as meter:
            before = meter.allocated()
            reserved_before = meter.reserved_peak()
            step, args = build(case, device, precision)
            step(*args)  # the warm-up: gradients and the optimizer's state exist after it
            meter.reset_peak()
            step(*args)
            true_peak = meter.peak() - before
            reserved_peak = meter.reserved_peak()
        estimate = koila.estimate(step, *args).peak(case.batch)
    reserved = None if reserved_peak is None or reserved_before is None else reserved_peak - reserved_before
    return Row(case, precision, kernel, true_peak, estimate, reserved)


def verdict(rows: list[Row]) -> tuple[float, float]:
    """Return the median and the worst absolute error of the rows."""
    errors = [abs(row.error) for row in rows]
    return statistics.median(errors), max(errors)


class _CudaMeter:
    def allocated(self) -> int:
        return torch.cuda.memory_allocated()

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated()

    def reset_peak(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def reserved_peak(self) -> int | None:
        return torch.cuda.max_memory_reserved()


@contextlib.contextmanager
def _cuda_measuring() -> Iterator[Meter]:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    meter = _CudaMeter()
    meter.reset_peak()
    yield meter


def accuracy(args: argparse.Namespace, device: torch.device) -> None:
    rows = []
    for precision in PRECISIONS:
        chosen = variants("cuda", precision)
        if args.quick:
            chosen = [pair for pair in chosen if pair[0].mode == "train"]
        for case, kernel in chosen:
            rows.append(measure(case, device, precision, kernel, _cuda_measuring))
            print(f"  {case} {precision} {kernel or ''}: {rows[-1].error:+.2%}", file=sys.stderr, flush=True)
    print("\nkoila.estimate against torch.cuda.max_memory_allocated\n")
    table = [row.cells() for row in rows]
    print_text(HEADER, table)
    if args.rst:
        print()
        print_rst(HEADER, table, "koila.estimate against the CUDA caching allocator's peak")
    median, worst = verdict(rows)
    lowest = min(row.error for row in rows)
    met = median <= TARGET_MEDIAN and worst <= TARGET_WORST and lowest >= -TARGET_UNDER
    print(
        f"\nmedian {median:.2%} (target <= {TARGET_MEDIAN:.0%}), worst {worst:.2%} (target <= {TARGET_WORST:.0%}), "
        f"lowest {lowest:+.2%} (target >= {-TARGET_UNDER:.0%}): {'met' if met else 'NOT met'}"
    )


# Speed ------------------------------------------------------------------------------------------


def timed_rounds(candidates: dict[str, Callable[[], None]], rounds: int, steps: int) -> dict[str, list[float]]:
    """Time ``steps`` calls of each candidate per round, in an order rotated every round; seconds per call."""
    names = list(candidates)
    times: dict[str, list[float]] = {name: [] for name in names}
    for function in candidates.values():  # a warm-up: kernels chosen, workspaces made
        function()
    for number in range(rounds):
        order = names[number % len(names) :] + names[: number % len(names)]
        for name in order:
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                candidates[name]()
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - start) / steps)
    return times


def ratio(times: dict[str, list[float]], name: str, baseline: str) -> float:
    """Return the median over rounds of a candidate's time over the baseline's in the same round."""
    return statistics.median(mine / base for mine, base in zip(times[name], times[baseline]))


def speed(args: argparse.Namespace, device: torch.device, rows_total: int = 4096, width: int = 4096) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 10))
    model.to(device)
    x = torch.randn(rows_total, 1024, device=device)
    y = torch.randint(0, 10, (rows_total,), device=device)

    def plain() -> None:
        model.zero_grad(set_to_none=True)
        functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]  # unannotated in torch

    def wrapped(initial: int | None) -> Callable[[], None]:
        @koila.accumulate(initial=initial)
        def step(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
            return functional.cross_entropy(model(xb), yb)

        def run() -> None:
            model.zero_grad(set_to_none=True)
            step(x, y)
            if step.stats.ooms or step.stats.batch_size != (initial or rows_total):
                raise SystemExit(f"accumulate left its happy path: {step.stats}")

        return run

    def by_hand(size: int) -> Callable[[], None]:
        def run() -> None:
            model.zero_grad(set_to_none=True)
            # Tensor.split and Tensor.backward are unannotated in torch (hence the type: ignores).
            for xb, yb in zip(x.split(size), y.split(size)):  # type: ignore[no-untyped-call]
                (functional.cross_entropy(model(xb), yb) * len(xb) / rows_total).backward()  # type: ignore[no-untyped-call]

        return run

    header = ["setting", "baseline", "koila / baseline", "target", "met"]
    table = []
    times = timed_rounds({"plain": plain, "koila": wrapped(None)}, args.rounds, args.steps)
    fits = ratio(times, "koila", "plain")
    limit = f"<= {TARGET_FITS - 1:+.0%}"
    table.append(["accumulate, whole batch", "plain step", percent(fits), limit, _yes(fits <= TARGET_FITS)])
    for pieces in (2, 4, 8):
        size = rows_total // pieces
        times = timed_rounds({"hand": by_hand(size), "koila": wrapped(size)}, args.rounds, args.steps)
        throughput = 1 / ratio(times, "koila", "hand")
        table.append(
            [
                f"accumulate, {pieces} x {size} rows",
                "hand loop",
                f"{throughput:.1%} throughput",
                f">= {TARGET_SPLIT:.0%}",
                _yes(throughput >= TARGET_SPLIT),
            ]
        )

    @koila.batch(initial=rows_total)
    def evaluate(batch_size: int) -> torch.Tensor:
        with torch.no_grad():
            logits: torch.Tensor = model(x[:batch_size])
            return logits

    def plain_evaluate() -> None:
        with torch.no_grad():
            model(x[:rows_total])

    def koila_evaluate() -> None:
        evaluate()
        if evaluate.stats.ooms:
            raise SystemExit(f"batch left its happy path: {evaluate.stats}")

    times = timed_rounds({"plain": plain_evaluate, "koila": koila_evaluate}, args.rounds, args.steps)
    happy = ratio(times, "koila", "plain")
    table.append(["@batch, happy path", "plain call", percent(happy), "-", "-"])
    print(f"\nWhat the front ends cost on a training step ({args.rounds} rounds of {args.steps} steps)\n")
    print_text(header, table)
    if args.rst:
        print()
        print_rst(header, table, "accumulate and batch on a CUDA GPU")


def _yes(met: bool) -> str:
    return "yes" if met else "NO"


def environment() -> str:
    """Return the GPU model, the driver, CUDA and torch versions, for the tables' header."""
    properties = torch.cuda.get_device_properties(torch.cuda.current_device())
    try:
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        driver = "unknown (no nvidia-smi)"
    return (
        f"GPU: {properties.name}, {properties.total_memory / 2**30:.1f} GiB; driver {driver}; "
        f"CUDA {torch.version.cuda}; torch {torch.__version__}; koila-retry {koila.__version__}; "
        f"transformers {version_of('transformers')}; Python {platform.python_version()}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("accuracy", "speed"), help="run one part only")
    parser.add_argument("--quick", action="store_true", help="fewer rounds, training steps only for accuracy")
    parser.add_argument("--rounds", type=int, help="timed rounds (default 30, 4 with --quick)")
    parser.add_argument("--steps", type=int, default=10, help="steps per timed block (default 10)")
    parser.add_argument("--rst", action="store_true", help="also print the tables as reStructuredText csv-tables")
    args = parser.parse_args(argv)
    settle_rounds(parser, args)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py needs a CUDA device: torch.cuda.is_available() is False", file=sys.stderr)
        return 1
    print(environment())
    device = torch.device("cuda", torch.cuda.current_device())
    if args.only in (None, "accuracy"):
        accuracy(args, device)
    if args.only in (None, "speed"):
        speed(args, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
