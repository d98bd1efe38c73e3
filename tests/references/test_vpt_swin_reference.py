"""VPT on a Swin against a hand-written re-implementation of KMnP/vpt's prompted Swin forward.

The re-implementation below follows KMnP/vpt@4410440 line by line (``P`` = src/models/vit_prompt/
swin_transformer.py, ``S`` = src/models/vit_backbones/swin_transformer.py, the Swin backbone it subclasses) and
shares no code with petl's or timm's Swin forward: it runs the reference's token sequences (B, L, C) with the
prompts in front, Swin's own window partition, shift mask and relative-position index (S L35-62, L91-102,
L206-225: the lines SSF's Swin file keeps too, written out once in test_ssf_swin.py), on the weights of a timm
SwinTransformer.  timm's Swin and the reference's share the architecture; the mapping: timm keeps the tokens as an
NHWC grid between blocks (the reference a (B, H*W, C) sequence), and a timm stage opens with the PatchMerging that
the reference's BasicLayer closes with (timm ``layers[s + 1].downsample`` is the reference's
``layers[s].downsample``); the blocks, norms and head are the same modules.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import make_reference_swin
from test_ssf_swin import relative_position_index, shift_mask, window_partition, window_reverse
from timm.models.swin_transformer import SwinTransformer

import petl
from petl.model.backbone import unwrap
from petl.model.backbone.swin_prompts import PromptedSwinBlock

N = 3


# --- the reference, re-implemented ------------------------------------------------------------------------------


def _attention(attn: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor | None, n: int, ws: int) -> torch.Tensor:
    # P L459-522 (PromptedWindowAttention.forward, prompt_location "prepend").
    b_, tokens, c = x.shape
    heads = attn.num_heads
    qkv = F.linear(x, attn.qkv.weight, attn.qkv.bias).reshape(b_, tokens, 3, heads, c // heads).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    q = q * (c // heads) ** -0.5
    a = q @ k.transpose(-2, -1)
    bias = attn.relative_position_bias_table[relative_position_index(ws).view(-1)].view(ws * ws, ws * ws, -1)
    bias = bias.permute(2, 0, 1).contiguous()
    _c, _h, _w = bias.shape
    bias = torch.cat((torch.zeros(_c, n, _w), bias), dim=1)  # L484-487
    bias = torch.cat((torch.zeros(_c, _h + n, n), bias), dim=-1)  # L488-491
    a = a + bias.unsqueeze(0)
    if mask is not None:
        windows = mask.shape[0]
        mask = torch.cat((torch.zeros(windows, n, _w), mask), dim=1)  # L501-503
        mask = torch.cat((torch.zeros(windows, _h + n, n), mask), dim=-1)  # L504-508
        a = a.view(b_ // windows, windows, heads, tokens, tokens) + mask.unsqueeze(1).unsqueeze(0)
        a = a.view(-1, heads, tokens, tokens)
    a = a.softmax(dim=-1)
    return attn.proj((a @ v).transpose(1, 2).reshape(b_, tokens, c))


def _block(block: torch.nn.Module, x: torch.Tensor, res: int, n: int, window: int, shift: int) -> torch.Tensor:
    # P L367-445 (PromptedSwinTransformerBlock.forward); S L190-193: a grid no larger than the window is one
    # unshifted window of the grid's size.
    if res <= window:
        window, shift = res, 0
    b, _, c = x.shape
    shortcut = x
    x = block.norm1(x)
    prompt = x[:, :n]
    x = x[:, n:].view(b, res, res, c)
    if shift:
        x = torch.roll(x, shifts=(-shift, -shift), dims=(1, 2))
    windows = window_partition(x, window).view(-1, window * window, c)
    num_windows = int(windows.shape[0] / b)
    prompt = prompt.unsqueeze(0).expand(num_windows, -1, -1, -1).reshape((-1, n, c))  # L404-406: window-major
    windows = torch.cat((prompt, windows), dim=1)
    mask = shift_mask(res, res, window, shift)
    out = _attention(block.attn, windows, mask, n, window)
    prompt = out[:, :n].view(-1, b, n, c).mean(0)  # L414-419
    x = window_reverse(out[:, n:].view(-1, window, window, c), window, res, res)
    if shift:
        x = torch.roll(x, shifts=(shift, shift), dims=(1, 2))
    x = torch.cat((prompt, x.view(b, res * res, c)), dim=1)
    x = shortcut + x
    return x + unwrap(block.mlp)(block.norm2(x))


def _merge(merging: torch.nn.Module, x: torch.Tensor, res: int, n: int) -> torch.Tensor:
    # P L311-344 (PromptedPatchMerging.forward; prompt_upsampling is None, L296-309: tiled 4x).
    b, _, c = x.shape
    prompt = torch.cat([x[:, :n]] * 4, dim=-1)
    x = x[:, n:].view(b, res, res, c)
    x0, x1, x2, x3 = x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]
    x = torch.cat([x0, x1, x2, x3], -1).view(b, -1, 4 * c)
    x = torch.cat((prompt, x), dim=1)
    return merging.reduction(merging.norm(x))


def reference_features(
    model: SwinTransformer, images: torch.Tensor, prompts: list[torch.Tensor], deep: bool, pool: str = "original"
) -> torch.Tensor:
    """KMnP/vpt's PromptedSwinTransformer.forward_features on ``model``'s weights; ``prompts`` as petl orders them.

    ``prompts``: the first block's (the reference's ``prompt_embeddings``) and, with ``deep``, every later block's
    in order (``deep_prompt_embeddings_s``, stage by stage).  ``pool="img_pool"`` drops the prompts before the
    final norm, as VPT's ViT does (src/models/vit_prompt/vit_mae.py L125-128); its Swin has no such option.
    """
    window, res = unwrap(model.layers[0].blocks[0]).window_size[0], model.patch_embed.grid_size[0]
    x = model.patch_embed(images).flatten(1, 2)  # S L504-506: (B, H*W, C) after the patch norm
    b = x.shape[0]
    x = torch.cat((prompts[0].expand(b, -1, -1), x), dim=1)  # P L166-173
    layers = list(model.layers)
    i = 0
    for s, stage in enumerate(layers):
        for j, block in enumerate(stage.blocks):
            # S L428-452: deep replaces the prompt outputs before every block but the very first.
            if deep and i > 0:
                x = torch.cat((prompts[i].expand(b, -1, -1), x[:, N:]), dim=1)
            x = _block(unwrap(block), x, res, N, window, shift=0 if j % 2 == 0 else window // 2)
            i += 1
        if s + 1 < len(layers):  # the reference's BasicLayer s closes with the merging timm's stage s + 1 opens with
            x = _merge(unwrap(layers[s + 1].downsample), x, res, N)
            res //= 2
    if pool == "img_pool":
        x = x[:, N:]
    x = unwrap(model.norm)(x)  # P L262-264: norm, then the average over every token, prompts included
    return x.mean(dim=1)


def _prompts(model: torch.nn.Module) -> list[torch.Tensor]:
    return [m.prompt for m in model.modules() if isinstance(m, PromptedSwinBlock) and m.prompt is not None]


def _petl_features(model: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    return model.forward_head(model.forward_features(images), pre_logits=True)


# --- the tests --------------------------------------------------------------------------------------------------


@pytest.fixture
def swin_images() -> torch.Tensor:
    return torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("deep", [False, True], ids=["shallow", "deep"])
def test_vpt_on_swin_equals_reference_per_image(swin_images, deep):
    model = petl.apply_vpt(make_reference_swin(), num_tokens=N, deep=deep, num_classes=4).eval()
    prompts = _prompts(model)
    assert len(prompts) == (8 if deep else 1)
    features, logits = _petl_features(model, swin_images), model(swin_images)
    for k in range(swin_images.shape[0]):
        expected = reference_features(model, swin_images[k : k + 1], prompts, deep)
        torch.testing.assert_close(features[k : k + 1], expected)
        torch.testing.assert_close(logits[k : k + 1], unwrap(model.head.fc)(expected))


def test_vpt_on_swin_img_pool_leaves_prompts_out_of_the_pool(swin_images):
    model = petl.apply_vpt(make_reference_swin(), num_tokens=N, deep=True, pool="img_pool").eval()
    expected = reference_features(model, swin_images, _prompts(model), True, pool="img_pool")
    torch.testing.assert_close(_petl_features(model, swin_images), expected)
    original = petl.apply_vpt(make_reference_swin(), num_tokens=N, deep=True).eval()
    assert not torch.allclose(_petl_features(original, swin_images), expected)


def test_deep_vpt_on_swin_equals_reference_on_a_batch(swin_images):
    # Deep prompts enter every block the same for each image, and the last stage is one window, so the
    # reference's window-major prompt copies (P L404-406, L418-419) change nothing here: equal on the batch.
    model = petl.apply_vpt(make_reference_swin(), num_tokens=N, deep=True).eval()
    expected = reference_features(model, swin_images, _prompts(model), True)
    torch.testing.assert_close(_petl_features(model, swin_images), expected)


def test_shallow_reference_mixes_images_and_petl_does_not(swin_images):
    # The deliberate difference (petl.model.backbone.swin_prompts): the reference copies the prompts window-major
    # into image-major windows (P L404-406 against S L45) and averages them back window-major (P L418-419), so a
    # carried prompt of one image meets other images' windows.  petl keeps every image to its own windows.
    model = petl.apply_vpt(make_reference_swin(), num_tokens=N).eval()
    prompts = _prompts(model)
    batched = reference_features(model, swin_images, prompts, False)
    alone = torch.cat([reference_features(model, swin_images[k : k + 1], prompts, False) for k in range(3)])
    assert not torch.allclose(batched, alone, atol=1e-4)
    ours = _petl_features(model, swin_images)
    torch.testing.assert_close(ours, alone)
    torch.testing.assert_close(_petl_features(model, swin_images[1:2]), ours[1:2])


def test_vpt_on_swin_prompt_init_and_widths():
    # P L91-92, L126-157: uniform(-v, v), v = sqrt(6 / (3 * patch_h * patch_w + embed_dim)) for every stage's
    # prompts, each stage's of its own width embed_dim * 2**s.
    model = petl.apply_vpt(make_reference_swin(), num_tokens=40, deep=True)
    bound = math.sqrt(6 / (3 * 2 * 2 + 8))
    prompts = _prompts(model)
    assert [tuple(p.shape) for p in prompts] == [(40, 8 * 2 ** (i // 2)) for i in range(8)]
    for p in prompts:
        assert p.abs().max() <= bound and p.abs().max() > 0.8 * bound
