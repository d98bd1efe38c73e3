"""The method registry: a method is a config dataclass (subclass of :class:`MethodConfig`) plus an ``inject``
function registered with :func:`register_method`; configs of other libraries register a converter.

:func:`petl.apply` (:mod:`petl.model.surgery`) does the parts every method shares (check the model, freeze it,
reset the head, record the config) so that a method file only adds its own modules.
"""

from __future__ import annotations

import dataclasses
import numbers
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from torch import nn

from petl.utils.checks import check_range


@dataclass
class MethodConfig:
    """Options shared by every method.

    Attributes:
        num_classes: reset the classifier head to this many classes; ``None`` keeps the head, and ``0`` removes it
            as timm's ``num_classes=0`` does (pooled features out; refused where the head is what the method trains).
        backbone_mode: (class-level, not an option) how the frozen backbone runs while this
            method trains, as its reference trains it: ``train`` (dropout and drop-path act
            everywhere; V-PETL, NOAH and PETL_Vision call ``model.train()``) or ``eval`` (only
            what learns is in train mode; the VPT repo's frozen encoder).  ``train.backbone_mode``
            overrides it per run.

    """

    num_classes: int | None = None
    backbone_mode: ClassVar[str] = "train"

    @property
    def keeps_zero_init(self) -> bool:
        """Whether this config starts as its method's ``zero_init`` says (``init=reference`` options do not)."""
        return True

    def validate(self, model: nn.Module) -> None:
        """Raise ValueError naming the field and its allowed range if a value is off for ``model``.

        Every float field is checked for NaN/inf here, so a method's own checks (``alpha <= 0``,
        which NaN passes) never see one.
        """
        check_types(self)
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float):
                check_range(f.name, value)
        if self.num_classes is not None:
            # 0 as timm's: a model whose reset_classifier(0) recorded it saves a file that loads as it was.
            check_range("num_classes", self.num_classes, low=0)


def check_types(config: MethodConfig) -> None:
    """Raise a ValueError naming the first field whose value is not of its annotated type.

    Checked on the config as its ``__post_init__`` left it (tuple fields already normalised from lists or
    comma-separated strings): ``"false"`` for a bool would otherwise read as true, and 4.5 or ``"4"`` for an int
    would reach torch as a layer size and fail there without naming the option.
    """
    hints = typing.get_type_hints(type(config))
    for f in fields(config):
        value, hint = getattr(config, f.name), hints[f.name]
        if not fits_type(value, hint):
            words = type_words(hint)
            example = f", e.g. {f.name}={f.default!r}" if f.default not in (dataclasses.MISSING, None) else ""
            raise ValueError(f"{f.name}={value!r} is not {words} ({type(value).__name__}): give {words}{example}")


def plain_numbers(config: MethodConfig) -> None:
    """Turn NumPy's (or any other library's) integers and reals in ``config``'s fields into Python's, in place.

    :func:`check_types` takes any whole number for an int (``np.arange``'s, ``np.int64``), but the weights file
    records the config as JSON, which writes Python's numbers only: a NumPy rank or alpha would fail
    :func:`petl.save_trainable` after training.  Lists and tuples of numbers are turned item by item.
    """

    def plain(value: Any) -> Any:
        if isinstance(value, bool | int | float | str) or value is None:
            return value
        if isinstance(value, numbers.Integral):
            return int(value)
        if isinstance(value, numbers.Real):
            return float(value)
        if isinstance(value, tuple | list):
            return type(value)(plain(item) for item in value)
        return value

    for f in fields(config):
        setattr(config, f.name, plain(getattr(config, f.name)))


def fits_type(value: Any, hint: Any) -> bool:
    """Whether ``value`` fits type hint ``hint``: bool only for bool; an int, never a bool, for int (a float too)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if hint is type(None) or hint is None:
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(fits_type(value, arg) for arg in args)
    if origin is typing.Literal:
        return any(value == arg and type(value) is type(arg) for arg in args)
    if origin in (tuple, list):
        if not isinstance(value, tuple | list):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(fits_type(v, a) for v, a in zip(value, args, strict=True))
        return not args or all(fits_type(v, args[0]) for v in value)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    return isinstance(value, origin or hint)


def type_words(hint: Any) -> str:
    """``hint`` as the answer says it: ``a whole number``, ``true or false``, ``a list of strings or None``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_words(arg) for arg in args)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(arg) for arg in args)
    if origin in (tuple, list):
        return f"a list of {type_words(args[0]).removeprefix('a ').removeprefix('an ')}s" if args else "a list"
    words = {bool: "true or false", int: "a whole number", float: "a number", str: "a string", type(None): "None"}
    return words.get(hint, f"a {getattr(hint, '__name__', hint)}")


