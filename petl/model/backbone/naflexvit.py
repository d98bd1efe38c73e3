"""timm's NaFlexVit (``naflexvit_*``) as a :class:`~petl.model.backbone.base.Backbone`.

timm keeps NaFlexVit in a module of its own (``timm/models/naflexvit.py``): timm's pre-norm ViT ``Block`` (L304-357,
``get_block_fn``: the plain ``Block`` unless a rotary embedding, a SwiGLU MLP or another EVA feature asks for an
``EvaBlock``, which :class:`NaFlexEva` takes as the eva kind does) behind one embedding module, ``embeds``
(``NaFlexEmbeds``, L360): a patch projection (a Linear over the image cut into patches by default,
``embed_proj_type='linear'``, or a Conv2d), a learned or factorized position embedding resampled to the image's grid,
then the class and register tokens in front (L916-1023).  The model's final ``norm``, attention pool (``map``),
``fc_norm`` and ``head`` are a ViT's, and its ``forward_head`` pools with a mask over the patch tokens (L1095-1165,
L1937-1976), which :meth:`NaFlexViT.pooled_features` hands ``keep``.

petl feeds it square images of one size, timm's plain-tensor path (``forward(x)`` with no ``patch_coord``, L2024):
there the attention mask is ``None`` and the position embedding is added before the blocks, so the blocks, the
prompts (no position inside attention, as on a ViT) and the methods are the ViT's.  The pre-patchified NaFlex batch
(``patches``, ``patch_coord``, ``patch_valid``, a dict from timm's NaFlex collator) is timm's, not petl's: a method
runs on it as timm runs its blocks, but petl's feature cache, ``MultiTask`` and the methods that reshape patch
tokens to a grid assume the one grid of :meth:`NaFlexViT.grid_size`.
"""

from __future__ import annotations

from typing import Any

import torch
from timm.data import resolve_data_config
from timm.layers import AttentionRope
from timm.models.eva import EvaAttention, EvaBlock
from timm.models.naflexvit import NaFlexVit
from timm.models.vision_transformer import Block
from torch import nn

from petl.model.backbone.base import register_backbone, unwrap
from petl.model.backbone.eva import Eva
from petl.model.backbone.vit import ViT


