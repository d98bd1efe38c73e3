"""HST, hierarchical side-tuning (Lin et al., 2023): a small pyramid network beside the ViT, fed by its blocks.

The frozen ViT gets one learned "meta token" in front of its tokens at every block (removed again after
the block), and its LayerNorms train.  A side network reads the image through a convolutional stem and
runs four stages of decreasing resolution (1/4, 1/8, 1/16, 1/32 of the image; widths 32, 48, 64, 72), one
side block per ViT block, three blocks a stage on ViT-B's twelve.  Side block ``i`` adds ViT block ``i``'s
patch features (resized to the stage's grid, projected to its width by the stage's bridge Linear) to its
tokens, and cross-attends from its tokens to two tokens: ViT block ``i``'s output meta token (bridged and
normalised) and the mean of the bridged patch features.  The classifier reads the side network's
average-pooled last stage, through a BatchNorm without affine parameters: HST replaces the model's head by
:class:`HstHead`, which reads the side network's output (the backbone's own norm and pooling still run,
unused).  The meta tokens sit in the backbone, so HST backpropagates through every block: unlike LST it
saves no backbone backward (the reference trains the same way).

Follows AFeng-x/HST@ee89571 models/vit_hsn.py: ``ViT_HSN.__init__`` L152-271 (stages, bridges
``T_Bridge_1..4``, per-block ``m_proj_norm``, meta tokens xavier-uniform, ``fc_norm`` BatchNorm1d without
affine, head on the last stage's width), ``freeze_vit`` L316-327 (what trains: every ``m_*`` module, the
bridges, the blocks' LayerNorms, the head), ``forward_features`` L332-395 (meta token in front at every
block, its output kept, patch tokens kept as a feature map; bridge + norm of the meta tokens; per stage
the patch embedding, bilinear resize + bridge of the ViT features, ``globalT`` = their mean, side blocks,
stage norm; mean pool) and ``forward`` L398-403; models/vit_custom_modules.py: ``M_C_Attention`` L131-162
(queries from the side tokens, keys and values from the two meta tokens), ``M_Block`` L165-205
(``x + attn(norm1(x), metaR); x + x_vit; x + mlp(norm2(x))``), ``Mlp_LE`` L96-128, ``OverlapPatchEmbed``
L208-244 (3x3 stride-2 conv + LayerNorm), ``Head`` L247-280 (3x3 stride-2 conv, BatchNorm, ReLU, 2x2
stride-2 conv, LayerNorm) and their inits (Linear trunc-normal 0.02 and zero bias, LayerNorm 1/0, conv
normal with std sqrt(2 / fan_out) and zero bias); defaults from ``ViT_HSN`` and
train_scripts/vit/vtab/*/train_s4.sh; LayerNorm eps 1e-6 in the side blocks and stage norms, 1e-5 in the
meta-token and patch-embedding norms, as there (``SIDE_EPS``).  V-PETL Bench publishes an HST row (0.78M) but
has no HST code.

Deliberate differences: the stages split the blocks evenly (the reference's ``block_indices`` 2, 5, 8, 11
on twelve blocks); a backbone with fewer blocks than stages uses its first ``depth`` stages.  The class
token and register tokens are the prefix tokens left out of the feature map (the reference drops one).  The
side blocks have no drop path (the reference's ``M_Block`` drops its two branches with ``DropPath`` at
``linspace(0, drop_path_rate)`` over the side blocks, vit_hsn.py L222, L233 and vit_custom_modules.py L178, L201-203:
``--drop-path`` is 0.1 in 12 of its 19 VTAB-1k scripts, 0.2 in one, 0 in six); petl's ``model.drop_path`` acts
on the backbone's blocks only.  The reference's constructor ends with ``init_weights`` (L270-271, L279,
``init_weights_vit_timm`` L406-413), which re-draws every ``nn.Linear`` of the side network trunc-normal(0.02)
with zero biases, the same draw its modules' own inits make and :func:`_init` makes here; its convolutions,
norms and meta tokens it leaves alone.

On the other ViT families (``vit_relpos``, BEiT, EVA, parallel blocks) the meta tokens in front of the sequence get
no position: the frozen attention gives them a zero relative-position bias or no rotation
(:meth:`petl.Backbone.make_room`, as VPT's prompts).  The LayerNorms that train are the blocks' pre-norms (a
parallel block's one ``in_norm``), and the side blocks' MLP ratio is the backbone's hidden width (what ``fc2``
reads) over its width.  A :class:`petl.MultiTask` mixed batch serves it on every family here: its meta tokens sit
in the batch's prompt slots, for which the shared blocks make the same room.

Trains:
    HST: a meta token per block, the blocks' LayerNorms, and a 4-stage side pyramid reading the image and the
    blocks; HST's own head (BatchNorm + Linear on the side network).

Reference:
    - AFeng-x/HST@ee89571 models/vit_hsn.py L152-271, L316-348, L332-403; models/vit_custom_modules.py L96-280;
      train_scripts/vit/vtab/*/train_s4.sh

Differences:
    - Stages split the blocks evenly (3, 3, 3, 3 on ViT-B, as ``block_indices`` 2/5/8/11); a backbone of fewer
      than four blocks uses its first stages: ``HstConfig.stages`` against ``models/vit_hsn.py`` L157,
      L247-256, L372-376.
    - Every prefix token (class, registers) is left out of the feature maps; the reference drops one:
      ``HstSide.step`` against ``models/vit_hsn.py`` L347.
    - Side blocks have no drop path; the reference's ``M_Block`` drops its branches at ``linspace(0, --drop-path)``
      (0.1 in 12 of its 19 VTAB-1k scripts, 0.2 in one, 0 in six); petl's ``model.drop_path`` acts on the backbone's
      blocks only: ``_CrossBlock`` against ``models/vit_hsn.py`` L222, L233;
      ``models/vit_custom_modules.py`` L178, L201-203.
    - re-draw: yes, ``init_weights`` re-draws every Linear trunc_normal(0.02) with zero bias, the draw its modules
      already make and petl's ``_init`` makes (convs, norms and meta tokens untouched); no difference.  LayerNorm eps
      as there: 1e-6 in the side blocks and stage norms, 1e-5 in the meta-token and patch-embedding norms:
      ``SIDE_EPS``, ``_init`` against ``models/vit_hsn.py`` L188, L230-235, L249-255, L270-279,
      L406-413; ``models/vit_custom_modules.py`` L219, L254.
    - The fresh head is PyTorch's default Linear, where HST's ``init_weights`` (``models/vit_hsn.py`` L268-271)
      draws it trunc_normal(0.02).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from timm.layers import trunc_normal_
from torch import nn

from petl.methods import _side
from petl.model import rows, surgery
from petl.model.backbone import backbone_of
from petl.model.registry import MethodConfig, register_method
from petl.model.wrappers import PetlHead, PetlModule, factory_kwargs
from petl.utils.checks import check_range, to_str_tuple

# ViT_HSN's norm_layer, partial(nn.LayerNorm, eps=1e-6) (vit_hsn.py L188), builds the side blocks' norm1/norm2
# (L230-234, vit_custom_modules.py L170, L179) and the stage norms m_norm (L235).  The per-block meta-token norms
# m_proj_norm (L249-255) and the patch embeddings' norms (vit_custom_modules.py L219, L254) are plain
# nn.LayerNorm, eps 1e-5, and stay so here.
SIDE_EPS = 1e-6


@dataclass
class HstConfig(MethodConfig):
    """Options of HST.

    Attributes:
        dims: width of each side stage (``m_embed_dims``, 32, 48, 64, 72); integers, kept as strings so that
            the CLI schema stays plain (``method.dims=[16,24]`` or ``dims=(16, 24)`` both work).
        heads: attention heads of each stage's side blocks (``m_c_num_heads``, 2, 4, 8, 12), likewise.
        meta_tokens: meta tokens in front of every ViT block (``metaG_num``, 1).

    """

    dims: tuple[str, ...] = ("32", "48", "64", "72")
    heads: tuple[str, ...] = ("2", "4", "8", "12")
    meta_tokens: int = 1

    def __post_init__(self) -> None:
        self.dims, self.heads = to_str_tuple(self.dims, "dims"), to_str_tuple(self.heads, "heads")

    @property
    def widths(self) -> tuple[int, ...]:
        """``dims`` as integers."""
        return _ints("dims", self.dims)

    @property
    def head_counts(self) -> tuple[int, ...]:
        """``heads`` as integers."""
        return _ints("heads", self.heads)

    def stages(self, model: nn.Module) -> list[list[int]]:
        """The ViT blocks feeding each stage: contiguous, as even as possible (3 per stage on 12 blocks)."""
        depth = backbone_of(model).depth()
        count = min(len(self.widths), depth)
        bounds = [round(i * depth / count) for i in range(count + 1)]
        return [list(range(bounds[i], bounds[i + 1])) for i in range(count)]

    def validate(self, model: nn.Module) -> None:
        super().validate(model)
        if not self.dims or len(self.dims) != len(self.heads):
            raise ValueError(f"dims={list(self.dims)} and heads={list(self.heads)} must name the same stages")
        for dim, heads in zip(self.widths, self.head_counts, strict=True):
            check_range("dims", dim, low=1)
            check_range("heads", heads, low=1)
            if dim % heads:
                raise ValueError(f"dims: a stage of width {dim} cannot split into {heads} heads")
        check_range("meta_tokens", self.meta_tokens, low=1)
        if self.num_classes == 0 or not (self.num_classes or backbone_of(model).num_classes()):
            raise ValueError(
                "HST classifies from its side network with a head of its own: give num_classes (at least 1)"
            )
        backbone_of(model).check_whole_grid("HST")


def _ints(field: str, values: tuple[str, ...]) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in values)
    except ValueError:
        raise ValueError(f"{field}={list(values)}: give whole numbers, one per stage") from None


def _init(module: nn.Module) -> None:
    """The reference's init of its side modules (vit_custom_modules.py L107-120)."""
    if isinstance(module, nn.Linear):
        trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Conv2d):
        fan_out = module.kernel_size[0] * module.kernel_size[1] * module.out_channels // module.groups
        nn.init.normal_(module.weight, std=math.sqrt(2.0 / fan_out))
        if module.bias is not None:
            nn.init.zeros_(module.bias)


