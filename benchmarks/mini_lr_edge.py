"""Is the mini suite's lr grid wide enough?  Retrain trials that chose its top lr (1e-2) at 3e-2 and compare.

Most experiments of ``configs/suites/mini_selection.yaml`` choose lr 1e-2, the top of the grid {1e-3, 1e-2}, on
most tasks, so their optimum may lie above the grid.  This probe takes committed 1e-2 selection trials (train800,
seed 0, scored on val200), trains the same config at lr 3e-2 into ``benchmarks/results/mini/lr_edge/`` and
compares the val top-1 after the last epoch: where 3e-2 wins, the row is under-tuned by the grid.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/mini_lr_edge.py [SHARD/SHARDS]   # resumable

Two processes (``0/2`` and ``1/2``) share the cases; a call without a shard trains what is left and writes
``benchmarks/results/mini/lr_edge.md``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mini_convergence import RESULTS, trial_dir, val_curve
from omegaconf import OmegaConf

from petl.run import runner

LR = "0.03"
TASKS = ("digits", "dsprites_loc")
# One or two per family: head only, LoRA, both adapters, deep prompts, biases.
EXPERIMENTS = ("linear", "lora", "adapter_sequential", "adapter_parallel", "vpt_deep", "bitfit")
CASES = [(task, experiment) for experiment in EXPERIMENTS for task in TASKS]


def probe_dir(task: str, experiment: str) -> Path:
    """Where the case's lr 3e-2 trial goes."""
    return RESULTS / "lr_edge" / task / experiment / f"train.lr={LR}"


def render() -> str:
    """``lr_edge.md`` from the committed runs of every case (reads only; trains nothing)."""
    rows = [
        "| task | experiment | val top-1 at lr 1e-3 | at 1e-2 (chosen) | at 3e-2 | 3e-2 - 1e-2 |",
        "|---|---|---:|---:|---:|---:|",
    ]
    wins = 0
    for task, experiment in CASES:
        low, top = (val_curve(trial_dir(task, experiment, lr))[-1] for lr in ("0.001", "0.01"))
        edge = val_curve(probe_dir(task, experiment))[-1]
        wins += edge > top
        rows.append(f"| {task} | {experiment} | {low:.1f} | {top:.1f} | {edge:.1f} | {edge - top:+.1f} |")
    return (
        "# lr 3e-2 against the grid's top (1e-2) on the mini suite's selection trials\n\n"
        "Written by `benchmarks/mini_lr_edge.py` from the committed trials (`runs/`) and their lr 3e-2 reruns "
        "(`lr_edge/`): same config, data split (train800 -> val200), 20 epochs and seed 0, only `train.lr` "
        "changed. Val top-1 after the last epoch (the selection's score); one val image is 0.5 points.\n\n"
        + "\n".join(rows)
        + f"\n\nlr 3e-2 scores higher than 1e-2 in {wins} of {len(CASES)} cases.\n"
    )


def main(shard: str | None) -> int:
    index, count = (int(n) for n in shard.split("/")) if shard else (0, 1)
    for case in CASES[index::count]:
        task, experiment = case
        cfg = OmegaConf.load(trial_dir(task, experiment, "0.01") / "config.yaml")
        cfg.train.lr = float(LR)
        cfg.train.progress = sys.stderr.isatty()
        cfg.output_dir = str(probe_dir(*case))
        try:
            runner.run(cfg)  # a finished probe is returned, not trained again
        except runner.RunError as error:  # held by the other shard: it trains that one
            print(f"skipped {case}: {error}")
            continue
        (probe_dir(*case) / "trainable.safetensors").unlink(missing_ok=True)  # only the curves are compared
    if shard is None:
        text = render()
        print(text)
        (RESULTS / "lr_edge.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1] if len(sys.argv) > 1 else None))