@register_backbone(NaFlexVit)
class NaFlexViT(ViT):
    """A timm NaFlexVit with plain ViT blocks (``naflexvit_*``), fed fixed-size images (EvaBlocks: NaFlexEva)."""

    kind = "naflexvit"
    supported = (
        "a timm NaFlexVit (naflexvit_*) with timm's plain ViT Block and a fused attn.qkv Linear, or with pre-norm "
        "EvaBlocks of EvaAttention or AttentionRope (rope_type, swiglu_mlp, attn_type eva/rope)"
    )
    # ViT's blocks stay ViT's (block_family): timm's Block is registered by the vit kind.
    block_types = ()
    timm_modules = ("naflexvit",)
    # timm's forward_head pools with a mask over the patch tokens for every pooling but the class token.
    maskable_pools = ("token", "avg", "avgmax", "max", "map")

    def check(self) -> None:
        """Raise a ValueError naming what is supported unless every block is timm's plain ``Block``.

        Raises:
            ValueError: another block (not the first: a first ``EvaBlock`` makes it :class:`NaFlexEva`'s), a block
                without a fused ``attn.qkv``, or no classifier head.

        """
        model, name = self.model, type(self.model).__name__
        blocks = getattr(model, "blocks", None)
        if not isinstance(blocks, nn.Sequential) or len(blocks) == 0 or getattr(model, "embeds", None) is None:
            raise ValueError(f"petl supports {self.supported}; got {name} without blocks or embeds")
        for i, block in enumerate(blocks):
            inner = unwrap(block)
            if type(inner) is not Block:  # EvaBlocks are NaFlexEva's (chosen by the first block)
                raise ValueError(f"petl supports {self.supported}; block {i} of {name} is a {type(inner).__name__}")
            qkv = getattr(inner.attn, "qkv", None)
            if not isinstance(qkv, nn.Linear) or qkv.out_features != 3 * qkv.in_features:
                raise ValueError(f"petl supports {self.supported}; block {i} of {name} has no fused attn.qkv Linear")
        if getattr(model, "rope", None) is not None:
            raise ValueError(f"petl supports {self.supported}; {name} has a rotary embedding (rope_type)")
        if not hasattr(model, "reset_classifier") or not hasattr(model, "head"):
            raise ValueError(f"petl supports {self.supported}; {name} has no timm classifier head.")

    # -- the tokens ------------------------------------------------------------------------------------------

    def image_size(self) -> tuple[int, int]:
        """The image size the model is built for: its ``img_size`` where timm keeps it (``pos_embed_grid_size=None``),
        else its pretrained config's ``input_size`` (the position grid is resampled to any other).
        """
        size = self.model.embeds.default_img_size
        if size is None:
            size = tuple(resolve_data_config({}, model=self.model)["input_size"][-2:])
        return int(size[0]), int(size[1])

    def grid_size(self) -> tuple[int, int]:
        """The patch grid of :meth:`image_size` images."""
        return self.feature_grid(torch.empty(0, 0, *self.image_size()))

    def feature_grid(self, images: torch.Tensor) -> tuple[int, int]:
        """The embedding's grid for ``images`` of any size (timm's ``dynamic_feat_size``)."""
        rows, cols = self.model.embeds.dynamic_feat_size(tuple(images.shape[-2:]))
        return int(rows), int(cols)

    def patch_size(self) -> tuple[int, int]:
        """The embedding's patch size (h, w)."""
        rows, cols = self.model.embeds.patch_size
        return int(rows), int(cols)

    def patch_proj(self) -> nn.Module:
        """The embedding's projection: a Linear over each patch's pixels (``embed_proj_type='linear'``, timm's
        default, L491-514) or a Conv2d.
        """
        return self.model.embeds.proj

    def set_patch_proj(self, module: nn.Module) -> None:
        """Replace the embedding's projection."""
        self.model.embeds.proj = module

    def patch_norm(self) -> nn.Module:
        """The norm after the projection (``embed_norm_layer``; ``nn.Identity`` without)."""
        return self.model.embeds.norm

    def set_patch_norm(self, module: nn.Module) -> None:
        """Replace the norm after the projection."""
        self.model.embeds.norm = module

    def num_tokens(self) -> int:
        """Patch tokens of :meth:`grid_size` plus prefix tokens."""
        rows, cols = self.grid_size()
        return rows * cols + self.num_prefix_tokens()

    def embed_tokens(self, images: torch.Tensor) -> torch.Tensor:
        """``embeds`` (patches, position embedding, prefix tokens), patch drop in training, ``norm_pre``: timm's
        ``_forward_embeds`` (L1615-1677) for a plain image tensor.
        """
        model = self.model
        x, _ = model.embeds(images)
        if model.training and model.patch_drop is not None:
            x, _ = model.patch_drop(x)
        return model.norm_pre(x)

    # -- after the blocks ------------------------------------------------------------------------------------

    def pooled_features(self, tokens: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """The final norm and timm's ``forward_head(pre_logits=True)`` (L1967-1976): its pooling (``_pool``), then
        ``fc_norm`` and head dropout.  ``keep`` (batch x tokens, bool) goes to the pooling as ``patch_valid`` over the
        tokens after the prefix, which every pooling but the class token's leaves out.  (petl puts a
        ``forward_head`` of its own on a model it applies a method to, which takes no ``patch_valid``.)
        """
        model = self.model
        valid = None if keep is None else keep[:, self.num_prefix_tokens() :]
        return model.head_drop(model.fc_norm(model._pool(model.norm(tokens), patch_valid=valid)))

    # -- taking the blocks' input and output -----------------------------------------------------------------

    def is_plain(self) -> bool:
        """Exactly timm's NaFlexVit."""
        return type(self.model) is NaFlexVit


@register_backbone(NaFlexVit, blocks=(EvaBlock,))
class NaFlexEva(NaFlexViT, Eva):
    """A timm NaFlexVit with timm's EvaBlocks (``rope_type``, ``swiglu_mlp``, ``attn_type='eva'``/``'rope'``...):
    the stem, pooling and head of :class:`NaFlexViT`, the blocks and rotary embedding of :class:`Eva`.

    timm's plain-tensor path computes the rotation for the image's grid (``rope.get_embed(shape=grid_size)``,
    L1641) and passes it every block, or block i its row i where the rotation is learnt per block (``rope_is_mixed``,
    L1898-1919), as an Eva does; petl's images are of the model's size, so :meth:`block_inputs` computes it for
    :meth:`NaFlexViT.grid_size`.
    """

    supported = (
        "a timm NaFlexVit (naflexvit_*) with timm's plain ViT Block, or with pre-norm EvaBlocks of EvaAttention or "
        "AttentionRope (rope_type, swiglu_mlp, attn_type eva/rope)"
    )
    block_types = ()

    def check(self) -> None:
        """Raise a ValueError naming what is supported unless every block is a pre-norm ``EvaBlock`` of
        ``EvaAttention`` or ``AttentionRope``.

        Raises:
            ValueError: another block or attention (a gated one), or no classifier head.

        """
        model, name = self.model, type(self.model).__name__
        if getattr(model, "embeds", None) is None:
            raise ValueError(f"petl supports {self.supported}; got {name} without embeds")
        for i, block in enumerate(model.blocks):
            inner = unwrap(block)
            attn = unwrap(getattr(inner, "attn", None))
            if type(inner) is not EvaBlock or type(attn) not in (EvaAttention, AttentionRope):
                raise ValueError(
                    f"petl supports {self.supported}; block {i} of {name}: {type(inner).__name__} with "
                    f"{type(attn).__name__}, not taken"
                )
            if getattr(attn, "gate", None) is not None:
                # A Linear of the block that no method's selection or MultiTask's routing knows: GPS would leave it out.
                raise ValueError(
                    f"petl supports {self.supported}; block {i} of {name} has a gated attention (attn_gated=True: a "
                    "gate Linear beside qkv), not taken: create it without attn_gated"
                )
        if not hasattr(model, "reset_classifier") or not hasattr(model, "head"):
            raise ValueError(f"petl supports {self.supported}; {name} has no timm classifier head.")

    def block_inputs(self, room: tuple[int, int] | None = None) -> dict[str, Any]:
        """The rotary embedding timm computes, at the model's grid (``None`` without one): one table for every
        block, or a per-block one's rows, which :meth:`Eva.run_block` hands each block.
        """
        rope = self.model.rope
        return {"rope": None if rope is None else rope.get_embed(shape=self.grid_size())}

    def embed_tokens(self, images: torch.Tensor) -> torch.Tensor:
        """:meth:`NaFlexViT.embed_tokens`, refused where patch tokens are dropped and rotated
        (:meth:`Eva.check_rope_follows_tokens`).
        """
        self.check_rope_follows_tokens()
        return NaFlexViT.embed_tokens(self, images)

    def _per_block_rope(self) -> bool:
        """Whether block i is passed its own row of the rotary embedding (timm's ``rope_is_mixed``)."""
        return self.model.rope is not None and self.model.rope_is_mixed

    def is_plain(self) -> bool:
        """Exactly timm's NaFlexVit."""
        return type(self.model) is NaFlexVit
