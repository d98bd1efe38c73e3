"""Exporting a trained run as a plain timm model (``petl-export``'s API: :func:`export`); to ONNX, a method that does
not unload into one goes as petl runs it.

The command line, its options and exit statuses are :mod:`petl.cli.export`'s.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import nn

import petl.methods  # noqa: F401  (importing the methods registers them)
from petl.backbones.models import timm_native
from petl.data.transforms import CROP_RATIO
from petl.model.unloading import NotUnloadable, unload
from petl.store import files
from petl.store.run_card import LoadedRun, load_run
from petl.utils.paths import cannot_be_written, cannot_write_in, remove_stale_temporaries

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; a killed export's temporary folder is then named, not removed
    fcntl = None  # type: ignore[assignment]

PROG = "petl-export"
FORMAT = files.EXPORT_FORMAT  # in the metadata and config.json: how a run loader tells an export (file_not_run)
FORMATS = (".safetensors", ".onnx", "")  # "": a timm folder
CONFIG_FILE, WEIGHTS_FILE = files.TIMM_FOLDER_FILES  # timm's local-dir names, which run loaders refuse
ONNX_OPSET = 17
# Largest |difference| of logits accepted between onnxruntime and torch (fp32 kernels differ in rounding).
ONNX_TOLERANCE = 1e-3
# Protobuf serializes nothing past 2 GiB, so weights past this (fp32 ViT-H/14 and up) go to one data file beside
# the .onnx, as onnx.save_model(save_as_external_data=True) writes it; 64 MiB are left for the graph and metadata.
ONNX_WEIGHTS_LIMIT = 2**31 - 2**26
# What to do when the ONNX file cannot be written or checked: a merged model has the other formats, a petl model
# (a method that does not unload) has petl itself.
ONNX_INSTEAD = "export a folder or a .safetensors file instead"
AS_PETL_MODEL = "use it as a petl model (petl-predict or petl-serve on its run folder, petl.load_run in Python)"
ONNX_DATA_SUFFIX = ".data"  # FILE.onnx.data, the name torch's newer (dynamo) exporter gives that file
# In an ONNX export's temporary folder: a file the export holds locked (flock) while it runs, so a later export
# tells the folder of one killed (kill -9, a power cut) from a live one's, and both from a folder it did not make.
WORK_LOCK = "petl-export.lock"


def metadata(run: LoadedRun, merged: bool = True) -> dict[str, str]:
    """What a consumer of the exported file needs, as string values (both formats take only strings).

    ``merged=False``: an ONNX graph of the run's petl model as it runs (its method's modules in the graph), for a
    method that does not fold into the backbone; ``timm_model`` then names the backbone it was trained on.
    """
    card = run.card
    architecture, kwargs = timm_native(card["backbone"]["name"], card["backbone"]["kwargs"])
    return {
        "format": FORMAT,
        "timm_model": architecture,
        "timm_kwargs": json.dumps(kwargs),
        "num_classes": str(len(run.class_names)),
        "class_names": json.dumps(run.class_names),
        "preprocess": json.dumps(card["preprocess"]),
        "method": f"{card['method']} (merged)"
        if merged
        else f"{card['method']} (not merged: its modules are in the graph)",
        # What it was trained on, as a folder's config.json says it (a card of an older petl may not record it).
        **({"dataset": card["dataset"]} if "dataset" in card else {}),
    }


def plain_model(run: LoadedRun) -> nn.Module:
    """The run's model merged and unloaded into a plain timm model (in place), in eval mode."""
    return unload(run.model).eval()


def save_safetensors(model: nn.Module, path: Path, meta: dict[str, str]) -> None:
    """The plain model's ``state_dict`` as safetensors, written atomically.

    The temporary file an export killed while writing ``path`` left beside it (kill -9) is removed first
    (:func:`petl.utils.paths.remove_stale_temporaries`: never a live writer's).
    """
    remove_stale_temporaries(path)
    tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in model.state_dict().items()}
    data = safetensors.torch.save(tensors, metadata=meta)

    def write(tmp: Path) -> None:
        tmp.write_bytes(data)

    files.write_atomic(path, write)


