"""Predict throughput of a LoRA model merged vs unmerged, measured in one process as a ratio.

    python benchmarks/predict_throughput.py [--threads 2] [--repeats 5] [--images 64]

For each backbone (petl's default 32 px FractalDB ViT with its weights, and ViT-B/16 at 224 px with
random weights: speed does not depend on the values), LoRA rank 8 on q and v is applied and given
non-zero updates; a deep copy is merged (``restorable=False``: it is never unmerged, so no copy is kept).  Both
then classify the same generated PNG files through ``petl-predict``'s own path
(:func:`petl.deploy.predict.predict_images`: decode, preprocess, batched forward, top-5), alternating merged
and unmerged ``--repeats`` times; the median images/s of each and their ratio are printed as a Markdown table,
with the load average before and after (the machine may be shared: the ratio, taken under the same load, is
the number to read).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import timm
import torch
from PIL import Image

import petl
from petl.data.transforms import ImageSpec
from petl.deploy.predict import predict_images
from petl.store.run_card import LoadedRun

# (timm name, load its pretrained weights, batch size, images per pass as a multiple of --images / 4)
BACKBONES = (
    ("vit_fractal_tiny_patch4_32.fractaldb", True, 64, 4),
    ("vit_base_patch16_224", False, 16, 1),
)


def _images(folder: Path, count: int, size: int) -> list[Path]:
    rng = np.random.default_rng(0)
    paths = []
    for index in range(count):
        path = folder / f"{size}_{index:04d}.png"
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(path)
        paths.append(path)
    return paths


def _runs(name: str, pretrained: bool) -> tuple[LoadedRun, LoadedRun]:
    model = timm.create_model(name, pretrained=pretrained)
    cfg = timm.data.resolve_data_config({}, model=model)
    petl.apply(model, "lora", num_classes=10)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.02)
    model.eval()
    merged = petl.merge(copy.deepcopy(model), restorable=False)  # never unmerged: no CPU copy to keep
    spec = ImageSpec(int(cfg["input_size"][-1]), tuple(cfg["mean"]), tuple(cfg["std"]), True, cfg["interpolation"])
    names = [str(i) for i in range(10)]
    make = lambda m, tag: LoadedRun(m, spec, names, {}, Path(tag))  # noqa: E731
    return make(model, "unmerged"), make(merged, "merged")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--images", type=int, default=64, help="per pass on ViT-B; 4x that on the tiny ViT")
    parser.add_argument("--only", choices=[b[0] for b in BACKBONES], help="measure this backbone alone")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, pretrained, batch, scale in BACKBONES:
            if args.only and name != args.only:
                continue
            unmerged, merged = _runs(name, pretrained)
            paths = _images(Path(tmp), args.images * scale, unmerged.spec.image_size)
            predict_images(unmerged, paths[:batch], batch_size=batch, progress=False)  # warm-up
            predict_images(merged, paths[:batch], batch_size=batch, progress=False)
            speeds: dict[str, list[float]] = {"unmerged": [], "merged": []}
            for _ in range(args.repeats):
                for tag, run in (("unmerged", unmerged), ("merged", merged)):
                    start = time.perf_counter()
                    predict_images(run, paths, batch_size=batch, progress=False)
                    speeds[tag].append(len(paths) / (time.perf_counter() - start))
            a, b = statistics.median(speeds["unmerged"]), statistics.median(speeds["merged"])
            size = unmerged.spec.image_size
            rows.append(f"| {name} | {size} | {len(paths)} | {batch} | {a:.1f} | {b:.1f} | {b / a:.2f} |")
            print(rows[-1], flush=True)  # as it comes: a slow machine may stop the script before the end
    load_after = os.getloadavg()
    print(f"\ntorch threads {args.threads}, median of {args.repeats} alternating passes over the same PNGs")
    print(f"load average before {load_before[0]:.2f} / after {load_after[0]:.2f} (1 min)\n")
    print("| backbone | px | images | batch | unmerged img/s | merged img/s | merged / unmerged |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
