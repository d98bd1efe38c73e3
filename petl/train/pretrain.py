"""petl-pretrain: formula-driven pretraining of petl's default backbone on FractalDB-style images.

No pretrained ViT weights can be downloaded where petl must run offline, so petl makes its own:
a small ViT trained to tell apart random IFS fractal classes (Kataoka et al.; Nakashima et al.
showed ViTs pretrained this way transfer).  It uses the same engine as petl-run, then writes
safetensors weights (without the pretraining head) and a JSON provenance record.

    petl-pretrain --classes 300 --instances 100 --epochs 8                 # writes runs/pretrain/
    petl-pretrain --classes 200 --instances 150 --epochs 7 --out petl/weights --overwrite

Without ``--out`` the files go to ``runs/pretrain/`` under the current folder, never into the installed
package; files already there are replaced only with ``--overwrite``.  Bad input exits with status 2,
a failure with 1, Ctrl-C with 130, each as one line; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

import timm
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

from petl.backbones import models
from petl.data.fractaldb import FractalConfig, generate, search_systems, to_model_input
from petl.errors import INTERRUPTED, RUN_ERROR, USAGE_ERROR
from petl.store import files as records
from petl.train.engine import TrainSettings, build_optimizer, fit

ARCH = "vit_fractal_tiny_patch4_32"
DEFAULT_OUT = Path("runs/pretrain")
PROG = "petl-pretrain"


def output_files(out_dir: Path) -> tuple[Path, Path]:
    """The weights and provenance files :func:`pretrain` writes into ``out_dir``."""
    return out_dir / f"{ARCH}.fractaldb.safetensors", out_dir / f"{ARCH}.fractaldb.json"


def _normalised(dataset: TensorDataset) -> TensorDataset:
    images, labels = dataset.tensors
    return TensorDataset(to_model_input(images, models.FRACTAL_MEAN, models.FRACTAL_STD), labels)


def pretrain(
    fractal: FractalConfig,
    settings: TrainSettings,
    batch_size: int = 128,
    val_instances: int = 5,
    drop_path: float = 0.1,
    precision: str = "no",
    out_dir: Path | None = None,
    seed: int = 0,
) -> dict:
    """Pretrain the default ViT on generated fractals and (optionally) write weights + provenance.

    Args:
        fractal: the FractalDB settings (classes, instances, seed...).
        settings: optimisation settings for the shared engine.
        batch_size: images per step.
        val_instances: fresh instances per class (another seed) to measure pretraining accuracy.
        drop_path: stochastic depth rate during pretraining.
        precision: accelerate mixed precision (``no``, ``bf16``, ``fp16``).
        out_dir: where to write ``<arch>.fractaldb.safetensors`` and ``.json``; None writes nothing.
        seed: seed of the model init and data order.

    Returns:
        The provenance record.
    """
    start = time.time()
    set_seed(seed)
    accelerator = Accelerator(mixed_precision=precision)
    systems = search_systems(fractal)
    train_set = _normalised(generate(fractal, systems))
    val_set = _normalised(
        generate(dataclasses.replace(fractal, instances=val_instances), systems, seed=fractal.seed + 10_000)
    )
    generation_seconds = time.time() - start

    model = timm.create_model(ARCH, num_classes=fractal.num_classes, drop_path_rate=drop_path)
    generator = torch.Generator().manual_seed(seed)
    train_loader = DataLoader(train_set, batch_size=batch_size, shuffle=True, drop_last=True, generator=generator)
    val_loader = DataLoader(val_set, batch_size=256)
    optimizer, scheduler = build_optimizer(model, settings, len(train_loader))
    model, optimizer, train_loader, val_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, val_loader, scheduler
    )

    def log(epoch: int, metrics: dict) -> None:
        accelerator.print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()}))

    history = fit(model, train_loader, {"val": val_loader}, settings, accelerator, optimizer, scheduler, 0, log)
    model = accelerator.unwrap_model(model)
    record = {
        "arch": ARCH,
        "fractal_config": dataclasses.asdict(fractal),
        "train_settings": dataclasses.asdict(settings),
        "batch_size": batch_size,
        "drop_path": drop_path,
        "precision": precision,
        "seed": seed,
        "images_seen": int(sum(h["images"] for h in history)),
        "final_train_top1": history[-1]["train_top1"],
        "final_val_top1": history[-1]["val_top1"],
        "val_note": f"{val_instances} fresh instances per class drawn with seed {fractal.seed + 10_000}",
        "history": history,
        "generation_seconds": round(generation_seconds, 1),
        "wall_seconds": round(time.time() - start, 1),
        "machine": f"{platform.machine()} {platform.processor() or ''} {torch.get_num_threads()} threads".strip(),
        # The same version and commit lookup as every petl-run record (git_commit, git_dirty).
        "versions": records.versions(),
        **records.git_commit(),
    }
    if out_dir is not None:
        weights, provenance = output_files(out_dir)
        # The pretraining head is task-specific: downstream runs reset it, so it is not shipped.
        state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items() if not k.startswith("head.")}
        records.write_atomic(weights, lambda tmp: save_file(state, str(tmp), metadata={"arch": ARCH}))
        records.write_text(provenance, json.dumps(record, indent=2) + "\n")
    return record


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point of ``petl-pretrain``: errors are one line and an exit status (module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        _main([a for a in argv if a != "--debug"])
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{PROG}: error: interrupted; nothing was written", file=sys.stderr)
        raise SystemExit(INTERRUPTED) from None
    except (ValueError, OSError, RuntimeError) as error:
        if debug:
            raise
        print(f"{PROG}: error: {type(error).__name__}: {error} (--debug shows the traceback)", file=sys.stderr)
        raise SystemExit(RUN_ERROR) from None


def _main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--classes", type=int, default=300, help="number of fractal classes")
    parser.add_argument("--instances", type=int, default=100, help="training images per class")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--warmup-frac", type=float, default=0.05)
    parser.add_argument("--label-smoothing", type=float, default=0.1)
    parser.add_argument("--precision", default="no", choices=["no", "bf16", "fp16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help=f"output folder (default: {DEFAULT_OUT} under the current folder; the shipped default backbone in "
        f"{models.WEIGHTS_DIR} changes only with --out pointing there and --overwrite)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace weights already in --out")
    parser.add_argument("--no-progress", action="store_true", help="hide the per-epoch progress bar")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    args = parser.parse_args(argv)
    for name in ("classes", "instances", "epochs", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    existing = [p for p in output_files(args.out) if p.exists()]
    if existing and not args.overwrite:
        # Checked before hours of training: a finished pretraining is never replaced without asking.
        print(
            f"{PROG}: error: {existing[0]} exists (an earlier pretraining): pass --overwrite to replace it, "
            "or choose another --out",
            file=sys.stderr,
        )
        raise SystemExit(USAGE_ERROR)
    fractal = FractalConfig(num_classes=args.classes, instances=args.instances, seed=args.seed)
    settings = TrainSettings(
        epochs=args.epochs,
        lr=args.lr,
        weight_decay=args.weight_decay,
        warmup_frac=args.warmup_frac,
        label_smoothing=args.label_smoothing,
        grad_clip=1.0,
        progress=not args.no_progress,
    )
    record = pretrain(fractal, settings, args.batch_size, precision=args.precision, out_dir=args.out, seed=args.seed)
    print(
        f"pretrained {ARCH} on {args.classes} fractal classes: {record['images_seen']} images seen, "
        f"val top-1 {record['final_val_top1']:.1f}% in {record['wall_seconds']:.0f} s -> {args.out}"
    )


if __name__ == "__main__":
    main()
