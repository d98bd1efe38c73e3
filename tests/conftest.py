"""Shared fixtures: tiny random-weight timm ViTs that build in milliseconds."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

# Three blocks of width 48 on 32x32 images in 8x8 patches: 16 patch tokens, about 95k parameters.
TINY_VIT = dict(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=3, num_classes=5)


def make_tiny_vit(seed: int = 0, **overrides) -> VisionTransformer:
    """A tiny ViT in eval mode; the same seed and overrides give the same weights."""
    torch.manual_seed(seed)
    return VisionTransformer(**{**TINY_VIT, **overrides}).eval()


@pytest.fixture
def tiny_vit() -> Callable[..., VisionTransformer]:
    """Factory of tiny ViTs: ``tiny_vit(seed=0, **VisionTransformer overrides)``."""
    return make_tiny_vit


@pytest.fixture
def images() -> torch.Tensor:
    """A fixed batch of two random 32x32 RGB images."""
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
