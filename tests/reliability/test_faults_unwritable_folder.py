"""A folder nothing can be written in: :func:`petl.utils.paths.cannot_write_in`, the one check petl-run, petl-bench,
petl-predict and petl-export make before anything is built.  Each command's own line (its option, its exit status)
is tested beside that command's other faults (test_faults_training, test_faults_interrupted, test_faults_new_user).
"""

from __future__ import annotations

import errno
import os

import pytest
from test_faults_training import _read_only_dir

from petl.utils import paths

TODO = "choose another output_dir"


@pytest.mark.parametrize("fill", [False, True])
@pytest.mark.parametrize(
    "case", ["a writable folder", "a missing folder under a writable parent", "a read-only folder", "a file"]
)
def test_cannot_write_in_says_the_folder_and_what_to_do_and_leaves_no_trace(tmp_path, case, fill):
    if case == "a writable folder":
        folder, expected = tmp_path, None
    elif case == "a missing folder under a writable parent":
        folder, expected = tmp_path / "new" / "deeper", None
    elif case == "a read-only folder":
        folder = _read_only_dir(tmp_path)
        expected = f"{folder} cannot be written (Permission denied): {TODO}"
    else:
        folder = tmp_path / "results"
        folder.write_text("")
        expected = f"{folder} is a file, not a folder: {TODO}"
    before = sorted(tmp_path.rglob("*"))
    assert paths.cannot_write_in(folder, TODO, fill=fill) == expected
    # The probe file is gone, and so are the folders made for it (the writer makes what it needs).
    assert sorted(tmp_path.rglob("*")) == before


def test_a_folder_below_a_file_names_that_folder(tmp_path):
    (tmp_path / "notes.txt").write_text("")
    folder = tmp_path / "notes.txt" / "runs"
    said = f"{folder} cannot be written (Not a directory): choose a folder you can write to"
    assert paths.cannot_write_in(folder) == said


def test_only_fill_refuses_a_full_disk(tmp_path, monkeypatch):
    # On a full disk an empty file can often still be made: only the bytes are refused.
    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(paths.os, "fsync", full)
    folder = tmp_path / "new"
    assert paths.cannot_write_in(folder) is None
    said = f"{folder} cannot be written (No space left on device): {TODO}"
    assert paths.cannot_write_in(folder, TODO, fill=True) == said
    assert list(tmp_path.iterdir()) == []
