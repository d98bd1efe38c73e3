"""benchmarks/device/gpu_session.sh, a lent GPU session's one call, run here in its --cpu mode with every part past
its deadline: what it checks is the layout it brings back (the device tool returns at most 8 files, 2 folders down),
and that what the call sends fits the device tool's limit.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

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


# A device call sends the working tree (its tracked and untracked, not ignored files) and the carried paths, 64 MiB
# together, counted as tar counts them; a larger call is refused whole, and a lease has time for one call.  The kit
# the session carries, `make_kit.py wheels data`'s .device/ (the wheels the image lacks, the sparse Fashion-MNIST),
# is 9.3 MB so counted (26 files, 2026-11-29).  The tree was 51.2 MB at 828f968, 22 MB more than three days before,
# most of it committed runs under benchmarks/results/.
CALL_LIMIT = 64 * 2**20
SESSION_KIT = 9.3e6


def _tar_counted(root: Path, names: list[str]) -> int:
    """Bytes of a tar of ``names``: a 512-byte header for each file and folder, each file padded to 512."""
    files = [root / name for name in names if (root / name).is_file()]
    folders = {parent for path in files for parent in path.relative_to(root).parents if parent != Path(".")}
    return sum(512 + -(-path.stat().st_size // 512) * 512 for path in files) + 512 * len(folders)


def test_the_tree_and_the_session_kit_fit_one_device_call():
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    listed = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    names = subprocess.run(listed, cwd=REPO, capture_output=True, text=True, check=True).stdout.split("\0")
    tree = _tar_counted(REPO, [name for name in names if name])
    assert tree + SESSION_KIT < CALL_LIMIT, (
        f"the working tree is {tree / 1e6:.1f} MB tar-counted: with the session's {SESSION_KIT / 1e6:.1f} MB kit "
        f"it passes the {CALL_LIMIT / 1e6:.1f} MB a device call may send, and gpu_session.sh's call would be refused; "
        "keep large files (committed runs, weights) out of the tree, or carry less (benchmarks/device/README.md)"
    )


def test_the_session_kit_is_made_by_the_command_its_readme_gives():
    """`make_kit.py wheels data` (README.md here, gpu_session.sh's set-up line) was refused as an unknown pair."""
    sys.path.insert(0, str(REPO / "benchmarks" / "device"))
    try:
        import make_kit
    finally:
        sys.path.pop(0)
    assert make_kit.requested(["wheels", "data"]) == make_kit.requested(["data"]) == {"data", "wheels"}
    assert make_kit.requested([]) == {"weights", "data", "wheels"} and make_kit.requested(["wheels"]) == {"wheels"}
    with pytest.raises(SystemExit, match="'weights'"):
        make_kit.requested(["weights"])
