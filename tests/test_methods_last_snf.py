"""LAST and SNF: their forwards against independent re-implementations, counts, and what they skip in the backward.

The registry-parametrized contract tests (tests/test_methods.py) cover them like every method.  The
re-implementations below are written from the paper (LAST, no reference code) and from the reference code
(SNF: Wang-Yaoming/SNF@a6f85b1), on the same weights as petl's modules, sharing no code with petl's methods.
"""

from __future__ import annotations

import math

import pytest
import timm
import torch
import torch.nn.functional as F
from conftest import perturb_trainable

import petl
from petl import vit


def _embed(model: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    """Patch embedding, prefix tokens and position embedding, as timm runs them before the blocks."""
    return model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(images))))


def _head(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model.forward_head(model.norm(x))


def _outputs_requiring_grad(model: torch.nn.Module, images: torch.Tensor) -> list[bool]:
    """Per original block, whether its output takes part in the backward of a training forward."""
    seen: list[bool] = []
    handles = [
        block.register_forward_hook(lambda _m, _args, out: seen.append(out.requires_grad))
        for block in vit.blocks(model)
    ]
    model.train()
    F.cross_entropy(model(images), torch.zeros(images.shape[0], dtype=torch.long)).backward()
    for handle in handles:
        handle.remove()
    return seen


def _vit_b() -> torch.nn.Module:
    return timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=0)


# --- LAST --------------------------------------------------------------------------------------


def _lsa(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    # Tang et al. 2024, section 3: X' = LN(X); Q, K, V = X'A_Q, X'A_K, X'A_V in r dimensions; attention there,
    # projected back up to d and added to X; no feed-forward network.
    n = F.layer_norm(x, x.shape[-1:], layer.norm.weight, layer.norm.bias, eps=1e-6)
    q, k, v = n @ layer.q.weight.T, n @ layer.k.weight.T, n @ layer.v.weight.T
    weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
    return x + (weights @ v) @ layer.up.weight.T


def _last_forward(model, side, plain_blocks, images, gap):
    # z_0: the embedded tokens; z_i: the output of the i-th group of `gap` blocks.  u_0 = F_0(z_0),
    # u_i = F_i(u_{i-1} + z_i); the output is u_m - (z_0 + ... + z_{m-1}) (the paper's bias correction).
    z = [_embed(model, images)]
    x = z[0]
    for i, block in enumerate(plain_blocks):
        x = block(x)
        if (i + 1) % gap == 0:
            z.append(x)

    def lsa_block(i, x):
        for layer in side.lsa[i]:
            x = _lsa(layer, x)
        return x

    u = lsa_block(0, z[0])
    for i in range(1, len(z)):
        u = lsa_block(i, u + z[i])
    return _head(model, u - sum(z[:-1]))


@pytest.mark.parametrize(
    ("options", "last"),
    [
        ({}, {}),
        ({"reg_tokens": 2}, {"gap": 3, "layers": 2, "rank": 3}),
        ({"class_token": False, "global_pool": "avg"}, {"rank": 5, "layers": 2}),
    ],
)
def test_last_equals_the_papers_forward(tiny_vit, images, options, last):
    model = petl.apply(tiny_vit(**options), "last", num_classes=4, **last)
    perturb_trainable(model)
    model.eval()
    side = model.blocks[0].side
    expected = _last_forward(model, side, [b.base for b in model.blocks], images, last.get("gap", 1))
    torch.testing.assert_close(model(images), expected, atol=1e-5, rtol=0)


def test_last_starts_as_the_backbone(tiny_vit, images):
    # up starts at zero: every LSA block passes its input through, and the bias correction leaves z_m.
    backbone = tiny_vit()
    expected = backbone(images)
    model = petl.apply(backbone, "last")
    torch.testing.assert_close(model(images), expected, atol=1e-5, rtol=0)


def test_last_backward_reaches_no_backbone_block(tiny_vit, images):
    # The side network only reads the frozen blocks' outputs: no gradient flows through the backbone.
    model = petl.apply(tiny_vit(), "last", num_classes=4)
    perturb_trainable(model)
    assert _outputs_requiring_grad(model, images) == [False, False, False]
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_last_counts_the_published_figure_on_vit_b():
    # 13 LSA blocks (F_0 and one per block) of 4 x 768 x 16 + 2 x 768: 658,944 = the published 0.66M.
    model = _vit_b()
    assert petl.count_params(petl.apply(model, "last")).trainable_no_head == 13 * (4 * 768 * 16 + 2 * 768) == 658_944


def test_last_rejects_bad_options(tiny_vit):
    for options, field in [({"rank": 0}, "rank"), ({"gap": 2}, "gap"), ({"gap": 4}, "gap"), ({"layers": 0}, "layers")]:
        with pytest.raises(ValueError, match=field):
            petl.apply(tiny_vit(), "last", **options)
