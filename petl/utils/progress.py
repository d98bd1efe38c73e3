"""Progress bars: every bar petl shows (epochs, feature caching, calibrations, sweeps, predictions) comes from here.

One rule for all of them, tqdm's own convention for ``disable=None``: a bar is drawn where stderr is a terminal, and
not where it goes to a file or a pipe (a job scheduler's log, CI, ``nohup``), where each redraw would be one more
carriage-return update in the file, thousands a run.  There the commands say what a bar would in lines of their own:
``petl-run`` logs a line per epoch, ``petl-pretrain`` prints one, a ``petl-bench`` sweep one per run it starts, and
the other long pieces of work (feature caching, calibrations, predictions) a few ``NAME: K/N UNITs`` lines each
(:class:`ProgressLines`, through the ``say`` a caller gives :func:`progress_bar`).  A notebook (Jupyter, VS Code,
Colab) draws its bars as widgets, whatever its streams say.  A caller's own switch (``train.progress=false``,
``progress=false``, ``--no-progress``, ``--quiet``) still hides a bar, and its lines, anywhere.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from itertools import islice
from typing import Any

from tqdm.auto import tqdm

from petl.utils.text import plural

# A hidden bar's lines: one as each tenth more of the work is done, or as a minute passes with some done (a NOAH
# supernet epoch can take minutes), so a log gets about a dozen lines for a piece of work, not one per item.
LINE_FRACTION = 0.1
LINE_SECONDS = 60.0
# The units petl's bars count whose plural is not the unit and an s ("epochs", "runs", "imgs"; "epoches" was said).
IRREGULAR_UNITS = {"batch": "batches"}


def bars_shown() -> bool:
    """Whether petl draws progress bars here: in a notebook, or where stderr is a terminal."""
    if any(base.__module__ == "tqdm.notebook" for base in tqdm.__mro__):  # tqdm.auto found a notebook: widgets
        return True
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # no stderr (pythonw), or one already closed
        return False


class ProgressLines:
    """What a bar that is not drawn says in lines: ``NAME: K/N UNITs`` at the start, every tenth or minute, at the end.

    It answers what petl's callers ask of a bar: iterating, ``update``, ``set_postfix`` (said after the count on the
    next line) and ``close``.

    Args:
        iterable: what it counts (None: updated by hand).
        say: writes one line (the caller's ``log.info``, or its print to stderr).
        desc: the work's name, first on each line.
        total: how many in all (None: ``len(iterable)`` where it has one, else the lines give the count alone).
        unit: what is counted, in the singular (None: the count alone, ``3/10``).
        initial: how many were done before (a resumed search's).
        delay: no line until this many seconds have passed (tqdm's ``delay``): work that ends sooner says nothing.

    """

    disable = False  # what a caller reading ``bar.disable`` (the sweep) asks: lines stand in for a bar here

    def __init__(
        self,
        iterable: Iterable | None,
        say: Callable[[str], Any],
        desc: str,
        total: int | None = None,
        unit: str | None = None,
        initial: int = 0,
        delay: float = 0.0,
    ) -> None:
        if total is None:
            try:
                total = len(iterable)  # type: ignore[arg-type]
            except TypeError:  # None, a generator, a loader over an iterable dataset: no total known
                pass
        self.iterable, self.say, self.desc, self.total, self.unit = iterable, say, desc, total, unit
        self.n = initial
        self.postfix = ""
        self._until = time.monotonic() + delay
        self._said, self._said_at = initial, time.monotonic()
        self._line()

    def _line(self) -> None:
        if time.monotonic() < self._until:
            return
        # "3/16 batches", "1/1 epoch": the noun agrees with the last number.
        if self.unit is None:
            count = f"{self.n}/{self.total}" if self.total is not None else str(self.n)
        elif self.total is None:
            count = plural(self.n, self.unit, IRREGULAR_UNITS.get(self.unit))
        else:
            count = f"{self.n}/{plural(self.total, self.unit, IRREGULAR_UNITS.get(self.unit))}"
        self.say(f"{self.desc}: {count}{self.postfix}")
        self._said, self._said_at = self.n, time.monotonic()

    def __iter__(self) -> Iterator:
        for item in self.iterable if self.iterable is not None else ():
            yield item
            self.update()
        self.close()  # as tqdm's bar does at the end (with no total known, the only line after the first)

    def update(self, n: int = 1) -> None:
        """Count ``n`` more done; say so if the end, another tenth or a minute was reached since the last line."""
        self.n += n
        tenth = self.total is not None and self.n - self._said >= LINE_FRACTION * self.total
        if self.n == self.total or tenth or time.monotonic() - self._said_at >= LINE_SECONDS:
            self._line()

    def set_postfix(self, **values: Any) -> None:
        """What the next line says after the count (``loss 1.234``), as a bar's postfix."""
        self.postfix = "".join(f", {key} {value}" for key, value in values.items())

    def close(self) -> None:
        """Say how far the work came, unless the last line did (stopped early: fewer than the total)."""
        if self.n != self._said:
            self._line()


def first(iterable: Iterable, count: int | None) -> tuple[Iterable, int | None]:
    """The first ``count`` items of ``iterable`` (all of them for None), and how many that is where it has a length:
    a bar over them then counts to what is done, not to the whole of ``iterable``.
    """
    try:
        total = len(iterable)  # type: ignore[arg-type]
    except TypeError:  # a generator, a loader over an iterable dataset: no length known
        total = None
    if count is None:
        return iterable, total
    return islice(iterable, count), count if total is None else min(total, count)


def progress_bar(
    iterable: Iterable | None = None, *, show: bool = True, say: Callable[[str], Any] | None = None, **kwargs: Any
) -> tqdm | ProgressLines:
    """A tqdm bar (``tqdm.auto``'s: a widget in a notebook), drawn where :func:`bars_shown` says and ``show`` is True.

    Args:
        iterable: what the bar counts, as tqdm's first argument (None: updated by hand, with ``total=``).
        show: the caller's own switch (``train.progress``, ``--quiet``...): False hides the bar anywhere.
        say: where ``show`` is True and no bar is drawn (stderr a file), a few lines through ``say`` instead
            (:class:`ProgressLines`); None: nothing there.
        **kwargs: tqdm's other arguments (``desc``, ``total``, ``unit``, ``initial``, ``leave``...); not ``disable``.

    Returns:
        The bar; a hidden one is tqdm's disabled bar, which iterates, counts nothing and prints nothing, or the
        :class:`ProgressLines` that stand in for it.

    """
    drawn = show and bars_shown()
    if show and not drawn and say is not None:
        return ProgressLines(
            iterable,
            say,
            kwargs.get("desc", "progress"),
            kwargs.get("total"),
            kwargs.get("unit"),
            kwargs.get("initial", 0),
            kwargs.get("delay", 0.0),
        )
    return tqdm(iterable, disable=not drawn, **kwargs)


def bar_over_first(iterable: Iterable, count: int | None, **kwargs: Any) -> tqdm | ProgressLines:
    """:func:`progress_bar` (its ``show``, ``say`` and tqdm's arguments in ``kwargs``) over the first ``count`` items
    of ``iterable`` (all of them for None), as :func:`first` takes them: the bar counts to where the loop stops.
    """
    items, total = first(iterable, count)
    return progress_bar(items, total=total, **kwargs)


class _LineHandler(logging.StreamHandler):
    """A log handler that writes each record as one line above the progress bars drawn (tqdm.write)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # as logging.StreamHandler: a log line never ends the work it reports
            self.handleError(record)


@contextmanager
def petl_log_lines() -> Iterator[None]:
    """Show petl's INFO lines on stderr while the block runs, as petl-run shows them (``[12:01:02] epoch 3/100 ...``).

    For a command that trains runs in its process (a ``petl-bench`` sweep): without it, no handler takes petl's
    INFO records and each run's epoch lines, ``resuming ... from epoch K/N`` and feature caching's progress lines
    are dropped.  The lines go above any bar drawn (``tqdm.write``); the handler is removed and the ``petl``
    logger's level restored afterwards.
    """
    logger = logging.getLogger("petl")
    handler = _LineHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", datefmt="%H:%M:%S"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
