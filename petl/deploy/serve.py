"""petl-serve's server: many trained runs over one frozen backbone, over HTTP, with batches formed across tasks.

Every run is loaded into one :class:`petl.MultiTask` (:meth:`~petl.MultiTask.from_runs`: the backbone the runs'
``model.json`` record, built once, each run checked as :func:`petl.load_run` checks it: its weights' hash, the
frozen tensors' hash, the head's class count).  Requests go through one :class:`~petl.deploy.batcher.Batcher`,
which runs the images of concurrent requests, whatever their task, as one mixed batch.

Routes (FastAPI, on :data:`router` and :data:`data_router`; each JSON answer is a Pydantic model, so
``/openapi.json`` describes them; no ``/docs`` page, which would load Swagger UI from a CDN):

* ``POST /v1/tasks/{task}/predict?top_k=5``: one image as the raw body, or several as multipart file fields;
  each image's top-k class names and probabilities, as ``petl-predict`` gives them.
* ``GET /v1/tasks``: each task's method, classes, trainable parameters, backbone and input size.
* ``GET /health`` (with the device and the precision served in), ``GET /metrics`` (Prometheus text), ``GET /``
  (a page to try the tasks on an image).

With the environment variable ``PETL_SERVE_TOKEN`` set, ``/v1/...`` and ``/metrics`` answer only requests
carrying ``Authorization: Bearer <token>``; ``/health``, the page and ``/openapi.json`` hold no task data and
stay open (the page asks for the token itself).  Every error is JSON ``{"detail": "one line"}`` saying what
to do; a request never takes the server down.

What one client can hold is bounded (:class:`ServeOptions`): the body's bytes, each image's and each request's
pixels (checked from the headers, before decoding), the images decoded at once, the time to send the request
headers and the body, the connections open at once, and the time a shutdown waits for requests in flight.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Coroutine, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import h11
import torch
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, Field
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match
from uvicorn.protocols.http.h11_impl import H11Protocol

from petl.data.transforms import ImageSpec
from petl.deploy.batcher import Batcher, QueueFull, WorkerStopped
from petl.deploy.metrics import ServeMetrics
from petl.deploy.multitask import MultiTask
from petl.deploy.uploads import BadImage, TooManyPixels, check_pixels, cut_short, is_multipart, preprocess_all
from petl.model.params import count_params
from petl.store.run_card import read_card, spec_of
from petl.utils.precision import INFERENCE_PRECISIONS, describe, inference, inference_precision
from petl.utils.text import shown
from petl.version import __version__

log = logging.getLogger("petl.serve")

TOKEN_VARIABLE = "PETL_SERVE_TOKEN"
PREDICT_ROUTE = "/v1/tasks/{task}/predict"
# Images decoded at once, whatever the number of requests: a decoded image costs about 10 bytes per pixel on its
# way to the model's few hundred pixels (the file's pixels, an RGB copy, the resized one), so this and
# max_image_mp bound the decoding memory (2 x 16 MP: about 0.3 GB).
DECODE_SLOTS = 2
# Each option's allowed range (inclusive): a value outside it, or not finite, is refused naming the option.
# Pillow itself refuses images over twice its Image.MAX_IMAGE_PIXELS (89 MP) before decoding them.
OPTION_RANGES: dict[str, tuple[float, float]] = {
    "max_batch": (1, 4096),
    "max_wait_ms": (0, 10_000),
    "max_queue": (1, 100_000),
    "max_upload_mb": (0.01, 1024),
    "max_image_mp": (0.001, 178),
    "max_request_mp": (0.001, 10_000),
    "header_timeout_s": (0.1, 3600),
    "body_timeout_s": (0.1, 3600),
    "max_connections": (1, 100_000),
    "shutdown_timeout_s": (0, 3600),
    "cuda_graphs": (0, 256),
}


@dataclass(frozen=True)
class ServeOptions:
    """How the server batches and what it accepts (``petl-serve``'s ``key=value`` options).

    Attributes:
        max_batch: the most images in one mixed batch.
        max_wait_ms: how long the oldest queued image waits for others before its batch runs.
        max_queue: the most images waiting at once (beyond it requests get 503) and in one request (413).
        max_upload_mb: the largest request body, in MB (2**20 bytes); larger ones get 413.
        max_image_mp: the most pixels in one image, in millions (its header is read before it is decoded); 413.
        max_request_mp: the most pixels in all the images of one request, in millions; 413.
        header_timeout_s: a connection whose request headers have not all arrived this long after it opened (or
            after its last answer) is closed.
        body_timeout_s: a request whose body has not all arrived this long after its headers gets 408.
        max_connections: the most connections (and requests) at once; requests beyond it get 503.
        shutdown_timeout_s: how long a shutdown (SIGTERM, Ctrl-C) waits for requests in flight before ending them.
        cuda_graphs: on a GPU, the most CUDA graphs the MultiTask keeps, one per mix of tasks in a batch that comes
            again (one per padded batch size where the tasks run every row: ``MultiTask.every_row``;
            ``MultiTask.graphs.size``); 0: every batch eager.  Another value than 8 is refused (by
            :func:`create_app`, petl-serve) where the runs are served off a CUDA GPU.
        token: the bearer token every data route needs (``None``: no token); ASCII, no space at its ends and no
            control character, as an ``Authorization`` header carries it (:func:`unsendable`).
        precision: the forward's precision, as ``train.precision`` (:mod:`petl.utils.precision`): ``auto`` (bf16
            autocast on a CUDA GPU with native bf16, fp32 elsewhere), ``no`` (strict fp32), ``tf32``, ``bf16``.
            Set when the app is made, for every request; the weights stay fp32 and probabilities are fp32.

    Raises:
        ValueError: a value that is not a finite number in :data:`OPTION_RANGES`, a precision not in
            :data:`petl.utils.precision.INFERENCE_PRECISIONS`, or a token no client can send (one line naming the
            option).

    """

    max_batch: int = 32
    max_wait_ms: float = 5.0
    max_queue: int = 256
    max_upload_mb: float = 20.0
    max_image_mp: float = 16.0
    max_request_mp: float = 64.0
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_connections: int = 128
    shutdown_timeout_s: float = 10.0
    cuda_graphs: int = 8
    token: str | None = None
    precision: str = "auto"

    def __post_init__(self) -> None:
        if self.precision not in INFERENCE_PRECISIONS:
            raise ValueError(f"precision={self.precision!r}: must be one of {', '.join(INFERENCE_PRECISIONS)}")
        for name, (low, high) in OPTION_RANGES.items():
            value = getattr(self, name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or not math.isfinite(value) or not low <= value <= high:
                shown_value = f"{value:g}" if number else repr(value)
                raise ValueError(f"{name}={shown_value}: must be a number from {low:g} to {high:g}")
        if self.token is not None and (problem := unsendable(self.token)) is not None:
            raise ValueError(problem)

    @property
    def max_upload_bytes(self) -> int:
        return int(self.max_upload_mb * 2**20)


def refuse_graphs_off_gpu(options: ServeOptions, device_type: str, why: str) -> None:
    """Refuse a ``cuda_graphs`` other than its default where the forward runs on ``device_type`` other than ``cuda``.

    Args:
        options: the server's options.
        device_type: the device type the runs are served on.
        why: what puts them there, for the one line (``torch sees none here``).

    Raises:
        ValueError: the option would have no effect: no graph is kept off a CUDA GPU (one line naming it).

    """
    if device_type != "cuda" and options.cuda_graphs != ServeOptions.cuda_graphs:
        raise ValueError(
            f"cuda_graphs={options.cuda_graphs} acts on a CUDA GPU only, and {why}: every batch runs eagerly on the "
            f"{device_type.upper()}; drop cuda_graphs="
        )


def unsendable(token: str) -> str | None:
    """Why no client can send ``token`` in an ``Authorization`` header (one line naming the character by its place,
    the token itself unshown), or ``None``.

    HTTP strips the spaces around a header's value and takes no control character or non-ASCII one as it is: such a
    token (a trailing carriage return from a file with Windows line ends, ``$(cat token.txt)``) is never matched, and
    every request would get 401.
    """
    edges = [place for place in (0, len(token) - 1) if token and token[place].isspace()]
    bad = edges or [place for place, char in enumerate(token) if not " " <= char <= "~"]
    if not bad:
        return None
    char = token[bad[0]]
    said = repr(char) if char.isspace() or not char.isprintable() else "not ASCII"  # a letter of the secret: unsaid
    return (
        f"token ({TOKEN_VARIABLE}): its character {bad[0] + 1} of {len(token)} is {said}, which no client can send in "
        "an Authorization header: set it to ASCII letters, digits and -._~+/= (python -c 'import secrets; "
        "print(secrets.token_urlsafe())')"
    )


# What the routes answer.  The fields' order is the order of the keys in the JSON answers.


class Health(BaseModel):
    """``GET /health``: the server is up; what it serves on."""

    status: Literal["ok"] = Field(description="always ok: the server answers")
    tasks: int = Field(description="the number of tasks served")
    device: str = Field(description="the device the forward runs on (cpu, cuda)")
    precision: str = Field(description="the precision served in: no (fp32), tf32 or bf16")


class TaskInfo(BaseModel):
    """One task served."""

    name: str = Field(description="the task's name in the routes")
    method: str = Field(description="the PETL method the run trained (lora, vpt...)")
    num_classes: int = Field(description="the number of classes")
    classes: list[str] = Field(description="the class names, in the head's order")
    trainable_parameters: int = Field(description="the parameters the run trained")
    backbone: str = Field(description="the frozen backbone's timm name, shared by every task")
    resolution: int = Field(description="the side of the square image the model reads, in pixels")
    run: str = Field(description="the run folder the task was loaded from")


class TaskList(BaseModel):
    """``GET /v1/tasks``: every task served, in the order they were given."""

    tasks: list[TaskInfo] = Field(description="one per task")


class Prediction(BaseModel):
    """One image's top-k classes, most probable first, as ``petl-predict`` computes them."""

    image: str = Field(description="a multipart file's name (or its field's); empty for an image sent as the body")
    labels: list[str] = Field(description="the top-k class names")
    probabilities: list[float] = Field(description="their probabilities (a softmax over the task's classes)")


