"""The real benchmarks: the 19 VTAB-1k tasks (``vtab/<task>``) and the 5 FGVC tasks (``fgvc/<task>``).

Each task loads from one of two places:

* a local folder (``root``), in the layout the field distributes: for VTAB-1k,
  ``<root>/<task>/`` holding the images and ``train800.txt``, ``val200.txt``,
  ``train800val200.txt``, ``test.txt`` with lines ``relative/image/path label``; the task folder
  may carry petl's name (``cifar100``) or the field's (``cifar``, as in the common ``vtab-1k.zip``).
  For FGVC, ``<root>/<task>/`` holding ``train.txt``/``val.txt``/``test.txt`` in the same line
  format, or VPT's ``train.json``/``val.json``/``test.json`` (``{"relative/path": label}``);
* the Hugging Face hub when ``root`` is ``None`` (ids and their verification status are listed in
  ``petl/data/README.md``).  Offline or uncached, that raises :class:`DatasetUnavailableError`
  naming the dataset, the hub id and the local-folder alternative.

FGVC has no fixed 800/200 protocol, so its splits answer to the VTAB names this way:
``train800`` -> train, ``val200`` -> val, ``train800val200`` -> train + val, ``test`` -> test.
Loading checks what can be checked: VTAB-1k split sizes (800/200/1000, unless ``strict=False``
for small test fixtures), labels inside ``[0, num_classes)``, and (strict) that the labels
present cover exactly ``num_classes`` classes.  A local folder lacking its task folder, a list or a listed image is bad
input (``ValueError``, ``petl-run`` exits 2, as for an unreadable image there); petl's unpacked hub copy lacking one is
unavailable data (:class:`DatasetUnavailableError`, exit 1), as is an FGVC hub copy without petl's splits, columns or
class count: the hub ids are petl's, not the user's input, and the remedy is a local copy.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
import zipfile
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from petl.data import hub as hub_access
from petl.data.images import FileListDataset, HubDataset
from petl.data.registry import (
    SPLITS,
    TEST,
    TRAIN,
    TRAIN_VAL,
    VAL,
    BadImagesError,
    DatasetInfo,
    DatasetUnavailableError,
    register_dataset,
)
from petl.data.transforms import ImageSpec
from petl.utils import paths
from petl.utils.text import first_line

VTAB_SIZES = {TRAIN: 800, VAL: 200, TRAIN_VAL: 1000}
VTAB_HUB_ID = "XiN0919/VTAB-1k"
VTAB_HUB_FILE = "vtab-1k.zip"
CACHE_ENV = paths.CACHE_ENV
# Seeded hold-out for hub FGVC copies that publish no validation split (VPT also holds out ~10%).
FGVC_VAL_FRACTION = 0.1
FGVC_VAL_SEED = 0


@dataclass(frozen=True)
class _Task:
    name: str
    group: str
    num_classes: int
    folders: tuple[str, ...]
    source: str
    hub_id: str | None


# Class counts follow VTAB's task definitions (task_adaptation): caltech101 includes the
# background class (102), clevr_dist / kitti_dist / dsprites_* / smallnorb_* are binned factors.
VTAB_TASKS: tuple[_Task, ...] = (
    _Task("cifar100", "natural", 100, ("cifar",), "CIFAR-100", VTAB_HUB_ID),
    _Task("caltech101", "natural", 102, ("caltech101",), "Caltech-101 (with background class)", VTAB_HUB_ID),
    _Task("dtd", "natural", 47, ("dtd",), "Describable Textures", VTAB_HUB_ID),
    _Task("flowers102", "natural", 102, ("oxford_flowers102",), "Oxford Flowers-102", VTAB_HUB_ID),
    _Task("pets", "natural", 37, ("oxford_iiit_pet",), "Oxford-IIIT Pet", VTAB_HUB_ID),
    _Task("svhn", "natural", 10, ("svhn",), "SVHN cropped digits", VTAB_HUB_ID),
    _Task("sun397", "natural", 397, ("sun397",), "SUN397 scenes", VTAB_HUB_ID),
    _Task("patch_camelyon", "specialized", 2, ("patch_camelyon",), "PatchCamelyon histopathology", VTAB_HUB_ID),
    _Task("eurosat", "specialized", 10, ("eurosat",), "EuroSAT RGB satellite", VTAB_HUB_ID),
    _Task("resisc45", "specialized", 45, ("resisc45",), "RESISC45 remote sensing", VTAB_HUB_ID),
    _Task("retinopathy", "specialized", 5, ("diabetic_retinopathy",), "Diabetic retinopathy grades", VTAB_HUB_ID),
    _Task("clevr_count", "structured", 8, ("clevr_count",), "CLEVR object count (3-10)", VTAB_HUB_ID),
    _Task("clevr_dist", "structured", 6, ("clevr_dist",), "CLEVR closest-object distance bins", VTAB_HUB_ID),
    _Task("dmlab", "structured", 6, ("dmlab",), "DeepMind Lab distance to reward", VTAB_HUB_ID),
    _Task("kitti_dist", "structured", 4, ("kitti",), "KITTI closest-vehicle distance bins", VTAB_HUB_ID),
    _Task("dsprites_loc", "structured", 16, ("dsprites_loc",), "dSprites x-position bins", VTAB_HUB_ID),
    _Task("dsprites_ori", "structured", 16, ("dsprites_ori",), "dSprites orientation bins", VTAB_HUB_ID),
    _Task("smallnorb_azi", "structured", 18, ("smallnorb_azi",), "smallNORB azimuth", VTAB_HUB_ID),
    _Task("smallnorb_ele", "structured", 9, ("smallnorb_ele",), "smallNORB elevation", VTAB_HUB_ID),
)

FGVC_TASKS: tuple[_Task, ...] = (
    _Task("cub", "fgvc", 200, ("CUB_200_2011",), "CUB-200-2011 birds", "bentrevett/caltech-ucsd-birds-200-2011"),
    # No public hub copy of NABirds with labels was found: local folder only.
    _Task("nabirds", "fgvc", 555, ("NABirds",), "NABirds", None),
    _Task(
        "flowers",
        "fgvc",
        102,
        ("OxfordFlower", "oxford_flowers102"),
        "Oxford Flowers-102",
        "dpdl-benchmark/oxford_flowers102",
    ),
    _Task("dogs", "fgvc", 120, ("StanfordDogs", "stanford_dogs"), "Stanford Dogs", "maurice-fp/stanford-dogs"),
    _Task(
        "cars",
        "fgvc",
        196,
        ("StanfordCars", "stanford_cars", "Stanford-cars"),
        "Stanford Cars",
        "tanganke/stanford_cars",
    ),
)


# --------------------------------------------------------------------------------------------
# Local folders
# --------------------------------------------------------------------------------------------


def _find_task_dir(info: DatasetInfo, task: _Task, root: Path, markers: Sequence[str]) -> Path:
    """The folder under ``root`` holding ``task``; ``root`` itself counts if it holds the split files under a name of
    the task.

    A task folder of another name given as the root is refused: ``data=vtab/dsprites_ori`` with the root at
    ``.../dsprites_loc`` would train the other task (of the same 16 classes) under this task's name.
    """
    names = list(dict.fromkeys((task.name, *task.folders)))
    for folder in (root / name for name in names):
        if any((folder / m).is_file() for m in markers):
            return folder
    holder = f"give the folder that holds {' or '.join(f'{name}/' for name in names)} as root (data.root)"
    if any((root / m).is_file() for m in markers):
        if Path(os.path.abspath(root)).name.casefold() in {name.casefold() for name in names}:
            return root
        raise ValueError(
            f"{info.name}: root={root} is itself a task folder (it holds {' / '.join(markers)}) but not named "
            f"{' or '.join(names)}: {holder}"
        )
    tried = ", ".join(str(root / name) for name in names)
    raise ValueError(
        f"{info.name}: no task folder found under root={root} (looked for {' / '.join(markers)} in {tried}): {holder}"
    )


def _read_list(path: Path, base: Path) -> list[tuple[Path, int]]:
    """Parse a ``relative/path label`` file; paths may contain spaces, the label is the last field."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark (Windows editors write one) is no part of the first path
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise ValueError(
            f"{path}:{line}: not UTF-8 text (byte {data[error.start]:#04x}): save the list as UTF-8"
        ) from None
    items = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.rsplit(maxsplit=1)
        if len(parts) != 2:
            raise ValueError(f"{path}:{number}: expected 'relative/path label', got {line!r}")
        try:
            label = int(parts[1])
        except ValueError:
            raise ValueError(f"{path}:{number}: label {parts[1]!r} is not an integer") from None
        items.append((base / parts[0], label))
    return items


