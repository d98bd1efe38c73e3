#!/usr/bin/env bash
# A lent GPU session's one call (issue 49), in BUDGET seconds (470 by default: under 8 minutes, a last pytest phase
# killed 30 s after its deadline included): the mixed-batch tables first, then the suite, each part to its deadline
# as in the two scripts it runs.
#   tables/  gpu_tables.sh without its two speed parts (speed_cuda.md, measured before, stays as committed; its
#            stand-in saying "not finished" is removed): multitask_cuda.md, multitask_cuda_profile.md,
#            multitask_graph_cuda.md, serve_cuda.md, gpu_tables.log.  TABLES seconds at most (140; on the H200 at
#            e1d6580 the three parts took 21, 19 and 32 s), the parts ending by MULTITASK_END, GRAPH_END, SERVE_END
#            (50, 90, 135 s from the start);
#   tests/   gpu_tests.sh with every second left: gpu_tests.log, summary.txt (its three phases took 66, 135 and 147 s
#            there; the suite is half as large again since, so its last phase, the CPU's tests, may be cut off: the
#            device README says why and what runs first).
# The two scripts' raw archives (the tables' parts.tar.gz, the tests' junit.tar.gz) are packed into raw.tar.gz: the
# device tool brings back at most 8 files from $OUT, and these are 8.
#
# Here, once: PYTHONPATH=. python benchmarks/device/make_kit.py wheels data    (.device/: the wheels the machine
# lacks and the mini tasks' Fashion-MNIST)
# The device call, whose device time (about 10 minutes with the machine's start) leaves no room for another:
#   run(command="bash benchmarks/device/gpu_session.sh", carry=[".device"], timeout_s=580)
# then copy tables/*.md to benchmarks/results/ and read tests/summary.txt.  A table (or the profile) that ends in
# "**Partial table**" or says "Not measured" lacks rows the committed one may hold: `git diff` it before keeping it.
#
# `bash benchmarks/device/gpu_session.sh --cpu` runs both scripts in their --cpu modes (see each), the same way.
# With KIT=1 and a python like the machine's on PATH, the call rehearsed here, kit and all (README.md here).
set -u
OUT=${OUT:-/tmp/petl_gpu_session}
BUDGET=${BUDGET:-470}
TABLES=${TABLES:-140}
HERE=$(dirname "$0")
mkdir -p "$OUT/tables" "$OUT/tests"
START=$SECONDS

OUT=$OUT/tables BUDGET=$TABLES SPEED_LORA_END=0 SPEED_METHODS_END=0 MULTITASK_END=${MULTITASK_END:-50} \
    GRAPH_END=${GRAPH_END:-90} SERVE_END=${SERVE_END:-135} bash "$HERE/gpu_tables.sh" "$@"
tables=$?
rm -f "$OUT/tables/speed_cuda.md"

left=$((BUDGET - (SECONDS - START)))
OUT=$OUT/tests BUDGET=$left bash "$HERE/gpu_tests.sh" "$@"
tests=$?

raw=()
for archive in tables/parts.tar.gz tests/junit.tar.gz; do
    [ -f "$OUT/$archive" ] && raw+=("$archive")
done
if [ ${#raw[@]} -gt 0 ]; then
    tar -czf "$OUT/raw.tar.gz" -C "$OUT" "${raw[@]}" && (cd "$OUT" && rm "${raw[@]}")
fi
echo "gpu_session.sh: tables exit $tables, tests exit $tests, done at $((SECONDS - START)) s of $BUDGET"
# The scripts' own exit statuses, the first that is not 0: 3 (no kit) or 5 (no GPU) say the call was wasted.
[ "$tables" != 0 ] && exit "$tables"
exit "$tests"
