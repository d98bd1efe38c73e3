"""petl.MultiTask: a mixed batch over one frozen backbone gives every row its own single-task model's logits."""

from __future__ import annotations

import collections
import copy
import csv
import functools
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from conftest import TINY_MODELS, make_tiny_family, make_tiny_swin, make_tiny_vit, perturb_trainable
from PIL import Image
from torch.utils._python_dispatch import TorchDispatchMode

import petl
from petl.cli import predict as predict_cli
from petl.data.transforms import ImageSpec
from petl.deploy import predict as predict_api
from petl.deploy.multitask import TaskRefused
from petl.deploy.routing import RoutedModule
from petl.model.backbone import backbone_of
from petl.store import run_card
from petl.utils.ops import CountOps

REPO = Path(__file__).resolve().parents[2]
# Every registered method with its defaults, plus the variants that take another path through the mixed batch.
VARIANTS = {
    "lora_all": ("lora", {"targets": "q,k,v,proj,fc1,fc2"}),
    "adapter_parallel": ("adapter", {"style": "parallel"}),
    "adapter_norm": ("adapter", {"norm": True}),
    "fact_tt": ("fact", {"type": "tt"}),
    "bitfit_linear": ("bitfit", {"biases": "linear"}),
    "vpt_deep": ("vpt", {"num_tokens": 5, "deep": True}),
    "vpt_img_pool": ("vpt", {"num_tokens": 2, "deep": True, "pool": "img_pool"}),
    "mlp_3": ("mlp", {"k": 3}),
    "dora": ("peft", {"peft_type": "LORA", "target_modules": ("qkv",), "options": '{"r": 4, "use_dora": true}'}),
    "peft_fc": ("peft", {"peft_type": "LORA", "target_modules": ("fc1", "fc2"), "options": '{"r": 2}'}),
    "ia3": (
        "peft",
        {"peft_type": "IA3", "target_modules": ("qkv", "fc2"), "options": '{"feedforward_modules": ["fc2"]}'},
    ),
}
# Side networks and NOAH's per-block choices: DTL+ (its conv over the grid must not see other tasks' prompt
# slots), GPS with two entries per row, NOAH with prompts that come, stay and are replaced from block to block
# (slots attended change per block), LoRA and adapters in some blocks only, LAST with two LSA layers per group.
VARIANTS |= {
    "dtl_plus": ("dtl", {"fusion_size": 3, "add_from": 0}),
    "gps_2": ("gps", {"per_row": 2}),
    "noah_mixed": ("noah", {"prompt": "2,0,3", "lora": "0,2,1", "adapter": "3,0,2"}),
    "hst_2": ("hst", {"dims": ("8", "16"), "heads": ("2", "4"), "meta_tokens": 2}),
    "last_gap_3": ("last", {"gap": 3, "layers": 2}),
}
# Cannot share: they train frozen weight matrices every row's matmul uses.
REFUSED = {"partial": ("partial", {}), "full": ("full", {})}
SHARED = {name: (name, {}) for name in petl.list_methods() if name not in REFUSED} | VARIANTS
# Head-only methods: nothing before the head differs from the plain backbone.
HEAD_ONLY = {"linear", "mlp", "mlp_3"}
# A class-token ViT with a register token, and an average-pooled one without class token (VPT's prompts then
# enter the pooling, so a row's unused prompt slots must be left out of it).
BACKBONES = {
    "token": {"reg_tokens": 1},
    "avg": {"global_pool": "avg", "class_token": False, "fc_norm": True},
}


def _trained(backbone, method: str, options: dict, seed: int) -> torch.nn.Module:
    """``method`` applied to a copy of ``backbone`` with every trained tensor (BatchNorm statistics too) perturbed."""
    model = petl.apply(copy.deepcopy(backbone), method, num_classes=3 + seed % 4, **options)
    perturb_trainable(model, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm1d):
            module.running_mean.copy_(torch.randn(module.running_mean.shape, generator=gen))
            module.running_var.uniform_(0.5, 2.0, generator=gen)
    return model.eval()


def _save(tmp_path, cases: dict, backbone) -> tuple[dict, dict]:
    singles, files = {}, {}
    for seed, (name, (method, options)) in enumerate(cases.items()):
        singles[name] = _trained(backbone, method, options, seed)
        files[name] = tmp_path / f"{name}.safetensors"
        petl.save_trainable(singles[name], files[name])
    return singles, files


