"""petl-serve's server: many trained runs over one frozen backbone, over HTTP, with batches formed across tasks.

Every run is loaded into one :class:`petl.MultiTask` (:meth:`~petl.MultiTask.from_runs`: the backbone the runs'
``model.json`` record, built once, each run checked as :func:`petl.load_run` checks it: its weights' hash, the
frozen tensors' hash, the head's class count).  Requests go through one :class:`~petl.deploy.batcher.Batcher`,
which runs the images of concurrent requests, whatever their task, as one mixed batch.

Routes (FastAPI; ``/docs`` shows them with their schemas):

* ``POST /v1/tasks/{task}/predict?top_k=5``: one image as the raw body, or several as multipart file fields;
  each image's top-k class names and probabilities, as ``petl-predict`` gives them.
* ``GET /v1/tasks``: each task's method, classes, trainable parameters, backbone and input size.
* ``GET /health``, ``GET /metrics`` (Prometheus text), ``GET /`` (a page to try the tasks on an image).

With the environment variable ``PETL_SERVE_TOKEN`` set, ``/v1/...`` and ``/metrics`` answer only requests
carrying ``Authorization: Bearer <token>``; ``/health``, the page and the OpenAPI docs hold no task data and
stay open (the page asks for the token itself).  Every error is JSON ``{"detail": "one line"}`` saying what
to do; a request never takes the server down.
"""

from __future__ import annotations

import asyncio
import hmac
import io
import logging
import os
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from PIL import Image
from starlette.datastructures import UploadFile

from petl.data.images import decode_image
from petl.data.transforms import ImageSpec, pil_to_tensor
from petl.deploy.batcher import Batcher, QueueFull
from petl.deploy.metrics import ServeMetrics
from petl.deploy.multitask import MultiTask
from petl.model.params import count_params
from petl.store.load import read_card, spec_of
from petl.utils.text import shown
from petl.version import __version__

log = logging.getLogger("petl.serve")

TOKEN_VARIABLE = "PETL_SERVE_TOKEN"
# Images larger than this are refused before they are decoded: a small file can hold a huge image (a
# "decompression bomb": a 100 kB PNG of 20,000 x 20,000 pixels decodes to 400 MB).  Pillow only warns below
# twice its own limit (89 MP); 50 MP is above any camera photo a classifier at a few hundred pixels needs.
MAX_PIXELS = 50_000_000
PREDICT_ROUTE = "/v1/tasks/{task}/predict"


@dataclass(frozen=True)
class ServeOptions:
    """How the server batches and what it accepts (``petl-serve``'s ``key=value`` options).

    Attributes:
        max_batch: the most images in one mixed batch.
        max_wait_ms: how long the oldest queued image waits for others before its batch runs.
        max_queue: the most images waiting at once (and in one request); beyond it requests get 503.
        max_upload_mb: the largest request body, in MB (2**20 bytes); larger ones get 413.
        token: the bearer token every data route needs (``None``: no token).

    """

    max_batch: int = 32
    max_wait_ms: float = 5.0
    max_queue: int = 256
    max_upload_mb: float = 20.0
    token: str | None = None

    @property
    def max_upload_bytes(self) -> int:
        return int(self.max_upload_mb * 2**20)


@dataclass(frozen=True)
class Task:
    """One served run: its name in the routes, its row index in the MultiTask, what ``GET /v1/tasks`` shows."""

    name: str
    index: int
    run_dir: Path
    method: str
    class_names: list[str]
    spec: ImageSpec
    trainable_parameters: int
    backbone: str

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "method": self.method,
            "num_classes": len(self.class_names),
            "classes": self.class_names,
            "trainable_parameters": self.trainable_parameters,
            "backbone": self.backbone,
            "resolution": self.spec.image_size,
            "run": shown(self.run_dir),
        }


def load_tasks(runs: Mapping[str, str | Path]) -> tuple[MultiTask, list[Task]]:
    """Every run (task name -> run folder) loaded into one MultiTask over the backbone their cards record.

    Raises:
        ValueError: a run that fails :func:`petl.load_run`'s checks, was trained on another backbone than the
            others, or whose method cannot share the backbone (the message names it).

    """
    served = MultiTask.from_runs({name: Path(folder) for name, folder in runs.items()})
    if torch.cuda.is_available():
        served.cuda()
    tasks = []
    for index, (name, folder) in enumerate(runs.items()):
        card = read_card(folder)
        tasks.append(
            Task(
                name=name,
                index=index,
                run_dir=Path(folder),
                method=card["method"],
                class_names=[str(c) for c in card["class_names"]],
                spec=spec_of(card),
                trainable_parameters=count_params(served.tasks[index]).trainable,
                backbone=card["backbone"]["name"],
            )
        )
    return served, tasks


