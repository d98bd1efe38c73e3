"""``leaderboard.html``: one self-contained static page (no network, no external files).

The tables come from the same display rows as the Markdown (:class:`petl.bench.table.Table`); this
module renders them and knows nothing of how a leaderboard is built.

The page opens on the main table (experiment, parameters, means, per-task accuracy: which method wins at
what budget), laid out to fit a 1400-pixel screen (headers wrap, spreads are set small); the legend and the
Pareto plot follow, then the details table (family, convergence, cost, published figures, configuration
and selection, whose long texts fold into a per-row disclosure), the learning curves and the published
per-task tables.  Every cell carries its sort key in
``data-sort``, so a click on a header sorts numerically even though the cell shows ``85.12 ± 0.31``.
Opening the page as ``leaderboard.html#sort=<column key>:<asc|desc>`` sorts on load (``#sort=ppt:desc``,
``#sort=task:vtab/dtd:asc``: a task column's key holds a colon), which makes a sorted view linkable (and lets the
tests check the sorting in a real browser).
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from html import escape

from petl.bench.table import Table

# An info cell longer than this many characters is shown folded (its start, a click opens it), but for a row's name.
LONG_TEXT = 50

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1em; color: #222; }
table { border-collapse: collapse; font-size: 13px; margin: 0.5em 0 1em; }
th, td { border: 1px solid #ccc; padding: 3px 4px; text-align: right; white-space: nowrap; }
.std { color: #777; font-size: 85%; }
th { background: #f0f0f0; cursor: pointer; user-select: none; white-space: normal; vertical-align: bottom; }
#leaderboard td:first-child, #leaderboard th:first-child { position: sticky; left: 0; }
#leaderboard td:first-child { background: #fff; }
th.info, td.info { text-align: left; }
td.info details[open] { white-space: normal; min-width: 24em; max-width: 40em; }
summary { cursor: pointer; }
details[open] > summary > span { display: none; }
p.lead { margin: 0.3em 0; }
img { max-width: 100%; }
th.published { background: #fdf1dc; }
td.published { background: #fffaf0; color: #555; font-style: italic; }
th[data-dir="asc"]::after { content: " \\25B2"; }
th[data-dir="desc"]::after { content: " \\25BC"; }
.wrap { overflow-x: auto; }
li { margin: 0.3em 0; }
"""

# Empty sort keys (a task not run yet) stay at the bottom whichever way a column is sorted.
_SCRIPT = """
function sortTable(table, col, dir) {
  var body = table.tBodies[0];
  var rows = Array.prototype.slice.call(body.rows);
  rows.sort(function (a, b) {
    var x = a.cells[col].getAttribute("data-sort"), y = b.cells[col].getAttribute("data-sort");
    if (x === "" || y === "") { return (x === "") - (y === ""); }
    var nx = Number(x), ny = Number(y);
    var c = (!isNaN(nx) && !isNaN(ny)) ? nx - ny : x.localeCompare(y);
    return dir === "asc" ? c : -c;
  });
  rows.forEach(function (row) { body.appendChild(row); });
  Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th, i) {
    if (i === col) { th.setAttribute("data-dir", dir); } else { th.removeAttribute("data-dir"); }
  });
}
document.querySelectorAll("table.sortable").forEach(function (table) {
  Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th, col) {
    th.addEventListener("click", function () {
      sortTable(table, col, th.getAttribute("data-dir") === "desc" ? "asc" : "desc");
    });
  });
});
(function () {
  var m = /^#sort=(.+):(asc|desc)$/.exec(decodeURIComponent(window.location.hash));  // a key may hold ":" (task:...)
  var table = document.getElementById("leaderboard");
  if (!m || !table) { return; }
  Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th, col) {
    if (th.getAttribute("data-key") === m[1]) { sortTable(table, col, m[2]); }
  });
})();
"""


def _table(table: Table, table_id: str, css_class: str = "") -> str:
    head = "".join(
        f'<th class="{h.kind}" data-key="{escape(h.key)}" title="click to sort">{escape(h.label)}</th>'
        for h in table.headers
    )
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="{h.kind}" data-sort="{escape(str(key))}">{_cell_text(text, h.kind, fold=i > 0)}</td>'
            for i, (h, (text, key)) in enumerate(zip(table.headers, cells, strict=True))
        )
        + "</tr>"
        for cells in table.rows
    )
    classes = " ".join(["sortable", *css_class.split()])
    return (
        f'<div class="wrap"><table class="{classes}" id="{table_id}"><thead><tr>{head}</tr></thead>'
        f"<tbody>{body}</tbody></table></div>"
    )


