"""One calibration per task: the runs of an experiment that reuse what another run's ``calibrate`` hook chose.

A method's data-dependent step (``calibrate``: NOAH's subnet search, GPS's and SCT's selections) runs in each
``petl-run`` before training.  An experiment with ``calibrate_once: true`` runs it once per task instead: the
task's first run (the first selection trial under a searching suite, else the first seed's run) calibrates
as usual, and every other run of the task takes the options it chose as overrides, so it neither repeats
the step nor chooses differently.  NOAH needs this: its reference trains one supernet and searches one subnet
per task, then retrains that subnet (ZhangYuanhan-AI/NOAH@e9c55f3 configs/NOAH/VTAB/supernet/slurm_train_vtab.sh,
search/slurm_search_vtab.sh, subnet/slurm_retrain_vtab.sh), and one search costs more than the retraining.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from petl.presets import override
from petl.store.files import RESULT_FILE, set_aside_advice
from petl.store.result import read_result

# Filled by the run itself from the data, never by a calibration.
_NOT_CALIBRATED = {"name", "num_classes"}


def calibrated_options(result_config: dict[str, Any], method_config: dict[str, Any]) -> dict[str, Any]:
    """The method options a run's calibration chose: those whose value differs from the command line's.

    Args:
        result_config: the run's composed config (``result.json``'s ``config``); its ``method`` node holds
            the options as given.
        method_config: the options the run trained with (``result.json``'s ``method_config``).

    Returns:
        ``{option: value}``, empty when the calibration kept every option (the options were given).

    """
    given = result_config.get("method") or {}
    return {
        key: value
        for key, value in method_config.items()
        if key in given and key not in _NOT_CALIBRATED and _plain(given[key]) != _plain(value)
    }


def _plain(value: Any) -> Any:
    # JSON has lists where the config has tuples: compare them as lists.
    return [_plain(v) for v in value] if isinstance(value, list | tuple) else value


def calibration_overrides(run_dir: Path) -> list[str] | None:
    """The finished run in ``run_dir``'s calibrated options as Hydra overrides; ``None`` while it has no result.

    Raises:
        ValueError: the run finished without recording its method's options (a result from before
            ``method_config`` was recorded): its calibration cannot be reused.

    """
    result = read_result(run_dir / RESULT_FILE)
    if result is None:
        return None
    if not result.method_config or result.config is None:
        raise ValueError(
            f"{run_dir / RESULT_FILE}: records no method_config to reuse; move its folder aside "
            f"({set_aside_advice(run_dir)}) and run again to calibrate anew"
        )
    chosen = calibrated_options(result.config, result.method_config)
    return [override(f"method.{key}", value) for key, value in chosen.items()]