class Predictions(BaseModel):
    """``POST /v1/tasks/{task}/predict``: the top-k of each image, in the order they were sent."""

    task: str = Field(description="the task named in the route")
    predictions: list[Prediction] = Field(description="one per image, in the order they were sent")


class Problem(BaseModel):
    """Every error's answer (its status code says which error)."""

    detail: str = Field(description="one line saying what went wrong and what to do")


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

    def describe(self) -> TaskInfo:
        """What ``GET /v1/tasks`` shows of the task."""
        return TaskInfo(
            name=self.name,
            method=self.method,
            num_classes=len(self.class_names),
            classes=self.class_names,
            trainable_parameters=self.trainable_parameters,
            backbone=self.backbone,
            resolution=self.spec.image_size,
            run=shown(self.run_dir),
        )


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
    # Three significant digits: the limit is max_upload_mb rounded down to whole bytes (0.01 MB is 10485 bytes,
    # 0.00999928 MB), and a small body is a small fraction of a MB.
    mb = f"{'over ' if at_least else ''}{size / 2**20:.3g} MB"
    return HTTPException(
        413,
        f"the request is {mb}, over max_upload_mb={limit / 2**20:.3g}: send smaller images "
        "(or start petl-serve with a larger max_upload_mb)",
    )


async def _uploads(request: Request, body: bytes, options: ServeOptions) -> list[tuple[str, bytes]]:
    """The images of a request: its multipart file fields, or the whole body as one image."""
    if not is_multipart(request.headers.get("content-type", "")):
        if not body:
            raise HTTPException(400, "no image in the request: send the image as the body or as multipart file fields")
        return [("", body)]

    async def replay() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    try:
        form = await Request(request.scope, replay).form(
            max_files=options.max_queue, max_fields=options.max_queue, max_part_size=options.max_upload_bytes
        )
    except StarletteHTTPException as error:  # starlette's 400, in its words ("Invalid multipart data.")
        detail = str(error.detail)
        if detail.startswith("Too many files"):
            raise _too_many(f"more than {options.max_queue}", options.max_queue) from None
        if detail.startswith("Too many fields"):
            raise HTTPException(
                400,
                f"the multipart request holds more than {options.max_queue} text fields: send images as file fields",
            ) from None
        raise HTTPException(
            400,
            f"the multipart body cannot be read ({detail.rstrip('.')}): send each image as a file field "
            "(curl -F image=@cat.jpg), or one image as the whole body",
        ) from None
    uploads = []
    try:
        # A body the parser read, whose part cut short it dropped without an error.
        if (problem := cut_short(body, request.headers["content-type"])) is not None:
            raise HTTPException(400, problem)
        for field, value in form.multi_items():
            if not isinstance(value, UploadFile):
                raise HTTPException(400, f"multipart field {field!r} is text, not a file: send images as file fields")
            uploads.append((value.filename or field, await value.read()))
    finally:
        await form.close()
    if not uploads:
        raise HTTPException(400, "the multipart request holds no file: send each image as a file field")
    return uploads


