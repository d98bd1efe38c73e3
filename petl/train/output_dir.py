"""The rules of a run folder, shared by petl-run and petl-bench so that the two cannot disagree about one folder.

A folder holds one run: its fingerprint (the part of the resolved config that decides what the run
computes), its inputs (the data and weights files' content), and, once finished, ``result.json``.
:func:`check_output_dir` (petl-run, before training or resuming) and :func:`check_finished`
(petl-bench, before counting a finished run) apply the same comparison; :func:`claim` holds the
folder for one run at a time.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from torch.utils.data import Dataset, Subset

from petl import data as petl_data
from petl.store import files, lock
from petl.store.result import ResultError, RunResult, read_result
from petl.train import config
from petl.train.config import ConfigError
from petl.utils import paths
from petl.utils.distributed import is_main_process
from petl.utils.errors import RunError, UnreachableError
from petl.utils.text import plural

log = logging.getLogger(__name__)

# Keys below these take any name, so a key missing from an old record is a real difference there.
_FREE_FORM = ("model.kwargs.",)


def fingerprint(resolved: dict[str, Any]) -> dict[str, Any]:
    """The part of a resolved config that decides what a run computes: every option not marked ``neutral``."""
    neutral = config.run_neutral_keys()
    nested = tuple(f"{key}." for key in neutral)
    return {key: value for key, value in flatten(resolved).items() if key not in neutral and not key.startswith(nested)}


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested mapping as one level of dotted keys (``{"train": {"lr": 1}}`` -> ``{"train.lr": 1}``)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def _difference(old: dict[str, Any], new: dict[str, Any]) -> str:
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    # An empty mapping is a key of its own when flattened (model.kwargs: {}), and gone once a key is set in it: the
    # key set is the difference, not "model.kwargs: {} -> None" beside it.
    keys = [k for k in keys if not ({} in (old.get(k), new.get(k)) and any(o.startswith(f"{k}.") for o in keys))]
    return ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys[:3]) + (" ..." if len(keys) > 3 else "")


def check_same_config(out: Path, recorded: dict[str, Any], resolved: dict[str, Any], advice: str) -> None:
    """Refuse a folder whose run was trained with another config: the one comparison petl-run and petl-bench make.

    Only the fingerprints count (options marked neutral never do).  A key added to petl after the run was
    recorded is not a difference while it has its default: an option is added with a default that keeps the
    old behaviour, so committed results and checkpoints stay valid when petl grows an option.
    ``model.kwargs`` is free-form (any ``timm.create_model`` keyword), so a key added there is a difference.

    Raises:
        ConfigError: naming up to three differing keys, and ``advice``.

    """
    difference = config_difference(recorded, resolved)
    if difference:
        raise ConfigError(f"output_dir {out} holds a run with another config ({difference}); {advice}")


def config_difference(recorded: dict[str, Any], resolved: dict[str, Any]) -> str:
    """Up to three keys whose values make ``resolved`` train another run than ``recorded`` did; "" if none.

    The one comparison of run identity (see :func:`check_same_config` for what counts).
    """
    old, new = fingerprint(recorded), fingerprint(resolved)
    method = (resolved.get("method") or {}).get("name")
    added = {k for k in new.keys() - old.keys() if not k.startswith(_FREE_FORM)}
    new = {k: v for k, v in new.items() if k not in added or v != _as_recorded(config.option_default(k, method))}
    return "" if old == new else _difference(old, new)


# The splits a run is scored on (val for selection, test for the final score), by the role build.datasets gives them,
# with their split name and the key of their content fingerprint in a run's inputs (run_inputs).  A record from before
# they were recorded lacks the keys, and is compared on the training split's alone.
EVAL_SPLITS = {"val": (petl_data.VAL, "data.val_fingerprint"), "test": (petl_data.TEST, "data.test_fingerprint")}
_EVAL_INPUTS = tuple(key for _, key in EVAL_SPLITS.values())

# What a run's inputs record about the data and weights files' content (run_inputs); paths may move.
_CONTENT_INPUTS = ("data.fingerprint", *_EVAL_INPUTS, "model.checkpoint_sha256")


# What a record says of its run beside its config, compared where a record has no config.
_RECORD_FIELDS = ("model", "pretrained", "epochs", "split", "num_classes")


def seed_difference(first: RunResult, other: RunResult) -> str:
    """What, besides the seed, makes ``other`` another run than ``first``: config or data/weights content; "" if none.

    Two seeds of one leaderboard cell must differ in nothing else (not the backbone, epochs, data...).
    Results without a recorded config (hand-made records, another tool's) are compared on what they do record of the
    run (:data:`_RECORD_FIELDS`): two "seeds" of two backbones would otherwise be averaged as one cell.
    """
    if first.config is None or other.config is None:
        pairs = [(k, getattr(first, k), getattr(other, k)) for k in _RECORD_FIELDS]
        return ", ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in pairs if a is not None and b is not None and a != b)
    a, b = {**first.config, "seed": None}, {**other.config, "seed": None}
    difference = config_difference(a, b) or config_difference(b, a)
    if difference:
        return difference
    old, new = first.inputs or {}, other.inputs or {}
    changed = [k for k in _CONTENT_INPUTS if k in old and k in new and old[k] != new[k]]
    return ", ".join(f"{k}: {_digest(old[k])} -> {_digest(new[k])}" for k in changed)  # SHA-256s cut short


def _as_recorded(value: Any) -> Any:
    # A record holds JSON/YAML values: a tuple default reads back as a list.
    return list(value) if isinstance(value, tuple) else value


def check_output_dir(out: Path, cfg: DictConfig, resolved: dict[str, Any], is_main: bool) -> RunResult | None:
    """Check what an earlier run left in ``out``; return its result if it finished with this config.

    A finished run is returned only whole: its record readable (every field checked, its method, dataset and seed
    those of the config it embeds: :func:`petl.store.result.read_result`), that config this command's, its inputs
    unchanged and its weights file there.  Anything else is named in one line (exit 2) and nothing is deleted.
    """
    if not cfg.resume:
        # A replacement: the earlier run stays until this one has checked its input (set_aside).
        return None
    finished = _read_finished(out)
    if finished is not None:
        if finished.config is None:
            raise ConfigError(
                f"output_dir {out} holds a {files.RESULT_FILE} without the config it was trained with, so it "
                "cannot be checked; choose another output_dir, or resume=false to replace it"
            )
        if not (out / files.WEIGHTS_FILE).is_file():
            # Its record alone is no finished run: petl-predict, petl-export and load_run need the weights.
            raise ConfigError(f"output_dir {out} holds a finished run without its {files.WEIGHTS_FILE}; {_REPLACE}")
        previous = finished.config
    elif (out / files.CHECKPOINT_FILE).exists():
        if not (out / files.CONFIG_FILE).exists():
            # config.yaml is written before the first checkpoint, so only a deleted file gets here (by hand, or a
            # copy of the folder that kept only git-ignored files); without it nothing tells which config the
            # checkpoint was trained with, and resuming could mix two.
            raise ConfigError(
                f"output_dir {out} holds {files.CHECKPOINT_FILE} without its {files.CONFIG_FILE}, so its config "
                "cannot be checked; choose another output_dir, or resume=false to replace it"
            )
        previous = _recorded_config(out, "choose another output_dir, or resume=false to replace it")
    else:
        # Nothing finished and no epoch to resume: what a run killed before its first checkpoint left is rewritten.
        _check_nothing_to_overwrite(out)
        return None
    check_same_config(out, previous, resolved, "choose another output_dir, or resume=false to replace it")
    if finished is not None:
        _data_fingerprint.cache_clear()  # one run: the data as it is now (a sweep's checks share the cache)
        check_inputs(out, finished.inputs, finished_inputs(cfg, finished), finished=True)
        # A run that kept its checkpoint (train.keep_checkpoint, neutral: this command may leave it out) keeps it.
        kept = (finished.config.get("train") or {}).get("keep_checkpoint") is True
        if is_main and not cfg.train.keep_checkpoint and not kept:
            # Left by a kill between result.json and the checkpoint's removal.
            (out / files.CHECKPOINT_FILE).unlink(missing_ok=True)
    return finished


def _check_nothing_to_overwrite(out: Path) -> None:
    """Refuse a folder holding files of petl's names that no unfinished run left (without a result or checkpoint).

    What a run stopped before its first checkpoint left is rewritten: :func:`petl.store.files.stopped_before_checkpoint`
    says which folder holds that, as petl-predict, petl-export, petl-serve and load_run read it.  Anything else of
    petl's names (weights or a card, a ``config.yaml`` that is not a run's, a ``metrics.jsonl`` without its
    ``config.yaml``) is another run's finished files (its ``result.json`` deleted) or the user's own
    (``output_dir=.`` in a project holding a ``config.yaml``): the run would overwrite them.

    Raises:
        ConfigError: naming the file; ``resume=false`` moves it aside instead.

    """
    if files.stopped_before_checkpoint(out):
        return
    found = [name for name in (files.WEIGHTS_FILE, files.MODEL_FILE) if (out / name).exists()]
    if not (out / files.CONFIG_FILE).exists() and (out / files.METRICS_FILE).exists():
        found.append(files.METRICS_FILE)
    if found:
        raise ConfigError(
            f"output_dir {out} holds {found[0]} without {files.RESULT_FILE} or {files.CHECKPOINT_FILE}: no run to "
            f"resume, and this one would overwrite it; {_REPLACE}"
        )
    if (out / files.CONFIG_FILE).exists():
        _recorded_config(out, f"this run would overwrite it; {_REPLACE}")


def check_finished(cfg: DictConfig) -> None:
    """Refuse a finished run in ``cfg.output_dir`` that was trained with another config or other inputs.

    A run still being trained there (its ``config.yaml`` without ``result.json``: another sweep holds the folder),
    or one interrupted (no live holder: the next sweep would resume it), is compared on its config.

    A sweep skips a run whose ``result.json`` exists without calling :func:`petl.train.runner.run`; this is the
    check :func:`check_output_dir` makes before such a result is returned, so an edited suite (another epoch
    count, say) cannot have old results counted as its own.

    Raises:
        ConfigError: the folder holds a run of another config, data folder or weights file.

    """
    from petl.train.build import resolve_precision  # late: the build module imports the data and model stack

    resolve_precision(cfg)  # train.precision=auto as petl.train.runner.run records it on this machine
    out = Path(cfg.output_dir)
    finished = _read_finished(out)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(resolved, dict)
    if finished is None and (out / files.CONFIG_FILE).is_file():
        # Being trained (by another sweep into the same folder: petl-bench asks while the folder is held), or
        # interrupted: resuming it would be refused on the same difference, after the whole sweep had planned it.
        recorded = _recorded_config(out, "delete it to train this config")
        if _held_by_another(out):
            advice = "another sweep is training it: give this suite its own folder"
        else:
            advice = "it is an unfinished run: delete it to train this config"
        check_same_config(out, recorded, resolved, advice)
        return
    if finished is None or finished.config is None:
        return  # nothing finished here (or a hand-made record): nothing to compare
    check_same_config(out, finished.config, resolved, "delete it to train this config")
    check_inputs(out, finished.inputs, finished_inputs(cfg, finished), finished=True)


def _held_by_another(out: Path) -> bool:
    """Whether another process holds ``out``'s lock: a live one on this host, or any on another (a shared disk)."""
    holder = lock.read_holder(out)
    if not holder or lock.holds_lock(out):
        return False
    return holder.get("host") != socket.gethostname() or lock.held_by_live_process(out)


