"""``python -m koila_retry estimate``: a model's peak memory at every batch size, from the command line.

Exit statuses: 0 when some batch size fits, 1 when not even 1 fits or the user's code failed,
and 2 for usage errors, as argparse gives.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import itertools
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from koila_retry._common.units import format_bytes, parse_bytes
from koila_retry._core.memory import free_memory, resolve_device
from koila_retry._estimation.calibration import LARGEST
from koila_retry._estimation.estimate import MemoryEstimate, estimate
from koila_retry._estimation.recorder import value_shaped_note

__all__ = ["configure", "run"]

EXAMPLE_ROWS = 8  # the rows of the example inputs the estimate scales from
MIN_ROWS_SHOWN = 64  # the table goes at least up to this batch size
MAX_ROWS = 20  # and has at most this many rows
GIB = 1 << 30

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
INPUT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int64": torch.int64}
OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-3),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
}
PLOT_MISSING = "--plot needs matplotlib: pip install matplotlib (koila-retry's plot extra)"
# What PyTorch says when floats reach an op that takes indices, on the CPU or on meta tensors:
# nn.Embedding and EmbeddingBag ("Expected tensor for argument #1 'indices' ...: Long, Int",
# "expected indices to be long or int"), index_select and gather ("Expected dtype int32/int64 for
# index"), one_hot ("index tensor"), indexing ("tensors used as indices must be long"), and the
# losses that take class indices, labels passed to a model ("expected target dtype to be Long").
INDEX_DTYPE_ERROR = re.compile(
    r"'indices'|indices (?:to|must) be (?:long|int)|as indices must be long|for index\b|index tensor"
    r"|target dtype to be long|scalar types?:? long|scalar type long",
    re.IGNORECASE,
)
INPUT_DTYPE_HINT = (
    "; token ids and other indices are integers: give --input-dtype int64 (once for every input, "
    "or once per --input, in order)"
)

_META = torch.device("meta")


class Failure(Exception):
    """An error reported as one line on stderr, with the exit status to return."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


class Target(NamedTuple):
    """``MODULE:FACTORY`` as given."""

    module: str
    factory: str
    text: str


# --- argument types: each raises ArgumentTypeError, which argparse reports as a usage error ---


def parse_target(text: str) -> Target:
    """Read ``MODULE:FACTORY``: a dotted module or a path to a .py file, and a (dotted) attribute."""
    module, colon, factory = text.rpartition(":")
    if not colon or not module or not factory:
        raise argparse.ArgumentTypeError(
            f"give a module (or a .py file) and a callable in it joined by a colon, like models:make_model, "
            f"got {text!r}"
        )
    if not all(part.isidentifier() for part in factory.split(".")):
        raise argparse.ArgumentTypeError(f"FACTORY must be a Python name, like make_model, got {factory!r} in {text!r}")
    if not _is_path(module) and not all(part.isidentifier() for part in module.split(".")):
        raise argparse.ArgumentTypeError(
            f"MODULE must be a dotted module name, like models.vision, or a path to a .py file, got {module!r}"
        )
    return Target(module, factory, text)


def parse_shape(text: str) -> tuple[int, ...]:
    """Read the shape of one sample, like ``3x224x224`` or ``128``."""
    parts = text.strip().lower().split("x")
    if not all(part.strip().isdigit() and int(part) >= 1 for part in parts):
        raise argparse.ArgumentTypeError(
            f"give the shape of one sample without the batch dimension, sizes >= 1 joined by x "
            f"(like 3x224x224 or 128), got {text!r}"
        )
    return tuple(int(part) for part in parts)


def parse_memory(text: str) -> int:
    """Read a memory size of more than 0 bytes, like ``24GiB``."""
    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"give a memory size of more than 0 bytes, like 24GiB, got {text!r}")
    try:
        size = parse_bytes(text, whole=True)  # "1.5" was 1 byte: a unit left out, not a fraction of a byte
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"give a memory size of more than 0 bytes, like 24GiB, got {text!r}")
    return size


