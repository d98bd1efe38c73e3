"""timm's VisionTransformerRelPos (``vit_relpos_*``, ``vit_srelpos_*``) as a
:class:`~petl.model.backbone.base.Backbone`.

A ViT without absolute position embedding: each block's attention adds a relative-position bias over the patch
grid (``attn.rel_pos``, a table or a small MLP), or one bias shared by every block (``shared_rel_pos``, computed
once per forward and passed to each block).  timm zero-pads the bias for a class token (``RelPosMlp``) or learns
class-to-patch entries (``RelPosBias``).  The blocks (``RelPosBlock``) have ViT's parts under ViT's names
(``norm1``, ``attn.qkv``, ``attn.proj``, ``ls1``, ``mlp.fc1``...), so the block-level knowledge is the ViT's;
what differs is the model around them: a ``ModuleList`` called with the shared bias, no ``pool`` method.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from timm.models._manipulate import checkpoint
from timm.models.vision_transformer_relpos import RelPosAttention, RelPosBlock, VisionTransformerRelPos
from torch import nn

from petl.model import rows
from petl.model.backbone.base import register_backbone, unwrap
from petl.model.backbone.vit import ViT
from petl.model.wrappers import PetlModule


@functools.lru_cache(maxsize=64)
def _kept(n: int, at: int, count: int, device: torch.device) -> torch.Tensor:
    """Where the ``n`` tokens of a bias sit once ``count`` tokens are inserted at ``at``: built once per layout and
    device, not in every block's attention (three ops each); a plain tensor even when first asked for in inference
    mode, so that autograd may save it.
    """
    with torch.inference_mode(False):
        return torch.cat([torch.arange(at), torch.arange(at + count, n + count)]).to(device)


def pad_bias(bias: torch.Tensor, at: int, count: int) -> torch.Tensor:
    """``bias`` (..., N, N) with ``count`` zero rows and columns inserted at ``at``: no bias to or from them."""
    if count == 0:
        return bias
    n = bias.shape[-1]
    out = bias.new_zeros(*bias.shape[:-2], n + count, n + count)
    keep = _kept(n, at, count, bias.device)
    out[..., keep[:, None], keep] = bias
    return out


def with_mask(bias: torch.Tensor | None, attn_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The additive ``attn_mask`` (0 or -inf, SDPA's float mask) added to the attention's ``bias``."""
    if attn_mask is None:
        return bias
    return attn_mask if bias is None else bias + attn_mask


