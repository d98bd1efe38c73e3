"""Your own images as a suite's task: ``petl-bench suite=choose data=folder data.root=PATH`` (or ``data=hf``).

The data becomes the suite's one task, named after the dataset (``folder``, ``hf``), under the suite's own
selection protocol (:mod:`petl.bench.protocol`): every grid point trains on ``train800`` (the training images
less a held-out ``val200``: the data's own validation split, else a seeded, stratified 20 % of each class) and
is scored on ``val200``; the chosen point trains on ``train800val200`` once per seed and the test split is read
once, after the last epoch.  A comparison needs a test split (its numbers rank the methods): data without one
is refused before anything trains, naming the folder to add.

**The data's version.**  Before planning, every image is decoded once and the splits' content fingerprints
(sha256 over each item's path, label and bytes, :class:`petl.data.images.FileListDataset`) are combined into
one.  Runs go to ``runs/bench/<suite>/<task>-<first 12 hex digits>-<setup>/`` unless ``output_dir=`` is given,
so an edited folder gets a folder of its own and the old runs stay as they were; ``data.json`` in the results
folder records the fingerprint, and an ``output_dir=`` holding runs of another version is refused in one
line.  ``<setup>`` is 8 hex digits of what else makes a run another run (:func:`run_setup`: the backbone, its
image size, the epochs, every option but the method's, the data's name and place, the seed and the folder), so
the same images under another backbone or epoch count (the docs' tiny-model example, then the README's
command) get folders of their own too; ``data.json`` records it, and an ``output_dir=`` of another setup is
refused in one line naming what differs.  Every finished run also records its training split's fingerprint
(``inputs`` in ``result.json``), which is checked before the run is counted
(:func:`petl.train.output_dir.check_finished`): a folder holding finished runs of another config is refused
before anything trains, a dry run included, saying what the real run would otherwise fail.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from petl import data as petl_data
from petl.data import TEST, TRAIN, TRAIN_VAL, VAL
from petl.store.files import DamagedFileError, NewerFileError, check_version, write_json
from petl.utils.text import first_line

DATA_FILE = "data.json"
# data.json's format: written by claim_output_dir, read (and checked) by read_record alone.  Records written before
# the field existed hold the same keys and read as version 1.
DATA_VERSION = 1
# How many hex digits of the fingerprint name a results folder: 48 bits, no collision among a user's versions.
SHORT = 12


@dataclass(frozen=True)
class OwnData:
    """The user's data as a suite task: what it is, its version, and what reading it cost.

    Attributes:
        task: the dataset name (``folder``, ``hf``): the task's column and folder in the results.
        root: ``data.root`` as given.
        options: the dataset's own options that are set (``image_column``...).
        fingerprint: sha256 over the fingerprints of ``train800val200`` and ``test``.
        classes: the class names in label order.
        sizes: images per split (``train800``, ``val200``, ``train800val200``, ``test``).
        val_from_train: how val200 is held out of the training images, or ``None`` (the data has its own).
        decode_seconds: seconds per image to read, decode and check one image (measured here, for the estimate).

    """

    task: str
    root: str
    options: dict[str, Any]
    fingerprint: str
    classes: list[str]
    sizes: dict[str, int]
    val_from_train: str | None
    decode_seconds: float

    @property
    def short(self) -> str:
        """The fingerprint's first digits, as the default results folder shows them."""
        return self.fingerprint[:SHORT]

    def default_output_dir(self, suite: str, setup: dict[str, Any]) -> Path:
        """``runs/bench/<suite>/<task>-<short fingerprint>-<setup key>``: one folder per data version and setup."""
        return Path("runs/bench") / suite / f"{self.task}-{self.short}-{setup_key(setup)}"

    def line(self) -> str:
        """One line saying what the data is."""
        if self.val_from_train:
            images = f"{self.sizes[TRAIN_VAL]} training images (val200 = {self.val_from_train})"
        else:
            # The folder's val/ images score the trials and join the finals' training images: counted apart, not
            # under the protocol's name for its 200-image split (val200), which they are not.
            images = (
                f"{self.sizes[TRAIN]} training images and {self.sizes[VAL]} validation images (its own: the trials "
                f"are scored on them, the final runs train on all {self.sizes[TRAIN_VAL]})"
            )
        counts = f"{len(self.classes)} classes, {images}, {self.sizes[TEST]} test images"
        return f"data {self.task} {self.root}: {counts}; fingerprint {self.short}"


