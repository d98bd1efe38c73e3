"""petl-export writes a model that plain timm loads, in a Python where petl cannot be imported.

The exported folder is timm's own ``local-dir:`` format (config.json + model.safetensors); petl's own
backbones are written under their timm-native names (petl.backbones.models.TIMM_NATIVE), which must build the
same tensors and give the same logits as petl's registrations.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import timm
import torch
from conftest import TINY_FAMILIES, TINY_MODELS, TINY_VIT, command_status
from safetensors import safe_open
from test_multitask import _run_folder as multitask_run_folder
from test_run_card import TINY, _image, _run_folder

import petl
from petl.backbones import models
from petl.cli import export as export_cli
from petl.cli import predict as predict_cli
from petl.deploy import export as export_api
from petl.model import timm_api
from petl.store import run_card


@pytest.mark.parametrize("name", sorted(models.TIMM_NATIVE))
def test_each_petl_backbone_has_a_timm_native_twin(name):
    # Smaller than shipped, to be quick: each family's own size arguments.
    if "dinov2" in name:
        kwargs = {"img_size": 56, "depth": 2}
    elif name.startswith("swin"):
        kwargs = {"depths": (1, 2, 1), "embed_dim": 32}
    else:
        kwargs = {"depth": 2, "embed_dim": 48}
    torch.manual_seed(0)
    ours = timm.create_model(name, pretrained=False, num_classes=3, **kwargs).eval()
    native, args = models.timm_native(name, kwargs)
    assert native.split(".")[0] not in models.TIMM_NATIVE and native in timm.list_models(pretrained=False)
    theirs = timm.create_model(native, pretrained=False, num_classes=3, **args).eval()
    theirs.load_state_dict(ours.state_dict(), strict=True)
    size = ours.patch_embed.img_size[0]
    images = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(images), ours(images))


def run_without_petl(script: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh interpreter where ``import petl`` fails (a stub shadows the installed package)."""
    stub = cwd / "no_petl"
    (stub / "petl").mkdir(parents=True, exist_ok=True)
    (stub / "petl" / "__init__.py").write_text("raise ImportError('petl is not installed here')\n")
    check = "\nimport sys\nassert 'petl' not in sys.modules and not timm.is_model('vit_fractal_tiny_patch4_32')\n"
    env = {**os.environ, "PYTHONPATH": str(stub)}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script) + check], cwd=cwd, env=env, capture_output=True, text=True
    )


