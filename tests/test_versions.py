"""The version gate: the estimate warns once when torch is outside the versions its rules were checked on."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

import koila_retry as koila
from koila_retry._estimation import versions
from koila_retry._estimation.versions import RULE_SETS, checked_minor, unchecked, warn_if_unchecked


@pytest.fixture(autouse=True)
def _fresh_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start each test with the gate not yet run, and give the process its own state back after it."""
    monkeypatch.setattr(versions, "_warned", False)


def _gate_warnings(version: str | None = None) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_if_unchecked(version)
    return [w for w in caught if "checked on" in str(w.message)]


@pytest.mark.parametrize(
    ("version", "minor"),
    [
        ("2.13.0", "2.13"),
        ("2.13.0+cpu", "2.13"),
        ("2.13.0a0+git1234abc", "2.13"),
        ("2.13.1+cu130", "2.13"),
        ("2.11.0+cu130", "2.11"),
        ("3.0.0.dev20270101", "3.0"),
        ("nightly", "nightly"),
    ],
)
def test_local_and_development_builds_count_as_their_release(version: str, minor: str) -> None:
    assert checked_minor(version) == minor


def test_an_unchecked_torch_is_warned_about_once_naming_both_versions() -> None:
    found = _gate_warnings("2.99.0+cu999")
    assert len(found) == 1
    assert found[0].category is UserWarning
    message = str(found[0].message)
    assert "torch 2.99.0+cu999" in message
    for rules in RULE_SETS:  # every rule set is outside 2.99, each with where it was checked
        assert f"{rules.name} ({rules.where}): checked on torch {', '.join(rules.checked)}" in message
    assert 'initial="auto" and suggest_batch_size(calibrate=True)' in message
    assert "report" in message
    assert _gate_warnings("2.99.0") == []  # once per process
    assert _gate_warnings("2.98.0") == []


def test_a_checked_torch_is_silent() -> None:
    assert _gate_warnings("2.13.0+cpu") == []
    assert _gate_warnings("2.99.0") == []  # the check ran: silent from then on too


def test_only_the_rule_sets_outside_the_version_are_named() -> None:
    checked_on_2_11 = [rules for rules in RULE_SETS if "2.11" in rules.checked]
    assert checked_on_2_11, "the allocator's rounding was exact on the 2.11 run"
    message = str(_gate_warnings("2.11.0+cu130")[0].message)
    for rules in RULE_SETS:
        assert (rules.name in message) == (rules not in checked_on_2_11)
    assert unchecked("2.11.0") == [rules for rules in RULE_SETS if rules not in checked_on_2_11]


def test_the_gate_judges_again_after_a_reset() -> None:
    assert len(_gate_warnings("2.99.0")) == 1
    versions.reset_warning()
    assert len(_gate_warnings("2.99.0")) == 1


def test_the_installed_torch_is_judged_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert versions.installed == str(torch.__version__)
    monkeypatch.setattr(versions, "installed", "2.99.0")
    assert "torch 2.99.0 " in str(_gate_warnings()[0].message)


def test_every_rule_set_names_versions_someone_checked() -> None:
    for rules in RULE_SETS:
        assert rules.checked, rules.name
        assert all(checked_minor(version) == version for version in rules.checked)
    # The installed torch is one of them: this suite's tests derive the tables from it.
    assert unchecked(str(torch.__version__)) == []


def test_racing_threads_warn_once() -> None:
    start = threading.Barrier(8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        def call() -> None:
            start.wait()
            warn_if_unchecked("2.99.0")

        threads = [threading.Thread(target=call) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert len([w for w in caught if "checked on" in str(w.message)]) == 1


def test_an_estimate_under_an_unchecked_torch_warns_at_the_callers_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(versions, "installed", "2.99.0")
    model = torch.nn.Linear(4, 2)
    x = torch.randn(8, 4)
    with pytest.warns(UserWarning, match=r"torch 2\.99\.0 is not a version") as caught:
        koila.estimate(model, x)
    gate = [w for w in caught if "checked on" in str(w.message)]
    assert len(gate) == 1
    assert gate[0].filename == __file__  # the user's line, not the library's
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        koila.estimate(model, x)  # once per process: the second estimate is silent


def test_an_estimate_under_the_installed_torch_is_silent() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        koila.estimate(torch.nn.Linear(4, 2), torch.randn(8, 4))
