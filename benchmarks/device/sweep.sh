#!/usr/bin/env bash
# A mini leaderboard's sweep on a lent GPU machine (the `device` tool), from the kit make_kit.py writes into .device/:
# SUITE=mini_dinov2 (the default: the DINOv2 sweep, kit `make_kit.py`) or SUITE=mini_swin (the FractalDB Swin, whose
# weights ship in petl/weights: kit `make_kit.py data`), into benchmarks/results/$SUITE/runs.
# SWEEPS processes (one torch thread each) loop over METHODS, each pass skipping finished runs, until DEADLINE
# seconds have passed; then every sweep is stopped (a run cut short leaves no result.json and trains again
# elsewhere) and the files of the runs that finished are packed into $OUT/runs.tgz, with the sweeps' logs and
# the data fingerprints (compare with benchmarks/results/mini_selection/fingerprints.txt).  The two archives are
# also re-packed every 60 s, so a call the device's time limit cuts off still brings back what had finished.
# Back here:
#   tar xzf <files_at>/runs.tgz -C /tmp/gpu && benchmarks/copy_finished_runs.sh /tmp/gpu benchmarks/results/$SUITE/runs
#
#   METHODS_LIST="lora bitfit" DEADLINE=525 SWEEPS=15 bash benchmarks/device/sweep.sh     (on the device machine)
#   SUITE=mini_swin DEADLINE=525 SWEEPS=15 bash benchmarks/device/sweep.sh                (the Swin's rows left)
#
# A sweep stops early once a pass leaves nothing of its methods to train (`petl-bench ... dry_run=true` lists no
# `todo` run and no cell still searching), and the call moves on when every sweep has.  SPEED_UNTIL=N (seconds
# from the start) then spends what is left before N on `petl-bench speed device=cuda options_for=lora`
# (issue 38's speed_cuda.md, ViT-B/16 at 224, batch 64; SPEED_ARGS adds keys, e.g. "rounds=3"), written to
# $OUT/speed_cuda.md if it finishes in time.
#
# Measured on an H200 (2026-11-26): 15 sweeps finished 247 runs in 525 s; .device/done.tgz, if present, holds
# finished runs not yet committed (a tar.gz of their folders, in the one-level layout: mini-digits/lora/seed0/...),
# unpacked first so that they are skipped.
set -u
DEADLINE=${DEADLINE:-500}
SWEEPS=${SWEEPS:-15}
SUITE=${SUITE:-mini_dinov2}
OUTDIR=benchmarks/results/$SUITE/runs
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .device/whl/*.whl || exit 3
if [ "$SUITE" = mini_dinov2 ]; then  # the DINOv2 weights cache, carried compressed; the Swin's ship in petl/weights
    mkdir -p /tmp/petlcache/weights && cp .device/cache/weights/*.json /tmp/petlcache/weights/ \
        && python3 benchmarks/device/unpack_weights.py /tmp/petlcache/weights/vit_small_patch14_dinov2_imgfocus.safetensors || exit 4
fi
export PYTHONPATH=/tmp/site:$PWD PETL_CACHE_DIR=/tmp/petlcache PETL_FASHION_MNIST_DIR=$PWD/.device/fmnist PYTHONUNBUFFERED=1
# Without METHODS_LIST: the suite's experiments in mini_sweep.sh's cheapest-first order (finished cells are skipped).
printf '#!/bin/sh\nexec python3 -m petl.cli.bench "$@"\n' > /tmp/petl-bench && chmod +x /tmp/petl-bench
METHODS_LIST=${METHODS_LIST:-$(PETL_BENCH=/tmp/petl-bench SUITE=$SUITE bash benchmarks/mini_sweep.sh --plan)} || exit 6
read -r -a METHODS <<< "$(echo $METHODS_LIST)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, timm, peft; print('torch', torch.__version__, 'timm', timm.__version__, 'peft', peft.__version__); assert torch.cuda.is_available()" || exit 5
(python3 benchmarks/mini_fingerprints.py > "$OUT/fingerprints.txt" 2>&1 &)
if [ -f .device/done.tgz ]; then tar xzf .device/done.tgz -C "$OUTDIR"; fi
sleep 1 && touch /tmp/start_marker  # every file newer than this is this call's
mkdir -p /tmp/logs
end=$((SECONDS + DEADLINE))
left() {  # runs of METHODS not finished yet: `todo` ones, `later` cells still searching; a failed dry run counts
    for m in "${METHODS[@]}"; do
        python3 -m petl.cli.bench suite=$SUITE methods="$m" output_dir=$OUTDIR dry_run=true || echo "todo ?"
    done | grep -c "^todo\|^later"
}
sweep() {
    while [ $SECONDS -lt $end ]; do
        for m in "${METHODS[@]}"; do
            [ $SECONDS -lt $end ] || break
            OMP_NUM_THREADS=1 python3 -m petl.cli.bench suite=$SUITE methods="$m" output_dir=$OUTDIR report=false
        done
        [ "$(left)" -gt 0 ] || break
    done
}
for i in $(seq 1 "$SWEEPS"); do
    sweep >> "/tmp/logs/$i.log" 2>&1 &
    sleep 3  # let each sweep lock its run before the next one looks
done
pack() {  # this call's files so far into $OUT/runs.tgz (replaced whole), so that a call cut off by the device's
    # time limit still brings back what finished; copy_finished_runs.sh takes only runs with a result.json
    (cd $OUTDIR && find . -newer /tmp/start_marker -type f ! -name '*.safetensors' ! -name checkpoint.pt \
        ! -name .petl.lock ! -name model.json > /tmp/newfiles && tar czf /tmp/runs.tgz -T /tmp/newfiles \
        && mv /tmp/runs.tgz "$OUT/runs.tgz" && wc -l < /tmp/newfiles)
    tar czf /tmp/logs.tgz -C /tmp logs && mv /tmp/logs.tgz "$OUT/logs.tgz"
}
last_pack=$SECONDS
while [ $SECONDS -lt $end ] && [ -n "$(jobs -r)" ]; do
    sleep 5
    if [ $((SECONDS - last_pack)) -ge 60 ]; then pack > /dev/null; last_pack=$SECONDS; fi
done
echo "sweeps ended at ${SECONDS} s; runs left: $(left)"
pkill -TERM -f petl.cli.bench; sleep 5; pkill -KILL -f petl.cli.bench; wait
pack
if [ -n "${SPEED_UNTIL:-}" ] && [ $((SPEED_UNTIL - SECONDS)) -gt 60 ]; then
    echo "speed: $((SPEED_UNTIL - SECONDS)) s left for petl-bench speed"
    timeout $((SPEED_UNTIL - SECONDS)) python3 -m petl.cli.bench speed device=cuda options_for=lora ${SPEED_ARGS:-} \
        out="$OUT/speed_cuda.md" > /tmp/logs/speed.log 2>&1
    echo "speed: exit $? at ${SECONDS} s"; tail -5 /tmp/logs/speed.log
    pack > /dev/null
fi
