"""The prompted block of a flat token sequence (a ViT's): prompts right after the class and register tokens.

VPT (petl.methods.vpt) builds it through :meth:`petl.model.backbone.Backbone.insert_prompts`, which each backbone
family implements for its token layout (a Swin's windows: petl.model.backbone.swin_prompts).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from petl.model.wrappers import PetlModule


class PromptedBlock(PetlModule):
    """A block that adds prompts to its input and/or strips them from its output.

    Args:
        base: the timm block.
        num_prefix: class plus register tokens; prompts go right after them.
        num_tokens: how many prompts the sequence carries.
        prompt: this block's prompts (``num_tokens`` x dim), or ``None`` to keep what arrives.
        replace: the input already carries prompts (from the previous block) that ``prompt`` replaces.
        strip: remove the prompts from the output (last block).
        dropout: dropout on ``prompt``.

    """

    prompt_place = "front"  # after the class and register tokens (see petl.model.timm_api)

    def __init__(
        self,
        base: nn.Module,
        num_prefix: int,
        num_tokens: int,
        prompt: torch.Tensor | None,
        replace: bool,
        strip: bool,
        dropout: float,
    ) -> None:
        super().__init__(base)
        self.num_prefix, self.num_tokens = num_prefix, num_tokens
        self.replace, self.strip = replace, strip
        self.prompt = None if prompt is None else nn.Parameter(prompt)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.prompt is not None:
            p = self.num_prefix
            rest = x[:, p + self.num_tokens :] if self.replace else x[:, p:]
            x = torch.cat([x[:, :p], self.prompts(x), rest], dim=1)
        # timm blocks take attn_mask / is_causal keywords; pass whatever the caller gave.
        x = self.base(x, *args, **kwargs)
        if self.strip:
            p = self.num_prefix
            x = torch.cat([x[:, :p], x[:, p + self.num_tokens :]], dim=1)
        return x

    def prompts(self, x: torch.Tensor) -> torch.Tensor:
        """This block's prompts for every row of ``x``, in ``x``'s dtype, dropout drawn per row.

        Expanded to the batch before the dropout, so each image gets its own mask (vit.py:L82, L114-115).
        """
        return self.dropout(self.prompt.unsqueeze(0).expand(x.shape[0], -1, -1).to(x.dtype))

    def no_weight_decay(self) -> set[str]:
        """Prompt tokens are exempt from weight decay by default (see petl.train.engine.param_groups)."""
        return {"prompt"} if self.prompt is not None else set()
