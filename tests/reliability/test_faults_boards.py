"""Faults and bad input, boards pass: the leaderboards and their statistics on what a messy sweep leaves behind.

Each case goes through ``petl-bench report`` or ``petl-bench compare`` (their main) on a results folder written as a
sweep writes it: one method, one task, two methods on two tasks, ties everywhere, failed and diverged runs, saturated
tasks, damaged records, several seeds against one, no finished run, task names with spaces or unicode.  Each must
give one clear line, or a board that says what it left out: never a traceback, a NaN shown as a number, a silently
wrong rank, or a statistic on too little data that does not say so.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_faults_untrusted_files import petl_bench
from test_harness import write_run

THREE = (("lora", 80.0), ("linear", 70.0), ("mlp", 75.0))


def _runs(root: Path, methods=THREE, tasks=("mini/digits", "mini/mnist"), seeds=(0,)) -> Path:
    """A results folder as a sweep leaves it: every method on every task and seed (seed s adds s points)."""
    for method, top1 in methods:
        for task in tasks:
            for seed in seeds:
                write_run(root, task, method, seed, top1=top1 + seed)
    return root


def _page(capsys, *args: str) -> str:
    code, out, err = petl_bench(capsys, *args)
    assert code == 0 and "Traceback" not in err, err
    return out


# --- compare: rows of one task mean share their place --------------------------------------------------------------


def test_compare_gives_tied_rows_one_place_not_an_order_by_name(tmp_path, capsys):
    # Was: on a board where every method scores 70, the rows were ranked 1 to 4 by name, and the page said linear
    # "moved up 2 places" and lora "-1" against a board where they did differ.
    first = _runs(tmp_path / "a", (("lora", 80.0), ("linear", 70.0), ("mlp", 75.0), ("vpt_deep", 60.0)))
    tied = _runs(tmp_path / "b", (("lora", 70.0), ("linear", 70.0), ("mlp", 70.0), ("vpt_deep", 70.0)))
    page = _page(capsys, "compare", str(first), str(tied))
    assert "tie on" in page  # no coefficient: one board ranks none above another
    # Four rows tied: each takes the mean of places 1 to 4.
    assert "| lora | 1 | 80.00 | 2.5 | 70.00 | -1.5 |" in page
    assert "| linear | 3 | 70.00 | 2.5 | 70.00 | +0.5 |" in page
    assert "| vpt_deep | 4 | 60.00 | 2.5 | 70.00 | +1.5 |" in page


# --- the comparison section names the rows it does not rank ---------------------------------------------------------


def test_a_row_with_a_failed_run_is_named_where_the_rank_test_leaves_it_out(tmp_path, capsys):
    # Was: lora, the best row, had lost one seed to a failed run; the section said "Ranked: the 2 complete rows" and
    # grouped mlp and linear, and only a `*` in the main table told that lora was not among them.
    root = _runs(tmp_path, seeds=(0, 1, 2))
    (root / "mini-mnist" / "lora" / "seed1" / "result.json").unlink()  # the run failed: no record
    _page(capsys, "report", str(root))
    md = (root / "leaderboard.md").read_text()
    section = md[md.index("## Which differences are real") :]
    assert "Ranked: the 2 complete rows" in section
    assert "Not ranked, marked `*` in the table: lora (short of a task or seed)." in section
    # With one complete row no test runs; the line still names what it left out.
    lone = _runs(tmp_path / "lone", (("lora", 80.0), ("linear", 70.0)), seeds=(0, 1))
    (lone / "mini-digits" / "linear" / "seed1" / "result.json").unlink()
    _page(capsys, "report", str(lone))
    md = (lone / "leaderboard.md").read_text()
    assert "- Not tested: 1 complete row: a comparison needs two. Not ranked, marked `*` in the table: linear" in md


# --- a test over too few blocks says that no outcome could have passed ----------------------------------------------


def test_two_methods_on_two_tasks_say_that_no_outcome_could_tell_them_apart(tmp_path, capsys):
    # Was: "0 of the 1 pairs do" and an interval "1.00 – 1.00", read as a finding; over two blocks even lora first
    # on both tasks cannot pass (the exact sign test's p of one method winning both blocks is 0.5).
    root = _runs(tmp_path, (("lora", 80.0), ("linear", 70.0)))
    _page(capsys, "report", str(root))
    md = (root / "leaderboard.md").read_text()
    assert "**Too few blocks**: over 2 tasks no outcome could tell two methods apart: the sign test's p " in md
    assert "cannot go below 0.5 over 2 blocks, however the two rank. That no pair differs below is a count" in md
    assert "run the methods on more tasks." in md


def test_three_methods_on_two_tasks_say_friedman_could_not_reject(tmp_path, capsys):
    root = _runs(tmp_path)
    _page(capsys, "report", str(root))
    md = (root / "leaderboard.md").read_text()
    assert "p = 0.14: at α = 0.05, it does not reject" in md
    assert "**Too few blocks**: over 2 tasks no outcome could tell two methods apart: Friedman's p cannot go " in md


def test_enough_blocks_say_nothing_of_too_few(tmp_path, capsys):
    root = _runs(tmp_path, tasks=("mini/digits", "mini/mnist", "mini/textures"))  # 3 x 3: p can reach 0.05
    _page(capsys, "report", str(root))
    assert "Too few blocks" not in (root / "leaderboard.md").read_text()


def test_choose_over_two_seeds_says_no_outcome_could_tell_the_best_two_apart(tmp_path):
    from petl.bench import choice, report

    root = _runs(tmp_path, (("lora", 80.0), ("linear", 79.0)), tasks=("mini/digits",), seeds=(0, 1))
    text = choice.choose(report.build_board(root), choice.Budget()).paragraph
    assert "**lora** and **linear** cannot be told apart on this data" in text
    assert "over 2 seeds no outcome could tell them apart: the sign test's p cannot go below 0.5 over 2" in text


# --- a record is checked against the config it embeds: its model too ------------------------------------------------


def test_a_record_whose_model_was_edited_by_hand_is_named_and_left_out(tmp_path, capsys):
    # Was: read as a run of the edited backbone; the board said "Measured by petl on A, B" and averaged the seed
    # with the others of its cell (a run's published figures and a suite's backbone check read this field).
    import json

    root = _runs(tmp_path, seeds=(0, 1))
    for path in root.rglob("result.json"):  # records as petl writes them: with the config they ran
        record = json.loads(path.read_text())
        config = {"method": {"name": record["method"]}, "data": {"name": record["dataset"]}, "seed": record["seed"]}
        path.write_text(json.dumps({**record, "config": {**config, "model": {"name": record["model"]}}}))
    edited = root / "mini-mnist" / "lora" / "seed1" / "result.json"
    edited.write_text(json.dumps({**json.loads(edited.read_text()), "model": "vit_base_patch16_224.orig_in21k"}))
    code, _, err = petl_bench(capsys, "report", str(root))
    assert code == 0 and "Traceback" not in err, err
    assert f"skipping {edited}: model 'vit_base_patch16_224.orig_in21k' is not the model of the config" in err
    md = (root / "leaderboard.md").read_text()
    assert "orig_in21k" not in md.split("## Legend")[1].split("\n")[2]  # "Measured by petl on" names one backbone
    assert "| lora * |" in md and "1 result.json file was skipped" in md


def test_two_seeds_of_a_cell_on_two_backbones_are_refused_without_a_config_to_compare(tmp_path, capsys):
    # Was: records without a config (hand-made, another tool's) were not compared, so a cell averaged a seed on one
    # backbone with a seed on another as seed noise.
    import json

    root = _runs(tmp_path, seeds=(0, 1))
    edited = root / "mini-mnist" / "lora" / "seed1" / "result.json"
    edited.write_text(json.dumps({**json.loads(edited.read_text()), "model": "vit_small_patch16_224"}))
    code, _, err = petl_bench(capsys, "report", str(root))
    assert code == 2 and "Traceback" not in err and err.count("\n") == 1, err
    assert f"mini/mnist lora: {edited} is not another seed of " in err
    assert "(model: 'vit_fractal_tiny_patch4_32.fractaldb' -> 'vit_small_patch16_224')" in err


def test_the_compute_line_counts_one_run_and_one_trial_in_the_singular(tmp_path, capsys):
    import json

    root = _runs(tmp_path, (("lora", 80.0),), tasks=("mini/digits",))
    trial = root / "mini-digits" / "lora" / "search" / "lr0.1" / "result.json"  # a selection trial: val only
    trial.parent.mkdir(parents=True)
    record = json.loads((root / "mini-digits" / "lora" / "seed0" / "result.json").read_text())
    trial.write_text(json.dumps({**record, "test_top1": None}))
    _page(capsys, "report", str(root))
    assert "**Compute**: 1 reported run and 1 selection trial (every" in (root / "leaderboard.md").read_text()


# --- the ordering is compared with a published one only on benchmark tasks -----------------------------------------


def test_an_unregistered_task_is_no_benchmark_task_and_gets_no_published_ordering(tmp_path, capsys):
    # Was: "my data" (no task petl registers) was put in group "other" and the board's order on it was compared
    # with the published VTAB-1k ordering, as if it were a benchmark task.
    methods = (("lora", 80.0), ("linear", 70.0), ("vpt_deep", 75.0))  # each names a published row
    for tasks in (("my data",), ("mini/digits", "my data")):
        root = _runs(tmp_path / str(len(tasks)), methods, tasks=tasks)
        code, out, err = petl_bench(capsys, "report", str(root))
        assert code == 0 and "Traceback" not in err, err
        md = (root / "leaderboard.md").read_text()
        assert "Rank correlation with the published" not in md + out and "groups —" not in md
    # A registered benchmark's task keeps both.
    root = _runs(tmp_path / "mini", methods, tasks=("mini/digits",))
    _page(capsys, "report", str(root))
    md = (root / "leaderboard.md").read_text()
    assert "Rank correlation with the published vtab1k ordering**: Spearman's rho" in md and "groups —" in md


# --- a row whose tasks ran on different backbones -------------------------------------------------------------------


def test_a_row_whose_tasks_ran_on_different_backbones_is_named_and_not_ranked(tmp_path, capsys):
    # Was: lora ran mnist on another backbone than digits and textures; its task mean averaged the two models, and it
    # was ranked with the others (only "Measured by petl on A, B" hinted at it).
    import json

    root = _runs(tmp_path, tasks=("mini/digits", "mini/mnist", "mini/textures"))
    edited = root / "mini-mnist" / "lora" / "seed0" / "result.json"
    edited.write_text(json.dumps({**json.loads(edited.read_text()), "model": "vit_small_patch16_224"}))
    _page(capsys, "report", str(root))
    md = (root / "leaderboard.md").read_text()
    assert "| lora * |" in md
    assert (
        "**Mixed backbones**: the tasks of 1 row ran on different backbones, so its task mean averages different "
        "models and compares with no other row's; marked `*`, not ranked" in md
    )
    assert "lora (vit_fractal_tiny_patch4_32.fractaldb: digits, textures; vit_small_patch16_224: mnist)." in md
    section = md[md.index("## Which differences are real") :]
    assert "Ranked: the 2 complete rows" in section
    assert "Not ranked, marked `*` in the table: lora (on vit_fractal_tiny_patch4_32.fractaldb, vit_small" in section
    # A suite's progress names it apart from the rows short of a task or seed.
    from petl.bench import report

    tasks = ("mini/digits", "mini/mnist", "mini/textures")
    board = report.build_board(root, plan=report.Plan("mini", ("lora", "linear", "mlp"), tasks, (0,)))
    line = report.progress(board)
    assert "Complete rows (2): linear, mlp." in line and "Short of a task" not in line
    assert "On different backbones, marked `*` and not ranked (1): lora." in line
    # A board on one backbone per row says nothing of it.
    plain = _runs(tmp_path / "plain")
    _page(capsys, "report", str(plain))
    assert "Mixed backbones" not in (plain / "leaderboard.md").read_text()


# --- one task, rows on different seeds ------------------------------------------------------------------------------


def test_one_task_with_rows_on_different_seeds_says_they_share_none(tmp_path, capsys):
    # Was: "0 seeds to rank over: a comparison needs two (seeds=0,1,2 gives three)", though each row had two seeds:
    # more seeds would not help, the same ones would.
    from test_harness import write_run

    for method, top1, seeds in (("lora", 80.0, (0, 1)), ("linear", 70.0, (2, 3))):
        for seed in seeds:
            write_run(tmp_path, "mini/digits", method, seed, top1=top1 + seed)
    _page(capsys, "report", str(tmp_path))
    md = (tmp_path / "leaderboard.md").read_text()
    assert "seeds=0,1,2" not in md
    assert (
        "Not tested: the complete rows share 0 seeds of the one task (lora: 0, 1; linear: 2, 3): a comparison needs "
        "two seeds every row ran; run the same seeds for every experiment." in md
    )


# --- the published ordering of rows that all tie --------------------------------------------------------------------


def test_the_published_ordering_line_says_that_the_rows_all_tie(tmp_path, capsys):
    root = _runs(tmp_path, (("lora", 70.0), ("linear", 70.0), ("vpt_deep", 70.0)))
    _page(capsys, "report", str(root))
    assert (
        "not computed: the 3 complete rows that name a published row (linear, lora, vpt_deep) all tie here, at a "
        "task mean of 70.00, so there is no ordering to compare." in (root / "leaderboard.md").read_text()
    )


# --- a final without a test score is no selection trial -------------------------------------------------------------


def test_a_final_without_a_test_score_is_counted_apart_from_the_selection_trials(tmp_path, capsys):
    # Was: a seed folder's record with no test score (a hand-made "diverged") was counted as a selection trial.
    import json

    root = _runs(tmp_path, (("lora", 80.0), ("linear", 70.0)), tasks=("mini/digits",), seeds=(0, 1))
    final = root / "mini-digits" / "lora" / "seed1" / "result.json"
    final.write_text(json.dumps({**json.loads(final.read_text()), "test_top1": None, "diverged": "loss is nan"}))
    _page(capsys, "report", str(root))
    md = (root / "leaderboard.md").read_text()
    assert (
        "**Compute**: 3 reported runs, 0 selection trials and 1 run in a seed folder without a test score (a final "
        "that diverged or skipped its test pass; not in the table: mini-digits/lora/seed1) (every result.json" in md
    )


# --- two runs of one cell ------------------------------------------------------------------------------------------


def test_two_runs_of_one_cell_on_two_backbones_are_refused_not_one_dropped(tmp_path, capsys):
    # Was: petl-run's default folders (<data>/<model>/<method>/seed<k>) read from <data>/ gave every cell two runs of
    # one seed, one per backbone; the report kept the first by path, dropped the other backbone's runs with a
    # warning on stderr, and the board said nothing of them.
    import json

    for model in ("vit_fractal_tiny_patch4_32.fractaldb", "vit_small_patch16_224"):
        _runs(tmp_path / model)
        for path in (tmp_path / model).rglob("result.json"):
            path.write_text(json.dumps({**json.loads(path.read_text()), "model": model}))
    code, _, err = petl_bench(capsys, "report", str(tmp_path), f"out={tmp_path / 'board'}")
    assert code == 2 and "Traceback" not in err and err.count("\n") == 1, err
    assert "are two runs of mini/digits linear seed 0 (model: 'vit_fractal_tiny_patch4_32.fractaldb' -> " in err
    assert "report their folders apart, or move one run aside" in err and not (tmp_path / "board").exists()
    # A copy of the same run (a folder copied inside the results) is read once, with a warning.
    copy = _runs(tmp_path / "copy")
    _runs(copy / "backup")
    code, _, err = petl_bench(capsys, "report", str(copy))
    assert code == 0 and "already read from" in err, err


# --- an out= nothing can be written in -----------------------------------------------------------------------------


def test_an_out_that_cannot_be_written_is_bad_input_named_in_one_line(tmp_path, capsys):
    # Was: report out=FILE failed on the first file written, "FileExistsError: [Errno 17] ..." with exit 1; compare
    # out= in a folder that cannot be written named only its temporary file, after both boards were built.
    root = _runs(tmp_path / "runs")
    (tmp_path / "afile").write_text("mine\n")
    code, _, err = petl_bench(capsys, "report", str(root), f"out={tmp_path / 'afile'}")
    assert code == 2 and err.count("\n") == 1, err
    assert f"out={tmp_path / 'afile'} is a file, not a folder: choose another out=" in err
    code, _, err = petl_bench(capsys, "compare", str(root), str(root), f"out={tmp_path / 'afile' / 'page.md'}")
    assert code == 2 and err.count("\n") == 1, err
    assert f"out={tmp_path / 'afile' / 'page.md'}: {tmp_path / 'afile'} is a file, not a folder: choose another" in err
    assert (tmp_path / "afile").read_text() == "mine\n"


# --- one task left of two, the other saturated: the section says which --------------------------------------------


def test_seed_blocks_name_their_task_and_the_saturated_task_left_out(tmp_path, capsys):
    # Was: on a board of digits and a saturated textures, the section said "the 3 seeds of the one task" without
    # naming digits, nor that textures was left out (a two-task board read as one task).
    _runs(tmp_path, tasks=("mini/digits",), seeds=(0, 1, 2))
    _runs(tmp_path, (("lora", 97.5), ("linear", 97.0), ("mlp", 97.2)), tasks=("mini/textures",), seeds=(0, 1, 2))
    _page(capsys, "report", str(tmp_path))
    md = (tmp_path / "leaderboard.md").read_text()
    assert "**Blocks**: the 3 seeds of the one task, digits (task × seed); textures left out as saturated." in md


# --- a p just below α is not shown as α --------------------------------------------------------------------------


def test_a_p_just_below_alpha_is_shown_with_the_digits_that_keep_it_below(tmp_path, capsys):
    # Was: three methods in one order on three tasks give Friedman's p = exp(-3) = 0.0498, shown "p = 0.05: at
    # α = 0.05, the methods do not all rank alike", which reads as a contradiction (choose printed its p alike).
    root = _runs(tmp_path, tasks=("mini/digits", "mini/mnist", "mini/textures"))
    _page(capsys, "report", str(root))
    md = (root / "leaderboard.md").read_text()
    assert "chi-square = 6.00, p = 0.0498: at α = 0.05, the methods do not all rank alike." in md
    # choose's verdicts print their p the same way.
    from petl.bench.ranking import show_p

    assert [show_p(p) for p in (0.049787, 0.04999, 0.0504, 0.14, 8.4e-13)] == [
        "0.0498",
        "0.04999",
        "0.05",
        "0.14",
        "8.4e-13",
    ]


# --- compare's page escapes the names it prints, as the leaderboard does --------------------------------------------


def test_compare_escapes_names_so_that_none_adds_a_column_or_html(tmp_path, capsys):
    # Was: an experiment folder named "c|d" split its table row into one column more, shifting its figures under the
    # wrong headers, and "<b>x" went into the page as HTML (leaderboard.md escaped both).
    root = _runs(tmp_path, (("c|d", 80.0), ("<b>x", 70.0), ("mlp", 75.0)))
    page = _page(capsys, "compare", str(root), str(root))
    assert "| c\\|d | 1 | 80.00 | 1 | 80.00 | +0 |" in page
    assert "| &lt;b&gt;x | 3 | 70.00 | 3 | 70.00 | +0 |" in page and "<b>" not in page


# --- a damaged metrics.jsonl spoils its line, not the report ---------------------------------------------------------


@pytest.mark.parametrize(
    "last",
    [
        b'{"epoch": 5, "val_top1": "x"}',
        b'{"epoch": 5, "val_top1": [1]}',
        b'{"epoch": 5, "val_top1": 1e999}',
        b"\xff\xfe",
    ],
)
def test_a_damaged_metrics_line_is_skipped_not_read_as_an_accuracy(tmp_path, capsys, last):
    # Was: "x" failed the report ("could not convert string to float: 'x'", no file named), [1] failed it with a
    # TypeError (exit 1), a non-UTF-8 byte with "'utf-8' codec can't decode", and 1e999 flagged the cell as still
    # learning by +inf points.
    root = _runs(tmp_path, tasks=("mini/digits", "mini/mnist", "mini/textures"))
    epochs = b"".join(b'{"epoch": %d, "loss": %d, "val_top1": 50}\n' % (e, 5 - e) for e in range(1, 5))
    (root / "mini-digits" / "lora" / "seed0" / "metrics.jsonl").write_bytes(epochs + last + b"\n")
    _page(capsys, "report", str(root))
    md = (root / "leaderboard.md").read_text()
    assert "| lora | low-rank | 0.0010 (1.00%) | +0.00 (max 0.00) |" in md and "inf" not in md


def test_a_selected_trial_whose_folder_is_no_text_has_no_curve(tmp_path, capsys):
    # Was: a hand-edited "selection" whose chosen trial's output_dir was 5 failed the report with "TypeError: expected
    # str, bytes or os.PathLike object, not int" (exit 1): the reader checks only that trials are mappings.
    import json

    root = _runs(tmp_path, tasks=("mini/digits", "mini/mnist", "mini/textures"))
    edited = root / "mini-digits" / "lora" / "seed0" / "result.json"
    selection = {"chosen": ["train.lr=0.1"], "trials": [{"overrides": ["train.lr=0.1"], "output_dir": 5}]}
    edited.write_text(json.dumps({**json.loads(edited.read_text()), "selection": selection}))
    _page(capsys, "report", str(root))
    assert "| lora | low-rank | 0.0010 (1.00%) | – |" in (root / "leaderboard.md").read_text()


@pytest.mark.parametrize("folder", ["../elsewhere", "/elsewhere/../elsewhere"])
def test_a_selected_trial_whose_folder_leaves_the_results_is_not_read_and_named(tmp_path, capsys, folder):
    # Was: an edited output_dir "../elsewhere" read <experiment>/../elsewhere/metrics.jsonl, another folder's curve
    # shown as this run's convergence: a record is checked, never trusted.
    import json

    root = _runs(tmp_path, tasks=("mini/digits", "mini/mnist", "mini/textures"))
    elsewhere = root / "mini-digits" / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "metrics.jsonl").write_text("".join(f'{{"epoch": {e}, "val_top1": {40 + e}}}\n' for e in (1, 2, 3)))
    edited = root / "mini-digits" / "lora" / "seed0" / "result.json"
    selection = {"chosen": ["train.lr=0.1"], "trials": [{"overrides": ["train.lr=0.1"], "output_dir": folder}]}
    edited.write_text(json.dumps({**json.loads(edited.read_text()), "selection": selection}))
    code, _, err = petl_bench(capsys, "report", str(root))
    assert code == 0 and "| lora | low-rank | 0.0010 (1.00%) | – |" in (root / "leaderboard.md").read_text()
    said = f"petl-bench: warning: {edited}: selection trial output_dir {folder!r} leaves the results folder: its curve"
    assert said in err, err


def test_an_empty_out_is_refused_not_read_as_the_current_folder(tmp_path, capsys, monkeypatch):
    # Was: report out= wrote the board into the current folder (Path("") is ".") and said "-> /leaderboard.{md,...}".
    root = _runs(tmp_path / "runs")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    code, _, err = petl_bench(capsys, "report", str(root), "out=")
    assert code == 2 and err.count("\n") == 1, err
    assert "out= names no folder: give out=DIR, or leave out= out to write into RESULTS_DIR" in err
    assert not any(work.iterdir())
    code, _, err = petl_bench(capsys, "compare", str(root), str(root), "out=")
    assert code == 2 and "out= names no file: give out=FILE.md" in err, err


def test_a_results_folder_that_is_none_says_so_and_what_to_give(tmp_path, capsys):
    # Was: "no usable result.json under X" for a folder that does not exist, a file, and an empty folder alike.
    (tmp_path / "afile").write_text("x\n")
    (tmp_path / "empty").mkdir()
    for given, said in (
        ("missing", "missing does not exist: give the folder a sweep or petl-run wrote its runs into"),
        ("afile", "afile is a file: give the folder a sweep or petl-run wrote its runs into"),
        ("empty", "no usable result.json under "),
    ):
        code, _, err = petl_bench(capsys, "report", str(tmp_path / given))
        assert code == 2 and err.count("\n") == 1 and said in err, err
    assert "its runs into (<task>/<experiment>/seed<k>/result.json)" in err
