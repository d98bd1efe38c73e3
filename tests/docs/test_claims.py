"""What a doc or a results file names exists: every repository path it cites, every commit it quotes, every flag it
gives a benchmark script, and the counts the home page and contributing.md state.

A claim such as "measured at 36593e9", "`benchmarks/speed_backbones.sh` writes it" or "see `../linear_probe.md`"
is only reproducible when the commit and the file exist in this repository (git's, not the working tree's).
A commit of another repository is written ``owner/name@hash`` (``KMnP/vpt@4410440``) and is not looked up here.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The prose docs, the results' notes and the READMEs of petl/ and tests/ (the leaderboards' generated files are left
# out: tests/bench checks them).
DOCS = sorted(
    {
        ROOT / "README.md",
        *(ROOT / "docs").rglob("*.md"),
        ROOT / "benchmarks" / "README.md",
        ROOT / "benchmarks" / "device" / "README.md",
        *(ROOT / "benchmarks" / "results").glob("*.md"),
        *(ROOT / "benchmarks" / "results").glob("*/README.md"),
        *(ROOT / "petl").rglob("README.md"),
        ROOT / "tests" / "README.md",
    }
)
# A path from the repository root: `benchmarks/...`, `tests/...`, ...; a link `](path)`; a `../path` in backticks.
ROOTED = re.compile(r"(?<![\w./@-])((?:benchmarks|tests|configs|petl|docs)/[\w./{},*-]*[\w/}*])")
LINK = re.compile(r"\]\(([^)#\s]+)\)")
RELATIVE = re.compile(r"`(\.\./[^`\s]+)`")
# A short or long commit hash standing alone: not `owner/name@hash`, not part of a path, a name or a digest.
COMMIT = re.compile(r"(?<![\w/@.=-])([0-9a-f]{7,40})(?![\w-]|\.\w|\.\.)")
# Another repository's commit written out: "github.com/owner/name, commit c188fad".
FOREIGN_COMMIT = re.compile(r"github\.com/[\w.-]+/[\w.-]+,?\s+commit\s+[0-9a-f]{7,40}")
# Paths a doc names that are not this repository's, each with why.
FOREIGN = {
    ("docs/methods/hydra.md", "configs/hydra_both/cifar.yaml"): "extremebird/Hydra's config",
    ("benchmarks/README.md", "configs/model_lora/"): "V-PETL Bench's folder",
    ("benchmarks/results/README.md", "benchmarks/results/mini/runs/mini/digits/"): "an old run's output_dir",
    ("benchmarks/results/README.md", "benchmarks/results/mini_dinov2/runs/mini/digits/"): "an old run's output_dir",
}
# Hex words that are not commits: a data fingerprint (docs/choose.md's example); a digest is cut as `198644e3...`.
NOT_COMMITS = {"96dcfaa30d51"}


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)


@pytest.fixture(scope="module")
def tracked() -> set[str]:
    """Every committed file and every folder above one, relative to the root."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    names = set(git("ls-files", "-z").stdout.split("\0")) - {""}
    return names | {str(parent) for name in names for parent in Path(name).parents if str(parent) != "."}


def expand(name: str) -> list[str]:
    """``a.{md,csv}`` -> ``[a.md, a.csv]``."""
    found = re.search(r"\{([^{}]*)\}", name)
    if not found:
        return [name]
    return [
        one
        for choice in found.group(1).split(",")
        for one in expand(name[: found.start()] + choice + name[found.end() :])
    ]


def named_paths(text: str) -> list[str]:
    """The repository paths ``text`` names, as written (rooted ones, links, ``../`` ones)."""
    links = [link for link in LINK.findall(text) if not re.match(r"[a-z]+:", link)]
    return sorted(set(ROOTED.findall(text)) | set(links) | set(RELATIVE.findall(text)))


def missing_paths(rel: str, text: str, tracked: set[str]) -> list[str]:
    """The paths the doc ``rel`` (its text ``text``) names that git does not hold, from the root or its folder."""
    missing = []
    for name in named_paths(text):
        if (rel, name) in FOREIGN or re.search(r"[A-Z]{3,}|<", name):  # NAME.yaml, <task>: placeholders
            continue
        for one in expand(name):
            found = [os.path.normpath(base / one.rstrip("/")) for base in (Path(), Path(rel).parent)]
            if "*" in one:
                hit = any(Path(t).match(f) for f in found for t in tracked)
            else:
                hit = any(f in tracked for f in found)
            if not hit:
                missing.append(one)
    return missing


