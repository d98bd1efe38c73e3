"""How much does GPS's selection depend on the batch its contrastive gradient is summed over?

Until 5f5e215 petl's runner handed calibrate hooks batches of ``train.eval_batch_size`` (256); since then it hands
them the training batch (64 in the mini suite), as GPS's reference does (``loader_grad`` with ``--batch-size``,
FightingFighting/GPS train_gps.py L133-136).  The SupCon loss compares the images of a batch, so the batch changes
which entry of each row has the largest gradient.  The committed mini GPS row was selected at 256.  For each mini
task this takes the committed lr 1e-2 selection trial's config, recomputes its selection at 256 (which must
reproduce the committed one) and at 64, and prints the share of rows whose selected entry agrees; for scale, the
same share between the task's committed finals (seeds 0, 1, 2: other seeds, and train800val200 instead of train800).

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/gps_selection_batch.py \
        > benchmarks/results/mini_selection/gps_selection_batch.md

About 20 s a task on one thread.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from accelerate.utils import set_seed
from omegaconf import OmegaConf

import petl
from petl.bench.sweep import task_folder
from petl.methods.gps import calibrate_gps
from petl.train import build

RUNS = Path(__file__).resolve().parent / "results" / "mini_selection" / "runs"
TASKS = ("fashion_mnist", "mnist", "digits", "textures", "dsprites_loc", "dsprites_ori", "clevr_count")


def agreement(first: list[str], second: list[str]) -> float:
    """The share of rows (one selected column each, ``per_row`` 1) whose selected column is the same."""
    same = total = 0
    for weight_a, weight_b in zip(first, second, strict=True):
        columns_a, columns_b = weight_a.split(","), weight_b.split(",")
        same += sum(a == b for a, b in zip(columns_a, columns_b, strict=True))
        total += len(columns_a)
    return same / total


def selection_at(result: dict, batch_size: int) -> list[str]:
    """The selection a committed run's config makes when its gradient is summed over ``batch_size`` batches."""
    cfg = OmegaConf.create(result["config"])
    set_seed(cfg.seed)  # as the runner does before it builds the backbone: the two views are random
    backbone = build.create_backbone(cfg)
    images = build.calibration_set(cfg, backbone)
    batches = build.loader(images, batch_size, 0, cfg.seed)
    method_cfg = petl.make_config("gps", num_classes=result["num_classes"], per_row=result["method_config"]["per_row"])
    return list(calibrate_gps(backbone, method_cfg, batches).selection)


def main() -> None:
    print("# GPS's selection at the eval batch (256, before 5f5e215) and at the training batch\n")
    print("`PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/gps_selection_batch.py` (what it does: its docstring).\n")
    print("| Task | 256 reproduces the committed | 64 vs 256 | finals seed 0 vs 1 | finals seed 0 vs 2 |")
    print("|---|---|---|---|---|")
    for task in TASKS:
        folder = RUNS / task_folder(f"mini/{task}") / "gps"
        trial = json.loads((folder / "search" / "train.lr=0.01" / "result.json").read_text())
        training_batch = trial["config"]["train"]["batch_size"]
        at_eval, at_train = selection_at(trial, 256), selection_at(trial, training_batch)
        finals = [json.loads((folder / f"seed{s}" / "result.json").read_text()) for s in range(3)]
        selections = [f["method_config"]["selection"] for f in finals]
        reproduced = "yes" if at_eval == trial["method_config"]["selection"] else "NO"
        print(
            f"| {task} | {reproduced} | {agreement(at_train, at_eval):.1%} | "
            f"{agreement(selections[0], selections[1]):.1%} | {agreement(selections[0], selections[2]):.1%} |",
            flush=True,
        )
    print(f"\nTraining batch {training_batch}; rows agreeing: share of GPS's per-row selected entries that are equal.")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
