"""SSF on Swin against a small re-implementation of SSF's own Swin code.

The reference is dongzelian/SSF@e94e0e7 ``models/swin_transformer.py`` (cited below as L<n>): its forward is written
out here, window partition, shifted-window mask and relative-position bias included, and run on the frozen weights
of a plain timm SwinTransformer with the scales and shifts petl's model holds, renamed to SSF's parameter names.
A wrong placement, a missing or extra site, or a scale on the wrong axis shows up as a numerical difference or as
a name the two sides do not share.

What SSF's code builds (checked by running it with ``tuning_mode='ssf'``): a scale/shift after the patch projection
and the patch norm (L512-517, L528-531), after each block's norm1 and norm2 (L331-333, L342-344, L374-375), after
qkv and proj (L212-214, L225-227, L253-255), after fc1 and fc2 (L111-114, L118-126) and after the final norm
(L620-621, L681-684).  PatchMerging declares one after its norm (L396-398, L420-422), but the stage hands it the
list of per-block modes (L619, L640, L477), so ``tuning_mode == 'ssf'`` is False there and the released code never
builds it: petl follows the code as it runs, with no scale/shift at patch merging.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
from conftest import REFERENCE_SWIN, make_reference_swin, perturb_trainable
from timm.models.swin_transformer import SwinTransformer
from torch import nn

import petl
from petl.methods.ssf import SsfLayer

# --- SSF's Swin forward, on a timm model's weights -----------------------------------------------------------------


def ssf_ada(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """L550-557: channels last, else channels on dim 1."""
    if x.shape[-1] == scale.shape[0]:
        return x * scale + shift
    return x * scale.view(1, -1, 1, 1) + shift.view(1, -1, 1, 1)


# Swin's own window helpers (SSF's file keeps them as Swin wrote them; so does KMnP/vpt's, which
# test_vpt_swin_reference.py cites and imports from here).


def window_partition(x: torch.Tensor, ws: int) -> torch.Tensor:
    """L133-144."""
    b, h, w, c = x.shape
    x = x.view(b, h // ws, ws, w // ws, ws, c)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, ws, ws, c)


def window_reverse(windows: torch.Tensor, ws: int, h: int, w: int) -> torch.Tensor:
    """L147-161."""
    b = int(windows.shape[0] / (h * w / ws / ws))
    x = windows.view(b, h // ws, w // ws, ws, ws, -1)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(b, h, w, -1)


def relative_position_index(ws: int) -> torch.Tensor:
    """L189-199."""
    coords = torch.stack(torch.meshgrid([torch.arange(ws), torch.arange(ws)], indexing="ij")).flatten(1)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0).contiguous()
    rel[:, :, 0] += ws - 1
    rel[:, :, 1] += ws - 1
    rel[:, :, 0] *= 2 * ws - 1
    return rel.sum(-1)


def shift_mask(h: int, w: int, ws: int, shift: int) -> torch.Tensor | None:
    """L304-325: the shifted windows' -100 mask between regions that were not neighbours."""
    if shift == 0:
        return None
    img_mask = torch.zeros((1, h, w, 1))
    slices = (slice(0, -ws), slice(-ws, -shift), slice(-shift, None))
    cnt = 0
    for hs in slices:
        for wsl in slices:
            img_mask[:, hs, wsl, :] = cnt
            cnt += 1
    windows = window_partition(img_mask, ws).view(-1, ws * ws)
    mask = windows.unsqueeze(1) - windows.unsqueeze(2)
    return mask.masked_fill(mask != 0, -100.0).masked_fill(mask == 0, 0.0)


