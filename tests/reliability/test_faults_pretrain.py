"""Faults a user meets with ``petl-pretrain``: bad option values, output folders, interruptions, resumes, two at once.

Every case is bad input said in one line (exit 2) before any image is generated (minutes at the documented sizes),
an interruption that keeps the finished epochs (130 / 143), or a kept checkpoint the same command continues from.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import command_status

from petl.cli import pretrain as pretrain_cli
from petl.train import pretrain
from petl.utils.errors import Terminated

TINY = ["--classes", "2", "--instances", "4", "--epochs", "2", "--batch-size", "4", "--no-progress"]


def petl_pretrain(capsys, *args: str) -> tuple[int, str]:
    """``petl-pretrain ARGS``: its exit status and its stderr."""
    code, _, err = command_status(capsys, pretrain_cli.main, *args)
    return code, err


@pytest.fixture
def no_generation(monkeypatch):
    """Bad input is refused before the fractals are generated: generating fails the test."""

    def generate(*args, **kwargs):
        pytest.fail("generated images for a command that should have been refused")

    monkeypatch.setattr(pretrain, "generate", generate)


@pytest.mark.parametrize(
    ("option", "said"),
    [
        (["--classes", "abc"], "argument --classes: invalid int value: 'abc'"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        # It said "--classes must be >= 1", and then "give 2 or more" for the --classes 1 that obeyed it.
        (["--classes", "0"], "--classes 0: give 2 or more\n"),
        (["--classes", "-3"], "--classes -3: give 2 or more\n"),
        (["--instances", "0"], "--instances must be >= 1"),
        # One class trained nothing (a loss of 0) and wrote the random weights, at "val top-1 100.0%".
        (["--classes", "1", "--instances", "8"], "--classes 1: give 2 or more"),
        (["--lr", "nan"], "--lr nan is not a finite number: allowed (0, inf]"),
        (["--lr", "0"], "--lr 0.0 is out of range: allowed (0, inf]"),
        (["--weight-decay", "-1"], "--weight-decay -1.0 is out of range"),
        (["--warmup-frac", "2"], "--warmup-frac 2.0 is out of range: allowed [0, 1]"),
        # TINY takes 4 steps: 0.1 of them warmed up none, as 0 would (petl-run's rule, engine.refuse_idle_warmup).
        (
            ["--warmup-frac", "0.1"],
            "--warmup-frac 0.1 cannot act: the run takes 4 optimizer steps (2 epochs of 2), and 0.1 of them warms up "
            "for none (a warm-up of one step runs that step at the full lr); give --warmup-frac 0.5 or more, or 0\n",
        ),
        (["warmup_frac=0.05"], "--warmup-frac 0.05 cannot act"),  # the default's value, given: checked too
        (["label_smoothing=inf"], "--label-smoothing inf is not a finite number"),
        (["--label-smoothing", "1"], "--label-smoothing 1.0 is out of range: allowed [0, 1)"),
        (["--seed", "-1"], "--seed -1 is out of range: allowed [0, 4294967295]"),
        (["overwrite=yes"], "overwrite=yes: expected true or false"),
    ],
)
def test_a_bad_option_value_is_one_line_naming_it_and_exit_2(option, said, tmp_path, capsys, no_generation):
    # argparse printed its 8-line usage before its error; the ranges of the float options were a ValueError naming
    # petl-run's train.lr (exit 1), and a negative seed failed inside accelerate's set_seed (exit 1).
    code, err = petl_pretrain(capsys, *TINY, "--out", str(tmp_path / "out"), *option)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("petl-pretrain: error: ") and said in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("given", "frac"), [([], 0.05), (["--warmup-frac", "0.5"], 0.5), (["warmup_frac=0"], 0.0)])
def test_a_warmup_that_acts_or_none_or_the_default_is_taken_on_a_tiny_run(given, frac, tmp_path, capsys, monkeypatch):
    # The default's 0.05 of TINY's 4 steps warms up none, but is not refused: the committed tiny pretrainings use it.
    taken = []

    def recorded(_fractal, settings, *args, **kwargs) -> dict:
        taken.append(settings.warmup_frac)
        return {"images_seen": 0, "final_val_top1": 0.0, "wall_seconds": 0.0}

    monkeypatch.setattr(pretrain, "pretrain", recorded)
    code, err = petl_pretrain(capsys, *TINY, "--out", str(tmp_path / "out"), *given)
    assert code == 0, err
    assert taken == [frac]


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 acts on a CUDA GPU")
def test_fp16_without_a_cuda_gpu_is_refused_before_generating(tmp_path, capsys, no_generation):
    # accelerate ran it in fp32 without a word, and the provenance record said "precision": "fp16".
    code, err = petl_pretrain(capsys, *TINY, "--out", str(tmp_path / "out"), "--precision", "fp16")
    assert code == 2 and err.count("\n") == 1, err
    assert "--precision fp16 needs a CUDA GPU" in err and "give --precision bf16 or no" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["file", "below a file"])
def test_an_out_that_cannot_be_written_is_refused_before_generating(where, tmp_path, capsys, no_generation):
    # It failed at the first epoch's checkpoint, after the generation and an epoch: FileExistsError, exit 1.
    blocker = tmp_path / "taken"
    blocker.write_text("a file\n")
    out = blocker if where == "file" else blocker / "out"
    code, err = petl_pretrain(capsys, *TINY, "--out", str(out))
    assert code == 2 and err.count("\n") == 1, err
    assert f"--out {out}" in err and "choose another --out" in err
    assert blocker.read_text() == "a file\n"


def test_a_model_that_does_not_take_32_px_images_is_refused_before_generating(tmp_path, capsys, no_generation):
    # timm's input-size assertion escaped every handler: a 20-line traceback, after the generation.
    code, err = petl_pretrain(capsys, *TINY, "--out", str(tmp_path / "out"), "--model", "vit_tiny_patch16_224")
    assert code == 2 and err.count("\n") == 1, err
    assert "vit_tiny_patch16_224 does not take the fractals' 32 px images" in err
    assert not (tmp_path / "out").exists()  # nor the folder (made for its lock) left behind


@pytest.mark.parametrize(("rank", "lines"), [("0", 1), ("1", 0)])
def test_a_launch_of_several_processes_is_refused_by_its_first(
    rank, lines, tmp_path, capsys, monkeypatch, no_generation
):
    # Each process claimed the lock (the second then refused, exit 1) and the cosine counted the unsharded loader.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)
    code, err = petl_pretrain(capsys, *TINY, "--out", str(tmp_path / "out"))
    assert code == 2 and err.count("\n") == lines, err
    assert err == lines * (
        "petl-pretrain: error: WORLD_SIZE=2: petl-pretrain runs as one process; start it without accelerate launch "
        "or torchrun\n"
    )
    assert not (tmp_path / "out").exists()


def _interrupted_after_one_epoch(capsys, monkeypatch, out, interruption: type[KeyboardInterrupt]) -> tuple[int, str]:
    save = pretrain.files.save_checkpoint

    def save_then_stop(path, state):
        save(path, state)
        raise interruption

    monkeypatch.setattr(pretrain.files, "save_checkpoint", save_then_stop)
    result = petl_pretrain(capsys, *TINY, "--out", str(out))
    monkeypatch.setattr(pretrain.files, "save_checkpoint", save)
    return result


def test_sigterm_keeps_the_epochs_and_the_same_command_continues(tmp_path, capsys, monkeypatch):
    code, err = _interrupted_after_one_epoch(capsys, monkeypatch, tmp_path, Terminated)
    partial = pretrain.partial_file(tmp_path)
    assert code == 143 and err.count("\n") == 1 and "terminated (SIGTERM)" in err and "continues" in err
    assert partial.exists()
    code, err = petl_pretrain(capsys, *TINY, "--out", str(tmp_path))
    weights, provenance = pretrain.output_files(tmp_path)
    assert code == 0 and weights.exists() and provenance.exists() and not partial.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([weights.name, provenance.name])


def test_ctrl_c_before_the_first_epoch_says_the_same_command_starts_over(tmp_path, capsys, monkeypatch):
    # Interrupted while it generated the fractals, it said "the same command continues from the last finished epoch":
    # there was none, and the same command generated and trained from the start.
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(pretrain, "generate", interrupted)
        code, err = petl_pretrain(capsys, *TINY, "--out", str(tmp_path))
    assert code == 130 and not pretrain.partial_file(tmp_path).exists()
    assert err == (
        "petl-pretrain: error: interrupted before the first epoch finished, so no epoch is kept and no weights "
        "written: the same command starts the pretraining over\n"
    )


def test_a_resume_with_other_options_names_the_difference_and_keeps_the_checkpoint(tmp_path, capsys, monkeypatch):
    # It said only 'a pretraining of another recipe' (exit 1, as a ValueError), after generating the images.
    code, _ = _interrupted_after_one_epoch(capsys, monkeypatch, tmp_path, KeyboardInterrupt)
    partial = pretrain.partial_file(tmp_path)
    kept = partial.read_bytes()
    assert code == 130
    with monkeypatch.context() as patched:
        patched.setattr(pretrain, "generate", lambda *a, **k: pytest.fail("generated before refusing"))
        code, err = petl_pretrain(capsys, *TINY, "--out", str(tmp_path), "--lr", "0.002", "--label-smoothing", "0")
    assert code == 2 and err.count("\n") == 1, err
    assert str(partial) in err and "--lr 0.001 then, 0.002 now" in err and "--label-smoothing 0.1 then, 0.0 now" in err
    assert partial.read_bytes() == kept
    code, err = petl_pretrain(capsys, *TINY, "--out", str(tmp_path))  # the first options go on
    assert code == 0 and not partial.exists()


@pytest.mark.parametrize("damage", ["truncated", "garbage", "another kind"])
def test_a_damaged_checkpoint_is_named_in_one_line_and_kept(damage, tmp_path, capsys, monkeypatch):
    # A cut file was a DamagedFileError said as a failure (exit 1), after the generation; a checkpoint without the
    # recipe (petl-run's checkpoint.pt copied in) a KeyError traceback.
    partial = pretrain.partial_file(tmp_path)
    if damage == "another kind":
        pretrain.files.save_checkpoint(partial, dict.fromkeys(pretrain.files.CHECKPOINT_KEYS, 0))
    else:
        _interrupted_after_one_epoch(capsys, monkeypatch, tmp_path, KeyboardInterrupt)
        whole = partial.read_bytes()
        partial.write_bytes(whole[: len(whole) // 2] if damage == "truncated" else b"not a checkpoint\n")
    kept = partial.read_bytes()
    with monkeypatch.context() as patched:
        patched.setattr(pretrain, "generate", lambda *a, **k: pytest.fail("generated before refusing"))
        code, err = petl_pretrain(capsys, *TINY, "--out", str(tmp_path))
    assert code == 2 and err.count("\n") == 1, err
    assert f"{partial} is damaged" in err and "remove it to start over" in err
    assert partial.read_bytes() == kept


def test_a_checkpoint_of_a_newer_petl_advises_upgrading_and_is_kept(tmp_path, capsys, no_generation):
    # It said "was written by a newer petl ...: remove it to start over", as if a newer petl's epochs were damage.
    partial = pretrain.partial_file(tmp_path)
    pretrain.files.save_checkpoint(partial, {**dict.fromkeys(pretrain.files.CHECKPOINT_KEYS, 0), "version": 2})
    kept = partial.read_bytes()
    code, err = petl_pretrain(capsys, *TINY, "--out", str(tmp_path))
    assert code == 2 and err.count("\n") == 1, err
    assert f"{partial} was written by a newer petl (checkpoint version 2; this petl reads up to 1)" in err
    assert err.rstrip().endswith(": upgrade petl to continue it, remove it to start over, or choose another --out")
    assert partial.read_bytes() == kept


def test_a_pretraining_after_a_bf16_training_in_one_process_runs(tmp_path, capsys):
    """accelerate's precision is process-wide and refuses to change: after a bf16 training (a GPU's default) in the
    same process (a notebook, a test session on the lent H200), petl-pretrain's fp32 said "AcceleratorState has
    already been initialized" and exited 1."""
    from accelerate.state import AcceleratorState

    from petl.train.engine import fresh_accelerator

    fresh_accelerator(mixed_precision="bf16")  # what a GPU run of petl-run leaves behind
    try:
        code, err = petl_pretrain(capsys, *TINY, "--out", str(tmp_path))
    finally:
        AcceleratorState._reset_state()
    assert code == 0, err
    assert pretrain.output_files(tmp_path)[0].is_file()