def _too_many(count: int | str, max_queue: int) -> HTTPException:
    return HTTPException(413, f"{count} images in one request, over max_queue={max_queue}: split it")


class _BodyDeadline:
    """ASGI middleware: a request whose body has not all arrived ``seconds`` after its headers gets 408.

    uvicorn bounds neither how long a body takes nor how long one chunk of it does; a client sending a few
    bytes a minute would hold its connection (and a shutdown) for ever.  Only the body's reads are timed:
    a wait for the client's disconnect after the body is complete is not.
    """

    def __init__(self, app: Any, seconds: float) -> None:
        self.app, self.seconds = app, seconds

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.seconds
        complete = False

        async def timed_receive() -> dict:
            nonlocal complete
            if complete:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise HTTPException(
                    408,
                    f"the request body did not all arrive within body_timeout_s={self.seconds:g}: send it again "
                    "(on a slow link, send smaller images)",
                    headers={"Connection": "close"},
                ) from None
            complete = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, timed_receive, send)


def header_deadline_protocol(seconds: float) -> type[H11Protocol]:
    """The h11 protocol of uvicorn, closing a connection whose request headers are not all in after ``seconds``.

    The clock starts when the connection opens and again after each answer; uvicorn itself times only idle
    keep-alive connections, so a client sending half a request's headers would hold its connection for ever.
    """

    class HeaderDeadline(H11Protocol):
        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _disarm(self) -> None:
            timer = getattr(self, "_header_timer", None)
            if timer is not None:
                timer.cancel()

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(seconds, self._header_deadline)

        def _header_deadline(self) -> None:
            # IDLE: the client has not finished a request's headers since the timer was set.
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadline


def server_config(app: FastAPI, host: str, port: int, options: ServeOptions, access_log: bool = True) -> Any:
    """The uvicorn configuration of :func:`create_app`'s app with the options' connection limits and deadlines."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=header_deadline_protocol(options.header_timeout_s),
        # uvicorn refuses a request once this many connections are open counting its own: one more, for exactly
        # max_connections (max_connections=1 answered every request 503).
        limit_concurrency=options.max_connections + 1,
        # As given: uvicorn hands it to asyncio.wait_for, which takes a fraction (rounded up, 0.2 s waited 1 s).
        timeout_graceful_shutdown=options.shutdown_timeout_s,
        access_log=access_log,
        log_level="info",
    )


def make_server(app: FastAPI, host: str, port: int, options: ServeOptions, access_log: bool = True) -> Any:
    """The uvicorn server of :func:`server_config`, whose shutdown first runs the images queued (``Batcher.drain``)."""
    import uvicorn

    class Draining(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            app.state.batcher.drain()  # no new request joins them: their batching window would only delay them
            await super().shutdown(sockets)

    return Draining(server_config(app, host, port, options, access_log))


def _top_k(image: str, logits: torch.Tensor, task: Task, k: int) -> Prediction:
    """One row's top-k, as ``petl-predict`` computes it (softmax over the task's own classes)."""
    probabilities = logits[: len(task.class_names)].float().softmax(-1)
    values, indices = probabilities.topk(min(k, probabilities.shape[-1]))
    return Prediction(
        image=image,
        labels=[task.class_names[int(i)] for i in indices],
        probabilities=[float(v) for v in values],
    )


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
            # Predict's two paths (with and without a trailing slash) are one route.
            route = getattr(scope.get("route"), "path", "unmatched").rstrip("/") or "/"
            self.metrics.requests.inc(route=route, status=str(status[0]))


@cache
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

# When each error is answered (docs/serving.md's table), for the OpenAPI schema.
ERRORS = {
    400: "not an image, a truncated or damaged one, an empty body, a text field in a multipart request",
    401: "a missing or wrong bearer token (when the server has one)",
    404: "an unknown task (the answer lists the tasks)",
    408: "the body did not all arrive within body_timeout_s",
    413: "a body over max_upload_mb, more images than max_queue, or more pixels than max_image_mp or max_request_mp",
    422: "a bad query value (top_k=0)",
    500: "the model's forward failed on the batch the request's images ran in (the log holds why): retry",
    503: "the queue is full: retry after Retry-After; a shutdown ended the request before its images ran; or the "
    "batcher stopped on an error (/health says so too): restart the server",
}


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI ``responses`` of these status codes: each a :class:`Problem`, as JSON."""
    # The schema given as JSON content rather than as "model": FastAPI files a model under the route's own media
    # type (text/plain for /metrics), but every error is JSON.
    problem = {"application/json": {"schema": Problem.model_json_schema()}}
    return {code: {"description": ERRORS[code], "content": problem} for code in codes}


