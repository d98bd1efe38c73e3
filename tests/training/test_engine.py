"""The training engine through the Python API: records, determinism, resume, caching, failures.

Every run here uses a two-block, width-48 ViT from random init on 96 examples per split of the
offline ``mini/digits`` task, so a run takes about a second on one CPU thread.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path

import pytest
import timm
import torch
from conftest import TINY_MODELS, tiny_run
from safetensors.torch import load_file, save_file

import petl
from petl.run import default_config, train
from petl.store import files
from petl.train import build, cache, config, engine, runner
from petl.utils import memory

TINY = tiny_run(subset=96, depth=2, batch_size=32)

RESULT_KEYS = {
    "method",
    "method_config",
    "dataset",
    "model",
    "seed",
    "num_classes",
    "trainable_params",
    "trainable_params_no_head",
    "total_params",
    "val_top1",
    "test_top1",
    "epochs",
    "train_seconds",
    "images_per_second",
    "peak_memory_mb",
    "peak_memory_kind",
    "versions",
    "git_commit",
    "config",
}


def tiny(out: Path, *overrides: str) -> dict:
    return train(default_config([*TINY, f"output_dir={out}", *overrides]))


@pytest.mark.slow
def test_two_epoch_run_writes_a_complete_record(tmp_path):
    result = tiny(tmp_path / "run", "method=lora", "method.rank=2")
    out = tmp_path / "run"
    assert sorted(p.name for p in out.iterdir()) == [
        "config.yaml",
        "metrics.jsonl",
        "model.json",
        "result.json",
        "trainable.safetensors",
    ]
    on_disk = json.loads((out / "result.json").read_text())
    assert RESULT_KEYS <= on_disk.keys()
    assert on_disk["test_top1"] == result["test_top1"] and 0 <= result["test_top1"] <= 100
    assert result["method"] == "lora" and result["method_config"]["rank"] == 2
    assert result["dataset"] == "mini/digits" and result["num_classes"] == 10 and result["epochs"] == 2
    assert result["trainable_params"] > result["trainable_params_no_head"] > 0
    # The process's RSS high-water mark on the CPU, the allocator's peak on a GPU (petl.utils.memory.peak_memory).
    kind = "cuda_max_allocated" if result["device"].startswith("cuda") else "process_max_rss"
    assert result["peak_memory_kind"] == kind and result["peak_memory_mb"] > 0
    assert result["versions"]["torch"] == torch.__version__
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["epoch"] for row in lines] == [1, 2] and all("val_top1" in row for row in lines)
    # Each epoch's lr is its last step's: 2 x 3 steps of cosine without warm-up, steps 3 and 6 (not the 0 after 6).
    cosine = [1e-3 * 0.5 * (1 + math.cos(math.pi * step / 6)) for step in (2, 5)]
    assert [row["lr"] for row in lines] == pytest.approx(cosine) and lines[-1]["lr"] > 0
    assert result["val_top1"] == lines[-1]["val_top1"]
    assert "lora" in (out / "config.yaml").read_text()
    # The saved weights restore onto a fresh backbone of the same modules (another random init: check_frozen=False).
    fresh = timm.create_model("vit_fractal_tiny_patch4_32", depth=2, embed_dim=48)
    petl.load_trainable(fresh, out / "trainable.safetensors", check_frozen=False)
    assert fresh.petl_method == "lora"


def _crash_in_epoch(monkeypatch, epoch: int) -> None:
    """Make training die part-way through ``epoch`` (1-based), after some real optimizer steps."""
    original = engine.train_one_epoch
    calls = {"n": 0}

    def dying(model, loader, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == epoch:
            first_batch = [next(iter(loader))]
            original(model, first_batch, *args, **kwargs)
            raise KeyboardInterrupt("killed")
        return original(model, loader, *args, **kwargs)

    monkeypatch.setattr(engine, "train_one_epoch", dying)


@pytest.mark.slow
def test_killed_run_resumes_to_the_uninterrupted_result(tmp_path, monkeypatch):
    args = ("method=lora", "train.epochs=3", "method.dropout=0.1", "model.drop_path=0.2")
    whole = tiny(tmp_path / "whole", *args)
    again = tiny(tmp_path / "again", *args)
    assert again["test_top1"] == whole["test_top1"] and again["val_top1"] == whole["val_top1"]  # determinism

    with monkeypatch.context() as patch:
        _crash_in_epoch(patch, 2)
        with pytest.raises(KeyboardInterrupt):
            tiny(tmp_path / "killed", *args)
    killed = tmp_path / "killed"
    assert not (killed / "result.json").exists() and not (killed / "trainable.safetensors").exists()
    assert (killed / "checkpoint.pt").exists() and len((killed / "metrics.jsonl").read_text().splitlines()) == 1

    config_file = killed / "config.yaml"
    kept = config_file.read_text()
    config_file.unlink()  # without it the checkpoint's config cannot be checked: refused, not resumed blindly
    with pytest.raises(config.ConfigError, match="checkpoint.pt without its config.yaml"):
        tiny(killed, *args)
    assert (killed / "checkpoint.pt").exists()
    config_file.write_text(kept)
    wall_before = torch.load(killed / "checkpoint.pt", weights_only=True)["wall_seconds"]
    tick = time.perf_counter()
    resumed = tiny(killed, *args)
    # wall_seconds sums the sessions: the killed one up to its checkpoint, then the whole resumed one.
    assert 0 < wall_before < resumed["wall_seconds"] <= wall_before + time.perf_counter() - tick + 0.01  # rounding
    for key in ("val_top1", "test_top1", "best_val_top1", "final_train_loss"):
        assert resumed[key] == whole[key], key
    a, b = load_file(tmp_path / "whole" / "trainable.safetensors"), load_file(killed / "trainable.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [json.loads(x)["loss"] for x in (killed / "metrics.jsonl").read_text().splitlines()] == [
        json.loads(x)["loss"] for x in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()
    ]
    assert not (killed / "checkpoint.pt").exists()


@pytest.mark.slow
def test_finished_run_is_returned_and_a_changed_config_is_refused(tmp_path, monkeypatch):
    first = tiny(tmp_path, "method=linear")
    monkeypatch.setattr(runner, "fit", lambda *a, **k: pytest.fail("a finished run must not train again"))
    assert tiny(tmp_path, "method=linear", "train.progress=true")["test_top1"] == first["test_top1"]
    with pytest.raises(config.ConfigError, match=r"another config \(train.lr: 0.001 -> 0.01\)"):
        tiny(tmp_path, "method=linear", "train.lr=0.01")
    monkeypatch.undo()
    replaced = tiny(tmp_path, "method=linear", "train.lr=0.01", "resume=false")
    assert replaced["config"]["train"]["lr"] == 0.01


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "described"), [("linear", "pre-logits features"), ("partial", "tokens entering block 1")]
)
def test_feature_cache_gives_the_uncached_result(tmp_path, method, described):
    # In strict fp32 on every device: the cache runs the front in batches of eval_batch_size, the uncached run in
    # training batches, and under a GPU's default bf16 autocast (or TF32) the shape alone changes the rounding.
    common = (f"method={method}", "train.epochs=3", "train.precision=no")
    cached = tiny(tmp_path / "cached", *common)
    plain = tiny(tmp_path / "plain", *common, "train.cache_features=false")
    assert cached["feature_cache"] == described and plain["feature_cache"] is None
    assert cached["test_top1"] == plain["test_top1"] and cached["val_top1"] == plain["val_top1"]
    a, b = (
        load_file(tmp_path / "cached" / "trainable.safetensors"),
        load_file(tmp_path / "plain" / "trainable.safetensors"),
    )
    assert all(torch.allclose(a[k], b[k], rtol=0, atol=1e-6) for k in a)


def test_cache_features_false_where_nothing_is_cached_is_refused_before_anything_is_written(tmp_path):
    # It trained exactly as the default does (LoRA's first block trains: no frozen front to cache), under another
    # config fingerprint.  Refused before resume=false sets the earlier run aside.
    tiny(tmp_path / "run", "method=lora", "train.epochs=1")
    refused = r"^train.cache_features=false cannot act: method lora caches noth"
    # Composing refuses it (on the meta model), so a sweep's check before it trains names it: that check found it
    # only as each run of a method that caches nothing failed, in its error.log.
    with pytest.raises(config.ConfigError, match=refused):
        default_config([*TINY, "method=lora", "train.cache_features=false"])
    cfg = default_config([*TINY, f"output_dir={tmp_path / 'run'}", "method=lora", "train.epochs=1", "resume=false"])
    cfg.train.cache_features = False  # set after composing: the runner refuses it on the real model
    with pytest.raises(config.ConfigError, match=refused):
        train(cfg)
    assert (tmp_path / "run" / "result.json").is_file() and [p.name for p in tmp_path.iterdir()] == ["run"]
    # Where a calibration chooses the blocks that train (NOAH's search), the runner alone can tell whether any front
    # is frozen; a backbone in train mode (NOAH's own choice) caches nothing whatever it chooses: refused as composed.
    noah = [*TINY, "method=noah", "train.cache_features=false"]
    assert not default_config([*noah, "train.backbone_mode=eval"]).train.cache_features
    with pytest.raises(config.ConfigError, match=r"cannot act: train.backbone_mode is train, the frozen front is"):
        default_config(noah)
    with pytest.raises(config.ConfigError, match=r"cannot act: train.backbone_mode is train, the frozen front is"):
        tiny(tmp_path / "linear", "method=linear", "train.backbone_mode=train", "train.cache_features=false")
    assert not (tmp_path / "linear").exists()


def test_cache_plan_is_read_off_the_model(tiny_vit):
    def planned(method, **options):
        return cache.plan(petl.apply(tiny_vit(), method, num_classes=4, **options))

    assert planned("linear") == cache.CachePlan(start=None, features=True)
    assert planned("partial", k=1) == cache.CachePlan(start=2, features=False)
    assert planned("lora") is None and planned("full") is None and planned("vpt") is None
    model = petl.apply(tiny_vit(), "linear", num_classes=4)
    model.pos_embed.requires_grad_(True)  # a trainable stem leaves nothing frozen in front
    assert cache.plan(model) is None
    model = petl.apply(tiny_vit(), "linear", num_classes=4)
    model.blocks[1].register_forward_hook(lambda *a: None)  # something acts inside the trunk
    assert cache.plan(model) == cache.CachePlan(start=1, features=False)


@pytest.mark.slow
def test_non_finite_loss_stops_with_the_last_good_checkpoint(tmp_path, monkeypatch):
    calls = {"n": 0}

    class PoisonedLoss(torch.nn.CrossEntropyLoss):
        def forward(self, logits, labels):
            calls["n"] += 1
            loss = super().forward(logits, labels)
            return loss * float("nan") if calls["n"] > 3 else loss  # epoch 1 has 3 batches

    monkeypatch.setattr(engine.nn, "CrossEntropyLoss", PoisonedLoss)
    with pytest.raises(runner.RunError, match=r"loss became nan at epoch 2/2.*checkpoint of epoch 1 is kept"):
        tiny(tmp_path, "method=adapter")
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["epoch"] == 1
    assert not (tmp_path / "result.json").exists()


class _NanGradient(torch.autograd.Function):
    """The identity forward, NaN gradients backward: a finite loss whose step writes NaN into the weights."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


