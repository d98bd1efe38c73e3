"""petl-pretrain: formula-driven pretraining of petl's backbones on FractalDB-style images.

No pretrained weights can be downloaded where petl must run offline, so petl makes its own:
a small ViT (or Swin) trained to tell apart random IFS fractal classes (Kataoka et al.; Nakashima et al.
showed ViTs pretrained this way transfer).  It uses the same engine as petl-run, then writes
safetensors weights (without the pretraining head) and a JSON provenance record.

    petl-pretrain --classes 300 --instances 100 --epochs 8                 # writes runs/pretrain/
    petl-pretrain --classes 200 --instances 150 --epochs 7 --out petl/weights --overwrite
    petl-pretrain --model swin_fractal_tiny_patch2_window4_32              # the Swin instead of the ViT

Without ``--out`` the files go to ``runs/pretrain/`` under the current folder, never into the installed
package; files already there are replaced only with ``--overwrite``.  After each epoch a checkpoint is
saved there: the same command run again continues from it (other options are refused, naming the
difference).  While it runs, a pretraining holds a lock in ``--out`` for its ``--model``
(``.MODEL.fractaldb.lock``, with its pid): a second pretraining of the same model into the same folder exits
with status 1, naming the holder; other models pretrain into the folder side by side; the lock is released
however the command ends, and one left by a dead process (kill -9) is taken over.  A later petl-run trains on
the weights with ``model.checkpoint=`` (and ``model=`` for the Swin):

    petl-run method=lora model.checkpoint=runs/pretrain/vit_fractal_tiny_patch4_32.fractaldb.safetensors

Bad input (a value out of range, --precision fp16 without a CUDA GPU, an --out that cannot be written, a damaged
checkpoint) exits with status 2, a failure with 1, Ctrl-C with 130, SIGTERM (a job's time limit) with 143, each as
one line naming the value or file and before any image is generated; ``--debug`` shows the traceback.  It runs as one
process: a launch of several (``accelerate launch``, ``torchrun``) is bad input, said by its first process.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from petl.cli.args import CommandLineError, Parser, boolean, entry_point, exit_statuses, plain
from petl.utils.distributed import is_main_process
from petl.utils.errors import RUN_ERROR
from petl.utils.text import shown

PROG = "petl-pretrain"
DEFAULT_OUT = Path("runs/pretrain")
# Given as None by the parser when --warmup-frac is not: only a fraction the user gave is checked to warm up (the
# default's 0.05 of the few steps of a small pretraining warms up none, and such pretrainings are not refused).
DEFAULT_WARMUP_FRAC = 0.05
# The checkpoint this pretraining keeps after each epoch, once the command line is read: Ctrl-C's line says
# whether there is one to continue from (_interrupted_line).
_partial: Path | None = None


@entry_point(PROG)
def main(argv: list[str] | None = None) -> None:
    """Command-line entry point of ``petl-pretrain``: errors are one line and an exit status (module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or "debug=true" in (a.lower() for a in argv)
    failure = (ValueError, OSError, RuntimeError)
    global _partial
    _partial = None
    # One process of a launch speaks (pretrain refuses several, each process alike).
    quiet = not is_main_process()
    with exit_statuses(PROG, failure=failure, interrupted=_interrupted_line, debug=debug, quiet=quiet):
        _main([a for a in argv if a != "--debug"])


def _interrupted_line() -> str:
    """Ctrl-C's line: whether an epoch is kept to continue from.

    The checkpoint of each finished epoch stays in --out (:func:`petl.train.pretrain.partial_file`) and the same
    command continues from it ("nothing was written" sent users to start over); before the first epoch finished (the
    fractals still being generated, say) there is none, and the same command starts over.
    """
    if _partial is not None and not _partial.is_file():
        return (
            "error: interrupted before the first epoch finished, so no epoch is kept and no weights written: the same "
            "command starts the pretraining over"
        )
    return "error: interrupted; no weights written yet: the same command continues from the last finished epoch"


def build_parser() -> Parser:
    """The command's parser: every option is a flag (``--epochs 8``) or, as in every petl command, ``epochs=8``."""
    parser = Parser(
        prog=PROG,
        description=plain(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Each --name VALUE may also be written name=VALUE (--batch-size 64 as batch_size=64), and each switch "
        "name=true or name=false (--overwrite as overwrite=true), anywhere.",
    )
    parser.add_argument(
        "--model",
        default="vit_fractal_tiny_patch4_32",
        help="timm architecture to pretrain, taking 32 px images (default: vit_fractal_tiny_patch4_32)",
    )
    # Each default said: without them the help gave no idea of what a bare petl-pretrain trains, or for how long.
    parser.add_argument("--classes", type=int, default=300, help="number of fractal classes, 2 or more (default: 300)")
    parser.add_argument("--instances", type=int, default=100, help="training images per class (default: 100)")
    parser.add_argument("--epochs", type=int, default=8, help="passes over the images (default: 8)")
    parser.add_argument("--batch-size", type=int, default=128, help="images per step (default: 128)")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate of AdamW (default: 0.001)")
    parser.add_argument("--weight-decay", type=float, default=0.05, help="AdamW weight decay (default: 0.05)")
    parser.add_argument(
        "--warmup-frac",
        type=float,
        default=None,
        help="share of the steps in linear warm-up; one given must warm up two steps or more, or be 0 "
        f"(default: {DEFAULT_WARMUP_FRAC})",
    )
    parser.add_argument(
        "--label-smoothing", type=float, default=0.1, help="cross-entropy label smoothing (default: 0.1)"
    )
    parser.add_argument(
        "--precision",
        default="no",
        choices=["no", "bf16", "fp16"],
        help="mixed precision: bf16, or fp16 on a CUDA GPU only (default: no, fp32)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the fractals, the init and the order (default: 0)")
    parser.add_argument(
        "--weights-dtype",
        default="float32",
        choices=["float32", "float16"],
        help="type of the written weights (float16: half the file; loading casts them back) (default: float32)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help=f"output folder (default: {DEFAULT_OUT} under the current folder; the shipped default backbone in "
        "petl/weights changes only with --out pointing there and --overwrite)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace weights already in --out")
    parser.add_argument("--no-progress", action="store_true", help="hide the per-epoch progress bar")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    return parser


def as_flags(argv: Sequence[str], parser: argparse.ArgumentParser) -> list[str]:
    """``name=VALUE`` words as ``--name VALUE`` (the grammar of the other petl commands); others unchanged.

    A switch (``--overwrite``) is written ``overwrite=true`` or ``overwrite=false``, as petl-predict's and
    petl-export's ``overwrite=true``: it became ``--overwrite true``, refused as "unrecognized arguments: true".

    Raises:
        CommandLineError: a switch given another value than true or false.

    """
    flags = {option: action for action in parser._actions for option in action.option_strings}
    out = []
    for word in argv:
        name, sep, value = word.partition("=")
        flag = "--" + name.replace("_", "-")
        if not (sep and not word.startswith("-") and flag in flags):
            out.append(word)
        elif flags[flag].nargs == 0:  # a switch: no value follows it
            try:
                out += [flag] if boolean(value) else []
            except ValueError:
                raise CommandLineError(f"{word}: expected true or false ({flag} alone means true)") from None
        else:
            out += [flag, value]
    return out


def _main(argv: list[str]) -> None:
    parser = build_parser()
    args = parser.parse_args(as_flags(argv, parser))
    import timm

    from petl.data.fractaldb import FractalConfig
    from petl.train.engine import TrainSettings, refuse_idle_warmup
    from petl.train.pretrain import InUseError, partial_file, pretrain
    from petl.utils.random import MAX_SEED

    global _partial
    _partial = partial_file(args.out, args.model)

    # --classes is checked on its own: its least is 2, which "--classes must be >= 1" for 0 did not say.
    for name in ("instances", "epochs", "batch_size"):
        if getattr(args, name) < 1:
            raise CommandLineError(f"--{name.replace('_', '-')} must be >= 1")
    if args.classes < 2:
        # One class: every image's loss is 0 (one logit), nothing would train and the weights written would be the
        # random initialisation, at "100% top-1".
        why = " (one class has nothing to tell apart)" if args.classes == 1 else ""
        raise CommandLineError(f"--classes {args.classes}: give 2 or more{why}")
    if args.classes * args.instances < args.batch_size:
        # Incomplete batches are dropped, so no step would run and untrained weights would be written.
        raise CommandLineError(
            f"--batch-size {args.batch_size} is more than the {args.classes * args.instances} training images "
            f"({args.classes} classes x {args.instances} instances): no step would train; give a smaller "
            "--batch-size or more --classes / --instances"
        )
    if not 0 <= args.seed <= MAX_SEED:  # what numpy and torch take: -1 failed after the model was built, exit 1
        raise CommandLineError(f"--seed {args.seed} is out of range: allowed [0, {MAX_SEED}]")
    if not timm.is_model(args.model):
        raise CommandLineError(f"--model {args.model} is not a timm architecture (petl's own: petl.backbones.models)")
    warmup_frac = DEFAULT_WARMUP_FRAC if args.warmup_frac is None else args.warmup_frac
    try:
        settings = TrainSettings(
            epochs=args.epochs,
            lr=args.lr,
            weight_decay=args.weight_decay,
            warmup_frac=warmup_frac,
            label_smoothing=args.label_smoothing,
            grad_clip=1.0,
            progress=not args.no_progress,
        )
    except ValueError as error:  # named as petl-run's option (train.lr=nan): said as this command's (--lr nan)
        raise CommandLineError(
            re.sub(r"^train\.(\w+)=", lambda m: "--" + m[1].replace("_", "-") + " ", str(error))
        ) from None
    if args.warmup_frac is not None:  # petl-run's rule (the same scheduler), on a fraction given only: see above
        steps_per_epoch = args.classes * args.instances // args.batch_size  # one process; the last batch dropped
        try:
            refuse_idle_warmup(args.warmup_frac, args.epochs, steps_per_epoch, option="--warmup-frac ")
        except ValueError as error:
            raise CommandLineError(str(error)) from None
    fractal = FractalConfig(num_classes=args.classes, instances=args.instances, seed=args.seed)
    try:
        # Weights already in --out are refused (overwrite=False) before hours of training, under the lock.
        record = pretrain(
            fractal,
            settings,
            args.batch_size,
            precision=args.precision,
            out_dir=args.out,
            seed=args.seed,
            arch=args.model,
            command=shlex.join([PROG, *argv]),
            weights_dtype=args.weights_dtype,
            overwrite=args.overwrite,
        )
    except InUseError as error:  # another pretraining of --model into --out: said as petl-run says it, exit 1
        print(f"{PROG}: error: {shown(error)}", file=sys.stderr)
        raise SystemExit(RUN_ERROR) from None
    print(
        f"pretrained {args.model} on {args.classes} fractal classes: {record['images_seen']} images seen, "
        f"val top-1 {record['final_val_top1']:.1f}% in {record['wall_seconds']:.0f} s -> {args.out}"
    )
