"""petl-run: train one PETL method on one task from the command line (Hydra).

    petl-run method=lora
    petl-run method=lora method.rank=4 data=mini/dsprites_ori train.epochs=20 seed=1
    petl-run model=vit_base_patch16_224.augreg2_in21k_ft_in1k data=vtab/cifar100 train.precision=bf16
    petl-run --multirun method=lora,adapter,vpt seed=0,1,2
    accelerate launch -m petl.run method=lora ...      # DDP on every GPU of the machine

Bad input (an unknown method, dataset, model or key; a value of the wrong type or out of range)
exits with status 2 and one line naming the key and what is valid; a run that cannot complete
(non-finite loss, unreachable data) exits with status 1.  Both are checked for every job of a
sweep before the first one starts.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

import hydra
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig

from petl.run import config, runner
from petl.run.config import ConfigError

PROG = "petl-run"
USAGE_ERROR = 2
RUN_ERROR = 1

# Sweeps larger than this are checked on their first jobs only; every job still checks itself.
MAX_CHECKED_JOBS = 64

# Errors of the jobs of a local sweep (Hydra's basic launcher runs them in this process).
_failed_jobs: list[str] = []


def _error(message: str) -> None:
    # Only one process of a multi-GPU launch speaks, or every error would print once per GPU.
    if os.environ.get("RANK", "0") == "0":
        print(f"{PROG}: error: {message}", file=sys.stderr)


def _job_overrides(overrides: list[str], multirun: bool) -> list[list[str]]:
    """The override list of every job the command line would launch (the first MAX_CHECKED_JOBS)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    parsed = OverridesParser.create().parse_overrides(overrides)
    if not multirun:
        return [overrides]
    try:
        jobs = BasicSweeper.split_arguments(parsed, None)[0]
    except HydraException:
        # Sweep kinds only other sweepers understand (intervals for Optuna...): check the fixed part.
        jobs = [[o.input_line for o in parsed if not o.is_sweep_override()]]
    return jobs[:MAX_CHECKED_JOBS]


def check_command_line(overrides: Sequence[str], multirun: bool = False) -> None:
    """Compose and check every job of a command line before Hydra starts any of them.

    Raises:
        ConfigError: the first problem found, as one line (naming the job of a sweep).

    """
    try:
        jobs = _job_overrides(list(overrides), multirun)
    except HydraException as error:
        raise ConfigError(config.explain(error, overrides)) from None
    for job in jobs:
        try:
            config.default_config(job)
        except ConfigError as error:
            where = f" (in job {' '.join(job)})" if multirun and len(jobs) > 1 else ""
            raise ConfigError(f"{error}{where}") from None


def _task(cfg: DictConfig) -> dict[str, Any] | None:
    """Hydra's task function: one run; errors become one line and an exit status."""
    hydra_cfg = HydraConfig.get() if HydraConfig.initialized() else None
    multirun = hydra_cfg is not None and hydra_cfg.mode == RunMode.MULTIRUN
    # Hydra's basic launcher runs a sweep's jobs in this process; others (submitit...) elsewhere.
    in_process = multirun and "BasicLauncher" in str(hydra_cfg.launcher.get("_target_", ""))
    try:
        result = runner.run(cfg)
    except (ConfigError, runner.RunError) as error:
        status = USAGE_ERROR if isinstance(error, ConfigError) else RUN_ERROR
        _error(str(error))
        if in_process:
            # Let the other jobs of the sweep run; main() reports the failures at the end.
            _failed_jobs.append(str(error))
            return None
        if multirun:
            # A remote job must fail visibly to its launcher (the line above is in its log).
            raise RuntimeError(str(error)) from None
        raise SystemExit(status) from None
    if os.environ.get("RANK", "0") == "0":
        print(runner._summary_line(result) + f"  -> {cfg.output_dir}", flush=True)
    return result


@hydra.main(version_base="1.3", config_path="pkg://petl.conf", config_name="config")
def _hydra_main(cfg: DictConfig) -> dict[str, Any] | None:
    return _task(cfg)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``petl-run`` (and ``python -m petl.run``)."""
    from hydra._internal.utils import get_args_parser

    argv = list(sys.argv[1:] if argv is None else argv)
    args = get_args_parser().parse_args(argv)
    config.register_configs()
    config.register_models_in(args.overrides)
    # --version exits inside the parser; these others only print, so nothing needs checking.
    informational = any(getattr(args, flag, None) for flag in ("help", "hydra_help", "shell_completion", "info"))
    if not informational:
        try:
            check_command_line(args.overrides, multirun=args.multirun)
        except ConfigError as error:
            _error(str(error))
            raise SystemExit(USAGE_ERROR) from None
    _failed_jobs.clear()
    saved_argv = sys.argv
    # hydra.main reads the command line from sys.argv.
    sys.argv = [saved_argv[0] if saved_argv else PROG, *argv]
    try:
        _hydra_main()
    except KeyboardInterrupt:
        _error("interrupted; the same command resumes from the last finished epoch")
        raise SystemExit(130) from None
    finally:
        sys.argv = saved_argv
        # hydra.main leaves its global state set (a process normally exits here); callers that
        # run petl-run in-process (tests, notebooks) get a clean slate back.
        GlobalHydra.instance().clear()
    if _failed_jobs:
        _error(f"{len(_failed_jobs)} job(s) of the sweep failed (see above)")
        raise SystemExit(RUN_ERROR)


if __name__ == "__main__":
    main()
