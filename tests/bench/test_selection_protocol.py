"""The selection protocol of a searching suite: search on val200, final runs on train800val200, test once.

The end-to-end test runs ``petl-bench`` on a generated VTAB-1k folder in NOAH's layout
(ZhangYuanhan-AI/NOAH@e9c55f3 data/vtab-source/get_vtab1k.py:L53-72: ``<task>/images/<split>/NNNNNN.jpg``
and one ``<split>.txt`` of ``images/<split>/NNNNNN.jpg label`` lines per split, train800val200 written
as its own image copies) with a tiny random ViT; the other tests check the pieces with a fake trainer.
"""

from __future__ import annotations

import csv
import json
import math
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from petl.bench import protocol, report, sweep
from petl.bench import suite as suites
from petl.bench.collect import collect, set_aside_files
from petl.bench.sweep import PlannedRun
from petl.cli import bench as cli
from petl.data.images import FileListDataset
from petl.store import files

# Two VTAB tasks with few classes, under NOAH's folder names (kitti, not kitti_dist).
TASKS = {"vtab/patch_camelyon": ("patch_camelyon", 2), "vtab/kitti_dist": ("kitti", 4)}
SIZES = {"train800": 800, "val200": 200, "train800val200": 1000, "test": 24}


def make_noah_task(folder: Path, num_classes: int, seed: int) -> None:
    """Write one task as NOAH's get_vtab1k.py does: every split its own image files and list."""
    rng = np.random.default_rng(seed)
    colours = rng.integers(0, 256, size=(num_classes, 3))
    for split, size in SIZES.items():
        (folder / "images" / split).mkdir(parents=True)
        lines = []
        for i in range(size):
            label = i % num_classes  # every split covers every class, as the loader's strict check wants
            pixels = np.clip(colours[label] + rng.normal(0, 40, size=(8, 8, 3)), 0, 255).astype(np.uint8)
            relative = f"images/{split}/{i:06d}.jpg"
            Image.fromarray(pixels).save(folder / relative)
            lines.append(f"{relative} {label}\n")
        (folder / f"{split}.txt").write_text("".join(lines))


def write_bench(folder: Path) -> None:
    """A benchmarks folder with one experiment and a suite that searches lr on val."""
    (folder / "experiments").mkdir(parents=True)
    (folder / "suites").mkdir()
    # The name differs from the method's: a trial picked up by the report would show up as "lora".
    (folder / "experiments" / "lora4.yaml").write_text("method: {name: lora, rank: 4}\n")
    (folder / "suites" / "tiny.yaml").write_text(
        "experiments: [lora4]\n"
        f"tasks: [{', '.join(TASKS)}]\n"
        "seeds: [0]\n"
        "search_seed: 0\n"
        "final_split: train800val200\n"
        "search:\n"
        "  train.lr: [1.0e-3, 3.0e-2]\n"
        "train: {epochs: 1, batch_size: 200}\n"
        # The default 32 px FractalDB architecture, shrunk: random weights, no download.
        "model: {name: vit_fractal_tiny_patch4_32, pretrained: false,\n"
        "        kwargs: {depth: 1, embed_dim: 32, num_heads: 2}}\n"
    )


