"""Leaderboard reports on the boards users make: part of a published benchmark, a report written twice into one folder,
a task outside the suite, long names, one epoch, stray set-aside records; and ``petl-bench params``'s bad input.

Training is faked (``write_run`` writes a result.json), so these take seconds.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import command_status
from test_harness import VIT_B, VTAB, VTAB_ROWS, VTAB_TASKS, _dump_dom_in_chromium, _read_table, read_csv, write_run

from petl.bench.report import write_report
from petl.cli import bench as cli

# Three of VTAB-1k's 19 tasks, on the published backbone, each cell at exactly the published figure.
SOME_VTAB = ("vtab/cifar100", "vtab/dtd", "vtab/clevr_count")
PUBLISHED = (("lora", "LoRA", 0.29e6), ("linear", "Linear probing", 0.0), ("vpt_deep", "VPT-Deep", 0.6e6))


def _some_vtab(root: Path) -> Path:
    for experiment, published, no_head in PUBLISHED:
        for task in SOME_VTAB:
            top1 = VTAB_ROWS[published].top1[VTAB.column(task)]
            write_run(
                root, task, experiment, 0, top1=top1, no_head=no_head, head=7.7e3, model=VTAB.backbone, total=VIT_B
            )
    return root


def test_a_published_task_mean_over_other_tasks_than_the_board_s_says_so(tmp_path):
    # Was: on 3 of VTAB-1k's 19 tasks, LoRA measured at exactly its published per-task figures showed a task mean of
    # 73.13 beside "Published vtab1k task mean" 72.25 (the published mean over all 19 tasks), and the per-task
    # published table put that 72.25 under "Task mean" right after its 3 task columns, whose mean is 73.13: read as
    # petl's LoRA beating the published one by 0.9 points on the same tasks.
    root = _some_vtab(tmp_path / "vtab")
    write_report(root)
    lora = read_csv(root / "leaderboard.csv")["lora"]
    assert round(float(lora["task_mean"]), 2) == 73.13 and float(lora["published_vtab1k_task_mean"]) == 72.25
    md = (root / "leaderboard.md").read_text()
    details = next(line for line in md.splitlines() if line.startswith("| Experiment | Family"))
    assert "| Published vtab1k task mean (its 19 tasks) | Published vtab1k group mean (its 19 tasks) |" in details
    assert "| Published vtab1k PPT (its 19 tasks) |" in details
    per_task = next(line for line in md.splitlines() if line.startswith("| petl experiment"))
    assert "| clevr_count | Task mean (its 19 tasks) | Group mean (its 19 tasks) | Params M | PPT (its 19 tasks) |" in (
        per_task
    )
    assert "over its 19 tasks, of which this board ran 3: they do not compare with the measured task mean" in md
    assert "Task mean (its 19 tasks)" in (root / "leaderboard.html").read_text()


def test_a_board_of_every_published_task_keeps_the_plain_labels(tmp_path):
    # The count is said only where the board leaves some of the table's tasks out.
    root = tmp_path / "vtab"
    for task in VTAB_TASKS:
        write_run(root, task, "lora", 0, top1=VTAB_ROWS["LoRA"].top1[VTAB.column(task)], model=VTAB.backbone)
    write_report(root)
    md = (root / "leaderboard.md").read_text()
    assert "| Published vtab1k task mean | Published vtab1k group mean |" in md and "its 19 tasks" not in md


def test_a_suite_short_of_a_published_task_says_so_though_a_run_outside_it_has_that_task(tmp_path):
    # Was: a suite of 18 of VTAB-1k's 19 tasks, in a folder also holding a run of the 19th (outside the suite, in no
    # mean), showed the published task mean, group mean and PPT under plain labels beside a measured task mean over
    # 18 tasks, and no legend line saying the published means are over other tasks than the measured one.
    from petl.bench.notes import notes
    from petl.bench.report import Plan, build_board, published_tables

    for task in VTAB_TASKS:
        write_run(tmp_path, task, "lora", 0, top1=VTAB_ROWS["LoRA"].top1[VTAB.column(task)], model=VTAB.backbone)
    board = build_board(tmp_path, plan=Plan("eighteen", ("lora",), tuple(VTAB_TASKS[:-1]), (0,)))
    labels = {c.label for c in board.columns}
    assert {"Published vtab1k task mean (its 19 tasks)", "Published vtab1k PPT (its 19 tasks)"} <= labels
    assert "Task mean (its 19 tasks)" in [h.label for h in published_tables(board)[0].headers]
    # Its per-task figures are the suite's tasks', as the means: the 19th, outside it, has none (the table, the CSV).
    last = VTAB.column(VTAB_TASKS[-1])
    assert f"published:{VTAB_TASKS[-1]}" not in [h.key for h in published_tables(board)[0].headers]
    assert f"published_vtab1k_{last}" not in [c.key for c in board.columns]
    assert f"published_vtab1k_{VTAB.column(VTAB_TASKS[0])}" in [c.key for c in board.columns]
    assert any("over its 19 tasks, of which this board ran 18: they do not compare" in line for line in notes(board))


def test_a_report_over_an_earlier_one_leaves_no_figure_of_the_earlier_board(tmp_path):
    # Was: a first report drew critical_difference.png and learning_curves.png; a second one into the same folder,
    # with one row left (or no curves), wrote its pages and kept both figures, which still showed the earlier rows.
    for experiment, top1 in (("lora", 80.0), ("linear", 70.0)):
        for task in ("mini/digits", "mini/mnist"):
            write_run(tmp_path, task, experiment, 0, top1=top1)
            run = tmp_path / task.replace("/", "-") / experiment / "seed0"
            (run / "metrics.jsonl").write_text('{"epoch": 1, "val_top1": 50.0}\n{"epoch": 2, "val_top1": 60.0}\n')
    write_report(tmp_path)
    assert (tmp_path / "critical_difference.png").is_file() and (tmp_path / "learning_curves.png").is_file()
    for task in ("mini-digits", "mini-mnist"):
        shutil.rmtree(tmp_path / task / "linear")
        (tmp_path / task / "lora" / "seed0" / "metrics.jsonl").unlink()
    write_report(tmp_path)
    assert not (tmp_path / "critical_difference.png").exists() and not (tmp_path / "learning_curves.png").exists()
    assert "critical_difference.png" not in (tmp_path / "leaderboard.md").read_text()


@pytest.mark.slow
def test_the_page_sorts_on_load_by_a_task_column_whose_key_holds_a_colon(tmp_path):
    # Was: the hash's key was matched up to its first colon, so #sort=task:mini/digits:asc (every task column's key,
    # and each group mean's, group:natural) sorted nothing: the page opened in the order written.
    for experiment, digits, mnist in (("lora", 90.0, 50.0), ("linear", 70.0, 80.0), ("bitfit", 60.0, 70.0)):
        write_run(tmp_path, "mini/digits", experiment, 0, top1=digits)
        write_run(tmp_path, "mini/mnist", experiment, 0, top1=mnist)
    write_report(tmp_path)
    page = (tmp_path / "leaderboard.html").as_uri()
    assert [row[0] for row in _read_table((tmp_path / "leaderboard.html").read_text(), "leaderboard").rows] == [
        "linear",
        "lora",
        "bitfit",
    ]
    dom = _dump_dom_in_chromium(page + "#sort=task:mini/mnist:desc", tmp_path)
    assert [row[0] for row in _read_table(dom, "leaderboard").rows] == ["linear", "bitfit", "lora"]
    dom = _dump_dom_in_chromium(page + "#sort=task:mini/digits:asc", tmp_path)
    assert [row[0] for row in _read_table(dom, "leaderboard").rows] == ["bitfit", "linear", "lora"]


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("methods=",), "methods= lists nothing"),
        (("methods=lora", "model=vit_bse_patch16_224"), "unknown model 'vit_bse_patch16_224'; did you mean"),
        # Was: a table whose every row said "refused" with the same reason, exit 0.
        (("methods=lora", "model=deit_tiny_distilled_patch16_224"), "model=deit_tiny_distilled_patch16_224: petl"),
    ],
)
def test_params_refuses_an_empty_methods_and_an_unknown_model_in_one_line(capsys, args, said):
    # Was: methods= printed a table of no row and exited 0 (as if every count had been checked); an unknown model=
    # printed the table's head, then timm's "RuntimeError: Unknown model" and exited 1, a failure, not bad input.
    code, out, err = command_status(capsys, cli.main, "params", *args)
    assert code == 2 and said in err and len(err.strip().splitlines()) == 1, err
    assert "experiment" not in out


def test_report_s_line_names_the_learning_curves_it_wrote(tmp_path, capsys):
    # Was: "-> DIR/leaderboard.{md,csv,html}, DIR/pareto.png": learning_curves.png was written and never named.
    for experiment, top1 in (("lora", 80.0), ("linear", 70.0)):
        write_run(tmp_path, "mini/digits", experiment, 0, top1=top1)
        (tmp_path / "mini-digits" / experiment / "seed0" / "metrics.jsonl").write_text('{"epoch": 1, "val_top1": 50}\n')
    code, out, _ = command_status(capsys, cli.main, "report", str(tmp_path))
    assert code == 0 and f"{tmp_path}/pareto.png, {tmp_path}/learning_curves.png\n" in out
    assert "critical_difference.png" not in out  # one block: no rank test, no diagram


def test_a_damaged_record_in_an_unstable_folder_outside_any_cell_does_not_fail_the_report(tmp_path, capsys):
    # Was: <root>/unstable/p/seed0/result.json, damaged, failed the report with "petl-bench: error: '/tmp' is not in
    # the subpath of '/tmp/...'" (the set-aside line looked for its task folder above the root), naming no file.
    write_run(tmp_path, "mini/digits", "lora", 0, top1=80.0)
    (tmp_path / "unstable" / "p" / "seed0").mkdir(parents=True)
    (tmp_path / "unstable" / "p" / "seed0" / "result.json").write_text("{")
    code, _, err = command_status(capsys, cli.main, "report", str(tmp_path))
    assert code == 0 and "error" not in err, err
    assert "**Set aside**" not in (tmp_path / "leaderboard.md").read_text()


def test_a_learning_curve_of_one_epoch_marks_epoch_1_only(monkeypatch):
    # Was: the epoch axis of one-epoch runs read 0.945, 0.960, ... 1.050: the integer locator gave up on a span
    # holding one whole number.
    from petl.bench import plot

    drawn = []
    monkeypatch.setattr(plot, "_png", lambda fig: drawn.append(fig) or b"")
    plot.render_curves({"lora": {1: 80.0}, "linear": {1: 70.0}}, "mini/digits", ["vit"], {"lora": "low-rank"})
    for ax in drawn[0].axes:
        low, high = ax.get_xlim()
        assert [float(t) for t in ax.get_xticks() if low <= t <= high] == [1.0]


def test_a_long_experiment_name_is_shown_whole_with_its_mark_in_the_html(tmp_path):
    # Was: an experiment name past 50 characters was folded like a long config text, in the main, details and rank
    # tables: two names sharing their first 40 characters read as one row twice, and the `*` of an unranked row (one
    # task short) was hidden behind the fold.
    stem = "adapter_parallel_dim8_scale0.1_warmup5_lr_search_"
    for name, tasks in ((stem + "a", ("mini/digits", "mini/mnist")), (stem + "b", ("mini/digits",))):
        for task in tasks:
            write_run(tmp_path, task, name, 0, top1=70.0)
    write_report(tmp_path)
    page = (tmp_path / "leaderboard.html").read_text()
    assert f'data-sort="{stem}a">{stem}a</td>' in page and f'data-sort="{stem}b">{stem}b *</td>' in page
    assert "<summary>" not in page.split('id="leaderboard"')[1].split("</table>")[0]


def test_a_run_of_a_task_outside_the_suite_has_its_column_and_no_part_in_the_means(tmp_path):
    # Was: report suite=mini on a folder where linear also ran vtab/dtd (one seed, 99 %) showed linear complete and
    # unmarked with a task mean over 8 tasks (76.00) among rows over the suite's 7 (its own over them: 72.71), sorted
    # and plotted by it; nothing said which tasks the mean covered.
    from petl.bench.report import plan_of
    from petl.bench.suite import configs_dir, load_suite

    mini = load_suite("mini", configs_dir())
    for experiment, top1 in (("lora", 80.0), ("linear", 70.0)):
        for i, task in enumerate(mini.tasks):
            for seed in mini.seeds:
                write_run(tmp_path, task, experiment, seed, top1=top1 + i)
    write_run(tmp_path, "vtab/dtd", "linear", 0, top1=99.0)
    board = write_report(tmp_path, plan=plan_of("mini"))
    linear = next(row for row in board.rows if row.experiment == "linear")
    assert linear.task_mean == 73.0 and board.complete(linear)
    assert "vtab/dtd" in linear.scores and "vtab/dtd" not in board.ranking.blocks
    md = (tmp_path / "leaderboard.md").read_text()
    assert "| dtd (not in the suite) |" in md and "unweighted mean over the 7 tasks" in md
    assert "**(not in the suite)**: dtd, not a task of suite `mini`" in md
    csv = read_csv(tmp_path / "leaderboard.csv")
    assert float(csv["linear"]["task_mean"]) == 73.0
    # Of the suite's tasks: it read 8/8 for linear, 7/8 for lora, complete as well.
    assert csv["linear"]["tasks_done"] == csv["lora"]["tasks_done"] == f"{len(mini.tasks)}/{len(mini.tasks)}"


def test_a_run_of_own_data_outside_the_suite_leaves_its_benchmark_tasks_named_as_such(tmp_path):
    # Was: a run of a task petl does not know ("my photos": a user's own data), outside the suite and in no mean, made
    # the board no benchmark's: the legend dropped the group mean's definition, and the published-ordering line went.
    from petl.bench.notes import benchmark_tasks, notes
    from petl.bench.report import Plan, build_board

    for experiment, top1 in (("lora", 80.0), ("linear", 70.0)):
        for task in ("mini/digits", "mini/mnist"):
            write_run(tmp_path, task, experiment, 0, top1=top1)
    write_run(tmp_path, "my photos", "lora", 0, top1=50.0)
    board = build_board(tmp_path, plan=Plan("two", ("lora", "linear"), ("mini/digits", "mini/mnist"), (0,)))
    assert "my photos" in board.tasks and benchmark_tasks(board)
    assert "**Group mean** = mean of the group averages" in notes(board)[1]
    assert not benchmark_tasks(build_board(tmp_path))  # without a suite, every task is the board's


def test_a_run_of_a_task_outside_the_suite_brings_in_no_published_table(tmp_path):
    # Was: suite two (mini tasks, no published table) in a folder also holding a run of vtab/dtd showed a
    # "Published vtab1k" table, columns and legend line, its figures over tasks the means do not count.
    from petl.bench.notes import notes
    from petl.bench.report import Plan, build_board, published_tables

    for experiment, top1 in (("lora", 80.0), ("linear", 70.0)):
        for task in ("mini/digits", "mini/mnist"):
            write_run(tmp_path, task, experiment, 0, top1=top1)
    write_run(tmp_path, "vtab/dtd", "lora", 0, top1=60.0, model=VTAB.backbone)
    board = build_board(tmp_path, plan=Plan("two", ("lora", "linear"), ("mini/digits", "mini/mnist"), (0,)))
    assert "vtab/dtd" in board.tasks and board.tables == [] and published_tables(board) == []
    assert not [c.key for c in board.columns if c.key.startswith("published")]
    assert not [line for line in notes(board) if "Published vtab1k" in line]
    assert [t.key for t in build_board(tmp_path).tables] == ["vtab1k"]  # without a suite, every task is the board's


def test_a_task_outside_the_suite_is_never_called_saturated(tmp_path):
    # Was: every complete row had also run vtab/dtd at 99 %, outside suite mini: its column read "dtd (saturated)"
    # in place of "(not in the suite)", and the legend said the means keep it and the rank test leaves it out.
    from petl.bench.report import plan_of
    from petl.bench.suite import configs_dir, load_suite

    mini = load_suite("mini", configs_dir())
    for experiment, top1 in (("lora", 80.0), ("linear", 70.0)):
        for i, task in enumerate(mini.tasks):
            for seed in mini.seeds:
                write_run(tmp_path, task, experiment, seed, top1=top1 + i)
        write_run(tmp_path, "vtab/dtd", experiment, 0, top1=99.0)
    board = write_report(tmp_path, plan=plan_of("mini"))
    assert board.saturated == [] and board.ranking.left_out_tasks == ()
    md = (tmp_path / "leaderboard.md").read_text()
    assert "| dtd (not in the suite) |" in md and "(saturated)" not in md


def test_the_task_count_beside_a_task_mean_is_the_suites(tmp_path, monkeypatch):
    # Was: a run of vtab/dtd outside suite mini made the published-ordering line say the task means were measured
    # "on these 8 tasks" and pareto.png's axis "over 8 tasks", of means over the suite's 7.
    from petl.bench import plot
    from petl.bench.report import pareto_png, plan_of
    from petl.bench.suite import configs_dir, load_suite

    mini = load_suite("mini", configs_dir())
    for experiment, top1 in (("lora", 80.0), ("linear", 70.0), ("full", 75.0)):
        for i, task in enumerate(mini.tasks):
            for seed in mini.seeds:
                write_run(tmp_path, task, experiment, seed, top1=top1 + i)
    write_run(tmp_path, "vtab/dtd", "linear", 0, top1=99.0)
    board = write_report(tmp_path, plan=plan_of("mini"))
    assert "measured here: " in (md := (tmp_path / "leaderboard.md").read_text())
    assert f"on these {len(mini.tasks)} tasks. Other backbone" in md
    counts: list[int] = []
    monkeypatch.setattr(plot, "render_pareto", lambda points, num_tasks, *rest: counts.append(num_tasks) or b"")
    pareto_png(board)
    assert counts == [len(mini.tasks)]


def test_a_damaged_set_aside_record_is_named_once_per_report(tmp_path, capsys):
    # Was: named twice, in two identical warnings: the legend was built once for the Markdown and once for the HTML.
    write_run(tmp_path, "mini/digits", "lora", 0, top1=80.0)
    aside = tmp_path / "mini-digits" / "lora" / "unstable" / "train.lr=0.1" / "seed0"
    aside.mkdir(parents=True)
    (aside / "result.json").write_text("{")
    code, _, err = command_status(capsys, cli.main, "report", str(tmp_path))
    assert code == 0 and err.count("set-aside run:") == 1, err


def test_a_sweep_s_end_line_names_the_figures_it_wrote(tmp_path, capsys):
    # Was: "..., pareto.png and critical_difference.png (when two complete rows can be compared)" whatever was drawn.
    from petl.bench import commands
    from petl.bench.args import configs_folder
    from petl.bench.sweep import SweepSummary

    for experiment, top1 in (("lora", 80.0), ("linear", 70.0)):
        write_run(tmp_path, "mini/digits", experiment, 0, top1=top1)
        (tmp_path / "mini-digits" / experiment / "seed0" / "metrics.jsonl").write_text('{"epoch": 1, "val_top1": 50}\n')
    suite = commands.suites.load_suite("mini", configs_folder({}))
    commands._finish(SweepSummary(total=2, already_done=2), tmp_path, {}, True, suite)
    out = capsys.readouterr().out
    assert f"written to {tmp_path}/leaderboard.{{md,csv,html}}, pareto.png, learning_curves.png\n" in out, out


def test_the_ranking_line_says_this_task_of_a_one_task_board(tmp_path):
    # Was: "measured here: ... on these 1 task."
    from petl.bench.notes import ranking_line
    from petl.bench.report import build_board

    for experiment, top1 in (("lora", 80.0), ("linear", 70.0)):
        write_run(tmp_path, "mini/digits", experiment, 0, top1=top1)
    board = build_board(tmp_path)
    assert " on this task. " in ranking_line(board)
    write_run(tmp_path, "mini/mnist", "lora", 0, top1=90.0)
    assert " on these 2 tasks. " in ranking_line(build_board(tmp_path))


def test_learning_curves_are_placed_by_epoch_and_average_only_the_epochs_every_seed_has(tmp_path, monkeypatch):
    # Was: plotted by position: a damaged line moved every later epoch one to the left, and a seed's shorter curve
    # silently shortened its row's mean curve.
    import json

    from petl.bench import plot
    from petl.bench.curves import cut_curves, learning_curves
    from petl.bench.report import build_board, learning_curves_png

    def metrics(experiment: str, seed: int, lines: list[str]) -> None:
        (tmp_path / "mini-digits" / experiment / f"seed{seed}" / "metrics.jsonl").write_text("\n".join(lines) + "\n")

    def line(epoch: int, top1: float) -> str:
        return json.dumps({"epoch": epoch, "val_top1": top1})

    for seed in (0, 1):
        write_run(tmp_path, "mini/digits", "lora", seed, top1=80.0)
        write_run(tmp_path, "mini/digits", "linear", seed, top1=70.0)
    metrics("lora", 0, [line(1, 10), '{"epoch": 2, "val_top1": 2', line(3, 30), line(4, 40)])  # epoch 2 cut short
    metrics("lora", 1, [line(1, 20), line(2, 20), line(3, 40), line(4, 50)])
    metrics("linear", 0, [line(1, 10), line(2, 20), line(3, 30)])
    metrics("linear", 1, [line(1, 30), line(2, 40)])  # a seed whose curve stops early
    board = build_board(tmp_path)
    task, curves = learning_curves(board)
    assert curves == {"lora": {1: 15.0, 3: 35.0, 4: 45.0}, "linear": {1: 20.0, 2: 30.0}}
    assert cut_curves(board, task) == ["lora (3 of 4 epochs)", "linear (2 of 3 epochs)"]
    drawn = []
    monkeypatch.setattr(plot, "_png", lambda fig: drawn.append(fig) or b"")
    learning_curves_png(board)
    assert "only the epochs every seed's curve has: lora (3 of 4 epochs), linear (2 of 3 epochs)" in " ".join(
        drawn[0]._suptitle.get_text().split()
    )
    lines = {line.get_label(): line for ax in drawn[0].axes for line in ax.get_lines() if line.get_color() != "0.86"}
    assert list(lines["lora"].get_xdata()) == [1, 3, 4]


def test_one_extra_seed_in_one_cell_leaves_the_other_rows_complete_and_is_marked(tmp_path):
    # Was: a row was complete only with as many seeds as the fullest cell, so lora's seed 3 on digits made every other
    # row "short of a task or seed" and the rank test ran on nothing.
    from petl.bench import ranking
    from petl.bench.notes import notes
    from petl.bench.report import build_board, display_table

    for i, experiment in enumerate(("lora", "linear", "bitfit")):
        for task in ("mini/digits", "mini/mnist"):
            for seed in (0, 1, 2):
                write_run(tmp_path, task, experiment, seed, top1=80.0 - 5 * i + seed)
    write_run(tmp_path, "mini/digits", "lora", 3, top1=90.0)
    board = build_board(tmp_path)
    assert board.seed_count == 3 and all(map(board.complete, board.rows))
    assert isinstance(board.ranking, ranking.Ranking) and len(board.ranking.methods) == 3
    lora = next(r for r in board.rows if r.experiment == "lora")
    assert lora.scores["mini/digits"].mean == (80 + 81 + 82 + 90) / 4  # over all its seeds, and marked
    cells = {row[0][0]: row for row in display_table(board).rows}
    assert any(text.endswith(" ⁺") for text, _ in cells["lora"]) and not any("⁺" in t for t, _ in cells["linear"])
    legend = " ".join(notes(board))
    assert "**⁺**: the cell ran more seeds than the 3 seeds most cells have" in legend
    assert "1 cell: lora digits (seeds 0, 1, 2, 3)." in legend
    # A row short of a seed most cells have is still short.
    (tmp_path / "mini-mnist" / "bitfit" / "seed2" / "result.json").unlink()
    assert [r.experiment for r in build_board(tmp_path).rows if not build_board(tmp_path).complete(r)] == ["bitfit"]


def test_with_a_suite_a_seed_outside_it_is_left_out_of_its_cell_and_marked(tmp_path):
    # Was: a seed outside the suite counted in the cell's mean with no mark, while a task outside it is left out.
    from petl.bench.notes import notes
    from petl.bench.ranking import seed_scores
    from petl.bench.report import Plan, build_board

    for experiment, top1 in (("lora", 80.0), ("linear", 70.0)):
        for seed in (0, 1):
            write_run(tmp_path, "mini/digits", experiment, seed, top1=top1 + seed)
    write_run(tmp_path, "mini/digits", "lora", 2, top1=10.0)
    board = build_board(tmp_path, plan=Plan("two", ("lora", "linear"), ("mini/digits",), (0, 1)))
    lora = next(r for r in board.rows if r.experiment == "lora")
    score = lora.scores["mini/digits"]
    assert score.mean == 80.5 and score.seeds == (0, 1) and score.outside_seeds == (2,)
    assert seed_scores(lora, "mini/digits") == {0: 80.0, 1: 81.0} and board.complete(lora)
    legend = " ".join(notes(board))
    assert "**⁺**: the cell has runs of seeds outside suite `two` (seeds 0, 1): they are left out" in legend
    assert "1 cell: lora digits (seed 2)." in legend


def test_a_name_holding_markup_stays_plain_text_in_the_legends(tmp_path):
    # Was: an experiment named x**y or `c` set the rest of its legend line in bold, or in code, in leaderboard.html
    # (and leaderboard.md): names were escaped for HTML, not for the legend's Markdown.
    for i, experiment in enumerate(("lora", "linear", "x**y", "`c`")):
        for task in ("mini/digits", "mini/mnist") if i < 2 else ("mini/digits",):
            write_run(tmp_path, task, experiment, 0, top1=80.0 - i)
    write_report(tmp_path)
    html = (tmp_path / "leaderboard.html").read_text()
    assert "Not ranked, marked <code>*</code> in the table: x**y (short of a task or seed), `c` (short of" in html
    assert "<code>c</code>" not in html
    md = (tmp_path / "leaderboard.md").read_text()
    assert "x\\*\\*y (short of a task or seed), \\`c\\` (short of" in md


def test_with_a_suite_a_seed_outside_it_is_left_out_of_the_cell_s_curves_too(tmp_path):
    # Was: its cell's mean left the seed out, but its val curve still counted in the cell's ↑ (tail change), the
    # convergence column and the learning curves, so a rerun of another seed could mark the suite's cell still learning.
    import json

    from petl.bench.curves import convergence, learning_curves
    from petl.bench.report import Plan, build_board

    def metrics(experiment: str, seed: int, step: float) -> None:
        lines = [json.dumps({"epoch": e, "val_top1": 50 + step * e}) for e in range(1, 6)]
        (tmp_path / "mini-digits" / experiment / f"seed{seed}" / "metrics.jsonl").write_text("\n".join(lines) + "\n")

    for experiment, top1 in (("lora", 80.0), ("linear", 70.0)):
        write_run(tmp_path, "mini/digits", experiment, 0, top1=top1)
        metrics(experiment, 0, 0.0)
    write_run(tmp_path, "mini/digits", "lora", 7, top1=10.0)
    metrics("lora", 7, 9.0)  # a seed outside the suite whose curve still rises 9 points an epoch
    board = build_board(tmp_path, plan=Plan("two", ("lora", "linear"), ("mini/digits",), (0,)))
    lora = next(r for r in board.rows if r.experiment == "lora")
    assert lora.scores["mini/digits"].tail_change == 0.0
    assert convergence(lora) == (0.0, 0.0)
    assert learning_curves(board)[1]["lora"] == dict.fromkeys(range(1, 6), 50.0)


def test_with_a_suite_the_cost_columns_read_the_runs_the_accuracy_does(tmp_path):
    # Was: a seed outside the suite was left out of its cell's mean, but its parameters, train seconds and peak memory
    # still counted in the row's Trainable M, PPT, Train s/run and Peak MB.

    from petl.bench.report import Plan, build_board

    for experiment in ("lora", "linear"):
        write_run(tmp_path, "mini/digits", experiment, 0, top1=80.0)
    write_run(tmp_path, "mini/digits", "lora", 7, top1=10.0, no_head=9e4, train_seconds=100.0, peak_memory_mb=999.0)
    board = build_board(tmp_path, plan=Plan("two", ("lora", "linear"), ("mini/digits",), (0,)))
    lora = next(r for r in board.rows if r.experiment == "lora")
    assert lora.trainable_no_head == 1000.0 and lora.values["trainable"][0] == 1100.0
    assert lora.values["train_seconds"] == 2.0 and lora.values["peak_memory_mb"] == 10.0


def test_with_a_suite_the_cost_columns_leave_out_the_runs_of_a_task_outside_it(tmp_path):
    # Was: a task outside the suite was left out of the row's means, but its runs' parameters, train seconds and peak
    # memory still counted in the row's Trainable M, PPT, Train s/run and Peak MB (and choose's train seconds).

    from petl.bench.choice import train_seconds
    from petl.bench.report import Plan, build_board

    for experiment in ("lora", "linear"):
        write_run(tmp_path, "mini/digits", experiment, 0, top1=80.0)
    write_run(tmp_path, "mini/mnist", "lora", 0, top1=10.0, no_head=9e4, train_seconds=100.0, peak_memory_mb=999.0)
    board = build_board(tmp_path, plan=Plan("two", ("lora", "linear"), ("mini/digits",), (0,)))
    lora = next(r for r in board.rows if r.experiment == "lora")
    assert "mini/mnist" in lora.scores and lora.outside_tasks == ("mini/mnist",)
    assert [r.task for r in lora.counted_runs] == ["mini/digits"]
    assert lora.trainable_no_head == 1000.0 and lora.values["trainable"][0] == 1100.0
    assert lora.values["train_seconds"] == 2.0 and lora.values["peak_memory_mb"] == 10.0 and train_seconds(lora) == 2.0
    # Without a suite every task counts.
    lora = next(r for r in build_board(tmp_path).rows if r.experiment == "lora")
    assert lora.trainable_no_head == (1000.0 + 9e4) / 2 and lora.values["train_seconds"] == 51.0


def test_the_convergence_column_reads_the_tail_by_epoch_not_by_line(tmp_path):
    # Was: the tail was the last 20 % of the curve's lines, so a metrics.jsonl missing epoch 9's line read epochs 7 to
    # 10 as the last 2 of 10 epochs: a curve flat since epoch 8 showed +10 and ↑ (still learning).
    import json

    from petl.bench.columns import still_learning
    from petl.bench.curves import convergence
    from petl.bench.report import build_board

    write_run(tmp_path, "mini/digits", "lora", 0, top1=80.0)
    lines = [json.dumps({"epoch": e, "val_top1": 10.0 * min(e, 8)}) for e in (1, 2, 3, 4, 5, 6, 7, 8, 10)]
    (tmp_path / "mini-digits" / "lora" / "seed0" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    lora = build_board(tmp_path).rows[0]
    assert convergence(lora) == (0.0, 0.0) and not still_learning(lora.scores["mini/digits"])


def test_with_a_suite_a_cell_of_only_seeds_outside_it_is_marked_as_the_legend_names_it(tmp_path):
    # Was: such a cell showed "–" without ⁺ while the ⁺ legend line counted and named it.
    from petl.bench.notes import notes
    from petl.bench.report import Plan, build_board, display_table

    for experiment in ("lora", "linear"):
        write_run(tmp_path, "mini/digits", experiment, 0, top1=80.0)
    write_run(tmp_path, "mini/mnist", "linear", 0, top1=80.0)
    write_run(tmp_path, "mini/mnist", "lora", 5, top1=90.0)
    board = build_board(tmp_path, plan=Plan("two", ("lora", "linear"), ("mini/digits", "mini/mnist"), (0,)))
    cells = {row[0][0].rstrip(" *"): [text for text, _ in row] for row in display_table(board).rows}
    assert cells["lora"][-1] == "– ⁺" and cells["linear"][-1] == "80.00"
    assert "1 cell: lora mnist (seed 5)." in " ".join(notes(board))


def test_the_report_command_prints_names_plainly_on_the_console(tmp_path, capsys, monkeypatch):
    # Was: its progress line printed x\*y (the Markdown escape the pages need) for an experiment named x*y.
    from petl.bench import report
    from petl.bench.report import Plan

    for experiment in ("x*y", "lora"):
        write_run(tmp_path, "mini/digits", experiment, 0, top1=80.0)
    monkeypatch.setattr(report, "plan_of", lambda *_: Plan("two", ("x*y", "lora"), ("mini/digits",), (0,)))
    code, out, _ = command_status(capsys, cli.main, "report", str(tmp_path), "suite=two")
    assert code == 0 and "Complete rows (2): x*y, lora." in out, out
    assert "x\\*y" in (tmp_path / "leaderboard.md").read_text()


def test_a_row_with_no_run_of_the_suite_shows_no_nan_for_its_parameters(tmp_path):
    # Was: a row whose runs are all of a seed outside the suite counts none; its Trainable M cells read "nan (nan%)".
    from petl.bench.report import Plan

    write_run(tmp_path, "mini/digits", "lora", 0, top1=80.0)
    write_run(tmp_path, "mini/digits", "linear", 7, top1=60.0)
    write_report(tmp_path, plan=Plan("two", ("lora", "linear"), ("mini/digits",), (0,)))
    md = (tmp_path / "leaderboard.md").read_text()
    linear = [line for line in md.splitlines() if line.startswith("| linear")]
    assert linear and not any("nan" in line for line in linear)
    assert "nan" not in (tmp_path / "leaderboard.html").read_text().split('id="leaderboard"')[1].split("</table>")[0]


def test_with_a_suite_a_run_outside_it_on_another_backbone_leaves_the_row_ranked(tmp_path):
    # Was: a row was 'on different backbones' (never complete, not ranked) when a run of a task or seed outside the
    # suite, in none of its figures, trained another backbone than its suite's runs.
    from petl.bench.report import Plan, build_board

    for experiment, top1 in (("lora", 80.0), ("linear", 70.0)):
        for task in ("mini/digits", "mini/mnist"):
            write_run(tmp_path, task, experiment, 0, top1=top1)
    write_run(tmp_path, "vtab/dtd", "lora", 0, top1=60.0, model="vit_base_patch16_224")
    write_run(tmp_path, "mini/digits", "lora", 7, top1=60.0, model="vit_base_patch16_224")
    board = build_board(tmp_path, plan=Plan("two", ("lora", "linear"), ("mini/digits", "mini/mnist"), (0,)))
    lora = next(r for r in board.rows if r.experiment == "lora")
    assert not board.mixed(lora) and board.complete(lora)


# ------------------------------------------------------------------------------------ records not to be trusted


def _three_seeds(root: Path, experiment: str = "lora", tasks=("mini/digits", "mini/mnist")) -> Path:
    for task in tasks:
        for seed in (0, 1, 2):
            write_run(root, task, experiment, seed, top1=50.0 + seed)
    return root


def test_a_record_of_other_bytes_than_utf_8_is_skipped_by_name(tmp_path):
    # Was: a result.json with a byte that is not UTF-8 (a method name edited in Latin-1) stopped the whole report with
    # "petl-bench: error: 'utf-8' codec can't decode byte 0xff in position 14", naming no file; and a name written as
    # the JSON escape \udcff (a lone surrogate) stopped it with a TypeError from matplotlib's text layout (exit 1).
    from petl.bench.collect import read_all

    root = _three_seeds(tmp_path)
    latin1 = root / "mini-digits" / "lora" / "seed0" / "result.json"
    latin1.write_bytes(latin1.read_bytes().replace(b'"method": "lora"', b'"method": "lo\xffra"'))
    escaped = root / "mini-mnist" / "lora" / "seed1" / "result.json"
    escaped.write_text(escaped.read_text().replace('"method": "lora"', '"method": "lo\\udcffra"'))
    with pytest.warns(UserWarning) as caught:
        found = read_all(root)
    said = [str(w.message) for w in caught]
    assert f"skipping {latin1}: not UTF-8 text (byte 0xff at 14)" in said
    assert (
        f"skipping {escaped}: field 'method' holds 'lo\\udcffra', which is not UTF-8 text (a lone surrogate escape)"
        in (said)
    )
    assert len(found) == 4
    with pytest.warns(UserWarning):
        write_report(root)  # the other runs' board, the two files named under Skipped
    assert "mini-mnist/lora/seed1/result.json" in (root / "leaderboard.md").read_text()


def test_a_folder_name_of_other_bytes_than_utf_8_is_skipped_by_name(tmp_path):
    # Was: an experiment folder named in bytes that are not UTF-8 (b"lo\xffra") stopped the report with matplotlib's
    # TypeError on the surrogate its name read as; the pages (UTF-8) could not hold the name either.
    root = _three_seeds(tmp_path, "linear")
    _three_seeds(tmp_path, "lora")
    for task in ("mini-digits", "mini-mnist"):
        os.rename(root / task / "lora", os.fsencode(root / task) + b"/lo\xffra")
    with pytest.warns(UserWarning) as caught:
        board = write_report(root)
    assert [row.experiment for row in board.rows] == ["linear"]
    # Each named as the page names it, its odd byte as \xff: a warning holding the lone surrogate the name reads as
    # (\udcff) could not be encoded, and under pytest-xdist stopped the whole test session (INTERNALERROR).
    said = sorted(str(w.message) for w in caught)
    assert len(said) == 6 and all("lo\\xffra/seed" in line and line.isascii() for line in said), said
    first = f"skipping {root}/mini-digits/lo\\xffra/seed0/result.json"
    assert said[0] == f"{first}: a folder name is not UTF-8 text; rename the folder"
    assert "mini-digits/lo\\xffra/seed0/result.json" in (root / "leaderboard.md").read_text(encoding="utf-8")


def test_a_results_folder_named_in_other_bytes_than_utf_8_gets_its_board(tmp_path):
    # Was: a results folder named in Latin-1 (b"r\xe9s") stopped the report with "'utf-8' codec can't encode character
    # '\udce9'", naming nothing: the page's title is the folder's name.  It is shown with its odd byte as \xe9.
    root = Path(os.fsdecode(os.fsencode(tmp_path) + b"/r\xe9s"))
    _three_seeds(root, "linear")
    _three_seeds(root, "lora")
    write_report(root)
    assert (root / "leaderboard.md").read_text(encoding="utf-8").startswith("# petl leaderboard: r\\xe9s\n")


def test_a_record_in_another_seed_s_folder_is_skipped(tmp_path):
    # Was: seed0/result.json edited (or copied) to say seed 1 stood in the cell as seed 1, and the true seed1/ run was
    # then dropped as "already read" (a copy of it): the cell's mean read the wrong score, and no line said so.
    from petl.bench.collect import collect

    root = _three_seeds(tmp_path)
    moved = root / "mini-digits" / "lora" / "seed0" / "result.json"
    moved.write_text(moved.read_text().replace('"seed": 0', '"seed": 1'))
    with pytest.warns(
        UserWarning, match=rf"skipping {moved}: a run of seed 1 in the folder of seed 0: move it"
    ) as said:
        records = collect(root)
    # Nothing finished is deleted unless the user asks (was: "move it, or delete it"): where it belongs, or aside.
    seeds = moved.parent.parent
    assert str(said[0].message).endswith(
        f": move it to {seeds / 'seed1'}, or aside (rename {seeds / 'seed0'} to seed0.replaced-old)"
    )
    digits = {r.seed: r.result.test_top1 for r in records if r.task == "mini/digits"}
    assert digits == {1: 51.0, 2: 52.0}


def test_a_linked_run_folder_is_read_and_a_link_back_up_is_not_walked_again(tmp_path):
    # Was: a run folder linked in from elsewhere (ln -s) counted as done for the sweep (its result.json is a file),
    # while the report's Path.rglob did not enter the link: the cell showed two of three seeds, and nothing said why.
    from petl.bench.collect import collect, result_files

    root = _three_seeds(tmp_path / "results")
    run = root / "mini-digits" / "lora" / "seed2"
    shutil.move(run, tmp_path / "elsewhere")
    run.symlink_to(tmp_path / "elsewhere")
    (root / "mini-mnist" / "up").symlink_to(root)  # a loop
    assert len(result_files(root)) == 6
    assert sorted(r.seed for r in collect(root) if r.task == "mini/digits") == [0, 1, 2]


def _at_size(root: Path, task: str, experiment: str, seed: int, img_size: int, given_as: str = "img_size") -> None:
    # The run's record as petl writes it when model.img_size (or +model.kwargs.img_size) is set: in its config.
    path = root / task.replace("/", "-") / experiment / f"seed{seed}" / "result.json"
    record = json.loads(path.read_text())
    model = {"name": record["model"], "img_size": None, "kwargs": {}}
    if given_as == "img_size":
        model["img_size"] = img_size
    elif given_as == "kwargs":
        model["kwargs"] = {"img_size": img_size}
    else:  # a NaFlexVit's training size
        model["kwargs"] = {"pretrained_cfg_overlay": {"input_size": [3, img_size, img_size]}}
    record["config"] = {"model": model}
    path.write_text(json.dumps(record))


def test_a_row_at_another_resolution_is_not_ranked_as_the_same_backbone(tmp_path):
    # Was: a row trained with model.img_size=64 on the board's 32-px model was named by its timm name alone, so it was
    # complete and ranked beside the others: the rank test compared resolutions as if they were methods.
    from petl.bench.report import build_board

    tasks = ("mini/digits", "mini/mnist")
    for experiment in ("linear", "vpt_deep", "lora"):
        _three_seeds(tmp_path, experiment, tasks)
    for task in tasks:
        for seed in (0, 1, 2):
            _at_size(tmp_path, task, "lora", seed, 64)
    board = build_board(tmp_path)
    lora = next(row for row in board.rows if row.experiment == "lora")
    assert board.other_backbone(lora) and not board.complete(lora)
    model = "vit_fractal_tiny_patch4_32.fractaldb"
    assert board.models == [f"{model} at 64 px", f"{model} at its own resolution"]
    assert board.ranked_backbone == f"{model} at its own resolution"
    # One run at another size makes its row's tasks of two models (mixed), as another backbone does.
    _at_size(tmp_path, "mini/digits", "linear", 0, 64)
    _at_size(tmp_path, "mini/digits", "linear", 1, 64)
    _at_size(tmp_path, "mini/digits", "linear", 2, 64)
    board = build_board(tmp_path)
    assert board.mixed(next(row for row in board.rows if row.experiment == "linear"))


@pytest.mark.parametrize("given_as", ["kwargs", "overlay"])
def test_a_resolution_given_as_a_timm_keyword_is_told_apart_as_model_img_size_is(tmp_path, given_as):
    # Was: only model.img_size was read, so runs at +model.kwargs.img_size=64 (the same timm argument) were named
    # by the timm name alone and ranked beside the 32-px rows, and runs given the same size both ways were two models.
    from petl.bench.report import build_board

    tasks = ("mini/digits", "mini/mnist")
    for experiment in ("linear", "vpt_deep", "lora"):
        _three_seeds(tmp_path, experiment, tasks)
    for task in tasks:
        for seed in (0, 1, 2):
            _at_size(tmp_path, task, "lora", seed, 64, given_as)
    board = build_board(tmp_path)
    model = "vit_fractal_tiny_patch4_32.fractaldb"
    assert board.models == [f"{model} at 64 px", f"{model} at its own resolution"]
    assert board.other_backbone(next(row for row in board.rows if row.experiment == "lora"))
    for task in tasks:
        for seed in (0, 1, 2):
            _at_size(tmp_path, task, "linear", seed, 64)  # the same size as model.img_size: the same model
    board = build_board(tmp_path)
    assert not board.mixed(next(row for row in board.rows if row.experiment == "linear"))
    assert board.models == [f"{model} at 64 px", f"{model} at its own resolution"]


def test_a_run_given_its_models_own_size_is_the_same_backbone_as_one_given_none(tmp_path):
    # Was: model.img_size=32 on the 32-px fractal ViT was named "<model> at 32 px" and a run that left it at the
    # default "<model> at its own resolution": one backbone counted as two, its rows marked and not ranked.
    from petl.bench.report import build_board

    tasks = ("mini/digits", "mini/mnist")
    for experiment in ("linear", "vpt_deep", "lora"):
        _three_seeds(tmp_path, experiment, tasks)
    for task in tasks:
        for seed in (0, 1, 2):
            _at_size(tmp_path, task, "lora", seed, 32)  # given explicitly
            _at_size(tmp_path, task, "linear", seed, None)  # left at the default: the config sets no size
            _at_size(tmp_path, task, "vpt_deep", seed, None)
    board = build_board(tmp_path)
    model = "vit_fractal_tiny_patch4_32.fractaldb"
    assert board.models == [model]
    assert all(board.complete(row) for row in board.rows)
    # At another size the default's runs are named with the size the model is built at, not "its own resolution".
    for task in tasks:
        for seed in (0, 1, 2):
            _at_size(tmp_path, task, "vpt_deep", seed, 64)
    board = build_board(tmp_path)
    assert board.models == [f"{model} at 32 px", f"{model} at 64 px"]
    assert board.ranked_backbone == f"{model} at 32 px"


def test_published_figures_are_not_shown_beside_runs_at_another_resolution(tmp_path):
    # Was: runs on the published ViT-B/16 at model.img_size=384 stood beside the published 224-px figures.
    from petl.bench.board import DIFFERENT_BACKBONE
    from petl.bench.report import build_board

    root = _some_vtab(tmp_path / "vtab")
    for task in SOME_VTAB:
        _at_size(root, task, "lora", 0, 384)
    board = build_board(root)
    rows = {row.experiment: row for row in board.rows}
    assert rows["lora"].published[VTAB.key] == DIFFERENT_BACKBONE
    assert rows["linear"].published[VTAB.key] != DIFFERENT_BACKBONE
    for task in SOME_VTAB:
        _at_size(root, task, "lora", 0, 224)  # the published resolution, set explicitly
    lora = next(row for row in build_board(root).rows if row.experiment == "lora")
    assert lora.published[VTAB.key] != DIFFERENT_BACKBONE