def _check_labels(info: DatasetInfo, splits: dict[str, list[tuple[Path, int]]], strict: bool) -> None:
    """Labels must index the classes; with ``strict``, together they must cover every class."""
    seen: set[int] = set()
    for split, items in splits.items():
        labels = {label for _, label in items}
        outside = sorted(lb for lb in labels if not 0 <= lb < info.num_classes)
        if outside:
            raise ValueError(
                f"{info.name}: split {split} has labels {outside[:5]} outside [0, {info.num_classes}): "
                "wrong task folder or wrong class count"
            )
        seen |= labels
    if strict and len(seen) != info.num_classes:
        raise ValueError(
            f"{info.name}: the splits hold {len(seen)} distinct labels but the task has {info.num_classes} classes"
        )


def _check_inside(info: DatasetInfo, root: Path, splits: dict[str, list[tuple[Path, int]]]) -> None:
    """Refuse listed paths that leave ``root`` as written (``../``, absolute), before any file is read.

    Judged on the path as written, not resolved: a symlink the dataset itself contains (layouts use them)
    is followed as usual, but a list cannot send a run to read files elsewhere.
    """
    inside = os.path.normpath(os.path.abspath(root))
    outside = {
        path: f"outside data.root {root}: a split list may only name files inside it"
        for items in splits.values()
        for path, _ in items
        if os.path.commonpath([inside, os.path.normpath(os.path.abspath(path))]) != inside
    }
    if outside:
        raise BadImagesError(info.name, sorted(outside.items()))


