"""petl: parameter-efficient transfer learning for timm Vision Transformers."""

from petl import models  # noqa: F401  (registers petl's timm models)
from petl.core import (
    MethodConfig,
    MethodSpec,
    ParamCount,
    PetlModule,
    apply,
    count_params,
    get_method,
    list_methods,
    load_trainable,
    make_config,
    merge,
    read_trainable_metadata,
    register_method,
    save_trainable,
    unmerge,
)
from petl.methods import (  # importing petl.methods registers every method
    apply_adapter,
    apply_adapter_plus,
    apply_full,
    apply_hydra,
    apply_linear,
    apply_lora,
    apply_mlp,
    apply_partial,
    apply_peft,
    apply_sct,
    apply_vpt,
)

__version__ = "0.1.0"

__all__ = [
    "MethodConfig",
    "MethodSpec",
    "ParamCount",
    "PetlModule",
    "apply",
    "apply_adapter",
    "apply_adapter_plus",
    "apply_full",
    "apply_hydra",
    "apply_linear",
    "apply_lora",
    "apply_mlp",
    "apply_partial",
    "apply_peft",
    "apply_sct",
    "apply_vpt",
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
]