@pytest.mark.slow
def test_search_on_val_then_final_on_1000_images_test_once(tmp_path, monkeypatch, capsys):
    data_root, bench, out = tmp_path / "vtab-1k", tmp_path / "bench", tmp_path / "runs"
    for k, (folder, classes) in enumerate(TASKS.values()):
        make_noah_task(data_root / folder, classes, seed=k)
    write_bench(bench)

    # Count every image read, by path: the test images must be read by the final runs only, once each.
    reads: Counter[Path] = Counter()
    original = FileListDataset.__getitem__

    def counting(self, index):
        reads[self.items[index][0]] += 1
        return original(self, index)

    monkeypatch.setattr(FileListDataset, "__getitem__", counting)
    args = [
        "suite=tiny",
        f"benchmarks_dir={bench}",
        f"data.root={data_root}",
        f"output_dir={out}",
        "progress=false",
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cli.main(args) == 0

    experiments = {"lora4": "lora"}
    for task, (folder, _) in TASKS.items():
        for name, method in experiments.items():
            cell = out / sweep.task_folder(task) / name
            trials = {}
            for trial_dir in sorted((cell / "search").iterdir()):
                result = json.loads((trial_dir / "result.json").read_text())
                # Trials train on 800 images, are scored on val200, and never see the test split.
                assert result["split"] == "train800" and result["test_top1"] is None
                assert result["val_top1"] is not None and result["seed"] == 0
                assert not (trial_dir / "trainable.safetensors").exists()
                rows = [json.loads(line) for line in (trial_dir / "metrics.jsonl").read_text().splitlines()]
                assert [r["images"] for r in rows] == [800]
                trials[result["config"]["train"]["lr"]] = result["val_top1"]
            assert sorted(trials) == [1e-3, 3e-2]

            final = json.loads((cell / "seed0" / "result.json").read_text())
            assert final["method"] == method and final["split"] == "train800val200"
            assert final["test_top1"] is not None and final["val_top1"] is None
            rows = [json.loads(line) for line in (cell / "seed0" / "metrics.jsonl").read_text().splitlines()]
            assert [r["images"] for r in rows] == [1000]  # the final run trained on all 1,000 images
            selection = final["selection"]
            assert selection["space"] == {"train.lr": [1e-3, 3e-2]}
            assert {t["overrides"]["train.lr"]: t["val_top1"] for t in selection["trials"]} == trials
            # The choice is the best val accuracy (ties: the first grid point), and the final run used it.
            best = max(trials.values())
            expected = next(lr for lr in (1e-3, 3e-2) if trials[lr] == best)
            assert selection["chosen"] == {"train.lr": expected}
            assert final["config"]["train"]["lr"] == expected

        # Every test image of the task was read exactly once: by the one final run, after training.
        test_images = [data_root / folder / f"images/test/{i:06d}.jpg" for i in range(SIZES["test"])]
        assert {p: reads[p] for p in test_images} == {p: 1 for p in test_images}
    assert sum(n for p, n in reads.items() if "/images/test/" in p.as_posix()) == len(TASKS) * SIZES["test"]

    # The report shows the final runs only: one row per experiment, the trials (method names) absent.
    with (out / "leaderboard.csv").open() as f:
        board = {row["experiment"]: row for row in csv.DictReader(f)}
    assert set(board) == set(experiments)
    final = json.loads((out / "vtab-kitti_dist/lora4/seed0/result.json").read_text())
    assert float(board["lora4"]["vtab/kitti_dist_top1_mean"]) == pytest.approx(final["test_top1"])

    # NOAH writes train800val200 as its own image copies: that layout is no reason for a warning.
    assert [str(w.message) for w in caught if "not the union" in str(w.message)] == []

    capsys.readouterr()
    assert cli.main(args) == 0  # resumed: every trial and final is done, nothing trains again
    assert "6 runs: 6 already done, 0 trained" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# The pieces, with a fake trainer
# ---------------------------------------------------------------------------------------------


def _suite(**fields) -> suites.Suite:
    base = dict(name="s", experiments=["e"], tasks=["mini/digits"], seeds=[0, 1])
    return suites.Suite(**{**base, **fields})


def test_grid_order_and_names():
    space = {"train.lr": [1e-3, 1e-2], "train.weight_decay": [1e-4, 1e-3]}
    points = protocol.grid(space)
    assert points[:2] == [
        {"train.lr": 1e-3, "train.weight_decay": 1e-4},
        {"train.lr": 1e-3, "train.weight_decay": 1e-3},
    ]
    assert len(points) == 4 and len({protocol.point_name(p) for p in points}) == 4
    assert protocol.point_name(points[0]) == "train.lr=0.001,train.weight_decay=0.0001"


def test_experiment_pins_and_extends_the_suite_space():
    suite = _suite(search={"train.lr": [1e-3, 1e-2], "train.weight_decay": [1e-4, 1e-3]})
    full = suites.Experiment("full", {"name": "full"}, {"train": {"lr": 1e-4}})
    assert suite.space_for(full) == {"train.weight_decay": [1e-4, 1e-3]}
    lora = suites.Experiment("lora", {"name": "lora"}, search={"method.rank": [4, 8]})
    assert suite.space_for(lora) == {**suite.search, "method.rank": [4, 8]}
    assert _suite().space_for(lora) == {}  # a suite that does not search runs as before


def _fake_trainer(val_by_lr: dict[float, float], trained: list[list[str]]):
    """A train_fn/compose_fn pair that writes a result.json whose val accuracy depends on train.lr."""

    def compose(overrides):
        return {k: v.strip("'") for k, _, v in (o.partition("=") for o in overrides)}

    def train(cfg):
        trained.append(cfg)
        out = Path(cfg["output_dir"])
        out.mkdir(parents=True, exist_ok=True)
        lr = float(cfg.get("train.lr", "nan"))
        trial = cfg.get("train.eval_test") == "false"
        result = {
            "dataset": cfg["data"],
            "seed": int(cfg["seed"]),
            "split": cfg["data.split"],
            "val_top1": val_by_lr.get(lr) if trial else None,
            "test_top1": None if trial else 50.0,
            "config": {"train": {"lr": lr}},
        }
        (out / "result.json").write_text(json.dumps(result))
        return result

    return {"train_fn": train, "compose_fn": compose}


def test_free_form_keys_get_plus_plus_and_per_task_pins_beat_an_experiment_search(tmp_path):
    suite = _suite(
        search={"train.lr": [1e-3, 1e-2], "model.kwargs.drop_rate": [0.0, 0.1]},
        per_task={"e": {"mini/digits": {"train.lr": 0.0032, "model.kwargs.qkv_bias": False}}},
    )
    exp = suites.Experiment("e", {"name": "lora"}, search={"train.lr": [1e-4]})
    assert suite.space_for(exp, "mini/digits") == {"model.kwargs.drop_rate": [0.0, 0.1]}
    assert suite.space_for(exp, "mini/mnist") == {"train.lr": [1e-4], "model.kwargs.drop_rate": [0.0, 0.1]}
    assert suite.task_overrides("e", "mini/digits") == ["train.lr=0.0032", "++model.kwargs.qkv_bias=false"]
    cells = protocol.plan_cells(suite, [exp], ["mini/digits"], [0], tmp_path)
    assert "++model.kwargs.drop_rate=0.1" in cells[0].trials[1].run.overrides


def test_sweep_owned_keys_are_refused_with_any_prefix():
    from petl.bench.args import parse_args

    for arg in ("seed=3", "+seed=3", "++seed=7", "data.name=mini/mnist", "++data=mini/mnist", "method.rank=2"):
        with pytest.raises(SystemExit, match="is set per run by the sweep"):
            parse_args([arg], set())
    assert parse_args(["data.root=/x", "+model.kwargs.depth=2"], set()) == (
        {},
        ["data.root=/x", "+model.kwargs.depth=2"],
    )


def test_ties_go_to_the_first_grid_point_and_finals_use_the_choice(tmp_path):
    suite = _suite(search={"train.lr": [1e-3, 1e-2, 1e-1]})
    exp = suites.Experiment("e", {"name": "lora"})
    cells = protocol.plan_cells(suite, [exp], ["mini/digits"], [0, 1], tmp_path)
    trained: list = []
    fakes = _fake_trainer({1e-3: 60.0, 1e-2: 70.0, 1e-1: 70.0}, trained)
    summary = protocol.run_protocol(cells, progress=False, **fakes)
    assert summary.trained == 5 and not summary.failed and not summary.waiting
    trials, finals = trained[:3], trained[3:]
    assert all(t["data.split"] == "train800" and t["seed"] == "0" for t in trials)
    assert [f["train.lr"] for f in finals] == ["0.01", "0.01"]  # 70.0 twice: the earlier point wins
    assert [(f["data.split"], f["seed"]) for f in finals] == [("train800val200", "0"), ("train800val200", "1")]
    result = json.loads((tmp_path / "mini-digits/e/seed1/result.json").read_text())
    assert result["selection"]["chosen"] == {"train.lr": 1e-2}
    assert [t["val_top1"] for t in result["selection"]["trials"]] == [60.0, 70.0, 70.0]


def test_a_pinned_experiment_gets_one_trial_for_its_val_curve_under_pinned_trial(tmp_path):
    full = suites.Experiment("full", {"name": "full"}, {"train": {"lr": 1e-4}})
    lora = suites.Experiment("lora", {"name": "lora"})
    plain = protocol.plan_cells(_suite(search={"train.lr": [1e-3]}), [full], ["mini/digits"], [0], tmp_path)
    assert plain[0].trials == []  # without the option: straight to the finals
    suite = _suite(search={"train.lr": [1e-3, 1e-2]}, pinned_trial=True)
    cells = protocol.plan_cells(suite, [full, lora], ["mini/digits"], [0], tmp_path)
    assert [t.run.run_dir.relative_to(tmp_path).as_posix() for t in cells[0].trials] == [
        "mini-digits/full/search/defaults"
    ]
    assert len(cells[1].trials) == 2  # a searched experiment is unchanged
    trained: list = []
    summary = protocol.run_protocol(cells, progress=False, **_fake_trainer({}, trained))
    assert summary.trained == 5 and not summary.failed
    trial = next(t for t in trained if t["output_dir"].endswith("full/search/defaults"))
    assert trial["data.split"] == "train800" and trial["train.eval_test"] == "false"
    result = json.loads((tmp_path / "mini-digits/full/seed0/result.json").read_text())
    assert result["selection"]["chosen"] == {} and result["selection"]["space"] == {}
    assert result["selection"]["trials"][0]["output_dir"] == "mini-digits/full/search/defaults"


def test_a_diverged_trial_is_scored_last_and_the_finals_go_ahead(tmp_path):
    from petl.train.runner import DivergedError

    suite = _suite(search={"train.lr": [1e-1, 1e-3]})
    cells = protocol.plan_cells(suite, [suites.Experiment("e", {"name": "lora"})], ["mini/digits"], [0], tmp_path)
    trained: list = []
    fakes = _fake_trainer({1e-3: 40.0}, trained)
    real_train = fakes["train_fn"]

    def train(cfg):
        if cfg.get("train.lr") == "0.1":
            raise DivergedError("loss became nan at epoch 2")
        return real_train(cfg)

    summary = protocol.run_protocol(cells, progress=False, train_fn=train, compose_fn=fakes["compose_fn"])
    assert not summary.failed and not summary.waiting and len(summary.diverged) == 1
    result = json.loads((tmp_path / "mini-digits/e/seed0/result.json").read_text())
    assert result["selection"]["chosen"] == {"train.lr": 1e-3}
    assert result["selection"]["trials"][0]["diverged"] is True and "diverged" not in result["selection"]["trials"][1]
    # The next invocation trains nothing: the diverged trial has its result.
    again = protocol.run_protocol(cells, progress=False, train_fn=train, compose_fn=fakes["compose_fn"])
    assert again.trained == 0 and not again.diverged
    # Any other error in a trial still blocks the cell (and is reported as a failure).
    other = protocol.plan_cells(suite, [suites.Experiment("f", {"name": "lora"})], ["mini/digits"], [0], tmp_path)

    def broken(cfg):
        raise OSError("data not found")

    summary = protocol.run_protocol(other, progress=False, train_fn=broken, compose_fn=fakes["compose_fn"])
    assert len(summary.failed) == 2 and len(summary.waiting) == 1 and not summary.diverged


def test_a_finished_trial_of_another_config_is_not_reused(tmp_path):
    suite = _suite(search={"train.lr": [1e-3, 1e-2]})
    cells = protocol.plan_cells(suite, [suites.Experiment("e", {"name": "lora"})], ["mini/digits"], [0], tmp_path)
    trained: list = []
    fakes = _fake_trainer({1e-3: 40.0, 1e-2: 50.0}, trained)
    protocol.run_protocol(cells, progress=False, **fakes)
    stale = cells[0].trials[1].run  # as if the suite's epochs had been edited since it finished

    def check(cfg):
        if cfg["output_dir"] == str(stale.run_dir):
            raise ValueError("holds a run with another config (train.epochs: 20 -> 30)")

    summary = protocol.run_protocol(cells, progress=False, check_fn=check, **fakes)
    assert summary.stale == [stale.label] and any("train.epochs: 20 -> 30" in f for f in summary.failed)
    assert summary.waiting and "another config" in summary.waiting[0]


@pytest.mark.slow
def test_check_finished_compares_the_config_a_run_was_trained_with(tmp_path):
    from conftest import tiny_run

    from petl.run import default_config, train
    from petl.train.config import ConfigError
    from petl.train.runner import check_finished

    overrides = [*tiny_run(subset=32, epochs=1), "method=linear", f"output_dir={tmp_path}"]
    train(default_config(overrides))
    check_finished(default_config(overrides))  # the same config: fine
    with pytest.raises(ConfigError, match="another config .*train.epochs: 1 -> 2"):
        check_finished(default_config([*overrides, "train.epochs=2"]))
    check_finished(default_config([*overrides, "train.progress=true"]))  # neutral keys do not count
    # A key petl did not have when the run finished is no difference (new options default to the old behaviour).
    result = json.loads((tmp_path / "result.json").read_text())
    del result["config"]["train"]["weight_decay_all"]
    (tmp_path / "result.json").write_text(json.dumps(result))
    check_finished(default_config(overrides))


def test_finals_wait_for_a_complete_search(tmp_path):
    suite = _suite(search={"train.lr": [1e-3, 1e-2]})
    cells = protocol.plan_cells(suite, [suites.Experiment("e", {"name": "lora"})], ["mini/digits"], [0], tmp_path)
    held = cells[0].trials[1].run
    held.run_dir.mkdir(parents=True)
    (held.run_dir / sweep.LOCK_FILE).write_text(json.dumps({"host": "elsewhere", "pid": 1}))
    trained: list = []
    summary = protocol.run_protocol(cells, progress=False, **_fake_trainer({1e-3: 1.0}, trained))
    assert len(trained) == 1 and len(summary.held_elsewhere) == 1 and len(summary.waiting) == 1
    assert not (tmp_path / "mini-digits/e/seed0").exists()


def test_command_line_cannot_override_what_the_protocol_sets(tmp_path):
    suite = _suite(search={"train.lr": [1e-3, 1e-2]})
    exp = suites.Experiment("e", {"name": "lora"})
    for override in ("train.lr=0.1", "data.split=train800", "train.eval_test=true"):
        with pytest.raises(ValueError, match="set per run by suite s's selection protocol"):
            protocol.plan_cells(suite, [exp], ["mini/digits"], [0], tmp_path, [override])


def test_suite_file_validation(tmp_path):
    (tmp_path / "experiments").mkdir()
    (tmp_path / "suites").mkdir()
    base = "experiments: [lora]\ntasks: [mini/digits]\nseeds: [0]\n"
    cases = {
        "search:\n  lr: [1]\n": "search key 'lr'",
        "search:\n  train.lr: []\n": "must list at least one value",
        "search:\n  data.split: [train800]\n": "search key 'data.split'",
        "search_seed: 1\n": "needs a `search:` space",
        "per_task: {vpt: {mini/digits: {train.lr: 0.1}}}\n": "'vpt' is not one of the suite's experiments",
        "per_task: {lora: {mini/mnist: {train.lr: 0.1}}}\n": "'mini/mnist' is not one of the suite's tasks",
        "per_task: {lora: {mini/digits: {lr: 0.1}}}\n": "'lr' is not an option key",
        "data: {split: train800}\n": "data.split are set per run",
        "pinned_trial: true\n": "`pinned_trial` needs a `search:` space",
        "search: {train.lr: [0.001]}\npinned_trial: 1\n": "`pinned_trial` must be true or false",
        "search: {train.lr: [0.001]}\nfinal_split: test\n": "final_split 'test': expected one of",
    }
    for extra, message in cases.items():
        (tmp_path / "suites" / "bad.yaml").write_text(base + extra)
        with pytest.raises(ValueError, match=message):
            suites.load_suite("bad", tmp_path)
    (tmp_path / "suites" / "ok.yaml").write_text(
        base + "search: {train.lr: [0.001]}\nmodel: {name: vit_base_patch16_224.orig_in21k}\ndata: {subset: 8}\n"
    )
    suite = suites.load_suite("ok", tmp_path)
    assert suite.overrides() == ["model=vit_base_patch16_224.orig_in21k", "data.subset=8"]
    # YAML 1.1 reads `1e-3` (no dot) as a string; preset files read it as the float Hydra would.
    (tmp_path / "suites" / "exp.yaml").write_text(base + "search: {train.lr: [1e-3, 2.5E-2], method.type: [tk]}\n")
    assert suites.load_suite("exp", tmp_path).search == {"train.lr": [1e-3, 2.5e-2], "method.type": ["tk"]}
    assert (suite.search_seed, suite.final_split) == (0, "train800val200")


def test_shipped_suites_carry_their_protocol():
    bench = suites.configs_dir()
    for name in ("vtab1k", "fgvc"):
        suite = suites.load_suite(name, bench)
        assert "model=vit_base_patch16_224.orig_in21k" in suite.overrides()
        assert suite.search and suite.final_split == "train800val200" and suite.seeds == [0, 1, 2]
    assert not suites.load_suite("mini", bench).search  # re-run under the protocol by issue 12


@pytest.mark.slow
def test_shipped_suites_compose_into_valid_run_configs(tmp_path):
    from petl.run import default_config

    bench = suites.configs_dir()
    vtab = suites.load_suite("vtab1k", bench)
    cell = protocol.plan_cells(vtab, [suites.load_experiment("lora", bench)], ["vtab/dmlab"], [0], tmp_path)[0]
    trial = default_config(list(cell.trials[-1].run.overrides))
    assert trial.model.name == "vit_base_patch16_224.orig_in21k"
    assert (trial.data.split, trial.train.eval_test) == ("train800", False)
    assert (trial.train.lr, trial.train.weight_decay) == (1e-2, 1e-3)  # the last grid point
    # The "reproduce V-PETL" preset: V-PETL's per-task numbers (scripts/run_vit_vptshallow.sh, dmlab line).
    preset = suites.load_suite("vtab1k_vpetl", bench)
    vpt = suites.load_experiment("vpt_shallow", bench)
    run = sweep.plan([vpt], ["vtab/dmlab"], [0], tmp_path, preset.overrides(), (), preset)[0]
    cfg = default_config(list(run.overrides))
    assert (cfg.train.lr, cfg.train.weight_decay, cfg.method.num_tokens) == (0.009, 0.1, 100)
    assert cfg.data.split == "train800val200" and not cfg.method.deep
    wave1 = {"lora", "adapter_sequential", "adapter_parallel", "vpt_shallow"}
    for name, per_task in (("vtab1k_vpetl", wave1 | {"gps", "noah"}), ("fgvc_vpetl", wave1)):
        preset = suites.load_suite(name, bench)
        assert set(preset.per_task) == per_task
        assert all(set(by_task) == set(preset.tasks) for by_task in preset.per_task.values())


@pytest.mark.slow
def test_the_vpetl_presets_start_lora_and_the_adapters_as_vpetl_runs_them(tmp_path):
    """V-PETL re-draws its methods' Linears at construction: its preset rows build with init=reference."""
    import torch
    from conftest import make_tiny_vit

    import petl
    from petl.run import default_config

    bench = suites.configs_dir()
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    for suite_name, task in (("vtab1k_vpetl", "vtab/dmlab"), ("fgvc_vpetl", "fgvc/cub"), ("vtab1k", "vtab/dmlab")):
        suite = suites.load_suite(suite_name, bench)
        for name in ("lora", "adapter_sequential", "adapter_parallel"):
            exp = suites.load_experiment(name, bench)
            run = sweep.plan([exp], [task], [0], tmp_path, suite.overrides(), (), suite)[0]
            method = dict(default_config(list(run.overrides)).method)
            reference = suite_name.endswith("_vpetl")
            assert method["init"] == ("reference" if reference else "zero"), (suite_name, name)
            # The row builds (on a tiny ViT): the reference's start is not the backbone's function, petl's is.
            options = {k: method[k] for k in ("init", "rank", "style", "dim") if k in method}
            backbone = make_tiny_vit()
            model = petl.apply(make_tiny_vit(), method["name"], num_classes=5, **options)
            model.head.load_state_dict(backbone.head.state_dict())
            unchanged = torch.allclose(model(images), backbone(images), atol=1e-6)
            assert unchanged != reference, (suite_name, name)
            zeros = [n for n, p in model.named_parameters() if p.requires_grad and p.dim() > 1 and not p.any()]
            assert bool(zeros) != reference, (suite_name, name, zeros)
    # NOAH's constructor re-draws the same way (supernet_vision_transformer_timm.py L462): its preset rows too.
    noah = suites.load_experiment("noah", bench)
    for suite_name, init in (("vtab1k_vpetl", "reference"), ("vtab1k", "zero")):
        suite = suites.load_suite(suite_name, bench)
        run = sweep.plan([noah], ["vtab/dmlab"], [0], tmp_path, suite.overrides(), (), suite)[0]
        assert default_config(list(run.overrides)).method.init == init, suite_name


def test_planned_run_label():
    run = PlannedRun("t", "e", 0, Path("x"), ())
    assert run.label == "t e seed0" and PlannedRun("t", "e", 0, Path("x"), (), "named").label == "named"


def test_per_task_settings_and_final_split_without_search(tmp_path):
    per_task = {"e": {"mini/mnist": {"train.lr": 0.005, "train.label_smoothing": 0.1}}}
    preset = _suite(tasks=["mini/digits", "mini/mnist"], final_split="train800val200", per_task=per_task)
    exp = suites.Experiment("e", {"name": "lora"})
    runs = sweep.plan([exp], preset.tasks, [0], tmp_path, preset.overrides(), ["train.epochs=1"], preset)
    digits, mnist = (r.overrides for r in runs)
    assert "train.lr=0.005" in mnist and "train.label_smoothing=0.1" in mnist and "train.lr=0.005" not in digits
    assert all("data.split=train800val200" in o for o in (digits, mnist))
    assert "data.split=train800val200" not in sweep.plan([exp], ["mini/digits"], [0], tmp_path)[0].overrides
    # In a searching suite a per-task setting pins its key: that task's grid leaves it out.
    searching = _suite(tasks=["mini/digits", "mini/mnist"], search={"train.lr": [1e-3, 1e-2]}, per_task=per_task)
    assert searching.space_for(exp, "mini/mnist") == {} and searching.space_for(exp, "mini/digits") != {}


def test_a_final_run_of_another_point_is_not_relabelled(tmp_path):
    suite = _suite(search={"train.lr": [1e-3, 1e-2]})
    cells = protocol.plan_cells(suite, [suites.Experiment("e", {"name": "lora"})], ["mini/digits"], [0], tmp_path)
    trained: list = []
    protocol.run_protocol(cells, progress=False, **_fake_trainer({1e-3: 60.0, 1e-2: 50.0}, trained))
    final = tmp_path / "mini-digits/e/seed0/result.json"
    assert json.loads(final.read_text())["selection"]["chosen"] == {"train.lr": 1e-3}
    # The trials change afterwards (say, more epochs): the finished final trained 1e-3, the search now says 1e-2.
    trial = cells[0].trials[1].run.run_dir / "result.json"
    trial.write_text(json.dumps({**json.loads(trial.read_text()), "val_top1": 99.0}))
    summary = protocol.run_protocol(cells, progress=False, **_fake_trainer({}, trained))
    assert len(summary.failed) == 1 and "delete" in summary.failed[0]
    assert json.loads(final.read_text())["selection"]["chosen"] == {"train.lr": 1e-3}


# ---------------------------------------------------------------------------------------------
# calibrate_once: one calibration per task (NOAH's search), reused by the task's other runs
# ---------------------------------------------------------------------------------------------


def _calibrating_trainer(trained: list, calibrated: list[str]):
    """The fake trainer, with a method whose ``widths`` option a calibration fills when it is not given."""
    fakes = _fake_trainer({1e-3: 60.0, 1e-2: 70.0}, trained)

    def train(cfg):
        fakes["train_fn"](cfg)
        widths = cfg.get("method.widths")
        if widths is None:
            calibrated.append(Path(cfg["output_dir"]).relative_to(cfg["+root"]).as_posix())
            widths = f"{len(calibrated)},0"
        out = Path(cfg["output_dir"]) / "result.json"
        record = json.loads(out.read_text())
        record["method_config"] = {"num_classes": 10, "widths": widths, "dropout": 0.1}
        record["config"]["method"] = {"name": "m", "widths": "", "dropout": 0.1}
        out.write_text(json.dumps(record))

    return {"train_fn": train, "compose_fn": fakes["compose_fn"]}


def test_calibrate_once_calibrates_in_the_first_trial_and_the_task_reuses_it(tmp_path):
    suite = _suite(search={"train.lr": [1e-3, 1e-2]})
    once = suites.Experiment("e", {"name": "noah"}, calibrate_once=True)
    cells = protocol.plan_cells(suite, [once], ["mini/digits", "mini/mnist"], [0, 1], tmp_path, [f"+root={tmp_path}"])
    trained: list = []
    calibrated: list[str] = []
    fakes = _calibrating_trainer(trained, calibrated)
    # A run whose calibrating run comes later in the sweep waits for it instead of calibrating itself.
    trials = [t.run for cell in cells for t in reversed(cell.trials)]
    summary = sweep.run_sweep(trials, progress=False, **fakes)
    assert summary.trained == 4 and not summary.waiting and not summary.failed
    summary = protocol.run_protocol(cells, progress=False, **fakes)
    assert summary.trained == 4 and not summary.failed  # the four finals
    assert calibrated == ["mini-digits/e/search/train.lr=0.001", "mini-mnist/e/search/train.lr=0.001"]
    for task, widths in (("mini/digits", "1,0"), ("mini/mnist", "2,0")):
        runs = [t for t in trained if f"/{sweep.task_folder(task)}/" in t["output_dir"]]
        assert len(runs) == 4 and [t.get("method.widths") for t in runs[1:]] == [widths] * 3
        final = json.loads((tmp_path / sweep.task_folder(task) / "e/seed1/result.json").read_text())
        assert final["method_config"]["widths"] == widths and final["selection"]["chosen"] == {"train.lr": 1e-2}
    # Finished runs are checked with the reused options: nothing is stale on the next invocation.
    again = protocol.run_protocol(cells, progress=False, check_fn=lambda cfg: None, **fakes)
    assert again.trained == 0 and again.already_done == 8 and not again.failed


def test_calibrate_once_waits_while_the_calibrating_run_is_held_elsewhere(tmp_path):
    suite = _suite(search={"train.lr": [1e-3, 1e-2]})
    once = suites.Experiment("e", {"name": "noah"}, calibrate_once=True)
    cells = protocol.plan_cells(suite, [once], ["mini/digits"], [0], tmp_path, [f"+root={tmp_path}"])
    held = cells[0].trials[0].run
    held.run_dir.mkdir(parents=True)
    (held.run_dir / sweep.LOCK_FILE).write_text(json.dumps({"host": "elsewhere", "pid": 1}))
    trained: list = []
    summary = protocol.run_protocol(cells, progress=False, **_calibrating_trainer(trained, []))
    assert trained == [] and summary.held_elsewhere == [held.label]
    assert any("waits for the calibration" in w for w in summary.waiting)
    assert any("search incomplete" in w for w in summary.waiting)


def test_calibrate_once_without_a_search_reuses_the_first_seed(tmp_path):
    once = suites.Experiment("e", {"name": "noah"}, calibrate_once=True)
    extra = [f"+root={tmp_path}", "data.split=train800"]
    runs = sweep.plan([once], ["mini/digits"], [0, 1, 2], tmp_path, extra_overrides=extra)
    assert [r.calibrated_by for r in runs] == [None, runs[0].run_dir, runs[0].run_dir]
    trained: list = []
    calibrated: list[str] = []
    summary = sweep.run_sweep(runs[::-1], progress=False, **_calibrating_trainer(trained, calibrated))
    assert summary.trained == 3 and calibrated == ["mini-digits/e/seed0"]
    assert [t.get("method.widths") for t in trained] == [None, "1,0", "1,0"]
    # Under a searching suite without trials (every searched key pinned), the first seed's final calibrates.
    pinned = suites.Experiment("p", {"name": "noah"}, {"train": {"lr": 1e-4}}, calibrate_once=True)
    cell = protocol.plan_cells(_suite(search={"train.lr": [1e-3]}), [pinned], ["mini/digits"], [0, 1], tmp_path)[0]
    finals = cell.finals({})
    assert cell.trials == [] and [r.calibrated_by for r in finals] == [None, finals[0].run_dir]


def test_calibrated_options_are_those_the_calibration_changed(tmp_path):
    from petl.bench.calibration import calibrated_options, calibration_overrides

    given = {"method": {"name": "sct", "channels": [], "top_n": None}}
    chosen = {"num_classes": 10, "channels": ["1,2", "3,4"], "top_n": None}
    assert calibrated_options(given, chosen) == {"channels": ["1,2", "3,4"]}
    kept = {"method": {"name": "sct", "channels": ["1,2"]}}
    assert calibrated_options(kept, {"num_classes": 10, "channels": ("1,2",)}) == {}
    assert calibration_overrides(tmp_path) is None  # no result yet
    (tmp_path / "result.json").write_text(json.dumps({"method": "sct", "dataset": "d", "seed": 0}))
    with pytest.raises(ValueError, match="records no method_config to reuse") as caught:
        calibration_overrides(tmp_path)
    # Was: "delete it to calibrate again"; a finished run is set aside, under a name the reports skip.
    assert "delete" not in str(caught.value) and f"move its folder aside (rename {tmp_path} to " in str(caught.value)
    assert f"to {tmp_path.name}{files.REPLACED_MARK}old)" in str(caught.value)  # a name the reports skip


def test_calibrate_once_needs_a_calibrate_hook_and_multirun_lines_refuse_it(tmp_path, capsys):
    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "bad.yaml").write_text("calibrate_once: true\nmethod: {name: lora}\n")
    with pytest.raises(ValueError, match="method lora has no calibrate hook"):
        suites.load_experiment("bad", tmp_path)
    (tmp_path / "experiments" / "odd.yaml").write_text("calibrate_once: yes please\nmethod: {name: noah}\n")
    with pytest.raises(ValueError, match="must be true or false"):
        suites.load_experiment("odd", tmp_path)
    assert suites.load_experiment("noah", suites.configs_dir()).calibrate_once
    # petl-run --multirun lines cannot hand one seed's calibration to the next.
    with pytest.raises(SystemExit) as exit_:
        cli.main(["commands", "suite=mini", "methods=noah"])
    assert exit_.value.code == cli.USAGE_ERROR
    assert "noah calibrate once per task" in capsys.readouterr().err
    assert cli.main(["commands", "suite=mini", "methods=noah", "seeds=0"]) == 0
    assert "method.search_epochs=50" in capsys.readouterr().out  # the suite's own NOAH budget
    args = ["suite=mini_selection", "methods=noah", "tasks=mini/digits", "dry_run=true", f"output_dir={tmp_path}"]
    assert cli.main(args) == 0
    second_trial = capsys.readouterr().out.splitlines()[2]
    assert "train.lr=0.01" in second_trial and "(+ the calibration of" in second_trial


