"""Warnings said once per process: a run reads its image folder several times (described once when the command
line is checked, then once per split built), and a sweep trains many runs in one process, for each of which a fault
of the data or of the schedule is the same.
"""

from __future__ import annotations

import logging

# What this process has said (tests reset it with monkeypatch.setattr(once, "SAID", set())).
SAID: set[str] = set()


def warn_once(log: logging.Logger, message: str) -> None:
    """``log.warning(message)``, unless this process has said the same message before."""
    if message not in SAID:
        SAID.add(message)
        log.warning(message)
