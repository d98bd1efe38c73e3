"""One home for a list several suites run: ``configs/experiment_lists.yaml``, ``configs/task_lists.yaml`` (issue 39).

A suite names a list (``experiments: leaderboard``, ``tasks: mini``) instead of spelling it out again, and
``benchmarks/mini_sweep.sh`` takes its methods from the suite (``petl-bench list suite=NAME``), keeping only
its own cheapest-first order.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from petl.bench.suite import (
    EXPERIMENT_LISTS,
    TASK_LISTS,
    configs_dir,
    experiment_lists,
    list_suites,
    load_suite,
    task_lists,
)
from petl.cli import bench as cli
from petl.presets import read_yaml

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = configs_dir()
SWEEP_SCRIPT = ROOT / "benchmarks" / "mini_sweep.sh"
# The suites mini_sweep.sh runs: its default, SUITE=mini_dinov2 and SUITE=mini_swin (its header, benchmarks/README.md).
SWEPT_SUITES = ("mini_selection", "mini_dinov2", "mini_swin")


def spelled_out_lists(key: str = "experiments") -> dict[str, list[str]]:
    """Suite name -> its ``experiments:`` (or ``key``) as written in the file, for the suites that write a list."""
    raw = {name: read_yaml(CONFIGS / "suites" / f"{name}.yaml").get(key) for name in list_suites(CONFIGS)}
    return {name: listed for name, listed in raw.items() if isinstance(listed, list)}


def cheapest_first() -> list[str]:
    """The sweep order stated in mini_sweep.sh (its CHEAPEST_FIRST array)."""
    found = re.search(r"^CHEAPEST_FIRST=\(([^)]*)\)", SWEEP_SCRIPT.read_text(), re.MULTILINE)
    assert found, f"{SWEEP_SCRIPT} no longer states CHEAPEST_FIRST=(...)"
    return found.group(1).split()


def test_the_leaderboard_suites_name_one_list_in_its_order():
    leaderboard = experiment_lists(CONFIGS)["leaderboard"]
    assert len(leaderboard) == len(set(leaderboard)) == 27
    for name in ("mini", "mini_selection", "mini_dinov2", "vtab1k", "fgvc"):
        assert read_yaml(CONFIGS / "suites" / f"{name}.yaml")["experiments"] == "leaderboard", name
        # The committed leaderboards' progress notes list rows in this order: it must stay the list's.
        assert load_suite(name, CONFIGS).experiments == leaderboard, name


def test_no_suite_spells_out_a_named_list_or_another_suites_list():
    named = {name: set(listed) for name, listed in experiment_lists(CONFIGS).items()}
    spelled = spelled_out_lists()
    for suite, listed in spelled.items():
        same = [name for name, members in named.items() if set(listed) == members]
        assert not same, f"configs/suites/{suite}.yaml lists {same[0]!r} again: write `experiments: {same[0]}`"
    shared = [(a, b) for a in spelled for b in spelled if a < b and set(spelled[a]) == set(spelled[b])]
    assert not shared, f"{shared}: suites sharing a list name it in configs/{EXPERIMENT_LISTS}"


# The task lists as the suites stated them before they named one (their order is the leaderboards' column order).
MINI = ["mini/fashion_mnist", "mini/mnist", "mini/digits", "mini/textures"]
MINI += ["mini/dsprites_loc", "mini/dsprites_ori", "mini/clevr_count"]
FGVC = ["fgvc/cub", "fgvc/nabirds", "fgvc/flowers", "fgvc/dogs", "fgvc/cars"]
VTAB_NATURAL = ["cifar100", "caltech101", "dtd", "flowers102", "pets", "svhn", "sun397"]
VTAB_SPECIALIZED = ["patch_camelyon", "eurosat", "resisc45", "retinopathy"]
VTAB_STRUCTURED = ["clevr_count", "clevr_dist", "dmlab", "kitti_dist", "dsprites_loc", "dsprites_ori"]
VTAB_STRUCTURED += ["smallnorb_azi", "smallnorb_ele"]
VTAB = [f"vtab/{task}" for task in VTAB_NATURAL + VTAB_SPECIALIZED + VTAB_STRUCTURED]
TASKS_BY_SUITE = {"mini": MINI, "mini_selection": MINI, "mini_dinov2": MINI, "vtab1k": VTAB, "vtab1k_vpetl": VTAB}
TASKS_BY_SUITE |= {"fgvc": FGVC, "fgvc_vpetl": FGVC, "mini_swin": MINI}


@pytest.mark.parametrize("suite", sorted(TASKS_BY_SUITE))
def test_suites_name_their_task_list_and_keep_its_order(suite):
    assert isinstance(read_yaml(CONFIGS / "suites" / f"{suite}.yaml")["tasks"], str), suite
    assert load_suite(suite, CONFIGS).tasks == TASKS_BY_SUITE[suite]


def test_no_suite_spells_out_a_named_task_list():
    named = {name: set(listed) for name, listed in task_lists(CONFIGS).items()}
    for suite, listed in spelled_out_lists("tasks").items():
        same = [name for name, members in named.items() if set(listed) == members]
        assert not same, f"configs/suites/{suite}.yaml lists {same[0]!r} again: write `tasks: {same[0]}`"


def test_a_suite_naming_an_unknown_task_list_is_one_line(tmp_path):
    (tmp_path / "experiments").mkdir()
    (tmp_path / "suites").mkdir()
    (tmp_path / TASK_LISTS).write_text("few: [mini/digits]\n")
    (tmp_path / "suites" / "s.yaml").write_text("experiments: [lora]\ntasks: many\nseeds: [0]\n")
    with pytest.raises(ValueError, match=r"s\.yaml: tasks: 'many' is not a list of .*task_lists\.yaml; known: few$"):
        load_suite("s", tmp_path)
    (tmp_path / "suites" / "s.yaml").write_text("experiments: [lora]\ntasks: few\nseeds: [0]\n")
    assert load_suite("s", tmp_path).tasks == ["mini/digits"]


def test_the_sweep_order_names_exactly_the_swept_suites_experiments():
    order = cheapest_first()
    assert len(order) == len(set(order)), "mini_sweep.sh names an experiment twice"
    # A name the leaderboard dropped would be skipped silently: the order is out of date.
    assert set(order) == set(experiment_lists(CONFIGS)["leaderboard"])
    for suite in SWEPT_SUITES:
        # A name missing from the order would still run (last), but then "cheapest first" no longer holds.
        assert set(load_suite(suite, CONFIGS).experiments) <= set(order), suite


def test_petl_bench_list_prints_a_suites_experiments_one_a_line(capsys):
    assert cli.main(["list", "suite=mini_selection"]) == 0
    assert capsys.readouterr().out.split("\n")[:-1] == load_suite("mini_selection", CONFIGS).experiments


def test_petl_bench_list_counts_a_suite_of_one_task_in_the_singular(capsys):
    # suite=choose's one task (your data) was listed as '1 tasks'.
    assert cli.main(["list"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("suite choose:"))
    assert line.startswith("suite choose: 6 experiments, 1 task, seeds [0, 1], "), line


@pytest.mark.slow
def test_mini_sweep_plans_the_suites_experiments_cheapest_first(tmp_path):
    # The script's own logic (membership from `petl-bench list suite=`, order from CHEAPEST_FIRST), through a
    # petl-bench that is this checkout's; --plan stops before anything trains.
    fake = tmp_path / "petl-bench"
    fake.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m petl.cli.bench "$@"\n')
    fake.chmod(0o755)
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PETL_BENCH": str(fake), "PYTHONPATH": path}
    for suite in ("mini_selection", "choose"):
        out = subprocess.run(
            ["bash", str(SWEEP_SCRIPT), "--plan"],
            env={**env, "SUITE": suite},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert out.returncode == 0, out.stderr
        planned = out.stdout.split()
        in_suite = load_suite(suite, CONFIGS).experiments
        assert sorted(planned) == sorted(in_suite), suite
        # choose runs six of them: still in the cheapest-first order (linear, lora, adapter_parallel, full, ...).
        assert planned == [m for m in cheapest_first() if m in in_suite], suite


def _configs(tmp_path: Path, lists: str, experiments: str) -> Path:
    (tmp_path / "experiments").mkdir()
    (tmp_path / "suites").mkdir()
    (tmp_path / EXPERIMENT_LISTS).write_text(lists)
    (tmp_path / "suites" / "s.yaml").write_text(f"experiments: {experiments}\ntasks: [mini/digits]\nseeds: [0]\n")
    return tmp_path


def test_a_suite_takes_a_named_list_in_its_order(tmp_path):
    configs = _configs(tmp_path, "few: [lora, linear]\n", "few")
    assert load_suite("s", configs).experiments == ["lora", "linear"]


@pytest.mark.parametrize(
    ("lists", "experiments", "message"),
    [
        (
            "few: [lora]\n",
            "many",
            r"s\.yaml: experiments: 'many' is not a list of .*experiment_lists\.yaml; known: all, few",
        ),
        ("few: lora\n", "few", r"experiment_lists\.yaml: 'few': must be a non-empty list of experiment names"),
        ("few: []\n", "few", r"experiment_lists\.yaml: 'few': must be a non-empty list"),
        ("few: [lora]\nall: [lora]\n", "few", r"experiment_lists\.yaml: 'all': `all` means every experiment"),
        ("[lora]\n", "few", r"experiment_lists\.yaml: expected a mapping"),
    ],
)
def test_a_bad_list_or_name_is_one_line_naming_the_file(tmp_path, lists, experiments, message):
    with pytest.raises(ValueError, match=message):
        load_suite("s", _configs(tmp_path, lists, experiments))
