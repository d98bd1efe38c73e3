"""VPT on a Swin: the prompts' layout through stages, timm's methods on the prompted model, a MultiTask's mixed
batch, the published count.

The registry-wide contracts (not unchanged at init, trainable count, save/load, dtype) run on the tiny Swin in
tests/methods/test_method_contracts.py; the forward against KMnP/vpt's own Swin code is in
tests/references/test_vpt_swin_reference.py.
"""

from __future__ import annotations

import copy

import pytest
import timm
import torch
import torch.nn.functional as F
from conftest import make_tiny_swin, perturb_trainable
from timm.models.swin_transformer import window_partition, window_reverse

import petl
from petl.deploy import multitask
from petl.deploy.multitask import TaskRefused
from petl.deploy.routing import task_sites
from petl.methods.lora import LoraLinear
from petl.model.backbone import swin_prompts
from petl.model.backbone.swin_prompts import PromptedFinalNorm, PromptedPatchMerging, PromptedSwinBlock
from petl.model.rows import RowHook


def _prompted(**options) -> torch.nn.Module:
    return petl.apply_vpt(make_tiny_swin(), num_tokens=3, **options).eval()


@pytest.mark.parametrize("pool", ["original", "img_pool"])
@pytest.mark.parametrize("deep", [False, True], ids=["shallow", "deep"])
def test_vpt_on_swin_layout(images, deep, pool):
    model = _prompted(deep=deep, pool=pool)
    blocks = [b for stage in model.layers for b in stage.blocks]
    assert all(isinstance(b, PromptedSwinBlock) for b in blocks)
    # One prompt set of the first stage's width (shallow), or one per block of its stage's width (deep).
    assert [tuple(b.prompt.shape) for b in blocks if b.prompt is not None] == (
        [(3, 16), (3, 16), (3, 32), (3, 32)] if deep else [(3, 16)]
    )
    assert isinstance(model.layers[1].downsample, PromptedPatchMerging)
    assert isinstance(model.norm, PromptedFinalNorm) == (pool == "original")
    # The final norm and pool see prompts and grid (VPT's Swin) or the grid alone (img_pool).
    features = model.forward_features(images)
    assert features.shape == ((2, 1, 3 + 16, 32) if pool == "original" else (2, 4, 4, 32))
    assert model(images).shape == (2, 5)


def test_vpt_on_swin_prompts_reach_every_stage(images):
    # Shallow prompts are carried through the merging into the next stage: changing them changes the last stage.
    model = _prompted()
    before = model.forward_intermediates(images)[1]
    with torch.no_grad():
        model.layers[0].blocks[0].prompt.mul_(-1)
    after = model.forward_intermediates(images)[1]
    assert not torch.allclose(before[-1], after[-1])


@pytest.mark.parametrize("pool", ["original", "img_pool"])
@pytest.mark.parametrize(
    "options",
    [{}, {"indices": 1}, {"norm": True}, {"indices": [0], "stop_early": True}, {"intermediates_only": True}],
    ids=["all", "last", "norm", "stop-early", "only"],
)
def test_vpt_on_swin_intermediates_have_timms_shapes(images, options, pool):
    plain = make_tiny_swin().forward_intermediates(images, **options)
    got = _prompted(deep=True, pool=pool).forward_intermediates(images, **options)
    if options.get("intermediates_only"):
        plain, got = (None, plain), (None, got)
    assert [t.shape for t in got[1]] == [t.shape for t in plain[1]]
    if not options.get("intermediates_only"):
        final = _prompted(deep=True, pool=pool).forward_features(images)
        expected = final.shape if not options.get("stop_early") else plain[0].shape
        assert got[0].shape == expected


def test_vpt_on_swin_intermediates_equal_the_grid_the_stages_pass(images):
    model = _prompted()
    final, found = model.forward_intermediates(images, norm=True)
    torch.testing.assert_close(final, model.forward_features(images))
    x = model.patch_embed(images)
    for stage, taken in zip(model.layers[:-1], found[:-1], strict=True):
        x = stage(x)
        torch.testing.assert_close(taken, x[0].permute(0, 3, 1, 2))
    # norm=True: the final norm on the last stage's grid, as timm applies it.
    last = model.layers[-1](x)[0]
    torch.testing.assert_close(found[-1], model.norm.base(last).permute(0, 3, 1, 2))
    with pytest.raises(TypeError, match="return_prefix_tokens"):
        model.forward_intermediates(images, return_prefix_tokens=True)


