"""Faults and bad input a new user met: an unfinished run given to petl-predict, petl-export and petl-serve (one line
saying it is unfinished), petl-serve on a folder of runs (runs set aside by resume=false and unfinished runs not
served, each named), out= where nothing can be written (refused before predicting), a folder data.root that is
train/ itself, a hidden class folder said once per run and an image outside the class folders said at all, a hub
error quoted without a double period.

Each test goes through a public entry point (the commands' mains, petl.load_run, the dataset describer); none trains.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf
from PIL import Image
from test_faults_issue52 import _main

import petl
from petl.cli import export as export_cli
from petl.cli import predict as predict_cli
from petl.cli import serve as serve_cli
from petl.data import folder
from petl.run import default_config
from petl.store import files
from petl.store.run_card import RunFolderError
from petl.train import output_dir as folder_checks
from petl.train.config import ConfigError
from petl.utils import once

UNFINISHED = "is an unfinished petl-run folder (checkpoint.pt without result.json): run the same petl-run command again"


def _image(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (24, 24, 3), dtype=np.uint8)).save(path)
    return path


def _unfinished(path: Path) -> Path:
    """What an interrupted petl-run leaves: its config, its finished epochs' metrics and checkpoint, no result."""
    path.mkdir(parents=True)
    for name in ("checkpoint.pt", "config.yaml", "metrics.jsonl"):
        (path / name).write_text("")
    return path


def _finished(path: Path) -> Path:
    """A run folder as petl-serve finds one (the files are not read before the runs load)."""
    path.mkdir(parents=True)
    for name in ("config.yaml", "model.json", "trainable.safetensors", "result.json"):
        (path / name).write_text("{}")
    return path


def _each_command_refuses(folder: Path, tmp_path: Path, capsys) -> list[str]:
    """What petl-predict (alone, and after a run), petl-export (out= ``tmp_path/export-out``) and petl-serve (a folder,
    task.NAME=) say of ``folder`` given where a run folder is wanted: each exits 2 in one line."""
    image = _image(tmp_path / "a.png")
    said = []
    for main, argv in [
        (predict_cli.main, [str(folder), str(image)]),
        # After a run, where petl-predict searched an exported folder for images: "holds no image files (.jpg, ...)".
        (predict_cli.main, [str(_finished(tmp_path / "done")), str(folder), str(image)]),
        (export_cli.main, [str(folder), f"out={tmp_path / 'export-out'}"]),
        (serve_cli.main, [str(folder)]),
        (serve_cli.main, [f"task.t={folder}"]),
    ]:
        code, err = _main(main, argv, capsys)
        assert code == 2 and err.count("\n") == 1, (argv, err)
        said.append(err)
    return said


def test_an_unfinished_run_is_named_as_one_by_every_command(tmp_path, capsys):
    # Each said another thing: "not a run folder (no trainable.safetensors)", "not a finished petl-run folder",
    # "holds no run folder (no model.json)".
    run = _unfinished(tmp_path / "u")
    for err in _each_command_refuses(run, tmp_path, capsys):
        assert f"error: {run} {UNFINISHED}" in err, err
    with pytest.raises(RunFolderError, match=re.escape(f"{run} {UNFINISHED}")):
        petl.load_run(run)
    assert not (tmp_path / "export-out").exists()  # petl-export's out= in _each_command_refuses


def test_a_run_stopped_before_its_first_epoch_ended_is_named_as_one(tmp_path, capsys):
    # Ctrl-C in the first epoch leaves config.yaml and metrics.jsonl, no checkpoint: petl-predict said "is not a run
    # folder (no trainable.safetensors): give a petl-run output_dir first" of the output_dir petl-run had made.
    run = _stopped(tmp_path / "u")
    said = f"{run} is a petl-run folder stopped before its first epoch ended (config.yaml without checkpoint.pt or "
    said += "result.json): run the same petl-run command again to train it"
    image = _image(tmp_path / "a.png")
    for main, argv in [
        (predict_cli.main, [str(run), str(image)]),
        (export_cli.main, [str(run), f"out={tmp_path / 'exported'}"]),
        (serve_cli.main, [str(run)]),
    ]:
        code, err = _main(main, argv, capsys)
        assert code == 2 and err.count("\n") == 1 and f"error: {said}" in err, (argv, err)
    with pytest.raises(RunFolderError, match=re.escape(said)):
        petl.load_run(run)


