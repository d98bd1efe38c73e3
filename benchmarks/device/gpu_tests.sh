#!/usr/bin/env bash
# The suite on the lent GPU machine (issue 49: the suite passes on a GPU machine), in one call of at most BUDGET
# seconds (480 by default), telling what it found even when cut off.  Three pytest phases, each to its deadline
# (seconds from the start: CUDA_END, GPU_END, REST_END, as shares of BUDGET, each at least KILL_AFTER + 5 s before
# its end; a phase that ends early leaves its time to the next):
#   cuda  the tests marked cuda (`pytest -m cuda`: petl on the GPU itself), one process, first;
#   gpu   the other tests of the folders whose code picks the GPU where there is one (training, serving,
#         predicting, the commands run in-process and their faults, the bench, timm autocast), under pytest-xdist:
#         WORKERS processes (8), THREADS torch threads each (2; 16 cores), one test file per worker
#         (DIST=loadfile: a file's fixtures are built once; xdist 3.5+ hands out the files with most tests first);
#   rest  every other test (the methods' and references' tiny models, data, docs: the CPU's code), the same way,
#         with what time is left: where the call runs short, what is cut is what CI runs the same way on a CPU.
# Every test's line is written to $OUT/gpu_tests.log as it ends (-v), each phase's slowest 30 follow it
# (--durations=30); pytest-timeout (carried in the kit) fails a test that runs past TEST_TIMEOUT seconds (180), and a
# phase past its deadline gets SIGINT, on which pytest still prints what failed and writes its JUnit XML.  $OUT holds
# three files (the device tool brings back at most 8): gpu_tests.log; summary.txt (per phase: exit status, seconds,
# pytest's count line, every test that failed or errored, the slowest tests); junit.tar.gz (one JUnit XML a phase).
#
# Here, once: PYTHONPATH=. python benchmarks/device/make_kit.py wheels    (.device/whl/: what the machine lacks; with
# `data` too, .device/fmnist/, the mini tasks' Fashion-MNIST, which the committed-results tests read)
# The device call (the `run` tool; the machine has torch, timm, peft, accelerate, pytest and pytest-xdist):
#   run(command="bash benchmarks/device/gpu_tests.sh", carry=[".device"], timeout_s=560)
# Without $OUT the files go to /tmp/petl_gpu_tests.
#
# `bash benchmarks/device/gpu_tests.sh --cpu` runs the same phases here, on a handful of tiny tests (CUDA_TESTS,
# GPU_TESTS and REST_TESTS, pytest arguments, choose them), one process, with the python on PATH (or $PYTHON),
# installing nothing (KIT=1: the kit, as on the device; kit.sh): the script's logic, tested by
# tests/bench/test_gpu_tests.py.
set -u
# The deadlines count from here: the install and the checks below are inside BUDGET, as the call's timeout is.
START=$SECONDS
MODE=gpu
[ "${1:-}" = "--cpu" ] && MODE=cpu
OUT=${OUT:-/tmp/petl_gpu_tests}
mkdir -p "$OUT"
LOG="$OUT/gpu_tests.log"
SUMMARY="$OUT/summary.txt"
WORK=$(mktemp -d)  # each phase's own output and JUnit XML; packed into $OUT/junit.tar.gz at the end
: > "$LOG"
: > "$SUMMARY"
PYTHON=${PYTHON:-python3}
source "$(dirname "$0")/kit.sh"
# The folders and files whose code runs on the GPU where there is one: petl-run, -pretrain, -bench, -predict and
# -serve train and answer there, in-process in tests/reliability, tests/cli, tests/bench and tests/store too (in the
# rest phase until 2026-11-29, where the suite's growth, 4,668 tests to 6,944, would leave them to be cut off last).
GPU_FILES="tests/training tests/deploy tests/reliability tests/cli tests/bench tests/store"
GPU_FILES="$GPU_FILES tests/methods/test_lora_ops.py tests/methods/test_timm_api.py"
if [ "$MODE" = gpu ]; then
    BUDGET=${BUDGET:-480}
    WORKERS=${WORKERS:-8}
    use_kit "$LOG"
    MACHINE="GPU $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1), $(nproc) cores"
    "$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'" >> "$LOG" 2>&1 || exit 5
    # The files that use the marker: collecting only them starts the first phase in seconds.
    CUDA_TESTS=${CUDA_TESTS:-$(grep -rl --include='test_*.py' 'pytest.mark.cuda' tests | sort | tr '\n' ' ')}
    GPU_TESTS=${GPU_TESTS:-$GPU_FILES}
    REST_TESTS=${REST_TESTS:-tests $(for f in $GPU_FILES; do printf -- '--ignore=%s ' "$f"; done)}
else
    BUDGET=${BUDGET:-300}  # a pytest process starts in seconds on two quiet cores, in 30 on busy ones
    MACHINE="CPU only, $(nproc) cores"
    WORKERS=${WORKERS:-0}
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    [ "${KIT:-0}" = 1 ] && use_kit "$LOG"
    CUDA_TESTS=${CUDA_TESTS:-tests/deploy/test_inference_precision.py}
    GPU_TESTS=${GPU_TESTS:-tests/training/test_learning.py -k three_ways}
    REST_TESTS=${REST_TESTS:-tests/training/test_engine.py -k epoch_sampler}
