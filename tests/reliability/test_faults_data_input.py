"""Faults and bad input, data input: own folders and data=hf datasets whose refusals named no file or remedy.

Each test is one fault found by feeding awkward folders (a class of GIFs, an empty val/, a class in another letter
case) and small ``datasets`` datasets built in a temporary folder through ``describe_dataset``, ``build_dataset``
and petl-run's main.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from test_faults_predict_data_report import TINY_MODEL, _exit_code, make_folder

from petl import data as petl_data
from petl.cli import run as cli
from petl.data import folder

datasets = pytest.importorskip("datasets")

CLASSES = ("a", "b")
CAT_DOG = datasets.ClassLabel(names=["cat", "dog"])


def _refusal(root: Path, capsys) -> str:
    """petl-run's one line on ``root`` (exit 2 asserted)."""
    folder._scan.cache_clear()
    argv = ["method=lora", "data=folder", f"data.root={root}", *TINY_MODEL, f"output_dir={root.parent / 'run'}"]
    capsys.readouterr()
    assert _exit_code(cli.main, argv) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1, error
    return error


def test_a_class_folder_of_files_that_are_not_images_names_them_in_its_refusal(tmp_path, capsys):
    # train/b of GIFs was refused as holding no images, the list of extensions alone: the warning naming its files
    # comes after the refusal, so nobody was told the GIFs were there and why they did not count.
    root = make_folder(tmp_path / "images", classes=CLASSES, test=0)
    for path in (root / "train" / "b").iterdir():
        path.unlink()
    Image.fromarray(np.zeros((8, 8), np.uint8)).convert("P").save(root / "train" / "b" / "x.gif")
    error = _refusal(root, capsys)
    assert error.endswith(
        f"{root / 'train' / 'b'} holds no images ({', '.join(folder.IMAGE_EXTENSIONS)}), only x.gif: "
        "convert them or remove it"
    ), error


@pytest.mark.parametrize(
    ("split", "without"), [("val", "val200 is 20% of each class"), ("test", "the run reports no test")]
)
def test_an_empty_val_or_test_folder_says_what_to_do(tmp_path, capsys, split, without):
    # An empty val/ (made by a script, its images moved away) was refused as 'holds no images in class
    # sub-folders', with no word of what to do about it.
    root = make_folder(tmp_path / "images", classes=CLASSES, test=0)
    (root / split / "a").mkdir(parents=True)
    error = _refusal(root, capsys)
    assert f"put images in {root / split}/<class name>/ or remove {root / split} (without it, {without}" in error, error


def test_a_class_train_lacks_says_what_to_do_and_one_in_other_letter_case_or_spacing_is_said_to_be_so(tmp_path, capsys):
    # 'val has classes that train/ lacks: A' said neither what to do nor that train/ has an a (a folder renamed on
    # one machine and not on another; on macOS and Windows A/ and a/ are one folder).
    root = make_folder(tmp_path / "images", classes=CLASSES, test=0)
    for name in ("A", "b"):
        (root / "val" / name).mkdir(parents=True)
        Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(root / "val" / name / "0.png")
    assert _refusal(root, capsys).endswith(
        f"{root / 'val'} has classes that train/ lacks: A ('A' is train/'s 'a' in other letter case: rename it 'a')"
    )
    (root / "val" / "A").rename(root / "val" / "a ")  # a space at the end: printed as train/'s a
    assert _refusal(root, capsys).endswith("lacks: a  ('a ' is train/'s 'a' but for spaces or case: rename it 'a')")
    (root / "val" / "a ").rename(root / "val" / "c")
    error = _refusal(root, capsys)
    assert error.endswith("has classes that train/ lacks: c; add them to train/ or remove them from val/"), error
    assert not re.search(r"letter case|spaces|Unicode", error)


def _rows(labels: list, label: object) -> datasets.Dataset:
    rng = np.random.default_rng(len(labels))
    pictures = [Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)) for _ in labels]
    features = datasets.Features({"image": datasets.Image(), "label": label})
    return datasets.Dataset.from_dict({"image": pictures, "label": labels}, features=features)


