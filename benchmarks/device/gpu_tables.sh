#!/usr/bin/env bash
# The CUDA tables (issue 49) in one call of the lent GPU machine, within BUDGET seconds (480 by default):
#   speed_cuda.md      petl-bench speed device=cuda (ViT-B/16 at 224, batch 64, random weights), in two parts:
#                      LoRA against peft's LoRA (TF32 and bf16 autocast rows, and torch.compile), then the seed
#                      methods (linear ... full) with a bf16 row each;
#   multitask_cuda.md  benchmarks/multitask_speed.py: 8 LoRA tasks and the 8-method set on ViT-B/16, bf16, batch 64,
#                      against the plain backbone, and multitask_cuda_profile.md beside it: where each mixed
#                      batch's GPU time goes (busy time against the timed call, kernels, the costliest ops);
#   multitask_graph_cuda.md  the same script with --graph: the 8-method set's and the LoRA set's mixed batch also
#                      through forward's CUDA graph of its layout (MultiTask.graphs, the rows in another order each
#                      call), in a process of its own (GPU only);
#   serve_cuda.md      benchmarks/serve_load.py: petl-serve on loopback (default backbone, 1 and 4 tasks) in its
#                      default precision=auto: bf16 autocast with TF32 on the GPU (the table's title names the
#                      precision each server's /health reported).
# Each part ends by its own deadline (seconds from the start: SPEED_LORA_END, SPEED_METHODS_END, MULTITASK_END,
# GRAPH_END, SERVE_END); a part that finishes early leaves its time to the next.  multitask_speed.py and serve_load.py start
# nothing new after their deadline and write the rows they measured, saying which are missing; they write their
# table after each row, so one cut off by `timeout` (or a process a GPU fault ended) leaves its finished rows, the
# table saying "Partial table"; a speed part cut
# off by `timeout` writes nothing, so its table says so, and the other speed part stands alone.  Every part's exit
# status and seconds go to gpu_tables.log.
#
# Here, once: PYTHONPATH=. python benchmarks/device/make_kit.py wheels    (.device/whl/, about 5 MB: hydra-core,
# omegaconf, antlr4, mlxtend, and petl-serve's fastapi/uvicorn/python-multipart stack for CPython 3.12)
# The device call (the `run` tool; the machine has torch, timm, peft, accelerate, no network):
#   run(command="bash benchmarks/device/gpu_tables.sh", carry=[".device"], timeout_s=540)
# then copy the files under files_at to benchmarks/results/ (they name the command, machine and GPU themselves).
# Without $OUT the tables go to /tmp/petl_gpu_tables (never into the checkout: committed tables stay as they are).
#
# `bash benchmarks/device/gpu_tables.sh --cpu` runs the same parts on the CPU with tiny settings (the tiny FractalDB
# ViT, a few steps, one round: about a minute on two quiet cores, BUDGET=300 s by default for busy ones) and the
# python on PATH, installing nothing (KIT=1: the kit, as on the device; kit.sh): the script's logic,
# tested by tests/bench/test_gpu_tables.py.  Its numbers mean nothing.
#
# What the new defaults (issue 49: train.precision=auto, TF32) would save a DINOv2 sweep row: see README.md here.
set -u
# The deadlines count from here: the install and the checks below are inside BUDGET, as the call's timeout is.
START=$SECONDS
MODE=gpu
[ "${1:-}" = "--cpu" ] && MODE=cpu
OUT=${OUT:-/tmp/petl_gpu_tables}
mkdir -p "$OUT"
# Each part's output and the two speed pieces are kept in WORK and packed into $OUT/parts.tar.gz at the end: the
# device tool brings back at most 8 files from $OUT.
WORK=$(mktemp -d)
LOG="$OUT/gpu_tables.log"
: > "$LOG"
PYTHON=${PYTHON:-python3}
source "$(dirname "$0")/kit.sh"
if [ "$MODE" = gpu ]; then
    BUDGET=${BUDGET:-480}
    use_kit "$LOG"
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$LOG"
    "$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'" || exit 5
    SPEED_COMMON="device=cuda"
    METHODS=linear,lora,adapter_sequential,adapter_parallel,vpt_shallow,vpt_deep,partial,mlp,full
    LORA_OPTIONS=bf16,compile
    MULTITASK="--model vit_base_patch16_224 --batches 64 --rounds 5 --device cuda --dtype bfloat16"
    SERVE="--backbones default --tasks 1,4 --rounds 3 --precision auto"