def test_per_experiment_settings_apply_to_one_experiment_and_pin_their_keys(tmp_path):
    suite = _suite(search={"train.lr": [1e-3, 1e-2]}, per_experiment={"e": {"method.search_epochs": 100}})
    exp, other = suites.Experiment("e", {"name": "noah"}), suites.Experiment("o", {"name": "noah"})
    assert suite.task_overrides("e", "mini/digits") == ["method.search_epochs=100"]
    assert suite.task_overrides("o", "mini/digits") == []
    pinned = _suite(search={"method.search_epochs": [1, 2]}, per_experiment={"e": {"method.search_epochs": 5}})
    assert pinned.space_for(exp) == {} and pinned.space_for(other) == {"method.search_epochs": [1, 2]}
    (tmp_path / "suites").mkdir()
    base = "experiments: [noah]\ntasks: [mini/digits]\nseeds: [0]\n"
    for extra, message in {
        "per_experiment: {lora: {train.lr: 0.1}}\n": "'lora' is not one of the suite's experiments",
        "per_experiment: {noah: {lr: 0.1}}\n": "'lr' is not an option key",
        "per_experiment: [noah]\n": "must map experiments to option overrides",
    }.items():
        (tmp_path / "suites" / "bad.yaml").write_text(base + extra)
        with pytest.raises(ValueError, match=message):
            suites.load_suite("bad", tmp_path)
    # The shipped mini suites scale NOAH's supernet epochs to their own (5x, as NOAH's 500 to 100).
    bench = suites.configs_dir()
    for name, epochs in (("mini_selection", 100), ("mini", 50), ("mini_dinov2", 50)):
        assert suites.load_suite(name, bench).per_experiment == {"noah": {"method.search_epochs": epochs}}
    assert not suites.load_suite("vtab1k", bench).per_experiment  # NOAH's own 500 on VTAB-1k


