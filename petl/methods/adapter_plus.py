"""Adapter+: a bottleneck adapter after each block with a learned per-channel scale (Steitz & Roth, CVPR 2024).

Each block's output ``x`` becomes ``x + s * up(act(down(x)))``: the "post" position, after the MLP
residual, which the paper found best; no LayerNorm inside the adapter; ``s`` a learned vector with
one scale per channel, starting at one; both projections drawn from a truncated normal with std
0.01 (Houlsby's initialisation), biases zero.  Because ``up`` is not zero, the model changes
slightly at init.  Not mergeable: the GELU sits between the projections.

Follows visinf/adapter_plus@191c4ab adapter_plus/vit_adapter.py L19-102 (``Adapter``: bottleneck,
``scaling="channel"`` -> ones(embed_dim) at L46-47, houlsby init L51-63, drop path on the branch
L95) and L269-273 (``forward_post``); defaults from conf/adapter/adapter_plus.yaml (config post,
scaling channel) over conf/adapter/base_adapter.yaml (dim 8, GELU, no norm, bias, houlsby init,
dropout 0, drop_path 0.1).

Trains:
    a bottleneck after each block, scaled per channel (Adapter+).

Reference:
    - visinf/adapter_plus@191c4ab adapter_plus/vit_adapter.py L19-102, L269-273; conf/adapter/adapter_plus.yaml,
      conf/adapter/base_adapter.yaml

Differences:
    - None beyond petl's shared choices: the reference's rebuilt blocks come after timm's ``init_weights``, so it
      starts as petl does (no ``init=reference`` needed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from timm.layers import DropPath
from torch import nn

from petl.model import rows, surgery
from petl.model.backbone import backbone_of
from petl.model.registry import MethodConfig, register_method
from petl.model.wrappers import PetlModule, factory_kwargs
from petl.utils.checks import check_choice, check_dropout, check_range

SCALINGS = ("channel", "learned", "none")
# Houlsby's std as given in the paper (vit_adapter.py L53); values beyond two std are redrawn.
INIT_STD = 0.01


@dataclass
class AdapterPlusConfig(MethodConfig):
    """Options of Adapter+.

    Attributes:
        dim: bottleneck width (the paper sweeps 1-32 per task; 8 is its base config).
        scaling: ``channel`` (a learned scale per channel, Adapter+), ``learned`` (one learned
            scalar) or ``none`` (no scaling, a plain Houlsby-style adapter).
        dropout: dropout between the activation and the up projection (train mode only).
        drop_path: stochastic depth on the adapter branch (train mode only).

    """

    dim: int = 8
    scaling: str = "channel"
    dropout: float = 0.0
    drop_path: float = 0.1

    def validate(self, model: nn.Module) -> None:
        super().validate(model)
        check_range("dim", self.dim, low=1)
        check_choice("scaling", self.scaling, SCALINGS)
        check_dropout("dropout", self.dropout)
        check_dropout("drop_path", self.drop_path)


class AdapterPlusBlock(PetlModule):
    """A frozen block followed by the Adapter+ bottleneck: ``x + s * up(act(down(x)))`` on its output.

    Args:
        base: the block; it stays frozen and is kept as ``base``.
        width: the token width.
        cfg: the method's options.

    """

    def __init__(self, base: nn.Module, width: int, cfg: AdapterPlusConfig) -> None:
        super().__init__(base)
        kw = factory_kwargs(base)
        self.down = nn.Linear(width, cfg.dim, **kw)
        self.act = nn.GELU()
        self.dropout = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        self.up = nn.Linear(cfg.dim, width, **kw)
        self.drop_path = DropPath(cfg.drop_path) if cfg.drop_path > 0 else nn.Identity()
        if cfg.scaling == "channel":
            self.scaling: nn.Parameter | None = nn.Parameter(torch.ones(width, **kw))
        elif cfg.scaling == "learned":
            self.scaling = nn.Parameter(torch.ones(1, **kw))
        else:
            self.scaling = None
        for linear in (self.down, self.up):
            nn.init.trunc_normal_(linear.weight, std=INIT_STD, a=-2 * INIT_STD, b=2 * INIT_STD)
            nn.init.zeros_(linear.bias)
        # New modules start in train mode; follow the wrapped block so an eval model stays in eval.
        self.train(base.training)

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return self.add_branch(self.base(x, **kwargs))

    def add_branch(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output ``x`` plus the scaled bottleneck branch that reads it."""
        branch = self.drop_path(self.up(self.dropout(self.act(self.down(x)))))
        if self.scaling is not None:
            branch = branch * self.scaling
        return x + branch


@rows.register_row_hook(AdapterPlusBlock)
def _rows(wrapper: AdapterPlusBlock) -> rows.RowHook:
    # The frozen block runs once for the mixed batch; each task's branch reads and adds to its rows' output.
    return rows.RowHook(wrapper.base, post=lambda x, y, _tokens: wrapper.add_branch(y))


def _formula(model: nn.Module, cfg: AdapterPlusConfig) -> int:
    r = cfg.dim
    # down d*r + r, up r*d + d, plus the scales, per block of width d.
    return sum(
        2 * d * r + r + d + {"channel": d, "learned": 1, "none": 0}[cfg.scaling] for d in backbone_of(model).widths()
    )


# The backbones adapter_plus's idea fits: a channel-scaled adapter after each block's MLP half, one width per block.
BACKBONES = ("vit", "naflexvit", "swin", "swinv2", "swinv2_cr", "vit_relpos", "beit", "eva", "vit_parallel")


@register_method("adapter_plus", AdapterPlusConfig, trainable_formula=_formula, backbones=BACKBONES)
def inject_adapter_plus(model: nn.Module, cfg: AdapterPlusConfig) -> None:
    """Adapter+: a bottleneck adapter after every block with a learned per-channel scale."""
    bb = backbone_of(model)
    for i, width in enumerate(bb.widths()):
        bb.set_block(i, AdapterPlusBlock(bb.block_container()[i], width, cfg))


def apply_adapter_plus(model: nn.Module, **options: Any) -> nn.Module:
    """Add an Adapter+ after every block of ``model`` and freeze everything else but the head.

    Args:
        model: a timm model of a backbone kind the method supports (its docs page; :func:`petl.list_backbones`).
        **options: fields of :class:`AdapterPlusConfig` (``dim``, ``scaling``, ``dropout``,
            ``drop_path``, ``num_classes``).

    Returns:
        The same model, modified in place.

    """
    return surgery.apply(model, "adapter_plus", **options)
