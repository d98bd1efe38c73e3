"""The interface every backbone family implements, and the registry that picks one by model class.

A :class:`Backbone` wraps one model and answers what petl needs to know about it: its blocks in order with each
block's width and stage, its token layout, where attention and the MLP branch sit in a block and how to replace
one of their Linears, its final norms and head, and how the blocks' input and output are taken.  Code outside the
implementations asks ``backbone_of(model)`` and never reads the model's attributes itself, so that a second family
(Swin: a width per stage, attention inside windows, patch merging between stages) is a second implementation, not
a branch in every caller.  timm chooses per model class the same way (``group_matcher``, ``forward_intermediates``
per family); peft keeps a per-model ``target_module_mapping``.

What a block does (its two residual halves, its Linears, its norms) does not depend on the model it sits in, so
the block-level operations are static methods: a wrapper keeps its family's class (``type(backbone)``) and calls
them in its forward without holding the whole model.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from petl.model.wrappers import check_module

# Row slice of a fused qkv Linear's output for each of Q, K, V, as a multiple of the block width: timm's fused
# attentions (ViT's Attention, Swin's WindowAttention) lay the rows out as Q = [0, d), K = [d, 2d), V = [2d, 3d).
QKV_INDEX = {"q": 0, "k": 1, "v": 2}

# Model class -> the Backbone class of its family (subclasses found through the MRO).
_FAMILIES: dict[type, type[Backbone]] = {}
# (model class, block class) -> the Backbone class chosen over _FAMILIES[model class] when the model's blocks are of
# that class: timm builds some families (the parallel blocks of vit_pwee_*) as a VisionTransformer with other blocks.
_BY_BLOCK: dict[tuple[type, type], type[Backbone]] = {}
# Block class -> the Backbone class that knows its halves (exact classes: a subclass may run another forward).
_BLOCK_FAMILIES: dict[type, type[Backbone]] = {}


def unwrap(module: nn.Module) -> nn.Module:
    """Return the original module under any petl wrappers (each keeps it as ``base``)."""
    while hasattr(module, "base") and isinstance(module.base, nn.Module):
        module = module.base
    return module


class Backbone:
    """One model seen through its family: the blocks, their widths and stages, the tokens, the head.

    Subclasses set :attr:`kind` and implement every method; :func:`register_backbone` ties them to model classes.

    Attributes:
        kind: the family's short name, as methods declare it (``vit``).
        supported: what the family covers, for the one-line refusal of a model it cannot take.
        layout: how tokens run through the blocks: ``sequence`` (one flat sequence, prefix tokens first, as in a
            ViT) or ``windows`` (a grid attended in local windows, as in Swin).
        block_types: the block classes whose parts and residual halves the static methods below know.
        timm_modules: the timm modules whose models the family takes (what ``petl-run model=`` lists).
        linear_names: the Linears of a block :meth:`linear` can reach (attention first, then the MLP).
        sublayers_are_modules: whether a block's attention and MLP are modules that read the normalised tokens
            (:meth:`attention`, :meth:`feed_forward`); if not, :meth:`beside_sublayers` adds beside them.
        norm_groups: each norm of a block (a :meth:`block_norm` name) with the Linears (:meth:`linear` names) that
            follow it, in forward order.
        maskable_pools: poolings :meth:`pooled_features` can restrict to some tokens.
        blocks_take_mask: whether a block called with ``attn_mask`` passes it to its attention; where not (a relpos
            ViT's, BEiT's), :meth:`run_block` and a mixed batch's routed block run a masked block as its two
            residual halves, the mask going to the attention.
        model: the model itself.

    """

    kind: ClassVar[str] = ""
    supported: ClassVar[str] = ""
    layout: ClassVar[str] = "sequence"
    block_types: ClassVar[tuple[type, ...]] = ()
    timm_modules: ClassVar[tuple[str, ...]] = ()
    linear_names: ClassVar[tuple[str, ...]] = ()
    # Whether a block's attention and MLP are modules that read the normalised tokens (attention(), feed_forward());
    # a parallel block runs them inline, and what goes beside them goes through beside_sublayers instead.
    sublayers_are_modules: ClassVar[bool] = True
    # Each pre-norm of a block and the Linears that follow it, in forward order (what SSF and BitFit walk).
    norm_groups: ClassVar[tuple[tuple[str, tuple[str, ...]], ...]] = (
        ("norm1", ("qkv", "proj")),
        ("norm2", ("fc1", "fc2")),
    )
    maskable_pools: ClassVar[tuple[str, ...]] = ()
    blocks_take_mask: ClassVar[bool] = True

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    # -- the blocks ------------------------------------------------------------------------------------------

    def check(self) -> None:
        """Raise a ValueError naming what is supported unless the model has everything this family needs."""
        raise NotImplementedError

    def block_container(self) -> nn.Module | list[nn.Module]:
        """The blocks as the model runs them (wrappers included), indexable in block order.

        A model with one Sequential of blocks returns it; a staged model a list over its stages' blocks.
        """
        raise NotImplementedError

    def set_block(self, index: int, module: nn.Module) -> None:
        """Replace the block at ``index`` in the running container (see :meth:`block_container`)."""
        raise NotImplementedError

    def block_list(self) -> list[nn.Module]:
        """The blocks, original (unwrapped) modules, in order."""
        return [unwrap(b) for b in self.block_container()]

    def depth(self) -> int:
        """Number of blocks."""
        return len(self.block_container())

    def widths(self) -> list[int]:
        """Token width of each block, in order."""
        raise NotImplementedError

    def stages(self) -> list[int]:
        """Stage of each block, in order (0 for every block of a single-stage model)."""
        raise NotImplementedError

    def feature_taps(self) -> list[int]:
        """The block after which each output of timm's ``forward_intermediates`` is taken, in order."""
        return list(range(self.depth()))

    def width(self) -> int:
        """The one token width of every block.

        Raises:
            ValueError: the width changes between blocks (a staged model); ask :meth:`widths` there.

        """
        widths = set(self.widths())
        if len(widths) != 1:
            raise ValueError(f"{type(self.model).__name__} has several block widths {sorted(widths)}: no single width")
        return widths.pop()

    # -- the tokens ------------------------------------------------------------------------------------------

    def num_prefix_tokens(self) -> int:
        """Tokens (class, registers) in front of the patch tokens; 0 where there are none."""
        raise NotImplementedError

    def grid_size(self) -> tuple[int, int]:
        """Patch-token grid (rows, columns) entering the first block, at the model's image size."""
        raise NotImplementedError

    def feature_grid(self, images: torch.Tensor) -> tuple[int, int]:
        """Patch-token grid (rows, columns) of the first block's input for ``images`` of any size."""
        raise NotImplementedError

    def patch_size(self) -> tuple[int, int]:
        """Patch size (h, w) of the patch embedding."""
        raise NotImplementedError

    def check_whole_grid(self, method: str) -> None:
        """Refuse, for a method that reshapes the blocks' patch tokens to :meth:`grid_size`, a model that drops patch
        tokens in training (timm's ``patch_drop_rate``: a ViT's or EVA's ``patch_drop``), whose blocks then see fewer.

        Raises:
            ValueError: the model drops patch tokens (one line naming the option and what to do).

        """
        rate = self.patch_drop_rate()
        if rate > 0:
            rows, cols = self.grid_size()
            raise ValueError(
                f"{method} reshapes the patch tokens to their {rows}x{cols} grid in every block, and "
                f"{type(self.model).__name__} drops patch tokens in training (timm's patch_drop_rate={rate:g}): "
                "create the model with patch_drop_rate=0"
            )

    def patch_drop_rate(self) -> float:
        """The share of patch tokens the model's ``patch_drop`` drops in training (timm's ``patch_drop_rate``)."""
        return float(getattr(getattr(self.model, "patch_drop", None), "prob", 0.0))

    def drops_patches(self) -> bool:
        """Whether :meth:`embed_tokens` drops patch tokens now (the model's ``patch_drop`` in train mode)."""
        drop = getattr(self.model, "patch_drop", None)
        return drop is not None and drop.training and self.patch_drop_rate() > 0

    def tokens_in(self, x: torch.Tensor) -> int:
        """Tokens per image in ``x``, a block's input (prompts a method added included)."""
        raise NotImplementedError

    def embed_tokens(self, images: torch.Tensor) -> torch.Tensor:
        """The tokens entering the first block (patch and position embedding and whatever runs before the blocks)."""
        raise NotImplementedError

    def before_block(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """What runs between block ``index - 1`` and block ``index`` (nothing in a ViT; a Swin's patch merging)."""
        return x

    def modules_before_block(self, index: int) -> list[nn.Module]:
        """The modules with weights that :meth:`before_block` runs in front of block ``index`` (none in a ViT; a
        Swin's patch merging in front of the first block of a later stage).
        """
        return []

    def block_inputs(self, room: tuple[int, int] | None = None) -> dict[str, Any]:
        """What the model computes once per forward and passes the blocks besides the tokens (EVA's rotary
        embedding, a relpos ViT's or BEiT's shared position bias): none by default.  Where each block takes its own
        part of it (an EVA's per-block rotary embedding, ``rope_type='mixed'``), :meth:`run_block` takes the block's
        part by its ``index``.

        ``room``: (at, count), extra tokens without a position that every block's tokens hold (a
        :class:`petl.MultiTask`'s prompt slots, where :meth:`make_room` made room for them); what needs padding for
        them comes padded once here, not in every block.
        """
        return {}

    def run_block(
        self,
        block: nn.Module,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        inputs: dict[str, Any] | None = None,
        index: int | None = None,
    ) -> torch.Tensor:
        """Run one block of the container on ``x``; ``attn_mask`` (where given) limits which tokens each attends;
        ``inputs`` is :meth:`block_inputs` computed once for every block of a forward (computed here where ``None``);
        ``index`` is the block's place in the container, which a family that passes each block its own inputs needs
        (an EVA with a rotary embedding per block refuses ``None``) and the others ignore.
        """
        raise NotImplementedError

    def patch_proj(self) -> nn.Module:
        """The patch embedding's projection (a Conv2d whose output channels are the first block's width)."""
        raise NotImplementedError

    def set_patch_proj(self, module: nn.Module) -> None:
        """Replace the patch embedding's projection."""
        raise NotImplementedError

    def patch_norm(self) -> nn.Module:
        """The norm after the patch projection (``nn.Identity`` where there is none)."""
        raise NotImplementedError

    def set_patch_norm(self, module: nn.Module) -> None:
        """Replace the norm after the patch projection."""
        raise NotImplementedError

    # -- after the blocks ------------------------------------------------------------------------------------

    def head(self) -> nn.Module:
        """The classifier head module (``nn.Identity`` when the model has no classes)."""
        raise NotImplementedError

    def set_head(self, module: nn.Module) -> None:
        """Install ``module`` as the classifier on the pooled features."""
        raise NotImplementedError

    def reset_head(self, num_classes: int) -> None:
        """Replace the classifier with a fresh one for ``num_classes`` classes, keeping the pooling."""
        raise NotImplementedError

    def plain_head_types(self) -> tuple[type, ...]:
        """The head types the family's plain model can hold (what unloading may leave behind)."""
        raise NotImplementedError

    def num_classes(self) -> int:
        """Output classes of the current head (0 when there is none)."""
        raise NotImplementedError

    def head_in_features(self) -> int:
        """Width of the pooled features the head receives."""
        raise NotImplementedError

    def named_final_norms(self) -> list[tuple[str, nn.Module]]:
        """(name, module) of the norms after the last block, those that exist (see :meth:`set_final_norm`)."""
        raise NotImplementedError

    def final_norms(self) -> list[nn.Module]:
        """The norms after the last block, those that exist."""
        return [m for _, m in self.named_final_norms()]

    def set_final_norm(self, name: str, module: nn.Module) -> None:
        """Replace a final norm named by :meth:`named_final_norms`."""
        raise NotImplementedError

    def layer_norms(self) -> list[nn.LayerNorm]:
        """Every LayerNorm of the backbone, the head's left out."""
        in_head = {id(m) for m in self.head().modules()}
        return [m for m in self.model.modules() if isinstance(m, nn.LayerNorm) and id(m) not in in_head]

    def pool_type(self) -> str:
        """How the model pools its tokens for the head (timm's ``global_pool`` names)."""
        raise NotImplementedError

    def pooled_features(self, tokens: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """What the head reads, from the last block's output; ``keep`` (batch x tokens, bool) leaves tokens out."""
        raise NotImplementedError

    # -- taking the blocks' input and output (feature caching, intermediates) --------------------------------

    def is_plain(self) -> bool:
        """Whether the model runs its family's own forward (no subclass, nothing patched), so that replaying it from
        a block on (:meth:`forward_from`) gives the very logits of the model's forward.
        """
        raise NotImplementedError

    def stem(self) -> tuple[list[nn.Parameter], list[nn.Module]]:
        """The parameters and modules that run before the first block."""
        raise NotImplementedError

    def after_blocks(self) -> list[nn.Module]:
        """The modules with parameters between the last block and the head (final norms, attention pooling)."""
        raise NotImplementedError

    def block_input_module(self, index: int) -> nn.Module:
        """The module whose input is the tokens entering block ``index`` (``depth()``: those leaving the last).

        Where a module with weights sits between blocks (Swin's patch merging), the cut in front of the block after
        it is taken in front of that module, and :meth:`forward_from` runs it.
        """
        raise NotImplementedError

    def forward_from(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """The model's logits from the tokens entering block ``start`` on (gradient checkpointing honoured)."""
        raise NotImplementedError

    def grad_checkpointing(self) -> bool:
        """Whether timm's gradient checkpointing (``set_grad_checkpointing``) is on: the model's own flag, where
        timm keeps it for a model whose blocks run in one sequence.
        """
        return bool(getattr(self.model, "grad_checkpointing", False))

    def pre_logits(self, images: torch.Tensor) -> torch.Tensor:
        """Timm's ``forward_head(forward_features(images), pre_logits=True)``: the pooled features the head reads.

        The class's ``forward_head``, not the instance's: on a model from ``petl.apply`` with its own head (Mlp-k)
        the instance's returns that head's hidden features (timm's meaning of ``pre_logits``), which a feature
        cache must not hold, since the head trains on what is cached.
        """
        model = self.model
        return type(model).forward_head(model, model.forward_features(images), pre_logits=True)

    def num_tokens(self) -> int:
        """Tokens entering the first block per image at the model's image size (prefix tokens included)."""
        raise NotImplementedError

    def block_tokens(self) -> list[int]:
        """Tokens each block takes per image at the model's image size, in order: :meth:`num_tokens` for all."""
        return [self.num_tokens()] * self.depth()

    def num_features(self) -> int:
        """Width of the pooled features (what :meth:`pre_logits` returns per image)."""
        raise NotImplementedError

    def adopt_wrapped_linears(self) -> None:
        """Hand every block Linear that another library (peft) or a mixed batch wrapped in place of
        :meth:`set_linear` back through it, which makes a family whose attention reads ``qkv.weight`` itself
        (BEiT, EVA, SwinV2) call the wrapper instead; a family that always calls its Linears just sets them again.
        """
        for block in self.block_list():
            for name in self.linear_names:
                try:
                    linear = self.linear(block, name)
                except (AttributeError, ValueError):  # a Linear this block does not have
                    continue
                if type(linear) is not nn.Linear:
                    self.set_linear(block, name, linear)

    # -- prompt tokens ---------------------------------------------------------------------------------------

    def insert_prompts(self, prompts: list[torch.Tensor | None], dropout: float, strip: bool) -> None:
        """Wrap the model so that prompt tokens (VPT's) run through its blocks beside the image tokens.

        Where the prompts sit and how they cross the blocks is the family's: after the prefix tokens of a flat
        sequence (ViT), or copied into every window and merged between stages (Swin).

        Args:
            prompts: per block, its prompts (tokens x the block's width, trainable) that replace the ones arriving,
                or ``None`` to carry the previous block's prompt outputs; the first block's are not ``None``.
            dropout: dropout on the prompts (train mode), drawn per image.
            strip: the last block removes the prompts, so the final norm and pooling see the image tokens only.

        """
        raise NotImplementedError(f"the {self.kind} backbone cannot take prompt tokens")

    def features_with_prompts(
        self,
        tokens: torch.Tensor,
        prompts: list[tuple[torch.Tensor, torch.Tensor | None] | None],
        pool_prompts: bool | torch.Tensor,
    ) -> torch.Tensor:
        """The pooled features of embedded ``tokens`` through the plain model, each row with prompts of its own
        beside them, as :meth:`insert_prompts` runs them where they travel beside the tokens (a Swin's): the rows of
        several VPT tasks in one pass of a mixed batch (:class:`petl.MultiTask`).

        Args:
            tokens: what the first block receives (rows first).
            prompts: per block, ``(own, use)``: each row's prompts for the block (rows x count x width) and which
                rows put them in place of those arriving (bool per row; ``None``: every row), or ``None``: every
                row carries its own.
            pool_prompts: whether the pooling averages the prompts with the tokens: for every row, or per row.

        """
        raise NotImplementedError(f"the {self.kind} backbone carries no prompts beside its tokens")

    # -- inside one block (static: a block's parts do not depend on the model around it) --------------------

    @staticmethod
    def linear_slot(block: nn.Module, name: str) -> tuple[nn.Module, str]:
        """Where a named Linear of a block (one of :attr:`linear_names`) sits: the module that holds and calls it,
        and its attribute name there (what :meth:`linear` reads and :meth:`set_linear` replaces).
        """
        raise NotImplementedError

    @classmethod
    def linear(cls, block: nn.Module, name: str) -> nn.Module:
        """A named Linear of a block (see :meth:`linear_slot`)."""
        owner, attribute = cls.linear_slot(block, name)
        return getattr(owner, attribute)

    @classmethod
    def set_linear(cls, block: nn.Module, name: str, module: nn.Module) -> None:
        """Replace a named Linear of a block (see :meth:`linear_slot`)."""
        owner, attribute = cls.linear_slot(block, name)
        setattr(owner, attribute, module)

    @classmethod
    def linear_biases(cls, block: nn.Module, name: str) -> list[nn.Parameter]:
        """The bias terms of a named Linear's output: its own bias, where it has one (a family that keeps some beside
        the Linear adds those).
        """
        bias = getattr(unwrap(cls.linear(block, name)), "bias", None)
        return [bias] if isinstance(bias, nn.Parameter) else []

    @staticmethod
    def attention(block: nn.Module) -> nn.Module:
        """The attention sub-module of a block."""
        raise NotImplementedError

    @staticmethod
    def set_attention(block: nn.Module, module: nn.Module) -> None:
        """Replace the attention of a block."""
        raise NotImplementedError

    @staticmethod
    def num_heads(block: nn.Module) -> int:
        """Attention heads of a block."""
        raise NotImplementedError

    @staticmethod
    def feed_forward(block: nn.Module) -> nn.Module:
        """The MLP (feed-forward) sub-module of a block."""
        raise NotImplementedError

    @staticmethod
    def set_feed_forward(block: nn.Module, module: nn.Module) -> None:
        """Replace the MLP of a block."""
        raise NotImplementedError

    @staticmethod
    def block_norm(block: nn.Module, name: str) -> nn.Module:
        """A block's pre-norm: ``norm1`` (before attention) or ``norm2`` (before the MLP)."""
        raise NotImplementedError

    @staticmethod
    def set_block_norm(block: nn.Module, name: str, module: nn.Module) -> None:
        """Replace a block's pre-norm (see :meth:`block_norm`)."""
        raise NotImplementedError

    @staticmethod
    def layer_scale_parameters(block: nn.Module) -> list[nn.Parameter]:
        """The block's layer-scale gammas, whether a module holds them or the block itself (none without)."""
        raise NotImplementedError

    @staticmethod
    def attn_branch(block: nn.Module, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """The attention half's branch before its residual sum (norm, attention, layer scale, drop path)."""
        raise NotImplementedError

    @staticmethod
    def mlp_branch(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The MLP half's branch before its residual sum (norm, MLP, layer scale, drop path)."""
        raise NotImplementedError

    @classmethod
    def attn_residual(cls, block: nn.Module, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """The first half of a block, ``x + attn_branch(x)``: methods acting between the halves run them."""
        return x + cls.attn_branch(block, x, **kwargs)

    @classmethod
    def mlp_residual(cls, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The second half of a block, ``x + mlp_branch(x)``."""
        return x + cls.mlp_branch(block, x)

    @classmethod
    def mlp_input_and_output(
        cls, block: nn.Module, x: torch.Tensor, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block run on ``x``: the stream entering its MLP half (``attn_residual``'s output) and the block's output.

        A parallel block's MLP reads the block's input, so there that is ``x`` itself.
        """
        mid = cls.attn_residual(block, x, **kwargs)
        return mid, cls.mlp_residual(block, mid)

    @staticmethod
    def beside_sublayers(block: nn.Module, x: torch.Tensor, side: Any) -> torch.Tensor:
        """What ``side(normalised x)``, added to the attention's and MLP's summed output, adds to the block's output
        for ``x``, in a family whose sub-layers are not modules (:attr:`sublayers_are_modules` False).
        """
        raise NotImplementedError("this family's attention and MLP are modules: wrap them (attention, feed_forward)")

    @staticmethod
    def mlp_norm(block: nn.Module) -> nn.Module:
        """The norm in front of a block's MLP (its input is the residual stream after attention)."""
        raise NotImplementedError

    @classmethod
    def qkv_rows(cls, block: nn.Module, part: str) -> tuple[str, int, int]:
        """The Linear of a block (one of :attr:`linear_names`) that computes ``part`` (``q``, ``k`` or ``v``), and
        the rows [start, end) of its output that are ``part``: by default thirds of a fused ``qkv``
        (:data:`QKV_INDEX`); a family with separate projections names them.
        """
        width = cls.linear(block, "qkv").out_features // 3
        start = QKV_INDEX[part] * width
        return "qkv", start, start + width

    def batch_shared_modules(self) -> list[nn.Module]:
        """Modules whose input is a table every image shares, not the images' rows (a SwinV2's continuous
        position-bias MLP); none by default.  A task that trains one changes what every row of a mixed batch uses.
        """
        return []

    @staticmethod
    def biases_beside(module: nn.Module) -> tuple[str, dict[str, tuple[int, int]]] | None:
        """Where ``module`` adds biases it holds itself to the output of one of its Linears: that Linear's attribute
        name and each bias's (first, end) output rows; ``None`` where it adds none (the default).

        A mixed batch serves a task that trains such biases (BitFit on the q/v biases of a SwinV2, BEiT or EVA: see
        :class:`~petl.model.backbone.timm_block.QvBiasesBesideQkv`) as a delta on that Linear's output, as it serves
        a trained Linear bias.
        """
        return None

    @classmethod
    def target_rows(cls, block: nn.Module, target: str) -> tuple[str, int, int]:
        """The Linear of a block (one of :attr:`linear_names`) that computes ``target`` and the rows [start, end) of its
        output that are ``target``: ``q``, ``k``, ``v`` as :meth:`qkv_rows` says; ``qkv``, ``proj``, ``fc1`` and ``fc2``
        all of the Linear of that name (a parallel block keeps ``fc1`` and ``qkv`` as rows of one ``in_proj``).
        """
        if target in QKV_INDEX:
            return cls.qkv_rows(block, target)
        return target, 0, cls.linear(block, target).out_features

    @classmethod
    def loose_biases(cls, block: nn.Module) -> list[nn.Parameter]:
        """The biases a block adds to its Linears' outputs but keeps outside them: what :meth:`linear_biases` names
        beyond each Linear's own bias (the q/v biases of a BEiT, EVA or SwinV2 attention, a parallel block's
        ``mlp_bias``); none in a plain ViT.
        """
        found = []
        for name in cls.linear_names:
            try:
                own = getattr(unwrap(cls.linear(block, name)), "bias", None)
            except (AttributeError, ValueError):  # a Linear this block does not have
                continue
            found += [bias for bias in cls.linear_biases(block, name) if bias is not own]
        return list({id(bias): bias for bias in found}.values())

    @staticmethod
    def make_room(block: nn.Module, at: int) -> None:
        """Let ``block`` (unwrapped) take extra tokens inserted at position ``at`` (after the prefix tokens, or at the
        end of the sequence) that have no position of their own: where the block adds position terms to the patch
        tokens inside attention (a relative-position bias, a rotary embedding), the extra tokens get none (a zero
        bias, no rotation), as VPT's own Swin code zero-pads the bias for its prompts (KMnP/vpt
        src/models/vit_prompt/swin_transformer.py L480-508).  As many as the block's input holds beyond the tokens
        the position terms cover, from none up: NOAH's prompts change in number from block to block and, in its
        search, from step to step.
        """
        raise NotImplementedError


def register_backbone(*model_classes: type, blocks: tuple[type, ...] = ()) -> Any:
    """Class decorator: the decorated :class:`Backbone` subclass serves ``model_classes`` and their subclasses.

    With ``blocks``, it serves them only when their first block is of one of those classes (another family is
    registered for the model classes themselves): the model class alone does not tell the families apart.
    """

    def decorate(family: type[Backbone]) -> type[Backbone]:
        for cls in model_classes:
            table, key = (_BY_BLOCK, [(cls, b) for b in blocks]) if blocks else (_FAMILIES, [cls])
            for k in key:
                if k in table:
                    raise ValueError(f"{k} already has backbone {table[k].kind!r}")
                table[k] = family
        for cls in family.block_types:
            _BLOCK_FAMILIES[cls] = family
        return family

    return decorate


def _all_families() -> list[type[Backbone]]:
    return [*_FAMILIES.values(), *_BY_BLOCK.values()]


def list_backbones() -> list[str]:
    """The kinds of every registered backbone family, sorted."""
    return sorted({family.kind for family in _all_families()})


def timm_modules() -> list[str]:
    """The timm modules of every registered family's models, sorted."""
    return sorted({module for family in _all_families() for module in family.timm_modules})


def family_of(model: nn.Module) -> type[Backbone] | None:
    """The registered Backbone class for ``model``'s class (nearest in its MRO), else None; where a family is
    registered for that class and the model's block class (``register_backbone(..., blocks=)``), that one.
    """
    cls = next((cls for cls in type(model).__mro__ if cls in _FAMILIES), None)
    if cls is None:
        return None
    family = _FAMILIES[cls]
    if any(key[0] is cls for key in _BY_BLOCK):
        try:
            first = type(unwrap(family(model).block_container()[0]))
        except (AttributeError, IndexError, TypeError):  # no blocks where the family keeps them: check() says so
            return family
        family = _BY_BLOCK.get((cls, first), family)
    return family


def _wrapper_hint(model: Any) -> str:
    """What to give petl instead of ``model`` where it wraps a model (torch.compile's, DataParallel's, timm's
    ``features_only``), else ``""``.
    """
    compiled = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
    if isinstance(compiled, nn.Module):
        return (
            f"torch.compile's wrapper of a {type(compiled).__name__}: give petl the model it compiled (model._orig_mod)"
        )
    if isinstance(model, nn.DataParallel | nn.parallel.DistributedDataParallel):
        return f"a wrapper of a {type(model.module).__name__}: give petl the model inside it (model.module)"
    if type(model).__module__ == "timm.models._features":
        return (
            "timm's features_only=True wrapper: create the model without features_only and apply petl to it "
            "(its forward_intermediates gives the blocks' features)"
        )
    return ""


def backbone_of(model: nn.Module) -> Backbone:
    """``model`` seen through its family's :class:`Backbone`.

    Raises:
        ValueError: no registered family takes ``model``'s class (the message names the model classes petl
            takes and docs/backbones.md, or, for a wrapper such as torch.compile's, which model inside it to give).

    """
    check_module(model)
    family = family_of(model)
    wrapper = _wrapper_hint(model) if family is None else ""
    if wrapper:  # the model inside may well be one petl takes: say how to reach it, not every family petl supports
        raise ValueError(f"got {type(model).__name__}, {wrapper}")
    if family is None:
        # The model classes, not every family's full description (one line of some 780 characters): what each
        # takes of its class is in docs/backbones.md, and a family's own check names what it refuses.  A subclass
        # of one of them (the distilled DeiT, registered to be refused) is not another class to name.
        roots = [cls for cls in _FAMILIES if not any(o is not cls and issubclass(cls, o) for o in _FAMILIES)]
        classes = ", ".join(sorted(cls.__name__ for cls in roots))
        raise ValueError(
            f"got {type(model).__name__}, which no backbone family takes: petl takes timm's {classes} "
            "(docs/backbones.md)"
        )
    return family(model)


def block_family(block: nn.Module) -> type[Backbone]:
    """The Backbone class that knows ``block``'s parts and residual halves, for wrappers that run the halves.

    Raises:
        ValueError: ``block`` is not exactly one of the registered block classes.

    """
    family = _BLOCK_FAMILIES.get(type(block))
    if family is None:
        known = ", ".join(f"{cls.__module__}.{cls.__name__}" for cls in _BLOCK_FAMILIES)
        raise ValueError(f"this method needs a pre-norm block it knows ({known}); got {type(block).__name__}")
    return family
