"""Side-tuning methods (DTL, LST): which blocks the backward reaches, and the side network's bookkeeping.

The registry-parametrized contract tests (tests/methods/test_method_contracts.py) cover them like every method; these
tests check what makes them side-tuning: the frozen blocks whose outputs need no gradient.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import petl
from petl.methods import _side
from petl.model.backbone import backbone_of

SIDE = ["dtl", "lst", "hst", "last"]


def _outputs_requiring_grad(model: torch.nn.Module, images: torch.Tensor) -> list[bool]:
    """Per original block, whether its output takes part in the backward of a training forward."""
    seen: list[bool] = []
    handles = [
        block.register_forward_hook(lambda _m, _args, out: seen.append(out.requires_grad))
        for block in backbone_of(model).block_list()
    ]
    model.train()
    F.cross_entropy(model(images), torch.zeros(images.shape[0], dtype=torch.long)).backward()
    for handle in handles:
        handle.remove()
    return seen


@pytest.mark.parametrize("add_from", [0, 1, 2])
def test_dtl_backward_reaches_only_the_blocks_after_add_from(tiny_vit, images, add_from):
    # heekhero/DTL models/vision_transformer.py L425-444: the side features join the stream after block
    # add_from, so the blocks up to it run as a frozen feature extractor.
    model = petl.apply(tiny_vit(), "dtl", num_classes=4, add_from=add_from)
    assert _outputs_requiring_grad(model, images) == [i > add_from for i in range(3)]


def test_hst_backward_reaches_every_block(tiny_vit, images):
    # HST's meta tokens and trained LayerNorms sit in the backbone (AFeng-x/HST models/vit_hsn.py L316-327,
    # L342-348): the reference backpropagates through every block, and so does petl.
    model = petl.apply(tiny_vit(), "hst", num_classes=4)
    assert _outputs_requiring_grad(model, images) == [True, True, True]


def test_lst_backward_reaches_no_backbone_block(tiny_vit, images):
    # LST's ladders only read the backbone (CLIP-ViL/src/lxrt/modeling.py L796-822): no backward through it.
    model = petl.apply(tiny_vit(), "lst", num_classes=4, reduction=4)
    assert _outputs_requiring_grad(model, images) == [False, False, False]
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("method", SIDE)
def test_side_parameters_live_once_under_block_zero(tiny_vit, method):
    model = petl.apply(tiny_vit(), method, num_classes=4)
    names = [n for n, p in model.named_parameters() if p.requires_grad and not n.startswith("head.")]
    # HST also trains the blocks' own LayerNorms (blocks.<i>.base.norm1/norm2).
    assert names and all(n.startswith("blocks.0.network.") or ".base.norm" in n for n in names)
    sides = {id(b.side) for b in model.blocks}
    assert len(sides) == 1 and all(isinstance(b, _side.SideBlock) for b in model.blocks)


@pytest.mark.parametrize("method", SIDE)
def test_side_state_is_dropped_after_each_forward(tiny_vit, images, method):
    model = petl.apply(tiny_vit(), method, num_classes=4)
    model(images)
    side = model.blocks[0].side
    held = [v for v in vars(side).values() if isinstance(v, torch.Tensor)]
    held += [v for v in vars(side).values() if isinstance(v, list) and any(isinstance(t, torch.Tensor) for t in v)]
    assert held == [] and getattr(side, "output", None) is None


@pytest.mark.parametrize("method", SIDE)
def test_side_methods_refuse_gradient_checkpointing_with_a_clear_error(tiny_vit, images, method):
    model = petl.apply(tiny_vit(), method, num_classes=4).train()
    with pytest.raises(ValueError, match=f"gradient checkpointing: method '{method}' cannot use it: its side network"):
        model.set_grad_checkpointing(True)
    # Switched on behind timm's back, the out-of-order block still raises in the backward.
    model.grad_checkpointing = True
    with pytest.raises(RuntimeError, match="gradient checkpointing"):
        model(images).sum().backward()


def test_hst_rejects_bad_options(tiny_vit):
    for options, field in [({"dims": [8, 12], "heads": [3]}, "dims"), ({"dims": [8], "heads": [3]}, "dims"),
                           ({"dims": ["a"], "heads": [1]}, "dims"), ({"meta_tokens": 0}, "meta_tokens")]:  # fmt: skip
        with pytest.raises(ValueError, match=field):
            petl.apply(tiny_vit(), "hst", num_classes=4, **options)
    with pytest.raises(ValueError, match="num_classes"):
        petl.apply(tiny_vit(num_classes=0), "hst")


def test_dtl_rejects_bad_options(tiny_vit):
    for options, field in [({"rank": 0}, "rank"), ({"add_from": 3}, "add_from"), ({"fusion_size": 2}, "fusion_size")]:
        with pytest.raises(ValueError, match=field):
            petl.apply(tiny_vit(), "dtl", **options)
