"""Which process of a launch this is (timm: ``utils/distributed.py``)."""

from __future__ import annotations

import os


def is_main_process() -> bool:
    """Whether this process writes the records and talks: rank 0 of a multi-process launch, or the only one.

    Read from the environment, so it works before accelerate is set up (``accelerate launch`` and
    ``torchrun`` export RANK to every process).
    """
    return os.environ.get("RANK", "0") == "0"
