"""timm's Eva (EVA, EVA-02) as a :class:`~petl.model.backbone.base.Backbone`.

A ViT whose attention rotates Q and K of the patch tokens by a rotary position embedding (``rope``, computed once
per forward and passed to every block; the prefix tokens, ``attn.num_prefix_tokens`` of them, are not rotated).
Inside a block:

* Q, K and V come from one fused ``qkv`` Linear with bare ``q_bias``, ``v_bias`` parameters (as BEiT: timm reads
  ``qkv.weight`` itself unless ``qkv_bias_separate``, so ``set_linear`` turns that on for a wrapper), or,
  with ``qkv_fused=False`` (EVA-02 base and larger), from separate ``q_proj``, ``k_proj``, ``v_proj`` Linears with
  their own biases: :meth:`Eva.qkv_rows` names those, so LoRA's Q and V targets adapt ``q_proj`` and ``v_proj``.
* the MLP is timm's ``Mlp`` (``fc1``, ``fc2``), a packed SwiGLU ``GluMlp`` (one ``fc1`` holding gate and value,
  ``fc2``) or an unpacked ``SwiGLU`` (``fc1_g``, ``fc1_x``, a norm, ``fc2``): a method that needs one ``fc1`` is
  refused on the last by :meth:`Eva.linear`.
* the layer scales are bare parameters ``gamma_1``, ``gamma_2``.

timm's ``vit_*_patch16_rope_*`` models (``attn_type='rope'``) are this Eva with timm's ``AttentionRope`` in the
same ``EvaBlock``: the same forward (q/k norm, the same rotation of the tokens after ``num_prefix_tokens``, the rope
passed in by the block), but Q, K and V take their biases inside ``qkv`` (or ``q_proj``, ``k_proj``, ``v_proj``),
a plain Linear it calls, so there is nothing beside ``qkv`` to train or to switch.

Their ``rope_mixed`` variants (``rope_type='mixed'``, the ``vit_*_rope_mixed_*`` models) learn a rotation per block:
timm's ``RotaryEmbeddingMixed`` holds one parameter ``freqs`` for every block and head, its ``get_embed`` gives a
table (depth x heads x tokens x 2 head_dim) and timm's ``forward_features`` passes block i its row ``i``.
:meth:`Eva.block_inputs` computes the whole table once and :meth:`Eva.run_block` hands each block its row.  The
table is computed from the grid's coordinates, not from the images, so :meth:`Eva.batch_shared_modules` names the
rotary embedding; its ``freqs`` is a backbone weight like any other (frozen but by full fine-tuning).
"""

from __future__ import annotations

from typing import Any

import torch
from timm.layers import AttentionRope
from timm.models._manipulate import checkpoint
from timm.models.eva import Eva as TimmEva
from timm.models.eva import EvaAttention, EvaBlock
from torch import nn

from petl.model import rows
from petl.model.backbone.base import register_backbone, unwrap
from petl.model.backbone.timm_block import GammaBranches, QvBiasesBesideQkv
from petl.model.backbone.vit import ViT
from petl.model.wrappers import PetlModule


class EvaRoom(PetlModule):
    """timm's ``EvaAttention`` or ``AttentionRope`` taking extra tokens at ``at`` (beyond ``rope``'s rows), unrotated.

    timm rotates every token after the prefix by its row of ``rope``; the extra tokens get the identity rotation
    (sin 0, cos 1) at their place among the patch tokens' rows (in front of them where the extra tokens sit before
    or right after the prefix), so their Q and K enter attention as computed.
    """

    def __init__(self, base: EvaAttention | AttentionRope, at: int) -> None:
        super().__init__(base)
        self.at = at

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        prefix = self.base.num_prefix_tokens
        count = 0 if rope is None else x.shape[1] - prefix - rope.shape[-2]
        if count:
            half = rope.shape[-1] // 2
            rows = list(rope.shape)
            rows[-2] = count
            identity = torch.cat([rope.new_zeros(rows[:-1] + [half]), rope.new_ones(rows[:-1] + [half])], dim=-1)
            place = max(self.at - prefix, 0)
            rope = torch.cat([rope[..., :place, :], identity, rope[..., place:, :]], dim=-2)
        return self.base(x, rope=rope, **kwargs)


