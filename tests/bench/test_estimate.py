"""The cost said before ``suite=choose`` trains: its terms, its range and its overhead share, without training."""

from __future__ import annotations

import contextlib

import pytest
import torch

from petl.bench import estimate as costs
from petl.bench.own_data import OwnData
from petl.data import TEST, TRAIN, TRAIN_VAL, VAL

DATA = OwnData("folder", "photos", {}, "0" * 64, ["a", "b"], {TRAIN: 8, VAL: 2, TRAIN_VAL: 10, TEST: 4}, None, 0.0)


def _probe(spread: float = 1.0, step: float = 0.0) -> costs.Probe:
    return costs.Probe(0.0, step, 0.0, 0.0, batch=4, image_size=32, spread=spread)


def test_two_probe_runs_split_the_overhead_into_per_run_and_per_epoch(monkeypatch):
    # 1 epoch took 10 s, 2 epochs 13 s, and the modelled terms are nil: 3 s per epoch, 7 s per run.
    monkeypatch.setattr(costs, "_probe_run", lambda overrides, epochs, compose: {1: 10.0, 2: 13.0}[epochs])
    assert costs.fixed_seconds(["output_dir=x"], _probe(), DATA, compose=None) == (7.0, 3.0)
    # Noise that makes the second run faster is no negative epoch.
    monkeypatch.setattr(costs, "_probe_run", lambda overrides, epochs, compose: {1: 10.0, 2: 9.0}[epochs])
    assert costs.fixed_seconds(["output_dir=x"], _probe(), DATA, compose=None) == (10.0, 0.0)


def test_the_estimate_says_its_range_and_how_much_is_overhead():
    # 2 trials + 2 finals of 5 epochs: per run 7 + 5 x 3 = 22 s of overhead, plus 10 s modelled.
    cost = costs.ExperimentCost("lora", 2, 2, 32.0, 32.0, 5, _probe(spread=2.0))
    found = costs.Estimate([cost], DATA.sizes, "cpu", fixed_seconds=7.0, per_epoch_seconds=3.0)
    assert found.seconds == 128.0
    assert found.range() == pytest.approx((4 * 22 + 4 * 10 / 2, 4 * 22 + 4 * 10 * 2))
    line = found.lines()[-1]
    assert "2 min, between 108 s and 3 min by the timed steps' spread" in line and "69 % of it" in line
    assert "7.0 s per run + 3.0 s per epoch" in line


def test_the_range_moves_the_timed_terms_only_not_the_builds_and_decoding():
    # Was: a run's build and decoding (measured apart, at their own rates) were scaled by the steps' spread too.
    data = OwnData("folder", "photos", {}, "0" * 64, ["a", "b"], {TRAIN: 8, VAL: 2, TRAIN_VAL: 10, TEST: 4}, None, 0.5)
    probe = costs.Probe(10.0, 0.1, 0.0, 0.0, batch=4, image_size=32, spread=2.0)
    trial, final = (costs.run_seconds(probe, data, 5, final=is_final) for is_final in (False, True))
    untimed = [costs.untimed_seconds(probe, data, is_final) for is_final in (False, True)]
    assert untimed == [10.0 + 0.5 * 10, 10.0 + 0.5 * 14]  # the build, and each image of its splits decoded
    assert trial == untimed[0] + 5 * 8 * 0.1 and final == untimed[1] + 5 * 10 * 0.1
    cost = costs.ExperimentCost("lora", 1, 1, trial, final, 5, probe, *untimed)
    found = costs.Estimate([cost], data.sizes, "cpu")
    assert found.range() == pytest.approx((32.0 + 9.0 / 2, 32.0 + 9.0 * 2))


def test_nothing_left_to_train_is_said_in_one_line_without_a_nil_estimate():
    # Was: "= 0 runs still to train", a line per experiment, then "0 s, between 0 s and 0 s ...; 0 % of it is ...".
    done = [costs.ExperimentCost(name, 0, 0, 0.0, 0.0, 5, None) for name in ("linear", "lora")]
    assert costs.Estimate(done, DATA.sizes, "cpu").lines() == [
        "cost: none: every run of the 2 experiments has finished, so nothing trains"
    ]


