"""``benchmarks/gpu_session.py``: the one command a session with a GPU runs, checked on the CPU."""

from __future__ import annotations

import shlex
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from _benchmarks import BENCHMARKS, imported

ROOT = BENCHMARKS.parent


@pytest.fixture(scope="module")
def session() -> Iterator[ModuleType]:
    with imported("gpu_session") as module:
        yield module


def _help(argv: tuple[str, ...]) -> str:
    done = subprocess.run([*argv, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    return done.stdout


def test_every_command_of_the_plan_takes_the_options_it_is_given(session: ModuleType) -> None:
    commands = session.plan()
    assert [command.log for command in commands] == ["pytest.log", "bench.log", "ddp-nccl.log"]
    for command in commands:
        program = command.argv[:3] if command.argv[1] == "-m" else command.argv[:2]
        if command.argv[1] != "-m":
            assert (ROOT / command.argv[1]).is_file(), command.argv[1]
        options = [word for word in command.argv[len(program) :] if word.startswith("--")]
        text = _help(program)
        for option in options:
            assert option in text, f"{option} is not an option of {' '.join(program)}"
    markers = subprocess.run(
        [sys.executable, "-m", "pytest", "--markers"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert "@pytest.mark.cuda" in markers


def test_each_log_starts_with_its_command_and_ends_with_its_exit_status(session: ModuleType, tmp_path: Path) -> None:
    commands = [
        session.Command("ok.log", (sys.executable, "-c", "print('hello')"), 60),
        session.Command("fails.log", (sys.executable, "-c", "import sys; print('bye'); sys.exit(3)"), 60),
    ]
    outcomes = session.run_plan(commands, tmp_path, budget=1000, clock=lambda: 0.0)
    assert [outcome for _, outcome in outcomes] == ["exit status 0", "exit status 3"]
    ok = (tmp_path / "ok.log").read_text().splitlines()
    assert ok[0] == f"$ {shlex.join(commands[0].argv)}"
    assert ok[1] == "hello"
    assert ok[-1] == "exit status: 0 (0 s)"
    fails = (tmp_path / "fails.log").read_text().splitlines()
    assert fails[1] == "bye"
    assert fails[-1] == "exit status: 3 (0 s)"


def test_a_command_that_could_outlast_what_is_left_of_the_budget_is_not_started(
    session: ModuleType, tmp_path: Path
) -> None:
    # The readings: the start, before the first command, as it starts and ends (it took 250 s), before the second.
    readings = iter([0.0, 0.0, 0.0, 250.0, 250.0])
    commands = [
        session.Command("first.log", (sys.executable, "-c", "pass"), 150),
        session.Command("second.log", (sys.executable, "-c", "pass"), 150),
    ]
    outcomes = session.run_plan(commands, tmp_path, budget=400, clock=lambda: next(readings))
    # 380 s to spend (20 kept back): the first starts with 380 left; the second would have 130.
    assert outcomes[0][1] == "exit status 0"
    assert outcomes[1][1] == "not run: 130 s left, it may take 150 s"
    assert not (tmp_path / "second.log").exists()


def test_a_command_past_its_timeout_is_killed_and_its_log_says_so(session: ModuleType, tmp_path: Path) -> None:
    command = session.Command("slow.log", (sys.executable, "-c", "import time; time.sleep(60)"), 1)
    outcomes = session.run_plan([command], tmp_path, budget=1000, clock=lambda: 0.0)
    assert outcomes[0][1] == "killed after its timeout of 1 s"
    assert (tmp_path / "slow.log").read_text().splitlines()[-1] == "killed after its timeout of 1 s (0 s)"


@pytest.mark.parametrize(("code", "status"), [("print('fine')", 0), ("raise SystemExit(2)", 1)])
def test_the_run_comes_back_as_one_archive(
    session: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: str, status: int
) -> None:
    """Only ``run.tar.gz`` in ``--out``: the device tool brings back eight files at most."""
    monkeypatch.setattr(session, "plan", lambda: [session.Command("step.log", (sys.executable, "-c", code), 60)])
    monkeypatch.setattr(session, "environment", lambda commit: f"commit: {commit}\n")
    out = tmp_path / "out"
    assert session.main(["--out", str(out), "--name", "2026-11-28-h200", "--commit", "abc1234"]) == status
    assert [path.name for path in out.iterdir()] == ["run.tar.gz"]
    with tarfile.open(out / "run.tar.gz") as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    folder = tmp_path / "unpacked" / "2026-11-28-h200"
    assert sorted(path.name for path in folder.iterdir()) == ["README.md", "env.txt", "step.log"]
    assert (folder / "env.txt").read_text() == "commit: abc1234\n"
    readme = (folder / "README.md").read_text()
    assert f"| `step.log` | `{sys.executable} -c " in readme
    assert ("exit status 0" if status == 0 else "exit status 2") in readme


def test_it_needs_out_unless_it_only_prints_the_plan(session: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    assert session.main(["--dry-run"]) == 0
    assert "pytest.log (timeout 240 s)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        session.main([])
    assert exit_info.value.code == 2
