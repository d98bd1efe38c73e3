"""timm's VisionTransformer with parallel blocks (``vit_pwee_*``, ``vit_*_xp_*``) as a
:class:`~petl.model.backbone.base.Backbone`.

timm builds these models as a plain ``VisionTransformer`` whose blocks are ``ParallelScalingBlock``s (ViT-22B's
layout, arXiv 2302.05442), so the family is chosen by block class (``register_backbone(..., blocks=)``).  A block is

    y = in_norm(x);  [h | q | k | v] = in_proj(y)  (rows in timm's ``in_split`` order: MLP hidden first)
    x + drop_path(ls(attn_out_proj(attention(q, k, v)) + mlp_out_proj(act(h + mlp_bias))))

one pre-norm, one fused input Linear holding fc1's rows and the Q, K, V rows, two output Linears and one residual.
timm calls every Linear as a module (``self.in_proj(y)``), so a wrapper put in its place runs.  What petl's methods
ask for maps onto it as follows:

* ``q``, ``k``, ``v``, ``qkv`` and ``fc1`` are rows of ``in_proj`` (:meth:`VitParallel.target_rows`); ``proj`` is
  ``attn_out_proj`` and ``fc2`` is ``mlp_out_proj`` (:meth:`VitParallel.linear` takes either name).
* the MLP's output is ``mlp_out_proj``'s (:meth:`VitParallel.feed_forward`): a sequential adapter reads and adds to
  it before it joins the attention's output.
* there is one residual: the attention and the MLP both read the block's input, so the stream "entering the MLP
  half" is that input (:meth:`VitParallel.mlp_input_and_output`); methods that act between two residual halves
  cannot be built on it.
* there is no attention or MLP module to wrap: what sits beside both (Convpass's bypasses) is added to their
  summed output (:meth:`VitParallel.beside_sublayers`).
* with ``qkv_bias=False`` (``vit_*_xp_*``) fc1's bias is a bare ``mlp_bias`` added after ``in_proj``
  (:meth:`VitParallel.linear_biases` counts it as ``in_proj``'s).

The differential-attention blocks of ``vit_dpwee_*`` and blocks with a fused ``out_proj`` are refused by
:meth:`VitParallel.check`.
"""

from __future__ import annotations

from typing import Any

import torch
from timm.models.vision_transformer import DiffParallelScalingBlock, ParallelScalingBlock, VisionTransformer
from torch import nn

from petl.model.backbone.base import QKV_INDEX, register_backbone, unwrap
from petl.model.backbone.vit import ViT

# petl's usual names for the output Linears -> timm's names in a parallel block.
OUTPUT_LINEARS = {"proj": "attn_out_proj", "fc2": "mlp_out_proj"}
# What in_proj holds besides Q, K and V, by petl's usual names.
IN_PROJ_PARTS = ("qkv", "fc1")


