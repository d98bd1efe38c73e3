"""petl-serve as a client hits it: every error says what to do in one JSON line (a path or method no route has, a
multipart body that cannot be read), a multipart Content-Type in any case is read as multipart, and a request a
shutdown ends is answered.  In process: the app called as uvicorn calls it (ASGI), no server, no training."""

from __future__ import annotations

import asyncio
import errno
import io
import json
import logging
import re
import socket
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import command_status
from PIL import Image
from test_inference_precision import asgi_scope
from test_multitask import _run_folder

pytest.importorskip("fastapi", reason='petl-serve\'s extra is not installed: pip install -e ".[serve]"')

import uvicorn  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from petl.cli import serve as serve_cli  # noqa: E402
from petl.data.transforms import ImageSpec  # noqa: E402
from petl.deploy import serve  # noqa: E402
from petl.deploy.batcher import Batcher  # noqa: E402
from petl.deploy.metrics import ServeMetrics  # noqa: E402
from petl.utils.errors import UsageError  # noqa: E402

BOUNDARY = "petl-test-boundary"
SPEC = ImageSpec(image_size=32)  # resized straight to the square, as the tiny runs here are


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """The app over one finished LoRA run (written without training), a long batching window."""
    run = tmp_path_factory.mktemp("serve_faults") / "lora"
    _run_folder(run, "lora", {}, seed=0)
    served, tasks = serve.load_tasks({"lora": run})
    return serve.create_app(served, tasks, serve.ServeOptions(max_wait_ms=2000, precision="no"))


def _png() -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 36, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def _header_png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("1", (width, height)).save(buffer, "PNG")  # a few kB: the limits read the header alone
    return buffer.getvalue()


def _multipart(filename: str, data: bytes) -> bytes:
    return (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="image"; filename="{filename}"\r\n'
        "Content-Type: image/png\r\n\r\n".encode()
        + data
        + f"\r\n--{BOUNDARY}--\r\n".encode()
    )


async def _ask(app, method: str, path: str, body: bytes = b"", content_type: str | None = None) -> tuple[int, dict]:
    """(status, JSON answer) of one request, the app called as uvicorn calls it."""
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client stays connected
        raise AssertionError("unreachable")

    sent = []

    async def send(message: dict) -> None:
        sent.append(message)

    headers = [(b"content-type", content_type.encode())] if content_type else []
    await app(asgi_scope(method, path, headers), receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))


def _replayed(messages: list[dict]):
    """An ASGI ``receive`` that hands out ``messages`` in order, a ``send``, and the list ``send`` fills."""
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0)

    async def send(message: dict) -> None:
        sent.append(message)

    return receive, send, sent


def _with_batcher(app, scenario):
    """Run ``scenario()`` with the app's batcher working, as its lifespan runs it."""

    async def run():
        worker = asyncio.create_task(app.state.batcher.run())
        await asyncio.sleep(0)
        try:
            return await scenario()
        finally:
            worker.cancel()

    return asyncio.run(run())


def test_a_path_or_method_no_route_has_says_which_routes_there_are(app):
    # Said "Not Found" and "Method Not Allowed": nothing of what to do.
    status, answer = asyncio.run(_ask(app, "GET", "/v1/task"))
    assert status == 404 and answer["detail"].startswith("no route GET '/v1/task': the routes are POST /v1/tasks/")
    status, answer = asyncio.run(_ask(app, "HEAD", "/v1/tasks"))
    assert status == 405 and answer["detail"].startswith("HEAD is not served at '/v1/tasks', only GET: the routes are")
    # /health answers HEAD, as uptime checkers probe, and its 405 names both methods (it named GET alone).
    status, _ = asyncio.run(_ask(app, "HEAD", "/health"))
    assert status == 200
    status, answer = asyncio.run(_ask(app, "OPTIONS", "/health"))
    assert status == 405 and answer["detail"].startswith("OPTIONS is not served at '/health', only GET, HEAD: "), answer
    status, answer = asyncio.run(_ask(app, "GET", serve.PREDICT_ROUTE.format(task="lora")))
    assert status == 405 and "only POST" in answer["detail"]
    # An unknown task keeps its own answer.
    status, answer = asyncio.run(_ask(app, "POST", serve.PREDICT_ROUTE.format(task="cars"), _png()))
    assert status == 404 and answer["detail"].startswith("unknown task 'cars': the tasks are lora")
    # A name no task has is shown as a path is, its first 100 characters: it was echoed whole (5 kB here).
    status, answer = asyncio.run(_ask(app, "POST", serve.PREDICT_ROUTE.format(task="x" * 5000), _png()))
    assert (
        status == 404
        and answer["detail"] == f"unknown task {'x' * 100!r}: the tasks are lora (GET /v1/tasks lists them)"
    )