@pytest.mark.slow
def test_weights_made_non_finite_by_the_last_step_stop_the_run_without_a_result(tmp_path, monkeypatch):
    calls = {"n": 0}

    class PoisonedLastStep(torch.nn.CrossEntropyLoss):
        def forward(self, logits, labels):
            calls["n"] += 1  # 2 epochs of 3 batches: the sixth is the run's last step, after which no loss is seen
            return super().forward(_NanGradient.apply(logits) if calls["n"] == 6 else logits, labels)

    monkeypatch.setattr(engine.nn, "CrossEntropyLoss", PoisonedLastStep)
    with pytest.raises(runner.RunError, match=r"weights became non-finite .* at epoch 2/2.*checkpoint of epoch 1 is"):
        tiny(tmp_path, "method=lora")
    assert not (tmp_path / "result.json").exists()
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["epoch"] == 1


@pytest.mark.slow
def test_an_lr_whose_step_overflows_float32_stops_the_run_as_non_finite_weights_do(tmp_path):
    # AdamW raised torch's RuntimeError "value cannot be converted to type float without overflow": petl-run printed a
    # traceback where its docs promise one line (exit 1) for a non-finite trained weight.
    with pytest.raises(runner.RunError, match=r"optimizer step overflowed float32 at epoch 1/2 .*lower train.lr"):
        tiny(tmp_path, "method=lora", "train.lr=1e39")
    assert not (tmp_path / "result.json").exists()


