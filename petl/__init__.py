"""petl: parameter-efficient transfer learning for timm Vision Transformers."""

from petl import models  # noqa: F401  (registers petl's timm models)
from petl.core import (
    ParamCount,
    apply,
    count_params,
    get_method,
    list_methods,
    load_trainable,
    merge,
    save_trainable,
    unmerge,
)

__version__ = "0.1.0"

__all__ = [
    "ParamCount",
    "apply",
    "count_params",
    "get_method",
    "list_methods",
    "load_trainable",
    "merge",
    "save_trainable",
    "unmerge",
]