# The server's state, set on app.state by create_app, reached by the routes through these dependencies.  Each is
# async: FastAPI runs a plain def dependency in a worker thread, a thread hop per request for an attribute read.


async def get_tasks(request: Request) -> dict[str, Task]:
    """The tasks served, by name, in the order they were given."""
    return request.app.state.tasks


async def get_options(request: Request) -> ServeOptions:
    """The server's options."""
    return request.app.state.options


async def get_batcher(request: Request) -> Batcher:
    """The batcher every request's images go through."""
    return request.app.state.batcher


async def get_metrics(request: Request) -> ServeMetrics:
    """The server's Prometheus metrics."""
    return request.app.state.metrics


async def get_decoding(request: Request) -> asyncio.Semaphore:
    """The :data:`DECODE_SLOTS` slots an image is decoded in."""
    return request.app.state.decoding


async def get_device(request: Request) -> str:
    """The device type the forward runs on (``cpu``, ``cuda``)."""
    return request.app.state.device


async def get_precision(request: Request) -> str:
    """The precision every forward runs in (``no``, ``tf32``, ``bf16``)."""
    return request.app.state.precision


TasksDep = Annotated[dict[str, Task], Depends(get_tasks)]
OptionsDep = Annotated[ServeOptions, Depends(get_options)]
BatcherDep = Annotated[Batcher, Depends(get_batcher)]
MetricsDep = Annotated[ServeMetrics, Depends(get_metrics)]
DecodingDep = Annotated[asyncio.Semaphore, Depends(get_decoding)]
DeviceDep = Annotated[str, Depends(get_device)]
PrecisionDep = Annotated[str, Depends(get_precision)]