def _stuck_trainer(val_by_lr: dict[float, float], stuck: set[tuple[float, str]], trained: list):
    """:func:`_fake_trainer` whose runs at (lr, seed) in ``stuck`` end at chance (ln 10) on 10 classes."""
    fakes = _fake_trainer(val_by_lr, trained)

    def train(cfg):
        result = fakes["train_fn"](cfg)
        lr, seed = float(cfg["train.lr"]), cfg["seed"]
        loss = math.log(10) if (lr, seed) in stuck else 0.5
        result.update(
            num_classes=10, final_train_loss=loss, trainable_params=2, trainable_params_no_head=1, total_params=9
        )
        (Path(cfg["output_dir"]) / "result.json").write_text(json.dumps(result))
        return result

    return {"train_fn": train, "compose_fn": fakes["compose_fn"]}


def test_require_learning_sets_a_point_aside_whose_finals_did_not_learn(tmp_path):
    suite = _suite(search={"train.lr": [1e-3, 1e-2]}, require_learning=True)
    cells = protocol.plan_cells(suite, [suites.Experiment("e", {"name": "lora"})], ["mini/digits"], [0, 1], tmp_path)
    trained: list = []
    fakes = _stuck_trainer({1e-3: 60.0, 1e-2: 70.0}, {(1e-2, "1")}, trained)
    # Val chose 1e-2; its seed 1 ended at chance, so in the same invocation both its finals are set aside and
    # 1e-3's finals train (a sweep going on to other methods must not leave the cell at chance).
    first = protocol.run_protocol(cells, progress=False, **fakes)
    assert first.trained == 6 and len(first.set_aside) == 2
    cell = tmp_path / "mini-digits/e"
    assert sorted(p.name for p in (cell / "unstable" / "train.lr=0.01").iterdir()) == ["seed0", "seed1"]
    assert [t["train.lr"] for t in trained[4:]] == ["0.001", "0.001"]
    selection = json.loads((cell / "seed0" / "result.json").read_text())["selection"]
    assert selection["chosen"] == {"train.lr": 1e-3} and selection["learning"]["best_val"] == {"train.lr": 1e-2}
    assert selection["learning"]["unstable"] == ["train.lr=0.01"]
    # The set-aside finals are kept but never reported; a third invocation has nothing to do.
    assert {(r.experiment, r.seed) for r in collect(tmp_path)} == {("e", 0), ("e", 1)}
    assert len(set_aside_files(tmp_path)) == 2
    second = protocol.run_protocol(cells, progress=False, **fakes)
    assert second.trained == 0 and not second.set_aside and not second.failed


