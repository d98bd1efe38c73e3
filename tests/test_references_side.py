"""Side-tuning methods against re-implementations of their references' forwards (as tests/test_references.py).

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