def parse_ranks(text: str) -> int:
    """Parse ``--fsdp``: the number of ranks, an int >= 1."""
    try:
        ranks = int(text)
    except ValueError:
        ranks = 0
    if ranks < 1:
        raise argparse.ArgumentTypeError(f"expected the number of ranks, an int >= 1 like 8, got {text!r}")
    return ranks


def parse_margin(text: str) -> float:
    """Read the margin: a fraction of the peak in [0, 10)."""
    try:
        margin = float(text)
    except ValueError:
        margin = -1.0
    if not 0 <= margin < 10:
        raise argparse.ArgumentTypeError(f"give a fraction of the peak in [0, 10), like 0.1, got {text!r}")
    return margin


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the arguments of ``estimate`` to its subparser."""
    parser.add_argument(
        "target",
        type=parse_target,
        metavar="MODULE:FACTORY",
        help="a module importable from the current directory (or a path to a .py file) and a callable in it "
        "that builds the model with no arguments; it is called on the meta device, so nothing is allocated",
    )
    parser.add_argument(
        "--input",
        dest="inputs",
        action="append",
        type=parse_shape,
        required=True,
        metavar="SHAPE",
        help="the shape of one sample, without the batch dimension: 3x224x224 for images, 128 for token ids; "
        "once per argument of forward()",
    )
    parser.add_argument(
        "--input-dtype",
        dest="input_dtypes",
        action="append",
        choices=sorted(INPUT_DTYPES),
        help="the dtype of each input, in order (given once: of every input); int64 for token ids. Default: --dtype",
    )
    parser.add_argument(
        "--mode",
        choices=["train", "infer"],
        default="train",
        help="train: forward, backward and optimizer step; infer: forward under torch.no_grad() (default: train)",
    )
    parser.add_argument(
        "--optimizer",
        choices=sorted(OPTIMIZERS),
        default="adamw",
        help="the optimizer of a training step, with PyTorch's defaults (sgd: no momentum) (default: adamw)",
    )
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32", help="the model's dtype (default: float32)")
    parser.add_argument(
        "--memory",
        type=parse_memory,
        metavar="SIZE",
        help="the memory budget, everything counted, like 24GiB (default: the free memory of --device now)",
    )
    parser.add_argument(
        "--device",
        help="the device the estimate is for: cuda devices round allocations as PyTorch's caching allocator does, "
        "and give the budget when --memory is not given (default: cpu)",
    )
    parser.add_argument(
        "--margin",
        type=parse_margin,
        default=0.1,
        help="the fraction of the peak kept free for what the estimate does not model (default: 0.1)",
    )
    parser.add_argument(
        "--fsdp",
        type=parse_ranks,
        metavar="N",
        help="estimate one rank of FSDP2 over N ranks: each module in an nn.ModuleList sharded with fully_shard, "
        "then the whole model; batch sizes are per rank (default: not sharded)",
    )
    parser.add_argument("--plot", metavar="PNG", help="also draw the peak against the batch size into this PNG file")


# --- the run ------------------------------------------------------------------------


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``estimate`` with parsed arguments; print the table; return the exit status."""
    inputs: list[tuple[int, ...]] = args.inputs
    names = args.input_dtypes or [args.dtype]
    if len(names) == 1:
        names = names * len(inputs)
    elif len(names) != len(inputs):
        parser.error(
            f"--input-dtype is given {len(names)} times for {len(inputs)} inputs; give it once (for every input) "
            "or once per --input"
        )
    try:
        return _run(args, inputs, [INPUT_DTYPES[name] for name in names])
    except Failure as failure:
        print(f"error: {_one_line(str(failure))}", file=sys.stderr)
        return failure.status


