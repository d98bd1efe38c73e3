"""A method's ``calibrate`` hook: petl-run completes the config from the train split before injecting.

SCT is the method that has one (it picks its salient channels from the task's images); the
throwaway method below checks the runner's side of the contract without SCT's details.  Runs use
the two-block, width-48 random ViT on 96 images of ``mini/digits`` as tests/training/test_engine.py does.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import timm
import torch
from accelerate.utils import set_seed
from conftest import tiny_run
from hydra.core.config_store import ConfigStore
from torch import nn
from torch.utils.data import DataLoader

import petl
from petl.methods import noah_search
from petl.methods.gps import GpsConfig, GpsLinear
from petl.methods.sct import SctBlock, SctConfig, select_sct_channels
from petl.model.registry import _REGISTRY, MethodConfig, get_method, register_method
from petl.run import default_config, train
from petl.train import build, config, engine
from petl.utils import progress

TINY = tiny_run(subset=96, depth=2, epochs=1, batch_size=32)


def tiny(out, *overrides: str) -> dict:
    return train(default_config([*TINY, f"output_dir={out}", *overrides]))


@pytest.mark.slow
def test_sct_run_records_channels_chosen_from_the_train_split(tmp_path):
    result = tiny(tmp_path / "run", "method=sct")
    channels = tuple(result["method_config"]["channels"])
    placeholder = ((0, 1, 2, 3, 4, 5),) * 2  # the data-free default: the first embed_dim // 8 channels
    assert len(channels) == 2 and SctConfig(channels=channels).channel_indices() != placeholder
    assert result["config"]["method"]["channels"] == []  # the command line's value stays as given

    # The same choice as selecting on the run's own backbone and train split (no augmentation).
    cfg = default_config([*TINY, "method=sct"])
    set_seed(cfg.seed)
    backbone = build.create_backbone(cfg)
    loader = DataLoader(build.calibration_set(cfg, backbone), batch_size=64)
    assert SctConfig(channels=select_sct_channels(backbone, loader)).channels == channels

    # The saved weights carry the channels: they load onto a fresh backbone with the same modules (another random
    # init than the run's, which the frozen fingerprint would refuse: check_frozen=False).
    fresh = timm.create_model("vit_fractal_tiny_patch4_32", depth=2, embed_dim=48)
    petl.load_trainable(fresh, tmp_path / "run" / "trainable.safetensors", check_frozen=False)
    assert fresh.petl_config.channels == channels
    blocks = [m for m in fresh.modules() if isinstance(m, SctBlock)]
    assert [tuple(b.index.tolist()) for b in blocks] == list(SctConfig(channels=channels).channel_indices())


@pytest.mark.slow
def test_sct_with_channels_given_keeps_them(tmp_path):
    result = tiny(tmp_path / "run", "method=sct", "method.top_n=2", "method.channels=['1,7','3,40']")
    assert tuple(result["method_config"]["channels"]) == ("1,7", "3,40")


CALIBRATED = [name for name in petl.list_methods() if petl.get_method(name).calibrate is not None]
# A budget that keeps the test fast, for methods whose calibration trains (NOAH's search).
BUDGET = {"noah": ("method.search_epochs=1", "method.search_generations=1", "method.population=3")}


@pytest.fixture(autouse=True)
def few_noah_candidates(monkeypatch):
    """Two mutations and two crossovers a NOAH generation, not its reference's 25 each (noah_search.MUTATIONS).

    Scoring those 50 candidates was most of a NOAH case's time here; what these tests check (a resume or a reuse
    keeps the first choice, the bars change nothing) does not depend on how many are scored, and a generation still
    mutates and crosses over.
    """
    monkeypatch.setattr(noah_search, "MUTATIONS", 2)
    monkeypatch.setattr(noah_search, "CROSSOVERS", 2)


@pytest.mark.slow
@pytest.mark.parametrize("method", CALIBRATED)
def test_a_calibration_shows_progress_bars_only_when_asked(tiny_vit, monkeypatch, capsys, method):
    """NOAH's search takes about 40 CPU minutes a mini task: its bars show, unless train.progress=false hides them."""
    monkeypatch.setattr(progress, "bars_shown", lambda: True)  # as on a terminal (capsys's stderr is none)
    budget = {key.removeprefix("method."): int(v) for key, v in (o.split("=") for o in BUDGET.get(method, ()))}
    cfg = petl.make_config(method, num_classes=4, **budget)
    gen = torch.Generator().manual_seed(0)
    loader = [(torch.randn(4, 3, 32, 32, generator=gen), torch.tensor([0, 1, 2, 3])) for _ in range(3)]
    spec = petl.get_method(method)
    capsys.readouterr()
    torch.manual_seed(0)  # NOAH draws its search's seed from torch's generator
    quiet = spec.calibrate(tiny_vit(), cfg, loader, progress=False)
    assert capsys.readouterr().err == ""
    torch.manual_seed(0)
    shown = spec.calibrate(tiny_vit(), cfg, loader, progress=True)
    assert method.upper() in capsys.readouterr().err
    assert quiet == shown  # the bars change nothing chosen


