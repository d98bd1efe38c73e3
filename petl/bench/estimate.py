"""What a suite on your own data will cost, before it trains: runs, images, and wall time measured here.

For each experiment the backbone is built and the method applied (timed), then a few training steps
(forward, cross-entropy, backward, AdamW step) and evaluation forwards are timed on a batch of random images
of the run's size and batch.  Where the run would cache the frozen front of the backbone
(:mod:`petl.train.cache`; not where the cache would exceed its size limit), the front is timed once per image
and the steps on the cached tensors, as the run trains.  A run's time is then

    fixed + epochs x per_epoch
    + build + decode (its splits' images, at the rate measured while fingerprinting the data)
    + epochs x (train images x step time per image + val images x eval time per image)   [trials]
    + train images x front time + test images x eval time                                 [finals]

summed over the runs not finished yet.  ``fixed`` and ``per_epoch`` are what a run costs besides the terms
above (the run folder's checks and records, the accelerator, the loaders started each epoch, a checkpoint per
epoch, the model card): two real runs of the first experiment on :data:`PROBE_IMAGES` images of each split,
of one and of two epochs, are timed whole and what the terms above account for is taken off; their
difference is the cost of one more epoch.  On small data these can dominate (one run's per-epoch costs counted
once, an estimate fell short by half and more), so the console line says how much of the total they are.  The
range said with it comes from the measurements' own spread: the timed terms (steps, evaluation forwards, the
cached front) at the slowest and at the fastest of the timed steps; a run's own costs, its build and decoding as
measured.
The steps, the front and the evaluation forwards are timed on the device and in the precision the run would
use (``train.precision`` as the run resolves it, under the autocast of an Accelerator made as the run's, TF32 as the
runner sets it), said on each experiment's line.  What it leaves out: calibration hooks (SCT, GPS, NOAH's search),
``train.compile`` (timed eager; gradient checkpointing is timed as the run has it), a selection trial's per-epoch
val pass beyond its images, and a machine's load changing between the estimate and the runs.  Each measurement is
said as it starts (building a backbone takes seconds to minutes).
``benchmarks/choose_estimate.py`` compares the estimate with the measured time.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import reprlib
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from petl.bench.own_data import OwnData
from petl.bench.protocol import Cell
from petl.data import TEST, TRAIN, TRAIN_VAL, VAL
from petl.store import files
from petl.utils.checks import is_finite_number
from petl.utils.errors import RUN_ERROR, USAGE_ERROR, RunError
from petl.utils.text import plural

ESTIMATE_FILE = "estimate.json"
ESTIMATE_VERSION = 1  # of estimate.json; read_estimate reads it and the unversioned records before it
WARMUP_STEPS = 1
TIMED_STEPS = 3
# Images per split of the one real run that measures a run's fixed cost.
PROBE_IMAGES = 4


@dataclass(frozen=True)
class Probe:
    """One experiment's measured costs on this machine.

    Attributes:
        build_seconds: building the backbone (pretrained weights loaded) and applying the method.
        step_seconds: per training image (one step, over the batch, divided by the batch).
        eval_seconds: per evaluated image (a no-grad forward of what trains).
        front_seconds: per image, the cached front's one forward (0 where the run caches nothing).
        batch: the batch the steps were timed at.
        image_size: the input size.
        spread: the slowest of the timed training steps over the fastest: how far one step's time varied here.
        precision: what the steps were timed in, as a run's first line says it (``fp32``, ``bf16 autocast``,
            ``fp32, TF32``).

    """

    build_seconds: float
    step_seconds: float
    eval_seconds: float
    front_seconds: float
    batch: int
    image_size: int
    spread: float = 1.0  # the slowest timed training step over the fastest (>= 1)
    precision: str = "fp32"


@dataclass
class ExperimentCost:
    """One experiment's runs still to train and their estimated seconds."""

    experiment: str
    trials: int
    finals: int
    trial_seconds: float
    final_seconds: float
    epochs: int
    probe: Probe | None  # None: every run of the experiment has finished, nothing was measured
    # Of a trial's and a final's seconds, those no timed step measured: the build and the decoding (at their own
    # measured rates), which the steps' spread does not move.
    trial_untimed: float = 0.0
    final_untimed: float = 0.0

    @property
    def seconds(self) -> float:
        """Estimated wall time of this experiment's remaining runs."""
        return self.trials * self.trial_seconds + self.finals * self.final_seconds

    @property
    def untimed_seconds(self) -> float:
        """Of :attr:`seconds`, the builds' and decodings' (``trial_untimed``, ``final_untimed``)."""
        return self.trials * self.trial_untimed + self.finals * self.final_untimed


