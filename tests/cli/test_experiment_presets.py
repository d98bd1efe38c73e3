"""``petl-run experiment=NAME``: the presets of configs/experiments/ on petl-run's command line."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from conftest import tiny_run

from petl import presets
from petl.bench import suite as suites
from petl.cli import run as cli
from petl.run import default_config
from petl.train import config

TINY = tiny_run(epochs=1)


def test_experiment_expands_to_the_bench_overrides_and_the_command_line_wins():
    bench_overrides = suites.load_experiment("full", suites.configs_dir()).overrides()
    assert bench_overrides == ["method=full", "train.lr=0.0001"]  # the file sets a train value too
    expanded = cli.expand_experiment(["experiment=full", "seed=3"])
    assert expanded[: len(bench_overrides)] == bench_overrides == presets.experiment_overrides("full")
    cfg = default_config(expanded)
    assert cfg.method.name == "full" and cfg.train.lr == 1e-4 and cfg.seed == 3
    assert cfg.output_dir.endswith("/full/seed3")
    # Whatever follows experiment= replaces the experiment's values.
    cfg = default_config(cli.expand_experiment(["train.lr=0.5", "experiment=vpt_deep", "method.num_tokens=5"]))
    assert (cfg.method.name, cfg.method.deep, cfg.method.num_tokens, cfg.train.lr) == ("vpt", True, 5, 0.5)
    # Two experiments of one method get folders of their own.
    assert default_config(cli.expand_experiment(["experiment=vpt_deep"])).output_dir.endswith("/vpt_deep/seed0")
    assert default_config(cli.expand_experiment(["experiment=vpt_shallow"])).output_dir.endswith("/vpt_shallow/seed0")
    assert cli.expand_experiment(["method=lora", "seed=1"]) == ["method=lora", "seed=1"]


@pytest.mark.slow
def test_cli_runs_an_experiment(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    cli.main([*TINY, "experiment=vpt_deep", "method.num_tokens=2"])
    (found,) = tmp_path.glob("runs/*/*/*/seed0/result.json")
    assert found.parent.parent.name == "vpt_deep"
    result = json.loads(found.read_text())
    assert result["method"] == "vpt" and result["method_config"]["deep"] is True
    assert result["method_config"]["num_tokens"] == 2
    assert "vpt on mini/digits" in capsys.readouterr().out


@pytest.mark.slow
def test_cli_multirun_sweeps_an_experiment(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    cli.main(["--multirun", *TINY, "experiment=linear", "seed=0,1", f"hydra.sweep.dir={tmp_path}/sweep"])
    found = sorted(p.relative_to(tmp_path).parts[-3:] for p in tmp_path.glob("runs/*/*/*/*/result.json"))
    assert found == [("linear", "seed0", "result.json"), ("linear", "seed1", "result.json")]
    assert capsys.readouterr().out.count("-> ") == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["experiment=nope"], r"unknown experiment 'nope'; known: .*\bvpt_deep\b"),
        (["experiment=lora", "method=vpt"], r"experiment=lora sets the method: drop method="),
        (["--multirun", "experiment=lora,vpt_deep"], r"experiment= takes one name: .*petl-bench"),
        (["experiment=lora", "method.rank=0"], r"method lora: rank=0 is out of range"),
    ],
)
def test_cli_refuses_bad_experiment_use_with_one_line(args, message, capsys):
    with pytest.raises(SystemExit) as caught:
        cli.main(args)
    assert caught.value.code == cli.USAGE_ERROR
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("petl-run: error: ")
    assert re.search(message, err), err


# A refusal of two values together named a value the user never typed as if they had: "reduction=8: the side
# width ..." for experiment=lst's reduction, "train.epochs=2 is given ...; drop one of them" for train=smoke's epochs.
NARROW = ["+model.kwargs.embed_dim=12", "+model.kwargs.num_heads=1"]  # LST's reduction 8 does not divide it
WIDTH = "the side width 12/8 must be a whole number divisible by the backbone's 1 attention heads"


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["experiment=lst", *NARROW], "method lst: reduction=8 (set by experiment=lst): " + WIDTH),
        (["experiment=lst", "method.reduction=8", *NARROW], "method lst: reduction=8: " + WIDTH),
        (
            ["train=smoke", "data.epochs=5"],
            "data.epochs=5 cannot act: train.epochs=2 is set by train=smoke, and the run trains that many; give "
            "train.epochs=5 in place of data.epochs",
        ),
        (
            ["train=smoke", "train.epochs=3", "data.epochs=5"],
            "data.epochs=5 cannot act: train.epochs=3 is given, and the run trains that many; drop one of them",
        ),
        # weight_decay_all chooses which tensors decay: moot where none does (gps's weight decay is 0).
        (
            ["experiment=gps", "train.weight_decay_all=true"],
            "train.weight_decay_all=true cannot act: train.weight_decay=0 (set by experiment=gps) decays no tensor; "
            "give train.weight_decay_all=false, or a train.weight_decay above 0",
        ),
        (
            ["train.weight_decay=0", "train.weight_decay_all=true"],
            "train.weight_decay_all=true cannot act: train.weight_decay=0 decays no tensor; give "
            "train.weight_decay_all=false, or a train.weight_decay above 0",
        ),
    ],
    ids=["experiment-set", "typed", "recipe-set", "typed-over-recipe", "decay-set", "both-typed"],
)
def test_a_refusal_says_which_value_a_file_set_and_which_was_typed(args, said, capsys):
    with pytest.raises(SystemExit) as caught:
        cli.main(args)
    assert caught.value.code == cli.USAGE_ERROR
    assert capsys.readouterr().err == f"petl-run: error: {said}\n"


@pytest.mark.parametrize(
    ("refusal", "said"),
    [
        ("reduction=8: the side width", "reduction=8 (set by experiment=x): the side width"),
        # A value holding spaces or colons of its own was cut at the first: "dims=[8, (set by experiment=x) 16]".
        ("dims=[8, 16] and heads=[1] differ", "dims=[8, 16] (set by experiment=x) and heads=[1] differ"),
        (
            "options='{\"a\": [1, 2]}' sets inference_mode",
            "options='{\"a\": [1, 2]}' (set by experiment=x) sets inference_mode",
        ),
        ("alpha=2.0", "alpha=2.0 (set by experiment=x)"),
    ],
)
def test_set_by_follows_the_whole_value_a_method_refusal_names(refusal, said):
    sources = {f"method.{refusal.split('=')[0]}": "experiment=x"}
    assert str(config.method_error("m", ValueError(refusal), sources)) == f"method m: {said}"


@pytest.mark.slow
def test_help_mentions_experiments(capsys):
    with pytest.raises(SystemExit) as caught:
        cli.main(["--help"])
    assert caught.value.code in (0, None)
    assert "experiment=NAME" in capsys.readouterr().out


@pytest.mark.slow
def test_the_run_layer_does_not_import_the_bench():
    code = (
        "import sys; from petl.cli import run as cli; cli.expand_experiment(['experiment=vpt_deep']); "
        "print([m for m in sys.modules if m.startswith('petl.bench')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
