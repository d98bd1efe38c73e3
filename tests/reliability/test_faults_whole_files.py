"""Every file petl writes is written whole or not at all: a write that fails part-way (a full disk, a kill) leaves the
file that was there, or none, never one cut short that a user or the next petl command would read.

A disk with room for only part of the file is a file-size limit (``RLIMIT_FSIZE``): writes past it fail with EFBIG,
as they would with ENOSPC.  A plain ``write_text`` had already emptied the file, and left it cut short.
"""

from __future__ import annotations

import resource
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from test_harness import BENCH, FakeEngine

import petl
from petl.bench import choice, own_data, speed, sweep
from petl.bench.suite import load_experiment
from petl.data import TEST, TRAIN, TRAIN_VAL, VAL
from petl.utils.errors import RunError


@contextmanager
def room_for(size: int) -> Iterator[None]:
    """Writes of a file past ``size`` bytes fail (EFBIG), as on a disk that fills up."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def _kept(path: Path, before: bytes) -> None:
    assert path.read_bytes() == before
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")] == []  # no temporary file left


def test_choice_md_cut_short_keeps_the_earlier_one(tmp_path):
    first = choice.Choice(best=None, runner_up=None, taken=None, run_dir=None, paragraph="A short paragraph.")
    path = choice.write_choice(tmp_path, first, None, None)
    before = path.read_bytes()
    longer = choice.Choice(
        best=None, runner_up=None, taken=None, run_dir=None, paragraph="A much longer paragraph. " * 200
    )
    with room_for(len(before)), pytest.raises(OSError):
        choice.write_choice(tmp_path, longer, None, None)
    _kept(path, before)


def test_data_json_cut_short_is_not_left_to_refuse_the_next_sweep(tmp_path):
    data = own_data.OwnData(
        "folder", "photos", {}, "0" * 64, ["a", "b"], {TRAIN: 8, VAL: 2, TRAIN_VAL: 10, TEST: 4}, None, 0.0
    )
    with room_for(64), pytest.raises(OSError):
        own_data.claim_output_dir(tmp_path, data)
    # Cut short, it was a damaged data.json that every later sweep into the folder refused.
    assert not (tmp_path / own_data.DATA_FILE).exists()
    own_data.claim_output_dir(tmp_path, data)
    assert own_data.read_record(tmp_path)["fingerprint"] == data.fingerprint


def test_speed_out_cut_short_keeps_the_earlier_table(tmp_path, monkeypatch, capsys):
    out = tmp_path / "speed.md"
    out.write_text("# the earlier table\n")
    before = out.read_bytes()
    monkeypatch.setattr(speed, "run_speed", lambda *args, **kwargs: [])
    monkeypatch.setattr(speed, "format_table", lambda *args, **kwargs: "| row |\n" * 500)
    with room_for(len(before)), pytest.raises(OSError):  # capsys: the table printed first is no file
        speed.main(["methods=linear", f"out={out}"])
    assert "| row |" in capsys.readouterr().out  # printed: the failure was writing out=
    _kept(out, before)


def test_save_trainable_cut_short_keeps_the_earlier_weights(tiny_vit, tmp_path):
    path = tmp_path / "w.safetensors"
    model = petl.apply(tiny_vit(seed=1), "lora", num_classes=4)
    petl.save_trainable(model, path)
    before = path.read_bytes()
    with room_for(len(before) // 2), pytest.raises(OSError):
        petl.save_trainable(model, path)
    _kept(path, before)


def test_a_sweeps_error_log_cut_short_is_not_left(tmp_path, capsys):
    runs = sweep.plan([load_experiment("linear", BENCH)], ["mini/digits"], [0], tmp_path)

    def train(cfg: dict) -> dict:
        raise RunError("the run failed: " + "why " * 500)

    with room_for(1000):  # the run's lock fits, the traceback does not (capsys: its lines are not a file)
        summary = sweep.run_sweep(runs, train, FakeEngine().compose, progress=False)
    log = runs[0].run_dir / sweep.ERROR_FILE
    assert summary.failed[0].endswith(f"{log} not written (File too large)"), summary.failed
    assert not log.exists()  # a traceback cut short read as the whole story
