"""Benchmark harness: suite loading, the sweep's layout and resumability, and the leaderboard report.

Training is faked (a function writing result.json), so these tests take seconds; the end-to-end test
through the real engine lives in test_bench_end_to_end.py.
"""

from __future__ import annotations

import csv
import html
import io
import itertools
import json
import math
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
from conftest import command_status

from petl.bench import sweep
from petl.bench.plot import Box, curve_panels, family_styles, pareto_front, place_labels
from petl.bench.published import TABLES, ppt
from petl.bench.report import aggregate, collect, write_report
from petl.bench.suite import configs_dir, format_value, load_experiment, load_suite, to_overrides
from petl.cli import bench as cli
from petl.presets import FAMILIES, preset_names

BENCH = configs_dir()
VTAB = TABLES[0]
VTAB_ROWS = VTAB.rows()
VIT_B = 85_800_000  # parameters of ViT-B/16, the published backbone (a record cannot train more than it has)
VTAB_TASKS = [f"vtab/{c}" for c in next(iter(VTAB_ROWS.values())).top1]


# ----------------------------------------------------------------------------------------------- suites


def test_suites_list_existing_experiments_and_the_expected_tasks():
    mini = load_suite("mini", BENCH)
    assert len(mini.tasks) == 7 and all(t.startswith("mini/") for t in mini.tasks)
    assert mini.seeds == [0, 1, 2]
    # The mini tasks' epoch count has one home, petl.data.mini.EPOCHS, not the suite file too.
    assert not any(o.startswith("train.epochs=") for o in mini.overrides())
    assert load_suite("vtab1k", BENCH).tasks == VTAB_TASKS
    assert len(load_suite("fgvc", BENCH).tasks) == 5
    for name in ("mini", "vtab1k", "fgvc"):
        for exp in load_suite(name, BENCH).experiments:
            load_experiment(exp, BENCH)  # raises if a suite names a missing experiment


def test_experiments_become_hydra_overrides():
    assert load_experiment("adapter_parallel", BENCH).overrides() == [
        "method=adapter",
        "method.style=parallel",
        "method.dim=8",
    ]
    assert load_experiment("vpt_deep", BENCH).overrides()[-1] == "method.deep=true"
    assert "train.lr=0.0001" in load_experiment("full", BENCH).overrides()
    with pytest.raises(ValueError, match="unknown experiment 'nope'.*lora"):
        load_experiment("nope", BENCH)


def test_malformed_experiment_names_the_bad_key(tmp_path):
    (tmp_path / "experiments").mkdir()
    (tmp_path / "suites").mkdir()
    (tmp_path / "experiments" / "bad.yaml").write_text("method: {name: lora}\noptimizer: {lr: 1}\n")
    with pytest.raises(ValueError, match="unknown key.*optimizer"):
        load_experiment("bad", configs_dir(tmp_path))


def test_format_value_quotes_what_hydra_would_misread():
    assert format_value("sequential") == "sequential"
    assert format_value("true") == "'true'"
    assert format_value("/tmp/it's") == "'/tmp/it\\'s'"
    assert format_value(("q", "v")) == "[q,v]"
    assert format_value(None) == "null" and format_value(False) == "false" and format_value(1e-4) == "0.0001"
    assert to_overrides("train", {"lr": 0.01, "sched": {"warmup": 2}}) == ["train.lr=0.01", "train.sched.warmup=2"]


# ------------------------------------------------------------------------------------------------ sweep


class FakeEngine:
    """Stands in for petl.run: compose records the overrides, train writes a result.json."""

    def __init__(self, fail_on: str | None = None):
        self.trained: list[list[str]] = []
        self.fail_on = fail_on

    def compose(self, overrides: list[str]) -> dict:
        values = dict(o.split("=", 1) for o in overrides)
        return {**values, "overrides": overrides, "output_dir": values["output_dir"].strip("'")}

    def train(self, cfg: dict) -> dict:
        if self.fail_on and self.fail_on in cfg["data"]:
            raise RuntimeError("boom")
        self.trained.append(cfg["overrides"])
        out = Path(cfg["output_dir"])
        out.mkdir(parents=True, exist_ok=True)
        result = fake_result(cfg["data"], cfg["method"], int(cfg["seed"]), 50.0 + int(cfg["seed"]))
        (out / "result.json").write_text(json.dumps(result))
        return result


def fake_result(
    task: str,
    method: str,
    seed: int,
    top1: float,
    no_head: float = 1000.0,
    head: float = 100.0,
    model: str = "vit_fractal_tiny_patch4_32.fractaldb",
    total: int = 100_000,
    train_seconds: float = 2.0,
    peak_memory_mb: float = 10.0,
) -> dict:
    return {
        "method": method,
        "method_config": {"num_classes": 10},
        "dataset": task,
        "model": model,
        "seed": seed,
        "num_classes": 10,
        # Counts as petl writes them: integers (the reader refuses 1100.0).
        "trainable_params": int(no_head + head),
        "trainable_params_no_head": int(no_head),
        "total_params": total,
        "val_top1": top1,
        "test_top1": top1,
        "epochs": 1,
        "train_seconds": train_seconds,
        "images_per_second": 100.0,
        "peak_memory_mb": peak_memory_mb,
    }


def write_run(root: Path, task: str, experiment: str, seed: int, **kwargs) -> None:
    folder = sweep.run_dir_for(root, task, experiment, seed)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "result.json").write_text(json.dumps(fake_result(task, kwargs.pop("method", experiment), seed, **kwargs)))


