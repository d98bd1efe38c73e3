"""``petl-bench speed``: what each method costs per training step, in memory, and at inference.

For every experiment (and two references) on one backbone and batch, in a fresh subprocess each:

* **train step**: forward + cross-entropy + backward + AdamW step, median of ``steps`` timed steps after
  ``warmup`` untimed ones (the first steps allocate optimizer state and warm caches);
* **peak memory**: on CUDA, ``torch.cuda.max_memory_allocated`` over the timed steps (absolute: weights,
  gradients, optimizer state, activations); on CPU, the growth of the process's peak resident set
  (``resource.getrusage(...).ru_maxrss``) from the end of set-up (model, batch and optimizer built) to the
  end of the steps, so it counts gradients, AdamW state and activations but not the frozen weights.
  tracemalloc cannot see torch's allocator, hence the fresh process per method;
* **inference**: eval-mode forward latency at ``infer_batch``, median of ``infer_steps``.

References: the frozen backbone's forward pass (the floor no training step can beat), full fine-tuning,
and peft's LoRA on the whole fused qkv (``peft.inject_adapter_in_model(LoraConfig(r=8,
target_modules=["qkv"]), model)``).  Mergeable methods are also timed after ``petl.merge``, against the
plain backbone's inference.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

FLOOR = "frozen forward (floor)"
PEFT_LORA = "peft LoRA r=8 on fused qkv"

SPEED_KEYS = {
    "model",
    "batch",
    "steps",
    "warmup",
    "infer_batch",
    "infer_steps",
    "device",
    "methods",
    "num_classes",
    "out",
    "inprocess",
    "benchmarks_dir",
}


@dataclass(frozen=True)
class SpeedSpec:
    """One measurement: which case, on what, how many steps.

    Attributes:
        case: a row label: an experiment name, :data:`FLOOR` or :data:`PEFT_LORA`.
        method: the experiment's ``method`` mapping (``{"name": "lora", "rank": 8}``); empty for references.
        model: timm model name (built with random weights: speed does not depend on their values).
        batch: training batch size.
        steps: timed training steps.
        warmup: untimed steps before them.
        infer_batch: inference batch size.
        infer_steps: timed inference forwards.
        device: ``cpu`` or ``cuda``.
        num_classes: classifier size.

    """

    case: str
    method: dict[str, Any]
    model: str = "vit_fractal_tiny_patch4_32"
    batch: int = 32
    steps: int = 10
    warmup: int = 3
    infer_batch: int = 1
    infer_steps: int = 30
    device: str = "cpu"
    num_classes: int = 10


def _peak_rss_mb() -> float:
    # ru_maxrss is in kilobytes on Linux (bytes on macOS).
    scale = 1 / 1024 if sys.platform != "darwin" else 1 / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _build(spec: SpeedSpec):
    """The model for ``spec``: plain frozen backbone, petl method, or peft LoRA; returns (model, image size)."""
    import timm
    import torch

    import petl

    model = timm.create_model(spec.model, pretrained=False, num_classes=spec.num_classes)
    size = model.patch_embed.img_size
    if spec.case == FLOOR:
        model.requires_grad_(False)
    elif spec.case == PEFT_LORA:
        from peft import LoraConfig, inject_adapter_in_model

        # peft marks only its own adapters trainable; the head trains too, as it does for every petl method.
        model = inject_adapter_in_model(LoraConfig(r=8, target_modules=["qkv"]), model)
        model.get_classifier().requires_grad_(True)
    else:
        options = {k: v for k, v in spec.method.items() if k != "name"}
        petl.apply(model, spec.method["name"], num_classes=spec.num_classes, **options)
    return model.to(torch.device(spec.device)), tuple(size)


def _timer(device: str) -> Callable[[], float]:
    import torch

    def now() -> float:
        # CUDA runs asynchronously: without a sync the clock would stop before the kernels do.
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    return now


def measure(spec: SpeedSpec) -> dict[str, Any]:
    """Time and size one case in this process (call it in a fresh process for a clean CPU peak).

    Returns:
        ``trainable``, ``train_ms`` (for the floor: the no-grad forward at the training batch),
        ``peak_mb``, ``infer_ms`` and, for mergeable methods, ``infer_merged_ms``.

    """
    import torch

    import petl

    torch.manual_seed(0)
    model, (h, w) = _build(spec)
    device = torch.device(spec.device)
    images = torch.randn(spec.batch, 3, h, w, device=device)
    labels = torch.randint(0, spec.num_classes, (spec.batch,), device=device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3) if params else None
    loss_fn = torch.nn.CrossEntropyLoss()
    now = _timer(spec.device)

    if spec.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    rss_before = _peak_rss_mb()
    times = []
    for i in range(spec.warmup + spec.steps):
        start = now()
        if optimizer is None:
            model.eval()
            with torch.no_grad():
                model(images)
        else:
            model.train()
            loss = loss_fn(model(images), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if i >= spec.warmup:
            times.append(now() - start)
    if spec.device == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = max(0.0, _peak_rss_mb() - rss_before)

    def infer_ms() -> float:
        model.eval()
        x = images[: spec.infer_batch] if spec.infer_batch <= spec.batch else torch.randn(spec.infer_batch, 3, h, w)
        x = x.to(device)
        laps = []
        with torch.no_grad():
            for i in range(spec.warmup + spec.infer_steps):
                start = now()
                model(x)
                if i >= spec.warmup:
                    laps.append(now() - start)
        return 1000 * statistics.median(laps)

    result = {
        "trainable": sum(p.numel() for p in params),
        "train_ms": 1000 * statistics.median(times),
        "peak_mb": peak,
        "infer_ms": infer_ms(),
    }
    if spec.method and petl.get_method(spec.method["name"]).mergeable:
        petl.merge(model)
        result["infer_merged_ms"] = infer_ms()
    return result


def measure_in_subprocess(spec: SpeedSpec) -> dict[str, Any]:
    """Run :func:`measure` in a fresh Python process (same interpreter and environment)."""
    proc = subprocess.run(
        [sys.executable, "-m", "petl.bench.speed", "--worker", json.dumps(asdict(spec))],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"speed worker for {spec.case!r} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def machine_line(device: str) -> str:
    """Where the numbers come from: CPU model (lscpu), cores, threads, torch version, GPU if used."""
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
        "CUDA max_memory_allocated during the steps (absolute)"
        if spec.device == "cuda"
        else "growth of peak RSS (ru_maxrss) over set-up, fresh process per row: grads + AdamW state + activations"
    )
    lines = [
        f"Backbone `{spec.model}` (random weights), training batch {spec.batch}, {spec.num_classes} classes, "
        f"device {spec.device}. Train step = forward + loss + backward + AdamW step, median of {spec.steps} "
        f"after {spec.warmup} warm-up steps; the floor row times a no-grad forward at the same batch. "
        f"Inference: eval forward at batch {spec.infer_batch}, median of {spec.infer_steps}. "
        f"Peak MB: {memory}.",
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
    base: SpeedSpec,
    experiments: Sequence[tuple[str, dict[str, Any]]],
    inprocess: bool = False,
    log: Callable[[str], None] = print,
) -> dict[str, dict[str, Any]]:
    """Measure the floor, each experiment and peft's LoRA; returns results by case, in table order.

    Args:
        base: the shared settings (its ``case`` and ``method`` are replaced per row).
        experiments: (name, method mapping) pairs.
        inprocess: measure in this process (fast, for tests; the CPU peak is then not per-method clean).
        log: progress messages.

    """
    cases = [(FLOOR, {}), *experiments, (PEFT_LORA, {})]
    results = {}
    for case, method in cases:
        spec = SpeedSpec(**{**asdict(base), "case": case, "method": dict(method)})
        log(f"speed: {case} ...")
        results[case] = measure(spec) if inprocess else measure_in_subprocess(spec)
    return results


def main(args: Sequence[str]) -> int:
    """``petl-bench speed key=value ...``: measure, print the table, optionally write it to ``out=``."""
    from petl.bench.cli import _as_bool, _split_list, parse_args
    from petl.bench.suite import find_benchmarks_dir, list_experiments, load_experiment

    own, rest = parse_args(args, SPEED_KEYS)
    if rest:
        raise SystemExit(f"petl-bench speed: unknown argument(s) {rest}; known: {', '.join(sorted(SPEED_KEYS))}")
    import torch

    device = own.get("device", "cuda" if torch.cuda.is_available() else "cpu")
    base = SpeedSpec(
        case="",
        method={},
        model=own.get("model", SpeedSpec.model),
        batch=int(own.get("batch", SpeedSpec.batch)),
        steps=int(own.get("steps", SpeedSpec.steps)),
        warmup=int(own.get("warmup", SpeedSpec.warmup)),
        infer_batch=int(own.get("infer_batch", SpeedSpec.infer_batch)),
        infer_steps=int(own.get("infer_steps", SpeedSpec.infer_steps)),
        device=device,
        num_classes=int(own.get("num_classes", SpeedSpec.num_classes)),
    )
    bench_dir = find_benchmarks_dir(own.get("benchmarks_dir"))
    names = _split_list(own["methods"]) if "methods" in own else list_experiments(bench_dir)
    experiments = [(n, load_experiment(n, bench_dir).method) for n in names]
    results = run_speed(base, experiments, inprocess=_as_bool("inprocess", own.get("inprocess", "false")))
    table = format_table(results, base, machine_line(device))
    print(table)
    if "out" in own:
        out = Path(own["out"])
        out.parent.mkdir(parents=True, exist_ok=True)
        command = "petl-bench speed " + " ".join(args)
        out.write_text(f"# petl speed: {base.model} on {device}\n\nCommand: `{command}`\n\n{table}")
    return 0


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    # Worker mode: one measurement, its JSON on the last line of stdout.
    print(json.dumps(measure(SpeedSpec(**json.loads(sys.argv[2])))))