class _CrossBlock(nn.Module):
    """HST's side block: cross-attention to the two meta tokens, the ViT features added, an MLP."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim, eps=SIDE_EPS)
        self.q, self.k, self.v, self.proj = (nn.Linear(dim, dim) for _ in range(4))
        self.norm2 = nn.LayerNorm(dim, eps=SIDE_EPS)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor, meta: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        h = self.norm1(x)
        q = self.q(h).reshape(b, n, self.heads, d // self.heads).transpose(1, 2)
        k = self.k(meta).reshape(b, -1, self.heads, d // self.heads).transpose(1, 2)
        v = self.v(meta).reshape(b, -1, self.heads, d // self.heads).transpose(1, 2)
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)
        x = x + self.proj(attended) + features
        return x + self.mlp(self.norm2(x))


class _Stem(nn.Module):
    """HST's first patch embedding: conv 3x3 stride 2, BatchNorm, ReLU, conv 2x2 stride 2 (1/4 resolution)."""

    def __init__(self, dim: int, in_chans: int) -> None:
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(in_chans, dim, 3, 2, padding=1, bias=False),
            nn.BatchNorm2d(dim),
            nn.ReLU(),
            nn.Conv2d(dim, dim, kernel_size=2, stride=2),
        )
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class _Downsample(nn.Module):
    """HST's later patch embeddings: conv 3x3 stride 2 (``OverlapPatchEmbed``), then the LayerNorm."""

    def __init__(self, in_dim: int, dim: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_dim, dim, 3, 2, padding=1)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class HstSide(_side.SideNetwork):
    """HST's meta tokens, bridges and hierarchical side network (see the module docstring).

    Args:
        model: the ViT it runs beside.
        cfg: the method's options.

    """

    def __init__(self, model: nn.Module, cfg: HstConfig) -> None:
        bb = backbone_of(model)
        depth, d = bb.depth(), bb.width()
        super().__init__(depth)
        kw = factory_kwargs(model)
        self.stage_blocks = cfg.stages(model)
        dims, heads = cfg.widths[: len(self.stage_blocks)], cfg.head_counts[: len(self.stage_blocks)]
        self.num_meta, self.num_prefix, self.grid = (
            cfg.meta_tokens,
            bb.num_prefix_tokens(),
            bb.grid_size(),
        )
        self.stage_of = [s for s, blocks in enumerate(self.stage_blocks) for _ in blocks]
        mlp_ratio = _side.mlp_ratio(model)
        in_chans = bb.patch_proj().in_channels
        self.meta = nn.ParameterList([nn.Parameter(torch.empty(1, cfg.meta_tokens, d)) for _ in range(depth)])
        self.embeds = nn.ModuleList(
            [_Stem(dims[0], in_chans)] + [_Downsample(dims[s - 1], dims[s]) for s in range(1, len(dims))]
        )
        self.bridges = nn.ModuleList([nn.Linear(d, dim) for dim in dims])
        self.meta_norms = nn.ModuleList([nn.LayerNorm(dims[s]) for s in self.stage_of])
        self.side_blocks = nn.ModuleList(
            [_CrossBlock(dims[s], heads[s], mlp_ratio) for s in self.stage_of]
        )  # one per ViT block
        self.stage_norms = nn.ModuleList([nn.LayerNorm(dim, eps=SIDE_EPS) for dim in dims])
        self.apply(_init)
        for meta in self.meta:
            nn.init.xavier_uniform_(meta)
        self.to(**kw)
        self.width = dims[-1]
        self._image: torch.Tensor | None = None
        self._metas: list[torch.Tensor] = []
        self._features: list[torch.Tensor] = []
        self.output: torch.Tensor | None = None

    def step(self, index: int, block: nn.Module, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        m, p = self.num_meta, self.num_prefix
        x = block(torch.cat([self.meta_tokens(index, x), x], dim=1), **kwargs)
        self.record(index, x[:, :m], x[:, m + p :])
        return x[:, m:]

    def meta_tokens(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Block ``index``'s meta tokens for every row of ``x``, in its dtype."""
        return self.meta[index].expand(x.shape[0], -1, -1).to(x.dtype)

    def record(self, index: int, meta: torch.Tensor, patches: torch.Tensor) -> None:
        """Keep block ``index``'s output meta tokens and patch tokens; after the last block, run the side network."""
        if index == 0:
            self._metas, self._features = [], []
        self._metas.append(meta)
        b, n, d = patches.shape
        rows, cols = self.grid
        if n != rows * cols:  # an image of another size (timm's dynamic_img_size): the side network's grid is fixed
            raise ValueError(f"HST expects {rows}x{cols} patch tokens, got {n}: give images of the model's size")
        self._features.append(patches.transpose(1, 2).reshape(b, d, rows, cols))
        if index == self.depth - 1:
            self.output = self.side_forward()
            self._image, self._metas, self._features = None, [], []

    def keep_image(self, images: torch.Tensor) -> None:
        """Hold the images for the side network's stem (the patch projection hands them over)."""
        self._image = images

    def row_hook(self, index: int, block: nn.Module) -> rows.RowHook:
        """The meta tokens as prompts in the batch's slots (rewritten at every block, never pooled).

        The side network reads the task's rows of each block's output: meta tokens from the slots, patch
        tokens after them.
        """
        m = self.num_meta
        like = rows.per_device(self.meta[index])  # cast once per device and dtype, not at every call

        def pre(x: torch.Tensor, tokens: rows.Tokens) -> torch.Tensor:
            p = tokens.prefix
            return torch.cat([x[:, :p], like(x)[0].expand(x.shape[0], -1, -1), x[:, p + m :]], dim=1)

        def post(x: torch.Tensor, y: torch.Tensor, tokens: rows.Tokens) -> None:
            p = tokens.prefix
            self.record(index, y[:, p : p + m], y[:, p + tokens.slots :])

        return rows.RowHook(block, pre=pre, post=post, prompts=m, pool_prompts=False)

    def side_forward(self) -> torch.Tensor:
        """The hierarchical side network on the stored image, meta tokens and ViT features: pooled features."""
        if self._image is None:
            raise RuntimeError("HST's side network needs the image: run the whole model, not its blocks alone")
        h = self._image
        for s, blocks in enumerate(self.stage_blocks):
            h = self.embeds[s](h)
            b, width, rows, cols = h.shape
            tokens = self.embeds[s].norm(h.flatten(2).transpose(1, 2))
            bridge = self.bridges[s]
            for i in blocks:
                features = F.interpolate(self._features[i], size=(rows, cols), mode="bilinear", align_corners=False)
                features = bridge(features.flatten(2).transpose(1, 2))
                meta = self.meta_norms[i](bridge(self._metas[i]))
                meta = torch.cat([meta, features.mean(dim=1, keepdim=True)], dim=1)
                tokens = self.side_blocks[i](tokens, meta, features)
            tokens = self.stage_norms[s](tokens)
            h = tokens.transpose(1, 2).reshape(b, width, rows, cols)
        return tokens.mean(dim=1)


class HstPatchProj(PetlModule):
    """The frozen patch projection, handing the image to HST's side network on the way."""

    def __init__(self, base: nn.Module, side: HstSide) -> None:
        super().__init__(base)
        self._shared = [side]  # registered under block 0

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        self._shared[0].keep_image(images)
        return self.base(images)


@rows.register_row_hook(HstPatchProj)
def _rows(wrapper: HstPatchProj) -> rows.RowHook:
    # The projection runs once for the batch; each task's side network keeps its own rows' images.
    return rows.RowHook(wrapper.base, pre=lambda images, _tokens: wrapper._shared[0].keep_image(images))


class HstHead(PetlHead):
    """HST's classifier: BatchNorm without affine parameters (``fc_norm``), then a Linear on the side network.

    timm calls the head on the backbone's pooled features; HST classifies the side network's instead, so
    the input is ignored.  The BatchNorm is written out here so that its running statistics belong to the
    module whose (trained) parameters are the classifier's, and are saved with them.

    Args:
        side: the side network (registered under block 0).
        width: the side network's output width.
        num_classes: classifier outputs.
        kw: device and dtype.

    """

    # Why timm's prune_intermediate_layers may not drop blocks under this head (petl.model.timm_api refuses it).
    needs_every_block = "its head classifies the side network's output, which reads every block"

    def __init__(self, side: HstSide, width: int, num_classes: int, kw: dict[str, Any]) -> None:
        super().__init__()
        self._shared = [side]
        linear = nn.Linear(width, num_classes, **kw)  # PyTorch's default init, as every petl head
        self.weight, self.bias = linear.weight, linear.bias
        self.register_buffer("running_mean", torch.zeros(width, **kw))
        self.register_buffer("running_var", torch.ones(width, **kw))

    def forward(self, _pooled: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """The logits, or with ``pre_logits`` the normed side-network features the Linear reads (timm's pre-logits)."""
        side = self._shared[0]
        features, side.output = side.output, None
        if features is None:
            raise RuntimeError("HST's head reads the side network's output: run the whole model")
        features = F.batch_norm(features, self.running_mean, self.running_var, training=self.training, eps=1e-6)
        return features if pre_logits else F.linear(features, self.weight, self.bias)

    def for_classes(self, num_classes: int) -> HstHead:
        """A fresh head on the same side network for ``num_classes`` classes (``reset_classifier``)."""
        kw = {"device": self.weight.device, "dtype": self.weight.dtype}
        return HstHead(self._shared[0], self.weight.shape[1], num_classes, kw)


def _block_norms(model: nn.Module) -> list[nn.Module]:
    """The blocks' pre-norms, which HST trains: norm1 and norm2 of a ViT block, a parallel block's one in_norm."""
    bb = backbone_of(model)
    return [bb.block_norm(block, name) for block in bb.block_list() for name, _ in bb.norm_groups]


def _formula(model: nn.Module, cfg: HstConfig) -> int:
    bb = backbone_of(model)
    d, depth = bb.width(), bb.depth()
    stages = cfg.stages(model)
    dims = cfg.widths[: len(stages)]
    in_chans = bb.patch_proj().in_channels
    ratio = _side.mlp_ratio(model)
    total = depth * cfg.meta_tokens * d + sum(p.numel() for norm in _block_norms(model) for p in norm.parameters())
    total += in_chans * dims[0] * 9 + 2 * dims[0] + dims[0] * dims[0] * 4 + dims[0]  # stem convs + BatchNorm
    total += sum(dims[s - 1] * dims[s] * 9 + dims[s] for s in range(1, len(dims)))  # stride-2 convs
    total += sum(2 * dim + (d * dim + dim) + 2 * dim for dim in dims)  # embed norms, bridges, stage norms
    for s, blocks in enumerate(stages):
        dim, hidden = dims[s], int(dims[s] * ratio)
        block = 2 * dim + 4 * (dim * dim + dim) + 2 * dim + (dim * hidden + hidden) + (hidden * dim + dim)
        total += len(blocks) * (block + 2 * dim)  # side blocks and per-block meta-token norms
    return total


# The backbones hst's idea fits: a side network over the patch grid with meta tokens, reading every block of one width.
BACKBONES = ("vit", "vit_relpos", "beit", "eva", "vit_parallel")
# Why not on the other backbone kinds (the refusal says it, and so does the docs page).
REFUSAL = (
    "its side network reads every block's tokens of one width through meta tokens in one flat sequence, "
    "and a Swin has stages of other widths and windowed grids"
)


@register_method(
    "hst",
    HstConfig,
    trainable_formula=_formula,
    backbones=BACKBONES,
    refusal=REFUSAL,
    refusal_for=("swin", "swinv2", "swinv2_cr"),
    refusals={
        "naflexvit": "its side network's stem reads the image the patch projection reads, and a NaFlexVit's "
        "projection is a Linear over the image already cut into patches"
    },
)
def inject_hst(model: nn.Module, cfg: HstConfig) -> None:
    """HST: meta tokens in every block, trained LayerNorms, and a hierarchical side network that classifies."""
    bb = backbone_of(model)
    side = HstSide(model, cfg)
    for block in bb.block_list():
        # The meta tokens have no position: no relative-position bias, no rotation (nothing to do in a ViT).
        bb.make_room(block, 0)
    _side.install(model, side)
    for norm in _block_norms(model):
        norm.requires_grad_(True)
    bb.set_patch_proj(HstPatchProj(bb.patch_proj(), side))
    bb.set_head(HstHead(side, side.width, bb.num_classes(), factory_kwargs(model)))


def apply_hst(model: nn.Module, **options: Any) -> nn.Module:
    """Add HST's meta tokens and hierarchical side network to ``model``; freeze the rest but its LayerNorms and head.

    Args:
        model: a timm model of a backbone kind the method supports (its docs page; :func:`petl.list_backbones`).
        **options: fields of :class:`HstConfig` (``dims``, ``heads``, ``meta_tokens``, ``num_classes``).

    Returns:
        The same model, modified in place.

    """
    return surgery.apply(model, "hst", **options)