@pytest.mark.slow
def test_nested_dict_config_is_completed_and_checked(tmp_path):
    cfg = {
        "method": {"name": "mlp"},
        "data": {"name": "mini/digits", "subset": 64},
        "model": {"name": "vit_fractal_tiny_patch4_32", "pretrained": False, "kwargs": {"depth": 1, "embed_dim": 48}},
        "train": {"epochs": 1, "progress": False},
        "output_dir": str(tmp_path),
    }
    result = train(cfg)
    assert result["method"] == "mlp" and result["config"]["train"]["lr"] == 1e-3 and result["epochs"] == 1
    with pytest.raises(config.ConfigError, match="unknown config key 'train.lrate'"):
        train({**cfg, "train": {"lrate": 1.0}})
    with pytest.raises(config.ConfigError, match=r"train.batch_size=0 is out of range: allowed \[1, inf\]"):
        train({**cfg, "train": {"batch_size": 0}})


def test_atomic_write_never_leaves_a_torn_file(tmp_path):
    target = tmp_path / "result.json"
    files.write_json(target, {"test_top1": 1.0})

    def failing(tmp: Path) -> None:
        tmp.write_text('{"test_top1": 2.')  # half a record, then the process "dies"
        raise OSError("disk full")

    with pytest.raises(OSError):
        files.write_atomic(target, failing)
    assert json.loads(target.read_text()) == {"test_top1": 1.0}
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]