def _folder_fault(message: str, root: Path | None) -> Exception:
    """A task folder lacking a list or an image: bad input (ValueError, exit 2) in the folder the user gave as
    ``root``, as an unreadable image there is; unavailable data (exit 1) in petl's unpacked hub copy (``root=None``).
    """
    return DatasetUnavailableError(message) if root is None else ValueError(message)


def _check_files(info: DatasetInfo, items: list[tuple[Path, int]], root: Path | None) -> None:
    missing = list(dict.fromkeys(path for path, _ in items if not path.is_file()))
    if missing:
        example = missing[0]
        if "\\" in str(example) and Path(str(example).replace("\\", "/")).is_file():
            # A list written on Windows: its paths' separators are no separators here.
            remedy = "the list writes paths with \\ (Windows): write them with /"
        else:
            remedy = "restore them (unpack the task folder again)"
        raise _folder_fault(f"{info.name}: {len(missing)} listed image file(s) missing, e.g. {example}: {remedy}", root)


def _check_union(info: DatasetInfo, splits: dict[str, list[tuple[Path, int]]]) -> None:
    """Warn when train800val200 cannot be train800 plus val200.

    Two layouts are right: lists of the same image files (train800val200 = the concatenation), or
    NOAH's, the field's standard zip, where every split lists its own copies of the images
    (``images/train800val200/NNNNNN.jpg``; ZhangYuanhan-AI/NOAH@e9c55f3
    data/vtab-source/get_vtab1k.py:L62-77).  Copies cannot be matched by path, so there the check
    is on labels: the same number of images of every class.  A mismatch is suspicious but not
    necessarily wrong, so it warns instead of refusing to run.
    """
    parts, whole = splits[TRAIN] + splits[VAL], splits[TRAIN_VAL]
    if sorted(parts) == sorted(whole):
        return
    part_paths, whole_paths = {path for path, _ in parts}, {path for path, _ in whole}
    same_labels = Counter(label for _, label in parts) == Counter(label for _, label in whole)
    if part_paths.isdisjoint(whole_paths) and same_labels:
        return  # NOAH's layout: its own copies with the same classes
    reason = "lists other labels" if not same_labels else "shares only some image files"
    warnings.warn(f"{info.name}: train800val200.txt is not train800.txt plus val200.txt (it {reason})", stacklevel=4)