def _run(args: argparse.Namespace, shapes: list[tuple[int, ...]], dtypes: list[torch.dtype]) -> int:
    device = _device(args.device)
    budget, source = _budget(args.memory, args.device, device)
    plot = _matplotlib(args.plot) if args.plot is not None else None

    inputs = [_input(shape, dtype) for shape, dtype in zip(shapes, dtypes)]
    with _importable(os.getcwd()):
        model = _build(args.target, DTYPES[args.dtype])
        step = _step(model, args.mode, args.optimizer)
        try:
            if args.mode == "train":
                # Every step after the first holds the optimizer's state from its start: estimate one of those.
                try:
                    _warm_up(step, inputs)
                except BrokenPipeError:
                    raise
                except Exception:
                    # Only the estimate's own run takes tensors the model makes or moves on the CPU to meta
                    # (.cpu(), a new CPU tensor): estimate two steps there, the second holding the first's state.
                    # What fails there too is the estimate's error, which notes why and what to do.
                    step = _twice(step)
            elif any(nn.parameter.is_lazy(tensor) for tensor in (*model.parameters(), *model.buffers())):
                # A lazy module (nn.LazyLinear) makes its parameters in its first forward, from the input's
                # shape: the estimate cannot, and its advice (run the model once) is this (probe 75B).
                with contextlib.suppress(Exception):  # what fails here fails in the estimate, which says why
                    _warm_up(step, inputs)
            found = estimate(step, *inputs, device=device, fsdp=args.fsdp)
        except SystemExit as exc:
            raise Failure(
                _exited("running the model", exc, "on meta tensors: its forward must return, not exit")
            ) from None
        except BrokenPipeError:  # the model's own prints' reader stopped reading: see main
            raise
        except Exception as exc:
            message = _one_line(str(exc))
            hint = ""
            if any(dtype.is_floating_point for dtype in dtypes) and INDEX_DTYPE_ERROR.search(message):
                hint = INPUT_DTYPE_HINT
            # koila.estimate's own note says why and what to do (a mask's indexing, say): PyTorch's
            # message alone may advise a compiler setting that does not help here.
            why = value_shaped_note(exc)
            notes = f"; {_one_line(why)}" if why is not None else ""
            raise Failure(
                f"the estimate failed: {type(exc).__name__}: {message} (raised while the model ran "
                f"on meta tensors, which have shapes and no values){hint}{notes}"
            ) from None

    margin: float = args.margin
    largest = found.largest_fitting(budget, margin=margin)
    sizes = _table_sizes(largest)
    described = ", ".join(f"{'x'.join(map(str, shape))} {_dtype_name(dtype)}" for shape, dtype in zip(shapes, dtypes))
    print(
        f"model {type(model).__name__} ({_count(sum(p.numel() for p in model.parameters()))}, {args.dtype}), "
        f"mode {args.mode}, optimizer {args.optimizer if args.mode == 'train' else 'none'}, "
        f"input {described}, device {device}, budget {format_bytes(budget)} ({source})"
        + ("" if args.fsdp is None else f", one rank of FSDP2 over {args.fsdp} (batch sizes per rank)")
    )
    print()
    for line in _table(found, sizes, budget, margin, largest):
        print(line)
    print()
    runs = ", ".join(map(str, found.sizes))
    print(f"the estimate took {found.seconds:.2f} s (runs on meta tensors at batch sizes {runs})")
    for note in found.notes:  # what the estimate could not see, as suggest_batch_size warns of it
        print(f"note: {note}")
    within = f"in {format_bytes(budget)} (with a {margin * 100:g}% margin)"
    if largest is None:
        needed = found.peak(1)
        print(
            f"not even a batch size of 1 fits {within}: its estimated peak is {format_bytes(needed)}, "
            f"{format_bytes(needed * (1 + margin))} with the margin"
        )
    else:
        print(f"largest batch size that fits {within}: {largest}")
    if plot is not None:
        title = f"{type(model).__name__}, {args.mode}" + (f" with {args.optimizer}" if args.mode == "train" else "")
        _plot(plot, args.plot, found, sizes, budget, margin, largest, title)
        # An argument's undecodable bytes (surrogates) would fail a strict UTF-8 stdout after the file was written.
        print(f"wrote {args.plot.encode('utf-8', 'surrogateescape').decode('utf-8', 'backslashreplace')}")
    return 1 if largest is None else 0


