"""Partial-k on a Swin against KMnP/vpt's own rule of which parameters train, on the same weights.

The reference, KMnP/vpt@4410440 src/models/vit_models.py L210-230 (``Swin.build_backbone``), freezes every
parameter of the encoder whose name fails a name test written for Swin-B (depths 2-2-18-2): Partial-1 keeps the last
block, Partial-2 the last stage, Partial-4 the last stage, the last two blocks of the stage before and that stage's
``downsample``; each keeps the final ``norm``.  The rule is re-written below as it stands (its substring tests
included) and run on a timm Swin's parameter names in the reference's layout: a reference stage ends with the
PatchMerging that timm's next stage opens with (the reference's ``layers[s].downsample`` is timm's
``layers[s + 1].downsample``, as tests/references/test_vpt_swin_reference.py maps it); the blocks and norms are
named alike.  The reference's head is its own MLP beside the encoder, so the encoder's names are compared.
"""

from __future__ import annotations

import re

import pytest
import torch
from conftest import REFERENCE_SWIN, make_tiny_swin

import petl
from petl.model.backbone import backbone_of

# The reference tests' Swin (four stages of two blocks) and Swin-B's depths on its widths, where the reference's
# Partial-4 reaches two of the 18 blocks of the third stage.
DEPTHS = {"reference_swin": (2, 2, 2, 2), "swin_b_depths": (2, 2, 18, 2)}


def _reference_names(model: torch.nn.Module) -> dict[str, str]:
    """The reference's name of each encoder parameter of a timm Swin (head left out), by timm's name."""

    def rename(name: str) -> str:
        merging = re.fullmatch(r"layers\.(\d+)\.downsample\.(.*)", name)
        return f"layers.{int(merging.group(1)) - 1}.downsample.{merging.group(2)}" if merging else name

    return {name: rename(name) for name, _ in model.named_parameters() if not name.startswith("head.")}


def _reference_trained(names: list[str], num_layers: int, depths: list[int], transfer_type: str) -> set[str]:
    """src/models/vit_models.py L211-230: the names the reference leaves trainable (``total_layer`` is
    ``len(self.enc.layers)``, ``total_blocks`` a stage's ``len(blocks)``).
    """
    total_layer = num_layers
    kept = set()
    for k in names:  # the reference's str.format calls, written as f-strings
        if transfer_type == "partial-1":
            total_blocks = depths[-1]
            frozen = (
                f"layers.{total_layer - 1}.blocks.{total_blocks - 1}" not in k
                and "norm.weight" != k
                and "norm.bias" != k
            )
        elif transfer_type == "partial-2":
            frozen = f"layers.{total_layer - 1}" not in k and "norm.weight" != k and "norm.bias" != k
        else:  # partial-4
            total_blocks = depths[-2]
            frozen = (
                f"layers.{total_layer - 1}" not in k
                and f"layers.{total_layer - 2}.blocks.{total_blocks - 1}" not in k
                and f"layers.{total_layer - 2}.blocks.{total_blocks - 2}" not in k
                and f"layers.{total_layer - 2}.downsample" not in k
                and "norm.weight" != k
                and "norm.bias" != k
            )
        if not frozen:
            kept.add(k)
    return kept


@pytest.mark.parametrize("depths", DEPTHS.values(), ids=DEPTHS.keys())
@pytest.mark.parametrize("k", [1, 2, 4])
def test_partial_k_trains_what_the_references_swin_rule_trains(depths, k):
    model = make_tiny_swin(**{**REFERENCE_SWIN, "depths": depths})
    names = _reference_names(model)
    # The layout the renaming assumes: the reference's last stage ends without a merging, every other with one.
    merging_stages = {int(n.split(".")[1]) for n in names.values() if ".downsample." in n}
    assert merging_stages == set(range(len(depths) - 1))
    expected = _reference_trained(list(names.values()), len(depths), list(depths), f"partial-{k}")
    petl.apply(model, "partial", k=k, num_classes=4)
    trained = {names[n] for n, p in model.named_parameters() if p.requires_grad and n in names}
    assert trained == expected
    if k == 4:  # the merging between the two trained stages is among them (the reference's layers.{L-2}.downsample)
        assert f"layers.{len(depths) - 2}.downsample.reduction.weight" in trained
    expected_count = sum(p.numel() for n, p in model.named_parameters() if names.get(n) in expected)
    assert petl.count_params(model).trainable_no_head == expected_count


@pytest.mark.parametrize("k", [1, 2, 4])
def test_the_formula_counts_the_merging_it_trains(k):
    build = dict(REFERENCE_SWIN, depths=DEPTHS["swin_b_depths"])
    formula = petl.get_method("partial").trainable_formula(make_tiny_swin(**build), petl.make_config("partial", k=k))
    model = petl.apply(make_tiny_swin(**build), "partial", k=k, num_classes=4)
    assert petl.count_params(model).trainable_no_head == formula
    merging = backbone_of(model).modules_before_block(backbone_of(model).depth() - 2)
    assert len(merging) == 1 and all(p.requires_grad == (k == 4) for p in merging[0].parameters())