def test_predict_with_a_trailing_slash_answers_as_predict_does(tmp_path):
    # Starlette answered .../predict/ with a 307 to .../predict: the image already sent, curl (without -L) ended on
    # the redirect's empty body.
    _run_folder(tmp_path / "lora", "lora", {}, seed=0)
    served, tasks = serve.load_tasks({"lora": tmp_path / "lora"})
    app = serve.create_app(served, tasks, serve.ServeOptions(precision="no"))  # its own: a short max_wait_ms

    def scenario():
        return _ask(app, "POST", serve.PREDICT_ROUTE.format(task="lora") + "/?top_k=2", _png(), "image/png")

    status, answer = _with_batcher(app, scenario)
    assert status == 200 and answer["task"] == "lora" and len(answer["predictions"][0]["labels"]) == 2, answer
    # /metrics counts the two paths as one route.
    assert app.state.metrics.requests.values == {(("route", serve.PREDICT_ROUTE), ("status", "200")): 1}
    status, answer = asyncio.run(_ask(app, "GET", serve.PREDICT_ROUTE.format(task="lora") + "/"))
    assert status == 405 and "only POST" in answer["detail"]
    assert "predict/" not in json.dumps(app.openapi())  # the schema names one path


def test_a_multipart_body_is_read_whatever_the_case_of_its_content_type(app):
    route = serve.PREDICT_ROUTE.format(task="lora")
    body = _multipart("cat.png", _png())

    async def scenario():
        # A media type is case-insensitive: Multipart/Form-Data was read as one image, "not a readable image".
        kinds = (f"multipart/form-data; boundary={BOUNDARY}", f"Multipart/Form-Data; boundary={BOUNDARY}")
        return [await _ask(app, "POST", route, body, kind) for kind in kinds]

    (status, answer), (status_upper, answer_upper) = _with_batcher(app, scenario)
    assert status == status_upper == 200, answer_upper
    assert answer_upper == answer and answer["predictions"][0]["image"] == "cat.png"


def test_a_whole_multipart_body_with_an_epilogue_or_a_quoted_boundary_is_not_taken_for_cut_short(app):
    # cut_short looks for CRLF --BOUNDARY-- where the body holds its boundary: the boundary as the Content-Type
    # quotes it, and text after the closing boundary (RFC 2046's epilogue), leave a body whole.  (A preamble, text
    # before the first boundary, python-multipart refuses itself: "cannot be read".)
    route = serve.PREDICT_ROUTE.format(task="lora")
    body = _multipart("cat.png", _png())
    asks = [
        (body, f'multipart/form-data; boundary="{BOUNDARY}"'),
        (body + b"an epilogue, after the closing boundary\r\n", f"multipart/form-data; boundary={BOUNDARY}"),
    ]

    async def scenario():
        return [await _ask(app, "POST", route, sent, kind) for sent, kind in asks]

    for status, answer in _with_batcher(app, scenario):
        assert status == 200 and answer["predictions"][0]["image"] == "cat.png", answer


def test_a_multipart_body_that_cannot_be_read_is_refused_saying_how_to_send_images(app):
    route = serve.PREDICT_ROUTE.format(task="lora")
    body = _multipart("cat.png", _png())
    # Starlette's own words ("Missing boundary in multipart.", "Invalid multipart data.") said nothing of what to do.
    for kind in ("multipart/form-data", f"multipart/form-data; boundary={BOUNDARY}x"):
        status, answer = asyncio.run(_ask(app, "POST", route, body, kind))
        assert status == 400 and answer["detail"].startswith("the multipart body cannot be read ("), answer
        assert answer["detail"].endswith(
            "send each image as a file field (curl -F image=@cat.jpg), or one image as the whole body"
        )
    # Two images, the second cut short before the closing boundary: python-multipart dropped it, and the first alone
    # was answered, 200.
    first, second = _multipart("a.png", _png()), _multipart("b.png", _png())
    head = first[: first.rindex(b"--" + BOUNDARY.encode())]
    # And the second's closing boundary without the CRLF before it, which the parser read as the image's data.
    for cut in (
        head + second[:-40],
        head + second.replace(b"\r\n--" + BOUNDARY.encode() + b"--", b"--" + BOUNDARY.encode() + b"--"),
    ):
        status, answer = asyncio.run(_ask(app, "POST", route, cut, f"multipart/form-data; boundary={BOUNDARY}"))
        assert status == 400 and answer["detail"].startswith("the multipart body ends before its closing"), answer


def test_a_client_that_closes_mid_upload_is_counted_not_logged_as_an_internal_error(app, caplog):
    """An upload cancelled part-way (the browser tab closed) raised starlette's ClientDisconnect: logged twice with
    a traceback, "request failed" and uvicorn's "Exception in ASGI application", and counted a 500."""
    messages = [{"type": "http.request", "body": _png()[:20], "more_body": True}, {"type": "http.disconnect"}]
    receive, send, sent = _replayed(messages)

    scope = asgi_scope("POST", serve.PREDICT_ROUTE.format(task="lora"), [(b"content-length", b"1000")])
    with caplog.at_level(logging.INFO):
        asyncio.run(app(scope, receive, send))  # raised ClientDisconnect
    assert sent[0]["status"] == serve.CLIENT_GONE == 499
    assert not caplog.records, caplog.text
    metrics = app.state.metrics.text()
    assert 'petl_requests_total{route="/v1/tasks/{task}/predict",status="499"} 1' in metrics
    assert 'status="500"' not in metrics


