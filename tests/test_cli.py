"""Tests for the command line, ``python -m koila_retry``, and the demo behind it."""

from __future__ import annotations

import io
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import koila_retry as koila
from koila_retry import __main__ as cli
from koila_retry._cli import estimate as estimate_command
from koila_retry._cli.demo import run_demo
from koila_retry._common import units as koila_units

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, "-m", "koila_retry", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=240,
        check=False,
    )


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@pytest.fixture(scope="module")
def demo() -> subprocess.CompletedProcess[str]:
    return run_cli("demo", "--epochs", "2")


def test_demo_exits_0_without_errors(demo: subprocess.CompletedProcess[str]) -> None:
    assert demo.returncode == 0, demo.stderr
    assert "Traceback" not in demo.stderr
    assert "error" not in demo.stderr.lower()


def test_demo_narrates_each_reduction(demo: subprocess.CompletedProcess[str]) -> None:
    reductions = re.findall(r"out of memory at batch size +(\d+);.*trying (\d+)", demo.stdout)
    assert reductions, demo.stdout
    assert reductions[0][0] == "8192"  # the default initial size
    for failed, following in reductions:
        assert int(following) < int(failed)
        assert is_power_of_two(int(following))


def test_demo_settles_and_later_epochs_come_from_the_cache(demo: subprocess.CompletedProcess[str]) -> None:
    epochs = re.findall(r"^epoch (\d+): loss [\d.]+ at batch size (\d+) \((.*)\)$", demo.stdout, re.MULTILINE)
    assert [number for number, _, _ in epochs] == ["1", "2"], demo.stdout
    sizes = {int(size) for _, size, _ in epochs}
    assert len(sizes) == 1
    (settled,) = sizes
    assert is_power_of_two(settled)
    assert settled < 8192
    # The size it settled on is the one the last reduction tried.
    assert re.findall(r"trying (\d+)", demo.stdout)[-1] == str(settled)
    assert "out-of-memory errors" in epochs[0][2]
    assert "straight from the cache" in epochs[1][2]


def test_the_readmes_first_command_prints_no_warning_without_numpy(tmp_path: Path) -> None:
    """Without numpy, importing torch warned "Failed to initialize NumPy" before the demo's first line (issue 18).

    The base install has no numpy: a module named numpy that cannot be imported stands in for
    its absence, and ``-W error`` turns any warning into a failure.
    """
    (tmp_path / "numpy.py").write_text('raise ModuleNotFoundError("No module named \'numpy\'", name="numpy")\n')
    result = subprocess.run(
        [sys.executable, "-W", "error", "-m", "koila_retry", "demo"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)]), "PYTHONWARNINGS": "error"},
        cwd=tmp_path,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert "Cache: 2 hits" in result.stdout


def test_demo_with_too_little_memory_for_the_model_reports_an_error_without_traceback() -> None:
    """Regression: building the model raised torch.OutOfMemoryError, which main() let through as a traceback."""
    result = run_cli("demo", "--memory", "1KiB")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("error:")


def test_demo_where_no_batch_size_fits_reports_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    # The model (5 MiB of parameters) fits in 6 MiB; its gradients do not, whatever the batch size.
    status = cli.main(["demo", "--memory", "6MiB", "--epochs", "1", "--initial", "4"])
    captured = capsys.readouterr()
    assert status == 1
    assert captured.err.startswith("error: ")
    assert "batch size 1 is the minimum" in captured.err
    assert captured.err.count("\n") == 1
    assert "(4 -> 2 -> 1)" in captured.err


def test_demo_narration_never_says_trying_none() -> None:
    """Regression: the last failure was narrated as 'trying None'."""
    lines: list[str] = []
    with pytest.raises(koila.BatchSizeExhausted):
        run_demo(limit="6MiB", initial=4, epochs=1, print_=lines.append)
    failures = [line for line in lines if "out of memory at batch size" in line]
    assert len(failures) == 3  # 4, 2, 1
    assert not any("None" in line for line in failures)


