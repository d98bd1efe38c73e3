"""The one image pipeline every dataset shares: resize (or resize and crop), three channels, normalisation.

Two entry points do the same thing for two kinds of input: :func:`array_to_tensors` for in-memory
uint8 batches (the mini datasets, converted once) and :func:`pil_to_tensor` for images decoded one
at a time (real datasets, converted lazily).  Both resample with the backbone's own interpolation
(its timm pretrained config's ``interpolation``; bicubic unless told) and antialias when shrinking,
so a model sees the same kind of pixels whichever family a dataset comes from.  :func:`normalize`
is the one place images are standardised (FractalDB pretraining uses it too).

Two geometries, after the references:

* VTAB-1k: resize straight to ``image_size`` x ``image_size`` (V-PETL Bench,
  synbol/Parameter-Efficient-Transfer-Learning-Benchmark@c188fad ImageClassification/dataloader/vtab.py:L72-74);
* FGVC (``crop``): resize the shorter side to ``image_size * 256 / 224`` and crop ``image_size``,
  centred for evaluation, random with a horizontal flip (p=0.5) for training (``augment``)
  (KMnP/vpt@4410440 src/data/transforms.py:L7-41; 224 -> 256, 384 -> 438, 448 -> 512 as there).
  Only decoded images (:func:`pil_to_tensor`) can be cropped or augmented: mini datasets are
  converted once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

# timm's IMAGENET_DEFAULT_MEAN / _STD, written out so importing petl.data does not import timm.
IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)

# Batches converted at once by array_to_tensors: bounds the float32 temporaries at large image sizes.
_CHUNK = 256

# timm's interpolation names -> PIL filters; torch's F.interpolate has the same names for these three.
INTERPOLATIONS = {
    "bicubic": Image.Resampling.BICUBIC,
    "bilinear": Image.Resampling.BILINEAR,
    "nearest": Image.Resampling.NEAREST,
}
# VPT's FGVC resize-then-crop ratio (src/data/transforms.py:L11-19: 256 for 224).
CROP_RATIO = 256 / 224
# Pillow modes holding more than 8 bits per pixel in one channel.  16-bit PNG/TIFF greyscale opens
# as I;16*, some decoders give I (int32) for the same files; all are scaled from 16 to 8 bits.
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")


@dataclass(frozen=True)
class ImageSpec:
    """How images leave a dataset.

    Attributes:
        image_size: side of the square output.
        mean: per-channel mean subtracted when ``normalize``, of pixel values in [0, 1].
        std: per-channel standard deviation divided by when ``normalize``, in (0, 1].
        normalize: whether to standardise; otherwise values stay in [0, 1].
        interpolation: ``bicubic``, ``bilinear`` or ``nearest`` (the backbone's timm pretrained config).
        crop: resize the shorter side to ``image_size * 256 / 224`` and crop ``image_size`` (VPT's
            FGVC geometry) instead of resizing straight to the square.
        augment: a random crop and horizontal flip instead of the centre crop (training splits;
            needs ``crop``).

    """

    image_size: int
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    normalize: bool = True
    interpolation: str = "bicubic"
    crop: bool = False
    augment: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.image_size, int) or self.image_size < 1:
            raise ValueError(f"image_size must be a positive int, got {self.image_size!r}")
        if len(self.mean) != 3 or len(self.std) != 3:
            raise ValueError(f"mean and std need 3 values (RGB), got mean={self.mean}, std={self.std}")
        if not all(math.isfinite(v) for v in (*self.mean, *self.std)):
            # NaN passes both checks below (every comparison with it is False) and would make every pixel NaN.
            raise ValueError(f"mean and std must be finite numbers, got mean={self.mean}, std={self.std}")
        if any(s <= 0 for s in self.std):
            raise ValueError(f"std values must be > 0, got {self.std}")
        if not all(0 <= m <= 1 for m in self.mean) or any(s > 1 for s in self.std):
            # Pixels are in [0, 1] here (timm's convention): 0-255 statistics (mmcv's 123.675...) would standardise
            # every image to about -2 / 0.02 without an error.
            raise ValueError(
                f"mean and std are of pixel values in [0, 1] (timm's convention), got mean={self.mean}, "
                f"std={self.std}: divide 0-255 values by 255"
            )
        if self.interpolation not in INTERPOLATIONS:
            raise ValueError(
                f"interpolation={self.interpolation!r} is not supported: choose one of {', '.join(INTERPOLATIONS)}"
            )
        if self.augment and not self.crop:
            raise ValueError("augment=True needs crop=True (augmentation is a random crop and flip)")


class UnfitImage(ValueError):
    """A readable image petl cannot use as it is; the message already says what to do with it."""


def eight_bit(image: Image.Image) -> Image.Image:
    """``image`` with at most 8 bits per channel: 16-bit greyscale scaled to 8 bits, floating-point pixels refused.

    ``Image.convert`` clips high-bit-depth greyscale at 255, which turns a 16-bit PNG nearly white, and rounds
    float pixels in [0, 1] to black; every other mode is returned as it is.

    Raises:
        UnfitImage: float pixels (mode F: no known range), or 32-bit values outside the 16-bit range.

    """
    if image.mode in SIXTEEN_BIT_MODES:
        values = np.asarray(image).astype(np.int64)
        if values.size and (values.min() < 0 or values.max() > 65535):
            raise UnfitImage(
                f"mode {image.mode} with values outside the 16-bit range [0, 65535]: save it as an 8- or 16-bit image"
            )
        return Image.fromarray(((values * 255 + 32767) // 65535).astype(np.uint8))
    if image.mode == "F":
        raise UnfitImage("floating-point pixels (mode F): save it as an 8- or 16-bit image")
    return image


def normalize(batch: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """Standardise a float ``[N, 3, H, W]`` batch in [0, 1] per channel: ``(x - mean) / std``."""
    mean_t = torch.tensor(mean, dtype=batch.dtype).view(1, 3, 1, 1)
    std_t = torch.tensor(std, dtype=batch.dtype).view(1, 3, 1, 1)
    return (batch - mean_t) / std_t


def _finish(batch: torch.Tensor, spec: ImageSpec) -> torch.Tensor:
    """Resize a float [N, 3, H, W] batch in [0, 1] and normalise it."""
    size = spec.image_size
    if batch.shape[-2:] != (size, size):
        # Antialiasing matters when shrinking (e.g. 64 px scenes to 32 px); bicubic overshoots, so clamp.
        mode = spec.interpolation
        smooth = mode != "nearest"
        batch = F.interpolate(
            batch, size=(size, size), mode=mode, align_corners=False if smooth else None, antialias=smooth
        )
        batch = batch.clamp_(0.0, 1.0)
    if spec.normalize:
        batch = normalize(batch, spec.mean, spec.std)
    return batch.contiguous()


def array_to_tensors(images: np.ndarray, spec: ImageSpec) -> torch.Tensor:
    """Convert a uint8 batch to model input.

    Args:
        images: ``[N, H, W]`` (grey) or ``[N, H, W, 3]`` (RGB) uint8 array.
        spec: output size and normalisation.

    Returns:
        float32 tensor ``[N, 3, image_size, image_size]``.

    """
    if images.dtype != np.uint8:
        raise TypeError(f"expected uint8 images, got {images.dtype}")
    if images.ndim == 3:
        images = images[..., None]
    if images.ndim != 4 or images.shape[-1] not in (1, 3):
        raise ValueError(f"expected [N, H, W] or [N, H, W, 3] images, got shape {images.shape}")
    if spec.crop:
        raise ValueError(
            "in-memory datasets are converted once and cannot be cropped or augmented: leave augmentation off "
            "(data.augment=false; augment=False in build_dataset)"
        )
    out = []
    for start in range(0, len(images), _CHUNK):
        chunk = torch.from_numpy(np.ascontiguousarray(images[start : start + _CHUNK]))
        chunk = chunk.permute(0, 3, 1, 2).float().div_(255.0)
        # Grey images are replicated, not weighted: every channel carries the same signal.
        chunk = chunk.expand(-1, 3, -1, -1)
        out.append(_finish(chunk, spec))
    if not out:
        return torch.empty(0, 3, spec.image_size, spec.image_size)
    return torch.cat(out)


def resize_size(width: int, height: int, spec: ImageSpec) -> tuple[int, int]:
    """The (width, height) :func:`resized` resizes an image of this size to: the square, or (``crop``) the shorter
    side ``image_size * 256 / 224`` and the longer in proportion, which a long thin image makes far larger than
    itself (1 x 20,000 px: 256 x 5,120,000).
    """
    if not spec.crop:
        return spec.image_size, spec.image_size
    short = int(spec.image_size * CROP_RATIO)
    # As torchvision's Resize(int): the shorter side becomes ``short``, the longer one is truncated.
    return (short, int(short * height / width)) if width <= height else (int(short * width / height), short)


def check_resize(width: int, height: int, spec: ImageSpec) -> None:
    """Refuse an image that ``spec``'s resize would make larger than Pillow's limit against decompression bombs.

    A cropping spec resizes the shorter side to ``image_size * 256 / 224`` and the longer in proportion
    (:func:`resize_size`), so a PNG of 118 bytes, 1 x 20,000 px, would become 256 x 5,120,000 px at 224: 3.9 GB
    allocated on each read, or a MemoryError naming no file.  The limit is the one Pillow refuses to decode above (twice
    ``Image.MAX_IMAGE_PIXELS``, none where that is ``None``): no image petl decodes may be made larger than it.

    Raises:
        UnfitImage: the resize over the limit; the message says what to do.

    """
    limit = 2 * (Image.MAX_IMAGE_PIXELS or 0)
    new_width, new_height = resize_size(width, height, spec)
    if limit and new_width * new_height > limit:
        raise UnfitImage(
            f"{width} x {height} px, which the resize (the shorter side to {min(new_width, new_height)} px) makes "
            f"{new_width} x {new_height} px, over Pillow's limit against decompression bombs ({limit:,} pixels): "
            "crop it nearer to a square"
        )


def resized(image: Image.Image, spec: ImageSpec) -> Image.Image:
    """The deterministic front of :func:`pil_to_tensor`: three channels, then the resize ``spec`` asks for.

    Straight to the square, or (``crop``) the shorter side to ``image_size * 256 / 224``; the random crop and flip
    come after it.  Its answer is left as it is by a second call (the sizes it computes from an image it resized are
    that image's own), so :func:`pil_to_tensor` gives the same tensor for an image and for ``resized(image, spec)``:
    a dataset may hold the smaller of the two (:func:`petl.data.images.held_form`).

    Raises:
        UnfitImage: an image of float pixels or of values beyond 16 bits (:func:`eight_bit`), or one the resize would
            make too large (:func:`check_resize`).
    """
    check_resize(*image.size, spec)  # before the conversion: a thin image's RGB copy is cheap, its resize is not
    # Scaled first: a 16-bit grey image straight to RGB would be clipped nearly white.
    image = eight_bit(image).convert("RGB")
    new = resize_size(*image.size, spec)
    # PIL's resize widens its filter when shrinking, i.e. it antialiases like the batch path.
    return image if image.size == new else image.resize(new, INTERPOLATIONS[spec.interpolation])


def _crop(image: Image.Image, spec: ImageSpec) -> Image.Image:
    """VPT's FGVC crop of an image :func:`resized`: a centre or random ``image_size`` square, a random flip."""
    size = spec.image_size
    new_w, new_h = image.size
    if spec.augment:
        # torch's RNG, so DataLoader workers and petl's seeding govern it like dropout.
        left = int(torch.randint(0, new_w - size + 1, ()))
        top = int(torch.randint(0, new_h - size + 1, ()))
    else:
        left, top = round((new_w - size) / 2), round((new_h - size) / 2)
    image = image.crop((left, top, left + size, top + size))
    if spec.augment and float(torch.rand(())) < 0.5:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return image


def pil_to_tensor(image: Image.Image, spec: ImageSpec) -> torch.Tensor:
    """Convert one decoded image to a float32 tensor ``[3, image_size, image_size]``.

    Any mode: grey is replicated to three channels, alpha dropped, 16-bit grey scaled to 8 bits.

    Raises:
        UnfitImage: an image of float pixels or of values beyond 16 bits (:func:`eight_bit`), or one the resize would
            make too large (:func:`check_resize`).
    """
    image = resized(image, spec)
    if spec.crop:
        image = _crop(image, spec)
    array = np.asarray(image, dtype=np.uint8)
    tensor = torch.from_numpy(array.copy()).permute(2, 0, 1).float().div_(255.0)
    return _finish(tensor[None], spec)[0]
