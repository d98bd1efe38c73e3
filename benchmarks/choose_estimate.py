"""Is the cost ``petl-bench suite=choose data=...`` says before training within a factor of 2 of the real time?

    OMP_NUM_THREADS=1 python benchmarks/choose_estimate.py [rounds]

Runs the end-to-end test of the choose suite (``test_choose_runs_the_suite_on_a_folder_and_names_a_run_that_predicts``:
a generated 3-class folder, the tiny random-init ViT at 32 px, linear / LoRA / full, 2 seeds, one epoch: 4
selection trials and 6 final runs) ``rounds`` times (default 1) in a fresh pytest process each, and reads what
the sweep recorded in its results folder's ``estimate.json``: the estimate made before training (``seconds``)
and the time the runs took (``measured_seconds``, the sweep's wall time from its first run to its last).
Prints both and their ratio per round; exits 1 when a ratio falls outside [0.5, 2].  A timing is asserted
here, not in a test: a shared machine's load can change between the estimate and the runs.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from petl.bench.estimate import ESTIMATE_FILE, read_estimate

ROOT = Path(__file__).resolve().parents[1]
TEST = "test_choose_runs_the_suite_on_a_folder_and_names_a_run_that_predicts"
FACTOR = 2.0


def one_round() -> tuple[float, float]:
    """Run the test once; the estimate and the measured seconds its sweep recorded."""
    test_file = next(ROOT.glob("tests/**/test_choose.py"))
    with tempfile.TemporaryDirectory(prefix="choose-estimate-") as base:
        command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", f"--basetemp={base}"]
        subprocess.run([*command, f"{test_file}::{TEST}"], cwd=ROOT, check=True)
        (path,) = Path(base).rglob(ESTIMATE_FILE)
        record = read_estimate(path.parent)  # the file's one reader, which checks it
    return float(record["seconds"]), float(record["measured_seconds"])


def main(argv: list[str]) -> int:
    rounds = int(argv[0]) if argv else 1
    outside = 0
    for index in range(rounds):
        estimate, measured = one_round()
        ratio = measured / estimate
        ok = 1 / FACTOR <= ratio <= FACTOR
        outside += not ok
        print(f"round {index + 1}: estimated {estimate:.1f} s, measured {measured:.1f} s, measured/estimate {ratio:.2f}"
              f" ({'within' if ok else 'OUTSIDE'} a factor of {FACTOR:g})")  # fmt: skip
    return 1 if outside else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
