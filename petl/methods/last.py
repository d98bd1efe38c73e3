"""LAST, low-rank attention side-tuning (Tang et al., arXiv 2402.04009): a side network of low-rank self-attention.

The frozen backbone is a feature extractor.  Its blocks form ``m = depth / gap`` groups; ``z_0`` are the tokens
entering the first block and ``z_i`` the output of group ``i``.  The side network is ``m + 1`` LSA blocks
``F_0 .. F_m``: ``u_0 = F_0(z_0)`` and ``u_i = F_i(u_{i-1} + z_i)``.  Each LSA block is ``layers`` low-rank
self-attention layers ``x + up(attention(q(n), k(n), v(n)))`` with ``n = LayerNorm(x)`` and bias-free rank-``rank``
projections q, k, v (``d -> r``) and up (``r -> d``); no feed-forward network.  The sum carries every ``z_i``
along, so the side output is bias-corrected, ``u_m - (z_0 + ... + z_{m-1})``, and replaces the backbone's output:
the backbone's final norm, pooling and the head read it.  Nothing trainable feeds the backbone, so no gradient
flows through it.  ``up`` starts at zero, so the corrected output is exactly ``z_m`` at init: the model is
unchanged.

Implemented from the paper, no reference code found: neither the authors nor V-PETL Bench publish LAST code
(V-PETL's ``vision_transformer_LAST.py`` is a copy of its VPT-Shallow model).  What petl takes from the paper
(section 3, as far as it could be read here): the groups and gap factor, ``F_i`` fed with ``u_{i-1} + z_i``, the
LSA layer (LayerNorm, rank-r query/key/value, attention in r dimensions, projection back to d, residual, no FFN)
and the bias correction ``u_m - sum_{i<m} z_i``.  What petl chose where the text was not available: one head,
bias-free projections, PyTorch's default init for q/k/v and a zero ``up`` (unchanged at init), and ``F_0`` on
``z_0`` (``m + 1`` blocks).  At rank 16, gap 1, one layer, that design counts 658,944 on ViT-B/16, the published
0.66M; the 12-block variant without ``F_0`` would count 608,256 (0.61M).

On the other ViT families (``vit_relpos``, BEiT, EVA, parallel blocks) the side network reads the tokens entering
the first block and each group's output as on the ViT; its LSA layers add no position terms of their own (neither
does the ViT's), and the frozen blocks run with their own relative-position bias or rotary embedding.

Trains:
    LAST: a side network of low-rank (r-wide, one head, no FFN) self-attention blocks, one on the embedded
    tokens and one after every ``gap`` blocks, fed with the previous side output plus the group's output; the
    bias-corrected side output (minus the earlier groups' outputs it carried along) replaces the backbone's; no
    backward through the backbone.  Implemented from the paper, no reference code found.

Reference:
    - Tang et al., arXiv 2402.04009 (the paper; neither the authors nor V-PETL publish LAST code)

Differences:
    - re-draw: not applicable, there is no reference code.  Where the paper's text could not be read here, petl
      chose: one attention head, bias-free projections, a zero-initialised up-projection (so the model starts as the
      backbone), PyTorch's default init elsewhere, and an LSA block ``F_0`` on the embedded tokens besides one per
      group: 13 blocks at rank 16 count the published 0.66M exactly (12 would count 0.61M): ``LowRankSelfAttention``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from petl.methods import _side
from petl.model import surgery
from petl.model.backbone import backbone_of
from petl.model.registry import MethodConfig, register_method
from petl.model.wrappers import factory_kwargs
from petl.utils.checks import check_range


@dataclass
class LastConfig(MethodConfig):
    """Options of LAST.

    Attributes:
        rank: width r of the attention's query, key and value (16).
        gap: blocks per group, the paper's gap factor g: an LSA block after every ``gap`` frozen blocks (1).
        layers: LSA layers per LSA block, the paper's T (1).

    """

    # The backbone is a frozen feature extractor: a speed floor of its own (petl.bench.speed).
    side_network: ClassVar[bool] = True

    rank: int = 16
    gap: int = 1
    layers: int = 1

    def validate(self, model: nn.Module) -> None:
        super().validate(model)
        depth = backbone_of(model).depth()
        check_range("rank", self.rank, low=1)
        check_range("gap", self.gap, low=1, high=depth)
        check_range("layers", self.layers, low=1)
        if depth % self.gap:
            raise ValueError(f"gap={self.gap} must divide the backbone's {depth} blocks into whole groups")


class LowRankSelfAttention(nn.Module):
    """One LSA layer: ``x + up(softmax(q k^T / sqrt(r)) v)`` on the LayerNorm of ``x``, all in ``r`` dimensions.

    Args:
        width: the token width d.
        rank: the attention's width r.
        kw: device and dtype of the new tensors.

    """

    def __init__(self, width: int, rank: int, **kw: Any) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width, eps=1e-6, **kw)
        self.q = nn.Linear(width, rank, bias=False, **kw)
        self.k = nn.Linear(width, rank, bias=False, **kw)
        self.v = nn.Linear(width, rank, bias=False, **kw)
        self.up = nn.Linear(rank, width, bias=False, **kw)
        nn.init.zeros_(self.up.weight)  # the side output starts as z_m exactly

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.norm(x)
        # One head of width r: (batch, 1, tokens, r) for the fused attention kernel.
        q, k, v = (proj(n).unsqueeze(1) for proj in (self.q, self.k, self.v))
        return x + self.up(F.scaled_dot_product_attention(q, k, v).squeeze(1))


class LastSide(_side.SideStream):
    """LAST's side network: an LSA block on the embedded tokens and one after every group of ``gap`` blocks.

    Args:
        model: the ViT it runs beside (width, depth).
        cfg: the method's options.

    """

    def __init__(self, model: nn.Module, cfg: LastConfig) -> None:
        bb = backbone_of(model)
        depth, d = bb.depth(), bb.width()
        super().__init__(depth)
        kw = factory_kwargs(model)
        self.gap = cfg.gap
        self.lsa = nn.ModuleList(
            [
                nn.Sequential(*[LowRankSelfAttention(d, cfg.rank, **kw) for _ in range(cfg.layers)])
                for _ in range(depth // cfg.gap + 1)
            ]
        )
        self._u: torch.Tensor | None = None
        self._z_sum: torch.Tensor | None = None

    def begin(self, x: torch.Tensor) -> None:
        """Start a forward on the embedded tokens ``z_0``: ``u_0 = F_0(z_0)``."""
        self._u, self._z_sum = self.lsa[0](x), x

    def after(self, index: int, y: torch.Tensor) -> torch.Tensor | None:
        """Read block ``index``'s output ``y``; the corrected side output after the last block, else ``None``."""
        if (index + 1) % self.gap:
            return None
        u = self.lsa[(index + 1) // self.gap](self._u + y)
        if index < self.depth - 1:
            self._u, self._z_sum = u, self._z_sum + y
            return None
        out = u - self._z_sum  # the paper's bias correction: u_m - (z_0 + ... + z_{m-1})
        self._u = self._z_sum = None  # no graph kept between forwards
        return out


def _formula(model: nn.Module, cfg: LastConfig) -> int:
    bb = backbone_of(model)
    d = bb.width()
    # Per LSA layer: a LayerNorm (2d), bias-free q, k, v (3 d r) and up (r d); (depth / gap + 1) blocks of them.
    return (bb.depth() // cfg.gap + 1) * cfg.layers * (4 * d * cfg.rank + 2 * d)


# The backbones last's idea fits: a side network over the blocks' outputs at one width.
BACKBONES = ("vit", "naflexvit", "vit_relpos", "beit", "eva", "vit_parallel")
# Why not on the other backbone kinds (the refusal says it, and so does the docs page).
REFUSAL = (
    "its low-rank attention side network runs over the blocks' outputs at one width and one token count, "
    "and a Swin's change per stage"
)


@register_method(
    "last",
    LastConfig,
    trainable_formula=_formula,
    zero_init=True,
    backbones=BACKBONES,
    refusal=REFUSAL,
    refusal_for=("swin", "swinv2", "swinv2_cr"),
)
def inject_last(model: nn.Module, cfg: LastConfig) -> None:
    """LAST: a side network of low-rank self-attention blocks reading every group's output."""
    _side.install(model, LastSide(model, cfg))


def apply_last(model: nn.Module, **options: Any) -> nn.Module:
    """Add LAST's low-rank attention side network to ``model`` and freeze everything else but the head.

    Args:
        model: a timm model of a backbone kind the method supports (its docs page; :func:`petl.list_backbones`).
        **options: fields of :class:`LastConfig` (``rank``, ``gap``, ``layers``, ``num_classes``).

    Returns:
        The same model, modified in place.

    """
    return surgery.apply(model, "last", **options)