def test_vpt_on_swin_with_gradient_checkpointing(images):
    plain = petl.apply_vpt(make_tiny_swin(), num_tokens=3, deep=True, num_classes=4).train()
    ckpt = petl.apply_vpt(make_tiny_swin(), num_tokens=3, deep=True, num_classes=4).train()
    ckpt.set_grad_checkpointing(True)
    plain(images).sum().backward()
    ckpt(images).sum().backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters(), strict=True):
        if a.requires_grad:
            assert b.grad is not None and b.grad.abs().sum() > 0, name
            torch.testing.assert_close(a.grad, b.grad)


def test_vpt_on_swin_prompt_dropout_per_image_in_train_mode_only(images):
    model = petl.apply_vpt(make_tiny_swin(), num_tokens=4, dropout=0.5)
    assert torch.equal(model.eval()(images), model(images))
    model.train()
    assert not torch.equal(model(images), model(images))
    # Two copies of one image get their own dropout masks.
    twins = images[:1].expand(2, -1, -1, -1)
    out = model(twins)
    assert not torch.allclose(out[0], out[1])


def test_vpt_on_swin_refuses_pruning_and_swinv2(images):
    model = _prompted()
    with pytest.raises(ValueError, match="beside the grid"):
        model.prune_intermediate_layers(indices=[0])
    with pytest.raises(ValueError, match="beside the grid"):
        model.prune_intermediate_layers(indices=1, prune_norm=True)
    assert model(images).shape == (2, 5)
    with pytest.raises(ValueError, match="swinv2.*no prompted reference"):
        petl.apply_vpt(timm.create_model("swinv2_tiny_window8_256", pretrained=False, pretrained_cfg=None).eval())


# --- petl.MultiTask: VPT tasks' rows in a mixed batch ----------------------------------------------------------

# VPT shallow, deep and img_pool with 3 prompts, shallow with 5 (a pass per count), beside tasks the routed pass serves.
MIXED = {
    "vpt": ("vpt", {"num_tokens": 3}),
    "vpt_deep": ("vpt", {"num_tokens": 3, "deep": True}),
    "vpt_img_pool": ("vpt", {"num_tokens": 3, "deep": True, "pool": "img_pool"}),
    "vpt_5": ("vpt", {"num_tokens": 5}),
    "lora": ("lora", {}),
    "adapter": ("adapter", {}),
    "linear": ("linear", {}),
}


def _save_tasks(tmp_path, cases: dict, backbone) -> tuple[dict, dict]:
    singles, files = {}, {}
    for seed, (name, (method, options)) in enumerate(cases.items()):
        model = petl.apply(copy.deepcopy(backbone), method, num_classes=3 + seed % 4, **options)
        perturb_trainable(model, seed=seed)
        singles[name], files[name] = model.eval(), tmp_path / f"{name}.safetensors"
        petl.save_trainable(model, files[name])
    return singles, files


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    backbone = make_tiny_swin()
    singles, files = _save_tasks(tmp_path_factory.mktemp("mixed"), MIXED, backbone)
    return backbone, singles, petl.MultiTask(backbone, files)


@pytest.mark.parametrize("launch_bound", [False, True])
@pytest.mark.parametrize("only", [None, "vpt_deep", "vpt_5"], ids=["all", "deep_alone", "five_alone"])
def test_multitask_serves_vpt_on_swin_rows_as_their_own_models(mixed, launch_bound, only):
    # Each VPT row runs the shared frozen Swin with its own task's prompts (a pass per prompt count), the other rows
    # the routed pass: every row equals its task's own model, the VPT ones changed by their prompts.
    backbone, singles, multi = mixed
    names = sorted(MIXED) if only is None else [only]
    gen = torch.Generator().manual_seed(len(names))
    ids = [names[i % len(names)] for i in torch.randperm(3 * len(names), generator=gen).tolist()]
    images = torch.randn(len(ids), 3, 32, 32, generator=gen)
    multi.launch_bound = launch_bound
    with torch.no_grad():
        out = multi(images, ids)
        plain = backbone.forward_head(backbone.forward_features(images), pre_logits=True)
        for row, task in enumerate(ids):
            single = singles[task]
            expected = single(images[row : row + 1])[0]
            n = expected.shape[0]
            torch.testing.assert_close(out[row, :n], expected, atol=2e-5, rtol=1e-4, msg=f"row {row}, task {task}")
            assert torch.isinf(out[row, n:]).all()
            if task.startswith("vpt"):
                features = single.forward_head(single.forward_features(images[row : row + 1]), pre_logits=True)
                assert (features[0] - plain[row]).abs().max() > 1e-3
    multi.launch_bound = None