@register_backbone(TimmEva)
class Eva(QvBiasesBesideQkv, GammaBranches, ViT):
    """A timm Eva (EVA, EVA-02, the rope ViTs: rotary embedding or not, fused or separate q/k/v, GELU or SwiGLU)."""

    kind = "eva"
    supported = (
        "a timm Eva (EVA, EVA-02, vit_*_rope_*) with pre-norm EvaBlocks of EvaAttention or AttentionRope, at a "
        "fixed image size, one rotary embedding for every block or one per block (rope_type='mixed')"
    )
    block_types = (EvaBlock,)
    timm_modules = ("eva",)
    linear_names = ("qkv", "q_proj", "k_proj", "v_proj", "proj", "fc1", "fc1_g", "fc1_x", "fc2")
    qv_bias_attentions = (EvaAttention,)

    def check(self) -> None:
        """Raise a ValueError naming what is supported unless the model is a usable timm Eva.

        Raises:
            ValueError: a post-norm block, another attention, or a dynamic image size with a rotary embedding.

        """
        model, name = self.model, type(self.model).__name__
        if model.rope is not None and model.dynamic_img_size:
            # timm's vit_*_dinov3, vit_*_lingbot and vit_*_sapiens2 models: built with dynamic_img_size=False they are
            # the same model at their img_size (the same weights, a rotation table computed once for its grid), which
            # block_inputs hands the blocks.
            raise ValueError(
                f"petl supports {self.supported}; {name} has a rotary embedding per image size (dynamic_img_size=True, "
                "as timm's vit_*_dinov3, vit_*_lingbot and vit_*_sapiens2): create it with dynamic_img_size=False, "
                "the same model at its img_size (petl-run: +model.kwargs.dynamic_img_size=false)"
            )
        for i, block in enumerate(model.blocks):
            inner = unwrap(block)
            if type(inner) is not EvaBlock or not isinstance(unwrap(inner.attn), (EvaAttention, AttentionRope)):
                runs = f"{type(inner).__name__} with {type(unwrap(getattr(inner, 'attn', None))).__name__}"
                raise ValueError(f"petl supports {self.supported}; block {i} of {name}: {runs}, not taken")

    def block_inputs(self, room: tuple[int, int] | None = None) -> dict[str, Any]:
        """The rotary embedding timm's ``_pos_embed`` computes at the model's image size (``check()`` refuses the
        other cases): one for every block, or every block's row of a per-block one (:meth:`run_block` hands each
        block its own).
        """
        rope = self.model.rope
        if rope is None:
            return {"rope": None}
        if hasattr(rope, "feat_shape"):
            return {"rope": rope.get_embed()}
        return {"rope": rope.get_embed(shape=self.model.patch_embed.grid_size)}

    def embed_tokens(self, images: torch.Tensor) -> torch.Tensor:
        """Patch embedding, prefix tokens, position embedding, patch drop, pre-norm (timm's ``_pos_embed``).

        Raises:
            ValueError: a rotary embedding and patch tokens dropped (:meth:`check_rope_follows_tokens`).

        """
        self.check_rope_follows_tokens()
        x, _ = self.model._pos_embed(self.model.patch_embed(images))
        return self.model.norm_pre(x)

    def check_rope_follows_tokens(self) -> None:
        """Refuse the block path (:meth:`embed_tokens`, then :meth:`run_block` with :meth:`block_inputs`) where the
        model drops patch tokens now and rotates them.

        timm's own forward takes the rotary table's rows of the kept tokens (``apply_keep_indices_nlc``);
        :meth:`block_inputs` computes the whole grid's table, which no longer matches the tokens.  No petl path
        takes the block path in train mode (a ``MultiTask`` stays in eval mode; a feature cache's front runs in eval
        mode and none is kept where the backbone trains): this keeps it so.

        Raises:
            ValueError: one line naming the rate and what to do.

        """
        if self.model.rope is not None and self.drops_patches():
            raise ValueError(
                f"{type(self.model).__name__} drops patch tokens in training (timm's patch_drop_rate="
                f"{self.patch_drop_rate():g}) and rotates them: petl's block path would hand its blocks the whole "
                "grid's rotary table; run the model's own forward, put it in eval mode, or create it with "
                "patch_drop_rate=0"
            )

    def run_block(
        self,
        block: nn.Module,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        inputs: dict[str, Any] | None = None,
        index: int | None = None,
    ) -> torch.Tensor:
        """The block with the model's rotary embedding (a per-block one's row ``index``) and ``attn_mask``.

        Raises:
            ValueError: no ``index`` where the model has a rotary embedding per block.

        """
        inputs = self._inputs_of_block(self.block_inputs() if inputs is None else inputs, index)
        return block(x, attn_mask=attn_mask, **inputs)

    def _inputs_of_block(self, inputs: dict[str, Any], index: int | None) -> dict[str, Any]:
        """What block ``index`` is passed of :meth:`block_inputs`: all of it, or a per-block rope's row ``index``."""
        if not self._per_block_rope():
            return inputs
        if index is None:
            raise ValueError(f"{type(self.model).__name__} passes each block its own rotary embedding: give index")
        return {**inputs, "rope": inputs["rope"][index]}

    def _per_block_rope(self) -> bool:
        """Whether the model passes block i its own row of the rotary embedding (timm's ``rope_mixed``)."""
        return self.model.rope is not None and getattr(self.model, "rope_mixed", False)

    def batch_shared_modules(self) -> list[nn.Module]:
        """A per-block rotary embedding: its learnable ``freqs`` make a table from the grid's coordinates that every
        image shares (a fixed one has no weights to train).
        """
        return [self.model.rope] if self._per_block_rope() else []

    def is_plain(self) -> bool:
        """Exactly timm's Eva."""
        return type(self.model) is TimmEva

    def forward_from(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """The rest of timm's ``forward_features`` and ``forward_head`` from block ``start`` on."""
        model, inputs = self.model, self.block_inputs()
        for index in range(start, len(model.blocks)):
            block, block_inputs = model.blocks[index], self._inputs_of_block(inputs, index)
            x = checkpoint(block, x, **block_inputs) if model.grad_checkpointing else block(x, **block_inputs)
        return model.forward_head(model.norm(x))

    # -- inside one block ------------------------------------------------------------------------------------

    @classmethod
    def qkv_rows(cls, block: nn.Module, part: str) -> tuple[str, int, int]:
        """Thirds of a fused ``qkv``, or all of ``q_proj``, ``k_proj`` or ``v_proj``."""
        if block.attn.qkv is not None:
            return super().qkv_rows(block, part)
        name = f"{part}_proj"
        return name, 0, cls.linear(block, name).out_features

    @staticmethod
    def make_room(block: nn.Module, at: int) -> None:
        """The attention gives the extra tokens the identity rotation."""
        block.attn = EvaRoom(block.attn, at)


# The room acts on no rows: petl.MultiTask gives its shared blocks the same room at the batch's prompt slots.
rows.register_row_hook(EvaRoom)(rows.room_hook)
