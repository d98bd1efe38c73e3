"""``key=value`` argument helpers shared by the ``petl-bench`` commands.

They live apart from :mod:`petl.cli.bench` so that a command module (``speed``, ``params``) can parse
its own arguments without importing the CLI that dispatches to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

# Overrides that would silently fight the sweep's own bookkeeping: which method and task a run is,
# its seed and its folder come from the suite and the experiment files.
RESERVED = {
    "method": "choose experiments with methods=...",
    "data": "choose tasks with tasks=...",
    "seed": "choose seeds with seeds=...",
}


def split_list(value: str) -> list[str]:
    """``a,b`` or ``[a,b]`` -> ``["a", "b"]``."""
    return [v.strip() for v in value.strip("[]").split(",") if v.strip()]


def as_bool(key: str, value: str) -> bool:
    """A ``key=true|false`` value as a bool; anything else exits naming the key."""
    if value.lower() in ("true", "1", "yes"):
        return True
    if value.lower() in ("false", "0", "no"):
        return False
    raise SystemExit(f"petl-bench: {key}={value}: expected true or false")


# Every yes/no key of petl-bench may also be written as a flag: `--dry-run` is `dry_run=true`, `--yes` is `yes=true`.
FLAGS = {"--yes": "yes", "--dry-run": "dry_run"}


def flags_as_keys(args: Sequence[str]) -> list[str]:
    """``--dry-run`` / ``--yes`` anywhere on the line as ``dry_run=true`` / ``yes=true``; another flag exits.

    Raises:
        SystemExit: a flag petl-bench does not take (one line listing those it does).

    """
    out = []
    for arg in args:
        if arg.startswith("--"):
            if arg not in FLAGS:
                raise SystemExit(f"petl-bench: unknown flag {arg!r}; petl-bench takes {', '.join(FLAGS)} and --debug")
            arg = f"{FLAGS[arg]}=true"
        out.append(arg)
    return out


def folders(args: Sequence[str], command: str) -> list[str]:
    """The words of ``args`` that name folders (neither ``key=value`` nor a flag), for ``report`` and ``compare``.

    Raises:
        SystemExit: a flag (``--bogus``), which was read as a results folder and refused as one without results.

    """
    for arg in args:
        if arg.startswith("-") and "=" not in arg:
            raise SystemExit(
                f"petl-bench {command}: unknown flag {arg!r}; it takes folders and key=value only "
                "(see petl-bench --help)"
            )
    return [arg for arg in args if "=" not in arg]


def check_run_keys(overrides: Sequence[str], own: set[str]) -> None:
    """Refuse a pass-through key that no run config has, listing petl-bench's own keys (a typo of one, say).

    A key petl-bench does not take goes to every run's config; one whose first part is not a config key
    (``dryrun=true``) would fail every run of the sweep, one by one, naming petl-run's keys only.

    Raises:
        SystemExit: one line naming the key, petl-bench's keys and the run config's top-level keys.

    """
    from petl.train.config import compose_config

    roots = None
    for arg in overrides:
        key = arg.partition("=")[0].lstrip("+~")
        root = key.split(".")[0].split("/")[0]
        if root == "hydra":  # a launcher or sweeper of petl-bench commands' lines
            continue
        roots = roots or [str(k) for k in compose_config([])]
        if root not in roots:
            passed = ", ".join(f"{r}.*" if r in ("method", "data", "model", "train") else r for r in roots)
            raise SystemExit(
                f"petl-bench: unknown key {key!r}; petl-bench takes {', '.join(sorted(own))} (and "
                f"{', '.join(FLAGS)}), and passes the run config's keys on to every run: {passed}"
            )


def parse_args(args: Sequence[str], known: set[str]) -> tuple[dict[str, str], list[str]]:
    """Split ``key=value`` arguments into the command's own keys and pass-through overrides.

    Raises:
        SystemExit: an argument without ``=``, or an override of what the sweep itself decides.

    """
    own, passthrough = {}, []
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep:
            raise SystemExit(f"petl-bench: expected key=value, got {arg!r} (see petl-bench --help)")
        if key in known:
            own[key] = value
            continue
        # `+seed=` and `++seed=` add or force the same key: the prefix must not let it past.
        name = key.lstrip("+~")
        root = name.split(".")[0]
        if root in RESERVED and (name in (root, "data.name") or root == "method"):
            raise SystemExit(f"petl-bench: {arg!r} is set per run by the sweep; {RESERVED[root]}")
        passthrough.append(arg)
    return own, passthrough


# The command-line keys naming the configs folder: configs_dir=, and its older name benchmarks_dir=.
CONFIGS_KEYS = {"configs_dir", "benchmarks_dir"}


def configs_folder(own: dict[str, str]) -> Path:
    """The configs folder (experiments/ and suites/) a command line names, else petl's own."""
    from petl.presets import configs_dir

    return configs_dir(own.get("configs_dir", own.get("benchmarks_dir")))
