"""Range and choice checks for option values: one line naming the option and what is allowed.

Method configs call them directly; the run config (:mod:`petl.train.config`) wraps them to raise its ConfigError.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Set
from typing import Any


def is_finite_number(value: Any) -> bool:
    """An int or float (not a bool) that is neither NaN nor infinite: what a record's numeric field must hold."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def check_range(
    field: str,
    value: float,
    low: float | None = None,
    high: float | None = None,
    *,
    open_low: bool = False,
    open_high: bool = False,
) -> None:
    """Raise a ValueError naming ``field`` when ``value`` is NaN, infinite, or outside its bounds.

    The one range check of petl: method configs call it directly, the run config
    (:mod:`petl.train.config`) wraps it to raise its ConfigError.

    Args:
        field: the option's name as the user typed it (``rank``, ``train.lr``).
        value: the value to check; ``None`` (an unset optional option) passes.
        low: lower bound, ``None`` for none.
        high: upper bound, ``None`` for none.
        open_low: the lower bound itself is not allowed (``(0, inf]``).
        open_high: the upper bound itself is not allowed (``[0, 1)``).

    """
    if value is None:
        return
    bounds = (
        f"{'(' if open_low else '['}{'-inf' if low is None else low}, "
        f"{'inf' if high is None else high}{')' if open_high else ']'}"
    )
    # NaN compares False with everything, so it would pass every bound below; inf is never meant.
    if isinstance(value, float) and not math.isfinite(value):
        allowed = f": allowed {bounds}" if low is not None or high is not None else ""
        raise ValueError(f"{field}={value} is not a finite number{allowed}")
    below = low is not None and (value <= low if open_low else value < low)
    above = high is not None and (value >= high if open_high else value > high)
    if below or above:
        raise ValueError(f"{field}={value} is out of range: allowed {bounds}")


def check_dropout(field: str, value: float) -> None:
    """Raise a ValueError naming ``field`` unless ``value`` is a dropout probability in [0, 1)."""
    check_range(field, value, low=0, high=1, open_high=True)


def check_nonzero(field: str, value: float, switches_off: str) -> None:
    """Raise a ValueError when a multiplier ``field`` is 0: it would silently switch ``switches_off`` off."""
    if value == 0:
        raise ValueError(f"{field}=0 switches {switches_off} off: choose a non-zero {field}")


def check_choice(field: str, value: Any, choices: tuple[str, ...]) -> None:
    """Raise a ValueError naming ``field`` and the valid choices when ``value`` is not one of them."""
    if value not in choices:
        raise ValueError(f"{field}={value!r} is not valid: choose one of {', '.join(choices)}")


def to_str_tuple(value: Any, field: str = "value") -> tuple[str, ...]:
    """Normalise a config's sequence-of-strings field to a tuple.

    The CLI hands over lists (or OmegaConf ListConfigs) where the dataclass declares a tuple, and a
    comma-separated string is the easiest way to type a list on a command line, so all three are
    accepted; the tuple keeps the config hashable and its JSON form stable.  Anything else (a number, a
    mapping) is a ValueError naming ``field``.
    """
    if isinstance(value, str):
        return tuple(part.strip() for part in value.split(",") if part.strip())
    return tuple(str(part) for part in as_list(value, field, "a list of strings"))


def as_list(value: Any, field: str, wanted: str) -> list[Any]:
    """``value`` (a list, tuple or ListConfig) as a list; a ValueError naming ``field`` and ``wanted`` otherwise."""
    if isinstance(value, Iterable) and not isinstance(value, str | bytes | Mapping | Set):
        return list(value)
    raise ValueError(f"{field}={value!r} is not {wanted} ({type(value).__name__}): give {wanted}")
