"""Contract tests every registered method meets, parametrized over the registry.

Test bodies never name a method: what a method promises comes from its MethodSpec flags
(zero_init, mergeable) and its trainable_formula.  Method-specific behaviour (VPT token layout,
Partial-k block choice, LoRA row slices, adapter placement, the peft bridge) has its own tests
further down.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_FAMILIES, TINY_MODELS, make_tiny_family, perturb_trainable
from peft import LoraConfig
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors import safe_open

import petl
from petl.methods.adapter import ParallelAdapter, SequentialAdapter
from petl.methods.gps import GpsLinear
from petl.methods.lora import LoraLinear
from petl.methods.vpt import PromptedBlock
from petl.model.backbone import backbone_of, unwrap
from petl.model.backbone.vit import ViT
from petl.model.params import trainable_state
from petl.model.wrappers import PetlModule

# Every registered method with its defaults, plus variants that exercise other code paths.
VARIANTS = [(name, {}) for name in petl.list_methods()] + [
    ("adapter", {"style": "parallel", "dim": 4}),
    ("vpt", {"deep": True, "num_tokens": 3}),
    ("lora", {"targets": ["q", "k", "v", "proj", "fc1", "fc2"], "rank": 2, "alpha": 4.0}),
    ("partial", {"k": 2}),
    ("mlp", {"k": 1}),
    ("peft", {"target_modules": ["qkv", "fc2"], "options": '{"r": 4, "lora_alpha": 8}'}),
    (
        "peft",
        {"peft_type": "LORA", "target_modules": ["qkv"], "options": '{"r": 8, "lora_alpha": 8, "use_dora": true}'},
    ),
    ("peft", {"peft_type": "IA3", "target_modules": ["qkv", "fc2"], "options": '{"feedforward_modules": ["fc2"]}'}),
    ("sct", {"top_n": 3, "channels": [[0, 5, 9], [47, 1, 2], [10, 20, 30]]}),
    ("adapter_plus", {"dim": 3, "scaling": "learned", "dropout": 0.1, "drop_path": 0.0}),
    ("adapter_plus", {"scaling": "none"}),
    ("convpass", {"dim": 3, "scale": 0.5, "xavier_conv": True, "dropout": 0.0}),
    ("hydra", {"dim": 3, "scale": 0.5, "dropout": 0.0, "targets": ["fc2"]}),
    ("bitfit", {"biases": "linear"}),
    ("ssf", {"init_std": 0.1}),
    ("fact", {"type": "tt", "rank": 4, "scale": 10.0}),
    ("repadapter", {"bottleneck": 4, "groups": 4, "scale": 0.5}),
    ("dtl", {"rank": 3, "beta": 5.0, "add_from": 0, "fusion_size": 3}),
    ("lst", {"reduction": 4, "gate_alpha": 1.0, "gate_t": 0.5, "dropout": 0.0}),
    ("hst", {"dims": [8, 12], "heads": [2, 3], "meta_tokens": 2}),
    ("last", {"rank": 3, "gap": 3, "layers": 2}),
    ("snf", {"flow_length": 0}),
    # init=reference: start as the references' code really runs (petl.methods._init); not unchanged at init.
    ("adapter", {"init": "reference"}),
    ("adapter", {"style": "parallel", "dim": 4, "init": "reference"}),
    ("lora", {"init": "reference"}),
    ("convpass", {"dim": 3, "init": "reference"}),
    ("fact", {"init": "reference"}),
    ("fact", {"type": "tt", "rank": 4, "init": "reference"}),
    ("gps", {"per_row": 2}),
    # Blocks without prompts between prompted ones: NOAH keeps the earlier prompts in the sequence.
    ("noah", {"prompt": [2, 0, 3], "lora": [0, 2, 1], "adapter": [3, 0, 0], "dropout": 0.0}),
]
IDS = [name + "".join(f"-{k}={v}" for k, v in opts.items()) for name, opts in VARIANTS]
MERGEABLE = [v for v in VARIANTS if petl.get_method(v[0]).mergeable]
MERGEABLE_IDS = [i for i, v in zip(IDS, VARIANTS, strict=True) if v in MERGEABLE]


def _on_every_backbone(variants: list[tuple[str, dict]]) -> tuple[list[tuple[str, str, dict]], list[str]]:
    """(kind, method, options) for every variant on every backbone kind its method declares, and their ids."""
    cases = [
        (kind, name, opts) for kind in TINY_MODELS for name, opts in variants if kind in petl.get_method(name).backbones
    ]
    ids = [f"{kind}-{IDS[VARIANTS.index((name, opts))]}" for kind, name, opts in cases]
    return cases, ids


# The contract tests run each variant on a tiny model of every backbone kind its method supports.
CASES, CASE_IDS = _on_every_backbone(VARIANTS)
MERGEABLE_CASES, MERGEABLE_CASE_IDS = _on_every_backbone(MERGEABLE)

# Backbones the formula and layout checks run on: class token + token pooling, average pooling
# without a class token, and register tokens.
BACKBONES = {
    "token": {},
    "avg-no-cls": {"class_token": False, "global_pool": "avg"},
    "reg-tokens": {"reg_tokens": 2},
}
# The formula is also checked on a Swin of three stages of other depths (widths 16, 32, 64; an odd depth).
SWIN_FORMULA = {"depths": (1, 2, 1), "num_heads": (2, 2, 4), "img_size": 64, "window_size": 4}


@pytest.mark.parametrize(("kind", "method", "options"), CASES, ids=CASE_IDS)
def test_zero_init_flag_matches_behaviour(images, kind, method, options):
    reference = TINY_MODELS[kind]()(images)
    # Without num_classes the head is kept, so the whole output can be compared.
    model = petl.apply(TINY_MODELS[kind](), method, **options).eval()
    unchanged = torch.allclose(model(images), reference, atol=1e-6)
    assert unchanged == (petl.get_method(method).zero_init and model.petl_config.keeps_zero_init)


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "method", "options"), CASES, ids=CASE_IDS)
def test_training_touches_exactly_the_trainable_tensors(kind, method, options):
    _check_training_touches_exactly_the_trainable_tensors(
        petl.apply(TINY_MODELS[kind](), method, num_classes=4, **options)
    )


def _check_training_touches_exactly_the_trainable_tensors(model: torch.nn.Module) -> None:
    model = model.train()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable
    before = {n: t.clone() for n, t in model.state_dict().items()}
    got_grad = dict.fromkeys(trainable, False)
    optimizer = torch.optim.AdamW(trainable.values(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    # Zero-initialised halves (LoRA B, adapter up) let their partner learn only from step 2.
    for _ in range(3):
        x, y = torch.randn(4, 3, 32, 32, generator=gen), torch.randint(0, 4, (4,), generator=gen)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        for n, p in trainable.items():
            got_grad[n] |= p.grad is not None and bool(p.grad.abs().sum() > 0)
        optimizer.step()
    assert [n for n, seen in got_grad.items() if not seen] == []
    after = model.state_dict()
    assert [n for n in trainable if torch.equal(after[n], before[n])] == []
    # Besides the parameters, only the learnt buffers (BatchNorm statistics of a trained head) move.
    learnt = set(trainable_state(model))
    assert [n for n in before if n not in learnt and not torch.equal(after[n], before[n])] == []


@pytest.mark.parametrize(("kind", "method", "options"), CASES, ids=CASE_IDS)
def test_inserted_modules_are_wrappers(kind, method, options):
    model = TINY_MODELS[kind]()
    original = {id(m) for m in model.modules()}
    petl.apply(model, method, **options)
    head = {id(m) for m in backbone_of(model).head().modules()}
    wrapper_paths = [n for n, m in model.named_modules() if isinstance(m, (PetlModule, BaseTunerLayer)) and n]
    for name, module in model.named_modules():
        if id(module) in original or id(module) in head:
            continue
        assert any(name == w or name.startswith(w + ".") for w in wrapper_paths), name


@pytest.mark.parametrize(("kind", "method", "options"), MERGEABLE_CASES, ids=MERGEABLE_CASE_IDS)
def test_merge_unmerge_equivalence(images, kind, method, options):
    model = petl.apply(TINY_MODELS[kind](), method, num_classes=4, **options)
    perturb_trainable(model)
    frozen = {n: t.clone() for n, t in model.state_dict().items() if n not in trainable_state(model)}
    unmerged = model(images)
    petl.merge(model)
    assert (model(images) - unmerged).abs().max() < 1e-5
    petl.unmerge(model)
    assert (model(images) - unmerged).abs().max() < 1e-5
    restored = model.state_dict()
    for name, tensor in frozen.items():
        torch.testing.assert_close(restored[name], tensor, atol=1e-6, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "method", "options"), CASES, ids=CASE_IDS)
def test_save_load_round_trip_onto_fresh_backbone(images, tmp_path, kind, method, options):
    model = petl.apply(TINY_MODELS[kind](), method, num_classes=4, **options)
    perturb_trainable(model)
    path = tmp_path / "trained.safetensors"
    petl.save_trainable(model, path)
    with safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == set(trainable_state(model))
    fresh = petl.load_trainable(TINY_MODELS[kind](), path)
    assert fresh.petl_method == method
    assert torch.equal(fresh.eval()(images), model.eval()(images))


@pytest.mark.slow
@pytest.mark.parametrize(("method", "options"), VARIANTS, ids=IDS)
def test_load_rejects_another_method_depth_or_width(tiny_vit, tmp_path, method, options):
    path = tmp_path / "trained.safetensors"
    petl.save_trainable(petl.apply(tiny_vit(), method, num_classes=4, **options), path)
    other = next(name for name in petl.list_methods() if name != method)
    # Each in one line naming the file and what to do (they named the mismatch alone).
    remedy = rf"^{path} holds method '{method}', the model carries '{other}': load it onto a fresh backbone"
    with pytest.raises(ValueError, match=remedy):
        petl.load_trainable(petl.apply(tiny_vit(), other, num_classes=4), path)
    with pytest.raises(ValueError, match=rf"^{path} .*depth=3.*depth=4: load it onto the backbone it was trained on$"):
        petl.load_trainable(tiny_vit(depth=4), path)
    with pytest.raises(ValueError, match="embed_dim=48.*embed_dim=60: load it onto the backbone it was trained on$"):
        petl.load_trainable(tiny_vit(embed_dim=60), path)


# Backbones of two kinds whose trained tensors have the same names and shapes: (kind saved on, kind loaded onto).
SAME_SHAPES = [("swinv2", "swin"), ("swin", "swinv2"), ("beit", "vit_relpos"), ("eva02", "vit")]


@pytest.mark.parametrize(("saved", "loaded"), SAME_SHAPES)
def test_load_rejects_a_file_of_another_backbone_kind_of_the_same_shapes(tmp_path, saved, loaded):
    # A SwinV2's LoRA loaded onto a Swin, a BEiT's onto a relpos ViT, silently: only the shapes were checked.
    def make(kind: str) -> torch.nn.Module:
        return TINY_MODELS[kind]() if kind in TINY_MODELS else make_tiny_family(kind)

    path = tmp_path / "trained.safetensors"
    petl.save_trainable(petl.apply(make(saved), "lora", num_classes=4), path)
    target = make(loaded)
    for load in (lambda: petl.load_trainable(target, path), lambda: petl.MultiTask(target, {"a": path})):
        with pytest.raises(ValueError, match=r"saved for a backbone of kind '\w+', this one is '\w+' \(") as error:
            load()
        assert "\n" not in str(error.value) and getattr(target, "petl_method", None) is None


# (method, option, value saved, value of the model loaded into)
OPTION_MISMATCHES = [
    ("lora", "rank", 2, 4),
    ("lora", "targets", ("q",), ("q", "v")),
    ("adapter", "dim", 4, 8),
    ("vpt", "num_tokens", 2, 3),
    ("partial", "k", 1, 2),
    ("mlp", "k", 2, 3),
    ("peft", "options", '{"r": 2}', '{"r": 4}'),
]


@pytest.mark.parametrize(("method", "option", "saved", "loaded"), OPTION_MISMATCHES)
def test_load_rejects_other_options(tiny_vit, tmp_path, method, option, saved, loaded):
    path = tmp_path / "trained.safetensors"
    petl.save_trainable(petl.apply(tiny_vit(), method, num_classes=4, **{option: saved}), path)
    with pytest.raises(ValueError, match=rf"^{path} was saved with {option}=.*: load it onto a fresh backbone "):
        petl.load_trainable(petl.apply(tiny_vit(), method, num_classes=4, **{option: loaded}), path)


@pytest.mark.parametrize("backbone", BACKBONES)
@pytest.mark.parametrize(("method", "options"), VARIANTS, ids=IDS)
def test_count_matches_formula(tiny_vit, method, options, backbone):
    spec = petl.get_method(method)
    expected = spec.trainable_formula(tiny_vit(**BACKBONES[backbone]), petl.make_config(method, **options))
    model = petl.apply(tiny_vit(**BACKBONES[backbone]), method, num_classes=4, **options)
    counts = petl.count_params(model)
    assert counts.trainable_no_head == expected
    assert counts.trainable == expected + sum(p.numel() for p in backbone_of(model).head().parameters())


@pytest.mark.parametrize(
    ("kind", "method", "options"),
    [c for c in CASES if c[0] != "vit"],
    ids=[i for c, i in zip(CASES, CASE_IDS, strict=True) if c[0] != "vit"],
)
def test_count_matches_formula_on_a_staged_backbone(kind, method, options):
    spec = petl.get_method(method)
    expected = spec.trainable_formula(TINY_MODELS[kind](**SWIN_FORMULA), petl.make_config(method, **options))
    model = petl.apply(TINY_MODELS[kind](**SWIN_FORMULA), method, num_classes=4, **options)
    assert petl.count_params(model).trainable_no_head == expected


PUBLISHED = [
    ("lora", {"rank": 8, "targets": ["q", "v"]}, 294_912),
    ("adapter", {"style": "sequential", "dim": 8}, 156_768),
    ("vpt", {"num_tokens": 10, "deep": True}, 92_160),
    ("vpt", {"num_tokens": 10, "deep": False}, 7_680),
    ("linear", {}, 0),
    ("bitfit", {}, 102_912),
    ("ssf", {}, 205_824),
    ("dtl", {}, 36_864),
]


@pytest.mark.parametrize(("method", "options", "published"), PUBLISHED)
def test_vit_base_counts_match_published(vit_base, method, options, published):
    assert petl.get_method(method).trainable_formula(vit_base, petl.make_config(method, **options)) == published
    model = petl.apply(copy.deepcopy(vit_base), method, num_classes=100, **options)
    assert petl.count_params(model).trainable_no_head == published


# --- VPT ---------------------------------------------------------------------------------------


def _block_inputs(model: torch.nn.Module) -> list[torch.Tensor]:
    """Record what each original block receives on the next forward."""
    seen: list[torch.Tensor] = []
    for block in backbone_of(model).block_list():
        block.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    return seen


@pytest.mark.parametrize("pool", ["original", "img_pool"])
@pytest.mark.parametrize("deep", [False, True], ids=["shallow", "deep"])
@pytest.mark.parametrize("backbone", BACKBONES)
def test_vpt_token_layout(tiny_vit, images, backbone, deep, pool):
    n = 3
    reference = tiny_vit(**BACKBONES[backbone])
    ref_inputs = _block_inputs(reference)
    ref_features = reference.forward_features(images)
    model = petl.apply_vpt(tiny_vit(**BACKBONES[backbone]), num_tokens=n, deep=deep, dropout=0.0, pool=pool)
    inputs = _block_inputs(model)
    features = model.forward_features(images)
    p = backbone_of(model).num_prefix_tokens()
    # Prompts sit right after the class/register tokens; the other tokens are untouched.
    assert torch.equal(torch.cat([inputs[0][:, :p], inputs[0][:, p + n :]], dim=1), ref_inputs[0])
    assert all(x.shape[1] == ref_inputs[0].shape[1] + n for x in inputs)
    prompts = [b.prompt for b in model.blocks if isinstance(b, PromptedBlock) and b.prompt is not None]
    assert len(prompts) == (backbone_of(model).depth() if deep else 1)
    # Deep VPT feeds each prompted block its own fresh prompts; shallow carries block 0's outputs.
    prompted = [i for i, b in enumerate(model.blocks) if isinstance(b, PromptedBlock) and b.prompt is not None]
    for i, prompt in zip(prompted, prompts, strict=True):
        assert torch.equal(inputs[i][:, p : p + n], prompt.expand(images.shape[0], -1, -1))
    # img_pool removes the prompts before the final norm and pooling; VPT's original keeps them.
    if pool == "img_pool":
        assert features.shape == ref_features.shape
    else:
        assert features.shape[1] == ref_features.shape[1] + n
    assert model(images).shape == (2, 5)


def test_vpt_prompt_dropout_only_in_train_mode(tiny_vit, images):
    model = petl.apply_vpt(tiny_vit(), num_tokens=4, dropout=0.5)
    assert torch.equal(model.eval()(images), model(images))
    model.train()
    assert not torch.equal(model(images), model(images))


def test_vpt_with_gradient_checkpointing(tiny_vit, images):
    plain = petl.apply_vpt(tiny_vit(), num_tokens=3, deep=True, dropout=0.0, num_classes=4).train()
    ckpt = petl.apply_vpt(tiny_vit(), num_tokens=3, deep=True, dropout=0.0, num_classes=4).train()
    ckpt.set_grad_checkpointing(True)
    plain(images).sum().backward()
    ckpt(images).sum().backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters(), strict=True):
        if a.requires_grad:
            assert b.grad is not None and b.grad.abs().sum() > 0, name
            torch.testing.assert_close(a.grad, b.grad)


def test_vpt_rejects_bad_options(tiny_vit):
    with pytest.raises(ValueError, match="num_tokens"):
        petl.apply_vpt(tiny_vit(), num_tokens=0)
    with pytest.raises(ValueError, match="dropout"):
        petl.apply_vpt(tiny_vit(), dropout=1.0)
    with pytest.raises(ValueError, match="pool"):
        petl.apply_vpt(tiny_vit(), pool="prompt_pool")


# --- Partial-k ---------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2])
def test_partial_trains_blocks_by_index(tiny_vit, k):
    model = petl.apply_partial(tiny_vit(depth=12, embed_dim=12), k=k, num_classes=4)
    trained = [i for i, block in enumerate(model.blocks) if all(p.requires_grad for p in block.parameters())]
    frozen = [i for i, block in enumerate(model.blocks) if not any(p.requires_grad for p in block.parameters())]
    assert trained == list(range(12 - k, 12))
    assert frozen == list(range(12 - k))  # blocks.1 stays frozen although "blocks.1" prefixes blocks.10/11
    assert all(p.requires_grad for norm in backbone_of(model).final_norms() for p in norm.parameters())
    assert not model.patch_embed.proj.weight.requires_grad


def test_partial_trains_the_attention_pool_between_its_blocks_and_head(tiny_vit):
    # SigLIP's map head (timm's global_pool='map') pools between the last block and fc_norm/head: Partial-k left it
    # frozen between trained parts, where everything after the last k blocks trains.
    model = petl.apply_partial(tiny_vit(class_token=False, global_pool="map"), k=1, num_classes=4)
    assert all(p.requires_grad for p in model.attn_pool.parameters())
    _check_training_touches_exactly_the_trainable_tensors(model)
    formula = petl.get_method("partial").trainable_formula(
        tiny_vit(class_token=False, global_pool="map"), petl.make_config("partial", k=1)
    )
    assert petl.count_params(model).trainable_no_head == formula


@pytest.mark.parametrize("k", [0, 4])
def test_partial_rejects_k_outside_depth(tiny_vit, k):
    with pytest.raises(ValueError, match=rf"k={k}.*\[1, 3\]"):
        petl.apply_partial(tiny_vit(), k=k)


# Methods that reshape the patch tokens to their grid in every block, with options that make them do so.
GRID_METHODS = [
    ("convpass", {}),
    ("dtl", {"fusion_size": 3}),
    ("hst", {"dims": [8, 12], "heads": [2, 3], "meta_tokens": 2, "num_classes": 4}),
]


@pytest.mark.parametrize(("method", "options"), GRID_METHODS, ids=[m for m, _ in GRID_METHODS])
def test_grid_methods_refuse_patch_dropout_in_one_line(tiny_vit, method, options):
    # timm's patch_drop_rate drops patch tokens in training: the grid reshape crashed at the first training step
    # (HST with a RuntimeError), where the model is refused at apply in one line naming the option.
    model = tiny_vit(patch_drop_rate=0.5)
    with pytest.raises(ValueError, match=r"patch_drop_rate=0\.5\): create the model with patch_drop_rate=0") as err:
        petl.apply(model, method, **options)
    assert "\n" not in str(err.value)
    assert not any(isinstance(m, PetlModule) for m in model.modules())
    petl.apply(tiny_vit(patch_drop_rate=0.0), method, **options)


@pytest.mark.parametrize(("method", "options"), GRID_METHODS, ids=[m for m, _ in GRID_METHODS])
def test_grid_methods_refuse_another_image_size_in_one_line(tiny_vit, method, options):
    # timm's dynamic_img_size takes 48x48 images on a 32x32 model: the grid is 6x6, not the 4x4 the methods built
    # for; HST failed in torch's reshape instead of saying so.
    model = petl.apply(tiny_vit(dynamic_img_size=True), method, **options)
    with pytest.raises(ValueError, match=r"4x4 patch tokens, got \d+") as err:
        model(torch.randn(2, 3, 48, 48))
    assert "\n" not in str(err.value)


# --- LoRA --------------------------------------------------------------------------------------


def test_lora_merge_touches_only_adapted_rows(tiny_vit, images):
    model = petl.apply_lora(tiny_vit(), targets=("q", "v"))
    perturb_trainable(model)
    qkv = ViT.linear(backbone_of(model).block_list()[0], "qkv")
    assert isinstance(qkv, LoraLinear)
    d = backbone_of(model).width()
    before = qkv.base.weight.clone()
    petl.merge(model)
    changed = (qkv.base.weight != before).any(dim=1)
    assert changed[:d].all() and not changed[d : 2 * d].any() and changed[2 * d :].all()
    tokens = torch.randn(2, 5, d)
    assert torch.equal(qkv(tokens), qkv.base(tokens))  # merged forward is the plain Linear
    petl.unmerge(model)
    torch.testing.assert_close(qkv.base.weight, before, atol=1e-6, rtol=0)


def test_merge_refuses_non_finite_updates_and_leaves_the_model_unmerged(tiny_vit):
    model = petl.apply_lora(tiny_vit())
    perturb_trainable(model)
    # The last block's update is bad: the blocks merged before it must be unmerged again.
    with torch.no_grad():
        ViT.linear(backbone_of(model).block_list()[-1], "qkv").lora_b["v"][0, 0] = float("inf")
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with pytest.raises(ValueError, match="non-finite"):
        petl.merge(model)
    assert not any(getattr(m, "merged", False) for m in model.modules())
    after = model.state_dict()
    for name, tensor in before.items():
        torch.testing.assert_close(after[name], tensor, atol=1e-6, rtol=0)


def test_gps_merge_refuses_a_non_finite_update_as_the_other_methods_do(tiny_vit):
    # GPS folds through petl.methods._reparam as LoRA and SSF do: the same refusal, and nothing left merged.
    model = petl.apply_gps(tiny_vit(), per_row=1)
    with torch.no_grad():
        [m for m in model.modules() if isinstance(m, GpsLinear)][-1].delta[0, 0] = float("inf")
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with pytest.raises(ValueError, match="refusing to merge GPS into the weight: it holds non-finite values"):
        petl.merge(model)
    assert not any(getattr(m, "merged", False) for m in model.modules())
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, before[name], atol=1e-6, rtol=0)


def test_lora_merge_of_half_weights_rounds_once(tiny_vit):
    model = petl.apply_lora(tiny_vit()).to(torch.bfloat16)
    perturb_trainable(model)
    qkv = ViT.linear(backbone_of(model).block_list()[0], "qkv")
    d = backbone_of(model).width()
    weight = qkv.base.weight.float()
    expected = weight[:d] + qkv.scale * (qkv.lora_b["q"].float() @ qkv.lora_a["q"].float())
    petl.merge(model)
    # Computed in float32 and rounded to bfloat16 once; a bfloat16 update would be rounded before the add.
    assert torch.equal(qkv.base.weight[:d], expected.to(torch.bfloat16))


def test_lora_init_and_scale(tiny_vit):
    model = petl.apply_lora(tiny_vit(), rank=4, alpha=16.0)
    qkv = ViT.linear(backbone_of(model).block_list()[0], "qkv")
    assert qkv.scale == 4.0
    assert all(b.abs().sum() == 0 for b in qkv.lora_b.values())
    assert all(a.abs().sum() > 0 for a in qkv.lora_a.values())


# --- Adapter -----------------------------------------------------------------------------------


def test_sequential_adapter_sits_after_the_mlp(tiny_vit):
    model = petl.apply_adapter(tiny_vit(), dim=4)
    wrapper = ViT.feed_forward(backbone_of(model).block_list()[0])
    assert isinstance(wrapper, SequentialAdapter)
    perturb_trainable(model)
    x = torch.randn(2, 5, 48)
    h = wrapper.base(x)
    torch.testing.assert_close(wrapper(x), h + wrapper.up(F.gelu(wrapper.down(h))))


def test_parallel_adapter_wraps_the_block_with_adaptformer_init(tiny_vit):
    # The forward itself is checked against a re-implementation of AdaptFormer's in test_reference_forwards.py.
    model = petl.apply_adapter(tiny_vit(), style="parallel")
    wrapper = model.blocks[0]
    assert isinstance(wrapper, ParallelAdapter) and wrapper.base is backbone_of(model).block_list()[0]
    assert wrapper.down.out_features == 64 and wrapper.scale == 0.1
    assert isinstance(wrapper.dropout, torch.nn.Dropout) and wrapper.dropout.p == 0.1
    assert isinstance(wrapper.norm, torch.nn.Identity)
    assert wrapper.down.bias.abs().sum() == 0 and wrapper.down.weight.abs().sum() > 0
    assert wrapper.up.weight.abs().sum() == 0 and wrapper.up.bias.abs().sum() == 0


def test_adapter_options_act_in_both_styles(tiny_vit, images):
    for style in ("sequential", "parallel"):
        model = petl.apply_adapter(tiny_vit(), style=style, dim=4, norm=True, dropout=0.5, scale=2.0)
        wrapper = next(m for m in model.modules() if isinstance(m, (ParallelAdapter, SequentialAdapter)))
        assert isinstance(wrapper.norm, torch.nn.LayerNorm) and wrapper.scale == 2.0
        perturb_trainable(model)
        model.train()
        assert not torch.equal(model(images), model(images))  # the bottleneck dropout acts
        d = backbone_of(model).width()
        assert petl.count_params(model).trainable_no_head == backbone_of(model).depth() * (2 * d * 4 + 4 + d + 2 * d)


def test_adapter_up_starts_at_zero_down_does_not(tiny_vit):
    wrapper = ViT.feed_forward(backbone_of(petl.apply_adapter(tiny_vit())).block_list()[0])
    assert wrapper.up.weight.abs().sum() == 0 and wrapper.up.bias.abs().sum() == 0
    # petl's sequential init keeps nn.Linear's random down weight and bias (init=reference: V-PETL's trunc_normal).
    assert wrapper.down.weight.abs().sum() > 0 and wrapper.down.bias.abs().sum() > 0


# --- Mlp-k -------------------------------------------------------------------------------------


def test_mlp_head_is_the_head(tiny_vit, images):
    model = petl.apply_mlp(tiny_vit(), k=3, num_classes=7)
    linears = [m for m in backbone_of(model).head().modules() if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(48, 48), (48, 48), (48, 7)]
    assert model(images).shape == (2, 7)
    assert petl.count_params(model).trainable_no_head == 0
    # Without num_classes the current head's class count is kept.
    assert petl.apply_mlp(tiny_vit())(images).shape == (2, 5)
    with pytest.raises(ValueError, match="num_classes"):
        petl.apply_mlp(tiny_vit(num_classes=0))


def test_mlp_head_batchnorm_statistics_are_saved_and_loaded(tiny_vit, images, tmp_path):
    model = petl.apply_mlp(tiny_vit(), k=2, num_classes=3).train()
    model(torch.randn(8, 3, 32, 32))  # moves the head's BatchNorm running statistics
    path = tmp_path / "mlp.safetensors"
    petl.save_trainable(model, path)
    with safe_open(str(path), framework="pt") as f:
        assert "head.2.running_mean" in f.keys()
    fresh = petl.load_trainable(tiny_vit(), path)
    assert torch.equal(fresh.eval()(images), model.eval()(images))


# --- peft bridge -------------------------------------------------------------------------------


def test_peft_accepts_a_ready_config_and_round_trips(tiny_vit, images, tmp_path):
    model = petl.apply_peft(
        tiny_vit(), peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["qkv"]), num_classes=3
    )
    d = backbone_of(model).width()
    assert petl.count_params(model).trainable_no_head == 3 * 4 * (d + 3 * d)
    assert model.petl_config.target_modules == ("qkv",)
    perturb_trainable(model)
    path = tmp_path / "peft.safetensors"
    petl.save_trainable(model, path)
    fresh = petl.load_trainable(tiny_vit(), path)
    assert torch.equal(fresh.eval()(images), model.eval()(images))
    with pytest.raises(ValueError, match="num_classes"):
        petl.apply_peft(tiny_vit(), peft_config=LoraConfig(target_modules=["qkv"]), rank=2)


def test_petl_apply_takes_a_peft_config_object(tiny_vit):
    model = petl.apply(tiny_vit(), LoraConfig(r=4, target_modules=["qkv"]), num_classes=3)
    assert model.petl_method == "peft" and model.petl_config.num_classes == 3
    assert petl.count_params(model).trainable_no_head == 3 * 4 * (backbone_of(model).width() * 4)
    assert (
        model.petl_config
        == petl.apply_peft(tiny_vit(), LoraConfig(r=4, target_modules=["qkv"]), num_classes=3).petl_config
    )
    with pytest.raises(ValueError, match="pass only num_classes; got rank"):
        petl.apply(tiny_vit(), LoraConfig(target_modules=["qkv"]), rank=2)


def test_peft_other_tuner_counts_by_injecting(tiny_vit):
    options = {"peft_type": "IA3", "target_modules": ["qkv", "fc2"], "options": '{"feedforward_modules": ["fc2"]}'}
    expected = petl.get_method("peft").trainable_formula(tiny_vit(), petl.make_config("peft", **options))
    model = petl.apply(tiny_vit(), "peft", num_classes=4, **options)
    assert petl.count_params(model).trainable_no_head == expected > 0


def test_peft_count_covers_a_target_that_also_names_a_conv(tiny_vit):
    # `proj` names each block's attn.proj (Linear) and patch_embed.proj (Conv2d): peft adapts both.
    model = petl.apply(tiny_vit(), "peft", target_modules=["proj"], options='{"r": 2}', num_classes=3)
    expected = petl.get_method("peft").trainable_formula(tiny_vit(), model.petl_config)
    assert petl.count_params(model).trainable_no_head == expected
    assert any("patch_embed.proj.lora_A" in name for name, _ in model.named_parameters())


def test_peft_rejects_bad_options(tiny_vit):
    with pytest.raises(ValueError, match="peft_type.*LORA"):
        petl.apply_peft(tiny_vit(), peft_type="NOPE")
    with pytest.raises(ValueError, match="options"):
        petl.apply_peft(tiny_vit(), options="{r: 8")
    with pytest.raises(ValueError, match="options"):
        petl.apply_peft(tiny_vit(), options='{"no_such_field": 1}')
    model = tiny_vit()
    with pytest.raises(ValueError, match="target_modules"):
        petl.apply_peft(model, target_modules=["query"])
    assert all(p.requires_grad for p in model.parameters())  # refused before anything changed


@pytest.mark.parametrize(("kind", "method", "options"), CASES, ids=CASE_IDS)
def test_new_tensors_follow_the_model_dtype(images, kind, method, options):
    # dtype stands in for device here: both come from the model, so a CPU-only run still catches
    # a method that builds its tensors with the defaults instead of beside the frozen weights.
    model = petl.apply(TINY_MODELS[kind]().double(), method, num_classes=4, **options)
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    assert model(images.double()).dtype == torch.float64


# --- the other ViT families -------------------------------------------------------------------------------------
# The contracts above, on a tiny model of each family in TINY_FAMILIES, for every variant whose method declares the
# family's kind; the variants that name a Linear the family lacks (peft's qkv on separate q/k/v) are left out.


# One variant per code path of the methods a family may take (all VARIANTS on every family would take minutes).
FAMILY_VARIANTS = [(name, {}) for name in petl.list_methods()] + [
    ("adapter", {"style": "parallel", "dim": 4}),
    ("vpt", {"deep": True, "num_tokens": 3, "pool": "img_pool"}),
    ("lora", {"targets": ["q", "k", "v", "proj", "fc1", "fc2"], "rank": 2, "alpha": 4.0}),
    ("lora", {"targets": ["k", "proj", "fc2"], "rank": 2}),
    ("fact", {"type": "tt", "rank": 4}),
    ("bitfit", {"biases": "linear"}),
    ("peft", {"peft_type": "LORA", "target_modules": ["qkv"], "options": '{"r": 8, "use_dora": true}'}),
    ("peft", {"peft_type": "IA3", "target_modules": ["qkv", "fc2"], "options": '{"feedforward_modules": ["fc2"]}'}),
    # DTL+'s conv over the patch grid; HST's meta tokens and NOAH's prompts, which change in number from block to
    # block, in the room the families' attention makes for them.
    ("dtl", {"fusion_size": 3}),
    ("hst", {"dims": [8, 12], "heads": [2, 3], "meta_tokens": 2}),
    ("noah", {"prompt": [2, 0, 3], "lora": [0, 2, 1], "adapter": [3, 0, 0], "dropout": 0.0}),
    # DoRA and IA3 on a parallel block's Linears (the other families have none of these names: refused there).
    ("peft", {"target_modules": ["in_proj"], "options": '{"r": 8, "use_dora": true}'}),
    (
        "peft",
        {
            "peft_type": "IA3",
            "target_modules": ["in_proj", "mlp_out_proj"],
            "options": '{"feedforward_modules": ["mlp_out_proj"]}',
        },
    ),
]


def _family_cases() -> tuple[list[tuple[str, str, dict]], list[tuple[str, str, dict]]]:
    """(family, method, options) that apply, and those the method refuses on the family (in one line)."""
    cases, refused = [], []
    for family in TINY_FAMILIES:
        model = make_tiny_family(family)
        for method, options in FAMILY_VARIANTS:
            if backbone_of(model).kind not in petl.get_method(method).backbones:
                continue
            config = petl.make_config(method, **options)
            try:
                config.validate(model)
                petl.get_method(method).trainable_formula(model, config)
            except ValueError:
                refused.append((family, method, options))
                continue
            cases.append((family, method, options))
    return cases, refused


FAMILY_CASES, FAMILY_REFUSED = _family_cases()
FAMILY_IDS = [f"{f}-{m}" + "".join(f"-{k}={v}" for k, v in o.items()) for f, m, o in FAMILY_CASES]
FAMILY_MERGEABLE = [c for c in FAMILY_CASES if petl.get_method(c[1]).mergeable]
FAMILY_MERGEABLE_IDS = [i for i, c in zip(FAMILY_IDS, FAMILY_CASES, strict=True) if c in FAMILY_MERGEABLE]


@pytest.mark.parametrize(("family", "method", "options"), FAMILY_CASES, ids=FAMILY_IDS)
def test_family_zero_init_and_count(images, family, method, options):
    reference = make_tiny_family(family)(images)
    model = petl.apply(make_tiny_family(family), method, **options).eval()
    unchanged = torch.allclose(model(images), reference, atol=1e-6)
    assert unchanged == (petl.get_method(method).zero_init and model.petl_config.keeps_zero_init)
    # What the method trains acts: moved away from its init, it changes the output.
    in_head = {id(p) for p in backbone_of(model).head().parameters()}
    if any(p.requires_grad and id(p) not in in_head for p in model.parameters()):
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad and id(p) not in in_head:
                    p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
        assert not torch.allclose(model(images), reference, atol=1e-4)
    expected = petl.get_method(method).trainable_formula(make_tiny_family(family), petl.make_config(method, **options))
    counted = petl.count_params(petl.apply(make_tiny_family(family), method, num_classes=4, **options))
    assert counted.trainable_no_head == expected


# vit_relpos's class token gets no relative-position bias (timm zero-pads it) and is all its token pooling reads, so
# the last block's bias MLP rightly gets no gradient there: that family is left out of the training check.
FAMILY_TRAINED = [(c, i) for c, i in zip(FAMILY_CASES, FAMILY_IDS, strict=True) if c[0] != "vit_relpos"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "method", "options"), [c for c, _ in FAMILY_TRAINED], ids=[i for _, i in FAMILY_TRAINED]
)
def test_family_training_touches_exactly_the_trainable_tensors(family, method, options):
    model = petl.apply(make_tiny_family(family), method, num_classes=4, **options)
    _check_training_touches_exactly_the_trainable_tensors(model)


@pytest.mark.parametrize(("family", "method", "options"), FAMILY_CASES, ids=FAMILY_IDS)
def test_family_save_load_round_trip(images, tmp_path, family, method, options):
    model = petl.apply(make_tiny_family(family), method, num_classes=4, **options)
    perturb_trainable(model)
    path = tmp_path / "trained.safetensors"
    petl.save_trainable(model, path)
    fresh = petl.load_trainable(make_tiny_family(family), path)
    assert torch.equal(fresh.eval()(images), model.eval()(images))


@pytest.mark.parametrize(("family", "method", "options"), FAMILY_MERGEABLE, ids=FAMILY_MERGEABLE_IDS)
def test_family_merge_equals_unmerged(images, family, method, options):
    model = petl.apply(make_tiny_family(family), method, num_classes=4, **options)
    perturb_trainable(model)
    unmerged = model(images)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    try:
        petl.merge(model)
    except ValueError as refused:
        # A Linear without a bias (timm's qkv_bias=False; BEiT's and EVA's q/v biases live outside qkv) cannot take
        # SSF's shift (nor Hydra's branch biases, on AIMv2's bias-free proj): merging is refused in one line and
        # leaves the model unmerged (all or nothing), bit for bit: the layers merged before the refusal were
        # unmerged by subtracting their update again, which left the patch embedding's weights rounded otherwise.
        assert "without weight and bias" in str(refused) or "without a bias" in str(refused)
        assert "\n" not in str(refused)
        assert not any(isinstance(m, PetlModule) and m.merged for m in model.modules())
        assert all(torch.equal(tensor, before[name]) for name, tensor in model.state_dict().items())
        return
    assert (model(images) - unmerged).abs().max() < 1e-5
    petl.unmerge(model)
    assert (model(images) - unmerged).abs().max() < 1e-5


@pytest.mark.parametrize(("family", "method", "options"), FAMILY_CASES, ids=FAMILY_IDS)
def test_family_unload_is_plain_timm_with_the_same_logits_or_refused_naming_the_method(images, family, method, options):
    # What petl-export writes: the unloaded state dict, loaded into the family's own timm model.
    model = petl.apply(make_tiny_family(family), method, num_classes=4, **options)
    perturb_trainable(model)
    with torch.no_grad():
        want = model.eval()(images)
    try:
        plain = petl.unload(model)
    except ValueError as refused:
        # Modules that do not fold, or a layer that cannot hold its update (SSF's shift on a qkv without bias).
        assert str(refused).startswith(f"method '{method}' cannot be unloaded into a plain timm model: ")
        assert "\n" not in str(refused)
        return
    assert not any(isinstance(m, PetlModule) for m in plain.modules())
    fresh = make_tiny_family(family, num_classes=4)
    fresh.load_state_dict(plain.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(fresh(images), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("family", "method", "options"), FAMILY_CASES, ids=FAMILY_IDS)
def test_family_forward_intermediates_at_timm_shapes(images, family, method, options):
    plain = make_tiny_family(family)
    model = petl.apply(make_tiny_family(family), method, **options).eval()
    for kwargs in ({}, {"output_fmt": "NLC", "indices": [0, 2]}):
        want = plain.forward_intermediates(images, intermediates_only=True, **kwargs)
        got = model.forward_intermediates(images, intermediates_only=True, **kwargs)
        assert [t.shape for t in got] == [t.shape for t in want]


@pytest.mark.parametrize(("family", "method", "options"), FAMILY_REFUSED)
def test_family_refusals_are_one_line(family, method, options):
    model = make_tiny_family(family)
    with pytest.raises(ValueError) as refused:
        petl.apply(model, method, **options)
    assert "\n" not in str(refused.value)
    assert not any(isinstance(m, PetlModule) for m in model.modules())


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_family_gps_selects_in_every_linear_of_each_block(family):
    # A SwiGLU MLP's fc1_g and fc1_x (EVA-02 base, AIMv2's ViT) are Linears of the block: GPS selects in them too.
    # Not in a relpos ViT's position-bias MLP, which maps a table of coordinates, not the tokens.
    model = make_tiny_family(family)
    bb = backbone_of(model)
    table = {id(m) for shared in bb.batch_shared_modules() for m in shared.modules()}
    block = bb.block_list()[0]
    linears = {id(m) for m in block.modules() if isinstance(m, torch.nn.Linear) and id(m) not in table}
    petl.apply(model, "gps", per_row=1)
    wrapped = {id(unwrap(m)) for m in bb.block_list()[0].modules() if isinstance(m, PetlModule)}
    assert linears <= wrapped


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_family_prompts_get_no_position(images, family):
    # Room for no tokens changes nothing; with prompts, attention sees them without a position (no relative bias,
    # no rotation), so shuffling the prompts leaves the patch tokens as they were and shuffles the prompt outputs.
    plain = make_tiny_family(family)
    roomy = make_tiny_family(family)
    bb = backbone_of(roomy)
    for block in bb.block_list():
        bb.make_room(block, bb.num_prefix_tokens())
    torch.testing.assert_close(roomy(images), plain(images), atol=1e-5, rtol=0)
    n, p = 4, bb.num_prefix_tokens()
    model = petl.apply_vpt(make_tiny_family(family), num_tokens=n, dropout=0.0)
    prompted = next(b for b in model.modules() if isinstance(b, PromptedBlock))
    features = model.forward_features(images)
    with torch.no_grad():
        prompted.prompt.copy_(prompted.prompt.flip(0))
    shuffled = model.forward_features(images)
    torch.testing.assert_close(shuffled[:, p + n :], features[:, p + n :], atol=1e-5, rtol=0)
    torch.testing.assert_close(shuffled[:, p : p + n], features[:, p : p + n].flip(1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("where", ["front", "end"])
@pytest.mark.parametrize("family", [f for f in TINY_FAMILIES if not f.startswith("vit_pwee")])
def test_family_room_anywhere_in_the_sequence(images, family, where):
    # HST's meta tokens go in front of the prefix, NOAH's prompts after the patches: wherever the room is made, the
    # extra tokens get no position, so shuffling them leaves every other token as it was; without extra tokens the
    # block is the plain one.
    plain, model = make_tiny_family(family), make_tiny_family(family)
    bb = backbone_of(model)
    at = 0 if where == "front" else bb.num_tokens()
    block = bb.block_list()[0]
    bb.make_room(block, at)
    x = bb.embed_tokens(images)
    plain_block = backbone_of(plain).block_list()[0]
    torch.testing.assert_close(bb.run_block(block, x, index=0), bb.run_block(plain_block, x, index=0))
    extra = torch.randn(x.shape[0], 3, x.shape[-1], generator=torch.Generator().manual_seed(0))
    y = bb.run_block(block, torch.cat([x[:, :at], extra, x[:, at:]], dim=1), index=0)
    shuffled = bb.run_block(block, torch.cat([x[:, :at], extra.flip(1), x[:, at:]], dim=1), index=0)
    others = torch.cat([torch.arange(at), torch.arange(at + 3, x.shape[1] + 3)])
    torch.testing.assert_close(shuffled[:, others], y[:, others], atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", [f for f in TINY_FAMILIES if not f.startswith("vit_pwee")])
def test_family_room_takes_a_mask(images, family):
    # A MultiTask's shared blocks mask the prompt slots a row's task does not fill: with room, a block given an
    # additive mask over the extra tokens gives the other tokens exactly what the plain block gives without them
    # (a relpos ViT's or BEiT's block, which passes its attention no mask, runs as its halves).
    plain, model = make_tiny_family(family), make_tiny_family(family)
    bb = backbone_of(model)
    p, n = bb.num_prefix_tokens(), 3
    block, plain_block = bb.block_list()[0], backbone_of(plain).block_list()[0]
    x = bb.embed_tokens(images)
    extra = torch.randn(x.shape[0], n, x.shape[-1], generator=torch.Generator().manual_seed(0))
    with_extra = torch.cat([x[:, :p], extra, x[:, p:]], dim=1)
    mask = torch.zeros(x.shape[0], 1, 1, with_extra.shape[1])
    mask[..., p : p + n] = float("-inf")
    if not bb.blocks_take_mask:
        with pytest.raises(ValueError, match="no mask until it has room"):
            bb.run_block(plain_block, with_extra, attn_mask=mask, index=0)
    bb.make_room(block, p)
    y = bb.run_block(block, with_extra, attn_mask=mask, index=0)
    expected = bb.run_block(plain_block, x, index=0)
    torch.testing.assert_close(torch.cat([y[:, :p], y[:, p + n :]], dim=1), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["vit", "swin", "swinv2"])
def test_unload_folds_a_mergeable_wrapper_on_the_head_into_timms_linear(images, kind):
    # peft's LoRA on the head's Linear (a Swin's head.fc) merges like any other; unload used to refuse it saying
    # "its head is a Linear, timm's is a Linear" (peft's layer class is named Linear too).
    model = TINY_MODELS[kind]()
    head = next(name for name, module in model.named_modules() if module is backbone_of(model).head())
    model = petl.apply(model, "peft", target_modules=[head.rpartition(".")[2]])
    perturb_trainable(model)
    with torch.no_grad():
        want = model.eval()(images)
    plain = petl.unload(model)
    assert type(backbone_of(plain).head()) is torch.nn.Linear
    fresh = TINY_MODELS[kind]()
    fresh.load_state_dict(plain.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(fresh(images), want, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------------ on a GPU

# Every backbone kind and family, with the methods that reach into its blocks in the most ways: LoRA in the attention's
# projections, the sequential adapter after the MLP, SSF at every layer and norm, VPT's prompts in the room the
# family's attention makes (its masks, its rotary positions) and NOAH's, whose number changes from block to block;
# HST's side network, fed by every block's tokens.  (On this CPU under bf16 autocast, torch 2.14.1, the hybrid ViT's
# HST got 0, 128 or 960 NaN gradients in its last downsampling conv, on a 1x1 grid, in three identical runs: the
# CPU's bf16 convolution backward, not petl; this test says whether the GPU's does the same.)
GPU_METHODS = ("lora", "adapter", "ssf", "vpt", "noah", "hst")
ON_A_GPU = [
    (kind, method) for kind, method, options in [*CASES, *FAMILY_CASES] if method in GPU_METHODS and not options
]
MAKE = {kind: TINY_MODELS[kind] for kind in TINY_MODELS} | {
    f: functools.partial(make_tiny_family, f) for f in TINY_FAMILIES
}


def _fails_on(device: str, images: torch.Tensor, model: torch.nn.Module) -> str | None:
    """What goes wrong with ``model`` on ``device``, or None: its eval logits there against the CPU's, and a training
    step under bf16 autocast (petl-run's default on a GPU with native bf16) with a finite loss and gradients."""
    with torch.no_grad():
        want = model.eval()(images)
    model.to(device)
    images, labels = images.to(device), torch.tensor([0, 1], device=device)
    try:
        with torch.no_grad():
            torch.testing.assert_close(model(images).cpu(), want, atol=1e-4, rtol=1e-4)
        model.train()
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = F.cross_entropy(model(images).float(), labels)
        loss.backward()
    except Exception as error:  # every case runs; each failure is said in one line
        return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    bad = [n for n, grad in grads.items() if not torch.isfinite(grad).all()]
    if not torch.isfinite(loss) or not grads or bad:
        return f"bf16 step: loss {loss.item()}, {len(grads)} gradients, non-finite: {bad}"
    return None


@pytest.mark.cuda
@pytest.mark.parametrize("kind", sorted({kind for kind, _ in ON_A_GPU}))
def test_each_kind_and_family_runs_its_methods_on_a_gpu(images, monkeypatch, kind):
    """Each backbone kind's and family's own code on the GPU (issue 49), which the tests above run on the CPU only:
    relative-position tables, rotary embeddings, NaFlexVit's masks and the room prompts take, each Swin's windows."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # the CPU's fp32, to compare with it
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    failed = {}
    for method in [m for k, m in ON_A_GPU if k == kind]:
        model = petl.apply(MAKE[kind](), method, num_classes=4)
        perturb_trainable(model)
        if (said := _fails_on("cuda", images, model)) is not None:
            failed[method] = said
    assert failed == {}
