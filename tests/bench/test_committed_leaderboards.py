"""The committed mini leaderboard (issue 12): rebuilt from committed results, convergence column, learning curves."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

from petl.bench import report
from petl.bench.report import tail_change, write_report

REPO = Path(__file__).resolve().parents[2]
MINI = REPO / "benchmarks" / "results" / "mini_selection"
RUNS = MINI / "runs"
# The same protocol on the real backbone (DINOv2 ViT-S/14 at 56 px), built with its suite's plan.
DINOV2 = REPO / "benchmarks" / "results" / "mini_dinov2"
# Every committed leaderboard: its folder, and the suite its README's report command names (None: none).
# The seed methods on petl's FractalDB Swin, beside the ViT's rows.
MINI_SWIN = REPO / "benchmarks" / "results" / "mini_swin"
LEADERBOARDS = [(MINI, "mini_selection"), (DINOV2, "mini_dinov2"), (MINI_SWIN, "mini_swin")]


def _result(task: str, method: str, seed: int, top1: float | None, **extra) -> dict:
    return {
        "method": method,
        "method_config": {"num_classes": 10},
        "dataset": task,
        "model": "vit_fractal_tiny_patch4_32.fractaldb",
        "seed": seed,
        "num_classes": 10,
        "trainable_params": 1100,
        "trainable_params_no_head": 1000,
        "total_params": 100_000,
        "val_top1": None,
        "test_top1": top1,
        "epochs": 5,
        "train_seconds": 2.0,
        "images_per_second": 100.0,
        **extra,
    }


def _write(folder: Path, result: dict, val: list[float] | None = None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "result.json").write_text(json.dumps(result))
    if val is not None:
        lines = [json.dumps({"epoch": i + 1, "loss": 1.0, "val_top1": v}) for i, v in enumerate(val)]
        (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def _load_script(name: str, monkeypatch) -> ModuleType:
    """A benchmarks/ script as a module (they import each other's helpers, so their folder goes on the path)."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _rows(path: Path) -> dict[str, dict[str, str]]:
    with path.open() as f:
        return {row["experiment"]: row for row in csv.DictReader(f)}


# ---------------------------------------------------------------------------------------- rebuild test


def _without_images(html: str) -> str:
    # The inline PNG depends on matplotlib's version and fonts, not on the results; everything else must match.
    return re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "data:image/png;base64,", html)


@pytest.mark.slow
@pytest.mark.parametrize(("folder", "suite"), LEADERBOARDS, ids=[f.name for f, _ in LEADERBOARDS])
def test_committed_reports_rebuild_from_the_committed_results(tmp_path, folder, suite):
    """`petl-bench report <folder>/runs out=<folder> [suite=...]` gives back the committed leaderboard exactly."""
    runs = folder / "runs"
    if not any(runs.rglob("result.json")):
        pytest.skip(f"no result.json committed under {runs.relative_to(REPO)} yet")
    write_report(runs, tmp_path, plan=report.plan_of(suite) if suite else None)
    for name in ("leaderboard.md", "leaderboard.csv"):
        assert (tmp_path / name).read_text() == (folder / name).read_text(), f"{name} differs from the committed one"
    rebuilt, committed = (tmp_path / "leaderboard.html").read_text(), (folder / "leaderboard.html").read_text()
    assert _without_images(rebuilt) == _without_images(committed)
    for name in ("pareto.png", "learning_curves.png"):
        assert (tmp_path / name).is_file() == (folder / name).is_file(), f"{name}: committed iff the report writes it"
    # Weights never travel with committed results (.gitignore keeps them out; a stray copy fails here).
    assert not [p for p in runs.rglob("*") if p.suffix in {".safetensors", ".pt"}]


def test_committed_convergence_table_rebuilds_from_the_committed_runs(monkeypatch):
    """convergence.md (20 against 40 epochs) is what benchmarks/mini_convergence.py renders from committed runs."""
    assert _load_script("mini_convergence", monkeypatch).render() == (MINI / "convergence.md").read_text()


