"""Faults of interrupted, concurrent and resource-starved work: a sweep into a results folder nothing can be written
into (one line, exit 2, as petl-run), a run another sweep finished while this one waited for it (counted as done),
a run folder read while a live process trains it (named as being trained, not as one to resume), a disk that fills
up during a sweep (each run failed in its line, the sweep going on), a lock whose pid is no number (respected), the
feature cache's frozen forward (a progress bar), petl-export's out= where nothing can be written (refused first, as
petl-predict's) or on a full disk (named), petl-predict's out= with a name too long (refused as a read-only one),
two processes unpacking one VTAB task from the hub archive at once (each into a folder of its own).

Only the progress bar's test trains (two tiny runs): the sweeps run a fake engine, the folder being trained is one
this process holds the lock of.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import threading
import zipfile
from pathlib import Path

import pytest
from conftest import tiny_run
from test_faults_issue52 import _main
from test_faults_new_user import _image, _unfinished
from test_faults_training import _read_only_dir
from test_faults_untrusted_files import _mini_sweep, petl_bench
from test_harness import BENCH, FakeEngine, write_run
from test_vtab_fgvc_folders import FULL, make_vtab_task, vtab_archive

from petl import data
from petl.bench import sweep
from petl.bench.suite import load_experiment
from petl.cli import export as export_cli
from petl.cli import predict as predict_cli
from petl.data import vtab
from petl.deploy import export as export_module
from petl.run import default_config, train
from petl.store import files, lock
from petl.utils import progress
from petl.utils.errors import RunError


@pytest.mark.parametrize("case", ["a file", "a name too long", "a read-only folder"])
def test_a_sweep_into_a_folder_it_cannot_write_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, case):
    # Each was "petl-bench: error: OSError: [Errno ...] ... (--debug shows the traceback)", exit 1, from the first
    # run's lock (the name too long: from planning), where petl-run names the output_dir with exit 2.
    engine = FakeEngine()
    monkeypatch.setattr(sweep, "_default_fns", lambda: (engine.train, engine.compose, None))
    if case == "a file":
        out, why = tmp_path / "out", "is a file, not a folder"
        out.write_text("results")
    elif case == "a name too long":
        out, why = tmp_path / ("a" * 300) / "x", "cannot be written (File name too long)"
    else:
        out, why = _read_only_dir(tmp_path) / "x", "cannot be written ("
    code, _, err = petl_bench(capsys, *_mini_sweep(out))
    assert code == 2 and err.startswith(f"petl-bench: error: output_dir {out} {why}") and err.count("\n") == 1, err
    assert err.rstrip().endswith(": choose another output_dir") and not engine.trained
    # A dry run checks the folder too, and leaves no folder behind where the check could make one.
    assert petl_bench(capsys, *_mini_sweep(tmp_path / "new" / "deep"), "dry_run=true")[0] == 0
    assert not (tmp_path / "new").exists()


def test_a_run_another_sweep_finished_while_this_one_waited_counts_as_done(tmp_path, monkeypatch):
    # The sweep's first look found it to do; by the time it had the lock, the other sweep had finished it.  It was
    # counted nowhere: "2 runs: 0 already done, 1 trained, 0 held by another sweep, 0 failed".
    runs = sweep.plan([load_experiment("linear", BENCH)], ["mini/digits"], [0, 1], tmp_path)
    real = sweep.acquire_lock

    def the_other_sweep_finishes_seed0_first(folder: Path) -> bool:
        if folder == runs[0].run_dir:
            write_run(tmp_path, "mini/digits", "linear", 0, top1=50.0)
        return real(folder)

    monkeypatch.setattr(sweep, "acquire_lock", the_other_sweep_finishes_seed0_first)
    engine = FakeEngine()
    summary = sweep.run_sweep(runs, engine.train, engine.compose, progress=False)
    assert len(engine.trained) == 1 and (summary.already_done, summary.trained) == (1, 1)
    assert summary.line().startswith("2 runs: 1 already done, 1 trained, 0 held by another sweep, 0 failed")


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


def test_a_disk_that_fills_up_during_a_sweep_fails_its_runs_each_in_its_line(tmp_path, monkeypatch):
    # The run that met the full disk failed, and so did the sweep's error.log for it: the sweep died with a bare
    # "OSError: [Errno 28] No space left on device" (exit 1), the run's line lost and no summary; so did the next
    # run's lock.
    runs = sweep.plan([load_experiment("linear", BENCH)], ["mini/digits"], [0, 1], tmp_path)
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    kept = "cannot write to output_dir x (No space left on device): the checkpoint of epoch 1 is kept"

    def train(cfg: dict) -> dict:
        raise RunError(kept)

    def write_text(path: Path, *args, **kwargs):
        if path.name == sweep.ERROR_FILE:  # the lock's few bytes still fit; the log of a traceback does not
            raise full
        return real_write_text(path, *args, **kwargs)

    def acquire(folder: Path) -> bool:
        if folder == runs[1].run_dir:
            raise full
        return real_acquire(folder)

    real_acquire, real_write_text = sweep.acquire_lock, sweep.write_text
    monkeypatch.setattr(sweep, "acquire_lock", acquire)
    monkeypatch.setattr(sweep, "write_text", write_text)
    summary = sweep.run_sweep(runs, train, FakeEngine().compose, progress=False)
    assert summary.failed == [
        f"{runs[0].label}: {kept}; {runs[0].run_dir / sweep.ERROR_FILE} not written (No space left on device)",
        f"{runs[1].label}: cannot write to {runs[1].run_dir} (No space left on device)",
    ]
    assert not (runs[0].run_dir / lock.LOCK_FILE).exists()


@pytest.mark.parametrize("pid", [None, "12x", [1]])
def test_a_lock_whose_pid_is_not_a_number_is_respected_not_a_traceback(tmp_path, pid):
    # int(holder["pid"]) raised TypeError or ValueError out of petl-run and the sweeps: a traceback, exit 1.
    (tmp_path / lock.LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": pid}))
    assert not lock.acquire_lock(tmp_path)
    assert f"pid {pid} on host {socket.gethostname()}" in lock.describe_holder(tmp_path)
    assert json.loads((tmp_path / lock.LOCK_FILE).read_text())["pid"] == pid  # left for the user to delete


@pytest.mark.slow
def test_caching_features_shows_a_progress_bar_where_the_epochs_show_one(tmp_path, monkeypatch, capsys):
    # The frozen forward over train and val (minutes for a ViT-B on a CPU) ran without a bar, between the run's
    # first line and the first epoch's bar.
    monkeypatch.setattr(progress, "bars_shown", lambda: True)  # as on a terminal (capsys's stderr is none)
    with_bars = [o for o in tiny_run() if o != "train.progress=false"]
    train(default_config([*with_bars, "method=linear", f"output_dir={tmp_path / 'bars'}"]))
    err = capsys.readouterr().err
    assert "caching train:" in err and "caching val:" in err
    train(default_config([*tiny_run(), "method=linear", f"output_dir={tmp_path / 'quiet'}"]))
    assert "caching" not in capsys.readouterr().err


@pytest.mark.slow
def test_caching_features_into_a_log_file_logs_a_few_lines_where_the_epochs_have_a_bar(tmp_path, monkeypatch, caplog):
    # Where stderr is a file the bar is not drawn, and the minutes of the frozen forward went by without a line.
    monkeypatch.setattr(progress, "bars_shown", lambda: False)
    caplog.set_level(logging.INFO)
    with_bars = [o for o in tiny_run(subset=64) if o != "train.progress=false"]
    train(default_config([*with_bars, "train.eval_batch_size=16", "method=linear", f"output_dir={tmp_path / 'bars'}"]))
    said = [m for m in caplog.messages if m.startswith("caching ")]
    assert [m for m in said if m.startswith("caching train")] == [f"caching train: {k}/4 batches" for k in range(5)]
    done, total = said[-1].removeprefix("caching val: ").split()[0].split("/")  # the val split's, to its end
    assert said[5].startswith("caching val: 0/") and done == total, said
    caplog.clear()
    train(default_config([*tiny_run(), "method=linear", f"output_dir={tmp_path / 'quiet'}"]))
    assert not [m for m in caplog.messages if m.startswith("caching ")]


@pytest.mark.parametrize("where", ["a read-only folder", "a file in the way", "a name too long"])
def test_petl_export_where_nothing_can_be_written_is_refused_before_the_run_loads(tmp_path, monkeypatch, capsys, where):
    # The export loaded and merged the run, then failed on "[Errno 30] Read-only file system: ..." (exit 1), where
    # petl-predict's out= is refused first, in one line naming it (exit 2).
    monkeypatch.setattr(export_module, "load_run", lambda *a: pytest.fail("must refuse before loading the run"))
    if where == "a read-only folder":
        out = _read_only_dir(tmp_path) / "exported"
        why = f"{out} cannot be written ("  # a timm folder: out= itself
    elif where == "a file in the way":
        (tmp_path / "file").write_text("")
        out = tmp_path / "file" / "exported.safetensors"
        why = f"{out.parent} is a file, not a folder"
    else:
        out = tmp_path / ("a" * 300) / "exported.onnx"
        why = f"{out} cannot be written (File name too long)"
    (tmp_path / "run").mkdir()
    code, err = _main(export_cli.main, [str(tmp_path / "run"), f"out={out}"], capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"petl-export: error: out={out}: {why}"), err
    assert err.rstrip().endswith(": choose a folder you can write to"), err


def test_petl_export_on_a_full_disk_names_out_in_one_line(tmp_path, monkeypatch, capsys):
    # It said "petl-export: error: [Errno 28] No space left on device", naming nothing.
    for name in ("load_run", "plain_model", "metadata"):
        monkeypatch.setattr(export_module, name, lambda *a: None)

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(export_module, "save_safetensors", full)
    out = tmp_path / "exported.safetensors"
    code, err = _main(export_cli.main, [str(tmp_path / "run"), f"out={out}"], capsys)
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith(f"petl-export: error: cannot write out={out} (No space left on device): free the space")


@pytest.mark.parametrize("name", ["a" * 300 + ".csv", "a" * 300 + "/preds.csv"])
def test_petl_predict_out_with_a_name_too_long_is_refused_in_one_line(tmp_path, capsys, name):
    # "petl-predict: error: [Errno 36] File name too long: ...", exit 1, where a read-only out= is bad input (exit 2).
    run = tmp_path / "run"
    run.mkdir()
    (run / files.WEIGHTS_FILE).write_text("")
    out = tmp_path / name
    code, err = _main(predict_cli.main, [str(run), str(_image(tmp_path / "a.png")), f"out={out}"], capsys)
    assert code == 2 and err.count("\n") == 1 and f"error: out={out}: {out} cannot be written (" in err, err
    assert "(File name too long): choose a folder you can write to" in err, err


def test_two_processes_unpacking_one_vtab_task_at_once_neither_breaks_the_other(tmp_path, monkeypatch):
    # Both unpacked into <task>.partial, each deleting it first as an interrupted one's leftover: the second deleted
    # the first's half-written files, and the first, going on, failed to rename its folder onto the second's
    # ("Directory not empty") -- or, the other way round, renamed a folder missing what the other had deleted.
    import huggingface_hub

    source = tmp_path / "source"
    make_vtab_task(source / "dtd", FULL, num_classes=47, images=4)
    archive = vtab_archive(source, tmp_path / "vtab-1k.zip")
    members = [m for m in zipfile.ZipFile(archive).namelist() if not m.endswith("/")]
    reached, resume = threading.Event(), threading.Event()

    class PausedHalfWay(zipfile.ZipFile):
        """The first unpacking stops half-way until the second has unpacked the whole task."""

        def open(self, name, *args, **kwargs):
            if threading.current_thread().name == "first" and name == members[len(members) // 2]:
                reached.set()
                resume.wait(30)
            return super().open(name, *args, **kwargs)

    monkeypatch.setenv(vtab.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda **kwargs: str(archive))
    monkeypatch.setattr(vtab.zipfile, "ZipFile", PausedHalfWay)
    outcome: dict[str, object] = {}

    def unpack() -> None:
        try:
            outcome["first"] = data.build_dataset("vtab/dtd", "train800", image_size=8)
        except Exception as error:  # noqa: BLE001  (the fault under test, reported below)
            outcome["first"] = error

    first = threading.Thread(target=unpack, name="first")
    first.start()
    assert reached.wait(30)
    second = data.build_dataset("vtab/dtd", "train800", image_size=8)
    resume.set()
    first.join(30)
    assert not isinstance(outcome["first"], Exception), outcome["first"]
    assert len(second) == len(outcome["first"]) == FULL["train800"]
    unpacked = tmp_path / "cache" / "vtab-1k"
    assert sorted(p.name for p in unpacked.iterdir()) == ["dtd"]  # no half-unpacked folder left behind
    assert sorted(p.relative_to(unpacked / "dtd").as_posix() for p in (unpacked / "dtd").rglob("*") if p.is_file()) == (
        sorted(m[len("vtab-1k/dtd/") :] for m in members)
    )


def test_a_finished_run_of_another_config_counts_as_failed_not_also_as_done(tmp_path):
    # An edited suite: "2 runs: 2 already done, 0 trained, 0 held by another sweep, 1 failed", three outcomes of two.
    runs = sweep.plan([load_experiment("linear", BENCH)], ["mini/digits"], [0, 1], tmp_path)
    for seed in (0, 1):
        write_run(tmp_path, "mini/digits", "linear", seed, top1=50.0)

    def check(cfg: dict) -> None:
        if cfg["output_dir"] == str(runs[1].run_dir):
            raise ValueError("holds a run with another config (train.epochs: 1 -> 2)")

    engine = FakeEngine()
    summary = sweep.run_sweep(runs, engine.train, engine.compose, progress=False, check_fn=check)
    assert summary.stale == [runs[1].label] and not engine.trained
    assert summary.line().startswith("2 runs: 1 already done, 0 trained, 0 held by another sweep, 1 failed")
