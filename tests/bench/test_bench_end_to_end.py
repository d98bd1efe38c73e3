"""petl-bench end to end, in-process through the real engine: one tiny task, two methods, one seed, one epoch."""

from __future__ import annotations

import csv
import json

import pytest

from petl.bench import sweep
from petl.cli import bench as cli

pytest.importorskip("petl.train.runner", reason="petl.run.train has not landed")


@pytest.mark.slow
def test_petl_bench_trains_reports_and_resumes(tmp_path, capsys):
    args = [
        "suite=mini",
        "methods=linear,lora",
        "tasks=mini/digits",
        "seeds=0",
        "train.epochs=1",
        "data.subset=64",  # every split cut to 64 images: seconds on a CPU
        "model.pretrained=false",  # the flow, not the accuracy, is under test; no checkpoint needed
        "+model.kwargs.depth=1",  # one narrow block: the flow needs no depth
        "+model.kwargs.embed_dim=48",
        f"output_dir={tmp_path}",
        "progress=false",
    ]
    assert cli.main(args) == 0
    for experiment, method in (("linear", "linear"), ("lora", "lora")):
        run_dir = tmp_path / "mini-digits" / experiment / "seed0"
        result = json.loads((run_dir / "result.json").read_text())
        assert result["method"] == method and result["dataset"] == "mini/digits" and result["seed"] == 0
        assert (run_dir / "trainable.safetensors").is_file() and not (run_dir / sweep.LOCK_FILE).exists()
    lora = json.loads((tmp_path / "mini-digits/lora/seed0/result.json").read_text())
    assert lora["method_config"]["rank"] == 8 and lora["epochs"] == 1

    with (tmp_path / "leaderboard.csv").open() as f:
        rows = {row["experiment"]: row for row in csv.DictReader(f)}
    assert set(rows) == {"linear", "lora"}
    assert float(rows["lora"]["mini/digits_top1_mean"]) == pytest.approx(lora["test_top1"])
    assert float(rows["linear"]["trainable_no_head_M"]) == 0.0 and float(rows["lora"]["trainable_no_head_M"]) > 0
    assert (tmp_path / "leaderboard.html").is_file() and (tmp_path / "pareto.png").is_file()

    capsys.readouterr()
    assert cli.main(args) == 0  # everything done: nothing retrains
    assert "2 already done, 0 trained" in capsys.readouterr().out
