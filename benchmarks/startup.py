"""Start-up cost: `import timm`, `import petl` and each console script's `--help`, in fresh processes.

    python benchmarks/startup.py [--repeats 5] [--label after] [--root CHECKOUT]

Each measurement starts a new interpreter (the one running this script) and times it from start to exit,
so it includes Python's own start-up; the median of ``--repeats`` runs is printed as a Markdown table,
with the load average before and after (the machine may be shared: compare rows measured together).
The commands are read from pyproject.toml's ``[project.scripts]`` and called through their entry point
(``module:function`` with ``sys.argv`` set), so the script measures whatever layout the checkout has;
``--root`` measures another checkout (an older commit's worktree) with the same script.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def entry_points(root: Path) -> dict[str, str]:
    """The console scripts of ``root``'s pyproject.toml: name -> ``module:function``."""
    with open(root / "pyproject.toml", "rb") as file:
        return tomllib.load(file)["project"]["scripts"]


def seconds(code: str, repeats: int, root: Path) -> float:
    """The median wall time of ``python -c CODE`` in ``root`` over ``repeats`` fresh processes."""
    times = []
    env = {**os.environ, "PYTHONPATH": str(root)}
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], cwd=root, env=env, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def help_code(name: str, target: str) -> str:
    """Python code that runs one console script's ``--help`` as its wrapper would."""
    module, function = target.split(":")
    return (
        f"import sys; sys.argv = [{name!r}, '--help']; from {module} import {function}\n"
        f"try:\n    {function}()\nexcept SystemExit:\n    pass"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="fresh processes per row (median)")
    parser.add_argument("--label", default="", help="a column heading, e.g. before / after")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to measure (default: this one)")
    args = parser.parse_args()
    rows = [("python -c pass", "pass"), ("import timm", "import timm"), ("import petl", "import petl")]
    rows += [(f"{name} --help", help_code(name, target)) for name, target in entry_points(args.root).items()]
    load_before = os.getloadavg()[0]
    results = [(label, seconds(code, args.repeats, args.root)) for label, code in rows]
    load_after = os.getloadavg()[0]
    print(f"| command | median s {args.label} |")
    print("| --- | --- |")
    for label, value in results:
        print(f"| `{label}` | {value:.2f} |")
    print(f"\n{args.repeats} fresh processes per row, {sys.executable} (Python {sys.version.split()[0]}), ")
    print(f"{os.cpu_count()} CPUs; 1-minute load average {load_before:.1f} before, {load_after:.1f} after.")


if __name__ == "__main__":
    main()
