"""Faults and bad input, records pass: a ``result.json`` is checked, never trusted, by every command that reads it.

Each case goes through a public entry point (petl-bench's and petl-run's mains): a malformed or out-of-range
field (F1, F7), a record in another task's folder (F8), and a finished output_dir whose record or weights do not
hold up (F2).  One reader checks them all (:func:`petl.store.result.read_result`).
"""

from __future__ import annotations

import csv
import io
import json
import shutil
from pathlib import Path

import pytest
from conftest import command_status, tiny_run
from test_faults_untrusted_files import _mini_sweep, petl_bench
from test_harness import FakeEngine, write_run

from petl.bench import sweep
from petl.bench.collect import read_all
from petl.cli import run as cli


def petl_run(capsys, *args: str) -> tuple[int, str]:
    """``petl-run ARGS``: its exit status and its stderr."""
    code, _, err = command_status(capsys, cli.main, *args)
    return code, err


def _edit(path: Path, **changes) -> None:
    record = json.loads(path.read_text())
    record.update(changes)
    path.write_text(json.dumps(record))


def _rows(folder: Path) -> dict[str, dict[str, str]]:
    return {r["experiment"]: r for r in csv.DictReader(io.StringIO((folder / "leaderboard.csv").read_text()))}


def _board(root: Path) -> None:
    for experiment, top1 in (("linear", 50.0), ("lora", 60.0), ("full", 70.0)):
        for seed in (0, 1):
            write_run(root, "mini/digits", experiment, seed, top1=top1 + seed)


# --- F1, F7: a malformed or out-of-range field is named and left out; the report still comes ----------------------


@pytest.mark.parametrize(
    ("field", "value", "what"),
    [
        ("final_train_loss", "abc", "a finite number"),  # was: could not convert string to float, exit 2
        ("final_train_loss", [1], "a finite number"),  # was: TypeError, exit 1
        ("num_classes", "ten", "an integer of at least 1"),  # was: TypeError, exit 1
        ("test_top1", 1234.5, "a percentage from 0 to 100"),  # was: on the board, a row mean of 374.99
        ("test_top1", -5, "a percentage from 0 to 100"),
        ("trainable_params", 10**12, "more than total_params"),  # was: on the board, a trainable share over 100 %
    ],
)
def test_f1_f7_a_bad_field_is_named_and_the_leaderboard_is_written(tmp_path, capsys, field, value, what):
    _board(tmp_path)
    bad = tmp_path / "mini-digits/lora/seed0/result.json"
    _edit(bad, **{field: value})
    code, out, err = petl_bench(capsys, "report", str(tmp_path), f"out={tmp_path / 'r'}")
    assert code == 0 and "Traceback" not in err, err
    assert f"skipping {bad}: field {field!r} is " in err and what in err
    rows = _rows(tmp_path / "r")
    assert rows["lora"]["runs"] == "1" and float(rows["lora"]["task_mean"]) == 61.0
    assert "1 result.json file was skipped" in (tmp_path / "r" / "leaderboard.md").read_text()


def _sweep_again_after_editing(tmp_path: Path, monkeypatch, capsys, **fields) -> tuple[Path, str, FakeEngine]:
    """A mini sweep of two seeds, its seed-1 record edited to ``fields``, then the same sweep again.

    Returns:
        The edited record's path, what the second sweep printed (stdout and stderr) and the engine that trained.

    """
    engine = FakeEngine()
    monkeypatch.setattr(sweep, "_default_fns", lambda: (engine.train, engine.compose, None))
    assert petl_bench(capsys, *_mini_sweep(tmp_path))[0] == 0
    bad = tmp_path / "mini-digits/linear/seed1/result.json"
    _edit(bad, **fields)
    (tmp_path / "leaderboard.md").unlink()
    code, out, err = petl_bench(capsys, *_mini_sweep(tmp_path))
    assert code == 0 and "Traceback" not in err, err
    return bad, out + err, engine


def test_f1_a_sweep_trains_a_run_with_a_malformed_record_again_and_reports(tmp_path, monkeypatch, capsys):
    bad, said, engine = _sweep_again_after_editing(tmp_path, monkeypatch, capsys, final_train_loss="abc")
    assert f"{bad}: field 'final_train_loss' is 'abc'" in said
    assert len(engine.trained) == 3 and "resume=false" in engine.trained[-1]
    assert (tmp_path / "leaderboard.md").is_file()


# --- F8: a record in another task's folder is skipped, not read as a task of its own --------------------------------


