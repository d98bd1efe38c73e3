"""The public API: defaults, error messages, unsupported models, counting, config schemas."""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing

import pytest
import timm
import torch
from conftest import TINY_MODELS, TINY_VIT, perturb_trainable
from timm.models.resnet import BasicBlock, ResNet
from torch import nn

import petl
from petl.deploy.multitask import TaskRefused
from petl.methods.ssf import SsfLayer
from petl.model.backbone import backbone_of
from petl.model.registry import MethodConfig, make_config
from petl.train import config as run_config
from petl.utils.checks import check_dropout, check_range

EXPORTS = [
    "apply",
    "apply_lora",
    "apply_adapter",
    "apply_vpt",
    "apply_linear",
    "apply_mlp",
    "apply_partial",
    "apply_full",
    "apply_peft",
    "list_methods",
    "count_params",
    "merge",
    "unmerge",
    "save_trainable",
    "load_trainable",
]


def test_public_names_exist():
    assert [name for name in EXPORTS if not hasattr(petl, name)] == []
    assert set(EXPORTS) <= set(petl.__all__)
    assert petl.list_methods() == sorted(
        ["linear", "mlp", "partial", "full", "lora", "adapter", "vpt", "peft"]
        + ["hydra", "adapter_plus", "sct", "convpass"]  # issue 11
        + ["bitfit", "ln", "ssf", "fact", "repadapter"]
        + ["dtl", "lst", "hst"]  # issue 23, side tuning
        + ["gps", "noah"]  # issue 23
        + ["last", "snf"]  # issue 23
    )


def test_apply_lora_without_arguments_keeps_the_head(tiny_vit, images):
    model = tiny_vit()
    head = model.head
    assert petl.apply_lora(model) is model
    assert model.head is head and model.head.weight.requires_grad
    assert model.petl_method == "lora" and model.petl_config.rank == 8
    assert model(images).shape == (2, 5)


@pytest.mark.parametrize("method", petl.list_methods())
def test_apply_resets_head_and_records_config(tiny_vit, method):
    model = petl.apply(tiny_vit(), method, num_classes=7)
    assert model.petl_method == method
    assert isinstance(model.petl_config, petl.get_method(method).config_cls)
    assert model.petl_config.num_classes == 7
    assert all(p.requires_grad for p in backbone_of(model).head().parameters())


def test_unknown_method_lists_the_valid_ones(tiny_vit):
    with pytest.raises(ValueError) as err:
        petl.apply(tiny_vit(), "lorax")
    assert all(name in str(err.value) for name in petl.list_methods())


def test_unknown_option_names_it_and_the_valid_fields(tiny_vit):
    with pytest.raises(ValueError, match=r"ranks.*valid:.*rank"):
        petl.apply_lora(tiny_vit(), ranks=4)


@pytest.mark.parametrize(
    ("method", "options", "pattern"),
    [
        ("lora", {"rank": 0}, "rank=0"),
        ("lora", {"alpha": 0.0}, "alpha"),
        ("lora", {"dropout": 1.5}, "dropout"),
        ("lora", {"targets": ("q", "x")}, r"targets='x'.*q, k, v, proj, fc1, fc2"),
        ("lora", {"targets": ()}, "targets"),
        ("adapter", {"style": "diagonal"}, r"style.*sequential, parallel"),
        ("adapter", {"dim": 0}, "dim=0"),
        ("partial", {"k": 9}, r"k=9.*\[1, 3\]"),
        ("mlp", {"k": 0}, "k=0"),
        ("vpt", {"num_tokens": -1}, "num_tokens"),
        ("linear", {"num_classes": 0}, "num_classes"),
    ],
)
def test_out_of_range_values_name_the_field(tiny_vit, method, options, pattern):
    model = tiny_vit()
    with pytest.raises(ValueError, match=pattern):
        petl.apply(model, method, **options)
    # Validation runs before anything is changed.
    assert getattr(model, "petl_method", None) is None
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize(
    ("method", "options"),
    [
        ("lora", {"alpha": float("nan")}),  # alpha <= 0 alone lets NaN through
        ("lora", {"alpha": float("inf")}),
        ("lora", {"dropout": float("nan")}),
        ("adapter", {"scale": float("nan")}),
        ("vpt", {"dropout": float("-inf")}),
    ],
)
def test_non_finite_floats_are_refused_by_every_method(tiny_vit, method, options):
    model = tiny_vit()
    ((key, value),) = options.items()
    with pytest.raises(ValueError, match=rf"^{key}={value} is not a finite number"):
        petl.apply(model, method, **options)
    assert getattr(model, "petl_method", None) is None


def test_check_range_bounds_and_non_finite():
    check_range("x", 0.5, low=0, high=1)
    check_range("x", None, low=0)  # unset optional options pass
    with pytest.raises(ValueError, match=r"x=0 is out of range: allowed \(0, inf\]"):
        check_range("x", 0, low=0, open_low=True)
    with pytest.raises(ValueError, match=r"x=1.0 is out of range: allowed \[0, 1\)"):
        check_dropout("x", 1.0)
    with pytest.raises(ValueError, match=r"x=nan is not a finite number: allowed \[0, 1\)"):
        check_dropout("x", float("nan"))


