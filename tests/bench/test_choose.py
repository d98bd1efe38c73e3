"""Which method for my data: ``petl-bench suite=choose data=folder data.root=PATH`` end to end (issue 37).

A generated image folder becomes the suite's task: the cost is said before training, the leaderboard and the
answer paragraph are written, the named run predicts, and an edited folder never mixes with the old runs.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
from conftest import tiny_run
from test_own_data import CLASSES, make_folder

import petl
from petl.bench import choice, own_data
from petl.bench.estimate import ESTIMATE_FILE
from petl.cli import bench as bench_cli
from petl.utils.errors import USAGE_ERROR

# Whole sweeps on a generated folder: the inner loop (pytest -m "not slow") leaves the module out.
pytestmark = pytest.mark.slow

# The tiny random-init backbone of the fast tests at its own 32 px (the suite's 224 px would be DINOv2's), one epoch.
TINY = [o for o in tiny_run(depth=1, epochs=1) if not o.startswith("data")] + ["model.img_size=32", "progress=false"]


def bench(*args: str) -> int:
    """``petl-bench`` in this process; its exit status."""
    try:
        return bench_cli.main(list(args))
    except SystemExit as stop:
        return int(stop.code or 0)


def test_choose_runs_the_suite_on_a_folder_and_names_a_run_that_predicts(tmp_path, capsys):
    photos = make_folder(tmp_path / "photos", train=8, test=3)
    out = tmp_path / "out"
    status = bench(
        "suite=choose", "data=folder", f"data.root={photos}", "methods=linear,lora,full", f"output_dir={out}",
        "budget.params=10k", *TINY, "--yes",
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert status == 0, printed
    # The cost came first: runs, images per run, and a measured wall time.
    assert re.search(r"cost: 3 experiments: 4 selection trials \(\d+ train / \d+ val images each\) \+ 6 final", printed)
    assert "estimated wall time on this machine" in printed and "by the timed steps' spread" in printed
    # Each measurement is said as it starts: the estimate is not silent while it builds the models.
    assert "petl-bench: measuring linear (1/3)" in printed and "petl-bench: measuring full (3/3)" in printed
    estimate = json.loads((out / ESTIMATE_FILE).read_text())
    assert estimate["runs"] == 10 and estimate["seconds"] > 0 and estimate["measured_seconds"] > 0
    assert estimate["measured_runs"] == 10  # what choice.md's cost line says the sweep trained

    with (out / "leaderboard.csv").open() as f:
        rows = {row["experiment"]: row for row in csv.DictReader(f)}
    assert set(rows) == {"linear", "lora", "full"}
    for name in ("leaderboard.md", "leaderboard.html", "pareto.png", own_data.DATA_FILE):
        assert (out / name).is_file()
    # Full fine-tuning trains every weight of the tiny ViT (over 10k): the best within budget is linear or lora.
    within = {k: float(v["folder_top1_mean"]) for k, v in rows.items() if float(v["trainable_M"]) * 1e6 <= 10e3}
    assert set(within) == {"linear", "lora"}
    best = max(within, key=lambda k: (within[k], -list(within).index(k)))
    paragraph = (out / choice.CHOICE_FILE).read_text()
    assert "at most 10.0 k trainable parameters" in paragraph and "Over the budget: full" in paragraph
    named = re.search(r"\*\*(\w+)\*\* reaches ([\d.]+) %", paragraph)
    assert named is not None and float(named.group(2)) == pytest.approx(max(within.values()), abs=0.01)
    assert named.group(1) in within and within[named.group(1)] == within[best]
    assert "runner-up" in paragraph and "**Cost**: estimated" in paragraph
    # The rank test decides, with the seeds as blocks (one task): issue 50.
    assert re.search(
        r"(cannot be told apart|differ) on this data \(.*each of the 2 seeds a block \(one task\)", paragraph
    )
    # A folder is no benchmark task (issue 52): no published ordering, no benchmark groups, one task in the singular.
    board_md = (out / "leaderboard.md").read_text()
    assert "Rank correlation with the published" not in board_md and "groups —" not in board_md
    assert "1 task," in board_md and "1 tasks" not in board_md
    record = json.loads((out / "folder" / named.group(1) / "seed0" / "result.json").read_text())
    assert record["split"] == "train800val200" and record["split_meaning"].startswith("train800val200: every")

    # The run to use: the best's, or the smaller's where the two cannot be told apart (over 2 seeds they cannot).
    smaller = re.search(r"; (\w+) is the smaller\.", paragraph)
    used = re.search(r"\. Use (\w+): ", paragraph).group(1)
    assert used == (smaller.group(1) if smaller else named.group(1))
    run_dir = Path(re.search(r"`petl-predict (\S+) IMAGES`", paragraph).group(1))
    assert run_dir == out / "folder" / used / "seed0"
    loaded = petl.load_run(run_dir)
    image = next((photos / "test" / CLASSES[0]).glob("*.png"))
    from PIL import Image

    logits = loaded.model(loaded.preprocess(Image.open(image).convert("RGB")).unsqueeze(0))
    assert logits.shape == (1, len(CLASSES)) and loaded.class_names == list(CLASSES)

    # Everything done: the same command trains nothing, estimates nothing to train, and answers again.
    assert bench(*["suite=choose", "data=folder", f"data.root={photos}", "methods=linear,lora,full",
                   f"output_dir={out}", *TINY]) == 0  # fmt: skip
    again = capsys.readouterr().out
    assert "every run of the 3 experiments has finished, so nothing trains" in again
    assert "10 already done, 0 trained" in again and "estimated wall time" not in again


def test_an_edited_folder_is_kept_apart_from_its_old_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    photos = make_folder(tmp_path / "photos", train=6, test=2)
    args = ["suite=choose", "data=folder", f"data.root={photos}", "methods=linear", "seeds=0", *TINY]
    assert bench(*args, "--yes") == 0
    (old,) = (tmp_path / "runs/bench/choose").iterdir()
    result = old / "folder/linear/seed0/result.json"
    before = result.read_bytes()
    capsys.readouterr()

    # One image changes: another version of the data, so another folder; pytest's stdin is not a terminal.
    victim = next((photos / "train" / CLASSES[1]).glob("*.png"))
    make_folder(tmp_path / "other", train=1, test=0, seed=5)
    victim.write_bytes(next((tmp_path / "other/train" / CLASSES[1]).glob("*.png")).read_bytes())
    assert bench(*args) == USAGE_ERROR
    said = capsys.readouterr()
    assert "pass --yes to train without asking" in said.err
    # Said before the measuring (minutes on a real backbone), which printed its lines first.
    assert "measuring" not in said.out and "estimated wall time" not in said.out
    folders = sorted((tmp_path / "runs/bench/choose").iterdir())
    assert len(folders) == 2 and old in folders
    new = next(f for f in folders if f != old)
    assert json.loads((new / own_data.DATA_FILE).read_text())["fingerprint"][:12] == new.name.split("-")[1]
    assert not any(new.rglob("result.json")) and result.read_bytes() == before

    # Pointing output_dir at the old runs is refused in one line, naming both versions.
    assert bench(*args, f"output_dir={old}", "--yes") == USAGE_ERROR
    error = capsys.readouterr().err.strip()
    assert "holds runs on another version" in error and old.name.split("-")[1] in error
    assert len(error.splitlines()) == 1
    assert result.read_bytes() == before


def test_a_folder_without_a_test_split_is_refused_before_training(tmp_path, capsys):
    photos = make_folder(tmp_path / "photos", train=4, test=0)
    assert bench("suite=choose", "data=folder", f"data.root={photos}", f"output_dir={tmp_path}/out", *TINY) == 2
    assert "no test split" in capsys.readouterr().err and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("given", "params", "seconds"),
    [({"budget.params": "300k"}, 3e5, None), ({"budget.params": "1.5M", "budget.train_seconds": "60"}, 1.5e6, 60.0)],
)
def test_budget_reads_suffixed_counts(given, params, seconds):
    budget = choice.Budget.parse(given)
    assert budget.params == params and budget.train_seconds == seconds


@pytest.mark.parametrize("bad", ["-1", "0", "lots", "1x"])
def test_budget_refuses_what_is_not_a_positive_number(bad):
    with pytest.raises(ValueError, match=f"budget.params={bad}: expected a positive number"):
        choice.Budget.parse({"budget.params": bad})


def test_cache_features_false_is_refused_for_every_method_that_cannot_take_it_before_anything_is_measured(
    tmp_path, capsys
):
    # The estimate composed each experiment as it measured them: the first that caches nothing (LoRA) stopped it in
    # the middle, after the images were decoded and the earlier experiments measured, the next one named only later.
    photos = make_folder(tmp_path / "photos", train=4, test=2)
    args = ["suite=choose", "data=folder", f"data.root={photos}", "methods=linear,lora,full", "seeds=0", *TINY]
    assert bench(*args, f"output_dir={tmp_path / 'out'}", "train.cache_features=false", "--yes") == USAGE_ERROR
    captured = capsys.readouterr()
    assert "measuring" not in captured.out and not (tmp_path / "out").exists()
    assert "train.cache_features=false cannot act in 2 of 3 experiment x task pairs" in captured.err
    assert "lora, full on folder: nothing in front of what the method trains is frozen" in captured.err
    # Not tasks=, which data= refuses: the one task is the data.
    assert captured.err.rstrip().endswith("; drop it, or leave those out (methods=) and run them in a sweep of their "
                                          "own without it")  # fmt: skip
    # Where every experiment takes it, it runs: it was refused for the run config's default method (LoRA), which
    # composed the data's config and is none of them.
    args = [*args[:3], "methods=linear", *args[4:], f"output_dir={tmp_path / 'out'}", "train.cache_features=false"]
    assert bench(*args, "dry_run=true") == 0, capsys.readouterr().err


def test_a_datasets_dataset_is_a_task_too_and_dry_run_stops_after_the_cost(tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    make_folder(tmp_path / "photos", train=4, test=2)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=list(CLASSES))})

    def split(name: str) -> datasets.Dataset:
        files = sorted((tmp_path / "photos" / name).glob("*/*.png"))
        labels = [CLASSES.index(f.parent.name) for f in files]
        return datasets.Dataset.from_dict({"image": [str(f) for f in files], "label": labels}, features=features)

    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": split("train"), "test": split("test")}).save_to_disk(str(saved))
    out = tmp_path / "out"
    args = ["suite=choose", "data=hf", f"data.root={saved}", "methods=lora", "seeds=0", f"output_dir={out}", *TINY]
    assert bench(*args, "dry_run=true") == 0
    printed = capsys.readouterr().out
    assert "data hf " in printed and "3 classes, 12 training images" in printed and "6 test images" in printed
    assert "= 3 runs still to train" in printed and "estimated wall time on this machine" in printed
    assert not any(out.rglob("result.json")) and not (out / ESTIMATE_FILE).exists()


def test_another_setup_on_the_same_images_gets_its_own_folder_and_a_dry_run_says_so(tmp_path, monkeypatch, capsys):
    """The docs' tiny-model example, then another setup on the same folder: it trains, never fails old runs."""
    monkeypatch.chdir(tmp_path)
    photos = make_folder(tmp_path / "photos", train=6, test=2)
    args = ["suite=choose", "data=folder", f"data.root={photos}", "methods=linear", "seeds=0", *TINY]
    assert bench(*args, "--yes") == 0
    (first,) = (tmp_path / "runs/bench/choose").iterdir()
    capsys.readouterr()

    # Two epochs instead of one: another folder, and the dry run counts the runs the real run will train.
    assert bench(*args, "train.epochs=2", "--dry-run") == 0
    printed = capsys.readouterr().out
    assert re.search(r"= [1-9]\d* runs still to train", printed) and str(first) not in printed, printed
    folders = sorted((tmp_path / "runs/bench/choose").iterdir())
    assert len(folders) == 2 and first.name.split("-")[1] == folders[1 - folders.index(first)].name.split("-")[1]

    # Pointed at the first folder, it is refused in one line naming what differs, before anything trains.
    assert bench(*args, "train.epochs=2", f"output_dir={first}", "--dry-run") == USAGE_ERROR
    error = capsys.readouterr().err.strip()
    assert "holds runs of another setup (train.epochs: 1 -> 2)" in error and len(error.splitlines()) == 1
    # A folder whose record predates the setup key: its finished runs are checked, and the dry run says so too.
    record = json.loads((first / own_data.DATA_FILE).read_text())
    del record["setup"]
    (first / own_data.DATA_FILE).write_text(json.dumps(record))
    assert bench(*args, "train.epochs=2", f"output_dir={first}", "--dry-run") == USAGE_ERROR
    error = capsys.readouterr().err.strip()
    assert "finished run(s) hold another config" in error and "train.epochs: 1 -> 2" in error


def test_an_output_dir_of_another_folders_runs_names_that_folder_not_another_version(tmp_path):
    # photos2's runs are not an edit of photos: the line names the folder they are of.
    other = own_data.OwnData("folder", "photos2", {}, "1" * 64, ["a", "b"], {}, None, 0.0)
    own_data.claim_output_dir(tmp_path / "out", other)
    data = own_data.OwnData("folder", str(tmp_path / "photos"), {}, "2" * 64, ["a", "b"], {}, None, 0.0)
    with pytest.raises(ValueError, match=r"holds runs on other data \(folder photos2, fingerprint 111111111111; now "):
        own_data.claim_output_dir(tmp_path / "out", data)
    # The same folder's name, spelled from another working directory, is an edit of it.
    edited = own_data.OwnData("folder", "./photos2/", {}, "2" * 64, ["a", "b"], {}, None, 0.0)
    with pytest.raises(ValueError, match=r"holds runs on another version of \./photos2/ \(fingerprint 111111111111"):
        own_data.claim_output_dir(tmp_path / "out", edited)
