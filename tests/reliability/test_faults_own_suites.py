"""Faults a researcher met writing their own suites and experiments (configs_dir=): a typo in a method option, a
search over a key the run config or the experiment's method lacks, an unknown task (each refused in one line naming
the file, exit 2, before any run folder is made, not failed run by run), seeds that are not whole numbers from 0 and
a name listed twice (in the suite or in methods=, tasks=, seeds=), an empty search, and a dry run after the suite was
edited (a finished or an interrupted run of the old config is named stale, as the sweep then fails it in one line,
not "done" or "todo").

Each test goes through petl-bench's main, or load_suite for what the suite file alone says; one trains a tiny run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import tiny_run
from test_faults_issue52 import _main

from petl.bench.suite import load_suite
from petl.cli import bench as bench_cli

BASE = "tasks: [mini/digits]\nseeds: [0]\ntrain: {epochs: 1}\n"


def _configs(tmp_path: Path, suite: str, experiments: dict[str, str] | None = None) -> Path:
    """A researcher's configs folder: one suite ``s`` and the given experiment files."""
    configs = tmp_path / "configs"
    (configs / "experiments").mkdir(parents=True, exist_ok=True)
    (configs / "suites").mkdir(exist_ok=True)
    (configs / "suites" / "s.yaml").write_text(suite)
    for name, text in (experiments or {}).items():
        (configs / "experiments" / f"{name}.yaml").write_text(text)
    return configs


@pytest.mark.parametrize(
    ("suite", "experiments", "extra", "where", "key"),
    [
        (
            "experiments: [mine]\n",
            {"mine": "method: {name: lora, rnak: 4}\n"},
            [],
            "experiments/mine.yaml",
            "method.rnak",
        ),
        ("experiments: [linear]\nsearch: {train.lrr: [0.001]}\n", {}, [], "suites/s.yaml: search", "train.lrr"),
        ("experiments: [linear]\nsearch: {method.rank: [2, 4]}\n", {}, [], "suites/s.yaml: search", "method.rank"),
        ("experiments: [linear]\ntasks: [mini/digit]\nseeds: [0]\n", {}, [], "suites/s.yaml: tasks", "mini/digit"),
        ("experiments: [linear]\n", {}, ["tasks=mini/digitz"], "command line's tasks=", "mini/digitz"),
        ("experiments: [linear]\n", {}, ["train.lrr=1"], "the command line", "train.lrr"),
        # An unknown experiment was named without where it was listed.
        ("experiments: [lroa]\n", {}, [], "suites/s.yaml: experiments: unknown experiment", "lroa"),
        ("experiments: [linear]\n", {}, ["methods=lroa"], "methods=: unknown experiment", "lroa"),
    ],
)
def test_a_bad_key_or_task_in_ones_own_files_is_refused_naming_the_file_before_any_run(
    tmp_path, capsys, suite, experiments, extra, where, key
):
    text = suite + (BASE if "tasks:" not in suite else "train: {epochs: 1}\n")
    configs = _configs(tmp_path, text, experiments)
    out = tmp_path / "runs"
    # petl-bench commands refuses a searching suite whatever its keys: it is checked on the others.
    for command in (["dry_run=true"], []) if "search" in suite else (["dry_run=true"], [], ["commands"]):
        argv = [*command, "suite=s", f"configs_dir={configs}", f"output_dir={out}", *extra]
        if command == ["commands"]:
            argv = ["commands", *argv[1:]]
        status, err = _main(bench_cli.main, argv, capsys)
        assert status == 2, err
        assert len(err.strip().splitlines()) == 1 and where in err and repr(key) in err, err
        assert not out.exists() or not any(out.rglob("*.log")), "a run was started"


