"""DTL, disentangled transfer learning (Fu et al., AAAI 2024): a compact side network of low-rank maps.

Before every block, a rank-``rank`` map ``B A x`` of the block's input is added to a running sum ``r``
(the "compact side network", CSN); from block ``add_from`` on, after each block, ``swish(r, beta)``
(``r * sigmoid(beta * r)``) is added back into the residual stream.  Only the blocks after ``add_from``
see trainable features, so the backward stops there: the first ``add_from + 1`` blocks run as a
frozen feature extractor.  ``fusion_size`` > 0 is DTL+: the added features of the patch tokens first
pass a depthwise ``fusion_size`` x ``fusion_size`` convolution on their image grid (the class and
register tokens pass unchanged).  B starts at zero, so the model is unchanged at init.

Follows heekhero/DTL@bf6c51e models/vision_transformer.py: ``LoRALinear`` L47-68 (A kaiming-uniform,
B zero, no bias, ``x A^T B^T``), ``swish`` L44-45, the CSN and the depthwise fusion conv (no bias,
``padding='same'``, ``groups=embed_dim``) L359-367, the forward L424-444; defaults from train_vit_vtab.py
L74-78 and train_scripts/vit/vtab/*/train_dtl.sh (r 2, beta 100, LoRA before blocks 0-11, added after
blocks 6-11, fusion_size 0 for DTL, 3 for DTL+).  V-PETL Bench's ``vision_transformer_dtl.py`` is a copy of
its VPT-Shallow model and its ``train_model_dtl.py`` a copy of its SCT script: it has no DTL code.

Deliberate differences: DTL's model averages the patch tokens and then applies the final norm
(vision_transformer.py L446-448); petl keeps the backbone's own norm and pooling, as for every method, so
rows compare on the same head.  ``add_from`` is 6 on ViT-B's 12 blocks, half the depth elsewhere.

On the other ViT families (``vit_relpos``, BEiT, EVA, parallel blocks) the side path reads each block's input
and adds to its output as on the ViT: the blocks' own position terms (a relative-position bias, a rotary
embedding) act inside the frozen blocks, which run as timm calls them.  DTL+'s convolution runs over the patch grid
after the prefix tokens.

Trains:
    DTL: a rank-2 side network summed over the blocks, ``swish`` of it added back after the later blocks; only
    those are backpropagated.  ``fusion_size=3`` is DTL+.

Reference:
    - heekhero/DTL@bf6c51e models/vision_transformer.py L44-68, L359-367, L424-444; train_vit_vtab.py L74-78;
      train_scripts/vit/vtab/*/train_dtl.sh

Differences:
    - petl keeps the backbone's final norm and pooling; DTL averages the patch tokens, then norms:
      petl: timm's ``forward_head`` runs against ``models/vision_transformer.py`` L446-448.
    - ``add_from`` is half the depth on any backbone (6 on ViT-B, as DTL's scripts); the reference's fusion hard-codes
      ViT-B's 14x14 grid: ``DtlConfig.first_add`` against ``train_scripts/vit/vtab/*/train_dtl.sh``
      (``--add_after_blocks 6-11``), ``models/vision_transformer.py`` L437-438.
    - re-draw: none.  ``init_weights`` runs before the low-rank maps and the fusion conv are built, so A
      kaiming-uniform, B zero and the conv's PyTorch default reach training, as in petl:
      ``DtlSide.__init__`` against ``models/vision_transformer.py`` L357, L362-367.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from petl.methods import _side
from petl.model import rows, surgery
from petl.model.backbone import backbone_of
from petl.model.registry import MethodConfig, register_method
from petl.model.wrappers import factory_kwargs
from petl.utils.checks import check_nonzero, check_range


@dataclass
class DtlConfig(MethodConfig):
    """Options of DTL.

    Attributes:
        rank: rank r of each block's low-rank map (``--r``, 2).
        beta: the swish's sharpness, ``r * sigmoid(beta * r)`` (``--beta``, 100).
        add_from: the first block after which the side features are added (``--add_after_blocks 6-11``);
            ``None`` picks half the depth (6 on ViT-B).
        fusion_size: kernel of the depthwise conv on the added patch features; 0 is DTL (no conv), 3 is
            DTL+ (``--fusion_size``).

    """

    # The frozen blocks before add_from see no trainable tensor: a speed floor of its own (petl.bench.speed).
    side_network: ClassVar[bool] = True

    rank: int = 2
    beta: float = 100.0
    add_from: int | None = None
    fusion_size: int = 0

    def first_add(self, model: nn.Module) -> int:
        """The block after which the side features are first added on ``model``."""
        return backbone_of(model).depth() // 2 if self.add_from is None else self.add_from

    def validate(self, model: nn.Module) -> None:
        super().validate(model)
        check_range("rank", self.rank, low=1)
        check_nonzero("beta", self.beta, "the swish gate")
        check_range("add_from", self.first_add(model), low=0, high=backbone_of(model).depth() - 1)
        check_range("fusion_size", self.fusion_size, low=0)
        if self.fusion_size and self.fusion_size % 2 == 0:
            raise ValueError(f"fusion_size={self.fusion_size} must be odd (or 0): the conv keeps the token grid")
        if self.fusion_size:
            backbone_of(model).check_whole_grid(f"DTL+ (fusion_size={self.fusion_size})")


class DtlSide(_side.SideNetwork):
    """DTL's compact side network: per block a low-rank map, and the optional depthwise fusion conv.

    Args:
        model: the ViT it runs beside (width, depth, token grid).
        cfg: the method's options.

    """

    def __init__(self, model: nn.Module, cfg: DtlConfig) -> None:
        bb = backbone_of(model)
        depth, d = bb.depth(), bb.width()
        super().__init__(depth)
        kw = factory_kwargs(model)
        self.beta, self.add_from = cfg.beta, cfg.first_add(model)
        self.grid, self.num_prefix = bb.grid_size(), bb.num_prefix_tokens()
        self.lora_a = nn.ParameterList([nn.Parameter(torch.empty(cfg.rank, d, **kw)) for _ in range(depth)])
        self.lora_b = nn.ParameterList([nn.Parameter(torch.zeros(d, cfg.rank, **kw)) for _ in range(depth)])
        for a in self.lora_a:
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        k = cfg.fusion_size
        self.fusion = (
            nn.Conv2d(d, d, k, padding="same", groups=d, bias=False, **kw) if k else nn.Identity()
        )  # PyTorch's default conv init, as the reference (built after its init_weights)
        self._sum: torch.Tensor | None = None

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The depthwise conv over the patch tokens' grid; prefix tokens pass unchanged."""
        if isinstance(self.fusion, nn.Identity):
            return features
        b, n, d = features.shape
        (rows, cols), p = self.grid, self.num_prefix
        if n - p != rows * cols:
            raise ValueError(f"DTL+ expects {p} prefix + {rows}x{cols} patch tokens, got {n} tokens")
        patches = features[:, p:].transpose(1, 2).reshape(b, d, rows, cols)
        patches = self.fusion(patches).reshape(b, d, rows * cols).transpose(1, 2)
        return torch.cat([features[:, :p], patches], dim=1)

    def step(self, index: int, block: nn.Module, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.accumulate(index, x)
        y = block(x, **kwargs)
        added = self.added(index)
        return y if added is None else y + added

    def accumulate(self, index: int, x: torch.Tensor) -> None:
        """Add block ``index``'s low-rank map of its input ``x`` to the running sum."""
        low_rank = x @ self.lora_a[index].t() @ self.lora_b[index].t()
        self._sum = low_rank if index == 0 else self._sum + low_rank

    def added(self, index: int) -> torch.Tensor | None:
        """What is added to block ``index``'s output: ``fuse(swish(sum))`` from ``add_from`` on, else ``None``."""
        added = None
        if index >= self.add_from:
            added = self.fuse(self._sum * torch.sigmoid(self.beta * self._sum))
        if index == self.depth - 1:
            self._sum = None  # no graph kept between forwards
        return added

    def row_hook(self, index: int, block: nn.Module) -> rows.RowHook:
        """The frozen block once for the batch; the task's running sum and additions on its rows.

        Served (no autograd), in fewer ops than :meth:`step`, the same function up to rounding: the running sum gets
        each block's map added (a matmul and an ``addmm``), with ``beta`` folded into ``B`` so that the
        swish is one SiLU, ``silu(beta r) / beta``, added into the block's output in place with the ``1 / beta`` as
        the add's alpha (and in DTL+'s convolution's weights, a linear map).  The sum runs over every token, the
        batch's prompt slots too: a token-wise map, and what it adds there is never read, since a row of a task
        without prompts has its slots masked out of attention and pooling (as Convpass's bypass); DTL+'s convolution
        reads the patch tokens after the slots.
        """
        with torch.no_grad():
            # A and B transposed once, as tokens_linear and addmm take them (a transpose is an op to dispatch).
            like = rows.per_device(self.lora_a[index].t(), (self.beta * self.lora_b[index]).t())
            fusion = None if isinstance(self.fusion, nn.Identity) else self.fusion.weight / self.beta
            conv = rows.per_device(fusion) if fusion is not None else None

        def pre(x: torch.Tensor, tokens: rows.Tokens) -> None:
            a_t, b_t = like(x)
            z = rows.tokens_linear(x, a_t)  # every token a row: tokens x rank
            if index == 0:
                self._sum = rows.tokens_linear(z, b_t).view(x.shape)
            else:  # a new sum (not addmm_: under autograd the last block's SiLU holds the old one)
                self._sum = torch.addmm(self._sum.view(-1, b_t.shape[1]), z, b_t).view(self._sum.shape)

        def post_in_place(_x: torch.Tensor | None, y: torch.Tensor, tokens: rows.Tokens) -> None:
            act = F.silu(self._sum)
            if index == self.depth - 1:
                self._sum = None  # nothing kept between forwards
            if conv is None:
                y.add_(act, alpha=1 / self.beta)
                return
            first = tokens.prefix + tokens.slots  # the patch tokens' grid starts after the slots
            (r, c), d = self.grid, act.shape[-1]
            patches = act[:, first:].transpose(1, 2).reshape(act.shape[0], d, r, c)
            fused = F.conv2d(patches, conv(act)[0], padding=self.fusion.padding, groups=d)
            y[:, :first].add_(act[:, :first], alpha=1 / self.beta)
            y[:, first:].add_(fused.view(*fused.shape[:2], -1).transpose(1, 2))

        # post reads the running sum and y alone: the routing slices no rows of x for it.
        in_place = post_in_place if index >= self.add_from else None
        return rows.RowHook(block, pre=pre, post_in_place=in_place, reads_input=False)


def _formula(model: nn.Module, cfg: DtlConfig) -> int:
    bb = backbone_of(model)
    d = bb.width()
    # A (r x d) and B (d x r) per block, and the depthwise conv's d * k * k weights (no bias).
    return bb.depth() * 2 * cfg.rank * d + d * cfg.fusion_size**2


# The backbones dtl's idea fits: a low-rank side path over a flat token sequence with one width, fused by convolution
# over the patch grid.
BACKBONES = ("vit", "naflexvit", "vit_relpos", "beit", "eva", "vit_parallel")
# Why not on the other backbone kinds (the refusal says it, and so does the docs page).
REFUSAL = (
    "its side path is one running sum of every block's low-rank map at one width, fused over one patch "
    "grid, and a Swin's width and grid change per stage"
)


@register_method(
    "dtl",
    DtlConfig,
    trainable_formula=_formula,
    zero_init=True,
    backbones=BACKBONES,
    refusal=REFUSAL,
    refusal_for=("swin", "swinv2", "swinv2_cr"),
)
def inject_dtl(model: nn.Module, cfg: DtlConfig) -> None:
    """DTL: a low-rank side network summed over the blocks and added back after the later ones."""
    _side.install(model, DtlSide(model, cfg))


def apply_dtl(model: nn.Module, **options: Any) -> nn.Module:
    """Add DTL's side network to ``model`` and freeze everything else but the head.

    Args:
        model: a timm model of a backbone kind the method supports (its docs page; :func:`petl.list_backbones`).
        **options: fields of :class:`DtlConfig` (``rank``, ``beta``, ``add_from``, ``fusion_size``,
            ``num_classes``).

    Returns:
        The same model, modified in place.

    """
    return surgery.apply(model, "dtl", **options)
