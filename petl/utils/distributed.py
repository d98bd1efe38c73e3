"""Which process of a launch this is (timm: ``utils/distributed.py``)."""

from __future__ import annotations

import os


def is_main_process() -> bool:
    """Whether this process writes the records and talks: rank 0 of a multi-process launch, or the only one.

    Read from the environment, so it works before accelerate is set up (``accelerate launch`` and
    ``torchrun`` export RANK to every process).
    """
    return os.environ.get("RANK", "0") == "0"


def is_local_main_process() -> bool:
    """Whether this process is the first of its machine (LOCAL_RANK 0, which the launchers export; RANK where no
    LOCAL_RANK is set): it says what every process on the machine meets alike (its data out of reach).
    """
    return os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")) == "0"
