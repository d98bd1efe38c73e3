"""Warnings said once: once per launch of several processes, and once per process.

Every process of a multi-GPU launch reads the same config and data, so a fault of them (a skipped image, a precision
the device lacks) is said by the main process alone (:func:`warn_main`), as bad input is (petl-run's error line),
not once per GPU.  A run reads its image folder several times (described once when the command line is checked, then
once per split built), and a sweep trains many runs in one process, for each of which a fault of the data or of the
schedule is the same: :func:`warn_once` says it the first time only.
"""

from __future__ import annotations

import logging

from petl.utils.distributed import is_main_process

# What this process has said (tests reset it with monkeypatch.setattr(once, "SAID", set())).
SAID: set[str] = set()


def warn_main(log: logging.Logger, message: str) -> None:
    """``log.warning(message)`` in the main process of a launch (:func:`petl.utils.distributed.is_main_process`)."""
    if is_main_process():
        log.warning(message)


def warn_once(log: logging.Logger, message: str) -> None:
    """:func:`warn_main`, unless this process has said the same message before."""
    if message not in SAID:
        SAID.add(message)
        warn_main(log, message)
