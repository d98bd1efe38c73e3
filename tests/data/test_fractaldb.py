import dataclasses
import json

import numpy as np
import pytest
import timm
import torch
from safetensors.torch import load_file

from petl.cli import pretrain as pretrain_cli
from petl.data.fractaldb import FractalConfig, fill_rate, generate, render, search_systems
from petl.train import pretrain

TINY = FractalConfig(num_classes=4, instances=6, seed=3)


def test_systems_pass_the_fill_filter_and_are_seeded():
    systems = search_systems(TINY)
    assert len(systems) == 4
    rng = np.random.default_rng(0)
    for system in systems:
        assert fill_rate(render(system, TINY.image_size, rng)) >= TINY.fill_threshold
    again = search_systems(TINY)
    assert all(np.array_equal(a, b) for a, b in zip(systems, again, strict=True))


def test_generate_is_deterministic_and_labelled():
    first, second = generate(TINY), generate(TINY)
    images, labels = first.tensors
    assert images.shape == (24, 1, 32, 32) and images.dtype == torch.uint8
    assert labels.tolist() == [c for c in range(4) for _ in range(6)]
    assert torch.equal(images, second.tensors[0])
    other_seed = generate(TINY, seed=99).tensors[0]
    assert not torch.equal(images, other_seed)
    # Every image shows something, and instances of one class differ (perturbation and flips).
    assert (images.flatten(1) > 0).any(1).all()
    assert not torch.equal(images[0], images[1])


def test_divergent_system_renders_blank():
    exploding = np.array([[10.0, 0.0, 0.0, 10.0, 0.0, 0.0]])
    image = render(exploding, 32, np.random.default_rng(0), steps=400)
    assert fill_rate(image) == 0.0


def test_generation_is_fast():
    import time

    start = time.perf_counter()
    generate(FractalConfig(num_classes=10, instances=20, seed=1))
    assert time.perf_counter() - start < 10, "200 images should take well under 10 s"


@pytest.mark.slow
def test_short_pretraining_writes_loadable_weights_and_provenance(tmp_path):
    settings = pretrain.TrainSettings(epochs=2, lr=1e-3, progress=False)
    record = pretrain.pretrain(TINY, settings, batch_size=8, val_instances=2, out_dir=tmp_path)
    weights = tmp_path / f"{pretrain.ARCH}.fractaldb.safetensors"
    provenance = json.loads((tmp_path / f"{pretrain.ARCH}.fractaldb.json").read_text())
    assert provenance["images_seen"] == record["images_seen"] == 2 * 24
    assert {"fractal_config", "final_val_top1", "wall_seconds", "versions", "seed"} <= set(provenance)
    model = timm.create_model(
        f"{pretrain.ARCH}.fractaldb", pretrained=True, pretrained_cfg_overlay={"file": str(weights)}, num_classes=3
    )
    fresh = timm.create_model(pretrain.ARCH, num_classes=3)
    trained = dict(model.named_parameters())
    key = "blocks.0.attn.qkv.weight"
    assert not torch.equal(trained[key], dict(fresh.named_parameters())[key])


@pytest.mark.slow
def test_cli_rejects_bad_sizes(capsys):
    with pytest.raises(SystemExit):
        pretrain_cli.main(["--classes", "0"])


def test_cli_refuses_a_model_timm_does_not_know_in_one_line(capsys):
    with pytest.raises(SystemExit) as caught:
        pretrain_cli.main(["--model", "swin_fractal_huge"])
    err = capsys.readouterr().err
    assert caught.value.code == 2 and "--model swin_fractal_huge is not a timm architecture" in err


def test_a_batch_larger_than_the_images_is_refused_before_generating(capsys):
    # Incomplete batches are dropped: 12 images in batches of 128 trained no step and wrote untrained weights.
    with pytest.raises(SystemExit) as caught:
        pretrain_cli.main(["--classes", "3", "--instances", "4", "--epochs", "1"])
    err = capsys.readouterr().err
    assert caught.value.code == 2 and "--batch-size 128 is more than the 12 training images" in err
    settings = pretrain.TrainSettings(epochs=1, lr=1e-3, progress=False)
    with pytest.raises(ValueError, match="batch_size 32 is more than the 24 training images"):
        pretrain.pretrain(TINY, settings, batch_size=32)


@pytest.mark.slow
def test_an_interrupted_pretraining_resumes_to_the_same_weights(tmp_path, monkeypatch):
    """The Swin pretrains through the same code; killed after its first epoch, the same call continues from the
    checkpoint and ends with the weights of an uninterrupted pretraining."""
    arch = "swin_fractal_tiny_patch2_window4_32"
    settings = pretrain.TrainSettings(epochs=2, lr=1e-3, progress=False)
    # 8 images an epoch in two shuffled batches of 4: a resume that lost the loader's or torch's generator state
    # draws other batches or drop paths.  The Swin's steps are most of the time: 8 images, not 24, a third of it.
    fractal = dataclasses.replace(TINY, instances=2)
    kwargs = dict(batch_size=4, val_instances=2, arch=arch, weights_dtype="float16")
    whole = pretrain.pretrain(fractal, settings, out_dir=tmp_path / "whole", **kwargs)

    save = pretrain.files.save_checkpoint

    saved = []

    def save_then_stop(path, state):
        save(path, state)
        saved.append(state)
        raise KeyboardInterrupt

    monkeypatch.setattr(pretrain.files, "save_checkpoint", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        pretrain.pretrain(fractal, settings, out_dir=tmp_path / "cut", **kwargs)
    assert pretrain.partial_file(tmp_path / "cut", arch).exists()
    monkeypatch.undo()
    resumed = pretrain.pretrain(fractal, settings, out_dir=tmp_path / "cut", **kwargs)

    assert not pretrain.partial_file(tmp_path / "cut", arch).exists()
    assert [h["loss"] for h in resumed["history"]] == [h["loss"] for h in whole["history"]]
    assert resumed["weights_sha256"] == whole["weights_sha256"]
    weights, _ = pretrain.output_files(tmp_path / "cut", arch)
    assert {v.dtype for k, v in load_file(weights).items() if "index" not in k} == {torch.float16}
    with pytest.raises(ValueError, match="unfinished pretraining with other options"):
        # The first epoch's checkpoint, whole and valid, but of another recipe.
        pretrain.files.save_checkpoint(pretrain.partial_file(tmp_path / "cut", arch), {**saved[0], "recipe": "{}"})
        pretrain.pretrain(fractal, settings, out_dir=tmp_path / "cut", **kwargs)