_bearer = HTTPBearer(auto_error=False, description=f"the token in {TOKEN_VARIABLE} (when the server has one)")


async def check_token(
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)], options: OptionsDep
) -> None:
    """Let a request through when the server has no token, or when it carries the server's (constant-time check).

    Raises:
        HTTPException: 401 with ``WWW-Authenticate: Bearer``, the token missing or wrong.

    """
    if options.token is None:
        return
    given = credentials.credentials if credentials is not None else ""
    if not hmac.compare_digest(given.encode(), options.token.encode()):
        said = f"missing or wrong bearer token: send the header 'Authorization: Bearer <{TOKEN_VARIABLE}>'"
        raise HTTPException(401, said, headers={"WWW-Authenticate": "Bearer"})


# JSONResponse named, not left to FastAPI's default: with a response model, the default writes the JSON with
# Pydantic's encoder, whose floats differ in form from json.dumps' (0.00001234 for 1.234e-05).
# router: what holds no task data (open); data_router: the tasks and the metrics (the token, when there is one).
router = APIRouter(default_response_class=JSONResponse)
data_router = APIRouter(
    default_response_class=JSONResponse, dependencies=[Depends(check_token)], responses=_errors(401)
)


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def index() -> HTMLResponse:
    """The page to try the tasks on an image (it asks for the token itself)."""
    return HTMLResponse(_page(), headers=PAGE_HEADERS)


@router.get("/health", responses=_errors(503))
async def health(tasks: TasksDep, device: DeviceDep, precision: PrecisionDep, batcher: BatcherDep) -> Health:
    """Liveness, the device and the precision served in (``no``: fp32; ``tf32``; ``bf16``): no token needed.

    503 once the batcher has stopped on an error (every predict request would get 503 too): restart the server.
    """
    if batcher.stopped():
        raise HTTPException(503, batcher.stopped())
    return Health(status="ok", tasks=len(tasks), device=device, precision=precision)


# HEAD too, as uptime checkers and load balancers probe (uvicorn sends the headers without the body); out of the
# schema, where a second method on one function would repeat its operation id.
router.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)


@data_router.get("/v1/tasks")
async def list_tasks(tasks: TasksDep) -> TaskList:
    """Every task served: its method, classes, trainable parameters, backbone and input resolution."""
    return TaskList(tasks=[task.describe() for task in tasks.values()])


@data_router.get("/metrics", response_class=PlainTextResponse)
async def prometheus(metrics: MetricsDep) -> PlainTextResponse:
    """Requests, images, batch sizes formed, queue wait and latency histograms, in Prometheus' text format."""
    return PlainTextResponse(metrics.text(), media_type="text/plain; version=0.0.4")


@data_router.post(PREDICT_ROUTE, openapi_extra=_IMAGE_BODY, responses=_errors(400, 404, 408, 413, 422, 500, 503))
async def predict(
    request: Request,
    task: str,
    tasks: TasksDep,
    options: OptionsDep,
    batcher: BatcherDep,
    metrics: MetricsDep,
    decoding: DecodingDep,
    top_k: Annotated[int, Query(ge=1, description="the classes given per image")] = 5,
) -> Predictions:
    """Top-k class names and probabilities for one image (the raw body) or several (multipart file fields)."""
    started = time.perf_counter()
    found = tasks.get(task)
    if found is None:
        # Its first 100 characters, as a path no route has: the client's name was echoed whole (kilobytes a line).
        said = f"unknown task {task[:100]!r}: the tasks are {', '.join(tasks)} (GET /v1/tasks lists them)"
        raise HTTPException(404, said)
    uploads = await _uploads(request, await read_body(request, options.max_upload_bytes), options)
    if len(uploads) > options.max_queue:
        raise _too_many(len(uploads), options.max_queue)
    try:
        check_pixels(uploads, options, found.spec)
        async with decoding:
            images = await asyncio.to_thread(preprocess_all, uploads, found.spec)
        rows = await _unless_gone(request, batcher.submit(images, found.index))
    except TooManyPixels as error:
        raise HTTPException(413, str(error)) from None
    except BadImage as error:
        raise HTTPException(400, str(error)) from None
    except QueueFull as error:
        raise HTTPException(503, f"{error}: retry in a moment", headers={"Retry-After": "1"}) from None
    except WorkerStopped as error:
        raise HTTPException(503, str(error)) from None
    except asyncio.CancelledError:
        # uvicorn cancels the requests still running when shutdown_timeout_s runs out (waiting for a decoding slot
        # or for the model): answered, not left to uvicorn's plain-text 500 (and a traceback in the log).
        said = "the server shut down before the images ran: send them again once it is back"
        raise HTTPException(503, said, headers={"Connection": "close"}) from None
    metrics.images.inc(len(rows), task=found.name)
    metrics.latency.observe(time.perf_counter() - started)
    predictions = [_top_k(name, row, found, top_k) for (name, _), row in zip(uploads, rows, strict=True)]
    return Predictions(task=found.name, predictions=predictions)


