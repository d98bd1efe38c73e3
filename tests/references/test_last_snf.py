"""LAST and SNF: their forwards against independent re-implementations, counts, and what they skip in the backward.

The registry-parametrized contract tests (tests/methods/test_method_contracts.py) cover them like every method.  The
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
from petl.model.backbone import backbone_of


def _embed(model: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    """Patch embedding, prefix tokens and position embedding, as timm runs them before the blocks."""
    return model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(images))))


def _head(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model.forward_head(model.norm(x))


def _outputs_requiring_grad(model: torch.nn.Module, images: torch.Tensor, wrappers: bool = False) -> list[bool]:
    """Per original block (or per wrapper, for wrappers that run their block's parts), whether its output takes
    part in the backward of a training forward."""
    seen: list[bool] = []
    handles = [
        block.register_forward_hook(lambda _m, _args, out: seen.append(out.requires_grad))
        for block in (model.blocks if wrappers else backbone_of(model).block_list())
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


# --- SNF ---------------------------------------------------------------------------------------


def _flow(flow: torch.nn.Module, z: torch.Tensor) -> torch.Tensor:
    # Wang-Yaoming/SNF@a6f85b1 flow.py L21-30: AffineTransform (L38-41, mu + exp(logsigma) * x), then each
    # PlanarFlow (L61-64, z + scale * tanh(F.linear(z, weight (1 x d), bias (1)))) in order; petl stacks flow k's
    # tensors as row k.
    z = flow.mu + torch.exp(flow.log_sigma) * z
    planar = flow.planar  # an Identity for flow_length 0
    rows = [] if isinstance(planar, torch.nn.Identity) else zip(planar.weight, planar.scale, planar.bias, strict=True)
    for weight, scale, bias in rows:
        z = z + scale[None] * torch.tanh(F.linear(z, weight[None], bias[None]))
    return z


def _snf_forward(model, images):
    # snf.py L11-18: x = flow(x) + attention(ln_1(x)); x = flow2(x) + mlp(ln_2(x)), timm's layer scale and drop
    # path in place (an identity here) as on every timm block.
    x = _embed(model, images)
    for wrapper in model.blocks:
        b = wrapper.base
        x = _flow(wrapper.flow_attn, x) + b.ls1(b.attn(b.norm1(x)))
        x = _flow(wrapper.flow_mlp, x) + b.ls2(b.mlp(b.norm2(x)))
    return _head(model, x)


@pytest.mark.parametrize(
    ("options", "flow_length"),
    [({}, 16), ({"reg_tokens": 2, "init_values": 0.5}, 3), ({"class_token": False, "global_pool": "avg"}, 0)],
)
def test_snf_equals_reference(tiny_vit, images, options, flow_length):
    model = petl.apply(tiny_vit(**options), "snf", num_classes=4, flow_length=flow_length)
    perturb_trainable(model)
    model.eval()
    torch.testing.assert_close(model(images), _snf_forward(model, images), atol=1e-5, rtol=0)


@pytest.mark.parametrize("length", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_snf_fused_flows_give_autograds_values_and_gradients(dtype, length):
    # PlanarFlows computes the flows from the chain's input by matrix products and walks the recurrence back by
    # hand; values and gradients must be those of autograd through the flows written out (_flow), to float
    # rounding, for the tokens and every tensor, also without autograd.
    from petl.methods.snf import ShortcutFlow

    torch.manual_seed(0)
    flow = ShortcutFlow(12, length, dtype=dtype)
    with torch.no_grad():
        for t in flow.parameters():
            t.normal_(0, 0.3)  # far from the near-identity init, so every term counts
    z = torch.randn(2, 7, 12, dtype=dtype, requires_grad=True)
    if dtype == torch.float64:
        assert torch.autograd.gradcheck(flow, (z,))
    tensors = [z, *flow.parameters()]
    target = torch.randn(2, 7, 12, dtype=dtype)
    got = torch.autograd.grad((flow(z) * target).sum(), tensors)
    want = torch.autograd.grad((_flow(flow, z) * target).sum(), tensors)
    torch.testing.assert_close(flow(z), _flow(flow, z))
    with torch.no_grad():
        torch.testing.assert_close(flow(z), _flow(flow, z))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_snf_flows_run_in_float32_under_bf16_autocast():
    from petl.methods.snf import ShortcutFlow

    flow, z = ShortcutFlow(8, 3), torch.randn(3, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = flow(z)
    assert out.dtype == torch.float32
    out.sum().backward()
    assert z.grad is not None and all(t.grad is not None and t.grad.dtype == torch.float32 for t in flow.parameters())


def test_snf_init_is_the_references(tiny_vit):
    # flow.py L35-36 (mu, logsigma zero) and L55-59 (weight, scale, bias uniform(-0.01, 0.01)).
    flow = petl.apply(tiny_vit(), "snf").blocks[1].flow_mlp
    assert not flow.mu.any() and not flow.log_sigma.any()
    planar = flow.planar
    assert planar.weight.shape == planar.scale.shape == (16, 48) and planar.bias.shape == (16,)
    for values in (planar.weight, planar.scale):
        assert values.abs().max() <= 0.01 and values.std() > 0.003
    assert planar.bias.abs().max() <= 0.01 and planar.bias.std() > 0.003


def test_snf_counts_the_reference_default_on_vit_b():
    # 24 flows of 2 x 768 + 16 x (2 x 768 + 1); flow_length 0 leaves the affine maps: 36,864, the paper's 0.036M.
    assert petl.count_params(petl.apply(_vit_b(), "snf")).trainable_no_head == 24 * (2 * 768 + 16 * 1537) == 627_072
    assert petl.count_params(petl.apply(_vit_b(), "snf", flow_length=0)).trainable_no_head == 36_864


def test_snf_backward_reaches_every_block(tiny_vit, images):
    # The flows sit in every block's residual stream: the backward runs through the whole backbone.
    model = petl.apply(tiny_vit(), "snf", num_classes=4)
    assert _outputs_requiring_grad(model, images, wrappers=True) == [True, True, True]


def test_snf_rejects_bad_options(tiny_vit):
    with pytest.raises(ValueError, match="flow_length"):
        petl.apply(tiny_vit(), "snf", flow_length=-1)


def test_snf_rows_in_a_multitask_batch_equal_their_own_model(tiny_vit, tmp_path):
    # The row hook swaps each half's identity shortcut for the task's flow (pre keeps the block input for mid):
    # a batch of SNF rows only, and one mixed with VPT-deep rows (prompt slots), give each row its own logits.
    backbone, files, singles = tiny_vit(), {}, {}
    for seed, (name, options) in enumerate([("snf", {"flow_length": 2}), ("vpt", {"deep": True, "num_tokens": 2})]):
        singles[name] = petl.apply(tiny_vit(), name, num_classes=3, **options)
        perturb_trainable(singles[name], seed=seed)
        singles[name].eval()
        files[name] = tmp_path / f"{name}.safetensors"
        petl.save_trainable(singles[name], files[name])
    multi = petl.MultiTask(backbone, files)
    images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    for ids in (["snf"] * 4, ["vpt", "snf", "snf", "vpt"]):
        with torch.no_grad():
            out = multi(images, ids)
            for row, task in enumerate(ids):
                torch.testing.assert_close(out[row], singles[task](images[row : row + 1])[0], atol=2e-5, rtol=1e-4)