def test_a_set_aside_record_that_does_not_read_is_named_and_the_report_still_written(tmp_path):
    suite = _suite(search={"train.lr": [1e-3, 1e-2]}, require_learning=True)
    cells = protocol.plan_cells(suite, [suites.Experiment("e", {"name": "lora"})], ["mini/digits"], [0, 1], tmp_path)
    protocol.run_protocol(cells, progress=False, **_stuck_trainer({1e-3: 60.0, 1e-2: 70.0}, {(1e-2, "1")}, []))
    aside = tmp_path / "mini-digits/e/unstable/train.lr=0.01/seed1/result.json"
    aside.write_text(json.dumps({**json.loads(aside.read_text()), "test_top1": 1234.5}))
    # The reader refuses it (test_top1 out of range); the legend counts it by its folder, the report goes on.
    with pytest.warns(UserWarning, match=f"set-aside run: {aside}: field 'test_top1' is 1234.5"):
        report.write_report(tmp_path)
    assert "**Set aside**: 2 final runs" in (tmp_path / "leaderboard.md").read_text()


def test_require_learning_stops_when_the_next_points_finals_do_not_learn_either(tmp_path):
    suite = _suite(search={"train.lr": [1e-3, 1e-2]}, require_learning=True)
    cells = protocol.plan_cells(suite, [suites.Experiment("e", {"name": "lora"})], ["mini/digits"], [0, 1], tmp_path)
    trained: list = []
    fakes = _stuck_trainer({1e-3: 60.0, 1e-2: 70.0}, {(1e-2, "1"), (1e-3, "1")}, trained)
    summary = protocol.run_protocol(cells, progress=False, **fakes)
    # 1e-2's finals are set aside; 1e-3's seed 1 fails too, and with no other point left its finals stay.
    assert summary.trained == 6 and len(summary.set_aside) == 2 and not summary.failed
    assert [t["train.lr"] for t in trained[4:]] == ["0.001", "0.001"]
    assert protocol.run_protocol(cells, progress=False, **fakes).trained == 0


