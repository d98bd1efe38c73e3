"""Training options that trade or save compute: gradient checkpointing, torch.compile, bf16 on CPU.

Each must run and give the loss (and gradients) it gives without it, within the option's tolerance:
exact up to float rounding for checkpointing, bf16 rounding for bf16, kernel-fusion rounding for compile.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import safetensors.torch
import torch
from conftest import make_tiny_vit, perturb_trainable

import petl
from petl.model import timm_api
from petl.model.backbone import backbone_of
from petl.model.wrappers import PetlModule
from petl.presets import configs_dir, list_experiments, load_experiment
from petl.run import default_config, train
from petl.store.result import read_result
from petl.train import build, engine, runner
from petl.train.output_dir import check_finished
from petl.utils import precision
from petl.utils import random as random_state
from petl.utils.errors import ConfigError

TINY = [
    "data=mini/digits",
    "data.subset=64",
    "model=vit_fractal_tiny_patch4_32",
    "model.pretrained=false",
    "+model.kwargs.depth=2",
    "+model.kwargs.embed_dim=48",
    "train.epochs=1",
    "train.batch_size=32",
    "train.progress=false",
]

# Every experiment of the registry (configs/experiments plus the methods no experiment file runs), with its options.
CONFIGS = configs_dir()
EXPERIMENTS = list_experiments(CONFIGS)


def _experiment(name: str) -> tuple[str, dict]:
    method = dict(load_experiment(name, CONFIGS).method)
    return method.pop("name"), method


def _run(out: Path, *overrides: str) -> dict:
    return train(default_config([*TINY, f"output_dir={out}", *overrides]))


def _loss_and_grads(model: torch.nn.Module, images: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    torch.manual_seed(3)  # same dropout masks in both runs (checkpointing replays the RNG state)
    engine.set_train_mode(model)
    loss = torch.nn.functional.cross_entropy(model(images), torch.arange(len(images)) % 5)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_grad_checkpointing_gives_the_same_loss_and_gradients(experiment, images):
    name, options = _experiment(experiment)
    plain = petl.apply(make_tiny_vit(), name, num_classes=5, **options)
    perturb_trainable(plain)  # zero-initialised branches act, so their gradients are not trivially equal
    ckpt = petl.apply(make_tiny_vit(), name, num_classes=5, **options)
    ckpt.load_state_dict(plain.state_dict())
    cell = timm_api.support(ckpt)["set_grad_checkpointing"]
    if any(isinstance(m, PetlModule) and m.no_grad_checkpointing for m in ckpt.modules()):
        # A side network reads the blocks in order in one forward; a re-run block would feed it twice: refused when
        # switched on, in one line naming the method and why.
        with pytest.raises(ValueError, match=f"method '{name}' cannot use it: .+") as refused:
            engine.enable_grad_checkpointing(ckpt)
        assert "\n" not in str(refused.value) and not ckpt.grad_checkpointing
        assert cell.startswith("refused")
        return
    assert cell == "same gradients"
    engine.enable_grad_checkpointing(ckpt)
    # Count forwards of the first block as the model runs it (a method's wrapper, if it replaced the block;
    # pre-hooks: the recomputation stops early, before post-hooks): a checkpointed block that something
    # below it trains runs again in the backward.
    calls = []
    backbone_of(ckpt).block_container()[0].register_forward_pre_hook(lambda *_: calls.append(1))
    loss, grads = _loss_and_grads(plain, images)
    loss_ckpt, grads_ckpt = _loss_and_grads(ckpt, images)
    assert loss_ckpt == pytest.approx(loss, rel=1e-6)
    assert grads.keys() == grads_ckpt.keys() and grads
    for key, grad in grads.items():
        torch.testing.assert_close(grads_ckpt[key], grad, rtol=1e-4, atol=1e-6)
    first_block_trains = any(p.requires_grad for p in ckpt.blocks[0].parameters())
    assert len(calls) == (2 if first_block_trains else 1)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["lora", "partial"])  # uncached, and cached tail (CachedTail)
def test_grad_checkpointing_run_matches_the_plain_run(tmp_path, method):
    plain = _run(tmp_path / "plain", f"method={method}")
    ckpt = _run(tmp_path / "ckpt", f"method={method}", "train.grad_checkpointing=true")
    assert ckpt["config"]["train"]["grad_checkpointing"] is True
    assert ckpt["final_train_loss"] == pytest.approx(plain["final_train_loss"], rel=1e-5)


@pytest.mark.slow
def test_bf16_autocasts_where_the_cpu_supports_it(tmp_path, monkeypatch, train_on_cpu):
    monkeypatch.setattr(build, "cpu_supports_bf16", lambda: True)
    fp32 = _run(tmp_path / "fp32", "method=lora")
    bf16 = _run(tmp_path / "bf16", "method=lora", "train.precision=bf16")
    assert fp32["precision"] == "no" and bf16["precision"] == "bf16"
    # bf16 rounding changes the loss a little (so autocast really ran), not more.
    assert bf16["final_train_loss"] != fp32["final_train_loss"]
    assert bf16["final_train_loss"] == pytest.approx(fp32["final_train_loss"], rel=2e-2)


@pytest.mark.slow
def test_bf16_falls_back_with_a_warning_where_the_cpu_lacks_it(tmp_path, monkeypatch, train_on_cpu, caplog):
    monkeypatch.setattr(build, "cpu_supports_bf16", lambda: False)
    with caplog.at_level(logging.WARNING):
        result = _run(tmp_path / "run", "method=lora", "train.precision=bf16")
    assert result["precision"] == "no" and "no bf16 instructions" in caplog.text


@pytest.mark.slow
def test_compile_falls_back_with_a_warning_without_a_compiler(tmp_path, monkeypatch, caplog, train_on_cpu):
    # What the CPU does without a C++ compiler (inductor's CPU code needs one; compiler_missing never refuses CUDA).
    monkeypatch.setattr(engine, "compiler_missing", lambda device: "no C++ compiler (test)")
    plain = _run(tmp_path / "plain", "method=linear")
    with caplog.at_level(logging.WARNING):
        result = _run(tmp_path / "run", "method=linear", "train.compile=true")
    assert "running uncompiled" in caplog.text and result["final_train_loss"] == plain["final_train_loss"]
    assert result["compiled"] is False


@pytest.mark.slow
@pytest.mark.skipif(engine.compiler_missing("cpu") is not None, reason="torch.compile on CPU needs a C++ compiler")
def test_compile_run_gives_the_same_loss(tmp_path, train_on_cpu):
    # The cheapest real compile: a linear probe trains only the head on cached features.
    plain = _run(tmp_path / "plain", "method=linear")
    compiled = _run(tmp_path / "compiled", "method=linear", "train.compile=true")
    assert compiled["final_train_loss"] == pytest.approx(plain["final_train_loss"], rel=1e-4)
    assert compiled["test_top1"] == plain["test_top1"]
    assert compiled["compiled"] is True and plain["compiled"] is False


# --- precision: auto, tf32, and what the record says ----------------------------------------------------------


@pytest.mark.parametrize(
    ("device", "native_bf16", "expected"),
    [("cuda", True, "bf16"), ("cuda", False, "no"), ("cpu", True, "no"), ("cpu", False, "no"), ("mps", True, "no")],
)
def test_auto_precision_is_bf16_on_a_gpu_with_native_bf16_and_fp32_elsewhere(device, native_bf16, expected):
    assert precision.auto_precision(device, native_bf16) == expected


def test_tf32_is_on_for_every_cuda_precision_but_strict_fp32_and_never_on_a_cpu():
    assert [precision.uses_tf32(p, "cuda") for p in ("no", "tf32", "bf16", "fp16")] == [False, True, True, True]
    assert not any(precision.uses_tf32(p, "cpu") for p in ("no", "tf32", "bf16", "fp16"))


@pytest.mark.slow
def test_the_default_precision_on_a_cpu_is_bit_identical_to_fp32(tmp_path, train_on_cpu):
    default = _run(tmp_path / "auto", "method=lora")
    fp32 = _run(tmp_path / "no", "method=lora", "train.precision=no")
    for key in ("final_train_loss", "val_top1", "best_val_top1", "test_top1"):
        assert default[key] == fp32[key], key
    trained = [safetensors.torch.load_file(tmp_path / name / "trainable.safetensors") for name in ("auto", "no")]
    assert trained[0].keys() == trained[1].keys()
    assert all(torch.equal(trained[0][k], trained[1][k]) for k in trained[0])
    # What ran is recorded: auto became "no" here, in config.yaml's fingerprint too, and no TF32.
    assert default["precision"] == "no" and default["tf32"] is False
    assert default["config"]["train"]["precision"] == "no"
    # So the folder of a train.precision=no run holds the default config's run: returned, not trained again...
    again = _run(tmp_path / "no", "method=lora")
    assert again["finished_at"] == fp32["finished_at"] and again["train_seconds"] == fp32["train_seconds"]
    check_finished(default_config([*TINY, f"output_dir={tmp_path / 'no'}", "method=lora"]))
    # ...and not a bf16 one's.
    with pytest.raises(ConfigError, match="train.precision: 'no' -> 'bf16'"):
        check_finished(default_config([*TINY, f"output_dir={tmp_path / 'no'}", "method=lora", "train.precision=bf16"]))


@pytest.mark.parametrize("asked", ["tf32", "fp16"])
def test_tf32_or_fp16_without_a_gpu_is_refused_before_anything_is_written(tmp_path, train_on_cpu, asked):
    # They ran in fp32 with a warning: the train.precision=no run, under another config fingerprint.
    message = f"^train.precision={asked} acts on a CUDA GPU only, and this run trains on cpu: give train.precision=no"
    with pytest.raises(ConfigError, match=message):
        _run(tmp_path / "run", "method=linear", f"train.precision={asked}")
    assert not (tmp_path / "run").exists()


def test_a_resume_that_sees_fewer_gpus_restores_the_states_of_those_it_has(monkeypatch):
    # A checkpoint holds one CUDA generator state per GPU the saving process saw; resumed where fewer are visible
    # (another machine, CUDA_VISIBLE_DEVICES), torch's set_rng_state_all raised an IndexError at the first one past
    # them.  Mocked, so it runs without a GPU: the fake refuses a GPU index past the count, as torch does.
    restored = []

    def set_rng_state_all(states):
        for index, value in enumerate(states):
            if index >= torch.cuda.device_count():
                raise IndexError("tuple index out of range")
            restored.append(value)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [torch.zeros(16, dtype=torch.uint8)] * 2)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", set_rng_state_all)
    state = random_state.rng_state()
    assert len(state["cuda"]) == 2
    random_state.set_rng_state(state)
    assert len(restored) == 1


# --- on a CUDA GPU (marked cuda: skipped without one) -------------------------------------------------------


def _cuda_switches() -> tuple[bool, bool, bool]:
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark


def _run_seeing_switches(monkeypatch, out: Path, *overrides: str) -> tuple[dict, tuple[bool, bool, bool]]:
    """A run, and torch's TF32 / cuDNN-autotuner switches as they were while it trained."""
    seen = []
    train_and_record = runner._train_and_record

    def spy(*args, **kwargs):
        seen.append(_cuda_switches())
        return train_and_record(*args, **kwargs)

    monkeypatch.setattr(runner, "_train_and_record", spy)
    return _run(out, *overrides), seen[0]