@pytest.mark.slow
def test_apply_dispatches_on_the_config_type(tiny_vit, images):
    from petl.methods.lora import LoraConfig

    model = petl.apply(tiny_vit(), LoraConfig(rank=4, num_classes=3))
    assert model.petl_method == "lora" and model.petl_config.rank == 4
    assert model(images).shape == (2, 3)
    classes = [petl.get_method(m).config_cls for m in petl.list_methods()]
    for method in petl.list_methods():
        config = petl.get_method(method).config_cls()
        if classes.count(type(config)) == 1:
            assert petl.apply(tiny_vit(), config).petl_method == method
        else:  # presets sharing one config class need their name
            with pytest.raises(ValueError, match="pass the method name"):
                petl.apply(tiny_vit(), config)
    with pytest.raises(ValueError, match="once"):
        petl.apply(tiny_vit(), LoraConfig(), LoraConfig())
    with pytest.raises(ValueError, match="no registered method takes a MethodConfig"):
        petl.apply(tiny_vit(), MethodConfig())


def test_config_or_options_not_both(tiny_vit):
    with pytest.raises(ValueError, match="either"):
        petl.apply(tiny_vit(), "lora", config=make_config("lora"), rank=2)
    with pytest.raises(ValueError, match="LoraConfig"):
        petl.apply(tiny_vit(), "lora", config=make_config("vpt"))


def test_applying_twice_is_refused(tiny_vit):
    model = petl.apply_lora(tiny_vit())
    with pytest.raises(ValueError, match="already carries"):
        petl.apply_adapter(model)


def test_resnet_is_unsupported_in_a_short_line_naming_its_class_and_the_doc():
    # The refusal listed every family's full description: one line of some 780 characters.
    resnet = ResNet(BasicBlock, [1, 1, 1, 1], num_classes=3)
    with pytest.raises(ValueError, match=r"^got ResNet, which no backbone family takes: petl takes timm's ") as error:
        petl.apply_lora(resnet)
    said = str(error.value)
    assert "VisionTransformer, " in said and "SwinTransformer, " in said and "Distilled" not in said, said
    assert said.endswith("(docs/backbones.md)") and len(said) < 250 and "\n" not in said, said


WRAPPERS = {
    "compiled": (lambda model: torch.compile(model), r"got OptimizedModule, torch\.compile's wrapper of a Vision"),
    "data parallel": (nn.DataParallel, r"got DataParallel, a wrapper of a VisionTransformer: .*\(model\.module\)$"),
    "features only": (
        lambda _model: timm.create_model("vit_tiny_patch16_224", features_only=True, **{**TINY_VIT, "num_classes": 0}),
        r"got FeatureGetterNet, timm's features_only=True wrapper: create the model without features_only",
    ),
}


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_a_wrapped_model_is_refused_saying_which_model_to_give(tiny_vit, tmp_path, wrapper):
    # A notebook compiles or wraps the model it trains: each petl call on the wrapper says which model to give, in
    # one line, instead of listing every family petl supports (a torch.compile'd model saved nothing).
    wrap, says = WRAPPERS[wrapper]
    petl.save_trainable(petl.apply_lora(tiny_vit()), tmp_path / "lora.safetensors")
    calls = {
        "apply": lambda model: petl.apply_lora(model),
        "load_trainable": lambda model: petl.load_trainable(model, tmp_path / "lora.safetensors"),
        "multitask": lambda model: petl.MultiTask(model, {"a": tmp_path / "lora.safetensors"}),
    }
    if wrapper != "features only":  # a trained model, then wrapped: saving and unloading it
        calls["save_trainable"] = lambda model: petl.save_trainable(model, tmp_path / "again.safetensors")
        calls["unload"] = petl.unload
    for name, call in calls.items():
        model = tiny_vit() if name in ("apply", "load_trainable", "multitask") else petl.apply_lora(tiny_vit())
        with pytest.raises(ValueError, match=says) as error:
            call(wrap(model))
        assert "\n" not in str(error.value) and "petl supports" not in str(error.value), name
    assert not (tmp_path / "again.safetensors").exists()


def test_a_distilled_deit_is_refused_in_one_line_saying_which_deit_to_take(tmp_path):
    # Its logits average head (class token) and head_dist (distillation token): petl read one head, so a MultiTask
    # row answered head alone, the feature cache trained head alone, and head_dist counted as outside the head.
    deit = timm.create_model(
        "deit_tiny_distilled_patch16_224", img_size=32, patch_size=8, embed_dim=48, depth=1, num_heads=3, num_classes=3
    )
    for use in (lambda: petl.apply(deit, "lora", num_classes=4), lambda: petl.MultiTask(deit, {"a": tmp_path / "a"})):
        with pytest.raises(ValueError, match=r"head_dist .*: take the DeiT without distillation") as error:
            use()
        assert "\n" not in str(error.value)
    assert all(p.requires_grad for p in deit.parameters()) and getattr(deit, "petl_method", None) is None


