"""The docs site: its generated pages are current, it builds strictly, and the README stays a five-minute read."""

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _gen():
    spec = importlib.util.spec_from_file_location("docs_gen", ROOT / "docs" / "gen.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stale(pages: dict[Path, str]) -> list[str]:
    return [str(p.relative_to(ROOT)) for p, text in pages.items() if not p.is_file() or p.read_text() != text]


def test_method_pages_and_tables_are_current():
    # Method pages from the registry and configs/, the methods table, the works-with table, mkdocs.yml's nav.
    stale = _stale(_gen().pages(cli=False))
    assert stale == [], f"stale: {', '.join(stale)}; run python docs/gen.py"


def test_a_method_page_for_every_registered_method_and_no_other():
    import petl

    pages = {p.stem for p in (ROOT / "docs" / "methods").glob("*.md")}
    assert pages == set(petl.list_methods())


def test_cli_reference_is_current():
    # Each console script's --help, run outside this process (so this follows whatever parser the command has).
    stale = _stale({ROOT / "docs" / "cli.md": _gen().cli_page()})
    assert stale == [], "docs/cli.md is stale; run python docs/gen.py"


def test_every_petl_run_key_has_a_meaning_in_the_cli_reference():
    # petl-run --help prints each key's default only: docs/cli.md says what each means, from the config docstrings.
    from petl.train import config

    rows = dict(re.findall(r"^\| `([\w.]+)` \| `[^|]*` \| (.*) \|$", "\n".join(_gen().run_keys()), flags=re.M))
    keys = [f.name for f in dataclasses.fields(config.RunConfig) if f.name not in ("method", "data", "model", "train")]
    for group, cls in {"data": config.DataConfig, "model": config.ModelConfig, "train": config.TrainConfig}.items():
        keys += [f"{group}.{f.name}" for f in dataclasses.fields(cls)]
    assert sorted(rows) == sorted(keys)
    assert [key for key, meaning in rows.items() if not meaning.strip()] == []
    assert "train.keep_checkpoint" in (ROOT / "docs" / "cli.md").read_text()


def test_a_method_module_without_its_sections_is_refused():
    gen = _gen()
    free, sections = gen.split_sections("Title.\n\nProse.\n\nTrains:\n    the head.\n\nMore prose.\n")
    assert sections == {"Trains": "the head."} and free == "Title.\n\nProse.\n\nMore prose."
    import petl

    spec = petl.get_method("linear")
    module = sys.modules[spec.inject.__module__]
    saved = module.__doc__
    module.__doc__ = "Linear probing, with no sections."
    try:
        with pytest.raises(SystemExit, match=r"linear\.py: its docstring has no Trains:, Reference: section"):
            gen.method_page("linear", gen.Counter(), {})
    finally:
        module.__doc__ = saved


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[dev]')")
    pytest.importorskip("material", reason="mkdocs-material is not installed (pip install -e '.[dev]')")
    pytest.importorskip("mkdocstrings", reason="mkdocstrings is not installed (pip install -e '.[dev]')")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    own_data = (tmp_path / "site" / "own-data" / "index.html").read_text()
    assert "petl-export" in own_data and "--8&lt;--" not in own_data  # the README's section was included
    install = (tmp_path / "site" / "install" / "index.html").read_text()
    assert "apt-get failed" in install and "--8&lt;--" not in install


def test_readme_is_a_five_minute_read():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= 12 * 1024
    assert readme.index("## Your own data") < len(readme) / 3
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / link).exists(), f"README.md links to {link}, which does not exist"


def test_a_readme_section_a_page_names_exists():
    """Pages name README sections in words (`the README's "Your own data"`): a renamed section must not leave them."""
    headings = [
        line.lstrip("#").strip() for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("## ")
    ]
    for page in sorted((ROOT / "docs").glob("*.md")):
        for named in re.findall(r"README(?:'s|,) \"([^\"]+)\"", page.read_text()):
            assert any(h.startswith(named) for h in headings), f"{page.name}: no README section {named!r}"


def test_the_built_site_is_ignored_and_contributing_says_how_to_build_it():
    ignored = subprocess.run(["git", "check-ignore", "-q", "site/index.html"], cwd=ROOT, check=False)
    assert ignored.returncode == 0, "site/ (what mkdocs build writes) must be in .gitignore"
    contributing = (ROOT / "docs" / "contributing.md").read_text()
    assert '--8<-- "docs/install.md:docs-build"' in contributing
    assert "[start:docs-build]" in (ROOT / "docs" / "install.md").read_text()
