"""Measuring one row of the speed table: its model, a timed training step, inference and peak memory.

See :mod:`petl.bench.speed` for what is measured and how the rows take turns.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import timm
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import petl.backbones  # noqa: F401  (registers petl's backbones with timm)
import petl.methods  # noqa: F401  (importing the methods registers them)
from petl.bench.floors import Floor, floor_hooks
from petl.model.backbone import backbone_of
from petl.model.registry import get_method
from petl.model.surgery import apply, merge
from petl.train import engine
from petl.train.readers import image_size
from petl.utils.checks import check_choice, check_range
from petl.utils.memory import current_rss_mb, peak_rss_mb, reset_peak_rss

FORWARD = "frozen forward (no grad)"
# peft's LoRA on the block Linear that computes Q (timm's fused qkv; a parallel block's in_proj): see peft_target.
PEFT_LORA = "peft LoRA r=8 on the Linear computing Q"
# Training options measured as extra rows, by the suffix their rows get.
OPTIONS = {"grad_ckpt": "+ grad checkpointing", "compile": "+ torch.compile", "bf16": "+ bf16 autocast"}
# A method slower than this many times its floor gets a note saying where the rest goes.
NOTE_ABOVE = 1.15


@dataclass(frozen=True)
class SpeedSpec:
    """The shared settings of a speed measurement.

    Attributes:
        model: timm model name (built with random weights: speed does not depend on their values).
        model_kwargs: further ``timm.create_model`` keywords, e.g. a smaller model of the family (``depth``,
            ``embed_dim``...): ``model.kwargs.KEY=VALUE`` on the command line, as petl-run's ``+model.kwargs``.
        img_size: the side of the square images the model is built for; 0 keeps the model's default.
        batch: training batch size.
        steps: timed training steps per case, spread over ``rounds``: at least one a round, so at least ``rounds``.
        warmup: untimed steps per case before the first round.
        rounds: how many times the cases take turns at training steps; the median runs over all of them.
        infer_batch: inference batch size.
        infer_steps: timed inference forwards per case, the cases taking turns call by call.
        device: ``cpu`` or ``cuda``.
        num_classes: classifier size.
        tf32: on CUDA, fp32 matmuls and convolutions run on TF32 tensor cores, as in a petl-run training with its
            default precision; false times strict fp32 (``train.precision=no``).  A CPU has no TF32.

    Raises:
        ValueError: a value out of its range, ``steps`` below ``rounds``, or a device other than ``cpu`` and
            ``cuda`` (one line naming it).

    """

    model: str = "vit_fractal_tiny_patch4_32"
    img_size: int = 0
    batch: int = 32
    steps: int = 10
    warmup: int = 3
    rounds: int = 10
    infer_batch: int = 1
    infer_steps: int = 100
    device: str = "cpu"
    num_classes: int = 10
    tf32: bool = True
    model_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Checked here, not where the values are used: batch=0 or warmup=-1 ran and printed "training batch 0",
        # rounds=0 and infer_steps=0 failed after every case was built (KeyError, exit 1).
        check_range("img_size", self.img_size, low=0)
        check_range("warmup", self.warmup, low=0)
        for name in ("batch", "steps", "rounds", "infer_batch", "infer_steps", "num_classes"):
            check_range(name, getattr(self, name), low=1)
        if self.steps < self.rounds:  # each round times a step per case: the table's "median of steps" would lie
            raise ValueError(
                f"steps={self.steps} is fewer than rounds={self.rounds}, and every round times at least one step: "
                f"give steps={self.rounds} or more, or rounds={self.steps} or fewer"
            )
        check_choice("device", self.device, ("cpu", "cuda"))


def precision_label(case: Case, spec: SpeedSpec) -> str:
    """The arithmetic a row's training step ran in: ``bf16 autocast``, ``TF32`` (fp32 on TF32 cores) or ``fp32``."""
    if "bf16" in case.options:
        return "bf16 autocast"
    return "TF32" if spec.device == "cuda" and spec.tf32 else "fp32"


