"""Reference-equivalence and count tests of Hydra, Adapter+, SCT, Convpass and the DoRA/IA3 peft presets.

Each reference test re-implements the reference forward in a few lines (from the file:line cited in
the method's module) and runs it on the very weights petl's modules hold.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import perturb_trainable

import petl
from petl.methods.hydra import HydraLinear


def _formula(vit_base, method, **options) -> int:
    return petl.get_method(method).trainable_formula(vit_base, petl.make_config(method, **options))


# --- Hydra -------------------------------------------------------------------------------------


def _reference_hydra_branch(branch, x, scale):
    # extremebird/Hydra vtab1k/hydra.py L59-61: up(dropout(down(x))) * scale (dropout off in eval).
    return F.linear(F.linear(x, branch.down.weight, branch.down.bias), branch.up.weight, branch.up.bias) * scale


def _reference_hydra_block(block, x):
    # vtab1k/hydra.py L8-41: the branches read the input (parallel) and output (sequential) of
    # attn.proj and mlp.fc2, and all three terms are summed before the dropout.
    attn, mlp = block.attn, block.mlp
    b, n, c = x.shape
    h = block.norm1(x)
    qkv = F.linear(h, attn.qkv.weight, attn.qkv.bias).reshape(b, n, 3, attn.num_heads, c // attn.num_heads)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    a = ((q * attn.scale) @ k.transpose(-2, -1)).softmax(-1) @ v
    a = a.transpose(1, 2).reshape(b, n, c)
    proj = attn.proj
    y = F.linear(a, proj.base.weight, proj.base.bias)
    x = (
        x
        + y
        + _reference_hydra_branch(proj.parallel, a, proj.scale)
        + _reference_hydra_branch(proj.sequential, y, proj.scale)
    )
    h = mlp.act(mlp.fc1(block.norm2(x)))
    fc2 = mlp.fc2
    y = F.linear(h, fc2.base.weight, fc2.base.bias)
    return (
        x
        + y
        + _reference_hydra_branch(fc2.parallel, h, fc2.scale)
        + _reference_hydra_branch(fc2.sequential, y, fc2.scale)
    )


def test_hydra_matches_reference_forward(tiny_vit):
    model = petl.apply_hydra(tiny_vit(), scale=0.7).eval()
    perturb_trainable(model)
    x = torch.randn(2, 17, 48)
    for block in model.blocks:
        assert isinstance(block.attn.proj, HydraLinear) and isinstance(block.mlp.fc2, HydraLinear)
        torch.testing.assert_close(block(x), _reference_hydra_block(block, x), atol=1e-5, rtol=1e-5)


def test_hydra_merge_matches_reference_reparameterize(tiny_vit):
    model = petl.apply_hydra(tiny_vit(), scale=0.3)
    perturb_trainable(model)
    fc2 = model.blocks[0].mlp.fc2
    with torch.no_grad():
        fc2.base.bias.normal_()  # timm starts biases at zero, which would hide a wrong bias fold
    # hydra.py L65-74 in nn.Linear's (out, in) layout: W = W0 + s (Wp + Ws W0), b = b0 + s (Ws b0 + bp + bs).
    wp = fc2.parallel.up.weight @ fc2.parallel.down.weight
    bp = fc2.parallel.up.weight @ fc2.parallel.down.bias + fc2.parallel.up.bias
    ws = fc2.sequential.up.weight @ fc2.sequential.down.weight
    bs = fc2.sequential.up.weight @ fc2.sequential.down.bias + fc2.sequential.up.bias
    w0, b0 = fc2.base.weight.clone(), fc2.base.bias.clone()
    petl.merge(model)
    torch.testing.assert_close(fc2.base.weight, w0 + 0.3 * (wp + ws @ w0), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(fc2.base.bias, b0 + 0.3 * (ws @ b0 + bp + bs), atol=1e-6, rtol=1e-5)


def test_hydra_init_dropout_and_merge_guards(tiny_vit, images):
    model = petl.apply_hydra(tiny_vit(), dropout=0.5)
    proj = model.blocks[0].attn.proj
    assert proj.parallel.up.weight.abs().sum() == 0 and proj.parallel.down.weight.abs().sum() > 0
    assert isinstance(petl.apply_hydra(tiny_vit(), dropout=0.0).blocks[0].attn.proj.parallel.dropout, torch.nn.Identity)
    perturb_trainable(model)
    model.train()
    assert not torch.equal(model(images), model(images))
    with torch.no_grad():
        proj.sequential.up.weight[0, 0] = float("inf")
    before = proj.base.weight.clone()
    bias = proj.base.bias.clone()
    # The refusal every re-parameterisable method gives (petl.methods._reparam), weight and bias both left as they were
    with pytest.raises(ValueError, match="refusing to merge Hydra into the weight and bias: it holds non-finite"):
        proj.merge()
    assert torch.equal(proj.base.weight, before) and torch.equal(proj.base.bias, bias) and not proj.merged


def test_hydra_merge_upcasts_half_weights(tiny_vit, images):
    model = petl.apply_hydra(tiny_vit(), scale=0.5)
    perturb_trainable(model)
    model = model.to(torch.bfloat16)
    unmerged = model(images.bfloat16()).float()
    petl.merge(model)
    merged = model(images.bfloat16()).float()
    assert (merged - unmerged).abs().max() < 0.1
    assert model.blocks[0].mlp.fc2.base.weight.dtype == torch.bfloat16


def test_hydra_rejects_bad_options(tiny_vit):
    with pytest.raises(ValueError, match="targets"):
        petl.apply_hydra(tiny_vit(), targets=["qkv"])
    with pytest.raises(ValueError, match="scale"):
        petl.apply_hydra(tiny_vit(), scale=0.0)
    with pytest.raises(ValueError, match="dim"):
        petl.apply_hydra(tiny_vit(), dim=0)


def test_hydra_vit_base_count(vit_base):
    # 239,712 without the head; V-PETL's 0.28M includes the average VTAB-1k head (see hydra.yaml).
    assert _formula(vit_base, "hydra") == 12 * (2 * (3072 + 3 * 768) + 4 + 1536 + 2 * (768 + 3 * 768) + 4 + 1536)
    assert _formula(vit_base, "hydra") == 239_712
    model = petl.apply(copy.deepcopy(vit_base), "hydra", num_classes=10)
    assert petl.count_params(model).trainable_no_head == 239_712


# --- peft presets: DoRA and IA3 ----------------------------------------------------------------


def test_peft_preset_counts_are_closed_form(vit_base, monkeypatch):
    from petl.methods import peft_bridge

    def refuse(*_args):
        raise AssertionError("counted by injecting into a copy")

    monkeypatch.setattr(peft_bridge, "_count_by_injecting", refuse)
    # DoRA: rank-8 A and B on qkv plus one magnitude per output row; IA3: a scale per qkv output and per fc2 input.
    assert _formula(vit_base, "peft", **peft_bridge.PRESETS["dora"]) == 12 * (8 * (768 + 2304) + 2304) == 322_560
    assert _formula(vit_base, "peft", **peft_bridge.PRESETS["ia3"]) == 12 * (2304 + 3072) == 64_512
    ia3_regex = {"peft_type": "IA3", "target_modules": ["qkv", "fc2"], "options": '{"feedforward_modules": ".*fc2"}'}
    assert _formula(vit_base, "peft", **ia3_regex) == 64_512


@pytest.mark.parametrize("preset", ["dora", "ia3"])
def test_peft_preset_counts_match_the_injected_model(tiny_vit, preset):
    from petl.methods.peft_bridge import PRESETS

    model = petl.apply(tiny_vit(), "peft", num_classes=4, **PRESETS[preset])
    d, depth = 48, 3
    expected = {"dora": depth * (8 * (d + 3 * d) + 3 * d), "ia3": depth * (3 * d + 4 * d)}[preset]
    assert petl.count_params(model).trainable_no_head == expected
    assert _formula(tiny_vit(), "peft", **PRESETS[preset]) == expected


def test_ia3_preset_matches_reference_forward(tiny_vit):
    from petl.methods.peft_bridge import PRESETS

    model = petl.apply(tiny_vit(), "peft", **PRESETS["ia3"]).eval()
    perturb_trainable(model)
    x, h = torch.randn(2, 5, 48), torch.randn(2, 5, 192)
    for block in model.blocks:  # every site, each with its own random scales
        qkv, fc2 = block.attn.qkv, block.mlp.fc2
        # IA3 (Liu et al. 2022, eq. in sec. 3.3): l * (W x + b) on attention outputs, W (l * h) + b in the MLP.
        l_qkv, l_fc2 = qkv.ia3_l["default"].flatten(), fc2.ia3_l["default"].flatten()
        base_qkv, base_fc2 = qkv.get_base_layer(), fc2.get_base_layer()
        torch.testing.assert_close(qkv(x), l_qkv * F.linear(x, base_qkv.weight, base_qkv.bias))
        torch.testing.assert_close(fc2(h), F.linear(l_fc2 * h, base_fc2.weight, base_fc2.bias))


def test_dora_preset_matches_reference_forward(tiny_vit):
    from petl.methods.peft_bridge import PRESETS

    model = petl.apply(tiny_vit(), "peft", **PRESETS["dora"]).eval()
    perturb_trainable(model)
    x = torch.randn(2, 5, 48)
    for block in model.blocks:  # every site, each with its own random A, B and magnitudes
        qkv = block.attn.qkv
        base = qkv.get_base_layer()
        a, b = qkv.lora_A["default"].weight, qkv.lora_B["default"].weight
        m = qkv.lora_magnitude_vector["default"].weight
        # DoRA (Liu et al. 2024, eq. 5): W' = m * (W0 + s B A) / ||W0 + s B A|| per output row, s = alpha / r = 1.
        direction = base.weight + b @ a
        weight = m.unsqueeze(1) * direction / direction.norm(dim=1, keepdim=True)
        torch.testing.assert_close(qkv(x), F.linear(x, weight, base.bias), atol=1e-5, rtol=1e-5)


# --- SCT ---------------------------------------------------------------------------------------


def _reference_sct_block(block, x):
    # V-PETL Bench vision_transformer_sct.py L340-346 with ChannelAdapter.forward L295-306:
    # x = x + attn(norm1(x)); x[..., idx] += Linear(x[..., idx]); x = x + mlp(norm2(x)).
    inner, idx = block.base, block.index
    x = x + inner.attn(inner.norm1(x))
    x = x.clone()
    x[..., idx] += F.linear(x[..., idx], block.linear.weight, block.linear.bias)
    return x + inner.mlp(inner.norm2(x))


def test_sct_matches_reference_forward(tiny_vit):
    channels = [[5, 1, 40, 7], [0, 2, 3, 47], [10, 11, 12, 13]]
    model = petl.apply_sct(tiny_vit(), top_n=4, channels=channels)
    perturb_trainable(model)
    x = torch.randn(2, 17, 48)
    for block, chosen in zip(model.blocks, channels, strict=True):
        assert sorted(block.index.tolist()) == sorted(chosen)
        torch.testing.assert_close(block(x), _reference_sct_block(block, x), atol=1e-6, rtol=1e-6)


def _batches(n_batches=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(4, 3, 32, 32, generator=gen), torch.randint(0, 3, (4,), generator=gen)) for _ in range(n_batches)
    ]


def _reference_salient_channels(model, batches, top_n):
    # train_model_sct.py L21-110 (sct_attn): hook blocks.i.norm2's input without the class token,
    # per class the L2 norm over (samples, tokens), mean over classes, keep values above the
    # (d-1-topN)-th smallest.
    features = [[] for _ in model.blocks]
    for i, block in enumerate(model.blocks):
        block.norm2.register_forward_hook(lambda _m, inp, _out, i=i: features[i].append(inp[0][:, 1:]))
    labels = []
    with torch.no_grad():
        for images, targets in batches:
            labels.append(targets)
            model(images)
    labels = torch.cat(labels)
    chosen = []
    for per_layer in features:
        feats = torch.cat(per_layer)
        norms = torch.stack([torch.norm(feats[labels == c], 2, dim=(0, 1)) for c in labels.unique()])
        fea = norms.mean(0)
        threshold = fea.sort().values[fea.numel() - 1 - top_n]
        chosen.append(tuple(torch.nonzero(fea > threshold).flatten().tolist()))
    return tuple(chosen)


def test_sct_selection_matches_reference(tiny_vit):
    from petl.methods.sct import SctConfig, calibrate_sct, select_sct_channels

    batches = _batches()
    expected = _reference_salient_channels(tiny_vit(), batches, top_n=6)
    assert select_sct_channels(tiny_vit(), batches, top_n=6) == expected
    assert calibrate_sct(tiny_vit(), SctConfig(top_n=6), batches).channel_indices() == expected
    # A selection on fewer batches differs (the data matter) and the model is left as it was.
    model = tiny_vit()
    assert select_sct_channels(model, batches, top_n=6, max_batches=1) != expected
    assert not model.training and not model.blocks[0].norm2._forward_pre_hooks


def test_sct_default_placeholder_and_bad_channels(tiny_vit, tmp_path, images):
    model = petl.apply_sct(tiny_vit())
    assert [b.index.tolist() for b in model.blocks] == [list(range(6))] * 3  # 48 // 8, the documented default
    with pytest.raises(ValueError, match="blocks"):
        petl.apply_sct(tiny_vit(), top_n=2, channels=[[0, 1]])
    with pytest.raises(ValueError, match="distinct"):
        petl.apply_sct(tiny_vit(), top_n=2, channels=[[0, 0], [0, 1], [0, 1]])
    with pytest.raises(ValueError, match="outside"):
        petl.apply_sct(tiny_vit(), top_n=2, channels=[[0, 48], [0, 1], [0, 1]])
    with pytest.raises(ValueError, match="top_n"):
        petl.apply_sct(tiny_vit(), top_n=49)
    # Selected channels are part of the recorded config: a fresh backbone gets the same ones back.
    channels = [[1, 2], [3, 4], [5, 47]]
    assert petl.make_config("sct", channels="1, 2; 3,4;5 47").channels == ("1,2", "3,4", "5,47")
    with pytest.raises(ValueError, match="channels"):
        petl.make_config("sct", channels=["1,x"])
    trained = petl.apply_sct(tiny_vit(), top_n=2, channels=channels, num_classes=3)
    perturb_trainable(trained)
    petl.save_trainable(trained, tmp_path / "sct.safetensors")
    fresh = petl.load_trainable(tiny_vit(), tmp_path / "sct.safetensors")
    assert [b.index.tolist() for b in fresh.blocks] == channels
    assert torch.equal(fresh.eval()(images), trained.eval()(images))


def test_sct_vit_base_count(vit_base):
    assert _formula(vit_base, "sct") == 12 * (96 * 96 + 96) == 111_744  # published 0.11M
    model = petl.apply(copy.deepcopy(vit_base), "sct", num_classes=10)
    assert petl.count_params(model).trainable_no_head == 111_744


# --- Adapter+ ----------------------------------------------------------------------------------


def _reference_adapter_plus(block, x):
    # visinf/adapter_plus vit_adapter.py L269-273 (forward_post) with Adapter.forward L91-102:
    # x = block(x); x = x + scaling * bottleneck(x), no norm (norm_layer None), drop path off in eval.
    inner = block.base
    x = x + inner.attn(inner.norm1(x))
    x = x + inner.mlp(inner.norm2(x))
    h = F.gelu(F.linear(x, block.down.weight, block.down.bias))
    return x + F.linear(h, block.up.weight, block.up.bias) * block.scaling


def test_adapter_plus_matches_reference_forward(tiny_vit):
    model = petl.apply_adapter_plus(tiny_vit()).eval()
    perturb_trainable(model)
    x = torch.randn(2, 17, 48)
    for block in model.blocks:
        assert block.scaling.shape == (48,)
        torch.testing.assert_close(block(x), _reference_adapter_plus(block, x), atol=1e-6, rtol=1e-6)


def test_adapter_plus_init_and_drop_path(tiny_vit, images):
    model = petl.apply_adapter_plus(tiny_vit(seed=1))
    block = model.blocks[0]
    # Houlsby init (vit_adapter.py L51-63): truncated normal std 0.01 within two std, zero biases; scales at one.
    for linear in (block.down, block.up):
        assert 0.005 < linear.weight.std() < 0.015 and linear.weight.abs().max() <= 0.02
        assert linear.bias.abs().sum() == 0
    assert torch.equal(block.scaling, torch.ones(48))
    assert not block.training  # follows the eval backbone
    perturb_trainable(model)
    model.train()
    assert not torch.equal(model(images), model(images))  # drop path 0.1 acts in train mode
    assert isinstance(petl.apply_adapter_plus(tiny_vit(), drop_path=0.0).blocks[0].drop_path, torch.nn.Identity)
    with pytest.raises(ValueError, match="scaling"):
        petl.apply_adapter_plus(tiny_vit(), scaling="per-token")


def test_adapter_plus_vit_base_count(vit_base):
    # No V-PETL row: 12 x (2 x 768 x 8 + 8 + 768 + 768) = 165,984 (0.17M) on ViT-B/16.
    assert _formula(vit_base, "adapter_plus") == 165_984
    assert _formula(vit_base, "adapter_plus", scaling="none") == 165_984 - 12 * 768
    model = petl.apply(copy.deepcopy(vit_base), "adapter_plus", num_classes=10)
    assert petl.count_params(model).trainable_no_head == 165_984


# --- Convpass ----------------------------------------------------------------------------------


def _reference_convpass(module, x, grid, dropout=0.0):
    # OSU-MLB/PETL_Vision model/convpass.py L29-50, one class token: down, QuickGELU, the patch
    # tokens as a grid and the class token as a 1x1 image through the same 3x3 conv, QuickGELU,
    # dropout (L46, train mode only), up, x scale.
    def quick_gelu(t):
        return t * torch.sigmoid(1.702 * t)

    b, _, _ = x.shape
    r = module.down.out_features
    h = quick_gelu(F.linear(x, module.down.weight, module.down.bias))
    patches = h[:, 1:].reshape(b, grid, grid, r).permute(0, 3, 1, 2)
    patches = F.conv2d(patches, module.conv.weight, module.conv.bias, padding=1)
    patches = patches.permute(0, 2, 3, 1).reshape(b, grid * grid, r)
    cls = F.conv2d(h[:, :1].reshape(b, 1, 1, r).permute(0, 3, 1, 2), module.conv.weight, module.conv.bias, padding=1)
    h = quick_gelu(torch.cat([cls.permute(0, 2, 3, 1).reshape(b, 1, r), patches], dim=1))
    h = F.dropout(h, dropout, training=dropout > 0)
    return F.linear(h, module.up.weight, module.up.bias) * module.scale


def test_convpass_matches_reference_forward(tiny_vit):
    model = petl.apply_convpass(tiny_vit(), scale=3.0).eval()
    perturb_trainable(model)
    x = torch.randn(2, 17, 48)  # class token + 4x4 patches
    for block in model.blocks:
        inner = block.attn.base, block.mlp.base
        # model/block.py L98-104 / L140-146, parallel mode with the LN "after": both read norm_i(x).
        h = x + inner[0](block.norm1(x)) + _reference_convpass(block.attn, block.norm1(x), 4)
        expected = h + inner[1](block.norm2(h)) + _reference_convpass(block.mlp, block.norm2(h), 4)
        torch.testing.assert_close(block(x), expected, atol=1e-5, rtol=1e-5)


def test_convpass_init_and_token_check(tiny_vit):
    module = petl.apply_convpass(tiny_vit()).blocks[0].attn
    centre = module.conv.weight[:, :, 1, 1]
    assert torch.equal(centre, torch.eye(8)) and module.conv.weight.abs().sum() == 8
    assert module.up.weight.abs().sum() == 0 and module.down.weight.abs().sum() > 0
    xavier = petl.apply_convpass(tiny_vit(), xavier_conv=True).blocks[0].attn.conv.weight
    assert not torch.equal(xavier[:, :, 1, 1], torch.eye(8))
    with pytest.raises(ValueError, match="patch tokens"):
        module.bypass(torch.randn(1, 10, 48))


def test_convpass_vit_base_count(vit_base):
    # No V-PETL row: 12 x 2 x (768*8 + 8 + 8*8*9 + 8 + 8*768 + 768) = 327,552 (0.33M) on ViT-B/16.
    assert _formula(vit_base, "convpass") == 327_552
    model = petl.apply(copy.deepcopy(vit_base), "convpass", num_classes=10)
    assert petl.count_params(model).trainable_no_head == 327_552


def test_convpass_refuses_a_zero_scale(tiny_vit):
    with pytest.raises(ValueError, match="scale=0 switches the bypass off"):
        petl.apply_convpass(tiny_vit(), scale=0.0)


# --- dropout placement in train mode -----------------------------------------------------------
# Each test draws the same random numbers for petl's module and for the reference forward (same seed, the same
# masks drawn in the same order on tensors of the same shape), so a dropout moved to another tensor, or drawn in
# another order, shows as a mismatch; the eval output differing shows that the masks act at all.


def _same_draws(module_forward, reference_forward, seed=7):
    torch.manual_seed(seed)
    out = module_forward()
    torch.manual_seed(seed)
    return out, reference_forward()


def test_hydra_dropout_sits_between_down_and_up_of_each_branch(tiny_vit):
    model = petl.apply_hydra(tiny_vit(), dropout=0.5, scale=0.7)
    perturb_trainable(model)
    proj = model.blocks[0].attn.proj.train()
    x = torch.randn(2, 17, 48)

    def reference():
        # vtab1k/hydra.py L18-41 (par before seq) with Hydra_layer.forward L59-61: up(dropout(down(x))) * scale.
        def branch(module, t):
            h = F.dropout(F.linear(t, module.down.weight, module.down.bias), 0.5, training=True)
            return F.linear(h, module.up.weight, module.up.bias) * proj.scale

        par = branch(proj.parallel, x)
        y = F.linear(x, proj.base.weight, proj.base.bias)
        return y + par + branch(proj.sequential, y)

    out, expected = _same_draws(lambda: proj(x), reference)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, proj.eval()(x))


def test_convpass_dropout_sits_before_the_up_projection(tiny_vit):
    model = petl.apply_convpass(tiny_vit(), dropout=0.5, scale=3.0)
    perturb_trainable(model)
    module = model.blocks[0].mlp.train()
    x = torch.randn(2, 17, 48)
    out, expected = _same_draws(lambda: module.bypass(x), lambda: _reference_convpass(module, x, 4, dropout=0.5))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, module.eval().bypass(x))


def test_adapter_plus_dropout_then_drop_path_then_scaling(tiny_vit):
    from timm.layers import drop_path

    model = petl.apply_adapter_plus(tiny_vit(), dropout=0.5, drop_path=0.5)
    perturb_trainable(model)
    block = model.blocks[0].train()
    block.base.eval()  # the frozen block draws no masks here: only the adapter's are compared
    x = torch.randn(4, 17, 48)

    def reference():
        # visinf/adapter_plus vit_adapter.py L34-40 (Linear, act, Dropout, Linear) and L91-102: drop path on
        # the bottleneck's output, then the scaling, added to the block's output (forward_post, L269-273).
        y = block.base(x)
        h = F.dropout(F.gelu(F.linear(y, block.down.weight, block.down.bias)), 0.5, training=True)
        branch = drop_path(F.linear(h, block.up.weight, block.up.bias), 0.5, training=True)
        return y + branch * block.scaling

    out, expected = _same_draws(lambda: block(x), reference)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(out, block.eval()(x))