def test_f8_a_record_of_another_task_in_a_task_folder_is_skipped_with_a_warning(tmp_path, capsys):
    _board(tmp_path)
    write_run(tmp_path / "elsewhere", "mini/mnist", "full", 1, top1=99.0)
    moved = tmp_path / "mini-digits/full/seed1/result.json"
    shutil.copy(tmp_path / "elsewhere/mini-mnist/full/seed1/result.json", moved)
    shutil.rmtree(tmp_path / "elsewhere")
    code, out, err = petl_bench(capsys, "report", str(tmp_path), f"out={tmp_path / 'r'}")
    assert code == 0 and "Traceback" not in err, err
    assert f"skipping {moved}: a run of mini/mnist in the folder of another task (mini-digits/)" in err
    # Nothing finished is deleted unless the user asks (was: "or delete it"): moved where it belongs, or aside.
    aside = f"or aside (rename {moved.parent} to seed1.replaced-old)"
    assert f"move it to {tmp_path / 'mini-mnist/full/seed1'}, {aside}" in err
    rows = _rows(tmp_path / "r")
    # One task, no mnist column; the other rows complete (before: every row starred, the rank test on 0 rows).
    assert not any("mnist" in key for key in rows["full"]) and rows["full"]["runs"] == "1"
    assert rows["linear"]["tasks_done"] == "1/1" and rows["lora"]["runs"] == "2"


def test_f8_other_layouts_still_read(tmp_path):
    # petl-run's default output_dir (runs/<data>/<model>/<method>/seed<k>) read from its data folder: the folder
    # above the method is a model's, which says nothing about the task.
    model = "vit_fractal_tiny_patch4_32.fractaldb"
    write_run(tmp_path / "runs", "mini/digits", f"{model}/lora", 0, method="lora", top1=60.0)
    assert len(read_all(tmp_path / "runs" / "mini-digits")) == 1
    # Own data: the task is the dataset's name (petl.bench.own_data), its folder that name.
    write_run(tmp_path / "own", "folder", "lora", 0, top1=60.0)
    assert [r.dataset for _, r in read_all(tmp_path / "own")] == ["folder"]


def test_f8_a_sweep_trains_a_run_whose_folder_holds_another_tasks_record_again(tmp_path, monkeypatch, capsys):
    bad, said, engine = _sweep_again_after_editing(tmp_path, monkeypatch, capsys, dataset="mini/mnist")
    assert f"{bad}: a run of mini/mnist, not of mini/digits" in said
    assert len(engine.trained) == 3 and "resume=false" in engine.trained[-1]


def test_f8_a_sweep_trains_a_run_whose_folder_holds_another_seeds_record_again(tmp_path, monkeypatch, capsys):
    # Was: seed1/result.json edited to say seed 0 counted as done, and the report then left seed 1's cell short.
    bad, said, engine = _sweep_again_after_editing(tmp_path, monkeypatch, capsys, seed=0)
    assert f"{bad}: a run of seed 0, not of seed 1 whose folder it is in" in said
    assert len(engine.trained) == 3 and "resume=false" in engine.trained[-1]


# --- F2: petl-run returns a finished run only when its record and weights hold up --------------------------------


@pytest.mark.slow
def test_f2_a_finished_run_is_returned_only_whole(tmp_path, capsys):
    command = [*tiny_run(epochs=1), "method=lora"]
    run = tmp_path / "run"
    assert petl_run(capsys, *command, f"output_dir={run}")[0] == 0
    damages = {
        "no weights": (lambda d: (d / "trainable.safetensors").unlink(), "without its trainable.safetensors"),
        "method": (
            lambda d: _edit(d / "result.json", method="vpt", test_top1=99.9),
            "method 'vpt' is not the method of the config it records ('lora')",
        ),
        "test_top1": (
            lambda d: _edit(d / "result.json", test_top1="abc"),
            "field 'test_top1' is 'abc', not a percentage from 0 to 100",
        ),
        "seed": (lambda d: _edit(d / "result.json", seed=1.7), "field 'seed' is 1.7, not an integer of at least 0"),
    }
    for name, (damage, message) in damages.items():
        copy = tmp_path / name.replace(" ", "_")
        shutil.copytree(run, copy)
        damage(copy)
        before = {p.name: p.read_bytes() for p in copy.iterdir()}
        code, err = petl_run(capsys, *command, f"output_dir={copy}")
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, (name, err)
        assert err.startswith(f"petl-run: error: output_dir {copy}") and message in err, (name, err)
        assert "resume=false" in err and "already finished" not in err
        assert {p.name: p.read_bytes() for p in copy.iterdir()} == before  # nothing finished deleted
    code, err = petl_run(capsys, *command, f"output_dir={tmp_path / 'no_weights'}", "resume=false")
    assert code == 0 and (tmp_path / "no_weights" / "trainable.safetensors").is_file()
