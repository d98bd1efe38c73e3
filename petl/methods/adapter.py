"""Bottleneck adapters: sequential (Houlsby/Pfeiffer, after the MLP) or parallel (AdaptFormer).

An adapter maps x -> scale * up(dropout(act(down(norm(x))))) through a narrow ``dim``.

* ``parallel`` follows AdaptFormer (ShoufaChen/AdaptFormer@6967d67): the branch reads the residual
  stream entering the MLP sub-layer, not the MLP's normalised input (models/custom_modules.py:L76-94),
  uses ReLU and dropout 0.1 in the bottleneck (custom_modules.py:L70, models/adapter.py:L55-58),
  scale 0.1 and no input LayerNorm (main_image.py:L185-191), zero up weight and zero biases with
  the down weight kept random (adapter.py:L43-48).  PETL_Vision places it the same way
  (OSU-MLB/PETL_Vision@245d262 model/block.py, ``ft_mlp_ln: before``).
* ``sequential`` follows V-PETL Bench's Houlsby-style adapter (synbol/Parameter-Efficient-Transfer-
  Learning-Benchmark@c188fad ImageClassification/models/vision_transformer_adapter.py:L196-265):
  h = mlp(norm2(x)), out = h + up(gelu(down(h))), then drop-path and the residual.  V-PETL applies
  it after the block's layer scale, petl before (inside the MLP): the same where the block has no
  layer scale, as in ViT-B/16.  V-PETL writes zeros into both projections (vision_transformer_adapter.py
  L210-214), but its constructor then calls ``init_weights`` (L385), which re-draws every nn.Linear,
  the adapter's included, with trunc_normal(std 0.02) and zero biases: V-PETL's adapter really starts
  with both projections random, and the model changed.  petl's default (``init=zero``) zeroes ``up``
  only (the model is unchanged at init, as the adapter papers intend) and keeps nn.Linear's random
  ``down``, so the whole adapter learns; ``init=reference`` starts both as V-PETL's code runs (its
  AdaptFormer file does the same re-draw, vision_transformer_adaptformer.py L227-230 then L407).
* On a parallel block (``vit_parallel``: ``x + ls(attn_out_proj(...) + mlp_out_proj(...))`` with one
  residual), "after the MLP" is after ``mlp_out_proj``, the MLP's last Linear: the sequential adapter reads
  and adds to the MLP's output before it joins the attention's, inside the layer scale (as petl places it
  before the layer scale on every block).  "Parallel to the MLP" reads what the MLP sub-layer reads,
  the block's input (the stream entering the MLP's norm, which there is the attention's too), and joins
  the one residual sum outside the layer scale and drop-path: ``block(x) + adapter(x)``, AdaptFormer's
  placement as far as a block with one residual allows.

Trains:
    bottleneck adapters: sequential after the MLP (V-PETL's Houlsby placement) or parallel on the residual stream
    beside the MLP sub-layer (AdaptFormer).  ``style=sequential|parallel``; ``dim``, ``dropout`` and ``scale`` default
    per style (8 / 64, 0 / 0.1, 1 / 0.1).

Reference:
    - parallel: ShoufaChen/AdaptFormer@6967d67 models/custom_modules.py L70, L76-94; models/adapter.py L43-48, L55-58;
      main_image.py L185-191
    - sequential: synbol/Parameter-Efficient-Transfer-Learning-Benchmark@c188fad
      ImageClassification/models/vision_transformer_adapter.py L196-265

Differences:
    - V-PETL adds its sequential adapter after the block's layer scale, petl before it (identical on backbones
      without layer scale, such as ViT-B/16).
    - On a parallel block (one residual; no reference adapts one) the sequential adapter follows ``mlp_out_proj``
      and the parallel one reads the block's input, which is what the MLP reads there (see above).
    - ``init=zero`` (default) zeroes ``up`` only, so the model is unchanged at init; V-PETL's constructor re-draws both
      projections trunc_normal(0.02) (vision_transformer_adapter.py L385; AdaptFormer file L227-230 then L407):
      ``init=reference`` starts that way, and the V-PETL presets use it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from petl.methods import _init
from petl.model import rows, surgery
from petl.model.backbone import backbone_of, block_family
from petl.model.registry import MethodConfig, register_method
from petl.model.wrappers import PetlModule, factory_kwargs
from petl.utils.checks import check_choice, check_dropout, check_range

STYLES = ("sequential", "parallel")
# Per-style defaults from the references: Pfeiffer/V-PETL-style sequential adapters use width 8,
# no dropout, no scaling; AdaptFormer uses width 64, dropout 0.1, scale 0.1 (main_image.py:L114, L190).
DEFAULT_DIM = {"sequential": 8, "parallel": 64}
DEFAULT_DROPOUT = {"sequential": 0.0, "parallel": 0.1}
DEFAULT_SCALE = {"sequential": 1.0, "parallel": 0.1}


@dataclass
class AdapterConfig(_init.InitOption, MethodConfig):
    """Options of the bottleneck adapter.

    Attributes:
        style: ``sequential`` (after the MLP, GELU) or ``parallel`` (beside the MLP sub-layer, ReLU).
        dim: bottleneck width; ``None`` picks 8 for sequential, 64 for parallel.
        dropout: dropout after the bottleneck's activation; ``None`` picks 0 for sequential,
            0.1 for parallel (AdaptFormer).
        scale: factor on the adapter's output; ``None`` picks 1 for sequential, 0.1 for parallel.
        norm: a trainable LayerNorm on the adapter's input (AdaptFormer's layernorm option
            ``in``; off by default, as in AdaptFormer's image runs).
        init: ``zero`` (petl's default: the model is unchanged at init) or ``reference``: both
            projections trunc_normal(std 0.02), zero biases, as V-PETL Bench's model constructors leave
            them (see :mod:`petl.methods._init`).

    """

    # V-PETL, AdaptFormer and PETL_Vision train with model.train(): drop-path acts in the frozen blocks.
    backbone_mode: ClassVar[str] = "train"

    style: str = "sequential"
    dim: int | None = None
    dropout: float | None = None
    scale: float | None = None
    norm: bool = False
    init: str = "zero"

    @property
    def bottleneck(self) -> int:
        """The bottleneck width in use (``dim`` or the style's default)."""
        return DEFAULT_DIM.get(self.style, 8) if self.dim is None else self.dim

    @property
    def dropout_p(self) -> float:
        """The dropout in use (``dropout`` or the style's default)."""
        return DEFAULT_DROPOUT.get(self.style, 0.0) if self.dropout is None else self.dropout

    @property
    def scale_factor(self) -> float:
        """The output scale in use (``scale`` or the style's default)."""
        return DEFAULT_SCALE.get(self.style, 1.0) if self.scale is None else self.scale

    def validate(self, model: nn.Module) -> None:
        super().validate(model)
        check_choice("style", self.style, STYLES)
        check_range("dim", self.bottleneck, low=1)
        check_dropout("dropout", self.dropout_p)
        if self.style == "parallel":
            for block in backbone_of(model).block_list():
                block_family(block)


class _Bottleneck(PetlModule):
    """What both styles share: ``base`` (the wrapped MLP or block) plus norm/down/act/dropout/up.

    ``up`` starts at zero, so the model is unchanged at init; ``down``'s weight keeps nn.Linear's
    random (kaiming-uniform) init, so ``up`` gets a gradient on the first step and ``down`` from
    the second.
    """

    def __init__(self, base: nn.Module, width: int, cfg: AdapterConfig, act: nn.Module, zero_down_bias: bool) -> None:
        super().__init__(base)
        self.norm = nn.LayerNorm(width) if cfg.norm else nn.Identity()
        self.down = nn.Linear(width, cfg.bottleneck)
        self.act = act
        self.dropout = nn.Dropout(cfg.dropout_p) if cfg.dropout_p > 0 else nn.Identity()
        self.up = nn.Linear(cfg.bottleneck, width)
        self.scale = cfg.scale_factor
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)
        if zero_down_bias:
            nn.init.zeros_(self.down.bias)
        if cfg.init == "reference":
            _init.redraw(self.down, self.up)

    def adapter(self, x: torch.Tensor) -> torch.Tensor:
        """The bottleneck branch scale * up(dropout(act(down(norm(x)))))."""
        return self.scale * self.up(self.dropout(self.act(self.down(self.norm(x)))))


class SequentialAdapter(_Bottleneck):
    """Adapter after the MLP, wrapping it: out = h + adapter(h) with h = mlp(x)."""

    def __init__(self, base: nn.Module, width: int, cfg: AdapterConfig) -> None:
        super().__init__(base, width, cfg, nn.GELU(), zero_down_bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.base(x)
        return h + self.adapter(h)


class ParallelAdapter(_Bottleneck):
    """AdaptFormer, wrapping the whole block: out = x + drop_path(mlp(norm2(x))) + adapter(x).

    ``x`` is the residual stream after the attention sub-layer; the branch skips the block's
    layer scale and drop-path, as in AdaptFormer (custom_modules.py:L76-94).
    """

    def __init__(self, base: nn.Module, width: int, cfg: AdapterConfig) -> None:
        # AdaptFormer's "lora" init zeroes the down bias as well (models/adapter.py:L43-48).
        super().__init__(base, width, cfg, nn.ReLU(), zero_down_bias=True)
        self.family = block_family(base)

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        # timm blocks take attn_mask / is_causal keywords; pass whatever the caller gave.
        # custom_modules.py:L78-93: the branch reads x, the residual stream entering the MLP
        # sub-layer (a parallel block's input), and joins the sum outside the block's layer scale and drop-path.
        x, out = self.family.mlp_input_and_output(self.base, x, **kwargs)
        return out + self.adapter(x)


def _batched(wrapper: _Bottleneck, reads_output: bool) -> rows.Batched:
    """The bottleneck of every row at once: each row's down and up weights gathered, two bmm (eval: no dropout).

    ``reads_output``: the branch reads the wrapped module's output (sequential) or its input (parallel).  The scale
    is folded into ``up``, and where the activation allows it ``up``'s bias rides on one more unit
    (:func:`petl.model.rows.with_bias_unit`: the second ``bmm`` adds into the rows' output, no add of its own).  The
    neutral entry (all zeros: the down projection gives 0, act(0) is 0 for GELU and ReLU, and so is the up
    projection) adds exactly nothing.  Bottlenecks of different widths stack, zero-padded to the widest: a padded
    unit's column of ``up`` is zero.
    """
    norm = wrapper.norm
    eps = norm.eps if isinstance(norm, nn.LayerNorm) else None
    act = wrapper.act
    with torch.no_grad():
        down_w, down_b = wrapper.down.weight, wrapper.down.bias
        up_w, up_b = wrapper.scale * wrapper.up.weight, wrapper.scale * wrapper.up.bias
        unit = rows.with_bias_unit(down_w, down_b, up_w, up_b, act)
        tensors = list(unit) if unit is not None else [down_w, down_b, up_w, up_b]
        if eps is not None:
            tensors += [norm.weight, norm.bias]
        tensors = [t.detach() for t in tensors]
    count = len(tensors) - (2 if eps is not None else 0)  # the bottleneck's tensors, before the norm's

    def hidden(x: torch.Tensor | None, y: torch.Tensor, per_row: tuple[torch.Tensor, ...]) -> torch.Tensor:
        down_w, down_b, norm_wb = per_row[0], per_row[1], per_row[count:]
        h = y if reads_output else x
        if norm_wb:
            h = F.layer_norm(h, h.shape[-1:], eps=eps)
            h = torch.addcmul(rows.rows_vector(norm_wb[1], h), h, rows.rows_vector(norm_wb[0], h))
        return act(rows.rows_matmul(h, down_w, add=rows.rows_vector(down_b, h)))

    def post(x: torch.Tensor | None, y: torch.Tensor, per_row: tuple[torch.Tensor, ...]) -> torch.Tensor:
        up_w, *up_b = per_row[2:count]
        z = hidden(x, y, per_row)
        return rows.rows_matmul(z, up_w, add=y + rows.rows_vector(up_b[0], y) if up_b else y)

    def post_in_place(x: torch.Tensor | None, y: torch.Tensor, per_row: tuple[torch.Tensor, ...]) -> None:
        up_w, *up_b = per_row[2:count]
        z = hidden(x, y, per_row)  # before y changes: a sequential adapter reads it
        if up_b:
            y.add_(rows.rows_vector(up_b[0], y))
        rows.rows_matmul_(y, z, up_w)

    neutral = tuple(torch.zeros_like(t) for t in tensors)
    key = ("bottleneck", reads_output, repr(act), eps, unit is not None)
    pad = (0, 0, 1) + ((None,) if unit is None else ()) + ((None, None) if eps is not None else ())
    return rows.Batched(
        key, tuple(tensors), neutral, post=post, pad=pad, post_in_place=post_in_place, reads_input=not reads_output
    )


def _add_branch(
    wrapper: _Bottleneck, reads_output: bool
) -> Callable[[torch.Tensor | None, torch.Tensor, rows.Tokens], None]:
    """The served branch added into the rows' output in place (eval: no dropout; the scale folded into ``up``).

    Where the activation allows it, ``up``'s bias rides on one more hidden unit
    (:func:`petl.model.rows.with_bias_unit`), so that ``up`` and the add into the rows are one ``addmm_``.
    """
    norm, act = wrapper.norm, wrapper.act
    normed = not isinstance(norm, nn.Identity)
    with torch.no_grad():
        down_w, down_b = wrapper.down.weight, wrapper.down.bias
        up_w, up_b = wrapper.scale * wrapper.up.weight, wrapper.scale * wrapper.up.bias
        unit = rows.with_bias_unit(down_w, down_b, up_w, up_b, act)
    if unit is not None:
        # down and up transposed once, as tokens_linear and add_matmul_ take them
        like = rows.per_device(unit[0].t(), unit[1], unit[2].t())

        def add(x: torch.Tensor | None, y: torch.Tensor, _tokens: rows.Tokens) -> None:
            down_t, down_b, up_t = like(y)
            h = y if reads_output else x
            if normed:
                h = norm(h)
            rows.add_matmul_(y, act(rows.tokens_linear(h, down_t, down_b)), up_t)

        return add
    like = rows.per_device(down_w, down_b, up_w, up_b)

    def add_with_bias(x: torch.Tensor | None, y: torch.Tensor, _tokens: rows.Tokens) -> None:
        down_w, down_b, up_w, up_b = like(y)
        h = norm(y if reads_output else x)
        y.add_(F.linear(act(F.linear(h, down_w, down_b)), up_w, up_b))

    return add_with_bias


@rows.register_row_hook(SequentialAdapter)
@rows.register_row_hook(ParallelAdapter)
def _rows(wrapper: _Bottleneck) -> rows.RowHook:
    # The frozen MLP (sequential) or block (parallel) runs once for the mixed batch; each task's branch reads its
    # rows' MLP output or, at a block, the stream entering the MLP half (post's x), and adds to its rows' output.
    reads_output = isinstance(wrapper, SequentialAdapter)
    return rows.RowHook(
        wrapper.base,
        post=lambda x, y, _tokens: y + wrapper.adapter(y if reads_output else x),
        post_in_place=_add_branch(wrapper, reads_output),
        batched=_batched(wrapper, reads_output),
        reads_input=not reads_output,  # sequential: the MLP's output alone, so the routing slices no rows of its input
    )


def _formula(model: nn.Module, cfg: AdapterConfig) -> int:
    r = cfg.bottleneck
    # down: d*r + r, up: r*d + d, and the optional input LayerNorm 2*d, per block of width d.
    return sum(2 * d * r + r + d + (2 * d if cfg.norm else 0) for d in backbone_of(model).widths())


# The backbones adapter's idea fits: bottlenecks on the MLP output (sequential) or beside the block's MLP half
# (parallel): any block whose residual halves its family knows (pre-norm ViT and Swin, post-norm SwinV2).
BACKBONES = ("vit", "naflexvit", "swin", "swinv2", "swinv2_cr", "vit_relpos", "beit", "eva", "vit_parallel")


@register_method(
    "adapter", AdapterConfig, trainable_formula=_formula, zero_init=True, mergeable=False, backbones=BACKBONES
)
def inject_adapter(model: nn.Module, cfg: AdapterConfig) -> None:
    """Bottleneck adapter in every block (sequential after the MLP, or parallel/AdaptFormer)."""
    bb = backbone_of(model)
    kw = factory_kwargs(model)
    for i, (block, width) in enumerate(zip(bb.block_list(), bb.widths(), strict=True)):
        if cfg.style == "parallel":
            bb.set_block(i, ParallelAdapter(block, width, cfg).to(**kw))
        else:
            bb.set_feed_forward(block, SequentialAdapter(bb.feed_forward(block), width, cfg).to(**kw))


def apply_adapter(model: nn.Module, **options: Any) -> nn.Module:
    """Add a bottleneck adapter to every block of ``model`` and freeze everything else but the head.

    Args:
        model: a timm model of a backbone kind the method supports (its docs page; :func:`petl.list_backbones`).
        **options: fields of :class:`AdapterConfig` (``style``, ``dim``, ``dropout``, ``scale``,
            ``norm``, ``init``, ``num_classes``).

    Returns:
        The same model, modified in place.

    """
    return surgery.apply(model, "adapter", **options)