def test_noah_searches_the_default_backbone_under_its_default_max_params():
    """The supernet (every module at supernet_dim in every block) was built as a given subnet, which max_params
    bounds: on the default backbone its 808,152 parameters are above the default 640,000, and ``petl-run
    method=noah`` failed before training it (exit 1)."""
    import petl.backbones  # noqa: F401  (registers the default backbone with timm)
    from petl.methods.noah import subnet_params

    model = timm.create_model("vit_fractal_tiny_patch4_32", pretrained=False, num_classes=4)
    cfg = petl.make_config("noah", num_classes=4, search_epochs=1, search_generations=1, population=3)
    gen = torch.Generator().manual_seed(0)
    loader = [(torch.randn(4, 3, 32, 32, generator=gen), torch.tensor([0, 1, 2, 3])) for _ in range(3)]
    torch.manual_seed(0)
    chosen = petl.get_method("noah").calibrate(model, cfg, loader, progress=False)
    assert chosen.searched and 0 < subnet_params(model.embed_dim, *chosen.widths(model)) <= cfg.max_params


# What each calibration logs where no bar is drawn, on the 3 batches below (NOAH's: 1 epoch, 1 generation).
LINES = {
    "sct": [f"SCT selection: {k}/3 batches" for k in range(4)],
    "gps": [f"GPS selection: {k}/3 batches" for k in range(4)],
    "noah": [
        "NOAH supernet: 0/1 epoch",
        "NOAH supernet: 1/1 epoch",
        *(f"NOAH evolution: {k}/2 gens" for k in range(3)),
    ],
}


@pytest.mark.parametrize("method", CALIBRATED)
def test_a_calibration_into_a_log_file_logs_a_few_progress_lines_only_when_asked(tiny_vit, monkeypatch, caplog, method):
    """Where no bar is drawn (stderr a file), NOAH's search went on for its minutes without a line."""
    monkeypatch.setattr(progress, "bars_shown", lambda: False)
    caplog.set_level(logging.INFO)
    budget = {key.removeprefix("method."): int(v) for key, v in (o.split("=") for o in BUDGET.get(method, ()))}
    cfg = petl.make_config(method, num_classes=4, **budget)
    gen = torch.Generator().manual_seed(0)
    loader = [(torch.randn(4, 3, 32, 32, generator=gen), torch.tensor([0, 1, 2, 3])) for _ in range(3)]
    spec = petl.get_method(method)

    def progress_lines() -> list[str]:  # without a postfix (NOAH's loss, best score)
        return [m.split(", ")[0] for m in caplog.messages if m.startswith(method.upper()) and "/" in m.split(", ")[0]]

    spec.calibrate(tiny_vit(), cfg, loader, progress=False)
    assert progress_lines() == []
    spec.calibrate(tiny_vit(), cfg, loader, progress=True)
    assert progress_lines() == LINES[method], caplog.messages


@pytest.mark.parametrize("method", ["sct", "gps"])
def test_max_batches_stops_the_loader_and_the_progress_count_there(tiny_vit, monkeypatch, caplog, method):
    """A selection on the first 2 of 3 batches counts to 2 (not 2 of 3, as if stopped short) and loads no third."""
    monkeypatch.setattr(progress, "bars_shown", lambda: False)
    caplog.set_level(logging.INFO)
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 3, 32, 32, generator=gen), torch.tensor([0, 1, 2, 3])) for _ in range(3)]
    loaded = []

    class Loader:  # a loader with a length, recording the batches it gave
        def __len__(self) -> int:
            return len(batches)

        def __iter__(self):
            for batch in batches:
                loaded.append(batch)
                yield batch

    spec = petl.get_method(method)
    spec.calibrate(tiny_vit(), petl.make_config(method, num_classes=4), Loader(), max_batches=2)
    lines = [m for m in caplog.messages if m.startswith(method.upper())]
    assert lines == [f"{method.upper()} selection: {k}/2 batches" for k in range(3)], caplog.messages
    assert len(loaded) == 2