def test_a_client_gone_while_its_images_wait_has_them_dropped_from_the_queue(tmp_path):
    # Its rows ran all the same, counted as a 200 nobody received: under load, clients that gave up filled the batches.
    _run_folder(tmp_path / "lora", "lora", {}, seed=0)
    app = serve.create_app(*serve.load_tasks({"lora": tmp_path / "lora"}), serve.ServeOptions(precision="no"))
    messages = [{"type": "http.request", "body": _png(), "more_body": False}, {"type": "http.disconnect"}]
    receive, send, sent = _replayed(messages)

    scope = asgi_scope("POST", serve.PREDICT_ROUTE.format(task="lora"), [(b"content-type", b"image/png")])
    _with_batcher(app, lambda: app(scope, receive, send))
    assert sent[0]["status"] == serve.CLIENT_GONE
    metrics = app.state.metrics
    assert metrics.batch_rows.count == 0 and not metrics.images.values and metrics.latency.count == 0
    assert metrics.requests.values == {(("route", serve.PREDICT_ROUTE), ("status", "499")): 1}


def test_the_pixel_limits_take_an_image_of_exactly_their_size():
    """max_image_mp=4.1 is 4099999.9999999995 pixels as a float: a 2050 x 2000 image (4.1 MP) was refused as "4.1 MP,
    over max_image_mp=4.1", and two of them as over max_request_mp=8.2."""

    options = serve.ServeOptions(max_image_mp=4.1, max_request_mp=8.2)
    exact, over = ("exact.png", _header_png(2050, 2000)), ("over.png", _header_png(4100001, 1))
    serve.check_pixels([exact, exact], options, SPEC)
    with pytest.raises(serve.TooManyPixels, match="over max_image_mp=4.1"):
        serve.check_pixels([over], options, SPEC)
    with pytest.raises(serve.TooManyPixels, match="over max_request_mp=8.2"):
        serve.check_pixels([exact, exact, ("one.png", _header_png(1, 1))], options, SPEC)


def test_a_long_thin_image_that_a_cropping_runs_resize_would_blow_up_is_refused_from_its_header():
    # A run that crops (FGVC) resizes the shorter side to 256 px and the longer in proportion: a 138-byte PNG of
    # 1 x 20,000 px (0.02 MP, under every limit) became 256 x 5,120,000 px, 6 GB and 40 s of the server's time.
    thin = ("thin.png", _header_png(20_000, 1))
    crop = ImageSpec(image_size=224, crop=True)
    with pytest.raises(
        serve.TooManyPixels,
        match=r"^image 1 \(thin.png\): 20000 x 1 px, which the task's resize "
        r"\(the shorter side to 256 px\) makes 1.31e\+03 MP, over max_image_mp=16: crop it nearer",
    ):
        serve.check_pixels([thin], serve.ServeOptions(), crop)
    serve.check_pixels([thin], serve.ServeOptions(), SPEC)  # resized straight to the square: nothing to fear
    # A small max_image_mp still takes what any crop's resize makes of an image it takes (256 x 256 and more).
    serve.check_pixels([("small.png", _header_png(30, 20))], serve.ServeOptions(max_image_mp=0.001), crop)
    with pytest.raises(serve.TooManyPixels, match=r"makes 1.31 MP, over 1.05 MP \(16 times the task's resize of a"):
        serve.check_pixels([("long.png", _header_png(20, 1))], serve.ServeOptions(max_image_mp=0.001), crop)


@pytest.mark.parametrize(
    "spec", [ImageSpec(image_size=1024), ImageSpec(image_size=896, crop=True)], ids=["1024 px", "896 px, cropped"]
)
def test_a_small_max_image_mp_takes_any_image_the_models_resize_makes_no_longer_than_16_squares(spec):
    """The resize's floor was a fixed 1 MP: under max_image_mp=0.5, a model of 1,024 px (which makes 1.05 MP of any
    image) refused every image, squares too, as one its resize would make "1.05 MP, over 1 MP"."""
    small = serve.ServeOptions(max_image_mp=0.5)
    for width, height in [(700, 700), (32, 32), (800, 600)]:  # squares up- or downscaled, a 4:3 photo
        serve.check_pixels([("photo.png", _header_png(width, height))], small, spec)
    # The edge: 64 x 4 px (16:1), which a crop's resize makes exactly 16 of its squares, is taken; 65 x 4 is not.
    serve.check_pixels([("16 to 1.png", _header_png(64, 4))], small, spec)
    if spec.crop:  # 16,640 x 1,024 px: 17 MP, over 16 x 1,024 x 1,024 px
        with pytest.raises(serve.TooManyPixels, match=r"makes 17 MP, over 16.8 MP \(16 times the task's resize of a"):
            serve.check_pixels([("wider.png", _header_png(65, 4))], small, spec)
    # The limit on the image itself stays: a square over 0.5 MP is refused from its header.
    with pytest.raises(serve.TooManyPixels, match=r"over max_image_mp=0.5: send it smaller \(the model reads "):
        serve.check_pixels([("big.png", _header_png(708, 708))], small, spec)


