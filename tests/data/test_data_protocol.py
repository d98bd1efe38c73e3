"""Data protocol details that follow the references: the VTAB-1k layout check on NOAH's zip, FGVC
augmentation, and transforms that follow the backbone's pretrained config."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from petl import data
from petl.data import fractaldb, transforms


def make_noah_task(folder: Path, num_classes: int, test: int = 4, relabel: bool = False) -> None:
    """A VTAB-1k task in NOAH's layout (ZhangYuanhan-AI/NOAH data/vtab-source/get_vtab1k.py:L62-77):
    every split lists its own image copies, ``images/<split>/NNNNNN.jpg``."""
    labels = {"train800": [i % num_classes for i in range(800)], "val200": [(i + 1) % num_classes for i in range(200)]}
    labels["train800val200"] = labels["train800"] + labels["val200"]
    if relabel:
        labels["train800val200"] = [(label + 1) % num_classes for label in labels["train800val200"]]
    labels["test"] = [i % num_classes for i in range(test)]
    pixels = Image.fromarray(np.zeros((2, 2, 3), dtype=np.uint8))
    for split, split_labels in labels.items():
        (folder / "images" / split).mkdir(parents=True)
        lines = []
        for i, label in enumerate(split_labels):
            path = f"images/{split}/{i:06d}.jpg"
            pixels.save(folder / path)
            lines.append(f"{path} {label}\n")
        (folder / f"{split}.txt").write_text("".join(lines))


def test_noah_layout_loads_without_the_union_warning(tmp_path):
    make_noah_task(tmp_path / "dtd", num_classes=47)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds = data.build_dataset("vtab/dtd", "train800val200", image_size=4, root=str(tmp_path))
    assert len(ds) == 1000


def test_train800val200_with_other_labels_still_warns(tmp_path):
    make_noah_task(tmp_path / "dtd", num_classes=47, relabel=True)
    with pytest.warns(UserWarning, match="train800val200.txt is not train800.txt plus val200.txt"):
        data.build_dataset("vtab/dtd", "train800", image_size=4, root=str(tmp_path))


def _fgvc_folder(root: Path, width: int = 40, height: int = 30) -> None:
    """A CUB-layout FGVC folder (train/val/test lists) whose images, one file linked under every listed name, have a
    bright left column."""
    folder = root / "CUB_200_2011"
    (folder / "images").mkdir(parents=True)
    pixels = np.zeros((height, width, 3), dtype=np.uint8)
    pixels[:, : width // 4] = 255
    Image.fromarray(pixels).save(folder / "images" / "a.png")
    for split in ("train", "val", "test"):  # every class in every split, each line its own file (links to a.png)
        for c in range(200):
            os.link(folder / "images" / "a.png", folder / "images" / f"{split}{c}.png")
        (folder / f"{split}.txt").write_text("".join(f"images/{split}{c}.png {c}\n" for c in range(200)))


def test_fgvc_augments_training_splits_and_centre_crops_the_others(tmp_path):
    # KMnP/vpt src/data/transforms.py:L20-40 at 1/8 scale: resize the short side 30 -> 32*256/224 = 36
    # (long side 48), then crop 32: random + flip for training, centred for evaluation.
    _fgvc_folder(tmp_path)
    build = lambda split, **kw: data.build_dataset(  # noqa: E731
        "fgvc/cub", split, image_size=32, normalize=False, root=str(tmp_path), **kw
    )
    test = build("test")
    first, again = test[0][0], test[0][0]
    assert first.shape == (3, 32, 32) and torch.equal(first, again)
    # Centre crop of the 48-wide resize: columns 8..40, so the bright quarter (0..12) shows as 4 columns.
    assert first[0, 16, :3].min() > 0.9 and first[0, 16, 6:].max() < 0.1
    torch.manual_seed(0)
    train = build("train800")
    crops = {tuple(train[0][0][0, 16].gt(0.5).nonzero().flatten().tolist()) for _ in range(20)}
    assert len(crops) > 3  # random offsets and flips
    # VTAB tasks (and data.augment=false) resize straight to the square: the bright quarter is 8 columns.
    plain = build("train800", augment=False)[0][0]
    assert plain[0, 16].gt(0.5).sum() == 8


def test_augment_is_refused_on_in_memory_datasets():
    with pytest.raises(ValueError, match="cannot be cropped or augmented"):
        data.build_dataset("mini/digits", "train800", image_size=16, augment=True)


def test_interpolation_follows_the_spec():
    image = Image.fromarray((np.arange(64, dtype=np.uint8).reshape(8, 8) * 4).repeat(3).reshape(8, 8, 3))
    spec = lambda mode: transforms.ImageSpec(image_size=3, normalize=False, interpolation=mode)  # noqa: E731
    nearest, bicubic = (transforms.pil_to_tensor(image, spec(m)) for m in ("nearest", "bicubic"))
    assert not torch.equal(nearest, bicubic)
    # The in-memory path follows the same setting.
    batch = np.array(image)[None]
    assert not torch.equal(
        transforms.array_to_tensors(batch, spec("nearest")), transforms.array_to_tensors(batch, spec("bilinear"))
    )
    with pytest.raises(ValueError, match="interpolation"):
        spec("lanczos")


def test_pil_to_tensor_scales_16_bit_grey_and_refuses_float_pixels():
    # The path a dataset of one's own takes (petl/data/README.md): 16-bit grey clipped by Image.convert came out
    # nearly white, float pixels in [0, 1] black; petl's own decoders scaled and refused them.
    values = (np.arange(64).reshape(8, 8) * 1000).astype(np.uint16)
    spec = transforms.ImageSpec(image_size=8, normalize=False)
    tensor = transforms.pil_to_tensor(Image.fromarray(values), spec)
    expected = torch.from_numpy(np.round(values / 65535 * 255) / 255).float()
    torch.testing.assert_close(tensor, expected.expand(3, -1, -1), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="mode F"):
        transforms.pil_to_tensor(Image.fromarray((values / 65535).astype(np.float32)), spec)


def test_mean_and_std_of_0_255_pixels_are_refused():
    # mmcv's 0-255 ImageNet statistics standardised every [0, 1] pixel to about -2 without an error.
    with pytest.raises(ValueError, match="divide 0-255 values by 255"):
        transforms.ImageSpec(image_size=8, mean=(123.675, 116.28, 103.53), std=(58.395, 57.12, 57.375))
    with pytest.raises(ValueError, match="divide 0-255 values by 255"):
        data.build_dataset("mini/digits", "val200", image_size=8, std=(58.395, 57.12, 57.375))
    transforms.ImageSpec(image_size=8, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))  # timm's inception statistics


@pytest.mark.parametrize("stats", [{"std": (float("nan"), 0.5, 0.5)}, {"mean": (0.5, float("nan"), 0.5)}])
def test_nan_mean_or_std_is_refused(stats):
    # A NaN std passed `s <= 0` and the [0, 1] range check, and would make every pixel NaN.
    with pytest.raises(ValueError, match="mean and std must be finite numbers"):
        transforms.ImageSpec(image_size=8, **stats)


def test_one_normaliser():
    images = torch.randint(0, 256, (2, 1, 4, 4), dtype=torch.uint8)
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    expected = transforms.normalize(images.float().div(255).expand(-1, 3, -1, -1), mean, std)
    torch.testing.assert_close(fractaldb.to_model_input(images, mean, std), expected)
    spec = transforms.ImageSpec(image_size=4, mean=mean, std=std)
    torch.testing.assert_close(transforms.array_to_tensors(images[:, 0].numpy(), spec), expected)
