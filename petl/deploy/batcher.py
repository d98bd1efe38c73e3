"""A dynamic batcher across tasks: rows from concurrent requests, whatever their task, run as one mixed batch.

A request puts its images (rows, each with its task) in one bounded queue and awaits their logits.  One
worker takes the rows in arrival order: it waits until ``max_batch`` rows are queued or the oldest row has
waited ``max_wait_s``, whichever comes first, then runs them as one batch in its own thread (the event loop
keeps accepting requests meanwhile, and rows arriving during a forward pass form the next batch).  A full
queue refuses new rows (:class:`QueueFull`) instead of growing without end.

Forward passes run one at a time (under a lock, across the worker's runs): a forward need not be safe to call from
two threads at once (:class:`petl.MultiTask` routes the batch it runs through state it holds, under a lock of its own).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from petl.deploy.metrics import ServeMetrics
from petl.utils.text import first_line

Tensor = torch.Tensor
log = logging.getLogger("petl.serve")


class QueueFull(RuntimeError):
    """The queue has no room for a request's rows: the caller answers 503."""


class WorkerStopped(RuntimeError):
    """No worker runs the rows (not started, or ended by an error: :attr:`Batcher.failure`): the caller answers 503."""


@dataclass
class _Row:
    image: Tensor
    task: int
    future: asyncio.Future
    queued: float  # time.perf_counter() when queued
    request: object  # the same object for every row of one request


