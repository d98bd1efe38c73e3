"""Faults and bad input, boards pass: the leaderboards and their statistics on what a messy sweep leaves behind.

Each case goes through ``petl-bench report`` or ``petl-bench compare`` (their main) on a results folder written as a
sweep writes it: one method, one task, two methods on two tasks, ties everywhere, failed and diverged runs, saturated
tasks, damaged records, several seeds against one, no finished run, task names with spaces or unicode.  Each must
give one clear line, or a board that says what it left out: never a traceback, a NaN shown as a number, a silently
wrong rank, or a statistic on too little data that does not say so.
"""

from __future__ import annotations

from pathlib import Path

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

