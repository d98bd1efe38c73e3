"""timm's NaFlexVit (``naflexvit_*``) through the naflexvit backbone.

The method contracts, ``MultiTask`` and the export run on a tiny one (``naflexvit`` in ``TINY_FAMILIES``); here
LoRA's forward is checked against timm's written out from the weights (the image cut into patches, the Linear patch
projection, the position grid resampled, the register tokens, the blocks, the masked average pooling), and the
backbone's block-by-block run and its feature-cache replay against timm's logits.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import make_tiny_family

import petl
from petl import backbone_of


def _embed(model: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    """timm's NaFlexEmbeds on a plain image tensor: 4x4 patches flattened (row, column, channel), the Linear, the
    learned 16x16 position grid resampled bicubic (antialiased) to the 8x8 one, the register tokens in front.
    """
    embeds = model.embeds
    b, c, h, w = images.shape
    p = embeds.patch_size[0]
    patches = images.view(b, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1).reshape(b, (h // p) * (w // p), -1)
    x = patches @ embeds.proj.weight.t() + embeds.proj.bias
    grid = F.interpolate(
        embeds.pos_embed.permute(0, 3, 1, 2), size=(h // p, w // p), mode="bicubic", align_corners=False, antialias=True
    )
    x = x + grid.flatten(2).transpose(1, 2)
    return torch.cat([embeds.reg_token.expand(b, -1, -1), x], dim=1)


def _block(block: torch.nn.Module, x: torch.Tensor, lora: torch.nn.Module) -> torch.Tensor:
    """timm's pre-norm Block with LoRA's update on qkv's Q and V rows, from the weights alone."""
    width, heads = x.shape[-1], block.attn.num_heads
    h = block.norm1(x)
    qkv = h @ lora.base.weight.t() + lora.base.bias
    for part, index in (("q", 0), ("v", 2)):
        update = (h @ lora.lora_a[part].t() @ lora.lora_b[part].t()) * lora.scale
        qkv = qkv + F.pad(update, (index * width, (2 - index) * width))
    b, n, _ = x.shape
    q, k, v = qkv.reshape(b, n, 3, heads, width // heads).permute(2, 0, 3, 1, 4)
    weights = ((q @ k.transpose(-2, -1)) * (width // heads) ** -0.5).softmax(dim=-1)
    out = (weights @ v).transpose(1, 2).reshape(b, n, width)
    x = x + block.ls1.gamma * (out @ block.attn.proj.weight.t() + block.attn.proj.bias)
    return x + block.ls2.gamma * block.mlp(block.norm2(x))


def test_lora_on_a_naflexvit_is_timms_forward_written_out(images):
    model = petl.apply(make_tiny_family("naflexvit"), "lora", targets=["q", "v"], rank=2, alpha=4.0).eval()
    bb = backbone_of(model)
    assert bb.kind == "naflexvit" and bb.grid_size() == (8, 8) and bb.num_prefix_tokens() == 4
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_b" in name:  # zero at init: the update must act
                param.normal_(0.0, 0.5)
        x = _embed(model, images)
        for block in bb.block_list():
            x = _block(block, x, bb.linear(block, "qkv"))
        # fc_norm=True: no norm before the pooling, the average over the patch tokens (registers left out), fc_norm.
        want = model.head(model.fc_norm(x[:, 4:].mean(dim=1)))
        torch.testing.assert_close(model(images), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(petl.merge(model)(images), want, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(make_tiny_family("naflexvit")(images), want, atol=1e-3)


@pytest.mark.parametrize("pool", ["avg", "map", "max", "token"])
def test_blocks_run_one_by_one_and_the_cache_replay_give_timms_logits(images, pool):
    # map: timm's attention pool over the patch tokens (registers left out), the final norm before it; token: a class
    # token in front of the registers (the RADIO models').
    options = {"global_pool": pool, "fc_norm": pool == "avg", "class_token": pool == "token"}
    model = petl.apply(make_tiny_family("naflexvit", **options), "adapter", dim=4)
    model.eval()
    for p in model.parameters():
        if p.requires_grad:
            p.data.normal_(0.0, 0.1)
    bb = backbone_of(model)
    assert bb.pool_type() == pool
    with torch.no_grad():
        want = model(images)
        x = bb.embed_tokens(images)
        inputs = [x]
        for i, block in enumerate(bb.block_container()):
            x = bb.run_block(block, x, index=i)
            inputs.append(x)
        torch.testing.assert_close(bb.head()(bb.pooled_features(x)), want, atol=0, rtol=0)
        # What the feature cache replays from each cut: the blocks' inputs as block_input_module sees them.
        for start, tokens in enumerate(inputs):
            torch.testing.assert_close(bb.forward_from(tokens, start), want, atol=0, rtol=0)
        # Tokens marked False leave the pooling as if they were not in the sequence (a MultiTask's prompt slots).
        keep = torch.ones(x.shape[:2], dtype=torch.bool)
        keep[:, 5:8] = False
        cut = torch.cat([x[:, :5], x[:, 8:]], dim=1)
        torch.testing.assert_close(bb.pooled_features(x, keep), bb.pooled_features(cut), atol=1e-5, rtol=0)


# timm builds EvaBlocks in a NaFlexVit for a rotary embedding (axial, learnt per block, DINOv3's), EVA's attention
# (q/v biases beside qkv) or a SwiGLU MLP; the per-block rotation (rope_is_mixed) is also a TINY_FAMILIES entry.
EVA_BLOCKS = {
    "axial": {"rope_type": "axial"},
    "mixed": {"rope_type": "mixed"},
    "dinov3": {"rope_type": "dinov3", "rope_rotate_half": True, "class_token": True, "global_pool": "token"},
    "eva_swiglu": {"attn_type": "eva", "swiglu_mlp": True},
}


@pytest.mark.parametrize("options", EVA_BLOCKS.values(), ids=EVA_BLOCKS)
def test_eva_blocks_run_one_by_one_and_the_cache_replay_give_timms_logits(images, options):
    # They were refused ("block 0 of NaFlexVit is a EvaBlock ... not taken yet"): the blocks take the rotation timm
    # computes for the image's grid, block i its own rows where it is learnt per block.
    model = petl.apply(make_tiny_family("naflexvit", **options), "lora", targets=["q", "v", "proj"], rank=2).eval()
    bb = backbone_of(model)
    assert bb.kind == "naflexvit" and type(bb.block_list()[0]).__name__ == "EvaBlock"
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_b" in name:  # zero at init: the update must act
                param.normal_(0.0, 0.5)
        want = model(images)
        x = bb.embed_tokens(images)
        inputs, rope = [x], bb.block_inputs()
        for i, block in enumerate(bb.block_container()):
            x = bb.run_block(block, x, inputs=rope, index=i)
            inputs.append(x)
        torch.testing.assert_close(bb.head()(bb.pooled_features(x)), want, atol=1e-5, rtol=1e-5)
        for start, tokens in enumerate(inputs):
            torch.testing.assert_close(bb.forward_from(tokens, start), want, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(make_tiny_family("naflexvit", **options)(images), want, atol=1e-3)


def test_a_naflexvit_with_gated_attention_is_refused_in_one_line():
    model = make_tiny_family("naflexvit", attn_gated=True)
    with pytest.raises(ValueError, match=r"block 0 of NaFlexVit has a gated attention .*: create it without") as e:
        petl.apply(model, "lora")
    assert "\n" not in str(e.value) and getattr(model, "petl_method", None) is None
