"""accelerate's own tests of its memory helpers, run against accelerate and against our stand-in.

accelerate's ``tests/test_memory_utils.py`` is run twice, each time in a pytest of its
own in a subprocess: once as it is, and once with ``accelerate.utils``'
``find_executable_batch_size``, ``release_memory`` and ``should_reduce_batch_size``
replaced by ``koila_retry.compat.accelerate``'s (a ``conftest.py`` swaps them before the
file imports them). Every test that passes against accelerate must pass against the
stand-in.

The file is not part of this repository. It is taken, in this order, from:

* ``KOILA_ACCELERATE_TESTS``: the path of accelerate's ``tests/test_memory_utils.py``, of
  the ``tests`` folder, or of a checkout of accelerate (take the tag of the installed
  version, ``v1.15.0`` for the version in ``constraints.txt``);
* else the source distribution of the installed accelerate, downloaded with pip into a
  temporary folder (accelerate 1.15.0's has its ``tests``). Without network, or without
  the file in it, the test is skipped and says why, as it is without accelerate.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

import koila_retry

accelerate = pytest.importorskip("accelerate")

SUITE = "test_memory_utils.py"
ENVIRONMENT = "KOILA_ACCELERATE_TESTS"

# Loaded by the suite's pytest before the suite imports accelerate's helpers.
CONFTEST = textwrap.dedent(
    """
    import json
    import os

    import accelerate
    import accelerate.utils
    import accelerate.utils.memory

    if os.environ["KOILA_SUITE_HELPERS"] == "koila":
        from koila_retry.compat import accelerate as stand_in

        for module in (accelerate, accelerate.utils, accelerate.utils.memory):
            for name in stand_in.__all__:
                if hasattr(module, name):
                    setattr(module, name, getattr(stand_in, name))

    outcomes = {}


    def pytest_runtest_logreport(report):
        if report.when == "call" or report.outcome != "passed":
            outcomes[report.nodeid.split("::")[-1]] = report.outcome


    def pytest_sessionfinish(session):
        import koila_retry

        with open(os.environ["KOILA_SUITE_RESULTS"], "w") as file:
            json.dump(
                {
                    "outcomes": outcomes,
                    "helper": accelerate.utils.memory.find_executable_batch_size.__module__,
                    "koila_retry": koila_retry.__file__,
                },
                file,
            )
    """
)


def _given(path: Path) -> Path:
    for candidate in (path, path / SUITE, path / "tests" / SUITE):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{ENVIRONMENT}={str(path)!r} is neither accelerate's {SUITE} nor a folder with it")


def _downloaded(folder: Path) -> Path:
    """Return the suite from the source distribution of the installed accelerate; skip without one."""
    version = accelerate.__version__
    command = [sys.executable, "-m", "pip", "download", f"accelerate=={version}", "--no-deps"]
    command += ["--no-binary", ":all:", "--retries", "1", "--timeout", "20", "--quiet", "--dest", str(folder)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    except subprocess.TimeoutExpired:
        pytest.skip(f"pip could not download accelerate {version}'s source in 120 s (offline?); set {ENVIRONMENT}")
    archives = sorted(folder.glob("accelerate-*.tar.gz"))
    if done.returncode != 0 or not archives:
        why = (done.stderr.strip().splitlines() or ["no archive"])[-1]
        pytest.skip(f"pip could not download accelerate {version}'s source ({why}); set {ENVIRONMENT}")
    with tarfile.open(archives[0]) as archive:
        # The repository's own tests folder, at the top of the archive's one folder.
        member = next((name for name in archive.getnames() if name.split("/")[1:] == ["tests", SUITE]), None)
        content = archive.extractfile(member) if member is not None else None
        if content is None:
            pytest.skip(
                f"accelerate {version}'s source distribution has no tests/{SUITE}; set {ENVIRONMENT} to the file "
                f"in a checkout of accelerate at tag v{version} to run it"
            )
        suite = folder / SUITE
        suite.write_bytes(content.read())
    return suite


def _run(suite: Path, folder: Path, helpers: str) -> dict[str, object]:
    """Run the suite with accelerate's helpers or ours; return what its conftest recorded."""
    folder.mkdir()
    (folder / SUITE).write_bytes(suite.read_bytes())
    (folder / "conftest.py").write_text(CONFTEST)
    (folder / "pytest.ini").write_text("[pytest]\n")  # the suite's own rootdir: none of our settings
    results = folder / "results.json"
    ours = os.path.dirname(os.path.dirname(os.path.abspath(koila_retry.__file__)))
    env = {
        **os.environ,
        "KOILA_SUITE_HELPERS": helpers,
        "KOILA_SUITE_RESULTS": str(results),
        "PYTHONPATH": os.pathsep.join(filter(None, [ours, os.environ.get("PYTHONPATH")])),
    }
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", SUITE]
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert results.is_file(), f"the suite did not finish under {helpers}'s helpers:\n{done.stdout}\n{done.stderr}"
    recorded: dict[str, object] = json.loads(results.read_text())
    recorded["output"] = done.stdout[-4000:]
    return recorded


@pytest.mark.slow
def test_the_stand_in_passes_every_test_of_accelerates_suite_that_accelerate_passes(tmp_path: Path) -> None:
    given = os.environ.get(ENVIRONMENT)
    suite = _given(Path(given)) if given else _downloaded(tmp_path)
    theirs = _run(suite, tmp_path / "accelerate", "accelerate")
    ours = _run(suite, tmp_path / "koila", "koila")
    assert theirs["helper"] == "accelerate.utils.memory"
    assert ours["helper"] == "koila_retry.compat.accelerate"  # the swap took effect
    assert ours["koila_retry"] == koila_retry.__file__
    their_outcomes, our_outcomes = theirs["outcomes"], ours["outcomes"]
    assert isinstance(their_outcomes, dict)
    assert isinstance(our_outcomes, dict)
    assert set(our_outcomes) == set(their_outcomes)
    passed_by_accelerate = {name for name, outcome in their_outcomes.items() if outcome == "passed"}
    passed_by_ours = {name for name, outcome in our_outcomes.items() if outcome == "passed"}
    assert passed_by_accelerate, f"no test of the suite passed against accelerate:\n{theirs['output']}"
    missing = sorted(passed_by_accelerate - passed_by_ours)
    assert not missing, (
        f"pass against accelerate, not against koila_retry.compat.accelerate: {missing}\n{ours['output']}"
    )
