"""The code blocks of the docs and of the README fit their column without scrolling sideways.

The docs use furo (``docs/conf.py``). Its content column is 46em, 736 px, at any window
width from 1072 px up, 1280 and 1366 px laptops included; a code block's text, 13 px
monospace inside 14 px of padding each side, has 708 px of it. Measured in Chromium with
Liberation Mono (0.6em a character, as Menlo and DejaVu Sans Mono), 90 characters fit
and a 91st scrolls; ``MAX_CODE_LINE`` leaves two for fonts a little wider. A block inside
a list item, a definition, a field or a quote has less room: 19 px less in a list item,
40 px in a definition, 59 px in a list item in a definition. ``NESTED_COST`` takes five
characters (39 px) for each container around the block. GitHub shows the README's blocks
in a column about as wide, at 13.6 px, so they keep the same limits.

The parser reads the reStructuredText a line at a time: the indented block after a code
directive (``code-block``, ``code``, ``sourcecode``, ``doctest``, ``testcode``,
``testoutput``) or after a paragraph that ends in ``::``, and every doctest block, a
paragraph whose first line starts with ``>>>``. A line's length is counted from the
block's own indentation, as the page shows it; the containers around a block are the
less indented lines it sits under.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

MAX_CODE_LINE = 88
NESTED_COST = 5

# Directives whose content the page shows as code; testsetup and testcleanup are not shown.
_CODE_DIRECTIVE = re.compile(r"^\s*\.\.\s+(code-block|code|sourcecode|doctest|testcode|testoutput)::")
_EXPLICIT_MARKUP = re.compile(r"^\s*\.\.(\s|$)")
_LIST_MARKER = re.compile(r"^\s*(?:[-*+]|\d+\.|#\.|\(?[0-9a-z]\))\s+")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _depth(lines: list[str], index: int, indent: int) -> int:
    """How many containers hold the text that ``lines[index]`` starts at column ``indent``.

    Each one is a line above it, less indented than those inside: a list item's marker,
    a definition's term, a directive, a field, the paragraph before a quote.
    """
    depth = 0
    for line in reversed(lines[: index + 1]):
        if indent == 0:
            break
        if line.strip() and _indent(line) < indent:
            depth += 1
            indent = _indent(line)
    return depth


def _paragraph_indent(lines: list[str], last: int) -> int:
    """The indentation of the text of the paragraph whose last line is ``lines[last]``.

    That of its lines after the first; for a one-line paragraph that starts a list item
    ("* ...", "1. ...", "#. ..."), where the item's text starts.
    """
    if last > 0 and lines[last - 1].strip():
        return _indent(lines[last])
    marker = _LIST_MARKER.match(lines[last])
    return marker.end() if marker is not None else _indent(lines[last])


def _block_after(lines: list[str], start: int, parent_indent: int) -> list[tuple[int, str]]:
    """The lines of the indented block that starts at or after ``start``: (line number, text).

    The block holds every line indented more than ``parent_indent`` up to the first
    non-blank line that is not; the text is what the page shows, without the block's
    common indentation and without a directive's leading ``:option:`` lines.
    """
    end = start
    while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > parent_indent):
        end += 1
    body = list(range(start, end))
    # A directive's options come first, right under it: ":caption: ...", ":emphasize-lines: 2".
    while body and lines[body[0]].strip() and lines[body[0]].lstrip().startswith(":"):
        body.pop(0)
    content = [number for number in body if lines[number].strip()]
    if not content:
        return []
    indent = min(_indent(lines[number]) for number in content)
    return [(number + 1, lines[number][indent:]) for number in content]


def code_lines(text: str) -> Iterator[tuple[int, str, int]]:
    """Every line that a code block of the reStructuredText ``text`` shows.

    Yields (line number, text, how many containers hold the block).
    """
    lines = text.expandtabs(8).splitlines()
    number = 0
    while number < len(lines):
        line = lines[number]
        stripped = line.strip()
        ends_paragraph = number + 1 == len(lines) or not lines[number + 1].strip()
        if _CODE_DIRECTIVE.match(line):
            parent = _indent(line)
        elif stripped.endswith("::") and ends_paragraph and not _EXPLICIT_MARKUP.match(line):
            # A literal block: the lines after the paragraph indented more than its text.
            parent = _paragraph_indent(lines, number)
        elif stripped.startswith(">>>") and (number == 0 or not lines[number - 1].strip()):
            # A doctest block: the paragraph, to its blank line, output included.
            indent = _indent(line)
            depth = _depth(lines, number, indent)
            while number < len(lines) and lines[number].strip():
                yield number + 1, lines[number][indent:], depth
                number += 1
            continue
        else:
            number += 1
            continue
        depth = _depth(lines, number, parent)
        block = _block_after(lines, number + 1, parent)
        for line_number, code in block:
            yield line_number, code, depth
        number = block[-1][0] if block else number + 1


def _too_long(name: str, text: str) -> list[str]:
    """A line for each code line of ``text`` longer than its limit: file, line number, length."""
    found = []
    for number, line, depth in code_lines(text):
        limit = MAX_CODE_LINE - NESTED_COST * depth
        if len(line) > limit:
            found.append(f"{name}:{number}: {len(line)} characters, at most {limit} here: {line.strip()}")
    return found


def _file_too_long(path: Path) -> list[str]:
    return _too_long(path.relative_to(ROOT).as_posix(), path.read_text(encoding="utf-8"))


@pytest.mark.parametrize("name", sorted(path.name for path in (ROOT / "docs").glob("*.rst")))
def test_docs_code_lines_fit_the_column(name: str) -> None:
    """No line of a code block of a page in docs/ is longer than its column shows."""
    too_long = _file_too_long(ROOT / "docs" / name)
    assert not too_long, "\n".join(too_long)


def test_readme_code_lines_fit_the_column() -> None:
    """No line of a code block of README.rst is longer than its column shows."""
    too_long = _file_too_long(ROOT / "README.rst")
    assert not too_long, "\n".join(too_long)


def test_the_parser_finds_every_kind_of_code_block() -> None:
    """code_lines reads directives with options, literal blocks, doctest blocks, nesting, and nothing else."""
    text = "\n".join(
        [
            "A paragraph, not code, however long it is" + " word" * 30 + ".",
            "",
            ".. code-block:: python",
            "   :caption: an option, not code",
            "",
            "   def f():",
            "       return 1",
            "",
            "After the block::",
            "",
            "    literal",
            "",
            ".. note::",
            "",
            "   Not code: a note's text.",
            "",
            "   >>> 1 + 1",
            "   2",
            "",
            ".. testsetup::",
            "",
            "   hidden = True",
            "",
            "* A list item whose paragraph ends in::",
            "",
            "    in the item",
            "",
            "  The item's text again, not code.",
            "",
            "term",
            "    A definition, with a list:",
            "",
            "    * item",
            "",
            "      .. code:: text",
            "",
            "         two levels down",
            "",
            "Text again.",
        ]
    )
    assert list(code_lines(text)) == [
        (6, "def f():", 0),
        (7, "    return 1", 0),
        (11, "literal", 0),
        (17, ">>> 1 + 1", 1),
        (18, "2", 1),
        (26, "in the item", 1),
        (37, "two levels down", 2),
    ]


def test_a_line_too_long_is_named() -> None:
    """A line over its limit is reported with its file, line number, length and limit."""
    top = "x" * (MAX_CODE_LINE + 1)
    nested = "y" * MAX_CODE_LINE
    text = f"Before::\n\n    {top}\n    {'z' * MAX_CODE_LINE}\n\n* item::\n\n    {nested}\n"
    limit = MAX_CODE_LINE - NESTED_COST
    assert _too_long("page.rst", text) == [
        f"page.rst:3: {MAX_CODE_LINE + 1} characters, at most {MAX_CODE_LINE} here: {top}",
        f"page.rst:8: {MAX_CODE_LINE} characters, at most {limit} here: {nested}",
    ]


def _docstring_examples() -> Iterator[tuple[str, int, str]]:
    """Each doctest line of the package's docstrings: its place, and the line as the API page shows it.

    The page shows an example inside the object's entry, a definition: from the indentation
    of its block's first ``>>>`` line on.
    """
    for path in sorted((ROOT / "koila_retry").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            docstring = ast.get_docstring(node, clean=True)
            if docstring is None:
                continue
            indent = 0
            for line in docstring.splitlines():
                stripped = line.lstrip(" ")
                if stripped.startswith(">>>") and (not indent or _indent(line) != indent):
                    indent = _indent(line)
                if stripped.startswith((">>>", "...")):
                    yield f"{path.relative_to(ROOT)} ({getattr(node, 'name', 'module')})", indent, line[indent:]


def test_the_api_pages_examples_fit_their_column() -> None:
    """The examples of the public docstrings fit the API page, where each sits in its object's entry."""
    limit = MAX_CODE_LINE - NESTED_COST
    too_long = [
        f"{where}: {len(shown)} characters, at most {limit}: {shown}"
        for where, _, shown in _docstring_examples()
        if len(shown) > limit
    ]
    assert not too_long, "\n".join(too_long)
    assert len(list(_docstring_examples())) > 50  # the examples were found
