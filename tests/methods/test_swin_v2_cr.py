"""timm's SwinTransformerV2Cr (``swinv2_cr_*``) through the ``swinv2_cr`` backbone.

The method contracts, MultiTask and export run on a tiny one (``swinv2_cr`` in ``TINY_MODELS``, each stage ending
with a third norm, ``norm3``); here LoRA's forward is checked against timm's blocks written out by hand (shifted
windows, cosine attention with ``logit_scale``, the ``meta_mlp`` position bias, post-norms, ``norm3``), and where
the final norm (the last block's ``norm3``) sits for the methods that name it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from conftest import make_tiny_swinv2_cr, perturb_trainable

import petl
from petl import backbone_of
from petl.methods.adapter import ParallelAdapter


def _windows(x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """(B, H, W, C) to (B * windows, window area, C), windows in row-major order within each image."""
    b, h, w, c = x.shape
    x = x.view(b, h // size[0], size[0], w // size[1], size[1], c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, size[0] * size[1], c)


def _unwindows(x: torch.Tensor, size: tuple[int, int], grid: tuple[int, int]) -> torch.Tensor:
    """The inverse of :func:`_windows`."""
    h, w = grid
    x = x.view(-1, h // size[0], w // size[1], size[0], size[1], x.shape[-1]).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, h, w, x.shape[-1])


def _reference_block(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """One SwinTransformerV2CrBlock with LoRA's update on qkv's Q and V rows, from the weights alone."""
    attn, lora = block.attn, block.attn.qkv
    b, h, w, c = x.shape
    heads, size, shift = attn.num_heads, block.window_size, block.shift_size
    shifted = torch.roll(x, shifts=(-shift[0], -shift[1]), dims=(1, 2)) if any(shift) else x
    tokens = _windows(shifted, size)
    qkv = tokens @ lora.base.weight.t() + lora.base.bias
    for part, index in (("q", 0), ("v", 2)):
        update = (tokens @ lora.lora_a[part].t() @ lora.lora_b[part].t()) * lora.scale
        qkv = qkv + F.pad(update, (index * c, (2 - index) * c))
    n = tokens.shape[1]
    q, k, v = qkv.view(-1, n, 3, heads, c // heads).permute(2, 0, 3, 1, 4)
    # Cosine attention scaled per head by exp(logit_scale) (at most 100), plus the meta MLP's bias over the window.
    logits = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
    logits = logits * attn.logit_scale.clamp(max=math.log(100.0)).exp().view(1, heads, 1, 1)
    logits = logits + attn.meta_mlp(attn.relative_coordinates_log).t().reshape(1, heads, n, n)
    if block.attn_mask is not None:
        mask = block.attn_mask
        logits = (logits.view(b, mask.shape[0], heads, n, n) + mask[None, :, None]).view(-1, heads, n, n)
    out = (logits.softmax(dim=-1) @ v).transpose(1, 2).reshape(-1, n, c)
    out = _unwindows(out @ attn.proj.weight.t() + attn.proj.bias, size, (h, w))
    out = torch.roll(out, shifts=shift, dims=(1, 2)) if any(shift) else out
    x = x + block.norm1(out)
    return block.norm3(x + block.norm2(block.mlp(x)))


def test_lora_on_a_swinv2_cr_is_timms_blocks_plus_the_update(images):
    model = petl.apply(make_tiny_swinv2_cr(), "lora", targets=["q", "v"], rank=2, alpha=4.0).eval()
    perturb_trainable(model)
    bb = backbone_of(model)
    assert bb.kind == "swinv2_cr"
    with torch.no_grad():
        x = model.patch_embed(images).permute(0, 2, 3, 1)  # the stages take NCHW and run their blocks on NHWC
        for stage in model.stages:
            x = stage.downsample(x)
            for block in stage.blocks:
                x = _reference_block(block, x)
        # The last block's norm3 is the model's final norm; the head averages the grid.
        want = model.head.fc(x.mean(dim=(1, 2)))
        torch.testing.assert_close(model(images), want, atol=1e-5, rtol=1e-5)
        # The update acts: without it, the logits differ.
        assert not torch.allclose(make_tiny_swinv2_cr()(images), want, atol=1e-3)


def test_the_final_norm_is_the_last_blocks_norm3_for_ssf_ln_and_partial(images):
    plain = make_tiny_swinv2_cr()
    bb = backbone_of(plain)
    last = bb.block_list()[-1]
    assert bb.named_final_norms() == [("stages.1.blocks.1.norm3", last.norm3)] and bb.after_blocks() == []
    # SSF follows it (a scale and shift after the model's final norm); LN tuning and Partial-1 train it.
    ssf = petl.apply(make_tiny_swinv2_cr(), "ssf")
    assert type(backbone_of(ssf).block_list()[-1].norm3).__name__ == "SsfLayer"
    for method, options in (("ln", {}), ("partial", {"k": 1})):
        model = petl.apply(make_tiny_swinv2_cr(), method, **options)
        trained = {name for name, p in model.named_parameters() if p.requires_grad}
        assert {"stages.1.blocks.1.norm3.weight", "stages.1.blocks.1.norm3.bias"} <= trained, method
    # LN tuning also trains the stage-ending norm3 of the first stage (the _ns models').
    ln = petl.apply(make_tiny_swinv2_cr(), "ln")
    assert ln.stages[0].blocks[1].norm3.weight.requires_grad


def test_the_parallel_adapter_joins_the_blocks_output_after_norm3(images):
    # AdaptFormer's branch reads the stream entering the MLP half and adds to what the block hands on: after norm3,
    # where a block has one (docs/backbones.md says why).
    model = petl.apply(make_tiny_swinv2_cr(), "adapter", style="parallel", dim=4).eval()
    perturb_trainable(model)
    bb = backbone_of(model)
    wrapper = bb.block_container()[1]
    assert isinstance(wrapper, ParallelAdapter) and not isinstance(wrapper.base.norm3, torch.nn.Identity)
    grid = torch.randn(2, 8, 8, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mid = bb.attn_residual(wrapper.base, grid)
        want = wrapper.base.norm3(mid + bb.mlp_branch(wrapper.base, mid)) + wrapper.adapter(mid)
        torch.testing.assert_close(wrapper(grid), want)
