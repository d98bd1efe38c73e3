"""Odd image files reach the model as the same tensor in training, petl-predict and petl-serve, or are refused there.

Each kind is made with Pillow: a CMYK JPEG, 16-bit grey, 1-bit and palette images with transparency, grey and colour
with alpha, an animated GIF and a multi-page TIFF (their first frame), a 1 x 1 image, a PNG named ``.jpg``, PGM and
PPM.  An
own-data split (``FileListDataset``, which holds a resized copy of each image), ``predict_images`` and petl-serve's
upload preprocessing must give one tensor for one file; a file none can use is refused by each in its words.
"""

from __future__ import annotations

import io
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import BatchRecorder
from PIL import Image, features

from petl.data.images import FileListDataset, pillow_quiet
from petl.data.registry import BadImagesError
from petl.data.transforms import ImageSpec, UnfitImage
from petl.deploy import uploads  # what petl-serve reads an upload with (it needs no serve extra)
from petl.deploy.predict import predict_images
from petl.store.run_card import LoadedRun

# Larger than the model's input, so the dataset holds a resized copy (held_form) and not the decoded image.
PICTURE = np.random.default_rng(0).integers(0, 256, (20, 28, 3), dtype=np.uint8)
SPECS = {"square": ImageSpec(image_size=8), "crop": ImageSpec(image_size=8, crop=True)}
SERVE = SimpleNamespace(max_image_mp=16.0, max_request_mp=64.0)  # petl-serve's defaults


