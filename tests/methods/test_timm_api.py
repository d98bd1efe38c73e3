"""What timm and torch users do with a model keeps working after petl.apply, for every experiment.

Each test runs the same check on the plain timm model and on every experiment of the registry
(``configs/experiments`` plus the methods no experiment file runs), and asserts the petl model behaves
as the plain one does, or refuses in one line naming its method.  Test bodies never name a method.
Gradient checkpointing's registry-wide test is tests/training/test_train_options.py's.  Each test also checks that its
column of the works-with table (``petl.model.timm_api.support``, docs/works-with.md) says what the model did.
"""

from __future__ import annotations

import copy
import io
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_MODELS, make_tiny_vit, perturb_trainable
from timm.optim import param_groups_weight_decay

import petl
from petl.bench.timm_support import support_table
from petl.model import timm_api
from petl.model.backbone import backbone_of
from petl.model.wrappers import PetlHead, PetlModule
from petl.presets import configs_dir, list_experiments, load_experiment
from petl.train import engine

CONFIGS = configs_dir()
EXPERIMENTS = list_experiments(CONFIGS)


def _method(name: str) -> tuple[str, dict]:
    method = dict(load_experiment(name, CONFIGS).method)
    return method.pop("name"), method


def _applied(name: str, num_classes: int = 4, **overrides) -> torch.nn.Module:
    method, options = _method(name)
    model = petl.apply(make_tiny_vit(**overrides), method, num_classes=num_classes, **options)
    perturb_trainable(model)  # zero-initialised branches act
    return model


def _grads(model: torch.nn.Module, images: torch.Tensor, seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)  # the same dropout masks in both runs
    model.zero_grad()
    F.cross_entropy(model(images), torch.tensor([0, 1])).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


# ----------------------------------------------------------------------------------------- reset_classifier


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_reset_classifier_keeps_the_method_or_refuses(images, tmp_path, name):
    plain = make_tiny_vit()
    plain.reset_classifier(7)
    model = _applied(name)
    model.reset_classifier(7)
    built = _applied(name, num_classes=7)
    # The head has the structure petl.apply builds at 7 classes, and everything trains as there.
    assert type(backbone_of(model).head()) is type(backbone_of(built).head())
    shapes = {n: (p.shape, p.requires_grad) for n, p in model.named_parameters()}
    assert shapes == {n: (p.shape, p.requires_grad) for n, p in built.named_parameters()}
    assert model.eval()(images).shape == plain(images).shape
    # Every trained tensor still reaches the output (timm's plain Linear would cut the method's head off).
    grads = _grads(model.train(), images)
    assert [n for n, p in model.named_parameters() if p.requires_grad and n not in grads] == []
    # The recorded config follows the head, so the trained tensors load onto a fresh backbone.
    path = tmp_path / "trained.safetensors"
    petl.save_trainable(model, path)
    assert torch.equal(petl.load_trainable(make_tiny_vit(), path).eval()(images), model.eval()(images))
    # No classes: timm's pooled features, or a one-line refusal where the method's own head would go.
    plain.reset_classifier(0)
    if isinstance(backbone_of(model).head(), PetlHead):
        with pytest.raises(ValueError, match=f"method '{model.petl_method}'.*its own") as refused:
            model.reset_classifier(0)
        assert "\n" not in str(refused.value)
        assert model(images).shape == (2, 7)  # refused before anything changed
    else:
        model.reset_classifier(0)
        assert model(images).shape == plain(images).shape


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_timms_optimizer_exempts_from_weight_decay_what_petls_does(name):
    model = _applied(name)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    exempt_timm = {
        n
        for group in param_groups_weight_decay(model, 0.05, no_weight_decay_list=model.no_weight_decay())
        if group["weight_decay"] == 0.0
        for n, p in model.named_parameters()
        if any(p is q for q in group["params"])
    }
    assert exempt_timm == trainable & engine.no_weight_decay_names(model)
    assert set(make_tiny_vit().no_weight_decay()) <= model.no_weight_decay()


def test_overrides_follow_copies_and_pickles(images):
    model = _applied("mlp")
    copied = copy.deepcopy(model)
    copied.reset_classifier(7)
    assert copied(images).shape == (2, 7) and model.eval()(images).shape == (2, 4)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    loaded.reset_classifier(6)
    assert type(backbone_of(loaded).head()) is type(backbone_of(model).head()) and loaded.eval()(images).shape == (2, 6)
    assert model.eval()(images).shape == (2, 4)


def test_unload_gives_back_timms_methods():
    model = petl.unload(petl.merge(_applied("lora")))
    assert not set(timm_api.OVERRIDES) & set(vars(model))