@dataclass
class Estimate:
    """The cost of what a sweep will run: per experiment, and in total."""

    experiments: list[ExperimentCost]
    sizes: dict[str, int]
    device: str
    fixed_seconds: float = 0.0
    per_epoch_seconds: float = 0.0
    measure_seconds: float = 0.0  # what measuring took
    measured_at: str = field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M:%S"))

    @property
    def seconds(self) -> float:
        """Estimated wall time of every remaining run."""
        return sum(e.seconds for e in self.experiments)

    @property
    def runs(self) -> int:
        """Runs still to train."""
        return sum(e.trials + e.finals for e in self.experiments)

    def lines(self) -> list[str]:
        """What will run and what it costs, for the console."""
        if not self.runs:
            # Nothing trains: said so, not as a cost whose every term is nil ("0 s, between 0 s and 0 s").
            experiments = plural(len(self.experiments), "experiment")
            return [f"cost: none: every run of the {experiments} has finished, so nothing trains"]
        trials = sum(e.trials for e in self.experiments)
        finals = sum(e.finals for e in self.experiments)
        s = self.sizes
        out = [
            f"cost: {len(self.experiments)} experiments: {trials} selection trials ({s[TRAIN]} train / {s[VAL]} val "
            f"images each) + {finals} final runs ({s[TRAIN_VAL]} train / {s[TEST]} test images each) = "
            f"{plural(self.runs, 'run')} still to train"
        ]
        for e in self.experiments:
            p = e.probe
            if p is None:
                out.append(f"  {e.experiment}: every run finished")
                continue
            out.append(
                f"  {e.experiment}: {e.trials} trials x {duration(e.trial_seconds)} + {e.finals} finals x "
                f"{duration(e.final_seconds)} ({plural(e.epochs, 'epoch')}; measured: build "
                f"{p.build_seconds:.1f} s, "
                f"{1000 * p.step_seconds:.2f} ms per training image at batch {p.batch}, {p.image_size} px, in "
                f"{p.precision})"
            )
        low, high = self.range()
        overhead = sum(
            (e.trials + e.finals) * (self.fixed_seconds + e.epochs * self.per_epoch_seconds) for e in self.experiments
        )
        share = 100 * overhead / self.seconds if self.seconds > 0 else 0.0
        out.append(
            f"estimated wall time on this machine ({self.device}): {duration(self.seconds)}, between "
            f"{duration(low)} and {duration(high)} by the timed steps' spread; {share:.0f} % of it is each run's "
            f"records, checks and loaders ({self.fixed_seconds:.1f} s per run + {self.per_epoch_seconds:.1f} s per "
            f"epoch, timed on a tiny real run); measuring took {duration(self.measure_seconds)}"
        )
        return out

    def range(self) -> tuple[float, float]:
        """The total with every experiment's timed terms (its steps, evaluation forwards and cached front) at its
        fastest and at its slowest timed step; each run's own costs, builds and decoding as they are.
        """
        low = high = 0.0
        for e in self.experiments:
            spread = e.probe.spread if e.probe is not None else 1.0
            overhead = (e.trials + e.finals) * (self.fixed_seconds + e.epochs * self.per_epoch_seconds)
            steady = overhead + e.untimed_seconds
            low += steady + (e.seconds - steady) / spread
            high += steady + (e.seconds - steady) * spread
        return low, high

    def write(self, output_dir: Path) -> None:
        """``estimate.json``: the estimate, kept for the report's comparison with the real time."""
        record = {
            "measured_at": self.measured_at,
            "device": self.device,
            "fixed_seconds_per_run": round(self.fixed_seconds, 2),
            "fixed_seconds_per_epoch": round(self.per_epoch_seconds, 2),
            "range_seconds": [round(x, 1) for x in self.range()],
            "measure_seconds": round(self.measure_seconds, 1),
            "seconds": round(self.seconds, 1),
            "runs": self.runs,
            "sizes": self.sizes,
            "experiments": [{**asdict(e), "seconds": round(e.seconds, 1)} for e in self.experiments],
        }
        output_dir.mkdir(parents=True, exist_ok=True)
        files.write_json(output_dir / ESTIMATE_FILE, {"version": ESTIMATE_VERSION, **record})


