"""Predicting with trained runs: labels for images, or accuracy on a labelled split (``petl-predict``'s API).

The command line, its options and exit statuses are :mod:`petl.cli.predict`'s.
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import io
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

import petl.methods  # noqa: F401  (importing the methods registers them)
from petl import data as petl_data
from petl.data.folder import IMAGE_EXTENSIONS, class_folders, image_files, lookalike, not_images
from petl.data.images import FileListDataset, decode_image, decode_progress
from petl.deploy.multitask import MultiTask, TaskRefused
from petl.deploy.tasks import given_once
from petl.model import surgery
from petl.model.registry import get_method
from petl.store.files import (
    MODEL_FILE,
    WEIGHTS_FILE,
    check_outside_runs,
    exported_file_not_run,
    exported_not_run,
    file_not_run,
    unfinished_run,
)
from petl.store.run_card import (
    LoadedRun,
    RunFolderError,
    create_backbone,
    load_run,
    loaded,
    read_card,
    weights_file,
)
from petl.utils.errors import UsageError
from petl.utils.paths import cannot_be_written, cannot_write_in, write_atomic
from petl.utils.precision import describe, inference, inference_precision
from petl.utils.progress import progress_bar
from petl.utils.text import csv_cell, plural, read_names, shown

PROG = "petl-predict"
SPLIT_ALIASES = {"train": petl_data.TRAIN, "val": petl_data.VAL, "validation": petl_data.VAL, "test": petl_data.TEST}


@dataclass
class Prediction:
    """One image's top-k labels and probabilities (and its true label when known)."""

    run: str
    source: str
    labels: list[str]
    probabilities: list[float]
    truth: str | None = None


def _say(line: str) -> None:
    """A progress line where no bar is drawn (stderr a file): on stderr, as the command's notes."""
    print(f"{PROG}: {line}", file=sys.stderr, flush=True)


def _is_run(path: Path) -> bool:
    return path.is_dir() and ((path / WEIGHTS_FILE).is_file() or (path / MODEL_FILE).is_file())


def image_paths(items: Sequence[str], quiet: bool = False) -> list[Path]:
    """Every image an item names: a file, the image files under a folder, or the lines of a ``.txt`` list.

    A folder is searched as ``petl-run`` searches a class folder (:func:`petl.data.folder.image_files`: hidden
    names skipped, linked sub-folders followed); the other files found there are named in a note on stderr
    (unless ``quiet``), so that no file is left without a row unsaid.

    Raises:
        UsageError: an item that does not exist or is neither a file nor a folder (a pipe), a folder without
            images, a listed file that is missing.

    """
    paths: list[Path] = []
    for item in items:
        path = Path(item).expanduser()
        if path.is_dir():
            found, others = image_files(path)
            if not found:
                raise UsageError(f"{shown(path)} holds no image files ({', '.join(IMAGE_EXTENSIONS)})")
            if others and not quiet:
                print(f"{PROG}: note: {not_images(others, path)}", file=sys.stderr)
            paths += found
        elif path.suffix.lower() == ".txt" and path.is_file():
            listed = [p if p.is_absolute() else path.parent / p for p in map(Path, read_names(path))]
            missing = [shown(p) for p in listed if not p.is_file()]
            if missing:
                # Where it looked, and what to do: a list written relative to the shell's folder and kept in
                # another reads as missing, though "ls" finds each file.
                raise UsageError(
                    f"{shown(path)} lists {len(missing)} missing file(s), e.g. {missing[0]}: fix or remove those "
                    f"lines (a relative path is read from the list's folder, {shown(path.parent.absolute())})"
                )
            paths += listed
        elif path.is_file():
            paths.append(path)
        elif path.exists():  # a named pipe, a device: it was said not to exist
            raise UsageError(f"{shown(item)} is not a file or a folder (a pipe, a device): give image files or folders")
        else:
            raise UsageError(f"{shown(item)}: no such file or folder")
    return paths


def _batches(paths: list[Path], size: int) -> Iterator[list[Path]]:
    for start in range(0, len(paths), size):
        yield paths[start : start + size]


