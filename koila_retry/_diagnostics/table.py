"""Tables of figures, as aligned text for a terminal and as HTML for Jupyter."""

from __future__ import annotations

import html
from collections.abc import Sequence


def text_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    numeric: frozenset[str] = frozenset(),
    title: str = "",
    footer: Sequence[str] = (),
) -> str:
    """Return formatted ``rows`` as aligned columns, one line per row; the ``numeric`` headers' are right-aligned."""
    widths = [len(header) for header in headers]
    for row in rows:
        widths = [max(width, len(cell)) for width, cell in zip(widths, row, strict=True)]

    def line(cells: Sequence[str]) -> str:
        aligned = (
            cell.rjust(width) if header in numeric else cell.ljust(width)
            for header, cell, width in zip(headers, cells, widths, strict=True)
        )
        return "  ".join(aligned).rstrip()

    lines = [title] if title else []
    lines += [line(headers), "  ".join("-" * width for width in widths)]
    lines += [line(row) for row in rows]
    lines += footer
    return "\n".join(lines)


def html_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    numeric: frozenset[str] = frozenset(),
    title: str = "",
    footer: Sequence[str] = (),
) -> str:
    """Return formatted ``rows`` as an HTML table in a ``<div>``, every cell escaped."""

    def cell(tag: str, header: str, text: str) -> str:
        style = ' style="text-align: right"' if header in numeric else ' style="text-align: left"'
        return f"<{tag}{style}>{html.escape(text)}</{tag}>"

    parts = ["<div>", "<table>"]
    if title:
        parts.append(f"<caption>{html.escape(title)}</caption>")
    parts.append("<thead><tr>" + "".join(cell("th", header, header) for header in headers) + "</tr></thead>")
    parts.append("<tbody>")
    parts += ["<tr>" + "".join(cell("td", h, c) for h, c in zip(headers, row, strict=True)) + "</tr>" for row in rows]
    parts += ["</tbody>", "</table>"]
    parts += [f"<p>{html.escape(line)}</p>" for line in footer]
    parts.append("</div>")
    return "\n".join(parts)
