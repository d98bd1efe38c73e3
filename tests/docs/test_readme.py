"""The README's set-up commands are the ones CI runs."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_ci_runs_exactly_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = _bash_blocks(readme)
    test_command = next(b for b in blocks if ".venv/bin/pytest" in b)
    ci = (ROOT / ".ci" / "run").read_text()
    match = re.search(r"^TEST_COMMAND='(.*)'$", ci, flags=re.M)
    assert match, ".ci/run must define TEST_COMMAND"
    assert match.group(1) == test_command


def test_readme_main_command_runs_lora_on_the_defaults():
    blocks = _bash_blocks((ROOT / "README.md").read_text())
    assert blocks[0].endswith(".venv/bin/petl-run method=lora")


def test_no_test_imports_the_tests_folder_as_a_package():
    # The README's `.venv/bin/pytest` does not put the repository root on sys.path (`python -m pytest` does), so
    # `from tests.conftest import ...` passes under the one and fails at collection under CI's command.
    offenders = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in sorted((ROOT / "tests").rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.match(r"\s*(from|import) tests(\.|\s|$)", line)
    ]
    assert not offenders, "import helpers as `from conftest import ...` (tests/README.md): " + ", ".join(offenders)
