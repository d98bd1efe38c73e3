"""Where petl keeps what it makes once per user (converted weights, unpacked datasets); files written whole; and
whether a folder can be written at all, asked once for every command that writes (:func:`cannot_write_in`).
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from petl.utils.text import shown

CACHE_ENV = "PETL_CACHE_DIR"
# What to do about a folder nothing can be written in, unless the caller names its option (choose another output_dir).
WRITE_ELSEWHERE = "choose a folder you can write to"


def cache_dir() -> Path:
    """The cache folder: ``$PETL_CACHE_DIR``, else ``$XDG_CACHE_HOME/petl``, else ``~/.cache/petl``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "petl"


def cannot_write_in(folder: Path, todo: str = WRITE_ELSEWHERE, *, fill: bool = False) -> str | None:
    """Why no file can be written in ``folder`` (one line: the folder, the reason, ``todo``), or ``None`` if one can.

    A folder that does not exist yet is made, as its writer would make it, and removed again with the probe
    file, so a check leaves no trace.  A file in the way, a read-only file system, ``/proc``, a name longer than
    the file system takes: each is said here, before anything is built, not as a bare ``OSError`` later.

    Args:
        folder: the folder to write in, existing or to be created.
        todo: what the user should do instead (``choose another output_dir``), ending the line.
        fill: also write and sync some bytes, so that a full disk is refused too (an empty file may still be made
            there).  petl-run and petl-bench fill (an ``output_dir`` that cannot be written is bad input, exit 2);
            petl-predict and petl-export do not (their full disk is a command that failed, exit 1, said on writing).

    """
    made: list[Path] = []
    try:
        # Even a look may fail (a name longer than the file system takes).
        if folder.exists() and not folder.is_dir():
            return f"{shown(folder)} is a file, not a folder: {todo}"
        missing = [p for p in (folder, *folder.parents) if not p.exists()]
        for path in reversed(missing):
            try:
                path.mkdir()
            except FileExistsError:  # made meanwhile by another process: not ours to remove
                continue
            made.append(path)
        with tempfile.TemporaryFile(prefix=".petl-write-check.", dir=folder) as probe:
            if fill:
                probe.write(b"petl" * 64)
                probe.flush()
                os.fsync(probe.fileno())  # a full disk refuses the bytes, not the name
    except OSError as error:
        return cannot_be_written(folder, error, todo)
    finally:
        for path in reversed(made):  # deepest first; the writer makes what it needs
            try:
                path.rmdir()
            except OSError:  # something was written there meanwhile: it and the folders above stay
                break
    return None


def cannot_be_written(path: Path, error: OSError, todo: str = WRITE_ELSEWHERE) -> str:
    """The line :func:`cannot_write_in` says of ``path``, for a caller whose own look at it failed with ``error``."""
    return f"{shown(path)} cannot be written ({error.strerror or error}): {todo}"


def file_sha256(path: Path) -> str:
    """SHA-256 of a file's bytes (read in 1 MiB blocks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


try:
    import fcntl
except ImportError:  # Windows: no advisory locks; stale temporaries are then left alone
    fcntl = None  # type: ignore[assignment]

# A temporary file younger than this is never taken for a dead writer's (its writer may not hold its lock yet).
STALE_SECONDS = 60.0


def _temporaries(path: Path) -> list[Path]:
    # Exactly the names atomic_path's mkstemp gives (8 of tempfile's letters, digits and _), and plain files only: in
    # a user's folder (petl-export's out=) a .model.safetensors.backup.tmp of theirs, a folder or a symlink of that
    # shape is not petl's to remove (a folder also failed the export, IsADirectoryError from unlink).
    name = re.compile(rf"\.{re.escape(path.name)}\.[a-z0-9_]{{8}}\.tmp")
    found = path.parent.glob(f".{glob.escape(path.name)}.*.tmp")  # model[1].safetensors: no character class
    return sorted(p for p in found if name.fullmatch(p.name) and p.is_file() and not p.is_symlink())


def remove_stale_temporaries(path: Path, min_age: float = STALE_SECONDS) -> list[Path]:
    """Remove the temporary files of :func:`atomic_path` for ``path`` that no live writer holds; return them.

    A process killed mid-write (kill -9, a power cut) leaves its temporary file beside ``path``.  A live writer
    holds an advisory lock on its temporary file until it is renamed or removed, so a file that can be locked,
    and is older than ``min_age`` seconds, belongs to a writer that is gone.

    Args:
        path: the file the temporaries were written for.
        min_age: seconds since a temporary file last changed before it may be removed.

    """
    removed: list[Path] = []
    if fcntl is None:
        return removed
    for tmp in _temporaries(path):
        try:
            fd = os.open(tmp, os.O_RDONLY)
        except OSError:  # gone meanwhile
            continue
        try:
            if time.time() - os.fstat(fd).st_mtime < min_age:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a live writer holds it
            continue
        else:
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
        finally:
            os.close(fd)
    return removed


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it onto ``path`` only if the block succeeds.

    The temporary file is locked (advisory) while the block runs, so :func:`remove_stale_temporaries` tells
    it from one a killed process left.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield Path(tmp)
        # mkstemp creates the file private (0600); give it the permissions a plain open() would.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
        os.close(fd)  # releases the lock


def write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)`` and move the result onto ``path`` atomically."""
    with atomic_path(path) as tmp:
        write(tmp)


def walk_linked(folder: Path) -> Iterator[tuple[str, list[str], list[str]]]:
    """``os.walk(folder)`` following sub-folders that are symbolic links, each real folder once, sub-folders in
    name order.

    A link to ``folder`` or to a folder above it is not followed (it would loop, or take in the folders beside).  A
    folder reached by two paths (itself and a link to it) is walked by the first in name order: in the order the file
    system lists them, a copy of the folder elsewhere could name its images (and petl-serve its tasks) by the other.
    The caller may prune a yielded ``dirs`` list in place, as with ``os.walk``.
    """
    seen: set[str] = set()
    start = os.path.join(os.path.realpath(folder), "")
    for top, dirs, files in os.walk(folder, followlinks=True):
        real = os.path.realpath(top)
        if real in seen or (seen and start.startswith(os.path.join(real, ""))):
            dirs[:] = []
            continue
        seen.add(real)
        dirs.sort()
        yield top, dirs, files
