"""timm's rope ViTs (``vit_*_patch16_rope_*``: an Eva whose blocks run ``AttentionRope``) through the eva backbone.

The method contracts run on a tiny one (``eva_rope`` in ``TINY_FAMILIES``) and on one with a learnable rotation per
block (``eva_rope_mixed``: timm's ``rope_type='mixed'``); here LoRA's forward is checked against timm's
``AttentionRope`` forward written out by hand, with each block's rotation written out for the per-block one.
"""

from __future__ import annotations

import pytest
import timm
import torch
from conftest import make_tiny_family

import petl
from petl import backbone_of


def _rotate(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """timm's interleaved rotation (``apply_rot_embed_cat``, ``rotate_half=False``): ``rope`` is [sin, cos]."""
    sin, cos = rope.chunk(2, dim=-1)
    turned = torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).reshape(x.shape)
    return x * cos + turned * sin


def _reference_block(block, x, rope, lora, prefix):
    """One EvaBlock of AttentionRope with LoRA's update on qkv's Q and V rows, from the weights alone."""
    attn = block.attn
    width, heads = x.shape[-1], attn.num_heads
    h = block.norm1(x)
    qkv = h @ lora.base.weight.t() + lora.base.bias
    for part, index in (("q", 0), ("v", 2)):
        update = (h @ lora.lora_a[part].t() @ lora.lora_b[part].t()) * lora.scale
        qkv = qkv + torch.nn.functional.pad(update, (index * width, (2 - index) * width))
    b, n, _ = x.shape
    q, k, v = qkv.reshape(b, n, 3, heads, width // heads).permute(2, 0, 3, 1, 4)
    # Every token after the prefix is rotated by its row of rope; the prefix tokens are not.
    q = torch.cat([q[:, :, :prefix], _rotate(q[:, :, prefix:], rope)], dim=2)
    k = torch.cat([k[:, :, :prefix], _rotate(k[:, :, prefix:], rope)], dim=2)
    weights = ((q @ k.transpose(-2, -1)) * (width // heads) ** -0.5).softmax(dim=-1)
    out = (weights @ v).transpose(1, 2).reshape(b, n, width)
    x = x + block.gamma_1 * (out @ attn.proj.weight.t() + attn.proj.bias)
    return x + block.gamma_2 * block.mlp(block.norm2(x))


def _mixed_rotations(freqs: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """timm's ``RotaryEmbeddingMixed`` table (depth x heads x tokens x 2 head_dim) from its ``freqs`` (2 x depth x
    heads x head_dim / 2): token (r, c) of the grid, in row-major order, turns by ``c * freqs[0] + r * freqs[1]``
    (``grid_indexing='xy'``), each angle's sin and cos repeated for the pair of channels it turns.
    """
    rows, cols = torch.meshgrid(torch.arange(grid[0]), torch.arange(grid[1]), indexing="ij")
    t_x, t_y = cols.reshape(-1).float(), rows.reshape(-1).float()
    angles = t_x[:, None] * freqs[0, :, :, None, :] + t_y[:, None] * freqs[1, :, :, None, :]
    return torch.cat([angles.sin().repeat_interleave(2, -1), angles.cos().repeat_interleave(2, -1)], dim=-1)


@pytest.mark.parametrize("family", ["eva_rope", "eva_rope_mixed"])
def test_lora_on_a_rope_vit_is_timms_attention_rope_plus_the_update(images, family):
    model = petl.apply(make_tiny_family(family), "lora", targets=["q", "v"], rank=2, alpha=4.0).eval()
    bb = backbone_of(model)
    assert all(type(b.attn).__name__ == "AttentionRope" for b in bb.block_list())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_b" in name:  # zero at init: the update must act
                param.normal_(0.0, 0.5)
        if family == "eva_rope_mixed":
            # Block i turns by its own rows of the learnable freqs (frozen, as the rest of the backbone).
            assert not model.rope.freqs.requires_grad
            ropes = list(_mixed_rotations(model.rope.freqs, bb.grid_size()))
            assert not torch.allclose(ropes[0], ropes[1])
            torch.testing.assert_close(torch.stack(ropes), model.rope.get_embed())
        else:
            ropes = [model.rope.get_embed()] * bb.depth()
        x = bb.embed_tokens(images)
        for block, rope in zip(bb.block_list(), ropes, strict=True):
            x = _reference_block(block, x, rope, bb.linear(block, "qkv"), bb.num_prefix_tokens())
        want = bb.head()(bb.pooled_features(x))
        torch.testing.assert_close(model(images), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(petl.merge(model)(images), want, atol=1e-5, rtol=1e-5)
        # The update acts: without it the logits differ.
        assert not torch.allclose(make_tiny_family(family)(images), want, atol=1e-3)


@pytest.mark.parametrize("method", ["bitfit", "lora", "ssf"])
def test_a_wrapper_on_attention_ropes_qkv_keeps_timms_own_forward(method):
    # AttentionRope calls qkv (its biases inside it): nothing is switched on it, and BitFit trains qkv's own bias.
    model = petl.apply(make_tiny_family("eva_rope"), method)
    bb = backbone_of(model)
    for block in bb.block_list():
        assert not hasattr(block.attn, "qkv_bias_separate")
        if method == "bitfit":
            assert bb.linear(block, "qkv").bias.requires_grad


def test_a_per_block_rope_is_refused_without_the_blocks_index_and_shared_by_every_row(images):
    # run_block hands block i its row i (the family contracts run the blocks one by one against timm's forward);
    # without an index it cannot tell which row.  The table comes from the grid, not the images: a MultiTask's
    # rows share it, so a task that trained its freqs could not share the backbone.
    model = make_tiny_family("eva_rope_mixed")
    bb = backbone_of(model)
    with pytest.raises(ValueError, match="its own rotary embedding: give index") as refused:
        bb.run_block(bb.block_list()[0], bb.embed_tokens(images))
    assert "\n" not in str(refused.value)
    assert bb.batch_shared_modules() == [model.rope]
    assert backbone_of(make_tiny_family("eva_rope")).batch_shared_modules() == []


def test_every_method_but_full_fine_tuning_leaves_the_per_block_rotation_frozen():
    # Its freqs are a backbone weight: GPS selects in the Linears, BitFit trains biases, Partial-k the last blocks,
    # none of them the table every block reads its rows of.
    for method in petl.list_methods():
        if "eva" not in petl.get_method(method).backbones:
            continue
        model = petl.apply(make_tiny_family("eva_rope_mixed"), method)
        assert model.rope.freqs.requires_grad == (method == "full"), method


# timm's DINOv3 sizes share one rotary layout (RotaryEmbeddingDinoV3: temperature 100, rotate_half, 4 register
# tokens) at the head width of 64 (S, S+, B, L, H+; H+ and S+ with a SwiGLU MLP), or 128 (7B, SwiGLU): a tiny one of
# each head width, at 8x8 patches of 4 px.  LingBot-Vision and Sapiens2 (separate q/k/v, grouped-query attention
# in the middle blocks, SwiGLU) take the same rotation, built dynamic_img_size=True too.
DINOV3 = [
    ("vit_small_patch16_dinov3", 128, {}),
    ("vit_7b_patch16_dinov3", 256, {}),
    ("vit_small_patch16_lingbot", 128, {}),
    ("vit_base_patch16_sapiens2", 128, {"num_kv_heads": (2, 1)}),
]


@pytest.mark.parametrize(("name", "width", "overrides"), DINOV3, ids=[name for name, *_ in DINOV3])
def test_a_dinov3_built_for_one_size_is_timms_dinov3_and_its_blocks_run_one_by_one(images, name, width, overrides):
    # petl refuses timm's dynamic_img_size=True DINOv3 saying to build it with dynamic_img_size=False: the same
    # weights and logits at its img_size, and petl's block path (block_inputs' rotation table) is timm's forward.
    options = dict(img_size=32, patch_size=4, embed_dim=width, num_heads=2, depth=2, num_classes=5, **overrides)
    torch.manual_seed(0)
    dynamic = timm.create_model(name, **options).eval()
    with pytest.raises(ValueError, match=r"create it with dynamic_img_size=False"):
        petl.apply(dynamic, "lora")
    fixed = timm.create_model(name, dynamic_img_size=False, **options).eval()
    fixed.load_state_dict(dynamic.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(fixed(images), dynamic(images))
        model = petl.apply(fixed, "lora", targets=["q", "v", "fc2"], rank=2).eval()
        for param_name, param in model.named_parameters():
            if any(key in param_name for key in ("lora_b", "gamma", "head")):  # LoRA and the 1e-5 layer scales act
                param.normal_(0.0, 0.5)
        bb = backbone_of(model)
        x, inputs = bb.embed_tokens(images), bb.block_inputs()
        for index, block in enumerate(bb.block_list()):
            x = bb.run_block(block, x, inputs=inputs, index=index)
        torch.testing.assert_close(bb.head()(bb.pooled_features(x)), model(images), atol=1e-5, rtol=1e-5)
        assert not torch.allclose(model(images), dynamic(images), atol=1e-3)


@pytest.mark.parametrize("family", ["eva02", "eva_rope_mixed", "naflexvit_rope_mixed"])
def test_patch_dropout_under_a_rotary_embedding_trains_as_timm_and_petls_block_path_refuses_it(images, family):
    # timm's forward takes the rotary table's rows of the patch tokens it keeps; petl's block path (embed_tokens,
    # then run_block with block_inputs) hands the blocks the whole grid's table.  No petl path takes the block path
    # in train mode (a MultiTask stays in eval mode; a feature cache is never kept where the backbone trains), and
    # embed_tokens refuses it, so that none silently does.
    plain = make_tiny_family(family, patch_drop_rate=0.5).train()
    model = petl.apply(make_tiny_family(family, patch_drop_rate=0.5), "lora").train()
    torch.manual_seed(5)
    want = plain(images)
    torch.manual_seed(5)
    torch.testing.assert_close(model(images), want)  # LoRA starts unchanged: timm's forward, patches dropped
    bb = backbone_of(model)
    with pytest.raises(ValueError, match=r"drops patch tokens in training \(timm's patch_drop_rate=0.5\) and rot"):
        bb.embed_tokens(images)
    bb.model.eval()  # nothing dropped: the whole grid, as block_inputs' table
    assert bb.embed_tokens(images).shape[1] == bb.num_tokens()