def test_a_shutdown_waits_shutdown_timeout_s_as_given(app):
    # It was rounded up to whole seconds for uvicorn: shutdown_timeout_s=0.2 waited 1 s.
    for seconds in (0, 0.2, 2.5):
        config = serve.server_config(app, "127.0.0.1", 0, serve.ServeOptions(shutdown_timeout_s=seconds))
        assert config.timeout_graceful_shutdown == seconds


def test_more_images_in_one_request_than_max_queue_get_the_413_the_help_names(app):
    # The help said "beyond it requests get 503" alone: one request past it gets 413 (a full queue, 503).
    max_queue = app.state.options.max_queue
    parts = b"".join(_multipart(f"{i}.png", b"x").split(f"--{BOUNDARY}--".encode())[0] for i in range(max_queue + 1))
    body = parts + f"--{BOUNDARY}--\r\n".encode()
    kind = f"multipart/form-data; boundary={BOUNDARY}"
    status, answer = asyncio.run(_ask(app, "POST", serve.PREDICT_ROUTE.format(task="lora"), body, kind))
    assert status == 413 and answer["detail"].endswith(f"images in one request, over max_queue={max_queue}: split it")
    help_text = next(key.help for key in serve_cli.KEYS if key.name == "max_queue")
    assert "503" in help_text and "in one request (more get 413)" in help_text


def test_max_connections_connections_are_served_and_the_next_gets_503(app):
    """uvicorn counts the asking connection among those open: max_connections=2 served one connection at a time, and
    max_connections=1 answered every request 503."""
    listening = serve_cli.bind("127.0.0.1", 0)
    serve_cli.listen(listening, "127.0.0.1", 0)
    port = listening.getsockname()[1]
    options = serve.ServeOptions(max_connections=2)
    server = uvicorn.Server(serve.server_config(app, "127.0.0.1", port, options, access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listening]}, daemon=True)
    thread.start()

    def health(connection: socket.socket) -> bytes:
        connection.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        return connection.recv(100).split(b"\r\n")[0]

    try:
        deadline = time.monotonic() + 60  # a server that failed to start (its thread ended) fails the test, not hangs
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        with socket.create_connection(("127.0.0.1", port), timeout=30) as held:
            with socket.create_connection(("127.0.0.1", port), timeout=30) as second:
                assert health(second) == b"HTTP/1.1 200 OK"
                with socket.create_connection(("127.0.0.1", port), timeout=30) as third:
                    assert health(third) == b"HTTP/1.1 503 Service Unavailable"
            while len(server.server_state.connections) > 1:  # the server has seen the other two close
                assert time.monotonic() < deadline + 60, "the server did not see the connections close"
                time.sleep(0.05)
            assert health(held) == b"HTTP/1.1 200 OK"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def _encoded(kind: str, **options) -> bytes:
    buffer = io.BytesIO()
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 36, 3), dtype=np.uint8))
    image.save(buffer, kind, **options)
    return buffer.getvalue()


def test_an_upload_is_read_only_as_a_format_the_answers_name(tmp_path, monkeypatch):
    """An upload was opened as any format Pillow knows: an EPS ran Ghostscript on the client's bytes (where it is
    installed), a PCX or TGA was decoded and answered 200, though the 400 answers name the formats (PPM, which
    petl-run reads, was refused since)."""
    from PIL import EpsImagePlugin

    _run_folder(tmp_path / "lora", "lora", {}, seed=0)
    served, tasks = serve.load_tasks({"lora": tmp_path / "lora"})
    app = serve.create_app(served, tasks, serve.ServeOptions(precision="no"))  # its own: a short max_wait_ms

    ran = []

    def ghostscript(*args, **kwargs):  # Pillow's EPS loader runs the gs program here
        ran.append(args)
        raise OSError("Ghostscript ran")

    monkeypatch.setattr(EpsImagePlugin, "Ghostscript", ghostscript)
    route = serve.PREDICT_ROUTE.format(task="lora")
    second = Image.fromarray(np.zeros((40, 36, 3), dtype=np.uint8))

    async def scenario():
        kept = ["PNG", "JPEG", "WEBP", "BMP", "GIF", "TIFF", "PPM"]
        answers = {kind: await _ask(app, "POST", route, _encoded(kind)) for kind in kept}
        # A phone's photo with a second picture opens as MPO, through Pillow's JPEG opener.
        answers["MPO"] = await _ask(app, "POST", route, _encoded("MPO", save_all=True, append_images=[second]))
        for kind in ("EPS", "PCX", "TGA", "SGI"):
            answers[kind] = await _ask(app, "POST", route, _encoded(kind))
        return answers

    answers = _with_batcher(app, scenario)
    for kind in ("PNG", "JPEG", "WEBP", "BMP", "GIF", "TIFF", "PPM", "MPO"):
        assert answers[kind][0] == 200, (kind, answers[kind])
    for kind in ("EPS", "PCX", "TGA", "SGI"):
        status, answer = answers[kind]
        assert status == 400 and answer["detail"].startswith("image 1: not a readable image"), (kind, answer)
    assert ran == []


