"""The dataset registry: names, metadata, and the single entry point that builds a split.

A dataset is a :class:`DatasetInfo` plus a builder function.  Defining the builder with the
:func:`register_dataset` decorator registers it, so a new dataset is one decorated function in one
file; nothing else has to be edited.  Builders receive already-validated arguments: the split name
is one of :data:`SPLITS` and the image options are bundled into an :class:`~petl.data.transforms.ImageSpec`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from torch.utils.data import Dataset

from petl.data.transforms import IMAGENET_MEAN, IMAGENET_STD, ImageSpec

# The VTAB-1k protocol's four splits, the one home of their names.  Every dataset answers to these
# names so that training code never needs to know which family a dataset comes from.  TRAIN_VAL
# is TRAIN followed by VAL (the final run's training set); a run trains on TRAIN or TRAIN_VAL.
TRAIN, VAL, TRAIN_VAL, TEST = "train800", "val200", "train800val200", "test"
SPLITS: tuple[str, ...] = (TRAIN, VAL, TRAIN_VAL, TEST)
TRAINING_SPLITS: tuple[str, ...] = (TRAIN, TRAIN_VAL)
GROUPS: tuple[str, ...] = ("natural", "specialized", "structured", "fgvc")
# Training epochs of the field's VTAB-1k / FGVC protocol; a dataset may set fewer (DatasetInfo.epochs).
PROTOCOL_EPOCHS = 100


class DatasetUnavailableError(RuntimeError):
    """A dataset's source cannot be reached here (not cached, offline, or a package is missing).

    The message says what is missing and how to provide it; it is raised ``from None`` so the
    user sees one clear sentence rather than a network traceback.
    """


class BadImagesError(ValueError):
    """Listed image files that cannot be decoded, all of them, found when a dataset is built.

    Attributes:
        bad: ``(path, reason)`` for every bad file, sorted by path.

    """

    def __init__(self, dataset: str, bad: Sequence[tuple[Path, str]]) -> None:
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

    """

    name: str
    group: str
    num_classes: int
    source: str
    hub_id: str | None = None
    epochs: int = PROTOCOL_EPOCHS

    def __post_init__(self) -> None:
        if self.group not in GROUPS:
            raise ValueError(f"{self.name}: group {self.group!r} is not one of {GROUPS}")
        if self.num_classes < 2:
            raise ValueError(f"{self.name}: num_classes must be >= 2, got {self.num_classes}")
        if self.epochs < 1:
            raise ValueError(f"{self.name}: epochs must be >= 1, got {self.epochs}")


class Builder(Protocol):
    def __call__(self, split: str, spec: ImageSpec, *, root: str | None, strict: bool) -> Dataset: ...


_REGISTRY: dict[str, tuple[DatasetInfo, Builder]] = {}


def register_dataset(info: DatasetInfo) -> Callable[[Builder], Builder]:
    """Decorator that registers ``builder`` under ``info.name``.

    Args:
        info: the dataset's metadata; its name must not be registered yet.

    Returns:
        A decorator returning the builder unchanged, so builders stay callable directly in tests.

    """

    def decorate(builder: Builder) -> Builder:
        if info.name in _REGISTRY:
            # Two definitions of one name would silently shadow each other depending on import order.
            raise ValueError(f"dataset {info.name!r} is registered twice")
        _REGISTRY[info.name] = (info, builder)
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
    """Metadata of dataset ``name``.

    Raises:
        ValueError: ``name`` is not registered; the message lists the valid names.

    """
    return _lookup(name)[0]


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

    Raises:
        ValueError: unknown name or split, or bad image options.
        DatasetUnavailableError: the source cannot be reached or read.

    """
    info, builder = _lookup(name)
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r} for {name}; valid splits: {', '.join(SPLITS)}")
    crop = info.group == "fgvc" if augment is None else augment
    spec = ImageSpec(
        image_size=image_size,
        mean=tuple(mean),
        std=tuple(std),
        normalize=normalize,
        interpolation=interpolation,
        crop=crop,
        augment=crop and split in TRAINING_SPLITS and not eval_transform,
    )
    return builder(split, spec, root=root, strict=strict)
