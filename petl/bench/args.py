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
