"""timm's SwinTransformerV2Cr (``swinv2_cr_*``) as a :class:`~petl.model.backbone.base.Backbone`.

timm keeps it in its own module (``timm/models/swin_transformer_v2_cr.py``, Christoph Reich's SwinV2), apart from
``SwinTransformerV2``, and so does petl: the stages and windows are Swin's (:class:`~petl.model.backbone.swin.Swin`
is the base), but the model and its blocks are laid out otherwise (line numbers: timm 1.0.31):

* the stages are ``model.stages`` (L858), not ``layers``; between stages the tensors are NCHW, and each stage turns
  its input to NHWC, runs its PatchMerging (``downsample``), then its blocks, and turns the result back (L718-734);
  the patch embedding hands NCHW (L611-613) and the head pools NCHW.  petl's blocks pass the NHWC grid the blocks
  take, so :meth:`SwinV2Cr.embed_tokens`, :meth:`SwinV2Cr.forward_from` and :meth:`SwinV2Cr.pooled_features` turn
  the layout where timm's stages do;
* a block is post-norm with cosine attention (as a SwinV2's), but its ``qkv`` Linear holds the Q/K/V bias (L138)
  and the attention calls it as a module (L231): nothing sits beside it, so a wrapper in its place runs as is;
* the attention's position bias comes from a small MLP over the window's relative coordinates, ``meta_mlp``
  (L143), a table every image shares (:meth:`SwinV2Cr.batch_shared_modules`), and a per-head ``logit_scale`` (L152);
* a block may end with a third norm on the residual stream, ``norm3(x + mlp branch)`` (L496; L334: built where
  ``extra_norm``, L670-674): on the last block of every stage of the ``_ns`` models (``extra_norm_stage``), on every
  ``extra_norm_period``-th block, and always on the model's last block (L848), where it is the model's only final
  norm: there is no ``norm`` after the stages (L1042-1045).  :meth:`SwinV2Cr.mlp_residual` includes it, so a method
  that runs a block's halves runs it whole; :meth:`SwinV2Cr.named_final_norms` names the last block's.
"""

from __future__ import annotations

from typing import Any

import torch
from timm.models.swin_transformer_v2_cr import SwinTransformerV2Cr, SwinTransformerV2CrBlock
from torch import nn

from petl.model.backbone.base import Backbone, register_backbone
from petl.model.backbone.swin import Swin, run_blocks


def to_nhwc(x: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) to (B, H, W, C), as timm's ``bchw_to_bhwc``."""
    return x.permute(0, 2, 3, 1)


def to_nchw(x: torch.Tensor) -> torch.Tensor:
    """(B, H, W, C) to (B, C, H, W), as timm's ``bhwc_to_bchw``."""
    return x.permute(0, 3, 1, 2)


