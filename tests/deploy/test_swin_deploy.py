"""The practitioner's path on a Swin: petl-serve answers VPT (shallow and deep) beside LoRA from one backbone, a
mixed batch giving every row its own run's model; petl-predict on a Swin VPT run, alone and with the others in one
MultiTask pass; petl-export folds LoRA into a plain timm Swin and refuses VPT in one line."""

from __future__ import annotations

import csv
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from test_multitask import _run_folder

import petl
from petl.cli import export as export_cli
from petl.cli import predict as predict_cli
from petl.deploy import predict as predict_api

pytest.importorskip("fastapi", reason='petl-serve\'s extra is not installed: pip install -e ".[serve]"')
from fastapi.testclient import TestClient  # noqa: E402

from petl.deploy import serve  # noqa: E402

# petl's offline Swin, random and small: a first stage of 2 blocks (the second shifted: 8x8 windows of 4x4 tokens
# at 32 px) so that the prompts meet the shift mask, then 2 and 1.
SWIN = {
    "name": "swin_fractal_tiny_patch2_window4_32",
    "pretrained": False,
    "kwargs": {"depths": [2, 2, 1], "embed_dim": 16},
}
# VPT's prompts travel beside the grid, LoRA's update is routed inside the window attention: both paths of a mixed
# batch on a Swin.  The two VPT tasks have one prompt count, so that their rows share a pass (one per count) and a
# row given another row's prompts shows; different class counts, so that a row answered by another head shows.
RUNS = {
    "vpt_shallow": ("vpt", {"num_tokens": 3}),
    "vpt_deep": ("vpt", {"num_tokens": 3, "deep": True}),
    "lora": ("lora", {}),
}
# A mixed batch is a differently shaped float32 computation than one run's own batch: equal to this tolerance.
TOLERANCE = 1e-5
STRICT = "precision=no"  # strict fp32 on every device (a GPU's default is bf16 autocast)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Three finished run folders on the tiny Swin, written as petl-run writes them, without training."""
    root = tmp_path_factory.mktemp("swin_runs")
    for seed, (name, (method, options)) in enumerate(RUNS.items()):
        _run_folder(root / name, method, options, seed, classes=3 + seed, model_cfg=SWIN)
    return {name: root / name for name in RUNS}


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("swin_images")
    rng = np.random.default_rng(0)
    for i, size in enumerate([(40, 36), (32, 32), (64, 20)]):
        Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return folder


def _own_probabilities(run_dir: Path, files: list[Path]) -> dict[str, dict[str, float]]:
    """The run's own model, alone: image file name -> {class name: probability}."""
    run = petl.load_run(run_dir)
    batch = torch.stack([run.preprocess(Image.open(path)) for path in files])
    with torch.no_grad():
        probabilities = run.model(batch).softmax(-1)
    rows = zip(files, probabilities.tolist(), strict=True)
    return {path.name: dict(zip(run.class_names, row, strict=True)) for path, row in rows}


def _assert_same(got: dict[str, float], expected: dict[str, float], what: str) -> None:
    assert got.keys() == expected.keys(), what
    for label, probability in expected.items():
        assert got[label] == pytest.approx(probability, abs=TOLERANCE), f"{what}: class {label}"


def test_petl_serve_answers_swin_vpt_beside_lora_as_each_runs_own_model(runs, images):
    files = sorted(images.iterdir())
    expected = {name: _own_probabilities(run, files) for name, run in runs.items()}
    served, tasks = serve.load_tasks(runs)
    assert [task.method for task in tasks] == ["vpt", "vpt", "lora"]
    # A long batching window: the nine requests below, sent at once, share batches whatever the machine's load.
    app = serve.create_app(served, tasks, serve.ServeOptions(max_wait_ms=500, precision="no"))
    pairs = [(name, path) for name in runs for path in files]
    with TestClient(app) as client, ThreadPoolExecutor(len(pairs)) as pool:
        answers = list(
            pool.map(
                lambda pair: client.post(f"/v1/tasks/{pair[0]}/predict?top_k=5", content=pair[1].read_bytes()), pairs
            )
        )
        metrics = client.get("/metrics").text
    for (name, path), answer in zip(pairs, answers, strict=True):
        assert answer.status_code == 200, answer.text
        (prediction,) = answer.json()["predictions"]
        got = dict(zip(prediction["labels"], prediction["probabilities"], strict=True))
        _assert_same(got, expected[name][path.name], f"{name} on {path.name}")
    single_task_batches = next(
        line for line in metrics.splitlines() if line.startswith('petl_batch_tasks_bucket{le="1"}')
    )
    all_batches = next(line for line in metrics.splitlines() if line.startswith('petl_batch_tasks_bucket{le="+Inf"}'))
    assert int(all_batches.split()[-1]) > int(single_task_batches.split()[-1]), "no batch mixed tasks"


