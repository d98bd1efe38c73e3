"""Every option of every registered method acts or is refused: "a config value that has no effect is a bug".

Parametrized over the registry and each method's config fields, on a tiny model of each backbone kind the method
declares: the option is set to another value than its default (:data:`ALTERNATIVES`, or one derived from its type)
that the model takes, and the model must differ from the default's: other trainable tensors, other features or
logits in eval mode, or other logits in train mode (a dropout) under the same seed, with every trainable tensor
perturbed so that zero-initialised branches act.  (Values that cannot act on some model or beside some other value
are refused by the method's ``validate``, and tested where it is.)  A new method's option of a type no value can
be derived for fails here until :data:`ALTERNATIVES` names one.  The few options documented to act elsewhere are
in :data:`ACT_ELSEWHERE`, with where.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import TINY_MODELS, perturb_trainable

import petl
from petl.methods.gps import selected_weights
from petl.model.backbone import backbone_of
from petl.model.registry import get_method, make_config
from petl.train.engine import set_train_mode

# Options the method applies with before one option changes (NOAH with given widths: no placeholder subnet).
BASE = {"noah": {"prompt": "2,1,1", "lora": "1,0,2", "adapter": "0,1,1"}}

# (method, option) -> another valid value, or a function of the model giving one.
ALTERNATIVES: dict[tuple[str, str], Any] = {
    ("adapter", "style"): "parallel",
    ("adapter", "dim"): 4,
    ("adapter", "dropout"): 0.3,
    ("adapter_plus", "scaling"): "learned",
    ("bitfit", "biases"): "linear",
    ("dtl", "add_from"): 0,
    ("fact", "type"): "tt",
    ("gps", "per_row"): 2,
    ("gps", "selection"): lambda model: tuple(",".join(["1"] * w.shape[0]) for w in selected_weights(model)),
    ("hst", "dims"): ("16", "24", "32", "48"),
    ("hst", "heads"): ("1", "2", "4", "8"),
    ("hydra", "targets"): ("proj",),
    ("last", "gap"): 3,
    ("lora", "targets"): ("q", "k"),
    ("lst", "reduction"): 4,
    ("noah", "prompt"): "2,0,1",
    ("noah", "lora"): "2,0,1",
    ("noah", "adapter"): "2,0,1",
    ("noah", "supernet_dim"): 50,
    ("peft", "peft_type"): "LOHA",
    ("peft", "target_modules"): ("fc1",),
    ("peft", "options"): '{"r": 4}',
    ("repadapter", "bottleneck"): 4,
    ("repadapter", "groups"): 4,
    ("sct", "top_n"): 4,
    ("sct", "channels"): lambda model: tuple(
        ",".join(str(c + 1) for c in range(backbone_of(model).width() // 8)) for _ in range(backbone_of(model).depth())
    ),
    ("vpt", "pool"): "img_pool",
}

# (method, option) -> where it acts instead, as its docs say.
ACT_ELSEWHERE = {
    ("noah", "search_epochs"): "in petl-run's search (given widths record the search that chose them)",
    ("noah", "search_generations"): "in petl-run's search",
    ("noah", "population"): "in petl-run's search",
    ("noah", "max_params"): "in petl-run's search (a given subnet above it is refused)",
}


def _other_value(method: str, field: dataclasses.Field, model: torch.nn.Module) -> Any:
    """A valid value of ``field`` other than its default."""
    if (method, field.name) in ALTERNATIVES:
        value = ALTERNATIVES[(method, field.name)]
        return value(model) if callable(value) else value
    default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
    if field.name == "init":
        return "reference"
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1 if default else 1
    if isinstance(default, float):
        return 2 * default + 0.05
    if default is None:  # a default picked from other options: the int fields' other value
        return 3
    pytest.fail(f"{method}.{field.name}: name another value than {default!r} in ALTERNATIVES")


def _outcome(make: Callable[[], torch.nn.Module], method: str, options: dict[str, Any]) -> tuple:
    """The trainable tensors' names and shapes, the features and logits in eval mode and the logits in train mode.

    The features too: on a class-token ViT, VPT's ``pool=img_pool`` changes what ``forward_features`` returns only.
    """
    model = make()
    torch.manual_seed(0)
    petl.apply(model, make_config(method, num_classes=5, **options))
    perturb_trainable(model)
    images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        features = model.eval().forward_features(images)
        evaluated = model(images)
        set_train_mode(model, model.petl_config.backbone_mode)
        torch.manual_seed(5)
        trained = model(images)
    shapes = sorted((name, tuple(p.shape)) for name, p in model.named_parameters() if p.requires_grad)
    return shapes, features, evaluated, trained


def _cases() -> list[tuple[str, str, str]]:
    cases = []
    for kind in TINY_MODELS:
        for method in petl.list_methods():
            for field in dataclasses.fields(get_method(method).config_cls):
                if kind in get_method(method).backbones and field.name != "num_classes":
                    cases.append((kind, method, field.name))
    return cases


@pytest.mark.parametrize(("kind", "method", "option"), _cases())
def test_every_method_option_acts_or_is_refused(kind, method, option):
    if (method, option) in ACT_ELSEWHERE:
        pytest.skip(f"{method}.{option} acts {ACT_ELSEWHERE[(method, option)]}")
    make = TINY_MODELS[kind]
    field = next(f for f in dataclasses.fields(get_method(method).config_cls) if f.name == option)
    base = dict(BASE.get(method, {}))
    other = {**base, option: _other_value(method, field, make())}
    default = _outcome(make, method, base)
    try:
        changed = _outcome(make, method, other)
    except ValueError as error:  # the value tests nothing: each option's refusals are tested where it is
        pytest.fail(f"{method}.{option}={other[option]!r} is refused ({error}): name one it takes in ALTERNATIVES")
    differs = [default[0] != changed[0]]
    differs += [a.shape != b.shape or not torch.equal(a, b) for a, b in zip(default[1:], changed[1:], strict=True)]
    assert any(differs), f"{method}.{option}={other[option]!r} changes nothing on a tiny {kind}"
