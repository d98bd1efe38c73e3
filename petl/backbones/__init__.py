"""The backbones petl registers with timm (:mod:`petl.backbones.models`): importing this package registers them."""

from petl.backbones import models  # noqa: F401  (registers the models with timm)