# Models of a family's timm module whose blocks it does not take: (timm model, its overrides, the refusal's end).
REFUSED_LAYOUTS = [
    # DINOv3's rotary embedding is computed per image size (dynamic_img_size), as LingBot's and Sapiens2's: petl's
    # hooks are built for one grid, which the same model built with dynamic_img_size=False has
    # (tests/methods/test_eva_rope.py).
    *(
        (
            name,
            overrides,
            "Eva has a rotary embedding per image size (dynamic_img_size=True, as timm's vit_*_dinov3, vit_*_lingbot "
            "and vit_*_sapiens2): create it with dynamic_img_size=False, the same model at its img_size (petl-run: "
            "+model.kwargs.dynamic_img_size=false)",
        )
        for name, overrides in [
            ("vit_small_patch16_dinov3", {}),
            ("vit_small_patch16_lingbot", {}),
            ("vit_base_patch16_sapiens2", {"num_kv_heads": (3,)}),
        ]
    ),
    ("beit_base_patch16_224", {"swiglu_mlp": True}, "block 0 of Beit: Block with SwiGLU, not taken"),
    ("vit_relpos_base_patch16_rpn_224", {}, "block 0 of VisionTransformerRelPos is a ResPostRelPosBlock"),
    # Post-norm, where ViT's residual halves (parallel adapter, SCT, SNF, GPS, a mixed batch's masks) are pre-norm.
    ("vit_base_patch16_rpn_224", {}, "block 0 of VisionTransformer is a ResPostBlock, not timm's pre-norm Block"),
    # Two attentions and two MLPs per block: the refusal named the block alone, not what to take instead.
    (
        "vit_small_patch16_18x2_224",
        {},
        "block 0 of VisionTransformer is a ParallelThingsBlock (vit_*_18x2_*): its attentions and MLPs run in pairs "
        "side by side, where petl reads one of each: take a plain ViT of its width (vit_small_patch16_224, "
        "vit_base_patch16_224)",
    ),
]


@pytest.mark.parametrize(("name", "overrides", "says"), REFUSED_LAYOUTS, ids=[c[0] for c in REFUSED_LAYOUTS])
def test_a_block_layout_the_family_does_not_take_is_named_in_one_line(name, overrides, says):
    # EVA's and BEiT's refusals ended "block 0 of Eva is not", naming neither the block nor what it runs; a plain
    # ViT of post-norm blocks was taken, and GPS failed on it with an AttributeError (no ls1).
    model = timm.create_model(name, img_size=32, patch_size=8, embed_dim=48, depth=1, num_heads=3, **overrides)
    with pytest.raises(ValueError, match=r"^petl supports a timm ") as error:
        petl.apply(model, "lora")
    assert str(error.value).endswith(f"; {says}") and "\n" not in str(error.value)


def test_a_vitamin_is_taken_and_a_method_on_the_patch_projection_it_lacks_is_refused_in_one_line(images):
    # timm's ViTamin is a VisionTransformer whose HybridEmbed (proj=False) hands its MbConv stem's features to the
    # blocks as they are: GPS failed with "'Identity' object has no attribute 'weight'", HST with no 'in_channels',
    # and petl-run called vitamin_* an unknown model.
    def vitamin() -> nn.Module:
        torch.manual_seed(0)
        return timm.create_model("vitamin_small_224", img_size=32, depth=1, num_classes=3).eval()

    reference = vitamin()(images)
    for method in ("lora", "adapter"):  # zero-initialised: the backbone's logits
        torch.testing.assert_close(petl.apply(vitamin(), method).eval()(images), reference)
    for method in ("gps", "hst"):
        model = vitamin()
        with pytest.raises(ValueError, match=r"^VisionTransformer's patch embedding has no projection .*vitamin_") as e:
            petl.apply(model, method)
        assert str(e.value).endswith("choose a method that does not act on the patch projection")
        assert "\n" not in str(e.value) and getattr(model, "petl_method", None) is None
    assert "vitamin_small_224" in run_config.list_models()