@pytest.mark.slow
def test_an_exported_folder_loads_in_timm_without_petl(tmp_path):
    model_cfg = {**TINY, "kwargs": {**TINY["kwargs"], "img_size": 48}}
    run_dir = _run_folder(tmp_path / "run", model_cfg=model_cfg)
    export_cli.main([str(run_dir), f"out={tmp_path / 'exported'}"])
    config = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert config["architecture"] == "vit_tiny_patch16_224" and config["num_classes"] == 3
    assert config["model_args"]["img_size"] == 48 and config["pretrained_cfg"]["label_names"] == ["c0", "c1", "c2"]
    images = torch.randn(3, 3, 48, 48, generator=torch.Generator().manual_seed(0))
    torch.save(images, tmp_path / "images.pt")
    script = """
        import timm, torch
        model = timm.create_model("local-dir:exported", pretrained=True).eval()
        with torch.no_grad():
            torch.save(model(torch.load("images.pt")), "logits.pt")
        data = timm.data.resolve_data_config(model=model)
        # A tuple: timm 1.0.29 gives the list config.json holds, later versions a tuple.
        print(tuple(data["input_size"]), data["crop_mode"], model.pretrained_cfg["label_names"])
    """
    done = run_without_petl(script, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "(3, 48, 48) squash ['c0', 'c1', 'c2']"
    with torch.no_grad():
        expected = petl.load_run(run_dir).model(images)
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_a_safetensors_export_loads_in_timm_as_docs_own_data_says_with_its_preprocessing_in_the_metadata(tmp_path):
    # docs/own-data.md: the file's metadata, read with safe_open, builds the model; timm does not read it, so
    # resolve_data_config gives the architecture's defaults and the run's preprocessing is in the metadata alone.
    model_cfg = {**TINY, "kwargs": {**TINY["kwargs"], "img_size": 48}}
    run_dir = _run_folder(tmp_path / "run", model_cfg=model_cfg)
    export_cli.main([str(run_dir), f"out={tmp_path / 'model.safetensors'}"])
    images = torch.randn(2, 3, 48, 48, generator=torch.Generator().manual_seed(0))
    torch.save(images, tmp_path / "images.pt")
    script = """
        import json, timm, torch
        from safetensors import safe_open
        with safe_open("model.safetensors", "pt") as weights:
            meta = weights.metadata()
        model = timm.create_model(
            meta["timm_model"], num_classes=int(meta["num_classes"]), checkpoint_path="model.safetensors",
            **json.loads(meta["timm_kwargs"]),
        ).eval()
        with torch.no_grad():
            torch.save(model(torch.load("images.pt")), "logits.pt")
        data = timm.data.resolve_data_config(model=model)
        print(json.loads(meta["preprocess"])["input_size"], tuple(data["input_size"]), data["crop_pct"])
    """
    done = run_without_petl(script, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "48 (3, 224, 224) 0.9"
    with torch.no_grad():
        expected = petl.load_run(run_dir).model(images)
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, atol=1e-5, rtol=1e-5)


def test_a_single_file_export_says_what_it_was_trained_on_as_a_folders_config_does(tmp_path):
    # config.json's petl section held the card's dataset; the .safetensors and .onnx metadata, "the same", did not.
    run_dir = _run_folder(tmp_path / "run")
    export_cli.main([str(run_dir), f"out={tmp_path / 'model.safetensors'}"])
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as weights:
        assert weights.metadata()["dataset"] == "folder" == petl.load_run(run_dir).card["dataset"]


def test_an_exported_file_given_as_a_run_says_what_it_is_and_how_timm_loads_it(tmp_path, capsys):
    # petl.load_run("exported/model.safetensors") said "a file, not a run folder: give a petl-run output folder
    # (model.json beside trainable.safetensors)": not that it is the plain timm model petl-export wrote, nor how to
    # load it.
    run_dir = _run_folder(tmp_path / "run")
    for out in ("exported", "model.safetensors"):
        export_cli.main([str(run_dir), f"out={tmp_path / out}"])
    for in_folder in (tmp_path / "exported" / name for name in ("model.safetensors", "config.json")):
        with pytest.raises(run_card.RunFolderError) as refused:
            petl.load_run(in_folder)
        assert str(refused.value) == (
            f"{in_folder}: a file, not a run folder; {tmp_path / 'exported'} is a plain timm model (config.json, "
            "model.safetensors, as petl-export writes it), not a petl-run folder: give the run folder it was exported "
            f"from, or load it with timm (timm.create_model('local-dir:{tmp_path / 'exported'}', pretrained=True))"
        )
    alone = tmp_path / "model.safetensors"
    with pytest.raises(run_card.RunFolderError) as refused:
        petl.load_run(alone)
    said = str(refused.value)
    assert "\n" not in said and said.startswith(
        f"{alone} is a plain timm model's weights (vit_tiny_patch16_224, as petl-export writes it), not a petl-run "
        "folder: give the run folder it was exported from, or load it with timm (timm.create_model("
    )
    # The call it names builds the run's model in timm.
    call = said.split("load it with timm (", 1)[1].removesuffix(")")
    model = eval(call, {"timm": timm}).eval()  # noqa: S307  (the line petl wrote, in a test)
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(images), petl.load_run(run_dir).model(images), atol=1e-5, rtol=1e-5)
    # Any other file is named as a file, as before.
    (tmp_path / "notes.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(run_card.RunFolderError, match="a file, not a run folder: give a petl-run output folder"):
        petl.load_run(tmp_path / "notes.safetensors")


def test_a_timm_folder_petl_export_did_not_write_is_not_called_an_export(tmp_path):
    # Was: any folder of config.json + model.safetensors was "a plain timm model (..., as petl-export writes it)" and
    # the advice was "give the run folder it was exported from", of a timm hub folder no petl run exported.
    import json

    from petl.store.files import exported_not_run

    run_dir = _run_folder(tmp_path / "run")
    export_cli.main([str(run_dir), f"out={tmp_path / 'exported'}"])
    hub = tmp_path / "hub"
    hub.mkdir()
    (hub / "model.safetensors").write_bytes((tmp_path / "exported" / "model.safetensors").read_bytes())
    config = json.loads((tmp_path / "exported" / "config.json").read_text())
    del config["petl"]  # a hub folder's config.json: timm's fields, no petl section
    (hub / "config.json").write_text(json.dumps(config))
    with pytest.raises(run_card.RunFolderError) as refused:
        petl.load_run(hub)
    assert str(refused.value) == (
        f"{hub} is a timm model folder (config.json, model.safetensors) that petl-export did not write (its "
        "config.json has no petl section: a model downloaded from the hub, say), not a petl-run folder: give a "
        "petl-run output folder (model.json beside trainable.safetensors), or load it with timm "
        f"(timm.create_model('local-dir:{hub}', pretrained=True))"
    )
    (hub / "config.json").write_text("{not json")  # unreadable: not called petl's either
    assert "that petl-export did not write" in exported_not_run(hub)
    assert "as petl-export writes it" in exported_not_run(tmp_path / "exported")


def test_petl_predict_and_petl_serve_say_what_an_exported_file_is_and_load_the_file_not_the_argument(
    tmp_path, capsys, monkeypatch
):
    # petl-predict said "model.safetensors is not a run folder (no trainable.safetensors)" of either export, and
    # petl-serve's timm call for task.x=FILE read checkpoint_path='task.x=FILE', a file that is not there.
    from petl.cli import serve as serve_cli

    run_dir = _run_folder(tmp_path / "run")
    for out in ("exported", "model.safetensors"):
        export_cli.main([str(run_dir), f"out={tmp_path / out}"])
    image = _image(tmp_path / "img.png")
    monkeypatch.chdir(tmp_path)
    for given in ("model.safetensors", "exported/model.safetensors"):
        code, _, err = command_status(capsys, predict_cli.main, given, str(image))
        assert code == 2 and err.startswith(f"petl-predict: error: {given}") and "plain timm model" in err, err
    code, _, err = command_status(capsys, predict_cli.main, str(image), str(run_dir))  # an image first: as before
    assert code == 2 and f"{image} is not a run folder, {run_dir} is" in err, err
    code, _, err = command_status(capsys, serve_cli.main, "task.x=model.safetensors", "--quiet")
    assert code == 2 and err.startswith("petl-serve: error: task.x=model.safetensors is a plain timm model's"), err
    call = err.split("load it with timm (", 1)[1].rstrip().removesuffix(")")
    assert call.endswith("checkpoint_path='model.safetensors')"), call
    eval(call, {"timm": timm})  # noqa: S307  (the line petl wrote, in a test)


@pytest.mark.slow
def test_the_stub_really_keeps_petl_out(tmp_path):
    done = run_without_petl("import timm\nimport petl\n", tmp_path)
    assert done.returncode != 0 and "petl is not installed here" in done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("target", ["trainable.safetensors", "model.onnx", "sub/model.safetensors", "."])
def test_out_inside_the_run_folder_is_refused(tmp_path, capsys, target):
    run_dir = _run_folder(tmp_path / "run")
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    with pytest.raises(SystemExit) as stop:
        export_cli.main([str(run_dir), f"out={run_dir / target}"])
    assert stop.value.code == 2
    assert "is inside the run folder" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before
    petl.load_run(run_dir)
    assert run_card.WEIGHTS_FILE in before


@pytest.mark.slow
def test_out_replaces_nothing_it_did_not_write_without_overwrite(tmp_path, capsys):
    """Issue 52: out= an existing folder replaced the user's config.json and model.safetensors; out= another run's
    trainable.safetensors replaced that run's weights (then refused as tampered)."""
    run_dir, other = _run_folder(tmp_path / "run"), _run_folder(tmp_path / "other", seed=1)
    mine = tmp_path / "mine"
    mine.mkdir()
    for name in ("config.json", "model.safetensors"):
        (mine / name).write_text(f"the user's own {name}")
    (tmp_path / "model.onnx").write_text("the user's own onnx")

    def refused(argv: list[str], message: str) -> None:
        with pytest.raises(SystemExit) as stop:
            export_cli.main([str(run_dir), *argv])
        error = capsys.readouterr().err
        assert stop.value.code == 2 and message in error and error.count("\n") == 1, error

    others = {p.name: p.read_bytes() for p in other.iterdir()}
    both = f"{mine / 'config.json'}, {mine / 'model.safetensors'}"
    refused([f"out={mine}"], f"{both} already exist: export elsewhere, or add overwrite=true to replace them")
    refused([f"out={tmp_path / 'model.onnx'}"], "add overwrite=true to replace it")
    for target in (other / "trainable.safetensors", other, other / "sub" / "x.onnx"):
        refused([f"out={target}", "overwrite=true"], f"is inside the run folder {other}")
    refused([f"out={mine}", "overwrite=yes"], "overwrite='yes': expected boolean")
    # A suffix alone is no file name: it was a hidden folder named .onnx, holding config.json and model.safetensors.
    for name in (".onnx", ".safetensors"):
        refused([f"out={tmp_path / name}"], f"out={tmp_path / name} names no file: give it a name ({tmp_path}/model")
    assert {p.name: p.read_text() for p in mine.iterdir()} == {
        "config.json": "the user's own config.json",
        "model.safetensors": "the user's own model.safetensors",
    }
    assert (tmp_path / "model.onnx").read_text() == "the user's own onnx"
    assert {p.name: p.read_bytes() for p in other.iterdir()} == others
    petl.load_run(other)
    # Asked for, the folder's two files are replaced; a new folder or file needs no overwrite=.
    export_cli.main([str(run_dir), f"out={mine}", "overwrite=true"])
    assert json.loads((mine / "config.json").read_text())["petl"]["format"] == "petl-export-1"
    export_cli.main([str(run_dir), f"out={tmp_path / 'new.safetensors'}"])
    assert (tmp_path / "new.safetensors").is_file()


# Every timm family petl takes beside the default ViT (conftest's tiny models, one block), as a run's backbone record.
FAMILY_BACKBONES = {
    family: {
        "name": name,
        "pretrained": False,
        "kwargs": {**{k: v for k, v in TINY_VIT.items() if k != "num_classes"}, "depth": 1, **options},
    }
    for family, (name, options) in TINY_FAMILIES.items()
}
# timm's SwinTransformerV2Cr (kind swinv2_cr), at the tiny Swin's sizes with one block a stage (norm3 ends each).
FAMILY_BACKBONES["swinv2_cr"] = {
    "name": "swinv2_cr_tiny_ns_224",
    "pretrained": False,
    "kwargs": {
        "img_size": 32,
        "patch_size": 4,
        "window_size": 4,
        "embed_dim": 16,
        "depths": [1, 1],
        "num_heads": [2, 4],
    },
}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILY_BACKBONES))
def test_each_family_exports_the_runs_logits_or_says_in_one_line_why_not(tmp_path, capsys, family):
    run_dir = tmp_path / "run"
    multitask_run_folder(run_dir, "lora", {}, seed=0, model_cfg=FAMILY_BACKBONES[family])
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = petl.load_run(run_dir).model(images)
    export_cli.main([str(run_dir), f"out={tmp_path / 'exported'}"])
    model = timm.create_model(f"local-dir:{tmp_path / 'exported'}", pretrained=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(images), want, rtol=1e-4, atol=1e-5)
    capsys.readouterr()
    try:
        export_cli.main([str(run_dir), f"out={tmp_path / 'model.onnx'}"])
    except SystemExit as stop:
        # A model torch's ONNX exporter cannot trace (timm's EVA): one line, exit 1, nothing written.
        error = capsys.readouterr().err
        assert stop.code == 1 and error.startswith("petl-export: error: torch.onnx.export cannot export ")
        assert error.count("\n") == 1 and not (tmp_path / "model.onnx").exists()
        return
    assert (tmp_path / "model.onnx").stat().st_size > 0