@contextlib.contextmanager
def cuda_matmul_precision(spec: SpeedSpec) -> Iterator[None]:
    """CUDA's TF32 switches set as ``spec.tf32`` says for a whole measurement, and put back after (CPU: nothing)."""
    if spec.device != "cuda":
        yield
        return
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = spec.tf32
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@dataclass(frozen=True)
class Case:
    """One row: a petl method (``method``), peft's LoRA (``peft``), a floor, or the no-grad forward (none).

    Attributes:
        name: the row label.
        method: petl method mapping (``name`` plus options).
        options: keys of :data:`OPTIONS` applied to the step.
        floor: set for a floor row.
        peft: peft's LoRA on the Linear computing Q (:func:`peft_target`).

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


def peft_target(model: nn.Module) -> tuple[str, list[str]]:
    """The block Linear peft's LoRA row adapts, by the name peft matches (the one computing Q), and which of ``fc1``,
    ``q``, ``k``, ``v`` its output rows hold: peft adapts every row of it (timm's fused qkv: q, k and v; a parallel
    block's in_proj: fc1's hidden rows too).
    """
    bb = backbone_of(model)
    block = bb.block_list()[0]
    name = bb.qkv_rows(block, "q")[0]
    held = []
    for part in ("fc1", "q", "k", "v"):
        try:
            if bb.target_rows(block, part)[0] == name:
                held.append(part)
        except ValueError:  # no such Linear (a SwiGLU MLP has no fc1)
            continue
    return name, held


@functools.cache
def _random_backbone(name: str, img_size: int, num_classes: int, kwargs_json: str) -> nn.Module:
    # Built once per setting and copied per case: a ViT-B's random init takes about 1.8 s here, a copy 0.2 s,
    # and a GPU run builds every case three times (floors, memory, times).  Never handed out itself.
    size = {"img_size": img_size} if img_size else {}
    return timm.create_model(name, pretrained=False, num_classes=num_classes, **size, **json.loads(kwargs_json))


def image_side(spec: SpeedSpec) -> int:
    """The side of the images every case is timed on: the built backbone's own (``img_size``, else its default).

    Read off the model as :class:`_Bench` reads it (petl-run's rule: a patch embedding's size, else the pretrained
    config's), so a table says the size without ``img_size=`` given too.
    """
    kwargs = json.dumps(spec.model_kwargs, sort_keys=True)
    return image_size(_random_backbone(spec.model, spec.img_size, spec.num_classes, kwargs))


def build_model(case: Case, spec: SpeedSpec):
    """The model of one case: plain frozen backbone, petl method (frozen too in a floor), or peft LoRA."""
    kwargs = json.dumps(spec.model_kwargs, sort_keys=True)
    model = copy.deepcopy(_random_backbone(spec.model, spec.img_size, spec.num_classes, kwargs))
    if case.peft:
        from peft import LoraConfig, inject_adapter_in_model

        # peft marks only its own adapters trainable; the head trains too, as it does for every petl method.
        target, _ = peft_target(model)
        model = inject_adapter_in_model(LoraConfig(r=8, target_modules=[target]), model)
        backbone_of(model).adopt_wrapped_linears()  # a SwinV2 then calls peft's layer (see petl.Backbone)
        model.get_classifier().requires_grad_(True)
    elif case.method:
        options = {k: v for k, v in case.method.items() if k != "name"}
        apply(model, case.method["name"], num_classes=spec.num_classes, **options)
        if case.floor is not None and case.floor.frozen:
            model.requires_grad_(False)
    else:
        model.requires_grad_(False)
    return model.to(torch.device(spec.device))


class _Bench:
    """One live case: its model, a fixed batch, its optimizer, and timed step / inference calls."""

    def __init__(self, case: Case, spec: SpeedSpec) -> None:
        torch.manual_seed(0)
        self.spec, self.case = spec, case
        self.model = build_model(case, spec)
        # The size petl-run feeds: a patch embedding's, else the pretrained config's (a NaFlexVit has no patch_embed).
        h = w = image_size(self.model)
        device = torch.device(spec.device)
        self.images = torch.randn(spec.batch, 3, h, w, device=device)
        self.labels = torch.randint(0, spec.num_classes, (spec.batch,), device=device)
        self.infer_images = torch.randn(spec.infer_batch, 3, h, w, device=device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if case.floor is not None:
            floor_hooks(self.model, case.floor)
        # The no-grad forward and the floors train nothing (a side floor its side network only): no optimizer.
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
        # CUDA runs asynchronously: without a sync the clock would stop before the kernels do.
        if self.spec.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def step(self) -> None:
        """One training step: forward + loss + backward (+ AdamW step when something trains)."""
        # As the engine does: only what learns is in train mode.
        engine.set_train_mode(self.model)
        if self.case.floor is None and self.optimizer is None:
            with torch.no_grad():
                self.model(self.images)
            return
        floor_at_images = self.case.floor is not None and not self.case.floor.start and not self.case.floor.side
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
        model = self.model if model is None else model
        # Into eval mode only where a module is still training (after the training rounds), as a served model is
        # put there once: eval() also drops what a module keeps between its no-grad calls (LoRA's stacked A and B),
        # which a call per forward would rebuild inside the timed forward.
        if any(module.training for module in model.modules()):
            model.eval()
        start = self._now()
        with torch.no_grad():
            model(self.infer_images)
        return self._now() - start

    def profile(self) -> tuple[dict[str, float], float]:
        """One profiled step: self time (ms) by op, and MB of distinct storages autograd saved for the backward."""
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
    resident, not the compiler's passing peak).  On CUDA the peak is the allocator's, less what was
    allocated before the case was built.
    """
    cuda = spec.device == "cuda"
    if cuda:
        # Every case runs in this process: free what earlier ones left (the compiler's caches may hold a model)
        # now, before the count starts, not mid-step, where a late free would hide part of this case's peak.
        torch.compiler.reset()
        gc.collect()
    # Whatever is still allocated (cuBLAS's workspace, anything a cache kept) is not this case's.
    elsewhere = torch.cuda.memory_allocated() if cuda else 0
    bench = _Bench(case, spec)
    before = current_rss_mb()
    steps = spec.warmup + 2
    if "compile" in case.options:
        for _ in range(spec.warmup):
            bench.step()
        steps = 2
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    # From here the high-water mark belongs to the steps alone (Linux); the weights are already resident.
    reset_peak_rss()
    for _ in range(steps):
        bench.step()
    peak = (torch.cuda.max_memory_allocated() - elsewhere) / 2**20 if cuda else max(0.0, peak_rss_mb() - before)
    return {"trainable": sum(p.numel() for p in bench.params), "peak_mb": peak}


def measure_memory_in_subprocess(case: Case, spec: SpeedSpec) -> dict[str, Any]:
    """Run :func:`measure_memory` in a fresh Python process (same interpreter and environment)."""
    payload = json.dumps({"case": asdict(case), "spec": asdict(spec)})
    proc = subprocess.run(
        [sys.executable, "-m", "petl.bench.speed", "--worker", payload], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        # The worker's traceback goes to stderr as it wrote it; the error stays one line (exit_statuses escapes any
        # newline in it), naming the worker's last line, which is its exception.
        sys.stderr.write(proc.stderr[-3000:])
        last = next((line for line in reversed(proc.stderr.splitlines()) if line.strip()), "no output")
        raise RuntimeError(f"speed worker for {case.name!r} failed (exit {proc.returncode}): {last.strip()}")
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
        By case: ``train_ms``, ``infer_ms``, for mergeable methods ``infer_merged_ms`` (or ``not_merged``, the
        reason ``petl.merge`` refused this model), and maybe ``note``.

    """
    benches: dict[str, _Bench] = {}
    not_merged: dict[str, str] = {}
    for case in cases:
        log(f"speed: building {case.name}")
        bench = benches[case.name] = _Bench(case, spec)
        for _ in range(spec.warmup):
            bench.train_step()
            bench.infer()
        if case.method and not case.options and get_method(case.method["name"]).mergeable:
            # Merged after the warm-up steps, so the folded update is not zero.
            try:
                bench.merged = merge(copy.deepcopy(bench.model), restorable=False)
            except ValueError as error:  # this model's layers cannot hold the update (SSF's shift without a bias)
                log(f"speed: {case.name} not merged: {error}")
                not_merged[case.name] = str(error)
                continue
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
    for name, why in not_merged.items():
        out[name]["not_merged"] = why
    for name in above_floor(out, floors or {}):
        log(f"speed: profiling {name} against its floor")
        out[name]["note"] = where_the_rest_goes(benches[name], benches[floors[name]])
    return out


def above_floor(times: dict[str, dict[str, Any]], floors: dict[str, str]) -> list[str]:
    """The cases whose training step takes more than :data:`NOTE_ABOVE` times their floor's.

    Args:
        times: by case, at least ``train_ms``.
        floors: case -> its floor case.

    """
    return [name for name, floor in floors.items() if times[name]["train_ms"] > NOTE_ABOVE * times[floor]["train_ms"]]


def _share(total: int, rounds: int, r: int) -> int:
    # Spread `total` over `rounds` as evenly as integers allow; SpeedSpec keeps total >= rounds, so that is
    # at least one per round and `total` in all, as the table says.
    return total // rounds + (1 if r < total % rounds else 0)
