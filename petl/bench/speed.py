"""``petl-bench speed``: what each method costs per training step, in memory, and at inference.

For every experiment and two references, on one backbone and batch:

* **train step**: forward + cross-entropy + backward + AdamW step, median of ``steps`` timed steps after
  ``warmup`` untimed ones (the first steps allocate optimizer state and warm caches).  All cases live in
  one process and take turns over ``rounds`` rounds, so a shared machine's drifting load falls on all alike
  (every round times a step, so ``steps`` below ``rounds`` is refused);
* **peak memory**: on CUDA, ``torch.cuda.max_memory_allocated`` (weights, gradients, optimizer state,
  activations), in this process, the allocator's peak reset per case once the previous case's tensors are
  freed, less what was still allocated before the case was built; on CPU, in a fresh subprocess per case,
  the growth of the resident set's high-water mark (Linux VmHWM, reset after set-up) over the RSS after
  set-up, so it counts gradients, AdamW state and activations but not the frozen weights.  tracemalloc
  cannot see torch's allocator, hence RSS, and an RSS high-water mark cannot be lowered again, hence a
  process per case;
* **inference**: eval-mode forward latency at ``infer_batch``, median of ``infer_steps``, also in turns.

References: the frozen backbone's no-grad forward, full fine-tuning, and peft's LoRA on the whole fused
qkv (``peft.inject_adapter_in_model(LoraConfig(r=8, target_modules=["qkv"]), model)``).  Mergeable methods
are also timed after ``petl.merge``, against the plain backbone's inference.

**Floors.**  Each method's step is compared with its own lower bound (:class:`Floor`): the frozen backbone's
forward plus a backward that reaches the earliest trainable tensor, with the method's extra tokens (prompts)
added where they enter (zeros after the prefix tokens, each block making room for them as for prompts; a Swin's
prompts, copied into every window beside the grid, run as the method's own model with every parameter frozen).
Both are read off the method's model (which parameters train, in which block or before/after the blocks, and how
many tokens each block sees), never off its name.  A method above
``NOTE_ABOVE`` times its floor gets a note: the ops whose time grew most over the floor's in one profiled
step (``torch.profiler``) and the bytes autograd saved for the backward (saved-tensor hooks).

**Options** (``options_for=`` experiments): the same step with gradient checkpointing (timm's), with
``torch.compile``, and under bf16 autocast, as extra rows (``options=bf16`` keeps only some of them, and is refused
without ``options_for=``, where it would add nothing); with a bf16 row, peft's LoRA gets one too, the reference of
the bf16 rows.

**Precision** is a column: on a GPU the fp32 rows run their matmuls on TF32 tensor cores (``tf32=true``, the
default: what a petl-run training does with its default precision), ``tf32=false`` times strict fp32; on a CPU
every row without bf16 is fp32, and ``tf32=`` is refused there.

On a GPU (``device=cuda``) the documented setting is ViT-B/16 at 224 px, batch 64: those are the defaults
there when ``model``/``batch`` are not given.

**Other backbones.**  ``model=`` takes any timm model petl has a backbone kind for (``petl.list_backbones()``:
Swin, SwinV2, EVA, BEiT, relative-position ViT and the others), and ``model.kwargs.KEY=VALUE`` (petl-run's
``+model.kwargs``) builds a smaller one of the family, e.g. the default ViT's shape; an experiment the kind
refuses (``petl.apply``'s one line) is left out and listed with its reason, as is peft's LoRA where the model has
no fused ``qkv`` (``benchmarks/speed_backbones.sh``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import torch

from petl.bench.args import CONFIGS_KEYS, as_bool, configs_folder, parse_args, split_list
from petl.bench.floors import Floor, find_floor, run_order, tokens_per_block
from petl.bench.speed_bench import (
    FORWARD,
    NOTE_ABOVE,
    OPTIONS,
    PEFT_LORA,
    Case,
    SpeedSpec,
    _Bench,
    build_model,
    cuda_matmul_precision,
    image_side,
    measure_memory,
    measure_memory_in_subprocess,
    measure_times,
    peft_target,
    precision_label,
)
from petl.bench.speed_table import format_table, machine_line, plain_inference
from petl.model.backbone import backbone_of
from petl.store.files import write_text
from petl.train import engine
from petl.train.readers import image_size

__all__ = [
    "FORWARD", "NOTE_ABOVE", "OPTIONS", "PEFT_LORA", "Case", "Floor", "SpeedSpec", "_Bench", "find_floor",
    "format_table", "main", "make_spec", "measure_memory", "measure_memory_in_subprocess", "measure_times",
    "plain_inference", "plan_cases", "run_speed",
]  # fmt: skip

# The documented GPU setting (used for device=cuda when model/batch are not given).
CUDA_DEFAULTS = {"model": "vit_base_patch16_224", "batch": 64}

# The command's own keys: SpeedSpec's fields (its model_kwargs as model.kwargs.KEY=VALUE, petl-run's spelling) and more.
SPEED_KEYS = {f.name for f in fields(SpeedSpec)} - {"model_kwargs"}
SPEED_KEYS |= {"methods", "out", "inprocess", "options_for", "options"} | CONFIGS_KEYS
MODEL_KWARGS = "model.kwargs."


def plan_cases(
    spec: SpeedSpec,
    experiments: Sequence[tuple[str, dict[str, Any]]],
    options_for: Sequence[str] = (),
    log: Callable[[str], None] = print,
    options: Sequence[str] | None = None,
) -> tuple[list[Case], dict[str, str], dict[str, str]]:
    """The rows in table order, each method row's floor row, and the rows left out with the reason.

    Floors are found on each method's model (:func:`find_floor`); methods with the same floor share
    its row.  ``options_for`` experiments get one extra row per training option (:data:`OPTIONS`, or the
    keys of it in ``options``) whose compiler is available; with a bf16 row, peft's LoRA gets one too.
    An experiment ``petl.apply`` refuses on this backbone (a Swin for a ViT-only method), and peft's LoRA
    where peft cannot wrap the Linear computing Q, is left out: its refusal is the reason.
    """
    chosen = list(OPTIONS) if options is None else list(options)
    cpu = SpeedSpec(**{**asdict(spec), "device": "cpu"})
    plain = build_model(Case("plain"), cpu)
    # The size petl-run feeds: a patch embedding's, else the pretrained config's (a NaFlexVit has no patch_embed).
    side = image_size(plain)
    probe = torch.randn(1, 3, side, side)
    plain_tokens = tokens_per_block(plain, probe)
    plain_modules = set(run_order(plain, probe))
    floors: dict[str, Floor] = {}
    refused: dict[str, str] = {}
    for name, method in experiments:
        try:
            model = build_model(Case(name, dict(method)), cpu)
        except ValueError as error:  # petl.apply's one-line refusal (see its Raises)
            refused[name] = str(error)
            log(f"speed: no {name} row: {error}")
            continue
        if getattr(model.petl_config, "side_network", False):
            floors[name] = Floor(start="", side=name)
        else:
            floors[name] = find_floor(model, probe, plain_tokens, plain_modules, name)
    experiments = [(name, method) for name, method in experiments if name not in refused]
    floor_rows = {f.label(): f for f in floors.values()}
    methods = dict(experiments)
    cases = [Case(FORWARD)]
    cases += [
        Case(label, dict(methods[f.side or f.frozen]) if f.side or f.frozen else {}, floor=f)
        for label, f in floor_rows.items()
    ]
    cases += [Case(name, dict(method)) for name, method in experiments]
    missing = engine.compiler_missing(spec.device)
    for name, method in experiments:
        if name not in options_for:
            continue
        for option, suffix in OPTIONS.items():
            if option not in chosen:
                continue
            if option == "compile" and missing:
                log(f"speed: no {name} {suffix} row: {missing}")
                continue
            cases.append(Case(f"{name} {suffix}", dict(method), options=(option,)))
    try:
        build_model(Case(PEFT_LORA, peft=True), cpu)
    except ValueError as error:  # peft: target module qkv not found
        refused[PEFT_LORA] = str(error)
        log(f"speed: no {PEFT_LORA} row: {error}")
    else:
        cases.append(Case(PEFT_LORA, peft=True))
        if "bf16" in chosen and any(c.options == ("bf16",) for c in cases):
            cases.append(Case(f"{PEFT_LORA} {OPTIONS['bf16']}", peft=True, options=("bf16",)))
    of = {name: floors[name].label() for name, _ in experiments}
    of.update({c.name: of[n] for c in cases if c.options for n, _ in experiments if c.name.startswith(n + " + ")})
    return cases, of, refused


def run_speed(
    spec: SpeedSpec,
    experiments: Sequence[tuple[str, dict[str, Any]]],
    inprocess: bool = False,
    log: Callable[[str], None] = print,
    options_for: Sequence[str] = (),
    options: Sequence[str] | None = None,
) -> dict[str, dict[str, Any]]:
    """Measure the no-grad forward, the floors, each experiment (and its options) and peft's LoRA.

    Args:
        spec: the shared settings.
        experiments: (name, method mapping) pairs.
        inprocess: measure memory in this process too (fast, for tests; CPU peaks are then not clean).
        log: progress messages.
        options_for: experiments that also get a row per training option.
        options: which training options (keys of :data:`OPTIONS`); all of them unless given.

    Returns:
        Results by case name, in table order; method rows name their floor row under ``floor``; an experiment
        the backbone refuses (and peft's LoRA where it cannot be built) has only ``refused``, the reason, last.

    """
    cases, floor_of, refused = plan_cases(spec, experiments, options_for, log, options)
    # A fresh process per case costs seconds of start-up (about 15 s a case on a GPU machine); only the
    # CPU's RSS high-water mark needs it, the CUDA allocator's peak resets in place.
    measure = measure_memory if inprocess or spec.device == "cuda" else measure_memory_in_subprocess
    results: dict[str, dict[str, Any]] = {}
    with cuda_matmul_precision(spec):
        for case in cases:
            log(f"speed: memory of {case.name}")
            results[case.name] = {**measure(case, spec), "precision": precision_label(case, spec)}
        method_floors = {c.name: floor_of[c.name] for c in cases if c.name in floor_of and not c.options}
        for name, times in measure_times(cases, spec, log, method_floors).items():
            results[name].update(times)
    for name, floor in floor_of.items():
        results[name]["floor"] = floor
    for case in cases:
        if case.name == FORWARD or (case.floor is not None and not case.floor.extra_tokens and not case.floor.side):
            # Its inference is the frozen backbone's plain forward: one more identical copy of the network.
            results[case.name]["plain_copy"] = True
        if case.floor is not None and case.floor.frozen:
            results[case.name]["frozen_model_of"] = case.floor.frozen
    if PEFT_LORA in results:  # what its label can only sum up: which Linear, holding which rows
        plain = build_model(Case("plain"), SpeedSpec(**{**asdict(spec), "device": "cpu"}))
        results[PEFT_LORA]["target"] = peft_target(plain)
    results.update({name: {"refused": why} for name, why in refused.items()})
    return results


def split_model_kwargs(args: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    """The ``model.kwargs.KEY=VALUE`` arguments (``+model.kwargs...`` too, as petl-run writes them) and the rest.

    Values are read by Hydra's override grammar, as petl-run reads them: ``[2,2]`` is a list, ``64`` an int.

    Raises:
        SystemExit: a value Hydra cannot read, or a key the command sets itself (``img_size``, ``num_classes``).

    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    ours = [a for a in args if a.lstrip("+").startswith(MODEL_KWARGS)]
    try:
        parsed = OverridesParser.create().parse_overrides([a.lstrip("+") for a in ours])
    except HydraException as error:
        raise SystemExit(f"petl-bench speed: {error}".splitlines()[0]) from None
    kwargs = {o.key_or_group.removeprefix(MODEL_KWARGS): o.value() for o in parsed}
    for key in sorted(set(kwargs) & {"img_size", "num_classes"}):
        raise SystemExit(f"petl-bench speed: {MODEL_KWARGS}{key}: give it as {key}=N, the command's own key")
    return kwargs, [a for a in args if a not in ours]


def make_spec(own: dict[str, str], cuda_available: bool, model_kwargs: dict[str, Any] | None = None) -> SpeedSpec:
    """The spec from command-line values: the GPU when there is one, and there :data:`CUDA_DEFAULTS`.

    Raises:
        SystemExit: a value that is not a number of its kind or not in its range, ``steps`` below ``rounds``,
            a device that is not ``cpu`` or a CUDA GPU torch sees, or ``tf32`` given on a CPU (one line naming it,
            checked before any model is built).

    """
    settings: dict[str, Any] = {}
    for f in fields(SpeedSpec):
        if f.name not in own:
            continue
        value = own[f.name]
        if isinstance(f.default, bool):
            settings[f.name] = as_bool(f.name, value)
            continue
        try:
            settings[f.name] = type(f.default)(value)
        except ValueError:  # int('abc') says neither which key nor what it takes
            raise SystemExit(f"petl-bench speed: {f.name}={value}: expected a whole number") from None
    settings["model_kwargs"] = dict(model_kwargs or {})
    settings.setdefault("device", "cuda" if cuda_available else "cpu")
    if settings["device"] == "cuda":
        if not cuda_available:
            raise SystemExit(
                "petl-bench speed: device=cuda: torch sees no CUDA GPU here (torch.cuda.is_available() is false): "
                "run it on a machine with one, or give device=cpu"
            )
        for key, value in CUDA_DEFAULTS.items():
            settings.setdefault(key, value)
    elif "tf32" in own:  # the default is true; given on a CPU it would be read by nothing
        raise SystemExit(
            f"petl-bench speed: tf32={own['tf32']} acts on a CUDA GPU only: a CPU has no TF32 and times every row "
            "without bf16 in fp32: drop tf32=, or give device=cuda"
        )
    try:
        return SpeedSpec(**settings)
    except ValueError as error:  # its range checks, one line naming the value
        raise SystemExit(f"petl-bench speed: {error}") from None


def main(args: Sequence[str]) -> int:
    """``petl-bench speed key=value ...``: measure, print the table, optionally write it to ``out=``."""
    from petl.bench.suite import list_experiments, load_experiment
    from petl.train.config import check_built_size, check_group_choice

    own, rest = parse_args(args, SPEED_KEYS)
    model_kwargs, rest = split_model_kwargs(rest)
    if rest:
        known = ", ".join(sorted(SPEED_KEYS | {MODEL_KWARGS + "KEY"}))
        raise SystemExit(f"petl-bench speed: unknown argument(s) {rest}; known: {known}")
    spec = make_spec(own, torch.cuda.is_available(), model_kwargs)
    if "inprocess" in own and spec.device == "cuda":
        # The CUDA allocator's peak resets in place: every row is measured in this process whatever inprocess says.
        raise SystemExit(
            f"petl-bench speed: inprocess={own['inprocess']} acts on a CPU only: on a CUDA GPU every row's memory is "
            "read in this process, its allocator's peak reset per row: drop inprocess=, or give device=cpu"
        )
    # Before any case is built: an unknown name is bad input (exit 2), not timm's RuntimeError mid-measure (exit 1).
    check_group_choice("model", spec.model)
    # Built on the meta device (shapes only, no weights), as petl-run checks its model before it builds one.
    import timm

    size = {"img_size": spec.img_size} if spec.img_size else {}
    try:
        with torch.device("meta"):
            model = timm.create_model(spec.model, pretrained=False, **size, **spec.model_kwargs)
    except TypeError as error:  # a keyword the model does not take: timm's TypeError failed the command (exit 1)
        raise SystemExit(f"petl-bench speed: model.kwargs: {error}") from None
    try:
        # A model of a family petl reads but refuses whole (a distilled DeiT) left every row out, then failed (exit 1).
        backbone_of(model).check()
    except ValueError as error:
        raise SystemExit(f"petl-bench speed: model={spec.model}: {error}") from None
    if spec.img_size:
        # As petl-run: a model that takes img_size and sizes its images otherwise (timm's NaFlexVit) would be timed at
        # its own size under a table that says img_size's.
        check_built_size(model, spec.model, spec.img_size, key="img_size")
    configs = configs_folder(own)
    names = split_list(own["methods"]) if "methods" in own else list_experiments(configs)
    options_for = split_list(own["options_for"]) if "options_for" in own else []
    unknown = sorted(set(options_for) - set(names))
    if unknown:
        raise SystemExit(f"petl-bench speed: options_for names experiments not measured: {unknown}")
    options = split_list(own["options"]) if "options" in own else None
    if options is not None and (not options or set(options) - set(OPTIONS)):
        raise SystemExit(f"petl-bench speed: options={own['options']}: choose among {', '.join(OPTIONS)}")
    if options is not None and not options_for:  # the option rows are only ever added for options_for's experiments
        raise SystemExit(
            f"petl-bench speed: options={own['options']} adds rows only for the experiments options_for= names: "
            "give options_for=NAME,... too (e.g. options_for=lora)"
        )
    experiments = [(n, load_experiment(n, configs).method) for n in names]
    inprocess = as_bool("inprocess", own.get("inprocess", "false"))
    results = run_speed(spec, experiments, inprocess=inprocess, options_for=options_for, options=options)
    table = format_table(results, spec, machine_line(spec.device), memory_in_process=inprocess)
    print(table)
    if "out" in own:
        command = "petl-bench speed " + " ".join(args)
        # Whole or not at all (its folder made as needed): an interrupted write keeps the earlier table.
        title = f"# petl speed: {spec.model} at {image_side(spec)} px on {spec.device}"
        write_text(Path(own["out"]), f"{title}\n\nCommand: `{command}`\n\n{table}")
    return 0


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    # Worker mode: one memory measurement, its JSON on the last line of stdout.
    job = json.loads(sys.argv[2])
    print(json.dumps(measure_memory(Case.from_dict(job["case"]), SpeedSpec(**job["spec"]))))
