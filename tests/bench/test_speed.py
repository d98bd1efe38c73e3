"""The speed benchmark on the tiny backbone: a few steps, in-process, to check the table's shape, floors and references.

The tests measure on the CPU wherever they run (SpeedSpec's device); ``device=cuda`` shares every code path but the
memory reading (``torch.cuda.max_memory_allocated``), the clock's synchronisation and the TF32 switches, which the
test marked cuda runs on a GPU.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import timm
import torch

import petl
from petl.bench import speed, speed_bench
from petl.bench.floors import run_order
from petl.bench.speed import (
    FORWARD,
    OPTIONS,
    PEFT_LORA,
    Case,
    Floor,
    SpeedSpec,
    find_floor,
    format_table,
    make_spec,
    measure_memory_in_subprocess,
    plan_cases,
    run_speed,
)
from petl.bench.speed_bench import above_floor, build_model, where_the_rest_goes
from petl.cli import bench as cli
from petl.train import engine

TINY = SpeedSpec(batch=2, steps=2, warmup=1, rounds=2, infer_steps=2)
LORA = ("lora", {"name": "lora", "rank": 8})
# The tiny FractalDB ViT: 8x8 patches of 4 px on 32 px images plus a class token, 6 blocks.
TOKENS, DEPTH = 65, 6


@pytest.fixture(scope="module")
def results():
    cases = [("full", {"name": "full"}), LORA, ("vpt", {"name": "vpt", "num_tokens": 5})]
    # Compile rows take a minute to compile; test_compile_row_is_planned... covers their planning.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(speed, "OPTIONS", {k: v for k, v in OPTIONS.items() if k != "compile"})
        return run_speed(TINY, cases, inprocess=True, log=lambda _: None, options_for=["lora"])


def _model(name: str, **options) -> torch.nn.Module:
    torch.manual_seed(0)
    model = timm.create_model(TINY.model, pretrained=False, num_classes=10)
    return petl.apply(model, name, num_classes=10, **options)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "options", "floor"),
    [
        ("lora", {}, Floor("blocks.0.attn.qkv")),
        ("lora", {"targets": ["fc2"]}, Floor("blocks.0.mlp.fc2")),
        ("partial", {"k": 2}, Floor(f"blocks.{DEPTH - 2}.norm1")),
        ("linear", {}, Floor("head")),
        ("full", {}, Floor("")),
        ("vpt", {"num_tokens": 7}, Floor("blocks.0", extra_tokens=7, extra_at=0)),
        ("vpt", {"num_tokens": 3, "deep": True}, Floor("blocks.0", extra_tokens=3, extra_at=0)),
        # NOAH's blocks run the timm block's halves, never its forward: its prompts count through the wrapper's
        # output (the data-free placeholder subnet: 5 prompts in every block).
        ("noah", {}, Floor("blocks.0", extra_tokens=5, extra_at=0)),
    ],
)
def test_floor_is_read_off_the_model(name, options, floor):
    model = _model(name, **options)
    plain = set(run_order(_model("full"), torch.randn(1, 3, 32, 32)))
    assert find_floor(model, torch.randn(1, 3, 32, 32), [TOKENS] * DEPTH, plain) == floor


def test_floor_backward_stops_at_the_earliest_trainable_tensor():
    # A floor at block 4's input: blocks 0-3 run forward only, so no gradient flows through them.
    from petl.bench.speed import _Bench

    bench = _Bench(Case("floor", floor=Floor("blocks.4")), TINY)
    reached = []
    for i, block in enumerate(bench.model.blocks):
        block.register_full_backward_hook(lambda _m, _gi, _go, i=i: reached.append(i))
    bench.step()
    assert sorted(reached) == [4, 5]


@pytest.mark.slow
def test_rows_and_references(results):
    rows = list(results)
    assert rows[0] == FORWARD and rows[-2:] == [PEFT_LORA, f"{PEFT_LORA} {OPTIONS['bf16']}"]
    floors = [r for r in rows if r.startswith("floor:")]
    assert floors == [
        "floor: fwd + bwd to images",
        "floor: fwd + bwd to `blocks.0.attn.qkv` input",
        "floor: fwd + bwd to `blocks.0` input, +5 tokens from block 0",
    ]
    assert results["full"]["floor"] == floors[0] and results["lora"]["floor"] == floors[1]
    assert results["vpt"]["floor"] == floors[2]
    assert results[FORWARD]["trainable"] == 0 and all(results[f]["trainable"] == 0 for f in floors)
    # peft's rank-8 LoRA on the whole fused qkv trains as many weights as petl's rank-8 LoRA on Q and V.
    assert results[PEFT_LORA]["trainable"] == results["lora"]["trainable"] < results["full"]["trainable"]
    assert "infer_merged_ms" in results["lora"] and "infer_merged_ms" not in results["full"]
    assert all(r["train_ms"] > 0 and r["infer_ms"] > 0 and r["peak_mb"] >= 0 for r in results.values())
    assert ["lora + grad checkpointing", "lora + bf16 autocast"] == [r for r in rows if r.startswith("lora +")]


@pytest.mark.slow
def test_table_has_ratios_to_each_reference(results):
    table = format_table(results, TINY, "test machine")
    main_table = table.split("Each method's floor")[0]
    rows = {line.split("|")[1].strip(): line.split("|") for line in main_table.splitlines() if line.startswith("| ")}
    assert rows[FORWARD][6].strip() == "1.00×"  # the no-grad forward against itself
    assert rows["full"][7].strip() == "1.00×" and rows[PEFT_LORA][8].strip() == "1.00×"
    ratio = results["lora"]["train_ms"] / results["full"]["train_ms"]
    assert rows["lora"][7].strip() == f"{ratio:.2f}×"
    own = results["lora"]["train_ms"] / results[results["lora"]["floor"]]["train_ms"]
    assert rows["lora"][5].strip() == f"{own:.2f}×"
    # Precision is a column; a bf16 row is compared with peft's LoRA in bf16, the other rows with it in fp32.
    assert rows["lora"][2].strip() == "fp32" and rows["lora + bf16 autocast"][2].strip() == "bf16 autocast"
    peft_bf16 = f"{PEFT_LORA} {OPTIONS['bf16']}"
    assert rows[peft_bf16][2].strip() == "bf16 autocast" and rows[peft_bf16][8].strip() == "1.00×"
    bf16_ratio = results["lora + bf16 autocast"]["train_ms"] / results[peft_bf16]["train_ms"]
    assert rows["lora + bf16 autocast"][8].strip() == f"{bf16_ratio:.2f}×"
    assert "Precision: `fp32` rows in fp32" in table
    assert "Merged inference" in table and "Machine: test machine" in table


@pytest.mark.slow
def test_merged_inference_is_compared_with_the_median_of_the_plain_copies(results):
    # The plain copies: the no-grad row and the floors that add no tokens; the prompt floor runs a longer sequence.
    copies = {c for c, r in results.items() if r.get("plain_copy")}
    assert copies == {FORWARD, "floor: fwd + bwd to images", "floor: fwd + bwd to `blocks.0.attn.qkv` input"}
    times = sorted(results[c]["infer_ms"] for c in copies)
    assert speed.plain_inference(results) == (times[1], times[0], times[2], 3)
    table = format_table(results, TINY, "m")
    merged_section = table.split("Merged inference")[1]
    merged_row = next(line for line in merged_section.splitlines() if line.startswith("| lora | "))
    assert merged_row.split("|")[4].strip() == f"{times[1]:.2f}"
    assert merged_row.split("|")[5].strip() == f"{results['lora']['infer_merged_ms'] / times[1]:.2f}×"
    assert "median of 3 identical plain networks" in table


def test_timed_inference_keeps_what_lora_caches_between_calls():
    # A served model is put in eval mode once; eval() before every timed call would drop LoRA's stacked A and B
    # (LoraLinear._inference_stack) and rebuild them inside each timed forward, which peft's row never pays.
    from petl.methods.lora import LoraLinear

    bench = speed._Bench(Case("lora", {"name": "lora", "rank": 2}), TINY)
    bench.step()  # the training rounds leave the LoRA layers in train mode
    layer = next(m for m in bench.model.modules() if isinstance(m, LoraLinear))
    bench.infer()
    stack = layer._stack
    bench.infer()
    assert layer._stack is stack and not any(m.training for m in bench.model.modules())


def test_a_bf16_rows_inference_runs_without_autocast_as_its_table_says():
    # The table says a row's options act on its training step only: its Infer ms is the eager fp32 forward.
    bench = speed._Bench(Case("lora + bf16 autocast", {"name": "lora", "rank": 2}, options=("bf16",)), TINY)
    seen = []
    bench.model.register_forward_hook(lambda *_: seen.append(torch.is_autocast_enabled("cpu")))
    bench.step()
    bench.infer()
    assert seen == [True, False]
    assert "act on its training step only" in format_table({}, TINY, "m")


@pytest.mark.parametrize(("kind", "px"), [("vit", 32), ("naflexvit", 384)])
def test_the_table_names_the_image_size_the_cases_ran_at_without_img_size_given(kind, px):
    # Without img_size= the table said no size at all: the default model's 32 px, or a NaFlexVit's 384 px (its
    # pretrained config's), went unsaid.
    spec = TINY if kind == "vit" else _tiny_spec(kind)  # img_size=0 both: the model's own size
    assert f"Backbone `{spec.model}` at {px} px" in format_table({}, spec, "m")
    assert speed.image_side(spec) == speed._Bench(Case(FORWARD), spec).images.shape[-1] == px


def test_the_out_files_title_names_the_image_size(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(speed, "run_speed", lambda *args, **kwargs: {})
    speed.main(["methods=linear", "device=cpu", f"out={tmp_path / 'speed.md'}"])
    title = (tmp_path / "speed.md").read_text().splitlines()[0]
    assert title == "# petl speed: vit_fractal_tiny_patch4_32 at 32 px on cpu", title


@pytest.mark.slow
def test_inference_turns_change_order(monkeypatch):
    # Record the order of the timed inference calls: every turn must not start with the same case.
    seen: list[str] = []
    real_infer = speed._Bench.infer

    def infer(self, model=None):
        seen.append(self.case.name + (" merged" if model is not None else ""))
        return real_infer(self, model)

    monkeypatch.setattr(speed._Bench, "infer", infer)
    spec = SpeedSpec(batch=2, steps=1, warmup=0, rounds=1, infer_steps=6)
    cases = [Case(FORWARD), Case("lora", {"name": "lora", "rank": 2}), Case("full", {"name": "full"})]
    speed.measure_times(cases, spec, log=lambda _: None)
    turns = [seen[i : i + 4] for i in range(0, len(seen), 4)]
    assert len(turns) == 6 and all(sorted(t) == sorted(turns[0]) for t in turns)
    assert sorted(turns[0]) == [FORWARD, "full", "lora", "lora merged"]
    assert len({t[0] for t in turns}) > 1


@pytest.mark.slow
def test_a_row_above_its_floor_gets_a_note(results):
    # Which rows are noted follows from the measured times (whatever they are on this machine).
    noted = {c for c, r in results.items() if "note" in r}
    above = {
        c
        for c, r in results.items()
        if "floor" in r and "+" not in c and r["train_ms"] > speed.NOTE_ABOVE * results[r["floor"]]["train_ms"]
    }
    assert noted == above


def test_the_note_goes_to_rows_above_their_floor_on_given_numbers():
    # Given numbers, not timings: 1.2x and 1.15x+ are above the 1.15x threshold, 1.15x itself and below are not.
    times = {
        "floor": {"train_ms": 10.0},
        "full": {"train_ms": 12.0},
        "lora": {"train_ms": 11.5},
        "bitfit": {"train_ms": 11.6},
        "linear": {"train_ms": 9.0},
    }
    floors = {name: "floor" for name in ("full", "lora", "bitfit", "linear")}
    assert speed.NOTE_ABOVE == 1.15
    assert above_floor(times, floors) == ["full", "bitfit"]


@pytest.mark.slow
def test_a_note_names_the_grown_ops_and_the_saved_memory_and_is_printed(results):
    # Full fine-tuning against its floor, profiled whatever the timings: the note's content, and the table's line.
    spec = SpeedSpec(batch=2, steps=1, warmup=0, rounds=1, infer_steps=1)
    full = speed._Bench(Case("full", {"name": "full"}), spec)
    floor = speed._Bench(Case("floor", floor=Floor(start="")), spec)
    note = where_the_rest_goes(full, floor)
    assert "aten::" in note and "saved for backward" in note
    given = {name: dict(r) for name, r in results.items()}
    given["full"]["train_ms"] = 2 * given[given["full"]["floor"]]["train_ms"]
    given["full"]["note"] = note
    table = format_table(given, TINY, "m")
    assert "where the rest goes" in table and f"- **full** (2.00×): {note}" in table


@pytest.mark.slow
def test_compile_row_is_planned_only_with_a_compiler(monkeypatch):
    cases, floor_of, _ = plan_cases(TINY, [LORA], options_for=["lora"], log=lambda _: None)
    names = [c.name for c in cases]
    has_compiler = engine.compiler_missing("cpu") is None
    assert ("lora + torch.compile" in names) == has_compiler and floor_of["lora + grad checkpointing"] == floor_of[
        "lora"
    ]
    monkeypatch.setattr(engine, "compiler_missing", lambda device: "no compiler (test)")
    cases, _, _ = plan_cases(TINY, [LORA], options_for=["lora"], log=lambda _: None)
    assert "lora + torch.compile" not in [c.name for c in cases]


def _peaks_in_subprocesses(cases: list[Case], spec: SpeedSpec) -> dict[str, float]:
    """Peak MB of each case, each in its own fresh process as the tool measures, two processes at a time.

    Each worker reads its own process's high-water mark (VmHWM), which another process beside it does not move, and
    a worker spends most of its seconds importing torch, timm and petl: two side by side take about half as long.
    """
    with ThreadPoolExecutor(max_workers=2) as pool:
        peaks = list(pool.map(lambda case: measure_memory_in_subprocess(case, spec)["peak_mb"], cases))
    return {case.name: peak for case, peak in zip(cases, peaks, strict=True)}


@pytest.fixture(scope="module")
def peaks_at_batch_8() -> dict[str, float]:
    """LoRA's, peft's LoRA's, LST's and LAST's peak MB at batch 8, read by the memory comparisons below.

    LoRA's is measured once for both comparisons: a worker spends most of its time importing torch, timm and petl.
    """
    cases = [Case("lora", dict(LORA[1])), Case(PEFT_LORA, peft=True)]
    cases += [Case(name, {"name": name}) for name in ("lst", "last")]
    return _peaks_in_subprocesses(cases, SpeedSpec(batch=8, warmup=1))


@pytest.mark.slow
def test_lora_uses_no_more_memory_than_peft(peaks_at_batch_8):
    # The same number of weights and FLOPs as peft's whole-qkv LoRA; petl adds its updates in place into
    # the qkv output instead of rebuilding it with torch.cat (measured in fresh processes).
    assert peaks_at_batch_8["lora"] <= 1.02 * peaks_at_batch_8[PEFT_LORA]


@pytest.mark.slow
def test_cpu_peak_counts_what_full_fine_tuning_allocates():
    # Gradients plus two AdamW moments for ~2.7M float32 weights are ~32 MB; the no-grad forward allocates none
    # of them (only forward temporaries, ~17 MB here).
    # Measured in fresh processes as the tool does: in this process, memory freed by earlier tests is reused
    # without raising the high-water mark, so an in-process reading depends on test order.
    peaks = _peaks_in_subprocesses([Case("full", {"name": "full"}), Case(FORWARD)], TINY)
    assert peaks["full"] > 32 and peaks["full"] > 2 * peaks[FORWARD]


def test_cuda_defaults_to_the_documented_gpu_setting():
    assert make_spec({}, cuda_available=False) == SpeedSpec()
    spec = make_spec({}, cuda_available=True)
    assert (spec.device, spec.model, spec.batch) == ("cuda", "vit_base_patch16_224", 64)
    assert make_spec({"device": "cuda", "batch": "8"}, cuda_available=True).batch == 8


def test_tf32_is_a_setting_and_names_the_fp32_rows_on_a_gpu():
    assert make_spec({}, cuda_available=True).tf32 is True
    assert make_spec({"tf32": "false"}, cuda_available=True).tf32 is False
    with pytest.raises(SystemExit, match="tf32=maybe"):
        make_spec({"tf32": "maybe"}, cuda_available=True)
    cuda, strict = SpeedSpec(device="cuda"), SpeedSpec(device="cuda", tf32=False)
    labels = [speed_bench.precision_label(Case("lora"), s) for s in (cuda, strict, SpeedSpec())]
    assert labels == ["TF32", "fp32", "fp32"]
    assert speed_bench.precision_label(Case("lora", options=("bf16",)), cuda) == "bf16 autocast"
    assert "`TF32` rows" in format_table({}, cuda, "m") and "strict fp32" in format_table({}, strict, "m")


@pytest.mark.parametrize("tf32", [True, False])
def test_a_cuda_measurement_sets_the_tf32_switches_and_puts_them_back(tf32):
    # torch's switches exist without a GPU; a CPU measurement leaves them alone.
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    with speed_bench.cuda_matmul_precision(SpeedSpec(device="cuda", tf32=tf32)):
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (tf32, tf32)
    with speed_bench.cuda_matmul_precision(SpeedSpec(tf32=not before[0])):
        assert torch.backends.cuda.matmul.allow_tf32 == before[0]
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before


@pytest.mark.slow
def test_options_keeps_only_the_named_training_options():
    cases, floor_of, _ = plan_cases(TINY, [LORA], options_for=["lora"], log=lambda _: None, options=["bf16"])
    extra = [c.name for c in cases if c.options]
    assert extra == ["lora + bf16 autocast", f"{PEFT_LORA} + bf16 autocast"]
    assert floor_of["lora + bf16 autocast"] == floor_of["lora"]
    cases, _, _ = plan_cases(TINY, [LORA], options_for=["lora"], log=lambda _: None, options=["grad_ckpt"])
    assert [c.name for c in cases if c.options] == ["lora + grad checkpointing"]


@pytest.mark.cuda
def test_a_cuda_speed_run_times_tf32_and_bf16_rows():
    spec = SpeedSpec(device="cuda", batch=2, steps=2, warmup=1, rounds=1, infer_steps=2)
    results = run_speed(spec, [LORA], log=lambda _: None, options_for=["lora"], options=["bf16"])
    assert results["lora"]["precision"] == "TF32" and results["lora + bf16 autocast"]["precision"] == "bf16 autocast"
    assert all(r["train_ms"] > 0 and r["peak_mb"] > 0 for name, r in results.items() if name != FORWARD)


def test_img_size_builds_the_backbone_at_that_size():
    spec = make_spec({"img_size": "16"}, cuda_available=False)
    assert build_model(Case("plain"), spec).patch_embed.img_size == (16, 16)
    assert build_model(Case("plain"), SpeedSpec()).patch_embed.img_size == (32, 32)


BASE = ["speed", "methods=lora", "inprocess=true", "warmup=0", "infer_steps=1", "steps=1", "rounds=1"]


def test_inprocess_on_a_gpu_is_refused_where_every_row_is_measured_in_process_anyway(monkeypatch, capsys):
    # It changed nothing there (the CUDA allocator's peak resets in place): the table read the same either way.
    monkeypatch.setattr(speed.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(speed, "run_speed", lambda *a, **k: pytest.fail("measured despite bad input"))
    with pytest.raises(SystemExit) as caught:
        cli.main([*BASE, "device=cuda"])
    err = capsys.readouterr().err
    assert caught.value.code == 2 and "inprocess=true acts on a CPU only: on a CUDA GPU every row's" in err, err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # Each ran and exited 0 printing "training batch 0" and the like, or built every case, then failed (exit 1).
        (["batch=0"], "batch=0 is out of range: allowed [1, inf]"),
        (["infer_batch=0"], "infer_batch=0 is out of range"),
        (["warmup=-1"], "warmup=-1 is out of range: allowed [0, inf]"),
        (["steps=0"], "steps=0 is out of range"),
        (["rounds=0"], "rounds=0 is out of range"),
        (["infer_steps=0"], "infer_steps=0 is out of range"),
        (["img_size=-1"], "img_size=-1 is out of range"),
        (["num_classes=0"], "num_classes=0 is out of range"),
        (["batch=many"], "batch=many: expected a whole number"),
        (["device=tpu"], "device='tpu' is not valid: choose one of cpu, cuda"),
        (["device=cuda"], "device=cuda: torch sees no CUDA GPU here"),
        # Every round times a step, so steps=1 rounds=3 timed 3 steps and the table said "median of 1 steps".
        (["steps=1", "rounds=3"], "steps=1 is fewer than rounds=3"),
        # options= only acts on options_for's experiments: alone, it added nothing.
        (["options=bf16"], "options=bf16 adds rows only for the experiments options_for= names"),
        (["options=", "options_for=lora"], "options=: choose among grad_ckpt, compile, bf16"),
        # Was timm's "RuntimeError: Unknown model" from the first case built, exit 1.
        (["model=vit_bse_patch16_224"], "unknown model 'vit_bse_patch16_224'; did you mean"),
        # A NaFlexVit ignores img_size: timed at its own 384 px under a table that said 32 px.
        (
            ["model=naflexvit_base_patch16_gap", "img_size=32"],
            "img_size=32: naflexvit_base_patch16_gap is built for 384 px whatever img_size says (timm resamples its "
            "position grid to any size): drop img_size",
        ),
        # Were timm's TypeError (exit 1), and every row left out, then an AttributeError building peft's (exit 1).
        (["model.kwargs.depthh=1"], "model.kwargs: VisionTransformer.__init__() got an unexpected keyword argument"),
        (["model=deit_tiny_distilled_patch16_224"], "model=deit_tiny_distilled_patch16_224: petl supports a timm"),
    ],
)
def test_speed_cli_refuses_bad_values_in_one_line_before_measuring(args, message, monkeypatch, capsys):
    monkeypatch.setattr(speed.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(speed, "run_speed", lambda *a, **k: pytest.fail("measured despite bad input"))
    with pytest.raises(SystemExit) as caught:
        cli.main([*BASE, *args])
    err = capsys.readouterr().err
    assert caught.value.code == 2 and err.count("\n") == 1 and message in err, err


def test_a_spec_refuses_what_it_cannot_time_and_times_the_steps_it_says():
    for bad in ({"batch": 0}, {"rounds": 0}, {"steps": 2, "rounds": 3}, {"device": "tpu"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SpeedSpec(**bad)
    for steps, rounds in ((10, 10), (7, 3), (3, 3), (1, 1)):
        shares = [speed_bench._share(steps, rounds, r) for r in range(rounds)]
        assert sum(shares) == steps and min(shares) >= 1


@pytest.mark.slow
def test_speed_cli_rejects_unknown_keys(capsys):
    with pytest.raises(SystemExit) as caught:
        cli.main(["speed", "batchsize=3"])
    assert caught.value.code == 2 and "unknown argument" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["dtl", "lst", "last"])
def test_side_tuning_methods_get_their_own_floor(name):
    # A side network's floor is its own model with the frozen blocks run without autograd, not a backward
    # into the backbone: find_floor is not asked (it would point at block 0, where the side network starts).
    spec = SpeedSpec(model=TINY.model)
    cases, floor_of, _ = plan_cases(spec, [(name, {"name": name})], log=lambda _: None)
    floor = next(c for c in cases if c.floor is not None)
    assert floor.floor == Floor("", side=name) and floor.method == {"name": name}
    assert floor_of[name] == floor.name == f"floor: no-grad fwd + {name} side network"


def test_side_floor_runs_no_block_with_autograd_and_trains_the_side_network():
    from petl.bench.speed import _Bench

    bench = _Bench(Case("floor", {"name": "dtl", "add_from": 2}, floor=Floor("", side="dtl")), TINY)
    outputs = []
    for block in petl.backbone_of(bench.model).block_list():
        block.register_forward_hook(lambda _m, _a, out: outputs.append(out.requires_grad))
    before = [p.detach().clone() for p in bench.params]
    bench.step()
    assert outputs == [False] * DEPTH and torch.is_grad_enabled()
    assert any(not torch.equal(p, q) for p, q in zip(bench.params, before, strict=True))


@pytest.mark.slow
def test_lst_and_last_peak_memory_is_below_loras(peaks_at_batch_8):
    # LST's and LAST's backward never enters the backbone, LoRA's reaches block 0 (fresh processes, as the tool
    # measures).
    for name in ("lst", "last"):
        assert peaks_at_batch_8[name] < peaks_at_batch_8["lora"], name


# One tiny model of every backbone kind petl added to the ViT, given as petl-bench speed takes it (model= and
# model.kwargs.KEY=VALUE): benchmarks/speed_backbones.sh times larger ones the same way.
TINY_SEQUENCE = {"patch_size": 8, "embed_dim": 48, "depth": 2, "num_heads": 3}
TINY_WINDOWS = {"patch_size": 4, "window_size": 4, "embed_dim": 16, "depths": [2, 2], "num_heads": [2, 4]}
KINDS = {
    "swin": ("swin_fractal_tiny_patch2_window4_32", TINY_WINDOWS),
    "swinv2": ("swinv2_tiny_window8_256", TINY_WINDOWS),
    "swinv2_cr": ("swinv2_cr_tiny_ns_224", TINY_WINDOWS),
    "eva": ("eva02_tiny_patch14_224", TINY_SEQUENCE),
    "beit": ("beitv2_base_patch16_224", TINY_SEQUENCE),
    "vit_relpos": ("vit_relpos_medium_patch16_cls_224", TINY_SEQUENCE),
    "vit_parallel": ("vit_pwee_patch16_reg1_gap_256", TINY_SEQUENCE),
    # No patch_embed: its 384-px images (its pretrained config's; timm ignores img_size) are 12x12 patches of 32.
    "naflexvit": ("naflexvit_base_patch16_gap", {**TINY_SEQUENCE, "patch_size": 32}),
}


def _tiny_spec(kind: str) -> SpeedSpec:
    name, kwargs = KINDS[kind]
    px = 0 if kind == "naflexvit" else 32
    return SpeedSpec(model=name, img_size=px, model_kwargs=kwargs, batch=2, steps=1, warmup=1, rounds=1, infer_steps=1)


@pytest.mark.parametrize("kind", KINDS)
def test_speed_runs_on_every_backbone_kind(kind):
    # Every row planned, built and measured (a round, no timing asserted); a method the kind refuses is left out
    # with petl.apply's reason, not an error.
    spec = _tiny_spec(kind)
    assert petl.backbone_of(build_model(Case("plain"), spec)).kind == kind
    # A method the kind refuses, where the registry has one (the first such).
    refused = next((m for m in petl.list_methods() if kind not in petl.get_method(m).backbones), None)
    experiments = [(name, {"name": name}) for name in ("lora", "ssf", "gps")] + [
        ("vpt", {"name": "vpt", "num_tokens": 3})
    ]
    experiments += [(refused, {"name": refused})] if refused else []
    results = run_speed(spec, experiments, inprocess=True, log=lambda _: None)
    # SSF's shift folds into a bias; where qkv has none (BEiT, EVA) petl.merge refuses and the row says why.
    ssf = results["ssf"]
    assert "refused" in ssf or "infer_merged_ms" in ssf or "without weight and bias" in ssf["not_merged"]
    for name in ("gps", "vpt"):
        assert ("refused" in results[name]) == (kind not in petl.get_method(name).backbones), name
    if refused:
        assert f"does not support the {kind} backbone" in results[refused]["refused"]
    measured = [name for name, r in results.items() if "refused" not in r]
    assert {FORWARD, "lora", PEFT_LORA} <= set(measured)
    # peft's LoRA adapts a whole Linear: a parallel block's in_proj holds fc1's rows beside Q, K and V.
    target = ("in_proj", ["fc1", "q", "k", "v"]) if kind == "vit_parallel" else ("qkv", ["q", "k", "v"])
    assert results[PEFT_LORA]["target"] == target
    assert all(results[name]["train_ms"] > 0 and results[name]["infer_ms"] > 0 for name in measured)
    if "refused" not in results["vpt"]:
        assert "+3 tokens from block 0" in results["vpt"]["floor"]
    table = format_table(results, spec, "test machine", memory_in_process=True)
    if refused:
        assert "Left out, refused on this backbone" in table
        assert f"- **{refused}**: method '{refused}' does not support" in table
    assert "Peak MB: not shown (inprocess=true" in table
    assert f"peft adapts all output rows of every block's `{target[0]}` ({', '.join(target[1])})." in table
    assert ("Not merged (`petl.merge` refused): ssf:" in table) == ("not_merged" in ssf)


@pytest.mark.parametrize("kind", ["eva", "beit", "swinv2"])
def test_a_floor_at_a_qkv_the_plain_attention_never_calls_starts_at_the_attention(kind):
    # Their attention reads qkv.weight itself (F.linear with the q/v biases): a hook on the plain qkv would never
    # run, and the floor's backward would reach nothing.
    spec = _tiny_spec(kind)
    cases, floor_of, _ = plan_cases(spec, [LORA], log=lambda _: None)
    assert floor_of["lora"].endswith(".attn` input")
    bench = speed._Bench(next(c for c in cases if c.name == floor_of["lora"]), spec)
    bench.step()  # would raise: element 0 of tensors does not require grad


def test_vpt_on_swin_gets_a_floor_with_its_prompts_in_every_window():
    # The prompts travel beside the grid and are copied into every window: the floor is VPT's own model, frozen.
    spec = _tiny_spec("swin")
    model = build_model(Case("vpt", {"name": "vpt", "num_tokens": 3, "deep": True}), spec)
    plain = build_model(Case("plain"), spec)
    images = torch.randn(1, 3, 32, 32)
    plain_tokens = speed.tokens_per_block(plain, images)
    assert speed.tokens_per_block(model, images) == [t + 3 for t in plain_tokens]
    floor = find_floor(model, images, plain_tokens, set(run_order(plain, images)), "vpt_deep")
    assert floor == Floor("layers.0.blocks.0", extra_tokens=3, extra_at=0, frozen="vpt_deep")
    bench = speed._Bench(Case(floor.label(), {"name": "vpt", "num_tokens": 3, "deep": True}, floor=floor), spec)
    assert bench.params == [] and bench.optimizer is None
    inputs = []  # block 0's input, as the floor's hook (registered first) hands it on
    bench.model.get_submodule(floor.start).register_forward_pre_hook(lambda _m, args: inputs.append(args[0]))
    bench.step()
    assert inputs[0].grad is not None and inputs[0].grad.abs().sum() > 0


def test_model_kwargs_are_read_as_petl_run_reads_them():
    kwargs, rest = speed.split_model_kwargs(["+model.kwargs.depths=[2,2]", "model.kwargs.embed_dim=16", "batch=2"])
    assert kwargs == {"depths": [2, 2], "embed_dim": 16} and rest == ["batch=2"]
    assert make_spec({}, cuda_available=False, model_kwargs=kwargs).model_kwargs == kwargs
    with pytest.raises(SystemExit, match="give it as img_size=N"):
        speed.split_model_kwargs(["model.kwargs.img_size=64"])


def test_the_machine_line_counts_the_logical_cpus_this_process_may_use(monkeypatch):
    # Was "16 cores": os.cpu_count(), the machine's logical CPUs, where the process was given 2 of them.
    from petl.bench import speed_table

    monkeypatch.setattr(speed_table.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(speed_table.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert ", 2 of the machine's 16 logical CPUs, " in speed_table.machine_line("cpu")
    monkeypatch.setattr(speed_table.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert ", 16 logical CPUs, " in speed_table.machine_line("cpu")


def test_a_failed_speed_worker_is_one_line_naming_its_exception_and_its_traceback_goes_to_stderr(monkeypatch, capsys):
    # Was "failed:\n" and the worker's stderr tail in the message, which the commands' one-line errors escape into
    # one long line of literal \n.
    import subprocess

    from petl.bench import speed_bench

    traceback = 'Traceback (most recent call last):\n  File "x.py", line 1\nValueError: rank 0\n\n'
    done = subprocess.CompletedProcess([], returncode=1, stdout="", stderr=traceback)
    monkeypatch.setattr(speed_bench.subprocess, "run", lambda *args, **kwargs: done)
    with pytest.raises(RuntimeError) as error:
        measure_memory_in_subprocess(Case("lora", dict(LORA[1])), TINY)
    assert str(error.value) == "speed worker for 'lora' failed (exit 1): ValueError: rank 0"
    assert capsys.readouterr().err == traceback


def test_predict_throughput_merges_without_keeping_a_copy_it_never_restores(monkeypatch):
    # benchmarks/predict_throughput.py merged with restorable=True: a CPU copy of the wrapped layers, never unmerged,
    # held beside the merged model it times.
    import importlib.util
    import sys
    from pathlib import Path

    from petl.model import merging

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "predict_throughput.py"
    spec = importlib.util.spec_from_file_location("predict_throughput", path)
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "predict_throughput", script)
    spec.loader.exec_module(script)
    unmerged, merged = script._runs("vit_fractal_tiny_patch4_32", pretrained=False)
    assert not any(hasattr(module, merging._KEPT) for module in merged.model.modules())
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(merged.model(images), unmerged.model(images), atol=1e-4, rtol=1e-4)
