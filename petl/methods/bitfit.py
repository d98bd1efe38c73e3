"""BitFit: train bias terms only (Ben Zaken et al., 2022).

``biases="all"`` (the default) trains every bias of the backbone: the patch embedding, every Linear
and every LayerNorm, the final norm.  This is what V-PETL Bench trains for its "BitFit" row:
every parameter whose name holds "bias"
(synbol/Parameter-Efficient-Transfer-Learning-Benchmark@c188fad
ImageClassification/train/train_model_bitfit.py:L164-171), as does PETL_Vision
(OSU-MLB/PETL_Vision@245d262 experiment/build_model.py:L30-31); on ViT-B/16 that is 102,912
tensors' entries, V-PETL's 0.10M.  ``biases="linear"`` trains only the blocks' Linear biases
(qkv, proj, fc1, fc2), 82,944 on ViT-B/16; in a parallel block (``vit_parallel``) those of ``in_proj`` (or,
with ``qkv_bias=False``, fc1's ``mlp_bias`` beside it), ``attn_out_proj`` and ``mlp_out_proj``.  Biases are found
as modules' ``bias`` parameters (and the ones a backbone keeps beside its Linears), never by matching parameter
names.

Trains:
    biases only: ``biases=all`` = every backbone bias (patch embedding, Linear, LayerNorm, final norm; V-PETL's
    BitFit), ``biases=linear`` = the blocks' qkv/proj/fc1/fc2 biases.

Reference:
    - synbol/Parameter-Efficient-Transfer-Learning-Benchmark@c188fad
      ImageClassification/train/train_model_bitfit.py L164-171
    - OSU-MLB/PETL_Vision@245d262 experiment/build_model.py L30-31

Differences:
    - Biases are found as modules' ``bias`` parameters, never by matching parameter names (the references match
      "bias" in the name).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from petl.model import surgery
from petl.model.backbone import backbone_of
from petl.model.registry import MethodConfig, register_method
from petl.utils.checks import check_choice

SCOPES = ("all", "linear")


@dataclass
class BitFitConfig(MethodConfig):
    """Options of BitFit.

    Attributes:
        biases: ``all`` (every bias of the backbone, V-PETL's choice) or ``linear`` (the blocks'
            qkv, proj, fc1 and fc2 biases only).

    """

    biases: str = "all"

    def validate(self, model: nn.Module) -> None:
        super().validate(model)
        check_choice("biases", self.biases, SCOPES)
        if not _biases(model, self.biases):
            raise ValueError(f"biases={self.biases!r}: this model has no such bias to train")


def _biases(model: nn.Module, scope: str) -> list[nn.Parameter]:
    bb = backbone_of(model)
    blocks = bb.block_list()
    # The blocks' Linear biases as the backbone keeps them (the Q and V biases of a SwinV2, BEiT or EVA sit beside
    # its qkv Linear, a parallel block's fc1 bias beside its in_proj).
    # A block without one of the Linears (an EVA-02 with separate q/k/v or a SwiGLU) is refused for the scope
    # `linear`, which names them; `all` takes every bias there is.
    found = []
    linears = [name for _, names in bb.norm_groups for name in names]  # qkv, proj, fc1, fc2 in a ViT block
    for block in blocks:
        for name in linears:
            try:
                found += bb.linear_biases(block, name)
            except ValueError:
                if scope == "linear":
                    raise
    if scope == "all":
        in_head = {id(m) for m in bb.head().modules()}
        modules = [m for m in model.modules() if id(m) not in in_head]
        found += [m.bias for m in modules if isinstance(getattr(m, "bias", None), nn.Parameter)]
    return list({id(bias): bias for bias in found}.values())


def _formula(model: nn.Module, cfg: BitFitConfig) -> int:
    return sum(b.numel() for b in _biases(model, cfg.biases))


# The backbones bitfit's idea fits: the biases of the blocks' Linears (and every other bias): any family whose
# Linears and their biases the backbone names.
BACKBONES = ("vit", "naflexvit", "swin", "swinv2", "swinv2_cr", "vit_relpos", "beit", "eva", "vit_parallel")


@register_method(
    "bitfit", BitFitConfig, trainable_formula=_formula, zero_init=True, mergeable=False, backbones=BACKBONES
)
def inject_bitfit(model: nn.Module, cfg: BitFitConfig) -> None:
    """BitFit: train the backbone's biases (all of them, or the blocks' Linear biases)."""
    for bias in _biases(model, cfg.biases):
        bias.requires_grad_(True)


def apply_bitfit(model: nn.Module, **options: Any) -> nn.Module:
    """Train only the biases (and the head) of ``model``.

    Args:
        model: a timm model of a backbone kind the method supports (its docs page; :func:`petl.list_backbones`).
        **options: fields of :class:`BitFitConfig` (``biases``, ``num_classes``).

    Returns:
        The same model, modified in place.

    """
    return surgery.apply(model, "bitfit", **options)
