"""petl-run composes and checks a single run once, and expands sweeps as Hydra's basic sweeper does."""

from __future__ import annotations

import pytest
from conftest import tiny_run
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser

from petl.cli import run as cli
from petl.train import config

TINY = tiny_run(epochs=1)


@pytest.mark.slow
def test_a_single_run_is_composed_and_checked_once(tmp_path, monkeypatch):
    calls = {"compose": 0, "check_values": 0, "check_method": 0}
    for name in calls:
        real = getattr(config, name if name != "compose" else "compose_config")

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(config, name if name != "compose" else "compose_config", counted)
    monkeypatch.setattr(cli, "_hydra_main", lambda: pytest.fail("a single run does not need Hydra's app runner"))
    cli.main([*TINY, "method=linear", f"output_dir={tmp_path}"])
    assert calls == {"compose": 1, "check_values": 1, "check_method": 1}
    assert (tmp_path / "result.json").is_file()


@pytest.mark.parametrize(
    "overrides",
    [
        ["method=lora,adapter", "seed=0,1,2", "train.lr=0.1"],
        ["seed=range(0,3)", "method=lora", "seed=5,6"],  # a later override of a key replaces the earlier one
        ["method.rank=choice(2,4)", "data=mini/digits"],
    ],
)
def test_sweep_jobs_are_expanded_as_hydra_does(overrides):
    parsed = OverridesParser.create().parse_overrides(overrides)
    assert cli._job_overrides(overrides, multirun=True) == BasicSweeper.split_arguments(parsed, None)[0]


def test_interval_sweeps_check_the_fixed_part():
    assert cli._job_overrides(["train.lr=interval(0.1,1)", "seed=1"], multirun=True) == [["seed=1"]]
