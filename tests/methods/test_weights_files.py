"""Weights files and the backbone they were trained on; what merging and unmerging give back."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import make_tiny_family, make_tiny_swin, perturb_trainable
from safetensors import safe_open
from safetensors.torch import save_file
from test_multitask import _run_folder as multitask_run_folder

import petl
from petl.data.transforms import ImageSpec
from petl.deploy.multitask import TaskRefused
from petl.deploy.predict import serve_together
from petl.model import io
from petl.store import run_card


@pytest.mark.parametrize("method", petl.list_methods())
def test_a_file_loads_onto_its_own_backbone_and_is_refused_on_other_weights_of_its_shape(tiny_vit, tmp_path, method):
    model = petl.apply(tiny_vit(), method)
    perturb_trainable(model)
    path = tmp_path / "w.safetensors"
    petl.save_trainable(model, path)
    # The same weights built again (a checkpoint downloaded again), fresh or with the method applied: it loads.
    petl.load_trainable(tiny_vit(), path)
    petl.load_trainable(petl.apply(tiny_vit(), method), path)
    other = tiny_vit(seed=1)  # the same shapes, other weights: the file's update was never trained on these
    if method == "full":  # the file holds every tensor: it gives the same model on any weights of its shapes
        assert petl.load_trainable(other, path).state_dict().keys() == model.state_dict().keys()
        return
    before = {name: t.clone() for name, t in other.state_dict().items()}
    with pytest.raises(ValueError, match="trained on other frozen weights") as caught:
        petl.load_trainable(other, path)
    assert str(path) in str(caught.value) and "check_frozen=False" in str(caught.value)
    assert len(str(caught.value).splitlines()) == 1
    assert getattr(other, "petl_method", None) is None  # refused before anything changed
    assert all(torch.equal(before[name], t) for name, t in other.state_dict().items())
    # Knowingly: it loads.
    loaded = petl.load_trainable(tiny_vit(seed=1), path, check_frozen=False)
    assert loaded.petl_method == method


@pytest.mark.parametrize("cast", [False, True])
def test_multitask_refuses_a_bare_weights_file_over_other_frozen_weights(tiny_vit, tmp_path, cast):
    # A bare file "records no backbone and is not checked": served over another random init, its task's logits were
    # silently another model's.  Refused, it was load_trainable's plain ValueError, whose remedy (check_frozen=False)
    # MultiTask does not take, and petl-predict stopped on it where a TaskRefused predicts the run on its own.
    path = tmp_path / "w.safetensors"
    petl.save_trainable(petl.apply_lora(tiny_vit()), path)
    other = tiny_vit().to(torch.bfloat16) if cast else tiny_vit(seed=1)
    message = f"^task 'a' cannot be served over this backbone: {path} was trained on other frozen weights"
    with pytest.raises(TaskRefused, match=message) as refused:
        petl.MultiTask(other, {"a": path})
    assert refused.value.mismatch and refused.value.task == "a"  # the file's own backbone, not one it cannot share
    assert "check_frozen" not in str(refused.value) and len(str(refused.value).splitlines()) == 1
    assert petl.MultiTask(tiny_vit(), {"a": path}).names == ["a"]


def test_petl_predict_predicts_apart_a_run_whose_weights_file_trained_on_other_frozen_weights(tmp_path):
    # Runs grouped by their cards' backbone record (bar frozen_sha256: the hub's weights changed between them) are
    # served by one MultiTask of their weights files: the file's frozen check was a plain ValueError, which stopped
    # petl-predict with load_trainable's remedy (check_frozen=False); a TaskRefused predicts the run on its own.
    multitask_run_folder(tmp_path / "a", "lora", {}, seed=0)
    multitask_run_folder(tmp_path / "c", "lora", {}, seed=1)
    backbone = {"name": "vit_fractal_tiny_patch4_32", "pretrained": False, "kwargs": {"depth": 2, "embed_dim": 48}}
    model = petl.apply(run_card.create_backbone({**backbone, "seed": 1}), "lora", num_classes=3)
    (tmp_path / "b").mkdir()
    petl.save_trainable(model, tmp_path / "b" / run_card.WEIGHTS_FILE)
    spec = ImageSpec(image_size=32, mean=(0.5,) * 3, std=(0.25,) * 3, interpolation="bilinear", crop=False)
    card = run_card.model_card(
        model_cfg=backbone, seed=0, model=model, spec=spec, class_names=list("xyz"), dataset="d", checkpoint_sha256=None
    )
    run_card.write_card(tmp_path / "b", card)  # a card recording seed 0, over the weights of seed 1
    served, _, refused = serve_together([tmp_path / "a", tmp_path / "b", tmp_path / "c"], quiet=True)
    assert served.names == [str(tmp_path / "a"), str(tmp_path / "c")] and refused == [tmp_path / "b"]
    with pytest.raises(run_card.RunFolderError, match="b: the backbone's frozen tensors differ"):
        petl.load_run(tmp_path / "b")  # what petl-predict says of it, predicting it alone


def test_a_file_of_an_earlier_petl_without_a_fingerprint_loads_onto_any_weights_of_its_shape(tiny_vit, tmp_path):
    model = petl.apply_lora(tiny_vit())
    perturb_trainable(model)
    path = tmp_path / "w.safetensors"
    petl.save_trainable(model, path)
    with safe_open(str(path), framework="pt") as f:
        meta = {k: v for k, v in f.metadata().items() if k not in (io.FROZEN, io.METADATA_HASH)}
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    save_file(tensors, str(path), metadata={**meta, io.METADATA_HASH: io.metadata_hash(meta)})  # as it wrote them
    loaded = petl.load_trainable(tiny_vit(seed=1), path)
    trained = petl.model.params.trainable_state(model)
    assert all(torch.equal(loaded.state_dict()[name], t) for name, t in trained.items())


def test_a_partial_file_of_a_swin_from_before_the_merging_trained_is_refused_naming_the_file(tmp_path):
    # Partial-k on a Swin now trains the patch merging between two trained blocks (VPT's Swin Partial-4).  A file the
    # earlier Partial-k wrote at k=3 on a two-stage Swin lacks the merging of the second stage; loaded, the model
    # would carry k=3 with that merging untrained.  Written here as that Partial-k wrote it: the merging frozen.
    old = petl.apply(make_tiny_swin(), "partial", k=3)
    perturb_trainable(old)
    old.layers[1].downsample.requires_grad_(False)
    old.petl_trained = tuple(name for name in old.petl_trained if ".downsample." not in name)
    path = tmp_path / "w.safetensors"
    petl.save_trainable(old, path)
    fresh = make_tiny_swin()
    for model in (fresh, petl.apply(make_tiny_swin(), "partial", k=3)):
        with pytest.raises(ValueError, match="lacks tensors that 'partial' trains") as caught:
            petl.load_trainable(model, path)
        message = str(caught.value)
        assert message.startswith(str(path)) and "layers.1.downsample.reduction.weight" in message
        assert "re-run the training" in message and len(message.splitlines()) == 1
    assert getattr(fresh, "petl_method", None) is None  # refused before anything changed
    # A file written now holds the merging and loads; at k=2 (the last stage) there is none between trained blocks.
    for k in (3, 2):
        model = petl.apply(make_tiny_swin(), "partial", k=k)
        perturb_trainable(model)
        petl.save_trainable(model, path)
        loaded = petl.load_trainable(make_tiny_swin(), path)
        assert torch.equal(loaded.layers[1].downsample.reduction.weight, model.layers[1].downsample.reduction.weight)


def test_an_edited_fingerprint_is_corrupt_metadata(tiny_vit, tmp_path):
    path = tmp_path / "w.safetensors"
    petl.save_trainable(petl.apply_lora(tiny_vit()), path)
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {name: f.get_tensor(name) for name in f.keys()}
    save_file(tensors, str(path), metadata={**meta, io.FROZEN: "0" * 64})
    with pytest.raises(ValueError, match="is corrupt: its metadata"):
        petl.load_trainable(tiny_vit(), path)


def test_a_half_precision_backbone_is_refused_and_loads_in_the_dtype_it_was_saved_in(tiny_vit, tmp_path):
    path = tmp_path / "w.safetensors"
    petl.save_trainable(petl.apply_lora(tiny_vit()), path)
    with pytest.raises(ValueError, match="dtype"):
        petl.load_trainable(tiny_vit().half(), path)
    assert petl.load_trainable(tiny_vit(), path).half().blocks[0].attn.qkv.base.weight.dtype == torch.float16


MERGEABLE = [name for name in petl.list_methods() if petl.model.registry.get_method(name).mergeable]


@pytest.mark.parametrize("method", MERGEABLE)
def test_unmerge_puts_the_weights_back_bit_for_bit_and_without_the_copy_to_rounding(tiny_vit, images, tmp_path, method):
    # unmerge subtracted the update again: W + U - U is not W in the last bits, so a file saved after a merge and an
    # unmerge recorded other frozen weights than the backbone's, and was refused on it.
    model = petl.apply(tiny_vit(), method)
    perturb_trainable(model)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    petl.unmerge(petl.merge(model))
    assert all(torch.equal(before[name], t) for name, t in model.state_dict().items())
    petl.save_trainable(model, tmp_path / "w.safetensors")
    petl.load_trainable(tiny_vit(), tmp_path / "w.safetensors")
    # Without the copy (or with the merged weights written since): the update subtracted, to float rounding.
    petl.unmerge(petl.merge(model, restorable=False))
    assert not any(getattr(m, "merged", False) for m in model.modules())
    for name, t in model.state_dict().items():
        torch.testing.assert_close(t, before[name], rtol=1e-5, atol=1e-6)
    merged = petl.merge(petl.apply(tiny_vit(), method))
    perturb_trainable(merged)
    merged.load_state_dict(petl.merge(model).state_dict())  # the merged weights written since the merge
    petl.unmerge(merged)
    for name, t in merged.state_dict().items():
        torch.testing.assert_close(t, before[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("family", "method"), [("vit_pwee", "repadapter"), ("vit_pwee_4x", "fact")])
def test_unmerge_is_bit_for_bit_where_wrappers_share_the_tensors_they_merge_into(family, method):
    # Each wrapper put back the copy it kept, first merged first: the second found the tensors written since (by the
    # first's copy) and subtracted its update from weights that no longer held it.
    model = petl.apply(make_tiny_family(family), method)
    perturb_trainable(model)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    petl.unmerge(petl.merge(model))
    assert all(torch.equal(before[name], t) for name, t in model.state_dict().items())


@pytest.mark.parametrize("method", MERGEABLE)
def test_a_copy_of_a_merged_model_unmerges_bit_for_bit_too(tiny_vit, tmp_path, method):
    # A copy's tensors start their version counters anew: compared with the original's, every unmerge of a deepcopy
    # (or of a model torch.save'd whole and loaded) subtracted the update, and a file saved from it was refused on the
    # backbone it was trained on.
    model = petl.apply(tiny_vit(), method)
    perturb_trainable(model)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    petl.merge(model)
    torch.save(model, tmp_path / "merged.pt")
    for copied in (copy.deepcopy(model), torch.load(tmp_path / "merged.pt", weights_only=False)):
        petl.unmerge(copied)
        assert all(torch.equal(before[name], t) for name, t in copied.state_dict().items())
        petl.save_trainable(copied, tmp_path / "w.safetensors")
        petl.load_trainable(tiny_vit(), tmp_path / "w.safetensors")
    # The copy of a model whose merged weights were written since: what was written stays (the update subtracted).
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    with torch.no_grad():
        for name in frozen:
            model.get_parameter(name).add_(1.0)
    copied = dict(petl.unmerge(copy.deepcopy(model)).named_parameters())
    assert not any(torch.equal(copied[name], before[name]) for name in frozen)