_ANOTHER = "choose another output_dir"
_REPLACE = "run again with resume=false to move that run aside and train anew, or choose another output_dir"


def _recorded_config(out: Path, advice: str) -> dict[str, Any]:
    """``out``'s ``config.yaml`` (:func:`petl.store.files.read_config`); a damaged one is bad input, named."""
    try:
        return files.read_config(out)
    except files.DamagedFileError as error:
        raise ConfigError(f"output_dir {out}: {error}; {advice}") from None


def _read_finished(out: Path) -> RunResult | None:
    try:
        return read_result(out / files.RESULT_FILE)
    except (ResultError, RecursionError) as error:
        raise ConfigError(f"output_dir {out}: {error}; {_REPLACE}") from None


def set_aside(out: Path) -> None:
    """Move the files of an earlier run in ``out`` to ``<out>.replaced-<time>`` (resume=false replaces a run).

    Called once the replacing run has built its model and data, right before it writes its first file, so a
    replacement that fails on its input deletes nothing.
    """
    found = [out / name for name in files.RUN_FILES if (out / name).exists()]
    if not found:
        return
    stamp = time.strftime("%Y%m%d-%H%M%S")
    # Resolved: output_dir=. (a project's folder, named in the refusal that points here) has no name to extend.
    named = out.resolve()
    aside = named.with_name(f"{named.name}{files.REPLACED_MARK}{stamp}")
    count = 1
    while aside.exists():
        count += 1
        aside = named.with_name(f"{named.name}{files.REPLACED_MARK}{stamp}-{count}")
    try:
        aside.mkdir()
        for path in found:
            os.replace(path, aside / path.name)
    except OSError as error:
        raise ConfigError(
            f"resume=false: cannot move the earlier run in {out} aside to {aside} ({error.strerror or error}); "
            "nothing was deleted: choose another output_dir"
        ) from None
    log.info("resume=false: the earlier run in %s (%s) moved to %s", out, ", ".join(p.name for p in found), aside)


