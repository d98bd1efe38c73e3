r"""petl-predict: a trained run's labels for new images, or its accuracy on a labelled split.

    petl-predict RUN_DIR photo.png more_photos/ list.txt            # top-5 labels per image, on screen
    petl-predict RUN_DIR photos/ out=preds.csv top_k=3 --merge       # also as CSV; LoRA & co. merged first
    petl-predict RUN_DIR data=folder data.root=PATH split=test confusion=confusion.png
    petl-predict RUN_A RUN_B RUN_C photos/ out=preds.csv          # several runs: one pass if one backbone

Images are files, folders (searched recursively for image files) or list files (``.txt``: one path per
line, relative to the list's folder).  They are decoded (PNG, JPEG, WebP, BMP, GIF, TIFF or PPM, by
their content, as petl-run and petl-serve read them; an animation's first frame), preprocessed as the run evaluated
(``model.json``), and classified in batches with a progress bar (where stderr is no terminal, a few lines
on it say how many are done).  With ``data=`` the images and labels
come from a dataset instead (``petl-run``'s ``data`` options), and the accuracy and the confusion matrix
(on screen; as a PNG with ``confusion=PATH``) are reported (new labelled images need only
``PATH/test/<class>/``, no ``train/``: their class folders are matched to the run's classes by name); the
options marked "with data=" are refused without it, and ``out=`` and ``top_k=`` with it (the accuracy is
top-1), ``overwrite=`` without ``out=`` or ``confusion=``.  Several run folders may be given (their rows carry
the run's folder): runs trained on one backbone (same timm name, pretrained weights or checkpoint, and preprocessing in
``model.json``) are served together by ``petl.MultiTask`` in one pass over the images, each image
decoded once and its rows for every run in the same batches; ``batch_size`` then counts image x run
rows.  A run on another backbone, or whose method cannot share one (Partial-k, full fine-tuning),
predicts with its own model after a one-line note; with ``--merge`` (a note says so) or ``data=`` every
run uses its own model.

``precision`` means what petl-run's ``train.precision`` does: the forward runs under it (bf16 autocast, TF32) on a
GPU, the weights stay fp32 (``--merge`` merges in fp32) and probabilities are computed in fp32; on a CPU ``auto``
predicts exactly as strict fp32, and ``tf32``, which acts on a GPU only, is refused there as petl-run refuses it.
A line on stderr says the device and precision (not with ``--quiet``).

``out=`` writes every prediction, in the format its suffix names: ``.csv`` (text cells that would start
a spreadsheet formula get a ``'``), ``.json`` (one list) or ``.jsonl`` (one object per line); the file is
written whole or not at all (a full disk leaves an earlier file as it was).  File names that are not
UTF-8 are written with their undecodable bytes as ``\xNN`` (:mod:`petl.utils.text`).  An existing ``out=`` or
``confusion=`` file is refused in one line naming it; ``overwrite=true`` replaces it.  Either inside a run
folder (one holding ``model.json``, ``trainable.safetensors``, ``result.json`` or ``checkpoint.pt``) is
refused even with ``overwrite=true``: a run's files are never replaced by a prediction.  Whether a file can be
written where ``out=`` and ``confusion=`` name (a read-only folder, ``/proc``) is checked before predicting.

Exit status (as every petl command): 2 for bad input (a run folder without weights or unfinished, a missing image,
an unreadable image, an unknown option or ``out=`` suffix, out= or confusion= inside a run folder or where no file
can be written, a file in the way without overwrite=true, a precision not listed or tf32 without a GPU), 1 when the
prediction cannot complete (a full disk...), 130 on Ctrl-C, 143 on SIGTERM (nothing half-written is left).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from petl.cli.args import CommandLineError, Key, boolean, entry_point, exit_statuses, parse, parser, split_items

PROG = "petl-predict"
# The key=value options and their types; data.* as petl-run reads them.
KEYS = (
    Key("out", "write every prediction to a .csv, .json or .jsonl file"),
    Key("top_k", "labels per image (not with data=: its accuracy is top-1)", int, 5),
    Key("batch_size", "images per batch (image x run rows when runs are served together)", int, 64),
    Key("split", "with data=: the split to evaluate", str, "test"),
    Key("confusion", "with data=: draw the confusion matrix into this .png"),
    Key("data", "evaluate on a dataset (folder, hf, ...) instead of images"),
    Key("data.root", "with data=: its folder"),
    Key("data.image_column", "with data=hf: the image column"),
    Key("data.label_column", "with data=hf: the label column"),
    Key("overwrite", "true: replace an existing out= or confusion= file", boolean),
    Key(
        "precision",
        "auto (bf16 autocast and TF32 on a CUDA GPU with native bf16, fp32 elsewhere), no (strict fp32), tf32, bf16",
        str,
        "auto",
    ),
)
USAGE = f"{PROG} RUN_DIR [RUN_DIR ...] (IMAGES... | data=NAME data.root=PATH [split=test]) [key=value ...] [flags]"


def build_parser():  # noqa: ANN201  (argparse is imported by petl.cli.args)
    """The command's parser: its flags; ``--help`` lists them and :data:`KEYS`."""
    made = parser(PROG, __doc__, USAGE, KEYS)
    made.add_argument("--merge", action="store_true", help="fold mergeable methods (LoRA...) in first")
    made.add_argument("--quiet", action="store_true", help="no progress bar and no table (needs out= or data=)")
    return made


@entry_point(PROG)
def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``petl-predict``: parse (``--help`` answers here), then predict (torch loads here)."""
    with exit_statuses(PROG):  # a bad flag too: one line, exit 2
        args = parse(build_parser(), sys.argv[1:] if argv is None else argv)
        positional, options = split_items(args.words, KEYS, PROG, paths_first=True)
        if args.quiet and "out" not in options and "data" not in options:
            # No table and no file: the predictions would go nowhere.
            raise CommandLineError("--quiet without out= shows and writes nothing: add out=FILE.csv or drop --quiet")
        if "data" in options and "out" in options:
            raise CommandLineError(
                "out= writes the predictions for images; with data= it would write nothing: drop out="
            )
        if "data" in options and "top_k" in options:
            raise CommandLineError(
                f"top_k={options['top_k']} ranks the labels of each image; with data= the accuracy is top-1: "
                "drop top_k="
            )
        if "overwrite" in options and "out" not in options and "confusion" not in options:
            raise CommandLineError(
                "overwrite= replaces an out= or confusion= file, and neither is given: add one, or drop overwrite="
            )
        idle = [key.name for key in KEYS if key.help.startswith("with data") and key.name in options]
        if idle and "data" not in options:
            raise CommandLineError(f"{idle[0]}= acts only with data=: add data=NAME data.root=PATH, or drop {idle[0]}=")
        from petl.deploy.predict import run_command

        status = run_command(positional, options, merge=args.merge, quiet=args.quiet)
    raise SystemExit(status)


if __name__ == "__main__":
    main()
