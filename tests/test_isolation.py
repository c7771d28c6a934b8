"""Isolated test files run in fresh interpreters, and what they report is what this run reports (issue 38).

``tests/_isolation.py`` runs every CUDA test file in a process of its own on a CUDA device, so
that what one file leaves in the caching allocator cannot move the next file's limits. These
tests show it without a GPU, on small projects made for them in a temporary folder and run by
``python -m pytest`` as a user would run the suite:

* with the CUDA tests' stand-ins (``tests/_fake_cuda.py``'s CUDA device made of numbers, and
  ``tests/_devices.py``'s simulated device), a file that leaves its device state behind changes
  the outcome of the next file in one process, and cannot once the files are isolated;
* the outcomes the children report (passed, failed with its traceback, skipped, xfailed, a
  crash, a test left out by ``-k``) are the ones the parent run reports and exits with.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

pytestmark = pytest.mark.slow

# The project's conftest, reduced to the isolation's hooks and the marker.
CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
from _isolation import (
    pytest_collection_modifyitems, pytest_configure, pytest_runtest_logreport, pytest_runtest_protocol,
)

def pytest_configure(config, _configure=pytest_configure):
    config.addinivalue_line("markers", "isolated: runs in a process of its own, with its file")
    config.addinivalue_line("markers", "cuda: needs a CUDA device")
    _configure(config)
"""

# Leaves what a leaky CUDA test file would: tensors kept alive past its tests (the half-used
# segments), and a device whose readings are never given back.
LEAVES = """
import os, pytest, torch
import _devices
from _fake_cuda import FakeCuda, GiB

def test_leaves_its_device_behind():
    with _devices.SimulatedStandIn().measuring() as meter:
        _devices.LEFT_BEHIND = [torch.empty(3 * 2**20 + 7, dtype=torch.uint8)]
        assert meter.allocated() == 3 * 2**20 + 7
    FakeCuda(reserved=12 * GiB, allocated=6 * GiB).install(pytest.MonkeyPatch())
    assert torch.cuda.is_available()
    print("pid", os.getpid())
"""

# What every CUDA test file assumes: a device no earlier file has used.
CHECKS = """
import gc, os, torch
import _devices
import koila_retry as koila

def test_finds_the_device_as_no_one_used_it():
    print("pid", os.getpid())
    assert not torch.cuda.is_available(), "a device left installed by an earlier file"
    assert not hasattr(_devices, "LEFT_BEHIND")
    sizes = {obj.nbytes for obj in gc.get_objects() if isinstance(obj, torch.Tensor)}
    assert 3 * 2**20 + 7 not in sizes, "tensors left alive by an earlier file"
    with _devices.SimulatedStandIn().limited(2**20) as meter:
        torch.empty(2**20, dtype=torch.uint8)
    assert meter.peak() == 2**20

def test_shares_its_files_process():
    print("pid", os.getpid())
"""