@dataclass(frozen=True)
class Section:
    """A section of its own under the legend: a heading, Markdown-lite lines, a table and a figure (each optional)."""

    title: str
    lines: list[str]
    table: Table | None = None
    png: bytes | None = None


def render_html(
    title: str,
    leaderboard: Table,
    details: Table,
    notes: list[str],
    figures: list[tuple[str, bytes]],
    extra: list[Table],
    summary: str = "",
    section: Section | None = None,
) -> str:
    """The page: main table, legend, first figure, details table, further figures, then the extra tables.

    Args:
        title: the page title.
        leaderboard: the main table (``id="leaderboard"``, sortable on load with ``#sort=key:dir``).
        details: the details table (``id="details"``, under ``details.title``).
        notes: legend lines, Markdown with only ``**bold**`` and ```code``` markup.
        figures: (heading, PNG) pairs, embedded as base64; the first (the Pareto plot) follows the legend,
            the others follow the details table.
        extra: further tables (the published per-task figures), each under its title and source.
        summary: a line under the title (what the page holds).
        section: a section after the first figure (the rank test: its sentences, table and diagram).

    """

    def figure(heading: str, png: bytes) -> list[str]:
        return [
            f"<h2>{escape(heading)}</h2>",
            f'<img alt="{escape(heading)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">',
        ]

    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{escape(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
        f'<p class="lead">{escape(summary)} Click a column header to sort; configuration, selection, convergence '
        "and cost of each experiment are in the details table below.</p>",
        _table(leaderboard, "leaderboard"),
        "<ul>" + "".join(f"<li>{_inline_markdown(escape(n))}</li>" for n in notes) + "</ul>",
    ]
    for heading, png in figures[:1]:
        parts += figure(heading, png)
    if section is not None:
        parts += [
            f"<h2>{escape(section.title)}</h2>",
            "<ul>" + "".join(f"<li>{_inline_markdown(escape(n))}</li>" for n in section.lines) + "</ul>",
        ]
        if section.table is not None:
            parts.append(_table(section.table, "ranks"))
        if section.png is not None:
            encoded = base64.b64encode(section.png).decode()
            parts.append(f'<img alt="{escape(section.title)}" src="data:image/png;base64,{encoded}">')
    parts += [f"<h2>{escape(details.title)}</h2>", _table(details, "details", "details")]
    for heading, png in figures[1:]:
        parts += figure(heading, png)
    for i, table in enumerate(extra):
        parts += [
            f"<h2>{escape(table.title)}</h2>",
            f"<p>Source: {escape(table.source)}.</p>",
            _table(table, f"published-{i}"),
        ]
    parts += [f"<script>{_SCRIPT}</script>", "</body></html>"]
    return "\n".join(parts) + "\n"


def _cell_text(text: str, kind: str, fold: bool = True) -> str:
    # fold=False: a row's name (the first column) is shown whole, with its mark (`*`): two long names that share
    # their start would read as one, and a folded `lora_... *` would hide that the row is not ranked.
    if fold and kind == "info" and len(text) > LONG_TEXT:
        # A long text (a configuration, the choices of a search) shows its start; a click opens the rest, so
        # that each row stays one line high.
        return f"<details><summary><span>{escape(text[: LONG_TEXT - 10])}…</span></summary>{escape(text)}</details>"
    # "85.12 ± 0.31": the mean is the figure to compare; the spread is set smaller and grey (narrower columns).
    mean, sep, spread = text.partition(" ± ")
    return escape(mean) + (f'<span class="std"> ± {escape(spread)}</span>' if sep else "")


def _inline_markdown(text: str) -> str:
    # notes() is written for Markdown; its only markup is **bold** and `code`.  A name holding * or ` comes escaped
    # (petl.bench.table.md_name): set aside before the split, as GitHub reads \*, and put back as the character.
    kept = re.findall(r"\\([\\*`])", text)
    text = re.sub(r"\\[\\*`]", "\0", text)
    for marker, tag in (("**", "b"), ("`", "code")):
        pieces = text.split(marker)
        text = "".join(f"<{tag}>{p}</{tag}>" if i % 2 else p for i, p in enumerate(pieces))
    for char in kept:
        text = text.replace("\0", char, 1)
    return text
