"""Photos stored sideways with an EXIF Orientation tag reach the model upright, the same in every path.

A phone stores a portrait photo as landscape pixels with Orientation=6; viewers (and ``PIL.ImageOps.exif_transpose``)
turn it.  petl fed the stored pixels: training on an own-data folder, petl-predict and petl-serve all saw it rotated.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import BatchRecorder
from PIL import Image

from petl import data as petl_data
from petl.data.images import decode_image, upright
from petl.data.transforms import ImageSpec
from petl.deploy.predict import predict_images
from petl.store.run_card import LoadedRun

SIDE = 24  # 3 x 3 blocks of 8 px: JPEG's own blocks, so the flat colours survive compression within 1 level
BLOCK_COLOURS = [
    (200, 30, 30),
    (30, 200, 30),
    (30, 30, 200),
    (200, 200, 30),
    (30, 200, 200),
    (200, 30, 200),
    (240, 240, 240),
    (110, 110, 110),
    (20, 20, 20),
]
# The upright picture: nine different blocks, so each of the eight orientations gives other pixels.
UPRIGHT = np.array(BLOCK_COLOURS, np.uint8).reshape(3, 3, 3).repeat(8, axis=0).repeat(8, axis=1)
# What a camera stores for each Orientation value (EXIF 2.3, tag 0x0112), written from the spec with numpy, not
# with Pillow's table: 6 is "turn 90 degrees clockwise to view", so the stored pixels are the picture turned back.
STORED = {
    2: lambda a: np.fliplr(a),
    3: lambda a: np.rot90(a, 2),
    4: lambda a: np.flipud(a),
    5: lambda a: a.swapaxes(0, 1),
    6: lambda a: np.rot90(a, 1),
    7: lambda a: np.rot90(a, 2).swapaxes(0, 1),
    8: lambda a: np.rot90(a, -1),
}
# Every level within 2 of the picture's (JPEG rounding is 1 here); another orientation is off by 90 somewhere.
ATOL = 2
# An EXIF block whose Orientation (6) reads fine but which ImageOps.exif_transpose cannot write back (struct.error
# in Exif.tobytes, Pillow 13): one of the many such damaged blocks that random tags after a valid Orientation give.
DAMAGED_EXIF = bytes.fromhex(
    "49492a000800000006000f010d0001000000fabf772512010300010000000600000069870700040000001a0000007c920800020000"
    "00ad00000005a00200020000000000000005a00f0001000000280000000000000017250d3f603dc82ebd3b120b635e"
)


def _photo(orientation: int = 6, fmt: str = "JPEG", exif: bytes | None = None) -> bytes:
    """The picture's file as a camera writes it: stored turned, with the Orientation tag saying how to turn it."""
    if exif is None:
        tags = Image.Exif()
        tags[0x0112] = orientation
        exif = tags.tobytes()
    buffer = io.BytesIO()
    stored = Image.fromarray(np.ascontiguousarray(STORED[orientation](UPRIGHT)))
    options = {"quality": 100, "subsampling": 0} if fmt == "JPEG" else {}
    stored.save(buffer, format=fmt, exif=exif, **options)
    return buffer.getvalue()


# The input size of the picture, no normalisation: a model input is then the pixels / 255.
PLAIN = ImageSpec(image_size=SIDE, normalize=False, interpolation="nearest")
AS_PLAIN = {"image_size": SIDE, "normalize": False, "interpolation": "nearest"}  # build_dataset's words for it


def _pixels(tensor: torch.Tensor) -> np.ndarray:
    """A model input made with :data:`PLAIN` back to its pixels ``[H, W, 3]``."""
    return (tensor.permute(1, 2, 0).numpy() * 255).round().astype(np.int64)


@pytest.mark.parametrize("orientation", sorted(STORED))
def test_every_orientation_decodes_upright(orientation):
    decoded = decode_image(_photo(orientation))
    np.testing.assert_allclose(decoded, UPRIGHT, atol=ATOL)
    assert np.abs(decoded.astype(int) - STORED[orientation](UPRIGHT)).max() > 50  # the stored pixels differ


def test_a_png_with_an_exif_chunk_decodes_upright_too():
    np.testing.assert_array_equal(decode_image(_photo(6, "PNG")), UPRIGHT)  # lossless: exactly the picture


def test_an_image_without_orientation_is_decoded_as_before_and_not_copied():
    buffer = io.BytesIO()
    Image.fromarray(UPRIGHT).save(buffer, format="JPEG")
    with Image.open(io.BytesIO(buffer.getvalue())) as image:
        image.load()
        assert upright(image) is image
        np.testing.assert_array_equal(decode_image(buffer.getvalue()), np.asarray(image.convert("RGB")))


