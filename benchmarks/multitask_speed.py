"""Serving many tasks: a mixed batch through petl.MultiTask against one model per task, in images/s.

The numbers in benchmarks/results/multitask_cpu.md come from this script:

    python benchmarks/multitask_speed.py --out benchmarks/results/multitask_cpu.md

For each task set (eight LoRA tasks; eight tasks of eight different methods; eight tasks mixing DTL, DTL+,
LST, HST, GPS, NOAH, LoRA and VPT) and each batch size (one row
per task; eight rows per task), four ways of answering the same batch, all in eval mode without autograd:

* **MultiTask**: one forward of the whole mixed batch (rows in shuffled task order);
* **8 separate models**: each task's own single-task model (unmerged, as trained) on its rows, eight forwards;
* **backbone 8 times**: the plain frozen backbone on each task's rows, eight forwards -- the cost of one
  forward per task with the task modules for free (what merged LoRA-style models would approach);
* **backbone once**: the plain backbone on the whole batch -- the floor any mixed-batch server can reach.

With ``--launch-bound`` the MultiTask is timed on the GPU's path (``launch_bound=True``: every row in one pass,
every stack of two tasks acting) whatever the device; on a CPU with a tiny model (``--model vit_tiny_patch16_224
--img-size 32``, one row per task), where the arithmetic is small, it is a rough proxy of the host's cost per op.

With ``--graph`` (a GPU only) a fifth case is timed: the MultiTask's forward replaying its CUDA graph of the batch's
layout (``MultiTask.graphs``, as petl-serve and petl-predict get it), each call's rows in another order with as many of
each task (another mix of tasks each call, where they run every row: ``MultiTask.every_row``), the host launching one
graph instead of every op.  The MultiTask case stays eager (``graphs.size = 0``).

With ``--ops`` nothing is timed: each case's aten ops in one call are counted (``petl.utils.ops.CountOps``,
after a warm-up call; the MultiTask on the GPU's path, ``launch_bound=True``), the cost where the host launching
kernels is the bound (a GPU serving small updates); the counts do not depend on the image size.

With ``--profile FILE`` the script also writes where one call of the MultiTask and one of the plain backbone
once spend their device's time (``torch.profiler``): the device's busy time against the timed call, the aten calls
(nested ones included), the GPU kernels and the costliest ops.  On a GPU, busy time well under the timed call
means the host launching ops was the bound; the costliest ops name what to batch next.

The cases take turns call by call over ``--rounds`` rounds in one process (so a shared machine's drifting
load falls on all alike) and the median per case is reported; ratios are against the 8 separate models.
The backbone has random weights and the task tensors are perturbed at random: speed does not depend on them.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import timm
import torch

import petl
import petl.backbones.models  # noqa: F401  (registers vit_fractal_tiny_patch4_32 with timm)

TASKS = 8
PROFILE_TOP = 12  # ops listed per case in the --profile file
TASK_SETS = {
    "8 LoRA tasks": [("lora", {})] * TASKS,
    "8 methods": [
        ("lora", {}),
        ("adapter", {}),
        ("adapter", {"style": "parallel"}),
        ("vpt", {"num_tokens": 10}),
        ("ssf", {}),
        ("bitfit", {}),
        ("fact", {}),
        ("convpass", {}),
    ],
    # Side networks (their own network per task on its rows), GPS's sparse updates, NOAH's per-block prompts.
    "8 methods, side networks & co.": [
        ("dtl", {}),
        ("dtl", {"fusion_size": 3}),
        ("lst", {}),
        ("hst", {}),
        ("gps", {}),
        ("noah", {}),
        ("lora", {}),
        ("vpt", {"num_tokens": 10}),
    ],
}
# Short names for --sets.
SET_KEYS = {"lora": "8 LoRA tasks", "methods": "8 methods", "side": "8 methods, side networks & co."}
CASES = ("MultiTask (mixed batch)", "8 separate models", "backbone 8 times", "backbone once")
GRAPH = "MultiTask, CUDA graph"  # with --graph on a GPU: forward replaying the graph of the batch's layout


def _task_files(backbone: torch.nn.Module, methods: list, folder: Path) -> tuple[dict[str, Path], list]:
    """Each task's weights file (trained tensors perturbed) and its single-task model."""
    files, singles = {}, []
    for i, (method, options) in enumerate(methods):
        model = petl.apply(copy.deepcopy(backbone), method, num_classes=10, **options)
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(0.01 * torch.randn_like(p))
        files[f"task{i}"] = folder / f"task{i}.safetensors"
        petl.save_trainable(model, files[f"task{i}"])
        singles.append(model.eval())
    return files, singles


