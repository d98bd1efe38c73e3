"""Linear probing: the backbone stays frozen and only a fresh classifier head trains.

A fresh head (``num_classes`` given) is initialised as VPT's (KMnP/vpt@4410440
src/models/mlp.py:L52-57, used by src/models/vit_models.py:L159-165): kaiming-normal weight
(fan-out) and every bias at -log(99), the prior-probability-0.01 bias, which leaves the softmax
unchanged but matches the reference's starting logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from petl import core, vit

# Prior probability of VPT's "special_bias" on the last layer (src/models/mlp.py:L54-57).
PRIOR_PROB = 0.01


@torch.no_grad()
def vpt_head_init(layer: nn.Linear) -> None:
    """Initialise a classifier Linear as VPT's last layer: kaiming-normal (fan-out), bias -log((1-p)/p)."""
    nn.init.kaiming_normal_(layer.weight, a=0, mode="fan_out")
    if layer.bias is not None:
        nn.init.constant_(layer.bias, -math.log((1 - PRIOR_PROB) / PRIOR_PROB))


@dataclass
class LinearConfig(core.MethodConfig):
    """Linear probing has no options beyond ``num_classes``."""

    # VPT runs its frozen encoder in eval mode (src/models/vit_models.py:L33-35, L173-174).
    backbone_mode: ClassVar[str] = "eval"


def _formula(model: nn.Module, cfg: LinearConfig) -> int:
    # Only the head trains, and the formula counts what trains outside it.
    return 0


@core.register_method("linear", LinearConfig, trainable_formula=_formula, zero_init=True, mergeable=False)
def inject_linear(model: nn.Module, cfg: LinearConfig) -> None:
    """Linear probe: train only the classifier head."""
    # core.apply already froze the backbone and unfroze the head; a head it reset gets VPT's init.
    head = vit.head(model)
    if cfg.num_classes is not None and isinstance(head, nn.Linear):
        vpt_head_init(head)


def apply_linear(model: nn.Module, **options: Any) -> nn.Module:
    """Freeze ``model`` and train only its (reset) head.

    Args:
        model: a timm VisionTransformer.
        **options: fields of :class:`LinearConfig` (``num_classes``).

    Returns:
        The same model, modified in place.

    """
    return core.apply(model, "linear", **options)