def timm_config(run: LoadedRun) -> dict[str, Any]:
    """The ``config.json`` of a timm folder (``local-dir:`` / hub): architecture, arguments, preprocessing, classes."""
    card, spec = run.card, run.spec
    architecture, kwargs = timm_native(card["backbone"]["name"], card["backbone"]["kwargs"])
    # The model's own timm names for its first convolution and its classifier (a Swin's is head.fc, a ViT's
    # head): timm drops the classifier by this name when the folder is loaded with another num_classes.
    own = run.model.pretrained_cfg
    # A NaFlexVit's run carries its size as pretrained_cfg_overlay (model.json): here pretrained_cfg holds it, and
    # timm's local-dir loader passes its own overlay beside model_args (one more is "multiple values").
    kwargs.pop("pretrained_cfg_overlay", None)
    return {
        "architecture": architecture,
        "num_classes": len(run.class_names),
        "model_args": {**kwargs, "num_classes": len(run.class_names)},
        "pretrained_cfg": {
            "input_size": [3, spec.image_size, spec.image_size],
            "fixed_input_size": True,
            "interpolation": spec.interpolation,
            "mean": list(spec.mean),
            "std": list(spec.std),
            # petl's evaluation geometry in timm's words: the shorter side to size * 256 / 224 and a centre crop,
            # or the image squashed to the square.
            "crop_pct": 1 / CROP_RATIO if spec.crop else 1.0,
            "crop_mode": "center" if spec.crop else "squash",
            "first_conv": own["first_conv"],
            "classifier": own["classifier"],
            "label_names": list(run.class_names),
        },
        "petl": {"format": FORMAT, "method": f"{card['method']} (merged)", "dataset": card.get("dataset")},
    }


def save_timm_folder(model: nn.Module, folder: Path, config: dict[str, Any]) -> None:
    """``model.safetensors`` and ``config.json`` into ``folder``, each written atomically.

    The temporary files an export killed while writing them left (kill -9) are removed first, as
    :func:`save_safetensors` says.
    """
    folder.mkdir(parents=True, exist_ok=True)
    # An earlier export's config.json goes first: interrupted between the two files, the folder must not hold it
    # beside the new weights, a mix timm would load as a finished export.
    (folder / CONFIG_FILE).unlink(missing_ok=True)
    save_safetensors(model, folder / WEIGHTS_FILE, {"format": "pt"})
    remove_stale_temporaries(folder / CONFIG_FILE)
    files.write_json(folder / CONFIG_FILE, config)


def onnx_data_path(path: Path) -> Path:
    """Where an ONNX export past protobuf's 2 GiB keeps its weights: ``FILE.onnx.data`` beside ``FILE.onnx``."""
    return path.with_name(path.name + ONNX_DATA_SUFFIX)


def save_onnx(
    model: nn.Module, path: Path, meta: dict[str, str], image_size: int, instead: str = ONNX_INSTEAD
) -> float | None:
    """The plain model as ONNX (dynamic batch); returns the largest logit difference onnxruntime gives, if installed.

    A model whose weights pass protobuf's 2 GiB (:data:`ONNX_WEIGHTS_LIMIT`) keeps them in one file beside
    ``path`` (:func:`onnx_data_path`), which the ``.onnx`` names and must stay beside; a smaller model is one file,
    and an earlier export's data file is removed.  Everything is written in a temporary folder beside ``path``
    and moved in once checked, the ``.onnx`` last, so an interrupted export leaves no ``.onnx`` that is not whole;
    the folder of an export killed before it could remove it is removed here (:func:`remove_killed_exports`).

    Raises:
        RuntimeError: torch's exporter cannot trace the model (timm's EVA), onnxruntime cannot run the graph or
            disagrees with torch by more than :data:`ONNX_TOLERANCE` (one line ending in ``instead``: what to do).

    """
    example = torch.randn(2, 3, image_size, image_size, generator=torch.Generator().manual_seed(0))
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_killed_exports(path)
    work, held = _work_folder(path)
    try:
        written = work / path.name
        _torch_onnx_export(model, example, written, meta, instead)
        large = _save_onnx_with_metadata(written, meta)
        gap = _onnx_gap(written, model, example, instead)
        if gap is not None and gap > ONNX_TOLERANCE:
            # A graph traced at one batch size that is wrong at others (a shape kept as a constant) lands here too.
            raise RuntimeError(f"onnxruntime's logits differ from torch's by {gap:.2e} (> {ONNX_TOLERANCE}): {instead}")
        _move_onnx_in(written, path, large)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        os.close(held)
    return gap


def _work_folder(path: Path) -> tuple[Path, int]:
    """A temporary folder beside ``path`` (``.FILE.onnx.*.tmp``) holding :data:`WORK_LOCK`, and the lock's descriptor.

    A folder, not a file: past 2 GiB torch's exporter writes each weight as a file beside the one it is given.
    """
    work = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    new = work / f"{WORK_LOCK}.new"
    held = os.open(new, os.O_CREAT | os.O_WRONLY, 0o644)
    if fcntl is not None:
        fcntl.flock(held, fcntl.LOCK_EX)
    # Locked before it has its name: a later export never finds the lock file unlocked while this export lives.
    os.rename(new, work / WORK_LOCK)
    return work, held


