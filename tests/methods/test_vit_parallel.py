"""The parallel-block ViTs (``vit_parallel``: timm's ParallelScalingBlock, vit_pwee_*): where each method lands.

The contract tests (test_method_contracts.py, family ``vit_pwee``) check every method that applies; these check that
what petl calls q, v, fc1, "after the MLP" and "beside the MLP" is that part of timm's block.
"""

from __future__ import annotations

import pytest
import timm
import torch
from conftest import TINY_VIT, make_tiny_family, perturb_trainable
from timm.models.vision_transformer import ParallelScalingBlock

import petl
from petl.methods.adapter import ParallelAdapter, SequentialAdapter
from petl.methods.convpass import ConvpassBlock
from petl.methods.repadapter import RepAdapterLinear
from petl.model.backbone import backbone_of, unwrap

# The tiny vit_pwee: width 48, MLP hidden 5 x 48 = 240; in_proj's rows are [fc1 | q | k | v] (timm's in_split).
HIDDEN, WIDTH = 240, 48
ROWS = {"fc1": (0, 240), "q": (240, 288), "k": (288, 336), "v": (336, 384)}


def test_the_family_is_chosen_by_block_class():
    assert backbone_of(make_tiny_family("vit_pwee")).kind == "vit_parallel"
    assert backbone_of(timm.create_model("vit_tiny_patch16_224", pretrained=False, **TINY_VIT)).kind == "vit"
    block = backbone_of(make_tiny_family("vit_pwee")).block_list()[0]
    assert block.in_split == [HIDDEN, WIDTH, WIDTH, WIDTH]


def test_differential_and_fused_blocks_are_refused_in_one_line():
    dpwee = timm.create_model("vit_dpwee_patch16_reg1_gap_256", pretrained=False, **TINY_VIT)
    with pytest.raises(ValueError, match=r"block 0 of VisionTransformer is a DiffParallelScalingBlock") as error:
        petl.apply(dpwee, "lora")
    assert "\n" not in str(error.value)
    fused = make_tiny_family("vit_pwee")
    fused.blocks[1] = ParallelScalingBlock(WIDTH, 3, mlp_ratio=5, fuse_out_proj=True)
    with pytest.raises(ValueError, match=r"block 1 of VisionTransformer fuses them into one out_proj") as error:
        petl.apply(fused, "linear")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("target", sorted(ROWS))
def test_lora_targets_are_their_rows_of_in_proj(target):
    model = petl.apply(make_tiny_family("vit_pwee"), "lora", targets=[target])
    perturb_trainable(model)
    in_proj = unwrap(backbone_of(model).block_list()[0].in_proj)
    before = in_proj.weight.clone()
    petl.merge(model)
    changed = (in_proj.weight != before).any(dim=1).nonzero().flatten()
    assert (changed.min().item(), changed.max().item() + 1) == ROWS[target]


def test_lora_proj_and_fc2_are_the_output_linears():
    model = petl.apply(make_tiny_family("vit_pwee"), "lora", targets=["proj", "fc2"])
    block = backbone_of(model).block_list()[0]
    assert type(block.in_proj) is torch.nn.Linear
    assert {type(block.attn_out_proj).__name__, type(block.mlp_out_proj).__name__} == {"LoraLinear"}


def test_sequential_adapter_follows_the_mlp_output():
    model = petl.apply(make_tiny_family("vit_pwee"), "adapter")
    block = backbone_of(model).block_list()[0]
    assert isinstance(block.mlp_out_proj, SequentialAdapter) and type(block.attn_out_proj) is torch.nn.Linear


def test_parallel_adapter_reads_the_block_input_and_adds_to_its_output():
    model = petl.apply(make_tiny_family("vit_pwee"), "adapter", style="parallel", dim=4)
    perturb_trainable(model)
    wrapper = backbone_of(model).block_container()[0]
    assert isinstance(wrapper, ParallelAdapter)
    x = torch.randn(2, 17, WIDTH)  # a register token and 4x4 patches
    with torch.no_grad():
        torch.testing.assert_close(wrapper(x), wrapper.base(x) + wrapper.adapter(x))


