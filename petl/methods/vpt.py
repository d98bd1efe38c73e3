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
prompts out of the intermediates it returns (:attr:`PromptedBlock.prompt_place`).

Trains:
    prompt tokens (``deep=false``: one set before the first block; ``deep=true``: fresh prompts before every
    block).

Reference:
    - KMnP/vpt@4410440 src/models/vit_prompt/vit.py L55-62, L75-84, L89-100, L109-124; src/configs/config.py L74;
      src/models/vit_prompt/vit_mae.py L122-128

Differences:
    - None in the forward: prompts are inserted as KMnP/vpt does and, by VPT's default ``pool=original``, kept in
      the tokens an average-pooling backbone averages (``pool=img_pool`` averages the patches only; on a class-token
      backbone both give the same logits).
    - Prompt dropout is drawn per image, as VPT expands the prompts to the batch before the dropout (vit.py L82,
      L114-115; tested): inert at its default ``dropout=0``, which every VPT experiment of petl runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from petl.model import rows, surgery
from petl.model.backbone import backbone_of
from petl.model.registry import MethodConfig, register_method
from petl.model.wrappers import PetlModule, factory_kwargs
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
            ``img_pool`` (prompts removed after the last block: the pooling sees patches only).

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


class PromptedBlock(PetlModule):
    """A block that adds prompts to its input and/or strips them from its output.

    Args:
        base: the timm block.
        num_prefix: class plus register tokens; prompts go right after them.
        num_tokens: how many prompts the sequence carries.
        prompt: this block's prompts (``num_tokens`` x dim), or ``None`` to keep what arrives.
        replace: the input already carries prompts (from the previous block) that ``prompt`` replaces.
        strip: remove the prompts from the output (last block).
        dropout: dropout on ``prompt``.

    """

    prompt_place = "front"  # after the class and register tokens (see petl.model.timm_api)

    def __init__(
        self,
        base: nn.Module,
        num_prefix: int,
        num_tokens: int,
        prompt: torch.Tensor | None,
        replace: bool,
        strip: bool,
        dropout: float,
    ) -> None:
        super().__init__(base)
        self.num_prefix, self.num_tokens = num_prefix, num_tokens
        self.replace, self.strip = replace, strip
        self.prompt = None if prompt is None else nn.Parameter(prompt)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.prompt is not None:
            p = self.num_prefix
            rest = x[:, p + self.num_tokens :] if self.replace else x[:, p:]
            x = torch.cat([x[:, :p], self.prompts(x), rest], dim=1)
        # timm blocks take attn_mask / is_causal keywords; pass whatever the caller gave.
        x = self.base(x, *args, **kwargs)
        if self.strip:
            p = self.num_prefix
            x = torch.cat([x[:, :p], x[:, p + self.num_tokens :]], dim=1)
        return x

    def prompts(self, x: torch.Tensor) -> torch.Tensor:
        """This block's prompts for every row of ``x``, in ``x``'s dtype, dropout drawn per row.

        Expanded to the batch before the dropout, so each image gets its own mask (vit.py:L82, L114-115).
        """
        return self.dropout(self.prompt.unsqueeze(0).expand(x.shape[0], -1, -1).to(x.dtype))

    def no_weight_decay(self) -> set[str]:
        """Prompt tokens are exempt from weight decay by default (see petl.train.engine.param_groups)."""
        return {"prompt"} if self.prompt is not None else set()


@rows.register_row_hook(PromptedBlock)
def _rows(wrapper: PromptedBlock) -> rows.RowHook:
    # The mixed batch carries prompt slots after the prefix (as many as its longest prompt set); a row writes its
    # prompts into the first ones, and the slots it leaves empty are masked out of its attention and pooling.
    # Stripping the prompts after the last block (img_pool) becomes leaving them out of the pooling.
    def pre(x: torch.Tensor, tokens: rows.Tokens) -> torch.Tensor:
        p, n = tokens.prefix, wrapper.num_tokens
        return torch.cat([x[:, :p], wrapper.prompts(x), x[:, p + n :]], dim=1)

    batched = None
    if wrapper.prompt is not None:
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


def _rows_prompts(
    x: torch.Tensor, tokens: rows.Tokens, stack: tuple[torch.Tensor, ...], entry: torch.Tensor
) -> torch.Tensor:
    """Each row's prompts written into its first slots (eval: no dropout); rows of other tasks keep theirs."""
    prompt, use = (t[entry] for t in stack)
    p, n = tokens.prefix, prompt.shape[1]
    slots = torch.where(use.view(-1, 1, 1), prompt.to(x.dtype), x[:, p : p + n])
    return torch.cat([x[:, :p], slots, x[:, p + n :]], dim=1)


def _prompt_init_bound(model: nn.Module) -> float:
    # VPT's Xavier-uniform bound for a patch-sized fan-in (3 * patch_h * patch_w) and fan-out dim.
    bb = backbone_of(model)
    patch_h, patch_w = bb.patch_size()
    return math.sqrt(6.0 / (3 * patch_h * patch_w + bb.width()))


def _formula(model: nn.Module, cfg: VptConfig) -> int:
    bb = backbone_of(model)
    prompt_sets = bb.depth() if cfg.deep else 1
    return prompt_sets * cfg.num_tokens * bb.width()


# The backbones vpt's idea fits: prompt tokens inserted after the prefix tokens of a flat token sequence.
BACKBONES = ("vit", "vit_relpos", "beit", "eva")


@register_method("vpt", VptConfig, trainable_formula=_formula, zero_init=False, mergeable=False, backbones=BACKBONES)
def inject_vpt(model: nn.Module, cfg: VptConfig) -> None:
    """Visual Prompt Tuning: learnable prompt tokens, shallow (first block) or deep (every block)."""
    bb = backbone_of(model)
    depth, bound = bb.depth(), _prompt_init_bound(model)
    kw = factory_kwargs(model)
    container = bb.block_container()
    for block in bb.block_list():
        # Every block carries the prompts; where a block adds position terms inside attention (a relative-position
        # bias, a rotary embedding) the prompts get none (Backbone.make_room).
        bb.make_room(block, bb.num_prefix_tokens(), cfg.num_tokens)
    for i in range(depth):
        has_prompt = i == 0 or cfg.deep
        strip = i == depth - 1 and cfg.pool == "img_pool"
        if not (has_prompt or strip):
            # Shallow VPT's later blocks just carry the prompt outputs along; they stay unwrapped.
            continue
        prompt = torch.empty(cfg.num_tokens, bb.width(), **kw).uniform_(-bound, bound) if has_prompt else None
        wrapper = PromptedBlock(
            container[i],
            num_prefix=bb.num_prefix_tokens(),
            num_tokens=cfg.num_tokens,
            prompt=prompt,
            replace=i > 0,
            strip=strip,
            dropout=cfg.dropout,
        )
        bb.set_block(i, wrapper)


def apply_vpt(model: nn.Module, **options: Any) -> nn.Module:
    """Add visual prompts to ``model`` and freeze everything else but the head.

    Args:
        model: a timm VisionTransformer (class token or not, register tokens, token or avg pooling).
        **options: fields of :class:`VptConfig` (``num_tokens``, ``deep``, ``dropout``, ``pool``,
            ``num_classes``).

    Returns:
        The same model, modified in place.

    """
    return surgery.apply(model, "vpt", **options)