def build_cases(
    model_name: str,
    methods: list,
    batch: int,
    device: str = "cpu",
    dtype: str = "float32",
    img_size: int | None = None,
    launch_bound: bool | None = None,
    graph: bool = False,
) -> dict[str, Callable[[], object]]:
    """The four cases (see the module doc) for one task set and batch size, each a call answering the same batch;
    ``img_size`` overrides the model's, ``launch_bound`` the MultiTask's choice of path by device; ``graph`` (on a
    GPU) adds a fifth: the MultiTask's forward replaying its CUDA graph of the batch's layout.
    """
    torch.manual_seed(0)
    kwargs = {} if img_size is None else {"img_size": img_size}
    backbone = timm.create_model(model_name, pretrained=False, num_classes=10, **kwargs).eval()
    size = backbone.patch_embed.img_size
    with tempfile.TemporaryDirectory() as folder:
        files, singles = _task_files(backbone, methods, Path(folder))
        multi = petl.MultiTask(backbone, files)
        graphed = petl.MultiTask(backbone, files) if graph else None
    multi.launch_bound = launch_bound
    multi.graphs.size = 0  # eager: on a GPU, forward would replay a graph of the repeated batch's layout
    kw = {"device": torch.device(device), "dtype": getattr(torch, dtype)}
    multi.to(**kw)  # the backbone too: its tensors are the MultiTask's
    singles = [model.to(**kw) for model in singles]
    ids = [i % TASKS for i in range(batch)]
    random.Random(0).shuffle(ids)
    images = torch.randn(batch, 3, *size).to(**kw)
    rows = [[r for r, t in enumerate(ids) if t == task] for task in range(TASKS)]
    per_task = [images[r] for r in rows]
    calls = {
        CASES[0]: lambda: multi(images, ids),
        CASES[1]: lambda: [singles[t](per_task[t]) for t in range(TASKS)],
        CASES[2]: lambda: [backbone(per_task[t]) for t in range(TASKS)],
        CASES[3]: lambda: backbone(images),
    }
    if graph:
        # Batches with as many rows of each task, each in another order: one graph answers them all; where the tasks
        # run every row (MultiTask.every_row), batches of other mixes too.
        graphed.launch_bound = launch_bound
        graphed.to(**kw)
        if graphed.every_row:
            others = [random.Random(k).choices(range(TASKS), k=len(ids)) for k in (1, 2, 3)]
        else:
            others = [random.Random(k).sample(ids, len(ids)) for k in (1, 2, 3)]
        turns = itertools.cycle([ids, *others])
        with torch.inference_mode():
            for _ in range(graphed.graphs.after):  # captured here, not in a timed call
                graphed(images, next(turns))
        calls[GRAPH] = lambda: graphed(images, next(turns))
    return calls