def _check_apart(
    info: DatasetInfo,
    folder: Path,
    splits: dict[str, list[tuple[Path, int]]],
    suffix: str,
    pairs: list[tuple[str, str]],
) -> None:
    """Refuse an image listed twice in one split, or in two splits of a pair that must not share one.

    A repeated line passes the size check with an image fewer and trains one image twice; a test image that is
    also a training (or validation) image counts what the run trained on: either is a silently wrong cell.
    Judged by listed path: NOAH's layout gives every split its own files, a same-files layout lists each once.
    """
    for name, items in splits.items():
        counts = Counter(path for path, _ in items)
        twice = [path for path, count in counts.items() if count > 1]
        if twice:
            raise ValueError(
                f"{info.name}: {folder / name}{suffix} lists {len(twice)} image(s) more than once, e.g. {twice[0]}: "
                "list each image once"
            )
    for first, second in pairs:
        shared = {path for path, _ in splits[first]} & {path for path, _ in splits[second]}
        if shared:
            raise ValueError(
                f"{info.name}: {len(shared)} image(s) listed in both {first}{suffix} and {second}{suffix}, e.g. "
                f"{min(shared)}: the splits must not share images"
            )


def _load_vtab_folder(
    info: DatasetInfo, folder: Path, split: str, spec: ImageSpec, strict: bool, root: Path | None = None
) -> Dataset:
    """Read all four split lists, validate them, and return ``split``."""
    splits = {}
    for name in SPLITS:
        path = folder / f"{name}.txt"
        if not path.is_file():
            raise _folder_fault(f"{info.name}: {path} is missing (a VTAB-1k task folder has all four lists)", root)
        splits[name] = _read_list(path, folder)
    if strict:
        for name, expected in VTAB_SIZES.items():
            if len(splits[name]) != expected:
                raise ValueError(
                    f"{info.name}: {folder / name}.txt lists {len(splits[name])} images, VTAB-1k expects {expected}"
                )
        if not splits[TEST]:
            raise ValueError(f"{info.name}: {folder / 'test.txt'} is empty")
        _check_union(info, splits)
        _check_apart(info, folder, splits, ".txt", [(TRAIN, VAL), (TRAIN, TEST), (VAL, TEST), (TRAIN_VAL, TEST)])
    _check_inside(info, root or folder, splits)  # every listed path inside data.root
    _check_labels(info, splits, strict)
    _check_files(info, splits[split], root)
    return FileListDataset(splits[split], spec, name=info.name, folder=folder)


def _read_json_split(path: Path) -> dict[str, int]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start}): save it as UTF-8") from None
    except (ValueError, RecursionError) as error:
        raise ValueError(f"{path}: malformed JSON ({error})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected an object mapping image paths to labels")
    out = {}
    for key, label in data.items():
        try:
            if isinstance(label, bool) or not isinstance(label, int | str):
                raise ValueError
            out[str(key)] = int(label)
        except ValueError:
            raise ValueError(f"{path}: label of {key!r} is {label!r}, not an integer") from None
    return out


def _image_base(folder: Path, relatives: Sequence[str]) -> Path:
    """Where VPT-style relative paths live: the task folder or its images/ subfolder, where the first listed image
    that is there lies (one image missing must not send every other to the wrong folder).
    """
    for relative in relatives:
        for base in (folder, folder / "images", folder / "Images"):
            if (base / relative).is_file():
                return base
    return folder


