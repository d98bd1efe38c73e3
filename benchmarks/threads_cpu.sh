#!/usr/bin/env bash
# How to spend two CPU cores on the mini suite: one training process on two torch threads, or two one-thread
# processes side by side?  Trains LoRA (the mini suite's recipe, lr 1e-2) for 4 epochs on mini/digits train800
# each way on an otherwise idle machine and writes the measured training throughput to
# benchmarks/results/threads_cpu.md.  Stop any sweep first: the point is two free cores.
#
#   benchmarks/threads_cpu.sh [SCRATCH_DIR]      (default /tmp/petl_threads; runs are deleted and redone)
set -eu
cd "$(dirname "$0")/.."
PETL_RUN=${PETL_RUN:-petl-run}
OUT=${1:-/tmp/petl_threads}
rm -rf "$OUT" && mkdir -p "$OUT"
ARGS=(method=lora data=mini/digits data.split=train800 train.epochs=4 train.lr=0.01 train.progress=false)
OMP_NUM_THREADS=2 "$PETL_RUN" "${ARGS[@]}" output_dir="$OUT/two_threads" > "$OUT/log" 2>&1
OMP_NUM_THREADS=1 "$PETL_RUN" "${ARGS[@]}" output_dir="$OUT/one_thread_alone" >> "$OUT/log" 2>&1
OMP_NUM_THREADS=1 "$PETL_RUN" "${ARGS[@]}" seed=1 output_dir="$OUT/side_by_side_1" >> "$OUT/log" 2>&1 &
OMP_NUM_THREADS=1 "$PETL_RUN" "${ARGS[@]}" seed=2 output_dir="$OUT/side_by_side_2" >> "$OUT/log" 2>&1 &
wait
python3 - "$OUT" > benchmarks/results/threads_cpu.md <<'PY'
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

out = Path(sys.argv[1])


def rate(name):
    # Training images/s of each epoch (metrics.jsonl); the first epoch (warm-up) is left out.
    lines = (out / name / "metrics.jsonl").read_text().splitlines()
    return statistics.median(json.loads(line)["images_per_second"] for line in lines[1:])


lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
cpu = next((line.split(":", 1)[1].strip() for line in lscpu if line.startswith("Model name")), "unknown CPU")
two, alone = rate("two_threads"), rate("one_thread_alone")
side = [rate("side_by_side_1"), rate("side_by_side_2")]
print("# One process on two threads, or two one-thread processes? (measured by `benchmarks/threads_cpu.sh`)\n")
print(
    "LoRA (rank 8 on Q and V), lr 1e-2, batch 64, fp32, 4 epochs on mini/digits train800 with the shipped "
    f"`vit_fractal_tiny_patch4_32.fractaldb`; {cpu}, {len(os.sched_getaffinity(0))} cores, nothing else running. "
    "Training images per second: the median over epochs 2-4 of each run's metrics.jsonl (evaluation not counted).\n"
)
print("| how the two cores are used | images/s per process | images/s in all |")
print("|---|---:|---:|")
print(f"| one process, 2 threads | {two:.0f} | {two:.0f} |")
print(f"| one process, 1 thread (one core idle) | {alone:.0f} | {alone:.0f} |")
print(f"| two processes side by side, 1 thread each | {side[0]:.0f}, {side[1]:.0f} | {sum(side):.0f} |")
if sum(side) > two:
    print(f"\nTwo one-thread processes train {sum(side) / two:.2f}x the images of one two-thread process.")
else:
    print(f"\nOne two-thread process trains {two / sum(side):.2f}x the images of two one-thread processes.")
PY
cat benchmarks/results/threads_cpu.md