def _input(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Return the example input of ``shape`` on the meta device, or fail if PyTorch cannot hold such a batch."""
    try:
        # The estimate runs at twice the example's rows as well: PyTorch must be able to size both.
        torch.empty((2 * EXAMPLE_ROWS, *shape), dtype=dtype, device=_META)
        return torch.empty((EXAMPLE_ROWS, *shape), dtype=dtype, device=_META)
    except (RuntimeError, TypeError, ValueError, OverflowError) as exc:
        raise Failure(
            f"--input {'x'.join(map(str, shape))}: a batch of {2 * EXAMPLE_ROWS} such samples is more than PyTorch "
            f"can size ({_one_line(str(exc))})",
            status=2,
        ) from None


def _device(text: str | None) -> torch.device:
    if text is None:
        return torch.device("cpu")
    try:
        return resolve_device(text)
    except (TypeError, ValueError) as exc:
        raise Failure(f"--device: {_one_line(str(exc))}", status=2) from None


def _budget(memory: int | None, text: str | None, device: torch.device) -> tuple[int, str]:
    if memory is not None:
        return memory, "--memory"
    if device.type == "meta":  # stores no data: its free memory is no budget (suggest_batch_size refuses it too)
        raise Failure("--device meta has no memory to fill; give the budget with --memory", status=2)
    try:
        free = free_memory(device)
    except (TypeError, ValueError) as exc:
        raise Failure(f"{_one_line(str(exc))}; give the budget with --memory", status=2) from None
    if text is None:
        return free, "the CPU's free memory now, as neither --memory nor --device is given"
    return free, f"free on {device} now"


def _matplotlib(path: str) -> tuple[Any, Any]:
    """Import what drawing needs, without pyplot's global state; check that ``path`` can be written."""
    folder = Path(path).resolve().parent
    if not folder.is_dir():
        raise Failure(f"--plot: no folder {str(folder)!r} to write {Path(path).name} in", status=2)
    if Path(path).is_dir():
        raise Failure(f"--plot: {path!r} is a folder; give the PNG file to write, such as {path}/peak.png", status=2)
    try:
        figure = importlib.import_module("matplotlib.figure")
        agg = importlib.import_module("matplotlib.backends.backend_agg")
    except ImportError:
        raise Failure(PLOT_MISSING, status=2) from None
    return figure.Figure, agg.FigureCanvasAgg


@contextlib.contextmanager
def _importable(*folders: str) -> Iterator[None]:
    """Put folders first on ``sys.path`` for the block, and restore it afterwards."""
    saved = list(sys.path)
    sys.path[:0] = [folder for folder in folders if folder not in sys.path]
    try:
        yield
    finally:
        sys.path[:] = saved


def _is_path(module: str) -> bool:
    return module.endswith(".py") or "/" in module or os.sep in module


def _import(module: str) -> Any:
    if _is_path(module):
        path = Path(module).resolve()
        if not path.is_file():
            raise Failure(f"no file {module!r} to import", status=2)
        name = f"_koila_estimate_{path.stem}_{abs(hash(str(path)))}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise Failure(f"cannot import {module!r}: not a Python file", status=2)
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[name] = loaded  # dataclasses and pickling look their module up
        sys.path.insert(0, str(path.parent))  # for its own imports of files beside it
        try:
            spec.loader.exec_module(loaded)
        except SystemExit as exc:
            del sys.modules[name]
            raise Failure(_exited(f"importing {module}", exc, _GUARD)) from None
        except BrokenPipeError:  # the model's own prints' reader stopped reading: see main
            raise
        except Exception as exc:
            del sys.modules[name]
            raise Failure(_raised(f"importing {module}", exc)) from None
        return loaded
    try:
        return importlib.import_module(module)
    except SystemExit as exc:
        raise Failure(_exited(f"importing {module}", exc, _GUARD)) from None
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module == exc.name or module.startswith(exc.name + ".")):
            raise Failure(
                f"no module named {exc.name!r} (looked in the current directory and on sys.path)", status=2
            ) from None
        raise Failure(_raised(f"importing {module}", exc)) from None
    except BrokenPipeError:  # the model's own prints' reader stopped reading: see main
        raise
    except Exception as exc:
        raise Failure(_raised(f"importing {module}", exc)) from None


