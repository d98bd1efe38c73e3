"""Run options declared once: a dataclass field carries its range, its choices and whether it changes results.

A run-config node (:class:`petl.train.engine.TrainSettings` and the nodes of :mod:`petl.train.config`) declares
each option with :func:`option`; :func:`check_options` validates a node against its own fields, and
:func:`neutral_keys` tells the run-folder rules (:mod:`petl.train.output_dir`) which options a finished or resumed
run may differ in.  Adding an option is one field plus the code that uses it.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from petl.utils.checks import check_choice, check_range

NEUTRAL = "neutral"


def option(
    default: Any = dataclasses.MISSING,
    *,
    default_factory: Callable[[], Any] | None = None,
    low: float | None = None,
    high: float | None = None,
    open_low: bool = False,
    open_high: bool = False,
    choices: Iterable[str] | None = None,
    check: Callable[[str, Any], None] | None = None,
    neutral: bool = False,
) -> Any:
    """A dataclass field with its validation and fingerprint metadata.

    Args:
        default: the default value (may be an OmegaConf interpolation such as ``II("data.epochs")``).
        default_factory: instead of ``default``, for mutable defaults.
        low: lower bound (:func:`petl.utils.checks.check_range`); NaN and infinity are refused too.
        high: upper bound.
        open_low: the lower bound itself is not allowed.
        open_high: the upper bound itself is not allowed.
        choices: the valid values (of each element, for a list option).
        check: any other check, ``check(key, value)``, raising ValueError with a one-line message.
        neutral: the option does not change what a run computes (where it writes, how it reports), so a
            finished or resumed run may differ in it.

    """
    metadata = {
        "low": low,
        "high": high,
        "open_low": open_low,
        "open_high": open_high,
        "choices": tuple(choices) if choices is not None else None,
        "check": check,
        NEUTRAL: neutral,
    }
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def check_options(node_type: type, values: Any, prefix: str = "") -> None:
    """Check every declared option of ``node_type`` in ``values`` (a dataclass instance or a config node).

    Raises:
        ValueError: naming ``prefix + field`` and its allowed range or choices.

    """
    for f in dataclasses.fields(node_type):
        meta = f.metadata
        if not meta:
            continue
        key, value = f"{prefix}{f.name}", getattr(values, f.name)
        if isinstance(value, str) and value.startswith("${"):
            continue  # an interpolation not resolved yet (a node's default): checked once the config resolves it
        if meta.get("low") is not None or meta.get("high") is not None:
            check_range(
                key, value, low=meta["low"], high=meta["high"], open_low=meta["open_low"], open_high=meta["open_high"]
            )
        if meta.get("choices") is not None:
            for item in value if isinstance(value, Sequence) and not isinstance(value, str) else [value]:
                check_choice(key, item, meta["choices"])
        if meta.get("check") is not None:
            meta["check"](key, value)


def neutral_keys(node_type: type, prefix: str = "") -> set[str]:
    """The dotted keys of every option marked neutral, in ``node_type`` and the dataclass nodes it holds."""
    keys = set()
    hints = typing.get_type_hints(node_type)
    for f in dataclasses.fields(node_type):
        if f.metadata.get(NEUTRAL):
            keys.add(f"{prefix}{f.name}")
        node = hints.get(f.name)
        if isinstance(node, type) and dataclasses.is_dataclass(node):
            keys |= neutral_keys(node, f"{prefix}{f.name}.")
    return keys
