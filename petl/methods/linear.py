"""Linear probing: the backbone stays frozen and only a fresh classifier head trains."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from petl import core


@dataclass
class LinearConfig(core.MethodConfig):
    """Linear probing has no options beyond ``num_classes``."""


def _formula(model: nn.Module, cfg: LinearConfig) -> int:
    # Only the head trains, and the formula counts what trains outside it.
    return 0


@core.register_method("linear", LinearConfig, trainable_formula=_formula, zero_init=True, mergeable=False)
def inject_linear(model: nn.Module, cfg: LinearConfig) -> None:
    """Linear probe: train only the classifier head."""
    # core.apply already froze the backbone and unfroze the head; nothing is added.


def apply_linear(model: nn.Module, **options: Any) -> nn.Module:
    """Freeze ``model`` and train only its (reset) head.

    Args:
        model: a timm VisionTransformer.
        **options: fields of :class:`LinearConfig` (``num_classes``).

    Returns:
        The same model, modified in place.

    """
    return core.apply(model, "linear", **options)
