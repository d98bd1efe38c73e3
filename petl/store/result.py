"""The record of a finished run, ``result.json``: one typed schema, one writer, one reader.

:func:`write_result` is the only code that writes the file (a trained run, a diverged selection trial, a
final run stamped with its selection) and :func:`read_result` the only code that reads it (the run-folder
rules, the sweep, the reports), so every field is named once, here, and the reports read attributes.
A record written before ``version`` existed reads as version 1.  The file is untrusted (a hand edit, a copy, another
tool's record): the reader checks every field's type and range, and that the method, dataset, seed and model are those
of the config the record embeds; an unreadable or malformed one raises :class:`ResultError` naming the file and the
field.
"""

from __future__ import annotations

import dataclasses
import json
import reprlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from petl.store.files import write_json
from petl.utils.checks import is_finite_number

RESULT_VERSION = 1
# Present only where they apply, so that the records of runs without them stay as they were.
_ONLY_WHEN_SET = ("selection", "diverged", "not_learned", "split_meaning", "extra")


class ResultError(ValueError):
    """A ``result.json`` that cannot be read (not JSON, not a record, a field malformed, another version); names it."""


@dataclass
class RunResult:
    """One run's ``result.json`` (accuracies in percent; counts and seconds as measured).

    Only ``method``, ``dataset`` and ``seed`` are always known; a selection trial that diverged has no scores
    and says why in ``diverged``.  ``selection`` is the search record a final run of ``petl-bench``'s
    protocol is stamped with.  Keys this petl does not know are kept in ``extra`` and written back.
    """

    method: str
    dataset: str
    seed: int
    method_config: dict[str, Any] = field(default_factory=dict)
    split: str | None = None
    model: str | None = None
    pretrained: bool | None = None
    num_classes: int | None = None
    trainable_params: int | None = None
    trainable_params_no_head: int | None = None
    total_params: int | None = None
    val_top1: float | None = None
    best_val_top1: float | None = None
    test_top1: float | None = None
    final_train_loss: float | None = None
    final_train_top1: float | None = None
    epochs: int | None = None
    train_seconds: float | None = None
    images_per_second: float | None = None
    feature_cache: str | None = None
    device: str | None = None
    num_processes: int | None = None
    precision: str | None = None
    compiled: bool | None = None
    # CUDA matmuls and convolutions on TF32 tensor cores (never on a CPU); null in records written before petl
    # recorded it, which ran with torch's default (TF32 matmuls off).  A field added, not changed: older readers
    # keep it in ``extra``, so the version stays.
    tf32: bool | None = None
    effective_batch_size: int | None = None
    # Optimizer steps the run took over all its epochs (per process); null in records written before petl recorded
    # it.  A field added, not changed: older readers keep it in ``extra``, so the version stays.
    optimizer_steps: int | None = None
    versions: dict[str, str | None] | None = None
    git_commit: str | None = None
    git_dirty: bool | None = None
    output_dir: str | None = None
    finished_at: str | None = None
    test_seconds: float | None = None
    peak_memory_mb: float | None = None
    peak_memory_kind: str | None = None
    config: dict[str, Any] | None = None
    inputs: dict[str, Any] | None = None
    # SHA-256 of the local pretrained weights file the backbone loaded (rows from several machines: same weights).
    weights_sha256: str | None = None
    # The weights file the backbone came from (then pretrained is false: not the tag's published weights).
    checkpoint: str | None = None
    checkpoint_sha256: str | None = None
    # The data: class names in label order, how val was held out of train (if it was), whether test exists.
    class_names: list[str] | None = None
    val_from_train: str | None = None
    # What ``split`` holds where its name says less: a user's own data, whose train800 is not 800 images.
    split_meaning: str | None = None
    has_test_split: bool | None = None
    wall_seconds: float | None = None
    selection: dict[str, Any] | None = None
    diverged: str | None = None
    # Why training ended where it began (petl.train.learning), for a run that did not learn.
    not_learned: str | None = None
    version: int = RESULT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The record as written: every field (null where unknown) but those only set where they apply."""
        record = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in _ONLY_WHEN_SET:
            if not record[name]:
                del record[name]
        extra = record.pop("extra", None) or {}  # popped first: written as the keys it holds, not as "extra"
        return {**record, **extra}

    @classmethod
    def from_json(cls, record: Any, source: str = "result.json") -> RunResult:
        """Read a record, every field checked (:func:`field_problem`); raises :class:`ResultError` naming ``source``.

        The one reader of the file: the run-folder rules, the sweep and the reports all come through here, so a
        field of the wrong type or out of range (a hand edit, another tool's record) is refused once, the same
        way for each of them, before anything formats or sums it.
        """
        if not isinstance(record, dict):
            raise ResultError(f"{source}: not a result record (a JSON {type(record).__name__})")
        missing = [name for name in ("dataset", "seed") if name not in record]
        if missing:
            raise ResultError(f"{source}: not a result record (no {', '.join(missing)})")
        problem = version_problem(record.get("version", RESULT_VERSION))
        if problem:
            raise ResultError(f"{source}: {problem}")
        unwritable = not_utf8(record)
        if unwritable is not None:
            raise ResultError(f"{source}: {unwritable}")
        known = {f.name for f in dataclasses.fields(cls)} - {"extra", "version"}
        values = {k: v for k, v in record.items() if k in known}
        for name, value in values.items():
            what = field_problem(name, value)
            if what:
                raise ResultError(f"{source}: field {name!r} is {reprlib.repr(value)}, not {what}")
        problem = config_problem(values) or count_problem(values)
        if problem:
            raise ResultError(f"{source}: {problem}")
        # A record without its method (hand-made, a test's) takes its config's, so that a rewrite stays consistent.
        method = _config_name(values.get("config"), "method")
        values.setdefault("method", method if isinstance(method, str) and method else "?")
        values["method_config"] = values.get("method_config") or {}
        extra = {k: v for k, v in record.items() if k not in known and k != "version"}
        return cls(**values, version=record.get("version", RESULT_VERSION), extra=extra)


# What each field of a record may hold, checked on read (RunResult.from_json).  Every field is in one group
# (a test keeps it so), so a field added to RunResult cannot be read unchecked.
_REQUIRED = ("method", "dataset", "seed")  # never null (one without a method: see from_json)
_NAMES = ("method", "dataset")  # non-empty text
_TEXT = (
    "split", "model", "feature_cache", "device", "precision", "git_commit", "output_dir", "finished_at",
    "peak_memory_kind", "weights_sha256", "checkpoint", "checkpoint_sha256", "val_from_train", "split_meaning",
    "diverged", "not_learned",
)  # fmt: skip
_FLAGS = ("pretrained", "compiled", "tf32", "git_dirty", "has_test_split")
# Integers (never true/false), with their least value: a model has parameters and a task classes.
_COUNTS = {
    "seed": 0, "num_classes": 1, "total_params": 1, "trainable_params": 0, "trainable_params_no_head": 0,
    "epochs": 0, "num_processes": 1, "effective_batch_size": 1, "optimizer_steps": 1,
}  # fmt: skip
_PERCENTS = ("val_top1", "best_val_top1", "test_top1", "final_train_top1")
_AMOUNTS = ("train_seconds", "test_seconds", "wall_seconds", "images_per_second", "peak_memory_mb")  # >= 0
_LOSSES = ("final_train_loss",)  # finite (a run whose loss went non-finite stops without a record)
_MAPPINGS = ("method_config", "config", "inputs", "versions", "selection")
_TEXT_LISTS = ("class_names",)
CHECKED_FIELDS = (
    *_NAMES, *_TEXT, *_FLAGS, *_COUNTS, *_PERCENTS, *_AMOUNTS, *_LOSSES, *_MAPPINGS, *_TEXT_LISTS, "version", "extra"
)  # fmt: skip


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def field_problem(name: str, value: Any) -> str | None:
    """What a record's field ``name`` should hold when ``value`` is not that, else ``None``.

    Null stands for "unknown" in every field but ``method``, ``dataset`` and ``seed``.
    """
    if value is None and name not in _REQUIRED:
        return None
    if name in _NAMES:
        return None if isinstance(value, str) and value else "a name"
    if name in _TEXT:
        return None if isinstance(value, str) else "text"
    if name in _FLAGS:
        return None if isinstance(value, bool) else "true or false"
    if name in _COUNTS:
        least = _COUNTS[name]
        return None if _is_count(value) and value >= least else f"an integer of at least {least}"
    if name in _PERCENTS:
        return None if is_finite_number(value) and 0 <= value <= 100 else "a percentage from 0 to 100"
    if name in _AMOUNTS:
        return None if is_finite_number(value) and value >= 0 else "a non-negative number"
    if name in _LOSSES:
        return None if is_finite_number(value) else "a finite number"
    if name in _MAPPINGS:
        if not isinstance(value, dict):
            return "a mapping"
        trials = value.get("trials") if name == "selection" else None
        if trials is not None and not (isinstance(trials, list) and all(isinstance(t, dict) for t in trials)):
            return "a mapping whose trials are a list of mappings"
        return None
    if name in _TEXT_LISTS:
        return None if isinstance(value, list) and all(isinstance(v, str) for v in value) else "a list of text"
    raise KeyError(name)


def not_utf8(value: Any, where: str = "") -> str | None:
    r"""Where ``value`` (a record, or a part of one) holds text no UTF-8 file can hold, or ``None``.

    A JSON escape of half a surrogate pair (``"\udcff"``) reads as a lone surrogate: a name with one stops every
    report that writes it (its Markdown, its plots' labels), so the record is refused once, on read, rather than by
    whichever writer meets it first.
    """
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            shown = reprlib.repr(value)
            return f"field {where or 'key'!r} holds {shown}, which is not UTF-8 text (a lone surrogate escape)"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        at = f"{where}.{key}" if where else str(key)
        problem = not_utf8(key, where) if isinstance(key, str) else None
        problem = problem or not_utf8(item, at)
        if problem:
            return problem
    return None


def version_problem(version: Any) -> str | None:
    """Why ``version`` is not a record version this petl reads (it reads 1 to :data:`RESULT_VERSION`), or ``None``."""
    if not _is_count(version):
        shown = reprlib.repr(version)
        return f"result version {shown} is not a version number (an integer; this petl writes {RESULT_VERSION})"
    if version > RESULT_VERSION:
        return f"result version {version} is newer than this petl reads ({RESULT_VERSION}): upgrade petl to read it"
    if version < 1:
        return f"result version {version} was never written by petl (versions 1 to {RESULT_VERSION})"
    return None


def config_problem(values: dict[str, Any]) -> str | None:
    """Where a record's method, dataset, seed or model differ from the config it records it was trained with, or
    ``None``.

    A selection trial that diverged was recorded under its experiment's name before this check existed
    (:func:`petl.bench.sweep._diverged_result`), so its method is not compared; it records no model.  The model is
    what a leaderboard reads to put published figures beside a run and to check a suite's backbone: a hand-edited
    one would pass a run off as another backbone's.
    """
    config = values.get("config")
    if not isinstance(config, dict):
        return None  # a hand-made record, or one from before configs were recorded: nothing to compare
    recorded = {"seed": config.get("seed"), "dataset": _config_name(config, "data")}
    recorded["model"] = _config_name(config, "model")
    if not values.get("diverged"):
        recorded["method"] = _config_name(config, "method")
    for name, value in recorded.items():
        if value is not None and values.get(name) is not None and value != values[name]:
            return f"{name} {values[name]!r} is not the {name} of the config it records ({value!r})"
    return None


def count_problem(values: dict[str, Any]) -> str | None:
    """Where a record counts more trainable parameters than parameters (a report would show over 100 %), or ``None``."""
    total = values.get("total_params")
    for name in ("trainable_params", "trainable_params_no_head"):
        count = values.get(name)
        if total is not None and count is not None and count > total:
            return f"field {name!r} is {count}, more than total_params ({total}): a record cannot train more"
    return None


def _config_name(config: Any, group: str) -> Any:
    """``config[group]["name"]`` (the method's or the dataset's name in a recorded config), else ``None``."""
    node = config.get(group) if isinstance(config, dict) else None
    return node.get("name") if isinstance(node, dict) else None


def write_result(path: Path, result: RunResult) -> None:
    """Write ``result.json`` atomically (its presence marks the run finished)."""
    write_json(path, result.to_json())


def read_result(path: Path) -> RunResult | None:
    """The record in ``path``, or ``None`` when there is none.

    Raises:
        ResultError: the file is not a readable result record (the message names it).

    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as error:
        raise ResultError(f"{path}: cannot be read ({error.strerror or error})") from None
    except UnicodeDecodeError as error:
        # petl writes UTF-8 JSON; other bytes (a hand edit in another encoding) are no record, named as one.
        raise ResultError(f"{path}: not UTF-8 text (byte {error.object[error.start]:#04x} at {error.start})") from None
    try:
        record = json.loads(text)
    except ValueError as error:
        raise ResultError(f"{path}: not valid JSON ({error})") from None
    return RunResult.from_json(record, str(path))
