"""timm's Beit (BEiT, BEiT-v2) as a :class:`~petl.model.backbone.base.Backbone`.

A ViT with a class token whose attention adds a relative-position bias (a table per block, or one table shared by
every block: ``rel_pos_bias``, computed once per forward and passed to each block as ``shared_rel_pos_bias``),
with learned class-to-patch entries.  Three things differ inside a block:

* the Q and V biases are parameters of the attention (``q_bias``, ``v_bias``; K has none), and timm's forward
  reads ``qkv.weight`` itself (``F.linear(x, qkv.weight, cat(q_bias, 0, v_bias))``) unless ``qkv_bias_separate``,
  when it calls ``qkv`` and adds the biases after: the same sum.  A wrapper on ``qkv`` (LoRA's Q and V rows)
  only runs if the module is called, so ``set_linear`` turns on that path (``QvBiasesBesideQkv``, shared with EVA
  and SwinV2).
* the layer scales are bare parameters ``gamma_1``, ``gamma_2`` (``None`` without layer scale).
* the block and its attention take ``shared_rel_pos_bias``, not ``attn_mask``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from timm.layers import Mlp
from timm.models.beit import Attention, Block
from timm.models.beit import Beit as TimmBeit
from torch import nn

from petl.model import rows
from petl.model.backbone.base import register_backbone, unwrap
from petl.model.backbone.timm_block import GammaBranches, QvBiasesBesideQkv
from petl.model.backbone.vit_relpos import VitRelPos, pad_bias, with_mask
from petl.model.wrappers import PetlModule


class BeitRoom(PetlModule):
    """timm's BEiT ``Attention`` taking extra tokens at ``at`` (those beyond the bias's) that get no relative-position
    bias.

    timm computes the bias inside its forward, for exactly the class token and the patch grid; this runs the same
    steps through the attention's own modules and parameters with the bias (own plus shared) zero-padded for the
    extra tokens, as the VPT code's Swin pads its bias for the prompts (swin_transformer.py L480-508).  It also takes
    an additive ``attn_mask`` (as :class:`~petl.model.backbone.vit_relpos.RelPosRoom`); with no extra tokens and no
    mask it is timm's attention itself (which adds the Q/V biases in its ``F.linear``).
    """

    def __init__(self, base: Attention, at: int) -> None:
        super().__init__(base)
        self.at = at

    def forward(
        self,
        x: torch.Tensor,
        shared_rel_pos_bias: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        attn = self.base
        batch, tokens, _ = x.shape
        own = attn._get_rel_pos_bias() if attn.relative_position_bias_table is not None else None
        shared = shared_rel_pos_bias
        if attn_mask is None and all(b is None or b.shape[-1] == tokens for b in (own, shared)):
            return attn(x, shared_rel_pos_bias=shared)
        qkv = attn.qkv(x)
        if attn.q_bias is not None:
            qkv = qkv + torch.cat((attn.q_bias, attn.k_bias, attn.v_bias))
        q, k, v = qkv.reshape(batch, tokens, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        # Each padded apart: a MultiTask passes the shared bias padded already (Backbone.block_inputs).
        own, shared = (None if b is None else pad_bias(b, self.at, tokens - b.shape[-1]) for b in (own, shared))
        bias = shared if own is None else own if shared is None else own + shared
        bias = with_mask(None if bias is None else bias.to(q.dtype), attn_mask)
        x = F.scaled_dot_product_attention(
            q, k, v, attn_mask=bias, dropout_p=attn.attn_drop.p if attn.training else 0.0
        )
        return attn.proj_drop(attn.proj(x.transpose(1, 2).reshape(batch, tokens, -1)))


@register_backbone(TimmBeit)
class Beit(QvBiasesBesideQkv, GammaBranches, VitRelPos):
    """A timm Beit (BEiT, BEiT-v2: per-block or shared relative-position bias, layer scale or not)."""

    kind = "beit"
    supported = "a timm Beit (BEiT, BEiT-v2) whose blocks have an Mlp (not SwiGLU)"
    block_types = (Block,)
    timm_modules = ("beit",)
    shared_bias_arg = "shared_rel_pos_bias"
    room_types = (BeitRoom,)
    qv_bias_attentions = (Attention,)

    def check(self) -> None:
        """Raise a ValueError naming what is supported unless every block is a BEiT Block with an ``Mlp``.

        Raises:
            ValueError: a block of another type, or a SwiGLU MLP (no ``fc1``).

        """
        name = type(self.model).__name__
        for i, block in enumerate(self.model.blocks):
            inner = unwrap(block)
            if type(inner) is not Block or not isinstance(unwrap(inner.mlp), Mlp):
                mlp = type(unwrap(getattr(inner, "mlp", None))).__name__
                raise ValueError(
                    f"petl supports {self.supported}; block {i} of {name}: {type(inner).__name__} with {mlp}, not taken"
                )

    def batch_shared_modules(self) -> list[nn.Module]:
        """The model's shared ``rel_pos_bias`` (a table every row reads; each attention's own table is a parameter
        of the attention, not a module of its own).
        """
        shared = self.model.rel_pos_bias
        return [shared] if shared is not None else []

    def _shared_bias(self) -> torch.Tensor | None:
        shared = self.model.rel_pos_bias
        return shared() if shared is not None else None

    def embed_tokens(self, images: torch.Tensor) -> torch.Tensor:
        """Patch embedding, class token, absolute position embedding (where used), dropout."""
        model = self.model
        x = model.patch_embed(images)
        x = torch.cat((model.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        if model.pos_embed is not None:
            x = x + model.pos_embed
        return model.pos_drop(x)

    def is_plain(self) -> bool:
        """Exactly timm's Beit."""
        return type(self.model) is TimmBeit

    # -- inside one block ------------------------------------------------------------------------------------

    @staticmethod
    def make_room(block: nn.Module, at: int) -> None:
        """The attention zero-pads its relative-position bias (own and shared) for the extra tokens."""
        block.attn = BeitRoom(block.attn, at)


# The room acts on no rows: petl.MultiTask gives its shared blocks the same room at the batch's prompt slots.
rows.register_row_hook(BeitRoom)(rows.room_hook)