def quoted_commits(text: str) -> list[str]:
    """The hex words of ``text`` that read as commits of this repository (a digit and a letter, or 7 digits)."""
    text = FOREIGN_COMMIT.sub("", text)
    words = set(COMMIT.findall(text)) - NOT_COMMITS
    return sorted(w for w in words if re.search(r"\d", w) and (re.search(r"[a-f]", w) or len(w) == 7))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_doc_names_is_committed(doc, tracked):
    rel = str(doc.relative_to(ROOT))
    missing = missing_paths(rel, doc.read_text(encoding="utf-8"), tracked)
    assert not missing, f"{rel} names {missing}, which git ls-files does not hold"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_commit_a_doc_quotes_exists(doc, tracked):
    if git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
        pytest.skip("a shallow clone lacks old commits")
    quoted = quoted_commits(doc.read_text(encoding="utf-8"))
    unknown = [h for h in quoted if git("cat-file", "-e", f"{h}^{{commit}}").returncode != 0]
    assert not unknown, (
        f"{doc.relative_to(ROOT)} quotes {unknown}: no such commit here (another repo's: owner/name@hash)"
    )


# A benchmark script's command line as a doc gives it: `python benchmarks/x.py --a 1 --b` (a line continued by `\`).
SCRIPT_CALL = re.compile(r"(benchmarks/[\w/]+\.py)((?:[ \t]+(?:--[\w-]+|[^\s`|]+))*)")


def unknown_flags(text: str) -> list[str]:
    """``script --flag`` pairs of ``text`` whose script's source never names the flag (as its argparse would)."""
    unknown = []
    for script, args in SCRIPT_CALL.findall(text.replace("\\\n", " ")):
        source = (ROOT / script).read_text(encoding="utf-8") if (ROOT / script).is_file() else ""
        for flag in re.findall(r"(?<![\w-])--[a-z][\w-]*", args):
            if f'"{flag}"' not in source and f"'{flag}'" not in source:
                unknown.append(f"{script} {flag}")
    return unknown


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_flag_a_doc_gives_a_benchmark_script_is_its(doc):
    unknown = unknown_flags(doc.read_text(encoding="utf-8"))
    assert not unknown, f"{doc.relative_to(ROOT)} gives {unknown}, which the script does not take"


def test_a_planted_path_and_commit_are_caught(tracked):
    text = (
        "Run `benchmarks/no_such_script.py`, read [it](results.md) and `../benchmarks/results/nope.md`,\n"
        "`benchmarks/results/speed_cpu.{md,csv}`, `petl/methods/*.py`, `benchmarks/*.nope`; measured at 0badc0de1,\n"
        "a file of SHA-256 198644e3...bfdf355 and at 36593e9. On 2 cores (KMnP/vpt@4410440 is another repository's,\n"
        "as is github.com/synbol/Parameter-Efficient-Transfer-Learning-Benchmark, commit c188fad).\n"
    )
    assert missing_paths("docs/planted.md", text, tracked) == [
        "../benchmarks/results/nope.md",
        "benchmarks/*.nope",
        "benchmarks/no_such_script.py",
        "benchmarks/results/speed_cpu.csv",
    ]
    assert quoted_commits(text) == ["0badc0de1", "36593e9"]
    planted = "`python benchmarks/linear_probe.py --backbones swin \\\n    --no-such-flag --out x.md`"
    assert unknown_flags(planted) == ["benchmarks/linear_probe.py --no-such-flag"]


def test_the_counts_the_pages_state_are_the_code_s():
    """The method count on the docs' home page and the module sizes contributing.md states follow the code."""
    import petl

    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    stated = re.search(r"with (\d+) registered methods", index)
    assert stated, "docs/index.md no longer says how many methods are registered"
    assert int(stated.group(1)) == len(petl.list_methods()), f"docs/index.md says {stated.group(1)} methods"
    contributing = (ROOT / "docs" / "contributing.md").read_text(encoding="utf-8")
    bounds = re.search(r"most\s+under\s+(\d+)\s+lines;([^)]*),\s+the\s+largest,\s+under\s+(\d+)\)", contributing)
    assert bounds, "docs/contributing.md no longer states the modules' sizes"
    most, largest_named, largest = int(bounds.group(1)), bounds.group(2), int(bounds.group(3))
    sizes = {
        str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines()) for p in (ROOT / "petl").rglob("*.py")
    }
    over = sorted(name for name, lines in sizes.items() if lines >= most)
    assert len(over) <= len(sizes) // 10, f"contributing.md says most modules are under {most} lines: {over}"
    biggest = max(sizes, key=sizes.get)
    assert sizes[biggest] < largest and biggest in largest_named, (
        f"contributing.md names{largest_named} as the largest, under {largest} lines: {biggest} has {sizes[biggest]}"
    )
