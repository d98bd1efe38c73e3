"""Visual Prompt Tuning (VPT): learnable tokens inserted after the class/register tokens.

Follows KMnP/vpt@4410440.  Shallow VPT inserts one set of prompts after the class (and register)
tokens before the first block and carries their outputs through the network
(src/models/vit_prompt/vit.py:L75-84); deep VPT replaces the previous layer's prompt outputs by
fresh prompts before every block (vit.py:L109-124).  Prompts start uniform in +-sqrt(6 / (3 p^2 + d))
(vit.py:L55-62); prompt dropout defaults to VPT's 0.0 (src/configs/config.py:L74) and, when set, draws a
mask per image, the prompts being expanded to the batch first (vit.py:L82, L114-115).

What the pooling sees is ``pool``: VPT's default ``original`` keeps the prompts in the sequence
through the final norm and pooling, so an average-pooled backbone averages prompts and patches
(src/models/vit_prompt/vit_mae.py:L122-124, the backbone's own pool of
src/models/vit_backbones/vit_mae.py:L40-41); ``img_pool`` removes them after the last block, so
the final norm and pooling see exactly the tokens they would see without VPT
(vit_prompt/vit_mae.py:L125-128).  On a class-token backbone both give
the same logits.  While training, VPT keeps the frozen encoder in eval mode and only the prompt
dropout in train mode (vit.py:L89-100): :attr:`VptConfig.backbone_mode` is ``eval``.

On a backbone whose attention adds position terms to the patch tokens (the relative-position bias of BEiT and
``vit_relpos``, EVA's rotary embedding) the prompts get none: the bias is zero-padded for them, as VPT's own Swin
code pads it (src/models/vit_prompt/swin_transformer.py L480-508), and EVA rotates them by the identity
(``Backbone.make_room``).

Each affected block is wrapped on its own, not the block container, so timm's forward still runs
``model.blocks`` itself, including through ``checkpoint_seq`` when gradient checkpointing is on.
timm's ``forward_intermediates`` also runs the wrapped blocks; :mod:`petl.model.timm_api` leaves the
prompts out of the intermediates it returns (:attr:`PromptedBlock.prompt_place`).  Where the prompts go
is the backbone's (:meth:`petl.model.backbone.Backbone.insert_prompts`): after the prefix tokens of a
ViT's sequence, or into a Swin's windows.

On a Swin, VPT follows KMnP/vpt's own Swin code (src/models/vit_prompt/swin_transformer.py, "P" below;
its backbone src/models/vit_backbones/swin_transformer.py, "S"), in
:mod:`petl.model.backbone.swin_prompts`.  What the hierarchy changes:

- Prompts across windows.  A Swin attends inside windows, so each block copies an image's prompts into
  every one of its windows, in front of the window's tokens (P L398-407); the relative-position bias and
  the shifted-window mask get zero rows and columns for them (P L476-508), so a prompt attends to its
  whole window and every token to the prompts; a prompt's outputs are averaged over the windows (P
  L411-419).  Both residual halves then act on prompts and tokens alike (P L438-443).  The copies'
  projections are computed once per image: ``qkv`` acts token by token, so every copy of a prompt gets
  the same q, k, v, and the average over the windows is taken before ``proj``, which an affine map
  commutes with (where ``proj`` is an ``nn.Linear`` and its dropout is off; otherwise after it, as P does).
  Same numbers up to float rounding, tested against the per-window computation.
- Merging.  Between stages the PatchMerging concatenates 2x2 neighbours; the prompts are tiled 4x along
  the channels in their place and go through its norm and reduction (P L303-343), so shallow prompts
  reach every stage at its width.
- Per-stage widths.  Deep VPT has one prompt set per block, each of its stage's width embed_dim * 2^s
  (P L132-157; S L428-452: the first block's are the shallow ones, every later block replaces the prompt
  outputs, across a merging too); the count is ``num_tokens * sum(block widths)``.  Every stage's prompts
  start uniform with the same bound, from the patch size and embed_dim (P L91-92).
- Prompt count.  Every window holds every prompt, so the ``vpt_shallow`` experiment's 100 prompts (V-PETL
  Bench's VPT-Shallow setting; ``num_tokens`` defaults to 10) outnumber a window's tokens (49 in a 7x7
  window, 16 in petl's FractalDB Swin) where a ViT's sequence holds 197 or 65.  On the FractalDB Swin's mini
  leaderboard VPT-shallow read below the linear probe (47.65 against 56.33, the task means), and one digits
  final read 75.16 with 10 prompts and 75.78 with 25 against 63.74 with 100
  (``benchmarks/results/mini_swin/README.md``): on a Swin, search ``num_tokens`` too.
- Pooling.  The final norm and the average pool see the prompts with the grid (P L262-264), as
  ``pool=original`` does on a ViT; ``forward_features`` then returns one row of prompts and grid tokens
  (B, 1, n + H*W, C) that timm's head averages.  ``pool=img_pool`` (VPT's ViT option; its Swin code has
  none) removes them after the last block.  ``forward_intermediates`` gives each stage's grid (timm's
  shapes); pruning a prompted Swin is refused; SwinV2 (post-norm, cosine attention) is not supported: VPT
  has no prompted SwinV2 to follow.  While training the frozen Swin stays in eval mode, as on a ViT (P
  L229-241).  In a :class:`petl.MultiTask` mixed batch, whose prompt slots a Swin's NHWC grid has no room for,
  the rows of VPT tasks take a pass of their own per prompt count through the shared frozen Swin, each row with
  its own task's prompts beside the grid (``Backbone.features_with_prompts``).

Trains:
    prompt tokens (``deep=false``: one set before the first block; ``deep=true``: fresh prompts before every
    block, of that block's width on a Swin).

Reference:
    - KMnP/vpt@4410440 src/models/vit_prompt/vit.py L55-62, L75-84, L89-100, L109-124; src/configs/config.py L74;
      src/models/vit_prompt/vit_mae.py L122-128
    - Swin: KMnP/vpt@4410440 src/models/vit_prompt/swin_transformer.py L91-92, L126-173, L243-265, L303-343,
      L367-445, L459-522; src/models/vit_backbones/swin_transformer.py L417-456

Differences:
    - None in the forward: prompts are inserted as KMnP/vpt does and, by VPT's default ``pool=original``, kept in
      the tokens an average-pooling backbone averages (``pool=img_pool`` averages the patches only; on a class-token
      backbone both give the same logits).
    - Prompt dropout is drawn per image, as VPT expands the prompts to the batch before the dropout (vit.py L82,
      L114-115; tested): inert at its default ``dropout=0``, which every VPT experiment of petl runs.
    - Swin, batches: VPT's block copies the prompts into the windows window-major (vit_prompt/swin_transformer.py
      L404-406) while the windows are image-major (vit_backbones/swin_transformer.py L45), and averages them back
      the same way (L418-419), so with several images and windows one image's carried prompts meet and average
      other images' windows.  petl keeps each image's prompts to its own windows: equal to the reference run
      image by image (tested), and to the reference on a batch where that mix-up is inert (deep prompts, one
      window in the last stage; tested).
    - Swin, prompt dropout: VPT's Swin drops the deep prompts before expanding them to the batch
      (vit_prompt/swin_transformer.py L255: one mask for every image), the first ones after (L169-170); petl
      draws every mask per image.  Inert at the default ``dropout=0``.
    - Swin: each block is timm's (its padding of a grid the window does not divide, its fused attention); the
      reference's Swin asserts a divisible grid.  Its deep prompts are written for four stages
      (vit_prompt/swin_transformer.py L132-157); petl gives any number of stages one prompt set per block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from petl.model import rows, surgery
from petl.model.backbone import backbone_of
from petl.model.prompts import PromptedBlock
from petl.model.registry import MethodConfig, register_method
from petl.model.wrappers import factory_kwargs
from petl.utils.checks import check_choice, check_dropout, check_range

POOLS = ("original", "img_pool")


@dataclass
class VptConfig(MethodConfig):
    """Options of VPT.

    Attributes:
        num_tokens: prompts per layer.
        deep: fresh prompts before every block (VPT-deep) rather than only the first (VPT-shallow).
        dropout: dropout on the prompts (train mode only); VPT's default is 0.0.
        pool: ``original`` (VPT's default: prompts stay in the sequence the pooling sees) or
            ``img_pool`` (prompts removed after the last block: the pooling sees patches only).  On a
            class-token backbone both give the same logits; ``img_pool`` still leaves the prompts out of what
            ``forward_features`` returns.

    """

    # VPT's PromptedTransformer.train() keeps the frozen encoder in eval mode (vit.py:L89-100).
    backbone_mode: ClassVar[str] = "eval"

    num_tokens: int = 10
    deep: bool = False
    dropout: float = 0.0
    pool: str = "original"

    def validate(self, model: nn.Module) -> None:
        super().validate(model)
        check_range("num_tokens", self.num_tokens, low=1)
        check_dropout("dropout", self.dropout)
        check_choice("pool", self.pool, POOLS)


@rows.register_row_hook(PromptedBlock)
def _rows(wrapper: PromptedBlock) -> rows.RowHook:
    # The mixed batch carries prompt slots after the prefix (as many as its longest prompt set); a row writes its
    # prompts into the first ones, and the slots it leaves empty are masked out of its attention and pooling.
    # Stripping the prompts after the last block (img_pool) becomes leaving them out of the pooling.
    def pre(x: torch.Tensor, tokens: rows.Tokens) -> torch.Tensor:
        p, n = tokens.prefix, wrapper.num_tokens
        prompts = like(x)[0].expand(x.shape[0], -1, -1)  # eval: no dropout
        return torch.cat([x[:, :p], prompts, x[:, p + n :]], dim=1)

    batched = None
    if wrapper.prompt is not None:
        like = rows.per_device(wrapper.prompt)  # cast once per device and dtype, not at every call
        # Every row's prompts at once: each row's own (or, for a row of another task, what its slots hold).
        prompt = wrapper.prompt.detach()
        use, keep = torch.ones(1, dtype=torch.bool), torch.zeros(1, dtype=torch.bool)
        batched = rows.Batched(_rows_prompts, (prompt, use), (torch.zeros_like(prompt), keep), pre=_rows_prompts)
    return rows.RowHook(
        wrapper.base,
        pre=pre if wrapper.prompt is not None else None,
        prompts=wrapper.num_tokens,
        pool_prompts=not wrapper.strip,
        batched=batched,
    )


def _rows_prompts(x: torch.Tensor, tokens: rows.Tokens, per_row: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Each row's prompts written into its first slots (eval: no dropout); rows of other tasks keep theirs."""
    prompt, use = per_row
    p, n = tokens.prefix, prompt.shape[1]
    slots = torch.where(use.view(-1, 1, 1), prompt.to(x.dtype), x[:, p : p + n])
    return torch.cat([x[:, :p], slots, x[:, p + n :]], dim=1)


def _prompt_init_bound(model: nn.Module) -> float:
    # VPT's Xavier-uniform bound for a patch-sized fan-in (3 * patch_h * patch_w) and the first block's width as
    # fan-out, for every block's prompts (vit.py:L55-62; a Swin's later, wider stages too: swin_transformer.py:L92).
    bb = backbone_of(model)
    patch_h, patch_w = bb.patch_size()
    return math.sqrt(6.0 / (3 * patch_h * patch_w + bb.widths()[0]))


def _formula(model: nn.Module, cfg: VptConfig) -> int:
    # One set of prompts of the first block's width (shallow), or one per block of that block's width (deep).
    widths = backbone_of(model).widths()
    return cfg.num_tokens * (sum(widths) if cfg.deep else widths[0])


# The backbones vpt's idea fits: prompt tokens beside the patch tokens of a ViT's flat sequence or of a Swin's
# windows (KMnP/vpt prompts both).
BACKBONES = ("vit", "naflexvit", "swin", "vit_relpos", "beit", "eva", "vit_parallel")
# Why not on the other backbone kinds (the refusal says it, and so does the docs page).
REFUSAL = (
    "KMnP/vpt prompts a ViT and a Swin (v1); a SwinV2's post-norm blocks with cosine attention and a "
    "continuous position bias have no prompted reference to follow"
)


@register_method(
    "vpt",
    VptConfig,
    trainable_formula=_formula,
    zero_init=False,
    mergeable=False,
    backbones=BACKBONES,
    refusal=REFUSAL,
)
def inject_vpt(model: nn.Module, cfg: VptConfig) -> None:
    """Visual Prompt Tuning: learnable prompt tokens, shallow (first block) or deep (every block)."""
    bb = backbone_of(model)
    bound, kw = _prompt_init_bound(model), factory_kwargs(model)
    prompts = [
        torch.empty(cfg.num_tokens, width, **kw).uniform_(-bound, bound) if i == 0 or cfg.deep else None
        for i, width in enumerate(bb.widths())
    ]
    # The backbone knows where prompts sit in its tokens and how they cross its blocks (and a Swin's stages).
    bb.insert_prompts(prompts, dropout=cfg.dropout, strip=cfg.pool == "img_pool")


def apply_vpt(model: nn.Module, **options: Any) -> nn.Module:
    """Add visual prompts to ``model`` and freeze everything else but the head.

    Args:
        model: a timm model of a backbone kind the method supports (its docs page; :func:`petl.list_backbones`);
            on a ViT, class token or not, register tokens, token or avg pooling.
        **options: fields of :class:`VptConfig` (``num_tokens``, ``deep``, ``dropout``, ``pool``,
            ``num_classes``).

    Returns:
        The same model, modified in place.

    """
    return surgery.apply(model, "vpt", **options)