@pytest.mark.cuda
def test_a_default_run_on_cuda_autocasts_bf16_with_tf32_and_puts_the_switches_back(tmp_path, monkeypatch):
    before = _cuda_switches()
    result, during = _run_seeing_switches(monkeypatch, tmp_path / "run", "method=lora")
    expected = "bf16" if precision.cuda_has_native_bf16() else "no"
    assert result["device"].startswith("cuda")
    assert result["precision"] == expected and result["config"]["train"]["precision"] == expected
    assert result["tf32"] is (expected == "bf16") and during[:2] == (expected == "bf16",) * 2
    assert during[2] is False  # deterministic by default: no cuDNN autotuning
    assert _cuda_switches() == before
    assert result["test_top1"] is not None and torch.isfinite(torch.tensor(result["final_train_loss"]))


@pytest.mark.cuda
def test_strict_fp32_on_cuda_turns_tf32_off_and_tf32_turns_it_on(tmp_path, monkeypatch):
    strict, during_strict = _run_seeing_switches(monkeypatch, tmp_path / "no", "method=lora", "train.precision=no")
    tf32, during_tf32 = _run_seeing_switches(monkeypatch, tmp_path / "tf32", "method=lora", "train.precision=tf32")
    assert strict["precision"] == "no" and strict["tf32"] is False and during_strict[:2] == (False, False)
    assert tf32["precision"] == "no" and tf32["tf32"] is True and during_tf32[:2] == (True, True)
    assert tf32["config"]["train"]["precision"] == "tf32"