def is_own_data(name: str) -> bool:
    """Whether dataset ``name`` reads the user's own files (``root`` required): ``folder``, ``hf``."""
    return petl_data.get_info(name).root == "required"


def read_own_data(cfg: Any) -> OwnData:
    """Read the data a composed run config names: its classes, split sizes and fingerprint.

    Every image is decoded once here (as each run will do again), so bad files are named before the
    estimate, let alone training.

    Raises:
        ValueError: not a dataset of the user's own files, no test split, or data the dataset refuses.

    """
    from petl.train import readers  # petl.train imports torch and timm: only a sweep on own data needs it here

    name = str(cfg.data.name)
    if not is_own_data(name):
        raise ValueError(f"data={name}: a registered task; give tasks={name} instead (data= names your own images)")
    info = readers.data_info(cfg)
    options = readers.data_options(cfg)
    if TEST not in info.splits:
        raise ValueError(
            f"data {name} {cfg.data.root}: no test split, so no number could rank the methods on images none of "
            f"them was selected or trained on; add a test split ({Path(str(cfg.data.root)) / 'test'}/<class>/ for "
            "data=folder, a `test` split for data=hf), e.g. a fifth of each class's images"
        )
    sizes, digests, decoded, tick = {}, {}, 0, time.perf_counter()
    for split in (TRAIN, VAL, TRAIN_VAL, TEST):
        dataset = petl_data.build_dataset(name, split, image_size=32, root=cfg.data.root, options=options)
        sizes[split] = min(len(dataset), cfg.data.subset or len(dataset))  # type: ignore[arg-type]
        digests[split] = getattr(dataset, "fingerprint", None) or ""
        decoded += len(dataset)  # type: ignore[arg-type]
    seconds = (time.perf_counter() - tick) / max(1, decoded)
    whole = hashlib.sha256(f"{digests[TRAIN_VAL]}:{digests[TEST]}".encode()).hexdigest()
    classes = list(info.class_names or ())
    return OwnData(name, str(cfg.data.root), options, whole, classes, sizes, info.val_from_train, seconds)


# What does not make a run of the suite another run: the method's options and the search's keys vary per experiment
# and trial inside one folder, the data is keyed by its fingerprint, seeds and folders are the sweep's.
_NOT_SETUP = ("method.", "data.root", "data.name", "seed", "output_dir")


def run_setup(cfg: Any, defaults: Any) -> dict[str, Any]:
    """What makes a suite's run on this data another run: the options ``cfg`` sets away from petl's ``defaults``.

    Args:
        cfg: the suite's config on the data (its overrides and the command line's), before any experiment.
        defaults: petl's own config on the same data (no overrides): an option petl adds later, at its default,
            changes no folder name.

    Returns:
        Dotted key -> value, less :data:`_NOT_SETUP`, sorted.

    """
    from omegaconf import OmegaConf

    from petl.train.output_dir import fingerprint

    chosen, base = (fingerprint(OmegaConf.to_container(c, resolve=True)) for c in (cfg, defaults))  # type: ignore[arg-type]
    return {k: v for k, v in sorted(chosen.items()) if not k.startswith(_NOT_SETUP) and (k not in base or base[k] != v)}


def setup_key(setup: dict[str, Any]) -> str:
    """8 hex digits of a :func:`run_setup`: the last part of the default results folder's name."""
    return hashlib.sha256(json.dumps(setup, sort_keys=True, default=str).encode()).hexdigest()[:8]


