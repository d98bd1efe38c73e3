"""Every method option is checked against its annotation: a wrong type is refused in one line naming the option."""

from __future__ import annotations

import dataclasses
import json
import types
import typing

import numpy as np
import pytest
from conftest import make_tiny_vit

import petl
from petl.model.registry import get_method

# Values of the wrong type for each annotation; "false" and 1 must not pass for a bool, nor 4.5, True or "4" for an
# int (torch fails on them without naming the option), nor "x" or True for a float.
WRONG = {
    bool: ["false", "no", 1],
    int: [4.5, True, "4"],
    float: ["x", True],
    str: [5],
    tuple: [5],
}


def _wrong_values(hint: typing.Any) -> list[typing.Any]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return [v for arg in typing.get_args(hint) if arg is not type(None) for v in _wrong_values(arg)]
    return WRONG[typing.get_origin(hint) or hint]


def _cases() -> list[tuple[str, str, typing.Any]]:
    cases = []
    for name in petl.list_methods():
        config_cls = get_method(name).config_cls
        hints = typing.get_type_hints(config_cls)
        for f in dataclasses.fields(config_cls):
            cases += [(name, f.name, value) for value in _wrong_values(hints[f.name])]
    return cases


@pytest.mark.parametrize(("method", "option", "value"), _cases())
def test_a_wrong_type_is_refused_naming_the_option(method, option, value):
    with pytest.raises(ValueError) as error:
        petl.apply(make_tiny_vit(), method, **{option: value})
    message = str(error.value)
    assert f"{option}=" in message and "\n" not in message


def _as_numpy(value: typing.Any) -> typing.Any:
    """``value`` with its numbers as NumPy's (np.int64, np.float32), as a sweep over np.arange or np.logspace gives."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return np.int64(value)
    if isinstance(value, float):
        return np.float32(value)
    if isinstance(value, tuple | list):
        return type(value)(_as_numpy(item) for item in value)
    return value


@pytest.mark.parametrize("method", petl.list_methods())
def test_numpy_numbers_are_taken_as_pythons_and_the_weights_file_is_written(tmp_path, method):
    # check_types took np.int64 as a whole number, and save_trainable then failed after training, in json, on
    # "Object of type int64 is not JSON serializable".
    plain = petl.apply(make_tiny_vit(), method, num_classes=3).petl_config
    options = {f.name: _as_numpy(getattr(plain, f.name)) for f in dataclasses.fields(plain)}
    model = petl.apply(make_tiny_vit(), method, **options)
    petl.save_trainable(model, tmp_path / "numpy.safetensors")
    recorded = dataclasses.asdict(model.petl_config)
    assert not [name for name, value in recorded.items() if isinstance(value, np.generic)]
    # The values given, each NumPy number as Python's (np.float32's rounding of a float kept).
    assert json.loads(json.dumps(recorded)) == json.loads(json.dumps(options, default=lambda number: number.item()))
    assert petl.read_trainable_metadata(tmp_path / "numpy.safetensors")["config"]["num_classes"] == 3
    petl.load_trainable(make_tiny_vit(), tmp_path / "numpy.safetensors")


def test_the_right_types_pass_as_the_command_line_hands_them_over():
    # An int for a float, lists for a tuple (Hydra's form), None for an optional int.
    model = petl.apply(make_tiny_vit(), "lora", rank=2, alpha=4, dropout=0, targets=["q", "v"], num_classes=None)
    assert model.petl_config.alpha == 4 and model.petl_config.targets == ("q", "v")
    petl.apply(make_tiny_vit(), "adapter", dim=None, norm=True)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ('{"r": "x"}', "r='x'"),
        ('{"use_dora": "yes"}', "use_dora='yes'"),
        ('{"lora_dropout": "0.1"}', "lora_dropout='0.1'"),
        ('{"bias": "some"}', "bias='some'"),
    ],
)
def test_peft_options_are_checked_against_the_peft_config(options, named):
    with pytest.raises(ValueError, match=f"options: {named}") as error:
        petl.apply(make_tiny_vit(), "peft", options=options)
    assert "\n" not in str(error.value)


def test_peft_options_may_give_lora_alpha_as_any_number():
    # peft annotates lora_alpha as int yet divides by it: 0.5 works there, so it passes here.
    petl.apply(make_tiny_vit(), "peft", options='{"r": 2, "lora_alpha": 0.5}')


def test_peft_inference_mode_is_refused():
    # peft injects its modules frozen in inference mode: the run would train the head alone.
    with pytest.raises(ValueError, match="inference_mode"):
        petl.apply(make_tiny_vit(), "peft", options='{"inference_mode": true}')


def test_peft_target_modules_given_twice_is_refused():
    with pytest.raises(ValueError, match="target_modules is given twice"):
        petl.apply(make_tiny_vit(), "peft", target_modules=("proj",), options='{"target_modules": ["fc1"]}')
    model = petl.apply(make_tiny_vit(), "peft", target_modules=(), options='{"target_modules": ["fc1"]}')
    assert all("fc1" in name for name, p in model.named_parameters() if p.requires_grad and "lora" in name)
    assert model.petl_config.target_modules == ()


def test_noah_refuses_a_given_subnet_above_max_params():
    widths = {"prompt": "1,1,1", "lora": "0,0,0", "adapter": "0,0,0"}
    with pytest.raises(ValueError, match="max_params=1 is below the given subnet's"):
        petl.apply(make_tiny_vit(), "noah", max_params=1, **widths)
    # A searched config keeps its search options as the record of the search that chose the widths.
    petl.apply(make_tiny_vit(), "noah", search_epochs=3, population=2, **widths)