def remove_killed_exports(path: Path) -> list[Path]:
    """Remove the temporary folders killed ONNX exports to ``path`` left beside it; return them.

    A folder of :func:`_work_folder` whose lock nobody holds is a killed export's, and is removed; a live export's
    is left alone.  A folder of that name without the lock (an earlier petl's, or not petl's at all) is never
    removed: a note on stderr names it, for the user to delete.
    """
    removed = []
    for folder in sorted(path.parent.glob(f".{glob.escape(path.name)}.*.tmp")):  # model[1].onnx: no character class
        if folder.is_symlink() or not folder.is_dir():  # a file: petl.utils.paths.atomic_path's, or the user's
            continue
        lock = folder / WORK_LOCK
        if fcntl is None or not lock.is_file():
            print(
                f"{PROG}: note: {folder} may be the temporary folder of an interrupted export to {path}: delete it "
                "if no export is writing there",
                file=sys.stderr,
            )
            continue
        try:
            held = os.open(lock, os.O_RDONLY)
        except OSError:  # its export finished meanwhile
            continue
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a live export's
            continue
        else:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
        finally:
            os.close(held)
    return removed


@contextmanager
def _output_held() -> Iterator[None]:
    """Hold back what is written to file descriptors 1 and 2 (C++ code's too) inside; write it out if no error.

    A descriptor that is closed (``petl-export ... >&-``; Python's stream is then ``None``) is left alone.
    """
    held = []  # (fd, its Python stream, a duplicate of the fd, the file holding what was written)
    with contextlib.ExitStack() as stack:
        for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
            if stream is None:
                continue
            try:
                saved = os.dup(fd)
            except OSError:
                continue
            stream.flush()
            file = stack.enter_context(tempfile.TemporaryFile())
            os.dup2(file.fileno(), fd)
            held.append((fd, stream, saved, file))
        try:
            yield
        finally:
            for fd, stream, saved, _ in held:
                stream.flush()
                os.dup2(saved, fd)
                os.close(saved)
        for _, stream, _, file in held:
            file.seek(0)
            stream.write(file.read().decode(errors="replace"))


def _torch_onnx_export(
    model: nn.Module, example: torch.Tensor, path: Path, meta: dict[str, str], instead: str = ONNX_INSTEAD
) -> None:
    # torch's TorchScript exporter writes the whole graph to the process's stdout, from C++, before it raises on an
    # operator it cannot export (NaFlexVit's antialiased bicubic resize: some 200 lines above the one-line refusal;
    # torch 2.9's setup_onnx_logging turns that log on always).  What it writes is held back, shown only on success.
    with warnings.catch_warnings(), _output_held():
        # The TorchScript exporter: torch's newer one needs the onnxscript package.
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(
                model.cpu(), (example,), str(path), input_names=["image"], output_names=["logits"],
                dynamic_axes={"image": {0: "batch"}, "logits": {0: "batch"}}, opset_version=ONNX_OPSET,
                dynamo=False,
            )  # fmt: skip
        except Exception as error:  # noqa: BLE001  (a model torch's exporter cannot trace: timm's EVA)
            first = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise RuntimeError(
                f"torch.onnx.export cannot export {meta.get('timm_model', 'this model')} ({first}): {instead}"
            ) from None


def _save_onnx_with_metadata(path: Path, meta: dict[str, str]) -> bool:
    """Add ``meta`` to the ONNX file at ``path`` (rewritten in place); return whether its weights went to a file."""
    import onnx

    proto = onnx.load(str(path))  # with the weights torch wrote beside it past 2 GiB
    for key, value in meta.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    # The weights' bytes, not proto.ByteSize(): protobuf cannot even count a message past 2 GiB.
    large = sum(len(tensor.raw_data) for tensor in proto.graph.initializer) > ONNX_WEIGHTS_LIMIT
    if large:
        # One data file (not torch's file per weight), named relative to the .onnx, so the two move together.
        onnx.save_model(
            proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
            location=onnx_data_path(path).name,
        )  # fmt: skip
    else:
        onnx.save_model(proto, str(path))
    return large