def record_measured(output_dir: Path, seconds: float, runs: int | None = None) -> None:
    """Add the suite's measured wall time to ``output_dir``'s ``estimate.json`` (written by :meth:`Estimate.write`).

    Args:
        output_dir: the results folder.
        seconds: the wall time of the sweep the estimate was made for.
        runs: the runs it trained, which may differ from the estimate's count: under ``require_learning`` the
            finals of a point set aside (did not learn) are trained again at the next point.

    """
    record = read_estimate(output_dir)
    if record is not None:
        measured = {"measured_seconds": round(seconds, 1)} | ({"measured_runs": runs} if runs is not None else {})
        files.write_json(Path(output_dir) / ESTIMATE_FILE, {**record, **measured})


def read_estimate(output_dir: Path) -> dict[str, Any] | None:
    """The ``estimate.json`` of a results folder, checked (the one reader of the file), or ``None`` when it has none.

    A record of before ``version`` existed reads as version 1.

    Raises:
        ValueError: the file is damaged, of a newer petl, or a field the report reads is missing or malformed (one
            line naming the file and what to do).

    """
    path = Path(output_dir) / ESTIMATE_FILE
    fix = "move it aside (choice.md then says no estimate was recorded)"
    try:
        record = files.read_json(path)
    except files.DamagedFileError as error:
        raise ValueError(f"{error}: {fix}") from None
    if record is None:
        return None
    try:
        files.check_version(path, record.get("version", 1), ESTIMATE_VERSION, "estimate")
    except files.NewerFileError as error:
        raise ValueError(f"{error}: report the folder with that petl, or {fix}") from None
    except files.DamagedFileError as error:
        raise ValueError(f"{error}: {fix}") from None
    wanted = {"seconds": "a non-negative number", "runs": "a count", "measured_at": "text", "device": "text"}
    if "measured_seconds" in record:
        wanted["measured_seconds"] = "a non-negative number"
    if "measured_runs" in record:
        wanted["measured_runs"] = "a count"
    for name, what in wanted.items():
        value = record.get(name)
        if what == "text":
            fits = isinstance(value, str)
        elif what == "a count":
            fits = type(value) is int and value >= 0
        else:
            fits = is_finite_number(value) and value >= 0
        if not fits:
            raise ValueError(f"{path}: field {name!r} is {reprlib.repr(value)}, not {what}: {fix}")
    return record


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def estimate(
    cells: Sequence[Cell],
    data: OwnData,
    compose: Callable[[list[str]], Any] | None = None,
    say: Callable[[str], None] = lambda line: None,
) -> Estimate:
    """Measure each experiment here and add up the cost of the cells' runs not finished yet.

    Args:
        cells: a searching suite's cells on the user's data (:func:`petl.bench.protocol.plan_cells`).
        data: the data (split sizes, decode time per image).
        compose: overrides -> run config (``petl.train.config.default_config`` unless given).
        say: told a line as each measurement starts (the console's progress: a backbone takes a while to build).

    """
    if compose is None:
        from petl.train.config import default_config as compose
    costs, device, fixed, tick = [], "cpu", None, time.perf_counter()
    per_epoch = 0.0
    for index, cell in enumerate(cells, start=1):
        trials = [t.run for t in cell.trials]
        finals = cell.finals({})  # the folders do not depend on the point chosen
        todo_trials, todo_finals = unfinished(cell)
        cfg = compose(list((trials or finals)[0].overrides))
        epochs = int(cfg.train.epochs)
        if not todo_trials + todo_finals:  # finished: nothing to measure
            costs.append(ExperimentCost(cell.experiment.name, 0, 0, 0.0, 0.0, epochs, None))
            continue
        say(f"measuring {cell.experiment.name} ({index}/{len(cells)}): building it, timing {TIMED_STEPS} steps")
        probe, device = measure(cfg, data)
        if fixed is None:
            say(f"timing two tiny real runs (1 and 2 epochs on {PROBE_IMAGES} images) for each run's own costs")
            fixed, per_epoch = fixed_seconds(list(finals[0].overrides), probe, data, compose)
        trial = fixed + epochs * per_epoch + run_seconds(probe, data, epochs, final=False)
        final = fixed + epochs * per_epoch + run_seconds(probe, data, epochs, final=True)
        untimed = [untimed_seconds(probe, data, is_final) for is_final in (False, True)]
        costs.append(
            ExperimentCost(cell.experiment.name, todo_trials, todo_finals, trial, final, epochs, probe, *untimed)
        )
    spent = time.perf_counter() - tick
    return Estimate(
        costs, dict(data.sizes), device, fixed_seconds=fixed or 0.0, per_epoch_seconds=per_epoch, measure_seconds=spent
    )


