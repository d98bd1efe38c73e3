"""Bottleneck adapters on each block's MLP: sequential (Houlsby/Pfeiffer) or parallel (AdaptFormer).

An adapter maps x -> up(act(down(x))) through a narrow ``dim``.  ``up`` starts at zero (weight
and bias), so the model is unchanged at init; ``down`` keeps nn.Linear's random init, so ``up``
gets a gradient on the first step and ``down`` from the second.  Zeroing both, as one public
benchmark repo does, leaves the adapter without any gradient, ever.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from petl import core, vit

STYLES = ("sequential", "parallel")
# Bottleneck widths from the papers: Pfeiffer-style sequential adapters use 8, AdaptFormer 64.
DEFAULT_DIM = {"sequential": 8, "parallel": 64}


@dataclass
class AdapterConfig(core.MethodConfig):
    """Options of the bottleneck adapter.

    Attributes:
        style: ``sequential`` (after the MLP, GELU) or ``parallel`` (beside the MLP, ReLU).
        dim: bottleneck width; ``None`` picks 8 for sequential, 64 for parallel.
        scale: factor on the parallel branch's output (ignored by sequential).

    """

    style: str = "sequential"
    dim: int | None = None
    scale: float = 0.1

    @property
    def bottleneck(self) -> int:
        """The bottleneck width in use (``dim`` or the style's default)."""
        return DEFAULT_DIM.get(self.style, 8) if self.dim is None else self.dim

    def validate(self, model: nn.Module) -> None:
        super().validate(model)
        core.check_choice("style", self.style, STYLES)
        core.check_range("dim", self.bottleneck, low=1)


class _Bottleneck(core.PetlModule):
    """Shared parts of both adapter styles: ``base`` is the block's MLP, plus down/act/up."""

    def __init__(self, base: nn.Module, width: int, dim: int, act: nn.Module) -> None:
        super().__init__(base)
        self.down = nn.Linear(width, dim)
        self.act = act
        self.up = nn.Linear(dim, width)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def adapter(self, x: torch.Tensor) -> torch.Tensor:
        """The bottleneck branch up(act(down(x)))."""
        return self.up(self.act(self.down(x)))


class SequentialAdapter(_Bottleneck):
    """Adapter after the MLP: out = h + adapter(h) with h = mlp(x)."""

    def __init__(self, base: nn.Module, width: int, dim: int) -> None:
        super().__init__(base, width, dim, nn.GELU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.base(x)
        return h + self.adapter(h)


class ParallelAdapter(_Bottleneck):
    """AdaptFormer: out = mlp(x) + scale * adapter(x), a branch beside the MLP."""

    def __init__(self, base: nn.Module, width: int, dim: int, scale: float) -> None:
        super().__init__(base, width, dim, nn.ReLU())
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x is the MLP's input, i.e. the block's norm2 output, so the branch reads normalised
        # tokens exactly as AdaptFormer's does.
        return self.base(x) + self.scale * self.adapter(x)


def _formula(model: nn.Module, cfg: AdapterConfig) -> int:
    d, r = vit.embed_dim(model), cfg.bottleneck
    # down: d*r + r, up: r*d + d, per block.
    return vit.depth(model) * (2 * d * r + r + d)


@core.register_method("adapter", AdapterConfig, trainable_formula=_formula, zero_init=True, mergeable=False)
def inject_adapter(model: nn.Module, cfg: AdapterConfig) -> None:
    """Bottleneck adapter on every block's MLP (sequential or parallel/AdaptFormer)."""
    width, kw = vit.embed_dim(model), core.factory_kwargs(model)
    for block in vit.blocks(model):
        mlp = vit.mlp(block)
        if cfg.style == "parallel":
            wrapper: nn.Module = ParallelAdapter(mlp, width, cfg.bottleneck, cfg.scale)
        else:
            wrapper = SequentialAdapter(mlp, width, cfg.bottleneck)
        vit.set_mlp(block, wrapper.to(**kw))


def apply_adapter(model: nn.Module, **options: Any) -> nn.Module:
    """Add a bottleneck adapter to every block of ``model`` and freeze everything else but the head.

    Args:
        model: a timm VisionTransformer.
        **options: fields of :class:`AdapterConfig` (``style``, ``dim``, ``scale``, ``num_classes``).

    Returns:
        The same model, modified in place.

    """
    return core.apply(model, "adapter", **options)