def test_repadapter_adapts_the_mlp_rows_and_the_qkv_rows_apart():
    model = petl.apply(make_tiny_family("vit_pwee"), "repadapter", dropout=0.0)
    outer = backbone_of(model).block_list()[0].in_proj
    assert isinstance(outer, RepAdapterLinear) and isinstance(outer.base, RepAdapterLinear)
    assert {outer.out_rows, outer.base.out_rows} == {ROWS["fc1"], (HIDDEN, HIDDEN + 3 * WIDTH)}
    # Only the qkv rows' adapter trained: the MLP's rows of in_proj's output are the frozen Linear's.
    with torch.no_grad():
        outer.up_weight.normal_()
        outer.up_bias.normal_()
    x = torch.randn(2, 17, WIDTH)
    plain = unwrap(outer)(x)
    with torch.no_grad():
        got = outer(x)
    start, end = outer.out_rows
    others = torch.ones(plain.shape[-1], dtype=torch.bool)
    others[start:end] = False
    torch.testing.assert_close(got[..., others], plain[..., others])
    assert not torch.allclose(got[..., start:end], plain[..., start:end])


def test_bitfit_takes_fc1_bias_beside_a_bias_free_in_proj():
    model = petl.apply(make_tiny_family("vit_pwee", qkv_bias=False), "bitfit", biases="linear")
    block = backbone_of(model).block_list()[0]
    assert block.in_proj.bias is None and block.mlp_bias.requires_grad
    assert block.attn_out_proj.bias.requires_grad and block.mlp_out_proj.bias.requires_grad


REFUSED = [m for m in petl.list_methods() if "vit_parallel" not in petl.get_method(m).backbones]


@pytest.mark.parametrize("method", REFUSED)
def test_a_refused_method_says_why_in_one_line(method):
    with pytest.raises(ValueError, match=rf"^method '{method}' does not support the vit_parallel backbone") as error:
        petl.apply(make_tiny_family("vit_pwee"), method)
    assert "\n" not in str(error.value)
    assert str(error.value).endswith(petl.get_method(method).why_refused("vit_parallel"))


MERGED = [
    ("vit_pwee", "lora", {"targets": ["q", "v", "fc1", "proj", "fc2"]}),
    ("vit_pwee", "repadapter", {}),
    ("vit_pwee", "ssf", {}),
    ("vit_pwee", "hydra", {}),
    ("vit_pwee", "peft", {"target_modules": ["in_proj"]}),
    ("vit_pwee_4x", "fact", {"type": "tt"}),
]


@pytest.mark.parametrize(("family", "method", "options"), MERGED, ids=[m for _, m, _ in MERGED])
def test_merged_methods_unload_into_plain_timm(images, family, method, options):
    # RepAdapter's and FacT's second wrapper on in_proj wraps the first: unloading goes down to the Linear.
    model = petl.apply(make_tiny_family(family), method, num_classes=4, **options).eval()
    perturb_trainable(model)
    want = model(images)
    petl.unload(model)
    plain = make_tiny_family(family, num_classes=4)
    plain.load_state_dict(model.state_dict())
    assert (plain.eval()(images) - want).abs().max() < 1e-5


def test_convpass_bypasses_read_the_blocks_norm_and_add_inside_its_layer_scale():
    model = petl.apply(make_tiny_family("vit_pwee"), "convpass", dropout=0.0)
    perturb_trainable(model)
    wrapper = backbone_of(model).block_container()[0]
    assert isinstance(wrapper, ConvpassBlock)
    block, x = wrapper.base, torch.randn(2, 17, WIDTH)
    with torch.no_grad():
        side = wrapper.attn_bypass.bypass(block.in_norm(x)) + wrapper.mlp_bypass.bypass(block.in_norm(x))
        torch.testing.assert_close(wrapper(x), block(x) + block.ls.gamma * side)


@pytest.mark.parametrize("kind", ["tt", "tk"])
def test_fact_updates_fc1_and_qkv_rows_of_in_proj_by_their_kinds(kind):
    model = petl.apply(make_tiny_family("vit_pwee_4x"), "fact", type=kind, rank=4, dropout=0.0)
    perturb_trainable(model)
    outer = backbone_of(model).block_list()[1].in_proj
    inner = outer.base
    assert (outer.kind, outer.out_rows, inner.kind, inner.out_rows) == ("fc1", (0, 192), "qkv", (192, 336))
    weight = unwrap(outer).weight
    before = weight.clone()
    petl.merge(model)
    with torch.no_grad():
        torch.testing.assert_close(
            weight - before, torch.cat([outer.delta_weight(weight.dtype), inner.delta_weight(weight.dtype)])
        )


def test_peft_naming_qkv_is_refused_with_the_blocks_own_linears():
    with pytest.raises(ValueError, match=r"its blocks' Linears are in_proj, attn_out_proj, mlp_out_proj$") as error:
        petl.apply(make_tiny_family("vit_pwee"), "peft", target_modules=["qkv"])
    assert "\n" not in str(error.value)