class _SplitQKV(nn.Module):
    """Attention with separate q, k, v projections, as some ViT variants have."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.v(x)


def test_vit_without_fused_qkv_is_unsupported(tiny_vit):
    model = tiny_vit()
    for block in model.blocks:
        block.attn = _SplitQKV(48)
    with pytest.raises(ValueError, match="fused attn.qkv"):
        petl.apply(model, "linear")


@pytest.mark.parametrize("kind", ["vit", "swinv2_cr"])
def test_a_model_without_pooling_is_refused_in_one_line(kind):
    # timm's global_pool='' gives logits per token (per grid cell on a Swin): taken, a run failed at its first step
    # inside the loss ("only batches of spatial targets supported"); a SwinV2Cr's head failed on the NCHW map.
    model = TINY_MODELS[kind](global_pool="")
    message = f"^{type(model).__name__} is built with global_pool='' .*: build it with a pooling [^\n]*$"
    with pytest.raises(ValueError, match=message):
        petl.apply(model, "lora", num_classes=4)
    assert all(p.requires_grad for p in model.parameters())  # refused before anything changed


def test_count_params(tiny_vit):
    model = petl.apply_linear(tiny_vit(), num_classes=4)
    counts = petl.count_params(model)
    total = sum(p.numel() for p in model.parameters())
    assert counts == petl.ParamCount(trainable=48 * 4 + 4, trainable_no_head=0, total=total)
    assert petl.count_params(petl.apply_full(tiny_vit(), num_classes=4)).trainable == total


@pytest.mark.parametrize("name", ["resnet10t", "convnext_atto"])
def test_count_params_of_another_timm_model_leaves_out_its_classifier(name):
    # A ResNet's fc was counted as outside the head (it has no "head" attribute); a ConvNeXt, which has one, was
    # refused with the list of petl's backbone families.
    model = timm.create_model(name, pretrained=False, num_classes=3)
    in_head = sum(p.numel() for p in model.get_classifier().parameters())
    total = sum(p.numel() for p in model.parameters())
    assert petl.count_params(model) == petl.ParamCount(trainable=total, trainable_no_head=total - in_head, total=total)


def test_a_wrapper_that_refuses_part_way_through_its_fold_is_put_back_too(tiny_vit):
    # SSF writes its weight, then refuses a bias that overflows float16: the model was said to be left unmerged with
    # that weight doubled (the rollback put back the wrappers merged before the refusing one, not it).
    model = petl.apply_ssf(tiny_vit()).half()
    ssf = [m for m in model.modules() if isinstance(m, SsfLayer) and getattr(m.base, "bias", None) is not None][-1]
    with torch.no_grad():
        ssf.scale.fill_(2.0), ssf.base.bias.fill_(500.0), ssf.shift.fill_(65000.0)  # 66000 > float16's 65504
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with pytest.raises(ValueError, match="refusing to merge SSF into the bias: it holds non-finite values"):
        petl.merge(model)
    assert not any(getattr(m, "merged", False) for m in model.modules())
    assert all(torch.equal(tensor, before[name]) for name, tensor in model.state_dict().items())


def test_merge_needs_a_mergeable_method(tiny_vit):
    with pytest.raises(ValueError, match="nothing to merge"):
        petl.merge(petl.apply_vpt(tiny_vit()))


def test_merge_and_unmerge_of_a_model_without_a_method_say_why_in_their_own_words(tiny_vit):
    # "nothing to merge: method None adds no mergeable layer; ... runs as trained without merging", from unmerge too.
    with pytest.raises(ValueError, match=r"^nothing to merge: the model carries no petl method \(petl\.apply one"):
        petl.merge(tiny_vit())
    unloaded = petl.unload(petl.apply_lora(tiny_vit(), num_classes=3))
    with pytest.raises(ValueError, match=r"^nothing to unmerge: petl\.unload folded .* for good: .* build the"):
        petl.unmerge(unloaded)
    with pytest.raises(ValueError, match=r"^nothing to unmerge: method 'vpt' adds no mergeable layer$"):
        petl.unmerge(petl.apply_vpt(tiny_vit()))


# The CLI builds Hydra/OmegaConf schemas from the config dataclasses, so field types stay plain.
PLAIN_TYPES = {int, float, str, bool, int | None, float | None, str | None, tuple[str, ...]}


@pytest.mark.parametrize("method", petl.list_methods())
def test_config_fields_have_plain_types_and_defaults(method):
    config_cls = petl.get_method(method).config_cls
    hints = typing.get_type_hints(config_cls)
    for field in dataclasses.fields(config_cls):
        assert hints[field.name] in PLAIN_TYPES, (field.name, hints[field.name])
        assert field.default is not dataclasses.MISSING, field.name
    config_cls()  # every field has a default


@pytest.mark.parametrize("method", petl.list_methods())
def test_configs_accept_lists_for_tuples(method):
    config_cls = petl.get_method(method).config_cls
    hints = typing.get_type_hints(config_cls)
    for field in dataclasses.fields(config_cls):
        if hints[field.name] == tuple[str, ...]:
            as_list = config_cls(**{field.name: list(field.default)})
            assert getattr(as_list, field.name) == field.default


def test_comma_separated_targets():
    assert make_config("lora", targets="q, k,v").targets == ("q", "k", "v")


def test_save_needs_an_applied_model(tiny_vit, tmp_path):
    with pytest.raises(ValueError, match="petl.apply"):
        petl.save_trainable(tiny_vit(), tmp_path / "x.safetensors")


@pytest.mark.parametrize(
    ("method", "says"),
    [
        ({"rank": 4}, r"got dict \{'rank': 4\}: give the name and unpack the options"),
        (petl.methods.lora.LoraConfig, "pass a config object, e.g. LoraConfig\\(\\), not the class"),
        (None, "got NoneType None: choose one of adapter"),
    ],
    ids=["dict", "config-class", "none"],
)
def test_a_method_that_is_no_name_nor_config_is_named(tiny_vit, method, says):
    # A dict (or any unhashable object) failed the registry lookup as "TypeError: unhashable type: 'dict'".
    with pytest.raises(ValueError, match=says) as refused:
        petl.apply(tiny_vit(), method)
    assert "\n" not in str(refused.value)


def test_a_config_given_as_a_dict_says_to_pass_keywords(tiny_vit):
    with pytest.raises(ValueError, match=r"got dict: pass options as keywords, apply\(model, 'lora', \*\*options\)"):
        petl.apply(tiny_vit(), "lora", {"rank": 4})


def test_the_model_keeps_its_own_copy_of_the_config(tiny_vit, tmp_path):
    # Reusing a config object in a notebook: changing it after apply changed the first model's recorded config, so
    # save_trainable wrote a file whose metadata (rank 16) did not match its tensors (rank 2), which never loaded.
    config = petl.methods.lora.LoraConfig(rank=2, num_classes=3)
    first = petl.apply(tiny_vit(), config)
    config.rank = 16
    second = petl.apply(tiny_vit(), config)
    assert (first.petl_config.rank, second.petl_config.rank) == (2, 16)
    petl.save_trainable(first, tmp_path / "first.safetensors")
    loaded = petl.load_trainable(tiny_vit(), tmp_path / "first.safetensors")
    assert loaded.petl_config.rank == 2


def test_a_model_peft_already_wrapped_is_named(tiny_vit):
    # It failed the backbone check as "block 0 has no fused attn.qkv Linear" (peft's layer stands in its place), or,
    # for a PeftModel, with the list of every supported family.
    peft = pytest.importorskip("peft")
    injected = peft.inject_adapter_in_model(peft.LoraConfig(r=4, target_modules=["qkv"]), tiny_vit())
    with pytest.raises(ValueError, match="carries peft's Linear at blocks.0.attn.qkv: petl.apply takes a plain timm"):
        petl.apply(injected, "lora")
    wrapped = peft.get_peft_model(tiny_vit(), peft.LoraConfig(r=4, target_modules=["qkv"]))
    with pytest.raises(ValueError, match="is a peft PeftModel: petl.apply takes a plain timm model"):
        petl.apply(wrapped, "bitfit")


def test_register_method_refuses_a_config_class_that_is_no_method_config():
    # Accepted before, it failed only at petl.apply, inside dataclasses ("must be called with a dataclass type").
    with pytest.raises(
        ValueError, match="config_cls must be a @dataclass subclass of petl.MethodConfig, got <class 'dict'>"
    ):
        petl.register_method("not_a_config", dict, trainable_formula=lambda model, cfg: 0)
    assert "not_a_config" not in petl.list_methods()


def test_a_model_on_the_meta_device_is_refused_by_save_and_load(tiny_vit, tmp_path):
    # Loading copied the file's tensors into meta tensors, which keeps no values: it returned as if it had loaded.
    path = tmp_path / "lora.safetensors"
    petl.save_trainable(petl.apply_lora(tiny_vit(), num_classes=3), path)
    with torch.device("meta"):
        on_meta = tiny_vit()
    with pytest.raises(ValueError, match="the model is on the meta device .* materialise it first"):
        petl.load_trainable(on_meta, path)
    assert getattr(on_meta, "petl_method", None) is None
    with pytest.raises(ValueError, match="the model is on the meta device"):
        petl.save_trainable(petl.apply_lora(on_meta), tmp_path / "meta.safetensors")


def test_a_folder_given_as_the_weights_file_is_named(tiny_vit, tmp_path):
    # It was "FileNotFoundError: no such file" for a folder that is there.
    with pytest.raises(ValueError, match="is a folder: give the .safetensors file in it .*trainable.safetensors"):
        petl.load_trainable(tiny_vit(), tmp_path)
    with pytest.raises(ValueError, match="is a folder"):
        petl.read_trainable_metadata(tmp_path)


def test_a_model_frozen_after_training_still_saves_what_its_method_trained(tiny_vit, images, tmp_path):
    # save_trainable wrote the tensors requiring grad at save time: after model.requires_grad_(False) (before
    # inference, say) it wrote a file without a tensor, silently, and the training was lost.
    model = petl.apply_lora(tiny_vit(), num_classes=3)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.1)
    model.eval().requires_grad_(False)
    petl.save_trainable(model, tmp_path / "lora.safetensors")
    loaded = petl.load_trainable(tiny_vit(), tmp_path / "lora.safetensors").eval()
    assert torch.equal(loaded(images), model(images))
    petl.load_trainable(model, tmp_path / "lora.safetensors")  # onto the frozen model itself too


@pytest.mark.parametrize("method", petl.list_methods())
def test_a_norm_unfrozen_beside_the_method_is_saved_and_loaded_back(tiny_vit, images, tmp_path, method):
    # save_trainable wrote every tensor requiring grad, the final norm a notebook unfroze beside LoRA among them, and
    # load_trainable (and MultiTask) then refused the file it wrote: "unexpected ['norm.bias', 'norm.weight']".
    model = petl.apply(tiny_vit(), method, num_classes=3)
    model.norm.requires_grad_(True)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.1)
    petl.save_trainable(model, tmp_path / "trained.safetensors")
    for target in (tiny_vit(), petl.apply(tiny_vit(), method, num_classes=3)):  # a fresh backbone, and one applied
        loaded = petl.load_trainable(target, tmp_path / "trained.safetensors").eval()
        torch.testing.assert_close(loaded(images), model.eval()(images), rtol=0, atol=0)
        trains = [name for name, p in loaded.named_parameters() if p.requires_grad]
        assert trains == [name for name, p in model.named_parameters() if p.requires_grad]
    if method == "lora":  # not served beside other tasks: the norm it trained is one the tasks share frozen
        plain = petl.apply(tiny_vit(), method, num_classes=3)
        petl.save_trainable(plain, tmp_path / "plain.safetensors")
        backbone = tiny_vit()
        before = {name: t.clone() for name, t in backbone.state_dict().items()}
        with pytest.raises(TaskRefused, match=r"task 'a' .*trained beside its method \(norm\.bias, norm\.weight"):
            petl.MultiTask(backbone, {"a": tmp_path / "trained.safetensors", "b": tmp_path / "plain.safetensors"})
        assert all(torch.equal(t, before[name]) for name, t in backbone.state_dict().items())  # the caller's, unchanged


def test_a_loaded_run_given_for_its_model_is_named_in_one_line(tiny_vit, tmp_path):
    # petl.merge(run) for petl.merge(run.model), a notebook's slip: merge, unmerge, unload and count_params failed
    # with "'LoadedRun' object has no attribute 'named_modules'", the others listed every family petl supports.
    from petl.store.run_card import LoadedRun

    model = petl.apply_lora(tiny_vit())
    petl.save_trainable(model, tmp_path / "lora.safetensors")
    run = LoadedRun(model=model, spec=None, class_names=[], card={}, run_dir=tmp_path)
    calls = {
        "apply": lambda: petl.apply(run, "lora"),
        "merge": lambda: petl.merge(run),
        "unmerge": lambda: petl.unmerge(run),
        "unload": lambda: petl.unload(run),
        "count_params": lambda: petl.count_params(run),
        "save_trainable": lambda: petl.save_trainable(run, tmp_path / "again.safetensors"),
        "load_trainable": lambda: petl.load_trainable(run, tmp_path / "lora.safetensors"),
        "MultiTask": lambda: petl.MultiTask(run, {"a": tmp_path / "lora.safetensors"}),
    }
    for call in calls.values():
        with pytest.raises(
            ValueError, match=r"^got a LoadedRun, not the model it holds: give its \.model \(run\.model\)$"
        ):
            call()
    with pytest.raises(ValueError, match=r"^MultiTask.from_runs takes run folders, got a LoadedRun: give its folder"):
        petl.MultiTask.from_runs([run])
    with pytest.raises(ValueError, match=r"^got a str, not a torch model: give the timm model \(an nn\.Module\)$"):
        petl.merge("runs/lora")


@pytest.mark.parametrize("method", ["lora", "ssf"])
def test_a_file_already_merged_into_the_model_is_refused_not_added_twice(tiny_vit, images, tmp_path, method):
    # petl.unload drops petl's marks: load_trainable took the model for a fresh backbone, applied the method again
    # and loaded the file, so the update counted twice in the logits, silently.
    model = petl.apply(tiny_vit(), method, num_classes=3).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.1)
    path = tmp_path / "trained.safetensors"
    petl.save_trainable(model, path)
    expected = model(images)
    petl.merge(model)
    with pytest.raises(ValueError, match=r"^unmerge the model before loading trainable weights \(petl\.unmerge"):
        petl.load_trainable(model, path)
    petl.unload(model)
    with pytest.raises(ValueError, match=r"trained\.safetensors is merged into this model already .* a fresh backbone"):
        petl.load_trainable(model, path)
    assert not hasattr(model, "petl_method") and torch.allclose(model(images), expected, atol=1e-5)  # as it was
    other = petl.apply(tiny_vit(seed=1), method, num_classes=3)  # another file: a second update on top, as asked
    petl.save_trainable(other, tmp_path / "other.safetensors")
    # Trained on other frozen weights (these hold an update now), so asked for in so many words.
    petl.load_trainable(model, tmp_path / "other.safetensors", check_frozen=False)


@pytest.mark.parametrize("method", ["fact", "gps", "hydra", "lora", "peft", "repadapter", "ssf"])
def test_a_state_dict_saved_merged_or_unmerged_loads_as_it_was_saved(tiny_vit, images, tmp_path, method):
    # A merged model's state dict holds the update in the base weights and again in the method's tensors: loaded with
    # torch's load_state_dict into an unmerged model (or the reverse), the update counted twice (or not at all).
    # peft's merged layers (the peft bridge) too: petl.merge merges them, and their state dict said nothing of it.
    model = petl.apply(tiny_vit(), method, num_classes=3).eval()
    perturb_trainable(model)
    with torch.no_grad():
        expected = model(images)
    unmerged_path, merged_path = tmp_path / "unmerged.pt", tmp_path / "merged.pt"
    torch.save(model.state_dict(), unmerged_path)
    torch.save(petl.merge(model).state_dict(), merged_path)
    fresh = petl.apply(tiny_vit(seed=1), method, num_classes=3).eval()
    fresh.load_state_dict(torch.load(merged_path, weights_only=True))
    with torch.no_grad():
        assert torch.allclose(fresh(images), expected, atol=1e-5)
        assert torch.allclose(petl.unmerge(fresh)(images), expected, atol=1e-5)  # the update taken out once
    model.load_state_dict(torch.load(unmerged_path, weights_only=True))  # onto the merged model
    with torch.no_grad():
        assert torch.allclose(model(images), expected, atol=1e-5)
        assert torch.allclose(petl.merge(model)(images), expected, atol=1e-5)


@pytest.mark.parametrize("method", ["fact", "gps", "hydra", "lora", "peft", "repadapter", "ssf"])
def test_training_a_merged_model_is_refused_while_its_method_trains(tiny_vit, images, method):
    # Merged, a wrapper runs its base alone: a training step on the merged model left the method's tensors
    # untouched (no gradient) while they still showed as trainable, silently; peft's merged layers did too.
    model = petl.merge(petl.apply(tiny_vit(), method, num_classes=3).train())
    with pytest.raises(ValueError, match=r"is merged, so its tensors would get no gradient .* petl\.unmerge\(model\)"):
        model(images)
    with torch.no_grad():
        model(images)  # running it merged is fine
    model.eval()(images).sum().backward()  # so is autograd in eval mode (saliency, attacks)
    for param in model.parameters():  # and training the head alone on the merged model
        param.requires_grad_(param is model.head.weight or param is model.head.bias)
    model.train()(images).sum().backward()
    assert model.head.weight.grad is not None
    petl.unmerge(model).requires_grad_(True)
    model(images).sum().backward()


@pytest.mark.parametrize("kind", ["vit", "swin"])
def test_a_model_whose_head_was_removed_saves_a_file_that_loads_as_it_was(images, tmp_path, kind):
    # reset_classifier(0) (timm's "no classifier") records num_classes=0, which petl.apply refused: the file
    # save_trainable wrote could not be loaded onto any model.
    model = petl.apply(TINY_MODELS[kind](), "lora", num_classes=3).eval()
    perturb_trainable(model)
    model.reset_classifier(0)
    petl.save_trainable(model, tmp_path / "features.safetensors")
    loaded = petl.load_trainable(TINY_MODELS[kind](), tmp_path / "features.safetensors").eval()
    assert loaded.petl_config.num_classes == 0
    with torch.no_grad():
        assert torch.equal(loaded(images), model(images))  # the pooled features, with the trained update


@pytest.mark.parametrize("method", ["linear", "mlp", "hst"])
def test_num_classes_0_is_refused_where_the_head_is_what_the_method_trains(tiny_vit, method):
    with pytest.raises(ValueError, match=r"num_classes=0 removes the head|give num_classes \(at least 1\)"):
        petl.apply(tiny_vit(), method, num_classes=0)


@pytest.mark.parametrize("kind", ["vit", "swin"])
def test_linear_on_a_model_without_a_head_is_refused_unless_given_the_class_count(kind):
    # A model built with num_classes=0, kept without num_classes: linear was taken and trained nothing at all (Mlp-k
    # and HST refused it already).
    with pytest.raises(ValueError, match="^linear needs num_classes: the model has no classifier head"):
        petl.apply(TINY_MODELS[kind](num_classes=0), "linear")
    assert petl.count_params(petl.apply(TINY_MODELS[kind](num_classes=0), "linear", num_classes=3)).trainable > 0


@pytest.mark.parametrize("applied", [False, True])
def test_a_file_whose_head_has_other_classes_says_how_many_to_give_the_model(tiny_vit, tmp_path, applied):
    # A file saved without num_classes keeps the model's head: onto a model of other classes the refusal said
    # "head.bias has shape (5,), the config recorded in it needs (9,)", which no config recorded.
    path = tmp_path / "five.safetensors"
    petl.save_trainable(petl.apply(tiny_vit(), "lora"), path)
    model = tiny_vit()  # the backbone the file was trained on (tiny_vit(num_classes=9) draws another init)
    model.reset_classifier(9)
    model = petl.apply(model, "lora") if applied else model
    with pytest.raises(ValueError, match=r"five\.safetensors: its head has 5 classes, this model.s 9: .*num_classes=5"):
        petl.load_trainable(model, path)
    model.reset_classifier(5)  # as the message says
    petl.load_trainable(model, path)


def test_a_method_refused_under_grad_checkpointing_leaves_the_model_as_it_was(tiny_vit):
    # The refusal came after the side network was built: the model carried lst, frozen, and a second apply (with
    # checkpointing turned off, as the message says) was refused as "already carries petl method 'lst'".
    model = tiny_vit()
    model.set_grad_checkpointing(True)
    with pytest.raises(ValueError, match=r"^gradient checkpointing: method 'lst' cannot use it"):
        petl.apply(model, "lst")
    assert getattr(model, "petl_method", None) is None
    assert all(p.requires_grad for p in model.parameters())
    assert all(type(block).__name__ == "Block" for block in model.blocks)
    model.set_grad_checkpointing(False)
    petl.apply(model, "lst")
    lora = tiny_vit()
    lora.set_grad_checkpointing(True)
    assert petl.apply(lora, "lora").grad_checkpointing  # a method that runs under it keeps it on


class _Unchecked(petl.PetlModule):
    """A block wrapper of a user's method that cannot run under gradient checkpointing."""

    no_grad_checkpointing = "it keeps state between blocks"

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self.base(x, *args, **kwargs)


