"""Faults and bad input (issue 10): no silent loss, no half-loaded model, one clear line for every fault.

The trainable-weights files are checked in-process; the run folder's lock and the kills use real
``petl-run`` subprocesses and SIGKILL.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from conftest import make_tiny_swin, tiny_run
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file

import petl
from petl import data as petl_data
from petl.cli import run as cli
from petl.model import io
from petl.run import default_config, train
from petl.store import files, lock
from petl.train import build, engine, runner
from petl.train import output_dir as folder
from petl.train.config import ConfigError

TINY = tiny_run(batch_size=32)


def tiny(out: Path, *overrides: str) -> dict:
    # An override choosing another dataset replaces TINY's (Hydra takes one choice per group).
    other_data = any(o.startswith("data=") for o in overrides)
    base = [o for o in TINY if not (other_data and o.startswith("data="))]
    return train(default_config([*base, f"output_dir={out}", *overrides]))


# --- trainable-weights files (items 3, 4, 8) --------------------------------------------------------


def _saved(tiny_vit, tmp_path: Path, method: str = "lora", **options) -> Path:
    path = tmp_path / "w.safetensors"
    # On tiny_vit(), which the tests load it onto: a file is refused on other frozen weights (seed=1's).
    model = petl.apply(tiny_vit(), method, num_classes=4, **options)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(1.0)  # trained values differ from a fresh init
    petl.save_trainable(model, path)
    return path


def _rewrite(path: Path, tensors=None, metadata=None) -> None:
    """Rewrite a safetensors file with other tensors or metadata (what tampering or a bug would do)."""
    with safe_open(str(path), framework="pt") as f:
        old_meta, old = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    save_file(old if tensors is None else tensors, str(path), metadata=old_meta if metadata is None else metadata)


def _signed(meta: dict[str, str], tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """``meta`` with both hashes of ``tensors`` recomputed: a file a bug wrote as save_trainable writes one."""
    meta = {**meta, "sha256": petl.model.params.content_hash(tensors)}
    return {**meta, io.METADATA_HASH: io.metadata_hash(meta)}


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_failed_load_leaves_a_carrying_model_exactly_as_it_was(tiny_vit, tmp_path):
    path = _saved(tiny_vit, tmp_path)
    tensors, meta = _read(path)
    last = sorted(tensors)[-1]
    tensors[last] = torch.zeros(3, 3)  # only the last tensor in copy order is wrong
    _rewrite(path, tensors=tensors, metadata=_signed(meta, tensors))
    model = petl.apply(tiny_vit(), "lora", num_classes=4)
    before = _state(model)
    with pytest.raises(ValueError, match=rf"{last} has shape \(3, 3\)"):
        petl.load_trainable(model, path)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_failed_load_leaves_a_fresh_model_without_the_method(tiny_vit, tmp_path):
    path = _saved(tiny_vit, tmp_path)
    tensors, meta = _read(path)
    tensors.pop(sorted(tensors)[0])
    _rewrite(path, tensors=tensors, metadata=_signed(meta, tensors))
    model = tiny_vit()
    before = _state(model)
    with pytest.raises(ValueError, match="lacks tensors that 'lora' trains on this model"):
        petl.load_trainable(model, path)
    assert getattr(model, "petl_method", None) is None
    assert _state(model).keys() == before.keys() and all(torch.equal(before[k], v) for k, v in _state(model).items())
    assert all(p.requires_grad for p in model.parameters())  # not frozen either


def test_good_file_still_loads_onto_a_fresh_model(tiny_vit, tmp_path):
    path = _saved(tiny_vit, tmp_path, "adapter")
    model = petl.load_trainable(tiny_vit(), path)
    with safe_open(str(path), framework="pt") as f:
        assert all(torch.equal(dict(model.named_parameters())[k], f.get_tensor(k)) for k in f.keys())


def test_a_flipped_byte_is_refused_naming_the_file(tiny_vit, tmp_path):
    path = _saved(tiny_vit, tmp_path)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40  # inside the last tensor's bytes: safetensors itself cannot notice
    path.write_bytes(bytes(data))
    model = petl.apply(tiny_vit(), "lora", num_classes=4)
    before = _state(model)
    with pytest.raises(ValueError, match=rf"{path} is corrupt: its tensors do not match the content hash"):
        petl.load_trainable(model, path)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("method", ["lora", "vpt", "ssf"])
def test_an_edited_option_that_fits_the_tensors_is_refused_naming_the_file(tiny_vit, tmp_path, method):
    # Only the tensors were hashed: LoRA's alpha (VPT's dropout, SSF's init_std) edited in the metadata loaded the
    # file's tensors under another option, silently (LoRA's logits moved by 1.8).
    path = _saved(tiny_vit, tmp_path, method)
    option = {"lora": "alpha", "vpt": "dropout", "ssf": "init_std"}[method]
    tensors, meta = _read(path)
    config = json.loads(meta["config"])
    _rewrite(path, metadata={**meta, "config": json.dumps({**config, option: config[option] + 0.25})})
    refused = rf"^{path} is corrupt: its metadata \(method, options, backbone\) do not match the hash"
    model = tiny_vit()
    with pytest.raises(ValueError, match=refused):
        petl.load_trainable(model, path)
    assert getattr(model, "petl_method", None) is None
    # Onto a model carrying the file's method and its true option, or read alone: the file is named as corrupt, not
    # as saved with the edited option (whose remedy, a fresh backbone, then failed on the hash).
    with pytest.raises(ValueError, match=refused):
        petl.load_trainable(petl.apply(tiny_vit(), method, num_classes=4, **{option: config[option]}), path)
    with pytest.raises(ValueError, match=refused):
        petl.read_trainable_metadata(path)
    # Other tensors under this metadata with their own tensor hash (a tool that re-signs what it rewrites): the
    # metadata's hash covers the tensors' hash.
    tensors = {name: tensor * 2 for name, tensor in tensors.items()}
    _rewrite(path, tensors=tensors, metadata={**meta, "sha256": petl.model.params.content_hash(tensors)})
    with pytest.raises(ValueError, match=refused):
        petl.load_trainable(tiny_vit(), path)


def test_a_file_without_a_hash_loads_with_a_warning(tiny_vit, tmp_path):
    # Files of earlier petl versions hold neither hash: the tensors' or the metadata's (nor the frozen fingerprint).
    path = _saved(tiny_vit, tmp_path)
    with safe_open(str(path), framework="pt") as f:
        meta = {k: v for k, v in f.metadata().items() if k not in ("sha256", io.METADATA_HASH, io.FROZEN)}
    _rewrite(path, metadata=meta)
    with pytest.warns(UserWarning, match="has no content hash"):
        model = petl.load_trainable(tiny_vit(), path)
    assert model.petl_method == "lora"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (tmp_path / "hashed").mkdir()
        petl.load_trainable(tiny_vit(), _saved(tiny_vit, tmp_path / "hashed"))  # hashed files load silently


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("depth", None, r"metadata field 'depth' is missing"),
        ("config", "{not json", r"metadata field 'config' is malformed \(Expecting property name"),
        ("embed_dim", "wide", r"metadata field 'embed_dim' is malformed"),
        ("config", "[1, 2]", r"metadata field 'config' is malformed \(not a JSON object\)"),
    ],
)
def test_tampered_metadata_names_the_file_and_the_field(tiny_vit, tmp_path, field, value, message):
    path = _saved(tiny_vit, tmp_path)
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
    meta.pop(field) if value is None else meta.update({field: value})
    _rewrite(path, metadata=meta)
    for read in (petl.read_trainable_metadata, lambda p: petl.load_trainable(tiny_vit(), p)):
        with pytest.raises(ValueError, match=rf"^{path}: {message}"):
            read(path)


@pytest.mark.parametrize("damage", ["truncate", "zero", "garbage"])
def test_a_corrupt_safetensors_file_is_named(tiny_vit, tmp_path, damage):
    path = _saved(tiny_vit, tmp_path)
    data = path.read_bytes()
    path.write_bytes({"truncate": data[: len(data) - 40], "zero": b"", "garbage": b"\x07" * 64}[damage])
    model = tiny_vit()
    with pytest.raises(ValueError, match=rf"^{path} is not a readable safetensors file"):
        petl.load_trainable(model, path)
    assert getattr(model, "petl_method", None) is None


# --- the run folder (items 1, 2, 4, 9) -------------------------------------------------------------


def _crash_in_epoch(monkeypatch, epoch: int) -> None:
    """Make training die at the start of ``epoch`` (1-based), after the epochs before it are saved."""
    original = engine.train_one_epoch
    calls = {"n": 0}

    def dying(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == epoch:
            raise KeyboardInterrupt("killed")
        return original(*args, **kwargs)

    monkeypatch.setattr(engine, "train_one_epoch", dying)


def _killed_after_one_epoch(out: Path, *overrides: str) -> None:
    with pytest.MonkeyPatch.context() as patch:
        _crash_in_epoch(patch, 2)
        with pytest.raises(KeyboardInterrupt):
            tiny(out, *overrides)
    assert torch.load(out / "checkpoint.pt", weights_only=True)["epoch"] == 1


@pytest.mark.parametrize("epoch", [1, 2], ids=["before-the-first-epoch", "after-one-epoch"])
def test_ctrl_c_says_whether_an_epoch_is_kept_and_the_same_command_does_what_it_says(tmp_path, capsys, epoch):
    # Interrupted before its first epoch ended, petl-run said "the same command resumes from the last finished epoch":
    # there was none, and the same command trained the run from its first epoch.
    args = [*TINY, "method=linear", "train.cache_features=false", f"output_dir={tmp_path}"]
    with pytest.MonkeyPatch.context() as patch:
        _crash_in_epoch(patch, epoch)
        capsys.readouterr()
        with pytest.raises(SystemExit) as stop:
            cli.main(args)
    line = capsys.readouterr().err.splitlines()[-1]
    assert stop.value.code == 130
    if epoch == 1:
        assert line == (
            "petl-run: error: interrupted before the run's first epoch finished, so no epoch is kept: the same command "
            "trains it from the start"
        )
        assert not (tmp_path / files.CHECKPOINT_FILE).exists()
    else:
        assert line == "petl-run: error: interrupted; the same command resumes from the last finished epoch"
    cli.main(args)
    said = capsys.readouterr()
    assert ("resuming" in said.err + said.out) == (epoch == 2)  # the runner's "resuming ... from epoch 1/2"
    assert len((tmp_path / files.METRICS_FILE).read_text().splitlines()) == 2


@pytest.mark.parametrize("keep", ["false", "true"])
def test_ctrl_c_while_a_finished_run_is_checked_says_the_same_command_returns_it(tmp_path, capsys, keep):
    # Interrupted while petl-run checked a finished run's data (a folder of photos is decoded there), it said "before
    # the run's first epoch finished ... trains it from the start" (no checkpoint.pt: a finished run removes it), or,
    # where train.keep_checkpoint kept one, "resumes from the last finished epoch": the same command returns the run.
    args = [*TINY, "method=linear", "train.cache_features=false", f"output_dir={tmp_path}"]
    args.append(f"train.keep_checkpoint={keep}")
    cli.main(args)
    finished = (tmp_path / files.RESULT_FILE).read_bytes()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(folder, "check_inputs", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
        capsys.readouterr()
        with pytest.raises(SystemExit) as stop:
            cli.main(args)
    assert stop.value.code == 130
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"petl-run: error: interrupted; output_dir {tmp_path} holds a finished run: the same command returns its result"
    )
    cli.main(args)
    assert "already finished" in capsys.readouterr().err
    assert (tmp_path / files.RESULT_FILE).read_bytes() == finished


@pytest.mark.parametrize("other", [[], ["train.lr=0.01"]], ids=["same-config", "another-config"])
def test_ctrl_c_before_resume_false_set_the_earlier_run_aside_says_what_resume_true_would_do(tmp_path, capsys, other):
    # Interrupted while a resume=false run built its data (before it set the earlier run aside), it said "run it
    # again with resume=true to resume from the last finished epoch" also of a checkpoint of another config, which
    # resume=true refuses ('holds a run with another config'): none of this run's epochs was kept.
    args = [*TINY, "method=linear", "train.cache_features=false", f"output_dir={tmp_path}"]
    with pytest.MonkeyPatch.context() as patch:
        _crash_in_epoch(patch, 2)
        with pytest.raises(SystemExit):
            cli.main(args)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(build, "datasets", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
        capsys.readouterr()
        with pytest.raises(SystemExit) as stop:
            cli.main([*args, *other, "resume=false"])
    line = capsys.readouterr().err.splitlines()[-1]
    assert stop.value.code == 130 and (tmp_path / files.CHECKPOINT_FILE).is_file()
    if other:
        assert line == (
            "petl-run: error: interrupted before the run's first epoch finished, so no epoch is kept: the same command "
            "trains it from the start"
        )
    else:
        assert (
            line == "petl-run: error: interrupted; run it again with resume=true to resume from the last finished epoch"
        )
        cli.main([*args, "resume=true"])
        assert "resuming" in "".join(capsys.readouterr())


def test_the_same_command_again_keeps_the_checkpoint_a_finished_run_was_told_to_keep(tmp_path):
    # Run again without train.keep_checkpoint (neutral: the finished result is returned), it deleted the checkpoint
    # the first run had kept, taking it for one a kill had left between result.json and its removal.
    first = tiny(tmp_path, "train.keep_checkpoint=true", "train.epochs=1")
    assert (tmp_path / files.CHECKPOINT_FILE).is_file()
    assert tiny(tmp_path, "train.epochs=1")["finished_at"] == first["finished_at"]  # returned, not trained again
    assert (tmp_path / files.CHECKPOINT_FILE).is_file()


def _image_folder(root: Path, seed: int) -> Path:
    """A two-class ``data=folder`` tree (train/ and test/) of random PNGs; another seed, other images."""
    rng = np.random.default_rng(seed)
    for split in ("train", "test"):
        for name in ("a", "b"):
            (root / split / name).mkdir(parents=True)
            for index in range(4):
                pixels = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / name / f"{index}.png")
    return root


@pytest.mark.slow
def test_resume_with_another_data_root_is_refused(tmp_path):
    # mini tasks read no folder (a root is refused there): the run reads a folder of its own.
    def on(folder: str) -> list[str]:
        return ["data=folder", f"data.root={tmp_path}/{folder}"]

    _image_folder(tmp_path / "a", seed=0), _image_folder(tmp_path / "b", seed=1)
    _killed_after_one_epoch(tmp_path / "run", *on("a"))
    # Resuming compares the images themselves (a moved folder with the same images would resume).
    said = r"holds epochs trained on other inputs \(data.fingerprint: [0-9a-f]{12}\.\.\. -> "  # digests cut short
    with pytest.raises(ConfigError, match=said):
        tiny(tmp_path / "run", *on("b"))
    assert torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["epoch"] == 1  # kept
    result = tiny(tmp_path / "run", *on("a"))  # the same inputs resume
    assert result["inputs"]["data.root"] == str(tmp_path / "a")
    with pytest.raises(ConfigError, match=r"holds a finished run on other inputs \(data.root"):
        tiny(tmp_path / "run", *on("b"))


@pytest.mark.slow
def test_resume_with_another_model_file_is_refused(tmp_path):
    def weights(seed: int) -> Path:
        torch.manual_seed(seed)
        source = timm.create_model("vit_fractal_tiny_patch4_32", depth=1, embed_dim=48, num_classes=0)
        path = tmp_path / "w.safetensors"
        save_file({k: v.contiguous() for k, v in source.state_dict().items()}, path)
        return path

    pretrained = ("model.pretrained=true", f"model.checkpoint={weights(0)}")
    _killed_after_one_epoch(tmp_path / "run", *pretrained)
    weights(1)  # the same path, other weights
    digest = r"[0-9a-f]{12}\.\.\."  # a SHA-256 said by its first 12 hex digits
    with pytest.raises(ConfigError, match=rf"other inputs \(model.checkpoint_sha256: {digest} -> {digest}\)"):
        tiny(tmp_path / "run", *pretrained)


def test_a_resume_under_another_process_count_is_refused(tmp_path):
    # A job requeued on another allocation (1 GPU, then 2) would train its last epochs on twice the effective batch.
    out = tmp_path / "run"
    _killed_after_one_epoch(out)
    checkpoint = files.load_checkpoint(out / "checkpoint.pt")
    assert checkpoint["num_processes"] == 1
    cfg = default_config([*TINY, f"output_dir={out}"])
    with pytest.raises(ConfigError, match=r"holds epochs trained on 1 process, this launch has 2: the effective batch"):
        folder.resume_checkpoint(out, cfg, checkpoint["inputs"], num_processes=2)
    assert folder.resume_checkpoint(out, cfg, checkpoint["inputs"], num_processes=1)["epoch"] == 1
    del checkpoint["num_processes"]  # a checkpoint from before the count was recorded is not compared
    files.save_checkpoint(out / "checkpoint.pt", checkpoint)
    assert folder.resume_checkpoint(out, cfg, checkpoint["inputs"], num_processes=2)["epoch"] == 1
    files.save_checkpoint(out / "checkpoint.pt", {**checkpoint, "num_processes": "2"})
    with pytest.raises(ConfigError, match=r"num_processes '2' is not a positive integer"):
        folder.resume_checkpoint(out, cfg, checkpoint["inputs"], num_processes=2)


def test_files_no_unfinished_run_left_are_not_overwritten(tmp_path):
    # Without result.json or checkpoint.pt "whatever is there" was overwritten: output_dir=. in a project holding a
    # config.yaml of its own, or a finished run whose result.json was deleted (its weights and card).
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("my: precious\n")
    with pytest.raises(ConfigError, match=r"config.yaml is damaged \(not a run's config.*this run would overwrite it"):
        tiny(out)
    assert (out / "config.yaml").read_text() == "my: precious\n" and sorted(os.listdir(out)) == ["config.yaml"]
    (out / "config.yaml").unlink()
    (out / "model.json").write_text("mine")
    with pytest.raises(ConfigError, match=r"holds model.json without result.json or checkpoint.pt: no run to resume"):
        tiny(out)
    tiny(out, "resume=false")  # moves it aside, as the line says
    (aside,) = tmp_path.glob("run.replaced-*")
    assert (aside / "model.json").read_text() == "mine" and (out / "result.json").is_file()
    # What a run killed before its first checkpoint leaves (its config.yaml, metrics.jsonl) is rewritten.
    again = tmp_path / "again"
    again.mkdir()
    (again / "config.yaml").write_bytes((out / "config.yaml").read_bytes())
    (again / "metrics.jsonl").write_text("")
    assert tiny(again)["output_dir"] == str(again)


def test_resume_false_sets_aside_a_run_in_output_dir_dot(tmp_path, monkeypatch):
    # output_dir=. in a project: resume=false, as the refusal above says, stopped in "ValueError: PosixPath('.') has
    # an empty name" (exit 1), the aside folder's name made from the folder's own.
    project = tmp_path / "project"
    project.mkdir()
    (project / "model.json").write_text("mine")
    monkeypatch.chdir(project)
    folder.set_aside(Path("."))
    (aside,) = tmp_path.glob("project.replaced-*")
    assert (aside / "model.json").read_text() == "mine" and not (project / "model.json").exists()


def test_a_moved_dataset_with_the_same_content_still_resumes():
    old = {"data.root": "/a", "data.fingerprint": "f1", "model.checkpoint_sha256": None}
    folder.check_inputs(Path("x"), old, {**old, "data.root": "/b"})  # content decides, not the path
    with pytest.raises(ConfigError, match=r"data.fingerprint: 'f1' -> 'f2'"):
        folder.check_inputs(Path("x"), old, {**old, "data.root": "/b", "data.fingerprint": "f2"})
    folder.check_inputs(Path("x"), None, old)  # checkpoints of older versions carry no inputs


@pytest.mark.slow
def test_output_dir_that_is_a_file_fails_before_building_anything(tmp_path, monkeypatch, capsys):
    (tmp_path / "out").write_text("not a folder")
    monkeypatch.setattr(build, "create_backbone", lambda *a: pytest.fail("must fail before building the model"))
    with pytest.raises(ConfigError, match=r"^output_dir .*/out is a file, not a folder: choose another output_dir$"):
        tiny(tmp_path / "out")
    with pytest.raises(ConfigError, match=r"output_dir .*/out/run cannot be written \(Not a directory\)"):
        tiny(tmp_path / "out" / "run")
    with pytest.raises(SystemExit) as caught:
        cli.main([*TINY, f"output_dir={tmp_path}/out"])
    err = capsys.readouterr().err
    assert caught.value.code == cli.USAGE_ERROR and err.count("\n") == 1 and "Traceback" not in err


def _read_only_dir(tmp_path: Path) -> Path:
    if os.geteuid() != 0:
        folder = tmp_path / "ro"
        folder.mkdir()
        folder.chmod(0o555)
        return folder
    # root ignores permission bits; sysfs refuses new files even to root.
    if not Path("/sys/kernel").is_dir():
        pytest.skip("needs a folder root cannot write")
    return Path("/sys/kernel")


@pytest.mark.slow
def test_read_only_output_dir_fails_before_building_anything(tmp_path, monkeypatch, capsys):
    folder = _read_only_dir(tmp_path)
    monkeypatch.setattr(build, "create_backbone", lambda *a: pytest.fail("must fail before building the model"))
    with pytest.raises(ConfigError, match=rf"^output_dir {folder} cannot be written \((Permission denied|.*)\)"):
        tiny(folder)
    with pytest.raises(SystemExit) as caught:
        cli.main([*TINY, f"output_dir={folder}"])
    err = capsys.readouterr().err
    assert caught.value.code == cli.USAGE_ERROR and err.count("\n") == 1 and "cannot be written" in err


@pytest.mark.slow
def test_disk_full_stops_with_one_line_and_keeps_the_checkpoint(tmp_path, monkeypatch):
    real = files.save_checkpoint

    def full_after_one(path, state):
        if state["epoch"] > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(path, state)

    monkeypatch.setattr(files, "save_checkpoint", full_after_one)
    message = (
        r"^cannot write to output_dir .* \(No space left on device\): the checkpoint of epoch 1 is kept; "
        r"free the space and run the same command again to resume$"
    )
    with pytest.raises(runner.RunError, match=message):
        tiny(tmp_path / "run", "train.epochs=3")
    assert torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["epoch"] == 1
    monkeypatch.undo()
    assert tiny(tmp_path / "run", "train.epochs=3")["epochs"] == 3  # space freed: resumes


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs: a real file system that can be filled (needs the right to mount)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.slow
def test_a_really_full_disk_keeps_the_checkpoint(small_disk, monkeypatch):
    real = files.append_metrics

    def fill_after_first_epoch(path, row):
        real(path, row)
        with open(small_disk / "filler", "wb") as f:  # take every byte that is left
            try:
                while True:
                    f.write(b"\0" * 65536)
            except OSError:
                pass

    monkeypatch.setattr(files, "append_metrics", fill_after_first_epoch)
    with pytest.raises(runner.RunError, match=r"\(No space left on device\): the checkpoint of epoch 1 is kept"):
        tiny(small_disk / "run", "train.epochs=3")
    assert torch.load(small_disk / "run" / "checkpoint.pt", weights_only=True)["epoch"] == 1
    assert not files.temporary_files(small_disk / "run")


@pytest.mark.slow
def test_unforeseen_faults_are_one_line_and_debug_shows_the_traceback(tmp_path, monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise OSError("image file is truncated (/data/x.jpg)")

    monkeypatch.setattr(engine, "train_one_epoch", broken)
    with pytest.raises(SystemExit) as caught:
        cli.main([*TINY, f"output_dir={tmp_path}"])
    # The run's own warnings may come first (whether its log lines reach this test's stderr depends on which test set
    # up logging before it); the fault itself is one line, the last, and no traceback.
    err = capsys.readouterr().err
    assert caught.value.code == cli.RUN_ERROR and "Traceback" not in err and err.count("error:") == 1
    last = err.splitlines()[-1]
    assert last.startswith("petl-run: error: OSError: image file is truncated (/data/x.jpg) (--debug shows")
    with pytest.raises(OSError, match="truncated"):
        cli.main([*TINY, f"output_dir={tmp_path}", "--debug"])


@pytest.mark.slow
def test_an_offline_error_leaves_no_empty_output_dir(tmp_path, monkeypatch, capsys):
    def unreachable(*args, **kwargs):
        raise petl_data.DatasetUnavailableError("mini/digits is not cached here; set data.root")

    monkeypatch.setattr(petl_data, "build_dataset", unreachable)
    with pytest.raises(SystemExit):
        cli.main([*TINY, f"output_dir={tmp_path}/new/run"])
    with pytest.raises(runner.RunError):
        tiny(tmp_path / "new" / "run")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "old").mkdir()
    with pytest.raises(runner.RunError):
        tiny(tmp_path / "old")
    assert (tmp_path / "old").is_dir()  # a folder that was there stays


# --- real processes, killed (items 1, 9) -------------------------------------------------------------

_DIE_WHILE_WRITING = """
import os, signal, sys
from petl.cli import run as cli
from petl.store import files