def test_damaged_exif_whose_orientation_reads_is_turned_without_a_warning():
    # ImageOps.exif_transpose raises on this block: only the pixels are turned, the metadata is not rewritten.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_allclose(decode_image(_photo(6, exif=b"Exif\x00\x00" + DAMAGED_EXIF)), UPRIGHT, atol=ATOL)


def test_exif_that_cannot_be_read_leaves_the_image_as_stored(monkeypatch):
    # A readable image must not start failing over its metadata: Pillow's EXIF parser raises many kinds.
    def broken(self):
        raise UnicodeDecodeError("utf-8", b"\xa8", 0, 1, "invalid start byte")

    monkeypatch.setattr(Image.Image, "getexif", broken)
    np.testing.assert_array_equal(decode_image(_photo(6, "PNG")), STORED[6](UPRIGHT))


def _folder(root: Path) -> Path:
    """An own-data folder whose class ``a`` holds the sideways photo."""
    for split in ("train", "val", "test"):
        for name in ("a", "b"):
            (root / split / name).mkdir(parents=True)
        (root / split / "a" / "photo.jpg").write_bytes(_photo(6))
        Image.fromarray(np.full((SIDE, SIDE, 3), 90, np.uint8)).save(root / split / "b" / "grey.png")
    return root


def _item_of(dataset, name: str) -> torch.Tensor:
    found = [dataset[i][0] for i in range(len(dataset)) if _source(dataset, i).endswith(name)]
    assert len(found) == 1
    return found[0]


def _source(dataset, index: int) -> str:
    if hasattr(dataset, "items"):  # data=folder: (path, label)
        return str(dataset.items[index][0])
    split, _, row, _ = dataset.rows[index]  # data=hf: (split, split name, row, label)
    value = split[row][dataset.image_column]
    return str(value.get("path") or "")


def test_an_own_data_folder_trains_and_evaluates_on_the_upright_photo(tmp_path):
    root = str(_folder(tmp_path / "images"))
    for split in (petl_data.TRAIN, petl_data.VAL, petl_data.TEST):
        dataset = petl_data.build_dataset("folder", split, root=root, **AS_PLAIN)
        np.testing.assert_allclose(_pixels(_item_of(dataset, "photo.jpg")), UPRIGHT, atol=ATOL)


def test_a_datasets_imagefolder_reads_the_photo_upright_as_the_folder_does(tmp_path):
    pytest.importorskip("datasets")
    root = str(_folder(tmp_path / "images"))
    dataset = petl_data.build_dataset("hf", "test", root=root, **AS_PLAIN)
    np.testing.assert_allclose(_pixels(_item_of(dataset, "photo.jpg")), UPRIGHT, atol=ATOL)


def test_petl_predict_feeds_the_upright_photo(tmp_path):
    path = tmp_path / "photo.jpg"
    path.write_bytes(_photo(6))
    run = LoadedRun(BatchRecorder(), PLAIN, ["a", "b"], {}, tmp_path)
    predictions, bad = predict_images(run, [path], top_k=1, progress=False, precision="no")
    assert len(predictions) == 1 and not bad
    np.testing.assert_allclose(_pixels(run.model.seen[0]), UPRIGHT, atol=ATOL)


def test_petl_serve_preprocesses_an_uploaded_photo_upright():
    from petl.deploy import uploads  # what petl-serve decodes an upload with (it needs no serve extra)

    np.testing.assert_allclose(_pixels(uploads.preprocess(_photo(6), PLAIN)), UPRIGHT, atol=ATOL)


def test_load_run_preprocess_scales_a_16_bit_grey_image_as_petl_predict_reads_it(tmp_path):
    # Image.convert("RGB") clips 16-bit grey at 255 (nearly white): run.preprocess must give predict's pixels.
    grey = (np.arange(SIDE * SIDE, dtype=np.uint16).reshape(SIDE, SIDE) * 113).astype(np.uint16)
    path = tmp_path / "deep.png"
    Image.fromarray(grey).save(path)
    run = LoadedRun(BatchRecorder(), PLAIN, ["a", "b"], {}, tmp_path)
    predict_images(run, [path], top_k=1, progress=False, precision="no")
    with Image.open(path) as image:
        assert image.mode.startswith("I")
        np.testing.assert_array_equal(run.preprocess(image).numpy(), run.model.seen[0].numpy())
    with pytest.raises(ValueError, match="floating-point pixels"):
        run.preprocess(Image.fromarray(grey.astype(np.float32)))
