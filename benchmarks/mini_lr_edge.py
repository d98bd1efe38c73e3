"""Is a mini suite's lr grid wide enough?  Retrain trials that chose its top lr (1e-2) at 3e-2 and compare.

Most experiments of ``configs/suites/mini_selection.yaml`` (and of ``mini_dinov2.yaml``, the same protocol on
DINOv2) choose lr 1e-2, the top of the grid {1e-3, 1e-2}, on most tasks, so their optimum may lie above the grid.
This probe takes committed 1e-2 selection trials (train800, seed 0, scored on val200), trains the same config at
lr 3e-2 into ``benchmarks/results/<suite folder>/lr_edge/`` and compares the val top-1 after the last epoch:
where 3e-2 wins, the row is under-tuned by the grid.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/mini_lr_edge.py [--suite mini_dinov2] [SHARD/SHARDS]

Resumable.  Two processes (``0/2`` and ``1/2``) share the cases; a call without a shard trains what is left and
writes the suite folder's ``lr_edge.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from petl.bench.sweep import task_folder
from petl.train import config, runner

RESULTS = Path(__file__).resolve().parent / "results"
# lr as the trial folders spell it -> as the table prints it.
SHOWN = {"0.0003": "3e-4", "0.001": "1e-3", "0.01": "1e-2", "0.03": "3e-2"}


@dataclass(frozen=True)
class Probe:
    """One suite's cases: which committed lr 1e-2 trials are retrained at 3e-2.

    Attributes:
        folder: the suite's results folder (its trials in ``runs/``, the reruns in ``lr_edge/``).
        title: what the table's heading calls the suite.
        epochs: the suite's schedule (the reruns keep it).
        cases: (task, experiment) pairs, every one a trial that chose the grid's edge ``chosen``.
        chosen: the grid's edge those trials chose; ``other``: the grid's other point.
        lr: the lr past the edge that the reruns train with.
        table: the file the comparison is written to, in ``folder``.

    """

    folder: Path
    title: str
    epochs: int
    cases: tuple[tuple[str, str], ...]
    chosen: str = "0.01"
    other: str = "0.001"
    lr: str = "0.03"
    table: str = "lr_edge.md"

    def trial_dir(self, task: str, experiment: str, lr: str) -> Path:
        """A committed selection trial."""
        return self.folder / "runs" / task_folder(f"mini/{task}") / experiment / "search" / f"train.lr={lr}"

    def probe_dir(self, task: str, experiment: str) -> Path:
        """Where the case's lr 3e-2 trial goes."""
        return self.folder / "lr_edge" / task / experiment / f"train.lr={self.lr}"


PROBES = {
    # One or two per family: head only, LoRA, both adapters, deep prompts, biases; on two tasks.
    "mini_selection": Probe(
        RESULTS / "mini_selection",
        "the mini suite's",
        20,
        tuple(
            (task, experiment)
            for experiment in ("linear", "lora", "adapter_sequential", "adapter_parallel", "vpt_deep", "bitfit")
            for task in ("digits", "dsprites_loc")
        ),
    ),
    # The real backbone's finished head-only rows, on every task where their search chose 1e-2 (linear: all but
    # dsprites_ori; Mlp-3: fashion_mnist and textures chose 1e-3, textures on a tie at 100.0).
    "mini_dinov2": Probe(
        RESULTS / "mini_dinov2",
        "the real-backbone (DINOv2 ViT-S/14, 56 px) mini suite's",
        10,
        tuple(
            [("digits", "linear"), ("fashion_mnist", "linear"), ("mnist", "linear"), ("textures", "linear")]
            + [("clevr_count", "linear"), ("dsprites_loc", "linear")]
            + [("digits", "mlp"), ("mnist", "mlp"), ("clevr_count", "mlp"), ("dsprites_loc", "mlp")]
            + [("dsprites_ori", "mlp")]
        ),
    ),
    # Partial-1 chose the grid's bottom, 1e-3, on all 7 tasks: one step below it on three tasks (one natural,
    # two structured), as many as fitted the session's CPU time.
    "mini_dinov2_low": Probe(
        RESULTS / "mini_dinov2",
        "the real-backbone (DINOv2 ViT-S/14, 56 px) mini suite's",
        10,
        (("digits", "partial"), ("clevr_count", "partial"), ("dsprites_loc", "partial")),
        chosen="0.001",
        other="0.01",
        lr="0.0003",
        table="lr_edge_low.md",
    ),
}


def val_curve(run: Path) -> list[float]:
    """Val top-1 per epoch from a run's metrics.jsonl."""
    return [json.loads(line)["val_top1"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def render(probe: Probe = PROBES["mini_selection"]) -> str:
    """The probe's table (``lr_edge.md``) from the committed runs of every case (reads only; trains nothing)."""
    edge, other, past = SHOWN[probe.chosen], SHOWN[probe.other], SHOWN[probe.lr]
    rows = [
        f"| task | experiment | val top-1 at lr {other} | at {edge} (chosen) | at {past} | {past} - {edge} |",
        "|---|---|---:|---:|---:|---:|",
    ]
    wins = 0
    for task, experiment in probe.cases:
        low, top = (val_curve(probe.trial_dir(task, experiment, lr))[-1] for lr in (probe.other, probe.chosen))
        beyond = val_curve(probe.probe_dir(task, experiment))[-1]
        wins += beyond > top
        rows.append(f"| {task} | {experiment} | {low:.1f} | {top:.1f} | {beyond:.1f} | {beyond - top:+.1f} |")
    side = "top" if float(probe.chosen) > float(probe.other) else "bottom"
    return (
        f"# lr {past} against the grid's {side} ({edge}) on {probe.title} selection trials\n\n"
        f"Written by `benchmarks/mini_lr_edge.py` from the committed trials (`runs/`) and their lr {past} reruns "
        f"(`lr_edge/`): same config, data split (train800 -> val200), {probe.epochs} epochs and seed 0, only "
        "`train.lr` changed. Val top-1 after the last epoch (the selection's score); one val image is 0.5 points.\n\n"
        + "\n".join(rows)
        + f"\n\nlr {past} scores higher than {edge} in {wins} of {len(probe.cases)} cases.\n"
    )


def main(probe: Probe, shard: str | None) -> int:
    index, count = (int(n) for n in shard.split("/")) if shard else (0, 1)
    for case in probe.cases[index::count]:
        task, experiment = case
        # A typed run config (the runner reads its nodes as dataclasses), as the trial recorded it.
        cfg = config.to_config(OmegaConf.load(probe.trial_dir(task, experiment, probe.chosen) / "config.yaml"))
        cfg.train.lr = float(probe.lr)
        cfg.train.progress = sys.stderr.isatty()
        cfg.output_dir = str(probe.probe_dir(*case))
        try:
            runner.run(cfg)  # a finished probe is returned, not trained again
        except runner.RunError as error:  # held by the other shard: it trains that one
            print(f"skipped {case}: {error}")
            continue
        (probe.probe_dir(*case) / "trainable.safetensors").unlink(missing_ok=True)  # only the curves are compared
    if shard is None:
        text = render(probe)
        print(text)
        (probe.folder / probe.table).write_text(text)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", choices=sorted(PROBES), default="mini_selection")
    parser.add_argument("shard", nargs="?", help="SHARD/SHARDS, e.g. 0/2")
    args = parser.parse_args()
    raise SystemExit(main(PROBES[args.suite], args.shard))