def test_epoch_sampler_order_depends_on_seed_and_epoch_only():
    sampler = build.EpochSampler(50, seed=3)
    first = list(sampler)
    sampler.set_epoch(1)
    second = list(sampler)
    assert sorted(first) == list(range(50)) and first != second
    fresh = build.EpochSampler(50, seed=3)
    fresh.set_epoch(1)
    assert list(fresh) == second


def _one_epoch_of_sgd(batch_size: int, grad_accum: int, images: int = 10) -> torch.Tensor:
    """A linear model's weights after one epoch of plain SGD (lr 1) on fixed data in a fixed order."""
    gen = torch.Generator().manual_seed(0)
    inputs, labels = torch.randn(images, 5, generator=gen), torch.randint(0, 3, (images,), generator=gen)
    data = torch.utils.data.TensorDataset(inputs, labels)
    model = torch.nn.Linear(5, 3)
    with torch.no_grad():
        model.weight.copy_(torch.randn(3, 5, generator=gen))
        model.bias.zero_()
    accelerator = engine.fresh_accelerator(cpu=True, gradient_accumulation_steps=grad_accum)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    engine.train_one_epoch(model, loader, optimizer, scheduler, accelerator, engine.TrainSettings(progress=False))
    return model.weight.detach().clone()


# 10 images: batches of 4 in steps of 2 leave a last step of one batch of 2; in steps of 3, one step of 4 + 4 + 2;
# batches of 3 in steps of 2 a last step of 3 + 1.  Each step must move the weights as one batch of its images does.
@pytest.mark.parametrize(("batch_size", "grad_accum"), [(4, 2), (4, 3), (3, 2)])
def test_an_accumulated_step_is_one_batch_of_its_images_also_at_the_end_of_an_epoch(batch_size, grad_accum):
    accumulated = _one_epoch_of_sgd(batch_size, grad_accum)
    torch.testing.assert_close(accumulated, _one_epoch_of_sgd(batch_size * grad_accum, 1))


def test_full_accumulated_steps_keep_every_loss_as_it_is():
    loader = torch.utils.data.DataLoader(range(12), batch_size=3)
    assert engine.accumulation_weights(loader, 1) == []
    assert engine.accumulation_weights(loader, 2) == [1.0] * 4
    # Two processes: accelerate fills every batch, so only the last step's count of batches weighs.
    assert engine.accumulation_weights(torch.utils.data.DataLoader(range(9), batch_size=3), 2, 2) == [1.0, 1.0, 2.0]


