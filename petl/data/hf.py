"""A Hugging Face ``datasets`` dataset of your own: ``data=hf data.root=PATH``.

``root`` is a dataset written by ``save_to_disk`` (a ``DatasetDict`` or a single ``Dataset``, read with
``datasets.load_from_disk``), a folder of parquet files (a hub dataset as downloaded), any other folder (read as an
``imagefolder``), or a hub id ``owner/name`` where the hub is reachable.  Splits answer to petl's names: ``train`` ->
train800, ``validation`` / ``val`` / ``valid`` / ``dev`` -> val200 (without one, the same seeded stratified hold-out as
``data=folder``, refused where train has one row per class), ``test`` -> test (optional).  ``image_column`` /
``label_column`` name the columns; by default the first ``Image`` and ``ClassLabel`` features (else ``image`` /
``label``).  Labels are a ``ClassLabel`` (its names are the class names), integers ``0..K-1``, or strings (sorted, as
folder names are; float numbers are refused, not made classes named ``0.0``); each split's labels are matched to train's
by name (a split's own ``ClassLabel`` may order them otherwise), and a class train lacks is refused.  ``-1``
(``ClassLabel``'s "no label") or an empty label marks a row unlabelled: a split with no label at all (the unlabelled
test split several hub datasets ship) is left out with a warning, so the run reports no test accuracy rather than 0 %; a
split with some unlabelled rows is refused, naming the split and a row.  A row whose image cannot be used is named
``split[row]`` and by its file where it has one (an imagefolder's rows).  Every image is decoded once when a split is
built, so bad images are reported together before training, and the split has a content fingerprint, as local folders
do.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch.utils.data import Dataset

from petl.data import hub
from petl.data.folder import HOLDOUT, lookalike, printed_alike, split_items, stratified_holdout
from petl.data.images import DECODED_MEMORY_LIMIT, decode_image, decoding, geometry, hashing_only, held_form
from petl.data.registry import (
    TEST,
    TRAIN,
    TRAIN_VAL,
    VAL,
    BadImagesError,
    DatasetInfo,
    DatasetUnavailableError,
    register_dataset,
)
from petl.data.transforms import ImageSpec, pil_to_tensor
from petl.data.vtab import find_column
from petl.utils.once import warn_main
from petl.utils.text import first_line, shown

log = logging.getLogger(__name__)

VAL_NAMES = ("validation", "val", "valid", "dev")
# ClassLabel's label of an unlabelled row (datasets' docs: "-1 for missing labels").
NO_LABEL = -1
OPTIONS = ("image_column", "label_column")

HF_INFO = DatasetInfo(
    name="hf",
    group="natural",
    num_classes=0,
    source="a Hugging Face datasets dataset: save_to_disk folder, imagefolder folder, or hub id",
    root="required",
    options=OPTIONS,
)


def _load(root: str) -> Any:
    """The ``DatasetDict`` at ``root``: saved to disk, an imagefolder, or a hub id.

    Raises:
        ValueError: ``root`` cannot be used (a file, neither a folder nor a hub id, a hub id the hub cannot load).
        DatasetUnavailableError: a hub id while the hub cannot be reached, not cached here.

    """
    import datasets

    path = Path(root).expanduser()
    if path.is_dir():
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
            loaded = datasets.load_from_disk(str(path))
        elif any(path.rglob("*.parquet")):
            # A hub dataset's files as downloaded (data/train-00000-of-00001.parquet): datasets infers their splits.
            loaded = datasets.load_dataset(str(path))
        else:
            loaded = datasets.load_dataset("imagefolder", data_dir=str(path))
    elif path.exists():
        raise ValueError(f"hf: root={root} is a file: give a dataset folder (save_to_disk) or a hub id")
    else:
        if not hub.looks_like_id(root):
            raise ValueError(f"hf: root={root} does not exist (and is not a hub id owner/name)")
        try:
            with hub.offline_unless_reachable() as online:
                loaded = datasets.load_dataset(root)
        except Exception as error:  # network, missing repo and format errors come in many types
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
            if not online:  # not the input's fault: the same command runs where the hub is reachable (exit 1)
                raise DatasetUnavailableError(
                    f"hf: root={root} is no folder here, and as a hub id it is not cached and the hub cannot be "
                    f"reached ({reason}): give a local copy, data.root=PATH (save_to_disk), or run where the hub is "
                    "reachable"
                ) from None
            raise ValueError(
                f"hf: cannot load hub dataset {root!r} ({reason}): give a local copy, data.root=PATH (save_to_disk)"
            ) from None
    if isinstance(loaded, datasets.Dataset):
        loaded = datasets.DatasetDict({"train": loaded})
    return loaded


def _column(features: Any, wanted: str | None, kind: str, fallbacks: Sequence[str], option: str) -> str:
    if wanted is not None:
        if wanted not in features:
            raise ValueError(f"hf: {option}={wanted!r} is not a column; the columns are {', '.join(features)}")
        return wanted
    try:
        return find_column(features, kind, fallbacks)
    except ValueError:
        raise ValueError(
            f"hf: no {kind} column among {', '.join(features)}: name it with data.{option}=COLUMN"
        ) from None


def _open(root: str, image_column: str | None, label_column: str | None) -> tuple[Any, str, str, tuple[str, ...]]:
    """The loaded dataset, its image and label columns and the class names; ValueError on what cannot be used.

    datasets' own lines are held back until the dataset is accepted, so a refusal is the only line printed.
    """
    with hub.datasets_quiet_until_accepted():
        return _checked(root, image_column, label_column)


def _checked(root: str, image_column: str | None, label_column: str | None) -> tuple[Any, str, str, tuple[str, ...]]:
    """:func:`_open` with datasets' lines as they come."""
    dataset = _load(root)
    if "train" not in dataset:
        # Name the remedy: petl takes no split mapping, so the user renames the split when saving.
        first, others = next(iter(dataset), "training"), ", ".join(VAL_NAMES[1:])
        raise ValueError(
            f"hf: {root} has splits {', '.join(dataset)}, and no train split: petl reads train, validation (or "
            f"{others}) and test; save it with those names, e.g. "
            f"DatasetDict(train=d[{first!r}], ...).save_to_disk(PATH)"
        )
    unknown = [name for name in dataset if name not in ("train", "test", *VAL_NAMES)]
    if unknown:
        raise ValueError(f"hf: {root} has splits petl cannot place: {', '.join(unknown)} (use train, validation, test)")
    held_out = [name for name in VAL_NAMES if name in dataset]
    if len(held_out) > 1:  # both would be petl's val: one would be dropped without a word
        raise ValueError(f"hf: {root} has splits {' and '.join(held_out)}, both validation splits: keep one")
    features = dataset["train"].features
    image = _column(features, image_column, "Image", ("image", "img"), "image_column")
    if not _holds_images(features[image]):
        # datasets' cast to an image failed later with a pyarrow traceback ("Unsupported cast from int64 to struct").
        raise ValueError(
            f"hf: image column {image!r} holds {_kind(features[image])}, not one image per row (an Image, file paths, "
            "image file bytes or a pixel array): name another with data.image_column=COLUMN"
        )
    if label_column is None and all(column == image for column in features):
        # An imagefolder of loose images: no column to name, so data.label_column= would be no remedy.
        raise ValueError(
            f"hf: {root} has no label column, only the images ({image!r}): put them in one folder per class, "
            f"{root}/train/<class name>/ (read as an imagefolder, or with data=folder), or save a label column"
        )
    label = _column(features, label_column, "ClassLabel", ("label", "labels", "target"), "label_column")
    if image == label:
        raise ValueError(f"hf: {image!r} is both the image and the label column: name the other with data.*_column")
    if type(features[label]).__name__ not in ("ClassLabel", "Value"):
        raise ValueError(
            f"hf: label column {label!r} holds {type(features[label]).__name__} values, not one class per image "
            "(a ClassLabel, integers or strings): name another with data.label_column=COLUMN"
        )
    dtype = str(getattr(features[label], "dtype", ""))
    if dtype.startswith("float"):
        # 0.0 / 1.0 would become classes named "0.0" and "1.0", a regression target one class per value.
        raise ValueError(
            f"hf: label column {label!r} holds {dtype} numbers, not classes (a ClassLabel, integers or strings): "
            f"cast it, d.cast_column({label!r}, datasets.Value('int64')), or name another with "
            "data.label_column=COLUMN"
        )
    for name, split in dataset.items():
        missing = [column for column in (image, label) if column not in split.features]
        if missing:
            raise ValueError(
                f"hf: {root}'s {name} split has no column {missing[0]!r} (its columns are "
                f"{', '.join(split.features)}): give every split the train split's columns"
            )
    dataset = _labelled(root, dataset, label)
    if type(features[label]).__name__ == "ClassLabel":
        names = tuple(features[label].names)
    else:
        values = sorted(dataset["train"].unique(label))
        if all(isinstance(v, int) for v in values) and values != list(range(len(values))):
            raise ValueError(
                f"hf: integer labels in {label!r} must be 0..K-1, found {values[:5]}{'...' if len(values) > 5 else ''}"
                ": renumber them, or cast the column to a ClassLabel or strings"
            )
        names = tuple(str(v) for v in values)
    if len(names) < 2:
        raise ValueError(f"hf: column {label!r} holds {len(names)} class(es); a classifier needs at least 2")
    twins = printed_alike(names)
    if twins:
        raise ValueError(
            f"hf: column {label!r} has classes {twins[0]} and {twins[1]}, which print alike but are two classes "
            f"({ascii(twins[0])} against {ascii(twins[1])}: other Unicode code points or spaces): make them one"
        )
    for name, split in dataset.items():
        extra = sorted(set(_label_names(split, label)) - set(names))
        if extra:
            said = f"hf: {root}'s {name} split has classes that train lacks: {', '.join(extra[:5])}"
            ours, trains = _kind(split.features[label]), _kind(features[label])
            if ours != trains:  # a test split of integers beside train's ClassLabel: its numbers are no names
                raise ValueError(
                    f"{said}; its {label!r} holds {ours} where train's holds {trains}: cast it to train's, "
                    f"d[{name!r}] = d[{name!r}].cast_column({label!r}, d['train'].features[{label!r}])"
                )
            raise ValueError(
                said + (lookalike(extra, names, "train's") or f"; add rows of them to train or remove them from {name}")
            )
    index = {name: i for i, name in enumerate(names)}
    train_labels = [index[name] for name in _label_names(dataset["train"], label)]
    if not any(name in dataset for name in VAL_NAMES) and not any(stratified_holdout(train_labels)):
        # As data=folder refuses it: else val200 is empty and the run goes on with no validation number.
        raise ValueError(
            f"hf: {root}'s train split has at most one row per class, so none can be held out for validation: "
            "add a validation split or more training rows"
        )
    return dataset, image, label, names