@register_backbone(VisionTransformer, blocks=(ParallelScalingBlock, DiffParallelScalingBlock))
class VitParallel(ViT):
    """A timm VisionTransformer whose blocks are ``ParallelScalingBlock``s (attention and MLP side by side)."""

    kind = "vit_parallel"
    supported = (
        "a timm VisionTransformer with ParallelScalingBlocks (vit_pwee_*, vit_*_xp_*) with separate "
        "attn_out_proj and mlp_out_proj"
    )
    block_types = (ParallelScalingBlock,)
    timm_modules = ("vision_transformer",)
    linear_names = ("in_proj", "attn_out_proj", "mlp_out_proj")
    norm_groups = (("in_norm", ("in_proj", "attn_out_proj", "mlp_out_proj")),)
    sublayers_are_modules = False

    def check(self) -> None:
        """Raise a ValueError naming what is supported unless every block is a ParallelScalingBlock petl takes.

        Raises:
            ValueError: a differential-attention block (``vit_dpwee_*``), a fused ``out_proj``, or no classifier head.

        """
        model, name = self.model, type(self.model).__name__
        for i, block in enumerate(model.blocks):
            inner = unwrap(block)
            if type(inner) is DiffParallelScalingBlock:
                raise ValueError(
                    f"petl supports {self.supported}; block {i} of {name} is a DiffParallelScalingBlock "
                    "(vit_dpwee_*): its differential attention (two softmax maps per head weighted by learned "
                    "lambdas, then a per-head norm) feeds one out_proj fused with the MLP's, not taken yet"
                )
            if type(inner) is not ParallelScalingBlock:
                raise ValueError(f"petl supports {self.supported}; block {i} of {name} is a {type(inner).__name__}")
            if inner.out_proj is not None:
                raise ValueError(
                    f"petl supports {self.supported}; block {i} of {name} fuses them into one out_proj "
                    "(fuse_out_proj=True)"
                )
        if not hasattr(model, "reset_classifier") or not hasattr(model, "head"):
            raise ValueError(f"petl supports {self.supported}; {name} has no timm classifier head.")

    # -- inside one block ------------------------------------------------------------------------------------

    @staticmethod
    def linear_slot(block: nn.Module, name: str) -> tuple[nn.Module, str]:
        """``in_proj``, ``attn_out_proj`` (also as ``proj``) or ``mlp_out_proj`` (also as ``fc2``), attributes of the
        block; timm calls each as a module, so a wrapper put there runs.

        Raises:
            ValueError: ``qkv`` or ``fc1``, which are rows of ``in_proj`` (see :meth:`target_rows`), or another name.

        """
        if name in IN_PROJ_PARTS:
            raise ValueError(f"a parallel block has no {name} Linear: {name} is rows of its one in_proj")
        name = OUTPUT_LINEARS.get(name, name)
        if name not in VitParallel.linear_names:
            raise ValueError(f"a parallel block has no {name} Linear (it has {', '.join(VitParallel.linear_names)})")
        return block, name

    @classmethod
    def linear_biases(cls, block: nn.Module, name: str) -> list[nn.Parameter]:
        """The Linear's bias; for ``in_proj`` also ``mlp_bias``, fc1's bias where timm keeps it beside."""
        biases = super().linear_biases(block, name)
        if name == "in_proj" and isinstance(block.mlp_bias, nn.Parameter):
            biases.append(block.mlp_bias)
        return biases

    @classmethod
    def qkv_rows(cls, block: nn.Module, part: str) -> tuple[str, int, int]:
        """Q, K and V follow the MLP's hidden rows in ``in_proj`` (timm's ``in_split``)."""
        hidden, width = block.in_split[0], block.in_split[1]
        start = hidden + QKV_INDEX[part] * width
        return "in_proj", start, start + width

    @classmethod
    def target_rows(cls, block: nn.Module, target: str) -> tuple[str, int, int]:
        """``q``, ``k``, ``v``, ``qkv`` and ``fc1`` as rows of ``in_proj``; ``proj`` and ``fc2`` as their Linears."""
        if target in QKV_INDEX:
            return cls.qkv_rows(block, target)
        hidden = block.in_split[0]
        if target == "fc1":
            return "in_proj", 0, hidden
        if target == "qkv":
            return "in_proj", hidden, hidden + 3 * block.in_split[1]
        return OUTPUT_LINEARS.get(target, target), 0, cls.linear(block, target).out_features

    @staticmethod
    def attention(block: nn.Module) -> nn.Module:
        """A parallel block has no attention module.

        Raises:
            ValueError: always.

        """
        raise ValueError("a parallel block has no attention module: in_proj, attention and attn_out_proj run inline")

    @staticmethod
    def set_attention(block: nn.Module, module: nn.Module) -> None:
        """See :meth:`attention`."""
        VitParallel.attention(block)

    @staticmethod
    def num_heads(block: nn.Module) -> int:
        """Timm's ``num_heads`` of the block."""
        return int(block.num_heads)

    @staticmethod
    def feed_forward(block: nn.Module) -> nn.Module:
        """``mlp_out_proj``: its output is the MLP's output (its input is the MLP's hidden activation)."""
        return block.mlp_out_proj

    @staticmethod
    def set_feed_forward(block: nn.Module, module: nn.Module) -> None:
        """Replace ``mlp_out_proj`` (see :meth:`feed_forward`)."""
        block.mlp_out_proj = module

    @staticmethod
    def block_norm(block: nn.Module, name: str) -> nn.Module:
        """``in_norm``, the block's one norm.

        Raises:
            ValueError: another name (``norm1``, ``norm2``: a parallel block has one norm).

        """
        if name != "in_norm":
            raise ValueError(f"a parallel block has one norm, in_norm, not {name}")
        return block.in_norm

    @staticmethod
    def set_block_norm(block: nn.Module, name: str, module: nn.Module) -> None:
        """Replace ``in_norm``."""
        VitParallel.block_norm(block, name)
        block.in_norm = module

    @staticmethod
    def mlp_norm(block: nn.Module) -> nn.Module:
        """``in_norm``: the MLP reads the block's one norm."""
        return block.in_norm

    @staticmethod
    def layer_scale_parameters(block: nn.Module) -> list[nn.Parameter]:
        """The parameters of ``ls``, the one layer scale on the summed outputs (none where it is ``nn.Identity``)."""
        return list(block.ls.parameters())

    @staticmethod
    def attn_branch(block: nn.Module, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """A parallel block has one residual branch, not an attention half.

        Raises:
            ValueError: always.

        """
        raise ValueError("a parallel block has one residual: its attention and MLP are not two halves")

    @staticmethod
    def mlp_branch(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """See :meth:`attn_branch`."""
        return VitParallel.attn_branch(block, x)

    @classmethod
    def attn_residual(cls, block: nn.Module, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """See :meth:`attn_branch`."""
        return cls.attn_branch(block, x)

    @classmethod
    def mlp_residual(cls, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """See :meth:`attn_branch`."""
        return cls.attn_branch(block, x)

    @classmethod
    def mlp_input_and_output(
        cls, block: nn.Module, x: torch.Tensor, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MLP reads the block's input (through ``in_norm``, as the attention does): ``(x, block(x))``."""
        return x, block(x, **kwargs)

    @staticmethod
    def beside_sublayers(block: nn.Module, x: torch.Tensor, side: Any) -> torch.Tensor:
        """``drop_path(ls(side(in_norm(x))))``: ``side`` reads what the attention and the MLP read, and adds to their
        summed output inside the layer scale (its drop path draws a mask of its own in training).
        """
        return block.drop_path(block.ls(side(block.in_norm(x))))
