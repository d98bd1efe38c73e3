"""One writer per run folder: a lock file shared by ``petl-run`` and ``petl-bench``'s sweeps.

A folder may hold several locks under other names (``petl-pretrain`` holds one per architecture in its ``--out``,
whose files are named by architecture): each function takes the lock file's ``name``, ``.petl.lock`` by default.

The lock holds its owner's host and pid as JSON.  It is made visible with one atomic step (a hard
link of a fully written file, or ``O_EXCL`` where the file system has no hard links), so a reader
never sees a half-written lock.  A lock whose owner died on this host (kill -9, a crashed node's
process restarted here) is stale and taken over, so a crash never blocks the resume that follows.
A lock from another host cannot be checked and is respected: delete it by hand after a crashed node.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

LOCK_FILE = ".petl.lock"


def _pid_alive(pid: int) -> bool:
    if pid <= 0:  # os.kill(0 or -1, ...) would address process groups, not one process
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _me() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}


def read_holder(folder: Path, name: str = LOCK_FILE) -> dict[str, Any] | None:
    """Who holds ``folder``'s lock (``host``, ``pid``, ``since``), or ``None`` when nobody does."""
    try:
        holder = json.loads((folder / name).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # unreadable: treated as held, never silently overwritten
    return holder if isinstance(holder, dict) else {}


def holds_lock(folder: Path, name: str = LOCK_FILE) -> bool:
    """Whether this very process holds ``folder``'s lock (a sweep that runs the training in-process)."""
    holder = read_holder(folder, name)
    return bool(holder) and holder.get("host") == socket.gethostname() and holder.get("pid") == os.getpid()


def held_by_live_process(folder: Path, name: str = LOCK_FILE) -> bool:
    """Whether a live process on this host holds ``folder``'s lock: a run being trained there now."""
    holder = read_holder(folder, name) or {}
    pid = holder.get("pid")
    return holder.get("host") == socket.gethostname() and isinstance(pid, int) and _pid_alive(pid)


def _create(lock: Path, text: str) -> bool:
    """Make ``lock`` appear with ``text`` in one step; False if it already exists."""
    tmp = lock.with_name(f"{lock.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    try:
        os.link(tmp, lock)
        return True
    except FileExistsError:
        return False
    except OSError:  # no hard links on this file system: O_EXCL is atomic too (local and NFSv3+)
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return True
    finally:
        tmp.unlink(missing_ok=True)


def acquire_lock(folder: Path, name: str = LOCK_FILE) -> bool:
    """Claim ``folder`` (created if missing) for this process; False if another live process holds it.

    Raises:
        OSError: the folder cannot be created or written (a file in the way, read-only, full).

    """
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / name
    me = _me()
    for _ in range(2):
        if _create(lock, json.dumps(me)):
            return True
        holder = read_holder(folder, name)
        if holder is None:
            continue  # released between our two looks
        pid = holder.get("pid", -1)  # not a number (a hand-edited lock): respected, as an unreadable one is
        if holder.get("host") == me["host"] and isinstance(pid, int) and not _pid_alive(pid):
            if _take_over(lock, holder):
                continue  # stale: its owner is dead, and the lock is out of the way
        return False
    return False


def _take_over(lock: Path, stale: dict[str, Any]) -> bool:
    """Move a stale lock out of the way; False if what moved was not ``stale`` (a newer, live lock).

    A rename moves one file once: of two claimants that judged the same lock stale, only one moves it, and
    the other either finds nothing (and races fairly for the new lock) or moves the winner's fresh lock,
    sees it is not the stale one, and puts it back.  (Deleting instead would let the slower one delete
    the faster one's live lock.)
    """
    moved = lock.with_name(f"{lock.name}.{os.getpid()}.stale")
    try:
        os.rename(lock, moved)
    except FileNotFoundError:
        return True  # another claimant moved it first: try to create ours
    try:
        taken = json.loads(moved.read_text())
    except (OSError, ValueError):
        taken = None
    if taken == stale:
        moved.unlink(missing_ok=True)
        return True
    try:
        os.link(moved, lock)  # put the live lock back, unless yet another claimant already made one
    except OSError:
        pass
    moved.unlink(missing_ok=True)
    return False


def release_lock(folder: Path, name: str = LOCK_FILE) -> None:
    """Drop this process's claim on ``folder``; a lock another process holds (it took over) is left alone."""
    if holds_lock(folder, name):
        (folder / name).unlink(missing_ok=True)


def describe_holder(folder: Path, name: str = LOCK_FILE) -> str:
    """``pid 123 on host h since 04:10:00`` for messages."""
    holder = read_holder(folder, name) or {}
    since = holder.get("since")
    when = time.strftime(" since %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else ""
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}{when}"