def test_unreadable_memory_is_a_one_line_usage_error() -> None:
    result = run_cli("demo", "--memory", "notasize")
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert lines[0].startswith("usage: python -m koila_retry demo ")  # the demo's usage, as for its options
    assert lines[-1].startswith("python -m koila_retry demo: error: ")
    assert [line for line in lines if "error" in line] == lines[-1:]
    assert "'notasize'" in lines[-1]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "shown"),
    [
        (["--initial", "0"], "got 0 and 3"),
        (["--initial", "-4"], "got -4 and 3"),
        (["--epochs", "0"], "got 8192 and 0"),
        (["--initial", "many"], "'many'"),
        (["--memory", "-1"], "'-1'"),
        (["--memory", "-5MiB"], "give --memory as a size of more than 0 bytes, like 48MiB, got '-5MiB'"),
        (["--memory=-5MiB"], "got '-5MiB'"),
        (["--memory", "0"], "got '0'"),
    ],
)
def test_bad_demo_arguments_exit_2(args: list[str], shown: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as excinfo:
        cli.main(["demo", *args])
    captured = capsys.readouterr()
    assert excinfo.value.code == 2
    errors = [line for line in captured.err.splitlines() if ": error: " in line]
    assert len(errors) == 1
    assert shown in errors[0]
    assert errors[0].startswith("python -m koila_retry demo: error: ")
    assert captured.err.startswith("usage: python -m koila_retry demo ")
    assert captured.out == ""


def test_a_command_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as excinfo:
        cli.main([])
    assert excinfo.value.code == 2
    assert "COMMAND" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as excinfo:
        cli.main(["--version"])
    assert excinfo.value.code == 0
    assert capsys.readouterr().out == f"koila-retry {koila.__version__}\n"


def test_run_demo_in_process_returns_the_settled_power_of_two() -> None:
    lines: list[str] = []
    settled = run_demo(print_=lines.append, epochs=2)
    assert isinstance(settled, int)
    assert is_power_of_two(settled)
    assert 1 <= settled < 8192
    epochs = [line for line in lines if line.startswith("epoch ")]
    assert len(epochs) == 2
    assert all(f"at batch size {settled} " in line for line in epochs)
    assert any("out of memory at batch size" in line for line in lines)
    assert "straight from the cache" in epochs[1]


def test_each_epoch_of_the_demo_reports_its_own_peak() -> None:
    lines: list[str] = []
    run_demo(initial=3000, epochs=2, print_=lines.append)
    peaks = [float(peak) for peak in re.findall(r"peak ([\d.]+) MiB\)$", "\n".join(lines), re.MULTILINE)]
    assert len(peaks) == 2
    assert peaks[1] < peaks[0]  # the first epoch's failed attempt at 3000 rows is not the second's


def test_run_demo_whose_first_size_fits_says_so_and_not_that_it_does_not() -> None:
    lines: list[str] = []
    assert run_demo("1GiB", initial=256, epochs=1, print_=lines.append) == 256
    text = "\n".join(lines)
    assert "does not fit" not in text
    assert "out of memory" not in text
    (epoch,) = [line for line in lines if line.startswith("epoch ")]
    assert "at the first size tried, no error" in epoch
    assert "straight from the cache" not in epoch  # the cache knew nothing yet
    assert "Cache: 0 hits, 1 miss." in text


# --- python -m koila_retry estimate ------------------------------------------------------

MODELS = """
import torch
from torch import nn


def mlp():
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))


class OnTheCpu(nn.Sequential):
    # The MLP, whose output goes to the CPU and meets a tensor made there.
    def __init__(self):
        super().__init__(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))

    def forward(self, x):
        return super().forward(x).cpu() * torch.ones(10)


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(self.conv(x).relu().mean((2, 3)))


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(100, 32)
        self.linear = nn.Linear(8, 32)

    def forward(self, ids, features):
        return self.embedding(ids).mean(1) + self.linear(features), ids


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(512, 512) for _ in range(4))
        self.head = nn.Linear(512, 10)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x).relu()
        return self.head(x)


def broken():
    raise ValueError("no weights here")


def not_a_model():
    return 42


def frozen():
    return nn.Linear(4, 4).requires_grad_(False)


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x)[x.nonzero()[:, 0]]


class ReadsAValue(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        hidden = self.linear(x)
        return hidden * 2 if hidden.sum().item() > 0 else hidden


def lazy():
    return nn.Sequential(nn.LazyLinear(4))


settings = {"not": "callable"}
"""

ROW = re.compile(r"^ *(\d+) +(\d+(?:\.\d+)? (?:bytes|KiB|MiB|GiB|TiB))(.*)$", re.MULTILINE)
LARGEST = re.compile(r"^largest batch size that fits in (.+) \(with a (\d+)% margin\): (\d+)$", re.MULTILINE)


@pytest.fixture(scope="module")
def models_folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    folder = tmp_path_factory.mktemp("models")
    (folder / "koila_cli_models.py").write_text(MODELS)
    yield folder
    sys.modules.pop("koila_cli_models", None)


@pytest.fixture
def models(models_folder: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The folder of the test factories, importable as ``koila_cli_models``."""
    monkeypatch.syspath_prepend(str(models_folder))
    return models_folder


def estimate_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    status = cli.main(["estimate", *args])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_estimate_prints_the_notes_of_what_it_could_not_see(models: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = estimate_cli(capsys, "koila_cli_models:ReadsAValue", "--input", "4", "--memory", "1MiB")
    assert status == 0
    notes = re.findall(r"^note: (.*)$", out, re.MULTILINE)
    assert len(notes) == 1
    assert notes[0].startswith("reading a float from a tensor")
    _, plain, _ = estimate_cli(capsys, "koila_cli_models:SmallCNN", "--input", "3x32x32", "--memory", "64MiB")
    assert "note:" not in plain


def table(out: str) -> dict[int, tuple[int, str]]:
    """Return the rows of the table: batch size -> (peak in bytes, give or take rounding; marker)."""
    rows = {}
    for size, peak, rest in ROW.findall(out):
        number, unit = peak.split()
        scale = 1 if unit == "bytes" else koila_units.parse_bytes(f"1{unit}")
        marker = next((marker for marker in ("fits, the largest", "fits") if rest.endswith(marker)), "")
        rows[int(size)] = (round(float(number) * scale), marker)
    return rows


def largest(out: str) -> int:
    found = LARGEST.findall(out)
    assert len(found) == 1, out
    return int(found[0][2])


def test_estimate_prints_a_header_a_table_and_the_largest_size_that_fits(
    models: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, err = estimate_cli(capsys, "koila_cli_models:SmallCNN", "--input", "3x32x32", "--memory", "64MiB")
    assert status == 0, err
    assert err == ""
    header = out.splitlines()[0]
    for part in ("SmallCNN", "618 parameters", "float32", "mode train", "optimizer adamw", "3x32x32", "device cpu"):
        assert part in header
    assert "budget 64.00 MiB" in header
    assert re.search(r"^batch size +peak +parameters +gradients +optimizer state +activations +temporaries$", out, re.M)
    rows = table(out)
    best = largest(out)
    assert "in 64.00 MiB (with a 10% margin)" in out
    assert re.search(r"^the estimate took \d+\.\d\d s", out, re.MULTILINE)
    assert is_power_of_two(best)
    assert list(rows) == [2**power for power in range(len(rows))]  # 1, 2, 4, ... with no gap
    assert max(rows) == max(64, 2 * best)
    # The sizes marked as fitting are those up to the largest, whose peak plus the margin fits.
    assert [size for size, (_, marker) in rows.items() if marker.startswith("fits")] == [s for s in rows if s <= best]
    assert rows[best][1] == "fits, the largest"
    assert rows[best][0] * 1.1 <= koila_units.parse_bytes("64MiB") * 1.01
    assert rows[2 * best][0] * 1.1 > koila_units.parse_bytes("64MiB") * 0.99
    peaks = [peak for peak, _ in rows.values()]
    assert peaks == sorted(peaks)


def test_more_memory_fits_a_larger_batch(models: Path, capsys: pytest.CaptureFixture[str]) -> None:
    answers = []
    for memory in ("16MiB", "256MiB", "4GiB"):
        status, out, _ = estimate_cli(capsys, "koila_cli_models:SmallCNN", "--input", "3x32x32", "--memory", memory)
        assert status == 0
        answers.append(largest(out))
    assert answers == sorted(answers)
    assert answers[0] < answers[-1]
    # A larger margin never fits more.
    _, out, _ = estimate_cli(
        capsys, "koila_cli_models:SmallCNN", "--input", "3x32x32", "--memory", "256MiB", "--margin", "1.5"
    )
    assert largest(out) <= answers[1]
    assert "(with a 150% margin)" in out


@pytest.mark.parametrize("mode", ["train", "infer"])
def test_a_lazy_module_is_estimated_in_both_modes(models: Path, capsys: pytest.CaptureFixture[str], mode: str) -> None:
    # In infer mode it failed with the estimate's advice, "run the model once on a real batch ... or pass
    # initial=", which a user of the command line cannot follow (probe 75B); train mode ran a step first.
    status, out, err = estimate_cli(capsys, "koila_cli_models:lazy", "--input", "8", "--memory", "1MiB", "--mode", mode)
    assert status == 0, err
    assert table(out)[8][0] > 0


def test_inference_needs_less_than_training(models: Path, capsys: pytest.CaptureFixture[str]) -> None:
    peaks = {}
    for mode in ("train", "infer"):
        status, out, _ = estimate_cli(
            capsys, "koila_cli_models:SmallCNN", "--input", "3x32x32", "--memory", "1GiB", "--mode", mode
        )
        assert status == 0
        assert f"mode {mode}" in out.splitlines()[0]
        peaks[mode] = table(out)
    assert "optimizer none" in out.splitlines()[0]
    for size in (1, 8, 64):
        assert peaks["infer"][size][0] < peaks["train"][size][0]
    # No gradients and no optimizer state without training.
    infer_row = next(line for line in out.splitlines() if re.match(r"^ +64 ", line))
    assert infer_row.split()[5:9] == ["0", "bytes", "0", "bytes"]


def test_an_optimizer_with_state_needs_more_than_plain_sgd(models: Path, capsys: pytest.CaptureFixture[str]) -> None:
    peaks = {}
    for optimizer in ("sgd", "adam"):
        status, out, _ = estimate_cli(
            capsys, "koila_cli_models:mlp", "--input", "64", "--memory", "1GiB", "--optimizer", optimizer
        )
        assert status == 0
        peaks[optimizer] = table(out)[1][0]
    assert peaks["sgd"] < peaks["adam"]


def test_training_is_estimated_with_the_optimizer_state_of_a_later_step(
    models: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Adam's state exists from the start of every step after the first: it is part of the peak at any size."""
    params = 64 * 256 + 256 + 256 * 10 + 10
    status, out, _ = estimate_cli(
        capsys, "koila_cli_models:mlp", "--input", "64", "--memory", "1GiB", "--optimizer", "adam"
    )
    assert status == 0
    state = re.compile(r"^ +(\d+) +\S+ \S+ +\S+ \S+ +\S+ \S+ +(\S+ \S+) ", re.MULTILINE)
    columns = {int(size): value for size, value in state.findall(out)}
    assert len(columns) >= 7
    for size, value in columns.items():  # exp_avg and exp_avg_sq, at every batch size, peak in any phase
        number, unit = value.split()
        assert float(number) * koila_units.parse_bytes(f"1{unit}") >= 2 * 4 * params * 0.99, (size, out)


def test_training_a_model_that_uses_the_cpu_is_estimated_as_the_same_model_that_does_not(
    models: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The warm-up step that makes the optimizer's state ran outside the estimate, which alone takes what
    # the model moves or makes on the CPU to meta: --mode train failed where --mode infer and
    # koila.estimate worked (probe 72C).
    found = []
    for target in ("koila_cli_models:mlp", "koila_cli_models:OnTheCpu"):
        status, out, err = estimate_cli(capsys, target, "--input", "64", "--memory", "1GiB", "--optimizer", "adam")
        assert (status, err) == (0, "")
        found.append({int(size): koila_units.parse_bytes(peak.replace(" ", "")) for size, peak, _ in ROW.findall(out)})
    assert len(found[0]) >= 7
    assert found[0].keys() == found[1].keys()
    for size, peak in found[0].items():  # as printed, to 0.01 KiB; and the ones, made anew each step
        assert abs(found[1][size] - peak) <= peak * 0.01 + 64, size


def test_several_inputs_with_their_dtypes_from_a_file_path(models: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = f"{models / 'koila_cli_models.py'}:TwoInputs"
    args = ["--input", "16", "--input", "8", "--memory", "1GiB", "--dtype", "bfloat16"]
    status, out, err = estimate_cli(capsys, target, *args, "--input-dtype", "int64", "--input-dtype", "bfloat16")
    assert status == 0, err
    header = out.splitlines()[0]
    assert "TwoInputs" in header
    assert "bfloat16)" in header
    assert "input 16 int64, 8 bfloat16" in header
    assert largest(out) >= 64
    # Token ids fed as floats fail inside the model: a one-line error.
    status, out, err = estimate_cli(capsys, target, *args, "--input-dtype", "float32")
    assert status == 1
    assert err.startswith("error: the estimate failed: ")
    assert err.count("\n") == 1


def test_a_long_table_shows_1_to_64_and_the_sizes_near_the_largest(
    models: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, _ = estimate_cli(capsys, "koila_cli_models:mlp", "--input", "64", "--memory", "4GiB")
    assert status == 0
    rows = table(out)
    best = largest(out)
    assert best >= 2**20
    assert len(rows) <= 20
    assert [size for size in rows if size <= 64] == [1, 2, 4, 8, 16, 32, 64]
    assert max(rows) == 2 * best
    assert re.search(r"^ +\.\.\.$", out, re.MULTILINE)


def test_device_rounds_while_memory_sets_the_budget(models: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = estimate_cli(
        capsys, "koila_cli_models:mlp", "--input", "64", "--memory", "1GiB", "--device", "cuda:0"
    )
    assert status == 0, err
    assert "device cuda:0, budget 1.00 GiB (--memory)" in out
    # The caching allocator's blocks of 512 bytes: 65536 + 1024 + 10240 + 512 bytes of parameters, not 76840.
    assert re.search(r"^ +1 +\S+ \S+ +75\.50 KiB ", out, re.MULTILINE)
    _, out, _ = estimate_cli(capsys, "koila_cli_models:mlp", "--input", "64", "--memory", "1GiB")
    assert re.search(r"^ +1 +\S+ \S+ +75\.04 KiB ", out, re.MULTILINE)


def test_without_memory_or_device_the_budget_is_the_cpus_free_memory(
    models: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, _ = estimate_cli(capsys, "koila_cli_models:SmallCNN", "--input", "3x32x32")
    assert status == 0
    assert "the CPU's free memory now" in out.splitlines()[0]


def test_when_not_even_a_batch_of_1_fits_the_status_is_1(models: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = estimate_cli(capsys, "koila_cli_models:SmallCNN", "--input", "3x32x32", "--memory", "1KiB")
    assert status == 1
    assert err == ""
    assert re.search(
        r"^not even a batch size of 1 fits in 1\.00 KiB \(with a 10% margin\): its estimated peak is .+$",
        out,
        re.MULTILINE,
    )
    assert not LARGEST.search(out)
    assert max(table(out)) == 64
    assert not any(marker for _, marker in table(out).values())


def test_fsdp_estimates_one_rank_of_a_sharded_model(models: Path, capsys: pytest.CaptureFixture[str]) -> None:
    found = {}
    for ranks in (None, "1", "8"):
        extra = [] if ranks is None else ["--fsdp", ranks]
        status, out, err = estimate_cli(
            capsys, "koila_cli_models:Blocks", "--input", "512", "--memory", "16MiB", *extra
        )
        assert err == ""
        if ranks is None:
            assert "FSDP2" not in out.splitlines()[0]
        else:
            assert f"one rank of FSDP2 over {ranks} (batch sizes per rank)" in out.splitlines()[0]
        found[ranks] = (status, table(out))
    # 4 MiB of weights, as much of gradients and twice as much of AdamW's state: 16 MiB fit it only sharded.
    assert found[None][0] == found["1"][0] == 1
    assert found["8"][0] == 0
    # FSDP2 over one rank gathers its blocks beside their shards: never less than unsharded.
    for size, (peak, _) in found[None][1].items():
        assert found["1"][1][size][0] >= peak > found["8"][1][size][0]


def test_plot_writes_a_png(models: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "peak.png"
    status, out, err = estimate_cli(
        capsys, "koila_cli_models:SmallCNN", "--input", "3x32x32", "--memory", "64MiB", "--plot", str(png)
    )
    assert status == 0, err
    assert out.splitlines()[-1] == f"wrote {png}"
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert png.stat().st_size > 1000


def test_plot_without_matplotlib_is_a_one_line_error(
    models: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)  # what an import finds: not installed
    png = tmp_path / "peak.png"
    status, out, err = estimate_cli(
        capsys, "koila_cli_models:SmallCNN", "--input", "3x32x32", "--memory", "64MiB", "--plot", str(png)
    )
    assert status == 2
    assert err == "error: --plot needs matplotlib: pip install matplotlib (koila-retry's plot extra)\n"
    assert out == ""
    assert not png.exists()


@pytest.mark.parametrize(
    ("target", "args", "code", "shown"),
    [
        ("koila_cli_no_such_module:make", [], 2, "no module named 'koila_cli_no_such_module'"),
        ("koila_cli_models:nothing", [], 2, "koila_cli_models has no attribute 'nothing'"),
        ("koila_cli_models:settings", [], 2, "koila_cli_models:settings is a dict, not a callable"),
        ("no/such/file.py:make", [], 2, "no file 'no/such/file.py'"),
        ("koila_cli_models:broken", [], 1, "koila_cli_models:broken() raised ValueError: no weights here"),
        ("koila_cli_models:not_a_model", [], 1, "returned an object of type int, not a torch.nn.Module"),
        ("koila_cli_models:frozen", [], 1, "nothing to train; try --mode infer"),
        ("koila_cli_models:mlp", ["--input", "3x3"], 1, "the estimate failed: RuntimeError: "),
        ("koila_cli_models:DataDependent", ["--input", "4"], 1, "the estimate failed: NotImplementedError: "),
        ("koila_cli_models:mlp", ["--device", "bogus"], 2, "--device: 'bogus' is not a device"),
        ("koila_cli_models:mlp", ["--input", "64", "--device", "meta"], 2, "--device meta has no memory to fill"),
        (
            "koila_cli_models:mlp",
            ["--input", "64", "--input-dtype", "float16"],
            1,
            "its operands must have the same dtype, but got float16 and float32",
        ),
        ("koila_cli_models:mlp", ["--memory", "1GiB", "--plot", "/no/such/folder/x.png"], 2, "--plot: no folder"),
        ("koila_cli_models:mlp", ["--memory", "1GiB", "--plot", "/tmp"], 2, "--plot: '/tmp' is a folder"),
        (
            "koila_cli_models:mlp",
            ["--input", "100000000000x100000000000"],
            2,
            "--input 100000000000x100000000000: a batch of 16 such samples is more than PyTorch can size",
        ),
        ("koila_cli_models:mlp", ["--input", "9" * 23], 2, f"--input {'9' * 23}: a batch of 16 such samples"),
    ],
    ids=[
        "no-module",
        "no-attribute",
        "not-callable",
        "no-file",
        "factory-raises",
        "not-a-module",
        "nothing-to-train",
        "wrong-shape",
        "data-dependent",
        "bad-device",
        "meta-device-without-memory",
        "input-of-another-dtype",
        "no-plot-folder",
        "plot-into-a-folder",
        "overflowing-shape",
        "size-past-int64",
    ],
)
def test_estimate_errors_are_one_line(
    target: str, args: list[str], code: int, shown: str, models: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if "--input" not in args:
        args = [*args, "--input", "64"]
    status, out, err = estimate_cli(capsys, target, *args)
    assert status == code
    assert err.startswith("error: ")
    assert err.count("\n") == 1
    assert shown in err
    assert "Traceback" not in err
    assert out == ""


@pytest.mark.parametrize("mode", ["train", "infer"])
def test_a_shape_made_from_values_says_why_the_estimate_cannot_know_it(
    mode: str, models: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only PyTorch's message was shown, which advises a compiler setting that does not help here."""
    status, out, err = estimate_cli(capsys, "koila_cli_models:DataDependent", "--input", "4", "--mode", mode)
    assert status == 1
    assert err.count("\n") == 1
    assert "depends on the values of a tensor, which an estimate cannot know" in err
    assert out == ""


def test_floats_given_to_an_embedding_suggest_integer_inputs(models: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 27: without --input-dtype int64, PyTorch's dtype error alone did not say what to change."""
    status, out, err = estimate_cli(capsys, "koila_cli_models:TwoInputs", "--input", "5", "--input", "8")
    assert status == 1
    assert out == ""
    assert err.count("\n") == 1
    assert err.startswith("error: the estimate failed: RuntimeError: Expected tensor for argument #1 'indices'")
    assert err.rstrip().endswith("give --input-dtype int64 (once for every input, or once per --input, in order)")
    # Given per input, as the hint says, it runs.
    status, out, err = estimate_cli(
        capsys,
        "koila_cli_models:TwoInputs",
        "--input",
        "5",
        "--input",
        "8",
        "--input-dtype",
        "int64",
        "--input-dtype",
        "float32",
        "--memory",
        "1GiB",
    )
    assert (status, err) == (0, "")
    assert "input 5 int64, 8 float32" in out.splitlines()[0]


@pytest.mark.parametrize(
    ("message", "about_indices"),
    [
        ("Expected tensor for argument #1 'indices' to have one of the following scalar types: Long, Int; but", True),
        ("expected indices to be long or int, got torch.float32", True),  # EmbeddingBag on meta tensors
        ("index_select(): Expected dtype int32 or int64 for index", True),
        ("gather(): Expected dtype int32/int64 for index, but got torch.float32", True),
        ("one_hot is only applicable to index tensor of type LongTensor.", True),
        ("tensors used as indices must be long, int, byte or bool tensors", True),
        ("expected target dtype to be Long or Byte, but got Float", True),  # labels given to a model
        ("mat1 and mat2 shapes cannot be multiplied (4x3 and 2x2)", False),
        ("expected m1 and m2 to have the same dtype, but got: float != long int", False),
        ("Sizes of tensors must match except in dimension 0. Expected size 3 but got size 4", False),
    ],
)
def test_the_dtype_hint_recognises_pytorchs_index_dtype_errors(message: str, about_indices: bool) -> None:
    assert bool(estimate_command.INDEX_DTYPE_ERROR.search(message)) is about_indices


def test_an_error_that_is_not_about_indices_gets_no_dtype_hint(
    models: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Floats of the wrong shape for the first Linear layer: the estimate fails, and no index is involved.
    status, _, err = estimate_cli(capsys, "koila_cli_models:mlp", "--input", "3x3")
    assert status == 1
    assert err.startswith("error: the estimate failed: RuntimeError: ")
    assert "--input-dtype" not in err


def test_the_example_in_the_help_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 27: the help's only example needed torchvision, which nothing installs."""
    with pytest.raises(SystemExit) as excinfo:
        cli.main(["estimate", "--help"])
    assert excinfo.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    at = lines.index("example, from the root of koila-retry's repository:")
    command = shlex.split(lines[at + 1])
    assert command[:4] == ["python", "-m", "koila_retry", "estimate"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(
        [sys.executable, *command[1:]], capture_output=True, text=True, env=env, cwd=REPO, timeout=240, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert largest(result.stdout) >= 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="reads the free memory of a CUDA device there is")
def test_free_memory_of_a_device_there_is_not_asks_for_memory(models: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = estimate_cli(capsys, "koila_cli_models:mlp", "--input", "64", "--device", "cuda")
    assert status == 2
    assert err.startswith("error: cannot read free memory of cuda:0")
    assert err.rstrip().endswith("give the budget with --memory")
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    ("args", "shown"),
    [
        (["koila_cli_models", "--input", "64"], "argument MODULE:FACTORY: give a module"),
        (["koila_cli_models:", "--input", "64"], "'koila_cli_models:'"),
        (["koila_cli_models:1x", "--input", "64"], "FACTORY must be a Python name"),
        (["koila_cli_models:mlp"], "the following arguments are required: --input"),
        (["koila_cli_models:mlp", "--input", "3x0x224"], "argument --input: give the shape of one sample"),
        (["koila_cli_models:mlp", "--input", "abc"], "'abc'"),
        (["koila_cli_models:mlp", "--input", "-1"], "'-1'"),
        (["koila_cli_models:mlp", "--input", "-3x3"], "argument --input: give the shape of one sample"),
        (["koila_cli_models:mlp", "--input", "64", "--memory", "24XB"], "argument --memory: cannot read '24XB'"),
        (
            ["koila_cli_models:mlp", "--input", "64", "--memory", "-5MiB"],
            "argument --memory: give a memory size of more than 0 bytes, like 24GiB, got '-5MiB'",
        ),
        (["koila_cli_models:mlp", "--input", "64", "--memory=-1.5GiB"], "more than 0 bytes, like 24GiB, got '-1.5GiB'"),
        (["koila_cli_models:mlp", "--input", "64", "--memory", "-5"], "more than 0 bytes, like 24GiB, got '-5'"),
        (["koila_cli_models:mlp", "--input", "64", "--memory", "0"], "more than 0 bytes, like 24GiB, got '0'"),
        # It was 1 byte, rounded down: a unit left out, not a fraction of a byte (probe 72C).
        (["koila_cli_models:mlp", "--input", "64", "--memory", "1.5"], "a whole number of bytes, got '1.5'"),
        (["koila_cli_models:mlp", "--input", "64", "--dtype", "float64"], "argument --dtype: invalid choice"),
        (["koila_cli_models:mlp", "--input", "64", "--optimizer", "lion"], "argument --optimizer: invalid choice"),
        (["koila_cli_models:mlp", "--input", "64", "--mode", "eval"], "argument --mode: invalid choice"),
        (["koila_cli_models:mlp", "--input", "64", "--input-dtype", "int8"], "argument --input-dtype: invalid"),
        (["koila_cli_models:mlp", "--input", "64", "--margin", "-0.1"], "argument --margin: give a fraction"),
        (["koila_cli_models:mlp", "--input", "64", "--fsdp", "0"], "argument --fsdp: expected the number of ranks"),
        (["koila_cli_models:mlp", "--input", "64", "--fsdp", "two"], "an int >= 1 like 8, got 'two'"),
        (
            ["koila_cli_models:mlp", "--input", "64", "--input-dtype", "int64", "--input-dtype", "float32"],
            "--input-dtype is given 2 times for 1 inputs",
        ),
    ],
    ids=[
        "no-colon",
        "no-factory",
        "factory-not-a-name",
        "no-input",
        "zero-size",
        "letters",
        "negative",
        "negative-shape",
        "memory-unit",
        "memory-negative",
        "memory-negative-attached",
        "memory-negative-number",
        "memory-zero",
        "memory-fraction-of-a-byte",
        "dtype",
        "optimizer",
        "mode",
        "input-dtype",
        "margin",
        "fsdp-zero",
        "fsdp-word",
        "input-dtype-count",
    ],
)
def test_bad_estimate_arguments_exit_2(
    args: list[str], shown: str, models: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as excinfo:
        cli.main(["estimate", *args])
    captured = capsys.readouterr()
    assert excinfo.value.code == 2
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert lines[0].startswith("usage: python -m koila_retry estimate")
    errors = [line for line in lines if line.startswith("python -m koila_retry estimate: error: ")]
    assert len(errors) == 1
    assert shown in errors[0]
    assert "Traceback" not in captured.err


def test_a_script_that_parses_its_arguments_when_imported_is_imported_without_ours(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # It read the CLI's own arguments, printed its usage and exited 2, with no error of ours (probe 72C).
    script = tmp_path / "train_script.py"
    script.write_text(
        "import argparse\nfrom torch import nn\nparser = argparse.ArgumentParser()\n"
        "parser.add_argument('--lr', type=float, default=0.1)\nargs = parser.parse_args()\n"
        "def make():\n    return nn.Linear(16, 4)\n"
    )
    status, out, err = estimate_cli(capsys, f"{script}:make", "--input", "16", "--memory", "1GiB")
    assert (status, err) == (0, "")
    assert LARGEST.search(out)
    assert sys.argv[0] != str(script)


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("import sys\nsys.exit(3)\ndef make():\n    pass\n", "importing {path} exited (status 3) instead of"),
        ("import sys\ndef make():\n    sys.exit()\n", "{path}:make() exited (status None) instead of building"),
        (
            "import sys\nfrom torch import nn\nclass Quits(nn.Linear):\n    def forward(self, x):\n"
            "        sys.exit(3)\ndef make():\n    return Quits(16, 4)\n",
            "running the model exited (status 3) on meta tensors: its forward must return, not exit",
        ),
    ],
    ids=["at-import", "in-the-factory", "in-the-forward"],
)
def test_a_module_or_factory_that_exits_is_an_error_not_a_success(
    text: str, shown: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # It exited with the status it chose, 0 for sys.exit(), and no table: a success that estimated nothing.
    script = tmp_path / "quits.py"
    script.write_text(text)
    status, _, err = estimate_cli(capsys, f"{script}:make", "--input", "16", "--memory", "1GiB")
    assert status == 1
    assert err.startswith(f"error: {shown.format(path=script)}")


def test_a_plot_path_with_bytes_that_are_not_utf_8_is_printed_escaped(
    models: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The file was written, then printing its name raised UnicodeEncodeError on a strict UTF-8 stdout.
    pytest.importorskip("matplotlib")
    name = os.fsdecode(bytes(tmp_path) + b"/peak\xff.png")
    strict = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict")
    monkeypatch.setattr(sys, "stdout", strict)
    status = cli.main(["estimate", "koila_cli_models:mlp", "--input", "64", "--memory", "1GiB", "--plot", name])
    strict.flush()
    assert status == 0
    assert os.path.exists(name)
    assert strict.buffer.getvalue().decode().splitlines()[-1] == f"wrote {tmp_path}/peak\\xff.png"  # type: ignore[attr-defined]


def test_the_demos_help_names_the_front_end_the_demo_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """The help said koila.accumulate splits each step; the demo runs each epoch under koila.batch (probe 61A)."""
    with pytest.raises(SystemExit) as excinfo:
        cli.main(["demo", "--help"])
    assert excinfo.value.code == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "koila.batch runs the epoch again at the next smaller power of two" in said  # not "half" (probe 70F)
    assert "accumulate" not in said


def test_help_lists_both_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as excinfo:
        cli.main(["--help"])
    assert excinfo.value.code == 0
    out = capsys.readouterr().out
    assert re.search(r"^ +demo +", out, re.MULTILINE)
    assert re.search(r"^ +estimate +", out, re.MULTILINE)


def test_usage_names_the_command_as_it_was_invoked(tmp_path: Path) -> None:
    """``koila-retry --help`` said ``usage: python -m koila_retry`` (issue 18)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    # What pip writes for the console script of setup.py: a file named koila-retry that calls main().
    assert "koila-retry=koila_retry.__main__:main" in (REPO / "setup.py").read_text(encoding="utf-8")
    script = tmp_path / "koila-retry"
    script.write_text("import sys\nfrom koila_retry.__main__ import main\nsys.exit(main())\n")
    for command, prog in (([str(script)], "koila-retry"), (["-m", "koila_retry"], "python -m koila_retry")):
        for args, usage in ((["--help"], f"usage: {prog} "), (["estimate", "--help"], f"usage: {prog} estimate ")):
            shown = subprocess.run(
                [sys.executable, *command, *args], capture_output=True, text=True, env=env, timeout=240, check=False
            )
            assert shown.returncode == 0, shown.stderr
            assert shown.stdout.startswith(usage), shown.stdout
        wrong = subprocess.run(
            [sys.executable, *command, "demo", "--memory", "notasize"],
            capture_output=True,
            text=True,
            env=env,
            timeout=240,
            check=False,
        )
        assert wrong.returncode == 2
        assert wrong.stderr.splitlines()[-1].startswith(f"{prog} demo: error: cannot read 'notasize'"), wrong.stderr


def test_estimate_in_a_subprocess_imports_from_the_current_directory(models_folder: Path) -> None:
    path = os.pathsep.join(filter(None, [str(REPO), str(models_folder), os.environ.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-m", "koila_retry", "estimate", "koila_cli_models:mlp", "--input", "64", "--memory", "1GiB"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": path},
        cwd=models_folder,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout.startswith("model Sequential (19.21 K parameters, float32), mode train, optimizer adamw")
    assert "in 1.00 GiB (with a 10% margin): " in result.stdout.splitlines()[-1]
    assert largest(result.stdout) > 64


OWN_OUTPUTS = """
import dataclasses

import torch
from torch import nn


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    hidden: torch.Tensor


class WithOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        hidden = self.linear(x)
        return Output(hidden.relu(), hidden)


class \u6a21\u578b(nn.Linear):
    def __init__(self):
        super().__init__(8, 8)


@dataclasses.dataclass(eq=False)
class Partial:
    logits: torch.Tensor
    aux: torch.Tensor = dataclasses.field(init=False)  # set in some modes only
    parent: object = None


class WithPartial(nn.Linear):
    def __init__(self):
        super().__init__(8, 8)

    def forward(self, x):
        out = Partial(super().forward(x))
        out.parent = out  # an output that holds itself
        return out


class Chatty(nn.Linear):
    def __init__(self):
        super().__init__(8, 8)

    def forward(self, x):
        print("forward", tuple(x.shape), "-" * 4000)
        return super().forward(x)
"""


@pytest.fixture
def own_outputs(tmp_path: Path) -> Path:
    path = tmp_path / "own_outputs.py"
    path.write_text(OWN_OUTPUTS, encoding="utf-8")
    return path


def test_a_class_name_the_output_s_encoding_lacks_is_escaped(own_outputs: Path) -> None:
    # print() raised UnicodeEncodeError under a latin-1 stdout, a traceback and exit status 1 (probe 77B).
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONIOENCODING": "latin-1"}
    args = ["estimate", f"{own_outputs}:\u6a21\u578b", "--input", "8", "--memory", "1MiB"]
    done = subprocess.run(
        [sys.executable, "-m", "koila_retry", *args], capture_output=True, env=env, timeout=240, check=False
    )
    assert done.returncode == 0, done.stderr
    assert b"model \\u6a21\\u578b (" in done.stdout


def _ends_quietly_when_its_reader_stops(*args: str, first: bytes) -> None:
    """Run the command until its first line, close the pipe it writes to, and check it ends with 141, silent."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    with subprocess.Popen(
        [sys.executable, "-m", "koila_retry", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    ) as process:
        assert process.stdout is not None
        assert process.stderr is not None
        assert process.stdout.readline().startswith(first)
        process.stdout.close()
        errors = process.stderr.read()
        assert process.wait(timeout=240) == 141
    assert errors == b""


def test_a_reader_that_stops_reading_ends_the_demo_quietly() -> None:
    # print() into the closed pipe of `| head -1` raised BrokenPipeError: a traceback and exit status 1 (probe 77B).
    _ends_quietly_when_its_reader_stops("demo", first=b"Training a 3-layer MLP")


@pytest.mark.parametrize("model", ["WithOutput", "WithPartial"])
def test_a_model_that_returns_a_dataclass_is_trained_on_its_floating_tensors(
    own_outputs: Path, capsys: pytest.CaptureFixture[str], model: str
) -> None:
    # Only mappings, lists and tuples were looked into: "no floating-point tensor to take a loss of" (probe 77B).
    # Then a field declared init=False and never set raised AttributeError, and one that held its output
    # recursed for ever (probe 77K).
    status, out, err = estimate_cli(capsys, f"{own_outputs}:{model}", "--input", "8", "--memory", "1MiB")
    assert (status, err) == (0, "")
    assert LARGEST.search(out)


def test_a_model_that_prints_to_a_reader_that_stops_reading_ends_quietly(own_outputs: Path) -> None:
    # The model's own print into the closed pipe was taken for the model's failure: "error: the estimate
    # failed: BrokenPipeError", status 1 (probe 77K).
    args = ("estimate", f"{own_outputs}:Chatty", "--input", "8", "--memory", "1MiB")
    _ends_quietly_when_its_reader_stops(*args, first=b"forward")


def test_no_stdout_at_all_is_no_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # pythonw, or a closed descriptor: the flush after the command raised AttributeError on None (probe 77K).
    monkeypatch.setattr(sys, "stdout", None)
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0


def test_a_broken_pipe_under_a_stdout_with_no_descriptor_ends_quietly(monkeypatch: pytest.MonkeyPatch) -> None:
    # Pointing stdout at /dev/null asked a StringIO for its descriptor: io.UnsupportedOperation (probe 77K).
    def broken(argv: object) -> int:
        raise BrokenPipeError

    monkeypatch.setattr(sys, "stdout", io.StringIO())
    monkeypatch.setattr(cli, "_main", broken)
    assert cli.main(["demo"]) == 141