def unfinished(cell: Cell) -> tuple[int, int]:
    """How many selection trials and final runs of ``cell`` are not finished yet: what :func:`estimate` counts."""
    finals = cell.finals({})  # the folders do not depend on the point chosen
    return sum(not t.run.is_done() for t in cell.trials), sum(not run.is_done() for run in finals)


def run_seconds(probe: Probe, data: OwnData, epochs: int, final: bool, subset: int | None = None) -> float:
    """A run's modelled seconds (all but the fixed cost): a trial (train800, val each epoch) or a final run.

    ``subset`` cuts every split to that many images after decoding, as ``data.subset`` does.
    """
    s = {k: min(v, subset or v) for k, v in data.sizes.items()}
    train, val, test = (s[TRAIN_VAL], 0, s[TEST]) if final else (s[TRAIN], s[VAL], 0)
    return (
        untimed_seconds(probe, data, final)
        + (train + val + test) * probe.front_seconds
        + epochs * (train * probe.step_seconds + val * probe.eval_seconds)
        + test * probe.eval_seconds
    )


def untimed_seconds(probe: Probe, data: OwnData, final: bool) -> float:
    """Of :func:`run_seconds`, what no timed step measured: the build, and decoding the run's splits."""
    # A split is decoded whole, then cut (data.subset).
    decoded = data.sizes[TRAIN_VAL] + data.sizes[TEST] if final else data.sizes[TRAIN] + data.sizes[VAL]
    return probe.build_seconds + data.decode_seconds * decoded


def fixed_seconds(
    overrides: list[str], probe: Probe, data: OwnData, compose: Callable[[list[str]], Any]
) -> tuple[float, float]:
    """What a run costs besides the modelled terms: per run and per epoch, from two tiny real final runs.

    Runs of one and of two epochs are timed whole, less their modelled seconds; the difference is one more
    epoch's cost (its loaders started, its checkpoint written), the rest the run's own.  They go through the
    sweep (:func:`petl.bench.sweep.run_sweep`: the folder's checks, its lock, the config composed), as every
    run will.

    Args:
        overrides: a final run's overrides (``output_dir=`` last, replaced by a temporary folder).
        probe: that experiment's measurements (:func:`measure`).
        data: the data (decode time per image).
        compose: overrides -> run config.

    Returns:
        Seconds per run and seconds per epoch (each at least 0).

    Raises:
        ValueError: a tiny run was refused as bad input (one line, the last of its error log; petl-bench exits 2):
            the real runs would fail the same way.
        RunError: a tiny run could not start (its folder unwritable: a full disk) or failed otherwise (out of memory,
            a fault in the forward; the last line of its error log), the line saying why (exit 1).

    """
    one, two = (
        _probe_run(overrides, epochs, compose) - run_seconds(probe, data, epochs, final=True, subset=PROBE_IMAGES)
        for epochs in (1, 2)
    )
    per_epoch = max(0.0, two - one)
    return max(0.0, one - per_epoch), per_epoch


