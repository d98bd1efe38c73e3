"""Convpass: a convolutional bypass beside each block's attention and MLP (Jie & Deng, 2022).

The bypass reads what the attention (or MLP) reads, the normalised tokens, and adds
``scale * up(drop(act(conv3x3(act(down(x))))))``: the patch tokens are laid back on their image grid
for a 3x3 convolution in the bottleneck, so the branch sees spatial neighbours that a token-wise
adapter cannot.  The class and register tokens each pass through the same convolution as a 1x1
image (only its centre tap acts).  ``up`` starts at zero, so the model is unchanged at init
(``init=zero``; PETL_Vision's ViT re-draws down and up with timm's ``init_weights`` after building them,
so its Convpass really starts random: ``init=reference``, see :mod:`petl.methods._init`).

Follows OSU-MLB/PETL_Vision@245d262 model/convpass.py L5-55 (``ConvPass``: down, QuickGELU, 3x3
conv initialised to zero plus the identity at the centre tap, QuickGELU, dropout 0.1, up, times
``convpass_scaler``; down/up initialised by model/utils.py ``init_weight`` "lora_xavier":
xavier-uniform down, zero up, zero biases) and model/block.py L98-104, L140-146 (parallel mode, "ln
after": beside attention and MLP, reading norm1/norm2 outputs); defaults from main.py L104-111
(bottleneck 8, conv identity init, scaler 10) and experiment/config/method/convpass.yml.  The
reference adds the bypass inside the block's drop path with a mask of its own; petl adds it inside
the attention/MLP output, so one drop-path mask covers both (identical at inference).

A parallel block (``vit_parallel``) has no attention or MLP module: one norm feeds one ``in_proj``, and the
attention's and MLP's outputs are summed into one residual.  Both bypasses read that norm's output (what the
attention and the MLP read) and add to the summed output inside the layer scale, under a drop path of their own
(``ConvpassBlock``, one wrapper on the block).

Trains:
    a 3x3 convolutional bypass on the patch grid beside each attention and MLP.

Reference:
    - OSU-MLB/PETL_Vision@245d262 model/convpass.py L5-55, model/block.py L98-104, L140-146, main.py L104-111,
      experiment/config/method/convpass.yml

Differences:
    - The bypass is added inside the attention/MLP output, so one drop-path mask covers both (the reference adds it
      inside the block's drop path with a mask of its own; identical at inference).  On a parallel block the two
      bypasses get a drop path of their own, as in the reference.
    - ``init=zero`` (default) starts ``up`` at zero; PETL_Vision's ViT re-draws down and up with timm's ``init_weights``
      (model/vision_transformer.py L207-208), so its Convpass really starts random: ``init=reference``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from timm.layers import QuickGELU
from torch import nn

from petl.methods import _init
from petl.model import rows, surgery
from petl.model.backbone import backbone_of
from petl.model.registry import MethodConfig, register_method
from petl.model.wrappers import PetlModule, factory_kwargs
from petl.utils.checks import check_dropout, check_nonzero, check_range


@dataclass
class ConvpassConfig(_init.InitOption, MethodConfig):
    """Options of Convpass.

    Attributes:
        dim: bottleneck channels of the bypass (``convpass_bottleneck``, 8).
        scale: factor on the bypass output (``convpass_scaler``, 10).
        xavier_conv: draw the 3x3 conv from xavier-uniform instead of starting it at the identity.
        dropout: dropout before the up projection (train mode only; the reference fixes 0.1).
        init: ``zero`` (petl's default: the model is unchanged at init) or ``reference``: down and up
            trunc_normal(std 0.02), zero biases, as PETL_Vision's ViT leaves them (timm 0.9.12's
            ``init_weights``; the conv keeps its init; see :mod:`petl.methods._init`).

    """

    dim: int = 8
    scale: float = 10.0
    xavier_conv: bool = False
    dropout: float = 0.1
    init: str = "zero"

    def validate(self, model: nn.Module) -> None:
        super().validate(model)
        check_range("dim", self.dim, low=1)
        check_nonzero("scale", self.scale, "the bypass")
        check_dropout("dropout", self.dropout)
        backbone_of(model).check_whole_grid("Convpass")


class _Bypass:
    """The bypass's layers, built as direct children of the module that mixes this in (saved files name them so),
    and its forward.
    """

    def _build(self, width: int, grid: tuple[int, int], num_prefix: int, cfg: ConvpassConfig, kw: dict) -> None:
        r = cfg.dim
        self.grid, self.num_prefix, self.scale = grid, num_prefix, cfg.scale
        self.down = nn.Linear(width, r, **kw)
        self.act = QuickGELU()  # x * sigmoid(1.702 x), the GELU approximation the reference uses
        self.conv = nn.Conv2d(r, r, kernel_size=3, padding=1, **kw)
        self.dropout = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        self.up = nn.Linear(r, width, **kw)
        with torch.no_grad():
            if cfg.xavier_conv:
                nn.init.xavier_uniform_(self.conv.weight)
            else:
                # Zero except the identity at the centre tap: the conv starts as a pass-through.
                self.conv.weight.zero_()
                self.conv.weight[:, :, 1, 1] = torch.eye(r, **kw)
            nn.init.zeros_(self.conv.bias)
            nn.init.xavier_uniform_(self.down.weight)
            nn.init.zeros_(self.down.bias)
            nn.init.zeros_(self.up.weight)
            nn.init.zeros_(self.up.bias)
        if cfg.init == "reference":
            _init.redraw(self.down, self.up)

    def bypass(self, x: torch.Tensor) -> torch.Tensor:
        """The convolutional bypass on tokens ``x`` (batch, tokens, width)."""
        b, n, _ = x.shape
        rows, cols = self.grid
        p = self.num_prefix
        if n - p != rows * cols:
            raise ValueError(f"Convpass expects {p} prefix + {rows}x{cols} patch tokens, got {n} tokens")
        h = self.act(self.down(x))
        r = h.shape[-1]
        patches = h[:, p:].reshape(b, rows, cols, r).permute(0, 3, 1, 2)
        patches = self.conv(patches).permute(0, 2, 3, 1).reshape(b, rows * cols, r)
        # Each prefix token is its own 1x1 image, as in the reference's class-token path.
        prefix = self.conv(h[:, :p].reshape(b * p, r, 1, 1)).reshape(b, p, r)
        h = self.dropout(self.act(torch.cat([prefix, patches], dim=1)))
        return self.up(h) * self.scale


class ConvpassParallel(_Bypass, PetlModule):
    """A frozen attention or MLP plus the convolutional bypass reading the same (normalised) tokens.

    Args:
        base: the block's attention or MLP; it stays frozen and is kept as ``base``.
        width: the token width.
        grid: patch-token grid (rows, columns).
        num_prefix: class and register tokens ahead of the patch tokens.
        cfg: the method's options.

    """

    def __init__(
        self, base: nn.Module, width: int, grid: tuple[int, int], num_prefix: int, cfg: ConvpassConfig
    ) -> None:
        PetlModule.__init__(self, base)
        self._build(width, grid, num_prefix, cfg, factory_kwargs(base))
        # New modules start in train mode; follow the wrapped layer so an eval model stays in eval.
        self.train(base.training)

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        # timm calls attention with attn_mask / is_causal keywords; the bypass does not use them.
        return self.base(x, **kwargs) + self.bypass(x)


def _folded(wrapper: ConvpassParallel) -> tuple[torch.Tensor, ...]:
    """The bypass's layers for eval, in fewer ops: each QuickGELU as one SiLU, dropout off, the scale folded into
    ``up``: (down weight, down bias, centre tap, its bias, the other eight taps, up), each weight out x in.

    ``x * sigmoid(1.702 x)`` is ``silu(1.702 x) / 1.702``: the 1.702 goes into the layer before each activation
    (``down``; the conv's bias, its weight taking the 1/1.702 of the first activation back) and the 1/1.702 of the
    second into ``up``, with the scale.  The same function, up to rounding.  The convolution is split in two: every
    token through its centre tap and bias (a matmul: a prefix token's whole 1x1 convolution), then the other eight
    taps over the patch grid, added to the patch tokens.  ``up``'s bias rides on one more unit of the centre tap's
    output (silu(2^14) is 2^14): ``up`` and the add into the rows are one matmul
    (:func:`petl.model.rows.with_bias_unit`).
    """
    k, s = 1.702, wrapper.scale
    conv = wrapper.conv
    with torch.no_grad():
        around = conv.weight.detach().clone()
        around[:, :, 1, 1] = 0.0
        centre, centre_b, up_w = rows.with_bias_unit(
            conv.weight[:, :, 1, 1], k * conv.bias, (s / k) * wrapper.up.weight, s * wrapper.up.bias, F.silu
        )
        return tuple(
            t.detach().clone() for t in (k * wrapper.down.weight, k * wrapper.down.bias, centre, centre_b, around, up_w)
        )


def _served_bypass(wrapper: ConvpassParallel) -> Callable[[torch.Tensor, torch.Tensor, int], None]:
    """The bypass in eval (:func:`_folded`) added into ``y`` in place.

    The tokens between the prefix and the patches (a mixed batch's prompt slots, ``slots``) go through the centre tap
    like prefix tokens: what the bypass adds there is never read, since a row of a task without prompts has its slots
    masked out of attention and pooling.
    """
    down, down_b, centre, centre_b, around, up = _folded(wrapper)
    # down, the centre tap and up transposed once, as tokens_linear and add_matmul_ take them.
    like = rows.per_device(down.t(), down_b, centre.t(), centre_b, around, up.t())
    rows_, cols = wrapper.grid
    p = wrapper.num_prefix

    def bypass(x: torch.Tensor, y: torch.Tensor, slots: int = 0) -> None:
        down_t, down_b, centre_t, centre_b, around_w, up_t = like(x)
        r = down_t.shape[1]
        # Every row's tokens as the rows of one matrix (tokens x channels, contiguous: a matmul's result).
        h = F.silu(rows.tokens_linear(x, down_t, down_b))
        c = rows.tokens_linear(h, centre_t, centre_b)
        # The patch tokens as a grid, each a view taken in one call (the host dispatches every view op): h's as the
        # convolution's NCHW input, and c's first r channels (not the bias unit, the last) in the same NCHW shape,
        # where the other taps' output is added in place (no copy of it, no copy of c's slice back, no permute).
        b, tokens, start = x.shape[0], x.shape[1], p + slots
        st, sw = h.stride()
        sb = tokens * st
        patches = h.as_strided((b, r, rows_, cols), (sb, sw, cols * st, st), h.storage_offset() + start * st)
        st, sw = c.stride()
        sb = tokens * st
        grid = c.as_strided((b, r, rows_, cols), (sb, sw, cols * st, st), c.storage_offset() + start * st)
        grid.add_(F.conv2d(patches, around_w, padding=1))
        rows.add_matmul_(y, F.silu(c), up_t)

    return bypass


class ConvBypass(_Bypass, nn.Module):
    """The bypass alone (one of :class:`ConvpassBlock`'s two)."""

    def __init__(self, width: int, grid: tuple[int, int], num_prefix: int, cfg: ConvpassConfig, kw: dict) -> None:
        nn.Module.__init__(self)
        self._build(width, grid, num_prefix, cfg, kw)


class ConvpassBlock(PetlModule):
    """A parallel block (attention and MLP inline from one norm, one residual) with a bypass beside each.

    Both bypasses read the block's normalised tokens, what its attention and its MLP read, and add to their summed
    output inside the layer scale, under a drop path of their own as in the reference (``Backbone.beside_sublayers``).

    Args:
        base: the block; it stays frozen and is kept as ``base``.
        family: its Backbone class (which knows its norm, layer scale and drop path).
        width: the token width.
        grid: patch-token grid (rows, columns).
        num_prefix: class and register tokens ahead of the patch tokens.
        cfg: the method's options.

    """

    def __init__(
        self, base: nn.Module, family: type, width: int, grid: tuple[int, int], num_prefix: int, cfg: ConvpassConfig
    ) -> None:
        super().__init__(base)
        kw = factory_kwargs(base)
        self.family = family
        self.attn_bypass = ConvBypass(width, grid, num_prefix, cfg, kw)
        self.mlp_bypass = ConvBypass(width, grid, num_prefix, cfg, kw)
        self.train(base.training)

    def side(self, normed: torch.Tensor) -> torch.Tensor:
        """Both bypasses on the block's normalised tokens, summed."""
        return self.attn_bypass.bypass(normed) + self.mlp_bypass.bypass(normed)

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return self.base(x, **kwargs) + self.family.beside_sublayers(self.base, x, self.side)


def _batched_bypass(wrapper: ConvpassParallel) -> rows.Batched:
    """The bypass in eval (:func:`_folded`) in its batched form: every row with its own task's layers.

    Each row's down, centre tap and up are gathered and applied with ``bmm`` (:func:`petl.model.rows.rows_matmul`);
    the eight other taps of every row's own convolution run as one grouped convolution, the rows' bottlenecks side by
    side as its channels, one group per row (a per-sample convolution in one op).  The neutral entry, all zeros,
    adds exactly nothing (every activation of zero is zero, and ``up`` is zero).  The patch tokens are the last
    ``rows x cols`` of the sequence, whatever prompt slots sit before them.
    """
    tensors = _folded(wrapper)
    grid = tuple(wrapper.grid)
    update = _grid_update(grid)
    neutral = tuple(torch.zeros_like(t) for t in tensors)
    return rows.Batched(("convpass", grid), tensors, neutral, post_in_place=update, post=_copied(update))


def _grid_update(grid: tuple[int, int]) -> Callable[[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]], None]:
    """The batched bypass on a ``grid`` of patches, added into ``y`` in place (see :func:`_batched_bypass`)."""
    height, width = grid

    def update(x: torch.Tensor, y: torch.Tensor, per_row: tuple[torch.Tensor, ...]) -> None:
        down, down_b, centre, centre_b, around, up = per_row
        b, r = x.shape[0], down.shape[1]
        h = F.silu(rows.rows_matmul(x, down, add=down_b))
        c = rows.rows_matmul(h, centre, add=centre_b)
        # Every row's patches as the channels of one image, each row's convolution one group of it.
        patches = h[:, -height * width :].transpose(1, 2).reshape(1, b * r, height, width)
        taps = F.conv2d(patches, around.reshape(b * r, r, 3, 3), padding=1, groups=b)
        c[:, -height * width :, :r].add_(taps.view(b, r, height * width).transpose(1, 2))
        rows.rows_matmul_(y, F.silu(c), up)

    return update


def _copied(update: Callable[..., None]) -> Callable[..., torch.Tensor]:
    """``update`` (in place) as a function returning the updated copy of ``y``."""

    def post(x: torch.Tensor, y: torch.Tensor, per_row: tuple[torch.Tensor, ...]) -> torch.Tensor:
        y = y.clone()
        update(x, y, per_row)
        return y

    return post


@rows.register_row_hook(ConvpassParallel)
def _rows(wrapper: ConvpassParallel) -> rows.RowHook:
    # The frozen attention/MLP runs once for the mixed batch; the bypass sees its rows' tokens on their grid, the
    # prompt slots other tasks' rows may have put in the sequence passed like prefix tokens (they hold nothing for
    # this row, and nothing this row reads).
    bypass = _served_bypass(wrapper)

    def add(x: torch.Tensor, y: torch.Tensor, tokens: rows.Tokens) -> None:
        bypass(x, y, tokens.slots)

    return rows.RowHook(wrapper.base, post_in_place=add, batched=_batched_bypass(wrapper))


@rows.register_row_hook(ConvpassBlock)
def _block_rows(wrapper: ConvpassBlock) -> rows.RowHook:
    # The frozen block runs once for the mixed batch (post hooks read its input, what both bypasses normalise);
    # the bypasses see their rows' tokens without other tasks' prompt slots, as above.
    def post(x: torch.Tensor, y: torch.Tensor, tokens: rows.Tokens) -> torch.Tensor:
        side = lambda normed: tokens.with_slots(wrapper.side(tokens.without_slots(normed)))  # noqa: E731
        return y + wrapper.family.beside_sublayers(wrapper.base, x, side)

    return rows.RowHook(wrapper.base, post=post)


def _formula(model: nn.Module, cfg: ConvpassConfig) -> int:
    bb = backbone_of(model)
    d, r = bb.width(), cfg.dim
    # down d*r + r, conv r*r*9 + r, up r*d + d; one bypass beside attention and one beside the MLP.
    return bb.depth() * 2 * (2 * d * r + 2 * r + 9 * r * r + d)


# The backbones convpass's idea fits: a 3x3 convolution over the patch grid of a flat token sequence (prefix tokens
# set apart), one width.
BACKBONES = ("vit", "naflexvit", "vit_relpos", "beit", "eva", "vit_parallel")
# Why not on the other backbone kinds (the refusal says it, and so does the docs page).
REFUSAL = (
    "its bypass reshapes the attention's input to the patch grid, and a Swin attention sees shifted "
    "windows: the 3x3 convolution would stop at every window border"
)


@register_method(
    "convpass",
    ConvpassConfig,
    trainable_formula=_formula,
    zero_init=True,
    backbones=BACKBONES,
    refusal=REFUSAL,
)
def inject_convpass(model: nn.Module, cfg: ConvpassConfig) -> None:
    """Convpass: a 3x3 convolutional bypass beside every attention and MLP."""
    bb = backbone_of(model)
    width, grid, prefix = (
        bb.width(),
        bb.grid_size(),
        bb.num_prefix_tokens(),
    )
    for i, block in enumerate(bb.block_list()):
        if bb.sublayers_are_modules:
            bb.set_attention(block, ConvpassParallel(bb.attention(block), width, grid, prefix, cfg))
            bb.set_feed_forward(block, ConvpassParallel(bb.feed_forward(block), width, grid, prefix, cfg))
        else:  # a parallel block: both bypasses beside its inline attention and MLP, one wrapper on the block
            bb.set_block(i, ConvpassBlock(bb.block_container()[i], type(bb), width, grid, prefix, cfg))


def apply_convpass(model: nn.Module, **options: Any) -> nn.Module:
    """Add a convolutional bypass beside the attention and MLP of every block; freeze everything else but the head.

    Args:
        model: a timm model of a backbone kind the method supports (its docs page; :func:`petl.list_backbones`).
        **options: fields of :class:`ConvpassConfig` (``dim``, ``scale``, ``xavier_conv``,
            ``dropout``, ``init``, ``num_classes``).

    Returns:
        The same model, modified in place.

    """
    return surgery.apply(model, "convpass", **options)
