"""`petl-bench compare`: two leaderboards' orderings, from their runs, over the rows complete on both."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_committed_leaderboards import _result as result_record
from test_committed_leaderboards import _write as write_run

from petl.bench import compare, report

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
# Each committed comparison: its file, and the two suites it compares (their runs under RESULTS/<suite>/runs).
COMMITTED = [
    (RESULTS / "mini_dinov2" / "vs_fractaldb.md", ("mini_selection", "mini_dinov2")),
    (RESULTS / "mini_swin" / "vs_vit.md", ("mini_selection", "mini_swin")),
]
TASKS = ("mini/digits", "mini/clevr_count")


def _write(root: Path, task: str, method: str, seed: int, top1: float) -> None:
    write_run(root / task / method / f"seed{seed}", result_record(task, method, seed, top1))


def _board(root: Path, means: dict[str, float], partial: tuple[str, ...] = ()) -> report.Leaderboard:
    """A board of one seed per cell: ``means`` complete on both tasks, ``partial`` on the first task only."""
    for method, top1 in means.items():
        for task in TASKS:
            _write(root, task, method, 0, top1)
    for method in partial:
        _write(root, TASKS[0], method, 0, 99.0)
    experiments = (*means, *partial)
    return report.build_board(root, plan=report.Plan(root.name, experiments, TASKS, (0,)))


def test_ranks_are_places_among_each_boards_complete_rows_and_rho_is_over_the_shared_ones(tmp_path):
    first = _board(tmp_path / "a", {"lora": 60.0, "linear": 50.0, "full": 70.0, "bitfit": 40.0})
    # On the second board bitfit is partial (its high first-task score must not rank it) and mlp is new.
    second = _board(tmp_path / "b", {"lora": 80.0, "linear": 85.0, "full": 90.0, "mlp": 10.0}, partial=("bitfit",))
    found = compare.compare(first, second)

    assert found.shared == ("full", "linear", "lora")  # the second board's order, best first
    assert found.complete[0]["lora"] == compare.Placing(2, 60.0)  # full 1, lora 2, linear 3, bitfit 4
    assert found.complete[1]["linear"].rank == 2 and "bitfit" not in found.complete[1]
    # ranks (1, 2, 3) on the second against (1, 3, 2) on the first: 1 - 6 * 2 / 24
    assert found.correlation.rho == pytest.approx(0.5)

    page = compare.markdown(found)
    assert "Spearman's rho = +0.50 over the 3 experiments complete on both boards." in page
    assert "| linear | 3 | 50.00 | 2 | 85.00 | +1 |" in page and "| lora | 2 | 60.00 | 3 | 80.00 | -1 |" in page
    assert "Complete only on suite a (1, not compared): bitfit." in page
    assert "Complete only on suite b (1, not compared): mlp." in page


def test_places_moved_are_counted_among_the_shared_rows_when_the_boards_differ_in_size(tmp_path):
    # Two rows complete on the first board only, both above the shared ones: the shared order is the same on both.
    first = _board(tmp_path / "a", {"ssf": 95.0, "dora": 92.0, "full": 70.0, "lora": 60.0, "linear": 50.0})
    second = _board(tmp_path / "b", {"full": 90.0, "lora": 80.0, "linear": 70.0})
    found = compare.compare(first, second)

    assert found.complete[0]["linear"].rank == 5 and found.complete[1]["linear"].rank == 3
    assert [found.places_moved_up(e) for e in found.shared] == [0, 0, 0]
    page = compare.markdown(found)
    assert "| Places moved up (of the 3 compared) |" in page
    assert "| linear | 5 | 50.00 | 3 | 70.00 | +0 |" in page


def test_too_few_shared_rows_give_no_coefficient(tmp_path):
    first = _board(tmp_path / "a", {"lora": 60.0, "linear": 50.0})
    second = _board(tmp_path / "b", {"lora": 70.0, "linear": 80.0})
    page = compare.markdown(compare.compare(first, second))
    assert "not computed: 2 experiment(s) are complete on both; it needs 3." in page


def test_the_command_writes_the_page_and_refuses_a_third_folder(tmp_path, capsys):
    from petl.cli import bench as cli

    for name in ("a", "b"):
        _board(tmp_path / name, {"lora": 60.0, "linear": 50.0, "full": 70.0})
    out = tmp_path / "page.md"
    assert cli.main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), f"out={out}"]) == 0
    assert "Spearman's rho = +1.00 over the 3 experiments" in out.read_text()
    for bad in (["compare", str(tmp_path / "a")], ["compare", str(tmp_path / "a"), str(tmp_path / "b"), "suites=x"]):
        with pytest.raises(SystemExit) as caught:
            cli.main(bad)
        assert caught.value.code == 2
    assert "suites=x: name two suites" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize(("committed", "suites"), COMMITTED, ids=[path.name for path, _ in COMMITTED])
def test_the_committed_comparison_rebuilds_from_the_committed_runs(committed, suites):
    """Each committed comparison is what `petl-bench compare` (the command in benchmarks/results/README.md) writes
    today.
    """
    boards = (report.build_board(RESULTS / suite / "runs", plan=report.plan_of(suite)) for suite in suites)
    assert compare.markdown(compare.compare(*boards)) == committed.read_text()


def test_the_command_refuses_to_replace_a_file_unless_told(tmp_path, capsys):
    from petl.cli import bench as cli

    for name in ("a", "b"):
        _board(tmp_path / name, {"lora": 60.0, "linear": 50.0, "full": 70.0})
    board = tmp_path / "a" / "leaderboard.md"
    board.write_text("the folder's own leaderboard\n")
    command = ["compare", str(tmp_path / "a"), str(tmp_path / "b"), f"out={board}"]
    with pytest.raises(SystemExit) as caught:
        cli.main(command)
    assert caught.value.code == 2 and board.read_text() == "the folder's own leaderboard\n"
    err = capsys.readouterr().err
    assert f"{board} exists; choose another out=, or pass overwrite=true" in err and err.count("\n") == 1
    assert cli.main([*command, "overwrite=true"]) == 0
    assert "Spearman's rho" in board.read_text()


def test_two_folders_of_different_own_images_are_refused(tmp_path, capsys):
    import json

    from petl.cli import bench as cli

    for name, fingerprint in (("a", "1" * 64), ("b", "2" * 64), ("c", "1" * 64)):
        _board(tmp_path / name, {"lora": 60.0, "linear": 50.0, "full": 70.0})
        record = {"task": "folder", "root": f"/data/{name}", "fingerprint": fingerprint}
        (tmp_path / name / "data.json").write_text(json.dumps(record))
    with pytest.raises(SystemExit) as caught:
        cli.main(["compare", str(tmp_path / "a"), str(tmp_path / "b")])
    err = capsys.readouterr().err
    assert caught.value.code == 2 and "different data" in err and "/data/a (fingerprint 111111111111)" in err
    # The same images in two folders (another backbone, say) compare.
    assert cli.main(["compare", str(tmp_path / "a"), str(tmp_path / "c")]) == 0
    (tmp_path / "c" / "data.json").unlink()  # registered tasks against own images: refused too
    with pytest.raises(SystemExit):
        cli.main(["compare", str(tmp_path / "a"), str(tmp_path / "c")])
