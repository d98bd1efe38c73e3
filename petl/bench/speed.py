"""``petl-bench speed``: what each method costs per training step, in memory, and at inference.

For every experiment and two references, on one backbone and batch:

* **train step**: forward + cross-entropy + backward + AdamW step, median of ``steps`` timed steps after
  ``warmup`` untimed ones (the first steps allocate optimizer state and warm caches).  All cases live in
  one process and take turns over ``rounds`` rounds, so a shared machine's drifting load falls on all alike;
* **peak memory**, in a fresh subprocess per case: on CUDA, ``torch.cuda.max_memory_allocated`` (absolute:
  weights, gradients, optimizer state, activations); on CPU, the growth of the resident set's high-water
  mark (Linux VmHWM, reset after set-up) over the RSS after set-up, so it counts gradients, AdamW state
  and activations but not the frozen weights.  tracemalloc cannot see torch's allocator, hence RSS;
* **inference**: eval-mode forward latency at ``infer_batch``, median of ``infer_steps``, also in turns.

References: the frozen backbone's forward pass (the floor no training step can beat), full fine-tuning,
and peft's LoRA on the whole fused qkv (``peft.inject_adapter_in_model(LoraConfig(r=8,
target_modules=["qkv"]), model)``).  Mergeable methods are also timed after ``petl.merge``, against the
plain backbone's inference.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from petl.bench.rss import current_rss_mb, peak_rss_mb, reset_peak_rss

FLOOR = "frozen forward (floor)"
PEFT_LORA = "peft LoRA r=8 on fused qkv"


@dataclass(frozen=True)
class SpeedSpec:
    """The shared settings of a speed measurement.

    Attributes:
        model: timm model name (built with random weights: speed does not depend on their values).
        batch: training batch size.
        steps: timed training steps per case, spread over ``rounds``.
        warmup: untimed steps per case before the first round.
        rounds: how many times the cases take turns at training steps; the median runs over all of them.
        infer_batch: inference batch size.
        infer_steps: timed inference forwards per case, the cases taking turns call by call.
        device: ``cpu`` or ``cuda``.
        num_classes: classifier size.

    """

    model: str = "vit_fractal_tiny_patch4_32"
    batch: int = 32
    steps: int = 10
    warmup: int = 3
    rounds: int = 5
    infer_batch: int = 1
    infer_steps: int = 100
    device: str = "cpu"
    num_classes: int = 10


# The command's own keys besides SpeedSpec's fields.
SPEED_KEYS = {f.name for f in fields(SpeedSpec)} | {"methods", "out", "inprocess", "benchmarks_dir"}


def _build(case: str, method: dict[str, Any], spec: SpeedSpec):
    """The model of one case: plain frozen backbone, petl method, or peft LoRA."""
    import timm
    import torch

    import petl

    model = timm.create_model(spec.model, pretrained=False, num_classes=spec.num_classes)
    if case == FLOOR:
        model.requires_grad_(False)
    elif case == PEFT_LORA:
        from peft import LoraConfig, inject_adapter_in_model

        # peft marks only its own adapters trainable; the head trains too, as it does for every petl method.
        model = inject_adapter_in_model(LoraConfig(r=8, target_modules=["qkv"]), model)
        model.get_classifier().requires_grad_(True)
    else:
        options = {k: v for k, v in method.items() if k != "name"}
        petl.apply(model, method["name"], num_classes=spec.num_classes, **options)
    return model.to(torch.device(spec.device))


class _Bench:
    """One live case: its model, a fixed batch, its optimizer, and timed step / inference calls."""

    def __init__(self, case: str, method: dict[str, Any], spec: SpeedSpec) -> None:
        import torch

        torch.manual_seed(0)
        self.spec = spec
        self.model = _build(case, method, spec)
        h, w = self.model.patch_embed.img_size
        device = torch.device(spec.device)
        self.images = torch.randn(spec.batch, 3, h, w, device=device)
        self.labels = torch.randint(0, spec.num_classes, (spec.batch,), device=device)
        self.infer_images = torch.randn(spec.infer_batch, 3, h, w, device=device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # The floor trains nothing: its "step" is a no-grad forward at the training batch.
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-3) if self.params else None
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.merged = None

    def _now(self) -> float:
        import torch

        # CUDA runs asynchronously: without a sync the clock would stop before the kernels do.
        if self.spec.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def train_step(self) -> float:
        """Seconds for one training step (or one no-grad forward for the floor)."""
        import torch

        start = self._now()
        if self.optimizer is None:
            self.model.eval()
            with torch.no_grad():
                self.model(self.images)
        else:
            self.model.train()
            self.loss_fn(self.model(self.images), self.labels).backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return self._now() - start

    def infer(self, model=None) -> float:
        """Seconds for one eval-mode forward at the inference batch."""
        import torch

        model = self.model if model is None else model
        model.eval()
        start = self._now()
        with torch.no_grad():
            model(self.infer_images)
        return self._now() - start


def measure_memory(case: str, method: dict[str, Any], spec: SpeedSpec) -> dict[str, Any]:
    """Trainable count and peak memory of a few training steps (call it in a fresh process on CPU).

    The peak covers ``warmup`` + 2 steps: the first step allocates the gradients and AdamW's state,
    later ones only repeat it.
    """
    import torch

    bench = _Bench(case, method, spec)
    if spec.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    # From here the high-water mark belongs to the steps alone (Linux); the weights are already resident.
    reset_peak_rss()
    before = current_rss_mb()
    for _ in range(spec.warmup + 2):
        bench.train_step()
    peak = torch.cuda.max_memory_allocated() / 2**20 if spec.device == "cuda" else max(0.0, peak_rss_mb() - before)
    return {"trainable": sum(p.numel() for p in bench.params), "peak_mb": peak}


def measure_memory_in_subprocess(case: str, method: dict[str, Any], spec: SpeedSpec) -> dict[str, Any]:
    """Run :func:`measure_memory` in a fresh Python process (same interpreter and environment)."""
    payload = json.dumps({"case": case, "method": method, "spec": asdict(spec)})
    proc = subprocess.run(
        [sys.executable, "-m", "petl.bench.speed", "--worker", payload], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"speed worker for {case!r} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure_times(
    cases: Sequence[tuple[str, dict[str, Any]]], spec: SpeedSpec, log: Callable[[str], None] = print
) -> dict[str, dict[str, float]]:
    """Median training-step and inference times of every case, the cases taking turns.

    On a shared machine the background load drifts; measuring the cases in turns, ``rounds`` times,
    spreads that drift over all of them instead of penalising whichever ran during a busy minute.
    Mergeable methods also get a merged copy (``petl.merge``) timed at inference.

    Returns:
        By case: ``train_ms``, ``infer_ms`` and, for mergeable methods, ``infer_merged_ms``.

    """
    import petl

    benches = {}
    for case, method in cases:
        log(f"speed: building {case}")
        bench = benches[case] = _Bench(case, method, spec)
        for _ in range(spec.warmup):
            bench.train_step()
            bench.infer()
        if method and petl.get_method(method["name"]).mergeable:
            # Merged after the warm-up steps, so the folded update is not zero.
            bench.merged = petl.merge(copy.deepcopy(bench.model))
            for _ in range(spec.warmup):
                bench.infer(bench.merged)
    laps: dict[tuple[str, str], list[float]] = {}
    for r in range(spec.rounds):
        log(f"speed: training round {r + 1}/{spec.rounds}")
        for case, bench in benches.items():
            laps.setdefault((case, "train_ms"), []).extend(
                bench.train_step() for _ in range(_share(spec.steps, spec.rounds, r))
            )
    # A forward at the inference batch takes milliseconds, so the cases can take turns call by call: the
    # finest interleaving, which matters most for merged-vs-plain, a comparison of near-equal times.
    log("speed: inference")
    for _ in range(spec.infer_steps):
        for case, bench in benches.items():
            laps.setdefault((case, "infer_ms"), []).append(bench.infer())
            if bench.merged is not None:
                laps.setdefault((case, "infer_merged_ms"), []).append(bench.infer(bench.merged))
    out: dict[str, dict[str, float]] = {case: {} for case in benches}
    for (case, key), seconds in laps.items():
        out[case][key] = 1000 * statistics.median(seconds)
    return out


def _share(total: int, rounds: int, r: int) -> int:
    # Spread `total` over `rounds` as evenly as integers allow, at least one per round.
    return max(1, total // rounds + (1 if r < total % rounds else 0))


def machine_line(device: str) -> str:
    """Where the numbers come from: CPU model (lscpu), cores, threads, torch version, GPU if used, load."""
    import torch

    cpu = platform.processor() or "unknown CPU"
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        cpu = next(line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        pass
    threads = torch.get_num_threads()
    parts = [f"CPU {cpu}", f"{os.cpu_count()} cores", f"torch {torch.__version__}", f"{threads} torch threads"]
    if device == "cuda":
        parts.append(f"GPU {torch.cuda.get_device_name()}")
    if hasattr(os, "getloadavg"):
        # Called after the measurements: the 15-minute load average says how much else shared the cores.
        parts.append(f"15-min load average {os.getloadavg()[2]:.1f} at the end")
    return ", ".join(parts)


def _ratio(value: float | None, ref: float | None) -> str:
    if value is None or ref is None or ref <= 0:
        return "–"
    return f"{value / ref:.2f}×"


def format_table(results: dict[str, dict[str, Any]], spec: SpeedSpec, machine: str) -> str:
    """The speed table as Markdown, with ratios to the floor, full fine-tuning and peft's LoRA."""
    floor = results.get(FLOOR, {})
    full = results.get("full", {})
    peft_lora = results.get(PEFT_LORA, {})
    memory = (
        "CUDA max_memory_allocated (absolute: weights, grads, AdamW state, activations), fresh process per row"
        if spec.device == "cuda"
        else "peak RSS growth over the RSS after set-up (Linux VmHWM, reset through /proc/self/clear_refs), "
        "fresh process per row, i.e. grads + AdamW state + activations, not the weights"
    )
    lines = [
        f"Backbone `{spec.model}` (random weights), training batch {spec.batch}, {spec.num_classes} classes, "
        f"device {spec.device}. Train step = forward + loss + backward + AdamW step, median of {spec.steps} steps "
        f"after {spec.warmup} warm-up steps, all cases taking turns over {spec.rounds} rounds (so background load "
        "falls on all of them alike); the floor row times a no-grad forward at the same batch. "
        f"Inference: eval forward at batch {spec.infer_batch}, median of {spec.infer_steps}, cases in turns call "
        "by call. "
        f"Peak MB over {spec.warmup + 2} training steps: {memory}.",
        "",
        f"Machine: {machine}.",
        "",
        "| Case | Trainable | Train step ms | × floor | × full FT | × peft LoRA | Peak MB | mem × full FT "
        "| mem × peft LoRA | Infer ms | infer × plain |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    plain_infer = floor.get("infer_ms")
    for case, r in results.items():
        lines.append(
            f"| {case} | {r['trainable']:,} | {r['train_ms']:.1f} | {_ratio(r['train_ms'], floor.get('train_ms'))} "
            f"| {_ratio(r['train_ms'], full.get('train_ms'))} | {_ratio(r['train_ms'], peft_lora.get('train_ms'))} "
            f"| {r['peak_mb']:.1f} | {_ratio(r['peak_mb'], full.get('peak_mb'))} "
            f"| {_ratio(r['peak_mb'], peft_lora.get('peak_mb'))} "
            f"| {r['infer_ms']:.2f} | {_ratio(r['infer_ms'], plain_infer)} |"
        )
    merged = [(case, r) for case, r in results.items() if "infer_merged_ms" in r]
    if merged:
        lines += [
            "",
            "Merged inference (`petl.merge` folds the update into the frozen weights):",
            "",
            "| Case | Infer ms unmerged | Infer ms merged | Plain backbone ms | merged × plain |",
            "|---|---:|---:|---:|---:|",
        ]
        for case, r in merged:
            lines.append(
                f"| {case} | {r['infer_ms']:.2f} | {r['infer_merged_ms']:.2f} | "
                f"{plain_infer if plain_infer is None else f'{plain_infer:.2f}'} | "
                f"{_ratio(r['infer_merged_ms'], plain_infer)} |"
            )
    return "\n".join(lines) + "\n"


def run_speed(
    spec: SpeedSpec,
    experiments: Sequence[tuple[str, dict[str, Any]]],
    inprocess: bool = False,
    log: Callable[[str], None] = print,
) -> dict[str, dict[str, Any]]:
    """Measure the floor, each experiment and peft's LoRA; returns results by case, in table order.

    Args:
        spec: the shared settings.
        experiments: (name, method mapping) pairs.
        inprocess: measure memory in this process too (fast, for tests; CPU peaks are then not clean).
        log: progress messages.

    """
    cases = [(FLOOR, {}), *experiments, (PEFT_LORA, {})]
    results: dict[str, dict[str, Any]] = {}
    for case, method in cases:
        log(f"speed: memory of {case}")
        results[case] = (measure_memory if inprocess else measure_memory_in_subprocess)(case, dict(method), spec)
    for case, times in measure_times(cases, spec, log).items():
        results[case].update(times)
    return results


def main(args: Sequence[str]) -> int:
    """``petl-bench speed key=value ...``: measure, print the table, optionally write it to ``out=``."""
    from petl.bench.args import as_bool, parse_args, split_list
    from petl.bench.suite import find_benchmarks_dir, list_experiments, load_experiment

    own, rest = parse_args(args, SPEED_KEYS)
    if rest:
        raise SystemExit(f"petl-bench speed: unknown argument(s) {rest}; known: {', '.join(sorted(SPEED_KEYS))}")
    import torch

    settings = {f.name: type(f.default)(own[f.name]) for f in fields(SpeedSpec) if f.name in own}
    settings.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")
    spec = SpeedSpec(**settings)
    bench_dir = find_benchmarks_dir(own.get("benchmarks_dir"))
    names = split_list(own["methods"]) if "methods" in own else list_experiments(bench_dir)
    experiments = [(n, load_experiment(n, bench_dir).method) for n in names]
    results = run_speed(spec, experiments, inprocess=as_bool("inprocess", own.get("inprocess", "false")))
    table = format_table(results, spec, machine_line(spec.device))
    print(table)
    if "out" in own:
        out = Path(own["out"])
        out.parent.mkdir(parents=True, exist_ok=True)
        command = "petl-bench speed " + " ".join(args)
        out.write_text(f"# petl speed: {spec.model} on {spec.device}\n\nCommand: `{command}`\n\n{table}")
    return 0


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    # Worker mode: one memory measurement, its JSON on the last line of stdout.
    job = json.loads(sys.argv[2])
    print(json.dumps(measure_memory(job["case"], job["method"], SpeedSpec(**job["spec"]))))