class BadImage(ValueError):
    """An uploaded image that cannot be used; the message names it and says why."""


def preprocess(data: bytes, spec: ImageSpec, max_pixels: int = MAX_PIXELS) -> torch.Tensor:
    """One uploaded file's bytes as a model input, checked: a decodable image of at most ``max_pixels`` pixels.

    Raises:
        ValueError: not an image, truncated, damaged, or too large (one phrase saying which).

    """
    limit = f"over the {max_pixels / 1e6:g} MP limit"
    try:
        with Image.open(io.BytesIO(data)) as header:  # reads the header only: the size, before any decoding
            width, height = header.size
    except Image.DecompressionBombError:  # over twice Pillow's own limit
        raise ValueError(f"more than {2 * Image.MAX_IMAGE_PIXELS / 1e6:.0f} MP is {limit}") from None
    except (OSError, SyntaxError, ValueError):
        width = height = 0  # decode_image below says what is wrong, in its words
    if width * height > max_pixels:
        raise ValueError(f"{width} x {height} pixels is {limit}")
    return pil_to_tensor(Image.fromarray(decode_image(data)), spec)


def _preprocess_all(uploads: list[tuple[str, bytes]], spec: ImageSpec) -> list[torch.Tensor]:
    tensors = []
    for number, (name, data) in enumerate(uploads, 1):
        try:
            tensors.append(preprocess(data, spec))
        except ValueError as error:
            which = f"image {number}" + (f" ({shown(name)})" if name else "")
            raise BadImage(f"{which}: {error}: send a complete PNG, JPEG, WebP, BMP, GIF or TIFF image") from None
    return tensors


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, refused (413) as soon as it is known to exceed ``limit`` bytes.

    A declared ``Content-Length`` over the limit is refused before anything is read; a body sent without
    one (chunked) is read until it passes the limit.
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _too_large(len(body), limit, at_least=True)
    return bytes(body)


def _too_large(size: int, limit: int, at_least: bool = False) -> HTTPException:
    mb = f"{'over ' if at_least else ''}{size / 2**20:.1f} MB"
    return HTTPException(
        413,
        f"the request is {mb}, over max_upload_mb={limit / 2**20:g}: send smaller images "
        "(or start petl-serve with a larger max_upload_mb)",
    )


