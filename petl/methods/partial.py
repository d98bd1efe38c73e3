"""Partial-k fine-tuning: the last ``k`` blocks, what runs after them (final norms, an attention pool) and the head
train.

Blocks are chosen by their index in the block list; a name test such as ``'blocks.1' in name``
would also catch ``blocks.10`` and ``blocks.11``.  On a Swin the blocks are counted over the stages, and a patch
merging between two trained blocks (in front of a stage whose blocks train, after a trained block of the stage
before) trains with them, as in VPT's Swin Partial-4; the merging in front of the first trained block stays frozen.

Trains:
    the last k blocks (by index), a Swin's patch merging between two of them, the final norms, the attention pool
    of a model that pools by attention (timm's ``global_pool='map'``, SigLIP), the head.

Reference:
    - KMnP/vpt@4410440 (Partial-k is one of VPT's baselines); its Swin rule: src/models/vit_models.py L210-230
      (``Swin.build_backbone``): Partial-1 trains the last block, Partial-2 the last stage, Partial-4 the last stage,
      the last two blocks of the stage before and the patch merging between them (``layers.{L-2}.downsample``:
      VPT's stage ends with the merging that timm's next stage opens with), each with the final ``norm``.

Differences:
    - VPT keeps even Partial-k's trained blocks in eval mode; petl trains them in train mode (the frozen part
      follows ``backbone_mode``, ``eval`` by default as VPT's).
    - VPT's Swin rule is written for k = 1, 2 and 4 on Swin-B (depths 2-2-18-2); petl takes any k, counting blocks
      over the stages and training each patch merging with trained blocks on both sides, which is VPT's rule at
      those k.  Files that Partial-k wrote on a Swin before it trained the merging lack its tensors and are refused
      (``load_trainable``: re-run the training), and so is resuming a run it began (its ``checkpoint.pt``: start
      it over with ``resume=false``, which moves the old run aside).
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
    first = len(blocks) - k
    # A Swin's patch merging between two trained blocks trains too (VPT's Swin Partial-4: src/models/vit_models.py
    # L224-230), where it would otherwise stay frozen between trained parts; the one in front of the first does not.
    between = [m for index in range(first + 1, len(blocks)) for m in bb.modules_before_block(index)]
    # Everything between the last blocks and the head trains: the final norms and, on a model pooling by attention
    # (SigLIP's map head), the attention pool between them, which would otherwise stay frozen between trained parts.
    return blocks[first:] + between + bb.after_blocks()


def _formula(model: nn.Module, cfg: PartialConfig) -> int:
    return sum(p.numel() for m in _trained_modules(model, cfg.k) for p in m.parameters())


# The backbones partial's idea fits: the last k blocks and what follows them train: any backbone (on a Swin the
# patch merging between two trained blocks trains with them).
BACKBONES = ("vit", "naflexvit", "swin", "swinv2", "swinv2_cr", "vit_relpos", "beit", "eva", "vit_parallel")


@register_method(
    "partial", PartialConfig, trainable_formula=_formula, zero_init=True, mergeable=False, backbones=BACKBONES
)
def inject_partial(model: nn.Module, cfg: PartialConfig) -> None:
    """Partial-k: train the last k blocks, what runs after them and the head."""
    for module in _trained_modules(model, cfg.k):
        module.requires_grad_(True)


def apply_partial(model: nn.Module, **options: Any) -> nn.Module:
    """Train only the last ``k`` blocks of ``model`` (with a Swin's patch merging between two of them), what runs after
    them (final norms, an attention pool), the head.

    Args:
        model: a timm model of a backbone kind the method supports (its docs page; :func:`petl.list_backbones`).
        **options: fields of :class:`PartialConfig` (``k``, ``num_classes``).

    Returns:
        The same model, modified in place.

    Raises:
        ValueError: ``k`` outside 1..depth.

    """
    return surgery.apply(model, "partial", **options)
