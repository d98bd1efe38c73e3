"""Faults of commands run by a job scheduler (SLURM, a CI runner, nohup): stdout and stderr go to files, and the time
limit ends the job with SIGTERM (then SIGKILL after a grace period).

SIGTERM ended petl-run and petl-bench without a word (killed by the signal: no line in the log saying why, the run
folder's lock left behind); it now interrupts them as Ctrl-C does, in one line saying so and what is kept, with
status 143.  The progress bars wrote thousands of carriage-return updates into the log file; where stderr is no
terminal they are not drawn now, and the per-epoch and per-run lines say what they would.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import command_status, tiny_run
from test_faults_training import _SLOW_EPOCHS
from test_harness import BENCH, FakeEngine, write_run
from test_run_card import _image, _run_folder

from petl.bench import sweep
from petl.bench.suite import load_experiment
from petl.cli import bench as bench_cli
from petl.cli import predict as predict_cli
from petl.cli import run as run_cli
from petl.deploy import predict
from petl.store import files, lock
from petl.store.run_card import load_run
from petl.utils import progress
from petl.utils.errors import TERMINATED

# As _SLOW_EPOCHS, for a sweep: an epoch is slow only once the folder {later_run} exists, the run the signal lands in;
# the runs before it have nothing to wait for.
_SLOW_LATER_RUN = """
import os, sys, time
from petl.cli import {module} as cli
from petl.train import engine

real = engine.train_one_epoch

def slow(*args, **kwargs):
    if os.path.isdir({later_run!r}):
        time.sleep(0.5)
    return real(*args, **kwargs)

engine.train_one_epoch = slow
cli.main(sys.argv[1:])
"""


def _started(module: str, args: list[str], cwd: Path, log: Path, later_run: Path | None = None) -> subprocess.Popen:
    """``petl-MODULE ARGS`` with slow epochs (once the folder ``later_run`` exists, where given), stdout and stderr
    into ``log`` as under a job scheduler."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    script = _SLOW_LATER_RUN if later_run else _SLOW_EPOCHS
    with log.open("w") as stream:  # the child holds its own descriptor
        return subprocess.Popen(
            [sys.executable, "-c", script.format(module=module, later_run=str(later_run)), *args],
            cwd=cwd,
            env=env,
            stdout=stream,
            stderr=stream,
        )


def _terminated_once(proc: subprocess.Popen, ready: Path, log: Path) -> tuple[int, str]:
    """SIGTERM to ``proc`` once ``ready`` exists (a finished epoch's checkpoint); its status and the log it leaves."""
    deadline = time.monotonic() + 240
    try:
        while not ready.exists():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"{ready} never appeared: {log.read_text()}"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, log.read_text()


@pytest.mark.slow
def test_sigterm_ends_petl_run_in_one_line_and_143_and_the_same_command_resumes(tmp_path):
    # The process died of the signal (status -15): its log ended on the last epoch's line, saying nothing of why it
    # stopped, and .petl.lock stayed in the run folder until a later run took it over as stale.
    args = [*tiny_run(epochs=20), "method=linear", "train.cache_features=false", "output_dir=run"]
    run = tmp_path / "run"
    log = tmp_path / "job.log"
    status, text = _terminated_once(_started("run", args, tmp_path, log), run / files.CHECKPOINT_FILE, log)
    assert status == TERMINATED == 143, text
    assert text.endswith(
        "petl-run: error: terminated (SIGTERM); the same command resumes from the last finished epoch\n"
    )
    assert "Traceback" not in text
    assert not (run / lock.LOCK_FILE).exists() and (run / files.CHECKPOINT_FILE).exists()
    assert not (run / files.RESULT_FILE).exists()
    # The same command, run again, resumes and finishes.
    run_cli.main([*args[:-1], f"output_dir={run}"])
    assert (run / files.RESULT_FILE).exists()
    assert len((run / files.METRICS_FILE).read_text().splitlines()) == 20


