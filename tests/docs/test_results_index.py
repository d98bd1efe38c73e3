"""benchmarks/results/README.md names every committed result file with the command that made it (issue 39, item 6).

Its tables' first column names files relative to benchmarks/results/ (``mini_selection/leaderboard.{md,csv,html}``:
one name per brace choice) or folders (``mini_selection/convergence/``: everything under it).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path, PurePosixPath

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
INDEX = RESULTS / "README.md"


def expand_braces(name: str) -> list[str]:
    """``a.{md,csv}`` -> ``[a.md, a.csv]`` (one brace group, as the README writes them)."""
    found = re.search(r"\{([^{}]*)\}", name)
    if not found:
        return [name]
    return [name[: found.start()] + choice + name[found.end() :] for choice in found.group(1).split(",")]


def indexed() -> tuple[set[str], set[str]]:
    """The files and the folders (ending in ``/``) the README's tables name in their first column."""
    files: set[str] = set()
    folders: set[str] = set()
    for line in INDEX.read_text(encoding="utf-8").splitlines():
        cells = line.split("|")
        if not line.startswith("|") or len(cells) < 3 or set(cells[1].strip()) <= {"-"} or cells[1].strip() == "File":
            continue
        for name in re.findall(r"`([^`]+)`", cells[1]):
            for one in expand_braces(name):
                (folders if one.endswith("/") else files).add(one)
    return files, folders


def committed() -> list[str]:
    """Files git tracks under benchmarks/results/, relative to it, outside the leaderboards' runs/ folders."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(
        ["git", "ls-files", "-z", "--", "benchmarks/results"], cwd=REPO, capture_output=True, text=True, check=True
    )
    names = [str(PurePosixPath(p).relative_to("benchmarks/results")) for p in out.stdout.split("\0") if p]
    # The runs under <suite>/runs/ are the leaderboard's raw data, one row for the folder.
    return [n for n in names if "runs" not in PurePosixPath(n).parts and n != "README.md"]


def test_the_index_names_every_committed_result_file():
    files, folders = indexed()
    assert files and folders, f"{INDEX}: no table of files found"
    missing = [n for n in committed() if n not in files and not any(n.startswith(f) for f in folders)]
    assert not missing, f"{INDEX} does not name {missing}: add a row with the command that made each"


def test_every_file_the_index_names_exists():
    files, folders = indexed()
    stale = sorted(n for n in files if not (RESULTS / n).is_file())
    stale += sorted(n for n in folders if not (RESULTS / n).is_dir())
    assert not stale, f"{INDEX} names {stale}, which benchmarks/results/ does not hold"


def test_each_leaderboard_folder_has_its_runs_and_report_rows():
    # One folder per leaderboard (named as its suite): the README says which command made its runs and its report.
    files, folders = indexed()
    for suite in sorted(p.parent.name for p in RESULTS.glob("*/leaderboard.md")):
        assert f"{suite}/runs/" in folders, suite
        assert {f"{suite}/leaderboard.{ext}" for ext in ("md", "csv", "html")} <= files, suite


def test_every_row_says_what_made_it():
    rows = [line.split("|") for line in INDEX.read_text(encoding="utf-8").splitlines() if line.startswith("| `")]
    assert rows and all(len(cells) >= 4 and cells[2].strip() for cells in rows), f"{INDEX}: a row with no command"


def test_brace_expansion():
    assert expand_braces("a/leaderboard.{md,csv}") == ["a/leaderboard.md", "a/leaderboard.csv"]
    assert expand_braces("a/pareto.png") == ["a/pareto.png"]