def test_an_image_petl_cannot_use_as_it_is_gets_its_own_remedy_alone(app):
    # It said "...: save it as an 8- or 16-bit image: send a complete PNG, JPEG, WebP, BMP, GIF or TIFF image",
    # two remedies, the second as if the TIFF sent were broken.
    buffer = io.BytesIO()
    Image.fromarray(np.zeros((8, 8), dtype=np.float32)).save(buffer, "TIFF")
    status, answer = asyncio.run(_ask(app, "POST", serve.PREDICT_ROUTE.format(task="lora"), buffer.getvalue()))
    assert status == 400
    assert answer["detail"] == "image 1: floating-point pixels (mode F): save it as an 8- or 16-bit image"
    # So does a 32-bit image whose values pass 16 bits: it said "...: send a complete PNG, JPEG, ... image" too.
    buffer = io.BytesIO()
    Image.fromarray(np.full((8, 8), 2**20, dtype=np.int32)).save(buffer, "TIFF")
    status, answer = asyncio.run(_ask(app, "POST", serve.PREDICT_ROUTE.format(task="lora"), buffer.getvalue()))
    assert status == 400
    assert answer["detail"] == (
        "image 1: mode I with values outside the 16-bit range [0, 65535]: save it as an 8- or 16-bit image"
    )


def test_a_request_a_shutdown_ends_gets_a_json_503(app):
    """uvicorn cancels the requests still running when shutdown_timeout_s runs out: the client got uvicorn's
    plain-text 500 ("Internal Server Error") and the log a traceback."""

    async def scenario():
        request = asyncio.create_task(_ask(app, "POST", serve.PREDICT_ROUTE.format(task="lora"), _png()))
        while not app.state.batcher._rows:  # the image waits in the 2 s batching window
            await asyncio.sleep(0.01)
        request.cancel("Task cancelled, timeout graceful shutdown exceeded")  # what uvicorn does
        return await request

    status, answer = _with_batcher(app, scenario)
    assert status == 503 and answer["detail"] == (
        "the server shut down before the images ran: send them again once it is back"
    )


def test_a_task_named_without_a_run_folder_is_refused(tmp_path, monkeypatch):
    """task.x= was read as the current folder: in a run folder, it served that run; elsewhere, said it "holds N
    runs"."""
    run = tmp_path / "cars"
    _run_folder(run, "lora", {}, seed=1)
    monkeypatch.chdir(run)
    with pytest.raises(UsageError, match=r"^task\.x=: no run folder after '=': give one, as task\.x=runs/cars$"):
        serve_cli.find_runs(["task.x="])


def test_a_run_of_another_backbone_is_refused_saying_what_a_petl_serve_user_can_do(tmp_path, capsys):
    """Said "serve it with a MultiTask of its own": Python, which a petl-serve user is not writing."""
    _run_folder(tmp_path / "narrow", "lora", {}, seed=0, width=48)
    _run_folder(tmp_path / "wide", "lora", {}, seed=0, width=96)
    with pytest.raises(SystemExit) as stop:
        serve_cli.main([str(tmp_path / "narrow"), str(tmp_path / "wide"), "port=0"])
    assert stop.value.code == 2
    error = capsys.readouterr().err
    assert "was trained on another backbone than run" in error and "a second petl-serve on another port" in error


@pytest.fixture
def unloaded(tmp_path, monkeypatch):
    """A run folder as petl-serve finds one, and a list of the loads tried (each fails the start, exit 2)."""
    run = tmp_path / "cars"
    run.mkdir()
    (run / "model.json").write_text("{}")  # never read: the start is refused before the runs load
    loaded = []

    def load_tasks(runs):
        loaded.append(runs)
        raise ValueError("the runs loaded")

    monkeypatch.setattr(serve, "load_tasks", load_tasks)
    return run, loaded


