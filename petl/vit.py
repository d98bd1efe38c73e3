"""The one module that knows timm's VisionTransformer internals.

Methods ask this module for blocks, the fused ``qkv`` Linear, the embedding width and the
prefix-token count, so that a change in timm touches one file.  timm's ``Attention`` computes
Q, K and V with one Linear whose output rows are laid out as Q = [0, d), K = [d, 2d), V = [2d, 3d).
"""

from __future__ import annotations

from typing import Any

import torch
from timm.models.vision_transformer import Block
from torch import nn

SUPPORTED = (
    "a timm VisionTransformer (ViT, DeiT, with or without class token, register tokens, "
    "token or avg pooling) whose blocks have a fused attn.qkv Linear"
)

# Row slice of the fused qkv output for each of Q, K, V, as a multiple of the embed dim.
QKV_INDEX = {"q": 0, "k": 1, "v": 2}


def check_vit(model: nn.Module) -> None:
    """Raise a ValueError naming what is supported unless ``model`` is a usable timm ViT.

    Args:
        model: the model to check.

    Raises:
        ValueError: if the model lacks ``blocks``, ``embed_dim`` or a fused ``attn.qkv`` Linear.

    """
    name = type(model).__name__
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.Sequential) or len(blocks) == 0 or not hasattr(model, "embed_dim"):
        raise ValueError(f"petl supports {SUPPORTED}; got {name}, which has no timm ViT blocks.")
    for i, block in enumerate(blocks):
        inner = unwrap(block)
        qkv = getattr(getattr(inner, "attn", None), "qkv", None)
        if not isinstance(qkv, nn.Linear) or qkv.out_features != 3 * qkv.in_features:
            raise ValueError(f"petl supports {SUPPORTED}; block {i} of {name} has no fused attn.qkv Linear.")
        if not hasattr(inner, "mlp"):
            raise ValueError(f"petl supports {SUPPORTED}; block {i} of {name} has no mlp.")
    if not hasattr(model, "reset_classifier") or not hasattr(model, "head"):
        raise ValueError(f"petl supports {SUPPORTED}; {name} has no timm classifier head.")


def unwrap(module: nn.Module) -> nn.Module:
    """Return the original module under any petl wrappers (each keeps it as ``base``)."""
    while hasattr(module, "base") and isinstance(module.base, nn.Module):
        module = module.base
    return module


def blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks, original (unwrapped) modules, in order."""
    return [unwrap(b) for b in model.blocks]


def depth(model: nn.Module) -> int:
    """Number of transformer blocks."""
    return len(model.blocks)


def embed_dim(model: nn.Module) -> int:
    """Token width of the ViT."""
    return int(model.embed_dim)


def num_prefix_tokens(model: nn.Module) -> int:
    """Class plus register tokens that precede the patch tokens."""
    return int(getattr(model, "num_prefix_tokens", 1 if getattr(model, "cls_token", None) is not None else 0))


def patch_size(model: nn.Module) -> tuple[int, int]:
    """Patch size (h, w) of the patch embedding."""
    size = model.patch_embed.patch_size
    return (size, size) if isinstance(size, int) else tuple(size)


def linear(block: nn.Module, name: str) -> nn.Module:
    """A named Linear of a block: ``qkv``, ``proj`` (attention) or ``fc1``, ``fc2`` (MLP)."""
    owner = block.attn if name in ("qkv", "proj") else block.mlp
    return getattr(owner, name)


def set_linear(block: nn.Module, name: str, module: nn.Module) -> None:
    """Replace a named Linear of a block (see :func:`linear`)."""
    owner = block.attn if name in ("qkv", "proj") else block.mlp
    setattr(owner, name, module)


def mlp(block: nn.Module) -> nn.Module:
    """The MLP (feed-forward) sub-module of a block; its input is the block's second norm output."""
    return block.mlp


def set_mlp(block: nn.Module, module: nn.Module) -> None:
    """Replace the MLP of a block (see :func:`mlp`)."""
    block.mlp = module


def block_container(model: nn.Module) -> nn.Sequential:
    """The ``nn.Sequential`` of blocks as the model runs it (wrappers included).

    timm's forward runs this container itself (plainly or through ``checkpoint_seq``), so methods
    that must act between blocks wrap single entries instead of replacing the container.
    """
    return model.blocks


def set_block(model: nn.Module, index: int, module: nn.Module) -> None:
    """Replace the block at ``index`` in the running container (see :func:`block_container`)."""
    model.blocks[index] = module


def head(model: nn.Module) -> nn.Module:
    """The classifier head module (``nn.Identity`` when the model has no classes)."""
    return model.head


def set_head(model: nn.Module, module: nn.Module) -> None:
    """Install ``module`` as the classifier; timm's ``forward_head`` calls it on the pooled features."""
    model.head = module


def num_classes(model: nn.Module) -> int:
    """Output classes of the current head (0 when the head is ``nn.Identity``)."""
    return int(getattr(model, "num_classes", 0))


def head_in_features(model: nn.Module) -> int:
    """Width of the pooled features the head receives."""
    return int(getattr(model, "head_hidden_size", model.embed_dim))


def reset_head(model: nn.Module, num_classes: int) -> None:
    """Replace the classifier with a fresh one for ``num_classes`` classes, keeping the pooling."""
    model.reset_classifier(num_classes)


def final_norms(model: nn.Module) -> list[nn.Module]:
    """The norms after the last block (``norm`` and ``fc_norm``), those that exist."""
    return [m for m in (getattr(model, "norm", None), getattr(model, "fc_norm", None)) if isinstance(m, nn.Module)]