def test_require_learning_passes_over_a_trial_that_did_not_learn_but_keeps_a_method_that_never_learns(tmp_path):
    suite = _suite(search={"train.lr": [1e-3, 1e-2]}, require_learning=True)
    exp = suites.Experiment("e", {"name": "lora"})
    cells = protocol.plan_cells(suite, [exp], ["mini/digits"], [0], tmp_path)
    trained: list = []
    # The 1e-2 trial has the better val score but ended at chance: 1e-3 is chosen at once.
    summary = protocol.run_protocol(
        cells, progress=False, **_stuck_trainer({1e-3: 60.0, 1e-2: 70.0}, {(1e-2, "0")}, trained)
    )
    assert [t["train.lr"] for t in trained] == ["0.001", "0.01", "0.001"] and not summary.set_aside
    selection = json.loads((tmp_path / "mini-digits/e/seed0/result.json").read_text())["selection"]
    assert selection["learning"]["not_learned"] == ["train.lr=0.01"]
    # Nothing learns anywhere: the finals stay (the report marks them), none is moved, nothing retrains.
    never = protocol.plan_cells(suite, [suites.Experiment("f", {"name": "lora"})], ["mini/digits"], [0], tmp_path)
    everything = {(1e-3, "0"), (1e-2, "0")}
    fakes = _stuck_trainer({1e-3: 60.0, 1e-2: 70.0}, everything, trained)
    protocol.run_protocol(never, progress=False, **fakes)
    again = protocol.run_protocol(never, progress=False, **fakes)
    assert again.trained == 0 and not again.set_aside
    assert "learning" not in json.loads((tmp_path / "mini-digits/f/seed0/result.json").read_text())["selection"]
    # Without the suite's option the plain rule holds: the 1e-2 trial is chosen.
    plain = protocol.plan_cells(
        _suite(search={"train.lr": [1e-3, 1e-2]}),
        [suites.Experiment("g", {"name": "lora"})],
        ["mini/digits"],
        [0],
        tmp_path,
    )
    protocol.run_protocol(plain, progress=False, **_stuck_trainer({1e-3: 60.0, 1e-2: 70.0}, {(1e-2, "0")}, trained))
    assert json.loads((tmp_path / "mini-digits/g/seed0/result.json").read_text())["selection"]["chosen"] == {
        "train.lr": 1e-2
    }
