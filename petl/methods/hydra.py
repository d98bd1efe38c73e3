"""Hydra: a parallel and a sequential low-rank branch on each block's attention ``proj`` and MLP ``fc2``.

For a frozen Linear ``y = W0 x + b0`` Hydra adds two bottlenecks (Kim et al., 2024):
``out = y + s * P(x) + s * S(y)``, where the parallel branch ``P`` reads the Linear's input and the
sequential branch ``S`` reads its output.  Both are linear (down, dropout, up), so at inference
they fold into the frozen weight: ``W = W0 + s * (Up Dp + Us Ds W0)``.

Follows extremebird/Hydra@4138457 vtab1k/hydra.py: ``forward_vit_hydra_ffn`` / ``forward_vit_hydra_attn``
(L8-41: the branches on fc2 and attn.proj), ``Hydra_layer`` (L43-61: down, dropout, up, times scale;
xavier-uniform down weight, zeros elsewhere), ``reparameterize`` (L65-74), ``set_hydra`` (L77-94:
both branches on both Linears); defaults from vtab1k/train.py L60-62 (dim 2) and the VTAB configs
(configs/hydra_both/cifar.yaml: scale 0.1, dropout 0.2).  V-PETL Bench lists Hydra, but its
ImageClassification/models/vision_transformer_hydra.py is a copy of its VPT-shallow model, so the
Hydra authors' repository is the reference here.  (Its ``set_hydraWeight`` L118 folds the attention
branches into ``mlp.fc2``'s weight, a slip; petl merges each Linear with its own weight.)

Trains:
    a parallel (reads the input) and a sequential (reads the output) low-rank branch per target Linear;
    mergeable.

Reference:
    - extremebird/Hydra@4138457 vtab1k/hydra.py L8-94; vtab1k/train.py L60-62; configs/hydra_both/cifar.yaml

Differences:
    - Each Linear merges with its own weight: the reference's ``set_hydraWeight`` (L118) folds the attention
      branches into ``mlp.fc2``'s weight, a slip.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from petl.methods import _reparam
from petl.model import rows, surgery
from petl.model.backbone import backbone_of
from petl.model.registry import MethodConfig, register_method
from petl.model.wrappers import PetlModule, factory_kwargs
from petl.utils.checks import check_choice, check_dropout, check_nonzero, check_range, to_str_tuple

TARGETS = ("proj", "fc2")


@dataclass
class HydraConfig(MethodConfig):
    """Options of Hydra.

    Attributes:
        dim: bottleneck width of every branch (the reference's ``--dim``, 2).
        scale: factor on both branches' outputs (the reference tunes it per task; 0.1 on most).
        dropout: dropout between each branch's down and up projection (train mode only).
        targets: which Linears get the two branches: ``proj`` (attention output), ``fc2`` (MLP output).

    """

    dim: int = 2
    scale: float = 0.1
    dropout: float = 0.2
    targets: tuple[str, ...] = TARGETS

    def __post_init__(self) -> None:
        self.targets = to_str_tuple(self.targets, "targets")

    def validate(self, model: nn.Module) -> None:
        super().validate(model)
        check_range("dim", self.dim, low=1)
        check_nonzero("scale", self.scale, "both branches")
        check_dropout("dropout", self.dropout)
        if not self.targets:
            raise ValueError(f"targets is empty: choose one or both of {', '.join(TARGETS)}")
        for target in self.targets:
            check_choice("targets", target, TARGETS)
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"targets={list(self.targets)} names a Linear twice")


class _LowRank(nn.Module):
    """down -> dropout -> up, a linear bottleneck whose up projection starts at zero."""

    def __init__(self, in_features: int, out_features: int, dim: int, dropout: float, **kw: Any) -> None:
        super().__init__()
        self.down = nn.Linear(in_features, dim, **kw)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.up = nn.Linear(dim, out_features, **kw)
        nn.init.xavier_uniform_(self.down.weight)
        nn.init.zeros_(self.down.bias)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.dropout(self.down(x)))

    def affine(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The branch as one affine map (weight, bias) in float64, dropout being the identity at inference."""
        up_w, up_b = self.up.weight.double(), self.up.bias.double()
        return up_w @ self.down.weight.double(), up_w @ self.down.bias.double() + up_b


class HydraLinear(PetlModule):
    """A frozen Linear with Hydra's parallel (reads its input) and sequential (reads its output) branches.

    Args:
        base: the Linear to adapt; it stays frozen and is kept as ``base``.
        dim: bottleneck width of both branches.
        scale: factor on both branches' outputs.
        dropout: dropout inside both branches.

    """

    def __init__(self, base: nn.Linear, dim: int, scale: float, dropout: float) -> None:
        super().__init__(base)
        kw = factory_kwargs(base)
        self.scale = scale
        self.parallel = _LowRank(base.in_features, base.out_features, dim, dropout, **kw)
        self.sequential = _LowRank(base.out_features, base.out_features, dim, dropout, **kw)
        # New modules start in train mode; follow the wrapped layer so an eval model stays in eval.
        self.train(base.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged:
            self.check_not_training()
            return self.base(x)
        return self.add_branches(x, self.base(x))

    def add_branches(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the frozen Linear's output for ``x``) plus both branches: parallel reads ``x``, sequential ``y``."""
        return y + self.scale * (self.parallel(x) + self.sequential(y))

    def _folded(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(I + s * S, s * P, s * (bp + bs))`` in float64: merged W = A @ W0 + sP, b = A @ b0 + c."""
        if self.base.bias is None:
            raise ValueError("Hydra cannot merge into a Linear without a bias: the branches add one")
        p_w, p_b = self.parallel.affine()
        s_w, s_b = self.sequential.affine()
        eye = torch.eye(s_w.shape[0], dtype=torch.float64, device=s_w.device)
        return eye + self.scale * s_w, self.scale * p_w, self.scale * (p_b + s_b)

    def _write(self, weight: torch.Tensor, bias: torch.Tensor, what: str) -> None:
        # Both checked (in the dtypes they are written in) before either is written: a refusal leaves base as it was.
        weight, bias = weight.to(self.base.weight.dtype), bias.to(self.base.bias.dtype)
        _reparam.check_finite(what, weight, bias)
        self.base.weight.copy_(weight)
        self.base.bias.copy_(bias)

    @torch.no_grad()
    def fold(self) -> None:
        """Fold both branches into ``base`` (computed in float64, so half weights are upcast first)."""
        a, p_w, c = self._folded()
        w0, b0 = self.base.weight.double(), self.base.bias.double()
        self._write(a @ w0 + p_w, a @ b0 + c, "Hydra into the weight and bias")

    @torch.no_grad()
    def unfold(self) -> None:
        """Recover the frozen weight by solving ``(I + s * S) W0 = W - s * P`` (up to rounding)."""
        a, p_w, c = self._folded()
        w, b = self.base.weight.double(), self.base.bias.double()
        rhs = torch.cat([w - p_w, (b - c).unsqueeze(1)], dim=1)
        solved = torch.linalg.solve(a, rhs)
        self._write(solved[:, :-1], solved[:, -1], "Hydra out of the weight and bias")

    def extra_repr(self) -> str:
        return f"scale={self.scale}"


@rows.register_row_hook(HydraLinear)
def _rows(wrapper: HydraLinear) -> rows.RowHook:
    # Both branches read what the frozen Linear reads or writes, so the Linear runs once for the mixed batch.
    return rows.RowHook(wrapper.base, post=lambda x, y, _tokens: wrapper.add_branches(x, y))


def _formula(model: nn.Module, cfg: HydraConfig) -> int:
    # Per adapted Linear (in -> out): parallel in*r + r + r*out + out, sequential out*r + r + r*out + out.
    bb = backbone_of(model)
    total = 0
    r = cfg.dim
    for block in bb.block_list():
        for name in cfg.targets:
            linear = bb.linear(block, name)
            n_in, n_out = linear.in_features, linear.out_features
            total += r * (n_in + 3 * n_out) + 2 * r + 2 * n_out
    return total


# The backbones hydra's idea fits: parallel and sequential low-rank branches on the attention projection and MLP
# Linears.
BACKBONES = ("vit", "naflexvit", "swin", "swinv2", "swinv2_cr", "vit_relpos", "beit", "eva", "vit_parallel")


@register_method("hydra", HydraConfig, trainable_formula=_formula, zero_init=True, mergeable=True, backbones=BACKBONES)
def inject_hydra(model: nn.Module, cfg: HydraConfig) -> None:
    """Hydra: parallel + sequential low-rank branches on attn.proj and mlp.fc2; mergeable."""
    bb = backbone_of(model)
    for block in bb.block_list():
        for name in cfg.targets:
            wrapper = HydraLinear(bb.linear(block, name), cfg.dim, cfg.scale, cfg.dropout)
            bb.set_linear(block, name, wrapper)


def apply_hydra(model: nn.Module, **options: Any) -> nn.Module:
    """Add Hydra's two branches to attn.proj and mlp.fc2 of every block; freeze everything else but the head.

    Args:
        model: a timm model of a backbone kind the method supports (its docs page; :func:`petl.list_backbones`).
        **options: fields of :class:`HydraConfig` (``dim``, ``scale``, ``dropout``, ``targets``, ``num_classes``).

    Returns:
        The same model, modified in place.

    """
    return surgery.apply(model, "hydra", **options)