def _load_fgvc_folder(
    info: DatasetInfo, folder: Path, split: str, spec: ImageSpec, strict: bool, root: Path | None = None
) -> Dataset:
    native = {"train": "train", "val": "val", "test": "test"}
    splits: dict[str, list[tuple[Path, int]]] = {}
    suffix = ".txt"
    if all((folder / f"{n}.txt").is_file() for n in native):
        for n in native:
            splits[n] = _read_list(folder / f"{n}.txt", folder)
    elif all((folder / f"{n}.json").is_file() for n in native):
        suffix = ".json"
        raw = {n: _read_json_split(folder / f"{n}.json") for n in native}
        # VPT's json labels are dataset class ids (1-based for some datasets): map the sorted ids
        # of all splits onto 0..K-1 so that every split shares one mapping.
        ids = sorted({label for split_map in raw.values() for label in split_map.values()})
        contiguous = {class_id: index for index, class_id in enumerate(ids)}
        base = _image_base(folder, [key for split_map in raw.values() for key in split_map])
        for n, split_map in raw.items():
            splits[n] = [(base / rel, contiguous[label]) for rel, label in split_map.items()]
    else:
        lists = [f"{n}.{kind}" for kind in ("txt", "json") for n in native]
        present = [name for name in lists if (folder / name).is_file()]
        kind = "json" if present and all(name.endswith(".json") for name in present) else "txt"
        lacking = [f"{n}.{kind}" for n in native if not (folder / f"{n}.{kind}").is_file()]
        raise ValueError(
            f"{info.name}: {folder} needs train/val/test lists (train.txt, val.txt, test.txt or VPT's *.json); "
            f"it lacks {', '.join(lacking)}"
        )
    _check_inside(info, root or folder, splits)  # every listed path inside data.root
    _check_labels(info, splits, strict)
    if strict:
        _check_apart(info, folder, splits, suffix, [("train", "val"), ("train", "test"), ("val", "test")])
    wanted = {TRAIN: ["train"], VAL: ["val"], TRAIN_VAL: ["train", "val"], TEST: ["test"]}[split]
    items = [item for n in wanted for item in splits[n]]
    _check_files(info, items, root)
    return FileListDataset(items, spec, name=info.name, folder=folder)


# --------------------------------------------------------------------------------------------
# Hugging Face hub
# --------------------------------------------------------------------------------------------


def _cache_dir() -> Path:
    return paths.cache_dir()


def _unavailable(
    info: DatasetInfo, task: _Task, layout: str, error: BaseException | None = None, why: str | None = None
) -> DatasetUnavailableError:
    """The one message users see when the hub cannot provide a dataset (``why``, when it is not out of reach)."""
    reason = ""
    if error is not None:
        reason = f" ({type(error).__name__}: {first_line(error)[:200]})"
    if why is not None:
        hub = why
    elif info.hub_id:
        hub = f"the Hugging Face hub dataset {info.hub_id!r} is not reachable or not cached{reason}"
    else:
        hub = "no public Hugging Face hub copy is known"
    # Once each: most tasks' zip folder bears petl's short name ("<root>/dtd/ or <root>/dtd/").
    folders = " or ".join(f"<root>/{f}/" for f in dict.fromkeys((task.name, *task.folders)))
    return DatasetUnavailableError(
        f"{info.name} is unavailable: {hub}. Use a local copy instead: pass root=/path "
        f"(command line: data.root=/path) where {folders} holds {layout}."
    )


_VTAB_LAYOUT = "the images and train800.txt, val200.txt, train800val200.txt, test.txt (lines 'relative/path label')"
_FGVC_LAYOUT = "the images and train.txt, val.txt, test.txt (lines 'relative/path label') or VPT's train/val/test.json"


def _vtab_from_hub(info: DatasetInfo, task: _Task) -> Path:
    """Fetch the field's VTAB-1k archive from the hub (once) and unpack this task's folder.

    The public copy is one zip of every task in the ``<task>/train800.txt ...`` layout, so the
    hub path ends in the same local-folder loader; only the task's own files are extracted.
    """
    target_root = _cache_dir() / "vtab-1k"
    for name in (task.name, *task.folders):
        if (target_root / name / "train800.txt").is_file():
            return target_root / name
    try:
        from huggingface_hub import hf_hub_download

        with hub_access.offline_unless_reachable():  # offline: fail at once, not after half a minute of retries
            archive = hf_hub_download(repo_id=VTAB_HUB_ID, filename=VTAB_HUB_FILE, repo_type="dataset")
    except Exception as error:  # network, offline and cache errors come in many types
        raise _unavailable(info, task, _VTAB_LAYOUT, error) from None
    try:
        return _unpack(info, task, Path(archive), target_root)
    except (zipfile.BadZipFile, zlib.error, EOFError) as error:  # the cached download cut short or damaged
        raise DatasetUnavailableError(
            f"{info.name}: the downloaded {archive} is damaged ({first_line(error, type(error).__name__)}): delete it "
            "to download it again, or pass root=/path (command line: data.root=/path) to a local copy"
        ) from None