def test_merge_with_unload_still_unloads_and_warns_at_the_callers_line(images):
    # merge(model, unload=True) was petl.unload(model) under merge's name: it stays for a release, with a warning
    # that names the call's own file, and merge(model, unload=False) merges as merge(model) does.
    model = _applied("lora").eval()
    with torch.no_grad():
        want = model(images)
    with pytest.warns(DeprecationWarning, match=r"call petl\.unload\(model\)") as warned:
        plain = petl.merge(model, unload=True)
    assert warned[0].filename == __file__
    assert not any(isinstance(m, PetlModule) for m in plain.modules())
    with torch.no_grad():
        torch.testing.assert_close(plain(images), want, rtol=1e-4, atol=1e-5)
    merged = _applied("lora")
    with pytest.warns(DeprecationWarning):
        petl.merge(merged, unload=False)
    assert any(isinstance(m, PetlModule) for m in merged.modules()) and all(
        m.merged for m in merged.modules() if isinstance(m, PetlModule) and m.mergeable
    )


# ----------------------------------------------------------------------------------------------- forward_head


def _last_linear(head: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight and bias of a head's last Linear: its last two parameters (timm's Linear, Mlp-k's, HST's)."""
    weight, bias = list(head.parameters())[-2:]
    assert weight.dim() == 2 and bias.shape == weight.shape[:1]
    return weight, bias


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_forward_head_pre_logits_are_what_the_last_linear_reads(images, name):
    # timm's meaning, on the plain model: the pre-logits are the features the classifier's last Linear maps to
    # the logits.
    plain = make_tiny_vit(num_classes=4)
    pooled = plain.forward_head(plain.forward_features(images), pre_logits=True)
    torch.testing.assert_close(F.linear(pooled, *_last_linear(plain.head)), plain(images))
    model = _applied(name).eval()
    weight, bias = _last_linear(backbone_of(model).head())
    with torch.no_grad():
        pre = model.forward_head(model.forward_features(images), pre_logits=True)
        logits = model.forward_head(model.forward_features(images))
    assert pre.shape == (2, weight.shape[1])
    torch.testing.assert_close(F.linear(pre, weight, bias), logits)
    own_head = isinstance(backbone_of(model).head(), PetlHead)
    assert timm_api.support(model)["forward_head(pre_logits)"] == (
        "the head's hidden features" if own_head else "timm's"
    )


# ------------------------------------------------------------------------------------ forward_intermediates


# A class token and a register token ahead of the patches (prompts go after both), and average pooling (VPT's
# default pooling then reads its prompts: the final features keep them).
PREFIXED = {"reg_tokens": 1, "global_pool": "avg"}


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_forward_intermediates_match_the_plain_model(images, name):
    plain = make_tiny_vit(**PREFIXED)
    model = _applied(name, **PREFIXED).eval()
    for options in ({}, {"output_fmt": "NLC", "return_prefix_tokens": True, "indices": [0, 2]}):
        want = plain.forward_intermediates(images, intermediates_only=True, **options)
        got = model.forward_intermediates(images, intermediates_only=True, **options)
        assert [[t.shape for t in torch.utils._pytree.tree_leaves(g)] for g in got] == [
            [t.shape for t in torch.utils._pytree.tree_leaves(w)] for w in want
        ]
    want = plain.forward_intermediates(images, output_dict=True, return_prefix_tokens=True)
    got = model.forward_intermediates(images, output_dict=True, return_prefix_tokens=True)
    assert got.keys() == want.keys()
    for key in ("image_intermediates", "image_intermediates_prefix"):
        assert [t.shape for t in got.get(key, [])] == [t.shape for t in want.get(key, [])]
    # The final features are forward_features' (prompts included where the pooling reads them), and the last
    # block's patch tokens, normed, are its last tokens.
    features = model.forward_features(images)
    torch.testing.assert_close(got["image_features"], features)
    final, (last,) = model.forward_intermediates(images, indices=1, norm=True, output_fmt="NLC")
    torch.testing.assert_close(final, features)
    torch.testing.assert_close(last, features[:, features.shape[1] - last.shape[1] :])


# ----------------------------------------------------------------------------------- prune_intermediate_layers


@pytest.mark.parametrize("prune_head", [True, False])
@pytest.mark.parametrize("name", EXPERIMENTS)
def test_prune_intermediate_layers_as_timm_or_refused(images, name, prune_head):
    plain = make_tiny_vit(num_classes=4)
    model = _applied(name).eval()
    with torch.no_grad():
        before = model.forward_intermediates(images, indices=[0, 1], intermediates_only=True)
        # timm's pruned model returns the unpruned features (prune_head, pooling off) or logits, of the kept blocks.
        want = model.forward_features(images).shape if prune_head else model(images).shape
        plain_want = plain.forward_features(images).shape if prune_head else plain(images).shape
    cell = timm_api.support(model)["prune_intermediate_layers"]
    assert (cell == "timm's") == (not isinstance(backbone_of(model).head(), PetlHead)) or cell.startswith("refused")
    if cell.startswith("refused") or (prune_head and cell == "`prune_head=False` only"):
        # The method cannot follow: one line naming the method, and nothing changed.
        with pytest.raises(ValueError, match=f"prune_intermediate_layers: method '{model.petl_method}'") as error:
            model.prune_intermediate_layers([0, 1], prune_head=prune_head)
        assert "\n" not in str(error.value) and len(model.blocks) == 3 and model(images).shape == (2, 4)
        return
    kept = plain.prune_intermediate_layers([0, 1], prune_head=prune_head)
    assert model.prune_intermediate_layers([0, 1], prune_head=prune_head) == kept
    assert len(model.blocks) == len(plain.blocks) == 2
    with torch.no_grad():
        after = model.forward_intermediates(images, indices=kept, intermediates_only=True)
        assert plain(images).shape == plain_want and model(images).shape == want
    for got, wanted in zip(after, before, strict=True):
        torch.testing.assert_close(got, wanted)


# -------------------------------------------------------------------------------------------------- autocast


CUDA = pytest.mark.cuda  # skipped without a CUDA GPU (tests/conftest.py)
AUTOCASTS = [
    pytest.param("cpu", torch.bfloat16, id="cpu-bf16"),
    pytest.param("cuda", torch.float16, id="cuda-fp16", marks=CUDA),
    pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=CUDA),
]


@pytest.mark.parametrize(("device", "dtype"), AUTOCASTS)
@pytest.mark.parametrize("name", EXPERIMENTS)
def test_autocast(images, name, device, dtype):
    model, images = _applied(name).eval().to(device), images.to(device)
    with torch.no_grad():
        full = model(images)
        with torch.autocast(device, dtype=dtype):
            half = model(images)
    # Within 4 of the autocast dtype's steps (eps) of the largest logit: the worst experiment measured 1.6 in bf16
    # on the CPU (1.25% of the largest logit) on the tiny ViT.
    assert torch.isfinite(half).all()
    torch.testing.assert_close(half.float(), full, atol=4 * torch.finfo(dtype).eps * full.abs().max().item(), rtol=0)
    model.train()
    with torch.autocast(device, dtype=dtype):
        loss = F.cross_entropy(model(images).float(), torch.tensor([0, 1], device=device))
    loss.backward()
    assert torch.isfinite(loss)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert [n for n, p in trainable.items() if p.grad is None or not torch.isfinite(p.grad).all()] == []


# Same gradients or refused when switched on, for every method: tests/training/test_train_options.py
# (test_grad_checkpointing_gives_the_same_loss_and_gradients).


def test_apply_on_a_checkpointing_model_refuses_a_side_network():
    model = make_tiny_vit()
    model.set_grad_checkpointing(True)
    with pytest.raises(ValueError, match="method 'lst' cannot use it"):
        petl.apply(model, "lst", num_classes=4)


# --------------------------------------------------------------------------------- compile, torchscript, export


@pytest.mark.exhaustive  # inductor compiles each experiment's forward and backward: a minute or more on two CPU cores
@pytest.mark.skipif(engine.compiler_missing("cpu") is not None, reason="torch.compile on CPU needs a C++ compiler")
@pytest.mark.parametrize("name", EXPERIMENTS)
def test_compile_gives_the_same_logits_and_gradients(images, name):
    model = _applied(name)
    compiled = torch.compile(copy.deepcopy(model))
    with torch.no_grad():
        torch.testing.assert_close(compiled.eval()(images), model.eval()(images), rtol=1e-4, atol=1e-5)
    # Gradients in eval mode: inductor draws dropout masks from its own generator, not eager's, and BatchNorm over a
    # batch of two (Mlp-k's, HST's) would turn its kernel-fusion rounding into large differences.
    want, got = _grads(model.eval(), images), _grads(compiled.eval(), images)
    assert got.keys() == {f"_orig_mod.{n}" for n in want}
    for key, grad in want.items():
        torch.testing.assert_close(got[f"_orig_mod.{key}"], grad, rtol=1e-3, atol=1e-5)
    assert timm_api.support(model)["torch.compile"] == "same logits"


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_torchscript_traces_the_same_logits_and_scripts_or_refuses(images, name):
    model, other = _applied(name).eval(), 2 * images.flip(0)
    with torch.no_grad():
        traced = torch.jit.trace(model, images, check_trace=False)
        torch.testing.assert_close(traced(other), model(other))
    cell = timm_api.support(model)["torchscript"]
    if cell == "trace, script":
        scripted = torch.jit.script(model)
        with torch.no_grad():
            torch.testing.assert_close(scripted(other), model(other))
        assert not any(isinstance(m, PetlModule) for m in model.modules())
        return
    assert cell == "trace; script refused"
    with pytest.raises(TypeError, match=f"torch.jit.script: method '{model.petl_method}' wraps .*trace") as error:
        torch.jit.script(model)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_merged_export_is_plain_timm_with_the_same_logits_or_refused(images, tmp_path, name):
    model = _applied(name).eval()
    with torch.no_grad():
        want = model(images)
    cell = timm_api.support(model)["export (merged)"]
    if cell.startswith("refused"):
        with pytest.raises(ValueError, match=f"method '{model.petl_method}' cannot be unloaded") as error:
            petl.unload(model)
        assert "\n" not in str(error.value)
        # What to do instead, for petl-export's users too (it named only petl.load_run, a Python function).
        assert str(error.value).endswith("(use it as a petl model: petl-predict or petl-serve on its run folder, "
                                         "petl.load_run in Python)")  # fmt: skip
        return
    assert cell == "timm folder, ONNX"
    plain = petl.unload(model)
    assert type(plain) is type(make_tiny_vit()) and not set(timm_api.OVERRIDES) & set(vars(plain))
    assert not any(isinstance(m, PetlModule) for m in plain.modules())
    fresh = make_tiny_vit(num_classes=4)
    fresh.load_state_dict(plain.state_dict())  # what timm.create_model loads from the exported weights
    with torch.no_grad():
        torch.testing.assert_close(fresh(images), want, rtol=1e-4, atol=1e-5)
    # petl-export's ONNX path (the TorchScript exporter, as petl.deploy.export.save_onnx calls it).
    torch.onnx.export(fresh, (images,), str(tmp_path / "model.onnx"), dynamo=False, opset_version=17)
    assert (tmp_path / "model.onnx").stat().st_size > 0


def test_docs_works_with_table_is_generated_from_the_registry():
    page = (Path(__file__).resolve().parents[2] / "docs" / "works-with.md").read_text()
    match = re.search(r"<!-- works-with -->\n(.*?)<!-- /works-with -->", page, flags=re.S)
    assert match, "docs/works-with.md: the works-with table's markers are missing"
    table = support_table()
    assert match.group(1) == table, f"docs/works-with.md's table is stale: run python docs/gen.py, or paste:\n{table}"


# ------------------------------------------------------------------------------------ on a staged backbone

# Every experiment whose method supports Swin, SwinV2 or SwinV2Cr, on the tiny model of that kind.
STAGED = [
    (kind, name)
    for kind in ("swin", "swinv2", "swinv2_cr")
    for name in EXPERIMENTS
    if kind in petl.get_method(_method(name)[0]).backbones
]


def _applied_on(kind: str, name: str) -> torch.nn.Module:
    method, options = _method(name)
    model = petl.apply(TINY_MODELS[kind](), method, num_classes=4, **options)
    perturb_trainable(model)
    return model.eval()


@pytest.mark.parametrize(("kind", "name"), STAGED)
def test_forward_intermediates_on_a_staged_backbone_are_timms(images, kind, name):
    plain, model = TINY_MODELS[kind](num_classes=4), _applied_on(kind, name)
    for options in ({}, {"indices": [0], "norm": True}, {"indices": 1, "stop_early": True}):
        want = plain.forward_intermediates(images, intermediates_only=True, **options)
        got = model.forward_intermediates(images, intermediates_only=True, **options)
        assert [t.shape for t in got] == [t.shape for t in want] == [t.shape for t in want]
    final, stages = model.forward_intermediates(images)
    assert [t.shape for t in stages] == [(2, 16, 8, 8), (2, 32, 4, 4)]  # NCHW per stage, as timm's
    torch.testing.assert_close(final, model.forward_features(images))
    # Pruned to the first stage as timm prunes, the kept stage's map is unchanged (where the head lets it prune).
    if timm_api.support(model)["prune_intermediate_layers"] != "timm's":
        return
    kept = model.prune_intermediate_layers([0], prune_head=True)
    assert kept == plain.prune_intermediate_layers([0], prune_head=True)
    torch.testing.assert_close(model.forward_intermediates(images, intermediates_only=True)[0], stages[0])


@pytest.mark.parametrize(("kind", "name"), STAGED)
def test_merged_export_on_a_staged_backbone_is_plain_timm_or_refused(images, kind, name):
    model = _applied_on(kind, name)
    with torch.no_grad():
        want = model(images)
    if timm_api.support(model)["export (merged)"].startswith("refused"):
        with pytest.raises(ValueError, match=f"method '{model.petl_method}' cannot be unloaded"):
            petl.unload(model)
        return
    plain = petl.unload(model)
    assert not any(isinstance(m, PetlModule) for m in plain.modules())
    fresh = TINY_MODELS[kind](num_classes=4)
    fresh.load_state_dict(plain.state_dict())  # what timm.create_model loads from the exported weights
    with torch.no_grad():
        torch.testing.assert_close(fresh(images), want, rtol=1e-4, atol=1e-5)
