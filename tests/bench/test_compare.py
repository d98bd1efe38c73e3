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
    said = "Spearman's rho = +0.50 (no bootstrap interval: 3 rows, it needs 4) over the 3 experiments complete on both"
    assert said in page
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
    assert "not computed: 2 experiments complete on both; it needs 3." in page


def test_the_command_writes_the_page_and_refuses_a_third_folder(tmp_path, capsys):
    from petl.cli import bench as cli

    for name in ("a", "b"):
        _board(tmp_path / name, {"lora": 60.0, "linear": 50.0, "full": 70.0})
    out = tmp_path / "page.md"
    assert cli.main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), f"out={out}"]) == 0
    said = "Spearman's rho = +1.00 (no bootstrap interval: 3 rows, it needs 4) over the 3 experiments"
    assert said in out.read_text()
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


def _fill(root: Path, means: dict[str, float], tasks: tuple[str, ...] = TASKS, seeds: tuple[int, ...] = (0,)) -> Path:
    """Runs of ``means`` (one score per experiment) on ``tasks`` x ``seeds``, without a plan; returns ``root``."""
    for method, top1 in means.items():
        for task in tasks:
            for seed in seeds:
                _write(root, task, method, seed, top1)
    return root


def _exit(argv: list[str]) -> int:
    from petl.cli import bench as cli

    try:
        return int(cli.main(argv) or 0)
    except SystemExit as stop:
        return int(stop.code or 0)