@pytest.mark.slow
def test_ssf_where_qkv_has_no_bias_predicts_unmerged_with_merge_and_export_names_the_method(tmp_path, capsys):
    run_dir = tmp_path / "run"
    multitask_run_folder(run_dir, "ssf", {}, seed=0, model_cfg=FAMILY_BACKBONES["beit"])
    images = tmp_path / "images"
    images.mkdir()
    for i in range(2):
        _image(images / f"{i}.png")
    rows = {}
    for flags in ([], ["--merge"]):
        with pytest.raises(SystemExit) as stop:
            predict_cli.main([str(run_dir), str(images), f"out={tmp_path / 'preds.csv'}", "overwrite=true", *flags])
        assert stop.value.code == 0, capsys.readouterr().err
        with open(tmp_path / "preds.csv", newline="") as handle:
            rows[bool(flags)] = list(csv.DictReader(handle))
    # The same rows: the refused merge put back the layers it merged before the refusal bit for bit.
    assert rows[True] == rows[False]
    assert "note: method ssf: blocks.0.attn.qkv: SSF cannot merge" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        export_cli.main([str(run_dir), f"out={tmp_path / 'exported'}"])
    error = capsys.readouterr().err
    assert stop.value.code == 2 and error.count("\n") == 1
    assert error.startswith("petl-export: error: method 'ssf' cannot be unloaded into a plain timm model: ")
    assert not (tmp_path / "exported").exists()


