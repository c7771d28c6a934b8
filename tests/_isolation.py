"""Tests marked ``isolated`` run in a fresh interpreter, one per file: nothing a file leaves behind reaches the next.

The CUDA tests need it. A CUDA test sets its limit as a share of the card over what the
caching allocator holds, and what earlier files left there (segments half used by tensors
still alive, blocks cached) moves that limit: on an H200, 8 of 24 CUDA tests failed in one
process and every file passed alone (issue 38). ``tests/conftest.py`` marks every ``cuda``
test ``isolated`` where there is a CUDA device.

How: the first isolated test of a file to come up starts ``python -m pytest`` on every
selected isolated test of that file, in a child process with the same root, configuration
and options that matter (``-s``, ``--timeout``), and the child writes each report it makes to
a file. This process then hands those reports, one test at a time, to its own reporting, so
``-rA``, ``-x``, JUnit XML and pytest-xdist see them as if the tests had run here. A test the
child never finished (it crashed, or hung past the time allowed) is reported failed, with
the end of what the child wrote, never as passed.

The hooks are imported by ``tests/conftest.py``; ``tests/test_isolation.py`` tests them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

# Set in a child: the file its reports go to. A child never isolates again.
REPORTS = "KOILA_ISOLATED_REPORTS"
MARKER = "isolated"
# Seconds a child may take beyond its tests' own time limits before it is stopped.
SLACK = 120.0

_config: Any = None  # this process's, for the hook that writes a child's reports
_reports_to: str | None = None  # in a child, the file its reports go to
_results = pytest.StashKey[dict[str, list[pytest.TestReport]]]()
_notes = pytest.StashKey[dict[str, str]]()


def in_child() -> bool:
    """Return whether this process is a child that runs isolated tests (and reports them to its parent)."""
    return _reports_to is not None


def pytest_configure(config: pytest.Config) -> None:
    global _config, _reports_to
    _config = config
    # Taken out of the environment, so that the processes a test starts do not report too.
    _reports_to = os.environ.pop(REPORTS, None)
    config.stash[_results] = {}
    config.stash[_notes] = {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The first test of a file runs the whole file's child, which sets its own time limit per
    # test: the parent's per-test limit would stop the child in the middle.
    if in_child() or not config.pluginmanager.hasplugin("timeout"):
        return
    for item in items:
        if item.get_closest_marker(MARKER) is not None:
            item.add_marker(pytest.mark.timeout(0))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    if in_child() or item.get_closest_marker(MARKER) is None:
        return None
    results = item.config.stash[_results]
    if item.nodeid not in results:
        _run_file(item)
    reports = results.pop(item.nodeid)
    if not reports or reports[-1].when != "teardown":
        reports.append(_unfinished(item, reports))
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    for report in reports:
        item.ihook.pytest_runtest_logreport(report=report)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _reports_to is None:
        return
    data = _config.hook.pytest_report_to_serializable(config=_config, report=report)
    # One line a report, written as it comes: a child that dies keeps what it reported.
    with open(_reports_to, "a", encoding="utf-8") as file:
        file.write(json.dumps(data) + "\n")


def _run_file(first: pytest.Item) -> None:
    """Run every selected isolated test of ``first``'s file in one child; keep its reports by test."""
    config = first.config
    tests = [
        item
        for item in first.session.items
        if item.path == first.path
        and item.get_closest_marker(MARKER) is not None
        and item.nodeid not in config.stash[_results]
    ]
    with tempfile.TemporaryDirectory(prefix="koila-isolated-") as folder:
        where = Path(folder) / "reports.jsonl"
        where.touch()
        command = [sys.executable, "-m", "pytest", *_options(config), *(item.nodeid for item in tests)]
        shown = config.option.capture == "no"
        limit = _time_limit(config, tests)
        env = {**os.environ, REPORTS: str(where)}
        try:
            done = subprocess.run(
                command,
                cwd=config.rootpath,
                env=env,
                stdout=None if shown else subprocess.PIPE,
                stderr=None if shown else subprocess.STDOUT,
                text=True,
                timeout=limit,
                check=False,
            )
            ending = f"exited with status {done.returncode}"
            output = done.stdout or ""
        except subprocess.TimeoutExpired as stopped:
            ending = f"was stopped after {limit:.0f} s"
            written = stopped.stdout or ""
            output = written if isinstance(written, str) else written.decode(errors="replace")
        lines = where.read_text(encoding="utf-8").splitlines()
    found: dict[str, list[pytest.TestReport]] = defaultdict(list)
    for line in lines:
        report = config.hook.pytest_report_from_serializable(config=config, data=json.loads(line))
        if isinstance(report.longrepr, list):  # a skip's (path, line, reason), which JSON made a list
            report.longrepr = tuple(report.longrepr)
        found[report.nodeid].append(report)
    note = f"the process that ran {first.path.name} alone {ending}"
    if output:
        note += f"; its output ended:\n{output[-4000:]}"
    for item in tests:
        config.stash[_results][item.nodeid] = found.get(item.nodeid, [])
        config.stash[_notes][item.nodeid] = note


def _options(config: pytest.Config) -> list[str]:
    """Return the child's options: this configuration, quiet, and what changes how tests run."""
    options = ["--rootdir", str(config.rootpath), "-p", "no:cacheprovider", "-p", "no:xdist", "-qq", "--no-header"]
    if config.inipath is not None:
        options += ["-c", str(config.inipath)]
    if config.option.capture == "no":
        options.append("-s")
    timeout = getattr(config.option, "timeout", None)
    if timeout is not None:
        options.append(f"--timeout={timeout}")
    return options


def _time_limit(config: pytest.Config, tests: list[pytest.Item]) -> float | None:
    """Return the seconds the child may take: its tests' time limits added up, and some; ``None`` if they have none."""
    if not config.pluginmanager.hasplugin("timeout"):
        return None
    default = float(getattr(config.option, "timeout", None) or config.getini("timeout") or 0)
    total = 0.0
    for item in tests:
        marks = [mark for mark in item.iter_markers("timeout") if mark.args and mark.args[0] != 0]
        seconds = float(marks[0].args[0]) if marks else default
        if seconds <= 0:
            return None
        total += seconds
    return total + SLACK


def _unfinished(item: pytest.Item, reports: list[pytest.TestReport]) -> pytest.TestReport:
    """Return a failure for the phase of ``item`` that its child never reported."""
    when = "setup" if not reports else "call" if reports[-1].when == "setup" and reports[-1].passed else "teardown"
    return pytest.TestReport(
        item.nodeid,
        item.location,
        dict.fromkeys(item.keywords, 1),
        "failed",
        f"{item.nodeid} did not finish: {item.config.stash[_notes][item.nodeid]}",
        when,  # type: ignore[arg-type]
    )
