"""Training options that trade or save compute: gradient checkpointing, torch.compile, bf16 on CPU.

Each must run and give the loss (and gradients) it gives without it, within the option's tolerance:
exact up to float rounding for checkpointing, bf16 rounding for bf16, kernel-fusion rounding for compile.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_vit, perturb_trainable

import petl
from petl.model import timm_api
from petl.model.backbone import backbone_of
from petl.model.wrappers import PetlModule
from petl.presets import configs_dir, list_experiments, load_experiment
from petl.run import default_config, train
from petl.train import engine

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
def test_bf16_autocasts_where_the_cpu_supports_it(tmp_path, monkeypatch):
    monkeypatch.setattr(engine, "cpu_supports_bf16", lambda: True)
    fp32 = _run(tmp_path / "fp32", "method=lora")
    bf16 = _run(tmp_path / "bf16", "method=lora", "train.precision=bf16")
    assert fp32["precision"] == "no" and bf16["precision"] == "bf16"
    # bf16 rounding changes the loss a little (so autocast really ran), not more.
    assert bf16["final_train_loss"] != fp32["final_train_loss"]
    assert bf16["final_train_loss"] == pytest.approx(fp32["final_train_loss"], rel=2e-2)


@pytest.mark.slow
def test_bf16_falls_back_with_a_warning_where_the_cpu_lacks_it(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(engine, "cpu_supports_bf16", lambda: False)
    with caplog.at_level(logging.WARNING):
        result = _run(tmp_path / "run", "method=lora", "train.precision=bf16")
    assert result["precision"] == "no" and "no bf16 instructions" in caplog.text


@pytest.mark.slow
def test_compile_falls_back_with_a_warning_without_a_compiler(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(engine, "compiler_missing", lambda device: "no C++ compiler (test)")
    plain = _run(tmp_path / "plain", "method=linear")
    with caplog.at_level(logging.WARNING):
        result = _run(tmp_path / "run", "method=linear", "train.compile=true")
    assert "running uncompiled" in caplog.text and result["final_train_loss"] == plain["final_train_loss"]
    assert result["compiled"] is False


@pytest.mark.slow
@pytest.mark.skipif(engine.compiler_missing("cpu") is not None, reason="torch.compile on CPU needs a C++ compiler")
def test_compile_run_gives_the_same_loss(tmp_path):
    # The cheapest real compile: a linear probe trains only the head on cached features.
    plain = _run(tmp_path / "plain", "method=linear")
    compiled = _run(tmp_path / "compiled", "method=linear", "train.compile=true")
    assert compiled["final_train_loss"] == pytest.approx(plain["final_train_loss"], rel=1e-4)
    assert compiled["test_top1"] == plain["test_top1"]
    assert compiled["compiled"] is True and plain["compiled"] is False