def test_sweep_layout_overrides_and_resume(tmp_path):
    experiments = [load_experiment("linear", BENCH), load_experiment("lora", BENCH)]
    tasks = ["mini/digits", "mini/mnist"]
    runs = sweep.plan(experiments, tasks, [0, 1], tmp_path, ["train.epochs=3"], ["train.lr=0.5"])
    assert len(runs) == 8
    lora = next(r for r in runs if r.experiment == "lora" and r.task == "mini/mnist" and r.seed == 1)
    assert lora.run_dir == tmp_path / "mini-mnist" / "lora" / "seed1"
    # Suite first, experiment next, the user's overrides after them, the run's folder last.
    assert lora.overrides[0] == "train.epochs=3" and lora.overrides[-2] == "train.lr=0.5"
    assert lora.overrides[-1] == f"output_dir={format_value(str(lora.run_dir))}"
    assert {"method=lora", "method.rank=8", "data=mini/mnist", "seed=1"} <= set(lora.overrides)

    engine = FakeEngine()
    summary = sweep.run_sweep(runs[:5], engine.train, engine.compose, progress=False)
    assert (summary.trained, summary.already_done) == (5, 0)
    assert all(r.is_done() for r in runs[:5]) and not any((r.run_dir / sweep.LOCK_FILE).exists() for r in runs)

    # Re-running the whole sweep trains only what is missing.
    again = FakeEngine()
    summary = sweep.run_sweep(runs, again.train, again.compose, progress=False)
    assert (summary.trained, summary.already_done, len(again.trained)) == (3, 5, 3)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("result.json")) == sorted(
        f"{sweep.task_folder(t)}/{e}/seed{s}/result.json" for t in tasks for e in ("linear", "lora") for s in (0, 1)
    )


def test_a_run_held_by_another_live_sweep_is_left_alone(tmp_path):
    run = sweep.plan([load_experiment("linear", BENCH)], ["mini/digits"], [0], tmp_path)[0]
    run.run_dir.mkdir(parents=True)
    # A live process on this host (our parent) holds the lock: the run is skipped, not trained twice.
    (run.run_dir / sweep.LOCK_FILE).write_text(json.dumps({"host": os.uname().nodename, "pid": os.getppid()}))
    engine = FakeEngine()
    summary = sweep.run_sweep([run], engine.train, engine.compose, progress=False)
    assert summary.held_elsewhere == [run.label] and not engine.trained and not run.is_done()
    # It says last that it trained nothing, and exits 0: sweeps side by side share a folder's runs.
    assert summary.idle_line().startswith("trained nothing: 1 run(s) are being trained by another sweep")
    # A lock left by a dead process is stale and taken over.
    (run.run_dir / sweep.LOCK_FILE).write_text(json.dumps({"host": os.uname().nodename, "pid": 2**22 + 12345}))
    summary = sweep.run_sweep([run], engine.train, engine.compose, progress=False)
    assert summary.trained == 1 and run.is_done() and not (run.run_dir / sweep.LOCK_FILE).exists()
    assert summary.idle_line() is None


def test_a_failing_run_is_logged_and_the_sweep_goes_on(tmp_path):
    runs = sweep.plan([load_experiment("linear", BENCH)], ["mini/digits", "mini/mnist"], [0], tmp_path)
    engine = FakeEngine(fail_on="digits")
    summary = sweep.run_sweep(runs, engine.train, engine.compose, progress=False)
    assert summary.trained == 1 and len(summary.failed) == 1
    assert "RuntimeError: boom" in (runs[0].run_dir / sweep.ERROR_FILE).read_text()
    assert runs[1].is_done()


def test_cli_runs_a_restricted_suite_then_reports(tmp_path, monkeypatch, capsys):
    engine = FakeEngine()
    monkeypatch.setattr(sweep, "_default_fns", lambda: (engine.train, engine.compose, None))
    args = ["suite=mini", "methods=linear,lora", "tasks=mini/digits", "seeds=0,1", "train.epochs=1"]
    assert cli.main([*args, f"output_dir={tmp_path}", "progress=false"]) == 0
    assert len(engine.trained) == 4 and all("train.epochs=1" in o for o in engine.trained)
    assert (tmp_path / "leaderboard.md").is_file() and (tmp_path / "pareto.png").is_file()
    assert cli.main([*args, f"output_dir={tmp_path}", "progress=false"]) == 0
    assert len(engine.trained) == 4  # nothing left to do
    assert "4 already done" in capsys.readouterr().out
    with pytest.raises(SystemExit) as caught:
        cli.main(["method=lora", f"output_dir={tmp_path}"])
    assert caught.value.code == 2 and "methods=" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------- report


def test_ppt_matches_the_published_worked_examples():
    assert round(ppt(72.25, 0.29e6), 2) == 0.71
    assert round(ppt(69.43, 0.56e6), 2) == 0.68
    assert round(ppt(71.70, 2.38e6), 2) == 0.65
    assert round(ppt(52.94, 0), 2) == 0.53


@pytest.fixture
def vtab_results(tmp_path) -> Path:
    """Two seeds of LoRA and linear probing on VTAB-1k: the published figures ± 0.5, and a partial VPT-Deep.

    All on the published backbone, except for adapter_parallel (on petl's tiny backbone); partial has
    no published row.
    """
    root = tmp_path / "vtab"
    for experiment, published, no_head in (("lora", "LoRA", 0.29e6), ("linear", "Linear probing", 0.0)):
        for seed, delta in ((0, -0.5), (1, 0.5)):
            for task in VTAB_TASKS:
                top1 = VTAB_ROWS[published].top1[VTAB.column(task)] + delta
                write_run(
                    root,
                    task,
                    experiment,
                    seed,
                    top1=top1,
                    no_head=no_head,
                    head=7.7e3,
                    model=VTAB.backbone,
                    total=VIT_B,
                )
    write_run(root, "vtab/dtd", "vpt_deep", 0, method="vpt", top1=60.0, no_head=5e4, model=VTAB.backbone)
    write_run(root, "vtab/dtd", "adapter_parallel", 0, method="adapter", top1=20.0)
    write_run(root, "vtab/dtd", "partial", 0, top1=10.0, model=VTAB.backbone)
    return root


