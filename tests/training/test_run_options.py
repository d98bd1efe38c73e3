"""Run options that could not act, or acted late: each acts or is refused in one line naming it, before a build.

Gradient checkpointing on a side network, ``model.kwargs`` the pretrained weights do not fit, ``num_classes`` in
``model.kwargs``, a dropout or drop-path rate on a backbone that runs in eval mode, ``train.backbone_mode`` on a
backbone without dropout or drop-path, ``data.num_workers`` with augmented images, ``data.augment=true`` on an
in-memory task.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_run
from PIL import Image

import petl
from petl.run import default_config, train
from petl.train import build, engine
from petl.utils.errors import ConfigError, RunError

# The tiny random-init backbone of the fast tests, without tiny_run's data choice.
TINY_MODEL = [o for o in tiny_run(depth=1, epochs=1) if not o.startswith("data")]


@pytest.mark.parametrize("method", ["dtl", "lst", "hst", "last"])
def test_grad_checkpointing_on_a_side_network_is_refused_naming_the_key(method):
    with pytest.raises(ConfigError, match=rf"^train\.grad_checkpointing=true: method '{method}' cannot use it"):
        default_config([f"method={method}", "train.grad_checkpointing=true"])
    default_config(["method=lora", "train.grad_checkpointing=true"])  # a method that can is accepted


def test_the_runners_grad_checkpointing_names_the_key_too(tiny_vit):
    model = petl.apply(tiny_vit(), "dtl", num_classes=4)
    with pytest.raises(ConfigError, match=r"^train\.grad_checkpointing=true: .*\(train\.grad_checkpointing=false\)$"):
        engine.enable_grad_checkpointing(model)


@pytest.mark.parametrize("method", ["linear", "mlp"])
def test_grad_checkpointing_where_only_the_head_trains_is_refused_before_anything_is_written(tmp_path, method):
    # It trained as without it (no block's backward runs, so none is recomputed) under another config fingerprint.
    overrides = [*TINY_MODEL, "data=mini/digits", "data.subset=8", f"method={method}", f"output_dir={tmp_path / 'run'}"]
    refused = rf"^train.grad_checkpointing=true cannot act: method {method} trains only"
    # Composing refuses it (on the meta model), so a sweep's check before it trains names it: that check found it
    # only as each of the method's runs failed, in its error.log.
    with pytest.raises(ConfigError, match=refused):
        default_config([*overrides, "train.grad_checkpointing=true"])
    cfg = default_config(overrides)
    cfg.train.grad_checkpointing = True  # set after composing: the runner refuses it on the real model
    with pytest.raises(ConfigError, match=refused):
        train(cfg)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("kwarg", "named"),
    [("depth=2", "unexpected blocks.2.norm1.weight"), ("global_pool=avg", "missing fc_norm.weight, fc_norm.bias")],
)
def test_model_kwargs_the_shipped_weights_do_not_fit_are_bad_input(kwarg, named):
    cfg = default_config([f"+model.kwargs.{kwarg}"])
    with pytest.raises(ConfigError) as error:
        build.create_backbone(cfg)
    message = str(error.value)
    assert message.startswith(f"+model.kwargs.{kwarg} does not fit the pretrained weights of ")
    assert named in message and "model.pretrained=false" in message and "\n" not in message
    assert "model.checkpoint" not in message


def test_a_weights_load_that_fails_without_kwargs_stays_a_run_error(monkeypatch):
    cfg = default_config([])

    def offline(*args, **kwargs):
        raise OSError("hub unreachable")

    monkeypatch.setattr(build.timm, "create_model", offline)
    with pytest.raises(RunError, match="cannot load pretrained weights"):
        build.create_backbone(cfg)


def test_num_classes_in_model_kwargs_is_refused():
    with pytest.raises(ConfigError, match=r"^model\.kwargs\.num_classes=3: the head's class count comes from the data"):
        default_config(["+model.kwargs.num_classes=3"])


def test_num_classes_added_to_the_method_is_refused_in_one_line():
    # The method node leaves num_classes out (the runner sets it from the data): added with +, make_config got it
    # twice, a TypeError's traceback and exit 1.
    message = r"^method\.num_classes=4: the head's class count comes from the data \(mini/digits's classes\): drop it$"
    with pytest.raises(ConfigError, match=message):
        default_config([*TINY_MODEL, "data=mini/digits", "method=lora", "+method.num_classes=4"])


def test_a_seed_numpy_cannot_take_is_bad_input():
    # It failed the run after the build (accelerate's set_seed seeds numpy): exit 1, "ValueError: Seed must be...".
    assert default_config([*TINY_MODEL, f"seed={2**32 - 1}"]).seed == 2**32 - 1
    with pytest.raises(ConfigError, match=r"^seed=4294967296 is out of range: allowed \[0, 4294967295\]$"):
        default_config([*TINY_MODEL, "seed=4294967296"])


def test_overrides_given_as_one_string_or_to_train_are_named():
    # default_config("method=lora") read the string's letters as overrides ("cannot parse override 'm'");
    # train("method=lora") and train([...]) failed in dict() ("dictionary update sequence element #0 has length 1").
    with pytest.raises(
        ConfigError, match=r"^default_config takes a list of overrides, got one string: write \['method=lora'\]$"
    ):
        default_config("method=lora")
    for given in ("method=lora", ["method=lora"]):
        with pytest.raises(
            ConfigError, match=r"^a run config must be a mapping, got (str|list): give overrides to default_config"
        ):
            train(given)


@pytest.mark.parametrize(
    "overrides",
    [
        ["method=vpt", "model.drop_path=0.5"],
        ["method=vpt", "+model.kwargs.drop_rate=0.5"],
        ["method=lora", "model.drop_path=0.3", "train.backbone_mode=eval"],
        # Partial-k's trained last block holds drop-path, not the head's dropout.
        ["method=partial", "+model.kwargs.drop_rate=0.5"],
    ],
)
def test_a_dropout_rate_the_eval_mode_backbone_cannot_use_is_refused(overrides):
    key = overrides[1].lstrip("+").split("=")[0]
    with pytest.raises(ConfigError, match=rf"^{key}=\S+ cannot act: .*train\.backbone_mode=train"):
        default_config(overrides)


@pytest.mark.parametrize(
    "overrides",
    [
        ["method=vpt"],  # the default 0.1, documented as acting in train mode only
        ["method=vpt", "model.drop_path=0"],
        ["method=vpt", "model.drop_path=0.5", "train.backbone_mode=train"],
        ["method=lora", "model.drop_path=0.5", "+model.kwargs.drop_rate=0.2"],
        ["method=partial", "model.drop_path=0.5"],
        ["method=full", "model.drop_path=0.5", "train.backbone_mode=eval"],
    ],
)
def test_a_dropout_rate_that_acts_is_accepted(overrides):
    default_config(overrides)


@pytest.mark.parametrize(
    "overrides",
    [
        ["method=lora", "model.drop_path=0", "train.backbone_mode=train"],
        ["method=vpt", "model.drop_path=0", "train.backbone_mode=eval"],
        ["model=swin_fractal_tiny_patch2_window4_32.fractaldb", "model.drop_path=0", "train.backbone_mode=train"],
    ],
)
def test_a_backbone_mode_on_a_backbone_without_dropout_is_refused(overrides):
    # Train and eval mode differ in dropout and drop-path alone: without either, the mode changed nothing.
    mode = overrides[-1].split("=")[1]
    with pytest.raises(ConfigError, match=rf"^train\.backbone_mode={mode} cannot act: the backbone holds no dropout"):
        default_config(overrides)
    default_config([*overrides[:-2], "model.drop_path=0"])  # without the mode: taken
    # With a rate for train mode to act on: taken.
    default_config([*overrides[:-2], "model.drop_path=0", "train.backbone_mode=train", "+model.kwargs.drop_rate=0.1"])


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_a_backbone_mode_from_python_is_refused_by_the_same_check(tiny_vit, mode):
    # TrainSettings(backbone_mode=...) handed to the engine from Python trained on, the mode acting on nothing.
    model = petl.apply(tiny_vit(), "lora", num_classes=3, dropout=0.1)  # LoRA's own dropout is not the backbone's
    settings = engine.TrainSettings(backbone_mode=mode, progress=False)
    with pytest.raises(ConfigError, match=rf"^TrainSettings\.backbone_mode={mode} cannot act: the backbone holds no"):
        # Refused as training starts, before the loader, optimizer or accelerator is touched.
        engine.fit(model, [], {}, settings, accelerator=None, optimizer=None, scheduler=None)
    assert engine.backbone_mode(model, engine.TrainSettings()) == "train"  # auto: the method's choice, taken
    dropping = petl.apply(tiny_vit(drop_path_rate=0.1), "lora", num_classes=3)
    assert engine.backbone_mode(dropping, settings) == mode  # with a rate to act on: taken
    # Mlp-k's head holds BatchNorm1d and dropout, but it is the method's and trains either way: refused as petl-run
    # refuses it (its check sees the backbone before the method), not taken as a backbone the mode acts on.
    with pytest.raises(ConfigError, match=rf"^TrainSettings\.backbone_mode={mode} cannot act"):
        engine.backbone_mode(petl.apply(tiny_vit(), "mlp", num_classes=3), settings)


def test_a_backbone_mode_acts_on_a_batchnorm_in_the_backbone():
    # A hybrid ViT whose ResNet-D stem holds BatchNorms: train mode normalises by the batch's statistics.
    hybrid = ["model.name=vit_small_resnet26d_224", "model.pretrained=false", "model.img_size=64"]
    default_config(["method=lora", *hybrid, "model.drop_path=0", "train.backbone_mode=train"])


def _folder(root: Path) -> Path:
    rng = np.random.default_rng(0)
    for split, count in (("train", 12), ("test", 3)):
        for label in ("a", "b"):
            (root / split / label).mkdir(parents=True)
            for index in range(count):
                pixels = rng.integers(0, 255, (40, 36, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / label / f"{index}.png")
    return root


def test_augmented_crops_do_not_depend_on_the_worker_count(tmp_path):
    # data.num_workers is a neutral key (a finished run is returned for another count): its result must not move.
    root = _folder(tmp_path / "imgs")
    common = [*TINY_MODEL, "data=folder", f"data.root={root}", "data.augment=true", "train.batch_size=8"]
    common += ["train.epochs=2", "method=lora"]
    losses = [
        train(default_config([*common, f"data.num_workers={n}", f"output_dir={tmp_path / str(n)}"]))["final_train_loss"]
        for n in (0, 2)
    ]
    assert losses[0] == losses[1]


def test_seeded_augmentation_draws_from_seed_epoch_and_index_alone():
    class Noise(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, index):
            return torch.rand(())

    items = build.SeededAugmentation(Noise(), seed=1)
    first = [items[i] for i in range(4)]
    before = torch.random.get_rng_state()
    assert [items[i] for i in reversed(range(4))] == first[::-1]
    assert torch.equal(torch.random.get_rng_state(), before)  # the global stream (dropout's) is left alone
    build.EpochSampler(4, seed=1, dataset=items).set_epoch(1)
    assert [items[i] for i in range(4)] != first


def test_augment_on_an_in_memory_task_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"data\.augment=false"):
        train(default_config([*tiny_run(), "data.augment=true", f"output_dir={tmp_path}"]))
