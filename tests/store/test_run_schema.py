"""One schema per record: a run option is one field, and one set of run-folder rules serves petl-run and petl-bench."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import tiny_run
from omegaconf import OmegaConf

from petl.cli import run as cli
from petl.run import default_config, train
from petl.train import config, runner
from petl.train import output_dir as folder
from petl.train.options import option

TINY = tiny_run(subset=32, depth=1, epochs=1, batch_size=32)


@pytest.fixture
def with_train_options(monkeypatch):
    """Add fields to the ``train`` node for one test, as a developer adding an option would; undone afterwards."""

    def add(**fields: dataclasses.Field) -> type:
        train_node = dataclasses.make_dataclass(
            "TrainConfig", [(name, type(f.default), f) for name, f in fields.items()], bases=(config.TrainConfig,)
        )
        run_node = dataclasses.make_dataclass(
            "RunConfig",
            [("train", train_node, dataclasses.field(default_factory=train_node))],
            bases=(config.RunConfig,),
        )
        monkeypatch.setattr(config, "TrainConfig", train_node)
        monkeypatch.setattr(config, "RunConfig", run_node)
        monkeypatch.setattr(config, "_registered", False)  # store the schema again
        return train_node

    yield add
    monkeypatch.undo()
    config._registered = False
    config.register_configs()  # the original schema back in Hydra's store


@pytest.mark.slow
def test_a_new_training_option_is_validated_fingerprinted_and_in_help(with_train_options, capsys):
    with_train_options(throwaway_scale=option(1.0, low=0, high=2), throwaway_label=option("", neutral=True))
    cfg = default_config(["train.throwaway_scale=1.5"])
    assert cfg.train.throwaway_scale == 1.5
    # Validated from its field: the range, with the one-line message every option gets.
    with pytest.raises(config.ConfigError, match=r"train.throwaway_scale=3.0 is out of range: allowed \[0, 2\]"):
        default_config(["train.throwaway_scale=3"])
    with pytest.raises(config.ConfigError, match=r"train.throwaway_scale=nan is not a finite number"):
        default_config(["train.throwaway_scale=nan"])
    # Fingerprinted: it changes results unless marked neutral.
    resolved = OmegaConf.to_container(cfg, resolve=True)
    fingerprint = folder.fingerprint(resolved)
    assert fingerprint["train.throwaway_scale"] == 1.5 and "train.throwaway_label" not in fingerprint
    # The engine receives it on the settings it trains with.
    assert OmegaConf.to_object(cfg.train).throwaway_scale == 1.5
    # Listed by petl-run's help as Hydra composes it (--help with an override; a bare --help prints the generated
    # petl/cli/run_choices.py, which python docs/gen.py rewrites and a test keeps current).
    with pytest.raises(SystemExit):
        cli.main(["--help", "method=lora"])
    out = capsys.readouterr().out
    assert "throwaway_scale: 1.0" in out and "throwaway_label" in out


@pytest.mark.slow
def test_a_run_from_before_a_new_option_is_finished_for_petl_run_and_petl_bench(
    tmp_path, with_train_options, monkeypatch
):
    overrides = [*TINY, "method=linear", f"output_dir={tmp_path / 'run'}"]
    first = train(default_config(overrides))
    # petl grows two options, with defaults that keep the old behaviour; the folder's record predates both.
    with_train_options(throwaway_label=option("", neutral=True), throwaway_scale=option(1.0, low=0))
    cfg = default_config(overrides)
    assert "throwaway_label" not in first["config"]["train"] and cfg.train.throwaway_label == ""
    monkeypatch.setattr(runner, "fit", lambda *a, **k: pytest.fail("a finished run must not train again"))
    # petl-run returns the finished result; petl-bench's sweep counts it (check_finished raises nothing).
    assert runner.run(cfg)["test_top1"] == first["test_top1"]
    folder.check_finished(cfg)
    # Neither accepts the folder for another value of an option that changes results.
    changed = default_config([*overrides, "train.throwaway_scale=0.5"])
    with pytest.raises(config.ConfigError, match=r"another config \(train.throwaway_scale: None -> 0.5\)"):
        runner.run(changed)
    with pytest.raises(config.ConfigError, match=r"another config \(train.throwaway_scale: None -> 0.5\)"):
        folder.check_finished(changed)


def test_neutral_options_are_read_off_the_fields():
    assert config.run_neutral_keys() == {
        "output_dir",
        "resume",
        "data.root",
        "data.num_workers",
        "train.progress",
        "train.trackers",
        "train.keep_checkpoint",
        "train.eval_batch_size",
    }


def test_train_settings_validate_themselves():
    from petl.train.engine import TrainSettings

    with pytest.raises(ValueError, match=r"train.warmup_frac=1.5 is out of range"):
        TrainSettings(warmup_frac=1.5)
    with pytest.raises(ValueError, match=r"train.backbone_mode='frozen' is not valid: choose one of auto, train"):
        TrainSettings(backbone_mode="frozen")


def test_a_kwarg_set_where_there_was_none_is_the_one_difference_said():
    # Was "model.kwargs: {} -> None, model.kwargs.depth: None -> 2": the empty mapping a flattened config keeps as a
    # key of its own was said changed too (and took one of the three keys said).
    plain = OmegaConf.to_container(default_config(["method=lora"]), resolve=True)
    deeper = OmegaConf.to_container(default_config(["method=lora", "+model.kwargs.depth=2"]), resolve=True)
    assert folder.config_difference(plain, deeper) == "model.kwargs.depth: None -> 2"
    assert folder.config_difference(deeper, plain) == "model.kwargs.depth: 2 -> None"
