"""Mlp-k: the frozen backbone feeds a k-layer MLP classifier, which is the only part that trains."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from petl import core, vit


@dataclass
class MlpConfig(core.MethodConfig):
    """Options of Mlp-k.

    Attributes:
        k: number of Linear layers in the head (hidden width = the ViT's feature width, GELU between).

    """

    k: int = 3

    def validate(self, model: nn.Module) -> None:
        super().validate(model)
        core.check_range("k", self.k, low=1)
        if self.num_classes is None and vit.num_classes(model) < 1:
            raise ValueError("mlp needs num_classes: the model has no classifier head to take the class count from")


class MlpHead(nn.Sequential):
    """``k`` Linear layers of width ``in_features`` with GELU between them, ending in ``num_classes``."""

    def __init__(self, in_features: int, num_classes: int, k: int) -> None:
        layers: list[nn.Module] = []
        for _ in range(k - 1):
            layers += [nn.Linear(in_features, in_features), nn.GELU()]
        layers.append(nn.Linear(in_features, num_classes))
        super().__init__(*layers)


def _formula(model: nn.Module, cfg: MlpConfig) -> int:
    # The MLP is the head, so nothing outside the head trains.
    return 0


@core.register_method("mlp", MlpConfig, trainable_formula=_formula, zero_init=False, mergeable=False)
def inject_mlp(model: nn.Module, cfg: MlpConfig) -> None:
    """Mlp-k: replace the head with a k-layer MLP; the backbone stays frozen."""
    # core.apply has already reset the head when num_classes was given, so the model knows its classes.
    head = MlpHead(vit.head_in_features(model), vit.num_classes(model), cfg.k)
    head.to(**core.factory_kwargs(model))
    head.train(model.training)
    vit.set_head(model, head)


def apply_mlp(model: nn.Module, **options: Any) -> nn.Module:
    """Freeze ``model`` and give it a trainable k-layer MLP head.

    Args:
        model: a timm VisionTransformer.
        **options: fields of :class:`MlpConfig` (``k``, ``num_classes``; without ``num_classes``
            the current head's class count is kept).

    Returns:
        The same model, modified in place.

    """
    return core.apply(model, "mlp", **options)