def test_multitask_runs_vpt_on_swin_through_the_shared_frozen_modules(mixed):
    backbone, _, multi = mixed
    frozen = {id(t) for t in [*backbone.parameters(), *backbone.buffers()]}
    assert {id(t) for t in [*multi.plain.parameters(), *multi.plain.buffers()]} <= frozen
    # Two prompt counts, two passes; neither the routed copy nor the plain one carries a VPT task's wrappers.
    assert len(multi.beside) == 2
    wrappers = (PromptedSwinBlock, PromptedPatchMerging, PromptedFinalNorm)
    assert not any(isinstance(m, wrappers) for copy_ in (multi.backbone, multi.plain) for m in copy_.modules())


def test_multitask_refuses_what_vpt_on_swin_cannot_share_in_one_line(tmp_path, monkeypatch):
    # A task with prompts beside the grid and a hook the routed pass would have to run; then tasks whose pooling
    # differs (prompts or not) over a pooling that cannot leave tokens out.
    backbone = make_tiny_swin()
    _, files = _save_tasks(tmp_path, {"vpt": MIXED["vpt"]}, backbone)
    qkv = backbone.layers[0].blocks[0].attn.qkv

    def with_a_routed_hook(model, frozen):
        return {**task_sites(model, frozen), "layers.0.blocks.0.attn.qkv": RowHook(qkv, post=lambda *a: a[1])}

    with monkeypatch.context() as patch:
        patch.setattr(multitask, "task_sites", with_a_routed_hook)
        refused = (
            r"task 'vpt' \(method vpt\) cannot share .*beside the tokens.* hook at layers\.0\.blocks\.0\.attn\.qkv"
        )
        with pytest.raises(TaskRefused, match=refused) as error:
            petl.MultiTask(backbone, files)
    assert "\n" not in str(error.value)
    backbone = make_tiny_swin(global_pool="max")
    cases = {"vpt": MIXED["vpt"], "vpt_img_pool": MIXED["vpt_img_pool"]}
    singles, files = _save_tasks(tmp_path, cases, backbone)
    with pytest.raises(TaskRefused, match=r"task 'vpt' .*pooling differs.*'max' pooling") as error:
        petl.MultiTask(backbone, files)
    assert "\n" not in str(error.value)
    # Either alone is served.
    for name in cases:
        multi = petl.MultiTask(backbone, {name: files[name]})
        images = torch.randn(2, 3, 32, 32)
        with torch.no_grad():
            torch.testing.assert_close(multi(images, [name, name]), singles[name](images), atol=2e-5, rtol=1e-4)


# --- the prompts' Linears once per image against the reference's once per window --------------------------------


def _per_window_attention(block, grid, prompts):
    # swin_prompts._windowed_attention as KMnP/vpt runs it (src/models/vit_prompt/swin_transformer.py L398-419,
    # L459-522), each image's prompts in its own windows: the prompts copied into every window before qkv, each
    # prompt's rows averaged over the windows after proj.
    b, h, w, c = grid.shape
    n, attn = prompts.shape[1], block.attn
    (win_h, win_w), (shift_h, shift_w) = block.window_size, block.shift_size
    shifted = F.pad(torch.roll(grid, (-shift_h, -shift_w), (1, 2)), (0, 0, 0, -w % win_w, 0, -h % win_h))
    windows = window_partition(shifted, block.window_size).view(-1, win_h * win_w, c)
    per_image = windows.shape[0] // b
    x = torch.cat([prompts.repeat_interleave(per_image, dim=0), windows], dim=1)
    rows, tokens, _ = x.shape
    q, k, v = attn.qkv(x).reshape(rows, tokens, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
    pad = (n, 0, n, 0)
    bias = F.pad(attn._get_rel_pos_bias(), pad)
    if block.attn_mask is not None:
        mask = F.pad(block.attn_mask, pad).view(1, per_image, 1, tokens, tokens)
        bias = (bias.unsqueeze(1) + mask).expand(b, -1, -1, -1, -1).reshape(rows, -1, tokens, tokens)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=attn.scale)
    out = attn.proj_drop(attn.proj(out.transpose(1, 2).reshape(rows, tokens, -1)))
    prompts_out = out[:, :n].reshape(b, per_image, n, c).mean(dim=1)
    out = window_reverse(out[:, n:].reshape(-1, win_h, win_w, c), block.window_size, *shifted.shape[1:3])
    return torch.roll(out[:, :h, :w], (shift_h, shift_w), (1, 2)), prompts_out


