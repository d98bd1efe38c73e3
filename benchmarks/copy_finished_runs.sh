#!/usr/bin/env bash
# Copies the finished runs of a sweep's results folder (each folder holding a result.json) into another one,
# with the files the committed results keep: result.json, metrics.jsonl, config.yaml.  It only reads SRC, so it
# is safe while the sweep writes there: a run writes its result.json last, and under a suite that selects on val
# a final run (seed<k>/ beside a search/ folder) is finished only once the sweep has stamped the selection into
# its result.json, after all the finals of that invocation (petl/bench/protocol.py): until then it is left out.
# Nothing in DST is overwritten: a run already there is skipped, one whose files differ from SRC's is named.
# DST gets the layout petl-bench writes, one folder per task (<family>-<task>/<experiment>/...: mini-digits/lora/...);
# a SRC in the layout before it (<family>/<task>/<experiment>/...: mini/digits/lora/..., a sweep started earlier)
# is copied into that layout too.
#
#   benchmarks/copy_finished_runs.sh SRC_RUNS DST_RUNS
#
# e.g. from a sweep in its own worktree (benchmarks/mini_sweep.sh, "Running it" in its results README):
#   benchmarks/copy_finished_runs.sh ../sweep19/benchmarks/results/mini_dinov2/runs benchmarks/results/mini_dinov2/runs
set -eu
if [ $# -ne 2 ] || [ ! -d "$1" ]; then
    echo "usage: $0 SRC_RUNS DST_RUNS (SRC_RUNS: a results folder holding <task>/<experiment>/.../result.json)" >&2
    exit 2
fi
src=$1 dst=$2
one_level() { sed -E 's#^(mini|vtab|fgvc)/([^/]+)/#\1-\2/#' <<< "$1"; }  # mini/digits/lora/seed0 -> mini-digits/lora/seed0
new=0 kept=0 differ=0
waiting=0
while IFS= read -r run; do
    if [[ $(basename "$run") == seed* ]] && [ -d "$src/$run/../search" ] \
        && ! grep -q '"selection"' "$src/$run/result.json"; then
        waiting=$((waiting + 1))
        continue
    fi
    to=$(one_level "$run")
    if [ -e "$dst/$to/result.json" ]; then
        for name in result.json metrics.jsonl config.yaml; do
            if [ -f "$src/$run/$name" ] && ! cmp -s "$src/$run/$name" "$dst/$to/$name"; then
                echo "differs, left alone: $dst/$to/$name" >&2
                differ=$((differ + 1))
            fi
        done
        kept=$((kept + 1))
        continue
    fi
    mkdir -p "$dst/$to"
    for name in metrics.jsonl config.yaml result.json; do  # result.json last: a copy cut short is not a finished run
        if [ -f "$src/$run/$name" ]; then cp "$src/$run/$name" "$dst/$to/$name"; fi
    done
    new=$((new + 1))
done < <(cd "$src" && find . -name result.json -printf '%h\n' | sed 's#^\./##' | sort)
echo "copied $new finished runs, $kept already in $dst ($differ files differ from $src: named above);" \
    "$waiting final runs left out until their selection is stamped"