@pytest.mark.slow
def test_local_checkpoint_replaces_the_hub_download(tmp_path):
    # Offline clusters: model.checkpoint points timm's own pretrained loader at a local file.
    source = timm.create_model("vit_fractal_tiny_patch4_32", depth=2, embed_dim=48, num_classes=0)
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, tmp_path / "w.safetensors")
    cfg = default_config([*TINY, "method=lora", "model.pretrained=true", f"model.checkpoint={tmp_path}/w.safetensors"])
    model = build.create_backbone(cfg)
    assert torch.equal(model.blocks[1].mlp.fc2.weight, source.blocks[1].mlp.fc2.weight)
    with pytest.raises(config.ConfigError, match="model.checkpoint=.*nope.safetensors: no such file"):
        build.create_backbone(default_config([*TINY, "model.pretrained=true", "model.checkpoint=nope.safetensors"]))
    # A finished run whose weights file is gone: the same usage error, not a raw FileNotFoundError.
    finished = [*TINY, "method=linear", "model.pretrained=true", f"model.checkpoint={tmp_path}/w.safetensors"]
    train(default_config([*finished, "train.epochs=1", f"output_dir={tmp_path / 'run'}"]))
    (tmp_path / "w.safetensors").unlink()
    with pytest.raises(config.ConfigError, match="no such file"):
        train(default_config([*finished, "train.epochs=1", f"output_dir={tmp_path / 'run'}"]))


@pytest.mark.slow
def test_backbone_mode_train_turns_the_feature_cache_off(tmp_path):
    # A cached front runs once, in eval mode; with train.backbone_mode=train its drop-path must act.
    run = tiny(tmp_path, "method=linear", "train.backbone_mode=train", "train.epochs=1")
    assert run["feature_cache"] is None and run["config"]["train"]["backbone_mode"] == "train"
    with pytest.raises(config.ConfigError, match="train.backbone_mode"):
        tiny(tmp_path / "bad", "method=linear", "train.backbone_mode=frozen")


@pytest.mark.slow
def test_a_last_batch_of_one_image_is_left_out_so_batchnorm_heads_train(tmp_path):
    # 97 = 3 x 32 + 1: Mlp-k's BatchNorm1d cannot train on that last single image ("Expected more than 1 value
    # per channel"), so the epoch is three batches; the image left out changes with each epoch's order.
    result = tiny(tmp_path / "run", "method=mlp", "data.subset=97", "train.epochs=1")
    assert result["final_train_top1"] is not None
    assert build.loader(list(range(97)), 32, 0, 0, drop_last=True).__len__() == 3


def test_a_training_split_of_one_image_is_refused_not_trained_in_no_step(tmp_path):
    # The lone image is a last batch of one, left out: the run took no step and recorded loss 0.0, val and test 0.
    with pytest.raises(config.ConfigError, match=r"^data mini/digits: the train800 split holds 1 image, too few"):
        tiny(tmp_path / "run", "method=lora", "data.subset=1")
    assert not (tmp_path / "run" / "result.json").exists()


def test_grad_accum_above_the_batches_of_an_epoch_is_refused_before_anything_is_written(tmp_path):
    # 96 images in batches of 32: three a step at most.  More trained exactly as three (one step at the epoch's end)
    # under another config fingerprint, and result.json recorded an effective batch of 32 x 4 images.
    with pytest.raises(config.ConfigError, match=r"^train.grad_accum=4 cannot act: an epoch holds 3 batches of "):
        tiny(tmp_path / "run", "method=lora", "train.grad_accum=4")
    assert not (tmp_path / "run").exists()
    # 97 images: the lone last one is left out, still three batches.
    with pytest.raises(config.ConfigError, match=r"give train.grad_accum=3 or less$"):
        tiny(tmp_path / "run", "method=lora", "train.grad_accum=4", "data.subset=97")


@pytest.mark.slow
def test_batches_of_one_image_are_refused_where_a_batchnorm_trains(tmp_path):
    # torch refused them at the first step: exit 1, "ValueError: Expected more than 1 value per channel...".
    with pytest.raises(config.ConfigError, match=r"^train.batch_size=1: method mlp's head.2 is a BatchNorm"):
        tiny(tmp_path / "mlp", "method=mlp", "train.batch_size=1", "data.subset=4", "train.epochs=1")
    assert tiny(tmp_path / "lora", "method=lora", "train.batch_size=1", "data.subset=4", "train.epochs=1")


