"""data=hf on datasets as they come: splits whose ClassLabels differ, classes train lacks, columns that cannot be used,
missing images, a folder of parquet files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import tiny_run
from PIL import Image

from petl import data as petl_data
from petl.cli import run as cli
from petl.data import images

datasets = pytest.importorskip("datasets")

TINY_MODEL = [o for o in tiny_run(depth=1) if not o.startswith("data")]


def _split(labels: list, label: object, images: list | None = None) -> datasets.Dataset:
    rng = np.random.default_rng(len(labels))
    if images is None:
        images = [Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)) for _ in labels]
    features = datasets.Features({"image": datasets.Image(), "label": label})
    return datasets.Dataset.from_dict({"image": images, "label": labels}, features=features)


def _save(root: Path, **splits: datasets.Dataset) -> str:
    datasets.DatasetDict(splits).save_to_disk(str(root))
    return str(root)


CAT_DOG = datasets.ClassLabel(names=["cat", "dog"])


def test_a_test_split_whose_classlabel_orders_the_names_otherwise_is_matched_by_name(tmp_path):
    # Splits encoded apart (class_encode_column per split) can number the classes otherwise: test's 0 is "dog" here.
    test = _split([0, 0, 1], datasets.ClassLabel(names=["dog", "cat"]))
    root = _save(tmp_path / "saved", train=_split([0, 1] * 5, CAT_DOG), test=test)
    assert petl_data.describe_dataset("hf", root=root).class_names == ("cat", "dog")
    assert petl_data.build_dataset("hf", "test", image_size=8, root=root).labels == [1, 1, 0]


@pytest.mark.parametrize(
    ("train", "test", "extra"),
    [
        (_split(["a", "b"] * 3, datasets.Value("string")), _split(["a", "c"], datasets.Value("string")), "c"),
        (_split([0, 1] * 3, CAT_DOG), _split([0, 2], datasets.ClassLabel(names=["cat", "dog", "cow"])), "cow"),
    ],
)
def test_a_split_with_a_class_train_lacks_is_refused_naming_it(tmp_path, train, test, extra):
    root = _save(tmp_path / "saved", train=train, test=test)
    with pytest.raises(ValueError, match=f"test split has classes that train lacks: {extra}; add rows of them"):
        petl_data.describe_dataset("hf", root=root)


def test_columns_and_splits_that_cannot_be_used_are_one_line_each(tmp_path):
    train = _split([0, 1] * 3, CAT_DOG)
    both = _save(tmp_path / "both", train=train, val=_split([0, 1], CAT_DOG), validation=_split([1, 0], CAT_DOG))
    with pytest.raises(ValueError, match="has splits validation and val, both validation splits: keep one"):
        petl_data.describe_dataset("hf", root=both)
    unlabelled = datasets.Dataset.from_dict(
        {"image": train["image"][:2]}, features=datasets.Features({"image": datasets.Image()})
    )
    no_label = _save(tmp_path / "no_label", train=train, test=unlabelled)
    with pytest.raises(ValueError, match=r"test split has no column 'label' \(its columns are image\)"):
        petl_data.describe_dataset("hf", root=no_label)
    with pytest.raises(ValueError, match="'image' is both the image and the label column"):
        petl_data.describe_dataset("hf", root=no_label, label_column="image")


def test_a_dev_split_is_the_validation_split(tmp_path):
    # Several hub datasets name their held-out split "dev".
    root = _save(tmp_path / "saved", train=_split([0, 1] * 5, CAT_DOG), dev=_split([1, 1, 0], CAT_DOG))
    assert petl_data.build_dataset("hf", "val200", image_size=8, root=root).labels == [1, 1, 0]
    both = _save(
        tmp_path / "both", train=_split([0, 1] * 5, CAT_DOG), dev=_split([1, 0], CAT_DOG), val=_split([0], CAT_DOG)
    )
    with pytest.raises(ValueError, match="has splits val and dev, both validation splits: keep one"):
        petl_data.describe_dataset("hf", root=both)


def test_a_label_column_of_lists_is_one_line_with_exit_2(tmp_path, capsys):
    several = _split([[0], [1], [0, 1], [1]] * 2, datasets.Sequence(datasets.Value("int64")))
    root = _save(tmp_path / "saved", train=several)
    argv = ["method=lora", "data=hf", f"data.root={root}", *TINY_MODEL, f"output_dir={tmp_path / 'run'}"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and "label column 'label' holds List values" in err


def test_a_row_without_an_image_and_a_missing_file_are_named_as_such(tmp_path):
    png = tmp_path / "0.png"
    Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(png)
    images = [str(png)] * 6
    images[1], images[4] = None, str(tmp_path / "gone.png")
    table = datasets.Dataset.from_dict({"path": images, "label": ["a", "b"] * 3})
    root = _save(tmp_path / "saved", train=table)
    with pytest.raises(petl_data.BadImagesError) as error:
        petl_data.build_dataset("hf", "train800val200", image_size=8, root=root, options={"image_column": "path"})
    assert "train[1] (no image ('path' is None))" in str(error.value)
    assert f"train[4] {tmp_path / 'gone.png'} (no such file)" in str(error.value)


def test_a_folder_of_parquet_files_as_the_hub_ships_them_loads(tmp_path):
    (tmp_path / "data").mkdir()
    _split([0, 1] * 5, CAT_DOG).to_parquet(str(tmp_path / "data" / "train-00000-of-00001.parquet"))
    _split([1, 0], CAT_DOG).to_parquet(str(tmp_path / "data" / "test-00000-of-00001.parquet"))
    info = petl_data.describe_dataset("hf", root=str(tmp_path))
    assert info.class_names == ("cat", "dog") and "test" in info.splits
    assert petl_data.build_dataset("hf", "test", image_size=8, root=str(tmp_path)).labels == [1, 0]


def test_a_dataset_without_a_train_split_is_told_the_split_names_petl_reads(tmp_path, capsys):
    # save_to_disk keeps a user's own split names ("training", "eval"); the line says how to rename them.
    root = _save(tmp_path / "saved", training=_split([0, 1] * 3, CAT_DOG), eval=_split([1, 0], CAT_DOG))
    argv = ["method=lora", "data=hf", f"data.root={root}", *TINY_MODEL, f"output_dir={tmp_path / 'run'}"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1
    assert "has splits training, eval, and no train split: petl reads train, validation (or val, valid, dev)" in err
    assert "DatasetDict(train=d['training'], ...).save_to_disk(PATH)" in err


def test_a_test_row_holding_a_training_rows_image_is_found_as_a_copy(tmp_path):
    # petl-run warns of such rows (their accuracy counts images the run trained on), as of a folder's copied files.
    train = _split([0, 1] * 5, CAT_DOG)
    test = _split([1, 0, 1], CAT_DOG, images=[train[3]["image"], *_split([0, 1], CAT_DOG)["image"]])
    root = _save(tmp_path / "saved", train=train, test=test)
    train, test = (
        petl_data.build_dataset("hf", split, image_size=8, root=root) for split in ("train800val200", "test")
    )
    assert images.copies(test, train) == [("test[0]", "train[3]")]


def test_a_finished_runs_check_hashes_the_rows_without_decoding_them(tmp_path, monkeypatch):
    # As a folder's files (test_eval_split_fingerprint): the check compares fingerprints alone, nothing decoded.
    from petl.data import hf
    from petl.train import output_dir

    root = _save(tmp_path / "saved", train=_split([0, 1] * 5, CAT_DOG), test=_split([1, 0, 1], CAT_DOG))
    built = petl_data.build_dataset("hf", "test", image_size=8, root=root)
    monkeypatch.setattr(hf, "decode_image", lambda data: pytest.fail("a fingerprint check decoded an image"))
    output_dir._data_fingerprint.cache_clear()
    assert output_dir._data_fingerprint("hf", "test", root, ()) == built.fingerprint


def _refusal(argv: list[str], capfd) -> str:
    capfd.readouterr()
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    err = capfd.readouterr().err
    assert stop.value.code == 2, err
    return err


def test_a_refusal_after_an_imagefolder_build_is_the_only_line_printed(tmp_path, capfd):
    # datasets builds a folder of loose images (its "Generating train split" bar) before petl sees it has no labels.
    for index in range(4):
        Image.fromarray(np.full((8, 8, 3), index, dtype=np.uint8)).save(tmp_path / f"{index}.png")
    argv = ["method=lora", "data=hf", f"data.root={tmp_path}", *TINY_MODEL, f"output_dir={tmp_path / 'run'}"]
    err = _refusal(argv, capfd)
    assert err.startswith("petl-run: error: hf:") and err.count("\n") == 1 and "\r" not in err, err


def test_datasets_lines_are_held_until_petl_accepts_the_dataset(tmp_path, monkeypatch, capfd, caplog):
    # As a hub id cached here loads offline: datasets logs which cached copy it took and draws a bar, then petl refuses
    # its float labels.  The same lines where petl accepts the copy: logged after its checks, the bar drawn once late.
    from petl.data import hub

    floats = _split([0.0, 1.0] * 3, datasets.Value("float32"))
    accepted = {"train": _split([0, 1] * 3, CAT_DOG)}

    def cached_copy(root: str) -> datasets.DatasetDict:
        datasets.utils.logging.get_logger("datasets.load").warning(f"Using the latest cached version of {root}")
        for _ in datasets.utils.tqdm(range(3), desc="Generating train split"):
            pass
        return datasets.DatasetDict(accepted)

    monkeypatch.setattr(hub, "reachable", lambda: False)
    monkeypatch.setattr(datasets, "load_dataset", cached_copy)
    accepted["train"] = floats
    argv = ["method=lora", "data=hf", "data.root=someone/floats", *TINY_MODEL, f"output_dir={tmp_path / 'run'}"]
    err = _refusal(argv, capfd)
    assert err.startswith("petl-run: error: hf: label column 'label' holds float32") and err.count("\n") == 1, err
    accepted["train"] = _split([0, 1] * 3, CAT_DOG)
    monkeypatch.setattr(hub, "PROGRESS_DELAY", 0.0)
    with caplog.at_level("WARNING", logger="datasets"):
        assert petl_data.describe_dataset("hf", root="someone/cats").class_names == ("cat", "dog")
    assert "Generating train split" in capfd.readouterr().err
    assert "Using the latest cached version of someone/cats" in caplog.text


def test_a_fgvc_hub_copy_petl_refuses_logs_no_datasets_lines_before_the_reason(monkeypatch, caplog):
    from petl.data import hub

    def cached_copy(hub_id: str) -> datasets.DatasetDict:
        datasets.utils.logging.get_logger("datasets.load").warning(f"Using the latest cached version of {hub_id}")
        return datasets.DatasetDict({"train": _split([0, 1], CAT_DOG)})

    monkeypatch.setattr(hub, "reachable", lambda: False)
    monkeypatch.setattr(datasets, "load_dataset", cached_copy)
    with caplog.at_level("WARNING", logger="datasets"):
        with pytest.raises(petl_data.DatasetUnavailableError, match="has splits .'train'., expected train and test"):
            petl_data.build_dataset("fgvc/cub", "test", image_size=8)
    assert "Using the latest cached version" not in caplog.text


@pytest.mark.parametrize("fault", ["splits", "classes", "empty", "text"])
def test_a_fgvc_hub_copy_petl_cannot_use_is_data_out_of_reach_in_one_line(tmp_path, monkeypatch, capfd, fault):
    # Wrong splits exited 1 (unavailable data) and a wrong class count 2 (bad input), though both are petl's own hub
    # copy, which the user did not give and cannot fix: both exit 1 now, and the line says to use a local copy.
    # Empty splits and labels of text raised from max() and >= (exit 2 naming nothing, and a traceback).
    splits = {"train": _split([0, 1], CAT_DOG)}
    if fault == "classes":  # fgvc/cub has 200 classes
        splits["test"] = _split([1, 0], CAT_DOG)
    elif fault == "empty":
        splits = {"train": _split([], CAT_DOG), "test": _split([], CAT_DOG)}
    elif fault == "text":
        splits = {name: _split(["cat", "dog"], datasets.Value("string")) for name in ("train", "test")}
    monkeypatch.setattr(datasets, "load_dataset", lambda hub_id, *args, **kwargs: datasets.DatasetDict(splits))
    capfd.readouterr()
    with pytest.raises(SystemExit) as stop:
        cli.main(["method=linear", "data=fgvc/cub", *TINY_MODEL, f"output_dir={tmp_path / 'run'}"])
    err = capfd.readouterr().err
    assert stop.value.code == 1 and err.count("\n") == 1, err
    why = {
        "splits": "has splits ['train'], expected train and test",
        "classes": "has 2 classes (labels 0..1), expected 200 classes",
        "empty": "has 0 classes, expected 200 classes",
        "text": "has labels that are not class numbers ('cat', 'dog'), expected 200 classes",
    }[fault]
    assert err.startswith(
        f"petl-run: error: fgvc/cub is unavailable: hub copy bentrevett/caltech-ucsd-birds-200-2011 {why}"
    )
    assert "Use a local copy instead: pass root=/path (command line: data.root=/path)" in err


def test_an_image_column_that_holds_no_images_is_one_line(tmp_path, capsys):
    # data.image_column naming a column of numbers, or of several images per row, failed in datasets' cast with a
    # pyarrow or numpy traceback (exit 1); file bytes and pixel arrays are images and load.
    pictures = _split([0, 1] * 3, CAT_DOG)["image"]
    table = datasets.Dataset.from_dict(
        {"image": pictures, "count": [3] * 6, "views": [[p] for p in pictures], "label": [0, 1] * 3},
        features=datasets.Features(
            {
                "image": datasets.Image(),
                "count": datasets.Value("int64"),
                "views": datasets.Sequence(datasets.Image()),
                "label": CAT_DOG,
            }
        ),
    )
    root = _save(tmp_path / "saved", train=table)
    for column, holds in (("count", "int64 values"), ("views", "lists of images")):
        argv = ["method=lora", "data=hf", f"data.root={root}", f"data.image_column={column}", *TINY_MODEL]
        err = _refusal([*argv, f"output_dir={tmp_path / 'run'}"], capsys)
        assert err.count("\n") == 1 and f"image column {column!r} holds {holds}, not one image per row" in err, err
    pixels = datasets.Dataset.from_dict({"pixels": [np.asarray(p).tolist() for p in pictures], "label": [0, 1] * 3})
    as_arrays = _save(tmp_path / "arrays", train=pixels)
    options = {"image_column": "pixels"}
    built = petl_data.build_dataset("hf", "train800val200", image_size=8, root=as_arrays, options=options)
    assert len(built) == 6 and built[0][0].shape == (3, 8, 8)


def test_datasets_lines_are_held_by_one_thread_at_a_time_and_restored(caplog):
    # Two threads' blocks overlapping (A in, B in, A out, B out): B saved A's holding list as datasets' handlers and
    # put it back on leaving, so every later datasets line went to that list, and every bar was drawn late, for good.
    import logging
    import threading

    from petl.data import hub

    library = logging.getLogger("datasets")
    before = (library.handlers[:], library.propagate, datasets.utils.tqdm.__init__)
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def first() -> None:
        with hub.datasets_quiet_until_accepted():
            a_in.set()
            b_in.wait(timeout=1)  # B is let in only once A is out: the wait runs out
        a_out.set()

    def second() -> None:
        a_in.wait()
        with hub.datasets_quiet_until_accepted():
            b_in.set()
            a_out.wait(timeout=5)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert (library.handlers[:], library.propagate, datasets.utils.tqdm.__init__) == before
    with caplog.at_level("WARNING", logger="datasets"):
        datasets.utils.logging.get_logger("datasets.load").warning("a line after both blocks")
    assert "a line after both blocks" in caplog.text


def test_an_image_column_of_bytes_and_path_records_loads(tmp_path):
    # How an Image is stored, {bytes, path} per row, where the Image type was not recorded (a Parquet file written by
    # pandas): datasets casts it to an Image, and it loaded, until the check for an image column refused it as
    # "dict values".
    pictures = _split([0, 1] * 3, CAT_DOG).cast_column("image", datasets.Image(decode=False))["image"]
    record = {"bytes": datasets.Value("binary"), "path": datasets.Value("string")}
    table = datasets.Dataset.from_dict(
        {"image": pictures, "label": [0, 1] * 3}, features=datasets.Features({"image": record, "label": CAT_DOG})
    )
    root = _save(tmp_path / "saved", train=table)
    built = petl_data.build_dataset("hf", "train800val200", image_size=8, root=root)
    assert len(built) == 6 and built[0][0].shape == (3, 8, 8)
