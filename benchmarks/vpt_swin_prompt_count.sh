#!/usr/bin/env bash
# VPT-shallow on petl's FractalDB Swin with fewer prompts: does the prompt count against a window's tokens explain
# the mini_swin row?  The row's protocol for one final run (digits, train800val200, lr 0.01, 20 epochs, seed 0, fp32)
# with 10 and with 25 prompts (the row: 100).  A Swin window of this model holds 16 tokens, and VPT's Swin code puts
# every prompt into every window; the ViT's 100 prompts sit beside 65 tokens.  Runs finished before are kept
# (petl-run resumes or skips them).  Prints each run's test top-1.
#
#   benchmarks/vpt_swin_prompt_count.sh        (about 5 minutes a run on one core)
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/results/mini_swin/prompt_count/digits
pids=()
for tokens in 10 25; do
  OMP_NUM_THREADS=1 petl-run method=vpt method.num_tokens=$tokens method.deep=false data.name=mini/digits \
    data.split=train800val200 model.name=swin_fractal_tiny_patch2_window4_32.fractaldb train.epochs=20 \
    train.lr=0.01 train.precision=no seed=0 "output_dir=$out/vpt_shallow_$tokens/seed0" &
  pids+=($!)
done
# Each run waited for by its pid, so that a failed run stops the script (a bare wait returns 0).
for pid in "${pids[@]}"; do wait "$pid"; done
for tokens in 10 25; do
  python -c "import json, sys; r = json.load(open(sys.argv[1])); print(sys.argv[2], 'prompts: test top-1', round(r['test_top1'], 2))" \
    "$out/vpt_shallow_$tokens/seed0/result.json" "$tokens"
done
