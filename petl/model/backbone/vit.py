"""timm's VisionTransformer as a :class:`~petl.model.backbone.base.Backbone`: the one module that knows its internals.

One width for every block, one stage, a flat token sequence with the class and register tokens in front, and
pre-norm blocks whose attention and MLP are residual halves.  timm's ``Attention`` computes Q, K and V with one
Linear whose output rows are laid out as Q = [0, d), K = [d, 2d), V = [2d, 3d).
"""

from __future__ import annotations

from typing import Any

import torch
from timm.models import checkpoint_seq
from timm.models.deit import VisionTransformerDistilled
from timm.models.vision_transformer import Block, ParallelThingsBlock, VisionTransformer
from torch import nn

from petl.model.backbone.base import Backbone, register_backbone, unwrap
from petl.model.backbone.timm_block import TimmBlockParts, TimmModelParts
from petl.model.prompts import PromptedBlock


@register_backbone(VisionTransformer)
class ViT(TimmModelParts, TimmBlockParts, Backbone):
    """A timm VisionTransformer (ViT, DeiT, with or without class token, register tokens, token or avg pooling)."""

    kind = "vit"
    supported = (
        "a timm VisionTransformer (ViT, DeiT, with or without class token, register tokens, "
        "token or avg pooling) whose blocks have a fused attn.qkv Linear"
    )
    layout = "sequence"
    # timm's pre-norm Block: x + drop_path1(ls1(attn(norm1(x)))), then the same with the MLP.
    block_types = (Block,)
    # Modules whose models are (subclasses of) VisionTransformer; "models" is the module name timm records for
    # petl's own petl/backbones/models.py.  vitamin_* are VisionTransformers behind a CNN stem (HybridEmbed).
    timm_modules = ("vision_transformer", "vision_transformer_hybrid", "deit", "vitamin", "models")
    # fc1_g, fc1_x: an unpacked SwiGLU MLP's two input Linears in place of fc1 (timm's AIMv2 ViTs).
    linear_names = ("qkv", "proj", "fc1", "fc1_g", "fc1_x", "fc2")
    # Pool types whose pooled features can leave out masked tokens (see pooled_features).
    maskable_pools = ("token", "avg")

    def check(self) -> None:
        """Raise a ValueError naming what is supported unless the model is a usable timm ViT.

        Raises:
            ValueError: if the model lacks ``blocks``, ``embed_dim`` or a fused ``attn.qkv`` Linear, or its blocks are
                not timm's pre-norm ``Block``.

        """
        model, name = self.model, type(self.model).__name__
        blocks = getattr(model, "blocks", None)
        if not isinstance(blocks, nn.Sequential) or len(blocks) == 0 or not hasattr(model, "embed_dim"):
            raise ValueError(f"petl supports {self.supported}; got {name}, which has no timm ViT blocks.")
        for i, block in enumerate(blocks):
            inner = unwrap(block)
            if isinstance(inner, ParallelThingsBlock):
                raise ValueError(
                    f"petl supports {self.supported}; block {i} of {name} is a ParallelThingsBlock (vit_*_18x2_*): "
                    "its attentions and MLPs run in pairs side by side, where petl reads one of each: take a plain "
                    "ViT of its width (vit_small_patch16_224, vit_base_patch16_224)"
                )
            qkv = getattr(getattr(inner, "attn", None), "qkv", None)
            if not isinstance(qkv, nn.Linear) or qkv.out_features != 3 * qkv.in_features:
                # e.g. a block with separate q, k and v Linears; the parallel blocks of vit_pwee_* are vit_parallel's.
                raise ValueError(
                    f"petl supports {self.supported}; block {i} of {name} ({type(inner).__name__}) has no fused "
                    "attn.qkv Linear."
                )
            if not hasattr(inner, "mlp"):
                raise ValueError(f"petl supports {self.supported}; block {i} of {name} has no mlp.")
            if type(inner) not in self.block_types:
                # e.g. the post-norm ResPostBlock of vit_base_patch16_rpn_224: the halves below are pre-norm ones.
                raise ValueError(
                    f"petl supports {self.supported}; block {i} of {name} is a {type(inner).__name__}, not timm's "
                    "pre-norm Block"
                )
        if not hasattr(model, "reset_classifier") or not hasattr(model, "head"):
            raise ValueError(f"petl supports {self.supported}; {name} has no timm classifier head.")

    # -- the blocks ------------------------------------------------------------------------------------------

    def block_container(self) -> nn.Sequential:
        """The ``nn.Sequential`` of blocks as the model runs it (wrappers included).

        timm's forward runs this container itself (plainly or through ``checkpoint_seq``), so methods
        that must act between blocks wrap single entries instead of replacing the container.
        """
        return self.model.blocks

    def set_block(self, index: int, module: nn.Module) -> None:
        """Replace the block at ``index`` in the running container."""
        self.model.blocks[index] = module

    def widths(self) -> list[int]:
        """Every block has the model's ``embed_dim``."""
        return [int(self.model.embed_dim)] * len(self.model.blocks)

    def stages(self) -> list[int]:
        """One stage."""
        return [0] * len(self.model.blocks)

    def width(self) -> int:
        """The model's ``embed_dim``."""
        return int(self.model.embed_dim)

    # -- the tokens ------------------------------------------------------------------------------------------

    def num_prefix_tokens(self) -> int:
        """Class plus register tokens that precede the patch tokens."""
        model = self.model
        return int(getattr(model, "num_prefix_tokens", 1 if getattr(model, "cls_token", None) is not None else 0))

    def tokens_in(self, x: torch.Tensor) -> int:
        """A flat sequence (batch, tokens, width)."""
        return int(x.shape[-2])

    def embed_tokens(self, images: torch.Tensor) -> torch.Tensor:
        """Patch embedding, position embedding, patch drop, pre-norm: timm's ``forward_features`` up to its blocks."""
        model = self.model
        x = model.patch_embed(images)
        x = model._pos_embed(x)
        x = model.patch_drop(x)
        return model.norm_pre(x)

    def run_block(
        self,
        block: nn.Module,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        inputs: dict[str, Any] | None = None,
        index: int | None = None,
    ) -> torch.Tensor:
        """Timm's blocks take the mask as ``attn_mask`` (and no ``inputs``: a ViT's are none)."""
        return block(x) if attn_mask is None else block(x, attn_mask=attn_mask)

    # -- after the blocks ------------------------------------------------------------------------------------

    def head(self) -> nn.Module:
        """The classifier head module (``nn.Identity`` when the model has no classes)."""
        return self.model.head

    def set_head(self, module: nn.Module) -> None:
        """Timm's ``forward_head`` calls ``head`` on the pooled features."""
        self.model.head = module

    def head_in_features(self) -> int:
        """Width of the pooled features the head receives."""
        return int(getattr(self.model, "head_hidden_size", self.model.embed_dim))

    def named_final_norms(self) -> list[tuple[str, nn.Module]]:
        """``norm`` and ``fc_norm``, those that exist."""
        return [(n, m) for n in ("norm", "fc_norm") if isinstance(m := getattr(self.model, n, None), nn.Module)]

    def set_final_norm(self, name: str, module: nn.Module) -> None:
        """Replace ``norm`` or ``fc_norm``."""
        setattr(self.model, name, module)

    def pool_type(self) -> str:
        """``token``, ``avg``, ``max``, ``avgmax``, ``map`` (attention pool), or ``""``."""
        return "map" if getattr(self.model, "attn_pool", None) is not None else str(self.model.global_pool)

    def pooled_features(self, tokens: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """The final norm, the pooling, ``fc_norm`` and head dropout applied to the blocks' output.

        timm's ``norm`` then ``forward_head(pre_logits=True)``, except that ``keep`` (batch x tokens, bool), when
        given, leaves the tokens it marks False out of an average pooling, as if they were not in the sequence.

        Raises:
            ValueError: ``keep`` with a pooling other than :attr:`maskable_pools`.

        """
        model = self.model
        x = model.norm(tokens)
        pool = self.pool_type()
        if keep is None or pool == "token":
            x = model.pool(x)
        elif pool == "avg":
            start = 0 if getattr(model, "pool_include_prefix", False) else self.num_prefix_tokens()
            weight = keep[:, start:, None].to(x.dtype)
            x = (x[:, start:] * weight).sum(dim=1) / weight.sum(dim=1)
        else:
            raise ValueError(
                f"cannot leave tokens out of the {pool!r} pooling: only {', '.join(self.maskable_pools)} can"
            )
        return model.head_drop(model.fc_norm(x))

    # -- taking the blocks' input and output -----------------------------------------------------------------

    def is_plain(self) -> bool:
        """Exactly timm's VisionTransformer (a subclass may run another forward)."""
        return type(self.model) is VisionTransformer

    def stem(self) -> tuple[list[nn.Parameter], list[nn.Module]]:
        """The model's own parameters (class, register and position embeddings) and its children before ``blocks``."""
        after = ("blocks", "norm", "fc_norm", "attn_pool", "head_drop", "head")
        modules = [module for name, module in self.model.named_children() if name not in after]
        return list(self.model.parameters(recurse=False)), modules

    def after_blocks(self) -> list[nn.Module]:
        """``norm``, ``fc_norm``, ``attn_pool``, those that exist."""
        model = self.model
        return [getattr(model, n) for n in ("norm", "fc_norm", "attn_pool") if getattr(model, n, None) is not None]

    def block_input_module(self, index: int) -> nn.Module:
        """Block ``index``, or the final ``norm`` after the last."""
        return self.model.blocks[index] if index < len(self.model.blocks) else self.model.norm

    def forward_from(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """The rest of timm's ``forward_features`` and ``forward_head`` from block ``start`` on."""
        model = self.model
        tail = model.blocks[start:]
        # Honour gradient checkpointing as timm's forward_features does.
        x = checkpoint_seq(tail, x) if getattr(model, "grad_checkpointing", False) else tail(x)
        return model.forward_head(model.norm(x))

    def num_tokens(self) -> int:
        """Patch tokens (where the patch embedding knows them) plus prefix tokens."""
        patch_embed = self.model.patch_embed
        grid = patch_embed.num_patches if hasattr(patch_embed, "num_patches") else 0
        return grid + self.num_prefix_tokens()

    # -- prompt tokens ---------------------------------------------------------------------------------------

    def insert_prompts(self, prompts: list[torch.Tensor | None], dropout: float, strip: bool) -> None:
        """Prompts right after the class and register tokens (:class:`petl.model.prompts.PromptedBlock`).

        Blocks without prompts of their own carry the previous prompt outputs along and stay unwrapped, but for
        the last with ``strip``.
        """
        depth, count = self.depth(), prompts[0].shape[0]
        for block in self.block_list():
            # Every block carries the prompts; where a block adds position terms inside attention (a relative-position
            # bias, a rotary embedding) the prompts get none.
            self.make_room(block, self.num_prefix_tokens())
        for i, prompt in enumerate(prompts):
            last_strip = strip and i == depth - 1
            if prompt is None and not last_strip:
                continue
            wrapper = PromptedBlock(
                self.block_container()[i],
                num_prefix=self.num_prefix_tokens(),
                num_tokens=count,
                prompt=prompt,
                replace=i > 0,
                strip=last_strip,
                dropout=dropout,
            )
            self.set_block(i, wrapper)

    # -- inside one block ------------------------------------------------------------------------------------

    @staticmethod
    def layer_scale_parameters(block: nn.Module) -> list[nn.Parameter]:
        """The parameters of ``ls1`` and ``ls2`` (none where they are ``nn.Identity``)."""
        return [*block.ls1.parameters(), *block.ls2.parameters()]

    @staticmethod
    def attn_branch(block: nn.Module, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """``drop_path1(ls1(attn(norm1(x))))``."""
        return block.drop_path1(block.ls1(block.attn(block.norm1(x), **kwargs)))

    @staticmethod
    def mlp_branch(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``drop_path2(ls2(mlp(norm2(x))))``."""
        return block.drop_path2(block.ls2(block.mlp(block.norm2(x))))

    @staticmethod
    def mlp_norm(block: nn.Module) -> nn.Module:
        """``norm2``."""
        return block.norm2

    @staticmethod
    def make_room(block: nn.Module, at: int) -> None:
        """Nothing to do: a ViT adds its (absolute) position embedding before the blocks."""


@register_backbone(VisionTransformerDistilled)
class DistilledViT(ViT):
    """timm's DeiT with a distillation token (``deit_*_distilled_*``), refused: its logits average two heads, ``head``
    on the class token and ``head_dist`` on the distillation token, where petl's head, feature cache, parameter counts
    and :class:`petl.MultiTask` read one head on the pooled features (a mixed batch would answer ``head`` alone).
    """

    # ViT's blocks stay ViT's (block_family): this class only refuses the model around them.
    block_types = ()

    def check(self) -> None:
        """Refuse the model in one line saying which DeiT to take instead.

        Raises:
            ValueError: always.

        """
        raise ValueError(
            f"petl supports {self.supported}; {type(self.model).__name__} (deit_*_distilled_*) averages two heads, "
            "head on the class token and head_dist on the distillation token, which petl reads as one: take the "
            "DeiT without distillation (deit_*_patch16_224)"
        )