def test_a_probe_run_takes_what_the_real_runs_take_on_its_four_images(tmp_path):
    # train.grad_accum=2 (two batches of 64 a step in the real runs), train.warmup_frac=0.05 (a whole step of their
    # hundreds) and data.epochs=3 (no train.epochs given): the probe's 4 images hold one batch, one step, and its
    # train.epochs=1 beside data.epochs=3 would leave that one without use; each was refused, and the estimate
    # stopped saying the real runs would fail.
    from petl.train.config import default_config

    tiny = ["model.pretrained=false", "+model.kwargs.depth=1", "+model.kwargs.embed_dim=48", "model.img_size=32"]
    overrides = ["method=linear", "data=mini/digits", *tiny, "train.grad_accum=2", "train.warmup_frac=0.05"]
    overrides.append("data.epochs=3")
    assert costs._probe_run([*overrides, f"output_dir={tmp_path}"], 1, default_config) > 0


def test_a_probe_run_that_could_not_start_says_why_in_one_line(monkeypatch):
    # Was: a FileNotFoundError naming the error.log of a temporary folder, which a run that could not start (its
    # folder unwritable: a full disk) never wrote, in place of why; and "a one-epoch run" of the two-epoch one too.
    import errno

    from petl.bench import sweep
    from petl.train.config import default_config
    from petl.utils.errors import ConfigError, RunError

    def full_disk(path):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sweep, "acquire_lock", full_disk)
    tiny = ["model.pretrained=false", "+model.kwargs.depth=1", "+model.kwargs.embed_dim=48", "model.img_size=32"]
    with pytest.raises(RunError, match=r"^a 2-epoch run on 4 images to measure the cost failed: cannot write to "):
        costs._probe_run(["method=linear", "data=mini/digits", *tiny, "output_dir=x"], 2, default_config)
    # A run that failed says its error log's last line: the real runs would fail the same way (bad input, exit 2).
    monkeypatch.undo()

    def refused(overrides):
        raise ConfigError("train.lr=-1: must be positive")

    with pytest.raises(ValueError, match=r"^a 1-epoch run on 4 images .* failed: .*ConfigError: train.lr=-1: must be"):
        costs._probe_run(["method=linear", "output_dir=x"], 1, refused)


def test_ctrl_c_in_a_probe_run_names_no_run_of_the_user_s(monkeypatch):
    # Was: "interrupted before the first epoch of probe probe seed0 finished ... that run trains from the start",
    # naming the estimate's tiny run in a temporary folder, which no command trains again.
    from petl.bench import sweep
    from petl.train.config import default_config

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(sweep, "_default_fns", lambda: (interrupted, default_config, None))
    with pytest.raises(KeyboardInterrupt):
        costs._probe_run(["method=linear", "output_dir=x"], 1, default_config)
    assert sweep.interrupted_line() == (
        "error: interrupted; run the same command again to go on (finished runs are kept)"
    )


@pytest.mark.parametrize(
    "fault", [RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), ValueError("a fault in the forward")]
)
def test_a_probe_run_that_failed_not_on_bad_input_is_a_run_failure_as_petl_run_says(fault):
    # Was: every failed tiny run was a ValueError, which petl-bench reports as bad input (exit 2), an out-of-memory
    # or a fault in the forward too; petl-run exits 1 on those (petl.utils.errors.exit_status), and so does this now.
    from petl.utils.errors import RUN_ERROR, RunError, exit_status

    def failing(overrides):
        raise fault

    with pytest.raises(RunError, match=rf"^a 1-epoch run on 4 images .* failed: {type(fault).__name__}: ") as caught:
        costs._probe_run(["method=linear", "output_dir=x"], 1, failing)
    assert exit_status(caught.value) == exit_status(fault) == RUN_ERROR


@pytest.mark.parametrize("limit", [None, 0])
def test_steps_are_timed_uncached_where_the_run_s_cache_would_exceed_its_limit(monkeypatch, limit):
    # Was: the estimate timed the steps on the cached front whenever the method left one frozen, while a run whose
    # images' features exceed petl.train.cache's limit caches nothing and runs the whole backbone each step.
    from petl.train import cache
    from petl.train.config import default_config

    if limit is not None:
        monkeypatch.setattr(cache, "MAX_CACHE_BYTES", limit)
    tiny = ["model.pretrained=false", "+model.kwargs.depth=2", "+model.kwargs.embed_dim=48", "output_dir=unused"]
    cfg = default_config(["method=partial", "data=mini/digits", *tiny])
    probe, _ = costs.measure(cfg, DATA, steps=1)
    assert (probe.front_seconds > 0) == (limit is None)


SWIN_CUTS = [("partial", {"k": 1}), ("partial", {"k": 2}), ("partial", {"k": 3}), ("linear", {})]