@pytest.mark.parametrize(
    ("failure", "reason", "status", "message"),
    [
        (socket.EAI_NONAME, "Name or service not known", 2, " does not resolve (Name or service not known): give"),
        (socket.EAI_AGAIN, "Temporary failure in name resolution", 1, ": Temporary failure in name resolution: try"),
    ],
    ids=["no such name", "resolver down"],
)
def test_a_host_that_does_not_resolve_is_one_line_before_the_runs_load(
    unloaded, capsys, monkeypatch, failure, reason, status, message
):
    """Resolved only at bind, after every run had loaded (minutes on a GPU): exit 1 for a misspelt host."""
    run, loaded = unloaded

    def getaddrinfo(*args, **kwargs):  # the resolver's answer, without asking a DNS server
        raise socket.gaierror(failure, reason)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    code, out, err = command_status(capsys, serve_cli.main, str(run), "host=no-such-host.invalid", "--quiet")
    assert (code, loaded) == (status, [])
    assert err.startswith(f"petl-serve: error: host=no-such-host.invalid{message}") and err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("token", "said"), [("s3cret\r", "7 of 7 is '\\r'"), (" s3cret", "1 of 7 is ' '"), ("sé", "2 of 2 is not")]
)
def test_a_token_no_client_can_send_is_refused_before_the_runs_load(unloaded, capsys, monkeypatch, token, said):
    """HTTP strips a header value's spaces and takes no control or non-ASCII character as it is: such a token (a
    carriage return left by $(cat token.txt) of a Windows file) was never matched, every request answered 401."""
    run, loaded = unloaded
    monkeypatch.setenv(serve.TOKEN_VARIABLE, token)
    code, out, err = command_status(capsys, serve_cli.main, str(run), "port=0", "--quiet")
    assert (code, loaded) == (2, []) and err.count("\n") == 1, err
    assert f"error: token (PETL_SERVE_TOKEN): its character {said}" in err and "s3cret" not in err, err
    # The Python API's options too: every request to such a server got 401.
    with pytest.raises(ValueError, match=re.escape(f"its character {said}")):
        serve.ServeOptions(token=token)


def test_a_port_in_use_is_one_line_naming_it_before_the_runs_load(unloaded, capsys):
    """Found at bind, after every run had loaded."""
    run, loaded = unloaded
    with socket.socket() as taken:  # no SO_REUSEADDR: any listening socket on the port refuses petl-serve's bind
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out, err = command_status(capsys, serve_cli.main, str(run), f"port={port}", "--quiet")
    assert (code, loaded) == (1, [])
    assert err == (
        f"petl-serve: error: cannot listen on 127.0.0.1:{port}: the port is in use: stop what holds it, or choose "
        "another port=\n"
    )


def test_a_host_that_is_not_this_machines_is_bad_input_before_the_runs_load(unloaded, capsys):
    """Said "Cannot assign requested address", exit 1 (a server that could not run), after loading every run."""
    nonlocal_bind = Path("/proc/sys/net/ipv4/ip_nonlocal_bind")
    if nonlocal_bind.is_file() and nonlocal_bind.read_text().strip() != "0":
        pytest.skip("this machine binds addresses it does not have (net.ipv4.ip_nonlocal_bind)")
    run, loaded = unloaded
    # 192.0.2.1 is TEST-NET-1 (RFC 5737), documentation's address, no machine's: bind sends nothing on a network.
    code, out, err = command_status(capsys, serve_cli.main, str(run), "host=192.0.2.1", "--quiet")
    assert (code, loaded) == (2, [])
    assert (
        err.startswith("petl-serve: error: host=192.0.2.1 is not an address of this machine (") and err.count("\n") == 1
    )
    assert "host=127.0.0.1 (the default) or host=0.0.0.0" in err


def test_an_ipv6_host_is_named_in_brackets(unloaded, capsys):
    """Printed as http://::1:8000/ and ::1:8000, which no browser or client takes for an address and a port."""
    assert serve_cli.address("::1", 8000) == "[::1]:8000" and serve_cli.address("127.0.0.1", 80) == "127.0.0.1:80"
    run, loaded = unloaded
    try:
        taken = socket.socket(socket.AF_INET6)
        taken.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with taken:
        taken.listen()
        port = taken.getsockname()[1]
        code, out, err = command_status(capsys, serve_cli.main, str(run), "host=::1", f"port={port}", "--quiet")
    assert (code, loaded) == (1, [])
    assert err.startswith(f"petl-serve: error: cannot listen on [::1]:{port}: the port is in use"), err


def test_a_privileged_port_refused_says_which_ports_a_user_may_take(unloaded, capsys, monkeypatch):
    """A port below 1024 for a user who is not root said "Permission denied" alone."""
    run, loaded = unloaded

    def bind(self, address):  # what the kernel answers a user who is not root (the suite may run as root)
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(socket.socket, "bind", bind)
    code, out, err = command_status(capsys, serve_cli.main, str(run), "port=80", "--quiet")
    assert (code, loaded) == (1, [])
    assert err == (
        "petl-serve: error: cannot listen on 127.0.0.1:80: Permission denied: ports below 1024 need root; choose "
        "port=8000 (the default) or another of 1024 and above\n"
    )