@pytest.mark.slow
def test_sigterm_ends_a_sweep_in_one_line_and_143_keeping_its_finished_runs(tmp_path, capsys):
    # As petl-run: killed by the signal, without a line, the lock of the run it trained left behind.
    args = [
        "suite=mini",
        "methods=linear",
        "tasks=mini/digits",
        "seeds=0,1",
        f"output_dir={tmp_path / 'bench'}",
        "report=false",
        # Six epochs, slow in the second run: the signal, sent at its first checkpoint, lands seconds before it ends.
        *(o for o in tiny_run(epochs=6) if o.startswith(("data.", "model", "+model", "train.epochs"))),
        "train.cache_features=false",
    ]
    seed0, seed1 = (sweep.run_dir_for(tmp_path / "bench", "mini/digits", "linear", k) for k in (0, 1))
    log = tmp_path / "job.log"
    started = _started("bench", args, tmp_path, log, later_run=seed1)
    status, text = _terminated_once(started, seed1 / files.CHECKPOINT_FILE, log)
    assert status == TERMINATED, text
    assert text.endswith(
        "petl-bench: error: terminated (SIGTERM); run the same command again to go on (finished runs are kept, an "
        "interrupted run resumes from its last finished epoch)\n"
    ), text
    assert "Traceback" not in text and "sweep: run 2/2: mini/digits linear seed1\n" in text
    assert (seed0 / files.RESULT_FILE).exists() and not (seed1 / files.RESULT_FILE).exists()
    assert not (seed1 / lock.LOCK_FILE).exists() and (seed1 / files.CHECKPOINT_FILE).exists()
    capsys.readouterr()
    assert bench_cli.main(args) == 0
    assert "2 runs: 1 already done, 1 trained, 0 held by another sweep, 0 failed" in capsys.readouterr().out


@pytest.mark.slow
def test_petl_run_into_a_log_file_writes_its_epochs_as_lines_not_a_bar(tmp_path):
    # Each epoch's bar went into the file as carriage-return updates ("\repoch 1/3:   0%| ...\r     \r").
    with_bars = [o for o in tiny_run(epochs=3) if o != "train.progress=false"]
    log = tmp_path / "job.log"
    with log.open("w") as stream:
        done = subprocess.run(
            [sys.executable, "-m", "petl.run", *with_bars, "method=linear", "output_dir=run"],
            cwd=tmp_path,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdout=subprocess.DEVNULL,
            stderr=stream,
            timeout=300,
        )
    text = log.read_text()
    assert done.returncode == 0, text
    assert "\r" not in text and "%|" not in text, text
    assert [line.split("] ", 1)[1].split("  loss")[0] for line in text.splitlines() if "] epoch " in line] == [
        "epoch 1/3",
        "epoch 2/3",
        "epoch 3/3",
    ]


def test_a_sweep_without_a_terminal_names_each_run_in_a_line_instead_of_a_bar(tmp_path, monkeypatch, capsys):
    # The sweep's bar went into the log as carriage-return updates; without it, nothing said which run was training.
    def planned(folder: str) -> list[sweep.PlannedRun]:
        return sweep.plan([load_experiment("linear", BENCH)], ["mini/digits"], [0, 1], tmp_path / folder)

    engine = FakeEngine()
    runs = planned("log")
    write_run(tmp_path / "log", "mini/digits", "linear", 0, top1=50.0)  # done before
    capsys.readouterr()
    summary = sweep.run_sweep(runs, engine.train, engine.compose)
    out, err = capsys.readouterr()
    assert summary.trained == 1 and err == "", err
    assert out == "sweep: run 2/2: mini/digits linear seed1\n"
    # progress=False keeps it quiet; on a terminal the bar shows, and no line.
    sweep.run_sweep(planned("quiet"), engine.train, engine.compose, progress=False)
    assert capsys.readouterr() == ("", "")
    monkeypatch.setattr(progress, "bars_shown", lambda: True)
    sweep.run_sweep(planned("terminal"), engine.train, engine.compose)
    out, err = capsys.readouterr()
    assert out == "" and "\rsweep: 100%" in err, err


def test_one_rule_for_every_bar_a_terminal_or_a_notebook_and_the_callers_switch(monkeypatch, capsys):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert progress.bars_shown()
    assert not progress.progress_bar(range(2)).disable
    assert progress.progress_bar(range(2), show=False).disable
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert not progress.bars_shown() and progress.progress_bar(range(2)).disable
    assert list(progress.progress_bar(range(3))) == [0, 1, 2]  # a hidden bar still iterates
    monkeypatch.setattr(sys.stderr, "isatty", _closed)
    assert not progress.bars_shown()


def _closed() -> bool:
    raise ValueError("I/O operation on closed file")