@pytest.mark.parametrize("suite", ["mini_selection", "mini_dinov2", "mini_dinov2_low"])
def test_committed_lr_edge_table_rebuilds_from_the_committed_runs(monkeypatch, suite):
    """The lr-edge tables (an lr past the grid's edge against it) rebuild from the committed runs."""
    script = _load_script("mini_lr_edge", monkeypatch)
    probe = script.PROBES[suite]
    if not (probe.folder / probe.table).is_file():
        pytest.skip(f"no {probe.table} committed in {probe.folder.relative_to(REPO)} yet")
    assert script.render(probe) == (probe.folder / probe.table).read_text()


# ---------------------------------------------------------------------------------------- convergence


def test_a_task_the_registry_does_not_know_is_reported_not_fatal():
    assert report.task_group("vtab/not_registered_here") == "other"
    assert report.task_group("fgvc/not_registered_here") == "fgvc"
    assert report.task_group("mini/digits") == "natural"


def test_tail_change_is_the_change_over_the_last_fifth_of_the_epochs():
    assert tail_change([10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 85.0, 86.0]) == 86.0 - 80.0  # k = 2
    assert tail_change([10.0, 30.0, 31.0, 31.5, 31.0]) == 31.0 - 31.5  # k = 1
    assert tail_change([50.0, 60.0]) == 10.0
    assert tail_change([50.0]) != tail_change([50.0])  # NaN: one epoch says nothing


def test_tail_change_counts_epochs_not_lines():
    # Was: measured by position, so with epoch 9's line skipped, the last 2 of 10 epochs read epochs 7 to 10 and a
    # curve flat since epoch 8 (rising 10 points an epoch before) read +10, still learning, in the convergence column.
    epochs = [1, 2, 3, 4, 5, 6, 7, 8, 10]
    values = [10.0 * min(e, 8) for e in epochs]
    assert tail_change(values, epochs) == 0.0  # k = round(0.2 * 10) = 2 epochs: epoch 10 minus epoch 8
    assert tail_change([10.0, 20.0, 40.0], [1, 2, 10]) == 40.0 - 20.0  # epoch 8 skipped: the latest before it


