"""Your own images: ``data=folder``, one sub-folder per class, the layout torchvision's ``ImageFolder`` reads.

    PATH/train/<class>/*.png     required
    PATH/val/<class>/*           optional: without it, a seeded, stratified 20% of train/ is held out
    PATH/test/<class>/*          optional: without it, a run has no test number (and says so)

Class names are the sub-folder names of ``train/`` in sorted order (label ``i`` is the ``i``-th name),
as ``ImageFolder`` and Hugging Face's ``imagefolder`` number them.  Names starting with ``.`` are skipped
(``.git``, ``.ipynb_checkpoints``), as ``imagefolder`` skips them; one holding images is named in a warning.  An
image lying in a split folder itself, outside every class folder, belongs to no class: it is named in a warning too
(each warning said once in a process, however often the folder is read).
``val/`` and ``test/`` may lack a class, never add one.  Files count as images by their extension
(torchvision's list; the others in a class folder are named in a warning, :func:`image_files` says which folders are
searched); every image is then decoded once when a split is built
(:class:`~petl.data.vtab.FileListDataset`): bad files are reported together, by path, before any training,
and the split carries a content fingerprint so a resumed run refuses changed data.
"""

from __future__ import annotations

import logging
import os
import unicodedata
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np
from torch.utils.data import Dataset

from petl.data.images import FileListDataset
from petl.data.registry import TEST, TRAIN, TRAIN_VAL, VAL, DatasetInfo, register_dataset
from petl.data.transforms import ImageSpec
from petl.utils.once import warn_once
from petl.utils.paths import walk_linked
from petl.utils.text import shown

log = logging.getLogger(__name__)

# torchvision.datasets.folder.IMG_EXTENSIONS (written out: petl.data does not import torchvision).
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
# Held out of train/ as val200 when the data has no validation split: per class, with a fixed seed.
VAL_FRACTION = 0.2
VAL_SEED = 0
HOLDOUT = f"{VAL_FRACTION:.0%} of each class of the training images, seed {VAL_SEED}"
# What a run does without each optional split folder.
NO_SPLIT = {"val": f"val200 is {HOLDOUT}", "test": "the run reports no test accuracy"}

FOLDER_INFO = DatasetInfo(
    name="folder",
    group="natural",
    num_classes=0,
    source="your own images: PATH/train/<class>/*, optional PATH/val/<class>/*, PATH/test/<class>/*",
    root="required",
)


def stratified_holdout(labels: list[int], fraction: float = VAL_FRACTION, seed: int = VAL_SEED) -> list[bool]:
    """Which items to hold out: ``fraction`` of every class (at least one of a class with two or more), seeded.

    Args:
        labels: every item's label, in item order.
        fraction: share of each class to hold out.
        seed: seeds the choice, so every run and method holds out the same items.

    Returns:
        ``True`` for the held-out items, in item order.

    """
    rng = np.random.default_rng(seed)
    held = [False] * len(labels)
    by_class: dict[int, list[int]] = {}
    for index, label in enumerate(labels):
        by_class.setdefault(label, []).append(index)
    for label in sorted(by_class):
        members = by_class[label]
        count = min(len(members) - 1, max(1, round(len(members) * fraction)))
        for index in rng.permutation(members)[:count]:
            held[int(index)] = True
    return held


def image_files(folder: Path) -> tuple[list[Path], list[Path]]:
    """The image files under ``folder`` (searched recursively, by extension) and the other files there, each sorted.

    Names starting with ``.`` are skipped at every level: ``.DS_Store``, macOS's ``._photo.jpg``, a
    ``.ipynb_checkpoints/`` copy are never images of a class, nor photos to predict.  Sub-folders that are
    symbolic links are followed, as torchvision's ``ImageFolder`` follows them, each real folder once; a link to
    ``folder`` or a folder above it is not (it would loop, or take in other classes).  A link to a missing file is
    listed, so that reading it names it.  A named pipe, a device or a socket (or a link to one) is among the other
    files whatever its extension: reading a pipe would wait for a writer.
    """
    images: list[Path] = []
    others: list[Path] = []
    for top, dirs, files in walk_linked(folder):
        dirs[:] = [name for name in dirs if not name.startswith(".")]
        for name in files:
            path = Path(top, name)
            if not name.startswith("."):
                image = _is_plain(path) and path.suffix.lower() in IMAGE_EXTENSIONS
                (images if image else others).append(path)
    return sorted(images), sorted(others)


