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

References: the frozen backbone's no-grad forward, full fine-tuning, and peft's LoRA on the whole fused
qkv (``peft.inject_adapter_in_model(LoraConfig(r=8, target_modules=["qkv"]), model)``).  Mergeable methods
are also timed after ``petl.merge``, against the plain backbone's inference.

**Floors.**  Each method's step is compared with its own lower bound (:class:`Floor`): the frozen backbone's
forward plus a backward that reaches the earliest trainable tensor, with the method's extra tokens (prompts)
added where they enter.  Both are read off the method's model (which parameters train, in which block or
before/after the blocks, and how many tokens each block sees), never off its name.  A method above
``NOTE_ABOVE`` times its floor gets a note: the ops whose time grew most over the floor's in one profiled
step (``torch.profiler``) and the bytes autograd saved for the backward (saved-tensor hooks).

**Options** (``options_for=`` experiments): the same step with gradient checkpointing (timm's), with
``torch.compile``, and under bf16 autocast, as extra rows.

On a GPU (``device=cuda``) the documented setting is ViT-B/16 at 224 px, batch 64: those are the defaults
there when ``model``/``batch`` are not given.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from petl.bench.rss import current_rss_mb, peak_rss_mb, reset_peak_rss

FORWARD = "frozen forward (no grad)"
PEFT_LORA = "peft LoRA r=8 on fused qkv"
# Training options measured as extra rows, by the suffix their rows get.
OPTIONS = {"grad_ckpt": "+ grad checkpointing", "compile": "+ torch.compile", "bf16": "+ bf16 autocast"}
# A method slower than this many times its floor gets a note saying where the rest goes.
NOTE_ABOVE = 1.15
# The documented GPU setting (used for device=cuda when model/batch are not given).
CUDA_DEFAULTS = {"model": "vit_base_patch16_224", "batch": 64}


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
    rounds: int = 10
    infer_batch: int = 1
    infer_steps: int = 100
    device: str = "cpu"
    num_classes: int = 10


# The command's own keys besides SpeedSpec's fields.
SPEED_KEYS = {f.name for f in fields(SpeedSpec)} | {"methods", "out", "inprocess", "benchmarks_dir", "options_for"}


@dataclass(frozen=True)
class Floor:
    """A method's lower bound: the frozen forward plus a backward that reaches its earliest trainable tensor.

    Attributes:
        start: the backbone module whose input the backward must reach: the innermost module that runs
            the method's earliest trainable tensor, named as in the plain backbone (``blocks.0.attn.qkv``
            for LoRA on Q/V, ``head`` for a linear probe); ``""`` for the whole model (the images).
        extra_tokens: tokens the method adds to the sequence (prompts), most over any block.
        extra_at: the first block that sees them.

    """

    start: str
    extra_tokens: int = 0
    extra_at: int = 0

    def label(self) -> str:
        """The floor's row name."""
        where = f"`{self.start}` input" if self.start else "images"
        tokens = f", +{self.extra_tokens} tokens from block {self.extra_at}" if self.extra_tokens else ""
        return f"floor: fwd + bwd to {where}{tokens}"


@dataclass(frozen=True)
class Case:
    """One row: a petl method (``method``), peft's LoRA (``peft``), a floor, or the no-grad forward (none).

    Attributes:
        name: the row label.
        method: petl method mapping (``name`` plus options).
        options: keys of :data:`OPTIONS` applied to the step.
        floor: set for a floor row.
        peft: peft's LoRA on the fused qkv.

    """

    name: str
    method: dict[str, Any] = field(default_factory=dict)
    options: tuple[str, ...] = ()
    floor: Floor | None = None
    peft: bool = False

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Case:
        """Inverse of ``dataclasses.asdict`` (for the memory worker)."""
        floor = raw.get("floor")
        return cls(**{**raw, "options": tuple(raw["options"]), "floor": Floor(**floor) if floor else None})


def _build(case: Case, spec: SpeedSpec):
    """The model of one case: plain frozen backbone, petl method, or peft LoRA."""
    import timm
    import torch

    import petl

    model = timm.create_model(spec.model, pretrained=False, num_classes=spec.num_classes)
    if case.peft:
        from peft import LoraConfig, inject_adapter_in_model

        # peft marks only its own adapters trainable; the head trains too, as it does for every petl method.
        model = inject_adapter_in_model(LoraConfig(r=8, target_modules=["qkv"]), model)
        model.get_classifier().requires_grad_(True)
    elif case.method:
        options = {k: v for k, v in case.method.items() if k != "name"}
        petl.apply(model, case.method["name"], num_classes=spec.num_classes, **options)
    else:
        model.requires_grad_(False)
    return model.to(torch.device(spec.device))


def _observe(model, images, handles: list) -> None:
    """One no-grad eval forward of ``model`` with the given hooks in place, which are removed afterwards."""
    import torch

    try:
        with torch.no_grad():
            model.eval()(images)
    finally:
        for handle in handles:
            handle.remove()


def _tokens_per_block(model, images) -> list[int]:
    """How many tokens enter each block (inside any wrapper, so prompts added by a wrapper count)."""
    from petl import vit

    seen: list[int] = [0] * vit.depth(model)
    handles = [
        block.register_forward_pre_hook(lambda _m, args, i=i: seen.__setitem__(i, max(seen[i], args[0].shape[-2])))
        for i, block in enumerate(vit.blocks(model))
    ]
    _observe(model, images, handles)
    return seen


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def find_floor(model, images, plain_tokens: int, plain_modules: set[str]) -> Floor:
    """Where ``model``'s earliest trainable tensor is used and how many tokens it adds (see :class:`Floor`).

    Read off the model, not the method's name: one forward with hooks records the order modules run in;
    each trainable parameter is placed at the innermost module that runs and holds it, and the earliest
    of those, mapped to the plain backbone's module of the same name (or its nearest ancestor there:
    a new adapter module maps to the block part it sits in), is where the floor's backward must reach.

    Args:
        model: the model with the method applied.
        images: a batch to run it on.
        plain_tokens: tokens the plain backbone feeds to each block.
        plain_modules: module names of the plain backbone.

    """
    names = {module: name for name, module in model.named_modules()}
    order: dict[str, int] = {}

    def record(module, _args) -> None:  # a pre-hook returning a value would replace the module's input
        order.setdefault(names[module], len(order))

    _observe(model, images, [m.register_forward_pre_hook(record) for m in model.modules()])
    places = []
    for name, param in model.named_parameters():
        if param.requires_grad:
            path = _parent(name)
            while path and path not in order:  # e.g. a ParameterDict, which never runs itself
                path = _parent(path)
            places.append((order[path], path))
    start = min(places)[1] if places else ""
    while start and start not in plain_modules:
        start = _parent(start)
    tokens = _tokens_per_block(model, images)
    extra = max(t - plain_tokens for t in tokens)
    extra_at = next((i for i, t in enumerate(tokens) if t > plain_tokens), 0)
    return Floor(start=start, extra_tokens=max(0, extra), extra_at=extra_at if extra > 0 else 0)


def _floor_hooks(model, floor: Floor) -> None:
    """Make the frozen ``model`` run ``floor``.

    Extra tokens are appended where they enter, then the input of ``floor.start`` is made to require grad,
    so the backward reaches exactly that far (hooks run in the order they were registered).
    """
    import torch

    from petl import vit

    def add_tokens(_module, args):
        x = args[0]
        return (torch.cat([x, x.new_zeros(x.shape[0], floor.extra_tokens, x.shape[-1])], dim=-2), *args[1:])

    if floor.extra_tokens:
        vit.block_container(model)[floor.extra_at].register_forward_pre_hook(add_tokens)
    if floor.start:
        start = model.get_submodule(floor.start)
        start.register_forward_pre_hook(lambda _m, args: (args[0].detach().requires_grad_(), *args[1:]))


class _Bench:
    """One live case: its model, a fixed batch, its optimizer, and timed step / inference calls."""

    def __init__(self, case: Case, spec: SpeedSpec) -> None:
        import torch

        from petl.run import engine

        torch.manual_seed(0)
        self.spec, self.case = spec, case
        self.model = _build(case, spec)
        h, w = self.model.patch_embed.img_size
        device = torch.device(spec.device)
        self.images = torch.randn(spec.batch, 3, h, w, device=device)
        self.labels = torch.randint(0, spec.num_classes, (spec.batch,), device=device)
        self.infer_images = torch.randn(spec.infer_batch, 3, h, w, device=device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if case.floor is not None:
            _floor_hooks(self.model, case.floor)
        # The no-grad forward and the floors train nothing: no optimizer.
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-3) if self.params else None
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.merged = None
        if "grad_ckpt" in case.options:
            engine.enable_grad_checkpointing(self.model)
        self.step_model = torch.compile(self.model) if "compile" in case.options else self.model
        bf16 = "bf16" in case.options
        self.autocast = (
            (lambda: torch.autocast(device_type=spec.device, dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
        )

    def _now(self) -> float:
        import torch

        # CUDA runs asynchronously: without a sync the clock would stop before the kernels do.
        if self.spec.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def step(self) -> None:
        """One training step: forward + loss + backward (+ AdamW step when something trains)."""
        import torch

        from petl.run import engine

        # As the engine does: only what learns is in train mode.
        engine.set_train_mode(self.model)
        if self.case.floor is None and self.optimizer is None:
            with torch.no_grad():
                self.model(self.images)
            return
        floor_at_images = self.case.floor is not None and not self.case.floor.start
        images = self.images.detach().requires_grad_() if floor_at_images else self.images
        with self.autocast():
            loss = self.loss_fn(self.step_model(images), self.labels)
        loss.backward()
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def train_step(self) -> float:
        """Seconds for one training step (:meth:`step`)."""
        start = self._now()
        self.step()
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

    def profile(self) -> tuple[dict[str, float], float]:
        """One profiled step: self time (ms) by op, and MB of distinct storages autograd saved for the backward."""
        import torch
        from torch.profiler import ProfilerActivity, profile

        storages: dict[int, int] = {}

        def pack(t):
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
            return t

        cuda = self.spec.device == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            self.step()
        attr = "self_device_time_total" if cuda else "self_cpu_time_total"
        times = {e.key: getattr(e, attr) / 1000 for e in prof.key_averages()}
        return times, sum(storages.values()) / 2**20


def where_the_rest_goes(bench: _Bench, floor: _Bench, top: int = 3) -> str:
    """A note on what a case spends beyond its floor: the ops whose time grew most, and saved-tensor memory."""
    times, saved = bench.profile()
    floor_times, floor_saved = floor.profile()
    grown = sorted(((t - floor_times.get(k, 0.0), k) for k, t in times.items()), reverse=True)[:top]
    ops = ", ".join(f"{k} +{d:.1f} ms" for d, k in grown if d > 0)
    memory = f"saved for backward {saved:.0f} MB (floor {floor_saved:.0f} MB)"
    return f"ops grown most over the floor in one profiled step: {ops}; {memory}"


def measure_memory(case: Case, spec: SpeedSpec) -> dict[str, Any]:
    """Trainable count and peak memory of a few training steps (call it in a fresh process on CPU).

    The peak covers ``warmup`` + 2 steps: the first step allocates the gradients and AdamW's state,
    later ones only repeat it.  A compiled case compiles in its warm-up steps first, so its peak is
    that of 2 compiled steps over the RSS after set-up (it includes what the compiled code keeps
    resident, not the compiler's passing peak).
    """
    import torch

    bench = _Bench(case, spec)
    before = current_rss_mb()
    steps = spec.warmup + 2
    if "compile" in case.options:
        for _ in range(spec.warmup):
            bench.step()
        steps = 2
    if spec.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    # From here the high-water mark belongs to the steps alone (Linux); the weights are already resident.
    reset_peak_rss()
    for _ in range(steps):
        bench.step()
    peak = torch.cuda.max_memory_allocated() / 2**20 if spec.device == "cuda" else max(0.0, peak_rss_mb() - before)
    return {"trainable": sum(p.numel() for p in bench.params), "peak_mb": peak}


def measure_memory_in_subprocess(case: Case, spec: SpeedSpec) -> dict[str, Any]:
    """Run :func:`measure_memory` in a fresh Python process (same interpreter and environment)."""
    payload = json.dumps({"case": asdict(case), "spec": asdict(spec)})
    proc = subprocess.run(
        [sys.executable, "-m", "petl.bench.speed", "--worker", payload], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"speed worker for {case.name!r} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure_times(
    cases: Sequence[Case],
    spec: SpeedSpec,
    log: Callable[[str], None] = print,
    floors: dict[str, str] | None = None,
) -> dict[str, dict[str, Any]]:
    """Median training-step and inference times of every case, the cases taking turns.

    On a shared machine the background load drifts; measuring the cases in turns, ``rounds`` times,
    spreads that drift over all of them instead of penalising whichever ran during a busy minute.
    Mergeable methods also get a merged copy (``petl.merge``) timed at inference.  Cases named in
    ``floors`` (case -> its floor case) that are slower than :data:`NOTE_ABOVE` times their floor get a
    ``note`` from :func:`where_the_rest_goes`.

    Returns:
        By case: ``train_ms``, ``infer_ms``, for mergeable methods ``infer_merged_ms``, and maybe ``note``.

    """
    import petl

    benches: dict[str, _Bench] = {}
    for case in cases:
        log(f"speed: building {case.name}")
        bench = benches[case.name] = _Bench(case, spec)
        for _ in range(spec.warmup):
            bench.train_step()
            bench.infer()
        if case.method and not case.options and petl.get_method(case.method["name"]).mergeable:
            # Merged after the warm-up steps, so the folded update is not zero.
            bench.merged = petl.merge(copy.deepcopy(bench.model))
            for _ in range(spec.warmup):
                bench.infer(bench.merged)
    laps: dict[tuple[str, str], list[float]] = {}
    for r in range(spec.rounds):
        log(f"speed: training round {r + 1}/{spec.rounds}")
        # Each round starts at a different case, so a slot in the round that runs slow (measured: the first
        # and last few on this shared machine) does not always fall on the same cases.
        names = list(benches)
        start = r * len(names) // spec.rounds
        for name in names[start:] + names[:start]:
            bench = benches[name]
            laps.setdefault((name, "train_ms"), []).extend(
                bench.train_step() for _ in range(_share(spec.steps, spec.rounds, r))
            )
    # A forward at the inference batch takes milliseconds, so the cases can take turns call by call: the
    # finest interleaving, which matters most for merged-vs-plain, a comparison of near-equal times.  Each
    # turn runs the calls in a new order: in a fixed order the first call of every turn read 2-5 % faster
    # than identical plain copies later in the turn (measured: the floor rows of an earlier speed_cpu.md).
    # Seeded, so a rerun times the same schedule.
    log("speed: inference")
    calls = [(name, "infer_ms", None) for name in benches]
    calls += [(name, "infer_merged_ms", b.merged) for name, b in benches.items() if b.merged is not None]
    order = random.Random(0)
    for _ in range(spec.infer_steps):
        order.shuffle(calls)
        for name, key, model in calls:
            laps.setdefault((name, key), []).append(benches[name].infer(model))
    out: dict[str, dict[str, Any]] = {name: {} for name in benches}
    for (name, key), seconds in laps.items():
        out[name][key] = 1000 * statistics.median(seconds)
    for name, floor in (floors or {}).items():
        if out[name]["train_ms"] > NOTE_ABOVE * out[floor]["train_ms"]:
            log(f"speed: profiling {name} against its floor")
            out[name]["note"] = where_the_rest_goes(benches[name], benches[floor])
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
    """The speed table as Markdown: ratios to each row's floor, the no-grad forward, full FT and peft's LoRA."""
    forward = results.get(FORWARD, {})
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
        "falls on all of them alike); the no-grad row times a forward without autograd at the same batch. "
        "A floor row is the frozen backbone's forward + loss + a backward that reaches the earliest trainable "
        "tensor of the methods that point to it (with their extra tokens), no optimizer; `× floor` compares "
        "each row with its own floor. "
        f"Inference: eval forward at batch {spec.infer_batch}, median of {spec.infer_steps}, cases in turns call "
        "by call. "
        f"Peak MB over {spec.warmup + 2} training steps: {memory}.",
        "",
        f"Machine: {machine}.",
        "",
        "| Case | Trainable | Train step ms | × floor | × no-grad fwd | × full FT | × peft LoRA | Peak MB "
        "| mem × floor | mem × full FT | mem × peft LoRA | Infer ms | infer × plain |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    plain = plain_inference(results)
    plain_infer = plain[0] if plain else forward.get("infer_ms")
    for case, r in results.items():
        own = results.get(r.get("floor", case), {}) if "floor" in r or case.startswith("floor:") else {}
        lines.append(
            f"| {case} | {r['trainable']:,} | {r['train_ms']:.1f} | {_ratio(r['train_ms'], own.get('train_ms'))} "
            f"| {_ratio(r['train_ms'], forward.get('train_ms'))} "
            f"| {_ratio(r['train_ms'], full.get('train_ms'))} | {_ratio(r['train_ms'], peft_lora.get('train_ms'))} "
            f"| {r['peak_mb']:.1f} | {_ratio(r['peak_mb'], own.get('peak_mb'))} "
            f"| {_ratio(r['peak_mb'], full.get('peak_mb'))} | {_ratio(r['peak_mb'], peft_lora.get('peak_mb'))} "
            f"| {r['infer_ms']:.2f} | {_ratio(r['infer_ms'], plain_infer)} |"
        )
    floors = [(case, r["floor"]) for case, r in results.items() if "floor" in r]
    if floors:
        lines += ["", "Each method's floor: " + "; ".join(f"{case} → {floor}" for case, floor in floors) + "."]
    notes = [(case, r["note"]) for case, r in results.items() if "note" in r]
    if notes:
        lines += ["", f"Above {NOTE_ABOVE}× its floor, where the rest goes:", ""]
        lines += [
            f"- **{case}** ({results[case]['train_ms'] / results[results[case]['floor']]['train_ms']:.2f}×): {note}"
            for case, note in notes
        ]
    merged = [(case, r) for case, r in results.items() if "infer_merged_ms" in r]
    if merged:
        lines += [
            "",
            "Merged inference (`petl.merge` folds the update into the frozen weights; the merged model is a plain "
            "network again):",
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
        if plain:
            median, low, high, count = plain
            lines += [
                "",
                f"Plain backbone: the median of {count} identical plain networks timed in the same turns (the "
                f"no-grad row and the floors without extra tokens), {low:.2f}–{high:.2f} ms, i.e. "
                f"{low / median:.3f}–{high / median:.3f}× their median: what identical networks read here. "
                "The `infer × plain` column uses the same median.",
            ]
    return "\n".join(lines) + "\n"


def plan_cases(
    spec: SpeedSpec,
    experiments: Sequence[tuple[str, dict[str, Any]]],
    options_for: Sequence[str] = (),
    log: Callable[[str], None] = print,
) -> tuple[list[Case], dict[str, str]]:
    """The rows in table order, and each method row's floor row.

    Floors are found on each method's model (:func:`find_floor`); methods with the same floor share
    its row.  ``options_for`` experiments get one extra row per training option (:data:`OPTIONS`)
    whose compiler is available.
    """
    import torch

    from petl.run import engine

    cpu = SpeedSpec(**{**asdict(spec), "device": "cpu"})
    plain = _build(Case("plain"), cpu)
    h, w = plain.patch_embed.img_size
    probe = torch.randn(1, 3, h, w)
    plain_tokens = max(_tokens_per_block(plain, probe))
    plain_modules = {name for name, _ in plain.named_modules()}
    floors: dict[str, Floor] = {}
    for name, method in experiments:
        floors[name] = find_floor(_build(Case(name, dict(method)), cpu), probe, plain_tokens, plain_modules)
    floor_rows = {f.label(): f for f in floors.values()}
    cases = [Case(FORWARD), *(Case(label, floor=f) for label, f in floor_rows.items())]
    cases += [Case(name, dict(method)) for name, method in experiments]
    missing = engine.compiler_missing(spec.device)
    for name, method in experiments:
        if name not in options_for:
            continue
        for option, suffix in OPTIONS.items():
            if option == "compile" and missing:
                log(f"speed: no {name} {suffix} row: {missing}")
                continue
            cases.append(Case(f"{name} {suffix}", dict(method), options=(option,)))
    cases.append(Case(PEFT_LORA, peft=True))
    of = {name: floors[name].label() for name, _ in experiments}
    of.update({c.name: of[n] for c in cases if c.options for n, _ in experiments if c.name.startswith(n + " + ")})
    return cases, of


def run_speed(
    spec: SpeedSpec,
    experiments: Sequence[tuple[str, dict[str, Any]]],
    inprocess: bool = False,
    log: Callable[[str], None] = print,
    options_for: Sequence[str] = (),
) -> dict[str, dict[str, Any]]:
    """Measure the no-grad forward, the floors, each experiment (and its options) and peft's LoRA.

    Args:
        spec: the shared settings.
        experiments: (name, method mapping) pairs.
        inprocess: measure memory in this process too (fast, for tests; CPU peaks are then not clean).
        log: progress messages.
        options_for: experiments that also get a row per training option.

    Returns:
        Results by case name, in table order; method rows name their floor row under ``floor``.

    """
    cases, floor_of = plan_cases(spec, experiments, options_for, log)
    results: dict[str, dict[str, Any]] = {}
    for case in cases:
        log(f"speed: memory of {case.name}")
        results[case.name] = (measure_memory if inprocess else measure_memory_in_subprocess)(case, spec)
    method_floors = {c.name: floor_of[c.name] for c in cases if c.name in floor_of and not c.options}
    for name, times in measure_times(cases, spec, log, method_floors).items():
        results[name].update(times)
    for name, floor in floor_of.items():
        results[name]["floor"] = floor
    for case in cases:
        if case.name == FORWARD or (case.floor is not None and not case.floor.extra_tokens):
            # Its inference is the frozen backbone's plain forward: one more identical copy of the network.
            results[case.name]["plain_copy"] = True
    return results


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


def make_spec(own: dict[str, str], cuda_available: bool) -> SpeedSpec:
    """The spec from command-line values: the GPU when there is one, and there :data:`CUDA_DEFAULTS`."""
    settings: dict[str, Any] = {f.name: type(f.default)(own[f.name]) for f in fields(SpeedSpec) if f.name in own}
    settings.setdefault("device", "cuda" if cuda_available else "cpu")
    if settings["device"] == "cuda":
        for key, value in CUDA_DEFAULTS.items():
            settings.setdefault(key, value)
    return SpeedSpec(**settings)


def main(args: Sequence[str]) -> int:
    """``petl-bench speed key=value ...``: measure, print the table, optionally write it to ``out=``."""
    from petl.bench.args import as_bool, parse_args, split_list
    from petl.bench.suite import find_benchmarks_dir, list_experiments, load_experiment

    own, rest = parse_args(args, SPEED_KEYS)
    if rest:
        raise SystemExit(f"petl-bench speed: unknown argument(s) {rest}; known: {', '.join(sorted(SPEED_KEYS))}")
    import torch

    spec = make_spec(own, torch.cuda.is_available())
    bench_dir = find_benchmarks_dir(own.get("benchmarks_dir"))
    names = split_list(own["methods"]) if "methods" in own else list_experiments(bench_dir)
    options_for = split_list(own["options_for"]) if "options_for" in own else []
    unknown = sorted(set(options_for) - set(names))
    if unknown:
        raise SystemExit(f"petl-bench speed: options_for names experiments not measured: {unknown}")
    experiments = [(n, load_experiment(n, bench_dir).method) for n in names]
    inprocess = as_bool("inprocess", own.get("inprocess", "false"))
    results = run_speed(spec, experiments, inprocess=inprocess, options_for=options_for)
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
    print(json.dumps(measure_memory(Case.from_dict(job["case"]), SpeedSpec(**job["spec"]))))