@pytest.mark.slow
def test_convergence_column_reads_own_curves_and_the_selected_trials_curve(tmp_path):
    # linear ran on train800 with val: its own metrics.jsonl, two seeds -> the task's mean change.
    _write(tmp_path / "mini/digits/linear/seed0", _result("mini/digits", "linear", 0, 70.0), [50, 60, 64, 65, 66])
    _write(tmp_path / "mini/digits/linear/seed1", _result("mini/digits", "linear", 1, 71.0), [50, 60, 64, 65, 68])
    # lora's finals trained on train800val200 (no val): their curve is the chosen trial's, shared by both seeds.
    exp = tmp_path / "mini/digits/lora"
    _write(exp / "search/train.lr=0.1", _result("mini/digits", "lora", 0, None), [40, 50, 55, 60, 70])
    _write(exp / "search/train.lr=0.01", _result("mini/digits", "lora", 0, None), [40, 60, 75, 80, 80.5])
    selection = {
        "space": {"train.lr": [0.1, 0.01]},
        "trials": [
            {"overrides": {"train.lr": 0.1}, "val_top1": 70, "output_dir": "mini/digits/lora/search/train.lr=0.1"},
            {"overrides": {"train.lr": 0.01}, "val_top1": 80.5, "output_dir": "mini/digits/lora/search/train.lr=0.01"},
        ],
        "chosen": {"train.lr": 0.01},
    }
    for seed in (0, 1):
        _write(exp / f"seed{seed}", _result("mini/digits", "lora", seed, 80.0, selection=selection, split="x"))
    # vpt recorded no curve at all.
    _write(tmp_path / "mini/digits/vpt/seed0", _result("mini/digits", "vpt", 0, 60.0))

    board = write_report(tmp_path)
    rows = _rows(tmp_path / "leaderboard.csv")
    assert float(rows["linear"]["val_change_last20_mean"]) == pytest.approx(((66 - 65) + (68 - 65)) / 2)
    assert float(rows["linear"]["val_change_last20_max_abs"]) == pytest.approx(3.0)
    assert float(rows["lora"]["val_change_last20_mean"]) == pytest.approx(0.5)  # the chosen trial, not lr=0.1's 10
    assert rows["vpt"]["val_change_last20_mean"] == ""
    md = (tmp_path / "leaderboard.md").read_text()
    assert "| Val Δ last 20% ep |" in md and "+0.50 (max 0.50)" in md and "**Val Δ last 20% ep**" in md

    task, curves = report.learning_curves(board)
    assert task == "mini/digits"
    assert list(curves["linear"].values()) == [50, 60, 64, 65, 67]  # mean of the two seeds' curves
    assert curves["lora"] == {1: 40, 2: 60, 3: 75, 4: 80, 5: 80.5}
    assert "vpt" not in curves
    png = (tmp_path / "learning_curves.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 1000


def test_rows_short_of_a_task_or_a_seed_are_marked_and_the_compute_is_summed(tmp_path):
    for seed in (0, 1):
        _write(tmp_path / f"mini/digits/linear/seed{seed}", _result("mini/digits", "linear", seed, 70.0))
        _write(tmp_path / f"mini/mnist/linear/seed{seed}", _result("mini/mnist", "linear", seed, 90.0))
    _write(tmp_path / "mini/digits/lora/seed0", _result("mini/digits", "lora", 0, 80.0))  # one seed so far
    _write(tmp_path / "mini/mnist/lora/seed0", _result("mini/mnist", "lora", 0, 95.0))
    _write(tmp_path / "mini/mnist/lora/seed1", _result("mini/mnist", "lora", 1, 95.0, wall_seconds=3600.0))
    _write(tmp_path / "mini/digits/lora/search/train.lr=0.1", _result("mini/digits", "lora", 0, None))
    board = write_report(tmp_path)
    assert {r.experiment: board.complete(r) for r in board.rows} == {"linear": True, "lora": False}
    assert board.compute == report.Compute(runs=7, trials=1, seconds=7 * 2.0 + 3600.0)
    md = (tmp_path / "leaderboard.md").read_text()
    assert "| lora * |" in md and "| linear |" in md
    assert "**Compute**: 7 reported runs and 1 selection trial (every result.json under the folder), 1.00 h" in md


def test_no_learning_curves_png_without_curves(tmp_path):
    _write(tmp_path / "mini/digits/linear/seed0", _result("mini/digits", "linear", 0, 70.0))
    write_report(tmp_path)
    assert (tmp_path / "leaderboard.md").is_file()
    assert not (tmp_path / "learning_curves.png").exists()
    assert report.learning_curves(report.aggregate(report.collect(tmp_path))) is None


def test_committed_results_keep_no_weights_per_the_ignore_rules():
    import shutil
    import subprocess

    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    folder = "benchmarks/results/mini_selection/runs/mini-digits/lora/seed0"
    paths = [f"{folder}/{name}" for name in ("result.json", "metrics.jsonl", "trainable.safetensors", "checkpoint.pt")]
    ignored = subprocess.run(
        ["git", "check-ignore", *paths], cwd=REPO, capture_output=True, text=True, check=False
    ).stdout.split()
    assert ignored == paths[2:]


# ---------------------------------------------------------------------------------------- proposed suite


def test_proposed_mini_selection_suite_is_the_mini_suite_under_the_selection_protocol():
    from petl.bench.suite import configs_dir, load_experiment, load_suite

    configs = configs_dir()
    mini, proposed = load_suite("mini", configs), load_suite("mini_selection", configs)
    assert proposed.tasks == mini.tasks and proposed.experiments == mini.experiments
    assert proposed.seeds == [0, 1, 2] and proposed.search_seed == 0
    assert proposed.search == {"train.lr": [1e-3, 1e-2]}  # weight decay fixed: the file says why
    assert proposed.final_split == "train800val200" and proposed.pinned_trial
    assert "train.epochs=20" in proposed.overrides()
    for name in proposed.experiments:
        load_experiment(name, configs)


@pytest.mark.slow
def test_device_column_names_where_each_row_trained(tmp_path):
    for seed in (0, 1):
        _write(tmp_path / f"mini/digits/linear/seed{seed}", _result("mini/digits", "linear", seed, 70.0, device="cpu"))
    devices = {0: "cuda", 1: "cuda", 2: "cpu"}  # a row finished on another machine
    for seed, device in devices.items():
        _write(tmp_path / f"mini/digits/lora/seed{seed}", _result("mini/digits", "lora", seed, 80.0, device=device))
    write_report(tmp_path)
    rows = _rows(tmp_path / "leaderboard.csv")
    assert rows["linear"]["device"] == "cpu" and rows["lora"]["device"] == "cpu 1, cuda 2"
    assert "**Device**" in (tmp_path / "leaderboard.md").read_text()
    # Results that never recorded a device get no column.
    plain = tmp_path / "plain"
    _write(plain / "mini/digits/linear/seed0", _result("mini/digits", "linear", 0, 70.0))
    write_report(plain)
    assert "device" not in _rows(plain / "leaderboard.csv")["linear"]


def test_a_long_calibrated_option_is_shown_by_its_length(tmp_path):
    channels = [",".join(str(c) for c in range(block, block + 24)) for block in range(6)]  # SCT's per-block lists
    method_config = {"num_classes": 10, "channels": channels, "top_n": None}
    _write(tmp_path / "mini/digits/sct/seed0", _result("mini/digits", "sct", 0, 70.0, method_config=method_config))
    _write(
        tmp_path / "mini/digits/lora/seed0",
        _result("mini/digits", "lora", 0, 70.0, method_config={"targets": ["q", "v"]}),
    )
    write_report(tmp_path)
    rows = _rows(tmp_path / "leaderboard.csv")
    assert rows["sct"]["config"].startswith("channels=[6 values], top_n=None")
    assert rows["lora"]["config"].startswith("targets=[q,v]")


@pytest.mark.slow
def test_the_mini_tasks_are_the_data_the_committed_results_trained_on(monkeypatch):
    """Every task hashes as recorded beside the results (fingerprints.txt), so a changed source is caught."""
    module = _load_script("mini_fingerprints", monkeypatch)
    recorded = dict(line.split() for line in (MINI / "fingerprints.txt").read_text().splitlines())
    assert set(recorded) == set(module.TASKS)
    for task, digest in recorded.items():
        assert module.fingerprint(task) == digest, f"mini/{task} is not the data the committed results used"


# ---------------------------------------------------------------------------------------- the real backbone


def test_committed_real_backbone_runs_all_loaded_the_same_weights():
    """Every committed DINOv2 run ran the suite's backbone at its resolution, on one float16 file."""
    from test_backbones import WEIGHTS_SHA256

    results = [json.loads(p.read_text()) for p in (DINOV2 / "runs").rglob("result.json")]
    if not results:
        pytest.skip("no real-backbone run committed yet")
    assert {r["model"] for r in results} == {"vit_small_patch14_dinov2_imgfocus"}
    assert {r["weights_sha256"] for r in results} == {WEIGHTS_SHA256}
    assert {r["config"]["model"]["img_size"] for r in results} == {56}


# ---------------------------------------------------------------------------------------- suite plan, ranking


def test_complete_rows_come_first_without_a_plan_too(tmp_path):
    # Sorted in place, the rows were read while list.sort had emptied board.rows: without a plan every row then read
    # as incomplete (no seeds in the fullest cell) and lora, on one task of two, came first on its higher mean.
    for task, top1 in (("mini/digits", 70.0), ("mini/mnist", 90.0)):
        for seed in (0, 1):
            _write(tmp_path / f"{task}/linear/seed{seed}", _result(task, "linear", seed, top1))
    for seed in (0, 1):
        _write(tmp_path / f"mini/digits/lora/seed{seed}", _result("mini/digits", "lora", seed, 95.0))
    board = report.build_board(tmp_path)
    assert [(r.experiment, board.complete(r)) for r in board.rows] == [("linear", True), ("lora", False)]


def test_a_plan_marks_missing_tasks_seeds_and_experiments(tmp_path):
    plan = report.Plan("s", ("linear", "lora", "vpt_deep"), ("mini/digits", "mini/mnist", "mini/clevr_count"), (0, 1))
    for task, top1 in (("mini/digits", 70.0), ("mini/mnist", 90.0), ("mini/clevr_count", 30.0)):
        for seed in (0, 1):
            _write(tmp_path / f"{task}/linear/seed{seed}", _result(task, "linear", seed, top1))
    for seed in (0, 1):  # lora: two tasks only, one of them with one seed; its mean beats linear's
        _write(tmp_path / f"mini/digits/lora/seed{seed}", _result("mini/digits", "lora", seed, 95.0))
    _write(tmp_path / "mini/mnist/lora/seed0", _result("mini/mnist", "lora", 0, 99.0))

    board = write_report(tmp_path, plan=plan)
    assert [r.experiment for r in board.rows] == ["linear", "lora"]  # complete rows first
    assert [board.complete(r) for r in board.rows] == [True, False]
    md = (tmp_path / "leaderboard.md").read_text()
    assert md.startswith("# petl leaderboard: suite s\n") and "| lora * |" in md
    assert "**Progress** of suite `s` (3 experiments x 3 tasks x 2 seeds = 18 final runs): 9 finished." in md
    assert "Complete rows (1): linear." in md and "lora (3 of 6)" in md
    assert "No final run yet (1; searching or not started): vpt_deep." in md

    # A task no run has reached yet still gets its column, shown "–" in every row.
    (tmp_path / "mini/clevr_count/linear/seed0/result.json").unlink()
    (tmp_path / "mini/clevr_count/linear/seed1/result.json").unlink()
    board = write_report(tmp_path, plan=plan)
    assert "mini/clevr_count" in board.tasks and not any(board.complete(r) for r in board.rows)
    assert "Complete rows (0): none yet." in (tmp_path / "leaderboard.md").read_text()


def test_rank_correlation_is_spearmans_rho_over_the_shared_methods():
    from petl.bench.published import rank_correlation

    measured = {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0, "only_here": 9.0, "nan": math.nan}
    published = {"a": 2.0, "b": 1.0, "c": 4.0, "d": 3.0, "only_there": 0.0, "nan": 5.0}
    found = rank_correlation(measured, published)
    assert found.methods == ("d", "c", "b", "a")  # measured order, best first
    assert found.rho == pytest.approx(1 - 6 * 4 / (4 * 15))  # sum of squared rank differences 4, n = 4
    assert rank_correlation({"a": 1, "b": 2, "c": 3}, {"a": 30, "b": 20, "c": 10}).rho == pytest.approx(-1.0)
    # ties get their average rank: ranks (1.5, 1.5, 3) against (1, 2, 3)
    assert rank_correlation({"a": 1, "b": 1, "c": 3}, {"a": 1, "b": 2, "c": 3}).rho == pytest.approx(math.sqrt(3) / 2)
    assert math.isnan(rank_correlation({"a": 1, "b": 2}, {"a": 1, "b": 2}).rho)  # two methods: no coefficient
    assert math.isnan(rank_correlation({"a": 1, "b": 1, "c": 1}, {"a": 1, "b": 2, "c": 3}).rho)  # one side all tied


def test_the_report_ranks_complete_rows_against_the_published_vtab_ordering(tmp_path):
    # Published VTAB-1k task means: Linear probing 52.94 < VPT-Deep 69.43 < LoRA 72.25 (< RepAdapter 73.84).
    plan = report.Plan("s", ("linear", "lora", "vpt_deep", "repadapter", "mlp"), ("mini/digits",), (0,))
    for experiment, top1 in (("linear", 50.0), ("lora", 60.0), ("vpt_deep", 70.0), ("mlp", 99.0)):
        _write(tmp_path / f"mini/digits/{experiment}/seed0", _result("mini/digits", experiment, 0, top1))
    _write(tmp_path / "mini/mnist/repadapter/seed0", _result("mini/mnist", "repadapter", 0, 1.0))  # not complete

    board = write_report(tmp_path, plan=plan)
    found = report.published_ranking(board)
    assert found.methods == ("vpt_deep", "lora", "linear")  # mlp has no published row, repadapter is incomplete
    assert found.rho == pytest.approx(0.5)  # ranks (3, 2, 1) against (2, 3, 1): 1 - 6 * 2 / 24
    md = (tmp_path / "leaderboard.md").read_text()
    said = "Spearman's rho = +0.50 (no bootstrap interval: 3 rows, it needs 4) between"
    assert f"**Rank correlation with the published vtab1k ordering**: {said}" in md
    assert "(supervised)" in md and "it compares the methods' orderings, not their accuracies." in md

    (tmp_path / "mini/digits/vpt_deep/seed0/result.json").unlink()
    write_report(tmp_path, plan=plan)
    assert (
        "not computed: 2 complete row(s) name a published row (lora, linear); it needs 3"
        in (tmp_path / "leaderboard.md").read_text()
    )


def test_report_command_takes_the_suite_and_prints_progress_and_ranking(tmp_path, capsys):
    from petl.cli import bench as cli

    # A run of the suite's backbone (a run of another is refused: test_compare.py).
    dinov2 = {"model": "vit_small_patch14_dinov2_imgfocus"}
    _write(tmp_path / "mini/digits/linear/seed0", _result("mini/digits", "linear", 0, 70.0, **dinov2))
    assert cli.main(["report", str(tmp_path), f"out={tmp_path / 'out'}", "suite=mini_dinov2"]) == 0
    out = capsys.readouterr().out
    assert (
        "**Progress** of suite `mini_dinov2` (27 experiments x 7 tasks x 3 seeds = 567 final runs): 1 finished." in out
    )
    assert "Rank correlation with the published vtab1k ordering**: not computed: 0 complete row(s)" in out
    assert (tmp_path / "out" / "leaderboard.md").read_text().startswith("# petl leaderboard: suite mini_dinov2\n")
    with pytest.raises(SystemExit) as caught:
        cli.main(["report", str(tmp_path), "suite=no_such_suite"])
    assert caught.value.code == 2 and "unknown suite 'no_such_suite'" in capsys.readouterr().err


def test_copy_finished_runs_takes_finished_runs_only_and_overwrites_nothing(tmp_path):
    import shutil
    import subprocess

    if shutil.which("bash") is None:
        pytest.skip("no bash")
    src, dst = tmp_path / "src", tmp_path / "dst"
    cell = src / "mini/digits/lora"
    _write(cell / "search/train.lr=0.01", _result("mini/digits", "lora", 0, None), [1.0, 2.0])
    (cell / "search/train.lr=0.01/config.yaml").write_text("x: 1\n")
    (cell / "search/train.lr=0.01/trainable.safetensors").write_bytes(b"weights")
    (cell / "search/train.lr=0.001").mkdir()  # still training: no result.json yet
    (cell / "search/train.lr=0.001/metrics.jsonl").write_text('{"epoch": 1}\n')
    _write(cell / "seed0", _result("mini/digits", "lora", 0, 80.0, selection={"chosen": {}}))
    _write(cell / "seed1", _result("mini/digits", "lora", 1, 80.0))  # trained, selection not stamped yet
    # src/mini/digits/... is the layout before one folder level per task (a sweep started earlier); both go to
    # the one-level layout petl-bench writes today.
    _write(src / "mini-mnist/linear/seed0", _result("mini/mnist", "linear", 0, 70.0))
    script = REPO / "benchmarks" / "copy_finished_runs.sh"

    def copy() -> str:
        done = subprocess.run(["bash", script, src, dst], capture_output=True, text=True, check=True)
        return done.stdout + done.stderr

    assert "copied 3 finished runs, 0 already" in copy() and "1 final runs left out" in copy()
    copied = sorted(str(p.relative_to(dst)) for p in dst.rglob("*") if p.is_file())
    assert copied == [
        "mini-digits/lora/search/train.lr=0.01/config.yaml",
        "mini-digits/lora/search/train.lr=0.01/metrics.jsonl",
        "mini-digits/lora/search/train.lr=0.01/result.json",
        "mini-digits/lora/seed0/result.json",
        "mini-mnist/linear/seed0/result.json",
    ]
    (dst / "mini-digits/lora/seed0/result.json").write_text("{}")  # a copy that differs is named, never replaced
    assert "differs, left alone: " in copy() and (dst / "mini-digits/lora/seed0/result.json").read_text() == "{}"
