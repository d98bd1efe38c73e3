"""The dataset registry: names, metadata, and the single entry point that builds a split.

A dataset is a :class:`DatasetInfo` plus a builder function.  Defining the builder with the
:func:`register_dataset` decorator registers it, so a new dataset is one decorated function in one
file; nothing else has to be edited.  Builders receive already-validated arguments: the split name
is one of :data:`SPLITS` and the image options are bundled into an :class:`~petl.data.transforms.ImageSpec`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from torch.utils.data import Dataset

from petl.data.transforms import IMAGENET_MEAN, IMAGENET_STD, ImageSpec

# The VTAB-1k protocol's four splits, the one home of their names.  Every dataset answers to these
# names so that training code never needs to know which family a dataset comes from.  TRAIN_VAL
# is TRAIN followed by VAL (the final run's training set); a run trains on TRAIN or TRAIN_VAL.
TRAIN, VAL, TRAIN_VAL, TEST = "train800", "val200", "train800val200", "test"
SPLITS: tuple[str, ...] = (TRAIN, VAL, TRAIN_VAL, TEST)
TRAINING_SPLITS: tuple[str, ...] = (TRAIN, TRAIN_VAL)
# Task groups (DatasetInfo.group): VTAB-1k's three, then FGVC; leaderboards print groups in this order.
GROUPS: tuple[str, ...] = ("natural", "specialized", "structured", "fgvc")
# Training epochs of the field's VTAB-1k / FGVC protocol; a dataset may set fewer (DatasetInfo.epochs).
PROTOCOL_EPOCHS = 100
# What a dataset does with ``root``: never reads it (generated data), reads it when given (else the hub),
# or cannot do without it (a user's own folder).
ROOT_USES: tuple[str, ...] = ("none", "optional", "required")


class DatasetUnavailableError(RuntimeError):
    """A dataset's source cannot be reached here (not cached, offline, or a package is missing).

    The message says what is missing and how to provide it; it is raised ``from None`` so the
    user sees one clear sentence rather than a network traceback.
    """


class BadImagesError(ValueError):
    """Listed image files that cannot be decoded, all of them, found when a dataset is built.

    Attributes:
        dataset: the dataset's name, as the message starts.
        bad: ``(path, reason)`` for every bad file, sorted by path.

    """

    def __init__(self, dataset: str, bad: Sequence[tuple[Path, str]]) -> None:
        self.dataset = dataset
        self.bad = list(bad)
        listing = "; ".join(f"{path} ({reason})" for path, reason in self.bad)
        super().__init__(f"{dataset}: {len(self.bad)} listed image(s) cannot be used, fix or remove them: {listing}")


@dataclass(frozen=True)
class DatasetInfo:
    """What is known about a dataset without loading it.

    Attributes:
        name: registry name, e.g. ``"vtab/cifar100"`` or ``"mini/digits"``.
        group: one of :data:`GROUPS` (VTAB's natural / specialized / structured, or fgvc).
        num_classes: number of labels; every label lies in ``[0, num_classes)``.
        source: one line on where the images come from.
        hub_id: Hugging Face hub repository used when no local folder is given, or ``None``.
        epochs: how many epochs a run trains on it by default (``train.epochs`` overrides): the
            protocol's 100, or fewer for tasks small enough for a quick offline run (mini).
        root: what the dataset does with a ``root`` folder: ``none`` (never reads one: passing one is an
            error), ``optional`` (a local copy instead of the hub) or ``required``.
        options: further build options it reads (``image_column``...), passed to its builder by name;
            any other option is refused.
        class_names: the label names in label order, where known.
        splits: the splits it has (a user's folder may have no test split).
        val_from_train: how ``val200`` is held out of the training images when the data has no
            validation split of its own (one line, recorded in result.json), else ``None``.

    A dataset whose classes are only known from its files (``num_classes=0`` and ``root="required"``)
    registers a ``describe`` function: :func:`describe_dataset` with a root returns its description.
    """

    name: str
    group: str
    num_classes: int
    source: str
    hub_id: str | None = None
    epochs: int = PROTOCOL_EPOCHS
    root: str = "optional"
    options: tuple[str, ...] = ()
    class_names: tuple[str, ...] | None = None
    splits: tuple[str, ...] = SPLITS
    val_from_train: str | None = None

    def __post_init__(self) -> None:
        if self.group not in GROUPS:
            raise ValueError(f"{self.name}: group {self.group!r} is not one of {GROUPS}")
        if self.root not in ROOT_USES:
            raise ValueError(f"{self.name}: root {self.root!r} is not one of {ROOT_USES}")
        if self.num_classes < 2 and not (self.num_classes == 0 and self.root == "required"):
            # 0 = read from the data: only a dataset that always has its root can know them.
            raise ValueError(f"{self.name}: num_classes must be >= 2, got {self.num_classes}")
        if self.class_names is not None and len(self.class_names) != self.num_classes:
            raise ValueError(f"{self.name}: {len(self.class_names)} class names for {self.num_classes} classes")
        if self.epochs < 1:
            raise ValueError(f"{self.name}: epochs must be >= 1, got {self.epochs}")

    def crops(self, augment: bool | None) -> bool:
        """Whether its images are cropped (randomly, with a flip, on the training splits) for ``augment``.

        ``None`` (``data.augment``'s default) crops the fgvc group only: VPT's FGVC protocol; VTAB resizes straight
        to the square.
        """
        return self.group == "fgvc" if augment is None else bool(augment)


class Builder(Protocol):
    def __call__(self, split: str, spec: ImageSpec, *, root: str | None, strict: bool, **options: Any) -> Dataset: ...


# Reads a dataset's files (cheaply: folder names, a dataset's features) and describes them.
Describe = Callable[..., DatasetInfo]

_REGISTRY: dict[str, tuple[DatasetInfo, Builder]] = {}
_DESCRIBE: dict[str, Describe] = {}


def register_dataset(info: DatasetInfo, describe: Describe | None = None) -> Callable[[Builder], Builder]:
    """Decorator that registers ``builder`` under ``info.name``.

    Args:
        info: the dataset's metadata; its name must not be registered yet.
        describe: for a dataset known only from its files, ``describe(root, **options) -> DatasetInfo``
            (class count and names, splits), called by :func:`describe_dataset`; it raises ValueError on a
            root it cannot use, naming it.

    Returns:
        A decorator returning the builder unchanged, so builders stay callable directly in tests.

    """

    def decorate(builder: Builder) -> Builder:
        if info.name in _REGISTRY:
            # Two definitions of one name would silently shadow each other depending on import order.
            raise ValueError(f"dataset {info.name!r} is registered twice")
        if info.num_classes == 0 and describe is None:
            raise ValueError(f"dataset {info.name!r} reads its classes from its files: register a describe function")
        _REGISTRY[info.name] = (info, builder)
        if describe is not None:
            _DESCRIBE[info.name] = describe
        return builder

    return decorate


def list_datasets() -> list[str]:
    """Every registered dataset name, sorted."""
    return sorted(_REGISTRY)


def _lookup(name: str) -> tuple[DatasetInfo, Builder]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown dataset {name!r}; valid names: {', '.join(list_datasets())}") from None


def get_info(name: str) -> DatasetInfo:
    """Metadata of dataset ``name`` as registered (``num_classes=0`` where the classes come from its files).

    Raises:
        ValueError: ``name`` is not registered; the message lists the valid names.

    """
    return _lookup(name)[0]


def describe_dataset(name: str, root: str | None = None, **options: Any) -> DatasetInfo:
    """Metadata of dataset ``name`` read with ``root`` and its options, checked against what it reads.

    A dataset whose classes come from its files reads them (folder names, features: no image is
    decoded) and returns their class count, names and splits; others return their registered entry.

    Raises:
        ValueError: ``name`` is not registered (the message lists the valid names); a root given to a
            dataset that reads none, missing where one is needed, or that does not exist; an option
            the dataset does not read; or (from its ``describe``) files it cannot use.

    """
    info = _lookup(name)[0]
    options = {k: v for k, v in options.items() if v is not None}
    _check_inputs(info, root, options)
    describe = _DESCRIBE.get(name)
    if describe is None or root is None:
        return info
    # The description keeps the registered name and fills in what the files say.
    return replace(describe(root, **options), name=name)


def _check_inputs(info: DatasetInfo, root: str | None, options: Mapping[str, Any]) -> None:
    unknown = sorted(key for key, value in options.items() if value is not None and key not in info.options)
    if unknown:
        reads = f"it reads only {', '.join(info.options)}" if info.options else "it takes no options"
        raise ValueError(f"{info.name} does not read {', '.join(unknown)}: {reads}")
    if root is None:
        if info.root == "required":
            raise ValueError(f"{info.name} reads your own files: give the folder with root=PATH (data.root=PATH)")
        return
    if info.root == "none":
        # Given and ignored, the run would train on something else than the user's folder without a word.
        raise ValueError(f"{info.name} is generated in memory and reads no folder: drop root={root}")
    # A dataset that describes its root checks it itself (data=hf also takes a hub id there).
    if info.name not in _DESCRIBE and not Path(root).expanduser().exists():
        raise ValueError(f"{info.name}: root={root} does not exist")


def build_dataset(
    name: str,
    split: str,
    *,
    image_size: int,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    normalize: bool = True,
    root: str | None = None,
    strict: bool = True,
    augment: bool | None = None,
    interpolation: str = "bicubic",
    eval_transform: bool = False,
    options: Mapping[str, Any] | None = None,
) -> Dataset:
    """Build one split of a registered dataset.

    Items are ``(float32 tensor [3, image_size, image_size], int label)``: images are resized to
    ``image_size`` (or resized and cropped, see ``augment``), converted to three channels and, if
    ``normalize``, standardised with ``mean``/``std``.

    Args:
        name: a name from :func:`list_datasets`.
        split: one of ``train800``, ``val200``, ``train800val200``, ``test``.
        image_size: side of the square output images (the backbone's input size).
        mean: per-channel mean, normally the backbone's timm pretrained config value.
        std: per-channel standard deviation, same origin as ``mean``.
        normalize: ``False`` returns pixel values in [0, 1] instead.
        root: folder holding the dataset in the field's layout; real datasets use the hub when
            ``None``.  Mini datasets ignore it.
        strict: check the VTAB-1k split sizes (800/200/1000) of local folders.  Only test
            fixtures turn this off; label ranges are checked either way.
        augment: VPT's FGVC protocol: resize to ``image_size * 256 / 224`` and crop, randomly with a
            horizontal flip on the training splits (train800, train800val200), centred on the
            others (see :mod:`petl.data.transforms`).  ``None`` turns it on for the fgvc group
            only; VTAB resizes straight to the square, as V-PETL Bench does.
        interpolation: resampling filter, normally the backbone's timm pretrained config value.
        eval_transform: build a training split with the evaluation transform (centre crop, no flip):
            for statistics of the training images, such as a method's calibration before training.
        options: the dataset's own options (:attr:`DatasetInfo.options`, e.g. ``image_column``); ``None``
            values count as not given.

    Raises:
        ValueError: unknown name or split, or bad image options.
        DatasetUnavailableError: the source cannot be reached or read.

    """
    info, builder = _lookup(name)
    options = {k: v for k, v in (options or {}).items() if v is not None}
    _check_inputs(info, root, options)
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r} for {name}; valid splits: {', '.join(SPLITS)}")
    crop = info.crops(augment)
    spec = ImageSpec(
        image_size=image_size,
        mean=tuple(mean),
        std=tuple(std),
        normalize=normalize,
        interpolation=interpolation,
        crop=crop,
        augment=crop and split in TRAINING_SPLITS and not eval_transform,
    )
    return builder(split, spec, root=root, strict=strict, **options)
