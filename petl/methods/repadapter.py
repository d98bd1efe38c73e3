"""RepAdapter: re-parameterisable group-wise adapters before attention and the MLP (Luo et al., 2023).

Follows PETL_Vision's RepAdapter (OSU-MLB/PETL_Vision@245d262 model/repadapter.py:L5-27) in its
"sequential_before" placement (model/block.py:L112-113, L154-155;
experiment/config/method/repadapter.yml): each block's norm1 output passes through
``x + scale * B(dropout(A(x)))`` before attention, and the norm2 output likewise before the MLP.
A is a dense ``dim -> bottleneck`` map with bias, B a group-wise ``bottleneck -> dim`` map with
bias (a 1x1 Conv1d with ``groups`` in the reference, so its weight is block-diagonal).  Defaults
are the reference's (main.py:L141-149): bottleneck 8, groups 2, scale 1, dropout 0.1, and the
"lora_xavier" init (model/utils.py:L13-17): A xavier-uniform, B and both biases zero, so the
model is unchanged at init.

The attention's first (and only) reader of its input is the fused qkv Linear, and the MLP's is
fc1, so petl wraps those two Linears: ``base(adapter(x))``.  The adapter is affine, so ``merge``
folds it into the Linear (``W <- W (I + s M)``, ``b <- b + s W c``) and merged inference is the
plain backbone.

A parallel block (``vit_parallel``) has one norm and one ``in_proj`` whose rows are fc1's and then
Q, K, V: the attention's and the MLP's inputs are one tensor there.  Each sub-layer still gets its own
adapter, applied to its own rows of ``in_proj`` (``W_rows (x + adapter(x))``): two adapters per block
as in the reference, each folding into its rows.

Trains:
    RepAdapter: a group-wise adapter on each block's attention and MLP input; merged into qkv and fc1.

Reference:
    - OSU-MLB/PETL_Vision@245d262 model/repadapter.py L5-27; model/block.py L112-113, L154-155; main.py L141-149;
      model/utils.py L13-17

Differences:
    - None: PETL_Vision's RepAdapter is made of Conv1d, which timm's ``init_weights`` re-draw leaves alone, so it
      starts as petl does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from petl.methods import _reparam
from petl.model import rows, surgery
from petl.model.backbone import backbone_of, unwrap
from petl.model.registry import MethodConfig, register_method
from petl.model.wrappers import PetlModule, factory_kwargs
from petl.utils.checks import check_dropout, check_nonzero, check_range

# The Linear that first reads the attention's input and the MLP's input.
TARGETS = ("qkv", "fc1")


@dataclass
class RepAdapterConfig(MethodConfig):
    """Options of RepAdapter.

    Attributes:
        bottleneck: width of the adapter's hidden layer.
        groups: groups of the up-projection B (block-diagonal weight); divides ``bottleneck`` and the width.
        scale: factor on the adapter's branch.
        dropout: dropout between A and B (train mode only).

    """

    bottleneck: int = 8
    groups: int = 2
    scale: float = 1.0
    dropout: float = 0.1

    def validate(self, model: nn.Module) -> None:
        super().validate(model)
        check_range("bottleneck", self.bottleneck, low=1)
        check_range("groups", self.groups, low=1)
        check_dropout("dropout", self.dropout)
        check_nonzero("scale", self.scale, "the adapters")
        for width in sorted(set(backbone_of(model).widths())):
            if self.bottleneck % self.groups or width % self.groups:
                raise ValueError(
                    f"groups={self.groups} must divide bottleneck={self.bottleneck} and the block width {width}"
                )
        bb = backbone_of(model)
        for i, block in enumerate(bb.block_list()):
            for name in TARGETS:
                if getattr(bb.linear(block, bb.target_rows(block, name)[0]), "bias", None) is None:
                    # The adapter's bias folds into the Linear's (fold below); a Linear without one cannot take it.
                    raise ValueError(
                        f"repadapter merges into {name}'s bias, and {name} of block {i} of {type(model).__name__} "
                        "has none (timm's qkv_bias=False, or biases kept outside the Linear): choose another method"
                    )


class RepAdapterLinear(PetlModule):
    """A frozen Linear whose input first passes through a re-parameterisable adapter (for some of its rows).

    Args:
        base: the Linear (qkv or fc1), or a RepAdapterLinear of other rows of it; kept frozen as ``base``.
        bottleneck: hidden width of the adapter.
        groups: groups of the up-projection.
        scale: factor on the adapter branch.
        dropout: dropout between the two projections.
        out_rows: the output rows [start, end) whose input is adapted (a parallel block's fc1 or qkv rows of
            ``in_proj``); ``None``: all of them.

    """

    def __init__(
        self,
        base: nn.Module,
        bottleneck: int,
        groups: int,
        scale: float,
        dropout: float,
        out_rows: tuple[int, int] | None = None,
    ) -> None:
        super().__init__(base)
        width = unwrap(base).in_features
        kw = factory_kwargs(base)
        self.groups, self.scale, self.out_rows = groups, scale, out_rows
        self.down = nn.Linear(width, bottleneck, **kw)
        # Group g maps hidden units [g*bottleneck/groups, ...) to output channels [g*width/groups, ...):
        # weight rows are output channels, columns the hidden units of the row's group.
        self.up_weight = nn.Parameter(torch.zeros(width, bottleneck // groups, **kw))
        self.up_bias = nn.Parameter(torch.zeros(width, **kw))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.train(base.training)  # new modules start in train mode; follow the model's mode instead
        nn.init.xavier_uniform_(self.down.weight)
        nn.init.zeros_(self.down.bias)

    def up_dense(self) -> torch.Tensor:
        """The up-projection as a dense ``width x bottleneck`` (block-diagonal) matrix."""
        blocks = self.up_weight.view(self.groups, -1, self.up_weight.shape[1])
        return torch.block_diag(*blocks.unbind(0))

    def adapt(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter alone: ``x + scale * B(dropout(A(x)))``."""
        h = self.dropout(self.down(x))
        # Grouped up-projection: each group of hidden units feeds its own slice of channels.
        h = h.unflatten(-1, (self.groups, -1))
        weight = self.up_weight.view(self.groups, -1, self.up_weight.shape[1])
        up = torch.einsum("...gi,goi->...go", h, weight).flatten(-2) + self.up_bias
        return x + self.scale * up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged:
            return self.merged_forward(x)
        if self.out_rows is None:
            return self.base(self.adapt(x))
        return self.add_rows(x, self.base(x))

    def add_rows(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the Linear's output for ``x``) with its :attr:`out_rows` computed from the adapted input instead."""
        start, end = self.out_rows
        update = F.linear(self.adapt(x) - x, unwrap(self.base).weight[start:end])
        return torch.cat([y[..., :start], y[..., start:end] + update, y[..., end:]], dim=-1)

    def _weight_and_bias(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rows of the frozen Linear's weight and bias this adapter folds into (views: writes reach the Linear)."""
        linear = unwrap(self.base)
        start, end = self.out_rows if self.out_rows is not None else (0, linear.out_features)
        bias = linear.bias[start:end] if linear.bias is not None else None
        return linear.weight[start:end], bias

    def _affine(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The adapter as ``x -> x + (M x + c)``: returns ``(M, c)`` (scale included) in ``dtype``."""
        up = self.up_dense().to(dtype)
        m = self.scale * up @ self.down.weight.to(dtype)
        c = self.scale * (up @ self.down.bias.to(dtype) + self.up_bias.to(dtype))
        return m, c

    @torch.no_grad()
    def fold(self) -> None:
        """Fold the adapter into the Linear: ``W <- W + W M``, ``b <- b + W c``."""
        weight, bias = self._weight_and_bias()
        dtype = _reparam.work_dtype(weight)
        m, c = self._affine(dtype)
        _reparam.check_finite("the RepAdapter", m, c)
        w = weight.to(dtype)
        if bias is None:
            if bool(c.any()):
                raise ValueError("RepAdapter cannot merge a non-zero adapter bias into a Linear without bias")
        else:
            _reparam.write(bias, bias.to(dtype) + w @ c, "the RepAdapter into the bias")
        _reparam.write(weight, w + w @ m, "the RepAdapter into the weight")

    @torch.no_grad()
    def unfold(self) -> None:
        """Undo :meth:`merge`: ``W = W' (I + M)^-1`` (via the low-rank Woodbury identity), ``b = b' - W c``."""
        weight, bias = self._weight_and_bias()
        dtype = _reparam.work_dtype(weight)
        up = self.up_dense().to(dtype)
        down = self.down.weight.to(dtype)
        _, c = self._affine(dtype)
        # (I + s U D)^-1 = I - s U (I_r + s D U)^-1 D: only a bottleneck-sized matrix is inverted.
        inner = torch.eye(down.shape[0], dtype=dtype, device=down.device) + self.scale * down @ up
        merged = weight.to(dtype)
        w = merged - self.scale * (merged @ up) @ torch.linalg.solve(inner, down)
        _reparam.write(weight, w, "the RepAdapter out of the weight")
        if bias is not None:
            _reparam.write(bias, bias.to(dtype) - w @ c, "the RepAdapter out of the bias")


@rows.register_row_hook(RepAdapterLinear)
def _rows(wrapper: RepAdapterLinear) -> rows.RowHook:
    # Unmerged: each task adapts its own rows' input, then the frozen Linear runs once for the mixed batch.  An
    # adapter of some output rows recomputes those from its adapted input after the Linear.
    if wrapper.out_rows is not None:
        return rows.RowHook(wrapper.base, post=lambda x, y, _tokens: wrapper.add_rows(x, y))
    return rows.RowHook(wrapper.base, pre=lambda x, _tokens: wrapper.adapt(x))


def _formula(model: nn.Module, cfg: RepAdapterConfig) -> int:
    r, g = cfg.bottleneck, cfg.groups
    # A: d*r + r; grouped B: d * (r/g) + d; two adapters (attention, MLP) per block of width d.
    return sum(2 * (d * r + r + d * (r // g) + d) for d in backbone_of(model).widths())


# The backbones repadapter's idea fits: re-parameterisable adapters in front of the attention and MLP Linears.
BACKBONES = ("vit", "naflexvit", "swin", "swinv2_cr", "vit_relpos", "beit", "eva", "vit_parallel")


@register_method(
    "repadapter",
    RepAdapterConfig,
    trainable_formula=_formula,
    zero_init=True,
    mergeable=True,
    backbones=BACKBONES,
    refusal="its merge folds the adapter's shift into the qkv bias, and a SwinV2's qkv Linear has none (its Q and V "
    "biases sit beside it)",
)
def inject_repadapter(model: nn.Module, cfg: RepAdapterConfig) -> None:
    """RepAdapter: group-wise adapters before attention and the MLP, merged into qkv and fc1."""
    bb = backbone_of(model)
    for block in bb.block_list():
        for target in TARGETS:
            # All of qkv or fc1; in a parallel block, their rows of in_proj (the second adapter wraps the first).
            name, start, end = bb.target_rows(block, target)
            linear = bb.linear(block, name)
            part = None if (start, end) == (0, unwrap(linear).out_features) else (start, end)
            wrapper = RepAdapterLinear(linear, cfg.bottleneck, cfg.groups, cfg.scale, cfg.dropout, part)
            bb.set_linear(block, name, wrapper)


def apply_repadapter(model: nn.Module, **options: Any) -> nn.Module:
    """Add RepAdapters before every block's attention and MLP and freeze everything else but the head.

    Args:
        model: a timm model of a backbone kind the method supports (its docs page; :func:`petl.list_backbones`).
        **options: fields of :class:`RepAdapterConfig` (``bottleneck``, ``groups``, ``scale``,
            ``dropout``, ``num_classes``).

    Returns:
        The same model, modified in place.

    """
    return surgery.apply(model, "repadapter", **options)