else
    BUDGET=${BUDGET:-300}
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    [ "${KIT:-0}" = 1 ] && use_kit "$LOG"
    SPEED_COMMON="device=cpu batch=2 steps=1 warmup=1 rounds=1 infer_steps=2 inprocess=true"
    METHODS=linear
    LORA_OPTIONS=bf16
    MULTITASK="--model vit_fractal_tiny_patch4_32 --batches 8 --rounds 1 --threads 1 --device cpu --dtype float32"
    SERVE="--backbones default --tasks 1 --rounds 1 --requests 8 --clients 2 --precision auto"
fi
export PYTHONUNBUFFERED=1
# Deadlines, in seconds from the start, as shares of BUDGET.
SPEED_LORA_END=${SPEED_LORA_END:-$((BUDGET * 25 / 100))}
SPEED_METHODS_END=${SPEED_METHODS_END:-$((BUDGET * 60 / 100))}
MULTITASK_END=${MULTITASK_END:-$((BUDGET * 74 / 100))}
GRAPH_END=${GRAPH_END:-$((BUDGET * 84 / 100))}
SERVE_END=${SERVE_END:-$((BUDGET * 98 / 100))}

left() { echo $(($1 - (SECONDS - START))); }

part() {  # part NAME END COMMAND...: run COMMAND under `timeout` until END (s from the start); log status, seconds
    local name=$1 end=$2 began=$SECONDS status
    shift 2
    local budget
    budget=$(left "$end")
    if [ "$budget" -lt 5 ]; then
        echo "$name: skipped, no time left before its deadline (${end} s)" | tee -a "$LOG"
        return 124
    fi
    timeout --kill-after=15 "$budget" "$@" > "$WORK/$name.out" 2>&1
    status=$?
    echo "$name: exit $status after $((SECONDS - began)) s (deadline $end s, at $((SECONDS - START)) s)" | tee -a "$LOG"
    tail -3 "$WORK/$name.out"
    return $status
}

# 1. speed: LoRA against peft's LoRA, then the seed methods.  Each part writes its own table.
part speed_lora "$SPEED_LORA_END" "$PYTHON" -m petl.cli.bench speed $SPEED_COMMON methods=lora options_for=lora \
    options=$LORA_OPTIONS out="$WORK/speed_cuda_lora.md"
part speed_methods "$SPEED_METHODS_END" "$PYTHON" -m petl.cli.bench speed $SPEED_COMMON methods=$METHODS \
    options_for=$METHODS options=bf16 out="$WORK/speed_cuda_methods.md"
{
    echo "# petl speed, two runs (benchmarks/device/gpu_tables.sh)"
    echo
    echo "Two \`petl-bench speed\` runs: LoRA against peft's LoRA with its options, then the seed methods with a bf16"
    echo "row each. Precision is a column: \`TF32\` rows are petl-run's \`train.precision=tf32\` (fp32 tensors, TF32"
    echo "matmuls), \`bf16 autocast\` rows its default (\`train.precision=auto\`) on a GPU with native bf16."
    for piece in lora methods; do
        echo
        if [ -f "$WORK/speed_cuda_$piece.md" ]; then
            sed 's/^# /## /' "$WORK/speed_cuda_$piece.md"
        else
            echo "## speed_$piece: not finished by its deadline (gpu_tables.log)"
        fi
    done
} > "$OUT/speed_cuda.md"

# 2. Serving many tasks from one backbone, bf16.
part multitask "$MULTITASK_END" "$PYTHON" benchmarks/multitask_speed.py $MULTITASK --sets lora,methods \
    --profile "$OUT/multitask_cuda_profile.md" \
    --deadline $(($(left "$MULTITASK_END") * 6 / 10)) --out "$OUT/multitask_cuda.md"

# 2b. The same mixed batches as CUDA graphs, in a process of their own: a graph that fails costs this part alone.
if [ "$MODE" = gpu ]; then
    part graph "$GRAPH_END" "$PYTHON" benchmarks/multitask_speed.py $MULTITASK --sets methods,lora --graph \
        --deadline $(($(left "$GRAPH_END") * 5 / 10)) --out "$OUT/multitask_graph_cuda.md"
else
    echo "graph: skipped, a CUDA graph needs a GPU" | tee -a "$LOG"
fi

# 3. petl-serve under load on loopback.
part serve "$SERVE_END" "$PYTHON" benchmarks/serve_load.py $SERVE \
    --deadline $(($(left "$SERVE_END") * 6 / 10)) --out "$OUT/serve_cuda.md"

echo "done at $((SECONDS - START)) s of $BUDGET" | tee -a "$LOG"
tar -czf "$OUT/parts.tar.gz" -C "$WORK" . && rm -r "$WORK"
ls "$OUT"