async def _uploads(request: Request, body: bytes, options: ServeOptions) -> list[tuple[str, bytes]]:
    """The images of a request: its multipart file fields, or the whole body as one image."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        if not body:
            raise HTTPException(400, "no image in the request: send the image as the body or as multipart file fields")
        return [("", body)]

    async def replay() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    form = await Request(request.scope, replay).form(
        max_files=options.max_queue, max_fields=options.max_queue, max_part_size=options.max_upload_bytes
    )
    uploads = []
    try:
        for field, value in form.multi_items():
            if not isinstance(value, UploadFile):
                raise HTTPException(400, f"multipart field {field!r} is text, not a file: send images as file fields")
            uploads.append((value.filename or field, await value.read()))
    finally:
        await form.close()
    if not uploads:
        raise HTTPException(400, "the multipart request holds no file: send each image as a file field")
    return uploads


def _top_k(logits: torch.Tensor, task: Task, k: int) -> dict[str, Any]:
    """One row's top-k, as ``petl-predict`` computes it (softmax over the task's own classes)."""
    probabilities = logits[: len(task.class_names)].float().softmax(-1)
    values, indices = probabilities.topk(min(k, probabilities.shape[-1]))
    return {
        "labels": [task.class_names[int(i)] for i in indices],
        "probabilities": [float(v) for v in values],
    }


class _CountRequests:
    """ASGI middleware counting every answer by route template and status (unknown paths as ``unmatched``)."""

    def __init__(self, app: Any, metrics: ServeMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]

        async def record(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, record)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.requests.inc(route=route, status=str(status[0]))


def _page() -> str:
    return resources.files("petl.deploy").joinpath("page.html").read_text(encoding="utf-8")


# The page loads nothing from elsewhere: no CDN, no fonts, its script and style inline.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "img-src 'self' data: blob:; connect-src 'self'",
    "X-Content-Type-Options": "nosniff",
}

_IMAGE_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
            "image/*": {"schema": {"type": "string", "format": "binary"}},
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "properties": {"image": {"type": "array", "items": {"type": "string", "format": "binary"}}},
                }
            },
        },
    }
}


def create_app(served: MultiTask, tasks: list[Task], options: ServeOptions) -> FastAPI:
    """The FastAPI application serving ``tasks`` (loaded by :func:`load_tasks`) through one batcher."""
    metrics = ServeMetrics()
    by_name = {task.name: task for task in tasks}
    device = next(served.parameters()).device
    batcher = Batcher(
        lambda images, rows: served(images.to(device), rows),
        options.max_batch,
        options.max_wait_ms / 1000,
        options.max_queue,
        metrics,
    )
    page = _page()

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        worker = asyncio.create_task(batcher.run())
        await asyncio.sleep(0)  # the worker is ready before the first request
        try:
            yield
        finally:
            worker.cancel()

    app = FastAPI(
        title="petl-serve",
        description="Trained petl runs over one shared frozen backbone; images of concurrent requests are "
        "batched together across tasks.",
        version=__version__,
        lifespan=lifespan,
    )
    bearer = HTTPBearer(auto_error=False, description=f"the token in {TOKEN_VARIABLE} (when the server has one)")

    def check_token(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:  # noqa: B008
        if options.token is None:
            return
        given = credentials.credentials if credentials is not None else ""
        if not hmac.compare_digest(given.encode(), options.token.encode()):
            raise HTTPException(
                401,
                f"missing or wrong bearer token: send the header 'Authorization: Bearer <{TOKEN_VARIABLE}>'",
                headers={"WWW-Authenticate": "Bearer"},
            )

    guarded = [Depends(check_token)]

    @app.exception_handler(RequestValidationError)
    async def one_line_validation(_request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        where = ".".join(str(part) for part in first.get("loc", ()) if part not in ("query", "path"))
        return JSONResponse({"detail": f"{where}: {first.get('msg', 'invalid value')}: fix it and send again"}, 422)

    @app.exception_handler(Exception)
    async def one_line_error(_request: Request, error: Exception) -> JSONResponse:
        log.exception("request failed")
        return JSONResponse({"detail": f"internal error ({type(error).__name__}): the server goes on; retry"}, 500)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def index() -> HTMLResponse:
        return HTMLResponse(page, headers=PAGE_HEADERS)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        """Liveness: answers without a token."""
        return {"status": "ok", "tasks": len(tasks)}

    @app.get("/v1/tasks", dependencies=guarded)
    async def list_tasks() -> dict[str, Any]:
        """Every task served: its method, classes, trainable parameters, backbone and input resolution."""
        return {"tasks": [task.describe() for task in tasks]}

    @app.get("/metrics", dependencies=guarded, response_class=PlainTextResponse)
    async def prometheus() -> PlainTextResponse:
        """Requests, images, batch sizes formed, queue wait and latency histograms, in Prometheus' text format."""
        return PlainTextResponse(metrics.text(), media_type="text/plain; version=0.0.4")

    @app.post(PREDICT_ROUTE, dependencies=guarded, openapi_extra=_IMAGE_BODY)
    async def predict(request: Request, task: str, top_k: int = Query(5, ge=1)) -> dict[str, Any]:  # noqa: B008
        """Top-k class names and probabilities for one image (the raw body) or several (multipart file fields)."""
        started = time.perf_counter()
        found = by_name.get(task)
        if found is None:
            listed = ", ".join(by_name)
            raise HTTPException(404, f"unknown task {task!r}: the tasks are {listed} (GET /v1/tasks lists them)")
        uploads = await _uploads(request, await read_body(request, options.max_upload_bytes), options)
        if len(uploads) > options.max_queue:
            raise HTTPException(
                413, f"{len(uploads)} images in one request, over max_queue={options.max_queue}: split it"
            )
        try:
            images = await asyncio.to_thread(_preprocess_all, uploads, found.spec)
        except BadImage as error:
            raise HTTPException(400, str(error)) from None
        try:
            rows = await batcher.submit(images, found.index)
        except QueueFull as error:
            raise HTTPException(503, f"{error}: retry in a moment", headers={"Retry-After": "1"}) from None
        metrics.images.inc(len(rows), task=found.name)
        metrics.latency.observe(time.perf_counter() - started)
        predictions = [
            {"image": name, **_top_k(row, found, top_k)} for (name, _), row in zip(uploads, rows, strict=True)
        ]
        return {"task": found.name, "predictions": predictions}

    app.add_middleware(_CountRequests, metrics=metrics)
    return app


def token_from_environment() -> str | None:
    """The bearer token from ``PETL_SERVE_TOKEN`` (``None`` when unset or empty): never from the command line."""
    return os.environ.get(TOKEN_VARIABLE) or None