@pytest.mark.slow
def test_out_where_nothing_can_be_written_is_refused_in_one_line_before_loading(tmp_path, capsys):
    # It was said after the run loaded, naming the temporary file ("[Errno 2] ... '/proc/.x.safetensors.41j4.tmp'").
    run_dir = _run_folder(tmp_path / "run")
    (run_dir / run_card.WEIGHTS_FILE).write_bytes(b"not loaded: the refusal comes first")
    a_file = tmp_path / "notes.txt"
    a_file.write_text("")
    targets = [a_file / "x.safetensors", a_file / "sub" / "exported"]
    if Path("/proc/self").is_dir():
        targets.append(Path("/proc/x.onnx"))
    for target in targets:
        with pytest.raises(SystemExit) as stop:
            export_cli.main([str(run_dir), f"out={target}"])
        error = capsys.readouterr().err
        assert stop.value.code == 2 and error.count("\n") == 1, error
        # The folder written in (the out= folder itself when it has no suffix), why, then what to do.
        folder = target.parent if target.suffix else target
        assert error.startswith(f"petl-export: error: out={target}: {folder} "), error
        assert error.rstrip().endswith(": choose a folder you can write to"), error


def test_onnx_without_the_onnx_package_says_which_package_before_loading(tmp_path, capsys, monkeypatch):
    # torch's exporter said "torch.onnx.export cannot export vit_tiny_patch16_224 (Module onnx is not installed!)",
    # after the run loaded, as if the model could not be traced.
    run_dir = _run_folder(tmp_path / "run")
    (run_dir / run_card.WEIGHTS_FILE).write_bytes(b"not loaded: the refusal comes first")
    monkeypatch.setitem(sys.modules, "onnx", None)  # import onnx raises ImportError
    with pytest.raises(SystemExit) as stop:
        export_cli.main([str(run_dir), f"out={tmp_path / 'model.onnx'}"])
    error = capsys.readouterr().err
    assert stop.value.code == 1 and error.count("\n") == 1, error
    assert error == (
        f"petl-export: error: out={tmp_path / 'model.onnx'} needs the onnx package, which is not installed: "
        "pip install onnx, or export a folder or a .safetensors file\n"
    )
    assert list(tmp_path.iterdir()) == [run_dir]