def read_csv(path: Path) -> dict[str, dict[str, str]]:
    with path.open() as f:
        return {row["experiment"]: row for row in csv.DictReader(f)}


def test_vtab_leaderboard_means_stds_ppt_and_published_columns(vtab_results):
    board = write_report(vtab_results)
    rows = read_csv(vtab_results / "leaderboard.csv")
    lora, linear = rows["lora"], rows["linear"]
    # Seeds at published ± 0.5: the mean is the published figure, the sample std 0.5·√2.
    assert float(lora["vtab/dtd_top1_mean"]) == pytest.approx(69.4)
    assert float(lora["vtab/dtd_top1_std"]) == pytest.approx(math.sqrt(0.5), abs=1e-4)
    assert lora["vtab/dtd_seeds"] == "0 1"
    assert float(lora["task_mean"]) == pytest.approx(72.25, abs=0.01)
    assert round(float(lora["ppt"]), 2) == 0.71 and round(float(linear["ppt"]), 2) == 0.53
    assert float(linear["trainable_no_head_M"]) == 0.0 and float(lora["trainable_no_head_M"]) == pytest.approx(0.29)
    assert float(lora["trainable_pct"]) == pytest.approx(100 * (0.29e6 + 7.7e3) / VIT_B, abs=1e-4)
    # The group mean (mean of natural/specialized/structured averages) is the higher convention.
    assert float(lora["group_mean"]) > float(lora["task_mean"]) + 2
    assert {"group_mean_natural", "group_mean_specialized", "group_mean_structured"} <= set(lora)
    # Published figures sit in their own labelled columns, with the source, and equal the table's.
    assert lora["published_vtab1k_method"] == "LoRA" and float(lora["published_vtab1k_task_mean"]) == 72.25
    assert float(lora["published_vtab1k_dtd"]) == 69.4 and "c188fad" in lora["published_vtab1k_source"]
    assert rows["vpt_deep"]["tasks_done"] == "1/19" and rows["vpt_deep"]["published_vtab1k_method"] == "VPT-Deep"
    assert [r.experiment for r in board.rows] == ["lora", "linear", "vpt_deep", "adapter_parallel", "partial"]
    # No silently empty published cell: another backbone, or no published row, is said in words.
    assert rows["adapter_parallel"]["published_vtab1k_method"] == "different backbone"
    assert (
        rows["adapter_parallel"]["published_vtab1k_task_mean"] == "" == rows["adapter_parallel"]["published_vtab1k_dtd"]
    )
    assert rows["partial"]["published_vtab1k_method"] == "no published row"

    md = (vtab_results / "leaderboard.md").read_text()
    # The main table leads with what answers "which wins at what budget"; published figures sit in the details.
    header, details, *_ranks = [line for line in md.splitlines() if line.startswith("| Experiment")]
    assert header.startswith("| Experiment | Trainable M (%) | Task mean | Natural mean |") and "| dtd |" in header
    assert "ublished" not in header and "Published vtab1k task mean" in details
    assert "69.40 ± 0.71" in md and "vpt_deep *" in md
    assert "| different backbone | – | – | – | – |" in md and "| no published row | – |" in md
    assert "**Task mean**" in md and "**Group mean**" in md and "V-PETL Bench README" in md
    assert "## Published per-task figures" in md


def test_mini_leaderboard_has_no_published_column(tmp_path):
    for seed in (0, 1, 2):
        write_run(tmp_path, "mini/digits", "lora", seed, method="lora", top1=90.0 + seed)
        write_run(tmp_path, "mini/digits", "linear", seed, method="linear", top1=80.0, no_head=0.0)
    write_report(tmp_path)
    rows = read_csv(tmp_path / "leaderboard.csv")
    assert not any(k.startswith("published") for k in rows["lora"])
    assert float(rows["lora"]["mini/digits_top1_mean"]) == 91.0 and float(rows["lora"]["mini/digits_top1_std"]) == 1.0
    assert float(rows["linear"]["mini/digits_top1_std"]) == 0.0
    md = (tmp_path / "leaderboard.md").read_text()
    # No published figures; the legend only ranks the rows against the published ordering (a line of its own).
    assert not [line for line in md.splitlines() if "ublished" in line and "Rank correlation" not in line]


def test_experiment_comes_from_the_folder_and_config_from_the_result(tmp_path):
    write_run(tmp_path, "mini/digits", "adapter_parallel", 0, method="adapter", top1=70.0)
    write_run(tmp_path, "mini/digits", "adapter_sequential", 0, method="adapter", top1=71.0)
    result = tmp_path / "mini-digits/adapter_parallel/seed0/result.json"
    data = json.loads(result.read_text())
    data["method_config"] = {"num_classes": 10, "style": "parallel", "dim": 8}
    result.write_text(json.dumps(data))
    nodes = "method:\n  name: adapter\ndata:\n  name: digits\nmodel:\n  name: vit\n"
    (result.parent / "config.yaml").write_text(nodes + "train:\n  lr: 0.001\n")
    board = aggregate(collect(tmp_path), tmp_path)
    row = next(r for r in board.rows if r.experiment == "adapter_parallel")
    assert row.values["method"] == "adapter" and row.values["config"] == "dim=8, style=parallel; lr=0.001, 1 ep"
    assert len(board.rows) == 2