@pytest.mark.slow
@pytest.mark.parametrize("method", CALIBRATED)
def test_a_resumed_run_keeps_the_calibration_of_its_first_session(tmp_path, monkeypatch, method):
    args = (f"method={method}", "train.epochs=2", *BUDGET.get(method, ()))
    whole = tiny(tmp_path / "whole", *args)

    original = engine.train_one_epoch
    calls = {"n": 0}

    def dying(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt("killed")
        return original(*a, **k)

    with monkeypatch.context() as patch:
        patch.setattr(engine, "train_one_epoch", dying)
        with pytest.raises(KeyboardInterrupt):
            tiny(tmp_path / "killed", *args)
    assert (tmp_path / "killed" / "checkpoint.pt").exists()

    # Calibrating again could choose otherwise: the resume must take the checkpoint's choice.
    spec = get_method(method)
    other = dataclasses.replace(spec, calibrate=lambda *args, **kwargs: pytest.fail("a resume must not recalibrate"))
    monkeypatch.setitem(_REGISTRY, method, other)
    resumed = tiny(tmp_path / "killed", *args)
    assert resumed["method_config"] == whole["method_config"]
    assert resumed["test_top1"] == whole["test_top1"] and resumed["final_train_loss"] == whole["final_train_loss"]


@pytest.mark.slow
def test_gps_run_records_the_selection_in_the_result_and_the_weights(tmp_path):
    result = tiny(tmp_path / "run", "method=gps")
    selection = tuple(result["method_config"]["selection"])
    backbone = timm.create_model("vit_fractal_tiny_patch4_32", depth=2, embed_dim=48)
    placeholder = tuple(",".join(map(str, c.flatten().tolist())) for c in GpsConfig().columns_for(backbone))
    assert len(selection) == 1 + 4 * 2 and selection != placeholder
    weights = tmp_path / "run" / "trainable.safetensors"
    assert tuple(petl.read_trainable_metadata(weights)["config"]["selection"]) == selection
    fresh = petl.load_trainable(backbone, weights, check_frozen=False)  # another random init than the run's
    index = [m.index for m in fresh.modules() if isinstance(m, GpsLinear)]
    assert [",".join(map(str, i.flatten().tolist())) for i in index] == list(selection)


NAME = "throwaway_calibrated"


@dataclass
class ProbeConfig(MethodConfig):
    """A method whose one option is filled by its calibrate hook."""

    seen_images: int = 0


@pytest.fixture
def probe() -> Iterator[list]:
    """Register a method with a calibrate hook that records its calls; remove it afterwards."""
    calls: list = []

    def calibrate(model: nn.Module, cfg: ProbeConfig, loader, *, progress: bool) -> ProbeConfig:
        calls.append((model, cfg, loader, progress))
        assert getattr(model, "petl_method", None) is None  # the backbone, before injection
        images = [x for x, _ in loader]
        assert all(isinstance(x, torch.Tensor) and x.shape[1:] == (3, 32, 32) for x in images)
        return dataclasses.replace(cfg, seen_images=sum(len(x) for x in images))

    def inject(model: nn.Module, cfg: ProbeConfig) -> None:
        """Nothing to add: the head trains."""

    config.register_configs()
    register_method(NAME, ProbeConfig, trainable_formula=lambda model, cfg: 0, calibrate=calibrate)(inject)
    try:
        yield calls
    finally:
        _REGISTRY.pop(NAME, None)
        ConfigStore.instance().repo["method"].pop(f"{NAME}.yaml", None)
        config._registered_methods.discard(NAME)


@pytest.mark.slow
def test_the_runner_calls_a_calibrate_hook_once_with_a_train_loader(probe, tmp_path):
    run = tmp_path / "run"
    result = tiny(run, f"method={NAME}", "train.epochs=2", "train.batch_size=16", "train.eval_batch_size=64")
    assert len(probe) == 1
    _model, cfg, loader, progress = probe[0]
    assert isinstance(loader, DataLoader) and cfg.num_classes == 10
    assert progress is False  # train.progress=false (tiny runs): no calibration bars either
    # Training-size batches: GPS's contrastive gradient and NOAH's supernet steps depend on the batch, as in their
    # references; eval_batch_size stays a setting that changes no result.
    assert loader.batch_size == 16
    assert len(loader.dataset) == 96  # data.subset of the train split
    assert result["method_config"]["seen_images"] == 96
    assert petl.read_trainable_metadata(tmp_path / "run" / "trainable.safetensors")["config"]["seen_images"] == 96


@pytest.mark.parametrize("method", [m for m in CALIBRATED if "swin" not in petl.get_method(m).backbones])
def test_a_calibrating_method_refuses_a_swin_before_it_calibrates(tmp_path, monkeypatch, method):
    # NOAH's search failed on a Swin after its supernet had trained, as an error of the run (exit 1); SCT's default
    # top_n asked the Swin for one width.  The refusal comes from the config check, and again from the build for a
    # config edited after it was checked, never from the calibration.
    swin = ["model=swin_fractal_tiny_patch2_window4_32", "model.pretrained=false", f"method={method}"]
    # Named once: "method noah: method 'noah' does not support ..." said the method twice.
    refusal = rf"^method '{method}' does not support the swin backbone"
    with pytest.raises(config.ConfigError, match=refusal):
        default_config(swin)
    cfg = default_config([f"method={method}"])
    cfg.model.name, cfg.model.pretrained = "swin_fractal_tiny_patch2_window4_32", False
    monkeypatch.setattr(build, "calibration_set", lambda *a: pytest.fail("calibrated a backbone it refuses"))
    with pytest.raises(config.ConfigError, match=refusal):
        build.method_config(cfg, build.create_backbone(cfg), 10, None, engine.fresh_accelerator(cpu=True))


@pytest.mark.slow
def test_methods_without_a_hook_build_no_calibration_set(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "calibration_set", lambda *a: pytest.fail("lora has no calibrate hook"))
    assert tiny(tmp_path / "run", "method=lora", "method.rank=2")["method_config"]["rank"] == 2


def test_the_calibration_split_is_the_train_split_without_random_augmentation(tmp_path):
    from test_data_protocol import _fgvc_folder

    # FGVC trains on random crops and flips; calibration reads the training images centre-cropped, as test.
    _fgvc_folder(tmp_path)
    cfg = default_config([*TINY[2:], "data=fgvc/cub", f"data.root={tmp_path}", "data.subset=4"])
    backbone = build.create_backbone(cfg)
    calibration, datasets = build.calibration_set(cfg, backbone), build.datasets(cfg, backbone)
    assert len(calibration) == len(datasets["train"]) == 4
    torch.manual_seed(0)
    reads = [calibration[0][0] for _ in range(10)]
    assert all(torch.equal(x, datasets["test"][0][0]) for x in reads)  # the one image, centre-cropped
    assert any(not torch.equal(datasets["train"][0][0], reads[0]) for _ in range(10))  # training is augmented


@pytest.mark.slow
@pytest.mark.parametrize("method", CALIBRATED)
def test_a_calibration_reused_as_overrides_rebuilds_the_same_method(tmp_path, monkeypatch, method):
    """calibrate_once: another run of the task takes the first run's choice as overrides, through Hydra."""
    from petl.bench.calibration import calibration_overrides

    args = (f"method={method}", *BUDGET.get(method, ()))
    first = tiny(tmp_path / "first", *args)
    reused = calibration_overrides(tmp_path / "first")
    assert reused and all(o.startswith("method.") for o in reused)
    spec = get_method(method)

    def given(model, cfg, loader, *, progress):
        # The options are given: the hook must keep them as they are (NOAH's, SCT's and GPS's do).
        assert spec.calibrate(model, cfg, loader, progress=progress) == cfg
        return cfg

    monkeypatch.setitem(_REGISTRY, method, dataclasses.replace(spec, calibrate=given))
    second = tiny(tmp_path / "second", *args, *reused, "seed=1")
    assert second["method_config"] == first["method_config"]