def test_boards_of_different_tasks_are_refused_and_the_page_names_the_tasks(tmp_path, capsys):
    means = {"lora": 60.0, "linear": 50.0, "full": 70.0}
    a = _fill(tmp_path / "a", means, tasks=("mini/mnist",))
    b = _fill(tmp_path / "b", means, tasks=("mini/digits",))
    assert _exit(["compare", str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert f"{a} ranks 1 task (mini/mnist) and {b} 1 task (mini/digits)" in err and err.count("\n") == 1
    c = _fill(tmp_path / "c", means, tasks=("mini/mnist",))
    assert _exit(["compare", str(a), str(c)]) == 0
    assert "- **Tasks** (both boards): mini/mnist." in capsys.readouterr().out


def test_a_run_of_a_task_outside_the_suites_does_not_make_the_boards_rank_different_tasks(tmp_path):
    # Was: one folder also held a linear run of vtab/dtd, outside both suites and in no mean, and compare refused the
    # two as ranking 3 tasks against 2; the page's task list would have named dtd among the tasks compared.
    first = _board(tmp_path / "a", {"lora": 60.0, "linear": 50.0, "full": 70.0})
    _write(tmp_path / "b", "vtab/dtd", "linear", 0, 99.0)
    second = _board(tmp_path / "b", {"lora": 80.0, "linear": 85.0, "full": 90.0})
    assert "vtab/dtd" in second.tasks
    found = compare.compare(first, second)
    assert found.tasks == TASKS and found.correlation.rho == pytest.approx(0.5)
    assert "- **Tasks** (both boards): mini/digits, mini/clevr_count." in compare.markdown(found)


def test_a_suite_of_another_backbone_is_refused_by_report_and_compare(tmp_path, capsys):
    # The runs trained the ViT (test_committed_leaderboards' record); mini_swin's file trains the Swin.
    a = _fill(tmp_path / "a", {"lora": 60.0, "linear": 50.0, "full": 70.0})
    for argv in (
        ["report", str(a), "suite=mini_swin", f"out={tmp_path / 'r'}"],
        ["compare", str(a), str(a), "suites=mini_swin,mini"],
    ):
        assert _exit(argv) == 2
        err = capsys.readouterr().err
        assert "its runs trained vit_fractal_tiny_patch4_32.fractaldb, and suite mini_swin trains swin_" in err
        assert err.count("\n") == 1
    assert not (tmp_path / "r").exists()
    assert report.plan_of("mini").model == "vit_fractal_tiny_patch4_32.fractaldb"  # no model: petl's default


def test_a_suite_at_another_resolution_is_refused_by_report(tmp_path, capsys):
    # Was: only the model name was compared with the suite's, so runs of the fractal ViT at model.img_size=64 were
    # reported as suite mini's, which trains it at its own 32 px.
    import json

    a = _fill(tmp_path / "a", {"lora": 60.0, "linear": 50.0, "full": 70.0})
    records = sorted(a.rglob("result.json"))
    for path in records:  # given as the model's own size, and left at it: both the suite's
        record = json.loads(path.read_text())
        record["config"] = {"model": {"name": record["model"], "img_size": 32 if "lora" in str(path) else None}}
        path.write_text(json.dumps(record))
    assert report.plan_of("mini").img_size == 32
    assert _exit(["report", str(a), "suite=mini", f"out={tmp_path / 'r'}"]) == 0
    record = json.loads(records[0].read_text())
    record["config"]["model"]["img_size"] = 64
    records[0].write_text(json.dumps(record))
    assert _exit(["report", str(a), "suite=mini", f"out={tmp_path / 'r2'}"]) == 2
    err = capsys.readouterr().err
    assert f"{records[0]}: this run trained vit_fractal_tiny_patch4_32.fractaldb at 64 px, and suite mini" in err
    assert "trains it at 32 px" in err and err.count("\n") == 1
    assert not (tmp_path / "r2").exists()


def test_a_row_outside_the_suite_is_not_complete_on_its_board(tmp_path):
    a = _fill(tmp_path / "a", {"lora": 60.0, "linear": 50.0, "full": 70.0, "lora_extra": 65.0})
    plan = report.Plan("a", ("lora", "linear", "full"), TASKS, (0,))
    board = report.build_board(a, plan=plan)
    assert not board.complete(next(r for r in board.rows if r.experiment == "lora_extra"))
    assert "Complete rows (3)" in report.progress(board) and "Not in the suite" in report.progress(board)
    found = compare.compare(board, board)
    assert len(found.complete[0]) == 3 and "- **suite a**: 3 complete rows;" in compare.markdown(found)


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ('{"task":"folder","root"', "Expecting ':' delimiter"),
        ("[1,2]", "a JSON list, not an object"),
        ('{"fingerprint":"abc"}', "task, root missing or malformed"),
        ('{"version":2,"task":"folder","root":"x","fingerprint":"abc"}', "written by a newer petl"),
    ],
    ids=["truncated", "list", "no-task", "newer"],
)
def test_a_damaged_data_json_is_named_in_one_line(tmp_path, capsys, text, said):
    means = {"lora": 60.0, "linear": 50.0, "full": 70.0}
    a, b = _fill(tmp_path / "a", means), _fill(tmp_path / "b", means)
    (a / "data.json").write_text(text)
    assert _exit(["compare", str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"petl-bench: error: {a / 'data.json'}") and said in err and err.count("\n") == 1


def test_a_data_json_without_a_version_reads_as_version_1_and_a_new_one_records_it(tmp_path):
    from petl.bench import own_data

    record = {"task": "folder", "root": "/data", "fingerprint": "1" * 64}
    (tmp_path / "data.json").write_text(__import__("json").dumps(record))
    assert own_data.read_record(tmp_path) == record
    data = own_data.OwnData("folder", "/data", {}, "2" * 64, ["a"], {}, None, 0.0)
    own_data.claim_output_dir(tmp_path / "new", data)
    assert own_data.read_record(tmp_path / "new")["version"] == own_data.DATA_VERSION


def test_ties_and_saturated_tasks_are_said_as_they_are(tmp_path):
    from petl.bench import notes

    means = {"lora": 50.0, "linear": 50.0, "full": 50.0}
    tied = report.build_board(_fill(tmp_path / "tied", means, seeds=(0, 1, 2)))
    lines = " ".join(notes.comparison_lines(tied))
    assert "needs three methods" not in lines and "every block ties every method" in lines
    assert "0 of the 3 pairs do" in lines  # Friedman does not reject: no pair is declared different
    page = compare.markdown(compare.compare(tied, tied))
    assert "it needs 3" not in page and "the 3 experiments complete on both tie on" in page

    saturated = report.build_board(_fill(tmp_path / "sat", dict.fromkeys(means, 99.0), seeds=(0, 1, 2)))
    assert saturated.saturated == list(saturated.tasks)
    assert notes.comparison_lines(saturated) == [
        "Not tested: every task is saturated (digits, clevr_count): the methods differ there by a few test images, "
        "which rank nothing."
    ]


def test_too_few_shared_rows_say_one_row_in_the_singular(tmp_path):
    first = _board(tmp_path / "a", {"lora": 60.0})
    page = compare.markdown(compare.compare(first, first))
    assert "- **suite a**: 1 complete row;" in page and "not computed: 1 experiment complete on both" in page


def test_a_configs_dir_that_is_no_configs_folder_is_refused(tmp_path, capsys):
    a = _fill(tmp_path / "a", {"lora": 60.0, "linear": 50.0, "full": 70.0})
    missing = tmp_path / "nowhere"
    for argv in (
        ["report", str(a), f"out={tmp_path / 'r'}", f"configs_dir={missing}"],
        ["compare", str(a), str(a), f"configs_dir={missing}"],
    ):
        assert _exit(argv) == 2
        err = capsys.readouterr().err
        assert str(missing) in err and err.count("\n") == 1
    assert not (tmp_path / "r").exists()


def test_compare_and_report_never_write_into_a_run_folder(tmp_path, capsys):
    a = _fill(tmp_path / "a", {"lora": 60.0, "linear": 50.0, "full": 70.0})
    run = a / TASKS[0] / "lora" / "seed0"
    before = (run / "result.json").read_text()
    for argv in (
        ["compare", str(a), str(a), f"out={run / 'result.json'}", "overwrite=true"],
        ["compare", str(a), str(a), f"out={run / 'page.md'}"],
        ["report", str(a), f"out={run}"],
        ["report", str(run)],  # a run folder as the results folder: the report would go into it
    ):
        assert _exit(argv) == 2, argv
        err = capsys.readouterr().err
        assert f"inside the run folder {run.resolve()} (it holds result.json)" in err and err.count("\n") == 1
    assert (run / "result.json").read_text() == before and sorted(p.name for p in run.iterdir()) == ["result.json"]


def test_the_interval_does_not_depend_on_which_board_comes_first(tmp_path):
    # Nine experiments ordered differently on the two boards (in either board's order the bootstrap gives
    # +0.58 to +1.00 one way and +0.56 to +1.00 the other): it resamples them in name order.
    first = (54.7, 52.1, 57.9, 53.1, 51.3, 58.0, 68.4, 66.0, 65.3)
    second = (55.6, 56.9, 57.5, 55.5, 53.5, 59.8, 75.1, 62.7, 67.8)
    boards = [
        _board(tmp_path / name, {f"m{i}": v for i, v in enumerate(means)})
        for name, means in (("a", first), ("b", second))
    ]
    forward, backward = compare.compare(*boards).correlation, compare.compare(*reversed(boards)).correlation
    assert forward.rho == pytest.approx(backward.rho)
    assert forward.interval == backward.interval
