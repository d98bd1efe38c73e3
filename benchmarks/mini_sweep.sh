#!/usr/bin/env bash
# Runs, or resumes, the committed mini leaderboard (configs/suites/mini_selection.yaml), or with SUITE=mini_dinov2
# the same protocol on the DINOv2 ViT-S/14 backbone at 56 px (into benchmarks/results/mini_dinov2/runs), or with
# SUITE=mini_swin on petl's FractalDB Swin, the nine seed methods only (into benchmarks/results/mini_swin/runs).
#
# Two sweeps share one results folder, one torch thread each (on the 2-core CPU, two one-thread processes train
# 1.04x the images of one two-thread process and overlap each other's evaluation:
# benchmarks/results/threads_cpu.md).  Each run's folder lock sends the second
# sweep to another run, so they never train the same thing.  Methods go one at a time, cheapest first, so a
# session that stops early leaves whole leaderboard rows behind; a cell whose search is still running in the
# other sweep shows as "waiting", and the next pass trains its finals.  Run it again to go on: finished runs
# (result.json present) are skipped.
#
#   benchmarks/mini_sweep.sh [--plan] [METHOD ...]   (default: every experiment of the suite;
#                                                      --plan prints the methods in sweep order and stops)
#
# SWEEPS=N runs N sweeps side by side instead of two (on a GPU machine with 16 cores, 12 to 15 kept an H100 busy;
# benchmarks/results/mini_selection/README.md); PETL_BENCH names the command (default petl-bench).
set -u
cd "$(dirname "$0")/.."
PETL_BENCH=${PETL_BENCH:-petl-bench}
SWEEPS=${SWEEPS:-2}
SUITE=${SUITE:-mini_selection}
OUT=benchmarks/results/$SUITE/runs  # one folder per leaderboard, named as its suite
PLAN=false
if [ "${1:-}" = --plan ]; then PLAN=true; shift; fi
# The sweep's order, not its membership (that is the suite's: `petl-bench list suite=...`): the nine seed
# experiments cheapest first, then issue 11's methods, then the wave-2 ones (side-tuning DTL, LST, HST, LAST;
# GPS; SNF; NOAH, whose one search per task costs more than its training), which joined the suites later.  An
# experiment of the suite not named here runs after these, in the suite's order; a name here that the suite
# does not run is skipped (tests/bench/test_experiment_lists.py checks this list names the leaderboard's).
CHEAPEST_FIRST=(linear mlp partial lora adapter_parallel adapter_sequential vpt_deep full vpt_shallow
    bitfit ln ssf fact repadapter hydra adapter_plus sct convpass dora ia3 dtl lst hst gps last snf noah)
METHODS=("$@")
if [ ${#METHODS[@]} -eq 0 ]; then
    IN_SUITE=$("$PETL_BENCH" list suite="$SUITE") || exit
    IN_SUITE=" $(echo $IN_SUITE) "  # one line, a space either side of every name
    QUEUED=" "
    for method in "${CHEAPEST_FIRST[@]}" $IN_SUITE; do
        case "$IN_SUITE" in *" $method "*) ;; *) continue ;; esac
        case "$QUEUED" in *" $method "*) continue ;; esac
        METHODS+=("$method")
        QUEUED+="$method "
    done
fi
if $PLAN; then
    printf '%s\n' "${METHODS[@]}"
    exit 0
fi

sweep() {
    for method in "${METHODS[@]}"; do
        OMP_NUM_THREADS=1 "$PETL_BENCH" suite="$SUITE" methods="$method" output_dir="$OUT" report=false
    done
}

# Two passes: the second trains the finals that were waiting for another sweep's last trial.
LOGS=runs/${SUITE/mini_selection/mini}_sweep  # outside the committed results: progress bars, not results
mkdir -p "$LOGS"
for pass in 1 2; do
    echo "== pass $pass: $(date -u +%FT%TZ)"
    for i in $(seq 1 "$SWEEPS"); do
        sweep >> "$LOGS/$i.log" 2>&1 &
        sleep 10  # let each sweep lock its run before the next one looks
    done
    wait
done
echo "== done: $(date -u +%FT%TZ)"