def test_the_weights_are_petl_runs_backbone_and_a_folder_given_instead_is_one_line(tmp_path, capsys):
    from petl.cli import run as run_cli
    from petl.utils import paths

    code, _ = petl_pretrain(capsys, *TINY, "--out", str(tmp_path / "pre"))
    weights, _ = pretrain.output_files(tmp_path / "pre")
    assert code == 0
    run = ["method=linear", "data=mini/digits", "data.subset=32", "train.epochs=1", "train.progress=false"]
    for checkpoint, status in ((weights, 0), (tmp_path / "pre", 2)):
        out = f"output_dir={tmp_path / checkpoint.name}-run"
        code, _, err = command_status(capsys, run_cli.main, *run, f"model.checkpoint={checkpoint}", out)
        assert code == status, err
    # The folder (petl-pretrain's --out) was said to be no such file.
    assert f"model.checkpoint={tmp_path / 'pre'} is a folder: give the weights file in it" in err
    result = (tmp_path / f"{weights.name}-run" / "result.json").read_text()
    assert paths.file_sha256(weights) in result


# --- one pretraining of an architecture per folder: its lock ----------------------------------------------

SWIN = "swin_fractal_tiny_patch2_window4_32"


@pytest.fixture
def live_pid():
    """The pid of another process that lives as long as the test (the holder of a lock), without timing races."""
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield holder.pid
    holder.kill()
    holder.wait()


