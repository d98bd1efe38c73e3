#!/usr/bin/env bash
# `petl-bench speed` on every backbone kind petl supports beside the plain ViT (Swin, SwinV2, EVA-02, BEiT-v2,
# relative-position ViT, parallel-block ViT), each at a size a 2-core CPU can time, into one file: every method
# the kind accepts against its floor, with the generated note for each row above 1.15x its floor, and the methods it refuses
# with the reason.  The Swin is the shipped tiny Swin's architecture; the SwinV2 is given that shape, and the
# ViT families the default ViT's (32 px, patch 4, width 192, 6 blocks, 3 heads), through model.kwargs.
#
#   nice -n 10 benchmarks/speed_backbones.sh [SCRATCH_DIR]      (default /tmp/petl_speed_backbones)
#
# Each kind is one petl-bench process, its cases taking turns, so the ratios inside a section share whatever
# else ran on the machine.  A kind whose table is already in SCRATCH_DIR is kept (delete it to measure again).
# One torch thread (OMP_NUM_THREADS=1): on a shared 2-core machine a two-thread process waits on a busy core at
# every parallel op.  Memory is read in the one process (inprocess=true: a fresh process per row costs seconds
# of start-up each); the tables say so.  SPEED_NOTE="..." adds a line on the run's conditions to the file.
# About 25 minutes here.
set -eu
cd "$(dirname "$0")/.."
PETL_BENCH=${PETL_BENCH:-petl-bench}
OUT=${1:-/tmp/petl_speed_backbones}
RESULT=benchmarks/results/speed_backbones_cpu.md
mkdir -p "$OUT"
export OMP_NUM_THREADS=1
COMMON=(device=cpu batch=16 steps=10 warmup=2 rounds=10 infer_steps=50 inprocess=true)
VIT_SHAPE=(img_size=32 model.kwargs.patch_size=4 model.kwargs.embed_dim=192 model.kwargs.depth=6 model.kwargs.num_heads=3)
SWIN_SHAPE=(img_size=32 model.kwargs.patch_size=2 model.kwargs.window_size=4 model.kwargs.embed_dim=64
  "model.kwargs.depths=[2,4,2]" "model.kwargs.num_heads=[2,4,8]")
KINDS=(swin swinv2 eva beit vit_relpos vit_parallel)

run() {
  local kind=$1
  shift
  if [ -s "$OUT/$kind.md" ]; then
    echo "speed_backbones: $kind kept from $OUT/$kind.md"
    return
  fi
  echo "speed_backbones: $kind ($(date -u +%H:%M:%S) UTC), log in $OUT/$kind.log"
  echo "Measured at commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- petl || echo ' (petl/ changed since)'), started $(date -u '+%Y-%m-%d %H:%M') UTC." > "$OUT/$kind.when"
  # petl-bench speed writes its table once every row is measured: a file there is a finished kind.
  "$PETL_BENCH" speed "$@" "${COMMON[@]}" out="$OUT/$kind.md" > "$OUT/$kind.log" 2>&1
}

run swin model=swin_fractal_tiny_patch2_window4_32
run swinv2 model=swinv2_tiny_window8_256 "${SWIN_SHAPE[@]}"
run eva model=eva02_tiny_patch14_224 "${VIT_SHAPE[@]}"
run beit model=beitv2_base_patch16_224 "${VIT_SHAPE[@]}"
run vit_relpos model=vit_relpos_medium_patch16_cls_224 "${VIT_SHAPE[@]}"
run vit_parallel model=vit_pwee_patch16_reg1_gap_256 "${VIT_SHAPE[@]}"

{
  echo "# petl speed on the backbone kinds beside the ViT (CPU)"
  echo
  echo "Made by \`nice -n 10 benchmarks/speed_backbones.sh\`: one \`petl-bench speed\` per backbone kind (its"
  echo "command and commit head its section), OMP_NUM_THREADS=1. Each section is"
  echo "one process whose cases take turns, so its ratios (× floor above all) share the machine's load alike;"
  echo "absolute times differ between sections, measured minutes apart. The ViT's own table is"
  echo "\`speed_cpu.md\`."
  if [ -n "${SPEED_NOTE:-}" ]; then
    echo
    echo "Conditions: $SPEED_NOTE"
  fi
  for kind in "${KINDS[@]}"; do
    echo
    sed -n '1s/^# /## /p' "$OUT/$kind.md"
    echo
    cat "$OUT/$kind.when"
    tail -n +2 "$OUT/$kind.md"
  done
} > "$RESULT"
echo "speed_backbones: wrote $RESULT"