def window_attention(x, attn, ws, mask, ssf, p):
    """WindowAttention.forward, L218-258 (dropout off)."""
    b_, n, c = x.shape
    heads = attn.num_heads
    qkv = ssf_ada(attn.qkv(x), *ssf[p + "attn.ssf_1"])  # L225-227
    q, k, v = qkv.reshape(b_, n, 3, heads, c // heads).permute(2, 0, 3, 1, 4).unbind(0)
    q = q * (c // heads) ** -0.5  # L182-183, L232
    a = q @ k.transpose(-2, -1)
    bias = attn.relative_position_bias_table[relative_position_index(ws).view(-1)].view(ws * ws, ws * ws, -1)
    a = a + bias.permute(2, 0, 1).contiguous().unsqueeze(0)  # L235-239
    if mask is not None:  # L241-244
        nw = mask.shape[0]
        a = a.view(b_ // nw, nw, heads, n, n) + mask.unsqueeze(1).unsqueeze(0)
        a = a.view(-1, heads, n, n)
    a = a.softmax(dim=-1)
    x = (a @ v).transpose(1, 2).reshape(b_, n, c)
    return ssf_ada(attn.proj(x), *ssf[p + "attn.ssf_2"])  # L253-255


def swin_block(x, res, window, blk, ssf, p, shifted):
    """SwinTransformerBlock.forward, L336-379 (drop path off); window and shift as L288-291 set them."""
    h, w = res
    b, _, c = x.shape
    shift = window // 2 if shifted else 0
    if min(res) <= window:
        shift, window = 0, min(res)
    shortcut = x
    x = ssf_ada(blk.norm1(x), *ssf[p + "ssf_1"]).view(b, h, w, c)  # L342-346
    if shift:
        x = torch.roll(x, shifts=(-shift, -shift), dims=(1, 2))
    windows = window_partition(x, window).view(-1, window * window, c)
    windows = window_attention(windows, blk.attn, window, shift_mask(h, w, window, shift), ssf, p)
    x = window_reverse(windows.view(-1, window, window, c), window, h, w)
    if shift:
        x = torch.roll(x, shifts=(shift, shift), dims=(1, 2))
    x = shortcut + x.view(b, h * w, c)
    mlp = blk.mlp
    y = ssf_ada(mlp.fc1(ssf_ada(blk.norm2(x), *ssf[p + "ssf_2"])), *ssf[p + "mlp.ssf_1"])  # L375, L117-120
    return x + ssf_ada(mlp.fc2(mlp.act(y)), *ssf[p + "mlp.ssf_2"])  # L122-126


def patch_merging(x, res, merge):
    """PatchMerging.forward, L401-426, without the scale/shift its __init__ never builds (see the module doc)."""
    h, w = res
    b, _, c = x.shape
    x = x.view(b, h, w, c)
    x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], -1)
    return merge.reduction(merge.norm(x.view(b, -1, 4 * c)))


def reference_features(plain: SwinTransformer, ssf: dict, images: torch.Tensor) -> torch.Tensor:
    """SwinTransformer.forward_features, L675-688, on ``plain``'s frozen weights and ``ssf``'s scales/shifts.

    timm runs a PatchMerging at the start of stages 1.. (``layers[s].downsample``) where SSF's code runs it at the
    end of stages ..-2 (L475-489); the same modules in the same order.
    """
    x = ssf_ada(plain.patch_embed.proj(images), *ssf["patch_embed.ssf_1"])  # L525-529, on the NCHW map
    x = x.flatten(2).transpose(1, 2)
    x = ssf_ada(plain.patch_embed.norm(x), *ssf["patch_embed.ssf_2"])  # L530-531
    res = plain.patch_embed.grid_size
    for s, stage in enumerate(plain.layers):
        if s > 0:
            x = patch_merging(x, res, stage.downsample)
            res = (res[0] // 2, res[1] // 2)
        for j, blk in enumerate(stage.blocks):
            # L470: odd blocks of a stage shift by half a window.
            x = swin_block(
                x, res, REFERENCE_SWIN["window_size"], blk, ssf, f"layers.{s}.blocks.{j}.", shifted=j % 2 == 1
            )
    x = ssf_ada(plain.norm(x), *ssf["ssf_1"])  # L681-684
    return x.mean(dim=1)  # L686-687: the average over the tokens


# --- the two sides' parameters ------------------------------------------------------------------------------------

# petl's site in a block -> SSF's parameter pair there (``<module>.ssf_<k>`` for ssf_scale_k and ssf_shift_k).
BLOCK_SITES = {
    "norm1": "ssf_1",
    "norm2": "ssf_2",
    "attn.qkv": "attn.ssf_1",
    "attn.proj": "attn.ssf_2",
    "mlp.fc1": "mlp.ssf_1",
    "mlp.fc2": "mlp.ssf_2",
}


def ssf_sites(depths: tuple[int, ...]) -> dict[str, str]:
    """Every scale/shift pair SSF's code builds for a Swin of ``depths`` (the module doc lists the lines), mapped
    to the module of timm's model it follows.
    """
    sites = {"patch_embed.ssf_1": "patch_embed.proj", "patch_embed.ssf_2": "patch_embed.norm", "ssf_1": "norm"}
    for s, depth in enumerate(depths):
        for j in range(depth):
            sites.update({f"layers.{s}.blocks.{j}.{k}": f"layers.{s}.blocks.{j}.{m}" for m, k in BLOCK_SITES.items()})
    return sites


def ssf_parameters(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """petl's scales and shifts, under SSF's names."""
    return {
        name: (model.get_submodule(path).scale, model.get_submodule(path).shift)
        for name, path in ssf_sites(REFERENCE_SWIN["depths"]).items()
    }


def _width(module: nn.Module) -> int:
    return module.weight.shape[0]  # Conv2d, Linear and LayerNorm alike: one weight row per output channel


def test_the_reference_is_timm_s_forward_at_the_identity(images):
    # The re-implementation itself: with scale 1 and shift 0 at every site it is timm's plain Swin.
    plain = make_reference_swin()
    identity = {}
    for name, path in ssf_sites(REFERENCE_SWIN["depths"]).items():
        width = _width(plain.get_submodule(path))
        identity[name] = (torch.ones(width), torch.zeros(width))
    with torch.no_grad():
        logits = plain.head.fc(reference_features(plain, identity, images))
        torch.testing.assert_close(logits, plain(images), atol=1e-5, rtol=1e-5)


def test_ssf_on_swin_builds_the_sites_ssf_s_code_builds():
    model = petl.apply_ssf(make_reference_swin())
    wrapped = {name for name, m in model.named_modules() if isinstance(m, SsfLayer)}
    assert wrapped == set(ssf_sites(REFERENCE_SWIN["depths"]).values())
    # None at patch merging: SSF's code never builds that one (the module doc says why).
    assert not any(isinstance(m, SsfLayer) for stage in model.layers for m in stage.downsample.modules())


@pytest.mark.parametrize("merged", [False, True], ids=["unmerged", "merged"])
def test_ssf_on_swin_matches_the_reference_forward(images, merged):
    model = petl.apply_ssf(make_reference_swin())
    perturb_trainable(model)  # scales and shifts well away from 1 and 0, and a trained head
    plain = make_reference_swin()
    with torch.no_grad():
        features = reference_features(plain, ssf_parameters(model), images)
        logits = model.head.fc(features)
        if merged:  # every scale and shift folded into the Conv2d, LayerNorm or Linear before it
            petl.merge(model)
        torch.testing.assert_close(model.forward_head(model.forward_features(images), pre_logits=True), features)
        torch.testing.assert_close(model(images), logits, atol=1e-5, rtol=1e-5)


def test_ssf_on_swin_count_is_the_per_stage_formula():
    # Per image: the patch projection and its norm (stage 0's width), 11 channels' worth per block (norm1, qkv: 3,
    # proj, norm2, fc1: 4, fc2) at its stage's width, and the final norm (the last stage's), a scale and a shift each.
    widths = [REFERENCE_SWIN["embed_dim"] * 2**s for s in range(len(REFERENCE_SWIN["depths"]))]
    blocks = sum(depth * 11 * width for depth, width in zip(REFERENCE_SWIN["depths"], widths, strict=True))
    expected = 2 * (2 * widths[0] + blocks + widths[-1])
    assert petl.get_method("ssf").trainable_formula(make_reference_swin(), petl.make_config("ssf")) == expected == 5_440
    assert petl.count_params(petl.apply_ssf(make_reference_swin(), num_classes=3)).trainable_no_head == expected


def test_ssf_on_swin_at_zero_std_is_the_identity_and_keeps_timm_s_intermediates(images):
    plain = make_reference_swin()
    model = petl.apply_ssf(make_reference_swin(), init_std=0.0)
    assert torch.equal(model(images), plain(images))
    perturb_trainable(model)
    with torch.no_grad():
        theirs = plain.forward_intermediates(images)
        ours = model.forward_intermediates(images)
        assert ours[0].shape == theirs[0].shape
        assert [t.shape for t in ours[1]] == [t.shape for t in theirs[1]]
        petl.merge(model)
        merged = model.forward_intermediates(images)
        torch.testing.assert_close(merged[0], ours[0], atol=1e-5, rtol=1e-5)
        for a, b in zip(merged[1], ours[1], strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _load_ssf_swin(repo: Path):
    """SSF's models/swin_transformer.py from a checkout, importable under today's timm.

    It imports ipdb (unused) and registers its models under timm's own names: the first is stubbed and
    the registration skipped, as only its classes are needed.
    """
    spec = importlib.util.spec_from_file_location("ssf_swin_transformer", repo / "models" / "swin_transformer.py")
    module = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # its timm.models.layers and .helpers imports
        registry = importlib.import_module("timm.models.registry")  # the deprecated path it imports from
        patch.setitem(sys.modules, "ipdb", types.ModuleType("ipdb"))
        patch.setattr(registry, "register_model", lambda fn: fn)
        spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not os.environ.get("PETL_SSF_REPO"), reason="set PETL_SSF_REPO to a dongzelian/SSF checkout")
def test_the_reference_is_ssf_s_own_code(images):
    # The re-implementation against SSF's file itself (MIT, not shipped with petl), on the same weights and random
    # scales and shifts: PETL_SSF_REPO=/path/to/SSF pytest tests/references/test_ssf_swin.py
    ssf_swin = _load_ssf_swin(Path(os.environ["PETL_SSF_REPO"]))
    plain = make_reference_swin()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # its torch.meshgrid without indexing= (L192)
        theirs = ssf_swin.SwinTransformer(tuning_mode="ssf", drop_path_rate=0.0, **REFERENCE_SWIN).eval()
    # Their stage s ends with the PatchMerging that timm runs at the start of stage s + 1 (L475-489).
    state = {
        re.sub(r"layers\.(\d+)\.downsample", lambda m: f"layers.{int(m.group(1)) - 1}.downsample", k).replace(
            "head.fc.", "head."
        ): v
        for k, v in plain.state_dict().items()
    }
    missing, unexpected = theirs.load_state_dict(state, strict=False)
    assert not unexpected and all("ssf_" in k or k.endswith(("attn_mask", "relative_position_index")) for k in missing)
    gen = torch.Generator().manual_seed(5)
    ssf = {}
    with torch.no_grad():
        for name, scale in theirs.named_parameters():
            if "ssf_scale_" in name:
                shift = theirs.get_parameter(name.replace("scale", "shift"))
                scale.copy_(1 + 0.3 * torch.randn(scale.shape, generator=gen))
                shift.copy_(0.3 * torch.randn(shift.shape, generator=gen))
                ssf[name.replace("ssf_scale_", "ssf_")] = (scale, shift)
        assert set(ssf) == set(ssf_sites(REFERENCE_SWIN["depths"]))  # and so none at PatchMerging
        torch.testing.assert_close(plain.head.fc(reference_features(plain, ssf, images)), theirs(images))