def test_hf_with_one_row_per_class_and_no_validation_split_is_refused(tmp_path, capsys):
    # data=folder refuses it; data=hf held nothing out, and the run trained on with an empty val200 ('val -').
    root = tmp_path / "saved"
    datasets.DatasetDict(train=_rows([0, 1], CAT_DOG)).save_to_disk(str(root))
    argv = ["method=lora", "data=hf", f"data.root={root}", *TINY_MODEL, f"output_dir={tmp_path / 'run'}"]
    capsys.readouterr()
    assert _exit_code(cli.main, argv) == 2
    error = capsys.readouterr().err.strip()
    assert error.endswith(
        f"hf: {root}'s train split has at most one row per class, so none can be held out for validation: add a "
        "validation split or more training rows"
    ), error
    assert not (tmp_path / "run" / "result.json").exists()


def test_hf_imagefolder_rows_that_cannot_be_used_are_named_by_file(tmp_path):
    # An imagefolder's empty file was named 'train[3]', a row number of a listing the user never sees.
    for name in CLASSES:
        for index in range(3):
            path = tmp_path / "images" / "train" / name / f"{index}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.full((8, 8, 3), 40 * index, np.uint8)).save(path)
    empty = tmp_path / "images" / "train" / "b" / "2.png"
    empty.write_bytes(b"")
    with pytest.raises(petl_data.BadImagesError) as error:
        petl_data.build_dataset("hf", "train800val200", image_size=8, root=str(tmp_path / "images"))
    assert re.search(rf"train\[\d\] {re.escape(str(empty))} \(empty file\)$", str(error.value)), error.value


def test_hf_float_labels_are_refused_not_made_classes_named_by_their_values(tmp_path):
    # A float32 label column of 0.0 / 1.0 (a pandas column that held a NaN) trained classes named '0.0' and '1.0';
    # a regression target made one class per value.
    root = tmp_path / "saved"
    datasets.DatasetDict(train=_rows([0.0, 1.0] * 3, datasets.Value("float32"))).save_to_disk(str(root))
    with pytest.raises(ValueError, match=r"^hf: label column 'label' holds float32 numbers, not classes .*: cast it"):
        petl_data.describe_dataset("hf", root=str(root))


def test_hf_a_split_class_train_lacks_says_what_to_do(tmp_path):
    # 'test split has classes that train lacks: Dog' said neither what to do nor that train has a dog.
    root = tmp_path / "saved"
    strings = datasets.Value("string")
    datasets.DatasetDict(train=_rows(["cat", "dog"] * 3, strings), test=_rows(["Dog"], strings)).save_to_disk(str(root))
    with pytest.raises(
        ValueError, match=r"lacks: Dog \('Dog' is train's 'dog' in other letter case: rename it 'dog'\)"
    ):
        petl_data.describe_dataset("hf", root=str(root))
    datasets.DatasetDict(train=_rows(["cat", "dog"] * 3, strings), test=_rows(["cow"], strings)).save_to_disk(
        str(tmp_path / "other")
    )
    with pytest.raises(ValueError, match=r"lacks: cow; add rows of them to train or remove them from test$"):
        petl_data.describe_dataset("hf", root=str(tmp_path / "other"))


def test_hf_a_row_changed_since_the_build_is_named_when_read_again(tmp_path, monkeypatch):
    # Above the memory limit a row is decoded again on access: a file emptied since the build raised a bare
    # 'ValueError: empty file' naming no row and no file (a FileListDataset names its file there).
    monkeypatch.setattr("petl.data.hf.DECODED_MEMORY_LIMIT", 0)
    for name in CLASSES:
        for index in range(3):
            path = tmp_path / "images" / "train" / name / f"{index}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.full((8, 8, 3), 40 * index, np.uint8)).save(path)
    train = petl_data.build_dataset("hf", "train800val200", image_size=8, root=str(tmp_path / "images"))
    first = Path(train.rows[0][0][train.rows[0][2]]["image"]["path"])
    first.write_bytes(b"")
    with pytest.raises(petl_data.BadImagesError, match=rf"train\[0\] {re.escape(str(first))} \(empty file\)$"):
        train[0]