def test_cuda_graphs_is_checked_set_on_the_served_model_and_refused_on_a_cpu(tmp_path, capsys, monkeypatch):
    with pytest.raises(ValueError, match="^cuda_graphs=-1: must be a number from 0 to 256$"):
        serve.ServeOptions(cuda_graphs=-1)
    run = tmp_path / "lora"
    _run_folder(run, "lora", {}, seed=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    served = []
    create_app = serve.create_app

    def recorded(model, tasks, options):
        served.append(model)
        return create_app(model, tasks, options)

    monkeypatch.setattr(serve, "create_app", recorded)
    # Serving ends at once: what matters is set and said before it starts.
    monkeypatch.setattr(uvicorn.Server, "run", lambda server, sockets: setattr(server, "started", True))
    code, _, err = command_status(capsys, serve_cli.main, str(run), "port=0", "--quiet")
    assert code == 0, err
    # On a CPU it served as the default did, with a note: now refused before any run loads.
    code, _, err = command_status(capsys, serve_cli.main, str(run), "port=0", "cuda_graphs=0", "--quiet")
    assert code == 2 and err == (
        "petl-serve: error: cuda_graphs=0 acts on a CUDA GPU only, and torch sees none here: every batch runs eagerly "
        "on the CPU; drop cuda_graphs=\n"
    ), err
    # The Python API agrees: create_app on a CPU MultiTask set graphs.size to a value that could not act, silently.
    model, tasks = serve.load_tasks({"lora": run})
    with pytest.raises(ValueError, match=r"^cuda_graphs=0 acts on a CUDA GPU only, and the MultiTask is on the CPU: "):
        serve.create_app(model, tasks, serve.ServeOptions(cuda_graphs=0, precision="no"))
    model.graphs.size = 3
    serve.create_app(model, tasks, serve.ServeOptions(precision="no"))
    assert served[0].graphs.size == 8 and model.graphs.size == 8


def test_an_app_served_again_answers_again(tmp_path):
    # The batcher's thread was made once and shut down with the first lifespan: served a second time (a second
    # `with TestClient(app)`, as FastAPI's docs test an app), every image was answered 500.  And a request once no
    # lifespan runs was queued for a worker gone: it waited for ever.
    _run_folder(tmp_path / "lora", "lora", {}, seed=0)
    app = serve.create_app(*serve.load_tasks({"lora": tmp_path / "lora"}), serve.ServeOptions(precision="no"))
    route = serve.PREDICT_ROUTE.format(task="lora")
    answers = []
    for _ in range(2):
        with TestClient(app) as client:
            answers.append(client.post(route, content=_png()))
    assert [a.status_code for a in answers] == [200, 200] and answers[0].json() == answers[1].json()
    outside = TestClient(app, raise_server_exceptions=False).post(route, content=_png())  # no lifespan
    assert outside.status_code == 503 and outside.json()["detail"].startswith("the batcher's worker is not running")


def test_a_request_answered_with_an_error_leaves_its_other_images_unrun():
    # Its first batch failed and it was answered 500, but its other images still ran, for no one, in batches beside
    # other requests' images (which failed with them, where the failure was the request's: the GPU's memory, say).
    calls = []

    def forward(images: torch.Tensor, tasks: torch.Tensor) -> torch.Tensor:
        calls.append(len(images))
        raise RuntimeError("out of memory")

    async def scenario() -> None:
        batcher = Batcher(forward, max_batch=2, max_wait_s=0, max_queue=8, metrics=ServeMetrics())
        worker = asyncio.create_task(batcher.run())
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="out of memory"):
            await batcher.submit([torch.zeros(3, 2, 2)] * 6, 0)
        await asyncio.sleep(0.01)  # a later batch would have started by now
        worker.cancel()

    asyncio.run(scenario())
    assert calls == [2]


def test_the_room_a_request_gone_took_in_the_queue_is_free_again():
    # Its rows stayed in the queue until a batch took them: while the model was busy, the requests of clients that had
    # given up kept the queue full, and new requests were answered 503.
    release, started = threading.Event(), threading.Event()

    def forward(images: torch.Tensor, tasks: torch.Tensor) -> torch.Tensor:
        started.set()
        release.wait()
        return images.flatten(1)

    async def scenario() -> None:
        batcher = Batcher(forward, max_batch=1, max_wait_s=0, max_queue=2, metrics=ServeMetrics())
        worker = asyncio.create_task(batcher.run())
        await asyncio.sleep(0)
        image = torch.zeros(3, 1, 1)
        running = asyncio.create_task(batcher.submit([image], 0))
        await asyncio.to_thread(started.wait)  # the model is busy with it
        gone = asyncio.create_task(batcher.submit([image, image], 0))
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        assert batcher.metrics.queued.values[()] == 0
        waiting = asyncio.create_task(batcher.submit([image, image], 1))  # was refused: QueueFull
        release.set()
        assert len(await running) == 1 and len(await waiting) == 2
        worker.cancel()

    try:
        asyncio.run(scenario())
    finally:
        release.set()  # a failed assertion leaves no forward waiting for ever


def test_a_lifespan_started_again_in_the_same_loop_has_a_working_batcher():
    # The lifespan's end cancelled the worker without waiting for it: a worker waiting for more rows (a request queued)
    # stopped a few loop turns later, after a lifespan started again in the same loop (asgi-lifespan's LifespanManager
    # in an async test), shutting down the new executor and marking the batcher stopped: every request answered 500.
    batcher = Batcher(lambda images, tasks: images.flatten(1), 2, max_wait_s=60, max_queue=8, metrics=ServeMetrics())
    app = types.SimpleNamespace(state=types.SimpleNamespace(batcher=batcher))
    image = torch.zeros(3, 1, 1)

    async def scenario() -> int:
        async with serve._lifespan(app):
            waiting = asyncio.create_task(batcher.submit([image], 0))
            await asyncio.sleep(0.01)  # the worker waits (60 s) for a second row
        async with serve._lifespan(app):
            await asyncio.sleep(0.01)  # a client's request takes some loop turns to arrive
            answered = len(await asyncio.wait_for(batcher.submit([image, image], 0), 10))  # a full batch: runs at once
        waiting.cancel()
        return answered

    assert asyncio.run(scenario()) == 2


