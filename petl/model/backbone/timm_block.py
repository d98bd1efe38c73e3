"""The parts of a block as timm names them in its ViT and Swin blocks, shared by the families whose blocks do, and
the model-level parts both keep alike (``patch_embed``, the classifier's reset and class count, ``num_features``).

timm's ``Block`` (ViT and its relpos, BEiT and EVA variants) and ``SwinTransformerBlock`` (v1 and v2) keep the
attention as ``attn`` (with ``qkv`` and ``proj``), the MLP as ``mlp`` (``fc1``, ``fc2``) and the norms as
``norm1``/``norm2``; what differs between the families (the residual halves, where the norms sit, layer scales)
stays in each family's own module.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from petl.model.backbone.base import QKV_INDEX, unwrap

# The Linears that live in the attention (EVA-02's separate q/k/v projections among them); the others (fc1, fc2 and
# a SwiGLU's fc1_g, fc1_x) live in the MLP.
ATTENTION_LINEARS = ("qkv", "q_proj", "k_proj", "v_proj", "proj")


class TimmModelParts:
    """:class:`~petl.model.backbone.base.Backbone`'s model-level accessors for timm's ViTs and Swins: a
    ``patch_embed`` that is timm's ``PatchEmbed`` (a ``proj`` Conv2d, then a ``norm``) and timm's classifier API.
    """

    model: nn.Module

    def grid_size(self) -> tuple[int, int]:
        """Patch-token grid (rows, columns) of the patch embedding at the model's image size."""
        rows, cols = self.model.patch_embed.grid_size
        return int(rows), int(cols)

    def feature_grid(self, images: torch.Tensor) -> tuple[int, int]:
        """The patch embedding's grid for ``images`` of any size (timm's ``dynamic_feat_size``)."""
        rows, cols = self.model.patch_embed.dynamic_feat_size(images.shape[-2:])
        return int(rows), int(cols)

    def patch_size(self) -> tuple[int, int]:
        """Patch size (h, w) of the patch embedding."""
        size = self.model.patch_embed.patch_size
        return (size, size) if isinstance(size, int) else tuple(size)

    def patch_proj(self) -> nn.Module:
        """The patch embedding's Conv2d (its output channels are the first block's width).

        Raises:
            ValueError: the patch embedding has none: timm's ``HybridEmbed`` built with ``proj=False`` (ViTamin,
                ``vitamin_*``; MobileCLIP's ``vit_base_mci_224``) hands its CNN stem's features to the blocks as
                they are.

        """
        proj = self.model.patch_embed.proj
        if isinstance(unwrap(proj), nn.Identity):
            raise ValueError(
                f"{type(self.model).__name__}'s patch embedding has no projection (patch_embed.proj is Identity, as "
                "in timm's vitamin_* and vit_base_mci_224: a CNN stem feeds the blocks directly); choose a method "
                "that does not act on the patch projection"
            )
        return proj

    def set_patch_proj(self, module: nn.Module) -> None:
        """Replace the patch embedding's projection."""
        self.model.patch_embed.proj = module

    def patch_norm(self) -> nn.Module:
        """The norm after the patch projection (``nn.Identity`` in most ViTs, a LayerNorm in a Swin).

        A hybrid ViT's ``HybridEmbed`` (a CNN, then ``proj``) has no norm: ``nn.Identity`` there too.
        """
        norm = getattr(self.model.patch_embed, "norm", None)
        return nn.Identity() if norm is None else norm

    def set_patch_norm(self, module: nn.Module) -> None:
        """Replace the norm after the patch projection."""
        self.model.patch_embed.norm = module

    def reset_head(self, num_classes: int) -> None:
        """Timm's ``reset_classifier``."""
        self.model.reset_classifier(num_classes)

    def plain_head_types(self) -> tuple[type, ...]:
        """Timm's classifier is a Linear, or an Identity without classes."""
        return (nn.Linear, nn.Identity)

    def num_classes(self) -> int:
        """Output classes of the current head (0 when it is ``nn.Identity``)."""
        return int(getattr(self.model, "num_classes", 0))

    def num_features(self) -> int:
        """Timm's ``num_features`` (a Swin's: the last stage's width)."""
        return int(self.model.num_features)


