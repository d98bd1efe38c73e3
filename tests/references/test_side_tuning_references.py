"""Side-tuning methods against re-implementations of their references' forwards (as test_reference_forwards.py).

Written from reading the reference code (files and lines cited per test), on the same weights as petl's
modules, sharing no code with petl's methods.  The pooling and head are the backbone's own (timm's
``forward_head``), as petl keeps them for every method (a stated difference for DTL).
"""

from __future__ import annotations

import pytest
import torch
from conftest import perturb_trainable

import petl


def _embed(model: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    """Patch embedding, prefix tokens and position embedding, as timm runs them before the blocks."""
    return model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(images))))


def _head(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model.forward_head(model.norm(x))


# --- DTL ---------------------------------------------------------------------------------------


def _dtl_forward(model, side, plain_blocks, images, add_from, beta, fusion, prefix, grid):
    # heekhero/DTL@bf6c51e models/vision_transformer.py L424-444: residuals accumulate LoRALinear(x) =
    # x @ A^T @ B^T (L66-68) before each block; after each block of add_after_blocks, swish(residuals, beta)
    # (L44-45), the patch part through the depthwise conv on its grid (L434-440), is added to x.
    x = _embed(model, images)
    residuals = 0.0
    for i, block in enumerate(plain_blocks):
        residuals = residuals + x @ side.lora_a[i].T @ side.lora_b[i].T
        x = block(x)
        if i >= add_from:
            act = residuals * torch.sigmoid(residuals * beta)
            if fusion:
                b, _, d = act.shape
                patches = act[:, prefix:].reshape(b, *grid, d).permute(0, 3, 1, 2)
                patches = side.fusion(patches).permute(0, 2, 3, 1).reshape(b, grid[0] * grid[1], d)
                act = torch.cat([act[:, :prefix], patches], dim=1)
            x = x + act
    return _head(model, x)


@pytest.mark.parametrize(
    ("fusion_size", "options"), [(0, {}), (3, {"reg_tokens": 2}), (3, {"class_token": False, "global_pool": "avg"})]
)
def test_dtl_equals_reference(tiny_vit, images, fusion_size, options):
    model = petl.apply(tiny_vit(**options), "dtl", num_classes=4, fusion_size=fusion_size, add_from=1, beta=3.0)
    perturb_trainable(model)
    model.eval()
    side = model.blocks[0].side
    plain = [b.base for b in model.blocks]
    prefix = model.num_prefix_tokens
    expected = _dtl_forward(model, side, plain, images, 1, 3.0, fusion_size > 0, prefix, (4, 4))
    torch.testing.assert_close(model(images), expected, atol=1e-5, rtol=0)


def test_dtl_defaults_follow_the_dtl_scripts(tiny_vit):
    # train_scripts/vit/vtab/*/train_dtl.sh: --r 2 --beta 100.0 --add_after_blocks 6-11 --fusion_size 0;
    # LoRALinear L59-63: A kaiming-uniform, B zero.
    cfg = petl.make_config("dtl")
    assert (cfg.rank, cfg.beta, cfg.fusion_size) == (2, 100.0, 0)
    assert cfg.first_add(tiny_vit()) == 1  # half of 3 blocks, as 6 is half of ViT-B's 12
    side = petl.apply(tiny_vit(), "dtl").blocks[0].side
    assert all(b.abs().sum() == 0 for b in side.lora_b) and all(a.abs().sum() > 0 for a in side.lora_a)


# --- LST ---------------------------------------------------------------------------------------


def _side_block(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A pre-norm transformer layer written out (multi-head attention, GELU MLP; eval mode, no dropout)."""
    a, m = block.attn, block.mlp
    b, n, d = x.shape
    h = block.norm1(x)
    q, k, v = (h @ a.qkv.weight.T + a.qkv.bias).reshape(b, n, 3, a.num_heads, d // a.num_heads).permute(2, 0, 3, 1, 4)
    weights = (q @ k.transpose(-2, -1) * (d // a.num_heads) ** -0.5).softmax(-1)
    x = x + a.proj((weights @ v).transpose(1, 2).reshape(b, n, d))
    return x + m.fc2(torch.nn.functional.gelu(m.fc1(block.norm2(x))))


def _lst_forward(model, side, plain_blocks, images, gate_t):
    # ylsung/Ladder-Side-Tuning@1798e82 CLIP-ViL/src/lxrt/modeling.py L796-822 (add_residual_after False):
    # side = first_downsample(embeddings); per layer x = layer(x), side = merge(side, downsample_i(x)) with
    # gate = sigmoid(alpha_i / T) (L709-716), side = side_layer_i(side); the output is final_upsample(side).
    x = _embed(model, images)
    s = x @ side.first_down.weight.T
    for i, block in enumerate(plain_blocks):
        x = block(x)
        gate = torch.sigmoid(side.gates[i] / gate_t)
        s = _side_block(side.side_blocks[i], gate * s + (1 - gate) * x @ side.ladders[i].weight.T)
    return _head(model, s @ side.up.weight.T)


@pytest.mark.parametrize("options", [{}, {"reg_tokens": 2}, {"class_token": False, "global_pool": "avg"}])
def test_lst_equals_reference(tiny_vit, images, options):
    model = petl.apply(tiny_vit(**options), "lst", num_classes=4, reduction=4, gate_alpha=0.3, gate_t=0.5)
    perturb_trainable(model)
    model.eval()
    side = model.blocks[0].side
    expected = _lst_forward(model, side, [b.base for b in model.blocks], images, 0.5)
    torch.testing.assert_close(model(images), expected, atol=1e-5, rtol=0)


def test_lst_defaults_and_init_follow_the_reference(tiny_vit):
    # side_transformers/config.py: gate_alpha 0, gate_T 0.1; init_bert_weights L1012-1023.  Reduction 8 reproduces
    # V-PETL's 2.38M (LST's own: 16 by default, 4 in its script; test_lst_reduction_is_cited_as_the_code_reads_it).
    cfg = petl.make_config("lst")
    assert (cfg.reduction, cfg.gate_alpha, cfg.gate_t) == (8, 0.0, 0.1)
    side = petl.apply(tiny_vit(embed_dim=96, num_heads=3), "lst").blocks[0].side
    assert side.first_down.weight.shape == (12, 96) and side.first_down.bias is None and side.up.bias is None
    assert torch.equal(side.gates, torch.zeros(3))
    assert abs(float(side.ladders[0].weight.detach().std()) - 0.02) < 0.005
    assert all(float(b.attn.qkv.bias.detach().abs().sum()) == 0 for b in side.side_blocks)


def test_lst_reduction_is_cited_as_the_code_reads_it():
    # ylsung/Ladder-Side-Tuning@1798e82: side_transformers/config.py L2 is task_reduction_factor = 8, unread by the
    # side network; its width comes from args.reduction_factor (entry.py L102, modeling.py L648-649), default 16
    # (param.py L225), 4 in scripts/side_transformers.sh L3.
    from pathlib import Path

    from petl.methods import lst

    experiment = (Path(__file__).parents[2] / "configs" / "experiments" / "lst.yaml").read_text()
    for text in (lst.__doc__, experiment):
        flat = " ".join(text.replace("#", " ").split())
        assert "config.py: reduction 8" not in flat and "config.py (reduction 8" not in flat
        for cited in ("entry.py L102", "param.py L225", "side_transformers.sh L3", "task_reduction_factor"):
            assert cited in flat, cited


# --- HST ---------------------------------------------------------------------------------------


def _layer_norm(norm: torch.nn.LayerNorm, x: torch.Tensor, eps: float) -> torch.Tensor:
    """``norm``'s affine parameters at the reference's ``eps`` (not ``norm``'s own)."""
    return torch.nn.functional.layer_norm(x, x.shape[-1:], norm.weight, norm.bias, eps)


def _hst_side_block(block, x, meta_r, x_vit):
    # AFeng-x/HST@ee89571 models/vit_custom_modules.py L147-162 (M_C_Attention: q from x, k and v from the
    # meta tokens, softmax(q k^T * scale) v, proj) and L200-205 (M_Block: x + attn, + x_vit, + mlp); its norms
    # are ViT_HSN's norm_layer, LayerNorm eps 1e-6 (vit_hsn.py L188, L233).
    b, n, c = x.shape
    heads = block.heads
    q = block.q(_layer_norm(block.norm1, x, 1e-6)).reshape(b, n, heads, c // heads).permute(0, 2, 1, 3)
    k = block.k(meta_r).reshape(b, -1, heads, c // heads).permute(0, 2, 1, 3)
    v = block.v(meta_r).reshape(b, -1, heads, c // heads).permute(0, 2, 1, 3)
    attn = (q @ k.transpose(-2, -1) * (c // heads) ** -0.5).softmax(dim=-1)
    x = x + block.proj((attn @ v).transpose(1, 2).reshape(b, n, c))
    x = x + x_vit
    fc1, fc2 = block.mlp[0], block.mlp[2]
    return x + fc2(torch.nn.functional.gelu(fc1(_layer_norm(block.norm2, x, 1e-6))))


def _hst_forward(model, side, head, plain_blocks, images, stage_blocks):
    # models/vit_hsn.py L332-403: a meta token in front at every block, its output kept, the patch tokens kept
    # as a map; metaG bridged by the stage's T_Bridge and normed by m_proj_norm; per stage: patch embedding,
    # bilinear resize + bridge of the ViT maps, globalT = their mean, M_Blocks, m_norm; mean pool; fc_norm; head.
    x = _embed(model, images)
    b, prefix = images.shape[0], model.num_prefix_tokens
    metas, maps = [], []
    for i, block in enumerate(plain_blocks):
        x = block(torch.cat([side.meta[i].expand(b, -1, -1), x], dim=1))
        metas.append(x[:, :1])
        maps.append(x[:, 1 + prefix :].transpose(1, 2).reshape(b, -1, 4, 4))
        x = x[:, 1:]
    stage_of = {i: s for s, blocks in enumerate(stage_blocks) for i in blocks}
    # m_proj_norm (L249-255) and the patch embeddings' norms (vit_custom_modules.py L219, L254): nn.LayerNorm,
    # eps 1e-5; the stage norms m_norm (L235): norm_layer, eps 1e-6.
    metas = [_layer_norm(side.meta_norms[i], side.bridges[stage_of[i]](m), 1e-5) for i, m in enumerate(metas)]
    x_m = images
    for s, blocks in enumerate(stage_blocks):
        embed = side.embeds[s]
        x_m = embed.conv(x_m)
        _, _, h, w = x_m.shape
        x_m = _layer_norm(embed.norm, x_m.flatten(2).transpose(1, 2), 1e-5)
        for i in blocks:
            vit_map = torch.nn.functional.interpolate(maps[i], size=(h, w), mode="bilinear", align_corners=False)
            vit_map = side.bridges[s](vit_map.flatten(2).transpose(1, 2))
            meta_r = torch.cat([metas[i], vit_map.mean(dim=1, keepdim=True)], dim=1)
            x_m = _hst_side_block(side.side_blocks[i], x_m, meta_r, vit_map)
        x_m = _layer_norm(side.stage_norms[s], x_m, 1e-6)
        if s != len(stage_blocks) - 1:
            x_m = x_m.reshape(b, h, w, -1).permute(0, 3, 1, 2)
    pooled = x_m.mean(dim=1)
    pooled = (pooled - head.running_mean) / torch.sqrt(head.running_var + 1e-6)  # BatchNorm1d, eval, no affine
    return pooled @ head.weight.T + head.bias


@pytest.mark.parametrize("options", [{"depth": 4}, {"depth": 3, "reg_tokens": 2}])
def test_hst_equals_reference(tiny_vit, images, options):
    # In float64, so that a LayerNorm eps of 1e-5 where the reference has 1e-6 (a 1e-6 change in the logits)
    # fails the comparison.
    model = petl.apply(tiny_vit(**options), "hst", num_classes=4, dims=(8, 12, 16, 16), heads=(2, 2, 4, 4))
    model, images = model.double(), images.double()
    perturb_trainable(model)
    model.train()
    model(images)  # one train-mode forward moves the BatchNorm statistics away from 0 and 1
    model.eval()
    side = model.blocks[0].side
    expected = _hst_forward(model, side, model.head, [b.base for b in model.blocks], images, side.stage_blocks)
    torch.testing.assert_close(model(images), expected, atol=1e-12, rtol=0)


def test_hst_layer_norm_eps_follows_the_reference(tiny_vit):
    # norm_layer = partial(nn.LayerNorm, eps=1e-6) (vit_hsn.py L188) for the side blocks (L230-234) and the stage
    # norms (L235); plain nn.LayerNorm (eps 1e-5) for m_proj_norm (L249-255) and the patch embeddings'
    # norms (vit_custom_modules.py L219, L254).
    side = petl.apply(tiny_vit(), "hst", num_classes=4, dims=(8, 12, 16), heads=(2, 2, 4)).blocks[0].side
    assert {m.eps for b in side.side_blocks for m in (b.norm1, b.norm2)} == {1e-6}
    assert {m.eps for m in side.stage_norms} == {1e-6}
    assert {m.eps for m in side.meta_norms} == {1e-5}
    assert {e.norm.eps for e in side.embeds} == {1e-5}


def test_hst_defaults_follow_the_reference(tiny_vit):
    # ViT_HSN defaults (vit_hsn.py L156-157): m_embed_dims 32/48/64/72, m_c_num_heads 2/4/8/12, metaG_num 1;
    # freeze_vit (L316-327): the blocks' LayerNorms train, the other backbone weights do not.
    cfg = petl.make_config("hst")
    assert (cfg.widths, cfg.head_counts, cfg.meta_tokens) == ((32, 48, 64, 72), (2, 4, 8, 12), 1)
    with torch.device("meta"):
        import timm

        vit_b = timm.create_model("vit_base_patch16_224", pretrained=False)
    assert cfg.stages(vit_b) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]  # block_indices 2, 5, 8, 11
    model = petl.apply(tiny_vit(), "hst", num_classes=4)
    trained = {n for n, p in model.named_parameters() if p.requires_grad and not n.startswith("blocks.0.network")}
    assert {n for n in trained if not n.startswith("head.")} == {
        f"blocks.{i}.base.{norm}.{p}" for i in range(3) for norm in ("norm1", "norm2") for p in ("weight", "bias")
    }