def _holds_images(feature: Any) -> bool:
    """Whether a column gives one image per row: an ``Image``, file paths or bytes, a pixel array (nested numbers), or
    the ``{bytes, path}`` records an ``Image`` is stored as, where its type was not recorded (Parquet from pandas).
    """
    if isinstance(feature, dict):  # datasets casts a record holding either field to an Image
        return "bytes" in feature or "path" in feature
    kind = type(feature).__name__
    if kind == "Image" or kind.startswith("Array"):
        return True
    if kind == "Value":
        return feature.dtype in ("string", "large_string", "binary", "large_binary")
    while type(feature).__name__ in ("List", "Sequence", "LargeList"):  # rows of pixels, not several images
        feature = feature.feature
    return type(feature).__name__ == "Value" and feature.dtype.startswith(("int", "uint", "float"))


def _kind(feature: Any) -> str:
    """A label feature in a few words: ``a ClassLabel``, ``int64 values``."""
    if type(feature).__name__ == "ClassLabel":
        return "a ClassLabel"
    if type(feature).__name__ == "Image":
        return "images"
    if type(feature).__name__ in ("List", "Sequence", "LargeList"):
        return f"lists of {_kind(feature.feature)}"
    return f"{getattr(feature, 'dtype', None) or type(feature).__name__} values"


