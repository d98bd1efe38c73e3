"""GPS (and the rest of issue 23's methods) against small re-implementations of their references.

Each reference function below is written from reading the reference code (file:line in the method modules)
and run on the very tensors petl's modules hold.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import perturb_trainable

import petl
from petl.methods.gps import GpsConfig, GpsLinear, gps_gradients, select_gps, selected_weights, supcon_loss
from petl.model.backbone import backbone_of, unwrap

# --- GPS ---------------------------------------------------------------------------------------


def _reference_supcon(features: torch.Tensor, labels: torch.Tensor, temperature: float = 0.07) -> torch.Tensor:
    # FightingFighting/GPS@72e0c31 utils/loss_utils.py L17-97, contrast_mode "all", base_temperature 0.07.
    features = F.normalize(features, dim=2)
    batch, count = features.shape[:2]
    mask = torch.eq(labels.view(-1, 1), labels.view(1, -1)).float()
    contrast = torch.cat(torch.unbind(features, dim=1), dim=0)
    logits = torch.div(contrast @ contrast.T, temperature)
    logits = logits - logits.max(dim=1, keepdim=True)[0].detach()
    mask = mask.repeat(count, count)
    logits_mask = torch.scatter(torch.ones_like(mask), 1, torch.arange(batch * count).view(-1, 1), 0)
    mask = mask * logits_mask
    log_prob = logits - torch.log((torch.exp(logits) * logits_mask).sum(1, keepdim=True))
    mean_log_prob_pos = (mask * log_prob).sum(1) / mask.sum(1)
    return (-(temperature / 0.07) * mean_log_prob_pos).view(count, batch).mean()


def test_gps_supcon_equals_the_reference():
    gen = torch.Generator().manual_seed(0)
    features, labels = torch.randn(6, 2, 16, generator=gen), torch.tensor([0, 1, 0, 2, 1, 0])
    torch.testing.assert_close(supcon_loss(features, labels), _reference_supcon(features, labels))


def _reference_mask(grad: np.ndarray, times_para: int) -> np.ndarray:
    # utils/pruning.py L14-28: per row, the argsort of |grad| picks the top times_para entries; 1 = frozen.
    mask = np.ones_like(grad)
    for ind in range(times_para):
        max_index = np.abs(grad).argsort(1)[:, -(ind + 1)]
        one_hot = ~np.eye(max(grad.shape))[max_index][:, : grad.shape[1]].astype(bool)
        mask = (mask.astype(int) & one_hot.astype(int)).astype(np.float32)
    return mask


@pytest.mark.parametrize("per_row", [1, 2])
def test_gps_selection_is_the_references_top_gradient_entries_per_row(tiny_vit, per_row):
    gen = torch.Generator().manual_seed(0)
    loader = [(torch.randn(6, 3, 32, 32, generator=gen), torch.tensor([0, 1] * 3)) for _ in range(2)]
    torch.manual_seed(0)
    grads = gps_gradients(tiny_vit(), loader)
    torch.manual_seed(0)
    selection = select_gps(tiny_vit(), loader, per_row=per_row)
    for text, grad in zip(selection, grads, strict=True):
        chosen = np.zeros(grad.shape, dtype=bool)
        columns = np.array([int(c) for c in text.split(",")]).reshape(grad.shape[0], per_row)
        np.put_along_axis(chosen, columns, True, axis=1)
        assert (chosen == (_reference_mask(grad.double().numpy(), per_row) == 0)).all()


def test_gps_gradients_leave_the_backbone_as_they_found_it(tiny_vit):
    model = tiny_vit().eval()
    model.blocks[0].attn.qkv.weight.requires_grad_(False)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    gps_gradients(model, [(torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 0, 1]))])
    assert not model.training and not model.blocks[0].attn.qkv.weight.requires_grad
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(t, model.state_dict()[n]) for n, t in before.items())


def _gps_reference_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The dense weights GPS's in-place training would hold: each selected entry W[r, c] += delta[r, k]."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, GpsLinear):
            weight = module.base.weight.detach().clone().flatten(1)
            for r in range(weight.shape[0]):
                for k in range(module.index.shape[1]):
                    weight[r, module.index[r, k]] += module.delta[r, k].detach()
            out[name] = weight.view_as(module.base.weight)
    return out


def test_gps_forward_equals_the_reference_on_identical_weights(tiny_vit, images):
    model = petl.apply_gps(tiny_vit(), per_row=2, num_classes=4)
    perturb_trainable(model)
    reference = tiny_vit()
    reference.reset_classifier(4)
    reference.load_state_dict({n.replace(".base.", "."): t for n, t in model.state_dict().items()}, strict=False)
    with torch.no_grad():
        for name, weight in _gps_reference_weights(model).items():
            reference.get_submodule(name.replace(".base", "")).weight.copy_(weight)
    torch.testing.assert_close(model.eval()(images), reference.eval()(images))


def test_gps_adam_step_equals_the_references_masked_gradient_step(tiny_vit, images):
    # utils/cuda.py L20-30: the reference zeroes the gradient of every unselected entry, then Adam steps
    # (weight decay 0 in every GPS script); petl's sparse delta must end at the same weights.
    model = petl.apply_gps(tiny_vit(), per_row=2, num_classes=4)
    reference = tiny_vit()
    reference.reset_classifier(4)
    reference.load_state_dict({n.replace(".base.", "."): t for n, t in model.state_dict().items()}, strict=False)
    masks = {name.replace(".base", ""): torch.ones_like(w) for name, w in _gps_reference_weights(model).items()}
    for name, module in model.named_modules():
        if isinstance(module, GpsLinear):
            masks[name].flatten(1).scatter_(1, module.index, 0.0)
    target = torch.tensor([0, 3])
    ours = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    theirs = torch.optim.Adam(reference.parameters(), lr=1e-2)
    for _ in range(2):
        ours.zero_grad()
        F.cross_entropy(model.train()(images), target).backward()
        ours.step()
        theirs.zero_grad()
        F.cross_entropy(reference.train()(images), target).backward()
        for name, param in reference.named_parameters():
            frozen = "norm" in name or "pos_embed" in name or "cls_token" in name
            if frozen:
                param.grad.zero_()
            elif name.endswith(".weight") and name[: -len(".weight")] in masks:
                param.grad.masked_fill_(masks[name[: -len(".weight")]] == 1, 0.0)
        theirs.step()
    torch.testing.assert_close(model.eval()(images), reference.eval()(images))
    for name, weight in _gps_reference_weights(model).items():
        torch.testing.assert_close(weight, reference.get_submodule(name.replace(".base", "")).weight)


def test_gps_vit_base_count(vit_base):
    # 12 x (2304 + 768 + 3072 + 768) rows + 768 patch-embedding rows, one entry each, and as many biases.
    count = petl.get_method("gps").trainable_formula(vit_base, GpsConfig())
    assert count == 2 * (12 * 6912 + 768) == 167_424
    model = petl.apply(copy.deepcopy(vit_base), "gps", num_classes=100)
    assert petl.count_params(model).trainable_no_head == count


def test_gps_rejects_a_selection_that_does_not_fit(tiny_vit):
    good = GpsConfig(per_row=1)
    n = len(selected_weights(tiny_vit()))
    with pytest.raises(ValueError, match="selection lists 2 weights"):
        petl.apply_gps(tiny_vit(), selection=["0", "1"])
    rows = [w.shape[0] for w in selected_weights(tiny_vit())]
    bad = [",".join(["0"] * r) for r in rows]
    bad[1] = ",".join(["999"] * rows[1])
    with pytest.raises(ValueError, match=r"selection\[1\] has a column outside"):
        petl.apply_gps(tiny_vit(), selection=bad)
    with pytest.raises(ValueError, match="per_row"):
        petl.apply_gps(tiny_vit(), per_row=0)
    assert len(good.columns_for(tiny_vit())) == n
    assert isinstance(backbone_of(petl.apply_gps(tiny_vit())).patch_proj(), GpsLinear)


# --- init=reference: as the references' code really starts ----------------------------------------


def _reference_redrawn(model: torch.nn.Module, method: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(tensors the reference's init_weights re-draws with trunc_normal(0.02), biases it zeroes) for ``method``."""
    from petl.methods.adapter import ParallelAdapter, SequentialAdapter
    from petl.methods.convpass import ConvpassParallel
    from petl.methods.fact import FactLinear
    from petl.methods.lora import LoraLinear
    from petl.methods.noah import NoahBlock, NoahQkv

    weights, biases = [], []
    for m in model.modules():
        if isinstance(m, (SequentialAdapter, ParallelAdapter, ConvpassParallel)):
            weights += [m.down.weight, m.up.weight]
            biases += [m.down.bias, m.up.bias]
        elif isinstance(m, LoraLinear):
            weights += [*m.lora_a.values(), *m.lora_b.values()]
        elif isinstance(m, FactLinear):
            weights += [m.shared.u, m.shared.v] if "shared" in m._modules else []
            weights += [m.cores] if m.cores is not None else []
        elif isinstance(m, NoahQkv):
            weights += [m.lora_a, m.lora_b]
        elif isinstance(m, NoahBlock) and m.down is not None:
            weights += [m.down.weight, m.up.weight]
            biases += [m.down.bias, m.up.bias]
    return weights, biases