@pytest.mark.parametrize("kind", list(TINY_MODELS))
def test_a_method_refusing_grad_checkpointing_is_refused_on_every_family_with_it_on(kind):
    # timm's Swins keep the flag on each stage (model.layers[i].grad_checkpointing), not on the model: apply read
    # model.grad_checkpointing, found none, and left a registered method that cannot run under it on a Swin with
    # checkpointing on, to fail in the backward.
    from petl.model.registry import _REGISTRY, register_method

    @dataclasses.dataclass
    class UncheckedConfig(MethodConfig):
        pass

    def inject(model: nn.Module, cfg: UncheckedConfig) -> None:
        backbone_of(model).set_block(0, _Unchecked(backbone_of(model).block_container()[0]))

    register_method(
        "unchecked_test", UncheckedConfig, trainable_formula=lambda model, cfg: 0, backbones=tuple(TINY_MODELS)
    )(inject)
    try:
        model = TINY_MODELS[kind]()
        assert not backbone_of(model).grad_checkpointing()
        model.set_grad_checkpointing(True)
        assert backbone_of(model).grad_checkpointing()
        with pytest.raises(ValueError, match=r"^gradient checkpointing: method 'unchecked_test' cannot use it"):
            petl.apply(model, "unchecked_test")
        assert getattr(model, "petl_method", None) is None
        model.set_grad_checkpointing(False)
        assert not backbone_of(model).grad_checkpointing()
        petl.apply(model, "unchecked_test")
        with pytest.raises(ValueError, match=r"^gradient checkpointing: method 'unchecked_test' cannot use it"):
            model.set_grad_checkpointing(True)
    finally:
        _REGISTRY.pop("unchecked_test", None)