def _label_names(split: Any, label: str) -> list[str]:
    """Each row's class name: its split's own ``ClassLabel`` name (splits may number them otherwise), else its text."""
    feature = split.features[label]
    if type(feature).__name__ == "ClassLabel":
        return [feature.names[value] for value in split[label]]
    return [str(value) for value in split[label]]


def _unlabelled(value: Any) -> bool:
    return value is None or value == NO_LABEL or value == ""


def _labelled(root: str, dataset: Any, label: str) -> Any:
    """``dataset`` without its splits that hold no label at all (said once); ValueError on a partly labelled one."""
    import datasets

    kept = {}
    for name, split in dataset.items():
        values = split[label]
        missing = [row for row, value in enumerate(values) if _unlabelled(value)]
        if not missing:
            kept[name] = split
        elif len(missing) == len(values) and name != "train":
            warn_main(log, f"hf: {root}'s {name} split has no labels (all {NO_LABEL!r} or empty): left out")
        else:
            raise ValueError(
                f"hf: {root}'s {name} split has {len(missing)} row(s) without a label ({label!r} is None, "
                f"empty or {NO_LABEL}), e.g. row {missing[0]}: label them or remove them"
            )
    return datasets.DatasetDict(kept)


def describe_hf(root: str, image_column: str | None = None, label_column: str | None = None) -> DatasetInfo:
    """The dataset's classes and splits, read from its features (no image is decoded)."""
    dataset, _, _, names = _open(root, image_column, label_column)
    has_val = any(name in dataset for name in VAL_NAMES)
    return DatasetInfo(
        name=HF_INFO.name,
        group=HF_INFO.group,
        num_classes=len(names),
        source=f"Hugging Face dataset {root}",
        root="required",
        options=OPTIONS,
        class_names=names,
        splits=(TRAIN, VAL, TRAIN_VAL, TEST) if "test" in dataset else (TRAIN, VAL, TRAIN_VAL),
        val_from_train=None if has_val else HOLDOUT,
    )


