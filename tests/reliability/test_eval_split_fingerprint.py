"""A finished run is compared on the splits it was scored on (val, test), not on its training split alone."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import tiny_run
from test_vtab_fgvc_folders import FULL, make_vtab_task

from petl.bench.collect import RunRecord
from petl.bench.report import MixedCellError, check_cell
from petl.run import default_config, train
from petl.store.result import RunResult
from petl.train import output_dir as folder
from petl.train import runner
from petl.train.config import ConfigError

TINY = [o for o in tiny_run(subset=32, depth=1, epochs=1, batch_size=32) if not o.startswith("data")]


@pytest.mark.slow
def test_a_finished_run_whose_test_list_was_edited_is_not_finished(tmp_path, monkeypatch):
    root = tmp_path / "root"
    make_vtab_task(root / "dtd", FULL, num_classes=47)
    overrides = [*TINY, "method=linear", "data=vtab/dtd", f"data.root={root}", f"output_dir={tmp_path / 'run'}"]
    first = train(default_config([*overrides, "data.split=train800"]))
    # Scored on val200 (selection) and test: both recorded beside the training split's fingerprint.
    assert {"data.fingerprint", "data.val_fingerprint", "data.test_fingerprint"} <= first["inputs"].keys()
    cfg = default_config([*overrides, "data.split=train800"])
    folder.check_finished(cfg)  # the same data: the sweep counts it
    # One test label changed: the recorded test accuracy was measured on other data.
    test_list = root / "dtd" / "test.txt"
    lines = test_list.read_text().splitlines()
    name, label = lines[0].rsplit(" ", 1)
    test_list.write_text("\n".join([f"{name} {(int(label) + 1) % 47}", *lines[1:]]) + "\n")
    monkeypatch.setattr(runner, "fit", lambda *a, **k: pytest.fail("a refused run must not train"))
    digest = r"[0-9a-f]{12}\.\.\."  # a SHA-256 said by its first 12 hex digits
    changed = rf"holds a finished run on other inputs \(data.test_fingerprint: {digest} -> {digest}\)"
    folder._data_fingerprint.cache_clear()  # a new sweep: one process caches a split's fingerprint
    with pytest.raises(ConfigError, match=changed):
        folder.check_finished(cfg)  # petl-bench: the sweep does not skip it
    with pytest.raises(ConfigError, match=changed):
        runner.run(cfg)  # petl-run: not "already finished" (exit 2)
    # A record from before the evaluated splits were recorded is compared on what it has, and still finished.
    result = tmp_path / "run" / "result.json"
    record = json.loads(result.read_text())
    for key in ("data.val_fingerprint", "data.test_fingerprint"):
        del record["inputs"][key]
    result.write_text(json.dumps(record))
    folder.check_finished(cfg)
    assert runner.run(cfg)["test_top1"] == first["test_top1"]


def test_changed_inputs_are_said_with_their_digests_cut_short():
    # Another folder into data=folder's default output_dir said four whole SHA-256s: one line of over 500 characters.
    old = {"data.root": "/a", "data.fingerprint": "a" * 64, "data.test_fingerprint": "c" * 64}
    new = {"data.root": "/b", "data.fingerprint": "b" * 64, "data.test_fingerprint": "d" * 64}
    said = "(data.root: '/a' -> '/b', data.fingerprint: aaaaaaaaaaaa... -> bbbbbbbbbbbb..., data.test_fingerprint: "
    with pytest.raises(ConfigError, match=re.escape(said + "cccccccccccc... -> dddddddddddd...); choose another")):
        folder.check_inputs(Path("x"), old, new, finished=True)


def test_checked_inputs_compare_the_evaluated_splits_where_recorded():
    old = {"data.root": "/a", "data.fingerprint": "f", "data.test_fingerprint": "t1", "model.checkpoint_sha256": None}
    with pytest.raises(ConfigError, match=r"a finished run on other inputs \(data.test_fingerprint: 't1' -> 't2'\)"):
        folder.check_inputs(Path("x"), old, {**old, "data.test_fingerprint": "t2"}, finished=True)
    with pytest.raises(ConfigError, match=r"epochs trained on other inputs \(data.test_fingerprint: 't1' -> 't2'\)"):
        folder.check_inputs(Path("x"), old, {**old, "data.test_fingerprint": "t2"})
    # Recorded before this check existed: no key, nothing to compare.
    before = {k: v for k, v in old.items() if k != "data.test_fingerprint"}
    folder.check_inputs(Path("x"), before, {**old, "data.test_fingerprint": "t2"}, finished=True)
    folder.check_inputs(Path("x"), before, {**old, "data.test_fingerprint": "t2"})


def test_a_cell_whose_seeds_were_tested_on_different_test_splits_is_refused(tmp_path):
    def record(seed: int, test: str | None) -> RunRecord:
        inputs = {"data.root": "/a", "data.fingerprint": "f", "model.checkpoint_sha256": None}
        if test is not None:
            inputs["data.test_fingerprint"] = test
        config = {"seed": seed, "data": {"name": "vtab/dtd"}, "method": {"name": "lora"}}
        result = RunResult("lora", "vtab/dtd", seed, test_top1=50.0, config=config, inputs=inputs)
        return RunRecord("vtab/dtd", "lora", seed, tmp_path / f"seed{seed}" / "result.json", result)

    check_cell([record(0, "t1"), record(1, "t1"), record(2, None)])  # an old record is compared on what it has
    with pytest.raises(MixedCellError, match=r"seed1/result.json is not another seed .*data.test_fingerprint: 't1'"):
        check_cell([record(0, "t1"), record(1, "t2")])
    # Said as petl-run's check says them, by their first 12 hex digits: two whole SHA-256s made one line of 300.
    said = "(data.test_fingerprint: aaaaaaaaaaaa... -> bbbbbbbbbbbb...); report"
    with pytest.raises(MixedCellError, match=re.escape(said)):
        check_cell([record(0, "a" * 64), record(1, "b" * 64)])


def test_a_finished_runs_check_hashes_its_splits_without_decoding_them(tmp_path, monkeypatch):
    # A finished run's check compares fingerprints alone: it reads and hashes each split's files but decodes none (a
    # VTAB test split is up to some 74,000 images), and finds the fingerprint a full build records.
    from petl import data as petl_data
    from petl.data import images

    root = tmp_path / "root"
    make_vtab_task(root / "dtd", FULL, num_classes=47)
    built = petl_data.build_dataset("vtab/dtd", "test", image_size=32, root=str(root))
    monkeypatch.setattr(images, "decode_image", lambda data: pytest.fail("a fingerprint check decoded an image"))
    folder._data_fingerprint.cache_clear()
    assert folder._data_fingerprint("vtab/dtd", "test", str(root), ()) == built.fingerprint
    with images.fingerprint_only():
        hashed = petl_data.build_dataset("vtab/dtd", "test", image_size=32, root=str(root))
    assert hashed.fingerprint == built.fingerprint and hashed.digests == built.digests and hashed.images is None