def _dead_pid() -> int:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


def _hold(out: Path, arch: str, pid: int) -> str:
    """Write ``arch``'s lock in ``out`` held by ``pid`` on this host, as petl.store.lock writes it; its text."""
    text = json.dumps({"host": socket.gethostname(), "pid": pid, "since": time.time()})
    out.mkdir(parents=True, exist_ok=True)
    pretrain.lock_file(out, arch).write_text(text)
    return text


def _lock_seen_at_each_checkpoint(monkeypatch, out: Path, arch: str = pretrain.ARCH) -> list:
    """What the lock of ``arch`` in ``out`` held (its pid, None without one) as each epoch's checkpoint was saved."""
    seen: list = []
    save = pretrain.files.save_checkpoint

    def save_and_look(path, state):
        lock = pretrain.lock_file(out, arch)
        seen.append(json.loads(lock.read_text())["pid"] if lock.exists() else None)
        save(path, state)

    monkeypatch.setattr(pretrain.files, "save_checkpoint", save_and_look)
    return seen


def test_a_second_pretraining_of_one_model_into_one_folder_is_refused_naming_the_holder(
    tmp_path, capsys, live_pid, no_generation
):
    # Nothing stopped it: both wrote {arch}.fractaldb.partial.pt and the weights in turn, silently mixing them.
    held = _hold(tmp_path, pretrain.ARCH, live_pid)
    code, err = petl_pretrain(capsys, *TINY, "--out", str(tmp_path))
    assert code == 1 and err.count("\n") == 1, err  # petl-run's status for an output_dir in use
    assert err.startswith(f"petl-pretrain: error: --out {tmp_path} is in use by another pretraining of {pretrain.ARCH}")
    assert f"(pid {live_pid} on host {socket.gethostname()}" in err and "RunError" not in err
    assert pretrain.lock_file(tmp_path, pretrain.ARCH).read_text() == held  # the holder's lock is left alone
    assert [p.name for p in tmp_path.iterdir()] == [pretrain.lock_file(tmp_path).name]