async def _unless_gone(request: Request, rows: Coroutine[Any, Any, list[torch.Tensor]]) -> list[torch.Tensor]:
    """The logits ``rows`` awaits; ClientDisconnect (499) if the client goes first, its rows then left unrun."""
    answer = asyncio.ensure_future(rows)
    gone = asyncio.ensure_future(request.receive())  # the body read, what comes next is the client's disconnect
    try:
        await asyncio.wait((answer, gone), return_when=asyncio.FIRST_COMPLETED)
        if not answer.done() and gone.result()["type"] == "http.disconnect":
            raise ClientDisconnect
        return await answer
    finally:  # a cancelled row leaves its batch: a client that gave up (or a shutdown) no longer costs a forward
        gone.cancel()
        answer.cancel()


# .../predict/ answers as .../predict does: Starlette's redirect to the path without the slash (a 307) went to a client
# that had sent its image already, and curl (without -L) ends on the empty redirect.  A GET route's redirect loses
# nothing, so only this one takes both paths; /openapi.json names the one.
data_router.add_api_route(PREDICT_ROUTE + "/", predict, methods=["POST"], include_in_schema=False)


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    worker = asyncio.create_task(app.state.batcher.run())
    await asyncio.sleep(0)  # the worker is ready before the first request
    try:
        yield
    finally:
        worker.cancel()
        # Awaited: a worker waiting for rows took loop turns to stop, and a lifespan started again meanwhile (asgi-
        # lifespan) had its executor shut down and the batcher marked stopped by the old worker's exit: all 500.
        # An error that ended it was logged then (Batcher.failure).
        await asyncio.gather(worker, return_exceptions=True)


async def _one_line_validation(_request: Request, error: RequestValidationError) -> JSONResponse:
    first = error.errors()[0] if error.errors() else {}
    where = ".".join(str(part) for part in first.get("loc", ()) if part not in ("query", "path"))
    return JSONResponse({"detail": f"{where}: {first.get('msg', 'invalid value')}: fix it and send again"}, 422)


ROUTES = (
    "POST /v1/tasks/{task}/predict, GET /v1/tasks, GET or HEAD /health, GET /metrics, GET / "
    "(GET /openapi.json describes them)"
)


