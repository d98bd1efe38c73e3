"""Partial-k fine-tuning: the last ``k`` blocks, what runs after them (final norms, an attention pool) and the head
train.

Blocks are chosen by their index in the block list; a name test such as ``'blocks.1' in name``
would also catch ``blocks.10`` and ``blocks.11``.

Trains:
    the last k blocks (by index), the final norms, the attention pool of a model that pools by attention (timm's
    ``global_pool='map'``, SigLIP), the head.

Reference:
    - KMnP/vpt@4410440 (Partial-k is one of VPT's baselines)

Differences:
    - VPT keeps even Partial-k's trained blocks in eval mode; petl trains them in train mode (the frozen part
      follows ``backbone_mode``, ``eval`` by default as VPT's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn

from petl.model import surgery
from petl.model.backbone import backbone_of
from petl.model.registry import MethodConfig, register_method
from petl.utils.checks import check_range


@dataclass
class PartialConfig(MethodConfig):
    """Options of Partial-k.

    Attributes:
        k: how many of the last blocks train, 1 to the model's depth.

    """

    # VPT, the reference of Partial-k, runs its encoder in eval mode for partial-k
    # (src/models/vit_models.py:L33-35, L70-76, L173-174); petl keeps the trained blocks in train mode.
    backbone_mode: ClassVar[str] = "eval"

    k: int = 1

    def validate(self, model: nn.Module) -> None:
        super().validate(model)
        check_range("k", self.k, low=1, high=backbone_of(model).depth())


def _trained_modules(model: nn.Module, k: int) -> list[nn.Module]:
    bb = backbone_of(model)
    blocks = bb.block_list()
    # Everything between the last blocks and the head trains: the final norms and, on a model pooling by attention
    # (SigLIP's map head), the attention pool between them, which would otherwise stay frozen between trained parts.
    return blocks[len(blocks) - k :] + bb.after_blocks()


def _formula(model: nn.Module, cfg: PartialConfig) -> int:
    return sum(p.numel() for m in _trained_modules(model, cfg.k) for p in m.parameters())


# The backbones partial's idea fits: the last k blocks and what follows them train: any backbone (on a Swin the
# patch merging between stages is not a block and stays frozen).
BACKBONES = ("vit", "naflexvit", "swin", "swinv2", "swinv2_cr", "vit_relpos", "beit", "eva", "vit_parallel")


@register_method(
    "partial", PartialConfig, trainable_formula=_formula, zero_init=True, mergeable=False, backbones=BACKBONES
)
def inject_partial(model: nn.Module, cfg: PartialConfig) -> None:
    """Partial-k: train the last k blocks, what runs after them and the head."""
    for module in _trained_modules(model, cfg.k):
        module.requires_grad_(True)


def apply_partial(model: nn.Module, **options: Any) -> nn.Module:
    """Train only the last ``k`` blocks of ``model``, what runs after them (final norms, an attention pool), the head.

    Args:
        model: a timm model of a backbone kind the method supports (its docs page; :func:`petl.list_backbones`).
        **options: fields of :class:`PartialConfig` (``k``, ``num_classes``).

    Returns:
        The same model, modified in place.

    Raises:
        ValueError: ``k`` outside 1..depth.

    """
    return surgery.apply(model, "partial", **options)
