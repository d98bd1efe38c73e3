"""SSF: learnable per-channel scale and shift after each operation (Lian et al., NeurIPS 2022).

Placement follows PETL_Vision (OSU-MLB/PETL_Vision@245d262): after the patch projection and the
patch-embedding norm when there is one (model/patch_embed.py:L61-64, L93-96), after each block's
norm1 and norm2 (model/block.py:L78-80, L93-94, L134-135), after qkv and proj
(model/attention.py:L40-42, L50-51, L88-89), after fc1 and fc2 (model/mlp.py:L40-42, L50-51,
L62-63) and after the final norm (model/vision_transformer.py:L159-160, L246-247).  petl puts
the last one after every final LayerNorm (``norm``, or ``fc_norm`` in average-pooling ViTs, where
``norm`` is an Identity the shift could not be folded into).  The init is the reference's:
scale ~ N(1, 0.02), shift ~ N(0, 0.02) (model/ssf.py:L4-11), so the model is *not* exactly
unchanged at init; ``init_std=0`` starts at the exact identity.

On Swin the placement follows SSF's own Swin code (dongzelian/SSF@e94e0e7 models/swin_transformer.py), the
same sites stage by stage, each of its stage's width: after the patch projection and the patch norm (L512-517,
L528-531), each block's norm1 and norm2 (L331-333, L342-344, L374-375), qkv and proj inside the windowed
attention (L212-214, L225-227, L253-255), fc1 and fc2 (L111-126) and the final norm (L620-621, L681-684).  None
sits at patch merging: SSF's PatchMerging declares a scale/shift after its norm (L396-398, L420-422), but the stage
passes it the list of per-block modes (L477, built at L619), so its ``tuning_mode == 'ssf'`` is False and the
released code (what its train_scripts/swin/*/train_ssf.sh run) never builds it; petl follows the code as it runs
(tests/references/test_ssf_swin.py checks the sites and the logits against a re-implementation of that file).

On a parallel block (``vit_parallel``: one norm, one ``in_proj`` holding fc1's and qkv's rows, two output Linears)
the sites are that block's affine layers (``Backbone.norm_groups``): ``in_norm``, ``in_proj`` (one scale and shift
per row, fc1's and qkv's alike), ``attn_out_proj`` and ``mlp_out_proj``; where timm keeps fc1's bias beside
``in_proj`` (``qkv_bias=False``) the shift of fc1's rows comes before that bias, not after it.

Each scale/shift follows an affine layer (Linear, Conv2d or LayerNorm), so ``merge`` folds it in:
``W <- s * W`` (row-wise) and ``b <- s * b + t``; merged inference runs the plain layer.

Trains:
    a per-channel scale and shift after the patch projection and its norm, each block's norms, qkv, proj, fc1
    and fc2, and the final norm; mergeable.  ``init_std=0`` starts at the exact identity.

Reference:
    - OSU-MLB/PETL_Vision@245d262 model/ssf.py L4-11; model/patch_embed.py L61-64, L93-96; model/block.py L78-80,
      L93-94, L134-135; model/attention.py L40-42, L50-51, L88-89; model/mlp.py L40-42, L50-51, L62-63;
      model/vision_transformer.py L159-160, L246-247
    - Swin: dongzelian/SSF@e94e0e7 models/swin_transformer.py L512-517, L528-531 (patch embedding); L331-333,
      L342-344, L374-375 (norm1, norm2); L212-214, L225-227, L253-255 (qkv, proj); L111-126 (fc1, fc2); L620-621,
      L681-684 (final norm); L396-398, L420-422 with L477, L619 (patch merging: declared, never built)

Differences:
    - The last scale/shift sits after every final LayerNorm (``norm``, or ``fc_norm`` in average-pooling ViTs,
      where ``norm`` is an Identity the shift could not be folded into).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from petl.methods import _reparam
from petl.model import rows, surgery
from petl.model.backbone import backbone_of
from petl.model.registry import MethodConfig, register_method
from petl.model.wrappers import PetlModule, factory_kwargs
from petl.utils.checks import check_range


@dataclass
class SsfConfig(MethodConfig):
    """Options of SSF.

    Attributes:
        init_std: standard deviation of the random init around scale 1 and shift 0 (the reference's
            0.02); 0 starts from the exact identity.

    """

    init_std: float = 0.02

    def validate(self, model: nn.Module) -> None:
        super().validate(model)
        check_range("init_std", self.init_std, low=0)


def _width(module: nn.Module) -> int:
    """Output channels of an affine layer: what SSF scales and shifts."""
    if isinstance(module, nn.Linear):
        return module.out_features
    if isinstance(module, nn.Conv2d):
        return module.out_channels
    if isinstance(module, nn.LayerNorm):
        return int(module.normalized_shape[-1])
    raise ValueError(f"SSF follows a Linear, Conv2d or LayerNorm, not {type(module).__name__}")


class SsfLayer(PetlModule):
    """An affine layer followed by a learnable per-channel scale and shift.

    Args:
        base: the Linear, Conv2d (channels on dim 1) or LayerNorm to follow; kept frozen as ``base``.
        init_std: std of the random init around scale 1, shift 0.

    """

    def __init__(self, base: nn.Module, init_std: float) -> None:
        super().__init__(base)
        width = _width(base)
        kw = factory_kwargs(base)
        self.scale = nn.Parameter(torch.ones(width, **kw))
        self.shift = nn.Parameter(torch.zeros(width, **kw))
        if init_std > 0:
            nn.init.normal_(self.scale, mean=1.0, std=init_std)
            nn.init.normal_(self.shift, mean=0.0, std=init_std)
        # A Conv2d's channels sit on dim 1 (NCHW); the other layers' on the last dim.
        self.channel_dim = 1 if isinstance(base, nn.Conv2d) else -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged:
            return self.merged_forward(x)
        return self.scale_shift(self.base(x))

    def scale_shift(self, out: torch.Tensor) -> torch.Tensor:
        """The base layer's output ``out`` scaled and shifted per channel."""
        if self.channel_dim == 1:
            return out * self.scale.view(-1, 1, 1) + self.shift.view(-1, 1, 1)
        return out * self.scale + self.shift

    def _check_mergeable(self) -> None:
        if getattr(self.base, "weight", None) is None or getattr(self.base, "bias", None) is None:
            raise ValueError(
                f"SSF cannot merge into a {type(self.base).__name__} without weight and bias (nothing holds the shift)"
            )

    @torch.no_grad()
    def fold(self) -> None:
        """Fold the scale into the base's weight rows and scale+shift into its bias."""
        self._check_mergeable()
        weight, bias = self.base.weight, self.base.bias
        dtype = _reparam.work_dtype(weight)
        scale, shift = self.scale.to(dtype), self.shift.to(dtype)
        _reparam.check_finite("SSF scale/shift", scale, shift)
        if bool((scale == 0).any()):
            raise ValueError("refusing to merge SSF: a scale of exactly 0 could not be unmerged")
        rows = scale.view(-1, *[1] * (weight.dim() - 1))
        _reparam.write(weight, weight.to(dtype) * rows, "SSF into the weight")
        _reparam.write(bias, bias.to(dtype) * scale + shift, "SSF into the bias")

    @torch.no_grad()
    def unfold(self) -> None:
        """Undo :meth:`merge` (divide the scale back out), up to rounding."""
        weight, bias = self.base.weight, self.base.bias
        dtype = _reparam.work_dtype(weight)
        scale, shift = self.scale.to(dtype), self.shift.to(dtype)
        rows = scale.view(-1, *[1] * (weight.dim() - 1))
        _reparam.write(weight, weight.to(dtype) / rows, "SSF out of the weight")
        _reparam.write(bias, (bias.to(dtype) - shift) / scale, "SSF out of the bias")