def test_a_bar_not_drawn_says_how_far_its_work_is_in_a_few_lines_where_its_caller_gives_a_say(monkeypatch, capsys):
    # Feature caching, calibrations and predictions had a bar and nothing else: into a log file, minutes of silence.
    lines: list[str] = []
    monkeypatch.setattr(progress, "bars_shown", lambda: False)
    assert sum(progress.progress_bar(range(100), desc="caching train", unit="batch", say=lines.append)) == 4950
    assert lines == [f"caching train: {k}/100 batches" for k in range(0, 101, 10)]  # a line a tenth, not one an item
    lines.clear()
    bar = progress.progress_bar(total=5, initial=2, desc="NOAH evolution", unit="gen", say=lines.append)
    bar.set_postfix(best="50.0")
    bar.update()
    bar.close()  # a search that stops early says where it stopped
    assert lines == ["NOAH evolution: 2/5 gens", "NOAH evolution: 3/5 gens, best 50.0"]
    lines.clear()
    list(progress.progress_bar(range(2), desc="NOAH supernet", unit="epoch", say=lines.append))  # "epoches" was said
    assert lines == ["NOAH supernet: 0/2 epochs", "NOAH supernet: 1/2 epochs", "NOAH supernet: 2/2 epochs"]
    lines.clear()
    monkeypatch.setattr(progress, "LINE_SECONDS", 0.0)  # a minute passed: a line, whatever the tenth
    list(progress.progress_bar(iter(range(2)), desc="evaluate", say=lines.append))
    assert lines == ["evaluate: 0", "evaluate: 1", "evaluate: 2"]
    lines.clear()
    list(progress.progress_bar(range(3), show=False, say=lines.append))  # the caller's switch: quiet everywhere
    monkeypatch.setattr(progress, "bars_shown", lambda: True)  # a terminal: the bar alone, as before
    list(progress.progress_bar(range(3), desc="caching train", say=lines.append))
    assert lines == [] and "caching train: 100%" in capsys.readouterr().err


def test_petl_predict_without_a_terminal_prints_a_few_progress_lines_unless_quiet(tmp_path, monkeypatch, capsys):
    # Thousands of images or a whole split went by without a word where stderr was a file.
    monkeypatch.setattr(progress, "bars_shown", lambda: False)
    runs = [str(_run_folder(tmp_path / name, seed=seed)) for seed, name in enumerate(("a", "b"))]
    images = [*(str(_image(tmp_path / f"{k}.png")) for k in range(3)), "batch_size=1", "overwrite=true"]
    for given, name in (([runs[0]], "a"), (runs, "2 runs")):  # one run alone, two in one MultiTask pass
        code, _, err = command_status(capsys, predict_cli.main, *given, *images, f"out={tmp_path / 'p.csv'}")
        lines = [line for line in err.splitlines() if ": predict " in line]
        assert code == 0 and lines == [f"petl-predict: predict {name}: {k}/3 imgs" for k in range(4)], err
        code, _, err = command_status(capsys, predict_cli.main, *given, *images, f"out={tmp_path / 'q.csv'}", "--quiet")
        assert code == 0 and ": predict " not in err, err
    run = load_run(runs[0])
    split = [(torch.zeros(3, 32, 32), 0)] * 5
    capsys.readouterr()
    predict.evaluate_split(run, split, batch_size=2)
    # In images, as the predict lines are: "evaluate a: 0/3" said three of what (the batches).
    assert capsys.readouterr().err == "".join(f"petl-predict: evaluate a: {k}/5 imgs\n" for k in (0, 2, 4, 5))
    predict.evaluate_split(run, split, batch_size=2, progress=False)
    assert capsys.readouterr().err == ""


def test_a_sweep_shows_each_runs_log_lines_as_petl_run_does(tmp_path, monkeypatch, capsys):
    # petl-bench set up no logging: each run's epoch lines and "resuming ... from epoch K/N" were dropped, so a
    # resumed sweep's log said "training ... 200 epochs" and then nothing for the whole run.
    class LoggingEngine(FakeEngine):
        def train(self, cfg: dict) -> dict:
            logging.getLogger("petl.train.runner").info("resuming %s from epoch %d/%d", cfg["output_dir"], 3, 6)
            return super().train(cfg)

    engine = LoggingEngine()
    monkeypatch.setattr(sweep, "_default_fns", lambda: (engine.train, engine.compose, None))
    monkeypatch.setattr(progress, "bars_shown", lambda: False)
    petl_logger = logging.getLogger("petl")
    handlers, level = list(petl_logger.handlers), petl_logger.level
    args = ["suite=mini", "methods=linear", "tasks=mini/digits", "seeds=0", f"output_dir={tmp_path}", "report=false"]
    assert bench_cli.main(args) == 0
    err = capsys.readouterr().err
    run = sweep.run_dir_for(tmp_path, "mini/digits", "linear", 0)
    assert re.search(rf"^\[\d\d:\d\d:\d\d\] resuming {re.escape(str(run))} from epoch 3/6$", err, re.M), err
    assert petl_logger.handlers == handlers and petl_logger.level == level  # only while the sweep runs
