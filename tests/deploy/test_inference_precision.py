"""petl-serve's and petl-predict's ``precision``: train.precision's names and meanings at inference.

On a CPU the default answers bit-identically to strict fp32; an unknown value, or tf32 off a CUDA GPU (as petl-run
refuses it), is one line (exit 2); bf16 on a CPU without bf16 instructions falls back to fp32 with one warning. On
a CUDA GPU the default runs the forward under bf16 autocast with TF32 (where the GPU has native bf16) and agrees
with fp32 within a tolerance.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from test_run_card import _image, _run_folder

from petl.cli import predict as predict_cli
from petl.deploy import predict
from petl.store.run_card import load_run
from petl.utils import precision
from petl.utils.errors import ConfigError

CUDA = pytest.mark.cuda  # skipped without a CUDA GPU (tests/conftest.py)
# bf16 keeps 8 mantissa bits: the tiny model's logits (order 1) move by a few 1e-3 under autocast.
BF16_TOLERANCE = 5e-2


class Recorder:
    """A forward hook keeping each output and the precision the forward ran in."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.outputs: list[torch.Tensor] = []
        self.states: list[tuple[bool, torch.dtype, bool]] = []
        module.register_forward_hook(self)

    def __call__(self, _module: torch.nn.Module, _inputs: tuple, output: torch.Tensor) -> None:
        device_type = output.device.type
        self.outputs.append(output.detach().float().cpu())
        self.states.append(
            (
                torch.is_autocast_enabled(device_type),
                torch.get_autocast_dtype(device_type),
                torch.backends.cuda.matmul.allow_tf32,
            )
        )


def _images(folder: Path, count: int = 6) -> list[Path]:
    folder.mkdir()
    rng = np.random.default_rng(1)
    paths = [folder / f"{i}.png" for i in range(count)]
    for path in paths:
        Image.fromarray(rng.integers(0, 255, (40, 36, 3), dtype=np.uint8)).save(path)
    return paths


def _predict_logits(run_dir: Path, paths: list[Path], **options: str) -> tuple[torch.Tensor, Recorder]:
    run = load_run(run_dir)
    if torch.cuda.is_available():
        run.model.cuda()  # as petl-predict does
    recorder = Recorder(run.model)
    predict.predict_images(run, paths, progress=False, **options)
    return torch.cat(recorder.outputs), recorder


# --- the names ------------------------------------------------------------------------------------------------


def test_auto_is_strict_fp32_on_a_cpu_and_an_unknown_value_is_refused_in_one_line():
    assert precision.inference_precision("auto", "cpu") == "no"
    assert precision.inference_precision("no", "cuda") == "no"
    with pytest.raises(ValueError, match=r"^precision='fp16': must be one of auto, no, tf32, bf16$"):
        precision.inference_precision("fp16", "cpu")


def test_bf16_on_a_cpu_without_it_falls_back_to_fp32_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(precision, "cpu_supports_bf16", lambda: False)
    with caplog.at_level(logging.WARNING):
        assert precision.inference_precision("bf16", "cpu") == "no"
    assert [r.getMessage() for r in caplog.records] == [
        "precision=bf16: this CPU has no bf16 instructions (AVX512-BF16/AMX): running in fp32",
    ]
    monkeypatch.setattr(precision, "cpu_supports_bf16", lambda: True)
    assert precision.inference_precision("bf16", "cpu") == "bf16"


@pytest.mark.parametrize("device_type", ["cpu", "mps"])
def test_tf32_off_a_cuda_gpu_is_refused_as_petl_run_refuses_it(device_type, caplog):
    # It would run as precision=no: a value with no effect.  One rule with train.precision (refuse_gpu_only).
    with caplog.at_level(logging.WARNING), pytest.raises(ConfigError) as refused:
        precision.inference_precision("tf32", device_type)
    assert str(refused.value) == (
        f"precision=tf32 acts on a CUDA GPU only, and the forward runs on {device_type}: "
        "give precision=no (or bf16, which CPUs autocast)"
    )
    assert not caplog.records
    assert precision.inference_precision("tf32", "cuda") == "tf32"


# --- petl-predict ---------------------------------------------------------------------------------------------


def test_predict_by_default_gives_exactly_the_logits_of_strict_fp32_on_a_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    run_dir, paths = _run_folder(tmp_path / "run"), _images(tmp_path / "images")
    default, recorder = _predict_logits(run_dir, paths)
    strict, _ = _predict_logits(run_dir, paths, precision="no")
    assert torch.equal(default, strict)
    assert recorder.states[0][0] is False  # no autocast