def _folder_name(root: str) -> str:
    """The last part of a ``data.root`` (``photos`` of ``./photos/`` and ``/data/photos``; ``name`` of a hub id)."""
    return Path(os.path.normpath(root)).name


def claim_output_dir(output_dir: Path, data: OwnData, setup: dict[str, Any] | None = None) -> None:
    """Record the data's version and the setup in ``output_dir/data.json``; refuse a folder of another one.

    Raises:
        ValueError: ``output_dir`` holds runs of other data, of another version of the data, or of another setup
            (one line, naming both, or up to three keys that differ).

    """
    path = output_dir / DATA_FILE
    record = read_record(output_dir)
    if record is not None:
        recorded = record["fingerprint"]
        if recorded != data.fingerprint:
            # Runs of another folder altogether are named as such, not as an edit of this one.  The folders' names
            # are compared, not their paths: the record's may be relative to another working directory.
            if record["task"] != data.task or _folder_name(record["root"]) != _folder_name(data.root):
                raise ValueError(
                    f"output_dir {output_dir} holds runs on other data ({record['task']} {record['root']}, "
                    f"fingerprint {str(recorded)[:SHORT]}; "
                    f"now {data.task} {data.root}, {data.short}): leave output_dir= out to keep each data set's runs "
                    "in a folder of their own, or choose another output_dir"
                )
            raise ValueError(
                f"output_dir {output_dir} holds runs on another version of {data.root} (fingerprint "
                f"{str(recorded)[:SHORT]}, now {data.short}): leave output_dir= out to keep each version in a "
                "folder of its own, or choose another output_dir"
            )
        old = record.get("setup")
        if setup is not None and isinstance(old, dict) and old != setup:
            keys = sorted(k for k in set(old) | set(setup) if old.get(k) != setup.get(k))
            said = ", ".join(f"{k}: {old.get(k)!r} -> {setup.get(k)!r}" for k in keys[:3])
            raise ValueError(
                f"output_dir {output_dir} holds runs of another setup ({said}{' ...' * (len(keys) > 3)}): leave "
                "output_dir= out to keep each setup in a folder of its own, or choose another output_dir"
            )
        return
    output_dir.mkdir(parents=True, exist_ok=True)
    record = {"version": DATA_VERSION, **{k: v for k, v in asdict(data).items() if k != "decode_seconds"}}
    if setup is not None:
        record["setup"] = setup
    # Whole or not at all: a data.json cut short by a crash would stop every later sweep into this folder.
    write_json(path, record)


def read_record(output_dir: str | Path) -> dict[str, Any] | None:
    """The ``data.json`` of a results folder of own data (checked), or ``None`` when the folder has none.

    Raises:
        ValueError: a file that is not such a record (not JSON, not an object, another version, ``task``,
            ``root`` or ``fingerprint`` missing or not text, ``setup`` not an object): one line naming it.

    """
    path = Path(output_dir) / DATA_FILE
    if not path.is_file():
        return None
    fix = (
        "move it aside and run the folder's `petl-bench ... data=... output_dir=...` command again to write it anew "
        "(finished runs are kept)"
    )
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a data record ({first_line(str(error))}): {fix}") from None
    if not isinstance(record, dict):
        raise ValueError(f"{path}: not a data record (a JSON {type(record).__name__}, not an object): {fix}")
    try:
        check_version(path, record.get("version", DATA_VERSION), DATA_VERSION, "data record")
    except NewerFileError as error:
        raise ValueError(f"{error}: compare and report it with that petl") from None
    except DamagedFileError as error:
        raise ValueError(f"{error}: {fix}") from None
    bad = [key for key in ("task", "root", "fingerprint") if not isinstance(record.get(key), str)]
    if "setup" in record and not isinstance(record["setup"], dict):
        bad.append("setup")
    if bad:
        raise ValueError(f"{path}: not a data record ({', '.join(bad)} missing or malformed): {fix}")
    return record
