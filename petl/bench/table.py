"""A rendered table: headers and (text, sort key) cells, and its Markdown; the HTML writer receives the same.

Its own small module so that :mod:`petl.bench.html` renders tables without importing the report that
builds them (the report imports the renderers, never the other way round).
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass

Cell = tuple[str, float | str]  # (display text, sort key); an empty sort key sorts last either way


@dataclass(frozen=True)
class Header:
    """A displayed column: a stable key (the HTML's sort links), its label, and measured/published/info."""

    key: str
    label: str
    kind: str = "measured"


@dataclass(frozen=True)
class Table:
    """Headers and rows of cells, one cell per header; ``title``/``source`` head the extra tables."""

    headers: list[Header]
    rows: list[list[Cell]]
    title: str = ""
    source: str = ""


def md_escape(text: str) -> str:
    """Markdown cell text: names and options come from result.json files, so no HTML gets through, and no
    newline ends a table row.
    """
    text = html.escape(text, quote=False).replace("|", "\\|")
    return text.replace("\r\n", "<br>").replace("\n", "<br>").replace("\r", "<br>")


def md_name(text: str) -> str:
    """A name (an experiment's, a task's) set in a Markdown sentence: its backslashes, ``*`` and backticks escaped, so
    that none opens bold or code there (the HTML page reads the escapes as GitHub does: :mod:`petl.bench.html`).
    """
    return re.sub(r"([\\*`])", r"\\\1", text)


def markdown_lines(table: Table) -> list[str]:
    """The table as Markdown lines: info columns left-aligned, the others right-aligned."""
    lines = [
        "| " + " | ".join(md_escape(h.label) for h in table.headers) + " |",
        "|" + "|".join("---" if h.kind == "info" else "---:" for h in table.headers) + "|",
    ]
    lines += ["| " + " | ".join(md_escape(text) for text, _ in cells) + " |" for cells in table.rows]
    return lines
