"""LST, ladder side-tuning (Sung et al., NeurIPS 2022): a narrow transformer beside the frozen one.

The side network is a copy of the backbone's architecture at ``1 / reduction`` of its width: it starts
from a linear down-projection of the tokens entering the first block, and after every frozen block it
mixes in a down-projection of that block's output (a "ladder") through a learned gate,
``side = g * side + (1 - g) * down_i(x_i)`` with ``g = sigmoid(alpha_i / T)``, before its own block
``i``.  The last side output, projected back up to the backbone's width, replaces the backbone's output:
the backbone's final norm, pooling and the head read it.  Nothing trainable feeds the backbone, so no
gradient flows through it: it runs as a frozen feature extractor.

Follows ylsung/Ladder-Side-Tuning@1798e82, the vision-and-language version (its ViT-sized encoder):
CLIP-ViL/src/lxrt/modeling.py L645-707 (``construct_side_network``: side layers of the backbone's layer
type with hidden and intermediate sizes divided by ``reduction_factor`` and the same head count; bias-free
first down-projection, per-layer down-projections and final up-projection; learnable gates at
``gate_alpha``), L709-720 (``merge_backbone_to_side``: ``sigmoid(alpha / gate_T)`` mixing), L796-822 (the
visualbert-style forward: first downsample of the embeddings, then per layer ladder-then-side-layer,
``add_residual_after`` False, the final upsample replacing the output), L1012-1023 (``init_bert_weights``:
Linear weights normal(0, 0.02), zero biases, LayerNorm 1/0; the constructors apply it after the side network is
built, L1167 and L1334, and petl draws the same); defaults from CLIP-ViL/src/lxrt/side_transformers/config.py
(gate "learnable", alpha 0, T 0.1, every layer).  The side network's width is ``hidden_size //
side_config.reduction_factor`` (modeling.py L648-649), set from ``args.reduction_factor`` (CLIP-ViL/src/lxrt/
entry.py L102), whose default is 16 (CLIP-ViL/src/param.py L225) and which the shipped script sets to 4
(CLIP-ViL/scripts/side_transformers.sh L3, ``--reduction_factor ${r}``); config.py's 8 is
``task_reduction_factor`` (L2), which the side network does not read.  petl's default 8 is what reproduces
V-PETL Bench's published 2.38M trainable parameters (configs/experiments/lst.yaml).  V-PETL Bench publishes an
LST row but has no LST code.

Deliberate differences: the side blocks are the backbone's own pre-norm timm blocks (LST builds them from
the backbone's layer class, a post-norm BERT layer there); their dropout acts where timm's does (after
the attention, the MLP activation and the MLP), BERT's after the attention and the output.  The LM
version initialises the side network from a pruned copy of the backbone (``fisher-v2``); the
vision-language version, followed here, draws it at random.

On the other ViT families (``vit_relpos``, BEiT, EVA, parallel blocks) the side blocks are still timm's ViT
``Block`` (a GELU MLP, no relative-position bias, no rotary embedding), at the backbone's MLP ratio taken from the
hidden width its ``fc2`` reads (an EVA-02's SwiGLU: 8/3; ``vit_pwee_*``: 5): LST builds its side layers from the
backbone's layer type, which petl replaces by the ViT block everywhere (see the differences).  The ladders read
the frozen blocks' outputs, whatever runs inside them.

Trains:
    LST: a 1/8-wide side transformer fed by gated ladders from every frozen block; its output replaces the
    backbone's; no backward through the backbone.

Reference:
    - ylsung/Ladder-Side-Tuning@1798e82 CLIP-ViL/src/lxrt/modeling.py L645-720, L796-822, L1012-1023;
      CLIP-ViL/src/lxrt/side_transformers/config.py

Differences:
    - Side layers are timm's pre-norm blocks (dropout where timm puts it); LST's are the backbone's layer type,
      post-norm BERT layers: ``LstSide.__init__`` against ``CLIP-ViL/src/lxrt/modeling.py`` L427-439,
      L664-668.
    - ``reduction`` 8, which reproduces V-PETL's published 2.38M; LST's side width is ``hidden //
      args.reduction_factor``, 16 by default and 4 in its script (config.py's 8 is the unread
      ``task_reduction_factor``, L2): ``LstConfig.reduction`` against ``CLIP-ViL/src/lxrt/entry.py`` L102,
      ``modeling.py`` L648-649, ``CLIP-ViL/src/param.py`` L225, ``CLIP-ViL/scripts/side_transformers.sh`` L3.
    - re-draw: yes, ``init_bert_weights`` (Linear normal(0.02), zero bias, LayerNorm 1/0) after the side network is
      built; petl draws the same, so no difference: ``LstSide.__init__`` against
      ``CLIP-ViL/src/lxrt/modeling.py`` L1012-1023, L1167, L1334.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from timm.models.vision_transformer import Block
from torch import nn

from petl.methods import _side
from petl.model import rows, surgery
from petl.model.backbone import backbone_of
from petl.model.registry import MethodConfig, register_method
from petl.model.wrappers import factory_kwargs
from petl.utils.checks import check_dropout, check_range


@dataclass
class LstConfig(MethodConfig):
    """Options of LST.

    Attributes:
        reduction: the side network's width is the backbone's divided by this (``--reduction_factor``: 16 by
            default, 4 in LST's script; 8 gives V-PETL Bench's published 2.38M).
        gate_alpha: initial gate logit of every ladder (``gate_alpha``, 0: the gate starts at 0.5).
        gate_t: gate temperature, ``g = sigmoid(alpha / gate_t)`` (``gate_T``, 0.1).
        dropout: dropout inside the side blocks (BERT's 0.1).

    """

    # The backbone is a frozen feature extractor: a speed floor of its own (petl.bench.speed).
    side_network: ClassVar[bool] = True

    reduction: int = 8
    gate_alpha: float = 0.0
    gate_t: float = 0.1
    dropout: float = 0.1

    def validate(self, model: nn.Module) -> None:
        bb = backbone_of(model)
        super().validate(model)
        d, heads = bb.width(), bb.num_heads(bb.block_list()[0])
        check_range("reduction", self.reduction, low=1, high=d)
        if d % self.reduction or (d // self.reduction) % heads:
            raise ValueError(
                f"reduction={self.reduction}: the side width {d}/{self.reduction} must be a whole number "
                f"divisible by the backbone's {heads} attention heads"
            )
        check_range("gate_t", self.gate_t, low=0, open_low=True)
        check_dropout("dropout", self.dropout)


class LstSide(_side.SideStream):
    """LST's side network: the first down-projection, one ladder + gate + side block per block, the up-projection.

    Args:
        model: the ViT it runs beside (width, depth, heads, MLP ratio).
        cfg: the method's options.

    """

    def __init__(self, model: nn.Module, cfg: LstConfig) -> None:
        bb = backbone_of(model)
        depth, d = bb.depth(), bb.width()
        super().__init__(depth)
        kw = factory_kwargs(model)
        width, heads = d // cfg.reduction, bb.num_heads(bb.block_list()[0])
        self.gate_t = cfg.gate_t
        self.first_down = nn.Linear(d, width, bias=False, **kw)
        self.ladders = nn.ModuleList([nn.Linear(d, width, bias=False, **kw) for _ in range(depth)])
        self.gates = nn.Parameter(torch.full((depth,), cfg.gate_alpha, **kw))
        self.side_blocks = nn.ModuleList(
            [
                Block(width, heads, mlp_ratio=_side.mlp_ratio(model), qkv_bias=True, proj_drop=cfg.dropout,
                      attn_drop=cfg.dropout).to(**kw)
                for _ in range(depth)
            ]
        )  # fmt: skip
        self.up = nn.Linear(width, d, bias=False, **kw)
        for module in self.modules():
            if isinstance(module, nn.Linear):  # BERT's init_bert_weights
                nn.init.normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        self._side: torch.Tensor | None = None

    def begin(self, x: torch.Tensor) -> None:
        """Start the side stream from the tokens entering the first block."""
        self._side = self.first_down(x)

    def after(self, index: int, x: torch.Tensor) -> torch.Tensor | None:
        """Side block ``index`` on the gated mix of the side stream and block ``index``'s output ``x``.

        Returns:
            After the last block, the side output projected up (it replaces the backbone's); else ``None``.

        """
        gate = torch.sigmoid(self.gates[index] / self.gate_t)
        return self._side_block(index, gate * self._side + (1 - gate) * self.ladders[index](x))

    def _side_block(self, index: int, mixed: torch.Tensor) -> torch.Tensor | None:
        """Side block ``index`` on the gated mix; after the last block, the side output projected up."""
        side = self.side_blocks[index](mixed)
        if index < self.depth - 1:
            self._side = side
            return None
        self._side = None  # no graph kept between forwards
        return self.up(side)

    def row_hook(self, index: int, block: nn.Module) -> rows.RowHook:
        """The frozen block once for the batch; the task's side stream on its rows, without the prompt slots.

        Served, the gate is a constant: its ``1 - gate`` is folded into the ladder's weight and the mix is one
        ``addmm`` (the side stream times the gate plus the ladder), not the ladder and six ops of the gate at every
        call.  The same function up to rounding.
        """
        with torch.no_grad():
            gate = torch.sigmoid(self.gates[index] / self.gate_t)
            like, keep = rows.per_device((1 - gate) * self.ladders[index].weight), float(gate)

        def served_after(i: int, x: torch.Tensor) -> torch.Tensor | None:
            (ladder,) = like(x)
            side = self._side.view(-1, ladder.shape[0])
            mixed = torch.addmm(side, x.reshape(-1, x.shape[-1]), ladder.t(), beta=keep)
            return self._side_block(i, mixed.view(self._side.shape))

        return self.stream_row_hook(index, block, served_after)


def _formula(model: nn.Module, cfg: LstConfig) -> int:
    bb = backbone_of(model)
    depth, d = bb.depth(), bb.width()
    s = d // cfg.reduction
    hidden = int(s * _side.mlp_ratio(model))
    # Side block: two LayerNorms, qkv and proj with biases, fc1 and fc2 with biases.
    side_block = 2 * 2 * s + (3 * s * s + 3 * s) + (s * s + s) + (s * hidden + hidden) + (hidden * s + s)
    # Bias-free first down-projection, one ladder per block and the up-projection; one gate per block.
    return depth * side_block + (depth + 1) * d * s + s * d + depth


# The backbones lst's idea fits: a ladder side network of timm ViT blocks at a reduced width, one width and head count
# for all blocks.
BACKBONES = ("vit", "naflexvit", "vit_relpos", "beit", "eva", "vit_parallel")
# Why not on the other backbone kinds (the refusal says it, and so does the docs page).
REFUSAL = (
    "its ladder side network takes every block's tokens at one reduced width and one token count, and a "
    "Swin's change per stage"
)


@register_method(
    "lst",
    LstConfig,
    trainable_formula=_formula,
    backbones=BACKBONES,
    refusal=REFUSAL,
    refusal_for=("swin", "swinv2", "swinv2_cr"),
)
def inject_lst(model: nn.Module, cfg: LstConfig) -> None:
    """LST: a 1/reduction-wide side transformer fed by ladders from every frozen block."""
    _side.install(model, LstSide(model, cfg))


def apply_lst(model: nn.Module, **options: Any) -> nn.Module:
    """Add LST's ladder side network to ``model`` and freeze everything else but the head.

    Args:
        model: a timm model of a backbone kind the method supports (its docs page; :func:`petl.list_backbones`).
        **options: fields of :class:`LstConfig` (``reduction``, ``gate_alpha``, ``gate_t``, ``dropout``,
            ``num_classes``).

    Returns:
        The same model, modified in place.

    """
    return surgery.apply(model, "lst", **options)
