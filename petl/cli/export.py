"""petl-export: a trained run as a plain timm model, for stacks that know nothing of petl.

    petl-export RUN_DIR out=exported             # a folder: timm.create_model("local-dir:exported", pretrained=True)
    petl-export RUN_DIR out=model.safetensors    # timm.create_model(name, num_classes=K, checkpoint_path=..., **kwargs)
    petl-export RUN_DIR out=model.onnx           # ONNX (torch.onnx.export), checked with onnxruntime

The run's method is merged into the backbone and its wrappers removed (``petl.unload(model)``,
peft's ``merge_and_unload``), so what is written is the timm architecture with other weights, named as timm itself
names it (petl's own backbones translated by :data:`petl.backbones.models.TIMM_NATIVE`), so that it loads where
petl is not installed.  A folder (``out=`` without a suffix) is timm's own format for a model with its
configuration, the one ``huggingface_hub`` uploads: ``config.json`` (``architecture``, ``model_args``
with ``img_size``, ``num_classes``, ``pretrained_cfg`` with the preprocessing and ``label_names``) and
``model.safetensors``.  A single file's metadata holds the same: the timm name and arguments, the class
names, the preprocessing (input size, mean/std, interpolation, crop) and the dataset, as strings (safetensors
metadata; ONNX ``metadata_props``): ``timm_kwargs``, ``class_names`` and ``preprocess`` hold JSON, ``num_classes``
a number, ``timm_model``, ``method``, ``dataset`` and ``format`` plain text (not JSON: no quotes).
An ONNX file needs the onnx package (``pip install onnx``; petl does not install it) and is checked against
the merged model's logits with onnxruntime where it is installed (a note on stderr where not); a model torch's
ONNX exporter cannot trace (timm's EVA, NaFlexVit) fails in one line:
export a folder or ``.safetensors`` for it.  A model whose weights pass 2 GiB (fp32 ViT-H/14 and larger; one ONNX
file cannot hold more) is written as two files: ``FILE.onnx`` and its weights ``FILE.onnx.data``, which the
``.onnx`` names; keep them together in one folder (onnx.load and onnxruntime read the weights from beside the
``.onnx``).  An ONNX export is written in a hidden folder beside it (``.FILE.onnx.*.tmp``) and moved in once
checked; a later export removes such a folder left by an export killed (kill -9), and names in a note one it did
not make, for you to delete; it removes the hidden temporary file (``.NAME.XXXXXXXX.tmp``, a minute old, no writer's)
a killed export left beside a ``.safetensors`` file or a folder's files too.  ``out=`` inside a run folder
(this run's or another's) is refused: an export never replaces a run's files.  An existing file (for
``FILE.onnx``, ``FILE.onnx.data`` too), or a folder already holding ``config.json`` or ``model.safetensors``, is
refused in one line naming it; ``overwrite=true`` replaces it (a smaller model's export
removes the old ``FILE.onnx.data``).
Methods whose modules cannot fold into the backbone (adapters, prompts, an MLP head) are refused for a folder
or ``.safetensors`` in one line saying what to use instead: ``out=FILE.onnx``, which writes the model as petl runs
it (its modules in the graph; metadata ``method`` says ``not merged``), checked as any ONNX export is, or
``petl-predict`` / ``petl.load_run``.  A graph torch's exporter cannot trace, or one onnxruntime cannot run or runs
wrong at another batch size, fails in one line saying which, exit 1; which graphs fail depends on the method and the
backbone (today HST, SCT and SNF on a ViT, and VPT on BEiT and the relative-position ViTs).

Exit status (as every petl command): 2 for bad input (no weights, a model.json petl cannot build, a method that
cannot be unloaded, an unknown format, out= inside a run folder or where nothing can be written, files in the way
without overwrite=true), 1 when the export fails (the onnx package missing for a .onnx file, a full disk), 130 on
Ctrl-C and 143 on SIGTERM (nothing half-written is left).
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence

from petl.cli.args import CommandLineError, Key, boolean, entry_point, exit_statuses, parse, parser, split_items

PROG = "petl-export"
KEYS = (
    Key("out", "FOLDER (timm's local-dir format), FILE.safetensors or FILE.onnx (required)"),
    Key(
        "overwrite",
        "true: replace an existing out= file (or the folder's config.json, model.safetensors; FILE.onnx.data)",
        boolean,
    ),
)
USAGE = f"{PROG} RUN_DIR out=FOLDER|FILE.safetensors|FILE.onnx [overwrite=true]"


def build_parser():  # noqa: ANN201  (argparse is imported by petl.cli.args)
    """The command's parser; ``--help`` lists :data:`KEYS`."""
    return parser(PROG, __doc__, USAGE, KEYS)


@entry_point(PROG)
def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``petl-export``: parse (``--help`` answers here), then export (torch loads here)."""
    with exit_statuses(PROG, failure=()):  # a bad flag too: one line, exit 2
        args = parse(build_parser(), sys.argv[1:] if argv is None else argv)
        # paths_first: a run folder named by its options (lr=0.001), given from the folder above it, is the run, not
        # an unknown option 'lr' (as petl-predict and petl-serve read it).
        positional, options = split_items(args.words, KEYS, PROG, paths_first=True)
        if not args.words:  # as petl-serve says it (the line below quoted an empty command line: got '')
            raise CommandLineError("no run folder given: petl-export RUN_DIR out=FOLDER|FILE.safetensors|FILE.onnx")
        if len(positional) == 1 and "out" not in options:
            # Quoted: the line is a command to copy, and a run folder's path may hold a space ("my runs/x").
            raise CommandLineError(
                f"no out= given: petl-export {shlex.quote(positional[0])} out=FOLDER|FILE.safetensors|FILE.onnx"
            )
        if len(positional) != 1 or not options.get("out"):
            raise CommandLineError(
                f"expected RUN_DIR out=FOLDER|FILE.safetensors|FILE.onnx, got {' '.join(args.words)!r}"
            )
    target = options["out"]
    from petl.deploy.export import export
    from petl.store.run_card import RunFolderError

    with exit_statuses(
        PROG,
        usage=(RunFolderError, ValueError, FileNotFoundError),
        interrupted=f"interrupted; {target} was not written",
    ):
        gap = export(positional[0], target, overwrite=options.get("overwrite", False))
    checked = f" (onnxruntime matches torch within {gap:.1e})" if gap is not None else ""
    print(f"wrote {target}{checked}")


if __name__ == "__main__":
    main()