def test_cache_features_false_names_every_experiment_and_task_where_it_cannot_act_before_any_run(tmp_path, capsys):
    # Composed on the first task only, the sweep found an augmented task's refusal as each of its runs failed, in its
    # error.log, after the other tasks' runs had trained; and stopped at the first experiment that caches nothing.
    configs = _configs(tmp_path, "experiments: [linear, lora]\ntasks: [mini/digits, fgvc/cub]\nseeds: [0]\n")
    out = tmp_path / "runs"
    for command in ([], ["commands"]):
        argv = [*command, "suite=s", f"configs_dir={configs}", f"output_dir={out}", "train.cache_features=false"]
        status, err = _main(bench_cli.main, argv, capsys)
        assert status == 2 and len(err.strip().splitlines()) == 1, err
        assert "the command line: train.cache_features=false cannot act in 3 of 4 experiment x task pairs" in err
        assert "linear on fgvc/cub: the training images are augmented" in err
        assert "lora on every task: nothing in front of what the method trains is frozen" in err
        assert "leave those out (methods=, tasks=) and run them" in err
        assert not out.exists()
    # The experiments and tasks where it acts run with it.
    argv = ["suite=s", f"configs_dir={configs}", f"output_dir={out}", "train.cache_features=false", "dry_run=true"]
    assert bench_cli.main([*argv, "methods=linear", "tasks=mini/digits"]) == 0


def test_seeds_must_be_whole_numbers_and_nothing_may_be_listed_twice(tmp_path):
    cases = {
        "experiments: [linear]\ntasks: [mini/digits]\nseeds: [0.5, 1]\n": r"`seeds` must list whole numbers",
        "experiments: [linear]\ntasks: [mini/digits]\nseeds: ['0', one]\n": r"`seeds` must list whole numbers",
        "experiments: [linear]\ntasks: [mini/digits]\nseeds: [-1, 0]\n": r"`seeds` must list whole numbers from 0",
        # petl-run refuses a seed past 2**32 - 1 (numpy's): each run would fail in its error.log.
        "experiments: [linear]\ntasks: [mini/digits]\nseeds: [0, 4294967296]\n": r"`seeds` .* from 0 to 4294967295,",
        "experiments: [linear]\ntasks: [mini/digits]\nseeds: [0]\nsearch: {train.lr: [1]}\nsearch_seed: 4294967296\n": (
            r"`search_seed` must be a whole number from 0 to 4294967295,"
        ),
        "experiments: [linear]\ntasks: [mini/digits]\nseeds: [0]\nsearch: {train.lr: [0.1]}\nsearch_seed: -1\n": (
            r"`search_seed` must be a whole number from 0"
        ),
        "experiments: [linear, linear]\ntasks: [mini/digits]\nseeds: [0]\n": r"`experiments` lists linear more than",
        "experiments: [linear]\ntasks: [mini/digits, mini/digits]\nseeds: [0]\n": r"`tasks` lists mini/digits more",
        "experiments: [linear]\ntasks: [mini/digits]\nseeds: [1, 1]\n": r"`seeds` lists 1 more than once",
        "experiments: [linear]\ntasks: [mini/digits]\nseeds: [0]\nsearch: {train.lr: [0.1]}\nsearch_seed: one\n": (
            r"`search_seed` must be a whole number"
        ),
    }
    for text, message in cases.items():
        configs = _configs(tmp_path, text)
        with pytest.raises(ValueError, match=r"s\.yaml: " + message):
            load_suite("s", configs)


def test_an_empty_search_is_refused_not_run_without_selection(tmp_path):
    for search in ("search: {}\n", "search:\n#  train.lr: [0.001, 0.01]\n"):
        configs = _configs(tmp_path, "experiments: [linear]\n" + BASE + search)
        with pytest.raises(ValueError, match=r"s\.yaml: `search` is empty"):
            load_suite("s", configs)


def test_final_split_left_empty_under_a_search_is_the_default_one(tmp_path):
    configs = _configs(tmp_path, "experiments: [linear]\n" + BASE + "search: {train.lr: [0.1]}\nfinal_split:\n")
    assert load_suite("s", configs).final_split == "train800val200"  # was None: "final runs ... on None"