@register_backbone(SwinTransformerV2Cr)
class SwinV2Cr(Swin):
    """A timm SwinTransformerV2Cr: Swin's stages of post-norm cosine-attention blocks, NCHW between stages."""

    kind = "swinv2_cr"
    supported = "a timm SwinTransformerV2Cr (swinv2_cr_*) whose blocks have a fused attn.qkv Linear"
    # x + drop_path1(norm1(attention over windows of x)), then norm3(x + drop_path2(norm2(mlp(x)))).
    block_types = (SwinTransformerV2CrBlock,)
    timm_modules = ("swin_transformer_v2_cr",)
    stages_attribute = "stages"  # L858

    # -- the tokens ------------------------------------------------------------------------------------------

    def embed_tokens(self, images: torch.Tensor) -> torch.Tensor:
        """The patch embedding (with its norm), turned to the NHWC grid the first stage turns it to (L725)."""
        return to_nhwc(self.model.patch_embed(images))

    # -- after the blocks ------------------------------------------------------------------------------------

    def named_final_norms(self) -> list[tuple[str, nn.Module]]:
        """The last block's ``norm3``: the model's only norm after the blocks, inside its last block (L848, L496)."""
        stage, j = self._places()[-1]
        norm = self.block_list()[-1].norm3
        return [] if isinstance(norm, nn.Identity) else [(f"stages.{stage}.blocks.{j}.norm3", norm)]

    def set_final_norm(self, name: str, module: nn.Module) -> None:
        """Replace the last block's ``norm3`` (the one name :meth:`named_final_norms` gives)."""
        self.block_list()[-1].norm3 = module

    def pooled_features(self, tokens: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """The head's pooling and dropout on the last block's NHWC output (its ``norm3`` is the final norm).

        ``keep`` (batch x rows*columns, bool), when given, leaves the tokens it marks False out of the average.

        Raises:
            ValueError: ``keep`` with a pooling other than :attr:`maskable_pools`.

        """
        if keep is None:
            return self.model.forward_head(to_nchw(tokens), pre_logits=True)
        return self.masked_pool(tokens, keep)

    # -- taking the blocks' input and output -----------------------------------------------------------------

    @staticmethod
    def model_types() -> tuple[type, ...]:
        """The model classes whose own forward :meth:`forward_from` replays."""
        return (SwinTransformerV2Cr,)

    def after_blocks(self) -> list[nn.Module]:
        """None: the final norm is the last block's ``norm3``, which the block's own parameters hold."""
        return []

    def block_input_module(self, index: int) -> nn.Module:
        """Block ``index`` (its stage's PatchMerging where it opens a stage that has one), or the head after the last.

        The PatchMerging takes the NHWC grid (the stage turns its input before it, L725), so every cut but the one
        after the last block receives the grid a block passes; the head receives NCHW.
        """
        if index >= self.depth():
            return self.model.head
        return super().block_input_module(index)

    def forward_from(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """The model's logits from the NHWC grid :meth:`block_input_module` ``(start)`` receives.

        The rest of ``start``'s stage as timm's stage runs it (its PatchMerging first where ``start`` opens the
        stage, gradient checkpointing honoured), turned to NCHW, the later stages and ``forward_head``.
        """
        model = self.model
        stage, j = self._places()[start]
        current = model.stages[stage]
        if j == 0:
            x = current.downsample(x)
        x = run_blocks(current.blocks[j:], x, current.grad_checkpointing)
        return model.forward_head(model.stages[stage + 1 :](to_nchw(x)))

    # -- prompt tokens: VPT declares no prompted reference for a SwinV2 (its refusal), so none are carried ----------

    # Backbone's refusals in place of the prompts Swin carries beside its grid.
    insert_prompts = Backbone.insert_prompts
    features_with_prompts = Backbone.features_with_prompts

    def prompted_intermediates(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """Refused: no prompts run beside this model's grid."""
        raise NotImplementedError(f"the {self.kind} backbone carries no prompts beside its tokens")

    # -- inside one block ------------------------------------------------------------------------------------

    def batch_shared_modules(self) -> list[nn.Module]:
        """Each window attention's ``meta_mlp``: it maps the relative-coordinates table to the position bias."""
        return [block.attn.meta_mlp for block in self.block_list()]

    @staticmethod
    def attn_branch(block: nn.Module, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """``drop_path1(norm1(windowed attention(x)))``: the norm after the attention (L491)."""
        return block.drop_path1(block.norm1(block._shifted_window_attn(x)))

    @staticmethod
    def mlp_branch(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``drop_path2(norm2(mlp(x)))``: per token, so the NHWC grid needs no flattening (L495)."""
        return block.drop_path2(block.norm2(block.mlp(x)))

    @classmethod
    def mlp_residual(cls, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``norm3(x + mlp_branch(x))``: the block's extra norm on the residual stream (an Identity in most, L496)."""
        return block.norm3(x + cls.mlp_branch(block, x))

    @staticmethod
    def mlp_norm(block: nn.Module) -> nn.Module:
        """A SwinV2Cr block has no norm in front of its MLP (its ``norm2`` follows the MLP).

        Raises:
            ValueError: always.

        """
        raise ValueError("a SwinV2Cr block is post-norm: no norm sits in front of its MLP")
