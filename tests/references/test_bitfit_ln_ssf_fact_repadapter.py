"""BitFit, LN tuning, SSF, FacT and RepAdapter against small re-implementations of their references.

Each reference function below is written from the reference's description (file:line in the
method modules) and run on the very tensors petl's wrappers hold, so a wrong placement, layout or
init convention shows up as a numerical difference.
"""

from __future__ import annotations

import copy
import csv
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import perturb_trainable
from torch import nn

import petl
from petl.methods.fact import FactLinear
from petl.methods.repadapter import RepAdapterLinear
from petl.methods.ssf import SsfLayer
from petl.model.backbone import backbone_of
from petl.model.backbone.vit import ViT

PUBLISHED_CSV = Path(petl.__file__).parent / "bench" / "published" / "vtab1k_vitb16_in21k_vpetl.csv"


def _published_params(row: str) -> str:
    with PUBLISHED_CSV.open() as f:
        for record in csv.reader(f):
            if record[0] == row:
                return record[-2]
    raise KeyError(row)


@pytest.mark.parametrize(
    ("method", "options", "row", "count"),
    [
        ("bitfit", {}, "BitFit", 102_912),
        ("ssf", {}, "SSF", 205_824),
        ("ln", {}, None, 38_400),
        ("bitfit", {"biases": "linear"}, None, 82_944),
        # Differ from the published row; the reasons are in the experiment files.
        ("fact", {"type": "tk", "rank": 32}, None, 86_528),
        ("repadapter", {}, None, 239_808),
    ],
)
def test_vit_base_counts(vit_base, method, options, row, count):
    assert petl.get_method(method).trainable_formula(vit_base, petl.make_config(method, **options)) == count
    if row is not None:
        assert f"{count / 1e6:.2f}M" == _published_params(row)


def test_repadapter_published_count_is_the_weights_without_biases():
    # RepAdapter's 0.22M: 24 adapters x (768*8 dense A + 768*8/2 grouped B) weights; petl also counts
    # the 8 + 768 bias entries of each adapter (239,808 = 0.24M).
    assert f"{24 * (768 * 8 + 768 * 4) / 1e6:.2f}M" == _published_params("RepAdapter")


# --- BitFit and LN tuning ----------------------------------------------------------------------


def test_bitfit_trains_what_vpetl_trains(tiny_vit):
    # V-PETL's rule (train_model_bitfit.py:L164-171): every parameter whose name holds "bias".
    model = petl.apply_bitfit(tiny_vit(), num_classes=4)
    trained = {n for n, p in model.named_parameters() if p.requires_grad and not n.startswith("head.")}
    assert trained == {n for n, _ in tiny_vit().named_parameters() if "bias" in n and not n.startswith("head.")}
    assert "patch_embed.proj.bias" in trained and "blocks.0.norm1.bias" in trained and "norm.bias" in trained