@dataclass(frozen=True)
class MethodSpec:
    """A registered method."""

    name: str
    config_cls: type[MethodConfig]
    inject: Callable[[nn.Module, MethodConfig], None]
    trainable_formula: Callable[[nn.Module, MethodConfig], int]
    zero_init: bool
    mergeable: bool
    # The backbone kinds (:attr:`petl.Backbone.kind`) the method's idea fits; petl.apply refuses the others.
    backbones: tuple[str, ...] = ("vit",)
    # Optional data-driven step before injection (e.g. choosing channels from the task's images):
    # ``calibrate(backbone, cfg, loader, *, progress=True) -> cfg``.  petl-run calls it; Python users call it
    # themselves.
    calibrate: Callable[..., MethodConfig] | None = None
    # Why the idea does not fit the backbone kinds left out of ``backbones`` (the refusal's second half), and which
    # of them that reason is about (empty: every kind left out).
    refusal: str = ""
    refusal_for: tuple[str, ...] = ()
    # Kind -> why the idea does not fit that kind, where it is not ``refusal``'s reason.
    refusals: dict[str, str] = field(default_factory=dict, hash=False)

    def why_refused(self, kind: str) -> str:
        """Why the method refuses backbone ``kind`` (one it does not declare), in a few words; empty if unsaid."""
        if kind in self.refusals:
            return self.refusals[kind]
        if not self.refusal_for or kind in self.refusal_for:
            return self.refusal
        return "it has not been built and tested on this family yet"


_REGISTRY: dict[str, MethodSpec] = {}


def register_method(
    name: str,
    config_cls: type[MethodConfig],
    trainable_formula: Callable[[nn.Module, MethodConfig], int],
    zero_init: bool = False,
    mergeable: bool = False,
    calibrate: Callable[..., MethodConfig] | None = None,
    backbones: tuple[str, ...] = ("vit",),
    refusal: str = "",
    refusal_for: tuple[str, ...] = (),
    refusals: dict[str, str] | None = None,
) -> Callable:
    """Decorator registering ``inject(model, cfg)`` as method ``name``.

    Args:
        name: the method name used by :func:`apply`, the CLI and the benchmark.
        config_cls: its config dataclass, a subclass of :class:`MethodConfig` (the schema of its options).
        trainable_formula: closed-form count of the trainable parameters outside the head,
            given a ViT (before injection) and a config; the contract tests check it.
        zero_init: the method leaves the model's outputs unchanged at init (for every config whose
            :attr:`MethodConfig.keeps_zero_init` holds).
        mergeable: the method's wrappers can merge into the frozen weights.
        calibrate: optional ``calibrate(backbone, cfg, loader, *, progress=True) -> cfg`` that completes the
            config from the task's training images (``loader`` yields ``(images, labels)`` batches without
            augmentation) on the frozen backbone before injection; ``progress`` says whether it may show
            progress bars (``petl-run`` passes ``train.progress``).  ``petl-run`` calls it once per run and
            records the returned config; :func:`apply` does not, so Python users call it first.
        backbones: the backbone kinds (:attr:`petl.Backbone.kind`, :func:`petl.list_backbones`) the method
            supports, from what its idea needs (a flat token sequence, prefix tokens, one width, the block's
            residual halves); :func:`apply` refuses a model of another kind in one line.
        refusal: why the idea does not fit the other kinds, in a few words; the refusal and the method's docs
            page say it.
        refusal_for: the kinds ``refusal`` is about (empty: every kind not in ``backbones``); the others are
            refused as not built for yet.
        refusals: kind -> why the idea does not fit that kind, where the reason is another than ``refusal``.

    Raises:
        ValueError: ``config_cls`` is no dataclass subclass of :class:`MethodConfig`, or ``name`` is taken.

    """
    # Checked here: a config class that is no MethodConfig dataclass would only fail in petl.apply, deep in dataclasses.
    if not (
        isinstance(config_cls, type) and issubclass(config_cls, MethodConfig) and dataclasses.is_dataclass(config_cls)
    ):
        raise ValueError(
            f"register_method({name!r}): config_cls must be a @dataclass subclass of petl.MethodConfig, "
            f"got {config_cls!r}"
        )

    def decorate(inject: Callable[[nn.Module, MethodConfig], None]) -> Callable:
        if name in _REGISTRY:
            raise ValueError(f"method {name!r} is registered twice")
        _REGISTRY[name] = MethodSpec(
            name,
            config_cls,
            inject,
            trainable_formula,
            zero_init,
            mergeable,
            calibrate=calibrate,
            backbones=tuple(backbones),
            refusal=refusal,
            refusal_for=tuple(refusal_for),
            refusals=dict(refusals or {}),
        )
        return inject

    return decorate