def test_methods_tasks_or_seeds_listing_nothing_twice_or_a_negative_seed_are_refused(tmp_path, capsys):
    configs = _configs(tmp_path, "experiments: [linear]\n" + BASE)
    for arg, message in [
        ("tasks=", "tasks= lists nothing"),
        ("methods=", "methods= lists nothing"),
        ("seeds=", "seeds= lists nothing"),
        ("seeds=a", "seeds=a: expected whole numbers"),
        # petl-run refuses a negative seed: each run would fail in its error.log, exit 1, not one line, exit 2.
        ("seeds=-1", "seeds=-1: expected whole numbers from 0"),
        ("seeds=0,4294967296", "seeds=0,4294967296: expected whole numbers from 0 to 4294967295"),
        # One run planned twice: trained once, counted twice; `commands` printed two jobs into one folder.
        ("seeds=0,00", "seeds=0,00: 0 listed more than once"),
        ("methods=linear,linear", "methods=linear,linear: linear listed more than once"),
        ("tasks=mini/digits,mini/digits", "mini/digits listed more than once"),
    ]:
        for command in (["dry_run=true"], ["commands"]):
            argv = [*command, "suite=s", f"configs_dir={configs}", f"output_dir={tmp_path / 'runs'}", arg]
            argv = ["commands", *argv[1:]] if command == ["commands"] else argv
            status, err = _main(bench_cli.main, argv, capsys)
            assert status == 2 and message in err, err


@pytest.mark.slow
def test_after_the_suite_was_edited_a_finished_or_unfinished_run_is_named_stale(tmp_path, capsys, train_on_cpu):
    from petl.run import default_config, train

    tiny = {o.partition("=")[0].lstrip("+"): o.partition("=")[2] for o in tiny_run(subset=32, epochs=1)}
    suite = (
        "experiments: [linear]\ntasks: [mini/digits]\nseeds: [0]\n"
        f"data: {{subset: {tiny['data.subset']}}}\ntrain: {{epochs: 1, progress: false}}\n"
        f"model: {{name: {tiny['model']}, pretrained: false, kwargs: {{depth: 1, embed_dim: 48}}}}\n"
    )
    configs = _configs(tmp_path, suite)
    out = tmp_path / "runs"
    run_dir = out / "mini-digits" / "linear" / "seed0"
    overrides = [*tiny_run(subset=32, epochs=1), "method=linear", "seed=0", f"output_dir={run_dir}"]
    train(default_config(overrides))
    argv = ["dry_run=true", "suite=s", f"configs_dir={configs}", f"output_dir={out}"]
    capsys.readouterr()
    assert bench_cli.main(argv) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("done  mini/digits linear seed0")
    (configs / "suites" / "s.yaml").write_text(suite.replace("epochs: 1", "epochs: 2"))
    assert bench_cli.main(argv) == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert line.startswith("stale mini/digits linear seed0") and "train.epochs: 1 -> 2" in line, line
    # An interrupted run of the old config (config.yaml, no result.json): the sweep resumed it, petl-run refused the
    # resume on the difference, and the sweep said only "see error.log", where its dry run had said "todo".
    (run_dir / "result.json").unlink()
    assert bench_cli.main(argv) == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert line.startswith("stale mini/digits linear seed0") and "it is an unfinished run: delete it" in line, line
    assert bench_cli.main([a for a in argv if a != "dry_run=true"]) == 1
    out = capsys.readouterr().out
    assert "failed: mini/digits linear seed0: output_dir" in out and "train.epochs: 1 -> 2" in out, out
    assert not (run_dir / "error.log").exists() and (run_dir / "config.yaml").is_file()