class RowsDataset(Dataset):
    """Rows of ``datasets`` splits, every image decoded once when built (checked, fingerprinted, held).

    Args:
        rows: ``(split dataset, row index, label)`` per item; the split's image column holds
            undecoded images (``{"bytes", "path"}``).
        image_column: that column's name.
        spec: output size and normalisation.
        name: for error messages.

    Attributes:
        fingerprint: sha256 over every item's split, row, label and image bytes, in item order.
        digests: each item's image bytes' sha256 (hex), in item order.
        sources: each item as ``split[row]``, in item order (what :func:`petl.data.images.copies` names).

    Raises:
        BadImagesError: naming every row whose image cannot be decoded.

    """

    def __init__(self, rows: list[tuple[Any, str, int, int]], image_column: str, spec: ImageSpec, name: str) -> None:
        self.rows, self.image_column, self.spec, self.name = rows, image_column, spec, name
        digest = hashlib.sha256()
        bad: list[tuple[Path, str]] = []
        hash_only = hashing_only()  # a finished run's check: the fingerprint alone, nothing decoded
        held: list[Any] | None = None if hash_only else []
        size = 0
        self.digests: list[str] = []
        self.sources = [f"{split_name}[{row}]" for _, split_name, row, _ in rows]
        for split, split_name, row, label in decoding(rows, name):
            try:
                data = self._bytes(split, row)
                digest.update(f"{split_name}\t{row}\t{label}\t{len(data)}\n".encode())
                digest.update(data)
                self.digests.append(hashlib.sha256(data).hexdigest())
                if hash_only:
                    continue
                array = held_form(decode_image(data), spec)
            except ValueError as error:
                bad.append((Path(self._name(split, split_name, row)), str(error)))
                continue
            size += array.nbytes
            if held is not None and size > DECODED_MEMORY_LIMIT:
                held = None  # too big to hold: checked now, decoded again on each access
            elif held is not None:
                held.append(array)
        if bad:
            raise BadImagesError(name, bad)
        self.images, self.fingerprint, self.held_for = held, digest.hexdigest(), geometry(spec)

    def _bytes(self, split: Any, row: int) -> bytes:
        """The row's image file bytes; ValueError saying why there are none (no image, a missing file)."""
        value = split[row][self.image_column]
        if value is None:
            raise ValueError(f"no image ({self.image_column!r} is None)")
        if value.get("bytes"):
            return value["bytes"]
        path = value.get("path")
        if not path:
            raise ValueError(f"no image ({self.image_column!r} holds neither bytes nor a path)")
        if not Path(path).is_file():
            # datasets reads a relative path from the current folder, wherever the dataset was saved.
            where = "" if Path(path).is_absolute() else f" (a relative path: read from the current folder {Path.cwd()})"
            raise ValueError(f"no such file{where}")
        return Path(path).read_bytes()

    def _name(self, split: Any, split_name: str, row: int) -> str:
        """A row as a bad image is named: ``split[row]``, and its file where it has one (an imagefolder's rows)."""
        value = split[row][self.image_column]
        path = value.get("path") if isinstance(value, dict) else None
        return f"{split_name}[{row}] {shown(path)}" if path else f"{split_name}[{row}]"

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        split, split_name, row, label = self.rows[index]
        try:
            if self.images is not None and geometry(self.spec) == self.held_for:
                array = self.images[index]
            else:  # above the memory limit, or held for another geometry; a file it names may have changed since
                array = decode_image(self._bytes(split, row))
            # Checked when built for the spec then, not for another geometry set since (its resize may be too large).
            return pil_to_tensor(Image.fromarray(array), self.spec), label
        except (OSError, ValueError) as error:
            where = Path(self._name(split, split_name, row))
            raise BadImagesError(self.name, [(where, first_line(error, type(error).__name__))]) from None

    @property
    def labels(self) -> list[int]:
        """Every item's label, without decoding images."""
        return [row[3] for row in self.rows]


@register_dataset(HF_INFO, describe=describe_hf)
def build_hf(
    split: str,
    spec: ImageSpec,
    *,
    root: str | None,
    strict: bool,
    image_column: str | None = None,
    label_column: str | None = None,
) -> Dataset:
    """One split of a ``datasets`` dataset (``strict`` has no sizes to check here)."""
    import datasets

    dataset, image, label, names = _open(str(root), image_column, label_column)
    index = {name: i for i, name in enumerate(names)}
    items: dict[str, list[tuple[Any, str, int, int]]] = {}
    for split_name in dataset:
        part = dataset[split_name].cast_column(image, datasets.Image(decode=False))
        labels = [index[name] for name in _label_names(part, label)]
        role = "val" if split_name in VAL_NAMES else split_name
        items[role] = [(part, split_name, row, int(value)) for row, value in enumerate(labels)]
    return RowsDataset(split_items(items, split), image, spec, name=f"hf {root}")
