"""Every dotted ``petl.x.y`` name that a config, a test comment or a doc cites names something that exists."""

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Not after "{": ${petl.slug:...} is an OmegaConf resolver, not a Python name.
NAME = re.compile(r"(?<![\w./{-])petl(?:\.[A-Za-z_]\w*)+(?![\w<])")
# Where a name is cited: config files, the comments of the tests, the docs (generated results are left out:
# they record what a past commit wrote).
SOURCES = [
    *sorted((ROOT / "configs").rglob("*.yaml")),
    *sorted((ROOT / "petl" / "conf").rglob("*.yaml")),
    *sorted((ROOT / "tests").rglob("*.py")),
    *sorted(p for p in ROOT.glob("*.md")),
    *sorted((ROOT / "docs").rglob("*.md")),
    *sorted((ROOT / "benchmarks").glob("*.md")),
    *sorted((ROOT / "petl").rglob("README.md")),
]


def cited(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".py":  # comments only: code is checked by running it
        text = "\n".join(line.split("#", 1)[1] for line in text.splitlines() if "#" in line)
    return sorted({m.rstrip(".") for m in NAME.findall(text)})


# pyproject's package-dir installs folders outside petl/ as its packages (configs/ as petl.configs): an install
# imports them, a checkout on PYTHONPATH (the lent GPU machine's) does not, so they resolve as the folders.
def mapped_packages() -> dict[str, str]:
    import tomllib  # Python 3.11's, as tests/bench/test_harness.py imports it

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


def resolves(name: str) -> bool:
    if folder := mapped_packages().get(name):
        return (ROOT / folder).is_dir()
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                target = getattr(target, attr)
        except AttributeError:
            return False
        return True
    return False


def test_the_scan_finds_names_and_catches_a_stale_one():
    assert "petl.data.mini.EPOCHS" in cited(ROOT / "configs" / "suites" / "mini.yaml")
    assert resolves("petl.data.mini.EPOCHS") and not resolves("petl.run.config.SUITE_EPOCHS")


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cited_petl_name_exists(path):
    missing = [name for name in cited(path) if not resolves(name)]
    assert not missing, f"{path.relative_to(ROOT)} cites names that do not exist: {', '.join(missing)}"
