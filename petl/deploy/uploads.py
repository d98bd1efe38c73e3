"""What petl-serve checks of an uploaded image before the model sees it: its format, and its pixels from its header.

An image is decoded only once its header says it is within ``max_image_mp`` and the request within
``max_request_mp`` (:func:`check_pixels`), so a decompression bomb is refused without being decoded; then it is
decoded as one of :data:`petl.data.images.IMAGE_FORMATS` alone, as training and petl-predict decode a file, and
resized to the model's input (:func:`preprocess`).
"""

from __future__ import annotations

import io
import math
from typing import TYPE_CHECKING

import torch
from PIL import Image

from petl.data.images import FORMAT_NAMES, IMAGE_FORMATS, UnfitImage, decode_image, pillow_quiet
from petl.data.transforms import ImageSpec, pil_to_tensor, resize_size
from petl.utils.text import shown

if TYPE_CHECKING:
    from petl.deploy.serve import ServeOptions

# An image's resize is refused over max_image_mp or this many times what the resize makes of a square image
# (its floor), whichever is more: a square image, or one of 16:1 or nearer to a square, is never refused for its
# resize.  A floor of a fixed 1 MP refused every image under a max_image_mp below the model's own square, square
# ones too (a run at 1,024 px makes 1.05 MP of any image); and at 224 px, 16 squares of 256 px are the 1 MP it was.
RESIZED_SQUARES_FLOOR = 16


class BadImage(ValueError):
    """An uploaded image that cannot be used; the message names it and says why."""


class TooManyPixels(ValueError):
    """An image, or a request's images, over the pixel limits; the message names the limit (413)."""


def image_size(data: bytes) -> tuple[int, int] | None:
    """An image file's width and height from its header alone, before any decoding (``None``: not a readable header).

    Raises:
        TooManyPixels: over twice Pillow's own limit (Pillow refuses to open it).

    """
    try:
        with pillow_quiet(), Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as header:
            return header.size
    except Image.DecompressionBombError:
        raise TooManyPixels(f"more than {2 * Image.MAX_IMAGE_PIXELS / 1e6:.0f} MP") from None
    except (OSError, SyntaxError, ValueError):
        return None  # decode_image says what is wrong, in its words


def preprocess(data: bytes, spec: ImageSpec) -> torch.Tensor:
    """One uploaded file's bytes (its size already checked: :func:`check_pixels`) as a model input.

    Raises:
        ValueError: not an image, truncated or damaged (one phrase saying which).

    """
    return pil_to_tensor(Image.fromarray(decode_image(data)), spec)


def _which(number: int, name: str) -> str:
    return f"image {number}" + (f" ({shown(name)})" if name else "")


def check_pixels(uploads: list[tuple[str, bytes]], options: ServeOptions, spec: ImageSpec) -> None:
    """Refuse a request whose images, read from their headers only, exceed max_image_mp or max_request_mp.

    So is an image that ``spec``'s resize would make larger than max_image_mp and than :data:`RESIZED_SQUARES_FLOOR`
    times its resize of a square image: a cropping run's resize made a 138-byte PNG of 1 x 20,000 px 256 x 5,120,000
    px (the shorter side 256), 6 GB and 40 s of the server's time.

    Raises:
        TooManyPixels: the first image over ``max_image_mp``, or the request's total over ``max_request_mp``.

    """
    # In whole pixels: max_image_mp=4.1 times 1e6 is 4099999.9999999995, which refused an image of 4.1 MP.
    image_limit, request_limit = round(options.max_image_mp * 1e6), round(options.max_request_mp * 1e6)
    floor = RESIZED_SQUARES_FLOOR * math.prod(resize_size(1, 1, spec))
    total = 0
    for number, (name, data) in enumerate(uploads, 1):
        try:
            width, height = image_size(data) or (0, 0)
        except TooManyPixels as error:
            pixels, size = math.inf, str(error)
        else:
            pixels, size = width * height, f"{width * height / 1e6:.3g} MP"
        if pixels > image_limit:
            raise TooManyPixels(
                f"{_which(number, name)}: {size}, over max_image_mp={options.max_image_mp:g}: send it smaller "
                f"(the model reads {spec.image_size} x {spec.image_size} px), or start petl-serve with a larger "
                "max_image_mp"
            )
        new_width, new_height = resize_size(width, height, spec) if pixels else (0, 0)
        if new_width * new_height > max(image_limit, floor):
            limit = f"max_image_mp={options.max_image_mp:g}"
            if image_limit < floor:
                limit = f"{floor / 1e6:.3g} MP ({RESIZED_SQUARES_FLOOR} times the task's resize of a square image)"
            raise TooManyPixels(
                f"{_which(number, name)}: {width} x {height} px, which the task's resize (the shorter side to "
                f"{min(new_width, new_height)} px) makes {new_width * new_height / 1e6:.3g} MP, over {limit}: crop it "
                "nearer to a square"
            )
        total += pixels
    if total > request_limit:
        raise TooManyPixels(
            f"the request's {len(uploads)} images hold {total / 1e6:.3g} MP, over max_request_mp="
            f"{options.max_request_mp:g}: split it, or send smaller images"
        )


def is_multipart(content_type: str) -> bool:
    """Whether a request's ``Content-Type`` is ``multipart/form-data``, in any case."""
    # A media type is case-insensitive (RFC 9110 8.3.1): Multipart/Form-Data was read as one image.
    return content_type.split(";")[0].strip().lower() == "multipart/form-data"


def cut_short(body: bytes, content_type: str) -> str | None:
    """Why a multipart ``body`` cannot be read, where it holds its boundary but ends before the closing one
    (``CRLF --BOUNDARY--``, RFC 2046); ``None`` where it does not (its parser then says what it finds wrong).

    python-multipart reads such a body without an error: the parts complete before the cut are its files, and the one
    cut short is dropped, so a request of three images whose third was cut was answered for two, and one of one image
    said it held no file.
    """
    from starlette.formparsers import parse_options_header  # python-multipart's, wherever Starlette found it

    boundary = parse_options_header(content_type)[1].get(b"boundary")
    close = b"--" + boundary + b"--" if boundary else b""
    # A body without its boundary at all is no multipart body: the parser's own error says so.  The closing boundary
    # ends the last part only after a CRLF (one without it was read as that part's data, and the part dropped too).
    if not boundary or b"--" + boundary not in body or body.startswith(close) or b"\r\n" + close in body:
        return None
    return (
        "the multipart body ends before its closing boundary (CRLF --BOUNDARY--): it was cut short: send it whole, "
        "each image a file field (curl -F image=@cat.jpg)"
    )


def preprocess_all(uploads: list[tuple[str, bytes]], spec: ImageSpec) -> list[torch.Tensor]:
    """Each upload (its name, its bytes: :func:`check_pixels` passed them) as a model input, in order.

    Raises:
        BadImage: the first image that cannot be used, named by its place and file name, and what to send instead.

    """
    tensors = []
    for number, (name, data) in enumerate(uploads, 1):
        try:
            tensors.append(preprocess(data, spec))
        except UnfitImage as error:  # its own remedy: "send a complete PNG..." would say the image was broken
            raise BadImage(f"{_which(number, name)}: {error}") from None
        except ValueError as error:
            raise BadImage(f"{_which(number, name)}: {error}: send a complete {FORMAT_NAMES} image") from None
    return tensors