def _top_k(logits: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    probabilities = logits.float().softmax(-1)
    values, indices = probabilities.topk(min(k, probabilities.shape[-1]), dim=-1)
    return values.cpu().numpy(), indices.cpu().numpy()


def _decode(run: LoadedRun, batch: list[Path], bad: list[tuple[Path, str]]) -> tuple[list[torch.Tensor], list[Path]]:
    """The readable images of ``batch`` preprocessed as ``run`` evaluated; the others appended to ``bad``."""
    tensors, kept = [], []
    for path in batch:
        try:
            # The preprocessing too: it refuses an image its resize would make too large (UnfitImage).
            tensors.append(run.preprocess(Image.fromarray(decode_image(path.read_bytes()))))
        except (OSError, ValueError) as error:
            bad.append((path, str(error).splitlines()[0] if str(error) else type(error).__name__))
            continue
        kept.append(path)
    return tensors, kept


def _predictions(run: LoadedRun, kept: list[Path], logits: torch.Tensor, top_k: int) -> list[Prediction]:
    values, indices = _top_k(logits, top_k)
    found = []
    for path, probs, labels in zip(kept, values, indices, strict=True):
        names = [run.class_names[int(i)] for i in labels]
        found.append(Prediction(shown(run.run_dir), shown(path), names, [float(p) for p in probs]))
    return found


def predict_images(
    run: LoadedRun,
    paths: list[Path],
    top_k: int = 5,
    batch_size: int = 64,
    progress: bool = True,
    precision: str = "auto",
) -> tuple[list[Prediction], list[tuple[Path, str]]]:
    """Classify image files with one run; unreadable images are returned apart, by path, with the reason.

    ``precision`` is the forward's (:func:`petl.utils.precision.inference_precision`): under ``auto``, bf16 autocast and
    TF32 on a CUDA GPU with native bf16, strict fp32 elsewhere; probabilities are computed in fp32.
    """
    device = next(run.model.parameters()).device
    precision = inference_precision(precision, device.type)
    predictions: list[Prediction] = []
    bad: list[tuple[Path, str]] = []
    bar = progress_bar(
        total=len(paths), desc=f"predict {run.run_dir.name}", unit="img", show=progress, leave=False, say=_say
    )
    for batch in _batches(paths, batch_size):
        tensors, kept = _decode(run, batch, bad)
        if tensors:
            with torch.inference_mode(), inference(precision, device.type):
                logits = run.model(torch.stack(tensors).to(device))
            predictions += _predictions(run, kept, logits, top_k)
        bar.update(len(batch))
    bar.close()
    return predictions, bad


def predict_together(
    served: MultiTask,
    runs: list[LoadedRun],
    paths: list[Path],
    top_k: int = 5,
    batch_size: int = 64,
    progress: bool = True,
    precision: str = "auto",
) -> tuple[list[Prediction], list[tuple[Path, str]]]:
    """Classify image files with several runs served by one :class:`petl.MultiTask`, in one pass over the images.

    Each image is decoded once; a batch holds one row per image and run (``batch_size`` rows at most, at
    least one image).  Predictions come run by run, as :func:`predict_images` gives them for each run, in
    ``precision`` as there.
    """
    device = next(served.parameters()).device
    precision = inference_precision(precision, device.type)
    found: list[list[Prediction]] = [[] for _ in runs]
    bad: list[tuple[Path, str]] = []
    bar = progress_bar(
        total=len(paths), desc=f"predict {len(runs)} runs", unit="img", show=progress, leave=False, say=_say
    )
    for batch in _batches(paths, max(1, batch_size // len(runs))):
        tensors, kept = _decode(runs[0], batch, bad)  # one preprocessing: the runs share it
        if tensors:
            images = torch.stack(tensors).to(device)
            tasks = torch.arange(len(runs)).repeat(len(kept))  # image 0 for every run, then image 1...
            with torch.inference_mode(), inference(precision, device.type):
                logits = served(images.repeat_interleave(len(runs), dim=0), tasks)
            for task, run in enumerate(runs):
                found[task] += _predictions(run, kept, logits[task :: len(runs), : len(run.class_names)], top_k)
        bar.update(len(batch))
    bar.close()
    return [p for run in found for p in run], bad


def _backbone_key(card: dict) -> str:
    """What runs must share to be served by one backbone: its record (bar the hash) and the preprocessing."""
    backbone = {key: value for key, value in card["backbone"].items() if key != "frozen_sha256"}
    if backbone.get("pretrained") or backbone.get("checkpoint"):
        backbone.pop("seed", None)  # the seed only drew a random init
    return json.dumps([backbone, card["preprocess"]], sort_keys=True)


def serve_together(folders: list[Path], quiet: bool = False) -> tuple[MultiTask | None, list[LoadedRun], list[Path]]:
    """Runs trained on one backbone, loaded as one :class:`petl.MultiTask` over a single copy of it.

    Args:
        folders: run folders whose ``model.json`` name the same backbone and preprocessing.
        quiet: no note on stderr for a run that cannot share.

    Returns:
        The MultiTask (``None`` when fewer than two runs can share), the served runs (their ``model`` is
        the task's model inside it), and the folders it refused (a note on stderr says why).

    """
    cards = {folder: read_card(folder) for folder in folders}
    backbone = create_backbone(cards[folders[0]]["backbone"], folders[0] / MODEL_FILE)
    tasks = {str(folder): weights_file(folder, cards[folder]) for folder in folders}
    refused: list[Path] = []
    while len(tasks) > 1:
        try:
            served = MultiTask(backbone, tasks)
        except TaskRefused as error:
            if not quiet:
                print(f"{PROG}: note: {error}; predicting {error.task} with its own model", file=sys.stderr)
            refused.append(Path(error.task))
            del tasks[error.task]
            continue
        runs = [
            loaded(Path(name), cards[Path(name)], model) for name, model in zip(served.names, served.tasks, strict=True)
        ]
        if torch.cuda.is_available():
            served.cuda()
        return served, runs, refused
    return None, [], folders


def evaluate_split(
    run: LoadedRun,
    dataset: torch.utils.data.Dataset,
    batch_size: int = 64,
    progress: bool = True,
    precision: str = "auto",
) -> tuple[np.ndarray, list[int], list[int]]:
    """Confusion matrix (rows: true class, columns: predicted) and the true and predicted labels of a split.

    The forward runs in ``precision``, as :func:`predict_images`'s does.
    """
    device = next(run.model.parameters()).device
    precision = inference_precision(precision, device.type)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size)
    truth: list[int] = []
    predicted: list[int] = []
    with torch.inference_mode(), inference(precision, device.type):
        # Counted in images, as the predict bar is ("evaluate run: 0/1" said one of what: a batch).
        bar = progress_bar(
            total=len(dataset), desc=f"evaluate {run.run_dir.name}", unit="img", show=progress, leave=False, say=_say
        )
        for images, labels in loader:
            predicted += run.model(images.to(device)).argmax(-1).cpu().tolist()
            truth += [int(label) for label in labels]
            bar.update(len(labels))
        bar.close()
    count = len(run.class_names)
    matrix = np.zeros((count, count), dtype=np.int64)
    np.add.at(matrix, (np.array(truth, dtype=np.int64), np.array(predicted, dtype=np.int64)), 1)
    return matrix, truth, predicted


@dataclass
class _TestFolder:
    """``ROOT/test/<class>/*`` read for the first run: its class folders, and its images decoded and labelled by them.

    Every later run takes a view of it (:func:`_new_test_folder`): the folder is listed, noted and decoded once.
    """

    names: list[str]
    dataset: FileListDataset  # labels: the index in ``names``


def _new_test_folder(run: LoadedRun, root: Path, read: dict[Path, _TestFolder]) -> FileListDataset:
    """``ROOT/test/<class>/*`` without a ``train/`` beside it: new labelled images, numbered by the run's classes.

    Args:
        run: the run to evaluate.
        root: the folder holding ``test/``.
        read: the folders read for earlier runs, by root; this one is added when read.

    Raises:
        UsageError: a class folder the run was not trained on, or no images at all.
        BadImagesError: naming every image that cannot be decoded.

    """
    test = root / "test"
    if root in read:
        names = read[root].names
    else:
        try:
            names = class_folders(test)
        except ValueError as error:
            raise UsageError(str(error)) from None
    unknown = [name for name in names if name not in run.class_names]
    if unknown:
        raise UsageError(
            f"{shown(test)} has class folders the run was not trained on: {', '.join(map(shown, unknown[:5]))} "
            f"(its classes: {', '.join(run.class_names)}); rename or remove them"
            + lookalike(unknown, run.class_names, "the run's")
        )
    spec = dataclasses.replace(run.spec, augment=False)
    if root not in read:
        items: list[tuple[Path, int]] = []
        skipped: list[Path] = []
        for index, name in enumerate(names):
            files, others = image_files(test / name)
            skipped += others
            items += [(path, index) for path in files]
        if skipped:
            print(f"{PROG}: note: {not_images(skipped, test)}", file=sys.stderr)
        if not items:
            raise UsageError(f"{shown(test)} holds no images in class sub-folders (<class name>/*.png)")
        folder = FileListDataset(items, spec, name=f"folder {root.resolve()}", folder=root.resolve())
        read[root] = _TestFolder(names, folder)
    # The decoded images shared, labelled by this run's classes; a run of another image size or geometry decodes
    # each image as it reads it (FileListDataset holds them resized for the first run's).
    view = copy.copy(read[root].dataset)
    view.items = [(path, run.class_names.index(names[label])) for path, label in view.items]
    view.spec = spec
    return view


def _eval_dataset(run: LoadedRun, options: dict, read: dict[Path, _TestFolder]) -> tuple[torch.utils.data.Dataset, str]:
    name = options["data"]
    split = SPLIT_ALIASES.get(options.get("split", "test"), options.get("split", "test"))
    if split not in petl_data.SPLITS:
        raise UsageError(f"split={options['split']}: choose one of test, val, train")
    extra = {k.split(".", 1)[1]: v for k, v in options.items() if k in ("data.image_column", "data.label_column")}
    root = Path(str(options.get("data.root"))).expanduser()
    try:
        if name == "folder" and split == petl_data.TEST and root.is_dir() and not (root / "train").is_dir():
            if (root / "test").is_dir():
                return _new_test_folder(run, root, read), split
            if root.name not in ("train", "val", "test"):  # a split folder given itself is answered with its parent
                raise UsageError(
                    f"{shown(root)} has no test/ folder: put the labelled images to evaluate on in "
                    f"{shown(root)}/test/<class name>/, one folder per class of the run ({', '.join(run.class_names)})"
                )
        info = petl_data.describe_dataset(name, root=options.get("data.root"), **extra)
        if info.class_names is not None and list(info.class_names) != run.class_names:
            raise UsageError(
                f"{options.get('data.root')} has classes {', '.join(info.class_names)}; "
                f"the run was trained on {', '.join(run.class_names)}"
            )
        if info.num_classes != len(run.class_names):
            raise UsageError(f"{name} has {info.num_classes} classes, the run has {len(run.class_names)}")
        spec = run.spec
        # eval_transform: split=train of a cropping run is scored on its centre crops, as val and test are, not on a
        # new random crop and flip per image at every call.
        dataset = petl_data.build_dataset(
            name, split, image_size=spec.image_size, mean=spec.mean, std=spec.std, interpolation=spec.interpolation,
            augment=spec.crop, eval_transform=True, root=options.get("data.root"), options=extra,
        )  # fmt: skip
    except petl_data.BadImagesError as error:
        raise UsageError(str(error)) from None
    except petl_data.DatasetUnavailableError as error:
        raise RuntimeError(str(error)) from None
    except ValueError as error:
        raise UsageError(str(error)) from None
    return dataset, split


def _print_table(predictions: list[Prediction], several_runs: bool) -> None:
    for p in predictions:
        ranked = "  ".join(f"{label} {prob:.1%}" for label, prob in zip(p.labels, p.probabilities, strict=True))
        run = f"{p.run}  " if several_runs else ""
        print(shown(f"{run}{p.source}  {ranked}"))


def csv_text(predictions: list[Prediction], several_runs: bool) -> str:
    """One row per image (and run): path, then label_1, prob_1, ... label_k, prob_k; no cell starts a formula."""
    k = max((len(p.labels) for p in predictions), default=0)
    header = (["run"] if several_runs else []) + ["path"]
    header += [f"{kind}_{i}" for i in range(1, k + 1) for kind in ("label", "prob")]
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(header)
    for p in predictions:
        probabilities = (f"{q:.6f}" for q in p.probabilities)
        cells = [cell for pair in zip(p.labels, probabilities, strict=True) for cell in pair]
        writer.writerow([csv_cell(shown(cell)) for cell in ([p.run] if several_runs else []) + [p.source] + cells])
    return buffer.getvalue()


def _record(p: Prediction, several_runs: bool) -> dict:
    record = {"run": p.run} if several_runs else {}
    record.update(path=p.source, labels=[shown(label) for label in p.labels], probabilities=p.probabilities)
    return record


def json_text(predictions: list[Prediction], several_runs: bool) -> str:
    """Every prediction as one JSON list of ``{path, labels, probabilities}`` (and ``run`` with several runs)."""
    return json.dumps([_record(p, several_runs) for p in predictions], indent=1) + "\n"


def jsonl_text(predictions: list[Prediction], several_runs: bool) -> str:
    """One JSON object per line, as :func:`json_text` writes them."""
    return "".join(json.dumps(_record(p, several_runs)) + "\n" for p in predictions)


# out='s suffix decides the format.
WRITERS = {".csv": csv_text, ".json": json_text, ".jsonl": jsonl_text}


def write_predictions(path: Path, predictions: list[Prediction], several_runs: bool) -> None:
    """Write ``predictions`` in the format ``path``'s suffix names, atomically (all of it, or the old file kept).

    Raises:
        UsageError: a suffix that is not one of :data:`WRITERS`.

    """
    writer = WRITERS.get(path.suffix.lower())
    if writer is None:
        raise UsageError(f"out={shown(path)}: choose a {', '.join(WRITERS)} file name (the suffix sets the format)")
    data = writer(predictions, several_runs).encode("utf-8")
    _write_or_say(path, lambda tmp: tmp.write_bytes(data))


def _write_or_say(path: Path, write: Callable[[Path], None]) -> None:
    """``write_atomic``; a failure (full disk, read-only folder) names ``path``, which is unchanged."""
    try:
        write_atomic(path, write)
    except OSError as error:
        kept = "the earlier file is kept as it was" if path.exists() else "nothing was written"
        raise RuntimeError(f"cannot write {shown(path)} ({error.strerror or error}): {kept}") from None


def write_csv(path: Path, predictions: list[Prediction], several_runs: bool) -> None:
    """``predictions`` as CSV (:func:`csv_text`), written atomically."""
    data = csv_text(predictions, several_runs).encode("utf-8")
    write_atomic(path, lambda tmp: tmp.write_bytes(data))


def _print_confusion(matrix: np.ndarray, names: list[str]) -> None:
    if len(names) > 20:
        return  # unreadable on a terminal: the PNG (confusion=PATH) shows it
    width = max(6, *(len(n) for n in names))
    print("confusion (rows: true class, columns: predicted)")
    print(" " * width + " " + " ".join(f"{n[:width]:>{width}}" for n in names))
    for name, row in zip(names, matrix, strict=True):
        print(f"{name:>{width}} " + " ".join(f"{int(v):>{width}}" for v in row))


def save_confusion_png(path: Path, matrix: np.ndarray, names: list[str], title: str) -> None:
    """The confusion matrix as a PNG heat map (rows: true class, columns: predicted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [shown(name) for name in names]
    size = max(4.0, 0.45 * len(names) + 2)
    fig, ax = plt.subplots(figsize=(size, size))
    ax.imshow(matrix, cmap="Blues")
    ax.set_xticks(range(len(names)), names, rotation=90)
    ax.set_yticks(range(len(names)), names)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true class")
    ax.set_title(title)
    if len(names) <= 20:
        # White on the cells past the colour scale's middle, as scikit-learn's ConfusionMatrixDisplay: black on
        # Blues' dark end could not be read, and that is the diagonal of a good run.
        middle = (matrix.max() + matrix.min()) / 2
        for (row, col), value in np.ndenumerate(matrix):
            colour = "white" if value > middle else "black"
            ax.text(col, row, str(value), ha="center", va="center", fontsize=8, color=colour)
    for text in fig.findobj(matplotlib.text.Text):
        text.set_parse_math(False)  # class names are text: "cost_$5_vs_$10" is not mathtext
    fig.tight_layout()
    try:
        _write_or_say(path, lambda tmp: fig.savefig(tmp, format="png"))
    finally:
        plt.close(fig)


def _check(positional: list[str], options: dict) -> tuple[list[Path], list[str]]:
    """The run folders and the image arguments of a command line, its options checked."""
    runs = []
    for item in positional:
        # Neither is an image folder: say what it is, wherever it stands (after a run it was searched for images).
        unfinished = unfinished_run(Path(item)) or exported_not_run(Path(item))
        if unfinished is not None:
            raise UsageError(unfinished)
        if not _is_run(Path(item)):
            break
        runs.append(Path(item))
    if not positional:  # as petl-serve says it (a bare command named a run folder '(none)')
        raise UsageError(
            "no run folder given: petl-predict RUN_DIR [RUN_DIR ...] IMAGES... (or data=NAME data.root=PATH)"
        )
    if not runs:
        first = positional[0]
        # The run's model.json or weights (its folder), or a file petl-export wrote (how timm loads it).
        if Path(first).is_file() and (_is_run(Path(first).parent) or exported_file_not_run(Path(first), first)):
            raise UsageError(file_not_run(Path(first), first))
        later = next((item for item in positional[1:] if _is_run(Path(item))), None)
        if later is not None:  # the images came before the run: the order is the fault, not the folder
            raise UsageError(
                f"{first} is not a run folder, {later} is: give the run folders first, then the images "
                f"(petl-predict {later} ... {first} ...)"
            )
        raise UsageError(f"{first} is not a run folder (no {WEIGHTS_FILE}): give a petl-run output_dir first")
    images = positional[len(runs) :]
    # Each image's rows came twice, and a run's confusion file was written twice; as petl-serve serves it once.
    runs, again = given_once(runs)
    for run in again:
        print(f"{PROG}: note: {run} was given more than once: predicted once", file=sys.stderr)
    if "data" in options and images:
        raise UsageError("give images or data=..., not both")
    if "data" not in options and not images:
        raise UsageError("no images given: name image files, folders or .txt lists (or data=NAME data.root=PATH)")
    for key in ("top_k", "batch_size"):
        if key in options and options[key] < 1:
            raise UsageError(f"{key}={options[key]}: must be at least 1")
    if "out" in options and Path(options["out"]).suffix.lower() not in WRITERS:
        raise UsageError(f"out={options['out']}: choose a {', '.join(WRITERS)} file name (the suffix sets the format)")
    if "confusion" in options and Path(options["confusion"]).suffix.lower() != ".png":
        raise UsageError(f"confusion={options['confusion']}: the matrix is drawn as a PNG: name a .png file")
    check_targets(runs, options)
    return runs, images


def confusion_files(target: Path, runs: list[Path]) -> dict[Path, Path]:
    """The PNG each run's confusion matrix goes to: ``target``, or with several runs ``<stem>_<run label>.png``."""
    if len(runs) == 1:
        return {runs[0]: target}
    labels = run_labels(runs)
    return {run: target.with_name(f"{target.stem}_{labels[run]}{target.suffix}") for run in runs}


def check_targets(runs: list[Path], options: dict) -> None:
    """Refuse to write over files the command did not write, before anything is loaded.

    A file inside a run folder (any run's: a folder above it holds ``model.json``, ``result.json``...) is refused
    even with ``overwrite=true``: a run's files are replaced by a run, never by a prediction.  An existing file
    is replaced only with ``overwrite=true``.

    Raises:
        UsageError: ``out=`` or ``confusion=`` inside a run folder, a folder, or files in the way (one line).

    """
    written = [("out", Path(options["out"]))] if "out" in options else []
    if "confusion" in options:
        written += [("confusion", path) for path in confusion_files(Path(options["confusion"]), runs).values()]
    for key, path in written:
        try:
            check_outside_runs(path, f"{key}={shown(options[key])}", "a prediction")
            if path.is_dir():
                raise UsageError(f"{key}={shown(options[key])} is a folder: name a new {path.suffix} file")
            # Without fill: a full disk is a prediction that cannot complete (exit 1, docs/cli.md), said on writing.
            unwritable = cannot_write_in(path.parent)
        except ValueError as error:
            raise UsageError(str(error)) from None
        except OSError as error:  # even a look fails: a name longer than the file system takes
            unwritable = cannot_be_written(path, error)
        if unwritable is not None:
            raise UsageError(f"{key}={shown(options[key])}: {unwritable}")
    in_the_way = [shown(path) for _, path in written if path.exists()]
    if in_the_way and not options.get("overwrite", False):
        exists = "already exists" if len(in_the_way) == 1 else "already exist"
        raise UsageError(f"{', '.join(in_the_way)} {exists}: write elsewhere, or add overwrite=true to replace it")


def _load(folder: Path, merge: bool) -> LoadedRun:
    run = load_run(folder)
    if merge:
        spec = get_method(run.card["method"])
        if spec.mergeable:
            try:
                surgery.merge(run.model, restorable=False)  # never unmerged: no copy kept
            except ValueError as error:  # a layer that cannot hold its update: all or nothing, the model runs unmerged
                print(f"{PROG}: note: method {spec.name}: {error}", file=sys.stderr)
        else:
            print(f"{PROG}: note: method {spec.name} is not mergeable: predicting unmerged", file=sys.stderr)
    if torch.cuda.is_available():
        run.model.cuda()
    return run


def _groups(runs: list[Path], merge: bool, quiet: bool) -> list[list[Path]]:
    """The runs grouped by the backbone they share (in the order given); with ``merge``, each run alone."""
    if merge:
        if not quiet:
            print(f"{PROG}: note: --merge: each run predicts with its own merged model, not together", file=sys.stderr)
        return [[run] for run in runs]
    groups: dict[str, list[Path]] = {}
    for run in runs:
        try:
            key = _backbone_key(read_card(run))
        except RunFolderError as error:
            raise UsageError(str(error)) from None
        groups.setdefault(key, []).append(run)
    if len(groups) > 1 and not quiet:
        for group in groups.values():
            if len(group) == 1:
                print(
                    f"{PROG}: note: {group[0]} was trained on another backbone or preprocessing than the other "
                    "runs: predicting it with its own model",
                    file=sys.stderr,
                )
    return list(groups.values())


def run_labels(runs: list[Path]) -> dict[Path, str]:
    """A distinct file-name part per run: its folder name, or its path from the folder the runs share.

    Two runs both named ``seed0`` (``a/lora/seed0``, ``b/lora/seed0``) get ``a_lora_seed0`` and ``b_lora_seed0``,
    so files written per run never replace one another.
    """
    names = [run.name for run in runs]
    if len(set(names)) == len(names):
        return dict(zip(runs, names, strict=True))
    resolved = [run.resolve() for run in runs]
    common = Path(os.path.commonpath(resolved))
    labels = ["_".join(run.relative_to(common).parts) or run.name for run in resolved]
    return dict(zip(runs, labels, strict=True))


def run_command(positional: list[str], options: dict, merge: bool = False, quiet: bool = False) -> int:
    """Predict or evaluate as ``petl-predict`` does: run folders then images (or ``data=``); returns 0.

    Args:
        positional: run folders, then images, folders of images or ``.txt`` lists.
        options: the command's ``key=value`` options, typed (:data:`petl.cli.predict.KEYS`).
        merge: fold mergeable methods into the backbone first (``--merge``).
        quiet: no progress bar and no table (``--quiet``).

    Raises:
        UsageError: bad input, in one line.

    """
    runs, items = _check(positional, options)
    device_type = "cuda" if torch.cuda.is_available() else "cpu"  # where _load and serve_together put the model
    try:
        precision = inference_precision(options.get("precision", "auto"), device_type)
    except ValueError as error:
        raise UsageError(str(error)) from None
    progress = not quiet  # and stderr a terminal: petl.utils.progress decides
    paths = image_paths(items, quiet) if items else []
    several = len(runs) > 1
    bad: list[tuple[Path, str]] = []
    by_run: dict[Path, list[Prediction]] = {}
    alone = runs
    read: dict[Path, _TestFolder] = {}  # a test/ folder of new labelled images, read once for every run
    if items and len(runs) > 1:
        alone = []
        for group in _groups(runs, merge, quiet):
            if len(group) == 1:
                alone += group
                continue
            try:
                served, together, refused = serve_together(group, quiet)
            except (RunFolderError, ValueError) as error:
                raise UsageError(str(error)) from None
            alone += refused
            if served is not None:
                found, unreadable = predict_together(
                    served, together, paths, options.get("top_k", 5), options.get("batch_size", 64), progress, precision
                )
                for prediction in found:
                    by_run.setdefault(Path(prediction.run), []).append(prediction)
                bad += [item for item in unreadable if item not in bad]
    for folder in alone:
        try:
            run = _load(folder, merge)
        except (RunFolderError, ValueError) as error:  # ValueError: weights that do not fit (load_trainable)
            raise UsageError(str(error)) from None
        if "data" in options:
            with decode_progress(_say if progress else None):  # every image of the split is decoded first
                dataset, split = _eval_dataset(run, options, read)
            matrix, truth, predicted = evaluate_split(run, dataset, options.get("batch_size", 64), progress, precision)
            accuracy = 100.0 * float(np.trace(matrix)) / max(1, int(matrix.sum()))
            print(f"{folder}: top-1 {accuracy:.2f}% on {int(matrix.sum())} images of {options['data']} {split}")
            if not quiet:
                _print_confusion(matrix, run.class_names)
            if "confusion" in options:
                target = confusion_files(Path(options["confusion"]), runs)[folder]
                save_confusion_png(target, matrix, run.class_names, f"{folder.name}: {split}, top-1 {accuracy:.1f}%")
                print(f"wrote {shown(target)}")
            continue
        found, unreadable = predict_images(
            run, paths, options.get("top_k", 5), options.get("batch_size", 64), progress, precision
        )
        by_run[folder] = found
        bad += [item for item in unreadable if item not in bad]
    predictions = [p for folder in runs for p in by_run.get(folder, [])]  # in the order the runs were given
    if not quiet and (predictions or "data" in options):
        print(f"{PROG}: predicted on {device_type} in {describe(precision, device_type)}", file=sys.stderr)
    if predictions:
        if not quiet:
            _print_table(predictions, several)
        if "out" in options:
            write_predictions(Path(options["out"]), predictions, several)
            print(f"wrote {shown(options['out'])} ({plural(len(predictions), 'row')})")
    if bad:
        listing = "; ".join(f"{shown(path)} ({reason})" for path, reason in bad)
        # With nothing predicted there are no others to speak of (one bad image given alone, or every one bad).
        others = ", the others were predicted" if predictions else ", nothing was predicted"
        # What to do, as petl-run says it of a folder's bad images ("fix or remove them"): the reasons alone said
        # "not a readable image..." or "cannot decode..." and left it there.
        raise UsageError(f"{len(bad)} image(s) cannot be read{others}: {listing}: fix them, or leave them out")
    return 0
