"""Does the mini suite's 20-epoch schedule converge?  Retrain a few search trials for 40 epochs and compare.

Each case is a committed selection trial of ``configs/suites/mini_selection.yaml`` (train800, seed 0, scored on
val200) whose val accuracy still rose over its last epochs.  The same config is trained again with twice the
epochs (so a whole cosine schedule twice as long, not the old one continued) into
``benchmarks/results/mini_selection/convergence/``, and the table compares the two end points.  If the longer schedule
ends within the noise of 200 val images, 20 epochs is enough for that case.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/mini_convergence.py   # resumable; prints the table

Writes ``benchmarks/results/mini_selection/convergence.md``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from omegaconf import OmegaConf

from petl.bench.sweep import task_folder
from petl.train import config, runner

RESULTS = Path(__file__).resolve().parent / "results" / "mini_selection"
EPOCHS = 40
# (task, experiment, lr): the trials whose val top-1 rose most over epochs 9-12 -> 17-20, one or two per method.
CASES = [
    ("clevr_count", "lora", "0.01"),
    ("mnist", "lora", "0.01"),
    ("dsprites_loc", "partial", "0.001"),
    ("dsprites_loc", "mlp", "0.01"),
    ("clevr_count", "linear", "0.01"),
]


def val_curve(run: Path) -> list[float]:
    """Val top-1 per epoch from a run's metrics.jsonl."""
    return [json.loads(line)["val_top1"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def trial_dir(task: str, experiment: str, lr: str) -> Path:
    """The committed 20-epoch selection trial of a case."""
    return RESULTS / "runs" / task_folder(f"mini/{task}") / experiment / "search" / f"train.lr={lr}"


def longer_dir(task: str, experiment: str, lr: str) -> Path:
    """Where the case's 40-epoch rerun goes."""
    return RESULTS / "convergence" / task / experiment / f"train.lr={lr}-{EPOCHS}ep"


def render() -> str:
    """``convergence.md`` from the committed runs of every case (reads only; trains nothing)."""
    rows = [
        "| task | experiment | lr | val top-1 after 20 ep | best of 20 | after 40 ep | best of 40 | 40 - 20 |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for case in CASES:
        short, long = val_curve(trial_dir(*case)), val_curve(longer_dir(*case))
        rows.append(
            f"| {' | '.join(case)} | {short[-1]:.1f} | {max(short):.1f} | {long[-1]:.1f} | {max(long):.1f} "
            f"| {long[-1] - short[-1]:+.1f} |"
        )
    return (
        "# 20 against 40 epochs on the mini suite's selection trials\n\n"
        "Written by `benchmarks/mini_convergence.py` from the committed trials (`runs/`) and their 40-epoch reruns "
        "(`convergence/`): same config, data split (train800 -> val200) and seed 0, only `train.epochs` "
        "doubled (a cosine schedule twice as long). One val image is 0.5 points.\n\n" + "\n".join(rows) + "\n"
    )


def main() -> int:
    for case in CASES:
        cfg = config.to_config(OmegaConf.load(trial_dir(*case) / "config.yaml"))  # typed, as the runner reads it
        cfg.train.epochs = EPOCHS
        cfg.train.progress = sys.stderr.isatty()
        cfg.output_dir = str(longer_dir(*case))
        runner.run(cfg)  # a finished rerun is returned, not trained again
        (longer_dir(*case) / "trainable.safetensors").unlink(missing_ok=True)  # only the curves are compared
    text = render()
    print(text)
    (RESULTS / "convergence.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
