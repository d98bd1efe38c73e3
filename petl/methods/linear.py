"""Linear probing: the backbone stays frozen and only a fresh classifier head trains.

A fresh head (``num_classes`` given) is the one every petl method gets: timm's ``reset_classifier``, an
``nn.Linear`` with PyTorch's default init, as V-PETL Bench resets its heads
(synbol/Parameter-Efficient-Transfer-Learning-Benchmark@c188fad
ImageClassification/models/vision_transformer_adapter.py:L424-429, the same in every
``vision_transformer_*.py``).  KMnP/vpt instead starts its heads at kaiming-normal (fan-out) weights and a
-log(99) bias (src/models/mlp.py:L52-57); petl keeps that init for Mlp-k's MLP only, where the whole module
follows VPT.  Measured on mini/digits (20 epochs, AdamW, val top-1): VPT's init reached 64.0 at lr 1e-2 and
29.5 at lr 1e-3, the default init 73.0 and 60.5 -- its logits start about ten times larger (mean train loss over
the first epoch 9.7 against 2.2), and a linear probe spends its budget undoing them.  One init for every
method's head also keeps the leaderboard's comparison between methods about the methods.

Trains:
    the head (a reset head is timm's ``reset_classifier`` Linear, as for every method).

Reference:
    - synbol/Parameter-Efficient-Transfer-Learning-Benchmark@c188fad
      ImageClassification/models/vision_transformer_adapter.py L424-429 (the head reset)

Differences:
    - VPT starts its heads at kaiming-normal (fan-out) weights and a -log 99 bias (KMnP/vpt src/models/mlp.py
      L52-57), which petl keeps for Mlp-k only: with AdamW on mini/digits that init cost the linear probe 9 val points
      at lr 1e-2 and 31 at lr 1e-3 in 20 epochs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn

from petl.model import surgery
from petl.model.backbone import backbone_of
from petl.model.registry import MethodConfig, register_method


@dataclass
class LinearConfig(MethodConfig):
    """Linear probing has no options beyond ``num_classes``."""

    # VPT runs its frozen encoder in eval mode (src/models/vit_models.py:L33-35, L173-174).
    backbone_mode: ClassVar[str] = "eval"

    def validate(self, model: nn.Module) -> None:
        super().validate(model)
        if self.num_classes == 0:
            raise ValueError("num_classes=0 removes the head, the only thing linear trains: give the class count")
        # A model built without a head (timm's num_classes=0) kept as it is: taken, it trained nothing at all.
        if self.num_classes is None and backbone_of(model).num_classes() < 1:
            raise ValueError(
                "linear needs num_classes: the model has no classifier head, the only thing linear trains, and none "
                "to take the class count from"
            )


def _formula(model: nn.Module, cfg: LinearConfig) -> int:
    # Only the head trains, and the formula counts what trains outside it.
    return 0


# The backbones linear's idea fits: only the head trains: any backbone.
BACKBONES = ("vit", "naflexvit", "swin", "swinv2", "swinv2_cr", "vit_relpos", "beit", "eva", "vit_parallel")


@register_method(
    "linear", LinearConfig, trainable_formula=_formula, zero_init=True, mergeable=False, backbones=BACKBONES
)
def inject_linear(model: nn.Module, cfg: LinearConfig) -> None:
    """Linear probe: train only the classifier head."""
    # Nothing to inject: petl.apply already froze the backbone and unfroze (and, given num_classes, reset) the head.


def apply_linear(model: nn.Module, **options: Any) -> nn.Module:
    """Freeze ``model`` and train only its (reset) head.

    Args:
        model: a timm model of a backbone kind the method supports (its docs page; :func:`petl.list_backbones`).
        **options: fields of :class:`LinearConfig` (``num_classes``).

    Returns:
        The same model, modified in place.

    """
    return surgery.apply(model, "linear", **options)