class Batcher:
    """Queues rows of any task and runs them in mixed batches through ``forward``.

    Args:
        forward: ``forward(images, task_index) -> logits``: a stacked batch (N x 3 x H x W) and one task
            index per row (N); called in the batcher's own thread, one call at a time.
        max_batch: the most rows in one batch.
        max_wait_s: the longest the oldest queued row waits for more rows before its batch runs.
        max_queue: the most rows waiting at once; beyond it :meth:`submit` raises :class:`QueueFull`.
        metrics: where batch sizes, queue waits and forward times are counted.

    """

    def __init__(
        self,
        forward: Callable[[Tensor, Tensor], Tensor],
        max_batch: int,
        max_wait_s: float,
        max_queue: int,
        metrics: ServeMetrics,
    ) -> None:
        self.forward = forward
        self.max_batch, self.max_wait_s, self.max_queue = max_batch, max_wait_s, max_queue
        self.metrics = metrics
        self._rows: deque[_Row] = deque()
        self._arrived: asyncio.Event | None = None
        self._executor: ThreadPoolExecutor | None = None
        # Held by every forward: a run's executor is shut down without waiting (the event loop may not block), so the
        # forward a stopped worker left may still be running when the next run's thread starts one.
        self._forwarding = threading.Lock()
        self.failure: BaseException | None = None  # what ended the worker, when not a cancellation
        self._draining = False  # a shutdown began: no row will join the queued ones

    async def submit(self, images: Sequence[Tensor], task: int) -> list[Tensor]:
        """Queue ``images`` (preprocessed, each 3 x H x W) for ``task``; their logits, in order, once run.

        Raises:
            QueueFull: fewer than ``len(images)`` places are left in the queue.
            WorkerStopped: no worker runs (:meth:`run` not awaited, or ended by an error).

        """
        if self._arrived is None:
            if self.failure is not None:
                raise WorkerStopped(self.stopped())
            raise WorkerStopped("the batcher's worker is not running: await Batcher.run() first (an app's lifespan)")
        if len(self._rows) + len(images) > self.max_queue:
            raise QueueFull(f"the queue is full ({len(self._rows)} images waiting, max_queue={self.max_queue})")
        loop = asyncio.get_running_loop()
        now = time.perf_counter()
        request = object()
        rows = [_Row(image, task, loop.create_future(), now, request) for image in images]
        self._rows.extend(rows)
        self.metrics.queued.set(len(self._rows))
        self._arrived.set()
        try:
            return list(await asyncio.gather(*(row.future for row in rows)))
        except asyncio.CancelledError:  # the client went away, or a shutdown: the room its rows took is free again
            self._rows = deque(row for row in self._rows if row.request is not request)
            self.metrics.queued.set(len(self._rows))
            raise

    def stopped(self) -> str | None:
        """One line saying that an error ended the worker (:attr:`failure`), what to do; ``None`` while it has not."""
        if self.failure is None:
            return None
        # Its type alone: the message, for the log, may name the server's files.
        return f"the server's batcher stopped ({type(self.failure).__name__}, in its log): restart petl-serve"

    async def run(self) -> None:
        """The worker: forms batches and runs them until cancelled; it may run again after (an app's lifespan again).

        Cancelled, it cancels the futures of the rows it leaves (queued, or in the forward it stopped waiting for):
        their :meth:`submit` raises ``CancelledError``.  A forward's ``Exception`` answers its batch's requests and the
        worker goes on; anything else ends it, kept in :attr:`failure`: its requests and every one after get
        :class:`WorkerStopped` (:meth:`stopped` says so in one line) until it runs again.
        """
        # Made anew each run: the executor a run shut down took no forward, so an app served a second time (each
        # `with TestClient(app)`, as FastAPI's docs test an app) answered every image 500.
        self._rows.clear()  # a request of an earlier run still here was cancelled with it
        self.failure, self._draining = None, False
        self._arrived = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="petl-serve-forward")
        loop = asyncio.get_running_loop()
        batch: list[_Row] = []
        try:
            while True:
                batch = await self._next_batch()
                if batch:
                    await self._run_batch(loop, batch)
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # not a forward's Exception (its requests answer it): said by submit, /health
            self.failure = error
            log.error("the batcher stopped: %s", first_line(error, type(error).__name__), exc_info=error)
            raise
        finally:
            self._arrived = None  # no worker: submit refuses rather than queue rows that nothing would run
            # The rows it leaves (queued, or in the forward it stopped waiting for) end their requests, cancelled (a
            # server answers 503) where they waited for ever: a request still in flight when the lifespan ended.  An
            # error that ended it is theirs to answer (503 too), not a shutdown's.
            for row in [*batch, *self._rows]:
                if self.failure is None:
                    row.future.cancel()
                elif not row.future.done():
                    row.future.set_exception(WorkerStopped(self.stopped()))
            self._executor.shutdown(wait=False, cancel_futures=True)

    def drain(self) -> None:
        """Run the rows queued now without waiting for more (a shutdown began: none will join them).

        Their batching window held them until it ran out: with ``max_wait_ms`` above ``shutdown_timeout_s`` a request
        queued at a SIGTERM was answered 503 while the model sat idle.
        """
        self._draining = True
        if self._arrived is not None:
            self._arrived.set()

    async def _next_batch(self) -> list[_Row]:
        """The next rows to run: up to ``max_batch``, once that many wait or the oldest has waited ``max_wait_s``."""
        while not self._rows:
            self._arrived.clear()
            await self._arrived.wait()
        deadline = self._rows[0].queued + self.max_wait_s
        while len(self._rows) < self.max_batch and not self._draining:
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except asyncio.TimeoutError:
                break
        batch = [self._rows.popleft() for _ in range(min(self.max_batch, len(self._rows)))]
        self.metrics.queued.set(len(self._rows))
        return [row for row in batch if not row.future.done()]  # a request that went away (client closed)

    async def _run_batch(self, loop: asyncio.AbstractEventLoop, batch: list[_Row]) -> None:
        started = time.perf_counter()
        images = [row.image for row in batch]
        tasks = torch.tensor([row.task for row in batch], dtype=torch.long)
        try:
            logits = await loop.run_in_executor(self._executor, self._forward, images, tasks)
        except Exception as error:  # noqa: BLE001  (each waiting request answers it; the worker goes on)
            # The requests' rows still queued too: they would run for no one (the request is answered with the error),
            # failing again beside other requests' rows where the failure was the request's (the GPU's memory, say).
            failed = {row.request for row in batch}
            for row in [*batch, *self._rows]:
                if row.request in failed and not row.future.done():
                    row.future.set_exception(error)
            return
        self.metrics.inference.observe(time.perf_counter() - started)
        self.metrics.batch_rows.observe(len(batch))
        self.metrics.batch_tasks.observe(len(set(tasks.tolist())))
        for row, row_logits in zip(batch, logits, strict=True):
            self.metrics.queue_wait.observe(started - row.queued)
            if not row.future.done():
                row.future.set_result(row_logits)

    def _forward(self, images: list[Tensor], tasks: Tensor) -> Tensor:
        with self._forwarding, torch.inference_mode():
            logits = self.forward(torch.stack(images), tasks)
            # Checked here, where a failure answers the batch's requests: a forward that gave fewer rows than images
            # failed in the worker's own code after it (zip), which ended the worker, and every request since was a 500.
            if not isinstance(logits, Tensor) or logits.ndim != 2 or len(logits) != len(images):
                shape = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
                raise ValueError(f"the model's forward gave {shape} for {len(images)} images, not a row of logits each")
            return logits.float().cpu()
