"""petl: parameter-efficient transfer learning for timm Vision Transformers."""

from typing import TYPE_CHECKING

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
from petl.unload import unload

if TYPE_CHECKING:
    from petl.run.load import LoadedRun, load_run

__version__ = "0.1.0"


def __getattr__(name: str):  # noqa: ANN202
    # load_run needs the data package and timm's creation path: loaded on first use, not with `import petl`.
    if name in ("load_run", "LoadedRun"):
        from petl.run import load

        return getattr(load, name)
    raise AttributeError(f"module 'petl' has no attribute {name!r}")


__all__ = [
    "LoadedRun",
    "MethodConfig",
    "MethodSpec",
    "MultiTask",
    "ParamCount",
    "PetlModule",
    "apply",
    "count_params",
    "get_method",
    "list_methods",
    "load_run",
    "load_trainable",
    "make_config",
    "merge",
    "read_trainable_metadata",
    "register_method",
    "save_trainable",
    "unload",
    "unmerge",
    *methods.__all__,
]
