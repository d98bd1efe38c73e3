"""Faults of interrupted, concurrent and resource-starved work: a run folder read while a live process trains it
(named as being trained, not as one to resume).

None trains: the folder being trained is one this process holds the lock of.
"""

from __future__ import annotations

import os

from test_faults_issue52 import _main
from test_faults_new_user import _image, _unfinished

from petl.cli import predict as predict_cli
from petl.store import files, lock


def test_a_run_being_trained_is_named_as_one_not_as_one_to_resume(tmp_path, capsys):
    # petl-predict (and export, serve, load_run) said "an unfinished petl-run folder ...: run the same petl-run command
    # again to resume it", which the run's lock then refuses; before its first checkpoint: "not a run folder".
    image = _image(tmp_path / "a.png")
    first_epoch = tmp_path / "first"
    first_epoch.mkdir()
    (first_epoch / files.CONFIG_FILE).write_text("seed: 0\n")
    for run in (first_epoch, _unfinished(tmp_path / "later")):
        assert lock.acquire_lock(run)  # this live process holds it, as the petl-run training it would
        try:
            code, err = _main(predict_cli.main, [str(run), str(image)], capsys)
        finally:
            lock.release_lock(run)
        assert code == 2 and err.count("\n") == 1, err
        assert f"error: {run} is a run being trained now (pid {os.getpid()} on host " in err, err
        assert err.rstrip().endswith(": wait for it to finish"), err
    # Once nobody trains it (a kill left it, its lock with it), it is one to resume.
    assert "run the same petl-run command again" in files.unfinished_run(tmp_path / "later")
