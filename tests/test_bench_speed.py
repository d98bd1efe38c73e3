"""The speed benchmark on the tiny backbone: a few steps, in-process, to check the table's shape and references."""

from __future__ import annotations

import pytest

import petl
from petl.bench.speed import FLOOR, PEFT_LORA, SpeedSpec, format_table, measure_in_subprocess, run_speed

TINY = SpeedSpec(case="", method={}, batch=2, steps=1, warmup=1, infer_steps=2)


@pytest.fixture(scope="module")
def results():
    if "lora" not in petl.list_methods():
        pytest.skip("petl.methods has no lora yet")
    return run_speed(TINY, [("full", {"name": "full"}), ("lora", {"name": "lora", "rank": 8})], True, lambda _: None)


def test_rows_and_references(results):
    assert list(results) == [FLOOR, "full", "lora", PEFT_LORA]
    assert results[FLOOR]["trainable"] == 0
    # peft's rank-8 LoRA on the whole fused qkv trains as many weights as petl's rank-8 LoRA on Q and V.
    assert results[PEFT_LORA]["trainable"] == results["lora"]["trainable"] < results["full"]["trainable"]
    assert "infer_merged_ms" in results["lora"] and "infer_merged_ms" not in results["full"]
    assert all(r["train_ms"] > 0 and r["infer_ms"] > 0 for r in results.values())


def test_table_has_ratios_to_each_reference(results):
    table = format_table(results, TINY, "test machine")
    floor_row = next(line for line in table.splitlines() if line.startswith(f"| {FLOOR}"))
    assert floor_row.split("|")[4].strip() == "1.00×"  # the floor against itself
    full_row = next(line for line in table.splitlines() if line.startswith("| full"))
    assert full_row.split("|")[5].strip() == "1.00×"
    assert "Merged inference" in table and "| lora |" in table and "Machine: test machine" in table


def test_worker_subprocess_reports_a_cpu_peak():
    if "linear" not in petl.list_methods():
        pytest.skip("petl.methods has no linear yet")
    result = measure_in_subprocess(SpeedSpec(case="linear", method={"name": "linear"}, batch=2, steps=1, warmup=1))
    assert result["trainable"] > 0 and result["peak_mb"] >= 0 and result["train_ms"] > 0