def test_hf_a_split_of_integer_labels_beside_trains_classlabel_is_told_to_cast_them(tmp_path):
    # A test split encoded apart as integers (train's class_encode_column alone) was told its classes 0 and 1 were
    # classes train lacks, to add rows of them to train: the cast that makes them train's cat and dog was not said.
    root = tmp_path / "saved"
    datasets.DatasetDict(train=_rows([0, 1] * 3, CAT_DOG), test=_rows([1, 0], datasets.Value("int64"))).save_to_disk(
        str(root)
    )
    with pytest.raises(ValueError) as error:
        petl_data.describe_dataset("hf", root=str(root))
    said = str(error.value)
    assert said.endswith(
        "lacks: 0, 1; its 'label' holds int64 values where train's holds a ClassLabel: cast it to train's, "
        "d['test'] = d['test'].cast_column('label', d['train'].features['label'])"
    ), said
    # The cast it names is enough.
    saved = datasets.load_from_disk(str(root))
    saved["test"] = saved["test"].cast_column("label", saved["train"].features["label"])
    saved.save_to_disk(str(tmp_path / "cast"))
    assert petl_data.build_dataset("hf", "test", image_size=8, root=str(tmp_path / "cast")).labels == [1, 0]


def test_hf_a_folder_of_loose_images_says_to_put_them_in_class_folders(tmp_path):
    # An imagefolder without class folders has an image column alone: petl said to name the label column with
    # data.label_column=COLUMN, where there is none to name.
    (tmp_path / "images" / "train").mkdir(parents=True)
    for index in range(4):
        Image.fromarray(np.full((8, 8, 3), 40 * index, np.uint8)).save(tmp_path / "images" / "train" / f"{index}.png")
    root = tmp_path / "images"
    with pytest.raises(
        ValueError, match=rf"^hf: {re.escape(str(root))} has no label column, only the images \('image'\)"
    ):
        petl_data.describe_dataset("hf", root=str(root))


def test_two_training_classes_that_print_alike_are_refused_and_letter_case_is_not_folded(tmp_path, capsys):
    # train/café/ made on macOS (e and a combining accent) beside train/café/ made elsewhere were two classes whose
    # predictions, confusion matrices and reports read the same; so were cat/ and "cat "/.
    root = make_folder(tmp_path / "images", classes=("caf\u00e9", "cafe\u0301", "b"), test=0)
    error = _refusal(root, capsys)
    assert "has class folders cafe\u0301 and caf\u00e9, which print alike but are two classes" in error, error
    assert "('cafe\\u0301' against 'caf\\xe9'" in error and error.endswith("merge them into one"), error
    spaced = make_folder(tmp_path / "spaced", classes=("cat", "cat ", "b"), test=0)
    assert "class folders cat and cat , which print alike" in _refusal(spaced, capsys)
    # A and a may be classes of their own (EMNIST's letters): kept.
    cased = make_folder(tmp_path / "cased", classes=("A", "a", "b"), test=0)
    assert petl_data.describe_dataset("folder", root=str(cased)).class_names == ("A", "a", "b")


def test_string_labels_that_print_alike_are_refused(tmp_path):
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)) for _ in range(6)]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("string")})
    table = datasets.Dataset.from_dict({"image": images, "label": ["caf\u00e9", "cafe\u0301", "b"] * 2}, features)
    datasets.DatasetDict(train=table).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(ValueError, match=r"column 'label' has classes cafe\u0301 and caf\xe9, which print alike"):
        petl_data.describe_dataset("hf", root=str(tmp_path / "saved"))