class TimmBlockParts:
    """:class:`~petl.model.backbone.base.Backbone`'s block-level accessors for blocks with timm's part names."""

    @staticmethod
    def linear_slot(block: nn.Module, name: str) -> tuple[nn.Module, str]:
        """``qkv``, ``proj`` of the attention or ``fc1``, ``fc2`` of the MLP, under any wrapper put around either (a
        mixed batch's routed attention, Convpass's): the module whose forward calls the Linear.

        Raises:
            ValueError: the block has no such Linear (EVA-02's separate q/k/v; a SwiGLU MLP's ``fc1_g``/``fc1_x`` in
                place of ``fc1``, as timm's EVA-02 base and AIMv2 ViTs build).

        """
        owner = unwrap(block.attn if name in ATTENTION_LINEARS else block.mlp)
        if getattr(owner, name, None) is None:
            have = [n for n, m in owner.named_children() if isinstance(unwrap(m), nn.Linear)]
            raise ValueError(f"this block's {type(owner).__name__} has no {name} Linear (it has {', '.join(have)})")
        return owner, name

    @staticmethod
    def attention(block: nn.Module) -> nn.Module:
        """Its input is the block's first norm output (a Swin's: windows of it, (windows*B, window area, C))."""
        return block.attn

    @staticmethod
    def set_attention(block: nn.Module, module: nn.Module) -> None:
        """Timm calls the attention with keywords (``attn_mask``, a Swin's ``mask``)."""
        block.attn = module

    @staticmethod
    def num_heads(block: nn.Module) -> int:
        """Timm's ``num_heads`` of the attention."""
        return int(block.attn.num_heads)

    @staticmethod
    def feed_forward(block: nn.Module) -> nn.Module:
        """The MLP; its input is the block's second norm output."""
        return block.mlp

    @staticmethod
    def set_feed_forward(block: nn.Module, module: nn.Module) -> None:
        """Replace the MLP of a block."""
        block.mlp = module

    @staticmethod
    def block_norm(block: nn.Module, name: str) -> nn.Module:
        """``norm1`` or ``norm2``."""
        return getattr(block, name)

    @staticmethod
    def set_block_norm(block: nn.Module, name: str, module: nn.Module) -> None:
        """Replace ``norm1`` or ``norm2``."""
        setattr(block, name, module)


class GammaBranches:
    """The residual halves of a block whose layer scales are bare parameters ``gamma_1``/``gamma_2`` (``None``
    without layer scale), as timm's BEiT and EVA blocks keep them.
    """

    @staticmethod
    def layer_scale_parameters(block: nn.Module) -> list[nn.Parameter]:
        """``gamma_1`` and ``gamma_2``, where the block has layer scale."""
        return [gamma for gamma in (block.gamma_1, block.gamma_2) if gamma is not None]

    @staticmethod
    def attn_branch(block: nn.Module, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """``drop_path1(gamma_1 * attn(norm1(x), **kwargs))`` (the family's attention keywords passed on)."""
        out = block.attn(block.norm1(x), **kwargs)
        return block.drop_path1(out if block.gamma_1 is None else block.gamma_1 * out)

    @staticmethod
    def mlp_branch(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``drop_path2(gamma_2 * mlp(norm2(x)))``."""
        out = block.mlp(block.norm2(x))
        return block.drop_path2(out if block.gamma_2 is None else block.gamma_2 * out)


class QvBiasesBesideQkv:
    """Block accessors for an attention that adds ``q_bias`` and ``v_bias`` of its own (K has none) to the output of
    a bias-free fused ``qkv`` Linear, as timm's BEiT, EVA and SwinV2 attentions (:attr:`qv_bias_attentions`) do.

    BitFit trains them as ``qkv``'s biases (:meth:`linear_biases`) and a mixed batch serves them as a delta on the
    routed ``qkv``'s Q and V rows (:meth:`biases_beside`).  timm adds them with ``F.linear(x, qkv.weight, bias)``,
    reading ``qkv.weight`` itself, which would bypass a wrapper in place of ``qkv``; ``qkv_bias_separate`` (timm's
    own switch) makes the attention call ``qkv`` and add the biases after: the same sum (:meth:`set_linear`).
    """

    qv_bias_attentions: ClassVar[tuple[type, ...]] = ()

    @classmethod
    def set_linear(cls, block: nn.Module, name: str, module: nn.Module) -> None:
        """Replace a Linear; a ``qkv`` other than timm's Linear is called (see above)."""
        super().set_linear(block, name, module)
        attn = cls.linear_slot(block, name)[0]
        if name == "qkv" and type(module) is not nn.Linear and isinstance(attn, cls.qv_bias_attentions):
            attn.qkv_bias_separate = True

    @classmethod
    def linear_biases(cls, block: nn.Module, name: str) -> list[nn.Parameter]:
        """The Linear's own bias; for ``qkv``, the attention's ``q_bias`` and ``v_bias`` too, where it has them."""
        biases = super().linear_biases(block, name)
        if name == "qkv":
            attn = cls.linear_slot(block, name)[0]
            # An attention of the family without them (EVA's AttentionRope: Q/K/V biases inside qkv) has none.
            beside = (getattr(attn, "q_bias", None), getattr(attn, "v_bias", None))
            biases += [b for b in beside if isinstance(b, nn.Parameter)]
        return biases

    @classmethod
    def biases_beside(cls, module: nn.Module) -> tuple[str, dict[str, tuple[int, int]]] | None:
        """One of :attr:`qv_bias_attentions`' ``q_bias`` and ``v_bias``, added to its ``qkv`` output's Q and V rows."""
        if not isinstance(module, cls.qv_bias_attentions) or module.q_bias is None:
            return None
        width = unwrap(module.qkv).out_features // 3
        rows = {f"{part}_bias": (QKV_INDEX[part] * width, (QKV_INDEX[part] + 1) * width) for part in ("q", "v")}
        return "qkv", rows
