"""The package's namespace: ``koila.testing`` is there when used, and costs nothing until then (issue 18)."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import koila_retry as koila

REPO = Path(__file__).resolve().parents[1]

# Run in a fresh interpreter: this one's tests have imported koila_retry.testing long ago.
PROBE = """
import json, sys
import koila_retry as koila
seen = {"loaded at import": "koila_retry.testing" in sys.modules, "listed": "testing" in dir(koila)}
# transformers is optional: nothing imports it until the user's code does.
seen["transformers"] = "transformers" in sys.modules
error = koila.testing.make_oom()
seen["is oom"] = koila.is_oom(error)
seen["the module"] = koila.testing is sys.modules["koila_retry.testing"]
print(json.dumps(seen))
"""


def test_testing_is_an_attribute_loaded_when_first_used() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=240, check=False
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {
        "loaded at import": False,
        "listed": True,
        "transformers": False,
        "is oom": True,
        "the module": True,
    }


def test_testing_is_public_and_other_names_still_raise() -> None:
    assert "testing" in koila.__all__
    assert "testing" in dir(koila)
    from koila_retry import testing

    assert koila.testing is testing
    with pytest.raises(AttributeError, match="module 'koila_retry' has no attribute 'tesitng'"):
        koila.tesitng  # noqa: B018


def test_every_public_callable_s_type_hints_resolve_at_run_time() -> None:
    # Tools that read annotations (sphinx-autodoc-typehints, typeguard, pydantic) call get_type_hints:
    # a name the annotations use only under TYPE_CHECKING (Unpack, os) raised NameError there.
    import inspect
    import typing

    from koila_retry.compat import accelerate, toma
    from koila_retry.integrations import lightning, transformers

    checked = []
    for owner in (koila, toma, accelerate, transformers, lightning):
        for name in getattr(owner, "__all__", ()):
            value = getattr(owner, name)
            if inspect.isfunction(value) or inspect.isclass(value):
                for target in (value, value.__init__) if inspect.isclass(value) else (value,):
                    typing.get_type_hints(target)
                    checked.append(name)
    assert {"Options", "accumulate", "attempts", "batch", "chunked", "range", "OOMRecovery", "adapt"} <= set(checked)


PUBLIC_MODULES = [
    "koila_retry",
    "koila_retry.testing",
    "koila_retry.compat.accelerate",
    "koila_retry.compat.toma",
    "koila_retry.integrations.transformers",
    "koila_retry.integrations.lightning",
]


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_the_api_reference_lists_every_public_name(module: str) -> None:
    """Every name in a public module's ``__all__`` is in docs/api.rst (compat.toma's two data lacked, probe 61A)."""
    if module.endswith("lightning"):
        pytest.importorskip("lightning")
    text = (REPO / "docs" / "api.rst").read_text()
    members = {name.strip() for line in re.findall(r":members: (.*)", text) for name in line.split(",")}
    missing = []
    for name in importlib.import_module(module).__all__:
        directive = rf"^\.\. \w+:: (?:{re.escape(module)}(?:\.|::)(?:\w+\.)?)?{re.escape(name)}(?:\(\))?$"
        if not (re.search(directive, text, re.MULTILINE) or name in members or f"``{module}.{name}``" in text):
            missing.append(name)
    assert missing == []