@pytest.mark.parametrize(
    ("method", "options"),
    [
        # V-PETL Bench: vision_transformer_adapter.py L200-214 then init_weights (L385, L484-489).
        ("adapter", {"dim": 64}),
        # vision_transformer_adaptformer.py L218-230 then init_weights (L407).
        ("adapter", {"style": "parallel", "dim": 64}),
        # vision_transformer_lora.py L100-108 then init_weights (L287, L364-369).
        ("lora", {"rank": 16, "targets": ["q", "v"]}),
        # PETL_Vision model/convpass.py L10-20, model/fact.py L16-39, then timm 0.9.12's init_weights.
        ("convpass", {"dim": 16}),
        ("fact", {"type": "tt", "rank": 16}),
        # NOAH supernet_vision_transformer_timm.py L224-228 (LoRA_a, LoRA_b nn.Linear) and adapter_super.py
        # L32-45 (ln1, ln2), then init_weights (L462, L520-531, _init_vit_weights L664-688).
        ("noah", {"prompt": [10, 5, 0], "lora": [10, 1, 5], "adapter": [5, 10, 10]}),
    ],
)
def test_init_reference_redraws_what_the_references_init_weights_redraws(tiny_vit, method, options):
    torch.manual_seed(0)
    model = petl.apply(tiny_vit(embed_dim=96), method, init="reference", **options)
    weights, biases = _reference_redrawn(model, method)
    assert weights
    values = torch.cat([w.detach().flatten() for w in weights])
    assert values.std().item() == pytest.approx(0.02, rel=0.1) and values.abs().max() < 0.02 * 6
    assert all(b.abs().sum() == 0 for b in biases)
    zero = petl.apply(tiny_vit(embed_dim=96), method, **options)
    assert torch.cat([w.detach().flatten() for w in _reference_redrawn(zero, method)[0]]).abs().min() == 0