def _project(root: Path, files: dict[str, str]) -> Path:
    (root / "conftest.py").write_text(CONFTEST)
    (root / "pytest.ini").write_text("[pytest]\n")
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def _pytest(root: Path, *options: str) -> tuple[subprocess.CompletedProcess[str], dict[str, str]]:
    """Run pytest on the project as a user would; return the run and each test's outcome from its JUnit XML."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}
    junit = root / "junit.xml"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", f"--junitxml={junit}", *options],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    outcomes = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}.{case.get('name')}"
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        skipped = case.find("skipped")
        if skipped is not None and skipped.get("type") == "pytest.xfail":
            kinds = ["xfailed"]
        outcomes[name] = kinds[0] if kinds else "passed"
    return done, outcomes


def test_a_file_that_leaves_its_device_behind_cannot_change_the_next_isolated_files_outcome(tmp_path: Path) -> None:
    marked = "import pytest\npytestmark = pytest.mark.isolated\n"
    root = _project(
        tmp_path,
        {
            "test_1_isolated_leaves.py": marked + LEAVES,
            "test_2_isolated_checks.py": marked + CHECKS,
            "test_3_shared_leaves.py": LEAVES,
            "test_4_shared_checks.py": CHECKS,
        },
    )
    done, outcomes = _pytest(root, "-s", "-rA")
    assert outcomes == {
        "test_1_isolated_leaves.test_leaves_its_device_behind": "passed",
        "test_2_isolated_checks.test_finds_the_device_as_no_one_used_it": "passed",
        "test_2_isolated_checks.test_shares_its_files_process": "passed",
        "test_3_shared_leaves.test_leaves_its_device_behind": "passed",
        # The same file, run after the same leaky one in one process: the leftovers show.
        "test_4_shared_checks.test_finds_the_device_as_no_one_used_it": "failure",
        "test_4_shared_checks.test_shares_its_files_process": "passed",
    }, done.stdout + done.stderr
    assert "a device left installed by an earlier file" in done.stdout
    assert done.returncode == 1
    # Every test printed its process: the isolated files ran in two processes of their own
    # (both tests of a file in one), the shared ones in the run's.
    pids = re.findall(r"pid (\d+)", done.stdout)
    assert len(pids) == 6, done.stdout
    isolated_leaves, isolated_check, isolated_shares, shared_leaves, shared_check, shared_shares = pids
    assert isolated_check == isolated_shares
    assert len({isolated_leaves, isolated_check, shared_leaves}) == 3
    assert shared_leaves == shared_check == shared_shares


OUTCOMES = """
import os, sys, pytest
pytestmark = pytest.mark.isolated

def test_passes():
    pass

def test_fails():
    print("what the failing test printed")
    assert 1 + 1 == 3, "the assertion's own message"

def test_is_skipped():
    pytest.skip("skipped for its own reason")

@pytest.mark.xfail(reason="expected to fail", strict=True)
def test_is_expected_to_fail():
    assert False

def test_is_left_out_by_k():
    open(os.path.join(os.path.dirname(__file__), "ran"), "w").close()
"""

CRASHES = """
import os, pytest
pytestmark = pytest.mark.isolated

def test_runs_first():
    pass

def test_ends_the_process():
    os._exit(3)

def test_never_runs():
    pass
"""


def test_what_the_children_report_is_what_the_run_reports(tmp_path: Path) -> None:
    root = _project(tmp_path, {"test_outcomes.py": OUTCOMES, "test_crashes.py": CRASHES})
    done, outcomes = _pytest(root, "-rA", "-k", "not left_out")
    assert outcomes == {
        "test_outcomes.test_passes": "passed",
        "test_outcomes.test_fails": "failure",
        "test_outcomes.test_is_skipped": "skipped",
        "test_outcomes.test_is_expected_to_fail": "xfailed",
        "test_crashes.test_runs_first": "passed",
        "test_crashes.test_ends_the_process": "failure",
        # Never started: an error in its setup, as pytest reports a test that could not begin.
        "test_crashes.test_never_runs": "error",
    }, done.stdout + done.stderr
    assert not (root / "ran").exists()  # -k reached the child
    assert done.returncode == 1
    # The child's traceback and captured output, in the parent's report.
    assert "the assertion's own message" in done.stdout
    assert "what the failing test printed" in done.stdout
    assert "skipped for its own reason" in done.stdout
    assert "did not finish: the process that ran test_crashes.py alone exited with status 3" in done.stdout


def test_a_run_whose_isolated_tests_pass_passes(tmp_path: Path) -> None:
    root = _project(tmp_path, {"test_outcomes.py": OUTCOMES})
    done, outcomes = _pytest(root, "-k", "passes or skipped or expected")
    assert sorted(outcomes.values()) == ["passed", "skipped", "xfailed"], done.stdout
    assert done.returncode == 0, done.stdout