def _probe_run(overrides: list[str], epochs: int, compose: Callable[[list[str]], Any]) -> float:
    """Seconds of one real final run of ``epochs`` epochs on :data:`PROBE_IMAGES` images, in a temporary folder."""
    import tempfile

    from petl.bench.sweep import ERROR_FILE, PlannedRun, run_sweep

    with tempfile.TemporaryDirectory(prefix="petl-estimate-") as folder:
        run_dir = Path(folder) / "run"
        # train.epochs beside another data.epochs (the command line's, where the suite sets no train.epochs) is
        # refused, data.epochs then doing nothing: both are set.  A train.grad_accum above the batches 4 images hold,
        # and a train.warmup_frac that warms up none of their one or two steps, are refused too, and a run's own
        # costs (loaders, records, checkpoints) depend on neither.
        extra = [f"data.epochs={epochs}", f"train.epochs={epochs}", f"data.subset={PROBE_IMAGES}"]
        extra += ["train.grad_accum=1", "train.warmup_frac=0", "train.progress=false"]
        run = PlannedRun("probe", "probe", 0, run_dir, (*overrides[:-1], *extra, f"output_dir={run_dir}"))
        tick = time.perf_counter()
        # Its "training ..." line and its warnings (a 4-image run takes few steps) are not about the user's runs.
        logging.disable(logging.WARNING)
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                summary = run_sweep([run], compose_fn=compose, progress=False, users_runs=False)
        finally:
            logging.disable(logging.NOTSET)
        whole = time.perf_counter() - tick
        if summary.failed:
            # Its traceback's last line; a run that could not start (its folder unwritable: a full disk) wrote no
            # error log, and the sweep's own line says why.  The folder goes with the temporary directory.
            log = run_dir / ERROR_FILE
            failed = f"a {epochs}-epoch run on {PROBE_IMAGES} images to measure the cost failed"
            if not log.is_file():  # not the config's fault: a run that cannot complete (exit 1)
                raise RunError(f"{failed}: {summary.failed[0].removeprefix(f'{run.label}: ')}")
            error = log.read_text(errors="replace").strip().splitlines()[-1:]
            line = f"{failed}: {' '.join(error) or summary.failed[0]}"
            # The status petl-run would have exited with: bad input 2, a run that could not complete (out of
            # memory, a fault in the forward) 1.
            if summary.failed_status.get(run.label, RUN_ERROR) == USAGE_ERROR:
                raise ValueError(line)
            raise RunError(line)
    return whole


def measure(cfg: Any, data: OwnData, steps: int = TIMED_STEPS) -> tuple[Probe, str]:
    """Build one run's model and time its training steps and evaluation forwards on random images.

    On the run's device and in its precision: an Accelerator made as :func:`petl.train.build.make_accelerator` makes
    the run's (``train.precision`` resolved the same way, a CPU without bf16 instructions falling back to fp32 as the
    run does) prepares the model and optimizer, so the steps and evaluation forwards run under the run's autocast,
    and the cached front under ``accelerator.autocast()`` as :func:`petl.train.cache.cache_split` computes it.

    Raises:
        ConfigError: ``train.precision=tf32`` or ``fp16`` off a CUDA GPU, which the run refuses
            (:func:`petl.train.build.run_precision`): nothing is built or timed.

    """
    from accelerate.state import AcceleratorState, GradientState

    from petl.train import build

    device = build.run_device_type()
    precision, _ = build.run_precision(cfg.train.precision, device)  # the run warns of a fallback; said below
    try:
        # Inside: accelerate sets its process-wide precision before it may refuse it (bf16 on a GPU without it).
        accelerator = build.precision_accelerator(precision)
        # cudnn.benchmark and TF32 as the runner sets them (one function): the run's kernels are the ones timed.
        with build.cuda_switches(precision, cfg.train.deterministic, device):
            return _measure(cfg, data, steps, accelerator), device
    finally:
        # Its precision is process-wide state in accelerate: a later Accelerator() made without one would inherit it.
        AcceleratorState._reset_state()
        GradientState._reset_state()


