"""LN tuning: train the affine parameters (weight and bias) of every LayerNorm of the backbone.

Follows PETL_Vision's "ln" method, which trains every parameter named "norm" - the blocks' norm1
and norm2 and the final norm (OSU-MLB/PETL_Vision@245d262 experiment/build_model.py:L33-34;
V-PETL's ImageClassification/train/train_model_lntune.py:L163-169 does the same).  petl finds the
LayerNorms by type (:meth:`petl.Backbone.layer_norms`), not by name.  On ViT-B/16 that is
25 norms x 2 x 768 = 38,400 parameters.

Trains:
    the weight and bias of every backbone LayerNorm.

Reference:
    - OSU-MLB/PETL_Vision@245d262 experiment/build_model.py L33-34
    - synbol/Parameter-Efficient-Transfer-Learning-Benchmark@c188fad
      ImageClassification/train/train_model_lntune.py L163-169

Differences:
    - LayerNorms are found by type (``petl.Backbone.layer_norms``), not by the name "norm".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from petl.model import surgery
from petl.model.backbone import backbone_of
from petl.model.registry import MethodConfig, register_method


@dataclass
class LnConfig(MethodConfig):
    """Options of LN tuning (none beyond ``num_classes``)."""

    def validate(self, model: nn.Module) -> None:
        super().validate(model)
        if not any(True for norm in backbone_of(model).layer_norms() for _ in norm.parameters()):
            raise ValueError("ln: this model has no LayerNorm with affine parameters to train")


def _formula(model: nn.Module, cfg: LnConfig) -> int:
    # weight and bias of each affine LayerNorm: 2 x its width.
    return sum(p.numel() for norm in backbone_of(model).layer_norms() for p in norm.parameters())


# The backbones ln's idea fits: the LayerNorms train: any backbone.
BACKBONES = ("vit", "naflexvit", "swin", "swinv2", "swinv2_cr", "vit_relpos", "beit", "eva", "vit_parallel")


@register_method("ln", LnConfig, trainable_formula=_formula, zero_init=True, mergeable=False, backbones=BACKBONES)
def inject_ln(model: nn.Module, cfg: LnConfig) -> None:
    """LN tuning: train the weight and bias of every LayerNorm of the backbone."""
    for norm in backbone_of(model).layer_norms():
        norm.requires_grad_(True)


def apply_ln(model: nn.Module, **options: Any) -> nn.Module:
    """Train only the LayerNorms' affine parameters (and the head) of ``model``.

    Args:
        model: a timm model of a backbone kind the method supports (its docs page; :func:`petl.list_backbones`).
        **options: fields of :class:`LnConfig` (``num_classes``).

    Returns:
        The same model, modified in place.

    """
    return surgery.apply(model, "ln", **options)
