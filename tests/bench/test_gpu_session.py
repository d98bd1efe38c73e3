"""benchmarks/device/gpu_session.sh, a lent GPU session's one call, run here in its --cpu mode with every part past
its deadline: what it checks is the layout it brings back (the device tool returns at most 8 files, 2 folders down).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "device" / "gpu_session.sh"
ENDS = ("MULTITASK_END", "GRAPH_END", "SERVE_END", "CUDA_END", "GPU_END", "REST_END")


def test_the_tables_then_the_tests_in_at_most_eight_files(tmp_path):
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    env = {**os.environ, "OUT": str(tmp_path), "PATH": path, "PYTHON": sys.executable, **dict.fromkeys(ENDS, "0")}
    done = subprocess.run(["bash", str(SCRIPT), "--cpu"], cwd=REPO, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert files == ["raw.tar.gz", "tables/gpu_tables.log", "tests/gpu_tests.log", "tests/summary.txt"]
    # The speed parts are not run, and their stand-in table is not brought back to replace the committed one.
    log = (tmp_path / "tables" / "gpu_tables.log").read_text()
    assert "speed_lora: skipped" in log and "multitask: skipped" in log and "serve: skipped" in log
    assert "cuda: skipped" in (tmp_path / "tests" / "summary.txt").read_text()
    with tarfile.open(tmp_path / "raw.tar.gz") as archive:
        assert archive.getnames() == ["tables/parts.tar.gz"]
    assert "gpu_session.sh: tables exit 0, tests exit 0, done at" in done.stdout