def run_inputs(cfg: DictConfig, dataset: Dataset | None, evaluated: dict[str, Dataset] | None = None) -> dict[str, Any]:
    """What decides a run's result besides its config values: the data and weights files' content.

    ``data.root`` may move without changing anything (it is not part of :func:`fingerprint`), so a
    dataset's content ``fingerprint`` (datasets read from local folders carry one) is what counts
    when there is one; without it, the resolved folder is compared instead.  The splits the run is scored
    on (``evaluated``, by role: :data:`EVAL_SPLITS`) add their fingerprints where they carry one, so that a
    test split edited after the run is not taken for the one it was scored on.
    """
    root = cfg.data.root
    checkpoint = cfg.model.checkpoint if cfg.model.pretrained else None
    if checkpoint and not Path(checkpoint).is_file():
        raise ConfigError(f"model.checkpoint={checkpoint}: no such file")
    inputs = {
        "data.root": str(Path(root).expanduser().resolve()) if root else None,
        "data.fingerprint": _content_fingerprint(dataset),
        "model.checkpoint_sha256": files.file_sha256(Path(checkpoint)) if checkpoint else None,
    }
    for role, (_, key) in EVAL_SPLITS.items():
        split_fingerprint = _content_fingerprint((evaluated or {}).get(role))
        if split_fingerprint is not None:  # generated data records nothing more than before
            inputs[key] = split_fingerprint
    return inputs