when = sys.argv.pop(1)
real = files.write_text

def write_text(path, text):
    if path.name == "result.json" and when == "during":
        def torn(tmp):
            tmp.write_text(text[:20])
            os.kill(os.getpid(), signal.SIGKILL)
        files.write_atomic(path, torn)
    real(path, text)
    if path.name == "result.json" and when == "after":
        os.kill(os.getpid(), signal.SIGKILL)

files.write_text = write_text
cli.main(sys.argv[1:])
"""


# A command (petl.cli.{module}) whose epochs take half a second more than they need: long enough to be caught running.
_SLOW_EPOCHS = """
import sys, time
from petl.cli import {module} as cli
from petl.train import engine

real = engine.train_one_epoch

def slow(*args, **kwargs):
    time.sleep(0.5)
    return real(*args, **kwargs)

engine.train_one_epoch = slow
cli.main(sys.argv[1:])
"""


def _petl_run(*args: str, cwd: Path, script: str | None = None, wait: bool = True):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", script, *args] if script else [sys.executable, "-m", "petl.run", *args]
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if wait:
        proc.communicate(timeout=300)
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("when", ["during", "after"])
def test_a_kill_around_the_result_write_leaves_nothing_behind(tmp_path, when):
    proc = _petl_run(when, *TINY, "method=linear", "output_dir=run", cwd=tmp_path, script=_DIE_WHILE_WRITING)
    assert proc.returncode == -signal.SIGKILL
    run = tmp_path / "run"
    assert (run / "checkpoint.pt").exists() and (run / lock.LOCK_FILE).exists()  # litter of the kill
    assert bool(files.temporary_files(run)) == (when == "during")
    result = tiny(run, "method=linear")
    assert result["epochs"] == 2
    assert sorted(p.name for p in run.iterdir()) == [
        "config.yaml",
        "metrics.jsonl",
        "model.json",
        "result.json",
        "trainable.safetensors",
    ]


@pytest.mark.slow
def test_two_runs_into_one_output_dir_and_a_stale_lock(tmp_path, capsys):
    args = (*TINY, "method=linear", "train.epochs=30", "train.cache_features=false", "output_dir=run")
    first = _petl_run(*args, cwd=tmp_path, script=_SLOW_EPOCHS.format(module="run"), wait=False)
    run = tmp_path / "run"
    try:
        deadline = time.monotonic() + 240
        while not (run / "checkpoint.pt").exists():
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline, "the first run did not start"
            time.sleep(0.2)
        # A second run into the same folder: refused, naming the holder, while the first goes on.
        with pytest.raises(SystemExit) as caught:
            cli.main([*args[:-1], f"output_dir={run}"])
        err = capsys.readouterr().err
        assert caught.value.code == cli.RUN_ERROR and err.count("\n") == 1
        assert f"is in use by another run (pid {first.pid} on host" in err
        assert first.poll() is None
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=60)
    assert first.returncode == -signal.SIGKILL
    epoch = torch.load(run / "checkpoint.pt", weights_only=True)["epoch"]
    holder = json.loads((run / lock.LOCK_FILE).read_text())
    assert holder["pid"] == first.pid  # stale: its owner is dead
    # The lock of a dead process does not stand in the way of the resume.
    resumed = train(default_config([*args[:-1], f"output_dir={run}"]))
    assert resumed["epochs"] == 30 and not (run / lock.LOCK_FILE).exists()
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 30 and epoch >= 1


def test_a_slower_claimant_of_a_stale_lock_leaves_the_winners_lock_alone(tmp_path, monkeypatch):
    # Two claimants judged the same dead holder stale; the first has already replaced the lock with its own
    # live one when the second takes over.  The second must fail and leave the live lock in place.
    dead = {"host": lock.socket.gethostname(), "pid": 2**22 + 12345, "since": 0.0}
    live = {"host": lock.socket.gethostname(), "pid": os.getppid(), "since": 1.0}
    (tmp_path / lock.LOCK_FILE).write_text(json.dumps(live))
    # The second claimant's (old) look.
    monkeypatch.setattr(lock, "read_holder", lambda folder, name=lock.LOCK_FILE: dead)
    assert not lock.acquire_lock(tmp_path)
    assert json.loads((tmp_path / lock.LOCK_FILE).read_text()) == live
    assert sorted(p.name for p in tmp_path.iterdir()) == [lock.LOCK_FILE]
    # A lock that really is the dead holder's is taken over.
    (tmp_path / lock.LOCK_FILE).write_text(json.dumps(dead))
    assert lock.acquire_lock(tmp_path)
    assert json.loads((tmp_path / lock.LOCK_FILE).read_text())["pid"] == os.getpid()


def test_a_version_1_file_still_loads(tiny_vit, tmp_path, images):
    # Version 1 recorded one embed_dim for every block and no widths; version 2 adds the per-block widths.
    path = _saved(tiny_vit, tmp_path)
    _, meta = _read(path)
    assert json.loads(meta.pop("widths")) == [48, 48, 48] and meta["format"] == "petl-trainable-2"
    del meta[io.METADATA_HASH], meta[io.FROZEN]  # added later, within version 2
    _rewrite(path, metadata={**meta, "format": "petl-trainable-1"})
    assert petl.read_trainable_metadata(path)["widths"] == [48, 48, 48]
    assert petl.load_trainable(tiny_vit(), path).petl_method == "lora"


def test_a_swin_file_names_the_widths_it_was_saved_for(tmp_path):
    path = tmp_path / "swin.safetensors"
    petl.save_trainable(petl.apply(make_tiny_swin(), "lora", num_classes=4), path)
    # The same embed_dim and depth, stages of other depths: the per-block widths differ.
    with pytest.raises(ValueError, match=r"widths=\[16, 16, 32, 32\], this one has widths=\[16, 32, 32, 32\]"):
        petl.load_trainable(make_tiny_swin(depths=(1, 3)), path)
