"""Does formula-driven pretraining help?  Linear probes of the shipped backbone vs random weights.

For every mini task, trains the `linear` method (frozen backbone, new head; features cached, so
the protocol's 100 epochs cost about one forward pass) on the FractalDB-pretrained default
backbone and on the same architecture with random weights, and prints a Markdown table of test
top-1.  Usage:

    python benchmarks/linear_probe.py [--epochs 100] [--seed 0] [--out benchmarks/results/linear_probe.md]
"""

from __future__ import annotations

import argparse
import platform
import tempfile
from pathlib import Path

import torch

from petl import data
from petl.run import default_config, train


def probe(task: str, pretrained: bool, epochs: int, seed: int, out: Path) -> float:
    cfg = default_config(
        [
            "method=linear",
            f"data={task}",
            f"model.pretrained={str(pretrained).lower()}",
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
    args = parser.parse_args()
    tasks = [name for name in data.list_datasets() if name.startswith("mini/")]
    rows = ["| task | random init | FractalDB-pretrained | gain |", "| --- | ---: | ---: | ---: |"]
    wins = 0
    with tempfile.TemporaryDirectory() as tmp:
        for task in tasks:
            accs = {}
            for pretrained in (False, True):
                run_dir = Path(tmp) / task.replace("/", "_") / str(pretrained)
                accs[pretrained] = probe(task, pretrained, args.epochs, args.seed, run_dir)
            gain = accs[True] - accs[False]
            wins += gain > 0
            rows.append(f"| {task} | {accs[False]:.1f} | {accs[True]:.1f} | {gain:+.1f} |")
            print(rows[-1], flush=True)
    table = "\n".join(
        [
            f"Linear probe (method=linear, {args.epochs} epochs, seed {args.seed}), test top-1 %, "
            f"`vit_fractal_tiny_patch4_32`; measured on {platform.machine()}, torch {torch.__version__}.",
            "Command: `python benchmarks/linear_probe.py`",
            "",
            *rows,
            "",
            f"Pretraining helps on {wins} of {len(tasks)} tasks.",
        ]
    )
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