def _is_plain(path: Path) -> bool:
    """A regular file, or a link to a missing one; not a pipe, a device or a socket."""
    return path.is_file() or (path.is_symlink() and not path.exists())


def not_images(others: list[Path], top: Path) -> str:
    """What :func:`image_files` left out under ``top``, in one line: three names of each kind and how many more."""
    files = [path for path in others if _is_plain(path)]
    special = [path for path in others if not _is_plain(path)]
    said = []
    if files:
        said.append(
            f"skipped {some(files, top)} in {shown(top)}: not image files by their extension "
            f"({', '.join(IMAGE_EXTENSIONS)}); convert them to use them"
        )
    if special:
        said.append(
            f"skipped {some(special, top)} in {shown(top)}: not files but pipes, devices or sockets; put the image "
            "files there to use them"
        )
    return "; ".join(said)


def some(paths: list[Path], top: Path) -> str:
    """The first three of ``paths`` relative to ``top``, and how many more: ``a/x.gif, a/y.gif and 5 more``."""
    names = [shown(os.path.relpath(path, top)) for path in paths]
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return f"{', '.join(names[:3])}{more}"


def class_folders(split_dir: Path) -> list[str]:
    """The class folder names of a split folder, sorted; hidden folders holding images and loose images are warned of.

    Raises:
        ValueError: a class folder's name is not UTF-8.

    """
    # A folder whose name starts with "." is not a class (.git, .ipynb_checkpoints, as Hugging Face's imagefolder
    # skips them); one holding images is named in a warning, so that a class is never dropped without a word.
    hidden = sorted(p.name for p in split_dir.iterdir() if p.is_dir() and p.name.startswith(".") and image_files(p)[0])
    if hidden:
        warn_once(
            log,
            f"folder: skipped {', '.join(shown(name) for name in hidden)} in {shown(split_dir)}: folders whose name "
            "starts with '.' are not classes; rename them to use them",
        )
    # An image beside the class folders has no class: said, so that no image is dropped without a word either.
    loose = sorted(
        p.name
        for p in split_dir.iterdir()
        if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS and not p.name.startswith(".")
    )
    if loose:
        more = f" and {len(loose) - 3} more" if len(loose) > 3 else ""
        warn_once(
            log,
            f"folder: skipped {', '.join(shown(name) for name in loose[:3])}{more} in {shown(split_dir)}: an image "
            f"outside the class folders has no class; move it into {shown(split_dir)}/<class name>/ to use it",
        )
    names = sorted(p.name for p in split_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
    for name in names:
        if name != name.encode("utf-8", "surrogateescape").decode("utf-8", "replace"):
            # A class name is recorded (result.json, model.json) and printed: it must be text.
            raise ValueError(f"folder: class folder {shown(split_dir / name)} has a name that is not UTF-8: rename it")
    return names


@lru_cache(maxsize=8)
def _scan(root: Path) -> tuple[tuple[str, ...], dict[str, list[tuple[Path, int]]]]:
    """Class names and ``(path, label)`` items of every split folder present; ValueError names what is wrong."""
    if root.is_file():  # a CSV or a list of labelled files, say: petl reads labels from folder names only
        raise ValueError(
            f"folder: root={root} is a file: give the folder holding train/<class name>/ (the class of an image is "
            "the name of the folder it is in; a list of files and labels is not read: move the images into them)"
        )
    if not root.is_dir():
        raise ValueError(f"folder: root={root} does not exist or is not a folder")
    train_dir = root / "train"
    if not train_dir.is_dir():
        if root.name in ("train", "val", "test") and any(
            p.is_dir() and not p.name.startswith(".") for p in root.iterdir()
        ):
            # The split folder itself was given (data.root=imgs/train): its parent is the root.
            raise ValueError(
                f"folder: {root} is a {root.name}/ folder of class folders, not the root holding train/: give "
                f"data.root={shown(root.parent)}"
            )
        raise ValueError(f"folder: {root} has no train/ folder: put the images in {root}/train/<class name>/")
    names = class_folders(train_dir)
    if len(names) < 2:
        message = f"folder: {train_dir} needs one sub-folder per class (at least 2), found {len(names)}"
        if names:  # train/animals/{cats,dogs}: the classes one level down, which the count alone would not say
            inner = sorted(p.name for p in (train_dir / names[0]).iterdir() if p.is_dir() and p.name[0] != ".")
            if len(inner) >= 2:
                listed = ", ".join(inner[:3]) + (", ..." if len(inner) > 3 else "")
                message += (
                    f": {names[0]}/ holds the folders {listed}; if they are the classes, move them up into {train_dir}/"
                )
        raise ValueError(message)
    twins = printed_alike(names)
    if twins:
        raise ValueError(
            f"folder: {train_dir} has class folders {twins[0]} and {twins[1]}, which print alike but are two classes "
            f"({ascii(twins[0])} against {ascii(twins[1])}: other Unicode code points or spaces): merge them into one"
        )
    label = {name: index for index, name in enumerate(names)}
    splits: dict[str, list[tuple[Path, int]]] = {}
    for split in ("train", "val", "test"):
        split_dir = root / split
        if not split_dir.is_dir():
            continue
        present = names if split == "train" else class_folders(split_dir)
        extra = [name for name in present if name not in label]
        if extra:
            raise ValueError(
                f"folder: {split_dir} has classes that train/ lacks: {', '.join(extra[:5])}"
                + (lookalike(extra, names, "train/'s") or f"; add them to train/ or remove them from {split}/")
            )
        items = []
        skipped: list[Path] = []
        for name in present if split != "train" else names:
            files, others = image_files(split_dir / name)
            skipped += others
            if not files and split == "train":
                # Said here, with the files it does hold (a class of .gif or .heic photos), since the warning
                # naming them below is never reached.
                holds = f", only {some(others, split_dir / name)}: convert them" if others else ": add some"
                raise ValueError(
                    f"folder: {split_dir / name} holds no images ({', '.join(IMAGE_EXTENSIONS)}){holds} or remove it"
                )
            items += [(path, label[name]) for path in files]
        if skipped:  # a class's .gif or .heic photos are never dropped without a word
            warn_once(log, f"folder: {not_images(skipped, split_dir)}")
        if not items:
            holds = f", only {some(skipped, split_dir)}, not images by their extension" if skipped else ""
            raise ValueError(
                f"folder: {split_dir} holds no images in class sub-folders{holds}; put images in "
                f"{split_dir}/<class name>/ or remove {split_dir} (without it, {NO_SPLIT[split]})"
            )
        splits[split] = items
    if "val" not in splits and not any(stratified_holdout([label for _, label in splits["train"]])):
        raise ValueError(
            f"folder: {train_dir} has one image per class, so none can be held out for validation: "
            f"add a {root / 'val'}/<class name>/ folder or more training images"
        )
    return tuple(names), splits


def lookalike(extra: Sequence[str], names: Sequence[str], whose: str) -> str:
    """Where a class of ``extra`` is one of ``names`` written otherwise, the words that say so; else ``""``.

    Args:
        extra: the class names refused.
        names: the class names known, ``whose`` (``train/'s``, ``the run's``).
        whose: who holds ``names``, in the message.

    macOS writes ``café`` as ``e`` and a combining accent (NFD) where Windows and Linux tools write one ``é`` (NFC):
    the two names print alike, so the refusal alone would name a class that seems to be there.  A name in another
    case (``Cat`` against ``cat``) is a class of its own on Linux and the same folder on macOS and Windows, and one
    with a space at its end (``cat ``) prints as the other: said too.  The remedy renames the name of ``extra``:
    ``names`` may be ones the user cannot rename (a trained run's classes, which its files record and check).
    """
    forms = {unicodedata.normalize("NFC", name): name for name in names}
    cases = {_loosely(name): name for name in names}
    for name in extra:
        twin = forms.get(unicodedata.normalize("NFC", name))
        if twin is not None:
            return (
                f" ({name} is {whose} {twin} written with other Unicode code points, {ascii(name)} against "
                f"{ascii(twin)}, as folders made on macOS and elsewhere can be: retype {name} as {whose} one)"
            )
    for name in extra:
        twin = cases.get(_loosely(name))
        if twin is not None:
            how = "in other letter case" if name.strip() == name and twin.strip() == twin else "but for spaces or case"
            return f" ({name!r} is {whose} {twin!r} {how}: rename it {twin!r})"
    return ""


def printed_alike(names: Sequence[str]) -> tuple[str, str] | None:
    """Two of ``names`` that print alike (one Unicode form, spaces at the ends and doubled ones dropped), else None.

    ``café`` in one Unicode form and in the other (macOS's), or ``cat`` and ``cat ``, would be two classes whose
    predictions and reports read the same.  Letter case is not folded: ``A`` and ``a`` may be classes of their own.
    """
    seen: dict[str, str] = {}
    for name in names:
        key = _as_printed(name)
        if key in seen:
            return seen[key], name
        seen[key] = name
    return None


def _as_printed(name: str) -> str:
    """A class name as it prints: one Unicode form, spaces at the ends and doubled ones dropped."""
    return " ".join(unicodedata.normalize("NFC", name).split())


def _loosely(name: str) -> str:
    """A class name as a person reads it: :func:`_as_printed`, and no case."""
    return _as_printed(name).casefold()


def describe_folder(root: str) -> DatasetInfo:
    """The folder's classes and splits, read from its sub-folder names (no image is decoded)."""
    names, splits = _scan(Path(root).expanduser().resolve())
    return _info(names, splits)


def _info(names: tuple[str, ...], splits: dict[str, list]) -> DatasetInfo:
    has_val, has_test = "val" in splits, "test" in splits
    return DatasetInfo(
        name=FOLDER_INFO.name,
        group=FOLDER_INFO.group,
        num_classes=len(names),
        source=FOLDER_INFO.source,
        root="required",
        class_names=names,
        splits=(TRAIN, VAL, TRAIN_VAL, TEST) if has_test else (TRAIN, VAL, TRAIN_VAL),
        val_from_train=None if has_val else HOLDOUT,
    )


def split_items(splits: dict[str, list], split: str) -> list:
    """The items of a petl split name, holding val out of train when there is no val of its own.

    Each item is a tuple ending with its class index (a folder's ``(path, label)``, a ``datasets`` dataset's
    ``(part, split name, row, label)``): the hold-out is stratified by it.
    """
    train = splits["train"]
    if split == TEST:
        if "test" not in splits:
            raise ValueError("no test split: add a test/ folder (or a test split) to evaluate on")
        return splits["test"]
    if "val" in splits:
        return {TRAIN: train, VAL: splits["val"], TRAIN_VAL: train + splits["val"]}[split]
    if split == TRAIN_VAL:
        return train
    held = stratified_holdout([item[-1] for item in train])
    return [item for item, out in zip(train, held, strict=True) if out == (split == VAL)]


@register_dataset(FOLDER_INFO, describe=describe_folder)
def build_folder(split: str, spec: ImageSpec, *, root: str | None, strict: bool) -> Dataset:
    """One split of an image folder (``strict`` has no sizes to check here)."""
    folder = Path(str(root)).expanduser().resolve()
    _scan.cache_clear()  # a build reads the folder as it is now (a describe may have cached an older listing)
    _, splits = _scan(folder)
    return FileListDataset(split_items(splits, split), spec, name=f"folder {folder}", folder=folder)