class RelPosRoom(PetlModule):
    """timm's ``RelPosAttention`` taking extra tokens at ``at`` (those beyond the bias's) that get no relative-position
    bias.

    Runs the attention's own projections, norms and bias module; only the bias (the block's own and the shared
    one) is zero-padded for the extra tokens, as in the VPT code's Swin (swin_transformer.py L480-508).  It also
    takes an additive ``attn_mask``, which timm's attention does not: a mixed batch (:class:`petl.MultiTask`) keeps
    each row from attending the prompt slots its task does not fill.  With no extra tokens and no mask it runs the ops
    of timm's fused attention.
    """

    def __init__(self, base: RelPosAttention, at: int) -> None:
        super().__init__(base)
        self.at = at

    def forward(
        self, x: torch.Tensor, shared_rel_pos: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        attn = self.base
        batch, tokens, channels = x.shape
        qkv = attn.qkv(x).reshape(batch, tokens, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = attn.q_norm(q), attn.k_norm(k)
        bias = attn.rel_pos.get_bias() if attn.rel_pos is not None else shared_rel_pos
        if bias is not None:
            bias = pad_bias(bias, self.at, tokens - bias.shape[-1]).to(q.dtype)
        bias = with_mask(bias, attn_mask)
        x = F.scaled_dot_product_attention(
            q, k, v, attn_mask=bias, dropout_p=attn.attn_drop.p if attn.training else 0.0
        )
        return attn.proj_drop(attn.proj(x.transpose(1, 2).reshape(batch, tokens, channels)))


@register_backbone(VisionTransformerRelPos)
class VitRelPos(ViT):
    """A timm VisionTransformerRelPos (per-block or shared relative-position bias, class token or not)."""

    kind = "vit_relpos"
    supported = "a timm VisionTransformerRelPos (vit_relpos_*, vit_srelpos_*) with pre-norm RelPosBlocks"
    # timm's pre-norm RelPosBlock: ViT's Block with the bias passed to its attention.  The post-norm
    # ResPostRelPosBlock (the *_rpn_* models) runs its halves otherwise: refused by check().
    block_types = (RelPosBlock,)
    timm_modules = ("vision_transformer_relpos",)
    # The keyword the blocks take the shared bias by.
    shared_bias_arg = "shared_rel_pos"
    # timm's blocks pass their attention no mask (run_block runs a masked block as its halves).
    blocks_take_mask = False
    # The attention given room for extra tokens (make_room): it takes a mask.
    room_types: ClassVar[tuple[type, ...]] = (RelPosRoom,)

    def check(self) -> None:
        """Raise a ValueError naming what is supported unless every block is a pre-norm RelPosBlock.

        Raises:
            ValueError: a block of another type (the post-norm ``*_rpn_*`` models).

        """
        name = type(self.model).__name__
        for i, block in enumerate(self.model.blocks):
            if type(unwrap(block)) is not RelPosBlock:
                raise ValueError(
                    f"petl supports {self.supported}; block {i} of {name} is a {type(unwrap(block)).__name__}"
                )

    def batch_shared_modules(self) -> list[nn.Module]:
        """Each attention's ``rel_pos`` and the model's ``shared_rel_pos``: they compute the position bias from the
        grid's relative coordinates (with a small MLP in timm's ``RelPosMlp``), not from the images' rows.
        """
        own = [block.attn.rel_pos for block in self.block_list() if block.attn.rel_pos is not None]
        shared = self.model.shared_rel_pos
        return own + ([shared] if shared is not None else [])

    def block_inputs(self, room: tuple[int, int] | None = None) -> dict[str, Any]:
        """The shared bias (``None`` where each attention has its own), by the keyword the blocks take it; with
        ``room``, zero-padded for the extra tokens once for every block (whose attention pads it no further).
        """
        shared = self._shared_bias()
        if shared is not None and room is not None:
            shared = pad_bias(shared, *room)
        return {self.shared_bias_arg: shared}

    def _shared_bias(self) -> torch.Tensor | None:
        shared = self.model.shared_rel_pos
        return shared.get_bias() if shared is not None else None

    def embed_tokens(self, images: torch.Tensor) -> torch.Tensor:
        """Patch embedding and class token: timm's ``forward_features`` up to its blocks."""
        model = self.model
        x = model.patch_embed(images)
        if model.cls_token is not None:
            x = torch.cat((model.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        return x

    def run_block(
        self,
        block: nn.Module,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        inputs: dict[str, Any] | None = None,
        index: int | None = None,
    ) -> torch.Tensor:
        """The block with the model's shared bias and, where given, ``attn_mask``.

        timm's block passes its attention no mask: a plain block given one runs as its two residual halves, the mask
        going to the attention, which takes one once it has room for extra tokens (:meth:`make_room`, as a
        :class:`petl.MultiTask` gives its shared blocks for the batch's prompt slots); a wrapper around the block (a
        MultiTask's routed block) takes the mask on itself.

        Raises:
            ValueError: ``attn_mask`` given to a plain block whose attention has no room.

        """
        inputs = self.block_inputs() if inputs is None else inputs
        if attn_mask is None:
            return block(x, **inputs)
        if type(block) not in self.block_types:
            return block(x, attn_mask=attn_mask, **inputs)
        if not isinstance(block.attn, self.room_types):
            raise ValueError(f"{type(self.model).__name__}'s attention takes no mask until it has room for prompts")
        return self.mlp_residual(block, self.attn_residual(block, x, attn_mask=attn_mask, **inputs))

    def pool_type(self) -> str:
        """``avg``, ``token`` or ``""``."""
        return str(self.model.global_pool)

    def pooled_features(self, tokens: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """The final norm and timm's ``forward_head(pre_logits=True)``; ``keep`` leaves tokens out of ``avg``.

        Raises:
            ValueError: ``keep`` with a pooling other than :attr:`maskable_pools`.

        """
        model = self.model
        x = model.norm(tokens)
        pool = self.pool_type()
        if keep is None or pool == "token":
            return model.forward_head(x, pre_logits=True)
        if pool != "avg":
            raise ValueError(f"cannot leave tokens out of the {pool!r} pooling: only {', '.join(self.maskable_pools)}")
        start = self.num_prefix_tokens()
        weight = keep[:, start:, None].to(x.dtype)
        return model.head_drop(model.fc_norm((x[:, start:] * weight).sum(dim=1) / weight.sum(dim=1)))

    def is_plain(self) -> bool:
        """Exactly timm's VisionTransformerRelPos."""
        return type(self.model) is VisionTransformerRelPos

    def after_blocks(self) -> list[nn.Module]:
        """``norm`` and ``fc_norm``."""
        return [self.model.norm, self.model.fc_norm]

    def forward_from(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """The rest of timm's ``forward_features`` and ``forward_head`` from block ``start`` on."""
        model, shared = self.model, self.block_inputs()
        for block in model.blocks[start:]:
            x = checkpoint(block, x, **shared) if model.grad_checkpointing else block(x, **shared)
        return model.forward_head(model.norm(x))

    @staticmethod
    def make_room(block: nn.Module, at: int) -> None:
        """The attention zero-pads its relative-position bias (own or shared) for the extra tokens."""
        block.attn = RelPosRoom(block.attn, at)


# The room acts on no rows: petl.MultiTask gives its shared blocks the same room at the batch's prompt slots.
rows.register_row_hook(RelPosRoom)(rows.room_hook)