def _stopped(path: Path, *more: str) -> Path:
    """What petl-run stopped before its first checkpoint leaves (its config.yaml, metrics.jsonl), and ``more``."""
    path.mkdir(parents=True)
    files.write_config(path, OmegaConf.to_container(default_config(["method=lora"]), resolve=True))
    for name in ("metrics.jsonl", *more):
        (path / name).write_text("{}")
    return path


def test_petl_run_and_the_readers_agree_on_a_run_stopped_before_its_first_checkpoint(tmp_path):
    # The readers called any config.yaml beside a metrics.jsonl such a run: a finished run whose result.json was
    # deleted (its weights and card kept, which load_run loads) was "stopped before its first epoch ended: run the
    # same petl-run command again", a command petl-run refuses there, as it does beside a config.yaml not a run's.
    # A run stopped while it cached features (config.yaml alone) was "not a run folder", and petl-run rewrites it.
    cfg = default_config(["method=lora"])
    resolved = OmegaConf.to_container(cfg, resolve=True)
    stopped = [_stopped(tmp_path / "s"), _stopped(tmp_path / "caching")]
    (tmp_path / "caching" / "metrics.jsonl").unlink()
    others = [_stopped(tmp_path / "r", "trainable.safetensors", "model.json"), _stopped(tmp_path / "m", "model.json")]
    for mine in ("", "my: precious\n"):  # files of the user's own beside a metrics.jsonl
        others.append(tmp_path / f"own{len(others)}")
        others[-1].mkdir()
        (others[-1] / "config.yaml").write_text(mine)
        (others[-1] / "metrics.jsonl").write_text("{}")
    for run in stopped:
        assert files.stopped_before_checkpoint(run) and "stopped before its first epoch" in files.unfinished_run(run)
        assert folder_checks.check_output_dir(run, cfg, resolved, is_main=True) is None  # rewritten
    for run in others:
        assert not files.stopped_before_checkpoint(run) and files.unfinished_run(run) is None, run
        with pytest.raises(ConfigError, match=rf"output_dir {re.escape(str(run))}"):
            folder_checks.check_output_dir(run, cfg, resolved, is_main=True)
    # The readers say what that run's folder lacks, not to train it again.
    with pytest.raises(RunFolderError, match=r"model.json is not valid JSON|not a petl model record"):
        petl.load_run(tmp_path / "r")


def test_images_given_before_the_run_are_said_to_come_after_it(tmp_path, capsys):
    # Was "a.png is not a run folder (no trainable.safetensors): give a petl-run output_dir first", the run given.
    run, image = _finished(tmp_path / "run"), _image(tmp_path / "a.png")
    code, err = _main(predict_cli.main, [str(image), str(run)], capsys)
    said = f"error: {image} is not a run folder, {run} is: give the run folders first, then the images (petl-predict "
    assert code == 2 and err.count("\n") == 1 and said in err, err


def test_predict_with_no_readable_image_says_nothing_was_predicted(tmp_path, monkeypatch, capsys):
    # One bad image given alone was "1 image(s) cannot be read, the others were predicted": there were no others.
    import torch

    from petl.data.transforms import ImageSpec
    from petl.deploy import predict
    from petl.store.run_card import LoadedRun

    class Zeros(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(()))  # predict_images puts the batch where this is

        def forward(self, batch: torch.Tensor) -> torch.Tensor:
            return torch.zeros(len(batch), 2)

    run = LoadedRun(Zeros(), ImageSpec(image_size=8), ["a", "b"], {}, tmp_path)
    monkeypatch.setattr(predict, "_load", lambda folder, merge: run)
    folder, good, bad = _finished(tmp_path / "run"), _image(tmp_path / "good.png"), tmp_path / "bad.png"
    bad.write_text("not an image")
    code, err = _main(predict_cli.main, [str(folder), str(bad)], capsys)
    assert code == 2 and f"error: 1 image(s) cannot be read, nothing was predicted: {bad} (" in err, err
    # And what to do, at the end of the one line (the reason alone did not say it).
    assert err.strip().splitlines()[-1].endswith("): fix them, or leave them out"), err
    code, err = _main(predict_cli.main, [str(folder), str(good), str(bad)], capsys)
    assert code == 2 and "error: 1 image(s) cannot be read, the others were predicted: " in err, err


