"""The speed table: ratios of every row to its floor and to the references, rendered through :mod:`petl.bench.table`."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
from typing import Any

import torch

from petl.bench.speed_bench import FORWARD, NOTE_ABOVE, OPTIONS, PEFT_LORA, SpeedSpec, image_side
from petl.bench.table import Header, Table, markdown_lines


def machine_line(device: str) -> str:
    """Where the numbers come from: CPU model (lscpu), cores, threads, torch version, GPU if used, load."""
    cpu = platform.processor() or "unknown CPU"
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        cpu = next(line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        pass
    threads = torch.get_num_threads()
    parts = [f"CPU {cpu}", _cpus(), f"torch {torch.__version__}", f"{threads} torch threads"]
    if device == "cuda":
        parts.append(f"GPU {torch.cuda.get_device_name()}")
    if hasattr(os, "getloadavg"):
        # Called after the measurements: the 15-minute load average says how much else shared the cores.
        parts.append(f"15-min load average {os.getloadavg()[2]:.1f} at the end")
    return ", ".join(parts)


def _cpus() -> str:
    """The logical CPUs this process may run on, of the machine's: "16 cores" named the machine's logical CPUs
    (os.cpu_count, threads not cores) where a container or taskset gave the process 2 of them.
    """
    machine = os.cpu_count()
    ours = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else machine
    return f"{ours} logical CPUs" if ours == machine else f"{ours} of the machine's {machine} logical CPUs"


def _precision_note(spec: SpeedSpec) -> str:
    if spec.device != "cuda":
        return "`fp32` rows in fp32; `bf16 autocast` rows under torch.autocast(bfloat16)."
    fp32 = (
        "`TF32` rows keep fp32 tensors and run CUDA matmuls and convolutions on TF32 tensor cores (tf32=true: what a "
        "petl-run training does with its default precision)"
        if spec.tf32
        else "`fp32` rows are strict fp32, TF32 off (tf32=false: petl-run's train.precision=no)"
    )
    return (
        f"{fp32}; `bf16 autocast` rows under torch.autocast(bfloat16), with TF32 {'on' if spec.tf32 else 'off'} for "
        "what autocast leaves in fp32 (petl-run's default on a GPU with native bf16). Their `× full FT` and "
        "`× peft LoRA` compare with the reference's own bf16 row where there is one; `× floor` with the fp32 floor."
    )


def _reference(results: dict[str, dict[str, Any]], name: str, row: dict[str, Any]) -> dict[str, Any]:
    """Reference ``name``'s row in ``row``'s precision where the table has one (a bf16 row's bf16 peft LoRA)."""
    same = results.get(f"{name} {OPTIONS['bf16']}") if row.get("precision") == "bf16 autocast" else None
    return same or results.get(name, {})


def _ratio(value: float | None, ref: float | None) -> str:
    if value is None or ref is None or ref <= 0:
        return "–"
    return f"{value / ref:.2f}×"


MAIN_COLUMNS = (
    "Case", "Precision", "Trainable", "Train step ms", "× floor", "× no-grad fwd", "× full FT", "× peft LoRA",
    "Peak MB", "mem × floor", "mem × full FT", "mem × peft LoRA", "Infer ms", "infer × plain",
)  # fmt: skip
MERGED_COLUMNS = ("Case", "Infer ms unmerged", "Infer ms merged", "Plain backbone ms", "merged × plain")


def _markdown(labels: tuple[str, ...], rows: list[list[str]]) -> list[str]:
    # The case names are left-aligned, the numbers right-aligned.
    headers = [Header(label, label, "info" if i == 0 else "measured") for i, label in enumerate(labels)]
    return markdown_lines(Table(headers, [[(text, text) for text in row] for row in rows]))


def format_table(
    results: dict[str, dict[str, Any]], spec: SpeedSpec, machine: str, memory_in_process: bool = False
) -> str:
    """The speed table as Markdown: ratios to each row's floor, the no-grad forward, full FT and peft's LoRA.

    Rows with only ``refused`` (the backbone refuses the method) are listed under the table with their reason.
    """
    refused = {case: r["refused"] for case, r in results.items() if "refused" in r}
    results = {case: r for case, r in results.items() if case not in refused}
    forward = results.get(FORWARD, {})
    # On a CPU the peak is an RSS high-water mark, which an earlier row in the same process sets for the later ones.
    memory_shown = spec.device == "cuda" or not memory_in_process
    memory = (
        "CUDA max_memory_allocated (weights, grads, AdamW state, activations), reset per row in one process, "
        "less what was still allocated before the row's model was built"
        if spec.device == "cuda"
        else "peak RSS growth over the RSS after set-up (Linux VmHWM, reset through /proc/self/clear_refs), "
        "fresh process per row, i.e. grads + AdamW state + activations, not the weights"
    )
    memory_line = (
        f"Peak MB over {spec.warmup + 2} training steps: {memory}. "
        if memory_shown
        else "Peak MB: not shown (inprocess=true: on a CPU every row's peak would be read in one process, whose RSS "
        "high-water mark an earlier row sets for the later ones; without inprocess each row runs in a fresh process). "
    )
    # The size the cases ran at, given or the model's default: a time per image means nothing without it.
    size = f" at {image_side(spec)} px"
    if spec.model_kwargs:
        size += " built with " + ", ".join(f"{k}={v}" for k, v in spec.model_kwargs.items())
    lines = [
        f"Backbone `{spec.model}`{size} (random weights), training batch {spec.batch}, {spec.num_classes} classes, "
        f"device {spec.device}. Train step = forward + loss + backward + AdamW step, median of {spec.steps} steps "
        f"after {spec.warmup} warm-up steps, all cases taking turns over {spec.rounds} rounds (so background load "
        "falls on all of them alike); the no-grad row times a forward without autograd at the same batch. "
        "A floor row is the frozen backbone's forward + loss + a backward that reaches the earliest trainable "
        "tensor of the methods that point to it (with their extra tokens), no optimizer; a side-tuning method's "
        "floor is its own model with the frozen blocks run without autograd (the side network's forward, backward "
        "and AdamW step on top of a no-grad backbone forward); `× floor` compares "
        "each row with its own floor. "
        + (
            "A floor marked `(m's model, frozen)` runs method m's own model with every parameter frozen (its "
            "prompts constants), the backward reaching the named input as in every floor: the cost of prompts a "
            "Swin carries beside its grid and copies into every window, which zero tokens appended to the grid "
            "would not have. "
            if any("frozen_model_of" in r for r in results.values())
            else ""
        )
        + f"Inference: eval forward at batch {spec.infer_batch}, median of {spec.infer_steps}, cases in turns call "
        "by call, each row's model eager and without autocast: a row's options (`+ bf16 autocast`, `+ torch.compile`, "
        "`+ grad checkpointing`) act on its training step only. " + memory_line + f"Precision: {_precision_note(spec)}",
        "",
        f"Machine: {machine}.",
        "",
    ]
    plain = plain_inference(results)
    plain_infer = plain[0] if plain else forward.get("infer_ms")
    rows = []
    for case, r in results.items():
        own = results.get(r.get("floor", case), {}) if "floor" in r or case.startswith("floor:") else {}
        full, peft_lora = (_reference(results, name, r) for name in ("full", PEFT_LORA))
        rows.append(
            [
                case,
                r.get("precision", "–"),
                f"{r['trainable']:,}",
                f"{r['train_ms']:.1f}",
                *(_ratio(r["train_ms"], ref.get("train_ms")) for ref in (own, forward, full, peft_lora)),
                f"{r['peak_mb']:.1f}" if memory_shown else "–",
                *(_ratio(r["peak_mb"], ref.get("peak_mb") if memory_shown else None) for ref in (own, full, peft_lora)),
                f"{r['infer_ms']:.2f}",
                _ratio(r["infer_ms"], plain_infer),
            ]
        )
    lines += _markdown(MAIN_COLUMNS, rows)
    floors = [(case, r["floor"]) for case, r in results.items() if "floor" in r]
    if floors:
        lines += ["", "Each method's floor: " + "; ".join(f"{case} → {floor}" for case, floor in floors) + "."]
    if "target" in results.get(PEFT_LORA, {}):
        linear, rows = results[PEFT_LORA]["target"]
        lines += ["", f"{PEFT_LORA}: peft adapts all output rows of every block's `{linear}` ({', '.join(rows)})."]
    notes = [(case, r["note"]) for case, r in results.items() if "note" in r]
    if notes:
        lines += ["", f"Above {NOTE_ABOVE}× its floor, where the rest goes:", ""]
        lines += [
            f"- **{case}** ({results[case]['train_ms'] / results[results[case]['floor']]['train_ms']:.2f}×): {note}"
            for case, note in notes
        ]
    if refused:
        lines += ["", "Left out, refused on this backbone:", ""]
        lines += [f"- **{case}**: {why}" for case, why in refused.items()]
    merged = [(case, r) for case, r in results.items() if "infer_merged_ms" in r]
    if merged:
        lines += [
            "",
            "Merged inference (`petl.merge` folds the update into the frozen weights; the merged model is a plain "
            "network again):",
            "",
        ]
        lines += _markdown(
            MERGED_COLUMNS,
            [
                [
                    case,
                    f"{r['infer_ms']:.2f}",
                    f"{r['infer_merged_ms']:.2f}",
                    f"{plain_infer}" if plain_infer is None else f"{plain_infer:.2f}",
                    _ratio(r["infer_merged_ms"], plain_infer),
                ]
                for case, r in merged
            ],
        )
        if plain:
            median, low, high, count = plain
            lines += [
                "",
                f"Plain backbone: the median of {count} identical plain networks timed in the same turns (the "
                f"no-grad row and the floors without extra tokens), {low:.2f}–{high:.2f} ms, i.e. "
                f"{low / median:.3f}–{high / median:.3f}× their median: what identical networks read here. "
                "The `infer × plain` column uses the same median.",
            ]
    unmerged = [(case, r["not_merged"]) for case, r in results.items() if "not_merged" in r]
    if unmerged:
        lines += ["", "Not merged (`petl.merge` refused): " + "; ".join(f"{c}: {why}" for c, why in unmerged) + "."]
    return "\n".join(lines) + "\n"


def plain_inference(results: dict[str, dict[str, Any]]) -> tuple[float, float, float, int] | None:
    """The plain backbone's inference time: the median, min and max over its identical copies, and their number.

    The no-grad row and every floor without extra tokens run the same eval forward of the same network, each
    model at its own place in memory.  Their spread is what an identical network reads here, so a merged model
    (also a plain network) is compared with their median, not with one copy that may sit at either end.
    """
    times = sorted(r["infer_ms"] for r in results.values() if r.get("plain_copy") and "infer_ms" in r)
    if not times:
        return None
    return statistics.median(times), times[0], times[-1], len(times)