def test_the_requests_a_stopped_worker_leaves_end_instead_of_waiting_for_ever():
    # A request in flight when the lifespan ended (its images queued, or in the forward the worker stopped waiting
    # for) awaited its rows for ever; they are cancelled, which petl-serve answers 503 (the server shut down).
    release = threading.Event()

    def forward(images: torch.Tensor, tasks: torch.Tensor) -> torch.Tensor:
        release.wait()
        return images.flatten(1)

    batcher = Batcher(forward, max_batch=1, max_wait_s=0, max_queue=8, metrics=ServeMetrics())
    app = types.SimpleNamespace(state=types.SimpleNamespace(batcher=batcher))
    image = torch.zeros(3, 1, 1)

    async def scenario() -> list[bool]:
        async with serve._lifespan(app):
            running = asyncio.create_task(batcher.submit([image], 0))
            queued = asyncio.create_task(batcher.submit([image], 1))
            await asyncio.sleep(0.01)  # the first in the forward, the second queued behind it
        await asyncio.sleep(0.01)
        return [running.cancelled(), queued.cancelled()]

    try:
        assert asyncio.run(scenario()) == [True, True]
    finally:
        release.set()


def test_a_forward_a_stopped_worker_left_running_ends_before_the_next_runs_starts():
    # A run's executor is shut down without waiting: served again while the last forward ran (a lifespan ended in the
    # middle of one), the new run's thread started a forward beside it, and the MultiTask, which routes the batch it
    # runs through state it holds, mixed the two batches' rows.
    release, started, guard = threading.Event(), threading.Event(), threading.Lock()
    running, most = [0], [0]

    def forward(images: torch.Tensor, tasks: torch.Tensor) -> torch.Tensor:
        with guard:
            running[0] += 1
            most[0] = max(most[0], running[0])
        if not started.is_set():
            started.set()
            release.wait()
        with guard:
            running[0] -= 1
        return images.flatten(1)

    batcher = Batcher(forward, max_batch=1, max_wait_s=0, max_queue=8, metrics=ServeMetrics())
    app = types.SimpleNamespace(state=types.SimpleNamespace(batcher=batcher))
    image = torch.zeros(3, 1, 1)

    async def scenario() -> tuple[bool, int]:
        async with serve._lifespan(app):
            first = asyncio.create_task(batcher.submit([image], 0))  # cancelled with the worker
            await asyncio.to_thread(started.wait)
        async with serve._lifespan(app):
            second = asyncio.create_task(batcher.submit([image], 1))
            await asyncio.sleep(0.05)  # time for the second forward to start, were nothing holding it
            release.set()
            return first.cancelled(), len(await second)

    try:
        assert asyncio.run(scenario()) == (True, 1) and most[0] == 1
    finally:
        release.set()


def test_a_shutdown_runs_the_queued_images_without_waiting_for_their_batching_window():
    # With max_wait_ms above shutdown_timeout_s, a request queued at a SIGTERM waited out its window, which no new
    # request would shorten, and was cancelled: 503 while the model sat idle.
    def forward(images: torch.Tensor, tasks: torch.Tensor) -> torch.Tensor:
        return images.flatten(1)

    batcher = Batcher(forward, max_batch=8, max_wait_s=3600, max_queue=8, metrics=ServeMetrics())

    async def scenario() -> int:
        worker = asyncio.create_task(batcher.run())
        await asyncio.sleep(0)
        waiting = asyncio.create_task(batcher.submit([torch.zeros(3, 1, 1)], 0))
        await asyncio.sleep(0.01)  # queued, its window an hour
        batcher.drain()
        try:
            return len(await asyncio.wait_for(waiting, 60))
        finally:
            worker.cancel()

    assert asyncio.run(scenario()) == 1


def test_petl_serves_server_drains_the_batcher_when_its_shutdown_begins(app, monkeypatch):
    drained = []
    monkeypatch.setattr(app.state.batcher, "drain", lambda: drained.append(True))
    listening = serve_cli.bind("127.0.0.1", 0)
    serve_cli.listen(listening, "127.0.0.1", 0)
    server = serve.make_server(app, "127.0.0.1", listening.getsockname()[1], serve.ServeOptions(), access_log=False)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listening]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60  # a server that failed to start (its thread ended) fails the test, not hangs
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    server.should_exit = True  # what uvicorn's SIGTERM and Ctrl-C handlers set
    thread.join(timeout=60)
    assert drained == [True] and not thread.is_alive()