def test_petl_serve_on_a_folder_leaves_out_runs_set_aside_and_unfinished_ones_naming_them(tmp_path, capsys):
    # Both lin.replaced-<time> (the run resume=false replaced) and lin were served as tasks; u was left out silently.
    runs = tmp_path / "sw"
    lin, lora = _finished(runs / "lin"), _finished(runs / "lora")
    replaced = _finished(runs / "lin.replaced-20261128-111154")
    _unfinished(runs / "lin.replaced-20261128-111154-2")  # set aside while unfinished: said once, as set aside
    unfinished = _unfinished(runs / "u")
    stopped = _stopped(runs / "v")  # was left out silently, stopped before its first checkpoint
    capsys.readouterr()
    assert serve_cli.find_runs([str(runs)]) == {"lin": lin, "lora": lora}
    notes = capsys.readouterr().err.splitlines()
    assert len(notes) == 3, notes
    assert notes[0].startswith("petl-serve: note: not served: 2 runs set aside by resume=false")
    assert f"{replaced}, {replaced}-2" in notes[0]
    said = f"petl-serve: note: not served: {unfinished} {UNFINISHED} (resume=true, the default) to resume it"
    assert notes[1] == said
    assert notes[2] == f"petl-serve: note: not served: {files.unfinished_run(stopped)}", notes[2]
    assert "stopped before its first epoch ended" in notes[2]
    # Named itself, a run set aside is served: the user asked for it.
    assert serve_cli.find_runs([f"task.old={replaced}"]) == {"old": replaced}
    # A folder of nothing but unfinished runs holds no run to serve.
    only = tmp_path / "only"
    _unfinished(only / "a")
    code, err = _main(serve_cli.main, [str(only)], capsys)
    assert code == 2 and err.splitlines()[-1].startswith(f"petl-serve: error: {only} holds no finished run folder")


def test_out_where_nothing_can_be_written_is_refused_before_predicting(tmp_path, capsys):
    # out=/proc/x.csv predicted every image, then failed "cannot write /proc/x.csv", exit 1.
    run = _finished(tmp_path / "run")
    image = _image(tmp_path / "a.png")
    a_file = tmp_path / "notes.txt"
    a_file.write_text("")
    targets = [("out", a_file / "x.csv"), ("confusion", a_file / "m.png")]
    if Path("/proc/self").is_dir():
        targets.append(("out", Path("/proc/x.csv")))
    for key, target in targets:
        evaluate = ["data=folder", f"data.root={tmp_path}"] if key == "confusion" else [str(image)]
        code, err = _main(predict_cli.main, [str(run), *evaluate, f"{key}={target}"], capsys)
        assert code == 2 and err.count("\n") == 1, err
        # The folder and why (a file, not a folder; /proc refuses new files), then what to do.
        assert err.startswith(f"petl-predict: error: {key}={target}: {target.parent} "), err
        assert err.rstrip().endswith(": choose a folder you can write to"), err
    # The run folder holds no real weights: nothing was loaded, the refusal came first.  A folder still to be made
    # is made by the writer: the check makes it and removes it again (test_faults_unwritable_folder).
    from petl.utils.paths import cannot_write_in

    assert cannot_write_in(tmp_path / "new" / "deeper") is None
    assert not (tmp_path / "new").exists() and not list(tmp_path.glob(".petl-write-check.*"))


@pytest.mark.parametrize("split", ["train", "test"])
def test_a_split_folder_given_as_the_root_is_answered_with_its_parent(tmp_path, split):
    # data.root=imgs/train said "imgs/train has no train/ folder: put the images in imgs/train/train/<class name>/".
    for name in ("red", "blue"):
        _image(tmp_path / "imgs" / split / name / "0.png")
    with pytest.raises(ValueError, match=re.escape(f"give data.root={tmp_path / 'imgs'}")):
        folder.describe_folder(str(tmp_path / "imgs" / split))
    # Any other folder without train/ gets the layout.
    with pytest.raises(ValueError, match="has no train/ folder: put the images in"):
        folder.describe_folder(str(tmp_path / "imgs" / split / "red"))