def _logits_and_prompt_grads(model, images, seed=0):
    model.zero_grad()
    torch.manual_seed(seed)
    logits = model(images)
    logits.square().sum().backward()
    return logits, [b.prompt.grad.clone() for b in _blocks(model) if b.prompt is not None]


def _blocks(model):
    return [b for stage in model.layers for b in stage.blocks]


def _proj_rows(model, images):
    # The token rows the first block's proj takes in one forward (over every call).
    seen = []
    hook = _blocks(model)[0].base.attn.proj.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape))
    with torch.no_grad():
        torch.manual_seed(0)
        model(images)
    hook.remove()
    return sum(shape[:-1].numel() for shape in seen)


def _spy_prompts_apart(monkeypatch) -> list[int]:
    """The prompt counts :func:`swin_prompts._prompts_apart` is called with, from now on."""
    calls, original = [], swin_prompts._prompts_apart

    def spy(attn, windows, prompts, mask):
        calls.append(prompts.shape[1])
        return original(attn, windows, prompts, mask)

    monkeypatch.setattr(swin_prompts, "_prompts_apart", spy)
    return calls


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("size", [32, 24], ids=["grid8", "grid6-padded"])
@pytest.mark.parametrize("deep, n", [(False, 5), (True, 5), (False, 20), (True, 20)], ids=lambda v: str(v))
def test_vpt_on_swin_prompt_linears_once_per_image_equal_once_per_window(monkeypatch, deep, n, size, mode):
    # Grid 8 in 4x4 windows: four windows an image, the odd block shifted (its mask padded); grid 6: padded to 8 and
    # shifted; the last stage one window.  Train mode with every dropout off (drop_path 0) takes the fast path too.
    # 20 prompts outnumber a window's 16 tokens: in the first stage's four windows their attention among themselves
    # is computed once per image (_prompts_apart); 5 do not, nor does the last stage's single window.
    model = petl.apply_vpt(make_tiny_swin(img_size=size, drop_path_rate=0.0), num_tokens=n, deep=deep)
    model.train(mode == "train")
    assert [b.base.window_size for b in _blocks(model)] == [(4, 4)] * 2 + [((size // 4 + 1) // 2,) * 2] * 2
    assert [b.base.shift_size for b in _blocks(model)] == [(0, 0), (2, 2), (0, 0), (0, 0)]
    images = torch.randn(3, 3, size, size, generator=torch.Generator().manual_seed(2))
    apart = _spy_prompts_apart(monkeypatch)
    logits, grads = _logits_and_prompt_grads(model, images)
    assert apart == ([n, n] if n >= 16 else [])
    # The fast path's proj: every window's own tokens and n prompt rows per image, not n per window.
    assert _proj_rows(model, images) == 3 * 4 * 16 + 3 * n
    monkeypatch.setattr(swin_prompts, "_windowed_attention", _per_window_attention)
    assert _proj_rows(model, images) == 3 * 4 * (16 + n)
    expected_logits, expected_grads = _logits_and_prompt_grads(model, images)
    torch.testing.assert_close(logits, expected_logits)
    assert len(grads) == (4 if deep else 1)
    for got, expected in zip(grads, expected_grads, strict=True):
        assert got.abs().sum() > 0
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("shifted", [False, True])
def test_prompts_apart_equals_the_prompts_in_every_window(shifted):
    # The attention itself, on inputs large enough that every part of the softmax counts: random windows and prompts,
    # a relative-position bias, the shifted block's mask; outputs (the prompt rows averaged over the windows) and
    # gradients of both ways equal up to rounding.
    block = make_tiny_swin(drop_path_rate=0.0).layers[0].blocks[int(shifted)]
    attn = block.attn
    with torch.no_grad():  # scores of a few units: softmaxes neither flat nor one-hot
        attn.relative_position_bias_table.normal_(0, 1, generator=torch.Generator().manual_seed(0))
        attn.qkv.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    windows = (3 * torch.randn(3 * 4, 16, attn.qkv.in_features, generator=gen)).requires_grad_()
    prompts = (3 * torch.randn(3, 20, attn.qkv.in_features, generator=gen)).requires_grad_()
    mask = block.attn_mask
    assert (mask is not None) == shifted
    outputs, grads = [], []
    for apart in (True, False):
        if apart:
            got = swin_prompts._prompts_apart(attn, windows, prompts, mask)
        else:
            got = swin_prompts._prompts_in_every_window(attn, windows, prompts, mask, 0.0)
            got = got[0], got[1].mean(dim=1)  # the prompt rows averaged over the windows
        weights = [torch.randn(t.shape, generator=torch.Generator().manual_seed(i)) for i, t in enumerate(got)]
        sum((t * w).sum() for t, w in zip(got, weights, strict=True)).backward()
        outputs.append(got)
        grads.append((windows.grad.clone(), prompts.grad.clone(), attn.qkv.weight.grad.clone()))
        windows.grad, prompts.grad, attn.qkv.weight.grad = None, None, None
    assert outputs[0][1].std() > 0.2  # the averaged prompt rows are not all alike
    for got, expected in zip([*outputs[0], *grads[0]], [*outputs[1], *grads[1]], strict=True):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def _proj_drop(model, p):
    for block in _blocks(model):
        block.base.attn.proj_drop = torch.nn.Dropout(p)


def _lora_proj(model):
    for block in _blocks(model):
        proj = block.base.attn.proj
        block.base.attn.proj = LoraLinear(proj, {"proj": (0, proj.out_features)}, rank=2, alpha=2.0, dropout=0.0)
        torch.nn.init.normal_(block.base.attn.proj.lora_b["proj"])


@pytest.mark.parametrize("n", [5, 20])
@pytest.mark.parametrize(
    "change, mode",
    [(lambda m: _proj_drop(m, 0.5), "train"), (_lora_proj, "eval")],
    ids=["proj_drop-in-training", "lora-wrapped-proj"],
)
def test_vpt_on_swin_averages_after_proj_where_before_would_not_be_exact(monkeypatch, change, mode, n):
    # A dropout draws a mask per prompt copy, and a wrapper is not known to be affine: proj then runs on every
    # window's prompt rows and the average follows, as the reference does, on the same random draws (with 20
    # prompts too, whose rows _prompts_apart gives).
    model = petl.apply_vpt(make_tiny_swin(drop_path_rate=0.0), num_tokens=n, deep=True)
    change(model)
    model.train(mode == "train")
    images = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    assert _proj_rows(model, images) == 3 * 4 * (16 + n)
    logits, grads = _logits_and_prompt_grads(model, images)
    monkeypatch.setattr(swin_prompts, "_windowed_attention", _per_window_attention)
    expected_logits, expected_grads = _logits_and_prompt_grads(model, images)
    torch.testing.assert_close(logits, expected_logits)
    for got, expected in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, expected)
    # The dropout acts (so the path it takes matters): another draw gives other logits.
    if mode == "train":
        assert not torch.allclose(logits, _logits_and_prompt_grads(model, images, seed=1)[0])


@pytest.fixture(scope="module")
def swin_tiny() -> torch.nn.Module:
    with torch.device("meta"):
        return timm.create_model("swin_tiny_patch4_window7_224", pretrained=False)


@pytest.mark.parametrize("deep", [False, True], ids=["shallow", "deep"])
def test_vpt_on_swin_tiny_counts_the_references_tensors(swin_tiny, deep):
    # KMnP/vpt@4410440 src/models/vit_prompt/swin_transformer.py L128-157 on swin_tiny (embed_dim 96, depths
    # 2, 2, 6, 2): prompt_embeddings (1, 10, 96), and for deep deep_prompt_embeddings_0 (1, 10, 96), _1 (2, 10, 192),
    # _2 (6, 10, 384), _3 (2, 10, 768).
    shapes = [(1, 10, 96)] + ([(1, 10, 96), (2, 10, 192), (6, 10, 384), (2, 10, 768)] if deep else [])
    expected = sum(a * b * c for a, b, c in shapes)
    model = petl.apply_vpt(copy.deepcopy(swin_tiny), num_tokens=10, deep=deep)
    assert petl.count_params(model).trainable_no_head == expected == (44_160 if deep else 960)