def _build(target: Target, dtype: torch.dtype) -> nn.Module:
    """Import the module, find the factory and build the model on the meta device, in ``dtype``."""
    argv, sys.argv = sys.argv, [target.module]  # a script that parses its arguments when imported: none of ours
    try:
        value = _import(target.module)
    finally:
        sys.argv = argv
    for attribute in target.factory.split("."):
        if not hasattr(value, attribute):
            raise Failure(f"{target.module} has no attribute {target.factory!r}", status=2)
        value = getattr(value, attribute)
    if not callable(value):
        raise Failure(f"{target.text} is a {type(value).__name__}, not a callable that builds the model", status=2)
    try:
        with _META:
            model = value()
    except SystemExit as exc:
        raise Failure(
            _exited(f"{target.text}()", exc, "instead of building the model: a factory must return the model")
        ) from None
    except BrokenPipeError:  # the model's own prints' reader stopped reading: see main
        raise
    except Exception as exc:
        raise Failure(_raised(f"{target.text}()", exc)) from None
    if not isinstance(model, nn.Module):
        raise Failure(f"{target.text}() returned an object of type {type(model).__name__}, not a torch.nn.Module")
    try:
        # Whatever the factory made elsewhere moves to the meta device too: nothing is held as data.
        return model.to(device=_META, dtype=dtype)
    except BrokenPipeError:  # the model's own prints' reader stopped reading: see main
        raise
    except Exception as exc:
        raise Failure(_raised("moving the model to the meta device", exc)) from None