def _content_fingerprint(dataset: Dataset | None) -> str | None:
    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    return getattr(dataset, "fingerprint", None)


def finished_inputs(cfg: DictConfig, finished: RunResult) -> dict[str, Any]:
    """The inputs a finished run is compared on: :func:`run_inputs`, with the data's content fingerprint if it has one.

    A finished run's images may have been edited since (a folder run, say): the same check as a resume,
    not a cheaper one.  A split (the training one, and the val and test splits the run was scored on) is read and
    hashed (:func:`petl.data.images.fingerprint_only`: no image decoded) only when the run recorded its content
    fingerprint, so generated data (the mini tasks) costs nothing; within one process (a sweep checking many
    finished runs of one task) a split's fingerprint is computed once.
    """
    inputs = run_inputs(cfg, None)
    recorded = finished.inputs or {}
    options = tuple(sorted(config.data_options(cfg).items()))
    splits = [(cfg.data.split, "data.fingerprint"), *EVAL_SPLITS.values()]
    for split, key in splits:
        if recorded.get(key) is not None:
            inputs[key] = _data_fingerprint(cfg.data.name, split, cfg.data.root, options)
    return inputs


@functools.lru_cache(maxsize=64)
def _data_fingerprint(name: str, split: str, root: str | None, options: tuple) -> str | None:
    # The fingerprint hashes file bytes and labels, not the transform: any image size builds the same one.
    from petl.data.images import fingerprint_only

    try:
        with fingerprint_only():  # the bytes are hashed, nothing decoded: a test split may be many thousand photos
            dataset = petl_data.build_dataset(name, split, image_size=32, root=root, options=dict(options))
    except petl_data.DatasetUnavailableError as error:
        raise UnreachableError(f"the data of a finished run cannot be checked: {error}") from None
    except ValueError as error:  # bad images, a folder gone or changed shape: the user's data
        raise ConfigError(f"the data of a finished run cannot be checked: {error}") from None
    return _content_fingerprint(dataset)


