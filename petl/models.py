"""The small ViT that petl pretrains itself on FractalDB-style images, registered with timm.

Importing this module registers ``vit_fractal_tiny_patch4_32`` so that ``timm.create_model`` and
``petl-run model=...`` find it.  Its pretrained tag ``fractaldb`` points at the checkpoint shipped
in ``petl/weights/``; loading goes through timm's own pretrained machinery (a local ``file``), the
same code path that serves hub weights for users who have them.
"""

from __future__ import annotations

from pathlib import Path

from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn

WEIGHTS_DIR = Path(__file__).parent / "weights"
FRACTAL_CHECKPOINT = WEIGHTS_DIR / "vit_fractal_tiny_patch4_32.fractaldb.safetensors"
DEFAULT_MODEL = "vit_fractal_tiny_patch4_32.fractaldb"

# Fractals are drawn white-ish on black, so a symmetric normalisation suits them and any RGB task.
FRACTAL_MEAN = (0.5, 0.5, 0.5)
FRACTAL_STD = (0.5, 0.5, 0.5)

default_cfgs = generate_default_cfgs(
    {
        "vit_fractal_tiny_patch4_32.fractaldb": {
            "file": str(FRACTAL_CHECKPOINT),
            "num_classes": 0,
            "input_size": (3, 32, 32),
            "pool_size": None,
            "crop_pct": 1.0,
            "interpolation": "bilinear",
            "mean": FRACTAL_MEAN,
            "std": FRACTAL_STD,
            "first_conv": "patch_embed.proj",
            "classifier": "head",
            "license": "apache-2.0",
        },
    }
)


@register_model
def vit_fractal_tiny_patch4_32(pretrained: bool = False, **kwargs) -> VisionTransformer:
    """ViT, patch 4, 32x32 input, width 192, 6 blocks, 3 heads (~2.7M parameters).

    Args:
        pretrained: load the FractalDB-pretrained weights shipped with petl.
        **kwargs: overrides passed to timm's VisionTransformer (``num_classes``, ``drop_path_rate``...).
    """
    args = dict(img_size=32, patch_size=4, embed_dim=192, depth=6, num_heads=3, mlp_ratio=4.0)
    return build_model_with_cfg(
        VisionTransformer,
        "vit_fractal_tiny_patch4_32",
        pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        **{**args, **kwargs},
    )