def test_init_reference_leaves_what_the_references_keep(tiny_vit):
    from petl.methods.convpass import ConvpassParallel
    from petl.methods.fact import FactLinear

    # timm's init_weights re-draws nn.Linear only: Convpass's conv keeps its identity init, FacT's P its own.
    conv = next(
        m for m in petl.apply_convpass(tiny_vit(), init="reference").modules() if isinstance(m, ConvpassParallel)
    )
    assert torch.equal(conv.conv.weight[:, :, 1, 1], torch.eye(conv.conv.weight.shape[0]))
    torch.manual_seed(1)
    ours = [m.p for m in petl.apply_fact(tiny_vit(), init="reference").modules() if isinstance(m, FactLinear)]
    torch.manual_seed(1)
    theirs = [m.p for m in petl.apply_fact(tiny_vit()).modules() if isinstance(m, FactLinear)]
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    with pytest.raises(ValueError, match="init='random'"):
        petl.apply_lora(tiny_vit(), init="random")


# --- NOAH --------------------------------------------------------------------------------------


def _noah_reference(model: torch.nn.Module, images: torch.Tensor, widths, drop: float = 0.0) -> torch.Tensor:
    # ZhangYuanhan-AI/NOAH@e9c55f3 model/supernet_vision_transformer_timm.py: forward_features L625-648 (model-level
    # prompts + their position embedding appended after the patches; final norm; class token), Block.forward
    # L354-366 (own prompts replace the previous block's last `sample_last_prompt_tuning_dim` tokens, or are
    # appended when that is 0; L605: block 0's is its own width), Attention.forward L272-297 (LoRA on q, k, v,
    # no scaling), adapter_super.py L62-74 (h + up(dropout(QuickGELU(down(h))))).  ``drop`` > 0: train mode, NOAH's
    # three dropouts in its order: the prompts after their expansion to the batch (L357-359), the LoRA input (L278),
    # the adapter's hidden (adapter_super.py L70); the frozen block's own dropouts and drop path are 0 here.
    from petl.methods.noah import NoahBlock

    prompt, lora, adapter = widths
    blocks = [b for b in model.blocks if isinstance(b, NoahBlock)]
    x = model.patch_embed(images)
    x = torch.cat([model.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + model.pos_embed
    if prompt[0] != 0:  # model-level prompts: random here (off the global stream), to show block 0 replaces them
        noise = torch.randn(x.shape[0], prompt[0], x.shape[2], generator=torch.Generator().manual_seed(9))
        x = torch.cat([x, noise], dim=1)
    for i, wrapper in enumerate(blocks):
        blk = wrapper.base
        last = prompt[i - 1] if i > 0 else prompt[0]
        if prompt[i] != 0:
            own = F.dropout(wrapper.prompt[: prompt[i]].expand(x.shape[0], -1, -1), drop, training=drop > 0)
            x = torch.cat([x, own], dim=1) if last == 0 else torch.cat([x[:, :-last], own], dim=1)
        h = blk.norm1(x)
        b, n, c = h.shape
        heads = blk.attn.num_heads
        qkv_linear = unwrap(blk.attn.qkv)
        qkv = F.linear(h, qkv_linear.weight, qkv_linear.bias)
        if lora[i]:
            lora_input = F.dropout(h, drop, training=drop > 0)
            delta = F.linear(F.linear(lora_input, blk.attn.qkv.lora_a), blk.attn.qkv.lora_b)
            qkv = qkv + delta
        q, k, v = qkv.reshape(b, n, 3, heads, c // heads).permute(2, 0, 3, 1, 4)
        attn = (q @ k.transpose(-2, -1) * (c // heads) ** -0.5).softmax(-1)
        x = x + blk.attn.proj((attn @ v).transpose(1, 2).reshape(b, n, c))
        m = blk.mlp(blk.norm2(x))
        if adapter[i]:
            z = F.linear(m, wrapper.down.weight, wrapper.down.bias)
            z = F.dropout(z * torch.sigmoid(1.702 * z), drop, training=drop > 0)
            m = m + F.linear(z, wrapper.up.weight, wrapper.up.bias)
        x = x + m
    return model.head(model.norm(x)[:, 0])


@pytest.mark.parametrize(
    "widths",
    [
        ((10, 5, 10), (10, 1, 5), (5, 10, 10)),  # every module in every block, as NOAH's VTAB subnets
        ((2, 0, 3), (0, 2, 1), (3, 0, 0)),  # a block without prompts: the earlier ones stay, the next appends
        ((0, 4, 4), (1, 0, 0), (0, 0, 2)),
    ],
)
def test_noah_forward_equals_the_reference_on_identical_weights(tiny_vit, images, widths):
    prompt, lora, adapter = widths
    model = petl.apply_noah(tiny_vit(), prompt=prompt, lora=lora, adapter=adapter, num_classes=4)
    perturb_trainable(model)
    model.eval()
    expected = _noah_reference(model, images, widths)
    torch.testing.assert_close(model(images), expected)
    # Train mode (dropout 0.1 on the prompts, the LoRA input and the adapter): the same masks, drawn in the same order.
    model.train()
    torch.manual_seed(3)
    got = model(images)
    torch.manual_seed(3)
    torch.testing.assert_close(got, _noah_reference(model, images, widths, drop=0.1))
    assert not torch.allclose(got, expected)


def test_noah_init_is_a_slice_of_the_supernets(tiny_vit):
    # L317-319: prompts xavier over [1, 100, d]; adapter_super.py L38-45: xavier weights over the 100-wide
    # Linears, normal(1e-6) biases; L224-228: LoRA A kaiming-uniform, B zero.
    from petl.methods.noah import NoahBlock

    torch.manual_seed(0)
    d = 96
    model = petl.apply_noah(tiny_vit(embed_dim=d), prompt=[100] * 3, lora=[100] * 3, adapter=[100] * 3)
    block = next(b for b in model.blocks if isinstance(b, NoahBlock))
    assert (
        block.prompt.abs().max() <= (6 / (101 * d)) ** 0.5 and block.prompt.abs().max() > 0.9 * (6 / (101 * d)) ** 0.5
    )
    bound = (6 / (d + 100)) ** 0.5
    assert 0.9 * bound < block.down.weight.abs().max() <= bound and block.up.bias.abs().max() < 1e-5
    qkv = block.base.attn.qkv
    assert qkv.lora_b.abs().sum() == 0 and 0 < qkv.lora_a.abs().max() <= 1 / d**0.5


def test_noah_init_reference_starts_as_noahs_code_runs(tiny_vit, images):
    # init_weights (L462) re-draws nn.Linear only: LoRA B is no longer zero, the prompts keep their xavier init;
    # the supernet of the search is built the same way (one constructor for both in NOAH).
    from petl.methods.noah import NoahBlock

    d, widths = 96, {"prompt": [100] * 3, "lora": [100] * 3, "adapter": [100] * 3}
    torch.manual_seed(0)
    block = next(b for b in petl.apply_noah(tiny_vit(embed_dim=d), init="reference", **widths).blocks)
    assert isinstance(block, NoahBlock)
    bound = (6 / (101 * d)) ** 0.5
    assert 0.9 * bound < block.prompt.abs().max() <= bound
    lora_b = block.base.attn.qkv.lora_b
    assert lora_b.abs().min() > 0 and float(lora_b.detach().std()) == pytest.approx(0.02, rel=0.05)
    assert block.up.bias.abs().sum() == 0 and block.down.bias.abs().sum() == 0
    assert petl.make_config("noah").init == "zero"
    with pytest.raises(ValueError, match="init='xavier'"):
        petl.apply_noah(tiny_vit(), init="xavier", **{k: [1] * 3 for k in widths})


def test_noah_published_subnet_count(vit_base):
    # experiments/NOAH/subnet/VTAB/ViT-B_prompt_cifar100.yaml (RETRAIN): 12 x (prompt d, LoRA 4d per rank,
    # adapter 2da + a + d) on d = 768.
    options = {
        "prompt": [10, 5, 10, 1, 5, 1, 10, 1, 10, 5, 1, 10],
        "lora": [10, 1, 5, 5, 1, 10, 1, 1, 1, 10, 1, 1],
        "adapter": [5, 10, 10, 10, 5, 1, 1, 1, 10, 10, 10, 1],
    }
    count = petl.get_method("noah").trainable_formula(vit_base, petl.make_config("noah", **options))
    assert count == 69 * 768 + 47 * 4 * 768 + sum(2 * 768 * a + a + 768 for a in options["adapter"]) == 320_330
    assert (
        petl.count_params(petl.apply(copy.deepcopy(vit_base), "noah", num_classes=100, **options)).trainable_no_head
        == count
    )


def test_noah_search_returns_a_legal_subnet_and_leaves_the_backbone(tiny_vit, tmp_path, monkeypatch):
    from petl.methods import noah_search
    from petl.methods.noah import NoahConfig, subnet_params

    monkeypatch.setenv("PETL_CACHE_DIR", str(tmp_path))  # the failing search below leaves its progress file

    backbone = tiny_vit()
    before = {n: t.clone() for n, t in backbone.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    loader = [(torch.randn(4, 3, 32, 32, generator=gen), torch.tensor([0, 1, 2, 3])) for _ in range(5)]
    cfg = NoahConfig(num_classes=4, search_epochs=1, search_generations=1, population=4, max_params=4000)
    prompt, lora, adapter = noah_search.search(backbone, cfg, loader, seed=0)
    assert len(prompt) == len(lora) == len(adapter) == 3
    assert subnet_params(48, prompt, lora, adapter) <= 4000
    assert all(set(w) <= {0, *noah_search.SEARCH_WIDTHS} for w in (prompt, lora, adapter))
    assert all(torch.equal(t, backbone.state_dict()[n]) for n, t in before.items())
    assert noah_search.depth_choices(12) == (3, 6, 9, 12)
    with pytest.raises(ValueError, match="max_params=1"):
        noah_search.search(backbone, replace_cfg(cfg, max_params=1), loader, seed=0)


@pytest.mark.parametrize("killed_after", [2, 4], ids=["in-the-supernet", "in-the-evolution"])
def test_a_killed_noah_search_resumes_and_chooses_the_same_subnet(tiny_vit, tmp_path, monkeypatch, killed_after):
    from petl.methods import noah_search
    from petl.methods.noah import NoahConfig

    monkeypatch.setenv("PETL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(noah_search, "SAVE_EVERY_SECONDS", 0.0)  # save after every epoch and generation
    gen = torch.Generator().manual_seed(0)
    loader = [(torch.randn(4, 3, 32, 32, generator=gen), torch.tensor([0, 1, 2, 3])) for _ in range(5)]
    cfg = NoahConfig(num_classes=4, search_epochs=3, search_generations=3, population=4, max_params=4000)
    steps = []

    def counted_loss(*args, **kwargs):
        steps.append(1)
        return F.cross_entropy(*args, **kwargs)

    monkeypatch.setattr(noah_search, "F", SimpleNamespace(cross_entropy=counted_loss))  # counts supernet steps
    finish, finished = noah_search.SearchCheckpoint.finish, []

    def keep_then_finish(checkpoint):
        finished.append(dict(checkpoint.state))
        finish(checkpoint)

    monkeypatch.setattr(noah_search.SearchCheckpoint, "finish", keep_then_finish)
    torch.manual_seed(0)
    whole = noah_search.search(tiny_vit(), cfg, loader, progress=False)
    assert not list(tmp_path.rglob("*.pt"))  # the progress file is removed when the search ends
    per_epoch = len(steps) // 3

    save, saves = noah_search.SearchCheckpoint.save, []

    def save_then_die(checkpoint, **state):
        save(checkpoint, **state)
        saves.append(sorted(state))
        if len(saves) == killed_after:  # 3 supernet epochs, then the first population and 3 generations
            raise KeyboardInterrupt

    monkeypatch.setattr(noah_search.SearchCheckpoint, "save", save_then_die)
    torch.manual_seed(0)
    with pytest.raises(KeyboardInterrupt):
        noah_search.search(tiny_vit(), cfg, loader, progress=False)
    assert len(list(tmp_path.rglob("*.pt"))) == 1
    monkeypatch.setattr(noah_search.SearchCheckpoint, "save", save)
    steps.clear()
    torch.manual_seed(0)
    assert noah_search.search(tiny_vit(), cfg, loader, progress=False) == whole
    assert not list(tmp_path.rglob("*.pt"))
    assert len(steps) == per_epoch * (3 - min(killed_after, 3))  # it went on from the saved epoch
    # The same supernet to the last bit (dropout's draws restored) and the same subnets scored.
    first, again = finished
    assert first["supernet"].keys() == again["supernet"].keys()
    assert all(torch.equal(first["supernet"][name], again["supernet"][name]) for name in first["supernet"])
    assert first["scores"] == again["scores"]


def test_a_noah_search_goes_on_when_it_cannot_save_its_progress(tiny_vit, tmp_path, monkeypatch, caplog):
    from petl.methods import noah_search
    from petl.methods.noah import NoahConfig

    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("PETL_CACHE_DIR", str(tmp_path / "a-file" / "cache"))  # no folder can be made there
    monkeypatch.setattr(noah_search, "SAVE_EVERY_SECONDS", 0.0)
    gen = torch.Generator().manual_seed(0)
    loader = [(torch.randn(4, 3, 32, 32, generator=gen), torch.tensor([0, 1, 2, 3])) for _ in range(5)]
    cfg = NoahConfig(num_classes=4, search_epochs=2, search_generations=1, population=4, max_params=4000)
    assert len(noah_search.search(tiny_vit(), cfg, loader, seed=0, progress=False)) == 3
    assert "cannot save its progress" in caplog.text


def replace_cfg(cfg, **changes):
    import dataclasses

    return dataclasses.replace(cfg, **changes)


# --- prompt dropout: one mask per image -------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "options"),
    [
        # NOAH model/supernet_vision_transformer_timm.py L357-359: expand to the batch, then drop_prompt.
        ("noah", {"prompt": [4, 4, 4], "lora": [0, 0, 0], "adapter": [0, 0, 0]}),
        # KMnP/vpt src/models/vit_prompt/vit.py L82 (shallow) and L114-115 (deep): prompt_dropout(... .expand(B)).
        ("vpt", {"num_tokens": 4}),
        ("vpt", {"num_tokens": 4, "deep": True}),
    ],
    ids=["noah", "vpt_shallow", "vpt_deep"],
)
def test_prompt_dropout_draws_a_mask_per_image(tiny_vit, method, options):
    model = petl.apply(tiny_vit(), method, dropout=0.5, **options).train()
    seen = []
    first = model.blocks[0].base
    first.norm1.register_forward_pre_hook(lambda _module, args: seen.append(args[0]))
    image = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(0)
    model(image.expand(2, -1, -1, -1))
    tokens = seen[0]  # block 0's input: the two rows differ only where the prompt dropout acted
    differs = (tokens[0] != tokens[1]).any(dim=-1)
    prompts = torch.zeros_like(differs)
    where = slice(-4, None) if method == "noah" else slice(1, 5)  # NOAH appends after the patches, VPT after cls
    prompts[where] = True
    assert differs[where].all() and not differs[~prompts].any()
