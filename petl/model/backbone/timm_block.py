"""The parts of a block as timm names them in its ViT and Swin blocks, shared by the families whose blocks do.

timm's ``Block`` (ViT and its relpos, BEiT and EVA variants) and ``SwinTransformerBlock`` (v1 and v2) keep the
attention as ``attn`` (with ``qkv`` and ``proj``), the MLP as ``mlp`` (``fc1``, ``fc2``) and the norms as
``norm1``/``norm2``; what differs between the families (the residual halves, where the norms sit, layer scales)
stays in each family's own module.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# The Linears that live in the attention; the others (fc1, fc2) live in the MLP.
ATTENTION_LINEARS = ("qkv", "proj")


class TimmBlockParts:
    """:class:`~petl.model.backbone.base.Backbone`'s block-level accessors for blocks with timm's part names."""

    @staticmethod
    def linear(block: nn.Module, name: str) -> nn.Module:
        """``qkv``, ``proj`` (attention) or ``fc1``, ``fc2`` (MLP)."""
        owner = block.attn if name in ATTENTION_LINEARS else block.mlp
        return getattr(owner, name)

    @staticmethod
    def set_linear(block: nn.Module, name: str, module: nn.Module) -> None:
        """Replace ``qkv``, ``proj``, ``fc1`` or ``fc2``."""
        owner = block.attn if name in ATTENTION_LINEARS else block.mlp
        setattr(owner, name, module)

    @classmethod
    def linear_biases(cls, block: nn.Module, name: str) -> list[nn.Parameter]:
        """The Linear's own bias, where it has one."""
        bias = getattr(cls.linear(block, name), "bias", None)
        return [bias] if isinstance(bias, nn.Parameter) else []

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
