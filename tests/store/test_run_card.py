"""The run card (model.json) rebuilds the model anywhere and is checked on every load.

A run trained at another resolution loads, predicts and exports; a relative backbone checkpoint is
recorded absolute; another run's weights, a card naming weights outside its folder, a damaged or newer
card and a head of another class count are each refused in one line; a card of the first format
(written before this one) still loads, with one line saying what could not be checked.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import timm
import torch
from conftest import perturb_trainable, tiny_run
from PIL import Image
from safetensors import safe_open

import petl
from petl.cli import export as export_cli
from petl.cli import predict as predict_cli
from petl.cli import run as cli
from petl.data.transforms import ImageSpec
from petl.model.backbone import backbone_of
from petl.store import run_card
from petl.train.readers import image_size

TINY = {"name": "vit_fractal_tiny_patch4_32", "pretrained": False, "kwargs": {"depth": 1, "embed_dim": 48}}
# conftest's tiny NaFlexVit at one block, sized 32 px by its pretrained config's input_size, as petl-run records it.
NAFLEX_KWARGS = {"patch_size": 4, "embed_dim": 48, "depth": 1, "num_heads": 3}
NAFLEX = {
    "name": "naflexvit_base_patch16_gap",
    "pretrained": False,
    "kwargs": {**NAFLEX_KWARGS, "pretrained_cfg_overlay": {"input_size": [3, 32, 32]}},
}


def _run_folder(folder: Path, seed: int = 0, classes: int = 3, model_cfg: dict | None = None) -> Path:
    """A finished run folder (LoRA on the tiny backbone) written as petl-run writes it, without training."""
    model_cfg = model_cfg or TINY
    model = petl.apply(run_card.create_backbone({**model_cfg, "seed": 0}), "lora", num_classes=classes)
    perturb_trainable(model, seed=seed)
    folder.mkdir(parents=True)
    petl.save_trainable(model, folder / run_card.WEIGHTS_FILE)
    size = image_size(model)
    spec = ImageSpec(image_size=size, mean=(0.5,) * 3, std=(0.25,) * 3, interpolation="bilinear", crop=False)
    card = run_card.model_card(
        model_cfg=model_cfg, seed=0, model=model, spec=spec, class_names=[f"c{i}" for i in range(classes)],
        dataset="folder", checkpoint_sha256=None,
    )  # fmt: skip
    run_card.write_card(folder, card)
    return folder


def _edit_card(folder: Path, edit) -> None:
    """Edit a run's card as a crafted card would be: its card_sha256 made anew (an edit that keeps it is refused by
    that alone: test_an_edited_card_is_refused_and_an_older_one_without_its_hash_loads), or dropped by ``edit``.
    """
    card = json.loads((folder / run_card.MODEL_FILE).read_text())
    edit(card)
    if run_card.CARD_HASH in card:
        card[run_card.CARD_HASH] = run_card.card_hash(card)
    (folder / run_card.MODEL_FILE).write_text(json.dumps(card))


def _image(path: Path) -> Path:
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 36, 3), dtype=np.uint8)).save(path)
    return path


@pytest.mark.slow
def test_a_run_at_another_resolution_loads_and_predicts(tmp_path, capsys):
    run_dir = tmp_path / "run48"
    cli.main([*tiny_run(), "model.img_size=48", f"output_dir={run_dir}"])
    card = json.loads((run_dir / run_card.MODEL_FILE).read_text())
    assert card["format"] == "petl-model-3" and card["backbone"]["kwargs"]["img_size"] == 48
    assert card["weights_sha256"] == run_card.file_sha256(run_dir / run_card.WEIGHTS_FILE)
    run = petl.load_run(run_dir)
    assert run.spec.image_size == 48 and run.model.patch_embed.img_size == (48, 48)
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        predict_cli.main([str(run_dir), str(_image(tmp_path / "a.png")), f"out={tmp_path / 'preds.csv'}", "--quiet"])
    assert stop.value.code == 0, capsys.readouterr().err
    assert (tmp_path / "preds.csv").read_text().count("\n") == 2  # the header and the one image


@pytest.mark.slow
def test_a_relative_checkpoint_is_recorded_absolute_and_loads_from_elsewhere(tmp_path, monkeypatch):
    import safetensors.torch

    (tmp_path / "work" / "ckpt").mkdir(parents=True)
    backbone = timm.create_model(TINY["name"], pretrained=False, num_classes=0, **TINY["kwargs"])
    safetensors.torch.save_file(backbone.state_dict(), tmp_path / "work" / "ckpt" / "w.safetensors")
    monkeypatch.chdir(tmp_path / "work")
    overrides = [o for o in tiny_run() if o != "model.pretrained=false"]
    cli.main([*overrides, "model.checkpoint=ckpt/w.safetensors", "output_dir=run"])
    card = json.loads(Path("run/model.json").read_text())
    assert card["backbone"]["checkpoint"] == str(tmp_path / "work" / "ckpt" / "w.safetensors")
    monkeypatch.chdir(tmp_path)
    petl.load_run(tmp_path / "work" / "run")
    # The checkpoint changed since: refused, naming it.
    safetensors.torch.save_file(
        {k: v + 1 for k, v in backbone.state_dict().items()}, tmp_path / "work" / "ckpt" / "w.safetensors"
    )
    with pytest.raises(run_card.RunFolderError, match=r"w.safetensors changed since the run"):
        petl.load_run(tmp_path / "work" / "run")


def test_another_runs_weights_of_the_same_shape_are_refused(tmp_path):
    one, two = _run_folder(tmp_path / "one", seed=1), _run_folder(tmp_path / "two", seed=2)
    (one / run_card.WEIGHTS_FILE).write_bytes((two / run_card.WEIGHTS_FILE).read_bytes())
    with pytest.raises(run_card.RunFolderError, match=r"trainable.safetensors is not the weights this run wrote"):
        petl.load_run(one)


def test_a_card_naming_weights_outside_its_folder_is_not_opened(tmp_path, monkeypatch):
    run = _run_folder(tmp_path / "run")
    other = _run_folder(tmp_path / "other", seed=4)
    opened = []
    monkeypatch.setattr(petl, "load_trainable", lambda model, path: opened.append(path))
    for outside in ("../other/trainable.safetensors", str(other / run_card.WEIGHTS_FILE)):
        _edit_card(run, lambda card, w=outside: card.update(weights=w))
        with pytest.raises(run_card.RunFolderError, match="names a file outside the run folder"):
            petl.load_run(run)
    assert opened == []


def test_a_head_of_another_class_count_is_refused(tmp_path):
    run = _run_folder(tmp_path / "run", classes=3)
    _edit_card(run, lambda card: card.update(num_classes=5, class_names=[f"c{i}" for i in range(5)]))
    with pytest.raises(run_card.RunFolderError, match="holds a head of 3 classes, model.json says num_classes=5"):
        petl.load_run(run)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda card: card.pop("weights_sha256"), "field weights_sha256 is missing"),
        (lambda card: card["backbone"].pop("name"), "field backbone.name is missing"),
        (lambda card: card.update(num_classes="3"), 'field num_classes is "3", not a int'),
        (lambda card: card["preprocess"].update(input_size=True), "field preprocess.input_size is true, not a int"),
        (lambda card: card.update(backbone=[]), "field backbone is"),
        (lambda card: card.update(class_names=["a"]), "class_names has 1 names for num_classes=3"),
        (lambda card: card.update(format="petl-model-4"), "was written by a newer petl .*upgrade petl"),
        (lambda card: card.update(format="something"), "not a petl model record .*: restore the run's model.json"),
        # Values of the right type but unusable: were a NaN prediction for every image (class 0, silently), or
        # torch's or ImageSpec's error not naming model.json.
        (lambda card: card["preprocess"].update(mean=[float("nan")] * 3), "preprocess.mean is \\[NaN, .*not finite"),
        (lambda card: card["preprocess"].update(std=["a", 1, 1]), "preprocess.std is .*, not finite numbers"),
        (lambda card: card["preprocess"].update(std=[0, 1, 1]), "preprocess: std values must be > 0"),
        (lambda card: card["preprocess"].update(mean=[0.5]), "preprocess: mean and std need 3 values"),
        (lambda card: card["preprocess"].update(interpolation="cubic"), "interpolation='cubic' is not supported"),
        (lambda card: card["preprocess"].update(input_size=0), "image_size must be a positive int"),
        (lambda card: card.update(class_names=[1, 2, 3]), "class_names holds a name that is not text"),
        # Formats count from 1; a card whose values describe another model than the one its weights build: were a
        # traceback on the first image (another input size), or a card saying options the model does not have.
        (lambda card: card.update(format="petl-model-0"), "not a petl model record \\(its format is not petl-model-N"),
        (lambda card: card["preprocess"].update(input_size=64), "input_size is 64, the backbone is built at .*=32"),
        (lambda card: card["method_config"].update(rank=2), "method_config.rank is 2, trainable.safetensors was trai"),
        (lambda card: card.update(dataset=["x"]), 'field dataset is \\["x"\\], not a str'),
    ],
)
def test_a_damaged_or_newer_card_is_refused_in_one_line(tmp_path, edit, message):
    run = _run_folder(tmp_path / "run")
    _edit_card(run, edit)
    with pytest.raises(run_card.RunFolderError, match=message) as error:
        petl.load_run(run)
    assert "\n" not in str(error.value) and str(run / run_card.MODEL_FILE) in str(error.value)


def test_weights_whose_options_were_edited_are_named_not_the_card(tmp_path):
    # The weights' metadata was compared with model.json before its hash was checked: an alpha edited in the file
    # was told as model.json's method_config.alpha, to be restored, though model.json was the run's own.
    run = _run_folder(tmp_path / "run")
    weights = run / run_card.WEIGHTS_FILE
    with safe_open(str(weights), framework="pt") as f:
        meta, tensors = f.metadata(), {name: f.get_tensor(name) for name in f.keys()}
    edited = json.dumps({**json.loads(meta["config"]), "alpha": 2.0})
    safetensors.torch.save_file(tensors, str(weights), metadata={**meta, "config": edited})
    with pytest.raises(run_card.RunFolderError, match=rf"^{weights} is not the weights this run wrote"):
        petl.load_run(run)


@pytest.mark.slow
def test_a_naflexvit_trained_at_its_overlays_size_reloads_predicts_and_exports_at_that_size(tmp_path, capsys):
    """A NaFlexVit's size is its pretrained config's input_size (384 px): the overlay that changes it was refused as a
    file timm would load; model.json now carries it, so the run reloads at the size it trained at."""
    run_dir = tmp_path / "run"
    overrides = [o for o in tiny_run(subset=32, epochs=1) if not o.startswith("model=")]
    naflex = ["model=naflexvit_base_patch16_gap", "+model.kwargs.patch_size=4", "+model.kwargs.num_heads=3"]
    overlay = "+model.kwargs.pretrained_cfg_overlay={input_size:[3,32,32]}"
    cli.main([*overrides, *naflex, overlay, "method=lora", f"output_dir={run_dir}"])
    card = json.loads((run_dir / run_card.MODEL_FILE).read_text())
    assert card["format"] == "petl-model-3" and card["preprocess"]["input_size"] == 32
    assert card["backbone"]["kwargs"]["pretrained_cfg_overlay"] == {"input_size": [3, 32, 32]}
    run = petl.load_run(run_dir)
    # The grid methods such as Convpass reshape the patch tokens to: 8x8 at 32 px, 96x96 at timm's 384.
    assert backbone_of(run.model).grid_size() == (8, 8)
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        predict_cli.main([str(run_dir), str(_image(tmp_path / "a.png")), f"out={tmp_path / 'preds.csv'}", "--quiet"])
    assert stop.value.code == 0, capsys.readouterr().err
    # The timm folder petl-export writes holds the size in its pretrained_cfg (an overlay beside it was timm's
    # "multiple values for keyword argument 'pretrained_cfg_overlay'").
    export_cli.main([str(run_dir), f"out={tmp_path / 'exported'}"])
    exported = timm.create_model(f"local-dir:{tmp_path / 'exported'}", pretrained=True).eval()
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported(images), run.model(images), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        # Format 3 on carries the overlay's input_size alone, the card's own.
        (lambda card: card.update(format="petl-model-2"), "pretrained_cfg_overlay is in a petl-model-2 card, which"),
        (
            lambda card: card["backbone"]["kwargs"]["pretrained_cfg_overlay"].update(input_size=[3, 48, 48]),
            r"overlay.input_size is \[3, 48, 48\], not the \[3, 32, 32\] of preprocess.input_size",
        ),
        (
            lambda card: card["backbone"]["kwargs"]["pretrained_cfg_overlay"].update(url="https://x"),
            "pretrained_cfg_overlay.url: petl takes only input_size of it",
        ),
        (
            lambda card: card["backbone"]["kwargs"].update(pretrained_cfg_overlay=[3, 32, 32]),
            r"pretrained_cfg_overlay=\[3, 32, 32\] is not a mapping",
        ),
    ],
)
def test_a_naflexvit_cards_overlay_other_than_its_input_size_is_refused(tmp_path, edit, message):
    run = _run_folder(tmp_path / "run", model_cfg=NAFLEX)
    assert backbone_of(petl.load_run(run).model).grid_size() == (8, 8)
    _edit_card(run, edit)
    with pytest.raises(run_card.RunFolderError, match=message) as error:
        petl.load_run(run)
    assert "\n" not in str(error.value) and str(run / run_card.MODEL_FILE) in str(error.value)


def test_a_second_format_card_still_loads(tmp_path):
    # Format 3 added the overlay a card may hold; a card of format 2, which holds none, is read as before.
    run = _run_folder(tmp_path / "run")
    _edit_card(run, lambda card: card.update(format="petl-model-2") or card.pop(run_card.CARD_HASH))
    assert petl.load_run(run).card["format"] == "petl-model-2"


@pytest.mark.parametrize(
    "edit",
    [
        lambda card: card.update(class_names=card["class_names"][::-1]),  # every prediction named as another class
        lambda card: card["preprocess"].update(mean=[0.4, 0.4, 0.4]),
        lambda card: card.update(dataset="other"),
    ],
)
def test_an_edited_card_is_refused_and_an_older_one_without_its_hash_loads(tmp_path, edit):
    # Nothing checked the class names, the preprocessing or the dataset against the run: an edited card was trusted.
    run = _run_folder(tmp_path / "run")
    card_path = run / run_card.MODEL_FILE
    card = json.loads(card_path.read_text())
    edit(card)
    card_path.write_text(json.dumps(card))
    with pytest.raises(run_card.RunFolderError) as error:
        petl.load_run(run)
    assert str(error.value) == (
        f"{card_path} was edited since petl-run wrote it (its fields do not match its card_sha256): restore the run's "
        "model.json"
    )
    card.pop(run_card.CARD_HASH)  # a card of petl before the hash: read as before
    card_path.write_text(json.dumps(card))
    assert petl.load_run(run).class_names == card["class_names"]


def test_a_file_of_the_run_given_for_its_folder_says_to_give_the_folder(tmp_path):
    # It said "no such run folder", though the file is there.
    run = _run_folder(tmp_path / "run")
    with pytest.raises(run_card.RunFolderError, match=r"model.json: a file, not a run folder: give the folder holding"):
        petl.load_run(run / run_card.MODEL_FILE)


def test_a_file_outside_any_run_is_not_said_to_be_in_a_run_folder(tmp_path):
    # It said "give the folder holding it (<that folder>)" of any file, an image among them: that folder, holding no
    # run, was refused in turn.
    image = tmp_path / "photos" / "cat.png"
    image.parent.mkdir()
    image.write_bytes(b"not a run")
    with pytest.raises(run_card.RunFolderError) as error:
        petl.load_run(image)
    assert (
        str(error.value)
        == f"{image}: a file, not a run folder: give a petl-run output folder (model.json beside trainable.safetensors)"
    )


def _as_first_format(card: dict) -> None:
    """What petl wrote before this format: no weights hash, no img_size unless the run gave it in kwargs."""
    card["format"] = "petl-model-1"
    card.pop("weights_sha256")
    card.pop(run_card.CARD_HASH)
    card["backbone"]["kwargs"].pop("img_size")


def test_a_first_format_card_still_loads_and_says_what_it_cannot_check(tmp_path, caplog):
    run = _run_folder(tmp_path / "run")
    expected = petl.load_run(run)
    _edit_card(run, _as_first_format)
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with caplog.at_level(logging.WARNING, logger="petl.store.run_card"):
        old = petl.load_run(run)
        petl.load_run(run)  # said once per card
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 1 and "petl-model-1 card: it records no hash of trainable.safetensors" in notes[0]
    with torch.no_grad():
        torch.testing.assert_close(old.model(images), expected.model(images))


def test_a_petl_bench_selection_trial_says_its_weights_were_removed_and_which_run_to_use(tmp_path):
    # petl-bench removes a scored trial's weights: "restore it from the run, or train the run again" sent the user
    # after weights that were removed on purpose.
    trial = _run_folder(tmp_path / "lora" / "search" / "train.lr=0.01")
    (trial / run_card.WEIGHTS_FILE).unlink()
    (trial / "result.json").write_text("{}")
    with pytest.raises(run_card.RunFolderError, match=r"is a petl-bench selection trial, whose weights petl-bench"):
        petl.load_run(trial)
    with pytest.raises(run_card.RunFolderError, match=re.escape(f"use a final run, {tmp_path / 'lora' / 'seed0'}")):
        petl.load_run(trial)


def test_a_first_format_card_of_a_run_at_another_resolution_loads(tmp_path):
    model_cfg = {**TINY, "kwargs": {**TINY["kwargs"], "img_size": 48}}
    run = _run_folder(tmp_path / "run", model_cfg=model_cfg)
    _edit_card(run, _as_first_format)
    _edit_card(run, lambda card: card["preprocess"].update(input_size=48))
    assert petl.load_run(run).model.patch_embed.img_size == (48, 48)


def test_a_run_without_its_weights_or_its_card_says_what_to_do(tmp_path):
    """Each said what is wrong ("holds no trainable.safetensors: not a finished petl-run folder") but not what to do."""
    run = _run_folder(tmp_path / "run")
    (run / run_card.WEIGHTS_FILE).unlink()
    with pytest.raises(run_card.RunFolderError, match=r"which its model.json names: restore it from the run, or train"):
        petl.load_run(run)
    (run / run_card.MODEL_FILE).unlink()
    with pytest.raises(run_card.RunFolderError, match=r"not a finished petl-run folder; give the output_dir of"):
        petl.load_run(run)