def _move_onnx_in(written: Path, path: Path, large: bool) -> None:
    """Move the checked export (and its data file) from the temporary folder onto ``path``, the ``.onnx`` last."""
    data = onnx_data_path(path)
    if large or os.path.lexists(data):
        # The earlier .onnx goes first: interrupted between the moves, no .onnx is left beside weights it does not
        # name (an old model.onnx would read the new model.onnx.data, or miss the one removed).
        path.unlink(missing_ok=True)
        data.unlink(missing_ok=True)
    if large:
        os.replace(onnx_data_path(written), data)
    os.replace(written, path)


def require_onnx(out: Path) -> None:
    """Refuse ``out=FILE.onnx`` without the onnx package, which torch's exporter needs and petl does not install.

    Raises:
        RuntimeError: onnx cannot be imported (one line naming the ``pip install``).

    """
    try:
        import onnx  # noqa: F401
    except ImportError:
        # torch's exporter said only "Module onnx is not installed!", after the run loaded, as if the model could
        # not be traced.
        raise RuntimeError(
            f"out={out} needs the onnx package, which is not installed: pip install onnx, or export a folder or a "
            ".safetensors file"
        ) from None


def _onnx_gap(path: Path, model: nn.Module, example: torch.Tensor, instead: str = ONNX_INSTEAD) -> float | None:
    try:
        import onnxruntime
    except ImportError:
        print(f"{PROG}: note: onnxruntime is not installed: the ONNX file is not checked", file=sys.stderr)
        return None
    # The torch model stays loaded beside the session (it is the caller's, and gives the expected logits): releasing
    # it first would not lower the export's peak memory, which torch.onnx.export sets.  On a ViT-B/16 (330 MiB of
    # fp32 weights, CPU, onnxruntime 1.32) the exporter rose 965 MiB above the loaded model, the metadata rewrite
    # 361 MiB, this check 230 MiB (the steps' peak resident memory, sampled every 2 ms).
    # A batch size other than the traced one: the batch axis must really be dynamic.
    images = torch.cat([example, example[:1]])
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 4  # fatal only: the error it logs on stderr is said below, in the one line
    try:
        session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        (logits,) = session.run(None, {"image": images.numpy()})
    except Exception as error:  # noqa: BLE001  (onnxruntime's own types: a shape traced as a constant)
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise RuntimeError(
            f"onnxruntime cannot run the exported graph on {len(images)} images ({first}): {instead}"
        ) from None
    with torch.inference_mode():
        expected = model(images).numpy()
    return float(abs(logits - expected).max())


def check_target(run_dir: str | Path, out: str | Path, overwrite: bool = False) -> None:
    """Refuse an ``out`` that would replace files the export did not write, before anything is loaded.

    ``out`` inside a run folder (this run's or any other: a folder above it holds ``model.json``) is refused
    even with ``overwrite``: a run's files are replaced by a run, never by an export; so is an ``out`` where no
    file can be written (a read-only folder, ``/proc``).  An existing file (for ``FILE.onnx``, also the data file
    ``FILE.onnx.data`` of a large export), or a folder already holding ``config.json`` or ``model.safetensors``, is
    replaced only with ``overwrite``; a folder where the export writes a file is refused even with it.

    Raises:
        ValueError: an unknown format, ``out`` inside a run folder, files in the way, a folder nothing can be
            written in (one line naming them).

    """
    out = Path(out)
    if out.suffix.lower() not in FORMATS:
        raise ValueError(f"out={out}: choose a folder (no suffix), a .safetensors or a .onnx file name")
    # Python reads ".onnx" as a hidden folder's name, without a suffix; "." (the current folder) has no name at all.
    if out.name and out.name.lower() in FORMATS:
        raise ValueError(f"out={out} names no file: give it a name ({out.with_name('model' + out.name.lower())})")
    try:
        target = out.resolve()
        if target.is_relative_to(Path(run_dir).resolve()):
            raise ValueError(f"out={out} is inside the run folder {run_dir}: export elsewhere (the run's files stay)")
        files.check_outside_runs(target, f"out={out}", "an export")
        if out.suffix:
            if out.is_dir():
                raise ValueError(f"out={out} is a folder: name a new {out.suffix} file")
            # A large ONNX export's data file is part of the export (an earlier one's, or someone's own file).  A
            # symlink counts even dangling (lexists): the user made it.
            names = [out, onnx_data_path(out)] if out.suffix.lower() == ".onnx" else [out]
            in_the_way = [path for path in names if os.path.lexists(path)]
        elif out.exists() and not out.is_dir():
            raise ValueError(f"out={out} is a file: name a folder (no suffix) or a .safetensors or .onnx file")
        else:
            in_the_way = [out / name for name in (CONFIG_FILE, WEIGHTS_FILE) if os.path.lexists(out / name)]
        for path in in_the_way:
            if path.is_dir():  # overwrite= replaces files, never a folder
                raise ValueError(f"{path} is a folder, where the export writes a file: remove it or export elsewhere")
        # Said before the run loads (as petl-predict's out=), not as a bare OSError after the model is built.  Without
        # fill: a full disk is an export that failed (exit 1, docs/cli.md), said by export() when it writes.
        unwritable = cannot_write_in(out.parent if out.suffix else out)
    except OSError as error:  # even a look fails: a name longer than the file system takes
        unwritable = cannot_be_written(out, error)
    if unwritable is not None:
        raise ValueError(f"out={out}: {unwritable}")
    if in_the_way and not overwrite:
        listed = ", ".join(str(path) for path in in_the_way)
        exists, them = ("already exists", "it") if len(in_the_way) == 1 else ("already exist", "them")
        raise ValueError(f"{listed} {exists}: export elsewhere, or add overwrite=true to replace {them}")


