"""timm's Swin Transformer (v1 and v2) as :class:`~petl.model.backbone.base.Backbone`: the one module that knows them.

A Swin runs its blocks in stages (``model.layers[s].blocks``); each stage after the first starts with a
PatchMerging (``layers[s].downsample``) that halves the grid and doubles the width, so every block has the width
of its stage.  Tokens stay an NHWC grid (B, H, W, C) between blocks; a block's attention partitions that grid into
(shifted) windows and its ``WindowAttention`` sees (windows*B, window area, C).  There are no prefix tokens, and the
head (timm's ``ClassifierHead``) averages the grid before its ``fc``.

timm keeps v1 and v2 in two modules with two block classes, and petl keeps two kinds, because what differs is
what methods build on: a v1 block is pre-norm (``x + attn(norm1(x))``) with its Q/K/V bias inside the fused
``qkv`` Linear; a v2 block is post-norm (``x + norm1(attn(x))``, cosine attention) and adds separate ``q_bias`` and
``v_bias`` to a bias-free ``qkv``.  A method declares the kinds whose blocks its idea fits.  timm's third Swin
module, ``swin_transformer_v2_cr`` (``swinv2_cr_*``), is a kind of its own on this base:
:mod:`petl.model.backbone.swin_v2_cr`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from timm.models.swin_transformer import SwinTransformer, SwinTransformerBlock
from timm.models.swin_transformer_v2 import SwinTransformerV2, SwinTransformerV2Block, WindowAttention
from torch import nn
from torch.utils.checkpoint import checkpoint

from petl.model.backbone import swin_prompts
from petl.model.backbone.base import Backbone, register_backbone, unwrap
from petl.model.backbone.timm_block import QvBiasesBesideQkv, TimmBlockParts, TimmModelParts


@register_backbone(SwinTransformer)
class Swin(TimmModelParts, TimmBlockParts, Backbone):
    """A timm SwinTransformer (Swin v1: pre-norm blocks, windowed attention with a fused qkv, patch merging)."""

    kind = "swin"
    supported = "a timm SwinTransformer (swin_*) whose blocks have a fused attn.qkv Linear"
    layout = "windows"
    # timm's pre-norm block: x + drop_path1(attention over windows of norm1(x)), then the same with the MLP.
    block_types = (SwinTransformerBlock,)
    timm_modules = ("swin_transformer",)
    linear_names = ("qkv", "proj", "fc1", "fc2")
    # The head averages the grid; tokens can be left out of that average (see pooled_features).
    maskable_pools = ("avg",)
    # The model's attribute holding its stages (an nn.Sequential of stages, each with ``blocks`` and a
    # ``downsample``): ``layers`` in timm's v1 and v2, ``stages`` in its SwinTransformerV2Cr.
    stages_attribute: ClassVar[str] = "layers"

    def check(self) -> None:
        """Raise a ValueError naming what is supported unless the model is a usable timm Swin.

        Raises:
            ValueError: if the model lacks stages of blocks, a fused ``attn.qkv`` Linear or a timm head.

        """
        model, name = self.model, type(self.model).__name__
        if not isinstance(getattr(model, self.stages_attribute, None), nn.Sequential) or not self.block_container():
            raise ValueError(f"petl supports {self.supported}; got {name}, which has no timm Swin stages.")
        for i, block in enumerate(self.block_list()):
            qkv = getattr(getattr(block, "attn", None), "qkv", None)
            if not isinstance(unwrap(qkv), nn.Linear) or unwrap(qkv).out_features != 3 * block.dim:
                raise ValueError(f"petl supports {self.supported}; block {i} of {name} has no fused attn.qkv Linear.")
        if not hasattr(model, "reset_classifier") or not hasattr(model.head, "fc"):
            raise ValueError(f"petl supports {self.supported}; {name} has no timm classifier head.")

    # -- the blocks ------------------------------------------------------------------------------------------

    def _stage_list(self) -> nn.Sequential:
        """The model's stages (:attr:`stages_attribute`)."""
        return getattr(self.model, self.stages_attribute)

    def _places(self) -> list[tuple[int, int]]:
        """(stage, index within the stage) of every block, in order."""
        return [(s, j) for s, stage in enumerate(self._stage_list()) for j in range(len(stage.blocks))]

    def block_container(self) -> list[nn.Module]:
        """The blocks as the stages run them (wrappers included), in order: a list over every stage's Sequential.

        The stages run their own ``blocks`` (plainly or through ``checkpoint_seq``), so a method that acts
        between blocks wraps single entries (:meth:`set_block`); the list itself is a view, rebuilt per call.
        """
        return [block for stage in self._stage_list() for block in stage.blocks]

    def set_block(self, index: int, module: nn.Module) -> None:
        """Replace the block at ``index`` (counted over all stages) in its stage."""
        stage, j = self._places()[index]
        self._stage_list()[stage].blocks[j] = module

    def widths(self) -> list[int]:
        """Each block's width: its stage's (``embed_dim * 2**stage`` in timm's models)."""
        return [int(block.dim) for block in self.block_list()]

    def stages(self) -> list[int]:
        """The stage of each block."""
        return [stage for stage, _ in self._places()]

    def feature_taps(self) -> list[int]:
        """Timm's ``forward_intermediates`` takes one output per stage: after each stage's last block."""
        places = self._places()
        return [i for i, (s, _) in enumerate(places) if i + 1 == len(places) or places[i + 1][0] != s]

    # -- the tokens ------------------------------------------------------------------------------------------

    def num_prefix_tokens(self) -> int:
        """A Swin has no class or register tokens."""
        return 0

    def tokens_in(self, x: torch.Tensor | swin_prompts.Pair) -> int:
        """An NHWC grid: rows times columns; with prompts beside it (a prompted block's pair), theirs added."""
        if not isinstance(x, torch.Tensor):
            grid, prompts = x
            return self.tokens_in(grid) + int(prompts.shape[1])
        return int(x.shape[1] * x.shape[2])

    def embed_tokens(self, images: torch.Tensor) -> torch.Tensor:
        """The patch embedding (with its norm): an NHWC grid, what the first stage receives."""
        return self.model.patch_embed(images)

    def before_block(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """The PatchMerging of the stage block ``index`` opens (``x`` itself inside a stage, or in the first)."""
        stage, j = self._places()[index]
        return self._stage_list()[stage].downsample(x) if j == 0 else x

    def modules_before_block(self, index: int) -> list[nn.Module]:
        """The PatchMerging of the stage block ``index`` opens, where it has one (none inside a stage)."""
        stage, j = self._places()[index]
        downsample = self._stage_list()[stage].downsample
        return [downsample] if j == 0 and not isinstance(downsample, nn.Identity) else []

    def run_block(
        self,
        block: nn.Module,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        inputs: dict[str, Any] | None = None,
        index: int | None = None,
    ) -> torch.Tensor:
        """Run one block on an NHWC grid (:meth:`before_block` runs the PatchMerging in front of a stage).

        Raises:
            ValueError: an ``attn_mask``: a Swin block builds its own (shifted-window) mask.

        """
        if attn_mask is not None:
            raise ValueError("a Swin block builds its own window mask: it takes no attn_mask")
        return block(x)

    # -- after the blocks ------------------------------------------------------------------------------------

    def head(self) -> nn.Module:
        """The classifier of timm's ``ClassifierHead`` (its ``fc``: the pooling in front of it has no weights)."""
        return self.model.head.fc

    def set_head(self, module: nn.Module) -> None:
        """The ``ClassifierHead`` calls ``fc`` on the pooled features."""
        self.model.head.fc = module

    def head_in_features(self) -> int:
        """Width of the pooled features the head receives."""
        return int(self.model.head_hidden_size)

    def named_final_norms(self) -> list[tuple[str, nn.Module]]:
        """``norm``, after the last stage."""
        return [("norm", self.model.norm)]

    def set_final_norm(self, name: str, module: nn.Module) -> None:
        """Replace ``norm``."""
        setattr(self.model, name, module)

    def pool_type(self) -> str:
        """The ``ClassifierHead``'s pooling (``avg`` in timm's models)."""
        return str(self.model.head.global_pool.pool_type)

    def pooled_features(self, tokens: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """The final norm and the head's pooling and dropout, on the last block's NHWC output.

        ``keep`` (batch x rows*columns, bool), when given, leaves the tokens it marks False out of the average.

        Raises:
            ValueError: ``keep`` with a pooling other than :attr:`maskable_pools`.

        """
        x = self.model.norm(tokens)
        if keep is None:
            return self.model.forward_head(x, pre_logits=True)
        return self.masked_pool(x, keep)

    def masked_pool(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """The head's average pooling and dropout over the tokens of the (normed) NHWC grid ``x`` that ``keep`` marks.

        Raises:
            ValueError: a pooling other than :attr:`maskable_pools`.

        """
        if self.pool_type() not in self.maskable_pools:
            raise ValueError(f"cannot leave tokens out of the {self.pool_type()!r} pooling: only avg can")
        weight = keep.reshape(x.shape[0], -1, 1).to(x.dtype)
        x = (x.reshape(x.shape[0], -1, x.shape[-1]) * weight).sum(dim=1) / weight.sum(dim=1)
        return self.model.head.drop(x)

    # -- taking the blocks' input and output -----------------------------------------------------------------

    def is_plain(self) -> bool:
        """Exactly timm's class (a subclass may run another forward)."""
        return type(self.model) in self.model_types()

    @staticmethod
    def model_types() -> tuple[type, ...]:
        """The model classes whose own forward :meth:`forward_from` replays."""
        return (SwinTransformer,)

    def stem(self) -> tuple[list[nn.Parameter], list[nn.Module]]:
        """The model's own parameters (none in timm's) and its children before the stages (the patch embedding):
        not the stages, nor the head, nor what :meth:`after_blocks` runs between them.
        """
        later = {id(m) for m in self.after_blocks()}
        skip = (self.stages_attribute, "head")
        modules = [m for name, m in self.model.named_children() if name not in skip and id(m) not in later]
        return list(self.model.parameters(recurse=False)), modules

    def after_blocks(self) -> list[nn.Module]:
        """``norm``."""
        return [self.model.norm]

    def block_input_module(self, index: int) -> nn.Module:
        """Block ``index`` (its stage's PatchMerging where it opens a stage that has one), or ``norm`` after the last.

        A cut in front of a stage's first block is taken in front of its PatchMerging, so that a method that trains
        the merging (Partial-k, LN, BitFit) gets its gradient from the cached path too.
        """
        if index >= self.depth():
            return self.model.norm
        merging = self.modules_before_block(index)
        return merging[0] if merging else self.block_container()[index]

    def forward_from(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """The model's logits from the tokens :meth:`block_input_module` ``(start)`` receives.

        The rest of ``start``'s stage (its PatchMerging first where ``start`` opens the stage), the later stages
        as timm runs them (gradient checkpointing honoured), the final norm and ``forward_head``.
        """
        model = self.model
        stage, j = self._places()[start]
        if j == 0:
            x = model.layers[stage](x)
        else:
            x = run_blocks(model.layers[stage].blocks[j:], x, model.layers[stage].grad_checkpointing)
        x = model.layers[stage + 1 :](x)
        return model.forward_head(model.norm(x))

    def grad_checkpointing(self) -> bool:
        """Whether timm's gradient checkpointing is on: a Swin's ``set_grad_checkpointing`` sets each stage's flag
        (its stages run their blocks), and the model has none of its own.
        """
        return any(stage.grad_checkpointing for stage in self._stage_list())

    def num_tokens(self) -> int:
        """Patch tokens entering the first stage (later stages have a quarter as many per stage)."""
        rows, cols = self.grid_size()
        return rows * cols

    def block_tokens(self) -> list[int]:
        """Each block's stage's grid: a stage's PatchMerging halves the sides of the grid before it (an odd side
        padded first, as timm's merging pads it).
        """
        rows, cols = self.grid_size()
        tokens = []
        for stage in self._stage_list():
            if not isinstance(stage.downsample, nn.Identity):
                rows, cols = (rows + 1) // 2, (cols + 1) // 2
            tokens += [rows * cols] * len(stage.blocks)
        return tokens

    # -- prompt tokens ---------------------------------------------------------------------------------------

    def insert_prompts(self, prompts: list[torch.Tensor | None], dropout: float, strip: bool) -> None:
        """Prompts copied into every window, merged between stages (:mod:`petl.model.backbone.swin_prompts`)."""
        swin_prompts.insert_prompts(self.model, prompts, dropout, strip)

    def prompted_intermediates(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """Timm's ``forward_intermediates`` on the prompted model: each stage's grid, the prompts left out."""
        return swin_prompts.forward_intermediates(self.model, x, *args, **kwargs)

    def features_with_prompts(
        self,
        tokens: torch.Tensor,
        prompts: list[tuple[torch.Tensor, torch.Tensor | None] | None],
        pool_prompts: bool | torch.Tensor,
    ) -> torch.Tensor:
        """Each row's prompts beside the grid through every window and merging
        (:func:`~petl.model.backbone.swin_prompts.rows_with_prompts`), then the final norm and the head's pooling
        over prompts and grid (``original``) or the grid alone (``img_pool``), as the prompted model's.
        """
        grid, carried = swin_prompts.rows_with_prompts(self.model, tokens, prompts)
        if pool_prompts is False:
            return self.pooled_features(grid)
        # One row of n + H*W tokens, prompts first, as PromptedFinalNorm hands the head.
        both = torch.cat([carried, grid.flatten(1, 2)], dim=1).unsqueeze(1)
        if pool_prompts is True:
            return self.pooled_features(both)
        keep = torch.ones(both.shape[0], both.shape[2], dtype=torch.bool, device=both.device)
        keep[:, : carried.shape[1]] = pool_prompts.view(-1, 1)
        return self.pooled_features(both, keep)

    # -- inside one block ------------------------------------------------------------------------------------

    @staticmethod
    def layer_scale_parameters(block: nn.Module) -> list[nn.Parameter]:
        """Swin blocks have no layer scale."""
        return []

    @staticmethod
    def attn_branch(block: nn.Module, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """``drop_path1(windowed attention(norm1(x)))`` on the NHWC grid (timm's ``_attn`` shifts and partitions)."""
        return block.drop_path1(block._attn(block.norm1(x)))

    @staticmethod
    def mlp_branch(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``drop_path2(mlp(norm2(x)))``: per token, so the NHWC grid needs no flattening."""
        return block.drop_path2(block.mlp(block.norm2(x)))

    @staticmethod
    def mlp_norm(block: nn.Module) -> nn.Module:
        """``norm2``."""
        return block.norm2


@register_backbone(SwinTransformerV2)
class SwinV2(QvBiasesBesideQkv, Swin):
    """A timm SwinTransformerV2: the stages of Swin with post-norm blocks, cosine attention and q/v biases."""

    kind = "swinv2"
    supported = "a timm SwinTransformerV2 (swinv2_*) whose blocks have a fused attn.qkv Linear"
    # timm's post-norm block: x + drop_path1(norm1(attention over windows of x)), then the same with the MLP.
    block_types = (SwinTransformerV2Block,)
    timm_modules = ("swin_transformer_v2",)
    qv_bias_attentions = (WindowAttention,)

    @staticmethod
    def model_types() -> tuple[type, ...]:
        """The model classes whose own forward :meth:`forward_from` replays."""
        return (SwinTransformerV2,)

    def batch_shared_modules(self) -> list[nn.Module]:
        """Each window attention's ``cpb_mlp``: it maps the relative-coordinates table to the position bias."""
        return [block.attn.cpb_mlp for block in self.block_list()]

    @staticmethod
    def attn_branch(block: nn.Module, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """``drop_path1(norm1(windowed attention(x)))``: the norm after the attention."""
        return block.drop_path1(block.norm1(block._attn(x)))

    @staticmethod
    def mlp_branch(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``drop_path2(norm2(mlp(x)))``: the norm after the MLP."""
        return block.drop_path2(block.norm2(block.mlp(x)))

    @staticmethod
    def mlp_norm(block: nn.Module) -> nn.Module:
        """A v2 block has no norm in front of its MLP (its ``norm2`` follows the MLP).

        Raises:
            ValueError: always.

        """
        raise ValueError("a SwinV2 block is post-norm: no norm sits in front of its MLP")


def run_blocks(blocks: nn.Module, x: torch.Tensor, checkpointed: bool) -> torch.Tensor:
    """Run some of a stage's blocks (a v1 Sequential or a v2 ModuleList) one after the other, as the stage does.

    With ``checkpointed``, each block runs under activation checkpointing, as a stage with gradient checkpointing
    on runs it (the gradients are the same either way).
    """
    for block in blocks:
        x = checkpoint(block, x, use_reentrant=False) if checkpointed else block(x)
    return x