@pytest.mark.parametrize(
    ("kind", "method"),
    [("vit", ("partial", {"k": 1})), ("vit", ("linear", {}))]
    + [(kind, cut) for kind in ("swin", "swinv2", "swinv2_cr") for cut in SWIN_CUTS],
)
def test_the_cache_size_the_estimate_decides_by_is_what_the_run_caches(kind, method):
    # A Swin's cut in its second stage was sized as the first stage's grid at the cut's width: 2 to 4 times the
    # tensors the run keeps here (64 times inside a fourth stage), so an estimate (and a run) went uncached under
    # the size limit.  Partial-k on these two-stage models cuts inside the second stage (k=1), at its opening in
    # front of the PatchMerging (k=2) and inside the first stage (k=3).
    from accelerate import Accelerator
    from conftest import TINY_MODELS
    from torch.utils.data import TensorDataset

    import petl
    from petl.train import cache

    name, options = method
    model = petl.apply(TINY_MODELS[kind](), name, num_classes=5, **options)
    plan = cache.plan(model)
    images = TensorDataset(torch.randn(6, 3, 32, 32), torch.zeros(6, dtype=torch.long))
    cached = cache.cache_split(cache.CachedTail(model, plan), images, Accelerator(cpu=True), batch_size=4).tensors[0]
    assert cache.cache_bytes(model, plan, len(images)) == cached.numel() * cached.element_size()


@pytest.mark.parametrize("kind", ["vit", "swin", "swinv2", "swinv2_cr"])
def test_a_cache_under_bf16_autocast_is_sized_in_the_dtype_it_holds(monkeypatch, kind):
    # Was sized at 4 bytes a value: a Swin's cache under CPU bf16 autocast holds bf16 (its residual stream starts at
    # the patch embedding's convolution), half that, so a run whose cache fitted the limit went uncached.  A ViT's
    # stays float32 (the position embedding's addition), and must not be halved.
    import functools

    from conftest import TINY_MODELS
    from torch.utils.data import TensorDataset

    import petl
    from petl.train import cache

    model = petl.apply(TINY_MODELS[kind](), "partial", num_classes=5, k=1)
    plan = cache.plan(model)
    bf16 = functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16)

    class Bf16Accelerator:  # what cache_split reads of accelerate's, without its process-wide precision state
        device = torch.device("cpu")
        autocast = staticmethod(bf16)

    images = TensorDataset(torch.randn(6, 3, 32, 32), torch.zeros(6, dtype=torch.long))
    cached = cache.cache_split(cache.CachedTail(model, plan), images, Bf16Accelerator(), batch_size=4).tensors[0]
    dtype = cache.cached_dtype(model, plan, bf16)
    assert dtype == cached.dtype == (torch.float32 if kind == "vit" else torch.bfloat16)
    assert cache.cache_bytes(model, plan, len(images), dtype) == cached.numel() * cached.element_size()
    # A limit the bf16 cache fits and its float32 size does not: cached under the autocast, not without it.
    monkeypatch.setattr(cache, "MAX_CACHE_BYTES", cached.numel() * cached.element_size())
    decided = {
        autocast: cache.decide(model, backbone_trains=False, augmented=False, sizes=[6], autocast=autocast)[0]
        for autocast in (bf16, contextlib.nullcontext)
    }
    assert decided == {bf16: plan, contextlib.nullcontext: plan if kind == "vit" else None}


@pytest.mark.parametrize(("precision", "itemsize"), [("no", 4), ("bf16", 2)])
def test_a_swin_cut_in_a_later_stage_is_timed_cached_where_its_cache_fits(monkeypatch, precision, itemsize):
    # swin_fractal_tiny's last block (Partial-1) takes a 4x4 grid at width 256: 16 KiB an image, 160 KiB for the 10
    # training images of a final run (DATA).  Sized as the first stage's 16x16 grid at that width (2.5 MiB), the
    # estimate timed it uncached under a limit the run's cache fits; so it did under train.precision=bf16, where
    # the run's cache holds bf16 (half that) and was sized at 4 bytes a value.
    from petl.train import cache
    from petl.train.config import default_config
    from petl.utils.precision import cpu_supports_bf16

    if precision == "bf16" and (torch.cuda.is_available() or not cpu_supports_bf16()):
        # CUDA's autocast runs LayerNorm in fp32 (the Swin's cache is fp32 there); such a CPU runs bf16 in fp32.
        pytest.skip("the Swin's cache is bf16 only under a CPU's bf16 autocast")
    monkeypatch.setattr(cache, "MAX_CACHE_BYTES", DATA.sizes[TRAIN_VAL] * 4 * 4 * 256 * itemsize)
    swin = ["model=swin_fractal_tiny_patch2_window4_32", "model.pretrained=false", "output_dir=unused"]
    overrides = ["method=partial", "method.k=1", "data=mini/digits", f"train.precision={precision}", *swin]
    probe, _ = costs.measure(default_config(overrides), DATA, steps=1)
    assert probe.front_seconds > 0


