"""The evidence of every GPU run is in the repository, and what cites it can be opened (issue 38).

Each run's logs are committed under ``benchmarks/runs/<date>-<gpu>/``, with a ``RECORD.md`` that says
where the commands, the commit, ``nvidia-smi``, the torch, CUDA and cuDNN versions and the full output
are, or that they were not kept. A document, docstring or comment cites a log by its path there; a log
that was written elsewhere and lost (the old ``gpu-runs`` folder outside the repository) is cited only
beside the words "log not kept". Checked on the text of the checkout, without a GPU.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "benchmarks" / "runs"
GPU_PAGE = ROOT / "docs" / "gpu.rst"
# The rows every RECORD.md has, in its table's first column.
ITEMS = ("command", "commit", "nvidia-smi", "torch, CUDA, cuDNN", "full output")
CITATION = re.compile(r"benchmarks/runs/[\w./-]*")
LOST_FOLDER = re.compile(r"gpu-runs", re.IGNORECASE)
NOT_KEPT = re.compile(r"logs? (?:was |were )?not kept", re.IGNORECASE)
# How far from a citation of the lost folder its "log not kept" may be, in characters of the text with
# line breaks, indentation and comment marks folded into single spaces: a sentence or two.
NEAR = 200
RUN_NAME = re.compile(r"\d{4}-\d{2}-\d{2}-[a-z0-9]+(?:-[a-z0-9]+)*")


def runs() -> list[str]:
    """The run folders under benchmarks/runs/, by name."""
    return sorted(path.name for path in RUNS.iterdir() if path.is_dir()) if RUNS.is_dir() else []


def sources() -> list[Path]:
    """The files that may cite a run: README, DEVELOPERS.md, the docs, the package, the tests, the runs' indexes."""
    found = [ROOT / "README.rst", ROOT / "DEVELOPERS.md", RUNS / "README.md"]
    found += sorted(path for path in (ROOT / "docs").rglob("*.rst") if "_build" not in path.parts)
    found += sorted((ROOT / "koila_retry").rglob("*.py"))
    found += sorted((ROOT / "tests").glob("*.py"))
    found += sorted(RUNS.glob("*/RECORD.md"))
    return [path for path in found if path.is_file() and path != Path(__file__).resolve()]


def folded(text: str) -> str:
    """The text with line breaks, indentation and comment marks as single spaces, as a reader sees a sentence."""
    return re.sub(r"(?:\s*#\s*|\s)+", " ", text)


def record_rows(run: str) -> dict[str, list[str]]:
    """The table of a run's RECORD.md: each row's first cell, lower case, to its cells."""
    rows = {}
    for line in (RUNS / run / "RECORD.md").read_text(encoding="utf-8").splitlines():
        if line.startswith("|"):
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            rows[cells[0].lower()] = cells
    return rows


def test_every_cited_run_file_is_in_the_repository() -> None:
    """Each path under benchmarks/runs/ that a file cites exists in the checkout."""
    missing = []
    for path in sources():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            for cited in CITATION.findall(line):
                if not (ROOT / cited.rstrip(".")).exists():
                    missing.append(f"{path.relative_to(ROOT)}:{number}: {cited}")
    assert missing == []


def test_a_log_kept_outside_the_repository_is_cited_only_as_not_kept() -> None:
    """Each mention of the lost gpu-runs folder has "log not kept" beside it."""
    unmarked = []
    for path in sources():
        text = path.read_text(encoding="utf-8")
        for found in LOST_FOLDER.finditer(text):
            before = folded(text[max(0, found.start() - 4 * NEAR) : found.start()])[-NEAR:]
            after = folded(text[found.start() : found.end() + 4 * NEAR])[: NEAR + len(found.group())]
            if not NOT_KEPT.search(before + after):
                number = text.count("\n", 0, found.start()) + 1
                unmarked.append(f"{path.relative_to(ROOT)}:{number}")
    assert unmarked == []


def test_there_are_runs_on_record() -> None:
    """benchmarks/runs/ holds at least the two runs whose logs survived."""
    assert {"2026-11-25-h100", "2026-11-28-h200"} <= set(runs())


@pytest.mark.parametrize("run", runs())
def test_a_run_folder_is_named_by_its_date_and_gpu(run: str) -> None:
    """A run's folder is <date>-<gpu>, in lower case."""
    assert RUN_NAME.fullmatch(run)


@pytest.mark.parametrize("run", runs())
def test_a_run_folder_records_where_each_required_item_is(run: str) -> None:
    """RECORD.md names, for every required item, files of the folder that hold it, or says it was not kept."""
    assert (RUNS / run / "RECORD.md").is_file()
    rows = record_rows(run)
    for item in ITEMS:
        assert item.lower() in rows, f"{run}/RECORD.md has no row for {item!r}"
        cells = rows[item.lower()]
        where = cells[1] if len(cells) > 1 else ""
        named = re.findall(r"`([^`]+)`", where)
        assert named or "not kept" in where.lower(), f"{run}: {item}: {where!r}"
        assert [name for name in named if not (RUNS / run / name).is_file()] == [], f"{run}: {item}"


@pytest.mark.parametrize("run", runs())
def test_a_run_folder_holds_small_text_files(run: str) -> None:
    """Every file of a run is text, and small: logs, not data sets or binaries."""
    for path in (RUNS / run).rglob("*"):
        if path.is_file() and "__pycache__" not in path.parts:
            assert path.stat().st_size < 256 * 1024, path.name
            path.read_text(encoding="utf-8")


@pytest.mark.parametrize("run", runs())
def test_docs_gpu_cites_every_run_folder(run: str) -> None:
    """docs/gpu.rst names each run's folder, so every run on record is in the docs."""
    assert f"benchmarks/runs/{run}/" in GPU_PAGE.read_text(encoding="utf-8")