def _mixed_batch(names: list[str], per_task: int, seed: int = 0) -> tuple[list[str], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(per_task * len(names), generator=gen).tolist()
    ids = [names[i % len(names)] for i in order]
    return ids, torch.randn(len(ids), 3, 32, 32, generator=gen)


def _check_rows(
    multi,
    singles: dict,
    ids: list[str],
    images: torch.Tensor,
    only: str | None = None,
    out=None,
    known: dict | None = None,
) -> None:
    """Each row of ``multi(images, ids)`` (or of ``out``, computed by it) against its task's single model.

    ``known``: the single models' outputs by (task, row) from earlier calls on these ``images`` (or a prefix of them),
    filled here: a check repeated on another path or batch runs no single model twice on one image.
    """
    known = {} if known is None else known
    with torch.no_grad():
        out = multi(images, ids) if out is None else out
        for row, task in enumerate(ids):
            if only is not None and task != only:
                continue
            if (task, row) not in known:
                known[task, row] = singles[task](images[row : row + 1])[0]
            expected = known[task, row]
            n = expected.shape[0]
            torch.testing.assert_close(out[row, :n], expected, atol=2e-5, rtol=1e-4, msg=f"row {row}, task {task}")
            assert torch.isinf(out[row, n:]).all(), "columns past a task's classes must be -inf"


def _check_both_paths(multi, singles: dict, ids: list[str], images: torch.Tensor) -> None:
    """:func:`_check_rows` on the CPU's path (prompted rows in a pass of their own, stacks only for half the rows)
    and on the GPU's (``launch_bound``: every row in one pass, every stack of two tasks acting)."""
    known: dict = {}
    for launch_bound in (False, True):
        multi.launch_bound = launch_bound
        _check_rows(multi, singles, ids, images, known=known)
    multi.launch_bound = None


@pytest.fixture(scope="module", params=sorted(BACKBONES))
def served(request, tmp_path_factory):
    """Every shareable case trained (perturbed) on one backbone, and a shuffled batch of all of them served at once,
    on the CPU's path and on the GPU's (``launch_bound``)."""
    backbone = make_tiny_vit(**BACKBONES[request.param])
    singles, files = _save(tmp_path_factory.mktemp(request.param), SHARED, backbone)
    multi = petl.MultiTask(backbone, files)
    ids, images = _mixed_batch(sorted(SHARED), per_task=2)
    outs = {}
    with torch.no_grad():
        for launch_bound in (False, True):
            multi.launch_bound = launch_bound
            outs[launch_bound] = multi(images, ids)
    multi.launch_bound = None
    return backbone, singles, multi, ids, images, outs


@pytest.mark.slow
@pytest.mark.parametrize("launch_bound", [False, True])
@pytest.mark.parametrize("case", sorted(SHARED))
def test_each_row_gets_its_own_single_task_models_logits(served, case, launch_bound):
    """In a shuffled batch over every method, each row of ``case`` equals its single-task model's output."""
    backbone, singles, multi, ids, images, outs = served
    _check_rows(multi, singles, ids, images, only=case, out=outs[launch_bound])
    if case not in HEAD_ONLY:  # the perturbed method acts, so a missing or misplaced hook could not pass
        single = singles[case]
        with torch.no_grad():
            # timm's pooled backbone features (a method's own head has pre-logits of its own: HST's side network's).
            features = type(single).forward_head(single, single.forward_features(images[:2]), pre_logits=True)
            plain = backbone.forward_head(backbone.forward_features(images[:2]), pre_logits=True)
        assert (features - plain).abs().max() > 1e-3


@pytest.mark.slow
def test_a_mixed_batch_of_methods_of_different_families(tmp_path):
    """LoRA, AdaptFormer, VPT-deep, SSF, BitFit, Convpass and the side networks of LST, HST and LAST in one shuffled
    batch: every row as its own model."""
    names = ("lora", "adapter_parallel", "vpt_deep", "ssf", "bitfit", "convpass", "lst", "hst", "last")
    cases = {name: SHARED[name] for name in names}
    backbone = make_tiny_vit()
    singles, files = _save(tmp_path, cases, backbone)
    multi = petl.MultiTask(backbone, files)
    ids, images = _mixed_batch(list(cases), per_task=3, seed=1)
    known: dict = {}
    for launch_bound in (False, True):  # the prompted rows in a pass of their own, and every row in one
        multi.launch_bound = launch_bound
        _check_rows(multi, singles, ids, images, known=known)
        # With autograd on, rows are gathered into new tensors instead of written in place: the same logits.
        _check_rows(multi, singles, ids, images, out=multi(images, ids).detach(), known=known)
        # A batch of one task, and a batch without the prompted task (no prompt slots then), give the same rows.
        _check_rows(multi, singles, ["ssf"] * 3, images[:3], known=known)
        _check_rows(multi, singles, ["lora", "convpass", "bitfit"], images[:3], known=known)


# On a Swin, tasks whose scales and shifts stack at the Linears inside the window attention: two SSFs and BitFit's
# bias deltas (a scale of one), with a LoRA between them whose update stacks with a LoRA after them.
SWIN_STACKED = {
    "ssf": ("ssf", {}),
    "lora": ("lora", {}),
    "ssf_2": ("ssf", {"init_std": 0.1}),
    "bitfit": ("bitfit", {"biases": "linear"}),
    "lora_qk": ("lora", {"targets": "q,k"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("launch_bound", [False, True])
def test_ssf_and_bitfit_stack_inside_a_swins_window_attention(tmp_path, monkeypatch, launch_bound):
    """An affine stack and a low-rank one at qkv over the images' windows, each on its span of the rows (an image's
    windows are consecutive rows): the rows as their own models, stacked or task by task."""
    backbone = make_tiny_swin()
    singles, files = _save(tmp_path, SWIN_STACKED, backbone)
    multi = petl.MultiTask(backbone, files)
    multi.launch_bound = launch_bound  # on a CPU the stacks act here too: their tasks hold all of their spans
    bb = backbone_of(multi.backbone)
    qkv = bb.linear(bb.block_list()[0], "qkv")
    stacks = [tuple(multi.names[t] for t in stack.tasks) for stack in qkv.stacks]
    assert stacks == [("ssf", "ssf_2", "bitfit"), ("lora", "lora_qk")]
    ids, images = _mixed_batch(list(SWIN_STACKED), per_task=2, seed=2)
    calls = _stack_calls(multi, monkeypatch, len(ids))
    _check_rows(multi, singles, ids, images)
    # In images, the tasks that stack together next to each other: SSF's, SSF's and BitFit's rows (0 to 6; at the
    # norms, without BitFit, 0 to 4), then the two LoRAs' (6 to 10), at the window attention's Linears as at the rest.
    assert {call[:3] for call in calls} == {(stacks[0], 0, 6), (("ssf", "ssf_2"), 0, 4), (stacks[1], 6, 10)}
    _check_rows(multi, singles, ["ssf_2"] * 3, images[:3])
    _without_stacks(multi)
    _check_rows(multi, singles, ids, images)


def test_frozen_layers_run_once_for_the_whole_mixed_batch(tmp_path):
    """The frozen qkv under several tasks' LoRA/RepAdapter/FacT hooks runs once, on every row of the batch."""
    cases = {name: SHARED[name] for name in ("lora", "repadapter", "fact", "linear")}
    backbone = make_tiny_vit()
    _, files = _save(tmp_path, cases, backbone)
    multi = petl.MultiTask(backbone, files)
    routed = backbone_of(multi.backbone).block_container()[0].attn.qkv
    assert isinstance(routed, RoutedModule) and sorted(routed.hooks) == [0, 1, 2]
    calls = []
    routed.base.register_forward_hook(lambda _m, args, _out: calls.append(args[0].shape[0]))
    ids, images = _mixed_batch(list(cases), per_task=2)
    with torch.no_grad():
        multi(images, ids)
    assert calls == [len(ids)]


@pytest.mark.parametrize("groups", [[(0, 0, 2), (1, 2, 5)], [(0, 0, 5)]], ids=["two tasks", "one task"])
def test_a_hook_is_handed_its_rows_of_the_input_only_if_it_reads_them(groups):
    """A hook that reads the module's output alone (SSF, a bias delta, a sequential adapter) gets None for its input:
    slicing a task's rows is an op the host dispatches at every routed module.  A task holding the whole batch gets
    the tensors themselves, not a slice of all their rows."""
    from petl.deploy.routing import Batch, Router
    from petl.model.rows import RowHook, Tokens

    seen = {}

    def record(task):
        def add(x, y, _tokens):
            seen[task] = (x, y)
            y.add_(1.0)

        return add

    base = torch.nn.Linear(4, 4)
    router = Router(2)
    hooks = {0: RowHook(base, post_in_place=record(0), reads_input=False), 1: RowHook(base, post_in_place=record(1))}
    routed = RoutedModule(base, hooks, router)
    router.batch = Batch(groups, Tokens(1, 0))
    x = torch.randn(5, 3, 4)
    with torch.inference_mode():
        y = routed(x)
        assert torch.equal(y, base(x) + 1.0)
    assert seen[0][0] is None
    if len(groups) == 1:
        assert seen[0][1] is y
    else:
        assert torch.equal(seen[1][0], x[2:5]) and seen[1][1].shape[0] == 3


def test_tasks_share_the_backbones_frozen_tensors(tmp_path):
    """A task costs its own tensors only: every frozen tensor of every task model is the backbone's own object."""
    # GPS trains the biases of the layers it wraps, HST the LayerNorms of the blocks it wraps: in the file they
    # are named under the wrapper (blocks.0.attn.qkv.base.bias), yet they must not be loaded into the backbone.
    cases = {name: SHARED[name] for name in ("lora", "bitfit", "gps", "hst")}
    backbone = make_tiny_vit()
    _, files = _save(tmp_path, cases, backbone)
    multi = petl.MultiTask(backbone, files)
    frozen = {id(p) for p in backbone.parameters()}
    for task in multi.tasks[:2]:
        own = [n for n, p in task.named_parameters() if id(p) not in frozen]
        # BitFit's biases and the head are the task's own; everything else is shared.
        assert all(n.endswith("bias") or n.startswith("head") or "lora" in n for n in own)
        assert len(own) < len(list(task.parameters()))
    gps = dict(multi.tasks[2].named_parameters())
    assert id(gps["blocks.0.attn.qkv.base.bias"]) not in frozen and id(gps["blocks.0.attn.qkv.base.weight"]) in frozen
    # The trained biases and LayerNorms did not leak into the shared backbone.
    assert all(torch.equal(a, b) for a, b in zip(backbone.parameters(), make_tiny_vit().parameters(), strict=True))


def test_layer_scale_gammas_trained_by_gps_act_on_their_own_rows(tmp_path):
    """GPS trains layer-scale gammas whole (a backbone with layer scale): each task's rows use its own."""
    backbone = make_tiny_vit(init_values=0.5)
    cases = {"gps": SHARED["gps"], "gps_2": SHARED["gps_2"], "lora": SHARED["lora"]}
    singles, files = _save(tmp_path, cases, backbone)
    multi = petl.MultiTask(backbone, files)
    ids, images = _mixed_batch(list(cases), per_task=2)
    _check_both_paths(multi, singles, ids, images)


@pytest.mark.parametrize("make", [make_tiny_vit, make_tiny_swin], ids=["vit", "swin"])
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_methods_that_train_frozen_weights_are_refused_in_one_line(tmp_path, case, make):
    backbone = make()
    _, files = _save(tmp_path, {case: REFUSED[case]}, backbone)
    with pytest.raises(ValueError, match=rf"task '{case}' \(method {case}\) cannot share the backbone") as error:
        petl.MultiTask(backbone, files)
    assert "\n" not in str(error.value)
    # Named by what the task trained whole (Partial-1: the last block), not only the first tensor met in it (on a
    # Swin, the block's relative-position table).
    paths = {id(m): path for path, m in backbone.named_modules()}
    last = paths[id(backbone_of(backbone).block_container()[-1])]
    whole = {"partial": f"all of {last} ({last}.", "full": "every weight of the backbone ("}[case]
    assert f"it trains {whole}" in str(error.value) and "use it as a model of its own" in str(error.value)


def test_a_peft_tuner_without_a_hook_is_refused_naming_it(tmp_path):
    backbone = make_tiny_vit()
    cases = {"loha": ("peft", {"peft_type": "LOHA", "target_modules": ("qkv",), "options": '{"r": 2}'})}
    _, files = _save(tmp_path, cases, backbone)
    with pytest.raises(ValueError, match=r"task 'loha' \(method peft LOHA\) .*loha.*has no multi-task hook"):
        petl.MultiTask(backbone, files)


def test_run_folders_task_ids_and_bad_input(tmp_path):
    backbone = make_tiny_vit()
    singles, files = _save(tmp_path, {"a": SHARED["lora"], "b": SHARED["vpt"]}, backbone)
    run = tmp_path / "run_b"
    run.mkdir()
    files["b"].rename(run / "trainable.safetensors")
    multi = petl.MultiTask(backbone, {"a": files["a"], "b": run})
    images = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        by_name = multi(images, ["b", "a", "b"])
        by_index = multi(images, torch.tensor([1, 0, 1]))
    torch.testing.assert_close(by_name, by_index)
    _check_both_paths(multi, singles, ["b", "a", "b"], images)
    with pytest.raises(ValueError, match="unknown task 'c'; the tasks are a, b"):
        multi(images, ["a", "b", "c"])
    with pytest.raises(ValueError, match="2 task ids for 3 images"):
        multi(images, ["a", "b"])
    with pytest.raises(ValueError, match="task index out of range"):
        multi(images, [0, 1, 2])
    # One task per image, as the docstring says: an N x 1 column was flattened and taken, a 0-d index read as a list.
    for wrong in (torch.tensor([[1], [0], [1]]), np.array([[1], [0], [1]]), torch.tensor(1)):
        with pytest.raises(ValueError, match=r"^task ids are \(.*\): give one task per image, a list or a 1-D array$"):
            multi(images, wrong)
    # A bool or a float is no task index (True was task 1, 1.7 task 1); numpy's integers are.
    for wrong in ([True, False, True], [0, 1.7, 1], torch.tensor([1.0, 0.0, 1.0]), torch.tensor([True, False, True])):
        with pytest.raises(ValueError, match="give task names or integer indices"):
            multi(images, wrong)
    with torch.no_grad():
        torch.testing.assert_close(multi(images, np.array([1, 0, 1])), by_name)
        # An empty batch is answered as a timm model answers it: no rows, the widest task's columns.
        assert multi(images[:0], []).shape == (0, max(multi.num_classes.values()))
    # Images the backbone cannot take: one line each (timm would raise an AssertionError or a convolution's error).
    for wrong, message in (
        (images[:, :, :16], r"^images are 16x32 px: the backbone takes 32x32; preprocess them as the runs' cards say"),
        (images[:, :1], r"^images are \(3, 1, 32, 32\): give a batch N x 3 x H x W$"),
        (images[0], r"^images are \(3, 32, 32\): give a batch N x 3 x H x W$"),
        (images.tolist(), r"^images are a list: give a tensor N x 3 x H x W, preprocessed$"),
        # uint8 and half failed with torch's "Input type (unsigned char) and bias type (float) should be the same".
        ((images * 255).to(torch.uint8), r"^images are torch.uint8: the backbone's weights are torch.float32; give"),
        (images.half(), r"^images are torch.float16: the backbone's weights are torch.float32; give torch.float32"),
    ):
        with pytest.raises(ValueError, match=message):
            multi(wrong, ["a", "b", "a"])
    with pytest.raises(ValueError, match="stays in eval mode"):
        multi.train()
    with pytest.raises(ValueError, match="pass the plain backbone"):
        petl.MultiTask(singles["a"], files)
    with pytest.raises(ValueError, match="embed_dim"):
        petl.MultiTask(make_tiny_vit(embed_dim=24), {"a": files["a"]})


def test_a_hybrid_vit_takes_images_of_its_cnns_channels(tmp_path):
    """A hybrid ViT's patch embedding (timm's HybridEmbed) runs the images through a CNN whose features its ``proj``
    takes: the images' channels are the CNN's input channels, not ``proj``'s (16 here)."""
    cnn = torch.nn.Conv2d(3, 16, kernel_size=4, stride=4)
    backbone = make_tiny_vit(embed_layer=functools.partial(timm.layers.HybridEmbed, backbone=cnn), patch_size=2)
    singles, files = _save(tmp_path, {"a": SHARED["lora"], "b": SHARED["adapter"]}, backbone)
    multi = petl.MultiTask(backbone, files)
    images = torch.randn(2, 3, 32, 32)
    _check_rows(multi, singles, ["a", "b"], images)
    with pytest.raises(ValueError, match=r"^images are \(2, 16, 32, 32\): give a batch N x 3 x H x W$"):
        multi(torch.randn(2, 16, 32, 32), ["a", "b"])


def _run_folder(
    folder, method: str, options: dict, seed: int, classes: int = 3, width: int = 48, model_cfg: dict | None = None
) -> None:
    """A finished run folder (model.json + trainable.safetensors) of ``method`` on ``model_cfg`` (a card's
    ``backbone`` record; default: the tiny default backbone at ``width``)."""
    model_cfg = model_cfg or {
        "name": "vit_fractal_tiny_patch4_32",
        "pretrained": False,
        "kwargs": {"depth": 2, "embed_dim": width},
    }
    model = petl.apply(run_card.create_backbone({**model_cfg, "seed": 0}), method, num_classes=classes, **options)
    perturb_trainable(model, seed=seed)
    folder.mkdir()
    petl.save_trainable(model, folder / run_card.WEIGHTS_FILE)
    spec = ImageSpec(image_size=32, mean=(0.5,) * 3, std=(0.25,) * 3, interpolation="bilinear", crop=False)
    names = [f"{folder.name}_{i}" for i in range(classes)]
    card = run_card.model_card(
        model_cfg=model_cfg, seed=0, model=model, spec=spec, class_names=names, dataset="folder", checkpoint_sha256=None
    )
    run_card.write_card(folder, card)


def _predict(argv: list[str]) -> list[dict]:
    with pytest.raises(SystemExit) as stop:
        predict_cli.main([*argv, "--quiet"])
    assert stop.value.code == 0
    with open(argv[-1].split("=", 1)[1], newline="") as handle:
        return list(csv.DictReader(handle))


@pytest.mark.slow
def test_petl_predict_serves_runs_on_one_backbone_together(tmp_path, monkeypatch, capsys):
    """Runs on one backbone go through one MultiTask pass; the others (a method that cannot share, another
    backbone) predict alone, with a note; every run's rows are what it predicts on its own."""
    runs = {"lora": ("lora", {}), "vpt": ("vpt", {"num_tokens": 3}), "lst": ("lst", {}), "full": ("full", {})}
    for seed, (name, (method, options)) in enumerate(runs.items()):
        _run_folder(tmp_path / name, method, options, seed, classes=2 + seed)
    _run_folder(tmp_path / "narrow", "lora", {}, 9, width=24)
    images = tmp_path / "images"
    images.mkdir()
    gen = np.random.default_rng(0)
    for i in range(5):
        Image.fromarray(gen.integers(0, 255, (40, 36, 3), dtype=np.uint8)).save(images / f"{i}.png")
    served = []
    together = predict_api.predict_together
    monkeypatch.setattr(
        predict_api, "predict_together", lambda multi, *a, **k: served.append(multi) or together(multi, *a, **k)
    )
    folders = [str(tmp_path / name) for name in (*runs, "narrow")]
    # Strict fp32 on every device: on a GPU the default (auto) is bf16 autocast, whose rounding differs between
    # the batched per-row updates and each run's own model far beyond the tolerance below.
    strict = "precision=no"
    with pytest.raises(SystemExit) as stop:
        predict_cli.main([*folders, str(images), f"out={tmp_path / 'all.csv'}", "batch_size=7", strict])
    assert stop.value.code == 0
    notes = capsys.readouterr().err
    assert "task '" + folders[3] + "' (method full) cannot share the backbone" in notes
    assert f"{folders[4]} was trained on another backbone or preprocessing" in notes
    assert len(served) == 1 and served[0].names == folders[:3]
    with open(tmp_path / "all.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [row["run"] for row in rows] == [f for f in folders for _ in range(5)]  # in the order given
    for index, folder in enumerate(folders):
        alone = _predict([folder, str(images), strict, f"out={tmp_path / f'one{index}.csv'}"])
        mine = [row for row in rows if row["run"] == folder]
        assert [r["path"] for r in mine] == [r["path"] for r in alone]
        for row, expected in zip(mine, alone, strict=True):
            labels = sorted(k for k in expected if k.startswith("label"))
            assert [row[k] for k in labels] == [expected[k] for k in labels]
            for k in (k for k in expected if k.startswith("prob")):
                assert float(row[k]) == pytest.approx(float(expected[k]), abs=2e-6)
    # --merge: each run its own merged model, said in one line.
    with pytest.raises(SystemExit):
        predict_cli.main([folders[0], folders[2], str(images), "--merge"])
    assert "--merge: each run predicts with its own merged model" in capsys.readouterr().err
    assert len(served) == 1


def test_a_run_is_refused_over_a_backbone_it_was_not_trained_on(tmp_path):
    """The card's backbone (name, resolution, frozen tensors) must be the one served over; from_runs builds it."""
    from test_run_card import TINY
    from test_run_card import _run_folder as run_folder

    at_32, other_32 = run_folder(tmp_path / "a", seed=1), run_folder(tmp_path / "b", seed=2)
    at_48 = run_folder(tmp_path / "c", model_cfg={**TINY, "kwargs": {**TINY["kwargs"], "img_size": 48}})
    served = petl.MultiTask.from_runs([at_32, other_32])
    # Runs as a generator (Path.glob's): its check of each folder consumed it, leaving 'needs at least one run folder'.
    assert petl.MultiTask.from_runs(path for path in (at_32, other_32)).names == [str(at_32), str(other_32)]
    images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for task, folder in enumerate([at_32, other_32]):
            expected = petl.load_run(folder).model(images)
            torch.testing.assert_close(served(images, [task] * 4), expected, atol=1e-5, rtol=1e-5)
    other = rf"run {tmp_path / 'c'} was trained on another backbone than run .*backbone.kwargs.img_size 32 against 48"
    with pytest.raises(ValueError, match=other):
        petl.MultiTask.from_runs([at_32, at_48])
    backbone = run_card.create_backbone({**TINY, "kwargs": {**TINY["kwargs"], "img_size": 32}, "seed": 0})
    name = "vit_fractal_tiny_patch4_32"
    refused = (
        f"task 'c' cannot be served over this backbone: trained on {name} at 48 px, this backbone is {name} at 32 px"
    )
    with pytest.raises(TaskRefused, match=refused):
        petl.MultiTask(backbone, {"a": at_32, "c": at_48})
    # Another random init of the same architecture: the frozen tensors differ.
    redrawn = run_card.create_backbone({**TINY, "seed": 1})
    with pytest.raises(TaskRefused, match="task 'a' cannot be served over this backbone: the backbone's frozen") as no:
        petl.MultiTask(redrawn, {"a": at_32})
    assert no.value.mismatch  # not a method that cannot share: petl-serve does not send it to petl-predict
    # The backbone cast before the runs were loaded on it: said so, where it was said to hold other weights.
    with pytest.raises(TaskRefused, match=r"weights are bfloat16, .*float32, .*\(\.to\(torch\.bfloat16\)\)"):
        petl.MultiTask(run_card.create_backbone({**TINY, "seed": 0}).to(torch.bfloat16), {"a": at_32})
    # Another architecture of the same shapes.
    native = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=4, depth=1, embed_dim=48)
    with pytest.raises(
        TaskRefused, match=f"trained on {name} at 32 px, this backbone is vit_tiny_patch16_224 at 32 px"
    ):
        petl.MultiTask(native, {"a": at_32})


# Tasks whose hooks stack (petl.model.rows.Batched): LoRA layouts and ranks, and FacT, whose update at qkv and fc1 is a
# rank-8 low-rank one (one stack at qkv: B places each target, the lower ranks zero-padded); SSF with BitFit's bias
# deltas (one affine stack; BitFit's LayerNorm biases too, with `all`); both adapter styles, with and without their
# LayerNorm, of two widths (padded); VPT-deep with two prompt counts; Convpass (its bypasses beside the attention and
# the MLP, each row's convolution a group of one grouped convolution).  Every head is a Linear of its own width.
BATCHED = {
    "lora_qv": ("lora", {}),
    "lora_qk": ("lora", {"targets": "q,k"}),
    "lora_r4": ("lora", {"rank": 4}),
    "lora_r4_fc": ("lora", {"rank": 4, "targets": "fc1"}),
    "ssf": ("ssf", {}),
    "bitfit": ("bitfit", {"biases": "linear"}),
    "bitfit_all": ("bitfit", {}),
    "adapter": ("adapter", {}),
    "adapter_2": ("adapter", {"scale": 0.5}),
    "adapter_16": ("adapter", {"dim": 16}),
    "adapter_norm": ("adapter", {"norm": True}),
    "adapter_norm_2": ("adapter", {"norm": True}),
    "adapter_parallel": ("adapter", {"style": "parallel"}),
    "adapter_parallel_2": ("adapter", {"style": "parallel", "scale": 0.3}),
    "vpt_5": ("vpt", {"num_tokens": 5, "deep": True}),
    "vpt_5_2": ("vpt", {"num_tokens": 5, "deep": True}),
    "vpt_2": ("vpt", {"num_tokens": 2, "deep": True}),
    "fact": ("fact", {}),
    "convpass": ("convpass", {}),
    "convpass_2": ("convpass", {"scale": 3.0}),
}


def _without_stacks(multi) -> None:
    """Turn every stack off: each task's hooks act on its own rows (the loop the stacks replace)."""
    multi.stacked_heads = False
    for module in multi.backbone.modules():
        if hasattr(module, "stacks"):
            module.stacks = []
            module._kinds()  # what each call does, worked out again without them


@pytest.fixture(scope="module")
def stacked(tmp_path_factory):
    backbone = make_tiny_vit()
    singles, files = _save(tmp_path_factory.mktemp("batched"), BATCHED, backbone)
    multi = petl.MultiTask(backbone, files)
    multi.launch_bound = True  # stacks act whenever two of their tasks are in a batch, as on a GPU
    return singles, files, multi, backbone


def test_hooks_with_the_same_batched_form_stack_once(stacked):
    """Stacks hold the tasks whose forms match; a task alone with its form has one only for batches run every row."""
    _, _, multi, _ = stacked
    block = backbone_of(multi.backbone).block_container()[0]
    inner = block.base

    def stacks(module) -> list[tuple[str, ...]]:
        return [tuple(multi.names[t] for t in stack.tasks) for stack in module.stacks]

    # Q+V and Q+K (A 16 x in, B 3*width x 16 each), rank-4 Q+V (A 8 x in) and FacT's rank-8 update at qkv: one stack,
    # as are the rank-4 fc1 update and FacT's fc1 update (A 4 x in, 8 x in).  BitFit's LayerNorm biases (`all`)
    # stack with SSF's scale and shift at the norms.
    assert stacks(inner.attn.base.qkv) == [("lora_qv", "lora_qk", "lora_r4", "fact"), ("ssf", "bitfit", "bitfit_all")]
    assert stacks(inner.mlp.base.fc1) == [("lora_r4_fc", "fact"), ("ssf", "bitfit", "bitfit_all")]
    assert stacks(inner.norm1) == [("ssf", "bitfit_all")]
    assert stacks(inner.attn) == [("convpass", "convpass_2")]
    assert stacks(inner.mlp) == [
        ("adapter", "adapter_2", "adapter_16"),
        ("adapter_norm", "adapter_norm_2"),
        ("convpass", "convpass_2"),
    ]
    # VPT-deep's 2 prompts alone in a stack of its own: every hook of these tasks stacks, so that a batch may run every
    # row through every stack (MultiTask.every_row); a batch that does not leaves it to act on its own rows.
    assert sorted(stacks(block)) == [("adapter_parallel", "adapter_parallel_2"), ("vpt_2",), ("vpt_5", "vpt_5_2")]
    assert multi.every_row and multi.stacked_heads


def test_stacked_hooks_give_each_row_its_own_models_logits(stacked, monkeypatch):
    """Mixed batches in any order, two tasks, one task: the rows are each task's own model's, and the stacks ran."""
    from petl.deploy.routing import Stack

    singles, _, multi, _ = stacked
    ran = []
    lookup = Stack.rows
    monkeypatch.setattr(Stack, "rows", lambda self, *args: ran.append(self.tasks) or lookup(self, *args))
    for seed in range(2):
        ids, images = _mixed_batch(list(BATCHED), per_task=2, seed=seed)
        known: dict = {}  # the single models' rows of these images, for the checks below too
        _check_rows(multi, singles, ids, images, known=known)
    assert ran
    # With autograd on (no rows written in place) and with two tasks of one stack, in both orders.
    _check_rows(multi, singles, ids, images, out=multi(images, ids).detach(), known=known)
    _check_rows(multi, singles, ["lora_qk", "lora_qv", "lora_qk"], images[:3], known=known)
    _check_rows(multi, singles, ["adapter_norm_2", "vpt_5", "adapter_norm", "vpt_5_2"], images[:4], known=known)
    # One task of a stack alone in a batch (or with tasks outside it) acts on its own rows: the stack stays off.
    ran.clear()
    _check_rows(multi, singles, ["lora_qv"] * 3, images[:3], known=known)
    _check_rows(multi, singles, ["lora_r4", "lora_r4_fc"], images[:2], known=known)
    assert not ran
    # Two methods and two ranks in one stack: LoRA's rank-4 and FacT's rank-8 low-rank updates at qkv and fc1; two
    # adapter widths.
    _check_rows(multi, singles, ["fact", "lora_r4_fc", "fact", "lora_r4"], images[:4], known=known)
    _check_rows(multi, singles, ["adapter_16", "adapter", "adapter_16"], images[:3], known=known)
    low_rank = {multi.names.index(n) for n in ("lora_r4", "lora_r4_fc", "fact")}
    together = [tasks for tasks in ran if low_rank & set(tasks)]
    assert len(together) >= 2 and all(multi.names.index("fact") in tasks for tasks in together)


def test_on_a_cpu_a_stack_acts_where_its_tasks_hold_half_of_its_span(stacked, monkeypatch):
    """Its op computes every row of its span, the other tasks' rows there too: on a CPU (arithmetic the cost) only
    worth it where its tasks hold half of them or more."""
    from petl.deploy.routing import Stack

    singles, _, multi, _ = stacked
    ran = []
    lookup = Stack.rows
    monkeypatch.setattr(Stack, "rows", lambda self, *args: ran.append(self.tasks) or lookup(self, *args))
    monkeypatch.setattr(multi, "launch_bound", None)  # by the device: the CPU here
    low_rank = tuple(multi.names.index(n) for n in ("lora_qv", "lora_qk", "lora_r4", "fact"))
    fc1 = tuple(multi.names.index(n) for n in ("lora_r4_fc", "fact"))
    # At qkv, LoRA's and FacT's rows, 2 of 5, span the fc1 LoRA's 3 between them (the tasks of one group of stacks
    # sit together, in task order): no stack.  At fc1, the fc1 LoRA's and FacT's, all 4 rows of their span: it acts.
    _, images = _mixed_batch(["lora_qv"], per_task=5)
    _check_rows(multi, singles, ["lora_r4_fc", "lora_qv", "lora_r4_fc", "fact", "lora_r4_fc"], images)
    assert set(ran) == {fc1}
    ran.clear()
    _check_rows(multi, singles, ["lora_qv", "ssf", "lora_qk", "lora_qv", "fact"], images)
    assert set(ran) == {low_rank}  # all 4 rows of its span; SSF alone has no stack acting


def test_stacked_hooks_give_what_the_task_by_task_loop_gives(stacked):
    """The batched path and the per-task loop it replaces agree on every row (float rounding apart)."""
    _, files, multi, backbone = stacked
    ids, images = _mixed_batch(list(BATCHED), per_task=3, seed=5)
    looped = petl.MultiTask(backbone, files)
    _without_stacks(looped)
    with torch.no_grad():
        torch.testing.assert_close(multi(images, ids), looped(images, ids), atol=1e-5, rtol=1e-5)


def _stack_calls(multi, monkeypatch, images: int) -> list[tuple[tuple[str, ...], int, int, bool]]:
    """Record each stack's op from now on: (its tasks, the first and end image of the rows it got, in place).

    The rows an op gets are a slice of the module's output (a view of its storage), so where they sit in the whole
    batch is known without the batch: a Swin's window attention sees each image as its windows' rows.
    """
    calls = []

    def record(stack, op, in_place):
        def recorded(x, y, rows):
            per_row = y[0].numel()
            total = y.untyped_storage().nbytes() // (y.element_size() * per_row)
            first, count = y.storage_offset() // per_row, y.shape[0]
            names = tuple(multi.names[t] for t in stack.tasks)
            calls.append((names, first * images // total, (first + count) * images // total, in_place))
            return op(x, y, rows)

        return recorded

    for module in multi.backbone.modules():
        for stack in getattr(module, "stacks", ()):
            if stack.post is not None:
                monkeypatch.setattr(stack, "post", record(stack, stack.post, False))
                if getattr(stack, "post_in_place", None) is not None:
                    monkeypatch.setattr(stack, "post_in_place", record(stack, stack.post_in_place, True))
    return calls


def _spans(multi, ids: list[str], images: torch.Tensor) -> dict[str, tuple[int, int]]:
    """Each task's rows (first, end) in the batch as the MultiTask sorts it."""
    layout = multi._layout(multi.task_index(ids, len(ids)), images)
    return {multi.names[task]: (first, end) for task, first, end in layout.groups}


@pytest.mark.parametrize("launch_bound", [False, True])
def test_a_stack_acts_on_the_span_of_its_tasks_rows_only(stacked, monkeypatch, launch_bound):
    """A stack's op gets the rows from its first task's first row to its last task's last (the batch sorted by task),
    not the whole batch: the rows of the tasks between take its neutral entry (BitFit's on the Linears only, between
    SSF's and BitFit's on every bias at the norms; the fc1 LoRA's between LoRA's and FacT's at qkv), those outside
    it are left alone.  Every row equals the per-task loop's and its own model's, written in place without
    autograd and into a new tensor with it."""
    singles, files, multi, backbone = stacked
    monkeypatch.setattr(multi, "launch_bound", launch_bound)
    names = ["lora_qv", "lora_r4_fc", "ssf", "bitfit", "bitfit_all", "adapter", "adapter_16", "adapter_parallel"]
    names += ["adapter_parallel_2", "fact"]
    ids, images = _mixed_batch(names, per_task=2, seed=7)
    calls = _stack_calls(multi, monkeypatch, len(ids))
    spans = _spans(multi, ids, images)
    looped = petl.MultiTask(backbone, files)
    _without_stacks(looped)
    known: dict = {}
    with torch.no_grad():
        expected = looped(images, ids)
        torch.testing.assert_close(multi(images, ids), expected, atol=1e-5, rtol=1e-5)
    _check_rows(multi, singles, ids, images, known=known)
    torch.testing.assert_close(multi(images, ids).detach(), expected, atol=1e-5, rtol=1e-5)  # autograd on
    assert calls
    partial = set()
    for tasks, first, end, in_place in calls:
        present = [spans[task] for task in tasks if task in spans]
        assert (first, end) == (min(s[0] for s in present), max(s[1] for s in present)), (tasks, first, end)
        if end - first < len(ids):
            partial.add((tasks, in_place))
    # The tasks of one group of stacks sit together: at the norms, SSF's and BitFit's with BitFit-on-Linears between;
    # at qkv, LoRA's and FacT's with the fc1 LoRA's rows between; the adapters' and the fc1 low-rank stack's inside the
    # batch (their tasks hold at least half of each span: on a CPU too).  In place without autograd, a new tensor with
    # it.
    qkv_low_rank = ("lora_qv", "lora_qk", "lora_r4", "fact")
    for tasks in (("ssf", "bitfit_all"), ("adapter", "adapter_2", "adapter_16"), ("lora_r4_fc", "fact"), qkv_low_rank):
        assert {(tasks, True), (tasks, False)} <= partial, sorted(partial)


@pytest.mark.parametrize("launch_bound", [False, True])
def test_stacks_written_in_place_under_bf16_autocast_answer_as_the_loop(stacked, monkeypatch, launch_bound):
    """Under bf16 autocast (petl-predict's and petl-serve's default on a GPU) a stack writes its rows into the frozen
    module's bf16 output with its own fp32 tensors: in place, the rows answer as the per-task loop's under the same
    autocast (an in-place op is not autocast: the H200 refused LoRA's fp32 B added into a bf16 output)."""
    _, files, multi, backbone = stacked
    monkeypatch.setattr(multi, "launch_bound", launch_bound)
    ids, images = _mixed_batch(list(BATCHED), per_task=2, seed=3)
    looped = petl.MultiTask(backbone, files)
    _without_stacks(looped)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        torch.testing.assert_close(multi(images, ids), looped(images, ids), atol=0.05, rtol=0.05)


# Tiny backbones of the other families (their methods as they declare them), and the cases apply refuses on them
# in one line before anything is served: RepAdapter where qkv has no bias of its own, FacT where the MLP is not 4x,
# and on EVA-02 with separate q/k/v and a SwiGLU MLP (fc1_g, fc1_x) every case naming qkv or fc1.
FAMILIES = {kind: TINY_MODELS[kind] for kind in ("swin", "swinv2", "swinv2_cr")}
FAMILIES |= {
    family: functools.partial(make_tiny_family, family)
    for family in (
        "beit",
        "beit_shared",
        "eva02",
        "eva02_unfused",
        "eva_rope",
        "eva_rope_mixed",
        "naflexvit",
        "naflexvit_rope_mixed",
        "naflexvit_eva",
        "vit_relpos",
        "vit_srelpos",
        "vit_hybrid",
    )
}
# A NaFlexVit pools with a mask over the patch tokens under every pooling: VPT's rows are served beside the others
# under its attention pool too, where a ViT's map pool is refused with prompts.
FAMILIES["naflexvit_map"] = functools.partial(make_tiny_family, "naflexvit", global_pool="map", fc_norm=False)
NOT_APPLIED = {
    "beit": ("repadapter",),
    "beit_shared": ("repadapter",),
    "eva02": ("repadapter", "fact", "fact_tt"),
    "naflexvit_eva": ("repadapter", "fact", "fact_tt"),
    "eva02_unfused": (
        *("repadapter", "fact", "fact_tt", "ssf", "noah", "noah_mixed"),
        *("peft", "dora", "lora_all", "bitfit_linear", "peft_fc", "ia3"),
    ),
    "vit_relpos": ("repadapter",),
    "vit_srelpos": ("repadapter",),
}
# Methods refused by a MultiTask in one line: GPS trains the blocks' bare gammas (BEiT, the rope ViTs) or the q/v
# biases beside the qkv it wraps (EVA-02 with a fused qkv).  VPT's prompts, HST's meta tokens and NOAH's prompts are
# served: the shared blocks get room for the batch's slots (no relative-position bias, no rotation), as each task's
# own model has.
GAMMAS = ("beit", "beit_shared", "eva02", "eva_rope", "eva_rope_mixed", "naflexvit_rope_mixed", "naflexvit_eva")
MULTITASK_REFUSED = {family: ("gps",) for family in GAMMAS}
# Cases that train a module computing a table every row shares (the position-bias MLP of a SwinV2, SwinV2Cr or a
# relpos ViT: BitFit on all biases, peft on every fc1/fc2), refused naming it; BitFit on the Linears alone is served.
TABLE_TRAINED = {
    "swinv2": {"bitfit": r"layers\.0\.blocks\.0\.attn\.cpb_mlp"},
    # A SwinV2Cr's position-bias MLP (meta_mlp) has Linears named fc1 and fc2, which peft's fc targets take too.
    "swinv2_cr": {case: r"stages\.0\.blocks\.0\.attn\.meta_mlp" for case in ("bitfit", "peft_fc", "ia3")},
    "vit_relpos": {case: r"blocks\.0\.attn\.rel_pos" for case in ("bitfit", "peft_fc", "ia3")},
    "vit_srelpos": {case: r"shared_rel_pos" for case in ("bitfit", "peft_fc", "ia3")},
    # A frozen weight the whole batch shares: BitFit on all biases trains the norms of a hybrid ViT's CNN stem.
    "vit_hybrid": {"bitfit": r"patch_embed\.backbone\.norm\.bias, a frozen weight"},
}


@pytest.mark.slow  # 5 to 30 s a family on 2 cores
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_mixed_batch_on_another_family_gives_each_row_its_own_tasks_logits(tmp_path, family):
    # Every method and variant that supports the family and shares a backbone, two LoRAs among them so that their
    # updates stack: a Swin's window attention's qkv and proj see each image as its windows' rows; BEiT's, EVA's
    # and the relpos ViTs' blocks take the model's relative-position bias or rotary embedding, and room for the
    # prompt slots of VPT (shallow, deep, img_pool), HST and NOAH (its prompts in some blocks only), whose slot
    # counts differ, so that rows attend some slots and not others, in every block or some.  On a Swin, VPT's rows
    # (10, 5 and 2 prompts) take a pass per prompt count beside the routed one (tests/methods/test_vpt_swin.py).
    backbone = FAMILIES[family]()
    kind = backbone_of(backbone).kind
    cases = {n: c for n, c in SHARED.items() if kind in petl.get_method(c[0]).backbones}
    cases["lora_2"] = ("lora", {"rank": 8})
    cases = {n: c for n, c in cases.items() if n not in NOT_APPLIED.get(family, ())}
    refused = MULTITASK_REFUSED.get(family, ())
    refusals = {
        name: rf"task '{name}' \(method {case[0]}\b[^)]*\) cannot share"
        for name, case in cases.items()
        if case[0] in refused
    }
    refusals |= {name: rf"task '{name}' .* trains {path}" for name, path in TABLE_TRAINED.get(family, {}).items()}
    served = {n: c for n, c in cases.items() if n not in refusals}
    singles, files = _save(tmp_path, served, backbone)
    multi = petl.MultiTask(backbone, files)
    ids, images = _mixed_batch(sorted(served), per_task=2)
    _check_both_paths(multi, singles, ids, images)
    for name, pattern in refusals.items():
        (tmp_path / name).mkdir()
        _, alone = _save(tmp_path / name, {name: cases[name]}, backbone)
        with pytest.raises(TaskRefused, match=pattern) as error:
            petl.MultiTask(backbone, alone)
        assert "\n" not in str(error.value) and not error.value.mismatch


def test_a_naflexvit_with_a_rotary_embedding_takes_its_own_image_size_only(tmp_path):
    # A NaFlexVit resamples its position grid to any image, and so does a MultiTask of one; with EvaBlocks the shared
    # blocks get the rotation of the model's grid (block_inputs): other images failed with a tensor size mismatch
    # inside the attention, where the task's own model (timm's forward, a rotation per image grid) ran them.
    for family, served in (("naflexvit", True), ("naflexvit_rope_mixed", False)):
        backbone = make_tiny_family(family)
        _, files = _save(tmp_path / family, {"a": ("lora", {})}, backbone)
        multi = petl.MultiTask(backbone, files)
        images = torch.randn(2, 3, 48, 48, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            if served:
                assert multi(images, ["a", "a"]).shape == (2, multi.num_classes["a"])
                continue
            with pytest.raises(ValueError, match=r"^images are 48x48 px: the backbone takes 32x32; preprocess") as e:
                multi(images, ["a", "a"])
        assert "\n" not in str(e.value)


def test_a_mixed_batch_on_parallel_blocks_gives_each_row_its_own_tasks_logits(tmp_path):
    # vit_pwee: LoRA's q/v/fc1 rows of in_proj, AdaptFormer reading the block's input (one residual), Convpass beside
    # the inline sub-layers, peft on the block's own Linear names; the variants naming qkv or fc1 Linears are refused
    # by apply there, and so is FacT (vit_pwee's MLP is 5x the width).
    cases = {
        n: c
        for n, c in SHARED.items()
        if "vit_parallel" in petl.get_method(c[0]).backbones and c[0] not in ("peft", "repadapter", "fact")
    }
    cases |= {
        "lora_2": ("lora", {"rank": 8}),
        "dora_in_proj": ("peft", {"target_modules": ("in_proj",), "options": '{"r": 4, "use_dora": true}'}),
        "ia3_parallel": (
            "peft",
            {
                "peft_type": "IA3",
                "target_modules": ("in_proj", "mlp_out_proj"),
                "options": '{"feedforward_modules": ["mlp_out_proj"]}',
            },
        ),
    }
    backbone = make_tiny_family("vit_pwee")
    singles, files = _save(tmp_path, cases, backbone)
    multi = petl.MultiTask(backbone, files)
    ids, images = _mixed_batch(sorted(cases), per_task=2)
    _check_both_paths(multi, singles, ids, images)
    # RepAdapter (and FacT) put two wrappers (the MLP's rows, the Q/K/V rows) on one in_proj: no row hook composes.
    _, files = _save(tmp_path, {"repadapter": ("repadapter", {})}, backbone)
    with pytest.raises(TaskRefused, match=r"task 'repadapter' .*modifies blocks\.0\.in_proj twice") as error:
        petl.MultiTask(backbone, files)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("launch_bound", [False, True])
def test_rows_without_prompts_share_the_blocks_without_prompt_slots_on_a_cpu(stacked, monkeypatch, launch_bound):
    """On a CPU, prompted tasks' rows go through the blocks in a pass of their own (slots and attention masks) and
    the other tasks' rows share a pass without them; where launching ops is the cost, every row goes through in one
    pass, the unprompted rows' slots masked out.  Either way every row is its own model's."""
    singles, _, multi, _ = stacked
    monkeypatch.setattr(multi, "launch_bound", launch_bound)
    passes = []
    features = petl.MultiTask._features

    def record(self, x, layout, part):
        passes.append([self.names[task] for task, _, _ in part])
        return features(self, x, layout, part)

    monkeypatch.setattr(petl.MultiTask, "_features", record)
    ids, images = _mixed_batch(["vpt_5", "lora_qv", "vpt_2", "ssf"], per_task=2, seed=3)
    _check_rows(multi, singles, ids, images)
    if launch_bound:
        assert passes == [["lora_qv", "ssf", "vpt_5", "vpt_2"]]
    else:
        assert passes == [["lora_qv", "ssf"], ["vpt_5", "vpt_2"]]
    passes.clear()
    _check_rows(multi, singles, ["ssf", "lora_qv"], images[:2])
    assert passes == [["lora_qv", "ssf"]]


def _task_set(name: str = "8 methods") -> dict[str, tuple[str, dict]]:
    """A task set of benchmarks/multitask_speed.py (the 8-method set: one task of each family), by task name."""
    spec = importlib.util.spec_from_file_location("multitask_speed", REPO / "benchmarks" / "multitask_speed.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    methods = script.TASK_SETS[name]
    return {f"{method}_{i}": (method, options) for i, (method, options) in enumerate(methods)}


class _AllOps(TorchDispatchMode):
    """Counts every aten op dispatched inside it by name, views included (CountOps leaves them out)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _served_ops(forward) -> collections.Counter[str]:
    """The ops of one served call (no autograd), after a first call that fills the per-device copies of the tasks'
    served tensors."""
    with torch.no_grad():
        forward()
        with CountOps() as count:
            forward()
    return count.ops


# What the 8-method set may add to the plain backbone's ops, per block: LoRA's and FacT's updates at qkv in one stack
# (bmm, baddbmm), FacT alone at proj, fc1 and fc2 (mm, addmm_ into the rows), SSF's and BitFit's scales and shifts
# in one stack at the norms and Linears (an addcmul each), each adapter's down, activation, and up added into the
# rows (addmm_, up's bias on a unit of its own), Convpass's two bypasses (down, SiLU, centre tap, the other taps'
# conv, add_, SiLU, up added into the rows), the prompt slots in the sequence costing none of them an op.
EIGHT_METHODS_OPS_PER_BLOCK = {"lora+fact": 2, "fact": 3 * 2, "ssf+bitfit": 6, "adapters": 2 * 3, "convpass": 2 * 7}
# Per batch: sorting the rows by task (on the CPU; two ops of it put the tasks that stack together next to each
# other), the prompt slots and each row's attention mask gathered from its task's, each row's head gathered, each
# stack table's rows gathered once, SSF and BitFit at the patch embedding and final norm.
EIGHT_METHODS_OPS_PER_BATCH = 24


def test_a_mixed_batch_of_eight_methods_launches_few_ops(tmp_path):
    """On a GPU a mixed batch of small updates is bound by the host launching ops, so one forward's op count is
    its cost: the 8-method set costs one pass of the plain backbone's ops (the prompted task's rows share it, the
    other rows' prompt slots masked out) plus what each family's update needs, no copy of a task's rows back into
    the batch and no per-module gather of its stacked tensors."""
    backbone = make_tiny_vit()
    _, files = _save(tmp_path, _task_set(), backbone)
    multi = petl.MultiTask(backbone, files)
    multi.launch_bound = True  # the GPU's path: every stack of two or more tasks acts
    ids, images = _mixed_batch(list(files), per_task=4)
    mixed, plain = _served_ops(lambda: multi(images, ids)), _served_ops(lambda: backbone(images))
    depth = len(backbone.blocks)
    budget = sum(plain.values()) + depth * sum(EIGHT_METHODS_OPS_PER_BLOCK.values()) + EIGHT_METHODS_OPS_PER_BATCH
    assert sum(mixed.values()) <= budget, dict(mixed)
    # The rows are written in place, and the prompt slots' masks gathered on the device from tables made once.
    assert not mixed["copy_"], dict(mixed)
    # Under inference mode (petl-predict's and petl-serve's) a tensor already in the output's dtype is not cast:
    # even a cast to its own dtype is an op to launch (e1d6580's in-place updates cast their tensors in every block,
    # 624 ops of the benchmark's batch becoming 816).  The 2 are the layout's moves to the device (the rows' order and
    # tasks).
    with torch.inference_mode():
        multi(images, ids)
        with CountOps() as count:
            multi(images, ids)
    assert count.ops["to"] <= 2, dict(count.ops)
    # Only the frozen Linears call F.linear: a hook's matmuls are one mm or addmm each on a weight transposed once
    # (rows.tokens_linear), the kernel F.linear reaches after dispatching the weight's transpose and matmul's views
    # (under inference mode F.linear is one op to the counter; without autograd it counts what it dispatches).
    with torch.inference_mode(), CountOps() as frozen:
        backbone(images)
    assert 0 < count.ops["linear"] <= frozen.ops["linear"], dict(count.ops)  # the heads are one stacked matmul
    # Nor is a dropout dispatched: in eval it returns its input, yet under inference mode it is an op the host
    # dispatches (38 of the benchmark's 624), which the routed copy's dropouts (MultiTask stays in eval) skip.
    assert not count.ops["dropout"], dict(count.ops)
    # Views are calls the host makes too: a stack's gathered vectors (SSF's and BitFit's scales and shifts, each
    # stack's two per call) come in the shape that broadcasts over the tokens, one view of each vector table's rows
    # (2 tables).
    unsqueezed = {}
    for name, call in (("mixed", lambda: multi(images, ids)), ("plain", lambda: backbone(images))):
        with torch.inference_mode(), _AllOps() as every:
            call()
        unsqueezed[name] = every.ops["unsqueeze"]
    assert unsqueezed["mixed"] <= unsqueezed["plain"] + 2, unsqueezed


def test_tasks_that_stack_together_get_one_span_of_the_batch(tmp_path):
    """The batch is sorted so that the tasks of a stack are next to each other (LoRA's and FacT's qkv updates, SSF's
    and BitFit's scales and shifts in the 8-method set, whose tasks 0 and 6 stack), and every row is still its own
    model's."""
    backbone = make_tiny_vit()
    singles, files = _save(tmp_path, _task_set(), backbone)
    multi = petl.MultiTask(backbone, files)
    multi.launch_bound = True
    ids, images = _mixed_batch(list(files), per_task=2)
    layout = multi._layout(multi.task_index(ids, len(ids)), images)
    order = [multi.names[task] for task, _, _ in layout.groups]
    assert order == ["lora_0", "fact_6", "adapter_1", "adapter_2", "vpt_3", "ssf_4", "bitfit_5", "convpass_7"]
    _check_rows(multi, singles, ids, images)


# What the other task sets may add to the plain backbone's ops, per block (upper bounds: DTL adds from half the depth
# on) and per batch.  Eight LoRA tasks: one stack at qkv (bmm, baddbmm).  The side-network set: GPS's bias delta,
# gather and addcmul_ into the rows at each of the four Linears; HST's two trained LayerNorms on its rows (each copied
# back), its meta tokens written into the slots, its side block (12) and what it reads of the block (7); LST's rows
# without the slots (a cat), the gated ladder (one addmm) and its side block (11); DTL's running sum (a matmul and an
# addmm), its SiLU added into the block's output (DTL+: its conv and two adds); NOAH's prompts written into the slots
# and its adapter (down, SiLU, addmm_); NOAH's and LoRA's qkv updates in one stack (bmm, baddbmm); the rows of the
# block's prompt writers put together (a cat).  Per batch: besides sorting the rows (9) and the head, for the
# side-network set the prompt slots and each row's masks gathered (3), VPT's prompts, GPS's patch convolution, HST's
# stem, stage norms and head, LST's first and last projections, and the heads one by one (HST's is not a Linear).
OTHER_SETS_OPS = {
    "8 LoRA tasks": ({"lora": 2}, 13),
    "8 methods, side networks & co.": (
        {"gps": 4 * 3, "hst": 2 * 2 + 1 + 12 + 7, "lst": 1 + 1 + 11, "dtl": 2 + 2, "dtl+": 2 + 4, "noah": 1 + 3,
         "lora+noah": 2, "prompt writers": 1},
        53,
    ),
}  # fmt: skip


@pytest.mark.parametrize("task_set", sorted(OTHER_SETS_OPS))
def test_the_other_task_sets_launch_few_ops(tmp_path, task_set):
    """As the 8-method set: the LoRA set and the side-network set of benchmarks/multitask_speed.py cost one pass of
    the plain backbone's ops plus what each task's served update needs, with none of the ops a served update can do
    without (a product or a sum where a fused op does, a gate or activation worked out at every call, a copy of a
    task's rows where it can write in place)."""
    backbone = make_tiny_vit()
    _, files = _save(tmp_path, _task_set(task_set), backbone)
    multi = petl.MultiTask(backbone, files)
    multi.launch_bound = True
    ids, images = _mixed_batch(list(files), per_task=4)
    mixed, plain = _served_ops(lambda: multi(images, ids)), _served_ops(lambda: backbone(images))
    per_block, per_batch = OTHER_SETS_OPS[task_set]
    depth = len(backbone.blocks)
    assert sum(mixed.values()) <= sum(plain.values()) + depth * sum(per_block.values()) + per_batch, dict(mixed)
    assert not {"mul", "sum", "sigmoid", "div", "rsub", "clone"} & set(mixed), dict(mixed)
    # Copies: LST's output put back into its rows (once), HST's two LayerNorms' rows (per block).
    assert mixed["copy_"] <= (1 + 2 * depth if "side" in task_set else 0), dict(mixed)


class _HostToDevice(TorchDispatchMode):
    """Records each copy from the CPU to another device: whether the host was allowed to go on without waiting."""

    def __init__(self) -> None:
        super().__init__()
        self.non_blocking: list[bool] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and args[0].device.type == "cpu":
            if kwargs.get("device", args[0].device).type != "cpu":
                self.non_blocking.append(bool(kwargs.get("non_blocking", False)))
        return func(*args, **kwargs)


@pytest.mark.parametrize("task_set", ["8 methods", *sorted(OTHER_SETS_OPS)])
def test_a_served_mixed_batch_reads_nothing_back_and_queues_its_copies(tmp_path, task_set):
    """The GPU's path (launch-bound) with the MultiTask on the meta device, which holds no values: the forward never
    reads a device tensor's values back to the host (an ``.item()`` there raises), and the few tensors it builds on
    the CPU (the rows' order, the prompt slots' masks) go to the device without waiting for it.  The CUDA test below
    checks the same on a GPU."""
    backbone = make_tiny_vit()
    _, files = _save(tmp_path, _task_set(task_set), backbone)
    ids, images = _mixed_batch(list(files), per_task=4)
    multi = petl.MultiTask(backbone, files)
    multi.launch_bound = True
    multi.to("meta")
    images = images.to("meta")
    with torch.no_grad():
        multi(images, ids)  # fills the per-device copies of the tasks' served tensors
        with _HostToDevice() as copies:
            logits = multi(images, ids)
    assert logits.shape == (len(ids), max(multi.num_classes.values()))
    assert copies.non_blocking and all(copies.non_blocking), copies.non_blocking


@pytest.mark.cuda
@pytest.mark.parametrize("task_set", ["8 methods", *sorted(OTHER_SETS_OPS)])
def test_a_served_mixed_batch_never_waits_for_the_gpu(tmp_path, monkeypatch, task_set):
    """On a GPU the host launching ops is the cost (the tests above), so a forward must never stop the host until the
    GPU has drained: no blocking copy of the rows' order or masks, no ``.item()``, eager or replaying forward's CUDA
    graph of the layout; and the rows get the logits the CPU gives them."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # the CPU's fp32, to compare with it
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    backbone = make_tiny_vit()
    _, files = _save(tmp_path, _task_set(task_set), backbone)
    ids, images = _mixed_batch(list(files), per_task=4)
    answers = []
    with torch.no_grad():
        on_cpu = petl.MultiTask(backbone, files)(images, ids)
        multi = petl.MultiTask(backbone, files).cuda()
        images = images.cuda()
        for graphs in (0, 8):  # eager, then from forward's graph of the layout
            multi.graphs.size = graphs
            for _ in range(2 if graphs else 1):  # fills the per-device copies of the tasks' tensors; captures
                multi(images, ids)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")  # a synchronizing CUDA call raises
            try:
                answers.append(multi(images, ids))
            finally:
                torch.cuda.set_sync_debug_mode("default")
    assert (multi.graphs.captured, multi.graphs.replayed) == (1, 2)
    for on_gpu in answers:
        torch.testing.assert_close(on_gpu.cpu(), on_cpu, atol=1e-4, rtol=1e-4)


def test_one_path_or_a_list_where_a_mapping_is_taken_is_named(tmp_path):
    # from_runs("runs/a") iterated the string's letters ("/ holds no trainable.safetensors"); MultiTask(backbone,
    # [file]) failed on list.items() with an AttributeError.
    with pytest.raises(ValueError, match=r"takes a list of run folders, got one path: write \['"):
        petl.MultiTask.from_runs(str(tmp_path))
    with pytest.raises(ValueError, match="takes a list of run folders"):
        petl.MultiTask.from_runs(tmp_path)
    with pytest.raises(ValueError, match=r"got a list: e.g. MultiTask\(backbone, \{'cifar': 'runs/cifar'\}\)"):
        petl.MultiTask(make_tiny_vit(), [str(tmp_path / "a.safetensors")])


def test_one_run_folder_listed_twice_is_refused_naming_it(tmp_path):
    # from_runs([a, a]) served one task where two were listed (a list's tasks are named by their paths, so two
    # entries of one folder were one dict key); runs/a and runs/a/ served one run as two tasks.
    from test_run_card import _run_folder as run_folder

    run = run_folder(tmp_path / "a", seed=1)
    for twice, spelt in (([run, run], ""), ([run, str(run)], ""), ([run, f"{run}/"], f" (as '{run}' and '{run}/')")):
        with pytest.raises(ValueError) as refused:
            petl.MultiTask.from_runs(twice)
        assert str(refused.value) == (
            f"run folder {twice[1]} is given twice{spelt}: give each run once, or a dict to name two tasks of it"
        )
    assert petl.MultiTask.from_runs({"x": run, "y": run}).names == ["x", "y"]  # two tasks of one run, as asked
    _singles, files = _save(tmp_path, {"a": SHARED["lora"]}, make_tiny_vit())
    with pytest.raises(ValueError, match="^task name 'a' is given twice: give each task one name$"):
        petl.MultiTask(make_tiny_vit(), {"a": files["a"], Path("a"): files["a"]})


def test_one_task_id_where_one_per_image_is_taken_is_named(tmp_path):
    # served(images, "a") read the string as one task per letter ("unknown task 'a'" for a task named "ab", or a batch
    # of len("ab") rows answered by tasks nobody named); served(images, 0) failed with "'int' object is not iterable".
    _singles, files = _save(tmp_path, {"ab": SHARED["lora"]}, make_tiny_vit())
    served = petl.MultiTask(make_tiny_vit(), files)
    images = torch.randn(2, 3, 32, 32)
    for one in ("ab", 0, np.int64(0)):
        with pytest.raises(ValueError, match=r"is one task: give one per image, e\.g\. \[.*\] \* 2$") as error:
            served(images, one)
        assert str(error.value).startswith(f"task_ids={one!r} is one task")


@pytest.mark.parametrize("how", ["deepcopy", "copy", "torch.save"])
def test_a_multitask_refuses_to_be_copied_or_pickled_in_one_line(tmp_path, how):
    # A deepcopy's row hooks went on reading the original's modules: its logits followed the original's tensors, and
    # the copy moved to another dtype failed deep in a matmul; torch.save failed on a local lambda.
    _singles, files = _save(tmp_path, {"a": SHARED["lora"], "b": SHARED["ssf"]}, make_tiny_vit())
    served = petl.MultiTask(make_tiny_vit(), files)
    copies = {"deepcopy": copy.deepcopy, "copy": copy.copy, "torch.save": lambda m: torch.save(m, tmp_path / "mt.pt")}
    with pytest.raises(
        TypeError, match=r"^a MultiTask cannot be copied or pickled .*petl\.MultiTask\(backbone, tasks\)"
    ):
        copies[how](served)
    # The single-task models it serves still copy and pickle (the notebook's model, not the server).
    model = petl.apply_lora(make_tiny_vit())
    torch.save(copy.deepcopy(model), tmp_path / "model.pt")


def test_a_task_named_by_an_integer_is_refused(tmp_path):
    # MultiTask(backbone, {1: a, 2: b}) named the tasks "1" and "2", and served(images, [1]) read 1 as an index:
    # the row was answered by task "2", silently.
    _singles, files = _save(tmp_path, {"a": SHARED["lora"], "b": SHARED["ssf"]}, make_tiny_vit())
    by_int = {1: files["a"], 2: files["b"]}
    with pytest.raises(
        ValueError, match=r"^task name 1 is an integer: name tasks by strings \('1'\); an integer task id"
    ):
        petl.MultiTask(make_tiny_vit(), by_int)
    with pytest.raises(ValueError, match=r"^task name 1 is an integer: name tasks by strings"):
        petl.MultiTask.from_runs(by_int)