def _predict(argv: list[str], out: Path) -> dict[tuple[str, str], dict[str, float]]:
    """petl-predict's CSV: (run, image file name) -> {class name: probability}."""
    with pytest.raises(SystemExit) as stop:
        predict_cli.main([*argv, "top_k=5", STRICT, f"out={out}", "--quiet"])
    assert stop.value.code == 0
    with open(out, newline="") as handle:
        rows = list(csv.DictReader(handle))
    ranks = range(1, 1 + sum(key.startswith("label_") for key in rows[0]))
    return {
        (Path(row.get("run", "")).name, Path(row["path"]).name): {
            row[f"label_{i}"]: float(row[f"prob_{i}"]) for i in ranks if row[f"label_{i}"]
        }
        for row in rows
    }


def test_petl_predict_on_swin_vpt_runs_alone_and_in_one_multitask_pass(runs, images, tmp_path, monkeypatch):
    files = sorted(images.iterdir())
    expected = {name: _own_probabilities(run, files) for name, run in runs.items()}
    # petl-predict writes probabilities with 6 decimals.
    rounding = 1e-6
    alone = _predict([str(runs["vpt_shallow"]), str(images)], tmp_path / "alone.csv")
    assert sorted(alone) == [("", path.name) for path in files]
    for (_, image), got in alone.items():
        for label, probability in expected["vpt_shallow"][image].items():
            assert got[label] == pytest.approx(probability, abs=TOLERANCE + rounding), f"vpt_shallow on {image}"
    served = []
    together = predict_api.predict_together
    monkeypatch.setattr(
        predict_api, "predict_together", lambda multi, *a, **k: served.append(multi) or together(multi, *a, **k)
    )
    rows = _predict([*map(str, runs.values()), str(images)], tmp_path / "together.csv")
    assert len(served) == 1 and len(served[0].names) == 3, "the Swin runs did not share one MultiTask pass"
    assert sorted(rows) == sorted((name, path.name) for name in runs for path in files)
    for (name, image), got in rows.items():
        for label, probability in expected[name][image].items():
            assert got[label] == pytest.approx(probability, abs=TOLERANCE + rounding), f"{name} on {image}"


def test_petl_export_folds_swin_lora_into_plain_timm_and_refuses_vpt_in_one_line(runs, tmp_path, capsys):
    out = tmp_path / "exported"
    export_cli.main([str(runs["lora"]), f"out={out}"])
    run = petl.load_run(runs["lora"])
    exported = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    assert type(exported) is timm.models.swin_transformer.SwinTransformer
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported(images), run.model(images), atol=1e-5, rtol=1e-5)
    # Fine-tuning it on in timm with another class count drops the classifier by the name config.json gives.
    again = timm.create_model(f"local-dir:{out}", pretrained=True, num_classes=2)
    assert again(images).shape == (2, 2)
    torch.testing.assert_close(again.layers[0].blocks[0].attn.qkv.weight, exported.layers[0].blocks[0].attn.qkv.weight)
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        export_cli.main([str(runs["vpt_deep"]), f"out={tmp_path / 'vpt'}"])
    error = capsys.readouterr().err
    assert stop.value.code == 2 and error.count("\n") == 1, error
    assert "method 'vpt' cannot be unloaded into a plain timm model" in error and "petl.load_run" in error
    assert not (tmp_path / "vpt").exists()
