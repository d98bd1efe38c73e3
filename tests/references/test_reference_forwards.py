"""Each method against a small hand-written re-implementation of its reference's forward.

The re-implementations below are written from reading the reference code (files and lines cited
per test), on the same weights as petl's modules; they share no code with petl's methods.  Also
here: the engine's train-mode semantics (``train.backbone_mode``) and its weight-decay groups,
which follow the references' training loops.
"""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import perturb_trainable
from timm.layers import DropPath

import petl
from petl.methods.adapter import ParallelAdapter, SequentialAdapter
from petl.methods.vpt import PromptedBlock
from petl.model.backbone import backbone_of, unwrap
from petl.train import engine


def _attn(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Multi-head self-attention of a timm block, written out (no dropout)."""
    a = block.attn
    b, n, d = x.shape
    h = a.num_heads
    q, k, v = F.linear(x, a.qkv.weight, a.qkv.bias).reshape(b, n, 3, h, d // h).permute(2, 0, 3, 1, 4)
    weights = (q @ k.transpose(-2, -1) * (d // h) ** -0.5).softmax(-1)
    return a.proj((weights @ v).transpose(1, 2).reshape(b, n, d))


def _mlp(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    m = unwrap(block.mlp)
    return m.fc2(F.gelu(m.fc1(x)))


def _embed(model: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    """Patch embedding, class token and position embedding (the tiny ViTs have no pre-norm)."""
    x = model.patch_embed(images)
    cls = model.cls_token.expand(x.shape[0], -1, -1)
    return torch.cat([cls, x], dim=1) + model.pos_embed


# --- AdaptFormer (parallel adapter) ------------------------------------------------------------


def _adaptformer_block(block: torch.nn.Module, adapter: ParallelAdapter, x: torch.Tensor) -> torch.Tensor:
    # ShoufaChen/AdaptFormer@6967d67 models/custom_modules.py:L76-94: the adapter reads the residual
    # stream x after the attention sub-layer (layernorm option "none"), the MLP reads norm2(x), and
    # residual + mlp + adapter are summed; models/adapter.py:L50-69: down -> ReLU -> dropout -> up, * scale.
    x = x + _attn(block, block.norm1(x))
    adapt = adapter.up(F.dropout(F.relu(adapter.down(x)), 0.1, training=adapter.training)) * 0.1
    residual = x
    x = _mlp(block, block.norm2(x))
    return residual + x + adapt


def test_parallel_adapter_equals_adaptformer(tiny_vit, images):
    model = petl.apply_adapter(tiny_vit(), style="parallel", dim=8)
    perturb_trainable(model)
    model.eval()
    x = _embed(model, images)
    ours = x
    for wrapper in model.blocks:
        assert isinstance(wrapper, ParallelAdapter)
        x = _adaptformer_block(wrapper.base, wrapper, x)
        ours = wrapper(ours)
    torch.testing.assert_close(ours, x)
    # The bottleneck dropout acts in train mode, on the same random stream as the reference's.
    wrapper = model.blocks[0].train()
    tokens = _embed(model, images)
    torch.manual_seed(5)
    got = wrapper(tokens)
    torch.manual_seed(5)
    torch.testing.assert_close(got, _adaptformer_block(wrapper.base, wrapper, tokens))


def test_parallel_adapter_init_is_adaptformers_lora_init(tiny_vit):
    # models/adapter.py:L43-48 ("lora" init, main_image.py:L189): kaiming-uniform(a=sqrt(5)) down
    # weight, that is nn.Linear's default, and zero down bias, up weight and up bias.
    wrapper = petl.apply_adapter(tiny_vit(), style="parallel").blocks[0]
    bound = 1 / math.sqrt(wrapper.down.in_features)  # kaiming-uniform(a=sqrt(5)) bound
    assert 0 < wrapper.down.weight.abs().max() <= bound
    for t in (wrapper.down.bias, wrapper.up.weight, wrapper.up.bias):
        assert t.abs().sum() == 0


# --- V-PETL sequential adapter -----------------------------------------------------------------


def _vpetl_adapter_block(block: torch.nn.Module, adapter: SequentialAdapter, x: torch.Tensor) -> torch.Tensor:
    # synbol/Parameter-Efficient-Transfer-Learning-Benchmark@c188fad ImageClassification/models/
    # vision_transformer_adapter.py:L216-223 (adapter: x + up(gelu(down(x)))) and L251-265 (placement:
    # after the MLP, before drop-path and the residual).
    x = x + _attn(block, block.norm1(x))
    h = x
    x = _mlp(block, block.norm2(x))
    x = x + adapter.up(F.gelu(adapter.down(x)))
    return x + h


def test_sequential_adapter_equals_vpetl(tiny_vit, images):
    model = petl.apply_adapter(tiny_vit(), style="sequential", dim=4)
    perturb_trainable(model)
    model.eval()
    x = ours = _embed(model, images)
    for block in model.blocks:
        x = _vpetl_adapter_block(block, block.mlp, x)
        ours = block(ours)
    torch.testing.assert_close(ours, x)


# --- V-PETL LoRA on the fused qkv --------------------------------------------------------------


def _vpetl_lora_block(block: torch.nn.Module, x: torch.Tensor, scale: float) -> torch.Tensor:
    # synbol/Parameter-Efficient-Transfer-Learning-Benchmark@c188fad ImageClassification/models/
    # vision_transformer_lora.py:L100-103 (A: dim -> r, B: r -> dim, no bias, for q and v) and L110-135: the
    # fused qkv output, then new_q = B_q A_q x added to its first dim columns and new_v = B_v A_v x to its last,
    # unscaled (``scale`` is petl's alpha / rank, 1 to be the reference), then multi-head attention.
    a = block.attn
    lora = a.qkv
    b, n, d = x.shape
    h = block.norm1(x)
    qkv = F.linear(h, lora.base.weight, lora.base.bias).clone()
    qkv[:, :, :d] += scale * F.linear(F.linear(h, lora.lora_a["q"]), lora.lora_b["q"])
    qkv[:, :, -d:] += scale * F.linear(F.linear(h, lora.lora_a["v"]), lora.lora_b["v"])
    q, k, v = qkv.reshape(b, n, 3, a.num_heads, d // a.num_heads).permute(2, 0, 3, 1, 4)
    weights = (q @ k.transpose(-2, -1) * a.scale).softmax(-1)
    x = x + a.proj((weights @ v).transpose(1, 2).reshape(b, n, d))
    return x + _mlp(block, block.norm2(x))


@pytest.mark.parametrize(("rank", "alpha"), [(4, 4.0), (4, 10.0)])
def test_lora_on_q_and_v_equals_vpetl(tiny_vit, images, rank, alpha):
    # petl's default alpha = rank = 8 is the reference's unscaled update; another alpha scales B A by alpha / rank.
    model = petl.apply_lora(tiny_vit(), rank=rank, alpha=alpha, num_classes=4)
    perturb_trainable(model)  # A and B random, so every update acts
    model.eval()
    x = ours = _embed(model, images)
    for block in model.blocks:
        x = _vpetl_lora_block(block, x, alpha / rank)
        ours = block(ours)
        torch.testing.assert_close(ours, x)
    torch.testing.assert_close(model(images), model.head(model.norm(x)[:, 0]))
    # The K rows are left alone: the update is not the whole qkv's.
    k_rows = slice(48, 96)
    qkv = model.blocks[0].attn.qkv
    h = torch.randn(2, 5, 48)
    torch.testing.assert_close(qkv(h)[..., k_rows], qkv.base(h)[..., k_rows])


# --- VPT: prompts, pooling, Mlp-k and linear heads ---------------------------------------------


def _vpt_forward(model: torch.nn.Module, images: torch.Tensor, n: int, deep: bool, pool: str) -> torch.Tensor:
    # KMnP/vpt@4410440 src/models/vit_prompt/vit.py:L75-84 (prompts after the class token),
    # L109-124 (deep: each later layer's prompt outputs replaced by its own prompts), and
    # src/models/vit_prompt/vit_mae.py:L122-128 ("original": mean over every token but the class
    # token, prompts included; "img_pool": mean over the patch tokens), then fc_norm and the head.
    prompts = [b.prompt for b in model.blocks if isinstance(b, PromptedBlock) and b.prompt is not None]
    x = _embed(model, images)
    b = x.shape[0]
    x = torch.cat([x[:, :1], prompts[0].expand(b, -1, -1), x[:, 1:]], dim=1)
    for i, block in enumerate(backbone_of(model).block_list()):
        if deep and i > 0:
            x = torch.cat([x[:, :1], prompts[i].expand(b, -1, -1), x[:, 1 + n :]], dim=1)
        x = x + _attn(block, block.norm1(x))
        x = x + _mlp(block, block.norm2(x))
    pooled = x[:, 1:].mean(dim=1) if pool == "original" else x[:, 1 + n :].mean(dim=1)
    return model.head(model.fc_norm(pooled))


@pytest.mark.parametrize("pool", ["original", "img_pool"])
@pytest.mark.parametrize("deep", [False, True], ids=["shallow", "deep"])
def test_vpt_equals_reference_on_an_avg_pool_backbone(tiny_vit, images, deep, pool):
    model = petl.apply_vpt(tiny_vit(global_pool="avg"), num_tokens=3, deep=deep, pool=pool, num_classes=4).eval()
    expected = _vpt_forward(model, images, 3, deep, pool)
    torch.testing.assert_close(model(images), expected)


def test_vpt_pool_options_differ_on_avg_pool_and_agree_on_token_pool(tiny_vit, images):
    def logits(pool: str, **backbone) -> torch.Tensor:
        return petl.apply_vpt(tiny_vit(**backbone), num_tokens=3, pool=pool).eval()(images)

    assert not torch.allclose(logits("original", global_pool="avg"), logits("img_pool", global_pool="avg"))
    torch.testing.assert_close(logits("original"), logits("img_pool"))


def test_vpt_defaults_follow_the_vpt_config(tiny_vit):
    # src/configs/config.py:L73-74: VIT_POOL_TYPE "original", PROMPT.DROPOUT 0.0.
    cfg = petl.make_config("vpt")
    assert cfg.pool == "original" and cfg.dropout == 0.0
    # vit.py:L55-62: uniform(-v, v) with v = sqrt(6 / (3 * patch_h * patch_w + d)).
    model = petl.apply_vpt(tiny_vit(), num_tokens=50)
    bound = math.sqrt(6 / (3 * 8 * 8 + 48))
    prompt = model.blocks[0].prompt
    assert prompt.abs().max() <= bound and prompt.abs().max() > 0.9 * bound


def _vpt_mlp_head(head: torch.nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    # KMnP/vpt@4410440 src/models/mlp.py:L38-65: per hidden layer Linear -> ReLU -> BatchNorm1d ->
    # Dropout(0.1), then the last Linear.
    linears = [m for m in head if isinstance(m, torch.nn.Linear)]
    norms = [m for m in head if isinstance(m, torch.nn.BatchNorm1d)]
    for fc, bn in zip(linears[:-1], norms, strict=True):
        x = F.relu(fc(x))
        x = F.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, training=bn.training)
        x = F.dropout(x, 0.1, training=head.training)
    return linears[-1](x)


def test_mlp_head_equals_vpts_mlp(tiny_vit):
    model = petl.apply_mlp(tiny_vit(), k=3, num_classes=7)
    head = backbone_of(model).head()
    perturb_trainable(model)
    features = torch.randn(16, 48, generator=torch.Generator().manual_seed(2))
    for mode in (True, False):
        head.train(mode)
        reference = copy.deepcopy(head)  # it updates its own BatchNorm statistics
        torch.manual_seed(4)
        got = head(features)
        torch.manual_seed(4)
        torch.testing.assert_close(got, _vpt_mlp_head(reference, features))


def test_vpt_head_init_on_mlp_k(tiny_vit):
    # src/models/mlp.py:L38-57 and vit_models.py:L159-165 (special_bias=True): kaiming-normal
    # (fan-out) weights, last bias -log((1 - 0.01) / 0.01).
    bias = -math.log(99)
    mlp_head = backbone_of(petl.apply_mlp(tiny_vit(embed_dim=192, num_heads=3), k=2, num_classes=200)).head()
    hidden, last = (m for m in mlp_head if isinstance(m, torch.nn.Linear))
    torch.testing.assert_close(last.bias, torch.full_like(last.bias, bias))
    assert last.weight.std().item() == pytest.approx(math.sqrt(2 / 200), rel=0.1)
    assert hidden.weight.std().item() == pytest.approx(math.sqrt(2 / 192), rel=0.1)


def test_linear_head_is_the_reset_head_every_method_gets(tiny_vit):
    # V-PETL's reset_classifier (vision_transformer_adapter.py:L424-429): a plain nn.Linear, default init.
    torch.manual_seed(5)
    linear_head = backbone_of(petl.apply_linear(tiny_vit(), num_classes=7)).head()
    torch.manual_seed(5)
    model = tiny_vit()
    model.reset_classifier(7)
    torch.testing.assert_close(linear_head.state_dict(), backbone_of(model).head().state_dict())
    torch.manual_seed(5)
    lora_head = backbone_of(petl.apply_lora(tiny_vit(), num_classes=7)).head()
    torch.testing.assert_close(linear_head.state_dict(), lora_head.state_dict())
    # A kept head (no num_classes) is left as it is.
    model = tiny_vit()
    before = backbone_of(model).head().bias.clone()
    assert torch.equal(backbone_of(petl.apply_linear(model)).head().bias, before)


# --- Train mode (train.backbone_mode) ----------------------------------------------------------


def _drop_paths(model: torch.nn.Module) -> list[DropPath]:
    return [m for m in model.modules() if isinstance(m, DropPath)]


@pytest.mark.parametrize(
    ("method", "options", "active"),
    [
        # V-PETL / NOAH / PETL_Vision / AdaptFormer train with model.train(): drop-path acts.
        ("adapter", {"style": "parallel"}, True),
        ("adapter", {"style": "sequential"}, True),
        ("lora", {}, True),
        ("full", {}, True),
        # VPT keeps its frozen encoder in eval (vit_prompt/vit.py:L89-100, vit_models.py:L173-174).
        ("vpt", {}, False),
        ("linear", {}, False),
        ("mlp", {}, False),
    ],
)
def test_backbone_mode_defaults_follow_the_references(tiny_vit, images, method, options, active):
    model = petl.apply(tiny_vit(drop_path_rate=0.5), method, num_classes=4, **options)
    perturb_trainable(model)
    settings = engine.TrainSettings()
    assert engine.backbone_mode(model, settings) == ("train" if active else "eval")
    engine.set_train_mode(model, engine.backbone_mode(model, settings))
    assert _drop_paths(model) and all(m.training == active for m in _drop_paths(model))
    if method != "mlp":  # Mlp-k's head has its own dropout, on in train mode either way
        assert torch.equal(model(images), model(images)) != active
    if method == "full":
        return  # everything learns, so "eval" (only what learns trains) is train mode too
    # The run-level override wins over the method's default, both ways.
    override = "eval" if active else "train"
    mode = engine.backbone_mode(model, engine.TrainSettings(backbone_mode=override))
    engine.set_train_mode(model, mode)
    assert all(m.training == (not active) for m in _drop_paths(model))


def test_backbone_mode_eval_still_trains_what_learns(tiny_vit):
    model = petl.apply_vpt(tiny_vit(drop_path_rate=0.5), num_tokens=2, dropout=0.3, num_classes=4)
    engine.set_train_mode(model, "eval")
    assert model.blocks[0].dropout.training and backbone_of(model).head().training
    assert not model.blocks[0].base.training


def test_backbone_mode_rejects_unknown_values(tiny_vit):
    model = petl.apply_lora(tiny_vit())
    with pytest.raises(ValueError, match="backbone_mode"):
        engine.backbone_mode(model, engine.TrainSettings(backbone_mode="frozen"))
    # A model without a petl method (petl-pretrain) trains whole.
    assert engine.backbone_mode(tiny_vit(), engine.TrainSettings()) == "train"


# --- Weight decay groups -----------------------------------------------------------------------


def test_no_weight_decay_on_biases_norms_prompts_and_position_embeddings(tiny_vit):
    model = petl.apply_vpt(tiny_vit(), num_tokens=2, deep=True, num_classes=4)
    model.pos_embed.requires_grad_(True)
    model.blocks[1].base.norm1.requires_grad_(True)
    decayed, exempt = engine.param_groups(model, engine.TrainSettings(weight_decay=0.05))
    assert decayed["weight_decay"] == 0.05 and exempt["weight_decay"] == 0.0
    ids = {id(p) for p in exempt["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in ids}
    prompts = {f"blocks.{i}.prompt" for i in range(3)}
    assert names == prompts | {"pos_embed", "head.bias", "blocks.1.base.norm1.weight", "blocks.1.base.norm1.bias"}
    assert [id(p) for p in decayed["params"]] == [id(backbone_of(model).head().weight)]
    # Asked for, every tensor decays.
    (everything,) = engine.param_groups(model, engine.TrainSettings(weight_decay_all=True))
    assert len(everything["params"]) == sum(p.requires_grad for p in model.parameters())
    optimizer, _ = engine.build_optimizer(model, engine.TrainSettings(), steps_per_epoch=1)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [1e-4, 0.0]


@pytest.mark.parametrize(("method", "tokens"), [("noah", "prompt"), ("hst", "meta")])
def test_noah_prompts_and_hst_meta_tokens_are_decayed_as_their_references(tiny_vit, method, tokens):
    # Both references build their optimizer with timm's create_optimizer, which exempts 1-D tensors and the model's
    # no_weight_decay() = {pos_embed, cls_token, dist_token} only (NOAH model/supernet_vision_transformer_timm.py
    # L542-543; HST models/vit_hsn.py L289-291, optim_factory.py L51): their 2-D/3-D tokens decay, unlike VPT's.
    options = {"prompt": [2, 2, 2], "lora": [2, 2, 2], "adapter": [2, 2, 2]} if method == "noah" else {}
    model = petl.apply(tiny_vit(), method, num_classes=4, **options)
    decayed, exempt = engine.param_groups(model, engine.TrainSettings(weight_decay=0.05))
    names = {id(p): n for n, p in model.named_parameters()}
    decayed_names = {names[id(p)] for p in decayed["params"]}
    token_names = {n for n in names.values() if re.search(rf"\.{tokens}(\.\d+)?$", n)}
    assert token_names and token_names <= decayed_names
    assert all(p.ndim > 1 for p in decayed["params"]) and all(p.ndim <= 1 for p in exempt["params"])