def _step(model: nn.Module, mode: str, optimizer: str) -> Callable[..., None]:
    """Return the call to estimate: a training step, or a forward pass without gradients."""
    if mode == "infer":
        model.eval()

        def forward(*inputs: torch.Tensor) -> None:
            with torch.no_grad():
                model(*inputs)

        return forward

    model.train()
    params = [parameter for parameter in model.parameters() if parameter.requires_grad]
    if not params:
        raise Failure("the model has no parameters that require grad, so there is nothing to train; try --mode infer")
    opt = OPTIMIZERS[optimizer](params)

    def train(*inputs: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        out = model(*inputs)
        _loss(out).backward()  # type: ignore[no-untyped-call]
        opt.step()

    train.parameters = params  # type: ignore[attr-defined]
    return train


class _NoValues(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Answer reads of a meta tensor's value (an optimizer's step count) with 1 instead of an error."""

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            return False if args[0].dtype == torch.bool else 1
        return func(*args, **(kwargs or {}))


def _warm_up(step: Callable[..., None], inputs: list[torch.Tensor]) -> None:
    """Run one training step on the meta model, so that its optimizer's state exists (as meta tensors)."""
    with _NoValues():  # type: ignore[no-untyped-call]
        step(*inputs)
    for parameter in getattr(step, "parameters", ()):  # a training step's (infer mode runs a forward)
        parameter.grad = None


def _twice(step: Callable[..., None]) -> Callable[..., None]:
    """Return a call of two training steps: the peak of the second, which starts with the optimizer's state."""

    def steps(*inputs: torch.Tensor) -> None:
        step(*inputs)
        step(*inputs)

    return steps


def _loss(out: Any) -> torch.Tensor:
    """Return a scalar loss from a model's output: the sum of the means of its floating tensors."""
    tensors = [tensor for tensor in _tensors(out) if tensor.is_floating_point()]
    if not tensors:
        raise TypeError(f"the model returned {type(out).__name__} with no floating-point tensor to take a loss of")
    loss = tensors[0].float().mean()
    for tensor in tensors[1:]:
        loss = loss + tensor.float().mean()
    return loss


def _tensors(out: Any, depth: int = 16) -> Iterator[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        yield out
    elif depth == 0:  # deeper than any output is nested: one that holds itself
        return
    elif isinstance(out, Mapping):
        for value in out.values():
            yield from _tensors(value, depth - 1)
    elif isinstance(out, (list, tuple)):
        for value in out:
            yield from _tensors(value, depth - 1)
    elif dataclasses.is_dataclass(out) and not isinstance(out, type):  # a model's output of its own
        for found in dataclasses.fields(out):
            yield from _tensors(getattr(out, found.name, None), depth - 1)  # a field never set: none


# --- the output -----------------------------------------------------------------------


def _table_sizes(largest: int | None) -> list[int]:
    """Return the powers of two shown: 1 to 64, then to one past the largest that fits, at most ``MAX_ROWS``."""
    # Past the search's last size, a row would read "fits" under "fits, the largest".
    beyond = largest if largest is None or largest >= LARGEST else 2 * largest
    end = max(MIN_ROWS_SHOWN, beyond or 0)
    sizes = [1 << power for power in range(end.bit_length())]
    if len(sizes) <= MAX_ROWS:
        return sizes
    head = [size for size in sizes if size <= MIN_ROWS_SHOWN]
    return [*head, *sizes[-(MAX_ROWS - len(head)) :]]


def _table(found: MemoryEstimate, sizes: Sequence[int], budget: int, margin: float, largest: int | None) -> list[str]:
    header = ["batch size", "peak", "parameters", "gradients", "optimizer state", "activations", "temporaries", ""]
    rows = []
    for size, following in itertools.zip_longest(sizes, sizes[1:]):
        parts = found.breakdown(size)
        fits = found.fits(size, budget, margin=margin)
        marker = "fits, the largest" if size == largest else "fits" if fits else ""
        amounts = [found.peak(size), *(parts[part] for part in ("parameters", "gradients", "optimizer state"))]
        amounts += [parts["activations"] + parts["inputs"], parts["temporaries"]]
        rows.append([str(size), *map(format_bytes, amounts), marker])
        if following is not None and following > 2 * size:
            rows.append(["...", *[""] * (len(header) - 1)])
    widths = [max(len(row[column]) for row in [header, *rows]) for column in range(len(header))]
    return [
        "  ".join(
            cell.ljust(width) if column == len(header) - 1 else cell.rjust(width)
            for column, (cell, width) in enumerate(zip(row, widths))
        ).rstrip()
        for row in [header, *rows]
    ]


def _plot(
    matplotlib: tuple[Any, Any],
    path: str,
    found: MemoryEstimate,
    sizes: Sequence[int],
    budget: int,
    margin: float,
    largest: int | None,
    title: str,
) -> None:
    figure_type, canvas_type = matplotlib
    figure = figure_type(figsize=(8, 5), layout="constrained")
    canvas_type(figure)
    axes = figure.add_subplot()
    peaks = [found.peak(size) / GIB for size in sizes]
    axes.plot(sizes, peaks, marker="o", label="estimated peak")
    axes.axhline(budget / GIB, color="tab:red", label=f"budget {format_bytes(budget)}")
    axes.axhline(
        budget / (1 + margin) / GIB,
        color="tab:red",
        linestyle="--",
        label=f"budget / (1 + margin {margin:g}): {format_bytes(budget / (1 + margin))}",
    )
    if largest is not None:
        axes.plot(
            [largest],
            [found.peak(largest) / GIB],
            marker="*",
            markersize=16,
            color="tab:green",
            linestyle="none",
            label=f"largest batch size that fits: {largest}",
        )
    axes.set_xscale("log", base=2)
    axes.set_xticks(sizes, [str(size) for size in sizes], rotation=45 if len(sizes) > 10 else 0)
    axes.set_ylim(0, max(*peaks, budget / GIB) * 1.05)
    axes.set_xlabel("batch size")
    axes.set_ylabel("estimated peak (GiB)")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend()
    try:
        figure.savefig(path, format="png")
    except OSError as exc:
        raise Failure(f"cannot write {path}: {_one_line(str(exc))}") from None


def _count(parameters: int) -> str:
    for unit, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if parameters >= scale:
            return f"{parameters / scale:.2f} {unit} parameters"
    return f"{parameters} parameter{'' if parameters == 1 else 's'}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _raised(what: str, exc: BaseException) -> str:
    return f"{what} raised {type(exc).__name__}: {_one_line(str(exc))}"


_GUARD = (
    "instead of building the model: a script that parses its arguments or runs its work when imported needs that "
    "under if __name__ == '__main__'"
)


def _exited(what: str, exc: SystemExit, hint: str) -> str:
    return f"{what} exited (status {exc.code!r}) {hint}"


def _one_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0].strip() if lines else "(no message)"
