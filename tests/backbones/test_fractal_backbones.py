"""The FractalDB backbones petl pretrains itself and ships in petl/weights: each builds offline through timm's
pretrained machinery from the shipped file, and the provenance beside it describes that file and that pretraining.
"""

from __future__ import annotations

import json

import pytest
import timm
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from petl.backbones import models
from petl.store import files
from petl.train import pretrain

SHIPPED = ["vit_fractal_tiny_patch4_32", "swin_fractal_tiny_patch2_window4_32"]
# Written by a petl-pretrain that records its command, the weights' SHA-256 and dtype (the ViT's predates them).
FULL_RECORD = {"swin_fractal_tiny_patch2_window4_32"}


@pytest.mark.parametrize("arch", SHIPPED)
def test_shipped_backbone_builds_offline_from_its_file(arch):
    weights, _ = pretrain.output_files(models.WEIGHTS_DIR, arch)
    model = timm.create_model(f"{arch}.fractaldb", pretrained=True, num_classes=3)
    assert model.pretrained_cfg["file"] == str(weights)
    shipped = load_file(weights)
    state = model.state_dict()
    # Every shipped tensor is loaded (cast to the model's float32), and only the new head is left untrained.
    assert set(shipped) == {k for k in state if not k.startswith("head.")}
    assert all(torch.equal(state[k], v.to(state[k].dtype)) for k, v in shipped.items())
    fresh = timm.create_model(arch, num_classes=3).state_dict()
    assert not torch.equal(fresh["patch_embed.proj.weight"], state["patch_embed.proj.weight"])
    size = model.pretrained_cfg["input_size"][-1]
    with torch.no_grad():
        assert model.eval()(torch.zeros(1, 3, size, size)).shape == (1, 3)


@pytest.mark.parametrize("arch", SHIPPED)
def test_shipped_provenance_describes_the_shipped_file(arch):
    weights, provenance = pretrain.output_files(models.WEIGHTS_DIR, arch)
    record = json.loads(provenance.read_text())
    with safe_open(str(weights), "pt") as f:
        assert record["arch"] == f.metadata()["arch"] == arch
    history = record["history"]
    assert len(history) == record["train_settings"]["epochs"]
    assert record["final_val_top1"] == history[-1]["val_top1"]
    assert record["images_seen"] == sum(h["images"] for h in history)
    assert record["fractal_config"]["image_size"] == timm.create_model(arch).patch_embed.img_size[0]
    assert len(record["git_commit"]) == 40 and record["command"].startswith("petl-pretrain ")
    if arch in FULL_RECORD:
        assert record["weights_sha256"] == files.file_sha256(weights)
        assert f"--model {arch}" in record["command"] and f"--epochs {len(history)}" in record["command"]
        dtype = {"float32": torch.float32, "float16": torch.float16}[record["weights_dtype"]]
        assert {v.dtype for v in load_file(weights).values()} == {dtype}
