r"""One policy for outside text that petl reads and writes: file names in any encoding, cells a spreadsheet runs.

File names are bytes.  Python gives a name that is not UTF-8 as a ``str`` holding lone surrogates
(``surrogateescape``, PEP 383), which opens the file again but cannot be encoded as UTF-8: printed, written to
a CSV or JSON file or put in a message, it raises ``UnicodeEncodeError``.  So every name petl shows or writes
goes through :func:`shown` (its undecodable bytes as ``\xNN``, its control characters as ``\n``, ``\t``,
``\xNN``: a message or a table row stays one line), and every list of names petl reads goes
through :func:`read_names` (its undecodable bytes kept, so the named file still opens).  Text cells written
for spreadsheets go through :func:`csv_cell`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# Control characters (C0, DEL, C1) and the Unicode line and paragraph separators: each would break a line of a
# message or a table, or move the terminal's cursor.  Written as Python writes them in a string's repr.
_ESCAPES = {code: f"\\x{code:02x}" for code in (*range(0x20), *range(0x7F, 0xA0))}
_ESCAPES.update({0x09: "\\t", 0x0A: "\\n", 0x0D: "\\r", 0x2028: "\\u2028", 0x2029: "\\u2029"})


def shown(name: object) -> str:
    r"""A file name (or any text that holds one) as one line of UTF-8-safe text.

    Bytes that are not UTF-8 become ``\xNN``; control characters become ``\n``, ``\r``, ``\t`` or ``\xNN``, so
    that a name holding a newline cannot split a one-line error or a table row in two.

    Args:
        name: a path, or text (an error message...) that may hold one as Python decoded it from the file system.

    Returns:
        The same text where it was valid UTF-8 without control characters; each undecodable byte written as
        ``\xNN``, each control character escaped.

    """
    text = os.fspath(name) if isinstance(name, os.PathLike) else str(name)
    try:
        text = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a lone surrogate no file name gave (from JSON text, say)
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text.translate(_ESCAPES)


def read_names(path: Path) -> list[str]:
    """The non-blank lines of a list of file names, read as the file system reads names.

    UTF-8, with any other byte kept as it is (a Latin-1 ``é`` in the list names the Latin-1 file on disk).
    """
    text = path.read_bytes().decode("utf-8", "surrogateescape")
    return [line.strip() for line in text.splitlines() if line.strip()]


# A spreadsheet reads a cell that starts with one of these as a formula (=HYPERLINK(...) runs on a click).
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def csv_cell(value: Any) -> Any:
    """A text cell a spreadsheet shows as text: a leading formula character gets a ``'`` before it (OWASP)."""
    return f"'{value}" if isinstance(value, str) and value.startswith(FORMULA_START) else value


def first_line(text: object, default: str = "") -> str:
    """The first non-blank line of ``text`` (an error's message, say), stripped; ``default`` when there is none."""
    return next((line.strip() for line in str(text).splitlines() if line.strip()), default)


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """``1 epoch``, ``2 epochs``: a count and its noun, in the plural unless the count is one.

    Args:
        count: how many.
        noun: the singular noun.
        nouns: the plural where it is not ``noun + "s"`` (``plural(n, "run folder holds", "run folders hold")``).

    """
    return f"{count} {noun}" if count == 1 else f"{count} {nouns or noun + 's'}"
