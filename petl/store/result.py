"""The record of a finished run, ``result.json``: one typed schema, one writer, one reader.

:func:`write_result` is the only code that writes the file (a trained run, a diverged selection trial, a
final run stamped with its selection) and :func:`read_result` the only code that reads it (the run-folder
rules, the sweep, the reports), so every field is named once, here, and the reports read attributes.
A record written before ``version`` existed reads as version 1; an unreadable one raises
:class:`ResultError` naming the file.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from petl.store.files import write_json

RESULT_VERSION = 1
# Present only where they apply, so that the records of runs without them stay as they were.
_ONLY_WHEN_SET = ("selection", "diverged", "not_learned", "split_meaning", "extra")


class ResultError(ValueError):
    """A ``result.json`` that cannot be read: not JSON, not a record, or from a newer petl; names the file."""


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
        return {**record, **record.pop("extra", {})}

    @classmethod
    def from_json(cls, record: Any, source: str = "result.json") -> RunResult:
        """Read a record; raises :class:`ResultError` naming ``source`` when it is not one."""
        if not isinstance(record, dict):
            raise ResultError(f"{source}: not a result record (a JSON {type(record).__name__})")
        missing = [name for name in ("dataset", "seed") if name not in record]
        if missing:
            raise ResultError(f"{source}: not a result record (no {', '.join(missing)})")
        version = record.get("version", RESULT_VERSION)
        if not isinstance(version, int) or version > RESULT_VERSION:
            raise ResultError(f"{source}: result version {version!r} is newer than this petl reads ({RESULT_VERSION})")
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        values = {k: v for k, v in record.items() if k in known}
        try:
            seed = int(values.pop("seed"))
        except (TypeError, ValueError):
            raise ResultError(f"{source}: seed {record['seed']!r} is not an integer") from None
        values.setdefault("method", "?")
        values["dataset"] = str(values["dataset"])
        return cls(**values, seed=seed, extra={k: v for k, v in record.items() if k not in known})


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
    try:
        record = json.loads(text)
    except ValueError as error:
        raise ResultError(f"{path}: not valid JSON ({error})") from None
    return RunResult.from_json(record, str(path))
