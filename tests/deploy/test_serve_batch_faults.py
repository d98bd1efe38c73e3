"""petl-serve when the model's forward fails: the requests of the failed batch get one line, the next are served;
a batcher an error stopped says so on /health and to every request (503), rather than answering 500 for ever.  In
process: the app called as uvicorn calls it (ASGI), no server, no training."""

from __future__ import annotations

import logging

import pytest
import torch
from test_multitask import _run_folder

pytest.importorskip("fastapi", reason='petl-serve\'s extra is not installed: pip install -e ".[serve]"')

from fastapi.testclient import TestClient  # noqa: E402
from test_serve_faults import _png  # noqa: E402

from petl.deploy import serve  # noqa: E402

ROUTE = serve.PREDICT_ROUTE.format(task="lora")


@pytest.fixture
def app(tmp_path):
    """A fresh app over one finished LoRA run (written without training): a test may break its forward."""
    _run_folder(tmp_path / "lora", "lora", {}, seed=0)
    return serve.create_app(*serve.load_tasks({"lora": tmp_path / "lora"}), serve.ServeOptions(precision="no"))


def _failing_once(app, failure):
    """Make the app's forward answer ``failure(images, tasks)`` the first time, then as it does."""
    forward, calls = app.state.batcher.forward, []

    def once(images: torch.Tensor, tasks: torch.Tensor) -> torch.Tensor:
        calls.append(len(images))
        return failure(images, tasks) if len(calls) == 1 else forward(images, tasks)

    app.state.batcher.forward = once
    return calls


def _answers(app, *requests: str) -> list[tuple[int, dict]]:
    """(status, JSON answer) of each request in turn ("POST": an image to predict, "GET": /health), served as
    ``petl-serve`` serves the app (its lifespan runs the batcher); a 500's exception is not raised here."""
    with TestClient(app, raise_server_exceptions=False) as client:
        answers = [client.post(ROUTE, content=_png()) if r == "POST" else client.get("/health") for r in requests]
    return [(answer.status_code, answer.json()) for answer in answers]


def test_a_forward_that_gives_too_few_rows_fails_its_batch_and_the_next_request_is_served(app):
    # The worker zipped the batch with the logits after the forward, outside the guard that answers a failed batch:
    # it ended, its request got 503 ("the server shut down"), and every later request a 500 for ever.
    calls = _failing_once(app, lambda images, tasks: torch.zeros(len(images) - 1, 4))
    (failed, said), (status, answer), (health, _) = _answers(app, "POST", "POST", "GET")
    assert failed == 500 and said["detail"] == "internal error (ValueError): the server goes on; retry", said
    assert status == 200 and answer["predictions"][0]["labels"], answer
    assert health == 200 and calls == [1, 1]


def test_a_forward_that_raises_fails_its_batch_alone(app):
    # Any exception in the model's forward (a shape the model refuses, the GPU's memory): the next request is served.
    def wrong_shape(images: torch.Tensor, tasks: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(images.flatten(1), torch.zeros(4, 5))  # mat1 and mat2 shapes differ

    _failing_once(app, wrong_shape)
    (failed, said), (status, _) = _answers(app, "POST", "POST")
    assert (failed, status) == (500, 200) and said["detail"].startswith("internal error (RuntimeError)"), said


class _Abort(BaseException):
    """Not an Exception (as pytest's own outcomes, or a library's abort): the batch's guard does not catch it."""


def test_a_batcher_an_error_stopped_says_so_on_health_and_answers_503(app, caplog):
    # Its request was answered "the server shut down", every request after it a 500 ("internal error
    # (RuntimeError)"), /health said ok, and the log said nothing until the server shut down.
    def abort(images: torch.Tensor, tasks: torch.Tensor) -> torch.Tensor:
        raise _Abort("the forward aborted")

    _failing_once(app, abort)
    with caplog.at_level(logging.ERROR, logger="petl.serve"):
        answers = _answers(app, "POST", "POST", "GET")
    line = "the server's batcher stopped (_Abort, in its log): restart petl-serve"
    assert answers == [(503, {"detail": line})] * 3
    assert [record.getMessage() for record in caplog.records] == ["the batcher stopped: the forward aborted"]
    # Served again (a new lifespan), the batcher runs again.
    assert [status for status, _ in _answers(app, "POST", "GET")] == [200, 200]


def test_the_openapi_schema_names_the_500_of_a_failed_forward_and_the_503_of_health(app):
    # The answers above were in no route's schema: a generated client did not know them as {"detail": ...}.
    paths = app.openapi()["paths"]
    for path, method, code in [(serve.PREDICT_ROUTE, "post", "500"), ("/health", "get", "503")]:
        problem = paths[path][method]["responses"][code]["content"]["application/json"]["schema"]
        assert list(problem["properties"]) == ["detail"], (path, code)
