"""Faults and bad input, own image folders: awkward real-world folders into petl-run, and petl-predict on them.

Each test is one fault found by feeding folders made with Pillow (hidden files, links, files that are not
images by their extension, bad images in several splits, huge images) through petl-run's and petl-predict's mains.
"""

from __future__ import annotations

import csv
import io
import logging
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from test_faults_predict_data_report import TINY_MODEL, _exit_code, make_folder, train_folder

import petl.run
from petl import data as petl_data
from petl.cli import predict as predict_cli
from petl.cli import run as cli
from petl.data import folder, images
from petl.data.images import decode_image
from petl.utils import once, progress

CLASSES = ("a", "b")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A tiny run on a two-class folder."""
    base = tmp_path_factory.mktemp("own_images")
    return train_folder(make_folder(base / "images", classes=CLASSES, test=0), base / "run")


def _png(path: Path, size: int = 12) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((size, size, 3), 90, np.uint8)).save(path)
    return path


def test_unreadable_images_of_every_split_are_named_in_one_line(tmp_path, capsys):
    # petl-run named the bad images of the first split it built only: fixed, the next run named test/'s.
    root = make_folder(tmp_path / "images", classes=CLASSES)
    (root / "train" / "a" / "000.png").write_bytes(b"")
    (root / "test" / "b" / "001.png").write_bytes(b"a text file named .png")
    argv = ["method=lora", "data=folder", f"data.root={root}", *TINY_MODEL, f"output_dir={tmp_path / 'run'}"]
    capsys.readouterr()
    assert _exit_code(cli.main, argv) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "2 listed image(s) cannot be used" in error, error
    assert str(root / "train" / "a" / "000.png") in error and str(root / "test" / "b" / "001.png") in error


def test_predict_on_a_folder_skips_hidden_files_as_training_does(trained, tmp_path, capsys):
    # A Jupyter checkpoint copy was predicted as a photo of its own, and macOS's ._photo.png (not an image) made
    # petl-predict exit 2; petl-run skips both.
    photos = tmp_path / "photos"
    _png(photos / "photo.png")
    _png(photos / ".ipynb_checkpoints" / "photo-checkpoint.png")
    (photos / "._photo.png").write_bytes(b"\x00\x05\x16\x07 AppleDouble")
    (photos / ".DS_Store").write_bytes(b"Bud1")
    out = tmp_path / "preds.csv"
    assert _exit_code(predict_cli.main, [str(trained), str(photos), f"out={out}"]) == 0
    with open(out, newline="") as handle:
        assert [row["path"] for row in csv.DictReader(handle)] == [str(photos / "photo.png")]


def test_predict_says_which_files_of_a_folder_are_not_images(trained, tmp_path, capsys):
    # A .gif and a file without a suffix had no row, and nothing said so.
    photos = tmp_path / "photos"
    _png(photos / "photo.png")
    Image.new("RGB", (8, 8)).save(photos / "moving.gif")
    _png(photos / "IMG_0001.png").rename(photos / "no_suffix")
    capsys.readouterr()
    assert _exit_code(predict_cli.main, [str(trained), str(photos)]) == 0
    captured = capsys.readouterr()
    assert captured.out.count("photo.png") == 1 and "moving.gif" not in captured.out
    note = [line for line in captured.err.splitlines() if "note: skipped" in line]
    assert len(note) == 1 and "moving.gif, no_suffix in " in note[0], captured.err


def test_a_class_folders_files_that_are_not_images_are_named_in_a_warning(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(once, "SAID", set())
    for name in CLASSES:
        for index in range(3):
            _png(tmp_path / "train" / name / f"{index}.png")
    Image.new("RGB", (8, 8)).save(tmp_path / "train" / "a" / "moving.gif")
    folder._scan.cache_clear()
    with caplog.at_level(logging.WARNING, logger="petl.data.folder"):
        folder.describe_folder(str(tmp_path))
    warned = [record.getMessage() for record in caplog.records]
    assert len(warned) == 1 and warned[0].startswith(f"folder: skipped a/moving.gif in {tmp_path / 'train'}: ")


def test_a_linked_sub_folder_is_followed_and_a_link_to_a_folder_above_is_not(tmp_path):
    # rglob did not follow a linked sub-folder of a class (torchvision's ImageFolder does): its images were
    # left out without a word.
    elsewhere = tmp_path / "elsewhere"
    for index in range(3):
        _png(elsewhere / f"{index}.png")
        _png(tmp_path / "images" / "train" / "b" / f"{index}.png")
    a = tmp_path / "images" / "train" / "a"
    _png(a / "own.png")
    (a / "batch").symlink_to(elsewhere)
    (a / "loop").symlink_to(a.parent)  # would take b's images into a, or loop
    dataset = petl_data.build_dataset("folder", petl_data.TRAIN_VAL, image_size=8, root=str(tmp_path / "images"))
    assert sorted(int(dataset[i][1]) for i in range(len(dataset))) == [0, 0, 0, 0, 1, 1, 1]


def test_a_folder_reached_by_a_link_too_is_read_by_the_first_path_in_name_order(tmp_path):
    # The path kept was the one the file system listed first: part real_*, part link_* on ext4 (hash order), so a
    # copy of the data elsewhere named its images otherwise (and ordered them, and held out others for val).
    for index, name in enumerate("abcdefgh"):
        real, link = tmp_path / f"real_{name}", tmp_path / f"link_{name}"
        if index % 2:  # tmpfs lists the newest first: some of each order
            link.symlink_to(real, target_is_directory=True)
        _png(real / "x.png")
        if not index % 2:
            link.symlink_to(real, target_is_directory=True)
    found, _ = folder.image_files(tmp_path)
    assert [path.parent.name for path in found] == [f"link_{name}" for name in "abcdefgh"]


def test_a_huge_image_decodes_without_pillows_warning_and_a_bomb_says_what_to_do(monkeypatch):
    # Pillow's DecompressionBombWarning was printed, naming no file, for any photo over 89 megapixels.
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)

    def png(size: int) -> bytes:
        buffer = io.BytesIO()
        Image.fromarray(np.zeros((size, size), np.uint8)).save(buffer, format="PNG")
        return buffer.getvalue()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert decode_image(png(12)).shape == (12, 12)  # 144 pixels: over the limit, under twice it
    with pytest.raises(ValueError, match=r"^more than 200 pixels, .*: downscale it$"):
        decode_image(png(20))


def test_a_palette_png_with_transparency_decodes_to_its_colours_without_pillows_warning():
    # Each one printed Pillow's "Palette images with Transparency expressed in bytes..." naming no file.
    image = Image.fromarray((np.arange(64).reshape(8, 8) % 4).astype(np.uint8), "P")
    image.putpalette([0, 0, 0, 255, 0, 0, 0, 255, 0, 0, 0, 255])
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", transparency=bytes([0, 128, 255, 255]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        decoded = decode_image(buffer.getvalue())
    np.testing.assert_array_equal(decoded, np.asarray(image.convert("RGB")))


def test_decoding_a_folder_says_how_far_it_is_after_a_while_unless_progress_is_off(tmp_path, monkeypatch, caplog):
    # Every image is decoded before the first epoch: a few thousand phone photos took minutes without a word.
    monkeypatch.setattr(images, "DECODE_DELAY_S", 0.0)  # every split takes a while here
    monkeypatch.setattr(progress, "bars_shown", lambda: False)  # stderr is a log file
    root = make_folder(tmp_path / "images", classes=CLASSES, train=5)
    base = ["method=lora", "data=folder", f"data.root={root}", *TINY_MODEL, "train.epochs=1"]

    def reading(*overrides: str) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="petl"):
            petl.run.train(petl.run.default_config([*base, *overrides]))
        return [record.getMessage() for record in caplog.records if record.getMessage().startswith("reading ")]

    lines = reading("train.progress=true", f"output_dir={tmp_path / 'on'}")
    # train/ less its held-out fifth, then val, then test: each split from 0 to its count
    assert f"reading folder {root}: 8/8 imgs" in lines and f"reading folder {root}: 4/4 imgs" in lines, lines
    assert f"reading folder {root}: 0/8 imgs" in lines
    assert reading(f"output_dir={tmp_path / 'off'}") == []  # train.progress=false: quiet
    monkeypatch.setattr(images, "DECODE_DELAY_S", 60.0)  # work that ends sooner says nothing
    assert reading("train.progress=true", f"output_dir={tmp_path / 'quick'}") == []


def test_predict_evaluates_new_labelled_images_in_a_folder_of_test_alone(trained, tmp_path, capsys):
    # New labelled photos in new/test/<class>/ were refused for lack of a train/ folder ("put the images in
    # new/train/<class name>/"): evaluating a run needs the run's classes, not its training images.
    new = tmp_path / "new"
    for name, count in (("b", 3), ("a", 2)):
        for index in range(count):
            _png(new / "test" / name / f"{index}.png")
    (new / "test" / "a" / "notes.txt").write_text("taken on Tuesday")
    capsys.readouterr()
    assert _exit_code(predict_cli.main, [str(trained), "data=folder", f"data.root={new}", "--quiet"]) == 0
    captured = capsys.readouterr()
    assert f"{trained}: top-1 " in captured.out and "% on 5 images of folder test" in captured.out, captured.out
    assert "note: skipped a/notes.txt" in captured.err
    _png(new / "test" / "horse" / "0.png")  # a class the run does not know: no number for it
    assert _exit_code(predict_cli.main, [str(trained), "data=folder", f"data.root={new}"]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "class folders the run was not trained on: horse (its classes: a, b)" in error, error
    loose = tmp_path / "labelled"  # the class folders straight under the root: told where they go
    _png(loose / "a" / "0.png")
    assert _exit_code(predict_cli.main, [str(trained), "data=folder", f"data.root={loose}"]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.endswith(
        f"{loose} has no test/ folder: put the labelled images to evaluate on in {loose}/test/"
        "<class name>/, one folder per class of the run (a, b)"
    ), error


def test_several_runs_on_a_folder_of_test_alone_read_it_once(trained, tmp_path, capsys, monkeypatch):
    # Each run listed the folder again, printed its note again and decoded every image again.
    new = tmp_path / "new"
    for name in ("a", "b"):
        for index in range(2):
            _png(new / "test" / name / f"{index}.png")
    (new / "test" / "a" / "notes.txt").write_text("taken on Tuesday")
    second = tmp_path / "second"
    shutil.copytree(trained, second)
    decoded = []
    monkeypatch.setattr(images, "decode_image", lambda data: decoded.append(1) or decode_image(data))
    capsys.readouterr()
    argv = [str(trained), str(second), "data=folder", f"data.root={new}", "--quiet"]
    assert _exit_code(predict_cli.main, argv) == 0
    captured = capsys.readouterr()
    assert captured.err.count("note: skipped a/notes.txt") == 1, captured.err
    assert len(decoded) == 4, decoded
    first, again = re.findall(r"top-1 \S+ on 4 images", captured.out)  # one number per run, the same weights
    assert first == again, captured.out


def test_a_run_given_twice_predicts_once_with_a_note(trained, tmp_path, capsys):
    # Every image was predicted twice by the one run, its rows printed and written twice (petl-serve serves it once).
    photo = _png(tmp_path / "photo.png")
    out = tmp_path / "preds.csv"
    again = f"{trained}/../{trained.name}"
    capsys.readouterr()
    assert _exit_code(predict_cli.main, [str(trained), again, str(photo), f"out={out}", "--quiet"]) == 0
    assert capsys.readouterr().err == f"petl-predict: note: {again} was given more than once: predicted once\n"
    with open(out, newline="") as handle:
        assert [row["path"] for row in csv.DictReader(handle)] == [str(photo)]


def test_test_and_val_images_that_are_copies_of_training_images_are_named(tmp_path, caplog):
    # A photo copied into test/ too, or twice into train/ (one copy then held out as val), was scored as unseen:
    # the accuracy counted images the run trained on, and nothing said so.
    root = make_folder(tmp_path / "images", classes=CLASSES, train=5)
    (root / "test" / "b" / "copy.png").write_bytes((root / "train" / "a" / "003.png").read_bytes())
    for index in range(5):  # every training image of b twice: whichever is held out, its twin trains
        (root / "train" / "b" / f"twin{index}.png").write_bytes(
            (root / "train" / "b" / f"{index:03d}.png").read_bytes()
        )
    argv = ["method=lora", "data=folder", f"data.root={root}", *TINY_MODEL, "train.epochs=1"]
    with caplog.at_level(logging.WARNING, logger="petl"):
        petl.run.train(petl.run.default_config([*argv, f"output_dir={tmp_path / 'run'}"]))
    said = [record.getMessage() for record in caplog.records if "byte-for-byte" in record.getMessage()]
    test = root / "test" / "b" / "copy.png"
    assert len(said) == 2 and said[1].startswith(
        f"1 of the 5 test images is a byte-for-byte copy of a training image "
        f"(first: {test} = {root / 'train' / 'a' / '003.png'}): "
    ), said
    assert said[0].startswith("2 of the 3 val images are byte-for-byte copies of training images"), said


def test_a_class_written_with_other_unicode_code_points_than_trains_is_said_to_be_so(tmp_path):
    # test/cafe + combining accent (macOS's NFD) against train/'s one-letter é: refused naming a class that printed
    # exactly as train/'s ("test has classes that train/ lacks: café"), with nothing to tell them apart.
    nfc, nfd = "caf\u00e9", "cafe\u0301"
    for split, name in (("train", nfc), ("train", "dog"), ("test", nfd)):
        for index in range(2):
            _png(tmp_path / "images" / split / name / f"{index}.png", size=8 + index)
    folder._scan.cache_clear()
    said = f"lacks: {nfd} ({nfd} is train/'s {nfc} written with other Unicode code points, {nfd!a} against {nfc!a}"
    with pytest.raises(ValueError, match=re.escape(said)):
        folder.describe_folder(str(tmp_path / "images"))
    # petl-predict's folder of new labelled images says the same of a class the run knows in the other form.
    # Its remedy renames the test folder's class: a trained run's classes cannot be renamed ("one of the two").
    said = folder.lookalike([nfd], ["dog", nfc], "the run's")
    assert said.startswith(f" ({nfd} is the run's {nfc} written") and said.endswith(f"retype {nfd} as the run's one)")
    assert (
        folder.lookalike(["Dog"], ["dog"], "the run's")
        == " ('Dog' is the run's 'dog' in other letter case: rename it 'dog')"
    )


def test_a_training_image_in_two_class_folders_is_named(tmp_path, caplog):
    # The same photo in cat/ and kitten/ trained toward both labels without a word.
    root = make_folder(tmp_path / "images", classes=CLASSES, train=5, test=0)
    (root / "train" / "b" / "clash.png").write_bytes((root / "train" / "a" / "002.png").read_bytes())
    train = petl_data.build_dataset("folder", "train800val200", image_size=8, root=str(root))
    assert images.conflicts(train) == [(str(root / "train" / "b" / "clash.png"), str(root / "train" / "a" / "002.png"))]
    (root / "val" / "a").mkdir(parents=True)  # a val/ of its own: every training image trains
    (root / "val" / "a" / "0.png").write_bytes((root / "train" / "a" / "000.png").read_bytes())
    (root / "val" / "b").mkdir()
    argv = ["method=lora", "data=folder", f"data.root={root}", *TINY_MODEL, "train.epochs=1"]
    with caplog.at_level(logging.WARNING, logger="petl"):
        petl.run.train(petl.run.default_config([*argv, f"output_dir={tmp_path / 'run'}"]))
    said = [record.getMessage() for record in caplog.records if "also in another class" in record.getMessage()]
    assert said == [
        f"1 training image is also in another class (first: {root / 'train' / 'b' / 'clash.png'} = "
        f"{root / 'train' / 'a' / '002.png'}): the run learns two labels for one image; keep each image in its one "
        "class folder"
    ], said