@pytest.mark.parametrize("method", petl.list_methods())
def test_each_apply_helper_documents_every_option_and_any_backbone_its_method_takes(method):
    # help(petl.apply_lora) in a notebook: its option list lacked init, and it said "a timm VisionTransformer" for
    # methods that take Swins, BEiTs and EVAs as well.
    doc = inspect.getdoc(getattr(petl, f"apply_{method}"))
    listed = set(re.findall(r"``(\w+)``", doc.split("**options")[1]))
    fields = {f.name for f in dataclasses.fields(petl.get_method(method).config_cls)}
    assert fields <= listed
    assert "model: a timm VisionTransformer" not in doc


def test_count_params_of_a_wrapped_model_leaves_out_its_head(tiny_vit):
    # DataParallel has no get_classifier and no backbone family: its head was counted in trainable_no_head.
    model = petl.apply(tiny_vit(), "lora", num_classes=3)
    expected = petl.count_params(model)
    assert petl.count_params(nn.DataParallel(model)) == expected
    assert petl.count_params(torch.compile(model)) == expected
    # Was: compiled around DataParallel, neither wrapper was taken off, and the head counted as a method's.
    assert petl.count_params(torch.compile(nn.DataParallel(model))) == expected
    assert petl.count_params(nn.DataParallel(torch.compile(model))) == expected


