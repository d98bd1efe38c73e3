"""result.json's one reader checks every field: type, range, version, and agreement with the config it embeds."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from petl.store.result import CHECKED_FIELDS, RESULT_VERSION, ResultError, RunResult, read_result

REPO = Path(__file__).resolve().parents[2]


def _record(**changes) -> dict:
    record = RunResult(
        method="lora",
        dataset="mini/digits",
        seed=1,
        num_classes=10,
        trainable_params=1100,
        trainable_params_no_head=1000,
        total_params=100_000,
        val_top1=50.0,
        test_top1=52.5,
        final_train_loss=1.25,
        train_seconds=3.0,
        class_names=[str(i) for i in range(10)],
        config={"method": {"name": "lora"}, "data": {"name": "mini/digits"}, "seed": 1},
    ).to_json()
    record.update(changes)
    return record


def test_every_field_is_in_one_checked_group():
    # A field added to RunResult without a check would be read unchecked: field_problem raises KeyError for it.
    assert sorted(CHECKED_FIELDS) == sorted(f.name for f in dataclasses.fields(RunResult))
    assert len(CHECKED_FIELDS) == len(set(CHECKED_FIELDS))


def test_a_good_record_reads_back_as_written():
    record = _record(final_train_loss=2, wall_seconds=None, unknown_key={"kept": True})
    result = RunResult.from_json(json.loads(json.dumps(record)))
    assert result.to_json() == record and result.extra == {"unknown_key": {"kept": True}}


@pytest.mark.parametrize(
    ("field", "value", "what"),
    [
        ("final_train_loss", "abc", "a finite number"),
        ("final_train_loss", [1], "a finite number"),
        ("final_train_loss", float("nan"), "a finite number"),
        ("num_classes", "ten", "an integer of at least 1"),
        ("num_classes", 0, "an integer of at least 1"),
        ("num_classes", True, "an integer of at least 1"),
        ("test_top1", 1234.5, "a percentage from 0 to 100"),
        ("test_top1", -5, "a percentage from 0 to 100"),
        ("test_top1", "abc", "a percentage from 0 to 100"),
        ("val_top1", float("inf"), "a percentage from 0 to 100"),
        ("seed", 1.7, "an integer of at least 0"),
        ("seed", -1, "an integer of at least 0"),
        ("seed", "1", "an integer of at least 0"),
        ("seed", None, "an integer of at least 0"),
        ("trainable_params", 1100.0, "an integer of at least 0"),
        ("total_params", 0, "an integer of at least 1"),
        ("train_seconds", -1.0, "a non-negative number"),
        ("method", "", "a name"),
        ("dataset", 7, "a name"),
        ("pretrained", "yes", "true or false"),
        ("model", 3, "text"),
        ("class_names", [0, 1], "a list of text"),
        ("config", [1], "a mapping"),
        ("selection", {"trials": ["x"]}, "a mapping whose trials are a list of mappings"),
    ],
)
def test_a_malformed_or_out_of_range_field_is_refused_naming_it(field, value, what):
    with pytest.raises(ResultError, match=r"^r\.json: field ") as caught:
        RunResult.from_json(_record(**{field: value}), "r.json")
    assert str(caught.value).startswith(f"r.json: field {field!r} is ") and str(caught.value).endswith(f"not {what}")


@pytest.mark.parametrize(
    ("version", "message"),
    [
        (0, "result version 0 was never written by petl (versions 1 to 1)"),
        (-3, "result version -3 was never written by petl"),
        (True, "result version True is not a version number (an integer; this petl writes 1)"),
        ("1", "result version '1' is not a version number"),
        (None, "result version None is not a version number"),
        (1.0, "result version 1.0 is not a version number"),
        (RESULT_VERSION + 1, f"result version {RESULT_VERSION + 1} is newer than this petl reads"),
    ],
)
def test_a_version_is_an_integer_petl_knows_and_each_refusal_says_why(version, message):
    with pytest.raises(ResultError) as caught:
        RunResult.from_json(_record(version=version), "r.json")
    assert str(caught.value).startswith(f"r.json: {message}")
    assert RunResult.from_json({k: v for k, v in _record().items() if k != "version"}).version == 1  # before versions


@pytest.mark.parametrize(
    ("field", "value"), [("method", "vpt"), ("dataset", "mini/mnist"), ("seed", 0)]
)  # fmt: skip
def test_a_record_whose_method_dataset_or_seed_is_not_its_configs_is_refused(field, value):
    with pytest.raises(ResultError, match=rf"^r\.json: {field} {value!r} is not the {field} of the config it records"):
        RunResult.from_json(_record(**{field: value}), "r.json")


def test_a_diverged_trial_from_before_names_its_experiment_and_reads():
    # _diverged_result wrote the experiment's name (adapter_sequential) as the method until it wrote the config's.
    record = _record(method="adapter_sequential", diverged="loss is nan", test_top1=None, val_top1=None)
    assert RunResult.from_json(record).method == "adapter_sequential"


def test_a_record_without_a_method_takes_its_configs():
    record = _record()
    del record["method"]
    assert RunResult.from_json(record).method == "lora"


def test_every_committed_record_reads(tmp_path):
    paths = sorted((REPO / "benchmarks" / "results").rglob("result.json"))
    assert len(paths) > 1000
    for path in paths:
        assert read_result(path) is not None
