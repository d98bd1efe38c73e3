"""Image datasets over files or hub rows, decoded the same way: turned upright by their EXIF orientation, 16-bit grey
scaled to 8 bits, bad files named.

Shared by every family of real datasets (:mod:`petl.data.vtab`) and by datasets read from a user's folder.
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import ExifTags, Image, UnidentifiedImageError
from torch.utils.data import Dataset, Subset

from petl.data.registry import BadImagesError
from petl.data.transforms import ImageSpec, UnfitImage, check_resize, eight_bit, pil_to_tensor, resized
from petl.utils.progress import progress_bar
from petl.utils.text import first_line, shown

# Decoded images of one split are held in memory up to this many bytes (uint8, each at the size the split's
# transform first resizes it to where that is smaller than its stored size: held_form).  VTAB-1k's splits and
# FGVC's train/val splits fit far below it; a split above it (e.g. a large test split of full-size photos:
# NABirds' ~24,600) is still fully decoded and checked once when built, but then decodes each image again on every
# access.
DECODED_MEMORY_LIMIT = 4 << 30

# Within fingerprint_only(), FileListDatasets hash their files and decode nothing (a finished run's check compares
# fingerprints alone: decoding a large test split, tens of thousands of photos, would cost minutes per task).
_FINGERPRINT_ONLY: ContextVar[bool] = ContextVar("petl_fingerprint_only", default=False)


@contextmanager
def fingerprint_only() -> Iterator[None]:
    """Within the block, a :class:`FileListDataset` (or ``data=hf``'s rows) reads and hashes its images, decodes none.

    Its ``fingerprint`` and ``digests`` are what a full build gives; its images are decoded on access, and a file
    that cannot be decoded is not found here (only one that cannot be read).
    """
    token = _FINGERPRINT_ONLY.set(True)
    try:
        yield
    finally:
        _FINGERPRINT_ONLY.reset(token)


def hashing_only() -> bool:
    """Whether a dataset built now only hashes its images (within :func:`fingerprint_only`)."""
    return _FINGERPRINT_ONLY.get()


# Where the commands say how far decoding a split has come (petl-run's log, petl-bench's stderr): a folder of a few
# thousand phone photos takes minutes to decode before the first epoch.  None, the default: nothing said (the Python
# API, a command's progress switched off).  Work that ends within DECODE_DELAY_S says nothing either.
_DECODE_SAY: ContextVar[Callable[[str], Any] | None] = ContextVar("petl_decode_say", default=None)
DECODE_DELAY_S = 5.0


@contextmanager
def decode_progress(say: Callable[[str], Any] | None) -> Iterator[None]:
    """Within the block, decoding a split of image files says how far it has come through ``say``.

    A bar where stderr is a terminal, else ``reading NAME: K/N imgs`` lines through ``say``
    (:func:`petl.utils.progress.progress_bar`), each only once the split has taken :data:`DECODE_DELAY_S` seconds.

    Args:
        say: writes one line (a command's ``log.info`` or its print to stderr); None says nothing.

    """
    token = _DECODE_SAY.set(say)
    try:
        yield
    finally:
        _DECODE_SAY.reset(token)


def decoding(items: Sequence[Any], name: str) -> Iterable[Any]:
    """``items`` as they are decoded, saying how far it is where :func:`decode_progress` asks (``reading NAME``)."""
    say = _DECODE_SAY.get()
    return progress_bar(
        items, desc=f"reading {name}", unit="img", show=say is not None, say=say, leave=False, delay=DECODE_DELAY_S
    )


# The formats an image file is decoded as, by its content, whatever its name: those of the extensions a folder is
# read by (petl.data.folder.IMAGE_EXTENSIONS; PPM reads .pgm too) and GIF, in training, petl-predict and petl-serve
# alike.  Pillow reads many more, which are not tried: an EPS named photo.jpg in a downloaded folder would run
# Ghostscript (an outside program with a long record of exploits) where it is installed, and an ICO, PCX or JPEG 2000
# file would be trained on and predicted, then refused by petl-serve.  JPEG includes a phone's MPO (Pillow's JPEG
# opener returns it).
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "BMP", "GIF", "TIFF", "PPM")
FORMAT_NAMES = "PNG, JPEG, WebP, BMP, GIF, TIFF or PPM"  # IMAGE_FORMATS as the messages name them


# EXIF Orientation 2-8 and the turn that makes the stored pixels upright: the table of PIL.ImageOps.exif_transpose.
_ORIENTATION_TURNS = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


def upright(image: Image.Image) -> Image.Image:
    """A decoded image turned as its EXIF Orientation tag says: the pixels ``PIL.ImageOps.exif_transpose`` gives.

    A phone photo is often stored sideways with a tag saying how to turn it; viewers turn it, and so must training
    and prediction.  An image without the tag (or with 1) is returned as it is, not copied.  Only the pixels are
    turned: exif_transpose also rewrites the EXIF block, which raises on many damaged ones (a bad rational, a tag of
    the wrong type) whose orientation reads fine.  EXIF that cannot be read at all leaves the image as stored:
    damaged metadata never makes a readable image fail.  (Pillow turns a TIFF itself as it loads it and drops the
    tag, so a TIFF is not turned twice.)
    """
    try:
        with pillow_quiet():  # Pillow warns of corrupt EXIF in lines naming no file; the pixels are what matters here
            orientation = image.getexif().get(ExifTags.Base.Orientation)
    except Exception:  # Pillow's EXIF parser raises many kinds on damaged blocks (struct.error, UnicodeDecodeError...)
        return image
    turn = _ORIENTATION_TURNS.get(orientation) if isinstance(orientation, int) else None
    return image if turn is None else image.transpose(turn)


def to_uint8(image: Image.Image) -> np.ndarray:
    """A decoded image as uint8 ``[H, W]`` (grey) or ``[H, W, 3]`` (everything else).

    ``Image.convert`` clips high-bit-depth greyscale at 255, which turns a 16-bit PNG nearly white;
    such images are scaled to 8 bits here instead.  Float images are refused (no known range).
    """
    image = eight_bit(image)
    if image.mode in ("1", "L"):
        return np.asarray(image.convert("L"))
    if image.mode == "P" and "transparency" in image.info:
        # Straight to RGB, Pillow warns in two lines naming no file (a PNG with a transparent palette, common on the
        # web); through RGBA the colours are the same and nothing is said.
        image = image.convert("RGBA")
    return np.asarray(image.convert("RGB"))


# pillow_quiet's one filter, shared by every thread inside it (:func:`pillow_quiet`): how many are inside, and the
# catch_warnings that the first one in entered and the last one out leaves.
_quiet_lock = threading.Lock()
_quiet_inside = 0
_quiet_filters: warnings.catch_warnings | None = None


@contextmanager
def pillow_quiet() -> Iterator[None]:
    """Within the block, Pillow's own warnings are not shown: each is two lines on stderr naming no file.

    Pillow warns of an image above ``MAX_IMAGE_PIXELS`` (a 108-megapixel photo), then decodes it (one above twice
    that raises, and the caller names the file), and of damaged metadata it reads past: a TIFF cut after its header
    printed "UserWarning: Corrupt EXIF data..." before petl's own line naming it, in petl-run, petl-predict and
    petl-serve's log.  What the image is, readable or not, is petl's to say, by its file.

    Safe in threads (petl-serve decodes uploads in several): ``warnings.catch_warnings`` swaps the process's one
    filter list and puts back the list it found (unless Python runs with context-aware warnings), so two threads
    each in their own would put back each other's lists out of order: one thread's Pillow warnings shown while it
    decodes, and the filter left on for good.  The threads inside share one: the first in enters it, the last out
    leaves it.
    """
    global _quiet_inside, _quiet_filters
    with _quiet_lock:
        if _quiet_inside == 0:
            _quiet_filters = warnings.catch_warnings()
            _quiet_filters.__enter__()
            # Those Pillow's modules raise (warnings.warn in PIL.Image, PIL.TiffImagePlugin...); others still show.
            warnings.filterwarnings("ignore", module=r"PIL\.")
        _quiet_inside += 1
    try:
        yield
    finally:
        with _quiet_lock:
            _quiet_inside -= 1
            if _quiet_inside == 0 and _quiet_filters is not None:
                _quiet_filters.__exit__(None, None, None)
                _quiet_filters = None


def decode_image(data: bytes) -> np.ndarray:
    """Decode one image file's bytes fully (truncation shows here, not later), :func:`upright`, to a uint8 array.

    Every image file petl decodes itself comes through here (data folders, ``data=hf`` rows, petl-predict's files,
    petl-serve's uploads), so training, evaluation and prediction see the same pixels, and read the same files:
    those of :data:`IMAGE_FORMATS` by their content, whatever their name (another is "not a readable image").

    Args:
        data: the file's bytes.

    Raises:
        ValueError: the bytes are not a decodable image; the message says why in a few words.

    """
    if not data:
        raise ValueError("empty file")
    try:
        with pillow_quiet(), Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as image:
            image.load()
            return to_uint8(upright(image))
    except UnidentifiedImageError:
        raise ValueError(f"not a readable image: not a {FORMAT_NAMES} file, or its header is damaged") from None
    except Image.DecompressionBombError:
        limit = 2 * (Image.MAX_IMAGE_PIXELS or 0)
        raise UnfitImage(
            f"more than {limit:,} pixels, Pillow's limit against decompression bombs: downscale it"
        ) from None
    except (OSError, SyntaxError, EOFError) as error:
        # Pillow reports truncated and corrupt files as OSError, some broken headers as SyntaxError.
        raise ValueError(f"cannot decode: {first_line(error, type(error).__name__)}") from None


def held_form(array: np.ndarray, spec: ImageSpec) -> np.ndarray:
    """What a dataset holds of a decoded image for ``spec``: the image resized as :func:`pil_to_tensor` first
    resizes it (:func:`petl.data.transforms.resized`), where that is smaller, else the image as decoded.

    :func:`pil_to_tensor` gives the same tensor for either, augmented or not (the random crop and flip come after
    that resize), so a folder of 12-megapixel photos is held at a few hundred kilobytes each, not 36 MB, and every
    result stays as it was.

    Raises:
        UnfitImage: an image ``spec``'s resize would make too large (:func:`petl.data.transforms.check_resize`),
            said here, where a split is built, rather than on its first read in training.
    """
    check_resize(array.shape[1], array.shape[0], spec)
    if array.shape[0] * array.shape[1] <= spec.image_size**2:  # no resize for spec is smaller: none to make
        return array
    small = np.asarray(resized(Image.fromarray(array), spec))
    return small if small.nbytes < array.nbytes else array


def geometry(spec: ImageSpec) -> tuple[int, bool, str]:
    """What of ``spec`` :func:`held_form` depends on: images held for one geometry serve another only decoded again."""
    return spec.image_size, spec.crop, spec.interpolation


class FileListDataset(Dataset):
    """Images listed by path, all decoded once when built and held as uint8 in memory.

    Building decodes every listed file, so a corrupt, truncated, empty or unsupported image stops
    the run before training (all bad files reported at once, by path) rather than after the last
    epoch; and training then never decodes a JPEG again.  Measured on 1,000 generated 224 px
    JPEGs read at 224 px (2-core machine shared with other jobs, so indicative only): one pass
    over the split took 1.15-1.81 s decoding per access and 0.78-1.12 s from the held arrays
    (1.5-1.8x), for a one-off 0.84 s decode, check and fingerprint at build time.  Items go
    through the same PIL-image transform as before.

    Args:
        items: ``(absolute image path, label)`` pairs.
        spec: output size and normalisation.
        name: the dataset's name, for error messages.
        folder: the task folder; the fingerprint uses paths relative to it.

    Attributes:
        fingerprint: sha256 (hex) over every item's relative path, label and file bytes, in list
            order: two builds hold the same data exactly when their fingerprints agree.
        digests: each item's file bytes' sha256 (hex), in item order: a copy of a file has the same one.
        sources: each item's path as text, in item order (what :func:`copies` names).
        images: the decoded uint8 arrays per item (:func:`held_form` for ``spec``), or ``None`` above
            :data:`DECODED_MEMORY_LIMIT`.  A ``spec`` of another :func:`geometry` set afterwards decodes each
            image again on access.

    Raises:
        BadImagesError: naming every listed file that cannot be decoded.

    """

    def __init__(
        self, items: Sequence[tuple[Path, int]], spec: ImageSpec, *, name: str = "dataset", folder: Path | None = None
    ) -> None:
        self.items = list(items)
        self.spec = spec
        self.name = name
        self.images, self.fingerprint, self.digests = _decode_all(name, self.items, folder, spec)
        self.held_for = geometry(spec)
        self.sources = [shown(path) for path, _ in self.items]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.items[index]
        try:
            if self.images is not None and geometry(self.spec) == self.held_for:
                array = self.images[index]
            else:  # checked when built, but the file may have changed since
                array = decode_image(path.read_bytes())
            # Checked when built for the spec then, not for another geometry set since (its resize may be too large).
            return pil_to_tensor(Image.fromarray(array), self.spec), label
        except (OSError, ValueError) as error:
            raise BadImagesError(self.name, [(path, first_line(error, type(error).__name__))]) from None

    @property
    def labels(self) -> list[int]:
        """Every item's label, without decoding images."""
        return [label for _, label in self.items]


def _decode_all(
    name: str, items: Sequence[tuple[Path, int]], folder: Path | None, spec: ImageSpec
) -> tuple[list[np.ndarray] | None, str, list[str]]:
    """Decode every listed file once: the arrays (:func:`held_form`, unless over the limit), fingerprint, SHA-256s."""
    digest = hashlib.sha256()
    digests: list[str] = []
    decoded: dict[Path, np.ndarray] = {}
    seen: set[Path] = set()  # lists may name one file several times: decode it once
    bad: dict[Path, str] = {}
    held = 0
    hash_only = hashing_only()
    keep = not hash_only
    for path, label in decoding(items, name):
        data = b""
        try:
            data = path.read_bytes()
        except OSError as error:
            bad.setdefault(path, f"cannot read: {first_line(error, type(error).__name__)}")
        relative = os.path.relpath(path, folder) if folder is not None else str(path)
        # surrogateescape: a file name that is not UTF-8 hashes as its bytes (UTF-8 names as before).
        digest.update(f"{Path(relative).as_posix()}\t{label}\t{len(data)}\n".encode("utf-8", "surrogateescape"))
        digest.update(data)
        digests.append(hashlib.sha256(data).hexdigest())
        if path in seen or path in bad or hash_only:
            continue
        seen.add(path)
        try:
            array = held_form(decode_image(data), spec)
        except ValueError as error:
            bad[path] = str(error)
            continue
        held += array.nbytes
        if keep and held > DECODED_MEMORY_LIMIT:
            # Too big to hold: drop what is held and only check the rest, so memory stays bounded.
            keep = False
            decoded.clear()
        if keep:
            decoded[path] = array
    if bad:
        raise BadImagesError(name, sorted(bad.items()))
    images = [decoded[path] for path, _ in items] if keep else None
    return images, digest.hexdigest(), digests


def copies(dataset: Dataset, of: Dataset) -> list[tuple[str, str]]:
    """The items of ``dataset`` whose image bytes are those of an item of ``of``: ``(its name, the first such of of)``.

    Items are named by :attr:`FileListDataset.sources` (a path; a ``data=hf`` row's ``split[row]``); a dataset
    without ``sources`` and ``digests`` (or a ``Subset`` of one) has nothing to compare (``[]``).
    """
    first: dict[str, str] = {}
    for source, sha, _ in _sources(of):
        first.setdefault(sha, source)
    return [(source, first[sha]) for source, sha, _ in _sources(dataset) if sha in first and first[sha] != source]


def conflicts(dataset: Dataset) -> list[tuple[str, str]]:
    """The items of ``dataset`` whose image bytes are an earlier item's of another class: ``(its name, the earlier)``.

    The same photo in two class folders trains toward both labels; named as :func:`copies` names items.
    """
    first: dict[str, tuple[str, int]] = {}
    found = []
    for source, sha, label in _sources(dataset):
        earlier = first.setdefault(sha, (source, label))
        if earlier[1] != label:
            found.append((source, earlier[0]))
    return found


def _sources(dataset: Dataset) -> list[tuple[str, str, int]]:
    indices = None
    while isinstance(dataset, Subset):  # data.subset: the items it keeps
        indices = [dataset.indices[i] for i in indices] if indices is not None else list(dataset.indices)
        dataset = dataset.dataset
    sources, digests = getattr(dataset, "sources", None), getattr(dataset, "digests", None)
    if sources is None or digests is None:
        return []
    labels = dataset.labels  # type: ignore[attr-defined]
    keep = range(len(sources)) if indices is None else indices
    return [(sources[i], digests[i], labels[i]) for i in keep]


class HubDataset(Dataset):
    """Rows of a Hugging Face ``datasets.Dataset`` selected by index, transformed lazily.

    Args:
        rows: the hub split.
        indices: which rows form this split.
        image_column: column holding the images.
        label_column: column holding integer labels.
        spec: output size and normalisation.

    """

    def __init__(
        self, rows: Any, indices: Sequence[int], image_column: str, label_column: str, spec: ImageSpec
    ) -> None:
        self.rows = rows
        self.indices = list(indices)
        self.image_column = image_column
        self.label_column = label_column
        self.spec = spec

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        row = self.rows[self.indices[index]]
        # datasets' Image feature decodes it, already turned by its EXIF orientation (datasets>=2.19) as upright() does.
        # The same conversion as local files (16-bit grey scaled to 8 bits, not clipped to white).
        image = Image.fromarray(to_uint8(row[self.image_column]))
        return pil_to_tensor(image, self.spec), int(row[self.label_column])
