"""SCT, salient channel tuning: a small Linear on a few task-salient channels of the residual stream.

In every block, right after the attention residual, the ``top_n`` selected channels ``x[..., idx]``
get ``x[..., idx] + W x[..., idx] + b`` (Zhao et al., 2024, "SCT: A Simple Baseline for
Parameter-Efficient Fine-Tuning via Salient Channels"); the rest of the block is untouched.

The channels come from the task's data: :func:`select_sct_channels` runs the frozen backbone over
the training images and keeps, per block, the ``top_n`` channels with the largest class-averaged L2
norm of the patch tokens entering the MLP half.  ``petl-run`` does this itself: SCT registers
:func:`calibrate_sct` as its ``calibrate`` hook, which the runner calls on the pretrained backbone
with the training split (without augmentation) before injecting, and the chosen channels are recorded
in ``result.json``'s ``method_config``, the checkpoint and ``trainable.safetensors``.  From Python,
:func:`petl.apply` does not look at data: call ``cfg = calibrate_sct(backbone, SctConfig(), loader)``
first (or pass ``channels=select_sct_channels(backbone, loader)``).  Without ``channels`` the method
uses a deterministic, data-free placeholder, the first ``top_n`` channels of every block, so that it
can be built and tested anywhere; that is NOT the paper's selection.

Follows synbol/Parameter-Efficient-Transfer-Learning-Benchmark@c188fad (V-PETL Bench):
ImageClassification/models/vision_transformer_sct.py L272-307 (``ChannelAdapter``: Linear(topN, topN),
trunc-normal std 0.02 weight, zero bias, added to the selected channels) and L340-346 (``sct_attn``:
applied between the attention and MLP residuals); ImageClassification/train/train_model_sct.py
L21-110 (``getSalientChannels``: hook the input of ``blocks.i.norm2``, drop the class token, per
class the L2 norm over samples and tokens, mean over classes, top-N) and scripts/run_model_sct.sh
(topN 96, tuning_mode sct_attn).  The reference's ``scale`` option is unused by its forward
(commented out at L298-302), so petl has none.

On ``vit_relpos``, BEiT and EVA the channels are tuned on the stream between the block's two residual halves as
the family computes them (:meth:`petl.Backbone.attn_residual`: BEiT's and EVA's ``gamma_1`` layer scale inside the
attention half, the relative-position bias or rotary embedding passed to the attention); the salient channels are
measured at the input of the MLP's norm, as on the ViT.  A parallel block has one residual: refused there.

Trains:
    a Linear on the selected residual channels after each attention.

    ``channels`` empty: ``petl-run`` selects them on the train split, without augmentation, before training and
    records them in ``result.json``; from Python call ``cfg = petl.methods.sct.calibrate_sct(backbone, cfg, loader)``
    first, as ``petl.apply`` alone uses the first ``top_n``, a data-free placeholder.

Reference:
    - synbol/Parameter-Efficient-Transfer-Learning-Benchmark@c188fad
      ImageClassification/models/vision_transformer_sct.py L272-307, L340-346;
      ImageClassification/train/train_model_sct.py L21-110; scripts/run_model_sct.sh

Differences:
    - No ``scale`` option: the reference's is unused by its forward (commented out at L298-302).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, replace
from itertools import islice
from typing import Any

import torch
from torch import nn

from petl.model import rows, surgery
from petl.model.backbone import backbone_of, block_family
from petl.model.registry import MethodConfig, register_method
from petl.model.wrappers import PetlModule, factory_kwargs
from petl.utils.checks import as_list, check_range
from petl.utils.progress import bar_over_first

log = logging.getLogger(__name__)

# The reference's topN=96 on ViT-B's 768 channels: one in eight.
DEFAULT_FRACTION = 8


@dataclass
class SctConfig(MethodConfig):
    """Options of SCT.

    Attributes:
        top_n: channels tuned per block; ``None`` picks embed_dim // 8 (96 on ViT-B, the reference's topN).
        channels: per block, the ``top_n`` channel indices to tune (from :func:`select_sct_channels`),
            stored as one comma-separated string per block (``("3,17,40", ...)``) so that the CLI
            schema and the saved config stay plain; lists of ints and a ``;``-separated string
            (``"3,17,40;1,2,5"``) are accepted too.  Empty means the data-free placeholder
            ``0 .. top_n-1`` in every block.

    """

    top_n: int | None = None
    channels: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.channels = _normalise_channels(self.channels)

    def width(self, model: nn.Module) -> int:
        """The number of tuned channels per block on ``model``."""
        return backbone_of(model).width() // DEFAULT_FRACTION if self.top_n is None else self.top_n

    def channel_indices(self) -> tuple[tuple[int, ...], ...]:
        """``channels`` parsed into one tuple of ints per block."""
        return tuple(tuple(int(c) for c in block.split(",")) for block in self.channels)

    def channels_for(self, model: nn.Module) -> tuple[tuple[int, ...], ...]:
        """The channel indices per block: ``channels`` or the placeholder."""
        if self.channels:
            return self.channel_indices()
        return tuple(tuple(range(self.width(model))) for _ in range(backbone_of(model).depth()))

    def validate(self, model: nn.Module) -> None:
        bb = backbone_of(model)
        super().validate(model)
        d, depth = bb.width(), bb.depth()
        check_range("top_n", self.width(model), low=1, high=d)
        if not self.channels:
            return
        if len(self.channels) != depth:
            raise ValueError(f"channels lists {len(self.channels)} blocks; the model has {depth}")
        for i, block in enumerate(self.channel_indices()):
            if len(block) != self.width(model) or len(set(block)) != len(block):
                raise ValueError(f"channels[{i}] must hold {self.width(model)} distinct indices, got {len(block)}")
            if min(block) < 0 or max(block) >= d:
                raise ValueError(f"channels[{i}] has an index outside [0, {d - 1}]")


def _normalise_channels(value: Any) -> tuple[str, ...]:
    """Per-block channel lists in any accepted form -> one ``"i,j,k"`` string per block."""
    wanted = "one list of channel indices per block"
    blocks = (
        [part for part in value.split(";") if part.strip()]
        if isinstance(value, str)
        else as_list(value, "channels", wanted)
    )
    out = []
    for block in blocks:
        items = block.replace(",", " ").split() if isinstance(block, str) else as_list(block, "channels", wanted)
        if not items:
            raise ValueError(f"channels={value!r} has an empty block: give each block its channel indices")
        try:
            out.append(",".join(str(int(item)) for item in items))
        except (TypeError, ValueError) as err:
            raise ValueError(f"channels={value!r}: every entry must be a list of channel indices ({err})") from err
    return tuple(out)


class SctBlock(PetlModule):
    """A frozen pre-norm block whose residual stream gets ``x[..., idx] += W x[..., idx] + b`` after attention.

    Args:
        base: the timm Block; it stays frozen and is kept as ``base``.
        channels: the indices ``idx`` of the tuned channels.

    """

    def __init__(self, base: nn.Module, channels: tuple[int, ...]) -> None:
        family = block_family(base)
        super().__init__(base)
        self.family = family
        kw = factory_kwargs(base)
        self.register_buffer("index", torch.tensor(channels, dtype=torch.long, device=kw["device"]), persistent=False)
        self.linear = nn.Linear(len(channels), len(channels), **kw)
        nn.init.trunc_normal_(self.linear.weight, std=0.02)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        # timm passes attn_mask / is_causal by keyword; they belong to the attention half.
        x = self.family.attn_residual(self.base, x, **kwargs)
        return self.family.mlp_residual(self.base, self.tune_channels(x))

    def tune_channels(self, x: torch.Tensor) -> torch.Tensor:
        """The residual stream after attention with ``W x[..., idx] + b`` added to its selected channels."""
        # index_add returns a new tensor: the reference's in-place update would trip autograd here.
        # Under autocast the Linear's output is in the autocast dtype, the residual stream in the model's.
        return x.index_add(-1, self.index, self.linear(x.index_select(-1, self.index)).to(x.dtype))


@rows.register_row_hook(SctBlock)
def _rows(wrapper: SctBlock) -> rows.RowHook:
    # Both halves of the frozen block run once for the mixed batch; each task tunes its rows' channels between.
    return rows.RowHook(wrapper.base, mid=lambda x, _tokens: wrapper.tune_channels(x))


@torch.no_grad()
def select_sct_channels(
    model: nn.Module, loader: Iterable, top_n: int | None = None, max_batches: int | None = None
) -> tuple[tuple[int, ...], ...]:
    """Pick each block's salient channels from the task's training data (run before :func:`apply_sct`).

    Args:
        model: the frozen backbone, before SCT is applied.
        loader: yields ``(images, labels)`` batches; use the training set without augmentation.
        top_n: channels per block; ``None`` picks embed_dim // 8.
        max_batches: stop after this many batches (``None``: the whole loader).

    Returns:
        Per block, the ``top_n`` channel indices in ascending order: the ``channels`` option.

    """
    bb = backbone_of(model)
    n = SctConfig(top_n=top_n).width(model)
    prefix, was_training = bb.num_prefix_tokens(), model.training
    sums: list[dict[int, torch.Tensor]] = [{} for _ in range(bb.depth())]
    labels: torch.Tensor | None = None

    def record(i: int) -> Any:
        def hook(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            # Per class, the squared norm over every sample and patch token of each channel.
            squares = args[0][:, prefix:].double().pow(2).sum(dim=1)
            for label in labels.unique().tolist():
                part = squares[labels == label].sum(dim=0)
                sums[i][label] = sums[i].get(label, 0) + part

        return hook

    handles = [bb.mlp_norm(block).register_forward_pre_hook(record(i)) for i, block in enumerate(bb.block_list())]
    try:
        model.eval()
        device = next(model.parameters()).device
        for images, targets in islice(loader, max_batches):  # no batch loaded past the last used
            labels = torch.as_tensor(targets).to(device)
            model(images.to(device))
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    if not sums[0]:
        raise ValueError("select_sct_channels got no batches from the loader")
    selected = []
    for per_class in sums:
        salience = torch.stack([per_class[c].sqrt() for c in sorted(per_class)]).mean(dim=0)
        selected.append(tuple(sorted(salience.topk(n).indices.tolist())))
    return tuple(selected)


def calibrate_sct(
    model: nn.Module, cfg: SctConfig, loader: Iterable, max_batches: int | None = None, *, progress: bool = True
) -> SctConfig:
    """``cfg`` with ``channels`` selected on ``loader`` by :func:`select_sct_channels` (unchanged if already set)."""
    if cfg.channels:
        return cfg
    bar = bar_over_first(
        loader, max_batches, desc="SCT selection", unit="batch", leave=False, show=progress, say=log.info
    )
    return replace(cfg, channels=select_sct_channels(model, bar, cfg.top_n))


def _formula(model: nn.Module, cfg: SctConfig) -> int:
    n = cfg.width(model)
    return backbone_of(model).depth() * (n * n + n)


# The backbones sct's idea fits: salient channels of the residual stream between the halves of pre-norm blocks of one
# width.
BACKBONES = ("vit", "naflexvit", "vit_relpos", "beit", "eva")
# Why not on the other backbone kinds (the refusal says it, and so does the docs page).
REFUSAL = (
    "its salient channels are chosen and tuned in one flat token stream of one width (top_n = width // "
    "8), and a Swin's width and tokens change per stage"
)
REFUSALS = {
    "vit_parallel": "it tunes channels of the stream between the attention and MLP residuals, and a parallel block "
    "has one residual"
}


@register_method(
    "sct",
    SctConfig,
    trainable_formula=_formula,
    calibrate=calibrate_sct,
    backbones=BACKBONES,
    refusal=REFUSAL,
    refusals=REFUSALS,
    refusal_for=("swin", "swinv2", "swinv2_cr"),
)
def inject_sct(model: nn.Module, cfg: SctConfig) -> None:
    """SCT: a Linear on the top_n salient residual channels after each block's attention."""
    bb = backbone_of(model)
    for i, channels in enumerate(cfg.channels_for(model)):
        bb.set_block(i, SctBlock(bb.block_container()[i], channels))


def apply_sct(model: nn.Module, **options: Any) -> nn.Module:
    """Add SCT to every block of ``model`` and freeze everything else but the head.

    Args:
        model: a timm model of a backbone kind the method supports (its docs page; :func:`petl.list_backbones`).
        **options: fields of :class:`SctConfig` (``top_n``, ``channels``, ``num_classes``); pass
            ``channels=select_sct_channels(model, train_loader)`` for the paper's data-driven choice.

    Returns:
        The same model, modified in place.

    """
    return surgery.apply(model, "sct", **options)