def test_bitfit_linear_trains_the_block_linear_biases_only(tiny_vit):
    model = petl.apply_bitfit(tiny_vit(), biases="linear", num_classes=4)
    trained = {n for n, p in model.named_parameters() if p.requires_grad and not n.startswith("head.")}
    expected = {f"blocks.{i}.{s}.bias" for i in range(3) for s in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")}
    assert trained == expected


def test_bitfit_refuses_a_model_without_such_biases(tiny_vit):
    with pytest.raises(ValueError, match="biases"):
        petl.apply_bitfit(tiny_vit(qkv_bias=False, proj_bias=False), biases="nope")
    model = tiny_vit()
    for block in backbone_of(model).block_list():
        for name in ("qkv", "proj", "fc1", "fc2"):
            ViT.linear(block, name).bias = None
    with pytest.raises(ValueError, match="no such bias"):
        petl.apply_bitfit(model, biases="linear")


def test_ln_trains_what_petl_vision_trains(tiny_vit):
    # PETL_Vision's rule (experiment/build_model.py:L33-34): every parameter whose name holds "norm".
    model = petl.apply_ln(tiny_vit(), num_classes=4)
    trained = {n for n, p in model.named_parameters() if p.requires_grad and not n.startswith("head.")}
    assert trained == {n for n, _ in tiny_vit().named_parameters() if "norm" in n}
    # Average pooling: the final LayerNorm is fc_norm, and it trains too.
    model = petl.apply_ln(tiny_vit(class_token=False, global_pool="avg"), num_classes=4)
    assert model.fc_norm.weight.requires_grad


# --- SSF ---------------------------------------------------------------------------------------


def _ssf(x: torch.Tensor, layer: SsfLayer) -> torch.Tensor:
    # ssf_ada (model/ssf.py:L14-21): tokens scale on the last dim, NCHW maps on dim 1.
    if x.dim() == 4:
        return x * layer.scale.view(1, -1, 1, 1) + layer.shift.view(1, -1, 1, 1)
    return x * layer.scale + layer.shift


def _reference_ssf_forward(plain: nn.Module, petl_model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """PETL_Vision's SSF ViT forward on ``plain``'s frozen weights and ``petl_model``'s scales/shifts."""
    ssf = {name: m for name, m in petl_model.named_modules() if isinstance(m, SsfLayer)}
    x = _ssf(plain.patch_embed.proj(images), ssf["patch_embed.proj"])  # patch_embed.py:L93-94
    x = x.flatten(2).transpose(1, 2)
    if "patch_embed.norm" in ssf:
        x = _ssf(plain.patch_embed.norm(x), ssf["patch_embed.norm"])  # patch_embed.py:L95-96
    x = plain._pos_embed(x)
    for i, blk in enumerate(plain.blocks):
        p = f"blocks.{i}."
        h = _ssf(blk.norm1(x), ssf[p + "norm1"])  # block.py:L93-94
        b, n, c = h.shape
        qkv = _ssf(blk.attn.qkv(h), ssf[p + "attn.qkv"])  # attention.py:L50-51
        q, k, v = qkv.reshape(b, n, 3, blk.attn.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c)
        x = x + _ssf(blk.attn.proj(a), ssf[p + "attn.proj"])  # attention.py:L88-89
        h = _ssf(blk.norm2(x), ssf[p + "norm2"])  # block.py:L134-135
        h = _ssf(blk.mlp.fc1(h), ssf[p + "mlp.fc1"])  # mlp.py:L50-51
        x = x + _ssf(blk.mlp.fc2(blk.mlp.act(h)), ssf[p + "mlp.fc2"])  # mlp.py:L62-63
    if plain.global_pool == "avg":
        # Average pooling: ``norm`` is an Identity, the final LayerNorm is fc_norm after the pooling.
        pooled = x[:, plain.num_prefix_tokens :].mean(dim=1)
        return petl_model.head(_ssf(plain.fc_norm(pooled), ssf["fc_norm"]))
    x = _ssf(plain.norm(x), ssf["norm"])  # vision_transformer.py:L246-247
    return petl_model.head(x[:, 0])  # the head trains too, so take the perturbed one


def test_ssf_matches_the_reference_forward(tiny_vit, images):
    model = petl.apply_ssf(tiny_vit())
    perturb_trainable(model)
    plain = tiny_vit()
    assert len([m for m in model.modules() if isinstance(m, SsfLayer)]) == 1 + 3 * 6 + 1
    torch.testing.assert_close(model(images), _reference_ssf_forward(plain, model, images), atol=1e-5, rtol=1e-5)


def test_ssf_follows_the_patch_norm_and_fc_norm_where_a_vit_has_them(tiny_vit, images):
    options = dict(embed_norm_layer="layernorm", class_token=False, global_pool="avg", fc_norm=True)
    model = petl.apply_ssf(tiny_vit(**options))
    perturb_trainable(model)
    plain = tiny_vit(**options)
    sites = {name for name, m in model.named_modules() if isinstance(m, SsfLayer)}
    assert {"patch_embed.norm", "fc_norm"} <= sites and "norm" not in sites and len(sites) == 2 + 3 * 6 + 1
    torch.testing.assert_close(model(images), _reference_ssf_forward(plain, model, images), atol=1e-5, rtol=1e-5)
    before = model(images)
    petl.merge(model)
    torch.testing.assert_close(model(images), before, atol=1e-5, rtol=1e-5)


def test_ssf_init_follows_the_reference_and_zero_std_is_the_identity(tiny_vit, images):
    torch.manual_seed(0)
    model = petl.apply_ssf(tiny_vit(depth=12, embed_dim=192, num_heads=3))
    scales = torch.cat([m.scale.detach() for m in model.modules() if isinstance(m, SsfLayer)])
    shifts = torch.cat([m.shift.detach() for m in model.modules() if isinstance(m, SsfLayer)])
    assert abs(scales.mean().item() - 1) < 0.005 and abs(scales.std().item() - 0.02) < 0.002
    assert abs(shifts.mean().item()) < 0.005 and abs(shifts.std().item() - 0.02) < 0.002
    identity = petl.apply_ssf(tiny_vit(), init_std=0.0)
    assert torch.equal(identity(images), tiny_vit()(images))


def test_ssf_merged_layers_run_the_plain_layer(tiny_vit, images):
    model = petl.apply_ssf(tiny_vit())
    perturb_trainable(model)
    before = model(images)
    petl.merge(model)
    layer = ViT.linear(backbone_of(model).block_list()[0], "qkv")
    tokens = torch.randn(2, 5, 48)
    assert torch.equal(layer(tokens), layer.base(tokens))
    torch.testing.assert_close(model(images), before, atol=1e-5, rtol=1e-5)


def test_ssf_merge_refuses_what_it_cannot_fold(tiny_vit):
    model = petl.apply_ssf(tiny_vit(qkv_bias=False))
    # The layer named, and what to do: the unmerged model runs as trained.
    with pytest.raises(ValueError, match=r"^blocks\.0\.attn\.qkv: SSF .* without weight and bias.* runs as trained"):
        petl.merge(model)
    model = petl.apply_ssf(tiny_vit())
    with torch.no_grad():
        ViT.linear(backbone_of(model).block_list()[1], "fc1").scale[0] = float("inf")
    weight = ViT.linear(backbone_of(model).block_list()[1], "fc1").base.weight.clone()
    with pytest.raises(ValueError, match="non-finite"):
        petl.merge(model)
    assert torch.equal(ViT.linear(backbone_of(model).block_list()[1], "fc1").base.weight, weight)


# --- FacT --------------------------------------------------------------------------------------


def _reference_fact(
    x: torch.Tensor, mode: str, i: int, ref: dict, kind: str, scale: float, drop: float = 0.0
) -> torch.Tensor:
    """model/fact.py:L57-118 on the tensors in ``ref``; ``drop`` > 0: train mode, the Dropout(0.1) of L27, L32,
    L49-50 on the rank-sized hidden, one draw per q, k, v core in that order (L61-64, L86-89)."""
    u, v = (lambda t: t @ ref["u"].t()), (lambda t: t @ ref["v"].t())
    dp = lambda t: F.dropout(t, drop, training=drop > 0)  # noqa: E731
    b, n, c = x.shape[0], x.shape[1], ref["u"].shape[1]
    f = ref["u"].shape[0]
    if kind == "tt":
        q, k, vv, proj = ref["attn"][i]
        fc1, fc2 = ref["mlp"][i]
        lin = lambda t, w: t @ w.t()  # noqa: E731
        if mode == "attn_qkv":
            return torch.cat([v(dp(lin(u(x), w))) for w in (q, k, vv)], dim=2) * scale
        if mode == "attn_proj":
            return v(dp(lin(u(x), proj))) * scale
        if mode == "mlp_1":
            return v(dp(lin(u(x), fc1)).reshape(b, n, 4, f)).reshape(b, n, 4 * c) * scale
        return v(dp(lin(u(x.reshape(b, n, 4, c)).reshape(b, n, 4 * f), fc2))) * scale
    start = i * 12
    if mode in ("attn_qkv", "attn_proj"):
        cores = ref["c"] @ ref["p"][:, start : start + 4]
        if mode == "attn_qkv":
            return torch.cat([v(dp(u(x) @ cores[:, :, j])) for j in range(3)], dim=2) * scale
        return v(dp(u(x) @ cores[:, :, 3])) * scale
    cores = ref["c"] @ ref["p"][:, start + 4 : start + 12]
    fc1, fc2 = cores[:, :, :4].reshape(f, 4 * f), cores[:, :, 4:].reshape(f, 4 * f)
    if mode == "mlp_1":
        return v(dp(u(x) @ fc1).reshape(b, n, 4, f)).reshape(b, n, 4 * c) * scale
    return v(dp(u(x.reshape(b, n, 4, c)).reshape(b, n, 4 * f) @ fc2.t())) * scale


def _reference_tensors(model: nn.Module, kind: str) -> dict:
    wrappers = [
        [ViT.linear(block, name) for name in ("qkv", "proj", "fc1", "fc2")] for block in backbone_of(model).block_list()
    ]
    shared = wrappers[0][0].factors
    ref = {"u": shared.u.detach(), "v": shared.v.detach()}
    if kind == "tt":
        ref["attn"] = [[*w[0].cores.detach(), w[1].cores.detach()[0]] for w in wrappers]
        ref["mlp"] = [[w[2].cores.detach()[0], w[3].cores.detach()[0]] for w in wrappers]
    else:
        ref["c"] = shared.c.detach()
        ref["p"] = torch.cat([w_.p.detach() for w in wrappers for w_ in w], dim=1)  # rank x (12 * depth)
    return ref


@pytest.mark.parametrize("kind", ["tt", "tk"])
def test_fact_matches_the_reference_forward(tiny_vit, kind):
    scale = 3.0
    model = petl.apply_fact(tiny_vit(), type=kind, rank=4, scale=scale).eval()
    perturb_trainable(model)
    ref = _reference_tensors(model, kind)
    if kind == "tk":
        assert ref["p"].shape == (4, 12 * 3) and ref["c"].shape == (4, 4, 4)
    gen = torch.Generator().manual_seed(5)
    for i, block in enumerate(backbone_of(model).block_list()):
        for name, mode in (("qkv", "attn_qkv"), ("proj", "attn_proj"), ("fc1", "mlp_1"), ("fc2", "mlp_2")):
            layer = ViT.linear(block, name)
            x = torch.randn(2, 5, layer.base.in_features, generator=gen)
            expected = layer.base(x) + _reference_fact(x, mode, i, ref, kind, scale)
            torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)
            # Train mode: the same dropout masks, drawn on the same tensors in the same order.
            layer.train()
            torch.manual_seed(i)
            got = layer(x)
            torch.manual_seed(i)
            expected = layer.base(x) + _reference_fact(x, mode, i, ref, kind, scale, drop=0.1)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
            assert not torch.allclose(got, layer.eval()(x))


def test_fact_shares_u_and_v_across_blocks_with_one_name_each(tiny_vit):
    model = petl.apply_fact(tiny_vit(), type="tk", rank=4)
    layers = [
        ViT.linear(block, name) for block in backbone_of(model).block_list() for name in ("qkv", "proj", "fc1", "fc2")
    ]
    assert all(isinstance(layer, FactLinear) and layer.factors is layers[0].factors for layer in layers)
    names = [n for n in model.state_dict() if n.endswith((".u", ".v", ".c"))]
    assert names == ["blocks.0.attn.qkv.shared.u", "blocks.0.attn.qkv.shared.v", "blocks.0.attn.qkv.shared.c"]
    assert layers[0].factors.v.abs().sum() == 0 and layers[0].factors.u.abs().sum() > 0


def test_fact_refuses_bad_options(tiny_vit):
    with pytest.raises(ValueError, match="type"):
        petl.apply_fact(tiny_vit(), type="cp")
    with pytest.raises(ValueError, match="rank"):
        petl.apply_fact(tiny_vit(), rank=0)
    with pytest.raises(ValueError, match="MLP"):
        petl.apply_fact(tiny_vit(mlp_ratio=2.0))
    with pytest.raises(ValueError, match="scale=0 switches the factorised update off"):
        petl.apply_fact(tiny_vit(), scale=0.0)


# --- RepAdapter --------------------------------------------------------------------------------


def _reference_repadapter(
    x: torch.Tensor, layer: RepAdapterLinear, groups: int, scale: float, drop: float = 0.0
) -> torch.Tensor:
    """model/repadapter.py:L5-27 with Conv1d layers carrying ``layer``'s tensors; ``drop`` > 0: train mode.

    The Dropout(0.1) of L16 acts between conv_A and conv_B (L25).  The reference draws it on the conv layout
    (batch, bottleneck, tokens); the mask is drawn element by element alike, so here it is drawn on the token
    layout petl's Linear gives, which makes the draws comparable under one seed.
    """
    # The Conv1d weights (out, in / groups, 1) of conv_A (dense) and conv_B (grouped), from ``layer``'s tensors.
    conv_a = lambda t: F.conv1d(t, layer.down.weight.unsqueeze(-1), layer.down.bias)  # noqa: E731
    conv_b = lambda t: F.conv1d(t, layer.up_weight.unsqueeze(-1), layer.up_bias, groups=groups)  # noqa: E731
    t = x.transpose(1, 2)
    h = F.dropout(conv_a(t).transpose(1, 2).contiguous(), drop, training=drop > 0).transpose(1, 2)
    return (conv_b(h) * scale + t).transpose(1, 2)


def test_repadapter_matches_the_reference_block(tiny_vit):
    groups, scale = 4, 0.7
    model = petl.apply_repadapter(tiny_vit(), bottleneck=8, groups=groups, scale=scale)
    perturb_trainable(model)
    plain = tiny_vit()
    x = torch.randn(2, 5, 48)
    for block, ref_block in zip(model.blocks, plain.blocks, strict=True):
        qkv, fc1 = ViT.linear(block, "qkv"), ViT.linear(block, "fc1")
        # block.py:L112-113 and L154-155: the adapter acts on the norm output, before attn / mlp.
        h = x + ref_block.attn(_reference_repadapter(ref_block.norm1(x), qkv, groups, scale))
        expected = h + ref_block.mlp(_reference_repadapter(ref_block.norm2(h), fc1, groups, scale))
        torch.testing.assert_close(block(x), expected, atol=1e-5, rtol=1e-5)
        # Train mode: the adapters' dropout (the frozen block has none here), the same masks in the same order.
        block.train()
        torch.manual_seed(1)
        got = block(x)
        torch.manual_seed(1)
        h = x + ref_block.attn(_reference_repadapter(ref_block.norm1(x), qkv, groups, scale, drop=0.1))
        trained = h + ref_block.mlp(_reference_repadapter(ref_block.norm2(h), fc1, groups, scale, drop=0.1))
        torch.testing.assert_close(got, trained, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(got, expected)
        block.eval()
        x = expected


def test_repadapter_init_is_lora_xavier(tiny_vit):
    layer = ViT.linear(backbone_of(petl.apply_repadapter(tiny_vit())).block_list()[0], "fc1")
    assert layer.up_weight.abs().sum() == 0 and layer.up_bias.abs().sum() == 0 and layer.down.bias.abs().sum() == 0
    bound = math.sqrt(6 / (48 + 8))
    assert 0 < layer.down.weight.abs().max() <= bound


def test_repadapter_merge_runs_the_plain_linear_and_unmerges(tiny_vit, images):
    model = petl.apply_repadapter(tiny_vit(), scale=2.0)
    perturb_trainable(model)
    layer = ViT.linear(backbone_of(model).block_list()[2], "qkv")
    weight, bias = layer.base.weight.clone(), layer.base.bias.clone()
    before = model(images)
    petl.merge(model)
    tokens = torch.randn(2, 5, 48)
    assert torch.equal(layer(tokens), layer.base(tokens))
    torch.testing.assert_close(model(images), before, atol=1e-5, rtol=1e-5)
    petl.unmerge(model)
    torch.testing.assert_close(layer.base.weight, weight, atol=1e-6, rtol=0)
    torch.testing.assert_close(layer.base.bias, bias, atol=1e-6, rtol=0)


def test_repadapter_refuses_groups_that_do_not_divide(tiny_vit):
    with pytest.raises(ValueError, match="groups=3"):
        petl.apply_repadapter(tiny_vit(), bottleneck=8, groups=3)
    with pytest.raises(ValueError, match="scale=0 switches the adapters off"):
        petl.apply_repadapter(tiny_vit(), scale=0.0)


# --- merging in half precision ------------------------------------------------------------------


@pytest.mark.parametrize(("method", "options"), [("ssf", {}), ("fact", {"type": "tt"}), ("repadapter", {})])
def test_half_precision_merge_computes_in_float32(tiny_vit, method, options):
    half = petl.apply(tiny_vit(), method, **options).to(torch.bfloat16)
    perturb_trainable(half)
    # The same bf16 values in a float32 model: its merge is the exact float32 result.
    full = petl.apply(tiny_vit(), method, **options)
    with torch.no_grad():
        for p, q in zip(full.parameters(), half.parameters(), strict=True):
            p.copy_(q.float())
    petl.merge(full)
    petl.merge(half)
    for (name, merged), merged_half in zip(full.named_parameters(), half.parameters(), strict=True):
        # Computed in float32 and rounded to bf16 once, not accumulated in bf16.
        assert torch.equal(merged_half, merged.detach().to(torch.bfloat16)), name


@pytest.mark.parametrize("method", ["fact", "repadapter"])
def test_new_dropout_follows_the_model_mode(tiny_vit, images, method):
    # Wrappers added to an eval-mode model start in eval mode (no dropout), and follow .train().
    model = petl.apply(tiny_vit(), method)
    perturb_trainable(model)
    assert torch.equal(model(images), model(images))
    model.train()
    assert not torch.equal(model(images), model(images))


def test_fact_deepcopy_shares_factors_within_the_copy(tiny_vit):
    model = petl.apply_fact(tiny_vit())
    clone = copy.deepcopy(model)
    owner = ViT.linear(backbone_of(clone).block_list()[0], "qkv")
    assert ViT.linear(backbone_of(clone).block_list()[2], "fc2").factors is owner.factors
    assert owner.factors is not ViT.linear(backbone_of(model).block_list()[0], "qkv").factors