async def _say_what_to_do(request: Request, error: StarletteHTTPException) -> Response:
    # Starlette's own answers to a path or a method no route has ("Not Found") say nothing of what to do.
    detail, headers = error.detail, error.headers
    if error.status_code == 404 and detail == "Not Found":
        detail = f"no route {request.method} {request.url.path[:100]!r}: the routes are {ROUTES}"
    elif error.status_code == 405 and detail == "Method Not Allowed":
        # Every route at this path, not only the first (Starlette's Allow: /health's GET, without its HEAD route).
        routes = [*router.routes, *data_router.routes]  # included with no prefix: their paths are the app's
        at_path = [route for route in routes if route.matches(request.scope)[0] == Match.PARTIAL]
        allowed = ", ".join(sorted({method for route in at_path for method in getattr(route, "methods", ())}))
        allowed = allowed or (headers or {}).get("Allow", "")  # a route of FastAPI's own (/openapi.json)
        detail = f"{request.method} is not served at {request.url.path[:100]!r}, only {allowed}: the routes are "
        detail += ROUTES
        headers = {**(headers or {}), "Allow": allowed}
    return await http_exception_handler(request, StarletteHTTPException(error.status_code, detail, headers))


# nginx's status for a request whose client closed the connection first: what /metrics counts it as (nothing is sent).
CLIENT_GONE = 499


async def _client_gone(_request: Request, _error: ClientDisconnect) -> Response:
    # A client that closed its connection before its body was all sent (a cancelled upload) or before its images ran
    # (_unless_gone): nothing to answer, not the server's fault (as any other exception: two tracebacks, a 500).
    return Response(status_code=CLIENT_GONE)


async def _one_line_error(_request: Request, error: Exception) -> JSONResponse:
    log.exception("request failed")
    return JSONResponse({"detail": f"internal error ({type(error).__name__}): the server goes on; retry"}, 500)


def create_app(served: MultiTask, tasks: list[Task], options: ServeOptions) -> FastAPI:
    """The FastAPI application serving ``tasks`` (loaded by :func:`load_tasks`) through one batcher.

    Its routes are :data:`router`'s and :data:`data_router`'s; what they need of this server is set on
    ``app.state`` (``tasks``, ``options``, ``batcher``, ``metrics``, ``decoding``, ``device``, ``precision``).
    """
    metrics = ServeMetrics()
    device = next(served.parameters()).device
    # Fixed here for every request: bf16 autocast and TF32 on a GPU under auto, strict fp32 on a CPU.
    precision = inference_precision(options.precision, device.type)
    refuse_graphs_off_gpu(options, device.type, f"the MultiTask is on the {device.type.upper()}")
    served.graphs.size = options.cuda_graphs

    def forward(images: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        replayed = served.graphs.replayed
        with inference(precision, device.type):
            logits = served(images.to(device), rows)
        metrics.graph_batches.inc(served.graphs.replayed - replayed)
        return logits

    _page()  # read now: a broken install stops the start, not the first visit
    # No /docs or /redoc: FastAPI's pages load Swagger UI and ReDoc from a CDN, blank without the internet and a
    # third-party script in the page.  /openapi.json stays, for any OpenAPI viewer or client generator.
    app = FastAPI(
        title="petl-serve",
        description="Trained petl runs over one shared frozen backbone; images of concurrent requests are "
        f"batched together across tasks; served on {device.type} in {describe(precision, device.type)}.",
        version=__version__,
        lifespan=_lifespan,
        docs_url=None,
        redoc_url=None,
        exception_handlers={
            RequestValidationError: _one_line_validation,
            StarletteHTTPException: _say_what_to_do,
            ClientDisconnect: _client_gone,
            Exception: _one_line_error,
        },
    )
    app.include_router(router)
    app.include_router(data_router)
    app.add_middleware(_BodyDeadline, seconds=options.body_timeout_s)
    app.add_middleware(_CountRequests, metrics=metrics)
    app.state.tasks = {task.name: task for task in tasks}
    app.state.options = options
    app.state.batcher = Batcher(forward, options.max_batch, options.max_wait_ms / 1000, options.max_queue, metrics)
    app.state.metrics = metrics
    app.state.decoding = asyncio.Semaphore(DECODE_SLOTS)
    app.state.device, app.state.precision = device.type, precision
    return app


def token_from_environment() -> str | None:
    """The bearer token from ``PETL_SERVE_TOKEN`` (``None`` when unset or empty): never from the command line."""
    return os.environ.get(TOKEN_VARIABLE) or None
