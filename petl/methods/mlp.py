"""Mlp-k: the frozen backbone feeds a k-layer MLP classifier, which is the only part that trains.

The head is VPT's MLP (KMnP/vpt@4410440 src/models/mlp.py:L15-65, built by
src/models/vit_models.py:L159-165 with hidden width = the feature width): each of the ``k - 1``
hidden layers is Linear -> ReLU -> BatchNorm1d -> Dropout(0.1) with a kaiming-normal (fan-out)
weight, and the last Linear starts as VPT's last layer (:func:`vpt_head_init`: kaiming-normal fan-out, bias
-log(99)).  ``k`` counts Linear layers, i.e. VPT's
``MODEL.MLP_NUM`` is ``k - 1``.

Trains:
    VPT's MLP head: k-1 hidden Linear-ReLU-BatchNorm1d-Dropout(0.1) layers, then a Linear.

Reference:
    - KMnP/vpt@4410440 src/models/mlp.py L15-65; src/models/vit_models.py L159-165

Differences:
    - None: the head keeps VPT's init (kaiming-normal fan-out, last bias -log 99), the only petl head that does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from petl.model import surgery
from petl.model.backbone import backbone_of
from petl.model.registry import MethodConfig, register_method
from petl.model.wrappers import PetlHead, factory_kwargs
from petl.utils.checks import check_range

# VPT's MLP default dropout (src/models/mlp.py:L20), which vit_models.py's head keeps.
HIDDEN_DROPOUT = 0.1
# Prior probability of VPT's "special_bias" on the last layer (src/models/mlp.py:L54-57).
PRIOR_PROB = 0.01


@torch.no_grad()
def vpt_head_init(layer: nn.Linear) -> None:
    """Initialise a classifier Linear as VPT's last layer: kaiming-normal (fan-out), bias -log((1-p)/p).

    The bias leaves the softmax unchanged (the same for every class) but matches the reference's logits.
    """
    nn.init.kaiming_normal_(layer.weight, a=0, mode="fan_out")
    if layer.bias is not None:
        nn.init.constant_(layer.bias, -math.log((1 - PRIOR_PROB) / PRIOR_PROB))


@dataclass
class MlpConfig(MethodConfig):
    """Options of Mlp-k.

    Attributes:
        k: number of Linear layers in the head (hidden width = the ViT's feature width).

    """

    # VPT runs its frozen encoder in eval mode (src/models/vit_models.py:L33-35, L173-174).
    backbone_mode: ClassVar[str] = "eval"

    k: int = 3

    def validate(self, model: nn.Module) -> None:
        super().validate(model)
        check_range("k", self.k, low=1)
        if self.num_classes == 0:
            raise ValueError("num_classes=0 removes the head, which mlp trains: give the class count (at least 1)")
        if self.num_classes is None and backbone_of(model).num_classes() < 1:
            raise ValueError("mlp needs num_classes: the model has no classifier head to take the class count from")


class MlpHead(nn.Sequential, PetlHead):
    """VPT's MLP head: ``k - 1`` hidden (Linear, ReLU, BatchNorm1d, Dropout) layers, then a Linear."""

    def __init__(self, in_features: int, num_classes: int, k: int) -> None:
        layers: list[nn.Module] = []
        for _ in range(k - 1):
            hidden = nn.Linear(in_features, in_features)
            nn.init.kaiming_normal_(hidden.weight, a=0, mode="fan_out")
            layers += [hidden, nn.ReLU(), nn.BatchNorm1d(in_features), nn.Dropout(HIDDEN_DROPOUT)]
        last = nn.Linear(in_features, num_classes)
        vpt_head_init(last)
        layers.append(last)
        super().__init__(*layers)
        self.num_layers = len(layers)  # an attribute, which TorchScript reads (it has no len() of a module)

    def forward(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """The logits, or with ``pre_logits`` the hidden layers' output the last Linear reads (as timm's MLP heads)."""
        for index, layer in enumerate(self):
            if index < self.num_layers - 1 or not pre_logits:
                x = layer(x)
        return x

    def for_classes(self, num_classes: int) -> MlpHead:
        """A fresh head with this one's width and ``k`` for ``num_classes`` classes (``reset_classifier``)."""
        linears = [m for m in self if isinstance(m, nn.Linear)]
        return MlpHead(linears[0].in_features, num_classes, len(linears))


def _formula(model: nn.Module, cfg: MlpConfig) -> int:
    # The MLP is the head, so nothing outside the head trains.
    return 0


# The backbones mlp's idea fits: a new MLP head on the pooled features: any backbone.
BACKBONES = ("vit", "naflexvit", "swin", "swinv2", "swinv2_cr", "vit_relpos", "beit", "eva", "vit_parallel")


@register_method("mlp", MlpConfig, trainable_formula=_formula, zero_init=False, mergeable=False, backbones=BACKBONES)
def inject_mlp(model: nn.Module, cfg: MlpConfig) -> None:
    """Mlp-k: replace the head with VPT's k-layer MLP head; the backbone stays frozen."""
    bb = backbone_of(model)
    # petl.apply has already reset the head when num_classes was given, so the model knows its classes.
    head = MlpHead(bb.head_in_features(), bb.num_classes(), cfg.k)
    head.to(**factory_kwargs(model))
    head.train(model.training)
    bb.set_head(head)


def apply_mlp(model: nn.Module, **options: Any) -> nn.Module:
    """Freeze ``model`` and give it a trainable k-layer MLP head (VPT's).

    Args:
        model: a timm model of a backbone kind the method supports (its docs page; :func:`petl.list_backbones`).
        **options: fields of :class:`MlpConfig` (``k``, ``num_classes``; without ``num_classes``
            the current head's class count is kept).

    Returns:
        The same model, modified in place.

    """
    return surgery.apply(model, "mlp", **options)
