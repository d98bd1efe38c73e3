"""Adding a method is one file: registering it is enough for the CLI, the contract tests and the benchmark.

The test registers a throwaway method the way a file in petl/methods/ does (a config dataclass and
``register_method``), finds it everywhere a method must appear, and removes it again.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from hydra.core.config_store import ConfigStore
from torch import nn

import petl
from petl.bench import suite as suites
from petl.model.registry import _REGISTRY, MethodConfig, register_method
from petl.train import config

NAME = "throwaway_scale"


@dataclass
class ThrowawayConfig(MethodConfig):
    """A method with one option, as a new method file would declare it."""

    gain: float = 2.0


@pytest.fixture
def throwaway() -> Iterator[str]:
    """Register the throwaway method for one test, then remove every trace of it."""

    def inject(model: nn.Module, cfg: ThrowawayConfig) -> None:
        """Nothing to add: the head trains (core.apply already froze the rest)."""

    # The CLI's groups are built once per process; build them first, as a CLI or test run before would have.
    config.register_configs()
    register_method(NAME, ThrowawayConfig, trainable_formula=lambda model, cfg: 0)(inject)
    try:
        yield NAME
    finally:
        _REGISTRY.pop(NAME, None)
        ConfigStore.instance().repo["method"].pop(f"{NAME}.yaml", None)
        config._registered_methods.discard(NAME)


def test_a_registered_method_reaches_the_cli_the_contract_tests_and_a_suite(throwaway, tmp_path):
    # The contract tests in tests/methods/test_method_contracts.py are parametrised over this list.
    assert throwaway in petl.list_methods()

    # The CLI's `method` group has it, with its options type-checked from the dataclass.
    assert throwaway in config.group_choices("method")
    cfg = config.default_config([f"method={throwaway}", f"method.{'gain'}=3.5"])
    assert cfg.method.name == throwaway and cfg.method.gain == 3.5
    with pytest.raises(config.ConfigError):
        config.default_config([f"method={throwaway}", "method.gain=loud"])

    # The benchmark: a default experiment from the registry, listed and usable in a suite by name.
    bench = suites.configs_dir()
    assert throwaway in suites.list_experiments(bench)
    experiment = suites.load_experiment(throwaway, bench)
    assert experiment.overrides() == [f"method={throwaway}"]
    (tmp_path / "experiments").mkdir()
    (tmp_path / "suites").mkdir()
    (tmp_path / "suites" / "named.yaml").write_text(f"experiments: [{throwaway}]\ntasks: [mini/digits]\nseeds: [0]\n")
    (tmp_path / "suites" / "every.yaml").write_text("experiments: all\ntasks: [mini/digits]\nseeds: [0]\n")
    assert suites.load_suite("named", tmp_path).experiments == [throwaway]
    assert throwaway in suites.load_suite("every", tmp_path).experiments


def test_an_experiment_file_overrides_the_registry_default(throwaway, tmp_path):
    (tmp_path / "experiments").mkdir()
    (tmp_path / "suites").mkdir()
    (tmp_path / "experiments" / "loud.yaml").write_text(
        f"method: {{name: {throwaway}, gain: 8.0}}\npublished: Throwaway\npublished_note: counts differ by the bias\n"
    )
    # The file covers the method, so `all` holds the file's experiment and no default one beside it.
    names = suites.list_experiments(tmp_path)
    assert "loud" in names and throwaway not in names
    loud = suites.load_experiment("loud", tmp_path)
    assert loud.overrides() == [f"method={throwaway}", "method.gain=8.0"]
    assert (loud.published, loud.published_note) == ("Throwaway", "counts differ by the bias")
    assert suites.load_experiment("lora", tmp_path).published == ""  # no file: the registry default