@rows.register_row_hook(SsfLayer)
def _rows(wrapper: SsfLayer) -> rows.RowHook:
    # The frozen layer runs once for the mixed batch; each task scales and shifts its own rows.
    batched = rows.affine(wrapper.scale, wrapper.shift, wrapper.channel_dim)
    shape = (-1, 1, 1) if wrapper.channel_dim == 1 else (-1,)
    like = rows.per_device(wrapper.scale.view(shape), wrapper.shift.view(shape))

    def scale_shift_in_place(_x: torch.Tensor | None, y: torch.Tensor, _tokens: rows.Tokens) -> None:
        scale, shift = like(y)
        torch.addcmul(shift, y, scale, out=y)  # one op, written over y itself

    return rows.RowHook(
        wrapper.base,
        post=lambda _x, y, _tokens: wrapper.scale_shift(y),
        post_in_place=scale_shift_in_place,
        batched=batched,
        reads_input=False,  # y alone: the routing slices no rows of x for it
    )


def _sites(model: nn.Module) -> list[tuple[nn.Module, Callable[[nn.Module], None]]]:
    """Every layer SSF follows, with the function that installs its wrapper, in forward order."""
    bb = backbone_of(model)
    sites: list[tuple[nn.Module, Callable[[nn.Module], None]]] = [(bb.patch_proj(), lambda m: bb.set_patch_proj(m))]
    if isinstance(bb.patch_norm(), nn.LayerNorm):
        sites.append((bb.patch_norm(), lambda m: bb.set_patch_norm(m)))
    for block in bb.block_list():
        # norm1, qkv, proj, norm2, fc1, fc2; a parallel block's one in_norm, in_proj and two output projections.
        for norm_name, linear_names in bb.norm_groups:
            norm = bb.block_norm(block, norm_name)
            sites.append((norm, lambda m, b=block, n=norm_name: bb.set_block_norm(b, n, m)))
            for name in linear_names:
                sites.append(
                    (
                        bb.linear(block, name),
                        lambda m, b=block, n=name: bb.set_linear(b, n, m),
                    )
                )
    for name, norm in bb.named_final_norms():
        if isinstance(norm, nn.LayerNorm):
            sites.append((norm, lambda m, n=name: bb.set_final_norm(n, m)))
    return sites


