"""Progress bars: every bar petl shows (epochs, feature caching, calibrations, sweeps, predictions) comes from here.

One rule for all of them, tqdm's own convention for ``disable=None``: a bar is drawn where stderr is a terminal, and
not where it goes to a file or a pipe (a job scheduler's log, CI, ``nohup``), where each redraw would be one more
carriage-return update in the file, thousands a run.  There the commands say what a bar would in lines of their own:
``petl-run`` logs a line per epoch, ``petl-pretrain`` prints one, a ``petl-bench`` sweep one per run it starts.  A
notebook (Jupyter, VS Code, Colab) draws its bars as widgets, whatever its streams say.  A caller's own switch
(``train.progress=false``, ``progress=false``, ``--no-progress``, ``--quiet``) still hides a bar anywhere.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from tqdm.auto import tqdm


def bars_shown() -> bool:
    """Whether petl draws progress bars here: in a notebook, or where stderr is a terminal."""
    if any(base.__module__ == "tqdm.notebook" for base in tqdm.__mro__):  # tqdm.auto found a notebook: widgets
        return True
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # no stderr (pythonw), or one already closed
        return False


def progress_bar(iterable: Iterable | None = None, *, show: bool = True, **kwargs: Any) -> tqdm:
    """A tqdm bar (``tqdm.auto``'s: a widget in a notebook), drawn where :func:`bars_shown` says and ``show`` is True.

    Args:
        iterable: what the bar counts, as tqdm's first argument (None: updated by hand, with ``total=``).
        show: the caller's own switch (``train.progress``, ``--quiet``...): False hides the bar anywhere.
        **kwargs: tqdm's other arguments (``desc``, ``total``, ``unit``, ``leave``...); not ``disable``.

    Returns:
        The bar; a hidden one is tqdm's disabled bar, which iterates, counts nothing and prints nothing.

    """
    return tqdm(iterable, disable=not (show and bars_shown()), **kwargs)