def _digest(value: Any) -> str:
    """A value as an inputs difference says it: a SHA-256 by its first 12 hex digits (four whole ones ran past 500
    characters on one line), anything else as its repr.
    """
    if isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value):
        return f"{value[:12]}..."
    return repr(value)


def check_inputs(out: Path, old: dict[str, Any] | None, new: dict[str, Any], finished: bool = False) -> None:
    """Refuse to resume (or to return a finished result) when the data or weights changed."""
    if old is None:
        return  # recorded by a petl from before inputs were recorded
    keys = ["model.checkpoint_sha256"]
    if finished or old.get("data.fingerprint") is None or new.get("data.fingerprint") is None:
        keys.append("data.root")
    if not finished or new.get("data.fingerprint") is not None:
        keys.append("data.fingerprint")
    # The splits the run was scored on, where it recorded them (a record or checkpoint from before: compared on
    # what it has), compared as the training split is.
    keys += [k for k in _EVAL_INPUTS if old.get(k) is not None and (not finished or new.get(k) is not None)]
    changed = {k: (old.get(k), new.get(k)) for k in keys if old.get(k) != new.get(k)}
    if changed:
        what = ", ".join(f"{k}: {_digest(a)} -> {_digest(b)}" for k, (a, b) in changed.items())
        done = "a finished run" if finished else "epochs trained"
        raise ConfigError(
            f"output_dir {out} holds {done} on other inputs ({what}); "
            "choose another output_dir, or resume=false to replace it"
        )


@contextmanager
def claim(out: Path) -> Iterator[None]:
    """Hold ``out`` for this run: checked writable, locked, cleared of litter; left as found on failure.

    Only the main process claims (the others of a multi-GPU launch write nothing).  A folder this
    claim created is removed again if the run fails before writing anything into it.
    """
    if not is_main_process():
        yield
        return
    # Checked as petl-bench checks its results folder (fill: a full disk is refused before anything is built).
    unwritable = paths.cannot_write_in(out, _ANOTHER, fill=True)
    if unwritable is not None:
        raise ConfigError(f"output_dir {unwritable}")
    created: list[Path] = []
    try:
        created = [p for p in (out, *out.parents) if not p.exists()]
        # A sweep (petl-bench) holds the folder's lock itself and trains in this very process.
        ours = not lock.holds_lock(out)
        taken = lock.acquire_lock(out) if ours else True
    except OSError as error:  # changed since the check (another process removed or filled it)
        _remove_empty(created)
        raise ConfigError(f"output_dir {paths.cannot_be_written(out, error, _ANOTHER)}") from None
    if not taken:
        raise RunError(
            f"output_dir {out} is in use by another run ({lock.describe_holder(out)}); wait for it to finish "
            f"or choose another output_dir (delete {out / lock.LOCK_FILE} if that process is gone)"
        )
    for tmp in files.temporary_files(out):  # left by a kill during an atomic write
        tmp.unlink(missing_ok=True)
    try:
        yield
    finally:
        if ours:
            lock.release_lock(out)
        _remove_empty(created)