@pytest.mark.parametrize(
    ("options", "says"),
    [('{"r": 0}', "`r` should be a positive integer"), ('{"lora_dropout": 2.0}', "dropout probability")],
)
def test_peft_options_peft_refuses_as_it_builds_leave_the_model_as_it_was(tiny_vit, options, says):
    # peft checks these as it builds its layers: the refusal came after petl.apply had frozen the model and reset its
    # head, so the model was left frozen with a fresh 3-class head and no method.
    model = tiny_vit()
    with pytest.raises(ValueError, match=rf"^peft rejected options='{re.escape(options)}' for peft_type=LORA: {says}"):
        petl.apply(model, "peft", num_classes=3, options=options)
    assert all(p.requires_grad for p in model.parameters()) and model.head.out_features == TINY_VIT["num_classes"]


@pytest.mark.parametrize("init", ["pissa", "olora"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_peft_inits_computed_from_the_weights_still_apply(tiny_vit, images, init, checkpointing):
    # The meta-device trial builds (validate's, and petl.apply's under gradient checkpointing) ran peft's PiSSA and
    # OLoRA, an SVD or QR of each frozen weight written back into it, on tensors without values: petl.apply failed
    # with torch's "incompatible tensor type" RuntimeError where it had applied them.
    model = tiny_vit()
    model.set_grad_checkpointing(checkpointing)
    with torch.no_grad():
        before = model.blocks[0].attn.qkv.weight.clone()
    petl.apply(model, "peft", num_classes=3, options=f'{{"r": 4, "init_lora_weights": "{init}"}}')
    qkv = model.blocks[0].attn.qkv
    assert not torch.equal(qkv.base_layer.weight, before)  # peft's init took the update's start out of the weight
    model.train()(images).sum().backward()
    assert qkv.lora_A["default"].weight.grad is not None


@pytest.mark.parametrize(
    ("method", "options"),
    [("lora", {}), ("peft", {}), ("ssf", {}), ("gps", {}), ("peft", {"options": '{"bias": "all"}'})],
    ids=["lora", "peft", "ssf", "gps", "peft-bias-all"],
)
def test_a_merged_state_dict_without_the_base_weights_leaves_the_model_unmerged(tiny_vit, images, method, options):
    # A merged state dict cut down in place to the method's tensors (del sd[key] keeps torch's metadata) and loaded
    # with strict=False: the wrappers were marked merged while their base weights stayed without the update, so the
    # forward ran the frozen base alone and dropped the update, silently.  GPS and peft's bias="all" train the base
    # layer's own bias: the cut-down state dict holds it, and not the weight the update was merged into.
    model = petl.apply(tiny_vit(), method, num_classes=3, **options).eval()
    perturb_trainable(model)
    with torch.no_grad():
        expected = model(images)
    state = petl.merge(model).state_dict()
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    for key in [k for k in state if k not in trained]:
        del state[key]
    fresh = petl.apply(tiny_vit(), method, num_classes=3, **options).eval()
    fresh.load_state_dict(state, strict=False)
    with torch.no_grad():
        assert torch.allclose(fresh(images), expected, atol=1e-5)