def attn(block: nn.Module) -> nn.Module:
    """The attention sub-module of a block; its input is the block's first norm output."""
    return block.attn


def set_attn(block: nn.Module, module: nn.Module) -> None:
    """Replace the attention of a block (see :func:`attn`); timm calls it with ``attn_mask`` keywords."""
    block.attn = module


def attn_residual(block: nn.Module, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """The first half of a pre-norm timm block: ``x + attn(norm1(x))`` (layer scale, drop path included).

    Methods that act on the residual stream between the two halves run the halves themselves.
    """
    return x + block.drop_path1(block.ls1(block.attn(block.norm1(x), **kwargs)))


def mlp_residual(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The second half of a pre-norm timm block: ``x + mlp(norm2(x))`` (see :func:`attn_residual`)."""
    return x + mlp_branch(block, x)


def mlp_branch(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The branch of :func:`mlp_residual` before its residual sum (layer scale and drop path included)."""
    return block.drop_path2(block.ls2(block.mlp(block.norm2(x))))


def mlp_norm(block: nn.Module) -> nn.Module:
    """The norm in front of a block's MLP (its input is the residual stream after attention)."""
    return block.norm2


def check_pre_norm_block(block: nn.Module) -> None:
    """Raise a ValueError unless ``block`` is timm's pre-norm ``Block`` (what the halves above assume)."""
    if type(block) is not Block:
        raise ValueError(f"this method needs timm's pre-norm vision_transformer.Block; got {type(block).__name__}")


def grid_size(model: nn.Module) -> tuple[int, int]:
    """Patch-token grid (rows, columns) of the patch embedding at the model's image size."""
    rows, cols = model.patch_embed.grid_size
    return int(rows), int(cols)


def patch_proj(model: nn.Module) -> nn.Module:
    """The patch embedding's projection (a Conv2d whose output channels are the embedding width)."""
    return model.patch_embed.proj


def set_patch_proj(model: nn.Module, module: nn.Module) -> None:
    """Replace the patch embedding's projection (see :func:`patch_proj`)."""
    model.patch_embed.proj = module


def patch_norm(model: nn.Module) -> nn.Module:
    """The norm after the patch projection (``nn.Identity`` in most ViTs)."""
    return model.patch_embed.norm


def set_patch_norm(model: nn.Module, module: nn.Module) -> None:
    """Replace the norm after the patch projection (see :func:`patch_norm`)."""
    model.patch_embed.norm = module


def block_norm(block: nn.Module, name: str) -> nn.Module:
    """A block's pre-norm: ``norm1`` (before attention) or ``norm2`` (before the MLP)."""
    return getattr(block, name)


def set_block_norm(block: nn.Module, name: str, module: nn.Module) -> None:
    """Replace a block's pre-norm (see :func:`block_norm`)."""
    setattr(block, name, module)


def named_final_norms(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(attribute name, module) of the norms after the last block (``norm``, ``fc_norm``), those that exist."""
    return [(n, m) for n in ("norm", "fc_norm") if isinstance(m := getattr(model, n, None), nn.Module)]


def set_final_norm(model: nn.Module, name: str, module: nn.Module) -> None:
    """Replace a final norm named by :func:`named_final_norms`."""
    setattr(model, name, module)


def layer_norms(model: nn.Module) -> list[nn.LayerNorm]:
    """Every LayerNorm of the backbone, the head's left out (patch-embedding, block and final norms)."""
    in_head = {id(m) for m in head(model).modules()}
    return [m for m in model.modules() if isinstance(m, nn.LayerNorm) and id(m) not in in_head]


# Pool types whose pooled features can leave out masked tokens (see :func:`pooled_features`).
MASKABLE_POOLS = ("token", "avg")


def embed_tokens(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """The token sequence entering the first block: patch embedding, position embedding, patch drop, pre-norm.

    timm's ``forward_features`` up to its blocks, for callers that run the blocks themselves.
    """
    x = model.patch_embed(images)
    x = model._pos_embed(x)
    x = model.patch_drop(x)
    return model.norm_pre(x)


def pool_type(model: nn.Module) -> str:
    """How the model pools its tokens: ``token``, ``avg``, ``max``, ``avgmax``, ``map`` (attention pool), or ``""``."""
    return "map" if getattr(model, "attn_pool", None) is not None else str(model.global_pool)


def pooled_features(model: nn.Module, tokens: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """What the head reads: the final norm, the pooling, ``fc_norm`` and head dropout applied to the blocks' output.

    timm's ``norm`` then ``forward_head(pre_logits=True)``, except that ``keep`` (batch x tokens, bool), when
    given, leaves the tokens it marks False out of an average pooling, as if they were not in the sequence.

    Raises:
        ValueError: ``keep`` with a pooling other than :data:`MASKABLE_POOLS`.

    """
    x = model.norm(tokens)
    pool = pool_type(model)
    if keep is None or pool == "token":
        x = model.pool(x)
    elif pool == "avg":
        start = 0 if getattr(model, "pool_include_prefix", False) else num_prefix_tokens(model)
        weight = keep[:, start:, None].to(x.dtype)
        x = (x[:, start:] * weight).sum(dim=1) / weight.sum(dim=1)
    else:
        raise ValueError(f"cannot leave tokens out of the {pool!r} pooling: only {', '.join(MASKABLE_POOLS)} can")
    return model.head_drop(model.fc_norm(x))