def register_calibration(name: str, calibrate: Callable[..., MethodConfig]) -> None:
    """Give the registered method ``name`` its ``calibrate`` step (see :func:`register_method`).

    For a method whose calibration lives in a module that builds on the method's own (NOAH's search imports
    its wrappers), so that the method file need not import it back.
    """
    _REGISTRY[name] = dataclasses.replace(get_method(name), calibrate=calibrate)


def list_methods() -> list[str]:
    """Names of all registered methods, sorted."""
    return sorted(_REGISTRY)


def get_method(name: str) -> MethodSpec:
    """The registered method ``name``; a ValueError lists the valid names otherwise."""
    if not isinstance(name, str):
        # A dict or another object would otherwise fail the lookup below as an unhashable TypeError.
        raise ValueError(f"a method is named by a string, got {type(name).__name__} {name!r}: {_naming_hint(name)}")
    if name not in _REGISTRY:
        raise ValueError(f"unknown method {name!r}; choose one of: {', '.join(list_methods())}")
    return _REGISTRY[name]


def _naming_hint(method: Any) -> str:
    """What to pass instead of ``method``, which is no method name."""
    if isinstance(method, dict):
        return "give the name and unpack the options, e.g. petl.apply(model, 'lora', **options)"
    if isinstance(method, type) and issubclass(method, MethodConfig):
        return f"pass a config object, e.g. {method.__name__}(), not the class"
    return f"choose one of {', '.join(list_methods())}, or pass a method's config object"


def make_config(name: str, **options: Any) -> MethodConfig:
    """Build method ``name``'s config from keyword options, rejecting unknown keys by name."""
    spec = get_method(name)
    valid = [f.name for f in fields(spec.config_cls)]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(unknown)} for method {name!r}; valid: {', '.join(valid)}")
    return spec.config_cls(**options)


# Config objects of other libraries that ``apply`` accepts: (recogniser, converter to a petl method config).
# peft_bridge registers peft's configs; a recogniser rather than a class, so nobody imports peft to check.
_FOREIGN_CONFIGS: list[tuple[Callable[[Any], bool], Callable[..., MethodConfig]]] = []


def register_foreign_config(is_one: Callable[[Any], bool], convert: Callable[..., MethodConfig]) -> None:
    """Let :func:`apply` take objects ``is_one`` accepts; ``convert(obj, num_classes=...)`` returns a petl config."""
    _FOREIGN_CONFIGS.append((is_one, convert))


def foreign_converter(method: Any) -> Callable[..., MethodConfig] | None:
    """The converter :func:`register_foreign_config` registered for ``method``'s kind, else None."""
    return next((convert for is_one, convert in _FOREIGN_CONFIGS if is_one(method)), None)


def method_for_config(config: MethodConfig) -> str:
    """The registered method whose config class ``config`` is (as peft dispatches on a config's type).

    Raises:
        ValueError: no method, or several methods, take this config class; then pass the name.

    """
    names = [spec.name for spec in _REGISTRY.values() if type(config) is spec.config_cls]
    if not names:  # a user's subclass of a method's config
        names = [spec.name for spec in _REGISTRY.values() if isinstance(config, spec.config_cls)]
    if len(names) != 1:
        found = f"methods {', '.join(sorted(names))} all take" if names else "no registered method takes"
        raise ValueError(f"{found} a {type(config).__name__}: pass the method name: apply(model, name, cfg)")
    return names[0]
