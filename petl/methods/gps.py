"""GPS, gradient-based parameter selection: per row of every weight, tune the entries the task's gradient picks.

Zhang et al., CVPR 2024, "Gradient-based Parameter Selection for Efficient Fine-Tuning".  Before training,
the task's training images are run through the pretrained backbone with a supervised contrastive loss and the
gradient of every weight matrix is accumulated over one pass; in each output row (each neuron) the ``per_row``
input connections with the largest absolute gradient are selected.  Training then updates only those entries,
every bias of the patch embedding and the blocks' Linears (and layer-scale gammas, where present), and the head.

Follows FightingFighting/GPS@72e0c31 (the authors' code; V-PETL Bench's ``vision_transformer_GPS.py`` and
``train_model_GPS.py`` are copies of its VPT-shallow model (L259) and SCT trainer, and ``run_vit_GPS.sh`` runs
``train_model_adapter.py``, so its published row comes from the authors' code):

* selection: ``train_gps.py`` L483-489 and L572-627 (``calculate_gradient``: ``model.train()``, no
  ``zero_grad`` between batches, so the gradient is summed over the whole training loader; two augmented views
  per image; ``SupConLoss`` of ``utils/loss_utils.py`` L6-97 with temperature 0.07 on the pooled pre-head feature
  of ``models/vision_transformer.py`` L549-557); the views are ``data/transforms_factory.py`` L80-110
  (random resized crop, horizontal flip, colour jitter 0.4/0.4/0.4/0.1 with p 0.8, grayscale p 0.2);
* what trains: ``utils/pruning.py`` L5-40 (``prune_by_percentile_gradient_perCell``: parameters named
  ``norm``, ``pos_embed``, ``cls_token`` frozen; ``head``, ``bias``, ``gamma`` trained whole; every other weight,
  the patch-embedding convolution flattened to ``[out, in*kh*kw]``, keeps the top-``times_para`` entries of
  each row by absolute gradient);
* training: ``utils/cuda.py`` L20-30 zeroes the gradient of every unselected entry before Adam's step, with
  weight decay 0 in every script (``train_scripts/vit/vtab/*/train_gps.sh``), so unselected entries never move.

petl trains the selected entries as a sparse update ``delta`` added to the frozen weight (``W + scatter(delta)``)
rather than masking the gradient of a trainable ``W``: with Adam and no weight decay both update exactly the same
entries by the same amounts (Adam is elementwise), and the backbone stays frozen, so saving, counting and merging
work as for every other method.  ``GpsLinear.merge`` folds ``delta`` into the weight.

The selection runs through the registry's ``calibrate`` hook (as SCT's and NOAH's): ``petl-run`` calls
:func:`calibrate_gps` on the pretrained backbone with the training split (without augmentation: the two views are
drawn from those images here) in batches of the run's training batch size, as the reference's ``loader_grad``
(``--batch-size``, train_gps.py L133-136; the contrastive loss compares the images of a batch) before injecting, and
the chosen columns are recorded in ``result.json``'s ``method_config``, the checkpoint and ``trainable.safetensors``;
a resumed run reuses them. From Python, call ``cfg = calibrate_gps(backbone, GpsConfig(), loader)`` first. Without
``selection`` the method uses a deterministic, data-free placeholder (the first ``per_row`` columns of every row) so
that it can be built and tested anywhere; that is NOT the paper's selection.

On the other ViT families the selected weights are every Linear of a block in the backbone's order
(:attr:`petl.Backbone.linear_names`: an EVA-02's separate ``q_proj``, ``k_proj``, ``v_proj`` and SwiGLU ``fc1_g``,
``fc1_x``; a parallel block's ``in_proj``, ``attn_out_proj``, ``mlp_out_proj``), and what trains whole are their
biases, the biases a block keeps beside its Linears (BEiT's and EVA's ``q_bias``, ``v_bias``; a parallel block's
``mlp_bias``) and the layer-scale gammas (BEiT's and EVA's ``gamma_1``, ``gamma_2``), as GPS trains every ``bias``
and ``gamma``.  A relative-position table or MLP stays frozen, as GPS freezes ``pos_embed``.  A
:class:`petl.MultiTask` mixed batch refuses it in one line where it trains a bare gamma or q/v bias (BEiT, EVA).

Trains:
    GPS: in every row of the patch embedding and each block's qkv/proj/fc1/fc2 weight the ``per_row`` entries
    with the largest gradient (a sparse update added to the frozen weight), every bias of those layers, layer-scale
    gammas; mergeable.

    ``selection`` empty: ``petl-run`` selects the entries before training from the supervised-contrastive gradient of
    the train split summed over batches of the run's training batch size (as the reference), two augmented views per
    image, and records them in ``result.json``; from Python call ``cfg = petl.methods.gps.calibrate_gps(backbone, cfg,
    loader)`` first, as ``petl.apply`` alone uses the first ``per_row`` columns, a data-free placeholder.

Reference:
    - FightingFighting/GPS@72e0c31 train_gps.py L133-136, L483-489, L572-627; utils/loss_utils.py L6-97;
      utils/pruning.py L5-40; utils/cuda.py L20-30; data/transforms_factory.py L80-110

Differences:
    - The selected entries train as a sparse update added to the frozen weight, not as a gradient mask on the whole
      weight: the same Adam steps at weight decay 0 (tested), so its experiment pins weight decay 0:
      ``GpsLinear`` against ``utils/cuda.py`` L20-30.
    - The selection's two contrastive views are drawn from the run's preprocessed training images (un-normalised,
      cropped, re-normalised), not from the decoded image files: ``_contrast_views`` against
      ``data/transforms_factory.py`` L80-110.
    - On BEiT the reference's rule by name (every parameter whose name holds ``bias`` trains whole) would also train
      the relative-position table ``relative_position_bias_table``; petl keeps position parameters frozen on every
      family, as the rule keeps ``pos_embed``: ``_trained_whole`` against ``utils/pruning.py`` L5-40.
    - re-draw: not applicable, GPS adds no module (it trains entries of the pretrained weights): ``utils/pruning.py``
      L5-40.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, replace
from itertools import islice
from typing import Any

import torch
import torch.nn.functional as F
from timm.data import resolve_data_config
from torch import nn
from torchvision.transforms import v2

from petl.methods import _reparam
from petl.model import rows, surgery
from petl.model.backbone import backbone_of, unwrap
from petl.model.registry import MethodConfig, register_method
from petl.model.wrappers import PetlModule, factory_kwargs
from petl.utils.checks import as_list, check_range
from petl.utils.progress import bar_over_first

log = logging.getLogger(__name__)

# SupConLoss defaults (utils/loss_utils.py L9-10) and the views of transforms_contrastaug_train (L80-110).
TEMPERATURE = 0.07


@dataclass
class GpsConfig(MethodConfig):
    """Options of GPS.

    Attributes:
        per_row: entries selected in each row of each weight (GPS's ``--times_para``; 1 in its VTAB-1k scripts
            but patch_camelyon's 2).
        selection: per selected weight (the patch embedding, then each block's Linears in the backbone's order: qkv,
            proj, fc1, fc2 in a ViT; see :meth:`petl.Backbone.linear_names`), the
            chosen input columns, ``per_row`` per output row, row after row, as one comma-separated string
            (``"3,17,40,..."``); filled by :func:`calibrate_gps`.  Empty means the data-free placeholder.

    """

    per_row: int = 1
    selection: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.selection = _normalise_selection(self.selection)

    def validate(self, model: nn.Module) -> None:
        super().validate(model)
        weights = selected_weights(model)
        check_range("per_row", self.per_row, low=1, high=min(w.shape[1] for w in weights))
        if not self.selection:
            return
        if len(self.selection) != len(weights):
            found, needed = len(self.selection), len(weights)
            raise ValueError(f"selection lists {found} weights; GPS selects in {needed} on this model")
        for i, (text, weight) in enumerate(zip(self.selection, weights, strict=True)):
            try:
                columns = [int(c) for c in text.split(",")]
            except ValueError as error:
                raise ValueError(f"selection[{i}] must be comma-separated column indices ({error})") from None
            rows, width = weight.shape
            if len(columns) != rows * self.per_row:
                raise ValueError(f"selection[{i}] holds {len(columns)} columns; {rows} rows x per_row={self.per_row}")
            if min(columns) < 0 or max(columns) >= width:
                raise ValueError(f"selection[{i}] has a column outside [0, {width - 1}]")

    def columns_for(self, model: nn.Module) -> list[torch.Tensor]:
        """Per selected weight, the ``[rows, per_row]`` column indices: ``selection`` or the placeholder."""
        weights = selected_weights(model)
        if not self.selection:
            return [torch.arange(self.per_row).expand(w.shape[0], -1).clone() for w in weights]
        return [
            torch.tensor([int(c) for c in text.split(",")]).view(w.shape[0], self.per_row)
            for text, w in zip(self.selection, weights, strict=True)
        ]


def _normalise_selection(value: Any) -> tuple[str, ...]:
    """Per-weight column lists as strings, lists of ints, or one ``;``-separated string -> ``("i,j,...", ...)``."""
    wanted = "one list of column indices per weight"
    parts = (
        [p for p in value.split(";") if p.strip()] if isinstance(value, str) else as_list(value, "selection", wanted)
    )
    lists = [p if isinstance(p, str) else as_list(p, "selection", wanted) for p in parts]
    try:
        return tuple(p.replace(" ", "") if isinstance(p, str) else ",".join(str(int(c)) for c in p) for p in lists)
    except (TypeError, ValueError) as err:
        raise ValueError(f"selection={value!r} is not {wanted} ({err})") from None


def _selected_modules(model: nn.Module) -> list[tuple[nn.Module, Any]]:
    """(module, setter) of every layer GPS selects in, in ``selection`` order: the patch projection, then every
    Linear of each block in the backbone's order (qkv, proj, fc1, fc2 in a ViT; in_proj, attn_out_proj, mlp_out_proj
    in a parallel block; q_proj, k_proj, v_proj where an EVA keeps them apart).
    """
    bb = backbone_of(model)
    found = [(bb.patch_proj(), lambda m: bb.set_patch_proj(m))]
    for block in bb.block_list():
        for name in bb.linear_names:
            try:
                linear = bb.linear(block, name)
            except ValueError:  # a name this block's layout has not (an EVA's fused or separate q/k/v, its MLP's)
                continue
            found.append((linear, lambda m, b=block, n=name: bb.set_linear(b, n, m)))
    return found


def selected_weights(model: nn.Module) -> list[torch.Tensor]:
    """The weights GPS selects entries of, each viewed as ``[rows, columns]`` (a convolution flattened)."""
    return [unwrap(m).weight.flatten(1) for m, _ in _selected_modules(model)]


class GpsLinear(PetlModule):
    """A frozen Linear or Conv2d whose weight gets a trainable sparse update; its bias trains whole.

    Args:
        base: the layer; its weight stays frozen, its bias (if any) trains, as GPS trains every bias.
        columns: ``[rows, k]`` input-column indices (of the weight flattened to 2-D) whose entries train.

    """

    def __init__(self, base: nn.Module, columns: torch.Tensor) -> None:
        super().__init__(base)
        kw = factory_kwargs(base)
        self.register_buffer("index", columns.to(device=kw["device"], dtype=torch.long), persistent=False)
        self.delta = nn.Parameter(torch.zeros(columns.shape, **kw))
        if base.bias is not None:
            base.bias.requires_grad_(True)

    def delta_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dense update: ``delta`` scattered into a zero tensor shaped like the weight (in ``dtype``)."""
        weight = self.base.weight
        flat = torch.zeros(weight.shape[0], weight[0].numel(), device=weight.device, dtype=dtype or weight.dtype)
        return flat.scatter(1, self.index, self.delta.to(flat.dtype)).view(weight.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged:
            return self.merged_forward(x)
        weight = self.base.weight + self.delta_weight()
        if isinstance(self.base, nn.Conv2d):
            return self.base._conv_forward(x, weight, self.base.bias)
        return F.linear(x, weight, self.base.bias)

    @torch.no_grad()
    def _fold(self, sign: float) -> None:
        weight = self.base.weight
        dtype = _reparam.work_dtype(weight)
        _reparam.write(weight, weight.to(dtype) + sign * self.delta_weight(dtype), "GPS into the weight")

    def fold(self) -> None:
        """Add the sparse update into the frozen weight; forward then costs what ``base`` costs."""
        self._fold(+1.0)

    def unfold(self) -> None:
        """Subtract the update again, restoring the frozen weight (up to rounding)."""
        self._fold(-1.0)


@rows.register_row_hook(GpsLinear)
def _rows(wrapper: GpsLinear) -> rows.RowHook:
    # The frozen layer once for the batch, then each task's sparse update added into its rows of the output; its own
    # trained bias is a module parameter of the wrapped layer, which MultiTask adds as a bias delta before this hook.
    # A Linear's rows read only their selected inputs (a gather, no dense matmul): with one entry per row, one
    # gather and one addcmul_ into the rows.  The patch embedding's convolution runs with the dense update.  The
    # tensors are made once per device and dtype, not at every call.
    if isinstance(wrapper.base, nn.Conv2d):
        with torch.no_grad():
            like = rows.per_device(wrapper.delta_weight())

        def add(x: torch.Tensor, y: torch.Tensor, _tokens: rows.Tokens) -> None:
            y.add_(wrapper.base._conv_forward(x, like(x)[0], None))

        return rows.RowHook(wrapper.base, post_in_place=add)
    out, per_row = wrapper.index.shape
    like = rows.per_device(wrapper.index.flatten(), wrapper.delta.flatten() if per_row == 1 else wrapper.delta)

    def add(x: torch.Tensor, y: torch.Tensor, _tokens: rows.Tokens) -> None:
        index, delta = like(x)
        picked = x[..., index]  # [..., out * per_row]: each output unit's selected inputs
        if per_row == 1:
            y.addcmul_(picked, delta)
        else:
            y.add_((picked.unflatten(-1, (out, per_row)) * delta).sum(dim=-1))

    return rows.RowHook(wrapper.base, post_in_place=add)


def _trained_whole(model: nn.Module) -> list[nn.Parameter]:
    """What GPS trains whole besides the selected layers' own biases: every layer-scale gamma (none in a plain ViT)
    and the biases a block keeps beside its Linears (BEiT's and EVA's q/v biases, a parallel block's ``mlp_bias``),
    as GPS trains every ``gamma`` and ``bias`` whole.
    """
    bb = backbone_of(model)
    return [p for block in bb.block_list() for p in (*bb.layer_scale_parameters(block), *bb.loose_biases(block))]


def _formula(model: nn.Module, cfg: GpsConfig) -> int:
    selected = sum(w.shape[0] * cfg.per_row for w in selected_weights(model))
    biases = sum(unwrap(m).bias.numel() for m, _ in _selected_modules(model) if unwrap(m).bias is not None)
    return selected + biases + sum(p.numel() for p in _trained_whole(model))


def inject_gps(model: nn.Module, cfg: GpsConfig) -> None:
    """GPS: a sparse update on the selected entries of every weight, plus every bias."""
    columns = cfg.columns_for(model)
    for (module, install), index in zip(_selected_modules(model), columns, strict=True):
        install(GpsLinear(module, index))
    for param in _trained_whole(model):
        param.requires_grad_(True)


# --- the selection -----------------------------------------------------------------------------


def supcon_loss(features: torch.Tensor, labels: torch.Tensor, temperature: float = TEMPERATURE) -> torch.Tensor:
    """Supervised contrastive loss (Khosla et al. 2020) as GPS computes it (utils/loss_utils.py L17-97).

    Args:
        features: ``[batch, views, dim]``; L2-normalised here.
        labels: ``[batch]`` class labels; samples of one class are each other's positives.
        temperature: softmax temperature (GPS: 0.07, with base temperature equal to it).

    """
    batch, views = features.shape[:2]
    features = F.normalize(features, dim=2)
    anchors = torch.cat(features.unbind(dim=1), dim=0)  # contrast_mode "all": every view is an anchor
    logits = anchors @ anchors.T / temperature
    logits = logits - logits.max(dim=1, keepdim=True).values.detach()
    positive = (labels.view(-1, 1) == labels.view(1, -1)).float().repeat(views, views)
    not_self = 1.0 - torch.eye(batch * views, device=features.device, dtype=positive.dtype)
    positive = positive * not_self
    log_prob = logits - torch.log((logits.exp() * not_self).sum(dim=1, keepdim=True))
    mean_log_prob_pos = (positive * log_prob).sum(dim=1) / positive.sum(dim=1)
    return -mean_log_prob_pos.mean()


def _contrast_views(model: nn.Module, size: tuple[int, int]) -> v2.Transform:
    """One random view of a normalised ``size`` image: GPS's contrastive augmentation on un-normalised pixels.

    The mean and std are the backbone's (timm's pretrained config), so the colour jitter acts on pixels.
    """
    data = resolve_data_config({}, model=model)
    mean, std = torch.tensor(data["mean"]).view(3, 1, 1), torch.tensor(data["std"]).view(3, 1, 1)
    return v2.Compose(
        [
            v2.Lambda(lambda x: (x * std.to(x) + mean.to(x)).clamp(0, 1)),
            v2.RandomResizedCrop(size, antialias=True),
            v2.RandomHorizontalFlip(),
            v2.RandomApply([v2.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8),
            v2.RandomGrayscale(p=0.2),
            v2.Lambda(lambda x: (x - mean.to(x)) / std.to(x)),
        ]
    )


def gps_gradients(model: nn.Module, loader: Iterable, max_batches: int | None = None) -> list[torch.Tensor]:
    """GPS's selection gradient: the SupCon loss's gradient of every selected weight, summed over ``loader``.

    Args:
        model: the pretrained backbone, before GPS is applied (it is left as it was).
        loader: yields ``(images, labels)`` batches of the training set, without augmentation.
        max_batches: stop after this many batches (``None``: the whole loader, as GPS does).

    Returns:
        Per selected weight (see :func:`selected_weights`), the summed gradient viewed as ``[rows, columns]``.

    """
    weights = [unwrap(m).weight for m, _ in _selected_modules(model)]
    flags, was_training = [w.requires_grad for w in weights], model.training
    device = weights[0].device
    total: list[torch.Tensor] | None = None
    try:
        model.train()  # calculate_gradient: model.train(), so dropout and drop-path act as in training
        for w in weights:
            w.requires_grad_(True)
        for images, labels in islice(loader, max_batches):  # no batch loaded past the last used
            images, labels = images.to(device), torch.as_tensor(labels).to(device)
            view = _contrast_views(model, tuple(images.shape[-2:]))
            both = torch.cat([torch.stack([view(x) for x in images]) for _ in range(2)])
            pooled = model.forward_head(model.forward_features(both), pre_logits=True)
            loss = supcon_loss(torch.stack(pooled.chunk(2), dim=1), labels)
            grads = torch.autograd.grad(loss, weights, allow_unused=True)
            grads = [torch.zeros_like(w) if g is None else g for g, w in zip(grads, weights, strict=True)]
            total = grads if total is None else [t + g for t, g in zip(total, grads, strict=True)]
    finally:
        for w, flag in zip(weights, flags, strict=True):
            w.requires_grad_(flag)
        model.train(was_training)
    if total is None:
        raise ValueError("GPS's selection got no batches from the loader")
    return [g.flatten(1) for g in total]


def select_gps(model: nn.Module, loader: Iterable, per_row: int = 1, max_batches: int | None = None) -> tuple[str, ...]:
    """Pick GPS's entries from the task's training data (run before :func:`apply_gps`).

    Returns:
        The ``selection`` option: per selected weight, the ``per_row`` columns of each row with the largest
        absolute summed gradient, in ascending order within a row.

    """
    selection = []
    for grad in gps_gradients(model, loader, max_batches):
        columns = grad.abs().topk(per_row, dim=1).indices.sort(dim=1).values
        selection.append(",".join(str(c) for c in columns.flatten().tolist()))
    return tuple(selection)


def calibrate_gps(
    model: nn.Module, cfg: GpsConfig, loader: Iterable, max_batches: int | None = None, *, progress: bool = True
) -> GpsConfig:
    """``cfg`` with ``selection`` chosen on ``loader`` by :func:`select_gps` (unchanged if already set)."""
    if cfg.selection:
        return cfg
    bar = bar_over_first(
        loader, max_batches, desc="GPS selection", unit="batch", leave=False, show=progress, say=log.info
    )
    return replace(cfg, selection=select_gps(model, bar, cfg.per_row))


# The backbones gps's idea fits: a per-row sparse update on the patch projection and every block's Linears, plus layer
# scales.
BACKBONES = ("vit", "naflexvit", "vit_relpos", "beit", "eva", "vit_parallel")
# Why not on the other backbone kinds (the refusal says it, and so does the docs page).
REFUSAL = (
    "its selection covers the patch projection and the blocks' Linears only: a Swin's patch-merging "
    "reductions between stages would silently stay out"
)


register_method(
    "gps",
    GpsConfig,
    trainable_formula=_formula,
    zero_init=True,
    mergeable=True,
    calibrate=calibrate_gps,
    backbones=BACKBONES,
    refusal=REFUSAL,
    refusal_for=("swin", "swinv2", "swinv2_cr"),
)(inject_gps)


def apply_gps(model: nn.Module, **options: Any) -> nn.Module:
    """Add GPS to ``model`` and freeze everything else but the head.

    Args:
        model: a timm model of a backbone kind the method supports (its docs page; :func:`petl.list_backbones`).
        **options: fields of :class:`GpsConfig` (``per_row``, ``selection``, ``num_classes``); pass
            ``selection=select_gps(model, train_loader)`` for the paper's data-driven choice.

    Returns:
        The same model, modified in place.

    """
    return surgery.apply(model, "gps", **options)
