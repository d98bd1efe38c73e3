"""The cost said before ``suite=choose`` trains: its terms, its range and its overhead share, without training."""

from __future__ import annotations

import pytest

from petl.bench import estimate as costs
from petl.bench.own_data import OwnData
from petl.data import TEST, TRAIN, TRAIN_VAL, VAL

DATA = OwnData("folder", "photos", {}, "0" * 64, ["a", "b"], {TRAIN: 8, VAL: 2, TRAIN_VAL: 10, TEST: 4}, None, 0.0)


def _probe(spread: float = 1.0, step: float = 0.0) -> costs.Probe:
    return costs.Probe(0.0, step, 0.0, 0.0, batch=4, image_size=32, spread=spread)


def test_two_probe_runs_split_the_overhead_into_per_run_and_per_epoch(monkeypatch):
    # 1 epoch took 10 s, 2 epochs 13 s, and the modelled terms are nil: 3 s per epoch, 7 s per run.
    monkeypatch.setattr(costs, "_probe_run", lambda overrides, epochs, compose: {1: 10.0, 2: 13.0}[epochs])
    assert costs.fixed_seconds(["output_dir=x"], _probe(), DATA, compose=None) == (7.0, 3.0)
    # Noise that makes the second run faster is no negative epoch.
    monkeypatch.setattr(costs, "_probe_run", lambda overrides, epochs, compose: {1: 10.0, 2: 9.0}[epochs])
    assert costs.fixed_seconds(["output_dir=x"], _probe(), DATA, compose=None) == (10.0, 0.0)


def test_the_estimate_says_its_range_and_how_much_is_overhead():
    # 2 trials + 2 finals of 5 epochs: per run 7 + 5 x 3 = 22 s of overhead, plus 10 s modelled.
    cost = costs.ExperimentCost("lora", 2, 2, 32.0, 32.0, 5, _probe(spread=2.0))
    found = costs.Estimate([cost], DATA.sizes, "cpu", fixed_seconds=7.0, per_epoch_seconds=3.0)
    assert found.seconds == 128.0
    assert found.range() == pytest.approx((4 * 22 + 4 * 10 / 2, 4 * 22 + 4 * 10 * 2))
    line = found.lines()[-1]
    assert "2 min, between 108 s and 3 min by the timed steps' spread" in line and "69 % of it" in line
    assert "7.0 s per run + 3.0 s per epoch" in line


def test_nothing_left_to_train_is_said_in_one_line_without_a_nil_estimate():
    # Was: "= 0 runs still to train", a line per experiment, then "0 s, between 0 s and 0 s ...; 0 % of it is ...".
    done = [costs.ExperimentCost(name, 0, 0, 0.0, 0.0, 5, None) for name in ("linear", "lora")]
    assert costs.Estimate(done, DATA.sizes, "cpu").lines() == [
        "cost: none: every run of the 2 experiments has finished, so nothing trains"
    ]


def test_a_probe_run_takes_what_the_real_runs_take_on_its_four_images(tmp_path):
    # train.grad_accum=2 (two batches of 64 a step in the real runs) and data.epochs=3 (no train.epochs given): the
    # probe's 4 images hold one batch, and its train.epochs=1 beside data.epochs=3 would leave that one without use;
    # both were refused, and the estimate stopped saying the real runs would fail.
    from petl.train.config import default_config

    tiny = ["model.pretrained=false", "+model.kwargs.depth=1", "+model.kwargs.embed_dim=48", "model.img_size=32"]
    overrides = ["method=linear", "data=mini/digits", *tiny, "train.grad_accum=2", "data.epochs=3"]
    assert costs._probe_run([*overrides, f"output_dir={tmp_path}"], 1, default_config) > 0


@pytest.mark.parametrize("limit", [None, 0])
def test_steps_are_timed_uncached_where_the_run_s_cache_would_exceed_its_limit(monkeypatch, limit):
    # Was: the estimate timed the steps on the cached front whenever the method left one frozen, while a run whose
    # images' features exceed petl.train.cache's limit caches nothing and runs the whole backbone each step.
    from petl.train import cache
    from petl.train.config import default_config

    if limit is not None:
        monkeypatch.setattr(cache, "MAX_CACHE_BYTES", limit)
    tiny = ["model.pretrained=false", "+model.kwargs.depth=2", "+model.kwargs.embed_dim=48", "output_dir=unused"]
    cfg = default_config(["method=partial", "data=mini/digits", *tiny])
    probe, _ = costs.measure(cfg, DATA, steps=1)
    assert (probe.front_seconds > 0) == (limit is None)


def test_the_data_line_counts_a_folders_own_val_images_apart_from_its_training_images():
    # Was "10 training images (val200 = its own validation split)": the val/ images counted as training images,
    # under the protocol's name for a split of 200.
    assert DATA.line() == (
        "data folder photos: 2 classes, 8 training images and 2 validation images (its own: the trials are scored "
        "on them, the final runs train on all 10), 4 test images; fingerprint 000000000000"
    )
