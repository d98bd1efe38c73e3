"""petl: parameter-efficient transfer learning for timm Vision Transformers.

``import petl`` is cheap: every public name loads on first use (PEP 562), so a command's ``--help`` does not
wait for torch and timm.  The first use of any name also registers petl's backbones with timm
(:mod:`petl.backbones`), as ``import petl`` did before; ``import petl.backbones`` does that alone.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from petl.version import __version__

# Public name -> the module that defines it.
_HOMES = {
    "Backbone": "petl.model.backbone",
    "backbone_of": "petl.model.backbone",
    "list_backbones": "petl.model.backbone",
    "register_backbone": "petl.model.backbone",
    "MethodConfig": "petl.model.registry",
    "MethodSpec": "petl.model.registry",
    "ParamCount": "petl.model.params",
    "PetlModule": "petl.model.wrappers",
    "count_params": "petl.model.params",
    "get_method": "petl.model.registry",
    "list_methods": "petl.model.registry",
    "make_config": "petl.model.registry",
    "register_method": "petl.model.registry",
    "unmerge": "petl.model.merging",
    "apply": "petl.model.surgery",
    "merge": "petl.model.surgery",
    "unload": "petl.model.unloading",
    "load_trainable": "petl.model.io",
    "read_trainable_metadata": "petl.model.io",
    "save_trainable": "petl.model.io",
    "MultiTask": "petl.deploy.multitask",
    "LoadedRun": "petl.store.run_card",
    "load_run": "petl.store.run_card",
}

if TYPE_CHECKING:
    from petl.deploy.multitask import MultiTask
    from petl.model.backbone import Backbone, backbone_of, list_backbones, register_backbone
    from petl.model.io import load_trainable, read_trainable_metadata, save_trainable
    from petl.model.merging import unmerge
    from petl.model.params import ParamCount, count_params
    from petl.model.registry import MethodConfig, MethodSpec, get_method, list_methods, make_config, register_method
    from petl.model.surgery import apply, merge
    from petl.model.unloading import unload
    from petl.model.wrappers import PetlModule
    from petl.store.run_card import LoadedRun, load_run


def _methods() -> Any:
    # Importing the methods registers them; importing the backbones registers petl's timm models.
    importlib.import_module("petl.backbones")
    return importlib.import_module("petl.methods")


# Documented submodules a user reaches as attributes of ``import petl`` (``from petl import presets`` asks
# this module's ``__getattr__`` first, so they load nothing beyond themselves).
_LIGHT_SUBMODULES = ("run", "presets")


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        _methods()
        value = getattr(importlib.import_module(_HOMES[name]), name)
    elif name.startswith("apply_"):
        value = getattr(_methods(), name)
    elif name == "__all__":
        value = sorted([*_HOMES, *_methods().__all__])
    elif name in ("methods", "backbones"):
        value = importlib.import_module(f"petl.{name}")
        _methods()
    elif name in _LIGHT_SUBMODULES:  # ``import petl`` then ``petl.run.train(...)``, as the docs write it
        value = importlib.import_module(f"petl.{name}")
    else:
        raise AttributeError(f"module 'petl' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