def measure(calls: dict[str, Callable[[], object]], rounds: int, device: str = "cpu") -> dict[str, float]:
    """Median seconds per call of each case, the cases taking turns call by call over ``rounds`` rounds."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls)
    with torch.inference_mode():
        for name in order:  # warm-up
            calls[name]()
        for r in range(rounds):
            random.Random(r).shuffle(order)
            for name in order:
                _sync(device)
                start = time.perf_counter()
                calls[name]()
                _sync(device)
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def profile(calls: dict[str, Callable[[], object]], device: str = "cpu", top: int = PROFILE_TOP) -> dict[str, dict]:
    """Where one call of the MultiTask and of the backbone once spends its device's time (``torch.profiler``).

    For each of the two cases: ``busy``, the seconds the device spent in ops (on a GPU its kernels, on a CPU the
    ops' own time); ``ops``, the aten calls the host made (nested ones included); ``kernels``, the GPU kernels
    they launched (None on a CPU); ``top``, the ``top`` ops by their own device time as (name, calls, seconds).
    A GPU busy for much less than the case's timed call waited on the host launching its ops; one busy for most
    of it is bound by the arithmetic or memory traffic.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    summary = {}
    with torch.inference_mode():
        for name in (CASES[0], CASES[3]):
            calls[name]()  # warm (caches, the allocator, cuDNN's choice) before the profiled call
            _sync(device)
            with torch_profile(activities=activities) as prof:
                calls[name]()
                _sync(device)
            ops = [e for e in prof.key_averages() if e.key.startswith("aten::")]
            own = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
            ranked = sorted(ops, key=own, reverse=True)
            kernels = sum(len(e.kernels) for e in prof.events() if e.device_type == DeviceType.CPU)
            summary[name] = {
                "busy": sum(own(e) for e in ops) / 1e6,
                "ops": sum(e.count for e in ops),
                "kernels": kernels if cuda else None,
                "top": [(e.key, e.count, own(e) / 1e6) for e in ranked[:top] if own(e) > 0],
            }
    return summary


def partial_note(unfinished: list[str] | None) -> list[str]:
    """The lines that say a file written while the run goes on holds only the rows before ``unfinished``."""
    if not unfinished:
        return []
    return [
        "",
        "**Partial table**: written after each row while the run went on; it ended (cut off at its part's "
        f"deadline, or failed) before {'; '.join(unfinished)}.",
    ]


def render_profile(
    profiles: dict,
    timed: dict,
    model_name: str,
    command: str,
    device: str,
    dtype: str,
    unfinished: list[str] | None = None,
) -> str:
    """The profile file: for each task set and batch, the two cases' device time and their costliest ops
    (``unfinished``: as :func:`render`'s)."""
    where = "GPU kernels" if device.startswith("cuda") else "the ops' own CPU time"
    lines = [
        f"# Where a mixed batch spends its time: MultiTask and the plain backbone once, `{model_name}` "
        f"({device_words(device, dtype)})",
        "",
        f"Command: `{command}`",
        "",
        f"One call of each case profiled with `torch.profiler` after a warm-up call. Busy: the device's time in "
        f"ops ({where}), summed over every op's own time; the timed call is the table's median without the "
        "profiler. Where busy is well under the timed call, the device waited on the host launching ops.",
    ]
    for (task_set, batch), summary in profiles.items():
        lines += ["", f"## {task_set}, batch {batch}", ""]
        lines += ["| Case | Timed call ms | Device busy ms | aten calls (nested included) | GPU kernels |"]
        lines.append("|---|---:|---:|---:|---:|")
        for name, part in summary.items():
            seconds = timed.get((task_set, batch), {}).get(name)
            shown = f"{seconds * 1e3:.2f}" if seconds is not None else "-"
            kernels = "-" if part["kernels"] is None else part["kernels"]
            lines.append(f"| {name} | {shown} | {part['busy'] * 1e3:.2f} | {part['ops']} | {kernels} |")
        for name, part in summary.items():
            lines += ["", f"{name}, its costliest ops:", "", "| Op | Calls | Own ms | Share of busy |"]
            lines.append("|---|---:|---:|---:|")
            for op, count, seconds in part["top"]:
                share = seconds / part["busy"] if part["busy"] else 0.0
                lines.append(f"| `{op}` | {count} | {seconds * 1e3:.3f} | {share:.0%} |")
    return "\n".join(lines + partial_note(unfinished)) + "\n"


def count_ops(model_name: str, methods: list, batch: int, img_size: int | None = None) -> dict[str, int]:
    """Each case's aten ops in one call (after a warm-up call), on the CPU; ``img_size`` overrides the model's."""
    from petl.utils.ops import CountOps

    torch.manual_seed(0)
    kwargs = {} if img_size is None else {"img_size": img_size}
    backbone = timm.create_model(model_name, pretrained=False, num_classes=10, **kwargs).eval()
    size = backbone.patch_embed.img_size
    with tempfile.TemporaryDirectory() as folder:
        files, singles = _task_files(backbone, methods, Path(folder))
        multi = petl.MultiTask(backbone, files)
    multi.launch_bound = True
    ids = [i % TASKS for i in range(batch)]
    random.Random(0).shuffle(ids)
    images = torch.randn(batch, 3, *size)
    per_task = [images[[r for r, t in enumerate(ids) if t == task]] for task in range(TASKS)]
    calls = {
        CASES[0]: lambda: multi(images, ids),
        CASES[1]: lambda: [singles[t](per_task[t]) for t in range(TASKS)],
        CASES[2]: lambda: [backbone(per_task[t]) for t in range(TASKS)],
        CASES[3]: lambda: backbone(images),
    }
    counts = {}
    with torch.inference_mode():
        for name, call in calls.items():
            call()
            with CountOps() as count:
                call()
            counts[name] = sum(count.ops.values())
    return counts


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def device_words(device: str, dtype: str) -> str:
    """The device and arithmetic the table measured, for its title: ``CPU``, ``NVIDIA H100 80GB HBM3, bfloat16``."""
    name = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else device.upper()
    if device.startswith("cuda") and dtype == "float32":
        dtype += ", TF32 matmuls" if torch.backends.cuda.matmul.allow_tf32 else ", TF32 off"
    return name if dtype == "float32" and not device.startswith("cuda") else f"{name}, {dtype}"


def render(
    results: dict,
    model_name: str,
    rounds: int,
    command: str,
    load: tuple[float, float],
    device: str = "cpu",
    dtype: str = "float32",
    missing: list[str] | None = None,
    launch_bound: bool = False,
    unfinished: list[str] | None = None,
) -> str:
    """The results file: one table row per task set and batch size (``missing``: rows the deadline cut off;
    ``unfinished``: rows not measured yet, in a table written while the run goes on)."""
    gpu = f", GPU {torch.cuda.get_device_name(torch.device(device))}" if device.startswith("cuda") else ""
    graph = any(GRAPH in seconds for seconds in results.values())
    cases = (*CASES, GRAPH) if graph else CASES
    lines = [
        f"# Serving 8 tasks over one frozen `{model_name}`: mixed batch vs one model per task "
        f"({device_words(device, dtype)})",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} torch threads{gpu}; 1-min load average {load[0]:.1f} before and {load[1]:.1f} "
        "after (the machine may be shared with other jobs: absolute images/s are noisy, the ratios were measured "
        "in one process with the cases taking turns call by call).",
        "",
        f"Backbone `{model_name}` with random weights, 10-class heads, eval mode, no autograd, {dtype} on "
        f"{device}; median over {rounds} rounds. Ratios are images/s against the 8 separate models."
        + (" The MultiTask on the GPU's path (`launch_bound=True`) whatever the device." if launch_bound else ""),
        "",
        "| Task set | Batch (rows per task) | " + " | ".join(f"{c} img/s" for c in cases) + " | "
        "MultiTask × 8 separate | MultiTask × backbone 8 times | MultiTask × backbone once |"
        + (" CUDA graph × backbone once |" if graph else ""),
        "|---|---:|" + "---:|" * (2 * len(cases) - 1),
    ]
    for (task_set, batch), seconds in results.items():
        speed = {name: batch / s for name, s in seconds.items()}
        ratios = [speed[CASES[0]] / speed[c] for c in CASES[1:]]
        ratios += [speed[GRAPH] / speed[CASES[3]]] if graph else []
        lines.append(
            f"| {task_set} | {batch} ({batch // TASKS}) | "
            + " | ".join(f"{speed[c]:.0f}" for c in cases)
            + " | "
            + " | ".join(f"{r:.2f}×" for r in ratios)
            + " |"
        )
    if graph:
        lines += [
            "",
            f"{GRAPH}: the MultiTask's forward replaying its CUDA graph of the batch's layout (`MultiTask.graphs`, "
            "captured the second time the layout came, as petl-serve and petl-predict get it), each call's rows in "
            "another order with as many of each task, or, where the tasks run every row through every stack "
            "(`MultiTask.every_row`: the 8 LoRA tasks and the 8 methods), each call another mix of tasks; the host "
            "launches one graph instead of every op. The other cases run eagerly.",
        ]
    if missing:
        lines += ["", f"Not measured: the --deadline had passed before {'; '.join(missing)}."]
    return "\n".join(lines + partial_note(unfinished)) + "\n"