def _saved(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def _frames(fmt: str, **options) -> bytes:
    """Three flat frames, the first dark: read as anything but the first, the picture is lighter."""
    frames = [Image.fromarray(np.full((20, 28, 3), level, np.uint8)) for level in (10, 128, 250)]
    return _saved(frames[0], fmt, save_all=True, append_images=frames[1:], **options)


def _palette_with_transparency() -> bytes:
    image = Image.fromarray(PICTURE).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    return _saved(image, "PNG", transparency=0)


def _half_transparent(mode: str) -> bytes:
    pixels = np.asarray(Image.fromarray(PICTURE).convert(mode)).copy()
    pixels[10:, :, -1] = 0  # the lower half transparent: its colours are read as stored, as .convert("RGB") reads them
    return _saved(Image.fromarray(pixels, mode), "PNG")


KINDS: dict[str, Callable[[], bytes]] = {
    "cmyk.jpg": lambda: _saved(Image.fromarray(PICTURE).convert("CMYK"), "JPEG", quality=95),
    "grey16.png": lambda: _saved(Image.fromarray(PICTURE[..., 0].astype(np.uint16) * 257), "PNG"),
    "one_bit.png": lambda: _saved(Image.fromarray(PICTURE).convert("1"), "PNG"),
    "palette_transparent.png": _palette_with_transparency,
    "grey_alpha.png": lambda: _half_transparent("LA"),
    "rgba.png": lambda: _half_transparent("RGBA"),
    "animated.gif": lambda: _frames("GIF"),
    "pages.tiff": lambda: _frames("TIFF"),
    "animated.png": lambda: _frames("PNG"),
    "animated.webp": lambda: _frames("WEBP", lossless=True),
    "one_pixel.png": lambda: _saved(Image.fromarray(PICTURE[:1, :1]), "PNG"),
    "png_named.jpg": lambda: _saved(Image.fromarray(PICTURE), "PNG"),
    "lossless.webp": lambda: _saved(Image.fromarray(PICTURE), "WEBP", lossless=True),
    "grey.pgm": lambda: _saved(Image.fromarray(PICTURE[..., 1]), "PPM"),
    "colour.ppm": lambda: _saved(Image.fromarray(PICTURE), "PPM"),
}
# Files Pillow reads that petl does not, each named as a folder's extensions would take it in.
OTHER_FORMATS = {
    "eps_named.jpg": "EPS",
    "pcx_named.jpg": "PCX",
    "icon_named.png": "ICO",
    "targa_named.png": "TGA",
    "jpeg2000_named.jpg": "JPEG2000",
}


def _trained_on(path: Path, spec: ImageSpec) -> torch.Tensor:
    """The tensor an own-data split evaluates ``path`` as (its held copy through the evaluation transform)."""
    return FileListDataset([(path, 0)], spec, name="folder")[0][0]


def _predicted_on(path: Path, spec: ImageSpec) -> tuple[torch.Tensor | None, list[tuple[Path, str]]]:
    """The batch petl-predict fed the model for ``path`` (None where it could not), and the images it set apart."""
    run = LoadedRun(BatchRecorder(), spec, ["a", "b"], {}, path.parent)
    predictions, bad = predict_images(run, [path], top_k=1, progress=False, precision="no")
    return (run.model.seen[0] if predictions else None), bad


def _served(name: str, data: bytes, spec: ImageSpec) -> torch.Tensor:
    """petl-serve's model input for an upload: its header checked, then decoded and preprocessed."""
    uploads.check_pixels([(name, data)], SERVE, spec)
    return uploads.preprocess_all([(name, data)], spec)[0]


@pytest.mark.parametrize("geometry", SPECS)
@pytest.mark.parametrize("kind", KINDS)
def test_an_odd_image_is_one_tensor_in_training_prediction_and_serving(kind, geometry, tmp_path):
    spec, data = SPECS[geometry], KINDS[kind]()
    path = tmp_path / kind
    path.write_bytes(data)
    trained = _trained_on(path, spec)
    predicted, bad = _predicted_on(path, spec)
    assert not bad and predicted is not None
    torch.testing.assert_close(predicted, trained, rtol=0, atol=0)
    torch.testing.assert_close(_served(kind, data, spec), trained, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["animated.gif", "pages.tiff", "animated.png", "animated.webp"])
def test_an_animation_or_a_multi_page_file_is_read_as_its_first_frame(kind, tmp_path):
    path = tmp_path / kind
    path.write_bytes(KINDS[kind]())
    first = Image.fromarray(np.full((20, 28, 3), 10, np.uint8))
    spec = SPECS["square"]
    expected = FileListDataset([(_png(tmp_path / "first.png", first), 0)], spec)[0][0]
    torch.testing.assert_close(_trained_on(path, spec), expected, rtol=0, atol=0)


def _png(path: Path, image: Image.Image) -> Path:
    image.save(path)
    return path


def test_an_image_the_crop_resize_would_blow_up_is_refused_in_one_line_on_every_surface(tmp_path, monkeypatch):
    # A cropping run resizes the shorter side to 256 px at 224 and the longer in proportion: a 118-byte PNG of
    # 1 x 20,000 px became 256 x 5,120,000 px (3.9 GB) on every read in training and in petl-predict, or a
    # MemoryError naming no file; only petl-serve refused it (from its header, 413).  Pillow's limit scaled down
    # here, so that the image is a few hundred pixels.
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # Pillow decodes up to 2000 pixels, refuses beyond
    spec = SPECS["crop"]  # the shorter side to 9 px: a 1 x 300 image becomes 9 x 2700 px, 24,300 pixels
    path = _png(tmp_path / "thin.png", Image.fromarray(np.zeros((300, 1), np.uint8)))
    said = r"1 x 300 px, which the resize \(the shorter side to 9 px\) makes 9 x 2700 px, over Pillow's limit .*"
    with pytest.raises(BadImagesError, match=said + "crop it nearer to a square") as refused:
        FileListDataset([(path, 0)], spec, name="folder")
    assert len(str(refused.value).splitlines()) == 1 and str(path) in str(refused.value)
    predicted, bad = _predicted_on(path, spec)
    assert predicted is None and [p for p, _ in bad] == [path]
    assert len(bad[0][1].splitlines()) == 1 and bad[0][1].endswith("crop it nearer to a square")
    with pytest.raises(uploads.BadImage, match=r"^image 1 \(thin.png\): 1 x 300 px, .*crop it nearer to a square$"):
        _served("thin.png", path.read_bytes(), spec)
    run = LoadedRun(BatchRecorder(), spec, ["a", "b"], {}, tmp_path)
    with pytest.raises(UnfitImage, match=said), Image.open(path) as image:
        run.preprocess(image)
    # Without the crop it is resized straight to the square, as any image is: used.
    assert _trained_on(path, SPECS["square"]).shape == (3, 8, 8)


def test_a_split_held_for_one_geometry_names_an_image_another_cannot_resize(tmp_path, monkeypatch):
    # petl-predict evaluates several runs on one test folder decoded once; a run that crops reads it through its own
    # spec, whose resize had not been checked: the refusal must still name the file (BadImagesError), not escape
    # as a bare ValueError from the DataLoader.
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    path = _png(tmp_path / "thin.png", Image.fromarray(np.zeros((300, 1), np.uint8)))
    dataset = FileListDataset([(path, 0)], SPECS["square"], name="folder")
    dataset.spec = SPECS["crop"]
    with pytest.raises(BadImagesError, match="crop it nearer to a square") as refused:
        dataset[0]
    assert refused.value.bad[0][0] == path


@pytest.mark.parametrize("name", OTHER_FORMATS)
def test_a_file_of_a_format_petl_serve_refuses_is_refused_in_training_and_prediction_too(name, tmp_path, monkeypatch):
    # Training and petl-predict opened a file as any format Pillow knows: an EPS named photo.jpg ran Ghostscript
    # (where it is installed), an ICO, PCX, TGA or JPEG 2000 file was trained on and predicted, and petl-serve then
    # refused the same file (400).
    from PIL import EpsImagePlugin

    ran = []

    def ghostscript(*args, **kwargs):  # Pillow's EPS loader runs the gs program here
        ran.append(args)
        raise OSError("Ghostscript ran")

    monkeypatch.setattr(EpsImagePlugin, "Ghostscript", ghostscript)
    if OTHER_FORMATS[name] == "JPEG2000" and not features.check("jpg_2000"):
        pytest.skip("this Pillow has no JPEG 2000 codec")
    path = tmp_path / name
    path.write_bytes(_saved(Image.fromarray(PICTURE), OTHER_FORMATS[name]))
    said = "not a readable image: not a PNG, JPEG, WebP, BMP, GIF, TIFF or PPM file, or its header is damaged"
    with pytest.raises(BadImagesError, match=said) as refused:
        FileListDataset([(path, 0)], SPECS["square"], name="folder")
    assert refused.value.bad[0][0] == path
    predicted, bad = _predicted_on(path, SPECS["square"])
    assert predicted is None and bad == [(path, said)]
    with pytest.raises(uploads.BadImage, match=f"^image 1 \\({name}\\): {said}"):
        _served(name, path.read_bytes(), SPECS["square"])
    assert ran == []


def test_a_tiff_cut_after_its_header_is_one_line_without_pillows_warning(tmp_path):
    # Pillow warned "UserWarning: Corrupt EXIF data.  Expecting to read 2 bytes but only got 0." in two lines naming
    # no file before petl's line naming it, in training, petl-predict and (reading the header) petl-serve's log.
    path = tmp_path / "cut.tiff"
    path.write_bytes(KINDS["pages.tiff"]()[:8])
    said = "not a readable image: not a PNG, JPEG, WebP, BMP, GIF, TIFF or PPM file, or its header is damaged"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(BadImagesError, match=said):
            FileListDataset([(path, 0)], SPECS["square"], name="folder")
        assert _predicted_on(path, SPECS["square"]) == (None, [(path, said)])
        with pytest.raises(uploads.BadImage, match=f"^image 1 \\(cut.tiff\\): {said}"):
            _served("cut.tiff", path.read_bytes(), SPECS["square"])


def test_pillows_warnings_stay_quiet_while_another_thread_leaves_its_quiet_block():
    # petl-serve decodes uploads in several threads.  Each pillow_quiet was its own warnings.catch_warnings, which
    # puts back the filter list it found: a thread leaving first took the filter away from one still decoding (its
    # Pillow warning shown), and the one leaving last put back a list holding the filter, left on for good.
    inside, leave, left = threading.Event(), threading.Event(), threading.Event()

    def decoding_elsewhere() -> None:
        with pillow_quiet():
            inside.set()
            leave.wait(10)
        left.set()

    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        before = list(warnings.filters)
        other = threading.Thread(target=decoding_elsewhere)
        other.start()
        assert inside.wait(10)
        with pillow_quiet():
            leave.set()
            assert left.wait(10)
            warnings.warn_explicit("Corrupt EXIF data", UserWarning, "TiffImagePlugin.py", 1, "PIL.TiffImagePlugin")
        other.join()
        assert shown == [] and warnings.filters == before