@pytest.mark.parametrize("asked", ["tf32", "fp16"])
def test_tf32_or_fp16_off_a_gpu_is_refused_before_anything_is_timed(monkeypatch, asked):
    # Was: timed in fp32 (run_precision's fallback, its warning dropped), then the tiny real run refused it, the
    # line naming a failed 1-epoch run of 4 images; the run and the estimate now refuse it in one place.
    from petl.train import build
    from petl.train.config import default_config
    from petl.utils.errors import ConfigError

    monkeypatch.setattr(build, "run_device_type", lambda: "cpu")
    tiny = ["model.pretrained=false", "+model.kwargs.depth=1", "+model.kwargs.embed_dim=48", "output_dir=unused"]
    cfg = default_config(["method=linear", "data=mini/digits", *tiny, f"train.precision={asked}"])
    built = []
    monkeypatch.setattr(build, "create_backbone", lambda cfg: built.append(cfg))
    with pytest.raises(
        ConfigError, match=rf"^train.precision={asked} acts on a CUDA GPU only, and this run trains on cpu"
    ):
        costs.measure(cfg, DATA, steps=1)
    assert built == []


def test_steps_are_timed_with_gradient_checkpointing_where_the_run_has_it(monkeypatch):
    # Was: timed without it, while the run's every backward recomputes each block's forward.
    from petl.train import engine
    from petl.train.config import default_config

    tiny = ["model.pretrained=false", "+model.kwargs.depth=2", "+model.kwargs.embed_dim=48", "output_dir=unused"]
    plain, checkpointed = (
        default_config(["method=lora", "data=mini/digits", *tiny, *more])
        for more in ([], ["train.grad_checkpointing=true"])
    )
    turned_on = []
    monkeypatch.setattr(engine, "enable_grad_checkpointing", lambda model: turned_on.append(type(model).__name__))
    costs.measure(plain, DATA, steps=1)
    assert turned_on == []
    costs.measure(checkpointed, DATA, steps=1)
    assert turned_on == ["VisionTransformer"]


def test_a_cache_over_its_limit_says_how_large_it_would_be(monkeypatch, tiny_vit):
    # Was "the cache would exceed 8 GiB": how far over, and for how many images, went unsaid.
    import petl
    from petl.train import cache

    model = petl.apply(tiny_vit(), "linear", num_classes=4)
    images = 2 * 2**30 // cache.cache_bytes(model, cache.plan(model), 1)
    monkeypatch.setattr(cache, "MAX_CACHE_BYTES", 2**30)
    plan, why = cache.decide(model, backbone_trains=False, augmented=False, sizes=[images])
    assert plan is None and why == f"the cache of {images} images would take 2 GiB, over its limit of 1 GiB"


def test_the_data_line_counts_a_folders_own_val_images_apart_from_its_training_images():
    # Was "10 training images (val200 = its own validation split)": the val/ images counted as training images,
    # under the protocol's name for a split of 200.
    assert DATA.line() == (
        "data folder photos: 2 classes, 8 training images and 2 validation images (its own: the trials are scored "
        "on them, the final runs train on all 10), 4 test images; fingerprint 000000000000"
    )


def test_a_precision_accelerate_refuses_is_named_and_leaves_no_precision_behind(monkeypatch):
    # Was: the Accelerator was made before the state it sets was put back on every path: accelerate records bf16
    # process-wide, then refuses it on a GPU without bf16, and a later Accelerator() inherited it; the line was
    # accelerate's own, naming no setting.
    from accelerate import Accelerator

    from petl.train import build, engine
    from petl.train.config import default_config
    from petl.utils.errors import ConfigError

    made = engine.fresh_accelerator

    def refused(**kwargs):
        made(**kwargs)  # its state is set before it refuses, as on a GPU without bf16
        raise ValueError("bf16 mixed precision requires PyTorch >= 1.10 and a supported device.")

    monkeypatch.setattr(build, "cpu_supports_bf16", lambda: True)
    monkeypatch.setattr(engine, "fresh_accelerator", refused)
    tiny = ["model.pretrained=false", "+model.kwargs.depth=1", "+model.kwargs.embed_dim=48", "output_dir=unused"]
    cfg = default_config(["method=linear", "data=mini/digits", "train.precision=bf16", *tiny])
    with pytest.raises(ConfigError, match=r"^train\.precision=bf16: bf16 mixed precision requires"):
        costs.measure(cfg, DATA, steps=1)
    assert Accelerator(cpu=True).mixed_precision == "no"


