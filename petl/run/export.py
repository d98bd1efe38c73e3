"""petl-export: a trained run as a plain timm model file, for stacks that know nothing of petl.

    petl-export RUN_DIR out=model.safetensors    # timm.create_model(name, num_classes=K, checkpoint_path=...)
    petl-export RUN_DIR out=model.onnx           # ONNX (torch.onnx.export), checked with onnxruntime

The run's method is merged into the backbone and its wrappers removed (``petl.merge(model,
unload=True)``), so what is written is the timm architecture with other weights.  The file's metadata
holds what using it needs: the timm model name, the class names and the preprocessing (input size,
mean/std, interpolation, crop), as JSON strings (safetensors metadata; ONNX ``metadata_props``).  An
ONNX file is checked against the merged model's logits with onnxruntime where it is installed.
Methods whose modules cannot fold into the backbone (adapters, prompts, an MLP head) are refused
in one line: use ``petl-predict`` / ``petl.load_run`` for them.

Exit status (as every petl command): 2 for bad input (no weights, a method that cannot be unloaded, an
unknown format), 1 when the export fails, 130 on Ctrl-C (nothing half-written is left).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import nn

import petl
from petl.run import records
from petl.run.errors import INTERRUPTED, RUN_ERROR, USAGE_ERROR
from petl.run.load import LoadedRun, RunFolderError, load_run

PROG = "petl-export"
FORMAT = "petl-export-1"
FORMATS = (".safetensors", ".onnx")
ONNX_OPSET = 17
# Largest |difference| of logits accepted between onnxruntime and torch (fp32 kernels differ in rounding).
ONNX_TOLERANCE = 1e-3


def metadata(run: LoadedRun) -> dict[str, str]:
    """What a consumer of the exported file needs, as string values (both formats take only strings)."""
    card = run.card
    return {
        "format": FORMAT,
        "timm_model": card["backbone"]["name"],
        "timm_kwargs": json.dumps(card["backbone"].get("kwargs") or {}),
        "num_classes": str(len(run.class_names)),
        "class_names": json.dumps(run.class_names),
        "preprocess": json.dumps(card["preprocess"]),
        "method": f"{card['method']} (merged)",
    }


def plain_model(run: LoadedRun) -> nn.Module:
    """The run's model merged and unloaded into a plain timm model (in place), in eval mode."""
    return petl.merge(run.model, unload=True).eval()


def save_safetensors(model: nn.Module, path: Path, meta: dict[str, str]) -> None:
    """The plain model's ``state_dict`` as safetensors, written atomically."""
    tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in model.state_dict().items()}
    data = safetensors.torch.save(tensors, metadata=meta)

    def write(tmp: Path) -> None:
        tmp.write_bytes(data)

    records.write_atomic(path, write)


def save_onnx(model: nn.Module, path: Path, meta: dict[str, str], image_size: int) -> float | None:
    """The plain model as ONNX (dynamic batch); returns the largest logit difference onnxruntime gives, if installed.

    Raises:
        RuntimeError: onnxruntime disagrees with torch by more than :data:`ONNX_TOLERANCE`.

    """
    example = torch.randn(2, 3, image_size, image_size, generator=torch.Generator().manual_seed(0))

    def write(tmp: Path) -> None:
        with warnings.catch_warnings():
            # The TorchScript exporter: torch's newer one needs the onnxscript package.
            warnings.simplefilter("ignore")
            torch.onnx.export(
                model.cpu(), (example,), str(tmp), input_names=["image"], output_names=["logits"],
                dynamic_axes={"image": {0: "batch"}, "logits": {0: "batch"}}, opset_version=ONNX_OPSET, dynamo=False,
            )  # fmt: skip
        _add_onnx_metadata(tmp, meta)
        gap = _onnx_gap(tmp, model, example)
        if gap is not None and gap > ONNX_TOLERANCE:
            raise RuntimeError(f"onnxruntime's logits differ from torch's by {gap:.2e} (> {ONNX_TOLERANCE})")
        result["gap"] = gap

    result: dict[str, Any] = {}
    records.write_atomic(path, write)
    return result.get("gap")


def _add_onnx_metadata(path: Path, meta: dict[str, str]) -> None:
    try:
        import onnx
    except ImportError:
        print(f"{PROG}: note: the onnx package is not installed: class names and preprocessing not recorded")
        return
    proto = onnx.load(str(path))
    for key, value in meta.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.save(proto, str(path))


def _onnx_gap(path: Path, model: nn.Module, example: torch.Tensor) -> float | None:
    try:
        import onnxruntime
    except ImportError:
        print(f"{PROG}: note: onnxruntime is not installed: the ONNX file is not checked")
        return None
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    # A batch size other than the traced one: the batch axis must really be dynamic.
    images = torch.cat([example, example[:1]])
    (logits,) = session.run(None, {"image": images.numpy()})
    with torch.inference_mode():
        expected = model(images).numpy()
    return float(abs(logits - expected).max())


def export(run_dir: str | Path, out: str | Path) -> float | None:
    """Write a run's merged plain model to ``out`` (``.safetensors`` or ``.onnx``).

    Returns:
        For ONNX, onnxruntime's largest logit difference from torch (``None`` without onnxruntime).

    Raises:
        ValueError: an unknown format, a method that cannot be unloaded, a run folder that cannot load.
        RuntimeError: the ONNX check failed.

    """
    out = Path(out)
    if out.suffix.lower() not in FORMATS:
        raise ValueError(f"out={out}: choose a .safetensors or .onnx file name")
    run = load_run(run_dir)
    model = plain_model(run)
    meta = metadata(run)
    if out.suffix.lower() == ".onnx":
        return save_onnx(model, out, meta, run.spec.image_size)
    save_safetensors(model, out, meta)
    return None


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``petl-export``."""
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dir", help="a finished petl-run output_dir")
    parser.add_argument("out", help="out=model.safetensors or out=model.onnx")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    key, eq, target = args.out.partition("=")
    if not eq or key != "out" or not target:
        print(f"{PROG}: error: expected out=FILE.safetensors|FILE.onnx, got {args.out!r}", file=sys.stderr)
        raise SystemExit(USAGE_ERROR)
    try:
        gap = export(args.run_dir, target)
    except (RunFolderError, ValueError, FileNotFoundError) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        raise SystemExit(USAGE_ERROR) from None
    except (RuntimeError, OSError) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        raise SystemExit(RUN_ERROR) from None
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; {target} was not written", file=sys.stderr)
        raise SystemExit(INTERRUPTED) from None
    checked = f" (onnxruntime matches torch within {gap:.1e})" if gap is not None else ""
    print(f"wrote {target}{checked}")


if __name__ == "__main__":
    main()