def test_pretrainings_of_two_models_into_one_folder_run_side_by_side(tmp_path, capsys, monkeypatch, live_pid):
    # The folder holds the files of several architectures: the ViT's lock does not stand in the Swin's way.
    held = _hold(tmp_path, pretrain.ARCH, live_pid)
    seen = _lock_seen_at_each_checkpoint(monkeypatch, tmp_path, SWIN)
    code, err = petl_pretrain(capsys, *TINY, "--out", str(tmp_path), "--model", SWIN)
    assert code == 0, err
    assert seen == [os.getpid(), os.getpid()]  # the Swin's own lock, held while it trained
    assert all(p.exists() for p in pretrain.output_files(tmp_path, SWIN))
    assert not pretrain.lock_file(tmp_path, SWIN).exists()
    assert pretrain.lock_file(tmp_path, pretrain.ARCH).read_text() == held


def test_the_lock_is_held_while_pretraining_and_released_after(tmp_path, capsys, monkeypatch):
    out = tmp_path / "new" / "pre"
    seen = _lock_seen_at_each_checkpoint(monkeypatch, out)
    code, err = petl_pretrain(capsys, *TINY, "--out", str(out))
    assert code == 0, err
    assert seen == [os.getpid(), os.getpid()]
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in pretrain.output_files(out))


@pytest.mark.parametrize(
    ("stop", "status"),
    [(KeyboardInterrupt, 130), (Terminated, 143), (OSError("No space left on device"), 1)],
    ids=["ctrl-c", "sigterm", "failure"],
)
def test_the_lock_is_released_after_an_interruption_or_a_failure(stop, status, tmp_path, capsys, monkeypatch):
    seen = _lock_seen_at_each_checkpoint(monkeypatch, tmp_path)
    save = pretrain.files.save_checkpoint

    def save_then_stop(path, state):
        save(path, state)
        raise stop

    monkeypatch.setattr(pretrain.files, "save_checkpoint", save_then_stop)
    code, err = petl_pretrain(capsys, *TINY, "--out", str(tmp_path))
    assert code == status and err.count("\n") == 1, err
    assert seen == [os.getpid()]
    assert not pretrain.lock_file(tmp_path).exists() and pretrain.partial_file(tmp_path).exists()


def test_a_lock_left_by_a_dead_process_is_taken_over(tmp_path, capsys, monkeypatch):
    # A pretraining killed with SIGKILL (or its node's crash) leaves its lock: the same command goes on.
    _hold(tmp_path, pretrain.ARCH, _dead_pid())
    seen = _lock_seen_at_each_checkpoint(monkeypatch, tmp_path)
    code, err = petl_pretrain(capsys, *TINY, "--out", str(tmp_path))
    assert code == 0, err
    assert seen == [os.getpid(), os.getpid()]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in pretrain.output_files(tmp_path))
