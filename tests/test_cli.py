"""Tests for the command line, ``python -m koila_retry``, and the demo behind it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import koila_retry as koila
from koila_retry import __main__ as cli
from koila_retry._demo import run_demo

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
    assert lines[0].startswith("usage: ")
    assert len(lines) == 2
    assert lines[1].startswith("python -m koila_retry: error: ")
    assert "'notasize'" in lines[1]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "shown"),
    [
        (["--initial", "0"], "got 0 and 3"),
        (["--initial", "-4"], "got -4 and 3"),
        (["--epochs", "0"], "got 8192 and 0"),
        (["--initial", "many"], "'many'"),
        (["--memory", "-1"], "'-1'"),
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