def _measure(cfg: Any, data: OwnData, steps: int, accelerator: Any) -> Probe:
    """:func:`measure`'s timings, under ``accelerator`` (its device, precision and autocast)."""
    import torch
    from omegaconf import OmegaConf

    import petl
    from petl import data as petl_data
    from petl.train import build, cache, engine, readers
    from petl.train.runner import precision_label

    device = accelerator.device.type
    tick = time.perf_counter()
    model = build.create_backbone(cfg)
    method_cfg = petl.make_config(cfg.method.name, num_classes=len(data.classes), **readers.method_options(cfg))
    build.apply_method(cfg, model, method_cfg)
    if cfg.train.grad_checkpointing:
        # As the run turns it on: each step's backward recomputes every block's forward (a third more per step).
        engine.enable_grad_checkpointing(model)
    model.to(accelerator.device)
    build_seconds = time.perf_counter() - tick
    size = readers.image_size(model)
    batch = max(1, min(int(cfg.train.batch_size), data.sizes[TRAIN]))
    images = torch.randn(batch, 3, size, size, device=accelerator.device)
    labels = torch.randint(0, len(data.classes), (batch,), device=accelerator.device)
    settings = OmegaConf.to_object(cfg.train)
    # The run caches the frozen front under the same conditions (cache.decide), its size limit too: a final run's
    # training images (a trial's train and val images are as many) over it train uncached, each step through the
    # whole backbone.  Sized in the dtype the run's autocast leaves the cached tensors in (a Swin's in bf16 under
    # CPU autocast).
    plan = None
    if cfg.train.cache_features:
        backbone_trains = engine.backbone_mode(model, settings) == "train"
        sizes = [data.sizes[TRAIN_VAL]]
        augmented = petl_data.get_info(cfg.data.name).crops(cfg.data.augment)
        plan, _ = cache.decide(
            model, backbone_trains=backbone_trains, augmented=augmented, sizes=sizes, autocast=accelerator.autocast
        )
    trainee: torch.nn.Module = model
    front_seconds = 0.0
    if plan is not None:
        trainee = cache.CachedTail(model, plan)
        model.eval()

        def front() -> torch.Tensor:
            with torch.no_grad(), accelerator.autocast():  # as cache_split runs it
                return trainee.front(images)

        front_seconds = _median(front, steps, device) / batch
        images = front()
    optimizer, _ = engine.build_optimizer(trainee, settings, steps_per_epoch=1)
    # Prepared as the run prepares them: the forward under the run's autocast, an fp16 step through its scaler.
    trainee, optimizer = accelerator.prepare(trainee, optimizer)
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=settings.label_smoothing)

    def step() -> None:
        loss = loss_fn(trainee(images), labels)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    engine.set_train_mode(trainee, engine.backbone_mode(model, settings))
    step_times = _times(step, steps, device)
    step_seconds = statistics.median(step_times) / batch
    trainee.eval()
    with torch.no_grad():
        eval_seconds = _median(lambda: trainee(images), steps, device) / batch
    spread = max(step_times) / max(1e-9, min(step_times))
    said = precision_label(accelerator)
    return Probe(build_seconds, step_seconds, eval_seconds, front_seconds, batch, size, spread, said)


def _median(fn: Callable[[], Any], steps: int, device: str) -> float:
    """Median seconds of ``steps`` calls after :data:`WARMUP_STEPS` untimed ones."""
    times = _times(fn, steps, device)
    return statistics.median(times) if times else math.nan


def _times(fn: Callable[[], Any], steps: int, device: str) -> list[float]:
    """Seconds of each of ``steps`` calls after :data:`WARMUP_STEPS` untimed ones."""
    import torch

    times = []
    for index in range(WARMUP_STEPS + steps):
        tick = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        if index >= WARMUP_STEPS:
            times.append(time.perf_counter() - tick)
    return times
