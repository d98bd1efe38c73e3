"""petl: parameter-efficient transfer learning for timm Vision Transformers."""

from petl import (
    methods,
    models,  # noqa: F401  (registers petl's timm models)
)
from petl.core import (
    MethodConfig,
    MethodSpec,
    ParamCount,
    PetlModule,
    apply,
    count_params,
    get_method,
    list_methods,
    make_config,
    merge,
    register_method,
    unmerge,
)
from petl.io import load_trainable, read_trainable_metadata, save_trainable
from petl.methods import *  # noqa: F403  (every apply_<name>; importing petl.methods registers the methods)
from petl.multitask import MultiTask

__version__ = "0.1.0"

__all__ = [
    "MethodConfig",
    "MethodSpec",
    "MultiTask",
    "ParamCount",
    "PetlModule",
    "apply",
    "count_params",
    "get_method",
    "list_methods",
    "load_trainable",
    "make_config",
    "merge",
    "read_trainable_metadata",
    "register_method",
    "save_trainable",
    "unmerge",
    *methods.__all__,
]
