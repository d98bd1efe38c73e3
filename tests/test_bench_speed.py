"""The speed benchmark on the tiny backbone: a few steps, in-process, to check the table's shape and references."""

from __future__ import annotations

import pytest

from petl.bench import cli
from petl.bench.speed import FLOOR, PEFT_LORA, SpeedSpec, format_table, measure_memory_in_subprocess, run_speed

TINY = SpeedSpec(batch=2, steps=2, warmup=1, rounds=2, infer_steps=2)


@pytest.fixture(scope="module")
def results():
    cases = [("full", {"name": "full"}), ("lora", {"name": "lora", "rank": 8})]
    return run_speed(TINY, cases, inprocess=True, log=lambda _: None)


def test_rows_and_references(results):
    assert list(results) == [FLOOR, "full", "lora", PEFT_LORA]
    assert results[FLOOR]["trainable"] == 0
    # peft's rank-8 LoRA on the whole fused qkv trains as many weights as petl's rank-8 LoRA on Q and V.
    assert results[PEFT_LORA]["trainable"] == results["lora"]["trainable"] < results["full"]["trainable"]
    assert "infer_merged_ms" in results["lora"] and "infer_merged_ms" not in results["full"]
    assert all(r["train_ms"] > 0 and r["infer_ms"] > 0 and r["peak_mb"] >= 0 for r in results.values())


def test_table_has_ratios_to_each_reference(results):
    table = format_table(results, TINY, "test machine")
    main_table = table.split("Merged inference")[0]
    rows = {line.split("|")[1].strip(): line.split("|") for line in main_table.splitlines() if line.startswith("| ")}
    assert rows[FLOOR][4].strip() == "1.00×"  # the floor against itself
    assert rows["full"][5].strip() == "1.00×" and rows[PEFT_LORA][6].strip() == "1.00×"
    ratio = results["lora"]["train_ms"] / results["full"]["train_ms"]
    assert rows["lora"][5].strip() == f"{ratio:.2f}×"
    assert "Merged inference" in table and "Machine: test machine" in table


def test_cpu_peak_counts_what_full_fine_tuning_allocates():
    # Gradients plus two AdamW moments for ~2.7M float32 weights are ~32 MB; the floor allocates none of them
    # (only forward temporaries, ~17 MB here).
    # Measured in fresh processes as the tool does: in this process, memory freed by earlier tests is reused
    # without raising the high-water mark, so an in-process reading depends on test order.
    full = measure_memory_in_subprocess("full", {"name": "full"}, TINY)
    floor = measure_memory_in_subprocess(FLOOR, {}, TINY)
    assert full["peak_mb"] > 32 and full["peak_mb"] > 2 * floor["peak_mb"]


def test_speed_cli_rejects_unknown_keys():
    with pytest.raises(SystemExit, match="unknown argument"):
        cli.main(["speed", "batchsize=3"])