def _unpack(info: DatasetInfo, task: _Task, archive: Path, target_root: Path) -> Path:
    """Unpack ``task``'s folder of the VTAB-1k ``archive`` into ``target_root``; the folder it made.

    Raises:
        DatasetUnavailableError: the archive holds no folder of the task, or a path outside it.
        zipfile.BadZipFile: the archive is damaged (zlib.error and EOFError for a member cut short).

    """
    with zipfile.ZipFile(archive) as bundle:
        prefix = None
        for member in bundle.namelist():
            parts = member.split("/")
            if parts[-1] == "train800.txt" and len(parts) >= 2 and parts[-2] in (task.name, *task.folders):
                prefix = member[: -len("train800.txt")]
                break
        if prefix is None:
            raise DatasetUnavailableError(f"{info.name}: {VTAB_HUB_ID}/{VTAB_HUB_FILE} holds no folder for this task")
        destination = target_root / prefix.rstrip("/").split("/")[-1]
        # A folder of this extraction's own: two processes unpacking one task at once (two sweeps side by side)
        # must neither delete nor write into each other's half-unpacked folder.
        target_root.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f"{destination.name}.partial-", dir=target_root))
        try:
            for member in bundle.namelist():
                if not member.startswith(prefix) or member.endswith("/"):
                    continue
                out = (partial / member[len(prefix) :]).resolve()
                # A crafted archive could name ../ paths; never write outside the task folder.
                if partial.resolve() not in out.parents:
                    raise DatasetUnavailableError(f"{info.name}: unsafe path {member!r} in {VTAB_HUB_FILE}")
                out.parent.mkdir(parents=True, exist_ok=True)
                with bundle.open(member) as source, out.open("wb") as sink:
                    while chunk := source.read(1 << 20):
                        sink.write(chunk)
            umask = os.umask(0)  # mkdtemp makes the folder private (0700); give it what a plain mkdir would
            os.umask(umask)
            partial.chmod(0o777 & ~umask)
            # Rename last, so an interrupted extraction is never mistaken for a complete folder.
            try:
                partial.rename(destination)
            except OSError:
                if not (destination / "train800.txt").is_file():
                    raise
                # Another process unpacked the task first (renamed last, so whole): its folder is as good.
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    return destination


def find_column(features: Any, kind: str, fallbacks: Sequence[str]) -> str:
    """The first column of a ``datasets`` feature type ``kind`` (``Image``, ``ClassLabel``), else of a fallback name."""
    for column, feature in features.items():
        if type(feature).__name__ == kind:
            return column
    for column in fallbacks:
        if column in features:
            return column
    raise ValueError(f"no {kind} column among {list(features)}")


def _fgvc_from_hub(info: DatasetInfo, task: _Task, split: str, spec: ImageSpec) -> Dataset:
    if info.hub_id is None:
        raise _unavailable(info, task, _FGVC_LAYOUT)
    with hub_access.datasets_quiet_until_accepted():  # datasets' lines only once the copy is accepted
        pools, image_column, label_column = _fgvc_hub_pools(info, task)
    if split == TRAIN_VAL:
        parts = [HubDataset(*pools[n], image_column, label_column, spec) for n in ("train", "val")]
        return torch.utils.data.ConcatDataset(parts)
    native = {TRAIN: "train", VAL: "val", TEST: "test"}[split]
    return HubDataset(*pools[native], image_column, label_column, spec)


