"""Full fine-tuning: every parameter trains (the reference the parameter-efficient methods chase).

Trains:
    everything.

Reference:
    - the baseline of every reference (V-PETL Bench, PETL_Vision: every parameter trainable)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn

from petl.model import surgery
from petl.model.backbone import backbone_of
from petl.model.registry import MethodConfig, register_method


@dataclass
class FullConfig(MethodConfig):
    """Full fine-tuning has no options beyond ``num_classes``."""

    # Everything trains, so everything is in train mode (VPT's end2end, src/models/vit_models.py:L36-38).
    backbone_mode: ClassVar[str] = "train"


def _formula(model: nn.Module, cfg: FullConfig) -> int:
    head_ids = {id(p) for p in backbone_of(model).head().parameters()}
    return sum(p.numel() for p in model.parameters() if id(p) not in head_ids)


# The backbones full's idea fits: every parameter trains: any backbone.
BACKBONES = ("vit", "naflexvit", "swin", "swinv2", "swinv2_cr", "vit_relpos", "beit", "eva", "vit_parallel")


@register_method("full", FullConfig, trainable_formula=_formula, zero_init=True, mergeable=False, backbones=BACKBONES)
def inject_full(model: nn.Module, cfg: FullConfig) -> None:
    """Full fine-tuning: every parameter trains."""
    model.requires_grad_(True)


def apply_full(model: nn.Module, **options: Any) -> nn.Module:
    """Make every parameter of ``model`` trainable (with a reset head when ``num_classes`` is given).

    Args:
        model: a timm model of a backbone kind the method supports (its docs page; :func:`petl.list_backbones`).
        **options: fields of :class:`FullConfig` (``num_classes``).

    Returns:
        The same model, modified in place.

    """
    return surgery.apply(model, "full", **options)