def _formula(model: nn.Module, cfg: SsfConfig) -> int:
    # One scale and one shift per output channel of every site.
    return sum(2 * _width(module) for module, _ in _sites(model))


# The backbones ssf's idea fits: scale and shift after the patch projection, the norms and the Linears, each of its
# block's width (Swin: its stage's).
BACKBONES = ("vit", "naflexvit", "swin", "swinv2_cr", "vit_relpos", "beit", "eva", "vit_parallel")


@register_method(
    "ssf",
    SsfConfig,
    trainable_formula=_formula,
    zero_init=False,
    mergeable=True,
    backbones=BACKBONES,
    refusal="SSF's code has no SwinV2, and a SwinV2's attention reads its qkv weight directly (its Q and V biases "
    "beside it) instead of calling the Linear a scale and shift would follow",
)
def inject_ssf(model: nn.Module, cfg: SsfConfig) -> None:
    """SSF: per-channel scale and shift after every norm, Linear and the patch projection; mergeable."""
    for module, install in _sites(model):
        install(SsfLayer(module, cfg.init_std))


def apply_ssf(model: nn.Module, **options: Any) -> nn.Module:
    """Add SSF scale/shift layers to ``model`` and freeze everything else but the head.

    Args:
        model: a timm model of a backbone kind the method supports (its docs page; :func:`petl.list_backbones`).
        **options: fields of :class:`SsfConfig` (``init_std``, ``num_classes``).

    Returns:
        The same model, modified in place.

    """
    return surgery.apply(model, "ssf", **options)
