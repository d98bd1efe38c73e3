"""Prometheus text exposition for ``petl-serve``: counters and histograms, written by hand (no client library).

Only what ``GET /metrics`` shows: the format is Prometheus' text format 0.0.4, which every scraper reads.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Sequence

Labels = tuple[tuple[str, str], ...]


def _labels(labels: Labels, extra: tuple[str, str] | None = None) -> str:
    pairs = [*labels, extra] if extra else list(labels)
    if not pairs:
        return ""
    escaped = (v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for _, v in pairs)
    return "{" + ",".join(f'{k}="{v}"' for (k, _), v in zip(pairs, escaped, strict=True)) + "}"


def _number(value: float) -> str:
    """A sample's value in full: a count as an integer, other values as the shortest float that reads back exactly.

    Not ``:g``, whose six significant digits wrote a counter past a million as ``1.23457e+06`` (a scraper read
    1234570 for every count from 1234565 to 1234574, and a rate of 0 between them).
    """
    value = float(value)  # a gauge is set to an int
    if not math.isfinite(value):
        return "NaN" if math.isnan(value) else "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


class Counter:
    """A monotone count per label set."""

    def __init__(self, name: str, help_text: str) -> None:
        self.name, self.help = name, help_text
        self.values: dict[Labels, float] = defaultdict(float)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        self.values[tuple(sorted(labels.items()))] += amount

    def text(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        return lines + [f"{self.name}{_labels(k)} {_number(v)}" for k, v in sorted(self.values.items())]


class Gauge(Counter):
    """A value that goes up and down (set, not incremented)."""

    def set(self, value: float) -> None:
        self.values[()] = value

    def text(self) -> list[str]:
        return [line.replace(" counter", " gauge") if line.startswith("# TYPE") else line for line in super().text()]


class Histogram:
    """Observations counted into cumulative buckets (``le``), with their sum and count, as Prometheus expects."""

    def __init__(self, name: str, help_text: str, buckets: Sequence[float]) -> None:
        self.name, self.help = name, help_text
        self.buckets = sorted(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last: above every bucket (+Inf only)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def text(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        running = 0
        for bound, count in zip([*self.buckets, float("inf")], self.counts, strict=True):
            running += count
            le = "+Inf" if bound == float("inf") else f"{bound:g}"
            lines.append(f'{self.name}_bucket{{le="{le}"}} {running}')
        return lines + [f"{self.name}_sum {_number(self.sum)}", f"{self.name}_count {self.count}"]


SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ServeMetrics:
    """Every metric ``petl-serve`` exports."""

    def __init__(self) -> None:
        self.requests = Counter("petl_requests_total", "HTTP requests answered, by route and status code.")
        self.images = Counter("petl_images_total", "Images predicted, by task.")
        # Observed once the predictions are in: a refused request (4xx, 503) or a client gone (499) is not timed.
        self.latency = Histogram(
            "petl_request_seconds", "Predict requests answered 200: receipt to answer, seconds.", SECONDS
        )
        self.queue_wait = Histogram("petl_queue_wait_seconds", "Rows: time queued before their batch ran.", SECONDS)
        self.inference = Histogram("petl_batch_seconds", "Batches: forward pass time, seconds.", SECONDS)
        sizes = (1, 2, 4, 8, 16, 32, 64, 128, 256)
        self.batch_rows = Histogram("petl_batch_rows", "Batches: images per batch formed.", sizes)
        self.batch_tasks = Histogram("petl_batch_tasks", "Batches: distinct tasks per batch formed.", sizes)
        self.queued = Gauge("petl_queue_rows", "Images waiting for a batch now.")
        self.graph_batches = Counter(
            "petl_graph_batches_total", "Batches a CUDA graph of their mix of tasks answered (on a GPU)."
        )

    def text(self) -> str:
        parts = [self.requests, self.images, self.latency, self.queue_wait, self.inference]
        parts += [self.batch_rows, self.batch_tasks, self.queued, self.graph_batches]
        return "\n".join(line for metric in parts for line in metric.text()) + "\n"
