"""The public face of training: ``petl-run``'s Python twin, and ``python -m petl.run``.

    from petl.run import default_config, train
    result = train(default_config(["method=lora", "method.rank=4", "train.epochs=5"]))

The code lives in :mod:`petl.train` (``train`` in :mod:`petl.train.runner`, ``default_config`` in
:mod:`petl.train.config`) and the command in :mod:`petl.cli.run`; this package keeps the documented names and
``accelerate launch -m petl.run``.  The two names load on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["default_config", "train"]


def __getattr__(name: str) -> Any:
    if name == "train":
        from petl.train.runner import train

        return train
    if name == "default_config":
        from petl.train.config import default_config

        return default_config
    raise AttributeError(f"module 'petl.run' has no attribute {name!r}")