def test_pareto_frontier_and_png(vtab_results):
    assert pareto_front([(10, 50), (5, 60), (20, 70), (30, 65), (5, 40)]) == [1, 2]
    write_report(vtab_results)
    assert (vtab_results / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_larger_row_of_the_same_mean_summed_in_another_order_is_off_the_pareto_front(tmp_path, monkeypatch):
    from petl.bench import plot, report

    # The committed DINOv2 board's gps and ssf on fashion_mnist: one score whose means differ in the last bit
    # (82.13333333333333 against 82.13333333333334), which drew ssf, of 45 times the parameters, on the front.
    for experiment, top1s, no_head in (("gps", (80.6, 82.8, 83.0), 1_000), ("ssf", (83.4, 81.6, 81.4), 45_000)):
        for seed, top1 in enumerate(top1s):
            write_run(tmp_path, "mini/digits", experiment, seed, top1=top1, no_head=no_head)
    board = aggregate(collect(tmp_path), tmp_path)
    assert board.rows[1].task_mean > board.rows[0].task_mean  # ssf's, in the last bit
    drawn = {}
    monkeypatch.setattr(plot, "render_pareto", lambda points, *args: drawn.setdefault("points", points) and b"")
    report.pareto_png(board)
    front = pareto_front([(p.params, p.accuracy) for p in drawn["points"]])
    assert [drawn["points"][i].label for i in front] == ["gps"]


def test_point_names_are_placed_clear_of_each_other_and_of_every_marker():
    # Twelve points packed 8-9 px apart (the mini board's adapters and scale-shift rows sit about that close).
    anchors = [(300.0 + 8 * (i % 4), 200.0 + 9 * (i // 4)) for i in range(12)]
    sizes = [(40.0 + 3 * i, 11.0) for i in range(12)]
    bounds, radius = Box(0, 0, 600, 400), 5.0
    frontier = [Box(250, 199, 300, 201)]  # a segment of the frontier's step line, kept clear too
    boxes = [p.box for p in place_labels(anchors, sizes, bounds, radius, frontier)]
    markers = [Box(x - radius, y - radius, x + radius, y + radius) for x, y in anchors]
    assert all(b.inside(bounds) for b in boxes)
    assert all(a.overlap(b) == 0 for a, b in itertools.combinations(boxes, 2))
    assert all(b.overlap(m) == 0 for b in boxes for m in markers + frontier)
    # A point with room around it keeps its name just to its right.
    (alone,) = place_labels([(100.0, 100.0)], [(30.0, 10.0)], bounds, radius)
    assert (alone.ha, alone.va, alone.dy) == ("left", "center", 0) and 0 < alone.dx < 10
    # Near the right edge, the name goes to the left instead of leaving the axes.
    (edge,) = place_labels([(590.0, 100.0)], [(30.0, 10.0)], bounds, radius)
    assert edge.ha == "right" and edge.box.inside(bounds)


def test_every_shipped_experiment_names_a_known_family():
    """The plots' markers, colours and learning-curve panels come from `family:` in each experiment file."""
    for name in preset_names(BENCH / "experiments"):
        assert load_experiment(name, BENCH).family in FAMILIES, f"configs/experiments/{name}.yaml: add `family:`"
    markers, colours = zip(*family_styles(list(FAMILIES)).values(), strict=True)
    assert len(set(markers)) == len(set(colours)) == len(FAMILIES)


def test_families_come_from_the_experiment_files_and_group_the_plots(tmp_path):
    for experiment, method in (("lora", "lora"), ("fact", "fact"), ("linear", "linear"), ("my_lora", "lora")):
        write_run(tmp_path, "mini/digits", experiment, 0, method=method, top1=70.0)
    board = write_report(tmp_path)
    rows = read_csv(tmp_path / "leaderboard.csv")
    # my_lora has no experiment file: its method names its family.
    assert {e: r["family"] for e, r in rows.items()} == {
        "lora": "low-rank",
        "fact": "low-rank",
        "linear": "head",
        "my_lora": "lora",
    }
    assert board.family_order == ["head", "low-rank", "lora"]
    family_of = {row.experiment: board.family(row) for row in board.rows}
    panels = curve_panels(["lora", "my_lora", "linear", "fact"], family_of, board.family_order)
    assert panels == {"head": ["linear"], "low-rank": ["lora", "fact"], "lora": ["my_lora"]}
    md = (tmp_path / "leaderboard.md").read_text()
    assert "## Details: family" in md and "| Experiment | Family |" in md and "**Family**" in md


def test_the_pareto_plot_draws_each_family_in_its_own_colour(tmp_path):
    from matplotlib.colors import to_rgb
    from PIL import Image

    one_per_family = {"linear": "head", "full": "layers", "vpt_deep": "prompt", "convpass": "adapter"}
    one_per_family |= {"lora": "low-rank", "ssf": "scale-shift", "gps": "sparse", "dtl": "side"}
    one_per_family |= {"noah": "search"}
    for i, experiment in enumerate(one_per_family):
        write_run(tmp_path, "mini/digits", experiment, 0, top1=50.0 + 5 * i, no_head=1000.0 * 4**i, total=10**11)
    board = write_report(tmp_path)
    assert board.family_order == list(FAMILIES)
    pixels = dict((rgb, n) for n, rgb in Image.open(tmp_path / "pareto.png").convert("RGB").getcolors(1 << 20))
    styles = family_styles(board.family_order)
    wanted = {family: tuple(round(255 * c) for c in to_rgb(colour)) for family, (_, colour) in styles.items()}
    assert len(set(wanted.values())) == len(wanted)

    def near(a, b):  # the 256-colour PNG may move a colour by a unit or two (octree cells are averages)
        return max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 3

    for family, rgb in wanted.items():
        drawn = sum(n for colour, n in pixels.items() if near(colour, rgb))
        assert drawn >= 20, f"{family}'s colour {styles[family][1]} is missing from pareto.png"
        assert not any(near(rgb, other) for f, other in wanted.items() if f != family)


class _TableReader(HTMLParser):
    """Collects the text of each body row of one <table id=...> and its <th> labels."""

    def __init__(self, table_id: str = "leaderboard"):
        super().__init__()
        self.table_id = table_id
        self.rows: list[list[str]] = []
        self.headers: list[str] = []
        self._in_table = self._in_body = False
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "table":
            self._in_table = attrs.get("id") == self.table_id
        elif self._in_table and tag == "tbody":
            self._in_body = True
        elif self._in_table and tag == "tr" and self._in_body:
            self.rows.append([])
        elif self._in_table and tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag):
        if tag == "table":
            self._in_table = self._in_body = False
        elif self._in_table and tag in ("td", "th") and self._cell is not None:
            text = "".join(self._cell).strip()
            (self.rows[-1] if tag == "td" else self.headers).append(text)
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def _read_table(dom: str, table_id: str) -> _TableReader:
    reader = _TableReader(table_id)
    reader.feed(dom)
    return reader


def _dump_dom_in_chromium(url: str, tmp_path: Path, window: tuple[int, int] = (1400, 900)) -> str:
    """The page's DOM after its scripts ran, in headless Chromium with a ``window`` wide viewport."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (the README set-up installs it; CI has it)")
    cmd = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--hide-scrollbars",  # the page is laid out on the whole width asked for
        f"--window-size={window[0]},{window[1]}",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
        "--dump-dom",
        url,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=90, check=True).stdout


@pytest.mark.slow
def test_html_renders_in_a_browser_and_sorts(vtab_results, tmp_path):
    write_report(vtab_results)
    page = vtab_results / "leaderboard.html"
    text = page.read_text()
    assert 'src="data:image/png;base64,iVBORw0KGgo' in text
    # Self-contained: no link out of the page (the embedded PNG's base64 may spell "http" by chance, so it is cut).
    body = re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", text.split("<body>")[1])
    assert "http" not in body.lower()
    # The hash makes the page's own script sort by PPT ascending on load: this checks the JS, in a real browser.
    dom = _dump_dom_in_chromium(page.as_uri() + "#sort=ppt:asc", tmp_path)
    reader = _read_table(dom, "leaderboard")
    # Written best task mean first (lora, vpt_deep, linear, ...); PPT ascending puts partial first.
    assert [row[0] for row in reader.rows] == ["partial *", "adapter_parallel *", "linear", "vpt_deep *", "lora"]
    ppt_col = next(i for i, h in enumerate(reader.headers) if h == "PPT")
    assert [row[ppt_col] for row in reader.rows] == ["0.10", "0.20", "0.53", "0.60", "0.71"]
    assert len(reader.rows[0]) == len(reader.headers)
    # The published figures and the configuration sit in the details table, one row per experiment.
    details = _read_table(dom, "details")
    assert "Published vtab1k task mean" in details.headers and "petl config" in details.headers
    assert "Published vtab1k task mean" not in reader.headers and "petl config" not in reader.headers
    assert sorted(row[0] for row in details.rows) == sorted(row[0] for row in reader.rows)


def test_long_texts_fold_into_a_per_row_disclosure_and_spreads_are_set_apart():
    from petl.bench.html import LONG_TEXT, render_html
    from petl.bench.table import Header, Table

    long = "dim=8, dropout=0.1, scale=10.0, xavier_conv=False; lr=0.01, 20 ep | lr=0.001, 20 ep"
    main = Table(
        [Header("experiment", "Experiment", "info"), Header("task:a", "a")], [[("x", "x"), ("81.50 ± 0.25", 81.5)]]
    )
    details = Table(
        [Header("experiment", "Experiment", "info"), Header("config", "petl config", "info")],
        [[("x", "x"), (long, long)]],
        "Details",
    )
    page = render_html("t", main, details, [], [], [])
    assert len(long) > LONG_TEXT
    # The whole text is kept, behind a summary showing its start; a short text is shown as it is.
    assert f"<details><summary><span>{long[: LONG_TEXT - 10]}…</span></summary>{long}</details>" in page
    assert '<td class="info" data-sort="x">x</td>' in page
    assert '81.50<span class="std"> ± 0.25</span>' in page
    assert page.index('id="leaderboard"') < page.index("<h2>Details</h2>") < page.index('id="details"')


# Appended to a copy of the page: writes where each main-table header lies, as the browser laid it out.
_LAYOUT_PROBE = """<script>
(function () {
  var out = {viewport: [document.documentElement.clientWidth, window.innerHeight], headers: {}};
  document.querySelectorAll("#leaderboard th").forEach(function (th) {
    var r = th.getBoundingClientRect();
    out.headers[th.getAttribute("data-key")] = [r.left, r.top, r.right, r.bottom];
  });
  var pre = document.createElement("pre");
  pre.id = "layout-probe";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
})();
</script>"""


def _header_boxes(page: Path, tmp_path: Path, width: int) -> dict[str, list[float]]:
    # Layout depends on the viewport's width only (the page has no vh units); its height is checked by position.
    assert "vh" not in page.read_text().split("<style>")[1].split("</style>")[0]
    probe = tmp_path / "probe.html"
    probe.write_text(page.read_text().replace("</body>", _LAYOUT_PROBE + "</body>"))
    dom = _dump_dom_in_chromium(probe.as_uri(), tmp_path, (width, 900))
    layout = json.loads(html.unescape(re.search(r'<pre id="layout-probe">(.*?)</pre>', dom).group(1)))
    assert layout["viewport"][0] == width
    return layout["headers"]


COMMITTED = {
    "committed mini leaderboard": (
        Path(__file__).resolve().parents[2] / "benchmarks/results/mini_selection/leaderboard.html"
    ),
    "committed real-backbone leaderboard": (
        Path(__file__).resolve().parents[2] / "benchmarks/results/mini_dinov2/leaderboard.html"
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("which", [*COMMITTED, "19 VTAB-1k tasks with published columns"])
def test_the_first_screen_shows_the_task_mean(which, vtab_results, tmp_path):
    """At 1400x900 the Task mean, the group means and the parameter count are on screen, not off to the right."""
    if which in COMMITTED:
        page = COMMITTED[which]
    else:
        write_report(vtab_results)
        page = vtab_results / "leaderboard.html"
    boxes = _header_boxes(page, tmp_path, 1400)
    for key in ["trainable", "task_mean", "group_mean", *(k for k in boxes if k.startswith("group:"))]:
        left, top, right, bottom = boxes[key]
        assert 0 <= left and right <= 1400 and 0 <= top and bottom <= 900, f"{key} header lies at {boxes[key]}"
    # The config and selection texts that pushed every number off-screen are in the details table.
    assert not {"config", "selected_on_val", "published_vtab1k_method"} & set(boxes)


def test_commands_print_multirun_lines_writing_the_same_layout(capsys):
    assert cli.main(["commands", "suite=mini", "methods=adapter_parallel", "seeds=0,1", "hydra/launcher=joblib"]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    assert line.startswith("petl-run --multirun ") and "method=adapter method.style=parallel method.dim=8" in line
    assert "seed=0,1" in line and "hydra/launcher=joblib" in line and "data=mini/fashion_mnist,mini/mnist," in line
    assert line.endswith("'output_dir=runs/bench/mini/${petl.slug:${data.name}}/adapter_parallel/seed${seed}'")
    # Each job's folder resolves as petl-bench's own would: runs/bench/mini/mini-digits/adapter_parallel/seed1.
    from omegaconf import OmegaConf

    from petl.train.config import register_configs

    register_configs()  # petl-run's resolvers, its slug resolver among them
    folder = line.split("output_dir=")[1].strip("'")
    job = OmegaConf.create({"data": {"name": "mini/digits"}, "seed": 1, "output_dir": folder})
    assert Path(job.output_dir) == sweep.run_dir_for(Path("runs/bench/mini"), "mini/digits", "adapter_parallel", 1)


def test_the_help_s_commands_example_prints_lines(capsys):
    # The usage line of petl-bench --help (and docs/cli.md) shows `commands` on a suite it must be able to print;
    # it showed suite=vtab1k, which selects on val and is refused.
    (usage,) = [line for line in cli.__doc__.splitlines() if line.strip().startswith("petl-bench commands ")]
    argv = re.sub(r"\[[^\]]*\]", "", usage.split("  (")[0]).split()[1:]  # without its options and comment
    assert cli.main(argv) == 0, argv
    assert capsys.readouterr().out.startswith("petl-run --multirun ")


def test_every_registered_task_has_its_own_one_level_folder():
    from petl.data import list_datasets

    tasks = list_datasets()
    folders = {sweep.task_folder(t) for t in tasks}
    assert len(folders) == len(tasks) and not [f for f in folders if "/" in f]
    assert sweep.task_folder("mini/digits") == "mini-digits"


def test_adding_a_column_is_one_declaration(tmp_path, monkeypatch):
    from petl.bench import report

    write_run(tmp_path, "mini/digits", "lora", 0, method="lora", top1=90.0)
    write_run(tmp_path, "mini/digits", "lora", 1, method="lora", top1=92.0)
    original = report.leaderboard_columns

    def with_one_more(board):
        extra = report.Column("seed_count", "Seeds seen", lambda row: float(len(row.runs)), note="**Seeds seen**: x.")
        return [*original(board), extra]

    monkeypatch.setattr(report, "leaderboard_columns", with_one_more)
    write_report(tmp_path)
    assert read_csv(tmp_path / "leaderboard.csv")["lora"]["seed_count"] == "2.0"
    md = (tmp_path / "leaderboard.md").read_text()
    assert "| Seeds seen |" in md and "| 2.00 |" in md and "- **Seeds seen**: x." in md
    assert 'data-key="seed_count"' in (tmp_path / "leaderboard.html").read_text()


@pytest.mark.slow
def test_selected_configuration_column_shows_only_when_runs_record_a_selection(tmp_path):
    write_run(tmp_path, "mini/digits", "linear", 0, top1=80.0, no_head=0.0)
    write_report(tmp_path)
    assert "selected_on_val" not in read_csv(tmp_path / "leaderboard.csv")["linear"]
    for task, lr in (("mini/digits", 0.01), ("mini/mnist", 0.001)):
        for seed in (0, 1):
            write_run(tmp_path, task, "lora", seed, method="lora", top1=90.0)
            path = sweep.run_dir_for(tmp_path, task, "lora", seed) / "result.json"
            result = json.loads(path.read_text())
            result["selection"] = {"space": {"lr": [0.01, 0.001]}, "chosen": {"lr": lr, "wd": 0.0001}}
            path.write_text(json.dumps(result))
    write_report(tmp_path)
    rows = read_csv(tmp_path / "leaderboard.csv")
    assert rows["lora"]["selected_on_val"] == "digits: lr=0.01, wd=0.0001; mnist: lr=0.001, wd=0.0001"
    assert rows["linear"]["selected_on_val"] == ""
    md = (tmp_path / "leaderboard.md").read_text()
    assert "| Selected on val |" in md and "**Selected on val**" in md


def test_no_import_loops_inside_petl_bench():
    import ast

    import petl.bench

    folder = Path(petl.bench.__file__).parent
    graph: dict[str, set[str]] = {}
    for path in folder.glob("*.py"):
        imports = set()
        for node in ast.walk(ast.parse(path.read_text())):  # imports inside functions count too
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("petl.bench."):
                imports.add(node.module.split(".")[2])
            elif isinstance(node, ast.ImportFrom) and node.module == "petl.bench":
                imports |= {alias.name for alias in node.names if (folder / f"{alias.name}.py").exists()}
        graph[path.stem] = imports - {path.stem}

    def reaches(start: str, target: str, seen: set[str]) -> bool:
        for nxt in graph.get(start, ()):
            if nxt == target or (nxt not in seen and reaches(nxt, target, seen | {nxt})):
                return True
        return False

    assert {"args", "params", "table"} <= set(graph)
    loops = sorted(m for m in graph if m != "__init__" and reaches(m, m, {m}))
    assert loops == []


# ----------------------------------------------------------------------------------------------- params


def test_published_precision():
    row = VTAB_ROWS["Full fine-tuning"]
    assert row.params_digits == 1 and row.params_match(85_798_656) and not row.params_match(86_000_000)
    lora = VTAB_ROWS["LoRA"]
    assert lora.params_digits == 2 and lora.params_match(294_912) and not lora.params_match(147_456)
    assert VTAB_ROWS["Linear probing"].params_match(0)


@pytest.mark.slow
def test_params_vtab1k_matches_every_published_row(capsys):
    assert cli.main(["params", "suite=vtab1k"]) == 0
    out = capsys.readouterr().out
    status = {}
    for line in out.splitlines():
        parts = line.split()
        if parts and parts[0] in load_suite("vtab1k", BENCH).experiments:
            status[parts[0]] = line
    # Every experiment with a published row matches it, except those whose file says why: VPT-Deep (per-task
    # prompt lengths), FacT (per-task ranks), RepAdapter (biases left out of the count), Hydra (head counted),
    # LST and HST (V-PETL has no code for them; petl counts the authors' designs); GPS (a published count no count
    # of the reference's selection reproduces), NOAH (a searched subnet), SNF (the code's default flow length).
    explained = {"vpt_deep", "fact", "repadapter", "hydra", "lst", "hst", "gps", "noah", "snf"}
    assert explained | {"bitfit", "ssf", "sct"} <= set(status)
    for name, line in status.items():
        experiment = load_experiment(name, BENCH)
        if not experiment.published:
            assert line.endswith("no published row"), line
        elif name in explained:
            assert line.endswith("differs (explained)"), line
        else:
            assert line.endswith("  ok"), line
    assert "0.08M  ok" in status["vpt_shallow"] and "0.29M  ok" in status["lora"]


def _fake_configs(tmp_path: Path, note: str = "") -> Path:
    (tmp_path / "suites").mkdir(parents=True, exist_ok=True)
    (tmp_path / "experiments").mkdir(exist_ok=True)
    (tmp_path / "suites" / "s.yaml").write_text("experiments: [lora4]\ntasks: [vtab/dtd]\nseeds: [0]\n")
    # Rank 4 is half the count of the published LoRA row (rank 8): 0.15M against 0.29M.
    text = "published: LoRA\n" + note + "method: {name: lora, rank: 4}\n"
    (tmp_path / "experiments" / "lora4.yaml").write_text(text)
    return tmp_path


def test_params_fails_on_a_count_that_differs_unless_the_file_says_why(tmp_path, capsys):
    args = ["params", "suite=s", f"benchmarks_dir={_fake_configs(tmp_path)}"]
    assert cli.main(args) == 1
    assert "DIFFERS" in capsys.readouterr().out
    # A note for another table does not excuse this one.
    _fake_configs(tmp_path, "published_note: {fgvc: another table}\n")
    assert cli.main(args) == 1
    _fake_configs(tmp_path, "published_note: {vtab1k: rank 4 on purpose}\n")
    capsys.readouterr()
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "differs (explained)" in out and "note: rank 4 on purpose" in out


@pytest.mark.parametrize(
    ("model", "said"),
    [
        ("swin_tiny_patch4_window7_224", "method 'fact' does not support the swin backbone"),  # the kind's refusal
        ("vitamin_small_224", "GeGluMlp has no fc1 Linear"),  # petl.apply's own, on this model's blocks
    ],
)
def test_params_on_a_backbone_that_refuses_a_method_says_so_on_its_row_and_counts_the_others(
    tmp_path, capsys, model, said
):
    # Was: petl-bench params model=swin_tiny_... stopped at the suite's first method that backbone refuses (FacT),
    # with petl.apply's error (exit 2) and no count of the methods it takes; petl-bench speed leaves such a row out.
    bench = _fake_configs(tmp_path)
    (bench / "suites" / "s.yaml").write_text("experiments: [fact, lora4]\ntasks: [vtab/dtd]\nseeds: [0]\n")
    (bench / "experiments" / "fact.yaml").write_text("published: FacT\nmethod: {name: fact}\n")
    code, out, err = command_status(capsys, cli.main, "params", "suite=s", f"benchmarks_dir={bench}", f"model={model}")
    assert code == 0 and err == "", err
    fact, reason, lora = out.splitlines()[-3:]
    assert fact.split()[:2] == ["fact", "-"] and fact.endswith("  refused") and said in reason
    assert lora.split()[0] == "lora4" and lora.endswith("differs (other backbone)")


@pytest.mark.slow
def test_params_applies_per_task_method_options_and_spares_another_backbone(tmp_path, capsys):
    bench = _fake_configs(tmp_path)
    suite = "experiments: [lora4]\ntasks: [vtab/dtd, vtab/cifar100]\nseeds: [0]\n"
    # Rank 8 on both tasks is the published LoRA row, whatever the experiment file says.
    both = "per_task:\n  lora4:\n    vtab/dtd: {method.rank: 8}\n    vtab/cifar100: {method.rank: 8}\n"
    (bench / "suites" / "s.yaml").write_text(suite + both)
    args = ["params", "suite=s", f"benchmarks_dir={bench}"]
    assert cli.main(args) == 0
    assert "0.29M  ok" in capsys.readouterr().out
    # Rank 8 on one task, 4 on the other: the mean (0.22M) is shown with the range, and it differs.
    (bench / "suites" / "s.yaml").write_text(suite + "per_task:\n  lora4:\n    vtab/dtd: {method.rank: 8}\n")
    assert cli.main(args) == 1
    out = capsys.readouterr().out
    assert "0.22 " in out and "DIFFERS" in out and "0.15 to 0.29 over the tasks" in out
    # On a backbone the table was not measured on, a difference is expected, not a failure.
    assert cli.main([*args, "model=vit_small_patch16_224"]) == 0
    assert "differs (other backbone)" in capsys.readouterr().out
    # The published network under another pretrained tag is the same architecture: a difference still fails.
    assert cli.main([*args, "model=vit_base_patch16_224.augreg_in21k"]) == 1


# ---------------------------------------------------------------------------------------------- configs


def test_configs_are_found_in_a_checkout_and_the_package_list_is_complete():
    root = Path(__file__).resolve().parents[2]
    assert BENCH == root / "configs"
    import tomllib

    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(p.parent.relative_to(root).parts) for p in (root / "petl").rglob("__init__.py")}
    assert listed == on_disk | {"petl.configs"}


@pytest.mark.slow
def test_a_non_editable_install_carries_the_configs(tmp_path):
    root = Path(__file__).resolve().parents[2]
    source = tmp_path / "src"
    # A copy of what a source distribution holds, so the build leaves nothing in the checkout.
    for name in ("petl", "configs"):
        shutil.copytree(root / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, source / name)
    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--target"]
    subprocess.run([*pip, str(site), str(source)], check=True, timeout=600, capture_output=True)
    assert (site / "petl" / "configs" / "suites" / "vtab1k.yaml").is_file()
    assert (site / "petl" / "configs" / "experiment_lists.yaml").is_file()  # vtab1k.yaml names its `leaderboard`
    assert (site / "petl" / "configs" / "task_lists.yaml").is_file()  # and its `tasks: vtab1k`
    assert (site / "petl" / "configs" / "experiments" / "lora.yaml").is_file()
    # Imported from the install (not this checkout), petl-bench's loader finds the installed presets.
    code = "from petl.bench.suite import configs_dir, load_suite; d = configs_dir(); "
    code += "print(d); print(load_suite('vtab1k', d).name); "
    # ... and so does petl-run's experiment=NAME.
    code += "from petl.cli.run import expand_experiment; print(expand_experiment(['experiment=lora'])[0])"
    # The dependencies stay where this process finds them (the lent GPU machine's kit is a folder on PYTHONPATH),
    # the checkout does not: petl must come from the install.
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != root]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *kept])}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(site / "petl" / "configs"), "vtab1k", "method=lora"]


def test_a_cell_with_a_seed_that_did_not_learn_is_marked_and_named(tmp_path):
    for seed in (0, 1, 2):
        write_run(tmp_path, "mini/mnist", "lora", seed, top1=93.0 if seed == 1 else 9.0)
        write_run(tmp_path, "mini/mnist", "linear", seed, top1=86.0)
        stuck = seed != 1
        losses = [2.4, 2.33, 2.307] if stuck else [2.4, 1.0, 0.3]  # seeds 0 and 2 end at chance, ln 10 = 2.303
        folder = tmp_path / "mini-mnist/lora" / f"seed{seed}"
        metrics = "".join(json.dumps({"epoch": i + 1, "loss": v}) + "\n" for i, v in enumerate(losses))
        (folder / "metrics.jsonl").write_text(metrics)
        record = json.loads((folder / "result.json").read_text())
        (folder / "result.json").write_text(json.dumps({**record, "final_train_loss": losses[-1]}))
    write_report(tmp_path)
    page = (tmp_path / "leaderboard.md").read_text()
    assert "37.00 ± 48.50 †2 ‡ |" in page and "86.00 ± 0.00 |" in page
    assert "1 cell: lora mnist (seed 0, 2)" in page
    rows = {r["experiment"]: r for r in csv.DictReader(io.StringIO((tmp_path / "leaderboard.csv").read_text()))}
    assert (
        rows["lora"]["mini/mnist_not_learned_seeds"] == "0 2" and rows["linear"]["mini/mnist_not_learned_seeds"] == ""
    )


def test_a_sweep_that_trained_nothing_because_of_another_says_so_last(tmp_path, capsys):
    from petl.bench import commands, suite

    summary = sweep.SweepSummary(total=2, already_done=1, held_elsewhere=["mini/digits linear seed0"])
    mini = suite.load_suite("mini", BENCH)
    assert commands._finish(summary, tmp_path, {"report": "false"}, True, mini) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("petl-bench: trained nothing: 1 run(s) are being trained by another sweep")


def test_an_unknown_key_lists_petl_benchs_own_keys_before_any_run(tmp_path, monkeypatch, capsys):
    from petl.cli import bench as cli

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as caught:
        cli.main(["suite=mini", "dryrun=true"])
    err = capsys.readouterr().err
    assert caught.value.code == 2 and err.count("\n") == 1 and "unknown key 'dryrun'" in err
    for own in ("dry_run", "suite", "budget.params", "--dry-run", "train.*"):
        assert own in err
    assert not (tmp_path / "runs").exists()  # nothing ran (it once failed every run of the suite, one by one)
    with pytest.raises(SystemExit) as caught:
        cli.main(["suite=mini", "--dryrun"])
    assert caught.value.code == 2 and "unknown flag '--dryrun'" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [[], ["run"], ["dry_run=true"], ["methods=linear", "--yes"]])
def test_a_run_without_suite_is_refused_naming_where_the_suites_are(argv, tmp_path, capsys, monkeypatch):
    from petl.cli import bench as cli

    # A bare `petl-bench` started suite=mini's 567 runs in the current folder.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as caught:
        cli.main(argv)
    err = capsys.readouterr().err
    assert caught.value.code == 2 and err.startswith("petl-bench: error: no suite= given: ")
    assert "petl-bench list" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "runs").exists()


def test_flags_and_key_values_are_one_grammar(tmp_path, capsys):
    from petl.cli import bench as cli

    words = ["suite=mini", "methods=linear", "tasks=mini/digits", "seeds=0", f"output_dir={tmp_path}"]
    assert cli.main([*words, "--dry-run"]) == 0
    by_flag = capsys.readouterr().out
    assert cli.main([*words, "dry_run=true"]) == 0
    assert capsys.readouterr().out == by_flag and "todo  mini/digits linear seed0" in by_flag
    assert not any(tmp_path.rglob("result.json"))