fi
THREADS=${THREADS:-2}
DIST=${DIST:-loadfile}
TEST_TIMEOUT=${TEST_TIMEOUT:-180}
export PYTHONUNBUFFERED=1
# A phase is killed KILL_AFTER seconds after its deadline where SIGINT did not end it: every deadline leaves that and
# 5 s for the summary and the archive inside BUDGET, which the device call's timeout counts on.
KILL_AFTER=30
share() { local end=$((BUDGET * $1 / 100)) last=$((BUDGET - KILL_AFTER - 5)); echo $((end < last ? end : last)); }
CUDA_END=${CUDA_END:-$(share 35)}
GPU_END=${GPU_END:-$(share 90)}
REST_END=${REST_END:-$(share 97)}

left() { echo $(($1 - (SECONDS - START))); }

{
    echo "gpu_tests.sh --$MODE, commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' plus changes'), budget $BUDGET s"
    echo "$MACHINE"
    "$PYTHON" - <<'EOF'
import importlib.metadata as m
names = ("torch", "timm", "peft", "accelerate", "pytest", "pytest-xdist", "pytest-timeout")
found = []
for name in names:
    try:
        found.append(f"{name} {m.version(name)}")
    except m.PackageNotFoundError:
        found.append(f"{name} missing")
print(", ".join(found))
EOF
} 2>&1 | tee -a "$SUMMARY" >> "$LOG"
TIMEOUT_ARGS=()
if [ "$TEST_TIMEOUT" != 0 ] && "$PYTHON" -c "import pytest_timeout" 2> /dev/null; then
    TIMEOUT_ARGS=(--timeout "$TEST_TIMEOUT")
else
    echo "no per-test timeout (TEST_TIMEOUT=$TEST_TIMEOUT, or pytest-timeout missing): only the phases' deadlines" \
        | tee -a "$SUMMARY" >> "$LOG"
fi
XDIST=no
"$PYTHON" -c "import xdist" 2> /dev/null && XDIST=yes

phase() {  # phase NAME END MARKERS PYTEST-ARGS...: pytest until END (s from the start); log status and seconds
    local name=$1 end=$2 markers=$3 budget began status
    shift 3
    budget=$(left "$end")
    if [ "$budget" -lt 10 ]; then
        echo "$name: skipped, no time left before its deadline ($end s)" | tee -a "$SUMMARY" >> "$LOG"
        return
    fi
    local parallel=() threads=()
    if [ "$name" != cuda ] && [ "$WORKERS" -gt 0 ] && [ "$XDIST" = yes ]; then
        parallel=(-n "$WORKERS" --dist "$DIST")
        threads=(env "OMP_NUM_THREADS=$THREADS" "MKL_NUM_THREADS=$THREADS")
    fi
    # -v -v: pyproject's addopts say -q; the net is one line per test.  -ra: the reasons of what did not pass,
    # not the captured output of what did.
    local command=("$PYTHON" -m pytest -p no:cacheprovider -p no:benchmark -v -v -ra --durations=30
        "${TIMEOUT_ARGS[@]}" "${parallel[@]}" --junitxml "$WORK/$name.xml" -m "$markers" "$@")
    echo "== $name: ${command[*]} (deadline $end s, $budget s left)" >> "$LOG"
    began=$SECONDS
    # SIGINT at the deadline: pytest stops, lists what failed so far and writes its XML; killed 30 s later if not.
    "${threads[@]}" timeout -s INT -k "$KILL_AFTER" "$budget" "${command[@]}" 2>&1 | tee "$WORK/$name.out" >> "$LOG"
    status=${PIPESTATUS[0]}
    local said="exit $status"
    [ "$status" = 124 ] && said="cut off at its deadline"
    [ "$status" = 137 ] && said="killed 30 s after its deadline"
    {
        echo "$name: $said after $((SECONDS - began)) s (deadline $end s, at $((SECONDS - START)) s)"
        grep -E '^=+ .*[0-9.]+s( \([0-9:]+\))? =+$' "$WORK/$name.out" | tail -1
        # Failed or errored as each test ended (-v), whether or not pytest got to its summary.
        grep -E '(FAILED|ERROR)' "$WORK/$name.out" | grep -oE '[^ ]+::[^ ]+' | sort -u | sed 's/^/  not passed: /'
        grep -E '^(FAILED|ERROR) ' "$WORK/$name.out" | sed 's/^/  /'
        # Where SIGINT found a phase run in one process: the test that was running (under xdist, the controller).
        grep -B1 'to show a full traceback on KeyboardInterrupt' "$WORK/$name.out" | head -1 | grep 'test_' \
            | sed 's/^/  cut off in: /'
        sed -n '/slowest .*durations/,/^=/p' "$WORK/$name.out" | grep -E '^[0-9.]+s ' | awk '$1 + 0 >= 1' \
            | head -10 | sed 's/^/  slow: /'
    } >> "$SUMMARY"
}

phase cuda "$CUDA_END" cuda $CUDA_TESTS
phase gpu "$GPU_END" "not cuda" $GPU_TESTS
phase rest "$REST_END" "not cuda" $REST_TESTS

echo "done at $((SECONDS - START)) s of $BUDGET" | tee -a "$SUMMARY" >> "$LOG"
XML=$(cd "$WORK" && ls -- *.xml 2> /dev/null)
[ -n "$XML" ] && tar -czf "$OUT/junit.tar.gz" -C "$WORK" $XML
rm -r "$WORK"
cat "$SUMMARY"
