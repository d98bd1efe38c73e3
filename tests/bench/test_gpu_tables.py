"""benchmarks/device/gpu_tables.sh, the CUDA tables' one device call, run here in its --cpu mode (tiny settings).

Its numbers mean nothing on a CPU: these tests check the script's logic (every part, the deadlines, the tables it
assembles) and the benchmark scripts' titles, which name the device they ran on.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from petl.utils import precision

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "device" / "gpu_tables.sh"


def _tables(out: Path, **env: str) -> subprocess.CompletedProcess:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    env = {**os.environ, "OUT": str(out), "PATH": path, "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", str(SCRIPT), "--cpu"], cwd=REPO, env=env, capture_output=True, text=True)


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_part_past_its_deadline_is_skipped_and_the_speed_table_says_so(tmp_path):
    ends = dict.fromkeys(("SPEED_LORA_END", "SPEED_METHODS_END", "MULTITASK_END", "SERVE_END"), "0")
    done = _tables(tmp_path, **ends)
    assert done.returncode == 0, done.stderr
    log = (tmp_path / "gpu_tables.log").read_text()
    for part in ("speed_lora", "speed_methods", "multitask", "serve"):
        assert f"{part}: skipped, no time left before its deadline (0 s)" in log
    speed = (tmp_path / "speed_cuda.md").read_text()
    assert "## speed_lora: not finished by its deadline" in speed and "## speed_methods: not finished" in speed


@pytest.mark.slow
def test_the_cpu_mode_makes_every_table(tmp_path):
    done = _tables(tmp_path, BUDGET="900")
    assert done.returncode == 0, done.stderr
    log = (tmp_path / "gpu_tables.log").read_text()
    assert all(f"{part}: exit 0" in log for part in ("speed_lora", "speed_methods", "multitask", "serve")), log
    assert "graph: skipped, a CUDA graph needs a GPU" in log and not (tmp_path / "multitask_graph_cuda.md").exists()
    speed = (tmp_path / "speed_cuda.md").read_text()
    assert speed.count("## petl speed: vit_fractal_tiny_patch4_32 at 32 px on cpu") == 2 and "| Precision |" in speed
    assert "| lora + bf16 autocast | bf16 autocast |" in speed and "| linear | fp32 |" in speed
    multitask = (tmp_path / "multitask_cuda.md").read_text()
    assert multitask.startswith("# Serving 8 tasks") and "per task (CPU)" in multitask.splitlines()[0]
    assert "| 8 LoRA tasks | 8 (1) |" in multitask and "| 8 methods | 8 (1) |" in multitask
    profile = (tmp_path / "multitask_cuda_profile.md").read_text()
    assert profile.startswith("# Where a mixed batch spends its time") and "## 8 methods, batch 8" in profile
    serve = (tmp_path / "serve_cuda.md").read_text()
    # petl-serve serves on the GPU wherever torch sees one, whatever the script's mode, in its default precision.
    if torch.cuda.is_available():
        served = precision.auto_precision("cuda")
        where = f"({precision.describe(served, 'cuda')} on GPU {torch.cuda.get_device_name()}, precision=auto)"
    else:
        where = "(fp32 on the CPU, precision=auto)"
    assert serve.splitlines()[0].endswith(f"servers {where}") and "| 1 server |" in serve


def test_the_multitask_title_names_the_device_and_what_it_left_out():
    multitask = _script("multitask_speed")
    assert multitask.device_words("cpu", "float32") == "CPU"
    assert multitask.device_words("cpu", "bfloat16") == "CPU, bfloat16"
    seconds = dict.fromkeys(multitask.CASES, 0.1)
    table = multitask.render(
        {("8 LoRA tasks", 8): seconds}, "m", 1, "cmd", (0.0, 0.0), missing=["8 methods at batch 8"]
    )
    assert table.splitlines()[0].endswith("per task (CPU)")
    assert "Not measured: the --deadline had passed before 8 methods at batch 8." in table


def test_a_multitask_run_cut_off_leaves_its_finished_rows_said_to_be_partial(tmp_path, monkeypatch):
    """gpu_tables.sh's part ends in `timeout`'s kill, or a CUDA graph's device-side assert ends the process: the table
    and profile were written at the end only, so the rows measured before were lost with the rest."""
    multitask = _script("multitask_speed")
    monkeypatch.setattr(multitask, "build_cases", lambda *args: None)
    monkeypatch.setattr(multitask, "profile", lambda calls, device: {})
    measured, cut_off = [], [True]

    def measure(calls, rounds, device):
        if measured and cut_off[0]:
            raise RuntimeError("stands for the process killed during its second row")
        measured.append(1)
        return dict.fromkeys(multitask.CASES, 0.1)

    monkeypatch.setattr(multitask, "measure", measure)
    out, profile = tmp_path / "multitask.md", tmp_path / "profile.md"
    argv = ["--sets", "lora,methods", "--batches", "8", "--out", str(out), "--profile", str(profile)]
    with pytest.raises(RuntimeError, match="second row"):
        multitask.main(argv)
    table = out.read_text()
    assert "| 8 LoRA tasks | 8 (1) |" in table and "| 8 methods |" not in table
    assert "**Partial table**" in table and "before 8 methods at batch 8." in table
    # The profile beside it says so too: copied in without the table, it read as the whole run's.
    assert "## 8 LoRA tasks, batch 8" in profile.read_text() and "## 8 methods" not in profile.read_text()
    assert "**Partial table**" in profile.read_text() and "before 8 methods at batch 8." in profile.read_text()
    cut_off[0] = False
    multitask.main(argv)  # a run that ends writes the whole table, not said to be partial
    assert "| 8 methods | 8 (1) |" in out.read_text() and "Partial" not in out.read_text()
    assert "## 8 methods, batch 8" in profile.read_text() and "Partial" not in profile.read_text()


def test_a_serve_load_run_cut_off_leaves_its_finished_rows_said_to_be_partial(tmp_path, monkeypatch):
    """As the multitask part: serve_load.py wrote its table at the end only, so a part killed at its deadline
    (servers slow to start, a GPU fault in one) lost the rows it had measured."""
    serve_load = _script("serve_load")
    figures = dict.fromkeys(("rps", "p50", "p99", "rows_per_batch", "tasks_per_batch", "graphed", "rss", "uss"), 1.0)
    row = {"backbone": "tiny", "tasks": 1, "methods": "lora", "one": figures, "separate": figures}

    def bench_backbone(key, counts, args, folder):
        args.row_done([row])
        raise RuntimeError("stands for the part killed before its next row")

    monkeypatch.setattr(serve_load, "bench_backbone", bench_backbone)
    monkeypatch.setattr(serve_load.signal, "signal", lambda *args: None)  # not this process's SIGTERM
    out = tmp_path / "serve.md"
    monkeypatch.setattr(sys, "argv", ["serve_load.py", "--backbones", "default", "--out", str(out)])
    with pytest.raises(RuntimeError, match="next row"):
        serve_load.main()
    table = out.read_text()
    assert "| tiny | 1 | 1 server |" in table and "**Partial table**" in table


def test_the_multitask_table_gives_a_graph_its_own_column_and_ratio():
    multitask = _script("multitask_speed")
    seconds = {**dict.fromkeys(multitask.CASES, 0.1), multitask.GRAPH: 0.05}
    table = multitask.render({("8 methods", 64): seconds}, "m", 1, "cmd", (0.0, 0.0))
    header, rule, row = (line for line in table.splitlines() if line.startswith("|"))
    assert header.count("|") == rule.count("|") == row.count("|") == 12
    assert header.endswith(
        "| MultiTask, CUDA graph img/s | MultiTask × 8 separate | MultiTask × backbone 8 times | "
        "MultiTask × backbone once | CUDA graph × backbone once |"
    )
    assert row.endswith("| 640 | 1280 | 1.00× | 1.00× | 1.00× | 2.00× |") and "the second time the layout came" in table
    assert "CUDA graph" not in multitask.render(
        {("8 methods", 64): dict.fromkeys(multitask.CASES, 0.1)}, "m", 1, "cmd", (0.0, 0.0)
    )


def test_the_multitask_profile_names_each_case_s_busy_time_and_costliest_ops():
    multitask = _script("multitask_speed")
    square = torch.ones(64, 64)
    calls = {multitask.CASES[0]: lambda: square @ square, multitask.CASES[3]: lambda: square + square}
    summary = multitask.profile(calls, "cpu")
    assert list(summary) == [multitask.CASES[0], multitask.CASES[3]]
    mixed, once = summary.values()
    # Which op costs most is a timing (aten::matmul's own dispatch can outlast a 64 x 64 mm on a busy CPU, as it did
    # once): the costliest ops name each case's op, in whichever order.
    assert "aten::mm" in [op[0] for op in mixed["top"]] and "aten::add" in [op[0] for op in once["top"]]
    assert mixed["busy"] > 0 and mixed["ops"] >= 1 and mixed["kernels"] is None
    timed = {("8 methods", 64): {multitask.CASES[0]: 0.002}}
    table = multitask.render_profile({("8 methods", 64): summary}, timed, "m", "cmd", "cpu", "float32")
    assert "## 8 methods, batch 64" in table
    assert f"| {multitask.CASES[0]} | 2.00 | {mixed['busy'] * 1e3:.2f} | {mixed['ops']} | - |" in table
    assert f"| {multitask.CASES[3]} | - |" in table and "| `aten::mm` | 1 |" in table


@pytest.mark.cuda
def test_a_cuda_multitask_title_names_the_gpu():
    multitask = _script("multitask_speed")
    assert multitask.device_words("cuda", "bfloat16") == f"{torch.cuda.get_device_name()}, bfloat16"


@pytest.mark.cuda
def test_a_cuda_multitask_profile_counts_the_gpu_s_kernels_and_their_time():
    multitask = _script("multitask_speed")
    square = torch.ones(256, 256, device="cuda")
    calls = {multitask.CASES[0]: lambda: square @ square, multitask.CASES[3]: lambda: square + square}
    mixed, once = multitask.profile(calls, "cuda").values()
    assert mixed["kernels"] >= 1 and once["kernels"] >= 1
    assert mixed["busy"] > 0 and mixed["top"][0][0] == "aten::mm" and once["top"][0][0] == "aten::add"