@pytest.mark.parametrize(
    ("suite", "experiment", "extra", "said"),
    [
        (
            "experiments: [linear]\n",
            None,
            ["data.epochs=5"],
            "the command line: data.epochs=5 cannot act: train.epochs=1 is set by {configs}/suites/s.yaml, and the run "
            "trains that many; give train.epochs=5 in place of data.epochs",
        ),
        (
            "experiments: [mine]\n",
            "method: {name: bitfit}\ntrain: {weight_decay_all: true}\n",
            ["train.weight_decay=0"],
            "the command line: train.weight_decay_all=true (set by {configs}/experiments/mine.yaml) cannot act: "
            "train.weight_decay=0 decays no tensor; give train.weight_decay_all=false, or a train.weight_decay above 0",
        ),
        # The file that fails is named first: its own values need no "set by".
        (
            "experiments: [mine]\n",
            "method: {name: bitfit}\ntrain: {weight_decay_all: true, weight_decay: 0}\n",
            [],
            "{configs}/experiments/mine.yaml: train.weight_decay_all=true cannot act: train.weight_decay=0 decays no "
            "tensor; give train.weight_decay_all=false, or a train.weight_decay above 0",
        ),
        # A list's own spaces: "dims=['8', (set by ...) '16', ...]" cut the value where its first space was.
        (
            "experiments: [mine]\nper_experiment:\n  mine: {method.heads: [1, 2]}\n",
            "method: {name: hst, dims: [8, 16, 32, 48]}\n",
            [],
            "{configs}/suites/s.yaml: per_experiment/per_task mine: method hst: dims=['8', '16', '32', '48'] (set by "
            "{configs}/experiments/mine.yaml) and heads=['1', '2'] must name the same stages",
        ),
        # Typed on the command line, it is the user's own.
        (
            "experiments: [linear]\n",
            None,
            ["train.epochs=2", "data.epochs=5"],
            "the command line: data.epochs=5 cannot act: train.epochs=2 is given, and the run trains that many; drop "
            "one of them",
        ),
    ],
    ids=["suite-set", "experiment-set", "in-the-failing-file", "a-list-set", "typed"],
)
def test_a_refusal_names_the_file_that_set_a_value_the_user_did_not_type(
    tmp_path, capsys, suite, experiment, extra, said
):
    # A refusal of two values together said "train.epochs=1 is given ...; drop one of them" of the suite's epochs, a
    # value the user never typed and could not drop (petl-run named experiment= and train= so, petl-bench did not).
    configs = _configs(tmp_path, suite + BASE, {"mine": experiment} if experiment else None)
    argv = ["dry_run=true", "suite=s", f"configs_dir={configs}", f"output_dir={tmp_path / 'runs'}", *extra]
    status, err = _main(bench_cli.main, argv, capsys)
    assert status == 2 and err == f"petl-bench: error: {said.format(configs=configs)}\n", err


def test_a_refusal_on_ones_own_data_names_the_suite_that_set_a_value(tmp_path, capsys):
    # suite=choose's 20 epochs were "given" beside data.epochs=5: the user typed neither train.epochs nor could drop it.
    from PIL import Image

    for split, label in [("train", "a"), ("train", "b"), ("test", "a"), ("test", "b")]:
        (tmp_path / "images" / split / label).mkdir(parents=True)
        for i in range(2):
            Image.new("RGB", (8, 8), (i * 90, 0, 0)).save(tmp_path / "images" / split / label / f"{i}.png")
    argv = ["suite=choose", "data=folder", f"data.root={tmp_path / 'images'}", "data.epochs=5", "--yes"]
    status, err = _main(bench_cli.main, [*argv, f"output_dir={tmp_path / 'runs'}"], capsys)
    assert status == 2, err
    assert "data.epochs=5 cannot act: train.epochs=20 is set by " in err and "suites/choose.yaml, and the run" in err
    assert err.endswith("; give train.epochs=5 in place of data.epochs\n") and err.count("\n") == 1, err
