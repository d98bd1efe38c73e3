"""Datasets: a registry of VTAB-1k, FGVC and offline mini-VTAB tasks behind one builder.

Usage::

    from petl import data
    data.list_datasets()                       # every registered name
    data.get_info("vtab/dtd").num_classes       # 47
    ds = data.build_dataset("mini/digits", "train800", image_size=32)
    data.describe_dataset("folder", root="my_images").class_names   # your own images (petl/data/README.md)

Importing this package registers every dataset (the modules below register on import).
"""

from petl.data import folder, hf, mini, vtab  # noqa: F401  (importing registers their datasets)
from petl.data.registry import (
    GROUPS,
    PROTOCOL_EPOCHS,
    SPLITS,
    TEST,
    TRAIN,
    TRAIN_VAL,
    TRAINING_SPLITS,
    VAL,
    BadImagesError,
    DatasetInfo,
    DatasetUnavailableError,
    build_dataset,
    describe_dataset,
    get_info,
    list_datasets,
    register_dataset,
)
from petl.data.transforms import IMAGENET_MEAN, IMAGENET_STD, ImageSpec

__all__ = [
    "GROUPS",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "PROTOCOL_EPOCHS",
    "SPLITS",
    "TEST",
    "TRAIN",
    "TRAINING_SPLITS",
    "TRAIN_VAL",
    "VAL",
    "BadImagesError",
    "DatasetInfo",
    "DatasetUnavailableError",
    "ImageSpec",
    "build_dataset",
    "describe_dataset",
    "get_info",
    "list_datasets",
    "register_dataset",
]
