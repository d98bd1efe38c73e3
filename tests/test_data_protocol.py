"""Data protocol details that follow the references: the VTAB-1k layout check on NOAH's zip, FGVC
augmentation, and transforms that follow the backbone's pretrained config."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from petl import data


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
