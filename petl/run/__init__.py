"""Running methods: the training engine, the ``petl-run`` command line and its Python twin.

    from petl.run import default_config, train
    result = train(default_config(["method=lora", "method.rank=4", "train.epochs=5"]))

The two names load on first use, so ``import petl.train.engine`` (the pretraining script) does not
pull in Hydra and the dataset registry.
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