def test_a_hidden_class_folder_is_said_once_and_a_loose_image_is_said_at_all(tmp_path, caplog, monkeypatch):
    # One petl-run said the .purple warning 4 times (the folder is read when the command line is checked, then for
    # each split built); an image beside the class folders was dropped without a word.
    monkeypatch.setattr(once, "SAID", set())
    for name in ("red", "blue", ".purple"):
        for i in range(3):
            _image(tmp_path / "train" / name / f"{i}.png")
    _image(tmp_path / "train" / "stray.png")
    with caplog.at_level(logging.WARNING, logger="petl.data.folder"):
        for _ in range(4):
            folder._scan.cache_clear()  # as each build_folder does
            info = folder.describe_folder(str(tmp_path))
    assert info.num_classes == 2
    warned = [record.getMessage() for record in caplog.records]
    assert len(warned) == 2, warned
    assert warned[0].startswith("folder: skipped .purple in ")
    assert warned[1] == (
        f"folder: skipped stray.png in {tmp_path / 'train'}: an image outside the class folders has no class; move "
        f"it into {tmp_path / 'train'}/<class name>/ to use it"
    )


def test_a_hub_error_is_quoted_without_a_double_period(monkeypatch):
    from petl.run import default_config
    from petl.train import build
    from petl.utils.errors import RunError

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co'. Check your Internet connection is on.")

    cfg = default_config(["model=vit_tiny_patch16_224.augreg_in21k"])
    monkeypatch.setattr(build.timm, "create_model", offline)
    with pytest.raises(RunError) as error:
        build.create_backbone(cfg)
    assert "connection is on. Give a local file with model.checkpoint=PATH" in str(error.value)
    assert ".." not in str(error.value)


def test_petl_serve_says_a_run_given_twice_is_served_once(tmp_path, capsys):
    """``petl-serve runs/a runs/a`` served one task and said nothing of the second."""
    run = _finished(tmp_path / "a")
    capsys.readouterr()
    assert serve_cli.find_runs([str(run), str(run)]) == {"a": run}
    assert capsys.readouterr().err == f"petl-serve: note: {run} was given more than once: served once\n"


def test_petl_serve_serves_a_run_spelt_twice_once_as_petl_predict_predicts_it(tmp_path, capsys, monkeypatch):
    """``petl-serve runs/a $PWD/runs/a`` was refused as two runs named 'a', where ``runs/a runs/a`` was served once
    and petl-predict predicted either once."""
    run = _finished(tmp_path / "a")
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert serve_cli.find_runs(["a", str(run), "./a/"]) == {"a": Path("a")}
    assert capsys.readouterr().err == (
        f"petl-serve: note: {run} was given more than once: served once\n"
        "petl-serve: note: a was given more than once: served once\n"
    )


@pytest.mark.parametrize(
    ("host", "alone"),
    [("localhost", True), ("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("0.0.0.0", False)]
    + [("192.168.1.20", False), ("::", False), ("myhost", False)],
)
def test_petl_serve_notes_an_open_port_for_every_host_but_loopback(host, alone):
    """The note "anyone who reaches this port can use the tasks" went to 127.0.0.2 too (loopback, 127.0.0.0/8)."""
    assert serve_cli.loopback(host) is alone


def test_an_exported_timm_folder_given_as_a_run_is_named_as_one_by_every_command(tmp_path, capsys, tiny_vit):
    # petl-predict said "exported is not a run folder (no trainable.safetensors)", petl-serve "holds no finished
    # run folder (no model.json)", load_run and petl-export "not a finished petl-run folder": none said it is the
    # plain timm model petl-export wrote, which timm loads, nor that its run folder is what they take.
    exported = tmp_path / "exported"
    exported.mkdir()
    for name in files.TIMM_FOLDER_FILES:
        (exported / name).write_text("{}")
    # petl-export's marker: its config.json's petl section (a hub folder's has none: test_export.py).
    (exported / "config.json").write_text(json.dumps({"petl": {"format": files.EXPORT_FORMAT}}))
    said = f"{exported} is a plain timm model (config.json, model.safetensors, as petl-export writes it), not a "
    for err in _each_command_refuses(exported, tmp_path, capsys):
        assert f"error: {said}" in err and f"timm.create_model('local-dir:{exported}', pretrained=True)" in err, err
    with pytest.raises(RunFolderError, match=re.escape(said)):
        petl.load_run(exported)
    # MultiTask's task -> folder took a folder without model.json for one holding a bare weights file: "no such
    # file: exported/trainable.safetensors".
    with pytest.raises(RunFolderError, match=re.escape(said)):
        petl.MultiTask(tiny_vit(), {"a": exported})
    # A run folder holding such files beside its card is still a run (its own files win).
    run = _finished(tmp_path / "run")
    for name in files.TIMM_FOLDER_FILES:
        (run / name).write_text("{}")
    assert files.exported_not_run(run) is None
