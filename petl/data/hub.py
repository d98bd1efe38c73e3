"""Whether the Hugging Face hub can be reached, asked once per process, so offline runs fail at once.

Offline, ``huggingface_hub`` and ``datasets`` retry their requests for about half a minute before
giving up.  Code that reaches the hub (hub datasets, hub weights) runs inside
:func:`offline_unless_reachable`: when one TCP connection to the hub endpoint does not open, the two
libraries are switched to their offline mode for the call, so a cached copy still loads and a missing
one fails at once with the caller's one-line hint.  ``HF_HUB_OFFLINE=1`` says so without asking.
:func:`datasets_quiet_until_accepted` keeps datasets' own lines from standing above such a hint or a refusal.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any
from urllib.parse import urlparse

# Seconds to wait for a TCP connection to the hub endpoint.
CONNECT_TIMEOUT = 3.0
# Seconds a datasets progress bar runs before it is drawn while petl loads and checks a dataset: a refusal after a
# quick load is then the only line, and a long download or build still shows its progress.
PROGRESS_DELAY = 2.0
# datasets' logger and progress-bar class are the process's: one thread at a time swaps them, so that each restores
# what it found (two blocks that overlapped in threads left datasets' lines sent to a finished block's list for good).
_DATASETS_SWAPPED = threading.RLock()


def offline_by_setting() -> bool:
    """Whether the environment declares the hub offline."""
    return any(os.environ.get(key, "").strip().lower() in ("1", "true", "yes", "on") for key in _OFFLINE_KEYS)


_OFFLINE_KEYS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


@lru_cache(maxsize=1)
def reachable() -> bool:
    """Whether a TCP connection to the hub endpoint (``HF_ENDPOINT`` or huggingface_hub's default) opens."""
    if offline_by_setting():
        return False
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "", port), timeout=CONNECT_TIMEOUT):
            return True
    except OSError:  # no route, no DNS, refused, timed out
        return False


@contextmanager
def offline_unless_reachable() -> Iterator[bool]:
    """Run the block with huggingface_hub and datasets in offline mode when the hub is not reachable.

    Yields:
        Whether the hub is reachable.  The libraries read their offline flag from a module constant at
        each request; it is set for the block and restored after.
    """
    if reachable():
        yield True
        return
    from huggingface_hub import constants

    modules = [constants]
    if "datasets" in sys.modules:
        import datasets.config

        modules.append(datasets.config)
    saved = [module.HF_HUB_OFFLINE for module in modules]
    for module in modules:
        module.HF_HUB_OFFLINE = True
    try:
        yield False
    finally:
        for module, value in zip(modules, saved, strict=True):
            module.HF_HUB_OFFLINE = value


def looks_like_id(text: str) -> bool:
    """Whether ``text`` has the form of a hub repository id, ``owner/name``."""
    parts = text.split("/")
    return len(parts) == 2 and all(parts) and not text.startswith((".", "~"))


class _HeldRecords(logging.Handler):
    """Keeps the log records it is given, to log them later or drop them."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def datasets_quiet_until_accepted() -> Iterator[None]:
    """Hold back ``datasets``' log lines in the block, and draw its progress bars only past :data:`PROGRESS_DELAY`.

    datasets says what it loads ("Using the latest cached version of the dataset...") before petl has looked at the
    columns; where petl then refuses, those lines and a quick build's progress bars stood above its one-line reason.
    Held lines are logged after the block where it ends normally, and dropped where it raises.  One thread at a time
    runs such a block (another waits): datasets' logger and bar class are the whole process's.
    """
    try:
        from datasets.utils import tqdm as progress_bar  # the class of every progress bar datasets draws
    except ImportError:  # nothing of datasets' to quiet: the caller's import says that it is missing
        yield
        return

    library = logging.getLogger("datasets")
    held = _HeldRecords()
    with _DATASETS_SWAPPED:
        saved_handlers, saved_propagate = library.handlers[:], library.propagate
        drawn_at_once = progress_bar.__init__

        def drawn_late(bar: Any, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("delay", PROGRESS_DELAY)
            drawn_at_once(bar, *args, **kwargs)

        try:
            library.handlers[:], library.propagate = [held], False
            progress_bar.__init__ = drawn_late
            yield
        finally:
            progress_bar.__init__ = drawn_at_once
            library.handlers[:], library.propagate = saved_handlers, saved_propagate
    for record in held.records:
        library.handle(record)