def export(run_dir: str | Path, out: str | Path, overwrite: bool = False) -> float | None:
    """Write a run's merged plain model to ``out`` (a timm folder, ``.safetensors`` or ``.onnx``); to ``.onnx``, a
    method that does not unload is written as petl runs it (:func:`_model_to_write`).

    Args:
        run_dir: the run folder.
        out: a folder (timm's ``local-dir`` format), a ``.safetensors`` or a ``.onnx`` file name.
        overwrite: replace an existing file (or a folder's ``config.json`` / ``model.safetensors``, a ``.onnx``
            file's ``.onnx.data``); without it they are refused (:func:`check_target`).

    Returns:
        For ONNX, onnxruntime's largest logit difference from torch (``None`` without onnxruntime).

    Raises:
        ValueError: an unknown format, ``out`` inside a run folder, files in the way without ``overwrite``, a
            method that cannot be unloaded (for a folder or ``.safetensors``), a run folder that cannot load.
        RuntimeError: the onnx package is missing for a ``.onnx`` file, the ONNX check failed, or a file could not be
            written (a full disk).

    """
    out = Path(out)
    check_target(run_dir, out, overwrite)
    if out.suffix.lower() == ".onnx":
        require_onnx(out)
    run = load_run(run_dir)
    model, merged = _model_to_write(run, out)
    meta = metadata(run, merged)
    with _made_folders_removed_on_failure(out.parent if out.suffix else out):
        try:
            if out.suffix.lower() == ".onnx":
                return save_onnx(model, out, meta, run.spec.image_size, ONNX_INSTEAD if merged else AS_PETL_MODEL)
            if out.suffix:
                save_safetensors(model, out, meta)
            else:
                save_timm_folder(model, out, timm_config(run))
        except OSError as error:  # a full disk: each file is written atomically, so none is left half-written
            raise RuntimeError(
                f"cannot write out={out} ({error.strerror or error}): free the space and export again"
            ) from None
    return None


def _model_to_write(run: LoadedRun, out: Path) -> tuple[nn.Module, bool]:
    """The run's plain timm model (:func:`plain_model`) and ``True``; for ONNX, a method that does not unload gives
    its petl model as it runs (in eval mode) and ``False``: an ONNX graph needs no timm architecture to hold it.

    Raises:
        ValueError: the method does not unload and ``out`` is a folder or a ``.safetensors`` file (one line saying
            to export ONNX instead).

    """
    try:
        return plain_model(run), True
    except NotUnloadable as refused:  # nothing changed: the run's model is as load_run built it
        if out.suffix.lower() == ".onnx":
            return run.model.eval(), False
        onnx = out.with_suffix(".onnx") if out.suffix else out.with_name(out.name + ".onnx")
        raise ValueError(
            f"method {refused.method!r} cannot be unloaded into a plain timm model: {refused.why}: export it as ONNX "
            f"instead (out={onnx}: the model as petl runs it), or {AS_PETL_MODEL}"
        ) from None


@contextmanager
def _made_folders_removed_on_failure(folder: Path) -> Iterator[None]:
    """Remove the folders up to ``folder`` that the block made, if it fails (Ctrl-C too) and they are still empty.

    An export that failed (a model torch cannot trace, a full disk) left the empty folders of a new ``out=`` path.
    """
    made = [path for path in (folder, *folder.parents) if not path.exists()]  # the deepest first
    try:
        yield
    except BaseException:
        for path in made:
            try:
                path.rmdir()
            except OSError:  # not empty (a folder export's weights, written before a Ctrl-C), or gone
                break
        raise
