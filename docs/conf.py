"""Sphinx configuration for the koila-retry documentation."""

from __future__ import annotations

import collections.abc
import doctest
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# Document the source tree next to this file, whether or not the package is installed.
sys.path.insert(0, str(ROOT))

_VERSION_FILE = (ROOT / "koila_retry" / "_version.py").read_text(encoding="utf-8")
_match = re.search(r'^__version__ = "([^"]+)"', _VERSION_FILE, re.MULTILINE)
if _match is None:
    raise RuntimeError("cannot find __version__ in koila_retry/_version.py")

project = "koila-retry"
author = "The koila-retry authors"
copyright = author
release = _match.group(1)
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.doctest",
    "sphinx.ext.viewcode",
]

exclude_patterns = ["_build"]
# Every cross-reference must resolve, except to objects no page here documents: with no
# intersphinx (the build must not fetch anything), Python's and PyTorch's own are among them.
nitpicky = True
nitpick_ignore_regex = [
    # Words of the docstrings' "Args:" types that napoleon turns into references:
    # "int, optional", "callable", "iterable of int", "sequence of str",
    # "tensor or structure of tensors".
    ("py:class", r"optional|callable|iterable|sequence|tensors?|structure"),
    ("py:(class|exc|func|obj|data)", r"(torch|collections\.abc|abc|types|typing|functools|os|transformers)\..+"),
    ("py:class", r"FrameType|Hashable|ProcessGroup|DistributedDataParallel"),
]

# autodoc: the docstrings carry the types in their Args sections, so signatures show
# names and defaults only (this also shows the real signature of the overloaded batch()).
autodoc_member_order = "bysource"
autodoc_typehints = "none"

# napoleon: Google style only.
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# doctest: ELLIPSIS and NORMALIZE_WHITESPACE, as in the pytest configuration (pyproject.toml).
# The pages' ">>>" examples run here. The "Example::" blocks of the docstrings are literal
# blocks, which this builder does not run; pytest runs them with --doctest-modules.
doctest_default_flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE | doctest.DONT_ACCEPT_TRUE_FOR_1

# furo (pinned in tox.ini's docs env): a content column wide enough for the code blocks,
# which tests/test_docs_width.py keeps within what it shows without scrolling sideways.
html_theme = "furo"
html_title = f"koila-retry {release}"
# No "View source" link to the page's reStructuredText, and no copy of it in the build.
html_show_sourcelink = False
html_copy_source = False


def _public_bases(app: object, name: str, obj: object, options: object, bases: list[object]) -> None:
    # SizeCache's store, Sizes, is private: the docs name the mapping it is.
    bases[:] = [collections.abc.MutableMapping if getattr(base, "__name__", "") == "Sizes" else base for base in bases]


def setup(app: Any) -> None:
    app.connect("autodoc-process-bases", _public_bases)