def _fgvc_hub_pools(info: DatasetInfo, task: _Task) -> tuple[dict[str, tuple[Any, Sequence[int]]], str, str]:
    """The hub copy's train / val / test rows (a split and its row indices), image and label columns, checked."""
    try:
        import datasets

        with hub_access.offline_unless_reachable():  # offline: fail at once, not after half a minute of retries
            hub = datasets.load_dataset(info.hub_id)
    except Exception as error:  # network, offline and cache errors come in many types
        raise _unavailable(info, task, _FGVC_LAYOUT, error) from None
    # petl's own hub id, not the user's input: a copy that has changed upstream is data out of reach here (exit 1, as
    # a missing image in petl's unpacked VTAB copy is), whose remedy is a local copy.
    if "train" not in hub or "test" not in hub:
        raise _unusable(info, task, f"has splits {sorted(hub)}, expected train and test")
    train = hub["train"]
    test = hub["test"]
    try:
        image_column = find_column(train.features, "Image", ("image", "img"))
        label_column = find_column(train.features, "ClassLabel", ("label", "labels", "target"))
    except ValueError as error:
        raise _unusable(info, task, f"has {error}") from None
    val_name = next((n for n in ("validation", "val", "valid") if n in hub), None)
    if val_name is not None:
        pools = {"train": (train, range(len(train))), "val": (hub[val_name], range(len(hub[val_name])))}
    else:
        # No published validation split: hold out a fixed, seeded fraction of train.
        order = np.random.default_rng(FGVC_VAL_SEED).permutation(len(train))
        cut = int(round(len(train) * FGVC_VAL_FRACTION))
        pools = {"train": (train, sorted(order[cut:].tolist())), "val": (train, sorted(order[:cut].tolist()))}
    pools["test"] = (test, range(len(test)))
    labels = set(train.unique(label_column)) | set(test.unique(label_column))
    if labels != set(range(info.num_classes)):
        # Empty splits or labels of text (max() and >= raise on them) are a copy petl cannot use all the same.
        if not all(isinstance(label, int) for label in labels):
            found = f"labels that are not class numbers ({', '.join(sorted(map(repr, labels))[:3])})"
        else:
            found = f"{len(labels)} classes" + (f" (labels {min(labels)}..{max(labels)})" if labels else "")
        raise _unusable(info, task, f"has {found}, expected {info.num_classes} classes")
    return pools, image_column, label_column


def _unusable(info: DatasetInfo, task: _Task, why: str) -> DatasetUnavailableError:
    """The line for an FGVC hub copy of petl's that is not what the task needs (``why``), as for one out of reach."""
    return _unavailable(info, task, _FGVC_LAYOUT, why=f"hub copy {info.hub_id} {why}")


# --------------------------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------------------------


def _vtab_dataset(
    info: DatasetInfo, task: _Task, split: str, spec: ImageSpec, root: Path | None, strict: bool
) -> Dataset:
    folder = _vtab_from_hub(info, task) if root is None else _find_task_dir(info, task, root, ["train800.txt"])
    return _load_vtab_folder(info, folder, split, spec, strict, root)


def _fgvc_dataset(
    info: DatasetInfo, task: _Task, split: str, spec: ImageSpec, root: Path | None, strict: bool
) -> Dataset:
    if root is None:
        return _fgvc_from_hub(info, task, split, spec)
    folder = _find_task_dir(info, task, root, ["train.txt", "train.json"])
    return _load_fgvc_folder(info, folder, split, spec, strict, root)


@dataclass(frozen=True)
class _Family:
    """A family of tasks: its name prefix, how its source is described, its tasks and how one is loaded."""

    prefix: str
    source: str
    tasks: tuple[_Task, ...]
    load: Callable[[DatasetInfo, _Task, str, ImageSpec, Path | None, bool], Dataset]


BENCHMARKS = (
    _Family("vtab", "VTAB-1k {}", VTAB_TASKS, _vtab_dataset),
    _Family("fgvc", "FGVC {} (train/val/test as train800/val200/test)", FGVC_TASKS, _fgvc_dataset),
)


def _register(family: _Family, task: _Task) -> None:
    info = DatasetInfo(
        name=f"{family.prefix}/{task.name}",
        group=task.group,
        num_classes=task.num_classes,
        source=family.source.format(task.source),
        hub_id=task.hub_id,
    )

    @register_dataset(info)
    def build(split: str, spec: ImageSpec, *, root: str | None, strict: bool) -> Dataset:
        return family.load(info, task, split, spec, None if root is None else Path(root).expanduser(), strict)


for _family in BENCHMARKS:
    for _task in _family.tasks:
        _register(_family, _task)