@pytest.mark.slow
def test_augmented_training_images_are_not_cached_and_test_time_is_apart(tmp_path):
    # An FGVC folder (CUB layout), whose training split is cropped and flipped anew at every access.
    from PIL import Image

    folder = tmp_path / "data" / "CUB_200_2011"
    (folder / "images").mkdir(parents=True)
    Image.new("RGB", (40, 30), (200, 10, 10)).save(folder / "images" / "a.png")
    for split in ("train", "val", "test"):  # each line its own file: a split lists an image once, apart from the others
        for c in range(200):
            os.link(folder / "images" / "a.png", folder / "images" / f"{split}{c}.png")
        (folder / f"{split}.txt").write_text("".join(f"images/{split}{c}.png {c}\n" for c in range(200)))
    base = [o for o in TINY if not o.startswith(("data=", "data.subset"))]
    common = [*base, "data=fgvc/cub", f"data.root={tmp_path / 'data'}", "method=linear", "train.epochs=1"]
    augmented = train(default_config([*common, f"output_dir={tmp_path / 'a'}"]))
    plain = train(default_config([*common, "data.augment=false", f"output_dir={tmp_path / 'b'}"]))
    assert augmented["feature_cache"] is None and plain["feature_cache"] is not None
    for result in (augmented, plain):
        assert result["test_seconds"] > 0 and result["train_seconds"] < result["wall_seconds"]


def test_the_loaders_worker_seed_of_an_epoch_does_not_depend_on_the_epochs_before():
    # Each epoch's iterator draws its worker base seed from the loader's generator: a run resumed at epoch 2
    # must draw epoch 2's, not epoch 0's (it decides the random crops and flips when num_workers > 0).
    def base_seed(sampler, epoch):
        sampler.set_epoch(epoch)
        loader = build.loader(list(range(8)), 4, 0, seed=3, sampler=sampler)
        return iter(loader)._base_seed

    uninterrupted = build.EpochSampler(8, seed=3)
    seeds = [base_seed(uninterrupted, e) for e in range(3)]
    assert len(set(seeds)) == 3
    assert base_seed(build.EpochSampler(8, seed=3), 2) == seeds[2]


def test_a_cpu_run_reports_its_process_peak_also_where_cuda_is_in_use(monkeypatch):
    # A CPU run on a GPU machine (ACCELERATE_USE_CPU=1, or after GPU runs in the same process) once recorded the
    # CUDA allocator's peak, which is not its own: the kind follows the run's device, not the machine's.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *args, **kwargs: 3 * 2**20)
    assert memory.peak_memory("cuda") == (3.0, "cuda_max_allocated")
    megabytes, kind = memory.peak_memory("cpu")
    assert kind == "process_max_rss" and megabytes > 0


@pytest.mark.slow
def test_every_run_resets_its_own_peak_memory(tmp_path, monkeypatch):
    # In-process runs (a sweep, Hydra's --multirun, a notebook) would otherwise report the peak of all before them.
    resets: list[int] = []
    monkeypatch.setattr(runner, "reset_peak_rss", lambda: resets.append(1) or True)
    tiny(tmp_path / "a", "method=linear", "train.epochs=1")
    tiny(tmp_path / "b", "method=linear", "train.epochs=1")
    assert len(resets) == 2


def test_a_run_that_cannot_learn_is_marked_in_its_record(tmp_path, train_on_cpu):
    # Full fine-tuning with the lr climbing to 30 over the whole run (warm-up to the last step, no decay) blows the
    # loss up more every epoch: finite on the CPU (a GPU's kernels reach NaN and the run raises DivergedError
    # instead).  Under the default cosine decay the last epoch's low lr can bring the loss back below the first
    # epoch's, as it did on an AMD EPYC CPU (25124, 20417, 14572).
    stuck = tiny(tmp_path / "stuck", "method=full", "train.lr=30.0", "train.epochs=3", "train.warmup_frac=1.0")
    assert "not below the first epoch's" in stuck["not_learned"]
    on_disk = json.loads((tmp_path / "stuck" / "result.json").read_text())
    assert on_disk["not_learned"] == stuck["not_learned"]
    # The random-init tiny backbone does not learn digits in a few steps (train top-1 9.4 % of 96 at LoRA's default
    # lr): the shipped FractalDB weights at lr 1e-2 reach 26 % of 96 on 10 classes, far above chance.
    fine = ["data=mini/digits", "data.subset=96", "train.batch_size=32", "train.epochs=2", "train.progress=false"]
    learned = train(
        default_config([*fine, "method=lora", "method.rank=2", "train.lr=0.01", f"output_dir={tmp_path / 'fine'}"])
    )
    assert "not_learned" not in json.loads((tmp_path / "fine" / "result.json").read_text())
    assert learned.get("not_learned") is None


