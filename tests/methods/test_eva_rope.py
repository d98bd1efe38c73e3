"""timm's rope ViTs (``vit_*_patch16_rope_*``: an Eva whose blocks run ``AttentionRope``) through the eva backbone.

The method contracts run on a tiny one (``eva_rope`` in ``TINY_FAMILIES``); here LoRA's forward is checked against
timm's ``AttentionRope`` forward written out by hand, and the per-block (``mixed``) variant's refusal.
"""

from __future__ import annotations

import pytest
import timm
import torch
from conftest import TINY_VIT, make_tiny_family

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


def test_lora_on_a_rope_vit_is_timms_attention_rope_plus_the_update(images):
    model = petl.apply(make_tiny_family("eva_rope"), "lora", targets=["q", "v"], rank=2, alpha=4.0).eval()
    bb = backbone_of(model)
    assert all(type(b.attn).__name__ == "AttentionRope" for b in bb.block_list())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_b" in name:  # zero at init: the update must act
                param.normal_(0.0, 0.5)
        rope = model.rope.get_embed()
        x = bb.embed_tokens(images)
        for block in bb.block_list():
            x = _reference_block(block, x, rope, bb.linear(block, "qkv"), bb.num_prefix_tokens())
        want = bb.head()(bb.pooled_features(x))
        torch.testing.assert_close(model(images), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(petl.merge(model)(images), want, atol=1e-5, rtol=1e-5)
        # The update acts: without it the logits differ.
        assert not torch.allclose(make_tiny_family("eva_rope")(images), want, atol=1e-3)


def test_a_rope_vit_with_a_rotary_embedding_per_block_is_refused_in_one_line():
    # rope_type='mixed' passes block i its own learnable rotation; petl passes every block one.
    options = {**TINY_VIT, "num_classes": 5}
    model = timm.create_model("vit_small_patch16_rope_mixed_224", pretrained=False, **options)
    with pytest.raises(ValueError, match="rope_type='mixed'") as refused:
        petl.apply(model, "lora")
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("method", ["bitfit", "lora", "ssf"])
def test_a_wrapper_on_attention_ropes_qkv_keeps_timms_own_forward(method):
    # AttentionRope calls qkv (its biases inside it): nothing is switched on it, and BitFit trains qkv's own bias.
    model = petl.apply(make_tiny_family("eva_rope"), method)
    bb = backbone_of(model)
    for block in bb.block_list():
        assert not hasattr(block.attn, "qkv_bias_separate")
        if method == "bitfit":
            assert bb.linear(block, "qkv").bias.requires_grad