@pytest.mark.cuda
def test_a_nondeterministic_cuda_run_lets_cudnn_autotune(tmp_path, monkeypatch):
    _, during = _run_seeing_switches(monkeypatch, tmp_path / "run", "method=linear", "train.deterministic=false")
    assert during[2] is True


@pytest.mark.cuda
@pytest.mark.slow
def test_a_compiled_run_on_cuda_compiles_under_the_default_precision(tmp_path):
    result = _run(tmp_path / "run", "method=lora", "train.compile=true")
    assert result["compiled"] is True and result["precision"] == ("bf16" if precision.cuda_has_native_bf16() else "no")
    assert result["test_top1"] is not None and torch.isfinite(torch.tensor(result["final_train_loss"]))


def test_a_batch_size_above_the_training_split_is_recorded_and_said_as_the_batch_that_ran(tmp_path, capsys):
    # Not refused (the default 64 is above a small folder): each step takes the whole split, and the record and the
    # first line say that batch, not the option's (effective_batch_size once read 64 for steps of 24 images).
    result = _run(tmp_path / "run", "data.subset=24", "train.batch_size=64", "method=linear")
    assert result["effective_batch_size"] == 24
    assert "batch 24 (all the training images: train.batch_size=64 is more)" in capsys.readouterr().out


def test_the_record_says_how_many_optimizer_steps_ran(tmp_path):
    # 40 images in batches of 8 accumulated in twos: 5 batches, steps of 2, 2 and 1 batches, so 3 steps an epoch.
    result = _run(tmp_path / "run", "data.subset=40", "train.batch_size=8", "train.grad_accum=2", "train.epochs=2")
    assert (result["optimizer_steps"], result["effective_batch_size"]) == (6, 16)
    assert read_result(tmp_path / "run" / "result.json").optimizer_steps == 6
