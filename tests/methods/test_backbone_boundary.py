"""Only the backbone implementations know a model family's internals (issue 53).

Every other module of the package reaches the model through ``petl.backbone_of(model)``: this test reads their
source (as tests/bench/test_harness.py reads the package list) and fails on a direct access to what a family keeps
inside, so that a second family (Swin) is a second implementation, not a branch in every caller.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import timm
import torch
from conftest import TINY_FAMILIES, TINY_MODELS, make_tiny_family
from timm.models.vision_transformer import VisionTransformer

import petl
from petl.model.backbone import base
from petl.model.backbone.vit import ViT

PACKAGE = Path(petl.__file__).parent
# The implementations, and the timm models petl registers (they define a ViT; they do not reach into one).
ALLOWED = (PACKAGE / "model" / "backbone", PACKAGE / "backbones")
# A model's attributes that only its family's Backbone may read.
INTERNALS = {"blocks", "ls1", "ls2", "_pos_embed", "attn", "mlp", "downsample", "_attn"}
FAMILY_CLASSES = {"VisionTransformer", "SwinTransformer", "SwinTransformerV2", "SwinTransformerV2Cr"}
# Modules whose ``.blocks`` are a rank test's blocks (petl/bench/ranking.py's Ranking, scipy's word), not a model's.
RANK_TEST_BLOCKS = {"petl/bench/choice.py", "petl/bench/notes.py", "petl/bench/report.py"}


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if not any(p.is_relative_to(a) for a in ALLOWED))


def _violations(path: Path) -> list[str]:
    return _violations_in(path.read_text(), path)


def _violations_in(source: str, path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, str(path))):
        where = f"{path.relative_to(PACKAGE.parent)}:{getattr(node, 'lineno', 0)}"
        # A module's own attributes (self.mlp of a side network) are its own; anything else's are the model's.
        if isinstance(node, ast.Attribute) and node.attr in INTERNALS:
            ranks = node.attr == "blocks" and where.split(":")[0] in RANK_TEST_BLOCKS
            if not ranks and not (isinstance(node.value, ast.Name) and node.value.id == "self"):
                found.append(f"{where}: .{node.attr}")
        if (
            isinstance(node, ast.Attribute | ast.Name)
            and getattr(node, "attr", getattr(node, "id", "")) in FAMILY_CLASSES
        ):
            found.append(f"{where}: {ast.unparse(node)}")
        if isinstance(node, ast.ImportFrom) and node.module:
            names = {alias.name for alias in node.names}
            if (
                names & FAMILY_CLASSES
                or node.module.startswith("petl.model.backbone.")
                or (node.module == "petl.model.backbone" and names & {"vit", "base"})
            ):
                found.append(f"{where}: from {node.module} import {', '.join(sorted(names))}")
    return found


def test_no_module_reaches_past_the_backbone():
    modules = _modules()
    assert len(modules) > 100, "the walk found too few modules"
    found = [v for path in modules for v in _violations(path)]
    assert not found, "reach the model through petl.backbone_of(model):\n" + "\n".join(found)


def test_the_check_catches_a_direct_access():
    sample = PACKAGE / "_boundary_sample.py"  # read in place of a module, never written
    source = (
        "from timm.models.vision_transformer import VisionTransformer\nx = (model.blocks, b.ls1, self.mlp)\n"
        "cr = isinstance(model, timm.models.swin_transformer_v2_cr.SwinTransformerV2Cr)\n"
    )
    found = [v.split(": ", 1)[1] for v in _violations_in(source, sample)]
    assert sorted(found) == [
        ".blocks",
        ".ls1",
        "from timm.models.vision_transformer import VisionTransformer",
        "timm.models.swin_transformer_v2_cr.SwinTransformerV2Cr",
    ]


def test_backbone_is_chosen_by_model_class(tiny_vit):
    assert isinstance(petl.backbone_of(tiny_vit()), ViT)
    assert petl.list_backbones() == [
        *("beit", "eva", "naflexvit", "swin", "swinv2", "swinv2_cr", "vit", "vit_parallel", "vit_relpos")
    ]
    deit = timm.create_model("deit_tiny_distilled_patch16_224", img_size=32, patch_size=8, num_classes=3)
    assert petl.backbone_of(deit).kind == "vit"  # a subclass of VisionTransformer, found through its MRO


def test_apply_docstring_names_every_backbone_kind():
    # petl.apply's docs list the kinds by hand (api.md renders them): a kind registered later is named there too.
    args = petl.apply.__doc__.split("model:", 1)[1].split("method:", 1)[0]
    assert sorted(re.findall(r"``(\w+)``", args)) == petl.list_backbones()


def test_a_backbone_a_method_does_not_declare_is_refused(tiny_vit, monkeypatch):
    class OtherViT(VisionTransformer):
        pass

    class Other(ViT):
        kind = "other"

    monkeypatch.setitem(base._FAMILIES, OtherViT, Other)
    model = OtherViT(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=3, num_classes=3)
    with pytest.raises(ValueError, match=r"^method 'lora' does not support the other backbone \(OtherViT\)") as error:
        petl.apply(model, "lora")
    assert "\n" not in str(error.value)
    assert not any(p.requires_grad is False for p in model.parameters())  # refused before anything changed


def test_interface_matches_the_vit(tiny_vit):
    model = tiny_vit().eval()
    bb = petl.backbone_of(model)
    assert bb.depth() == len(bb.block_list()) and bb.widths() == [bb.width()] * bb.depth()
    assert bb.stages() == [0] * bb.depth() and bb.layout == "sequence"
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        x = bb.embed_tokens(images)
        for block in bb.block_container():
            x = bb.run_block(block, x)
        assert torch.equal(bb.head()(bb.pooled_features(x)), model(images))


@pytest.mark.parametrize("kind", ["swin", "swinv2", "swinv2_cr"])
def test_interface_matches_the_swin(kind, images):
    model = TINY_MODELS[kind]()
    bb = petl.backbone_of(model)
    assert bb.kind == kind and bb.layout == "windows"
    assert bb.widths() == [16, 16, 32, 32] and bb.stages() == [0, 0, 1, 1] and bb.feature_taps() == [1, 3]
    assert bb.num_prefix_tokens() == 0 and bb.grid_size() == (8, 8)
    with pytest.raises(ValueError, match="several block widths"):
        bb.width()
    logits = model(images)
    with torch.no_grad():
        # The blocks one by one (each stage's patch merging in front of its first), then the pooled features.
        x = bb.embed_tokens(images)
        for i, block in enumerate(bb.block_container()):
            x = bb.run_block(block, bb.before_block(i, x))
            # Each block is its two residual halves, as the methods that act between them run it.
            assert x.shape[-1] == bb.widths()[i]
        torch.testing.assert_close(bb.head()(bb.pooled_features(x)), logits)
        # The logits again from every cut point, as the feature cache replays them.
        for start in range(bb.depth()):
            seen: list[torch.Tensor] = []
            record = seen.append
            handle = bb.block_input_module(start).register_forward_pre_hook(lambda _m, args, r=record: r(args[0]))
            model(images)
            handle.remove()
            torch.testing.assert_close(bb.forward_from(seen[0], start), logits)
        # Both blocks of the first stage: the second ends a SwinV2Cr stage with its third norm (norm3).
        for block in bb.block_list()[:2]:
            grid = torch.randn(2, 8, 8, 16)
            torch.testing.assert_close(bb.mlp_residual(block, bb.attn_residual(block, grid)), block(grid))
        keep = torch.ones(2, 16, dtype=torch.bool)
        torch.testing.assert_close(bb.pooled_features(x, keep), bb.pooled_features(x))


@pytest.mark.parametrize("kind", ["swin", "swinv2", "swinv2_cr"])
@pytest.mark.parametrize("method", petl.list_methods())
def test_a_method_refuses_a_backbone_it_does_not_declare_in_one_line(kind, method):
    spec = petl.get_method(method)
    if kind in spec.backbones:
        pytest.skip(f"{method} supports {kind}")
    model = TINY_MODELS[kind]()
    with pytest.raises(ValueError, match=rf"^method '{method}' does not support the {kind} backbone") as error:
        petl.apply(model, method)
    assert "\n" not in str(error.value)
    # The reason, where the method gives one, is the refusal's end.
    assert str(error.value).endswith(spec.refusal)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_interface_matches_each_family(family):
    # The blocks run one by one, the pooled features and the replay from a middle block give the model's logits.
    model = make_tiny_family(family)
    bb = petl.backbone_of(model)
    assert bb.depth() == len(bb.block_list()) == 3 and bb.width() == 48
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = model(images)
        x = bb.embed_tokens(images)
        assert x.shape == (2, bb.num_tokens(), 48)
        for i, block in enumerate(bb.block_container()):
            if i == 1:
                torch.testing.assert_close(bb.forward_from(x, 1), want)
            x = bb.run_block(block, x, index=i)
        torch.testing.assert_close(bb.head()(bb.pooled_features(x)), want)
        torch.testing.assert_close(bb.head()(bb.pre_logits(images)), want)
        keep = torch.ones(2, x.shape[1], dtype=torch.bool)
        if bb.pool_type() in bb.maskable_pools:
            torch.testing.assert_close(bb.head()(bb.pooled_features(x, keep)), want)