def _remove_empty(created: list[Path]) -> None:
    """Remove the folders of ``created`` (deepest first) that are still empty."""
    for folder in created:
        try:
            folder.rmdir()
        except OSError:  # not empty (the run wrote something), or already gone
            return


@contextmanager
def disk_errors(out: Path, saved_epoch: Callable[[], int], resume: bool = True) -> Iterator[None]:
    """Turn a failed write (disk full, folder gone) into one line saying which epochs are safe."""
    try:
        yield
    except OSError as error:
        epoch = saved_epoch()
        kept = f"the checkpoint of epoch {epoch} is kept" if epoch else "no epoch had finished"
        reason = error.strerror or str(error)
        # With resume=false the same command would delete the kept checkpoint and start over.
        again = "run the same command again to resume" if resume else "run the command again with resume=true"
        raise RunError(f"cannot write to output_dir {out} ({reason}): {kept}; free the space and {again}") from None


def damaged_checkpoint(out: Path, why: str) -> ConfigError:
    """The one line for ``out``'s ``checkpoint.pt`` whose contents do not fit this run, and what to do."""
    return ConfigError(f"{out / files.CHECKPOINT_FILE} is damaged ({why}): {_REPLACE}")


def older_checkpoint(out: Path, why: str) -> ConfigError:
    """The one line for ``out``'s ``checkpoint.pt`` that an earlier petl wrote (``why`` says how it differs)."""
    return ConfigError(f"{out / files.CHECKPOINT_FILE} {why}; {_REPLACE}")


def resume_checkpoint(
    out: Path, cfg: DictConfig, inputs: dict[str, Any], num_processes: int = 1
) -> dict[str, Any] | None:
    """The checkpoint to resume from, once its data and weights are known to be this run's.

    Args:
        out: the run folder.
        cfg: the run's config (its ``config.yaml`` already matched against it).
        inputs: the data and weights files' content (:func:`run_inputs`).
        num_processes: the processes of this launch; a checkpoint of another count is refused, since each process
            trains its own batches (the effective batch is ``train.batch_size`` x processes x ``train.grad_accum``).

    """
    path = out / files.CHECKPOINT_FILE
    try:
        checkpoint = files.load_checkpoint(path) if cfg.resume else None
    except files.NewerFileError as error:
        raise ConfigError(f"{error}: upgrade petl to resume it, or {_REPLACE}") from None
    except files.DamagedFileError as error:
        raise ConfigError(f"{error}: {_REPLACE}") from None
    if checkpoint is not None and checkpoint["epoch"] > cfg.train.epochs:
        # config.yaml holds this train.epochs (check_output_dir): no checkpoint of this run went past it.
        raise damaged_checkpoint(out, f"epoch {checkpoint['epoch']} of {cfg.train.epochs}")
    # Checkpoints from before the count was recorded: not compared (most were of one process).
    trained_on = checkpoint.get("num_processes") if checkpoint is not None else None
    if trained_on is not None and trained_on != num_processes:
        raise ConfigError(
            f"output_dir {out} holds epochs trained on {plural(trained_on, 'process', 'processes')}, this launch "
            f"has {num_processes}: the effective batch would change mid-run; resume it with {trained_on}, or "
            "resume=false to replace it"
        )
    if checkpoint is not None:
        # check_output_dir has matched its config.yaml against cfg; the inputs need the data built.
        check_inputs(out, checkpoint.get("inputs"), inputs)
    return checkpoint
