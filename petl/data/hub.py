"""Whether the Hugging Face hub can be reached, asked once per process, so offline runs fail at once.

Offline, ``huggingface_hub`` and ``datasets`` retry their requests for about half a minute before
giving up.  Code that reaches the hub (hub datasets, hub weights) runs inside
:func:`offline_unless_reachable`: when one TCP connection to the hub endpoint does not open, the two
libraries are switched to their offline mode for the call, so a cached copy still loads and a missing
one fails at once with the caller's one-line hint.  ``HF_HUB_OFFLINE=1`` says so without asking.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from urllib.parse import urlparse

# Seconds to wait for a TCP connection to the hub endpoint.
CONNECT_TIMEOUT = 3.0


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