@pytest.mark.parametrize("method", ["lora", "partial"])
@pytest.mark.parametrize(
    ("precision", "dtype", "said"), [("bf16", torch.bfloat16, "bf16 autocast"), ("no", torch.float32, "fp32")]
)
def test_steps_are_timed_in_the_precision_the_run_trains_in(monkeypatch, method, precision, dtype, said):
    # Was: timed in fp32 whatever train.precision said, while a bf16 run's every forward runs under bf16 autocast.
    # LoRA trains through the whole backbone; Partial-1 trains on its cached front, computed under the autocast too.
    from petl.train import build
    from petl.train.config import default_config

    monkeypatch.setattr(build, "cpu_supports_bf16", lambda: True)  # a CPU without bf16 runs it in fp32, as runs do
    outputs = []
    forward = torch.nn.Linear.forward
    monkeypatch.setattr(torch.nn.Linear, "forward", lambda self, x: outputs.append(y := forward(self, x)) or y)
    tiny = ["model.pretrained=false", "+model.kwargs.depth=2", "+model.kwargs.embed_dim=48", "output_dir=unused"]
    cfg = default_config([f"method={method}", "data=mini/digits", f"train.precision={precision}", *tiny])
    probe, _ = costs.measure(cfg, DATA, steps=1)
    assert outputs and {y.dtype for y in outputs} == {dtype}
    assert (probe.front_seconds > 0) == (method == "partial")
    assert probe.precision.startswith(said)
    line = costs.Estimate([costs.ExperimentCost("lora", 1, 1, 1.0, 1.0, 5, probe)], DATA.sizes, "cpu").lines()[1]
    assert line.endswith(f"px, in {probe.precision})")
    # accelerate's precision is process-wide: the estimate leaves none behind for an Accelerator made after it.
    from accelerate import Accelerator

    assert Accelerator(cpu=True).mixed_precision == "no"


@pytest.mark.parametrize(("deterministic", "autotuned"), [("false", True), ("true", False)])
def test_steps_are_timed_with_the_cuda_switches_the_run_sets(monkeypatch, deterministic, autotuned):
    # Was: TF32 set as the runner sets it, but not cudnn.benchmark, which a train.deterministic=false run turns on
    # on CUDA: its convolutions (a Swin's patch embedding) were timed on other kernels than the run uses.  Both now
    # go through build.cuda_switches; here a CPU stands in for the GPU, the switches being plain flags.
    from petl.train import build
    from petl.train.config import default_config

    switches = (torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    seen = []

    def measured(*args):
        seen.append(
            (torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        )
        return _probe()

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # a deterministic run sets it
    monkeypatch.setattr(build, "run_device_type", lambda: "cuda")
    monkeypatch.setattr(costs, "_measure", measured)
    tiny = ["model.pretrained=false", "+model.kwargs.depth=1", "+model.kwargs.embed_dim=48", "output_dir=unused"]
    overrides = ["method=linear", "data=mini/digits", "train.precision=tf32", f"train.deterministic={deterministic}"]
    assert costs.measure(default_config([*overrides, *tiny]), DATA, steps=1)[1] == "cuda"
    assert seen == [(autotuned, True, True)]
    assert (
        torch.backends.cudnn.benchmark,
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
    ) == switches  # put back


def test_the_cuda_switches_act_on_cuda_only_and_are_put_back(monkeypatch):
    from petl.train import build

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # a deterministic run sets it

    def switches() -> tuple[bool, bool, bool]:
        return torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32

    before = switches()
    with build.cuda_switches("bf16", deterministic=False, device_type="cpu"):
        assert switches() == before
    with build.cuda_switches("no", deterministic=False, device_type="cuda"):
        assert switches() == (True, False, False)
    with pytest.raises(RuntimeError), build.cuda_switches("bf16", deterministic=True, device_type="cuda"):
        assert switches() == (False, True, True)
        raise RuntimeError("a failed run")
    assert switches() == before