def main(argv: list[str]) -> None:
    """Measure every task set at every batch size and print (or write) the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit_fractal_tiny_patch4_32")
    parser.add_argument("--batches", default="8,64", help="comma-separated batch sizes (multiples of 8)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", help="float32 or bfloat16 (on a GPU)")
    parser.add_argument("--sets", default=",".join(SET_KEYS), help=f"task sets, of {','.join(SET_KEYS)}")
    parser.add_argument(
        "--deadline", type=float, help="seconds: start no task set and batch after this; the table says what is left"
    )
    parser.add_argument("--out", type=Path, help="write the table here (else print it)")
    parser.add_argument(
        "--profile",
        type=Path,
        help="also write here where one call of the MultiTask and of the backbone once spends its device's time "
        "(torch.profiler: busy time, ops dispatched, the costliest ops)",
    )
    parser.add_argument("--ops", action="store_true", help="count each case's aten ops in one call; time nothing")
    parser.add_argument(
        "--graph",
        action="store_true",
        help="on a GPU, also time the MultiTask's forward replaying its CUDA graph of the batch's layout "
        "(MultiTask.graphs), the rows in another order each call",
    )
    parser.add_argument("--img-size", type=int, help="the model's image size (with --ops the counts do not change)")
    parser.add_argument(
        "--launch-bound",
        action="store_true",
        help="time the MultiTask on the GPU's path (every row in one pass, every stack of two tasks acting) on any "
        "device: on a CPU with a tiny model, a proxy of the host's cost per op",
    )
    args = parser.parse_args(argv)
    unknown = set(args.sets.split(",")) - set(SET_KEYS)
    if unknown:
        parser.error(f"--sets {args.sets}: unknown {', '.join(sorted(unknown))}; choose among {', '.join(SET_KEYS)}")
    if args.graph and not args.device.startswith("cuda"):
        parser.error(f"--graph makes a CUDA graph: it needs --device cuda, not {args.device}")
    torch.set_num_threads(args.threads)
    if args.ops:
        for task_set in (SET_KEYS[key] for key in args.sets.split(",")):
            for batch in (int(b) for b in args.batches.split(",")):
                counts = count_ops(args.model, TASK_SETS[task_set], batch, args.img_size)
                print(
                    f"{task_set}, batch {batch}, aten ops per call:", ", ".join(f"{k} {v}" for k, v in counts.items())
                )
        return
    started, before = time.monotonic(), os.getloadavg()[0]
    results, missing, profiles = {}, [], {}
    command = ("python benchmarks/multitask_speed.py " + " ".join(argv)).strip()
    plan = [(SET_KEYS[key], int(b)) for key in args.sets.split(",") for b in args.batches.split(",")]

    def write(unfinished: list[str] | None = None) -> str:
        """The table (and profile) of the rows measured so far, into their files: a run cut off leaves those."""
        load = (before, os.getloadavg()[0])
        table = render(
            results, args.model, args.rounds, command, load, args.device, args.dtype, missing, args.launch_bound,
            unfinished,
        )  # fmt: skip
        if args.out:
            args.out.write_text(table)
        if args.profile:
            profile_text = render_profile(profiles, results, args.model, command, args.device, args.dtype, unfinished)
            args.profile.write_text(profile_text)
        return table

    for step, (task_set, batch) in enumerate(plan):
        if args.deadline is not None and time.monotonic() - started > args.deadline:
            missing.append(f"{task_set} at batch {batch}")
            continue
        methods = TASK_SETS[task_set]
        launch_bound = True if args.launch_bound else None
        calls = build_cases(
            args.model, methods, batch, args.device, args.dtype, args.img_size, launch_bound, args.graph
        )
        results[(task_set, batch)] = measure(calls, args.rounds, args.device)
        if args.profile:
            profiles[(task_set, batch)] = profile(calls, args.device)
        print(task_set, batch, {k: f"{batch / v:.0f} img/s" for k, v in results[(task_set, batch)].items()})
        if step + 1 < len(plan):  # the rows so far, said to be partial until the last is written
            write([f"{later} at batch {size}" for later, size in plan[step + 1 :]])
    print(write())
    if args.profile:
        print(f"profile: {args.profile}")


if __name__ == "__main__":
    main(sys.argv[1:])
