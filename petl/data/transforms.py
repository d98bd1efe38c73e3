"""The one image pipeline every dataset shares: resize, three channels, optional normalisation.

Two entry points do the same thing for two kinds of input: :func:`array_to_tensors` for in-memory
uint8 batches (the mini datasets, converted once) and :func:`pil_to_tensor` for images decoded one
at a time (real datasets, converted lazily).  Both use bicubic resampling with antialiasing so a
model sees the same kind of pixels whichever family a dataset comes from.
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class ImageSpec:
    """How images leave a dataset.

    Attributes:
        image_size: side of the square output.
        mean: per-channel mean subtracted when ``normalize``.
        std: per-channel standard deviation divided by when ``normalize``.
        normalize: whether to standardise; otherwise values stay in [0, 1].

    """

    image_size: int
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    normalize: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.image_size, int) or self.image_size < 1:
            raise ValueError(f"image_size must be a positive int, got {self.image_size!r}")
        if len(self.mean) != 3 or len(self.std) != 3:
            raise ValueError(f"mean and std need 3 values (RGB), got mean={self.mean}, std={self.std}")
        if any(s <= 0 for s in self.std):
            raise ValueError(f"std values must be > 0, got {self.std}")


def _finish(batch: torch.Tensor, spec: ImageSpec) -> torch.Tensor:
    """Resize a float [N, 3, H, W] batch in [0, 1] and normalise it."""
    size = spec.image_size
    if batch.shape[-2:] != (size, size):
        # Antialiasing matters when shrinking (e.g. 64 px scenes to 32 px); bicubic overshoots, so clamp.
        batch = F.interpolate(batch, size=(size, size), mode="bicubic", align_corners=False, antialias=True)
        batch = batch.clamp_(0.0, 1.0)
    if spec.normalize:
        mean = torch.tensor(spec.mean, dtype=batch.dtype).view(1, 3, 1, 1)
        std = torch.tensor(spec.std, dtype=batch.dtype).view(1, 3, 1, 1)
        batch = (batch - mean) / std
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


def pil_to_tensor(image: Image.Image, spec: ImageSpec) -> torch.Tensor:
    """Convert one decoded image (any mode) to a float32 tensor ``[3, image_size, image_size]``."""
    image = image.convert("RGB")
    size = spec.image_size
    if image.size != (size, size):
        # PIL's resize widens its filter when shrinking, i.e. it antialiases like the batch path.
        image = image.resize((size, size), Image.Resampling.BICUBIC)
    array = np.asarray(image, dtype=np.uint8)
    tensor = torch.from_numpy(array.copy()).permute(2, 0, 1).float().div_(255.0)
    return _finish(tensor[None], spec)[0]