class _AntialiasedResize(torch.nn.Module):
    """An operator torch's ONNX exporter has no symbol for, as NaFlexVit resamples its position grid."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.interpolate(x, size=(5, 5), mode="bicubic", antialias=True)


def test_an_onnx_export_torch_cannot_write_leaves_its_one_line_refusal_without_torchs_graph_dump(tmp_path, capfd):
    # petl-export out=model.onnx on a NaFlexVit run printed some 200 lines of torch's IR graph ("Torch IR graph at
    # exception: ...", written from C++ to the process's stdout) before its one-line refusal.
    pytest.importorskip("onnx")
    with pytest.raises(RuntimeError, match="cannot export tiny .*aten::_upsample_bicubic2d_aa"):
        export_api._torch_onnx_export(
            _AntialiasedResize(), torch.zeros(1, 3, 8, 8), tmp_path / "x.onnx", {"timm_model": "tiny"}
        )
    assert capfd.readouterr() == ("", "")


def test_onnx_without_onnxruntime_notes_it_on_stderr_and_prints_only_what_it_wrote(tmp_path, capsys, monkeypatch):
    # The note went to stdout, beside "wrote ...", where a script reads the command's answer.
    pytest.importorskip("onnx")
    run_dir = _run_folder(tmp_path / "run")
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    export_cli.main([str(run_dir), f"out={tmp_path / 'model.onnx'}"])
    out, err = capsys.readouterr()
    assert out == f"wrote {tmp_path / 'model.onnx'}\n"
    assert err == "petl-export: note: onnxruntime is not installed: the ONNX file is not checked\n"
    assert (tmp_path / "model.onnx").stat().st_size > 0


def test_an_export_interrupted_over_an_earlier_folder_leaves_no_config_beside_the_new_weights(
    tmp_path, capsys, monkeypatch
):
    # overwrite=true wrote the new model.safetensors, then config.json: a Ctrl-C between them left the earlier
    # export's config.json (its classes, its run) beside the new weights, a folder timm loads as finished.
    old, new = _run_folder(tmp_path / "old", classes=3), _run_folder(tmp_path / "new", seed=1, classes=3)
    export_cli.main([str(old), f"out={tmp_path / 'exported'}"])

    def interrupted(path, record):
        raise KeyboardInterrupt

    monkeypatch.setattr(export_api.files, "write_json", interrupted)
    with pytest.raises(SystemExit) as stop:
        export_cli.main([str(new), f"out={tmp_path / 'exported'}", "overwrite=true"])
    assert stop.value.code == 130
    assert sorted(p.name for p in (tmp_path / "exported").iterdir()) == ["model.safetensors"]
    capsys.readouterr()


def test_a_folder_where_the_export_writes_a_file_is_refused_even_with_overwrite(tmp_path, capsys):
    # With overwrite=true it failed after loading as "cannot write out=... (Is a directory): free the space".
    run_dir = _run_folder(tmp_path / "run")
    (tmp_path / "exported" / "model.safetensors").mkdir(parents=True)
    for flags in ([], ["overwrite=true"]):
        with pytest.raises(SystemExit) as stop:
            export_cli.main([str(run_dir), f"out={tmp_path / 'exported'}", *flags])
        error = capsys.readouterr().err
        assert stop.value.code == 2 and error == (
            f"petl-export: error: {tmp_path / 'exported' / 'model.safetensors'} is a folder, where the export "
            "writes a file: remove it or export elsewhere\n"
        )


def _onnx_logits(path: Path, images: torch.Tensor) -> torch.Tensor:
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return torch.from_numpy(session.run(None, {"image": images.numpy()})[0])


def test_an_onnx_export_past_2_gib_keeps_its_weights_in_one_data_file_that_an_overwrite_replaces(
    tmp_path, capsys, monkeypatch
):
    # Past protobuf's 2 GiB, petl re-saved torch's ONNX file whole to add the metadata: "EncodeError: Failed to
    # serialize proto", beside torch's file per weight left in out='s folder.  The limit lowered: the TINY model is
    # "large".  The real size is not in the suite (a 2 GiB model costs 20-45 s and 7 GB of memory); it was run by
    # hand with 2.02 GiB of fp32 weights: the old code failed as above, this one wrote a 745-byte .onnx and its .data.
    pytest.importorskip("onnxruntime")
    import onnx

    run_dir = _run_folder(tmp_path / "run")
    out = tmp_path / "model.onnx"
    data = tmp_path / "model.onnx.data"
    images = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = petl.load_run(run_dir).model(images)
    monkeypatch.setattr(export_api, "ONNX_WEIGHTS_LIMIT", 0, raising=False)
    export_cli.main([str(run_dir), f"out={out}"])
    assert capsys.readouterr().out.startswith(f"wrote {out} (onnxruntime matches torch within ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.onnx.data", "run"]
    proto = onnx.load(str(out), load_external_data=False)
    assert {entry.key: entry.value for entry in proto.metadata_props}["timm_model"] == "vit_tiny_patch16_224"
    locations = {
        entry.value for tensor in proto.graph.initializer for entry in tensor.external_data if entry.key == "location"
    }
    assert locations == {"model.onnx.data"}  # one file, named relative to the .onnx: the two move together
    torch.testing.assert_close(_onnx_logits(out, images), want, atol=1e-4, rtol=1e-4)
    # The data file is part of the export: refused without overwrite=true, even alone.
    out.unlink()
    with pytest.raises(SystemExit) as stop:
        export_cli.main([str(run_dir), f"out={out}"])
    error = capsys.readouterr().err
    assert stop.value.code == 2 and error == (
        f"petl-export: error: {data} already exists: export elsewhere, or add overwrite=true to replace it\n"
    )
    export_cli.main([str(run_dir), f"out={out}", "overwrite=true"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.onnx.data", "run"]
    # A small export over a large one removes its data file: the new .onnx holds its weights itself.
    monkeypatch.undo()
    export_cli.main([str(run_dir), f"out={out}", "overwrite=true"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "run"]
    torch.testing.assert_close(_onnx_logits(out, images), want, atol=1e-4, rtol=1e-4)


def test_a_large_onnx_export_that_fails_its_check_leaves_the_earlier_export_and_no_temporary_files(
    tmp_path, capsys, monkeypatch
):
    pytest.importorskip("onnxruntime")
    run_dir = _run_folder(tmp_path / "run")
    out = tmp_path / "model.onnx"
    (tmp_path / "model.onnx.data").write_text("an earlier export's weights")
    out.write_text("an earlier export")
    monkeypatch.setattr(export_api, "ONNX_WEIGHTS_LIMIT", 0, raising=False)
    monkeypatch.setattr(export_api, "_onnx_gap", lambda *args: 1.0)
    with pytest.raises(SystemExit) as stop:
        export_cli.main([str(run_dir), f"out={out}", "overwrite=true"])
    error = capsys.readouterr().err
    assert stop.value.code == 1 and "onnxruntime's logits differ from torch's by 1.00e+00" in error, error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.onnx.data", "run"]
    assert out.read_text() == "an earlier export"
    assert (tmp_path / "model.onnx.data").read_text() == "an earlier export's weights"


def test_an_onnx_export_removes_the_temporary_folder_a_killed_export_left_and_names_one_it_did_not_make(
    tmp_path, capsys
):
    # An export killed with kill -9 left its hidden temporary folder (with torch's weights) beside out= for good.
    pytest.importorskip("onnxruntime")
    run_dir = _run_folder(tmp_path / "run")
    out = tmp_path / "model.onnx"
    killed = """
        import os, signal, sys
        from petl.cli import export as export_cli
        from petl.deploy import export as export_api
        def killed(*args):
            os.kill(os.getpid(), signal.SIGKILL)
        export_api._onnx_gap = killed  # after torch wrote the model in the temporary folder
        export_cli.main(sys.argv[1:])
    """
    env = {**os.environ, "PYTHONPATH": str(Path(petl.__file__).parents[1])}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(killed), str(run_dir), f"out={out}"], env=env, capture_output=True
    )
    assert done.returncode == -9, done.stderr
    (leftover,) = tmp_path.glob(".model.onnx.*.tmp")
    assert (leftover / "model.onnx").is_file()
    live, held = export_api._work_folder(out)  # another export, running now
    mine = tmp_path / ".model.onnx.mine.tmp"  # the user's own folder of that name
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    try:
        export_cli.main([str(run_dir), f"out={out}"])
        assert live.is_dir()
    finally:
        os.close(held)
    assert not leftover.exists() and (mine / "notes.txt").read_text() == "the user's"
    assert {p.name for p in tmp_path.iterdir()} == {".model.onnx.mine.tmp", live.name, "model.onnx", "run"}
    assert capsys.readouterr().err == (
        f"petl-export: note: {mine} may be the temporary folder of an interrupted export to {out}: delete it if no "
        "export is writing there\n"
    )


def test_an_export_removes_the_temporary_files_an_export_killed_while_writing_left(tmp_path, capsys):
    # An export killed (kill -9) while writing a .safetensors file, or a folder's files, left its hidden temporary
    # file (as big as the weights) beside them for good.
    run_dir = _run_folder(tmp_path / "run")
    folder = tmp_path / "exported"
    folder.mkdir()
    killed = [tmp_path / ".model.safetensors.k1lled00.tmp"]
    killed += [folder / ".model.safetensors.k1lled00.tmp", folder / ".config.json.k1lled00.tmp"]
    for path in killed:
        path.write_bytes(b"half a file")
        os.utime(path, (time.time() - 3600,) * 2)
    young = tmp_path / ".model.safetensors.wr1ting0.tmp"  # maybe a live export's, not locked yet: kept
    young.write_bytes(b"half a file")
    export_cli.main([str(run_dir), f"out={tmp_path / 'model.safetensors'}"])
    export_cli.main([str(run_dir), f"out={folder}"])
    assert [path for path in killed if path.exists()] == [] and young.exists()
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    capsys.readouterr()


def test_an_export_that_fails_removes_the_empty_folders_it_made_for_out(tmp_path, capsys, monkeypatch):
    # An ONNX export torch cannot trace (timm's EVA) to out=new/sub/model.onnx failed in one line but left the
    # empty folders new/sub behind.
    run_dir = _run_folder(tmp_path / "run")

    def cannot_trace(model, example, path, meta, instead):
        raise RuntimeError("torch.onnx.export cannot export eva02 (...): export a folder or a .safetensors file")

    monkeypatch.setattr(export_api, "_torch_onnx_export", cannot_trace)
    (tmp_path / "kept").mkdir()  # a folder that was there stays, even empty
    for out in (tmp_path / "new" / "sub" / "model.onnx", tmp_path / "kept" / "sub" / "model.onnx"):
        with pytest.raises(SystemExit) as stop:
            export_cli.main([str(run_dir), f"out={out}"])
        assert stop.value.code == 1 and capsys.readouterr().err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept", "run"] and not any((tmp_path / "kept").iterdir())


def test_a_dangling_symlink_at_out_is_in_the_way_as_a_file_is(tmp_path, capsys):
    # A symlink the user made whose target is gone (exists() is False) was replaced without overwrite=true.
    run_dir = _run_folder(tmp_path / "run")
    (run_dir / run_card.WEIGHTS_FILE).write_bytes(b"not loaded: the refusal comes first")
    links = [tmp_path / "model.safetensors", tmp_path / "model.onnx.data", tmp_path / "exported" / "config.json"]
    (tmp_path / "exported").mkdir()
    for link in links:
        link.symlink_to(tmp_path / "gone" / link.name)
    for out, link in zip([links[0], tmp_path / "model.onnx", tmp_path / "exported"], links, strict=True):
        with pytest.raises(SystemExit) as stop:
            export_cli.main([str(run_dir), f"out={out}"])
        error = capsys.readouterr().err
        assert stop.value.code == 2 and error == (
            f"petl-export: error: {link} already exists: export elsewhere, or add overwrite=true to replace it\n"
        )
    assert all(link.is_symlink() for link in links)


def test_a_run_folder_named_by_its_options_given_from_the_folder_above_is_the_run(tmp_path, capsys, monkeypatch):
    # petl-export lr=0.001 out=... said "unknown option 'lr'", where petl-predict and petl-serve take the run.
    _run_folder(tmp_path / "lr=0.001")
    monkeypatch.chdir(tmp_path)
    code, out, err = command_status(capsys, export_cli.main, "lr=0.001", "out=exported.safetensors")
    assert code == 0 and out == "wrote exported.safetensors\n", err
    assert (tmp_path / "exported.safetensors").is_file()


def test_out_the_current_folder_is_a_folder_export_not_a_file_without_a_name(tmp_path, monkeypatch):
    # out=. (a timm folder in the current folder) failed with "PosixPath('.') has an empty name": the check for
    # out=.onnx (a suffix without a name) took the current folder's empty name for a suffix.
    monkeypatch.chdir(tmp_path)
    export_api.check_target(tmp_path / "run", ".")
    (tmp_path / "config.json").write_text("the user's own")
    with pytest.raises(ValueError, match=r"config.json already exist"):
        export_api.check_target(tmp_path / "run", ".")
    with pytest.raises(ValueError, match=r"out=.onnx names no file: give it a name \(model.onnx\)"):
        export_api.check_target(tmp_path / "run", ".onnx")


def test_stale_temporaries_are_only_the_files_atomic_path_names(tmp_path):
    # In an export's out= folder (the user's) every old .model.safetensors.*.tmp went: a file of the user's named so
    # was deleted, and a folder of that shape failed the export (IsADirectoryError from unlink).
    from petl.utils import paths

    target = tmp_path / "model.safetensors"
    with paths.atomic_path(target) as tmp:  # a live writer's file: its name is one, its lock keeps it
        assert paths._temporaries(target) == [tmp] and paths.remove_stale_temporaries(target, min_age=0) == []
    killed = tmp_path / ".model.safetensors.k1lled_0.tmp"  # a name mkstemp gives
    kept = [tmp_path / ".model.safetensors.backup.tmp", tmp_path / ".model.safetensors.notmine123.tmp"]
    for path in (killed, *kept):
        path.write_bytes(b"bytes")
    folder, link = tmp_path / ".model.safetensors.folder00.tmp", tmp_path / ".model.safetensors.link0000.tmp"
    folder.mkdir()
    link.symlink_to(kept[0])
    for path in (killed, *kept, folder, link):
        os.utime(path, (time.time() - 3600,) * 2, follow_symlinks=False)
    assert paths.remove_stale_temporaries(target) == [killed]
    assert all(path.exists() for path in (*kept, folder, link)) and not killed.exists()
    # A name glob reads as a pattern: .model[1].safetensors.*.tmp matched .model1.safetensors's, never its own.
    odd = tmp_path / "model[1].safetensors"
    killed = tmp_path / f".{odd.name}.k1lled_0.tmp"
    other = tmp_path / ".model1.safetensors.k1lled_0.tmp"
    for path in (killed, other):
        path.write_bytes(b"bytes")
        os.utime(path, (time.time() - 3600,) * 2)
    assert paths.remove_stale_temporaries(odd) == [killed] and other.exists()


def test_a_killed_onnx_exports_folder_is_found_whatever_characters_its_name_holds(tmp_path):
    # .model[1].onnx.*.tmp read as a pattern: the killed export's own folder was never found (and model1.onnx's was).
    out, other = tmp_path / "model[1].onnx", tmp_path / "model1.onnx"
    folders = [tmp_path / f".{out.name}.k1lled_0.tmp", tmp_path / f".{other.name}.k1lled_0.tmp"]
    for folder in folders:
        folder.mkdir()
        (folder / export_api.WORK_LOCK).write_bytes(b"")  # nobody holds it: a killed export's
    assert export_api.remove_killed_exports(out) == [folders[0]] and folders[1].is_dir()


def _does_not_unload(method: str) -> bool:
    model = petl.apply(TINY_MODELS["vit"](), method, num_classes=3)
    return timm_api.support(model)["export (merged)"].startswith("refused")


# Every registered method whose modules do not fold into the backbone (works-with.md's "refused" cells).
NOT_UNLOADED = [method for method in petl.list_methods() if _does_not_unload(method)]
# Those of them whose ONNX export fails on the tiny ViT, as petl-export's help says (its "today" list).
ONNX_FAILS = {"hst", "sct", "snf"}


@pytest.mark.slow
@pytest.mark.parametrize("method", NOT_UNLOADED)
def test_a_method_that_does_not_unload_is_told_to_export_onnx_which_holds_it_as_petl_runs_it(tmp_path, capsys, method):
    # Refused for a folder or .safetensors in one line naming what to use instead; ONNX was refused the same way,
    # though a graph needs no timm architecture to hold the method's modules.
    import onnx
    import onnxruntime

    run_dir = tmp_path / "run"
    multitask_run_folder(run_dir, method, {}, seed=0)
    code, _, error = command_status(capsys, export_cli.main, str(run_dir), f"out={tmp_path / 'exported'}")
    assert code == 2 and error.count("\n") == 1, error
    assert error.startswith(f"petl-export: error: method '{method}' cannot be unloaded into a plain timm model: ")
    assert f"export it as ONNX instead (out={tmp_path / 'exported.onnx'}" in error and "petl.load_run" in error
    assert not (tmp_path / "exported").exists()
    out = tmp_path / "exported.onnx"
    code, printed, error = command_status(capsys, export_cli.main, str(run_dir), f"out={out}")
    assert (code != 0) == (method in ONNX_FAILS), error
    if code != 0:
        # A graph torch cannot trace, or one traced at one batch size that is wrong at another: one line, exit 1.
        assert code == 1 and error.count("\n") == 1, error
        assert error.rstrip().endswith(export_api.AS_PETL_MODEL) and not out.exists()
        return
    assert printed.startswith(f"wrote {out} (onnxruntime matches torch within ")
    meta = {entry.key: entry.value for entry in onnx.load(str(out)).metadata_props}
    assert meta["method"] == f"{method} (not merged: its modules are in the graph)"
    images = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = petl.load_run(run_dir).model(images)
    session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"image": images.numpy()})
    torch.testing.assert_close(torch.from_numpy(logits), want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["beit", "vit_relpos"])
def test_vpt_on_a_relative_position_backbone_fails_its_onnx_check_in_one_line(tmp_path, capsys, family):
    # petl-export's help names it among the graphs that fail (VPT on BEiT and the relative-position ViTs).
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    run_dir = tmp_path / "run"
    multitask_run_folder(run_dir, "vpt", {}, seed=0, model_cfg=FAMILY_BACKBONES[family])
    out = tmp_path / "exported.onnx"
    code, _, error = command_status(capsys, export_cli.main, str(run_dir), f"out={out}")
    assert code == 1 and error.count("\n") == 1, error
    assert error.rstrip().endswith(export_api.AS_PETL_MODEL) and not out.exists()


def test_a_single_file_s_metadata_is_json_where_the_docs_say_and_plain_text_where_they_say(tmp_path):
    # docs/own-data.md said every value was a JSON string: json.loads(meta["timm_model"]) fails on vit_tiny_...
    run_dir = _run_folder(tmp_path / "run")
    meta = export_api.metadata(petl.load_run(run_dir))
    doc = " ".join((Path(__file__).resolve().parents[2] / "docs" / "own-data.md").read_text().split())
    said = re.search(
        r"`timm_kwargs`, `class_names` and `preprocess` hold JSON, `num_classes` a number, (.+?) plain", doc
    )
    assert said is not None, "docs/own-data.md no longer says which metadata values are JSON"
    plain = set(re.findall(r"`(\w+)`", said.group(1)))
    assert set(meta) == {"timm_kwargs", "class_names", "preprocess", "num_classes"} | plain
    for key in ("timm_kwargs", "class_names", "preprocess"):
        json.loads(meta[key])
    assert int(meta["num_classes"]) == len(json.loads(meta["class_names"]))
    for key in plain:
        with pytest.raises(json.JSONDecodeError):
            json.loads(meta[key])