def test_predict_bf16_on_a_cpu_autocasts_where_it_has_bf16_and_warns_where_not(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    run_dir, paths = _run_folder(tmp_path / "run"), _images(tmp_path / "images")
    strict, _ = _predict_logits(run_dir, paths, precision="no")
    monkeypatch.setattr(precision, "cpu_supports_bf16", lambda: True)
    bf16, recorder = _predict_logits(run_dir, paths, precision="bf16")
    assert recorder.states[0][:2] == (True, torch.bfloat16)
    assert (bf16 - strict).abs().max() < BF16_TOLERANCE
    monkeypatch.setattr(precision, "cpu_supports_bf16", lambda: False)
    with caplog.at_level(logging.WARNING):
        fallback, recorder = _predict_logits(run_dir, paths, precision="bf16")
    assert torch.equal(fallback, strict) and recorder.states[0][0] is False
    assert sum("no bf16 instructions" in r.getMessage() for r in caplog.records) == 1


def _predict_cli(argv: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        predict_cli.main(argv)
    return stop.value.code, capsys.readouterr().err


def test_the_predict_command_says_its_precision_and_refuses_an_unknown_one(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    run_dir, image = _run_folder(tmp_path / "run"), _image(tmp_path / "a.png")
    code, error = _predict_cli([str(run_dir), str(image), "precision=fp16"], capsys)
    assert code == 2 and error == "petl-predict: error: precision='fp16': must be one of auto, no, tf32, bf16\n"
    code, error = _predict_cli([str(run_dir), str(image), "precision=tf32"], capsys)
    assert code == 2 and error == (
        "petl-predict: error: precision=tf32 acts on a CUDA GPU only, and the forward runs on cpu: "
        "give precision=no (or bf16, which CPUs autocast)\n"
    )
    code, error = _predict_cli([str(run_dir), str(image)], capsys)
    assert code == 0 and "petl-predict: predicted on cpu in fp32\n" in error
    monkeypatch.setattr(precision, "cpu_supports_bf16", lambda: False)
    code, error = _predict_cli([str(run_dir), str(image), "precision=bf16"], capsys)
    assert code == 0 and "petl-predict: predicted on cpu in fp32\n" in error


# --- petl-serve -------------------------------------------------------------------------------------------------


def asgi_scope(method: str, path: str, headers: list[tuple[bytes, bytes]]) -> dict:
    """The ASGI scope of one HTTP request to ``path`` (its query after ``?``), as uvicorn gives it to the app."""
    route, _, query = path.partition("?")
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": route,
        "raw_path": route.encode(),
        "query_string": query.encode(),
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }


async def _request(app, method: str, path: str, body: bytes = b"") -> tuple[int, dict]:
    """One request through the app, without a socket (inside its lifespan: the batcher's worker runs)."""
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    headers = [(b"content-type", b"image/png"), (b"content-length", str(len(body)).encode())]
    await app(asgi_scope(method, path, headers), receive, send)
    answer = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(answer)


def _serve(run_dir: Path, image: Path, **options: str) -> tuple[dict, dict, Recorder]:
    serve = pytest.importorskip("petl.deploy.serve", reason="petl-serve's extra is not installed")
    served, tasks = serve.load_tasks({"task": run_dir})
    recorder = Recorder(served)
    app = serve.create_app(served, tasks, serve.ServeOptions(**options))

    async def requests() -> tuple[tuple[int, dict], tuple[int, dict]]:
        async with app.router.lifespan_context(app):
            health = await _request(app, "GET", "/health")
            return health, await _request(app, "POST", "/v1/tasks/task/predict?top_k=3", image.read_bytes())

    (status, health), (predicted, answer) = asyncio.run(requests())
    assert status == 200 and predicted == 200, answer
    return health, answer, recorder


def test_serve_by_default_answers_exactly_as_strict_fp32_on_a_cpu_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    run_dir, image = _run_folder(tmp_path / "run"), _image(tmp_path / "a.png")
    health, default, recorder = _serve(run_dir, image)
    _, strict, strict_recorder = _serve(run_dir, image, precision="no")
    assert health == {"status": "ok", "tasks": 1, "device": "cpu", "precision": "no"}
    assert torch.equal(recorder.outputs[0], strict_recorder.outputs[0]) and default == strict
    assert recorder.states[0][0] is False


def test_serve_refuses_an_unknown_precision_in_one_line(tmp_path, capsys):
    serve_cli = pytest.importorskip("petl.cli.serve")
    pytest.importorskip("fastapi", reason="petl-serve's extra is not installed")
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        serve_cli.main([str(_run_folder(tmp_path / "run")), "precision=half", "port=1"])
    assert stop.value.code == 2
    assert capsys.readouterr().err == "petl-serve: error: precision='half': must be one of auto, no, tf32, bf16\n"


def test_serve_refuses_tf32_without_a_gpu_before_the_runs_load(tmp_path, capsys, monkeypatch):
    serve_cli = pytest.importorskip("petl.cli.serve")
    serve = pytest.importorskip("petl.deploy.serve", reason="petl-serve's extra is not installed")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(serve, "load_tasks", lambda _runs: pytest.fail("loaded the runs before refusing"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        serve_cli.main([str(_run_folder(tmp_path / "run")), "precision=tf32", "port=1"])
    assert stop.value.code == 2
    assert capsys.readouterr().err == (
        "petl-serve: error: precision=tf32 acts on a CUDA GPU only, and the forward runs on cpu: "
        "give precision=no (or bf16, which CPUs autocast)\n"
    )


def test_serve_api_refuses_tf32_on_a_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^precision=tf32 acts on a CUDA GPU only, and the forward runs on cpu: "):
        _serve(_run_folder(tmp_path / "run"), _image(tmp_path / "a.png"), precision="tf32")


def test_serve_bf16_on_a_cpu_without_bf16_falls_back_with_one_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(precision, "cpu_supports_bf16", lambda: False)
    run_dir, image = _run_folder(tmp_path / "run"), _image(tmp_path / "a.png")
    with caplog.at_level(logging.WARNING):
        health, _, recorder = _serve(run_dir, image, precision="bf16")
    assert health["precision"] == "no" and recorder.states[0][0] is False
    assert sum("no bf16 instructions" in r.getMessage() for r in caplog.records) == 1


# --- on a CUDA GPU ----------------------------------------------------------------------------------------------


@CUDA
def test_predict_on_a_gpu_runs_auto_in_bf16_with_tf32_and_agrees_with_fp32(tmp_path):
    run_dir, paths = _run_folder(tmp_path / "run"), _images(tmp_path / "images")
    tf32_before = torch.backends.cuda.matmul.allow_tf32
    strict, strict_recorder = _predict_logits(run_dir, paths, precision="no")
    auto, recorder = _predict_logits(run_dir, paths)
    assert strict_recorder.states[0][0] is False and strict_recorder.states[0][2] is False
    if precision.cuda_has_native_bf16():
        assert recorder.states[0] == (True, torch.bfloat16, True)
    else:  # before Ampere: no bf16, no TF32
        assert recorder.states[0][0] is False
    assert (auto - strict).abs().max() < BF16_TOLERANCE
    assert torch.equal(auto.argmax(-1), strict.argmax(-1))
    assert torch.backends.cuda.matmul.allow_tf32 == tf32_before  # the process's switch is put back


@CUDA
def test_serve_on_a_gpu_runs_auto_in_bf16_with_tf32_and_agrees_with_fp32(tmp_path):
    run_dir, image = _run_folder(tmp_path / "run"), _image(tmp_path / "a.png")
    health, auto, recorder = _serve(run_dir, image)
    _, strict, strict_recorder = _serve(run_dir, image, precision="no")
    expected = "bf16" if precision.cuda_has_native_bf16() else "no"
    assert health["device"] == "cuda" and health["precision"] == expected
    if expected == "bf16":
        assert recorder.states[0] == (True, torch.bfloat16, True)
    assert strict_recorder.states[0][0] is False and strict_recorder.states[0][2] is False
    assert (recorder.outputs[0] - strict_recorder.outputs[0]).abs().max() < BF16_TOLERANCE
    assert auto["predictions"][0]["labels"][0] == strict["predictions"][0]["labels"][0]
    # Probabilities come back in fp32 whatever the forward ran in.
    probabilities = auto["predictions"][0]["probabilities"]
    assert all(isinstance(p, float) for p in probabilities)
    assert sum(probabilities) <= 1.0 + 1e-6