@pytest.mark.slow
def test_a_run_says_its_schedule_and_resolution_when_it_starts(tmp_path, capsys):
    tiny(tmp_path / "run", "method=lora", "method.rank=2")
    out = capsys.readouterr().out
    assert re.search(
        r"^training lora \(rank=2\) on mini/digits \(\d+ images\) at 32 px: 2 epochs, batch 32, lr 0\.001, "
        r"on (cpu|cuda) in (fp32|bf16 autocast)(, TF32)?$",
        out,
        re.M,
    )


def test_the_opening_line_says_the_device_processes_and_precision():
    from types import SimpleNamespace

    from petl.train.runner import device_label

    cpu = SimpleNamespace(device=torch.device("cpu"), num_processes=1, mixed_precision="no")
    assert device_label(cpu) == "on cpu in fp32"
    gloo = SimpleNamespace(device=torch.device("cpu"), num_processes=2, mixed_precision="bf16")
    assert device_label(gloo) == "on 2 processes of cpu in bf16 autocast"


@pytest.mark.parametrize("kind", sorted(TINY_MODELS))
@pytest.mark.parametrize("method", ["linear", "mlp"])
def test_cached_features_are_what_the_head_reads_on_the_live_model(images, kind, method):
    # The cache holds the pooled features, not a petl head's own pre-logits (Mlp-k's hidden layers): a head
    # trained on the cache must give the live model's logits (it gave chance-level test accuracy when it did not).
    model = petl.apply(TINY_MODELS[kind](), method, num_classes=4)
    model.train()
    model(images)  # BatchNorm's running statistics move away from their initial values
    model.eval()
    plan = cache.plan(model)
    assert plan == cache.CachePlan(start=None, features=True)
    tail = cache.CachedTail(model, plan)
    torch.testing.assert_close(tail(tail.front(images)), model(images))


@pytest.mark.parametrize("kind", ["swin", "swinv2", "swinv2_cr"])
def test_cache_on_a_swin_cuts_in_front_of_the_patch_merging(images, kind):
    # Partial-2 trains the second stage (blocks 2 and 3): the cut is taken in front of its patch merging.
    model = petl.apply(TINY_MODELS[kind](), "partial", k=2, num_classes=4).eval()
    plan = cache.plan(model)
    assert plan == cache.CachePlan(start=2, features=False)
    tail = cache.CachedTail(model, plan)
    torch.testing.assert_close(tail(tail.front(images)), model(images))
    # Partial-1 trains block 3 only; a trained patch merging in front of block 2 moves the cut in front of it.
    model = petl.apply(TINY_MODELS[kind](), "partial", k=1, num_classes=4).eval()
    assert cache.plan(model) == cache.CachePlan(start=3, features=False)
    stages = model.stages if kind == "swinv2_cr" else model.layers  # timm's SwinV2Cr names them stages
    stages[1].downsample.norm.weight.requires_grad_(True)
    assert cache.plan(model) == cache.CachePlan(start=2, features=False)
    tail = cache.CachedTail(model, cache.plan(model))
    torch.testing.assert_close(tail(tail.front(images)), model(images))


@pytest.mark.parametrize(("precision", "cached"), [("bf16", "tokens entering block 7"), ("no", None)])
def test_a_run_sizes_its_cache_in_the_dtype_its_autocast_leaves(tmp_path, monkeypatch, precision, cached):
    # The run sizes its cache under the accelerator's autocast on its device: a Swin's front under CPU bf16 returns
    # bf16 (from its patch embedding's convolution on), half float32's bytes, so a cache that fits only as bf16 is made
    # under train.precision=bf16 and not in fp32.  Partial-1's cut on swin_fractal_tiny takes a 4x4 grid at width 256;
    # data.subset=16 caches 16 train and 16 val images.
    from petl.utils.precision import cpu_supports_bf16

    if torch.cuda.is_available() or not cpu_supports_bf16():
        pytest.skip("the Swin's cache is bf16 only under a CPU's bf16 autocast")
    monkeypatch.setattr(cache, "MAX_CACHE_BYTES", 32 * 4 * 4 * 256 * 2)
    swin = ["model=swin_fractal_tiny_patch2_window4_32", "model.pretrained=false", "data=mini/digits"]
    overrides = [*swin, "data.subset=16", "method=partial", "method.k=1", "train.epochs=1", "train.progress=false"]
    result = train(default_config([*overrides, f"train.precision={precision}", f"output_dir={tmp_path}"]))
    assert result["feature_cache"] == cached
